"""The megatron-core side of ``megatron-ext train``: everything the driver asks megatron-core.

What it does:
    The driver (:mod:`megatron_ext.train`) owns the command line, the loop and the logs;
    this module holds the pieces that call megatron-core, as Megatron-LM's ``training.py``
    would: process groups and seeds (:func:`init_distributed`, :func:`seed_all`), the
    ``TransformerConfig`` and DDP config from the driver's flags, the GPT model
    (:func:`build_gpt_model`, with the vocabulary padded as Megatron-LM pads it), its DDP
    wrapper, the optimizer and LR schedule (:func:`build_optimizer`), the grad-sync callables
    of the schedules (:func:`wire_grad_sync`), the distributed optimizer's overlapped
    parameter gather (:class:`ParamGather`), the weight-hash check across data-parallel
    replicas (:func:`check_weight_hashes`), one forward/backward pass over the microbatches
    (:func:`forward_backward`) and the loss (:func:`gpt_forward_step`, :func:`reduce_lm_loss`).

Why here:
    megatron_ext imports Megatron only under ``megatron_ext.megatron``; a release change of
    megatron-core touches this package and nothing above it.

Constraints:
    Non-interleaved schedule only (no virtual pipeline stages); no context or expert
    parallelism.
"""

from __future__ import annotations

import logging
import math
import os
import random
from datetime import timedelta
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_ext.config import ConfigError

__all__ = [
    "init_distributed",
    "seed_all",
    "transformer_config",
    "ddp_config",
    "build_gpt_model",
    "wrap_ddp",
    "count_parameters",
    "build_optimizer",
    "wire_grad_sync",
    "ParamGather",
    "check_weight_hashes",
    "forward_backward",
    "gpt_forward_step",
    "lm_loss",
    "reduce_lm_loss",
]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    *, cpu: bool, backend: str, tp: int, pp: int, timeout_minutes: int, dist_opt_instances: int = 1
) -> Tuple[Any, int, int]:
    """Process group and megatron's model-parallel groups.

    Returns:
        ``(parallel_state module, global rank, world size)``.
    """
    if cpu:
        from megatron_ext.megatron.cpu import enable_cpu_execution

        # --cpu is an explicit request: honoured on a machine with a GPU too (megatron-core
        # would otherwise allocate on the GPU while the driver feeds CPU batches).
        enable_cpu_execution(force=True)
    elif not torch.cuda.is_available():
        raise ConfigError(
            "--cpu", "no CUDA device found; pass --cpu to run megatron-core on CPU with gloo"
        )
    if backend == "auto":
        backend = "gloo" if cpu else "nccl"
    if "RANK" not in os.environ:
        # Single process without torchrun.
        os.environ.update(
            {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
        )
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if not cpu:
        torch.cuda.set_device(_local_device(int(os.environ.get("LOCAL_RANK", "0")), backend))
    torch.distributed.init_process_group(
        backend=backend, timeout=timedelta(minutes=timeout_minutes)
    )
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        num_distributed_optimizer_instances=dist_opt_instances,
    )
    return ps, torch.distributed.get_rank(), torch.distributed.get_world_size()


def _local_device(local_rank: int, backend: str) -> int:
    """The CUDA device of this rank: its local rank; with gloo, ranks beyond the node's GPUs
    share them round-robin (a debugging layout: NCCL refuses two ranks on one GPU)."""
    count = torch.cuda.device_count()
    if local_rank < count:
        return local_rank
    if backend != "gloo":
        raise ConfigError(
            "--distributed-backend",
            f"local rank {local_rank} on a node with {count} CUDA device(s): {backend} needs "
            f"one GPU per rank (start at most {count} processes per node, or share GPUs with "
            "--distributed-backend gloo)",
        )
    return local_rank % count


