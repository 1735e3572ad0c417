"""Load test of an OpenAI-compatible server, in the spirit of vLLM's benchmark_serving.

N requests arrive all at once (--request-rate inf) or as a Poisson process at a given rate. Prompt and
output lengths follow nano-vllm's bench.py: prompts of random token ids (values < 10000), lengths uniform
in [100, max_input_len], outputs uniform in [100, max_output_len] with ignore_eos, seed 0. Every request
streams; reported: request and token throughput, TTFT p50/p99, inter-token latency (ITL) p50/p99 and time
per output token. --compare-url runs the same requests against a second server in the same run (e.g.
`transformers serve`, which speaks only chat: use --endpoint chat, whose prompts are random common words,
about one token each); --offline runs them through llaisys.Engine in this process, the ceiling the
server's throughput is measured against.

    llaisys serve --model qwen2.5-coder-0.5b-instruct --device cuda &
    python bench/serve_load.py --url http://127.0.0.1:8000 --model qwen2.5-coder-0.5b-instruct -n 256
    python bench/serve_load.py --url ... --request-rate 1 -n 64 --offline --json out.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time

import numpy as np

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


async def one_request(client, url: str, model: str, req: dict, args, t_start: float) -> dict:
    body = {"model": model, "max_tokens": req["max_tokens"], "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": req["text"]}]
    else:
        path, body["prompt"] = "/v1/completions", req["prompt_ids"]
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
                    if "error" in chunk:
                        error = chunk["error"].get("message")
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
    """The same requests through llaisys.Engine in this process, all submitted at once."""
    from llaisys.server.backend import Engine

    eng = Engine(model, device=args.device, progress=False)
    try:
        eng.generate(reqs[0]["prompt_ids"][:16], max_new_tokens=4, temperature=0)  # warm-up
        t0 = time.perf_counter()
        results = eng.generate([r["prompt_ids"] for r in reqs], max_new_tokens=[r["max_tokens"] for r in reqs],
                               temperature=args.temperature or 0, ignore_eos=args.ignore_eos)
        duration = time.perf_counter() - t0
    finally:
        eng.close()
    out = sum(len(r.token_ids) for r in results)
    ttft = [r.timings["ttft_s"] for r in results]
    return {"requests": len(reqs), "duration_s": duration, "output_throughput": out / duration,
            "ttft_p50_ms": float(np.percentile(ttft, 50) * 1e3), "ttft_p99_ms": float(np.percentile(ttft, 99) * 1e3)}


def report(name: str, s: dict) -> None:
    print(f"== {name}")
    for k, v in s.items():
        print(f"  {k:<24} {v:.2f}" if isinstance(v, float) else f"  {k:<24} {v}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="the model name the server expects")
    p.add_argument("--compare-url", help="a second server to run the same requests against")
    p.add_argument("--compare-model", help="its model name (default: --model)")
    p.add_argument("--offline", action="store_true", help="also run the requests through llaisys.Engine here")
    p.add_argument("--device", default="auto", help="device of the --offline engine")
    p.add_argument("--num-requests", "-n", type=int, default=256)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="for servers without vLLM's ignore_eos (outputs may then end early)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="completions sends token ids (exact lengths); chat sends words")
    p.add_argument("--api-key")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.max_input_len < 100 or args.max_output_len < 100:
        p.error("--max-input-len and --max-output-len must be >= 100 (the protocol's lower bound)")
    reqs = make_requests(args.num_requests, args.max_input_len, args.max_output_len, args.seed)
    results = {"args": {k: v for k, v in vars(args).items() if k != "api_key"}}
    results["llaisys serve"] = asyncio.run(run_load(args.url, args.model, reqs, args))
    report(f"{args.url} ({args.model})", results["llaisys serve"])
    if args.compare_url:
        results["compare"] = asyncio.run(run_load(args.compare_url, args.compare_model or args.model, reqs, args))
        report(f"{args.compare_url}", results["compare"])
    if args.offline:
        results["offline engine"] = run_offline(args.model, reqs, args)
        report("offline llaisys.Engine", results["offline engine"])
        share = results["llaisys serve"]["output_throughput"] / results["offline engine"]["output_throughput"]
        print(f"server output throughput / offline engine's: {share:.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    return 1 if results["llaisys serve"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
