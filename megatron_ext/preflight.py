"""Checks of a Megatron-LM launch made once per node, before ``torchrun`` starts any rank.

What it does:
    ``python -m megatron_ext.preflight [--config FILE] [--nodes N]
    [--gpus-per-node G] [--dry-run] [--null] -- [ARGS...]`` prints the arguments
    ``pretrain_gpt.py`` gets (NUL-separated with ``--null``, else one shell-quoted line) and
    says on stderr what it changed and what the run needs. ``scripts/pretrain_gpt_ext.sh``
    calls it on every node (its ``DRY_RUN=1`` prints the result instead of launching):

    1. **arguments**: the run file's (:func:`~megatron_ext.runfile.
       run_file_args`), then ``ARGS``, which override them (argparse keeps the last value);
    2. **resume** (:func:`resume_args`): when the last ``--save`` directory holds
       ``latest_checkpointed_iteration.txt``, the run continues from it: every ``--load`` is
       replaced by ``--load <save>`` and ``--finetune`` is dropped. A requeued or restarted
       job thus resumes from its own checkpoints whatever the run file's initial ``load`` /
       ``finetune`` (AQ-SGD's run file fine-tunes a pretrained GPT-2 XL the first time);
    3. **layout** (:func:`check_layout`): nodes x GPUs per node must be a whole, non-zero
       number of ``TP x CP x PP`` model replicas, and the global batch a multiple of
       micro-batch x data-parallel size; multi-node launches need ``NODE_RANK`` and a
       ``MASTER_ADDR`` other than localhost (checked by the shell script);
    4. **Megatron-LM defaults that fail late** (:func:`check_megatron_lm_defaults`): a
       missing ``--eval-interval``, which Megatron-LM divides by after the model is built;
    5. **inputs** (:func:`check_inputs`): the ``--data-path`` prefixes' ``.bin`` / ``.idx``,
       ``--vocab-file``, ``--merge-file``, a SentencePiece ``--tokenizer-model`` and the
       ``--load`` directory of a ``--finetune`` run exist;
    6. **memory** (:func:`memory_needs`): AQ-SGD's per-sample buffers, per node (host or
       disk) or per GPU (device), from :func:`megatron_ext.memory.aqsgd_buffer_plan`
       (the codec's and ``benchmarks/state_memory.py``'s computation).
       Printed always; outside a dry run the node's available host memory
       (``MemAvailable``) or the buffer directory's free space is compared, and the launch
       refused when it is smaller. Grass's and Protocol Models' state per GPU
       (:func:`method_state_needs`: :func:`megatron_ext.state_plan.grass_plan` /
       ``protocol_plan`` on :func:`model_shape`, the model the run's flags describe) is
       printed too, with what Grass saves against the dense gradient and Adam state of the
       weights it projects; a Grass rank the shape cannot take is refused here.

Why:
    A run that cannot work should stop before a multi-node job waits in a queue, starts
    64 processes and fails in one of them: with the reason, the flag and the figure.

Constraints:
    Never imports Megatron, and torch only to size AQ-SGD's buffers: it runs on every node
    before torchrun and in every dry run, so it stays outside ``megatron_ext.megatron``
    (whose import brings torch). megatron-ext's own flags come from its config dataclasses,
    for their defaults; Megatron-LM's flags are read with a small parser of the few it
    needs, and Megatron-LM's own parser still validates everything at start. Exit code 2 on
    refusal.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

# Re-exported: preflight reports it, and callers have found it here.
from megatron_ext.validation import available_host_memory

__all__ = [
    "PreflightError",
    "resume_args",
    "check_layout",
    "check_megatron_lm_defaults",
    "check_save_interval",
    "check_inputs",
    "memory_needs",
    "method_state_needs",
    "model_shape",
    "available_host_memory",
    "main",
]

CHECKPOINT_TRACKER = "latest_checkpointed_iteration.txt"
"""The file Megatron-LM writes in ``--save`` after each checkpoint."""


class PreflightError(ValueError):
    """A launch that cannot work; the message names the flag or variable to change."""


class _SubsetParser(argparse.ArgumentParser):
    """argparse whose errors raise :class:`PreflightError` (one line, printed once by the
    caller) instead of printing this small parser's usage and exiting on every rank."""

    def error(self, message: str):
        raise PreflightError(message)


