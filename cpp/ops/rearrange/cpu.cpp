#include "ops/rearrange/rearrange.hpp"

#include "ops/common/cpu.hpp"

#include <cstring>

namespace llaisys::ops::cpu {

// Walks every index of plan.shape except the innermost with an odometer, then copies the innermost
// run (memcpy when both sides are dense there).
template <size_t ES>
static void copy_rows(char *dst, const char *src, const CopyPlan &p) {
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

void rearrange(const Tensor &out, const Tensor &x, const CopyPlan &plan) {
    auto *dst = static_cast<char *>(out.data());
    const auto *src = static_cast<const char *>(x.data());
    switch (plan.element_size) {
    case 1: return copy_rows<1>(dst, src, plan);
    case 2: return copy_rows<2>(dst, src, plan);
    case 4: return copy_rows<4>(dst, src, plan);
    default: return copy_rows<8>(dst, src, plan);
    }
}

} // namespace llaisys::ops::cpu
