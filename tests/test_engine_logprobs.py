"""The engine's logprobs entries (EngineCore._logprobs_arrays: one ops.logprobs call a step) against the float64
formula EngineCore used before, applied to the very logits each step sampled from: every row that asked,
in the persistent decode batch and in the general path, greedy and sampled, k from 0 to 20."""
import numpy as np
import pytest

from llaisys.engine.core import EngineCore
from llaisys.engine.engine import Engine
from tiny_model import make_tiny_qwen2
from utils import DEVICES


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_qwen2(tmp_path_factory.mktemp("lp"), seed=5, max_position_embeddings=512)


def reference_entry(x64, temperature: float, token: int, k: int) -> dict:
    """The pre-op EngineCore._logprobs on one row of logits (float64, ties to the lower id)."""
    x = x64 / (temperature or 1.0)
    m = x.max()
    lp = x - (m + np.log(np.exp(x - m).sum()))
    top = np.lexsort((np.arange(lp.size), -lp))[:k]
    return {"token_id": token, "logprob": lp[token], "top": [[int(i), lp[i]] for i in top]}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_entries_equal_the_float64_formula_on_the_steps_logits(tiny, device, dtype, monkeypatch):
    seen = []
    own = EngineCore._logprobs_arrays

    def spy(self, rows, temperature, chosen, k):  # every logprobs computed from a step's logits come here
        out = own(self, rows, temperature, chosen, k)
        chosen_lp, top_ids, top_lp = out
        assert top_ids.shape == top_lp.shape == (len(rows), k)
        logits = self.runner.last_logits().to("cpu").to("f32").numpy().astype(np.float64)
        for i, row in enumerate(rows.tolist()):
            ref = reference_entry(logits[row], float(temperature[row]), int(chosen[row]), k)
            assert chosen_lp[i] == pytest.approx(ref["logprob"], abs=1e-4)  # f32 sum over V (test_ops_logprobs)
            assert top_ids[i].tolist() == [i for i, _ in ref["top"]]
            np.testing.assert_allclose(top_lp[i], [x for _, x in ref["top"]], atol=1e-4)
        seen.append(len(rows))
        return out

    monkeypatch.setattr(EngineCore, "_logprobs_arrays", spy)
    # overlap off: every step's logprobs come from EngineCore._logprobs_arrays (the device path below is compared
    # with it); the rows of generate() are quiet (read at their end), their entries built from those arrays then
    # (engine/logprobs_log.py); test_engine_logprobs_log.py compares them with streamed ones, built step by step
    with Engine(tiny, device=device, dtype=dtype, progress=False, max_seq_len=256, num_kv_blocks=256,
                overlap_steps=False) as eng:
        rng = np.random.default_rng(3)
        ps = [[int(t) for t in rng.integers(0, eng.config.vocab_size, n)] for n in (5, 30, 12, 70)]
        out = eng.generate(ps, max_new_tokens=[12, 4, 20, 9], temperature=[0, 0.8, 1.3, 0], seed=[1, 2, 3, 4],
                           logprobs=[5, None, 20, 0], ignore_eos=True)
        batch_steps = eng.stats()["decode_batch_steps"]
    assert [r.logprobs is None for r in out] == [False, True, False, False]
    assert [len(r.logprobs or ()) for r in out] == [12, 0, 20, 9]
    assert sum(seen) == 12 + 20 + 9 and batch_steps > 0  # every entry checked, some from the decode batch


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_overlapped_steps_compute_entries_on_the_device(tiny, device, dtype):
    """With overlapped steps, a batch step's logprobs are computed on the device behind it (Runner.
    enqueue_logprobs) and read with its tokens, so rows with logprobs chain: the same tokens and entries as
    the plain loop (whose entries the test above checks against float64), rows ending mid-batch included."""
    def run(overlap):
        with Engine(tiny, device=device, dtype=dtype, progress=False, max_seq_len=256, num_kv_blocks=256,
                    overlap_steps=overlap) as eng:
            rng = np.random.default_rng(4)
            ps = [[int(t) for t in rng.integers(0, eng.config.vocab_size, n)] for n in (5, 30, 12, 70, 9)]
            out = eng.generate(ps, max_new_tokens=[12, 4, 20, 9, 30], temperature=[0, 0.8, 1.3, 0, 0.7],
                               seed=[1, 2, 3, 4, 5], logprobs=[5, None, 20, 0, 3], ignore_eos=True)
            return out, eng.stats()["overlapped_steps"]

    (plain, n_plain), (over, n_over) = run(False), run(True)
    assert n_plain == 0 and n_over > 15  # the rows with logprobs chained
    with Engine(tiny, device=device, dtype=dtype, progress=False, max_seq_len=256, num_kv_blocks=256,
                overlap_steps=True) as eng:  # every row with logprobs=0 (the chosen token's alone)
        ps = [[3, 4, 5], [6, 7, 8, 9]]
        zero = eng.generate(ps, max_new_tokens=[6, 9], temperature=0, logprobs=0, ignore_eos=True)
        assert eng.stats()["overlapped_steps"] > 3
    assert [len(r.logprobs) for r in zero] == [6, 9] and all(e["top"] == [] for r in zero for e in r.logprobs)
    for a, b in zip(plain, over):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert (a.logprobs is None) == (b.logprobs is None)
        for ea, eb in zip(a.logprobs or (), b.logprobs or ()):
            assert ea["token_id"] == eb["token_id"] and [i for i, _ in ea["top"]] == [i for i, _ in eb["top"]]
            assert eb["logprob"] == pytest.approx(ea["logprob"], abs=1e-5)
            np.testing.assert_allclose([x for _, x in eb["top"]], [x for _, x in ea["top"]], atol=1e-5)
    assert [len(r.logprobs or ()) for r in over] == [12, 0, 20, 9, 30]
