"""The data pipeline against real megatron-core: indexed files, GPTDataset, sampling, caching.

Everything runs on CPU. A 512-piece SentencePiece model and an indexed dataset of the first
400 embedded-corpus documents are built once per module; caches live under ``tmp_path``
(``MEGATRON_EXT_CACHE`` is pointed there too, so nothing reaches ``~/.cache``). Two tests
start processes: the cache lock test forks two builders, the distributed test runs two gloo
ranks as subprocesses.
"""

import dataclasses
import fcntl
import itertools
import json
import multiprocessing
import os
import re
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

import megatron_ext.megatron.data.datasets as datasets_module
from megatron_ext.config import ConfigError
from megatron_ext.data.cache import read_marker
from megatron_ext.data.config import DataConfig
from megatron_ext.data.corpus import embedded_corpus_documents
from megatron_ext.data.tokenizers import SentencePieceTokenizer, Tokenizer, train_sentencepiece
from megatron_ext.megatron.data import (
    DatasetExhaustedError,
    MicrobatchIterator,
    build_gpt_datasets,
    build_tokenizer,
    indexed_dataset_stats,
    prepare_default_data,
    sample_indices,
    write_indexed_dataset,
)
from tests.helpers.paths import REPO

_SEQ = 32


@pytest.fixture(autouse=True)
def _private_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGATRON_EXT_CACHE", str(tmp_path / "default-cache"))


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    docs = list(itertools.islice(embedded_corpus_documents(), 400))
    model = train_sentencepiece(docs, str(root / "tok"), vocab_size=512)
    tokenizer = SentencePieceTokenizer(model)
    prefix = write_indexed_dataset(docs, tokenizer, str(root / "corpus"))
    cfg = DataConfig(
        data_path=(prefix,),
        tokenizer_model=model,
        split="90,10,0",
        data_cache_path=str(root / "cache"),
    )
    return SimpleNamespace(
        root=root, docs=docs, model=model, tokenizer=tokenizer, prefix=prefix, cfg=cfg
    )


@pytest.fixture(scope="module")
def train_dataset(small):
    train, _, _ = build_gpt_datasets(
        small.cfg, tokenizer=small.tokenizer, seq_length=_SEQ, seed=1234, num_samples=(96, 0, 0)
    )
    return train


# ------------------------------------------------------------------------------------------
# Indexed datasets
# ------------------------------------------------------------------------------------------


def test_indexed_dataset_reads_back(small):
    dataset = IndexedDataset(small.prefix)
    assert dataset.index.dtype == numpy.uint16
    assert len(dataset) == len(small.docs) == len(dataset.document_indices) - 1
    total = 0
    for i, doc in enumerate(small.docs):
        expected = small.tokenizer.tokenize(doc) + [small.tokenizer.eod]
        numpy.testing.assert_array_equal(dataset[i], expected)
        total += len(expected)
    assert indexed_dataset_stats(small.prefix) == (len(small.docs), total)


class _CodepointTokenizer(Tokenizer):
    """Ids ``65600 + ord(c)``: too large for uint16, so the writer must pick int32."""

    def tokenize(self, text):
        return [65600 + ord(c) for c in text]

    def detokenize(self, ids):
        return "".join(chr(int(i) - 65600) for i in ids)

    @property
    def vocab_size(self):
        return 65600 + 256

    @property
    def eod(self):
        return 0

    @property
    def unique_identifiers(self):
        return {"class": "codepoints"}


def test_indexed_dataset_dtype_and_empty_documents(tmp_path):
    tok = _CodepointTokenizer()
    prefix = write_indexed_dataset(["ab", "", "cde"], tok, str(tmp_path / "x"), append_eod=False)
    dataset = IndexedDataset(prefix)
    assert dataset.index.dtype == numpy.int32
    assert [tok.detokenize(dataset[i]) for i in range(len(dataset))] == ["ab", "cde"]
    with pytest.raises(ValueError, match="no non-empty documents"):
        write_indexed_dataset(["", ""], tok, str(tmp_path / "empty"))
    assert sorted(os.listdir(tmp_path)) == ["x.bin", "x.idx"]


# ------------------------------------------------------------------------------------------
# GPTDataset through BlendedMegatronDatasetBuilder
# ------------------------------------------------------------------------------------------


