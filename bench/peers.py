#!/usr/bin/env python3
"""Run llaisys and its peers on the same model, prompt ids, token counts, threads and device, and print one
table: llama.cpp (llama-cpp-python, on a GGUF file, CPU), HF transformers eager, and on CUDA a static-cache
torch.compile decode. llaisys and llama.cpp each run in a process of their own (fair peak RSS).

    python bench/peers.py --model qwen2.5-coder-0.5b-instruct --device cpu --threads 2
    python bench/peers.py --shape qwen2-1.5b --gguf-types q4_k_m --device cpu      # a random GGUF of the shape
    python bench/peers.py --shape qwen2-1.5b --device cuda --prompt-len 128 --new-tokens 256
Same as `llaisys bench --peers`; see bench/llaisys_bench/peers.py for how each peer is timed.
"""
import argparse
import sys

from llaisys_bench import one_request, shapes  # this folder is sys.path[0] when run as a script


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--shape", choices=sorted(shapes.SHAPES))
    src.add_argument("--model")
    p.add_argument("--gguf-types", metavar="PRESET", help="with --shape: a random GGUF in these block formats "
                   "(q4_k_m, q8_0, q4_0, q5_0, q5_k, q6_k; bench/random_gguf.py)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "quantized", "bf16", "f16", "f32"],
                   help="llaisys' dtype, as for the Engine; when it keeps a GGUF's blocks (quantized or auto) "
                        "a bf16 reference row is added")
    p.add_argument("--threads", type=int, metavar="N", help="CPU threads of llaisys (LLAISYS_NUM_THREADS), "
                   "llama.cpp and torch (default: llaisys' own count, for all)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--skip-hf", action="store_true", help="leave out HF transformers (slow on a CPU)")
    p.add_argument("--json")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    args.peers = True
    return one_request.main(args)


if __name__ == "__main__":
    sys.exit(main())
