"""The Engine: load a Qwen2-family model and generate, stream or chat with it.

    eng = llaisys.Engine("qwen2.5-coder-0.5b-instruct")          # catalog name, HF dir, .gguf or repo id
    print(eng.chat([{"role": "user", "content": "Hi"}]).text)
    for chunk in eng.stream("def fib(n):", max_new_tokens=64):
        print(chunk.text, end="", flush=True)

One sequence is generated at a time. Its keys/values stay in the model's KV cache between calls, so a
follow-up prompt that starts with the previous conversation only prefills what is new. Calls from several
threads are safe and run one after another (a per-Engine lock); a paused stream whose cache another call
has since used raises instead of continuing on the other call's context. close() (or `with Engine(...)`)
frees the model at once.
"""
from __future__ import annotations

import random
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from . import _core, catalog, loader
from ._tensor import _wrap
from .chat import render_chat_template
from .engine_args import (check_max_seq_len, check_model_arg, check_text, resolve_device, resolve_dtype,
                          token_sequence, trim_heap)
from .sampling import SamplingParams, check_sampling_names, eos_union, resolve_sampling
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


class Engine:
    """A loaded model plus its tokenizer, chat template and generation defaults."""

    def __init__(self, model: str = catalog.DEFAULT_MODEL, device: str = "auto", dtype: str = "auto",
                 max_seq_len: int | None = None, progress: bool = True):
        self._lock = threading.RLock()  # one caller at a time drives the model and its KV cache
        self._model = None  # set last: close() and a failed __init__ leave an engine without one
        # every argument is checked before any file is read
        self.dtype = resolve_dtype(dtype)
        self.device = resolve_device(device)
        check_max_seq_len(max_seq_len)
        model = check_model_arg(model)
        loaded = loader.load(catalog.resolve(model), progress=progress)
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.chat_template = loaded.chat_template
        self.generation_config = {**catalog.generation_defaults(model), **loaded.generation_config}
        self.source = loaded.source
        limit = self.config.max_position_embeddings
        if max_seq_len is None:
            max_seq_len = min(limit, DEFAULT_MAX_SEQ_LEN)
        if max_seq_len > limit:
            raise ValueError(f"max_seq_len (CLI: --max-seq-len) must be at most {limit} for this model, "
                             f"got {max_seq_len}")
        self.max_seq_len = int(max_seq_len)
        model_obj = _core.Qwen2(self._config_dict(), self.dtype, self.device, self.max_seq_len)
        self._load_weights(model_obj, loaded.weights, progress)
        del loaded
        trim_heap()
        self._cached: list[int] = []  # the tokens whose keys/values are in the cache, in order
        self._generation = 0  # bumped by every call that touches the cache
        self._model = model_obj

    def _config_dict(self) -> dict:
        c = self.config
        return dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                    num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                    num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                    rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings)

    def _load_weights(self, model, weights: dict, progress: bool) -> None:
        from tqdm import tqdm

        names = list(weights)
        for name in tqdm(names, desc=f"uploading to {self.device}", unit="tensor", disable=not progress,
                         file=sys.stderr, leave=False):
            # weights may be read-only views of the mapped checkpoint: the model never writes them
            model.load_weight(name, _wrap(np.ascontiguousarray(weights.pop(name))))
        missing = model.missing_weights()
        if missing:
            raise ValueError(f"{self.source}: missing weights, e.g. {missing[:3]}")

    # ---- public API ---------------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[int], **sampling) -> GenerationResult:
        """Generate a completion of a raw prompt: a str, or token ids (list/tuple/range of ints or a 1-D integer
        numpy array; bytes raise TypeError: decode them first). Sampling arguments left as None come from the
        model's generation_config.json; temperature=0 is greedy."""
        chunks = self._stream_ids(self._encode(prompt), self._params("generate", sampling))
        with self._lock:  # the whole generation: concurrent calls wait, each gets its own answer
            return self._collect(chunks)

    def stream(self, prompt: str | Sequence[int], **sampling) -> Iterator[StreamChunk]:
        """Like generate(), yielding text deltas (always whole UTF-8 characters) as they are produced.
        The engine is locked during each step only: another call made while the stream is paused takes
        the cache over, and this stream then raises RuntimeError."""
        return self._stream_ids(self._encode(prompt), self._params("stream", sampling))

    def chat(self, messages: list[dict], stream: bool = False, add_generation_prompt: bool = True, **sampling):
        """Render messages with the model's chat template and generate the assistant's reply."""
        for name, value in (("stream", stream), ("add_generation_prompt", add_generation_prompt)):
            if not isinstance(value, bool):
                raise TypeError(f"chat(): {name} must be True or False, got {value!r}")
        params = self._params("chat", sampling)
        if not self.chat_template:
            raise ValueError(f"{self.source} has no chat template; use generate() with a raw prompt")
        text = render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.tokenizer.bos_token, eos_token=self.tokenizer.eos_token)
        chunks = self._stream_ids(self._check_ids(self.tokenizer.encode(text, add_special_tokens=False)), params)
        if stream:
            return chunks
        with self._lock:
            return self._collect(chunks)

    def score(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits for every position of token_ids, [len, vocab] float32 (teacher forcing)."""
        ids = self._check_ids(token_sequence("token_ids", token_ids))
        with self._lock:
            self.reset()
            logits = self._open_model().forward([0], [ids], all_logits=True)
            out = np.asarray(logits.to("cpu").to("f32").numpy(), dtype=np.float32).copy()
            self.reset()  # the cache now holds ids; forget them so the next call starts clean
            return out

    def reset(self) -> None:
        """Forget the cached conversation."""
        with self._lock:
            model = self._open_model()
            self._generation += 1
            model.truncate(0, 0)
            self._cached = []

    def close(self) -> None:
        """Free the model (weights, KV cache) now; later calls raise RuntimeError. Waits for a running
        generate/chat/score; a paused stream raises at its next step. Closing twice is fine."""
        with self._lock:
            if self._model is None:
                return
            self._generation += 1
            self._model = None
            self._cached = []
        trim_heap()

    @property
    def closed(self) -> bool:
        return self._model is None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------------

    def _open_model(self):
        if self._model is None:
            raise RuntimeError("engine is closed: create a new Engine to generate again")
        return self._model

    def _params(self, call: str, sampling: dict) -> SamplingParams:
        self._open_model()
        check_sampling_names(call, sampling)
        params = resolve_sampling(self.generation_config, **sampling)
        vocab = self.config.vocab_size
        for t in params.stop_token_ids:
            if t >= vocab:
                raise ValueError(f"stop_token_ids: {t} is not a token id of this model (vocab size {vocab})")
        return params

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            check_text("prompt", prompt)
            return self._check_ids(self.tokenizer.encode(prompt, add_special_tokens=True))
        return self._check_ids(token_sequence("prompt", prompt))

    def _check_ids(self, ids: list) -> list[int]:
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        vocab = self.config.vocab_size
        for i, t in enumerate(ids):
            if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"token id at position {i} is {t!r}, not an int in [0, {vocab})")
        if len(ids) >= self.max_seq_len:
            raise ValueError(f"prompt has {len(ids)} tokens but the context holds {self.max_seq_len} "
                             f"(raise max_seq_len: Engine(max_seq_len=N) or `--max-seq-len N` in the CLI, up to "
                             f"{self.config.max_position_embeddings} for this model)")
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
        generated, pending, finish, tail, first = [], [], "length", None, None
        start = time.perf_counter()
        with self._lock:  # take the cache over: any other call from now on invalidates this generator
            self._open_model()
            self._generation += 1
            mine = self._generation
            feed = self._reuse_prefix(ids)
        prefill_len = len(feed)
        try:
            while len(generated) < budget:
                if penalised is not None:
                    sp.penalty_ids = sorted(penalised)
                token = self._step(mine, feed, sp, seed, len(generated))
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
                    yield StreamChunk(text, pending)  # unlocked: other threads may run while we are paused
                    pending = []
                feed = [token]
        finally:
            with self._lock:
                if self._generation == mine:  # else the cache is another call's now: leave it alone
                    self._sync_cache()
        if tail is None:  # EOS or length: a last partial character, then what was held back as a stop prefix
            tail, hit = stops.feed(detok.flush())
            tail += "" if hit else stops.flush()
            if stops.hit:  # a stop string that only completed in this final text
                finish = "stop"
        yield StreamChunk(tail, pending, finish, self._usage(ids, generated),
                          self._timings(start, first, prefill_len, len(generated)))

    def _step(self, mine: int, feed: list[int], sp, seed: int, index: int) -> int:
        """Prefill/decode `feed` and sample one token, under the lock and only while this stream owns the cache."""
        with self._lock:
            self._check_still_active(mine)
            token = self._model.forward_sample([0], [feed], [sp], seed, index)[0]
            self._cached.extend(feed)
            return token

    def _check_still_active(self, mine: int) -> None:
        self._open_model()
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
