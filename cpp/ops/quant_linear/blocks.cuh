// Device readers of the GGUF block formats (layouts: quant/formats.hpp). Every format is read in
// sub-blocks of 32 weights, which is what one thread of the CUDA kernels takes: the 32 codes packed 4 to
// an int (element order, ready for __dp4a) and the numbers that turn code q_j into weight j:
//   w_j = (d * isc[j / 16]) * (q_j - off) - dm
// Q4_0/Q5_0/Q8_0: isc = 1, off = 8/16/0, dm = 0. Q4_K/Q5_K: isc = the sub-block's 6-bit scale,
// off = 0, dm = dmin * m. Q6_K: isc = the two 16-weight groups' int8 scales, off = 32, dm = 0.
// Evaluated in that order in f32 (decode()), it is the f32 arithmetic of gguf-py's dequantize.
#pragma once
#include "ops/common/cuda.cuh"
#include "quant/formats.hpp"

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace llaisys::ops::cuda::qblocks {

struct Sub32 {
    int q[8];   // codes 4j..4j+3 in int j: u8 0..63, or s8 for Q8_0
    float d;    // the block's scale (f16 in the block)
    int isc[2]; // integer scales of weights 0-15 and 16-31
    int off;    // offset of the unsigned codes
    float dm;   // subtracted from each weight after scaling (K-quants' mins)
};

// Loads from global memory through the read-only path.
struct Ldg {
    __device__ static uint16_t u16(const uint8_t *p) { return __ldg(reinterpret_cast<const unsigned short *>(p)); }
    __device__ static uint32_t u32(const uint8_t *p) { return __ldg(reinterpret_cast<const uint32_t *>(p)); }
    __device__ static uint4 u128(const uint8_t *p) { return __ldg(reinterpret_cast<const uint4 *>(p)); }
};

// N consecutive 4-byte words from p (aligned to Align bytes). At 2-byte alignment these are N + 1
// aligned loads joined by funnel shifts rather than 2N half-word loads: the GEMV at batch 1 is bound by
// load instructions, not bytes. The word past the run is loaded only when p is misaligned, so a run
// ending at the end of an allocation reads nothing beyond it.
template <int Align, int N>
__device__ __forceinline__ void ld_words(uint32_t (&w)[N], const uint8_t *p) {
    if constexpr (Align >= 4) {
#pragma unroll
        for (int i = 0; i < N; ++i) w[i] = Ldg::u32(p + 4 * i);
    } else {
        const uintptr_t a = reinterpret_cast<uintptr_t>(p);
        const uint8_t *base = p - (a & 3);
        const unsigned shift = unsigned(a & 3) * 8; // 0 or 16
        uint32_t next[N + 1];
#pragma unroll
        for (int i = 0; i < N; ++i) next[i] = Ldg::u32(base + 4 * i);
        next[N] = shift ? Ldg::u32(base + 4 * N) : 0u;
#pragma unroll
        for (int i = 0; i < N; ++i) w[i] = __funnelshift_r(next[i], next[i + 1], shift);
    }
}
__device__ __forceinline__ float half_bits(uint32_t h) { return __half2float(__ushort_as_half(uint16_t(h))); }
// Bits 0-3 of b moved to bit 4 of bytes 0-3 (a fifth code bit per byte).
__device__ __forceinline__ int spread4(uint32_t b) {
    return int((b & 1) << 4 | (b & 2) << 11 | (b & 4) << 18 | (b & 8) << 25);
}

static_assert(offsetof(quant::BlockQ4_0, qs) == 2 && offsetof(quant::BlockQ5_0, qh) == 2 &&
              offsetof(quant::BlockQ5_0, qs) == 6 && offsetof(quant::BlockQ8_0, qs) == 2);

// Q4_0 and Q5_0 (kFifth): qs[j] holds weight j (low nibble) and j + 16 (high); Q5_0's qh bit j is
// weight j's fifth bit.
template <bool kFifth>
struct Q4_0or5_0 {
    using Block = std::conditional_t<kFifth, quant::BlockQ5_0, quant::BlockQ4_0>;
    static constexpr int kBK = 32, kBytes = sizeof(Block), kAlign = 2, kSubs = 1;
    static constexpr bool kSigned = false, kOffsets = true;
    __device__ static Sub32 sub(const uint8_t *b, int) {
        Sub32 r{{}, half_bits(Ldg::u16(b)), {1, 1}, kFifth ? 16 : 8, 0.f};
        constexpr int kWords = kFifth ? 5 : 4; // Q5_0's qh (4 bytes) sits right before qs
        uint32_t w[kWords];
        ld_words<2>(w, b + 2);
        const uint32_t qh = kFifth ? w[0] : 0u;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t q = w[kWords - 4 + i];
            r.q[i] = int(q & 0x0F0F0F0Fu);
            r.q[4 + i] = int((q >> 4) & 0x0F0F0F0Fu);
            if constexpr (kFifth) r.q[i] |= spread4(qh >> (4 * i)), r.q[4 + i] |= spread4(qh >> (16 + 4 * i));
        }
        return r;
    }
};

