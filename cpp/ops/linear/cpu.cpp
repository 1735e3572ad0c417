// CPU linear: out [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]), products accumulated in f32.
//
// Decode (M = 1) reads every weight once, so it is bound by memory bandwidth: threads split the rows
// of W, and each micro tile streams 4 W rows at once against the x row held in L1. Prefill (large M)
// is bound by arithmetic: a micro tile of 4 x rows by 4 W rows keeps 16 accumulators in registers,
// so every loaded vector feeds 4 FMAs, and tasks of [MC x NC] outputs keep their W rows in L2 while
// all their x rows pass over them.
#include "ops/linear/linear.hpp"
#include "ops/linear/small_k.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"
#include "ops/common/cpu.hpp"

#include <memory>
#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 reports the deliberately undefined pass-through operand inside its own AVX-512 intrinsics
// (_mm512_cvtph_ps, _mm512_reduce_add_ps) as maybe-uninitialized: a false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace llaisys::ops::cpu {
namespace {

// ---- The plain version: what every SIMD path below computes, and the portable fallback. ----

// out [M, N] = x [M, K] @ w [N, K]^T + bias [N]; rows of x and w are ldx and ldw elements apart.
template <typename T>
void linear_plain(T *out, const T *x, int64_t ldx, const T *w, int64_t ldw, const T *bias, int64_t M, int64_t N,
                  int64_t K) {
    parallel_for(N, M * K, [&](int64_t n) {
        const T *wn = w + n * ldw; // [K]
        for (int64_t m = 0; m < M; ++m) {
            const T *xm = x + m * ldx; // [K]
            float acc = 0.f;
            for (int64_t k = 0; k < K; ++k) acc += load(xm, k) * load(wn, k);
            if (bias) acc += load(bias, n);
            store(out + m * N, n, acc);
        }
    });
}

#if defined(__AVX2__)
inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

// ---- SIMD steps: how kStep elements of a W row and an x row are loaded and multiplied. ----
// W is the weight's storage type, X the type x is read as (f32, or bf16 for the bf16 dot product),
// Vec what a load returns and Acc the f32 accumulator vector.

#if defined(__AVX512F__)
struct Avx512F32 {
    using W = float;
    using X = float;
    using Vec = __m512;
    using Acc = __m512;
    static constexpr int kStep = 16;
    static Acc zero() { return _mm512_setzero_ps(); }
    static Vec load_w(const W *p) { return _mm512_loadu_ps(p); }
    static Vec load_x(const X *p) { return _mm512_loadu_ps(p); }
    static Acc madd(Acc acc, Vec x, Vec w) { return _mm512_fmadd_ps(x, w, acc); }
    static float sum(Acc acc) { return _mm512_reduce_add_ps(acc); }
};

// f16 weights widened with F16C's 512-bit form (part of AVX-512F).
struct Avx512F16 : Avx512F32 {
    using W = f16_t;
    static Vec load_w(const W *p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p))); }
};

// bf16 is the top half of an f32: widening is a 16-bit shift.
struct Avx512Bf16Shift : Avx512F32 {
    using W = bf16_t;
    static Vec load_w(const W *p) {
        const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
    }
};
#endif

