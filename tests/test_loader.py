"""The loader against transformers: tiny checkpoints written by transformers (safetensors dirs: tied, untied,
sharded, f32/f16/bf16), tiny GGUF files converted like llama.cpp does, and the real default GGUF; plus the
strict checks (missing/extra/mis-shaped/non-float tensors, wrong architecture) and corrupt files."""
import json
import os
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llaisys import loader  # noqa: E402
from llaisys.loader import Qwen2Config, expected_weight_shapes  # noqa: E402
from tiny_model import make_tiny_qwen2, write_tiny_gguf  # noqa: E402

_ST_NAMES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(ml_dtypes.bfloat16): "BF16",
             np.dtype(np.int32): "I32", np.dtype(np.int64): "I64"}


def write_safetensors(path, tensors: dict, header_len: int | None = None, header: bytes | None = None):
    """The format written by hand (so tests can also write broken files): u64 header length, JSON, data."""
    meta, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        meta[name] = {"dtype": _ST_NAMES[a.dtype], "shape": list(a.shape),
                      "data_offsets": [offset, offset + a.nbytes]}
        blobs.append(a.tobytes())
        offset += a.nbytes
    header = header if header is not None else json.dumps(meta).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header) if header_len is None else header_len))
        f.write(header)
        for b in blobs:
            f.write(b)


def hf_state_dict(path, **kwargs):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    return {k: v.numpy() for k, v in model.state_dict().items()}


VARIANTS = {  # name -> make_tiny_qwen2 kwargs, the dtype the weights are stored in
    "f32": ({}, np.float32),
    "f32-tied": ({"tie": True}, np.float32),
    "f32-sharded": ({"shards": 3}, np.float32),
    "bf16-tied-sharded": ({"dtype": "bfloat16", "tie": True, "shards": 2}, ml_dtypes.bfloat16),
    "f16": ({"dtype": "float16"}, np.float16),
}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {name: make_tiny_qwen2(root / name, seed=i, **kw) for i, (name, (kw, _)) in enumerate(VARIANTS.items())}


@pytest.fixture()
def tiny_copy(tiny_dirs, tmp_path):
    """A private copy of the plain f32 checkpoint, to break."""
    return shutil.copytree(tiny_dirs["f32"], tmp_path / "model")


def read_st(path):
    from llaisys.loader.safetensors import read_safetensors

    return {k: np.array(v) for k, v in read_safetensors(path).items()}


