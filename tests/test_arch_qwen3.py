"""Qwen3 (q/k RMSNorm per head, no q/k/v bias, head_dim not hidden / heads) against HF transformers'
Qwen3ForCausalLM, f32 on the CPU: a tiny random checkpoint transformers writes itself, and a GGUF of it."""
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import arch_check  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return arch_check.make_tiny(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=5, head_dim=20)


def test_qwen3_logits_equal_hf(tiny):
    arch_check.check_logits(tiny)


def test_qwen3_greedy_equals_hf_batched_and_alone(tiny):
    arch_check.check_greedy(tiny)


def test_qwen3_gguf_greedy_equals_hf(tiny, tmp_path):
    arch_check.check_gguf_greedy(tiny, tmp_path, "qwen3")


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_qwen3_fused_projections_equal_unfused_on_cpu(tiny, dtype):
    # the fused q/k/v path norms q and k inside rope_qkv_cache; the unfused one calls rms_norm
    arch_check.check_fused_equals_unfused(tiny, dtype)


@pytest.mark.cuda
def test_cuda_bf16_close_to_hf_f32(tiny):
    arch_check.check_half(tiny, "cuda")


def test_cpu_bf16_close_to_hf_f32(tiny):
    arch_check.check_half(tiny, "cpu")
