"""Per-kernel time of one batch-1 decode step on CUDA (random weights of a real Qwen2 shape).

    python bench/decode_breakdown.py [--shape qwen2-0.5b] [--steps 20] [--json out.json]

Runs the decode step with CUDA graphs on (the real path) under torch.profiler, which records every
kernel in the process through CUPTI, including those replayed from our graph. Prints, per kernel
name: launches per step, device µs per step, and share of the step; then the sum of kernel time
against the step's wall time (the difference is the gaps between kernels).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "python"))

import llaisys  # noqa: E402
from llaisys import bench as B  # noqa: E402


def short(name: str) -> str:
    """A kernel's name without namespaces, template arguments and parameter list; a GEMV keeps its
    epilogue (Plain / Swiglu) so linear and linear_swiglu show apart."""
    name = name.replace("(anonymous namespace)::", "").replace("void ", "")
    name = name.split("(")[0]
    depth, out, targs = 0, [], []
    for ch in name:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
        else:
            targs.append(ch)
    base = "".join(out).strip().split("::")[-1] or name[:60]
    for epilogue in ("PlainEpilogue", "SwigluEpilogue"):
        if epilogue in "".join(targs):
            base += "/" + epilogue.replace("Epilogue", "").lower()
    return base


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2-0.5b", choices=sorted(B.SHAPES))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--context", type=int, default=256, help="tokens already in the cache when timing starts")
    ap.add_argument("--graphs", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    c = B.SHAPES[args.shape]
    model = B.random_model(c, "bf16", "cuda:0", args.context + args.steps + 64)
    model.cuda_graphs = bool(args.graphs)
    sp = B._greedy()
    model.forward_sample([0], [list(range(1, args.context + 1))], [sp], 0, 0)
    tok = 1
    for i in range(5):  # capture and warm the decode graph
        tok = model.forward_sample([0], [[tok]], [sp], 0, i + 1)[0]
    llaisys.synchronize("cuda:0")
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for i in range(args.steps):
            tok = model.forward_sample([0], [[tok]], [sp], 0, i + 10)[0]
        wall = (time.perf_counter() - t0) / args.steps * 1e6
    per = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0 and "Memcpy" not in ev.name:
            k = short(ev.name)
            per[k][0] += 1
            per[k][1] += ev.device_time_total
    total = sum(v[1] for v in per.values()) / args.steps
    rows = sorted(((k, n / args.steps, us / args.steps) for k, (n, us) in per.items()), key=lambda r: -r[2])
    print(f"{args.shape}, bf16, context {args.context}, graphs {'on' if args.graphs else 'off'}, "
          f"fused projections {'on' if model.fused_projections else 'off'}: "
          f"step wall {wall:.1f} µs (profiled), kernel time {total:.1f} µs, "
          f"launches/step {sum(r[1] for r in rows):.0f}")
    print(f"{'kernel':<44}{'launches':>9}{'µs/step':>10}{'share':>8}{'µs/launch':>11}")
    for k, n, us in rows:
        print(f"{k[:43]:<44}{n:9.1f}{us:10.1f}{100 * us / max(total, 1e-9):7.1f}%{us / max(n, 1e-9):11.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "fused": model.fused_projections, "wall_us": wall, "kernel_us": total,
                       "kernels": [dict(name=k, launches=n, us=us) for k, n, us in rows]}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
