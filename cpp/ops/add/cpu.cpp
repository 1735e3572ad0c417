#include "ops/add/add.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/cpu.hpp"

namespace llaisys::ops::cpu {

// out[i] = a[i] + b[i], rounded once from f32.
template <typename T>
static void add_kernel(T *out, const T *a, const T *b, int64_t n) {
    parallel_for(n, 1, [&](int64_t i) { store(out, i, load(a, i) + load(b, i)); });
}

void add(const Tensor &out, const Tensor &a, const Tensor &b) {
    detail::dispatch_float("add", a.dtype(), a.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        add_kernel(out.data_as<T>(), a.data_as<T>(), b.data_as<T>(), a.numel());
    });
}

} // namespace llaisys::ops::cpu
