"""Device time per kernel name under torch.profiler (CUPTI records every kernel of the process, including those
replayed from the Runner's CUDA graphs): what bench/decode_breakdown.py and `bench/throughput.py --kernels` print.
With PDL on (the default), CUPTI counts a kernel's wait for its predecessor as its own time: set LLAISYS_PDL=0 for
durations that add up."""
from __future__ import annotations

import time
from collections import defaultdict


def short(name: str) -> str:
    """A kernel's name without namespaces, template arguments and parameter list; a GEMV keeps its
    epilogue (Plain / Swiglu) so linear and linear_swiglu show apart."""
    name = name.replace("(anonymous namespace)::", "").replace("void ", "")
    name = name.split("(")[0]
    depth, out, targs = 0, [], []
    for ch in name:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
        else:
            targs.append(ch)
    base = "".join(out).strip().split("::")[-1] or name[:60]
    t = "".join(targs)
    for epilogue in ("PlainEpilogue", "SwigluEpilogue"):
        if epilogue in t:
            base += "/" + epilogue.replace("Epilogue", "").lower()
    if base.startswith("quant_gemv") and t.rstrip().endswith("true"):
        base += "/swiglu"
    return base


def profiled_call(device, fn):
    """(kernel name -> [launches, device µs], wall seconds, µs the GPU ran no kernel between the first kernel and
    the last) of fn() on `device` (its kernels only: under tensor parallelism the other ranks' GPUs run the
    same kernels, which CUPTI records too)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import llaisys

    index = int(str(device).partition(":")[2] or 0)
    llaisys.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fn()
        llaisys.synchronize(device)
        wall = time.perf_counter() - t0
    per = defaultdict(lambda: [0, 0.0])
    spans = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0 and \
                ev.device_index in (index, -1):
            copy = "Memcpy" in ev.name  # listed (with --regex, --logprobs), not counted as kernel time or busy
            k = ev.name.split(" (")[0] if copy else short(ev.name)
            per[k][0] += 1
            per[k][1] += ev.device_time_total
            if not copy:
                spans.append((ev.time_range.start, ev.time_range.end))
    idle, reach = 0.0, None
    for start, end in sorted(spans):  # gaps in the union of the kernels' intervals
        if reach is not None and start > reach:
            idle += start - reach
        reach = end if reach is None else max(reach, end)
    return per, wall, idle




def profiled(eng, prompts, new_tokens: int, **kw):
    """profiled_call of one generate call (greedy unless kw says otherwise)."""
    return profiled_call(eng.device, lambda: eng.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True,
                                                          **{"temperature": 0, **kw}))


def print_rows(per: dict, out=print) -> float:
    """The kernels by device time (launches, ms, share of kernel time, µs a launch); returns the kernel µs
    (copies listed, not counted)."""
    rows = sorted(((k, n, us) for k, (n, us) in per.items()), key=lambda r: -r[2])
    total = sum(r[2] for r in rows if not r[0].startswith("Memcpy"))
    out(f"{'kernel':<44}{'launches':>9}{'ms':>10}{'share':>8}{'µs/launch':>11}")
    for k, n, us in rows:
        out(f"{k[:43]:<44}{n:9d}{us / 1e3:10.2f}{100 * us / max(total, 1e-9):7.1f}%{us / max(n, 1):11.2f}")
    return total


COLLECTIVE_MARKS = ("all_reduce", "AllReduce", "AllGather", "nccl")  # the peer kernels and NCCL's


def is_collective(kernel: str) -> bool:
    """A kernel of a collective (the peer-memory all-reduces, NCCL's kernels)."""
    return any(m in kernel for m in COLLECTIVE_MARKS)
