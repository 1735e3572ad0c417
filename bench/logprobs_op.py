"""ops.logprobs against what EngineCore did before it (issue 33): per row, a copy of the row's logits to the
host and a float64 log-softmax + argpartition in NumPy. Random f32 logits [B, V] on --device; the best of
--repeat, the two interleaved.

    LLAISYS_BUILD_DIR=build/dev PYTHONPATH=python python bench/logprobs_op.py --vocab 151936 --batch 32 64
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def per_row_numpy(logits, rows: int, k: int) -> None:
    """The old EngineCore._logprobs, once per row."""
    for row in range(rows):
        x = np.asarray(logits.slice(0, row, row + 1).to("cpu").to("f32").numpy(), dtype=np.float64)[0]
        m = x.max()
        lp = x - (m + np.log(np.exp(x - m).sum()))
        top = np.argpartition(-lp, k)[:k] if 0 < k < lp.size else np.arange(lp.size if k else 0)
        sorted(top.tolist(), key=lambda i: (-lp[i], i))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    import llaisys
    from llaisys import ops

    dev, V, k = args.device, args.vocab, args.k
    for B in args.batch:
        x = llaisys.tensor(np.random.default_rng(0).standard_normal((B, V)).astype(np.float32), dev)
        t, c = llaisys.tensor(np.ones(B, np.float32), dev), llaisys.tensor(np.zeros(B, np.int64), dev)
        r = llaisys.tensor(np.arange(B, dtype=np.int64), dev)
        out = (llaisys.empty([B], "f32", dev), llaisys.empty([B, k], "i64", dev), llaisys.empty([B, k], "f32", dev))
        best_op = best_np = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            ops.logprobs(*out, x, t, c, r)
            [o.to("cpu") for o in out]  # what the engine reads back (and a sync on a device)
            t1 = time.perf_counter()
            per_row_numpy(x, B, k)
            t2 = time.perf_counter()
            best_op, best_np = min(best_op, t1 - t0), min(best_np, t2 - t1)
        print(f"V {V} B {B} k {k} on {dev}: ops.logprobs {best_op * 1e3:.2f} ms, per-row copy + NumPy "
              f"{best_np * 1e3:.2f} ms (x{best_np / best_op:.1f})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
