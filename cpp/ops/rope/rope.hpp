#pragma once
#include "llaisys/tensor.hpp"

#include <cstdint>
#include <vector>

namespace llaisys::ops::detail {
// ops::rope_inv_freq(theta, head_dim, {}) (1 / theta^(2i / head_dim) in f32 as HF computes it, theta^e
// rounded correctly to f32 through double, so that the CPU, CUDA and the tests agree bit for bit), cached
// per thread for the last (theta, head_dim): what the theta overloads of rope and rope_qkv_cache use.
const std::vector<float> &rope_inv_freq(float theta, int64_t head_dim);
// The table rules of the inv_freq overloads: 1 <= r <= head_dim / 2 finite entries; on CUDA head_dim <=
// kRopeMaxCudaHeadDim.
void check_inv_freq(const char *op, const std::vector<float> &inv_freq, int64_t head_dim, Device device);
} // namespace llaisys::ops::detail

namespace llaisys::ops {
// The CUDA kernel takes inv_freq as a kernel parameter of kRopeMaxCudaHeadDim / 2 floats.
constexpr int64_t kRopeMaxCudaHeadDim = 1024;
} // namespace llaisys::ops

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
