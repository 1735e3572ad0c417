// llaisys._core.Tensor and zero-copy exchange with NumPy and DLPack consumers (torch, cupy, ...).
//
// Exports hand out views of the same memory; the returned object keeps a reference to the tensor's
// storage. Imports wrap the producer's memory; the llaisys tensor keeps the producer alive.
// For CUDA, `__dlpack__(stream=s)` makes the consumer's stream s wait for llaisys' current stream, and
// from_dlpack asks the producer to order its work before llaisys' current stream.
#include "bindings/common.hpp"
#include "llaisys/stream.hpp"
#include "llaisys/ops.hpp"
#include "llaisys/tensor.hpp"

#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

using namespace llaisys;

namespace {

nb::dlpack::dtype to_dlpack(DType d) {
    using C = nb::dlpack::dtype_code;
    auto mk = [](C code, int bits) { return nb::dlpack::dtype{uint8_t(code), uint8_t(bits), 1}; };
    switch (d) {
    case DType::F32: return mk(C::Float, 32);
    case DType::F16: return mk(C::Float, 16);
    case DType::BF16: return mk(C::Bfloat, 16);
    case DType::I32: return mk(C::Int, 32);
    case DType::I64: return mk(C::Int, 64);
    case DType::U8: return mk(C::UInt, 8);
    case DType::Bool: return mk(C::Bool, 8);
    }
    throw std::invalid_argument("unknown dtype");
}

DType from_dlpack_dtype(nb::dlpack::dtype t) {
    using C = nb::dlpack::dtype_code;
    if (t.lanes == 1) {
        const auto code = C(t.code);
        if (code == C::Float && t.bits == 32) return DType::F32;
        if (code == C::Float && t.bits == 16) return DType::F16;
        if (code == C::Bfloat && t.bits == 16) return DType::BF16;
        if (code == C::Int && t.bits == 32) return DType::I32;
        if (code == C::Int && t.bits == 64) return DType::I64;
        if (code == C::UInt && t.bits == 8) return DType::U8;
        if (code == C::Bool && t.bits == 8) return DType::Bool;
    }
    throw TypeError(detail::concat("from_dlpack: unsupported dtype (DLPack code ", int(t.code), ", ", int(t.bits),
                                   " bits, ", int(t.lanes), " lanes); llaisys supports f32, f16, bf16, i32, i64, "
                                   "u8 and bool"));
}

Device from_dlpack_device(int type, int id) {
    if (type == 1 || type == 3) return Device::cpu(); // kDLCPU, kDLCUDAHost (pinned host memory)
    if (type == 2) return Device::cuda(id);            // kDLCUDA
    throw std::invalid_argument(detail::concat("from_dlpack: unsupported device type ", type,
                                               " (llaisys takes CPU and CUDA memory)"));
}

// A nanobind ndarray viewing `t`, owned by a capsule holding a copy of the tensor handle; `dtype`
// overrides how the elements are described (NumPy gets bf16 as uint16 bits).
template <typename... Extra>
nb::ndarray<Extra...> as_ndarray(const Tensor &t, nb::dlpack::dtype dtype) {
    std::vector<size_t> shape(t.shape().begin(), t.shape().end());
    nb::capsule owner(new Tensor(t), [](void *p) noexcept { delete static_cast<Tensor *>(p); });
    return nb::ndarray<Extra...>(t.data(), shape.size(), shape.data(), owner, t.strides().data(), dtype,
                                 int(t.device().type), t.device().index);
}
template <typename... Extra>
nb::ndarray<Extra...> as_ndarray(const Tensor &t) {
    return as_ndarray<Extra...>(t, to_dlpack(t.dtype()));
}

// `as_dtype` reinterprets raw bits of the same width (NumPy has no bf16: ml_dtypes arrays come as uint16).
Tensor import_ndarray(nb::ndarray<nb::ro> a, const std::string &as_dtype) {
    const bool raw16 = a.dtype() == nb::dtype<uint16_t>() && as_dtype == "bf16";
    const DType dtype = raw16 ? DType::BF16 : from_dlpack_dtype(a.dtype());
    const Device device = from_dlpack_device(a.device_type(), a.device_id());
    check_device_available(device);
    Shape shape(a.ndim());
    Strides strides(a.ndim());
    for (size_t i = 0; i < a.ndim(); ++i) {
        shape[i] = int64_t(a.shape(i));
        strides[i] = a.stride(i);
        LLAISYS_CHECK(strides[i] >= 0 || shape[i] <= 1, std::invalid_argument,
                      "from_dlpack: negative strides are not supported; pass a contiguous copy "
                      "(e.g. numpy.ascontiguousarray) instead");
        if (strides[i] < 0) strides[i] = 0;
    }
    auto *keep = new nb::ndarray<nb::ro>(a);
    return Tensor::from_blob(const_cast<void *>(a.data()), shape, strides, dtype, device, [keep] {
        nb::gil_scoped_acquire gil; // the producer's deleter may need the interpreter
        delete keep;
    });
}

nb::tuple to_tuple(const std::vector<int64_t> &v) {
    nb::list l;
    for (int64_t x : v) l.append(x);
    return nb::tuple(l);
}

Shape shape_arg(nb::args args) {
    // Accepts t.view(2, 3) and t.view((2, 3)) / t.view([2, 3]).
    if (args.size() == 1 && !nb::isinstance<nb::int_>(args[0])) return nb::cast<Shape>(args[0]);
    return nb::cast<Shape>(args);
}

nb::object dlpack_capsule(const Tensor &t, nb::kwargs kwargs) {
    nb::object stream = kwargs.contains("stream") ? nb::object(kwargs["stream"]) : nb::none();
    if (t.device().is_cuda()) {
        // DLPack: None means the legacy default stream (1); -1 asks for no synchronization.
        const intptr_t s = stream.is_none() ? 1 : nb::cast<intptr_t>(stream);
        if (s != -1) {
            Event e(t.device());
            e.record(current_stream(t.device()));
            e.wait(Stream(t.device(), reinterpret_cast<void *>(s)));
        }
    }
    nb::dict rest;
    for (auto [k, v] : kwargs)
        if (nb::cast<std::string>(k) != "stream") rest[k] = v;
    return nb::cast(as_ndarray<nb::array_api>(t)).attr("__dlpack__")(**rest);
}

nb::object to_numpy(const Tensor &t) {
    LLAISYS_CHECK(t.device().is_cpu(), std::invalid_argument, "numpy(): tensor is on ", t.device().str(),
                  "; copy it with .to('cpu') first");
    if (t.dtype() == DType::BF16) { // NumPy has no bf16: a uint16 view, reinterpreted by ml_dtypes
        const auto u16 = as_ndarray<nb::numpy>(t, nb::dtype<uint16_t>());
        return nb::cast(u16).attr("view")(nb::module_::import_("ml_dtypes").attr("bfloat16"));
    }
    return nb::cast(as_ndarray<nb::numpy>(t));
}

} // namespace

