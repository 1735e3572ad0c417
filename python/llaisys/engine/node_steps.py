"""The step broadcast between nodes (engine/nodes.py): node 0's runner calls, run on every node.

Node 0 keeps the only scheduler and step loop (and serves HTTP). Its runner is wrapped in a NodeProxy: each
call (step, launch, finish, logits, shift_kv) is first sent to every other node (engine/wire.py: arrays,
lists and numbers, never pickle), then run here; each follower (follow()) runs it on its own ranks and
answers with its tokens or its error. Every rank samples from the same gathered logits with the same seeds,
so the tokens agree by construction (the answers check that they do). A call that fails on every node alike
(a bad row) raises as it would at one node and the group goes on; one that fails on some nodes only, a node
that does not answer within tp_timeout_s, or a closed connection breaks the group (Node.fail): node 0's
engine fails (Engine.failure, /health 503) and the followers exit with the reason.
"""
from __future__ import annotations

import os
import queue
import time

from .nodes import CLOSED, Node, _log, describe

CALLS = ("step", "launch", "finish", "logits", "shift_kv", "set_seen")  # what a follower runs; nothing else
# Calls that return nothing: once node 0's own call succeeded it goes on without the followers' answers, which
# are checked before the next call that returns something (a step's tokens) returns: a chained step's launch
# no longer waits for a round trip, and no token leaves node 0 before every earlier call was answered "ok".
UNANSWERED = ("launch", "set_seen")


class NodeProxy:
    """Node 0's runner: the methods of a Runner / RankGroup, each call run on every node first."""

    def __init__(self, runner, node: Node):
        self._runner, self._node = runner, node
        self._pending: list[tuple[str, float]] = []  # (name, start) of UNANSWERED calls whose answers wait

    def step(self, *args):
        return self._call("step", args, self._runner.step)

    def launch(self, *args):
        return self._call("launch", args, self._runner.launch)

    def finish(self):
        return self._call("finish", (), self._runner.finish)

    def logits(self, *args):
        return self._call("logits", args, self._runner.logits)

    def shift_kv(self, *args):
        return self._call("shift_kv", args, self._runner.shift_kv)

    def set_seen(self, *args):
        return self._call("set_seen", args, self._runner.set_seen)

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
        self._node.send(node, ["fault", mode])

    def _call(self, name: str, args: tuple, fn):
        node = self._node
        if node.broken:
            raise RuntimeError(f"tensor-parallel group is broken: {node.broken}")
        self._check_pending(wait=False)  # a follower's failed launch: broken now, before this call waits on it
        node.begin(name)  # before sending: a follower's answer may come back at once (_fail_fast)
        try:
            for k in node.conns:
                node.send(k, ["call", name, list(args)])
        except OSError as e:
            node.end()
            node.fail(f"node 0 could not send {name} to a follower: {e!r}")
            raise RuntimeError(f"tensor-parallel group is broken: {node.broken}") from None
        error = result = None
        try:
            result = fn(*args)
        except Exception as e:  # noqa: BLE001 - compared with the followers' outcome below
            error = e
        except BaseException:  # (KeyboardInterrupt): its answers are read with the next call's, in order
            self._pending.append((name, node.started))
            raise
        finally:
            node.end()
        if error is None and name in UNANSWERED:
            self._pending.append((name, node.started))
            return result
        self._check_pending(wait=True)  # the followers answer in call order: the earlier calls' answers first
        deadline = self._deadline(node.started)
        answers = {k: self._answer(k, name, deadline) for k in node.conns}
        failed = {k: a[1] for k, a in answers.items() if a[0] != "ok"}
        if error is not None and len(failed) == len(answers) and set(failed.values()) == {describe(error)}:
            raise error  # every node failed alike (a bad row): the group is fine, as at one node
        if error is None and not failed:
            for k, a in answers.items():
                if isinstance(result, list) and a[1] != result:  # (an answer without tokens is no agreement)
                    node.fail(f"nodes 0 and {k} sampled different tokens in {name} (their logits differ)")
                    raise RuntimeError(f"tensor-parallel group is broken: {node.broken}")
            return result
        if error is not None and failed:
            k = min(failed)
            node.fail(f"node {k} failed in {name}: {failed[k]}; node 0: {describe(error)}")
        elif error is not None:
            node.fail(f"node 0 failed in {name} and node(s) {sorted(answers)} did not: {error}")
        else:
            k = min(failed)
            node.fail(f"node {k} failed in {name} and node 0 did not: {failed[k]}")
        raise RuntimeError(f"tensor-parallel group is broken: {node.broken}")

    def _check_pending(self, wait: bool) -> None:
        """The followers' answers to the UNANSWERED calls node 0 went past (every one "ok", or the group breaks):
        all of them (wait, each within its call's timeout), or else those every follower has answered already
        (a failure one follower reported while another is still busy is seen by Node._fail_fast meanwhile)."""
        node = self._node
        while self._pending:
            name, started = self._pending[0]
            if not wait and any(node.inbox[k].empty() for k in node.conns):
                return
            deadline = self._deadline(started)
            answers = {k: self._answer(k, name, deadline) for k in node.conns}
            self._pending.pop(0)
            failed = {k: a[1] for k, a in answers.items() if a[0] != "ok"}
            if failed:
                k = min(failed)
                node.fail(f"node {k} failed in {name} and node 0 did not: {failed[k]}")
                raise RuntimeError(f"tensor-parallel group is broken: {node.broken}")

    def _deadline(self, started: float) -> float:
        """When the followers' answers to a call started at `started` are due: every node finishes a call within
        the timeout from its start (as every rank of a RankGroup), and gets a grace after now, where node 0's own
        wait (a collective's) used it up."""
        node = self._node
        return started + max(node.timeout_s, time.monotonic() - started + node.GRACE_S)

    def _answer(self, k: int, name: str, deadline: float):
        node = self._node
        try:
            msg = node.inbox[k].get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            node.fail(f"node {k} did not finish {name} within {node.timeout_s:g} s (a node that stalled)")
            raise RuntimeError(f"tensor-parallel group is broken: {node.broken}") from None
        if msg is CLOSED:
            raise RuntimeError(f"tensor-parallel group is broken: {node.broken}")
        if not (isinstance(msg, list) and (len(msg) == 2 and msg[0] in ("ok", "error") or
                                           len(msg) == 3 and msg[0] == "error")):
            node.fail(f"node {k} answered {name} with {msg!r:.80}")
            raise RuntimeError(f"tensor-parallel group is broken: {node.broken}")
        return msg


