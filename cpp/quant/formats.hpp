// The GGUF block layouts (as ggml-common.h defines them; byte sizes checked below) and the small
// helpers every reader of them needs. Weight e of a block is decoded as:
//   Q4_0  d * (q - 8),   q = 4 bits: qs[e] low nibble for e < 16, qs[e - 16] high nibble after
//   Q5_0  d * (q - 16),  q = the Q4_0 nibble | bit e of qh << 4
//   Q8_0  d * q,         q = qs[e] (int8)
//   Q4_K  (d * sc[s]) * q - dmin * m[s], sub-block s = e / 32 of 8, q = qs[32 (s / 2) + e % 32] low
//         nibble for even s, high nibble for odd s; 6-bit sc/m packed in 12 bytes (scale_min_k4)
//   Q5_K  as Q4_K with q |= bit s of qh[e % 32] << 4
//   Q6_K  (d * sc[e / 16]) * (q - 32); in half h = e / 128 (r = e % 128): q = ql[64 h + r % 64] >>
//         4 (r / 64) & 15 | (qh[32 h + r % 32] >> 2 (r / 32) & 3) << 4; sc int8
#pragma once
#include "llaisys/dtype.hpp"

#include <cstdint>

// scale_min_k4 is also called by the CUDA kernels (ops/quant_linear/cuda.cu).
#ifdef __CUDACC__
#define LLAISYS_QUANT_HD __host__ __device__
#else
#define LLAISYS_QUANT_HD
#endif

namespace llaisys::quant {

constexpr int kQK = 32;   // elements per block of Q4_0, Q5_0, Q8_0
constexpr int kQK_K = 256; // elements per block of the K-quants

struct BlockQ4_0 {
    f16_t d;
    uint8_t qs[kQK / 2];
};
struct BlockQ5_0 {
    f16_t d;
    uint8_t qh[4]; // bit e: the fifth bit of weight e (a little-endian uint32)
    uint8_t qs[kQK / 2];
};
struct BlockQ8_0 {
    f16_t d;
    int8_t qs[kQK];
};
struct BlockQ4_K {
    f16_t d, dmin;
    uint8_t scales[12];
    uint8_t qs[kQK_K / 2];
};
struct BlockQ5_K {
    f16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[kQK_K / 8];
    uint8_t qs[kQK_K / 2];
};
struct BlockQ6_K {
    uint8_t ql[kQK_K / 2];
    uint8_t qh[kQK_K / 4];
    int8_t scales[kQK_K / 16];
    f16_t d;
};
static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ5_0) == 22 && sizeof(BlockQ8_0) == 34);
static_assert(sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210);

// The 6-bit scale and min of sub-block s (0..7) of a Q4_K/Q5_K block: bytes 0-3 hold the low 6 bits
// of sc[0..3] (top 2 bits: high bits of sc[4..7]), bytes 4-7 the same for m, bytes 8-11 the low
// nibbles of sc[4..7] | m[4..7] << 4.
LLAISYS_QUANT_HD inline void scale_min_k4(const uint8_t *s, int j, uint8_t &sc, uint8_t &m) {
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = uint8_t((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4));
        m = uint8_t((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

// QuantLayout::Q5Split (llaisys/quant.hpp): a Q5_0 row of nb blocks stored as [nb f16 d][nb x 4 bytes of
// fifth bits][nb x 16 bytes qs], the same 22 bytes a block, so that an AVX2 decode step converts 8 scales
// with one instruction and takes the fifth bits with shifts instead of a shuffle (ops/quant_linear/isa.hpp:
// q5_split). Blocks 2p and 2p + 1 share the 8 fifth-bit bytes at 8p: the bit of code j (L = j / 4,
// i = j % 4) is bit q5_split_bit(j, odd) of them (odd: the second block). When nb is odd the last block's
// 4 bytes are its qh as in the file.
constexpr int q5_split_bit(int j, bool odd) { return 32 * ((j / 4) & 1) + 8 * (j % 4) + (odd ? 0 : 4) + j / 8; }
void q5_split_row(const uint8_t *file_row, int64_t nb, uint8_t *split_row);
void q5_unsplit_row(const uint8_t *split_row, int64_t nb, uint8_t *file_row);

} // namespace llaisys::quant
