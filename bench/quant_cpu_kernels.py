#!/usr/bin/env python3
"""CPU time of the quantized linear at the default model's shapes (qwen2.5-coder-0.5b Q4_K_M), for A/B runs of two
builds on a busy machine.

    LLAISYS_NUM_THREADS=1 LLAISYS_BUILD_DIR=build/base python bench/quant_cpu_kernels.py --rows 64 &
    LLAISYS_NUM_THREADS=1 LLAISYS_BUILD_DIR=build/dev  python bench/quant_cpu_kernels.py --rows 64 & wait

Wall time means little on a 2-core machine at load 5-6 (a run at 1x and 2x of another), and so does one process's
CPU time measured at another moment (another tenant's working set evicts ours). Run the two builds at the same
time, one thread each, so that both see the same neighbours; each prints, per shape, the least and the first
quartile of the calling thread's CPU time per call (LLAISYS_NUM_THREADS=1: the call runs on the caller). The
weights are random blocks with d = 0.01, one copy each (prefill is bound by arithmetic, not by reading them).
"""
import argparse
import time

import numpy as np

import llaisys
from llaisys import quant

# (format, N, K): Q5_0 gate/up and o-shaped rows (4864 x 896, 896 x 896), the Q5_0 shape with K = 4864 (as
# bench_ops), Q8_0 v-shaped, Q4_K down.
SHAPES = [("q5_0", 4864, 896), ("q5_0", 896, 4864), ("q5_0", 896, 896), ("q8_0", 128, 896), ("q4_k", 896, 4864)]


def random_matrix(fmt: str, n: int, k: int, rng) -> quant.QuantMatrix:
    info = quant.format_info(fmt)
    blocks = rng.integers(0, 256, (n, k // info["block_elems"], info["block_bytes"]), dtype=np.uint8)
    d = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    blocks[:, :, 0:2] = d
    if fmt in ("q4_k", "q5_k"):
        blocks[:, :, 2:4] = d  # dmin
    return quant.from_numpy(fmt, n, k, np.ascontiguousarray(blocks.reshape(n, -1)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=64, help="x rows (1: decode's GEMV, more: a prefill chunk)")
    p.add_argument("--calls", type=int, default=40)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    for fmt, n, k in SHAPES:
        w = random_matrix(fmt, n, k, rng)
        x = llaisys.tensor(rng.standard_normal((args.rows, k)).astype(np.float32))
        quant.linear(x, w)  # first call: page faults, buffers
        times = []
        for _ in range(args.calls):
            t = time.thread_time()
            quant.linear(x, w)
            times.append(time.thread_time() - t)
        print(f"{fmt} N {n:5d} K {k:5d} M {args.rows}: min {min(times) * 1e3:7.3f} ms  "
              f"q1 {np.percentile(times, 25) * 1e3:7.3f} ms  ({quant.cpu_path()})", flush=True)


if __name__ == "__main__":
    main()
