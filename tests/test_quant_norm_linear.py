"""quant.add_rms_norm_linear_: add_rms_norm, then a quantized projection (linear or linear + SwiGLU) of its
output, with the residual out of place. On CUDA, for up to 8 rows of a 2-byte dtype and widths the GEMV can
reproduce, it is one kernel that makes the norm itself (the decode step's layer inputs); it must give the
same bits as the ops it replaces, for every width, row count and dtype, fused or not."""
import numpy as np
import pytest

import llaisys
from llaisys import quant
from test_quant import matrix, random_blocks
from utils import NP_DTYPE, bits, poisoned

EPS = 1e-6


def operands(M, K, dtype, device, seed, wmax=1.0):
    """residual, delta, norm weight; the norm weight keeps x @ W (|W| <= wmax) well inside f16."""
    rng = np.random.default_rng(seed)
    res = (3 * rng.standard_normal((M, K))).astype(np.float32)
    delta = rng.standard_normal((M, K)).astype(np.float32)
    norm = ((1 + 0.2 * rng.standard_normal(K)) * 4 / (wmax * np.sqrt(K))).astype(np.float32)
    return [llaisys.tensor(a.astype(NP_DTYPE[dtype]), device) for a in (res, delta, norm)]


def run_both(fmt, K, M, N, dtype, swiglu, device, seed=0):
    """(fused op's out, residual_out, residual after) and the reference ops' (out, residual)."""
    host_w = matrix(fmt, random_blocks(fmt, 2 * N if swiglu else N, K, seed=seed + 1))
    residual, delta, norm = operands(M, K, dtype, device, seed, wmax=float(np.abs(host_w.dequantize()).max()))
    before = bits(residual)
    w = host_w.to(device)
    bias = None if swiglu else llaisys.tensor(
        np.random.default_rng(seed + 2).standard_normal(N).astype(NP_DTYPE[dtype]), device)
    out, res_out = poisoned((M, N), dtype, device), poisoned((M, K), dtype, device)
    quant.add_rms_norm_linear_(out, res_out, residual, delta, norm, EPS, w, bias, swiglu)
    np.testing.assert_array_equal(bits(residual), before)  # read only

    ref_res = llaisys.tensor(residual.to("cpu").numpy(), device)
    x = poisoned((M, K), dtype, device)
    llaisys.ops.add_rms_norm(x, ref_res, delta, norm, EPS)
    ref = quant.linear_swiglu(x, w) if swiglu else quant.linear(x, w, bias)
    return (out, res_out), (ref, ref_res)


def assert_same(got, want):
    for g, w in zip(got, want):
        np.testing.assert_array_equal(bits(g), bits(w))
    assert np.isfinite(got[0].to("cpu").to("f32").numpy()).all()


@pytest.mark.parametrize("fmt,K", [("q4_k", 256), ("q5_0", 96), ("q8_0", 512)])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("swiglu", [False, True])
def test_equals_add_rms_norm_then_linear(fmt, K, dtype, M, swiglu):
    assert_same(*run_both(fmt, K, M, 37, dtype, swiglu, "cpu"))


cuda = pytest.mark.cuda


# Widths: K / 8 = 4..288 vectors. 32, 128, 256, 896, 1536 and 2048 run fused (one vector per thread, as
# add_rms_norm's kernels hold them; 32 and 128 fill part of a warp); 512 (a warp with two vectors a lane
# there) and 2304 (more vectors than the GEMV's threads) take the composed path. N = 2800 at 1536: K-quants
# there take the chunked GEMV.
FUSED_WIDTHS = {32, 128, 256, 896, 1536, 2048}


@cuda
@pytest.mark.parametrize("fmt,K", [("q4_0", 32), ("q8_0", 128), ("q4_k", 256), ("q5_0", 896), ("q8_0", 896),
                                   ("q4_k", 1536), ("q6_k", 1536), ("q5_k", 512), ("q4_0", 2048), ("q6_k", 2304)])
