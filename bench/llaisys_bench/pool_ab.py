"""Interleaved A/B of the CPU pool's modes in one process beside one contender (`cpu_contention.py
--interleaved`).

Why: decode speeds measured in separate processes at separate times drift on a shared machine as much as
the effect looked for (idle alone 46.5-62.3 tok/s in one session). Here one engine decodes in rounds; each
round runs every compared mode once, back to back, in alternating order (A B, B A, ...), so a drift of the
machine hits both sides of a round alike, and the per-round ratios A/B show the effect and its spread.
Decode is timed by the request's decode rate; "prefill" times 128-token prompts that differ from their first
token on (no prefix-cache hit) by the request's prefill rate.

A mode is `_core.set_pool_mode`'s 'adaptive', 'serial' (the caller alone: one thread) or 'parallel', set
without restarting the adaptive choice (so 'adaptive' is the pool of a long-running engine), or
'1-thread process': a second process with LLAISYS_NUM_THREADS=1 that decodes when asked (the check that
in-process 'serial' is a fair stand-in for single-thread speed).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

PEER = "1-thread process"
PEER_CODE = """
import sys
import llaisys
engine = llaisys.Engine(sys.argv[1], device="cpu", dtype=sys.argv[2], progress=False)
for line in sys.stdin:
    r = engine.generate(sys.argv[3], max_new_tokens=int(line), temperature=0, ignore_eos=True)
    print(r.timings["decode_tokens_per_s"], flush=True)
"""


class OneThreadPeer:
    """A process of the engine with one thread that decodes `tokens` greedily each time it is asked."""

    def __init__(self, model: str, dtype: str, prompt: str, python_dir: str):
        env = dict(os.environ, LLAISYS_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(p for p in (python_dir, os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen([sys.executable, "-c", PEER_CODE, model, dtype, prompt], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def rate(self, tokens: int) -> float:
        self.proc.stdin.write(f"{tokens}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the 1-thread peer process ended")
        return float(line)

    def close(self):
        self.proc.kill()
        self.proc.wait()


def run_rounds(decode, modes: list[str], rounds: int, tokens: int, peer: OneThreadPeer | None = None) -> dict:
    """{mode: [decode tok/s per round]} and the pool's stats of each in-process mode summed over the rounds.
    decode(tokens) -> tok/s runs in this process; round i runs the modes in order, reversed when i is odd."""
    from llaisys import _core

    rates = {m: [] for m in modes}
    stats = {m: {} for m in modes if m != PEER}
    for i in range(rounds):
        for mode in modes if i % 2 == 0 else modes[::-1]:
            if mode == PEER:
                rates[mode].append(peer.rate(tokens))
                continue
            _core.set_pool_mode(mode, restart=False)
            before = _core.pool_stats()
            rates[mode].append(decode(tokens))
            after = _core.pool_stats()
            for k in after:
                stats[mode][k] = stats[mode].get(k, 0) + after[k] - before[k]
    _core.set_pool_mode("adaptive", restart=False)
    return {"rates": rates, "pool_stats": stats}


def ratio_summary(a: list[float], b: list[float]) -> dict:
    """Per-round a/b: the median, the 25-75% range, and how many rounds a was below b."""
    ratios = [x / y for x, y in zip(a, b)]
    q1, q2, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return {"median": q2, "q1": q1, "q3": q3, "below_1": sum(r < 1 for r in ratios), "rounds": len(ratios)}


def report(contender: str, result: dict, pairs: list[tuple[str, str]]) -> dict:
    """Prints the medians and the per-round ratios of `pairs` (a, b); returns the summaries."""
    rates = result["rates"]
    med = "  ".join(f"{m} {statistics.median(r):.1f}" for m, r in rates.items())
    print(f"{contender:<10} median tok/s: {med}")
    out = {}
    for a, b in pairs:
        s = out[f"{a} / {b}"] = ratio_summary(rates[a], rates[b])
        print(f"{'':<10} {a} / {b}: median {s['median']:.3f}x, 25-75% {s['q1']:.3f}-{s['q3']:.3f}, "
              f"below 1 in {s['below_1']} of {s['rounds']} rounds")
    st = result["pool_stats"]["adaptive"]
    jobs = st["parallel_jobs"] + st["serial_jobs"]
    print(f"{'':<10} adaptive pool: {st['serial_jobs'] / max(jobs, 1):.0%} of {jobs} jobs on the caller alone, "
          f"{st['probes']} probes, {st['switches_to_serial']} switches to it")
    return out


# name: (contender or None, what is timed, the modes compared round by round, the pairs reported)
PLANS = {
    "idle": (None, "decode", ["adaptive", "parallel", "serial", PEER],
             [("adaptive", "parallel"), ("adaptive", "serial"), ("serial", PEER)]),
    "prefill": (None, "prefill", ["adaptive", "parallel"], [("adaptive", "parallel")]),
    "busy-loop": ("busy-loop", "decode", ["adaptive", "serial", "parallel"],
                  [("adaptive", "serial"), ("adaptive", "parallel")]),
    "engine": ("engine", "decode", ["adaptive", "serial", "parallel"],
               [("adaptive", "serial"), ("adaptive", "parallel")]),
}


def main(args, timed: dict, start_contender, python_dir: str, prompt: str) -> int:
    """Every plan in turn: start its contender, warm up, run the rounds, report; --json also writes it all.
    timed: {"decode" / "prefill": fn(tokens) -> tok/s} of the engine in this process."""
    peer = OneThreadPeer(args.model, args.dtype, prompt, python_dir)
    results = {}
    try:
        peer.rate(8)  # loads its model before any round
        for name, (contender, what, modes, pairs) in PLANS.items():
            proc = start_contender(contender, "llaisys", args) if contender else None
            try:
                for mode in modes:  # warm-up: the contender's steady state, each mode's first touches
                    run_rounds(timed[what], [mode], 1, 8, peer)
                r = run_rounds(timed[what], modes, args.interleaved, args.tokens, peer)
            finally:
                if proc is not None:
                    proc.kill()
                    proc.wait()
            results[name] = dict(r, ratios=report(name, r, pairs))
    finally:
        peer.close()
    idle = statistics.median(results["idle"]["rates"]["adaptive"])
    print("adaptive x idle adaptive: " + ", ".join(
        f"{c} {statistics.median(results[c]['rates']['adaptive']) / idle:.2f}" for c in ("busy-loop", "engine")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "dtype": args.dtype, "tokens": args.tokens, "rounds": args.interleaved,
                       "results": results}, f, indent=2)
    return 0
