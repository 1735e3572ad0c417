"""`llaisys bench`: prefill and decode speed of one request through the Engine, against the weight-bandwidth
roofline.

Batch-1 decode reads every weight once per token, so its floor is weight_bytes / copy_bandwidth; the
copy bandwidth is measured here on the same device (bytes read + written by a large device copy).
With --shape the model has random weights of a real Qwen2 shape (no download); with --model a real one;
with --shape and --gguf-types a random GGUF file of that shape in those block formats (bench/random_gguf.py,
cached in the temp dir).

`--peers` also runs, on the same prompt ids, token counts and threads: llama.cpp (llama-cpp-python) on the
same GGUF file, and HF transformers (peers.py). Then llaisys and llama.cpp each run in a
process of their own, so each one's peak RSS is its own; when llaisys keeps the file's blocks (dtype
auto or quantized) it also runs dequantized to bf16 (the reference), and a table gives the ratios
llaisys / llama.cpp.
`--threads N` sets LLAISYS_NUM_THREADS (and llama.cpp's n_threads) to N.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np
from llaisys import Event, build_info, current_stream, empty, memory_stats

from . import random_gguf_module, resolve_device
from .shapes import SHAPES, decode_weight_bytes, random_loaded


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Measured device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    if device == "cpu":  # one copy thread per core (NumPy releases the GIL while copying)
        from concurrent.futures import ThreadPoolExecutor

        nbytes, workers = 1 << 28, os.cpu_count() or 1
        a, b = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
        step = nbytes // workers
        parts = [(a[i * step:(i + 1) * step], b[i * step:(i + 1) * step]) for i in range(workers)]
        with ThreadPoolExecutor(workers) as pool:
            times = []
            for _ in range(6):
                t = time.perf_counter()
                list(pool.map(lambda p: np.copyto(p[1], p[0]), parts))
                times.append(time.perf_counter() - t)
        return 2 * step * workers / min(times[1:])
    a, b = empty((nbytes,), "u8", device).fill_(1), empty((nbytes,), "u8", device)
    b.copy_(a)
    start, end = Event(device, timing=True), Event(device, timing=True)
    stream = current_stream(device)
    times = []
    for _ in range(10):
        start.record(stream)
        b.copy_(a)
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_ms(end) / 1e3)
    return 2 * nbytes / float(np.median(times))


def bench_prompts(vocab: int, prompt_len: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """(warm-up, timed) prompts of random ids: fresh ids, so the timed prefill gets no prefix-cache hit.
    Every engine compared gets these same ids."""
    rng = np.random.default_rng(seed)
    warm, timed = ([int(t) for t in rng.integers(0, vocab, prompt_len)] for _ in range(2))
    return warm, timed


def peak_rss_mb() -> float:
    """This process's peak resident set so far (VmHWM; mapped file pages that were touched count too), MB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 1e6
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6  # kB on Linux


def run_engine(eng, prompt_len: int, new_tokens: int, seed: int = 0) -> dict:
    """The same measurement through the Engine (scheduler, runner, paged KV cache): one request alone."""
    warm, timed = bench_prompts(eng.config.vocab_size, prompt_len, seed)
    kw = dict(temperature=0, ignore_eos=True)
    eng.generate(warm, max_new_tokens=8, **kw)  # warm-up at the timed shapes: GEMM handles, graph capture
    cuda = eng.device != "cpu"
    mallocs = memory_stats(eng.device)["device_mallocs"] if cuda else 0
    t = eng.generate(timed, max_new_tokens=new_tokens, **kw).timings
    # counted over the whole timed request (prefill included), after the warm-up
    new_mallocs = memory_stats(eng.device)["device_mallocs"] - mallocs if cuda else 0
    return {"prompt_len": prompt_len, "new_tokens": new_tokens, "ttft_ms": t["ttft_s"] * 1e3,
            "prefill_tok_s": t["prefill_tokens_per_s"], "decode_tok_s": t["decode_tokens_per_s"],
            "decode_ms_per_token": 1e3 / max(t["decode_tokens_per_s"], 1e-9), "decode_device_mallocs": new_mallocs}


def engine_weight_bytes(eng, c: dict) -> int:
    """Bytes one decode step reads from what the engine holds (quantized weights count their blocks); the
    dense formula where the model cannot list its weights."""
    formats = getattr(eng._model, "weight_formats", None)
    if formats is None:
        return decode_weight_bytes(c, eng.dtype)
    rows = formats()
    sizes = {name: int(nbytes) for name, _, nbytes in rows}
    embed = sizes.pop(rows[0][0], 0)  # the weight table lists the embedding first
    tied = eng.config.tie_word_embeddings
    return sum(sizes.values()) + (embed if tied else 0)  # a tied table is the LM head


