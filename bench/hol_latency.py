"""Head-of-line latency: short requests and a running stream beside one long prompt, per scheduling policy.

A stream (a short prompt, decoding all along) runs; then a long prompt arrives (--long tokens, 1 new token),
then --short short requests (--short-len prompt tokens, --short-new new tokens each), one every --gap
seconds from the long prompt's arrival. Reported per policy: the short requests' time to first token
(TTFT) and their inter-token latency (ITL), the stream's ITL while the long prompt is computed, and the
long prompt's own TTFT. EOS is ignored and the prefix cache is off, so every run does the same work; every
policy of a round gets the same prompts (greedy), and the run says whether their tokens came out the same.

Policies, as --policy NAME=TOKENS:CHUNK (TOKENS: max_num_batched_tokens, CHUNK: max_prefill_chunk; "none" as
CHUNK is the scheduler of before the cap: running prefills first, each taking all the budget the decodes
leave), or NAME=default (EngineConfig's defaults for the device). Default: before=4096:none after=default.
All policies run on one loaded model, in interleaved rounds (--rounds): the scheduler's two settings are
set between runs, so they share the machine's state.

    python bench/hol_latency.py                                   # the default model on the CPU
    python bench/hol_latency.py --model /tmp/tiny --long 3001 --gap 0.05
    python bench/hol_latency.py --shape qwen2-0.5b --device cuda --long 16000 --gap 0.005
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time

from llaisys_bench import resolve_device, shapes, throughput as bt  # this folder is sys.path[0] as a script


def parse_policy(text: str) -> tuple[str, int | None, int | None, bool]:
    """'name=TOKENS:CHUNK' | 'name=default' -> (name, tokens, chunk, capped): tokens/chunk None = default."""
    name, sep, spec = text.partition("=")
    if not sep or not name:
        raise ValueError(f"--policy takes NAME=TOKENS:CHUNK or NAME=default, got {text!r}")
    if spec == "default":
        return name, None, None, True
    tokens, sep, chunk = spec.partition(":")
    try:
        t = int(tokens)
        c = None if chunk == "none" else int(chunk)
    except ValueError:
        raise ValueError(f"--policy {text!r}: TOKENS and CHUNK are whole numbers (CHUNK may be 'none')") from None
    if not sep or t < 1 or (c is not None and c < 1):
        raise ValueError(f"--policy {text!r}: give TOKENS:CHUNK, both >= 1 (CHUNK may be 'none')")
    return name, t, c, c is not None


class Timed(threading.Thread):
    """Reads one request's chunks, stamping each token's arrival (time.perf_counter)."""

    def __init__(self, handle, submitted: float):
        super().__init__(daemon=True)
        self.handle, self.submitted, self.stamps, self.ids = handle, submitted, [], []
        self.start()

    def run(self):
        for chunk in self.handle:
            now = time.perf_counter()
            self.stamps += [now] * len(chunk.token_ids)
            self.ids += chunk.token_ids

    @property
    def ttft(self) -> float:
        return self.stamps[0] - self.submitted

    def gaps(self, since: float = float("-inf"), until: float = float("inf")) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:]) if since <= b <= until]


def one_run(eng, rng: random.Random, args) -> dict:
    vocab = eng.config.vocab_size
    ids = lambda n: [rng.randrange(100, vocab - 100) for _ in range(n)]  # noqa: E731
    kw = dict(temperature=0, ignore_eos=True)
    stream_new = eng.max_seq_len - args.stream_len - 1  # it decodes until the context is full, or is stopped
    stream = Timed(eng.submit(ids(args.stream_len), max_new_tokens=stream_new, **kw), time.perf_counter())
    while len(stream.stamps) < 2:
        time.sleep(0.001)
    t_long = time.perf_counter()
    long = Timed(eng.submit(ids(args.long), max_new_tokens=1, **kw), t_long)
    shorts = []
    for i in range(args.short):
        time.sleep(max(0.0, t_long + (i + 1) * args.gap - time.perf_counter()))
        shorts.append(Timed(eng.submit(ids(args.short_len), max_new_tokens=args.short_new, **kw), time.perf_counter()))
    for t in [long] + shorts:
        t.join()
    long_done = long.stamps[0]
    stream.handle.abort()
    stream.join()
    if len(stream.stamps) >= stream_new:
        print(f"  (the stream reached the context's end before the long prompt's first token: its gaps are "
              f"those of the first {stream_new} tokens)", flush=True)
    short_ttft = [t.ttft for t in shorts]
    short_itl = [g for t in shorts for g in t.gaps()]
    stream_itl = stream.gaps(t_long, long_done)
    return {"long_ttft_s": long.ttft, "long_prefill_tok_s": args.long / long.ttft,
            "short_ttft_s": short_ttft, "short_itl_s": short_itl, "stream_itl_s": stream_itl,
            "token_ids": [long.ids] + [t.ids for t in shorts]}


def summary(runs: list[dict]) -> dict:
    cat = lambda k: [v for r in runs for v in r[k]]  # noqa: E731
    med = lambda v: statistics.median(v) if v else float("nan")  # noqa: E731
    out = {"runs": len(runs), "long_ttft_s": med([r["long_ttft_s"] for r in runs]),
           "long_prefill_tok_s": med([r["long_prefill_tok_s"] for r in runs])}
    for k in ("short_ttft_s", "short_itl_s", "stream_itl_s"):
        v = cat(k)
        out[k] = {"median": med(v), "max": max(v) if v else float("nan"), "n": len(v)}
    return out


def fmt(name: str, tokens, chunk, s: dict) -> str:
    f = lambda d: f"{d['median']:.3f} / {d['max']:.3f}"  # noqa: E731
    return (f"{name:>8} (tokens/step {tokens}, chunk {chunk}): short TTFT med/max {f(s['short_ttft_s'])} s | "
            f"short ITL {f(s['short_itl_s'])} s | stream ITL {f(s['stream_itl_s'])} s | long TTFT "
            f"{s['long_ttft_s']:.2f} s ({s['long_prefill_tok_s']:.0f} tok/s)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="a catalog name, HF dir or .gguf (default: the catalog's default model)")
    src.add_argument("--shape", choices=sorted(shapes.SHAPES), help="random bf16 weights of a real shape")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--long", type=int, default=3001, help="the long prompt's tokens")
    ap.add_argument("--short", type=int, default=4, help="short requests")
    ap.add_argument("--short-len", type=int, default=8, help="a short request's prompt tokens")
    ap.add_argument("--short-new", type=int, default=4, help="a short request's new tokens")
    ap.add_argument("--stream-len", type=int, default=16, help="the stream's prompt tokens")
    ap.add_argument("--gap", type=float, default=2.0, help="seconds between the long prompt and each short one")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--policy", action="append", help="NAME=TOKENS:CHUNK or NAME=default (repeatable)")
    ap.add_argument("--json", metavar="FILE", help="also write the per-run numbers as JSON")
    args = ap.parse_args(argv)
    try:
        policies = [parse_policy(p) for p in (args.policy or ["before=4096:none", "after=default"])]
    except ValueError as e:
        ap.error(str(e))
    for flag in ("long", "short", "short_len", "short_new", "stream_len", "rounds"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")

    from llaisys.engine import Engine

    device = resolve_device(args.device)
    need = max(args.long, args.short_len + args.short_new) + 64
    kw = dict(device=device, max_seq_len=need if need > 8192 else None, progress=False,  # None: min(8192, model's)
              enable_prefix_caching=False)
    if args.shape:
        dtype = "bf16" if args.dtype == "auto" else args.dtype
        eng = Engine.from_loaded(shapes.random_loaded(bt.shape_config(args.shape), dtype, name=args.shape),
                                 dtype=dtype, **kw)
        label = f"{args.shape} (random {dtype})"
    else:
        import llaisys

        model = args.model or llaisys.catalog.DEFAULT_MODEL
        eng, label = Engine(model, dtype=args.dtype, **kw), model
    sched, defaults = eng._core.scheduler, eng.engine_config
    print(f"{label} on {device}: {args.long}-token prompt, {args.short} short requests ({args.short_len} + "
          f"{args.short_new} tokens) every {args.gap} s after it, beside a stream; {args.rounds} round(s)",
          flush=True)
    eng.generate([1, 2, 3], max_new_tokens=2, temperature=0)  # warm-up
    runs: dict[str, list[dict]] = {name: [] for name, *_ in policies}
    settings = {}
    for r in range(args.rounds):
        for name, tokens, chunk, capped in policies:
            t = defaults.max_num_batched_tokens if tokens is None else tokens
            c = (defaults.max_prefill_chunk if chunk is None else chunk) if capped else None
            settings[name] = (t, c)
            sched.max_tokens, sched.max_chunk = t, c
            res = one_run(eng, random.Random(r), args)  # the same prompts for every policy of a round
            runs[name].append(res)
            print(f"  round {r} " + fmt(name, t, c, summary([res])), flush=True)
    same = all(len({str(runs[name][r]["token_ids"]) for name in runs}) == 1 for r in range(args.rounds))
    print(f"the long and short requests' tokens are {'the same' if same else 'NOT the same'} under every policy")
    print("median over rounds (short and stream latencies: over all their tokens):")
    out = {}
    for name, *_ in policies:
        out[name] = {"tokens_per_step": settings[name][0], "chunk": settings[name][1], **summary(runs[name]),
                     "per_run": runs[name]}
        print(fmt(name, *settings[name], out[name]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": label, "device": device, "args": vars(args), "same_tokens": same, "policies": out}, f,
                      indent=1)
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
