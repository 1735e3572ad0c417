"""The Engine: load a model (any architecture of the core's tables) and generate, stream or chat with it, many requests at once.

    eng = llaisys.Engine("qwen2.5-coder-0.5b-instruct")          # catalog name, HF dir, .gguf or repo id
    print(eng.chat([{"role": "user", "content": "Hi"}]).text)
    results = eng.generate(["def add(a, b):", "# quicksort"], seed=[1, 2], temperature=0.7)
    for chunk in eng.stream("def fib(n):", max_new_tokens=64):
        print(chunk.text, end="", flush=True)

Every call becomes requests of one background step loop that batches all running sequences over a paged
KV cache with prefix caching; any thread may call any method at any time, and each caller gets its own
answer. submit() is the request interface for servers (iterate the handle, abort() it).
"""
from __future__ import annotations

import atexit
import weakref
from typing import Iterator, Sequence as Seq

import numpy as np

from .. import _core, catalog, loader
from ..loader.header import context_length
from ..engine_args import (check_max_seq_len, check_model_arg, resolve_device, resolve_dtype, token_sequence,
                           trim_heap, weight_policy, freeze_heap, thaw_heap)
from ..sampling import SamplingParams, check_sampling_names, resolve_sampling
from .admission import Admission
from .config import EngineConfig
from .core import EngineCore
from .kv_budget import kv_blocks_for
from .score import score_logits
from .loop import StepLoop
from .prompts import split_sampling
from .ranks import keep_if_left_behind, load_weights, make_models, rank_devices
from .request import (ChunkSink, GenerationResult, Request, StreamChunk, check_incremental, check_sink,
                      chunks_or_abort, results_or_abort)

_OPEN: "weakref.WeakSet[Engine]" = weakref.WeakSet()  # closed at exit, before the extension is torn down
atexit.register(lambda: [e.close() for e in list(_OPEN)])

DEFAULT_MAX_SEQ_LEN = 8192  # context per sequence when the caller does not choose (the model may allow more)

__all__ = ["Engine", "EngineConfig", "GenerationResult", "StreamChunk", "Request", "ChunkSink"]


