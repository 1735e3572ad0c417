// CPU quantized linear (cpp/ops/quant_linear) at the Qwen2 decode shapes, next to the bf16 linear on
// the same shapes, read in GB/s of weight bytes (what bounds decode): N * row_bytes for a quantized
// matrix, N * K * 2 for bf16. The K-quants need K % 256 == 0, so Q4_K/Q6_K run the 0.5B down projection
// (4864 -> 896) and the 1.5B shapes; Q5_0/Q8_0 run the 0.5B ones (as the Q4_K_M file stores them).
// QuantLinear/<fmt>/<path>/... forces a CPU path (portable, avx2, avx512vnni) to show what each pays.
//
// Each case cycles through distinct copies of its weight (>= 256 MiB in all), so no copy sits in the
// L3 between calls, as in a forward pass where every layer has its own weights.
//
// QuantLinear/cuda_graph/... (CUDA builds): the GEMV on the 1.5B Q4_K_M shapes (Q4_K q/k/v, gate/up,
// down; Q6_K down and LM head) and the fused gate/up + SwiGLU, two 0.5B shapes (Q5_0, Q8_0), at M = 1
// and a few at M = 8, bf16 x, replayed from a CUDA graph over distinct device copies (>= 256 MiB,
// bench_timing.hpp's cold_sets) so L2 holds none of them. GB/s counts the weight bytes; quantizing x
// (in the GEMV at M = 1, a kernel ahead of it at M = 8) is included.
#include "bench_timing.hpp"
#include "llaisys/ops.hpp"
#include "llaisys/quant.hpp"
#include "llaisys/tensor.hpp"
#include "llaisys/thread_pool.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <string>
#include <tuple>
#include <vector>

