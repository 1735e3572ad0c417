"""Load test of an OpenAI-compatible server, in the spirit of vLLM's benchmark_serving.

N requests arrive all at once (--request-rate inf) or as a Poisson process at a given rate. Prompt and
output lengths follow nano-vllm's bench.py: prompts of random token ids (values < 10000), lengths uniform
in [100, max_input_len], outputs uniform in [100, max_output_len] with ignore_eos, seed 0. Every request
streams; reported: request and token throughput, TTFT p50/p99, inter-token latency (ITL) p50/p99 and time
per output token. A chunk may carry several tokens (llaisys serve merges the waiting chunks of a stream that
fell behind, as vLLM does): ITL is the time between chunks with text, TPOT counts tokens from usage.
--compare-url runs the same requests against a second server in the same run; --offline
runs them through llaisys.Engine in this process (at the same arrival times), the ceiling the server's
throughput is measured against; --offline-only runs only that (start it when no server holds the GPU).

`transformers serve` (HF's OpenAI-compatible server; bench/serve_check.sh starts it) takes only text
prompts and no ignore_eos: --api transformers sends --prompt-format text (random common words) and asks
for EOS to be ignored through its `generation_config` field (eos_token_id -1, with the same sampling).

    llaisys serve --model qwen2.5-coder-0.5b-instruct --device cuda &
    python bench/serve_load.py --url http://127.0.0.1:8000 --model qwen2.5-coder-0.5b-instruct -n 256
    python bench/serve_load.py --url ... --request-rate 1 -n 64 --offline --json out.json
    python bench/serve_load.py --write-checkpoint /tmp/ckpt --shape qwen2-0.5b   # random weights, for both servers
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

WORDS = ("the of and to in is that for it as with was on be by this are from at or an have not they which "
         "one you were all we can her has there been if more when will would who so no out up into do time "
         "only new some could these two may first then any like my now over such our man me even most made "
         "after also did many before must through back years where much your way well down should because "
         "each just those people how too little state good very make world still own see men work long get "
         "here between both life being under never day same another know while last might us great old year "
         "off come since against go came right used take three").split()


def make_requests(n: int, max_input_len: int, max_output_len: int, seed: int = 0) -> list[dict]:
    """nano-vllm's protocol: token-id prompts and output lengths drawn with one seeded generator."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randint(0, 10000) for _ in range(rng.randint(100, max_input_len))]
        out.append({"prompt_ids": ids, "text": " ".join(WORDS[i % len(WORDS)] for i in ids),
                    "max_tokens": rng.randint(100, max_output_len)})
    return out


def arrival_offsets(n: int, rate: float, seed: int = 0) -> list[float]:
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return list(np.cumsum(rng.exponential(1.0 / rate, n)))


def request_body(model: str, req: dict, args) -> tuple[str, dict]:
    """(path, JSON body) of one request, in the dialect of --api."""
    body = {"model": model, "max_tokens": req["max_tokens"], "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.api == "transformers":
        # transformers serve refuses ignore_eos (422) and reads sampling from a GenerationConfig given as
        # JSON; eos_token_id -1 turns EOS off in its continuous batching. top_k/top_p: llaisys's defaults.
        gc = {"do_sample": args.temperature > 0, "temperature": args.temperature or 1.0, "top_k": 50, "top_p": 1.0}
        if args.ignore_eos:
            gc["eos_token_id"] = -1
        body["generation_config"] = json.dumps(gc)
    elif args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": req["text"]}]}
    return "/v1/completions", {**body, "prompt": req["text"] if args.prompt_format == "text" else req["prompt_ids"]}


async def one_request(client, url: str, model: str, req: dict, args, t_start: float) -> dict:
    path, body = request_body(model, req, args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    times, usage, error = [], None, None
    sent = time.perf_counter()
    try:
        async with client.stream("POST", url + path, json=body, headers=headers) as r:
            if r.status_code != 200:
                error = f"{r.status_code}: {(await r.aread()).decode()[:200]}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data:") or line.strip() == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if "error" in chunk:  # OpenAI's {"error": {...}}, or transformers serve's {"error": "..."}
                        err = chunk["error"]
                        error = err.get("message") if isinstance(err, dict) else str(err)
                        break
                    usage = chunk.get("usage") or usage
                    for c in chunk.get("choices", []):
                        if c.get("text") or (c.get("delta") or {}).get("content"):
                            times.append(time.perf_counter())
    except Exception as e:  # a refused or dropped connection counts as a failed request
        error = f"{type(e).__name__}: {e}"
    done = time.perf_counter()
    out_tokens = (usage or {}).get("completion_tokens", len(times))
    return {"ok": error is None and bool(times), "error": error, "start": sent - t_start, "ttft": times[0] - sent
            if times else None, "itl": list(np.diff(times)), "e2e": done - sent, "output_tokens": out_tokens,
            "prompt_tokens": (usage or {}).get("prompt_tokens", len(req["prompt_ids"]))}


async def run_load(url: str, model: str, reqs: list[dict], args) -> dict:
    import httpx

    offsets = arrival_offsets(len(reqs), args.request_rate, args.seed)
    limit = asyncio.Semaphore(args.max_concurrency or len(reqs))
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=httpx.Limits(max_connections=None)) as client:
        for i in range(args.warmup):  # not measured: lazy model loads, CUDA graphs, transformers' CB start
            w = await one_request(client, url, model, {**reqs[i % len(reqs)], "max_tokens": 4}, args, 0.0)
            if not w["ok"]:
                raise SystemExit(f"the warm-up request to {url} failed: {w['error']}")
        t0 = time.perf_counter()

        async def launch(req, offset):
            await asyncio.sleep(max(0.0, offset - (time.perf_counter() - t0)))
            async with limit:
                return await one_request(client, url, model, req, args, t0)
        results = await asyncio.gather(*(launch(r, o) for r, o in zip(reqs, offsets)))
        duration = time.perf_counter() - t0
    return summarize(results, duration)


