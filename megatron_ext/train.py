"""``megatron-ext train``: train a GPT / LLaMA-style model on megatron-core with our seams.

What it does:
    A compact training driver on megatron-core alone (no Megatron-LM checkout needed),
    launched with ``torchrun`` (or ``megatron-ext netbench``): data / tensor / pipeline
    parallelism (1F1B), micro and global batches, fp32 or bf16, megatron's optimizer and
    learning-rate schedule, periodic checkpoints with exact resume through megatron-core's
    dist_checkpointing, evaluation, a progress bar and megatron's iteration log line
    extended with the bytes each category of communication moved. Every megatron_ext seam
    is installed (``megatron_ext.megatron.runtime``); with all methods ``none`` training is
    bit-identical to stock megatron-core.

    Data: by default an embedded corpus (CPython's documentation and docstrings) tokenized
    with a SentencePiece model trained on first use, in megatron's indexed format, read
    through ``megatron.core.datasets`` GPTDataset; or ``--data-path`` prefixes, or
    ``--data-files`` (text / JSON / parquet through HF datasets).

Usage:
    torchrun --nproc-per-node 2 -m megatron_ext.train --cpu --model gpt-tiny --train-iters 50

Constraints:
    Non-interleaved schedule only (no virtual pipeline stages); no context or expert
    parallelism. With ``--cpu`` the limits of :mod:`megatron_ext.megatron.cpu` apply.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import time
from datetime import datetime, timedelta
from functools import partial
from typing import Any, Dict, List, Optional, Sequence

from megatron_ext.config import (
    ConfigError,
    ExtConfig,
    add_args,
    add_config_args,
    config_from_args,
    ext_config_from_args,
)
from megatron_ext.logging import is_last_rank, print_rank_0
from megatron_ext.train_config import (
    DRIVER_CONFIG_CLASSES,
    CheckpointArgs,
    LoggingArgs,
    ModelArgs,
    ParallelArgs,
    TrainingArgs,
    find_config_file,
    load_yaml_defaults,
)

__all__ = ["build_parser", "parse_args", "main", "Trainer"]


# ----------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------


def _data_config_class():
    from megatron_ext.data.config import DataConfig

    return DataConfig


def build_parser() -> argparse.ArgumentParser:
    """The driver's parser: model presets, run files, driver flags, data and ext flags."""
    parser = argparse.ArgumentParser(
        prog="megatron-ext train",
        description="Train a GPT/LLaMA model on megatron-core with megatron-ext compression.",
        allow_abbrev=False,
    )
    group = parser.add_argument_group("presets")
    group.add_argument(
        "--model",
        default=None,
        help="Model preset from configs/models (e.g. gpt-tiny, llama-tiny, gpt2-345m, "
        "llama-1b) or a YAML file; sets model-shape defaults.",
    )
    group.add_argument(
        "--config",
        default=None,
        help="Run file (YAML mapping of flag names to values, may name a 'model' preset); "
        "flags given on the command line override it.",
    )
    for cls in DRIVER_CONFIG_CLASSES:
        add_config_args(parser, cls)
    add_config_args(parser, _data_config_class())
    add_args(parser)
    return parser


@dataclasses.dataclass(frozen=True)
class DriverConfig:
    """Everything the driver was asked to do, validated."""

    model: ModelArgs
    parallel: ParallelArgs
    training: TrainingArgs
    checkpoint: CheckpointArgs
    logging: LoggingArgs
    data: Any
    ext: ExtConfig
    model_preset: Optional[str]
    config_file: Optional[str]


