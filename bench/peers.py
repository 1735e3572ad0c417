#!/usr/bin/env python3
"""Run llaisys and its peers (HF transformers eager; on CUDA also a static-cache torch.compile decode) on
the same shape, device and token counts in one process, and print one table.

    python bench/peers.py --shape qwen2-1.5b --device cuda --prompt-len 128 --new-tokens 256
Same as `llaisys bench --peers`; see python/llaisys/_peers.py for how each peer is timed.
"""
import argparse
import sys

from llaisys import bench


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(bench.SHAPES))
    p.add_argument("--model")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "f16", "f32"])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--json")
    args = p.parse_args()
    args.peers = True
    return bench.main(args)


if __name__ == "__main__":
    sys.exit(main())
