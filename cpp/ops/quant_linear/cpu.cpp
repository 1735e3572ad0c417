// CPU quantized linear: out [M, N] = x [M, K] @ dequant(W)[N, K]^T, the way llama.cpp computes it.
//
// Each x row is quantized once per call to 8-bit blocks of the weight's block size (Q8Act: one f32
// scale, int8 codes and the sums of each 16 codes, which the weight offsets and mins multiply).
// Threads then split the W rows; each W row is dotted with every x row in integer arithmetic per block
// (kernels.inc), compiled three times: portable C++, AVX2 and AVX-512 VNNI, picked at run time.
// Decode (M = 1) reads each weight byte once, so it is bound by memory bandwidth: the quantized rows
// are 3.5-7 times fewer bytes than bf16 ones. Prefill (M > 1) is bound by the arithmetic per block: on
// VNNI the 32-element formats, on AVX2 Q4_0 and Q5_0, get their own kernel over x packed in 16-row tiles
// (kernels.inc: column_u8; on AVX-512 two x rows a 512-bit vector, tile_u8_pairs), and on AVX-512 the K-quants
// take x packed in row pairs (XPair256, kernels.inc: column_kpairs), all with the decode kernel's integers and
// float operations lane by lane, so a row's bits never depend on M.
//
// This file is compiled with -ffp-contract=off (CMakeLists.txt), so a*b+c is never fused behind our
// back: the three paths round the same float operations and return the same bits.
#include "ops/quant_linear/quant_linear.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"
#include "ops/common/cpu.hpp"
#include "ops/quant_linear/isa.hpp"
#include "ops/swiglu/swiglu.hpp"
#include "quant/formats.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace llaisys::ops::cpu {
namespace {

// One block of a quantized x row: x[e] ~ d * q[e]. 32-element blocks carry bias[k] = -offset * (q[4k] +
// ... + q[4k + 3]) for the offset of the weight format's codes (kernels.inc: act_offset), which the
// dot product starts from; 256-element blocks the sums of each 16 codes, for the K-quants' offsets
// and mins.
template <int BK>
struct Q8Act;
template <>
struct Q8Act<32> {
    int8_t q[32];
    int32_t bias[8];
    float d;
};
template <>
struct Q8Act<256> {
    int8_t q[256];
    int16_t sums[16];
    float d;
};

// Prefill's x for the 32-element formats on the VNNI and AVX2 paths (kernels.inc: column_u8): tiles of
// kPackRows x rows; per block the rows' codes + 128 as u8 (the unsigned operand of VPDPBUSD or maddubs)
// and their d, side by side, so that one vector multiply gives a weight block's scales for the whole
// tile. Rows past M are 0 (d = 0).
// On the AVX-512 path dx holds each row pair's d again, spread as its 512-bit kernel multiplies them (row 2p's
// in lanes 0-7, row 2p + 1's in lanes 8-15: kernels.inc, tile_u8_pairs); the other paths leave it unwritten.
constexpr int kPackRows = 16;
struct alignas(64) XTile32 {
    uint8_t q[kPackRows][32];
    float d[kPackRows];
    float dx[kPackRows / 2][16];
};

// One block of a W row decoded once for every x row of a prefill call (kernels.inc: decode_u8): its codes
// less their offset (s8) and -128 times their lane sums (x's codes come as q + 128); its scale goes to a
// float array beside.
struct alignas(32) WBlockU8 {
    int8_t ws[32];
    int32_t corr[8];
};

// The K-quants' prefill x on the AVX-512 path (kernels.inc: column_kpairs): rows 2p and 2p + 1 of a call side
// by side per 256-element block, each 32-element chunk of one row followed by the same chunk of the other (one
// 512-bit load), their 16-sums likewise, and dx as XTile32's. A missing last row is zeros.
struct alignas(64) XPair256 {
    int8_t q[8][2][32];
    int16_t sums[2][16];
    float dx[16];
};

// col [M] = one W row . M quantized x rows (xq: M rows of nb Q8Act blocks).
using ColumnFn = void (*)(const uint8_t *w_row, const void *xq, int64_t M, int64_t nb, float *col);
// out [n] = W rows [0, n) from w_row (row_bytes apart) . one quantized x row (decode).
using RowsFn = void (*)(const uint8_t *w_row, int64_t row_bytes, int64_t n, const void *xq, int64_t nb, float *out);
// w [nb] blocks and wd [nb] scales = one W row (nb blocks) decoded.
using DecodeU8Fn = void (*)(const uint8_t *w_row, int64_t nb, WBlockU8 *w, float *wd);
// col [mm] = one decoded W row . the first mm rows of one tile (xt: its nb blocks).
using ColumnU8Fn = void (*)(const WBlockU8 *w, const float *wd, const XTile32 *xt, int64_t mm, int64_t nb, float *col);
// col [mm] = one W row . mm x rows from pair xp on (XPair256: ceil(mm / 2) pairs of nb blocks).
using ColumnPairFn = void (*)(const uint8_t *w_row, const XPair256 *xp, int64_t mm, int64_t nb, float *col);

// A prefill's kernels, all of one path (kernels.inc: prefill_fns): the x packing they read (XTile32::dx for
// the pair tile, XPair256) must be the path's whose kernel reads it, whatever set_cpu_path does meanwhile.
struct PrefillFns {
    DecodeU8Fn dec = nullptr;       // the packed-x kernel's row decoder (32-element formats), or nullptr
    ColumnU8Fn u8 = nullptr;        // that kernel (where dec)
    bool pair_tiles = false;        // whether u8 reads XTile32::dx (AVX-512)
    ColumnPairFn kpairs = nullptr;  // the K-quants' pair kernel (AVX-512), or nullptr
    ColumnFn column = nullptr;      // the unpacked kernel (neither of the above)
};

namespace portable {
using S = quant_isa::Portable;
#include "ops/quant_linear/kernels.inc"
} // namespace portable

#ifdef LLAISYS_QUANT_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace avx2 {
using S = quant_isa::Avx2;
#include "ops/quant_linear/kernels.inc"
} // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni"))), \
                             apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
