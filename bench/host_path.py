"""Issue 31: where constrained decode's host path goes per row and per step, on real llguidance matchers over
the model's tokenizer and bench/structured.py's schema, at B rows sitting at different places of the grammar
(each advanced by a random allowed token a step, as a batch's rows are). Per step (medians over the steps):

- consumes: each row's consume_token and its error/done checks one after another (EngineCore's pass);
- masks one after another, with each row's own time: the distribution (median, p90, max row) and the
  "skew bound" max(max row, sum / T), the least a pool of T threads could take for that step (T = the
  MaskFiller's threads, or --threads), against what MaskFiller.fill took;
- the GIL hand-over of a worker-thread fill (MaskFiller.start/wait) while the caller runs Python (a spin of
  --busy-us microseconds standing for the loop's accounting and delivery): from start() to the fill written,
  against the fill alone. A Python thread that wants the GIL back while another runs Python waits up to the
  switch interval (5 ms) unless the holder blocks.

    LLAISYS_BUILD_DIR=build/dev PYTHONPATH=python python bench/host_path.py --batch 16 64
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from mask_fill import random_allowed, setup  # this folder is sys.path[0] when run as a script


def spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--shape", default=None, help="a random checkpoint of this shape (the test tokenizer)")
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=None, help="MaskFiller threads (default: the engine's)")
    ap.add_argument("--busy-us", type=float, default=300.0, help="the caller's Python work during a start()")
    ap.add_argument("--scan", type=int, nargs="*", default=[], metavar="T",
                    help="then, per batch, LLExecutor's mask time and consume_token_par's at each of these thread "
                         "counts, on matchers in the same states (how the pool scales on this host)")
    ap.add_argument("--lanes", type=int, nargs="*", default=[], metavar="T",
                    help="then, per batch, a step's consumes + masks at each of these thread counts: the loop's consumes "
                         "one after another then MaskFiller.fill (before), against MaskFiller.start_advanced, the "
                         "consumes and masks on T lanes (now), on matchers in the same states")
    args = ap.parse_args()

    from llaisys import constraints

    eng, vocab, lltok, grammar, filler = setup(args)
    T = max(filler.num_threads, 1)
    W = (vocab + 31) // 32
    print(f"{os.cpu_count()} CPUs, vocab {vocab}, {T} mask threads, switch interval "
          f"{sys.getswitchinterval() * 1e3:.1f} ms, load average {os.getloadavg()[0]:.2f}")
    for batch in args.batch:
        rng = np.random.default_rng(0)
        # three sets of matchers in the same states: each state's mask is computed once by each way (a second
        # mask of one state finds llguidance's caches warm)
        sets = [[constraints.Constraint(lltok, grammar) for _ in range(batch)] for _ in range(3)]
        cons, serial, med, p90, mx, bound, fill, handed = [], [], [], [], [], [], [], []
        for step in range(args.steps):
            live = [j for j in range(batch) if not sets[0][j].done]
            if not live:
                break
            a = np.empty((len(live), W), np.int32)
            b, c = np.empty_like(a), np.empty_like(a)
            per = []
            for k, j in enumerate(live):  # one after another, each row timed
                t = time.perf_counter()
                sets[0][j].mask_into(a[k])
                per.append(time.perf_counter() - t)
            t = time.perf_counter()
            filler.fill([sets[1][j] for j in live], b)
            fill.append(time.perf_counter() - t)
            t = time.perf_counter()
            filler.start([sets[2][j] for j in live], c)
            spin(args.busy_us)
            filler.wait()
            handed.append(time.perf_counter() - t)
            assert (a == b).all() and (a == c).all()
            serial.append(sum(per))
            med.append(statistics.median(per))
            p90.append(float(np.percentile(per, 90)))
            mx.append(max(per))
            bound.append(max(max(per), sum(per) / T))
            toks = random_allowed(rng, a, vocab)
            t = time.perf_counter()
            for j, tok in zip(live, toks):
                m = sets[0][j]
                m.consume(tok)
                m.error is None and m.done
            cons.append(time.perf_counter() - t)
            for s in sets[1:]:
                for j, tok in zip(live, toks):
                    s[j].consume(tok)
        ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
        print(f"batch {batch:3d} ({len(serial)} steps), ms a step: consumes {ms(cons):.3f} "
              f"({ms(cons) / batch * 1e3:.1f} us a row); masks one after another {ms(serial):.3f}, a row: median "
              f"{ms(med) * 1e3:.0f} us, p90 {ms(p90) * 1e3:.0f} us, max {ms(mx) * 1e3:.0f} us; skew bound at {T} "
              f"threads {ms(bound):.3f}; MaskFiller.fill {ms(fill):.3f}; start + {args.busy_us:.0f} us of Python + "
              f"wait {ms(handed):.3f}", flush=True)
        if args.scan:
            scan(lltok, grammar, batch, args.steps, args.scan, W, vocab)
        if args.lanes:
            lanes(lltok, grammar, batch, args.steps, args.lanes, W, vocab)
    eng.close()
    return 0


def scan(lltok, grammar, batch: int, steps: int, counts: list[int], W: int, vocab: int) -> None:
    """A MaskFiller (llguidance's LLExecutor) at each thread count in `counts`, its rows in as many lanes and in
    one lane, all in the same states (advanced by the same random allowed tokens): ms a step (median) for the
    masks and for llguidance's consume_token_par, against consume_token one row after another."""
    import llguidance

    from llaisys import constraints
    rng = np.random.default_rng(1)
    # each thread count's rows in as many lanes (what the engine's Constraints does), and copies of one matcher
    # (one lane: llguidance's copies share one lexer lock)
    sets = {t: [m.new(grammar) for _ in range(batch)] for t in counts
            for m in [constraints.Constraints(lltok, lanes=t)]}
    counts = counts + [-t for t in counts if t > 1]
    pools = {t: llguidance.LLExecutor(abs(t)) for t in counts}
    fillers = {t: constraints.MaskFiller(abs(t)) for t in counts}  # its fill orders the rows by lane
    one = constraints.Constraints(lltok)
    sets.update({t: [one.new(grammar) for _ in range(batch)] for t in counts if t < 0})
    masks_t = {t: [] for t in counts}
    cons_t = {t: [] for t in counts}
    serial_c = []
    ref = counts[0]
    for _ in range(steps):
        live = [j for j in range(batch) if not sets[ref][j].done]
        if not live:
            break
        out = {}
        for t in counts:
            a = np.empty((len(live), W), np.int32)
            tt = time.perf_counter()
            fillers[t].fill([sets[t][j] for j in live], a)
            masks_t[t].append(time.perf_counter() - tt)
            out[t] = a
        assert all((out[t] == out[ref]).all() for t in counts)
        toks = random_allowed(rng, out[ref], vocab)
        for i, t in enumerate(counts):
            if i == 0:  # one after another, as the engine's loop does
                tt = time.perf_counter()
                for j, tok in zip(live, toks):
                    sets[t][j].consume(tok)
                serial_c.append(time.perf_counter() - tt)
            else:
                tt = time.perf_counter()
                ok = pools[t].consume_token_par([(sets[t][j].matcher, tok) for j, tok in zip(live, toks)])
                cons_t[t].append(time.perf_counter() - tt)
                assert all(ok)
    ms = lambda xs: statistics.median(xs) * 1e3 if xs else float("nan")  # noqa: E731
    print(f"batch {batch:3d} scan ({len(serial_c)} steps): consumes one after another {ms(serial_c):.3f} ms; "
          + "; ".join(f"{abs(t)} threads{' one lane' if t < 0 else ''}: masks {ms(masks_t[t]):.3f}, "
                      f"consume_token_par {ms(cons_t[t]):.3f}" for t in counts), flush=True)


def lanes(lltok, grammar, batch: int, steps: int, counts: list[int], W: int, vocab: int) -> None:
    """At each thread count T in `counts`, a step of `batch` rows in T lanes (Constraints(lanes=T)), from the
    step's tokens to its masks written: before, the loop's consumes one after another (with the error/done checks
    of EngineCore._advance_constrained) then MaskFiller.fill on llguidance's pool of T threads; now,
    MaskFiller.start_advanced (each lane's consumes then its masks, on its own thread) and wait(). Both on
    matchers in the same states, the ways alternating; ms a step (median over steps) of the whole, and of the
    caller's part before the masks run without it (before: the consumes; now: start_advanced's return)."""
    from llaisys import constraints
    rng = np.random.default_rng(2)
    ways = [(t, way) for t in counts for way in ("before", "now")]
    sets = {w: [m.new(grammar) for _ in range(batch)] for w in ways
            for m in [constraints.Constraints(lltok, lanes=w[0])]}
    fillers = {w: constraints.MaskFiller(w[0], lanes=w[1] == "now") for w in ways}
    whole, caller = {w: [] for w in ways}, {w: [] for w in ways}
    first = np.empty((batch, W), np.int32)
    fillers[ways[0]].fill(sets[ways[0]], first)  # the start state's masks (nothing to consume yet)
    for w in ways[1:]:
        fillers[w].fill(sets[w], np.empty_like(first))  # (warms each set's lexers as the first did)
    live, toks = list(range(batch)), random_allowed(rng, first, vocab)
    for step in range(steps):
        out, ended = {}, {}
        for w in (ways if step % 2 == 0 else ways[::-1]):
            cs = [sets[w][j] for j in live]
            mask = np.empty((len(live), W), np.int32)
            t0 = time.perf_counter()
            if w[1] == "before":
                ends = []
                for c, tok in zip(cs, toks):
                    m = c.matcher
                    m.consume_token(tok)
                    ends.append(m.is_error() or m.is_stopped())
                t1 = time.perf_counter()
                fillers[w].fill(cs, mask)
            else:
                ends = [e is not None for e in fillers[w].start_advanced(list(zip(cs, toks)), cs, mask)]
                t1 = time.perf_counter()
                fillers[w].wait()
            t2 = time.perf_counter()
            whole[w].append(t2 - t0)
            caller[w].append(t1 - t0)
            out[w], ended[w] = mask, ends
        ref = ways[0]
        assert all((out[w] == out[ref]).all() and ended[w] == ended[ref] for w in ways)
        keep = [k for k, e in enumerate(ended[ref]) if not e]
        if not keep:
            break
        live = [live[k] for k in keep]
        toks = random_allowed(rng, out[ref][keep], vocab)
    ms = lambda xs: statistics.median(xs) * 1e3 if xs else float("nan")  # noqa: E731
    print(f"batch {batch:3d} lanes ({len(whole[ways[0]])} steps), tokens -> masks written, ms a step (the caller's "
          f"part): " + "; ".join(f"{t} threads: before {ms(whole[(t, 'before')]):.3f} ({ms(caller[(t, 'before')]):.3f}), "
                                 f"now {ms(whole[(t, 'now')]):.3f} ({ms(caller[(t, 'now')]):.3f})" for t in counts),
          flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
