#include "ops/logit_bias/logit_bias.hpp"

#include "ops/common/cuda.cuh"

namespace llaisys::ops::cuda {

namespace {
struct AddBias { // bias [B, n] f32, at the ids' flat positions
    const float *bias;
    __device__ float operator()(float l, int64_t k) const { return l + bias[k]; }
};
} // namespace

void logit_bias(const Tensor &logits, const Tensor &ids, const Tensor &bias) {
    update_logits_at_ids("logit_bias", logits, ids, AddBias{bias.data_as<float>()});
}

} // namespace llaisys::ops::cuda
