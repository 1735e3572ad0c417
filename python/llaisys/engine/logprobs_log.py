"""Logprobs entries kept as arrays until a request ends (issue 33: host work per sequence and step).

A request read only at its end (Request.keeps_ids: generate(), the server's non-streaming responses) that asks
for logprobs is a quiet row of the persistent batch like one that asks for none (Sequence.quiet): a batch step
does not build its entry (a dict with a list of [id, logprob] lists) nor hand it to the step loop. The step's
logprobs arrays of such rows are appended, as they are, to the batch's log (LogprobsLog: a column per such
sequence, a row per step accounted from the batch); each of those sequences got, when the log began, a Span
in its ordered list `Sequence.lp_log` (the list the step loop appends the entries it is handed to: the first
token's, those of steps of the general path). Request.finish turns that list into the entries (resolve),
built once from the stacked arrays: the same dicts, values and order as the entries built step by step
(`entries`).

Why a batch's log and not each row's: appending to it is a few array copies a step whatever the rows; a
sequence's Span is made only when a batch begins (a new DecodeBatch: an admission, a prefill, a preemption
rebuild it), not each step, nor when rows leave the batch (its log follows them)."""
from __future__ import annotations

import numpy as np

from .. import _core


def entries(tokens, ks, chosen, top_ids, top_lp, V: int) -> list[dict]:
    """Logprobs entries of rows: each row's token (ints), its k (ints, or one int for every row), its logprob
    (chosen [R] f32) and its first min(k, V) top ids / logprobs (top_ids [R, K] i64, top_lp [R, K] f32, K >= k),
    highest first: {"token_id", "logprob", "top": [[id, logprob], ...]}, Python ints and floats (as tolist()
    gives them). Built in C++ (_core.logprobs_entries), the containers untracked by the garbage collector: a
    comprehension of dicts of lists made ~7 tracked containers an entry, walked by every collection while
    results piled up."""
    K = min(top_ids.shape[1], V)
    n = np.minimum(np.atleast_1d(np.asarray(ks, np.int64)), K).tolist()  # one for every row, or each row's
    if isinstance(tokens, np.ndarray):
        tokens = tokens.tolist()
    return _core.logprobs_entries(tokens, chosen, top_ids, top_lp, n)


class LogprobsLog:
    """The logprobs of a persistent batch's quiet rows with logprobs, one row of each array a step accounted
    the batch way: chosen [steps, Q] f32, ids and lps [steps, Q, k] (k: the most any of them asked for), a
    column per sequence (Q: those at the log's first step). The batch's rows only leave it (a row that joins
    makes a new batch), so every column's steps are contiguous in its sequence's output from the log's first
    step until the sequence ends; after that its column holds whatever (a Span never reads past its output).
    Rows leaving change which step row is which column (at): the log follows the batch's versions. Grown by
    doubling."""

    def __init__(self, seq_ids: list[int], k: int, V: int):
        self.col = {s: c for c, s in enumerate(seq_ids)}  # sequence id -> its column
        self.version = None  # the batch's version that `at` and `sel` are for
        self.sel = None  # the quiet ones among the step's logprobs rows (None: every one)
        self.at = None  # their columns (None: 0..Q-1, in order)
        self.k, self.V, self.n = k, V, 0
        Q = len(seq_ids)
        self.chosen = np.empty((8, Q), np.float32)
        self.ids = np.empty((8, Q, k), np.int64)
        self.lps = np.empty((8, Q, k), np.float32)

    def follow(self, version: int, quiet: np.ndarray, seq_ids: list[int]) -> None:
        """The batch's layout at `version` (whose steps are appended next): `quiet` over the step's logprobs rows,
        seq_ids: the quiet ones' sequences (every one a column here)."""
        sel = np.flatnonzero(quiet)
        self.sel = None if sel.size == quiet.size else sel
        at = np.fromiter(map(self.col.__getitem__, seq_ids), np.int64, len(seq_ids))
        self.at = None if at.size == len(self.col) else at  # (columns are made in row order: all = identity)
        self.version = version

    def append(self, chosen: np.ndarray, top_ids: np.ndarray, top_lp: np.ndarray) -> None:
        """A step's arrays over its logprobs rows (chosen [R], top_* [R, K]; K is at least the k of every quiet
        row the step has, which may be less than the log's k once the row that asked the most left)."""
        n = self.n
        if n == len(self.chosen):  # the bigger arrays are filled before they replace the old
            grown = []
            for a in (self.chosen, self.ids, self.lps):
                b = np.empty((2 * n,) + a.shape[1:], a.dtype)
                b[:n] = a
                grown.append(b)
            self.chosen, self.ids, self.lps = grown
        sel, at, k = self.sel, self.at, min(self.k, top_ids.shape[1])
        if sel is not None:
            chosen, top_ids, top_lp = chosen[sel], top_ids[sel], top_lp[sel]
        if at is None:
            self.chosen[n] = chosen
            self.ids[n, :, :k] = top_ids[:, :k]
            self.lps[n, :, :k] = top_lp[:, :k]
        else:
            self.chosen[n, at] = chosen
            self.ids[n, at, :k] = top_ids[:, :k]
            self.lps[n, at, :k] = top_lp[:, :k]
        self.n = n + 1


class Span:
    """A sequence's entries in a LogprobsLog: its column there, from its output token `start` on, for every step
    of the log, and never past the sequence's output (a row that ended is left in the steps after: those are
    not its tokens)."""

    __slots__ = ("log", "col", "start")

    def __init__(self, log: LogprobsLog, col: int, start: int):
        self.log, self.col, self.start = log, col, start

    def entries(self, seq) -> list[dict]:
        log, col, start = self.log, self.col, self.start
        n = min(log.n, seq.num_output - start)
        if n <= 0:
            return []
        first = seq.num_prompt + start
        # (entries() without its checks: one call a span of every sequence at its end)
        return _core.logprobs_entries(seq.tokens[first:first + n], log.chosen[:n, col], log.ids[:n, col],
                                      log.lps[:n, col], [min(seq.params.logprobs, log.k, log.V)])


def resolve(items: list, seq) -> list[dict]:
    """A sequence's ordered logprobs (entries, and Spans in LogprobsLogs) as entries."""
    if not any(isinstance(i, Span) for i in items):
        return items
    out = []
    for item in items:
        if isinstance(item, Span):
            out += item.entries(seq)
        else:
            out.append(item)
    return out
