#include "ops/logit_bias/logit_bias.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/cpu.hpp"

namespace llaisys::ops::cpu {

// logits [B, V] (strides s0, s1) += bias [B, n] at ids [B, n] (-1 = padding), rounded once per logit.
template <typename T>
static void bias_kernel(T *logits, int64_t s0, int64_t s1, const int64_t *ids, const float *bias, int64_t B,
                        int64_t n) {
    for (int64_t b = 0; b < B; ++b)
        for (int64_t j = 0; j < n; ++j) {
            const int64_t id = ids[b * n + j];
            if (id < 0) continue;
            T *p = logits + b * s0 + id * s1;
            *p = from_float<T>(to_float(*p) + bias[b * n + j]);
        }
}

void logit_bias(const Tensor &logits, const Tensor &ids, const Tensor &bias) {
    const int64_t B = ids.size(0), n = ids.size(1), V = logits.size(1);
    const int64_t *id = ids.data_as<int64_t>();
    for (int64_t k = 0; k < B * n; ++k) // checked before any logit changes
        LLAISYS_CHECK(id[k] >= -1 && id[k] < V, std::out_of_range, "logit_bias: id ", id[k], " at [", k / n, ", ",
                      k % n, "] is out of range for a vocabulary of ", V, " (use -1 for padding)");
    detail::dispatch_float("logit_bias", logits.dtype(), logits.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        bias_kernel(logits.data_as<T>(), logits.stride(0), logits.stride(1), id, bias.data_as<float>(), B, n);
    });
}

} // namespace llaisys::ops::cpu
