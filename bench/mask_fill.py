"""Host time of one step's token masks for B constrained rows (issue 31): the rows one after another
(Constraint.mask_into, what ModelRunner._masks did before) against constraints.MaskFiller (llguidance's
LLExecutor: the rows on a thread pool, the GIL released), on the same matchers in the same states; and
the time of advancing the matchers with the step's tokens: each row's consume and its done/error checks one
after another (what the engine does; llguidance's pooled consume_token_par was 0.45-0.68x as fast with two
threads here, session 29, and was removed). Each row follows the bench/structured.py schema, advanced by a random
allowed token a step, so the rows sit at different places of the grammar, as a batch's do. Prints ms per step (median over the steps) for each, on
two sets of matchers in the same states (a second mask of one state would find llguidance's caches warm).

    LLAISYS_BUILD_DIR=build/dev PYTHONPATH=python python bench/mask_fill.py --batch 1 16 64
    python bench/mask_fill.py --shape qwen2-0.5b --batch 1 16 64      # no model file (the test tokenizer)
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from llaisys_bench.throughput import open_engine  # this folder is sys.path[0] when run as a script
from structured import SCHEMA


def random_allowed(rng, masks: np.ndarray, vocab: int) -> list[int]:
    """A random allowed token of each row of masks ([rows, ceil(vocab / 32)] int32 bitmasks)."""
    bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return [int(rng.choice(np.flatnonzero(row))) for row in bits]


def setup(args):
    """(engine on the CPU, vocabulary size, llguidance tokenizer, the SCHEMA's grammar, a MaskFiller) for
    --model/--shape and --threads (bench/host_path.py uses it too)."""
    from llaisys import catalog, constraints

    eng = open_engine(args.shape, None if args.shape else (args.model or catalog.DEFAULT_MODEL), device="cpu",
                      checkpoint=bool(args.shape))[0]
    return (eng, eng.config.vocab_size, eng._admit.ll_tokenizer(), constraints.compile_constraint(json_schema=SCHEMA),
            constraints.MaskFiller(args.threads))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--shape", default=None, help="a random checkpoint of this shape (the test tokenizer)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=None, help="LLExecutor threads (default: llguidance's)")
    args = ap.parse_args()

    from llaisys import constraints

    eng, vocab, lltok, grammar, filler = setup(args)
    W = (vocab + 31) // 32
    print(f"{os.cpu_count()} CPUs, vocab {vocab}, load average {os.getloadavg()[0]:.2f}")
    for batch in args.batch:
        rng = np.random.default_rng(0)
        # two sets of matchers in the same states, one per method: each state's mask is computed once by each
        # (a second mask of the same state finds llguidance's caches warm)
        cs = [constraints.Constraint(lltok, grammar) for _ in range(batch)]
        ds = [constraints.Constraint(lltok, grammar) for _ in range(batch)]
        serial, par, serial_c = [], [], []
        for step in range(args.steps):
            live = [(c, d) for c, d in zip(cs, ds) if not c.done]
            if not live:
                break
            a, b = np.empty((len(live), W), np.int32), np.empty((len(live), W), np.int32)

            def one_by_one():
                t = time.perf_counter()
                for j, (c, _) in enumerate(live):
                    c.mask_into(a[j])
                serial.append(time.perf_counter() - t)

            def batched():
                t = time.perf_counter()
                filler.fill([d for _, d in live], b)
                par.append(time.perf_counter() - t)
            for f in ((one_by_one, batched) if step % 2 == 0 else (batched, one_by_one)):
                f()
            assert (a == b).all()  # the same masks
            toks = random_allowed(rng, a, vocab)

            t = time.perf_counter()  # EngineCore._advance_constrained's calls, row after row
            for (c, _), tok in zip(live, toks):
                c.consume(tok)
                c.error is None and c.done
            serial_c.append(time.perf_counter() - t)
            for (_, d), tok in zip(live, toks):
                d.consume(tok)
        s, p = statistics.median(serial) * 1e3, statistics.median(par) * 1e3
        sc = statistics.median(serial_c) * 1e3
        print(f"batch {batch:3d}: masks one after another {s:.3f} ms a step, MaskFiller {p:.3f} ms a step "
              f"(x{s / p:.2f}); consumes {sc:.3f} ms a step; {len(serial)} steps, {filler.num_threads} threads",
              flush=True)
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
