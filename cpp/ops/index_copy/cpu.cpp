#include "ops/index_copy/index_copy.hpp"

#include "ops/common/checks.hpp"

#include <cstring>

namespace llaisys::ops::cpu {

// out [R, row_bytes] row index[i] = src [n, row_bytes] row i
void index_copy(const Tensor &out, const Tensor &index, const Tensor &src, int64_t row_bytes) {
    const int64_t n = index.size(0), rows = out.size(0);
    detail::dispatch_index("index_copy", index.dtype(), index.device(), [&](auto tag) {
        using I = typename decltype(tag)::type;
        const I *idx = index.data_as<I>();
        for (int64_t i = 0; i < n; ++i)
            LLAISYS_CHECK(idx[i] >= 0 && idx[i] < rows, std::out_of_range, "index_copy: index ", int64_t(idx[i]),
                          " at position ", i, " is out of range [0, ", rows, ")");
        for (int64_t i = 0; i < n; ++i)
            std::memcpy(static_cast<char *>(out.data()) + int64_t(idx[i]) * row_bytes,
                        static_cast<const char *>(src.data()) + i * row_bytes, size_t(row_bytes));
    });
}

} // namespace llaisys::ops::cpu
