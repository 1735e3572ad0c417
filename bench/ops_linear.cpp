// linear at the Qwen2 shapes: decode (M = 1) is bound by streaming the weight and is read in GB/s
// (weight + x + out bytes); prefill (M = 64 on the CPU, 512 and 2048 on CUDA) in TFLOP/s (2 M N K).
// LinearSwiglu/... is the fused MLP gate/up projection + SwiGLU at decode (weight [2I, K], out [M, I]),
// read the same way; the unfused path is two Linear/.../N:I calls and a swiglu. LinearGeglu/... is the same
// with Gemma 3's tanh GeGLU, LinearGelu/... a plain MLP's up projection with its bias and erf GELU (GPT-NeoX):
// against Linear/... of the same K and N, what the epilogue costs over the GEMV it replaces a kernel beside.
// Compare with the ceilings in ops_ceilings.cpp (device copy bandwidth, cuBLAS GEMM peak, CPU memory).
//
// Each iteration cycles through enough copies of the weight (>= 256 MiB in all) that they cannot sit
// in the CPU's L3 or the GPU's L2 between calls, as in a real forward pass where every layer has its
// own weights. CUDA iterations time a batch of back-to-back calls with events, so the host's wait
// does not count; Linear/cuda_graph/... replays the calls from a CUDA graph, so launch costs do not
// either (what a decode step captured in a graph sees).
#include "bench_timing.hpp"
#include "llaisys/ops.hpp"
#include "llaisys/stream.hpp"
#include "llaisys/tensor.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <string>
#include <vector>

