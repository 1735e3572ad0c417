#include "ops/swiglu/swiglu.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/swiglu_math.cuh"
#include "ops/common/vec.cuh"

namespace llaisys::ops::cuda {

// Grid-stride over VEC-element vectors (16-byte loads when all three pointers are aligned), then the
// n % VEC tail elements one per thread. Block: 256 threads. out may alias gate or up.
template <typename T, int VEC>
__global__ void swiglu_kernel(T *out, const T *gate, const T *up, int64_t n) {
    const int64_t tid = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
    const int64_t nvec = n / VEC;
    for (int64_t v = tid; v < nvec; v += stride) {
        const Vec<T, VEC> g = load_vec<VEC>(gate + v * VEC), u = load_vec<VEC>(up + v * VEC);
        Vec<T, VEC> o;
#pragma unroll
        for (int j = 0; j < VEC; ++j) o.v[j] = from_f32<T>(swiglu_f32(to_f32(g.v[j]), to_f32(u.v[j])));
        store_vec(out + v * VEC, o);
    }
    for (int64_t i = nvec * VEC + tid; i < n; i += stride)
        out[i] = from_f32<T>(swiglu_f32(to_f32(gate[i]), to_f32(up[i])));
}

void swiglu(const Tensor &out, const Tensor &gate, const Tensor &up) {
    const int64_t n = gate.numel();
    detail::dispatch_float("swiglu", gate.dtype(), gate.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        const bool wide = is_aligned(out.data(), 16) && is_aligned(gate.data(), 16) && is_aligned(up.data(), 16);
        dispatch_vec<T>(wide, [&](auto vec) {
            constexpr int V = decltype(vec)::value;
            const int threads = 256;
            const int blocks = int(std::min<int64_t>(ceil_div(std::max<int64_t>(n / V, 1), threads), 65535));
            swiglu_kernel<device_t<T>, V><<<blocks, threads, 0, stream_of(out)>>>(dptr<T>(out), dptr<T>(gate),
                                                                                  dptr<T>(up), n);
            CUDA_CHECK_LAUNCH();
        });
    });
}

} // namespace llaisys::ops::cuda
