// llaisys._core.KVPool and Runner: the paged KV cache and the step runner the Python scheduler drives.
#include "bindings/common.hpp"
#include "llaisys/rank_group.hpp"
#include "llaisys/runner.hpp"

#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <type_traits>

using namespace llaisys;
using namespace llaisys::runtime;

namespace {
template <typename T>
using Array = nb::ndarray<const T, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

template <typename T, typename U = T>
std::vector<U> to_vector(const Array<T> &a) {
    return std::vector<U>(a.data(), a.data() + a.shape(0));
}

using Tables = nb::ndarray<const int32_t, nb::ndim<2>, nb::c_contig, nb::device::cpu>;

// A new NumPy array of `shape` holding a copy of v (its own buffer, freed with the array).
template <typename T>
nb::ndarray<nb::numpy, T> owned_array(const std::vector<T> &v, std::initializer_list<size_t> shape) {
    T *buf = new T[std::max<size_t>(v.size(), 1)];
    std::copy(v.begin(), v.end(), buf);
    nb::capsule owner(buf, [](void *p) noexcept { delete[] static_cast<T *>(p); });
    return nb::ndarray<nb::numpy, T>(buf, shape.size(), shape.begin(), owner);
}

HostBatch host_batch(const Array<int64_t> &ids, const Array<int64_t> &pos, const Array<int64_t> &slots,
                     const Array<int32_t> &q_start, const Array<int32_t> &kv_len, const Tables &tables,
                     bool logits = true) {
    HostBatch b;
    b.logits = logits;
    b.ids = to_vector(ids);
    b.pos = to_vector(pos);
    b.slots = to_vector(slots);
    b.q_start = to_vector(q_start);
    b.kv_len = to_vector(kv_len);
    b.max_blocks = int64_t(tables.shape(1));
    b.block_tables.assign(tables.data(), tables.data() + tables.shape(0) * tables.shape(1));
    LLAISYS_CHECK(int64_t(tables.shape(0)) == b.num_seqs(), std::invalid_argument,
                  "Runner: block_tables needs one row per sequence");
    return b;
}
// One RowSampling per sequence of b from the step's sampling arrays (moved out of the lists).
std::vector<RowSampling> row_sampling(const HostBatch &b, const Array<float> &temperature, const Array<int32_t> &top_k,
                                      const Array<float> &top_p, const Array<float> &min_p,
                                      const Array<float> &repetition_penalty, const Array<uint64_t> &seed,
                                      const Array<uint64_t> &step, const Array<int32_t> &seen_row,
                                      std::vector<std::vector<int64_t>> &bias_ids, std::vector<std::vector<float>> &bias) {
    const size_t B = size_t(b.num_seqs());
    LLAISYS_CHECK(temperature.shape(0) == B && top_k.shape(0) == B && top_p.shape(0) == B && min_p.shape(0) == B &&
                      repetition_penalty.shape(0) == B && seed.shape(0) == B && step.shape(0) == B &&
                      seen_row.shape(0) == B && bias_ids.size() == bias.size() &&
                      (bias_ids.empty() || bias_ids.size() == B),
                  std::invalid_argument, "Runner.step: need one sampling value per sequence (", B, ")");
    std::vector<RowSampling> rows(B);
    for (size_t i = 0; i < B; ++i) {
        RowSampling &r = rows[i];
        r.temperature = temperature.data()[i];
        r.top_k = top_k.data()[i];
        r.top_p = top_p.data()[i];
        r.min_p = min_p.data()[i];
        r.repetition_penalty = repetition_penalty.data()[i];
        r.seed = seed.data()[i];
        r.step = step.data()[i];
        r.seen_row = seen_row.data()[i];
        if (!bias_ids.empty()) {
            LLAISYS_CHECK(bias_ids[i].size() == bias[i].size(), std::invalid_argument,
                          "Runner.step: bias_ids and bias of row ", i, " differ in length");
            r.bias_ids = std::move(bias_ids[i]);
            r.bias = std::move(bias[i]);
        }
    }
    return rows;
}

// Each of B rows' allowed-token bitmask: token_mask[j] for row mask_rows[j] ([M, W] i32; None: no row
// constrained), empty for the others.
std::vector<std::vector<int32_t>> row_masks(size_t B, const std::optional<Tables> &token_mask,
                                            const std::vector<int64_t> &mask_rows) {
    const size_t M = token_mask ? token_mask->shape(0) : 0, W = token_mask ? token_mask->shape(1) : 0;
    LLAISYS_CHECK(M == mask_rows.size(), std::invalid_argument, "Runner.step: token_mask has ", M,
                  " rows but mask_rows names ", mask_rows.size());
    std::vector<std::vector<int32_t>> masks(B);
    for (size_t j = 0; j < M; ++j) {
        const int64_t r = mask_rows[j];
        LLAISYS_CHECK(r >= 0 && r < int64_t(B), std::out_of_range, "Runner.step: mask row ", r,
                      " outside the batch of ", B);
        const int32_t *p = token_mask->data() + j * W;
        masks[size_t(r)].assign(p, p + W);
    }
    return masks;
}

// Strided read-only views: a column of a logprobs log ([steps, rows, k] arrays, engine/logprobs_log.py).
using Lp1 = nb::ndarray<const float, nb::ndim<1>, nb::device::cpu>;
template <typename T>
using Lp2 = nb::ndarray<const T, nb::ndim<2>, nb::device::cpu>;

// A new untracked object (see logprobs_entries), or the error nanobind raises.
PyObject *checked(PyObject *o) {
    if (!o) throw nb::python_error();
    return o;
}

// The logprobs entries {"token_id", "logprob", "top": [[id, logprob] x n]} of T rows, as the engine's
// Python built them (logprobs_log.entries' docstring): Python ints from the i64 ids, floats from the f32
// logprobs. The containers are left out of the garbage collector (PyObject_GC_UnTrack): plain data made here,
// in no reference cycle, freed by their reference counts as any; tracked, the ~7 of each entry were walked
// by every collection while results piled up (half the cost of building them at 256 rows, CPU proxy). A dict
// is tracked again by CPython once a container is put in it; a list is not (a cycle made through it would
// never be collected).
nb::list logprobs_entries(const std::vector<int64_t> &tokens, const Lp1 &chosen, const Lp2<int64_t> &ids,
                          const Lp2<float> &lps, const std::vector<int64_t> &n) {
    const size_t T = tokens.size();
    LLAISYS_CHECK(chosen.shape(0) == T && ids.shape(0) == T && lps.shape(0) == T &&
                      ids.shape(1) == lps.shape(1) && (n.size() == T || n.size() == 1),
                  std::invalid_argument, "logprobs_entries: ", T, " tokens, ", chosen.shape(0), " logprobs, ",
                  ids.shape(0), " x ", ids.shape(1), " ids, ", lps.shape(0), " x ", lps.shape(1), " top, ",
                  n.size(), " counts");
    static PyObject *k_token = PyUnicode_InternFromString("token_id"), *k_lp = PyUnicode_InternFromString("logprob"),
                    *k_top = PyUnicode_InternFromString("top");
    const int64_t K = int64_t(ids.shape(1));
    nb::list out = nb::steal<nb::list>(checked(PyList_New(Py_ssize_t(T))));
    for (size_t i = 0; i < T; ++i) {
        const int64_t m = std::min(n.size() == 1 ? n[0] : n[i], K);
        LLAISYS_CHECK(m >= 0, std::invalid_argument, "logprobs_entries: a negative count");
        nb::object top = nb::steal(checked(PyList_New(Py_ssize_t(m))));
        for (int64_t j = 0; j < m; ++j) {
            PyObject *pair = checked(PyList_New(2));
            PyList_SET_ITEM(top.ptr(), j, pair); // owned by top from here (freed with it on an error)
            PyList_SET_ITEM(pair, 0, checked(PyLong_FromLongLong(ids(i, j))));
            PyList_SET_ITEM(pair, 1, checked(PyFloat_FromDouble(double(lps(i, j)))));
            PyObject_GC_UnTrack(pair);
        }
        PyObject_GC_UnTrack(top.ptr());
        nb::object entry = nb::steal(checked(PyDict_New()));
        nb::object token = nb::steal(checked(PyLong_FromLongLong(tokens[i])));
        nb::object lp = nb::steal(checked(PyFloat_FromDouble(double(chosen(i)))));
        if (PyDict_SetItem(entry.ptr(), k_token, token.ptr()) || PyDict_SetItem(entry.ptr(), k_lp, lp.ptr()) ||
            PyDict_SetItem(entry.ptr(), k_top, top.ptr()))
            throw nb::python_error();
        PyObject_GC_UnTrack(entry.ptr());
        PyList_SET_ITEM(out.ptr(), Py_ssize_t(i), entry.release().ptr());
    }
    return out;
}

void add_masks(std::vector<RowSampling> &rows, const std::optional<Tables> &token_mask,
               const std::vector<int64_t> &mask_rows) {
    std::vector<std::vector<int32_t>> masks = row_masks(rows.size(), token_mask, mask_rows);
    for (size_t i = 0; i < rows.size(); ++i) rows[i].allowed = std::move(masks[i]);
}
} // namespace

