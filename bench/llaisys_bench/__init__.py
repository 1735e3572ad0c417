"""The benchmark code of llaisys: what `llaisys bench` and the scripts of bench/ run.

It lives in a source checkout, not in the installed package (issue 17: a wheel ships no benchmark code), so it
may use the checkout's other files: bench/random_gguf.py and tests/tiny_model.py.

- shapes: real Qwen2 shapes and random weights of them (no download)
- one_request: `llaisys bench`, one request's prefill and decode against the weight-bandwidth roofline
- throughput: `llaisys bench --throughput`, nano-vllm's batched protocol
- peers: llama.cpp and HF transformers timed like llaisys

Importing this package needs its folder (bench/) on sys.path: a bench/*.py script has it as its own folder,
`llaisys bench` puts it there, tests/conftest.py too.
"""
from __future__ import annotations

import importlib.util
import os
import sys

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(BENCH_DIR)

if importlib.util.find_spec("llaisys") is None:  # a checkout without llaisys installed: use its sources
    sys.path.insert(0, os.path.join(ROOT, "python"))


def checkout_module(rel: str, name: str):
    """The module of the checkout's file `rel` (a path from the checkout's root), imported once as `name`."""
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(ROOT, rel)
    if not os.path.exists(path):
        raise RuntimeError(f"{path} is missing: the benchmarks need the whole source checkout of llaisys, not "
                           f"bench/ alone")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def random_gguf_module():
    """bench/random_gguf.py (the random GGUF writer of --gguf-types), loaded once."""
    return checkout_module(os.path.join("bench", "random_gguf.py"), "llaisys_random_gguf")


def resolve_device(device: str) -> str:
    """auto -> cuda:0 when this build sees a GPU, else cpu; cuda -> cuda:0."""
    if device == "auto":
        from llaisys import cuda_is_available

        return "cuda:0" if cuda_is_available() else "cpu"
    return "cuda:0" if device == "cuda" else device
