// The vector operations the quantized dot products are written in, for three instruction sets.
//
// B holds 32 bytes (weights as u8 or s8, activations as s8), W 16 int16 lanes, I 8 int32 lanes, F 8
// float lanes. The dot products sum 4 adjacent byte products per lane: lane k = sum over elements
// 4k..4k+3, so lanes 0-3 cover elements 0-15 and lanes 4-7 elements 16-31. Every integer result is
// exact (no saturation is reachable with the operands the kernels pass), so the three ISAs give the
// same integers however they compute them; the float operations (fmadd: one fused rounding per lane,
// hsum: the halves, then pairs) are the same lane by lane, so all paths give the same bits.
//
// Avx2 and Avx512Vnni carry their own target attributes, so a build without -march=native still has
// them; cpu.cpp only calls them after checking the CPU at run time.
#pragma once
#include "llaisys/dtype.hpp"
#include "quant/formats.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define LLAISYS_QUANT_X86 1
#endif

namespace llaisys::ops::cpu::quant_isa {

struct Portable {
    static constexpr int kTileRows = 4; // x rows per unpacked W block (kernels.inc: column)
    static constexpr bool kU8Act = false; // no prefill kernel on x's codes + 128 (kernels.inc: column_u8)
    static constexpr bool kPairTile = false; // no 512-bit pair tile (Avx512Vnni's)
    struct B {
        uint8_t b[32];
    };
    struct W {
        int16_t v[16];
    };
    struct I {
        int32_t v[8];
    };
    struct F {
        float v[8];
    };

