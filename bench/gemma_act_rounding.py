#!/usr/bin/env python3
"""How the quantized kernels' 8-bit activation rounding moves Gemma-3-270M Q4_K_M's top-1 agreement (issue 29).

HF transformers (f32, loading the same GGUF: weights dequantized) with a forward pre-hook on every nn.Linear that
rounds its input as quant_linear's CPU kernels do (cpp/ops/quant_linear/kernels.inc: quantize_row, d = max|x| /
127 per block, round half away from zero), over tests/test_real_gemma3.py's 600 teacher-forced positions, against
the same model unrounded. The kernels' integer dot product with the dequantized weights is this up to float
summation order. Matrices in K-quants (o_proj, down_proj in this file) round per 256 today, the rest per 32.

    PYTHONPATH=python python bench/gemma_act_rounding.py          # a few minutes on 2 cores
"""
import os

import numpy as np
import torch
import transformers

from llaisys import catalog
from llaisys.engine import Engine

K_QUANTS = {"o_proj", "down_proj"}  # K = 1024, 2048; every matrix reading the 640-wide hidden state is Q5_0/Q8_0


def round_q8(x: torch.Tensor, block: int | None) -> torch.Tensor:
    if block is None:
        return x
    v = x.reshape(-1, x.shape[-1] // block, block)
    d = v.abs().amax(-1, keepdim=True) / 127.0
    y = v * torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    t = torch.trunc(y)
    q = t + (y - t >= 0.5).float() - (y - t <= -0.5).float()
    return (q * d).reshape(x.shape)


SCHEMES = {  # name: (block of the 32-element formats' inputs, of the K-quants' inputs, matrices left in f32)
    "as the kernels today": (32, 256, ()),
    "K-quants per 32": (32, 32, ()),
    "K-quants per 16": (32, 16, ()),
    "K-quants f32": (32, None, ()),
    "everything per 16": (16, 16, ()),
    "everything per 8": (8, 8, ()),
    "down_proj f32": (32, 256, ("down_proj",)),
    "K-quants f32, lm_head f32": (32, None, ("lm_head",)),
}


def main() -> None:
    path = catalog.resolve("gemma-3-270m")
    text = open("/usr/share/common-licenses/GPL-3", encoding="utf-8").read()[:6000]
    with Engine(path, device="cpu", dtype="auto", max_seq_len=2048, progress=False) as eng:
        ids = eng.tokenizer.encode(text)[:600]
        engine_logits = eng.score(ids)
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                              dtype=torch.float32).eval()
    blocks: dict[str, int | None] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            mod.register_forward_pre_hook(lambda m, a, n=name: (round_q8(a[0], blocks.get(n)),))
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].numpy()
        print(f"| the engine (dtype=auto) | {100 * np.mean(engine_logits.argmax(-1) == ref.argmax(-1)):.2f}% | |")
        for scheme, (b32, bk, keep) in SCHEMES.items():
            blocks.clear()
            for name, mod in model.named_modules():
                kind = name.split(".")[-1]
                if isinstance(mod, torch.nn.Linear) and kind not in keep:
                    blocks[name] = bk if kind in K_QUANTS else b32
            out = model(torch.tensor([ids])).logits[0].numpy()
            rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
            print(f"| {scheme} | {100 * np.mean(out.argmax(-1) == ref.argmax(-1)):.2f}% | {100 * rel:.2f}% |", flush=True)


if __name__ == "__main__":
    main()
