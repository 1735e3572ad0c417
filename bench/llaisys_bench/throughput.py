"""`llaisys bench --throughput [N]` (and bench/throughput.py): batched throughput, nano-vllm's protocol.

N requests (default 256) with prompt and output lengths uniform in [min_len, max_len] (default [100, 1024],
seed 0), random prompt ids, EOS ignored, all submitted at once to one Engine. Prints output tok/s and total
tok/s (prompt + output tokens over the wall time), the steps and where a step's time goes (scheduler, host
arrays, runner, bookkeeping).

--shape runs random weights of a real Qwen2 shape (every weight its own buffer, tied embeddings as the real
models have; shapes.random_loaded, nothing written to disk); --model a real model; --shape with --gguf-types a
random GGUF file of the shape (bench/random_gguf.py).

--peers also runs HF transformers' continuous batching (model.generate_batch) on the same prompts, in the same
run. HF takes one max_new_tokens for all requests, so that comparison reruns llaisys with every output length
set to the mean, at temperature 0. With --shape both engines load one random HF checkpoint written to the temp
dir (the checkout's tests/tiny_model.py writes it).
"""
from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
from typing import Callable

from . import checkout_module, random_gguf_module, resolve_device, shapes

DEFAULTS = dict(num_requests=256, min_len=100, max_len=1024, temperature=0.6, max_num_seqs=256)


def shape_config(shape: str) -> dict:
    """HF config values of a shape as this protocol runs it: Qwen2 0.5B and 1.5B tie the LM head to the
    embedding table (shapes.SHAPES keeps them untied for the roofline's separate head)."""
    if shape not in shapes.SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {sorted(shapes.SHAPES)}")
    return dict(shapes.SHAPES[shape], tie_word_embeddings=True)


