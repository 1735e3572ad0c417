#!/usr/bin/env python3
"""Prefill speed of one prompt alone against the prompt chunk size (issue 29's CPU prefill): one Engine per
`--chunks` value (max_prefill_chunk = max_num_batched_tokens = the chunk, so each step computes that many prompt
tokens), prompts of fresh random ids (no prefix hits), 1 new token, the engines in interleaved order; prints
the median prefill tok/s of each.

    LLAISYS_BUILD_DIR=build/dev PYTHONPATH=python python bench/prefill_chunks.py --model gemma-3-270m \\
        --prompt-len 512 --chunks 32 64 128 256
"""
from __future__ import annotations

import argparse
import statistics
import time

from llaisys_bench.one_request import bench_prompts, catalog_path  # this folder is sys.path[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma-3-270m", help="a catalog name or a local model path")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--chunks", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if args.prompt_len < 1 or args.rounds < 1 or min(args.chunks) < 1:
        ap.error("--prompt-len, --rounds and every --chunks value must be >= 1")
    from llaisys import Engine

    path = catalog_path(args.model)
    engines = {c: Engine(path, device=args.device, dtype="auto", max_seq_len=args.prompt_len + 64, progress=False,
                         max_prefill_chunk=c, max_num_batched_tokens=c, max_num_seqs=min(c, 256))
               for c in args.chunks}
    vocab = engines[args.chunks[0]].config.vocab_size
    rates = {c: [] for c in args.chunks}
    for r in range(args.rounds):
        for c in (args.chunks if r % 2 == 0 else args.chunks[::-1]):  # no order advantage
            ids = bench_prompts(vocab, args.prompt_len, seed=1000 * r + c)[1]
            t = time.perf_counter()
            engines[c].generate([ids], max_new_tokens=1, temperature=0)
            rates[c].append(args.prompt_len / (time.perf_counter() - t))
    for c in args.chunks:
        print(f"{args.model}, prompt {args.prompt_len}, chunk {c}: prefill {statistics.median(rates[c]):,.0f} tok/s "
              f"(runs {', '.join(f'{x:,.0f}' for x in rates[c])})")
    for e in engines.values():
        e.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