def _megatron_subset(args: Sequence[str]) -> argparse.Namespace:
    """The few Megatron-LM flags the checks read (the last value of each wins).

    Raises:
        PreflightError: a value of one of them that does not parse (``--lr 1e-3x``).
    """
    p = _SubsetParser(add_help=False, allow_abbrev=False)
    for flag, default in [
        ("--tensor-model-parallel-size", 1),
        ("--pipeline-model-parallel-size", 1),
        ("--context-parallel-size", 1),
        ("--micro-batch-size", None),
        ("--global-batch-size", None),
        ("--seq-length", None),
        ("--hidden-size", None),
        ("--num-layers", None),
        ("--ffn-hidden-size", None),
        ("--num-attention-heads", None),
        ("--num-query-groups", None),
        ("--kv-channels", None),
        ("--vocab-size", None),
        ("--make-vocab-size-divisible-by", 128),
        ("--eval-interval", None),
        ("--save-interval", None),
        ("--train-iters", None),
        ("--train-samples", None),
    ]:
        p.add_argument(flag, type=int, default=default)
    for flag in (
        "--bf16",
        "--fp16",
        "--sequence-parallel",
        "--use-tp-pp-dp-mapping",
        "--finetune",
        "--group-query-attention",
        "--swiglu",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--skip-train",
        "--full-validation",
    ):
        p.add_argument(flag, action="store_true")
    p.add_argument("--position-embedding-type", default="learned_absolute")
    for flag in ("--save", "--load", "--vocab-file", "--merge-file", "--tokenizer-type"):
        p.add_argument(flag)
    p.add_argument("--tokenizer-model")
    p.add_argument("--lr", type=float)
    p.add_argument("--mock-data", action="store_true")
    for flag in ("--data-path", "--train-data-path"):
        p.add_argument(flag, nargs="*")
    for flag in ("--data-args-path", "--per-split-data-args-path", "--yaml-cfg"):
        p.add_argument(flag)
    return p.parse_known_args(list(args))[0]


def _ext_args(args: Sequence[str]) -> argparse.Namespace:
    """megatron-ext's flags with their defaults (the config dataclasses'), and the data flag
    ``--fixed-samples`` that Megatron-LM runs get from megatron-ext (default None)."""
    from megatron_ext.config import add_args

    parser = add_args(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
    parser.add_argument("--fixed-samples", type=int, default=None)
    return parser.parse_known_args(list(args))[0]


def resume_args(args: Sequence[str]) -> Tuple[List[str], Optional[str]]:
    """``args`` resuming from the run's own checkpoints when ``--save`` holds one.

    Returns:
        The arguments, and a note saying what changed (None when nothing did).
    """
    save = _megatron_subset(args).save
    if not save or not os.path.isfile(os.path.join(save, CHECKPOINT_TRACKER)):
        return list(args), None
    with open(os.path.join(save, CHECKPOINT_TRACKER), encoding="utf-8") as f:
        iteration = f.read().strip()
    out: List[str] = []
    dropped: List[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--finetune":
            dropped.append(arg)
        elif arg == "--load":
            dropped += args[i : i + 2]
            i += 1
        elif arg.startswith("--load="):
            dropped.append(arg)
        else:
            out.append(arg)
        i += 1
    out += ["--load", save]
    note = f"resuming from this run's checkpoint in {save} (iteration {iteration}): --load {save}"
    if dropped:
        note += f" (instead of {shlex.join(dropped)})"
    return out, note


def check_layout(args: Sequence[str], nodes: int, gpus_per_node: int) -> int:
    """Refuse a layout the nodes cannot hold; returns the data-parallel size.

    Raises:
        PreflightError: naming the flags and ``NNODES`` / ``GPUS_PER_NODE``.
    """
    a = _megatron_subset(args)
    tp, pp, cp = (
        a.tensor_model_parallel_size,
        a.pipeline_model_parallel_size,
        a.context_parallel_size,
    )
    world = nodes * gpus_per_node
    model = tp * pp * cp
    if world < model or world % model:
        raise PreflightError(
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} x "
            f"--context-parallel-size {cp} = {model} ranks per model replica, but NNODES "
            f"{nodes} x GPUS_PER_NODE {gpus_per_node} = {world} ranks "
            + ("is fewer" if world < model else "is not a multiple of it")
            + f": use {-(-model // gpus_per_node)} or more nodes (a multiple of "
            f"{model} ranks in all) or smaller parallel sizes"
        )
    dp = world // model
    if a.global_batch_size and a.micro_batch_size:
        if a.global_batch_size % (a.micro_batch_size * dp):
            raise PreflightError(
                f"--global-batch-size {a.global_batch_size} is not a multiple of "
                f"--micro-batch-size {a.micro_batch_size} x data-parallel size {dp} "
                f"({world} ranks / {model} per replica)"
            )
    return dp


# Tokenizers and what Megatron-LM's build_tokenizer asserts (without a message) for each,
# after the arguments are printed and before the model is built.
_TOKENIZER_NEEDS = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "BertWordPieceLowerCase": ("vocab_file",),
    "BertWordPieceCase": ("vocab_file",),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",),
    "HuggingFaceTokenizer": ("tokenizer_model",),
    "TikTokenizer": ("tokenizer_model",),
    "NullTokenizer": ("vocab_size",),
}

