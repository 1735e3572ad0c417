"""Stop strings over streamed text, and incremental detokenization on a real byte-level BPE tokenizer."""
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from llaisys.stops import StopStringMatcher
from llaisys.streaming import IncrementalDetokenizer

# ---- stop strings -----------------------------------------------------------------------------------------


def cut_at_first_stop(text, stops):
    """Reference: the text up to where the earliest stop string starts."""
    found = [text.find(s) for s in stops if s in text]
    return text[:min(found)] if found else text


def run(stops, deltas):
    """Feed deltas until a hit (as the engine does), then flush; return (all emitted text, hit, pieces)."""
    m = StopStringMatcher(stops)
    pieces = []
    for d in deltas:
        text, hit = m.feed(d)
        pieces.append(text)
        if hit:
            break
    else:
        pieces.append(m.flush())
    return "".join(pieces), m.hit, pieces


def check(stops, deltas):
    out, hit, pieces = run(stops, deltas)
    full = "".join(deltas)
    assert out == cut_at_first_stop(full, stops), (stops, deltas, pieces)
    assert hit == any(s in full for s in stops)
    return pieces


@pytest.mark.parametrize("stops, deltas", [
    (["<|im_end|>"], list("Hello<|im_end|>ignored")),                   # one stop across 10 deltas
    (["<|im_end|>"], ["Hel", "lo <|", "im", "_e", "nd|", ">tail"]),
    (["<|im_end|>"], ["a <|im_", "start|> b"]),                          # a prefix that diverges
    (["ab", "abc"], ["x a", "b", "c"]),                                   # overlapping prefixes
    (["abc", "ab"], ["xab", "c"]),
    (["abcd", "b"], ["a", "b", "c", "d"]),                                # a longer stop starting earlier wins
    (["abcd", "b"], ["a", "b", "c", "x"]),                                # ... unless it does not complete
    (["STOP", "END", "\n\n"], ["line one\n", "\nline three END"]),         # multiple stops: earliest wins
    (["END", "STOP"], ["xx ST", "OP yy END"]),
    (["😀👍", "停止"], ["你好", "😀", "👍", "!"]),                             # unicode
    (["停止"], ["请", "停", "止吧"]),
    (["é"], ["cafe", "\u0301", " café"]),                                 # é (one code point) vs e + combining
    (["END"], ["END at the start"]),
    (["END"], ["no stop here", " at all"]),
    (["aaa"], ["a", "a", "b", "a", "a", "a"]),                           # self-overlapping stop
    (["aab"], ["a", "a", "a", "a", "b"]),
    ([], ["no", " stops"]),
])
def test_emitted_text_is_the_text_cut_at_the_first_stop(stops, deltas):
    check(stops, deltas)


def test_text_is_emitted_as_soon_as_it_cannot_start_a_stop():
    m = StopStringMatcher(["END"])
    assert m.feed("hello") == ("hello", False)
    assert m.feed(" E") == (" ", False)       # "E" may start "END": held back
    assert m.feed("N") == ("", False)
    assert m.feed("X and") == ("ENX and", False)
    assert m.feed("EN") == ("", False)
    assert m.flush() == "EN" and not m.hit    # generation ended without the stop: release what was held


def test_stop_found_at_flush_and_feed_after_hit():
    m = StopStringMatcher(["abcd", "b"])
    assert m.feed("ab") == ("", False)        # "b" is complete but "abcd" may start earlier
    assert m.flush() == "a" and m.hit         # the text ended: "b" is the first stop that occurs
    m = StopStringMatcher("##")                # a single string is one stop
    assert m.feed("x##y") == ("x", True)
    assert m.feed("more") == ("", True) and m.flush() == ""


def test_random_texts_and_splits_match_the_reference():
    rng = np.random.default_rng(0)
    alphabet = list("ab c") + ["😀", "é", "\n"]
    for _ in range(1500):
        text = "".join(rng.choice(alphabet, rng.integers(0, 30)))
        stops = ["".join(rng.choice(alphabet, rng.integers(1, 4))) for _ in range(rng.integers(1, 4))]
        if rng.random() < 0.5 and len(text) > 3:  # make a hit likely
            i = rng.integers(0, len(text) - 2)
            stops.append(text[i:i + rng.integers(1, 4)])
        cuts = sorted(rng.integers(0, len(text) + 1, rng.integers(0, 8)))
        deltas = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        check(stops, deltas)


@pytest.mark.parametrize("bad", [[""], ["ok", ""], [None], [3]])
def test_empty_or_non_string_stops_are_rejected(bad):
    with pytest.raises(ValueError, match="stop strings must be non-empty strings"):
        StopStringMatcher(bad)