struct Q8_0 {
    using Block = quant::BlockQ8_0;
    static constexpr int kBK = 32, kBytes = sizeof(Block), kAlign = 2, kSubs = 1;
    static constexpr bool kSigned = true, kOffsets = false;
    __device__ static Sub32 sub(const uint8_t *b, int) {
        Sub32 r{{}, half_bits(Ldg::u16(b)), {1, 1}, 0, 0.f};
        uint32_t w[8];
        ld_words<2>(w, b + offsetof(Block, qs));
#pragma unroll
        for (int i = 0; i < 8; ++i) r.q[i] = int(w[i]);
        return r;
    }
};

// Q4_K and Q5_K (kFifth): sub-block s is the low (even s) or high (odd s) nibbles of qs[32 (s / 2) + l],
// Q5_K adds bit s of qh[l]. Blocks of 144 and 176 bytes keep 4-byte alignment. (16-byte loads of the
// head and codes measured no faster on the H100: 1536 -> 2 x 8960 + SwiGLU 10.3 -> 10.9 us.)
template <bool kFifth>
struct QxK {
    using Block = std::conditional_t<kFifth, quant::BlockQ5_K, quant::BlockQ4_K>;
    static constexpr int kBK = 256, kBytes = sizeof(Block), kAlign = 4, kSubs = 8;
    static constexpr bool kSigned = false, kOffsets = true;
    __device__ static Sub32 sub(const uint8_t *b, int s) {
        uint8_t sc, m;
        quant::scale_min_k4(b + offsetof(Block, scales), s, sc, m);
        Sub32 r{{}, half_bits(Ldg::u16(b)), {sc, sc}, 0, half_bits(Ldg::u16(b + 2)) * float(m)};
        const uint8_t *qs = b + offsetof(Block, qs) + 32 * (s / 2);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            r.q[i] = int((Ldg::u32(qs + 4 * i) >> (4 * (s % 2))) & 0x0F0F0F0Fu);
            if constexpr (kFifth)
                r.q[i] |= int(((Ldg::u32(b + offsetof(quant::BlockQ5_K, qh) + 4 * i) >> s) & 0x01010101u) << 4);
        }
        return r;
    }
};

// Q6_K: sub-block s = 4h + c is weights 128h + 32c + l: low 4 bits from ql[64h + 32 (c % 2) + l]
// (nibble c / 2), high 2 bits from qh[32h + l] (bits 2c, 2c + 1); groups 8h + 2c and + 1 of 16.
// 210-byte blocks sit 2 bytes apart: runs of words (ld_words), the two scales in one 2-byte load.
struct Q6_K {
    using Block = quant::BlockQ6_K;
    static constexpr int kBK = 256, kBytes = sizeof(Block), kAlign = 2, kSubs = 8;
    static constexpr bool kSigned = false, kOffsets = true;
    __device__ static Sub32 sub(const uint8_t *b, int s) {
        const int h = s / 4, c = s % 4, g = 8 * h + 2 * c;
        const uint16_t sc2 = Ldg::u16(b + offsetof(Block, scales) + g);
        Sub32 r{{}, half_bits(Ldg::u16(b + offsetof(Block, d))), {int(int8_t(sc2 & 0xFFu)), int(int8_t(sc2 >> 8))}, 32, 0.f};
        uint32_t ql[8], qh[8];
        ld_words<2>(ql, b + offsetof(Block, ql) + 64 * h + 32 * (c % 2));
        ld_words<2>(qh, b + offsetof(Block, qh) + 32 * h);
#pragma unroll
        for (int i = 0; i < 8; ++i)
            r.q[i] = int(((ql[i] >> (4 * (c / 2))) & 0x0F0F0F0Fu) | ((qh[i] >> (2 * c)) & 0x03030303u) << 4);
        return r;
    }
};

