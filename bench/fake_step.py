"""A CPU stand-in for a GPU's engine step, to measure the server and the load client on a machine without one:
every engine step sleeps LLAISYS_FAKE_STEP_MS (default 20; the GIL is free meanwhile, as while a GPU
computes) and returns random token ids instead of running the model. Scheduling, the KV block accounting,
detokenizing, the engine process's messages and HTTP all run as they do for real.

    python bench/serve_load.py --write-checkpoint /tmp/ckpt --shape tiny     # every id decodes to " t<id>"
    python bench/fake_step.py serve --model /tmp/ckpt --device cpu --port 8123 --cpu-kv-cache-bytes 1073741824
    python bench/fake_step.py load --url http://127.0.0.1:8123 --model /tmp/ckpt --device cpu --offline

`serve` runs `llaisys serve` with the fake step (its engine process is spawned from this file, so it gets the
patch too); `load` runs bench/serve_load.py, whose --offline engine then has the same fake step.
"""
import os
import random
import runpy
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from llaisys.engine.model_runner import ModelRunner  # noqa: E402

STEP_S = float(os.environ.get("LLAISYS_FAKE_STEP_MS", "20")) / 1e3
TOKENS = (1000, 16000)  # ids of the tiny random checkpoint's padded vocabulary: one word each, no EOS


def fake_step(self, step) -> list[int]:
    time.sleep(STEP_S)
    return [random.randrange(*TOKENS) for _ in step.seqs]


# at import, not under __main__: a spawned engine process imports this file as its main module (__mp_main__)
ModelRunner.step = fake_step

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("serve", "load"):
        raise SystemExit(__doc__)
    what, sys.argv = sys.argv[1], [sys.argv[0], *sys.argv[2:]]
    if what == "serve":
        runpy.run_module("llaisys.server", run_name="__main__")
    else:
        import serve_load

        raise SystemExit(serve_load.main())
