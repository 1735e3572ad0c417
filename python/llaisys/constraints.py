"""Structured output through llguidance: a request's json_schema / regex / grammar / choice becomes one
llguidance grammar (checked when the request is made, so a bad one raises ValueError naming the problem
before anything runs), and its sequence carries a matcher over our vocabulary. Each step the matcher's
allowed-token bitmask ([ceil(vocab / 32)] int32 words) is applied to the row's logits on their device
(`ops.token_mask`, in the runner), and the matcher advances with the sampled token."""
from __future__ import annotations

import functools
import json
import os
import queue
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np

# Compact but readable JSON (what json.dumps writes): no free whitespace, so a small model cannot wander
# into endless newlines between tokens, and every output is one line a client can parse.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CONSTRAINT_ARGS = ("json_schema", "regex", "grammar", "choice")


def _llg():
    import llguidance  # imported on first use: `import llaisys` stays light
    return llguidance


def compile_constraint(json_schema=None, regex=None, grammar=None, choice=None) -> str | None:
    """The llguidance grammar of one request's constraint (None: unconstrained). At most one of the four;
    json_schema is a dict or its JSON text (True / {} = any JSON object), regex a string, grammar Lark text,
    choice a list of strings. Raises ValueError naming the argument and the problem."""
    given = [(n, v) for n, v in zip(CONSTRAINT_ARGS, (json_schema, regex, grammar, choice)) if v is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"give at most one of json_schema, regex, grammar and choice, got "
                         f"{', '.join(n for n, _ in given)}")
    name, value = given[0]
    if name == "json_schema":
        source = json.dumps(_schema(value))  # key order kept: it is the order of the output's properties
    elif name == "choice":
        source = choice_grammar(value)
    elif not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name} must be a non-empty {'string' if name == 'regex' else 'Lark grammar string'}, "
                         f"got {value!r}")
    else:
        source = value
    return _compiled(name, source)


@functools.lru_cache(maxsize=256)  # repeated schemas (an API's one response format) are checked once
def _compiled(name: str, source: str) -> str:
    M = _llg().LLMatcher
    if name == "json_schema":
        g = M.grammar_from_json_schema(source, defaults=JSON_OPTIONS)
    elif name == "regex":
        g = M.grammar_from_regex(source)
    else:
        g = M.grammar_from_lark(source)
    is_error, messages = M.validate_grammar_with_warnings(g)
    if is_error:
        # llguidance's message spans lines (a caret under the place): one line for logs and HTTP errors
        text = " ".join(line.strip() for line in (messages[0] if messages else "invalid").splitlines())
        raise ValueError(f"{name}: {text.strip()}")
    return g


def _schema(value) -> dict:
    if value is True:
        return {"type": "object"}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"json_schema must be a JSON schema object (a dict), got {type(value).__name__}")
    return value or {"type": "object"}


def choice_grammar(choices) -> str:
    """Lark for exactly one of the strings (JSON string literals are valid Lark literals)."""
    if not isinstance(choices, (list, tuple)) or not choices or not all(
            isinstance(c, str) and c for c in choices):
        raise ValueError(f"choice must be a non-empty list of non-empty strings, got {choices!r}")
    return "start: " + " | ".join(json.dumps(c) for c in dict.fromkeys(choices))


def ll_tokenizer(tokenizer, vocab_size: int, eos_ids):
    """llguidance's tokenizer over ours (its tokenizers JSON), with the model's vocabulary size (the mask's
    width: ids the tokenizer lacks are never allowed) and the ids that end a request. ~1 s: build once."""
    return _llg().LLTokenizer(tokenizer.inner.to_str(), n_vocab=int(vocab_size), eos_token=list(eos_ids))


