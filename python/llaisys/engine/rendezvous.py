"""The nodes' rendezvous (engine/nodes.py): node 0 listens on master_addr:master_port; every other node
connects (retrying until tp_timeout_s: nodes start in any order) and sends a hello of the settings that must
agree (version, sizes, dtype, the model's config). Node 0 checks each against its own (a mismatch is
refused with the field named, on both sides), then welcomes them all with what the communicators need: NCCL's
unique id on CUDA; on the CPU each follower then opens a second connection that its socket communicator
takes over."""
from __future__ import annotations

import errno
import json
import socket
import time

from .. import _core
from .nodes import Node, NodeTimeout, _log
from .wire import WireError, recv_frame, send_frame


_RETRY_S = 0.2


def _tune(sock: socket.socket, timeout_s: float | None) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a step's frame goes out at once
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.settimeout(timeout_s)
    return sock


def connect_retrying(addr: str, port: int, timeout_s: float, who: str) -> socket.socket:
    """A connection to addr:port, retried until timeout_s (node 0 may start later); NodeTimeout names it."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            return socket.create_connection((addr, port), timeout=min(5.0, timeout_s))
        except OSError as e:
            last = e
            time.sleep(_RETRY_S)
    raise NodeTimeout(f"{who} could not reach node 0 at {addr}:{port} within {timeout_s:g} s ({last}): is node 0 "
                      f"started with the same --master-addr/--master-port, and reachable from here?")


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


def engine_hello(ec, dtype: str, quantized: bool, device: str, max_seq_len: int, model_config: dict) -> dict:
    """What every node must agree on (hello_mismatch compares it with node 0's)."""
    return {"version": _core.build_info()["version"], "nnodes": ec.nnodes,
            "tensor_parallel_size": ec.tensor_parallel_size, "dtype": dtype, "quantized": quantized,
            "device_type": device.split(":")[0], "max_seq_len": max_seq_len,
            "block_size": ec.block_size, "graph_sizes": list(ec.graph_sizes), "cuda_graphs": ec.cuda_graphs,
            "fused_projections": ec.fused_projections,
            "model_config": json.dumps(model_config, sort_keys=True, default=str)}


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
        try:
            listener = socket.create_server((addr, port))
        except OSError as e:  # an address the others reach but this host does not own (NAT): every interface
            if e.errno != errno.EADDRNOTAVAIL:
                raise
            listener = socket.create_server(("", port))
            _log(node, f"{addr} is not an address of this host: listening on every interface, port {port}")
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
