#include "ops/sample/sample.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"

#include <cmath>
#include <cstdint>

namespace llaisys::ops {

// Checks dtypes, shapes and devices.
static void check_sample_args(const Tensor &out_ids, const Tensor &logits, const Tensor &temperature,
                              const Tensor &top_k, const Tensor &top_p, const Tensor &min_p) {
    constexpr const char *op = "sample";
    detail::check_operands(op, {{"logits", logits}, {"out_ids", out_ids}, {"temperature", temperature},
                                {"top_k", top_k}, {"top_p", top_p}, {"min_p", min_p}});
    detail::check_float(op, "logits", logits);
    detail::check_dtype(op, "out_ids", out_ids, DType::I64);
    detail::check_dtype(op, "temperature", temperature, DType::F32);
    detail::check_dtype(op, "top_k", top_k, DType::I32);
    detail::check_dtype(op, "top_p", top_p, DType::F32);
    detail::check_dtype(op, "min_p", min_p, DType::F32);
    detail::check_ndim(op, "logits", logits, 2);
    const int64_t B = logits.size(0), V = logits.size(1);
    LLAISYS_CHECK(V >= 1, std::invalid_argument, op, ": logits must have at least one column, got shape ",
                  shape_str(logits.shape()));
    // Kernels index within a row with 32-bit ints.
    LLAISYS_CHECK(V <= INT32_MAX, std::invalid_argument, op, ": vocabulary must be < 2^31, got ", V);
    detail::check_shape(op, "out_ids", out_ids, {B});
    detail::check_shape(op, "temperature", temperature, {B});
    detail::check_shape(op, "top_k", top_k, {B});
    detail::check_shape(op, "top_p", top_p, {B});
    detail::check_shape(op, "min_p", min_p, {B});
}

// The parameter values, when they live on the host: on a device reading them would cost a host sync,
// so there the caller validates them (the Python sampling policy does) and the kernels read out-of-range
// values safely (NaN temperature = greedy, top_p >= 1 = off, ...).
static void check_sample_values(const Tensor &temperature, const Tensor &top_k, const Tensor &top_p,
                                const Tensor &min_p) {
    if (!temperature.device().is_cpu()) return;
    for (int64_t b = 0; b < temperature.size(0); ++b) {
        const float t = temperature.data_as<float>()[b], p = top_p.data_as<float>()[b], m = min_p.data_as<float>()[b];
        const int32_t k = top_k.data_as<int32_t>()[b];
        LLAISYS_CHECK(t >= 0 && std::isfinite(t), std::invalid_argument,
                      "sample: temperature must be a finite number >= 0 (0 = greedy), got ", t, " in row ", b);
        LLAISYS_CHECK(k >= 0, std::invalid_argument, "sample: top_k must be an int >= 0 (0 = off), got ", k,
                      " in row ", b);
        LLAISYS_CHECK(p > 0 && p <= 1, std::invalid_argument, "sample: top_p must be in (0, 1] (1 = off), got ", p,
                      " in row ", b);
        LLAISYS_CHECK(m >= 0 && m <= 1, std::invalid_argument, "sample: min_p must be in [0, 1] (0 = off), got ", m,
                      " in row ", b);
    }
}

static void run_sample(const Tensor &out_ids, const Tensor &logits, const Tensor &temperature, const Tensor &top_k,
                       const Tensor &top_p, const Tensor &min_p, const sampling::SeedSource &seeds) {
    const Tensor lc = logits.contiguous(), tc = temperature.contiguous(), kc = top_k.contiguous(),
                 pc = top_p.contiguous(), mc = min_p.contiguous();
    check_sample_values(tc, kc, pc, mc);
    detail::with_contiguous_out(out_ids, [&](const Tensor &dst) {
        LLAISYS_DEVICE_DISPATCH("sample", dst.device(), cpu::sample(dst, lc, tc, kc, pc, mc, seeds),
                                cuda::sample(dst, lc, tc, kc, pc, mc, seeds));
    });
}

void sample(const Tensor &out_ids, const Tensor &logits, const Tensor &temperature, const Tensor &top_k,
            const Tensor &top_p, const Tensor &min_p, uint64_t seed, uint64_t offset) {
    check_sample_args(out_ids, logits, temperature, top_k, top_p, min_p);
    if (logits.size(0) == 0) return;
    run_sample(out_ids, logits, temperature, top_k, top_p, min_p, sampling::SeedSource{seed, offset, nullptr, nullptr});
}

void sample_rows(const Tensor &out_ids, const Tensor &logits, const Tensor &temperature, const Tensor &top_k,
                 const Tensor &top_p, const Tensor &min_p, const Tensor &seeds, const Tensor &steps) {
    constexpr const char *op = "sample_rows";
    check_sample_args(out_ids, logits, temperature, top_k, top_p, min_p);
    detail::check_operands(op, {{"logits", logits}, {"seeds", seeds}, {"steps", steps}});
    detail::check_dtype(op, "seeds", seeds, DType::I64);
    detail::check_dtype(op, "steps", steps, DType::I64);
    detail::check_shape(op, "seeds", seeds, {logits.size(0)});
    detail::check_shape(op, "steps", steps, {logits.size(0)});
    if (logits.size(0) == 0) return;
    const Tensor sc = seeds.contiguous(), stc = steps.contiguous();
    run_sample(out_ids, logits, temperature, top_k, top_p, min_p,
               sampling::SeedSource{0, 0, sc.data_as<int64_t>(), stc.data_as<int64_t>()});
}

} // namespace llaisys::ops
