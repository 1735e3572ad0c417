"""The server's side of the engine: the one place it is imported, prompts turned into token ids, and the
engine requests of one HTTP request read on the event loop.

Delivery is batched: every engine request of the server is submitted with one StreamHub as its sink
(request.ChunkSink). The step loop puts the chunks of a step into the hub and flushes it once, which
schedules one callback on the event loop for the whole step (not one thread wake-up and one callback per
token and stream); the callback hands each Generation its chunks and wakes its reader once. A reader that
finds several chunks of a choice waiting reads them as one (merge_chunks), so a stream that falls behind
catches up in fewer, larger SSE events instead of falling further behind.

A non-streaming response reads only the end, so its requests are submitted with incremental=False
(Generation.start): the step loop keeps their ids, decodes them once, and the hub gets one chunk per
request, the one its chunks would have merged into. Stop strings keep a request incremental (the engine
decides), and so does the first choice of n that others wait for (its first chunk starts them).
"""
from __future__ import annotations

import asyncio
import collections
import hashlib

import numpy as np

from ..engine import Engine, StreamChunk
from ..engine.process import EngineProcess
from ..engine.request import merge_chunks
from ..tokenizer import _BYTE_CHARS

__all__ = ["Engine", "EngineProcess", "StreamChunk", "StreamHub", "Generation", "chat_ids", "prompt_ids", "prompt_logprobs", "choice_seed",
           "token_bytes"]

SCORE_ROWS = 256  # log-softmax this many logit rows at a time: float64 copies of [rows, vocab], not [n, vocab]

_CHAR_BYTE = {c: b for b, c in enumerate(_BYTE_CHARS)}


def chat_ids(eng: Engine | EngineProcess, messages: list[dict], tools: list | None = None) -> list[int]:
    """The conversation as Engine.chat submits it; the server's own message when there is no template."""
    if not eng.chat_template:
        raise ValueError(f"the model {eng.source} has no chat template: use /v1/completions with a raw prompt")
    return eng.render_chat(messages, tools=tools)


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


class StreamHub:
    """The ChunkSink of every engine request read on one event loop. put() and flush() run on the step
    loop thread; the rest on the event loop. At most one drain is scheduled at a time: a flush while one
    is pending adds nothing, and the drain takes everything put before it runs."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._items: collections.deque = collections.deque()  # (engine request, chunk or exception)
        self._scheduled = False
        self._routes: dict = {}  # engine request -> (Generation, choice index), until its last item
        self._early: dict = {}  # items of requests not registered yet (never, while submit and register share a thread)

    # ---- the step loop's side ---------------------------------------------------------------------
    def put(self, req, item) -> None:
        self._items.append((req, item))

    def flush(self) -> None:
        if self._scheduled:
            return
        self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the event loop is closed (server shut down): nobody is listening
            pass

    # ---- the event loop's side --------------------------------------------------------------------
    def register(self, req, gen: "Generation", index: int) -> None:
        self._routes[req] = (gen, index)
        early = self._early.pop(req, None)
        if early:
            self._deliver(req, early)

    def _drain(self) -> None:
        self._scheduled = False  # before taking: a flush from now on schedules another drain
        items, batch = self._items, {}
        for _ in range(len(items)):  # what was put before now; later items come with the next drain
            req, item = items.popleft()
            got = batch.get(req)
            if got is None:
                batch[req] = [item]
            else:
                got.append(item)
        for req, got in batch.items():
            self._deliver(req, got)

    def _deliver(self, req, items: list) -> None:
        route = self._routes.get(req)
        if route is None:
            self._early.setdefault(req, []).extend(items)
            return
        last = items[-1]
        if isinstance(last, BaseException) or last.finish_reason is not None:
            del self._routes[req]  # nothing comes after the last item
        route[0].deliver(route[1], items)


def coalesce(items: list) -> list:
    """A choice's waiting items with consecutive chunks merged into one. Exceptions stay as they are, and
    so does a last chunk that ends in "abort" (the server cut the request short: the text before it is
    still sent before the error)."""
    out, run = [], []
    for item in items:
        if isinstance(item, BaseException) or item.finish_reason == "abort":
            if run:
                out.append(merge_chunks(run))
                run = []
            out.append(item)
        else:
            run.append(item)
    if run:
        out.append(merge_chunks(run))
    return out


class Generation:
    """All engine requests of one HTTP request: for each prompt, n choices. events() yields
    (choice index, StreamChunk) as they arrive, choices interleaved; the chunks of a choice that arrived
    since its reader last looked come as one (coalesce).

    With n > 1 only the first choice of a prompt starts at once; the others are submitted when its first
    chunk arrives, so its prompt blocks are in the prefix cache and they share them instead of each
    computing the prompt again (requests admitted in the same step would not find each other's blocks).
    """

    def __init__(self, eng: Engine, block_size: int, hub: StreamHub | None = None):
        self.eng, self.block_size = eng, block_size
        self.loop = asyncio.get_running_loop()
        self.hub = hub if hub is not None and hub.loop is self.loop else StreamHub(self.loop)
        self.pending: dict[int, list] = {}  # choice index -> items not read yet, in order
        self.waiter: asyncio.Future | None = None
        self.requests: list = []
        self.followers: dict[int, list[tuple]] = {}  # leader index -> (index, ids, sampling, incremental) to start
        self.num_choices = 0
        self.aborted = False

    def start(self, groups: list[tuple[list[int], list[dict]]], incremental: bool = True) -> None:
        """groups: per prompt, its token ids and one sampling dict per choice. Raises the engine's errors
        (ValueError: bad value or a prompt that can never fit; RuntimeError: queue full) before any
        request runs, so a failure leaves nothing behind. incremental=False (a reader of the end only): each
        choice arrives as one chunk (Engine.submit), but a leader whose followers wait for its first chunk."""
        for ids, choices in groups:
            shared = self.eng.engine_config.enable_prefix_caching and (len(ids) - 1) // self.block_size > 0
            leader = self.num_choices
            for i, sampling in enumerate(choices):
                if i > 0 and shared:
                    self.followers.setdefault(leader, []).append((self.num_choices, ids, sampling, incremental))
                else:
                    led = shared and len(choices) > 1  # its first chunk, not its last, starts the others
                    self._submit(self.num_choices, ids, sampling, incremental or led)
                self.num_choices += 1

    def _submit(self, index: int, ids: list[int], sampling: dict, incremental: bool = True) -> None:
        try:
            req = self.eng.submit(ids, sink=self.hub, incremental=incremental, **sampling)
        except BaseException:
            self.abort()
            raise
        self.requests.append(req)
        self.hub.register(req, self, index)

    def deliver(self, index: int, items: list) -> None:
        """The hub's hand-over (event loop): items of choice `index`, in order."""
        got = self.pending.get(index)
        if got is None:
            self.pending[index] = items
        else:
            got.extend(items)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def events(self):
        left = self.num_choices
        while left:
            if not self.pending:
                self.waiter = self.loop.create_future()
                try:
                    await self.waiter
                finally:
                    self.waiter = None
                continue
            pending, self.pending = self.pending, {}
            for index, items in pending.items():
                for item in coalesce(items):
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
