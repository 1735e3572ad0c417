"""The server's side of the engine: the one place it is imported, prompts turned into token ids, and the
engine requests of one HTTP request merged into one asyncio queue.

Engine requests block their reader, so each is read by a thread of its own that hands chunks to the event
loop (call_soon_threadsafe): the loop never waits on the engine, and a slow stream never holds a worker
that others need (as a shared thread pool of a few workers would).
"""
from __future__ import annotations

import asyncio
import hashlib
import threading

import numpy as np

from ..engine import Engine, StreamChunk
from ..tokenizer import _BYTE_CHARS

__all__ = ["Engine", "StreamChunk", "Generation", "chat_ids", "prompt_ids", "prompt_logprobs", "choice_seed",
           "token_bytes"]

SCORE_ROWS = 256  # log-softmax this many logit rows at a time: float64 copies of [rows, vocab], not [n, vocab]

_CHAR_BYTE = {c: b for b, c in enumerate(_BYTE_CHARS)}


def chat_ids(eng: Engine, messages: list[dict]) -> list[int]:
    """The conversation as Engine.chat submits it; the server's own message when there is no template."""
    if not eng.chat_template:
        raise ValueError(f"the model {eng.source} has no chat template: use /v1/completions with a raw prompt")
    return eng.render_chat(messages)


def prompt_ids(eng: Engine, prompt) -> list[int]:
    """A completion prompt (text or token ids) as the engine reads it (text gets BOS when the model wants)."""
    return eng.tokenize(prompt)


def prompt_logprobs(eng: Engine, ids: list[int], k: int) -> list[dict]:
    """The prompt's own logprobs, for completions with echo: entry i > 0 is the log-softmax (float64) of the
    logits at position i - 1, raw (no temperature, penalties or top-k/top-p: the prompt was not sampled), as
    {"token_id", "logprob", "top": [[id, logprob], ...]} with the k most likely, highest first (ties: lower
    id). Entry 0 has logprob and top None: nothing predicts the first token. Costs one more forward pass
    over the prompt (Engine.score), outside the prefix cache.

    Raises ValueError for ids the model does not have or a prompt larger than the whole KV cache (the
    client's mistake) and RuntimeError when the cache is too full right now (retry later)."""
    # checked here although score() checks them too: its ValueError would not tell a bad id from a full cache
    vocab = eng.config.vocab_size
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"prompt: token id at position {bad} is {ids[bad]}, not an int in [0, {vocab})")
    stats = eng.stats()
    need = -(-len(ids) // stats["block_size"])
    if need > stats["kv_blocks_total"]:
        raise ValueError(f"the prompt's logprobs need {need} KV blocks for its {len(ids)} tokens but the cache "
                         f"has {stats['kv_blocks_total']}")
    try:
        logits = eng.score(ids)  # [n, vocab] float32
    except ValueError as e:  # ids and size are checked above: what is left is a cache too full right now
        raise RuntimeError(f"no room to compute the prompt's logprobs now ({e}); retry later") from None
    out = [{"token_id": ids[0], "logprob": None, "top": None}]
    for lo in range(0, len(ids) - 1, SCORE_ROWS):
        x = logits[lo:min(lo + SCORE_ROWS, len(ids) - 1)].astype(np.float64)  # rows predicting ids[lo + 1 ...]
        m = x.max(axis=1, keepdims=True)
        lp = x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))
        top = np.argpartition(-lp, k, axis=1)[:, :k] if k else np.zeros((len(x), 0), dtype=np.int64)
        for r in range(len(x)):
            best = sorted(top[r].tolist(), key=lambda t: (-lp[r, t], t))
            token = ids[lo + r + 1]
            out.append({"token_id": token, "logprob": float(lp[r, token]),
                        "top": [[int(t), float(lp[r, t])] for t in best]})
    return out


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice 0 uses the request's seed (so n=1 and the first of n agree); the others get independent
    streams derived from it. None stays None: the engine draws a random seed."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def token_bytes(eng: Engine, token_id: int) -> bytes:
    """The bytes a token stands for: byte-level BPE tokens map back through GPT-2's alphabet; special
    and added tokens are their UTF-8 text."""
    piece = eng.tokenizer.id_to_token(token_id) or ""
    if piece and all(c in _CHAR_BYTE for c in piece):
        return bytes(_CHAR_BYTE[c] for c in piece)
    return piece.encode()


class Generation:
    """All engine requests of one HTTP request: for each prompt, n choices. events() yields
    (choice index, StreamChunk) as they arrive, choices interleaved.

    With n > 1 only the first choice of a prompt starts at once; the others are submitted when its first
    chunk arrives, so its prompt blocks are in the prefix cache and they share them instead of each
    computing the prompt again (requests admitted in the same step would not find each other's blocks).
    """

    def __init__(self, eng: Engine, block_size: int):
        self.eng, self.block_size = eng, block_size
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.requests: list = []
        self.followers: dict[int, list[tuple[int, list[int], dict]]] = {}  # leader index -> choices to start
        self.num_choices = 0
        self.aborted = False

    def start(self, groups: list[tuple[list[int], list[dict]]]) -> None:
        """groups: per prompt, its token ids and one sampling dict per choice. Raises the engine's errors
        (ValueError: bad value or a prompt that can never fit; RuntimeError: queue full) before any
        request runs, so a failure leaves nothing behind."""
        for ids, choices in groups:
            shared = self.eng.engine_config.enable_prefix_caching and (len(ids) - 1) // self.block_size > 0
            leader = self.num_choices
            for i, sampling in enumerate(choices):
                if i > 0 and shared:
                    self.followers.setdefault(leader, []).append((self.num_choices, ids, sampling))
                else:
                    self._submit(self.num_choices, ids, sampling)
                self.num_choices += 1

    def _submit(self, index: int, ids: list[int], sampling: dict) -> None:
        try:
            req = self.eng.submit(ids, **sampling)
        except BaseException:
            self.abort()
            raise
        self.requests.append(req)
        threading.Thread(target=self._pump, args=(index, req), name=f"llaisys-http-{index}", daemon=True).start()

    def _pump(self, index: int, req) -> None:
        try:
            for chunk in req:
                self._put((index, chunk))
        except BaseException as e:  # re-raised by events() on the event loop
            self._put((index, e))

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shut down): nobody is listening
            pass

    async def events(self):
        left = self.num_choices
        while left:
            index, item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            followers = self.followers.pop(index, ())
            if self.aborted:
                left -= len(followers)  # never started: nothing of theirs will arrive
            else:
                for follower in followers:
                    self._submit(*follower)
            if item.finish_reason is not None:
                left -= 1
            yield index, item

    def abort(self) -> None:
        """Stops every request (safe at any time): their blocks are freed before the next step."""
        self.aborted = True
        for req in self.requests:
            req.abort()
