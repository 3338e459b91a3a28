"""DataConfig flags and validation, the file readers and the once-only cache builder.

Pure Python: no Megatron. The reader tests go through Hugging Face ``datasets`` with its
cache in ``tmp_path``.
"""

import argparse
import gzip
import json
import os

import pytest

from megatron_ext.config import ConfigError, add_config_args, config_from_args
from megatron_ext.data.cache import MARKER_NAME, build_once, is_built
from megatron_ext.data.config import CACHE_ENV_VAR, DataConfig, default_cache_dir, parse_blend
from megatron_ext.data.readers import files_fingerprint, iter_file_documents


def _parse(argv):
    parser = add_config_args(argparse.ArgumentParser(), DataConfig)
    return config_from_args(DataConfig, parser.parse_args(argv))


def test_flags_use_megatron_lm_names():
    parser = add_config_args(argparse.ArgumentParser(), DataConfig)
    flags = {s for a in parser._actions for s in a.option_strings}
    assert {
        "--data-path",
        "--split",
        "--tokenizer-type",
        "--tokenizer-model",
        "--vocab-file",
        "--merge-file",
        "--vocab-size",
        "--data-cache-path",
        "--data-files",
        "--data-text-key",
    } <= flags


def test_defaults_and_parsing():
    cfg = _parse([])
    assert cfg == DataConfig()
    assert (cfg.split, cfg.tokenizer_type, cfg.vocab_size) == (
        "969,30,1",
        "SentencePieceTokenizer",
        8192,
    )
    assert cfg.trains_tokenizer and cfg.blend is None
    cfg = _parse(["--data-path", "0.3", "a", "0.7", "b", "--tokenizer-model", "m.model"])
    assert cfg.data_path == ("0.3", "a", "0.7", "b")
    assert cfg.blend == (["a", "b"], [0.3, 0.7])
    assert _parse(["--data-path", "a", "b", "--tokenizer-model", "m"]).blend == (["a", "b"], None)
    assert parse_blend(("a",)) == (["a"], None)


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json"], "--merge-file"),
        (["--tokenizer-type", "GPT2BPETokenizer"], "--vocab-file"),
        (["--vocab-file", "v.json"], "--vocab-file"),
        (["--data-path", "a", "--data-files", "x.txt"], "--data-files"),
        (["--data-path", "a"], "--tokenizer-model"),
        (["--data-path", "0.5", "a", "b", "--tokenizer-model", "m"], "--data-path"),
        (["--data-path", "1", "a", "b", "c", "--tokenizer-model", "m"], "--data-path"),
        (["--data-path", "0", "a", "0", "b", "--tokenizer-model", "m"], "--data-path"),
        (["--data-path", "a.bin", "--tokenizer-model", "m"], "--data-path"),
        (["--split", "90,5,4,1"], "--split"),
        (["--split", "0,0,0"], "--split"),
        (["--vocab-size", "100"], "--vocab-size"),
    ],
)
def test_invalid_combinations_name_the_flag(argv, flag):
    with pytest.raises(ConfigError) as info:
        _parse(argv)
    assert flag in info.value.flags


def test_cache_dir_default(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "c"))
    assert default_cache_dir() == str(tmp_path / "c")
    assert DataConfig().cache_dir == str(tmp_path / "c")
    assert DataConfig(data_cache_path=str(tmp_path / "d")).cache_dir == str(tmp_path / "d")
    monkeypatch.delenv(CACHE_ENV_VAR)
    assert default_cache_dir().endswith(os.path.join(".cache", "megatron_ext"))


def test_readers_all_formats(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("line one\nline two\n", encoding="utf-8")
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text(
        "\n".join(json.dumps({"body": t, "n": i}) for i, t in enumerate(["x", None, "y"])),
        encoding="utf-8",
    )
    js = tmp_path / "c.json"
    js.write_text(json.dumps([{"body": "z"}]), encoding="utf-8")
    gz = tmp_path / "d.jsonl.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"body": "compressed"}) + "\n")
    files = [str(txt), str(jsonl), str(js), str(gz)]
    docs = list(iter_file_documents(files, "body", hf_cache_dir=str(tmp_path / "hf")))
    # The .txt file is one document; null rows are skipped; file order is kept.
    assert docs == ["line one\nline two\n", "x", "y", "z", "compressed"]

    pq = tmp_path / "e.parquet"
    import datasets

    datasets.Dataset.from_dict({"text": ["p1", "p2"]}).to_parquet(str(pq))
    assert list(iter_file_documents([str(pq)], hf_cache_dir=str(tmp_path / "hf"))) == [
        "p1",
        "p2",
    ]


def test_readers_errors(tmp_path):
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text(json.dumps({"text": 3}) + "\n", encoding="utf-8")
    hf = str(tmp_path / "hf")
    with pytest.raises(ConfigError, match="no such file") as info:
        list(iter_file_documents([str(tmp_path / "missing.jsonl")], hf_cache_dir=hf))
    assert info.value.flags == ("--data-files",)
    with pytest.raises(ConfigError, match="is not a file"):
        list(iter_file_documents([str(tmp_path)], hf_cache_dir=hf))
    (tmp_path / "x.docx").write_text("x")
    with pytest.raises(ConfigError, match="unsupported file type '.docx'"):
        list(iter_file_documents([str(tmp_path / "x.docx")], hf_cache_dir=hf))
    with pytest.raises(ConfigError, match="no column 'body'") as info:
        list(iter_file_documents([str(jsonl)], "body", hf_cache_dir=hf))
    assert info.value.flags == ("--data-text-key",)
    with pytest.raises(ConfigError, match="not text"):
        list(iter_file_documents([str(jsonl)], "text", hf_cache_dir=hf))


def test_files_fingerprint_tracks_content(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("one", encoding="utf-8")
    key = files_fingerprint([str(f)], "text")
    assert files_fingerprint([str(f)], "text") == key
    assert files_fingerprint([str(f)], "body") != key
    f.write_text("one two", encoding="utf-8")
    assert files_fingerprint([str(f)], "text") != key


def test_build_once(tmp_path):
    target = str(tmp_path / "entry")
    calls = []

    def build(tmp_dir):
        calls.append(tmp_dir)
        with open(os.path.join(tmp_dir, "data"), "w") as f:
            f.write("payload")
        return {"n": 1}

    marker = build_once(target, build)
    assert marker["built_here"] and marker["info"] == {"n": 1}
    assert marker["built_by_pid"] == os.getpid()
    again = build_once(target, build)
    assert not again["built_here"] and len(calls) == 1
    assert open(os.path.join(target, "data")).read() == "payload"
    assert sorted(os.listdir(tmp_path)) == [".entry.lock", "entry"]

    def failing(tmp_dir):
        open(os.path.join(tmp_dir, "partial"), "w").close()
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        build_once(str(tmp_path / "broken"), failing)
    assert not is_built(str(tmp_path / "broken"))
    assert not any(n.startswith(".broken.tmp") for n in os.listdir(tmp_path))
    assert not os.path.exists(os.path.join(tmp_path, "broken", MARKER_NAME))
