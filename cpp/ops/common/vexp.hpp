// e^x in plain float arithmetic, for CPU loops that must vectorize (std::exp is a scalar libm call per
// element). Files using it are built with -fno-trapping-math (CMakeLists.txt), without which GCC keeps
// the callers' float selects as branches and their loops scalar.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace llaisys::ops::cpu {

// e^x for x in [-87, 88] (callers clamp): Cephes' expf (range reduction by ln 2, a degree-6 polynomial,
// 2^n from the exponent bits), ~1 ulp; NaN stays NaN.
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

// e^d for d <= 0 (a score or logit minus its running max): 0 below -87 (e^-87 ~ 1.6e-38) and for -inf; NaN
// stays NaN. The clamp first: a vectorized select computes both sides, and exp_clamped's 2^n needs n >= -126.
inline float exp_nonpositive(float d) {
    const float y = exp_clamped(d < -87.f ? -87.f : d);
    return d < -87.f ? 0.f : y;
}

} // namespace llaisys::ops::cpu
