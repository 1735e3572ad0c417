// Helpers shared by CUDA kernels: error checks, launch math, type mapping and warp/block reductions.
#pragma once
#include "llaisys/common.hpp"
#include "llaisys/dtype.hpp"
#include "llaisys/stream.hpp"
#include "llaisys/tensor.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <utility>

#define CUDA_CHECK(expr)                                                                               \
    do {                                                                                               \
        cudaError_t err_ = (expr);                                                                     \
        if (err_ != cudaSuccess)                                                                       \
            throw std::runtime_error(::llaisys::detail::concat("CUDA error ", cudaGetErrorString(err_), \
                                                               " at ", __FILE__, ":", __LINE__));      \
    } while (0)

// Checks the launch itself (bad configuration); asynchronous faults surface at the next synchronize.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

namespace llaisys::ops::cuda {

inline cudaStream_t stream_of(const Tensor &t) {
    return static_cast<cudaStream_t>(current_stream(t.device()).handle());
}

__host__ __device__ constexpr inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Streaming multiprocessors of a device, cached per device (cuda.cu); 132 for an index past 63.
int sm_count(int device);

// ---- Programmatic dependent launch (PDL, compute capability 9.0+) ----
// A decode step is ~220 short kernels in a row; each one's start (launch, block scheduling, first
// loads) would otherwise wait for the previous one to drain. A kernel started with launch_pdl may begin
// while the kernel before it on the stream is still running, so it must call pdl_wait() - in every
// block, before any early return - before it touches memory another kernel writes or reads: only inputs
// no kernel writes any more may be read before it (weights the caller declared constant, as linear's
// constant_weight; every PDL kernel triggers at its start, so several kernels ahead may still be
// running). A prefetch into L2 returns no data and is safe on any address. pdl_trigger() lets the next
// PDL kernel start (it fires once every block of this grid has called it or exited). Both are no-ops
// below sm_90 and for kernels launched the ordinary way. LLAISYS_PDL=0 in the environment turns
// launch_pdl into an ordinary launch.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
bool pdl_enabled(int device); // compute capability >= 9 and LLAISYS_PDL != "0" (cuda.cu)

template <typename... Params, typename... Args>
void launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, int device,
                Args &&...args) {
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = &attr;
    cfg.numAttrs = pdl_enabled(device) ? 1 : 0;
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// Storage type on the device for each host storage type.
template <typename T>
struct device_type;
template <>
struct device_type<float> {
    using type = float;
};
template <>
struct device_type<f16_t> {
    using type = __half;
};
template <>
struct device_type<bf16_t> {
    using type = __nv_bfloat16;
};
template <typename T>
using device_t = typename device_type<T>::type;

template <typename T>
inline device_t<T> *dptr(const Tensor &t) { return reinterpret_cast<device_t<T> *>(t.data()); }

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block; every thread gets the result. `scratch` holds 32 floats; blockDim.x % 32 == 0.
__device__ __forceinline__ float block_sum(float v, float *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads(); // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0.f;
    return warp_sum(v);
}
__device__ __forceinline__ float block_max(float v, float *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : -INFINITY;
    return warp_max(v);
}

} // namespace llaisys::ops::cuda
