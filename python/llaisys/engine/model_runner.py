"""Turns a scheduled Step into the runner's host arrays and back into one token per sequence."""
from __future__ import annotations

import time
import weakref

import numpy as np

from .. import _core
from ..constraints import MaskFiller
from .scheduler import Step
from .seen import SeenRows
from .sequence import Status


_NO_BIAS: dict = {}  # a row's logit biases where it has none (never changed)


class ModelRunner:
    def __init__(self, models: list, pools: list, block_size: int, max_blocks_per_seq: int, graph_sizes,
                 cuda_graphs: bool, vocab_size: int, tp_timeout_s: float = 300.0, mask_threads: int | None = None):
        """One model and KV pool per rank: several are driven as one by a RankGroup (same methods)."""
        self.block_size, self.vocab_size = block_size, vocab_size
        runners = [_core.Runner(m, p, list(graph_sizes), max_blocks_per_seq, cuda_graphs) for m, p in zip(models, pools)]
        self.runner = runners[0] if len(runners) == 1 else _core.RankGroup(runners, tp_timeout_s)
        self.prepare_s = 0.0  # host time building the step's arrays (read by benchmarks)
        self.capture_s = 0.0  # time capture_graphs() took (read by benchmarks)
        self.mask_s, self.mask_rows = 0.0, 0  # host time computing token masks, and rows masked (benchmarks)
        self.masks = MaskFiller(mask_threads)
        self._mask_host = None  # the masks' host array, reused (_mask_buffer)
        self._started = None  # (mask, rows) of the deferred step's masks being computed (start_deferred_masks)
        self.mask_wait_s = 0.0  # host time sample_deferred() waited for them (benchmarks)
        self.deferred: Step | None = None  # a chained step launched without its sampling (sample_deferred)
        self.deferred_steps = 0  # steps sampled so (stats: overlapped_constrained_steps)
        # the repetition penalty's sets, on the device (self.runner may be replaced: a NodeProxy)
        # through a weak reference: a lambda holding self would make a cycle, and the runner with its KV pool
        # would be freed only by a collection after close()
        me = weakref.ref(self)
        self.seen = SeenRows(lambda row, words: me().runner.set_seen(row, words), vocab_size)

    def capture_graphs(self, sizes, progress: bool = False) -> list[int]:
        """Captures the decode graph of every size in `sizes` not captured yet, now rather than at the first step
        of that many rows (vLLM and SGLang capture theirs at start too): a step of P rows of one token each, all
        at position 0 of the reserved block 0 (where padded rows write), greedy, its tokens dropped. Returns the
        sizes captured. A batch that grew to a new size no longer waits for a capture in the middle of serving
        (the nano-vllm protocol on an H200 passes through ~20 sizes as its requests end)."""
        import sys

        from tqdm import tqdm

        todo = sorted(set(sizes) - set(self.runner.captured_batch_sizes), reverse=True)
        bar = progress and getattr(sys.stderr, "isatty", lambda: False)()
        t = time.perf_counter()
        for p in tqdm(todo, desc="capturing decode graphs", unit="graph", disable=not bar, file=sys.stderr,
                      leave=False):
            zeros64, zeros32 = np.zeros(p, np.int64), np.zeros(p, np.int32)
            try:
                self.runner.step(zeros64, zeros64, zeros64, np.arange(p + 1, dtype=np.int32), np.ones(p, np.int32),
                                 np.zeros((p, 1), np.int32), np.zeros(p, np.float32), zeros32, np.ones(p, np.float32),
                                 np.zeros(p, np.float32), np.ones(p, np.float32), np.zeros(p, np.uint64),
                                 np.zeros(p, np.uint64), np.full(p, -1, np.int32), [], [])
            except RuntimeError as e:
                # a model that computes NaN/Inf: the graph is captured (the check follows the replay), and each
                # request says so at its first token, as without the warm-up; anything else is raised
                if not str(e).startswith("non-finite logits"):
                    raise
        took = time.perf_counter() - t
        self.capture_s += took
        if progress and not bar and todo:
            print(f"llaisys: captured {len(todo)} decode graphs ({min(todo)} to {max(todo)} rows) in {took:.1f} s",
                  file=sys.stderr, flush=True)
        return todo[::-1]

    def _arrays(self, step: Step, ahead: int = 0):
        """The step's host arrays. ahead = 1: a decode one token past what the host knows (the token it
        reads is still being sampled on the device; its id here is a placeholder the runner replaces).
        Per row only its start, count and table are gathered in Python; positions and slots of every token
        come from a few vectorised operations (a 4096-token prefill step built them as per-row arrays turned
        into lists: ~1.3 ms of the host's time a step on the CPU proxy, with the device idle)."""
        bs, rows = self.block_size, len(step.seqs)
        ids, starts, tables = [], [], []
        for seq, n in zip(step.seqs, step.num_tokens):
            start = len(seq.tokens) - seq.remaining + ahead  # (num_computed + ahead)
            if n == 1:
                ids.append(0 if ahead else seq.tokens[start])
            else:
                ids += seq.tokens[start:start + n]
            starts.append(start - seq.evicted)  # its index in the cache, and its RoPE position (StreamingLLM)
            tables.append(seq.block_table)
        width = max(map(len, tables))
        table = np.zeros((rows, width), dtype=np.int32)
        for row, t in enumerate(tables):
            table[row, :len(t)] = t
        n = np.asarray(step.num_tokens, dtype=np.int64)
        c = np.asarray(starts, dtype=np.int64)
        q_start = np.zeros(rows + 1, dtype=np.int32)
        np.cumsum(n, out=q_start[1:])
        if q_start[-1] == rows:  # decodes only: one token a row
            pos = c
            slots = table[np.arange(rows), c // bs].astype(np.int64) * bs + c % bs
        else:
            row_of = np.repeat(np.arange(rows), n)  # each token's row
            pos = np.arange(int(q_start[-1]), dtype=np.int64) - np.repeat(q_start[:-1].astype(np.int64) - c, n)
            slots = table[row_of, pos // bs].astype(np.int64) * bs + pos % bs
        return (np.asarray(ids, dtype=np.int64), pos, slots, q_start, (c + n).astype(np.int32), table)

    def shift(self, shifts) -> None:
        """Windowed evictions' K-shifts (Step.shifts), stream-ordered before the next step."""
        for src, dst, delta in shifts:
            self.runner.shift_kv(src, dst, delta)

    def step(self, step: Step) -> list[int]:
        """Runs the step; the token of each sequence (meaningful only where its prefill is complete)."""
        self.shift(step.shifts)
        t0 = time.perf_counter()
        arrays, sampling = self._inputs(step, 0)
        self.prepare_s += time.perf_counter() - t0
        return self.runner.step(*arrays, *sampling, *self._masks(step), self._wants_logits(step))

    @staticmethod
    def _wants_logits(step: Step) -> bool:
        """Whether any row samples a token this step; False when every row is a prompt chunk before its prompt's
        last (a long prompt alone in its steps): the runner then skips the LM head (HostBatch::logits)."""
        if step.batch is not None:
            return True
        return any(s.num_computed + n >= len(s) for s, n in zip(step.seqs, step.num_tokens))

    def _inputs(self, step: Step, ahead: int):
        b = step.batch
        if b is not None:  # the persistent decode batch keeps its arrays
            if b.seen_row is None:  # first step from it: each penalised row's seen row (written once)
                b.seen_row = self.seen.rows(b.seqs, ahead)
            return b.arrays(ahead), b.sampling(ahead)
        return self._arrays(step, ahead), self._sampling(step, ahead)

    def launch(self, step: Step, chain: bool, before=None) -> None:
        """Runs the step without waiting for its tokens (finish() returns them). chain: a decode of the
        tokens of the step launched just before it (the same sequences in the same rows), not known here
        yet. A chained step with a constrained row is launched without its sampling (its masks need the
        tokens of the step ahead): sample_deferred() completes it once they advanced the matchers."""
        self.shift(step.shifts)
        t0 = time.perf_counter()
        arrays, sampling = self._inputs(step, int(chain))
        self.prepare_s += time.perf_counter() - t0
        # a row whose constraint waits for its trigger too: the step ahead's token may be that trigger
        defer = chain and (step.batch.defers if step.batch is not None else any(
            s.constraint is not None or s.trigger is not None for s in step.seqs))
        masks = (None, []) if chain else self._masks(step)
        if before is not None:
            before()
        self.runner.launch(*arrays, *sampling, chain, *masks, defer, step.chain_rows or [], self._wants_logits(step))
        self.deferred = step if defer else None
        b = step.batch
        if b is not None and not defer and self.device_logprobs:
            want = b.lp_rows
            if want.size:  # on the device behind the step, before a chained step overwrites its logits
                ks = b.logprobs[want]
                self.runner.enqueue_logprobs(want.tolist(), b.temperature, max(int(ks.max()), 1))
                step.lp = (want, ks, b.quiet[want])  # the quiet ones' arrays are logged (EngineCore._log_quiet)

    @property
    def device_logprobs(self) -> bool:
        """Whether the runner computes a launched step's logprobs on the device (a Runner: one GPU or the
        CPU; a tensor-parallel group or a node proxy computes them from the logits after the step)."""
        return hasattr(self.runner, "enqueue_logprobs")

    def finished_logprobs(self):
        return self.runner.finished_logprobs()

    def start_deferred_masks(self, consume: list | None = None) -> list | None:
        """Starts computing the deferred step's masks (from the matchers as they stand now, after the step
        ahead's tokens) on the MaskFiller's worker thread: the caller's Python work (the loop's delivery, the
        next call's preamble) goes on meanwhile, and sample_deferred() waits for them. Until then no matcher
        of the step may be touched.

        consume: (Constraint, token) pairs of the step ahead not advanced yet (MaskFiller.lanes): the lanes
        advance them first (MaskFiller.start_advanced), each lane going on to its own rows' masks; returns what
        each token left (None: goes on, True: complete, a string: the matcher's error). The rows masked are
        those running now, so a row whose grammar this token completes or fails is masked too (llguidance
        then allows only EOS): its token is dropped, as for any row that ends while its step runs."""
        rows = self._mask_rows(self.deferred)
        mask = self._mask_buffer(len(rows)) if rows else None
        ended = None
        if consume is not None:
            ended = self.masks.start_advanced(consume, [self.deferred.seqs[r].constraint for r in rows], mask)
        elif rows:
            self.masks.start([self.deferred.seqs[r].constraint for r in rows], mask)
        self._started = (mask, rows)
        return ended

    @property
    def lanes(self) -> bool:
        """Whether the deferred step's masks may advance the matchers too (start_deferred_masks' consume)."""
        return self.masks.lanes

    @property
    def masks_started(self) -> bool:
        return self._started is not None

    def sample_deferred(self) -> None:
        """Samples the deferred step with its masks (start_deferred_masks' or, where not started, computed
        now), enqueued behind its forward. Rows that ended since the masks were started are masked all the
        same (their token is dropped)."""
        step, self.deferred = self.deferred, None
        started, self._started = self._started, None
        self.deferred_steps += 1
        if started is None:
            mask, rows = self._masks(step)
        else:
            t = time.perf_counter()
            mask, rows = started
            self.mask_s += self.masks.wait()
            self.mask_rows += len(rows)
            self.mask_wait_s += time.perf_counter() - t
        self.runner.sample_deferred(mask, rows, len(step.seqs))

    def drop_deferred(self) -> None:
        """Forgets the deferred step (finish() then samples it unmasked: its token is dropped), once its masks
        are no longer being written (what they raised is dropped with them)."""
        self.deferred, self._started = None, None
        try:
            self.masks.wait()
        except Exception:
            pass

    def finish(self) -> list[int]:
        """The tokens of the oldest launched step not finished yet."""
        return self.runner.finish()

    @property
    def launched(self) -> int:
        return self.runner.launched

    @property
    def busy(self) -> bool:
        """Whether the oldest launched step still runs on the device (finish() would wait for it): host work that
        can wait may run meanwhile for free (EngineCore._build_ahead). Always False on the CPU and for a
        tensor-parallel RankGroup; a runner without it (a NodeProxy) counts as never busy."""
        return getattr(self.runner, "busy", False)

    def _masks(self, step: Step):
        """(token_mask [M, ceil(vocab / 32)] int32, mask_rows): the allowed tokens of each constrained row
        whose token is sampled this step (None, [] when none). Computed from the matchers as they stand, so
        a step run again (EngineCore._isolate) gets the same masks."""
        rows = self._mask_rows(step)
        if not rows:
            return None, []
        t0 = time.perf_counter()
        mask = self._mask_buffer(len(rows))
        self.masks.fill([step.seqs[r].constraint for r in rows], mask)
        self.mask_s += time.perf_counter() - t0
        self.mask_rows += len(rows)
        return mask, rows

    @staticmethod
    def _mask_rows(step: Step) -> list[int]:
        """The step's rows that are masked: constrained, running, and sampling a token this step."""
        if step.batch is not None:  # decodes only, each sampling its token: no pass over the rows when none
            if not step.batch.masked:  # is constrained (the common case)
                return []
            running = Status.RUNNING  # (a pass of two attribute tests a row: 64 rows ~0.05 -> ~0.01 ms, CPU)
            return [r for r, s in enumerate(step.seqs) if s.constraint is not None and s.status is running]
        return [r for r, (s, n) in enumerate(zip(step.seqs, step.num_tokens))
                if s.constraint is not None and s.num_computed + n >= len(s) and s.status is Status.RUNNING]

    def _mask_buffer(self, rows: int) -> np.ndarray:
        """[rows, ceil(vocab / 32)] int32, reused from step to step (the runner copies it out before it
        returns; a new 1.2 MB array a step at 64 rows of Qwen's vocabulary costs page faults). A Runner's own
        (pinned on CUDA: sample_deferred copies it to the device as it is, not through a staging copy)."""
        W = (self.vocab_size + 31) // 32
        if hasattr(self.runner, "mask_buffer"):
            buf = self.runner.mask_buffer(rows).numpy()
            if buf.shape == (rows, W):
                return buf
        if self._mask_host is None or self._mask_host.shape[0] < rows:
            self._mask_host = np.empty((max(rows, 64), W), dtype=np.int32)
        return self._mask_host[:rows]

    def _sampling(self, step: Step, ahead: int = 0):
        seqs = step.seqs
        params = [s.params for s in seqs]
        penalty = [p.repetition_penalty for p in params]
        seen = np.full(len(seqs), -1, np.int32)
        if any(v != 1.0 for v in penalty):  # rows whose sampled token counts (not a prefill chunk's)
            for row, (s, n) in enumerate(zip(seqs, step.num_tokens)):
                if s.penalised and s.num_computed + n >= len(s):
                    seen[row] = self.seen.row(s, ahead)
        # (only rows with presence/frequency counts or a min_tokens can have any)
        biases = [s.biases(ahead) if s.counts is not None or s.params.min_tokens else _NO_BIAS for s in seqs]
        if not any(biases):
            biases = []
        sampling = (
            np.asarray([p.temperature for p in params], dtype=np.float32),
            np.asarray([p.top_k for p in params], dtype=np.int32),
            np.asarray([p.top_p for p in params], dtype=np.float32),
            np.asarray([p.min_p for p in params], dtype=np.float32),
            np.asarray(penalty, dtype=np.float32),
            np.asarray([s.seed for s in seqs], dtype=np.uint64),
            np.asarray([s.num_output + ahead for s in seqs], dtype=np.uint64),
            seen, [list(b) for b in biases], [list(b.values()) for b in biases])
        return sampling

    def last_logits(self):
        """The logits the last step sampled from, [B, vocab] on the device (after penalties)."""
        return self.runner.last_logits()

    def logits(self, step: Step, all_logits: bool):
        """Runs between steps (score.py, after EngineCore.settle(): no deferred sampling is pending)."""
        self.shift(step.shifts)
        return self.runner.logits(*self._arrays(step), all_logits)
