"""llaisys.ops.argmax vs torch.max(x, dim=-1) (values and indices, what our op returns) and torch.argmax
on the same GPU, over rows x 151936 bf16 logits (Qwen2's vocabulary): 1 and 4 rows (greedy decode, the
logits just written, so in L2) and 64 and 256 rows (a batch; each call reads its own copy, >= 256 MiB of
copies in all, so nothing sits in L2). The inputs are made by torch and shared with llaisys through DLPack
without a copy. Each side is timed as bench/attention_vs_sdpa.py times it: batches of 10 back-to-back calls
on its own stream behind a GPU filler, median of --iters batches. Prints the time per call of each, the
rate (logits bytes read per second) and torch's time over llaisys' (> 1: llaisys is faster); the indices
are checked equal.

    python bench/argmax_vs_torch.py [--iters 30]
"""
from __future__ import annotations

import argparse

import torch

import llaisys
from attention_vs_sdpa import llaisys_record, median_ms, torch_record

VOCAB = 151936


def compare(rows: int, iters: int) -> None:
    row_bytes = rows * VOCAB * 2
    copies = 1 if rows <= 4 else min(64, (256 << 20) // row_bytes + 1)
    g = torch.Generator(device="cuda").manual_seed(rows)
    xs = [torch.randn(rows, VOCAB, device="cuda", dtype=torch.bfloat16, generator=g) * 3 for _ in range(copies)]
    lxs = [llaisys.from_dlpack(x) for x in xs]
    idx, val = torch.empty(rows, dtype=torch.int64, device="cuda"), torch.empty(rows, dtype=torch.bfloat16, device="cuda")
    lidx, lval = llaisys.from_dlpack(idx), llaisys.from_dlpack(val)

    def cycling(fn):
        state = {"i": 0}

        def call():
            fn(state["i"] % copies)
            state["i"] += 1
        return call

    ours = median_ms(cycling(lambda i: llaisys.ops.argmax(lidx, lval, lxs[i])), llaisys_record, iters)
    llaisys.synchronize("cuda")
    tmax = median_ms(cycling(lambda i: torch.max(xs[i], dim=-1)), torch_record, iters)
    targ = median_ms(cycling(lambda i: torch.argmax(xs[i], dim=-1)), torch_record, iters)

    llaisys.ops.argmax(lidx, lval, lxs[0])
    llaisys.synchronize("cuda")
    ref = torch.max(xs[0], dim=-1)
    if not (torch.equal(idx, ref.indices) and torch.equal(val, ref.values)):
        raise SystemExit(f"argmax_vs_torch: llaisys and torch disagree at {rows} rows")
    gbs = lambda ms: row_bytes / (ms * 1e-3) / 1e9  # noqa: E731
    print(f"{rows:>5} {row_bytes / 1e6:8.1f} {ours * 1e3:8.2f} {gbs(ours):7.0f} {tmax * 1e3:9.2f} {gbs(tmax):7.0f}"
          f" {targ * 1e3:9.2f} {tmax / ours:6.2f}x {targ / ours:6.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    if not torch.cuda.is_available() or not llaisys.cuda_is_available():
        print("argmax_vs_torch: no CUDA device visible")
        return 1
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 x [rows, {VOCAB}]")
    print(f"{'rows':>5} {'MB':>8} {'ours us':>8} {'GB/s':>7} {'max us':>9} {'GB/s':>7} {'argmax us':>9}"
          f" {'vs max':>7} {'vs argmax':>9}")
    for rows in (1, 4, 64, 256):
        compare(rows, args.iters)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