#if defined(__AVX512BF16__)
// bf16 x and W multiplied in pairs by VDPBF16PS: 32 products per instruction, summed into 16 f32
// lanes (pairs of adjacent k). Products of bf16 values are exact in f32; inputs below the bf16
// normal range (< 1.2e-38) count as zero, which no model weight or activation relies on.
struct Avx512Bf16Dot {
    using W = bf16_t;
    using X = bf16_t;
    using Vec = __m512bh;
    using Acc = __m512;
    static constexpr int kStep = 32;
    static Acc zero() { return _mm512_setzero_ps(); }
    static Vec load_w(const W *p) { return (__m512bh)_mm512_loadu_si512(p); }
    static Vec load_x(const X *p) { return (__m512bh)_mm512_loadu_si512(p); }
    static Acc madd(Acc acc, Vec x, Vec w) { return _mm512_dpbf16_ps(acc, x, w); }
    static float sum(Acc acc) { return _mm512_reduce_add_ps(acc); }
};
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct Avx2F32 {
    using W = float;
    using X = float;
    using Vec = __m256;
    using Acc = __m256;
    static constexpr int kStep = 8;
    static Acc zero() { return _mm256_setzero_ps(); }
    static Vec load_w(const W *p) { return _mm256_loadu_ps(p); }
    static Vec load_x(const X *p) { return _mm256_loadu_ps(p); }
    static Acc madd(Acc acc, Vec x, Vec w) { return _mm256_fmadd_ps(x, w, acc); }
    static float sum(Acc acc) { return hsum(acc); }
};
struct Avx2F16 : Avx2F32 {
    using W = f16_t;
    static Vec load_w(const W *p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))); }
};
struct Avx2Bf16Shift : Avx2F32 {
    using W = bf16_t;
    static Vec load_w(const W *p) {
        const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
    }
};
#endif

// The best step this build has for weights of type T; `void` means the plain loops.
template <typename T>
struct BestStep {
    using type = void;
};
#if defined(__AVX512F__)
template <>
struct BestStep<float> {
    using type = Avx512F32;
};
template <>
struct BestStep<f16_t> {
    using type = Avx512F16;
};
#if defined(__AVX512BF16__)
template <>
struct BestStep<bf16_t> {
    using type = Avx512Bf16Dot;
};
#else
template <>
struct BestStep<bf16_t> {
    using type = Avx512Bf16Shift;
};
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
template <>
struct BestStep<float> {
    using type = Avx2F32;
};
template <>
struct BestStep<f16_t> {
    using type = Avx2F16;
};
template <>
struct BestStep<bf16_t> {
    using type = Avx2Bf16Shift;
};
#endif

// ---- The tiled SIMD path. ----

// sums[i][j] = x row i . w row j over K, for MB rows of x (xr[i] [K]) and NB rows of W (wr[j] [K]).
// With `prefetch`, each step also prefetches the same columns of the next NB rows (next[j]): when a W
// tile is used once (decode), short rows (K = 896 is 28 cache lines) end before the hardware
// prefetcher has locked on, and asking one tile ahead keeps the memory pipe full.
template <class S, int MB, int NB, bool prefetch>
void dot_tile(const typename S::X *const (&xr)[MB], const typename S::W *const (&wr)[NB],
              const typename S::W *const (&next)[NB], int64_t K, float (&sums)[MB][NB]) {
    typename S::Acc acc[MB][NB];
    for (int i = 0; i < MB; ++i)
        for (int j = 0; j < NB; ++j) acc[i][j] = S::zero();
    const int64_t k_vec = K / S::kStep * S::kStep;
    for (int64_t k = 0; k < k_vec; k += S::kStep) {
        typename S::Vec wv[NB];
        for (int j = 0; j < NB; ++j) {
            if constexpr (prefetch) __builtin_prefetch(next[j] + k, 0, 3);
            wv[j] = S::load_w(wr[j] + k);
        }
        for (int i = 0; i < MB; ++i) {
            const typename S::Vec xv = S::load_x(xr[i] + k);
            for (int j = 0; j < NB; ++j) acc[i][j] = S::madd(acc[i][j], xv, wv[j]);
        }
    }
    for (int i = 0; i < MB; ++i)
        for (int j = 0; j < NB; ++j) {
            float s = S::sum(acc[i][j]);
            for (int64_t k = k_vec; k < K; ++k) s += to_float(xr[i][k]) * to_float(wr[j][k]); // the tail
            sums[i][j] = s;
        }
}

// What one task needs: out [M, N] (ld N), x [M, K] (ld ldx, already in S::X), w [N, K] (ld ldw), bias [N].
template <class S, typename T>
struct TiledArgs {
    T *out;
    const typename S::X *x;
    const T *w;
    const T *bias;
    int64_t ldx, ldw, M, N, K;
};

constexpr int kTileM = 4; // rows of x per micro tile
constexpr int kTileN = 4; // rows of W per micro tile

