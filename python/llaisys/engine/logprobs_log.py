"""Logprobs entries kept as arrays until a request ends (issue 33: host work per sequence and step).

A request read only at its end (Request.keeps_ids: generate(), the server's non-streaming responses) that asks
for logprobs is a quiet row of the persistent batch like one that asks for none (Sequence.quiet): a batch step
does not build its entry (a dict with a list of [id, logprob] lists) nor hand it to the step loop. The step's
logprobs arrays of such rows are appended, as they are, to the batch's log (LogprobsLog: a column per such
sequence, a row per step accounted from the batch); each of those sequences got, when the log began, a Span
in its ordered list `Sequence.lp_log` (the list the step loop appends the entries it is handed to: the first
token's, those of steps of the general path). Request.finish copies each Span's piece of the log out (a few
small arrays a request: resolve) into a Pending, and the entries are built from those only when the caller
first reads them (`logprobs` of the last StreamChunk or of the GenerationResult: LazyLogprobs), in the
caller's thread: the same dicts, values and order as the entries built step by step (`entries`), not in the
step loop's own time (building them there at 256 rows cost ~0.7 us an entry, ~0.2 ms a step on the CPU proxy;
only time the loop would spend waiting for the device is used: built ahead, below).

Why a batch's log and not each row's: appending to it is a few array copies a step whatever the rows; a
sequence's Span is made only when a batch begins (a new DecodeBatch: an admission, a prefill, a preemption
rebuild it), not each step, nor when rows leave the batch (its log follows them).

Built ahead while the device computes: where the step loop would only wait for the device (EngineCore.step,
before it reads an overlapped step's tokens, while ModelRunner.busy: a GPU still running that step), it
builds the current batch's log's entries in step order, 64 at a time, asking again after each call
(LogprobsLog.build_next: the same _core.logprobs_entries call, over the columns still in the batch), so most
of a request's entries exist when it ends, and its Pending holds them as they are (a list: the same dicts)
plus the arrays of the steps not built yet. Measured on the H200 (0.5B, 256 rows, logprobs=5, every entry read): the loop waited ~1.4 ms of a
2 ms step there, and the reader's building was ~0.42 ms a step (~1.6 us an entry). Where the device is never
busy (the CPU, a host-bound model, a tensor-parallel RankGroup) nothing is built ahead: the loop has no time
to spare, and the entries stay arrays until read."""
from __future__ import annotations

