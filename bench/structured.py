"""Structured output's costs (issue 31): schema compile time (cold and cached), the llguidance tokenizer's
build, the host's mask time (per masked token and per step), and decode speed of JSON-schema-constrained
requests against unconstrained ones of the same length, at batch 1 and a larger batch, with overlapped
steps on and/or off. With overlap on, a constrained step's masks are computed while the device runs its
forward (ModelRunner.sample_deferred); "hidden" is the share of the host's mask time that did not add to
the wall time: 1 - max(0, constrained - unconstrained) / mask time (0 on the CPU, which runs every call
synchronously). With overlap on it prints the host's path per overlapped step (EngineCore.timing), for the
constrained run and its free twin: from a step's tokens on the host to the next step's masked sampling
enqueued (accounting, the matchers' consumes, the loop's delivery while the masks are written on a worker
thread, the wait for them, the sampling's launch: on a GPU the device idles where this exceeds the forward;
on the CPU the call also runs the sampling), to step()'s return, the time outside EngineCore.step (the
loop's delivery) before the step after is launched, and how long the step loop waited for the masks
("mask wait": the part of the mask time not hidden behind the loop's other work).

    LLAISYS_BUILD_DIR=build/dev PYTHONPATH=python python bench/structured.py                 # default model, CPU
    python bench/structured.py --device cuda --batch 1 64 --repeat 3 --json $OUT/structured.json      # GPU, real model
    python bench/structured.py --shape qwen2-0.5b --device cuda --batch 1 64 --overlap both   # GPU, random weights

--shape runs random bf16 weights of that shape from an HF checkpoint written once to the temp dir, with the
small byte-level tokenizer the tests train (llaisys_bench.throughput.random_checkpoint: no network, no
model file needed); the outputs are random but still obey the schema, so the masks cost what real ones do
for this schema (the vocabulary is the shape's size; the tokens are not Qwen's).

Each constrained request generates until its JSON object is complete (or --max-new); its unconstrained twin
(same prompt, greedy, EOS ignored) generates exactly as many tokens, so the two decode the same number of
steps. The runs alternate (constrained, unconstrained, ...) and the best of --repeat is kept for each.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from llaisys_bench.throughput import open_engine  # this folder is sys.path[0] when run as a script

# A realistic API object: nested objects, an enum, bounded numbers, an array with bounds, optional fields.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags", "active"],
}
PROMPT = "Write one user record for our admin panel as JSON:\n"


def run(eng, batch: int, constrained: bool, max_new: int, lengths=None) -> tuple[list, float, dict]:
    """(outputs, wall seconds, the engine's counters over the run)."""
    core = eng._core
    host = ("overlapped", "to_return_s", "betweens", "between_s", "deferred", "to_sample_s", "consume_s")
    r = core.runner
    before = (r.mask_wait_s, r.mask_s, r.mask_rows, core.timing["steps"], r.deferred_steps,
              *(core.timing[k] for k in host))
    prompts = [PROMPT + f"(record {i})" for i in range(batch)]
    # repetition_penalty 1: the default model's generation_config asks 1.1, and a penalised row is never
    # overlapped (its penalty ids change every step), which would hide what this measures
    kw = dict(temperature=0, repetition_penalty=1.0)
    if constrained:
        kw.update(json_schema=SCHEMA, max_new_tokens=max_new)
    else:
        kw.update(max_new_tokens=lengths, ignore_eos=True)
    t = time.perf_counter()
    out = eng.generate(prompts, **kw)
    wall = time.perf_counter() - t
    after = (r.mask_wait_s, r.mask_s, r.mask_rows, core.timing["steps"], r.deferred_steps,
             *(core.timing[k] for k in host))
    wait_s, mask_s, rows, steps, deferred, n, to_return, n_between, between, n_def, to_sample, consume = (
        a - b for a, b in zip(after, before))
    return out, wall, dict(mask_s=mask_s, rows=rows, steps=steps, deferred=deferred,
                           mask_wait_ms=wait_s / max(n_def, 1) * 1e3,
                           to_return_ms=to_return / max(n, 1) * 1e3, between_ms=between / max(n_between, 1) * 1e3,
                           to_sample_ms=to_sample / max(n_def, 1) * 1e3, consume_ms=consume / max(steps, 1) * 1e3)


def valid_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


def measure(eng, batch: int, repeat: int, max_new: int) -> dict:
    best = {}
    for _ in range(repeat):
        out, wall_c, c = run(eng, batch, True, max_new)
        lengths = [len(r.token_ids) for r in out]
        _, wall_u, u = run(eng, batch, False, max_new, lengths)
        if wall_u < best.get("unconstrained_s", float("inf")):  # the free twin's host path, as it ran best
            best.update(free_to_return_ms=u["to_return_ms"], free_between_ms=u["between_ms"])
        if wall_c < best.get("constrained_s", float("inf")):
            best.update(constrained_s=wall_c, tokens=sum(lengths), steps=c["steps"],
                        complete=sum(r.finish_reason == "stop" and valid_json(r.text) for r in out),
                        mask_ms_per_token=c["mask_s"] / max(c["rows"], 1) * 1e3,
                        mask_ms_per_step=c["mask_s"] / max(c["steps"], 1) * 1e3, mask_s=c["mask_s"],
                        overlapped_share=c["deferred"] / max(c["steps"], 1),
                        **{k: c[k] for k in ("to_return_ms", "to_sample_ms", "between_ms", "consume_ms",
                                             "mask_wait_ms")})
        best["unconstrained_s"] = min(best.get("unconstrained_s", float("inf")), wall_u)
    best["ratio"] = best["constrained_s"] / best["unconstrained_s"]
    extra = max(0.0, best["constrained_s"] - best["unconstrained_s"])
    best["hidden"] = min(1.0, max(0.0, 1 - extra / best["mask_s"])) if best["mask_s"] > 0 else 0.0
    return best


def profile(eng, batch: int, max_new: int, top: int, name: str) -> None:
    """cProfile of the step loop thread: a constrained run, then its free twin (the profiler slows Python
    calls: shares, not times)."""
    from llaisys_bench import loop_profile
    got = {}
    times = loop_profile.own_times(eng, lambda: got.update(out=run(eng, batch, True, max_new)))
    out, _, c = got["out"]
    loop_profile.report(f"overlap {name} batch {batch} constrained", times, max(c["steps"], 1), top, out=sys.stdout)
    lengths = [len(r.token_ids) for r in out]
    times = loop_profile.own_times(eng, lambda: got.update(out=run(eng, batch, False, max_new, lengths)))
    loop_profile.report(f"overlap {name} batch {batch} free", times, max(got["out"][2]["steps"], 1), top,
                        out=sys.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model (default: the catalog's default, unless --shape)")
    ap.add_argument("--shape", default=None, help="random weights of this shape (e.g. qwen2-0.5b) instead")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--overlap", choices=("default", "on", "off", "both"), default="default",
                    help="overlapped steps (default: the device's default, on for CUDA)")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="then a cProfile of the step loop over one constrained run of the largest batch and one "
                         "free run of its lengths: the top N functions by own time per step, each")
    args = ap.parse_args()

    from llaisys import catalog, constraints

    res = {}
    constraints._compiled.cache_clear()
    t = time.perf_counter()
    constraints.compile_constraint(json_schema=SCHEMA)
    res["compile_cold_ms"] = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    constraints.compile_constraint(json_schema=SCHEMA)
    res["compile_cached_ms"] = (time.perf_counter() - t) * 1e3

    modes = {"default": [None], "on": [True], "off": [False], "both": [False, True]}[args.overlap]
    model = None if args.shape else (args.model or catalog.DEFAULT_MODEL)
    for overlap in modes:
        eng, _, label, dtype = open_engine(args.shape, model, None, args.device, args.dtype,
                                           max_num_seqs=max(256, max(args.batch)), checkpoint=bool(args.shape),
                                           overlap_steps=overlap)
        t = time.perf_counter()
        eng._admit.ll_tokenizer()
        res["ll_tokenizer_s"] = time.perf_counter() - t
        eng.generate(PROMPT, max_new_tokens=8, temperature=0)  # warm-up (graphs, allocator)
        eng.generate(PROMPT, max_new_tokens=8, temperature=0, json_schema=SCHEMA)
        name = {None: "default", True: "on", False: "off"}[overlap]
        for batch in args.batch:
            best = measure(eng, batch, args.repeat, args.max_new)
            res[f"overlap_{name}_batch_{batch}"] = best
            print(f"{label} {dtype} {args.device} overlap {name} batch {batch:3d}: {best['tokens']} tokens "
                  f"({best['complete']}/{batch} complete JSON), constrained {best['constrained_s']:.3f} s vs "
                  f"unconstrained {best['unconstrained_s']:.3f} s (x{best['ratio']:.3f}); mask "
                  f"{best['mask_ms_per_token']:.3f} ms a token, {best['mask_ms_per_step']:.3f} ms a step, "
                  f"{best['overlapped_share']:.0%} of steps overlapped, hidden {best['hidden']:.0%}; consumes "
                  f"{best['consume_ms']:.3f} ms a step" + (f"; host per overlapped step, constrained vs free: "
                  f"tokens -> masked sampling {best['to_sample_ms']:.3f} ms (mask wait "
                  f"{best['mask_wait_ms']:.3f} ms), tokens -> step() returns "
                  f"{best['to_return_ms']:.3f} vs {best['free_to_return_ms']:.3f} ms, outside step() "
                  f"{best['between_ms']:.3f} vs {best['free_between_ms']:.3f} ms"
                  if best["overlapped_share"] else ""), flush=True)
        if args.profile:
            profile(eng, max(args.batch), args.max_new, args.profile, name)
        eng.close()
    print(f"schema compile: {res['compile_cold_ms']:.1f} ms cold, {res['compile_cached_ms']:.3f} ms cached; "
          f"llguidance tokenizer {res['ll_tokenizer_s']:.2f} s (once per engine)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
