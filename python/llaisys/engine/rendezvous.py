"""The nodes' rendezvous (engine/nodes.py): node 0 listens on master_addr:master_port; every other node
connects (retrying until tp_timeout_s: nodes start in any order) and sends a hello of the settings that must
agree (version, sizes, dtype, the model's config). Node 0 checks each against its own (a mismatch is
refused with the field named, on both sides), then welcomes them all with what the communicators need: NCCL's
unique id on CUDA; on the CPU each follower then opens a second connection that its socket communicator
takes over."""
from __future__ import annotations

import socket
import time

from .. import _core
from .nodes import Node, NodeTimeout, _log, _tune, connect_retrying, hello_mismatch
from .wire import WireError, recv_frame, send_frame


def rendezvous(config, hello: dict, device: str, progress: bool) -> Node:
    """This node, connected to the others (EngineConfig's nnodes, node_rank, master_addr/port, tp_timeout_s)."""
    local = config.tensor_parallel_size // config.nnodes
    node = Node(config.node_rank, config.nnodes, local, config.tensor_parallel_size, config.tp_timeout_s, progress)
    cuda = device.startswith("cuda")
    if node.rank == 0:
        _lead(node, config, hello, cuda)
    else:
        _join(node, config, hello, cuda)
    return node


def _lead(node: Node, config, hello: dict, cuda: bool) -> None:
    addr, port, t = config.master_addr, config.master_port, config.tp_timeout_s
    try:
        listener = socket.create_server((addr, port), reuse_port=False)
    except OSError as e:
        raise RuntimeError(f"node 0 cannot listen on {addr}:{port} for the other nodes: {e.strerror or e} "
                           f"(choose another --master-port, or an address of this host)") from None
    _log(node, f"waiting for {node.nnodes - 1} node(s) at {addr}:{port}")
    deadline = time.monotonic() + t
    try:
        listener.settimeout(1.0)
        pending = set(range(1, node.nnodes))
        while pending:
            conn = _accept(listener, deadline, node, pending, addr, port)
            msg = _first_frame(conn)
            k = msg[1] if len(msg) == 3 and msg[0] == "hello" and isinstance(msg[1], int) else None
            why = ("not a hello" if k is None else f"node rank {k} is not one of the nodes still awaited "
                   f"{sorted(pending)}" if k not in pending else hello_mismatch(hello, msg[2], f"node {k}"))
            if why:
                _refuse(conn, why)
                raise ValueError(f"node 0 refused a node that connected to {addr}:{port}: {why}")
            node.conns[k] = _tune(conn, t)
            pending.discard(k)
            _log(node, f"node {k} joined")
        node.nccl_id = _core.nccl_unique_id() if cuda else None
        for k in node.conns:
            send_frame(node.conns[k], ["welcome", {"nccl_id": node.nccl_id}])
        if not cuda:  # each follower's communicator connection, in rank order for the socket group
            fds = {}
            while len(fds) < node.nnodes - 1:
                conn = _accept(listener, deadline, node, set(range(1, node.nnodes)) - set(fds), addr, port)
                msg = _first_frame(conn)
                if not (len(msg) == 2 and msg[0] == "comm" and msg[1] in node.conns and msg[1] not in fds):
                    _refuse(conn, f"expected a follower's communicator connection, got {msg!r:.80}")
                    raise ValueError(f"node 0: a connection to {addr}:{port} that is not a node's ({msg!r:.80})")
                fds[msg[1]] = _tune(conn, None).detach()
            node.data_fds = [-1] + [fds[k] for k in range(1, node.nnodes)]
    finally:
        listener.close()


def _accept(listener, deadline: float, node: Node, pending: set, addr: str, port: int) -> socket.socket:
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise NodeTimeout(f"node 0 waited {node.timeout_s:g} s at {addr}:{port} for node(s) {sorted(pending)}, "
                               f"which never connected (start each with --nnodes {node.nnodes} --node-rank K "
                               f"--master-addr {addr} --master-port {port})")
        try:
            conn, _ = listener.accept()
            conn.settimeout(min(10.0, max(left, 0.1)))
            return conn
        except socket.timeout:
            continue


def _first_frame(conn: socket.socket) -> list:
    try:
        msg = recv_frame(conn)
    except (OSError, WireError) as e:
        conn.close()
        raise ValueError(f"node 0: a connection sent no valid first frame ({e!r}): something other than a "
                         f"llaisys node connected to the master port?") from None
    return msg if isinstance(msg, list) and msg else [None]


def _refuse(conn: socket.socket, why: str) -> None:
    try:
        send_frame(conn, ["refused", why])
    except OSError:
        pass
    conn.close()


def _join(node: Node, config, hello: dict, cuda: bool) -> None:
    addr, port, t = config.master_addr, config.master_port, config.tp_timeout_s
    who = f"node {node.rank}"
    conn = _tune(connect_retrying(addr, port, t, who), t)
    send_frame(conn, ["hello", node.rank, hello])
    try:
        msg = recv_frame(conn)
    except (OSError, WireError) as e:
        raise RuntimeError(f"{who}: node 0 at {addr}:{port} closed the rendezvous without an answer ({e!r}): "
                           f"its log says why (another node refused?)") from None
    if isinstance(msg, list) and msg and msg[0] == "refused":
        raise ValueError(f"{who}: node 0 refused this node: {msg[1]}")
    if not (isinstance(msg, list) and len(msg) == 2 and msg[0] == "welcome" and isinstance(msg[1], dict)):
        raise RuntimeError(f"{who}: node 0 answered the hello with {msg!r:.80}")
    node.conns[0] = conn
    node.nccl_id = msg[1].get("nccl_id")
    if not cuda:
        data = connect_retrying(addr, port, t, who)
        send_frame(data, ["comm", node.rank])
        node.data_fds = [_tune(data, None).detach()]
    _log(node, f"joined node 0 at {addr}:{port}")
