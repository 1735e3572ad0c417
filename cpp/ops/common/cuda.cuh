// Helpers shared by CUDA kernels: error checks, launch math, type mapping and warp/block reductions.
#pragma once
#include "llaisys/common.hpp"
#include "llaisys/dtype.hpp"
#include "llaisys/stream.hpp"
#include "llaisys/tensor.hpp"
#include "ops/common/checks.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
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

// Opts Kernel into `bytes` of dynamic shared memory (required above 48 KB), once per device.
template <auto Kernel>
void opt_in_smem(size_t bytes, int device) {
    static std::atomic<uint64_t> done{0};
    const uint64_t bit = uint64_t(1) << (device & 63);
    if (done.load(std::memory_order_acquire) & bit) return;
    CUDA_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    done.fetch_or(bit, std::memory_order_release);
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

// Grid-stride over ids [B, n], one thread per id; logits [B, V] with strides (s0, s1): the logit of the
// id at flat position k becomes f(logit, k). Padding (-1) and ids outside [0, V) are skipped (a host
// check would need a sync). Ids are distinct per row, so no two threads touch one logit.
template <typename T, typename F>
__global__ void update_logits_at_ids_kernel(T *logits, int64_t s0, int64_t s1, int64_t V, const int64_t *ids,
                                            int64_t n, int64_t total, F f) {
    for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < total; k += int64_t(gridDim.x) * blockDim.x) {
        const int64_t id = ids[k];
        if (id < 0 || id >= V) continue;
        T *p = logits + (k / n) * s0 + id * s1;
        *p = from_f32<T>(f(to_f32(*p), k));
    }
}

// The body of logit_bias and repetition_penalty: logits [B, V] (any strides, updated in place), ids
// [B, n] (contiguous i64); F is a functor with `__device__ float operator()(float logit, int64_t k)`.
template <typename F>
void update_logits_at_ids(const char *op, const Tensor &logits, const Tensor &ids, F f) {
    const int64_t total = ids.numel(), n = ids.size(1);
    detail::dispatch_float(op, logits.dtype(), logits.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        const int threads = 256;
        const int blocks = int(std::min<int64_t>(ceil_div(total, threads), 4096));
        update_logits_at_ids_kernel<<<blocks, threads, 0, stream_of(logits)>>>(
            dptr<T>(logits), logits.stride(0), logits.stride(1), logits.size(1), ids.data_as<int64_t>(), n, total, f);
        CUDA_CHECK_LAUNCH();
    });
}

} // namespace llaisys::ops::cuda
