"""Engine.score's logits: every position of a token list, teacher-forced, dense or through a windowed
sequence's rolling cache (StreamingLLM). Runs on the loop thread between steps."""
from __future__ import annotations

import numpy as np

from ..sampling import resolve_sampling
from .scheduler import Step
from .sequence import Sequence

_GREEDY = resolve_sampling({}, temperature=0)


def score_logits(core, ids: list[int], kv_window: int = 0, sink_tokens: int = 0):
    """Teacher-forced logits of every position of ids, [len, vocab] (a tensor on the model's device; with a
    window, a float32 numpy array). Runs on the loop thread between steps, in blocks of its own (no prefix
    hits: every position's logits are computed) that are freed at once. With kv_window, through the same
    rolling cache a windowed generation uses, in chunks of one block: each position sees what it would see
    when decoded (the sinks and kv_window to kv_window + block_size - 1 tokens before it, when both are
    multiples of the block size)."""
    core.settle()  # a chained step's pending sampling reads the logits buffer this forward overwrites
    bm = core.blocks
    seq = Sequence(ids, _GREEDY, seed=0, eos=frozenset(), kv_window=kv_window, sink_tokens=sink_tokens)
    if not kv_window:
        need = bm.blocks_for(len(ids))
        if need > bm.num_free:
            raise ValueError(f"score(): {len(ids)} tokens need {need} KV blocks but only {bm.num_free} are free")
        bm.admit_private(seq)
        try:
            return core.runner.logits(Step([seq], [len(ids)]), all_logits=True)
        finally:
            bm.free(seq)
    core.check_window(kv_window, sink_tokens)
    need = bm.window_blocks(seq)
    if need > bm.num_free:
        raise ValueError(f"score(): a window of {kv_window} + {sink_tokens} tokens needs {need} KV blocks but only "
                         f"{bm.num_free} are free")
    out = []
    try:
        while seq.num_computed < len(ids):
            n = min(len(ids) - seq.num_computed, bm.block_size, bm.chunk_limit(seq))
            step = Step([seq], [n])
            shift = bm.slide(seq, n)  # never short of blocks: private ones, fewer than window_blocks
            if shift is not None:
                step.shifts.append(shift)
            logits = core.runner.logits(step, all_logits=True)  # the model's buffer, reused by the next step
            out.append(np.array(logits.to("cpu").to("f32").numpy(), dtype=np.float32))
            seq.num_computed += n
    finally:
        bm.free(seq)
    return np.concatenate(out)