def seed_all(seed: int) -> None:
    """Seed every generator as Megatron-LM does (``seed + 100 * pipeline rank``)."""
    import numpy as np
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def transformer_config(model: Any, training: Any, *, tp: int, pp: int) -> Any:
    """megatron-core's ``TransformerConfig`` from the driver's model and training flags."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    m = model
    bf16 = training.bf16
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups if m.group_query_attention else None,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        normalization=m.normalization,
        gated_linear_unit=m.swiglu,
        activation_func=torch.nn.functional.silu if m.swiglu else torch.nn.functional.gelu,
        bias_activation_fusion=False if m.swiglu else not training.cpu,
        add_bias_linear=not m.disable_bias_linear,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        bf16=bf16,
        # Megatron-LM forces deallocation of pipeline outputs after they are sent.
        deallocate_pipeline_outputs=True,
        # Fused wgrad accumulation needs Apex's CUDA extension; megatron_ext's linear seam
        # accumulates into main_grad itself where a method needs it.
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=not training.cpu,
        masked_softmax_fusion=m.masked_softmax_fusion and not training.cpu,
        apply_rope_fusion=False,
        persist_layer_norm=m.persist_layer_norm and not training.cpu,
        use_cpu_initialization=False,
        # Megatron-LM's pretrain_gpt averages per token across microbatches this way.
        calculate_per_token_loss=False,
    )


def _same_named(flags: Any, *names: str) -> Dict[str, Any]:
    """``{name: flags.name}`` for driver flags that carry the name of the megatron-core config
    field they set (as Megatron-LM copies its arguments into its config dataclasses)."""
    return {name: getattr(flags, name) for name in names}


def ddp_config(parallel: Any, training: Any) -> Any:
    """megatron-core's ``DistributedDataParallelConfig`` from the driver's flags."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=parallel.accumulate_allreduce_grads_in_fp32 or training.bf16,
        **_same_named(
            parallel,
            "overlap_grad_reduce",
            "overlap_param_gather",
            "use_distributed_optimizer",
            "num_distributed_optimizer_instances",
        ),
        bucket_size=parallel.ddp_bucket_size,
        check_for_nan_in_grad=True,
    )


def build_gpt_model(model: Any, config: Any, *, vocab_size: int, tp: int) -> Tuple[Any, int]:
    """This stage's GPTModel (local or Transformer Engine layer spec), unwrapped.

    Returns:
        ``(model, padded vocabulary size)``; the vocabulary is padded to a multiple of
        ``128 * TP`` as Megatron-LM pads it.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel

    m = model
    if m.transformer_impl == "local":
        spec = get_gpt_layer_local_spec(normalization=m.normalization)
    else:
        spec = get_gpt_layer_with_transformer_engine_spec()
    multiple = 128 * tp
    padded_vocab = int(math.ceil(vocab_size / multiple) * multiple)
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab,
        max_sequence_length=m.max_position_embeddings or m.seq_length,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        position_embedding_type=m.position_embedding_type,
        rotary_base=m.rotary_base,
    )
    return gpt, padded_vocab


def wrap_ddp(module: Any, config: Any, ddp_cfg: Any, *, cpu: bool) -> Any:
    """Move to the device, wrap in ``Float16Module`` for bf16 and in megatron's DDP."""
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.transformer.module import Float16Module

    if not cpu:
        module.cuda(torch.cuda.current_device())
    if config.bf16:
        module = Float16Module(config, module)
    ddp = DDP(config, ddp_cfg, module)
    ddp.broadcast_params()
    return ddp


def count_parameters(model_chunks: Sequence[Any]) -> int:
    """Parameters of this tensor-parallel rank's model, summed over pipeline stages."""
    from megatron.core import parallel_state as ps

    from megatron_ext.accounting import ProcessGroupTrafficMeter, collective_device

    group = ps.get_pipeline_model_parallel_group()
    num = sum(p.numel() for chunk in model_chunks for p in chunk.parameters())
    totals = torch.tensor([num], dtype=torch.int64, device=collective_device(group))
    with ProcessGroupTrafficMeter.untracked():
        torch.distributed.all_reduce(totals, group=group)
    return int(totals.item())


