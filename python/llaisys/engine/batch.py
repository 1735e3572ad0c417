"""The persistent decode batch (issue 33): while every running sequence decodes one token a step, the
step's host arrays live here as NumPy arrays that advance in place, so the host's work per step is a few
vectorised operations plus one short Python loop (a token appended to each sequence), not a pass of
attribute lookups, list building and checks per sequence in the scheduler, the runner and the accounting.

The Sequence objects stay the truth (the block manager, the prefix cache, preemption and the slow path
read them); the arrays are a cache of them that EngineCore keeps in step and drops whenever something else
changes the batch (a request admitted, a prefill, a preemption, a failed step). Rows that end leave by
`condense`. A batch exists only for rows the fast path serves exactly: decodes without presence/frequency
penalties or biases, past their min_tokens (those run the general path: their biases are host lists rebuilt
each step). A repetition penalty joins: its set lives on the device (engine/seen.py), the batch carries only
each row's penalty and seen row. Constrained rows (structured output) may join: the rows in `masked` get
their matchers' masks and advance them; rows waiting for their constraint's trigger (`triggers`) check each
token on the host and move to `masked` when it fires. Rows with logprobs
may join: where the runner computes them on the device behind each step (ModelRunner.launch), their steps
chain like any; else (a tensor-parallel group) a batch holding any runs its steps one at a time (the logprobs
are then read from the step's logits, which a chained step would overwrite). A quiet row's logprobs stay
arrays, in the batch's log (lp_log), until its request ends (engine/logprobs_log.py)."""
from __future__ import annotations

import numpy as np

from collections import deque

from .sequence import Sequence, Status


def eligible(seq: Sequence) -> bool:
    """Whether seq's next steps can run from the batch arrays: a decode whose sampling needs no per-step
    host lists (the biases of presence/frequency penalties and of the min_tokens ban; logprobs come from one
    op over the batch, a constrained row's mask from its matcher: DecodeBatch.masked, a repetition penalty's
    set from the device: seen.py) and whose cache does not slide (a windowed sequence's positions and blocks
    move with its evictions: block_manager.slide)."""
    return (len(seq) - seq.num_computed == 1 and seq.counts is None and
            seq.num_output >= seq.params.min_tokens and not seq.kv_window)


