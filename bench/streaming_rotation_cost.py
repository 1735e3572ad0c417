#!/usr/bin/env python3
"""StreamingLLM (issue 32): the two ways to take positions within the cache, measured as ops on one device.

- K-shift (what llaisys does): when a block is evicted, every kept key of every layer is turned back by the
  block's length once (`ops.kv_shift` over the W + sinks kept rows of each layer, in place): a cost per evicted
  block, i.e. per `block_size` decoded tokens.
- Keys cached before RoPE and rotated inside attention (the alternative): every decode step turns every key it
  reads, in every layer. Timed here as `ops.rope` over the W kept keys of each layer per token: the rotation
  alone as a pass of its own (a version fused into the attention kernel would save that pass's write, not its
  angles and arithmetic, and would change every attention kernel).

Prints both per decoded token (ms) for windows W. Shape: layers, kv heads, head dim and RoPE base of --shape.

    python bench/streaming_rotation_cost.py --device cpu --window 256 1024 --repeat 5
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def timed(fn, repeat: int, sync) -> float:
    """Least seconds of `repeat` calls of fn (after one warm-up)."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None) -> int:
    import llaisys
    from llaisys import ops
    from llaisys_bench.shapes import SHAPES  # this folder is sys.path[0]

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: bf16 on CUDA, f32 on the CPU (as the engine runs)")
    ap.add_argument("--window", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args(argv)
    c = SHAPES[a.shape]
    layers, nkvh = c["num_hidden_layers"], c["num_key_value_heads"]
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    theta = float(c.get("rope_theta", 10000.0))
    dtype = a.dtype or ("bf16" if a.device.startswith("cuda") else "f32")
    inv = ops.rope_inv_freq(theta, hd)

    def sync():
        if a.device.startswith("cuda"):
            llaisys.synchronize(a.device)

    print(f"{a.shape} ({layers} layers, {nkvh} kv heads, head dim {hd}) on {a.device}, {dtype}, block size "
          f"{a.block_size}, {a.sinks} sinks; least of {a.repeat}")
    print("| window | K-shift ms per evicted block | per token | rotate-in-attention ms per token | ratio |")
    print("|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    for w in a.window:
        rows = w + a.sinks
        def cache():  # one layer's keys or values: its own buffer
            x = llaisys.tensor(rng.standard_normal((rows, nkvh, hd)).astype(np.float32), a.device)
            return x if dtype == "f32" else llaisys.functional.cast(x, dtype)

        ks, vs = [cache() for _ in range(layers)], [cache() for _ in range(layers)]
        kept = llaisys.tensor(np.arange(a.sinks, rows, dtype=np.int64), a.device)
        pos = llaisys.tensor(np.arange(rows, dtype=np.int64), a.device)
        outs = [llaisys.functional.rope(k, pos, inv_freq=inv) for k in ks]  # buffers of the rotated keys

        def shift():
            for k, v in zip(ks, vs):
                ops.kv_shift(k, v, kept, kept, -a.block_size, inv)

        def rotate():
            for k, o in zip(ks, outs):
                ops.rope(o, k, pos, inv)

        shift_s, rotate_s = timed(shift, a.repeat, sync), timed(rotate, a.repeat, sync)
        per_token = shift_s / a.block_size
        print(f"| {w} | {shift_s * 1e3:.3f} | {per_token * 1e3:.4f} | {rotate_s * 1e3:.3f} | "
              f"{rotate_s / per_token:.1f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
