"""Tensor parallelism across hosts (issue 30): `nnodes` processes (one per host, or several on one host), each
running tensor_parallel_size / nnodes ranks, joined through a TCP rendezvous at node 0's master_addr:port.

Node 0 keeps the only scheduler and step loop (and serves HTTP). Its runner is wrapped in a NodeProxy: each
call (step, launch, finish, logits, shift_kv) is first sent to every other node (engine/wire.py: arrays,
lists and numbers, never pickle), then run here; each follower runs it on its own ranks and answers with its
tokens or its error. The ranks' collectives join the nodes' math (NCCL from a unique id node 0 hands out; on
the CPU, TCP sockets: comm_socket.cpp), and every rank samples from the same gathered logits with the same
seeds, so the tokens agree by construction (the answers check that they do). A call that fails on every
node alike (a bad row) raises as it would at one node; one that fails on some nodes only, a node that does
not answer within tp_timeout_s, or a connection that closes breaks the group: the communicators are
aborted (ending waits in collectives), followers are told to exit, and node 0's engine fails (Engine.failure,
/health 503). A follower whose node 0 goes away aborts its ranks and exits with an error.
"""
from __future__ import annotations

import json
import queue
import socket
import sys
import threading
import time

from .. import _core
from .wire import WireError, recv_frame, send_frame

CALLS = ("step", "launch", "finish", "logits", "shift_kv")  # what a follower runs; nothing else
_CLOSED = object()


class NodeTimeout(TimeoutError, RuntimeError):
    """A node that did not join or answer in time (a RuntimeError too, so the CLI reports it plainly)."""

_RETRY_S = 0.2


def _log(node: "Node", text: str) -> None:
    if node.progress:
        print(f"llaisys: node {node.rank}/{node.nnodes}: {text}", file=sys.stderr, flush=True)


def _tune(sock: socket.socket, timeout_s: float) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a step's frame goes out at once
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.settimeout(timeout_s)
    return sock


