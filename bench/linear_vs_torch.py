"""torch's M = 1 linear (cuBLAS, what `F.linear` runs) on the Qwen2 decode shapes, timed the way
bench_ops times llaisys' GEMV (`Linear/cuda_graph/bf16/M:1/...`): calls captured in a CUDA graph and
replayed, each call on its own copy of the weight (>= 256 MiB of copies, so none sits in L2 between
uses), time per call from CUDA events around the replays. Also the graph's floor: the time per kernel of
a replayed chain of one-element kernels, which no kernel in a graph beats on this GPU.
Run it in the same device call as bench_ops and compare the two as ratios.

    python bench/linear_vs_torch.py [--replays 20]
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
    start.record()
    for _ in range(replays):
        graph.replay()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) * 1e3 / (replays * calls)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replays", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("linear_vs_torch: no CUDA device visible")
        return 1
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, cuBLAS via F.linear, bf16, M = 1")
    tiny = torch.zeros(1, device=dev)
    floor = per_call_us(lambda i: tiny.add_(1.0), 256, args.replays)
    print(f"graph floor (one-element add_ per kernel): {floor:.2f} us per kernel")
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
