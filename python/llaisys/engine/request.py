"""A submitted request as its caller sees it: chunks of text arrive in a thread-safe queue, fed by the
step loop; iterate the handle to read them, abort() to stop it and free its blocks at once. A consumer of
many requests (the HTTP server) passes a ChunkSink instead: the step loop hands it every chunk and tells it
once per step that a batch is complete, so its readers wake once per step rather than once per token."""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Protocol

from ..stops import StopStringMatcher
from ..streaming import IncrementalDetokenizer
from .logprobs_log import LazyLogprobs, concat, materialized_state, raw_logprobs, resolve, set_lazy
from .sequence import Sequence


@dataclass
class StreamChunk:
    """A piece of streamed output. The last chunk has finish_reason, usage and timings set."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: dict | None = None
    timings: dict | None = None
    # with logprobs=k: one entry per token id of the chunk, {"token_id", "logprob", "top": [[id, logprob], ...]}
    # (the last chunk of a request read only at its end builds its entries when first read: LazyLogprobs)
    logprobs: list[dict] | None = LazyLogprobs()

    __getstate__ = materialized_state


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    usage: dict = field(default_factory=dict)  # prompt_tokens, completion_tokens, cached_tokens
    timings: dict = field(default_factory=dict)  # ttft_s, prefill_tokens_per_s, decode_tokens_per_s, total_s
    logprobs: list[dict] | None = LazyLogprobs()  # one entry per token id, with logprobs=k (built when first read)

    __getstate__ = materialized_state


_END = object()
log = logging.getLogger("llaisys.engine")


class ChunkSink(Protocol):
    """Where the chunks of requests submitted with Engine.submit(..., sink=) go instead of their own queues.

    Both methods run on the step loop thread and must return quickly without raising (they hold up the
    next step). put(request, item) comes for each chunk in order, the last one being the chunk with
    finish_reason set or the exception that ended the request. flush() comes once after each round of the
    loop (a step, or aborts handled, or the engine closing) that put anything into this sink: the moment to
    hand the batch to its readers, e.g. with one call_soon_threadsafe for all of them."""

    def put(self, request: "Request", item: "StreamChunk | BaseException") -> None: ...

    def flush(self) -> None: ...


def check_sink(sink) -> None:
    """TypeError, at submit time, for a sink the step loop could not call (rather than an error in its thread)."""
    if sink is None:
        return
    missing = [m for m in ("put", "flush") if not callable(getattr(sink, m, None))]
    if missing:
        raise TypeError(f"sink must be a ChunkSink (llaisys.engine.request.ChunkSink): an object with methods "
                        f"put(request, item) and flush(); {type(sink).__name__} has no callable "
                        f"{' or '.join(missing)}")


def check_incremental(incremental) -> None:
    """TypeError for a submit(incremental=) that is not a bool (1 or "no" would be read as a choice)."""
    if not isinstance(incremental, bool):
        raise TypeError(f"incremental must be True or False, got {incremental!r}")


def chunks_or_abort(req: "Request") -> Iterator[StreamChunk]:
    """req's chunks; a caller that stops reading (break, close, Ctrl-C) aborts it, so its blocks are freed."""
    done = False
    try:
        for chunk in req:
            yield chunk
        done = True
    finally:
        if not done:
            req.abort()


def results_or_abort(reqs: list["Request"]) -> list[GenerationResult]:
    """Every request's result, in order; an error or Ctrl-C aborts those still running."""
    try:
        return [r.result() for r in reqs]
    except BaseException:
        for r in reqs:
            r.abort()
        raise


def merge_chunks(chunks: list[StreamChunk]) -> StreamChunk:
    """Consecutive chunks of one request as one: text and token ids concatenated, logprobs entries in
    order, finish_reason, usage and timings from the last. Text stays whole UTF-8 characters and shows no
    stop string, as each chunk's does."""
    if len(chunks) == 1:
        return chunks[0]
    last = chunks[-1]
    return set_lazy(StreamChunk("".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids],
                                last.finish_reason, last.usage, last.timings),
                    concat([raw_logprobs(c) for c in chunks]))  # (entries not built yet stay so)


