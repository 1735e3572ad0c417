"""The engine in a process of its own, for the HTTP server: EngineProcess starts an Engine (model, step loop,
detokenizer, stop strings) in a child process and is, to the server, what the Engine is (submit with a
sink, abort, score, stats, tokenize, render_chat and the config values).

Why: in one process the server's event loop (HTTP, SSE writes) and the engine's step loop (scheduling,
detokenizing every token of every request) share one GIL; at hundreds of streams each slows the other.
Here the child's step loop sends one message per step (every new chunk of every request, pickled once) and
a receiver thread of the server turns it into one put() per chunk and one flush() per sink, exactly as the
in-process step loop does, so the server's delivery (server/backend.py StreamHub) is the same in both modes.

The child is started with multiprocessing's 'spawn' context: a fresh interpreter (no fork of a process that
has threads, or a CUDA context, to copy), with Connection objects that frame and pickle messages, and the
parent's sys.path. Two one-way pipes:

    parent -> child   ("submit", rid, ids, sampling, incremental) ("abort", rid) ("call", cid, name, args) ("close",)
    child -> parent   ("ready", info) | ("failed", exc)  first; then ("chunks", [(rid, chunk or exc), ...])
                      once per step, and ("reply", cid, ok, value)

submit() checks what Engine.submit checks (prompt ids, sampling values, that the request can ever fit, the
queue limit) in the parent, with the same messages, and does not wait for the child: it costs the event
loop one pipe write. A child that dies (or is killed) ends every running request with a RuntimeError,
fails pending calls, and `closed` becomes true; a parent that dies closes the pipe, and the child closes
its engine and exits. The child ignores SIGINT: Ctrl-C in a terminal reaches the whole process group, and
the parent decides how to shut down (close() asks the child to close, then terminates it if it must).
"""
from __future__ import annotations

import itertools
import logging
import multiprocessing
import queue
import threading
from concurrent.futures import Future

from .admission import Admission
from .core import EngineCore
from .logprobs_log import set_lazy
from .process_child import child_main
from .request import StreamChunk, check_incremental, check_sink

log = logging.getLogger("llaisys.engine")

CLOSE_TIMEOUT_S = 30.0  # how long close() waits for the child to close its engine before terminating it


class _Limits:
    """What EngineCore.check_fits reads, sent by the child once."""

    check_window = EngineCore.check_window
    check_fits = EngineCore.check_fits

    def __init__(self, max_seq_len: int, capacity_tokens: int, block_size: int):
        self.max_seq_len = max_seq_len
        self.blocks = type("Blocks", (), {"capacity_tokens": capacity_tokens})()
        self.config = type("Config", (), {"block_size": block_size})()


class RemoteRequest:
    """The parent's handle of a request running in the child: abort() it; `done` once its last item came.
    Without a sink its chunks are read by iterating it (as an in-process Request)."""

    def __init__(self, client: "EngineProcess", rid: int, sink):
        self._client, self.rid = client, rid
        self._queue = queue.SimpleQueue() if sink is None else None
        self.sink = sink if sink is not None else _QueueSink(self._queue)
        self.done = False

    def abort(self) -> None:
        if not self.done:
            self._client._send(("abort", self.rid), quiet=True)

    def __iter__(self):
        if self._queue is None:
            raise RuntimeError("this request's chunks go to the sink it was submitted with")
        while True:
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return


class _QueueSink:
    def __init__(self, q: queue.SimpleQueue):
        self.q = q

    def put(self, req, item) -> None:
        self.q.put(item)

    def flush(self) -> None:
        pass


