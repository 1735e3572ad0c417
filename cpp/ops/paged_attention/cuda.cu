// Paged attention on CUDA: a split-KV ("flash-decoding") kernel on CUDA cores for prefill and chunked
// steps, a decode kernel for steps of one query per sequence, each followed by a combine kernel when a
// sequence's keys were split. Every
// per-sequence number (query rows, length, block table) is read on the device, so the grid depends only
// on (B, max_q_len, max_blocks) and one captured graph serves every decode step of a batch. Softmax runs
// in base 2 (scores pre-multiplied by scale * log2 e) with f32 running max/sum, accumulation in f32.
// Prefill and chunked steps of 16-bit caches with head dim 64 or 128 (no sliding window) run on tensor cores
// instead: paged_prefill_tc_kernel, flash-attention-2 over K/V tiles gathered through the block table.
#include "ops/paged_attention/paged_attention.hpp"

#include "core/runtime.hpp"
#include "ops/common/checks.hpp"
#include "ops/common/cuda.cuh"
#include "ops/common/flash_tc.cuh"
#include "ops/common/mma.cuh"
#include "ops/common/split_kv.cuh"
#include "ops/paged_attention/paged_cuda.cuh"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace llaisys::ops::cuda {

namespace {

using namespace paged; // PagedArgs, Seq and the per-sequence helpers
using split_kv::kRows;
using split_kv::kThreads;
using split_kv::kTile;           // two tiles in flight here
constexpr int kMaxSplits = 256;  // key chunks per sequence at most (the combine kernel's weights in smem)
constexpr int kCombineWarps = 4; // output rows per combine block, one warp each
constexpr int kCombineDims = 4;  // head dims per lane per pass of the combine kernel (hd 128 in one pass)
// The decode kernel (one query per sequence): 4 warps a block, each taking 8 keys a step, so a block's
// step covers 32 keys and its chunks are multiples of 32; a GQA group of at most 8 query heads.
constexpr int kDecWarps = 4, kDecKeys = 8, kDecTile = kDecWarps * kDecKeys, kDecRows = 8;

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
            float *dst = a.part + ((int64_t(blockIdx.z) * a.part_rows + t) * a.nh + rows.h(r)) * (a.hd + 2);
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
// past the sequence's rows or keys, or (sliding window) before all of their rows' windows, return at once.
template <typename T, int DPT, bool VEC, bool WINDOW>
__global__ void __launch_bounds__(kThreads) paged_split_kernel(const PagedArgs<T> a) {
    extern __shared__ __align__(16) unsigned char smem[];
    pdl_trigger(); // launched with PDL (cuda.cuh): nothing is read before the previous kernel is done
    pdl_wait();
    const int group = a.nh / a.nkvh, b = blockIdx.y / a.nkvh, kvh = blockIdx.y % a.nkvh;
    const Seq s = load_seq(a, b);
    if (int(blockIdx.x) * kRows >= s.qlen * group) return;
    const split_kv::Rows rows = make_rows(s, group, kvh, blockIdx.x * kRows);
    const int base = span_base<WINDOW>(s, a.window), L = chunk_len(s.kv - base, a.nsplit, a.granule);
    const int kc = base + blockIdx.z * L, ke = min(kc + L, rows.last_key + 1);
    // with a window, the chunk's keys before the window of the block's first row (which starts first) are
    // seen by none of its rows
    const int kb = WINDOW ? max(kc, rows.lim[0] - a.window + 1) : kc;
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
        split_kv::softmax_tile<T, DPT, VEC, WINDOW>(lay, rows, qs, smem + lay.k_off(cur), red, ps, t0, n, st, a.window);
        split_kv::pv_tile<T, DPT, WINDOW>(lay, rows, smem + lay.v_off(cur), ps, t0, n, st, a.window);
    }
    __syncthreads(); // the accumulators' merge reuses the tiles
    finish<T, DPT>(a, lay, rows, s, smem, st);
}

// Starts copying ROWS rows of HD 16-bit elements into the smem tile [ROWS][HD + 8]: row r from row_ptr(r)
// for r < nvalid, zeros past it (never read from global memory).
template <int ROWS, int HD, typename T, typename RowPtr>
__device__ __forceinline__ void gather_rows_async(T *tile, const T *any, RowPtr row_ptr, int nvalid) {
    constexpr int chunks = HD / 8, threads = flash_tc::kTcWarps * 32; // 16-byte chunks per row
    static_assert(ROWS * chunks % threads == 0, "tile copy must split evenly over the block");
#pragma unroll
    for (int i = 0; i < ROWS * chunks / threads; ++i) {
        const int c = i * threads + threadIdx.x, r = c / chunks, col = (c % chunks) * 8;
        const bool valid = r < nvalid;
        cp_async16(tile + r * flash_tc::tc_pitch<HD>() + col, valid ? row_ptr(r) + col : any, valid);
    }
}

// The query tiles of a step, numbered so that a grid needs no per-sequence size from the host: sequence b's
// ceil(qlen_b / 64) tiles are numbers [first(b), first(b) + ceil(qlen_b / 64)), first(b) = floor(q_start[b] / 64)
// + b. These ranges are disjoint and in order (floor(x / 64) + ceil(y / 64) <= floor((x + y) / 64) + 1), and all
// lie below floor(tokens / 64) + B: the grid's y size. (A grid of ceil(max_q_len / 64) tiles for every sequence
// gave a step of one 2048-token chunk beside 256 decodes 32 x 257 blocks a head, nearly all returning at once.)
__host__ __device__ constexpr int64_t tc_tiles(int64_t tokens, int64_t B) { return tokens / flash_tc::kTcBQ + B; }

// The block's (sequence, query tile from the sequence's start) for tile number v, found by the block's threads
// together (each checks some sequences); {-1, 0} in a gap between two sequences' tiles. q_start must rise from 0
// to at most tokens: a sequence where it does not is reported (kErrPagedMetadata) and its tiles are never found.
template <typename T>
__device__ __forceinline__ int2 tc_tile_of(const PagedArgs<T> &a, int v) {
    __shared__ int found; // the sequence (the largest that claims v, should malformed ranges overlap)
    if (threadIdx.x == 0) found = -1;
    __syncthreads();
    for (int b = threadIdx.x; b < a.batch; b += blockDim.x) {
        const int q0 = a.q_start[b], q1 = a.q_start[b + 1];
        if (q0 < 0 || q1 < q0 || q1 > a.tokens) {
            *a.error = kErrPagedMetadata;
            continue;
        }
        const int first = q0 / flash_tc::kTcBQ + b, n = (q1 - q0 + flash_tc::kTcBQ - 1) / flash_tc::kTcBQ;
        if (v >= first && v < first + n) atomicMax(&found, b);
    }
    __syncthreads();
    const int b = found;
    return b < 0 ? make_int2(-1, 0) : make_int2(b, v - (a.q_start[b] / flash_tc::kTcBQ + b));
}

