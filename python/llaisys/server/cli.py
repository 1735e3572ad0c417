"""`llaisys serve`: the OpenAI-compatible server on uvicorn. llaisys/cli.py adds the subcommand with
add_serve_parser(sub) and the command runs run_serve(args). FastAPI and uvicorn are imported only when
the server starts (pip install 'llaisys[serve]').

Every argument is checked, and the listening socket bound, before the model is read: a wrong value exits 2
and a port in use (or a host that cannot be bound) exits 3, uvicorn's startup-failure code, in about a
second instead of after the load. The bound socket is handed to uvicorn, so no other process can take the
port while the model loads; until uvicorn starts, connections to it are refused."""
from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import socket
import sys

from ..cli import _whole_at_least as _int_at_least  # one argparse type for both CLIs

SERVE_EPILOG = """\
examples:
  llaisys serve                                   the default model on http://127.0.0.1:8000/v1
  llaisys serve --model ./Qwen2.5-0.5B-Instruct --port 9000 --api-key secret
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"model": "qwen2.5-coder-0.5b-instruct", "messages": [{"role": "user", "content": "Hi"}]}'
The API key defaults to $LLAISYS_API_KEY; /health and /metrics need none."""


ENGINE_PROCESS = True  # the default of --engine-process (docs/ARCHITECTURE.md, "Serving over HTTP", has why)
EXIT_STARTUP_FAILURE = 3  # uvicorn's code for a server that could not start (e.g. the port is in use)


def _device(text: str) -> str:
    if re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        return text
    raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              formatter_class=argparse.RawDescriptionHelpFormatter, epilog=SERVE_EPILOG,
                              description="Serve a model at /v1/chat/completions, /v1/completions and "
                                          "/v1/models (OpenAI's API), with /health and /metrics (Prometheus).")
    p.add_argument("--model", "-m", metavar="M", help="catalog name, HF model directory, .gguf file or HF repo "
                   "id (default: the catalog's default model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_int_at_least(0), default=8000, help="port (default 8000)")
    p.add_argument("--device", default="auto", type=_device, metavar="DEV", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "quantized", "bf16", "f16", "f32"], help="as for llaisys generate (default auto)")
    p.add_argument("--max-seq-len", type=_int_at_least(2), metavar="N", help="context per sequence (default: "
                   "up to 8192)")
    p.add_argument("--api-key", default=os.environ.get("LLAISYS_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $LLAISYS_API_KEY, else none)")
    p.add_argument("--served-model-name", metavar="NAME", help="the model name clients send (default: --model)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=ENGINE_PROCESS,
                   help="run the engine (model, step loop, detokenizer) in a process of its own, so that HTTP "
                        "and the step loop do not share one GIL (default: %(default)s)")
    g = p.add_argument_group("engine settings (EngineConfig; left out: its defaults)")
    g.add_argument("--max-num-seqs", type=_int_at_least(1), metavar="N", help="sequences per step")
    g.add_argument("--max-num-batched-tokens", type=_int_at_least(1), metavar="N", help="tokens per step")
    g.add_argument("--max-prefill-chunk", type=_int_at_least(1), metavar="N",
                   help="prompt tokens of one request per step")
    g.add_argument("--block-size", type=_int_at_least(1), metavar="N", help="positions per KV block")
    g.add_argument("--gpu-memory-utilization", type=float, metavar="F", help="CUDA: share of the device to fill")
    g.add_argument("--cpu-kv-cache-bytes", type=_int_at_least(1), metavar="B", help="CPU: bytes of KV cache")
    g.add_argument("--num-kv-blocks", type=_int_at_least(2), metavar="N", help="a fixed number of KV blocks")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None)
    g.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false", default=None)
    g.add_argument("--no-overlap-steps", dest="overlap_steps", action="store_false", default=None,
                   help="read each decode step's tokens before launching the next (default: overlapped on CUDA)")
    g.add_argument("--max-queued-requests", type=_int_at_least(1), metavar="N",
                   help="requests in flight before new ones get 503")
    g.add_argument("--kv-window", type=_int_at_least(0), metavar="N",
                   help="default rolling KV window of requests (StreamingLLM: endless generation; 0 = dense)")
    g.add_argument("--sink-tokens", type=_int_at_least(0), metavar="N", help="first tokens a window keeps (default 4)")
    g.add_argument("--tensor-parallel-size", "-tp", type=_int_at_least(1), metavar="N",
                   help="split the model over N GPUs (--device's and the next N - 1; default 1); with --nnodes, "
                        "over every node's GPUs together (N / nnodes a node)")
    g.add_argument("--tp-timeout-s", dest="tp_timeout_s", type=float, metavar="S",
                   help="a rank or node that does not finish a step, or join, within S seconds fails the engine "
                        "(default 300)")
    n = p.add_argument_group("across hosts (torchrun's and SGLang's names): one command per node")
    n.add_argument("--nnodes", type=_int_at_least(1), metavar="N", help="processes the model spans (default 1)")
    n.add_argument("--node-rank", type=_int_at_least(0), metavar="R",
                   help="this node (default 0); node 0 serves HTTP, the others only run its steps")
    n.add_argument("--master-addr", metavar="ADDR", help="node 0's address, reachable from every node (default "
                   "127.0.0.1)")
    n.add_argument("--master-port", type=_int_at_least(1), metavar="PORT",
                   help="the port node 0 listens on for the other nodes (default 29500)")
    p.set_defaults(func=run_serve)
    return p


