#include "ops/gelu/gelu.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/cpu.hpp"

#include <cmath>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LLAISYS_GELU_AVX2 1
#endif

namespace llaisys::ops::cpu {

// x * Phi(x) in f32, the formulas of common/gelu_math.cuh (the CUDA kernels): erf form with erfc (no cancellation in
// the negative tail), or TANH, torch's approximate="tanh" as x / (1 + e^(-2u)) (no 1 + tanh(u) cancellation;
// the AVX2 kernel below computes the same). -inf gives NaN in both, as torch.
template <bool TANH>
static inline float gelu_f32(float x) {
    if constexpr (TANH) {
        constexpr float kSqrt2OverPi = 0.7978845608028654f;
        return x / (1.f + std::exp(-2.f * kSqrt2OverPi * (x + 0.044715f * x * x * x)));
    } else {
        return 0.5f * x * std::erfc(-x * 0.7071067811865476f);
    }
}

#ifdef LLAISYS_GELU_AVX2
// e^a for 8 lanes (Cephes expf: a = n ln2 + r, |r| <= ln2 / 2, degree-5 polynomial, ~1 ulp): +inf above
// 88.72, ~0 below -87.3 (clamped there, not at -88.38, so that 2^n stays a normal float), NaN stays NaN.
static inline __m256 exp8(__m256 a) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3f);
    const __m256 over = _mm256_cmp_ps(a, _mm256_set1_ps(88.7228391f), _CMP_GT_OQ);
    const __m256 nan = _mm256_cmp_ps(a, a, _CMP_UNORD_Q);
    __m256 x = _mm256_max_ps(_mm256_min_ps(a, hi), lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); // r = x - n ln2, ln2 in two parts
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 r = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    r = _mm256_blendv_ps(r, _mm256_set1_ps(INFINITY), over);
    return _mm256_blendv_ps(r, a, nan);
}

// gelu_tanh(x) = 0.5 x (1 + tanh(u)) = x / (1 + e^(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3): the same function
// without tanh's 1 + tanh cancellation for negative x. x = -inf: -inf / inf = NaN, as the formula above.
static inline __m256 gelu_tanh8(__m256 x) {
    const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    const __m256 u = _mm256_mul_ps(_mm256_set1_ps(-2.f * 0.7978845608028654f),
                                   _mm256_fmadd_ps(x3, _mm256_set1_ps(0.044715f), x)); // -2u
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(u)));
}

// Tanh GELU (GeGLU with up) over blocks of 8 elements: every element, the last block's too (through a
// padded copy), runs the same vector math, so a result never depends on how the blocks were split.
template <typename T>
static void gelu_tanh_avx2(T *out, const T *x, const T *up, int64_t n) {
    const auto block = [&](int64_t i, int64_t m) {
        if constexpr (std::is_same_v<T, float>) {
            if (m == 8) { // f32 and whole: straight from memory
                const __m256 y = gelu_tanh8(_mm256_loadu_ps(x + i));
                _mm256_storeu_ps(out + i, up ? _mm256_mul_ps(y, _mm256_loadu_ps(up + i)) : y);
                return;
            }
        }
        alignas(32) float xb[8] = {}, ub[8] = {};
        for (int64_t j = 0; j < m; ++j) xb[j] = load(x, i + j);
        __m256 y = gelu_tanh8(_mm256_load_ps(xb));
        if (up) {
            for (int64_t j = 0; j < m; ++j) ub[j] = load(up, i + j);
            y = _mm256_mul_ps(y, _mm256_load_ps(ub));
        }
        _mm256_store_ps(xb, y);
        for (int64_t j = 0; j < m; ++j) store(out, i + j, xb[j]);
    };
    parallel_ranges((n + 7) / 8, 64, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) block(8 * b, std::min<int64_t>(8, n - 8 * b));
    });
}
#endif

// out[i] = gelu(x[i]) (* up[i] when up is given: GeGLU), in f32, rounded once. out may alias x or up.
template <typename T, bool TANH>
static void gelu_kernel(T *out, const T *x, const T *up, int64_t n) {
#ifdef LLAISYS_GELU_AVX2
    if constexpr (TANH) return gelu_tanh_avx2(out, x, up, n);
#endif
    if (up)
        parallel_for(n, 16, [&](int64_t i) { store(out, i, gelu_f32<TANH>(load(x, i)) * load(up, i)); });
    else
        parallel_for(n, 16, [&](int64_t i) { store(out, i, gelu_f32<TANH>(load(x, i))); });
}

void gelu(const Tensor &out, const Tensor &x, const Tensor &up, bool tanh_approx) {
    const char *op = up.defined() ? "geglu" : "gelu";
    detail::dispatch_float(op, x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        T *o = out.data_as<T>();                                 // [n]
        const T *xp = x.data_as<T>();                            // [n]
        const T *u = up.defined() ? up.data_as<T>() : nullptr;   // [n] or null
        if (tanh_approx) gelu_kernel<T, true>(o, xp, u, x.numel());
        else gelu_kernel<T, false>(o, xp, u, x.numel());
    });
}

} // namespace llaisys::ops::cpu
