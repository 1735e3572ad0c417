#include "ops/rope/rope.hpp"

#include "llaisys/ops.hpp"
#include "ops/common/checks.hpp"
#include "ops/common/rope_table.hpp"

#include <cmath>

namespace llaisys::ops {

namespace {

// One f32 operation, rounded and stored: nothing around it can be fused into an FMA (this file is built
// with -march=native), so each step rounds where torch's separate tensor ops round.
float rounded(float v) {
    volatile float r = v;
    return r;
}

} // namespace

std::vector<float> rope_inv_freq(float theta, int64_t rotary_dim, const RopeScaling &scaling) {
    constexpr const char *op = "rope_inv_freq";
    using Type = RopeScaling::Type;
    LLAISYS_CHECK(theta > 0.f && std::isfinite(theta), std::invalid_argument, op,
                  ": theta must be finite and > 0, got ", theta);
    LLAISYS_CHECK(rotary_dim >= 2 && rotary_dim % 2 == 0, std::invalid_argument, op,
                  ": rotary_dim must be even and >= 2, got ", rotary_dim);
    const float factor = scaling.factor;
    if (scaling.type != Type::none)
        LLAISYS_CHECK(factor > 0.f && std::isfinite(factor), std::invalid_argument, op,
                      ": the scaling factor must be finite and > 0, got ", factor);
    // HF: inv_freq = 1.0 / (base ** (arange(0, dim, 2).float() / dim)): an f32 quotient for the exponent,
    // base^e in f32 (here rounded correctly, through double), an f32 reciprocal.
    std::vector<float> inv_freq(size_t(rotary_dim / 2));
    for (int64_t i = 0; i < rotary_dim / 2; ++i) {
        const float e = rounded(float(2 * i) / float(rotary_dim));
        inv_freq[size_t(i)] = rounded(1.f / float(std::pow(double(theta), double(e))));
    }
    if (scaling.type == Type::linear) { // inv_freq /= factor
        for (float &f : inv_freq) f = rounded(f / factor);
    } else if (scaling.type == Type::llama3) {
        const float low = scaling.low_freq_factor, high = scaling.high_freq_factor;
        const int64_t orig = scaling.original_max_position_embeddings;
        LLAISYS_CHECK(std::isfinite(low) && std::isfinite(high) && low > 0.f && high > low, std::invalid_argument,
                      op, ": llama3 needs 0 < low_freq_factor < high_freq_factor, got ", low, " and ", high);
        LLAISYS_CHECK(orig > 0, std::invalid_argument, op, ": original_max_position_embeddings must be > 0, got ",
                      orig);
        // Python floats (double) compared with or applied to f32 tensors: torch converts them to f32 first.
        const float low_wavelen = float(double(orig) / double(low)), high_wavelen = float(double(orig) / double(high));
        const float two_pi = float(2.0 * 3.14159265358979323846), orig_f = float(orig);
        const float denom = float(double(high) - double(low));
        for (float &f : inv_freq) {
            // `scalar / tensor` is torch's tensor.reciprocal() * scalar: two roundings.
            const float wavelen = rounded(rounded(1.f / f) * two_pi);
            const float kept = wavelen > low_wavelen ? rounded(f / factor) : f; // inv_freq_llama
            if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) { // medium: smoothed
                const float smooth = rounded(rounded(rounded(rounded(1.f / wavelen) * orig_f) - low) / denom);
                const float a = rounded(rounded(rounded(1.f - smooth) * kept) / factor);
                f = rounded(a + rounded(smooth * kept));
            } else {
                f = kept;
            }
        }
    }
    return inv_freq;
}

static void check_rope_tensors(const char *op, const Tensor &out, const Tensor &x, const Tensor &pos_ids) {
    detail::check_operands(op, {{"out", out}, {"x", x}, {"pos_ids", pos_ids}});
    detail::check_float(op, "x", x);
    detail::check_same_dtype(op, "out", out, x);
    detail::check_index(op, "pos_ids", pos_ids);
    detail::check_ndim(op, "x", x, 3);
    detail::check_shape(op, "out", out, x.shape());
    detail::check_shape(op, "pos_ids", pos_ids, {x.size(0)});
}

// rope with a checked table: inv_freq [r], 1 <= r <= head_dim / 2.
static void rope_table(const char *op, const Tensor &out, const Tensor &x, const Tensor &pos_ids,
                       const std::vector<float> &inv_freq) {
    if (x.numel() == 0) return;
    // The kernels take any seq/head strides but need each head's row dense.
    const Tensor xs = x.stride(2) == 1 ? x : x.contiguous();
    const Tensor pc = pos_ids.contiguous();
    auto run = [&](const Tensor &dst) {
        LLAISYS_DEVICE_DISPATCH(op, dst.device(), cpu::rope(dst, xs, pc, inv_freq), cuda::rope(dst, xs, pc, inv_freq));
    };
    if (out.stride(2) == 1) return run(out);
    Tensor tmp = Tensor::empty(out.shape(), out.dtype(), out.device());
    run(tmp);
    Tensor(out).copy_(tmp);
}

void rope(const Tensor &out, const Tensor &x, const Tensor &pos_ids, float theta) {
    constexpr const char *op = "rope";
    check_rope_tensors(op, out, x, pos_ids);
    LLAISYS_CHECK(x.size(2) % 2 == 0, std::invalid_argument, op, ": head_dim must be even, got ", x.size(2));
    LLAISYS_CHECK(theta > 0.f && std::isfinite(theta), std::invalid_argument, op,
                  ": theta must be finite and > 0, got ", theta);
    LLAISYS_CHECK(x.device().is_cpu() || x.size(2) <= kRopeMaxCudaHeadDim, std::invalid_argument, op, ": head_dim ",
                  x.size(2), " is not supported on CUDA (at most ", kRopeMaxCudaHeadDim, ")");
    if (x.numel() == 0) return;
    rope_table(op, out, x, pos_ids, detail::rope_inv_freq(theta, x.size(2)));
}

void rope(const Tensor &out, const Tensor &x, const Tensor &pos_ids, const std::vector<float> &inv_freq) {
    constexpr const char *op = "rope";
    check_rope_tensors(op, out, x, pos_ids);
    detail::check_inv_freq(op, inv_freq, x.size(2), x.device());
    rope_table(op, out, x, pos_ids, inv_freq);
}

} // namespace llaisys::ops
