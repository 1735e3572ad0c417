import os
import sys

import pytest

# Tests import helpers from this folder (tests/utils.py), and the benchmark code from bench/ (bench/llaisys_bench,
# which the installed package does not ship).
sys.path.insert(0, os.path.dirname(__file__))
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))  # last: no shadowing


def pytest_collection_modifyitems(config, items):
    import llaisys

    if llaisys.cuda_is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA build and a GPU (run `pytest -m cuda` on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
