"""Sampling inside the batched CUDA decode graphs (issue 17). A graphed decode step whose rows have no
logit bias samples inside the graph (a repetition penalty from the rows' seen sets included); its tokens
must be exactly those of the path that samples after the replay (penalties and biases, argmax, sample_rows
of the sampled rows), for
the same logits and the same (seed, step) of each request. References: that path on the same step (a
zero logit bias sends a step down it without changing a logit), sample_rows run eagerly on the step's
logits, and end to end an engine without CUDA graphs. All CUDA: the CPU has no graphs."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import llaisys  # noqa: E402
from llaisys import _core, ops  # noqa: E402
from llaisys.engine import Engine  # noqa: E402
from llaisys.engine.seen import seen_words  # noqa: E402
from test_model import _core_model, _nan_checkpoint, _Paged, prompt_ids  # noqa: E402
from test_serving_engine import engine, prompts  # noqa: E402
from tiny_model import make_tiny_qwen2  # noqa: E402

pytestmark = pytest.mark.cuda

# (temperature, top_k, top_p, min_p, seed) per row: greedy rows between sampled ones, each filter alone
# and together, a greedy row with filters set (they must not matter).
ROWS = [(0.9, 0, 1.0, 0.0, 11), (0.0, 0, 1.0, 0.0, 12), (1.3, 5, 1.0, 0.0, 13), (0.7, 0, 0.8, 0.0, 14),
        (1.0, 0, 1.0, 0.1, 15), (0.0, 40, 0.5, 0.2, 16), (2.0, 50, 0.9, 0.05, 17), (0.5, 3, 0.95, 0.0, 18)]
GREEDY = [(0.0, 0, 1.0, 0.0, s) for s in range(8)]
GRAPH_SIZES = [1, 4, 8]


@pytest.fixture(scope="module", params=["small_vocab", "large_vocab"])
def tiny(request, tmp_path_factory):
    # large_vocab: rows of 80 KiB (f32), so argmax takes its split two-kernel path inside the graph
    vocab = {"small_vocab": None, "large_vocab": 20000}[request.param]
    return make_tiny_qwen2(tmp_path_factory.mktemp(request.param), seed=5, vocab_size=vocab)


class _Runner(_Paged):
    """_Paged with 8 sequences, graphs of 1, 4 and 8 rows (or none), and steps with each row's sampling."""

    def __init__(self, model, config, cuda_graphs=True):
        super().__init__(model, config, num_seqs=8, max_seq_len=64)
        self.runner = _core.Runner(model, self.pool, GRAPH_SIZES, self.per_seq, cuda_graphs)
        self.vocab = config["vocab_size"]

    def step(self, tokens, rows, step, penalty=1.0, zero_bias=False):
        """One step of sequences 0..B-1 (B = len(tokens)); request i is at generation step step + i. With
        penalty != 1 every row penalises the ids it is fed (its seen set written before the step: the one
        the step before grew is replaced); zero_bias adds 0.0 to one logit of row 0."""
        B, seqs = len(tokens), list(range(len(tokens)))
        t, k, p, mp, seed = (np.array(c) for c in zip(*rows[:B]))
        seen = np.full(B, -1, np.int32)
        if penalty != 1.0:
            for i, x in enumerate(tokens):
                self.runner.set_seen(i, seen_words(x, self.vocab))
            seen = np.arange(B, dtype=np.int32)
        bias_ids, bias = ([[0]] + [[]] * (B - 1), [[0.0]] + [[]] * (B - 1)) if zero_bias else ([], [])
        arrays = self._arrays(seqs, tokens)
        try:
            return list(self.runner.step(
                *arrays, t.astype(np.float32), k.astype(np.int32), p.astype(np.float32), mp.astype(np.float32),
                np.full(B, penalty, np.float32), seed.astype(np.uint64), self.steps(B, step), seen, bias_ids, bias))
        finally:
            self._advance(seqs, tokens)

    @staticmethod
    def steps(B, step):
        return np.arange(step, step + B, dtype=np.uint64)

    def rewind(self, B):
        for s in range(B):
            self.truncate(s, self.lengths[s] - 1)


def _runner(path, dtype, cuda_graphs=True):
    eng = Engine(path, device="cpu", dtype="f32", progress=False)  # for the config and the loader
    m = _Runner(_core_model(eng, path, "cuda", dtype, None), eng.config.core, cuda_graphs)
    vocab = eng.config.vocab_size
    eng.close()
    return m, vocab


