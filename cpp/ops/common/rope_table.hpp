// The inv_freq tables of the rope ops (rope, rope_qkv_cache): the cached theta table of their theta
// overloads, the rules a caller's table must meet, and the CUDA head_dim limit (rope_table.cpp).
#pragma once
#include "llaisys/device.hpp"

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
