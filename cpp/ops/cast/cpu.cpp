#include "ops/cast/cast.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/cpu.hpp"

namespace llaisys::ops::cpu {

template <typename In>
static float load_any(const In *p, int64_t i) {
    if constexpr (std::is_integral_v<In>) return float(p[i]);
    else return to_float(p[i]);
}

template <typename In, typename Out>
static void cast_kernel(Out *out, const In *x, int64_t n) {
    parallel_for(n, 1, [&](int64_t i) { out[i] = from_float<Out>(load_any(x, i)); });
}

template <typename Out>
static void cast_to(const Tensor &out, const Tensor &x) {
    Out *o = out.data_as<Out>();
    const int64_t n = x.numel();
    switch (x.dtype()) {
    case DType::F32: return cast_kernel(o, x.data_as<float>(), n);
    case DType::F16: return cast_kernel(o, x.data_as<f16_t>(), n);
    case DType::BF16: return cast_kernel(o, x.data_as<bf16_t>(), n);
    case DType::I32: return cast_kernel(o, x.data_as<int32_t>(), n);
    case DType::I64: return cast_kernel(o, x.data_as<int64_t>(), n);
    default: detail::unsupported("cast", x.dtype(), x.device());
    }
}

void cast(const Tensor &out, const Tensor &x) {
    detail::dispatch_float("cast", out.dtype(), out.device(), [&](auto tag) {
        using Out = typename decltype(tag)::type;
        cast_to<Out>(out, x);
    });
}

} // namespace llaisys::ops::cpu
