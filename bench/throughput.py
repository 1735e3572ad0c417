"""Batched throughput, nano-vllm's protocol: a thin wrapper of bench/llaisys_bench/throughput.py (what
`llaisys bench --throughput [N]` runs), keeping this script's flags (bench/gpu_check.sh calls it). N requests
with prompt and output lengths uniform in [min_len, max_len] (seed 0), random prompt ids, EOS ignored. Prints
output tok/s and total tok/s, and where a step's time goes (scheduler, host arrays, runner, bookkeeping).
--solo also runs the same requests one at a time; --peers runs HF transformers' continuous batching
(generate_batch) on the same requests (one max_new_tokens for all: HF takes no per-request length, so that row
uses the mean length for both engines); --single PROMPT NEW measures one request's decode instead.

    python bench/throughput.py --shape qwen2-0.5b --device cuda            # random weights of the shape
    python bench/throughput.py --shape qwen2-1.5b --gguf-types q4_k_m --device cuda   # a random GGUF of it
    python bench/throughput.py --model qwen2.5-coder-0.5b-instruct --device cpu -n 16 --max-len 128 --solo

--gguf-types PRESET (q4_k_m, q8_0, q4_0, q5_0, q5_k, q6_k) runs a random GGUF file of the shape in those block
formats (bench/random_gguf.py, kept in the temp dir) instead of random bf16 weights; --dtype quantized (the
default there) keeps its blocks on any device, bf16 dequantizes them.
"""
from __future__ import annotations

import argparse
import json
import sys

from llaisys_bench import shapes, throughput as bt  # this folder is sys.path[0] when run as a script


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--shape", choices=sorted(shapes.SHAPES))
    src.add_argument("--model")
    ap.add_argument("--gguf-types", metavar="PRESET", help="with --shape: a random GGUF in these block formats")
    ap.add_argument("--dtype", choices=["auto", "quantized", "bf16", "f32"],
                    help="default: quantized for a GGUF file (its block formats, on any device), else bf16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("-n", "--num-requests", type=int, default=bt.DEFAULTS["num_requests"])
    ap.add_argument("--min-len", type=int, default=bt.DEFAULTS["min_len"])
    ap.add_argument("--max-len", type=int, default=bt.DEFAULTS["max_len"])
    ap.add_argument("--temperature", type=float, default=bt.DEFAULTS["temperature"])
    ap.add_argument("--max-num-seqs", type=int, default=bt.DEFAULTS["max_num_seqs"])
    ap.add_argument("--max-num-batched-tokens", type=int, metavar="T",
                    help="the engine's token budget a step (default: the engine's for the device)")
    ap.add_argument("--solo", action="store_true", help="also run the requests one at a time")
    ap.add_argument("--peers", action="store_true", help="also run HF transformers' generate_batch")
    ap.add_argument("--single", nargs=2, type=int, metavar=("PROMPT", "NEW"),
                    help="instead: decode speed of one request (median of 3), as `llaisys bench` measures it")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="run the requests again under cProfile (the step loop's thread) and print the N functions "
                         "with the most own host time per step")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="run the requests again under torch.profiler (CUDA) and print the N kernels with the most "
                         "device time over the whole run")
    ap.add_argument("--json", metavar="FILE", help="also write the result dict as JSON to FILE")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="split the model over N GPUs")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.gguf_types and not args.shape:
        ap.error("--gguf-types writes a random GGUF of --shape: give --shape")
    try:
        bt.check(args.num_requests, args.min_len, args.max_len, args.temperature, args.max_num_seqs)
        if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {args.max_num_batched_tokens}")
        if args.single and min(args.single) < 1:
            raise ValueError(f"--single PROMPT NEW must both be >= 1, got {args.single}")
    except ValueError as e:
        ap.error(str(e))
    gguf = bool(args.gguf_types) or str(args.model).endswith(".gguf")
    dtype = args.dtype or ("quantized" if gguf else "bf16")
    r = bt.throughput(shape=args.shape, model=args.model, gguf_types=args.gguf_types, device=args.device,
                      dtype=dtype, num_requests=args.num_requests, min_len=args.min_len, max_len=args.max_len,
                      temperature=args.temperature, max_num_seqs=args.max_num_seqs, solo=args.solo,
                      peers=args.peers, single=tuple(args.single) if args.single else None,
                      tensor_parallel_size=args.tensor_parallel_size, profile=args.profile,
                      kernels=args.kernels, max_num_batched_tokens=args.max_num_batched_tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