# ---- safetensors directories ---------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_weights_equal_transformers(tiny_dirs, variant):
    kwargs, dtype = VARIANTS[variant]
    m = loader.load(tiny_dirs[variant], progress=False)
    ref = hf_state_dict(tiny_dirs[variant])
    tied = kwargs.get("tie", False)
    assert set(m.weights) == set(ref) - ({"lm_head.weight"} if tied else set())
    assert set(m.weights) == set(expected_weight_shapes(m.config))
    for name, w in m.weights.items():
        assert w.dtype == dtype, name
        assert not w.flags.owndata and not w.flags.writeable, name  # a view of the read-only mmap
        np.testing.assert_array_equal(w.astype(np.float32), ref[name], err_msg=name)
    c = m.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (416, 64, 128, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert (c.max_position_embeddings, c.rms_norm_eps, c.rope_theta) == (512, 1e-6, 10000.0)
    assert c.tie_word_embeddings == tied
    assert c.dtype == {np.float32: "f32", np.float16: "f16", ml_dtypes.bfloat16: "bf16"}[dtype]
    assert c.eos_token_ids == (m.tokenizer.token_to_id("<|im_end|>"),)
    assert m.generation_config["eos_token_id"] == [m.tokenizer.token_to_id("<|im_end|>"),
                                                   m.tokenizer.token_to_id("<|endoftext|>")]
    assert "<|im_start|>" in m.chat_template and m.source == tiny_dirs[variant]


def test_reader_matches_safetensors_package(tiny_dirs):
    """An independent reader of the same files (f32/f16: safetensors' numpy path cannot read bf16)."""
    from safetensors.numpy import load_file

    for variant in ("f32", "f16"):
        file = os.path.join(tiny_dirs[variant], "model.safetensors")
        ours, ref = read_st(file), load_file(file)
        assert ours.keys() == ref.keys()
        for k in ref:
            assert ours[k].dtype == ref[k].dtype and ours[k].shape == ref[k].shape
            np.testing.assert_array_equal(ours[k], ref[k])


def test_tied_checkpoint_with_an_lm_head_copy_ignores_it(tiny_dirs, tmp_path):
    d = shutil.copytree(tiny_dirs["f32-tied"], tmp_path / "m")
    tensors = read_st(d / "model.safetensors")
    tensors["lm_head.weight"] = np.full_like(tensors["model.embed_tokens.weight"], 7.0)
    write_safetensors(d / "model.safetensors", tensors)
    m = loader.load(d, progress=False)
    assert "lm_head.weight" not in m.weights
    np.testing.assert_array_equal(m.weights["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"])


def test_several_files_without_index(tiny_dirs, tmp_path):
    d = shutil.copytree(tiny_dirs["f32"], tmp_path / "m")
    tensors = read_st(d / "model.safetensors")
    os.remove(d / "model.safetensors")
    names = sorted(tensors)
    write_safetensors(d / "a.safetensors", {k: tensors[k] for k in names[:10]})
    write_safetensors(d / "b.safetensors", {k: tensors[k] for k in names[10:]})
    m = loader.load(d, progress=False)
    for k, v in tensors.items():
        np.testing.assert_array_equal(m.weights[k], v)
    # the same tensor in two files is ambiguous
    write_safetensors(d / "c.safetensors", {names[0]: tensors[names[0]]})
    with pytest.raises(ValueError, match=f"tensor '{names[0]}' is also in"):
        loader.load(d, progress=False)


def _rewrite(d, edit):
    tensors = read_st(d / "model.safetensors")
    edit(tensors)
    write_safetensors(d / "model.safetensors", tensors)


def test_missing_tensor_raises(tiny_copy):
    _rewrite(tiny_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError,
                       match=r"model\.safetensors: missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        loader.load(tiny_copy, progress=False)


@pytest.mark.parametrize("name", ["model.layers.0.mlp.extra.weight", "model.layers.2.input_layernorm.weight",
                                  "transformer.wte.weight"])
def test_unexpected_tensor_raises(tiny_copy, name):
    _rewrite(tiny_copy, lambda t: t.__setitem__(name, np.zeros(64, np.float32)))
    with pytest.raises(ValueError, match=rf"model\.safetensors: unexpected tensor '{name}'"):
        loader.load(tiny_copy, progress=False)


def test_misshaped_tensor_raises(tiny_copy):
    key = "model.layers.0.self_attn.k_proj.weight"
    _rewrite(tiny_copy, lambda t: t.__setitem__(key, np.ascontiguousarray(t[key].T)))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \[64, 32\], "
                                         r"expected \[32, 64\]"):
        loader.load(tiny_copy, progress=False)


def test_non_float_tensor_raises(tiny_copy):
    key = "model.norm.weight"
    _rewrite(tiny_copy, lambda t: t.__setitem__(key, t[key].astype(np.int32)))
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.norm\.weight' has dtype int32"):
        loader.load(tiny_copy, progress=False)


def _edit_config(d, **changes):
    with open(d / "config.json") as f:
        cfg = json.load(f)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with open(d / "config.json", "w") as f:
        json.dump(cfg, f)


def test_unknown_architecture_is_rejected_naming_the_known_ones(tiny_copy):
    transformers.GPTJConfig(vocab_size=416, n_embd=64, n_layer=2, n_head=4,
                            architectures=["GPTJForCausalLM"]).save_pretrained(tiny_copy)
    with pytest.raises(ValueError, match=r"config\.json: architecture GPTJForCausalLM is not supported \(llaisys "
                                         r"runs Qwen2ForCausalLM, .*LlamaForCausalLM"):
        loader.load(tiny_copy, progress=False)


def test_llama_checkpoint_under_a_qwen2_weight_list_is_refused(tiny_copy):
    """A Llama config over Qwen2's tensors (q/k/v biases Llama does not have): strict loading names one."""
    transformers.LlamaConfig(vocab_size=416, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, architectures=["LlamaForCausalLM"]).save_pretrained(tiny_copy)
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.\d+\.self_attn\.[qkv]_proj\.bias': not "
                                         r"a weight of a llama model"):
        loader.load(tiny_copy, progress=False)


