#include "ops/gelu/gelu.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/cpu.hpp"

#include <cmath>

namespace llaisys::ops::cpu {

// x * Phi(x) in f32, the formulas of gelu.cuh (the CUDA kernels): erf form with erfc (no cancellation in
// the negative tail), or TANH, torch's approximate="tanh". -inf gives NaN in both, as torch.
template <bool TANH>
static inline float gelu_f32(float x) {
    if constexpr (TANH) {
        constexpr float kSqrt2OverPi = 0.7978845608028654f;
        return 0.5f * x * (1.f + std::tanh(kSqrt2OverPi * (x + 0.044715f * x * x * x)));
    } else {
        return 0.5f * x * std::erfc(-x * 0.7071067811865476f);
    }
}

// out[i] = gelu(x[i]) (* up[i] when up is given: GeGLU), in f32, rounded once. out may alias x or up.
template <typename T, bool TANH>
static void gelu_kernel(T *out, const T *x, const T *up, int64_t n) {
    if (up)
        parallel_for(n, 16, [&](int64_t i) { store(out, i, gelu_f32<TANH>(load(x, i)) * load(up, i)); });
    else
        parallel_for(n, 16, [&](int64_t i) { store(out, i, gelu_f32<TANH>(load(x, i))); });
}

void gelu(const Tensor &out, const Tensor &x, const Tensor &up, bool tanh_approx) {
    const char *op = up.defined() ? "geglu" : "gelu";
    detail::dispatch_float(op, x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        T *o = out.data_as<T>();                                 // [n]
        const T *xp = x.data_as<T>();                            // [n]
        const T *u = up.defined() ? up.data_as<T>() : nullptr;   // [n] or null
        if (tanh_approx) gelu_kernel<T, true>(o, xp, u, x.numel());
        else gelu_kernel<T, false>(o, xp, u, x.numel());
    });
}

} // namespace llaisys::ops::cpu
