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
    along whole blocks (a block packs block_elems consecutive columns of one row). (fmt, rows, cols, data)."""
    if cut.dim < 0:
        return fmt, rows, cols, data
    if cut.dim == 0:
        return fmt, cut.stop - cut.start, cols, data[cut.start:cut.stop]
    from ..quant import format_info

    info = format_info(fmt)
    elems, nbytes = info["block_elems"], info["block_bytes"]
    if cut.start % elems or cut.stop % elems:
        raise ValueError(f"{name}: a {fmt} row packs {elems} columns per block, so its columns "
                         f"[{cut.start}, {cut.stop}) cannot be cut out for this rank (the split must fall on whole "
                         f"blocks: use fewer GPUs or a dense checkpoint)")
    part = data[:, cut.start // elems * nbytes:cut.stop // elems * nbytes]
    return fmt, rows, cut.stop - cut.start, np.ascontiguousarray(part)
