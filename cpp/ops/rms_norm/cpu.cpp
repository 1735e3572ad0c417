#include "ops/rms_norm/rms_norm.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/cpu.hpp"

#include <cmath>

namespace llaisys::ops::cpu {

// out [D] = x [D] * rsqrt(mean(x^2) + eps) * weight [D], all in f32, rounded once. out may alias x.
template <typename T>
void rms_norm_row(T *out, const T *x, const T *weight, int64_t D, float eps) {
    // Eight partial sums: independent chains the compiler keeps in one vector register (the order is
    // fixed, so results do not depend on the caller).
    float acc[8] = {};
    int64_t i = 0;
    for (; i + 8 <= D; i += 8)
        for (int j = 0; j < 8; ++j) {
            const float v = load(x, i + j);
            acc[j] += v * v;
        }
    float ss = 0.f;
    for (; i < D; ++i) {
        const float v = load(x, i);
        ss += v * v;
    }
    for (int j = 0; j < 8; ++j) ss += acc[j];
    const float scale = 1.f / std::sqrt(ss / float(D) + eps);
    for (int64_t k = 0; k < D; ++k) store(out, k, load(x, k) * scale * load(weight, k));
}

template void rms_norm_row<float>(float *, const float *, const float *, int64_t, float);
template void rms_norm_row<f16_t>(f16_t *, const f16_t *, const f16_t *, int64_t, float);
template void rms_norm_row<bf16_t>(bf16_t *, const bf16_t *, const bf16_t *, int64_t, float);

void rms_norm(const Tensor &out, const Tensor &x, const Tensor &weight, float eps) {
    const int64_t D = x.shape().back(), rows = x.numel() / D;
    detail::dispatch_float("rms_norm", x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        T *o = out.data_as<T>();             // [rows, D]
        const T *xp = x.data_as<T>();        // [rows, D]
        const T *w = weight.data_as<T>();    // [D]
        parallel_for(rows, D, [&](int64_t r) { rms_norm_row(o + r * D, xp + r * D, w, D, eps); });
    });
}

void rms_norm_rows(const Tensor &out, const Tensor &x, const Tensor &weight, float eps, const RowMap &om,
                   const RowMap &xm) {
    const int64_t D = x.shape().back(), rows = x.numel() / D;
    const auto at = [](const RowMap &m, int64_t r) { return r / m.inner * m.s_outer + r % m.inner * m.s_inner; };
    detail::dispatch_float("rms_norm", x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        T *o = out.data_as<T>();
        const T *xp = x.data_as<T>();
        const T *w = weight.data_as<T>();
        parallel_for(rows, D, [&](int64_t r) { rms_norm_row(o + at(om, r), xp + at(xm, r), w, D, eps); });
    });
}

} // namespace llaisys::ops::cpu
