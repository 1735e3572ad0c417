// Timing pieces shared by the op benchmarks (ops_*.cpp).
#pragma once
#include "llaisys/graph.hpp"
#include "llaisys/ops.hpp"
#include "llaisys/stream.hpp"
#include "llaisys/tensor.hpp"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <exception>

namespace llaisys::bench {

// How many independent buffer sets of `bytes` each a CUDA benchmark cycles through so that they do not
// sit in the GPU's L2 between calls (>= 256 MiB in all, at most 64 sets); 1 on the CPU, where the cache
// effects of small shapes are part of what is measured.
inline int64_t cold_sets(double bytes, Device device) {
    if (device.is_cpu()) return 1;
    return std::clamp<int64_t>(int64_t(double(int64_t(256) << 20) / bytes) + 1, 1, 64);
}

// Times batches of `batch` back-to-back calls call(i) (i counting up over the whole run, after three
// warm-up calls) with events on the current stream of the CUDA device `dev`. A filler op of
// `filler_elems` f32 additions runs before each batch, longer than the host takes to enqueue the batch,
// so the time is the kernels' own, as a CUDA graph replays them, not the host's launch rate.
template <typename Fn>
void time_filled_batches(benchmark::State &state, Device dev, int batch, int64_t filler_elems, Fn &&call) {
    const Stream stream = current_stream(dev);
    const Tensor filler = Tensor::zeros({filler_elems}, DType::F32, dev);
    size_t i = 0;
    for (int w = 0; w < 3; ++w) call(i++);
    Event start(dev, true), stop(dev, true);
    for (auto _ : state) {
        ops::add(filler, filler, filler);
        start.record(stream);
        for (int b = 0; b < batch; ++b) call(i++);
        stop.record(stream);
        stop.synchronize();
        state.SetIterationTime(double(start.elapsed_ms(stop)) * 1e-3 / batch);
    }
}

// Captures `batch` calls call(0 .. batch - 1) in one CUDA graph (after one warm-up call outside it) and
// times replays of it with events on the current stream: the kernels' own time, as a decode step
// captured in a graph sees it, without the host's launch cost. Sets the iteration time per call; an
// exception while capturing skips the benchmark with its message.
template <typename Fn>
void time_graph_replays(benchmark::State &state, Device dev, int batch, Fn &&call) {
    const Stream stream = current_stream(dev);
    try {
        call(0);
        Graph graph(dev);
        graph.capture([&] {
            for (int b = 0; b < batch; ++b) call(b);
        });
        Event start(dev, true), stop(dev, true);
        graph.replay(); // warm-up replay
        for (auto _ : state) {
            start.record(stream);
            graph.replay();
            stop.record(stream);
            stop.synchronize();
            state.SetIterationTime(double(start.elapsed_ms(stop)) * 1e-3 / batch);
        }
    } catch (const std::exception &e) {
        state.SkipWithError(e.what());
    }
}

} // namespace llaisys::bench