@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("M", [1, 2, 3, 8, 9])
@pytest.mark.parametrize("swiglu", [False, True])
def test_cuda_equals_add_rms_norm_then_linear(fmt, K, dtype, M, swiglu):
    fused = K in FUSED_WIDTHS and dtype != "f32" and M <= 8
    assert quant.add_rms_norm_linear_fused(dtype, "cuda", M, K) == fused
    N = 2800 if K == 1536 else 37
    assert_same(*run_both(fmt, K, M, N, dtype, swiglu, "cuda", seed=K + M))


@cuda
def test_cuda_nan_in_delta_makes_its_row_nan():
    residual, delta, norm = operands(3, 1536, "bf16", "cuda", seed=5)
    d = delta.to("cpu").to("f32").numpy()
    d[1, 700] = np.nan
    delta = llaisys.tensor(d.astype(NP_DTYPE["bf16"]), "cuda")
    w = matrix("q4_k", random_blocks("q4_k", 64, 1536, seed=6)).to("cuda")
    for M in (1, 2, 3):  # shared-memory x (1, 2) and x made ahead (3)
        out, res_out = poisoned((M, 64), "bf16", "cuda"), poisoned((M, 1536), "bf16", "cuda")
        quant.add_rms_norm_linear_(out, res_out, residual.slice(0, 0, M), delta.slice(0, 0, M), norm, EPS, w)
        got = out.to("cpu").to("f32").numpy()
        assert np.isfinite(got[0]).all()
        if M > 1:
            assert np.isnan(got[1]).all() and np.isfinite(got[2:]).all()


def test_fused_predicate():
    fused = quant.add_rms_norm_linear_fused
    assert not fused("bf16", "cpu", 1, 1536)
    assert fused("bf16", "cuda", 1, 1536) and fused("f16", "cuda", 8, 896) and fused("bf16", "cuda", 2, 2048)
    assert fused("bf16", "cuda", 1, 256) and fused("bf16", "cuda", 1, 32) and fused("bf16", "cuda", 1, 8)
    assert not fused("f32", "cuda", 1, 1536)  # add_rms_norm's f32 vectors are 4 wide
    assert not fused("bf16", "cuda", 9, 1536)  # more rows than the GEMV takes
    assert not fused("bf16", "cuda", 1, 512)  # one warp, two vectors a lane: another order of sums
    assert not fused("bf16", "cuda", 1, 3584)  # more vectors than the GEMV's threads


def test_errors():
    residual, delta, norm = operands(2, 256, "f32", "cpu", seed=1)
    w = matrix("q8_0", random_blocks("q8_0", 8, 256, seed=2))
    out, res_out = llaisys.empty([2, 8]), llaisys.empty([2, 256])
    op = quant.add_rms_norm_linear_
    with pytest.raises(ValueError, match="add_rms_norm_quant_linear: residual_out .*overlap"):
        op(out, residual, residual, delta, norm, EPS, w)
    with pytest.raises(ValueError, match="with swiglu"):
        op(llaisys.empty([2, 4]), res_out, residual, delta, norm, EPS, w, llaisys.empty([8]), True)
    with pytest.raises(ValueError, match="weight's cols"):
        op(out, res_out, residual, delta, norm, EPS, matrix("q8_0", random_blocks("q8_0", 8, 512, seed=2)))
    with pytest.raises(ValueError, match="add_rms_norm_quant_linear"):
        op(llaisys.empty([2, 9]), res_out, residual, delta, norm, EPS, w)
    with pytest.raises(ValueError, match="add_rms_norm_quant_linear"):
        op(out, res_out, residual, llaisys.empty([2, 128]), norm, EPS, w)
    with pytest.raises(ValueError, match="add_rms_norm_quant_linear: residual must be"):
        op(out, res_out, llaisys.empty([256]), delta, norm, EPS, w)