class Engine:
    """A loaded model plus its tokenizer, chat template, generation defaults and batched runtime."""

    def __init__(self, model: str = catalog.DEFAULT_MODEL, device: str = "auto", dtype: str = "auto",
                 max_seq_len: int | None = None, progress: bool = True, config: EngineConfig | None = None,
                 **settings):
        self._loop = None  # set last: close() and a failed __init__ leave an engine without one
        # every argument is checked before any file is read, and max_seq_len against the model's context
        # from its config alone, before the tokenizer is built or any weight is read
        self._check_arguments(device, dtype, max_seq_len, config, settings)
        model = check_model_arg(model)
        path = catalog.resolve(model)
        check_max_seq_len(max_seq_len, context_length(path))
        # no local name for the loaded model: _start drops the last reference once the weights are uploaded
        self._start(loader.load(path, progress=progress), catalog.generation_defaults(model), max_seq_len, progress)

    @classmethod
    def from_loaded(cls, loaded: loader.LoadedModel, device: str = "auto", dtype: str = "auto",
                    max_seq_len: int | None = None, progress: bool = True, config: EngineConfig | None = None,
                    **settings) -> "Engine":
        """An Engine over a model already in memory (a loader.LoadedModel, e.g. random weights of a real
        shape for a benchmark: bench/llaisys_bench/shapes.py, random_loaded). Takes the same arguments as Engine()."""
        if not isinstance(loaded, loader.LoadedModel):
            raise TypeError(f"from_loaded() takes a loader.LoadedModel, got {type(loaded).__name__}")
        self = cls.__new__(cls)
        self._loop = None
        self._check_arguments(device, dtype, max_seq_len, config, settings)
        self._start(loaded, {}, max_seq_len, progress)
        return self

    def _check_arguments(self, device, dtype, max_seq_len, config, settings) -> None:
        self.dtype = resolve_dtype(dtype)
        self.device = resolve_device(device)
        check_max_seq_len(max_seq_len)
        self.engine_config = EngineConfig.merged(config, settings).for_device(self.device)
        ec = self.engine_config
        self.devices = rank_devices(self.device, ec.tensor_parallel_size // ec.nnodes)
        if ec.nnodes > 1 and not self.device.startswith("cuda") and len(self.devices) > 1:
            raise ValueError(f"on the CPU a node runs one rank (the socket group: comm_socket.cpp), so "
                             f"tensor_parallel_size must equal nnodes ({ec.nnodes}), got {ec.tensor_parallel_size}")

    def _start(self, loaded: loader.LoadedModel, generation_defaults: dict, max_seq_len: int | None,
               progress: bool) -> None:
        """Uploads the weights, sizes the KV pool and starts the step loop."""
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.chat_template = loaded.chat_template
        self.generation_config = {**generation_defaults, **loaded.generation_config}
        self.source = loaded.source
        limit = self.config.max_position_embeddings
        check_max_seq_len(max_seq_len, limit)
        self.max_seq_len = int(min(limit, DEFAULT_MAX_SEQ_LEN) if max_seq_len is None else max_seq_len)
        self._admit = Admission(self.tokenizer, self.config, self.generation_config, self.chat_template,
                                self.source, self.max_seq_len, self.engine_config)
        # whether a GGUF file's blocks are kept, and the compute dtype: engine_args.weight_policy says why
        self.quantized, self.dtype = weight_policy(self.dtype, self.device, loaded.weights.quantized, loaded.source)
        # the KV budget before the upload, where it does not depend on the memory the weights leave free
        if not self.device.startswith("cuda"):
            kv_blocks_for(self.engine_config, self.config, self.dtype, self.device, self.max_seq_len)
        # the model is only weights and layer math (one share per rank when split over several devices); the
        # KV pool, graphs and sampling are EngineCore's
        ec = self.engine_config
        self._node = None  # a group spanning processes: this one's end (engine/nodes.py)
        if ec.nnodes > 1:
            from .rendezvous import engine_hello, rendezvous
            hello = engine_hello(ec, self.dtype, self.quantized, self.device, self.max_seq_len, self.config.core)
            self._node = rendezvous(ec, hello, self.device, progress)
        try:
            nets = make_models(self.config, self.dtype, self.devices, ec.fused_projections, ec.tp_timeout_s,
                               self._node)
            self._load_weights(nets, loaded.weights, progress)
            for net in nets:
                net.prepare()  # before the KV pool takes the free device memory
            del loaded
            trim_heap()
            self._core = EngineCore(nets, self.config, ec, self.dtype, self.device, self.max_seq_len, self._node)
            c = self._core.config
            if c.cuda_graphs and c.graphs_at_start and self._node is None and self.device.startswith("cuda"):
                self._core.runner.capture_graphs(c.graph_sizes, progress)
        except BaseException:
            if self._node is not None:  # the other nodes see the connection close, and say so
                self._node.closing = True
                self._node.close()
            raise
        self._model = nets[0]
        self._models = nets
        if self._node is not None:
            self._node.start()
        if ec.node_rank == 0:  # a follower's steps are node 0's (follow())
            self._loop = StepLoop(self._core, self.engine_config.max_queued_requests)
        _OPEN.add(self)
        freeze_heap()

    def _load_weights(self, models: list, weights, progress: bool) -> None:
        node = self._node
        load_weights(models, self.config, weights, self.quantized, progress, self.source,
                     node.first_rank if node else 0, node.world if node else None)

    def follow(self) -> None:
        """A follower (node_rank > 0): runs node 0's steps on this node's ranks until node 0 closes
        (returns) or the group breaks (RuntimeError saying why); the engine is closed after."""
        if getattr(self, "_node", None) is None or self._node.rank == 0:
            raise RuntimeError("follow() is for an engine with node_rank > 0 (node 0 schedules and serves)")
        try:
            from .node_steps import follow
            follow(self._node, self._core.runner.runner)
        finally:
            self.close()

    # ---- public API ---------------------------------------------------------------------------

    def describe(self) -> dict:
        """What the loaded model holds: its compute dtype, and per stored weight format (bf16, q4_k, ...) the
        number of tensors and their bytes on the device (quantized weights count their block bytes).
        decode_scratch_bytes: on CUDA with quantized weights, the one buffer prefill and batches of more than
        8 sequences decode each quantized weight into before the dense GEMM (the compute dtype, as large as
        the largest weight; 0 otherwise), not part of weight_bytes."""
        self._open()
        formats: dict[str, dict] = {}
        for _, fmt, nbytes in self._model.weight_formats():
            entry = formats.setdefault(fmt, {"tensors": 0, "bytes": 0})
            entry["tensors"] += 1
            entry["bytes"] += int(nbytes)
        return {"source": self.source, "device": self.device, "dtype": self.dtype, "quantized": self.quantized,
                "weight_formats": formats, "weight_bytes": int(sum(m.weight_bytes for m in self._models)),
                "decode_scratch_bytes": int(self._model.decode_scratch_bytes),
                "tensor_parallel_size": self.engine_config.tensor_parallel_size, "devices": list(self.devices),
                "nnodes": self.engine_config.nnodes}

    def generate(self, prompt, **sampling):
        """Complete a raw prompt (text or token ids), or a list of them (one result each, in order).
        Each sampling keyword takes one value, or (for a list) one value per prompt. Arguments left as
        None come from the model's generation_config.json; temperature=0 is greedy. Structured output:
        json_schema= (a dict or its JSON), regex=, grammar= (Lark) or choice= (a list of strings), at most one
        per prompt; the text then obeys it (llaisys.constraints), ending with "stop" when complete."""
        if self._is_batch(prompt):
            per = split_sampling("generate", sampling, len(prompt))
            for s in per:
                check_sampling_names("generate", s)
            reqs = self._submit_all([(self._admit.encode(p), self._params("generate", s)) for p, s in zip(prompt, per)],
                                    incremental=False)
            return results_or_abort(reqs)
        req = self._submit_ids(self._admit.encode(prompt), self._params("generate", sampling), incremental=False)
        return results_or_abort([req])[0]

    def stream(self, prompt, **sampling) -> Iterator[StreamChunk]:
        """Like generate() for one prompt, yielding text deltas (always whole UTF-8 characters) as they are
        produced; the last chunk carries finish_reason, usage and timings. Closing the iterator aborts."""
        params = self._params("stream", sampling)
        return chunks_or_abort(self._submit_ids(self._admit.encode(prompt), params))

    def submit(self, prompt, sink: ChunkSink | None = None, incremental: bool = True, **sampling) -> Request:
        """The request interface for servers: queue one prompt and return its handle at once. Iterate the
        handle (from any thread) for its StreamChunks, call result() to wait for all, abort() to stop it.
        With a sink (request.ChunkSink), the chunks go there instead, put and flushed by the step loop
        thread: a server reading many requests wakes once per step, not once per token and request.
        incremental=False: for a caller that reads only the end (a non-streaming response): the ids are
        kept and decoded once, and the request gives ONE chunk, its last, equal to what its chunks would
        merge into (request.merge_chunks). A request with stop strings stays incremental (they need the
        text as it grows, to stop where the stop string ends), so it still gives its chunks as they come."""
        check_sink(sink)
        check_incremental(incremental)
        return self._submit_ids(self._admit.encode(prompt), self._params("submit", sampling), sink, incremental)

    def chat(self, messages, stream: bool = False, add_generation_prompt: bool = True, **sampling):
        """Render messages with the model's chat template and generate the assistant's reply; a list of
        conversations gives a list of replies (stream=False only)."""
        for name, value in (("stream", stream), ("add_generation_prompt", add_generation_prompt)):
            if not isinstance(value, bool):
                raise TypeError(f"chat(): {name} must be True or False, got {value!r}")
        batch = isinstance(messages, (list, tuple)) and bool(messages) and all(
            isinstance(m, (list, tuple)) for m in messages)
        if batch and stream:
            raise ValueError("chat(): stream=True takes one conversation, not a list of them")
        convs = list(messages) if batch else [messages]
        ids = [self._admit.check_ids(self.render_chat(m, add_generation_prompt), limit=False) for m in convs]
        per = split_sampling("chat", sampling, len(convs)) if batch else [sampling]
        reqs = self._submit_all([(i, self._params("chat", s)) for i, s in zip(ids, per)], incremental=stream)
        if stream:
            return chunks_or_abort(reqs[0])
        results = results_or_abort(reqs)
        return results if batch else results[0]

    def tokenize(self, prompt) -> list[int]:
        """A raw prompt (text, or token ids) as the token ids a request gets, before the vocabulary and
        context checks of submitting it (text gets BOS when the model wants it)."""
        return self._admit.tokenize(prompt)

    def render_chat(self, messages, add_generation_prompt: bool = True, tools: list | None = None) -> list[int]:
        """Messages rendered with the model's chat template and tokenized, as chat() submits them; tools
        (OpenAI-style function specs) are rendered by the template where it supports them."""
        return self._admit.render_chat(messages, add_generation_prompt, tools)

    def score(self, token_ids: Seq[int], kv_window: int | None = None, sink_tokens: int | None = None) -> np.ndarray:
        """Logits for every position of token_ids, [len, vocab] float32 (teacher forcing). kv_window /
        sink_tokens (None: the engine's defaults, EngineConfig): through the rolling cache a windowed
        generation uses (StreamingLLM), in chunks of one block; then token_ids may be longer than the context."""
        window, sinks = self._admit.window(resolve_sampling({}, kv_window=kv_window, sink_tokens=sink_tokens))
        ids = self._admit.check_ids(token_sequence("token_ids", token_ids), limit=not window)

        def run():
            logits = score_logits(self._core, ids, window, sinks)
            if isinstance(logits, np.ndarray):
                return logits
            return np.asarray(logits.to("cpu").to("f32").numpy(), dtype=np.float32).copy()
        return self._open().call(run)

    def check_window(self, kv_window, sink_tokens=None) -> None:
        """ValueError for a kv_window / sink_tokens a request of this engine could not use (a CLI checks its
        flags with it before the first turn)."""
        params = resolve_sampling({}, kv_window=kv_window, sink_tokens=sink_tokens)
        window, sinks = self._admit.window(params)
        if window:
            self._open()
            self._core.check_window(window, sinks)

    def stats(self) -> dict:
        """Running and waiting requests, KV blocks used/free, prefix-cache hit rate, preemptions."""
        return self._open().stats()

    def reset(self) -> None:
        """Kept for compatibility: conversations need no reset (the prefix cache finds shared prefixes)."""
        self._open()

    def close(self) -> None:
        """Stop the step loop (running requests end with an error), free the model and KV cache. Later calls
        raise RuntimeError; closing twice is fine."""
        loop, self._loop = self._loop, None
        node, self._node = getattr(self, "_node", None), None
        if loop is None and node is None:
            return
        if loop is not None:
            loop.close()  # joins the loop thread and drops its reference to the core
        del loop
        if node is not None:
            node.close()  # node 0: the followers exit
        keep_if_left_behind(self._core, self._model, self._models)
        self._core = self._model = self._models = None
        thaw_heap()
        if self.device.startswith("cuda"):
            _core.empty_cache(self.device)  # the pool's memory goes back to the driver, not only our cache
        trim_heap()

    @property
    def closed(self) -> bool:
        return self._loop is None

    @property
    def failure(self) -> str | None:
        """Why this engine can run no more steps (its tensor-parallel group broke: a rank failed or stalled),
        else None. A server's /health answers 503 with it."""
        core = getattr(self, "_core", None)
        return (core.broken or None) if core is not None else None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        # the step loop's thread would otherwise keep the model alive until the interpreter exits
        if getattr(self, "_loop", None) is not None:
            self.close()

    # ---- internals ----------------------------------------------------------------------------

    def _open(self) -> StepLoop:
        loop = self._loop
        if loop is None and getattr(self, "_node", None) is not None:
            raise RuntimeError(f"this engine is node {self._node.rank} of {self._node.nnodes}: node 0 schedules "
                               f"and serves, a follower only runs its steps (follow())")
        if loop is None:
            raise RuntimeError("engine is closed: create a new Engine to generate again")
        return loop

    @staticmethod
    def _is_batch(prompt) -> bool:
        """A list/tuple of prompts (str or token-id sequences), as opposed to one list of token ids."""
        return isinstance(prompt, (list, tuple)) and bool(prompt) and all(
            isinstance(p, (str, list, tuple, np.ndarray)) for p in prompt)

    def _params(self, call: str, sampling: dict) -> SamplingParams:
        self._open()
        return self._admit.params(call, sampling)

    def _request(self, ids: list[int], params: SamplingParams, sink: ChunkSink | None = None,
                 incremental: bool = True) -> Request:
        """incremental False: the caller reads only the result (see Request)."""
        window, sinks = self._admit.checked(ids, params, self._core)
        seq = self._admit.sequence(ids, params, window, sinks)
        return Request(seq, self.tokenizer.inner, params.stop, self._open(), sink, incremental)

    def _submit_ids(self, ids: list[int], params: SamplingParams, sink: ChunkSink | None = None,
                    incremental: bool = True) -> Request:
        return self._open().submit(self._request(ids, params, sink, incremental))

    def _submit_all(self, items, incremental: bool = True) -> list[Request]:
        """Every request is built (and checked) before any is queued: one bad item fails the whole call."""
        reqs = [self._request(ids, params, incremental=incremental) for ids, params in items]
        loop, queued = self._open(), []
        try:
            for r in reqs:
                queued.append(loop.submit(r))
        except BaseException:
            for r in queued:
                r.abort()
            raise
        return queued
