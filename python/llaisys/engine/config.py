"""EngineConfig: every knob of the batched engine in one frozen object.

Environment variables only supply defaults, here and nowhere else; they exist for A/B runs:
LLAISYS_CUDA_GRAPHS=0 (no CUDA graphs), LLAISYS_GRAPHS_AT_START=0 (each decode graph captured at its first
step), LLAISYS_PREFIX_CACHE=0 (no prefix caching),
LLAISYS_KV_BLOCKS=N (a fixed number of KV blocks, e.g. to force preemption), LLAISYS_FUSED=0|1 (fused
projections off or on; unset: on for CUDA only).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value in (None, "") else value != "0"


def _env_optional_flag(name: str) -> bool | None:
    value = os.environ.get(name)
    return None if value in (None, "") else value != "0"


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def default_graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond: padding wastes at most 15 rows of work."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    step = 8
    while sizes[-1] < max_num_seqs:
        if sizes[-1] >= 64:
            step = 16
        sizes.append(min(sizes[-1] + step, max_num_seqs))
    return tuple(sizes)


# Defaults that depend on the device (EngineConfig.for_device).
# CPU, measured with bench/hol_latency.py (bench/RESULTS.md; 2-core AMD EPYC, AVX2, Qwen2.5-Coder-0.5B
# Q4_K_M): a prompt token costs about the same in chunks of 16 to 256 tokens a step (a 3,001-token prompt in
# one step was slower), so a step's time is its token count. Chunks of 32 keep a stream's tokens ~1 s apart
# beside a long prompt, and a short request's first token ~1.5 s away, where one 3,001-token step stalled
# both for minutes. 256 tokens a step: no less than max_num_seqs, so every running decode fits in a step.
# CUDA: 4096 a step, within vLLM's and SGLang's defaults (2048-16384); no prompt more than half of it, so short
# requests always fit beside a long one. Measured on an H200 (session 39, nano-vllm's protocol, 1.5B): 8192 and
# 16384 gained nothing (29,773 / 29,493 against 30,034 output tok/s) once a step's decodes stopped riding on the
# prefill kernel (before that fix, 16384 had looked 6% faster).
_PER_DEVICE = {
    "max_num_batched_tokens": {"cpu": 256, "cuda": 4096},
    "max_prefill_chunk": {"cpu": 32, "cuda": 2048},
}


@dataclass(frozen=True)
class EngineConfig:
    """Settings of the batched engine. Pass one to Engine(config=...) or its fields as keywords."""

    max_num_seqs: int = 256               # sequences in one step (decode batch size)
    # tokens in one step, and prompt tokens of one sequence in one step: a long prompt is computed in chunks
    # beside the running streams and the short prompts (scheduler.py). None: the device's default (_PER_DEVICE)
    max_num_batched_tokens: int | None = None
    max_prefill_chunk: int | None = None
    block_size: int = 16                  # positions per KV block (the prefix cache's granularity)
    gpu_memory_utilization: float = 0.9   # CUDA: fraction of the device the engine may fill (KV pool sized to it)
    cpu_kv_cache_bytes: int = 1 << 30     # CPU: bytes for the KV pool
    num_kv_blocks: int | None = field(default_factory=lambda: _env_int("LLAISYS_KV_BLOCKS"))  # overrides both
    enable_prefix_caching: bool = field(default_factory=lambda: _env_flag("LLAISYS_PREFIX_CACHE", True))
    cuda_graphs: bool = field(default_factory=lambda: _env_flag("LLAISYS_CUDA_GRAPHS", True))
    graph_batch_sizes: tuple[int, ...] | None = None  # None: default_graph_sizes(max_num_seqs)
    # capture every decode graph when the engine starts (ModelRunner.capture_graphs), not at a batch size's
    # first step; a group spanning several nodes captures at first use either way
    graphs_at_start: bool = field(default_factory=lambda: _env_flag("LLAISYS_GRAPHS_AT_START", True))
    # one GEMV for q/k/v and for gate/up (RoPE + cache write fused); None: on for CUDA only, since on the
    # CPU fusing copies the checkpoint's memory-mapped weights that are otherwise used in place
    fused_projections: bool | None = field(default_factory=lambda: _env_optional_flag("LLAISYS_FUSED"))
    max_queued_requests: int = 4096       # submit() beyond this raises (a server answers 503)
    # decode steps overlap: the host schedules step n + 1 (its input tokens chained on the device) while the
    # device runs step n (engine/core.py); None: on for CUDA only (on the CPU the step runs on the calling
    # thread, so nothing overlaps: True there is for tests)
    overlap_steps: bool | None = field(default_factory=lambda: _env_optional_flag("LLAISYS_OVERLAP"))
    # StreamingLLM, the default of requests that do not choose: keep the first sink_tokens tokens and about
    # kv_window after them, evicting the oldest blocks between (block_manager.py); 0 = dense (no window)
    kv_window: int = 0
    sink_tokens: int = 4
    # tensor parallelism (engine/ranks.py): the model split over this many GPUs from the engine's device on
    # (cuda:i .. cuda:i + N - 1; on the CPU, N threads, for tests); a rank that fails or does not finish a
    # step within tp_timeout_s seconds breaks the group and fails the engine with an error naming it
    tensor_parallel_size: int = 1
    tp_timeout_s: float = 300.0
    # structured output: threads computing a step's token masks (llguidance's pool, constraints.MaskFiller);
    # None: 80% of the CPUs, at most 32; 1: one row after another
    mask_threads: int | None = field(default_factory=lambda: _env_int("LLAISYS_MASK_THREADS"))
    # across hosts (engine/nodes.py; torchrun's and SGLang's names): nnodes processes of
    # tensor_parallel_size / nnodes ranks each, joined at node 0's master_addr:master_port; node 0 schedules
    # and serves, the others follow its steps (Engine.follow). tp_timeout_s also bounds the rendezvous.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500

    def __post_init__(self):
        ints = {"max_num_seqs": 1, "max_num_batched_tokens": 1, "max_prefill_chunk": 1, "block_size": 1,
                "cpu_kv_cache_bytes": 1, "max_queued_requests": 1, "kv_window": 0, "sink_tokens": 0,
                "tensor_parallel_size": 1, "nnodes": 1, "node_rank": 0, "master_port": 1}
        for name, low in ints.items():
            value = getattr(self, name)
            if value is None and name in _PER_DEVICE:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"EngineConfig.{name} must be an int >= {low}{' or None' * (name in _PER_DEVICE)}, "
                                 f"got {value!r}")
        m = self.mask_threads
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ValueError(f"EngineConfig.mask_threads must be an int >= 1 or None, got {m!r}")
        if self.block_size > 1024:
            raise ValueError(f"EngineConfig.block_size must be at most 1024, got {self.block_size}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2):
            raise ValueError(f"EngineConfig.num_kv_blocks must be an int >= 2 (block 0 is reserved), "
                             f"got {self.num_kv_blocks!r}")
        self._check_nodes()
        t = self.tp_timeout_s
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0.0 < t < float("inf"):
            raise ValueError(f"EngineConfig.tp_timeout_s must be a positive number of seconds, got {t!r}")
        u = self.gpu_memory_utilization
        if not isinstance(u, (int, float)) or isinstance(u, bool) or not 0.0 < u <= 1.0:
            raise ValueError(f"EngineConfig.gpu_memory_utilization must be in (0, 1], got {u!r}")
        for name in ("enable_prefix_caching", "cuda_graphs", "graphs_at_start"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("fused_projections", "overlap_steps"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be True, False or None, got {getattr(self, name)!r}")
        sizes = self.graph_batch_sizes
        if sizes is not None and (not isinstance(sizes, (tuple, list)) or
                                  not all(isinstance(s, int) and s >= 1 for s in sizes)):
            raise ValueError(f"EngineConfig.graph_batch_sizes must be a tuple of ints >= 1, got {sizes!r}")

    def _check_nodes(self) -> None:
        if self.node_rank >= self.nnodes:
            raise ValueError(f"EngineConfig.node_rank must be in 0..nnodes - 1 = {self.nnodes - 1}, got {self.node_rank}")
        if self.master_port > 65535:
            raise ValueError(f"EngineConfig.master_port must be a TCP port (1..65535), got {self.master_port}")
        if not isinstance(self.master_addr, str) or not self.master_addr.strip():
            raise ValueError(f"EngineConfig.master_addr must be node 0's host name or address, got {self.master_addr!r}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"EngineConfig.tensor_parallel_size {self.tensor_parallel_size} does not split over "
                             f"{self.nnodes} nodes: each node runs tensor_parallel_size / nnodes ranks (e.g. "
                             f"--nnodes 2 with -tp 4: 2 GPUs a node)")

    def for_device(self, device: str) -> "EngineConfig":
        """This config with each setting left as None given the device's default (_PER_DEVICE)."""
        kind = "cuda" if device.startswith("cuda") else "cpu"
        return replace(self, **{name: defaults[kind] for name, defaults in _PER_DEVICE.items()
                                if getattr(self, name) is None})

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        for name in ("fused_projections", "overlap_steps"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be True, False or None, got {getattr(self, name)!r}")
        sizes = self.graph_batch_sizes or default_graph_sizes(self.max_num_seqs)
        return tuple(sorted(s for s in sizes if s <= self.max_num_seqs))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def merged(cls, config, settings: dict) -> "EngineConfig":
        """Engine(config=..., **settings): the settings over config (or over the defaults); a TypeError names
        a setting that does not exist."""
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        unknown = sorted(set(settings) - set(cls.names()))
        if unknown:
            raise TypeError(f"Engine() got unexpected keyword argument(s) {', '.join(map(repr, unknown))} (engine "
                            f"settings: {', '.join(cls.names())})")
        return cls(**settings) if config is None else replace(config, **settings)