// out rows [m0, m0 + MB) x columns [n0, n0 + nvalid): one micro tile. W row pointers past the last
// valid row repeat it (computed, not stored), so every tile runs the same unrolled code.
template <class S, typename T, int MB, bool prefetch>
void run_tile(const TiledArgs<S, T> &a, int64_t m0, int64_t n0, int64_t nvalid) {
    const typename S::X *xr[MB];
    const T *wr[kTileN], *next[kTileN];
    for (int i = 0; i < MB; ++i) xr[i] = a.x + (m0 + i) * a.ldx;
    for (int j = 0; j < kTileN; ++j) {
        wr[j] = a.w + (n0 + std::min<int64_t>(j, nvalid - 1)) * a.ldw;
        next[j] = a.w + std::min(n0 + kTileN + j, a.N - 1) * a.ldw;
    }
    float sums[MB][kTileN];
    dot_tile<S, MB, kTileN, prefetch>(xr, wr, next, a.K, sums);
    for (int i = 0; i < MB; ++i)
        for (int j = 0; j < nvalid; ++j) {
            const float b = a.bias ? to_float(a.bias[n0 + j]) : 0.f;
            store(a.out + (m0 + i) * a.N, n0 + j, sums[i][j] + b);
        }
}

// Outputs [m_begin, m_end) x [n_begin, n_end): for each group of 4 W rows (kept in L1), every x
// row of the task passes over it in micro tiles of up to 4 rows. A task of at most 4 x rows reads
// each W row once and prefetches; larger ones reuse W from L1 and leave it there.
template <class S, typename T>
void run_task(const TiledArgs<S, T> &a, int64_t m_begin, int64_t m_end, int64_t n_begin, int64_t n_end) {
    for (int64_t n0 = n_begin; n0 < n_end; n0 += kTileN) {
        const int64_t nvalid = std::min<int64_t>(kTileN, n_end - n0);
        int64_t m0 = m_begin;
        if (m_end - m0 > kTileM)
            for (; m0 + kTileM <= m_end; m0 += kTileM) run_tile<S, T, kTileM, false>(a, m0, n0, nvalid);
        switch (m_end - m0) { // a single tile or the leftover rows of x
        case 4: run_tile<S, T, 4, true>(a, m0, n0, nvalid); break;
        case 3: run_tile<S, T, 3, true>(a, m0, n0, nvalid); break;
        case 2: run_tile<S, T, 2, true>(a, m0, n0, nvalid); break;
        case 1: run_tile<S, T, 1, true>(a, m0, n0, nvalid); break;
        default: break;
        }
    }
}

// Splits out [M, N] into tasks of [mc, nc]: nc W rows fill about 256 KiB (they stay in L2 while
// mc = 64 rows of x pass), shrunk until every thread has a few tasks (decode has M = 1, so its
// parallelism comes from N alone).
template <class S, typename T>
void linear_tiled(const TiledArgs<S, T> &a) {
    const int64_t row_bytes = std::max<int64_t>(a.K, 1) * int64_t(sizeof(T));
    const int64_t mc = std::min<int64_t>(a.M, 64);
    const int64_t m_tasks = (a.M + mc - 1) / mc, want_tasks = 4 * int64_t(max_threads());
    int64_t nc = std::clamp<int64_t>((256 << 10) / row_bytes / kTileN * kTileN, kTileN, 512);
    while (nc > kTileN && m_tasks * ((a.N + nc - 1) / nc) < want_tasks) nc = std::max<int64_t>(kTileN, nc / 2 / kTileN * kTileN);
    const int64_t n_tasks = (a.N + nc - 1) / nc, tasks = m_tasks * n_tasks;
    run_tasks(tasks, a.M * a.N * a.K >= (1 << 16), [&](int64_t t) {
        const int64_t m = t / n_tasks * mc, n = t % n_tasks * nc;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
        if constexpr (std::is_same_v<S, Avx2F32>)
            if (small_k::fits(a.M, a.K))
                return small_k::task(a.out, a.x, a.ldx, a.w, a.ldw, a.bias, a.N, a.K, m, std::min(a.M, m + mc), n,
                                     std::min(a.N, n + nc));
#endif
        run_task(a, m, std::min(a.M, m + mc), n, std::min(a.N, n + nc));
    });
}