def test_gpt_datasets(small, train_dataset):
    train, valid, test = build_gpt_datasets(
        small.cfg, tokenizer=small.tokenizer, seq_length=_SEQ, seed=1234, num_samples=(96, 8, 0)
    )
    assert test is None
    assert len(train) >= 96 and len(valid) >= 8
    sample = train[5]
    assert sample["tokens"].shape == sample["labels"].shape == (_SEQ,)
    assert sample["attention_mask"].shape == (1, _SEQ, _SEQ)
    # Labels are the next tokens: consecutive samples overlap by the one extra token.
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
    assert int(sample["tokens"].max()) < small.tokenizer.vocab_size
    assert torch.equal(sample["position_ids"], torch.arange(_SEQ))
    assert bool((sample["loss_mask"] == 1).all())
    # The train split does not depend on whether valid was requested; indices are cached.
    assert torch.equal(train_dataset[5]["tokens"], sample["tokens"])
    assert any(n.endswith("shuffle_index.npy") for n in os.listdir(small.root / "cache/indices"))


def test_gpt_datasets_from_data_files(small, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(
        "\n".join(json.dumps({"body": d}) for d in small.docs[:60]) + "\n", encoding="utf-8"
    )
    cfg = DataConfig(
        data_files=(str(path),),
        data_text_key="body",
        tokenizer_model=small.model,
        split="80,20,0",
        data_cache_path=str(tmp_path / "cache"),
    )
    tokenizer = build_tokenizer(cfg)
    train, valid, _ = build_gpt_datasets(
        cfg, tokenizer=tokenizer, seq_length=_SEQ, seed=7, num_samples=(16, 4, 0)
    )
    assert len(train) >= 16 and len(valid) >= 4
    (entry,) = [p for p in (tmp_path / "cache").iterdir() if p.name.startswith("files-")]
    assert read_marker(str(entry))["info"]["num_documents"] == 60
    built_at = read_marker(str(entry))["built_at"]
    build_gpt_datasets(cfg, tokenizer=tokenizer, seq_length=_SEQ, seed=7, num_samples=(16, 4, 0))
    assert read_marker(str(entry))["built_at"] == built_at


def test_weighted_blend(small, tmp_path):
    other = write_indexed_dataset(small.docs[200:], small.tokenizer, str(tmp_path / "other"))
    cfg = DataConfig(
        data_path=("0.25", small.prefix, "0.75", other),
        tokenizer_model=small.model,
        split="90,10,0",
        data_cache_path=str(tmp_path / "cache"),
    )
    train, _, _ = build_gpt_datasets(
        cfg, tokenizer=small.tokenizer, seq_length=_SEQ, seed=3, num_samples=(64, 0, 0)
    )
    assert len(train) >= 64
    batch = next(MicrobatchIterator(train, micro_batch_size=64, dp_rank=0, dp_size=1))
    assert batch["tokens"].shape == (64, _SEQ)
    # Samples are drawn in proportion to the weights.
    assert 8 <= int((batch["dataset_id"] == 0).sum()) <= 24


def test_empty_split_is_refused(small, tmp_path):
    tok = small.tokenizer
    prefix = write_indexed_dataset(small.docs[:20], tok, str(tmp_path / "tiny"))
    cfg = DataConfig(
        data_path=(prefix,), tokenizer_model=small.model, data_cache_path=str(tmp_path / "c")
    )
    # 0.1% of 20 documents is none: megatron-core would loop forever on the test split.
    with pytest.raises(ConfigError, match="test split") as info:
        build_gpt_datasets(cfg, tokenizer=tok, seq_length=_SEQ, seed=1, num_samples=(8, 2, 2))
    assert info.value.flags == ("--split",)
    # Asking for no test samples drops that split instead.
    train, valid, test = build_gpt_datasets(
        cfg, tokenizer=tok, seq_length=_SEQ, seed=1, num_samples=(8, 2, 0)
    )
    assert test is None and len(train) >= 8 and len(valid) >= 2
    # One document (a single .txt file through prepare-data): the refusal's --split works.
    one = write_indexed_dataset(small.docs[:1], tok, str(tmp_path / "one"))
    cfg = DataConfig(
        data_path=(one,),
        tokenizer_model=small.model,
        data_cache_path=str(tmp_path / "c1"),
        split="98,2,0",
    )
    with pytest.raises(ConfigError, match="valid split") as info:
        build_gpt_datasets(cfg, tokenizer=tok, seq_length=_SEQ, seed=1, num_samples=(8, 2, 0))
    advice = re.search(r"pass --split (\S+)", str(info.value)).group(1)
    assert advice == "100,0,0", str(info.value)
    cfg = dataclasses.replace(cfg, split=advice)
    train, valid, test = build_gpt_datasets(
        cfg, tokenizer=tok, seq_length=_SEQ, seed=1, num_samples=(8, 2, 0)
    )
    assert len(train) >= 8 and valid is None and test is None


def test_token_ids_outside_the_vocabulary_are_refused_on_the_index(small, tmp_path):
    """Data made with another (larger) tokenizer: refused before any dataset is built, from
    the largest id in the .bin (scanned once, cached), instead of an IndexError in the
    embedding at the first such token."""
    from megatron_ext.megatron.data import max_token_id

    cache = str(tmp_path / "c")
    top = max_token_id(small.prefix, cache)
    assert 0 < top < 512
    assert max_token_id(small.prefix, cache) == top  # from the cache
    assert len(os.listdir(os.path.join(cache, "token-range"))) == 2  # marker dir + lock
    cfg = DataConfig(data_path=(small.prefix,), tokenizer_model=small.model, data_cache_path=cache)
    narrow = SimpleNamespace(vocab_size=top)  # a tokenizer that never produces id `top`
    with pytest.raises(ConfigError) as info:
        build_gpt_datasets(cfg, tokenizer=narrow, seq_length=_SEQ, seed=1, num_samples=(8, 0, 0))
    assert info.value.flags == ("--data-path", "--tokenizer-model")
    assert f"holds token id {top}, outside the tokenizer's vocabulary of {top} ids" in str(
        info.value
    )


def test_sample_index_larger_than_memory_is_refused_before_the_build(small, tmp_path):
    """--train-iters 10^9 used to make numpy allocate the document index (69.7 GiB on the
    embedded corpus); the estimate refuses it naming the flags that set the sample count."""
    cfg = dataclasses.replace(small.cfg, data_cache_path=str(tmp_path / "c"))
    with pytest.raises(ConfigError) as info:
        build_gpt_datasets(
            cfg, tokenizer=small.tokenizer, seq_length=_SEQ, seed=1, num_samples=(10**12, 0, 0)
        )
    assert info.value.flags == ("--train-iters", "--global-batch-size")
    assert "sample index of the train split" in str(info.value)
    assert "of host memory, more than the" in str(info.value)
    assert not os.path.isdir(os.path.join(str(tmp_path / "c"), "indices"))  # nothing built


def test_missing_data_path_names_the_flag(small, tmp_path):
    cfg = DataConfig(data_path=(str(tmp_path / "nothing"),), tokenizer_model=small.model)
    with pytest.raises(ConfigError, match="no such file") as info:
        build_gpt_datasets(
            cfg, tokenizer=small.tokenizer, seq_length=_SEQ, seed=1, num_samples=(1, 0, 0)
        )
    assert info.value.flags == ("--data-path",)


# ------------------------------------------------------------------------------------------
# Sampling
# ------------------------------------------------------------------------------------------


def _reference_sampler(consumed, total, mbs, dp_rank, dp_size):
    """Megatron-LM's MegatronPretrainingSampler (dataloader-type single), restated."""
    block = []
    for idx in range(consumed, total):
        block.append(idx)
        if len(block) == mbs * dp_size:
            yield block[dp_rank * mbs : (dp_rank + 1) * mbs]
            block = []


@pytest.mark.parametrize("mbs, dp_size, num_microbatches", [(1, 1, 3), (2, 2, 4), (3, 4, 2)])
def test_sample_indices_partition_the_global_batch(mbs, dp_size, num_microbatches):
    consumed = 5 * mbs * dp_size * num_microbatches
    global_batch = mbs * dp_size * num_microbatches
    seen = []
    for dp_rank in range(dp_size):
        reference = _reference_sampler(consumed, consumed + global_batch, mbs, dp_rank, dp_size)
        for microbatch, expected in zip(range(num_microbatches), reference):
            indices = sample_indices(consumed, microbatch, mbs, dp_rank, dp_size)
            assert indices.dtype == torch.int64 and indices.tolist() == expected
            seen.extend(indices.tolist())
    assert sorted(seen) == list(range(consumed, consumed + global_batch))
    assert len(set(seen)) == len(seen)


def test_iterator_batches_and_resume(train_dataset):
    mbs, dp_size, steps = 2, 2, 6
    block = mbs * dp_size
    for dp_rank in range(dp_size):
        full = MicrobatchIterator(train_dataset, micro_batch_size=mbs, dp_rank=dp_rank, dp_size=2)
        uninterrupted = [next(full) for _ in range(steps)]
        assert full.consumed_samples == steps * block
        for step, batch in enumerate(uninterrupted):
            expected = sample_indices(0, step, mbs, dp_rank, dp_size)
            assert torch.equal(batch["sample_index"], expected)
            assert batch["tokens"].shape == (mbs, _SEQ) and batch["tokens"].dtype == torch.int64
            assert batch["labels"].shape == (mbs, _SEQ)
            assert batch["loss_mask"].dtype == torch.float32
            assert batch["attention_mask"].shape == (mbs, 1, _SEQ, _SEQ)
            for j, index in enumerate(expected.tolist()):
                assert torch.equal(batch["tokens"][j], train_dataset[index]["tokens"])
        # Resuming at C samples gives what the uninterrupted iterator gave after C samples.
        for resume_step in (1, 4):
            resumed = MicrobatchIterator(
                train_dataset,
                micro_batch_size=mbs,
                dp_rank=dp_rank,
                dp_size=dp_size,
                consumed_samples=resume_step * block,
            )
            for expected_batch in uninterrupted[resume_step:]:
                batch = next(resumed)
                assert batch.keys() == expected_batch.keys()
                for key in batch:
                    assert torch.equal(batch[key], expected_batch[key]), key
        state = full.state_dict()
        restored = MicrobatchIterator(
            train_dataset, micro_batch_size=mbs, dp_rank=dp_rank, dp_size=2
        )
        restored.load_state_dict(state)
        assert torch.equal(next(restored)["tokens"], next(full)["tokens"])


def test_iterator_stops_with_a_clear_error(train_dataset):
    block = 4
    last = (len(train_dataset) // block) * block
    it = MicrobatchIterator(
        train_dataset, micro_batch_size=2, dp_rank=1, dp_size=2, consumed_samples=last - block
    )
    assert len(it) == 1
    next(it)
    assert len(it) == 0
    with pytest.raises(DatasetExhaustedError, match="more samples"):
        next(it)
    with pytest.raises(ValueError, match="dp_rank"):
        MicrobatchIterator(train_dataset, micro_batch_size=2, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match="expected"):
        it.load_state_dict({"consumed": 0})


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_fixed_samples_cycle_per_rank_in_a_new_order_each_epoch(dp_size):
    from megatron_ext.megatron.data import FixedSampleSampler

    mbs, num = 2, 26  # 26 rounds down to a multiple of dp_size
    per_rank = num // dp_size
    for rank in range(dp_size):
        sampler = FixedSampleSampler(num, mbs, rank, dp_size, seed=7)
        assert sampler.num_samples == per_rank * dp_size
        ids = torch.cat(
            [sampler.indices(c, 0) for c in range(0, 6 * per_rank * dp_size, mbs * dp_size)]
        ).tolist()
        assert all(i % dp_size == rank for i in ids)  # a sample always on its rank
        epochs = [ids[k * per_rank : (k + 1) * per_rank] for k in range(6)]
        for epoch in epochs:
            assert sorted(epoch) == sorted(sampler.local_ids().tolist())  # each once an epoch
        assert len({tuple(e) for e in epochs}) > 1  # a new order per epoch
        # A pure function of the consumed samples (what makes resume exact).
        again = FixedSampleSampler(num, mbs, rank, dp_size, seed=7)
        assert (
            again.indices(3 * mbs * dp_size, 1).tolist()
            == sampler.indices(3 * mbs * dp_size, 1).tolist()
        )


def test_fixed_sample_ids_mean_the_same_tokens_every_epoch(small):
    from megatron_ext.megatron.data import FixedSampleSampler

    train, _, _ = build_gpt_datasets(
        small.cfg, tokenizer=small.tokenizer, seq_length=_SEQ, seed=1234, num_samples=(12, 0, 0)
    )
    sampler = FixedSampleSampler(12, 2, 0, 1, seed=3)
    it = MicrobatchIterator(train, micro_batch_size=2, dp_rank=0, dp_size=1, sampler=sampler)
    seen = {}
    for _ in range(3 * 6):  # three epochs of 12 samples, 2 per microbatch
        batch = next(it)
        for i, tokens in zip(batch["sample_index"].tolist(), batch["tokens"]):
            if i in seen:
                assert torch.equal(seen[i], tokens), i
            seen[i] = tokens
    assert sorted(seen) == list(range(12))


def test_iterator_without_attention_mask(small):
    train, _, _ = build_gpt_datasets(
        small.cfg,
        tokenizer=small.tokenizer,
        seq_length=_SEQ,
        seed=1234,
        num_samples=(8, 0, 0),
        create_attention_mask=False,
    )
    batch = next(MicrobatchIterator(train, micro_batch_size=2, dp_rank=0, dp_size=1))
    assert "attention_mask" not in batch
    assert batch["position_ids"].shape == (2, _SEQ)


# ------------------------------------------------------------------------------------------
# Processes: the cache lock, and two gloo ranks
# ------------------------------------------------------------------------------------------


def _prepare_counting_builds(cache_dir, log_path, barrier, queue):
    import megatron_ext.megatron.data.prepare as data

    train = data.train_sentencepiece

    def counting_train(*args, **kwargs):
        with open(log_path, "a") as f:
            f.write(f"{os.getpid()}\n")
        return train(*args, **kwargs)

    data.train_sentencepiece = counting_train
    barrier.wait()
    tokenizer, prefix = data.prepare_default_data(cache_dir, vocab_size=512)
    queue.put((os.getpid(), prefix, tokenizer.identity()))


def test_prepare_default_data_builds_once_under_concurrency(tmp_path):
    cache, log = str(tmp_path / "cache"), str(tmp_path / "builds.log")
    # fork: the children inherit the imported modules, and patch their own copy.
    ctx = multiprocessing.get_context("fork")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=_prepare_counting_builds, args=(cache, log, barrier, queue))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    with open(log) as f:
        builders = [int(line) for line in f]
    assert len(builders) == 1, "the SentencePiece model was trained more than once"
    assert {r[0] for r in results} == {p.pid for p in procs}
    assert len({r[1] for r in results}) == 1 and len({r[2] for r in results}) == 1
    entry = os.path.dirname(results[0][1])
    assert read_marker(entry)["built_by_pid"] == builders[0]
    assert [n for n in os.listdir(cache) if ".tmp-" in n] == []
    # A later caller reuses the entry without touching it.
    model = os.path.join(entry, "tokenizer.model")
    mtime = os.stat(model).st_mtime_ns
    tokenizer, prefix = prepare_default_data(cache, vocab_size=512)
    assert prefix == results[0][1] and tokenizer.identity() == results[0][2]
    assert os.stat(model).st_mtime_ns == mtime
    num_documents, num_tokens = indexed_dataset_stats(prefix)
    assert num_documents > 1000 and num_tokens > num_documents


def _locked_elsewhere(path):
    """Whether another open file description holds an exclusive flock on ``path``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_index_build_holds_the_cache_lock(small, tmp_path, monkeypatch):
    # Jobs sharing a cache (DiLoCo's sites over torchft) must never see another job's index
    # files half-written: megatron-core writes them in place, so the build runs under an
    # exclusive flock on <cache>/indices/.build.lock that a second job waits for.
    cfg = dataclasses.replace(small.cfg, data_cache_path=str(tmp_path / "cache"))
    lock = str(tmp_path / "cache" / "indices" / ".build.lock")
    held = []
    build = datasets_module._DatasetBuilder.build

    def probing_build(self):
        held.append(_locked_elsewhere(lock))
        return build(self)

    monkeypatch.setattr(datasets_module._DatasetBuilder, "build", probing_build)
    train, _, _ = build_gpt_datasets(
        cfg, tokenizer=small.tokenizer, seq_length=_SEQ, seed=5, num_samples=(16, 0, 0)
    )
    assert held == [True], "the index build ran without the cache lock"
    assert not _locked_elsewhere(lock), "the cache lock outlived the build"
    assert len(train) >= 16


_RANK_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    import torch.distributed as dist
    from megatron_ext.data.config import DataConfig
    from megatron_ext.megatron.data import MicrobatchIterator, build_gpt_datasets, build_tokenizer

    rank, world, init_file, cfg_json, out = sys.argv[1:]
    rank, world = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    cfg = DataConfig(**{k: tuple(v) if isinstance(v, list) else v
                        for k, v in json.loads(cfg_json).items()})
    tok = build_tokenizer(cfg)
    train, valid, _ = build_gpt_datasets(cfg, tokenizer=tok, seq_length=32, seed=99,
                                         num_samples=(40, 4, 0))
    batch = next(MicrobatchIterator(train, micro_batch_size=2, dp_rank=rank, dp_size=world))
    torch.save({"len": (len(train), len(valid)), "index": batch["sample_index"],
                "tokens": batch["tokens"]}, out)
    dist.barrier()
    dist.destroy_process_group()
    """)


