"""Host cost of a decode step as the batch grows (issue 33): a tiny random Qwen2 (vocab 512, one layer of
width 32) whose kernels cost next to nothing, so a step's wall time is the engine's own work: scheduling,
the step's arrays, accounting, EOS/length checks, detokenizing, stop strings and chunk delivery.

For each batch B, B requests of --prompt token ids decode 1 token, then 1 + --new tokens, through
Engine.generate (greedy, EOS ignored); the step time is (t(1+new) - t(1)) / new, and the cost of one more
sequence per step is the slope between the smallest and the largest batch. The engine's own split of a
step (EngineCore.timing: schedule / run / postprocess, the rest being the loop's delivery) is printed too.

With --logprobs K every batch is timed twice, without logprobs and with logprobs=K on every request (both
the best of --repeat, interleaved), and the ratio printed (issue 33's target: <= 1.10 for K = 5).

    LLAISYS_BUILD_DIR=build/dev PYTHONPATH=python python bench/host_cost.py            # 1, 64, 256
    python bench/host_cost.py --device cuda   # the GPU host (issue 33: <= 2 us per sequence per step)
    python bench/host_cost.py --batches 1 256 --new 64 --repeat 3 --json /tmp/h.json
    python bench/host_cost.py --batches 64 256 --logprobs 5 --repeat 5
    python bench/host_cost.py --batches 64 256 --prompt 256 --repetition-penalty 1.1   # the model's default

With --cpu the same split is also taken in CPU time of the step loop's thread (time.pthread_getcpuclockid),
which does not count the time a busy machine keeps it waiting for a core: run it with LLAISYS_NUM_THREADS=1
so the C++ step's work is on that thread too (cpu_kernels: the Runner's calls; cpu_host: the rest).
On a shared 2-core box, compare two trees by this rather than by wall time.

    LLAISYS_NUM_THREADS=1 python bench/host_cost.py --batches 1 256 --repeat 3 --cpu

With --stream every request is submitted as the server submits a streamed one (Engine.submit with a ChunkSink,
incremental): each token is detokenized and delivered as a chunk, the per-token work that generate() skips.

    python bench/host_cost.py --batches 1 256 --stream --cpu

With --protocol, nano-vllm's protocol as bench/throughput.py runs it, on the tiny model: --requests requests at
once (default 256), prompt and output lengths uniform in --lengths (default 100 1024), temperature 0.6, a seed
each, EOS ignored, CUDA's step budget (4096 tokens, chunks of 2048) and chained steps; it prints
EngineCore.host_seconds() per sequence per step (issue 33's number) with its parts, and the loop thread's CPU time
less the runner's. --null-runner replaces the C++ runner by one that computes nothing (its tokens come from a
counter), so the host's work runs with warm caches, as on a GPU host, and the spread is small; --sweep-mb MB then
writes that much memory in each of its calls (the caches a forward would have evicted).

    LLAISYS_NUM_THREADS=1 python bench/host_cost.py --protocol --null-runner
    LLAISYS_NUM_THREADS=1 python bench/host_cost.py --protocol              # the tiny model's own forward

With --arrivals, requests arrive during decode instead (overlap_steps on, as on CUDA; on the CPU nothing
overlaps in time, but the same steps are chained): a queue (--queue requests at once, --batch of them
running, the others waiting while full steps decode) and arrivals (--requests requests, one
every --interval-ms whatever the engine does: mostly with room to be admitted at once). It
prints the share of steps launched chained behind the step ahead (stats overlapped_steps / steps).

    python bench/host_cost.py --arrivals --queue 256 --requests 128 --batch 32 --lengths 100 400
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TINY = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0,
            tie_word_embeddings=True)


def tiny_loaded():
    """The shape above with random weights and a word-level tokenizer in which every id is a word "w<id>"
    (so detokenizing costs what it costs for real text)."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    from llaisys.tokenizer import Tokenizer
    from llaisys_bench import shapes

    loaded = shapes.random_loaded(TINY, "f32", name="tiny-host")
    vocab = {f"w{i}": i for i in range(TINY["vocab_size"])}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="w0"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    loaded.tokenizer = Tokenizer(hf)
    return loaded