#endif
namespace vnni {
using S = quant_isa::Avx512Vnni;
#include "ops/quant_linear/kernels.inc"
} // namespace vnni
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif // LLAISYS_QUANT_X86

QuantCpuPath detect_best() {
#ifdef LLAISYS_QUANT_X86
    // Every CPU with AVX2 and FMA (Haswell, Zen 1 and later) also has F16C.
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw"))
        return QuantCpuPath::Avx512Vnni;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return QuantCpuPath::Avx2;
#endif
    return QuantCpuPath::Portable;
}

const QuantCpuPath kBest = detect_best();
std::atomic<QuantCpuPath> g_path{kBest};

RowsFn rows_fn(QuantFormat format, QuantLayout layout) {
    switch (g_path.load(std::memory_order_relaxed)) {
#ifdef LLAISYS_QUANT_X86
    case QuantCpuPath::Avx512Vnni: return vnni::rows_fn(format, layout);
    case QuantCpuPath::Avx2: return avx2::rows_fn(format, layout);
#endif
    default: return portable::rows_fn(format, layout);
    }
}

// The prefill kernels of the current path, from one read of it.
PrefillFns prefill_fns(QuantFormat format, QuantLayout layout) {
    switch (g_path.load(std::memory_order_relaxed)) {
#ifdef LLAISYS_QUANT_X86
    case QuantCpuPath::Avx512Vnni: return vnni::prefill_fns(format, layout);
    case QuantCpuPath::Avx2: return avx2::prefill_fns(format, layout);
#endif
    default: return portable::prefill_fns(format, layout);
    }
}

template <int BK, typename T>
void quantize_row(const T *x, int64_t nb, Q8Act<BK> *out, int offset) {
    switch (g_path.load(std::memory_order_relaxed)) {
#ifdef LLAISYS_QUANT_X86
    case QuantCpuPath::Avx512Vnni: return vnni::quantize_row<BK>(x, nb, out, offset);
    case QuantCpuPath::Avx2: return avx2::quantize_row<BK>(x, nb, out, offset);
#endif
    default: return portable::quantize_row<BK>(x, nb, out, offset);
    }
}

// x [M, K] quantized to Q8Act blocks of the weight's block size: M rows of nb blocks, in a buffer of
// the calling thread that is reused by its next call (decode quantizes a few KiB per call; a fresh
// allocation over malloc's mmap threshold would cost page faults every call).
struct QuantizedX {
    uint8_t *data = nullptr;
    int64_t M = 0, nb = 0, row_bytes = 0;
    const void *row(int64_t m) const { return data + m * row_bytes; }
};

