// Host-side pieces of the CUDA helpers in cuda.cuh.
#include "ops/common/cuda.cuh"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace llaisys::ops::cuda {

// Per device: 0 unknown, 1 off, 2 on. The environment is read once per process.
bool pdl_enabled(int device) {
    static std::atomic<int> state[64] = {};
    static const bool env_off = [] {
        const char *v = std::getenv("LLAISYS_PDL");
        return v && std::strcmp(v, "0") == 0;
    }();
    if (device < 0 || device >= 64) return false;
    int s = state[device].load(std::memory_order_relaxed);
    if (s == 0) {
        int major = 0;
        CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
        s = !env_off && major >= 9 ? 2 : 1;
        state[device].store(s, std::memory_order_relaxed);
    }
    return s == 2;
}

} // namespace llaisys::ops::cuda