# ---- incremental detokenization -------------------------------------------------------------------------

CORPUS = ["the cat sat on the mat.", "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
          "Hello, world! Streaming text, one token at a time."] * 20

TEXTS = [
    "Hello world",
    "emoji 😀 and family 👨‍👩‍👧‍👦 and flag 🇫🇷",
    "中文字符：你好，世界！日本語のテキスト。한국어",
    "naïve café — “quotes” … ∑ ∫ Ωμέγα e\u0301",
    "code:\n\tif x < 2:\n\t\treturn '🐍'\n",
    "  leading and trailing spaces  ",
    "🚀",
]


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE like Qwen2's, trained on a little ASCII text: most non-ASCII characters are split into
    several byte tokens, which is what the detokenizer has to put back together."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def stream(tok, ids, prompt=None, **kwargs):
    d = IncrementalDetokenizer(tok, **kwargs)
    if prompt is not None:
        d.prefill(prompt)
    pieces = [d.step(t) for t in ids]
    return pieces, d.flush()


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_are_whole_characters_and_add_up_to_decode(bpe, text):
    ids = bpe.encode(text).ids
    pieces, rest = stream(bpe, ids)
    assert "".join(pieces) == bpe.decode(ids) == text and rest == ""
    assert all("\ufffd" not in p for p in pieces)  # never a broken character on screen
    if any(ord(c) > 127 for c in text):  # the test is meaningful: characters really span several tokens
        assert any("\ufffd" in bpe.decode([t]) for t in ids) and "" in pieces


def test_random_unicode_strings(bpe):
    rng = np.random.default_rng(1)
    chars = list("ab \n") + ["é", "ß", "中", "文", "😀", "👍🏽", "\u0301", "€", "𝔘"]
    for _ in range(200):
        text = "".join(rng.choice(chars, rng.integers(1, 25)))
        ids = bpe.encode(text).ids
        pieces, rest = stream(bpe, ids)
        assert "".join(pieces) == text and rest == ""


def test_special_tokens_are_skipped_or_kept(bpe):
    eos = bpe.token_to_id("<|im_end|>")
    ids = bpe.encode("ok 😀").ids + [eos] + bpe.encode(" after").ids
    assert "".join(stream(bpe, ids)[0]) == bpe.decode(ids, skip_special_tokens=True) == "ok 😀 after"
    kept = "".join(stream(bpe, ids, skip_special_tokens=False)[0])
    assert kept == bpe.decode(ids, skip_special_tokens=False) == "ok 😀<|im_end|> after"


def test_generation_ending_inside_a_character_is_flushed_like_decode(bpe):
    ids = bpe.encode("ok 😀").ids[:-1]  # cut inside the emoji (max_new_tokens reached)
    pieces, rest = stream(bpe, ids)
    assert "".join(pieces) == "ok " and rest.startswith("\ufffd")
    assert "".join(pieces) + rest == bpe.decode(ids)


def test_invalid_bytes_inside_the_text_decode_like_decode(bpe):
    emoji = bpe.encode("😀").ids
    ids = emoji[:2] + bpe.encode("ab").ids + emoji  # a truncated character followed by more text
    pieces, rest = stream(bpe, ids)
    assert "".join(pieces) + rest == bpe.decode(ids) and rest == ""


def test_prefill_keeps_output_equal_for_byte_level(bpe):
    prompt, gen = bpe.encode("你好 prompt").ids, bpe.encode(" reply 😀 中").ids
    assert "".join(stream(bpe, gen, prompt=prompt)[0]) == bpe.decode(gen)
    # a prompt ending inside a character: its bytes are not re-emitted with the reply
    emoji = bpe.encode("😀").ids
    pieces, rest = stream(bpe, emoji[2:] + gen, prompt=prompt + emoji[:2])
    assert "".join(pieces) + rest == bpe.decode(emoji[2:] + gen)


def test_prefill_gives_the_first_token_its_context():
    # SentencePiece-style (Metaspace) decoders drop the space of a text's first word; after a prompt they must not.
    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    assert tok.decode([2]) == "world"
    assert stream(tok, [2])[0] == ["world"]
    assert stream(tok, [2, 2], prompt=[1])[0] == [" world", " world"]


def test_prefill_after_step_is_an_error(bpe):
    d = IncrementalDetokenizer(bpe)
    d.step(bpe.encode("a").ids[0])
    with pytest.raises(RuntimeError, match="before step"):
        d.prefill([1, 2])
