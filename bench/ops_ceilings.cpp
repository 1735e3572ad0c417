// The ceilings the op benchmarks are read against:
//   Ceiling/cuda/copy      device-to-device cudaMemcpyAsync of 1 GiB; GB/s counts bytes read + written
//   Ceiling/cuda/gemm_bf16 cuBLAS bf16 GEMM, 8192^3, f32 compute; TFLOP/s = 2 M N K
//   Ceiling/cpu/memcpy     memcpy of 256 MiB split over the CPU pool's threads; GB/s counts bytes read + written
//   Ceiling/cpu/read       one read-only pass over 256 MiB (all a decode GEMV must do); GB/s of bytes read
#include "llaisys/stream.hpp"
#include "llaisys/tensor.hpp"
#include "llaisys/thread_pool.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#ifdef LLAISYS_WITH_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#endif

namespace {

using namespace llaisys;

constexpr int64_t kCpuCeilingBytes = int64_t(256) << 20;

// Splits [0, n) into one contiguous range per thread.
template <typename Fn>
void ceiling_parallel_ranges(int64_t n, Fn &&fn) {
    const int64_t nt = cpu_threads();
    parallel_tasks(nt, [&](int64_t t) { fn(n * t / nt, n * (t + 1) / nt); });
}

void BM_CeilingCpuMemcpy(benchmark::State &state) {
    std::vector<char> src(size_t(kCpuCeilingBytes), 1), dst(size_t(kCpuCeilingBytes), 0);
    for (auto _ : state) {
        ceiling_parallel_ranges(kCpuCeilingBytes, [&](int64_t b, int64_t e) { std::memcpy(&dst[b], &src[b], e - b); });
        benchmark::ClobberMemory();
    }
    state.counters["GB/s"] = benchmark::Counter(2.0 * kCpuCeilingBytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// A read-only pass folding 256 MiB with XOR (vectorised at -O3 for any target, one-cycle latency),
// with software prefetch like the CPU GEMV's, so memory is the limit.
void BM_CeilingCpuRead(benchmark::State &state) {
    const std::vector<uint64_t> src(size_t(kCpuCeilingBytes / 8), 1);
    for (auto _ : state) {
        std::atomic<uint64_t> folded{0};
        ceiling_parallel_ranges(int64_t(src.size()), [&](int64_t b, int64_t e) {
            uint64_t acc = 0;
            int64_t i = b;
            for (; i + 8 <= e; i += 8) { // one cache line, prefetching 2 KiB ahead as the GEMV does
                __builtin_prefetch(&src[size_t(std::min(i + 256, e - 1))]);
                for (int j = 0; j < 8; ++j) acc ^= src[size_t(i + j)];
            }
            for (; i < e; ++i) acc ^= src[size_t(i)];
            folded.fetch_xor(acc, std::memory_order_relaxed);
        });
        benchmark::DoNotOptimize(folded.load());
    }
    state.counters["GB/s"] = benchmark::Counter(kCpuCeilingBytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

BENCHMARK(BM_CeilingCpuMemcpy)->Name("Ceiling/cpu/memcpy")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_CeilingCpuRead)->Name("Ceiling/cpu/read")->Unit(benchmark::kMillisecond)->UseRealTime();

#ifdef LLAISYS_WITH_CUDA
#define CEILING_CUDA_CHECK(expr)                                                                       \
    do {                                                                                               \
        const cudaError_t e_ = (expr);                                                                 \
        if (e_ != cudaSuccess) throw std::runtime_error(std::string("CUDA: ") + cudaGetErrorString(e_)); \
    } while (0)

// Times `batch` back-to-back runs of enqueue() per iteration with events on the current stream.
template <typename Fn>
void time_cuda_batches(benchmark::State &state, Device dev, int batch, Fn &&enqueue) {
    const Stream stream = current_stream(dev);
    for (int i = 0; i < 2; ++i) enqueue(stream); // warm-up
    Event start(dev, true), stop(dev, true);
    for (auto _ : state) {
        start.record(stream);
        for (int i = 0; i < batch; ++i) enqueue(stream);
        stop.record(stream);
        stop.synchronize();
        state.SetIterationTime(double(start.elapsed_ms(stop)) * 1e-3 / batch);
    }
}

void BM_CeilingCudaCopy(benchmark::State &state) {
    if (cuda_device_count() == 0) return state.SkipWithError("no CUDA device visible");
    const Device dev = Device::cuda(0);
    DeviceGuard guard(dev);
    const int64_t bytes = int64_t(1) << 30;
    const Tensor src = Tensor::empty({bytes}, DType::U8, dev), dst = Tensor::empty({bytes}, DType::U8, dev);
    time_cuda_batches(state, dev, 4, [&](const Stream &s) {
        CEILING_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), size_t(bytes), cudaMemcpyDeviceToDevice,
                                           static_cast<cudaStream_t>(s.handle())));
    });
    state.counters["GB/s"] = benchmark::Counter(2.0 * bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_CeilingCudaGemmBf16(benchmark::State &state) {
    if (cuda_device_count() == 0) return state.SkipWithError("no CUDA device visible");
    const Device dev = Device::cuda(0);
    DeviceGuard guard(dev);
    const int n = 8192;
    const Tensor a = Tensor::empty({n, n}, DType::BF16).fill_(0.01).to(dev);
    const Tensor b = a.clone(), c = Tensor::empty({n, n}, DType::BF16, dev);
    cublasHandle_t handle;
    if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) return state.SkipWithError("cublasCreate failed");
    const float alpha = 1.f, beta = 0.f;
    bool ok = true;
    time_cuda_batches(state, dev, 4, [&](const Stream &s) {
        cublasSetStream(handle, static_cast<cudaStream_t>(s.handle()));
        ok &= cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &alpha, a.data(), CUDA_R_16BF, n, b.data(),
                           CUDA_R_16BF, n, &beta, c.data(), CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                           CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS;
    });
    synchronize(dev);
    cublasDestroy(handle);
    if (!ok) return state.SkipWithError("cublasGemmEx failed");
    state.counters["TFLOP/s"] = benchmark::Counter(2.0 * n * n * double(n) * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
}

BENCHMARK(BM_CeilingCudaCopy)->Name("Ceiling/cuda/copy")->Unit(benchmark::kMillisecond)->UseManualTime();
BENCHMARK(BM_CeilingCudaGemmBf16)->Name("Ceiling/cuda/gemm_bf16")->Unit(benchmark::kMillisecond)->UseManualTime();
#endif

} // namespace
