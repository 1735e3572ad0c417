"""Peer engines timed like llaisys (same shape, prompt length, token count, device, dtype, process).

- "hf-eager": HF transformers Qwen2ForCausalLM, eager attention, dynamic KV cache, a greedy loop.
- "torch-compile-static" (CUDA only): the same model with a static KV cache and
  torch.compile(mode="reduce-overhead") (CUDA graphs) on the decode step.
Needs torch and transformers (the [test] extra); random weights for --shape, the checkpoint for --model.
"""
from __future__ import annotations

import time


def _hf_model(shape: str | None, model: str | None, dtype, device):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from .bench import SHAPES

    if model is not None:
        import os

        from . import catalog

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
        m = m.to_empty(device="cpu").to(dtype)
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.02)
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


def run_peers(ours: dict, shape: str | None = None, model: str | None = None) -> list[dict]:
    import torch

    device, n, plen = ours["device"], ours["new_tokens"], ours["prompt_len"]
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[ours["dtype"]]
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
