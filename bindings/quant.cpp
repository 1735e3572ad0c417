// llaisys._core.quant: quantized weight matrices (GGUF block formats) and the ops that read them.
// A QuantMatrix wraps a u8 Tensor of its blocks without copying (build it from a NumPy array with
// llaisys.quant.QuantMatrix.from_numpy); dequantize() returns a new f32 NumPy array.
#include "bindings/common.hpp"
#include "llaisys/quant.hpp"

#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <optional>

using namespace llaisys;

namespace {

// rows [row0, row0 + n) decoded to a new f32 array [n, cols] that owns its buffer.
nb::ndarray<nb::numpy, float, nb::ndim<2>> dequantize(const QuantMatrix &m, int64_t row0, std::optional<int64_t> n) {
    const int64_t count = n ? *n : m.rows() - row0;
    LLAISYS_CHECK(count >= 0, std::out_of_range, "dequantize: row0 ", row0, " is past the ", m.rows(), " rows");
    float *buf = new float[size_t(std::max<int64_t>(count * m.cols(), 1))];
    nb::capsule owner(buf, [](void *p) noexcept { delete[] static_cast<float *>(p); });
    {
        nb::gil_scoped_release release;
        dequantize_rows(m, row0, count, buf);
    }
    const size_t shape[2] = {size_t(count), size_t(m.cols())};
    return nb::ndarray<nb::numpy, float, nb::ndim<2>>(buf, 2, shape, owner);
}

const char *layout_name(QuantLayout l) { return l == QuantLayout::Q5Split ? "q5_split" : "file"; }
QuantLayout layout_from_name(const std::string &name) {
    if (name == "file") return QuantLayout::File;
    if (name == "q5_split") return QuantLayout::Q5Split;
    throw std::invalid_argument("QuantMatrix: layout must be 'file' or 'q5_split', got '" + name + "'");
}

nb::dict format_info(const std::string &name) {
    const QuantFormatInfo &f = quant_format_info(quant_format_from_name(name));
    nb::dict d;
    d["name"] = f.name;
    d["block_elems"] = f.block_elems;
    d["block_bytes"] = f.block_bytes;
    d["gguf_type"] = f.gguf_type;
    return d;
}

} // namespace

