#include "ops/rearrange/rearrange.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

namespace llaisys::ops {

CopyPlan make_copy_plan(const Tensor &dst, const Tensor &src) {
    CopyPlan p{{}, {}, {}, dst.element_size(), dst.numel()};
    for (int d = 0; d < dst.ndim(); ++d) {
        if (dst.shape()[d] == 1) continue; // size-1 dims move nothing
        const int64_t n = dst.shape()[d], ds = dst.strides()[d], ss = src.strides()[d];
        // Merge with the previous (outer) dim when both tensors step over it as one run.
        if (!p.shape.empty() && p.dst_strides.back() == ds * n && p.src_strides.back() == ss * n) {
            p.shape.back() *= n;
            p.dst_strides.back() = ds;
            p.src_strides.back() = ss;
        } else {
            p.shape.push_back(n);
            p.dst_strides.push_back(ds);
            p.src_strides.push_back(ss);
        }
    }
    if (p.shape.empty()) { // a single element
        p.shape = {1};
        p.dst_strides = p.src_strides = {1};
    }
    return p;
}

void rearrange(const Tensor &out, const Tensor &x) {
    constexpr const char *op = "rearrange";
    detail::check_defined(op, "out", out);
    detail::check_defined(op, "x", x);
    detail::check_same_device(op, {&out, &x});
    detail::check_same_dtype(op, "out", out, x);
    detail::check_shape(op, "out", out, x.shape());
    if (x.numel() == 0) return;
    const CopyPlan plan = make_copy_plan(out, x);
    LLAISYS_CHECK(plan.shape.size() <= 8, std::invalid_argument, op, ": more than 8 non-mergeable dims");
    LLAISYS_DEVICE_DISPATCH(op, out.device(), cpu::rearrange(out, x, plan), cuda::rearrange(out, x, plan));
}

} // namespace llaisys::ops