def follow(node: Node, runner) -> None:
    """Runs node 0's calls on this node's runner until node 0 closes (returns) or the group breaks
    (RuntimeError saying why)."""
    _log(node, "following node 0's steps")
    while True:
        msg = node.inbox[0].get()
        if msg is CLOSED:
            raise RuntimeError(f"tensor-parallel group is broken: {node.broken}")
        kind = msg[0] if isinstance(msg, list) and msg else None
        if kind == "close":
            _log(node, "node 0 closed: exiting")
            return
        if kind == "abort":  # _read has aborted this node's ranks already
            raise RuntimeError(f"tensor-parallel group is broken: {node.broken}")
        if kind == "fault":
            node.fault = str(msg[1])
            continue
        if kind != "call" or len(msg) != 3 or msg[1] not in CALLS or not isinstance(msg[2], list):
            node.send(0, ["error", f"node {node.rank}: not a call: {msg!r:.80}"])
            continue
        node.send(0, _run(node, runner, msg[1], msg[2]))


def _run(node: Node, runner, name: str, args: list):
    fault, node.fault = node.fault, ""
    try:
        if fault == "exit":  # a process that dies mid-step (tests)
            os._exit(17)
        if fault == "raise":
            raise RuntimeError(f"injected fault at node {node.rank}")
        while fault == "stall" and not (node.broken or node.closing):  # until the group gives up on it
            time.sleep(0.05)
        node.begin(name)
        try:
            result = getattr(runner, name)(*args)
        finally:
            node.end()
        return ["ok", result if isinstance(result, list) else None]
    except Exception as e:  # noqa: BLE001 - node 0 decides what it means
        return ["error", describe(e), name]  # the call's name: node 0 may be in a later one (an unanswered launch)