// Slot 0 holds the quantized x rows, slot 1 their packed tiles, slot 2 a worker's decoded W rows; 64-byte
// aligned.
template <int Slot>
uint8_t *x_buffer(size_t bytes) {
    thread_local std::unique_ptr<uint8_t[]> buf;
    thread_local size_t cap = 0;
    if (bytes > cap) {
        buf.reset(); // before allocating the larger one: never hold both
        buf.reset(new uint8_t[bytes + 63]);
        cap = bytes;
    }
    const auto p = reinterpret_cast<uintptr_t>(buf.get());
    return reinterpret_cast<uint8_t *>((p + 63) & ~uintptr_t(63));
}

template <int BK, typename T>
QuantizedX quantize_x(const Tensor &x, int64_t M, int64_t K, int offset) {
    QuantizedX q;
    q.M = M;
    q.nb = K / BK;
    q.row_bytes = q.nb * int64_t(sizeof(Q8Act<BK>));
    q.data = x_buffer<0>(size_t(M * q.row_bytes));
    const T *xp = x.data_as<T>();
    const int64_t ldx = M > 1 ? x.stride(0) : K;
    parallel_for(M, K, [&](int64_t m) {
        quantize_row<BK>(xp + m * ldx, q.nb, reinterpret_cast<Q8Act<BK> *>(q.data + m * q.row_bytes), offset);
    });
    return q;
}

template <typename T>
QuantizedX quantize_x(const Tensor &x, QuantFormat format) {
    const int64_t M = x.size(0), K = x.size(1);
    if (quant_format_info(format).block_elems == quant::kQK)
        return quantize_x<quant::kQK, T>(x, M, K, portable::act_offset(format));
    return quantize_x<quant::kQK_K, T>(x, M, K, 0);
}

// xq's M rows of Q8Act<32> blocks -> ceil(M / kPackRows) tiles of nb XTile32 blocks (pairs: dx too).
const XTile32 *pack_x(const QuantizedX &xq, bool pairs) {
    const int64_t M = xq.M, nb = xq.nb, tiles = (M + kPackRows - 1) / kPackRows;
    auto *out = reinterpret_cast<XTile32 *>(x_buffer<1>(size_t(tiles * nb) * sizeof(XTile32)));
    parallel_for(tiles, kPackRows * nb * 32, [&](int64_t t) {
        for (int64_t b = 0; b < nb; ++b) {
            XTile32 &o = out[t * nb + b];
            std::memset(&o, 0, offsetof(XTile32, dx));
            for (int r = 0; r < kPackRows && t * kPackRows + r < M; ++r) {
                const Q8Act<32> &a = static_cast<const Q8Act<32> *>(xq.row(t * kPackRows + r))[b];
                for (int e = 0; e < 32; ++e) o.q[r][e] = uint8_t(uint8_t(a.q[e]) ^ 0x80u); // q + 128
                o.d[r] = a.d;
            }
            if (pairs)
                for (int r = 0; r < kPackRows; ++r)
                    for (int l = 0; l < 8; ++l) o.dx[r / 2][8 * (r % 2) + l] = o.d[r];
        }
    });
    return out;
}

// xq's M rows of Q8Act<256> blocks -> ceil(M / 2) pairs of nb XPair256 blocks.
const XPair256 *pack_x_pairs(const QuantizedX &xq) {
    const int64_t M = xq.M, nb = xq.nb, pairs = (M + 1) / 2;
    auto *out = reinterpret_cast<XPair256 *>(x_buffer<1>(size_t(pairs * nb) * sizeof(XPair256)));
    parallel_for(pairs, 2 * nb * 256, [&](int64_t p) {
        for (int64_t b = 0; b < nb; ++b) {
            XPair256 &o = out[p * nb + b];
            for (int r = 0; r < 2; ++r) {
                if (2 * p + r >= M) {
                    for (int c = 0; c < 8; ++c) std::memset(o.q[c][r], 0, 32);
                    std::memset(o.sums[r], 0, sizeof o.sums[r]);
                    for (int l = 0; l < 8; ++l) o.dx[8 * r + l] = 0.f;
                    continue;
                }
                const Q8Act<256> &a = static_cast<const Q8Act<256> *>(xq.row(2 * p + r))[b];
                for (int c = 0; c < 8; ++c) std::memcpy(o.q[c][r], a.q + 32 * c, 32);
                std::memcpy(o.sums[r], a.sums, sizeof a.sums);
                for (int l = 0; l < 8; ++l) o.dx[8 * r + l] = a.d;
            }
        }
    });
    return out;
}

