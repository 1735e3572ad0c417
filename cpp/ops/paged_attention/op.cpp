#include "ops/paged_attention/paged_attention.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

#include <string>

namespace llaisys::ops {

namespace {

void check_metadata(const char *op, const char *name, const Tensor &t, const Shape &shape) {
    detail::check_dtype(op, name, t, DType::I32);
    detail::check_shape(op, name, t, shape);
    LLAISYS_CHECK(t.is_contiguous(), std::invalid_argument, op, ": ", name, " must be contiguous");
}

void check_paged_args(const char *op, const Tensor &out, const Tensor &q, const Tensor &k_cache,
                      const Tensor &v_cache, const Tensor &block_tables, const Tensor &q_start,
                      const Tensor &kv_len, int64_t max_q_len) {
    detail::check_operands(op, {{"out", out}, {"q", q}, {"k_cache", k_cache}, {"v_cache", v_cache},
                                {"block_tables", block_tables}, {"q_start", q_start}, {"kv_len", kv_len}});
    detail::check_float(op, "q", q);
    detail::check_same_dtype(op, "k_cache", k_cache, q);
    detail::check_same_dtype(op, "v_cache", v_cache, q);
    detail::check_same_dtype(op, "out", out, q);
    detail::check_ndim(op, "q", q, 3);
    detail::check_ndim(op, "k_cache", k_cache, 4);
    detail::check_ndim(op, "block_tables", block_tables, 2);
    const int64_t T = q.size(0), nh = q.size(1), hd = q.size(2), nkvh = k_cache.size(2), B = block_tables.size(0);
    LLAISYS_CHECK(nh >= 1 && nkvh >= 1 && hd >= 1, std::invalid_argument, op, ": need at least one head, got q ",
                  shape_str(q.shape()), " and k_cache ", shape_str(k_cache.shape()));
    LLAISYS_CHECK(nh % nkvh == 0, std::invalid_argument, op, ": the number of query heads (", nh,
                  ") must be a multiple of the number of kv heads (", nkvh, ")");
    LLAISYS_CHECK(k_cache.size(3) == hd, std::invalid_argument, op, ": k_cache must have head dim ", hd,
                  " like q, got k_cache ", shape_str(k_cache.shape()), " and q ", shape_str(q.shape()));
    LLAISYS_CHECK(k_cache.size(0) >= 1 && k_cache.size(1) >= 1, std::invalid_argument, op,
                  ": k_cache needs at least one block of at least one row, got ", shape_str(k_cache.shape()));
    detail::check_shape(op, "v_cache", v_cache, k_cache.shape());
    detail::check_shape(op, "out", out, {T, nh, hd});
    // The kernels address cache rows by block id, so the cache must be one dense block of rows.
    LLAISYS_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), std::invalid_argument, op,
                  ": k_cache and v_cache must be contiguous");
    LLAISYS_CHECK(hd == 1 || out.stride(2) == 1, std::invalid_argument, op,
                  ": out must have a unit last stride (rows of sequences with no queries are left as they were, "
                  "so no temporary can stand in for it)");
    check_metadata(op, "q_start", q_start, {B + 1});
    check_metadata(op, "kv_len", kv_len, {B});
    LLAISYS_CHECK(block_tables.dtype() == DType::I32 && block_tables.is_contiguous(), std::invalid_argument, op,
                  ": block_tables must be contiguous i32, got ", dtype_name(block_tables.dtype()));
    LLAISYS_CHECK(max_q_len >= 0, std::invalid_argument, op, ": max_q_len must be >= 0, got ", max_q_len);
    // Numbers through std::to_string: see self_attention.hpp (an integer streamed inside _core segfaults on
    // the GPU image).
    LLAISYS_CHECK(!q.device().is_cuda() || hd * int64_t(q.element_size()) <= paged_detail::kCudaMaxRowBytes,
                  std::invalid_argument, op, ": head dim ", std::to_string(hd), " in ", dtype_name(q.dtype()),
                  " is not supported on CUDA (rows of at most ", std::to_string(paged_detail::kCudaMaxRowBytes),
                  " bytes)");
    LLAISYS_CHECK(k_cache.numel() < (int64_t(1) << 40) && T * nh < (int64_t(1) << 30) &&
                      block_tables.numel() < (int64_t(1) << 31) && k_cache.size(0) * k_cache.size(1) < (int64_t(1) << 31),
                  std::invalid_argument, op, ": sizes too large for the kernels' index types");
}

} // namespace

// Paged causal GQA attention; see ops.hpp.
void paged_attention(const Tensor &out, const Tensor &q, const Tensor &k_cache, const Tensor &v_cache,
                     const Tensor &block_tables, const Tensor &q_start, const Tensor &kv_len, float scale,
                     int64_t max_q_len, bool settled_history, int64_t window) {
    constexpr const char *op = "paged_attention";
    check_paged_args(op, out, q, k_cache, v_cache, block_tables, q_start, kv_len, max_q_len);
    LLAISYS_CHECK(window >= 0, std::invalid_argument, op, ": window must be >= 0 (0 = full attention), got ",
                  std::to_string(window));
    // A window past every position a sequence can hold (max_blocks * block_size) hides nothing: the kernels
    // then take the full path (and an int).
    if (window >= block_tables.size(1) * k_cache.size(1)) window = 0;
    const Tensor qc = q.size(2) <= 1 || q.stride(2) == 1 ? q : q.contiguous();
    LLAISYS_DEVICE_DISPATCH(
        op, out.device(),
        cpu::paged_attention(out, qc, k_cache, v_cache, block_tables, q_start, kv_len, scale, max_q_len, window),
        cuda::paged_attention(out, qc, k_cache, v_cache, block_tables, q_start, kv_len, scale, max_q_len,
                              settled_history, window));
}

} // namespace llaisys::ops
