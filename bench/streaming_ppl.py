"""StreamingLLM's perplexity experiment (Xiao et al., arXiv 2309.17453, fig. 3) at small scale: the
perplexity of a long public text under dense attention, sinks + a rolling window (Engine.score with
kv_window/sink_tokens: the cache a windowed generation uses), the window without sinks, and the paper's
upper baseline, a sliding window that recomputes each scored position from the window's tokens alone
(strided: every `stride`-th position). Every method is scored on the same positions (those the recompute
baseline scores) so the numbers compare; dense and the rolling caches are also given over every position
past the window.

    python bench/streaming_ppl.py [--model NAME] [--text FILE] [--tokens N] [--window W] [--sinks S] [--stride K]
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np

DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"


def nll(logits: np.ndarray, ids: list[int], positions) -> np.ndarray:
    """-log p(ids[t + 1] | logits[t]) for each t in positions (float64)."""
    x = logits[positions].astype(np.float64)
    m = x.max(-1, keepdims=True)
    lse = (m[:, 0] + np.log(np.exp(x - m).sum(-1)))
    return lse - x[np.arange(len(positions)), [ids[t + 1] for t in positions]]


def recompute_nll(eng, ids: list[int], window: int, positions) -> np.ndarray:
    """The sliding window with recomputation: position t sees ids[t - window + 1 .. t], fresh (dense)."""
    out = []
    for t in positions:
        ctx = ids[max(0, t - window + 1):t + 1]
        out.append(nll(eng.score(ctx, kv_window=0), ctx + [ids[t + 1]], [len(ctx) - 1])[0])
    return np.array(out)


def run(eng, ids: list[int], window: int, sinks: int, stride: int) -> dict:
    """{method: (ppl on the strided positions, ppl on every position past the window or None, seconds)}."""
    n = len(ids)
    past = list(range(window + eng.engine_config.block_size, n - 1))  # positions whose window has slid
    strided = past[::stride]
    rows = {}
    for name, kw in (("dense", dict(kv_window=0)), (f"sinks {sinks} + window {window}", dict(kv_window=window,
                     sink_tokens=sinks)), (f"window {window}, no sinks", dict(kv_window=window, sink_tokens=0))):
        t0 = time.perf_counter()
        logits = eng.score(ids, **kw)
        dt = time.perf_counter() - t0
        rows[name] = (math.exp(nll(logits, ids, strided).mean()), math.exp(nll(logits, ids, past).mean()), dt)
    t0 = time.perf_counter()
    rows[f"sliding window {window} + recompute"] = (math.exp(recompute_nll(eng, ids, window, strided).mean()), None,
                                                    time.perf_counter() - t0)
    return rows


def table(rows: dict, n_strided: int, n_past: int) -> str:
    lines = [f"| method | PPL ({n_strided} strided positions) | PPL (all {n_past} past the window) | s |",
             "|---|---|---|---|"]
    for name, (a, b, dt) in rows.items():
        lines.append(f"| {name} | {a:.3f} | {'-' if b is None else f'{b:.3f}'} | {dt:.1f} |")
    return "\n".join(lines)


def main() -> None:
    import llaisys
    from llaisys import catalog

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=catalog.DEFAULT_MODEL)
    ap.add_argument("--text", default=DEFAULT_TEXT)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--stride", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    eng = llaisys.Engine(a.model, device=a.device, progress=False, max_seq_len=max(a.tokens + 1, 2 * a.window))
    ids = eng.tokenize(open(a.text).read())[:a.tokens]
    rows = run(eng, ids, a.window, a.sinks, a.stride)
    past = len(range(a.window + eng.engine_config.block_size, len(ids) - 1))
    print(f"{a.model} on {eng.device}, {a.text}: {len(ids)} tokens, block size {eng.engine_config.block_size}")
    print(table(rows, len(range(0, past, a.stride)), past))
    eng.close()


if __name__ == "__main__":
    main()
