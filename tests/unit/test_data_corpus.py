"""Embedded corpus, SentencePiece training and the pure-Python GPT-2 BPE tokenizer.

No Megatron here: these are the pure parts of the data pipeline. SentencePiece models are
trained at vocabulary 512 on the first few hundred corpus documents (well under a second).
"""

import itertools
import json
import pickle
import random
import re

import pytest

from megatron_ext.data.corpus import (
    MIN_DOCSTRING_CHARS,
    embedded_corpus_documents,
    embedded_corpus_fingerprint,
    stdlib_source_files,
)
from megatron_ext.data.tokenizers import (
    GPT2_EOD_TOKEN,
    GPT2_PRETOKENIZE_PATTERN,
    NO_PAD_ID,
    GPT2BPETokenizer,
    SentencePieceTokenizer,
    bytes_to_unicode,
    tokenize_documents,
    train_sentencepiece,
)

_NUM_DOCS = 300
_ODD_TEXTS = [
    "",
    " leading space",
    "  two leading spaces and trailing  ",
    "tabs\tand\nnewlines\n\n",
    "    def f(x):\n        return x ** 2  # indented code\n",
    "unicode: caf\u00e9 \u00bd \u00b2 \u65e5\u672c\u8a9e \U0001f600",
    "digits 1234567890 and under_scores",
]


def _docs(n=_NUM_DOCS):
    return list(itertools.islice(embedded_corpus_documents(), n))


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("sp") / "m"
    return train_sentencepiece(_docs(), str(path), vocab_size=512)


# ------------------------------------------------------------------------------------------
# Corpus
# ------------------------------------------------------------------------------------------


def test_corpus_is_deterministic_and_non_empty():
    first, second = _docs(), _docs()
    assert first == second
    assert len(first) == _NUM_DOCS
    assert all(isinstance(d, str) and d == d.strip() and d for d in first)
    # After the help topics come docstrings, none shorter than the threshold.
    assert min(len(d) for d in first[100:]) >= MIN_DOCSTRING_CHARS


def test_corpus_skips_tests_and_third_party_code():
    files = stdlib_source_files()
    assert len(files) > 100
    assert list(files) == sorted(files)
    skipped = {"test", "tests", "idlelib", "lib2to3", "site-packages"}
    assert not any(skipped & set(re.split(r"[\\/]", f)) for f in files)


def test_fingerprint_is_stable():
    fp = embedded_corpus_fingerprint()
    assert re.fullmatch(r"[0-9a-f]{16}", fp)
    assert embedded_corpus_fingerprint() == fp
    # The uncached computation agrees with the cached value.
    assert embedded_corpus_fingerprint.__wrapped__() == fp


# ------------------------------------------------------------------------------------------
# SentencePiece
# ------------------------------------------------------------------------------------------