KEYS = ("schedule_s", "prepare_s", "run_s", "postprocess_s")


class _CpuRunner:
    """The C++ Runner with its step/launch/finish timed in CPU time of the calling thread (--cpu)."""

    def __init__(self, inner):
        self._inner, self.cpu_s = inner, 0.0

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in ("step", "launch", "finish", "sample_deferred"):
            return attr

        def timed(*args, **kw):
            t = time.thread_time()
            try:
                return attr(*args, **kw)
            finally:
                self.cpu_s += time.thread_time() - t
        return timed


def _clock(eng) -> dict:
    d = dict(eng._core.timing, prepare_s=eng._core.runner.prepare_s, wall_s=time.perf_counter())
    runner = eng._core.runner.runner
    if isinstance(runner, _CpuRunner):  # --cpu: the step loop thread's CPU clock, and the C++ calls' share
        d["cpu_s"] = time.clock_gettime(time.pthread_getcpuclockid(eng._loop._thread.ident))
        d["cpu_kernels_s"] = runner.cpu_s
    return d


PENALTY = 1.0  # --repetition-penalty of every request (the default model's generation_config.json: 1.1)
STREAM = False  # --stream


class _CountingSink:
    """A ChunkSink (engine/request.py) that keeps each request's token ids, as a server's would its chunks."""

    def __init__(self):
        self.ids: dict = {}

    def put(self, req, item) -> None:
        if isinstance(item, BaseException):
            raise item
        self.ids.setdefault(id(req), []).extend(item.token_ids)

    def flush(self) -> None:
        pass


def _generate(eng, prompts, new: int, logprobs):
    """The token ids of each prompt's 1 + new tokens: generate(), or with --stream submit() to a sink."""
    kw = dict(max_new_tokens=1 + new, temperature=0, ignore_eos=True, logprobs=logprobs, repetition_penalty=PENALTY)
    if not STREAM:
        return [r.token_ids for r in eng.generate(prompts, **kw)]
    sink = _CountingSink()
    reqs = [eng.submit(p, sink=sink, **kw) for p in prompts]
    for r in reqs:
        r._ended.wait()
    return [sink.ids[id(r)] for r in reqs]


def _run(eng, prompts, new: int, logprobs: int | None = None) -> dict:
    """What generating 1 + new tokens for every prompt cost, per component (seconds)."""
    t0 = _clock(eng)
    out = _generate(eng, prompts, new, logprobs)
    t1 = _clock(eng)
    assert all(len(ids) == 1 + new for ids in out), "a request ended early"
    return {k: t1[k] - t0[k] for k in t1 if k in (*KEYS, "wall_s", "cpu_s", "cpu_kernels_s")}


def step_ms(eng, batch: int, prompt: int, new: int, repeat: int, variants=(None,)) -> list[dict]:
    """Per decode step (ms), for each logprobs setting in `variants`: the difference between generating
    1 + new and 1 tokens, over new; the best of `repeat` by wall time (the variants interleaved, so a
    noisy machine hits them alike). kernels: the C++ step (model, sampling, the one sync) = run - prepare."""
    prompts = [[(7 * b + i) % 500 + 1 for i in range(prompt)] for b in range(batch)]
    best, cpu = [None] * len(variants), [None] * len(variants)
    for _ in range(repeat):
        for j, lp in enumerate(variants):
            one, many = _run(eng, prompts, 0, lp), _run(eng, prompts, new, lp)
            d = {k: (many[k] - one[k]) / new * 1e3 for k in many}
            if best[j] is None or d["wall_s"] < best[j]["wall_s"]:
                best[j] = d
            if "cpu_s" in d and (cpu[j] is None or d["cpu_s"] < cpu[j]["cpu_s"]):
                cpu[j] = d  # the CPU split: of the run with the least CPU time (chosen apart from the wall's)
    for d, c in zip(best, cpu):
        if c is not None:
            d.update(cpu_s=c["cpu_s"], cpu_kernels_s=c["cpu_kernels_s"])
        d["kernels_s"] = d["run_s"] - d["prepare_s"]
        d["host_s"] = d["wall_s"] - d["kernels_s"]
        if "cpu_s" in d:
            d["cpu_host_s"] = d["cpu_s"] - d["cpu_kernels_s"]
    return best


