"""Splitting the sampling keywords of a batched call into one dict per prompt.

A keyword takes one value for every prompt or a list/tuple with one value per prompt. `stop` and
`stop_token_ids` (and `choice`) already accept lists as a single value, so their per-prompt form is a list whose items
are each a list, a tuple or None (`stop=[["\\n"], None]`); a flat list applies to every prompt."""
from __future__ import annotations

_LIST_VALUED = ("stop", "stop_token_ids", "choice")


def _per_prompt(name: str, value, n: int) -> bool:
    if not isinstance(value, (list, tuple)):
        return False
    if name in _LIST_VALUED:
        return bool(value) and all(v is None or isinstance(v, (list, tuple)) for v in value)
    return True


def split_sampling(call: str, sampling: dict, n: int) -> list[dict]:
    out = [dict() for _ in range(n)]
    for name, value in sampling.items():
        if _per_prompt(name, value, n):
            if len(value) != n:
                raise ValueError(f"{call}(): {name} has {len(value)} values for {n} prompts (give one value, "
                                 f"or one per prompt)")
            for d, v in zip(out, value):
                d[name] = v
        else:
            for d in out:
                d[name] = value
    return out
