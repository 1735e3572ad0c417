"""Which sequences run in the next step, and how many tokens each computes.

A step has at most max_num_seqs sequences and max_num_batched_tokens tokens, and no sequence computes more
than max_prefill_chunk prompt tokens in it: a step's time is bounded, and a long prompt cannot hold up the
others, it is computed in chunks beside them (a prompt alone, with nothing else running or waiting, takes
the whole token budget a step). A step takes, in this order:

1. the running decodes (one token each): a stream never waits for a prompt;
2. one chunk of the oldest long prefill (more than max_prefill_chunk tokens to go), running or new: the
   long prompts progress in arrival order, whatever else comes;
3. the short prefills (what is left of the prompt fits in one chunk): running ones, then new requests
   admitted in arrival order while their blocks fit. A short request is admitted beside the chunks of a long
   prompt and ahead of the other long prompts: its first token comes a step or two after it arrives;
4. the other long prefills, running then new, with what is left of the budget.

max_prefill_chunk None is the scheduling of before the cap: running prefills in order, then new requests
in arrival order, each taking all the budget that the ones before it left.

When a running sequence needs a block and none is free, the newest running sequence not yet in this step is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed (mostly from
the prefix cache). A request too large for the whole pool is refused at submission, so nothing deadlocks.
A new request whose blocks do not fit stops admission: nothing behind it jumps ahead for want of blocks
(a long one passed over in 3. is checked only in 4.).

A windowed sequence (StreamingLLM) computes at most what its window's cap holds in a step; its blocks are
readied by BlockManager.slide, and the K-shift that eviction needs rides on the step (Step.shifts), to be
run before it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import islice

from .batch import DecodeBatch, eligible
from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass
class Step:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # tokens each sequence computes in this step
    batch: DecodeBatch | None = None  # every running sequence decodes, from these arrays (batch.py)
    version: int = 0  # the batch's version when the step was made
    # K-shifts to run before the step (cache rows src, rows dst, delta positions): windowed evictions
    shifts: list[tuple[list[int], list[int], int]] = field(default_factory=list)
    # a chained step that continues only some rows of the step ahead (rows of it ended): their indices there,
    # increasing (Runner.launch's chain_rows); None: every row
    chain_rows: list[int] | None = None
    # set on a batch step when the step chained behind it dropped some of its rows (Chainer._next_batch): which
    # rows the batch kept (the batch was condensed to them then, its version became kept_version)
    keep: object = None
    kept_version: int = -1
    # (rows, each row's k, which are quiet rows), NumPy arrays, of the rows whose logprobs were computed on the
    # device behind the step (ModelRunner.launch)
    lp: object = None

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_prefill_chunk: int | None = None):
        self.blocks = blocks
        self.max_num_seqs, self.max_tokens = max_num_seqs, max_num_batched_tokens
        self.max_chunk = max_prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.batch: DecodeBatch | None = None  # the running decodes as arrays, while nothing else runs
        self.batch_steps = 0  # steps made from it (stats: decode_batch_steps)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str | None) -> None:
        """Ends seq (finished or aborted) and frees its blocks; a no-op for a sequence already finished."""
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.blocks.free(seq)
        else:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _make_room(self, seq: Sequence, step: Step, n: int = 1) -> bool:
        """Frees blocks until seq can grow by n tokens; False when seq itself had to be preempted."""
        bm = self.blocks
        while not (bm.need(seq, n) <= bm.num_free if seq.kv_window else bm.can_grow(seq)):
            victims = [s for s in self.running if s is not seq and s not in step.seqs]
            victim = victims[-1] if victims else seq
            self._preempt(victim)
            if victim is seq:
                return False
        if not seq.kv_window:
            bm.grow(seq)
        return True

    def _is_long(self, seq: Sequence) -> bool:
        """More prompt to compute than one chunk (a new request counts its whole prompt: its prefix-cache
        hits are known only once it is admitted)."""
        return self.max_chunk is not None and seq.remaining > self.max_chunk

    def decode_step(self) -> Step | None:
        """The step where every running sequence decodes one token and none waits: made from the
        persistent batch (built when the running set last changed) without a pass over the sequences.
        None where the general schedule must decide (admissions, prefills, rows the batch cannot serve,
        a block to preempt for). Requests may wait when max_num_seqs sequences run: none could be admitted."""
        running = self.running
        if (not running or len(running) > min(self.max_tokens, self.max_num_seqs) or
                (self.waiting and len(running) < self.max_num_seqs)):
            return None
        b = self.batch
        if b is None or not b.matches(running):
            if not all(eligible(s) for s in running):
                self.batch = None
                return None
            b = self.batch = DecodeBatch(running, self.blocks.block_size)
        if not b.grow(self.blocks, 0):
            self.batch = None
            return None
        self.batch_steps += 1
        return Step(b.seqs, [1] * len(b), batch=b, version=b.step_made())

    def schedule(self) -> Step:
        fast = self.decode_step()
        if fast is not None:
            return fast
        self.batch = None
        step, budget = Step(), self.max_tokens
        # A prompt alone (nothing else running or waiting) protects no one by its chunks: it takes the whole
        # budget a step (CPU, 2-core AVX-512, a 512-token prompt alone: chunks of 32 -> 256, Gemma-3-270M 1,051
        # -> 1,319 tok/s, Qwen2.5-Coder-0.5B 433 -> 507; each chunk streams every weight again). A request that
        # arrives meanwhile waits at most one step of the budget, as beside any full step.
        alone = len(self.running) + len(self.waiting) == 1
        cap = self.max_tokens if self.max_chunk is None or alone else self.max_chunk

        def room() -> bool:
            return budget > 0 and len(step.seqs) < self.max_num_seqs

        def tokens(seq: Sequence) -> int:
            self.blocks.skip_ahead(seq)
            limit = self.blocks.chunk_limit(seq)
            return min(seq.remaining, budget, cap, limit if limit is not None else budget)

        def add(seq: Sequence, most: int | None = None) -> None:
            nonlocal budget
            n = tokens(seq) if most is None else min(tokens(seq), most)
            if seq.kv_window:
                shift = self.blocks.slide(seq, n)
                if shift is not None:
                    step.shifts.append(shift)
            step.add(seq, n)
            budget -= n

        def run(seq: Sequence) -> None:  # a running sequence, unless preempted for an earlier one or itself
            if seq.status is Status.RUNNING and self._make_room(seq, step, tokens(seq)):
                add(seq)

        def admit(seq: Sequence) -> None:
            self.waiting.remove(seq)
            self.blocks.admit(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            # a windowed one evicts nothing in its first step: its admission counted no copies of shared blocks
            add(seq, self.blocks.window_blocks(seq) * self.blocks.block_size - (seq.num_computed - seq.evicted)
                if seq.kv_window else None)

        decodes = [s for s in self.running if s.remaining == 1]
        prefills = [s for s in self.running if s.remaining > 1]
        long_prefills = [s for s in prefills if self._is_long(s)]
        short_prefills = [s for s in prefills if not self._is_long(s)]
        bm, bs = self.blocks, self.blocks.block_size
        for seq in decodes + long_prefills[:1] + short_prefills:
            if not room():
                break
            # a running decode of a dense cache: run(seq)'s effects inlined (one token; a block where its last one
            # is full; skip_ahead and chunk_limit apply to windowed ones only); when it needs a block and none
            # is free, run() preempts
            if seq.remaining == 1 and not seq.kv_window and seq.status is Status.RUNNING:
                if len(seq.block_table) * bs < len(seq.tokens):  # its last block is full
                    if not bm.num_free:
                        run(seq)
                        continue
                    bm.grow(seq)
                step.seqs.append(seq)
                step.num_tokens.append(1)
                budget -= 1
                continue
            run(seq)
        # new requests in arrival order; a long one is passed over while a long prefill runs, and comes after
        passed: list[Sequence] = []
        for seq in list(islice(self.waiting, 2 * self.max_num_seqs)):  # at most max_num_seqs passed, as many admitted
            if not room() or len(self.running) >= self.max_num_seqs:
                break
            if self._is_long(seq) and long_prefills:
                if len(passed) >= self.max_num_seqs:
                    break  # no more could run in this step: the scan of a long queue stops here
                passed.append(seq)
                continue
            if not self.blocks.can_admit(seq):
                break
            admit(seq)
            if self._is_long(seq):
                long_prefills.append(seq)
        for seq in long_prefills[1:]:
            if not room():
                break
            run(seq)
        for seq in passed:
            if not room() or len(self.running) >= self.max_num_seqs or not self.blocks.can_admit(seq):
                break
            admit(seq)
        return step