def build_optimizer(
    training: Any, parallel: Any, config: Any, model_chunks: Sequence[Any], *, gbs: int
) -> Tuple[Any, Any]:
    """megatron-core's Adam optimizer and ``OptimizerParamScheduler`` (steps in samples)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    t = training
    opt_config = OptimizerConfig(
        optimizer="adam",
        **_same_named(
            t,
            "lr",
            "min_lr",
            "weight_decay",
            "adam_beta1",
            "adam_beta2",
            "adam_eps",
            "clip_grad",
            "bf16",
        ),
        params_dtype=config.params_dtype,
        **_same_named(parallel, "use_distributed_optimizer", "overlap_param_gather"),
        log_num_zeros_in_grad=False,
    )
    optimizer = get_megatron_optimizer(opt_config, list(model_chunks))
    decay_iters = t.lr_decay_iters or t.train_iters
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=t.lr_warmup_iters * gbs,
        lr_decay_steps=decay_iters * gbs,
        lr_decay_style=t.lr_decay_style,
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=decay_iters * gbs,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=t.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=t.override_opt_param_scheduler,
    )
    return optimizer, scheduler


def wire_grad_sync(config: Any, model_chunks: Sequence[Any], optimizer: Any, parallel: Any) -> None:
    """Set the schedules' grad-sync callables as Megatron-LM's ``train()`` does."""
    from megatron.core.distributed import finalize_model_grads

    config.finalize_model_grads_func = finalize_model_grads
    if parallel.overlap_grad_reduce:
        config.no_sync_func = model_chunks[0].no_sync
    if parallel.overlap_param_gather:
        config.param_sync_func = model_chunks[0].start_param_sync
    config.grad_scale_func = optimizer.scale_loss


class ParamGather:
    """The distributed optimizer's overlapped parameter gather, handled as Megatron-LM does.

    With ``--use-distributed-optimizer --overlap-param-gather`` the gather of updated
    parameters runs in forward pre-hooks of the next step. Megatron-LM runs the first
    iteration without those hooks (and without ``param_sync_func``) and turns them on once a
    step has succeeded; evaluation and checkpoints gather synchronously first.
    """

    def __init__(self, model_chunks: Sequence[Any], config: Any, parallel: Any):
        self.chunks = list(model_chunks)
        self.config = config
        self.active = bool(parallel.use_distributed_optimizer and parallel.overlap_param_gather)
        self.hooks_enabled = self.active
        self._param_sync_func = None

    def start(self) -> None:
        """Before the first iteration: no gather hooks until a step succeeded."""
        if self.active:
            self._param_sync_func = self.config.param_sync_func
            self.disable(param_sync=False)
            self.config.param_sync_func = None

    def step_succeeded(self) -> None:
        """After a successful step: the hooks take over the gather."""
        if self.active and self.config.param_sync_func is None:
            self.enable()
            self.config.param_sync_func = self._param_sync_func

    def disable(self, param_sync: bool = True) -> None:
        """Stop gathering in forward pre-hooks (optionally gathering now)."""
        if self.active and self.hooks_enabled:
            for chunk in self.chunks:
                chunk.disable_forward_pre_hook(param_sync=param_sync)
            self.hooks_enabled = False

    def enable(self) -> None:
        """Gather in forward pre-hooks again."""
        if self.active and not self.hooks_enabled:
            for chunk in self.chunks:
                chunk.enable_forward_pre_hook()
            self.hooks_enabled = True

    def sync(self) -> None:
        """Make every rank's parameters current (they lag one gather after a step)."""
        if self.active:
            for chunk in self.chunks:
                chunk.start_param_sync(force_sync=True)


class _HashMismatchRecords(logging.Handler):
    """Collects megatron-core's "Hash not matching for NAME" lines (logged at INFO)."""

    def __init__(self):
        super().__init__(level=logging.INFO)
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "Hash not matching" in message:
            self.lines.append(message)


