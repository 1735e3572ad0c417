#!/usr/bin/env python3
"""What a tensor-parallel split costs where it cuts a GGUF file's blocks (loader/shard.py shard_blocks):
the parts re-made as Q8_0 (the default), kept dense, or (for comparison) re-quantized to Q5_0/Q4_0, on the
CPU ranks. For each: the ranks' weight bytes, and the teacher-forced logits of a prompt against the file's
own math in float32 (every weight dequantized, one rank): relative L2 error, largest error over the largest
logit, and top-1 agreement; the unsplit quantized engine's row is the error the blocks already have. Then
the time (thread CPU seconds) to re-make one rank's part of a real model's down_proj (REMAKES).

    python bench/kquant_shards.py                         # the default catalog model (Q4_K_M 0.5B), TP 2
    python bench/kquant_shards.py --model x.gguf --tp 4
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import llaisys.loader.shard as shard  # noqa: E402
from llaisys import catalog  # noqa: E402
from llaisys.engine import Engine  # noqa: E402

PROMPT = ("def quicksort(items):\n    \"\"\"Sort a list in place and return it.\"\"\"\n    if len(items) <= 1:\n"
          "        return items\n    pivot = items[len(items) // 2]\n    left = [x for x in items if x < pivot]\n")


def logits(model: str, tp: int, dtype: str, requant) -> tuple[np.ndarray, int, dict]:
    shard.REQUANT_FORMAT = requant
    with Engine(model, device="cpu", dtype=dtype, progress=False, tensor_parallel_size=tp, max_seq_len=512) as eng:
        ids = eng.tokenizer.encode(PROMPT)
        d = eng.describe()
        return np.asarray(eng.score(ids), np.float64), d["weight_bytes"], d["weight_formats"]


def accuracy_rows(model: str, tp: int) -> list[str]:
    ref, ref_bytes, _ = logits(model, 1, "f32", "q8_0")
    rows = ["| variant | weight bytes (all ranks) | rel L2 err | max err / max logit | top-1 agree |",
            "|---|---|---|---|---|"]
    runs = [("TP 1, file's blocks", 1, "q8_0"), (f"TP {tp}, cut parts as Q8_0 (default)", tp, "q8_0"),
            (f"TP {tp}, cut parts dense f32", tp, None), (f"TP {tp}, cut parts as Q5_0", tp, "q5_0"),
            (f"TP {tp}, cut parts as Q4_0", tp, "q4_0")]
    for label, n, requant in runs:
        got, nbytes, formats = logits(model, n, "auto", requant)
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        peak = np.abs(got - ref).max() / np.abs(ref).max()
        agree = np.mean(got.argmax(-1) == ref.argmax(-1))
        rows.append(f"| {label} | {nbytes / 2**20:.1f} MiB | {err:.2e} | {peak:.2e} | {agree:.3f} |")
        print(rows[-1], {k: v["tensors"] for k, v in formats.items()}, file=sys.stderr, flush=True)
    rows.append(f"| reference: TP 1, every weight f32 | {ref_bytes / 2**20:.1f} MiB | 0 | 0 | 1 |")
    return rows


# (what, file format, rows, cols, ranks): a Qwen2.5-7B Q4_K down_proj at TP 4 (4736 columns, 18.5 blocks of
# 256: re-quantized to Q8_0) and Qwen2.5-72B's at TP 8 (llama.cpp stores its 29568-wide rows as Q8_0 or Q5_0,
# 32-column blocks, which TP 4 cuts whole; TP 8's 3696 columns are 115.5 blocks: kept dense)
REMAKES = (("7B down_proj, TP 4", "q4_k", 3584, 18944, 4), ("72B down_proj, TP 8", "q8_0", 8192, 29568, 8))


def remake_time(fmt: str, rows: int, cols: int, world: int) -> tuple[float, str, int]:
    """(thread CPU seconds, what it became, bytes) to re-make rank 1's part of a random matrix."""
    from llaisys import quant

    info = quant.format_info(fmt)
    data = np.random.default_rng(0).integers(0, 256, (rows, quant.row_bytes(fmt, cols)), dtype=np.uint8)
    scales = [0.01, 0.002] if fmt.endswith("_k") else [0.01]  # finite f16 scales at each block's start
    data.reshape(rows, -1, info["block_bytes"])[:, :, :2 * len(scales)] = np.frombuffer(
        np.float16(scales).tobytes(), np.uint8)
    per = cols // world
    t = time.thread_time()
    part = shard.shard_blocks("down_proj", fmt, rows, cols, data, shard.Cut(1, per, 2 * per))
    seconds = time.thread_time() - t
    return seconds, part.remade, (part.dense if part.dense is not None else part.blocks[3]).nbytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the default catalog model)")
    ap.add_argument("--tp", type=int, default=2)
    args = ap.parse_args()
    model = args.model or catalog.resolve(catalog.DEFAULT_MODEL)
    print(f"{os.path.basename(model)}, CPU ranks, load average {os.getloadavg()[0]:.1f}")
    print("\n".join(accuracy_rows(model, args.tp)))
    shard.REQUANT_FORMAT = "q8_0"
    for what, fmt, rows, cols, world in REMAKES:
        seconds, became, nbytes = remake_time(fmt, rows, cols, world)
        print(f"re-make one rank's part of a {what} ({fmt.upper()} [{rows}, {cols}]) as {became}: "
              f"{seconds:.2f} s thread CPU, {nbytes / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
