#include "ops/rope/rope.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/cpu.hpp"

#include <cmath>

namespace llaisys::ops::cpu {

// Per position s: angle_i = float(pos[s]) * inv_freq[i] (f32), then for every head the pair
// (x[i], x[i + h]) turns by angle_i. Each pair is read before it is written, so out may alias x.
template <typename T, typename I>
static void rope_kernel(const Tensor &out, const Tensor &x, const I *pos, const std::vector<float> &inv_freq) {
    const int64_t seq = x.size(0), heads = x.size(1), h = x.size(2) / 2;
    const int64_t xs = x.stride(0), xh = x.stride(1), os = out.stride(0), oh = out.stride(1);
    const T *xp = x.data_as<T>(); // [seq, heads, 2h], strides (xs, xh, 1)
    T *op = out.data_as<T>();     // [seq, heads, 2h], strides (os, oh, 1)
    parallel_for(seq, heads * 2 * h, [&](int64_t s) {
        std::vector<float> cos_sin(size_t(2 * h)); // cos [h] | sin [h]
        const float p = float(pos[s]);
        for (int64_t i = 0; i < h; ++i) {
            const float angle = p * inv_freq[size_t(i)];
            cos_sin[size_t(i)] = std::cos(angle);
            cos_sin[size_t(h + i)] = std::sin(angle);
        }
        for (int64_t head = 0; head < heads; ++head) {
            const T *xr = xp + s * xs + head * xh; // [2h]
            T *orow = op + s * os + head * oh;     // [2h]
            for (int64_t i = 0; i < h; ++i) {
                const float c = cos_sin[size_t(i)], sn = cos_sin[size_t(h + i)];
                const float x1 = load(xr, i), x2 = load(xr, i + h);
                store(orow, i, x1 * c - x2 * sn);
                store(orow, i + h, x2 * c + x1 * sn);
            }
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
