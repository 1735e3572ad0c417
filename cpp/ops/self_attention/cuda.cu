// Causal GQA attention on CUDA: a flash-attention-2 style tensor-core kernel for f16/bf16 prefill with
// head dim 64 or 128, and a split-KV ("flash-decoding") kernel on CUDA cores for decode and everything
// else (f32, other head dims, unaligned views), followed by a combine kernel when the keys were split.
// Softmax runs in base 2 (scores pre-multiplied by scale * log2 e) with f32 running max/sum.
#include "ops/self_attention/self_attention.hpp"

#include "core/runtime.hpp"
#include "ops/common/checks.hpp"
#include "ops/common/cuda.cuh"
#include "ops/common/flash_tc.cuh"
#include "ops/common/split_kv.cuh"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace llaisys::ops::cuda {

namespace {

// One call's operands; strides in elements. Row i of head h of x starts at x + i * x_s0 + h * x_s1 and
// its head-dim elements are contiguous.
template <typename T>
struct AttnArgs {
    T *out;
    const T *q, *k, *v;
    int64_t q_s0, q_s1, k_s0, k_s1, v_s0, v_s1, o_s0, o_s1;
    int qlen, kvlen, nh, nkvh, hd, hd_v;
    float scale_log2;     // scale * log2(e)
    const void *kvlen_dev; // self_attention_cached: [1] i64/i32 length on the device; kvlen is the capacity
    bool kvlen_i64;
    int *error; // device error flag, set when *kvlen_dev is out of [qlen, capacity]
};

constexpr int kErrKvLenOutOfRange = 3; // code in runtime::cuda::error_flag

// The args with the kvlen of this launch: the host's, or the device-held length of
// self_attention_cached clamped into [qlen, capacity] (an out-of-range length is reported through the
// device error flag, which raises at the next synchronize). Reading it here keeps a captured CUDA graph
// valid for every length.
template <typename T>
__device__ __forceinline__ AttnArgs<T> resolve_kvlen(const AttnArgs<T> &args) {
    AttnArgs<T> a = args;
    if (!a.kvlen_dev) return a;
    const int64_t len =
        a.kvlen_i64 ? *static_cast<const int64_t *>(a.kvlen_dev) : *static_cast<const int32_t *>(a.kvlen_dev);
    if (len < a.qlen || len > a.kvlen) {
        if (threadIdx.x == 0) *a.error = kErrKvLenOutOfRange;
        a.kvlen = len < a.qlen ? a.qlen : a.kvlen;
    } else {
        a.kvlen = int(len);
    }
    return a;
}

__device__ __forceinline__ int group_of(int nh, int nkvh) { return nh / nkvh; }

// ---------------------------------------------------------------------------------------------
// Tensor-core prefill (tile math, Q fragments, key loop and row store: ops/common/flash_tc.cuh)
// ---------------------------------------------------------------------------------------------

using namespace flash_tc;

// Starts copying rows [row0, row0 + ROWS) of one head (row r at g + r * s0, HD contiguous elements)
// into the smem tile [ROWS][HD + 8]. Rows >= nrows are zero-filled and never read from global memory.
template <int ROWS, int HD, typename T>
__device__ __forceinline__ void load_tile_async(T *tile, const T *g, int64_t s0, int row0, int nrows) {
    constexpr int chunks = HD / 8, threads = kTcWarps * 32; // 16-byte chunks per row
    static_assert(ROWS * chunks % threads == 0, "tile copy must split evenly over the block");
#pragma unroll
    for (int i = 0; i < ROWS * chunks / threads; ++i) {
        const int c = i * threads + threadIdx.x, r = c / chunks, col = (c % chunks) * 8;
        const bool valid = row0 + r < nrows;
        cp_async16(tile + r * tc_pitch<HD>() + col, valid ? g + int64_t(row0 + r) * s0 + col : g, valid);
    }
}

// Flash-attention-2 prefill on tensor cores. Grid (nh, ceil(qlen / 64)), 128 threads: a block owns 64
// queries of one head (warp w: rows 16w..16w+15, Q fragments kept in registers) and walks the K/V
// tiles of 64 keys up to the last key its queries see (later tiles are never visited). Dynamic smem:
// Q [64][HD+8], K [64][HD+8], V [64][HD+8]. V_t streams in (cp.async) during S = Q K_t^T and K_{t+1}
// during softmax and O += P V_t; the barriers around each copy keep every smem reuse race-free.
template <typename T, int HD>
__global__ void __launch_bounds__(kTcWarps * 32) attn_prefill_tc_kernel(const AttnArgs<T> args) {
    extern __shared__ __align__(16) unsigned char tc_smem[];
    const AttnArgs<T> a = resolve_kvlen(args);
    T *qs = reinterpret_cast<T *>(tc_smem), *ks = qs + kTcBQ * tc_pitch<HD>(), *vs = ks + kTcBK * tc_pitch<HD>();
    const int h = blockIdx.x, i0 = (gridDim.y - 1 - blockIdx.y) * kTcBQ; // latest (heaviest) blocks first
    const int kvh = h / group_of(a.nh, a.nkvh), off = a.kvlen - a.qlen, warp = threadIdx.x / 32,
              lane = threadIdx.x % 32;
    const T *kg = a.k + kvh * a.k_s1, *vg = a.v + kvh * a.v_s1;
    const int kv_end = min(a.kvlen, min(i0 + kTcBQ, a.qlen) + off); // keys seen by the block's last query
    const int ntiles = (kv_end + kTcBK - 1) / kTcBK;

    load_tile_async<kTcBQ, HD>(qs, a.q + h * a.q_s1, a.q_s0, i0, a.qlen);
    load_tile_async<kTcBK, HD>(ks, kg, a.k_s0, 0, kv_end);
    uint32_t qf[HD / 16][4];
    load_q_frags<T, HD>(qf, qs, warp, lane);
    const int row0 = i0 + warp * 16 + lane / 4; // this thread's rows: row0 and row0 + 8
    float o[HD / 8][4], l[2];
    attend_tiles<T, HD>(o, l, qf, ks, vs, ntiles, row0 + off, a.kvlen, a.scale_log2, lane,
                        [&](int j0) { load_tile_async<kTcBK, HD>(ks, kg, a.k_s0, j0, kv_end); },
                        [&](int j0) { load_tile_async<kTcBK, HD>(vs, vg, a.v_s0, j0, kv_end); });
    store_rows<T, HD>(a.out + h * a.o_s1, a.o_s0, row0, a.qlen, lane, o, l);
}

template <typename T, int HD>
void launch_prefill_tc(const AttnArgs<T> &a, int device, cudaStream_t stream) {
    constexpr size_t smem = tc_smem_bytes<HD>();
    opt_in_smem<attn_prefill_tc_kernel<T, HD>>(smem, device);
    const dim3 grid(unsigned(a.nh), unsigned(ceil_div(a.qlen, kTcBQ)));
    attn_prefill_tc_kernel<T, HD><<<grid, kTcWarps * 32, smem, stream>>>(a);
    CUDA_CHECK_LAUNCH();
}


// ---------------------------------------------------------------------------------------------
// Split-KV attention on CUDA cores: decode, short chunks, f32, any head dim <= 256, unaligned views
// ---------------------------------------------------------------------------------------------

using split_kv::kRows;
using split_kv::kThreads;
using split_kv::kTile;
constexpr int kSplitMaxDim = int(attention_detail::kCudaMaxHeadDim); // checked in check_args

// Shared-memory layout of the split kernel in bytes, shared by host and device code: split_kv's head
// (q, red, p) | K tile | V tile; after the key loop the key groups' accumulators f32 [groups][8][hd_v]
// reuse the K/V tile space.
struct SplitSmem : split_kv::Layout {
    __host__ __device__ int k_off() const { return (p_end() + 15) / 16 * 16; }
    __host__ __device__ int v_off() const { return k_off() + kTile * k_pitch(); }
    __host__ __device__ int bytes() const {
        const int tiles = kTile * (k_pitch() + v_pitch()), merge = groups() * kRows * hd_v * 4;
        return k_off() + (tiles > merge ? tiles : merge);
    }
};

template <typename T>
__device__ __forceinline__ split_kv::Rows split_rows(const AttnArgs<T> &a, int kvh, int first) {
    split_kv::Rows rows;
    rows.first = first;
    rows.group = group_of(a.nh, a.nkvh);
    rows.kvh = kvh;
    rows.n = min(kRows, a.qlen * rows.group - first);
    const int off = a.kvlen - a.qlen;
#pragma unroll
    for (int r = 0; r < kRows; ++r) rows.lim[r] = r < rows.n ? min(rows.qi(r) + off, a.kvlen - 1) : -1;
    rows.last_key = min(rows.qi(rows.n - 1) + off, a.kvlen - 1); // rows go by query
    return rows;
}

// Starts staging keys [t0, t0 + n) of kv head kvh: K rows into ks, V rows into vs. VEC (16-byte aligned
// rows of a multiple of 16 bytes): every copy in flight at once through cp.async (finished by
// split_wait_tile); otherwise element by element, done on return.
template <typename T, bool VEC>
__device__ __forceinline__ void split_issue_tile(const AttnArgs<T> &a, const SplitSmem &lay, unsigned char *ks,
                                                 unsigned char *vs, int kvh, int t0, int n) {
    const T *kg = a.k + kvh * a.k_s1 + int64_t(t0) * a.k_s0, *vg = a.v + kvh * a.v_s1 + int64_t(t0) * a.v_s0;
    if constexpr (VEC) {
        constexpr int per16 = 16 / sizeof(T);
        const int kc = a.hd / per16, vc = a.hd_v / per16; // 16-byte chunks per row
        for (int i = threadIdx.x; i < n * kc; i += kThreads)
            cp_async16(ks + (i / kc) * lay.k_pitch() + (i % kc) * 16, kg + (i / kc) * a.k_s0 + (i % kc) * per16, true);
        for (int i = threadIdx.x; i < n * vc; i += kThreads)
            cp_async16(vs + (i / vc) * lay.v_pitch() + (i % vc) * 16, vg + (i / vc) * a.v_s0 + (i % vc) * per16, true);
        cp_async_commit();
    } else {
#pragma unroll 4
        for (int i = threadIdx.x; i < n * a.hd; i += kThreads)
            reinterpret_cast<T *>(ks + (i / a.hd) * lay.k_pitch())[i % a.hd] = kg[(i / a.hd) * a.k_s0 + i % a.hd];
#pragma unroll 4
        for (int i = threadIdx.x; i < n * a.hd_v; i += kThreads)
            reinterpret_cast<T *>(vs + (i / a.hd_v) * lay.v_pitch())[i % a.hd_v] =
                vg[(i / a.hd_v) * a.v_s0 + i % a.hd_v];
    }
}

// Waits for this thread's copies; the barrier makes every thread's smem writes visible.
__device__ __forceinline__ void split_wait_tile() {
    cp_async_wait_all();
    __syncthreads();
}

// Sums the key groups' accumulators and the row sums, then writes each row to out (one chunk) or as a
// partial (acc [hd_v], m, l) for attn_combine_kernel.
template <typename T, int DPT>
__device__ __forceinline__ void split_finish(const AttnArgs<T> &a, const SplitSmem &lay, const split_kv::Rows &rows,
                                             unsigned char *smem, const split_kv::State<DPT> &st, float *part) {
    float *red = reinterpret_cast<float *>(smem + lay.red_off()), *merge = reinterpret_cast<float *>(smem + lay.k_off());
    split_kv::merge_groups(lay, st, red, merge); // the K/V tiles are free: the key loop ended on a barrier
    const int pitch = a.hd_v + 2;
    for (int idx = threadIdx.x; idx < rows.n * a.hd_v; idx += kThreads) {
        const int r = idx / a.hd_v, d = idx % a.hd_v;
        const float l = split_kv::row_sum(red, r), m = split_kv::row_max(red, r);
        const float acc = split_kv::row_acc(lay, merge, r, d);
        if (gridDim.z == 1) {
            a.out[rows.qi(r) * a.o_s0 + rows.h(r) * a.o_s1 + d] = from_f32<T>(acc / l);
        } else { // part [chunk][qlen * nh][hd_v + 2]
            float *dst = part + (int64_t(blockIdx.z) * a.qlen * a.nh + rows.qi(r) * a.nh + rows.h(r)) * pitch;
            dst[d] = acc;
            if (d == 0) {
                dst[a.hd_v] = m;
                dst[a.hd_v + 1] = l;
            }
        }
    }
}

// Split-KV attention ("flash-decoding"). Grid (ceil(qlen * group / 8), nkvh, nchunks), 128 threads,
// dynamic smem per SplitSmem. A block takes 8 rows (query, head) of one GQA group - every K/V row it
// stages serves all of them - and walks the keys of chunk blockIdx.z that they may see in tiles of 64:
// stage K/V (cp.async), scores and softmax (thread = key), P @ V (thread = output dim). With one chunk
// it writes out directly; otherwise attn_combine_kernel merges the chunks' partials.
template <typename T, int DPT, bool VEC>
__global__ void __launch_bounds__(kThreads) attn_split_kernel(const AttnArgs<T> args, int chunk, float *part) {
    extern __shared__ __align__(16) unsigned char split_smem[];
    const AttnArgs<T> a = resolve_kvlen(args);
    const SplitSmem lay{{a.hd, a.hd_v, int(sizeof(T))}};
    float *qs = reinterpret_cast<float *>(split_smem), *red = reinterpret_cast<float *>(split_smem + lay.red_off()),
          *ps = reinterpret_cast<float *>(split_smem + lay.p_off());
    unsigned char *ks = split_smem + lay.k_off(), *vs = split_smem + lay.v_off();
    const split_kv::Rows rows = split_rows(a, blockIdx.y, blockIdx.x * kRows);
    const int kb = blockIdx.z * chunk, ke = min(kb + chunk, rows.last_key + 1);
    if (kb < ke) split_issue_tile<T, VEC>(a, lay, ks, vs, blockIdx.y, kb, min(kTile, ke - kb)); // overlaps q
#pragma unroll 8 // independent loads: let them be in flight together
    for (int idx = threadIdx.x; idx < kRows * a.hd; idx += kThreads) { // padding rows are 0
        const int r = idx / a.hd, d = idx % a.hd;
        qs[idx] = r < rows.n ? to_f32(a.q[rows.qi(r) * a.q_s0 + rows.h(r) * a.q_s1 + d]) * a.scale_log2 : 0.f;
    }
    split_kv::State<DPT> st;
    st.reset();
    for (int t0 = kb; t0 < ke; t0 += kTile) {
        const int n = min(kTile, ke - t0);
        if (t0 > kb) split_issue_tile<T, VEC>(a, lay, ks, vs, blockIdx.y, t0, n);
        split_wait_tile(); // the tile (and, the first time, qs) is in smem for every thread
        split_kv::softmax_tile<T, DPT, VEC>(lay, rows, qs, ks, red, ps, t0, n, st);
        split_kv::pv_tile<T, DPT>(lay, rows, vs, ps, t0, n, st);
        __syncthreads(); // the next tile overwrites ks, vs, ps and red
    }
    split_finish<T, DPT>(a, lay, rows, split_smem, st, part);
}

constexpr int kCombineThreads = 256;
constexpr int kCombineMaxChunks = 256; // launch_split never makes more (2 * SMs)

// Merges the split-KV partials of one output row. Grid (qlen * nh), 256 threads. The chunks' (m, l) are
// read in parallel into smem and their weights 2^(m_c - max) computed once; then thread (chunk group,
// dim) sums its chunks and the groups are added through smem. Chunks past the (device-held) kvlen hold
// nothing and are skipped. Every global read is independent, so the kernel pays about two memory
// latencies, not one per chunk.
template <typename T>
__global__ void __launch_bounds__(kCombineThreads) attn_combine_kernel(const AttnArgs<T> args, const float *part,
                                                                      int nchunks, int chunk) {
    __shared__ float wt[kCombineMaxChunks], red[32];
    __shared__ float sums[kCombineThreads];
    const AttnArgs<T> a = resolve_kvlen(args);
    const int row = blockIdx.x, pitch = a.hd_v + 2, used = min(nchunks, (a.kvlen + chunk - 1) / chunk);
    const int64_t stride = int64_t(a.qlen) * a.nh * pitch; // between chunks
    const float *p0 = part + int64_t(row) * pitch;
    float m = -INFINITY, l = 0.f;
    for (int c = threadIdx.x; c < used; c += kCombineThreads) m = fmaxf(m, p0[c * stride + a.hd_v]);
    const float mx = block_max(m, red);
    for (int c = threadIdx.x; c < used; c += kCombineThreads) {
        wt[c] = exp2f(p0[c * stride + a.hd_v] - mx); // an empty chunk (m = -inf) weighs 0
        l += wt[c] * p0[c * stride + a.hd_v + 1];
    }
    const float inv = 1.f / block_sum(l, red); // block_sum's barriers also publish wt
    const int dims = a.hd_v < kCombineThreads ? a.hd_v : kCombineThreads;
    const int groups = kCombineThreads / dims, g = threadIdx.x / dims;
    T *dst = a.out + (row / a.nh) * a.o_s0 + (row % a.nh) * a.o_s1;
    for (int d0 = 0; d0 < a.hd_v; d0 += dims) {
        const int d = d0 + threadIdx.x % dims;
        float acc = 0.f;
        if (g < groups && d < a.hd_v)
#pragma unroll 8
            for (int c = g; c < used; c += groups) acc += wt[c] * p0[c * stride + d];
        __syncthreads(); // sums is reused across d0 steps
        sums[threadIdx.x] = acc;
        __syncthreads();
        if (threadIdx.x < dims && d < a.hd_v) {
            for (int j = 1; j < groups; ++j) acc += sums[j * dims + threadIdx.x];
            dst[d] = from_f32<T>(acc * inv);
        }
    }
}

// Splits the keys until about two blocks per SM are busy (decode); prefill has rows enough already.
// With a device-held length the split is planned for the capacity, so a captured graph fits any length.
template <typename T, int DPT, bool VEC>
void launch_split(const AttnArgs<T> &a, Device device, cudaStream_t stream) {
    const int row_blocks = int(ceil_div(int64_t(a.qlen) * (a.nh / a.nkvh), kRows)), blocks = row_blocks * a.nkvh;
    const int64_t want = std::min<int64_t>(2 * int64_t(sm_count(device.index)), kCombineMaxChunks);
    const int64_t max_chunks = ceil_div(a.kvlen, kTile);
    const int64_t chunks = blocks >= want ? 1 : std::min(ceil_div(want, blocks), max_chunks);
    const int chunk = int(ceil_div(ceil_div(a.kvlen, chunks), kTile) * kTile);
    const int nchunks = int(ceil_div(a.kvlen, chunk));
    Tensor part;
    if (nchunks > 1) part = Tensor::empty(Shape{int64_t(nchunks) * a.qlen * a.nh * (a.hd_v + 2)}, DType::F32, device);
    const int elem = int(sizeof(T));
    opt_in_smem<attn_split_kernel<T, DPT, VEC>>(size_t(SplitSmem{{kSplitMaxDim, kSplitMaxDim, elem}}.bytes()), device.index);
    const dim3 grid(unsigned(row_blocks), unsigned(a.nkvh), unsigned(nchunks));
    float *pp = nchunks > 1 ? part.data_as<float>() : nullptr;
    attn_split_kernel<T, DPT, VEC><<<grid, kThreads, SplitSmem{{a.hd, a.hd_v, elem}}.bytes(), stream>>>(a, chunk, pp);
    CUDA_CHECK_LAUNCH();
    if (nchunks > 1) {
        attn_combine_kernel<T><<<unsigned(a.qlen * a.nh), kCombineThreads, 0, stream>>>(a, pp, nchunks, chunk);
        CUDA_CHECK_LAUNCH();
    }
}

// 16-byte aligned row starts (pointer and both strides) for cp.async; `row_bytes` must be a multiple too.
bool aligned16(const Tensor &t, int64_t row_bytes) {
    const int64_t e = int64_t(t.element_size());
    return reinterpret_cast<uintptr_t>(t.data()) % 16 == 0 && (t.stride(0) * e) % 16 == 0 &&
           (t.stride(1) * e) % 16 == 0 && row_bytes % 16 == 0;
}

template <typename T>
void run_split(const AttnArgs<T> &a, const Tensor &k, const Tensor &v, Device device, cudaStream_t stream) {
    const int64_t e = int64_t(sizeof(T));
    if (aligned16(k, a.hd * e) && aligned16(v, a.hd_v * e)) {
        if (a.hd_v <= kThreads) return launch_split<T, 1, true>(a, device, stream);
        return launch_split<T, 2, true>(a, device, stream);
    }
    if (a.hd_v <= kThreads) return launch_split<T, 1, false>(a, device, stream);
    launch_split<T, 2, false>(a, device, stream);
}

template <typename T> // host storage type; the args carry device_t<T>
AttnArgs<device_t<T>> make_args(const Tensor &out, const Tensor &q, const Tensor &k, const Tensor &v, float scale,
                                const Tensor *kv_len) {
    return AttnArgs<device_t<T>>{dptr<T>(out), dptr<T>(q), dptr<T>(k), dptr<T>(v), q.stride(0), q.stride(1),
                                 k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
                                 int(q.size(0)), int(k.size(0)), int(q.size(1)), int(k.size(1)), int(q.size(2)),
                                 int(v.size(2)), scale * 1.4426950408889634f, kv_len ? kv_len->data() : nullptr,
                                 kv_len && kv_len->dtype() == DType::I64,
                                 kv_len ? ::llaisys::runtime::cuda::error_flag(out.device()) : nullptr};
}

// Picks the kernel: tensor cores for f16/bf16 prefill with head dim 64/128 and 16-byte aligned rows;
// the split-KV kernel otherwise. Inputs are validated, out is contiguous.
void run_attention(const Tensor &out, const Tensor &q, const Tensor &k, const Tensor &v, float scale,
                   const Tensor *kv_len) {
    const int64_t hd = q.size(2), hd_v = v.size(2);
    LLAISYS_CHECK(k.size(0) < (int64_t(1) << 30) && q.size(0) * q.size(1) < (int64_t(1) << 30),
                  std::invalid_argument, "self_attention: too long for the CUDA kernels (", k.size(0), " keys)");
    detail::dispatch_float("self_attention", q.dtype(), q.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        using D = device_t<T>;
        const AttnArgs<D> a = make_args<T>(out, q, k, v, scale, kv_len);
        cudaStream_t stream = stream_of(out);
        if constexpr (!std::is_same_v<T, float>) {
            const bool tc = q.size(0) >= kTcMinQueries && hd == hd_v && (hd == 64 || hd == 128) &&
                            aligned16(q, hd * 2) && aligned16(k, hd * 2) && aligned16(v, hd * 2) &&
                            aligned16(out, hd * 2);
            if (tc && hd == 64) return launch_prefill_tc<D, 64>(a, out.device().index, stream);
            if (tc && hd == 128) return launch_prefill_tc<D, 128>(a, out.device().index, stream);
        }
        run_split(a, k, v, out.device(), stream);
    });
}

} // namespace

void self_attention(const Tensor &out, const Tensor &q, const Tensor &k, const Tensor &v, float scale) {
    run_attention(out, q, k, v, scale, nullptr);
}

void self_attention_cached(const Tensor &out, const Tensor &q, const Tensor &k_cache, const Tensor &v_cache,
                           const Tensor &kv_len, float scale) {
    constexpr const char *op = "self_attention_cached";
    attention_detail::check_args(op, out, q, k_cache, v_cache);
    if (q.size(0) == 0) return;
    const Tensor qc = attention_detail::unit_last_stride(q), kc = attention_detail::unit_last_stride(k_cache),
                 vc = attention_detail::unit_last_stride(v_cache);
    detail::with_contiguous_out(out, [&](const Tensor &dst) { run_attention(dst, qc, kc, vc, scale, &kv_len); });
}

} // namespace llaisys::ops::cuda
