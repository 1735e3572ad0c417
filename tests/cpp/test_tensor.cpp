// Unit tests of the C++ core: dtype conversion, tensor views and copies, memory statistics, add.
#include "llaisys/ops.hpp"
#include "llaisys/tensor.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

using namespace llaisys;

static Tensor arange_f32(const Shape &shape) {
    Tensor t = Tensor::empty(shape, DType::F32);
    for (int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = float(i);
    return t;
}

TEST(DType, Bf16RoundsToNearestEven) {
    EXPECT_EQ(from_float<bf16_t>(1.0f).bits, 0x3f80);
    // 1 + 2^-8 is halfway between two bf16 values: ties go to the even mantissa (1.0).
    EXPECT_EQ(from_float<bf16_t>(1.00390625f).bits, 0x3f80);
    EXPECT_EQ(to_float(from_float<bf16_t>(3.140625f)), 3.140625f);
    EXPECT_TRUE(std::isnan(to_float(from_float<bf16_t>(NAN))));
}

TEST(DType, F16RoundTripsEveryHalf) {
    for (uint32_t bits = 0; bits < 0x10000; ++bits) {
        const f16_t h{uint16_t(bits)};
        const float f = to_float(h);
        if (std::isnan(f)) continue;
        EXPECT_EQ(from_float<f16_t>(f).bits, h.bits) << "bits " << bits;
    }
    EXPECT_EQ(from_float<f16_t>(65520.f).bits, 0x7c00); // rounds to inf
    EXPECT_EQ(to_float(from_float<f16_t>(5.9604645e-08f)), 5.9604645e-08f); // smallest subnormal
}

TEST(Tensor, ContiguousStridesAndNumel) {
    Tensor t = Tensor::empty({2, 3, 4}, DType::F32);
    EXPECT_EQ(t.strides(), (Strides{12, 4, 1}));
    EXPECT_EQ(t.numel(), 24);
    EXPECT_TRUE(t.is_contiguous());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data()) % 64, 0u);
}

TEST(Tensor, SliceOffsetsSurviveViews) {
    Tensor t = arange_f32({4, 6});
    Tensor s = t.slice(0, 1, 3).slice(1, 2, 5); // rows 1..2, cols 2..4
    EXPECT_EQ(s.offset_bytes(), (1 * 6 + 2) * sizeof(float));
    EXPECT_FALSE(s.is_contiguous());
    Tensor row = t.slice(0, 2, 3).view({6}); // a contiguous slice can be viewed
    EXPECT_EQ(row.data_as<float>()[0], 12.f);
    Tensor c = s.contiguous();
    const std::vector<float> want{8, 9, 10, 14, 15, 16};
    for (int i = 0; i < 6; ++i) EXPECT_EQ(c.data_as<float>()[i], want[i]);
}

TEST(Tensor, ViewRejectsIncompatibleStrides) {
    Tensor t = arange_f32({4, 6}).transpose(0, 1);
    EXPECT_THROW(t.view({24}), std::invalid_argument);
    Tensor r = t.reshape({24}); // copies instead
    EXPECT_EQ(r.data_as<float>()[1], 6.f);
    EXPECT_THROW(t.view({5, 5}), std::invalid_argument);
    EXPECT_EQ(arange_f32({4, 6}).view({-1, 3}).shape(), (Shape{8, 3}));
}

TEST(Tensor, PermuteAndCopyBetweenStrides) {
    Tensor t = arange_f32({2, 3, 4});
    Tensor p = t.permute({2, 0, 1}).contiguous(); // p[k][i][j] = t[i][j][k]
    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 3; ++j)
            for (int k = 0; k < 4; ++k)
                EXPECT_EQ(p.data_as<float>()[k * 6 + i * 3 + j], float(i * 12 + j * 4 + k));
    EXPECT_THROW(t.permute({0, 0, 1}), std::invalid_argument);
}

TEST(Tensor, SliceOutOfRangeThrows) {
    Tensor t = arange_f32({4, 6});
    EXPECT_THROW(t.slice(0, 2, 5), std::out_of_range);
    EXPECT_THROW(t.slice(3, 0, 1), std::out_of_range);
    EXPECT_THROW(t.select(1, 6), std::out_of_range);
}

TEST(Tensor, FillAndCopyDtypeMismatch) {
    Tensor t = Tensor::empty({3, 5}, DType::BF16);
    t.slice(1, 1, 4).fill_(2.5);
    EXPECT_EQ(to_float(t.data_as<bf16_t>()[1]), 2.5f);
    Tensor f = Tensor::empty({3, 5}, DType::F32);
    EXPECT_THROW(f.copy_(t), TypeError);
    Tensor g = ops::to_dtype(t, DType::F32);
    EXPECT_EQ(g.data_as<float>()[2], 2.5f);
}

// copy_ runs core's own strided copy (core/copy.hpp), which merges dims both sides step over as one run
// and refuses more than 8 dims it cannot merge (the CUDA kernel's limit), on every device alike.
TEST(Tensor, CopyMergesDimsAndLimitsTheRest) {
    Tensor src = arange_f32({2, 3, 4}).permute({2, 0, 1}); // [4, 2, 3]: no dim merges
    Tensor dst = Tensor::empty({4, 2, 3}, DType::F32);
    dst.copy_(src);
    for (int64_t i = 0; i < 24; ++i) EXPECT_EQ(dst.data_as<float>()[i], float((i % 6) * 4 + i / 6));
    const Shape nine(9, 2);
    Tensor reversed = arange_f32(nine).permute({8, 7, 6, 5, 4, 3, 2, 1, 0});
    EXPECT_THROW(Tensor::empty(nine, DType::F32).copy_(reversed), std::invalid_argument);
    EXPECT_NO_THROW(Tensor::empty(nine, DType::F32).copy_(arange_f32(nine))); // all dims merge into one
}

TEST(Memory, CpuStatsTrackAllocations) {
    const int64_t before = memory_stats(Device::cpu()).allocated;
    {
        Tensor t = Tensor::empty({1024}, DType::F32);
        EXPECT_GE(memory_stats(Device::cpu()).allocated, before + 4096);
    }
    EXPECT_EQ(memory_stats(Device::cpu()).allocated, before);
}

TEST(Ops, AddMatchesFormulaAndChecksArguments) {
    Tensor a = arange_f32({3, 7}), b = arange_f32({3, 7}), out = Tensor::empty({3, 7}, DType::F32);
    ops::add(out, a, b);
    for (int i = 0; i < 21; ++i) EXPECT_EQ(out.data_as<float>()[i], 2.f * i);
    EXPECT_THROW(ops::add(out, a, Tensor::empty({3, 6}, DType::F32)), std::invalid_argument);
    EXPECT_THROW(ops::add(out, a, Tensor::empty({3, 7}, DType::BF16)), TypeError);
}

TEST(Device, ParseAndAvailability) {
    EXPECT_EQ(Device::parse("cuda:3").index, 3);
    EXPECT_THROW(Device::parse("gpu"), std::invalid_argument);
    if (!cuda_compiled()) EXPECT_THROW(Tensor::empty({1}, DType::F32, Device::cuda()), NotCompiledError);
}