    static float fp16(f16_t h) { return to_float(h); }
    static B load(const void *p) {
        B r;
        std::memcpy(r.b, p, 32);
        return r;
    }
    static I load_i(const int32_t *p) {
        I r;
        std::memcpy(r.v, p, 32);
        return r;
    }
    static W load_w(const int16_t *p) {
        W r;
        std::memcpy(r.v, p, 32);
        return r;
    }
    // 16 bytes -> their low nibbles (bytes 0-15), then their high nibbles (bytes 16-31).
    static B nibbles16(const uint8_t *p) {
        B r;
        for (int j = 0; j < 16; ++j) r.b[j] = p[j] & 0x0F, r.b[j + 16] = p[j] >> 4;
        return r;
    }
    // Q5_0's codes: nibbles16(qs) with bit j of qh as the fifth bit of byte j (u8 0..31).
    static B q5(const uint8_t *qs, uint32_t qh) {
        B r = nibbles16(qs);
        for (int j = 0; j < 32; ++j) r.b[j] |= uint8_t(((qh >> j) & 1) << 4);
        return r;
    }
    // Q5_0's codes in QuantLayout::Q5Split: nibbles16(qs), the fifth bits from the 8 bytes of their block
    // pair (quant::q5_split_bit says where each bit is; odd: the pair's second block).
    static B q5_split(const uint8_t *qs, const uint8_t *pair, bool odd) {
        uint64_t p;
        std::memcpy(&p, pair, 8);
        B r = nibbles16(qs);
        for (int j = 0; j < 32; ++j) r.b[j] |= uint8_t(((p >> quant::q5_split_bit(j, odd)) & 1) << 4);
        return r;
    }
    // out[i] = fp16(d[i]) * xd[i] for 8 blocks (d: 8 f16 bits), each product rounded once.
    static void scales8(const uint8_t *d, const float *xd, float *out) {
        for (int i = 0; i < 8; ++i) {
            f16_t h;
            std::memcpy(&h, d + 2 * i, 2);
            out[i] = fp16(h) * xd[i];
        }
    }
    // ((v >> shift) & mask) << up in each byte (the result fits in the byte).
    static B field(B v, int shift, uint8_t mask, int up) {
        for (uint8_t &x : v.b) x = uint8_t(((x >> shift) & mask) << up);
        return v;
    }
    static B or_(B a, B b) {
        for (int j = 0; j < 32; ++j) a.b[j] |= b.b[j];
        return a;
    }
    // bias + w (u8, at most 63) . x (s8) per lane.
    static I dot_u(B w, B x, I bias) {
        for (int k = 0; k < 8; ++k)
            for (int j = 4 * k; j < 4 * k + 4; ++j) bias.v[k] += int32_t(w.b[j]) * int8_t(x.b[j]);
        return bias;
    }
    // w (s8) . x (s8) per lane; bias128 = -128 * (the lane sums of x), which Avx512Vnni uses.
    static I dot_s(B w, B x, I /*bias128*/) {
        I r;
        for (int k = 0; k < 8; ++k) {
            int32_t s = 0;
            for (int j = 4 * k; j < 4 * k + 4; ++j) s += int32_t(int8_t(w.b[j])) * int8_t(x.b[j]);
            r.v[k] = s;
        }
        return r;
    }
    // acc + lane k of (w (u8, at most 63) . x (s8) over pairs, times sc), i.e. Avx2's madd(maddubs).
    static I dot_scaled(I acc, B w, B x, W sc) {
        for (int k = 0; k < 8; ++k)
            for (int p = 2 * k; p < 2 * k + 2; ++p)
                acc.v[k] += (int32_t(w.b[2 * p]) * int8_t(x.b[2 * p]) + int32_t(w.b[2 * p + 1]) * int8_t(x.b[2 * p + 1])) *
                            int32_t(sc.v[p]);
        return acc;
    }
    // 16 int8 -> 16 int16.
    static W widen_s8(const int8_t *p) {
        W r;
        for (int j = 0; j < 16; ++j) r.v[j] = p[j];
        return r;
    }
    // 8 u8 -> 16 int16, each twice (lane k of madd with it takes byte k).
    static W widen_u8_twice(const uint8_t *p) {
        W r;
        for (int j = 0; j < 16; ++j) r.v[j] = p[j / 2];
        return r;
    }
    // Words 0-7 = s[g], words 8-15 = s[g + 1] (g even).
    static W pair(W s, int g) {
        W r;
        for (int j = 0; j < 16; ++j) r.v[j] = s.v[g + j / 8];
        return r;
    }
    static W set_w(int v) {
        W r;
        for (int16_t &x : r.v) x = int16_t(v);
        return r;
    }
    static I madd(W a, W b) {
        I r;
        for (int k = 0; k < 8; ++k) r.v[k] = int32_t(a.v[2 * k]) * b.v[2 * k] + int32_t(a.v[2 * k + 1]) * b.v[2 * k + 1];
        return r;
    }
    static I zero_i() { return I{}; }
    static I add(I a, I b) {
        for (int k = 0; k < 8; ++k) a.v[k] += b.v[k];
        return a;
    }
    static I sub_shl(I a, I b, int n) { // a - (b << n)
        for (int k = 0; k < 8; ++k) a.v[k] -= int32_t(uint32_t(b.v[k]) << n);
        return a;
    }
    static F zero_f() { return F{}; }
    static F fmadd(F acc, I v, float s) { // acc + float(v) * s, one rounding per lane
        for (int k = 0; k < 8; ++k) acc.v[k] = std::fma(float(v.v[k]), s, acc.v[k]);
        return acc;
    }
    static F fnmadd(F acc, I v, float s) { // acc - float(v) * s, one rounding per lane
        for (int k = 0; k < 8; ++k) acc.v[k] = std::fma(-float(v.v[k]), s, acc.v[k]);
        return acc;
    }
    static F add_f(F a, F b) {
        for (int k = 0; k < 8; ++k) a.v[k] += b.v[k];
        return a;
    }
    static float hsum(F a) {
        float h[4];
        for (int k = 0; k < 4; ++k) h[k] = a.v[k] + a.v[k + 4];
        return (h[0] + h[2]) + (h[1] + h[3]);
    }
    static void prefetch(const void *) {}
};

#ifdef LLAISYS_QUANT_X86
#define LLAISYS_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define LLAISYS_TARGET_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

struct Avx2 {
    // x rows per unpacked W block (kernels.inc: column): 8 rows' integer sums and the unpacked chunks fill the
    // 16 ymm registers; their float accumulators, touched once a block, spill. Unpacking each block half as
    // often as with 4 rows (all in registers) pays more than the spills (K-quants' prefill; bench/RESULTS.md,
    // session 30).
    static constexpr int kTileRows = 8;
    static constexpr bool kU8Act = true; // for the formats whose codes less their offset are small (below)
    static constexpr bool kPairTile = false; // the 8-row tile_u8 (Avx512Vnni: pairs of rows in 512 bits)
    using B = __m256i;
    using W = __m256i;
    using I = __m256i;
    using F = __m256;

