#include "ops/kv_shift/kv_shift.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"
#include "ops/common/rope_table.hpp"

namespace llaisys::ops {

void kv_shift(const Tensor &k_cache, const Tensor &v_cache, const Tensor &src, const Tensor &dst, int64_t delta,
              const std::vector<float> &inv_freq) {
    constexpr const char *op = "kv_shift";
    detail::check_operands(op, {{"k_cache", k_cache}, {"v_cache", v_cache}, {"src", src}, {"dst", dst}});
    detail::check_float(op, "k_cache", k_cache);
    detail::check_same_dtype(op, "v_cache", v_cache, k_cache);
    detail::check_ndim(op, "k_cache", k_cache, 3);
    detail::check_shape(op, "v_cache", v_cache, k_cache.shape());
    detail::check_index(op, "src", src);
    detail::check_index(op, "dst", dst);
    detail::check_ndim(op, "src", src, 1);
    detail::check_shape(op, "dst", dst, src.shape());
    // The cache rows are written in place: no temporary can stand in for them.
    LLAISYS_CHECK(k_cache.stride(2) == 1 && v_cache.stride(2) == 1, std::invalid_argument, op,
                  ": k_cache and v_cache must have a contiguous last dim");
    detail::check_inv_freq(op, inv_freq, k_cache.size(2), k_cache.device());
    // |delta| * inv_freq must stay an exact-enough f32 angle: positions beyond 2^24 are not integers in f32
    LLAISYS_CHECK(delta > -(int64_t(1) << 24) && delta < (int64_t(1) << 24), std::invalid_argument, op,
                  ": delta must be within +-2^24, got ", delta);
    if (src.numel() == 0) return;
    const Tensor s = src.contiguous(), d = dst.contiguous();
    LLAISYS_DEVICE_DISPATCH(op, k_cache.device(), cpu::kv_shift(k_cache, v_cache, s, d, delta, inv_freq),
                            cuda::kv_shift(k_cache, v_cache, s, d, delta, inv_freq));
}

} // namespace llaisys::ops