constexpr int64_t kChunk = 64; // x rows per call (prefill), W rows per call (decode): a stack buffer
static_assert(kPackRows <= kChunk, "a packed tile's column fits the buffer");

// Where W row n's result for x row m goes: rows [0, split) to out [M, split], rows [split, N) to the plane
// after it, [M, N - split] (quant_linear_swiglu's g and u in one call), plus bias [N] if given.
template <typename T>
struct Outputs {
    T *out;
    const T *bias;
    int64_t M, N, split;
    void put(int64_t m, int64_t n, float v) const {
        const int64_t ld = n < split ? split : N - split;
        T *o = n < split ? out : out + M * split;
        store(o + m * ld, n < split ? n : n - split, bias ? v + load(bias, n) : v);
    }
};

// Decode (one x row): each range of W rows goes to the kernel 64 rows per call.
template <typename T>
void run_rows(const QuantizedX &xq, const QuantMatrix &w, const Outputs<T> &o) {
    const int64_t N = w.rows(), rb = w.row_bytes();
    const uint8_t *w0 = w.row(0);
    const RowsFn fn = rows_fn(w.format(), w.layout());
    parallel_ranges(N, w.cols() / 4, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; n += kChunk) {
            float row[kChunk];
            const int64_t nn = std::min(kChunk, end - n);
            fn(w0 + n * rb, rb, nn, xq.row(0), xq.nb, row);
            if (o.split < N || o.bias) {
                for (int64_t i = 0; i < nn; ++i) o.put(0, n + i, row[i]);
            } else { // one plane, no bias (the LM head's 151936 rows): a plain loop that vectorizes
                for (int64_t i = 0; i < nn; ++i) store(o.out, n + i, row[i]);
            }
        }
    });
}

// Prefill: each W row against the x rows, kChunk rows (or one packed tile) per call. The W rows go in groups,
// each group through one x chunk before the next, so that the chunk (a packed tile of K = 896: 16 KiB of codes
// and scales, 30 KiB on the AVX-512 path with XTile32::dx) and the group's weight rows stay in L1 (or close to it:
// 30 + 15 KiB on a 48 KiB L1d) while every row of the group reads them. On the packed path a group's
// rows are decoded once, for all the tiles (68 bytes a block: 8 rows of K = 896 are 15 KiB; a group of 16
// would not leave the tile its L1).
template <typename T>
void run_prefill(const QuantizedX &xq, const QuantMatrix &w, const Outputs<T> &o) {
    constexpr int64_t kMaxGroup = 16;
    const int64_t M = xq.M, N = w.rows(), rb = w.row_bytes(), nb = xq.nb;
    const uint8_t *w0 = w.row(0);
    const PrefillFns k = prefill_fns(w.format(), w.layout());
    const DecodeU8Fn dec = k.dec;
    const ColumnU8Fn fn_u8 = k.u8;
    const XTile32 *xt = dec ? pack_x(xq, k.pair_tiles) : nullptr;
    const ColumnPairFn fp = k.kpairs;
    const XPair256 *xp = fp ? pack_x_pairs(xq) : nullptr;
    const ColumnFn fn = k.column;
    // x rows a pass: a packed tile; on the K-quants' pair path one 8-row tile (4 pairs), whose blocks (K = 2048:
    // 20 KB) stay in L1 beside the group's 16 W rows (18 KB of Q4_K) while every row of the group reads them; a
    // 64-row chunk (80 KB) was read from L2 by each W row (Q4_K 640 x 2048 at M = 32: 1.16x the 8-row ymm
    // tiles' speed, then 1.5x).
    const int64_t rows = dec ? kPackRows : fp ? 8 : kChunk, group = dec ? 8 : kMaxGroup;
    parallel_ranges(N, M * w.cols() / 4, [&](int64_t begin, int64_t end) {
        WBlockU8 *wb = nullptr; // [group][nb] decoded blocks, then wd [group][nb] scales
        float *wd = nullptr;
        if (dec) {
            wb = reinterpret_cast<WBlockU8 *>(x_buffer<2>(size_t(group * nb) * (sizeof(WBlockU8) + sizeof(float))));
            wd = reinterpret_cast<float *>(wb + group * nb);
        }
        for (int64_t g = begin; g < end; g += group) {
            const int64_t g_end = std::min(end, g + group);
            for (int64_t n = g; dec && n < g_end; ++n) dec(w0 + n * rb, nb, wb + (n - g) * nb, wd + (n - g) * nb);
            for (int64_t m0 = 0; m0 < M; m0 += rows) {
                const int64_t mm = std::min(rows, M - m0);
                float cols[kMaxGroup][kChunk]; // [W row][x row]: written out by x row, so that the stores of
                                               // a column (N floats apart) do not all land in one L1 set
                for (int64_t n = g; n < g_end; ++n) {
                    // The next group's weight rows, asked into L2 while this group computes, a row before each
                    // call of the first x chunk: decode_u8's first load of each block waited on DRAM for two
                    // thirds of its samples (the weights stream once per 32-row chunk). Gemma-3-270M prefill, AVX-512,
                    // 5 interleaved rounds: 1.08x against none, 1.04-1.09x against the whole group at once
                    // before its decode (whose burst of prefetches stalled on the fill buffers).
                    if (m0 == 0 && (dec || fp) && n + group < end)
                        for (int64_t off = 0; off < rb; off += 64) __builtin_prefetch(w0 + (n + group) * rb + off, 0, 2);
                    float *col = cols[n - g];
                    if (dec) fn_u8(wb + (n - g) * nb, wd + (n - g) * nb, xt + m0 / kPackRows * nb, mm, nb, col);
                    else if (fp) fp(w0 + n * rb, xp + m0 / 2 * nb, mm, nb, col);
                    else fn(w0 + n * rb, xq.row(m0), mm, nb, col);
                }
                for (int64_t i = 0; i < mm; ++i)
                    for (int64_t n = g; n < g_end; ++n) o.put(m0 + i, n, cols[n - g][i]);
            }
        }
    });
}

