#pragma once
#include "llaisys/tensor.hpp"

#include <vector>

// Backends receive x [seq, heads, head_dim] and out of that shape with the last dim contiguous; the seq
// and head strides may be anything (e.g. q sliced out of a fused QKV buffer). out may alias x. pos_ids
// [seq] is contiguous i64/i32; inv_freq has r entries, 1 <= r <= head_dim / 2: the pairs (i, i + r) turn,
// dims [2r, head_dim) are copied (nothing to do when out is x).
namespace llaisys::ops::cpu {
void rope(const Tensor &out, const Tensor &x, const Tensor &pos_ids, const std::vector<float> &inv_freq);
}
namespace llaisys::ops::cuda {
void rope(const Tensor &out, const Tensor &x, const Tensor &pos_ids, const std::vector<float> &inv_freq);
}
