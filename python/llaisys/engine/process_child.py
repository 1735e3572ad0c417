"""The child side of EngineProcess (engine/process.py, whose docstring describes the protocol): an Engine in a
spawned process, a command loop reading the parent's pipe, and one ("chunks", ...) message per step."""
from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor

from .engine import Engine
from .logprobs_log import raw_logprobs


class _BatchSink:
    """The child's ChunkSink for every request: a flush sends what the step put, as one message."""

    def __init__(self, out, out_lock: threading.Lock):
        self.out, self.out_lock = out, out_lock
        self.lock = threading.Lock()  # rids and reqs: the command thread adds, the step loop removes
        self.rids: dict = {}  # Request -> rid
        self.reqs: dict[int, object] = {}  # rid -> Request
        self.items: list = []

    def put(self, req, item) -> None:
        self.items.append((req, item))

    def flush(self) -> None:
        items, self.items = self.items, []
        batch = []
        with self.lock:
            for req, item in items:
                rid = self.rids.get(req)
                if isinstance(item, BaseException):
                    batch.append((rid, _picklable(item)))
                    last = True
                else:
                    # (logprobs not built yet go as their arrays, built in the parent when read: logprobs_log.Pending)
                    batch.append((rid, (item.text, item.token_ids, item.finish_reason, item.usage, item.timings,
                                        raw_logprobs(item))))
                    last = item.finish_reason is not None
                if last:
                    del self.rids[req]
                    del self.reqs[rid]
        self.send(("chunks", batch))

    def send(self, msg) -> None:
        with self.out_lock:
            self.out.send(msg)


def _picklable(e: BaseException) -> BaseException:
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def child_main(cmd, out, model: str, kwargs: dict) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides (see the module's docstring)
    out_lock = threading.Lock()
    try:
        eng = Engine(model, **kwargs)
    except BaseException as e:
        out.send(("failed", _picklable(e)))
        return
    info = dict(source=eng.source, config=eng.config, tokenizer=eng.tokenizer, chat_template=eng.chat_template,
                generation_config=eng.generation_config, engine_config=eng.engine_config,
                max_seq_len=eng.max_seq_len, device=eng.device, dtype=eng.dtype,
                capacity_tokens=eng._core.blocks.capacity_tokens)
    out.send(("ready", info))
    sink = _BatchSink(out, out_lock)
    workers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="llaisys-engine-call")
    calls = {"score": eng.score, "stats": eng.stats, "describe": eng.describe}
    stop = threading.Event()

    def watch():  # an engine that breaks (Engine.failure) is reported once, so the server's /health says so
        while not stop.wait(0.5):
            if eng.failure:
                try:
                    sink.send(("failed", eng.failure))
                except (OSError, ValueError):
                    pass
                return

    threading.Thread(target=watch, name="llaisys-engine-watch", daemon=True).start()

    def run_call(cid, name, args):
        try:
            value, ok = calls[name](*args), True
        except BaseException as e:
            value, ok = _picklable(e), False
        try:
            sink.send(("reply", cid, ok, value))
        except (OSError, ValueError):
            pass

    try:
        while True:
            try:
                msg = cmd.recv()
            except (EOFError, OSError):  # the parent is gone
                break
            kind = msg[0]
            if kind == "submit":
                _, rid, ids, sampling, incremental = msg
                with sink.lock:  # a step may put this request's chunks before it is named: flush waits
                    try:
                        req = eng.submit(ids, sink=sink, incremental=incremental, **sampling)
                    except Exception as e:  # the parent checked what Engine.submit checks: a race, or a bug
                        error = _picklable(e)
                    else:
                        sink.rids[req], sink.reqs[rid], error = rid, req, None
                if error is not None:
                    sink.send(("chunks", [(rid, error)]))
            elif kind == "abort":
                req = sink.reqs.get(msg[1])
                if req is not None:
                    req.abort()
            elif kind == "call":
                workers.submit(run_call, *msg[1:])
            elif kind == "close":
                break
    finally:
        stop.set()
        workers.shutdown(wait=True)
        eng.close()  # running requests end with an error, flushed through the sink
