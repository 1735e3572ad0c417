#include "ops/rope/rope.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/rope_math.hpp"

namespace llaisys::ops::cpu {

// Per position s: angle_i = float(pos[s]) * inv_freq[i] (f32), then for every head the pair
// (x[i], x[i + h]) turns by angle_i (rope_cos_sin and rope_row in common/rope_math.hpp), h = inv_freq's
// size, and dims [2h, hd) are copied (rope_pass). out may alias x.
template <typename T, typename I>
static void rope_kernel(const Tensor &out, const Tensor &x, const I *pos, const std::vector<float> &inv_freq) {
    const int64_t seq = x.size(0), heads = x.size(1), hd = x.size(2), h = int64_t(inv_freq.size());
    const int64_t xs = x.stride(0), xh = x.stride(1), os = out.stride(0), oh = out.stride(1);
    const T *xp = x.data_as<T>(); // [seq, heads, hd], strides (xs, xh, 1)
    T *op = out.data_as<T>();     // [seq, heads, hd], strides (os, oh, 1)
    parallel_for(seq, heads * hd, [&](int64_t s) {
        std::vector<float> cos_sin(size_t(2 * h)); // cos [h] | sin [h]
        rope_cos_sin(float(pos[s]), inv_freq, h, cos_sin.data());
        for (int64_t head = 0; head < heads; ++head) {
            T *o = op + s * os + head * oh;
            const T *src = xp + s * xs + head * xh;
            rope_row(o, src, cos_sin.data(), h);
            rope_pass(o, src, 2 * h, hd);
        }
    });
}

void rope(const Tensor &out, const Tensor &x, const Tensor &pos_ids, const std::vector<float> &inv_freq) {
    detail::dispatch_float("rope", x.dtype(), x.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        detail::dispatch_index("rope", pos_ids.dtype(), pos_ids.device(), [&](auto itag) {
            using I = typename decltype(itag)::type;
            rope_kernel<T>(out, x, pos_ids.data_as<I>(), inv_freq);
        });
    });
}

} // namespace llaisys::ops::cpu
