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
