"""StreamingLLM's perplexity experiment at small scale with the real default model on the CPU
(bench/streaming_ppl.py; the table at a larger size is in bench/RESULTS.md): over a public text several
times the window, sinks + a rolling window stay within 10% of the sliding window that recomputes (the
paper's upper baseline; here it is even below it), and the window without sinks collapses."""
import os
import sys

import pytest

from tiny_model import real_model_path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import streaming_ppl  # noqa: E402

TEXT = streaming_ppl.DEFAULT_TEXT


@pytest.mark.skipif(not os.path.exists(TEXT), reason=f"{TEXT} (Debian's base-files) is not on this machine")
def test_sinks_keep_perplexity_where_a_plain_window_collapses():
    from llaisys.engine.engine import Engine

    eng = Engine(real_model_path(), device="cpu", progress=False, max_seq_len=512)
    ids = eng.tokenize(open(TEXT).read())[:384]  # 6x the window
    rows = streaming_ppl.run(eng, ids, window=64, sinks=4, stride=24)
    eng.close()
    print(streaming_ppl.table(rows, 0, 0))
    dense, sinks, no_sinks, recompute = (v[0] for v in rows.values())
    assert sinks <= 1.10 * recompute
    assert no_sinks > 2 * sinks
    assert dense < sinks  # the full context still helps: the window loses something, not nothing