// Runs the tiled path with step S, first converting x to S::X when the step reads x in another type
// (f32 for f16 weights and for bf16 widened by shifts).
template <class S, typename T>
void linear_simd(T *out, const T *x, int64_t ldx, const T *w, int64_t ldw, const T *bias, int64_t M, int64_t N,
                 int64_t K) {
    using X = typename S::X;
    if constexpr (std::is_same_v<X, T>) {
        linear_tiled(TiledArgs<S, T>{out, x, w, bias, ldx, ldw, M, N, K});
    } else {
        std::unique_ptr<X[]> xc(new X[size_t(M * K)]); // x [M, K] in X
        parallel_for(M, K, [&](int64_t m) {
            for (int64_t k = 0; k < K; ++k) xc[size_t(m * K + k)] = from_float<X>(load(x + m * ldx, k));
        });
        linear_tiled(TiledArgs<S, T>{out, xc.get(), w, bias, K, ldw, M, N, K});
    }
}

template <typename T>
void linear_typed(const Tensor &out, const Tensor &x, const Tensor &weight, const Tensor &bias) {
    const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
    const int64_t ldx = detail::ld(x), ldw = detail::ld(weight);
    const T *b = bias.defined() ? bias.data_as<T>() : nullptr;
    using S = typename BestStep<T>::type;
    if constexpr (std::is_void_v<S>)
        linear_plain(out.data_as<T>(), x.data_as<T>(), ldx, weight.data_as<T>(), ldw, b, M, N, K);
    else linear_simd<S>(out.data_as<T>(), x.data_as<T>(), ldx, weight.data_as<T>(), ldw, b, M, N, K);
}

} // namespace

void linear(const Tensor &out, const Tensor &x, const Tensor &weight, const Tensor &bias) {
    detail::dispatch_float("linear", x.dtype(), x.device(), [&](auto tag) {
        linear_typed<typename decltype(tag)::type>(out, x, weight, bias);
    });
}

// Composed from the ops it fuses: g and u come from the linear above (per output the same summation
// order as two separate linear calls, rounded to T on store), then the swiglu (geglu) kernel combines them,
// so the result equals linear + linear + swiglu (geglu) bit for bit. Decode reads the weight once either way.
template <class Combine>
void gated_halves(const Tensor &out, const Tensor &x, const Tensor &w_gate_up, Combine &&combine) {
    const int64_t M = out.size(0), I = out.size(1);
    const Tensor gu = Tensor::empty({2, M, I}, out.dtype()); // [g; u], each [M, I]
    const Tensor g = gu.select(0, 0), u = gu.select(0, 1);
    linear(g, x, w_gate_up.slice(0, 0, I), Tensor());     // w_gate_up[:I]  [I, K]
    linear(u, x, w_gate_up.slice(0, I, 2 * I), Tensor()); // w_gate_up[I:]  [I, K]
    combine(g, u);
}

void linear_swiglu(const Tensor &out, const Tensor &x, const Tensor &w_gate_up) {
    gated_halves(out, x, w_gate_up, [&](const Tensor &g, const Tensor &u) { ::llaisys::ops::swiglu(out, g, u); });
}

void linear_geglu(const Tensor &out, const Tensor &x, const Tensor &w_gate_up, bool tanh_approx) {
    gated_halves(out, x, w_gate_up,
                 [&](const Tensor &g, const Tensor &u) { ::llaisys::ops::geglu(out, g, u, tanh_approx); });
}

// linear, then the gelu op in place on its output: linear + gelu bit for bit.
void linear_gelu(const Tensor &out, const Tensor &x, const Tensor &weight, const Tensor &bias, bool tanh_approx) {
    linear(out, x, weight, bias);
    ::llaisys::ops::gelu(out, out, tanh_approx); // the gelu op (llaisys/ops.hpp)
}

} // namespace llaisys::ops::cpu