def check(num_requests: int, min_len: int, max_len: int, temperature: float, max_num_seqs: int) -> None:
    """ValueError naming the flag of the first bad setting."""
    for flag, v in (("--num-requests", num_requests), ("--min-len", min_len), ("--max-len", max_len),
                    ("--max-num-seqs", max_num_seqs)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{flag} must be a whole number >= 1, got {v!r}")
    if min_len > max_len:
        raise ValueError(f"--min-len ({min_len}) must not exceed --max-len ({max_len})")
    if not (isinstance(temperature, (int, float)) and 0 <= temperature < float("inf")):
        raise ValueError(f"--temperature must be a number >= 0, got {temperature!r}")


def requests(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """(prompts, output lengths): n prompts of random ids with lengths uniform in [lo, hi], then n output
    lengths uniform in [lo, hi], all from one seeded generator."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    outs = [rng.randint(lo, hi) for _ in range(n)]
    return prompts, outs


def random_checkpoint(shape: str) -> str:
    """A random HF checkpoint of the shape (every weight its own tensor, bf16, real vocab) with a small trained
    tokenizer: what both llaisys and transformers load for --peers. Kept in the temp dir for later runs."""
    dirpath = os.path.join(tempfile.gettempdir(), f"llaisys-bench-{shape}")
    if os.path.exists(os.path.join(dirpath, "generation_config.json")):
        return dirpath
    c = shape_config(shape)
    tiny = checkout_module(os.path.join("tests", "tiny_model.py"), "llaisys_tiny_model")
    return tiny.make_tiny_qwen2(dirpath, tie=c["tie_word_embeddings"], dtype="bfloat16", vocab_size=c["vocab_size"],
                                max_position_embeddings=c["max_position_embeddings"], rope_theta=c["rope_theta"],
                                **{k: c[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                     "num_attention_heads", "num_key_value_heads")})


def open_engine(shape: str | None = None, model: str | None = None, gguf_types: str | None = None,
                device: str = "auto", dtype: str = "auto", max_seq_len: int = 2064, max_num_seqs: int = 256,
                checkpoint: bool = False, tensor_parallel_size: int = 1, nodes: dict | None = None,
                **engine_kw):
    """(engine, path or None, label, dtype). dtype goes to the Engine as given for a file ("quantized" and
    "auto" keep a GGUF's blocks); the random shape is dense ("auto" = bf16). checkpoint: load
    --shape from random_checkpoint (what HF loads too) instead of building it in memory. engine_kw: more
    Engine keywords (EngineConfig fields: overlap_steps, ...)."""
    from llaisys.engine import Engine

    if model and (shape or gguf_types):
        raise ValueError("give --model or --shape (with --gguf-types), not both")
    device = resolve_device(device)
    kw = dict(device=device, max_seq_len=max_seq_len, progress=False, max_num_seqs=max_num_seqs,
              tensor_parallel_size=tensor_parallel_size, **(nodes or {}), **engine_kw)
    shape = shape or (None if model else "qwen2-0.5b")
    if gguf_types:
        path = random_gguf_module().cached_random_gguf(shape, gguf_types)
        label = f"{shape} {gguf_types} (random GGUF)"
    elif shape and checkpoint:
        path, label = random_checkpoint(shape), shape
    else:
        path, label = model, model or shape
    if path is None:  # random weights of the shape, in memory
        if dtype == "quantized":
            raise ValueError("--dtype quantized needs a GGUF file: --model FILE.gguf, or --shape with --gguf-types")
        dtype = "bf16" if dtype == "auto" else dtype
        return Engine.from_loaded(shapes.random_loaded(shape_config(shape), dtype, name=shape), dtype=dtype,
                                  **kw), None, label, dtype
    return Engine(path, dtype=dtype, **kw), path, label, dtype


def run_llaisys(eng, prompts, outs, temperature: float) -> dict:
    """All requests at once through eng.generate; the wall time and the engine's per-step split."""
    core = eng._core
    core.timing.update(dict.fromkeys(core.timing, 0))
    core.runner.prepare_s = 0.0
    before = eng.stats()
    t = time.perf_counter()
    res = eng.generate(prompts, max_new_tokens=outs, temperature=temperature, ignore_eos=True,
                       seed=list(range(len(prompts))))
    dt = time.perf_counter() - t
    gen = sum(len(r.token_ids) for r in res)
    # when the last request got its first token: the end of the run's prefill phase (decode steps ran beside it)
    prefill_s = max(r.timings.get("ttft_s", 0.0) for r in res)
    prompt_tokens = sum(map(len, prompts))
    tm = dict(core.timing)
    steps = max(tm["steps"], 1)
    stats = eng.stats()
    return {"seconds": dt, "prompt_tokens": prompt_tokens, "output_tokens": gen, "output_tok_s": gen / dt,
            "total_tok_s": (gen + prompt_tokens) / dt, "last_first_token_s": prefill_s, "steps": tm["steps"],
            "ms_per_step": 1e3 * dt / steps,
            "schedule_ms": 1e3 * tm["schedule_s"] / steps, "arrays_ms": 1e3 * core.runner.prepare_s / steps,
            "runner_ms": 1e3 * (tm["run_s"] - core.runner.prepare_s) / steps,
            "postprocess_ms": 1e3 * tm["postprocess_s"] / steps,
            # the host's Python per sequence per step (EngineCore.host_seconds: scheduling, the step's arrays,
            # accounting, the hand-back and the loop's delivery between steps; not the runner's C++). Before
            # session 33 this sum counted an overlapped step's accounting twice (postprocess_s and to_return_s)
            "host_us_per_seq_step": 1e6 * core.host_seconds() / max(tm["rows"], 1),
            "preemptions": stats["preemptions"] - before["preemptions"],
            "overlapped": stats["overlapped_steps"] - before["overlapped_steps"], "stats": stats}


def run_solo(eng, prompts, outs) -> dict:
    """The same requests one at a time (greedy)."""
    t = time.perf_counter()
    gen = sum(len(eng.generate(p, max_new_tokens=o, temperature=0, ignore_eos=True).token_ids)
              for p, o in zip(prompts, outs))
    dt = time.perf_counter() - t
    return {"seconds": dt, "output_tokens": gen, "output_tok_s": gen / dt}


def run_single(eng, prompt_len: int, new_tokens: int) -> dict:
    """Decode speed of one request (median of 3 after a warm-up), as `llaisys bench` measures it."""
    prompt = requests(1, prompt_len, prompt_len, eng.config.vocab_size)[0][0]
    eng.generate(prompt, max_new_tokens=8, temperature=0, ignore_eos=True)  # warm-up, graph capture
    runs = []
    for _ in range(3):
        eng.generate([1] + prompt[1:], max_new_tokens=1)  # a different first block: no prefix hit next
        r = eng.generate(prompt, max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
        runs.append(r.timings["decode_tokens_per_s"])
    return {"prompt_len": prompt_len, "new_tokens": new_tokens, "decode_tok_s": sorted(runs)[1], "runs": runs}


def run_hf(path: str, device: str, prompts, new_tokens: int) -> dict:
    """HF transformers' continuous batching (generate_batch) on the checkpoint or GGUF file at path, greedy,
    no EOS, new_tokens for every request."""
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
    return {"seconds": dt, "output_tokens": gen, "output_tok_s": gen / dt}


def format_line(r: dict) -> str:
    return (f"batched: {r['output_tok_s']:.0f} output tok/s, {r['total_tok_s']:.0f} total tok/s "
            f"({r['seconds']:.1f} s, last first token at {r.get('last_first_token_s', 0):.2f} s, {r['steps']} steps, "
            f"{r['ms_per_step']:.2f} ms/step: schedule "
            f"{r['schedule_ms']:.2f}, arrays {r['arrays_ms']:.2f}, runner {r['runner_ms']:.2f}, "
            f"postprocess {r['postprocess_ms']:.2f}; preemptions {r['preemptions']}; overlapped "
            f"{r.get('overlapped', 0)} steps; host {r.get('host_us_per_seq_step', 0):.2f} us per sequence per step)")


def throughput(shape: str | None = None, model: str | None = None, gguf_types: str | None = None,
               device: str = "auto", dtype: str = "auto", num_requests: int = 256, min_len: int = 100,
               max_len: int = 1024, temperature: float = 0.6, max_num_seqs: int = 256, solo: bool = False,
               peers: bool = False, single: tuple[int, int] | None = None,
               out: Callable[[str], None] = print, tensor_parallel_size: int = 1, nodes: dict | None = None,
               profile: int = 0, kernels: int = 0, max_num_batched_tokens: int | None = None) -> dict:
    """Run the protocol (or with `single`, one request's decode instead), printing each result line through
    `out`; returns the result dict (what --json writes)."""
    check(num_requests, min_len, max_len, temperature, max_num_seqs)
    # a prompt and its output at most; one request alone as `llaisys bench` sizes it
    max_seq_len = max(sum(single) + 16, 256) if single else 2 * max_len + 16
    eng, path, label, dtype = open_engine(shape, model, gguf_types, device, dtype, max_seq_len, max_num_seqs,
                                          checkpoint=peers and not model, tensor_parallel_size=tensor_parallel_size,
                                          nodes=nodes, **({"max_num_batched_tokens": max_num_batched_tokens}
                                                          if max_num_batched_tokens else {}))
    if (nodes or {}).get("node_rank"):  # a follower: node 0's steps until node 0 ends; node 0 reports
        eng.follow()
        return {}
    if tensor_parallel_size > 1:
        label = f"{label}, tensor parallel {tensor_parallel_size}"
    import llaisys

    with eng:
        what = "one request" if single else f"{num_requests} requests, lengths [{min_len}, {max_len}]"
        captured = eng._core.runner.capture_s
        out(f"llaisys {getattr(llaisys, '__version__', '')} on {eng.device}: {label}, dtype {dtype} (computes "
            f"{eng.dtype}), {what}" + (f"; decode graphs captured at start in {captured:.2f} s" if captured else ""))
        result = {"engine": "llaisys", "model": label, "device": eng.device, "dtype": dtype,
                  "compute_dtype": eng.dtype, "num_requests": num_requests, "min_len": min_len, "max_len": max_len,
                  "temperature": temperature, "max_num_seqs": max_num_seqs}
        if single:
            s = run_single(eng, *single)
            out(f"one request, prompt {s['prompt_len']}, {s['new_tokens']} new: decode {s['decode_tok_s']:.1f} "
                f"tok/s (runs {', '.join(f'{x:.1f}' for x in s['runs'])})")
            return dict(result, single=s)
        prompts, outs = requests(num_requests, min_len, max_len, eng.config.vocab_size)
        eng.generate(prompts[:2], max_new_tokens=4, ignore_eos=True)  # warm-up (graphs, allocator)
        result.update(run_llaisys(eng, prompts, outs, temperature), requested_output_tokens=sum(outs))
        out(format_line(result))
        if profile:  # the same requests again under the profiler (it slows them: the timed run above is not)
            from . import loop_profile

            again = {}
            times = loop_profile.own_times(eng, lambda: again.update(run_llaisys(eng, prompts, outs, temperature)))
            loop_profile.report(f"{num_requests} requests, {again['steps']} steps", times, again["steps"], profile)
        if kernels:  # the same requests again under torch.profiler: device time per kernel over the whole run
            from .kernel_profile import print_rows, profiled_call

            again = {}
            # another first token a prompt: the prefix cache holds the timed run's prompts, and a hit would
            # leave their prefill out of the profile
            fresh = [[(p[0] + 1) % eng.config.vocab_size] + p[1:] for p in prompts]
            per, wall, idle = profiled_call(eng.device, lambda: again.update(run_llaisys(eng, fresh, outs,
                                                                                         temperature)))
            busy = sum(us for k, (n, us) in per.items() if not k.startswith("Memcpy"))
            out(f"kernels of {num_requests} requests ({again['steps']} steps, profiled): wall {wall * 1e3:.0f} ms, "
                f"kernel time {busy / 1e3:.0f} ms, GPU idle {idle / 1e3:.0f} ms")
            rows = []
            print_rows(per, rows.append)
            for line in rows[:kernels + 1]:
                out(line)
        if solo:
            s = result["solo"] = run_solo(eng, prompts, outs)
            out(f"one at a time: {s['output_tok_s']:.1f} output tok/s ({s['seconds']:.1f} s); "
                f"batched/solo = {result['output_tok_s'] / s['output_tok_s']:.2f}x")
        if peers:
            mean = sum(outs) // len(outs)
            same = run_llaisys(eng, prompts, [mean] * len(outs), 0.0)
    if peers:  # the engine is closed: its memory is HF's now
        hf = run_hf(path, result["device"], prompts, mean)
        result["peers"] = {"new_tokens": mean, "llaisys": same, "hf_generate_batch": hf}
        out(f"fixed {mean} new tokens: llaisys {same['output_tok_s']:.0f} tok/s, HF generate_batch "
            f"{hf['output_tok_s']:.0f} tok/s -> {same['output_tok_s'] / hf['output_tok_s']:.1f}x")
    return result


def require_hf() -> None:
    """--peers runs HF generate_batch: RuntimeError in one line when torch or transformers is missing."""
    import importlib.util

    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(f"--peers runs HF transformers' generate_batch, which needs {' and '.join(missing)} "
                           f"(pip install 'llaisys[test]')")


def main(args, num_requests: int) -> int:
    """`llaisys bench --throughput` with the CLI's checked args."""
    if args.peers:
        require_hf()
    r = throughput(shape=args.shape, model=args.model, gguf_types=args.gguf_types, device=args.device,
                   dtype=args.dtype, num_requests=num_requests, min_len=args.min_len, max_len=args.max_len,
                   temperature=args.temperature, max_num_seqs=args.max_num_seqs, peers=args.peers,
                   tensor_parallel_size=getattr(args, "tensor_parallel_size", 1) or 1,
                   nodes={k: getattr(args, k) for k in ("nnodes", "node_rank", "master_addr", "master_port")
                          if getattr(args, k, None) is not None})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    sys.stdout.flush()
    return 0