// Tensor-core prefill over the paged cache (flash-attention-2: the Q fragments, key loop and row store are
// those of self_attention's prefill kernel, ops/common/flash_tc.cuh; only the K/V tile fetch is its own).
// Grid (nh, tc_tiles(tokens, B)), 128 threads: a block owns 64 query rows of one head of one sequence
// (tc_tile_of) and walks the K/V tiles of 64 keys up to the last key they see, each tile's rows gathered
// through the block table; a sequence's latest (heaviest) query tile has its lowest number, so it starts
// first. Query i of a sequence (position kv - qlen + i) sees keys [0, kv - qlen + i]. In a kManyQueries
// launch sequences of one query are the decode kernel's. Dynamic smem: Q [64][HD+8], K [64][HD+8],
// V [64][HD+8]; V_t streams in during S = Q K_t^T, K_{t+1} during softmax and O += P V_t. P is rounded to 16
// bits for P V (as the decode mma kernel and flash attention do); keys past the sequence are never loaded.
template <typename T, int HD>
__global__ void __launch_bounds__(flash_tc::kTcWarps * 32) paged_prefill_tc_kernel(const PagedArgs<T> a) {
    using namespace flash_tc;
    extern __shared__ __align__(16) unsigned char smem[];
    pdl_trigger();
    pdl_wait();
    const int h = blockIdx.x;
    const int2 bt = tc_tile_of(a, int(blockIdx.y));
    const int b = bt.x;
    if (b < 0) return;
    const Seq s = load_seq(a, b);
    const int tiles = (s.qlen + kTcBQ - 1) / kTcBQ;
    if (bt.y >= tiles || (a.select == kManyQueries && s.qlen == 1)) return;
    const int i0 = (tiles - 1 - bt.y) * kTcBQ;
    T *qs = reinterpret_cast<T *>(smem), *ks = qs + kTcBQ * tc_pitch<HD>(), *vs = ks + kTcBK * tc_pitch<HD>();
    const int kvh = h / (a.nh / a.nkvh), off = s.kv - s.qlen, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int kv_end = min(s.kv, min(i0 + kTcBQ, s.qlen) + off); // keys seen by the block's last query
    const int ntiles = (kv_end + kTcBK - 1) / kTcBK;
    const int32_t *table = a.tables + int64_t(b) * a.max_blocks;
    const int64_t row_elems = int64_t(a.nkvh) * HD, head = int64_t(kvh) * HD;
    const T *qg = a.q + int64_t(s.q0 + i0) * a.q_s0 + int64_t(h) * a.q_s1;
    const auto kv_rows = [&](T *tile, const T *base, int j0) {
        gather_rows_async<kTcBK, HD>(tile, base, [&](int r) {
            return base + int64_t(cache_row(a, table, j0 + r)) * row_elems + head;
        }, kv_end - j0);
    };

    gather_rows_async<kTcBQ, HD>(qs, a.q, [&](int r) { return qg + int64_t(r) * a.q_s0; }, s.qlen - i0);
    kv_rows(ks, a.k, 0);
    uint32_t qf[HD / 16][4];
    load_q_frags<T, HD>(qf, qs, warp, lane);
    const int row0 = i0 + warp * 16 + lane / 4; // this thread's rows: row0 and row0 + 8
    float o[HD / 8][4], l[2];
    attend_tiles<T, HD>(o, l, qf, ks, vs, ntiles, row0 + off, s.kv, a.scale_log2, lane,
                        [&](int j0) { kv_rows(ks, a.k, j0); }, [&](int j0) { kv_rows(vs, a.v, j0); });
    store_rows<T, HD>(a.out + int64_t(s.q0) * a.o_s0 + int64_t(h) * a.o_s1, a.o_s0, row0, s.qlen, lane, o, l);
}

// DPL elements of T as one load: 2 to 16 bytes.
template <int BYTES> struct RawVec;
template <> struct RawVec<2> { using type = unsigned short; };
template <> struct RawVec<4> { using type = unsigned int; };
template <> struct RawVec<8> { using type = uint2; };
template <> struct RawVec<16> { using type = uint4; };

template <typename T, int DPL>
struct Dims {
    using Raw = typename RawVec<DPL * int(sizeof(T))>::type;
    Raw raw;
    __device__ __forceinline__ void load(const T *p) { raw = __ldg(reinterpret_cast<const Raw *>(p)); }
    __device__ __forceinline__ void zero() { raw = Raw{}; }
    __device__ __forceinline__ float operator[](int e) const { return to_f32(reinterpret_cast<const T *>(&raw)[e]); }
};

// v[r] holds this lane's part of row r's dot product (r < 8); returns the whole warp's sum of row
// (lane >> 2) & 7 (four lanes hold each row). A reduce-scatter: each exchange hands the partner the half
// of the rows it keeps, 4 + 2 + 1 shuffles, then 2 more to sum the last four lanes: 9 instead of 8 x 5.
__device__ __forceinline__ float reduce_scatter8(const float (&v)[kDecRows], int lane) {
    constexpr unsigned all = 0xffffffffu;
    const bool b16 = lane & 16, b8 = lane & 8, b4 = lane & 4;
    float v4[4], v2[2];
#pragma unroll
    for (int i = 0; i < 4; ++i) v4[i] = (b16 ? v[i + 4] : v[i]) + __shfl_xor_sync(all, b16 ? v[i] : v[i + 4], 16);
#pragma unroll
    for (int i = 0; i < 2; ++i) v2[i] = (b8 ? v4[i + 2] : v4[i]) + __shfl_xor_sync(all, b8 ? v4[i] : v4[i + 2], 8);
    float x = (b4 ? v2[1] : v2[0]) + __shfl_xor_sync(all, b4 ? v2[0] : v2[1], 4);
    x += __shfl_xor_sync(all, x, 2);
    return x + __shfl_xor_sync(all, x, 1);
}

// The row of the split partials a decode block of sequence b (its query at token t) writes: the token, or in
// a kOneQuery launch the sequence (partials for B rows, not for every token of a step of prompt chunks).
template <typename T>
__device__ __forceinline__ int part_row(const PagedArgs<T> &a, int b, int t) {
    return a.select == kOneQuery ? b : t;
}

// The decode kernels' last stage: the block's WARPS warps each hold (max, sum, acc) of the group's rows over
// their own keys (wm, wl, wacc: HD = a.hd dims); merged per output element into out (one split) or into the
// chunk's partials (row prow, part_row) for paged_combine_kernel.
template <typename T, int WARPS, int ROWS, int HD>
__device__ __forceinline__ void merge_warps(const PagedArgs<T> &a, const float (&wm)[WARPS][ROWS],
                                            const float (&wl)[WARPS][ROWS], const float (&wacc)[WARPS][ROWS][HD],
                                            int kvh, int group, int t, int prow) {
    for (int idx = threadIdx.x; idx < group * HD; idx += WARPS * 32) {
        const int r = idx / HD, d = idx % HD, h = kvh * group + r;
        float mm = -INFINITY;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mm = fmaxf(mm, wm[w][r]);
        const float m_ref = mm == -INFINITY ? 0.f : mm;
        float o = 0.f, sum = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) { // a warp that saw no key has m = -inf: weight 0
            const float wt = exp2f(wm[w][r] - m_ref);
            o += wt * wacc[w][r][d];
            sum += wt * wl[w][r];
        }
        if (a.nsplit == 1) {
            a.out[t * a.o_s0 + h * a.o_s1 + d] = from_f32<T>(o / sum);
        } else {
            float *dst = a.part + ((int64_t(blockIdx.x) * a.part_rows + prow) * a.nh + h) * (a.hd + 2);
            dst[d] = o;
            if (d == 0) dst[a.hd] = mm, dst[a.hd + 1] = sum;
        }
    }
}