def bench(shape: str | None = None, model: str | None = None, device: str = "auto", dtype: str = "bf16",
          prompt_len: int = 128, new_tokens: int = 256, tensor_parallel_size: int = 1,
          nodes: dict | None = None) -> dict | None:
    """One llaisys measurement in this process, through the Engine (scheduler, runner, paged KV cache). `dtype`
    goes to the Engine as given for --model ("quantized" and "auto" keep a GGUF file's block
    formats); the random --shape model is dense ("auto" = bf16). nodes: EngineConfig's nnodes, node_rank,
    master_addr, master_port; a node_rank > 0 follows node 0's steps and returns None when node 0 ends."""
    nodes = nodes or {}
    device = resolve_device(device)
    max_seq_len = max(prompt_len + new_tokens + 16, 256)
    from llaisys.engine import Engine

    t = time.perf_counter()
    if model is not None:
        eng, name = Engine(model, device=device, dtype=dtype, max_seq_len=max_seq_len, progress=False,
                           tensor_parallel_size=tensor_parallel_size, **nodes), model
    else:  # random weights of a real shape, through the same Engine
        shape = shape or "qwen2-0.5b"
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; choose from {sorted(SHAPES)}")
        if dtype == "quantized":
            raise ValueError("dtype quantized needs a GGUF file: --model FILE.gguf, or --shape with --gguf-types")
        dtype = "bf16" if dtype == "auto" else dtype
        eng = Engine.from_loaded(random_loaded(SHAPES[shape], dtype, name=shape), device=device, dtype=dtype,
                                 max_seq_len=max_seq_len, progress=False, tensor_parallel_size=tensor_parallel_size,
                                 **nodes)
        name = shape
    if nodes.get("node_rank"):
        eng.follow()
        return None
    with eng:
        load_s = time.perf_counter() - t
        c = dict(eng.config.core, max_position_embeddings=eng.config.max_position_embeddings)
        result = run_engine(eng, prompt_len, new_tokens)
        weight_bytes = engine_weight_bytes(eng, c)
        # describe() needs a core that lists its weights (older builds don't)
        described = eng.describe() if hasattr(eng._model, "weight_formats") else {}
        result.update(load_s=load_s, compute_dtype=eng.dtype, quantized=bool(described.get("quantized")),
                      weight_formats=sorted(described.get("weight_formats", {})))
    # read before the copy-bandwidth buffers below raise it
    result["peak_rss_mb"] = peak_rss_mb() if device == "cpu" else None
    result["threads"] = build_info()["cpu_threads"]
    bw = copy_bandwidth(device)
    roofline = bw / weight_bytes
    # tensor parallel: weight_bytes are rank 0's (each GPU reads its share), bw one GPU's copy bandwidth
    result.update({"engine": "llaisys" + (f" tp={tensor_parallel_size}" if tensor_parallel_size > 1 else ""),
                   "tensor_parallel_size": tensor_parallel_size,
                   "model": name, "device": device, "dtype": dtype, "vocab_size": c["vocab_size"],
                   "copy_bandwidth_gb_s": bw / 1e9, "weight_bytes": weight_bytes, "roofline_tok_s": roofline,
                   "fraction_of_roofline": result["decode_tok_s"] / roofline})
    result["roofline_warning"] = roofline_warning(result)
    return result


def roofline_warning(r: dict) -> str | None:
    """Why a decode faster than its roofline cannot be trusted, or None when it is below it."""
    if r.get("fraction_of_roofline", 0) <= 1:
        return None
    return (f"WARNING: {100 * r['fraction_of_roofline']:.0f}% of the roofline is impossible for a decode that reads "
            f"every weight once per token: the weights were served from cache (aliased or too small for this "
            f"device) or the copy bandwidth was under-measured; do not quote this figure")


def format_row(r: dict) -> str:
    model = os.path.basename(r["model"]) if os.sep in r["model"] else r["model"]  # a path: its file name
    row = (f"{r['engine']:<22} {model:<28} {r['device']:<8} {r['dtype']:<5} "
           f"prefill {r['prefill_tok_s']:9.1f} tok/s  TTFT {r['ttft_ms']:8.1f} ms  "
           f"decode {r['decode_tok_s']:8.1f} tok/s ({r['decode_ms_per_token']:.2f} ms/tok)"
           + (f"  {100 * r['fraction_of_roofline']:.0f}% of roofline" if "fraction_of_roofline" in r else ""))
    warning = roofline_warning(r)
    return row + (f"\n  {warning}" if warning else "")


