"""The torch.compile peer of bench/steady_decode.py (issue 33, bench/llaisys_bench/static_peer.py): whichever way
it is compiled, its greedy tokens are HF's own eager model's (a reference no one here wrote), and it compiles
the decoder layer once, not once per layer or per step."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from llaisys_bench import peers, shapes, static_peer  # bench/ is on sys.path (conftest.py)

# A small Qwen2 shape (HF config values), two layers: enough to catch a recompile per layer
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
            max_position_embeddings=128)
BATCH, STEPS = 3, 4


def _eager_tokens(device):
    """HF's model with eager attention and its dynamic cache: greedy from the start tokens at position 0."""
    from transformers import DynamicCache

    m = peers._hf_model("tiny-peer", None, torch.float32, device)
    token = _start_tokens(device)
    cache, rows, logits = DynamicCache(config=m.config), [], []
    with torch.no_grad():
        for _ in range(STEPS):
            out = m(token, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
            token = out.logits[:, -1:].argmax(-1)
            rows.append(token)
    return torch.cat(rows, 1), torch.stack(logits, 1)


def _start_tokens(device):
    return torch.tensor([[7], [300], [511]], device=device)


def _peer_tokens(mode, device):
    m = peers._hf_model("tiny-peer", None, torch.float32, device)
    peer = static_peer.StaticPeer(m, BATCH, STEPS + 8, mode, device)
    peer.capture(0)  # compiles (and on CUDA records), then puts every row back at position 0
    peer.token.copy_(_start_tokens(device))
    rows, logits = [], []
    for _ in range(STEPS):
        peer.step()
        rows.append(peer.token.clone())
        logits.append(peer.logits.clone())
    return torch.cat(rows, 1), torch.stack(logits, 1)


def _check_against_eager(mode, device, monkeypatch):
    monkeypatch.setitem(shapes.SHAPES, "tiny-peer", TINY)
    torch._dynamo.reset()
    ref_tokens, ref_logits = _eager_tokens(device)
    tokens, logits = _peer_tokens(mode, device)
    assert torch.equal(tokens, ref_tokens)
    # f32 both ways; Inductor fuses and reorders reductions, so not bit-equal (observed ~1e-6 relative)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-5)


def test_regional_peer_decodes_as_hf_eager_on_cpu(monkeypatch):
    """One compiled decoder layer shared by both layers, each with its own cache layer: the same greedy tokens
    as HF eager over a few steps, with no recompile (one per layer would also hit dynamo's recompile limit)."""
    from torch._dynamo.utils import counters

    counters.clear()
    _check_against_eager("regional", "cpu", monkeypatch)
    assert counters["stats"]["unique_graphs"] == 1


def test_random_hf_model_has_the_rope_of_its_config(monkeypatch):
    """peers._hf_model builds on the meta device and fills parameters with random draws; the buffers HF computes
    in __init__ were left as uninitialised memory (RoPE frequencies of ~1e-24: no rotation at all). They must
    be RoPE's 1 / theta^(2i / head_dim)."""
    import numpy as np

    monkeypatch.setitem(shapes.SHAPES, "tiny-peer", TINY)
    m = peers._hf_model("tiny-peer", None, torch.bfloat16, "cpu")
    d, theta = TINY["head_dim"], TINY["rope_theta"]
    want = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    np.testing.assert_allclose(m.model.rotary_emb.inv_freq.double().numpy(), want, rtol=1e-6)


def test_static_peer_rejects_an_unknown_mode(monkeypatch):
    monkeypatch.setitem(shapes.SHAPES, "tiny-peer", TINY)
    m = peers._hf_model("tiny-peer", None, torch.float32, "cpu")
    with pytest.raises(ValueError, match="mode"):
        static_peer.StaticPeer(m, BATCH, 8, "whole", "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("mode", static_peer.MODES)
def test_peer_decodes_as_hf_eager_on_cuda(mode, monkeypatch):
    """On CUDA the regional peer replays one recorded CUDA graph per step (argmax and feedback inside it), the
    full one uses torch.compile's reduce-overhead graphs: both must still be HF's greedy tokens."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # reference and peer in plain f32
    _check_against_eager(mode, "cuda", monkeypatch)