# What gives pretrain_gpt.py its training data (any one of them).
_DATA_SOURCES = (
    "mock_data",
    "data_path",
    "train_data_path",
    "data_args_path",
    "per_split_data_args_path",
)


def _flag(attribute: str) -> str:
    return "--" + attribute.replace("_", "-")


def check_megatron_lm_defaults(a: Any) -> None:
    """Refuse Megatron-LM flags left at a default that fails only after start-up.

    ``a`` is :func:`_megatron_subset` of an argument list (the pre-flight, the zero-touch
    launcher) or Megatron-LM's own parsed arguments (a patched ``pretrain_gpt.py``); an
    attribute it lacks counts as unset. Measured on core_v0.16.1 and core_v0.19.0, a tiny GPT
    launched without each flag in turn:

    * ``--eval-interval`` (default None): Megatron-LM sizes the validation split as
      ``train_iters // eval_interval`` in ``get_train_valid_test_num_samples``, after the
      model is built (``TypeError: unsupported operand type(s) for //: 'int' and
      'NoneType'`` on every rank), unless it skips training or validates on the whole split;
    * ``--train-iters`` / ``--train-samples`` (both None): "either train-iters or
      train-samples should be provided" once the model is built;
    * ``--lr`` (None): the learning-rate scheduler compares it with ``--min-lr`` once the
      model is built (``TypeError: '<=' not supported between instances of 'float' and
      'NoneType'``);
    * no training data (``--data-path``, ``--train-data-path``, ``--data-args-path``,
      ``--per-split-data-args-path`` or ``--mock-data``): "GPTDataset failed to build as a
      mock data generator" once the model is built;
    * ``--save`` without ``--save-interval`` (None): a bare ``AssertionError`` in Megatron-LM's
      ``validate_args`` (:func:`check_save_interval`, which a patched ``pretrain_gpt.py``
      runs before that check);
    * a tokenizer without its files (``--tokenizer-type`` defaults to GPT2BPETokenizer in
      ``pretrain_gpt.py``, which needs ``--vocab-file`` and ``--merge-file``; NullTokenizer
      needs ``--vocab-size``; the SentencePiece, Llama2, HuggingFace and TikToken ones
      ``--tokenizer-model``): a bare ``AssertionError`` in ``build_tokenizer``.

    Every problem found is named, in one line. With ``--yaml-cfg`` the arguments come from
    that file: only Megatron-LM's parsed arguments can be checked.

    Raises:
        PreflightError: naming each flag and what to give.
    """
    if getattr(a, "yaml_cfg", None):
        # The arguments come from that file: the session checks them once parsed.
        return
    problems = []
    training = not getattr(a, "skip_train", False)
    if training and getattr(a, "eval_interval", None) is None:
        if not getattr(a, "full_validation", False):
            problems.append(
                "--eval-interval: Megatron-LM needs it to size the validation split (its "
                "default, None, fails after start-up): give --eval-interval N, e.g. "
                "--eval-interval 1000 --eval-iters 10"
            )
    if training and getattr(a, "train_iters", None) is None:
        if getattr(a, "train_samples", None) is None:
            problems.append(
                "--train-iters: Megatron-LM needs the run's length (None fails once the model "
                "is built): give --train-iters N (or --train-samples N)"
            )
    if getattr(a, "lr", None) is None:
        problems.append(
            "--lr: Megatron-LM has no default learning rate (None fails once the model is "
            "built): give --lr, e.g. --lr 3e-4"
        )
    if training and not any(getattr(a, name, None) for name in _DATA_SOURCES):
        problems.append(
            "--data-path: no training data: give --data-path PREFIX (or --train-data-path, "
            "--data-args-path, --per-split-data-args-path), or --mock-data"
        )
    save_interval = _save_interval_problem(a)
    if save_interval:
        problems.append(save_interval)
    tokenizer = getattr(a, "tokenizer_type", None) or "GPT2BPETokenizer"
    missing = [n for n in _TOKENIZER_NEEDS.get(tokenizer, ()) if getattr(a, n, None) is None]
    if missing:
        problems.append(
            f"--tokenizer-type {tokenizer}: needs {' and '.join(map(_flag, missing))}"
            + ("" if getattr(a, "tokenizer_type", None) else " (pretrain_gpt.py's default)")
        )
    if problems:
        raise PreflightError("; ".join(problems))