def test_build_gpt_datasets_on_two_gloo_ranks(small, tmp_path):
    cache = tmp_path / "cache"
    cfg = {
        "data_path": [small.prefix],
        "tokenizer_model": small.model,
        "split": "90,10,0",
        "data_cache_path": str(cache),
    }
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    init_file = tmp_path / "init"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _RANK_SCRIPT,
                str(rank),
                "2",
                str(init_file),
                json.dumps(cfg),
                str(tmp_path / f"rank{rank}.pt"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    for rank, proc in enumerate(procs):
        output, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"rank {rank} failed:\n{output[-4000:]}"
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert results[0]["len"] == results[1]["len"]
    assert results[0]["index"].tolist() == [0, 1] and results[1]["index"].tolist() == [2, 3]
    # Same samples as a single-process build from the indices the ranks cached.
    train, _, _ = build_gpt_datasets(
        DataConfig(**{**cfg, "data_path": (small.prefix,)}),
        tokenizer=small.tokenizer,
        seq_length=32,
        seed=99,
        num_samples=(40, 4, 0),
    )
    for result in results:
        for j, index in enumerate(result["index"].tolist()):
            assert torch.equal(result["tokens"][j], train[index]["tokens"])


# ------------------------------------------------------------------------------------------
# megatron-ext prepare-data
# ------------------------------------------------------------------------------------------


def test_prepare_data_command(small, tmp_path, capsys):
    from megatron_ext.megatron.prepare_data import main

    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text(
        "\n".join(json.dumps({"content": d}) for d in small.docs[:50]) + "\n", encoding="utf-8"
    )
    txt = tmp_path / "in.txt"
    txt.write_text(small.docs[60], encoding="utf-8")
    out = tmp_path / "out" / "data"
    argv = ["--input", str(jsonl), str(txt), "--output-prefix", str(out)]
    assert main(argv + ["--data-text-key", "content", "--vocab-size", "400"]) == 0
    report = capsys.readouterr().out
    assert "51 documents" in report and "trained SentencePiece model" in report
    tokenizer = SentencePieceTokenizer(f"{out}.model")
    assert tokenizer.vocab_size == 400
    dataset = IndexedDataset(str(out))
    assert len(dataset) == 51
    assert tokenizer.detokenize(dataset[50][:-1]) == small.docs[60]

    # GPT-2 BPE (a byte-level vocabulary without merges) in two worker processes.
    from megatron_ext.data.tokenizers import GPT2_EOD_TOKEN, GPT2BPETokenizer, bytes_to_unicode

    encoder = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    encoder[GPT2_EOD_TOKEN] = len(encoder)
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text(json.dumps(encoder), encoding="utf-8")
    merges.write_text("#version: 0.2\n", encoding="utf-8")
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab)]
    gpt2 += ["--merge-file", str(merges), "--workers", "2", "--data-text-key", "content"]
    assert main(argv[:-1] + [str(tmp_path / "gpt2"), *gpt2]) == 0
    dataset = IndexedDataset(str(tmp_path / "gpt2"))
    tok = GPT2BPETokenizer(str(vocab), str(merges))
    assert [int(t) for t in dataset[3]] == tok.tokenize(small.docs[3]) + [tok.eod]

    # Errors exit with status 2 and name the flag.
    for bad, flag in [
        (["--input", str(tmp_path / "missing.jsonl"), "--output-prefix", str(out)], "--input"),
        (argv + ["--data-text-key", "nope", "--tokenizer-model", small.model], "--data-text-key"),
        (argv + ["--tokenizer-type", "GPT2BPETokenizer"], "--vocab-file"),
        (["--output-prefix", str(out)], "--input"),
    ]:
        with pytest.raises(SystemExit) as info:
            main(bad)
        assert info.value.code == 2
        assert flag in capsys.readouterr().err
