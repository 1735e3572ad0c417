#include "ops/gelu/gelu.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/vec.cuh"
#include "ops/common/gelu_math.cuh"

namespace llaisys::ops::cuda {

namespace {

// out = gelu(x) (* up when GATED), rounded once from f32.
template <bool TANH, bool GATED, typename T>
__device__ __forceinline__ T gelu_one(T x, T up) {
    const float g = gelu_f32<TANH>(to_f32(x));
    return from_f32<T>(GATED ? g * to_f32(up) : g);
}

// Grid-stride over VEC-element vectors (16-byte loads when every pointer is aligned), then the n % VEC
// tail elements one per thread. Block: 256 threads. up is null unless GATED. out may alias x or up.
template <typename T, int VEC, bool TANH, bool GATED>
__global__ void gelu_kernel(T *out, const T *x, const T *up, int64_t n) {
    const int64_t tid = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
    const int64_t nvec = n / VEC;
    for (int64_t v = tid; v < nvec; v += stride) {
        const Vec<T, VEC> a = load_vec<VEC>(x + v * VEC);
        Vec<T, VEC> u, o;
        if constexpr (GATED) u = load_vec<VEC>(up + v * VEC);
#pragma unroll
        for (int j = 0; j < VEC; ++j) o.v[j] = gelu_one<TANH, GATED>(a.v[j], GATED ? u.v[j] : a.v[j]);
        store_vec(out + v * VEC, o);
    }
    for (int64_t i = nvec * VEC + tid; i < n; i += stride)
        out[i] = gelu_one<TANH, GATED>(x[i], GATED ? up[i] : x[i]);
}

template <typename T, int VEC, bool TANH>
void launch(const Tensor &out, const Tensor &x, const Tensor &up) {
    const int64_t n = x.numel();
    const int threads = 256;
    const int blocks = int(std::min<int64_t>(ceil_div(std::max<int64_t>(n / VEC, 1), threads), 65535));
    using DT = device_t<T>;
    if (up.defined())
        gelu_kernel<DT, VEC, TANH, true><<<blocks, threads, 0, stream_of(out)>>>(dptr<T>(out), dptr<T>(x), dptr<T>(up), n);
    else
        gelu_kernel<DT, VEC, TANH, false><<<blocks, threads, 0, stream_of(out)>>>(dptr<T>(out), dptr<T>(x), nullptr, n);
    CUDA_CHECK_LAUNCH();
}

} // namespace

void gelu(const Tensor &out, const Tensor &x, const Tensor &up, bool tanh_approx) {
    const char *op = up.defined() ? "geglu" : "gelu";
    detail::dispatch_float(op, x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        const bool wide = is_aligned(out.data(), 16) && is_aligned(x.data(), 16) &&
                          (!up.defined() || is_aligned(up.data(), 16));
        dispatch_vec<T>(wide, [&](auto vec) {
            constexpr int V = decltype(vec)::value;
            if (tanh_approx) launch<T, V, true>(out, x, up);
            else launch<T, V, false>(out, x, up);
        });
    });
}

} // namespace llaisys::ops::cuda
