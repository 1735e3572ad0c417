#include "ops/swiglu/swiglu.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/cpu.hpp"

#include <cmath>

namespace llaisys::ops::cpu {

// out[i] = up[i] * silu(gate[i]) = up * g / (1 + exp(-g)), in f32, rounded once. exp(-g) overflows to
// inf for g < -88 and the quotient goes to -0 as it should; NaN propagates.
template <typename T>
static void swiglu_kernel(T *out, const T *gate, const T *up, int64_t n) {
    parallel_for(n, 8, [&](int64_t i) {
        const float g = load(gate, i);
        store(out, i, load(up, i) * (g / (1.f + std::exp(-g))));
    });
}

void swiglu(const Tensor &out, const Tensor &gate, const Tensor &up) {
    detail::dispatch_float("swiglu", gate.dtype(), gate.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        swiglu_kernel(out.data_as<T>(), gate.data_as<T>(), up.data_as<T>(), gate.numel());
    });
}

} // namespace llaisys::ops::cpu