def test_sentencepiece_round_trip(sp_model):
    tok = SentencePieceTokenizer(sp_model)
    assert tok.vocab_size == 512
    assert (tok.eod, tok.pad, tok.bos) == (2, 3, 1)
    for text in _docs(40) + _ODD_TEXTS:
        ids = tok.tokenize(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.eod not in ids
        assert tok.detokenize(ids) == text
    # Common words are merged: fewer tokens than characters.
    text = "the function returns the value of the argument"
    assert len(tok.tokenize(text)) < len(text) / 2


def test_sentencepiece_training_is_deterministic(sp_model, tmp_path):
    again = train_sentencepiece(_docs(), str(tmp_path / "again"), vocab_size=512)
    with open(sp_model, "rb") as a, open(again, "rb") as b:
        assert a.read() == b.read()
    assert (
        SentencePieceTokenizer(sp_model).unique_identifiers
        == SentencePieceTokenizer(again).unique_identifiers
    )
    other = train_sentencepiece(_docs(), str(tmp_path / "other"), vocab_size=600)
    assert SentencePieceTokenizer(other).identity() != SentencePieceTokenizer(again).identity()


def test_sentencepiece_batch_pickle_and_threads(sp_model):
    tok = SentencePieceTokenizer(sp_model)
    docs = _docs(50)
    expected = [tok.tokenize(d) for d in docs]
    assert tok.tokenize_batch(docs, num_threads=2) == expected
    assert list(tokenize_documents(tok, docs, num_workers=2, chunk_size=7)) == expected
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.tokenize(docs[0]) == expected[0]
    assert clone.unique_identifiers == tok.unique_identifiers


def test_sentencepiece_errors(tmp_path):
    with pytest.raises(ValueError, match="no text"):
        train_sentencepiece(["", "\n\n"], str(tmp_path / "empty"), vocab_size=512)
    with pytest.raises(ValueError, match="vocab_size=100000"):
        train_sentencepiece(_docs(5), str(tmp_path / "big"), vocab_size=100000)
    not_a_model = tmp_path / "x.model"
    not_a_model.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a SentencePiece model"):
        SentencePieceTokenizer(str(not_a_model))


# ------------------------------------------------------------------------------------------
# GPT-2 byte-level BPE
# ------------------------------------------------------------------------------------------

# Merges in rank order; "\u0120" is the byte-mapped space. With these, "hello" and " world"
# each merge into one token, while "world" without its space stops at ["w", "or", "ld"].
_MERGES = ["h e", "l l", "he ll", "hell o", "\u0120 w", "o r", "\u0120w or", "l d", "\u0120wor ld"]
_BASE = ["h", "e", "l", "o", "w", "r", "d", "\u0120", "!"]


@pytest.fixture
def tiny_gpt2(tmp_path):
    tokens = _BASE + ["".join(m.split(" ")) for m in _MERGES] + [GPT2_EOD_TOKEN]
    encoder = {t: i for i, t in enumerate(tokens)}
    vocab = tmp_path / "encoder.json"
    vocab.write_text(json.dumps(encoder), encoding="utf-8")
    merges = tmp_path / "merges.txt"
    merges.write_text("#version: 0.2\n" + "\n".join(_MERGES) + "\n", encoding="utf-8")
    return GPT2BPETokenizer(str(vocab), str(merges)), encoder


def test_gpt2_known_merges(tiny_gpt2):
    tok, enc = tiny_gpt2
    assert tok.tokenize("hello world") == [enc["hello"], enc["\u0120world"]]
    assert tok.tokenize("hello world!") == [enc["hello"], enc["\u0120world"], enc["!"]]
    assert tok.tokenize("world") == [enc["w"], enc["or"], enc["ld"]]
    assert tok.tokenize("hell") == [enc["hell"]]
    assert tok.tokenize("") == []
    assert tok.eod == enc[GPT2_EOD_TOKEN]
    assert tok.vocab_size == len(enc)
    assert tok.pad == NO_PAD_ID
    for text in ["hello world", "world hello!", "hell", "dr hole  lord"]:
        assert tok.detokenize(tok.tokenize(text)) == text


def test_gpt2_errors(tiny_gpt2, tmp_path):
    tok, _ = tiny_gpt2
    with pytest.raises(ValueError, match="not in"):
        tok.tokenize("z")
    with pytest.raises(ValueError, match="token id"):
        tok.detokenize([10_000])
    no_eod = tmp_path / "no_eod.json"
    no_eod.write_text(json.dumps({"a": 0}), encoding="utf-8")
    with pytest.raises(ValueError, match="endoftext"):
        GPT2BPETokenizer(str(no_eod), tok.merges_file)
    bad_merges = tmp_path / "bad.txt"
    bad_merges.write_text("a b c\n", encoding="utf-8")
    with pytest.raises(ValueError, match="bad.txt:1"):
        GPT2BPETokenizer(tok.vocab_file, str(bad_merges))


def test_gpt2_byte_level_round_trip_and_pickle(tmp_path):
    # All 256 byte symbols and no merges: every text is encodable, one token per byte.
    encoder = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    encoder[GPT2_EOD_TOKEN] = len(encoder)
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text(json.dumps(encoder), encoding="utf-8")
    merges.write_text("#version: 0.2\n", encoding="utf-8")
    tok = GPT2BPETokenizer(str(vocab), str(merges))
    assert tok.vocab_size == 257 and tok.eod == 256
    for text in _ODD_TEXTS + _docs(10):
        ids = tok.tokenize(text)
        assert len(ids) == len(text.encode("utf-8"))
        assert tok.detokenize(ids) == text
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.tokenize(_ODD_TEXTS[5]) == tok.tokenize(_ODD_TEXTS[5])
    assert clone.identity() == tok.identity()


def test_bytes_to_unicode_is_a_bijection():
    table = bytes_to_unicode()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256
    assert not any(c.isspace() for c in table.values())


def test_gpt2_pretokenization():
    # Expected splits are GPT-2's: whitespace before a word leaves its last character to it.
    pattern = re.compile(GPT2_PRETOKENIZE_PATTERN)
    assert pattern.findall("I'm 42 years   old!!\n\nNext") == [
        "I",
        "'m",
        " 42",
        " years",
        "  ",
        " old",
        "!!",
        "\n",
        "\n",
        "Next",
    ]
    assert pattern.findall("snake_case x\u00b2") == ["snake", "_", "case", " x\u00b2"]
    # No character is ever dropped, whatever its Unicode category.
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(0x20, 0x7F)] + [
        chr(c) for c in (0x0A, 0x09, 0xA0, 0xB2, 0xBD, 0x301, 0x2162, 0x3000, 0x1C, 0x1F600)
    ]
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        assert "".join(pattern.findall(text)) == text
