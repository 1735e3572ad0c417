#include "core/copy.hpp"

#include "llaisys/thread_pool.hpp"

#include <cstring>

namespace llaisys::runtime {

CopyPlan make_copy_plan(const Tensor &dst, const Tensor &src) {
    CopyPlan p{{}, {}, {}, dst.element_size(), dst.numel()};
    for (int d = 0; d < dst.ndim(); ++d) {
        if (dst.shape()[d] == 1) continue; // size-1 dims move nothing
        const int64_t n = dst.shape()[d], ds = dst.strides()[d], ss = src.strides()[d];
        // Merge with the previous (outer) dim when both tensors step over it as one run.
        if (!p.shape.empty() && p.dst_strides.back() == ds * n && p.src_strides.back() == ss * n) {
            p.shape.back() *= n;
            p.dst_strides.back() = ds;
            p.src_strides.back() = ss;
        } else {
            p.shape.push_back(n);
            p.dst_strides.push_back(ds);
            p.src_strides.push_back(ss);
        }
    }
    if (p.shape.empty()) { // a single element
        p.shape = {1};
        p.dst_strides = p.src_strides = {1};
    }
    return p;
}

namespace {
// Walks every index of plan.shape except the innermost with an odometer, then copies the innermost
// run (memcpy when both sides are dense there).
template <size_t ES>
void copy_rows(char *dst, const char *src, const CopyPlan &p) {
    const int nd = int(p.shape.size());
    const int64_t inner = p.shape[nd - 1], ds = p.dst_strides[nd - 1], ss = p.src_strides[nd - 1];
    const int64_t rows = p.numel / inner;
    parallel_for(rows, inner, [&](int64_t row) {
        int64_t doff = 0, soff = 0, r = row;
        for (int d = nd - 2; d >= 0; --d) {
            const int64_t i = r % p.shape[d];
            r /= p.shape[d];
            doff += i * p.dst_strides[d];
            soff += i * p.src_strides[d];
        }
        char *drow = dst + doff * int64_t(ES);
        const char *srow = src + soff * int64_t(ES);
        if (ds == 1 && ss == 1) {
            std::memcpy(drow, srow, size_t(inner) * ES);
            return;
        }
        for (int64_t i = 0; i < inner; ++i) std::memcpy(drow + i * ds * int64_t(ES), srow + i * ss * int64_t(ES), ES);
    });
}

void copy_strided_cpu(char *dst, const char *src, const CopyPlan &plan) {
    switch (plan.element_size) {
    case 1: return copy_rows<1>(dst, src, plan);
    case 2: return copy_rows<2>(dst, src, plan);
    case 4: return copy_rows<4>(dst, src, plan);
    default: return copy_rows<8>(dst, src, plan);
    }
}
} // namespace

void copy_strided(const Tensor &dst, const Tensor &src) {
    if (dst.numel() == 0) return;
    const CopyPlan plan = make_copy_plan(dst, src);
    LLAISYS_CHECK(plan.shape.size() <= kCopyMaxDims, std::invalid_argument,
                  "rearrange: more than 8 non-mergeable dims");
    if (dst.device().is_cpu())
        return copy_strided_cpu(static_cast<char *>(dst.data()), static_cast<const char *>(src.data()), plan);
#ifdef LLAISYS_WITH_CUDA
    cuda::copy_strided(dst.data(), src.data(), plan, dst.device());
#else
    throw NotCompiledError("rearrange: this build of llaisys has no CUDA backend");
#endif
}

} // namespace llaisys::runtime
