"""`llaisys bench`: its random model must be as big in memory as the real one, and a figure above the
roofline must never print without a warning (issue 16, item 3)."""
import numpy as np
import pytest

from llaisys import bench

# A small Qwen2 shape (HF config values): every weight kind, a few MB in all
SMALL = dict(vocab_size=1000, hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
             max_position_embeddings=512)


class _Recorder:
    """Stands in for _core.Qwen2 and keeps every tensor random_model loads."""

    def __init__(self, config, dtype, device, max_seq_len):
        self.dtype, self.weights = dtype, {}

    def load_weight(self, name, value):
        self.weights[name] = value


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_random_model_weights_are_distinct_memory_of_their_real_size(monkeypatch, dtype):
    """Overlapping windows of one pool let the whole model sit in a CPU's cache (154% of roofline)."""
    monkeypatch.setattr(bench._core, "Qwen2", _Recorder)
    model = bench.random_model(SMALL, dtype, "cpu", 64)
    shapes = bench.weight_shapes(SMALL)
    assert model.weights.keys() == shapes.keys()
    spans = []
    for name, t in model.weights.items():
        assert t.shape == shapes[name] and t.dtype == dtype, name
        spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size, name))
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        assert begin >= end, f"{a} and {b} share memory"


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
def test_random_weights_look_like_an_initialised_model(dtype):
    weights = dict(bench.random_weights(SMALL, dtype, seed=1))
    w = weights["model.layers.1.mlp.down_proj.weight"].astype(np.float64)
    assert np.isfinite(w).all() and 0.0078 <= np.abs(w).min() and np.abs(w).max() < 0.032
    assert abs(w.mean()) < 1e-3 and 0.01 < w.std() < 0.03  # both signs, not one repeated value
    assert len(np.unique(w)) > 100
    np.testing.assert_array_equal(weights["model.norm.weight"].astype(np.float32), 1.0)
    other = weights["model.layers.2.mlp.down_proj.weight"].astype(np.float64)
    assert not np.array_equal(w, other)  # each weight drawn anew, not a copy of one block


def _result(fraction: float) -> dict:
    return {"engine": "llaisys", "model": "qwen2-0.5b", "device": "cpu", "dtype": "bf16", "prefill_tok_s": 90.0,
            "ttft_ms": 1400.0, "decode_tok_s": 40.0 * fraction, "decode_ms_per_token": 25.0 / fraction,
            "fraction_of_roofline": fraction}


def test_above_roofline_prints_a_warning():
    row = bench.format_row(_result(1.54))
    assert "154% of roofline" in row and "WARNING" in row and "cache" in row
    assert bench.roofline_warning(_result(1.54)) in row


def test_below_roofline_prints_no_warning():
    assert "WARNING" not in bench.format_row(_result(0.97))
    assert bench.roofline_warning(_result(0.97)) is None
    peer = {k: v for k, v in _result(2.0).items() if k != "fraction_of_roofline"}  # peers have no roofline
    assert "WARNING" not in bench.format_row(peer)


def test_bench_model_runs_one_request_through_the_engine(tmp_path):
    """--model measures the Engine users get (scheduler, paged KV cache), on fresh prompts."""
    from llaisys import bench
    from tiny_model import make_tiny_qwen2

    path = make_tiny_qwen2(tmp_path / "m", seed=3)
    r = bench.bench(model=path, device="cpu", dtype="f32", prompt_len=20, new_tokens=6)
    assert r["model"] == path and r["prompt_len"] == 20 and r["new_tokens"] == 6
    assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 and r["ttft_ms"] > 0
