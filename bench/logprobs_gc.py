"""The collector's cost in a step loop that makes many containers (session 31): B rows decoding with logprobs=5
against greedy, with the heap frozen at start-up (engine_args.freeze_heap, the default) and without
(LLAISYS_GC_FREEZE=0), alternated in child processes. A tiny random Qwen2 (one layer of width 32) on the CPU,
overlapped steps, so the time is the host's: (least of 3 runs of 1 + S tokens - least of 3 of 1 token) / S.

The 16-token prompts are prefilled in each run within a budget of 256 tokens a step, so the rows are admitted over
many steps and decode beside the later ones' prefill: most of the S steps are the general path's, not the
persistent batch's. --warm: 40-token prompts already in the prefix cache and a budget of 16 tokens a row, so each
run prefills one partial block a row in one step and its S steps are all of B rows in the batch (the CPU proxy
of bench/steady_decode.py's 256 x 600). --read: also logprobs=5 with every result's entries read in the timed
run (the caller's thread builds them when first read: engine/logprobs_log.py), the cost a reader of them pays.
--eager (with --read): also the same with ModelRunner.busy forced True, so the step loop builds every logged
step's entries before reading each step's tokens (EngineCore._build_ahead; on the CPU the runner is never busy,
so nothing is built ahead otherwise): a CPU A/B of where the building goes, loop or reader. On the CPU that time
is the loop's own (no device wait hides it): the gain needs a GPU, where the loop builds only while it would
wait anyway.
--profile N: the N functions of the step loop with the most own time a step (cProfile, one more run of each
length: llaisys_bench.loop_profile), printed after the table.

    python bench/logprobs_gc.py --batch 256 --steps 64 --rounds 2 [--warm] [--read [--eager]] [--profile 12]
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(batch: int, steps: int, warm: bool = False, profile: int = 0, read: bool = False,
          eager: bool = False) -> None:
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    import numpy as np
    from tiny_model import make_tiny_qwen2

    from llaisys.engine import Engine

    path = make_tiny_qwen2(tempfile.mkdtemp(), seed=1, max_position_embeddings=1024, hidden_size=32,
                           intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    rng = np.random.default_rng(0)
    context, budget = (40, dict(max_num_batched_tokens=max(16 * batch, 256))) if warm else (16, {})
    with Engine(path, device="cpu", dtype="f32", progress=False, max_seq_len=steps + 64, num_kv_blocks=8192,
                max_num_seqs=batch, overlap_steps=True, **budget) as eng:
        prompts = [rng.integers(0, 400, context).tolist() for _ in range(batch)]

        from llaisys.engine.model_runner import ModelRunner

        busy_property = ModelRunner.busy

        def run(n, read=False, busy=False, **kw):
            ModelRunner.busy = True if busy else busy_property  # (a property: set on the class, not the runner)
            t = time.perf_counter()
            try:
                out = eng.generate(prompts, max_new_tokens=n, ignore_eos=True, temperature=0, **kw)
                if read:
                    assert sum(len(r.logprobs) for r in out) == n * batch
                return time.perf_counter() - t
            finally:
                ModelRunner.busy = busy_property

        modes = [("greedy", {}), ("logprobs5", {"logprobs": 5})]
        modes += [("logprobs5read", {"logprobs": 5, "read": True})] * read
        modes += [("logprobs5eager", {"logprobs": 5, "read": True, "busy": True})] * (read and eager)
        for name, kw in modes:
            run(8, **kw)
            long_s, short_s = min(run(1 + steps, **kw) for _ in range(3)), min(run(1, **kw) for _ in range(3))
            print(f"{name} {(long_s - short_s) / steps * 1e3:.3f}", flush=True)
            if profile:
                from llaisys_bench import loop_profile  # bench/ is sys.path[0]

                d_long = loop_profile.own_times(eng, lambda: run(1 + steps, **kw))
                d_short = loop_profile.own_times(eng, lambda: run(1, **kw))
                heap = "not frozen" if os.environ.get("LLAISYS_GC_FREEZE") == "0" else "frozen"
                loop_profile.report(f"{name}, heap {heap}", d_long, steps, profile, minus=d_short, out=sys.stdout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warm", action="store_true", help="prompts in the prefix cache: every step in the batch")
    ap.add_argument("--read", action="store_true", help="also logprobs=5 with every result's entries read")
    ap.add_argument("--eager", action="store_true",
                    help="with --read: also with the entries built on the step loop (ModelRunner.busy forced True)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="the loop's N costliest functions a step")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.batch < 1 or args.steps < 1 or args.rounds < 1 or args.profile < 0:
        ap.error("--batch, --steps and --rounds must be >= 1, --profile >= 0")
    if args.child:
        child(args.batch, args.steps, args.warm, args.profile, args.read, args.eager)
        return 0
    if args.eager and not args.read:
        ap.error("--eager needs --read")
    print("| round | heap | greedy ms/step | logprobs=5 ms/step |" + " logprobs=5, read ms/step |" * args.read
          + " logprobs=5, built on the loop, read ms/step |" * args.eager
          + "\n|---:|---|---:|---:|" + "---:|" * (args.read + args.eager))
    profiles = []
    for r in range(args.rounds):
        for freeze in ("0", "1"):
            out = subprocess.run([sys.executable, __file__, "--child", "--batch", str(args.batch), "--steps",
                                  str(args.steps), "--profile", str(args.profile)] + ["--warm"] * args.warm
                                 + ["--read"] * args.read + ["--eager"] * args.eager,
                                 env={**os.environ, "LLAISYS_GC_FREEZE": freeze},
                                 capture_output=True, text=True, check=True).stdout
            lines = [line for line in out.splitlines() if line.strip()]
            names = ("greedy", "logprobs5", "logprobs5read", "logprobs5eager")
            ms = dict(line.split() for line in lines if line.split()[0] in names)
            profiles += [line for line in lines if line.split()[0] not in names]
            print(f"| {r + 1} | {'frozen' if freeze == '1' else 'not frozen'} | {ms['greedy']} | {ms['logprobs5']} |"
                  + (f" {ms['logprobs5read']} |" if args.read else "")
                  + (f" {ms['logprobs5eager']} |" if args.eager else ""), flush=True)
    print("\n".join(profiles))
    return 0


if __name__ == "__main__":
    sys.exit(main())
