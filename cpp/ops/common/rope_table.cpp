// The rope table helpers of rope_table.hpp, one definition for rope and rope_qkv_cache.
#include "ops/common/rope_table.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

#include <cmath>

namespace llaisys::ops {

const std::vector<float> &detail::rope_inv_freq(float theta, int64_t head_dim) {
    thread_local float cached_theta = 0.f;
    thread_local int64_t cached_dim = -1;
    thread_local std::vector<float> inv_freq;
    if (theta != cached_theta || head_dim != cached_dim) {
        inv_freq = ops::rope_inv_freq(theta, head_dim, {});
        cached_theta = theta;
        cached_dim = head_dim;
    }
    return inv_freq;
}

void detail::check_inv_freq(const char *op, const std::vector<float> &inv_freq, int64_t head_dim, Device device) {
    LLAISYS_CHECK(!inv_freq.empty() && int64_t(inv_freq.size()) <= head_dim / 2, std::invalid_argument, op,
                  ": inv_freq must have 1 .. head_dim / 2 = ", head_dim / 2, " entries, got ", inv_freq.size());
    for (size_t i = 0; i < inv_freq.size(); ++i)
        LLAISYS_CHECK(std::isfinite(inv_freq[i]), std::invalid_argument, op, ": inv_freq[", i,
                      "] must be finite, got ", inv_freq[i]);
    LLAISYS_CHECK(device.is_cpu() || head_dim <= kRopeMaxCudaHeadDim, std::invalid_argument, op, ": head_dim ",
                  head_dim, " is not supported on CUDA (at most ", kRopeMaxCudaHeadDim, ")");
}

} // namespace llaisys::ops