// Decode steps (one query per sequence). The split kernel's blocks each walk 64 keys with a serial
// instruction stream (thread = key, then thread = dim over every key) and at batch 1 only a dozen exist.
// Here grid (nsplit, B * nkvh), 4 warps: a block takes one chunk (a multiple of 32 keys) of one kv head's
// keys for the group's query heads (<= 8), and every warp walks its own 8 keys a step with no barrier:
//   lane = DPL = hd / 32 dims: the lane holds those dims of all 8 query rows (q), loads those dims of
//   its warp's 8 K and 8 V rows at once (one block-table lookup per key, by lanes 0-7), forms 8 partial
//   dot products per key and reduce-scatters them, so lane l ends with row (l >> 2)'s scores; the
//   online softmax of that row runs in the lane, and P @ V takes each row's probability by a shuffle.
// The 4 warps' (max, sum, acc) merge through shared memory; the chunk's result goes to out (one split) or
// to the partials paged_combine_kernel merges (the same layout as the split kernel's). With settled
// history (a model's step) the block reads its sequence's metadata, block table and first keys before
// pdl_wait, so only q and this step's own keys wait for the kernels ahead.
template <typename T, int DPL, bool WINDOW>
__global__ void __launch_bounds__(kDecWarps * 32) paged_decode_kernel(const PagedArgs<T> a) {
    constexpr unsigned all = 0xffffffffu;
    __shared__ float wm[kDecWarps][kDecRows], wl[kDecWarps][kDecRows];
    __shared__ __align__(16) float wacc[kDecWarps][kDecRows][32 * DPL];
    pdl_trigger();
    if (!a.settled) pdl_wait();
    const DecodeChunk ck = decode_chunk<kDecTile, WINDOW>(a);
    const int group = ck.group, kvh = ck.kvh, kb = ck.kb, ke = ck.ke, t = ck.s.q0;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, own = lane >> 2;
    const int64_t row_elems = int64_t(a.nkvh) * a.hd, head = int64_t(kvh) * a.hd + lane * DPL;
    // Keys [t0, t0 + n) of a step, this warp's: lanes 0..n-1 look up their cache rows, then every load of
    // the step is in flight at once. Only keys in [lo, hi) are loaded by a call; past the chunk (k >= n):
    // no read, and V = 0 so that p = 0 adds nothing (not 0 * NaN).
    Dims<T, DPL> kd[kDecKeys], vd[kDecKeys];
    int t0 = kb + warp * kDecKeys, n = ck.empty ? 0 : max(0, min(kDecKeys, ke - t0));
    const auto load_keys = [&](int lo, int hi) {
        const int slot = lane < n ? cache_row(a, ck.table, t0 + lane) : 0;
#pragma unroll
        for (int k = 0; k < kDecKeys; ++k) {
            const int64_t at = int64_t(__shfl_sync(all, slot, k)) * row_elems + head;
            if (k < n && t0 + k >= lo && t0 + k < hi) {
                kd[k].load(a.k + at);
                vd[k].load(a.v + at);
            } else if (k >= n) {
                kd[k].zero();
                vd[k].zero();
            }
        }
    };
    // The first step's keys from before this step (kv - qlen of them): with settled history they load
    // while the kernel ahead (the one that writes this step's keys) still runs.
    const int settled_end = ck.s.kv - ck.s.qlen;
    load_keys(INT_MIN, settled_end);
    if (a.settled) pdl_wait();
    if (ck.empty) return;
    load_keys(settled_end, INT_MAX);
    float q[kDecRows][DPL], acc[kDecRows][DPL];
#pragma unroll
    for (int r = 0; r < kDecRows; ++r) {
        Dims<T, DPL> qd;
        if (r < group) qd.load(a.q + t * a.q_s0 + (kvh * group + r) * a.q_s1 + lane * DPL);
        else qd.zero(); // padding rows score 0 and are never written
#pragma unroll
        for (int e = 0; e < DPL; ++e) {
            q[r][e] = qd[e] * a.scale_log2;
            acc[r][e] = 0.f;
        }
    }
    float m = -INFINITY, l = 0.f; // row own's running max and sum (base 2)
    while (n > 0) {
        float sc[kDecKeys], mx = -INFINITY;
#pragma unroll
        for (int k = 0; k < kDecKeys; ++k) {
            float part[kDecRows];
#pragma unroll
            for (int r = 0; r < kDecRows; ++r) {
                part[r] = 0.f;
#pragma unroll
                for (int e = 0; e < DPL; ++e) part[r] += q[r][e] * kd[k][e];
            }
            sc[k] = k < n ? reduce_scatter8(part, lane) : -INFINITY;
            mx = fmaxf(mx, sc[k]); // fmaxf skips NaN scores; exp2f below turns them into NaN
        }
        const float m_new = fmaxf(m, mx), m_ref = m_new == -INFINITY ? 0.f : m_new; // avoid -inf - -inf
        const float corr = exp2f(m - m_ref);
        float p[kDecKeys], psum = 0.f;
#pragma unroll
        for (int k = 0; k < kDecKeys; ++k) {
            p[k] = exp2f(sc[k] - m_ref);
            psum += p[k];
        }
        l = l * corr + psum;
        m = m_new;
#pragma unroll
        for (int r = 0; r < kDecRows; ++r) {
            const float c = __shfl_sync(all, corr, 4 * r);
#pragma unroll
            for (int e = 0; e < DPL; ++e) acc[r][e] *= c;
        }
#pragma unroll
        for (int k = 0; k < kDecKeys; ++k)
#pragma unroll
            for (int r = 0; r < kDecRows; ++r) {
                const float pr = __shfl_sync(all, p[k], 4 * r);
#pragma unroll
                for (int e = 0; e < DPL; ++e) acc[r][e] += pr * vd[k][e];
            }
        t0 += kDecTile;
        n = max(0, min(kDecKeys, ke - t0));
        if (n > 0) load_keys(INT_MIN, INT_MAX);
    }
    if ((lane & 3) == 0) wm[warp][own] = m, wl[warp][own] = l;
#pragma unroll
    for (int r = 0; r < kDecRows; ++r)
#pragma unroll
        for (int e = 0; e < DPL; ++e) wacc[warp][r][lane * DPL + e] = acc[r][e];
    __syncthreads();
    merge_warps(a, wm, wl, wacc, kvh, group, t, part_row(a, ck.b, t));
}

