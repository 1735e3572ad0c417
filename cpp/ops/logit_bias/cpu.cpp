#include "ops/logit_bias/logit_bias.hpp"

#include "ops/common/cpu.hpp"

namespace llaisys::ops::cpu {

// logits [b, ids[b, j]] += bias [b, j].
void logit_bias(const Tensor &logits, const Tensor &ids, const Tensor &bias) {
    const float *bs = bias.data_as<float>();
    update_logits_at_ids("logit_bias", logits, ids, [bs](float l, int64_t k) { return l + bs[k]; });
}

} // namespace llaisys::ops::cpu
