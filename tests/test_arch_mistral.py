"""Mistral against HF transformers' MistralForCausalLM, f32 on the CPU: a tiny random checkpoint without a
sliding window (Mistral v0.2+), and one whose window is shorter than the sequences."""
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import arch_check  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return arch_check.make_tiny(tmp_path_factory.mktemp("mistral"), "mistral", seed=9, sliding_window=None)


def test_mistral_logits_equal_hf(tiny):
    arch_check.check_logits(tiny)


def test_mistral_greedy_equals_hf_batched_and_alone(tiny):
    arch_check.check_greedy(tiny)


def test_mistral_gguf_greedy_equals_hf(tiny, tmp_path):
    arch_check.check_gguf_greedy(tiny, tmp_path, "mistral")


@pytest.mark.cuda
def test_cuda_bf16_close_to_hf_f32(tiny):
    arch_check.check_half(tiny, "cuda")


def test_cpu_bf16_close_to_hf_f32(tiny):
    arch_check.check_half(tiny, "cpu")
