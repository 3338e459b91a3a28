"""``--tokenizer-type HuggingFaceTokenizer``: prepare-data and the driver's tokenizer.

The run file ``configs/megatron_lm/llama_8b_protocol_64gpu.yaml`` trains with Megatron-LM's
``HuggingFaceTokenizer`` (LLaMA-3's) and tells the user to make its data with
``megatron-ext prepare-data --tokenizer-type HuggingFaceTokenizer``. Checked here without a
network: a byte-level BPE tokenizer is trained locally with ``tokenizers`` and saved with
``save_pretrained``; it prepends a beginning-of-text token as LLaMA-3's does. The indexed
dataset must hold exactly what Megatron-LM's ``HuggingFaceTokenizer.tokenize`` gives
(``tokenizer(text).input_ids``) plus the end-of-sequence id per document; the tokenizer
pickles (for ``--workers``) by reloading the same folder. Without ``transformers`` the command stops before reading anything,
naming the flag and the extra (that part runs everywhere; the rest needs ``transformers``,
which the ``test`` extra installs).
"""

import importlib.util
import json

import pytest

from megatron_ext.config import ConfigError
from megatron_ext.data.config import DataConfig, TokenizerConfig

DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "def main():\n    return 42\n",
    "Megatron-LM trains GPT and LLaMA models with tensor, pipeline and data parallelism.",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich. 日本語も。",
] + [f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 7 + 1) for i in range(40)]


def _write_inputs(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps({"text": d}) for d in DOCS) + "\n", encoding="utf-8")
    return path


def test_huggingface_tokenizer_needs_a_model_flag():
    with pytest.raises(ConfigError) as info:
        TokenizerConfig(tokenizer_type="HuggingFaceTokenizer")
    assert info.value.flags == ("--tokenizer-type", "--tokenizer-model")
    with pytest.raises(ConfigError, match="--vocab-file"):
        TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="x", vocab_file="v")


def test_prepare_data_without_transformers_names_the_extra_before_reading(
    tmp_path, monkeypatch, capsys
):
    from megatron_ext.megatron.prepare_data import main

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "transformers" else real_find_spec(name, *a),
    )
    out = tmp_path / "out" / "data"
    argv = ["--input", str(_write_inputs(tmp_path)), "--output-prefix", str(out)]
    argv += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path)]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--tokenizer-type: HuggingFaceTokenizer needs the transformers package" in err, err
    assert "pip install 'megatron-ext[hf]'" in err
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A LLaMA-3-like tokenizer folder: byte-level BPE, BOS prepended, EOS as end of text."""
    pytest.importorskip("transformers", reason="pip install 'megatron-ext[test]'")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[bos, eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(DOCS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)
    folder = tmp_path_factory.mktemp("hf-tokenizer")
    fast.save_pretrained(str(folder))
    return folder


def test_prepare_data_writes_megatron_lm_s_tokens(hf_folder, tmp_path, capsys):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import AutoTokenizer

    from megatron_ext.megatron.prepare_data import main

    reference = AutoTokenizer.from_pretrained(str(hf_folder))  # what Megatron-LM loads
    out = tmp_path / "out" / "data"
    argv = ["--input", str(_write_inputs(tmp_path)), "--output-prefix", str(out)]
    argv += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf_folder)]
    assert main(argv) == 0
    report = capsys.readouterr().out
    assert f"{len(DOCS)} documents" in report and "HuggingFaceTokenizer" in report
    dataset = IndexedDataset(str(out))
    assert len(dataset) == len(DOCS)
    for i, text in enumerate(DOCS):
        expected = reference(text).input_ids + [reference.eos_token_id]
        assert [int(t) for t in dataset[i]] == expected, i
    assert int(dataset[0][0]) == reference.bos_token_id


def test_driver_builds_the_same_tokenizer(hf_folder, tmp_path):
    import pickle

    from megatron_ext.data.tokenizers import HuggingFaceTokenizer
    from megatron_ext.megatron.data import build_tokenizer

    cfg = DataConfig(
        tokenizer_type="HuggingFaceTokenizer",
        tokenizer_model=str(hf_folder),
        data_path=(str(tmp_path / "data"),),
    )
    tokenizer = build_tokenizer(cfg)
    assert isinstance(tokenizer, HuggingFaceTokenizer)
    assert tokenizer.vocab_size == 400 and tokenizer.pad == -1
    ids = tokenizer.tokenize(DOCS[3])
    assert ids[0] == tokenizer.bos and tokenizer.detokenize(ids[1:]) == DOCS[3]
    clone = pickle.loads(pickle.dumps(tokenizer))
    assert clone.identity() == tokenizer.identity() and clone.tokenize(DOCS[1]) == (
        tokenizer.tokenize(DOCS[1])
    )
    with pytest.raises(ConfigError, match="--tokenizer-model"):
        build_tokenizer(
            TokenizerConfig(
                tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "none")
            )
        )