class Constraint:
    """One sequence's matcher. mask_into() writes the allowed tokens of the next step; consume() advances."""

    def __init__(self, lltok, grammar: str, matcher=None, lane: int = 0):
        """matcher: a fresh matcher of this grammar to take over (Constraints.new's copy) instead of building one;
        lane: the MaskFiller lane that advances and masks it (Constraints.new: copies of one start state share
        one)."""
        self.matcher = matcher if matcher is not None else _llg().LLMatcher(lltok, grammar, log_level=0)
        self.lane = lane
        if self.matcher.is_error():
            raise ValueError(f"constraint: {self.matcher.get_error()}")

    def mask_into(self, row: np.ndarray) -> None:
        """row: a C-contiguous int32 [ceil(vocab / 32)] view (a row of the step's mask array)."""
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def consume(self, token: int) -> None:
        self.matcher.consume_token(int(token))

    @property
    def done(self) -> bool:
        """The grammar is complete and nothing may follow (e.g. a JSON object's closing brace)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


class Constraints:
    """Makes the Constraints of one tokenizer's grammars, from matchers kept in their start state.

    Building a matcher parses and compiles its grammar again (~0.55 ms for bench/structured.py's API object on
    a 2-core EPYC: 35 ms of host time for 64 requests of one schema, on the path of every admission) and
    starts with a cold lexer (its regex automaton is built lazily as the text goes); a deep copy is ~1 us and
    shares its original's lexer, warm from every request served before. But llguidance keeps a parser's lexer
    behind one mutex that its copies share: copies of one matcher compute their masks one at a time, however
    many threads the MaskFiller has (H200 host, 64 rows: 0.95-1.23 ms at 2 to 16 threads). So each grammar
    keeps `lanes` independent start states (as many as the MaskFiller has threads), built on first use, and
    its requests take copies of them in turn: rows of different lanes compute in parallel, each on a warm
    lexer. The last `size` grammars are kept. Thread-safe (requests are submitted from any thread).

    A Constraint's `lane` is the MaskFiller worker that advances and masks it (start_advanced): copies of one
    start state share a lane (their lexer lock would make them wait for each other on two), and each grammar's
    start states begin one lane after the previous grammar's, so rows of many grammars spread over the lanes."""

    def __init__(self, lltok, lanes: int = 1, size: int = 64):
        self.lltok, self.lanes, self.size = lltok, max(int(lanes), 1), size
        self._start: OrderedDict[str, list] = OrderedDict()  # grammar -> its lanes' start-state matchers, LRU
        self._turn: dict[str, int] = {}  # grammar -> requests made of it (the next one's start state)
        # grammar -> the worker lane of its first start state (MaskFiller.start_advanced): grammars kept one after
        # another start one lane further, so the first requests of different grammars do not all go to lane 0
        self._offset: dict[str, int] = {}
        self._grammars = 0  # grammars seen (the next one's offset)
        self._lock = threading.Lock()

    def new(self, grammar: str) -> Constraint:
        with self._lock:
            lanes = self._start.pop(grammar, None) or []
            turn = self._turn.get(grammar, 0)
            try:
                if turn % self.lanes == len(lanes):
                    lanes.append(Constraint(self.lltok, grammar).matcher)  # raises on a grammar in error
            finally:
                if lanes:
                    self._start[grammar] = lanes  # the most recent last
                    self._turn[grammar] = turn + 1
                    if grammar not in self._offset:
                        self._offset[grammar] = self._grammars % self.lanes
                        self._grammars += 1
                    if len(self._start) > self.size:
                        gone = self._start.popitem(last=False)[0]
                        self._turn.pop(gone, None)
                        self._offset.pop(gone, None)
            start = turn % self.lanes
            return Constraint(self.lltok, grammar, lanes[start].deep_copy(),
                              (start + self._offset[grammar]) % self.lanes)


def mask_threads(num_threads: int | None = None) -> int:
    """The MaskFiller's threads: num_threads, or llguidance's own default, 80% of the CPUs, at most 32."""
    return num_threads if num_threads is not None else min(32, int(0.8 * (os.cpu_count() or 1)))


def lanes_enabled(num_threads: int) -> bool:
    """Whether a MaskFiller of num_threads threads advances and masks the rows of a chained step on its lanes
    (MaskFiller.start_advanced) rather than the loop advancing them one after another before start(): only
    when LLAISYS_MASK_LANES=1 (from 2 threads); off by default. Each lane is two threads (its worker and its
    llguidance pool), woken for each step. Measured slower both where it was tried: on a shared 2-core box
    (bench/host_path.py --lanes 2, 64 rows, 7 runs: median 0.87 against 0.81 ms a step, the caller blocked 0.54
    against 0.15 ms) and on an H200 host of 16 CPUs, 12 mask threads (session 35, bench/structured.py 0.5B,
    batch 64, overlap on: constrained / free x1.171 against x1.146 without lanes, the loop blocked 0.633 against
    0.125 ms a step)."""
    return os.environ.get("LLAISYS_MASK_LANES", "") == "1" and num_threads >= 2


class _Latch:
    """Opens once `count` arrivals came (at once for 0). wait() blocks without the GIL."""

    def __init__(self, count: int):
        self.count, self._lock, self._gate = count, threading.Lock(), threading.Lock()
        if count:
            self._gate.acquire()

    def arrive(self) -> None:
        with self._lock:
            self.count -= 1
            last = self.count == 0
        if last:
            self._gate.release()

    def wait(self) -> None:
        self._gate.acquire()
        self._gate.release()


class _LaneJob:
    """One start_advanced() call: `entered` opens once every lane given work is inside its masks' native call
    (or done), `done` once every lane finished; `ended[k]` is what consume[k]'s token left (None: goes on, True:
    complete, a string: the matcher's error); `error` the first exception a lane's masks raised."""

    def __init__(self, lanes: int, consumes: int):
        self.entered, self.done = _Latch(lanes), _Latch(lanes)
        self.ended: list = [None] * consumes
        self.error: BaseException | None = None
        self.t0 = time.perf_counter()
        self.t1 = self.t0  # when the last lane finished


