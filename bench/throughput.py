"""Batched throughput, nano-vllm's protocol: N requests with prompt and output lengths uniform in
[min_len, max_len] (seed 0), random prompt ids, EOS ignored. Prints output tok/s and total tok/s, and
where a step's time goes (scheduler, host arrays, runner, bookkeeping). --solo also runs the same
requests one at a time; --peers runs HF transformers' continuous batching (generate_batch) on the same
requests (one max_new_tokens for all: HF takes no per-request length, so that row uses the mean length
for both engines).

    python bench/throughput.py --shape qwen2-0.5b --device cuda            # random weights of the shape
    python bench/throughput.py --shape qwen2-1.5b --gguf-types q4_k_m --device cuda   # a random GGUF of it
    python bench/throughput.py --model qwen2.5-coder-0.5b-instruct --device cpu -n 16 --max-len 128 --solo

--gguf-types PRESET (q4_k_m, q8_0, q4_0, q5_0, q5_k, q6_k) runs a random GGUF file of the shape in those block
formats (bench/random_gguf.py, kept in the temp dir) instead of the bf16 safetensors checkpoint; --dtype
quantized (the default there) keeps its blocks on any device, bf16 dequantizes them.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

SHAPES = {  # HF config fields of the real models
    "qwen2-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, tie=True),
    "qwen2-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, tie=True),
}


def random_checkpoint(shape: str) -> str:
    """A random HF checkpoint of the shape (every weight its own tensor, bf16, real vocab) with a small
    trained tokenizer: what both llaisys and transformers load. Kept in the temp dir for later runs."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from tiny_model import make_tiny_qwen2

    dirpath = os.path.join(tempfile.gettempdir(), f"llaisys-bench-{shape}")
    if os.path.exists(os.path.join(dirpath, "generation_config.json")):
        return dirpath

    cfg = dict(SHAPES[shape])
    tie = cfg.pop("tie")
    return make_tiny_qwen2(dirpath, tie=tie, dtype="bfloat16", vocab_size=151936, max_position_embeddings=32768,
                           rope_theta=1e6, **cfg)


