#include "ops/repetition_penalty/repetition_penalty.hpp"

#include "ops/common/cpu.hpp"

namespace llaisys::ops::cpu {

// HF's RepetitionPenaltyLogitsProcessor at the logits of ids [b, :].
void repetition_penalty(const Tensor &logits, const Tensor &ids, float penalty) {
    update_logits_at_ids("repetition_penalty", logits, ids,
                         [penalty](float l, int64_t) { return l > 0.f ? l / penalty : l * penalty; });
}

} // namespace llaisys::ops::cpu
