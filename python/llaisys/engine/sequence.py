"""A request's sequence as the scheduler and block manager see it: token ids, KV blocks, progress."""
from __future__ import annotations

import enum
import itertools

from ..sampling import SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """prompt + generated tokens. num_computed tokens have their keys/values in the blocks of
    block_table; a step computes the next ones (a prefill chunk, or the one new token of a decode)."""

    def __init__(self, prompt: list[int], params: SamplingParams, seed: int, eos: frozenset[int],
                 kv_window: int = 0, sink_tokens: int = 0):
        self.seq_id = next(_ids)
        self.tokens = list(prompt)
        self.num_prompt = len(prompt)
        self.params = params
        self.seed = seed
        self.eos = eos
        self.status = Status.WAITING
        self.block_table: list[int] = []
        # tokens still to compute before the next token can be sampled (1 for a decode step); num_computed, the
        # tokens whose keys/values are in block_table, is len(tokens) - remaining. Kept this way round so that a
        # decode's token appended to `tokens` alone also counts the token before it as computed: the persistent
        # batch advances its rows by one list append each (DecodeBatch.advance), no attribute write. Appending
        # a token that is not computed goes through append(), which keeps num_computed.
        self.remaining = len(self.tokens)
        # StreamingLLM (block_manager.py, slide): a windowed sequence keeps its first sink blocks and about
        # kv_window tokens after them; `evicted` tokens after the sinks have left its cache, so token t >= the
        # sinks' end sits at cache index t - evicted, which is also its RoPE position. kv_window 0: dense.
        self.kv_window, self.sink_tokens, self.evicted = kv_window, sink_tokens, 0
        self.skip = 0  # tokens after the sinks a long admission leaves uncomputed (BlockManager.skip_ahead)
        self.registered, self.chain = 0, None  # full blocks registered in the prefix cache, last one's hash
        self.num_cached_prompt = 0  # prompt tokens found in the prefix cache (reported in usage)
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        # repetition_penalty (HF: prompt and output tokens): the runner keeps the set on the device, in its
        # row seen_row of the seen bitmasks (engine/seen.py; None until its first step samples)
        self.penalised = params.repetition_penalty != 1.0
        self.seen_row: int | None = None
        # generated-token counts for the presence/frequency penalties (OpenAI: output tokens only)
        self.counts: dict[int, int] | None = (
            {} if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 else None)
        # structured output: a constraints.Constraint (the engine sets it when params.constraint is set)
        self.constraint = None
        # a constraints.Trigger: the constraint that becomes `constraint` where the output begins it
        # (SamplingParams.grammar_trigger / opening_grammar); None once it fired
        self.trigger = None
        # quiet: its consumer reads its output from `tokens` once it ends (a Request that keeps its ids), and its
        # logprobs, if it asked for them, from lp_log. A step of the persistent batch lists a quiet row's token
        # only when the row ends (DecodeBatch.quiet): no per-token delivery for it (issue 33)
        self.quiet = False
        # a quiet sequence's logprobs in order (engine/logprobs_log.py): the entries the step loop was handed
        # (its first token's, the general path's), and Spans of the batch layouts' logs that hold the rest's
        # arrays; Request.finish copies those out, built into entries when the caller reads them. None: not kept so
        self.lp_log: list | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def output(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def num_computed(self) -> int:
        return len(self.tokens) - self.remaining

    @num_computed.setter
    def num_computed(self, n: int) -> None:
        self.remaining = len(self.tokens) - n

    def append(self, token: int) -> None:
        """A sampled token, not computed yet (num_computed unchanged)."""
        self.tokens.append(token)
        self.remaining += 1
        if self.counts is not None:
            self.counts[token] = self.counts.get(token, 0) + 1

    def biases(self, ahead: int = 0) -> dict[int, float]:
        """Logit biases for this step: -(presence + frequency * count) per generated token, and -inf on
        EOS / stop_token_ids while fewer than min_tokens have been generated. ahead: a step chained behind
        `ahead` launched steps whose tokens the host has not read (their count is known, their tokens not:
        so a chained row may have the min_tokens ban, never counts)."""
        p, out = self.params, {}
        if self.counts:
            out = {t: -(p.presence_penalty + p.frequency_penalty * c) for t, c in self.counts.items()}
        if self.num_output + ahead < p.min_tokens:
            out.update(dict.fromkeys(self.eos, float("-inf")))
        return out
