"""Prometheus metrics in the text exposition format (version 0.0.4), written by hand: a few counters
and histograms do not need a client library. Observations happen on the event loop thread only, so
there is no lock."""
from __future__ import annotations

import bisect

# seconds; TTFT spans CPU prefill of long prompts, per-token latency GPU decode steps
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for le, n in zip([*map(str, self.buckets), "+Inf"], self.counts):
            cumulative += n
            out.append(f'{self.name}_bucket{{le="{le}"}} {cumulative}')
        out += [f"{self.name}_sum {self.sum}", f"{self.name}_count {self.count}"]
        return out


class Metrics:
    def __init__(self):
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests: dict[str, int] = {}  # finished HTTP generation requests by outcome
        self.in_flight = 0  # HTTP generation requests being answered
        self.ttft = Histogram("llaisys_time_to_first_token_seconds",
                              "Time from a request's arrival to its first token.", TTFT_BUCKETS)
        self.tpot = Histogram("llaisys_time_per_output_token_seconds",
                              "Decode time per generated token after the first, per sequence.", TPOT_BUCKETS)
        self.e2e = Histogram("llaisys_e2e_request_latency_seconds",
                             "Time from a request's arrival to its last token.", E2E_BUCKETS)

    def finished(self, outcome: str, usage: dict | None = None, ttft: float | None = None,
                 total: float | None = None, decode_rates: list[float] = ()) -> None:
        """One HTTP request ended: outcome is "ok", "error", "aborted" (the client left) or "rejected"."""
        self.requests[outcome] = self.requests.get(outcome, 0) + 1
        if usage:
            self.prompt_tokens += usage["prompt_tokens"]
            self.generation_tokens += usage["completion_tokens"]
        if ttft is not None:
            self.ttft.observe(ttft)
        if total is not None:
            self.e2e.observe(total)
        for rate in decode_rates:
            if rate > 0:
                self.tpot.observe(1.0 / rate)

    def render(self, stats: dict) -> str:
        """The exposition text; `stats` is Engine.stats() (read fresh for each scrape)."""
        gauges = [
            ("llaisys_num_requests_running", "Sequences in the running batch.", stats["running"]),
            ("llaisys_num_requests_waiting", "Sequences waiting to be scheduled.", stats["waiting"]),
            ("llaisys_http_requests_in_flight", "Generation requests being answered.", self.in_flight),
            ("llaisys_kv_blocks_used", "KV cache blocks held by sequences.", stats["kv_blocks_used"]),
            ("llaisys_kv_blocks_free", "KV cache blocks free (cached prefixes included).", stats["kv_blocks_free"]),
            ("llaisys_kv_blocks_total", "KV cache blocks in the pool.", stats["kv_blocks_total"]),
            ("llaisys_prefix_cache_hit_rate", "Share of admitted prompt tokens found in the prefix cache.",
             stats["prefix_cache_hit_rate"]),
        ]
        counters = [
            ("llaisys_prompt_tokens_total", "Prompt tokens of finished requests.", self.prompt_tokens),
            ("llaisys_generation_tokens_total", "Generated tokens of finished requests.", self.generation_tokens),
            ("llaisys_preemptions_total", "Sequences preempted for lack of KV blocks.", stats["preemptions"]),
            ("llaisys_kv_blocks_evicted_total", "KV blocks windowed sequences evicted (kv_window, StreamingLLM).",
             stats.get("kv_blocks_evicted", 0)),
        ]
        lines = []
        for name, help_text, value in gauges:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value}"]
        for name, help_text, value in counters:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {value}"]
        lines += ["# HELP llaisys_requests_total Finished generation requests by outcome.",
                  "# TYPE llaisys_requests_total counter"]
        lines += [f'llaisys_requests_total{{outcome="{k}"}} {v}' for k, v in sorted(self.requests.items())]
        for h in (self.ttft, self.tpot, self.e2e):
            lines += h.lines()
        return "\n".join(lines) + "\n"