namespace {

using namespace llaisys;

// linear; linear_swiglu / linear_geglu (tanh): out [M, N / 2] from the gate and up halves; linear_gelu
// (erf, with a bias of N).
enum class Epi { plain, swiglu, geglu, gelu };

struct LinearCase {
    int64_t M, K, N; // N: weight rows (2I for linear_swiglu / linear_geglu)
    Epi epi = Epi::plain;
};

bool gated(const LinearCase &c) { return c.epi == Epi::swiglu || c.epi == Epi::geglu; }
int64_t out_cols(const LinearCase &c) { return gated(c) ? c.N / 2 : c.N; }

// The weights are written before timing (the device synchronized after) and then only read, as a
// model's are: constant_weight, which the Qwen2 model passes too. bias: [N] for linear_gelu, else undefined.
void run_case(const LinearCase &c, const Tensor &out, const Tensor &x, const Tensor &w, const Tensor &bias) {
    switch (c.epi) {
    case Epi::swiglu: return ops::linear_swiglu(out, x, w, /*constant_weight=*/true);
    case Epi::geglu: return ops::linear_geglu(out, x, w, /*tanh_approx=*/true, /*constant_weight=*/true);
    case Epi::gelu: return ops::linear_gelu(out, x, w, bias, /*tanh_approx=*/false, /*constant_weight=*/true);
    case Epi::plain: return ops::linear(out, x, w, Tensor(), /*constant_weight=*/true);
    }
}

Tensor bias_of(const LinearCase &c, DType dtype, Device device) {
    return c.epi == Epi::gelu ? Tensor::empty({c.N}, dtype).fill_(0.01).to(device) : Tensor();
}

// Copies of a [N, K] weight filling at least 256 MiB (at most 256 copies).
std::vector<Tensor> linear_weight_copies(int64_t N, int64_t K, DType dtype, Device device) {
    const int64_t bytes = N * K * int64_t(dtype_size(dtype)), want = int64_t(256) << 20;
    const int64_t copies = std::min<int64_t>(256, (want + bytes - 1) / bytes);
    Tensor host = Tensor::empty({N, K}, dtype).fill_(0.01);
    std::vector<Tensor> ws;
    for (int64_t i = 0; i < copies; ++i) ws.push_back(device.is_cpu() ? host.clone() : host.to(device));
    return ws;
}

void set_linear_counters(benchmark::State &state, const LinearCase &c, DType dtype) {
    const double es = double(dtype_size(dtype));
    const double bytes = (double(c.N) * c.K + double(c.M) * c.K + double(c.M) * out_cols(c)) * es;
    const double flops = 2.0 * c.M * c.N * c.K;
    state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
    state.counters["TFLOP/s"] = benchmark::Counter(flops * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
}

void bench_linear_cpu(benchmark::State &state, LinearCase c, DType dtype) {
    const Tensor x = Tensor::empty({c.M, c.K}, dtype).fill_(0.5);
    const Tensor out = Tensor::empty({c.M, out_cols(c)}, dtype), bias = bias_of(c, dtype, Device::cpu());
    const std::vector<Tensor> ws = linear_weight_copies(c.N, c.K, dtype, Device::cpu());
    size_t i = 0;
    for (auto _ : state) {
        run_case(c, out, x, ws[i++ % ws.size()], bias);
        benchmark::ClobberMemory();
    }
    set_linear_counters(state, c, dtype);
}

#ifdef LLAISYS_WITH_CUDA
void bench_linear_cuda(benchmark::State &state, LinearCase c, DType dtype) {
    if (cuda_device_count() == 0) return state.SkipWithError("no CUDA device visible");
    const Device dev = Device::cuda(0);
    DeviceGuard guard(dev);
    const Tensor x = Tensor::empty({c.M, c.K}, dtype).fill_(0.5).to(dev);
    const Tensor out = Tensor::empty({c.M, out_cols(c)}, dtype, dev), bias = bias_of(c, dtype, dev);
    const std::vector<Tensor> ws = linear_weight_copies(c.N, c.K, dtype, dev);
    synchronize(dev);
    const Stream stream = current_stream(dev);
    const int batch = 16;
    size_t i = 0;
    for (int w = 0; w < 3; ++w) run_case(c, out, x, ws[i++ % ws.size()], bias); // warm-up (handles, workspace)
    Event start(dev, true), stop(dev, true);
    for (auto _ : state) {
        start.record(stream);
        for (int b = 0; b < batch; ++b) run_case(c, out, x, ws[i++ % ws.size()], bias);
        stop.record(stream);
        stop.synchronize();
        state.SetIterationTime(double(start.elapsed_ms(stop)) * 1e-3 / batch);
    }
    set_linear_counters(state, c, dtype);
}

// The same calls captured in a CUDA graph and replayed, so the host's launch cost (several us per
// call, more than a small GEMV takes) drops out and the kernel's own bandwidth shows. One replay
// runs over >= 128 MiB of distinct weights, so they cannot stay in L2 between replays.
void bench_linear_cuda_graph(benchmark::State &state, LinearCase c, DType dtype) {
    if (cuda_device_count() == 0) return state.SkipWithError("no CUDA device visible");
    const Device dev = Device::cuda(0);
    DeviceGuard guard(dev);
    const Tensor x = Tensor::empty({c.M, c.K}, dtype).fill_(0.5).to(dev);
    const Tensor out = Tensor::empty({c.M, out_cols(c)}, dtype, dev), bias = bias_of(c, dtype, dev);
    const std::vector<Tensor> ws = linear_weight_copies(c.N, c.K, dtype, dev);
    synchronize(dev);
    const int64_t w_bytes = c.N * c.K * int64_t(dtype_size(dtype));
    const int64_t want = std::max<int64_t>(16, ((int64_t(128) << 20) + w_bytes - 1) / w_bytes);
    const int batch = int(std::min<int64_t>(want, int64_t(ws.size())));
    llaisys::bench::time_graph_replays(state, dev, batch,
                                       [&](int b) { run_case(c, out, x, ws[size_t(b) % ws.size()], bias); });
    set_linear_counters(state, c, dtype);
}
#endif

// The 0.5B (hidden 896, MLP 4864) and 1.5B (hidden 1536, MLP 8960, k/v 256) projections and LM heads;
// 896->1152 and 1536->2048 are the fused q/k/v projections the CUDA model runs.
const std::vector<std::pair<int64_t, int64_t>> kLinearKN = {
    {896, 896}, {896, 128}, {896, 1152}, {896, 4864}, {896, 151936}, {4864, 896},
    {1536, 1536}, {1536, 256}, {1536, 2048}, {1536, 8960}, {1536, 151936}, {8960, 1536},
};

// A fixed count of timed batches per CUDA case: the adaptive count, sized on the per-call time (a few
// us), would repeat a ~0.2 ms host round trip tens of thousands of times.
constexpr int kCudaIterations = 200;

std::string linear_name(const char *device, DType dtype, const LinearCase &c) {
    const char *op = c.epi == Epi::swiglu ? "LinearSwiglu/" : c.epi == Epi::geglu ? "LinearGeglu/"
                     : c.epi == Epi::gelu ? "LinearGelu/" : "Linear/";
    return std::string(op) + device + "/" + dtype_name(dtype) + "/M:" + std::to_string(c.M) + "/K:" +
           std::to_string(c.K) + (gated(c) ? "/I:" : "/N:") + std::to_string(out_cols(c));
}

int register_linear_benchmarks() {
    for (const auto &[K, N] : kLinearKN) {
        // CPU: decode in bf16 (and f32 for two shapes), and one short prefill (M = 64, the small shapes).
        for (int64_t M : {1, 64}) {
            const LinearCase c{M, K, N};
            if (M > 1 && N > 10000) continue; // an LM head over a whole prompt takes seconds on 2 cores
            benchmark::RegisterBenchmark(linear_name("cpu", DType::BF16, c).c_str(), bench_linear_cpu, c, DType::BF16)
                ->Unit(benchmark::kMicrosecond)->UseRealTime();
            if (M == 1 && (N == 4864 || N == 1536) && K != 8960)
                benchmark::RegisterBenchmark(linear_name("cpu", DType::F32, c).c_str(), bench_linear_cpu, c, DType::F32)
                    ->Unit(benchmark::kMicrosecond)->UseRealTime();
        }
#ifdef LLAISYS_WITH_CUDA
        for (int64_t M : {1, 64, 256, 512, 2048}) { // 64 and 256: decode batches (the GEMMs cuBLASLt's choice is timed for)
            const LinearCase c{M, K, N};
            benchmark::RegisterBenchmark(linear_name("cuda", DType::BF16, c).c_str(), bench_linear_cuda, c, DType::BF16)
                ->Unit(benchmark::kMicrosecond)->UseManualTime()->Iterations(kCudaIterations);
            if ((N == 1536 || N == 4864) && (M == 1 || M >= 512))
                benchmark::RegisterBenchmark(linear_name("cuda", DType::F32, c).c_str(), bench_linear_cuda, c, DType::F32)
                    ->Unit(benchmark::kMicrosecond)->UseManualTime()->Iterations(kCudaIterations);
        }
        // decode without launch costs; M 2-8: the GEMV's other instantiations; 64 and 256: cuBLASLt at the batch
        // sizes of a decode graph (what LLAISYS_GEMM_TUNE's choice is for), weights cold as in a step
        for (int64_t M : {1, 2, 4, 8, 64, 256}) {
            const LinearCase c{M, K, N};
            if (M == 1 || M >= 64 || (K == 1536 && N == 8960))
                benchmark::RegisterBenchmark(linear_name("cuda_graph", DType::BF16, c).c_str(), bench_linear_cuda_graph,
                                             c, DType::BF16)->Unit(benchmark::kMicrosecond)->UseManualTime()
                    ->Iterations(kCudaIterations);
        }
#endif
    }
#ifdef LLAISYS_WITH_CUDA
    // The 0.5B and 1.5B MLP gate/up + SwiGLU at decode (K = hidden, I = MLP width), launched and replayed.
    // Gemma-3-1B's gate/up + GeGLU (1152 -> 2 x 6912) and Pythia-1.4B's up + bias + GELU (2048 -> 8192), each
    // beside the plain GEMV of the same weight.
    const std::vector<LinearCase> mlp = {{1, 896, 2 * 4864, Epi::swiglu}, {1, 1536, 2 * 8960, Epi::swiglu},
                                         {1, 1152, 2 * 6912, Epi::geglu}, {1, 1152, 2 * 6912},
                                         {1, 2048, 8192, Epi::gelu},      {1, 2048, 8192}};
    // The 0.5B and 1.5B gate/up + SwiGLU at decode batches of 64 and 256 rows (cuBLASLt, then swiglu), replayed:
    // LLAISYS_GATED_GEMM=halves against the default's one batched launch.
    for (int64_t M : {64, 256})
        for (const LinearCase &c : {LinearCase{M, 896, 2 * 4864, Epi::swiglu}, LinearCase{M, 1536, 2 * 8960, Epi::swiglu}})
            benchmark::RegisterBenchmark(linear_name("cuda_graph", DType::BF16, c).c_str(), bench_linear_cuda_graph, c,
                                         DType::BF16)->Unit(benchmark::kMicrosecond)->UseManualTime()
                ->Iterations(kCudaIterations);
    // The other families' decode projections at M = 1, replayed (issue 29's share of copy roofline): Pythia-1.4B's
    // q/k/v (2048 -> 6144), dense, down (8192 -> 2048) and LM head; Gemma-3-1B's q/k/v (1152 -> 1536), o, down
    // and LM head (1152 -> 262144)
    for (const auto &[K, N] : std::vector<std::pair<int64_t, int64_t>>{
             {2048, 6144}, {2048, 2048}, {8192, 2048}, {2048, 50304}, {1152, 1536}, {1024, 1152}, {6912, 1152},
             {1152, 262144}})
        benchmark::RegisterBenchmark(linear_name("cuda_graph", DType::BF16, LinearCase{1, K, N}).c_str(),
                                     bench_linear_cuda_graph, LinearCase{1, K, N}, DType::BF16)
            ->Unit(benchmark::kMicrosecond)->UseManualTime()->Iterations(kCudaIterations);
    for (const LinearCase &c : mlp) {
        if (c.epi == Epi::swiglu)
            benchmark::RegisterBenchmark(linear_name("cuda", DType::BF16, c).c_str(), bench_linear_cuda, c, DType::BF16)
                ->Unit(benchmark::kMicrosecond)->UseManualTime()->Iterations(kCudaIterations);
        benchmark::RegisterBenchmark(linear_name("cuda_graph", DType::BF16, c).c_str(), bench_linear_cuda_graph, c,
                                     DType::BF16)->Unit(benchmark::kMicrosecond)->UseManualTime()->Iterations(kCudaIterations);
    }
#endif
    return 0;
}

const int linear_benchmarks_registered = register_linear_benchmarks();

} // namespace