void bind_quant(nb::module_ &m) {
    nb::module_ q = m.def_submodule("quant", "Quantized weights (GGUF block formats) and their ops.");
    using G = nb::call_guard<nb::gil_scoped_release>;

    nb::class_<QuantMatrix>(q, "QuantMatrix")
        .def("__init__", [](QuantMatrix *self, const std::string &format, int64_t rows, int64_t cols, const Tensor &bytes,
                            const std::string &layout) {
            new (self) QuantMatrix(quant_format_from_name(format), rows, cols, bytes, layout_from_name(layout));
        }, nb::arg("format"), nb::arg("rows"), nb::arg("cols"), nb::arg("bytes"), nb::arg("layout") = "file",
             "Wraps bytes (u8 tensor [rows, row_bytes], contiguous, in `layout`) without copying.")
        .def_prop_ro("format", [](const QuantMatrix &w) { return std::string(quant_format_info(w.format()).name); })
        .def_prop_ro("rows", &QuantMatrix::rows)
        .def_prop_ro("cols", &QuantMatrix::cols)
        .def_prop_ro("shape", [](const QuantMatrix &w) { return nb::make_tuple(w.rows(), w.cols()); })
        .def_prop_ro("row_bytes", &QuantMatrix::row_bytes)
        .def_prop_ro("nbytes", &QuantMatrix::nbytes)
        .def_prop_ro("device", [](const QuantMatrix &w) { return w.device().str(); })
        .def_prop_ro("bytes", &QuantMatrix::bytes, "The blocks as a u8 tensor [rows, row_bytes] (shared).")
        .def("slice_rows", &QuantMatrix::slice_rows, nb::arg("start"), nb::arg("end"))
        .def("to", [](const QuantMatrix &w, const std::string &d) { return w.to(Device::parse(d)); }, nb::arg("device"))
        .def_static("concat_rows", &QuantMatrix::concat_rows, nb::arg("parts"))
        .def_prop_ro("layout", [](const QuantMatrix &w) { return std::string(layout_name(w.layout())); },
                     "'file' (GGUF's blocks) or 'q5_split' (Q5_0's scales, fifth bits and nibbles apart: quant.hpp).")
        .def("with_layout", [](const QuantMatrix &w, const std::string &l) { return w.with_layout(layout_from_name(l)); },
             nb::arg("layout"), "The same weights in layout 'file' or 'q5_split' (self if already; else a host copy).")
        .def("dequantize", &dequantize, nb::arg("row0") = 0, nb::arg("n") = nb::none(),
             "Rows [row0, row0 + n) as a new f32 NumPy array [n, cols] (host matrices only).")
        .def("__repr__", [](const QuantMatrix &w) {
            return std::string("QuantMatrix(") + quant_format_info(w.format()).name + ", [" + std::to_string(w.rows()) +
                   ", " + std::to_string(w.cols()) + "], " + w.device().str() + ")";
        });

    q.def("row_bytes", [](const std::string &f, int64_t cols) { return quant_row_bytes(quant_format_from_name(f), cols); },
          nb::arg("format"), nb::arg("cols"));
    q.def("format_info", &format_info, nb::arg("format"));
    q.def("format_from_gguf", [](int t) { return std::string(quant_format_info(quant_format_from_gguf(t)).name); },
          nb::arg("gguf_type"));
    q.def("set_cpu_path", [](const std::string &p) { set_quant_cpu_path(quant_cpu_path_from_name(p)); },
          nb::arg("path"), "Force the CPU kernels: 'auto', 'portable', 'avx2' or 'avx512vnni' (for A/B tests).");
    q.def("cpu_path", [] { return std::string(quant_cpu_path_name(quant_cpu_path())); });
    q.def("cpu_layout", [](const std::string &f, int64_t cols) {
        return std::string(layout_name(quant_cpu_layout(quant_format_from_name(f), cols)));
    }, nb::arg("format"), nb::arg("cols"), "The layout a CPU model keeps a weight of this format and width in "
                                           "('file' or 'q5_split').");
    q.def("set_cpu_split", &set_quant_cpu_split, nb::arg("on"),
          "A/B switch, not a user setting: False makes models loaded afterwards keep Q5_0 in the file layout.");
    q.def("cpu_path_supported", [](const std::string &p) { return quant_cpu_path_supported(quant_cpu_path_from_name(p)); },
          nb::arg("path"));

    q.def("linear", [](const Tensor &out, const Tensor &x, const QuantMatrix &w, const Tensor *bias) {
        ops::quant_linear(out, x, w, bias ? *bias : Tensor());
    }, nb::arg("out"), nb::arg("x"), nb::arg("weight"), nb::arg("bias") = nb::none(), G());
    q.def("linear_swiglu", &ops::quant_linear_swiglu, nb::arg("out"), nb::arg("x"), nb::arg("w_gate_up"), G());
    q.def("add_rms_norm_linear", [](const Tensor &out, const Tensor &residual_out, const Tensor &residual,
                                    const Tensor &delta, const Tensor &norm_weight, float eps, const QuantMatrix &w,
                                    const Tensor *bias, bool swiglu) {
        ops::add_rms_norm_quant_linear(out, residual_out, residual, delta, norm_weight, eps, w,
                                       bias ? *bias : Tensor(), swiglu);
    }, nb::arg("out"), nb::arg("residual_out"), nb::arg("residual"), nb::arg("delta"), nb::arg("norm_weight"),
          nb::arg("eps"), nb::arg("weight"), nb::arg("bias") = nb::none(), nb::arg("swiglu") = false, G());
    q.def("add_rms_norm_linear_fused", [](const std::string &dtype, const std::string &device, int64_t rows, int64_t cols) {
        return ops::add_rms_norm_quant_linear_fused(dtype_from_name(dtype), Device::parse(device), rows, cols);
    }, nb::arg("dtype"), nb::arg("device"), nb::arg("rows"), nb::arg("cols"));
    q.def("embedding", &ops::quant_embedding, nb::arg("out"), nb::arg("ids"), nb::arg("weight"), G());
    q.def("dequantize", &ops::quant_dequantize, nb::arg("out"), nb::arg("weight"), G());
}
