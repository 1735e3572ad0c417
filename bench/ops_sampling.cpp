// The decode-step ops around the model: argmax (1 and 4 rows; on CUDA also 64 and 256, next to a copy
// of the same bytes, and every row count replayed from a CUDA graph too) and sample over rows of Qwen2
// logits (V = 151936), and embedding of 1 id (decode) and 512 ids (prefill; 2048 and 8192 on CUDA) for
// hidden sizes 896 (0.5B) and 1536 (1.5B).
// GB/s counts the bytes an op must move at least: the logits read once (sample reads them more than
// once, so its figure is a lower bound of the traffic), and for embedding the rows read and written.
// CUDA iterations time a batch of back-to-back calls with events, so launch gaps and host waits do not
// count.
#include "bench_timing.hpp"
#include "llaisys/ops.hpp"
#include "llaisys/stream.hpp"
#include "llaisys/tensor.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace llaisys;

constexpr int64_t kSamplingVocab = 151936;

// Normal(0, scale) values of `dtype` on `device`, rounded from f32.
Tensor sampling_random(const Shape &shape, DType dtype, Device device, float scale, uint32_t seed) {
    Tensor host = Tensor::empty(shape, DType::F32);
    std::mt19937 gen(seed);
    std::normal_distribution<float> dist(0.f, scale);
    float *p = host.data_as<float>();
    for (int64_t i = 0; i < host.numel(); ++i) p[i] = dist(gen);
    return ops::to_dtype(host, dtype).to(device);
}

// Runs fn(i) (the i-th call, i = 0, 1, ...) once per iteration on the CPU; on CUDA times batches of 20
// behind a filler op (bench_timing.hpp).
template <typename Fn>
void sampling_timed(benchmark::State &state, Device dev, Fn &&fn) {
    if (dev.is_cuda()) return llaisys::bench::time_filled_batches(state, dev, 20, int64_t(64) << 20, fn);
    size_t i = 0;
    for (auto _ : state) fn(i++);
}