class _NullRunner:
    """--null-runner: the Runner's step/launch/finish computing nothing (tokens from a counter, never an EOS of
    the tiny tokenizer, whose ids are all words); everything else is the real runner's."""

    def __init__(self, inner, sweep_mb: float = 0.0):
        import numpy as np

        self._inner, self._launched, self._k = inner, [], 0
        self._sweep = np.zeros(int(sweep_mb * (1 << 20)) // 8, np.int64) if sweep_mb else None

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _tokens(self, n: int) -> list[int]:
        if self._sweep is not None:
            self._sweep += 1
        self._k += 1
        return [(self._k * 31 + 17 * i) % 499 + 1 for i in range(n)]

    def step(self, ids, pos, slots, q_start, *args, **kw):
        return self._tokens(len(q_start) - 1)

    def launch(self, ids, pos, slots, q_start, *args, **kw):
        self._launched.append(len(q_start) - 1)

    def finish(self):
        return self._tokens(self._launched.pop(0))

    @property
    def launched(self) -> int:
        return len(self._launched)


def protocol(args) -> dict:
    """The --protocol run (see the docstring): host us per sequence per step, and the parts."""
    import random

    import llaisys

    lo, hi = args.lengths if args.lengths != [16, 64] else (100, 1024)
    n = args.requests if args.requests != 128 else 256
    eng = llaisys.Engine.from_loaded(tiny_loaded(), device=args.device, dtype="f32", max_seq_len=2 * hi + 16,
                                     max_num_seqs=256, overlap_steps=True, progress=False,
                                     max_num_batched_tokens=4096, max_prefill_chunk=2048)
    core = eng._core
    if args.null_runner:
        core.runner.runner = _NullRunner(core.runner.runner, args.sweep_mb)
    core.runner.runner = _CpuRunner(core.runner.runner)
    eng.generate([[1, 2, 3]] * 4, max_new_tokens=4, temperature=0.6, ignore_eos=True)  # warm-up
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    outs = [rng.randint(lo, hi) for _ in range(n)]
    parts = ("schedule_s", "prepare_s", "postprocess_s", "overlapped_postprocess_s", "to_return_s", "between_s")
    c0, h0 = _clock(eng), core.host_seconds()
    eng.generate(prompts, max_new_tokens=outs, temperature=0.6, ignore_eos=True, seed=list(range(n)))
    c1, h1 = _clock(eng), core.host_seconds()
    rows, steps = c1["rows"] - c0["rows"], c1["steps"] - c0["steps"]
    r = dict(steps=steps, rows=rows, host_us=1e6 * (h1 - h0) / rows,
             cpu_host_us=1e6 * ((c1["cpu_s"] - c0["cpu_s"]) - (c1["cpu_kernels_s"] - c0["cpu_kernels_s"])) / rows,
             **{k.replace("_s", "_us"): 1e6 * (c1[k] - c0[k]) / rows for k in parts})
    print(f"protocol ({n} requests, lengths [{lo}, {hi}], {'null runner' if args.null_runner else 'tiny model'}"
          f"{f', {args.sweep_mb:g} MB swept a call' if args.sweep_mb else ''}): {steps} steps, {rows} rows; host "
          f"{r['host_us']:.3f} us per sequence per step (schedule {r['schedule_us']:.3f}, "
          f"arrays {r['prepare_us']:.3f}, accounting {r['postprocess_us'] - r['overlapped_postprocess_us']:.3f} + overlapped steps' tokens -> return "
          f"{r['to_return_us']:.3f}, between steps {r['between_us']:.3f}); loop thread CPU less the runner's "
          f"{r['cpu_host_us']:.3f} us", flush=True)
    eng.close()
    return r


def arrivals(args) -> list[dict]:
    """The --arrivals runs (see the docstring): steps, chained steps and their share, output tokens."""
    import random

    import llaisys

    rows = []
    for mode in ("queue", "arrivals"):
        eng = llaisys.Engine.from_loaded(tiny_loaded(), device=args.device, dtype="f32", max_seq_len=1024,
                                         max_num_seqs=args.batch, overlap_steps=True, progress=False)
        rng = random.Random(0)
        t0, steps0 = time.perf_counter(), eng._core.timing["steps"]
        if mode == "queue":
            jobs = [([rng.randrange(1, 500) for _ in range(args.prompt)], rng.randint(*args.lengths))
                    for _ in range(args.queue)]
            out = eng.generate([p for p, _ in jobs], max_new_tokens=[n for _, n in jobs], temperature=0.6,
                               seed=list(range(len(jobs))), ignore_eos=True)
            tokens = sum(len(r.token_ids) for r in out)
        else:  # open loop: one request every --interval-ms, whatever the engine does
            reqs = []
            for i in range(args.requests):
                p = [rng.randrange(1, 500) for _ in range(args.prompt)]
                reqs.append(eng.submit(p, max_new_tokens=rng.randint(*args.lengths), temperature=0.6, seed=i,
                                       ignore_eos=True))
                time.sleep(args.interval_ms / 1e3)
            tokens = sum(len(r.result().token_ids) for r in reqs)
        wall = time.perf_counter() - t0
        steps = eng._core.timing["steps"] - steps0
        chained = eng.stats()["overlapped_steps"]
        rows.append(dict(mode=mode, steps=steps, overlapped_steps=chained, share=round(chained / steps, 4),
                         tokens=tokens, wall_s=round(wall, 3)))
        print(f"{mode:8s}: {steps} steps, {chained} chained ({chained / steps:.1%}), {tokens} tokens in {wall:.2f} s",
              flush=True)
        eng.close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--logprobs", type=int, metavar="K", help="also time logprobs=K on every request")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--cpu", action="store_true", help="also the step loop thread's CPU time (see above)")
    ap.add_argument("--stream", action="store_true", help="requests streamed to a sink, as the server's (see above)")
    ap.add_argument("--device", default="cpu", help="cuda: the GPU machine's host (the tiny model's kernels "
                    "cost microseconds, so a step is the host's work; overlapped steps as the engine runs them)")
    ap.add_argument("--repetition-penalty", type=float, default=1.0, metavar="P",
                    help="on every request (the default model's generation config has 1.1)")
    ap.add_argument("--arrivals", action="store_true", help="requests arriving during decode (see above)")
    ap.add_argument("--protocol", action="store_true", help="nano-vllm's protocol on the tiny model (see above)")
    ap.add_argument("--null-runner", action="store_true", help="with --protocol: a runner that computes nothing")
    ap.add_argument("--sweep-mb", type=float, default=0.0, help="with --null-runner: memory written a call")
    ap.add_argument("--queue", type=int, default=256)
    ap.add_argument("--requests", type=int, default=128, help="--arrivals' (default 128) or --protocol's (256)")
    ap.add_argument("--interval-ms", type=float, default=5.0, help="between two --arrivals submissions")
    ap.add_argument("--batch", type=int, default=32, help="max_num_seqs of the --arrivals runs")
    ap.add_argument("--lengths", type=int, nargs=2, default=[16, 64], metavar=("LO", "HI"),
                    help="new tokens of each --arrivals request, uniform in [LO, HI] (--protocol: prompt and output "
                         "lengths, default 100 1024)")
    args = ap.parse_args()
    global PENALTY, STREAM
    PENALTY, STREAM = args.repetition_penalty, args.stream
    if args.protocol or args.arrivals:
        r = protocol(args) if args.protocol else arrivals(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(r, f, indent=2)
        return 0
    import llaisys

    eng = llaisys.Engine.from_loaded(tiny_loaded(), device=args.device, dtype="f32", max_seq_len=1024,
                                     max_num_seqs=max(args.batches), progress=False,
                                     # every prompt in one step: t(1) is one prefill step, the rest decodes
                                     max_num_batched_tokens=max(args.batches) * args.prompt,
                                     max_prefill_chunk=args.prompt)
    if args.cpu:
        eng._core.runner.runner = _CpuRunner(eng._core.runner.runner)
    eng.generate([[1, 2, 3]] * 4, max_new_tokens=4, temperature=0, ignore_eos=True)  # warm-up
    rows = []
    for b in args.batches:
        variants = (None,) if args.logprobs is None else (None, args.logprobs)
        d, *with_lp = step_ms(eng, b, args.prompt, args.new, args.repeat, variants)
        rows.append(dict(batch=b, **{k.replace("_s", "_ms"): round(v, 4) for k, v in d.items()}))
        print(f"batch {b:4d}: {d['wall_s']:7.3f} ms a step = C++ step {d['kernels_s']:.3f} + host {d['host_s']:.3f} "
              f"(schedule {d['schedule_s']:.3f}, arrays {d['prepare_s']:.3f}, postprocess {d['postprocess_s']:.3f}, "
              f"delivery and the rest {d['host_s'] - d['schedule_s'] - d['prepare_s'] - d['postprocess_s']:.3f})",
              flush=True)
        if args.cpu:
            print(f"batch {b:4d}: step loop thread CPU {d['cpu_s']:7.3f} ms a step = C++ step {d['cpu_kernels_s']:.3f} "
                  f"+ host {d['cpu_host_s']:.3f}", flush=True)
        if with_lp:
            lp = with_lp[0]
            rows[-1].update(logprobs=args.logprobs, logprobs_wall_ms=round(lp["wall_s"], 4),
                            logprobs_ratio=round(lp["wall_s"] / d["wall_s"], 4))
            print(f"batch {b:4d}: logprobs={args.logprobs} on every request {lp['wall_s']:7.3f} ms a step vs "
                  f"{d['wall_s']:.3f} without: x{lp['wall_s'] / d['wall_s']:.3f} (postprocess "
                  f"{lp['postprocess_s']:.3f} vs {d['postprocess_s']:.3f})", flush=True)
    lo, hi = rows[0], rows[-1]
    if hi["batch"] > lo["batch"]:
        keys = ("wall_ms", "host_ms", "kernels_ms") + (("cpu_ms", "cpu_host_ms", "cpu_kernels_ms") if args.cpu else ())
        per = {k: (hi[k] - lo[k]) / (hi["batch"] - lo["batch"]) * 1e3 for k in keys}
        print(f"per extra sequence per step (batch {lo['batch']} -> {hi['batch']}): {per['wall_ms']:.2f} us wall = "
              f"{per['kernels_ms']:.2f} us in the C++ step + {per['host_ms']:.2f} us of host work")
        if args.cpu:
            print(f"per extra sequence per step, CPU: {per['cpu_ms']:.2f} us = {per['cpu_kernels_ms']:.2f} us in the "
                  f"C++ step + {per['cpu_host_ms']:.2f} us of host work")
        rows.append({f"per_extra_seq_{k.replace('_ms', '_us')}": round(v, 3) for k, v in per.items()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
