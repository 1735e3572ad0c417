"""A quick end-to-end check of tensor parallelism on this machine's GPUs, stage by stage (eager steps, then
CUDA graphs, then overlapped decode), each against the same model on one GPU: what bench/gpu_check.sh runs
first in its tp step, under a watchdog that records every thread's stack if a stage hangs.

    python bench/tp_smoke.py [--tp 2]
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llaisys_bench.shapes import random_loaded  # noqa: E402

from llaisys.engine import Engine  # noqa: E402

SHAPE = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
             max_position_embeddings=2048)
STAGES = {"eager": dict(cuda_graphs=False, overlap_steps=False), "graphs": dict(cuda_graphs=True, overlap_steps=False),
          "overlap": dict(cuda_graphs=True, overlap_steps=True)}


def run(tp: int, settings: dict, dtype: str) -> list[list[int]]:
    prompts = [[(7 * i + 3 * k) % 4000 for i in range(n)] for k, n in enumerate((5, 40, 130))]
    with Engine.from_loaded(random_loaded(SHAPE, dtype, name="tiny"), device="cuda", dtype=dtype,
                            progress=False, tensor_parallel_size=tp, tp_timeout_s=60, **settings) as eng:
        return [r.token_ids for r in eng.generate(prompts, max_new_tokens=24, temperature=0, ignore_eos=True)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"],
                    help="f32 (default): sums in another order differ by ~1e-6, so tokens must be equal; in bf16 "
                         "a near-tie may flip a token")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(100, exit=False)
    for name, settings in STAGES.items():
        t = time.perf_counter()
        one = run(1, settings, args.dtype)
        split = run(args.tp, settings, args.dtype)
        firsts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(one, split)]
        where = "" if split == one else f" (first difference at token {firsts} of each prompt)"
        print(f"tp_smoke {name}: tp={args.tp} {args.dtype} {'equal' if split == one else 'DIFFERENT'} tokens{where}, "
              f"{time.perf_counter() - t:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
