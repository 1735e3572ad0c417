// The out-of-line pieces of rms_norm_rows.hpp: one definition of each, so that rms_norm, add_rms_norm and
// add_rms_norm_quant_linear check alike and the CPU ops run one row kernel.
#include "ops/common/rms_norm_rows.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/cpu.hpp"

#include <cmath>

namespace llaisys::ops {

void detail::check_rms_norm_args(const char *op, const Tensor &out, const Tensor &x, const Tensor &weight,
                                 float eps) {
    check_operands(op, {{"out", out}, {"x", x}, {"weight", weight}});
    check_float(op, "x", x);
    check_same_dtype(op, "weight", weight, x);
    check_same_dtype(op, "out", out, x);
    LLAISYS_CHECK(x.ndim() >= 1, std::invalid_argument, op, ": x must have at least 1 dim, got a scalar");
    check_shape(op, "weight", weight, {x.shape().back()});
    check_shape(op, "out", out, x.shape());
    LLAISYS_CHECK(eps >= 0.f && std::isfinite(eps), std::invalid_argument, op,
                  ": eps must be finite and >= 0, got ", eps);
}

} // namespace llaisys::ops

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

} // namespace llaisys::ops::cpu
