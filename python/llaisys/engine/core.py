"""EngineCore: the KV pool, block manager, scheduler and runner of one model; step() advances every
scheduled sequence. Not thread-safe: one step loop (serving/loop.py) owns it."""
from __future__ import annotations

import math
import time

import numpy as np

from .. import _core
from ..sampling import resolve_sampling
from .block_manager import BlockManager
from .config import EngineConfig
from .model_runner import ModelRunner
from .scheduler import Scheduler, Step
from .sequence import Sequence, Status

_DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
_GREEDY = resolve_sampling({}, temperature=0)


def kv_blocks_for(config: EngineConfig, mc, dtype: str, device: str, max_seq_len: int) -> int:
    """Blocks the pool gets: EngineConfig.num_kv_blocks, else the CPU byte budget, else the CUDA
    memory fraction minus what is in use and an estimate of the step's activations and graphs; at most
    what max_num_seqs sequences of max_seq_len tokens can use."""
    block = _core.KVPool.block_bytes(mc.num_hidden_layers, config.block_size, mc.num_key_value_heads, mc.head_dim,
                                     dtype)
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if not device.startswith("cuda"):
        budget = config.cpu_kv_cache_bytes
    else:
        _core.empty_cache(device)  # blocks our allocator caches count as used in the driver's figure
        free, total = _core.device_memory_info(device)
        dsize = _DTYPE_BYTES[dtype]
        per_row = (mc.vocab_size + 4 * mc.intermediate_size + 8 * mc.hidden_size) * dsize
        graphs = sum(config.graph_sizes) * per_row if config.cuda_graphs else 0
        prefill = config.max_num_batched_tokens * per_row // 4 + config.max_num_seqs * mc.vocab_size * 4
        budget = int(config.gpu_memory_utilization * total) - (total - free) - graphs - prefill - (256 << 20)
    per_seq = math.ceil(max_seq_len / config.block_size)
    need = per_seq + 1
    # More than every sequence at full length (plus block 0) is never used at once: don't take it from
    # the device (or from other models sharing it). The prefix cache keeps what fits in this.
    blocks = min(budget // block, config.max_num_seqs * per_seq + 1)
    if blocks < need:
        raise ValueError(f"the KV cache budget ({budget / 2**20:.0f} MiB) holds {max(blocks, 0)} blocks of "
                         f"{config.block_size} tokens; one sequence of max_seq_len {max_seq_len} needs {need}: "
                         f"raise the budget (EngineConfig.cpu_kv_cache_bytes / gpu_memory_utilization) "
                         f"or lower max_seq_len")
    return int(blocks)


class EngineCore:
    def __init__(self, model, mc, config: EngineConfig, dtype: str, device: str, max_seq_len: int):
        config = config.for_device(device)
        self.config, self.max_seq_len = config, max_seq_len
        num_blocks = kv_blocks_for(config, mc, dtype, device, max_seq_len)
        self.pool = _core.KVPool(mc.num_hidden_layers, num_blocks, config.block_size, mc.num_key_value_heads,
                                 mc.head_dim, dtype, device)
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_prefill_chunk)
        self.runner = ModelRunner(model, self.pool, config.block_size, math.ceil(max_seq_len / config.block_size),
                                  config.graph_sizes, config.cuda_graphs, mc.vocab_size)
        overlap = config.overlap_steps
        self._overlap = device.startswith("cuda") if overlap is None else overlap
        self._inflight = None  # a launched step whose tokens are not read yet (overlapped decode)
        # where step time goes (read by benchmarks): scheduling, the runner (arrays + C++ step, which
        # includes the model and the one host sync), and bookkeeping after it
        self.timing = dict.fromkeys(("steps", "tokens", "schedule_s", "run_s", "postprocess_s"), 0)
        self.overlapped_steps = 0  # steps launched chained behind the step ahead (overlap_steps)

    def check_fits(self, n_prompt: int, max_new_tokens: int) -> None:
        """ValueError (with the numbers) for a request that could never run."""
        if n_prompt >= self.max_seq_len:
            raise ValueError(f"prompt has {n_prompt} tokens but the context holds {self.max_seq_len} "
                             f"(max_seq_len)")
        need = min(n_prompt + max_new_tokens, self.max_seq_len)
        if need > self.blocks.capacity_tokens:
            raise ValueError(f"the request needs up to {need} tokens of KV cache ({n_prompt} prompt + "
                             f"{max_new_tokens} new) but the whole pool holds {self.blocks.capacity_tokens}")

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def finish(self, seq: Sequence, reason: str | None) -> None:
        self.scheduler.finish(seq, reason)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def step(self) -> tuple[list[tuple[Sequence, int, dict | None]], list[tuple[Sequence, BaseException]]]:
        """One step. Returns (produced, failed): (sequence, new token, its logprobs or None) for each
        sequence that produced one, and (sequence, error) for each whose row made the step raise (see
        _isolate: the other rows are run again without it). Sequences that end (EOS, max_new_tokens,
        max_seq_len, an error) are finished, their blocks freed.

        Overlapped decode (EngineConfig.overlap_steps): a graphed decode step is launched without waiting,
        and before its tokens are read the next step of the same sequences is launched behind it, its
        input tokens taken on the device from the step ahead. So the host's scheduling and bookkeeping run
        while the device computes, instead of between steps. A step launched so for a sequence that then
        ends (EOS, a stop string, an abort) computes one token nobody reads: its blocks are freed only
        after, in stream order. Anything else (new requests waiting, prefill, penalties, biases,
        logprobs, a sequence about to reach its length limit, no free block) runs the plain way."""
        t0 = time.perf_counter()
        step = None  # the step whose tokens this call reads, once known
        try:
            if self._inflight is None:
                step = self.scheduler.schedule()
                if not step.seqs:
                    return [], []
                t1 = time.perf_counter()
                if not self._may_overlap(step):
                    return self._account(step, self.runner.step(step), t0, t1), []
                self.runner.launch(step, chain=False)
                self._inflight = step
            t1 = time.perf_counter()
            step, self._inflight = self._inflight, None
            try:
                self._inflight = self._launch_next(step)
            except Exception:
                # a step that could not sample a token (NaN logits) hands the chained one an id of -1: the
                # step's own error says why, so it goes first
                self.runner.finish()
                raise
            tokens = self.runner.finish()
        except Exception as e:
            self._drain()
            if step is None:  # scheduling failed: not any one row's doing
                raise
            return self._isolate(step, e, t0)
        except BaseException:
            self._drain()
            raise
        return self._account(step, tokens, t0, t1), []

    def _isolate(self, step, error: Exception, t0: float):
        """A step raised: one row's values (a penalty, say, that the sampler refuses or that makes its
        logits non-finite) must not end its neighbours. Its rows are run again as plain steps in halves,
        down to single rows: a row that fails alone ends with its error, every other row gets its token.
        Sound because a failed step changed nothing the host keeps (tokens, progress, prefix cache): a row
        run again recomputes the same keys and values into its own slots and draws from its own (seed,
        step), so its token is the one the full step would have given. With k failing rows of n this costs
        at most about 2k·log2(n) extra steps, only when a step fails. Rows that ended while the step ran (an
        abort between overlapped steps) are dropped: their blocks may be reused already."""
        rows = [(s, n) for s, n in zip(step.seqs, step.num_tokens) if s.status is Status.RUNNING]
        produced, failed, pending = [], [], [(rows, error)]
        while pending:
            part, err = pending.pop()
            if not part:
                continue
            if len(part) == 1:
                seq = part[0][0]
                seq.error = err
                self.finish(seq, "error")
                failed.append((seq, err))
                continue
            half = len(part) // 2
            for sub in (part[:half], part[half:]):
                sub_step = Step([s for s, _ in sub], [n for _, n in sub])
                t1 = time.perf_counter()
                try:
                    tokens = self.runner.step(sub_step)
                except Exception as e:
                    self._drain()
                    pending.append((sub, e))
                    continue
                produced += self._account(sub_step, tokens, t0, t1)
        return produced, failed

    def _may_overlap(self, step) -> bool:
        """Whether step may run launched (its tokens read later) with a next step chained behind it."""
        if not self._overlap:
            return False
        # decodes, no penalties or biases, no logprobs, no constraint (the next mask needs this step's token)
        for seq, n in zip(step.seqs, step.num_tokens):
            p = seq.params
            if (n != 1 or seq.remaining != 1 or p.logprobs is not None or seq.seen is not None or
                    seq.counts is not None or seq.num_output < p.min_tokens or seq.constraint is not None):
                return False
        return True

    def _launch_next(self, step):
        """Launches the decode step after `step` (still running) for the same sequences, chained to its
        tokens; None (nothing launched) where that step is not certain to be wanted as it stands."""
        if not self._may_overlap(step) or self.scheduler.waiting:
            return None  # waiting requests: schedule them as soon as this step is read
        bm, need = self.blocks, 0
        for seq in step.seqs:
            if (seq.status is not Status.RUNNING or seq.num_output + 1 >= seq.params.max_new_tokens or
                    len(seq) + 1 >= self.max_seq_len):
                return None  # ended, or about to end by length
            need += max(0, bm.blocks_for(len(seq) + 1) - len(seq.block_table))
        if need > bm.num_free:
            return None
        for seq in step.seqs:
            bm.grow(seq, len(seq) + 1)
        nxt = Step(list(step.seqs), [1] * len(step.seqs))
        self.runner.launch(nxt, chain=True)
        self.overlapped_steps += 1
        return nxt

    def _drain(self) -> None:
        """After a failure: waits out every launched step (their tokens dropped)."""
        self._inflight = None
        while self.runner.launched:
            try:
                self.runner.finish()
            except Exception:
                pass

    def _account(self, step, tokens, t0: float, t1: float) -> list[tuple[Sequence, int, dict | None]]:
        """Applies a step's tokens: progress, prefix-cache registration, ends; sequences that ended while
        it ran (an abort, a stop string) are skipped."""
        t2 = time.perf_counter()
        produced = []
        for row, (seq, n, token) in enumerate(zip(step.seqs, step.num_tokens, tokens)):
            if seq.status is not Status.RUNNING:
                continue
            seq.num_computed += n
            self.blocks.register_full(seq)
            if seq.num_computed < len(seq):
                continue  # a prefill chunk: more of the prompt to go
            lp = None if seq.params.logprobs is None else self._logprobs(row, int(token), seq.params)
            seq.append(int(token))
            produced.append((seq, int(token), lp))
            if token in seq.eos:
                self.finish(seq, "stop")
            elif seq.constraint is not None and self._constrained_end(seq, int(token)):
                pass
            elif seq.num_output >= seq.params.max_new_tokens or len(seq) >= self.max_seq_len:
                self.finish(seq, "length")
        t = self.timing
        t["steps"] += 1
        t["tokens"] += sum(step.num_tokens)
        t["schedule_s"] += t1 - t0
        t["run_s"] += t2 - t1
        t["postprocess_s"] += time.perf_counter() - t2
        return produced

    def _constrained_end(self, seq: Sequence, token: int) -> bool:
        """Advances the sequence's matcher; ends the sequence ("stop") once its grammar is complete and
        nothing may follow, or with an error if the matcher failed (a resource limit, a grammar bug)."""
        c = seq.constraint
        c.consume(token)
        if c.error is not None:
            seq.error = RuntimeError(f"structured output: {c.error}")
            self.finish(seq, "error")
            return True
        if c.done:
            self.finish(seq, "stop")
            return True
        return False

    def _logprobs(self, row: int, token: int, params) -> dict:
        """Log-softmax of the row's logits after the temperature (1 for greedy), before top-k/top-p: the
        chosen token's logprob and the `params.logprobs` most likely, highest first."""
        x = np.asarray(self.runner.last_logits().slice(0, row, row + 1).to("cpu").to("f32").numpy(),
                       dtype=np.float64)[0] / (params.temperature or 1.0)
        m = x.max()
        lp = x - (m + np.log(np.exp(x - m).sum()))
        k = params.logprobs
        top = np.argpartition(-lp, k)[:k] if 0 < k < lp.size else np.arange(lp.size if k else 0)
        top = sorted(top.tolist(), key=lambda i: (-lp[i], i))
        return {"token_id": token, "logprob": float(lp[token]), "top": [[int(i), float(lp[i])] for i in top]}

    def stats(self) -> dict:
        b, s = self.blocks, self.scheduler
        return {"running": len(s.running), "waiting": len(s.waiting), "kv_blocks_used": b.num_used,
                "kv_blocks_free": b.num_free, "kv_blocks_total": b.num_blocks - 1, "block_size": b.block_size,
                "prefix_cache_hit_rate": b.hit_rate(), "preemptions": s.num_preemptions,
                "overlapped_steps": self.overlapped_steps}


def score_logits(core: EngineCore, ids: list[int]):
    """Teacher-forced logits of every position of ids, [len, vocab] (a tensor on the model's device).
    Runs on the loop thread between steps, in blocks of its own (no prefix hits: every position's
    logits are computed) that are freed at once."""
    bm = core.blocks
    seq = Sequence(ids, _GREEDY, seed=0, eos=frozenset())
    need = bm.blocks_for(len(ids))
    if need > bm.num_free:
        raise ValueError(f"score(): {len(ids)} tokens need {need} KV blocks but only {bm.num_free} are free")
    bm.admit_private(seq)
    try:
        return core.runner.logits(Step([seq], [len(ids)]), all_logits=True)
    finally:
        bm.free(seq)

