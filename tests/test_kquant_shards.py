"""Tensor parallelism over GGUF files whose row-parallel cuts fall inside blocks (issue 30): Qwen2.5-0.5B's
MLP of 4864 columns is 2432 a rank at TP 2, 9.5 blocks of 256. Such a part is decoded from the blocks that
cover it and re-quantized to Q8_0, or kept dense where Q8_0's 32 columns do not divide it either
(loader/shard.py shard_blocks); the load names each such tensor. References: gguf-py's dequantizer and
quantizer (a port of ggml's), and the same file with every weight dequantized to float32 at one rank."""
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import arch_check  # noqa: E402
import llaisys  # noqa: E402
from llaisys import quant  # noqa: E402
from llaisys.engine import Engine  # noqa: E402
from llaisys.loader import shard  # noqa: E402
from llaisys.loader.shard import Cut, shard_blocks  # noqa: E402

Q = gguf.GGMLQuantizationType
VOCAB = 416
# hidden 256 = one Q4_K block a row of o_proj's input (128 columns a rank at TP 2: half a block), MLP 768 =
# three (384 a rank: 1.5 blocks); both divide by Q8_0's 32, so both parts are re-quantized
SHAPE = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2)


def k_blocks(rng, rows: int, cols: int, q) -> np.ndarray:
    """Random K-quant blocks [rows, row bytes] decoding to weights of about HF's initial std (0.02)."""
    import random_gguf  # bench/ is on sys.path (conftest.py)

    return random_gguf._k_blocks(rng, rows * cols // 256, q, 0.02).reshape(rows, -1)


@pytest.fixture(scope="module")
def kfiles(tmp_path_factory):
    """Two tiny Qwen2 GGUFs, every weight F32 but o_proj and down_proj: ("k") Q4_K and Q6_K blocks, so the
    only weights a split re-makes are the only quantized ones; ("q8") the same weights as gguf-py decodes
    them, quantized to Q8_0 whole by gguf-py -- what a TP 2 rank's re-quantized part holds, since the cuts
    (128 and 384 columns) fall on Q8_0's 32-column blocks."""
    from tiny_model import write_tiny_gguf

    d = tmp_path_factory.mktemp("kquant")
    hf = arch_check.make_tiny(d / "hf", "qwen2", seed=8, **SHAPE)
    rng = np.random.default_rng(8)
    blocks, q8 = {}, {}
    for layer in range(2):
        blocks[f"blk.{layer}.attn_output.weight"] = (Q.Q4_K, k_blocks(rng, 256, 256, Q.Q4_K))
        blocks[f"blk.{layer}.ffn_down.weight"] = (Q.Q6_K, k_blocks(rng, 256, 768, Q.Q6_K))
    for name, (q, data) in blocks.items():
        q8[name] = (Q.Q8_0, gguf.quants.quantize(gguf.quants.dequantize(data, q), Q.Q8_0))
    return {"k": write_tiny_gguf(hf, d / "k.gguf", blocks=blocks), "q8": write_tiny_gguf(hf, d / "q8.gguf", blocks=q8)}


def run(path, tp, dtype="auto", **kw):
    """(greedy tokens of two prompts, seeded samples, teacher-forced logits of one, describe())."""
    prompts = [arch_check.prompt(VOCAB, k, seed=k) for k in (6, 21)]
    with Engine(path, dtype=dtype, tensor_parallel_size=tp, **{"progress": False, "device": "cpu", **kw}) as eng:
        greedy = [r.token_ids for r in eng.generate(prompts, max_new_tokens=16, temperature=0, ignore_eos=True)]
        sampled = [r.token_ids for r in eng.generate(prompts, max_new_tokens=12, temperature=0.8, seed=[1, 2],
                                                     ignore_eos=True)]
        return greedy, sampled, np.asarray(eng.score(prompts[1]), np.float64), eng.describe()


def rel_err(got, ref) -> float:
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def test_dense_parts_compute_the_unsplit_dense_math(kfiles, monkeypatch):
    """Parts kept dense (f32 on the CPU): the split computes what one rank computes with every weight
    dequantized to f32, up to the all-reduce's order of summation (the tolerance of test_tensor_parallel)."""
    g1, s1, l1, _ = run(kfiles["k"], 1, dtype="f32")
    monkeypatch.setattr(shard, "REQUANT_FORMAT", None)
    g2, s2, l2, d2 = run(kfiles["k"], 2)
    assert d2["quantized"] and set(d2["weight_formats"]) == {"f32"}  # every cut part was re-made dense
    assert (g2, s2) == (g1, s1)
    np.testing.assert_allclose(l2, l1, rtol=0, atol=1e-4 * np.abs(l1).max())


def test_requantized_parts_compute_the_q8_0_files_math_and_are_named(kfiles, capfd):
    """The default: the cut parts as Q8_0, bit for bit what gguf-py makes of those weights: two ranks on the
    K-quant file compute exactly what two ranks compute on a file holding the same weights as Q8_0 (there
    the cuts fall on whole Q8_0 blocks: nothing re-made). Against one rank on that file, up to the split's
    own differences; the load names every re-made tensor and each rank's summary counts them."""
    g8, s8, l8, _ = run(kfiles["q8"], 2)
    capfd.readouterr()
    g2, s2, l2, d2 = run(kfiles["k"], 2, progress=True)
    log = capfd.readouterr().err
    assert d2["weight_formats"]["q8_0"]["tensors"] == 4  # rank 0's o_proj and down_proj of both layers
    assert (g2, s2) == (g8, s8)
    np.testing.assert_array_equal(l2, l8)
    g1, s1, l1, _ = run(kfiles["q8"], 1)
    # One rank against two: the quantized matmuls round their input x to 8-bit codes in 32-column blocks, so an
    # input that differs in its last bit between the two (the dense matmuls before them split their columns
    # differently, which on an AVX-512 box changes a few roundings) can move one code by one step: about
    # 1/127 of its block's largest |x|. Measured on such a box: 0.0048 of logits up to 1.16 (0.4%); on AVX2
    # boxes the inputs matched and the logits within 1e-4. Greedy tokens of this model keep a top-2 gap
    # above that; seeded samples at temperature 0.8 are not compared (a near-tie in the draw may flip).
    assert g2 == g1
    np.testing.assert_allclose(l2, l1, rtol=0, atol=2e-2 * np.abs(l1).max())
    for layer in range(2):
        assert (f"model.layers.{layer}.self_attn.o_proj.weight: Q4_K rows cut into 128 columns a rank "
                f"(tensor_parallel_size 2) do not fall on its 256-column blocks: re-quantized to Q8_0") in log
        assert f"model.layers.{layer}.mlp.down_proj.weight: Q6_K rows cut into 384 columns a rank" in log
    assert log.count("4 of them re-made from blocks the split cuts") == 2  # each rank's summary


@pytest.mark.cuda
@pytest.mark.parametrize("requant", ["q8_0", None])
def test_gpus_split_k_quant_files(kfiles, monkeypatch, requant):
    """On 2 GPUs (bf16 compute): the re-made parts, Q8_0 or dense bf16, against one GPU holding the same
    weights (the Q8_0 file, or every weight dense in bf16); bf16's rule of test_tensor_parallel (the all-reduce
    rounds partial sums once more), so logits close rather than equal."""
    if llaisys.cuda_device_count() < 2 or not llaisys.build_info()["nccl"]:
        pytest.skip("needs 2 GPUs and a build with NCCL")
    monkeypatch.setattr(shard, "REQUANT_FORMAT", requant)
    _, _, l1, _ = run(kfiles["q8"] if requant else kfiles["k"], 1, dtype="auto" if requant else "bf16",
                      device="cuda")
    g2, _, l2, d2 = run(kfiles["k"], 2, device="cuda")
    assert d2["dtype"] == "bf16" and ("q8_0" in d2["weight_formats"]) == bool(requant)
    assert {"q4_k", "q6_k"}.isdisjoint(d2["weight_formats"])
    assert rel_err(l2, l1) < 2e-2 and len(g2) == 2


# ---- shard_blocks against gguf-py --------------------------------------------------------------------------

def test_a_part_inside_k_blocks_is_the_q8_0_of_its_columns():
    """gguf-py decodes the file's blocks and quantizes the rank's columns to Q8_0: the part is those bytes."""
    rng = np.random.default_rng(1)
    rows, cols = 40, 768
    data = k_blocks(rng, rows, cols, Q.Q4_K)
    whole = gguf.quants.dequantize(data, Q.Q4_K).reshape(rows, cols)
    for rank in range(2):
        cut = Cut(1, rank * 384, (rank + 1) * 384)
        part = shard_blocks("blk.0.ffn_down.weight", "q4_k", rows, cols, data, cut)
        assert part.remade == "q8_0" and part.dense is None
        fmt, nr, nc, got = part.blocks
        assert (fmt, nr, nc) == ("q8_0", rows, 384)
        want = gguf.quants.quantize(whole[:, cut.start:cut.stop], Q.Q8_0)
        np.testing.assert_array_equal(got, want)


def test_a_part_q8_0_cannot_hold_is_kept_dense_exactly():
    """A Q8_0 file's 96 columns over 2 ranks: 48 a rank, 1.5 of its blocks and not a whole number of Q8_0
    blocks either, so the part is dense: gguf-py's decoding of those columns, exactly (d * q in f32)."""
    rng = np.random.default_rng(2)
    rows, cols = 24, 96
    whole = rng.standard_normal((rows, cols)).astype(np.float32)
    data = gguf.quants.quantize(whole, Q.Q8_0)
    decoded = gguf.quants.dequantize(data, Q.Q8_0).reshape(rows, cols)
    for rank in range(2):
        cut = Cut(1, rank * 48, (rank + 1) * 48)
        part = shard_blocks("blk.1.ffn_down.weight", "q8_0", rows, cols, data, cut)
        assert part.remade == "dense" and part.blocks is None
        np.testing.assert_array_equal(part.dense, decoded[:, cut.start:cut.stop])


def test_cuts_on_whole_blocks_keep_the_files_blocks():
    """Rows, and columns on whole blocks, are the file's own bytes (no re-make): e.g. Qwen2.5-72B's down_proj,
    whose 29568-wide rows llama.cpp stores in a 32-column format (Q8_0 or Q5_0), at TP 4 (231 blocks a rank)."""
    rows, cols = 2, 29568
    data = gguf.quants.quantize(np.random.default_rng(3).standard_normal((rows, cols)).astype(np.float32), Q.Q8_0)
    part = shard_blocks("blk.0.ffn_down.weight", "q8_0", rows, cols, data, Cut(1, 7392, 2 * 7392))
    assert part.remade is None and part.blocks[:3] == ("q8_0", rows, 7392)
    np.testing.assert_array_equal(part.blocks[3], data[:, 231 * 34:462 * 34])
    part = shard_blocks("w", "q8_0", rows, cols, data, Cut(0, 1, 2))  # rows: a view of the file's bytes
    assert part.remade is None and np.shares_memory(part.blocks[3], data)


def test_a_part_never_decodes_the_whole_matrix():
    """Only the rank's columns are decoded, a few rows at a time: the peak of NumPy's allocations while one
    part is made stays well below the whole matrix in float32."""
    import tracemalloc

    rows, cols = 8192, 1280  # 5 blocks a row: 2.5 a rank at TP 2
    data = k_blocks(np.random.default_rng(4), rows, cols, Q.Q4_K)
    tracemalloc.start()
    try:
        shard_blocks("blk.0.ffn_down.weight", "q4_k", rows, cols, data, Cut(1, 640, 1280))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < rows * cols * 4 / 2, peak


def test_a_cut_that_is_not_of_the_tensor_raises_naming_it():
    data = np.zeros((4, quant.row_bytes("q4_k", 512)), np.uint8)
    for cut in (Cut(1, 100, 600), Cut(1, 300, 200)):
        with pytest.raises(ValueError, match=r"blk\.3\.ffn_down\.weight: columns .* not a cut of this tensor"):
            shard_blocks("blk.3.ffn_down.weight", "q4_k", 4, 512, data, cut)
    with pytest.raises(ValueError, match=r"blk\.3\.ffn_down\.weight: .*held in \(4, 100\) bytes"):
        shard_blocks("blk.3.ffn_down.weight", "q4_k", 4, 512, data[:, :100], Cut(1, 128, 256))