def _eager_sample_rows(logits, rows, steps):
    """sample_rows run on its own over a step's logits [B, V] (the graph's, read before the next step)."""
    B = logits.shape[0]
    t, k, p, mp, seed = (np.array(c) for c in zip(*rows[:B]))
    vals = [(t, np.float32), (k, np.int32), (p, np.float32), (mp, np.float32), (seed, np.int64), (steps, np.int64)]
    args = [llaisys.tensor(v.astype(d), "cuda") for v, d in vals]
    out = llaisys.tensor(np.full(B, -7, np.int64), "cuda")
    ops.sample_rows(out, logits, *args)
    return out.to("cpu").numpy().tolist()


def _prefill(m, vocab, B):
    prompts_ = [prompt_ids(vocab, 3 + 2 * i, seed=i) for i in range(B)]
    for s in range(B):
        m.truncate(s, 0)
    return [[t] for t in m.step(prompts_, GREEDY, 0)]


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("B", [1, 3, 4, 5, 8])  # 3 and 5 are padded to the graphs of 4 and 8
def test_graph_sampling_equals_sampling_after_the_replay(tiny, dtype, B):
    """Each decode step runs twice on the same graph with the same inputs: sampling inside it, then (rewound)
    with a zero logit bias, which samples after the replay as before. Same tokens, same logits, and the same
    tokens as sample_rows run on those logits; steps alternate mixed, all-greedy (the graph's sampler off)
    and penalised ones (mixed and all greedy: the penalty's parts on, the sampler on or off) so switching
    each part on and off is covered."""
    m, vocab = _runner(tiny, dtype)
    feeds = _prefill(m, vocab, B)
    plan = [(ROWS, 1.0), (GREEDY, 1.0), (ROWS, 1.0), (ROWS, 1.3), (GREEDY, 0.8), (ROWS[::-1], 1.0), (GREEDY, 1.0)]
    for step, (rows, penalty) in enumerate(plan, 1):
        before = m.runner.steps_sampled_in_graph
        got = m.step(feeds, rows, step, penalty=penalty)
        assert m.runner.steps_sampled_in_graph == before + 1
        assert _eager_sample_rows(m.runner.last_logits(), rows, m.steps(B, step)) == got
        logits = torch.from_dlpack(m.runner.last_logits()).clone()
        m.rewind(B)
        assert m.step(feeds, rows, step, penalty=penalty, zero_bias=True) == got
        assert m.runner.steps_sampled_in_graph == before + 1
        assert torch.equal(torch.from_dlpack(m.runner.last_logits()), logits)
        assert all(0 <= t < vocab for t in got)
        feeds = [[t] for t in got]
    padded = {1: 1, 3: 4, 4: 4, 5: 8, 8: 8}[B]
    assert m.runner.captured_batch_sizes == [padded]


@pytest.mark.parametrize("B", [3, 8])
def test_penalised_steps_equal_a_runner_without_graphs(tiny, B):
    """Steps with a repetition penalty sample inside the graph (the penalty from the rows' seen sets, the
    tokens added to them): the same tokens as a runner that never captures, step after step."""
    (g, vocab), (e, _) = _runner(tiny, "f32"), _runner(tiny, "f32", cuda_graphs=False)
    feeds = _prefill(g, vocab, B)
    assert _prefill(e, vocab, B) == feeds
    for step, penalty in enumerate([1.3, 1.0, 0.8, 1.3], 1):
        got = g.step(feeds, ROWS, step, penalty=penalty)
        assert e.step(feeds, ROWS, step, penalty=penalty) == got
        feeds = [[t] for t in got]
    assert g.runner.steps_sampled_in_graph == 4 and e.runner.steps_sampled_in_graph == 0
    assert e.runner.captured_batch_sizes == []