def _options(args) -> dict:
    """The checked settings of one `llaisys bench` run (args from the CLI's or bench/peers.py's argparse;
    --threads and --gguf-types may be absent from an older parser)."""
    model, shape = getattr(args, "model", None), getattr(args, "shape", None)
    threads, gguf_types = getattr(args, "threads", None), getattr(args, "gguf_types", None)
    if model and shape:
        raise ValueError("give either --model or --shape, not both")
    if gguf_types is not None and model:
        raise ValueError("--gguf-types writes a random GGUF file of --shape; it cannot be combined with --model")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"--threads must be a whole number >= 1, got {threads!r}")
    if args.dtype not in ("auto", "quantized", "bf16", "f16", "f32"):
        raise ValueError(f"--dtype must be auto, quantized, bf16, f16 or f32, got {args.dtype!r}")
    if args.dtype == "quantized" and gguf_types is None and not (model and catalog_path(model).endswith(".gguf")):
        raise ValueError("--dtype quantized needs a GGUF file: --model FILE.gguf, or --shape with --gguf-types")
    label = None
    if gguf_types is not None:
        shape = shape or "qwen2-0.5b"
        model, shape, label = random_gguf_module().cached_random_gguf(shape, gguf_types), None, \
            f"{shape} {gguf_types} (random)"
    return dict(model=model, shape=shape, label=label, threads=threads, peers=bool(getattr(args, "peers", False)),
                kw=dict(shape=shape, model=model, device=resolve_device(args.device), dtype=args.dtype,
                        prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1) or 1, **_nodes(args)))


def _nodes(args) -> dict:
    """{"nodes": the node flags given} where any was (--nnodes etc.: bench(nodes=...)), else {}."""
    nodes = {k: getattr(args, k) for k in ("nnodes", "node_rank", "master_addr", "master_port")
             if getattr(args, k, None) is not None}
    return {"nodes": nodes} if nodes else {}


def catalog_path(model: str) -> str:
    """The local path of --model as the Engine will load it (a catalog name is downloaded if needed)."""
    from llaisys import catalog

    return catalog.resolve(model)


def run_isolated(kw: dict, threads: int | None) -> dict:
    """bench(**kw) in a fresh process (its own peak RSS; LLAISYS_NUM_THREADS=threads read by its thread pool
    at start)."""
    from .peers import child_env, run_child

    env = child_env()
    if threads is not None:
        env["LLAISYS_NUM_THREADS"] = str(threads)
    code = ("import json, sys; from llaisys_bench.one_request import bench; "
            "print(json.dumps(bench(**json.loads(sys.argv[1]))))")
    return run_child(code, kw, env, f"llaisys ({kw['dtype']})")


def _print_llaisys(r: dict) -> None:
    print(format_row(r))
    extra = f", peak RSS {r['peak_rss_mb']:.0f} MB" if r.get("peak_rss_mb") else ""
    formats = f", weights {'/'.join(r['weight_formats'])}" if r.get("weight_formats") else ""
    print(f"  copy bandwidth {r['copy_bandwidth_gb_s']:.0f} GB/s, {r['weight_bytes'] / 1e9:.2f} GB of weights per "
          f"token -> roofline {r['roofline_tok_s']:.0f} tok/s; device mallocs during decode: "
          f"{r['decode_device_mallocs']}; {r['threads']} threads{extra}{formats}")


def comparison_table(rows: list[dict]) -> str | None:
    """Prefill, decode and peak RSS of each llaisys row and llama.cpp's, with ratios llaisys / llama.cpp."""
    peer = next((r for r in rows if r["engine"] == "llama.cpp"), None)
    ours = [r for r in rows if r["engine"] == "llaisys"]
    if peer is None or not ours:
        return None
    name = lambda r: f"{r['engine']} {r['dtype']}" + (" (quantized)" if r.get("quantized") else "")  # noqa: E731
    lines = [f"{'':<36} {'prefill tok/s':>13} {'decode tok/s':>13} {'peak RSS MB':>12}   ({peer['threads']} "
             f"threads, prompt {peer['prompt_len']}, {peer['new_tokens']} new tokens, CPU)"]
    for r in ours + [peer]:
        lines.append(f"{name(r):<36} {r['prefill_tok_s']:13.1f} {r['decode_tok_s']:13.1f} {r['peak_rss_mb']:12.0f}")
    for r in ours:
        ratios = [r[k] / peer[k] for k in ("prefill_tok_s", "decode_tok_s", "peak_rss_mb")]
        lines.append(f"{name(r) + ' / llama.cpp':<36} " + " ".join(f"{x:12.2f}x" for x in ratios))
    return "\n".join(lines)


def main(args) -> int:
    """Entry point of `llaisys bench` (args from the CLI's argparse)."""
    o = _options(args)
    kw = o["kw"]
    # own processes for fair peak RSS with peers, and for a thread count read once at pool start
    isolated = o["peers"] or o["threads"] is not None
    r = run_isolated(kw, o["threads"]) if isolated else bench(**kw)
    if r is None:  # a follower node (--node-rank > 0): node 0 reports
        return 0
    if o["label"]:
        r["model"] = o["label"]
    rows = [r]
    _print_llaisys(r)
    if o["peers"]:
        from . import peers

        if r.get("quantized"):  # the dequantized reference, same run
            ref = run_isolated(dict(kw, dtype="bf16"), o["threads"])
            ref["model"] = r["model"]
            rows.append(ref)
            _print_llaisys(ref)
        rows += peers.run_all(r, o["model"], o["shape"], o["threads"], hf=not getattr(args, "skip_hf", False))
        table = comparison_table(rows)
        if table:
            print(table)
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0