def summarize(results: list[dict], duration: float) -> dict:
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    itl = [x for r in ok for x in r["itl"]]
    tpot = [(r["e2e"] - r["ttft"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1]
    out_tokens = sum(r["output_tokens"] for r in ok)

    def pct(xs, q):
        return float(np.percentile(xs, q) * 1e3) if xs else float("nan")
    return {"requests": len(results), "failed": len(results) - len(ok), "duration_s": duration,
            "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
            "total_token_throughput": (out_tokens + sum(r["prompt_tokens"] for r in ok)) / duration,
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99), "itl_p50_ms": pct(itl, 50),
            "itl_p99_ms": pct(itl, 99), "tpot_mean_ms": float(np.mean(tpot) * 1e3) if tpot else float("nan"),
            "errors": sorted({r["error"] for r in results if r["error"]})[:5]}


def run_offline(model: str, reqs: list[dict], args) -> dict:
    """The same requests through llaisys.Engine in this process, submitted at the same arrival times (all at
    once by default). TTFT counts from each request's submit, as the server's from its HTTP request."""
    from llaisys.server.backend import Engine

    eng = Engine(model, device=args.device, progress=False)
    try:
        for _ in range(args.warmup):
            eng.generate(reqs[0]["prompt_ids"][:16], max_new_tokens=4, temperature=0)
        offsets = arrival_offsets(len(reqs), args.request_rate, args.seed)
        handles = []
        t0 = time.perf_counter()
        for r, offset in zip(reqs, offsets):  # submit() returns at once; the engine's thread runs them
            time.sleep(max(0.0, offset - (time.perf_counter() - t0)))
            handles.append(eng.submit(r["prompt_ids"], max_new_tokens=r["max_tokens"],
                                      temperature=args.temperature or 0, ignore_eos=args.ignore_eos))
        results = [h.result() for h in handles]  # chunks wait in each request's queue until read
        duration = time.perf_counter() - t0
    finally:
        eng.close()
    out = sum(len(r.token_ids) for r in results)
    ttft = [r.timings["ttft_s"] for r in results]
    return {"requests": len(reqs), "duration_s": duration, "output_throughput": out / duration,
            "ttft_p50_ms": float(np.percentile(ttft, 50) * 1e3), "ttft_p99_ms": float(np.percentile(ttft, 99) * 1e3)}


SHAPES = {  # HF config fields of the real models (tied embeddings, as they have) and a tiny one for the CPU
    "qwen2-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, tie=True),
    "qwen2-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, tie=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie=True, vocab_size=16384, max_position_embeddings=4096),
}


def write_checkpoint(shape: str, dirpath: str) -> str:
    """A random HF checkpoint of `shape` (the real shapes and vocabulary, bf16; or "tiny") that both
    llaisys and transformers load. The test tokenizer knows 400 tokens; its vocabulary is padded
    with one word per remaining id (" t<id>") so every id a random model samples decodes to text: a server
    streams nothing for a token without text, and TTFT could not be measured."""
    sys.path[:0] = [os.path.join(HERE, "..", "tests")]
    from tiny_model import make_tiny_qwen2

    if shape not in SHAPES:
        raise SystemExit(f"--shape must be one of {sorted(SHAPES)}, got {shape!r}")
    cfg = dict(SHAPES[shape])
    tie = cfg.pop("tie")
    cfg = {"vocab_size": 151936, "max_position_embeddings": 32768, "rope_theta": 1e6, **cfg}
    make_tiny_qwen2(dirpath, tie=tie, dtype="bfloat16", **cfg)
    path = os.path.join(dirpath, "tokenizer.json")
    with open(path) as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    vocab.update({t["content"]: t["id"] for t in tok["added_tokens"]})  # else a loader re-numbers them past the padding
    taken = set(vocab.values())
    for i in range(cfg["vocab_size"]):
        if i not in taken:
            vocab[f"\u0120t{i}"] = i  # U+0120 is a space in byte-level BPE's alphabet
    with open(path, "w") as f:
        json.dump(tok, f)
    return dirpath


def report(name: str, s: dict) -> None:
    print(f"== {name}")
    for k, v in s.items():
        print(f"  {k:<24} {v:.2f}" if isinstance(v, float) else f"  {k:<24} {v}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="the model name the server expects (and the model --offline loads)")
    p.add_argument("--compare-url", help="a second server to run the same requests against")
    p.add_argument("--compare-model", help="its model name (default: --model)")
    p.add_argument("--offline", action="store_true", help="also run the requests through llaisys.Engine here")
    p.add_argument("--offline-only", action="store_true", help="only run them through llaisys.Engine (no --url)")
    p.add_argument("--device", default="auto", help="device of the --offline engine")
    p.add_argument("--num-requests", "-n", type=int, default=256)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s, Poisson (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let outputs end at EOS (by default every output has its drawn length)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="completions sends --prompt-format; chat sends words")
    p.add_argument("--prompt-format", choices=["ids", "text"],
                   help="completions prompts: token ids (exact lengths; default) or random common words (text, for "
                        "servers that take no ids; default for --api transformers)")
    p.add_argument("--api", choices=["llaisys", "transformers"], default="llaisys",
                   help="the server's dialect: llaisys (and vLLM) take ignore_eos; transformers serve does not")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured short requests sent first (default 1)")
    p.add_argument("--api-key")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--write-checkpoint", metavar="DIR", help="write a random checkpoint of --shape into DIR and exit")
    p.add_argument("--shape", default="qwen2-0.5b", help="for --write-checkpoint: qwen2-0.5b, qwen2-1.5b or tiny")
    args = p.parse_args(argv)
    if args.write_checkpoint:
        print(write_checkpoint(args.shape, args.write_checkpoint))
        return 0
    if not args.model or not (args.url or args.offline_only):
        p.error("--model is needed, and --url unless --offline-only")
    args.prompt_format = args.prompt_format or ("text" if args.api == "transformers" else "ids")
    if args.api == "transformers" and args.endpoint == "completions" and args.prompt_format == "ids":
        p.error("transformers serve takes only text prompts: use --prompt-format text or --endpoint chat")
    if args.max_input_len < 100 or args.max_output_len < 100:
        p.error("--max-input-len and --max-output-len must be >= 100 (the protocol's lower bound)")
    if args.num_requests < 1 or args.warmup < 0:
        p.error("--num-requests must be >= 1 and --warmup >= 0")
    reqs = make_requests(args.num_requests, args.max_input_len, args.max_output_len, args.seed)
    results = {"args": {k: v for k, v in vars(args).items() if k != "api_key"}}
    if not args.offline_only:
        results["server"] = asyncio.run(run_load(args.url, args.model, reqs, args))
        report(f"{args.url} ({args.model})", results["server"])
    if args.compare_url:
        results["compare"] = asyncio.run(run_load(args.compare_url, args.compare_model or args.model, reqs, args))
        report(f"{args.compare_url}", results["compare"])
    if args.offline or args.offline_only:
        results["offline engine"] = run_offline(args.model, reqs, args)
        report("offline llaisys.Engine", results["offline engine"])
    if "server" in results and "offline engine" in results:
        share = results["server"]["output_throughput"] / results["offline engine"]["output_throughput"]
        print(f"server output throughput / offline engine's: {share:.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 1 if any(results[k].get("failed") for k in ("server", "compare") if k in results) else 0


if __name__ == "__main__":
    sys.exit(main())
