"""Chained (overlapped) decode steps: whether a step may run launched, its tokens read later, with the next
step of the same sequences chained behind it on the device, and launching that next step. EngineCore.step
drives it (its docstring says how the overlap works); EngineConfig.overlap_steps turns it on."""
from __future__ import annotations

import os

import numpy as np

from .scheduler import Step
from .sequence import Status


class Chainer:
    def __init__(self, enabled: bool, scheduler, blocks, runner, max_seq_len: int):
        self.enabled, self.max_seq_len = enabled, max_seq_len
        self.scheduler, self.blocks, self.runner = scheduler, blocks, runner
        self.overlapped_steps = 0  # steps launched chained behind the step ahead
        self.waited = 0  # chained steps launched in a row while requests waited for admission (may_chain)
        # a chained batch step may leave out rows that ended (_next_batch); LLAISYS_CHAIN_DROP=0: the old way,
        # such a step is not chained (the A/B of bench/throughput.py)
        self.drop_rows = os.environ.get("LLAISYS_CHAIN_DROP", "1") != "0"
        self.dropped_rows = 0  # rows left out so (stats)

    def may_overlap(self, step) -> bool:
        """Whether step may run launched (its tokens read later) with a next step chained behind it."""
        if not self.enabled:
            return False
        if step.batch is not None:  # the batch holds only such rows (batch.eligible), or rows with logprobs:
            # those chain where the runner computes them on the device behind each step (ModelRunner.launch),
            # not with a constrained row (whose sampling, deferred, comes after that)
            b = step.batch
            return not b.lp_rows.size or (self.runner.device_logprobs and not b.defers)
        # decodes, no presence/frequency penalties (their counts need the token ahead), no logprobs. The
        # min_tokens ban may chain: whether it applies depends only on how many tokens came before
        # (Sequence.biases(ahead)). A repetition penalty may chain: the sampler adds each token to the row's
        # set on the device (engine/seen.py). A constrained row may chain: its next step's sampling waits for
        # the mask that this step's token decides (ModelRunner.sample_deferred)
        for seq, n in zip(step.seqs, step.num_tokens):
            p = seq.params
            if n != 1 or seq.remaining != 1 or p.logprobs is not None or seq.counts is not None:
                return False
        return True

    # Chained steps launched in a row while requests wait and could be admitted: then one unchained step
    # (the scheduler's) admits them. 1: a request arriving while a step runs is scheduled at most one step
    # later than without overlap (the chained step in flight, then at most this many more). More buys little:
    # on bench/host_cost.py --arrivals the chained share went 80.3% (1) -> 81.0% (2) -> 81.8% (4), the rest
    # being mostly the admission steps themselves (a prefill is never chained).
    MAX_CHAINED_WHILE_WAITING = 1

    def may_chain(self, step) -> bool:
        """Whether a step may be chained behind `step` although requests wait: the chained step holds the same
        sequences, and the waiting ones join the first step after it that is not chained (the scheduler runs
        only when no step is in flight, so an admission or a preemption never meets a chained step). Exact:
        every row draws from its own (seed, step) and reads only its own cache, so which step a request
        joins changes no token (the assumption every batch already rests on: a row's result does not depend
        on the step's other rows, nor, on CUDA, on a pure decode step's kernel against a mixed step's).
        Bounded (no starvation): a step holding max_num_seqs sequences admits nobody until one of them ends,
        so such steps chain on; once a row ended the chained step holds fewer (_next_batch leaves it out), and
        at most MAX_CHAINED_WHILE_WAITING steps are chained in a row while requests wait."""
        # running, not step.seqs: a row that ended is gone from `running` at once, and the step chained next
        # would leave it out (_next_batch), so the step is no longer full and its successor admits
        if not self.scheduler.waiting or len(self.scheduler.running) >= self.scheduler.max_num_seqs:
            return True
        return self.waited < self.MAX_CHAINED_WHILE_WAITING

    def launch_next(self, step, before=None):
        """Launches the decode step after `step` (still running) for the same sequences, chained to its
        tokens; None (nothing launched) where that step is not certain to be wanted as it stands, or where
        waiting requests must be scheduled now (may_chain). before: called just before the launch itself
        (ModelRunner.launch), once its arrays are made."""
        nxt = None
        if self.may_overlap(step) and self.may_chain(step):
            nxt = self._next_batch(step, before) if step.batch is not None else self._next_seqs(step, before)
        self.waited = self.waited + 1 if nxt is not None and self.scheduler.waiting else 0
        return nxt

    def _next_seqs(self, step, before=None):
        """launch_next for a step of the general path."""
        bm, need = self.blocks, 0
        for seq in step.seqs:
            if (seq.status is not Status.RUNNING or seq.num_output + 1 >= seq.params.max_new_tokens or
                    (not seq.kv_window and len(seq) + 1 >= self.max_seq_len)):
                return None  # ended, or about to end by length
            # a windowed one: its eviction before the token after this one (its keys written by the step ahead)
            need += bm.need(seq, 1, ahead=1) if seq.kv_window else max(
                0, bm.blocks_for(len(seq) + 1) - len(seq.block_table))
        if need > bm.num_free:
            return None
        nxt = Step(list(step.seqs), [1] * len(step.seqs))
        for seq in step.seqs:
            if not seq.kv_window:
                bm.grow(seq, len(seq) + 1)
            elif (shift := bm.slide(seq, 1, ahead=1)) is not None:
                nxt.shifts.append(shift)
        self.runner.launch(nxt, chain=True, before=before)
        self.overlapped_steps += 1
        return nxt

    def _next_batch(self, step, before=None):
        """launch_next for a step of the persistent batch: the same checks on its arrays. Rows that end with
        `step` (its token reaches their length limit) or ended before it was read (an EOS, a stop string, an
        abort seen since) are left out of the next step: the batch is condensed to the rest now, the next step
        takes their tokens through chain_rows, and EngineCore._account maps `step`'s tokens back (Step.keep).
        Before, a row's end stopped the chain: the step after it waited for the host (issue 33: 222 of the
        nano-vllm protocol's 1,053 steps)."""
        b = step.batch
        if b is not self.scheduler.batch or step.version != b.version:
            return None
        n = len(b)
        keep = None  # every row
        if b.ends(self.max_seq_len) <= b.advanced + 1:  # some row ends by length with `step`'s token
            keep = b.end_at > b.advanced + 1
        if len(self.scheduler.running) != n:  # some row ended (nothing joins `running` while a batch chains)
            live = np.fromiter((s.status is Status.RUNNING for s in b.seqs), bool, n)
            keep = live if keep is None else keep & live
        rows = None
        if keep is not None and not keep.all():
            if not self.drop_rows or not keep.any():
                return None
            rows = np.flatnonzero(keep).tolist()
            step.keep = keep
            b.condense(keep)
            step.kept_version = b.version
            self.dropped_rows += n - len(rows)
        if not b.grow(self.blocks, 1):
            return None  # `step` is accounted through its keep mask all the same
        nxt = Step(b.seqs, [1] * len(b), batch=b, version=b.step_made(), chain_rows=rows)
        self.runner.launch(nxt, chain=True, before=before)
        self.overlapped_steps += 1
        return nxt
