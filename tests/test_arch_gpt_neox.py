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


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_gpt_neox_fused_projections_equal_unfused_on_cpu(tiny, dtype):
    arch_check.check_fused_equals_unfused(tiny, dtype)


@pytest.mark.cuda
def test_cuda_bf16_close_to_hf_f32(tiny):
    arch_check.check_half(tiny, "cuda")


def test_cpu_bf16_close_to_hf_f32(tiny):
    arch_check.check_half(tiny, "cpu")


def test_a_neox_config_with_num_key_value_heads_loads():
    """GPT-NeoX's table reads no num_key_value_heads (every head has its own K/V): a config.json that states
    it anyway (some converters write it) gets the query head count, and other families still refuse 0."""
    from llaisys.loader.config import ModelConfig

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                max_position_embeddings=64)
    cfg = ModelConfig.from_hf(dict(base, model_type="gpt_neox", num_key_value_heads=4), "config.json")
    assert cfg.num_key_value_heads == 4
    with pytest.raises(ValueError, match="num_key_value_heads must be a positive int, got 0"):
        ModelConfig.from_hf(dict(base, model_type="qwen2", num_key_value_heads=0), "config.json")
