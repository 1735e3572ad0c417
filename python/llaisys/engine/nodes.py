"""Tensor parallelism across hosts (issue 30): `nnodes` processes (one per host, or several on one host), each
running tensor_parallel_size / nnodes ranks, joined at node 0's master_addr:master_port (engine/rendezvous.py).

A Node is one process's end of the connections between nodes: the sockets (a reader thread per connection,
so an answer or a closed connection is seen at once, also while a call runs), the communicators its ranks
join, a watchdog, and the group's fault state. What travels over it, node 0's calls and the followers'
answers, is engine/node_steps.py's. Breaking the group (fail) aborts this node's communicators, which ends
waits in collectives; node 0 then tells the followers to exit.
"""
from __future__ import annotations

import queue
import socket
import sys
import threading
import time

from .. import _core
from .wire import WireError, recv_frame, send_frame

CLOSED = object()  # what a reader thread puts in its inbox when its connection closed


class NodeTimeout(TimeoutError, RuntimeError):
    """A node that did not join or answer in time (a RuntimeError too, so the CLI reports it plainly)."""


def _log(node: "Node", text: str) -> None:
    if node.progress:
        print(f"llaisys: node {node.rank}/{node.nnodes}: {text}", file=sys.stderr, flush=True)


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


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
        self.running: tuple[int, str | None] = (0, None)  # (call number, the call running here, or None)
        self.started = 0.0  # when the running call started (the watchdog's clock)

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
            self.send(0, ["blocks", int(blocks)])
            reply = self._recv_setup(0, "the KV pool's size")
            return int(reply[1])
        for k in self.conns:
            blocks = min(blocks, int(self._recv_setup(k, "the KV pool's size")[1]))
        for k in self.conns:
            self.send(k, ["blocks", blocks])
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
            call, name = self.running
            if name is not None and time.monotonic() - self.started > self.timeout_s and self.running == (call, name):
                self.fail(f"node {self.rank}'s {name} did not finish within {self.timeout_s:g} s (a node that "
                          f"stalled or died, e.g. in a collective)")

    def begin(self, name: str) -> None:
        self.started = time.monotonic()
        self.running = (self.running[0] + 1, name)

    def end(self) -> None:
        self.running = (self.running[0], None)

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
                    self.send(k, ["abort", why])
                except OSError:
                    pass

    def close(self) -> None:
        """Node 0: tells the followers to exit (cleanly); every node closes its connections."""
        self.closing = True
        self.comms = []  # the models hold theirs; this node's threads may outlive it until exit
        for k, conn in self.conns.items():
            if self.rank == 0 and not self.broken:
                try:
                    self.send(k, ["close"])
                except OSError:
                    pass
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def send(self, k: int, msg) -> None:
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
                self.inbox[k].put(CLOSED)
                return
            if isinstance(msg, list) and msg == ["close"] and self.rank > 0:
                # node 0 ended cleanly: the end of its connection that follows is no failure. Marked here, not
                # by the main thread after it reads the message: the failure path would call into the
                # communicators (GIL released) from this daemon thread while the process exits, and a thread
                # taking the GIL back during finalization ends in std::terminate (CI: "terminate called
                # without an active exception" from a follower that had logged "node 0 closed: exiting")
                self.closing = True
            elif isinstance(msg, list) and msg and msg[0] == "error":
                self._fail_fast(k, msg)
            elif isinstance(msg, list) and len(msg) == 2 and msg[0] == "abort" and self.rank > 0:
                self.fail(f"node 0 broke the group: {msg[1]}")  # at once: this node may wait in a collective
            self.inbox[k].put(msg)

    # A follower failed while node 0 still runs the call: node 0 may wait in a collective for that node, which
    # will not come. After a grace (node 0 may just be slower to fail alike) the group breaks, which ends
    # the wait, as RankGroup fails fast within a process.
    GRACE_S = 2.0

    def _fail_fast(self, k: int, msg) -> None:
        call, name = self.running
        if name is None:
            return

        theirs = msg[2] if len(msg) > 2 else name  # the follower's call: an unanswered launch's error comes later

        def check():
            if self.running == (call, name):
                ran = "it" if theirs == name else name
                self.fail(f"node {k} failed in {theirs} while node 0 still ran {ran}: {msg[1]}")
        timer = threading.Timer(min(self.GRACE_S, self.timeout_s), check)
        timer.daemon = True
        timer.start()
