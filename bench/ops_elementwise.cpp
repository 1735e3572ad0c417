// The memory-bound ops of a Qwen2 layer in bf16 at decode (1 row) and prefill shapes (512 and 2048 rows
// on CUDA, plus 8192 to show the streaming rate past the fixed per-kernel cost; 64 rows on the CPU):
// rms_norm and add_rms_norm (hidden 896 and 1536), rope in place on q and k (14/2 heads x 64 and 12/2
// heads x 128), swiglu (ffn 4864 and 8960). GB/s counts the bytes each call must read and write; compare
// with the device copy bandwidth (the Ceiling benchmarks; about 2.98 TB/s for a 256 MiB copy on an H100
// SXM) - the target is >= 60% of it where the tensors fill the chip. Each CUDA call also costs a fixed
// ~2 us (launch to launch, measured at 1 row), which caps the 2048-row shapes. CopySameBytes/cuda/...
// copies the bytes rms_norm moves at the same shape (one cudaMemcpyAsync): what a plain copy reaches at
// that size, i.e. whether the tensor is large enough to fill the chip.
//
// Like a real forward pass, where every layer has its own activations, CUDA iterations cycle through
// enough independent buffer sets (>= 256 MiB in all, at most 64 sets) that they do not sit in L2 between
// calls. They time a batch of back-to-back calls with events, and a large filler op runs first so that
// the host has enqueued the whole batch before the GPU reaches it: the time is the kernels' own, as a
// CUDA graph replays them, not the host's launch cost (a few us per call, more than a small kernel).
#include "bench_timing.hpp"
#include "llaisys/ops.hpp"
#include "llaisys/stream.hpp"
#include "llaisys/tensor.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

