#pragma once
#include "llaisys/tensor.hpp"
#include "ops/common/checks.hpp"

#include <string>

// Backends receive validated tensors: q [qlen, nh, hd], k [kvlen, nkvh, hd], v [kvlen, nkvh, hd_v],
// out [qlen, nh, hd_v] (contiguous), all with a unit stride on the last dim; the seq and head dims of
// q, k and v may have any strides (a KV-cache slice, a view of a fused QKV buffer). 1 <= qlen <= kvlen,
// nh % nkvh == 0.
namespace llaisys::ops::cpu {
void self_attention(const Tensor &out, const Tensor &q, const Tensor &k, const Tensor &v, float scale);
}
namespace llaisys::ops::cuda {
void self_attention(const Tensor &out, const Tensor &q, const Tensor &k, const Tensor &v, float scale);
// self_attention_cached's CUDA side (declared again in ops/self_attention_cached/op.cpp): k_cache and
// v_cache [capacity, nkvh, hd] unvalidated, kv_len [1] i64/i32 on the device. Validates like
// self_attention with kvlen = capacity; the kernels read the length on the device.
void self_attention_cached(const Tensor &out, const Tensor &q, const Tensor &k_cache, const Tensor &v_cache,
                           const Tensor &kv_len, float scale);
}

namespace llaisys::ops::attention_detail {

constexpr int64_t kCudaMaxHeadDim = 256; // the split-KV kernel keeps per-thread state for at most this


// Every check of self_attention (and of self_attention_cached, with the cache capacity as kvlen).
inline void check_args(const char *op, const Tensor &out, const Tensor &q, const Tensor &k, const Tensor &v) {
    detail::check_operands(op, {{"out", out}, {"q", q}, {"k", k}, {"v", v}});
    detail::check_float(op, "q", q);
    detail::check_same_dtype(op, "k", k, q);
    detail::check_same_dtype(op, "v", v, q);
    detail::check_same_dtype(op, "out", out, q);
    detail::check_ndim(op, "q", q, 3);
    detail::check_ndim(op, "k", k, 3);
    detail::check_ndim(op, "v", v, 3);
    detail::check_ndim(op, "out", out, 3);
    const int64_t qlen = q.size(0), nh = q.size(1), hd = q.size(2), kvlen = k.size(0), nkvh = k.size(1);
    LLAISYS_CHECK(nh >= 1 && nkvh >= 1, std::invalid_argument, op, ": need at least one head, got q ",
                  shape_str(q.shape()), " and k ", shape_str(k.shape()));
    LLAISYS_CHECK(nh % nkvh == 0, std::invalid_argument, op, ": the number of query heads (", nh,
                  ") must be a multiple of the number of kv heads (", nkvh, ")");
    LLAISYS_CHECK(hd >= 1 && k.size(2) == hd, std::invalid_argument, op, ": k must have head dim ", hd,
                  " like q, got k ", shape_str(k.shape()), " and q ", shape_str(q.shape()));
    LLAISYS_CHECK(v.size(0) == kvlen && v.size(1) == nkvh && v.size(2) >= 1, std::invalid_argument, op,
                  ": v must have shape [", kvlen, ", ", nkvh, ", hd_v] like k, got ", shape_str(v.shape()));
    LLAISYS_CHECK(kvlen >= 1, std::invalid_argument, op, ": kvlen must be >= 1, got k ", shape_str(k.shape()));
    LLAISYS_CHECK(qlen <= kvlen, std::invalid_argument, op, ": qlen (", qlen, ") must be <= kvlen (", kvlen,
                  "): the first queries would see no key");
    detail::check_shape(op, "out", out, {qlen, nh, v.size(2)});
    // Numbers through std::to_string: on the GPU image, streaming an integer into an ostringstream inside
    // _core (detail::concat) segfaults (std::ostream::_M_insert<long>); strings stream fine.
    LLAISYS_CHECK(!q.device().is_cuda() || (hd <= kCudaMaxHeadDim && v.size(2) <= kCudaMaxHeadDim),
                  std::invalid_argument, op, ": head dim ", std::to_string(hd), " (values ", std::to_string(v.size(2)),
                  ") is not supported: at most ", std::to_string(kCudaMaxHeadDim), " on CUDA");
}

// Kernels read rows through their seq/head strides but need the elements of one row adjacent.
inline Tensor unit_last_stride(const Tensor &t) { return t.size(2) <= 1 || t.stride(2) == 1 ? t : t.contiguous(); }

} // namespace llaisys::ops::attention_detail
