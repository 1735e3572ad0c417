// Paged attention on CUDA: one split-KV ("flash-decoding") kernel on CUDA cores for every step - decode,
// chunked prefill, prefill - followed by a combine kernel when a sequence's keys were split. Every
// per-sequence number (query rows, length, block table) is read on the device, so the grid depends only
// on (B, max_q_len, max_blocks) and one captured graph serves every decode step of a batch. Softmax runs
// in base 2 (scores pre-multiplied by scale * log2 e) with f32 running max/sum, accumulation in f32.
// TODO: a tensor-core path for long prefills (self_attention's mma kernel over gathered K/V tiles).
#include "ops/paged_attention/paged_attention.hpp"

#include "core/runtime.hpp"
#include "ops/common/checks.hpp"
#include "ops/common/cuda.cuh"
#include "ops/common/split_kv.cuh"

#include <algorithm>
#include <cstdint>

namespace llaisys::ops::cuda {

namespace {

using split_kv::kRows;
using split_kv::kThreads;
using split_kv::kTile;           // two tiles in flight here
constexpr int kMaxSplits = 256;  // key chunks per sequence at most (the combine kernel's weights in smem)
constexpr int kCombineWarps = 4; // output rows per combine block, one warp each
constexpr int kErrPagedMetadata = 5; // code in runtime::cuda::error_flag

template <typename T>
struct PagedArgs {
    T *out;                                   // [tokens, nh, hd], strides (o_s0, o_s1, 1)
    const T *q;                               // [tokens, nh, hd], strides (q_s0, q_s1, 1)
    const T *k, *v;                           // [num_blocks, block_size, nkvh, hd] contiguous
    const int32_t *tables, *q_start, *kv_len; // [B, max_blocks], [B + 1], [B]
    float *part;                              // nsplit > 1: partials [nsplit][tokens][nh][hd + 2] (acc, m, l)
    int *error;
    int64_t q_s0, q_s1, o_s0, o_s1;
    int tokens, nh, nkvh, hd, block_size, max_blocks, num_blocks, max_q_len, nsplit;
    float scale_log2;
};

// One sequence's metadata, clamped into the contract so that nothing out of bounds is read: q rows
// [q0, q0 + qlen) of the step, kv keys with qlen <= kv <= max_blocks * block_size.
struct Seq {
    int q0, qlen, kv;
};

template <typename T>
__device__ __forceinline__ Seq load_seq(const PagedArgs<T> &a, int b) {
    int q0 = a.q_start[b], q1 = a.q_start[b + 1], kv = a.kv_len[b];
    const int cap = a.max_blocks * a.block_size;
    bool bad = false;
    if (q0 < 0 || q1 < q0 || q1 > a.tokens) {
        bad = true;
        q0 = q1 = 0;
    }
    if (q1 - q0 > a.max_q_len) { // rows past the bound have no blocks in the grid
        bad = true;
        q1 = q0 + a.max_q_len;
    }
    if (kv < q1 - q0 || kv > cap) {
        bad = true;
        kv = min(max(kv, q1 - q0), cap);
        q1 = min(q1, q0 + kv);
    }
    if (bad && threadIdx.x == 0) *a.error = kErrPagedMetadata;
    return Seq{q0, q1 - q0, kv};
}

// Keys of one chunk of a sequence of kv keys: the split is planned per sequence on the device, so short
// sequences get short chunks (or fewer) and a long one uses every split.
__device__ __forceinline__ int chunk_len(int kv, int nsplit) {
    const int c = (kv + nsplit - 1) / nsplit;
    return max(kTile, (c + kTile - 1) / kTile * kTile);
}

// Shared-memory layout in bytes, shared by host and device code: split_kv's head (q, red, p) | cache rows
// of two tiles i32 [2][64] | K tiles [2][64] | V tiles [2][64]. After the key loop the key groups'
// accumulators f32 [groups][8][hd] reuse the K/V tiles.
struct Smem : split_kv::Layout { // hd_v = hd
    __host__ __device__ int slot_off() const { return p_end(); }
    __host__ __device__ int k_off(int buf) const { return (slot_off() + 2 * kTile * 4 + 15) / 16 * 16 + buf * kTile * k_pitch(); }
    __host__ __device__ int v_off(int buf) const { return k_off(2) + buf * kTile * v_pitch(); }
    __host__ __device__ int bytes() const {
        const int merge = k_off(0) + groups() * kRows * hd * 4;
        return max(v_off(2), merge);
    }
};

__device__ __forceinline__ split_kv::Rows make_rows(const Seq &s, int group, int kvh, int first) {
    split_kv::Rows rows;
    rows.first = first;
    rows.group = group;
    rows.kvh = kvh;
    rows.n = min(kRows, s.qlen * group - first);
#pragma unroll
    for (int r = 0; r < kRows; ++r) rows.lim[r] = r < rows.n ? rows.qi(r) + s.kv - s.qlen : -1;
    rows.last_key = rows.qi(rows.n - 1) + s.kv - s.qlen; // rows go by query
    return rows;
}

// Cache row of key j of a sequence: its block from the table (clamped into the pool, reported), then the
// row in the block.
template <typename T>
__device__ __forceinline__ int cache_row(const PagedArgs<T> &a, const int32_t *table, int j) {
    int blk = table[j / a.block_size];
    if (blk < 0 || blk >= a.num_blocks) {
        *a.error = kErrPagedMetadata;
        blk = min(max(blk, 0), a.num_blocks - 1);
    }
    return blk * a.block_size + j % a.block_size;
}

// Starts staging n keys of kv head kvh whose cache rows are slots[0 .. n): K rows into ks, V rows into vs.
// VEC (16-byte aligned rows of a multiple of 16 bytes): through cp.async, one commit group; otherwise
// element by element, done on return (the empty commit group keeps the waits' counting uniform).
template <typename T, bool VEC>
__device__ __forceinline__ void issue_tile(const PagedArgs<T> &a, const Smem &lay, unsigned char *ks,
                                           unsigned char *vs, const int *slots, int kvh, int n) {
    const int64_t head = int64_t(kvh) * a.hd, row = int64_t(a.nkvh) * a.hd; // elements
    if constexpr (VEC) {
        constexpr int per16 = 16 / sizeof(T);
        const int pieces = a.hd / per16; // 16-byte pieces per row
        for (int i = threadIdx.x; i < n * pieces; i += kThreads) {
            const int c = i / pieces, e = (i % pieces) * per16;
            const int64_t src = slots[c] * row + head + e;
            cp_async16(ks + c * lay.k_pitch() + e * sizeof(T), a.k + src);
            cp_async16(vs + c * lay.v_pitch() + e * sizeof(T), a.v + src);
        }
    } else {
#pragma unroll 4
        for (int i = threadIdx.x; i < n * a.hd; i += kThreads) {
            const int c = i / a.hd, e = i % a.hd;
            const int64_t src = slots[c] * row + head + e;
            reinterpret_cast<T *>(ks + c * lay.k_pitch())[e] = a.k[src];
            reinterpret_cast<T *>(vs + c * lay.v_pitch())[e] = a.v[src];
        }
    }
    cp_async_commit();
}

// Sums the key groups' accumulators and the row sums, then writes each row to out (one split) or as a
// partial (acc [hd], m, l) for paged_combine_kernel. Called after a barrier that ended all tile reads.
template <typename T, int DPT>
__device__ __forceinline__ void finish(const PagedArgs<T> &a, const Smem &lay, const split_kv::Rows &rows, const Seq &s,
                                       unsigned char *smem, const split_kv::State<DPT> &st) {
    float *red = reinterpret_cast<float *>(smem + lay.red_off()), *merge = reinterpret_cast<float *>(smem + lay.k_off(0));
    split_kv::merge_groups(lay, st, red, merge);
    for (int idx = threadIdx.x; idx < rows.n * a.hd; idx += kThreads) {
        const int r = idx / a.hd, d = idx % a.hd, t = s.q0 + rows.qi(r);
        const float l = split_kv::row_sum(red, r), acc = split_kv::row_acc(lay, merge, r, d);
        if (a.nsplit == 1) {
            a.out[t * a.o_s0 + rows.h(r) * a.o_s1 + d] = from_f32<T>(acc / l);
        } else {
            float *dst = a.part + ((int64_t(blockIdx.z) * a.tokens + t) * a.nh + rows.h(r)) * (a.hd + 2);
            dst[d] = acc;
            if (d == 0) {
                dst[a.hd] = split_kv::row_max(red, r);
                dst[a.hd + 1] = l;
            }
        }
    }
}

// Split-KV paged attention. Grid (ceil(max_q_len * group / 8), B * nkvh, nsplit), 128 threads, dynamic
// smem per Smem. A block takes 8 rows (query, head) of one GQA group of one sequence - every K/V row it
// stages serves all of them - and walks the keys of its chunk that they may see in tiles of 64: the
// tile's cache rows are looked up in the block table one tile ahead, K/V rows of tile t + 1 stream in
// (cp.async) while tile t is scored (thread = key) and multiplied into V (thread = output dim). Blocks
// past the sequence's rows or keys return at once.
template <typename T, int DPT, bool VEC>
__global__ void __launch_bounds__(kThreads) paged_split_kernel(const PagedArgs<T> a) {
    extern __shared__ __align__(16) unsigned char smem[];
    pdl_trigger(); // launched with PDL (cuda.cuh): nothing is read before the previous kernel is done
    pdl_wait();
    const int group = a.nh / a.nkvh, b = blockIdx.y / a.nkvh, kvh = blockIdx.y % a.nkvh;
    const Seq s = load_seq(a, b);
    if (int(blockIdx.x) * kRows >= s.qlen * group) return;
    const split_kv::Rows rows = make_rows(s, group, kvh, blockIdx.x * kRows);
    const int kb = blockIdx.z * chunk_len(s.kv, a.nsplit), ke = min(kb + chunk_len(s.kv, a.nsplit), rows.last_key + 1);
    if (kb >= ke) return;
    const Smem lay{{a.hd, a.hd, int(sizeof(T))}};
    float *qs = reinterpret_cast<float *>(smem), *red = reinterpret_cast<float *>(smem + lay.red_off()),
          *ps = reinterpret_cast<float *>(smem + lay.p_off());
    int *slots = reinterpret_cast<int *>(smem + lay.slot_off()); // [2][kTile]
    const int32_t *table = a.tables + int64_t(b) * a.max_blocks;
    const int tid = threadIdx.x, ntiles = (ke - kb + kTile - 1) / kTile;

    if (tid < kTile && kb + tid < ke) slots[tid] = cache_row(a, table, kb + tid);
    int next = tid < kTile && kb + kTile + tid < ke ? cache_row(a, table, kb + kTile + tid) : 0;
    __syncthreads();
    issue_tile<T, VEC>(a, lay, smem + lay.k_off(0), smem + lay.v_off(0), slots, kvh, min(kTile, ke - kb));
#pragma unroll 8 // independent loads: let them be in flight together
    for (int idx = tid; idx < kRows * a.hd; idx += kThreads) { // padding rows are 0
        const int r = idx / a.hd, d = idx % a.hd;
        qs[idx] = r < rows.n ? to_f32(a.q[(s.q0 + rows.qi(r)) * a.q_s0 + rows.h(r) * a.q_s1 + d]) * a.scale_log2 : 0.f;
    }
    split_kv::State<DPT> st;
    st.reset();
    for (int t = 0; t < ntiles; ++t) {
        const int t0 = kb + t * kTile, n = min(kTile, ke - t0), cur = t & 1;
        if (t + 1 < ntiles) {
            if (tid < kTile) slots[(cur ^ 1) * kTile + tid] = next;
            __syncthreads(); // those rows are visible, and every thread is done with tile t - 1's buffers
            issue_tile<T, VEC>(a, lay, smem + lay.k_off(cur ^ 1), smem + lay.v_off(cur ^ 1), slots + (cur ^ 1) * kTile,
                               kvh, min(kTile, ke - t0 - kTile));
            if (tid < kTile && t0 + 2 * kTile + tid < ke) next = cache_row(a, table, t0 + 2 * kTile + tid);
            cp_async_wait<1>(); // tile t has landed (tile t + 1 may still be in flight)
        } else {
            cp_async_wait<0>();
        }
        __syncthreads(); // tile t (and, the first time, qs) is in smem for every thread
        split_kv::softmax_tile<T, DPT, VEC>(lay, rows, qs, smem + lay.k_off(cur), red, ps, t0, n, st);
        split_kv::pv_tile<T, DPT>(lay, rows, smem + lay.v_off(cur), ps, t0, n, st);
    }
    __syncthreads(); // the accumulators' merge reuses the tiles
    finish<T, DPT>(a, lay, rows, s, smem, st);
}

// Merges the split partials of the output rows. Grid (ceil(max_q_len * nh / 4), B), 4 warps: warp w takes
// row (query i, head h) = blockIdx.x * 4 + w of sequence blockIdx.y. The chunks its query saw (the same
// per-sequence split as the split kernel; later chunks hold nothing for it) are weighted by
// 2^(m_c - max) and summed per dim.
template <typename T>
__global__ void __launch_bounds__(kCombineWarps * 32) paged_combine_kernel(const PagedArgs<T> a) {
    __shared__ float wts[kCombineWarps][kMaxSplits];
    pdl_trigger();
    pdl_wait();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, rho = blockIdx.x * kCombineWarps + warp;
    const Seq s = load_seq(a, blockIdx.y);
    const int i = rho / a.nh, h = rho % a.nh;
    if (i >= s.qlen) return; // whole warps return; only warp-level syncs follow
    const int lim = i + s.kv - s.qlen, used = lim / chunk_len(s.kv, a.nsplit) + 1, t = s.q0 + i;
    const int64_t stride = int64_t(a.tokens) * a.nh * (a.hd + 2); // between chunks
    const float *p0 = a.part + (int64_t(t) * a.nh + h) * (a.hd + 2);
    float *wt = wts[warp];
    float m = -INFINITY, l = 0.f;
    for (int c = lane; c < used; c += 32) m = fmaxf(m, p0[c * stride + a.hd]);
    m = warp_max(m);
    for (int c = lane; c < used; c += 32) {
        wt[c] = exp2f(p0[c * stride + a.hd] - m); // a chunk with nothing visible (m = -inf) weighs 0
        l += wt[c] * p0[c * stride + a.hd + 1];
    }
    const float inv = 1.f / warp_sum(l);
    __syncwarp();
    T *dst = a.out + t * a.o_s0 + h * a.o_s1;
    for (int d = lane; d < a.hd; d += 32) {
        float acc = 0.f;
#pragma unroll 8
        for (int c = 0; c < used; ++c) acc += wt[c] * p0[c * stride + d];
        dst[d] = from_f32<T>(acc * inv);
    }
}

// Splits each sequence's keys until about four blocks per SM are busy (a decode batch smaller than the
// GPU); a large batch or a prefill has blocks enough already. Planned from the host-known sizes only.
int plan_splits(int64_t blocks, int64_t capacity, int device) {
    const int64_t want = 4 * int64_t(sm_count(device));
    if (blocks >= want) return 1;
    return int(std::max<int64_t>(1, std::min({ceil_div(want, blocks), int64_t(kMaxSplits), ceil_div(capacity, kTile)})));
}

template <typename T, int DPT, bool VEC>
void launch(const PagedArgs<T> &a, int B, Device device, cudaStream_t stream) {
    const int elem = int(sizeof(T)), group = a.nh / a.nkvh;
    opt_in_smem<paged_split_kernel<T, DPT, VEC>>(
        size_t(Smem{{int(paged_detail::kCudaMaxRowBytes) / elem, int(paged_detail::kCudaMaxRowBytes) / elem, elem}}.bytes()),
        device.index);
    const dim3 grid(unsigned(ceil_div(int64_t(a.max_q_len) * group, kRows)), unsigned(B * a.nkvh), unsigned(a.nsplit));
    launch_pdl(paged_split_kernel<T, DPT, VEC>, grid, dim3(kThreads), size_t(Smem{{a.hd, a.hd, elem}}.bytes()), stream,
               device.index, a);
    if (a.nsplit > 1) {
        const dim3 cgrid(unsigned(ceil_div(int64_t(a.max_q_len) * a.nh, kCombineWarps)), unsigned(B));
        launch_pdl(paged_combine_kernel<T>, cgrid, dim3(kCombineWarps * 32), 0, stream, device.index, a);
    }
}

} // namespace

void paged_attention(const Tensor &out, const Tensor &q, const Tensor &k_cache, const Tensor &v_cache,
                     const Tensor &block_tables, const Tensor &q_start, const Tensor &kv_len, float scale,
                     int64_t max_q_len) {
    constexpr const char *op = "paged_attention";
    const int64_t tokens = q.size(0), nh = q.size(1), hd = q.size(2), nkvh = k_cache.size(2), B = block_tables.size(0);
    const int64_t mq = std::min(max_q_len, tokens); // no sequence has more queries than the step
    if (tokens == 0 || B == 0 || mq == 0) return;
    LLAISYS_CHECK(B * nkvh <= 65535, std::invalid_argument, op, ": batch * kv heads (", std::to_string(B * nkvh),
                  ") is more than the CUDA grid allows (65535)");
    const int64_t blocks = ceil_div(mq * (nh / nkvh), kRows) * B * nkvh;
    const int nsplit = plan_splits(blocks, block_tables.size(1) * k_cache.size(1), out.device().index);
    Tensor part; // split partials through the stream-ordered allocator: no cudaMalloc in steady state
    if (nsplit > 1) part = Tensor::empty({int64_t(nsplit) * tokens * nh * (hd + 2)}, DType::F32, out.device());
    detail::dispatch_float(op, q.dtype(), q.device(), [&](auto tag) {
        using H = typename decltype(tag)::type;
        using D = device_t<H>;
        const PagedArgs<D> a{dptr<H>(out), dptr<H>(q), dptr<H>(k_cache), dptr<H>(v_cache),
                             block_tables.data_as<int32_t>(), q_start.data_as<int32_t>(), kv_len.data_as<int32_t>(),
                             nsplit > 1 ? part.data_as<float>() : nullptr,
                             ::llaisys::runtime::cuda::error_flag(out.device()), q.stride(0), q.stride(1),
                             out.stride(0), out.stride(1), int(tokens), int(nh), int(nkvh), int(hd),
                             int(k_cache.size(1)), int(block_tables.size(1)), int(k_cache.size(0)), int(mq), nsplit,
                             scale * 1.4426950408889634f};
        const bool vec = (hd * int64_t(sizeof(H))) % 16 == 0 && reinterpret_cast<uintptr_t>(k_cache.data()) % 16 == 0 &&
                         reinterpret_cast<uintptr_t>(v_cache.data()) % 16 == 0;
        cudaStream_t stream = stream_of(out);
        const int bi = int(B);
        if (vec && hd <= kThreads) return launch<D, 1, true>(a, bi, out.device(), stream);
        if (vec) return launch<D, 2, true>(a, bi, out.device(), stream);
        if (hd <= kThreads) return launch<D, 1, false>(a, bi, out.device(), stream);
        launch<D, 2, false>(a, bi, out.device(), stream);
    });
}

} // namespace llaisys::ops::cuda