// Decode steps on tensor cores (16-bit K/V, head dim 64 or 128, a GQA group of at most 16 query heads).
// The kernel above spends ~17 shuffles and ~64 FMAs a key on CUDA cores and moved ~1 TB/s at batch 256
// (session 28); here each warp takes 16 keys a step and does Q K^T and P V as mma.sync m16n8k16 (the group's
// query rows are the M = 16 rows, padded with zero rows), so a key costs a few instructions; a lane reads its
// fragments as 16-byte pieces of the K/V rows:
//   lane (g = lane / 4, c = lane % 4). Q K^T: the k index is a permutation of the head's dims (the dot
//   product is the same in any order): k-step s takes dims c * HD/4 + 4 s + 0..3 at lane c, so a lane's B
//   fragments for key n = g of n-tile j (key 8 j + g of the step) are one contiguous HD/4-dim piece of that
//   K row, and its A fragments the same dims of query rows g and g + 8.
//   P V: S's accumulator layout is P's A fragment (keys 2c, 2c+1 | 8+2c, 9+2c); output column n of n-tile
//   d is dim n * HD/8 + d, so a lane's V reads are the HD/8-dim piece at g * HD/8 of its four keys' rows,
//   paired into B fragments with a byte permute.
// The online softmax keeps f32 (max, sum) per row; P is rounded to the 16-bit type for the P V product (as
// flash attention does). The 4 warps' results merge through shared memory as in paged_decode_kernel, into
// out or the partials paged_combine_kernel merges.
// The K/V rows come through shared memory: each warp owns STAGES stages of its 16 keys' K and V rows and keeps
// STAGES - 1 steps of cp.async in flight while it computes on the oldest, with no block barrier in the key
// loop; cache rows are looked up one step before their copies are issued. (Session 32's kernel loaded the
// next step's rows straight into the fragment registers: ~4 KB in flight a warp for hd 64, a memory latency
// waited every step, 2.1-2.3 TB/s at 256 rows x 600 keys on an H200; this one, 2.5-3.3 TB/s at 256 rows of
// 512-2048 keys and the nano-vllm protocol +7-9%, session 33.) A stage's rows are padded by 16 bytes (no bank
// conflicts for hd 64's fragment reads). After the loop the stages hold the warps' accumulators for
// merge_warps.
// WARPS warps a block (4, or 3 where a batch's blocks overflow one wave of 4-warp blocks but fit in one of
// 3-warp blocks: see decode_warps); a step of a block covers WARPS * kMmaKeys keys.
constexpr int kMmaKeys = 16, kMmaRows = 16;

constexpr int kPipePad = 16; // bytes after each staged K/V row

template <int HD>
__host__ __device__ constexpr int pipe_pitch() { return HD * 2 + kPipePad; }
template <int HD>
__host__ __device__ constexpr int pipe_stage_bytes() { return 2 * kMmaKeys * pipe_pitch<HD>(); } // K then V rows
template <int HD, int STAGES, int WARPS>
__host__ __device__ constexpr int pipe_smem_bytes() {
    const int stages = WARPS * STAGES * pipe_stage_bytes<HD>();
    const int merge = WARPS * kMmaRows * HD * 4;
    return stages > merge ? stages : merge;
}

// N / 4 16-byte words of a staged row from p into fragment registers.
template <int N>
__device__ __forceinline__ void stage_words(uint32_t (&w)[N], const unsigned char *p) {
    static_assert(N % 4 == 0, "16-byte pieces");
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
        const uint4 u = reinterpret_cast<const uint4 *>(p)[i];
        w[4 * i] = u.x, w[4 * i + 1] = u.y, w[4 * i + 2] = u.z, w[4 * i + 3] = u.w;
    }
}

template <typename T, int HD, bool WINDOW, int STAGES, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) paged_decode_pipe_kernel(const PagedArgs<T> a) {
    constexpr int kMmaTile = WARPS * kMmaKeys;
    constexpr unsigned all = 0xffffffffu;
    constexpr int KW = HD / 8, VW = HD / 16, KS = HD / 16, NT = HD / 8; // K/V piece words, k-steps, n-tiles
    constexpr int PITCH = pipe_pitch<HD>(), STAGE = pipe_stage_bytes<HD>();
    constexpr int PPR = HD * 2 / 16;               // 16-byte pieces of a K or V row
    constexpr int PIECES = kMmaKeys * PPR / 32;    // pieces of K (and of V) a lane copies a step
    static_assert(PIECES * 32 == kMmaKeys * PPR && 32 % PPR == 0, "whole rows a round of lanes");
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ float wm[WARPS][kMmaRows], wl[WARPS][kMmaRows];
    __shared__ uint4 qfrag[KS][32];
    pdl_trigger();
    if (!a.settled) pdl_wait();
    const DecodeChunk ck = decode_chunk<kMmaTile, WINDOW>(a);
    const int group = ck.group, kvh = ck.kvh, kb = ck.kb, ke = ck.ke, t = ck.s.q0;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane >> 2, c = lane & 3;
    const int64_t row_elems = int64_t(a.nkvh) * HD;
    const T *kbase = a.k + int64_t(kvh) * HD, *vbase = a.v + int64_t(kvh) * HD;
    unsigned char *const mine = smem + warp * STAGES * STAGE; // this warp's stages
    // Step i of this warp covers keys [kb + 16 warp + 64 i, + 16); lane l looks up the cache row of key l % 16
    const int first = kb + warp * kMmaKeys;
    const auto slot_of = [&](int t0) {
        const int key = t0 + (lane & 15);
        return key < ke ? cache_row(a, ck.table, key) : 0;
    };
    // Copies the K and V rows of step i's keys in [lo, hi) into stage i % STAGES; keys past the chunk are
    // zeroed (V = 0 so that p = 0 adds nothing, not 0 * NaN). Lane l copies pieces l + 32 j: key
    // (l + 32 j) / PPR, piece l % PPR of its row (a row's pieces by consecutive lanes).
    const auto issue = [&](int i, int slot, int lo, int hi) {
        const int t0 = first + i * kMmaTile;
        unsigned char *ks = mine + (i % STAGES) * STAGE, *vs = ks + kMmaKeys * PITCH;
        const int piece = lane % PPR;
#pragma unroll
        for (int j = 0; j < PIECES; ++j) {
            const int key = (lane + 32 * j) / PPR, row = __shfl_sync(all, slot, key);
            const int at = key * PITCH + piece * 16;
            const int64_t src = int64_t(row) * row_elems + piece * 8;
            if (t0 + key >= ke) {
                cp_async16(ks + at, kbase, false);
                cp_async16(vs + at, vbase, false);
            } else if (t0 + key >= lo && t0 + key < hi) {
                cp_async16(ks + at, kbase + src);
                cp_async16(vs + at, vbase + src);
            }
        }
    };
    // Prologue: steps 0 .. STAGES - 2 in flight (one commit group each, empty past the chunk), their keys
    // from before this step's (kv - qlen of them) while the kernel ahead still runs with settled history
    const int settled_end = ck.s.kv - ck.s.qlen;
    int pre[STAGES - 1];
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) pre[i] = slot_of(first + i * kMmaTile);
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if (!ck.empty && first + i * kMmaTile < ke) issue(i, pre[i], INT_MIN, settled_end);
        cp_async_commit();
    }
    if (a.settled) pdl_wait();
    if (ck.empty) {
        cp_async_wait_all();
        return;
    }
    bool late = false; // the prologue's keys of this step (rare: a chunk of fewer than ~STAGES x 64 keys)
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        const int t0 = first + i * kMmaTile;
        if (t0 < ke && t0 + kMmaKeys > settled_end) {
            issue(i, pre[i], settled_end, INT_MAX);
            late = true;
        }
    }
    if (late) {
        cp_async_commit();
        cp_async_wait_all();
    }
    if (warp == 0) { // Q's A fragments (rows g and g + 8 of the group, zero past it), the same for every warp
#pragma unroll
        for (int st = 0; st < KS; ++st) {
            uint32_t f[4];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = g + 8 * h;
                const T *qr = a.q + t * a.q_s0 + int64_t(kvh * group + r) * a.q_s1 + c * (HD / 4) + 4 * st;
                f[h] = r < group ? *reinterpret_cast<const uint32_t *>(qr) : 0u;
                f[2 + h] = r < group ? *reinterpret_cast<const uint32_t *>(qr + 2) : 0u;
            }
            qfrag[st][lane] = make_uint4(f[0], f[1], f[2], f[3]);
        }
    }
    __syncthreads();
    float acc[NT][4];
