"""Tensor-parallel shards of a model's weights (issue 30), cut as the core's weight table says.

Megatron's scheme: q/k/v and gate/up are column-parallel (each rank computes some output rows: whole
attention heads, a slice of the MLP), o and down are row-parallel (each rank reads the inputs its heads or
MLP slice produced; one all-reduce sums the ranks' partial outputs); the LM head splits the vocabulary (each
rank's logits slice is gathered by all); the embedding is replicated (a vocabulary-split lookup would cost a
masked gather and one more all-reduce per step, for V x H bytes a rank: 2.5 GB of a 72B model's ~36 GB
share at 4 ranks); norms and the biases added after an all-reduce stay whole on every rank. The table's split dim
(0 rows, 1 columns, -1 whole) says which; the role says the unit a cut must respect (a head of head_dim
rows, NeoX's per-head [q; k; v] triple, a GGUF block of columns).

KV heads: split when there are at least as many as ranks, else replicated (rank r holds KV head
r // (world / kv_heads), the one its query heads read). Every cut is a slice of one dimension, so a loader
can read a shard straight from the file (safetensors slices, GGUF rows or whole blocks) without any rank
holding the whole tensor. `check_tensor_parallel` raises before any weight is read.

A GGUF row-parallel cut need not fall on whole blocks: Qwen2.5-72B's MLP of 29568 over 4 ranks is 7392
columns a rank, 28.875 blocks of 256. Such a part is decoded from the blocks that cover it and re-quantized
into Q8_0 (or kept dense where Q8_0's 32 columns do not divide it either): shard_blocks, which the loader
reports per tensor. Keeping the file's blocks exactly would need the model to change: parts of unequal
width (every rank's gate/up rows too), or each rank holding the blocks that cover its columns (at most two
blocks a row more) and multiplying the columns outside its range by zeros padded onto its input.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import _core

# role -> the head a row (or, for o, a column) belongs to: query heads, KV heads, or NeoX's fused triples
_HEAD_UNITS = {"q": "q", "q_bias": "q", "o": "q", "k": "kv", "k_bias": "kv", "v": "kv", "v_bias": "kv",
               "qkv_heads": "qkv", "qkv_heads_bias": "qkv"}
_REPLICATED = ("embed",)  # whole on every rank (see above), whatever the table's split dim


@dataclass(frozen=True)
class Cut:
    """One rank's part of a tensor: elements [start, stop) of dimension dim (dim -1: the whole tensor)."""
    dim: int
    start: int = 0
    stop: int = 0


def vocab_range(vocab_size: int, world: int, rank: int) -> tuple[int, int]:
    """The token ids [start, stop) whose LM-head rows and logits rank holds: vocab_size / world each (the
    split must be even, for the all-gather: check_tensor_parallel says so first)."""
    if vocab_size % world:
        raise ValueError(f"vocab_size {vocab_size} is not a multiple of tensor_parallel_size {world}")
    per = vocab_size // world
    return rank * per, (rank + 1) * per


def check_tensor_parallel(config, world: int) -> None:
    """ValueError naming everything that does not divide, for a model that cannot run on `world` ranks (the
    core's own check, which a rank's model makes again: _core.tensor_parallel_config)."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {world!r}")
    _core.tensor_parallel_config(config.core, world)


def rank_cut(entry: tuple, config, world: int, rank: int) -> Cut:
    """Rank `rank`'s cut of one weight-table entry (HF name, GGUF name, shape, group, split dim, role, layer)."""
    name, _, shape, _, split, role, _ = entry
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, {world})")
    if split < 0 or world == 1 or role in _REPLICATED:
        return Cut(-1)
    n = shape[split]
    if role == "lm_head":
        return Cut(split, *vocab_range(n, world, rank))
    unit_kind = _HEAD_UNITS.get(role)
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if unit_kind == "kv" and kv < world:  # replicated: this rank's query heads read KV head r // (world / kv)
        size = n // kv
        head = rank // (world // kv)
        return Cut(split, head * size, (head + 1) * size)
    units = {"q": heads, "qkv": heads, "kv": kv}.get(unit_kind, n)
    if n % units or units % world:
        raise ValueError(f"{name}: dimension {split} of {tuple(shape)} does not split into {world} parts of whole "
                         f"{'heads' if unit_kind else 'rows'}")
    per = n // world
    return Cut(split, rank * per, (rank + 1) * per)


def cut_dense(array: np.ndarray, cut: Cut) -> np.ndarray:
    """The rank's part of a dense tensor (a view where the slice allows: rows always)."""
    if cut.dim < 0:
        return array
    index = [slice(None)] * array.ndim
    index[cut.dim] = slice(cut.start, cut.stop)
    return array[tuple(index)]