def _save_interval_problem(a: Any) -> Optional[str]:
    if getattr(a, "save", None) and getattr(a, "save_interval", None) is None:
        return (
            "--save-interval: Megatron-LM needs it with --save (without it, a bare "
            "AssertionError in its validate_args): give --save-interval N, e.g. "
            "--save-interval 1000"
        )
    return None


def check_save_interval(a: Any) -> None:
    """Refuse ``--save`` without ``--save-interval``, which Megatron-LM's ``validate_args``
    stops with a bare ``AssertionError``.

    Raises:
        PreflightError: naming ``--save-interval``.
    """
    problem = _save_interval_problem(a)
    if problem:
        raise PreflightError(problem)


def check_inputs(args: Sequence[str]) -> None:
    """Refuse inputs that do not exist (data, tokenizer files, the model to fine-tune).

    Raises:
        PreflightError: naming the flag and the path.
    """
    a = _megatron_subset(args)
    missing = []
    for prefix in a.data_path or []:
        try:
            float(prefix)  # a blend weight
            continue
        except ValueError:
            pass
        for ext in (".bin", ".idx"):
            if not os.path.isfile(prefix + ext):
                missing.append(f"--data-path {prefix}: {prefix}{ext} not found")
    for flag, path in [("--vocab-file", a.vocab_file), ("--merge-file", a.merge_file)]:
        if path and not os.path.exists(path):
            missing.append(f"{flag} {path}: not found")
    if a.tokenizer_type == "SentencePieceTokenizer" and a.tokenizer_model:
        if not os.path.exists(a.tokenizer_model):
            missing.append(f"--tokenizer-model {a.tokenizer_model}: not found")
    if a.finetune and a.load and not os.path.isdir(a.load):
        missing.append(f"--load {a.load} (loaded with --finetune): no such directory")
    if missing:
        raise PreflightError("; ".join(missing))


