"""CPU decode speed when other processes use the CPU (issue 16, item 2).

    LLAISYS_BUILD_DIR=build/h1 python bench/cpu_contention.py [--model NAME] [--tokens 64] [--repeats 3]

Greedy decode tok/s of a real model on the CPU in four conditions, each in a fresh process:
  idle          nothing else running
  busy-loop     beside one process spinning a Python `while True` loop
  engine        beside a second engine process decoding the same model without pause
  1-thread      idle, with the pool forced to one thread (LLAISYS_NUM_THREADS=1, an A/B switch only)
and the ratio of each to idle and to 1-thread. The target: busy-loop >= 0.45x idle, and no condition
below 1-thread. Other work on the machine (compilers, other users) shows up as noise: repeat runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_DIR = os.path.join(HERE, "..", "python")
PROMPT = "def quicksort(arr):"


def decode_rate(engine, tokens: int) -> float:
    r = engine.generate(PROMPT, max_new_tokens=tokens, temperature=0, ignore_eos=True)
    return r.timings["decode_tokens_per_s"]


def worker(args) -> int:
    """Loads the model, then either prints `ready` and decodes forever (a contender) or prints the
    median decode tok/s over the repeats as JSON (a measurement)."""
    sys.path.insert(0, PYTHON_DIR)
    import llaisys

    engine = llaisys.Engine(args.model, device="cpu", progress=False)
    decode_rate(engine, 8)  # warm-up: first-touch of the weights and the cache
    if args.role == "contender":
        print("ready", flush=True)
        while True:
            decode_rate(engine, args.tokens)
    rates = [decode_rate(engine, args.tokens) for _ in range(args.repeats)]
    threads = llaisys.build_info().get("cpu_threads")
    print(json.dumps({"median": statistics.median(rates), "rates": rates, "threads": threads}), flush=True)
    return 0


def start_contender(kind: str, args) -> subprocess.Popen:
    if kind == "busy-loop":
        return subprocess.Popen([sys.executable, "-c", "while True: pass"])
    p = subprocess.Popen([sys.executable, __file__, "--role", "contender", "--model", args.model,
                          "--tokens", str(args.tokens)], stdout=subprocess.PIPE, text=True)
    if p.stdout.readline().strip() != "ready":
        raise RuntimeError("the contending engine did not start")
    return p


def measure(condition: str, args) -> dict:
    env = dict(os.environ)
    if condition == "1-thread":
        env[args.single_thread_env] = "1"
    contender = start_contender(condition, args) if condition in ("busy-loop", "engine") else None
    try:
        time.sleep(0.5)  # let the contender reach its steady state
        out = subprocess.run([sys.executable, __file__, "--role", "measure", "--model", args.model, "--tokens",
                              str(args.tokens), "--repeats", str(args.repeats)],
                             env=env, check=True, stdout=subprocess.PIPE, text=True).stdout
    finally:
        if contender is not None:
            contender.kill()
            contender.wait()
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per timed generate")
    ap.add_argument("--repeats", type=int, default=3, help="timed generates per condition (the median is shown)")
    ap.add_argument("--single-thread-env", default="LLAISYS_NUM_THREADS",
                    help="variable set to 1 for the 1-thread row (OMP_NUM_THREADS for an OpenMP build)")
    ap.add_argument("--role", choices=["measure", "contender"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        return worker(args)

    results = {c: measure(c, args) for c in ("idle", "busy-loop", "engine", "1-thread")}
    idle, single = results["idle"]["median"], results["1-thread"]["median"]
    print(f"model {args.model}, {args.tokens} new tokens, median of {args.repeats}, "
          f"{len(os.sched_getaffinity(0))} cores, pool threads {results['idle']['threads']}")
    print(f"{'condition':<10} {'tok/s':>7} {'x idle':>7} {'x 1-thread':>10}  runs")
    for c, r in results.items():
        runs = " ".join(f"{x:.1f}" for x in r["rates"])
        print(f"{c:<10} {r['median']:7.1f} {r['median'] / idle:7.2f} {r['median'] / single:10.2f}  {runs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