def cut_blocks(name: str, fmt: str, rows: int, cols: int, data: np.ndarray, cut: Cut):
    """The rank's part of a GGUF-block matrix [rows, row bytes] (uint8): rows as they are, columns only
    along whole blocks (a block packs block_elems consecutive columns of one row). (fmt, rows, cols, data).
    A column cut inside blocks raises: shard_blocks is the loader's way, which re-makes such a part."""
    if cut.dim < 0:
        return fmt, rows, cols, data
    if cut.dim == 0:
        return fmt, cut.stop - cut.start, cols, data[cut.start:cut.stop]
    elems, nbytes = _block(fmt)
    if cut.start % elems or cut.stop % elems:
        raise ValueError(f"{name}: a {fmt} row packs {elems} columns per block, so its columns "
                         f"[{cut.start}, {cut.stop}) cannot be cut out for this rank as blocks (the split must fall "
                         f"on whole blocks)")
    part = data[:, cut.start // elems * nbytes:cut.stop // elems * nbytes]
    return fmt, rows, cut.stop - cut.start, np.ascontiguousarray(part)


# The format a part whose cut falls inside the file's blocks is re-quantized into: Q8_0's 32-column blocks
# divide every K-quant cut over 2, 4 or 8 ranks (256 / 8), its 8.5 bits a weight are half of bf16's and
# its rounding (at most 1/254 of a block's largest weight) is small beside the 4-6 bit formats' own error:
# bench/RESULTS.md "K-quant shards" measured it against dense parts. A width Q8_0 cannot hold either (a
# 32-column format's cut inside its blocks) stays dense.
REQUANT_FORMAT = "q8_0"  # None: always dense (bench/kquant_shards.py compares)
_CHUNK = 1 << 20  # elements decoded (float32) at a time: a part is never whole in float32 unless kept dense


@dataclass(frozen=True)
class BlockShard:
    """A rank's part of a GGUF-block matrix: `blocks` (fmt, rows, cols, uint8 data) for load_quant_weight,
    or `dense` (float32 [rows, cols]) for load_weight; `remade`: None when the part is the file's own
    blocks, else what it was re-made as (REQUANT_FORMAT or "dense") because the cut falls inside blocks."""
    blocks: tuple | None = None
    dense: np.ndarray | None = None
    remade: str | None = None


def shard_blocks(name: str, fmt: str, rows: int, cols: int, data: np.ndarray, cut: Cut) -> BlockShard:
    """The rank's part of a GGUF-block matrix: its own blocks where the cut falls on whole blocks (rows
    always do), else the covering blocks decoded a few rows at a time and re-quantized into REQUANT_FORMAT
    (or kept dense where its blocks do not divide the width) -- only this rank's columns are ever decoded."""
    if cut.dim != 1 or not (cut.start % _block(fmt)[0] or cut.stop % _block(fmt)[0]):
        return BlockShard(blocks=cut_blocks(name, fmt, rows, cols, data, cut))
    if not (0 <= cut.start < cut.stop <= cols) or data.shape != (rows, _row_bytes(fmt, cols)):
        raise ValueError(f"{name}: columns [{cut.start}, {cut.stop}) of a {fmt} matrix [{rows}, {cols}] held in "
                         f"{data.shape} bytes: not a cut of this tensor")
    width = cut.stop - cut.start
    target = REQUANT_FORMAT if REQUANT_FORMAT and width % _block(REQUANT_FORMAT)[0] == 0 else "dense"
    if target == "dense":
        out = np.empty((rows, width), np.float32)
    else:
        out = np.empty((rows, _row_bytes(target, width)), np.uint8)
    for r0, part in _decoded_rows(fmt, rows, data, cut):
        out[r0:r0 + len(part)] = part if target == "dense" else _quantize(target, part)
    if target == "dense":
        return BlockShard(dense=out, remade=target)
    return BlockShard(blocks=(target, rows, width, out), remade=target)


def _decoded_rows(fmt: str, rows: int, data: np.ndarray, cut: Cut):
    """(first row, float32 [n, width]) for the columns [cut.start, cut.stop) of every row, decoded by the
    core from the blocks that cover them (at most one block more at either end), _CHUNK elements at a time."""
    from ..quant import from_numpy

    elems, nbytes = _block(fmt)
    b0, b1 = cut.start // elems, -(-cut.stop // elems)
    lo, width = cut.start - b0 * elems, cut.stop - cut.start
    step = max(1, _CHUNK // ((b1 - b0) * elems))
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        blocks = np.ascontiguousarray(data[r0:r0 + n, b0 * nbytes:b1 * nbytes])
        yield r0, from_numpy(fmt, n, (b1 - b0) * elems, blocks).dequantize()[:, lo:lo + width]


def _quantize(fmt: str, x: np.ndarray) -> np.ndarray:
    """float32 [n, k] (k a multiple of fmt's block) -> blocks [n, row bytes], as ggml's reference quantizer
    makes them (gguf-py's port, bit-exact with ggml-quants.c; it has Q8_0, Q4_0 and Q5_0)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    return quantize(np.ascontiguousarray(x), GGMLQuantizationType[fmt.upper()])


def _block(fmt: str) -> tuple[int, int]:
    from ..quant import format_info

    info = format_info(fmt)
    return info["block_elems"], info["block_bytes"]


def _row_bytes(fmt: str, cols: int) -> int:
    elems, nbytes = _block(fmt)
    return cols // elems * nbytes
