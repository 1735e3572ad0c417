import os
import sys

import pytest

# Tests import helpers from this folder (tests/utils.py), and the benchmark code from bench/ (bench/llaisys_bench,
# which the installed package does not ship).
sys.path.insert(0, os.path.dirname(__file__))
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))  # last: no shadowing


CUDA_REASON = "needs a CUDA build and a GPU (run `pytest -m cuda` on a GPU machine)"
_DESELECTED_CUDA = pytest.StashKey[int]()


def pytest_collection_modifyitems(config, items):
    """Without a GPU, the CUDA tests are deselected (the summary counts them as 'deselected', and a line at
    the end says why), not skipped one by one: on a CPU machine they would be half the run's `s` marks. Asked
    for by name (`-m cuda`), they are skipped with their reason instead, so that the run says why nothing ran."""
    import llaisys

    if llaisys.cuda_is_available():
        return
    cuda = [item for item in items if "cuda" in item.keywords]
    if not cuda:
        return
    if "cuda" in (config.getoption("markexpr", "") or ""):
        skip = pytest.mark.skip(reason=CUDA_REASON)
        for item in cuda:
            item.add_marker(skip)
        return
    config.hook.pytest_deselected(items=cuda)
    items[:] = [item for item in items if "cuda" not in item.keywords]
    config.stash[_DESELECTED_CUDA] = len(cuda)


def pytest_terminal_summary(terminalreporter, config):
    n = config.stash.get(_DESELECTED_CUDA, 0)
    if n:
        terminalreporter.write_line(f"{n} CUDA tests deselected: no CUDA build or no GPU here (run `pytest -m cuda` "
                                    f"on a GPU machine)")