def parse_args(argv: Optional[Sequence[str]] = None) -> DriverConfig:
    """Parse and validate; raises :class:`ConfigError` naming the flag at fault."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    pre, _ = parser.parse_known_args(argv)
    defaults: Dict[str, Any] = {}
    model_name = pre.model
    run_file = None
    if pre.config:
        run_file = find_config_file(pre.config, "", "--config")
        run_defaults = load_yaml_defaults(run_file, parser, "--config")
        model_name = pre.model or run_defaults.pop("model", None)
        run_defaults.pop("config", None)
    else:
        run_defaults = {}
    if model_name:
        path = find_config_file(model_name, "models", "--model")
        preset = load_yaml_defaults(path, parser, "--model")
        defaults.update(preset)
    defaults.update(run_defaults)
    parser.set_defaults(**defaults)
    args = parser.parse_args(argv)
    return DriverConfig(
        model=config_from_args(ModelArgs, args),
        parallel=config_from_args(ParallelArgs, args),
        training=config_from_args(TrainingArgs, args),
        checkpoint=config_from_args(CheckpointArgs, args),
        logging=config_from_args(LoggingArgs, args),
        data=config_from_args(_data_config_class(), args),
        ext=ext_config_from_args(args),
        model_preset=model_name,
        config_file=run_file,
    )


def _layout_sizes(cfg: DriverConfig, world_size: int) -> Dict[str, int]:
    tp = cfg.parallel.tensor_model_parallel_size
    pp = cfg.parallel.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise ConfigError(
            ["--tensor-model-parallel-size", "--pipeline-model-parallel-size"],
            f"world size {world_size} is not divisible by TP {tp} x PP {pp}",
        )
    dp = world_size // (tp * pp)
    mbs = cfg.training.micro_batch_size
    gbs = cfg.training.global_batch_size or mbs * dp
    if gbs % (mbs * dp):
        raise ConfigError(
            ["--global-batch-size", "--micro-batch-size"],
            f"global batch {gbs} is not a multiple of micro batch {mbs} x DP {dp}",
        )
    if cfg.model.num_layers % pp:
        raise ConfigError(
            ["--num-layers", "--pipeline-model-parallel-size"],
            f"{cfg.model.num_layers} layers do not split evenly over {pp} pipeline stages",
        )
    heads = cfg.model.num_attention_heads
    if heads % tp:
        raise ConfigError(
            ["--num-attention-heads", "--tensor-model-parallel-size"],
            f"{heads} heads do not split over TP {tp}",
        )
    if cfg.model.num_query_groups and cfg.model.num_query_groups % tp:
        raise ConfigError(
            ["--num-query-groups", "--tensor-model-parallel-size"],
            "query groups must be divisible by the tensor-parallel size",
        )
    return {"tp": tp, "pp": pp, "dp": dp, "gbs": gbs, "num_microbatches": gbs // (mbs * dp)}


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


class Trainer:
    """Builds everything on each rank and runs the loop (see module docstring)."""

    def __init__(self, cfg: DriverConfig):
        self.cfg = cfg
        self.writer = None
        self.log_file = None

    # -- setup ----------------------------------------------------------------------------

    def setup_distributed(self) -> None:
        import torch

        cfg = self.cfg
        if cfg.training.cpu:
            from megatron_ext.megatron.cpu import enable_cpu_execution

            enable_cpu_execution()
        elif not torch.cuda.is_available():
            raise ConfigError(
                "--cpu",
                "no CUDA device found; pass --cpu to run megatron-core on CPU with gloo",
            )
        world = int(os.environ.get("WORLD_SIZE", "1"))
        self.sizes = _layout_sizes(cfg, world)
        threads = cfg.training.num_threads
        if cfg.training.cpu and threads is None:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            threads = max(1, (os.cpu_count() or 1) // local)
        if threads:
            torch.set_num_threads(threads)
        backend = cfg.parallel.distributed_backend
        if backend == "auto":
            backend = "gloo" if cfg.training.cpu else "nccl"
        if "RANK" not in os.environ:
            # Single process without torchrun.
            os.environ.update(
                {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
            )
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        if not cfg.training.cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group(
            backend=backend,
            timeout=timedelta(minutes=cfg.parallel.distributed_timeout_minutes),
        )
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(
            tensor_model_parallel_size=self.sizes["tp"],
            pipeline_model_parallel_size=self.sizes["pp"],
        )
        self.ps = ps
        self.rank = torch.distributed.get_rank()
        self.world = torch.distributed.get_world_size()
        self.seed()

    def seed(self) -> None:
        """Seed every generator as Megatron-LM does (seed + 100 * pipeline rank)."""
        import numpy as np
        import torch
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        seed = self.cfg.training.seed + 100 * self.ps.get_pipeline_model_parallel_rank()
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)

    def build_data(self) -> None:
        import torch

        from megatron_ext.megatron import data as ext_data

        cfg, sizes = self.cfg, self.sizes
        ps = self.ps
        t0 = time.time()
        self.tokenizer = ext_data.build_tokenizer(cfg.data)
        iters = cfg.training.train_iters
        eval_runs = (iters // cfg.training.eval_interval if cfg.training.eval_interval else 0) + 1
        num_samples = (
            iters * sizes["gbs"],
            eval_runs * cfg.training.eval_iters * sizes["gbs"],
            0,
        )
        self.train_ds, self.valid_ds, _ = ext_data.build_gpt_datasets(
            cfg.data,
            tokenizer=self.tokenizer,
            seq_length=cfg.model.seq_length,
            seed=cfg.training.seed,
            num_samples=num_samples,
        )
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp_size = ps.get_data_parallel_world_size()
        self.needs_data = ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage()
        print_rank_0(
            f"> data: {len(self.train_ds)} train / "
            f"{0 if self.valid_ds is None else len(self.valid_ds)} valid samples of "
            f"{cfg.model.seq_length} tokens, vocab {self.tokenizer.vocab_size} "
            f"({time.time() - t0:.1f} s)"
        )
        torch.distributed.barrier()

    def _transformer_config(self):
        import torch
        from megatron.core.transformer.transformer_config import TransformerConfig

        m, cfg = self.cfg.model, self.cfg
        bf16 = cfg.training.bf16
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
            bias_activation_fusion=False if m.swiglu else not cfg.training.cpu,
            add_bias_linear=not m.disable_bias_linear,
            tensor_model_parallel_size=self.sizes["tp"],
            pipeline_model_parallel_size=self.sizes["pp"],
            pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            bf16=bf16,
            # Megatron-LM forces deallocation of pipeline outputs after they are sent.
            deallocate_pipeline_outputs=True,
            # Fused wgrad accumulation needs Apex's CUDA extension; megatron_ext's linear
            # seam accumulates into main_grad itself where a method needs it.
            gradient_accumulation_fusion=False,
            bias_dropout_fusion=not cfg.training.cpu,
            masked_softmax_fusion=not cfg.training.cpu,
            apply_rope_fusion=False,
            persist_layer_norm=not cfg.training.cpu,
            use_cpu_initialization=False,
            # Megatron-LM's pretrain_gpt averages per token across microbatches this way.
            calculate_per_token_loss=False,
        )

    def build_model(self) -> None:
        import torch
        from megatron.core.distributed import DistributedDataParallel as DDP
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_local_spec,
            get_gpt_layer_with_transformer_engine_spec,
        )
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.module import Float16Module

        cfg, ps = self.cfg, self.ps
        m = cfg.model
        config = self._transformer_config()
        if m.transformer_impl == "local":
            spec = get_gpt_layer_local_spec(normalization=m.normalization)
        else:
            spec = get_gpt_layer_with_transformer_engine_spec()
        vocab = self.tokenizer.vocab_size
        # Megatron-LM pads the vocabulary to a multiple of 128 * TP.
        multiple = 128 * self.sizes["tp"]
        padded_vocab = int(math.ceil(vocab / multiple) * multiple)
        model = GPTModel(
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
        if not cfg.training.cpu:
            model.cuda(torch.cuda.current_device())
        if cfg.training.bf16:
            model = Float16Module(config, model)
        par = cfg.parallel
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=par.accumulate_allreduce_grads_in_fp32 or cfg.training.bf16,
            overlap_grad_reduce=par.overlap_grad_reduce,
            overlap_param_gather=par.overlap_param_gather,
            use_distributed_optimizer=par.use_distributed_optimizer,
            bucket_size=par.ddp_bucket_size,
            check_for_nan_in_grad=True,
        )
        model = DDP(config, ddp_config, model)
        model.broadcast_params()
        self._param_hooks_enabled = bool(par.use_distributed_optimizer and par.overlap_param_gather)
        self.config = config
        self.model = [model]
        self.padded_vocab = padded_vocab
        num_params = sum(p.numel() for p in model.parameters())
        from megatron_ext.accounting import ProcessGroupTrafficMeter, collective_device

        group = ps.get_pipeline_model_parallel_group()
        totals = torch.tensor([num_params], dtype=torch.int64, device=collective_device(group))
        with ProcessGroupTrafficMeter.untracked():
            torch.distributed.all_reduce(totals, group=group)
        print_rank_0(
            f"> model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} "
            f"heads, vocab {padded_vocab} (padded): {totals.item() / 1e6:.2f}M parameters per "
            f"tensor-parallel rank"
        )

    def build_optimizer(self) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        cfg = self.cfg
        t = cfg.training
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=t.lr,
            min_lr=t.min_lr,
            weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1,
            adam_beta2=t.adam_beta2,
            adam_eps=t.adam_eps,
            clip_grad=t.clip_grad,
            bf16=t.bf16,
            params_dtype=self.config.params_dtype,
            use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
            overlap_param_gather=cfg.parallel.overlap_param_gather,
            log_num_zeros_in_grad=False,
        )
        self.optimizer = get_megatron_optimizer(opt_config, self.model)
        gbs = self.sizes["gbs"]
        decay_iters = t.lr_decay_iters or t.train_iters
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
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
        )

    def install_ext(self, stock: bool = False) -> None:
        """Wire megatron's grad-sync callables and install megatron_ext's seams.

        Args:
            stock: install nothing of megatron_ext (the stock megatron-core baseline that
                parity tests and benchmarks compare against).
        """
        from megatron.core.distributed import finalize_model_grads

        from megatron_ext.megatron.runtime import install

        config = self.config
        config.finalize_model_grads_func = finalize_model_grads
        if self.cfg.parallel.overlap_grad_reduce:
            config.no_sync_func = self.model[0].no_sync
        if self.cfg.parallel.overlap_param_gather:
            config.param_sync_func = self.model[0].start_param_sync
        config.grad_scale_func = self.optimizer.scale_loss
        if stock:
            self.runtime = _StockRuntime()
            return
        self.runtime = install(
            self.cfg.ext,
            model_chunks=self.model,
            optimizer=self.optimizer,
            model_config=config,
            transformer_impl=self.cfg.model.transformer_impl,
        )

    # -- distributed-optimizer parameter gather (Megatron-LM's handling) -------------------

    @property
    def _overlapped_param_gather(self) -> bool:
        par = self.cfg.parallel
        return par.use_distributed_optimizer and par.overlap_param_gather

    def _disable_param_gather_hooks(self, param_sync: bool = True) -> None:
        """Stop gathering parameters in forward pre-hooks (optionally gathering them now)."""
        if self._overlapped_param_gather and self._param_hooks_enabled:
            for chunk in self.model:
                chunk.disable_forward_pre_hook(param_sync=param_sync)
            self._param_hooks_enabled = False

    def _enable_param_gather_hooks(self) -> None:
        if self._overlapped_param_gather and not self._param_hooks_enabled:
            for chunk in self.model:
                chunk.enable_forward_pre_hook()
            self._param_hooks_enabled = True

    def sync_params(self) -> None:
        """Make every rank's model parameters current (the distributed optimizer with
        overlapped parameter gather leaves them one gather behind after a step)."""
        if self._overlapped_param_gather:
            for chunk in self.model:
                chunk.start_param_sync(force_sync=True)

    # -- steps ----------------------------------------------------------------------------

    def _iterator(self, dataset, consumed: int):
        if dataset is None or not self.needs_data:
            return None
        from megatron_ext.megatron.data import MicrobatchIterator

        return MicrobatchIterator(
            dataset,
            micro_batch_size=self.cfg.training.micro_batch_size,
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            consumed_samples=consumed,
        )

    def _sample_ids_fn(self, consumed: int):
        from megatron_ext.megatron.data import sample_indices

        return partial(
            lambda c, m: sample_indices(
                c, m, self.cfg.training.micro_batch_size, self.dp_rank, self.dp_size
            ),
            consumed,
        )

    def forward_step(self, data_iterator, model):
        """megatron's forward_step_func: one microbatch through this stage."""
        batch = next(data_iterator) if data_iterator is not None else None
        if self.on_step_batch is not None and batch is not None:
            self.on_step_batch(batch)
        first = self.ps.is_pipeline_first_stage()
        last = self.ps.is_pipeline_last_stage()
        tokens = batch["tokens"] if (batch is not None and first) else None
        position_ids = batch["position_ids"] if (batch is not None and first) else None
        labels = batch["labels"] if (batch is not None and last) else None
        loss_mask = batch["loss_mask"] if (batch is not None and last) else None
        if not self.cfg.training.cpu:
            tokens = tokens.cuda() if tokens is not None else None
            position_ids = position_ids.cuda() if position_ids is not None else None
            labels = labels.cuda() if labels is not None else None
            loss_mask = loss_mask.cuda() if loss_mask is not None else None
        output = model(tokens, position_ids, None, labels=labels)
        return output, partial(_loss_func, loss_mask)

    on_step_batch = None
    """Optional callback receiving each microbatch a rank reads (tests use it)."""

    def train_step(self, iteration: int, consumed: int, data_iterator):
        """One iteration: forward/backward over all microbatches, optimizer step."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.runtime.begin_step(iteration, sample_ids_fn=self._sample_ids_fn(consumed))
        forward_backward = get_forward_backward_func()
        losses = forward_backward(
            forward_step_func=self.forward_step,
            data_iterator=data_iterator,
            model=self.model,
            num_microbatches=self.sizes["num_microbatches"],
            seq_length=self.cfg.model.seq_length,
            micro_batch_size=self.cfg.training.micro_batch_size,
            forward_only=False,
            **self.runtime.forward_backward_kwargs(),
        )
        update_successful, grad_norm, _ = self.optimizer.step()
        if update_successful:
            self.scheduler.step(increment=self.sizes["gbs"])
        return self._reduce_losses(losses), grad_norm, update_successful

    def _reduce_losses(self, losses) -> Optional[float]:
        """Token-weighted mean 'lm loss' over microbatches and DP ranks (last stage)."""
        import torch

        if not self.ps.is_pipeline_last_stage():
            return None
        from megatron_ext.accounting import collective_device

        group = self.ps.get_data_parallel_group()
        total = torch.zeros(2, dtype=torch.float64, device=collective_device(group))
        for item in losses:
            total += item["lm loss"].double().to(total.device)
        torch.distributed.all_reduce(total, group=group)
        return (total[0] / total[1].clamp(min=1)).item()

    def evaluate(self, step: int) -> Optional[float]:
        """Validation loss over --eval-iters iterations (forward only)."""
        import torch
        from megatron.core.pipeline_parallel import get_forward_backward_func

        t = self.cfg.training
        if self.valid_ds is None or t.eval_iters == 0:
            return None
        hooks_were_enabled = self._overlapped_param_gather and self._param_hooks_enabled
        self._disable_param_gather_hooks()
        for chunk in self.model:
            chunk.eval()
        total = 0.0
        count = 0
        eval_consumed = self._eval_consumed
        with torch.no_grad():
            for _ in range(t.eval_iters):
                iterator = self._iterator(self.valid_ds, eval_consumed)
                self.runtime.begin_step(step, forward_only=True)
                losses = get_forward_backward_func()(
                    forward_step_func=self.forward_step,
                    data_iterator=iterator,
                    model=self.model,
                    num_microbatches=self.sizes["num_microbatches"],
                    seq_length=self.cfg.model.seq_length,
                    micro_batch_size=t.micro_batch_size,
                    forward_only=True,
                    **self.runtime.forward_backward_kwargs(),
                )
                value = self._reduce_losses(losses)
                if value is not None:
                    total += value
                    count += 1
                eval_consumed += self.sizes["gbs"]
        self._eval_consumed = eval_consumed
        for chunk in self.model:
            chunk.train()
        if hooks_were_enabled:
            self._enable_param_gather_hooks()
        return total / count if count else None

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> Dict[str, Any]:
        """Train; returns a summary dict (also written to the JSON reports)."""
        from megatron_ext.accounting import Traffic, all_ranks_totals
        from megatron_ext.megatron import checkpoint as ckpt

        cfg = self.cfg
        t = cfg.training
        gbs = self.sizes["gbs"]
        iteration = 0
        consumed = 0
        self._eval_consumed = 0
        if cfg.checkpoint.load:
            from megatron_ext.accounting import ProcessGroupTrafficMeter

            with ProcessGroupTrafficMeter.untracked():
                loaded = ckpt.load_checkpoint(
                    cfg.checkpoint.load,
                    model_chunks=self.model,
                    optimizer=self.optimizer,
                    scheduler=self.scheduler,
                    runtime=self.runtime,
                    on_mismatch=cfg.ext.checkpoint.on_mismatch,
                )
            if loaded is not None:
                iteration, consumed = loaded["iteration"], loaded["consumed_samples"]
                self._eval_consumed = loaded.get("eval_consumed_samples", 0)
                print_rank_0(f"> resumed from {cfg.checkpoint.load} at iteration {iteration}")
            else:
                print_rank_0(f"> no checkpoint in {cfg.checkpoint.load}; starting from scratch")
        self._open_writers()
        data_iterator = self._iterator(self.train_ds, consumed)
        interval_losses: List[float] = []
        interval_traffic: Dict[str, Traffic] = {}
        interval_iters = 0
        step_times: List[float] = []
        history: List[Dict[str, Any]] = []
        last_loss = None
        last_eval = None
        start_iteration = iteration
        progress = _Progress(t.train_iters, enabled=cfg.logging.progress and is_last_rank())
        stop_at = min(t.train_iters, t.exit_interval or t.train_iters)
        # As Megatron-LM: the first iteration runs without the overlapped parameter gather,
        # which resumes once a step has succeeded.
        param_sync_func = self.config.param_sync_func
        if self._overlapped_param_gather:
            self._disable_param_gather_hooks(param_sync=False)
            self.config.param_sync_func = None
        while iteration < stop_at:
            t0 = time.time()
            loss, grad_norm, ok = self.train_step(iteration, consumed, data_iterator)
            if ok and self._overlapped_param_gather and self.config.param_sync_func is None:
                self._enable_param_gather_hooks()
                self.config.param_sync_func = param_sync_func
            step_traffic = self.runtime.end_step()
            step_times.append(time.time() - t0)
            iteration += 1
            consumed += gbs
            interval_iters += 1
            if loss is not None:
                interval_losses.append(loss)
                last_loss = loss
            for c, tr in step_traffic.items():
                interval_traffic.setdefault(c, Traffic()).add(tr)
            progress.update(iteration, last_loss)
            if t.eval_interval and iteration % t.eval_interval == 0:
                last_eval = self.evaluate(iteration)
            if iteration % cfg.logging.log_interval == 0 or iteration == stop_at:
                # Like Megatron-LM's interval timer: checkpointing and evaluation excluded.
                elapsed = sum(step_times[-interval_iters:])
                traffic_sum = (
                    all_ranks_totals(interval_traffic)[0] if cfg.ext.comm.accounting else {}
                )
                record = self._log(
                    iteration,
                    consumed,
                    elapsed / interval_iters,
                    interval_losses,
                    grad_norm,
                    traffic_sum,
                    interval_iters,
                    last_eval,
                )
                history.append(record)
                interval_losses, interval_traffic = [], {}
                interval_iters = 0
            if (
                cfg.checkpoint.save
                and cfg.checkpoint.save_interval
                and iteration % cfg.checkpoint.save_interval == 0
                and iteration < stop_at
            ):
                self._save(iteration, consumed)
        progress.close()
        self._disable_param_gather_hooks()
        if not t.eval_interval or iteration % t.eval_interval:
            final_eval = self.evaluate(iteration) if iteration > start_iteration else None
        else:
            final_eval = last_eval
        if cfg.checkpoint.save and iteration > start_iteration:
            self._save(iteration, consumed)
        summary = self._summary(iteration, consumed, step_times, history, final_eval)
        self._close_writers()
        return summary

    # -- checkpoints, logs, reports ----------------------------------------------------------

    def _save(self, iteration: int, consumed: int) -> None:
        from megatron_ext.accounting import ProcessGroupTrafficMeter
        from megatron_ext.megatron import checkpoint as ckpt

        t0 = time.time()
        self.sync_params()
        # Checkpoint coordination is not training traffic (the Megatron-LM adapter excludes it
        # the same way).
        with ProcessGroupTrafficMeter.untracked():
            self._save_checkpoint(ckpt, iteration, consumed)
        print_rank_0(
            f"  saved checkpoint at iteration {iteration:8d} to {self.cfg.checkpoint.save} "
            f"({time.time() - t0:.1f} s)"
        )

    def _save_checkpoint(self, ckpt, iteration: int, consumed: int) -> None:
        ckpt.save_checkpoint(
            self.cfg.checkpoint.save,
            iteration,
            model_chunks=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            runtime=self.runtime,
            consumed_samples=consumed,
            extra_common={"eval_consumed_samples": self._eval_consumed},
        )

    def _open_writers(self) -> None:
        cfg = self.cfg
        if not is_last_rank():
            return
        if cfg.logging.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=cfg.logging.tensorboard_dir, max_queue=1000)
        path = cfg.logging.log_json or (
            os.path.join(cfg.checkpoint.save, "log.jsonl") if cfg.checkpoint.save else None
        )
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.log_file = open(path, "a")

    def _close_writers(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
        if self.log_file is not None:
            self.log_file.close()

    def _log(self, iteration, consumed, step_time, losses, grad_norm, traffic, iters, eval_loss):
        """Megatron-style log line (last rank) + TensorBoard + JSON record."""
        from megatron_ext.accounting import comm_scalars, format_traffic

        lr = self.optimizer.param_groups[0]["lr"]
        loss = sum(losses) / len(losses) if losses else None
        per_step = {c: {k: v / iters for k, v in tr.as_dict().items()} for c, tr in traffic.items()}
        record = {
            "iteration": iteration,
            "consumed_samples": consumed,
            "step_time_s": step_time,
            "lr": lr,
            "lm_loss": loss,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "valid_loss": eval_loss,
            "bytes_per_step_all_ranks": per_step,
        }
        if not is_last_rank():
            return record
        ts = datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")
        line = (
            f" [{ts}] iteration {iteration:8d}/{self.cfg.training.train_iters:8d} |"
            f" consumed samples: {consumed:12d} |"
            f" elapsed time per iteration (ms): {step_time * 1000:.1f} |"
            f" learning rate: {lr:.6E} |"
            f" global batch size: {self.sizes['gbs']:5d} |"
        )
        if loss is not None:
            line += f" lm loss: {loss:.6E} |"
        if eval_loss is not None:
            line += f" valid loss: {eval_loss:.6E} |"
        line += " loss scale: 1.0 |"
        if grad_norm is not None:
            line += f" grad norm: {float(grad_norm):.3f} |"
        line += format_traffic(traffic, iters)
        print(line, flush=True)
        if self.writer is not None:
            w = self.writer
            w.add_scalar("learning-rate", lr, iteration)
            if loss is not None:
                w.add_scalar("lm loss", loss, iteration)
                w.add_scalar("lm loss vs samples", loss, consumed)
            if grad_norm is not None:
                w.add_scalar("grad-norm", float(grad_norm), iteration)
            if eval_loss is not None:
                w.add_scalar("lm loss validation", eval_loss, iteration)
            w.add_scalar("iteration-time", step_time, iteration)
            for name, value in comm_scalars(traffic, iters).items():
                w.add_scalar(name, value, iteration)
        if self.log_file is not None:
            self.log_file.write(json.dumps(record) + "\n")
            self.log_file.flush()
        return record

    def _summary(self, iteration, consumed, step_times, history, final_eval) -> Dict[str, Any]:
        import torch

        from megatron_ext.accounting import collective_device, comm_report, report_path

        cfg = self.cfg
        comm = comm_report(self.runtime.meter)
        warm = step_times[1:] if len(step_times) > 1 else step_times
        final_loss = None
        for rec in reversed(history):
            if rec.get("lm_loss") is not None:
                final_loss = rec["lm_loss"]
                break
        # The loss lives on the last rank; share it so rank 0 can write the report.
        shared = torch.tensor(
            [
                final_loss if final_loss is not None else float("nan"),
                final_eval if final_eval is not None else float("nan"),
            ],
            dtype=torch.float64,
            device=collective_device(),
        )
        torch.distributed.broadcast(shared, src=self.world - 1)
        summary = {
            "iterations": iteration,
            "consumed_samples": consumed,
            "steps_this_run": len(step_times),
            "mean_step_time_s": sum(warm) / max(1, len(warm)),
            "final_lm_loss": None if math.isnan(shared[0].item()) else shared[0].item(),
            "final_valid_loss": None if math.isnan(shared[1].item()) else shared[1].item(),
            "layout": dict(self.sizes),
            "world_size": self.world,
            "model_preset": cfg.model_preset,
            "config_file": cfg.config_file,
            "ext": cfg.ext.summary(),
            "comm": comm,
            "history": history if is_last_rank() else [],
        }
        path = report_path(cfg.ext.comm.report, cfg.checkpoint.save)
        if self.rank == 0 and cfg.ext.comm.accounting:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                json.dump(summary, f, indent=2)
            print_rank_0(f"> communication report: {path}")
        valid = summary["final_valid_loss"]
        print_rank_0(
            f"> done: {iteration} iterations, mean step {summary['mean_step_time_s'] * 1000:.1f} ms"
            + ("" if valid is None else f", validation loss {valid:.4f}")
        )
        return summary


class _StockRuntime:
    """Stands in for ExtRuntime when nothing of megatron_ext is installed (the baseline).

    Stock megatron-core has no seams, so there is nothing to notify and no bytes counted.
    """

    def __init__(self):
        from megatron_ext.accounting import CommMeter

        self.meter = CommMeter(enabled=False)
        self.communicator = None

    def begin_step(self, step, *, sample_ids_fn=None, forward_only=False):
        return None

    def end_step(self):
        return {}

    def forward_backward_kwargs(self):
        return {}

    def remove(self):
        return None


def _loss_func(loss_mask, output_tensor):
    """pretrain_gpt's loss: masked token sum, token count, and the 'lm loss' report."""
    import torch

    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    return loss, num_tokens, report