#pragma unroll
    for (int d = 0; d < NT; ++d) acc[d][0] = acc[d][1] = acc[d][2] = acc[d][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}; // rows g, g + 8: running max and this lane's sum
    int ahead = slot_of(first + (STAGES - 1) * kMmaTile);  // cache rows of the step issued next
    for (int i = 0; first + i * kMmaTile < ke; ++i) {
        const int t0 = first + i * kMmaTile, tn = t0 + (STAGES - 1) * kMmaTile;
        if (tn < ke) {
            const int slot = ahead;
            ahead = slot_of(tn + kMmaTile); // looked up now, used next step
            issue(i + STAGES - 1, slot, INT_MIN, INT_MAX);
        }
        cp_async_commit();
        cp_async_wait<STAGES - 1>(); // step i's group is done (this lane's copies)
        __syncwarp();                // and every lane's
        const unsigned char *ks = mine + (i % STAGES) * STAGE, *vs = ks + kMmaKeys * PITCH;
        uint32_t kr[2][KW];
#pragma unroll
        for (int j = 0; j < 2; ++j) stage_words(kr[j], ks + (8 * j + g) * PITCH + c * (HD / 4) * 2);
        float sc[2][4]; // n-tile j, element e: row g + 8 (e >> 1), key 8 j + 2 c + (e & 1)
#pragma unroll
        for (int j = 0; j < 2; ++j) sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.f;
#pragma unroll
        for (int st = 0; st < KS; ++st) {
            const uint4 q4 = qfrag[st][lane];
            const uint32_t qa[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
            for (int j = 0; j < 2; ++j) mma16816<T>(sc[j], qa, kr[j][2 * st], kr[j][2 * st + 1]);
        }
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const bool in = t0 + 8 * j + 2 * c + (e & 1) < ke;
                sc[j][e] = in ? sc[j][e] * a.scale_log2 : -INFINITY;
                mx[e >> 1] = fmaxf(mx[e >> 1], sc[j][e]); // fmaxf skips NaN scores; exp2f turns them into NaN
            }
        float corr[2], m_ref[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(all, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(all, mx[h], 2));
            const float m_new = fmaxf(m[h], mx[h]);
            m_ref[h] = m_new == -INFINITY ? 0.f : m_new; // avoid -inf - -inf
            corr[h] = exp2f(m[h] - m_ref[h]);
            m[h] = m_new;
            l[h] *= corr[h];
        }
        float p[2][4];
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                p[j][e] = exp2f(sc[j][e] - m_ref[e >> 1]);
                l[e >> 1] += p[j][e];
            }
        const uint32_t pa[4] = {pack2<T>(p[0][0], p[0][1]), pack2<T>(p[0][2], p[0][3]), pack2<T>(p[1][0], p[1][1]),
                                pack2<T>(p[1][2], p[1][3])};
        uint32_t vr[4][VW];
#pragma unroll
        for (int q = 0; q < 4; ++q) stage_words(vr[q], vs + (2 * c + (q & 1) + 8 * (q >> 1)) * PITCH + g * (HD / 8) * 2);
#pragma unroll
        for (int d = 0; d < NT; ++d) {
            acc[d][0] *= corr[0], acc[d][1] *= corr[0], acc[d][2] *= corr[1], acc[d][3] *= corr[1];
            const unsigned sel = d & 1 ? 0x7632u : 0x5410u; // dim d of the pieces: high or low halves
            const uint32_t b0 = __byte_perm(vr[0][d / 2], vr[1][d / 2], sel);
            const uint32_t b1 = __byte_perm(vr[2][d / 2], vr[3][d / 2], sel);
            mma16816<T>(acc[d], pa, b0, b1);
        }
        __syncwarp(); // the stage is read before a later step's copies overwrite it
    }
    cp_async_wait_all(); // the empty groups past the chunk
#pragma unroll
    for (int h = 0; h < 2; ++h) { // a row's sum over the four lanes of its keys
        l[h] += __shfl_xor_sync(all, l[h], 1);
        l[h] += __shfl_xor_sync(all, l[h], 2);
    }
    __syncthreads(); // every warp is done with its stages: they hold the accumulators now
    auto &wacc = *reinterpret_cast<float(*)[WARPS][kMmaRows][HD]>(smem);
    if (c == 0) wm[warp][g] = m[0], wl[warp][g] = l[0], wm[warp][g + 8] = m[1], wl[warp][g + 8] = l[1];
#pragma unroll
    for (int d = 0; d < NT; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) wacc[warp][g + 8 * (e >> 1)][(2 * c + (e & 1)) * (HD / 8) + d] = acc[d][e];
    __syncthreads();
    merge_warps(a, wm, wl, wacc, kvh, group, t, part_row(a, ck.b, t));
}