def requests(n: int, lo: int, hi: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    outs = [rng.randint(lo, hi) for _ in range(n)]
    return prompts, outs


def run_llaisys(eng, prompts, outs, temperature: float) -> dict:
    core = eng._core
    core.timing.update(dict.fromkeys(core.timing, 0))
    core.runner.prepare_s = 0.0
    t = time.perf_counter()
    res = eng.generate(prompts, max_new_tokens=outs, temperature=temperature, ignore_eos=True,
                       seed=list(range(len(prompts))))
    dt = time.perf_counter() - t
    gen = sum(len(r.token_ids) for r in res)
    tm = dict(core.timing)
    steps = max(tm["steps"], 1)
    return {"seconds": dt, "output_tok_s": gen / dt, "total_tok_s": (gen + sum(map(len, prompts))) / dt,
            "steps": tm["steps"], "ms_per_step": 1e3 * dt / steps,
            "schedule_ms": 1e3 * tm["schedule_s"] / steps, "arrays_ms": 1e3 * core.runner.prepare_s / steps,
            "runner_ms": 1e3 * (tm["run_s"] - core.runner.prepare_s) / steps,
            "postprocess_ms": 1e3 * tm["postprocess_s"] / steps, "stats": eng.stats()}


def run_solo(eng, prompts, outs) -> dict:
    t = time.perf_counter()
    gen = sum(len(eng.generate(p, max_new_tokens=o, temperature=0, ignore_eos=True).token_ids)
              for p, o in zip(prompts, outs))
    dt = time.perf_counter() - t
    return {"seconds": dt, "output_tok_s": gen / dt}


def run_single(eng, prompt_len: int, new_tokens: int) -> int:
    prompt = requests(1, prompt_len, prompt_len, eng.config.vocab_size)[0][0]
    eng.generate(prompt, max_new_tokens=8, temperature=0, ignore_eos=True)  # warm-up, graph capture
    runs = []
    for _ in range(3):
        eng.generate([1] + prompt[1:], max_new_tokens=1)  # a different first block: no prefix hit next
        r = eng.generate(prompt, max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
        runs.append(r.timings["decode_tokens_per_s"])
    print(f"one request, prompt {prompt_len}, {new_tokens} new: decode {sorted(runs)[1]:.1f} tok/s "
          f"(runs {', '.join(f'{x:.1f}' for x in runs)})")
    return 0


def run_hf(path: str, device: str, prompts, new_tokens: int) -> dict:
    import torch
    import transformers

    from llaisys import catalog

    path = catalog.resolve(path)
    # a GGUF file loads (dequantized) from its folder by file name
    where = dict(gguf_file=os.path.basename(path)) if path.endswith(".gguf") else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path) if where else path,
                                                              dtype=torch.bfloat16, **where).to(
        "cuda" if device.startswith("cuda") else "cpu").eval()
    gc = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                       pad_token_id=0)
    model.generate_batch(inputs=prompts[:2], generation_config=gc)  # warm-up
    t = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=gc)
    dt = time.perf_counter() - t
    gen = sum(len(o.generated_tokens) for o in out.values())
    return {"seconds": dt, "output_tok_s": gen / dt}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--shape", choices=sorted(SHAPES))
    src.add_argument("--model")
    ap.add_argument("--gguf-types", metavar="PRESET", help="with --shape: a random GGUF in these block formats")
    ap.add_argument("--dtype", choices=["auto", "quantized", "bf16", "f32"],
                    help="default: quantized for a GGUF file (its block formats, on any device), else bf16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("-n", "--num-requests", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--solo", action="store_true", help="also run the requests one at a time")
    ap.add_argument("--peers", action="store_true", help="also run HF transformers' generate_batch")
    ap.add_argument("--single", nargs=2, type=int, metavar=("PROMPT", "NEW"),
                    help="instead: decode speed of one request (median of 3), as `llaisys bench` measures it")
    args = ap.parse_args()
    if args.gguf_types and not args.shape:
        ap.error("--gguf-types writes a random GGUF of --shape: give --shape")

    import llaisys
    from llaisys.engine.engine import Engine

    if args.gguf_types:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from random_gguf import cached_random_gguf

        path = cached_random_gguf(args.shape, args.gguf_types)
    else:
        path = random_checkpoint(args.shape) if args.shape else args.model
    dtype = args.dtype or ("quantized" if str(path).endswith(".gguf") else "bf16")
    eng = Engine(path, device=args.device, dtype=dtype, progress=False, max_seq_len=2 * args.max_len + 16,
                 max_num_seqs=args.max_num_seqs)
    what = f"{args.shape} {args.gguf_types} (random GGUF)" if args.gguf_types else args.shape or args.model
    print(f"llaisys {llaisys.__version__ if hasattr(llaisys, '__version__') else ''} on {eng.device}: "
          f"{what}, dtype {dtype}, {args.num_requests} requests, lengths [{args.min_len}, {args.max_len}]")
    if args.single:
        return run_single(eng, *args.single)
    prompts, outs = requests(args.num_requests, args.min_len, args.max_len, eng.config.vocab_size)
    eng.generate(prompts[:2], max_new_tokens=4, ignore_eos=True)  # warm-up (graphs, allocator)
    r = run_llaisys(eng, prompts, outs, args.temperature)
    print(f"batched: {r['output_tok_s']:.0f} output tok/s, {r['total_tok_s']:.0f} total tok/s "
          f"({r['seconds']:.1f} s, {r['steps']} steps, {r['ms_per_step']:.2f} ms/step: schedule "
          f"{r['schedule_ms']:.2f}, arrays {r['arrays_ms']:.2f}, runner {r['runner_ms']:.2f}, "
          f"postprocess {r['postprocess_ms']:.2f}; preemptions {r['stats']['preemptions']})")
    if args.solo:
        s = run_solo(eng, prompts, outs)
        print(f"one at a time: {s['output_tok_s']:.1f} output tok/s ({s['seconds']:.1f} s); "
              f"batched/solo = {r['output_tok_s'] / s['output_tok_s']:.2f}x")
    if args.peers:
        mean = sum(outs) // len(outs)
        same = run_llaisys(eng, prompts, [mean] * len(outs), 0.0)
        eng.close()
        hf = run_hf(path, eng.device, prompts, mean)
        print(f"fixed {mean} new tokens: llaisys {same['output_tok_s']:.0f} tok/s, HF generate_batch "
              f"{hf['output_tok_s']:.0f} tok/s -> {same['output_tok_s'] / hf['output_tok_s']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