// The methods a Runner and a RankGroup share (the engine drives either the same way).
template <typename R>
void bind_steps(nb::class_<R> &c) {
    using G = nb::call_guard<nb::gil_scoped_release>;
    c
        .def("step", [](R &r, Array<int64_t> ids, Array<int64_t> pos, Array<int64_t> slots,
                        Array<int32_t> q_start, Array<int32_t> kv_len, Tables tables, Array<float> temperature,
                        Array<int32_t> top_k, Array<float> top_p, Array<float> min_p, Array<float> repetition_penalty,
                        Array<uint64_t> seed, Array<uint64_t> step, Array<int32_t> seen_row,
                        std::vector<std::vector<int64_t>> bias_ids, std::vector<std::vector<float>> bias,
                        std::optional<Tables> token_mask, std::vector<int64_t> mask_rows, bool logits) {
            const HostBatch b = host_batch(ids, pos, slots, q_start, kv_len, tables, logits);
            std::vector<RowSampling> rows = row_sampling(b, temperature, top_k, top_p, min_p, repetition_penalty,
                                                         seed, step, seen_row, bias_ids, bias);
            add_masks(rows, token_mask, mask_rows);
            nb::gil_scoped_release release;
            return r.step(b, rows);
        }, nb::arg("ids"), nb::arg("pos"), nb::arg("slots"), nb::arg("q_start"), nb::arg("kv_len"),
             nb::arg("block_tables"), nb::arg("temperature"), nb::arg("top_k"), nb::arg("top_p"), nb::arg("min_p"),
             nb::arg("repetition_penalty"), nb::arg("seed"), nb::arg("step"), nb::arg("seen_row"),
             nb::arg("bias_ids"), nb::arg("bias"), nb::arg("token_mask").none() = nb::none(),
             nb::arg("mask_rows") = std::vector<int64_t>(), nb::arg("logits") = true,
             "Runs one step and returns one sampled token id per sequence. token_mask [M, ceil(vocab / 32)] (i32): "
             "the allowed-token bitmasks of rows mask_rows (structured output). logits False: no row samples a "
             "token this step (prompt chunks before their prompt's last): no LM head, every row gets token 0.")
        .def("launch", [](R &r, Array<int64_t> ids, Array<int64_t> pos, Array<int64_t> slots,
                          Array<int32_t> q_start, Array<int32_t> kv_len, Tables tables, Array<float> temperature,
                          Array<int32_t> top_k, Array<float> top_p, Array<float> min_p, Array<float> repetition_penalty,
                          Array<uint64_t> seed, Array<uint64_t> step, Array<int32_t> seen_row,
                          std::vector<std::vector<int64_t>> bias_ids, std::vector<std::vector<float>> bias,
                          bool chain, std::optional<Tables> token_mask, std::vector<int64_t> mask_rows,
                          bool defer_sampling, std::vector<int64_t> chain_rows, bool logits) {
            const HostBatch b = host_batch(ids, pos, slots, q_start, kv_len, tables, logits);
            std::vector<RowSampling> rows = row_sampling(b, temperature, top_k, top_p, min_p, repetition_penalty,
                                                         seed, step, seen_row, bias_ids, bias);
            add_masks(rows, token_mask, mask_rows);
            nb::gil_scoped_release release;
            if constexpr (std::is_same_v<R, Runner>) {
                r.launch(b, rows, chain, defer_sampling, chain_rows);
            } else { // a tensor-parallel group chains steps but never defers sampling (EngineCore)
                LLAISYS_CHECK(!defer_sampling, std::invalid_argument, "RankGroup.launch: no defer_sampling");
                r.launch(b, rows, chain, chain_rows);
            }
        }, nb::arg("ids"), nb::arg("pos"), nb::arg("slots"), nb::arg("q_start"), nb::arg("kv_len"),
             nb::arg("block_tables"), nb::arg("temperature"), nb::arg("top_k"), nb::arg("top_p"), nb::arg("min_p"),
             nb::arg("repetition_penalty"), nb::arg("seed"), nb::arg("step"), nb::arg("seen_row"),
             nb::arg("bias_ids"), nb::arg("bias"), nb::arg("chain"), nb::arg("token_mask").none() = nb::none(),
             nb::arg("mask_rows") = std::vector<int64_t>(), nb::arg("defer_sampling") = false,
             nb::arg("chain_rows") = std::vector<int64_t>(), nb::arg("logits") = true,
             "Runs one step without waiting for its tokens (finish() returns them); chain: its input ids are the "
             "previous launch's tokens, on the device (chain_rows: of those rows, increasing). defer_sampling (a Runner only): the forward alone; "
             "sample_deferred() samples it. logits: as step()'s.")
        .def("finish", [](R &r) {
            nb::gil_scoped_release release;
            return r.finish();
        }, "The tokens of the oldest unfinished launch (waits for them).")
        .def("set_seen", [](R &r, int64_t row, Array<int32_t> words) {
            std::vector<int32_t> w = to_vector(words);
            nb::gil_scoped_release release;
            r.set_seen(row, w);
        }, nb::arg("row"), nb::arg("words"),
             "Writes row `row` of the repetition penalty's seen sets: words [ceil(vocab / 32)] i32, bit v % 32 of "
             "word v / 32 = token v seen (a step's seen_row names it; its sampled tokens are added on the device).")
        .def_prop_ro("launched", &R::launched, "Launched steps not finished yet.")
        .def_prop_ro("busy", [](const R &r) {
            if constexpr (std::is_same_v<R, Runner>) return r.busy();
            else return false; // a RankGroup's ranks own their launches on their threads: never asked
        }, "Whether the oldest launch still runs on the device (finish() would wait); False on the CPU and for a "
           "tensor-parallel group.")
        .def("logits", [](R &r, Array<int64_t> ids, Array<int64_t> pos, Array<int64_t> slots,
                          Array<int32_t> q_start, Array<int32_t> kv_len, Tables tables, bool all_logits) {
            const HostBatch b = host_batch(ids, pos, slots, q_start, kv_len, tables);
            nb::gil_scoped_release release;
            return r.logits(b, all_logits);
        }, nb::arg("ids"), nb::arg("pos"), nb::arg("slots"), nb::arg("q_start"), nb::arg("kv_len"),
             nb::arg("block_tables"), nb::arg("all_logits") = false,
             "The step's logits [B, vocab] (or [T, vocab] with all_logits), not synchronized.")
        .def("last_logits", &R::last_logits,
             "The logits the last step sampled from [B, vocab] (after penalties, before temperature).")
        .def("shift_kv", &R::shift_kv, nb::arg("src"), nb::arg("dst"), nb::arg("delta"), G(),
             "StreamingLLM's K-shift before the next step: cache rows src -> dst, keys turned by delta positions "
             "with each layer's RoPE table (stream-ordered behind every launched step).")
        .def_prop_ro("captured_batch_sizes", &R::captured_batch_sizes)
        .def_prop_ro("steps_sampled_in_graph", &R::steps_sampled_in_graph,
                     "Steps whose tokens were sampled inside a CUDA graph (no penalty or bias in any row).");
}

