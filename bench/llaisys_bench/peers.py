"""Peer engines timed like llaisys (same model, prompt ids, token counts, threads, device).

- "llama.cpp": llama-cpp-python (the binding users install; a benchmark tool here, never a dependency) on the
  same GGUF file, in a process of its own so its peak RSS is its own: Llama.generate with temp=0 (greedy),
  which never stops at EOS (only create_completion checks it), n_threads = n_threads_batch = llaisys'
  threads. Timed as the Engine times a request: TTFT = prompt evaluated + first token sampled; decode
  tok/s = (new tokens - 1) / time from the first token to the last. CPU only (a CPU build here).
- "hf-eager": HF transformers Qwen2ForCausalLM, eager attention, dynamic KV cache, a greedy loop.
- "torch-compile-static" (CUDA only): the same model with a static KV cache and
  torch.compile(mode="reduce-overhead") (CUDA graphs) on the decode step.
HF needs torch and transformers (the [test] extra); random weights for --shape, the checkpoint for --model.
A peer that is not installed is reported in one line and skipped.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time


def _hf_model(shape: str | None, model: str | None, dtype, device):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from .shapes import SHAPES

    if model is not None:
        from llaisys import catalog

        path = catalog.resolve(model)
        if path.endswith(".gguf"):
            m = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     torch_dtype=dtype)
        else:
            m = AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype)
    else:
        c = dict(SHAPES[shape or "qwen2-0.5b"])
        cfg = Qwen2Config(**c, attn_implementation="eager")
        torch.manual_seed(0)
        with torch.device("meta"):
            m = Qwen2ForCausalLM(cfg)
        # drawn where they live: 0.5B normal draws on the CPU took 34 s of the H200 host's peer start
        m = m.to_empty(device=device).to(dtype)
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.02)
        # to_empty leaves buffers computed in __init__ (RoPE's inv_freq) as uninitialised memory: compute them
        m.model.rotary_emb = type(m.model.rotary_emb)(config=m.config).to(device)
    m.config._attn_implementation = "eager"
    return m.to(device).eval()


def _sync(device: str):
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time_eager(m, prompt, new_tokens: int, device: str) -> tuple[float, float]:
    import torch

    with torch.no_grad():
        out = m(prompt[:, :8], use_cache=True)  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        out = m(prompt, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        _sync(device)
        ttft = time.perf_counter() - t0
        past = out.past_key_values
        t1 = time.perf_counter()
        for _ in range(new_tokens):
            out = m(token, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = out.logits[:, -1:].argmax(-1)
        _sync(device)
        return ttft, time.perf_counter() - t1


def _time_compiled_static(m, prompt, new_tokens: int, device: str) -> tuple[float, float]:
    import torch
    from transformers import StaticCache

    max_len = prompt.shape[1] + new_tokens + 8
    cache = StaticCache(config=m.config, max_batch_size=1, max_cache_len=max_len, device=device, dtype=m.dtype)
    step = torch.compile(m.forward, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        t0 = time.perf_counter()
        pos = torch.arange(prompt.shape[1], device=device)
        out = m(prompt, past_key_values=cache, cache_position=pos, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        _sync(device)
        ttft = time.perf_counter() - t0
        p = prompt.shape[1]
        for i in range(3):  # compile and record the graphs outside the timed region
            out = step(token, past_key_values=cache, cache_position=torch.tensor([p + i], device=device), use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        _sync(device)
        p += 3
        t1 = time.perf_counter()
        for i in range(new_tokens):
            out = step(token, past_key_values=cache, cache_position=torch.tensor([p + i], device=device), use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        _sync(device)
        return ttft, time.perf_counter() - t1


def run_peers(ours: dict, shape: str | None = None, model: str | None = None, threads: int | None = None) -> list[dict]:
    """The HF rows (in this process)."""
    import torch

    device, n, plen = ours["device"], ours["new_tokens"], ours["prompt_len"]
    # llaisys keeping a GGUF's blocks has no HF counterpart: HF runs the dequantized model in bf16 then
    dtype = {"auto": torch.bfloat16, "quantized": torch.bfloat16, "bf16": torch.bfloat16, "f16": torch.float16,
             "f32": torch.float32}[ours["dtype"]]
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    m = _hf_model(shape, model, dtype, device)
    prompt = torch.randint(0, m.config.vocab_size, (1, plen), device=device)
    runs = [("hf-eager", _time_eager)]
    if device.startswith("cuda"):
        runs.append(("torch-compile-static", _time_compiled_static))
    rows = []
    for name, fn in runs:
        try:
            ttft, decode_s = fn(m, prompt, n, device)
        except Exception as e:  # a peer that fails is reported, not fatal to the benchmark
            print(f"  peer {name} failed: {type(e).__name__}: {e}")
            continue
        row = {"engine": name, "model": ours["model"], "device": device, "dtype": ours["dtype"], "prompt_len": plen,
               "new_tokens": n, "ttft_ms": ttft * 1e3, "prefill_tok_s": plen / ttft, "decode_tok_s": n / decode_s,
               "decode_ms_per_token": decode_s / n * 1e3}
        if "roofline_tok_s" in ours:
            row["fraction_of_roofline"] = row["decode_tok_s"] / ours["roofline_tok_s"]
        rows.append(row)
    return rows


# ---- running a peer in a process of its own -------------------------------------------------------------

def child_env() -> dict:
    """The environment for a child that imports this llaisys and this benchmark code: the llaisys package's
    parent, then bench/, first on its path."""
    import llaisys

    from . import BENCH_DIR

    env = dict(os.environ)
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(llaisys.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, BENCH_DIR, env.get("PYTHONPATH")) if p)
    return env


def run_child(code: str, payload: dict, env: dict, what: str) -> dict:
    """Runs `python -c code JSON(payload)` and returns the JSON object on its last stdout line; a failure
    raises RuntimeError with the end of the child's stderr."""
    p = subprocess.run([sys.executable, "-c", code, json.dumps(payload)], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        tail = " | ".join(p.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"{what} failed in its own process (exit {p.returncode}): {tail}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---- llama.cpp ----------------------------------------------------------------------------------------

LLAMA_CPP_MISSING = "llama.cpp: skipped, llama-cpp-python is not installed (pip install llama-cpp-python)"


def llama_cpp_skip_reason(device: str, path: str | None) -> str | None:
    """Why llama.cpp cannot run this comparison, or None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return LLAMA_CPP_MISSING
    if device != "cpu":
        return f"llama.cpp: skipped on {device}: this llama-cpp-python is a CPU build (compare with --device cpu)"
    if path is None or not path.endswith(".gguf"):
        return "llama.cpp: skipped, it runs GGUF files (use --model FILE.gguf, or --shape with --gguf-types)"
    return None


def llama_cpp_measure(path: str, threads: int, vocab: int, prompt_len: int, new_tokens: int) -> dict:
    """In the child: load `path`, warm up, then time one prompt of prompt_len + new_tokens greedy tokens, on
    the ids llaisys got (bench_prompts of the same vocabulary size)."""
    from llama_cpp import Llama

    from .one_request import bench_prompts, peak_rss_mb

    t = time.perf_counter()
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=prompt_len + new_tokens + 16,
                n_batch=max(512, prompt_len), seed=0, verbose=False)
    load_s = time.perf_counter() - t
    if llm.n_vocab() != vocab:
        raise ValueError(f"llama.cpp reads {llm.n_vocab()} tokens from {path}, llaisys {vocab}: not the same model")
    warm, timed = bench_prompts(vocab, prompt_len)

    llama_cpp_timed(llm, warm, 8)  # warm-up at the timed shapes, as llaisys gets
    ttft, decode_s = llama_cpp_timed(llm, timed, new_tokens)
    return {"ttft_ms": ttft * 1e3, "prefill_tok_s": len(timed) / ttft,
            "decode_tok_s": (new_tokens - 1) / decode_s if new_tokens > 1 else 0.0,
            "peak_rss_mb": peak_rss_mb(), "threads": threads, "load_s": load_s}


def llama_cpp_timed(llm, prompt: list[int], n: int) -> tuple[float, float]:
    """Greedy Llama.generate of n tokens after `prompt` (it never stops at EOS): (seconds to the first
    token, seconds from the first token to the n-th)."""
    llm.reset()  # no prefix reuse from the previous prompt: the whole prompt is evaluated
    start = time.perf_counter()
    first = start
    gen = llm.generate(prompt, temp=0.0)
    for i, _ in enumerate(gen, 1):
        if i == 1:
            first = time.perf_counter()
        if i == n:
            break
    gen.close()
    return first - start, time.perf_counter() - first


def run_llama_cpp(ours: dict, path: str, threads: int) -> dict:
    """llama.cpp's row, measured in its own process on the prompt ids llaisys got."""
    code = ("import json, sys; from llaisys_bench.peers import llama_cpp_measure; "
            "print(json.dumps(llama_cpp_measure(**json.loads(sys.argv[1]))))")
    payload = dict(path=path, threads=threads, vocab=ours["vocab_size"], prompt_len=ours["prompt_len"],
                   new_tokens=ours["new_tokens"])
    row = run_child(code, payload, child_env(), "llama.cpp")
    # no fraction of llaisys' roofline: that counts the bytes llaisys holds, which differ unless quantized
    row.update({"engine": "llama.cpp", "model": ours["model"], "device": "cpu", "dtype": "file",
                "prompt_len": ours["prompt_len"], "new_tokens": ours["new_tokens"],
                "decode_ms_per_token": 1e3 / max(row["decode_tok_s"], 1e-9)})
    return row


def hf_skip_reason() -> str | None:
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        return f"HF transformers: skipped, {' and '.join(missing)} not installed (pip install '.[test]')"
    return None


def run_all(ours: dict, model: str | None, shape: str | None, threads: int | None, hf: bool = True) -> list[dict]:
    """Every peer that can run here (HF unless hf=False), each printed as it finishes; the ones that can't are
    named in one line."""
    path = None
    if model is not None:
        from llaisys import catalog

        path = catalog.resolve(model)
    rows = []
    reason = llama_cpp_skip_reason(ours["device"], path)
    if reason:
        print(reason)
    else:
        try:
            rows.append(run_llama_cpp(ours, path, threads or ours["threads"]))
        except (RuntimeError, ValueError) as e:  # a peer that fails is reported, not fatal to the benchmark
            print(f"  peer llama.cpp failed: {e}")
        else:
            from .one_request import format_row

            print(format_row(rows[-1]) + f"  peak RSS {rows[-1]['peak_rss_mb']:.0f} MB")
    if not hf:
        return rows
    reason = hf_skip_reason()
    if reason:
        print(reason)
        return rows
    from .one_request import format_row

    for peer in run_peers(ours, shape=shape, model=model, threads=threads):
        rows.append(peer)
        print(format_row(peer) + f"  (llaisys is {ours['decode_tok_s'] / peer['decode_tok_s']:.2f}x)")
    return rows