namespace {

using namespace llaisys;

// One call of an op on its own buffers, and the bytes a call reads plus writes.
struct ElemJob {
    std::vector<std::function<void()>> calls;
    double bytes = 0;
};

Tensor elem_filled(const Shape &shape, double value, Device device) {
    const Tensor host = Tensor::empty(shape, DType::BF16).fill_(value);
    return device.is_cpu() ? host : host.to(device);
}

ElemJob rms_norm_job(int64_t rows, int64_t D, bool fused, Device device) {
    ElemJob job;
    job.bytes = (fused ? 4.0 : 2.0) * double(rows * D) * 2 + double(D) * 2; // bf16; + weight
    const Tensor w = elem_filled({D}, 1.0, device);
    for (int64_t s = 0, n = llaisys::bench::cold_sets(job.bytes, device); s < n; ++s) {
        Tensor x = elem_filled({rows, D}, 0.5, device), out = Tensor::empty({rows, D}, DType::BF16, device);
        if (!fused) {
            job.calls.push_back([=] { ops::rms_norm(out, x, w, 1e-6f); });
            continue;
        }
        Tensor res = elem_filled({rows, D}, 0.25, device);
        job.calls.push_back([=] { ops::add_rms_norm(out, res, x, w, 1e-6f); });
    }
    return job;
}

// In place, as the model applies it to q and to k.
ElemJob rope_job(int64_t seq, int64_t heads, int64_t hd, Device device) {
    ElemJob job;
    job.bytes = 2.0 * double(seq * heads * hd) * 2 + double(seq) * 8; // bf16 x in and out; i64 positions
    Tensor pos_host = Tensor::empty({seq}, DType::I64);
    for (int64_t i = 0; i < seq; ++i) pos_host.data_as<int64_t>()[i] = 1000 + i;
    const Tensor pos = device.is_cpu() ? pos_host : pos_host.to(device);
    for (int64_t s = 0, n = llaisys::bench::cold_sets(job.bytes, device); s < n; ++s) {
        Tensor x = elem_filled({seq, heads, hd}, 0.5, device);
        job.calls.push_back([=] { ops::rope(x, x, pos, 1e6f); });
    }
    return job;
}

ElemJob swiglu_job(int64_t rows, int64_t ffn, Device device) {
    ElemJob job;
    job.bytes = 3.0 * double(rows * ffn) * 2; // gate, up in; out
    for (int64_t s = 0, n = llaisys::bench::cold_sets(job.bytes, device); s < n; ++s) {
        Tensor gate = elem_filled({rows, ffn}, 0.5, device), up = elem_filled({rows, ffn}, 0.25, device);
        Tensor out = Tensor::empty({rows, ffn}, DType::BF16, device);
        job.calls.push_back([=] { ops::swiglu(out, gate, up); });
    }
    return job;
}

// LayerNorm of GPT-NeoX (H 2048: pythia-1.4b; 2560: pythia-2.8b), with bias, in three forms: layer_norm
// alone; add_layer_norm(residual, attn, mlp) - the parallel residual and the next layer's norm in one pass;
// and the unfused sequence it replaces (add, add, layer_norm). The fused and unfused forms count the same
// bytes (what the fused op must move: residual, delta and delta2 in, residual and out back), so their GB/s
// ratio is their speed ratio.
enum class LnForm { Plain, Fused, Unfused };

ElemJob layer_norm_job(int64_t rows, int64_t H, LnForm form, Device device) {
    ElemJob job;
    job.bytes = (form == LnForm::Plain ? 2.0 : 5.0) * double(rows * H) * 2 + 2.0 * double(H) * 2; // + w, b
    const Tensor w = elem_filled({H}, 1.0, device), b = elem_filled({H}, 0.125, device);
    for (int64_t s = 0, n = llaisys::bench::cold_sets(job.bytes, device); s < n; ++s) {
        Tensor x = elem_filled({rows, H}, 0.5, device), out = Tensor::empty({rows, H}, DType::BF16, device);
        if (form == LnForm::Plain) {
            job.calls.push_back([=] { ops::layer_norm(out, x, w, b, 1e-5f); });
            continue;
        }
        // x stands for the attention output, d2 for the MLP's; x + d2 = 0 keeps the residual at 0.25 however
        // many calls run.
        Tensor res = elem_filled({rows, H}, 0.25, device), d2 = elem_filled({rows, H}, -0.5, device);
        if (form == LnForm::Fused) {
            job.calls.push_back([=] { ops::add_layer_norm(out, res, x, d2, w, b, 1e-5f); });
            continue;
        }
        job.calls.push_back([=] {
            ops::add(res, res, x);
            ops::add(res, res, d2);
            ops::layer_norm(out, res, w, b, 1e-5f);
        });
    }
    return job;
}

// A contiguous copy of the same bytes as rms_norm reads and writes at [rows, D] (rearrange of a
// contiguous tensor is one cudaMemcpyAsync): what the copy engine path itself reaches at this size,
// next to the 1 GiB ceiling.
ElemJob copy_job(int64_t rows, int64_t D, Device device) {
    ElemJob job;
    job.bytes = 2.0 * double(rows * D) * 2;
    for (int64_t s = 0, n = llaisys::bench::cold_sets(job.bytes, device); s < n; ++s) {
        Tensor x = elem_filled({rows, D}, 0.5, device), out = Tensor::empty({rows, D}, DType::BF16, device);
        job.calls.push_back([=] { ops::rearrange(out, x); });
    }
    return job;
}

using ElemMaker = std::function<ElemJob(Device)>;

void elem_counters(benchmark::State &state, const ElemJob &job) {
    state.counters["GB/s"] = benchmark::Counter(job.bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void bench_elem_cpu(benchmark::State &state, ElemMaker make) {
    const ElemJob job = make(Device::cpu());
    size_t i = 0;
    for (auto _ : state) {
        job.calls[i++ % job.calls.size()]();
        benchmark::ClobberMemory();
    }
    elem_counters(state, job);
}

#ifdef LLAISYS_WITH_CUDA
void bench_elem_cuda(benchmark::State &state, ElemMaker make) {
    if (cuda_device_count() == 0) return state.SkipWithError("no CUDA device visible");
    const Device dev = Device::cuda(0);
    DeviceGuard guard(dev);
    const ElemJob job = make(dev);
    // ~0.3 ms of device work (768 MB moved) covers the host's enqueueing of 20 calls.
    llaisys::bench::time_filled_batches(state, dev, 20, int64_t(64) << 20,
                                        [&](size_t i) { job.calls[i % job.calls.size()](); });
    elem_counters(state, job);
}
#endif

void register_elem(const std::string &name, bool cuda, ElemMaker make) {
    if (!cuda) {
        benchmark::RegisterBenchmark(name.c_str(), bench_elem_cpu, make)->Unit(benchmark::kMicrosecond)->UseRealTime();
        return;
    }
#ifdef LLAISYS_WITH_CUDA
    // A fixed count: each iteration also runs the filler (~0.3 ms), which an adaptive count sized on
    // the (us-long) manual time would repeat thousands of times.
    benchmark::RegisterBenchmark(name.c_str(), bench_elem_cuda, make)
        ->Unit(benchmark::kMicrosecond)->UseManualTime()->Iterations(50);
#endif
}

int register_elementwise_benchmarks() {
    for (bool cuda : {false, true}) {
        const std::string dev = cuda ? "cuda" : "cpu";
        const std::vector<int64_t> rows = cuda ? std::vector<int64_t>{1, 512, 2048, 8192} : std::vector<int64_t>{1, 64};
        for (int64_t R : rows) {
            const std::string r = "/bf16/rows:" + std::to_string(R);
            for (int64_t D : {896, 1536}) {
                const std::string d = "/D:" + std::to_string(D);
                register_elem("RmsNorm/" + dev + r + d, cuda, [=](Device v) { return rms_norm_job(R, D, false, v); });
                register_elem("AddRmsNorm/" + dev + r + d, cuda, [=](Device v) { return rms_norm_job(R, D, true, v); });
                if (cuda) register_elem("CopySameBytes/" + dev + r + d, cuda, [=](Device v) { return copy_job(R, D, v); });
            }
            for (auto [heads, hd] : {std::pair<int64_t, int64_t>{14, 64}, {2, 64}, {12, 128}, {2, 128}}) {
                const std::string h = "/heads:" + std::to_string(heads) + "/hd:" + std::to_string(hd);
                register_elem("Rope/" + dev + r + h, cuda, [=](Device v) { return rope_job(R, heads, hd, v); });
            }
            for (int64_t ffn : {4864, 8960}) {
                const std::string f = "/ffn:" + std::to_string(ffn);
                register_elem("Swiglu/" + dev + r + f, cuda, [=](Device v) { return swiglu_job(R, ffn, v); });
            }
        }
    }
    for (bool cuda : {false, true}) { // LayerNorm, fused against unfused (layer_norm_job)
        const std::string dev = cuda ? "cuda" : "cpu";
        const std::vector<int64_t> rows = cuda ? std::vector<int64_t>{1, 512, 2048, 8192} : std::vector<int64_t>{1, 64};
        for (int64_t R : rows)
            for (int64_t H : {2048, 2560}) {
                const std::string rh = "/bf16/rows:" + std::to_string(R) + "/H:" + std::to_string(H);
                register_elem("LayerNorm/" + dev + rh, cuda, [=](Device v) { return layer_norm_job(R, H, LnForm::Plain, v); });
                register_elem("AddLayerNorm2/fused/" + dev + rh, cuda,
                              [=](Device v) { return layer_norm_job(R, H, LnForm::Fused, v); });
                register_elem("AddLayerNorm2/unfused/" + dev + rh, cuda,
                              [=](Device v) { return layer_norm_job(R, H, LnForm::Unfused, v); });
            }
    }
    return 0;
}

const int elementwise_benchmarks_registered = register_elementwise_benchmarks();

} // namespace