// Merges the split partials of the output rows. Grid (ceil(max_q_len * nh / 4), B) (a kOneQuery launch: one
// query a sequence, its partials at the sequence's row), 4 warps: warp w takes row (query i, head h) =
// blockIdx.x * 4 + w of sequence blockIdx.y. The chunks its query saw (the same
// per-sequence split as the split kernel; later chunks, and with a window earlier ones, hold nothing for it
// and may be unwritten) are weighted by 2^(m_c - max) and summed per dim.
template <typename T, bool WINDOW>
__global__ void __launch_bounds__(kCombineWarps * 32) paged_combine_kernel(const PagedArgs<T> a) {
    __shared__ float wts[kCombineWarps][kMaxSplits], sums[kCombineWarps][kMaxSplits];
    pdl_trigger();
    pdl_wait();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, rho = blockIdx.x * kCombineWarps + warp;
    const Seq s = load_seq(a, blockIdx.y);
    const int i = rho / a.nh, h = rho % a.nh;
    if (i >= s.qlen || (a.select == kOneQuery && s.qlen != 1)) return; // whole warps return; only warp syncs follow
    // the chunks holding keys this query sees: [first, used) of the span [base, kv)
    const int lim = i + s.kv - s.qlen, base = span_base<WINDOW>(s, a.window);
    const int L = chunk_len(s.kv - base, a.nsplit, a.granule), used = (lim - base) / L + 1;
    const int first = WINDOW ? (max(base, lim - a.window + 1) - base) / L : 0;
    const int t = s.q0 + i;
    const int64_t stride = int64_t(a.part_rows) * a.nh * (a.hd + 2); // between chunks
    const float *p0 = a.part + (int64_t(part_row(a, int(blockIdx.y), t)) * a.nh + h) * (a.hd + 2);
    float *wt = wts[warp], *lt = sums[warp];
    float m = -INFINITY, l = 0.f;
    for (int c = first + lane; c < used; c += 32) { // each chunk's (m, l), read together
        wt[c] = p0[c * stride + a.hd];
        lt[c] = p0[c * stride + a.hd + 1];
        m = fmaxf(m, wt[c]);
    }
    m = warp_max(m);
    for (int c = first + lane; c < used; c += 32) {
        wt[c] = exp2f(wt[c] - m); // a chunk with nothing visible (m = -inf) weighs 0
        l += wt[c] * lt[c];
    }
    const float inv = 1.f / warp_sum(l);
    __syncwarp();
    T *dst = a.out + t * a.o_s0 + h * a.o_s1;
    for (int d0 = 0; d0 < a.hd; d0 += 32 * kCombineDims) { // one pass for hd <= 128
        // dims d0 + lane + 32 j of every chunk: chunks outer, so each step's loads of all the lane's dims
        // (and, unrolled, of several chunks) are in flight together; each dim still sums its chunks in order
        float acc[kCombineDims] = {};
#pragma unroll 4
        for (int c = first; c < used; ++c) {
            const float w = wt[c], *pc = p0 + c * stride + d0 + lane;
#pragma unroll
            for (int j = 0; j < kCombineDims; ++j)
                if (d0 + lane + 32 * j < a.hd) acc[j] += w * pc[32 * j];
        }
#pragma unroll
        for (int j = 0; j < kCombineDims; ++j)
            if (d0 + lane + 32 * j < a.hd) dst[d0 + lane + 32 * j] = from_f32<T>(acc[j] * inv);
    }
}

// Splits each sequence's keys so that the GPU is busy: a large batch or a prefill has blocks enough
// already. Planned from the host-known sizes only. resident > 0 (the pipelined decode kernel): that many
// of its blocks fit on an SM at once, and the split fills at most one wave of them - keys split further
// would start a second wave, and a chunk's fixed cost (its block's start, the combine kernel) buys
// nothing there; at 256 rows x 512 keys of the 1.5B shape one chunk a sequence took 48.9 us, two 64.9
// (session 33, H200). resident = 0: about four blocks per SM (the other kernels).
// LLAISYS_SPLIT_BLOCKS_PER_SM=N overrides either with N blocks per SM (read once; an A/B knob).
int plan_splits(int64_t blocks, int64_t capacity, int granule, int device, int resident = 0) {
    static const int64_t per_sm_env = [] {
        const char *e = std::getenv("LLAISYS_SPLIT_BLOCKS_PER_SM");
        const long v = e != nullptr ? std::strtol(e, nullptr, 10) : 0;
        return v > 0 ? int64_t(v) : int64_t(0);
    }();
    const int64_t cap = std::min(int64_t(kMaxSplits), ceil_div(capacity, granule));
    if (per_sm_env == 0 && resident > 0) {
        const int64_t slots = int64_t(resident) * sm_count(device);
        return int(std::max<int64_t>(1, std::min(slots / blocks, cap)));
    }
    const int64_t want = (per_sm_env > 0 ? per_sm_env : 4) * int64_t(sm_count(device));
    if (blocks >= want) return 1;
    return int(std::max<int64_t>(1, std::min(ceil_div(want, blocks), cap)));
}

template <typename T, bool WINDOW>
void launch_combine(const PagedArgs<T> &a, int B, Device device, cudaStream_t stream) {
    if (a.nsplit == 1) return;
    const int64_t rows = a.select == kOneQuery ? 1 : a.max_q_len; // query rows a sequence
    const dim3 grid(unsigned(ceil_div(rows * a.nh, kCombineWarps)), unsigned(B));
    launch_pdl(paged_combine_kernel<T, WINDOW>, grid, dim3(kCombineWarps * 32), 0, stream, device.index, a);
}

template <typename T, int DPT, bool VEC, bool WINDOW>
void launch(const PagedArgs<T> &a, int B, Device device, cudaStream_t stream) {
    const int elem = int(sizeof(T)), group = a.nh / a.nkvh;
    opt_in_smem<paged_split_kernel<T, DPT, VEC, WINDOW>>(
        size_t(Smem{{int(paged_detail::kCudaMaxRowBytes) / elem, int(paged_detail::kCudaMaxRowBytes) / elem, elem}}.bytes()),
        device.index);
    const dim3 grid(unsigned(ceil_div(int64_t(a.max_q_len) * group, kRows)), unsigned(B * a.nkvh), unsigned(a.nsplit));
    launch_pdl(paged_split_kernel<T, DPT, VEC, WINDOW>, grid, dim3(kThreads), size_t(Smem{{a.hd, a.hd, elem}}.bytes()), stream,
               device.index, a);
    launch_combine<T, WINDOW>(a, B, device, stream);
}

template <typename T, int DPL, bool WINDOW>
void launch_decode(const PagedArgs<T> &a, int B, Device device, cudaStream_t stream) {
    launch_pdl(paged_decode_kernel<T, DPL, WINDOW>, dim3(unsigned(a.nsplit), unsigned(B * a.nkvh)), dim3(kDecWarps * 32), 0,
               stream, device.index, a);
    launch_combine<T, WINDOW>(a, B, device, stream);
}

template <typename T, int HD, bool WINDOW, int STAGES, int WARPS>
void launch_decode_pipe(const PagedArgs<T> &a, int B, Device device, cudaStream_t stream) {
    constexpr size_t smem = size_t(pipe_smem_bytes<HD, STAGES, WARPS>());
    opt_in_smem<paged_decode_pipe_kernel<T, HD, WINDOW, STAGES, WARPS>>(smem, device.index);
    launch_pdl(paged_decode_pipe_kernel<T, HD, WINDOW, STAGES, WARPS>, dim3(unsigned(a.nsplit), unsigned(B * a.nkvh)),
               dim3(WARPS * 32), smem, stream, device.index, a);
    launch_combine<T, WINDOW>(a, B, device, stream);
}

