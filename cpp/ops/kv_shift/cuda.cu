#include "ops/kv_shift/kv_shift.hpp"

#include "core/runtime.hpp"
#include "ops/common/checks.hpp"
#include "ops/common/rope_math.cuh"

namespace llaisys::ops::cuda {

// Error code written into runtime::cuda::error_flag (synchronize raises IndexError naming the op).
constexpr int kRowOutOfRange = 6;

struct KvShiftDims {
    int nkvh, hd;
    int half;          // pairs (i, i + half) that turn: inv_freq's size, <= hd / 2
    int64_t capacity;  // cache rows
    int64_t ks, kh;    // k_cache strides over rows and heads
    int64_t vs, vh;    // v_cache strides over rows and heads
};

// One block per entry i (s = src[i], d = dst[i]): the block stages cos/sin of float(delta) * inv_freq
// (rope's own evaluation, rope.cuh), then its threads stride over (head, VEC pairs) of k (k_cache[d] gets
// k_cache[s] turned), over the dims a partial rotary leaves alone and over the v heads (both copied when
// d != s). A thread reads the pair it writes first, so s == d works in place. A row outside [0, capacity)
// sets the error flag and the block writes nothing.
template <typename T, typename I, int VEC>
__global__ void kv_shift_kernel(T *k_cache, T *v_cache, const I *src, const I *dst, float delta,
                                const RopeFreqs freqs, const KvShiftDims d, int *error) {
    __shared__ float cos_s[kMaxRopePairs], sin_s[kMaxRopePairs];
    const int64_t s = int64_t(src[blockIdx.x]), t = int64_t(dst[blockIdx.x]);
    if (s < 0 || s >= d.capacity || t < 0 || t >= d.capacity) {
        if (threadIdx.x == 0) *error = kRowOutOfRange;
        return;
    }
    for (int i = threadIdx.x; i < d.half; i += blockDim.x) rope_cos_sin(delta, freqs.v[i], cos_s[i], sin_s[i]);
    __syncthreads();
    const int chunks = d.half / VEC, turns = d.nkvh * chunks, per_pass = (d.hd - 2 * d.half) / VEC;
    const bool copy = s != t;
    const int passes = copy ? d.nkvh * per_pass : 0, per_v = d.hd / VEC;
    const int items = turns + passes + (copy ? d.nkvh * per_v : 0);
    for (int j = threadIdx.x; j < items; j += blockDim.x) {
        if (j < turns) {
            const int head = j / chunks, i0 = (j - head * chunks) * VEC;
            rope_turn_vec<VEC>(k_cache + t * d.ks + head * d.kh, k_cache + s * d.ks + head * d.kh, i0, d.half, cos_s,
                               sin_s);
        } else if (j < turns + passes) { // a dim a partial rotary leaves alone
            const int c = j - turns, head = c / per_pass, e0 = 2 * d.half + (c - head * per_pass) * VEC;
            store_vec(k_cache + t * d.ks + head * d.kh + e0, load_vec<VEC>(k_cache + s * d.ks + head * d.kh + e0));
        } else {
            const int c = j - turns - passes, head = c / per_v, e0 = (c - head * per_v) * VEC;
            store_vec(v_cache + t * d.vs + head * d.vh + e0, load_vec<VEC>(v_cache + s * d.vs + head * d.vh + e0));
        }
    }
}

void kv_shift(const Tensor &k_cache, const Tensor &v_cache, const Tensor &src, const Tensor &dst, int64_t delta,
              const std::vector<float> &inv_freq) {
    constexpr const char *op = "kv_shift";
    LLAISYS_CHECK(src.dtype() == dst.dtype(), std::invalid_argument, op, ": src and dst must share a dtype");
    const int64_t hd = k_cache.size(2), half = int64_t(inv_freq.size()); // op.cpp checks half and hd
    const RopeFreqs freqs = rope_freqs(inv_freq, half);
    const KvShiftDims d{int(k_cache.size(1)), int(hd),          int(half),         k_cache.size(0),
                        k_cache.stride(0),    k_cache.stride(1), v_cache.stride(0), v_cache.stride(1)};
    int *error = runtime::cuda::error_flag(k_cache.device());
    detail::dispatch_float(op, k_cache.dtype(), k_cache.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        const bool wide = rope_rows_aligned<T>(k_cache, half) && rope_rows_aligned<T>(v_cache, half);
        detail::dispatch_index(op, src.dtype(), src.device(), [&](auto itag) {
            using I = typename decltype(itag)::type;
            dispatch_vec<T>(wide, [&](auto vec) {
                constexpr int V = decltype(vec)::value;
                const int64_t items = d.nkvh * (hd / V) * 2; // an upper bound: turns + passes + v
                const int threads = int(std::min<int64_t>(256, std::max<int64_t>(32, ceil_div(items, 32) * 32)));
                kv_shift_kernel<device_t<T>, I, V><<<unsigned(src.numel()), threads, 0, stream_of(k_cache)>>>(
                    dptr<T>(k_cache), dptr<T>(v_cache), src.data_as<I>(), dst.data_as<I>(), float(delta), freqs, d,
                    error);
                CUDA_CHECK_LAUNCH();
            });
        });
    });
}

} // namespace llaisys::ops::cuda
