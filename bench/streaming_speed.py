"""StreamingLLM's speed target (issue 32): one sequence's decode tok/s after G generated tokens with a
rolling window W vs its speed at W tokens of dense context (target >= 0.95x: the cost stays flat), and the
eviction's cost per evicted block (the K-shift launches, timed with a synchronize on CUDA, and the host's
bookkeeping in BlockManager.slide).

    python bench/streaming_speed.py --device cuda --window 4096 --generated 32768 --shape qwen2-0.5b  # the H100 target
    python bench/streaming_speed.py --device cpu --window 256 --generated 1024       # a CPU-sized run

Both runs measure the decode rate of the last `--measure` tokens: the dense one from a prompt of W tokens
(it decodes at W..W+measure context), the windowed one after G generated tokens (sinks + W..W+block_size).
The timing wrappers add a synchronize per eviction on CUDA (one every block_size tokens): the ratio is
measured with them on, so it is a lower bound.
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def decode_rate(eng, prompt: list[int], before: int, measure: int, **window) -> float:
    """tok/s of (about) the last `measure` tokens of a greedy run that first generates `before` tokens, from
    the time each engine step's tokens were accounted and the sequence's output count then (not the step's
    produced list: a quiet row of the persistent batch is listed only when it ends, which made the dense
    run read 6.65 tok/s in session 30)."""
    core, stamps = eng._core, []
    account = core._account

    def stamped(step, tokens, t0, t1):
        produced = account(step, tokens, t0, t1)
        stamps.append((time.perf_counter(), step.seqs[0].num_output))
        return produced
    core._account = stamped
    try:
        eng.generate(prompt, max_new_tokens=before + measure, temperature=0, ignore_eos=True, **window)
    finally:
        core._account = account
    counts = np.array([k for _, k in stamps])
    n, i = int(counts[-1]), int(np.searchsorted(counts, counts[-1] - measure))
    return (n - int(counts[i])) / (stamps[-1][0] - stamps[i][0])


def time_evictions(eng) -> dict:
    """Wraps the engine's block manager and model runner: seconds in slide (host) and in the K-shift."""
    bm, runner = eng._core.blocks, eng._core.runner
    acc = {"host": 0.0, "shift": 0.0, "blocks": 0}
    slide, shift = bm.slide, runner.shift

    def timed_slide(seq, n, ahead=0):
        t0, before = time.perf_counter(), bm.evicted_blocks
        out = slide(seq, n, ahead)
        acc["host"] += time.perf_counter() - t0
        acc["blocks"] += bm.evicted_blocks - before
        return out

    def timed_shift(shifts):
        t0 = time.perf_counter()
        shift(shifts)
        if shifts and eng.device.startswith("cuda"):
            from llaisys import synchronize
            synchronize(eng.device)
        acc["shift"] += time.perf_counter() - t0

    bm.slide, runner.shift = timed_slide, timed_shift
    return acc


def main() -> None:
    import llaisys
    from llaisys import catalog

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=catalog.DEFAULT_MODEL)
    ap.add_argument("--shape", help="random weights of a real shape (bench/llaisys_bench/shapes.py), e.g. "
                                    "qwen2-0.5b on a GPU machine without the model's file")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--generated", type=int, default=1024)
    ap.add_argument("--measure", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    max_seq_len = a.window + a.measure + 64
    if a.shape:
        from llaisys_bench.shapes import SHAPES, random_loaded

        dtype = "bf16" if a.device.startswith("cuda") else "f32"
        eng = llaisys.Engine.from_loaded(random_loaded(SHAPES[a.shape], dtype, name=a.shape), device=a.device,
                                         dtype=dtype, max_seq_len=max_seq_len, progress=False)
        a.model = a.shape
    else:
        eng = llaisys.Engine(a.model, device=a.device, progress=False, max_seq_len=max_seq_len)
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, 20000, a.window)]
    acc = time_evictions(eng)
    dense, windowed = [], []
    for _ in range(a.repeats):  # alternated, best of each: a shared machine's load moves between runs
        dense.append(decode_rate(eng, prompt, 0, a.measure))
        windowed.append(decode_rate(eng, prompt[:16], a.generated, a.measure, kv_window=a.window,
                                    sink_tokens=a.sinks))
    dense, windowed = max(dense), max(windowed)
    blocks = max(acc["blocks"], 1)
    print(f"{a.model} on {eng.device}: window {a.window} + {a.sinks} sinks, block size "
          f"{eng.engine_config.block_size}")
    print(f"| dense at {a.window} context | windowed after {a.generated} generated | ratio | evicted blocks | "
          f"K-shift ms/block | host ms/block |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| {dense:.2f} tok/s | {windowed:.2f} tok/s | **{windowed / dense:.3f}** | {acc['blocks']} | "
          f"{1e3 * acc['shift'] / blocks:.3f} | {1e3 * acc['host'] / blocks:.3f} |")
    eng.close()


if __name__ == "__main__":
    main()
