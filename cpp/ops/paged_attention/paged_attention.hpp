#pragma once
#include "llaisys/tensor.hpp"

#include <cstdint>

// Backends receive validated tensors: q [T, nh, hd] with a unit last stride, out [T, nh, hd] with a
// unit last stride, k_cache/v_cache [num_blocks, block_size, nkvh, hd] contiguous, block_tables
// [B, max_blocks], q_start [B + 1] and kv_len [B] contiguous i32; nh % nkvh == 0; T, B or max_q_len may be 0;
// window >= 0 (0: full causal attention; else the query at position p sees keys (p - window, p]).
// The metadata's values are not checked yet: the CPU backend checks them (it can read them), the CUDA
// kernels clamp them and report through the device error flag.
namespace llaisys::ops::cpu {
void paged_attention(const Tensor &out, const Tensor &q, const Tensor &k_cache, const Tensor &v_cache,
                     const Tensor &block_tables, const Tensor &q_start, const Tensor &kv_len, float scale,
                     int64_t max_q_len, int64_t window);
}
namespace llaisys::ops::cuda {
void paged_attention(const Tensor &out, const Tensor &q, const Tensor &k_cache, const Tensor &v_cache,
                     const Tensor &block_tables, const Tensor &q_start, const Tensor &kv_len, float scale,
                     int64_t max_q_len, bool settled_history, int64_t window);
}

namespace llaisys::ops::paged_detail {
// The CUDA kernels stage 2 x 64 K and V rows in shared memory: rows of at most 512 bytes (head dim 256
// in f16/bf16, 128 in f32).
constexpr int64_t kCudaMaxRowBytes = 512;
} // namespace llaisys::ops::paged_detail
