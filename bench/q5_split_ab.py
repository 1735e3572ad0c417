#!/usr/bin/env python3
"""Whole-model decode A/B of the Q5_0 split layout (QuantLayout::Q5Split) in one process: the default model
loaded twice, once with the file's Q5_0 blocks (quant.set_cpu_split(False)) and once split, decoding in turn
the same greedy request (128 fresh prompt ids, ignore_eos); per round each engine's decode and prefill tok/s
(the request's own timings), medians and per-round ratios.
Both engines share the process, the thread pool and the neighbours, so the ratio is robust to a shared box's
load in a way two processes' are not.

    LLAISYS_NUM_THREADS=2 LLAISYS_BUILD_DIR=build/dev PYTHONPATH=python:bench python bench/q5_split_ab.py [ROUNDS] [NEW]
"""
import os
import statistics
import sys

from llaisys import quant
from llaisys.engine import Engine

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 8
new = int(sys.argv[2]) if len(sys.argv) > 2 else 128
model = os.environ.get("MODEL", "qwen2.5-coder-0.5b-instruct")
engines = {}
for label, split in (("file", False), ("split", True)):
    quant.set_cpu_split(split)
    engines[label] = Engine(model, device="cpu", dtype="auto", max_seq_len=512, progress=False)
quant.set_cpu_split(True)
kw = dict(temperature=0, ignore_eos=True)
for eng in engines.values():
    eng.generate(list(range(500, 628)), max_new_tokens=8, **kw)  # warm-up
rates = {k: [] for k in engines}
prefill = {k: [] for k in engines}
for r in range(rounds):
    order = list(engines) if r % 2 == 0 else list(reversed(engines))
    for label in order:
        prompt = [int(t) for t in range(1000 + 131 * r, 1128 + 131 * r)]  # fresh ids: no prefix-cache hit
        t = engines[label].generate(prompt, max_new_tokens=new, **kw).timings
        rates[label].append(t["decode_tokens_per_s"])
        prefill[label].append(t["prefill_tokens_per_s"])
    print(f"round {r} load {os.getloadavg()[0]:.1f}: " +
          "  ".join(f"{k} {rates[k][-1]:.1f} (prefill {prefill[k][-1]:.0f})" for k in engines), flush=True)
ratio = [s / f for s, f in zip(rates["split"], rates["file"])]
for k, v in rates.items():
    print(f"{k:5s} decode tok/s median {statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})")
print(f"split / file decode per round: median {statistics.median(ratio):.3f} ({min(ratio):.3f}-{max(ratio):.3f})")
pr = [s / f for s, f in zip(prefill["split"], prefill["file"])]
print(f"split / file prefill per round: median {statistics.median(pr):.3f} ({min(pr):.3f}-{max(pr):.3f})")
