"""torch's M = 1 linear (cuBLAS, what `F.linear` runs) on the Qwen2 decode shapes, timed the way
bench_ops times llaisys' GEMV (`Linear/cuda_graph/bf16/M:1/...`): the calls of one replay (>= 16, each
on its own copy of the weight, >= 128 MiB of distinct weights per replay, so none sits in L2 between
uses) captured in a CUDA graph; CUDA events around each replay, the time per call averaged over
--replays replays. Also the time per kernel of a replayed chain of one-element kernels: what a kernel
launched without programmatic dependent launch (PDL) costs in a graph on this GPU however little it does.
Run it in the same device call as bench_ops and compare the two as ratios.

    python bench/linear_vs_torch.py [--replays 200]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

# (K, N): 0.5B q/k/v fused, o, gate/up half, down; 1.5B q/k/v fused, o, k/v, gate/up half, down.
SHAPES = [(896, 1152), (896, 896), (896, 4864), (4864, 896),
          (1536, 2048), (1536, 1536), (1536, 256), (1536, 8960), (8960, 1536)]


def per_call_us(fn, calls: int, replays: int) -> float:
    """Captures fn(i) for i < calls in one graph; returns microseconds per call over `replays` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture (cuBLAS handles, workspaces)
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    total_ms = 0.0
    for _ in range(replays):  # as bench_ops: one event pair per replay, the host waiting in between
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        total_ms += start.elapsed_time(stop)
    return total_ms * 1e3 / (replays * calls)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replays", type=int, default=200)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("linear_vs_torch: no CUDA device visible")
        return 1
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, cuBLAS via F.linear, bf16, M = 1")
    tiny = torch.zeros(1, device=dev)
    floor = per_call_us(lambda i: tiny.add_(1.0), 256, args.replays)
    print(f"graph floor without PDL (one-element add_ per kernel): {floor:.2f} us per kernel")
    print(f"{'K->N':>12} {'weight MB':>9} {'us/call':>8} {'GB/s':>8}")
    for K, N in SHAPES:
        w_bytes = N * K * 2
        copies = min(256, -(-(256 << 20) // w_bytes))
        calls = min(copies, max(16, -(-(128 << 20) // w_bytes)))
        ws = [torch.full((N, K), 0.01, dtype=torch.bfloat16, device=dev) for _ in range(copies)]
        x = torch.full((1, K), 0.5, dtype=torch.bfloat16, device=dev)
        us = per_call_us(lambda i: F.linear(x, ws[i % copies]), calls, args.replays)
        gbs = (w_bytes + 2 * K + 2 * N) / (us * 1e-6) / 1e9
        print(f"{K:>5}->{N:<6} {w_bytes / 1e6:9.2f} {us:8.2f} {gbs:8.0f}")
        del ws
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
