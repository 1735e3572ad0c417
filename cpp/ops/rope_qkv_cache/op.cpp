#include "ops/rope_qkv_cache/rope_qkv_cache.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"
#include "ops/common/rope_table.hpp"

#include <cmath>
#include <utility>

namespace llaisys::ops {

// The checks both overloads share: every tensor rule of ops.hpp (head_dim and theta/inv_freq are each
// overload's own).
static void check_rope_qkv_cache_args(const char *op, const Tensor &q_out, const Tensor &k_cache,
                                      const Tensor &v_cache, const Tensor &qkv, const Tensor &pos_ids,
                                      const Tensor &slots) {
    detail::check_operands(op, {{"qkv", qkv}, {"q_out", q_out}, {"k_cache", k_cache}, {"v_cache", v_cache},
                                {"pos_ids", pos_ids}});
    detail::check_float(op, "qkv", qkv);
    detail::check_same_dtype(op, "q_out", q_out, qkv);
    detail::check_same_dtype(op, "k_cache", k_cache, qkv);
    detail::check_same_dtype(op, "v_cache", v_cache, qkv);
    detail::check_index(op, "pos_ids", pos_ids);
    detail::check_ndim(op, "qkv", qkv, 2);
    detail::check_ndim(op, "q_out", q_out, 3);
    detail::check_ndim(op, "k_cache", k_cache, 3);
    const int64_t tokens = qkv.size(0), nh = q_out.size(1), hd = q_out.size(2), nkvh = k_cache.size(1);
    detail::check_shape(op, "q_out", q_out, {tokens, nh, hd});
    detail::check_shape(op, "k_cache", k_cache, {k_cache.size(0), nkvh, hd});
    detail::check_shape(op, "v_cache", v_cache, k_cache.shape());
    detail::check_shape(op, "pos_ids", pos_ids, {tokens});
    if (slots.defined()) {
        detail::check_on_device(op, qkv.device(), slots);
        detail::check_index(op, "slots", slots);
        detail::check_shape(op, "slots", slots, {tokens});
    }
    LLAISYS_CHECK(qkv.size(1) == (nh + 2 * nkvh) * hd, std::invalid_argument, op,
                  ": qkv's last dim must be (nh + 2 * nkvh) * head_dim = (", nh, " + 2 * ", nkvh, ") * ", hd, " = ",
                  (nh + 2 * nkvh) * hd, ", got ", qkv.size(1));
    // The cache rows are written in place: no temporary can stand in for them.
    LLAISYS_CHECK(k_cache.stride(2) == 1 && v_cache.stride(2) == 1, std::invalid_argument, op,
                  ": k_cache and v_cache must have a contiguous last dim");
}

// The optional q/k norm: both weights or neither, each [head_dim] of qkv's dtype on its device, eps as
// rms_norm takes it.
static void check_qk_norm_args(const char *op, const Tensor &qkv, int64_t hd, const Tensor &q_norm,
                               const Tensor &k_norm, float eps) {
    LLAISYS_CHECK(q_norm.defined() == k_norm.defined(), std::invalid_argument, op,
                  ": q_norm and k_norm must be given together (or neither)");
    if (!q_norm.defined()) return;
    for (const auto &[name, w] : {std::pair<const char *, const Tensor &>{"q_norm", q_norm}, {"k_norm", k_norm}}) {
        detail::check_on_device(op, qkv.device(), w);
        detail::check_same_dtype(op, name, w, qkv);
        detail::check_shape(op, name, w, {hd});
    }
    LLAISYS_CHECK(eps >= 0.f && std::isfinite(eps), std::invalid_argument, op,
                  ": eps must be finite and >= 0, got ", eps);
}

// rope_qkv_cache with a checked table: inv_freq [r], 1 <= r <= head_dim / 2, and checked norm weights.
static void rope_qkv_cache_table(const char *op, const Tensor &q_out, const Tensor &k_cache, const Tensor &v_cache,
                                 const Tensor &qkv, const Tensor &pos_ids, const std::vector<float> &inv_freq,
                                 const Tensor &slots, const Tensor &q_norm, const Tensor &k_norm, float eps) {
    if (qkv.size(0) == 0) return;
    const Tensor x = qkv.stride(1) == 1 ? qkv : qkv.contiguous();
    const Tensor pc = pos_ids.contiguous(), sc = slots.defined() ? slots.contiguous() : Tensor();
    // contiguous weights, as rms_norm reads them (its CUDA vector width depends on their alignment)
    const Tensor qn = q_norm.defined() ? q_norm.contiguous() : Tensor();
    const Tensor kn = k_norm.defined() ? k_norm.contiguous() : Tensor();
    auto run = [&](const Tensor &q) {
        LLAISYS_DEVICE_DISPATCH(op, q.device(),
                                cpu::rope_qkv_cache(q, k_cache, v_cache, x, pc, sc, inv_freq, qn, kn, eps),
                                cuda::rope_qkv_cache(q, k_cache, v_cache, x, pc, sc, inv_freq, qn, kn, eps));
    };
    if (q_out.stride(2) == 1) return run(q_out);
    Tensor tmp = q_out.contiguous(); // holds q_out's values: a token that writes nothing leaves them as they were
    run(tmp);
    Tensor(q_out).copy_(tmp);
}

void rope_qkv_cache(const Tensor &q_out, const Tensor &k_cache, const Tensor &v_cache, const Tensor &qkv,
                    const Tensor &pos_ids, float theta, const Tensor &slots, const Tensor &q_norm,
                    const Tensor &k_norm, float eps) {
    constexpr const char *op = "rope_qkv_cache";
    check_rope_qkv_cache_args(op, q_out, k_cache, v_cache, qkv, pos_ids, slots);
    const int64_t hd = q_out.size(2);
    check_qk_norm_args(op, qkv, hd, q_norm, k_norm, eps);
    LLAISYS_CHECK(hd % 2 == 0, std::invalid_argument, op, ": head_dim must be even, got ", hd);
    LLAISYS_CHECK(theta > 0.f && std::isfinite(theta), std::invalid_argument, op,
                  ": theta must be finite and > 0, got ", theta);
    LLAISYS_CHECK(qkv.device().is_cpu() || hd <= kRopeMaxCudaHeadDim, std::invalid_argument, op, ": head_dim ", hd,
                  " is not supported on CUDA (at most ", kRopeMaxCudaHeadDim, ")");
    if (qkv.size(0) == 0) return;
    rope_qkv_cache_table(op, q_out, k_cache, v_cache, qkv, pos_ids, detail::rope_inv_freq(theta, hd), slots, q_norm,
                         k_norm, eps);
}

void rope_qkv_cache(const Tensor &q_out, const Tensor &k_cache, const Tensor &v_cache, const Tensor &qkv,
                    const Tensor &pos_ids, const std::vector<float> &inv_freq, const Tensor &slots,
                    const Tensor &q_norm, const Tensor &k_norm, float eps) {
    constexpr const char *op = "rope_qkv_cache";
    check_rope_qkv_cache_args(op, q_out, k_cache, v_cache, qkv, pos_ids, slots);
    detail::check_inv_freq(op, inv_freq, q_out.size(2), qkv.device());
    check_qk_norm_args(op, qkv, q_out.size(2), q_norm, k_norm, eps);
    rope_qkv_cache_table(op, q_out, k_cache, v_cache, qkv, pos_ids, inv_freq, slots, q_norm, k_norm, eps);
}

} // namespace llaisys::ops
