#!/usr/bin/env python3
"""Host memory of an Engine on the CPU: peak RSS while loading, and RSS after load, after one generate and
after `del engine` + gc, each dtype in a fresh process (a process's peak never goes down).

    LLAISYS_BUILD_DIR=build/dev PYTHONPATH=python python bench/memory.py [--model M] [--dtype auto f32]

RSS splits into anonymous memory (the model's own buffers, dequantized copies) and file-backed pages
(the mapped checkpoint, counted while mapped and touched). Numbers are MB (10^6 bytes).
"""
import argparse
import json
import os
import subprocess
import sys

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
    engine = llaisys.Engine(model, device="cpu", dtype=dtype, progress=False)
    stages["loaded"] = _status()
    engine.generate("def fib(n):", max_new_tokens=16, temperature=0)
    stages["generated"] = _status()
    del engine
    gc.collect()
    stages["deleted"] = _status()
    return stages


def run(model: str, dtype: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", model, "--dtype", dtype]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--dtype", nargs="+", default=["auto", "f32"])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.dtype[0])))
        return 0
    print(f"{'dtype':<5} {'peak':>7} | {'after load (anon/file)':>24} | {'after generate':>14} | "
          f"{'after del + gc':>14}   MB RSS, {args.model}, CPU")
    for dtype in args.dtype:
        s = run(args.model, dtype)
        load, gen, gone = s["loaded"], s["generated"], s["deleted"]
        print(f"{dtype:<5} {gone['VmHWM']:7.0f} | {load['VmRSS']:7.0f} ({load['RssAnon']:5.0f}/{load['RssFile']:5.0f})"
              f"{'':>3} | {gen['VmRSS']:14.0f} | {gone['VmRSS']:14.0f}   (after import: {s['imported']['VmRSS']:.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
