// llaisys._core.Qwen2: the model (weights and layer math) the Runner (serving.cpp) drives.
#include "bindings/common.hpp"
#include "llaisys/qwen2.hpp"
#include "llaisys/quant.hpp"

#include <nanobind/stl/optional.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

using namespace llaisys;
using namespace llaisys::models;

namespace {
Qwen2Config config_from_dict(const nb::dict &d) {
    auto get = [&](const char *key) -> nb::handle {
        if (!d.contains(key)) throw std::invalid_argument(std::string("Qwen2 config is missing '") + key + "'");
        return d[key];
    };
    Qwen2Config c;
    c.vocab_size = nb::cast<int64_t>(get("vocab_size"));
    c.hidden_size = nb::cast<int64_t>(get("hidden_size"));
    c.intermediate_size = nb::cast<int64_t>(get("intermediate_size"));
    c.num_layers = nb::cast<int64_t>(get("num_hidden_layers"));
    c.num_heads = nb::cast<int64_t>(get("num_attention_heads"));
    c.num_kv_heads = nb::cast<int64_t>(get("num_key_value_heads"));
    c.head_dim = nb::cast<int64_t>(get("head_dim"));
    c.rms_norm_eps = nb::cast<float>(get("rms_norm_eps"));
    c.rope_theta = nb::cast<float>(get("rope_theta"));
    c.tie_word_embeddings = nb::cast<bool>(get("tie_word_embeddings"));
    return c;
}
} // namespace

void bind_model(nb::module_ &m) {
    using G = nb::call_guard<nb::gil_scoped_release>;
    nb::class_<Qwen2>(m, "Qwen2")
        .def("__init__", [](Qwen2 *self, const nb::dict &config, const std::string &dtype, const std::string &device,
                            std::optional<bool> fused) {
            new (self) Qwen2(config_from_dict(config), dtype_from_name(dtype), Device::parse(device), fused);
        }, nb::arg("config"), nb::arg("dtype"), nb::arg("device"), nb::arg("fused").none() = nb::none(),
             "The weights and layer math of one step over a batch; a Runner (with a KVPool) runs it. fused: "
             "fused projections on or off, None: on for CUDA only.")
        .def("load_weight", &Qwen2::load_weight, nb::arg("name"), nb::arg("value"), G())
        .def("load_quant_weight", &Qwen2::load_quant_weight, nb::arg("name"), nb::arg("value"), G(),
             "Takes a projection or embedding weight as a QuantMatrix (GGUF blocks), kept quantized.")
        .def("missing_weights", &Qwen2::missing_weights)
        .def("prepare", &Qwen2::prepare, G(), "Finish loading: checks, fusion, decode scratch (see qwen2.hpp).")
        .def("weight_formats", &Qwen2::weight_formats, "[(HF name, stored format 'bf16' / 'q4_k' / ..., bytes)]")
        .def_prop_ro("weight_bytes", &Qwen2::weight_bytes, "Bytes the weights take on the model's device.")
        .def_prop_ro("decode_scratch_bytes", &Qwen2::decode_scratch_bytes,
                     "CUDA, quantized weights: bytes of the buffer multi-row steps decode each weight into (0 "
                     "otherwise; set by prepare()).")
        .def_prop_ro("fused_projections", &Qwen2::fused_projections,
                     "One GEMV for q/k/v and for gate/up, RoPE + cache write in one kernel (set at construction).")
        .def_prop_ro("dtype", [](const Qwen2 &q) { return std::string(dtype_name(q.dtype())); })
        .def_prop_ro("device", [](const Qwen2 &q) { return q.device().str(); });
}