void bind_tensor(nb::module_ &m) {
    nb::class_<Tensor>(m, "Tensor")
        .def_prop_ro("shape", [](const Tensor &t) { return to_tuple(t.shape()); })
        .def_prop_ro("strides", [](const Tensor &t) { return to_tuple(t.strides()); },
                     "Strides in elements.")
        .def_prop_ro("dtype", [](const Tensor &t) { return std::string(dtype_name(t.dtype())); })
        .def_prop_ro("device", [](const Tensor &t) { return t.device().str(); })
        .def_prop_ro("ndim", &Tensor::ndim)
        .def_prop_ro("offset", &Tensor::offset_bytes, "Byte offset of the first element in the storage.")
        .def_prop_ro("element_size", &Tensor::element_size)
        .def("numel", &Tensor::numel)
        .def("data_ptr", [](const Tensor &t) { return reinterpret_cast<uintptr_t>(t.data()); })
        .def("is_contiguous", &Tensor::is_contiguous)
        .def("is_pinned", &Tensor::is_pinned)
        .def("view", [](const Tensor &t, nb::args a) { return t.view(shape_arg(a)); })
        .def("reshape", [](const Tensor &t, nb::args a) { return t.reshape(shape_arg(a)); })
        .def("permute", [](const Tensor &t, nb::args a) { return t.permute(nb::cast<std::vector<int>>(
                                                               a.size() == 1 && !nb::isinstance<nb::int_>(a[0]) ? a[0] : a)); })
        .def("transpose", &Tensor::transpose, nb::arg("dim0"), nb::arg("dim1"))
        .def("slice", &Tensor::slice, nb::arg("dim"), nb::arg("start"), nb::arg("end"))
        .def("select", &Tensor::select, nb::arg("dim"), nb::arg("index"))
        .def("contiguous", &Tensor::contiguous)
        .def("clone", &Tensor::clone)
        .def("to", [](const Tensor &t, const std::string &target) {
            // A device ("cpu", "cuda:0") or a dtype ("bf16", "float32"). The copy may wait for the device's
            // queued work (a collective waiting for another thread's rank, say): that thread needs the GIL.
            if (target == "cpu" || target.rfind("cuda", 0) == 0) {
                const Device d = Device::parse(target);
                nb::gil_scoped_release release;
                return t.to(d);
            }
            const DType d = dtype_from_name(target);
            nb::gil_scoped_release release;
            return ops::to_dtype(t, d);
        }, nb::arg("target"))
        .def("view_dtype", [](const Tensor &t, const std::string &d) { return t.view_dtype(dtype_from_name(d)); })
        .def("copy_", [](Tensor &t, const Tensor &src) -> Tensor & { return t.copy_(src); }, nb::arg("src"),
             nb::rv_policy::reference_internal)
        .def("fill_", [](Tensor &t, double v) -> Tensor & { return t.fill_(v); }, nb::arg("value"),
             nb::rv_policy::reference_internal)
        .def("numpy", &to_numpy, "A NumPy view of a CPU tensor (no copy); bf16 comes as ml_dtypes.bfloat16.")
        .def("__dlpack__", &dlpack_capsule)
        .def("__dlpack_device__", [](const Tensor &t) { return nb::make_tuple(int(t.device().type), t.device().index); })
        .def("__repr__", [](const Tensor &t) { return t.repr(); })
        .def("__len__", [](const Tensor &t) {
            LLAISYS_CHECK(t.ndim() > 0, TypeError, "len() of a 0-d tensor");
            return t.shape()[0];
        });

    m.def("empty", [](const Shape &shape, const std::string &dtype, const std::string &device, bool pin_memory) {
        return Tensor::empty(shape, dtype_from_name(dtype), Device::parse(device), pin_memory);
    }, nb::arg("shape"), nb::arg("dtype") = "f32", nb::arg("device") = "cpu", nb::arg("pin_memory") = false);
    m.def("zeros", [](const Shape &shape, const std::string &dtype, const std::string &device) {
        return Tensor::zeros(shape, dtype_from_name(dtype), Device::parse(device));
    }, nb::arg("shape"), nb::arg("dtype") = "f32", nb::arg("device") = "cpu");
    m.def("_import", &import_ndarray, nb::arg("array"), nb::arg("as_dtype") = "",
          "Wraps a DLPack capsule or an object with the buffer protocol without copying.");
}
