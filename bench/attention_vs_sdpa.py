"""llaisys.ops.self_attention vs torch.nn.functional.scaled_dot_product_attention on the same GPU.

Identical bf16 inputs (made by torch, shared with llaisys through DLPack without a copy) at Qwen2
shapes: causal prefill (qlen == kvlen, where torch's is_causal mask equals ours) and decode (qlen == 1,
no mask). Each side is timed with CUDA events on its own stream after warm-up: batches of 10 back-to-back calls
behind a GPU filler (so host launch overhead is not timed), median of --iters batches;
torch gets its preferred [1, heads, seq, dim] layout and the better of enable_gqa=True and K/V
repeat_interleave'd up front (not timed). Prints: shape, llaisys ms, torch ms, ratio (llaisys
throughput / torch's), TFLOP/s (prefill, causal half) or K/V GB/s (decode), and the max abs difference.

    python bench/attention_vs_sdpa.py [--iters 30]
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import llaisys

# (qlen, kvlen, nh, nkvh, hd)
SHAPES = [
    (2048, 2048, 14, 2, 64), (2048, 2048, 12, 2, 128),
    (512, 512, 14, 2, 64), (512, 512, 12, 2, 128),
    (1, 4096, 14, 2, 64), (1, 4096, 12, 2, 128),
]


BATCH = 10  # calls per timed sample: back-to-back, as in a forward pass


def median_ms(fn, record, iters: int, warmup: int = 3) -> float:
    """Median over iters of record(fn) / BATCH, after warm-up."""
    for _ in range(warmup):
        fn()
    return statistics.median(record(fn) / BATCH for _ in range(iters))


def torch_record(fn) -> float:
    """ms of BATCH calls on torch's stream; a GPU spin first lets the host enqueue them all ahead."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    for _ in range(BATCH):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop)


_FILLER = {}


def llaisys_record(fn) -> float:
    """ms of BATCH calls on llaisys' stream, behind a ~0.3 ms filler op for the same reason."""
    if "t" not in _FILLER:
        _FILLER["t"] = llaisys.zeros((64 << 20,), "f32", "cuda")
    filler, stream = _FILLER["t"], llaisys.current_stream("cuda")
    start, stop = llaisys.Event("cuda", timing=True), llaisys.Event("cuda", timing=True)
    llaisys.ops.add(filler, filler, filler)
    start.record(stream)
    for _ in range(BATCH):
        fn()
    stop.record(stream)
    stop.synchronize()
    return start.elapsed_ms(stop)


def torch_sdpa(q, k, v, causal: bool, gqa: bool):
    """q [1, nh, qlen, hd], k/v [1, nkvh, kvlen, hd]; with gqa=False k/v already have nh heads."""
    if gqa:
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def compare(qlen, kvlen, nh, nkvh, hd, iters):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(qlen, nh, hd, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(kvlen, nkvh, hd, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(kvlen, nkvh, hd, device="cuda", dtype=torch.bfloat16, generator=g)
    out = torch.empty(qlen, nh, hd, device="cuda", dtype=torch.bfloat16)
    lq, lk, lv, lout = (llaisys.from_dlpack(t) for t in (q, k, v, out))
    scale = hd ** -0.5
    ours_ms = median_ms(lambda: llaisys.ops.self_attention(lout, lq, lk, lv, scale), llaisys_record, iters)
    llaisys.synchronize("cuda")

    causal = qlen > 1
    tq, tk, tv = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
    group = nh // nkvh
    tk_rep, tv_rep = tk.repeat_interleave(group, dim=1), tv.repeat_interleave(group, dim=1)
    best, ref = None, None
    for gqa in (True, False):
        fn = torch_sdpa(tq, tk if gqa else tk_rep, tv if gqa else tv_rep, causal, gqa)
        try:
            ms = median_ms(fn, torch_record, iters)
        except (RuntimeError, TypeError) as e:  # an older torch without enable_gqa
            print(f"  (torch enable_gqa={gqa} unavailable: {e})")
            continue
        if best is None or ms < best[0]:
            best = (ms, "gqa" if gqa else "repeat")
        ref = fn()
    torch_ms, how = best
    err = (ref[0].transpose(0, 1).float() - out.float()).abs().max().item()

    if causal:
        work = 4.0 * qlen * kvlen / 2 * nh * hd / 1e12  # TFLOP
        rate = f"{work / (ours_ms * 1e-3):7.1f} {work / (torch_ms * 1e-3):7.1f} TFLOP/s"
    else:
        gb = 2.0 * kvlen * nkvh * hd * 2 / 1e9
        rate = f"{gb / (ours_ms * 1e-3):7.0f} {gb / (torch_ms * 1e-3):7.0f} GB/s (K/V)"
    shape = f"q{qlen} kv{kvlen} {nh}/{nkvh}x{hd}"
    print(f"{shape:<24} {ours_ms:10.4f} {torch_ms:10.4f} {torch_ms / ours_ms:6.2f}  {rate}  "
          f"max|diff| {err:.2e}  (torch: {how})")
    return torch_ms / ours_ms


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  iters {args.iters} (median)")
    print(f"{'shape':<24} {'llaisys ms':>10} {'torch ms':>10} {'ratio':>6}  {'llaisys':>7} {'torch':>7}")
    for s in SHAPES:
        compare(*s, args.iters)


if __name__ == "__main__":
    main()
