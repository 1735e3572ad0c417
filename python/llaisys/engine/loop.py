"""The step loop: one background thread drives every request of an engine. Any thread may submit,
read and abort; the loop alone touches the scheduler, the KV pool and the model. Requests with a sink
(request.ChunkSink) have their chunks put there; each sink that got any is flushed once per round.

What one request does wrong ends that request alone: a row that makes a step fail (EngineCore._isolate),
an exception from its detokenizer, stop strings or sink's put(), and a sink whose flush() raises (its
requests end) never stop the loop or reach another request."""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

from .core import EngineCore
from .request import Request

log = logging.getLogger("llaisys.engine")


class _Broken(RuntimeError):
    """The loop's end after a rank failed or stalled (EngineCore.broken): expected, and logged once."""


class StepLoop:
    def __init__(self, core: EngineCore, max_queued: int):
        self.core, self.max_queued = core, max_queued
        self._cv = threading.Condition()
        self._incoming: list[Request] = []
        self._aborts: list[Request] = []
        self._calls: list[tuple] = []
        self._live: dict[int, Request] = {}  # seq_id -> request, while the core holds it
        self.dirty: set = set()  # sinks that got chunks this round (loop thread only; Request._emit adds)
        self._closed = False
        self._thread: threading.Thread | None = None

    def submit(self, req: Request) -> Request:
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is closed")
            if len(self._incoming) + len(self._live) >= self.max_queued:
                raise RuntimeError(f"too many requests in flight ({self.max_queued}, EngineConfig.max_queued_requests)")
            self._incoming.append(req)
            self._start()
            self._cv.notify()
        return req

    def abort(self, req: Request) -> None:
        with self._cv:
            if self._closed:
                return  # close() already ended every request
            self._aborts.append(req)
            self._cv.notify()

    def call(self, fn):
        """Runs fn() on the loop thread between steps (it may use the core) and returns its result."""
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._calls.append((fn, fut))
            self._start()
            self._cv.notify()
        return fut.result()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is None:
            self.core = None
        elif self._thread is not threading.current_thread():
            self._thread.join()

    def stats(self) -> dict:
        return self.call(lambda: self.core.stats())

    # ---- the loop thread ------------------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="llaisys-step-loop", daemon=True)
            self._thread.start()

    def _take(self):
        with self._cv:
            while not (self._incoming or self._aborts or self._calls or self._closed or self.core.has_work()):
                self._cv.wait()
            work = self._incoming, self._aborts, self._calls
            self._incoming, self._aborts, self._calls = [], [], []
            return work, self._closed

    def _flush(self) -> None:
        dirty, self.dirty = self.dirty, set()
        broken = []
        for sink in dirty:
            try:
                sink.flush()
            except Exception as e:  # the consumer's bug must not stop every other request
                log.exception("a chunk sink failed to flush: its running requests end")
                broken.append((sink, e))
        for sink, e in broken:  # what it was given may be lost: its requests end rather than go on with a gap
            for req in [r for r in self._live.values() if r.sink is sink]:
                self._fail(req, RuntimeError(f"this request's sink failed to flush: {e!r}"))

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # a bug in the loop itself: fail everyone rather than leave them waiting
            why = str(e) if isinstance(e, _Broken) else repr(e)
            with self._cv:
                self._closed = True
                waiting = self._incoming + list(self._live.values())
                self._live.clear()
                calls = self._calls
                self._incoming, self._calls = [], []
            for req in waiting:
                req.fail(RuntimeError(f"the engine's step loop failed: {why}"))
            for _, fut in calls:
                fut.set_exception(RuntimeError(f"the engine's step loop failed: {why}"))
            self._flush()
            # logged, not re-raised: a thread's uncaught exception prints a second, bare traceback to stderr
            if isinstance(e, _Broken):  # the step's traceback was logged already ("a step failed")
                log.error("the step loop ends: %s (Engine.failure says so too)", e)
            else:
                log.error("the step loop failed", exc_info=e)

    def _serve(self) -> None:
        while True:
            (incoming, aborts, calls), closed = self._take()
            for req in incoming:
                self._live[req.seq.seq_id] = req
                self.core.add(req.seq)
            for req in aborts:
                self._deliver(req, self._end, req, "abort")
            for fn, fut in calls:
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to the caller, who re-raises it
                    fut.set_exception(e)
            if closed:
                for req in list(self._live.values()):
                    req.fail(RuntimeError("engine is closed: this request was still running"))
                    self.core.finish(req.seq, "abort")
                self._live.clear()
                self.core = None  # handles the caller still holds must not keep the model alive
                self._flush()
                return
            if self.core.has_work():
                self._step()
            self._flush()

    def _end(self, req: Request, reason: str) -> None:
        if self._live.pop(req.seq.seq_id, None) is not None:
            self.core.finish(req.seq, reason)
            req.finish(reason)

    def _fail(self, req: Request, error: BaseException) -> None:
        """Ends req alone with `error` and frees its blocks (req.fail never raises)."""
        if self._live.pop(req.seq.seq_id, None) is not None:
            self.core.finish(req.seq, "error")
        req.fail(error)

    def _deliver(self, req: Request, fn, *args) -> None:
        """Runs one request's delivery (detokenizer, stop strings, its sink's put): what it raises ends
        that request, not the loop."""
        try:
            fn(*args)
        except Exception as e:
            log.exception("request %d failed while its output was delivered", req.seq.seq_id)
            self._fail(req, e)

    def _ended(self, req: Request, seq) -> None:
        """req after its last token: the core ended its sequence (EOS, length, an error)."""
        self._live.pop(seq.seq_id)
        if seq.error is not None:  # the core ended it with an error (a structured-output matcher's)
            req.fail(seq.error)
        else:
            req.finish(seq.finish_reason)

    def _step(self) -> None:
        try:
            produced, failed = self.core.step()
        except Exception as e:  # not one row's failure (those come back in `failed`): fail what it held
            log.exception("a step failed")
            for req in list(self._live.values()):
                if req.seq in self.core.scheduler.running:
                    self._fail(req, e)
            if self.core.broken:  # a rank failed or stalled: no later step can run, so the loop ends (Engine.failure)
                raise _Broken(f"tensor-parallel group is broken: {self.core.broken}") from e
            return
        for seq, error in failed:  # the core finished them; the others of the step went on
            req = self._live.pop(seq.seq_id, None)
            if req is not None:
                req.fail(error)
        live = self._live
        for seq, token, logprobs in produced:  # _deliver's isolation inlined: this runs per token per request
            req = live.get(seq.seq_id)
            if req is None:
                continue
            if req.keeps_ids and seq.finish_reason is None and req.first is not None:
                if logprobs is not None:  # a request read only at its end, mid-way: all there is to do
                    req.lps_kept.append(logprobs)  # (its ids are its sequence's output: Request.finish)
                continue
            try:
                if req.on_token(token, logprobs):
                    self._end(req, "stop")
                elif seq.finish_reason is not None:
                    self._ended(req, seq)
            except Exception as e:
                log.exception("request %d failed while its output was delivered", req.seq.seq_id)
                self._fail(req, e)
