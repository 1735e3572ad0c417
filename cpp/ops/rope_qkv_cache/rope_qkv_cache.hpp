#pragma once
#include "llaisys/tensor.hpp"

#include <vector>

// Backends receive qkv [T, (nh + 2 * nkvh) * hd] with a contiguous last dim (any row stride), q_out
// [T, nh, hd] with a contiguous last dim (may be qkv's q part: in place), k_cache/v_cache
// [capacity, nkvh, hd] with contiguous last dims, pos_ids [T] contiguous i64/i32, slots [T] contiguous
// i64/i32 or undefined (then the cache rows are pos_ids) and inv_freq [r], 1 <= r <= hd / 2 (the pairs
// (i, i + r) of q and k heads turn, dims [2r, hd) are copied). T > 0. A cache row outside [0, capacity)
// writes nothing for its token. q_norm/k_norm: both undefined, or both contiguous [hd] of qkv's dtype (then
// every q and k head is rms_norm'ed with eps first, as ops.hpp says).
namespace llaisys::ops::cpu {
void rope_qkv_cache(const Tensor &q_out, const Tensor &k_cache, const Tensor &v_cache, const Tensor &qkv,
                    const Tensor &pos_ids, const Tensor &slots, const std::vector<float> &inv_freq,
                    const Tensor &q_norm, const Tensor &k_norm, float eps);
}
namespace llaisys::ops::cuda {
void rope_qkv_cache(const Tensor &q_out, const Tensor &k_cache, const Tensor &v_cache, const Tensor &qkv,
                    const Tensor &pos_ids, const Tensor &slots, const std::vector<float> &inv_freq,
                    const Tensor &q_norm, const Tensor &k_norm, float eps);
}