namespace {

using namespace llaisys;

constexpr int64_t kColdBytes = int64_t(256) << 20;

int64_t copies_for(int64_t bytes) { return std::clamp<int64_t>((kColdBytes + bytes - 1) / bytes, 1, 512); }

// Offsets of the f16 scales (d, dmin) in a block: set to 0.01 so the random bytes decode to finite,
// normal floats (subnormals or NaNs would time something else).
std::vector<int> scale_offsets(QuantFormat f) {
    switch (f) {
    case QuantFormat::Q4_K:
    case QuantFormat::Q5_K: return {0, 2};
    case QuantFormat::Q6_K: return {208};
    default: return {0};
    }
}

QuantMatrix random_matrix(QuantFormat f, int64_t N, int64_t K) {
    const QuantFormatInfo &info = quant_format_info(f);
    Tensor bytes = Tensor::empty({N, quant_row_bytes(f, K)}, DType::U8);
    uint8_t *p = bytes.data_as<uint8_t>();
    uint64_t s = 0x9E3779B97F4A7C15ull;
    for (int64_t i = 0; i < bytes.numel(); ++i) { // xorshift64: random codes and sub-block scales
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        p[i] = uint8_t(s >> 56);
    }
    const uint16_t d = 0x211F; // 0.01 in f16
    for (int64_t b = 0; b < bytes.numel() / info.block_bytes; ++b)
        for (int off : scale_offsets(f)) std::memcpy(p + b * info.block_bytes + off, &d, 2);
    return QuantMatrix(f, N, K, bytes);
}

void bench_quant(benchmark::State &state, QuantFormat f, QuantCpuPath path, int64_t M, int64_t K, int64_t N) {
    if (!quant_cpu_path_supported(path)) return state.SkipWithError("this CPU cannot run the path");
    set_quant_cpu_path(path);
    const QuantMatrix w0 = random_matrix(f, N, K);
    std::vector<QuantMatrix> ws;
    for (int64_t i = 0; i < copies_for(w0.nbytes()); ++i) ws.push_back(QuantMatrix(f, N, K, w0.bytes().clone()));
    const Tensor x = Tensor::empty({M, K}, DType::BF16).fill_(0.5), out = Tensor::empty({M, N}, DType::BF16);
    size_t i = 0;
    for (auto _ : state) {
        ops::quant_linear(out, x, ws[i++ % ws.size()], Tensor());
        benchmark::ClobberMemory();
    }
    set_quant_cpu_path(QuantCpuPath::Auto);
    state.counters["GB/s"] = benchmark::Counter(double(w0.nbytes()) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void bench_bf16(benchmark::State &state, int64_t M, int64_t K, int64_t N) {
    const Tensor w0 = Tensor::empty({N, K}, DType::BF16).fill_(0.01);
    const int64_t bytes = N * K * 2;
    std::vector<Tensor> ws;
    for (int64_t i = 0; i < copies_for(bytes); ++i) ws.push_back(w0.clone());
    const Tensor x = Tensor::empty({M, K}, DType::BF16).fill_(0.5), out = Tensor::empty({M, N}, DType::BF16);
    size_t i = 0;
    for (auto _ : state) {
        ops::linear(out, x, ws[i++ % ws.size()], Tensor());
        benchmark::ClobberMemory();
    }
    state.counters["GB/s"] = benchmark::Counter(double(bytes) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// The ceiling for the rows above: reading the same number of bytes (cold copies, as bench_quant) on the
// pool's threads, 32-byte loads OR-ed together, split into as many tasks as quant_linear uses.
#if defined(__x86_64__)
__attribute__((target("avx2"))) uint64_t read_bytes(const uint8_t *p, int64_t n) {
    __m256i a = _mm256_setzero_si256(), b = a;
    int64_t i = 0;
    for (; i + 64 <= n; i += 64)
        a = _mm256_or_si256(a, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p + i))),
        b = _mm256_or_si256(b, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(p + i + 32)));
    a = _mm256_or_si256(a, b);
    uint64_t r = uint64_t(_mm256_extract_epi64(a, 0) | _mm256_extract_epi64(a, 1) | _mm256_extract_epi64(a, 2) |
                          _mm256_extract_epi64(a, 3));
    for (; i < n; ++i) r |= p[i];
    return r;
}
#else
uint64_t read_bytes(const uint8_t *p, int64_t n) {
    uint64_t r = 0;
    for (int64_t i = 0; i < n; ++i) r |= p[i];
    return r;
}
#endif

void bench_read(benchmark::State &state, int64_t bytes) {
    std::vector<Tensor> ws;
    for (int64_t i = 0; i < copies_for(bytes); ++i) ws.push_back(Tensor::empty({bytes}, DType::U8).fill_(1));
    const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(8 * cpu_threads(), bytes >> 14));
    size_t i = 0;
    std::atomic<uint64_t> sink{0};
    for (auto _ : state) {
        const uint8_t *p = ws[i++ % ws.size()].data_as<uint8_t>();
        parallel_tasks(tasks, [&](int64_t t) {
            const int64_t b = bytes * t / tasks & ~int64_t(63), e = t + 1 == tasks ? bytes : bytes * (t + 1) / tasks & ~int64_t(63);
            sink.fetch_or(read_bytes(p + b, e - b), std::memory_order_relaxed);
        });
    }
    benchmark::DoNotOptimize(sink.load());
    state.counters["GB/s"] = benchmark::Counter(double(bytes) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

#ifdef LLAISYS_WITH_CUDA
// One call per device copy of the weight (N rows: linear; 2N rows: linear_swiglu into N outputs).
void bench_quant_cuda(benchmark::State &state, QuantFormat f, int64_t M, int64_t K, int64_t N, bool swiglu) {
    if (cuda_device_count() == 0) return state.SkipWithError("no CUDA device visible");
    const Device dev = Device::cuda(0);
    DeviceGuard guard(dev);
    const QuantMatrix w0 = random_matrix(f, swiglu ? 2 * N : N, K);
    std::vector<QuantMatrix> ws;
    for (int64_t i = 0; i < llaisys::bench::cold_sets(double(w0.nbytes()), dev); ++i) ws.push_back(w0.to(dev));
    const Tensor x = Tensor::empty({M, K}, DType::BF16).fill_(0.5).to(dev), out = Tensor::empty({M, N}, DType::BF16, dev);
    synchronize(dev);
    const int batch = int(std::max<size_t>(16, ws.size()));
    llaisys::bench::time_graph_replays(state, dev, batch, [&](int b) {
        const QuantMatrix &w = ws[size_t(b) % ws.size()];
        if (swiglu) ops::quant_linear_swiglu(out, x, w);
        else ops::quant_linear(out, x, w, Tensor());
    });
    state.counters["GB/s"] = benchmark::Counter(double(w0.nbytes()) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// The M > 64 rows path's dense copy alone (quant_dequantize into one bf16 scratch, as models::linear does);
// GB/s counts the weight's bytes read plus the copy's bytes written.
void bench_dequantize_cuda(benchmark::State &state, QuantFormat f, int64_t N, int64_t K) {
    if (cuda_device_count() == 0) return state.SkipWithError("no CUDA device visible");
    const Device dev = Device::cuda(0);
    DeviceGuard guard(dev);
    const QuantMatrix w0 = random_matrix(f, N, K);
    std::vector<QuantMatrix> ws;
    for (int64_t i = 0; i < llaisys::bench::cold_sets(double(w0.nbytes()), dev); ++i) ws.push_back(w0.to(dev));
    const Tensor out = Tensor::empty({N, K}, DType::BF16, dev);
    synchronize(dev);
    const int batch = int(std::max<size_t>(16, ws.size()));
    llaisys::bench::time_graph_replays(state, dev, batch,
                                       [&](int b) { ops::quant_dequantize(out, ws[size_t(b) % ws.size()]); });
    state.counters["GB/s"] = benchmark::Counter(double(w0.nbytes() + N * K * 2) * 1e-9,
                                                benchmark::Counter::kIsIterationInvariantRate);
}

void register_cuda_benchmarks() {
    for (const auto &[f, N, K] : std::vector<std::tuple<QuantFormat, int64_t, int64_t>>{
             {QuantFormat::Q4_K, 17920, 1536}, {QuantFormat::Q4_K, 1536, 8960}, {QuantFormat::Q6_K, 1536, 8960},
             {QuantFormat::Q6_K, 151936, 1536}, {QuantFormat::Q5_K, 17920, 1536}}) {
        const std::string name = std::string("QuantDequantize/cuda_graph/") + quant_format_info(f).name + "/N:" +
                                 std::to_string(N) + "/K:" + std::to_string(K);
        benchmark::RegisterBenchmark(name.c_str(), bench_dequantize_cuda, f, N, K)
            ->Unit(benchmark::kMicrosecond)->UseManualTime()->Iterations(200);
    }

    struct Case {
        QuantFormat f;
        int64_t M, K, N;
        bool swiglu;
    };
    const std::vector<Case> cases = {
        {QuantFormat::Q4_K, 1, 1536, 2048, false},   {QuantFormat::Q4_K, 1, 1536, 8960, false},
        {QuantFormat::Q4_K, 1, 8960, 1536, false},   {QuantFormat::Q6_K, 1, 8960, 1536, false},
        {QuantFormat::Q6_K, 1, 1536, 151936, false}, {QuantFormat::Q4_K, 1, 1536, 8960, true},
        {QuantFormat::Q5_0, 1, 896, 4864, true},     {QuantFormat::Q8_0, 1, 4864, 896, false},
        {QuantFormat::Q4_K, 8, 1536, 8960, true},    {QuantFormat::Q6_K, 8, 8960, 1536, false},
        // M > 8: the tensor-core GEMM over decoded W tiles against the dense copy + cuBLASLt
        // (LLAISYS_QUANT_TC_MAX_ROWS=0), at the 1.5B's gate/up, down and LM head
        {QuantFormat::Q4_K, 16, 1536, 8960, true},   {QuantFormat::Q4_K, 64, 1536, 8960, true},
        {QuantFormat::Q4_K, 128, 1536, 8960, true},  {QuantFormat::Q4_K, 256, 1536, 8960, true},
        {QuantFormat::Q6_K, 16, 8960, 1536, false},  {QuantFormat::Q6_K, 64, 8960, 1536, false},
        {QuantFormat::Q6_K, 256, 8960, 1536, false}, {QuantFormat::Q6_K, 64, 1536, 151936, false},
        {QuantFormat::Q6_K, 256, 1536, 151936, false},
    };
    for (const Case &c : cases) {
        const std::string name = std::string(c.swiglu ? "QuantLinearSwiglu" : "QuantLinear") + "/cuda_graph/" +
                                 quant_format_info(c.f).name + "/M:" + std::to_string(c.M) + "/K:" +
                                 std::to_string(c.K) + (c.swiglu ? "/I:" : "/N:") + std::to_string(c.N);
        benchmark::RegisterBenchmark(name.c_str(), bench_quant_cuda, c.f, c.M, c.K, c.N, c.swiglu)
            ->Unit(benchmark::kMicrosecond)->UseManualTime()->Iterations(200);
    }
}
#endif

std::string shape_name(int64_t M, int64_t K, int64_t N) {
    return "/M:" + std::to_string(M) + "/K:" + std::to_string(K) + "/N:" + std::to_string(N);
}

int register_quant_benchmarks() {
    struct Case {
        QuantFormat f;
        int64_t K, N;
    };
    const std::vector<Case> cases = {
        {QuantFormat::Q5_0, 896, 4864}, {QuantFormat::Q5_0, 4864, 896}, {QuantFormat::Q5_0, 896, 1152},
        {QuantFormat::Q8_0, 896, 4864}, {QuantFormat::Q8_0, 4864, 896}, {QuantFormat::Q8_0, 896, 151936},
        {QuantFormat::Q4_K, 4864, 896}, {QuantFormat::Q4_K, 1536, 8960}, {QuantFormat::Q4_K, 8960, 1536},
        {QuantFormat::Q6_K, 4864, 896}, {QuantFormat::Q6_K, 1536, 8960}, {QuantFormat::Q6_K, 8960, 1536},
    };
    std::vector<std::pair<int64_t, int64_t>> dense;
    for (const Case &c : cases) {
        const std::string fmt = quant_format_info(c.f).name;
        for (QuantCpuPath p : {QuantCpuPath::Auto, QuantCpuPath::Avx2, QuantCpuPath::Portable}) {
            if (p == QuantCpuPath::Portable && c.N > 10000) continue; // the LM head takes seconds there
            const std::string name = "QuantLinear/" + fmt + "/" + quant_cpu_path_name(p) + shape_name(1, c.K, c.N);
            benchmark::RegisterBenchmark(name.c_str(), bench_quant, c.f, p, int64_t(1), c.K, c.N)
                ->Unit(benchmark::kMicrosecond)->UseRealTime();
        }
        if (c.N < 10000) // a short prefill
            benchmark::RegisterBenchmark(("QuantLinear/" + fmt + "/auto" + shape_name(64, c.K, c.N)).c_str(), bench_quant,
                                         c.f, QuantCpuPath::Auto, int64_t(64), c.K, c.N)
                ->Unit(benchmark::kMicrosecond)->UseRealTime();
        if (std::find(dense.begin(), dense.end(), std::make_pair(c.K, c.N)) == dense.end()) dense.push_back({c.K, c.N});
    }
    for (int64_t bytes : {int64_t(128) * 1024, int64_t(512) * 1024, int64_t(2) << 20, int64_t(8) << 20, int64_t(128) << 20})
        benchmark::RegisterBenchmark(("MemRead/bytes:" + std::to_string(bytes)).c_str(), bench_read, bytes)
            ->Unit(benchmark::kMicrosecond)->UseRealTime();
    for (const auto &[K, N] : dense)
        benchmark::RegisterBenchmark(("DenseLinear/bf16" + shape_name(1, K, N)).c_str(), bench_bf16, int64_t(1), K, N)
            ->Unit(benchmark::kMicrosecond)->UseRealTime();
#ifdef LLAISYS_WITH_CUDA
    register_cuda_benchmarks();
#endif
    return 0;
}

const int quant_benchmarks_registered = register_quant_benchmarks();

} // namespace
