"""Decode tok/s of one request with a model's own sampling defaults (its generation_config: top_k, top_p,
temperature, penalties), where the sampler's cost shows next to the forward's: the CPU, a small model.

    python bench/sampled_decode.py [MODEL] [--device cpu] [--new-tokens 96]

Time of 1 + N new tokens minus the time of 1, best of 3 (seeds 0-2); EOS ignored."""
import argparse
import time

from llaisys import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--new-tokens", type=int, default=96)
    args = ap.parse_args()
    eng = Engine(args.model, device=args.device)
    prompt = "Write a long story about a lighthouse keeper who finds a map."
    eng.generate(prompt, max_new_tokens=8, ignore_eos=True, seed=1)  # warm-up
    best = 0.0
    for seed in range(3):
        t0 = time.perf_counter()
        eng.generate(prompt, max_new_tokens=1, ignore_eos=True, seed=seed)
        t1 = time.perf_counter()
        eng.generate(prompt, max_new_tokens=1 + args.new_tokens, ignore_eos=True, seed=seed)
        t2 = time.perf_counter()
        best = max(best, args.new_tokens / ((t2 - t1) - (t1 - t0)))
    print(f"{args.model} on {args.device}: decode {best:.1f} tok/s (best of 3, sampled with the model's defaults)")


if __name__ == "__main__":
    main()
