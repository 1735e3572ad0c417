#include "ops/kv_shift/kv_shift.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/rope_math.hpp"

#include <cstring>

namespace llaisys::ops::cpu {

// Row i: k_cache[dst[i]] = k_cache[src[i]] turned by angle_j = float(delta) * inv_freq[j] (rope's own
// cos/sin and row rotation, ops/common/rope_math.hpp; dims past 2h copied), v_cache[dst[i]] = v_cache[src[i]] (nothing
// to do when they are the same row). Every row is checked before anything is written.
template <typename T, typename I>
static void kv_shift_kernel(const Tensor &k_cache, const Tensor &v_cache, const I *src, const I *dst, int64_t n,
                            int64_t delta, const std::vector<float> &inv_freq) {
    const int64_t capacity = k_cache.size(0), nkvh = k_cache.size(1), hd = k_cache.size(2);
    const int64_t h = int64_t(inv_freq.size());
    for (int64_t i = 0; i < n; ++i)
        LLAISYS_CHECK(src[i] >= 0 && src[i] < capacity && dst[i] >= 0 && dst[i] < capacity, std::out_of_range,
                      "kv_shift: row ", int64_t(src[i]), " -> ", int64_t(dst[i]), " at index ", i,
                      " is out of range of the KV cache [0, ", capacity, ")");
    T *k = k_cache.data_as<T>(); // [capacity, nkvh, hd], strides (ks, kh, 1)
    T *v = v_cache.data_as<T>(); // [capacity, nkvh, hd], strides (vs, vh, 1)
    const int64_t ks = k_cache.stride(0), kh = k_cache.stride(1), vs = v_cache.stride(0), vh = v_cache.stride(1);
    std::vector<float> cos_sin(size_t(2 * h)); // cos [h] | sin [h]: one angle set for every row
    rope_cos_sin(float(delta), inv_freq, h, cos_sin.data());
    parallel_for(n, 2 * nkvh * hd, [&](int64_t i) {
        const int64_t s = int64_t(src[i]), d = int64_t(dst[i]);
        for (int64_t head = 0; head < nkvh; ++head) {
            rope_row(k + d * ks + head * kh, k + s * ks + head * kh, cos_sin.data(), h);
            rope_pass(k + d * ks + head * kh, k + s * ks + head * kh, 2 * h, hd);
            if (s != d) std::memcpy(v + d * vs + head * vh, v + s * vs + head * vh, size_t(hd) * sizeof(T));
        }
    });
}

void kv_shift(const Tensor &k_cache, const Tensor &v_cache, const Tensor &src, const Tensor &dst, int64_t delta,
              const std::vector<float> &inv_freq) {
    constexpr const char *op = "kv_shift";
    LLAISYS_CHECK(src.dtype() == dst.dtype(), std::invalid_argument, op, ": src and dst must share a dtype");
    detail::dispatch_float(op, k_cache.dtype(), k_cache.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        detail::dispatch_index(op, src.dtype(), src.device(), [&](auto itag) {
            using I = typename decltype(itag)::type;
            kv_shift_kernel<T>(k_cache, v_cache, src.data_as<I>(), dst.data_as<I>(), src.numel(), delta, inv_freq);
        });
    });
}

} // namespace llaisys::ops::cpu
