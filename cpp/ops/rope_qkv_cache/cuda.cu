#include "ops/rope_qkv_cache/rope_qkv_cache.hpp"

#include "core/runtime.hpp"
#include "ops/common/checks.hpp"
#include "ops/common/rms_norm_rows.cuh"
#include "ops/common/rope_math.cuh"

namespace llaisys::ops::cuda {

// Error code written into runtime::cuda::error_flag (synchronize raises IndexError naming the op).
constexpr int kPositionOutOfRange = 4;

struct RopeQkvDims {
    int nh, nkvh, hd;   // q heads, k/v heads, head_dim
    int half;           // pairs (i, i + half) that turn: inv_freq's size, <= hd / 2; dims [2 half, hd) are copied
    int q_pass;         // 0 when q_out is qkv's own q part (its copied dims are already in place), else 1
    int64_t capacity;   // cache rows
    int64_t xs;         // qkv row stride (last dim contiguous)
    int64_t qs, qh;     // q_out strides over tokens and heads
    int64_t ks, kh;     // k_cache strides over positions and heads
    int64_t vs, vh;     // v_cache strides over positions and heads
};

// Cache rows of the tokens: slots [T] (i64 or i32, for a paged cache) or, without them, the positions.
struct CacheRows {
    const void *slots; // null: row = pos[t]
    bool i64;
};

// Token blockIdx.x's cache row (its slot, or its position), with the cos/sin of its `half` angles staged in
// cos_s/sin_s (rope's own evaluation, rope_math.cuh); -1 for a row outside [0, capacity): the error flag is set
// and the block writes nothing. Every thread of the block calls it (a barrier), after pdl_wait.
template <typename I>
__device__ __forceinline__ int64_t token_row(const I *pos, const CacheRows &rows, const RopeFreqs &freqs,
                                             const RopeQkvDims &d, int *error, float *cos_s, float *sin_s) {
    const int64_t t = blockIdx.x;
    const int64_t r = !rows.slots ? int64_t(pos[t])
                      : rows.i64  ? static_cast<const int64_t *>(rows.slots)[t]
                                  : int64_t(static_cast<const int32_t *>(rows.slots)[t]);
    if (r < 0 || r >= d.capacity) {
        if (threadIdx.x == 0) *error = kPositionOutOfRange;
        return -1;
    }
    for (int i = threadIdx.x; i < d.half; i += blockDim.x) rope_cos_sin(float(pos[t]), freqs.v[i], cos_s[i], sin_s[i]);
    __syncthreads();
    return r;
}

// One block per token t, p = pos[t], cache row r = slots[t] (or p): the block stages cos/sin of the
// `half` angles in shared memory (rope's own evaluation, rope_math.cuh), then its threads stride over (head,
// VEC pairs) of the q and k heads (q_out[t] and k_cache[r] get the turned pairs), over (head, VEC
// elements) of the dims a partial rotary leaves alone (copied to q_out[t] and k_cache[r]; q's skipped when
// q_out is qkv's q part) and over (head, VEC elements) of the v heads (copied to v_cache[r]). A thread reads
// what it writes first, so q_out may be qkv's q part. A row outside [0, capacity) sets the error flag and
// the block writes nothing.
template <typename T, typename I, int VEC>
__global__ void rope_qkv_cache_kernel(T *q_out, T *k_cache, T *v_cache, const T *qkv, const I *pos,
                                      const CacheRows rows, const RopeFreqs freqs, const RopeQkvDims d, int *error) {
    __shared__ float cos_s[kMaxRopePairs], sin_s[kMaxRopePairs];
    pdl_trigger(); // launched with PDL (cuda.cuh): nothing is read before the previous kernel is done
    pdl_wait();
    const int64_t t = blockIdx.x, r = token_row(pos, rows, freqs, d, error, cos_s, sin_s);
    if (r < 0) return;
    const int half = d.half;
    const T *row = qkv + t * d.xs; // [nh + 2 nkvh, hd]: q heads, k heads, v heads
    const int chunks = half / VEC, turns = (d.nh + d.nkvh) * chunks, per_v = d.hd / VEC;
    const int per_pass = (d.hd - 2 * half) / VEC, pass_heads = d.q_pass ? d.nh + d.nkvh : d.nkvh;
    const int passes = pass_heads * per_pass, items = turns + passes + d.nkvh * per_v;
    for (int j = threadIdx.x; j < items; j += blockDim.x) {
        if (j >= turns && j < turns + passes) { // a dim a partial rotary leaves alone
            const int c = j - turns, ph = c / per_pass, e0 = 2 * half + (c - ph * per_pass) * VEC;
            const int head = d.q_pass ? ph : d.nh + ph; // over q heads then k heads, or k heads alone
            T *dst = head < d.nh ? q_out + t * d.qs + head * d.qh : k_cache + r * d.ks + (head - d.nh) * d.kh;
            store_vec(dst + e0, load_vec<VEC>(row + head * d.hd + e0));
        } else if (j < turns) {
            const int head = j / chunks, i0 = (j - head * chunks) * VEC;
            T *dst = head < d.nh ? q_out + t * d.qs + head * d.qh : k_cache + r * d.ks + (head - d.nh) * d.kh;
            rope_turn_vec<VEC>(dst, row + head * d.hd, i0, half, cos_s, sin_s); // src [2 * half]
        } else {
            const int c = j - turns - passes, head = c / per_v, e0 = (c - head * per_v) * VEC;
            store_vec(v_cache + r * d.vs + head * d.vh + e0, load_vec<VEC>(row + (d.nh + d.nkvh + head) * d.hd + e0));
        }
    }
}

// The q/k norm weights [hd] (contiguous) and, for each, whether rms_norm would read that head with 16-byte
// vectors (q_wide / k_wide): the vector width decides rms_norm's summation order, so it must be rms_norm's.
template <typename T>
struct QkNorm {
    const T *q, *k;
    float eps;
    bool q_wide, k_wide;
};

// One head [hd] rms_norm'ed by one warp into buf (rounded to T), with the summation order and formula of the
// kernel rms_norm itself launches on that head (rms_norm_rows.cuh), so the bits are rms_norm's: NV-wide
// vectors (NV = 16 bytes: rms_norm_reg_kernel; NV = 1 and hd <= 64: rms_norm_kernel's warp per row) summed
// per lane in order, then warp_sum; NV = 1 and hd > 64 (rms_norm_kernel's block per row, one element a
// thread): each 32-element slice summed by warp_sum and the slice sums summed as block_sum does.
template <int NV, typename T>
__device__ __forceinline__ void norm_head(T *buf, const T *src, const T *w, int hd, float eps, int lane) {
    const int nvec = hd / NV;
    float ss;
    if (NV == 1 && nvec > 64) {
        float part = 0.f; // lane k: slice k's sum, block_sum's scratch[k]
        for (int k = 0; 32 * k < nvec; ++k) {
            const int v = 32 * k + lane;
            float s = 0.f;
            if (v < nvec) s += sum_squares(load_vec<NV>(src + int64_t(v) * NV));
            s = warp_sum(s);
            if (lane == k) part = s;
        }
        ss = warp_sum(part);
    } else {
        float s = 0.f;
        for (int v = lane; v < nvec; v += 32) s += sum_squares(load_vec<NV>(src + int64_t(v) * NV));
        ss = warp_sum(s);
    }
    const float scale = rsqrtf(ss / float(hd) + eps);
    for (int v = lane; v < nvec; v += 32) {
        const int64_t off = int64_t(v) * NV;
        store_vec(buf + off, normalized(load_vec<NV>(src + off), load_vec<NV>(w + off), scale));
    }
}

// rope_qkv_cache_kernel with the q/k norm: one block per token as there, but each warp takes whole q/k heads
// (heads warp, warp + warps, ...): norm_head into the warp's shared row, then the head turned from that row
// into q_out[t] / k_cache[r] (its unturned dims copied from it, q's too: they were normed). A warp reads all
// of a head before it writes any of it, and no other warp touches that head, so q_out may be qkv's q part.
// The v heads are copied by the whole block. Dynamic shared memory: warps * hd elements of T.
template <typename T, typename I, int VEC>
__global__ void rope_qkv_cache_norm_kernel(T *q_out, T *k_cache, T *v_cache, const T *qkv, const I *pos,
                                           const CacheRows rows, const RopeFreqs freqs, const RopeQkvDims d,
                                           const QkNorm<T> n, int *error) {
    extern __shared__ __align__(16) unsigned char heads_s[];
    __shared__ float cos_s[kMaxRopePairs], sin_s[kMaxRopePairs];
    pdl_trigger(); // launched with PDL (cuda.cuh): nothing is read before the previous kernel is done
    pdl_wait();
    const int64_t t = blockIdx.x, r = token_row(pos, rows, freqs, d, error, cos_s, sin_s);
    if (r < 0) return;
    const int half = d.half;
    const T *row = qkv + t * d.xs; // [nh + 2 nkvh, hd]: q heads, k heads, v heads
    const int lane = int(threadIdx.x % 32), warp = int(threadIdx.x / 32), warps = int(blockDim.x / 32);
    T *buf = reinterpret_cast<T *>(heads_s) + int64_t(warp) * d.hd; // 16-byte aligned whenever a wide path runs
    constexpr int kWide = 16 / int(sizeof(T));
    for (int head = warp; head < d.nh + d.nkvh; head += warps) {
        const bool is_q = head < d.nh;
        if (is_q ? n.q_wide : n.k_wide) norm_head<kWide>(buf, row + head * d.hd, is_q ? n.q : n.k, d.hd, n.eps, lane);
        else norm_head<1>(buf, row + head * d.hd, is_q ? n.q : n.k, d.hd, n.eps, lane);
        __syncwarp(); // the normed row is whole
        T *dst = is_q ? q_out + t * d.qs + head * d.qh : k_cache + r * d.ks + (head - d.nh) * d.kh;
        for (int c = lane; c < half / VEC; c += 32) rope_turn_vec<VEC>(dst, buf, c * VEC, half, cos_s, sin_s);
        for (int c = lane; c < (d.hd - 2 * half) / VEC; c += 32) {
            const int e0 = 2 * half + c * VEC;
            store_vec(dst + e0, load_vec<VEC>(buf + e0));
        }
        __syncwarp(); // buf is read out before the warp's next head overwrites it
    }
    const int per_v = d.hd / VEC;
    for (int j = threadIdx.x; j < d.nkvh * per_v; j += blockDim.x) {
        const int head = j / per_v, e0 = (j - head * per_v) * VEC;
        store_vec(v_cache + r * d.vs + head * d.vh + e0, load_vec<VEC>(row + (d.nh + d.nkvh + head) * d.hd + e0));
    }
}

// 16-byte vectors when every row start of qkv, q_out and the caches is aligned to them.
template <typename T>
static bool rows_aligned(const Tensor &q_out, const Tensor &k_cache, const Tensor &v_cache, const Tensor &qkv,
                         int64_t half) {
    const bool qkv_ok = (qkv.size(0) == 1 || qkv.stride(0) % kVec16<T> == 0) && is_aligned(qkv.data(), 16);
    return qkv_ok && rope_rows_aligned<T>(q_out, half) && rope_rows_aligned<T>(k_cache, half) &&
           rope_rows_aligned<T>(v_cache, half);
}

void rope_qkv_cache(const Tensor &q_out, const Tensor &k_cache, const Tensor &v_cache, const Tensor &qkv,
                    const Tensor &pos_ids, const Tensor &slots, const std::vector<float> &inv_freq,
                    const Tensor &q_norm, const Tensor &k_norm, float eps) {
    constexpr const char *op = "rope_qkv_cache";
    // hd <= kRopeMaxCudaHeadDim and half <= hd / 2: op.cpp checks them
    const int64_t hd = q_out.size(2), half = int64_t(inv_freq.size());
    const RopeFreqs freqs = rope_freqs(inv_freq, half);
    const bool q_in_place = q_out.data() == qkv.data() && q_out.stride(0) == qkv.stride(0) && q_out.stride(1) == hd;
    const RopeQkvDims d{int(q_out.size(1)), int(k_cache.size(1)), int(hd),          int(half),
                        q_in_place ? 0 : 1, k_cache.size(0),      qkv.stride(0),    q_out.stride(0),
                        q_out.stride(1),    k_cache.stride(0),    k_cache.stride(1), v_cache.stride(0),
                        v_cache.stride(1)};
    int *error = runtime::cuda::error_flag(qkv.device());
    const CacheRows rows{slots.defined() ? slots.data() : nullptr, slots.defined() && slots.dtype() == DType::I64};
    detail::dispatch_float(op, qkv.dtype(), qkv.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        const bool wide = rows_aligned<T>(q_out, k_cache, v_cache, qkv, half);
        detail::dispatch_index(op, pos_ids.dtype(), pos_ids.device(), [&](auto itag) {
            using I = typename decltype(itag)::type;
            dispatch_vec<T>(wide, [&](auto vec) {
                constexpr int V = decltype(vec)::value;
                if (q_norm.defined()) {
                    // rms_norm's own test on the head views of qkv (rms_norm_rows.cuh, launch_rms_norm): 16-byte
                    // vectors when hd, the view's start, the row stride (T > 1) and the weight allow them
                    const bool heads_wide = hd % kVec16<T> == 0 && is_aligned(qkv.data(), 16) &&
                                            (qkv.size(0) == 1 || qkv.stride(0) % kVec16<T> == 0);
                    const QkNorm<device_t<T>> n{dptr<T>(q_norm), dptr<T>(k_norm), eps,
                                                heads_wide && is_aligned(q_norm.data(), 16),
                                                heads_wide && is_aligned(k_norm.data(), 16)};
                    // a warp per q/k head, up to 32 and what 48 KiB of staged heads allow (each warp stages one
                    // normed head in shared memory): at batch 1 the token's one block does every head, and with 8
                    // warps Qwen3-0.6B's 24 heads took three rounds (the first A/B, session 41, ran 8 warps; this
                    // rule is not yet measured)
                    const int64_t fit = std::max<int64_t>(1, (int64_t(48) << 10) / (hd * int64_t(sizeof(T))));
                    const int64_t warps = std::min<int64_t>({32, d.nh + d.nkvh, fit});
                    launch_pdl(rope_qkv_cache_norm_kernel<device_t<T>, I, V>, unsigned(qkv.size(0)),
                               unsigned(32 * warps), size_t(warps * hd) * sizeof(T), stream_of(qkv),
                               qkv.device().index, dptr<T>(q_out), dptr<T>(k_cache), dptr<T>(v_cache), dptr<T>(qkv),
                               pos_ids.data_as<I>(), rows, freqs, d, n, error);
                    return;
                }
                // Enough threads for one pass over a token's items (80 for Qwen2-0.5B in bf16), at most 256.
                const int64_t passes = (d.q_pass ? d.nh + d.nkvh : d.nkvh) * ((hd - 2 * half) / V);
                const int64_t items = (d.nh + d.nkvh) * (half / V) + passes + d.nkvh * (hd / V);
                const int threads = int(std::min<int64_t>(256, std::max<int64_t>(32, ceil_div(items, 32) * 32)));
                launch_pdl(rope_qkv_cache_kernel<device_t<T>, I, V>, unsigned(qkv.size(0)), threads, 0, stream_of(qkv),
                           qkv.device().index, dptr<T>(q_out), dptr<T>(k_cache), dptr<T>(v_cache), dptr<T>(qkv),
                           pos_ids.data_as<I>(), rows, freqs, d, error);
            });
        });
    });
}

} // namespace llaisys::ops::cuda
