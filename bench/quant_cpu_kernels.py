#!/usr/bin/env python3
"""CPU time of the quantized linear at the default model's shapes (qwen2.5-coder-0.5b Q4_K_M; --model gemma: gemma-3-270m's), for A/B runs of two
builds on a busy machine.

    LLAISYS_NUM_THREADS=1 LLAISYS_BUILD_DIR=build/base python bench/quant_cpu_kernels.py --rows 64 &
    LLAISYS_NUM_THREADS=1 LLAISYS_BUILD_DIR=build/dev  python bench/quant_cpu_kernels.py --rows 64 & wait

Wall time means little on a 2-core machine at load 5-6 (a run at 1x and 2x of another), and so does one process's
CPU time measured at another moment (another tenant's working set evicts ours). Run the two builds at the same
time, one thread each, so that both see the same neighbours; each prints, per shape, the least and the first
quartile of the calling thread's CPU time per call (LLAISYS_NUM_THREADS=1: the call runs on the caller). The
weights are random blocks with d = 0.01, one copy each (prefill is bound by arithmetic, not by reading them).

Decode reads every weight from DRAM once per step, which one copy in the cache does not show:

    LLAISYS_NUM_THREADS=1 python bench/quant_cpu_kernels.py --rows 1 --dram-mb 256

holds enough copies of each matrix (at least --dram-mb MB, more than any L3 here) and calls them in turn, and adds
the Q8_0 LM head (151936 x 896, 145 MB). Its thread CPU time includes the core's stalls on memory. --layout file
runs Q5_0 in the file's blocks where a model would split it (an A/B of the layouts in one build).
"""
import argparse
import time

import numpy as np

import llaisys
from llaisys import quant

# (format, N, K): Q5_0 gate/up and o-shaped rows (4864 x 896, 896 x 896), the Q5_0 shape with K = 4864 (as
# bench_ops), Q8_0 v-shaped, Q4_K down.
SHAPES = [("q5_0", 4864, 896), ("q5_0", 896, 4864), ("q5_0", 896, 896), ("q8_0", 128, 896), ("q4_k", 896, 4864)]
# gemma-3-270m Q4_K_M (--model gemma): Q5_0 gate and up as one matrix, q, k; Q8_0 v; Q4_K o and down; Q6_K down.
GEMMA_SHAPES = [("q5_0", 4096, 640), ("q5_0", 1024, 640), ("q5_0", 256, 640), ("q8_0", 256, 640),
                ("q4_k", 640, 1024), ("q4_k", 640, 2048), ("q6_k", 640, 2048)]


def random_matrix(fmt: str, n: int, k: int, rng) -> quant.QuantMatrix:
    info = quant.format_info(fmt)
    blocks = rng.integers(0, 256, (n, k // info["block_elems"], info["block_bytes"]), dtype=np.uint8)
    d = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    blocks[:, :, 0:2] = d
    if fmt in ("q4_k", "q5_k"):
        blocks[:, :, 2:4] = d  # dmin
    w = quant.from_numpy(fmt, n, k, np.ascontiguousarray(blocks.reshape(n, -1)))
    return w if LAYOUT == "file" or not hasattr(quant, "cpu_layout") else w.with_layout(quant.cpu_layout(fmt, k))


LAYOUT = "cpu"  # --layout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64, help="x rows (1: decode's GEMV, more: a prefill chunk)")
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--dram-mb", type=float, default=0, help="copies of each matrix making at least this many MB, "
                   "called in turn (decode's weights come from DRAM); also times the Q8_0 LM head")
    p.add_argument("--layout", choices=["cpu", "file"], default="cpu", help="cpu: each format in the layout a CPU "
                   "model keeps it in (quant.cpu_layout: Q5_0 split where AVX2 is the best path); file: GGUF's blocks")
    p.add_argument("--model", choices=["qwen", "gemma"], default="qwen", help="whose shapes: qwen2.5-coder-0.5b's "
                   "or gemma-3-270m's")
    args = p.parse_args()
    global LAYOUT
    LAYOUT = args.layout
    rng = np.random.default_rng(0)
    shapes = (GEMMA_SHAPES if args.model == "gemma" else SHAPES) + ([("q8_0", 151936, 896)] if args.dram_mb > 0 else [])
    for fmt, n, k in shapes:
        mb = n * quant.row_bytes(fmt, k) / 1e6
        ws = [random_matrix(fmt, n, k, rng) for _ in range(max(1, int(np.ceil(args.dram_mb / mb))))]
        x = llaisys.tensor(rng.standard_normal((args.rows, k)).astype(np.float32))
        for w in ws:
            quant.linear(x, w)  # first call: page faults, buffers
        times = []
        for i in range(args.calls):
            w = ws[i % len(ws)]
            t = time.thread_time()
            quant.linear(x, w)
            times.append(time.thread_time() - t)
        print(f"{fmt} N {n:5d} K {k:5d} M {args.rows}: min {min(times) * 1e3:7.3f} ms  "
              f"q1 {np.percentile(times, 25) * 1e3:7.3f} ms  ({quant.cpu_path()}, {getattr(ws[0], 'layout', 'file')}, {len(ws)} x {mb:.1f} MB)", flush=True)


if __name__ == "__main__":
    main()