class Request:
    """Owned by the step loop after submit(): on_token/finish run there; the caller only reads chunks."""

    def __init__(self, seq: Sequence, tokenizer_inner, stops: tuple[str, ...], loop, sink: ChunkSink | None = None,
                 incremental: bool = True):
        self.seq, self._loop, self.sink = seq, loop, sink
        # incremental False: nobody reads the chunks before the end (generate(), chat() without a stream, the
        # server's non-streaming responses: Engine.submit(incremental=False)) and
        # no stop string needs the text as it grows, so the ids are decoded once when the request ends: the
        # step loop does nothing for it per token (issue 33: host work per sequence and step)
        self.keeps_ids = not incremental and not stops
        # its ids are seq.output at the end (every token the core gave it), its logprobs seq.lp_log: the step
        # loop hands it its first token (for its time) and, where the general path computed them, logprobs
        # entries; a row of the persistent batch is not handed anything until it ends (Sequence.quiet)
        self._detok = IncrementalDetokenizer(tokenizer_inner, skip_special_tokens=True)
        self._stops = StopStringMatcher(stops)
        self._pending: list[int] = []
        self._tail: str | None = None  # the text before a stop string, once one is hit
        self._pending_lp: list[dict] | None = [] if seq.params.logprobs is not None else None
        self.lps_kept = self._pending_lp  # and their logprobs entries (None: the request asked for none)
        seq.quiet = self.keeps_ids
        if self.keeps_ids:  # the core appends its logs' Spans to the same list (engine/logprobs_log.py)
            seq.lp_log = self._pending_lp
        self._chunks: queue.SimpleQueue = queue.SimpleQueue()
        # every item read from _chunks, kept: iterating again, or result() after iterating, replays them
        # (the queue gives each item once; reading it twice would wait forever)
        self._read: list = []
        self._read_lock = threading.Lock()
        self._result: GenerationResult | None = None
        self.start, self.first = time.perf_counter(), None
        self.done = False
        self._ended = threading.Event()  # set once the last item is queued

    # ---- the step loop's side -------------------------------------------------------------------
    def on_token(self, token: int, logprobs: dict | None = None) -> bool:
        """Queues the text the token completes; True when a stop string was hit (the text before it is
        queued and the request must end)."""
        if self.first is None:
            self.first = time.perf_counter()
        if self._pending_lp is not None and logprobs is not None:  # (None: a quiet row's, in seq.lp_log)
            self._pending_lp.append(logprobs)
        if self.keeps_ids:  # its ids are the sequence's output, read once at the end
            return False
        self._pending.append(token)  # ids travel with the next chunk that carries text
        if token in self.seq.eos:
            return False
        text = self._detok.step(token)
        if self._stops.stops:  # without stop strings feed() returns the text as it is
            text, hit = self._stops.feed(text)
            if hit:
                self._tail = text
                return True
        if text:
            self._emit(StreamChunk(text, self._pending, logprobs=self._take_lp()))
            self._pending = []
        return False

    def _emit(self, item) -> None:
        sink = self.sink
        if sink is None:
            self._chunks.put(item)
        else:
            sink.put(self, item)
            self._loop.dirty.add(sink)  # flushed once after this round of the loop

    def _take_lp(self) -> list[dict] | None:
        lp = self._pending_lp
        if lp is not None:
            self._pending_lp = []
        return lp

    def finish(self, reason: str) -> None:
        """Queues the last chunk. If that raises (the detokenizer, or the sink's put), the request is not
        done: the step loop ends it with fail(error)."""
        if self.done:
            return
        tail = self._tail
        if self.keeps_ids:  # one decode of every id but EOS (which never reaches the text, as in on_token)
            eos = self.seq.eos
            self._pending = ids = self.seq.output  # every token the core gave it (the step loop kept none)
            if eos and not eos.isdisjoint(ids):  # (a pass at C speed; the filter is Python's)
                ids = [t for t in ids if t not in eos]
            tail = self._detok.decode_all(ids, ints=True)  # (the core's tokens are Python ints)
            if self._pending_lp is not None:  # the arrays the core logged, copied out: the entries are built
                self._pending_lp = resolve(self._pending_lp, self.seq)  # when the caller reads them, not here
        elif tail is None:  # EOS, length or abort: a last partial character, then any held-back stop prefix
            tail, hit = self._stops.feed(self._detok.flush())
            tail += "" if hit else self._stops.flush()
            if self._stops.hit:
                reason = "stop"
        self._emit(set_lazy(StreamChunk(tail, self._pending, reason, self.usage(), self.timings()), self._take_lp()))
        self.done = True
        self._end()

    def _end(self) -> None:
        self.seq.lp_log = self.lps_kept = None  # (the logs' arrays are not held by a request kept after its end)
        if self.sink is None:
            self._chunks.put(_END)
        self._ended.set()

    def fail(self, error: BaseException) -> None:
        """Ends the request with `error`; never raises (a sink whose put raises cannot be told: logged)."""
        if self.done:
            return
        self.done = True
        try:
            self._emit(error)
        except Exception:
            log.exception("a chunk sink's put() raised while a request was given its error %r", error)
        finally:
            self._end()

    def usage(self) -> dict:
        s = self.seq
        return {"prompt_tokens": s.num_prompt, "completion_tokens": s.num_output,
                "cached_tokens": s.num_cached_prompt}

    def timings(self) -> dict:
        end = time.perf_counter()
        ttft = (self.first - self.start) if self.first else 0.0
        decode_s = end - self.first if self.first else 0.0
        n, prefilled = self.seq.num_output, self.seq.num_prompt - self.seq.num_cached_prompt
        return {"ttft_s": ttft, "prefill_tokens_per_s": prefilled / ttft if ttft > 0 else 0.0,
                "decode_tokens_per_s": (n - 1) / decode_s if decode_s > 0 and n > 1 else 0.0,
                "total_s": end - self.start}

    # ---- the caller's side ----------------------------------------------------------------------
    def __iter__(self):
        """Yields StreamChunks until the last one (with finish_reason); re-raises a step's error. Iterating
        again (or after result()) yields the same chunks again from the start."""
        if self.sink is not None:
            raise RuntimeError("this request's chunks go to the sink it was submitted with")
        i = 0
        while True:
            item = self._item(i)
            i += 1
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def _item(self, i: int):
        read = self._read
        if i < len(read):
            return read[i]
        with self._read_lock:  # two readers at once wait for the same next item, and both get it
            while len(read) <= i:
                read.append(self._chunks.get())
            return read[i]

    def result(self) -> GenerationResult:
        """The whole output, once the request ended; the same object on every call (or its error again)."""
        if self._result is not None:
            return self._result
        # Waits for the end once rather than waking for every chunk: a reader woken per token takes the
        # GIL from the step loop each time (at batch 1 that slowed decode measurably).
        self._ended.wait()
        text, ids, lps, last = [], [], [], None
        for chunk in self:
            text.append(chunk.text)
            ids.extend(chunk.token_ids)
            lps.append(raw_logprobs(chunk))  # entries not built yet (the last chunk's) are built when read
            last = chunk
        lps = None if self.seq.params.logprobs is None else (concat(lps) or [])
        self._result = set_lazy(GenerationResult("".join(text), ids, last.finish_reason, last.usage, last.timings),
                                lps)
        return self._result

    def abort(self) -> None:
        """Ends the request now (finish_reason "abort"); its blocks are freed before the next step."""
        self._loop.abort(self)
