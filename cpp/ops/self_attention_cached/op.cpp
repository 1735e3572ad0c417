#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

namespace llaisys::ops {
#ifdef LLAISYS_WITH_CUDA
namespace cuda {
// cpp/ops/self_attention/cuda.cu: the decode kernels with the length read on the device.
void self_attention_cached(const Tensor &out, const Tensor &q, const Tensor &k_cache, const Tensor &v_cache,
                           const Tensor &kv_len, float scale);
} // namespace cuda
#endif

void self_attention_cached(const Tensor &out, const Tensor &q, const Tensor &k_cache, const Tensor &v_cache,
                           const Tensor &kv_len, float scale) {
    constexpr const char *op = "self_attention_cached";
    detail::check_defined(op, "kv_len", kv_len);
    detail::check_same_device(op, {&out, &q, &k_cache, &v_cache, &kv_len});
    detail::check_index(op, "kv_len", kv_len);
    detail::check_shape(op, "kv_len", kv_len, {1});
    if (q.device().is_cpu()) { // the length is host memory here: read it and run the plain op on the slice
        const int64_t len = kv_len.dtype() == DType::I64 ? *kv_len.data_as<int64_t>() : *kv_len.data_as<int32_t>();
        LLAISYS_CHECK(len >= q.size(0) && len <= k_cache.size(0), std::out_of_range, op, ": kv_len ", len,
                      " out of range [", q.size(0), ", ", k_cache.size(0), "]");
        return self_attention(out, q, k_cache.slice(0, 0, len), v_cache.slice(0, 0, len), scale);
    }
#ifdef LLAISYS_WITH_CUDA
    DeviceGuard guard(q.device());
    cuda::self_attention_cached(out, q, k_cache, v_cache, kv_len, scale);
#else
    detail::cuda_not_compiled(op);
#endif
}

} // namespace llaisys::ops
