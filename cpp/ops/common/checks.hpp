// Argument checks and dtype dispatch shared by every op.cpp. Each check names the op, so a user sees
// e.g. "rms_norm: weight must have shape [896], got [512]".
#pragma once
#include "llaisys/common.hpp"
#include "llaisys/tensor.hpp"

#include <initializer_list>
#include <string>
#include <utility>

namespace llaisys::ops::detail {

inline void check_defined(const char *op, const char *name, const Tensor &t) {
    LLAISYS_CHECK(t.defined(), std::invalid_argument, op, ": ", name, " is an undefined tensor");
}

// t is on d, the device of the op's other tensors.
inline void check_on_device(const char *op, Device d, const Tensor &t) {
    LLAISYS_CHECK(t.device() == d, std::invalid_argument, op, ": all tensors must be on one device, got ", d.str(),
                  " and ", t.device().str());
}

inline void check_same_device(const char *op, std::initializer_list<const Tensor *> ts) {
    for (const Tensor *t : ts) check_on_device(op, (*ts.begin())->device(), *t);
}

// A named operand, for the checks that cover several at once.
struct Operand {
    const char *name;
    const Tensor &t;
};

// Every operand is defined, and all are on the first one's device: how every op's checks begin.
inline void check_operands(const char *op, std::initializer_list<Operand> operands) {
    for (const Operand &o : operands) check_defined(op, o.name, o.t);
    for (const Operand &o : operands) check_on_device(op, operands.begin()->t.device(), o.t);
}

inline void check_dtype(const char *op, const char *name, const Tensor &t, DType want) {
    LLAISYS_CHECK(t.dtype() == want, TypeError, op, ": ", name, " must be ", dtype_name(want), ", got ",
                  dtype_name(t.dtype()));
}

inline void check_same_dtype(const char *op, const char *name, const Tensor &t, const Tensor &ref) {
    LLAISYS_CHECK(t.dtype() == ref.dtype(), TypeError, op, ": ", name, " must have dtype ", dtype_name(ref.dtype()),
                  " like the other operands, got ", dtype_name(t.dtype()));
}

inline void check_float(const char *op, const char *name, const Tensor &t) {
    LLAISYS_CHECK(is_float(t.dtype()), TypeError, op, ": ", name, " must be f32, f16 or bf16, got ",
                  dtype_name(t.dtype()));
}

inline void check_index(const char *op, const char *name, const Tensor &t) {
    LLAISYS_CHECK(t.dtype() == DType::I64 || t.dtype() == DType::I32, TypeError, op, ": ", name,
                  " must be i64 or i32, got ", dtype_name(t.dtype()));
}

inline void check_shape(const char *op, const char *name, const Tensor &t, const Shape &want) {
    LLAISYS_CHECK(t.shape() == want, std::invalid_argument, op, ": ", name, " must have shape ", shape_str(want),
                  ", got ", shape_str(t.shape()));
}

// Ops whose kernels read an input while other threads write the output (GEMVs, GEMMs) give wrong
// results silently when the two share bytes; they call this to refuse such a pair. Only a contiguous
// out is written in place (with_contiguous_out gives any other a temporary), and its bytes are one
// block, so the test is whether that block meets the byte range the input can touch.
inline void check_no_overlap(const char *op, const char *out_name, const Tensor &out, const char *in_name,
                             const Tensor &in) {
    if (!out.defined() || !in.defined() || out.storage() != in.storage() || out.numel() == 0 || in.numel() == 0 ||
        !out.is_contiguous())
        return;
    auto span = [](const Tensor &t) { // [first byte, one past the last byte] the view can touch
        const char *lo = static_cast<const char *>(t.data()), *hi = lo;
        for (int d = 0; d < t.ndim(); ++d) {
            const int64_t reach = (t.size(d) - 1) * t.stride(d) * int64_t(t.element_size());
            (reach < 0 ? lo : hi) += reach;
        }
        return std::pair<const char *, const char *>(lo, hi + t.element_size());
    };
    const auto [a0, a1] = span(out);
    const auto [b0, b1] = span(in);
    LLAISYS_CHECK(a1 <= b0 || b1 <= a0, std::invalid_argument, op, ": ", out_name, " must not overlap ", in_name,
                  " (they share memory); write into a separate tensor");
}

inline void check_ndim(const char *op, const char *name, const Tensor &t, int ndim) {
    LLAISYS_CHECK(t.ndim() == ndim, std::invalid_argument, op, ": ", name, " must be ", ndim, "-D, got shape ",
                  shape_str(t.shape()));
}

// Elementwise ops out = f(a, b): a float, and b and out of a's dtype and shape.
inline void check_elementwise(const char *op, Operand out, Operand a, Operand b) {
    check_operands(op, {out, a, b});
    check_float(op, a.name, a.t);
    check_same_dtype(op, b.name, b.t, a.t);
    check_same_dtype(op, out.name, out.t, a.t);
    check_shape(op, b.name, b.t, a.t.shape());
    check_shape(op, out.name, out.t, a.t.shape());
}

// Ops that update logits [B, V] (float, any strides) at token ids [B, n] (i64), as logit_bias and
// repetition_penalty do.
inline void check_logits_ids(const char *op, const Tensor &logits, const Tensor &ids) {
    check_float(op, "logits", logits);
    check_dtype(op, "ids", ids, DType::I64);
    check_ndim(op, "logits", logits, 2);
    check_ndim(op, "ids", ids, 2);
    LLAISYS_CHECK(ids.size(0) == logits.size(0), std::invalid_argument, op, ": ids must have ", logits.size(0),
                  " rows like logits, got shape ", shape_str(ids.shape()));
}

[[noreturn]] inline void unsupported(const char *op, DType dtype, Device device) {
    throw TypeError(::llaisys::detail::concat(op, ": dtype ", dtype_name(dtype), " is not supported on ", device.str()));
}

// The no-CUDA branch of a dispatch: a CPU-only build cannot hold CUDA tensors, but keep the message clear.
[[noreturn]] inline void cuda_not_compiled(const char *op) {
    throw NotCompiledError(::llaisys::detail::concat(op, ": this build of llaisys has no CUDA backend"));
}

template <typename T>
struct type_tag {
    using type = T;
};

// Calls fn(type_tag<T>{}) with T = float, f16_t or bf16_t for the given float dtype.
template <typename Fn>
void dispatch_float(const char *op, DType dtype, Device device, Fn &&fn) {
    switch (dtype) {
    case DType::F32: return fn(type_tag<float>{});
    case DType::F16: return fn(type_tag<f16_t>{});
    case DType::BF16: return fn(type_tag<bf16_t>{});
    default: unsupported(op, dtype, device);
    }
}

// Calls fn(type_tag<T>{}) with T = int64_t or int32_t.
template <typename Fn>
void dispatch_index(const char *op, DType dtype, Device device, Fn &&fn) {
    switch (dtype) {
    case DType::I64: return fn(type_tag<int64_t>{});
    case DType::I32: return fn(type_tag<int32_t>{});
    default: unsupported(op, dtype, device);
    }
}

// t [..., cols] as a 2-D [rows, cols] tensor whose rows are dense and at least `cols` apart: a view
// when the strides allow it (e.g. a column slice of a wider matrix), else a contiguous copy.
inline Tensor dense_rows(const Tensor &t, int64_t rows, int64_t cols) {
    Tensor r = t.reshape({rows, cols});
    const bool unit_cols = cols <= 1 || r.stride(1) == 1;
    const bool rows_apart = rows <= 1 || r.stride(0) >= cols;
    return unit_cols && rows_apart ? r : r.contiguous();
}

// Runs fn(dst) where dst is `out` itself when contiguous, else a contiguous temporary that is copied
// into `out` afterwards. Kernels then only ever write dense rows.
template <typename Fn>
void with_contiguous_out(const Tensor &out, Fn &&fn) {
    if (out.is_contiguous()) return fn(out);
    Tensor tmp = Tensor::empty(out.shape(), out.dtype(), out.device());
    fn(tmp);
    Tensor(out).copy_(tmp);
}

} // namespace llaisys::ops::detail

// Runs the CPU or the CUDA implementation for `device`; a CPU-only build never references the latter.
#ifdef LLAISYS_WITH_CUDA
#define LLAISYS_DEVICE_DISPATCH(op, device, cpu_call, cuda_call)                                       \
    do {                                                                                               \
        if ((device).is_cpu()) {                                                                       \
            cpu_call;                                                                                  \
        } else {                                                                                       \
            ::llaisys::DeviceGuard device_guard_(device);                                              \
            cuda_call;                                                                                 \
        }                                                                                              \
    } while (0)
#else
#define LLAISYS_DEVICE_DISPATCH(op, device, cpu_call, cuda_call)                                       \
    do {                                                                                               \
        if ((device).is_cpu()) {                                                                       \
            cpu_call;                                                                                  \
        } else {                                                                                       \
            ::llaisys::ops::detail::cuda_not_compiled(op);                                             \
        }                                                                                              \
    } while (0)
#endif
