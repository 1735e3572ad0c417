// The sampling rule, shared by the CPU and CUDA backends so both draw from one distribution.
//
// Per row with temperature t > 0 and m = max logit (NaN ignored): token i has weight
// w_i = exp((l_i - m) / t) in [0, 1] (the max has 1, NaN has 0). Filters, in order:
//   min_p  keeps w_i >= min_p (the "survivors"; min_p 0 keeps all);
//   top_k  keeps survivors whose logit key is >= the k-th largest survivor key (ties kept);
//   top_p  keeps the smallest set of largest survivors left by top_k whose mass reaches
//          ceil(top_p * their total mass) (ties at the boundary kept).
// Both thresholds are the largest 32-bit key θ whose kept count / mass still reaches the target, so
// they can be found by binary search over the key (or, equivalently, by sorting candidates).
// The draw walks the kept tokens in index order and stops where the running mass exceeds
// r = floor(u * Z), u in [0, 1) from a counter-based generator on (seed, offset, row).
// Masses are fixed point (`mass_shift` fractional bits) so every sum is an exact integer: the same
// tokens whatever order a backend sums in, and V * 2^shift <= 2^62 cannot overflow. Weights below
// 2^-shift (~6e-14 of the top token for V = 151936) count as 0.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "ops/common/host_device.hpp"

namespace llaisys::ops::sampling {

// Order-preserving map float -> uint32: a > b <=> key(a) > key(b). NaN maps to 0, below -inf.
LLAISYS_HD uint32_t float_key(float x) {
    uint32_t u;
#ifdef __CUDA_ARCH__
    u = __float_as_uint(x);
#else
    std::memcpy(&u, &x, 4);
#endif
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Inverse of float_key for non-NaN keys (bit-exact).
LLAISYS_HD float key_float(uint32_t k) {
    const uint32_t u = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float x;
    std::memcpy(&x, &u, 4);
    return x;
#endif
}

// (l - m) / t as a multiply by inv_t: <= 0, exactly 0 for the maximum (also when m is infinite), NaN for NaN.
LLAISYS_HD float scaled_diff(float l, float m, float inv_t) { return l == m ? 0.f : (l - m) * inv_t; }

// exp(d) in [0, 1]; 0 for -inf and NaN; exactly 1 for d = 0. CUDA uses the fast exp (relative error
// < 3e-6 for d >= -32, where all measurable mass lies): the weights need no more, and it is several
// times cheaper than expf in the passes over the row.
LLAISYS_HD float weight_of(float d) {
#ifdef __CUDA_ARCH__
    return d > -INFINITY ? __expf(d) : 0.f;
#else
    return d > -INFINITY ? expf(d) : 0.f;
#endif
}

// Fractional bits of the fixed-point masses for a row of V tokens: V * 2^shift <= 2^62.
LLAISYS_HD int mass_shift(int64_t V) {
    int bits = 0;
    while ((int64_t(1) << bits) < V) ++bits;
    return 62 - bits;
}

// w in [0, 1] as fixed point; scale = 2^mass_shift(V) (a power of two, so w * scale is exact).
LLAISYS_HD uint64_t to_mass(float w, float scale) { return uint64_t(w * scale); }

LLAISYS_HD uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// 64 random bits for (seed, offset, row): a counter-based generator, so any row of any step can be
// drawn independently (and replayed by a CUDA graph with a new offset).
LLAISYS_HD uint64_t row_random(uint64_t seed, uint64_t offset, uint64_t row) {
    return splitmix64(splitmix64(splitmix64(seed) ^ offset) ^ row);
}

// Where row b's random bits come from: one (seed, offset) for the whole call with the row index mixed
// in, or each row's own (seeds[b], steps[b]) with row 0 (the batched engine: a request's draw then never
// depends on its row). seeds/steps point into the logits' device memory.
struct SeedSource {
    uint64_t seed = 0, offset = 0;
    const int64_t *seeds = nullptr, *steps = nullptr;
    LLAISYS_HD uint64_t bits(uint64_t row) const {
        return seeds ? row_random(uint64_t(seeds[row]), uint64_t(steps[row]), 0) : row_random(seed, offset, row);
    }
};

// floor(bits / 2^64 * z): a uniform draw in [0, z) without rounding through a float.
LLAISYS_HD uint64_t scale_random(uint64_t bits, uint64_t z) {
#ifdef __CUDA_ARCH__
    return __umul64hi(bits, z);
#else
    return uint64_t((static_cast<unsigned __int128>(bits) * z) >> 64);
#endif
}

LLAISYS_HD bool is_greedy(float temperature) { return !(temperature > 0.f); } // NaN too
LLAISYS_HD float clean_min_p(float p) { return p > 0.f ? fminf(p, 1.f) : 0.f; } // NaN -> off
LLAISYS_HD bool top_p_on(float p) { return p < 1.f; }                             // NaN -> off
LLAISYS_HD bool top_k_on(int k, uint64_t survivors) { return k > 0 && uint64_t(k) < survivors; }

// Mass top_p must reach out of z: ceil(p * z), at least 1 (the top token) and at most z.
LLAISYS_HD uint64_t top_p_target(float p, uint64_t z) {
    const double t = ceil(double(p) * double(z));
    if (!(t >= 1.0)) return 1;
    return t >= double(z) ? z : uint64_t(t);
}

// Largest θ in [lo, 2^32) with f(θ) >= target, for f non-increasing in θ and f(lo) >= target.
template <typename F>
LLAISYS_HD uint32_t search_threshold(uint32_t lo, uint64_t target, F &&f) {
    uint64_t good = lo, bad = uint64_t(1) << 32;
    while (bad - good > 1) {
        const uint64_t mid = (good + bad) / 2;
        if (f(uint32_t(mid)) >= target) good = mid;
        else bad = mid;
    }
    return uint32_t(good);
}

} // namespace llaisys::ops::sampling