// ---- Chunks: the K-quant GEMV's unit (quant_gemv_kq_kernel in cuda.cu) ----
// A 256-weight block is read by 8 lanes, lane c taking chunk c: 16 bytes of its codes, which hold two runs of
// 16 weights (A and B, kRunGap apart; A starts at run_a(c)). Lanes c of consecutive blocks read consecutive
// bytes, so a warp's loads of one block are one contiguous span instead of 8 overlapping 32-byte reads per
// sub-block. Each lane loads the block's scales itself (the 8 lanes' loads of them are one broadcast).
// load() only issues the loads (Raw holds the words as they came), decode() turns them into the runs' codes
// and scales, so a lane can have several blocks in flight before it needs any of them.
struct Chunk {
    int q[2][4];  // codes of runs A and B, 4 to an int (element order)
    float d;      // the block's scale
    int isc[2];   // integer scales of A and B
    int off;      // offset of the unsigned codes
    float dm[2];  // subtracted from each weight of A and B after scaling (K-quants' mins)
};

// 4 words from a 16-byte run at p: one 16-byte load when the run is so aligned (kV16), else four 4-byte ones
// (the same words, so the same bits).
template <bool kV16>
__device__ __forceinline__ void ld_run16(uint32_t (&w)[4], const uint8_t *p) {
    if constexpr (kV16) {
        const uint4 v = Ldg::u128(p);
        w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = Ldg::u32(p + 4 * i);
    }
}

// Byte k (0..11) of the 12 scale bytes held in three words.
__device__ __forceinline__ uint32_t byte12(const uint32_t (&s)[3], int k) {
    const uint32_t w = k < 4 ? s[0] : k < 8 ? s[1] : s[2];
    return (w >> (8 * (k & 3))) & 0xFFu;
}
// scale_min_k4 (quant/formats.hpp) over the scale bytes held in words: j is known only at run time, and a
// byte pointer into a local array would put that array in local memory.
__device__ __forceinline__ void scale_min_words(const uint32_t (&s)[3], int j, int &sc, int &m) {
    if (j < 4) {
        sc = int(byte12(s, j) & 63), m = int(byte12(s, j + 4) & 63);
    } else {
        sc = int((byte12(s, j + 4) & 0x0F) | ((byte12(s, j - 4) >> 6) << 4));
        m = int((byte12(s, j + 4) >> 4) | ((byte12(s, j) >> 6) << 4));
    }
}

// Q4_K and Q5_K: chunk c is qs bytes 16c..16c+15, i.e. positions 16 (c % 2)..+15 of sub-blocks 2 (c / 2)
// (low nibbles, run A) and 2 (c / 2) + 1 (high nibbles, run B); Q5_K's fifth bits are qh at the same
// positions, bits 2 (c / 2) and + 1. Blocks of 144 and 176 bytes: 16-byte aligned when the matrix is.
template <bool kFifth>
struct KChunkQxK {
    using Block = std::conditional_t<kFifth, quant::BlockQ5_K, quant::BlockQ4_K>;
    static constexpr int kRunGap = 32;
    struct Raw {
        uint32_t head[4]; // d, dmin (f16 each), the 12 scale bytes
        uint32_t qs[4];
        uint32_t qh[kFifth ? 4 : 1];
    };
    __device__ static int run_a(int c) { return 64 * (c / 2) + 16 * (c % 2); }
    template <bool kV16>
    __device__ static void load(Raw &r, const uint8_t *b, int c) {
        ld_run16<kV16>(r.head, b);
        ld_run16<kV16>(r.qs, b + offsetof(Block, qs) + 16 * c);
        if constexpr (kFifth) ld_run16<kV16>(r.qh, b + offsetof(quant::BlockQ5_K, qh) + 16 * (c % 2));
    }
    __device__ static Chunk decode(const Raw &r, int c) {
        const int s0 = 2 * (c / 2);
        const uint32_t sw[3] = {r.head[1], r.head[2], r.head[3]};
        int sc0, m0, sc1, m1;
        scale_min_words(sw, s0, sc0, m0);
        scale_min_words(sw, s0 + 1, sc1, m1);
        const float dmin = half_bits(r.head[0] >> 16);
        Chunk k{{}, half_bits(r.head[0]), {sc0, sc1}, 0, {dmin * float(m0), dmin * float(m1)}};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            k.q[0][i] = int(r.qs[i] & 0x0F0F0F0Fu);
            k.q[1][i] = int((r.qs[i] >> 4) & 0x0F0F0F0Fu);
            if constexpr (kFifth) {
                k.q[0][i] |= int(((r.qh[i] >> s0) & 0x01010101u) << 4);
                k.q[1][i] |= int(((r.qh[i] >> (s0 + 1)) & 0x01010101u) << 4);
            }
        }
        return k;
    }
};