    LLAISYS_TARGET_AVX2 static float fp16(f16_t h) { return _cvtsh_ss(h.bits); }
    LLAISYS_TARGET_AVX2 static B load(const void *p) { return _mm256_loadu_si256(static_cast<const __m256i *>(p)); }
    LLAISYS_TARGET_AVX2 static I load_i(const int32_t *p) { return load(p); }
    LLAISYS_TARGET_AVX2 static W load_w(const int16_t *p) { return load(p); }
    // The 16 bytes in both halves, the upper half shifted right by 4 within each 64-bit lane (the mask
    // drops what crossed a byte).
    LLAISYS_TARGET_AVX2 static B nibbles16(const uint8_t *p) {
        const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
        return _mm256_and_si256(_mm256_srlv_epi64(t, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0x0F));
    }
    // Byte j takes byte j / 8 of qh, sets every bit but bit j % 8, and compares with all ones.
    LLAISYS_TARGET_AVX2 static B q5(const uint8_t *qs, uint32_t qh) {
        const __m256i spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(int(qh)),
            _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
        const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                              _mm256_set1_epi64x(-1));
        return _mm256_or_si256(nibbles16(qs), _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    }
    // The pair's 8 bytes in every 64-bit lane: 32-bit lane L holds their dword L % 2, whose byte i has the
    // bit of code 4L + i at 4 + L / 2 (first block) or L / 2 (second): one shift per lane puts it at bit 4
    // (quant::q5_split_bit). 3 operations for the fifth bit instead of q5's 5, and no shuffle. The decode
    // kernel passes odd as a constant; the prefill kernel's passes take one parity each (a branch that
    // never changes within a pass).
    LLAISYS_TARGET_AVX2 static B q5_split(const uint8_t *qs, const uint8_t *pair, bool odd) {
        long long p;
        std::memcpy(&p, pair, 8);
        const __m256i t = _mm256_set1_epi64x(p);
        __m256i h;
        if (odd) h = _mm256_sllv_epi32(t, _mm256_set_epi32(1, 1, 2, 2, 3, 3, 4, 4));
        else h = _mm256_srlv_epi32(t, _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0));
        return _mm256_or_si256(nibbles16(qs), _mm256_and_si256(h, _mm256_set1_epi8(0x10)));
    }
    // 8 f16 -> f32 (exact) times 8 floats: the products scalar code rounds, lane by lane.
    LLAISYS_TARGET_AVX2 static void scales8(const uint8_t *d, const float *xd, float *out) {
        const __m256 w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(d)));
        _mm256_storeu_ps(out, _mm256_mul_ps(w, _mm256_loadu_ps(xd)));
    }
    // 16-bit shifts move bits across bytes, but only into positions the mask clears.
    LLAISYS_TARGET_AVX2 static B field(B v, int shift, uint8_t mask, int up) {
        const __m256i m = _mm256_set1_epi8(char(mask << up));
        if (shift >= up) return _mm256_and_si256(_mm256_srli_epi16(v, shift - up), m);
        return _mm256_and_si256(_mm256_slli_epi16(v, up - shift), m);
    }
    LLAISYS_TARGET_AVX2 static B or_(B a, B b) { return _mm256_or_si256(a, b); }
    // maddubs: u8 x s8 pairs -> i16 (at most 2 * 63 * 127: never saturates here); madd sums pairs.
    LLAISYS_TARGET_AVX2 static I dot_u(B w, B x, I bias) {
        return _mm256_add_epi32(bias, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
    }
    // s8 x s8 as |w| (u8) x (x with w's sign); x is never -128.
    LLAISYS_TARGET_AVX2 static I dot_s(B w, B x, I) {
        return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)),
                                 _mm256_set1_epi16(1));
    }
    LLAISYS_TARGET_AVX2 static I dot_scaled(I acc, B w, B x, W sc) {
        return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), sc));
    }
    LLAISYS_TARGET_AVX2 static W widen_s8(const int8_t *p) {
        return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
    }
    LLAISYS_TARGET_AVX2 static W widen_u8_twice(const uint8_t *p) {
        const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i *>(p)));
        return _mm256_set_m128i(_mm_unpackhi_epi16(w, w), _mm_unpacklo_epi16(w, w));
    }
    LLAISYS_TARGET_AVX2 static W pair(W s, int g) {
        const int j = g % 8; // words j, j + 1 of the half holding g
        const __m256i half = g < 8 ? _mm256_permute2x128_si256(s, s, 0x00) : _mm256_permute2x128_si256(s, s, 0x11);
        const short lo = short((2 * j + 1) << 8 | 2 * j), hi = short((2 * j + 3) << 8 | (2 * j + 2));
        return _mm256_shuffle_epi8(half, _mm256_set_m128i(_mm_set1_epi16(hi), _mm_set1_epi16(lo)));
    }
    LLAISYS_TARGET_AVX2 static W set_w(int v) { return _mm256_set1_epi16(short(v)); }
    LLAISYS_TARGET_AVX2 static I madd(W a, W b) { return _mm256_madd_epi16(a, b); }
    LLAISYS_TARGET_AVX2 static I zero_i() { return _mm256_setzero_si256(); }
    LLAISYS_TARGET_AVX2 static I add(I a, I b) { return _mm256_add_epi32(a, b); }
    LLAISYS_TARGET_AVX2 static I sub_shl(I a, I b, int n) { return _mm256_sub_epi32(a, _mm256_slli_epi32(b, n)); }
    LLAISYS_TARGET_AVX2 static F zero_f() { return _mm256_setzero_ps(); }
    LLAISYS_TARGET_AVX2 static F fmadd(F acc, I v, float s) {
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(s), acc);
    }
    LLAISYS_TARGET_AVX2 static F fnmadd(F acc, I v, float s) {
        return _mm256_fnmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(s), acc);
    }
    LLAISYS_TARGET_AVX2 static F add_f(F a, F b) { return _mm256_add_ps(a, b); }
    LLAISYS_TARGET_AVX2 static float hsum(F a) {
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); // lanes k + (k + 4)
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));                                         // (0 + 2), (1 + 3)
        return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    }
    LLAISYS_TARGET_AVX2 static void prefetch(const void *p) { _mm_prefetch(static_cast<const char *>(p), _MM_HINT_T0); }

    // The packed-x prefill kernel (kernels.inc: column_u8), as Avx512Vnni's but with maddubs + madd for
    // VPDPBUSD: x's codes + 128 (u8, at most 255) times the weight codes less their offset (s8). maddubs
    // sums two such products into an int16, exact only while 2 * 255 * |w| <= 32767, i.e. |w| <= 64:
    // Q4_0 (-8..7) and Q5_0 (-16..15) qualify, Q8_0 (-128..127) does not (kU8Formats). 8 rows a pass:
    // their 8 accumulators, the codes, the correction and the constants fit 16 ymm registers.
    static constexpr int kU8Rows = 8;
    static constexpr bool u8_format_ok(int offset) { return offset <= 64; }
    LLAISYS_TARGET_AVX2 static B sub_i8(B a, int v) { return _mm256_sub_epi8(a, _mm256_set1_epi8(char(v))); }
    LLAISYS_TARGET_AVX2 static void store(void *p, __m256i v) { _mm256_storeu_si256(static_cast<__m256i *>(p), v); }
    LLAISYS_TARGET_AVX2 static I dot_ux(I acc, B xu, B ws) {
        return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(xu, ws), _mm256_set1_epi16(1)));
    }
    // 128 * (w0 + w1) per pair: at most 128 * 2 * 64 in magnitude, exact in int16 for the formats above.
    LLAISYS_TARGET_AVX2 static I neg128_lane_sums(B ws) {
        return _mm256_sub_epi32(_mm256_setzero_si256(), dot_ux(_mm256_setzero_si256(), _mm256_set1_epi8(char(0x80)), ws));
    }
    // out[i] = a * v[i] for 8 floats, each rounded once (the scalar product's bits).
    LLAISYS_TARGET_AVX2 static void scale8(float a, const float *v, float *out) {
        _mm256_store_ps(out, _mm256_mul_ps(_mm256_set1_ps(a), _mm256_load_ps(v)));
    }
};

