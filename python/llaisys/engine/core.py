"""EngineCore: the KV pool, block manager, scheduler and runner of one model; step() advances every
scheduled sequence. Not thread-safe: one step loop (serving/loop.py) owns it."""
from __future__ import annotations

import math
import time
import warnings
from itertools import repeat
from types import SimpleNamespace

import numpy as np

from .. import _core, ops
from .._tensor import empty, tensor
from .block_manager import BlockManager
from .chaining import Chainer
from .config import EngineConfig
from .kv_budget import kv_blocks_for
from .logprobs_log import LogprobsLog, Span, entries as lp_entries
from .model_runner import ModelRunner
from .scheduler import Scheduler, Step
from .sequence import Sequence, Status


class _Dropped(Exception):
    """The step in flight was dropped (its masks failed) while the next one was being launched."""


class EngineCore:
    def __init__(self, models: list, mc, config: EngineConfig, dtype: str, device: str, max_seq_len: int,
                 node=None):
        """models: one per rank (engine/ranks.py), each sized its KV pool from its own device's free memory
        and its own share of the KV heads; the block manager is one, so every pool gets the fewest blocks
        (over every node's ranks too: node, engine/nodes.py, where the group spans processes)."""
        config = config.for_device(device)
        self.config, self.max_seq_len = config, max_seq_len
        shares = [SimpleNamespace(**m.config) for m in models]  # each rank's heads (the vocabulary is whole)
        num_blocks = min(kv_blocks_for(config, c, dtype, m.device, max_seq_len) for m, c in zip(models, shares))
        if node is not None:
            num_blocks = node.agree_blocks(num_blocks)
        self.pools = [_core.KVPool(c.num_hidden_layers, num_blocks, config.block_size, c.num_key_value_heads,
                                   c.head_dim, dtype, m.device) for m, c in zip(models, shares)]
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_prefill_chunk)
        self.runner = ModelRunner(models, self.pools, config.block_size, math.ceil(max_seq_len / config.block_size),
                                  config.graph_sizes, config.cuda_graphs, mc.vocab_size, config.tp_timeout_s,
                                  config.mask_threads)
        if node is not None and node.rank == 0:  # every call goes to the other nodes first
            from .node_steps import NodeProxy
            self.runner.runner = NodeProxy(self.runner.runner, node)
        overlap = config.overlap_steps
        enabled = device.startswith("cuda") if overlap is None else overlap
        # Ranks of one process chain by default on CUDA (2 H200s, session 27: chained tokens equal one GPU's,
        # 7B decode 315 -> 354 tok/s). Several nodes chain only when asked for (overlap_steps=True): each chained
        # launch is a synchronous broadcast there, and that path has not run on GPUs.
        if node is not None:
            enabled = overlap is True
        self.chain = Chainer(enabled, self.scheduler, self.blocks, self.runner, max_seq_len)
        self._stuck = ""  # why launched steps could not be drained (then no step can run: broken)
        self._inflight = None  # a launched step whose tokens are not read yet (overlapped decode)
        # where step time goes (read by benchmarks): scheduling, the runner (arrays + C++ step, which
        # includes the model and the one host sync), and bookkeeping after it
        # rows: sequences summed over steps (a prefill chunk's sequence counts once), what host cost is per
        self.timing = dict.fromkeys(("steps", "tokens", "rows", "schedule_s", "run_s", "postprocess_s"), 0)
        # the host's path on overlapped steps, between a step's tokens and the device's next work: tokens read ->
        # step() returns ("to_return_s", over "overlapped" steps), of which, where a constrained row's sampling was
        # deferred, tokens -> that sampling enqueued ("to_sample_s", over "deferred" steps; the device idles where
        # it exceeds the forward); and the time outside step() until the next call launches the step after (the
        # loop's delivery: "between_s", over "betweens" calls that found a step in flight). Read by
        # bench/structured.py
        self.timing.update(dict.fromkeys(("overlapped", "to_return_s", "deferred", "to_sample_s", "betweens",
                                          "between_s", "consume_s"), 0))
        # the accounting of overlapped steps: their part of postprocess_s, inside their to_return_s (host_seconds)
        self.timing["overlapped_postprocess_s"] = 0
        # logprobs entries built ahead while the device ran (_build_ahead): the time, inside run_s (a wait the
        # loop had anyway, so not in host_seconds), and the logged steps built whole (each: every row still there)
        self.timing.update(ahead_s=0, ahead_steps=0)
        self.ahead_failed = ""  # why building ahead stopped for this engine ('' while it runs: _build_ahead)
        self._returned = None  # when an overlapped step() last returned (for between_s)
        self._t_tokens = 0.0  # when the tokens that started the pending deferred masks came (for to_sample_s)

    @property
    def broken(self) -> str:
        """Why no step can run any more (a tensor-parallel rank failed or stalled, or launched steps could not be
        finished); '' while steps can run."""
        return self._stuck or getattr(self.runner.runner, "broken", "")

    def check_window(self, kv_window: int, sink_tokens: int) -> None:
        """ValueError for a window whose blocks (sinks + window + one) a step's block table cannot hold."""
        bs = self.config.block_size
        blocks = -(-sink_tokens // bs) + -(-kv_window // bs) + 1
        if blocks > math.ceil(self.max_seq_len / bs):
            raise ValueError(f"kv_window {kv_window} + sink_tokens {sink_tokens} take {blocks} blocks of {bs} "
                             f"tokens (with one being filled) but a sequence holds at most "
                             f"{math.ceil(self.max_seq_len / bs)} (max_seq_len {self.max_seq_len}): lower kv_window "
                             f"or raise max_seq_len")

    def check_fits(self, n_prompt: int, max_new_tokens: int, kv_window: int = 0, sink_tokens: int = 0) -> None:
        """ValueError (with the numbers) for a request that could never run. A windowed one (kv_window > 0)
        has no length limit: it holds at most its window's blocks."""
        if kv_window:
            self.check_window(kv_window, sink_tokens)
            bs = self.config.block_size
            need = min(n_prompt + max_new_tokens, (-(-sink_tokens // bs) + -(-kv_window // bs) + 1) * bs)
            if need > self.blocks.capacity_tokens:
                raise ValueError(f"the request's window needs up to {need} tokens of KV cache but the whole pool "
                                 f"holds {self.blocks.capacity_tokens}")
            return
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
        sequence that produced one (a quiet one of the persistent batch, Sequence.quiet: only its last), and
        (sequence, error) for each whose row made the step raise (see _isolate: the other rows are run again
        without it). Sequences that end (EOS, max_new_tokens, max_seq_len, an error) are finished, their
        blocks freed.

        Overlapped decode (EngineConfig.overlap_steps): a graphed decode step is launched without waiting,
        and before its tokens are read the next step of the same sequences is launched behind it, its
        input tokens taken on the device from the step ahead. So the host's scheduling and bookkeeping run
        while the device computes, instead of between steps. A step launched so for a sequence that then
        ends (EOS, a stop string, an abort) computes one token nobody reads: its blocks are freed only
        after, in stream order. Requests waiting for admission join the first step that is not chained
        (Chainer.may_chain bounds how long that takes). Anything else (prefill, presence/frequency penalties,
        biases, logprobs, a sequence about to reach its length limit, no free block) runs the plain way."""
        t0 = time.perf_counter()
        if self._returned is not None and self._inflight is not None:  # not an idle engine's wait
            self.timing["between_s"] += t0 - self._returned
            self.timing["betweens"] += 1
        self._returned = None
        step = None  # the step whose tokens this call reads, once known
        try:
            # the scheduler (admissions, preemptions) never runs with a step in flight, and a step whose sampling
            # waits for its masks is always the one in flight: none is pending here
            if self._inflight is None:
                step = self.scheduler.schedule()
                if not step.seqs:
                    return [], []
                t1 = time.perf_counter()
                if not self.chain.may_overlap(step):
                    return self._account(step, self.runner.step(step), t0, t1), []
                self.runner.launch(step, chain=False)
                self._inflight = step
            t1 = time.perf_counter()
            step, self._inflight = self._inflight, None
            try:
                # a step in flight still waiting for its masks is sampled (settle) once the next one's arrays
                # are made, just before its launch: the host makes them while the masks are computed
                self._inflight = self.chain.launch_next(step, self._settle_before_launch)
            except _Dropped:  # its masks failed: _drain() dropped every launched step, nothing to read
                return [], []
            except Exception:
                # a step that could not sample a token (NaN logits) hands the chained one an id of -1: the
                # step's own error says why, so it goes first
                self.runner.finish()
                raise
            if self._inflight is None and not self.settle():  # nothing was launched behind it: sampled here
                return [], []
            self._build_ahead()  # (never raises: a failure there only stops building ahead)
            tokens = self.runner.finish()
            t_tokens = time.perf_counter()
        except Exception as e:
            self._drain()
            if step is None:  # scheduling failed: not any one row's doing
                raise
            return self._isolate(step, e, t0)
        except BaseException:
            self._drain()
            raise
        self._t_tokens = t_tokens
        pp = self.timing["postprocess_s"]
        produced = self._account(step, tokens, t0, t1)
        self.timing["overlapped_postprocess_s"] += self.timing["postprocess_s"] - pp
        if self.runner.deferred is not None and not self.runner.masks_started:  # not a _account_batch step
            self._start_masks()
        t = self.timing
        self._returned = time.perf_counter()
        t["overlapped"] += 1
        t["to_return_s"] += self._returned - t_tokens
        return produced, []

    def host_seconds(self) -> float:
        """The loop thread's Python time on steps so far (from `timing`; read by benchmarks): scheduling, the
        step arrays (ModelRunner.prepare_s), the accounting, the rest of an overlapped step() after its tokens
        and the loop's delivery between overlapped steps; not the runner's C++ launches nor the waits for the
        device. Each interval counted once: an overlapped step's accounting is part of its to_return_s."""
        t = self.timing
        return (t["schedule_s"] + self.runner.prepare_s + t["postprocess_s"] - t["overlapped_postprocess_s"] +
                t["to_return_s"] + t["between_s"])

    def _build_ahead(self) -> None:
        """Builds logprobs entries of the current batch's log (engine/logprobs_log.py: its quiet rows', otherwise
        built by whoever reads the results) while the device still runs the step whose tokens finish() is about
        to wait for: a chunk of a logged step at a time (LogprobsLog.build_next), asking again after each, so
        the loop goes on at most a chunk (~0.1 ms) after the device is done. On the H200 (0.5B, 256 rows,
        logprobs=5) the loop waited ~1.4 ms of each 2 ms step here, and a step's entries cost ~0.4 ms to build
        (~1.6 us an entry). Only this batch's log (older ones are read at their rows' ends, soon); never busy on
        the CPU: the entries stay arrays there."""
        b = self.scheduler.batch
        log = None if b is None else b.lp_log
        if log is None or self.ahead_failed:
            return
        runner, nb, t, calls = self.runner, log.nb, time.perf_counter(), 0
        try:
            while log.unbuilt and runner.busy:
                log.build_next()
                calls += 1
        except Exception as e:  # an optimisation only: the step and its rows go on, the entries stay arrays
            # (a column's built list is a prefix of its steps whatever was appended: Span.parts takes the rest
            # from the arrays, so nothing is lost or doubled; the reader then builds them, and sees any error)
            self.ahead_failed = f"{type(e).__name__}: {e}"
            warnings.warn(f"llaisys: building logprobs entries ahead failed ({self.ahead_failed}); they are built "
                          "when read from now on", RuntimeWarning, stacklevel=2)
        if calls:
            self.timing["ahead_s"] += time.perf_counter() - t
            self.timing["ahead_steps"] += log.nb - nb

    def settle(self) -> bool:
        """Enqueues the sampling of a chained step still waiting for its masks (_start_masks), or, when they
        failed, drops that step as _sample_deferred does (then False). Called before anything else runs the
        model on the loop thread: step() (before the next launch), and score() between steps, whose forward
        overwrites the logits buffer that sampling reads."""
        return self.runner.deferred is None or self._sample_deferred()

    def _settle_before_launch(self) -> None:
        if not self.settle():
            raise _Dropped()

    def _start_masks(self) -> None:
        """Starts the masks of the chained step launched without its sampling (a constrained row), from the
        matchers this step's tokens advanced, on the MaskFiller's worker: the loop finishes this step's
        accounting and delivers its tokens meanwhile, and the next call samples with them (_sample_deferred)
        before it launches the step after, the order of the runner's calls as when the masks were computed
        here. The device runs the forward all the while. Rows that end with this step's token (EOS, length)
        are still running then: their masks are computed and their tokens dropped, as for rows that end
        while the step runs. A failure drops that step (its sequences run again from what the host knows)."""
        try:
            self.runner.start_deferred_masks()
        except Exception:
            self._drain()

    def _sample_deferred(self) -> bool:
        """Enqueues the deferred step's masked sampling once its masks (_start_masks) are written. A failed
        mask drops that step (nothing of it was kept): this call schedules its sequences afresh."""
        try:
            self.runner.sample_deferred()
        except Exception:
            self._drain()
            return False
        self.timing["deferred"] += 1
        self.timing["to_sample_s"] += time.perf_counter() - self._t_tokens
        return True

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

    def _drain(self) -> None:
        """After a failure: waits out every launched step (their tokens dropped)."""
        self.scheduler.batch = None  # rebuilt from the sequences, which a failed step left as they were
        self._inflight, self.chain.waited = None, 0
        self.runner.drop_deferred()  # finish() samples it unmasked: its token is dropped
        self.runner.seen.reset()  # the device added tokens of steps the host drops: rewrite the sets
        while self.runner.launched:
            left = self.runner.launched
            try:
                self.runner.finish()
            except Exception as e:
                if self.runner.launched >= left:  # finish() gets nowhere: retrying would spin forever
                    self._stuck = f"a launched step could not be finished ({e!r:.200})"
                    raise RuntimeError(self._stuck) from e

    def _account(self, step, tokens, t0: float, t1: float) -> list[tuple[Sequence, int, dict | None]]:
        """Applies a step's tokens: progress, prefix-cache registration, ends; sequences that ended while
        it ran (an abort, a stop string) are skipped."""
        t2 = time.perf_counter()
        entries = None
        if step.batch is not None:
            b = step.batch
            ours = b is self.scheduler.batch and (
                step.version == b.version if step.keep is None else step.kept_version == b.version)
            if step.lp is not None:  # computed on the device behind the step (ModelRunner.launch, Step.lp)
                rows, ks, quiet = step.lp
                # quiet rows' arrays are logged only where the batch way accounts the step: the general way
                # below hands every row its entry
                entries = self._batch_entries(b, step.version, step.seqs, tokens, rows, ks, quiet if ours else None,
                                              *self.runner.finished_logprobs())
            if ours:
                if step.keep is None:
                    return self._account_batch(b, tokens, t0, t1, t2, entries, step.lp is not None)
                return self._account_kept(step, tokens, t0, t1, t2, entries)
            self.scheduler.batch = None  # its arrays would miss what the general accounting does below
        produced, want = [], []  # want: (row, index in produced) of the rows that asked for logprobs
        for row, (seq, n, token) in enumerate(zip(step.seqs, step.num_tokens, tokens)):
            if seq.status is not Status.RUNNING:
                continue
            if entries is None and seq.params.logprobs is not None and n >= seq.remaining:
                want.append((row, len(produced)))
            if self._apply(seq, n, int(token)):
                produced.append((seq, int(token), None if entries is None else entries[row]))
        if want:
            temperature, chosen = np.zeros(len(tokens), np.float32), np.asarray(tokens, np.int64)
            ks = []
            for row, i in want:
                temperature[row] = produced[i][0].params.temperature
                ks.append(produced[i][0].params.logprobs)
            entries = self._logprobs(np.array([r for r, _ in want], np.int64), temperature, chosen, ks)
            for (_, i), entry in zip(want, entries):
                produced[i] = (produced[i][0], produced[i][1], entry)
        self._time(sum(step.num_tokens), t0, t1, t2, len(step.seqs))
        return produced

    def _apply(self, seq: Sequence, n: int, token: int) -> bool:
        """The general accounting of one running row that computed n tokens: progress, prefix-cache
        registration, its token and end. Whether it produced a token (False: a prefill chunk)."""
        seq.remaining -= n  # (num_computed += n)
        self.blocks.register_full(seq)
        if seq.remaining:
            return False  # a prefill chunk: more of the prompt to go
        seq.append(token)
        if token in seq.eos:
            self.finish(seq, "stop")
        elif seq.constraint is not None and self._constrained_end(seq, token):
            pass
        elif seq.num_output >= seq.params.max_new_tokens or (not seq.kv_window and len(seq) >= self.max_seq_len):
            self.finish(seq, "length")
        elif seq.trigger is not None and (started := seq.trigger.fire(token, seq.num_output == 1)):
            seq.constraint, seq.trigger = started, None  # it masks the next token on
        return True

    def _account_kept(self, step, tokens, t0: float, t1: float, t2: float, entries=None):
        """_account for a batch step whose chained successor left out some of its rows (Chainer._next_batch
        condensed the batch to step.keep then): the rows left out that still run end with this token (their
        length limit) and are accounted one by one; the kept rows, in the batch's rows now, the batch way."""
        keep = step.keep
        produced = []
        for row in np.flatnonzero(~keep).tolist():
            seq = step.seqs[row]
            if seq.status is Status.RUNNING and self._apply(seq, 1, int(tokens[row])):
                produced.append((seq, int(tokens[row]), None if entries is None else entries[row]))
        kept = np.asarray(tokens, np.int64)[keep].tolist()
        if entries is not None:
            entries = [e for e, k in zip(entries, keep.tolist()) if k]
        return produced + self._account_batch(step.batch, kept, t0, t1, t2, entries, step.lp is not None)

    def _batch_entries(self, b, version: int, seqs, tokens, rows, ks, quiet, chosen, top_ids, top_lp):
        """The logprobs entries of a batch step's rows, one per row of the step (its layout: seqs; None where
        not asked for), or None where no row gets one, from its logprobs arrays over `rows` (ks: each one's k):
        those of the rows marked `quiet` (read at their end: Sequence.lp_log) are appended to the batch's log
        (_log_quiet), the others' entries are built. quiet None: none is."""
        if quiet is not None and quiet.any():
            self._log_quiet(b, version, seqs, tokens, rows, ks, quiet, chosen, top_ids, top_lp)
            if quiet.all():
                return None
            loud = np.flatnonzero(~quiet)
            rows, ks, chosen, top_ids, top_lp = rows[loud], ks[loud], chosen[loud], top_ids[loud], top_lp[loud]
        rows = rows.tolist()
        entries = [None] * len(seqs)
        found = lp_entries([int(tokens[r]) for r in rows], ks, chosen, top_ids, top_lp, self.runner.vocab_size)
        for r, entry in zip(rows, found):
            entries[r] = entry
        return entries

    def _log_quiet(self, b, version: int, seqs, tokens, rows, ks, quiet, chosen, top_ids, top_lp) -> None:
        """Appends a batch step's logprobs arrays of its quiet rows (the step's layout: seqs, at the batch's
        `version`) to the batch's log (b.lp_log; engine/logprobs_log.py), begun at its first such step: each
        quiet row's sequence then gets a Span there, from its output index now (before this step's token is
        appended). Request.finish copies their pieces out (built into entries when read, or ahead while the
        device computes: _build_ahead)."""
        log = b.lp_log
        qrows = rows[quiet].tolist()
        if log is None:
            qseqs = [seqs[r] for r in qrows]
            log = b.lp_log = LogprobsLog([s.seq_id for s in qseqs], int(ks[quiet].max()), self.runner.vocab_size,
                                         [s.params.logprobs for s in qseqs])
            for col, seq in enumerate(qseqs):
                if seq.lp_log is not None:  # else its request ended while the step ran: its entries are built
                    seq.lp_log.append(Span(log, col, seq.num_output))
        if log.version != version:  # rows left the batch since (or its first step)
            log.follow(version, quiet, [seqs[r].seq_id for r in qrows])
        # the step's tokens of the rows (what their sequences get), for entries built ahead (_build_ahead)
        log.append(np.asarray(tokens, np.int64)[rows], chosen, top_ids, top_lp)

    def _account_batch(self, b, tokens, t0: float, t1: float, t2: float, entries=None, given: bool = False):
        """_account for a step of the persistent batch: the same effects, vectorised over its rows. Its
        produced list leaves out the quiet rows (DecodeBatch.quiet) that go on: their tokens are read from
        their sequences at the end, and their logprobs, if any, from the batch's log (_log_quiet). entries: the
        rows' logprobs entries computed on the device with the step (_batch_entries; given: it was so computed,
        None then meaning no row needs one), else they are computed here from the step's logits."""
        # Rows leave `running` only (nothing joins it before the next schedule(), which rebuilds or checks the
        # batch): as many running as rows means none ended while the step ran, and no pass over the rows
        live = None if len(self.scheduler.running) == len(b) else [s.status is Status.RUNNING for s in b.seqs]
        if entries is None and not given:  # from the step's logits rows, before rows leave
            want = b.lp_rows
            if want.size:
                ks = b.logprobs[want]
                entries = self._batch_entries(b, b.version, b.seqs, tokens, want, ks, b.quiet[want],
                                              *self._logprobs_arrays(want, b.temperature,
                                                                     np.asarray(tokens, np.int64), int(ks.max())))
        if live is not None:  # ended while the step ran (an abort, a stop string): their tokens are dropped
            tokens = [t for t, keep in zip(tokens, live) if keep]
            if entries is not None:
                entries = [e for e, keep in zip(entries, live) if keep]
            b.condense(np.array(live, bool))
        eos, length = b.advance(tokens, self.max_seq_len)
        seqs, bs = b.seqs, self.blocks.block_size
        if self.blocks.caching:  # before a row's end frees its blocks
            rows = np.flatnonzero(b.pos % bs == 0).tolist()  # rows whose block just filled
            if rows:
                self.blocks.register_rows([seqs[row] for row in rows])
        # then what the next step's masks need (constrained and trigger rows are never quiet: listed below
        # whatever their `length` becomes here), so they start early, beside the rest of the accounting
        start = self.runner.deferred is not None and not self.runner.masks_started
        # the constrained rows that consume their token: all but EOS rows (listed before a trigger joins them)
        moving = [row for row in b.masked if not eos[row]] if b.masked else None
        lanes = moving is not None and start and self.runner.lanes
        if moving is not None and not lanes:
            self._advance_constrained(b, moving, tokens, length)
        if b.triggers:  # (trigger rows are not constrained ones: the constrained ends leave them as they are)
            self._fire_triggers(b, tokens, eos | length)
        if lanes:  # the matchers move on the lanes, each going on to its masks
            self._advance_on_lanes(b, moving, tokens, length)
        elif start:  # the matchers moved: start now
            self._start_masks()
        ended = eos.any() or length.any()  # most steps end no row
        if b.any_quiet:
            listed = np.flatnonzero(~b.quiet | eos | length).tolist() if ended else b.loud
            produced = [(seqs[row], tokens[row], None) for row in listed] if entries is None else [
                (seqs[row], tokens[row], entries[row]) for row in listed]
        else:
            produced = list(zip(seqs, tokens, repeat(None) if entries is None else entries))
        if ended:
            for row in np.flatnonzero(eos).tolist():
                self.finish(seqs[row], "stop")
            for row in np.flatnonzero(length).tolist():
                self.finish(seqs[row], "length")
        self._time(len(seqs), t0, t1, t2, len(seqs))
        return produced

    @staticmethod
    def _fire_triggers(b, tokens: list[int], ended: np.ndarray) -> None:
        """The batch's rows waiting for their constraint's trigger: where this token fires it, the row is
        constrained (masked) from its next token on, as _account does for a row of the general path."""
        fired = False
        for row in b.triggers:
            seq = b.seqs[row]
            if not ended[row] and (started := seq.trigger.fire(tokens[row], seq.num_output == 1)):
                seq.constraint, seq.trigger = started, None
                fired = True
        if fired:
            b.triggered()

    def _time(self, num_tokens: int, t0: float, t1: float, t2: float, rows: int) -> None:
        t = self.timing
        t["steps"] += 1
        t["tokens"] += num_tokens
        t["rows"] += rows
        t["schedule_s"] += t1 - t0
        t["run_s"] += t2 - t1
        t["postprocess_s"] += time.perf_counter() - t2

    def _advance_constrained(self, b, rows: list[int], tokens: list[int], length: np.ndarray) -> None:
        """The batch's constrained rows (`rows`: those whose token is not an EOS: the row ends "stop" without
        it, as _account does): their matchers advance with the step's tokens; a row whose grammar completes or
        fails ends here (then not by length). On the host's path between the tokens and the next step's masked
        sampling (EngineCore.timing's consume_s)."""
        t = time.perf_counter()
        seqs = [b.seqs[row] for row in rows]
        # one after another: llguidance's pooled consume_token_par was slower on the H200 host (64 rows: 0.22-0.39
        # ms at 4-16 threads against 0.26 ms; session 32)
        for row, seq in zip(rows, seqs):
            m = seq.constraint.matcher  # _constrained_end's calls, inlined: ~1 us a row of Python less
            m.consume_token(tokens[row])
            if (m.is_error() or m.is_stopped()) and self._constrained_end(seq):
                length[row] = False
        self.timing["consume_s"] += time.perf_counter() - t

    def _advance_on_lanes(self, b, rows: list[int], tokens: list[int], length: np.ndarray) -> None:
        """_advance_constrained and _start_masks at once, on the MaskFiller's lanes (MaskFiller.start_advanced):
        each lane advances its rows' matchers by this step's tokens and goes straight on to their masks of the
        deferred step, the lanes side by side, where the loop advanced every row one after another before any
        mask could start. Returns once every matcher advanced (the masks go on); the rows whose grammar
        completed or failed end here as _advance_constrained ends them. consume_s: the loop's time here."""
        t = time.perf_counter()
        seqs = [b.seqs[row] for row in rows]
        try:
            ended = self.runner.start_deferred_masks([(s.constraint, tokens[row]) for row, s in zip(rows, seqs)])
        except Exception:  # raised before any lane was given work (the mask rows or buffer): as before lanes
            self.timing["consume_s"] += time.perf_counter() - t
            self._advance_constrained(b, rows, tokens, length)
            self._drain()
            return
        if any(ended):  # most steps end no row
            for row, seq, end in zip(rows, seqs, ended):
                if end is not None:
                    self._end_constrained(seq, None if end is True else end)
                    length[row] = False
        self.timing["consume_s"] += time.perf_counter() - t

    def _constrained_end(self, seq: Sequence, token: int | None = None) -> bool:
        """Advances the sequence's matcher by `token` (None: advanced already); ends the sequence ("stop") once
        its grammar is complete and nothing may follow, or with an error if the matcher failed (a resource
        limit, a grammar bug)."""
        c = seq.constraint
        if token is not None:
            c.consume(token)
        if c.error is not None or c.done:
            self._end_constrained(seq, c.error)
            return True
        return False

    def _end_constrained(self, seq: Sequence, error: str | None) -> None:
        """Ends a constrained sequence: "stop" (its grammar complete), or with the matcher's error text."""
        if error is not None:
            seq.error = RuntimeError(f"structured output: {error}")
            self.finish(seq, "error")
        else:
            self.finish(seq, "stop")

    def _logprobs(self, rows: np.ndarray, temperature: np.ndarray, chosen: np.ndarray, ks: list[int]) -> list[dict]:
        """The logprobs entries of the last step's `rows` ([R] i64), given every row's temperature ([B] f32)
        and sampled token ([B] i64), and each listed row's number of top entries: the log-softmax of the row's
        logits after its temperature (1 for greedy), before top-k/top-p; the chosen token's logprob and the
        ks[r] most likely, highest first (ties: lower id)."""
        arrays = self._logprobs_arrays(rows, temperature, chosen, max(ks))
        return lp_entries(chosen[rows], ks, *arrays, self.runner.vocab_size)

    def _logprobs_arrays(self, rows: np.ndarray, temperature: np.ndarray, chosen: np.ndarray, k: int):
        """(chosen_lp [R] f32, top_ids [R, k] i64, top_lp [R, k] f32) NumPy arrays of the last step's `rows`
        (_logprobs' values, the k most likely of each row): one ops.logprobs call on the logits' device for
        every row and three small copies back, not each row's logits."""
        logits = self.runner.last_logits()  # [B, V] on the device, valid until the next step
        dev, R = logits.device, len(rows)
        chosen_lp, top_ids, top_lp = empty([R], "f32", dev), empty([R, k], "i64", dev), empty([R, k], "f32", dev)
        ops.logprobs(chosen_lp, top_ids, top_lp, logits, tensor(temperature, dev), tensor(chosen, dev),
                     tensor(rows, dev))
        return tuple(t.to("cpu").numpy() for t in (chosen_lp, top_ids, top_lp))

    def stats(self) -> dict:
        b, s = self.blocks, self.scheduler
        return {"running": len(s.running), "waiting": len(s.waiting), "kv_blocks_used": b.num_used,
                "kv_blocks_free": b.num_free, "kv_blocks_total": b.num_blocks - 1, "block_size": b.block_size,
                "prefix_cache_hit_rate": b.hit_rate(), "preemptions": s.num_preemptions,
                "kv_blocks_evicted": b.evicted_blocks, "overlapped_steps": self.chain.overlapped_steps,
                "chain_dropped_rows": self.chain.dropped_rows,
                "overlapped_constrained_steps": self.runner.deferred_steps,
                "decode_batch_steps": s.batch_steps}
