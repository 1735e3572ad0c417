// self_attention at Qwen2 shapes (14/2 heads x 64 for 0.5B, 12/2 heads x 128 for 1.5B), bf16.
//   Prefill (qlen = kvlen, causal): TFLOP/s counting 4 * qlen * kvlen * nh * hd / 2 (QK^T and PV, half
//   the square visible). CUDA at 512 and 2048 tokens; the CPU at 128.
//   Decode (qlen = 1): GB/s counting the K and V bytes read (2 * kvlen * nkvh * hd * 2); kvlen 128, 1024,
//   4096 on CUDA, 1024 on the CPU. Compare with the device copy bandwidth (ops_ceilings.cpp). The "cap"
//   cases are the decode step's call: self_attention_cached over a cache of that capacity with the
//   length read from device memory (the kernels plan for the capacity), kvlen 256 of 4096.
//   Paged decode (paged_attention, qlen = 1 per sequence): batch 1/64/256 at context 512/2048, block size
//   16 with shuffled block ids; GB/s counting every sequence's K and V bytes read.
// CUDA iterations cycle through independent K/V sets (like the layers of a model, >= 128 MiB in all) so
// the decode K/V is not served from L2, and time a batch of back-to-back calls with events; a filler op
// enqueued first keeps the GPU busy while the host enqueues the batch, so host overhead is not timed.
#include "bench_timing.hpp"
#include "llaisys/ops.hpp"
#include "llaisys/stream.hpp"
#include "llaisys/tensor.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace llaisys;

struct AttnShape {
    int64_t qlen, kvlen, nh, nkvh, hd;
    int64_t capacity = 0; // > 0: self_attention_cached over a [capacity] cache, kvlen held on the device
    double flops() const { // causal: about half of the qlen x kvlen scores are computed (exact for decode)
        const double pairs = qlen == 1 ? double(kvlen) : double(qlen) * double(kvlen) / 2;
        return 4.0 * pairs * double(nh * hd);
    }
    double kv_bytes() const { return 2.0 * double(kvlen * nkvh * hd) * 2; } // bf16 K and V
};

Tensor attn_random(const Shape &shape, Device device, uint32_t seed) {
    Tensor host = Tensor::empty(shape, DType::F32);
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist;
    for (int64_t i = 0; i < host.numel(); ++i) host.data_as<float>()[i] = dist(rng);
    const Tensor b = ops::to_dtype(host, DType::BF16);
    return device.is_cpu() ? b : b.to(device);
}

// Independent (q, k, v, out) sets to cycle through, and the calls on them.
std::vector<std::function<void()>> attn_calls(const AttnShape &s, Device device) {
    const double set_bytes = s.kv_bytes() + 4.0 * double(s.qlen * s.nh * s.hd);
    const int64_t sets = device.is_cpu() ? 1 : std::clamp<int64_t>(int64_t((128 << 20) / set_bytes) + 1, 1, 64);
    const float scale = 1.f / std::sqrt(float(s.hd));
    std::vector<std::function<void()>> calls;
    for (int64_t i = 0; i < sets; ++i) {
        const uint32_t seed = uint32_t(3 * i);
        const int64_t rows = s.capacity > 0 ? s.capacity : s.kvlen;
        Tensor q = attn_random({s.qlen, s.nh, s.hd}, device, seed), k = attn_random({rows, s.nkvh, s.hd}, device, seed + 1),
               v = attn_random({rows, s.nkvh, s.hd}, device, seed + 2);
        Tensor out = Tensor::empty({s.qlen, s.nh, s.hd}, DType::BF16, device);
        if (s.capacity > 0) {
            Tensor len = Tensor::empty({1}, DType::I64);
            len.data_as<int64_t>()[0] = s.kvlen;
            if (!device.is_cpu()) len = len.to(device);
            calls.push_back([=] { ops::self_attention_cached(out, q, k, v, len, scale); });
        } else {
            calls.push_back([=] { ops::self_attention(out, q, k, v, scale); });
        }
    }
    return calls;
}

void attn_counters(benchmark::State &state, const AttnShape &s, bool cuda) {
    using C = benchmark::Counter;
    if (s.qlen == 1)
        state.counters["GB/s"] = C(s.kv_bytes() * 1e-9, C::kIsIterationInvariantRate);
    else if (cuda)
        state.counters["TFLOP/s"] = C(s.flops() * 1e-12, C::kIsIterationInvariantRate);
    else
        state.counters["GFLOP/s"] = C(s.flops() * 1e-9, C::kIsIterationInvariantRate);
}