// Blocks of paged_decode_pipe_kernel<.., HD, .., STAGES, WARPS> an SM of `device` holds at once (its shared
// memory decides), asked of the runtime once per process (every GPU of a machine is the same model).
template <int HD, int STAGES, int WARPS>
int pipe_resident(int device) {
    static const int n = [device] {
        constexpr auto kernel = &paged_decode_pipe_kernel<__nv_bfloat16, HD, false, STAGES, WARPS>;
        constexpr size_t smem = size_t(pipe_smem_bytes<HD, STAGES, WARPS>());
        opt_in_smem<kernel>(smem, device);
        int blocks = 0;
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, WARPS * 32, smem));
        return std::max(1, blocks);
    }();
    return n;
}

int pipe_resident(int hd, int stages, int warps, int device) {
    if (warps == 3) return stages == 2 ? pipe_resident<128, 2, 3>(device) : pipe_resident<128, 3, 3>(device);
    if (hd == 64) return stages == 2 ? pipe_resident<64, 2, 4>(device) : pipe_resident<64, 3, 4>(device);
    return stages == 2 ? pipe_resident<128, 2, 4>(device) : pipe_resident<128, 3, 4>(device);
}

// Warps a block of the tensor-core decode kernel: 4, except for head dim 128 where a batch's blocks (kv heads
// x sequences) overflow one wave of 4-warp blocks (3 an SM of an H200) but fit in one of 3-warp blocks (4 an
// SM: the same warps an SM): the 4-warp grid's second wave runs part-empty (256 rows of the 1.5B shape took
// 1.52x the time of 198 rows, one full wave; session 37). LLAISYS_DECODE_WARPS=3 or 4 fixes it (read once;
// an A/B switch for benchmarks).
int decode_warps(int64_t blocks, int hd, int stages, int device) {
    static const int forced = [] {
        const char *e = std::getenv("LLAISYS_DECODE_WARPS");
        const long v = e != nullptr ? std::strtol(e, nullptr, 10) : 0;
        return v == 3 || v == 4 ? int(v) : 0;
    }();
    if (hd != 128) return 4;
    if (forced != 0) return forced;
    const int64_t sms = sm_count(device);
    const bool overflow4 = blocks > int64_t(pipe_resident(hd, stages, 4, device)) * sms;
    return overflow4 && blocks <= int64_t(pipe_resident(hd, stages, 3, device)) * sms ? 3 : 4;
}

template <typename T, int HD>
void launch_prefill_tc(const PagedArgs<T> &a, int B, Device device, cudaStream_t stream) {
    constexpr size_t smem = flash_tc::tc_smem_bytes<HD>();
    opt_in_smem<paged_prefill_tc_kernel<T, HD>>(smem, device.index);
    const dim3 grid(unsigned(a.nh), unsigned(tc_tiles(a.tokens, B)));
    launch_pdl(paged_prefill_tc_kernel<T, HD>, grid, dim3(flash_tc::kTcWarps * 32), smem, stream, device.index, a);
}

// LLAISYS_PREFILL_MMA=0 keeps prefill and chunked steps on the CUDA-core split kernel (an A/B switch, read once).
bool prefill_mma_enabled() {
    static const bool on = [] {
        const char *e = std::getenv("LLAISYS_PREFILL_MMA");
        return e == nullptr || std::strcmp(e, "0") != 0;
    }();
    return on;
}

// A mixed step's sequences of one query run on the tensor-core decode kernel (kOneQuery) where it applies;
// LLAISYS_PAGED_MIXED=0 leaves them to the tensor-core prefill's 64-row tiles (an A/B switch, read once).
bool mixed_split_enabled() {
    static const bool on = [] {
        const char *e = std::getenv("LLAISYS_PAGED_MIXED");
        return e == nullptr || std::strcmp(e, "0") != 0;
    }();
    return on;
}

// The tensor-core decode kernel is the default where it applies; LLAISYS_DECODE_MMA=0 keeps the CUDA-core one
// (an A/B switch for benchmarks, read once).
bool decode_mma_enabled() {
    static const bool on = [] {
        const char *e = std::getenv("LLAISYS_DECODE_MMA");
        return e == nullptr || std::strcmp(e, "0") != 0;
    }();
    return on;
}

// Shared-memory stages of the tensor-core decode kernel: 2 (five blocks an SM for head dim 64, three for
// 128). Three stages (three and two blocks an SM) were faster for head dim 128 in bench_ops at 256 rows of 512
// and 2048 keys but not in the nano-vllm protocol of the 1.5B shape (28,244 output tok/s with two, 27,997 with
// three, same call); four were slower everywhere (session 33, H200). LLAISYS_DECODE_STAGES=3 sets three (read
// once; an A/B switch for benchmarks).
int decode_stages() {
    static const int stages = [] {
        const char *e = std::getenv("LLAISYS_DECODE_STAGES");
        return e != nullptr && std::strtol(e, nullptr, 10) == 3 ? 3 : 2;
    }();
    return stages;
}

} // namespace

