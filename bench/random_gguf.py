#!/usr/bin/env python3
"""A GGUF file with random weights of a real Qwen2 shape in chosen block formats, for benchmarks of the
quantized path (issue 19) without the real file. Written like llama.cpp's converter writes Qwen2
(general.architecture=qwen2, qwen2.* keys), with the tokenizer.ggml.* metadata and chat template copied
from the real default model's GGUF, so the file loads and tokenizes like a real one.

    python bench/random_gguf.py --shape qwen2-1.5b --types q4_k_m -o /tmp/r.gguf
    write_random_gguf(path, "qwen2-0.5b", "q8_0", seed=0)     # from Python

Presets (--types): q4_k_m = Q4_K for most 2-D weights and Q6_K for ffn_down, output and token_embd (what
llama.cpp's Q4_K_M mostly does for the 1.5B model); q8_0, q4_0, q5_0, q5_k and q6_k put every 2-D weight
in that format. Norms and biases are F32. K-quants need rows that are a multiple of 256; a tensor whose
rows are not (the 0.5B shape's 896-wide rows) falls back like llama.cpp does: Q4_K -> Q5_0, Q6_K -> Q8_0,
and Q5_K -> Q5_0 (llama.cpp picks Q5_1 there; llaisys has no Q5_1 kernel, so its nearest kernel format).
Each fallback is reported.

Values: every block is built directly (gguf-py's quantization is ~30 MB/s, and it has none for K-quants):
random quant bytes, with the f16 scales (and the K-quants' 6-bit sub-block scales) chosen so each block
decodes to about zero mean and std 0.02 (the embedding 0.04); every tensor is checked with
gguf.quants.dequantize (finite, std within 2x of the target) before it is written. Every tensor is its own
draw from one seeded generator.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

# this folder is on sys.path (sys.path[0] when run as a script); llaisys_bench finds llaisys' sources when the
# package is not installed
from llaisys_bench.shapes import SHAPES, gguf_names, weight_shapes
# the loader's reader: ~3x faster than gguf.GGUFReader over a 150k-token vocabulary
from llaisys.loader.gguf import _open

# preset -> (format of most 2-D weights, format of ffn_down / output / token_embd)
PRESETS = {"q4_k_m": (Q.Q4_K, Q.Q6_K), "q8_0": (Q.Q8_0, Q.Q8_0), "q4_0": (Q.Q4_0, Q.Q4_0),
           "q5_0": (Q.Q5_0, Q.Q5_0), "q5_k": (Q.Q5_K, Q.Q5_K), "q6_k": (Q.Q6_K, Q.Q6_K)}
# general.file_type as llama.cpp writes it (LlamaFileType) for each preset
_FILE_TYPES = {"q4_k_m": 15, "q8_0": 7, "q4_0": 2, "q5_0": 8, "q5_k": 17, "q6_k": 18}
# K-quant -> what llama.cpp's quantizer uses when a row is not a multiple of 256 (Q5_K: see the docstring)
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}
_MORE_BITS = ("output.weight", "token_embd.weight")  # and every ffn_down
WEIGHT_STD, EMBEDDING_STD = 0.02, 0.04
_CHUNK = 1 << 22  # elements drawn and quantized at a time, so a 150k x 1536 table never sits in f32

def _config(shape) -> dict:
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; choose from {sorted(SHAPES)} or pass a dict of HF config "
                             f"values")
        return dict(SHAPES[shape])
    if not isinstance(shape, dict):
        raise TypeError(f"shape must be a name ({sorted(SHAPES)}) or a dict of HF config values, got "
                        f"{type(shape).__name__}")
    return dict(shape)


def plan(shape, types: str) -> tuple[dict[str, tuple[tuple[int, ...], Q]], list[str]]:
    """({GGUF name: (HF shape, format)} in file order, fallback notes) for a shape and a preset."""
    if types not in PRESETS:
        raise ValueError(f"unknown --types preset {types!r}; choose from {sorted(PRESETS)}")
    c = _config(shape)
    main, more = PRESETS[types]
    out, fell = {}, {}
    names = gguf_names(c)
    for hf, s in weight_shapes(c).items():
        name = names[hf]
        if len(s) == 1:
            out[name] = (s, Q.F32)
            continue
        want = more if name in _MORE_BITS or name.endswith(".ffn_down.weight") else main
        block = gguf.GGML_QUANT_SIZES[want][0]
        got = want
        if s[-1] % block:
            got = _FALLBACK.get(want)
            if got is None or s[-1] % gguf.GGML_QUANT_SIZES[got][0]:
                raise ValueError(f"{name}: rows of {s[-1]} are not a multiple of {want.name}'s block of {block}")
            fell.setdefault((s[-1], want, got), []).append(name)
        out[name] = (s, got)
    order = ["token_embd.weight"] + [n for n in out if n.startswith("blk.")] + \
            [n for n in ("output_norm.weight", "output.weight") if n in out]
    notes = [f"rows of {cols} are not a multiple of 256: {want.name} -> {got.name} for {len(names)} tensors "
             f"(e.g. {names[0]})" for (cols, want, got), names in fell.items()]
    return {n: out[n] for n in order}, notes


def _row_bytes(cols: int, q: Q) -> int:
    block, size = gguf.GGML_QUANT_SIZES[q]
    return cols // block * size


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """[n, 8] 6-bit sub-block scales and mins -> Q4_K/Q5_K's 12 packed bytes (layout of ggml's
    get_scale_min_k4: low 6 bits of 0-3 / 4-7 hold sc/m 0-3, their top 2 bits and bytes 8-11 hold 4-7)."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _random_bytes(rng, n: int, size: int) -> np.ndarray:
    """[n, size] uniform random bytes, from the generator's raw 64-bit words (several times rng.integers' rate)."""
    return rng.bit_generator.random_raw(-(-n * size // 8)).view(np.uint8)[:n * size].reshape(n, size)


def _k_blocks(rng, n: int, q: Q, std: float) -> np.ndarray:
    """n random K-quant blocks of 256 weights decoding to zero mean and about `std`: random quant bytes;
    per block a scale d (jittered 0.5-1.5x); per 16- or 32-weight sub-block a random scale."""
    size = gguf.GGML_QUANT_SIZES[q][1]
    blocks = _random_bytes(rng, n, size)
    jitter = rng.uniform(0.5, 1.5, n).astype(np.float32)
    if q == Q.Q6_K:  # ql[128] qh[64] scales[16] (int8) d: w = d * scale * (q - 32), q uniform in 0..63
        mag = rng.integers(32, 128, (n, 16))
        scales = np.where(rng.integers(0, 2, (n, 16)) == 1, mag, -mag).astype(np.int8)
        rms = np.sqrt(np.mean(np.arange(32, 128) ** 2.0))
        blocks[:, 192:208] = scales.view(np.uint8)
        blocks[:, 208:210] = _f16(jitter * std / (rms * np.sqrt((64 ** 2 - 1) / 12)))
        return blocks
    levels = 16 if q == Q.Q4_K else 32  # d, dmin, scales[12], (qh[32]), qs[128]: w = d*sc*q - dmin*m
    sc = rng.integers(32, 64, (n, 8), dtype=np.uint8)
    rms = np.sqrt(np.mean(np.arange(32, 64) ** 2.0))
    d = jitter * std / (rms * np.sqrt((levels ** 2 - 1) / 12))
    blocks[:, 0:2] = _f16(d)
    blocks[:, 2:4] = _f16(d * (levels - 1) / 2)  # m = sc and dmin = d * mean(q): each sub-block centred
    blocks[:, 4:16] = _pack_k_scales(sc, sc)
    return blocks


# the legacy formats' quant levels (a 32-weight block: d f16, [qh], qs; w = d * (q - levels / 2))
_LEGACY_LEVELS = {Q.Q8_0: 256, Q.Q4_0: 16, Q.Q5_0: 32}


def _legacy_blocks(rng, n: int, q: Q, std: float) -> np.ndarray:
    """n random Q8_0 / Q4_0 / Q5_0 blocks of 32 weights of about `std`: random quant bytes (uniform levels) and a
    scale d per block (jittered 0.5-1.5x, random sign). Built directly, as the K-quants are: gguf-py's quantization of
    Gaussians ran at ~30 MB/s, 11 minutes for a 72B model's Q8_0 down projections."""
    size = gguf.GGML_QUANT_SIZES[q][1]
    levels = _LEGACY_LEVELS[q]
    blocks = _random_bytes(rng, n, size)
    rms = np.sqrt(np.mean((np.arange(levels) - levels // 2) ** 2.0))
    # a random sign of d: the levels' own mean (-0.5, a tenth of Q4_0's rms) cancels over blocks
    d = rng.uniform(0.5, 1.5, n).astype(np.float32) * np.where(rng.integers(0, 2, n) == 1, 1, -1) * std / rms
    blocks[:, 0:2] = _f16(d)
    return blocks


def _check(name: str, raw: np.ndarray, q: Q, std: float) -> None:
    """The blocks decode (gguf-py) to finite values of about the intended scale, or raise."""
    w = gguf.quants.dequantize(raw[:64], q)  # the first rows: enough weights for a std
    got = float(np.std(w))
    if not np.isfinite(w).all() or not std / 2 < got < std * 2:
        raise RuntimeError(f"{name}: random {q.name} blocks decode to std {got:.4g} (finite: "
                           f"{bool(np.isfinite(w).all())}), expected about {std}")


def _tensor(rng, name: str, shape: tuple[int, ...], q: Q) -> np.ndarray:
    """The bytes (or F32 values) of one tensor, drawn anew."""
    if q == Q.F32:  # norms near 1, biases small; distinct per tensor
        base = 1.0 if name.endswith("norm.weight") else 0.0
        return (base + WEIGHT_STD * rng.standard_normal(shape)).astype(np.float32)
    std = EMBEDDING_STD if name == "token_embd.weight" else WEIGHT_STD
    rows, cols = shape
    out = np.empty((rows, _row_bytes(cols, q)), np.uint8)
    step = max(1, _CHUNK // cols)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        if q in _FALLBACK:  # K-quants
            out[r:r + n] = _k_blocks(rng, n * cols // 256, q, std).reshape(n, -1)
        else:
            out[r:r + n] = _legacy_blocks(rng, n * cols // 32, q, std).reshape(n, -1)
    _check(name, out, q, std)
    return out


@functools.lru_cache(maxsize=2)
def _tokenizer_fields(source: str) -> tuple[tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None], ...]:
    """(key, value, type, array item type) of every tokenizer.* key of `source`, read once per process."""
    fields = _open(source).fields
    return tuple((key, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
                 for key, f in fields.items() if key.startswith("tokenizer."))


def _copy_tokenizer(w: gguf.GGUFWriter, source: str, vocab: int) -> None:
    """Every tokenizer.* key of `source` (a real Qwen2 GGUF), as it is there; a shape with more embedding rows
    than the tokenizer has tokens (Qwen2.5-7B/72B: 152064 rows, 151936 tokens) gets "[PAD{i}]" tokens of type
    UNUSED up to its rows, as llama.cpp's converter pads Qwen2's vocabulary."""
    fields = _tokenizer_fields(os.path.abspath(source))
    tokens = next((value for key, value, _, _ in fields if key == "tokenizer.ggml.tokens"), [])
    if len(tokens) > vocab:
        raise ValueError(f"{source} has {len(tokens)} tokens but the shape's vocab_size is {vocab}: the tokenizer "
                         f"must fit the embedding rows")
    pad = vocab - len(tokens)
    for key, value, vtype, sub_type in fields:
        if pad and key == "tokenizer.ggml.tokens":
            value = list(value) + [f"[PAD{i}]" for i in range(len(tokens), vocab)]
        elif pad and key == "tokenizer.ggml.token_type":
            value = list(value) + [int(gguf.TokenType.UNUSED)] * pad
        elif pad and key == "tokenizer.ggml.scores":
            value = list(value) + [0.0] * pad
        w.add_key_value(key, value, vtype, sub_type=sub_type)


def _default_tokenizer_source() -> str:
    # a machine without the model (a GPU box with no network) points this at a GGUF holding only the tokenizer
    if os.environ.get("LLAISYS_TOKENIZER_GGUF"):
        return os.environ["LLAISYS_TOKENIZER_GGUF"]
    from llaisys import catalog

    return catalog.resolve(catalog.DEFAULT_MODEL)


def write_random_gguf(path, shape, types: str, seed: int = 0, tokenizer_from: str | None = None,
                      verbose: bool = True) -> str:
    """Write the file and return its path. `shape`: a name of llaisys_bench.shapes.SHAPES or a dict of HF config
    values; `types`: a preset (PRESETS); `tokenizer_from`: a GGUF whose tokenizer.* metadata is copied
    (default: the default catalog model, downloaded if missing). Fallbacks are printed unless not verbose."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    c = _config(shape)
    tensors, notes = plan(c, types)
    path = os.fspath(path)
    for note in notes if verbose else ():
        print(f"random_gguf: {note}", file=sys.stderr)
    w = gguf.GGUFWriter(path, arch="qwen2")
    w.add_type("model")
    w.add_name(f"random {shape if isinstance(shape, str) else 'qwen2'} {types}")
    w.add_file_type(_FILE_TYPES[types])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    if c["head_dim"] != c["hidden_size"] // c["num_attention_heads"]:  # the converter writes it only then
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    _copy_tokenizer(w, tokenizer_from or _default_tokenizer_source(), c["vocab_size"])
    # Tensor infos first, then each tensor's bytes as it is made: the model is never whole in memory.
    for name, (s, q) in tensors.items():
        if q == Q.F32:
            w.add_tensor_info(name, s, np.dtype(np.float32), int(np.prod(s)) * 4)
        else:
            w.add_tensor_info(name, (s[0], _row_bytes(s[1], q)), np.dtype(np.uint8), s[0] * _row_bytes(s[1], q),
                              raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, (s, q) in tensors.items():
        w.write_tensor_data(_tensor(rng, name, s, q))
    w.close()
    return path


def cached_random_gguf(shape: str, types: str, seed: int = 0) -> str:
    """write_random_gguf into the temp dir, kept for later runs (a file is renamed into place only once
    complete, so an interrupted write is never reused)."""
    plan(shape, types)  # bad arguments fail before anything is written
    path = os.path.join(tempfile.gettempdir(), f"llaisys-bench-{shape}-{types}-seed{seed}.gguf")
    if not os.path.exists(path):
        partial = f"{path}.{os.getpid()}.partial"
        try:
            write_random_gguf(partial, shape, types, seed)
            os.replace(partial, path)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--types", required=True, choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer-from", metavar="GGUF", help="copy tokenizer metadata from this file "
                    "(default: the default catalog model)")
    ap.add_argument("-o", "--output", help="default: cached in the temp dir (printed)")
    args = ap.parse_args()
    if args.tokenizer_from and not args.output:
        ap.error("--tokenizer-from needs -o (the cached files all use the default model's tokenizer)")
    if args.output:
        path = write_random_gguf(args.output, args.shape, args.types, args.seed, args.tokenizer_from)
    else:
        path = cached_random_gguf(args.shape, args.types, args.seed)
    counts = {}
    for _, q in plan(args.shape, args.types)[0].values():
        counts[q.name] = counts.get(q.name, 0) + 1
    print(f"{path}: {os.path.getsize(path) / 1e6:.0f} MB, " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
