#include "ops/index_copy/index_copy.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

namespace llaisys::ops {

void index_copy(const Tensor &out, const Tensor &index, const Tensor &src) {
    constexpr const char *op = "index_copy";
    detail::check_operands(op, {{"out", out}, {"index", index}, {"src", src}});
    detail::check_index(op, "index", index);
    detail::check_ndim(op, "index", index, 1);
    detail::check_same_dtype(op, "src", src, out);
    LLAISYS_CHECK(out.ndim() >= 1, std::invalid_argument, op, ": out must have at least one dim");
    Shape want = out.shape();
    want[0] = index.size(0);
    detail::check_shape(op, "src", src, want);
    // The rows are written in place, so out must be dense (a KV cache slot is).
    LLAISYS_CHECK(out.is_contiguous(), std::invalid_argument, op, ": out must be contiguous");
    if (index.size(0) == 0) return;
    const int64_t row_bytes = int64_t(out.element_size()) * (out.numel() / std::max<int64_t>(out.size(0), 1));
    const Tensor idx = index.contiguous(), s = src.contiguous();
    LLAISYS_DEVICE_DISPATCH(op, out.device(), cpu::index_copy(out, idx, s, row_bytes),
                            cuda::index_copy(out, idx, s, row_bytes));
}

} // namespace llaisys::ops
