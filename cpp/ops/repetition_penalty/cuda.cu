#include "ops/repetition_penalty/repetition_penalty.hpp"

#include "ops/common/cuda.cuh"

namespace llaisys::ops::cuda {

namespace {
struct Penalize { // HF's RepetitionPenaltyLogitsProcessor
    float penalty;
    __device__ float operator()(float l, int64_t) const { return l > 0.f ? l / penalty : l * penalty; }
};
} // namespace

void repetition_penalty(const Tensor &logits, const Tensor &ids, float penalty) {
    update_logits_at_ids("repetition_penalty", logits, ids, Penalize{penalty});
}

} // namespace llaisys::ops::cuda
