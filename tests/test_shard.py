"""Tensor-parallel shards of every family's weight table (loader/shard.py, issue 30): cut then merged
equals the original for dense tensors and GGUF blocks (checked with gguf-py's own dequantizer), the cuts
of q/k/v/o and gate/up/down line up so that the ranks' partial outputs of a layer, summed as the
all-reduce sums them, equal the whole layer in NumPy float64, and settings that cannot split raise."""
import numpy as np
import pytest

from llaisys import _core
from llaisys.loader.config import ModelConfig
from llaisys.loader.shard import Cut, check_tensor_parallel, cut_blocks, cut_dense, rank_cut, vocab_range

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {
    "qwen2": {}, "qwen3": dict(head_dim=16), "llama": dict(attention_bias=True, mlp_bias=True), "mistral": {},
    "gpt_neox": dict(rotary_pct=0.25, num_key_value_heads=None), "gemma3_text": dict(head_dim=16),
}


def config(family, **over):
    d = {"model_type": family, **BASE, **FAMILIES[family], **over}
    return ModelConfig.from_hf({k: v for k, v in d.items() if v is not None}, family)


def table(cfg):
    return _core.weight_table(cfg.core)


def merge(parts, cut0: Cut, shape):
    """The ranks' parts put back: concatenated along the split, or (replicated KV heads) each distinct one once."""
    if cut0.dim < 0:
        return parts[0]
    seen, out = set(), []
    for c, p in parts:
        if (c.start, c.stop) not in seen:
            seen.add((c.start, c.stop))
            out.append((c.start, p))
    return np.concatenate([p for _, p in sorted(out, key=lambda x: x[0])], axis=cut0.dim)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cut_then_merge_is_the_original(family, world):
    cfg = config(family)
    rng = np.random.default_rng(0)
    split_roles = set()
    for entry in table(cfg):
        name, _, shape, _, split, role, _ = entry
        w = rng.standard_normal(shape)
        cuts = [rank_cut(entry, cfg, world, r) for r in range(world)]
        parts = [(c, cut_dense(w, c)) for c in cuts]
        if split < 0 or role == "embed":  # the embedding is replicated, whatever the table's split dim
            assert all(c.dim == -1 and p is w for c, p in parts), name
            continue
        split_roles.add(role)
        np.testing.assert_array_equal(merge(parts, cuts[0], shape), w, err_msg=name)
        if role not in ("k", "v", "k_bias", "v_bias") or cfg.num_key_value_heads >= world:
            assert sum(c.stop - c.start for c in cuts) == shape[split], name  # disjoint, covering
    assert {"o", "down"} <= split_roles
    assert ("lm_head" in split_roles) == (not cfg.tie_word_embeddings)


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_ranges_cover_the_vocabulary_evenly(world):
    ranges = [vocab_range(128, world, r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == 128
    assert all(a[1] == b[0] and a[1] - a[0] == 128 // world for a, b in zip(ranges, ranges[1:]))
    with pytest.raises(ValueError, match="vocab_size 129 is not a multiple"):
        vocab_range(129, world, 0)


def _layer(cfg, world):
    """Weights of layer 0 by role, random, float64."""
    rng = np.random.default_rng(1)
    return {e[5]: (e, rng.standard_normal(e[2]) / np.sqrt(e[2][-1])) for e in table(cfg) if e[6] == 0}


def _attention(x, wq, wk, wv, wo, heads, kv_heads, bq=0, bk=0, bv=0):
    """Causal GQA attention of x [T, H] (no RoPE: the cut is what is checked), float64 -> [T, H_out]."""
    t = x.shape[0]
    q = (x @ wq.T + bq).reshape(t, heads, -1)
    k = (x @ wk.T + bk).reshape(t, kv_heads, -1)
    v = (x @ wv.T + bv).reshape(t, kv_heads, -1)
    group = heads // kv_heads
    out = np.empty_like(q)
    mask = np.triu(np.full((t, t), -np.inf), 1)
    for h in range(heads):
        s = q[:, h] @ k[:, h // group].T / np.sqrt(q.shape[-1]) + mask
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, h] = (p / p.sum(-1, keepdims=True)) @ v[:, h // group]
    return out.reshape(t, -1) @ wo.T


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("world", [2, 4])
def test_rank_partials_sum_to_the_whole_layer(world, kv_heads):
    """Column-parallel q/k/v + row-parallel o, and gate/up + down: each rank computes with its shards and
    local head counts, the partial outputs summed (the all-reduce) equal the unsplit layer."""
    cfg = config("llama", num_key_value_heads=kv_heads)
    lay = _layer(cfg, world)
    x = np.random.default_rng(2).standard_normal((5, cfg.hidden_size))
    full = _attention(x, *(lay[r][1] for r in ("q", "k", "v", "o")), cfg.num_attention_heads, kv_heads,
                      *(lay[r][1] for r in ("q_bias", "k_bias", "v_bias")))
    g, u, d = (lay[r][1] for r in ("gate", "up", "down"))
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    mlp = (silu(x @ g.T + lay["gate_bias"][1]) * (x @ u.T + lay["up_bias"][1])) @ d.T
    local = _core.tensor_parallel_config(cfg.core, world)
    attn_sum, mlp_sum = 0, 0
    for r in range(world):
        part = {role: cut_dense(w, rank_cut(e, cfg, world, r)) for role, (e, w) in lay.items()}
        attn_sum = attn_sum + _attention(x, *(part[k] for k in ("q", "k", "v", "o")), local["num_attention_heads"],
                                         local["num_key_value_heads"], *(part[k] for k in ("q_bias", "k_bias", "v_bias")))
        mlp_sum = mlp_sum + (silu(x @ part["gate"].T + part["gate_bias"]) * (x @ part["up"].T + part["up_bias"])) @ part["down"].T
    np.testing.assert_allclose(attn_sum, full, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(mlp_sum, mlp, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("world", [2, 4])
def test_neox_fused_qkv_splits_by_whole_heads(world):
    """GPT-NeoX's query_key_value rows are per head [q; k; v]: a rank's rows are its heads' triples."""
    cfg = config("gpt_neox")
    lay = _layer(cfg, world)
    (entry, w), (_, b) = lay["qkv_heads"], lay["qkv_heads_bias"]
    heads, d = cfg.num_attention_heads, cfg.head_dim
    x = np.random.default_rng(3).standard_normal((4, cfg.hidden_size))
    full = (x @ w.T + b).reshape(4, heads, 3, d)
    for r in range(world):
        c = rank_cut(entry, cfg, world, r)
        mine = (x @ cut_dense(w, c).T + cut_dense(b, rank_cut(lay["qkv_heads_bias"][0], cfg, world, r)))
        h0 = r * heads // world
        np.testing.assert_allclose(mine.reshape(4, heads // world, 3, d), full[:, h0:h0 + heads // world], rtol=1e-12)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_k"])
def test_gguf_blocks_cut_along_rows_and_whole_blocks(fmt):
    """Dequantized by gguf-py: a cut of the blocks is the same cut of the dequantized matrix."""
    gguf = pytest.importorskip("gguf")
    from llaisys import quant

    info = quant.format_info(fmt)
    rows, cols = 8, 4 * info["block_elems"]
    rng = np.random.default_rng(4)
    data = rng.integers(0, 256, (rows, quant.row_bytes(fmt, cols)), dtype=np.uint8)
    if fmt == "q4_k":  # keep the f16 scales finite: bytes 0-3 of each block are two float16 scales
        view = data.reshape(rows, -1, info["block_bytes"])
        view[:, :, 0:4] = np.frombuffer(np.float16([0.01, 0.002]).tobytes(), np.uint8)
    else:
        view = data.reshape(rows, -1, info["block_bytes"])
        view[:, :, 0:2] = np.frombuffer(np.float16([0.01]).tobytes(), np.uint8)
    qtype = gguf.GGMLQuantizationType[fmt.upper()]
    dense = gguf.dequantize(data, qtype).reshape(rows, cols)
    for dim, n in ((0, rows), (1, cols)):
        for world in (2, 4):
            per = n // world
            for r in range(world):
                c = Cut(dim, r * per, (r + 1) * per)
                f, nr, nc, part = cut_blocks("w", fmt, rows, cols, data, c)
                assert (f, nr, nc) == (fmt, rows if dim else per, per if dim else cols)
                np.testing.assert_array_equal(gguf.dequantize(part, qtype).reshape(nr, nc), cut_dense(dense, c))
    with pytest.raises(ValueError, match="whole blocks"):
        cut_blocks("blk.0.ffn_down.weight", fmt, rows, cols, data, Cut(1, 0, info["block_elems"] // 2))


def test_settings_that_cannot_split_raise_before_loading():
    cfg = config("llama", num_attention_heads=6, num_key_value_heads=3, intermediate_size=90, hidden_size=96,
                 vocab_size=129)
    with pytest.raises(ValueError, match=r"num_attention_heads 6 is not a multiple of tensor_parallel_size 4.*"
                                         r"num_key_value_heads 3.*intermediate_size 90.*vocab_size 129"):
        check_tensor_parallel(cfg, 4)
    for world in (4, 2):  # the core's own check, where a rank's model is made
        with pytest.raises(ValueError, match="cannot be split over"):
            _core.tensor_parallel_config(cfg.core, world)
    check_tensor_parallel(cfg, 3)
    check_tensor_parallel(cfg, 1)
    for bad in (0, -2, True, 2.0, "2"):
        with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
            check_tensor_parallel(cfg, bad)
    with pytest.raises(ValueError, match="rank 4 is not in"):
        rank_cut(table(cfg)[0], cfg, 4, 4)
