"""The CPU quantized linear's prefill (M > 1): W rows decoded once per group of 8 for every x tile (cpu.cpp:
run_prefill; kernels.inc: decode_u8, tile_u8; on AVX-512 tile_u8_pairs, two x rows per 512-bit vector), the
K-quants' and Q8_0's 8-row tiles on AVX2 (on AVX-512 the K-quants' pair tiles, kpairs_tile: x rows packed in
pairs, 4 pairs a tile), and the tile's outputs written by x row. The shapes that would break them: W row counts with a partial last group and ranges
split across threads, x row counts around the 8-row passes and 16-row packed tiles, an odd block count (the
split layout's unpaired last block), and linear_swiglu, whose gate and up planes meet inside a group.
References: float64 on gguf-py's dequantization and on x quantized as the op documents (test_quant), and the
portable path's bits."""
import numpy as np
import pytest

import llaisys
from llaisys import quant
from utils import bits, poisoned

gguf = pytest.importorskip("gguf")
from test_quant import (block_elems, check, cpu_path, gtype, linear_tol, matrix,  # noqa: F401 (cpu_path: fixture)
                        quantized_x, random_blocks)

# K per format: an odd number of blocks
K_OF = {"q4_0": 21 * 32, "q5_0": 21 * 32, "q8_0": 21 * 32, "q4_k": 3 * 256, "q5_k": 3 * 256, "q6_k": 3 * 256}
CASES = [(fmt, "file") for fmt in K_OF] + [("q5_0", "q5_split")]


def weights(fmt, layout, N, seed, K=None):
    data = random_blocks(fmt, N, K or K_OF[fmt], seed=seed)
    w = matrix(fmt, data)
    return data, (w if layout == "file" else w.with_layout(layout))


@pytest.mark.parametrize("fmt,layout", CASES, ids=[f"{f}-{l}" for f, l in CASES])
@pytest.mark.parametrize("M", [1, 2, 7, 9, 16, 33, 47])
@pytest.mark.parametrize("N", [13, 301])  # 13: one full group and a partial one; 301: many groups, both threads
def test_prefill_groups_each_cpu_path(cpu_path, fmt, layout, M, N):
    data, w = weights(fmt, layout, N, seed=M * 31 + N)
    rng = np.random.default_rng(M + N)
    x = rng.standard_normal((M, K_OF[fmt])).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    out = poisoned((M, N))
    quant.linear_(out, llaisys.tensor(x), w, llaisys.tensor(b))
    xq = quantized_x(x, block_elems(fmt))
    ref = xq @ gguf.quants.dequantize(data, gtype(fmt)).astype(np.float64).T + b.astype(np.float64)
    check(out, ref, linear_tol(fmt, "f32", xq, data))
    quant.set_cpu_path("portable")
    np.testing.assert_array_equal(bits(out), bits(quant.linear(llaisys.tensor(x), w, llaisys.tensor(b))))


@pytest.mark.parametrize("fmt,layout", [("q5_0", "q5_split"), ("q5_0", "file"), ("q4_k", "file")])
@pytest.mark.parametrize("M", [2, 33])
@pytest.mark.parametrize("I", [37, 301])  # gate row I - 1 and up row 0 share a group of 8
def test_prefill_swiglu_planes_meet_in_a_group(cpu_path, fmt, layout, M, I):
    _, w = weights(fmt, layout, 2 * I, seed=I + M)
    x = llaisys.tensor(np.random.default_rng(M).standard_normal((M, K_OF[fmt])).astype(np.float32))
    out = poisoned((M, I))
    quant.linear_swiglu_(out, x, w)
    ref = poisoned((M, I))
    llaisys.ops.swiglu(ref, quant.linear(x, w.slice_rows(0, I)), quant.linear(x, w.slice_rows(I, 2 * I)))
    np.testing.assert_array_equal(bits(out), bits(ref))


@pytest.mark.parametrize("fmt,layout", CASES, ids=[f"{f}-{l}" for f, l in CASES])
@pytest.mark.parametrize("M", [2, 3, 8, 10, 17])  # one pair; an odd row in a pair; one 8-row pair tile and past it
def test_prefill_one_block_rows_each_cpu_path(cpu_path, fmt, layout, M):
    """K at one block: the pair tiles' tail block (no odd accumulator) and nothing else."""
    K, N = block_elems(fmt), 19
    data, w = weights(fmt, layout, N, seed=M + 7, K=K)
    x = np.random.default_rng(M).standard_normal((M, K)).astype(np.float32)
    out = poisoned((M, N))
    quant.linear_(out, llaisys.tensor(x), w)
    xq = quantized_x(x, block_elems(fmt))
    check(out, xq @ gguf.quants.dequantize(data, gtype(fmt)).astype(np.float64).T, linear_tol(fmt, "f32", xq, data))
    quant.set_cpu_path("portable")
    np.testing.assert_array_equal(bits(out), bits(quant.linear(llaisys.tensor(x), w)))