def check_weight_hashes(model_chunks: Sequence[Any], iteration: int, param_gather: Any) -> None:
    """Megatron-LM's ``--check-weight-hash-across-dp-replicas-interval`` check, on the driver.

    megatron-core's ``check_param_hashes_across_dp_replicas(model, cross_check=True)``
    hashes every parameter (SHA-1 of its fp32 bytes) and all-gathers the hashes over the
    data-parallel group; as Megatron-LM does, the overlapped parameter gather is turned off
    around it (so the parameters are current) and the ranks meet at a barrier afterwards.

    Args:
        model_chunks: the DDP-wrapped model chunks of this rank.
        iteration: iterations done (for the message).
        param_gather: the driver's :class:`ParamGather`.

    Raises:
        RuntimeError: on every rank when any replica's hashes differ, with Megatron-LM's
            message ("Parameter hashes not matching across DP replicas") followed by the
            parameters whose hash on this rank differs from data-parallel rank 0's.
    """
    from megatron.core import utils as mcore_utils

    from megatron_ext.logging import print_rank_0

    hooks_were_enabled = param_gather.hooks_enabled
    param_gather.disable()
    records = _HashMismatchRecords()
    logger = mcore_utils.logger
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        match = mcore_utils.check_param_hashes_across_dp_replicas(
            list(model_chunks), cross_check=True
        )
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    if not match:
        where = "; ".join(records.lines) or (
            f"[Rank {torch.distributed.get_rank()}] this rank's hashes match data-parallel "
            "rank 0's; another replica differs"
        )
        raise RuntimeError(
            f"Parameter hashes not matching across DP replicas after {iteration} iterations: "
            f"{where}"
        )
    torch.distributed.barrier()
    print_rank_0(f">>> Weight hashes match after {iteration} iterations...")
    if hooks_were_enabled:
        param_gather.enable()


def forward_backward(
    forward_step: Callable,
    data_iterator: Any,
    model_chunks: Sequence[Any],
    *,
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool,
    **kwargs: Any,
) -> List[Dict[str, Any]]:
    """One pass of megatron's schedule over the microbatches; returns the loss reports."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data_iterator,
        model=list(model_chunks),
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
        **kwargs,
    )


def lm_loss(loss_mask, output_tensor):
    """pretrain_gpt's loss: masked token sum, token count, and the 'lm loss' report."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    return loss, num_tokens, report


def gpt_forward_step(batch: Optional[Dict[str, Any]], model: Any, *, cpu: bool):
    """megatron's forward_step_func body for one microbatch of a GPT stage."""
    from megatron.core import parallel_state as ps

    first = ps.is_pipeline_first_stage()
    last = ps.is_pipeline_last_stage()

    def get(key, wanted):
        value = batch[key] if (batch is not None and wanted) else None
        if value is None or cpu:
            return value
        # Pinned, then an asynchronous copy: a pageable .cuda() blocks the host each
        # microbatch (the caching host allocator keeps the pinned block until the copy ran).
        return value.pin_memory().cuda(non_blocking=True)

    tokens = get("tokens", first)
    position_ids = get("position_ids", first)
    labels = get("labels", last)
    loss_mask = get("loss_mask", last)
    output = model(tokens, position_ids, None, labels=labels)
    return output, partial(lm_loss, loss_mask)


def reduce_lm_loss(losses: Sequence[Dict[str, Any]]) -> Optional[torch.Tensor]:
    """Token-weighted mean 'lm loss' over microbatches and DP ranks (None off the last stage),
    as a 0-d float64 tensor on the collective's device: read it on the host only when it is
    logged (a ``.item()`` every step would synchronize the GPU every step)."""
    from megatron.core import parallel_state as ps

    from megatron_ext.accounting import collective_device

    if not ps.is_pipeline_last_stage():
        return None
    group = ps.get_data_parallel_group()
    total = torch.zeros(2, dtype=torch.float64, device=collective_device(group))
    for item in losses:
        total += item["lm loss"].double().to(total.device)
    torch.distributed.all_reduce(total, group=group)
    return total[0] / total[1].clamp(min=1)
