#include "ops/embedding/embedding.hpp"

#include "core/runtime.hpp"
#include "ops/common/checks.hpp"
#include "ops/common/cuda.cuh"

#include <cstdint>

namespace llaisys::ops::cuda {

// Error code the embedding kernel writes into runtime::cuda::error_flag (synchronize raises IndexError).
constexpr int kIdOutOfRange = 1;

// One block per id: copies row ids[i] of weight [V, units] into out [n, units], where a unit is the
// widest word (16, 8, 4 or 2 bytes) that divides the row and both base addresses. An id outside [0, V)
// sets the device error flag (no host sync here) and zero-fills the row so the output stays defined.
template <typename Unit, typename Id>
__global__ void embedding_kernel(Unit *out, const Id *ids, const Unit *weight, int64_t V, int64_t units,
                                 int *error_flag) {
    const int64_t i = blockIdx.x;
    const int64_t id = int64_t(ids[i]);
    Unit *dst = out + i * units;
    if (id < 0 || id >= V) {
        if (threadIdx.x == 0) *error_flag = kIdOutOfRange;
        for (int64_t u = threadIdx.x; u < units; u += blockDim.x) dst[u] = Unit{};
        return;
    }
    const Unit *src = weight + id * units;
    for (int64_t u = threadIdx.x; u < units; u += blockDim.x) dst[u] = src[u];
}

template <typename Unit, typename Id>
static void launch_embedding(const Tensor &out, const Tensor &ids, const Tensor &weight, size_t row_bytes) {
    const int64_t n = ids.numel(), units = int64_t(row_bytes / sizeof(Unit));
    // Enough threads for one pass over a row (896 bf16 = 112 16-byte units), at most 256.
    const int threads = int(std::min<int64_t>(256, std::max<int64_t>(32, ceil_div(units, 32) * 32)));
    embedding_kernel<Unit, Id><<<unsigned(n), threads, 0, stream_of(out)>>>(
        static_cast<Unit *>(out.data()), ids.data_as<Id>(), static_cast<const Unit *>(weight.data()), weight.size(0),
        units, ::llaisys::runtime::cuda::error_flag(out.device()));
    CUDA_CHECK_LAUNCH();
}

// The widest copy word dividing the row size and both base addresses.
static size_t copy_unit(const Tensor &out, const Tensor &weight, size_t row_bytes) {
    const uintptr_t bits = reinterpret_cast<uintptr_t>(out.data()) | reinterpret_cast<uintptr_t>(weight.data()) | row_bytes;
    for (size_t unit : {16, 8, 4})
        if (bits % unit == 0) return unit;
    return 2;
}

void embedding(const Tensor &out, const Tensor &ids, const Tensor &weight) {
    const int64_t n = ids.numel();
    const size_t row_bytes = size_t(weight.size(1)) * weight.element_size();
    if (n == 0 || row_bytes == 0) return; // nothing to copy; no id is read
    LLAISYS_CHECK(n <= INT32_MAX, std::invalid_argument, "embedding: too many ids for one launch: ", n);
    detail::dispatch_index("embedding", ids.dtype(), ids.device(), [&](auto tag) {
        using Id = typename decltype(tag)::type;
        switch (copy_unit(out, weight, row_bytes)) {
        case 16: return launch_embedding<uint4, Id>(out, ids, weight, row_bytes);
        case 8: return launch_embedding<uint2, Id>(out, ids, weight, row_bytes);
        case 4: return launch_embedding<uint32_t, Id>(out, ids, weight, row_bytes);
        default: return launch_embedding<uint16_t, Id>(out, ids, weight, row_bytes);
        }
    });
}

} // namespace llaisys::ops::cuda
