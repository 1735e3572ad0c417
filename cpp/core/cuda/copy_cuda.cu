// The CUDA side of runtime::copy_strided (core/copy.hpp): a device memcpy when both sides are dense,
// else one thread per element.
#include "core/copy.hpp"
#include "core/cuda/check.hpp"
#include "llaisys/stream.hpp"

#include <algorithm>
#include <cstdint>

namespace llaisys::runtime::cuda {

namespace {
struct CopyArgs {
    int ndim;
    int64_t shape[kCopyMaxDims], dst_strides[kCopyMaxDims], src_strides[kCopyMaxDims];
};

// Grid-stride: decompose the linear index, gather from src, scatter to dst.
template <typename E>
__global__ void copy_kernel(E *dst, const E *src, CopyArgs a, int64_t n) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        int64_t r = i, doff = 0, soff = 0;
        for (int d = a.ndim - 1; d >= 0; --d) {
            const int64_t idx = r % a.shape[d];
            r /= a.shape[d];
            doff += idx * a.dst_strides[d];
            soff += idx * a.src_strides[d];
        }
        dst[doff] = src[soff];
    }
}

template <typename E>
void launch(void *dst, const void *src, const CopyArgs &args, int64_t n, cudaStream_t stream) {
    const int threads = 256;
    const int blocks = int(std::min<int64_t>((n + threads - 1) / threads, 65535 * 4));
    copy_kernel<E><<<blocks, threads, 0, stream>>>(static_cast<E *>(dst), static_cast<const E *>(src), args, n);
    LLAISYS_CUDA_CHECK(cudaGetLastError());
}
} // namespace

void copy_strided(void *dst, const void *src, const CopyPlan &p, Device device) {
    DeviceGuard guard(device);
    const auto stream = static_cast<cudaStream_t>(current_stream(device).handle());
    if (p.shape.size() == 1 && p.dst_strides[0] == 1 && p.src_strides[0] == 1) {
        LLAISYS_CUDA_CHECK(
            cudaMemcpyAsync(dst, src, size_t(p.numel) * p.element_size, cudaMemcpyDeviceToDevice, stream));
        return;
    }
    CopyArgs args{int(p.shape.size()), {}, {}, {}};
    for (size_t d = 0; d < p.shape.size(); ++d) {
        args.shape[d] = p.shape[d];
        args.dst_strides[d] = p.dst_strides[d];
        args.src_strides[d] = p.src_strides[d];
    }
    switch (p.element_size) {
    case 1: return launch<uint8_t>(dst, src, args, p.numel, stream);
    case 2: return launch<uint16_t>(dst, src, args, p.numel, stream);
    case 4: return launch<uint32_t>(dst, src, args, p.numel, stream);
    default: return launch<uint64_t>(dst, src, args, p.numel, stream);
    }
}

} // namespace llaisys::runtime::cuda
