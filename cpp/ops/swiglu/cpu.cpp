#include "ops/swiglu/swiglu.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/cpu.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace llaisys::ops::cpu {

namespace {

// e^x for x in [-87, 88] (callers clamp): Cephes' expf (range reduction by ln 2, a degree-6 polynomial,
// 2^n from the exponent bits), ~1 ulp; NaN stays NaN. Plain arithmetic, so the loop below vectorizes:
// std::exp is a scalar libm call per element, and swiglu's 4864 of them a layer were ~1.5% of a 1-thread
// decode step of the 0.5B model (bench/RESULTS.md, session 26). CMake builds this file with
// -fno-trapping-math, without which GCC keeps the float selects as branches and the loop scalar.
inline float exp_clamped(float x) {
    const float n = std::floor(x * 1.44269504088896341f + 0.5f); // -126 <= n <= 127 for x in [-87, 88]
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.f;
    const int32_t bits = (int32_t(n) + 127) << 23; // a normal power of two
    float scale;
    std::memcpy(&scale, &bits, 4);
    return y * scale;
}

// up * silu(g) = up * g / (1 + e^-g). Beyond the clamp the quotient is what f32 gives: for g > 87,
// 1 + e^-g rounds to 1 (e^-87 < 2^-125); for g < -88, e^-g overflows and g / inf is -0 (g * 0 here;
// -inf * 0 is NaN as -inf / inf was). NaN in g or up propagates.
inline float swiglu1(float g, float u) {
    const float x = g > 87.f ? -87.f : g < -88.f ? 88.f : -g;
    const float s = g / (1.f + exp_clamped(x));
    return u * (g < -88.f ? g * 0.f : s);
}

template <typename T>
void swiglu_kernel(T *out, const T *gate, const T *up, int64_t n) {
    constexpr int64_t kChunk = 256; // elements converted to f32 at a time (T may be bf16/f16)
    parallel_ranges(n, 8, [&](int64_t begin, int64_t end) {
        for (int64_t i0 = begin; i0 < end; i0 += kChunk) {
            const int64_t m = std::min(kChunk, end - i0);
            float g[kChunk], u[kChunk], o[kChunk];
            for (int64_t j = 0; j < m; ++j) g[j] = load(gate, i0 + j), u[j] = load(up, i0 + j);
            for (int64_t j = 0; j < m; ++j) o[j] = swiglu1(g[j], u[j]);
            for (int64_t j = 0; j < m; ++j) store(out, i0 + j, o[j]);
        }
    });
}

} // namespace

void swiglu(const Tensor &out, const Tensor &gate, const Tensor &up) {
    detail::dispatch_float("swiglu", gate.dtype(), gate.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        swiglu_kernel(out.data_as<T>(), gate.data_as<T>(), up.data_as<T>(), gate.numel());
    });
}

} // namespace llaisys::ops::cpu
