"""cProfile of an Engine's step-loop thread (where its steps run) over a piece of work: where the host's part
of a step goes. A C++ method's time counts as its Python caller's own time, a wait for the device included
(ModelRunner.finish). The profiler slows Python calls, so this shows shares, not how long a step takes."""
from __future__ import annotations

import cProfile
import pstats
import sys


def own_times(eng, run) -> dict:
    """{(file, line, function): (calls, own seconds)} of the loop thread while run() runs."""
    prof = cProfile.Profile()
    eng._loop.call(prof.enable)  # enable() profiles the calling thread: the loop's
    try:
        run()
    finally:
        eng._loop.call(prof.disable)
    return {k: (v[1], v[2]) for k, v in pstats.Stats(prof).stats.items()}


def report(title: str, times: dict, per: int, top: int, minus: dict | None = None, out=sys.stderr) -> None:
    """Prints the `top` functions by own time per `per` (steps), after subtracting `minus` (a shorter run's
    times, so that what both runs share cancels)."""
    minus = minus or {}
    rows = []
    for key, (calls, own) in times.items():
        c0, o0 = minus.get(key, (0, 0.0))
        rows.append(((own - o0) / per, (calls - c0) / per, key))
    rows.sort(reverse=True)
    print(f"{title}: profiled host time {sum(r[0] for r in rows) * 1e3:.3f} ms a step (own time, per step):", file=out)
    for own, calls, (path, line, name) in rows[:top]:
        where = f"{path.rsplit('/', 1)[-1]}:{line}" if line else path
        print(f"  {own * 1e3:8.3f} ms {calls:8.1f} calls  {name} ({where})", file=out)
    out.flush()
