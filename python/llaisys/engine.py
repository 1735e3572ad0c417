"""The Engine: load a Qwen2-family model and generate, stream or chat with it.

    eng = llaisys.Engine("qwen2.5-coder-0.5b-instruct")          # catalog name, HF dir, .gguf or repo id
    print(eng.chat([{"role": "user", "content": "Hi"}]).text)
    for chunk in eng.stream("def fib(n):", max_new_tokens=64):
        print(chunk.text, end="", flush=True)

One sequence is generated at a time. Its keys/values stay in the model's KV cache between calls, so a
follow-up prompt that starts with the previous conversation only prefills what is new.
"""
from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from . import _core, catalog, loader
from ._runtime import cuda_is_available
from ._tensor import _wrap
from .chat import render_chat_template
from .sampling import SamplingParams, eos_union, resolve_sampling
from .stops import StopStringMatcher
from .streaming import IncrementalDetokenizer

DEFAULT_MAX_SEQ_LEN = 8192  # KV cache size when the caller does not choose (the model may allow more)


@dataclass
class StreamChunk:
    """A piece of streamed output. The last chunk has finish_reason, usage and timings set."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: dict | None = None
    timings: dict | None = None


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    usage: dict = field(default_factory=dict)  # prompt_tokens, completion_tokens
    timings: dict = field(default_factory=dict)  # ttft_s, prefill_tokens_per_s, decode_tokens_per_s


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda:0" if cuda_is_available() else "cpu"
    if device == "cuda":
        return "cuda:0"
    return device


def _resolve_dtype(dtype: str) -> str:
    names = {"auto": "bf16", "bf16": "bf16", "bfloat16": "bf16", "f16": "f16", "float16": "f16", "f32": "f32",
             "float32": "f32"}
    if dtype not in names:
        raise ValueError(f"dtype must be one of auto, bf16, f16, f32; got {dtype!r}")
    return names[dtype]


class Engine:
    """A loaded model plus its tokenizer, chat template and generation defaults."""

    def __init__(self, model: str = catalog.DEFAULT_MODEL, device: str = "auto", dtype: str = "auto",
                 max_seq_len: int | None = None, progress: bool = True):
        loaded = loader.load(catalog.resolve(str(model)), progress=progress)
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.chat_template = loaded.chat_template
        self.generation_config = {**catalog.generation_defaults(str(model)), **loaded.generation_config}
        self.source = loaded.source
        self.device = _resolve_device(device)
        self.dtype = _resolve_dtype(dtype)
        limit = self.config.max_position_embeddings
        if max_seq_len is None:
            max_seq_len = min(limit, DEFAULT_MAX_SEQ_LEN)
        if not isinstance(max_seq_len, int) or not 1 <= max_seq_len <= limit:
            raise ValueError(f"max_seq_len must be an int in [1, {limit}] for this model, got {max_seq_len!r}")
        self.max_seq_len = max_seq_len
        self._model = _core.Qwen2(self._config_dict(), self.dtype, self.device, max_seq_len)
        self._load_weights(loaded.weights, progress)
        self._cached: list[int] = []  # the tokens whose keys/values are in the cache, in order
        self._generation = 0  # bumped by every call that touches the cache

    def _config_dict(self) -> dict:
        c = self.config
        return dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                    num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                    num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                    rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings)

    def _load_weights(self, weights: dict, progress: bool) -> None:
        from tqdm import tqdm

        names = list(weights)
        for name in tqdm(names, desc=f"uploading to {self.device}", unit="tensor", disable=not progress,
                         file=sys.stderr, leave=False):
            # weights may be read-only views of the mapped checkpoint: the model never writes them
            self._model.load_weight(name, _wrap(np.ascontiguousarray(weights.pop(name))))
        missing = self._model.missing_weights()
        if missing:
            raise ValueError(f"{self.source}: missing weights, e.g. {missing[:3]}")

    # ---- public API ---------------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], **sampling) -> GenerationResult:
        """Generate a completion of a raw prompt (text, or token ids). Sampling arguments left as None
        come from the model's generation_config.json; temperature=0 is greedy."""
        return self._collect(self.stream(prompt, **sampling))

    def stream(self, prompt: str | Sequence[int], **sampling) -> Iterator[StreamChunk]:
        """Like generate(), yielding text deltas (always whole UTF-8 characters) as they are produced."""
        params = resolve_sampling(self.generation_config, **sampling)
        return self._stream_ids(self._encode(prompt), params)

    def chat(self, messages: list[dict], stream: bool = False, add_generation_prompt: bool = True, **sampling):
        """Render messages with the model's chat template and generate the assistant's reply."""
        if not self.chat_template:
            raise ValueError(f"{self.source} has no chat template; use generate() with a raw prompt")
        text = render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.tokenizer.bos_token, eos_token=self.tokenizer.eos_token)
        params = resolve_sampling(self.generation_config, **sampling)
        chunks = self._stream_ids(self._check_ids(self.tokenizer.encode(text, add_special_tokens=False)), params)
        return chunks if stream else self._collect(chunks)

    def score(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits for every position of token_ids, [len, vocab] float32 (teacher forcing)."""
        ids = self._check_ids(list(token_ids))
        self.reset()
        logits = self._model.forward([0], [ids], all_logits=True)
        out = np.asarray(logits.to("cpu").to("f32").numpy(), dtype=np.float32).copy()
        self.reset()  # the cache now holds ids; forget them so the next call starts clean
        return out

    def reset(self) -> None:
        """Forget the cached conversation."""
        self._generation += 1
        self._model.truncate(0, 0)
        self._cached = []

    # ---- internals ----------------------------------------------------------------------------

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return self._check_ids(self.tokenizer.encode(prompt, add_special_tokens=True))
        return self._check_ids(list(prompt))

    def _check_ids(self, ids: list) -> list[int]:
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        vocab = self.config.vocab_size
        for i, t in enumerate(ids):
            if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"token id at position {i} is {t!r}, not an int in [0, {vocab})")
        if len(ids) >= self.max_seq_len:
            raise ValueError(f"prompt has {len(ids)} tokens but the context holds {self.max_seq_len} "
                             f"(pass max_seq_len= to Engine, up to {self.config.max_position_embeddings})")
        return [int(t) for t in ids]

    def _reuse_prefix(self, ids: list[int]) -> list[int]:
        """Keep the cached tokens shared with ids; return the tokens still to prefill (at least one)."""
        common = 0
        for a, b in zip(self._cached, ids):
            if a != b:
                break
            common += 1
        common = min(common, len(ids) - 1)
        self._model.truncate(0, common)
        del self._cached[common:]
        return ids[common:]

    def _sampling(self, params: SamplingParams) -> "_core.SamplingParams":
        sp = _core.SamplingParams()
        sp.temperature, sp.top_k, sp.top_p = params.temperature, params.top_k, params.top_p
        sp.min_p, sp.repetition_penalty = params.min_p, params.repetition_penalty
        return sp

    def _stream_ids(self, ids: list[int], params: SamplingParams) -> Iterator[StreamChunk]:
        eos = set(params.stop_token_ids) if params.ignore_eos else set(
            eos_union(self.generation_config, self.tokenizer.eos_token_ids, params.stop_token_ids))
        budget = min(params.max_new_tokens, self.max_seq_len - len(ids))
        return self._decode_loop(ids, params, eos, budget)

    def _decode_loop(self, ids, params, eos, budget) -> Iterator[StreamChunk]:
        sp = self._sampling(params)
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        penalised = set(ids) if params.repetition_penalty != 1.0 else None
        detok = IncrementalDetokenizer(self.tokenizer.inner, skip_special_tokens=True)
        stops = StopStringMatcher(params.stop)
        self._generation += 1  # any other call from now on invalidates this generator (one KV cache)
        mine = self._generation
        generated, pending, finish, tail, first = [], [], "length", None, None
        start = time.perf_counter()
        try:
            feed = self._reuse_prefix(ids)
            prefill_len = len(feed)
            while len(generated) < budget:
                if penalised is not None:
                    sp.penalty_ids = sorted(penalised)
                token = self._model.forward_sample([0], [feed], [sp], seed, len(generated))[0]
                self._cached.extend(feed)
                first = first or time.perf_counter()
                generated.append(token)
                pending.append(token)  # ids travel with the next chunk that carries text
                if token in eos:
                    finish = "stop"
                    break
                if penalised is not None:
                    penalised.add(token)
                text, hit = stops.feed(detok.step(token))
                if hit:  # text is what came before the stop string
                    finish, tail = "stop", text
                    break
                if text:
                    yield StreamChunk(text, pending)
                    pending = []
                    self._check_still_active(mine)
                feed = [token]
        finally:
            self._sync_cache()
        if tail is None:  # EOS or length: a last partial character, then what was held back as a stop prefix
            tail, hit = stops.feed(detok.flush())
            tail += "" if hit else stops.flush()
            if stops.hit:  # a stop string that only completed in this final text
                finish = "stop"
        yield StreamChunk(tail, pending, finish, self._usage(ids, generated),
                          self._timings(start, first, prefill_len, len(generated)))

    def _check_still_active(self, mine: int) -> None:
        if self._generation != mine:
            raise RuntimeError("another generate/stream/chat/score/reset call used this engine while this stream "
                               "was paused; its KV cache no longer holds this stream's context (use one Engine "
                               "per concurrent stream)")

    def _sync_cache(self) -> None:
        # After an interrupt the cache and our record of it may disagree by one step: keep what both hold.
        n = min(self._model.cache_length(0), len(self._cached))
        self._model.truncate(0, n)
        del self._cached[n:]

    @staticmethod
    def _usage(ids, generated) -> dict:
        return {"prompt_tokens": len(ids), "completion_tokens": len(generated)}

    @staticmethod
    def _timings(start, first, prefill_len: int, n_generated: int) -> dict:
        end = time.perf_counter()
        ttft = (first - start) if first else 0.0
        decode_s = end - first if first else 0.0
        return {"ttft_s": ttft, "prefill_tokens_per_s": prefill_len / ttft if ttft > 0 else 0.0,
                "decode_tokens_per_s": (n_generated - 1) / decode_s if decode_s > 0 and n_generated > 1 else 0.0,
                "total_s": end - start}

    @staticmethod
    def _collect(chunks: Iterator[StreamChunk]) -> GenerationResult:
        text, ids, last = [], [], None
        for chunk in chunks:
            text.append(chunk.text)
            ids.extend(chunk.token_ids)
            last = chunk
        return GenerationResult("".join(text), ids, last.finish_reason, last.usage, last.timings)