// VPDPBUSD does maddubs + madd + add in one instruction, VPDPWSSD madd + add (256-bit forms, AVX512VL);
// the fifth bit of Q5_0 goes in through a mask register.
struct Avx512Vnni : Avx2 {
    static constexpr int kTileRows = 8; // AVX-512VL has 32 ymm registers: 8 rows fit
    static constexpr bool kU8Act = true;
    static constexpr bool u8_format_ok(int) { return true; } // VPDPBUSD sums in int32: never saturates
    LLAISYS_TARGET_VNNI static B q5(const uint8_t *qs, uint32_t qh) {
        const __m256i q = nibbles16(qs);
        return _mm256_mask_add_epi8(q, __mmask32(qh), q, _mm256_set1_epi8(0x10));
    }
    LLAISYS_TARGET_VNNI static I dot_u(B w, B x, I bias) { return _mm256_dpbusd_epi32(bias, w, x); }
    // w + 128 as u8: the bias removes 128 * (x's lane sums) again.
    LLAISYS_TARGET_VNNI static I dot_s(B w, B x, I bias128) {
        return _mm256_dpbusd_epi32(bias128, _mm256_xor_si256(w, _mm256_set1_epi8(char(0x80))), x);
    }
    LLAISYS_TARGET_VNNI static I dot_scaled(I acc, B w, B x, W sc) {
        return _mm256_dpwssd_epi32(acc, _mm256_maddubs_epi16(w, x), sc);
    }
    // The prefill kernel of the 32-element formats (kernels.inc: column_u8) takes x's codes + 128 as
    // VPDPBUSD's unsigned operand and the weight codes less their offset (s8) as the signed one; the
    // offset 128 then moves to the weight's side, once per weight block: acc - 128 * (w's lane sums).
    // Every product is at most 255 * 128 in magnitude, four to a lane: exact in int32.
    LLAISYS_TARGET_VNNI static I dot_ux(I acc, B xu, B ws) { return _mm256_dpbusd_epi32(acc, xu, ws); }
    LLAISYS_TARGET_VNNI static I neg128_lane_sums(B ws) {
        const __m256i zero = _mm256_setzero_si256();
        return _mm256_sub_epi32(zero, _mm256_dpbusd_epi32(zero, _mm256_set1_epi8(char(0x80)), ws));
    }

