"""What a request is checked against before it is queued: its prompt (text or ids, in the vocabulary, within the
context), its sampling values, its window, and the constraint or trigger it carries (structured output).

One Admission serves the Engine and the server's EngineProcess alike: the process's parent checks a request
with the values its child sent (tokenizer, config, generation defaults) and gives the same errors, with the
same messages, as the child's Engine would, without a round trip.
"""
from __future__ import annotations

import random
import threading

import numpy as np

from ..chat import render_chat_template
from ..constraints import Constraints, Trigger, ll_tokenizer, mask_threads
from ..engine_args import check_text, token_sequence
from ..sampling import SamplingParams, check_sampling_names, eos_union, resolve_sampling
from .sequence import Sequence


class Admission:
    def __init__(self, tokenizer, config, generation_config: dict, chat_template, source: str, max_seq_len: int,
                 engine_config):
        self.tokenizer, self.config, self.generation_config = tokenizer, config, generation_config
        self.chat_template, self.source, self.max_seq_len = chat_template, source, max_seq_len
        self.engine_config = engine_config
        self._constraints, self._ll_lock = None, threading.Lock()

    # ---- prompts ----------------------------------------------------------------------------------
    def tokenize(self, prompt) -> list[int]:
        """Engine.tokenize: text gets BOS where the model wants it; ids are checked as a sequence of ints."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            check_text("prompt", prompt)
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return token_sequence("prompt", prompt)

    def render_chat(self, messages, add_generation_prompt: bool = True, tools: list | None = None) -> list[int]:
        """Engine.render_chat: the messages through the model's chat template, tokenized."""
        if not self.chat_template:
            raise ValueError(f"{self.source} has no chat template; use generate() with a raw prompt")
        text = render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.tokenizer.bos_token, eos_token=self.tokenizer.eos_token,
                                    tools=tools)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_ids(self, ids: list, limit: bool = True) -> list[int]:
        """ids as ints of the vocabulary; limit: fewer than max_seq_len (a windowed request has no limit)."""
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        vocab = self.config.vocab_size
        # plain ints (what tokenizers and most callers give): checked at C speed. 256 prompts of ~560 ids
        # cost ~190 ms one by one, on the step loop's thread (5% of bench/throughput.py on an H200)
        if isinstance(ids, list) and set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab:
            ids = list(ids)
        else:
            for i, t in enumerate(ids):
                if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < vocab:
                    raise ValueError(f"token id at position {i} is {t!r}, not an int in [0, {vocab})")
            ids = [int(t) for t in ids]
        if limit:
            self.check_length(ids)
        return ids

    def check_length(self, ids: list[int]) -> None:
        """ids (checked ones) fit the context: fewer than max_seq_len."""
        if len(ids) >= self.max_seq_len:
            raise ValueError(f"prompt has {len(ids)} tokens but the context holds {self.max_seq_len} "
                             f"(raise max_seq_len: Engine(max_seq_len=N) or `--max-seq-len N` in the CLI, up to "
                             f"{self.config.max_position_embeddings} for this model)")

    def encode(self, prompt) -> list[int]:
        return self.check_ids(self.tokenize(prompt), limit=False)  # the length: checked, by the window

    # ---- sampling ---------------------------------------------------------------------------------
    def params(self, call: str, sampling: dict) -> SamplingParams:
        """The request's SamplingParams: its keywords over the model's generation defaults, every value checked."""
        check_sampling_names(call, sampling)
        params = resolve_sampling(self.generation_config, **sampling)
        vocab = self.config.vocab_size
        for t in params.stop_token_ids:
            if t >= vocab:
                raise ValueError(f"stop_token_ids: {t} is not a token id of this model (vocab size {vocab})")
        return params

    def window(self, params: SamplingParams) -> tuple[int, int]:
        """(kv_window, sink_tokens) of a request: its own, else the engine's; no sinks without a window."""
        cfg = self.engine_config
        window = cfg.kv_window if params.kv_window is None else params.kv_window
        sinks = cfg.sink_tokens if params.sink_tokens is None else params.sink_tokens
        return window, sinks if window else 0

    def checked(self, ids: list[int], params: SamplingParams, limits) -> tuple[int, int]:
        """(kv_window, sink_tokens) of a request of these ids, once it is known it can ever run: within the
        context unless windowed, and within the KV pool (limits: the EngineCore, or what a process's child sent)."""
        window, sinks = self.window(params)
        if not window:
            self.check_length(ids)  # the context's limit (the ids were checked when encoded)
        limits.check_fits(len(ids), params.max_new_tokens, window, sinks)
        return window, sinks

    # ---- the sequence ---------------------------------------------------------------------------------
    def sequence(self, ids: list[int], params: SamplingParams, window: int, sinks: int) -> Sequence:
        """The request's Sequence: its stop ids, seed, window, and the constraint (or the trigger that starts
        one inside the output) it carries; a bad schema, regex or grammar raises here, at submit."""
        eos = params.stop_token_ids if params.ignore_eos else eos_union(
            self.generation_config, self.tokenizer.eos_token_ids, params.stop_token_ids)
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        seq = Sequence(ids, params, seed, frozenset(eos), kv_window=window, sink_tokens=sinks)
        if params.constraint is not None and params.grammar_trigger is None and params.opening_grammar is None:
            seq.constraint = self.constraints().new(params.constraint)
        elif params.constraint is not None or params.opening_grammar is not None:
            seq.trigger = self._trigger(params)
        return seq

    def _trigger(self, params: SamplingParams) -> Trigger:
        """The constraints that start inside the output (grammar_trigger, opening_grammar)."""
        made, token, after, opening = self.constraints(), None, None, None
        if params.grammar_trigger is not None:
            token = self.tokenizer.token_to_id(params.grammar_trigger)
            if token is None:
                raise ValueError(f"grammar_trigger {params.grammar_trigger!r} is not one token of this model's "
                                 f"vocabulary")
            after = made.new(params.constraint)
        if params.opening_grammar is not None:
            opening = made.new(params.opening_grammar)
        return Trigger(token, after, opening, lambda t: not self.tokenizer.decode([t]).strip())

    def constraints(self) -> Constraints:
        """The requests' matchers over llguidance's view of the vocabulary (structured output), built on first
        use (~1 s) and kept."""
        with self._ll_lock:
            if self._constraints is None:
                eos = eos_union(self.generation_config, self.tokenizer.eos_token_ids)
                self._constraints = Constraints(ll_tokenizer(self.tokenizer, self.config.vocab_size, eos),
                                                lanes=mask_threads(self.engine_config.mask_threads))
            return self._constraints

    def ll_tokenizer(self):
        return self.constraints().lltok
