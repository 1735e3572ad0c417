"""Per-kernel time of a decode step of the batched engine on CUDA (random weights of a real Qwen2 shape,
bf16 safetensors or a random GGUF kept in its block formats).

    python bench/decode_breakdown.py [--shape qwen2-0.5b] [--gguf-types q4_k_m] [--batch 1] [--steps 32] [-tp N]

Runs `Engine.generate` (CUDA graphs on, the real path) for `--batch` requests of `--context` prompt tokens
under torch.profiler, which records every kernel of the process through CUPTI, including those replayed
from the Runner's graphs: once with 1 new token (prefill and the first sample) and once with 1 + steps.
Both runs use the same prompts, put in the prefix cache by a warm-up run first, so each prefills only the
last few tokens of every prompt in one step (with fresh prompts, a long prefill's chunks ran beside the
first decodes and were counted as decode). The difference, divided by steps, is what one decode step costs: per kernel name, launches and device µs
per step; then kernel time against the step's wall time (the rest is gaps between kernels and the
host's work). With PDL on (the default), CUPTI counts a kernel's wait for its predecessor as its own
time: set LLAISYS_PDL=0 for durations that add up.
"""
from __future__ import annotations

import argparse
import json

from llaisys_bench.kernel_profile import is_collective, print_rows, profiled  # this folder is sys.path[0]

def prefill_report(eng, args, prompts) -> int:
    """--prefill: every kernel of one generate(prompts, 1 new token) with prompts the cache has not seen."""
    per, wall, idle = profiled(eng, prompts, 1)
    tokens = sum(map(len, prompts))
    total = sum(us for k, (n, us) in per.items() if not k.startswith("Memcpy"))
    print(f"{args.shape}, prefill of {args.batch} prompts x {args.context} tokens: wall {wall * 1e3:.1f} ms "
          f"(profiled; {tokens / wall:,.0f} tok/s), kernel time {total / 1e3:.1f} ms, GPU idle {idle / 1e3:.1f} ms")
    print_rows(per)
    eng.close()
    return 0


def main() -> int:
    from llaisys_bench.shapes import SHAPES  # llaisys_bench finds llaisys' sources
    from llaisys_bench.throughput import open_engine, random_checkpoint, requests

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--gguf-types", metavar="PRESET", help="a random GGUF of the shape in these block formats")
    ap.add_argument("--dtype", help="default: quantized for --gguf-types, else bf16")
    ap.add_argument("--batch", type=int, default=1, help="requests decoded together")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--context", type=int, default=256, help="prompt tokens of each request")
    ap.add_argument("--prefill", action="store_true",
                    help="instead: the kernels of prefilling --batch fresh prompts of --context tokens (one "
                         "generate of 1 new token; its prompts miss the prefix cache): ms per kernel for the whole prefill")
    ap.add_argument("--logprobs", type=int, metavar="K",
                    help="every request asks for logprobs=K (the logprobs kernel and its copies in the step)")
    ap.add_argument("--temperature", type=float, metavar="T",
                    help="every request samples at T (the protocol's 0.6: the sampler's passes in the step)")
    ap.add_argument("--regex", metavar="RE",
                    help="every request constrained by this regex (issue 31: the masks' copies and the deferred "
                         "sampling in the step); memory copies are listed too")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                    help="split the model over N GPUs; the table is rank 0's GPU, with its collectives' share")
    ap.add_argument("--json")
    args = ap.parse_args()

    from llaisys.engine.engine import Engine

    dtype = args.dtype or ("quantized" if args.gguf_types else "bf16")
    kw = dict(device="cuda", dtype=dtype, max_seq_len=args.context + args.steps + 64, max_num_seqs=max(args.batch, 1),
              tensor_parallel_size=args.tensor_parallel_size)
    if args.gguf_types:
        from random_gguf import cached_random_gguf

        eng = Engine(cached_random_gguf(args.shape, args.gguf_types), progress=False, **kw)
    elif args.shape.startswith("qwen2") and args.tensor_parallel_size == 1:
        eng = Engine(random_checkpoint(args.shape), progress=False, **kw)
    else:  # the other families' shapes and split models: random weights built in memory (each rank cuts its own)
        eng = open_engine(shape=args.shape, **kw)[0]
    prompts = requests(args.batch, args.context, args.context, eng.config.vocab_size)[0]
    # graph capture, allocator warm-up, and the prompts' blocks into the prefix cache
    gen_kw = {k: v for k, v in dict(logprobs=args.logprobs, regex=args.regex, temperature=args.temperature).items()
              if v is not None}
    eng.generate(prompts, max_new_tokens=8, ignore_eos=True, **{"temperature": 0, **gen_kw})
    if args.prefill:
        return prefill_report(eng, args, requests(args.batch, args.context, args.context, eng.config.vocab_size,
                                                   seed=1)[0])
    # one profiled call thrown away first: session 41's breakdowns (H200 x2) printed a 788 us "step" of 1,407 us of
    # kernels (GPU idle -552 us): the 1-token run's wall and idle held more than the longer run's, most likely a
    # one-time cost of the first profiled call (the profiler's start-up); not yet confirmed on a GPU
    profiled(eng, prompts, 1, **gen_kw)
    base, wall0, idle0 = profiled(eng, prompts, 1, **gen_kw)
    full, wall1, idle1 = profiled(eng, prompts, 1 + args.steps, **gen_kw)
    rows = []
    for k, (n, us) in full.items():
        n0, us0 = base.get(k, (0, 0.0))
        if n - n0 > 0:
            rows.append((k, (n - n0) / args.steps, (us - us0) / args.steps))
    rows.sort(key=lambda r: -r[2])
    total = sum(r[2] for r in rows if not r[0].startswith("Memcpy"))
    wall = (wall1 - wall0) / args.steps * 1e6
    idle = (idle1 - idle0) / args.steps
    what = f"{args.gguf_types} GGUF ({dtype})" if args.gguf_types else dtype
    what += "".join(f", {k}={v}" for k, v in gen_kw.items())
    if args.tensor_parallel_size > 1:
        what += f", tensor parallel {args.tensor_parallel_size} (rank 0's GPU)"
    print(f"{args.shape}, {what}, batch {args.batch}, context {args.context}: decode step wall {wall:.1f} µs "
          f"(profiled), kernel time {total:.1f} µs, launches/step {sum(r[1] for r in rows):.0f}, GPU idle {idle:.1f} µs "
          f"(no kernel running: the host's part of a step)")
    print(f"{'kernel':<44}{'launches':>9}{'µs/step':>10}{'share':>8}{'µs/launch':>11}")
    for k, n, us in rows:
        print(f"{k[:43]:<44}{n:9.1f}{us:10.1f}{100 * us / max(total, 1e-9):7.1f}%{us / max(n, 1e-9):11.2f}")
    coll = [(n, us) for k, n, us in rows if is_collective(k)]
    coll_us = sum(us for _, us in coll)
    if args.tensor_parallel_size > 1:  # a collective's time includes its wait for the slowest rank
        print(f"collectives (all-reduce, all-gather; rank 0): {sum(n for n, _ in coll):.0f} launches, {coll_us:.1f} µs a "
              f"step = {100 * coll_us / max(wall, 1e-9):.1f}% of the step's wall, {100 * coll_us / max(total, 1e-9):.1f}% "
              f"of its kernel time")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "dtype": what, "batch": args.batch, "wall_us": wall, "kernel_us": total, "idle_us": idle,
                       "tensor_parallel_size": args.tensor_parallel_size, "collective_us": coll_us,
                       "kernels": [dict(name=k, launches=n, us=us) for k, n, us in rows]}, f, indent=2)
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
