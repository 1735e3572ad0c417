"""Structured output's costs (issue 31): schema compile time (cold and cached), the llguidance tokenizer's
build, the mask per token (llguidance's compute_mask into the step's bitmask row), and decode speed of
JSON-schema-constrained requests against unconstrained ones of the same length, at batch 1 and a larger batch.

    LLAISYS_BUILD_DIR=build/dev PYTHONPATH=python python bench/structured.py                 # default model, CPU
    python bench/structured.py --device cuda --batch 1 64 --repeat 3 --json /tmp/s.json     # a GPU machine

Each constrained request generates until its JSON object is complete; its unconstrained twin (same prompt,
greedy, EOS ignored) generates exactly as many tokens, so the two decode the same number of steps. The runs
alternate (constrained, unconstrained, ...) and the best of --repeat is kept for each.
"""
from __future__ import annotations

import argparse
import json
import time

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


def timed_masks(constraints_mod):
    """Wraps Constraint.mask_into to count calls and seconds; returns the counter dict."""
    stats = {"calls": 0, "s": 0.0}
    orig = constraints_mod.Constraint.mask_into

    def mask_into(self, row):
        t = time.perf_counter()
        orig(self, row)
        stats["s"] += time.perf_counter() - t
        stats["calls"] += 1

    constraints_mod.Constraint.mask_into = mask_into
    return stats


def run(eng, batch: int, constrained: bool, lengths=None):
    prompts = [PROMPT + f"(record {i})" for i in range(batch)]
    kw = dict(temperature=0)
    if constrained:
        kw.update(json_schema=SCHEMA, max_new_tokens=160)
    else:
        kw.update(max_new_tokens=lengths, ignore_eos=True)
    t = time.perf_counter()
    out = eng.generate(prompts, **kw)
    wall = time.perf_counter() - t
    return out, wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()

    import llaisys
    from llaisys import catalog, constraints

    res = {}
    constraints._compiled.cache_clear()
    t = time.perf_counter()
    constraints.compile_constraint(json_schema=SCHEMA)
    res["compile_cold_ms"] = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    constraints.compile_constraint(json_schema=SCHEMA)
    res["compile_cached_ms"] = (time.perf_counter() - t) * 1e3

    eng = llaisys.Engine(args.model or catalog.DEFAULT_MODEL, device=args.device, progress=False)
    t = time.perf_counter()
    eng._ll_tokenizer()
    res["ll_tokenizer_s"] = time.perf_counter() - t
    masks = timed_masks(constraints)
    eng.generate(PROMPT, max_new_tokens=8, temperature=0)  # warm-up
    for batch in args.batch:
        best = {}
        for _ in range(args.repeat):
            before = dict(masks)
            out, wall_c = run(eng, batch, True)
            mask_s, calls = masks["s"] - before["s"], masks["calls"] - before["calls"]
            lengths = [len(r.token_ids) for r in out]
            for r in out:
                json.loads(r.text)  # every output is one valid JSON object
            _, wall_u = run(eng, batch, False, lengths)
            if not best or wall_c < best["constrained_s"]:
                best.update(constrained_s=wall_c, mask_ms_per_token=mask_s / max(calls, 1) * 1e3,
                            mask_ms_per_step=mask_s / max(max(lengths), 1) * 1e3, tokens=sum(lengths))
            best["unconstrained_s"] = min(best.get("unconstrained_s", float("inf")), wall_u)
        best["ratio"] = best["constrained_s"] / best["unconstrained_s"]
        res[f"batch_{batch}"] = best
        print(f"batch {batch:3d}: {best['tokens']} tokens, constrained {best['constrained_s']:.2f} s vs unconstrained "
              f"{best['unconstrained_s']:.2f} s (x{best['ratio']:.3f}); mask {best['mask_ms_per_token']:.3f} ms a "
              f"token, {best['mask_ms_per_step']:.3f} ms a step", flush=True)
    print(f"schema compile: {res['compile_cold_ms']:.1f} ms cold, {res['compile_cached_ms']:.3f} ms cached; "
          f"llguidance tokenizer {res['ll_tokenizer_s']:.2f} s (once per engine)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
