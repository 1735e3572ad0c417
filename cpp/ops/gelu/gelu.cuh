// The GELU formulas on the device, in one place for the gelu/geglu kernels and any kernel that fuses
// them later (a GEMV with a GeGLU epilogue), so that the fused and unfused paths round alike.
#pragma once

namespace llaisys::ops::cuda {

// x * Phi(x) in f32. Erf form: Phi(x) = erfc(-x / sqrt 2) / 2 (erfc, not 1 + erf: no cancellation in the
// negative tail). TANH (torch's approximate="tanh"): 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))); x^3
// may overflow to inf, where tanh saturates to +-1 as it should. -inf gives NaN (-inf * 0) in both, as torch.
template <bool TANH>
__device__ __forceinline__ float gelu_f32(float x) {
    if constexpr (TANH) {
        constexpr float kSqrt2OverPi = 0.7978845608028654f;
        return 0.5f * x * (1.f + tanhf(kSqrt2OverPi * (x + 0.044715f * x * x * x)));
    } else {
        return 0.5f * x * erfcf(-x * 0.7071067811865476f);
    }
}

} // namespace llaisys::ops::cuda