@pytest.mark.parametrize("changes,match", [
    ({"hidden_size": None}, r"config\.json: config is missing 'hidden_size'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"config\.json: rope_scaling .* not supported"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     "rope_parameters rope_type 'dynamic' is not supported"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"dtype": "int8"}, "dtype 'int8' is not supported"),
    ({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}, "architecture MixtralForCausalLM is not supported"),
])
def test_bad_config_raises(tiny_copy, changes, match):
    _edit_config(tiny_copy, **changes)
    with pytest.raises(ValueError, match=match):
        loader.load(tiny_copy, progress=False)


def test_config_from_older_transformers_format():
    """rope_theta at the top level, torch_dtype, rope_scaling null, head_dim absent (Qwen2.5-0.5B's config)."""
    d = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
         "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
         "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "rope_scaling": None,
         "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151645,
         "use_sliding_window": False, "sliding_window": 32768, "hidden_act": "silu"}
    c = Qwen2Config.from_hf(d, "config.json")
    assert (c.head_dim, c.rope_theta, c.dtype, c.tie_word_embeddings, c.eos_token_ids) == (64, 1e6, "bf16", True,
                                                                                        (151645,))
    assert expected_weight_shapes(c)["model.layers.23.self_attn.k_proj.weight"] == (128, 896)
    assert "lm_head.weight" not in expected_weight_shapes(c)
    with pytest.raises(ValueError, match="ModelConfig: hidden_size must be a positive int"):
        Qwen2Config.from_hf({**d, "hidden_size": 0, "head_dim": 64}, "config.json")


def test_directory_without_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        loader.load(tmp_path, progress=False)


def test_directory_without_weights(tiny_copy):
    os.remove(tiny_copy / "model.safetensors")
    (tiny_copy / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights \(found pytorch_model\.bin"):
        loader.load(tiny_copy, progress=False)


def test_missing_path_and_non_gguf_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        loader.load(tmp_path / "nope", progress=False)
    (tmp_path / "x.bin").write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match=r"x\.bin: not a GGUF file"):
        loader.load(tmp_path / "x.bin", progress=False)


# ---- corrupt safetensors --------------------------------------------------------------------------


def _corrupt(d, how):
    file = d / "model.safetensors"
    raw = bytearray(file.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    if how == "truncated":
        raw = raw[:-1000]
    elif how == "header_length":
        raw[:8] = struct.pack("<Q", len(raw) + 5)
    elif how == "json":
        raw[8:12] = b"{{{{"
    elif how == "tiny":
        raw = raw[:5]
    elif how == "size":  # a shape that disagrees with the data offsets
        header = raw[8:8 + n].decode().replace('"shape":[64]', '"shape":[63]', 1)
        raw[8:8 + n] = header.encode()
    file.write_bytes(bytes(raw))


@pytest.mark.parametrize("how,match", [
    ("truncated", r"ends at byte \d+, beyond the end of the file .*truncated"),
    ("header_length", r"header length \d+ is beyond the file"),
    ("json", "invalid JSON"),
    ("tiny", "not a safetensors file"),
    ("size", r"has 256 bytes of data, but its shape \[63\] and dtype F32 need 252"),
])
def test_corrupt_safetensors_raise_naming_the_file(tiny_copy, how, match):
    _corrupt(tiny_copy, how)
    with pytest.raises(ValueError, match=match) as e:
        loader.load(tiny_copy, progress=False)
    assert str(tiny_copy / "model.safetensors") in str(e.value)


def test_overlapping_tensors_raise(tmp_path):
    a = np.zeros(4, np.float32)
    header = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                         "y": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}).encode()
    write_safetensors(tmp_path / "o.safetensors", {"x": a}, header=header)
    with open(tmp_path / "o.safetensors", "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(ValueError, match="tensors 'x' and 'y' overlap"):
        read_st(tmp_path / "o.safetensors")


def test_sharded_index_problems(tiny_dirs, tmp_path):
    d = shutil.copytree(tiny_dirs["f32-sharded"], tmp_path / "m")
    with open(d / "model.safetensors.index.json") as f:
        index = json.load(f)
    shard = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == shard[0])
    index["weight_map"][name] = shard[1]  # listed in the wrong shard
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"tensor '{name}' is listed in {shard[1]} but is in"):
        loader.load(d, progress=False)
    os.remove(d / shard[2])
    with pytest.raises(FileNotFoundError, match=f"shard {shard[2]} is missing"):
        loader.load(d, progress=False)
    (d / "model.safetensors.index.json").write_text("{")
    with pytest.raises(ValueError, match=r"index\.json: invalid index"):
        loader.load(d, progress=False)


