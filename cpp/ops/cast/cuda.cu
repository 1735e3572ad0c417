#include "ops/cast/cast.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/cuda.cuh"

namespace llaisys::ops::cuda {

template <typename In>
__device__ __forceinline__ float load_any(In v) {
    if constexpr (std::is_integral_v<In>) return float(v);
    else return to_f32(v);
}

// Grid-stride elementwise conversion through f32.
template <typename In, typename Out>
__global__ void cast_kernel(Out *out, const In *x, int64_t n) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        out[i] = from_f32<Out>(load_any(x[i]));
}

template <typename In, typename Out>
static void launch(Out *out, const In *x, int64_t n, cudaStream_t s) {
    const int threads = 256;
    const int blocks = int(std::min<int64_t>(ceil_div(n, threads), 65535));
    cast_kernel<<<blocks, threads, 0, s>>>(out, x, n);
    CUDA_CHECK_LAUNCH();
}

void cast(const Tensor &out, const Tensor &x) {
    const int64_t n = x.numel();
    if (n == 0) return;
    const cudaStream_t s = stream_of(out);
    detail::dispatch_float("cast", out.dtype(), out.device(), [&](auto tag) {
        using Out = typename decltype(tag)::type;
        device_t<Out> *o = dptr<Out>(out);
        switch (x.dtype()) {
        case DType::F32: return launch(o, dptr<float>(x), n, s);
        case DType::F16: return launch(o, dptr<f16_t>(x), n, s);
        case DType::BF16: return launch(o, dptr<bf16_t>(x), n, s);
        case DType::I32: return launch(o, x.data_as<int32_t>(), n, s);
        case DType::I64: return launch(o, x.data_as<int64_t>(), n, s);
        default: detail::unsupported("cast", x.dtype(), x.device());
        }
    });
}

} // namespace llaisys::ops::cuda