void bind_serving(nb::module_ &m) {
    m.def("logprobs_entries", &logprobs_entries, nb::arg("tokens"), nb::arg("chosen"), nb::arg("top_ids"),
          nb::arg("top_lp"), nb::arg("n"),
          "Logprobs entries {'token_id', 'logprob', 'top': [[id, logprob], ...]} of rows: tokens [T] ints, chosen "
          "[T] f32, top_ids [T, K] i64 and top_lp [T, K] f32 (strided views allowed), n: each row's count of top "
          "pairs (one for every row, or T), at most K. Its containers are not tracked by the garbage collector.");
    m.def("device_memory_info", [](const std::string &d) {
        const DeviceMemoryInfo info = device_memory_info(Device::parse(d));
        return std::make_pair(info.free, info.total);
    }, nb::arg("device"), "(free, total) bytes of `device` (CUDA: cudaMemGetInfo; CPU: MemAvailable/MemTotal).");

    nb::class_<KVPool>(m, "KVPool")
        .def("__init__", [](KVPool *self, int64_t layers, int64_t blocks, int64_t block_size, int64_t nkvh,
                            int64_t hd, const std::string &dtype, const std::string &device) {
            new (self) KVPool(layers, blocks, block_size, nkvh, hd, dtype_from_name(dtype), Device::parse(device));
        }, nb::arg("num_layers"), nb::arg("num_blocks"), nb::arg("block_size"), nb::arg("num_kv_heads"),
             nb::arg("head_dim"), nb::arg("dtype"), nb::arg("device"))
        .def_static("block_bytes", [](int64_t layers, int64_t block_size, int64_t nkvh, int64_t hd,
                                      const std::string &dtype) {
            return KVPool::block_bytes(layers, block_size, nkvh, hd, dtype_from_name(dtype));
        }, nb::arg("num_layers"), nb::arg("block_size"), nb::arg("num_kv_heads"), nb::arg("head_dim"), nb::arg("dtype"))
        .def_prop_ro("num_blocks", &KVPool::num_blocks)
        .def_prop_ro("block_size", &KVPool::block_size)
        .def_prop_ro("nbytes", &KVPool::nbytes)
        .def("keys", &KVPool::keys, nb::arg("layer"))
        .def("values", &KVPool::values, nb::arg("layer"));

    nb::class_<Runner> runner(m, "Runner");
    runner
        .def("__init__", [](Runner *self, models::Model &model, KVPool &pool, std::vector<int64_t> graph_sizes,
                            int64_t max_blocks_per_seq, bool cuda_graphs) {
            new (self) Runner(model, pool, RunnerConfig{std::move(graph_sizes), max_blocks_per_seq, cuda_graphs});
        }, nb::arg("model"), nb::arg("pool"), nb::arg("graph_batch_sizes"), nb::arg("max_blocks_per_seq"),
             nb::arg("cuda_graphs"), nb::keep_alive<1, 2>(), nb::keep_alive<1, 3>());
    bind_steps(runner);
    runner.def("sample_deferred", [](Runner &r, std::optional<Tables> token_mask, std::vector<int64_t> mask_rows,
                                     int64_t num_rows) {
        const int64_t M = token_mask ? int64_t(token_mask->shape(0)) : 0;
        const int64_t W = token_mask ? int64_t(token_mask->shape(1)) : 0;
        nb::gil_scoped_release release; // the array is read in the call (token_mask keeps it alive)
        r.sample_deferred(token_mask ? token_mask->data() : nullptr, M, W, mask_rows, num_rows);
    }, nb::arg("token_mask").none(), nb::arg("mask_rows"), nb::arg("num_rows"),
       "Samples the deferred launch (launch(defer_sampling=True)) of num_rows rows, rows mask_rows masked by "
       "token_mask [M, ceil(vocab / 32)] (i32).");
    runner.def("mask_buffer", &Runner::mask_buffer, nb::arg("rows"),
               "A host buffer [rows, ceil(vocab / 32)] i32 for the next sample_deferred's token masks (pinned on "
               "CUDA: copied to the device as it is). Two alternate; write it only before that call.");
    runner.def("enqueue_logprobs", [](Runner &r, std::vector<int64_t> rows, Array<float> temperature, int64_t k) {
        std::vector<float> t = to_vector(temperature);
        nb::gil_scoped_release release;
        r.enqueue_logprobs(rows, t, k);
    }, nb::arg("rows"), nb::arg("temperature"), nb::arg("k"),
       "Logprobs of the last launch's rows `rows` (temperature [B] f32, 0 = 1; k most likely, 1..20), computed on "
       "the device behind it: finished_logprobs() returns them once finish() returned its tokens.");
    runner.def("finished_logprobs", [](const Runner &r) -> nb::object {
        const Runner::FinishedLogprobs &f = r.finished_logprobs();
        if (f.k == 0) return nb::none();
        const size_t R = f.chosen.size(), k = size_t(f.k);
        // NumPy arrays (each owning a copy): the engine keeps them as they are for rows read at their end
        // (engine/logprobs_log.py), rather than lists of R lists of k Python numbers built every step
        return nb::make_tuple(owned_array(f.chosen, {R}), owned_array(f.top_ids, {R, k}),
                              owned_array(f.top_lp, {R, k}));
    }, "(chosen_lp [R] f32, top_ids [R, k] i64, top_lp [R, k] f32) NumPy arrays of the step finish() returned "
       "last, or None when enqueue_logprobs was not called for it.");

    nb::class_<RankGroup> group(m, "RankGroup",
                                "The runners of a tensor-parallel group driven as one: one thread per rank (rank_group.hpp).");
    group
        .def("__init__", [](RankGroup *self, std::vector<Runner *> runners, double timeout_s) {
            new (self) RankGroup(std::move(runners), timeout_s);
        }, nb::arg("runners"), nb::arg("timeout_s") = 300.0, nb::keep_alive<1, 2>())
        .def_prop_ro("world", &RankGroup::world)
        .def_prop_ro("broken", &RankGroup::broken, "Why the group is broken ('' while it is not).")
        .def_prop_ro("left_behind", &RankGroup::left_behind,
                     "Ranks still inside a job the broken group gave up on: their runners must never be freed.")
        .def("inject_fault", &RankGroup::inject_fault, nb::arg("rank"), nb::arg("mode"),
             "For fault tests: the rank's next call raises ('raise'), stalls until the group gives up ('stall'), or "
             "hangs past that, left behind ('hang').");
    bind_steps(group);
}
