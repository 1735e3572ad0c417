#include "ops/embedding/embedding.hpp"

#include "ops/common/checks.hpp"
#include "ops/common/cpu.hpp"

#include <cstring>

namespace llaisys::ops::cpu {

// Every id must lie in [0, V); checked before anything is written.
template <typename Id>
static void check_ids(const Id *ids, int64_t n, int64_t V) {
    for (int64_t i = 0; i < n; ++i)
        LLAISYS_CHECK(ids[i] >= 0 && int64_t(ids[i]) < V, std::out_of_range, "embedding: id ", int64_t(ids[i]),
                      " at position ", i, " is out of range for an embedding table of ", V, " rows");
}

// out [n, D] = weight [V, D] rows ids [n]: a byte copy per row, so the output is bit-equal.
template <typename Id>
static void embedding_kernel(char *out, const Id *ids, const char *weight, int64_t n, int64_t V, size_t row_bytes) {
    check_ids(ids, n, V);
    parallel_for(n, int64_t(row_bytes), [&](int64_t i) {
        std::memcpy(out + i * row_bytes, weight + int64_t(ids[i]) * row_bytes, row_bytes);
    });
}

void embedding(const Tensor &out, const Tensor &ids, const Tensor &weight) {
    const size_t row_bytes = size_t(weight.size(1)) * weight.element_size();
    detail::dispatch_index("embedding", ids.dtype(), ids.device(), [&](auto tag) {
        using Id = typename decltype(tag)::type;
        embedding_kernel(static_cast<char *>(out.data()), ids.data_as<Id>(), static_cast<const char *>(weight.data()),
                         ids.numel(), weight.size(0), row_bytes);
    });
}

} // namespace llaisys::ops::cpu
