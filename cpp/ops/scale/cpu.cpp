#include "ops/scale/scale.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/cpu.hpp"

namespace llaisys::ops::cpu {

// out[i] = x[i] * alpha, the f32 product rounded once to the dtype.
template <typename T>
static void scale_kernel(T *out, const T *x, float alpha, int64_t n) {
    parallel_for(n, 1, [&](int64_t i) { store(out, i, load(x, i) * alpha); });
}

void scale(const Tensor &out, const Tensor &x, float alpha) {
    detail::dispatch_float("scale", x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        scale_kernel(out.data_as<T>(), x.data_as<T>(), alpha, x.numel());
    });
}

} // namespace llaisys::ops::cpu
