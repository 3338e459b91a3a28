"""Tokenizers for GPT pretraining: SentencePiece, GPT-2 byte-level BPE, Hugging Face.

What it does:
    :class:`Tokenizer` is the small interface that megatron-core's ``GPTDataset`` and our
    data pipeline read from a tokenizer: ``tokenize``/``detokenize``, ``vocab_size``, ``eod``
    (the end-of-document id appended after every document), ``pad`` and
    ``unique_identifiers`` (a JSON-able description that megatron-core hashes into the names
    of its cached sample indices). Two implementations:

    * :class:`SentencePieceTokenizer` wraps a SentencePiece ``.model``;
      :func:`train_sentencepiece` trains one (BPE, byte fallback, identity normalization, so
      any text encodes and ``detokenize(tokenize(text)) == text``).
    * :class:`GPT2BPETokenizer` is GPT-2's byte-level BPE from an ``encoder.json``/``vocab.json``
      and a ``merges.txt``, implemented in pure Python (the algorithm of OpenAI's
      ``encoder.py``, also used by Megatron-LM's ``gpt2_tokenization.py``).
    * :class:`HuggingFaceTokenizer` is Megatron-LM's ``HuggingFaceTokenizer``:
      ``transformers.AutoTokenizer`` from a model name or a local folder, with the same
      ``tokenize`` (``input_ids``, the special tokens the tokenizer adds itself included, e.g.
      LLaMA-3's ``<|begin_of_text|>``), ``eod`` (its end-of-sequence token) and
      ``vocab_size`` (``len(tokenizer)``), so data made here matches Megatron-LM's
      ``tools/preprocess_data.py`` token for token.

    :func:`tokenize_documents` tokenizes a stream of documents, optionally in parallel, in
    input order.

Why:
    megatron-core 0.16 only types the tokenizer as ``MegatronTokenizerBase`` and duck-types
    it (``GPTDatasetConfig`` reads ``vocab_size``; ``GPTDataset`` reads ``eod``, ``pad`` and
    ``unique_identifiers``), so a plain class suffices and this module stays free of Megatron
    imports. ``unique_identifiers`` holds content hashes of the model files rather than their
    paths, so moving a tokenizer keeps the caches and changing one invalidates them.

Constraints:
    * Pure Python plus ``sentencepiece``; never imports Megatron or torch.
      :class:`HuggingFaceTokenizer` imports ``transformers`` (the ``hf`` extra:
      ``pip install 'megatron-ext[hf]'``) when it is built, never at module import; without
      it the constructor raises :class:`MissingPackageError` naming the extra. A model name
      is resolved by ``transformers`` (its cache, or the Hub); a local folder needs no network.
    * GPT-2 pretokenization uses the standard library's ``re`` (the ``regex`` package is not
      a dependency). ``re`` has no ``\\p{L}``/``\\p{N}``; :data:`GPT2_PRETOKENIZE_PATTERN`
      spells letters as ``[^\\W\\d_]`` and numbers as ``\\d``. For ASCII and for text whose
      letters and digits are Unicode categories L* and Nd the split is identical to GPT-2's.
      Two differences remain: characters of categories Nl/No (``"\u00b2"``,
      ``"\u00bd"``, Roman numerals) are grouped with letters instead of numbers, and
      ``\\s`` also matches the separators U+001C..U+001F. No character is ever dropped
      (every character falls in exactly one class), so tokenization still round-trips.
    * The text ``"<|endoftext|>"`` inside a document is tokenized as ordinary text, as in
      Megatron-LM; the end-of-document id is appended by the dataset writer instead.
    * Tokenizers are picklable (for worker processes); per-process caches are rebuilt.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import multiprocessing
import os
import re
from abc import ABC, abstractmethod
from functools import lru_cache
from typing import (
    Any,
    ClassVar,
    Dict,
    Iterable,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
)

import sentencepiece

from megatron_ext.digests import file_digest

__all__ = [
    "NO_PAD_ID",
    "Tokenizer",
    "SentencePieceTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "HF_EXTRA",
    "MissingPackageError",
    "check_transformers",
    "GPT2_PRETOKENIZE_PATTERN",
    "GPT2_EOD_TOKEN",
    "bytes_to_unicode",
    "train_sentencepiece",
    "tokenize_documents",
]

NO_PAD_ID: int = -1
"""``pad`` of a tokenizer without a padding token; it is also megatron-core's own fallback
pad id, which never matches a real token id."""

GPT2_EOD_TOKEN: str = "<|endoftext|>"
"""GPT-2's end-of-document token; it must be in the vocabulary file."""