void set_bytes(benchmark::State &state, double bytes) {
    state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

bool sampling_device_ok(benchmark::State &state, Device dev) {
    if (dev.is_cuda() && cuda_device_count() == 0) {
        state.SkipWithError("no CUDA device visible");
        return false;
    }
    return true;
}

// rows x 151936. One and four rows (greedy decode) read logits the LM head has just written, so they
// stay in L2 between calls; 64 and 256 rows (a batch) cycle through cold copies. On CUDA few long rows
// take the split path (several blocks per row, then a one-warp combine per row), many rows one block per
// row; see cpp/ops/argmax/cuda.cu. With `graph` (CUDA), the same calls are replayed from a CUDA graph
// (bench_timing.hpp), as the Linear/cuda_graph/... rows are: at least 16 calls a replay.
void bench_argmax(benchmark::State &state, Device dev, DType dtype, int64_t rows, bool graph) {
    if (!sampling_device_ok(state, dev)) return;
    const double bytes = double(rows) * double(kSamplingVocab) * double(dtype_size(dtype));
    const int64_t sets = rows <= 4 ? 1 : llaisys::bench::cold_sets(bytes, dev);
    std::vector<Tensor> xs;
    for (int64_t i = 0; i < sets; ++i) xs.push_back(sampling_random({rows, kSamplingVocab}, dtype, dev, 3.f, uint32_t(1 + i)));
    const Tensor idx = Tensor::empty({rows}, DType::I64, dev), val = Tensor::empty({rows}, dtype, dev);
    const auto call = [&](size_t i) { ops::argmax(idx, val, xs[i % xs.size()]); };
    if (graph)
        llaisys::bench::time_graph_replays(state, dev, int(std::max<int64_t>(16, sets)), [&](int i) { call(size_t(i)); });
    else
        sampling_timed(state, dev, call);
    set_bytes(state, bytes);
}

// A copy (one cudaMemcpyAsync) that reads and writes as many bytes in all as argmax over rows x 151936
// bf16 reads: what the copy path itself reaches at this size, next to the 1 GiB copy ceiling. It says
// whether these rows are enough to fill the chip, as CopySameBytes does for the norms.
void bench_argmax_copy(benchmark::State &state, Device dev, int64_t rows) {
    if (!sampling_device_ok(state, dev)) return;
    const double bytes = double(rows) * double(kSamplingVocab) * 2.0;
    std::vector<Tensor> srcs, dsts;
    for (int64_t i = 0, sets = llaisys::bench::cold_sets(bytes, dev); i < sets; ++i) {
        srcs.push_back(Tensor::zeros({rows, kSamplingVocab / 2}, DType::BF16, dev));
        dsts.push_back(Tensor::empty({rows, kSamplingVocab / 2}, DType::BF16, dev));
    }
    sampling_timed(state, dev, [&](size_t i) { ops::rearrange(dsts[i % dsts.size()], srcs[i % srcs.size()]); });
    set_bytes(state, bytes);
}

struct SampleCase {
    float temperature;
    int top_k;
    float top_p;
};

void bench_sample(benchmark::State &state, Device dev, DType dtype, SampleCase c) {
    if (!sampling_device_ok(state, dev)) return;
    const Tensor logits = sampling_random({1, kSamplingVocab}, dtype, dev, 3.f, 2);
    const Tensor out = Tensor::empty({1}, DType::I64, dev);
    const Tensor t = Tensor::empty({1}, DType::F32).fill_(c.temperature).to(dev);
    const Tensor k = Tensor::empty({1}, DType::I32).fill_(c.top_k).to(dev);
    const Tensor p = Tensor::empty({1}, DType::F32).fill_(c.top_p).to(dev);
    const Tensor min_p = Tensor::zeros({1}, DType::F32, dev);
    uint64_t offset = 0;
    sampling_timed(state, dev, [&](size_t) { ops::sample(out, logits, t, k, p, min_p, 1234, offset++); });
    set_bytes(state, double(kSamplingVocab) * double(dtype_size(dtype)));
}

// rows x 151936 bf16 at temperature 0.6 (a sampled batch step's call), Normal(0, sd) logits (0.78: a random
// model of the 1.5B shape's, whose steps take HF's default top_k 50), cold copies of the logits as
// bench_argmax's batch rows.
void bench_sample_rows(benchmark::State &state, Device dev, int64_t rows, float sd, int top_k, float top_p) {
    if (!sampling_device_ok(state, dev)) return;
    const double bytes = double(rows) * double(kSamplingVocab) * 2.0;
    std::vector<Tensor> xs;
    for (int64_t i = 0, sets = llaisys::bench::cold_sets(bytes, dev); i < sets; ++i)
        xs.push_back(sampling_random({rows, kSamplingVocab}, DType::BF16, dev, sd, uint32_t(1 + i)));
    const Tensor out = Tensor::empty({rows}, DType::I64, dev);
    const Tensor t = Tensor::empty({rows}, DType::F32).fill_(0.6f).to(dev);
    const Tensor k = Tensor::empty({rows}, DType::I32).fill_(top_k).to(dev);
    const Tensor p = Tensor::empty({rows}, DType::F32).fill_(top_p).to(dev);
    const Tensor min_p = Tensor::zeros({rows}, DType::F32, dev);
    uint64_t offset = 0;
    sampling_timed(state, dev, [&](size_t i) { ops::sample(out, xs[i % xs.size()], t, k, p, min_p, 1234, offset++); });
    set_bytes(state, bytes);
}

// Rows of the full 151936-row table at random ids; on CUDA each set of ids and outputs is distinct, so
// neither the rows read nor the outputs sit in L2 between calls.
void bench_embedding(benchmark::State &state, Device dev, int64_t n, int64_t D) {
    if (!sampling_device_ok(state, dev)) return;
    const int64_t rows = dev.is_cpu() ? 32768 : kSamplingVocab; // the copy cost does not depend on it
    const Tensor weight = Tensor::zeros({rows, D}, DType::BF16, dev);
    const double bytes = 2.0 * double(n) * double(D) * 2.0 + double(n) * 8.0;
    std::mt19937 gen(3);
    std::vector<Tensor> ids, outs;
    for (int64_t s = 0, sets = llaisys::bench::cold_sets(bytes, dev); s < sets; ++s) {
        Tensor ids_host = Tensor::empty({n}, DType::I64);
        for (int64_t i = 0; i < n; ++i) ids_host.data_as<int64_t>()[i] = int64_t(gen() % rows);
        ids.push_back(ids_host.to(dev));
        outs.push_back(Tensor::empty({n, D}, DType::BF16, dev));
    }
    sampling_timed(state, dev, [&](size_t i) { ops::embedding(outs[i % outs.size()], ids[i % ids.size()], weight); });
    set_bytes(state, bytes);
}

int register_sampling_benchmarks() {
    struct Dev {
        const char *name;
        Device device;
    };
    std::vector<Dev> devs = {{"cpu", Device::cpu()}};
#ifdef LLAISYS_WITH_CUDA
    devs.push_back({"cuda", Device::cuda(0)});
#endif
    const SampleCase cases[] = {{0.7f, 50, 0.9f}, {1.f, 0, 1.f}, {1.f, 0, 0.9f}};
    const char *case_names[] = {"top_k:50/top_p:0.9", "plain", "top_p:0.9"};
    for (const Dev &d : devs) {
        auto reg = [&](const std::string &name, auto fn, auto... args) {
            auto *b = benchmark::RegisterBenchmark((name + "/" + d.name).c_str(), fn, d.device, args...)
                          ->Unit(benchmark::kMicrosecond);
            if (d.device.is_cuda()) b->UseManualTime()->Iterations(50); // each also runs the ~0.3 ms filler
            else b->UseRealTime();
        };
        for (DType dt : {DType::F32, DType::BF16})
            reg(std::string("Argmax/") + dtype_name(dt) + "/V:151936", bench_argmax, dt, int64_t(1), false);
        for (int64_t rows : {4, 64, 256})
            if (rows == 4 || d.device.is_cuda())
                reg("Argmax/bf16/rows:" + std::to_string(rows) + "/V:151936", bench_argmax, DType::BF16, rows, false);
        if (d.device.is_cuda())
            for (int64_t rows : {1, 4, 64, 256}) {
                const std::string r = "/bf16/rows:" + std::to_string(rows) + "/V:151936";
                reg("Argmax/graph" + r, bench_argmax, DType::BF16, rows, true);
                if (rows >= 64) reg("CopySameBytes/argmax" + r, bench_argmax_copy, rows);
            }
        for (DType dt : {DType::F32, DType::BF16})
            reg(std::string("Sample/") + dtype_name(dt) + "/V:151936/" + case_names[0], bench_sample, dt, cases[0]);
        for (int c = 1; c < 3; ++c) // plain temperature; top_p alone (the slow path on these flat logits)
            reg(std::string("Sample/bf16/V:151936/") + case_names[c], bench_sample, DType::BF16, cases[c]);
        if (d.device.is_cuda())
            for (int64_t rows : {64, 256}) {
                const std::string r = "Sample/bf16/rows:" + std::to_string(rows) + "/V:151936/t:0.6";
                reg(r + "/sd:3", bench_sample_rows, rows, 3.f, 0, 1.f);
                reg(r + "/sd:0.78", bench_sample_rows, rows, 0.78f, 0, 1.f);
                reg(r + "/sd:0.78/top_k:50", bench_sample_rows, rows, 0.78f, 50, 1.f);
                reg(r + "/sd:3/top_k:20/top_p:0.8", bench_sample_rows, rows, 3.f, 20, 0.8f);
            }
        for (int64_t n : {1, 512, 2048, 8192})
            for (int64_t D : {896, 1536})
                if (n <= 512 || d.device.is_cuda())
                reg("Embedding/bf16/n:" + std::to_string(n) + "/D:" + std::to_string(D), bench_embedding, n, D);
    }
    return 0;
}

const int sampling_benchmarks_registered = register_sampling_benchmarks();

} // namespace
