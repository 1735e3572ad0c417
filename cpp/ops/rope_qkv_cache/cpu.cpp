#include "ops/rope_qkv_cache/rope_qkv_cache.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/rms_norm_rows.hpp"
#include "ops/common/rope_math.hpp"

#include <cstring>

namespace llaisys::ops::cpu {

// Per token t with position p = pos[t] and cache row r = row[t]: q_out[t] = rope(q heads),
// k_cache[r] = rope(k heads) (the first 2 * inv_freq.size() dims turned, the rest copied), v_cache[r] = v heads, with rope's own cos/sin and row rotation
// (common/rope_math.hpp), so the result equals rope + index_copy bit for bit. With q_norm/k_norm (non-null),
// each q/k head is first normed into a scratch row by rms_norm's own row kernel (rms_norm_rows.hpp), so
// the result equals rms_norm + rms_norm + rope + index_copy bit for bit. Every row is checked before
// anything is written.
template <typename T, typename I, typename R>
static void rope_qkv_cache_kernel(const Tensor &q_out, const Tensor &k_cache, const Tensor &v_cache,
                                  const Tensor &qkv, const I *pos, const R *row_of, const char *row_name,
                                  const std::vector<float> &inv_freq, const T *q_norm, const T *k_norm, float eps) {
    const int64_t tokens = qkv.size(0), nh = q_out.size(1), nkvh = k_cache.size(1), hd = q_out.size(2);
    const int64_t h = int64_t(inv_freq.size()); // pairs (i, i + h); dims [2h, hd) are copied
    const int64_t capacity = k_cache.size(0);
    for (int64_t t = 0; t < tokens; ++t)
        LLAISYS_CHECK(row_of[t] >= 0 && row_of[t] < capacity, std::out_of_range, "rope_qkv_cache: ", row_name, " ",
                      int64_t(row_of[t]), " at index ", t, " is out of range of the KV cache [0, ", capacity, ")");
    const T *x = qkv.data_as<T>(); // [tokens, nh + 2 nkvh, hd]: q heads, k heads, v heads; strides (qkv_s, hd, 1)
    T *q = q_out.data_as<T>();     // [tokens, nh, hd], strides (qs, qh, 1)
    T *k = k_cache.data_as<T>();   // [capacity, nkvh, hd], strides (ks, kh, 1)
    T *v = v_cache.data_as<T>();   // [capacity, nkvh, hd], strides (vs, vh, 1)
    const int64_t xs = qkv.stride(0), qs = q_out.stride(0), qh = q_out.stride(1);
    const int64_t ks = k_cache.stride(0), kh = k_cache.stride(1), vs = v_cache.stride(0), vh = v_cache.stride(1);
    parallel_for(tokens, (nh + 2 * nkvh) * hd, [&](int64_t t) {
        std::vector<float> cos_sin(size_t(2 * h)); // cos [h] | sin [h]
        rope_cos_sin(float(pos[t]), inv_freq, h, cos_sin.data());
        std::vector<T> normed(q_norm ? size_t(hd) : 0);
        // the head at `in` as rope reads it: itself, or its rms_norm (rounded to T) when norming
        const auto head_in = [&](const T *in, const T *w) -> const T * {
            if (!w) return in;
            rms_norm_row(normed.data(), in, w, hd, eps);
            return normed.data();
        };
        const T *src = x + t * xs;
        const int64_t r = int64_t(row_of[t]);
        for (int64_t head = 0; head < nh; ++head) {
            const T *in = head_in(src + head * hd, q_norm);
            rope_row(q + t * qs + head * qh, in, cos_sin.data(), h);
            rope_pass(q + t * qs + head * qh, in, 2 * h, hd);
        }
        for (int64_t head = 0; head < nkvh; ++head) {
            const T *in = head_in(src + (nh + head) * hd, k_norm);
            rope_row(k + r * ks + head * kh, in, cos_sin.data(), h);
            rope_pass(k + r * ks + head * kh, in, 2 * h, hd);
            std::memcpy(v + r * vs + head * vh, src + (nh + nkvh + head) * hd, size_t(hd) * sizeof(T));
        }
    });
}

void rope_qkv_cache(const Tensor &q_out, const Tensor &k_cache, const Tensor &v_cache, const Tensor &qkv,
                    const Tensor &pos_ids, const Tensor &slots, const std::vector<float> &inv_freq,
                    const Tensor &q_norm, const Tensor &k_norm, float eps) {
    constexpr const char *op = "rope_qkv_cache";
    const Tensor &rows = slots.defined() ? slots : pos_ids;
    detail::dispatch_float(op, qkv.dtype(), qkv.device(), [&](auto tag) {
        using T = typename decltype(tag)::type;
        detail::dispatch_index(op, pos_ids.dtype(), pos_ids.device(), [&](auto itag) {
            using I = typename decltype(itag)::type;
            detail::dispatch_index(op, rows.dtype(), rows.device(), [&](auto rtag) {
                using R = typename decltype(rtag)::type;
                rope_qkv_cache_kernel<T>(q_out, k_cache, v_cache, qkv, pos_ids.data_as<I>(), rows.data_as<R>(),
                                         slots.defined() ? "slot" : "position", inv_freq,
                                         q_norm.defined() ? q_norm.data_as<T>() : nullptr,
                                         k_norm.defined() ? k_norm.data_as<T>() : nullptr, eps);
            });
        });
    });
}

} // namespace llaisys::ops::cpu
