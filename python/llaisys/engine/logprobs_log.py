"""Logprobs entries kept as arrays until a request ends (issue 33: host work per sequence and step).

A request read only at its end (Request.keeps_ids: generate(), the server's non-streaming responses) that asks
for logprobs is a quiet row of the persistent batch like one that asks for none (Sequence.quiet): a batch step
does not build its entry (a dict with a list of [id, logprob] lists) nor hand it to the step loop. The step's
logprobs arrays of such rows are appended, as they are, to the log of the batch's layout (LogprobsLog: the
batch's rows at one version, over the consecutive steps accounted from it); each of those sequences got, when
the layout's log began, a Span in its ordered list `Sequence.lp_log` (the list the step loop appends the
entries it is handed to: the first token's, those of steps of the general path). Request.finish turns that
list into the entries (resolve), built once from the stacked arrays: the same dicts, values and order as the
entries built step by step (`entries`).

Why a layout's log and not each row's: appending to it is a few array copies a step whatever the rows; a
row's Span is made only when its layout begins (a new batch, or rows left it: DecodeBatch.condense)."""
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
    """The logprobs of a batch layout's quiet rows with logprobs (Q of them), one row of each array a step:
    chosen [steps, Q] f32, ids and lps [steps, Q, k] (k: the most any of them asked for). Grown by doubling."""

    def __init__(self, version: int, sel, Q: int, k: int, V: int):
        self.version = version  # the batch's version whose layout this is
        self.sel = sel  # the quiet ones among the step's logprobs rows (None: every one)
        self.k, self.V, self.n = k, V, 0
        self.chosen = np.empty((8, Q), np.float32)
        self.ids = np.empty((8, Q, k), np.int64)
        self.lps = np.empty((8, Q, k), np.float32)

    def append(self, chosen: np.ndarray, top_ids: np.ndarray, top_lp: np.ndarray) -> None:
        """A step's arrays over its logprobs rows (chosen [R], top_* [R, K >= k])."""
        n = self.n
        if n == len(self.chosen):  # the bigger arrays are filled before they replace the old
            grown = []
            for a in (self.chosen, self.ids, self.lps):
                b = np.empty((2 * n,) + a.shape[1:], a.dtype)
                b[:n] = a
                grown.append(b)
            self.chosen, self.ids, self.lps = grown
        sel, k = self.sel, self.k
        if sel is None:
            self.chosen[n] = chosen
            self.ids[n] = top_ids[:, :k]
            self.lps[n] = top_lp[:, :k]
        else:
            self.chosen[n] = chosen[sel]
            self.ids[n] = top_ids[sel, :k]
            self.lps[n] = top_lp[sel, :k]
        self.n = n + 1


class Span:
    """A sequence's entries in a LogprobsLog: its quiet row q there, from its output token `start` on, for every
    step of the log (the layout's steps are contiguous in each of its rows' outputs), and never past the
    sequence's output (a row that ended is left in its layout's later steps: those are not its tokens)."""

    __slots__ = ("log", "q", "start")

    def __init__(self, log: LogprobsLog, q: int, start: int):
        self.log, self.q, self.start = log, q, start

    def entries(self, seq) -> list[dict]:
        log, q, start = self.log, self.q, self.start
        n = min(log.n, seq.num_output - start)
        if n <= 0:
            return []
        first = seq.num_prompt + start
        return entries(seq.tokens[first:first + n], seq.params.logprobs, log.chosen[:n, q], log.ids[:n, q],
                       log.lps[:n, q], log.V)


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