void paged_attention(const Tensor &out, const Tensor &q, const Tensor &k_cache, const Tensor &v_cache,
                     const Tensor &block_tables, const Tensor &q_start, const Tensor &kv_len, float scale,
                     int64_t max_q_len, bool settled_history, int64_t window) {
    constexpr const char *op = "paged_attention";
    const int64_t tokens = q.size(0), nh = q.size(1), hd = q.size(2), nkvh = k_cache.size(2), B = block_tables.size(0);
    const int64_t mq = std::min(max_q_len, tokens); // no sequence has more queries than the step
    if (tokens == 0 || B == 0 || mq == 0) return;
    LLAISYS_CHECK(B * nkvh <= 65535, std::invalid_argument, op, ": batch * kv heads (", std::to_string(B * nkvh),
                  ") is more than the CUDA grid allows (65535)");
    const int64_t capacity = block_tables.size(1) * k_cache.size(1), elem = q.element_size();
    const auto aligned = [&](const Tensor &t, int64_t bytes) { return reinterpret_cast<uintptr_t>(t.data()) % bytes == 0; };
    // K/V rows in 16-byte pieces (the split kernel's cp.async)
    const bool vec = (hd * elem) % 16 == 0 && aligned(k_cache, 16) && aligned(v_cache, 16);
    // Decode (one query per sequence): the decode kernel where its lanes cover the head (hd = 32 x 1, 2, 4
    // or, in 16-bit types, 8 dims: a lane's piece is at most 16 bytes) and q's rows can be read in the
    // lanes' pieces; prefill and chunked steps: the split kernel.
    const int dpl = int(hd / 32), piece = dpl * int(elem);
    const bool decode = mq == 1 && hd % 32 == 0 && (dpl == 1 || dpl == 2 || dpl == 4 || (dpl == 8 && elem == 2)) &&
                        nh / nkvh <= kDecRows &&
                        aligned(q, piece) && aligned(k_cache, piece) && aligned(v_cache, piece) &&
                        (q.stride(0) * elem) % piece == 0 && (q.stride(1) * elem) % piece == 0;
    // Tensor cores for 16-bit decode of head dim 64 or 128 and groups of up to 16 query heads (16-byte K/V
    // pieces, q read in 4-byte pairs)
    const bool mma = mq == 1 && elem == 2 && (hd == 64 || hd == 128) && nh / nkvh <= kMmaRows && decode_mma_enabled() &&
                     aligned(k_cache, 16) && aligned(v_cache, 16) && aligned(q, 4) && (q.stride(0) * elem) % 4 == 0 &&
                     (q.stride(1) * elem) % 4 == 0;
    // Tensor cores for 16-bit prefill and chunked steps of head dim 64 or 128 without a window: whole 16-byte
    // rows of q and the caches (cp.async), out written in 4-byte pairs
    const auto rows16 = [&](const Tensor &t) { return aligned(t, 16) && (t.stride(0) * elem) % 16 == 0 && (t.stride(1) * elem) % 16 == 0; };
    const bool prefill_tc = mq >= flash_tc::kTcMinQueries && elem == 2 && (hd == 64 || hd == 128) && window == 0 &&
                            prefill_mma_enabled() && rows16(q) && aligned(k_cache, 16) && aligned(v_cache, 16) &&
                            aligned(out, 4) && (out.stride(0) * elem) % 4 == 0 && (out.stride(1) * elem) % 4 == 0 &&
                            tc_tiles(tokens, B) <= 65535;
    // A step of prompt chunks and decodes (several sequences, tensor-core prefill): the sequences of one query
    // go to the tensor-core decode kernel in a launch of their own (kOneQuery), not to 64-row query tiles that
    // read their keys once a query head (session 39: the 1.5B protocol's prefill kernel took 385 us a launch)
    const bool mixed = prefill_tc && B > 1 && mixed_split_enabled() && (nh / nkvh) <= kMmaRows && decode_mma_enabled() &&
                       aligned(q, 4) && (q.stride(0) * elem) % 4 == 0 && (q.stride(1) * elem) % 4 == 0;
    // the tensor-core decode kernel: a decode step's, or the one-query launch of a mixed step
    const int stages = mma || mixed ? decode_stages() : 0; // > 0: paged_decode_pipe_kernel
    const int warps = stages > 0 ? decode_warps(B * nkvh, int(hd), stages, out.device().index) : 0;
    const int granule = stages > 0 ? warps * kMmaKeys : decode ? kDecTile : kTile;
    const int64_t blocks = decode || stages > 0 ? B * nkvh : ceil_div(mq * (nh / nkvh), kRows) * B * nkvh;
    // keys a sequence's step may see: with a window at most window + max_q_len - 1 (window < capacity here:
    // op.cpp turns a larger one into 0)
    const int64_t span = window > 0 ? std::min(capacity, window + mq - 1) : capacity;
    const int resident = stages > 0 ? pipe_resident(int(hd), stages, warps, out.device().index) : 0;
    // splits of the decode or split kernel (the tensor-core prefill takes a sequence's keys whole)
    const int nsplit = prefill_tc && !mixed ? 1 : plan_splits(blocks, span, granule, out.device().index, resident);
    // its partials' rows: one a token, or one a sequence in a mixed step's one-query launch
    const int64_t part_rows = mixed ? B : tokens;
    Tensor part; // split partials through the stream-ordered allocator: no cudaMalloc in steady state
    if (nsplit > 1) part = Tensor::empty({int64_t(nsplit) * part_rows * nh * (hd + 2)}, DType::F32, out.device());
    detail::dispatch_float(op, q.dtype(), q.device(), [&](auto tag) {
        using H = typename decltype(tag)::type;
        using D = device_t<H>;
        const PagedArgs<D> a{dptr<H>(out), dptr<H>(q), dptr<H>(k_cache), dptr<H>(v_cache),
                             block_tables.data_as<int32_t>(), q_start.data_as<int32_t>(), kv_len.data_as<int32_t>(),
                             nsplit > 1 ? part.data_as<float>() : nullptr,
                             ::llaisys::runtime::cuda::error_flag(out.device()), q.stride(0), q.stride(1),
                             out.stride(0), out.stride(1), int(tokens), int(nh), int(nkvh), int(hd),
                             int(k_cache.size(1)), int(block_tables.size(1)), int(k_cache.size(0)), int(mq), nsplit,
                             scale * 1.4426950408889634f, granule, settled_history ? 1 : 0, int(window),
                             mixed ? kOneQuery : kAllSeqs, int(B), int(part_rows)};
        cudaStream_t stream = stream_of(out);
        const int bi = int(B);
        const auto go = [&](auto window) {
            constexpr bool W = decltype(window)::value;
            if constexpr (sizeof(D) == 2) {
                const auto pipe = [&](const PagedArgs<D> &x) { // paged_decode_pipe_kernel's instance
                    if (stages == 2 && hd == 64) return launch_decode_pipe<D, 64, W, 2, 4>(x, bi, out.device(), stream);
                    if (stages == 2 && warps == 3) return launch_decode_pipe<D, 128, W, 2, 3>(x, bi, out.device(), stream);
                    if (stages == 2) return launch_decode_pipe<D, 128, W, 2, 4>(x, bi, out.device(), stream);
                    if (stages == 3 && hd == 64) return launch_decode_pipe<D, 64, W, 3, 4>(x, bi, out.device(), stream);
                    if (stages == 3 && warps == 3) return launch_decode_pipe<D, 128, W, 3, 3>(x, bi, out.device(), stream);
                    launch_decode_pipe<D, 128, W, 3, 4>(x, bi, out.device(), stream);
                };
                if constexpr (!W) {
                    if (prefill_tc) {
                        if (mixed) pipe(a); // a mixed step's sequences of one query (kOneQuery), then the others
                        PagedArgs<D> p = a;
                        p.nsplit = 1, p.part = nullptr, p.select = mixed ? kManyQueries : kAllSeqs;
                        if (hd == 64) return launch_prefill_tc<D, 64>(p, bi, out.device(), stream);
                        return launch_prefill_tc<D, 128>(p, bi, out.device(), stream);
                    }
                }
                if (stages > 0) return pipe(a);
            }
            if (decode && dpl == 1) return launch_decode<D, 1, W>(a, bi, out.device(), stream);
            if (decode && dpl == 2) return launch_decode<D, 2, W>(a, bi, out.device(), stream);
            if (decode && dpl == 4) return launch_decode<D, 4, W>(a, bi, out.device(), stream);
            if constexpr (sizeof(D) == 2) // head dim 256 (Gemma 3): 8 dims of 2 bytes a lane
                if (decode) return launch_decode<D, 8, W>(a, bi, out.device(), stream);
            if (vec && hd <= kThreads) return launch<D, 1, true, W>(a, bi, out.device(), stream);
            if (vec) return launch<D, 2, true, W>(a, bi, out.device(), stream);
            if (hd <= kThreads) return launch<D, 1, false, W>(a, bi, out.device(), stream);
            launch<D, 2, false, W>(a, bi, out.device(), stream);
        };
        if (window > 0) go(std::true_type{});
        else go(std::false_type{});
    });
}

} // namespace llaisys::ops::cuda
