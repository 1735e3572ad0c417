#pragma once
#include "llaisys/tensor.hpp"
#include "ops/sample/sample_math.hpp"

#include <cstdint>

// Backends receive validated, contiguous tensors: out_ids [B] (i64), logits [B, V] (V >= 1) and the
// per-row parameters temperature [B] f32, top_k [B] i32, top_p [B] f32, min_p [B] f32 on one device.
namespace llaisys::ops::cpu {
void sample(const Tensor &out_ids, const Tensor &logits, const Tensor &temperature, const Tensor &top_k,
            const Tensor &top_p, const Tensor &min_p, const sampling::SeedSource &seeds);
}
namespace llaisys::ops::cuda {
void sample(const Tensor &out_ids, const Tensor &logits, const Tensor &temperature, const Tensor &top_k,
            const Tensor &top_p, const Tensor &min_p, const sampling::SeedSource &seeds);
}
