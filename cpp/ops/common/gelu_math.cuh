// The GELU formulas on the device, in one place for the gelu/geglu kernels and the GEMV epilogues that
// fuse them (linear_geglu, linear_gelu), so that the fused and unfused paths round alike.
#pragma once

namespace llaisys::ops::cuda {

// x * Phi(x) in f32. Erf form: Phi(x) = erfc(-x / sqrt 2) / 2 (erfc, not 1 + erf: no cancellation in the
// negative tail). TANH (torch's approximate="tanh"): 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3),
// computed as the equal x / (1 + e^(-2u)): 1 + tanh(u) cancels for negative x (in f32 up to 13x off for x in
// [-6, -3]); this keeps ~1e-5 relative error everywhere (the CPU kernel's form); x^3 may overflow to inf,
// where e^(-2u) goes to 0 or inf as it should. -inf gives NaN in both forms (-inf * 0, -inf / inf), as torch.
template <bool TANH>
__device__ __forceinline__ float gelu_f32(float x) {
    if constexpr (TANH) {
        constexpr float kSqrt2OverPi = 0.7978845608028654f;
        return x / (1.f + expf(-2.f * kSqrt2OverPi * (x + 0.044715f * x * x * x)));
    } else {
        return 0.5f * x * erfcf(-x * 0.7071067811865476f);
    }
}

} // namespace llaisys::ops::cuda
