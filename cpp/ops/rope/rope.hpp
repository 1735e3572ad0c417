#pragma once
#include "llaisys/tensor.hpp"

#include <cstdint>
#include <vector>

namespace llaisys::ops::detail {
// inv_freq [head_dim / 2]: 1 / theta^(2i / head_dim) in f32 as HF computes it, with theta^e rounded
// correctly to f32 (through double) so that the CPU, CUDA and the tests agree bit for bit. Cached per
// thread for the last (theta, head_dim).
const std::vector<float> &rope_inv_freq(float theta, int64_t head_dim);
} // namespace llaisys::ops::detail

namespace llaisys::ops {
// The CUDA kernel takes inv_freq as a kernel parameter of kRopeMaxCudaHeadDim / 2 floats.
constexpr int64_t kRopeMaxCudaHeadDim = 1024;
} // namespace llaisys::ops

// Backends receive x [seq, heads, head_dim] and out of that shape with the last dim contiguous; the seq
// and head strides may be anything (e.g. q sliced out of a fused QKV buffer). out may alias x. pos_ids
// [seq] is contiguous i64/i32; inv_freq has head_dim / 2 entries.
namespace llaisys::ops::cpu {
void rope(const Tensor &out, const Tensor &x, const Tensor &pos_ids, const std::vector<float> &inv_freq);
}
namespace llaisys::ops::cuda {
void rope(const Tensor &out, const Tensor &x, const Tensor &pos_ids, const std::vector<float> &inv_freq);
}
