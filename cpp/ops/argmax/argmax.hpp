#pragma once
#include "llaisys/tensor.hpp"
#include "ops/common/cpu.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>

// Backends receive validated tensors: x contiguous [rows, V] (V >= 1) viewed through its last dim,
// max_idx [rows] (i64) and max_val [rows] (x's dtype) contiguous.
namespace llaisys::ops::cpu {
void argmax(const Tensor &max_idx, const Tensor &max_val, const Tensor &x);

// Max of row [V] ignoring NaN (-inf if none) and whether it holds a NaN. The max is taken over
// order-preserving integer keys (NaN -> 0) so the compiler can vectorize the reduction.
template <typename T>
float row_max(const T *row, int64_t V, bool &any_nan) {
    uint32_t kmax = 0, nan = 0;
    for (int64_t i = 0; i < V; ++i) {
        uint32_t u;
        const float v = load(row, i);
        std::memcpy(&u, &v, 4);
        const uint32_t is_nan = (u & 0x7fffffffu) > 0x7f800000u;
        const uint32_t k = ((u >> 31) ? ~u : (u | 0x80000000u)) & (is_nan - 1u); // branch-free: NaN -> 0
        kmax = k > kmax ? k : kmax;
        nan |= is_nan;
    }
    any_nan = nan != 0;
    if (kmax == 0) return -INFINITY;
    const uint32_t u = (kmax & 0x80000000u) ? (kmax & 0x7fffffffu) : ~kmax;
    float m;
    std::memcpy(&m, &u, 4);
    return m;
}

// NumPy's argmax of row [V]: the first NaN if there is one, else the first maximum.
template <typename T>
int64_t argmax_row(const T *row, int64_t V) {
    bool any_nan = false;
    const float m = row_max(row, V, any_nan);
    for (int64_t i = 0; i < V; ++i) {
        const float v = load(row, i);
        if (any_nan ? v != v : v == m) return i;
    }
    return 0; // every value is -inf
}
} // namespace llaisys::ops::cpu

namespace llaisys::ops::cuda {
void argmax(const Tensor &max_idx, const Tensor &max_val, const Tensor &x);
}