def connect_retrying(addr: str, port: int, timeout_s: float, who: str) -> socket.socket:
    """A connection to addr:port, retried until timeout_s (node 0 may start later); TimeoutError names it."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            return socket.create_connection((addr, port), timeout=min(5.0, timeout_s))
        except OSError as e:
            last = e
            time.sleep(_RETRY_S)
    raise NodeTimeout(f"{who} could not reach node 0 at {addr}:{port} within {timeout_s:g} s ({last}): is node 0 "
                       f"started with the same --master-addr/--master-port, and reachable from here?")


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def hello_mismatch(mine: dict, theirs: dict, who: str) -> str | None:
    """What differs between node 0's hello and another's (naming the field), else None."""
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key)
        if key == "model_config" and a != b:
            ca, cb = json.loads(a), json.loads(b)
            field = next(k for k in sorted(set(ca) | set(cb)) if ca.get(k) != cb.get(k))
            return f"the model differs: config field {field!r} is {ca.get(field)!r} at node 0, {cb.get(field)!r} at {who}"
        if a != b:
            return f"{key} is {a!r} at node 0 but {b!r} at {who}: every node must be started with the same settings"
    return None


class Node:
    """This process's end of the connections between nodes (made by rendezvous())."""

    def __init__(self, rank: int, nnodes: int, local: int, world: int, timeout_s: float, progress: bool):
        self.rank, self.nnodes, self.local, self.world = rank, nnodes, local, world
        self.first_rank = rank * local  # the global rank of this node's first local rank
        self.timeout_s, self.progress = timeout_s, progress
        self.conns: dict[int, socket.socket] = {}  # node 0: each follower's; a follower: {0: node 0's}
        self.data_fds: list[int] = []  # CPU: the sockets the communicator takes over
        self.nccl_id: bytes | None = None
        self.comms: list = []
        self.inbox: dict[int, queue.Queue] = {}
        self.broken, self.closing = "", False
        self._lock = threading.Lock()
        self._send_locks: dict[int, threading.Lock] = {}
        self.fault = ""  # a follower's injected fault for its next call (tests)
        self._running: tuple[int, str | None] = (0, None)  # (call number, the call running here, or None)
        self._started = 0.0  # when the running call started (the watchdog's clock)

    # ---- the communicators and the KV pool's size -------------------------------------------------------

    def make_comms(self, devices: list[str]) -> list:
        """This node's ranks' communicators, joined with every other node's (blocks until all joined)."""
        if devices[0].startswith("cuda"):
            first = devices[0]
            done: dict = {}

            def init():
                try:
                    done["comms"] = _core.group_from_id(first, self.local, self.first_rank, self.world, self.nccl_id)
                except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                    done["error"] = e
            t = threading.Thread(target=init, daemon=True, name="llaisys-nccl-init")
            t.start()
            t.join(self.timeout_s)
            if t.is_alive():
                raise NodeTimeout(f"node {self.rank}: NCCL did not join the {self.world} ranks within "
                                   f"{self.timeout_s:g} s (a node that died, or GPUs that cannot reach each other)")
            if "error" in done:
                raise done["error"]
            self.comms = done["comms"]
        else:
            fds, self.data_fds = self.data_fds, []
            self.comms = [_core.socket_group(self.rank, self.world, fds, self.timeout_s)]
        return self.comms

    def agree_blocks(self, blocks: int) -> int:
        """The KV pool's block count every node gets: the fewest any node's ranks can hold (one block
        manager, at node 0, hands out block ids that must be valid everywhere)."""
        if self.rank > 0:
            self._send(0, ["blocks", int(blocks)])
            reply = self._recv_setup(0, "the KV pool's size")
            return int(reply[1])
        for k in self.conns:
            blocks = min(blocks, int(self._recv_setup(k, "the KV pool's size")[1]))
        for k in self.conns:
            self._send(k, ["blocks", blocks])
        return blocks

    def _recv_setup(self, k: int, what: str):
        try:
            msg = recv_frame(self.conns[k])
        except (OSError, WireError) as e:
            raise RuntimeError(f"node {self.rank}: no answer from node {k} about {what} ({e!r}): it failed or "
                               f"stalled while loading (its log says why)") from None
        if not isinstance(msg, list) or not msg or msg[0] != "blocks":
            raise RuntimeError(f"node {self.rank}: node {k} sent {msg!r:.80} instead of {what}")
        return msg

    def start(self) -> None:
        """After setup: a reader thread per connection (answers and closures are seen while a call runs)."""
        for k, conn in self.conns.items():
            self.inbox[k] = queue.Queue()
            threading.Thread(target=self._read, args=(k, conn), daemon=True, name=f"llaisys-node-{k}").start()
        threading.Thread(target=self._watch, daemon=True, name="llaisys-node-watchdog").start()

    def _watch(self) -> None:
        """A call of this node's that runs past the timeout (a peer that stalled, or died without its
        connection closing, while this node waits in a collective) breaks the group, which ends the wait."""
        while not self.closing and not self.broken:
            time.sleep(min(1.0, self.timeout_s / 4))
            call, name = self._running
            if name is not None and time.monotonic() - self._started > self.timeout_s and self._running == (call, name):
                self.fail(f"node {self.rank}'s {name} did not finish within {self.timeout_s:g} s (a node that "
                          f"stalled or died, e.g. in a collective)")

    def _begin(self, name: str) -> None:
        self._started = time.monotonic()
        self._running = (self._running[0] + 1, name)

    def _end(self) -> None:
        self._running = (self._running[0], None)

    # ---- faults and closing ---------------------------------------------------------------------------

    def fail(self, why: str) -> None:
        """Breaks the group: aborts this node's communicators and, at node 0, tells the followers to exit."""
        with self._lock:
            if self.broken:
                return
            self.broken = why
        for comm in self.comms:
            comm.abort(why)
        if self.rank == 0:
            for k in list(self.conns):
                try:
                    self._send(k, ["abort", why])
                except OSError:
                    pass

    def close(self) -> None:
        """Node 0: tells the followers to exit (cleanly); every node closes its connections."""
        self.closing = True
        self.comms = []  # the models hold theirs; this node's threads may outlive it until exit
        for k, conn in self.conns.items():
            if self.rank == 0 and not self.broken:
                try:
                    self._send(k, ["close"])
                except OSError:
                    pass
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def _send(self, k: int, msg) -> None:
        lock = self._send_locks.setdefault(k, threading.Lock())
        with lock:
            send_frame(self.conns[k], msg)

    def _read(self, k: int, conn: socket.socket) -> None:
        while True:
            try:
                msg = recv_frame(conn)
            except socket.timeout:
                continue  # idle: the connection stays until it closes
            except (OSError, WireError) as e:
                if not self.closing:
                    lost = ("its connection to node 0 closed (node 0 died or ended)" if self.rank > 0 else
                            f"node {k}'s connection closed (the process died or was stopped)")
                    self.fail(f"node {self.rank}: {lost}: {e!r}")
                self.inbox[k].put(_CLOSED)
                return
            if isinstance(msg, list) and msg and msg[0] == "error":
                self._fail_fast(k, msg)
            elif isinstance(msg, list) and len(msg) == 2 and msg[0] == "abort" and self.rank > 0:
                self.fail(f"node 0 broke the group: {msg[1]}")  # at once: this node may wait in a collective
            self.inbox[k].put(msg)

    # A follower failed while node 0 still runs the call: node 0 may wait in a collective for that node, which
    # will not come. After a grace (node 0 may just be slower to fail alike) the group breaks, which ends
    # the wait, as RankGroup fails fast within a process.
    GRACE_S = 2.0

    def _fail_fast(self, k: int, msg) -> None:
        call, name = self._running
        if name is None:
            return

        def check():
            if self._running == (call, name):
                self.fail(f"node {k} failed in {name} while node 0 still ran it: {msg[1]}")
        timer = threading.Timer(min(self.GRACE_S, self.timeout_s), check)
        timer.daemon = True
        timer.start()

    # ---- node 0: one call on every node ---------------------------------------------------------------

    def call(self, name: str, args: tuple, fn):
        if self.broken:
            raise RuntimeError(f"tensor-parallel group is broken: {self.broken}")
        self._begin(name)  # before sending: a follower's answer may come back at once (_fail_fast)
        try:
            for k in self.conns:
                self._send(k, ["call", name, list(args)])
        except OSError as e:
            self._end()
            self.fail(f"node 0 could not send {name} to a follower: {e!r}")
            raise RuntimeError(f"tensor-parallel group is broken: {self.broken}") from None
        error = result = None
        try:
            result = fn(*args)
        except Exception as e:  # noqa: BLE001 - compared with the followers' outcome below
            error = e
        finally:
            self._end()
        # every node finishes a call within the timeout from its start (as every rank of a RankGroup), and
        # gets a grace after this node's end, where this node's own wait (a collective's) used it up
        deadline = self._started + max(self.timeout_s, time.monotonic() - self._started + self.GRACE_S)
        answers = {k: self._answer(k, name, deadline) for k in self.conns}
        failed = {k: a[1] for k, a in answers.items() if a[0] != "ok"}
        if error is not None and len(failed) == len(answers) and set(failed.values()) == {_describe(error)}:
            raise error  # every node failed alike (a bad row): the group is fine, as at one node
        if error is None and not failed:
            for k, a in answers.items():
                if isinstance(result, list) and a[1] is not None and a[1] != result:
                    self.fail(f"nodes 0 and {k} sampled different tokens in {name} (their logits differ)")
                    raise RuntimeError(f"tensor-parallel group is broken: {self.broken}")
            return result
        if error is not None and failed:
            k = min(failed)
            self.fail(f"node {k} failed in {name}: {failed[k]}; node 0: {_describe(error)}")
        elif error is not None:
            self.fail(f"node 0 failed in {name} and node(s) {sorted(answers)} did not: {error}")
        else:
            k = min(failed)
            self.fail(f"node {k} failed in {name} and node 0 did not: {failed[k]}")
        raise RuntimeError(f"tensor-parallel group is broken: {self.broken}")

    def _answer(self, k: int, name: str, deadline: float):
        try:
            msg = self.inbox[k].get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            self.fail(f"node {k} did not finish {name} within {self.timeout_s:g} s (a node that stalled)")
            raise RuntimeError(f"tensor-parallel group is broken: {self.broken}") from None
        if msg is _CLOSED:
            raise RuntimeError(f"tensor-parallel group is broken: {self.broken}")
        if not (isinstance(msg, list) and len(msg) == 2 and msg[0] in ("ok", "error")):
            self.fail(f"node {k} answered {name} with {msg!r:.80}")
            raise RuntimeError(f"tensor-parallel group is broken: {self.broken}")
        return msg

    # ---- a follower: node 0's calls until it ends -----------------------------------------------------

    def follow(self, runner) -> None:
        """Runs node 0's calls on this node's runner until node 0 closes (returns) or the group breaks
        (RuntimeError saying why)."""
        _log(self, "following node 0's steps")
        while True:
            msg = self.inbox[0].get()
            if msg is _CLOSED:
                raise RuntimeError(f"tensor-parallel group is broken: {self.broken}")
            kind = msg[0] if isinstance(msg, list) and msg else None
            if kind == "close":
                _log(self, "node 0 closed: exiting")
                return
            if kind == "abort":  # _read has aborted this node's ranks already
                raise RuntimeError(f"tensor-parallel group is broken: {self.broken}")
            if kind == "fault":
                self.fault = str(msg[1])
                continue
            if kind != "call" or len(msg) != 3 or msg[1] not in CALLS or not isinstance(msg[2], list):
                self._send(0, ["error", f"node {self.rank}: not a call: {msg!r:.80}"])
                continue
            self._send(0, self._run(runner, msg[1], msg[2]))

    def _run(self, runner, name: str, args: list):
        fault, self.fault = self.fault, ""
        try:
            if fault == "exit":  # a process that dies mid-step (tests)
                import os
                os._exit(17)
            if fault == "raise":
                raise RuntimeError(f"injected fault at node {self.rank}")
            while fault == "stall" and not (self.broken or self.closing):  # until the group gives up on it
                time.sleep(0.05)
            self._begin(name)
            try:
                result = getattr(runner, name)(*args)
            finally:
                self._end()
            return ["ok", result if isinstance(result, list) else None]
        except Exception as e:  # noqa: BLE001 - node 0 decides what it means
            return ["error", _describe(e)]


