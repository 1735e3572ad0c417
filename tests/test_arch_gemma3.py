"""Gemma 3 (text) against HF transformers' Gemma3ForCausalLM, f32 on the CPU: (1 + w) RMSNorms before and
after each block, q/k norms, GeGLU (tanh), scaled embeddings, tied head, sliding-window layers with their own
RoPE base beside global ones; sequences longer than the window (prefill, decode, chunked prefill)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import arch_check  # noqa: E402
from llaisys.engine import Engine  # noqa: E402


def _tiny(dirpath, query_pre_attn_scalar):
    # 7 layers: 5 windowed, the 6th global, the 7th windowed again; window 16 < the prompts and generations
    return arch_check.make_tiny(dirpath, "gemma3", seed=13, num_hidden_layers=7, head_dim=32, num_attention_heads=4,
                                num_key_value_heads=1, sliding_window=16, query_pre_attn_scalar=query_pre_attn_scalar,
                                tie_word_embeddings=True,
                                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                 "full_attention": {"rope_type": "default", "rope_theta": 1e6}})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # query_pre_attn_scalar = head_dim, as the released models below 27B (GGUF has no key for it)
    return _tiny(tmp_path_factory.mktemp("gemma3"), 32)


def test_gemma3_logits_equal_hf(tiny):
    arch_check.check_logits(tiny)


def test_gemma3_attention_scale_from_query_pre_attn_scalar(tmp_path):
    arch_check.check_logits(_tiny(tmp_path / "m", 24))


def test_gemma3_greedy_equals_hf_batched_and_alone(tiny):
    arch_check.check_greedy(tiny)


def test_gemma3_chunked_prefill_and_prefix_hits_equal_hf(tiny):
    """A 60-token prompt prefilled in 8-token chunks (several windows), then again from the prefix cache."""
    hf = arch_check.hf_model(tiny)
    with Engine(tiny, device="cpu", dtype="f32", progress=False, max_num_batched_tokens=8, block_size=4) as eng:
        ids = arch_check.prompt(eng.config.vocab_size, 60, seed=21)
        first = eng.generate(ids, max_new_tokens=24, temperature=0, ignore_eos=True)
        again = eng.generate(ids, max_new_tokens=24, temperature=0, ignore_eos=True)
        got = eng.score(ids)
    ref = arch_check.hf_greedy(hf, ids, 24)
    assert first.token_ids == ref and again.token_ids == ref
    assert again.usage["cached_tokens"] > 0
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].double().numpy()
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


def test_gemma3_gguf_greedy_equals_hf(tiny, tmp_path):
    arch_check.check_gguf_greedy(tiny, tmp_path, "gemma3")


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_gemma3_fused_projections_equal_unfused_on_cpu(tiny, dtype):
    arch_check.check_fused_equals_unfused(tiny, dtype)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_gemma3_norms_fused_equal_separate_launches(tiny, device, tmp_path):
    arch_check.check_norm_fusion_knob(tiny, device, tmp_path)


@pytest.mark.cuda
def test_cuda_bf16_close_to_hf_f32(tiny):
    arch_check.check_half(tiny, "cuda")


def test_cpu_bf16_close_to_hf_f32(tiny):
    arch_check.check_half(tiny, "cpu")