import threading
from collections import deque

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
    the batch way: toks [steps, Q] i64 (the step's tokens), chosen [steps, Q] f32, ids and lps [steps, Q, k] (k:
    the most any of them asked for), a column per sequence (Q: those at the log's first step). The batch's rows
    only leave it (a row that joins makes a new batch), so every column's steps are contiguous in its sequence's
    output from the log's first step until the sequence ends; after that its column holds whatever (a Span
    never reads past its output). Rows leaving change which step row is which column (at): the log follows the
    batch's versions. Grown by doubling.

    built[c]: column c's entries of the log's first steps, built ahead (build_next) while the device was busy;
    a column's are always a prefix of its steps (only columns still in the batch are built, and columns only
    leave). Its Span takes them when the request ends (Span.parts), leaving the list empty: an entry is ~1 KB
    at k=5 against ~80 B of arrays, and the log lives as long as its batch. ks[c]: column c's count of top
    entries (its request's logprobs, at most k and the vocabulary)."""

    chunk = 64  # entries a build_next call builds: ~0.1 ms on the H200 host (1.6 us an entry)

    def __init__(self, seq_ids: list[int], k: int, V: int, ks: list[int] | None = None):
        """ks: each column's request's logprobs (None: k for every one)."""
        self.col = {s: c for c, s in enumerate(seq_ids)}  # sequence id -> its column
        self.version = None  # the batch's version that `at` and `sel` are for
        self.sel = None  # the quiet ones among the step's logprobs rows (None: every one)
        self.at = None  # their columns (None: 0..Q-1, in order)
        self.k, self.V, self.n = k, V, 0
        Q = len(seq_ids)
        self.ks = [min(x, k, V) for x in ([k] * Q if ks is None else ks)]
        self.toks = np.empty((8, Q), np.int64)
        self.chosen = np.empty((8, Q), np.float32)
        self.ids = np.empty((8, Q, k), np.int64)
        self.lps = np.empty((8, Q, k), np.float32)
        self.built = [[] for _ in range(Q)]
        self.nb, self.nc = 0, 0  # steps built (build_next), and of the next one, its first columns built
        self.live = None  # (at, their built lists, their ks), for build_next (None: not made for this `at` yet)
        self.cur = None  # the same of the step being built

    def follow(self, version: int, quiet: np.ndarray, seq_ids: list[int]) -> None:
        """The batch's layout at `version` (whose steps are appended next): `quiet` over the step's logprobs rows,
        seq_ids: the quiet ones' sequences (every one a column here)."""
        sel = np.flatnonzero(quiet)
        self.sel = None if sel.size == quiet.size else sel
        at = np.fromiter(map(self.col.__getitem__, seq_ids), np.int64, len(seq_ids))
        self.at = None if at.size == len(self.col) else at  # (columns are made in row order: all = identity)
        self.version, self.live = version, None

    def append(self, toks: np.ndarray, chosen: np.ndarray, top_ids: np.ndarray, top_lp: np.ndarray) -> None:
        """A step's arrays over its logprobs rows (toks [R] i64: their tokens, chosen [R], top_* [R, K]; K is at
        least the k of every quiet row the step has, which may be less than the log's k once the row that asked
        the most left)."""
        n = self.n
        if n == len(self.chosen):  # the bigger arrays are filled before they replace the old
            grown = []
            for a in (self.toks, self.chosen, self.ids, self.lps):
                b = np.empty((2 * n,) + a.shape[1:], a.dtype)
                b[:n] = a
                grown.append(b)
            self.toks, self.chosen, self.ids, self.lps = grown
        sel, at, k = self.sel, self.at, min(self.k, top_ids.shape[1])
        if sel is not None:
            toks, chosen, top_ids, top_lp = toks[sel], chosen[sel], top_ids[sel], top_lp[sel]
        if at is None:
            self.toks[n] = toks
            self.chosen[n] = chosen
            self.ids[n, :, :k] = top_ids[:, :k]
            self.lps[n, :, :k] = top_lp[:, :k]
        else:
            self.toks[n, at] = toks
            self.chosen[n, at] = chosen
            self.ids[n, at, :k] = top_ids[:, :k]
            self.lps[n, at, :k] = top_lp[:, :k]
        self.n = n + 1

    @property
    def unbuilt(self) -> bool:
        """Whether a logged step's entries are not all built yet (build_next has work)."""
        return self.nb < self.n

    def build_next(self) -> None:
        """Builds the next `chunk` entries of the first logged step not built yet, for the columns still in the
        batch when that step's building began (they were in it at that step: columns only leave; those that
        left ended, their Spans take the rest from the arrays), with one _core.logprobs_entries call (each
        column its own k), appended to their `built` lists. Called only while the device is busy anyway
        (EngineCore._build_ahead), which asks again after each call: a chunk, not a whole step, bounds how long
        the loop can go on once the device is done (256 rows' step: ~0.4 ms on the H200 host, 1.6 us an entry)."""
        i, j = self.nb, self.nc
        if j == 0:  # this step's columns, kept until it is built whatever leaves meanwhile (follow)
            if self.at is None:
                self.cur = (None, self.built, self.ks)
            else:
                if self.live is None:
                    cols = self.at.tolist()
                    self.live = (self.at, [self.built[c] for c in cols], [self.ks[c] for c in cols])
                self.cur = self.live
        at, lists, ks = self.cur
        e = min(j + self.chunk, len(lists))
        c = slice(j, e) if at is None else at[j:e]
        found = _core.logprobs_entries(self.toks[i, c].tolist(), self.chosen[i, c], self.ids[i, c], self.lps[i, c],
                                       ks[j:e])
        deque(map(list.append, lists[j:e], found), 0)  # each column's entry to its list, at C speed
        if e == len(lists):
            self.nb, self.nc = i + 1, 0
        else:
            self.nc = e


class Span:
    """A sequence's entries in a LogprobsLog: its column there, from its output token `start` on, for every step
    of the log, and never past the sequence's output (a row that ended is left in the steps after: those are
    not its tokens)."""

    __slots__ = ("log", "col", "start")

    def __init__(self, log: LogprobsLog, col: int, start: int):
        self.log, self.col, self.start = log, col, start

    def parts(self, seq) -> list:
        """Its piece of the log as Pending parts that hold no reference to the log (so none outlives the
        request): the entries built ahead (LogprobsLog.build_next) of its first steps, as a new list of the same
        dicts, then a segment of copies for the rest, a logprobs_entries argument tuple (tokens, chosen [n],
        ids [n, k], lps [n, k], [k]), k the column's (the request's, at most the log's and the vocabulary's).
        Either may be missing (none where the log holds no token of the sequence). Called once, when the
        request ends: the log's list of the column's built entries is emptied (they are the request's now)."""
        log, col, start = self.log, self.col, self.start
        n = min(log.n, seq.num_output - start)
        if n <= 0:
            return []
        built = log.built[col]
        m = min(len(built), n)
        out = [built[:m]] if m else []
        built.clear()  # (the build may append a step or two more before the row leaves: nobody reads those)
        if m < n:
            first, k = seq.num_prompt + start, log.ks[col]
            out.append((seq.tokens[first + m:first + n], log.chosen[m:n, col].copy(), log.ids[m:n, col, :k].copy(),
                        log.lps[m:n, col, :k].copy(), [k]))
        return out


class Pending:
    """Logprobs entries not built yet: `parts` in order, each an entry (a dict: built on the step loop already,
    kept as it is), a list of entries (built ahead on the step loop: Span.parts, kept as they are), a segment
    (the arguments of one _core.logprobs_entries call: Span.parts) or a Pending (whose own entries, the same
    objects, come in its place). build() makes the list once, under a lock (two threads reading at once get the
    same list), and drops the parts. Picklable: the child engine process sends it, arrays and all, to the
    parent (engine/process_child.py), where it is built when read; a Pending so unpickled builds with Python
    alone (py_entries: the same values), as the server's process calls nothing of the native module
    (tests/test_server_process.py: no CUDA context there)."""

    __slots__ = ("parts", "built", "lock", "native")

    def __init__(self, parts: list):
        self.parts, self.built, self.lock, self.native = parts, None, threading.Lock(), True

    def build(self) -> list[dict]:
        with self.lock:
            if self.built is None:
                make = _core.logprobs_entries if self.native else py_entries
                out = []
                for part in self.parts:
                    kind = type(part)
                    if kind is dict:
                        out.append(part)
                    elif kind is list:
                        out += part
                    elif kind is tuple:
                        out += make(*part)
                    else:
                        out += part.build()
                self.built, self.parts = out, None
            return self.built

    def __getstate__(self):
        return self.parts, self.built

    def __setstate__(self, state) -> None:
        (self.parts, self.built), self.lock, self.native = state, threading.Lock(), False


def py_entries(tokens: list, chosen: np.ndarray, ids: np.ndarray, lps: np.ndarray, n: list) -> list[dict]:
    """_core.logprobs_entries of a segment (one count for every row) in Python: the same dicts of Python ints
    and floats (~2x its time, and containers the collector tracks)."""
    m = min(n[0], ids.shape[1])
    if m < ids.shape[1]:
        ids, lps = ids[:, :m], lps[:, :m]
    return [{"token_id": t, "logprob": c, "top": list(map(list, zip(i, lp)))}
            for t, c, i, lp in zip(tokens, chosen.tolist(), ids.tolist(), lps.tolist())]


def resolve(items: list, seq) -> list[dict] | Pending:
    """A sequence's ordered logprobs (entries, and Spans in LogprobsLogs) as entries, or as a Pending of
    entries and the Spans' parts where it has any Span (the copies made here; the entries not built ahead are
    built when read)."""
    if not any(isinstance(i, Span) for i in items):
        return items
    parts = []
    for item in items:
        if isinstance(item, Span):
            parts += item.parts(seq)
        else:
            parts.append(item)
    return Pending(parts)


_PENDING = "_logprobs_pending"  # where a lazy object's Pending waits in its __dict__


class LazyLogprobs:
    """The `logprobs` field of StreamChunk and GenerationResult: a plain attribute (the dataclass's __init__
    stores the value in the instance's __dict__, where reads find it at C speed: this non-data descriptor is
    not consulted), except on an object made lazy (set_lazy): its __dict__ then holds a Pending instead, and
    the first read builds the list, stores it as the plain attribute and returns it. So every read gives a
    list of entries (or None), as before; equality, repr, dataclasses.asdict/replace read the attribute, and
    pickling and copying the object go through materialized_state. The class attribute (the dataclass
    field's default) reads None."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return None
        d = obj.__dict__
        pending = d.get(_PENDING)
        if pending is None:  # another thread built it just now (it sets the attribute first), or the attribute
            return d.get(self.name)  # was deleted (None: the default, as a dataclass's class attribute gives)
        value = pending.build()  # (the same list for every thread that gets here)
        d[self.name] = value  # before the Pending goes: a reader at any moment finds one or the other
        d.pop(_PENDING, None)
        return value


def set_lazy(obj, value):
    """obj (a StreamChunk or GenerationResult) with `value` as its logprobs: a Pending is kept to be built on
    the first read (LazyLogprobs), anything else set as it is. Returns obj."""
    if type(value) is Pending:
        d = obj.__dict__
        d.pop("logprobs", None)
        d[_PENDING] = value
    else:
        obj.logprobs = value
    return obj


def raw_logprobs(obj):
    """obj's logprobs as they are: the list, None, or the Pending not built yet (which set_lazy takes)."""
    d = obj.__dict__
    return d["logprobs"] if "logprobs" in d else d.get(_PENDING)


def concat(values: list):
    """Several objects' logprobs (raw_logprobs: lists, Nones, Pendings) one after another: a list, or a Pending
    (built when read) where any is one; None where all are None."""
    if not any(type(v) is Pending for v in values):
        if all(v is None for v in values):
            return None
        return [e for v in values for e in (v or ())]
    parts = []
    for v in values:
        if type(v) is Pending:
            parts.append(v)
        elif v:
            parts += v
    return Pending(parts)


def materialized_state(self):
    """__getstate__ of StreamChunk and GenerationResult: their __dict__ with the logprobs built (pickle and
    copy see what they saw before the entries were lazy)."""
    if _PENDING in self.__dict__:
        self.logprobs  # noqa: B018 (builds them: LazyLogprobs)
    return self.__dict__