class NodeProxy:
    """Node 0's runner: the methods of a Runner / RankGroup, each call run on every node (Node.call)."""

    def __init__(self, runner, node: Node):
        self._runner, self._node = runner, node

    def step(self, *args):
        return self._node.call("step", args, self._runner.step)

    def launch(self, *args):
        return self._node.call("launch", args, self._runner.launch)

    def finish(self):
        return self._node.call("finish", (), self._runner.finish)

    def logits(self, *args):
        return self._node.call("logits", args, self._runner.logits)

    def shift_kv(self, *args):
        return self._node.call("shift_kv", args, self._runner.shift_kv)

    def last_logits(self):
        return self._runner.last_logits()

    @property
    def launched(self) -> int:
        return 0 if self.broken else self._runner.launched

    @property
    def captured_batch_sizes(self):
        return self._runner.captured_batch_sizes

    @property
    def steps_sampled_in_graph(self):
        return self._runner.steps_sampled_in_graph

    @property
    def broken(self) -> str:
        return self._node.broken or getattr(self._runner, "broken", "")

    def inject_fault(self, rank: int, mode: str) -> None:
        """For fault tests: global rank `rank`'s next call raises / stalls (a local rank: RankGroup's), or
        at a follower 'raise', 'stall' (until the group breaks) or 'exit' (its process dies mid-step)."""
        node = rank // self._node.local
        if node == 0:
            return self._runner.inject_fault(rank, mode)
        if mode not in ("raise", "stall", "exit"):
            raise ValueError(f"a follower's fault is 'raise', 'stall' or 'exit', got {mode!r}")
        self._node._send(node, ["fault", mode])
