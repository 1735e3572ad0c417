"""CPU decode speed when other processes use the CPU (issue 16, item 2), llaisys and llama.cpp side by side.

    LLAISYS_BUILD_DIR=build/h1 python bench/cpu_contention.py [--model NAME] [--tokens 64] [--repeats 3]
        [--engines llaisys llama.cpp] [--threads N] [--dtype auto|quantized|bf16|f32] [--json FILE]

Greedy decode tok/s of a real model on the CPU in six conditions, each in a fresh process:
  idle                nothing else running
  busy-loop           beside one process spinning a Python `while True` loop
  engine              beside a second process of the same engine decoding the same model without pause
  1-thread            idle, with one thread (llaisys: LLAISYS_NUM_THREADS=1, an A/B switch only; llama.cpp:
                      n_threads=1)
  1-thread busy-loop  one thread, beside the same busy loop
  1-thread engine     one thread, beside the same second engine (which keeps the default threads, as in
                      `engine`)
and the ratio of each to idle and to 1-thread, then "N threads / 1 thread, same contender": each of the
first three over its 1-thread row beside the same contender. The target: busy-loop >= 0.45x idle, and no
condition below 1-thread (compared beside the same contender, the last table). llama.cpp (llama-cpp-python,
when installed) runs the same GGUF file with the same prompt, token count and threads (n_threads =
n_threads_batch = llaisys' pool size, the cores of this process, unless --threads), greedy, EOS ignored.
Other work on the machine (compilers, other users) shows up as noise: repeat runs. --json FILE also writes
every rate and ratio.

--interleaved ROUNDS measures llaisys alone, in this process, in rounds that switch the pool's mode
(llaisys_bench/pool_ab.py says why): beside each contender (none, a busy loop, a second engine in its default
adaptive pool) the adaptive pool against the caller alone ('serial': single-thread speed), idle also against
the workers always ('parallel') and 'serial' against a 1-thread process, and idle prefill adaptive against
'parallel'; the median tok/s, and per-round ratios (median, 25-75% range, rounds below 1).
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
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


def prefill_rate(engine, counter=itertools.count()) -> float:
    """Prefill tok/s of a ~128-token prompt whose first line differs every call: no prefix-cache hit."""
    r = engine.generate(f"# {next(counter)}\n" + PROMPT * 24, max_new_tokens=1, temperature=0)
    return r.timings["prefill_tokens_per_s"]


def llaisys_decoder(args):
    """(decode(tokens) -> tok/s, thread count) of llaisys."""
    import llaisys

    engine = llaisys.Engine(args.model, device="cpu", dtype=args.dtype, progress=False)
    return (lambda tokens: decode_rate(engine, tokens)), llaisys.build_info().get("cpu_threads")


def llama_cpp_decoder(args):
    """The same for llama.cpp: greedy Llama.generate (it never stops at EOS), timed like llaisys' request
    timings: (new tokens - 1) / time from the first token to the last."""
    from llama_cpp import Llama

    from llaisys import catalog
    from llaisys_bench.peers import llama_cpp_timed  # this script's folder is sys.path[0]

    threads = args.threads or len(os.sched_getaffinity(0))  # llaisys' pool default (llama-cpp-python's: cores / 2)
    llm = Llama(model_path=catalog.resolve(args.model), n_threads=threads, n_threads_batch=threads,
                n_ctx=512, seed=0, verbose=False)
    prompt = llm.tokenize(PROMPT.encode(), add_bos=False)

    def rate(tokens: int) -> float:
        return (tokens - 1) / llama_cpp_timed(llm, prompt, tokens)[1]

    return rate, threads


def worker(args) -> int:
    """Loads the model, then either prints `ready` and decodes forever (a contender) or prints the
    median decode tok/s over the repeats as JSON (a measurement)."""
    try:
        import llaisys  # noqa: F401
    except ImportError:  # a checkout without the package installed
        sys.path.insert(0, PYTHON_DIR)
    rate, threads = (llama_cpp_decoder if args.engine == "llama.cpp" else llaisys_decoder)(args)
    rate(8)  # warm-up: first-touch of the weights and the cache
    if args.role == "contender":
        print("ready", flush=True)
        while True:
            rate(args.tokens)
    rates = [rate(args.tokens) for _ in range(args.repeats)]
    print(json.dumps({"median": statistics.median(rates), "rates": rates, "threads": threads}), flush=True)
    return 0


def _worker_cmd(role: str, engine: str, args, threads: int | None) -> list[str]:
    cmd = [sys.executable, __file__, "--role", role, "--engine", engine, "--model", args.model, "--tokens",
           str(args.tokens), "--repeats", str(args.repeats), "--dtype", args.dtype]
    return cmd + (["--threads", str(threads)] if threads else [])


def start_contender(kind: str, engine: str, args) -> subprocess.Popen:
    if kind == "busy-loop":
        return subprocess.Popen([sys.executable, "-c", "while True: pass"])
    p = subprocess.Popen(_worker_cmd("contender", engine, args, args.threads), stdout=subprocess.PIPE, text=True,
                         env=_env(engine, args.threads, args))
    if p.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the contending {engine} did not start")
    return p


def _env(engine: str, threads: int | None, args) -> dict:
    env = dict(os.environ)
    if engine == "llaisys" and threads:
        env[args.single_thread_env if threads == 1 else "LLAISYS_NUM_THREADS"] = str(threads)
    return env


# condition: (contender or None, whether the measured engine runs on one thread). A 1-thread row beside a
# contender has the same contender as the row of the engine's own threads, so the two compare like with like.
CONDITIONS = {
    "idle": (None, False),
    "busy-loop": ("busy-loop", False),
    "engine": ("engine", False),
    "1-thread": (None, True),
    "1-thread busy-loop": ("busy-loop", True),
    "1-thread engine": ("engine", True),
}
SAME_CONTENDER = {"none": ("idle", "1-thread"), "busy-loop": ("busy-loop", "1-thread busy-loop"),
                  "engine": ("engine", "1-thread engine")}  # contender: (own threads, one thread)


def measure(engine: str, condition: str, args) -> dict:
    kind, single = CONDITIONS[condition]
    threads = 1 if single else args.threads
    contender = start_contender(kind, engine, args) if kind else None
    try:
        time.sleep(0.5)  # let the contender reach its steady state
        out = subprocess.run(_worker_cmd("measure", engine, args, threads), env=_env(engine, threads, args),
                             check=True, stdout=subprocess.PIPE, text=True).stdout
    finally:
        if contender is not None:
            contender.kill()
            contender.wait()
    return json.loads(out.strip().splitlines()[-1])


def _columns(results: dict, c: str) -> str:
    r, idle, single = results[c], results["idle"]["median"], results["1-thread"]["median"]
    return f"{r['median']:7.1f} {r['median'] / idle:7.2f} {r['median'] / single:10.2f}"


def same_contender(results: dict) -> dict:
    """{contender: decode with the engine's own threads / with one thread, beside that same contender}."""
    return {kind: results[own]["median"] / results[one]["median"] for kind, (own, one) in SAME_CONTENDER.items()}


def interleaved(args, ap) -> int:
    if args.interleaved < 2 or args.engines not in (None, ["llaisys"]) or args.threads:
        ap.error("--interleaved needs ROUNDS >= 2, llaisys alone and the default threads")
    try:
        import llaisys
    except ImportError:  # a checkout without the package installed
        sys.path.insert(0, PYTHON_DIR)
        import llaisys
    from llaisys_bench import pool_ab

    engine = llaisys.Engine(args.model, device="cpu", dtype=args.dtype, progress=False)
    timed = {"decode": lambda tokens: decode_rate(engine, tokens), "prefill": lambda _: prefill_rate(engine)}
    return pool_ab.main(args, timed, start_contender, PYTHON_DIR, PROMPT)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per timed generate")
    ap.add_argument("--repeats", type=int, default=3, help="timed generates per condition (the median is shown)")
    ap.add_argument("--engines", nargs="+", choices=["llaisys", "llama.cpp"],
                    help="default: llaisys, and llama.cpp when llama-cpp-python is installed")
    ap.add_argument("--threads", type=int, help="threads of each engine (default: the cores of this process)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "quantized", "bf16", "f32"], help="llaisys' dtype")
    ap.add_argument("--single-thread-env", default="LLAISYS_NUM_THREADS",
                    help="variable set to 1 for llaisys' 1-thread row (OMP_NUM_THREADS for an OpenMP build)")
    ap.add_argument("--json", metavar="FILE", help="also write every rate and ratio to FILE")
    ap.add_argument("--interleaved", type=int, metavar="ROUNDS",
                    help="llaisys only: in-process rounds that interleave the pool's modes (see above)")
    ap.add_argument("--role", choices=["measure", "contender"], help=argparse.SUPPRESS)
    ap.add_argument("--engine", default="llaisys", choices=["llaisys", "llama.cpp"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tokens < 2 or args.repeats < 1 or (args.threads is not None and args.threads < 1):
        ap.error("--tokens must be >= 2, --repeats and --threads >= 1")
    if args.role:
        return worker(args)
    if args.interleaved is not None:
        return interleaved(args, ap)
    engines = args.engines or ["llaisys"]
    if args.engines is None and importlib.util.find_spec("llama_cpp") is not None:
        engines.append("llama.cpp")
    elif args.engines is None:
        print("llama.cpp: skipped, llama-cpp-python is not installed (pip install llama-cpp-python)")
    if "llama.cpp" in engines and importlib.util.find_spec("llama_cpp") is None:
        ap.error("--engines llama.cpp needs llama-cpp-python (pip install llama-cpp-python)")

    results = {e: {c: measure(e, c, args) for c in CONDITIONS} for e in engines}
    threads = ", ".join(f"{e} {results[e]['idle']['threads']}" for e in engines)
    print(f"model {args.model} (llaisys dtype {args.dtype}), {args.tokens} new tokens, median of {args.repeats}, "
          f"{len(os.sched_getaffinity(0))} cores, threads: {threads}")
    head = " | ".join(f"{e + ' tok/s':>15} {'x idle':>7} {'x 1-thread':>10}" for e in engines)
    both = len(engines) == 2
    print(f"{'condition':<18} {head}" + ("  llaisys/llama.cpp" if both else ""))
    for c in CONDITIONS:
        row = " | ".join(f"{'':>8}{_columns(results[e], c)}" for e in engines)
        ratio = f"  {results['llaisys'][c]['median'] / results['llama.cpp'][c]['median']:17.2f}x" if both else ""
        print(f"{c:<18} {row}{ratio}")
    ratios = {e: same_contender(results[e]) for e in engines}
    print(f"{'same contender':<18} " + " | ".join(
        f"{e + ' ' + str(results[e]['idle']['threads']) + ' threads / 1 thread':>34}" for e in engines))
    for kind in SAME_CONTENDER:
        print(f"{kind:<18} " + " | ".join(f"{ratios[e][kind]:33.2f}x" for e in engines))
    for e in engines:
        print(f"{e} runs: " + "; ".join(f"{c} " + " ".join(f"{x:.1f}" for x in results[e][c]["rates"])
                                      for c in CONDITIONS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "dtype": args.dtype, "tokens": args.tokens, "repeats": args.repeats,
                       "cores": len(os.sched_getaffinity(0)), "results": results,
                       "same_contender": ratios}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