ENGINE_SETTINGS = ("max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk", "block_size",
                   "gpu_memory_utilization", "cpu_kv_cache_bytes", "num_kv_blocks", "enable_prefix_caching",
                   "cuda_graphs", "overlap_steps", "max_queued_requests", "kv_window", "sink_tokens",
                   "tensor_parallel_size", "tp_timeout_s", "nnodes", "node_rank", "master_addr", "master_port")


def run_follower(args) -> int:
    """`llaisys serve --node-rank R` (R > 0): no HTTP; this node runs node 0's steps until node 0 ends."""
    from .. import catalog
    from ..engine import Engine

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    settings = {k: getattr(args, k) for k in ENGINE_SETTINGS if getattr(args, k) is not None}
    engine = Engine(args.model or catalog.DEFAULT_MODEL, device=args.device, dtype=args.dtype,
                    max_seq_len=args.max_seq_len, **settings)
    engine.follow()
    return 0


def run_serve(args) -> int:
    if (args.node_rank or 0) > 0:
        return run_follower(args)
    try:
        import uvicorn

        from .app import check_api_key, create_app
    except ImportError as e:
        raise RuntimeError(f"the server needs FastAPI and uvicorn ({e}): pip install 'llaisys[serve]'") from None
    from .. import catalog
    from ..engine.config import EngineConfig
    from ..engine_args import check_max_seq_len, check_model_arg, resolve_dtype
    from .backend import Engine, EngineProcess

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    model = check_model_arg(args.model or catalog.DEFAULT_MODEL)
    settings = {k: getattr(args, k) for k in ENGINE_SETTINGS if getattr(args, k) is not None}
    # Engine()'s checks that need no device (this process calls nothing of _core when the engine has its own
    # process; --device's syntax is the parser's, whether it exists the engine's), before the socket is bound
    resolve_dtype(args.dtype)
    check_max_seq_len(args.max_seq_len)
    EngineConfig(**settings)
    check_api_key(args.api_key)
    try:
        sockets = bind_sockets(args.host, args.port)
    except OSError as e:
        hint = " (another server is listening there: choose another --port)" if e.errno == errno.EADDRINUSE else ""
        print(f"llaisys: error: cannot listen on {args.host}:{args.port}: {e.strerror or e}{hint}", file=sys.stderr)
        return EXIT_STARTUP_FAILURE
    try:
        make = EngineProcess if args.engine_process else Engine
        engine = make(model, device=args.device, dtype=args.dtype, max_seq_len=args.max_seq_len, **settings)
        if args.engine_process:
            logging.getLogger("llaisys.server").info("the engine runs in process %d", engine.pid)
        try:
            app = create_app(engine, args.served_model_name or model, args.api_key)
            config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
            _serve(config, app.state.llaisys, sockets)
        finally:
            engine.close()
    finally:
        for sock in sockets:
            sock.close()
    return 0


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address of host (as asyncio's create_server binds them: SO_REUSEADDR, IPv6
    sockets IPv6-only), not listening yet. Raises OSError (socket.gaierror for a host that does not
    resolve) when any cannot be bound."""
    infos = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)  # not inheritable (Python's default): the engine process must not hold the port
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _serve(config, state, sockets: list[socket.socket]) -> None:
    """uvicorn's Server on the bound sockets, except that SIGINT/SIGTERM first ends the running requests
    (streams get an error chunk): uvicorn's graceful shutdown waits for open responses, which must not wait
    for generations."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            state.request_shutdown()
            super().handle_exit(sig, frame)

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started:  # uvicorn logs where it listens only for sockets it bound itself
                for sock in sockets or ():
                    host, port = sock.getsockname()[:2]
                    where = f"[{host}]" if sock.family == socket.AF_INET6 else host
                    logging.getLogger("uvicorn.error").info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)",
                                                            where, port)

    Server(config).run(sockets=sockets)
