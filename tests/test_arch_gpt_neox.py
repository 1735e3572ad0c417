"""GPT-NeoX (Pythia) against HF transformers' GPTNeoXForCausalLM, f32 on the CPU: LayerNorm with biases,
parallel and serial residual, GELU MLP with biases, partial rotary (0.25), the per-head interleaved fused
q/k/v; tiny random checkpoints transformers writes itself, and a GGUF of one."""
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import arch_check  # noqa: E402


@pytest.fixture(scope="module", params=["parallel", "serial"])
def tiny(request, tmp_path_factory):
    extra = {"parallel": {}, "serial": {"use_parallel_residual": False}}[request.param]
    return arch_check.make_tiny(tmp_path_factory.mktemp(f"neox-{request.param}"), "gpt_neox", seed=11,
                                hidden_size=96, **extra)  # head_dim 16: a rotary dim of 4


def test_gpt_neox_logits_equal_hf(tiny):
    arch_check.check_logits(tiny)


def test_gpt_neox_greedy_equals_hf_batched_and_alone(tiny):
    arch_check.check_greedy(tiny)


def test_gpt_neox_gguf_greedy_equals_hf(tiny, tmp_path):
    arch_check.check_gguf_greedy(tiny, tmp_path, "gpt_neox")


@pytest.mark.cuda
def test_cuda_bf16_close_to_hf_f32(tiny):
    arch_check.check_half(tiny, "cuda")


def test_cpu_bf16_close_to_hf_f32(tiny):
    arch_check.check_half(tiny, "cpu")
