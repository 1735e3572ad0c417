#pragma once
#include "llaisys/tensor.hpp"

#include <vector>

// Backends receive k_cache/v_cache [capacity, nkvh, hd] with contiguous last dims, src/dst [n] contiguous
// i64/i32 (n > 0, rows checked in [0, capacity) by the CPU kernel; on CUDA a bad row sets the error flag),
// delta the position shift and inv_freq [r], 1 <= r <= hd / 2.
namespace llaisys::ops::cpu {
void kv_shift(const Tensor &k_cache, const Tensor &v_cache, const Tensor &src, const Tensor &dst, int64_t delta,
              const std::vector<float> &inv_freq);
}
namespace llaisys::ops::cuda {
void kv_shift(const Tensor &k_cache, const Tensor &v_cache, const Tensor &src, const Tensor &dst, int64_t delta,
              const std::vector<float> &inv_freq);
}
