"""KV block allocation with prefix caching.

Blocks hold `block_size` positions of one sequence. A full block is identified by the hash of its tokens
chained with the previous block's hash, so equal prefixes (a system prompt, earlier turns of a chat)
map to the same blocks, which are shared with reference counts. A block whose count drops to 0 keeps
its contents and its hash: it is free, but a later request with the same prefix can take it back.
Free blocks are reused unhashed ones first, then the least recently freed cached one (LRU eviction).
Block 0 is never handed out: the runner points padded rows of a CUDA graph at it.

A windowed sequence (StreamingLLM: Sequence.kv_window, sink_tokens) holds at most window_blocks of them:
its first blocks (the attention sinks), its window and one being filled. Before a step that would pass that,
slide() evicts its oldest whole non-sink blocks and turns the keys it keeps back by the tokens evicted
(llama.cpp's K-shift, ops.kv_shift), so RoPE positions stay those within the cache. A kept block that
others share is copied first (they keep their keys); one this sequence alone holds loses its prefix-cache
entry (its keys no longer match its chain's positions); and a sequence registers no block once it has
evicted. So every block the prefix cache finds holds keys at the positions its chain says.
"""
from __future__ import annotations

from collections import OrderedDict

from .sequence import Sequence


def chain_hash(prev: int | None, tokens: tuple[int, ...]) -> int:
    return hash((prev, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks, got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.caching = enable_prefix_caching
        self.ref = [0] * num_blocks
        self.key: list[tuple | None] = [None] * num_blocks  # (hash, tokens) of a full, registered block
        self.by_hash: dict[int, int] = {}
        self.free_plain = list(range(num_blocks - 1, 0, -1))  # a stack; block 0 reserved
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.queried_tokens = self.hit_tokens = 0  # prefix-cache statistics over admitted prompts
        self.evicted_blocks = 0  # blocks windowed sequences evicted (slide)

    # ---- queries ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_plain) + len(self.free_cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - self.num_free

    @property
    def capacity_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    # ---- allocation ---------------------------------------------------------------------------
    def _take(self) -> int:
        if self.free_plain:
            b = self.free_plain.pop()
        else:
            b, _ = self.free_cached.popitem(last=False)  # evict the least recently freed cached block
            self._unregister(b)
        self.ref[b] = 1
        return b

    def _unregister(self, b: int) -> None:
        if self.key[b] is not None:
            h = self.key[b][0]
            if self.by_hash.get(h) == b:
                del self.by_hash[h]
            self.key[b] = None

    def _lookup(self, prev: int | None, tokens: tuple[int, ...]) -> int | None:
        b = self.by_hash.get(chain_hash(prev, tokens))
        return b if b is not None and self.key[b][1] == tokens else None  # tokens compared: no false hits

    def _hits(self, seq: Sequence) -> list[int]:
        """Cached blocks covering a prefix of seq. The block holding the last token is never a hit: its
        logits are needed, so that position is computed (into a private block, never a shared one)."""
        hits, prev, bs = [], None, self.block_size
        if not self.caching:
            return hits
        for i in range((len(seq) - 1) // bs):
            tokens = tuple(seq.tokens[i * bs:(i + 1) * bs])
            b = self._lookup(prev, tokens)
            if b is None:
                break
            hits.append(b)
            prev = self.key[b][0]
        return hits

    def _admitted(self, seq: Sequence) -> tuple[list[int], int]:
        """The prefix hits and the blocks seq is admitted with: all its tokens', a windowed one's at most
        window_blocks (and hits that leave a block to fill; only the sinks' when it skips, see skip_ahead)."""
        hits, tokens = self._hits(seq), len(seq)
        if seq.kv_window:
            hits = hits[:self.blocks_for(seq.sink_tokens) if self._skip(seq) else self.window_blocks(seq) - 1]
            tokens = min(tokens, self.window_blocks(seq) * self.block_size)
        return hits, self.blocks_for(tokens)

    def _skip(self, seq: Sequence) -> int:
        """Tokens after the sinks a windowed sequence admitted with more tokens than its cap leaves out: it
        computes its sink blocks and its last window (whole blocks of it), as if the rest had been evicted.
        A long prompt (a chat that outgrew the context) or a recompute after preemption then costs one
        window, not its whole length; its kept keys are computed without the context that left (the
        recomputing window's view, not the rolling cache's; score() computes every token instead)."""
        sink_end, bs = self.blocks_for(seq.sink_tokens) * self.block_size, self.block_size
        if len(seq) <= self.window_blocks(seq) * bs:
            return 0
        return len(seq) - sink_end - self.blocks_for(seq.kv_window) * bs

    def skip_ahead(self, seq: Sequence) -> None:
        """Once windowed seq's sinks are computed, jumps over the tokens its admission skips (they count as
        evicted: the ones after them take the cache indices and positions right after the sinks)."""
        if seq.skip and seq.num_computed - seq.evicted == self.blocks_for(seq.sink_tokens) * self.block_size:
            seq.num_computed += seq.skip
            seq.evicted += seq.skip
            seq.skip = 0

    def can_admit(self, seq: Sequence) -> bool:
        hits, blocks = self._admitted(seq)
        revived = sum(1 for b in hits if self.ref[b] == 0)  # free cached blocks the hits take back
        return blocks - len(hits) <= self.num_free - revived

    def admit(self, seq: Sequence) -> None:
        """Gives seq blocks for all its current tokens (a windowed one: up to its cap), reusing cached prefix
        blocks."""
        assert not seq.block_table
        hits, blocks = self._admitted(seq)
        for b in hits:
            if self.ref[b] == 0:
                self.free_cached.pop(b, None)
            self.ref[b] += 1
        seq.block_table = hits + [self._take() for _ in range(blocks - len(hits))]
        seq.skip = self._skip(seq) if seq.kv_window else 0
        seq.num_computed = len(hits) * self.block_size
        seq.registered, seq.chain = len(hits), (self.key[hits[-1]][0] if hits else None)
        self.queried_tokens += seq.num_prompt
        if seq.num_output == 0:  # a first admission (not a recompute after preemption)
            seq.num_cached_prompt = min(seq.num_computed, seq.num_prompt)
        self.hit_tokens += min(seq.num_computed, seq.num_prompt)

    def admit_private(self, seq: Sequence) -> None:
        """Fresh blocks for all of seq's tokens, no prefix hits (scoring needs every position computed)."""
        seq.block_table = [self._take() for _ in range(self.blocks_for(len(seq)))]

    def can_grow(self, seq: Sequence) -> bool:
        return self.blocks_for(len(seq)) <= len(seq.block_table) or self.num_free > 0

    def grow(self, seq: Sequence, tokens: int | None = None) -> None:
        """Adds blocks while seq's tokens (or `tokens` of them: a step ahead of what the host knows)
        outgrew its table (before a decode step computes the last one)."""
        while self.blocks_for(len(seq) if tokens is None else tokens) > len(seq.block_table):
            seq.block_table.append(self._take())

    def take(self, n: int) -> list[int]:
        """n blocks for the caller to append to tables itself (DecodeBatch.grow: many rows at once), in the
        order n calls of grow's would take them."""
        return [self._take() for _ in range(n)]

    def register_full(self, seq: Sequence) -> None:
        """After a step: blocks completely computed become findable by their token chain (not once seq has
        evicted: its keys sit at positions within its cache, not at those of its chain)."""
        if not self.caching or seq.evicted:
            return
        bs, done = self.block_size, len(seq.tokens) - seq.remaining  # (num_computed)
        if seq.registered < done // bs:
            self._register(seq, done // bs)

    def register_rows(self, seqs) -> None:
        """register_full of a decode batch's rows whose block just filled (never windowed)."""
        bs = self.block_size
        for seq in seqs:
            end = (len(seq.tokens) - seq.remaining) // bs
            if seq.registered < end:
                self._register(seq, end)

    def _register(self, seq: Sequence, end: int) -> None:
        """Registers seq's full blocks from seq.registered up to `end` (exclusive)."""
        bs, key, table, ids, chain = self.block_size, self.key, seq.block_table, seq.tokens, seq.chain
        for i in range(seq.registered, end):
            b = table[i]
            k = key[b]
            if k is None:
                tokens = tuple(ids[i * bs:(i + 1) * bs])
                h = hash((chain, tokens))  # chain_hash, inlined
                key[b] = (h, tokens)
                self.by_hash.setdefault(h, b)
                chain = h
            else:
                chain = k[0]
        seq.chain, seq.registered = chain, end

    def free(self, seq: Sequence) -> None:
        """Releases seq's blocks (last first, so a later eviction takes a chain's tail before its head)."""
        ref, key = self.ref, self.key
        for b in reversed(seq.block_table):  # _release, inlined (a sequence holds tens of blocks)
            ref[b] -= 1
            if ref[b] == 0:
                if key[b] is not None:
                    self.free_cached[b] = None
                else:
                    self.free_plain.append(b)
        seq.block_table = []
        seq.num_computed = seq.registered = seq.evicted = seq.skip = 0
        seq.chain = None

    def _release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if self.key[b] is not None:
                self.free_cached[b] = None
            else:
                self.free_plain.append(b)

    # ---- StreamingLLM: sinks and a rolling window -------------------------------------------------
    def window_blocks(self, seq: Sequence) -> int:
        """The most blocks windowed seq holds: its sink blocks, its window's and one being filled."""
        return self.blocks_for(seq.sink_tokens) + self.blocks_for(seq.kv_window) + 1

    def chunk_limit(self, seq: Sequence, ahead: int = 0) -> int | None:
        """The most tokens windowed seq may compute in one step (None: any): what its cap holds once every
        whole non-sink block is evicted. ahead: tokens launched whose step the host has not read yet."""
        if not seq.kv_window:
            return None
        bs, sink_end = self.block_size, self.blocks_for(seq.sink_tokens) * self.block_size
        cached = seq.num_computed + ahead - seq.evicted
        if seq.skip:  # no chunk past the sinks' end: the tokens after it are skipped
            return sink_end - cached
        floor = cached if cached <= sink_end else sink_end + (cached - sink_end) % bs
        return self.window_blocks(seq) * bs - floor

    def _plan(self, seq: Sequence, n: int, ahead: int) -> tuple[int, int, int]:
        """(tokens cached, blocks to evict, first sink-free table index) before n more tokens of seq."""
        cached = seq.num_computed + ahead - seq.evicted
        over = cached + n - self.window_blocks(seq) * self.block_size
        return cached, max(0, -(-over // self.block_size)), self.blocks_for(seq.sink_tokens)

    def need(self, seq: Sequence, n: int, ahead: int = 0) -> int:
        """Free blocks windowed seq needs (may be < 0: it frees some) before a step computes n more of its
        tokens: copies of shared blocks whose keys turn and new blocks, less the blocks it evicts."""
        cached, evict, sb = self._plan(seq, n, ahead)
        table = seq.block_table
        freed = sum(1 for b in table[sb:sb + evict] if self.ref[b] == 1)
        copies = sum(1 for b in table[sb + evict:self.blocks_for(cached)] if self.ref[b] > 1) if evict else 0
        grow = max(0, self.blocks_for(cached - evict * self.block_size + n) - (len(table) - evict))
        return copies + grow - freed

    def slide(self, seq: Sequence, n: int, ahead: int = 0) -> tuple[list[int], list[int], int] | None:
        """Readies windowed seq's table for a step that computes n more of its tokens (n <= chunk_limit;
        need() free blocks): evicts its oldest whole non-sink blocks beyond its cap and adds blocks. Returns
        the K-shift the step needs first, (cache rows src, rows dst, delta positions), or None."""
        bs, table = self.block_size, seq.block_table
        cached, evict, sb = self._plan(seq, n, ahead)
        shift = None
        if evict:
            for b in table[sb:sb + evict]:
                self._release(b)
            src, dst = [], []
            for i in range(sb + evict, self.blocks_for(cached)):  # kept blocks that hold keys
                b, rows = table[i], min(bs, cached - i * bs)
                if self.ref[b] > 1:  # shared (a prefix hit, or hit by another): turn a copy of it
                    self.ref[b] -= 1
                    table[i] = self._take()
                else:
                    self._unregister(b)
                src += range(b * bs, b * bs + rows)
                dst += range(table[i] * bs, table[i] * bs + rows)
            del table[sb:sb + evict]
            seq.evicted += evict * bs
            self.evicted_blocks += evict
            shift = (src, dst, -evict * bs)
        while self.blocks_for(cached - evict * bs + n) > len(table):
            table.append(self._take())
        return shift

    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