def _lane_main(jobs, executor) -> None:
    """A lane's worker thread: for each job, its rows' consumes, then their masks, each one native call on the
    lane's own one-thread pool (both release the GIL: lanes run side by side, and a lane's masks never wait
    for another lane's consumes). Holds no reference to the MaskFiller: it ends when the filler is collected
    (a None on its queue)."""
    while True:
        got = jobs.get()
        if got is None:
            return
        job, pairs, ks, items, ptr, row_bytes, rows, _keep = got  # _keep: the mask array, alive until done
        try:
            try:
                if pairs:
                    _lane_consume(executor, pairs, ks, job.ended)
            finally:
                job.entered.arrive()  # the caller goes on: every lane is in native code or done
            if items:
                executor.unsafe_compute_mask_ptr(items, ptr, row_bytes, rows)
        except BaseException as e:  # handed to wait(); the worker goes on (a later job may succeed)
            if job.error is None:
                job.error = e
        finally:
            job.t1 = max(job.t1, time.perf_counter())
            job.done.arrive()
        del got, job, pairs, ks, items, _keep  # nothing of this job kept while waiting for the next


def _lane_consume(executor, pairs: list, ks: list[int], ended: list) -> None:
    """pairs: (matcher, token) of one lane, ks their indices in start_advanced's `consume`; ended[k]: what the
    token left (EngineCore._constrained_end's checks). A consume that raises (not a token the grammar refuses:
    that is the matcher's error state) ends each row of the lane with its message: which of them moved is not
    known."""
    try:
        executor.consume_token_par(pairs)  # (releases the GIL: the lanes' consumes run side by side)
        for (m, _), k in zip(pairs, ks):
            if m.is_error():
                ended[k] = m.get_error() or "the matcher failed"
            elif m.is_stopped():
                ended[k] = True
    except Exception as e:
        for k in ks:
            ended[k] = f"advancing the matcher failed ({e!r})"


def _stop_lanes(queues) -> None:
    for q in queues:
        q.put(None)


