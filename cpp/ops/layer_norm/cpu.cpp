#include "ops/layer_norm/layer_norm.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/cpu.hpp"

#include <algorithm>
#include <cmath>

namespace llaisys::ops::cpu {

// sum of f(i) for i in [0, D) in f32, in eight partial sums: independent chains the compiler keeps in one
// vector register (the order is fixed, so results do not depend on the caller).
template <typename F>
static float row_sum(int64_t D, F &&f) {
    float acc[8] = {};
    int64_t i = 0;
    for (; i + 8 <= D; i += 8)
        for (int j = 0; j < 8; ++j) acc[j] += f(i + j);
    float s = 0.f;
    for (; i < D; ++i) s += f(i);
    for (int j = 0; j < 8; ++j) s += acc[j];
    return s;
}

// out [D] = (x [D] - mean) * rstd * weight [D] (+ bias [D]), all in f32, rounded once; bias may be null.
// The corrected two-pass algorithm (Chan, Golub and LeVeque): pass 1 sums x for a first mean m; pass 2 sums
// d = x - m and d^2, whose mean c = sum(d) / D corrects m and var = sum(d^2) / D - c^2. No E[x^2] - mean^2
// cancellation, and x - m is exact for x near m, so rows whose mean is large against their spread keep
// their precision. out may alias x: each element is read before it is written.
template <typename T>
static void layer_norm_row(T *out, const T *x, const T *weight, const T *bias, int64_t D, float eps) {
    const float m = row_sum(D, [&](int64_t i) { return load(x, i); }) / float(D);
    const float c = row_sum(D, [&](int64_t i) { return load(x, i) - m; }) / float(D);
    const float sq = row_sum(D, [&](int64_t i) {
        const float d = load(x, i) - m;
        return d * d;
    });
    const float rstd = 1.f / std::sqrt(std::max(sq / float(D) - c * c, 0.f) + eps);
    if (bias)
        for (int64_t k = 0; k < D; ++k) store(out, k, (load(x, k) - m - c) * rstd * load(weight, k) + load(bias, k));
    else
        for (int64_t k = 0; k < D; ++k) store(out, k, (load(x, k) - m - c) * rstd * load(weight, k));
}

template <typename T>
static const T *ptr_or_null(const Tensor &t) { return t.defined() ? t.data_as<T>() : nullptr; }

void layer_norm(const Tensor &out, const Tensor &x, const Tensor &weight, const Tensor &bias, float eps) {
    const int64_t D = x.shape().back(), rows = x.numel() / D;
    detail::dispatch_float("layer_norm", x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        T *o = out.data_as<T>();             // [rows, D]
        const T *xp = x.data_as<T>();        // [rows, D]
        const T *w = weight.data_as<T>();    // [D]
        const T *b = ptr_or_null<T>(bias);   // [D] or null
        parallel_for(rows, 3 * D, [&](int64_t r) { layer_norm_row(o + r * D, xp + r * D, w, b, D, eps); });
    });
}

// Per row: residual += delta, then += delta2 (each rounded to T, as add() does), then layer_norm_row reads
// the rounded row, so the result equals add(), add() and layer_norm() bit for bit (out2: a second
// layer_norm() of the same row).
void add_layer_norm(const Tensor &out, const Tensor &residual, const Tensor &delta, const Tensor &delta2,
                    const Tensor &weight, const Tensor &bias, float eps, const Tensor &out2, const Tensor &weight2,
                    const Tensor &bias2) {
    const int64_t D = delta.shape().back(), rows = delta.numel() / D;
    detail::dispatch_float("add_layer_norm", delta.dtype(), delta.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        T *o = out.data_as<T>();              // [rows, D]
        T *res = residual.data_as<T>();       // [rows, D], updated in place
        const T *d = delta.data_as<T>();      // [rows, D]
        const T *d2 = ptr_or_null<T>(delta2); // [rows, D] or null
        const T *w = weight.data_as<T>();     // [D]
        const T *b = ptr_or_null<T>(bias);    // [D] or null
        T *o2 = out2.defined() ? out2.data_as<T>() : nullptr; // [rows, D] or null, with w2 and b2
        const T *w2 = ptr_or_null<T>(weight2), *b2 = ptr_or_null<T>(bias2);
        parallel_for(rows, 5 * D, [&](int64_t r) {
            T *rr = res + r * D;
            const T *dr = d + r * D;
            for (int64_t i = 0; i < D; ++i) store(rr, i, load(rr, i) + load(dr, i));
            if (d2)
                for (int64_t i = 0; i < D; ++i) store(rr, i, load(rr, i) + load(d2 + r * D, i));
            layer_norm_row(o + r * D, rr, w, b, D, eps);
            if (o2) layer_norm_row(o2 + r * D, rr, w2, b2, D, eps);
        });
    });
}

} // namespace llaisys::ops::cpu