@pytest.mark.parametrize("bad_row", ["greedy_all_greedy", "greedy_beside_sampled", "sampled"])
def test_non_finite_logits_raise_from_a_graph_that_samples(tmp_path, bad_row):
    """A row whose logits are NaN gets no token: the step raises naming its step and row when the graph
    samples (from its argmax with the sampler off, or from its sampler, greedy or not), with a padded row
    (3 of 4) beside it; the sequences go on once the NaN keys/values are overwritten."""
    bad = 9
    path = _nan_checkpoint(tmp_path, "model.embed_tokens.weight", rows=bad)
    m, vocab = _runner(path, "f32")
    first = {"greedy_all_greedy": 0.0, "greedy_beside_sampled": 0.7, "sampled": 0.7}[bad_row]
    t_bad = 0.8 if bad_row == "sampled" else 0.0
    rows = [(first, 0, 1.0, 0.0, 1), (t_bad, 20, 0.9, 0.0, 2), (0.0, 0, 1.0, 0.0, 3)]
    ok = [t for t in prompt_ids(vocab, 16, 5) if t != bad][:3]
    for s in range(3):
        m.truncate(s, 0)
    m.step([[t] for t in ok], rows, 0)  # one-token prompts: a decode-shaped step, it captures the graph of 4
    m.step([[t] for t in ok[::-1]], rows, 1)
    before = m.runner.steps_sampled_in_graph
    with pytest.raises(RuntimeError, match=r"non-finite logits \(NaN or Inf\) at generation step 3 of the request "
                                           r"in row 1 of the step"):
        m.step([[ok[0]], [bad], [ok[1]]], rows, 2)
    assert m.runner.steps_sampled_in_graph == before + 1  # the failing step sampled inside the graph
    m.rewind(3)
    got = m.step([[ok[0]], [ok[2]], [ok[1]]], rows, 2)  # the NaN keys/values are overwritten
    assert all(0 <= t < vocab for t in got)


@pytest.mark.parametrize("case", ["greedy", "sampled", "penalty"])
def test_engine_with_graphs_equals_engine_without(tiny, case):
    """End to end: five requests of different lengths (decode batches of 5, 4, 3, ... padded to the graphs of
    8, 4, 4, 2, 1) give the same tokens with CUDA graphs as without."""
    kw = {"greedy": dict(temperature=0),
          "sampled": dict(temperature=[0.9, 0, 1.2, 0.6, 0], top_k=[0, 0, 30, 0, 5], top_p=[1.0, 1.0, 0.9, 0.8, 1.0],
                          min_p=[0.0, 0.0, 0.0, 0.05, 0.1], seed=[7, 8, 9, 10, 11]),
          "penalty": dict(temperature=[0.9, 0, 1.2, 0.6, 0], repetition_penalty=[1.2, 1.0, 1.5, 0.8, 1.2],
                          seed=[7, 8, 9, 10, 11])}[case]
    outs = [6, 12, 3, 9, 15]
    results = []
    for graphs in (True, False):
        eng = engine(tiny, "cuda", cuda_graphs=graphs, graph_batch_sizes=(1, 2, 4, 8), max_num_seqs=8,
                     max_seq_len=256)
        ps = prompts(eng.config.vocab_size, [3, 9, 17, 30, 5], seed=2)
        results.append([r.token_ids for r in eng.generate(ps, max_new_tokens=outs, ignore_eos=True, **kw)])
        runner = eng._core.runner.runner
        if graphs:
            assert {4, 8} <= set(runner.captured_batch_sizes)
            sampled_in_graph = runner.steps_sampled_in_graph
        eng.close()
    assert results[0] == results[1]
    assert [len(r) for r in results[0]] == outs
    assert sampled_in_graph > 0  # a repetition penalty too: its seen sets are applied and grown in the graph


def test_penalised_rows_past_the_first_seen_rows_grow_them(tiny):
    """More penalised sequences than the runner's first 64 seen rows: the sets grow (kept, and the graphs,
    which hold their address, captured again) and the tokens stay those of the engine without graphs; the
    steps are chained and sampled in the graph."""
    results = []
    for graphs in (True, False):
        eng = engine(tiny, "cuda", cuda_graphs=graphs, graph_batch_sizes=(1, 2, 4, 8, 16, 32, 64, 128),
                     max_num_seqs=128, max_seq_len=256)
        ps = prompts(eng.config.vocab_size, [3 + i % 29 for i in range(100)], seed=4)
        rs = eng.generate(ps, max_new_tokens=[8 + i % 13 for i in range(100)], temperature=[0, 0.8] * 50,
                          seed=list(range(100)), repetition_penalty=[1.3, 1.0, 1.1, 0.9] * 25, ignore_eos=True)
        results.append([r.token_ids for r in rs])
        if graphs:
            assert eng._core.runner.seen.count > 64
            assert eng._core.runner.runner.steps_sampled_in_graph > 0 and eng.stats()["overlapped_steps"] > 0
        eng.close()
    assert results[0] == results[1]