# ---- GGUF: tiny files converted like llama.cpp does ---------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


# max |ours - original f32 weight| allowed by each storage type: its rounding step at |w| <= ~0.2 (the
# tiny model's init; norms ~1) -- this checks the dequantized values are the right ones, not only equal to HF's
QUANT_ERR = {"F32": 0.0, "F16": 1e-3, "BF16": 8e-3, "Q8_0": 2e-3, "Q5_0": 1e-2, "Q4_0": 2e-2}


@pytest.mark.parametrize("variant", ["f32", "f32-tied"])
@pytest.mark.parametrize("qtype", list(QUANT_ERR))
def test_tiny_gguf_equals_transformers_gguf_load(tiny_dirs, tiny_gguf_dir, variant, qtype):
    path = write_tiny_gguf(tiny_dirs[variant], tiny_gguf_dir / f"{variant}-{qtype}.gguf", qtype=qtype)
    m = loader.load(path, progress=False)
    ref = hf_state_dict(os.path.dirname(path), gguf_file=os.path.basename(path))
    src = hf_state_dict(tiny_dirs[variant])
    tied = variant.endswith("tied")
    assert m.config.tie_word_embeddings == tied
    assert set(m.weights) == set(ref) - ({"lm_head.weight"} if tied else set())
    for name, w in m.weights.items():
        assert w.dtype == np.float32 and w.shape == ref[name].shape, name
        np.testing.assert_array_equal(w, ref[name], err_msg=name)
        assert np.abs(w - src[name]).max() <= QUANT_ERR[qtype] * max(1.0, np.abs(src[name]).max()), name
    hf_dir = loader.load(tiny_dirs[variant], progress=False)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_theta", "eos_token_ids"):
        assert getattr(m.config, field) == getattr(hf_dir.config, field), field
    assert m.config.rms_norm_eps == pytest.approx(1e-6, rel=1e-6)  # stored as float32 in GGUF
    assert m.chat_template == hf_dir.chat_template
    assert m.generation_config == {"bos_token_id": 397, "eos_token_id": 399, "pad_token_id": 397}


def test_gguf_wrong_architecture(tiny_dirs, tmp_path):
    path = write_tiny_gguf(tiny_dirs["f32"], tmp_path / "falcon.gguf", arch="falcon")
    with pytest.raises(ValueError, match=r"falcon\.gguf: architecture falcon is not supported \(llaisys runs Qwen2"):
        loader.load(path, progress=False)


