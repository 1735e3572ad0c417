#!/usr/bin/env python3
"""Host memory of an Engine on the CPU: peak RSS while loading, and RSS after load, after one generate, after
close() and after `del engine` + gc, each dtype in a fresh process (a process's peak never goes down).

    LLAISYS_BUILD_DIR=build/dev PYTHONPATH=python python bench/memory.py [--model M | --shape S] [--dtype auto f32]
        [--json FILE]

--shape S (qwen2-0.5b, qwen2-1.5b) loads a random HF checkpoint of that real Qwen2 shape instead of a model:
bf16 safetensors with every tensor its own bytes and the LM head tied to the embedding, as the real models
have (llaisys_bench.throughput.random_checkpoint; written once to the temp dir, 3.1 GB for qwen2-1.5b, and
reused; writing it needs transformers and a source checkout's tests/tiny_model.py).

RSS splits into anonymous memory (the model's own buffers, converted copies) and file-backed pages (the
mapped checkpoint, counted while mapped and touched). "model" is the weights' bytes as the engine holds them
(Engine.describe()); "KV" the KV pool it reserved (its pages count in RSS only once used). MB = 10^6 bytes.
"""
import argparse
import json
import os
import subprocess
import sys
import time

FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")


def _status() -> dict:
    """This process's RSS fields from /proc/self/status, in MB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in FIELDS:
                out[key] = int(value.split()[0]) * 1024 / 1e6  # reported in kB
    return out


def child(model: str, dtype: str) -> dict:
    import gc

    import llaisys

    stages = {"imported": _status()}
    t = time.perf_counter()
    engine = llaisys.Engine(model, device="cpu", dtype=dtype, progress=False)
    load_s = time.perf_counter() - t
    stages["loaded"] = _status()
    held = {"dtype": engine.dtype, "load_s": load_s, "weight_bytes": engine.describe()["weight_bytes"],
            "kv_bytes": sum(p.nbytes for p in engine._core.pools)}
    engine.generate("def fib(n):", max_new_tokens=16, temperature=0)
    stages["generated"] = _status()
    engine.close()
    stages["closed"] = _status()
    del engine
    gc.collect()
    stages["deleted"] = _status()
    return {"stages": stages, **held}


def run(model: str, dtype: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", model, "--dtype", dtype]
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, env=os.environ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _row(dtype: str, r: dict) -> str:
    s = r["stages"]
    load, gen, peak = s["loaded"], s["generated"], s["deleted"]["VmHWM"]
    rss = lambda st: f"{st['VmRSS']:6.0f} ({st['RssAnon']:5.0f}/{st['RssFile']:5.0f})"  # noqa: E731
    return (f"{dtype:<5} {r['weight_bytes'] / 1e6:7.0f} {r['kv_bytes'] / 1e6:5.0f} | {load['VmHWM']:9.0f} | "
            f"{rss(load)} | {rss(gen)} | {s['closed']['VmRSS']:5.0f} {s['deleted']['VmRSS']:8.0f} | "
            f"{peak:6.0f} {peak / (r['weight_bytes'] / 1e6):5.2f}x | {r['load_s']:6.1f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="catalog name, HF directory or .gguf (default: the catalog's default model)")
    src.add_argument("--shape", help="a random bf16 checkpoint of this real shape (see above)")
    p.add_argument("--dtype", nargs="+", default=["auto", "f32"])
    p.add_argument("--json", metavar="FILE", help="also write {dtype: stages and sizes} to FILE")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    model = args.model or "qwen2.5-coder-0.5b-instruct"
    if args.child:
        print(json.dumps(child(model, args.dtype[0])))
        return 0
    if args.shape:
        from llaisys_bench.throughput import random_checkpoint, shape_config

        try:
            shape_config(args.shape)
        except ValueError as e:
            p.error(f"--shape: {e}")
        model = random_checkpoint(args.shape)  # before any measurement: writing it is not part of a load
    label = f"{args.shape} (random checkpoint {model})" if args.shape else model
    print(f"MB, CPU, {label}; RSS (anon/file); load peak = VmHWM after the load, peak = VmHWM at the end")
    print(f"{'dtype':<5} {'model':>7} {'KV':>5} | {'load peak':>9} | {'after load':>20} | {'after generate':>20} | "
          f"{'close':>5} {'del + gc':>8} | {'peak':>6} {'/model':>6} | {'load s':>6}")
    results = {}
    for dtype in args.dtype:
        results[dtype] = run(model, dtype)
        print(_row(dtype, results[dtype]), flush=True)
    print(f"(RSS after import: {results[args.dtype[0]]['stages']['imported']['VmRSS']:.0f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "shape": args.shape, "dtypes": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
