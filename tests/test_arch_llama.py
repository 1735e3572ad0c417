"""Llama (and Llama with attention/MLP biases) against HF transformers' LlamaForCausalLM, f32 on the CPU:
tiny random checkpoints transformers writes itself; safetensors and a GGUF with llama.cpp's q/k permutation."""
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import arch_check  # noqa: E402


@pytest.fixture(scope="module", params=["plain", "tied", "biases"])
def tiny(request, tmp_path_factory):
    extra = {"plain": {}, "tied": {"tie_word_embeddings": True},
             "biases": {"attention_bias": True, "mlp_bias": True}}[request.param]
    return arch_check.make_tiny(tmp_path_factory.mktemp(f"llama-{request.param}"), "llama", seed=3, **extra)


def test_llama_logits_equal_hf(tiny):
    arch_check.check_logits(tiny)


def test_llama_greedy_equals_hf_batched_and_alone(tiny):
    arch_check.check_greedy(tiny)


def test_llama_gguf_greedy_equals_hf(tiny, tmp_path):
    arch_check.check_gguf_greedy(tiny, tmp_path, "llama")


@pytest.mark.cuda
def test_cuda_bf16_close_to_hf_f32(tiny):
    arch_check.check_half(tiny, "cuda")


def test_cpu_bf16_close_to_hf_f32(tiny):
    arch_check.check_half(tiny, "cpu")
