// Host-side pieces of the CUDA helpers in cuda.cuh.
#include "ops/common/cuda.cuh"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace llaisys::ops::cuda {

namespace {
// A device attribute, asked of the driver once per device (kernels' launch planning asks per launch).
template <cudaDeviceAttr Attr>
int cached_attribute(int device) {
    static std::atomic<int> values[64] = {}; // 0: not asked yet (every attribute used here is > 0)
    int v = values[device].load(std::memory_order_relaxed);
    if (v == 0) {
        CUDA_CHECK(cudaDeviceGetAttribute(&v, Attr, device));
        values[device].store(v, std::memory_order_relaxed);
    }
    return v;
}
} // namespace

int sm_count(int device) {
    if (device < 0 || device >= 64) return 132;
    return cached_attribute<cudaDevAttrMultiProcessorCount>(device);
}

bool pdl_enabled(int device) {
    static const bool env_off = [] {
        const char *v = std::getenv("LLAISYS_PDL");
        return v && std::strcmp(v, "0") == 0;
    }();
    if (env_off || device < 0 || device >= 64) return false;
    return cached_attribute<cudaDevAttrComputeCapabilityMajor>(device) >= 9;
}

} // namespace llaisys::ops::cuda