class EngineProcess:
    """An Engine running in a child process. Takes Engine's arguments; raises what Engine() raises (its
    type and message) when the child fails to load the model."""

    def __init__(self, model: str, device: str = "auto", dtype: str = "auto", max_seq_len: int | None = None,
                 progress: bool = True, **settings):
        ctx = multiprocessing.get_context("spawn")
        cmd_recv, self._cmd = ctx.Pipe(duplex=False)
        self._out, out_send = ctx.Pipe(duplex=False)
        kwargs = dict(device=device, dtype=dtype, max_seq_len=max_seq_len, progress=progress, **settings)
        self._proc = ctx.Process(target=child_main, args=(cmd_recv, out_send, model, kwargs),
                                 name="llaisys-engine-core", daemon=True)
        self._proc.start()
        cmd_recv.close()  # else the parent's copies keep the pipes open after the child is gone: no EOF
        out_send.close()
        self._send_lock = threading.Lock()
        self._live: dict[int, RemoteRequest] = {}
        self._calls: dict[int, Future] = {}
        self._ids = itertools.count()
        self._closing = False
        self.failure: str | None = None  # why the child is gone, when it went by itself
        try:
            kind, info = self._out.recv()
        except (EOFError, OSError):
            self._proc.join()
            raise RuntimeError(f"the engine process exited while loading the model (exit code "
                               f"{self._proc.exitcode})") from None
        except BaseException:  # Ctrl-C while loading: the child ignores SIGINT, so end it here
            self._proc.kill()
            self._proc.join()
            raise
        if kind == "failed":
            self._proc.join()
            raise info
        self._limits = _Limits(info["max_seq_len"], info.pop("capacity_tokens"), info["engine_config"].block_size)
        for k, v in info.items():
            setattr(self, k, v)
        # the parent's checks are the Engine's own (engine/admission.py), on the values the child sent
        self._admit = Admission(self.tokenizer, self.config, self.generation_config, self.chat_template,
                                self.source, self.max_seq_len, self.engine_config)
        self._receiver = threading.Thread(target=self._receive, name="llaisys-engine-receiver", daemon=True)
        self._receiver.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def closed(self) -> bool:
        return self._closing or self.failure is not None

    # ---- Engine's interface, as the server uses it ------------------------------------------------
    def submit(self, prompt, sink=None, incremental: bool = True, **sampling) -> RemoteRequest:
        """Engine.submit in the child; the errors Engine.submit raises for this request are raised here.
        incremental=False: the child sends the request's one last chunk only (Engine.submit's doc)."""
        check_sink(sink)
        check_incremental(incremental)
        ids = self._admit.encode(prompt)
        self._open()
        self._admit.checked(ids, self._admit.params("submit", sampling), self._limits)
        with self._send_lock:  # the queue check and the send, as one: the limit holds under concurrency
            if self.closed:
                raise RuntimeError("the engine is closed")
            queued = self.engine_config.max_queued_requests
            if len(self._live) >= queued:
                raise RuntimeError(f"too many requests in flight ({queued}, EngineConfig.max_queued_requests)")
            rid = next(self._ids)
            req = self._live[rid] = RemoteRequest(self, rid, sink)
            try:
                self._cmd.send(("submit", rid, ids, sampling, incremental))
            except (OSError, ValueError):
                del self._live[rid]
                raise RuntimeError("the engine process is not running") from None
        return req

    def tokenize(self, prompt) -> list[int]:
        return self._admit.tokenize(prompt)

    def render_chat(self, messages, add_generation_prompt: bool = True, tools: list | None = None) -> list[int]:
        return self._admit.render_chat(messages, add_generation_prompt, tools)

    def score(self, token_ids, kv_window=None, sink_tokens=None):
        return self._call("score", list(token_ids), kv_window, sink_tokens)

    def stats(self) -> dict:
        return self._call("stats")

    def describe(self) -> dict:
        return self._call("describe")

    def _open(self):
        if self.closed:
            raise RuntimeError("engine is closed: create a new Engine to generate again")

    def close(self) -> None:
        """Asks the child to close its engine (running requests end with an error) and waits for it to
        exit; terminates (then kills) it when it does not within CLOSE_TIMEOUT_S. Closing twice is fine."""
        if self._closing:
            return
        self._closing = True
        self._send(("close",), quiet=True)
        self._proc.join(CLOSE_TIMEOUT_S)
        if self._proc.exitcode is None:
            log.warning("the engine process did not exit in %.0f s: terminating it", CLOSE_TIMEOUT_S)
            self._proc.terminate()
            self._proc.join(5)
            if self._proc.exitcode is None:
                self._proc.kill()
                self._proc.join()
        self._receiver.join(10)
        self._cmd.close()

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ---------------------------------------------------------------------------------
    def _send(self, msg, quiet: bool = False) -> None:
        try:
            with self._send_lock:
                self._cmd.send(msg)
        except (OSError, ValueError):  # the child is gone (or the pipe closed): the receiver tells why
            if not quiet:
                raise RuntimeError("the engine process is not running") from None

    def _call(self, name: str, *args):
        if self.closed:
            raise RuntimeError("engine is closed: create a new Engine to generate again")
        fut: Future = Future()
        cid = next(self._ids)
        self._calls[cid] = fut
        try:
            self._send(("call", cid, name, args))
        except RuntimeError:
            self._calls.pop(cid, None)
            raise
        if self.closed and self._calls.pop(cid, None) is not None:  # the receiver ended before it was put
            raise RuntimeError("the engine process is not running")
        return fut.result()

    def _receive(self) -> None:
        """The receiver thread: one message per step becomes one put() per item and one flush() per sink."""
        live, calls = self._live, self._calls
        try:
            while True:
                msg = self._out.recv()
                if msg[0] == "chunks":
                    dirty = set()
                    for rid, item in msg[1]:
                        req = live.get(rid)
                        if req is None:
                            continue
                        if type(item) is tuple:
                            item = set_lazy(StreamChunk(*item[:5]), item[5])  # (a Pending: built when read)
                            if item.finish_reason is not None:
                                req.done = True
                                del live[rid]
                        else:  # the exception that ended it
                            req.done = True
                            del live[rid]
                        self._put(req, item, dirty)
                    self._flush(dirty)
                elif msg[0] == "failed":  # the child's engine can run no more steps (Engine.failure)
                    self.failure = msg[1]
                    log.error("the engine failed: %s", msg[1])
                elif msg[0] == "reply":
                    _, cid, ok, value = msg
                    fut = calls.pop(cid, None)
                    if fut is not None:
                        (fut.set_result if ok else fut.set_exception)(value)
        except (EOFError, OSError):
            pass
        except Exception as e:  # a message that cannot be read: nothing after it can be trusted
            log.exception("the engine process's message could not be read")
            self.failure = f"a message from the engine process could not be read ({e!r})"
        self._proc.join(1.0 if self._closing else 10.0)
        if not self._closing and self.failure is None:
            self.failure = f"the engine process exited (exit code {self._proc.exitcode})"
            log.error("%s: running requests fail", self.failure)
        why = self.failure or "engine is closed"
        with self._send_lock:  # from here submit() sees `closed` and adds nothing more to _live
            self._closing = self._closing or self.failure is None
            reqs, calls_left = list(live.values()), list(calls.values())
            live.clear()
            calls.clear()
        dirty = set()
        for req in reqs:
            req.done = True
            self._put(req, RuntimeError(f"{why}: this request was still running"), dirty)
        self._flush(dirty)
        for fut in calls_left:
            fut.set_exception(RuntimeError(why))

    def _put(self, req: RemoteRequest, item, dirty: set) -> None:
        """One item into its request's sink; a sink that raises ends that request alone (as the step loop
        does in process), never the receiver."""
        try:
            req.sink.put(req, item)
            dirty.add(req.sink)
        except Exception as e:
            log.exception("a chunk sink's put() raised: its request ends")
            self._end(req, RuntimeError(f"this request's sink raised in put(): {e!r}"), dirty)

    def _end(self, req: RemoteRequest, error: BaseException, dirty: set) -> None:
        """Ends req in the parent (and in the child, if it runs there yet) and tries to give it `error`."""
        self._live.pop(req.rid, None)
        if not req.done:
            req.done = True
            self._send(("abort", req.rid), quiet=True)
        try:
            req.sink.put(req, error)
            dirty.add(req.sink)
        except Exception:
            log.exception("a chunk sink's put() raised while its request was given its error")

    def _flush(self, sinks) -> None:
        broken = set()
        for sink in sinks:
            try:
                sink.flush()
            except Exception as e:  # what it was given may be lost: its requests end rather than go on with a gap
                log.exception("a chunk sink failed to flush: its running requests end")
                for req in [r for r in list(self._live.values()) if r.sink is sink]:
                    self._end(req, RuntimeError(f"this request's sink failed to flush: {e!r}"), broken)
        for sink in broken:  # one more try, to hand over the errors
            try:
                sink.flush()
            except Exception:
                log.exception("a chunk sink failed to flush again")
