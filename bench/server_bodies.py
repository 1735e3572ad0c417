"""Large request bodies against `llaisys serve`: the HTTP process's RSS before and after, and how long
/health takes meanwhile (issue 28, item 2).

Starts the server (`python -m llaisys.server`, the engine in its own process as by default), sends a few
ordinary requests, then runs phases of --count bodies each, one at a time on fresh connections:

  413-length   --body-mib MiB of JSON prompt with a Content-Length over the limit (refused before reading)
  413-chunked  the same body sent chunked, without a Content-Length (refused once the limit is passed)
  400-fits     a prompt just under the body limit (read, decoded and tokenized, then refused: longer than
               the context); this is the most a client can make the server parse

For each phase: the server process's RSS (VmRSS of /proc/PID/status) before and after (after a 1 s
settle), the statuses, and the latency of /health polled every 50 ms by a separate process during the
phase (p50, p99, max). The bodies are built once and sent with socket.sendall; the response is read in full.

    python bench/server_bodies.py                                   # the default model, CPU
    python bench/server_bodies.py --model /path/to/tiny --max-seq-len 4096 --count 100
    git archive 68fe1c6 python | tar -x -C /tmp/old                 # the code before the body limit
    python bench/server_bodies.py --tree /tmp/old --phases 413-length --count 3

--tree runs the server from another tree's python/ folder (put first on PYTHONPATH; LLAISYS_BUILD_DIR, if
set, still supplies the extension).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
PHASES = ("413-length", "413-chunked", "400-fits")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(port: int, path: str, timeout: float = 600) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def post(port: int, body: bytes, chunked: bool = False, path: str = "/v1/completions") -> tuple[int, bytes]:
    """One request on a fresh connection; (status, response body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=600) as s:
        # kept alive, as clients do: a server that answers before the body ends must still read the rest
        head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        if chunked:
            s.sendall((head + "Transfer-Encoding: chunked\r\n\r\n").encode())
            step = 1 << 20
            try:
                for i in range(0, len(body), step):
                    part = body[i:i + step]
                    s.sendall(f"{len(part):x}\r\n".encode() + part + b"\r\n")
                s.sendall(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server answered and closed early: read what it said
        else:
            s.sendall((head + f"Content-Length: {len(body)}\r\n\r\n").encode())
            try:
                s.sendall(body)
            except (BrokenPipeError, ConnectionResetError):
                pass
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(1 << 16)
            if not chunk:
                raise ConnectionError(f"the server closed the connection before answering: {data[:200]!r}")
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        length = next(int(v) for k, _, v in (x.partition(":") for x in lines[1:]) if k.lower() == "content-length")
        while len(rest) < length:
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            rest += chunk
    return int(lines[0].split()[1]), rest


def poll_health(port: int, stop, ready, out) -> None:
    """In its own process: /health latencies (s) every 50 ms until stop is set; ready is set once the first
    poll is answered, so a phase starts only once the poller runs (a busy machine took longer than any fixed
    wait to start the poller's interpreter, and a short phase then ended with no poll at all)."""
    lat = []
    while True:
        t = time.perf_counter()
        status, _ = http_get(port, "/health", timeout=600)
        lat.append(time.perf_counter() - t)
        if status != 200:
            lat[-1] = float("inf")
        ready.set()
        if stop.is_set():
            break
        time.sleep(0.05)
    out.put(lat)


def prompt_body(model: str, nbytes: int) -> bytes:
    """A /v1/completions body of about nbytes bytes (English-like text)."""
    words = "the quick brown fox jumps over the lazy dog while a server reads its body ".split()
    text, n = [], 0
    while n < nbytes - 64:
        w = words[len(text) % len(words)]
        text.append(w)
        n += len(w) + 1
    return json.dumps({"model": model, "prompt": " ".join(text), "max_tokens": 1}).encode()


def run_phase(name: str, port: int, pid: int, body: bytes, count: int, chunked: bool) -> dict:
    ctx = multiprocessing.get_context("spawn")
    stop, ready, out = ctx.Event(), ctx.Event(), ctx.Queue()
    poller = ctx.Process(target=poll_health, args=(port, stop, ready, out), daemon=True)
    before = rss_mib(pid)
    poller.start()
    if not ready.wait(120):
        poller.kill()
        raise SystemExit("server_bodies: the /health poller got no answer in 120 s")
    statuses: dict[int, int] = {}
    t0 = time.perf_counter()
    for _ in range(count):
        status, _ = post(port, body, chunked)
        statuses[status] = statuses.get(status, 0) + 1
    wall = time.perf_counter() - t0
    stop.set()
    lat = out.get(timeout=600)
    poller.join()
    peak = rss_mib(pid)
    time.sleep(1.0)
    after = rss_mib(pid)
    lat.sort()
    q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] * 1e3  # noqa: E731
    return dict(phase=name, count=count, body_bytes=len(body), statuses=statuses, wall_s=round(wall, 2),
                rss_before_mib=round(before, 1), rss_end_mib=round(peak, 1), rss_after_mib=round(after, 1),
                health_polls=len(lat), health_p50_ms=round(statistics.median(lat) * 1e3, 1),
                health_p99_ms=round(q(0.99), 1), health_max_ms=round(lat[-1] * 1e3, 1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="as for llaisys serve (default: the catalog's default model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-seq-len", type=int, default=None, help="as for llaisys serve (default: the model's, "
                   "up to 8192)")
    p.add_argument("--count", type=int, default=100, help="bodies per phase (default 100)")
    p.add_argument("--body-mib", type=float, default=10, help="size of the refused bodies (default 10 MiB)")
    p.add_argument("--fits-bytes", type=int, default=None, help="size of the 400-fits body (default: 1 KiB "
                   "under the limit the server states in its 413 answer)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)}")
    p.add_argument("--tree", default=None, help="the checkout whose python/ runs the server (default: the llaisys "
                   "this Python imports)")
    p.add_argument("--server-arg", action="append", default=[], help="more llaisys serve arguments")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    args = p.parse_args()
    phases = [x for x in args.phases.split(",") if x]
    bad = [x for x in phases if x not in PHASES]
    if bad:
        p.error(f"unknown phase(s) {bad}; choose from {PHASES}")

    port = free_port()
    # Without --tree the server is the llaisys this Python imports (the installed package, or whatever
    # PYTHONPATH/LLAISYS_BUILD_DIR already name): a source tree's python/ has no compiled _core of its own.
    tree = os.path.abspath(args.tree) if args.tree else None
    env = dict(os.environ)
    if tree:
        paths = [os.path.join(tree, "python")] + [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x]
        env["PYTHONPATH"] = os.pathsep.join(paths)
    cmd = [sys.executable, "-m", "llaisys.server", "--device", args.device, "--port", str(port),
           "--served-model-name", "m", *args.server_arg]
    if args.model:
        cmd += ["--model", args.model]
    if args.max_seq_len:
        cmd += ["--max-seq-len", str(args.max_seq_len)]
    log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"server_bodies_{port}.log")
    log = open(log_path, "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    results = []
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server exited with {server.returncode}: see {log_path}")
            try:
                if http_get(port, "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        ok = json.dumps({"model": "m", "prompt": "Hello, my name is", "max_tokens": 4}).encode()
        for _ in range(3):  # the first requests load code paths; RSS is measured after them
            assert post(port, ok)[0] == 200
        big = prompt_body("m", int(args.body_mib * (1 << 20)))
        limit = None
        for name in phases:
            if name == "400-fits":
                if args.fits_bytes is None and limit is None:
                    status, answer = post(port, big)
                    msg = json.loads(answer)["error"]["message"]
                    limit = int(msg.split("reads at most ")[1].split()[0]) if "reads at most" in msg else None
                    if limit is None:
                        print(f"400-fits: the server states no limit ({status}: {msg[:100]}); give --fits-bytes",
                              file=sys.stderr)
                        continue
                body = prompt_body("m", args.fits_bytes or limit - 1024)
                results.append(run_phase(name, port, server.pid, body, args.count, False))
            else:
                results.append(run_phase(name, port, server.pid, big, args.count, name == "413-chunked"))
            r = results[-1]
            print(f"{r['phase']:12} {r['count']} x {r['body_bytes'] / 2**20:.2f} MiB -> {r['statuses']} in "
                  f"{r['wall_s']} s | RSS {r['rss_before_mib']} -> {r['rss_end_mib']} MiB (after 1 s: "
                  f"{r['rss_after_mib']}) | /health p50 {r['health_p50_ms']} ms, p99 {r['health_p99_ms']} ms, "
                  f"max {r['health_max_ms']} ms over {r['health_polls']} polls", flush=True)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    with open(log_path) as f:
        text = f.read()
    errors = text.count(" ERROR ") + text.count("ERROR:")
    print(f"server log {log_path}: {errors} ERROR lines, {text.count('Traceback')} tracebacks")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command=sys.argv, tree=tree, results=results, log_errors=errors), f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
