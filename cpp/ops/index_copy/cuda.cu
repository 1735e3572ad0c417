#include "ops/index_copy/index_copy.hpp"

#include "core/runtime.hpp"
#include "ops/common/checks.hpp"
#include "ops/common/cuda.cuh"

namespace llaisys::ops::cuda {

// One block per source row; threads copy the row in 16-byte words when the row size allows, else in
// bytes. A bad index sets the device error flag (code 2) instead of writing.
template <typename I, typename W>
__global__ void index_copy_kernel(char *out, const I *index, const char *src, int64_t rows, int64_t row_words,
                                  int *error) {
    const int64_t i = blockIdx.x, dst_row = int64_t(index[i]);
    if (dst_row < 0 || dst_row >= rows) {
        if (threadIdx.x == 0) *error = 2;
        return;
    }
    W *dst = reinterpret_cast<W *>(out) + dst_row * row_words;
    const W *from = reinterpret_cast<const W *>(src) + i * row_words;
    for (int64_t w = threadIdx.x; w < row_words; w += blockDim.x) dst[w] = from[w];
}

void index_copy(const Tensor &out, const Tensor &index, const Tensor &src, int64_t row_bytes) {
    int *error = runtime::cuda::error_flag(out.device());
    const bool wide = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(out.data()) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(src.data()) % 16 == 0;
    detail::dispatch_index("index_copy", index.dtype(), index.device(), [&](auto tag) {
        using I = typename decltype(tag)::type;
        auto *o = static_cast<char *>(out.data());
        const auto *s = static_cast<const char *>(src.data());
        const unsigned blocks = unsigned(index.size(0));
        if (wide)
            index_copy_kernel<I, int4><<<blocks, 128, 0, stream_of(out)>>>(o, index.data_as<I>(), s, out.size(0),
                                                                          row_bytes / 16, error);
        else
            index_copy_kernel<I, char><<<blocks, 128, 0, stream_of(out)>>>(o, index.data_as<I>(), s, out.size(0),
                                                                          row_bytes, error);
        CUDA_CHECK_LAUNCH();
    });
}

} // namespace llaisys::ops::cuda