void bench_attn_cpu(benchmark::State &state, AttnShape s) {
    const auto calls = attn_calls(s, Device::cpu());
    for (auto _ : state) {
        calls[0]();
        benchmark::ClobberMemory();
    }
    attn_counters(state, s, false);
}

#ifdef LLAISYS_WITH_CUDA
void bench_attn_cuda(benchmark::State &state, AttnShape s) {
    if (cuda_device_count() == 0) return state.SkipWithError("no CUDA device visible");
    const Device dev = Device::cuda(0);
    DeviceGuard guard(dev);
    const auto calls = attn_calls(s, dev);
    // ~0.6 ms of copying: longer than the host needs to enqueue a batch (~15 us a call). The warm-up
    // sets kernel attributes and fills the allocator.
    llaisys::bench::time_filled_batches(state, dev, s.qlen == 1 ? 20 : 10, int64_t(128) << 20,
                                        [&](size_t i) { calls[i % calls.size()](); });
    attn_counters(state, s, true);
}
#endif

#ifdef LLAISYS_WITH_CUDA
// batch sequences of one query at `context` keys; with prompts > 0 also that many fresh prompts of prompt_len
// queries (a step of prompt chunks beside decodes, as the engine's first steps of a batch are)
struct PagedShape {
    int64_t batch, context, nh, nkvh, hd, prompts = 0, prompt_len = 0;
    static constexpr int64_t block_size = 16;
    int64_t seqs() const { return batch + prompts; }
    int64_t tokens() const { return batch + prompts * prompt_len; }
    double kv_bytes() const { return 2.0 * double((batch * context + prompts * prompt_len) * nkvh * hd) * 2; } // bf16 K and V
};

Tensor i32_on(const std::vector<int32_t> &v, const Shape &shape, Device device) {
    Tensor host = Tensor::empty(shape, DType::I32);
    std::copy(v.begin(), v.end(), host.data_as<int32_t>());
    return host.to(device);
}

// Independent paged caches (every sequence's blocks at shuffled ids) and the step's calls on them: the
// decodes first, then the prompts.
std::vector<std::function<void()>> paged_calls(const PagedShape &s, Device device) {
    const int64_t per_seq = (std::max(s.context, s.prompt_len) + s.block_size - 1) / s.block_size,
                  blocks = s.seqs() * per_seq, B = s.seqs();
    const int64_t sets = llaisys::bench::cold_sets(s.kv_bytes(), device);
    std::vector<std::function<void()>> calls;
    for (int64_t i = 0; i < sets; ++i) {
        const uint32_t seed = uint32_t(5 * i);
        std::vector<int32_t> ids(static_cast<size_t>(blocks)), starts(static_cast<size_t>(B + 1)),
            lens(static_cast<size_t>(B), int32_t(s.context));
        std::iota(ids.begin(), ids.end(), 0);
        std::shuffle(ids.begin(), ids.end(), std::mt19937(seed));
        for (int64_t b = 0; b < B; ++b) { // one query a decode, prompt_len a prompt (all of its keys)
            const int64_t qlen = b < s.batch ? 1 : s.prompt_len;
            starts[size_t(b + 1)] = int32_t(starts[size_t(b)] + qlen);
            if (b >= s.batch) lens[size_t(b)] = int32_t(s.prompt_len);
        }
        const Tensor tables = i32_on(ids, {B, per_seq}, device), q_start = i32_on(starts, {B + 1}, device),
                     kv_len = i32_on(lens, {B}, device);
        const Tensor q = attn_random({s.tokens(), s.nh, s.hd}, device, seed),
                     k = attn_random({blocks, s.block_size, s.nkvh, s.hd}, device, seed + 1),
                     v = attn_random({blocks, s.block_size, s.nkvh, s.hd}, device, seed + 2);
        const Tensor out = Tensor::empty({s.tokens(), s.nh, s.hd}, DType::BF16, device);
        const float scale = 1.f / std::sqrt(float(s.hd));
        const int64_t mq = s.prompts > 0 ? s.prompt_len : 1;
        calls.push_back([=] { ops::paged_attention(out, q, k, v, tables, q_start, kv_len, scale, mq); });
    }
    return calls;
}

void bench_paged_decode_cuda(benchmark::State &state, PagedShape s) {
    if (cuda_device_count() == 0) return state.SkipWithError("no CUDA device visible");
    const Device dev = Device::cuda(0);
    DeviceGuard guard(dev);
    const auto calls = paged_calls(s, dev);
    llaisys::bench::time_filled_batches(state, dev, 20, int64_t(128) << 20,
                                        [&](size_t i) { calls[i % calls.size()](); });
    using C = benchmark::Counter;
    state.counters["GB/s"] = C(s.kv_bytes() * 1e-9, C::kIsIterationInvariantRate);
}
#endif

