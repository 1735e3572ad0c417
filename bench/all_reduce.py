"""The all-reduces of a tensor-parallel decode step, alone (issue 30): a decode step of a model split over N
GPUs makes two all-reduces of [batch, hidden] per layer (after o and after down), plus one all-gather of the
logits' slices (or, for greedy rows, of each slice's (max, index): issue 30 asks which costs less). This times
them on their own, eagerly, one thread per GPU as the engine drives them, so the
share of a step they take can be read beside `llaisys bench --tensor-parallel-size N` of the same shape
(inside the engine they are captured into each rank's CUDA graph, which launches them cheaper than here).

    python bench/all_reduce.py --shape qwen2-7b [--batch 1 64 256] [--world 2]

The all-reduce is timed three ways side by side, each in a group of its own: NCCL alone
(LLAISYS_PEER_ALLREDUCE=0), the peer-memory pull kernel (LLAISYS_PEER_ALLREDUCE_PUSH=0) and the push kernel
(the default); each column says which path the calls really took (a message past a kernel's limit goes on).
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llaisys_bench.shapes import SHAPES  # noqa: E402

import llaisys  # noqa: E402
from llaisys import _core  # noqa: E402


MODES = {  # the environment a group is made under: which all-reduce paths it may take
    "nccl": {"LLAISYS_PEER_ALLREDUCE": "0"},
    "pull": {"LLAISYS_PEER_ALLREDUCE": "1", "LLAISYS_PEER_ALLREDUCE_PUSH": "0"},
    "push": {"LLAISYS_PEER_ALLREDUCE": "1", "LLAISYS_PEER_ALLREDUCE_PUSH": "1"},
}


def make_group(world: int, mode: str):
    os.environ.update(MODES[mode])
    return _core.local_group("cuda", world)


def ran(comm) -> str:
    """The path(s) this rank's all-reduces took, from its counters: "push", "pull", "nccl" or a mix."""
    return "+".join(k for k, v in sorted(comm.all_reduce_paths.items()) if v) or "-"


def time_ranks(world: int, fn, iters: int, mode: str = "push") -> tuple[float, str]:
    """Seconds per iteration of fn(rank, comm, i) run on every rank at once (its own thread), after warm-up, in
    a group made under MODES[mode]; and the path(s) rank 0's all-reduces took."""
    comms = make_group(world, mode)
    spans = [0.0] * world
    barrier = threading.Barrier(world)

    def rank(r):
        dev = f"cuda:{r}"
        state = fn(r, comms[r], None)  # set up and warm up
        for i in range(10):
            fn(r, comms[r], state)
        llaisys.synchronize(dev)
        barrier.wait()
        t = time.perf_counter()
        for i in range(iters):
            fn(r, comms[r], state)
        llaisys.synchronize(dev)
        spans[r] = time.perf_counter() - t

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(spans) / iters, ran(comms[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2-7b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--world", type=int, nargs="+")
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    c = SHAPES[args.shape]
    hidden, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    gpus = llaisys.cuda_device_count()
    worlds = args.world or [w for w in (2, 4, 8) if w <= gpus]
    # the backend line says whether these GPUs take the peer path, and each kernel's limit
    print(f"{args.shape}: hidden {hidden}, {layers} layers, vocab {vocab}; {gpus} GPUs; NCCL "
          f"{llaisys.build_info()['nccl']}; all_reduce backend: {make_group(worlds[0], 'push')[0].backend}")
    for world in worlds:
        for batch in args.batch:
            def reduce(r, comm, state):
                if state is None:
                    return llaisys.tensor(np.ones((batch, hidden), np.float32)).to(f"cuda:{r}").to("bf16")
                _core.ops.all_reduce(state, comm)

            def gather(r, comm, state):
                if state is None:
                    part = llaisys.tensor(np.ones((batch, vocab // world), np.float32)).to(f"cuda:{r}").to("bf16")
                    out = llaisys.tensor(np.ones((batch * world, vocab // world), np.float32)).to(f"cuda:{r}")
                    return part, out.to("bf16")
                _core.ops.all_gather(state[1], state[0], comm)

            def pairs(r, comm, state):  # the alternative for greedy rows: each slice's (max, index) gathered
                if state is None:
                    part = llaisys.tensor(np.ones((batch, 2), np.float32)).to(f"cuda:{r}")
                    return part, llaisys.tensor(np.ones((batch * world, 2), np.float32)).to(f"cuda:{r}")
                _core.ops.all_gather(state[1], state[0], comm)

            ar = {mode: time_ranks(world, reduce, args.iters, mode) for mode in MODES}
            mi, _ = time_ranks(world, pairs, args.iters)
            ag, _ = time_ranks(world, gather, max(20, args.iters // 10))
            best = min(t for t, _ in ar.values())
            step = 2 * layers * best + ag
            cols = "  ".join(f"{mode} {t * 1e6:6.1f} us (ran {path})" for mode, (t, path) in ar.items())
            print(f"world {world} batch {batch:4d}: all_reduce [{batch}, {hidden}] bf16: {cols}; "
                  f"all_gather of the logits {ag * 1e6:7.1f} us; per decode step (2 x {layers} + 1, fastest) "
                  f"{step * 1e3:6.3f} ms; all_gather of (max, index) [{batch}, 2] f32 {mi * 1e6:7.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
