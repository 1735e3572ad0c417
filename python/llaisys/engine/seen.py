"""The repetition penalty's "seen" sets (HF: every token of the prompt and of the output so far, penalised
once), one bitmask row per penalised sequence in the runner's device tensor (Runner.set_seen). A row is
written once, from the sequence's tokens, at the first step that samples for it (NumPy bit operations:
O(its length) once); from then on the sampler adds each sampled token on the device (ops.seen_mark). So a
step costs the host nothing per row for the penalty, and a chained step, whose input token the host does
not know yet, penalises that token too. Rows of finished sequences are reused. After a failed step every row
is written again from the sequences (the device may have added tokens the host then dropped)."""
from __future__ import annotations

import numpy as np

from .sequence import Sequence, Status


def seen_words(tokens, vocab_size: int) -> np.ndarray:
    """The set of `tokens` as a bitmask [ceil(vocab / 32)] i32: bit v % 32 of word v / 32 = token v."""
    words = np.zeros((vocab_size + 31) // 32, np.uint32)
    ids = np.asarray(tokens, np.int64)
    np.bitwise_or.at(words, ids >> 5, np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32)))
    return words.view(np.int32)


class SeenRows:
    def __init__(self, write, vocab_size: int):
        """write(row, words): the runner's set_seen (looked up at each call: engine/node_steps.py wraps the
        runner after it is built)."""
        self.write, self.vocab_size = write, vocab_size
        self.owner: dict[int, Sequence] = {}  # row -> its sequence
        self.free: list[int] = []
        self.count = 0  # rows named so far (the device tensor holds at least these)
        self.writes = 0  # rows written from the host (tests: once per sequence unless a step failed)

    def row(self, seq: Sequence, ahead: int = 0) -> int:
        """seq's row, written from its tokens if it has none. ahead 1 (a chained step) never writes one: the
        host lacks the token of the step ahead, which the row would then miss."""
        if seq.seen_row is not None:
            return seq.seen_row
        if ahead:
            raise RuntimeError("a chained step for a sequence with no seen row (its first step was not sampled "
                               "with its repetition penalty)")
        r = self._take()
        self.write(r, seen_words(seq.tokens, self.vocab_size))
        self.writes += 1
        seq.seen_row, self.owner[r] = r, seq
        return r

    def rows(self, seqs: list[Sequence], ahead: int = 0) -> np.ndarray:
        """[B] i32: each penalised sequence's row, -1 for the others."""
        return np.array([self.row(s, ahead) if s.penalised else -1 for s in seqs], np.int32)

    def _take(self) -> int:
        if not self.free:  # reclaim the rows of finished sequences (a step still marking one runs first)
            self.free = [r for r, s in self.owner.items() if s.status is Status.FINISHED]
            for r in self.free:
                self.owner.pop(r).seen_row = None
        if self.free:
            return self.free.pop()
        self.count += 1
        return self.count - 1

    def reset(self) -> None:
        """After a failed step: every row is written again from its sequence's tokens when next used."""
        for s in self.owner.values():
            s.seen_row = None
        self.owner.clear()
        self.free = list(range(self.count))