// W [N, K] . x rows (+ bias [N]); threads split the W rows. Rows [0, split) go to out [M, split], rows
// [split, N) to the plane after it, [M, N - split] (quant_linear_swiglu's g and u in one call).
template <typename T>
void run_columns(const QuantizedX &xq, const QuantMatrix &w, const T *bias, T *out, int64_t split) {
    const Outputs<T> o{out, bias, xq.M, w.rows(), split};
    if (xq.M == 1) run_rows<T>(xq, w, o);
    else run_prefill<T>(xq, w, o);
}

// Decode's quant_linear_swiglu: each task takes gate rows [n, n + 64) and the up rows I + [n, n + 64),
// rounds both to T and applies the swiglu op's arithmetic (swiglu_span) while they are in L1: one pool job
// instead of two and no [2, I] buffer, with the bits of linear then swiglu.
template <typename T>
void decode_swiglu(const QuantizedX &xq, const QuantMatrix &w, T *out) {
    const int64_t I = w.rows() / 2, rb = w.row_bytes();
    const uint8_t *w0 = w.row(0);
    const RowsFn fn = rows_fn(w.format(), w.layout());
    parallel_ranges(I, 2 * w.cols() / 4, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; n += kChunk) {
            float g[kChunk], u[kChunk];
            T gt[kChunk], ut[kChunk];
            const int64_t nn = std::min(kChunk, end - n);
            fn(w0 + n * rb, rb, nn, xq.row(0), xq.nb, g);
            fn(w0 + (I + n) * rb, rb, nn, xq.row(0), xq.nb, u);
            for (int64_t i = 0; i < nn; ++i) store(gt, i, g[i]), store(ut, i, u[i]);
            swiglu_span(out + n, gt, ut, nn);
        }
    });
}

} // namespace

void quant_linear(const Tensor &out, const Tensor &x, const QuantMatrix &weight, const Tensor &bias) {
    detail::dispatch_float("quant_linear", x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        const QuantizedX xq = quantize_x<T>(x, weight.format());
        run_columns<T>(xq, weight, bias.defined() ? bias.data_as<T>() : nullptr, out.data_as<T>(), weight.rows());
    });
}

// x is quantized once for both halves; g and u are rounded to T, then combined by the swiglu kernel,
// as two quant_linear calls and a swiglu would.
void quant_linear_swiglu(const Tensor &out, const Tensor &x, const QuantMatrix &w_gate_up) {
    const int64_t M = out.size(0), I = out.size(1);
    detail::dispatch_float("quant_linear_swiglu", x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        const QuantizedX xq = quantize_x<T>(x, w_gate_up.format());
        if (M == 1) return decode_swiglu<T>(xq, w_gate_up, out.data_as<T>());
        const Tensor gu = Tensor::empty({2, M, I}, out.dtype()); // [g; u], each [M, I]
        const Tensor g = gu.select(0, 0), u = gu.select(0, 1);
        run_columns<T>(xq, w_gate_up.slice_rows(0, 2 * I), nullptr, gu.data_as<T>(), I); // g and u in one pass
        ::llaisys::ops::swiglu(out, g, u); // the swiglu op (llaisys/ops.hpp)
    });
}