class _Progress:
    """Single-line progress bar on a terminal (never in logs)."""

    def __init__(self, total: int, enabled: bool):
        self.total = total
        self.enabled = enabled and sys.stderr.isatty()
        self.start = time.time()

    def update(self, done: int, loss: Optional[float]) -> None:
        if not self.enabled:
            return
        width = 30
        frac = done / max(1, self.total)
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        elapsed = time.time() - self.start
        eta = elapsed / max(frac, 1e-9) - elapsed
        loss_s = "" if loss is None else f" loss {loss:.4f}"
        sys.stderr.write(f"\r[{bar}] {done}/{self.total}{loss_s} eta {eta:5.0f}s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_training(cfg: DriverConfig) -> Dict[str, Any]:
    """Set up a full run from a parsed config and train (call on every rank)."""
    trainer = Trainer(cfg)
    trainer.setup_distributed()
    trainer.build_data()
    trainer.build_model()
    trainer.build_optimizer()
    trainer.install_ext()
    return trainer.run()


# Warnings megatron-core prints on every rank when optional GPU libraries are absent;
# expected on CPU and without Transformer Engine, so not repeated in every run's output.
_EXPECTED_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "full scope is deprecated",
)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point; returns the exit code."""
    import warnings

    for message in _EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{message}.*")
    try:
        cfg = parse_args(argv)
    except ConfigError as exc:
        print(f"megatron-ext train: error: {exc}", file=sys.stderr)
        return 2
    try:
        run_training(cfg)
    except ConfigError as exc:
        print(f"megatron-ext train: error: {exc}", file=sys.stderr)
        return 2
    finally:
        import torch

        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
