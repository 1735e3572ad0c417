#include "ops/rope/rope.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

#include <cmath>

namespace llaisys::ops {

const std::vector<float> &detail::rope_inv_freq(float theta, int64_t head_dim) {
    thread_local float cached_theta = 0.f;
    thread_local int64_t cached_dim = -1;
    thread_local std::vector<float> inv_freq;
    if (theta != cached_theta || head_dim != cached_dim) {
        inv_freq.resize(size_t(head_dim / 2));
        for (int64_t i = 0; i < head_dim / 2; ++i) {
            const float e = float(2 * i) / float(head_dim);
            inv_freq[size_t(i)] = 1.f / float(std::pow(double(theta), double(e)));
        }
        cached_theta = theta;
        cached_dim = head_dim;
    }
    return inv_freq;
}

static void check_rope_args(const char *op, const Tensor &out, const Tensor &x, const Tensor &pos_ids, float theta) {
    detail::check_operands(op, {{"out", out}, {"x", x}, {"pos_ids", pos_ids}});
    detail::check_float(op, "x", x);
    detail::check_same_dtype(op, "out", out, x);
    detail::check_index(op, "pos_ids", pos_ids);
    detail::check_ndim(op, "x", x, 3);
    detail::check_shape(op, "out", out, x.shape());
    detail::check_shape(op, "pos_ids", pos_ids, {x.size(0)});
    LLAISYS_CHECK(x.size(2) % 2 == 0, std::invalid_argument, op, ": head_dim must be even, got ", x.size(2));
    LLAISYS_CHECK(theta > 0.f && std::isfinite(theta), std::invalid_argument, op,
                  ": theta must be finite and > 0, got ", theta);
    LLAISYS_CHECK(x.device().is_cpu() || x.size(2) <= kRopeMaxCudaHeadDim, std::invalid_argument, op, ": head_dim ",
                  x.size(2), " is not supported on CUDA (at most ", kRopeMaxCudaHeadDim, ")");
}

void rope(const Tensor &out, const Tensor &x, const Tensor &pos_ids, float theta) {
    constexpr const char *op = "rope";
    check_rope_args(op, out, x, pos_ids, theta);
    if (x.numel() == 0) return;
    // The kernels take any seq/head strides but need each head's row dense.
    const Tensor xs = x.stride(2) == 1 ? x : x.contiguous();
    const Tensor pc = pos_ids.contiguous();
    const std::vector<float> &inv_freq = detail::rope_inv_freq(theta, x.size(2));
    auto run = [&](const Tensor &dst) {
        LLAISYS_DEVICE_DISPATCH(op, dst.device(), cpu::rope(dst, xs, pc, inv_freq), cuda::rope(dst, xs, pc, inv_freq));
    };
    if (out.stride(2) == 1) return run(out);
    Tensor tmp = Tensor::empty(out.shape(), out.dtype(), out.device());
    run(tmp);
    Tensor(out).copy_(tmp);
}

} // namespace llaisys::ops
