// The paged-attention kernels' arguments and per-sequence bookkeeping (cuda.cu): the metadata of a
// sequence clamped into the contract, its block-table lookups, how its keys split into chunks, and the
// prologue both decode kernels share (decode_chunk), so that the CUDA-core and the tensor-core decode
// kernel cover the same keys of a chunk by one definition.
#pragma once
#include "ops/common/cuda.cuh"

#include <cstdint>

namespace llaisys::ops::cuda::paged {

constexpr int kErrPagedMetadata = 5; // code in runtime::cuda::error_flag

template <typename T>
struct PagedArgs {
    T *out;                                   // [tokens, nh, hd], strides (o_s0, o_s1, 1)
    const T *q;                               // [tokens, nh, hd], strides (q_s0, q_s1, 1)
    const T *k, *v;                           // [num_blocks, block_size, nkvh, hd] contiguous
    const int32_t *tables, *q_start, *kv_len; // [B, max_blocks], [B + 1], [B]
    float *part;                              // nsplit > 1: partials [nsplit][part_rows][nh][hd + 2] (acc, m, l)
    int *error;
    int64_t q_s0, q_s1, o_s0, o_s1;
    int tokens, nh, nkvh, hd, block_size, max_blocks, num_blocks, max_q_len, nsplit;
    float scale_log2;
    int granule; // a sequence's key chunks are multiples of it: kTile (split kernel) or kDecTile (decode kernel)
    int settled; // settled_history (ops.hpp): the decode kernel reads the metadata and older keys before pdl_wait
    int window;  // > 0: the query at position p sees keys (p - window, p]; 0: all keys <= p
    // Which sequences a launch takes (a step of prompt chunks and decodes runs two launches, each on its own
    // rows): kAllSeqs, kOneQuery (the decode kernel's launch: sequences of exactly one query; its partials
    // are indexed by sequence, part_rows = B) or kManyQueries (the tensor-core prefill's: more than one)
    int select;
    int batch;     // B: sequences (q_start holds B + 1 entries)
    int part_rows; // rows of the partials per split: tokens, or B where they are indexed by sequence
};

constexpr int kAllSeqs = 0, kOneQuery = 1, kManyQueries = 2;

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

// Keys of one chunk of a sequence's span of keys: the split is planned per sequence on the device, so
// short sequences get short chunks (or fewer) and a long one uses every split.
__device__ __forceinline__ int chunk_len(int span, int nsplit, int granule) {
    const int c = (span + nsplit - 1) / nsplit;
    return max(granule, (c + granule - 1) / granule * granule);
}

// The keys a sequence's step may see, [base, kv): with a window, those before its first query's window
// are seen by none (base = 0 without one). Its chunks split this span: chunk c holds keys
// [base + c L, base + (c + 1) L), L = chunk_len(kv - base, ...), here and in the combine kernel alike.
// Every kernel takes WINDOW as a template argument: without a window (window == 0) its code is the full
// attention's, with nothing of the window's bounds and masks in it.
template <bool WINDOW>
__device__ __forceinline__ int span_base(const Seq &s, int window) {
    if constexpr (WINDOW) return max(0, s.kv - s.qlen - window + 1);
    else return 0;
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

// The chunk of keys one block of a decode kernel (one query per sequence) covers: grid (nsplit, B * nkvh),
// blockIdx.y = (sequence b, kv head kvh), blockIdx.x = the chunk. With one query (at kv - 1) and a window its
// keys are exactly the span [base, kv), so no key of [kb, ke) needs a mask. GRANULE: the kernel's keys a
// step (chunks are multiples of it). empty: the block has no key to attend to (a padded row, a chunk past
// a short sequence's keys, or in a kOneQuery launch a sequence of several queries: the other launch's); the kernel must still reach its pdl_wait before it returns (cuda.cuh).
struct DecodeChunk {
    int group, b, kvh;
    Seq s;
    int kb, ke;
    bool empty;
    const int32_t *table; // sequence b's block-table row
};

template <int GRANULE, bool WINDOW, typename T>
__device__ __forceinline__ DecodeChunk decode_chunk(const PagedArgs<T> &a) {
    DecodeChunk c;
    c.group = a.nh / a.nkvh;
    c.b = blockIdx.y / a.nkvh;
    c.kvh = blockIdx.y % a.nkvh;
    c.s = load_seq(a, c.b);
    const int base = span_base<WINDOW>(c.s, a.window), L = chunk_len(c.s.kv - base, a.nsplit, GRANULE);
    c.kb = base + blockIdx.x * L;
    c.ke = min(c.kb + L, c.s.kv);
    c.empty = c.s.qlen == 0 || c.kb >= c.ke || (a.select == kOneQuery && c.s.qlen != 1);
    c.table = a.tables + int64_t(c.b) * a.max_blocks;
    return c;
}

} // namespace llaisys::ops::cuda::paged