def _free_disk(directory: str) -> Optional[int]:
    path = os.path.abspath(directory)
    while path and not os.path.isdir(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return shutil.disk_usage(path).free


def model_shape(args: Sequence[str]):
    """The model Megatron-LM builds from ``args``
    (:class:`megatron_ext.state_plan.ModelShape`); None without ``--num-layers``,
    ``--hidden-size`` or ``--num-attention-heads``. The vocabulary is padded as Megatron-LM
    pads it; it is known from ``--vocab-size`` or a ``--tokenizer-type`` whose size is
    fixed (GPT2BPETokenizer), else None (a tokenizer model decides it when it loads)."""
    from megatron_ext.state_plan import TOKENIZER_VOCAB, ModelShape, padded_vocab

    a = _megatron_subset(args)
    if not (a.num_layers and a.hidden_size and a.num_attention_heads):
        return None
    vocab = a.vocab_size or TOKENIZER_VOCAB.get(a.tokenizer_type or "")
    if vocab:
        vocab = padded_vocab(vocab, a.make_vocab_size_divisible_by, a.tensor_model_parallel_size)
    ffn = a.ffn_hidden_size
    if ffn is None:  # Megatron-LM's default
        h = a.hidden_size
        ffn = int((4 * h * 2 / 3) / 64) * 64 if a.swiglu else 4 * h
    return ModelShape(
        num_layers=a.num_layers,
        hidden=a.hidden_size,
        heads=a.num_attention_heads,
        ffn=ffn,
        vocab=vocab,
        seq=a.seq_length or 0,
        kv_heads=a.num_query_groups if a.group_query_attention else None,
        kv_channels=a.kv_channels,
        swiglu=a.swiglu,
        bias=not a.disable_bias_linear,
        learned_positions=a.position_embedding_type == "learned_absolute",
        untied=a.untie_embeddings_and_output_weights,
    )


def method_state_needs(args: Sequence[str]) -> List[Dict[str, object]]:
    """Grass's and Protocol Models' state per GPU (device needs), from
    :func:`megatron_ext.state_plan.grass_plan` / ``protocol_plan`` on the run's model shape.

    Raises:
        PreflightError: a Grass rank the model's shape or TP layout cannot take.
    """
    ext = _ext_args(args)
    grass = ext.grass_method != "none"
    protocol = ext.subspace_method == "protocol"
    if not (grass or protocol):
        return []
    shape = model_shape(args)
    if shape is None:
        return []
    from megatron_ext.state_plan import format_bytes as fb, grass_plan, protocol_plan

    a = _megatron_subset(args)
    dtype = "bf16" if a.bf16 else "fp16" if a.fp16 else "fp32"
    tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    needs: List[Dict[str, object]] = []
    if grass:
        try:
            plan = grass_plan(
                shape,
                rank=ext.grass_rank,
                method=ext.grass_method,
                sketch_size=ext.grass_sketch_size,
                layers=ext.grass_layers,
                params_dtype=dtype,
                tensor_parallel=tp,
                pipeline_parallel=pp,
            )
        except ValueError as exc:
            raise PreflightError(str(exc)) from None
        what = (
            f"Grass state ({len(plan.weights)} projected weights a stage, r={ext.grass_rank} "
            f"per part: virtual parameters {plan.virtual_elements / 1e6:.2f}M x "
            f"{plan.bytes_per_virtual} B ({dtype} + gradient + Adam) = "
            f"{fb(plan.virtual_bytes)}, selection {fb(plan.selection_bytes)}, sketches at a "
            f"selection step {fb(plan.sketch_bytes)} + {fb(plan.sketch_reduce_bytes)} "
            f"all-reduced); saves ~{fb(plan.saved)} against the "
            f"dense gradient and Adam state of those weights ({plan.projected_elements / 1e6:.2f}M"
            f" x {plan.bytes_per_dense} B = {fb(plan.dense_bytes)})"
        )
        needs.append(dict(where="device", nbytes=plan.total, what=what, flags="--grass-rank"))
    if protocol:
        from megatron_ext.config import config_from_args
        from megatron_ext.methods.protocol import SubspaceConfig

        cfg = config_from_args(SubspaceConfig, ext)
        k = cfg.rank_for(shape.hidden)
        sub = protocol_plan(
            shape, k=k, update_interval=cfg.update_interval, params_dtype=dtype,
            pipeline_parallel=pp,
        )  # fmt: skip
        d = shape.hidden
        if sub.fixed_bytes is None:
            fixed = (
                f"T_fixed {fb(sub.fixed_bytes_per_row)} per vocabulary row (not counted: the "
                f"vocabulary is {a.tokenizer_type}'s, known when it loads)"
            )
        else:
            fixed = f"T_fixed {shape.vocab} x {d} x {sub.fixed_bytes_per_row // d} B = " + fb(
                sub.fixed_bytes
            )
        acc = ""
        if sub.accumulator_bytes:
            acc = (
                f"; the last stage's Grassmann accumulator A and staged g^T g 2 x {d}^2 x 4 B"
                f" = {fb(sub.accumulator_bytes)}"
            )
        what = (
            f"Protocol Models state (k={k} of d={d}: U {d} x {k} x 4 B = {fb(sub.u_bytes)} "
            f"and {fixed} on each of {pp} stage{'s' if pp > 1 else ''}{acc})"
        )
        needs.append(
            dict(where="device", nbytes=sub.per_gpu_max, what=what, flags="--subspace-rank")
        )
    return needs


def memory_needs(args: Sequence[str], nodes: int, gpus_per_node: int) -> List[Dict[str, object]]:
    """What the run keeps beyond the model and optimizer, per node or per GPU.

    Returns:
        One entry per need: ``where`` ("host", "disk" or "device"), ``nbytes`` (per node for
        host and disk, per GPU for device), ``what`` (a sentence), ``flags`` (to change it)
        and ``directory`` (disk).
    """
    needs = method_state_needs(args)
    ext = _ext_args(args)
    if ext.p2p_compression != "aqsgd" or not ext.fixed_samples:
        return needs
    a = _megatron_subset(args)
    if not a.seq_length or not a.hidden_size:
        return needs
    import torch

    from megatron_ext.collectives.aqsgd import format_bytes
    from megatron_ext.memory import aqsgd_buffer_plan

    dtype = torch.bfloat16 if a.bf16 else torch.float16 if a.fp16 else torch.float32
    plan = aqsgd_buffer_plan(
        num_samples=ext.fixed_samples,
        seq_length=a.seq_length,
        hidden_size=a.hidden_size,
        activation_dtype=dtype,
        buffer_dtype=ext.aqsgd_buffer_dtype,
        tensor_parallel=a.tensor_model_parallel_size,
        pipeline_parallel=a.pipeline_model_parallel_size,
        context_parallel=a.context_parallel_size,
        sequence_parallel=a.sequence_parallel,
        world_size=nodes * gpus_per_node,
        ranks_per_node=gpus_per_node,
        tp_pp_dp_mapping=a.use_tp_pp_dp_mapping,
    )
    where = ext.aqsgd_buffer
    side = (
        f"{plan.slots} samples per data-parallel rank x {plan.rows} tokens x "
        f"{a.hidden_size} x {plan.itemsize} B = {format_bytes(plan.per_side)} per boundary side"
    )
    flags = "--aqsgd-buffer, --fixed-samples, more data-parallel ranks"
    if where == "device":
        return needs + [
            dict(
                where="device",
                nbytes=plan.per_rank_max,
                what=f"AQ-SGD buffers ({side}, 2 sides on a middle stage)",
                flags=flags,
            )
        ]
    place = "host memory" if where == "host" else f"disk in {ext.aqsgd_buffer_dir}"
    return needs + [
        dict(
            where=where,
            nbytes=plan.per_node_max,
            what=f"AQ-SGD buffers in {place} ({side}; {gpus_per_node} ranks a node)",
            flags=flags + (", --aqsgd-buffer-dir" if where == "disk" else ""),
            directory=ext.aqsgd_buffer_dir,
        )
    ]


def _report_memory(needs, dry_run: bool) -> None:
    if not needs:
        return
    from megatron_ext.state_plan import format_bytes

    for need in needs:
        unit = "per GPU" if need["where"] == "device" else "per node"
        kind = {"host": "host memory", "disk": "disk", "device": "GPU memory"}[need["where"]]
        print(
            f"megatron-ext: needs ~{format_bytes(need['nbytes'])} of {kind} {unit} for "
            f"{need['what']}",
            file=sys.stderr,
        )
        if dry_run:
            continue
        if need["where"] == "host":
            free, what = available_host_memory(), "available memory on this node"
        elif need["where"] == "disk":
            free, what = _free_disk(need["directory"] or "."), f"free in {need['directory']}"
        else:
            continue  # the codec checks the GPU's free memory at install
        if free is not None and need["nbytes"] > free:
            raise PreflightError(
                f"{need['what']}: need ~{format_bytes(need['nbytes'])} {unit} but "
                f"{format_bytes(free)} is {what}; change {need['flags']}"
            )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point; returns the exit code (2: refused)."""
    from megatron_ext.runfile import RunFileError, print_args, run_file_args

    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m megatron_ext.preflight",
        description="Check a Megatron-LM launch and print pretrain_gpt.py's arguments.",
    )
    parser.add_argument("--config", default="", help="run file (YAML), read first")
    parser.add_argument("--nodes", type=int, default=1, help="nodes (NNODES)")
    parser.add_argument("--gpus-per-node", type=int, default=1, help="ranks per node")
    parser.add_argument("--dry-run", action="store_true", help="print needs, do not compare")
    parser.add_argument("--null", action="store_true", help="NUL-separated output")
    opts = parser.parse_args(argv)
    try:
        if opts.nodes < 1 or opts.gpus_per_node < 1:
            raise PreflightError(
                f"NNODES ({opts.nodes}) and GPUS_PER_NODE ({opts.gpus_per_node}) must be >= 1"
            )
        args = (run_file_args(opts.config) if opts.config else []) + extra
        if opts.config:
            print(f"megatron-ext: run file {opts.config}", file=sys.stderr)
        args, note = resume_args(args)
        if note:
            print(f"megatron-ext: {note}", file=sys.stderr)
        check_layout(args, opts.nodes, opts.gpus_per_node)
        check_megatron_lm_defaults(_megatron_subset(args))
        check_inputs(args)
        _report_memory(memory_needs(args, opts.nodes, opts.gpus_per_node), opts.dry_run)
    except (OSError, RunFileError, PreflightError) as exc:
        print(f"megatron-ext: error: {exc}", file=sys.stderr)
        return 2
    print_args(args, opts.null)
    return 0


if __name__ == "__main__":
    sys.exit(main())