std::string attn_name(const char *kind, const char *dev, const AttnShape &s) {
    return std::string("Attention/") + kind + "/" + dev + "/bf16/heads:" + std::to_string(s.nh) + "x" +
           std::to_string(s.nkvh) + "x" + std::to_string(s.hd) + "/qlen:" + std::to_string(s.qlen) +
           "/kvlen:" + std::to_string(s.kvlen) + (s.capacity > 0 ? "/cap:" + std::to_string(s.capacity) : "");
}

int register_attention_benchmarks() {
    const std::vector<std::pair<int64_t, int64_t>> heads{{14, 2}, {12, 2}};
    for (auto [nh, nkvh] : heads) {
        const int64_t hd = nh == 14 ? 64 : 128;
        const AttnShape cpu_prefill{128, 128, nh, nkvh, hd}, cpu_decode{1, 1024, nh, nkvh, hd};
        benchmark::RegisterBenchmark(attn_name("prefill", "cpu", cpu_prefill).c_str(), bench_attn_cpu, cpu_prefill)
            ->Unit(benchmark::kMillisecond)->UseRealTime();
        benchmark::RegisterBenchmark(attn_name("decode", "cpu", cpu_decode).c_str(), bench_attn_cpu, cpu_decode)
            ->Unit(benchmark::kMicrosecond)->UseRealTime();
#ifdef LLAISYS_WITH_CUDA
        // A fixed count: every iteration also runs the ~0.6 ms filler.
        for (int64_t n : {512, 2048}) {
            const AttnShape s{n, n, nh, nkvh, hd};
            benchmark::RegisterBenchmark(attn_name("prefill", "cuda", s).c_str(), bench_attn_cuda, s)
                ->Unit(benchmark::kMicrosecond)->UseManualTime()->Iterations(20);
        }
        for (int64_t kv : {128, 1024, 4096}) {
            const AttnShape s{1, kv, nh, nkvh, hd};
            benchmark::RegisterBenchmark(attn_name("decode", "cuda", s).c_str(), bench_attn_cuda, s)
                ->Unit(benchmark::kMicrosecond)->UseManualTime()->Iterations(50);
        }
        const AttnShape step{1, 256, nh, nkvh, hd, 4096}; // the decode step's call
        benchmark::RegisterBenchmark(attn_name("decode", "cuda", step).c_str(), bench_attn_cuda, step)
            ->Unit(benchmark::kMicrosecond)->UseManualTime()->Iterations(50);
        // 132 and 198 rows x 2 kv heads: one and 1.5 blocks an SM of an H200 (132 SMs), against 256's
        // 1.94 (the decode kernel's wave tail, issue 33)
        // batch 1 up to 32768 keys: the decode kernels' own merge of tens to hundreds of chunks (merge_arrived)
        for (int64_t batch : {1, 64, 132, 198, 256})
            for (int64_t context : {256, 512, 2048, 8192, 32768}) {
                if ((context == 256 && batch < 132) || (context > 2048 && batch > 1)) continue;
                const PagedShape p{batch, context, nh, nkvh, hd};
                const std::string name = "Attention/paged_decode/cuda/bf16/heads:" + std::to_string(nh) + "x" +
                                         std::to_string(nkvh) + "x" + std::to_string(hd) + "/batch:" +
                                         std::to_string(batch) + "/context:" + std::to_string(context) + "/block:16";
                benchmark::RegisterBenchmark(name.c_str(), bench_paged_decode_cuda, p)
                    ->Unit(benchmark::kMicrosecond)->UseManualTime()->Iterations(50);
            }
        // A step of the nano-vllm protocol's first second: two 2048-token prompt chunks (the CUDA step budget,
        // 4096 tokens) beside 0, 64 or 256 decodes of 512 keys (LLAISYS_PAGED_MIXED=0: the old split of work)
        for (int64_t batch : {0, 64, 256}) {
            const PagedShape p{batch, 512, nh, nkvh, hd, 2, 2048};
            const std::string name = "Attention/paged_mixed/cuda/bf16/heads:" + std::to_string(nh) + "x" +
                                     std::to_string(nkvh) + "x" + std::to_string(hd) + "/decodes:" +
                                     std::to_string(batch) + "/context:512/prompts:2x2048/block:16";
            benchmark::RegisterBenchmark(name.c_str(), bench_paged_decode_cuda, p)
                ->Unit(benchmark::kMicrosecond)->UseManualTime()->Iterations(20);
        }
#endif
    }
    return 0;
}

const int attention_benchmarks_registered = register_attention_benchmarks();

} // namespace
