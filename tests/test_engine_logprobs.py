"""The engine's logprobs entries (EngineCore._logprobs: one ops.logprobs call a step) against the float64
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
    own = EngineCore._logprobs

    def spy(self, rows, temperature, chosen, ks):
        out = own(self, rows, temperature, chosen, ks)
        logits = self.runner.last_logits().to("cpu").to("f32").numpy().astype(np.float64)
        for row, k, entry in zip(rows.tolist(), ks, out):
            ref = reference_entry(logits[row], float(temperature[row]), int(chosen[row]), k)
            assert entry["token_id"] == ref["token_id"]
            assert entry["logprob"] == pytest.approx(ref["logprob"], abs=1e-4)  # f32 sum over V (test_ops_logprobs)
            assert [i for i, _ in entry["top"]] == [i for i, _ in ref["top"]]
            np.testing.assert_allclose([x for _, x in entry["top"]], [x for _, x in ref["top"]], atol=1e-4)
        seen.append(len(out))
        return out

    monkeypatch.setattr(EngineCore, "_logprobs", spy)
    with Engine(tiny, device=device, dtype=dtype, progress=False, max_seq_len=256, num_kv_blocks=256) as eng:
        rng = np.random.default_rng(3)
        ps = [[int(t) for t in rng.integers(0, eng.config.vocab_size, n)] for n in (5, 30, 12, 70)]
        out = eng.generate(ps, max_new_tokens=[12, 4, 20, 9], temperature=[0, 0.8, 1.3, 0], seed=[1, 2, 3, 4],
                           logprobs=[5, None, 20, 0], ignore_eos=True)
        batch_steps = eng.stats()["decode_batch_steps"]
    assert [r.logprobs is None for r in out] == [False, True, False, False]
    assert [len(r.logprobs or ()) for r in out] == [12, 0, 20, 9]
    assert sum(seen) == 12 + 20 + 9 and batch_steps > 0  # every entry checked, some from the decode batch