    // The pair tile (kernels.inc: tile_u8_pairs): two x rows of a packed tile per 512-bit vector, row 2p in
    // lanes 0-7 and row 2p + 1 in lanes 8-15, each lane the same 4 products, integer and float operations as
    // the 8 lanes of dot_tile's block; the weight block's codes and correction repeat in both halves.
    static constexpr bool kPairTile = true;
#if defined(__GNUC__) && !defined(__clang__) // GCC 12's 512-bit intrinsics start from a self-initialised
#pragma GCC diagnostic push                  // "undefined" vector: a false -Wuninitialized where they inline
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
    using Z = __m512i;
    using ZF = __m512;
    LLAISYS_TARGET_VNNI static Z load_z(const void *p) { return _mm512_load_si512(p); }
    LLAISYS_TARGET_VNNI static ZF load_zf(const float *p) { return _mm512_load_ps(p); }
    LLAISYS_TARGET_VNNI static Z twice(const void *p) { // 32 bytes in both halves
        return _mm512_broadcast_i64x4(_mm256_load_si256(static_cast<const __m256i *>(p)));
    }
    LLAISYS_TARGET_VNNI static ZF set1_zf(float v) { return _mm512_set1_ps(v); }
    LLAISYS_TARGET_VNNI static ZF zero_zf() { return _mm512_setzero_ps(); }
    LLAISYS_TARGET_VNNI static ZF mul_zf(ZF a, ZF b) { return _mm512_mul_ps(a, b); }
    LLAISYS_TARGET_VNNI static ZF add_zf(ZF a, ZF b) { return _mm512_add_ps(a, b); }
    LLAISYS_TARGET_VNNI static Z dot_ux_z(Z acc, Z xu, Z ws) { return _mm512_dpbusd_epi32(acc, xu, ws); }
    LLAISYS_TARGET_VNNI static ZF fmadd_z(ZF acc, Z v, ZF s) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), s, acc); }
    LLAISYS_TARGET_VNNI static Z dup(B v) { return _mm512_broadcast_i64x4(v); } // v in both halves
    LLAISYS_TARGET_VNNI static Z set1_wz(int v) { return _mm512_set1_epi16(short(v)); }
    LLAISYS_TARGET_VNNI static Z zero_z() { return _mm512_setzero_si512(); }
    LLAISYS_TARGET_VNNI static Z dot_scaled_z(Z acc, Z w, Z x, Z sc) {
        return _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(w, x), sc);
    }
    LLAISYS_TARGET_VNNI static Z madd_z(Z a, Z b) { return _mm512_madd_epi16(a, b); }
    LLAISYS_TARGET_VNNI static Z sub_shl_z(Z a, Z b, int n) { return _mm512_sub_epi32(a, _mm512_slli_epi32(b, n)); }
    LLAISYS_TARGET_VNNI static ZF fnmadd_z(ZF acc, Z v, ZF s) { return _mm512_fnmadd_ps(_mm512_cvtepi32_ps(v), s, acc); }
    LLAISYS_TARGET_VNNI static F lo(ZF a) { return _mm512_castps512_ps256(a); }
    LLAISYS_TARGET_VNNI static F hi(ZF a) {
        return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
};
#endif

} // namespace llaisys::ops::cpu::quant_isa