// Q6_K: chunk c is ql bytes 16c..16c+15: in half h = c / 4, positions 16 (c % 4)..+15 (low nibbles, run A)
// and 64 further (high nibbles, run B); their top 2 bits are qh[32 h + 16 (c % 2) ..] bits 2 ((c % 4) / 2)
// and + 4; scales sc[8 h + c % 4] and + 4. 210-byte blocks sit 2 bytes apart: runs of words (ld_words).
struct KChunkQ6_K {
    using Block = quant::BlockQ6_K;
    static constexpr int kRunGap = 64;
    struct Raw {
        uint32_t ql[5], qh[5]; // the aligned words covering each 16-byte run (joined in decode())
        uint32_t shift;        // 0 or 16: where the runs start within their first word
        uint32_t sc;           // the scale bytes of A (bits 0-7) and B (bits 8-15)
        uint32_t d;
    };
    __device__ static int run_a(int c) { return 128 * (c / 4) + 16 * (c % 4); }
    // Both runs start at the block's 4-byte phase, and the word after each lies inside the block.
    template <bool kV16>
    __device__ static void load(Raw &r, const uint8_t *b, int c) {
        const int h = c / 4;
        const uintptr_t phase = reinterpret_cast<uintptr_t>(b) & 3;
        const uint8_t *ql = b - phase + offsetof(Block, ql) + 16 * c, *qh = b - phase + offsetof(Block, qh) + 32 * h + 16 * (c % 2);
#pragma unroll
        for (int i = 0; i < 5; ++i) r.ql[i] = Ldg::u32(ql + 4 * i), r.qh[i] = Ldg::u32(qh + 4 * i);
        r.shift = uint32_t(phase) * 8;
        const uint8_t *sc = b + offsetof(Block, scales) + 8 * h + c % 4;
        r.sc = uint32_t(__ldg(sc)) | uint32_t(__ldg(sc + 4)) << 8;
        r.d = Ldg::u16(b + offsetof(Block, d));
    }
    __device__ static Chunk decode(const Raw &r, int c) {
        const int sh = 2 * ((c % 4) / 2);
        Chunk k{{}, half_bits(r.d), {int(int8_t(r.sc & 0xFFu)), int(int8_t(r.sc >> 8))}, 32, {0.f, 0.f}};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t ql = __funnelshift_r(r.ql[i], r.ql[i + 1], r.shift);
            const uint32_t qh = __funnelshift_r(r.qh[i], r.qh[i + 1], r.shift);
            k.q[0][i] = int((ql & 0x0F0F0F0Fu) | ((qh >> sh) & 0x03030303u) << 4);
            k.q[1][i] = int(((ql >> 4) & 0x0F0F0F0Fu) | ((qh >> (sh + 4)) & 0x03030303u) << 4);
        }
        return k;
    }
};

template <class F>
struct KChunkOf;
template <bool kFifth>
struct KChunkOf<QxK<kFifth>> {
    using type = KChunkQxK<kFifth>;
};
template <>
struct KChunkOf<Q6_K> {
    using type = KChunkQ6_K;
};

// Weight j (0..31) of a sub-block, in gguf-py's f32 operations (the _rn intrinsics keep nvcc from
// fusing them into an FMA).
template <class F>
__device__ __forceinline__ float decode(const Sub32 &r, int j) {
    const uint32_t byte = (uint32_t(r.q[j / 4]) >> (8 * (j % 4))) & 0xFFu;
    const int q = F::kSigned ? int(int8_t(byte)) : int(byte);
    return __fsub_rn(__fmul_rn(__fmul_rn(r.d, float(r.isc[j / 16])), float(q - r.off)), r.dm);
}

// Calls fn(F{}) with the reader of `format`.
template <class Fn>
void dispatch_format(QuantFormat format, Fn &&fn) {
    switch (format) {
    case QuantFormat::Q4_0: return fn(Q4_0or5_0<false>{});
    case QuantFormat::Q4_K: return fn(QxK<false>{});
    case QuantFormat::Q5_0: return fn(Q4_0or5_0<true>{});
    case QuantFormat::Q5_K: return fn(QxK<true>{});
    case QuantFormat::Q6_K: return fn(Q6_K{});
    case QuantFormat::Q8_0: return fn(Q8_0{});
    }
}

} // namespace llaisys::ops::cuda::qblocks
