// The logprobs op's backends and the rule both share: order keys for the top-k selection.
#pragma once
#include "llaisys/tensor.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "ops/common/host_device.hpp"

namespace llaisys::ops::logprobs_rule {

// Most top entries a row can ask for (OpenAI's limit).
constexpr int64_t kMaxTopK = 20;

// A 64-bit key per (value, index) whose order is the top-k order: larger value first, then the lower
// index. High 32 bits: the float bits mapped to an unsigned int of the same order (-0.0 as +0.0, NaN
// above +inf); low 32 bits: ~index. Key 0 is below every element's key (-inf maps to 0x007fffff), so it
// marks an empty slot.
LLAISYS_HD uint64_t order_key(float v, int64_t i) {
    uint32_t u;
#ifdef __CUDA_ARCH__
    u = __float_as_uint(v);
#else
    std::memcpy(&u, &v, 4);
#endif
    uint32_t o;
    if (v != v) o = 0xffffffffu;
    else if (u == 0x80000000u) o = 0x80000000u;
    else o = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return (uint64_t(o) << 32) | uint64_t(~uint32_t(i));
}

LLAISYS_HD int64_t key_index(uint64_t key) { return int64_t(~uint32_t(key)); }

// Inserts key into top[0, n) (sorted descending, capacity k) when it belongs to the k largest; n grows
// up to k.
LLAISYS_HD void insert_key(uint64_t *top, int &n, int k, uint64_t key) {
    if (n == k && !(key > top[k - 1])) return;
    int j = n < k ? n++ : k - 1;
    for (; j > 0 && top[j - 1] < key; --j) top[j] = top[j - 1];
    top[j] = key;
}

// 1 / temperature, with 0 (greedy), negative or non-finite meaning 1 (the sampled distribution of a
// greedy row is taken at temperature 1, as the engine reports it).
LLAISYS_HD float inv_temperature(float t) { return t > 0.f && t < INFINITY ? 1.f / t : 1.f; }

} // namespace llaisys::ops::logprobs_rule

// Backends receive validated, contiguous tensors on one device: logits [B, V] (float, V >= 1),
// temperature [B] f32, chosen [B] i64, rows [R] i64; outputs chosen_lp [R] f32, top_ids [R, k] i64,
// top_lp [R, k] f32 with 0 <= k <= kMaxTopK and R >= 1.
namespace llaisys::ops::cpu {
void logprobs(const Tensor &chosen_lp, const Tensor &top_ids, const Tensor &top_lp, const Tensor &logits,
              const Tensor &temperature, const Tensor &chosen, const Tensor &rows);
}
namespace llaisys::ops::cuda {
void logprobs(const Tensor &chosen_lp, const Tensor &top_ids, const Tensor &top_lp, const Tensor &logits,
              const Tensor &temperature, const Tensor &chosen, const Tensor &rows);
}
