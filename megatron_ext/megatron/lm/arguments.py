"""Megatron-LM's parsed arguments checked against megatron-ext's methods, before training.

What it does:
    :func:`check_megatron_lm_args` refuses the Megatron-LM options under which a
    megatron-ext hook could not do its job (checkpoint formats it cannot extend, CUDA graphs
    and TE userbuffers that bypass its seams, optimizers a method's update is not, a
    ``--load`` of a finished run, DiLoCo sites against Megatron-LM's own checks), naming the
    flag; :func:`layout_from_args` gives the :class:`~megatron_ext.config.ParallelLayout`
    the methods validate against.

Why its own module:
    These are decisions about one command line, made once after Megatron-LM's
    ``validate_args``; :mod:`megatron_ext.megatron.lm.session` is what happens at the
    seams during the run. Keeping them apart lets the checks be read (and tested) on their
    own.

Constraints:
    Reads the parsed ``args`` only (no process group, no model); raises
    :class:`~megatron_ext.config.ConfigError` naming the flags.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from megatron_ext.config import ConfigError, ExtConfig, ParallelLayout
from megatron_ext.preflight import CHECKPOINT_TRACKER
from megatron_ext.run_report import check_not_finished

__all__ = ["layout_from_args", "check_megatron_lm_args", "microbatches", "check_load_not_finished"]


def layout_from_args(args: Any) -> ParallelLayout:
    """The parallel layout from Megatron-LM's validated args (``data_parallel_size`` set)."""
    return ParallelLayout(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        data_parallel_size=args.data_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        use_distributed_optimizer=bool(args.use_distributed_optimizer),
        overlap_grad_reduce=bool(args.overlap_grad_reduce),
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        transformer_impl=args.transformer_impl,
        replica_hash_interval=args.check_weight_hash_across_dp_replicas_interval or 0,
        fixed_samples=getattr(args, "fixed_samples", None),
        per_token_loss=bool(args.calculate_per_token_loss),
        dataloader_type=args.dataloader_type,
    )


def microbatches(args: Any, dp_size: int) -> int:
    """Microbatches a step takes on one data-parallel rank (at the final global batch)."""
    return args.global_batch_size // (args.micro_batch_size * dp_size)


def check_megatron_lm_args(args: Any, cfg: ExtConfig) -> None:
    """Refuse Megatron-LM options under which a megatron-ext hook could not do its job.

    Raises:
        ConfigError: naming the Megatron-LM flag (and ours where both matter).
    """
    if (args.save or args.load) and args.ckpt_format not in ("torch_dist", "torch"):
        raise ConfigError(
            "--ckpt-format",
            f"megatron-ext keeps its per-rank state in 'torch_dist' and 'torch' checkpoints; "
            f"got {args.ckpt_format!r}",
        )
    if args.non_persistent_save_interval:
        raise ConfigError(
            "--non-persistent-save-interval",
            "megatron-ext state is saved in persistent checkpoints only (--save-interval)",
        )
    scope = [str(s) for s in (getattr(args, "cuda_graph_scope", None) or [])]
    if args.cuda_graph_impl == "local" and any("full_iteration" in s for s in scope):
        raise ConfigError(
            ["--cuda-graph-impl", "--cuda-graph-scope"],
            "a full-iteration CUDA graph replays the step without megatron-ext's per-step hooks",
        )
    if cfg.enabled("linear") and args.cuda_graph_impl != "none":
        raise ConfigError(
            ["--cuda-graph-impl", "--grass-method"],
            f"Grass cannot run inside CUDA graphs (--cuda-graph-impl {args.cuda_graph_impl}): "
            "it copies its row selection through the host while the layers run, which graph "
            "capture forbids, and a replayed graph would never see a new selection. Use "
            "--cuda-graph-impl none",
        )
    if getattr(args, "tp_comm_overlap", False) and cfg.comm.accounting:
        # TE's userbuffers move tensor-parallel activations outside torch.distributed, where
        # the byte meter cannot see them: the report would silently miss that traffic.
        raise ConfigError(
            ["--tp-comm-overlap", "--no-comm-accounting"],
            "Transformer Engine's userbuffer communication bypasses torch.distributed, so "
            "megatron-ext cannot count its bytes; run with --no-comm-accounting, or without "
            "--tp-comm-overlap to measure",
        )
    if cfg.method("grad") == "radius":
        # Radius ranks entries by AdamW's update from the optimizer's moments and fp32 master
        # weights. TE's precision-aware FusedAdam keeps scaled low-precision moments (read
        # through get_unscaled_state) and the master inside the optimizer, and the CPU
        # offload wrapper hides the AdamW mode: the selection would be silently wrong.
        flag = _optimizer_state_elsewhere(args)
        if flag is not None:
            raise ConfigError(
                ["--grad-compression", flag],
                "Radius reads the fp32 Adam moments and master weights of megatron's "
                "optimizer to choose its entries; with this flag they are kept elsewhere "
                "(scaled low-precision moments, or on the host behind a wrapper), so the "
                "selection would be wrong. Drop the flag or choose another method",
            )
    if cfg.enabled("linear"):
        check_grass_optimizer(args)
    from megatron_ext.megatron.lm.requirements import (
        check_local_spec_kernels,
        check_tokenizer_package,
    )

    check_tokenizer_package(getattr(args, "tokenizer_type", None))
    check_local_spec_kernels(
        transformer_impl=args.transformer_impl,
        half=bool(args.fp16 or args.bf16),
        masked_softmax_fusion=bool(args.masked_softmax_fusion),
        gradient_accumulation_fusion=bool(args.gradient_accumulation_fusion),
        persist_layer_norm=not getattr(args, "no_persist_layer_norm", True),
    )
    if getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False):
        flag = (
            "--use-torch-fsdp2"
            if getattr(args, "use_torch_fsdp2", False)
            else "--use-megatron-fsdp"
        )
        raise ConfigError(
            flag, "megatron-ext hooks megatron-core's DistributedDataParallel, not FSDP"
        )
    if cfg.enabled("linear"):
        # The model transform runs inside get_model's model provider, before Megatron-LM
        # moves the model to the GPU: rows Grass selects there must already be on it.
        for flag, attr in (
            ("--use-cpu-initialization", "use_cpu_initialization"),
            ("--init-model-with-meta-device", "init_model_with_meta_device"),
        ):
            if getattr(args, attr, False) and torch.cuda.is_available():
                raise ConfigError(
                    ["--grass-method", flag],
                    "Grass adds its virtual parameters and selected rows while the model is "
                    "built, on the weights' device; with this flag the weights are not on "
                    "the GPU yet. Drop the flag",
                )
    fixed = getattr(args, "fixed_samples", None)
    if fixed is not None:
        if fixed <= 0:
            raise ConfigError("--fixed-samples", f"must be > 0, got {fixed}")
        if args.dataloader_type not in (None, "single"):
            raise ConfigError(
                ["--fixed-samples", "--dataloader-type"],
                f"fixed-sample mode replaces the 'single' sampler; got --dataloader-type "
                f"{args.dataloader_type}",
            )
        from megatron_ext.megatron.data import fixed_sample_sampler

        dp = args.data_parallel_size
        fixed_sample_sampler(
            fixed,
            args.micro_batch_size,
            microbatches(args, dp),
            0,
            dp,
            args.seed,
        )
    elif cfg.enabled("p2p") and cfg.method("p2p") == "aqsgd":
        raise ConfigError(
            ["--p2p-compression", "--fixed-samples"],
            "aqsgd keeps an activation per training sample and needs a sample id to mean "
            "the same tokens in every epoch; Megatron-LM's GPTDataset repacks documents per "
            "epoch. Add --fixed-samples N (epochs over the first N training samples)",
        )


