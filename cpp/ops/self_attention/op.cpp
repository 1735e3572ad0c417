#include "ops/self_attention/self_attention.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

namespace llaisys::ops {

// Causal GQA attention; see ops.hpp. Query i of head h sees keys j <= i + kvlen - qlen of kv head
// h / (nh / nkvh); softmax in f32 (online), the output rounded once.
void self_attention(const Tensor &out, const Tensor &q, const Tensor &k, const Tensor &v, float scale) {
    constexpr const char *op = "self_attention";
    attention_detail::check_args(op, out, q, k, v);
    if (q.size(0) == 0) return;
    const Tensor qc = attention_detail::unit_last_stride(q), kc = attention_detail::unit_last_stride(k),
                 vc = attention_detail::unit_last_stride(v);
    detail::with_contiguous_out(out, [&](const Tensor &dst) {
        LLAISYS_DEVICE_DISPATCH(op, dst.device(), cpu::self_attention(dst, qc, kc, vc, scale),
                                cuda::self_attention(dst, qc, kc, vc, scale));
    });
}

} // namespace llaisys::ops