class DecodeBatch:
    def __init__(self, seqs: list[Sequence], block_size: int):
        self.seqs = list(seqs)
        self.block_size = block_size
        self.version = 0  # bumped when rows leave: a step made before then is accounted the general way
        self.issued = 0  # steps made from the arrays and not advanced yet: at a new schedule, 0 unless stale
        n = len(self.seqs)
        self.pos = np.fromiter((s.num_computed for s in self.seqs), np.int64, n)  # position computed next
        self.last = np.fromiter((s.tokens[-1] for s in self.seqs), np.int64, n)  # the token fed next
        self.num_output = np.fromiter((s.num_output for s in self.seqs), np.int64, n)
        self.max_new = np.fromiter((s.params.max_new_tokens for s in self.seqs), np.int64, n)
        self.nblk = np.fromiter((len(s.block_table) for s in self.seqs), np.int64, n)
        # [n, the widest row's blocks] i32: exactly that wide, so a step hands it over without a copy
        self.tables = np.zeros((n, int(self.nblk.max(initial=1))), np.int32)
        for row, s in enumerate(self.seqs):
            self.tables[row, :len(s.block_table)] = s.block_table
        self._fixed = None  # arrays() parts that change only with the rows or the tables' width (_layout)
        params = [s.params for s in self.seqs]
        self.temperature = np.array([p.temperature for p in params], np.float32)
        self.top_k = np.array([p.top_k for p in params], np.int32)
        self.top_p = np.array([p.top_p for p in params], np.float32)
        self.min_p = np.array([p.min_p for p in params], np.float32)
        self.penalty = np.array([p.repetition_penalty for p in params], np.float32)
        self.seen_row: np.ndarray | None = None  # [n] i32, -1: no penalty; ModelRunner fills it at the first step
        self.seeds = np.array([s.seed for s in self.seqs], np.uint64)
        self.logprobs = np.array([-1 if p.logprobs is None else p.logprobs for p in params], np.int64)  # -1: none
        # rows whose tokens nobody reads before they end (Sequence.quiet), past their first token (its time is
        # taken when it is delivered) and with no constraint (whose ends the accounting does not see as masks)
        # (a row with logprobs: its arrays go to lp_log, engine/logprobs_log.py)
        self.quiet = np.fromiter((s.quiet and s.num_output > 0 and s.constraint is None and s.trigger is None and
                                  (s.params.logprobs is None or s.lp_log is not None) for s in self.seqs), bool, n)
        self.lp_log = None  # the LogprobsLog of its quiet rows with logprobs (EngineCore._log_quiet)
        self.advanced = 0  # steps advanced so far (the clock of end_at)
        self.end_at: np.ndarray | None = None  # [n] the value of `advanced` at which each row ends by length
        self._rows()
        self._constrained()
        eos = {s.eos for s in self.seqs}
        # one EOS set for every row (the usual case): one vectorised test; else a per-row test of the few rows
        self.eos = np.array(sorted(next(iter(eos))), np.int64) if len(eos) == 1 else None
        self.eos_set = next(iter(eos)) if len(eos) == 1 else None

    def _rows(self) -> None:
        """What the steps ask about the rows, kept until they change (per step a test of a flag or a counter, not
        a pass over arrays): the rows with logprobs, the rows listed in every step's produced list (not quiet),
        and the step at which the first row reaches its length limit (end_at, once max_seq_len is known)."""
        self.token_lists = [s.tokens for s in self.seqs]  # advance() appends to them
        self.lp_rows = np.flatnonzero(self.logprobs >= 0)
        self.any_quiet = bool(self.quiet.any())
        self.loud = np.flatnonzero(~self.quiet).tolist()
        self.next_end = int(self.end_at.min(initial=1 << 62)) if self.end_at is not None else -1

    def ends(self, max_seq_len: int) -> int:
        """The value of `advanced` at which the first row ends by length (max_new_tokens, or the context
        max_seq_len); from then on end_at says which rows do."""
        if self.end_at is None:
            self.end_at = self.advanced + np.minimum(self.max_new - self.num_output, max_seq_len - 1 - self.pos)
            self.next_end = int(self.end_at.min(initial=1 << 62))
        return self.next_end

    def _constrained(self) -> None:
        # rows with a constraint (structured output): masked each step, their matchers advanced by advance();
        # rows whose constraint waits for its trigger: each token checked (EngineCore._account_batch)
        self.masked = [row for row, s in enumerate(self.seqs) if s.constraint is not None]
        self.triggers = [row for row, s in enumerate(self.seqs) if s.trigger is not None]

    def triggered(self) -> None:
        """A trigger row's constraint started (its sequence's `constraint` set): it is masked from now on."""
        self._constrained()

    @property
    def defers(self) -> bool:
        """Whether a chained step's sampling waits for the step ahead's tokens (ModelRunner.launch): a row's
        mask needs them, or a trigger row's constraint may start with one of them."""
        return bool(self.masked or self.triggers)

    def __len__(self) -> int:
        return len(self.seqs)

    def matches(self, running: list[Sequence]) -> bool:
        """Whether the rows are exactly `running` (after dropping the rows that ended since: condense), and
        every step made from the arrays was advanced (else the sequences moved without them)."""
        if self.issued:
            return False
        if running == self.seqs:
            return True
        keep = [s.status is Status.RUNNING for s in self.seqs]
        if sum(keep) != len(running):
            return False
        self.condense(np.array(keep, bool))
        return running == self.seqs

    def condense(self, keep: np.ndarray) -> None:
        self.last = np.asarray(self.last, np.int64)
        self.seqs = [s for s, k in zip(self.seqs, keep) if k]
        for name in ("pos", "last", "num_output", "max_new", "nblk", "tables", "temperature", "top_k", "top_p",
                     "min_p", "penalty", "seeds", "logprobs", "seen_row", "quiet", "end_at"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name)[keep])
        width = int(self.nblk.max(initial=1))
        if width < self.tables.shape[1]:  # the widest row left
            self.tables = np.ascontiguousarray(self.tables[:, :width])
        self._fixed = None
        self._rows()
        self._constrained()
        self.version += 1

    def grow(self, blocks, ahead: int) -> bool:
        """Gives every row the blocks that a decode `ahead` steps past the host's knowledge needs; False
        (nothing taken) when the pool has too few free: the general path then preempts. The rows' new blocks
        are taken in row order (as BlockManager.grow row by row would) and written into the table at once."""
        need = -(-(self.pos + ahead + 1) // self.block_size) - self.nblk
        rows = np.flatnonzero(need > 0)
        if rows.size == 0:
            return True
        counts = need[rows]
        total = int(counts.sum())
        if total > blocks.num_free:
            return False
        new = blocks.take(total)
        first = self.nblk[rows]  # each row's first new table column
        width = int((first + counts).max())
        if width > self.tables.shape[1]:
            grown = np.zeros((len(self), width), np.int32)
            grown[:, :self.tables.shape[1]] = self.tables
            self.tables, self._fixed = grown, None
        if total == rows.size:  # one block a row (a decode crossed a block's end): the usual case
            for row, b in zip(rows.tolist(), new):
                self.seqs[row].block_table.append(b)
            self.tables[rows, first] = new
        else:
            ends = np.cumsum(counts)
            for row, a, z in zip(rows.tolist(), (ends - counts).tolist(), ends.tolist()):
                self.seqs[row].block_table.extend(new[a:z])
            self.tables[np.repeat(rows, counts), np.repeat(first - ends + counts, counts) + np.arange(total)] = new
        self.nblk[rows] += counts
        return True

    def _layout(self):
        """(row offsets into the flat tables, q_start, placeholder ids): fixed while the rows and the tables'
        width are."""
        n, width = len(self), self.tables.shape[1]
        if self._fixed is None or self._fixed[0] != width:
            self._fixed = (width, np.arange(n, dtype=np.int64) * width, np.arange(n + 1, dtype=np.int32),
                           np.zeros(n, np.int64))
        return self._fixed[1:]

    def arrays(self, ahead: int = 0):
        """The runner's host arrays (ids, pos, slots, q_start, kv_len, tables), as ModelRunner._arrays
        builds them for one-token rows. ahead 1: the step after the one still running (ids are placeholders
        the runner takes from that step's tokens on the device). The runner copies them: the batch may
        change them in place afterwards."""
        bs = self.block_size
        offsets, q_start, zeros = self._layout()
        pos = self.pos + ahead
        blk = pos // bs
        slots = self.tables.ravel()[offsets + blk].astype(np.int64)  # each row's block of pos
        slots *= bs
        slots += pos - blk * bs
        ids = zeros if ahead else np.asarray(self.last, np.int64)  # (advance keeps the runner's list)
        return (ids, pos, slots, q_start, (pos + 1).astype(np.int32), self.tables)

    def step_made(self) -> int:
        """Counts a step made from the arrays (advance() counts it back); its version."""
        self.issued += 1
        return self.version

    def sampling(self, ahead: int = 0):
        return (self.temperature, self.top_k, self.top_p, self.min_p, self.penalty, self.seeds,
                (self.num_output + ahead).astype(np.uint64), self.seen_row, [], [])

    def advance(self, tokens, max_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """Applies a step's tokens (one per row, every row running): the sequences get them, the arrays
        move one position. Returns the (EOS, length) end masks; the caller finishes those rows."""
        self.issued -= 1
        if type(tokens) is not list or (tokens and type(tokens[0]) is not int):  # (the runner's: a list of ints)
            tokens = np.asarray(tokens, np.int64).tolist()  # plain ints (the prefix cache hashes them)
        # each row's token appended to its sequence's list, at C speed: the token before it counts as computed
        # with it (Sequence.remaining stays 1), so no attribute of the sequence is written
        deque(map(list.append, self.token_lists, tokens), 0)
        self.pos += 1
        self.num_output += 1
        self.last = tokens
        if self.eos is not None:  # a compare per EOS id: np.isin sorts, ~9x slower at 256 rows
            eos = np.zeros(len(tokens), bool)
            if not self.eos_set.isdisjoint(tokens):  # (a pass at C speed; most steps draw no EOS)
                tok = np.asarray(tokens, np.int64)
                for e in self.eos.tolist():
                    eos |= tok == e
        else:
            eos = np.array([t in s.eos for s, t in zip(self.seqs, tokens)], bool)
        self.advanced += 1
        if self.ends(max_seq_len) > self.advanced:  # most steps: no row reaches its length limit
            return eos, np.zeros(len(tokens), bool)
        return eos, ~eos & (self.end_at <= self.advanced)