def test_gguf_missing_and_unknown_tensors(tiny_dirs, tmp_path):
    path = write_tiny_gguf(tiny_dirs["f32"], tmp_path / "a.gguf", drop=("blk.1.ffn_up.weight",))
    with pytest.raises(ValueError, match=r"a\.gguf: missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        loader.load(path, progress=False)
    path = write_tiny_gguf(tiny_dirs["f32"], tmp_path / "b.gguf", extra={"rope_freqs.weight": np.ones(8, np.float32)})
    with pytest.raises(ValueError, match=r"b\.gguf: unexpected tensor rope_freqs\.weight"):
        loader.load(path, progress=False)
    bad = {"blk.0.attn_k.weight": np.zeros((64, 64), np.float32)}
    path = write_tiny_gguf(tiny_dirs["f32"], tmp_path / "c.gguf", extra=bad)
    with pytest.raises(ValueError, match=r"c\.gguf: tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' "
                                         r"\(blk\.0\.attn_k\.weight\) has shape \[64, 64\], expected \[32, 64\]"):
        loader.load(path, progress=False)


@pytest.mark.parametrize("cut", [0.5, 0.999, 0.01])  # in the data, at its very end, in the metadata
def test_truncated_tiny_gguf_raises(tiny_dirs, tmp_path, cut):
    path = write_tiny_gguf(tiny_dirs["f32"], tmp_path / "t.gguf", qtype="Q8_0")
    raw = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(raw[:int(len(raw) * cut)])
    with pytest.raises(ValueError, match=r"t\.gguf: .*(truncated|corrupt)"):
        loader.load(path, progress=False)


def test_corrupt_gguf_magic(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"GGUF" + b"\xff" * 60)
    with pytest.raises(ValueError, match=r"x\.gguf: corrupt or truncated GGUF"):
        loader.load(tmp_path / "x.gguf", progress=False)


# ---- the real default model (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M) -----------------------------------


@pytest.fixture(scope="module")
def real_gguf(qwen_gguf):
    return qwen_gguf


@pytest.fixture(scope="module")
def real_loaded(real_gguf):
    return loader.load(real_gguf, progress=False)


@pytest.fixture(scope="module")
def hf_real(qwen_hf32):
    """transformers' own GGUF load (it dequantizes the whole model: slow, so once per session, conftest.py)."""
    return qwen_hf32.config, {k: v.numpy() for k, v in qwen_hf32.state_dict().items()}


@pytest.mark.slow
def test_real_gguf_config(real_loaded, hf_real):
    c = real_loaded.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (151936, 896, 4864, 24)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (14, 2, 64)
    assert (c.max_position_embeddings, c.rope_theta, c.dtype) == (32768, 1e6, "f32")
    assert c.rms_norm_eps == pytest.approx(1e-6, rel=1e-6)
    assert c.tie_word_embeddings is False  # this file stores output.weight (Q8_0) separately
    assert (c.bos_token_id, c.eos_token_ids) == (151643, (151645,))
    assert real_loaded.generation_config == {"bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": 151643}
    assert real_loaded.chat_template.startswith("{%- if tools %}")
    hc = hf_real[0]
    for ours, theirs in [("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
                         ("intermediate_size", "intermediate_size"), ("num_hidden_layers", "num_hidden_layers"),
                         ("num_attention_heads", "num_attention_heads"), ("num_key_value_heads", "num_key_value_heads"),
                         ("max_position_embeddings", "max_position_embeddings"), ("rms_norm_eps", "rms_norm_eps"),
                         ("tie_word_embeddings", "tie_word_embeddings")]:
        assert getattr(c, ours) == getattr(hc, theirs), ours
    assert c.rope_theta == hc.rope_parameters["rope_theta"]


@pytest.mark.slow
def test_real_gguf_weights_equal_transformers(real_loaded, hf_real):
    """Every tensor (Q4_K, Q5_0, Q6_K, Q8_0, F32), bit for bit: same dequantization, and no q/k un-permute
    for Qwen2 (transformers applies one only to LLaMA-style architectures)."""
    ref = hf_real[1]
    assert set(real_loaded.weights) == set(ref) == set(expected_weight_shapes(real_loaded.config))
    for name, w in real_loaded.weights.items():
        assert w.dtype == np.float32 and w.shape == ref[name].shape, name
        assert np.array_equal(w, ref[name]), name


@pytest.mark.slow
def test_truncated_real_gguf_raises(real_gguf, tmp_path):
    part = tmp_path / "cut.gguf"
    with open(real_gguf, "rb") as src, open(part, "wb") as dst:
        dst.write(src.read(64 << 20))  # metadata and the first tensors, the rest cut off
    with pytest.raises(ValueError, match=r"cut\.gguf: .*truncated"):
        loader.load(part, progress=False)


def test_load_prints_nothing(tiny_dirs, tmp_path, capfd):
    """load() reads no weight (the consumer's upload shows progress), so it has nothing to report."""
    path = write_tiny_gguf(tiny_dirs["f32"], tmp_path / "p.gguf", qtype="Q8_0")
    capfd.readouterr()
    for source in (tiny_dirs["f32"], path):
        loader.load(source, progress=True)
        assert capfd.readouterr() == ("", "")


# ---- loading without a converted copy of the whole model (issue 16, item 8) ---------------------------


def test_gguf_weights_are_dequantized_one_at_a_time(tiny_dirs, tmp_path, monkeypatch):
    """load() dequantizes one row of each tensor (to fail early on an unknown type), then each pop one
    tensor: a dequantized float32 copy of the whole model never exists."""
    from llaisys.loader import gguf as gguf_loader

    path = write_tiny_gguf(tiny_dirs["f32"], tmp_path / "m.gguf", qtype="Q8_0")
    ref = dict(loader.load(path, progress=False).weights.items())
    made = []
    real = gguf_loader.dequantize
    monkeypatch.setattr(gguf_loader, "dequantize", lambda data, qtype: made.append(real(data, qtype)) or made[-1])
    m = loader.load(path, progress=False)
    shapes = expected_weight_shapes(m.config)
    assert max(a.size for a in made) <= max(s[-1] for s in shapes.values())  # at most one row each
    made.clear()
    names = list(m.weights)
    assert sorted(names) == sorted(shapes) and not made  # listing names dequantizes nothing
    for i, name in enumerate(names):
        w = m.weights.pop(name)
        assert w.shape == shapes[name] and w.dtype == np.float32 and len(made) == i + 1
        np.testing.assert_array_equal(w, ref[name], err_msg=name)
    assert len(m.weights) == 0


def _rss_file_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:")) / 1024


def test_popping_a_weight_releases_the_previous_ones_file_pages(tmp_path):
    """An f32 checkpoint loaded as bf16 is read (converted) tensor by tensor; without releasing the pages
    each read leaves resident, a load would end holding the whole file as well as the converted model."""
    from llaisys.loader import FileSpan, LazyWeights

    n = 16 << 20  # floats per tensor: 64 MB
    path = tmp_path / "two.safetensors"
    write_safetensors(path, {"a": np.arange(n, dtype=np.float32), "b": np.ones(n, np.float32)})
    from llaisys.loader.safetensors import _read

    arrays, spans = _read(os.fspath(path))
    assert isinstance(spans["a"], FileSpan)
    weights = LazyWeights({k: (lambda a=a: a) for k, a in arrays.items()}, spans)
    before = _rss_file_mb()
    a = weights.pop("a")
    assert a.astype(ml_dtypes.bfloat16)[-1] == n - 1  # read it all, as a converting upload does
    assert _rss_file_mb() - before > 48
    b = weights.pop("b")
    assert _rss_file_mb() - before < 16  # a's pages went back; b's were not read yet
    assert b.sum() == n and a[-1] == n - 1  # released pages read back from the file


def test_pop_releases_only_the_previously_popped_weight():
    from llaisys.loader import LazyWeights

    released = []

    class Span:
        def __init__(self, name):
            self.name = name

        def release(self):
            released.append(self.name)

    weights = LazyWeights({n: (lambda n=n: np.full(2, ord(n))) for n in "abc"}, {n: Span(n) for n in "abc"})
    assert list(weights) == ["a", "b", "c"] and weights["b"][0] == ord("b") and not released
    assert weights.pop("b")[0] == ord("b") and not released  # still in use by whoever popped it
    weights.pop("a")
    assert released == ["b"] and list(weights) == ["c"]
    with pytest.raises(KeyError):
        weights.pop("b")