class MaskFiller:
    """Writes the masks of several constraints at once: on llguidance's thread pool (LLExecutor, which
    releases the GIL; the same masks as one at a time) where it has two threads or more, else one row after
    another (on a 2-core box the pool's one thread made 16 rows 1.5x slower: bench/mask_fill.py). start()
    runs the same fill on a worker thread, so the caller's Python work goes on while llguidance writes.

    start_advanced() (a chained step's rows, where `lanes`: lanes_enabled) also advances the matchers by
    the step ahead's tokens, on one worker thread a lane (Constraint.lane), each with its own one-thread
    llguidance pool: a lane consumes its rows' tokens and goes straight on to their masks, the lanes side by
    side, where the loop used to consume every row one after another before any mask could start (64 rows:
    ~0.25 ms on the H200 host, session 32). A lane's rows share no lexer lock with another lane's, so the
    lanes never wait for each other."""

    def __init__(self, num_threads: int | None = None, lanes: bool | None = None):
        """lanes: whether start_advanced() may be used (default: lanes_enabled)."""
        self.num_threads = mask_threads(num_threads)
        self.lanes = lanes_enabled(self.num_threads) if lanes is None else bool(lanes)
        self._executor = None  # started on the first batch of two or more
        self._worker = None  # start()'s thread, made on its first use
        self._pending = None  # start()'s fill not waited for yet (a Future)
        self._queues = None  # start_advanced()'s lanes' job queues, made on first use
        self._job = None  # start_advanced()'s job not waited for yet

    def fill(self, constraints: list[Constraint], mask: np.ndarray, entered: threading.Event | None = None) -> None:
        """mask: C-contiguous int32 [len(constraints), ceil(vocab / 32)]; row j gets constraints[j]'s.
        entered (start()'s worker): set just before the native call, which then covers every row."""
        if len(constraints) == 1 or (self.num_threads < 2 and entered is None):
            if entered is not None:
                entered.set()
            for c, row in zip(constraints, mask):
                c.mask_into(row)
            return
        if self._executor is None:  # the pool even with one thread under start(): one native call (see start())
            self._executor = _llg().LLExecutor(max(self.num_threads, 1))
        # by lane: the pool's threads take runs of the list, so each mostly works on one lane (Constraints)
        items = [(c.matcher, j) for j, c in sorted(enumerate(constraints), key=lambda jc: jc[1].lane)]
        if entered is not None:
            entered.set()
        self._executor.unsafe_compute_mask_ptr(items, mask.ctypes.data, mask.shape[1] * 4, mask.shape[0])

    def start(self, constraints: list[Constraint], mask: np.ndarray) -> None:
        """fill() on a worker thread; returns once the worker is inside llguidance's native call (which runs
        without the GIL), so the fill runs while the caller's Python goes on. Until wait() returns, the caller
        touches neither these matchers (llguidance holds them) nor `mask`.

        Why the hand-over: a thread that wants the GIL while another runs Python gets it only when that one
        blocks or after the switch interval (5 ms). Without it the worker waited for the GIL until the caller
        blocked in wait(), so the fill ran after the caller's work instead of beside it (bench/host_path.py).
        For the same reason the worker makes one native call for all its rows."""
        if self._pending is not None:
            raise RuntimeError("MaskFiller.start: the last fill was not waited for")
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="llaisys-masks")
        entered = threading.Event()
        self._pending = self._worker.submit(self._timed_fill, constraints, mask, entered)
        entered.wait()  # blocks, so the worker takes the GIL now; it gives it back in the native call

    def start_advanced(self, consume: list, constraints: list[Constraint], mask: np.ndarray | None) -> list:
        """consume: (Constraint, token) pairs; constraints: row j of `mask` gets constraints[j]'s mask (mask None
        when there are none). On the lanes (see the class): each lane advances its constraints of `consume` by
        their tokens, then writes the masks of its constraints of `constraints`, so a constraint in both is
        masked after its token. Returns once every lane is inside its masks' native call (start()'s GIL
        hand-over), with what each consume left: None (goes on), True (the grammar is complete) or the
        matcher's error (a string). Until wait() returns the caller touches none of these matchers (llguidance
        holds them) nor `mask`."""
        if self._pending is not None or self._job is not None:
            raise RuntimeError("MaskFiller.start_advanced: the last fill was not waited for")
        L = self.num_threads
        if self._queues is None:
            self._queues = [_start_lane(i) for i in range(L)]
            weakref.finalize(self, _stop_lanes, list(self._queues))
        pairs, ks, masks = [[] for _ in range(L)], [[] for _ in range(L)], [[] for _ in range(L)]
        for k, (c, token) in enumerate(consume):
            lane = c.lane % L
            pairs[lane].append((c.matcher, token))
            ks[lane].append(k)
        for j, c in enumerate(constraints):
            masks[c.lane % L].append((c.matcher, j))
        busy = [i for i in range(L) if ks[i] or masks[i]]
        job = _LaneJob(len(busy), len(consume))
        if mask is not None:
            ptr, row_bytes, rows = mask.ctypes.data, mask.shape[1] * 4, mask.shape[0]
        else:
            ptr = row_bytes = rows = 0
        for i in busy:
            self._queues[i].put((job, pairs[i], ks[i], masks[i], ptr, row_bytes, rows, mask))
        self._job = job
        job.entered.wait()  # blocks: the lanes take the GIL in turn until each is inside its native call
        return job.ended

    def wait(self) -> float:
        """Returns once start()'s fill (or start_advanced()'s consumes and masks) is written (at once when none
        is pending): the seconds it took on the worker(s). Raises what the fill raised."""
        job, self._job = self._job, None
        if job is not None:
            job.done.wait()
            if job.error is not None:
                raise job.error
            return job.t1 - job.t0
        pending, self._pending = self._pending, None
        return 0.0 if pending is None else pending.result()

    def _timed_fill(self, constraints, mask, entered) -> float:
        t = time.perf_counter()
        try:
            self.fill(constraints, mask, entered)
        finally:
            entered.set()  # never leave start() waiting
        return time.perf_counter() - t


def _start_lane(i: int):
    """A lane's job queue, its worker thread started (_lane_main) with its own one-thread llguidance pool."""
    jobs = queue.SimpleQueue()
    threading.Thread(target=_lane_main, args=(jobs, _llg().LLExecutor(1)), name=f"llaisys-lane-{i}",
                     daemon=True).start()
    return jobs


class Trigger:
    """A constraint that starts inside the output (tool_choice "auto": free text until the model begins a
    call). `after`: the constraint of what follows the token `token_id`, wherever it comes (a tagged call's
    `<tool_call>`). `opening`: a constraint the whole answer follows when its first token is not blank and is
    one that `opening` accepts as its start (a bare JSON call); that token is its first."""

    def __init__(self, token_id: int | None, after: Constraint | None, opening: Constraint | None, blank):
        self.token_id, self.after, self.opening, self.blank = token_id, after, opening, blank

    def fire(self, token: int, first: bool) -> Constraint | None:
        """The constraint that starts with the output's token `token` (first: the output's first), or None."""
        if token == self.token_id:
            return self.after
        if first and self.opening is not None and not self.blank(token):
            if self.opening.matcher.try_consume_tokens([int(token)]) == 1:
                return self.opening
        return None
