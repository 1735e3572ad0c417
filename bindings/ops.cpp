// llaisys._core.ops: every operator in its out-parameter form. Arguments are documented in
// cpp/include/llaisys/ops.hpp; llaisys.functional has the allocating forms.
#include "bindings/common.hpp"
#include "llaisys/comm.hpp"
#include "llaisys/ops.hpp"

#include <nanobind/stl/map.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

using namespace llaisys;

void bind_ops(nb::module_ &m) {
    nb::module_ o = m.def_submodule("ops", "Operators writing into caller-provided outputs.");
    // Kernels run with the GIL released so other Python threads keep going during long CPU ops.
    using G = nb::call_guard<nb::gil_scoped_release>;
    o.def("add", &ops::add, nb::arg("out"), nb::arg("a"), nb::arg("b"), G());
    o.def("scale", &ops::scale, nb::arg("out"), nb::arg("x"), nb::arg("alpha"), G());
    o.def("cast", &ops::cast, nb::arg("out"), nb::arg("x"), G());
    o.def("rearrange", &ops::rearrange, nb::arg("out"), nb::arg("x"), G());
    o.def("index_copy", &ops::index_copy, nb::arg("out"), nb::arg("index"), nb::arg("src"), G());
    o.def("argmax", &ops::argmax, nb::arg("max_idx"), nb::arg("max_val"), nb::arg("x"), G());
    o.def("embedding", &ops::embedding, nb::arg("out"), nb::arg("ids"), nb::arg("weight"), G());
    o.def("linear", [](const Tensor &out, const Tensor &x, const Tensor &w, const Tensor *bias, bool constant_weight) {
        ops::linear(out, x, w, bias ? *bias : Tensor(), constant_weight);
    }, nb::arg("out"), nb::arg("x"), nb::arg("weight"), nb::arg("bias") = nb::none(), nb::kw_only(),
          nb::arg("constant_weight") = false, G());
    o.def("linear_swiglu", &ops::linear_swiglu, nb::arg("out"), nb::arg("x"), nb::arg("w_gate_up"), nb::kw_only(),
          nb::arg("constant_weight") = false, G());
    o.def("linear_geglu", &ops::linear_geglu, nb::arg("out"), nb::arg("x"), nb::arg("w_gate_up"),
          nb::arg("tanh_approx") = false, nb::kw_only(), nb::arg("constant_weight") = false, G());
    o.def("linear_gelu", [](const Tensor &out, const Tensor &x, const Tensor &w, const Tensor *bias, bool tanh_approx,
                            bool constant_weight) {
        ops::linear_gelu(out, x, w, bias ? *bias : Tensor(), tanh_approx, constant_weight);
    }, nb::arg("out"), nb::arg("x"), nb::arg("weight"), nb::arg("bias") = nb::none(), nb::arg("tanh_approx") = false,
          nb::kw_only(), nb::arg("constant_weight") = false, G());
    o.def("rms_norm", &ops::rms_norm, nb::arg("out"), nb::arg("x"), nb::arg("weight"), nb::arg("eps"), G());
    o.def("add_rms_norm", [](const Tensor &out, const Tensor &residual, const Tensor &x, const Tensor &weight,
                             float eps, const Tensor *x_weight) {
        ops::add_rms_norm(out, residual, x, weight, eps, x_weight ? *x_weight : Tensor());
    }, nb::arg("out"), nb::arg("residual"), nb::arg("x"), nb::arg("weight"), nb::arg("eps"), nb::kw_only(),
          nb::arg("x_weight") = nb::none(), G());
    o.def("rope", nb::overload_cast<const Tensor &, const Tensor &, const Tensor &, float>(&ops::rope), nb::arg("out"),
          nb::arg("x"), nb::arg("pos_ids"), nb::arg("theta"), G());
    o.def("rope_qkv_cache", [](const Tensor &q_out, const Tensor &k_cache, const Tensor &v_cache, const Tensor &qkv,
                               const Tensor &pos_ids, float theta, const Tensor *slots, const Tensor *q_norm,
                               const Tensor *k_norm, float eps) {
        ops::rope_qkv_cache(q_out, k_cache, v_cache, qkv, pos_ids, theta, slots ? *slots : Tensor(),
                            q_norm ? *q_norm : Tensor(), k_norm ? *k_norm : Tensor(), eps);
    }, nb::arg("q_out"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("qkv"), nb::arg("pos_ids"), nb::arg("theta"),
          nb::arg("slots") = nb::none(), nb::kw_only(), nb::arg("q_norm") = nb::none(), nb::arg("k_norm") = nb::none(),
          nb::arg("eps") = 0.f, G());
    // RoPE from a frequency table (partial rotary, rope scaling): rope / rope_qkv_cache with a list of floats
    // in place of theta, and the table HF computes (rope_type "default", "linear" or "llama3").
    o.def("rope", nb::overload_cast<const Tensor &, const Tensor &, const Tensor &, const std::vector<float> &>(&ops::rope),
          nb::arg("out"), nb::arg("x"), nb::arg("pos_ids"), nb::arg("inv_freq"), G());
    o.def("rope_qkv_cache", [](const Tensor &q_out, const Tensor &k_cache, const Tensor &v_cache, const Tensor &qkv,
                               const Tensor &pos_ids, const std::vector<float> &inv_freq, const Tensor *slots,
                               const Tensor *q_norm, const Tensor *k_norm, float eps) {
        ops::rope_qkv_cache(q_out, k_cache, v_cache, qkv, pos_ids, inv_freq, slots ? *slots : Tensor(),
                            q_norm ? *q_norm : Tensor(), k_norm ? *k_norm : Tensor(), eps);
    }, nb::arg("q_out"), nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("qkv"), nb::arg("pos_ids"),
          nb::arg("inv_freq"), nb::arg("slots") = nb::none(), nb::kw_only(), nb::arg("q_norm") = nb::none(),
          nb::arg("k_norm") = nb::none(), nb::arg("eps") = 0.f, G());
    o.def("kv_shift", &ops::kv_shift, nb::arg("k_cache"), nb::arg("v_cache"), nb::arg("src"), nb::arg("dst"),
          nb::arg("delta"), nb::arg("inv_freq"), G());
    o.def("rope_inv_freq", [](float theta, int64_t rotary_dim, const std::string &rope_type, float factor,
                              float low_freq_factor, float high_freq_factor, int64_t original_max_position_embeddings) {
        ops::RopeScaling sc;
        if (rope_type == "default") sc.type = ops::RopeScaling::Type::none;
        else if (rope_type == "linear") sc.type = ops::RopeScaling::Type::linear;
        else if (rope_type == "llama3") sc.type = ops::RopeScaling::Type::llama3;
        else throw std::invalid_argument("rope_inv_freq: rope_type must be 'default', 'linear' or 'llama3', got '" +
                                         rope_type + "'");
        sc.factor = factor;
        sc.low_freq_factor = low_freq_factor;
        sc.high_freq_factor = high_freq_factor;
        sc.original_max_position_embeddings = original_max_position_embeddings;
        return ops::rope_inv_freq(theta, rotary_dim, sc);
    }, nb::arg("theta"), nb::arg("rotary_dim"), nb::kw_only(), nb::arg("rope_type") = "default",
          nb::arg("factor") = 1.f, nb::arg("low_freq_factor") = 1.f, nb::arg("high_freq_factor") = 4.f,
          nb::arg("original_max_position_embeddings") = 8192);
    o.def("self_attention", &ops::self_attention, nb::arg("out"), nb::arg("q"), nb::arg("k"), nb::arg("v"),
          nb::arg("scale"), G());
    o.def("self_attention_cached", &ops::self_attention_cached, nb::arg("out"), nb::arg("q"), nb::arg("k_cache"),
          nb::arg("v_cache"), nb::arg("kv_len"), nb::arg("scale"), G());
    o.def("paged_attention", &ops::paged_attention, nb::arg("out"), nb::arg("q"), nb::arg("k_cache"),
          nb::arg("v_cache"), nb::arg("block_tables"), nb::arg("q_start"), nb::arg("kv_len"), nb::arg("scale"),
          nb::arg("max_q_len"), nb::arg("settled_history") = false, nb::arg("window") = 0, G());
    o.def("swiglu", &ops::swiglu, nb::arg("out"), nb::arg("gate"), nb::arg("up"), G());
    o.def("sample", &ops::sample, nb::arg("out_ids"), nb::arg("logits"), nb::arg("temperature"), nb::arg("top_k"),
          nb::arg("top_p"), nb::arg("min_p"), nb::arg("seed"), nb::arg("offset"), G());
    o.def("sample_rows", &ops::sample_rows, nb::arg("out_ids"), nb::arg("logits"), nb::arg("temperature"),
          nb::arg("top_k"), nb::arg("top_p"), nb::arg("min_p"), nb::arg("seeds"), nb::arg("steps"), G());
    o.def("logprobs", &ops::logprobs, nb::arg("chosen_lp"), nb::arg("top_ids"), nb::arg("top_lp"), nb::arg("logits"),
          nb::arg("temperature"), nb::arg("chosen"), nb::arg("rows"), G());
    o.def("repetition_penalty", &ops::repetition_penalty, nb::arg("logits"), nb::arg("ids"), nb::arg("penalty"), G());
    o.def("seen_penalty", &ops::seen_penalty, nb::arg("logits"), nb::arg("seen"), nb::arg("rows"), nb::arg("penalty"),
          G());
    o.def("seen_mark", &ops::seen_mark, nb::arg("seen"), nb::arg("rows"), nb::arg("ids"), G());
    o.def("logit_bias", &ops::logit_bias, nb::arg("logits"), nb::arg("ids"), nb::arg("bias"), G());
    o.def("token_mask", &ops::token_mask, nb::arg("logits"), nb::arg("mask"), G());
    // ---- LayerNorm and GELU (GPT-NeoX / Pythia, Gemma 3); bias and delta2 may be None ----
    o.def("layer_norm", [](const Tensor &out, const Tensor &x, const Tensor &weight, const Tensor *bias, float eps) {
        ops::layer_norm(out, x, weight, bias ? *bias : Tensor(), eps);
    }, nb::arg("out"), nb::arg("x"), nb::arg("weight"), nb::arg("bias").none(), nb::arg("eps"), G());
    o.def("add_layer_norm", [](const Tensor &out, const Tensor &residual, const Tensor &delta, const Tensor *delta2,
                               const Tensor &weight, const Tensor *bias, float eps, const Tensor *out2,
                               const Tensor *weight2, const Tensor *bias2) {
        const auto opt = [](const Tensor *t) { return t ? *t : Tensor(); };
        ops::add_layer_norm(out, residual, delta, opt(delta2), weight, opt(bias), eps, opt(out2), opt(weight2),
                            opt(bias2));
    }, nb::arg("out"), nb::arg("residual"), nb::arg("delta"), nb::arg("delta2").none(), nb::arg("weight"),
          nb::arg("bias").none(), nb::arg("eps"), nb::arg("out2").none() = nb::none(),
          nb::arg("weight2").none() = nb::none(), nb::arg("bias2").none() = nb::none(), G());
    o.def("gelu", &ops::gelu, nb::arg("out"), nb::arg("x"), nb::arg("tanh_approx") = false, G());
    o.def("geglu", &ops::geglu, nb::arg("out"), nb::arg("gate"), nb::arg("up"), nb::arg("tanh_approx") = false, G());
    // ---- end LayerNorm and GELU ----
    // ---- tensor-parallel collectives (llaisys/comm.hpp) ----
    nb::class_<Communicator>(m, "Communicator", "One rank of a tensor-parallel group (local_group makes them).")
        .def_prop_ro("rank", &Communicator::rank)
        .def_prop_ro("world", &Communicator::world)
        .def_prop_ro("device", [](const Communicator &c) { return c.device().str(); })
        .def_prop_ro("backend", &Communicator::backend)
        .def_prop_ro("all_reduce_paths", &Communicator::all_reduce_paths,
                     "How many all_reduces of this rank took each path (CUDA: push, pull, nccl); a call captured "
                     "into a CUDA graph counts once, not per replay.")
        .def("abort", &Communicator::abort, nb::arg("why"), nb::call_guard<nb::gil_scoped_release>(),
             "Breaks the group: calls blocked in a collective raise, and so does every later one.");
    m.def("local_group", [](const std::string &device, int world, double timeout_s) {
        LLAISYS_CHECK(world >= 1, std::invalid_argument, "local_group: world must be >= 1, got ", world);
        const Device d = Device::parse(device);
        std::vector<int> devices(size_t(world), 0);
        if (d.type == DeviceType::CUDA)
            for (int r = 0; r < world; ++r) devices[size_t(r)] = d.index + r;
        return local_group(d.type, devices, timeout_s);
    }, nb::arg("device"), nb::arg("world"), nb::arg("timeout_s") = 300.0,
       "The `world` ranks of one group: on 'cpu' threads of this process, on 'cuda[:i]' GPUs i .. i + world - 1 "
       "(NCCL).");
    m.def("nccl_unique_id", [] {
        const std::string id = nccl_unique_id();
        return nb::bytes(id.data(), id.size());
    }, "NCCL's unique id (bytes) that global rank 0's process hands every process of a group (group_from_id).");
    m.def("group_from_id", [](const std::string &device, int local, int first_rank, int world, nb::bytes id) {
        const Device d = Device::parse(device);
        LLAISYS_CHECK(d.type == DeviceType::CUDA, std::invalid_argument, "group_from_id: CUDA only (the CPU "
                      "spans processes with socket_group), got ", device);
        std::vector<int> devices;
        for (int r = 0; r < local; ++r) devices.push_back(d.index + r);
        const std::string raw(id.c_str(), id.size());
        nb::gil_scoped_release release; // blocks until every process's ranks joined
        return group_from_id(devices, first_rank, world, raw);
    }, nb::arg("device"), nb::arg("local"), nb::arg("first_rank"), nb::arg("world"), nb::arg("id"),
       "This process's GPUs device .. device + local - 1 as global ranks first_rank.. of a group of `world` "
       "spanning processes, through NCCL's unique id.");
    m.def("socket_group", &socket_group, nb::arg("rank"), nb::arg("world"), nb::arg("fds"), nb::arg("timeout_s"),
       "This process as CPU rank `rank` of `world` over connected TCP sockets (rank 0: one per rank, its own "
       "-1; others: the one to rank 0), which the communicator then owns.");
    o.def("all_reduce", &ops::all_reduce, nb::arg("x"), nb::arg("comm"), G());
    o.def("all_gather", &ops::all_gather, nb::arg("out"), nb::arg("x"), nb::arg("comm"), G());
}
