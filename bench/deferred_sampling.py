"""Host time of a deferred step's masked sampling call (issue 31): Runner.sample_deferred with B rows' token
masks at a real vocabulary's width (Qwen's 151,936 ids: 4,748 words a row), every row masked in order (a
batch of constrained rows) and every other row masked (constrained rows beside free ones). On CUDA the call
only enqueues (mask upload, token_mask, the draw), so its time is what it adds to the host's path from a
step's tokens to the next masked sampling; on the CPU it also runs the masking and the draw.

The model is one layer of width 32 with random weights (its forward costs next to nothing, and the
launch's forward is outside the timed call); each mask allows a few hundred random tokens a row.

    LLAISYS_BUILD_DIR=build/dev PYTHONPATH=python python bench/deferred_sampling.py --batch 16 64
    python bench/deferred_sampling.py --device cuda --batch 16 64 256
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from llaisys_bench import shapes  # this folder is sys.path[0] when run as a script

SHAPE = dict(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0,
             tie_word_embeddings=True)


def launch(eng, n: int) -> None:
    """An n-row decode at position 0 (row r in block r + 1), its sampling deferred, on the runner's binding."""
    runner, bs = eng._core.runner.runner, eng._core.config.block_size
    f32, i32, u64 = (lambda v: np.array(v, np.float32)), (lambda v: np.array(v, np.int32)), np.uint64
    runner.launch(np.arange(5, 5 + n), np.zeros(n, np.int64), np.arange(1, n + 1) * bs, i32(range(n + 1)),
                  i32([1] * n), i32([[r + 1] for r in range(n)]), f32([0.0] * n), i32([0] * n),
                  f32([1.0] * n), f32([0.0] * n), f32([1.0] * n), np.arange(n, dtype=u64), np.zeros(n, u64),
                  i32([-1] * n), [[]] * n, [[]] * n, False, None, [], True)


def time_call(eng, masks: np.ndarray, rows: list[int], n: int, steps: int) -> float:
    """Median seconds of sample_deferred over `steps` launches (finish() outside the timing)."""
    runner, times = eng._core.runner.runner, []
    for _ in range(steps):
        launch(eng, n)
        t = time.perf_counter()
        runner.sample_deferred(masks, rows, n)
        times.append(time.perf_counter() - t)
        runner.finish()
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()

    from llaisys.engine import Engine

    eng = Engine.from_loaded(shapes.random_loaded(SHAPE, "f32", name="deferred-sampling"), device=args.device,
                             dtype="f32", max_seq_len=64, progress=False, overlap_steps=True,
                             max_num_seqs=max(args.batch))
    W, rng = (SHAPE["vocab_size"] + 31) // 32, np.random.default_rng(0)
    print(f"{args.device}, vocab {SHAPE['vocab_size']}, load average {os.getloadavg()[0]:.2f}")
    for n in args.batch:
        # a few hundred allowed tokens a row, as a JSON grammar's string or number states allow
        masks = np.where(rng.random((n, W)) < 0.05, rng.integers(-2**31, 2**31, (n, W)), 0).astype(np.int32)
        every = time_call(eng, masks, list(range(n)), n, args.steps)
        half = time_call(eng, np.ascontiguousarray(masks[::2]), list(range(0, n, 2)), n, args.steps)
        print(f"batch {n:3d}: sample_deferred {every * 1e3:.3f} ms with every row masked, {half * 1e3:.3f} ms "
              f"with every other row (median of {args.steps})", flush=True)
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
