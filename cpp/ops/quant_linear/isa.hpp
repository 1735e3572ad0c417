// The vector operations the quantized dot products are written in, for three instruction sets.
//
// B holds 32 bytes (weights as u8 0..63 or s8, activations as s8), I 8 int32 lanes, F 8 float lanes.
// The dot products sum 4 adjacent byte products per lane: lane k = sum over elements 4k..4k+3, so
// lanes 0-3 cover elements 0-15 and lanes 4-7 elements 16-31 (per-16 scales apply to lane halves).
// Portable computes exactly what Avx2 computes, lane by lane and in the same float order (fmadd is
// one fused rounding, hsum adds the halves, then pairs), so both give the same bits.
//
// Avx2 and Avx512Vnni carry their own target attributes, so a build without -march=native still has
// them; cpu.cpp only calls them after checking the CPU at run time.
#pragma once
#include "llaisys/dtype.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define LLAISYS_QUANT_X86 1
#endif

namespace llaisys::ops::cpu::quant_isa {

struct Portable {
    struct B {
        uint8_t b[32];
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
    // 16 bytes -> their low nibbles (bytes 0-15), then their high nibbles (bytes 16-31).
    static B nibbles16(const uint8_t *p) {
        B r;
        for (int j = 0; j < 16; ++j) r.b[j] = p[j] & 0x0F, r.b[j + 16] = p[j] >> 4;
        return r;
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
    // Byte j = value if bit j of `bits` is set, else 0.
    static B bits_to_bytes(uint32_t bits, uint8_t value) {
        B r;
        for (int j = 0; j < 32; ++j) r.b[j] = (bits >> j) & 1 ? value : 0;
        return r;
    }
    // w as u8 (or s8 for dot_ss) times x as s8; lanes as described above. The scaled form multiplies
    // lanes 0-3 by s_lo and lanes 4-7 by s_hi.
    static I dot_us_scaled(B w, B x, int s_lo, int s_hi) {
        I r;
        for (int k = 0; k < 8; ++k) {
            int32_t s = 0;
            for (int j = 4 * k; j < 4 * k + 4; ++j) s += int32_t(w.b[j]) * int8_t(x.b[j]);
            r.v[k] = s * (k < 4 ? s_lo : s_hi);
        }
        return r;
    }
    static I dot_us(B w, B x) { return dot_us_scaled(w, x, 1, 1); }
    static I dot_ss(B w, B x) {
        I r;
        for (int k = 0; k < 8; ++k) {
            int32_t s = 0;
            for (int j = 4 * k; j < 4 * k + 4; ++j) s += int32_t(int8_t(w.b[j])) * int8_t(x.b[j]);
            r.v[k] = s;
        }
        return r;
    }
    static I zero_i() { return I{}; }
    static I add(I a, I b) {
        for (int k = 0; k < 8; ++k) a.v[k] += b.v[k];
        return a;
    }
    static F zero_f() { return F{}; }
    static F fmadd(F acc, I v, float s) { // acc + float(v) * s, one rounding per lane
        for (int k = 0; k < 8; ++k) acc.v[k] = std::fma(float(v.v[k]), s, acc.v[k]);
        return acc;
    }
    static float hsum(F a) {
        float h[4];
        for (int k = 0; k < 4; ++k) h[k] = a.v[k] + a.v[k + 4];
        return (h[0] + h[2]) + (h[1] + h[3]);
    }
};

#ifdef LLAISYS_QUANT_X86
#define LLAISYS_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define LLAISYS_TARGET_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

struct Avx2 {
    using B = __m256i;
    using I = __m256i;
    using F = __m256;

    LLAISYS_TARGET_AVX2 static float fp16(f16_t h) { return _cvtsh_ss(h.bits); }
    LLAISYS_TARGET_AVX2 static B load(const void *p) { return _mm256_loadu_si256(static_cast<const __m256i *>(p)); }
    LLAISYS_TARGET_AVX2 static B nibbles16(const uint8_t *p) {
        const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i *>(p));
        return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
    }
    // 16-bit shifts move bits across bytes, but only into positions the mask clears.
    LLAISYS_TARGET_AVX2 static B field(B v, int shift, uint8_t mask, int up) {
        const __m256i m = _mm256_set1_epi8(char(mask << up));
        if (shift >= up) return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift - up)), m);
        return _mm256_and_si256(_mm256_sll_epi16(v, _mm_cvtsi32_si128(up - shift)), m);
    }
    LLAISYS_TARGET_AVX2 static B or_(B a, B b) { return _mm256_or_si256(a, b); }
    // Byte j takes byte j / 8 of `bits`, keeps bit j % 8, and becomes all ones where it was set.
    LLAISYS_TARGET_AVX2 static B bits_to_bytes(uint32_t bits, uint8_t value) {
        const __m256i spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(int(bits)),
            _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
        const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201));
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        return _mm256_and_si256(set, _mm256_set1_epi8(char(value)));
    }
    // maddubs: u8 x s8 pairs -> i16 (at most 2 * 63 * 127 or 2 * 128 * 127: never saturates here);
    // madd with the scales then sums pairs of those into i32 lanes.
    LLAISYS_TARGET_AVX2 static I dot_us_scaled(B w, B x, int s_lo, int s_hi) {
        const __m256i s = _mm256_set_m128i(_mm_set1_epi16(short(s_hi)), _mm_set1_epi16(short(s_lo)));
        return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), s);
    }
    LLAISYS_TARGET_AVX2 static I dot_us(B w, B x) {
        return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
    }
    // s8 x s8 as |w| (u8) x (x with w's sign).
    LLAISYS_TARGET_AVX2 static I dot_ss(B w, B x) { return dot_us(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); }
    LLAISYS_TARGET_AVX2 static I zero_i() { return _mm256_setzero_si256(); }
    LLAISYS_TARGET_AVX2 static I add(I a, I b) { return _mm256_add_epi32(a, b); }
    LLAISYS_TARGET_AVX2 static F zero_f() { return _mm256_setzero_ps(); }
    LLAISYS_TARGET_AVX2 static F fmadd(F acc, I v, float s) {
        return _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(s), acc);
    }
    LLAISYS_TARGET_AVX2 static float hsum(F a) {
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); // lanes k + (k + 4)
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));                                         // (0 + 2), (1 + 3)
        return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    }
};

// VPDPBUSD does Avx2's maddubs + madd in one instruction, with 32-bit sums (256-bit form, AVX512VL).
struct Avx512Vnni : Avx2 {
    LLAISYS_TARGET_VNNI static I dot_us(B w, B x) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x); }
    LLAISYS_TARGET_VNNI static I dot_ss(B w, B x) { return dot_us(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); }
};
#endif

} // namespace llaisys::ops::cpu::quant_isa