namespace {
// Row i of out [n, D] (contiguous) = W row row_of(i) decoded (gguf-py's f32 arithmetic, then one rounding
// to out's dtype); rows in parallel. What embedding (rows picked by ids) and dequantize (every row) share.
template <class RowOf>
void decode_rows(const char *op, const Tensor &out, const QuantMatrix &weight, int64_t n, RowOf row_of) {
    const int64_t D = weight.cols();
    detail::dispatch_float(op, out.dtype(), out.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        T *o = out.data_as<T>();
        parallel_for(n, D, [&](int64_t i) {
            if constexpr (std::is_same_v<T, float>) {
                dequantize_rows(weight, row_of(i), 1, o + i * D);
            } else {
                std::vector<float> row(static_cast<size_t>(D)); // [D]
                dequantize_rows(weight, row_of(i), 1, row.data());
                for (int64_t k = 0; k < D; ++k) store(o + i * D, k, row[size_t(k)]);
            }
        });
    });
}
} // namespace

void quant_embedding(const Tensor &out, const Tensor &ids, const QuantMatrix &weight) {
    detail::dispatch_index("quant_embedding", ids.dtype(), ids.device(), [&](auto itag) {
        const auto *id = ids.data_as<typename decltype(itag)::type>();
        decode_rows("quant_embedding", out, weight, ids.numel(), [id](int64_t i) { return int64_t(id[i]); });
    });
}

void quant_dequantize(const Tensor &out, const QuantMatrix &weight) {
    decode_rows("quant_dequantize", out, weight, weight.rows(), [](int64_t i) { return i; });
}

} // namespace llaisys::ops::cpu

namespace llaisys {

bool quant_cpu_path_supported(QuantCpuPath path) {
    switch (path) {
    case QuantCpuPath::Auto:
    case QuantCpuPath::Portable: return true;
    case QuantCpuPath::Avx2: return ops::cpu::kBest != QuantCpuPath::Portable;
    case QuantCpuPath::Avx512Vnni: return ops::cpu::kBest == QuantCpuPath::Avx512Vnni;
    }
    return false;
}

void set_quant_cpu_path(QuantCpuPath path) {
    LLAISYS_CHECK(quant_cpu_path_supported(path), std::invalid_argument, "set_quant_cpu_path: this CPU cannot run ",
                  quant_cpu_path_name(path), " (best here: ", quant_cpu_path_name(ops::cpu::kBest), ")");
    ops::cpu::g_path = path == QuantCpuPath::Auto ? ops::cpu::kBest : path;
}

QuantCpuPath quant_cpu_path() { return ops::cpu::g_path.load(); }

namespace {
std::atomic<bool> g_cpu_split{true};
}

void set_quant_cpu_split(bool on) { g_cpu_split = on; }

QuantLayout quant_cpu_layout(QuantFormat format, int64_t cols) {
    const bool split = g_cpu_split.load() && format == QuantFormat::Q5_0 && cols <= kQuantCpuSplitMaxCols &&
                       ops::cpu::kBest == QuantCpuPath::Avx2;
    return split ? QuantLayout::Q5Split : QuantLayout::File;
}

const char *quant_cpu_path_name(QuantCpuPath path) {
    switch (path) {
    case QuantCpuPath::Auto: return "auto";
    case QuantCpuPath::Portable: return "portable";
    case QuantCpuPath::Avx2: return "avx2";
    case QuantCpuPath::Avx512Vnni: return "avx512vnni";
    }
    return "?";
}

QuantCpuPath quant_cpu_path_from_name(const std::string &name) {
    for (QuantCpuPath p : {QuantCpuPath::Auto, QuantCpuPath::Portable, QuantCpuPath::Avx2, QuantCpuPath::Avx512Vnni})
        if (name == quant_cpu_path_name(p)) return p;
    throw std::invalid_argument("unknown quantized CPU path '" + name + "' (expected auto, portable, avx2 or avx512vnni)");
}

} // namespace llaisys