def check_load_not_finished(args: Any) -> None:
    """Refuse ``--load`` of a run already at ``--train-iters`` (Megatron-LM would load it,
    train nothing and the report would be rewritten), unless it is loaded to fine-tune or
    to evaluate (``--finetune``, ``--skip-train``).

    Raises:
        ConfigError: naming ``--load``, ``--train-iters`` and the flags that extend a run.
    """
    load = getattr(args, "load", None)
    if not load or getattr(args, "skip_train", False):
        return
    iteration = getattr(args, "ckpt_step", None)
    if iteration is None:
        try:
            with open(os.path.join(load, CHECKPOINT_TRACKER), encoding="utf-8") as f:
                text = f.read().strip()
        except OSError:
            return
        iteration = int(text) if text.isdigit() else None
    check_not_finished(
        load, iteration, getattr(args, "train_iters", None), finetune=bool(args.finetune)
    )


def check_grass_optimizer(args: Any) -> None:
    """Grass's update is decoupled AdamW's: refuse every other optimizer, naming the flag.

    Megatron-LM's ``--optimizer adam`` builds AdamW (torch's ``AdamW``, or TE's / Apex's
    ``FusedAdam`` in ``adam_w_mode``) while ``decoupled_weight_decay`` stays at its default
    (True); 0.16 and 0.19 have no flag for it, only a ``--yaml-cfg`` could set it.
    """
    optimizer = getattr(args, "optimizer", "adam")
    why = (
        "Grass's update is decoupled AdamW's (the paper's Adam on the selected rows; the row "
        "decay, the bias correction and the moments a reselection moves or zeroes are "
        "AdamW's)"
    )
    if optimizer != "adam":
        raise ConfigError(
            ["--grass-method", "--optimizer"],
            f"{why}; got --optimizer {optimizer}. Use --optimizer adam",
        )
    if getattr(args, "decoupled_weight_decay", True) is False:
        flag = "--yaml-cfg" if getattr(args, "yaml_cfg", None) else "decoupled_weight_decay"
        raise ConfigError(
            ["--grass-method", flag],
            f"{why}; got decoupled_weight_decay=False (Adam with L2 weight decay, which would "
            "put the decay into the moments of V, the change since the selection)",
        )
    flag = _optimizer_state_elsewhere(args)
    if flag is not None:
        raise ConfigError(
            ["--grass-method", flag],
            f"{why} with fp32 moments next to megatron's fp32 main parameters; with this "
            "flag they are kept elsewhere (scaled low-precision moments and master "
            "weights inside TE's FusedAdam, or on the host behind a wrapper), where a "
            "reselection cannot zero or move them. Drop the flag",
        )


def _optimizer_state_elsewhere(args: Any) -> Optional[str]:
    """The first flag set in ``args`` that keeps Adam's moments and master weights outside
    megatron's fp32 optimizer state (TE's precision-aware FusedAdam, the CPU offload
    wrapper), or None."""
    for flag, attr in (
        ("--use-precision-aware-optimizer", "use_precision_aware_optimizer"),
        ("--optimizer-cpu-offload", "optimizer_cpu_offload"),
    ):
        if getattr(args, attr, False):
            return flag
    return None
