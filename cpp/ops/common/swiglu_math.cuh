// The SwiGLU formula on the device, shared by the swiglu op and the GEMV epilogues that fuse it
// (linear_swiglu, quant_linear_swiglu): one definition keeps linear_swiglu equal to linear + linear +
// swiglu bit for bit.
#pragma once

namespace llaisys::ops::cuda {

// up * silu(g) in f32; expf (not __expf) keeps f32 accuracy for |g| up to ~88, where exp(-g) overflows
// and the quotient correctly goes to -0.
__device__ __forceinline__ float swiglu_f32(float g, float u) { return u * (g / (1.f + expf(-g))); }

} // namespace llaisys::ops::cuda
