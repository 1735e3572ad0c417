"""Runs torch's own cuBLAS GEMMs (no llaisys code at all) on M > 8 shapes like those of the cases marked
`cublas` in tests/test_ops_linear.py (a hand-kept list, not derived from the tests), so that
`compute-sanitizer --tool racecheck` on this script shows which shared-memory hazards cuBLAS reports by
itself. llaisys sends such shapes to cuBLASLt too (cpp/ops/linear/cuda.cu).

    compute-sanitizer --tool racecheck --print-limit 20 python3 bench/cublas_racecheck.py
"""
import torch
import torch.nn.functional as F

# (M, K, N): M > 8 shapes from test_ops_linear.py's linear cases, and its linear_swiglu cases with N = 2I.
SHAPES = [(64, 896, 896), (9, 67, 100), (10, 111, 19), (9, 896, 896), (64, 1536, 256), (128, 8960, 128),
          (64, 1536, 512), (9, 1, 222), (64, 19, 222), (9, 1536, 222), (64, 896, 222), (12, 19, 222),
          (9, 111, 38), (9, 40, 48)]


def main():
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    calls = 0
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for M, K, N in SHAPES:
            x = torch.randn(M, K, device=dev, dtype=dtype, generator=g)
            w = torch.randn(N, K, device=dev, dtype=dtype, generator=g) / K**0.5
            b = torch.randn(N, device=dev, dtype=dtype, generator=g)
            for bias in (None, b):
                y = F.linear(x, w, bias)
                ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
                err = (y.double() - ref).abs().max().item()
                assert err < 0.5, f"{dtype} {M}x{K}x{N}: max error {err}"  # a sanity check, not a test
                calls += 1
    torch.cuda.synchronize()
    print(f"cublas_racecheck: {calls} torch.nn.functional.linear calls on {torch.cuda.get_device_name()}")


if __name__ == "__main__":
    main()
