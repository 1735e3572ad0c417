#!/usr/bin/env python3
"""Interleaved CPU rounds on the catalog's gemma-3-270m: one or more llaisys builds (label=BUILD_DIR, each run
with LLAISYS_BUILD_DIR set) and llama.cpp, each in its own process, on the same prompt ids; prints per-round rows
and medians (ranges) with ratios to llama.cpp. For a shared box, where only side-by-side runs compare.

    LLAISYS_BUILD_DIR=build/dev PYTHONPATH=python:bench:/path/to/llama-site \\
        python bench/cpu_rounds.py THREADS ROUNDS NEW_TOKENS base=/tmp/base_build new=build/dev
"""
import json, os, statistics, sys
from llaisys_bench.one_request import run_isolated, catalog_path
from llaisys_bench.peers import run_llama_cpp
threads, rounds, new = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
builds = dict(a.split("=", 1) for a in sys.argv[4:])  # label=build_dir
path = catalog_path("gemma-3-270m")
kw = dict(shape=None, model="gemma-3-270m", device="cpu", dtype="auto", prompt_len=128, new_tokens=new)
rows = {k: [] for k in list(builds) + ["llama.cpp"]}
loads = []
for r in range(rounds):
    la = os.getloadavg()[0]
    line = []
    for label, bdir in builds.items():
        os.environ["LLAISYS_BUILD_DIR"] = bdir
        ours = run_isolated(kw, threads)
        rows[label].append(ours)
        line.append(f"{label} {ours['prefill_tok_s']:.1f}/{ours['decode_tok_s']:.1f}/{ours['peak_rss_mb']:.0f}")
    peer = run_llama_cpp(ours, path, threads)
    rows["llama.cpp"].append(peer)
    line.append(f"llama.cpp {peer['prefill_tok_s']:.1f}/{peer['decode_tok_s']:.1f}/{peer['peak_rss_mb']:.0f}")
    loads.append((la, os.getloadavg()[0]))
    print(f"round {r} load {la:.1f}-{loads[-1][1]:.1f}: " + " | ".join(line), flush=True)
if os.environ.get("ROUNDS_JSON"):
    json.dump({"rows": rows, "loads": loads}, open(os.environ["ROUNDS_JSON"], "w"))
def med(xs): return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"
peer = rows["llama.cpp"]
for k in ("prefill_tok_s", "decode_tok_s", "peak_rss_mb"):
    for label in rows:
        s = f"{k:14s} {label:10s} {med([a[k] for a in rows[label]])}"
        if label != "llama.cpp":
            s += f"  ratio {med([a[k] / b[k] for a, b in zip(rows[label], peer)])}"
        print(s)
print("load", min(l for p in loads for l in p), max(l for p in loads for l in p))
