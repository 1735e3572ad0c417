// CPU pieces shared by the rope kernels (rope, rope_qkv_cache), so that they agree bit for bit; the
// device pieces are in rope_math.cuh.
#pragma once
#include "ops/common/cpu.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace llaisys::ops::cpu {
// cos_sin [2h] = cos | sin of angle_i = p * inv_freq[i], an f32 product (h = inv_freq's size: the pairs).
inline void rope_cos_sin(float p, const std::vector<float> &inv_freq, int64_t h, float *cos_sin) {
    for (int64_t i = 0; i < h; ++i) {
        const float angle = p * inv_freq[size_t(i)];
        cos_sin[i] = std::cos(angle);
        cos_sin[h + i] = std::sin(angle);
    }
}
// out [2h] = x [2h] with the pair (x[i], x[i + h]) turned by angle_i. Each pair is read before it is
// written, so out may alias x.
template <typename T>
inline void rope_row(T *out, const T *x, const float *cos_sin, int64_t h) {
    for (int64_t i = 0; i < h; ++i) {
        const float c = cos_sin[i], sn = cos_sin[h + i];
        const float x1 = load(x, i), x2 = load(x, i + h);
        store(out, i, x1 * c - x2 * sn);
        store(out, i + h, x2 * c + x1 * sn);
    }
}
// The dims a partial rotary leaves alone: out [from, hd) = x [from, hd); nothing when out is x.
template <typename T>
inline void rope_pass(T *out, const T *x, int64_t from, int64_t hd) {
    if (out != x && hd > from) std::memcpy(out + from, x + from, size_t(hd - from) * sizeof(T));
}
} // namespace llaisys::ops::cpu
