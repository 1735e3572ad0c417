// llaisys._core.Model (weights and layer math, which a Runner in serving.cpp drives), create_model, and the
// architecture tables the Python loader reads (config keys, traits, weight tables): one copy, in C++.
#include "bindings/common.hpp"
#include "llaisys/model.hpp"
#include "llaisys/quant.hpp"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

using namespace llaisys;
using namespace llaisys::models;

namespace {

nb::object to_py(const ConfigValue &v) {
    return std::visit([](const auto &x) -> nb::object { return nb::cast(x); }, v);
}

ConfigValue from_py(const std::string &name, nb::handle h) {
    if (nb::isinstance<nb::bool_>(h)) return nb::cast<bool>(h);
    if (nb::isinstance<nb::int_>(h)) return nb::cast<int64_t>(h);
    if (nb::isinstance<nb::float_>(h)) return nb::cast<double>(h);
    if (nb::isinstance<nb::str>(h)) return nb::cast<std::string>(h);
    throw TypeError("ModelConfig: " + name + " must be an int, float, bool or str, got " +
                    nb::cast<std::string>(nb::str(h.type())));
}

nb::dict to_dict(const ModelConfig &c) {
    nb::dict d;
    for (const std::string &name : config_field_names()) d[name.c_str()] = to_py(get_config_field(c, name));
    return d;
}

// Every key of d must be a field; fields d lacks keep the architecture's defaults.
ModelConfig from_dict(const nb::dict &d) {
    LLAISYS_CHECK(d.contains("arch"), std::invalid_argument, "ModelConfig: 'arch' is missing");
    ModelConfig c = architecture(nb::cast<std::string>(d["arch"])).defaults;
    for (auto [key, value] : d) {
        const std::string name = nb::cast<std::string>(key);
        set_config_field(c, name, from_py(name, value));
    }
    return c;
}

nb::dict architecture_dict(const Architecture &a) {
    nb::dict d;
    d["name"] = a.name;
    d["hf_architectures"] = a.hf_architectures;
    d["gguf_arch"] = a.gguf_arch;
    d["defaults"] = to_dict(a.defaults);
    nb::list keys;
    for (const ConfigKey &k : a.keys) keys.append(nb::make_tuple(k.field, k.hf_key, k.gguf_key));
    d["keys"] = keys;
    d["gguf_permuted_qk"] = a.gguf_permuted_qk;
    return d;
}

} // namespace

void bind_model(nb::module_ &m) {
    using G = nb::call_guard<nb::gil_scoped_release>;
    m.def("architectures", [] {
        nb::list out;
        for (const Architecture &a : architectures()) out.append(architecture_dict(a));
        return out;
    }, "Every architecture llaisys runs: name, hf_architectures, gguf_arch, defaults (traits), keys "
       "[(field, HF config.json key, GGUF metadata key)], gguf_permuted_qk.");
    m.def("config_fields", [] { return config_field_names(); }, "The fields of a model config, by name.");
    m.def("check_config", [](const nb::dict &d) { from_dict(d).validate(); }, nb::arg("config"),
          "Raises ValueError naming the field when the config cannot run (before any weight is read).");
    m.def("weight_table", [](const nb::dict &d) {
        const ModelConfig c = from_dict(d);
        c.validate();
        nb::list out;
        for (const WeightSpec &w : architecture(c.arch).weights(c)) {
            nb::tuple shape = nb::steal<nb::tuple>(PyTuple_New(Py_ssize_t(w.shape.size())));
            for (size_t i = 0; i < w.shape.size(); ++i) PyTuple_SET_ITEM(shape.ptr(), i, PyLong_FromLongLong(w.shape[i]));
            out.append(nb::make_tuple(w.hf_name, w.gguf_name, shape, w.group, w.split_dim, w.role, w.layer));
        }
        return out;
    }, nb::arg("config"), "[(HF name, GGUF name, shape, fusion group, tensor-parallel split dim, decoder role, "
                          "layer or -1)] of a config.");

    nb::class_<Model>(m, "Model")
        .def("load_weight", &Model::load_weight, nb::arg("name"), nb::arg("value"), G())
        .def("load_quant_weight", &Model::load_quant_weight, nb::arg("name"), nb::arg("value"), G(),
             "Takes a projection or embedding weight as a QuantMatrix (GGUF blocks), kept quantized.")
        .def("missing_weights", &Model::missing_weights)
        .def("prepare", &Model::prepare, G(), "Finish loading: checks, fusion, decode scratch (see model.hpp).")
        .def("weight_formats", &Model::weight_formats, "[(HF name, stored format 'bf16' / 'q4_k' / ..., bytes)]")
        .def_prop_ro("weight_bytes", &Model::weight_bytes, "Bytes the weights take on the model's device.")
        .def_prop_ro("decode_scratch_bytes", &Model::decode_scratch_bytes,
                     "CUDA, quantized weights: bytes of the buffer multi-row steps decode each weight into (0 "
                     "otherwise; set by prepare()).")
        .def_prop_ro("fused_projections", &Model::fused_projections,
                     "One GEMV for q/k/v and for gate/up, RoPE + cache write in one kernel (set at construction).")
        .def_prop_ro("config", [](const Model &model) { return to_dict(model.config()); })
        .def_prop_ro("dtype", [](const Model &model) { return std::string(dtype_name(model.dtype())); })
        .def_prop_ro("device", [](const Model &model) { return model.device().str(); })
        .def_prop_ro("tensor_parallel", [](const Model &model) {
            const auto &c = model.communicator();
            return c ? std::make_pair(c->rank(), c->world()) : std::make_pair(0, 1);
        }, "(rank, world) of the tensor-parallel group this model is a share of; (0, 1) when whole.");

    m.def("create_model", [](const nb::dict &config, const std::string &dtype, const std::string &device,
                             std::optional<bool> fused, std::shared_ptr<Communicator> comm) {
        return create_model(from_dict(config), dtype_from_name(dtype), Device::parse(device), fused, std::move(comm));
    }, nb::arg("config"), nb::arg("dtype"), nb::arg("device"), nb::arg("fused").none() = nb::none(),
       nb::arg("comm").none() = nb::none(),
       "The model of config['arch'] (weights and layer math of one step; a Runner with a KVPool runs it). fused: "
       "fused projections on or off, None: on for CUDA only. comm: a rank of a tensor-parallel group "
       "(local_group), which makes the model that rank's share (tensor_parallel_config).");
    m.def("tensor_parallel_config", [](const nb::dict &config, int world) {
        return to_dict(tensor_parallel_config(from_dict(config), world));
    }, nb::arg("config"), nb::arg("world"),
       "One rank's share of a model split over `world` ranks (its heads, KV heads, MLP width; the vocabulary "
       "whole); ValueError naming what does not divide.");
}