GPT2_PRETOKENIZE_PATTERN: str = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+"""
)
"""GPT-2's pretokenization regex in ``re`` syntax (GPT-2's own is
``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``).
``[^\\W\\d_]`` is "word character but not digit or underscore", i.e. letters; the "other"
class ``[^\\s\\w]|_`` is everything that is neither whitespace, letter nor digit."""

# Bound on the characters per line fed to SentencePiece training: its max_sentence_length is
# in bytes (UTF-8 needs up to 4 per character), and longer lines would be skipped silently.
_SP_MAX_LINE_CHARS = 4096
_SP_MAX_SENTENCE_BYTES = 4 * _SP_MAX_LINE_CHARS
_SP_SPECIAL_IDS = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3}


class Tokenizer(ABC):
    """What the data pipeline and megatron-core's ``GPTDataset`` need from a tokenizer.

    Subclasses implement :meth:`tokenize`, :meth:`detokenize`, :attr:`vocab_size`,
    :attr:`eod` and :attr:`unique_identifiers`.
    """

    NATIVE_THREADS: ClassVar[bool] = False
    """Whether :meth:`tokenize_batch` parallelizes by itself (then no worker processes)."""

    @abstractmethod
    def tokenize(self, text: str) -> List[int]:
        """Token ids of ``text`` (no end-of-document id is added)."""

    @abstractmethod
    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of token ids (accepts lists, numpy arrays and 1-D tensors)."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids; every id is in ``[0, vocab_size)``."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """End-of-document id, appended after every document."""

    @property
    @abstractmethod
    def unique_identifiers(self) -> Dict[str, Any]:
        """JSON-serializable description that identifies the tokenizer's behavior."""

    @property
    def pad(self) -> int:
        """Padding id, or :data:`NO_PAD_ID` when the tokenizer has none."""
        return NO_PAD_ID

    @property
    def eos(self) -> int:
        """End-of-sequence id; the same as :attr:`eod`."""
        return self.eod

    def tokenize_batch(self, texts: Sequence[str], num_threads: int = 1) -> List[List[int]]:
        """Token ids of several texts, in order.

        Args:
            texts: the texts.
            num_threads: threads to use where the implementation has native threads
                (:attr:`NATIVE_THREADS`); ignored otherwise.

        Returns:
            One id list per text.
        """
        return [self.tokenize(t) for t in texts]

    def identity(self) -> str:
        """Short hash of :attr:`unique_identifiers`, for cache keys."""
        blob = json.dumps(self.unique_identifiers, sort_keys=True).encode("utf-8")
        return hashlib.sha256(blob).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod})"


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model (BPE or unigram) as a :class:`Tokenizer`.

    The end-of-document id is the model's end-of-sequence piece (``</s>``), as in
    Megatron-LM's ``SentencePieceTokenizer``; the pad id is the model's pad piece if it has one.

    Args:
        model_path: path of the ``.model`` file.

    Raises:
        FileNotFoundError: when ``model_path`` does not exist.
        ValueError: when the file is not a SentencePiece model or has no end-of-sequence piece.
    """

    NATIVE_THREADS: ClassVar[bool] = True

    def __init__(self, model_path: str):
        self.model_path = os.fspath(model_path)
        with open(self.model_path, "rb") as f:
            proto = f.read()
        self._load(proto)

    def _load(self, proto: bytes) -> None:
        self._proto = proto
        self._sha256 = hashlib.sha256(proto).hexdigest()
        processor = sentencepiece.SentencePieceProcessor()
        try:
            processor.LoadFromSerializedProto(proto)
        except RuntimeError as err:
            raise ValueError(f"{self.model_path}: not a SentencePiece model ({err})") from err
        self._sp = processor
        if processor.eos_id() < 0:
            raise ValueError(
                f"{self.model_path}: the SentencePiece model has no end-of-sequence piece "
                "(eos_id = -1), which is needed as end-of-document token"
            )

    def __getstate__(self) -> Dict[str, Any]:
        return {"model_path": self.model_path, "proto": self._proto}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.model_path = state["model_path"]
        self._load(state["proto"])

    def tokenize(self, text: str) -> List[int]:
        """Token ids of ``text``."""
        return self._sp.encode(text)

    def tokenize_batch(self, texts: Sequence[str], num_threads: int = 1) -> List[List[int]]:
        """Token ids of several texts, encoded by SentencePiece's own thread pool."""
        return self._sp.encode(list(texts), num_threads=max(1, num_threads))

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of token ids."""
        return self._sp.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        """Number of pieces of the model."""
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        """The ``</s>`` id."""
        return self._sp.eos_id()

    @property
    def bos(self) -> int:
        """The ``<s>`` id (-1 when the model has none); never added by :meth:`tokenize`."""
        return self._sp.bos_id()

    @property
    def pad(self) -> int:
        """The pad piece id, or :data:`NO_PAD_ID`."""
        pad = self._sp.pad_id()
        return pad if pad >= 0 else NO_PAD_ID

    @property
    def vocab(self) -> Dict[str, int]:
        """Piece to id."""
        return {self._sp.id_to_piece(i): i for i in range(self.vocab_size)}

    @property
    def unique_identifiers(self) -> Dict[str, Any]:
        """Class name and the SHA-256 of the model file."""
        return {"class": type(self).__name__, "model_sha256": self._sha256}


def _sentencepiece_lines(documents: Iterable[str]) -> Iterator[str]:
    """Training sentences: non-blank lines, long lines cut into bounded chunks."""
    for doc in documents:
        for line in doc.split("\n"):
            if not line.strip():
                continue
            for start in range(0, len(line), _SP_MAX_LINE_CHARS):
                yield line[start : start + _SP_MAX_LINE_CHARS]


def train_sentencepiece(
    documents: Iterable[str],
    model_prefix: str,
    vocab_size: int,
    seed: int = 1234,
    num_threads: int = 2,
    max_sentences: int = 2_000_000,
) -> str:
    """Train a byte-fallback BPE SentencePiece model; writes ``<model_prefix>.model``.

    The result depends only on the documents and the arguments: training reads the first
    ``max_sentences`` non-blank lines in order (no sampling, no shuffling) and SentencePiece's
    random generator is seeded. Settings follow Llama's tokenizer: identity normalization, no
    whitespace collapsing, whitespace-only pieces allowed (indentation), digits split, and
    byte fallback so that every string encodes. Ids 0..3 are ``<unk>``, ``<s>``, ``</s>``
    (end of document) and ``<pad>``. On the embedded corpus (about 2 MB) training at
    vocabulary 8192 takes well under a second on 2 cores.

    Args:
        documents: training texts; each is split into lines.
        model_prefix: output path without the ``.model`` suffix; the directory must exist.
        vocab_size: number of pieces, including 256 byte pieces and the 4 special pieces.
        seed: seed of SentencePiece's random generator.
        num_threads: training threads.
        max_sentences: at most this many lines are read.

    Returns:
        The path of the written ``.model`` file.

    Raises:
        ValueError: when there is no training text, or the text cannot support
            ``vocab_size`` pieces.
    """
    lines = itertools.islice(_sentencepiece_lines(documents), max_sentences)
    first = next(lines, None)
    if first is None:
        raise ValueError("train_sentencepiece: the documents contain no text")
    model_path = f"{model_prefix}.model"
    buffer = io.BytesIO()
    sentencepiece.set_random_generator_seed(seed)
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=itertools.chain([first], lines),
            model_writer=buffer,
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            character_coverage=0.9999,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            input_sentence_size=max_sentences,
            shuffle_input_sentence=False,
            max_sentence_length=_SP_MAX_SENTENCE_BYTES,
            num_threads=num_threads,
            minloglevel=2,
            **_SP_SPECIAL_IDS,
        )
    except RuntimeError as err:
        raise ValueError(
            f"SentencePiece training at vocab_size={vocab_size} failed: {err}. A vocabulary "
            "needs 260 ids for bytes and special pieces plus the distinct characters of the "
            "text, and the text must support that many merges; try a smaller vocabulary or "
            "more text."
        ) from err
    tmp_path = f"{model_path}.tmp-{os.getpid()}"
    with open(tmp_path, "wb") as f:
        f.write(buffer.getvalue())
    os.replace(tmp_path, model_path)
    return model_path


@lru_cache(maxsize=None)
def bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters.

    Printable Latin-1 bytes map to themselves; the others (controls, space) map to
    ``chr(256 + k)``, so that BPE works on strings without whitespace or control characters.

    Returns:
        Byte value to one-character string.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, (chr(c) for c in chars)))


class GPT2BPETokenizer(Tokenizer):
    """GPT-2 byte-level BPE from a user's vocabulary and merges files.

    Text is split with :data:`GPT2_PRETOKENIZE_PATTERN`, each piece's UTF-8 bytes are mapped
    through :func:`bytes_to_unicode`, and merges are applied lowest rank first. Results per
    piece are kept in an LRU cache.

    Args:
        vocab_file: ``encoder.json`` / ``vocab.json``: a JSON object of token string to id.
        merges_file: ``merges.txt``: one merge ``"a b"`` per line in rank order, after an
            optional ``#version`` header line.
        cache_size: number of pretokenized pieces whose BPE result is cached.

    Raises:
        FileNotFoundError: when a file does not exist.
        ValueError: when a file is malformed or the vocabulary lacks ``<|endoftext|>``.
    """

    def __init__(self, vocab_file: str, merges_file: str, cache_size: int = 1 << 16):
        self.vocab_file = os.fspath(vocab_file)
        self.merges_file = os.fspath(merges_file)
        self.cache_size = cache_size
        try:
            with open(self.vocab_file, "r", encoding="utf-8") as f:
                encoder = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{self.vocab_file}: not a JSON vocabulary ({err})") from err
        if not isinstance(encoder, dict) or not all(isinstance(v, int) for v in encoder.values()):
            raise ValueError(f"{self.vocab_file}: expected a JSON object of token -> int id")
        if GPT2_EOD_TOKEN not in encoder:
            raise ValueError(f"{self.vocab_file}: the vocabulary has no {GPT2_EOD_TOKEN!r} token")
        self.encoder: Dict[str, int] = encoder
        self.decoder: Dict[int, str] = {v: k for k, v in encoder.items()}
        self.bpe_ranks: Dict[Tuple[str, str], int] = self._read_merges(self.merges_file)
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self._pattern = re.compile(GPT2_PRETOKENIZE_PATTERN)
        self._vocab_size = max(encoder.values()) + 1
        self._identifiers = {
            "class": type(self).__name__,
            "vocab_sha256": file_digest(self.vocab_file, "sha256"),
            "merges_sha256": file_digest(self.merges_file, "sha256"),
        }
        self._bpe_cached = lru_cache(maxsize=cache_size)(self._bpe)

    @staticmethod
    def _read_merges(path: str) -> Dict[Tuple[str, str], int]:
        ranks: Dict[Tuple[str, str], int] = {}
        with open(path, "r", encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                line = line.rstrip("\n")
                if not line or (lineno == 1 and line.startswith("#version")):
                    continue
                parts = line.split(" ")
                if len(parts) != 2:
                    raise ValueError(f"{path}:{lineno}: expected 'left right', got {line!r}")
                ranks.setdefault((parts[0], parts[1]), len(ranks))
        return ranks

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        # The compiled pattern pickles fine; the lru_cache wrapper does not.
        del state["_bpe_cached"]
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._bpe_cached = lru_cache(maxsize=self.cache_size)(self._bpe)

    def _bpe(self, token: str) -> Tuple[str, ...]:
        """Apply the merges to one byte-mapped piece; returns its BPE tokens."""
        word = tuple(token)
        while len(word) > 1:
            pairs = set(zip(word, word[1:]))
            best = min(pairs, key=lambda p: self.bpe_ranks.get(p, float("inf")))
            if best not in self.bpe_ranks:
                break
            first, second = best
            merged: List[str] = []
            i = 0
            while i < len(word):
                if i < len(word) - 1 and word[i] == first and word[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
        return word

    def pretokenize(self, text: str) -> List[str]:
        """The pieces GPT-2 applies BPE to (concatenated they give ``text`` back)."""
        return self._pattern.findall(text)

    def tokenize(self, text: str) -> List[int]:
        """Token ids of ``text``.

        Raises:
            ValueError: when a BPE token is missing from the vocabulary (an inconsistent
                vocabulary/merges pair; GPT-2's files cover every byte and merge).
        """
        ids: List[int] = []
        for piece in self._pattern.findall(text):
            mapped = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            for token in self._bpe_cached(mapped):
                try:
                    ids.append(self.encoder[token])
                except KeyError:
                    raise ValueError(
                        f"BPE token {token!r} (from {piece!r}) is not in {self.vocab_file}; "
                        "the vocabulary and merges files do not belong together"
                    ) from None
        return ids

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of token ids; invalid UTF-8 byte sequences become U+FFFD."""
        try:
            text = "".join(self.decoder[int(i)] for i in ids)
        except KeyError as err:
            raise ValueError(f"token id {err.args[0]} is not in {self.vocab_file}") from None
        return bytes(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")

    @property
    def vocab_size(self) -> int:
        """Largest id in the vocabulary file plus one (50257 for GPT-2)."""
        return self._vocab_size

    @property
    def eod(self) -> int:
        """The ``<|endoftext|>`` id."""
        return self.encoder[GPT2_EOD_TOKEN]

    @property
    def vocab(self) -> Dict[str, int]:
        """Token string (byte-mapped) to id."""
        return self.encoder

    @property
    def unique_identifiers(self) -> Dict[str, Any]:
        """Class name and the SHA-256 of both files."""
        return dict(self._identifiers)


HF_EXTRA: str = "hf"
"""The ``setup.py`` extra that installs ``transformers`` for :class:`HuggingFaceTokenizer`."""


class MissingPackageError(ImportError):
    """A tokenizer needs a Python package that is not installed (the message says which)."""


def check_transformers() -> None:
    """Raise :class:`MissingPackageError` (naming the extra) unless ``transformers`` imports.

    Only looks for the package (``find_spec``); nothing is imported.
    """
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        raise MissingPackageError(
            "HuggingFaceTokenizer needs the transformers package, which is not installed: "
            f"pip install 'megatron-ext[{HF_EXTRA}]' (or: pip install transformers)"
        )


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face tokenizer (``transformers.AutoTokenizer``), as Megatron-LM's.

    ``tokenize`` is ``tokenizer(text).input_ids``: special tokens the tokenizer adds by itself
    (a beginning-of-text token) are kept, as Megatron-LM's ``HuggingFaceTokenizer`` and its
    ``tools/preprocess_data.py`` keep them. The end-of-document id is the tokenizer's
    end-of-sequence token; the vocabulary size is ``len(tokenizer)`` (added tokens included).

    Args:
        name_or_path: a local folder written by ``save_pretrained`` (``tokenizer.json`` /
            ``tokenizer_config.json``), or a model name ``transformers`` resolves.

    Raises:
        MissingPackageError: ``transformers`` is not installed.
        ValueError: the tokenizer cannot be loaded or has no end-of-sequence token.
    """

    def __init__(self, name_or_path: str):
        self.name_or_path = os.fspath(name_or_path)
        self._load()

    def _load(self) -> None:
        check_transformers()
        import transformers

        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(self.name_or_path)
        except (OSError, ValueError) as err:
            raise ValueError(
                f"{self.name_or_path}: cannot load a Hugging Face tokenizer ({err})"
            ) from err
        if tokenizer.eos_token_id is None:
            raise ValueError(
                f"{self.name_or_path}: the tokenizer has no end-of-sequence token "
                "(eos_token), which is needed as end-of-document token"
            )
        self._tok = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            blob = backend.to_str()
        else:
            blob = json.dumps(sorted(tokenizer.get_vocab().items()))
        self._identifiers = {
            "class": type(self).__name__,
            "tokenizer_class": type(tokenizer).__name__,
            "tokenizer_sha256": hashlib.sha256(blob.encode("utf-8")).hexdigest(),
            "special_tokens": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        }

    def __getstate__(self) -> Dict[str, Any]:
        return {"name_or_path": self.name_or_path}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.name_or_path = state["name_or_path"]
        self._load()

    def tokenize(self, text: str) -> List[int]:
        """``tokenizer(text).input_ids`` (no end-of-document id)."""
        # verbose=False: no warning per document longer than the model's context.
        return list(self._tok(text, verbose=False).input_ids)

    def tokenize_batch(self, texts: Sequence[str], num_threads: int = 1) -> List[List[int]]:
        """Token ids of several texts, in one call of the tokenizer."""
        return [list(ids) for ids in self._tok(list(texts), verbose=False).input_ids]

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of token ids (special tokens included)."""
        return self._tok.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        """``len(tokenizer)``: the base vocabulary plus added tokens (as Megatron-LM)."""
        return len(self._tok)

    @property
    def eod(self) -> int:
        """The end-of-sequence token's id."""
        return int(self._tok.eos_token_id)

    @property
    def bos(self) -> int:
        """The beginning-of-sequence id, or -1 when the tokenizer has none."""
        bos = self._tok.bos_token_id
        return -1 if bos is None else int(bos)

    @property
    def pad(self) -> int:
        """The pad token's id, or :data:`NO_PAD_ID`."""
        pad = self._tok.pad_token_id
        return NO_PAD_ID if pad is None else int(pad)

    @property
    def vocab(self) -> Dict[str, int]:
        """Token string to id."""
        return self._tok.get_vocab()

    @property
    def unique_identifiers(self) -> Dict[str, Any]:
        """Class names, the SHA-256 of the serialized tokenizer and its special tokens."""
        return dict(self._identifiers)


# Worker-process state of tokenize_documents (set by the pool initializer).
_WORKER_TOKENIZER: Optional[Tokenizer] = None


def _init_worker(tokenizer: Tokenizer) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tokenizer


def _tokenize_in_worker(texts: List[str]) -> List[List[int]]:
    assert _WORKER_TOKENIZER is not None
    return _WORKER_TOKENIZER.tokenize_batch(texts)


def _chunks(items: Iterable[str], size: int) -> Iterator[List[str]]:
    it = iter(items)
    while True:
        chunk = list(itertools.islice(it, size))
        if not chunk:
            return
        yield chunk


def tokenize_documents(
    tokenizer: Tokenizer,
    documents: Iterable[str],
    *,
    num_workers: int = 1,
    chunk_size: int = 256,
) -> Iterator[List[int]]:
    """Token ids of each document, in input order.

    With ``num_workers > 1``, a tokenizer with native threads (SentencePiece) uses that many
    threads; any other is run in that many ``spawn`` worker processes (the tokenizer is
    pickled to them once). Results are identical to ``num_workers=1``.

    Args:
        tokenizer: the tokenizer.
        documents: the texts; consumed lazily, ``chunk_size`` at a time.
        num_workers: degree of parallelism.
        chunk_size: documents per task.

    Yields:
        One id list per document (no end-of-document id).
    """
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if num_workers == 1 or tokenizer.NATIVE_THREADS:
        for chunk in _chunks(documents, chunk_size):
            yield from tokenizer.tokenize_batch(chunk, num_threads=num_workers)
        return
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(num_workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        for ids in pool.imap(_tokenize_in_worker, _chunks(documents, chunk_size)):
            yield from ids
