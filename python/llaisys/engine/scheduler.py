"""Which sequences run in the next step, and how many tokens each computes.

A step has at most max_num_seqs sequences and max_num_batched_tokens tokens. Running sequences come
first, decodes (one token) before prefills, so a long prompt is chunked beside running streams instead
of stalling them. Waiting sequences are admitted in arrival order while their blocks fit. When a running
sequence needs a block and none is free, the newest running sequence not yet in this step is preempted:
its blocks are freed and it goes back to the front of the queue, to be recomputed (mostly from the
prefix cache). A request too large for the whole pool is refused at submission, so nothing deadlocks.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, Status


@dataclass
class Step:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # tokens each sequence computes in this step

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs, self.max_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

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

    def _make_room(self, seq: Sequence, step: Step) -> bool:
        """Frees blocks until seq can grow; False when seq itself had to be preempted."""
        while not self.blocks.can_grow(seq):
            victims = [s for s in self.running if s is not seq and s not in step.seqs]
            victim = victims[-1] if victims else seq
            self._preempt(victim)
            if victim is seq:
                return False
        self.blocks.grow(seq)
        return True

    def schedule(self) -> Step:
        step, budget = Step(), self.max_tokens
        decodes = [s for s in self.running if s.remaining == 1]
        prefills = [s for s in self.running if s.remaining > 1]
        for seq in decodes + prefills:
            if budget == 0 or len(step.seqs) == self.max_num_seqs:
                break
            if seq.status is not Status.RUNNING or not self._make_room(seq, step):
                continue  # preempted while making room for an earlier one, or for itself
            n = min(seq.remaining, budget)
            step.add(seq, n)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.blocks.can_admit(seq):
                break
            self.waiting.popleft()
            self.blocks.admit(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(seq.remaining, budget)
            step.add(seq, n)
            budget -= n
        return step
