#!/usr/bin/env python3
"""Interleaved CPU rounds on a catalog model (gemma-3-270m, or $MODEL, e.g. the default
qwen2.5-coder-0.5b-instruct): one or more llaisys builds (label=BUILD_DIR, each run
with LLAISYS_BUILD_DIR set and, for a BUILD_DIR inside a checkout, that checkout's python/) and llama.cpp, each in its own process, on the same prompt ids; prints per-round rows
and medians (ranges) with ratios to llama.cpp. For a shared box, where only side-by-side runs compare.

    LLAISYS_BUILD_DIR=build/dev PYTHONPATH=python:bench:/path/to/llama-site \\
        python bench/cpu_rounds.py THREADS ROUNDS NEW_TOKENS base=/tmp/base_build new=build/dev
"""
import json, os, statistics, sys
from llaisys_bench.one_request import catalog_path
from llaisys_bench.peers import child_env, run_child, run_llama_cpp
threads, rounds, new = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
builds = dict(a.split("=", 1) for a in sys.argv[4:])  # label=build_dir
model = os.environ.get("MODEL", "gemma-3-270m")
path = catalog_path(model)
kw = dict(shape=None, model=model, device="cpu", dtype="auto", prompt_len=128, new_tokens=new)
rows = {k: [] for k in list(builds) + ["llama.cpp"]}


def run_build(build: str) -> dict:
    """one_request.bench in its own process with this build's _core and, where the build dir is a checkout's
    <repo>/build/<name>, that checkout's python/ package (another branch's Python may not match this one's)."""
    env = child_env()
    env["LLAISYS_BUILD_DIR"], env["LLAISYS_NUM_THREADS"] = build, str(threads)
    package = os.path.normpath(os.path.join(os.path.abspath(build), "..", "..", "python"))
    if os.path.isdir(os.path.join(package, "llaisys")):
        env["PYTHONPATH"] = os.pathsep.join([package, env["PYTHONPATH"]])
    code = ("import json, sys; from llaisys_bench.one_request import bench; "
            "print(json.dumps(bench(**json.loads(sys.argv[1]))))")
    return run_child(code, kw, env, f"llaisys ({build})")


ref = None
loads = []
for r in range(rounds):
    la = os.getloadavg()[0]
    line = []
    order = list(builds) + ["llama.cpp"]
    if r % 2:  # odd rounds run in reverse order: whoever runs first in a round gets no systematic advantage
        order.reverse()
    for label in order:
        if label == "llama.cpp":  # needs one llaisys row (vocab, prompt length): round 0 runs llaisys first
            res = run_llama_cpp(ref, path, threads)
        else:
            res = ref = run_build(builds[label])
        rows[label].append(res)
        line.append(f"{label} {res['prefill_tok_s']:.1f}/{res['decode_tok_s']:.1f}/{res['peak_rss_mb']:.0f}")
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
