"""EngineConfig.graphs_at_start: every decode graph captured when the engine starts (ModelRunner.capture_graphs)
instead of at the first step of each batch size."""
import numpy as np
import pytest

import llaisys
from llaisys.engine import EngineConfig
from test_serving_engine import engine, prompts
from tiny_model import make_tiny_qwen2
from utils import DEVICES

SIZES = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_qwen2(tmp_path_factory.mktemp("graphs_at_start"), seed=6)


def _run(eng, ps):
    out = eng.generate(ps, max_new_tokens=[6, 9, 3, 12, 7, 5], temperature=[0, 0.8, 0, 1.1, 0, 0.5],
                       seed=list(range(len(ps))), ignore_eos=True, logprobs=2)
    # then a prompt sharing a whole block with one of them: a prefix hit
    out.append(eng.generate(ps[1][:16] + [7, 8], max_new_tokens=4, temperature=0, ignore_eos=True, logprobs=2))
    return ([r.token_ids for r in out], np.concatenate([[e["logprob"] for e in r.logprobs] for r in out]),
            eng.stats()["prefix_cache_hit_rate"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tp", [1, 2])
def test_graphs_captured_at_start_change_no_output(tiny, device, tp):
    """The warm-up steps write only the reserved block 0: sampled tokens, logprobs and prefix hits equal those
    of an engine that captures at first use. On CUDA the engine captured every size at start; on the CPU
    (nothing is captured there, and the engine does not call it) the same steps run when asked."""
    if device == "cuda" and tp > llaisys.cuda_device_count():
        pytest.skip(f"needs {tp} GPUs")
    ps = prompts(400, [3, 17, 9, 30, 5, 40], seed=4)
    runs = []
    for at_start in (True, False):
        with engine(tiny, device, graph_batch_sizes=SIZES, max_num_seqs=8, graphs_at_start=at_start, max_seq_len=256,
                    tensor_parallel_size=tp) as eng:
            runner = eng._core.runner
            if device == "cpu" and at_start:
                assert runner.capture_graphs(eng._core.config.graph_sizes) == list(SIZES)
            if device == "cuda":
                assert runner.runner.captured_batch_sizes == (list(SIZES) if at_start else [])
            runs.append(_run(eng, ps))
    assert runs[0][0] == runs[1][0]
    np.testing.assert_allclose(runs[0][1], runs[1][1], rtol=1e-6, atol=1e-6)
    assert runs[0][2] == runs[1][2] > 0


def test_graphs_at_start_setting():
    assert EngineConfig().graphs_at_start is True
    assert EngineConfig(graphs_at_start=False).graphs_at_start is False
    with pytest.raises(ValueError, match="graphs_at_start must be True or False"):
        EngineConfig(graphs_at_start="yes")


def test_warm_up_of_a_model_that_computes_nan_leaves_the_error_to_requests(tmp_path):
    """A checkpoint with a NaN weight: the warm-up steps (whose tokens are dropped) do not fail the engine's
    start; each request still raises its non-finite-logits error at its first token (on CUDA the engine's own
    start runs them: tests/test_model.py's NaN test covers that path)."""
    from test_model import _nan_checkpoint

    path = _nan_checkpoint(tmp_path, "model.norm.weight")
    with engine(path, "cpu", graph_batch_sizes=SIZES, max_num_seqs=8, max_seq_len=256) as eng:
        assert eng._core.runner.capture_graphs(eng._core.config.graph_sizes) == list(SIZES)
        with pytest.raises(RuntimeError, match=r"non-finite logits \(NaN or Inf\) at generation step 0"):
            eng.generate([1, 2, 3], max_new_tokens=4, temperature=0)
