"""Block manager and scheduler of the batched engine, without a model: prefix-cache sharing and
eviction, preemption under a tiny pool, chunked prefill beside decodes, every block free at the end."""
import random

import pytest

from llaisys.sampling import resolve_sampling
from llaisys.engine.block_manager import BlockManager
from llaisys.engine.scheduler import Scheduler
from llaisys.engine.sequence import Sequence, Status


def seq(tokens, max_new=4):
    return Sequence(list(tokens), resolve_sampling({}, max_new_tokens=max_new), seed=0, eos=frozenset())


def run_step(sched, step, next_token=lambda s: 7):
    """What EngineCore.step does with the runner's output, with a fixed 'model'."""
    for s, n in zip(step.seqs, step.num_tokens):
        s.num_computed += n
        sched.blocks.register_full(s)
        if s.num_computed == len(s):
            s.append(next_token(s))
            if s.num_output >= s.params.max_new_tokens:
                sched.finish(s, "length")


def test_block_zero_is_reserved_and_all_blocks_return():
    bm = BlockManager(num_blocks=6, block_size=4)
    s = seq(range(20))  # 5 blocks: all but block 0
    assert bm.can_admit(s)
    bm.admit(s)
    assert 0 not in s.block_table and sorted(s.block_table) == [1, 2, 3, 4, 5]
    assert bm.num_free == 0 and not bm.can_admit(seq([1]))
    bm.free(s)
    assert bm.num_free == 5 and bm.num_used == 0


def test_prefix_hits_share_full_blocks_but_never_the_last_token():
    bm = BlockManager(num_blocks=32, block_size=4)
    a = seq(range(10))
    bm.admit(a)
    a.num_computed = 10
    bm.register_full(a)  # blocks of tokens 0-3 and 4-7 are full
    b = seq(list(range(8)) + [99, 98, 97])
    bm.admit(b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_computed == 8 and b.num_cached_prompt == 8
    assert bm.ref[a.block_table[0]] == 2
    c = seq(range(8))  # its last token lies in block 2 (of 2): only block 1 may be a hit
    bm.admit(c)
    assert c.num_computed == 4 and c.block_table[0] == a.block_table[0] and c.block_table[1] != a.block_table[1]
    d = seq([0, 1, 2, 5, 4, 5, 6, 7, 8])  # differs inside the first block: no hit at all
    bm.admit(d)
    assert d.num_computed == 0


def test_prefix_cache_off_and_hash_collisions_cannot_hit():
    bm = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=False)
    a = seq(range(10))
    bm.admit(a)
    a.num_computed = 10
    bm.register_full(a)
    b = seq(range(10))
    bm.admit(b)
    assert b.num_computed == 0 and set(a.block_table).isdisjoint(b.block_table)
    bm2 = BlockManager(num_blocks=32, block_size=4)
    x = seq(range(10))
    bm2.admit(x)
    x.num_computed = 10
    bm2.register_full(x)
    h = bm2.key[x.block_table[0]][0]
    bm2.key[x.block_table[0]] = (h, (9, 9, 9, 9))  # as if another chain had the same hash
    y = seq(range(10))
    bm2.admit(y)
    assert y.num_computed == 0  # tokens are compared, not just hashes


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    bm = BlockManager(num_blocks=5, block_size=2)  # 4 usable blocks
    a = seq([1, 2, 3, 4, 5])
    bm.admit(a)
    a.num_computed = 5
    bm.register_full(a)
    bm.free(a)
    assert bm.num_free == 4
    b = seq([1, 2, 3, 4, 9])  # takes a's two cached blocks back
    bm.admit(b)
    assert b.num_computed == 4 and bm.num_free == 1
    bm.free(b)
    c = seq(range(100, 108))  # needs all 4 blocks: the cached ones are evicted
    bm.admit(c)
    assert bm.num_free == 0 and not bm.by_hash
    bm.free(c)
    d = seq([1, 2, 3, 4, 9])
    bm.admit(d)
    assert d.num_computed == 0  # evicted: recomputed


def test_chunked_prefill_runs_beside_decodes():
    bm = BlockManager(num_blocks=200, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=16)
    short = seq([1, 2, 3], max_new=50)
    sched.add(short)
    run_step(sched, sched.schedule())  # short's prefill
    long = seq(range(100, 160), max_new=2)
    sched.add(long)
    seen_chunks = []
    for _ in range(5):
        step = sched.schedule()
        assert sum(step.num_tokens) <= 16
        assert step.seqs[0] is short and step.num_tokens[0] == 1  # the decode is never stalled
        seen_chunks.append(step.num_tokens[1] if len(step.seqs) > 1 else 0)
        run_step(sched, step)
    assert seen_chunks[:3] == [15, 15, 15] and long.num_output >= 1


@pytest.mark.parametrize("num_blocks", [12, 20, 60])
def test_preemption_under_a_tiny_pool_finishes_everything_and_frees_every_block(num_blocks):
    rng = random.Random(num_blocks)
    bm = BlockManager(num_blocks=num_blocks, block_size=4)
    sched = Scheduler(bm, max_num_seqs=16, max_num_batched_tokens=32)
    seqs = [seq([rng.randrange(50) for _ in range(rng.randint(1, 20))], max_new=rng.randint(1, 20))
            for _ in range(30)]
    for s in seqs:
        assert len(s) + s.params.max_new_tokens <= bm.capacity_tokens
        sched.add(s)
    # the "model" emits a function of the sequence's own tokens, so a recompute after preemption
    # must reproduce exactly what an undisturbed run produces
    model = lambda s: (sum(s.tokens) * 31 + len(s)) % 97
    for _ in range(2000):
        if not sched.has_work():
            break
        run_step(sched, sched.schedule(), model)
    assert not sched.has_work()
    for s in seqs:
        assert s.status is Status.FINISHED and s.num_output == s.params.max_new_tokens
        ref = list(s.tokens[:s.num_prompt])
        for _ in range(s.params.max_new_tokens):
            ref.append((sum(ref) * 31 + len(ref)) % 97)
        assert s.tokens == ref
    assert bm.num_free == num_blocks - 1 and all(r == 0 for r in bm.ref)
    if num_blocks == 12:
        assert sched.num_preemptions > 0
