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

Structure:
    This module is the command line and the loop's orchestration (parse, build in order,
    train, evaluate, checkpoint, log, report). Everything that calls megatron-core lives in
    :mod:`megatron_ext.megatron.training` (model, DDP, optimizer, schedule, loss) and the
    other adapters under ``megatron_ext.megatron``.

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
import sys
import time
from datetime import datetime
from typing import Any, Dict, List, Optional, Sequence

from megatron_ext.config import (
    ConfigError,
    ExtConfig,
    add_args,
    add_config_args,
    config_from_args,
    ext_config_from_args,
    validate_ext_config,
)
from megatron_ext.logging import is_last_rank, print_rank_0
from megatron_ext.train_config import (
    DRIVER_CONFIG_CLASSES,
    CheckpointArgs,
    LoggingArgs,
    ModelArgs,
    ParallelArgs,
    TrainingArgs,
    driver_layout,
    find_config_file,
    layout_sizes,
    load_yaml_defaults,
)
from megatron_ext.validation import (
    check_backend,
    check_flag_relations,
    check_flag_values,
    check_transformer_engine,
    check_writable,
)

__all__ = ["build_parser", "parse_args", "main", "Trainer", "batch_change_warning"]


# ----------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------


def _data_config_class():
    from megatron_ext.data.config import DataConfig

    return DataConfig


class _DriverArgumentParser(argparse.ArgumentParser):
    """argparse, with its errors reported once per job (every rank parses the same flags),
    as one line: the usage (~130 lines) would bury the cause."""

    def error(self, message: str):
        from megatron_ext.refusal import report_refusal

        report_refusal(f"{self.prog}: error: {message} ('{self.prog} --help' lists the flags)")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    """The driver's parser: model presets, run files, driver flags, data and ext flags."""
    parser = _DriverArgumentParser(
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
    # Every numeric flag in its range first (one line naming the flag and the range), then
    # the relations that would fail inside the run: the table Megatron-LM's hooks use too.
    check_flag_values(args)
    check_flag_relations(args)
    cfg = DriverConfig(
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
    _check_kernels(cfg)
    return cfg


def _check_kernels(cfg: DriverConfig) -> None:
    """Refuse Transformer Engine layers without Transformer Engine, NCCL where it cannot
    run, and fused kernels of the local spec whose Apex extensions are not installed (the
    driver never fuses gradient accumulation, and never fuses on CPU)."""
    import torch

    from megatron_ext.megatron.lm.requirements import check_local_spec_kernels

    check_transformer_engine(cfg.model.transformer_impl)
    check_backend(cfg.parallel.distributed_backend, cfg.training.cpu)
    if not cfg.training.cpu and not torch.cuda.is_available():
        return  # refused at start-up naming --cpu, the flag such a machine needs
    check_local_spec_kernels(
        transformer_impl=cfg.model.transformer_impl,
        half=cfg.training.bf16,
        masked_softmax_fusion=cfg.model.masked_softmax_fusion and not cfg.training.cpu,
        gradient_accumulation_fusion=False,
        persist_layer_norm=cfg.model.persist_layer_norm and not cfg.training.cpu,
    )


def batch_change_warning(saved_gbs: Optional[int], gbs: int) -> Optional[str]:
    """The warning for a resume with another global batch than the checkpoint's (None if
    the same, or unknown). Allowed, as in Megatron-LM, but rarely meant on a resume with
    another data-parallel size: the default global batch is micro batch x DP."""
    if saved_gbs is None or saved_gbs == gbs:
        return None
    return (
        f"megatron-ext: WARNING: the checkpoint was trained with global batch {saved_gbs}, "
        f"this run uses {gbs} (pass --global-batch-size {saved_gbs} to continue the same "
        "optimization)"
    )


def _torchft_site(cfg: DriverConfig) -> Optional[tuple]:
    """``(site id, number of sites)`` with --outer-transport torchft, else None."""
    if cfg.ext.methods["outer"] == "none":
        return None
    from megatron_ext.options.outer import OuterConfig

    o = cfg.ext.options_for(OuterConfig)
    return (o.site_id, o.sites) if o.transport == "torchft" else None


class _ShardSampler:
    """A sampler's indices shifted by ``offset``: one site's own block of the training
    samples (``--outer-sites`` blocks of ``--train-iters`` global batches each)."""

    fixed = False

    def __init__(self, base, offset: int):
        self.base = base
        self.offset = int(offset)
        self.micro_batch_size = base.micro_batch_size
        self.dp_rank = base.dp_rank
        self.dp_size = base.dp_size

    def indices(self, consumed_samples: int, microbatch: int = 0):
        return self.base.indices(consumed_samples, microbatch) + self.offset


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


class Trainer:
    """Builds everything on each rank and runs the loop (see module docstring).

    Build order (each a method, so tests can rebuild pieces): :meth:`setup_distributed`,
    :meth:`build_data`, :meth:`build_model` (megatron_ext's model transforms run here,
    before DDP wraps the model), :meth:`build_optimizer`, :meth:`install_ext`.
    """

    on_step_batch = None
    """Optional callback receiving each microbatch a rank reads (tests use it)."""

    exit_signals = None
    """The installed :class:`~megatron_ext.signals.ExitSignalHandler`, with
    ``--exit-signal-handler``."""

    run_dir = None
    """Rank 0's directory for the reports of a run without --save (see ``run_training``)."""

    def __init__(self, cfg: DriverConfig):
        self.cfg = cfg
        self.runtime = None
        self._eval_consumed = 0
        self._last_saved: Optional[int] = None
        self._last_grad_norm = None

    # -- setup ----------------------------------------------------------------------------

    def setup_distributed(self) -> None:
        """Process groups (gloo on CPU) and seeds."""
        import torch

        from megatron_ext.megatron import training

        cfg = self.cfg
        self.sizes = layout_sizes(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        # The methods' combination checks, before the ranks talk (build_model checks again
        # against parallel_state's layout, which is the same).
        validate_ext_config(cfg.ext, driver_layout(cfg, self.sizes))
        threads = cfg.training.num_threads
        if cfg.training.cpu and threads is None:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            threads = max(1, (os.cpu_count() or 1) // local)
        if threads:
            torch.set_num_threads(threads)
        self.ps, self.rank, self.world = training.init_distributed(
            cpu=cfg.training.cpu,
            backend=cfg.parallel.distributed_backend,
            tp=self.sizes["tp"],
            pp=self.sizes["pp"],
            timeout_minutes=cfg.parallel.distributed_timeout_minutes,
            dist_opt_instances=cfg.parallel.num_distributed_optimizer_instances,
        )
        self.seed()

    def seed(self) -> None:
        """Seed every generator as Megatron-LM does (seed + 100 * pipeline rank)."""
        from megatron_ext.megatron.training import seed_all

        seed_all(self.cfg.training.seed)

    def build_data(self) -> None:
        """Tokenizer and the train / validation GPT datasets."""
        import torch

        from megatron_ext.megatron import data as ext_data

        cfg, sizes = self.cfg, self.sizes
        t0 = time.time()
        self.tokenizer = ext_data.build_tokenizer(cfg.data)
        iters = cfg.training.train_iters
        eval_runs = (iters // cfg.training.eval_interval if cfg.training.eval_interval else 0) + 1
        self.dp_rank = self.ps.get_data_parallel_rank()
        self.dp_size = self.ps.get_data_parallel_world_size()
        self.sampler = self._train_sampler()
        shards = 1
        site = _torchft_site(cfg)
        if site is not None:
            # DiLoCo sites in separate jobs: site s of N reads its own block of the samples.
            site_id, shards = site
            self.sampler = _ShardSampler(self.sampler, site_id * iters * sizes["gbs"])
        num_samples = (
            self.sampler.num_samples if self.sampler.fixed else shards * iters * sizes["gbs"],
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
        self.needs_data = self.ps.is_pipeline_first_stage() or self.ps.is_pipeline_last_stage()
        fixed = (
            f" (fixed samples: {self.sampler.num_samples}, {self.sampler.per_rank} per "
            "data-parallel rank, a new order each epoch)"
            if self.sampler.fixed
            else ""
        )
        print_rank_0(
            f"> data{fixed}: {len(self.train_ds)} train / "
            f"{0 if self.valid_ds is None else len(self.valid_ds)} valid samples of "
            f"{cfg.model.seq_length} tokens, vocab {self.tokenizer.vocab_size} "
            f"({time.time() - t0:.1f} s)"
        )
        torch.distributed.barrier()

    def _train_sampler(self):
        """Which sample ids training microbatches take (fixed-sample mode or one pass)."""
        from megatron_ext.megatron.data import SequentialSampler, fixed_sample_sampler

        cfg = self.cfg
        mbs = cfg.training.micro_batch_size
        if not cfg.data.fixed_samples:
            return SequentialSampler(mbs, self.dp_rank, self.dp_size)
        return fixed_sample_sampler(
            cfg.data.fixed_samples,
            mbs,
            self.sizes["num_microbatches"],
            self.dp_rank,
            self.dp_size,
            cfg.training.seed,
        )

    def build_model(self, stock: bool = False) -> None:
        """The GPT model of this stage, megatron_ext's methods and the DDP wrapper.

        Args:
            stock: install nothing of megatron_ext (the stock megatron-core baseline that
                parity tests and benchmarks compare against).
        """
        from megatron_ext.megatron import training
        from megatron_ext.megatron.runtime import (
            ExtRuntime,
            StockRuntime,
            parallel_layout,
        )

        cfg, m = self.cfg, self.cfg.model
        self.config = training.transformer_config(
            m, cfg.training, tp=self.sizes["tp"], pp=self.sizes["pp"]
        )
        ddp_cfg = training.ddp_config(cfg.parallel, cfg.training)
        # The methods are built before the model is wrapped: a method that changes the
        # model does so before DDP allocates gradient buffers for it.
        if stock:
            self.runtime = StockRuntime()
        else:
            layout = parallel_layout(ddp_cfg, m.transformer_impl)
            self.runtime = ExtRuntime.create(cfg.ext, layout)
        model, self.padded_vocab = training.build_gpt_model(
            m, self.config, vocab_size=self.tokenizer.vocab_size, tp=self.sizes["tp"]
        )
        if not stock:
            self.runtime.transform_model([model])
        self.model = [training.wrap_ddp(model, self.config, ddp_cfg, cpu=cfg.training.cpu)]
        num_params = training.count_parameters(self.model)
        print_rank_0(
            f"> model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} "
            f"heads, vocab {self.padded_vocab} (padded): {num_params / 1e6:.2f}M parameters per "
            f"tensor-parallel rank"
        )

    def build_optimizer(self) -> None:
        """megatron-core's optimizer and LR schedule."""
        from megatron_ext.megatron.training import build_optimizer

        cfg = self.cfg
        self.optimizer, self.scheduler = build_optimizer(
            cfg.training, cfg.parallel, self.config, self.model, gbs=self.sizes["gbs"]
        )

    def install_ext(self) -> None:
        """Wire megatron's grad-sync callables and install megatron_ext's seams."""
        from megatron_ext.megatron import training
        from megatron_ext.megatron.runtime import ExtRuntime

        training.wire_grad_sync(self.config, self.model, self.optimizer, self.cfg.parallel)
        self.param_gather = training.ParamGather(self.model, self.config, self.cfg.parallel)
        if isinstance(self.runtime, ExtRuntime):
            from megatron_ext.methods.registry import SampleSpace

            sampler = self.sampler
            self.runtime.install(
                self.model,
                self.optimizer,
                model_config=self.config,
                scheduler=self.scheduler,
                transformer_impl=self.cfg.model.transformer_impl,
                samples=SampleSpace(
                    fixed=sampler.fixed,
                    num_samples=sampler.num_samples if sampler.fixed else 0,
                    dp_rank=self.dp_rank,
                    dp_size=self.dp_size,
                    micro_batch_size=self.cfg.training.micro_batch_size,
                    num_microbatches=self.sizes["num_microbatches"],
                    seq_length=self.cfg.model.seq_length,
                    train_iters=self.cfg.training.train_iters,
                ),
            )
            for line in self.runtime.descriptions():
                print_rank_0(f"> megatron-ext: {line}")

    def checkpoint_parts(self) -> Dict[str, Any]:
        """What a checkpoint holds of this trainer: the ``model_chunks``, ``optimizer``,
        ``scheduler`` and ``runtime`` keyword arguments of
        :func:`~megatron_ext.megatron.checkpoint.save_checkpoint` and
        :func:`~megatron_ext.megatron.checkpoint.load_checkpoint`."""
        return dict(
            model_chunks=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            runtime=self.runtime,
        )

    def sync_params(self) -> None:
        """Make every rank's model parameters current (the distributed optimizer with
        overlapped parameter gather leaves them one gather behind after a step)."""
        self.param_gather.sync()

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
            sampler=self.sampler if dataset is self.train_ds else None,
        )

    def _sample_ids_fn(self, consumed: int):
        sampler = self.sampler
        return lambda microbatch: sampler.indices(consumed, microbatch)

    def forward_step(self, data_iterator, model):
        """megatron's forward_step_func: one microbatch through this stage."""
        from megatron_ext.megatron.training import gpt_forward_step

        batch = next(data_iterator) if data_iterator is not None else None
        if self.on_step_batch is not None and batch is not None:
            self.on_step_batch(batch)
        return gpt_forward_step(batch, model, cpu=self.cfg.training.cpu)

    def _forward_backward(self, data_iterator, forward_only: bool):
        from megatron_ext.megatron.training import forward_backward

        return forward_backward(
            self.forward_step,
            data_iterator,
            self.model,
            num_microbatches=self.sizes["num_microbatches"],
            seq_length=self.cfg.model.seq_length,
            micro_batch_size=self.cfg.training.micro_batch_size,
            forward_only=forward_only,
            **self.runtime.forward_backward_kwargs(),
        )

    def train_step(self, iteration: int, consumed: int, data_iterator):
        """One iteration: forward/backward over all microbatches, optimizer step.

        Returns:
            ``(loss or None off the last stage, grad norm, update_successful)``; the loss is a
            0-d device tensor (``float()`` it to read it: that synchronizes).
        """
        from megatron_ext.megatron.training import reduce_lm_loss

        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.runtime.begin_step(iteration, sample_ids_fn=self._sample_ids_fn(consumed))
        losses = self._forward_backward(data_iterator, forward_only=False)
        update_successful, grad_norm, _ = self.optimizer.step()
        if update_successful:
            self.scheduler.step(increment=self.sizes["gbs"])
        return reduce_lm_loss(losses), grad_norm, update_successful

    def evaluate(self, step: int) -> Optional[float]:
        """Validation loss over --eval-iters iterations (forward only)."""
        import torch

        from megatron_ext.megatron.training import reduce_lm_loss

        t = self.cfg.training
        if self.valid_ds is None or t.eval_iters == 0:
            return None
        hooks_were_enabled = self.param_gather.hooks_enabled
        self.param_gather.disable()
        for chunk in self.model:
            chunk.eval()
        total = 0.0
        count = 0
        with torch.no_grad():
            for _ in range(t.eval_iters):
                iterator = self._iterator(self.valid_ds, self._eval_consumed)
                self.runtime.begin_step(step, forward_only=True)
                value = reduce_lm_loss(self._forward_backward(iterator, forward_only=True))
                if value is not None:
                    total += float(value)
                    count += 1
                self._eval_consumed += self.sizes["gbs"]
        for chunk in self.model:
            chunk.train()
        if hooks_were_enabled:
            self.param_gather.enable()
        return total / count if count else None

    # -- the loop ---------------------------------------------------------------------------

    def _resume(self) -> tuple:
        """``(iteration, consumed samples)`` after loading ``--load`` (zeros without one)."""
        from megatron_ext.accounting import ProcessGroupTrafficMeter
        from megatron_ext.megatron import checkpoint as ckpt

        cfg = self.cfg
        self._eval_consumed = 0
        if not cfg.checkpoint.load:
            return 0, 0
        with ProcessGroupTrafficMeter.untracked():
            loaded = ckpt.load_checkpoint(
                cfg.checkpoint.load,
                **self.checkpoint_parts(),
                on_mismatch=cfg.ext.checkpoint.on_mismatch,
                model_only=cfg.checkpoint.finetune,
                save=cfg.checkpoint.save,
                verify_checksums=cfg.ext.checkpoint.verify_checksums,
            )
        if loaded is None:
            if cfg.checkpoint.finetune:
                raise ConfigError(
                    ["--finetune", "--load"], f"no checkpoint to fine-tune in {cfg.checkpoint.load}"
                )
            # Only when --load is --save (auto-resume); any other --load without a checkpoint
            # is refused by load_checkpoint.
            print_rank_0(
                f"> no checkpoint in {cfg.checkpoint.load} (the --save directory) yet; "
                "starting from scratch"
            )
            return 0, 0
        if cfg.checkpoint.finetune:
            # The distributed optimizer's fp32 main copies were made from the initial weights.
            self.optimizer.reload_model_params()
            print_rank_0(f"> fine-tuning from the model weights of {loaded['finetune_from']}")
            return 0, 0
        self._eval_consumed = loaded.get("eval_consumed_samples", 0)
        warning = batch_change_warning(loaded.get("global_batch_size"), self.sizes["gbs"])
        if warning:
            print_rank_0(warning)
        print_rank_0(f"> resumed from {cfg.checkpoint.load} at iteration {loaded['iteration']}")
        return loaded["iteration"], loaded["consumed_samples"]

    def run(self) -> Dict[str, Any]:
        """Train; returns a summary dict (also written to the JSON reports)."""
        cfg = self.cfg
        t = cfg.training
        gbs = self.sizes["gbs"]
        iteration, consumed = self._resume()
        start_iteration = iteration
        log = _TrainLog(self, enabled_writers=is_last_rank())
        data_iterator = self._iterator(self.train_ds, consumed)
        last_eval = None
        progress = _Progress(t.train_iters, enabled=cfg.logging.progress and is_last_rank())
        stop_at = min(t.train_iters, t.exit_interval or t.train_iters)
        self.param_gather.start()
        self._check_weight_hashes(iteration)
        self._last_saved = None
        stop_signal = None
        while iteration < stop_at:
            # Between iterations (also before the first): a signal during the step (or during
            # setup) stops here, on every rank at the same iteration.
            stop_signal = self._exit_signal_received()
            if stop_signal is not None:
                break
            t0 = time.time()
            loss, grad_norm, ok = self.train_step(iteration, consumed, data_iterator)
            self._last_grad_norm = grad_norm
            if ok:
                self.param_gather.step_succeeded()
            traffic = self.runtime.end_step(update_successful=ok)
            iteration += 1
            consumed += gbs
            log.add_step(time.time() - t0, loss, traffic)
            progress.update(iteration, log.logged_loss)
            if t.eval_interval and iteration % t.eval_interval == 0:
                last_eval = self.evaluate(iteration)
            if iteration % cfg.logging.log_interval == 0 or iteration == stop_at:
                log.emit(iteration, consumed, grad_norm, last_eval)
            hash_every = t.check_weight_hash_across_dp_replicas_interval
            if hash_every and iteration % hash_every == 0:
                self._check_weight_hashes(iteration)
            save_due = (
                cfg.checkpoint.save_interval and iteration % cfg.checkpoint.save_interval == 0
            )
            if cfg.checkpoint.save and save_due and iteration < stop_at:
                self._save(iteration, consumed)
        progress.close()
        self.param_gather.disable()
        if stop_signal is not None:
            # Time is short (Slurm kills after its grace period, torchrun after its shutdown
            # timeout): save, no final evaluation.
            final_eval = last_eval
            if log.pending:
                log.emit(iteration, consumed, self._last_grad_norm, last_eval)
        elif not t.eval_interval or iteration % t.eval_interval:
            final_eval = self.evaluate(iteration) if iteration > start_iteration else None
        else:
            final_eval = last_eval
        if cfg.checkpoint.save and iteration > start_iteration and self._last_saved != iteration:
            self._save(iteration, consumed)
        if stop_signal is not None:
            if iteration == start_iteration:
                where = " (no iteration ran: nothing new to save)"
            elif cfg.checkpoint.save:
                where = f"; checkpoint at iteration {iteration} in {cfg.checkpoint.save}"
            else:
                where = " (no --save: nothing saved)"
            print_rank_0(
                f"> exiting after receiving {stop_signal.name} at iteration {iteration}{where}"
            )
        self.runtime.finish()  # what is still in flight (DiLoCo's overlapped exchanges)
        summary = self._summary(iteration, consumed, log, final_eval, start_iteration)
        summary["exit_signal"] = None if stop_signal is None else stop_signal.name
        log.close()
        return summary

    def _check_weight_hashes(self, iteration: int) -> None:
        """With ``--check-weight-hash-across-dp-replicas-interval``: the replicas hold the
        same weights (before the first iteration and every N iterations, as Megatron-LM)."""
        if self.cfg.training.check_weight_hash_across_dp_replicas_interval is None:
            return
        from megatron_ext.megatron.training import check_weight_hashes

        check_weight_hashes(self.model, iteration, self.param_gather)

    # -- checkpoints and reports -------------------------------------------------------------

    def _exit_signal_received(self):
        """The exit signal any rank received (collective), or None; always None without
        ``--exit-signal-handler``."""
        if self.exit_signals is None:
            return None
        from megatron_ext.accounting import ProcessGroupTrafficMeter

        # Control traffic of the driver, not training communication.
        with ProcessGroupTrafficMeter.untracked():
            return self.exit_signals.stop_requested()

    def _save(self, iteration: int, consumed: int) -> None:
        from megatron_ext.accounting import ProcessGroupTrafficMeter
        from megatron_ext.megatron import checkpoint as ckpt

        self._last_saved = iteration
        t0 = time.time()
        self.sync_params()
        # Checkpoint coordination is not training traffic (the Megatron-LM adapter excludes it
        # the same way).
        with ProcessGroupTrafficMeter.untracked():
            ckpt.save_checkpoint(
                self.cfg.checkpoint.save,
                iteration,
                **self.checkpoint_parts(),
                consumed_samples=consumed,
                extra_common={
                    "eval_consumed_samples": self._eval_consumed,
                    "global_batch_size": self.sizes["gbs"],
                },
            )
        print_rank_0(
            f"  saved checkpoint at iteration {iteration:8d} to {self.cfg.checkpoint.save} "
            f"({time.time() - t0:.1f} s)"
        )

    def _summary(self, iteration, consumed, log, final_eval, start_iteration=0) -> Dict[str, Any]:
        import torch

        from megatron_ext.accounting import collective_device, comm_report
        from megatron_ext.run_report import report_file, write_report

        cfg = self.cfg
        step_times = log.step_times
        warm = step_times[1:] if len(step_times) > 1 else step_times
        final_loss = next(
            (rec["lm_loss"] for rec in reversed(log.history) if rec.get("lm_loss") is not None),
            None,
        )
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
        mean_step = sum(warm) / max(1, len(warm))
        tokens_per_step = self.sizes["gbs"] * cfg.model.seq_length
        summary = {
            "start_iteration": start_iteration,
            "iterations": iteration,
            "consumed_samples": consumed,
            "steps_this_run": len(step_times),
            "mean_step_time_s": mean_step,
            # Steps after the first (its compilation and allocation excluded), all ranks.
            "tokens_per_s": tokens_per_step / mean_step if mean_step > 0 else None,
            "peak_memory": _peak_memory(self.world, cfg.training.cpu),
            "final_lm_loss": None if math.isnan(shared[0].item()) else shared[0].item(),
            "final_valid_loss": None if math.isnan(shared[1].item()) else shared[1].item(),
            "layout": dict(self.sizes),
            "world_size": self.world,
            "model_preset": cfg.model_preset,
            "config_file": cfg.config_file,
            "ext": cfg.ext.summary(),
            "comm": comm_report(self.runtime.meter),
            "history": log.history if is_last_rank() else [],
        }
        path = report_file(cfg.ext.comm.report, cfg.checkpoint.save, self.run_dir)
        if self.rank == 0 and cfg.ext.comm.accounting:
            # A resume adds its segment to the run's report (megatron_ext.run_report).
            for note in write_report(path, summary, start_iteration):
                print_rank_0(f"> {note}")
            print_rank_0(f"> communication report: {path}")
        valid = summary["final_valid_loss"]
        peak = summary["peak_memory"]
        print_rank_0(
            f"> done: {iteration} iterations, mean step {summary['mean_step_time_s'] * 1000:.1f} ms"
            + (
                ""
                if summary["tokens_per_s"] is None
                else f", {summary['tokens_per_s']:.0f} tokens/s"
            )
            + ("" if valid is None else f", validation loss {valid:.4f}")
            + ("" if peak is None else f", peak GPU memory {peak['max_allocated_gib']:.2f} GiB")
        )
        return summary


def _peak_memory(world: int, cpu: bool) -> Optional[Dict[str, Any]]:
    """The largest per-rank CUDA peak (``max_memory_allocated`` / ``max_memory_reserved``, GiB)
    over all ranks, or None with ``--cpu``. A collective: every rank calls it."""
    import torch

    from megatron_ext.accounting import collective_device

    if cpu:
        return None
    peak = torch.tensor(
        [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()],
        dtype=torch.float64,
        device=collective_device(),
    )
    if world > 1:
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    allocated, reserved = (float(x) / 2**30 for x in peak.tolist())
    return {"max_allocated_gib": allocated, "max_reserved_gib": reserved}


class _TrainLog:
    """Per-interval accumulation and output: Megatron's iteration line (last rank),
    TensorBoard scalars and one JSON record per logged iteration."""

    def __init__(self, trainer: Trainer, *, enabled_writers: bool):
        self.trainer = trainer
        cfg = trainer.cfg
        self.step_times: List[float] = []
        self.history: List[Dict[str, Any]] = []
        self.logged_loss: Optional[float] = None
        """The last logged interval's mean loss (what the progress bar shows)."""
        self._losses: List[Any] = []  # device tensors, read on the host at emit only
        self._traffic: Dict[str, Any] = {}
        self._iters = 0
        self.writer = None
        self.log_file = None
        if not enabled_writers:
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

    @property
    def pending(self) -> bool:
        """Whether iterations since the last :meth:`emit` are not logged yet."""
        return self._iters > 0

    def add_step(self, seconds: float, loss: Optional[float], traffic: Dict[str, Any]) -> None:
        """One finished iteration."""
        from megatron_ext.accounting import Traffic

        self.step_times.append(seconds)
        self._iters += 1
        if loss is not None:
            self._losses.append(loss)
        for c, tr in traffic.items():
            self._traffic.setdefault(c, Traffic()).add(tr)

    def emit(self, iteration, consumed, grad_norm, eval_loss) -> Dict[str, Any]:
        """Log the interval ending at ``iteration`` and start the next one."""
        from megatron_ext.accounting import (
            all_ranks_totals,
            comm_scalars,
            format_traffic,
        )

        trainer = self.trainer
        cfg = trainer.cfg
        iters = self._iters
        # Like Megatron-LM's interval timer: checkpointing and evaluation excluded.
        step_time = sum(self.step_times[-iters:]) / iters
        traffic = all_ranks_totals(self._traffic)[0] if cfg.ext.comm.accounting else {}
        lr = trainer.optimizer.param_groups[0]["lr"]
        # The interval's one host read of the losses (not one synchronization per step).
        losses = [float(x) for x in self._losses]
        loss = sum(losses) / len(losses) if losses else None
        if loss is not None:
            self.logged_loss = loss
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
        self.history.append(record)
        self._losses, self._traffic, self._iters = [], {}, 0
        if not is_last_rank():
            return record
        ts = datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")
        line = (
            f" [{ts}] iteration {iteration:8d}/{cfg.training.train_iters:8d} |"
            f" consumed samples: {consumed:12d} |"
            f" elapsed time per iteration (ms): {step_time * 1000:.1f} |"
            f" learning rate: {lr:.6E} |"
            f" global batch size: {trainer.sizes['gbs']:5d} |"
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

    def close(self) -> None:
        """Flush and close the writers."""
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
        if self.log_file is not None:
            self.log_file.close()


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


def run_training(cfg: DriverConfig) -> Dict[str, Any]:
    """Set up a full run from a parsed config and train (call on every rank)."""
    from megatron_ext.megatron import mcore

    # An unsupported megatron-core is refused before any process group or model exists.
    mcore.release()
    # megatron-core's checkpoint writer processes must not outlive a killed rank, nor a rank
    # its killed launcher.
    from megatron_ext.child_processes import bind_process_lifetimes

    bind_process_lifetimes()
    # A --save that cannot be written stops here, not at the first checkpoint.
    check_writable(cfg.checkpoint.save, "--save")
    if cfg.checkpoint.load:
        from megatron_ext.megatron.checkpoint import resolve_load
        from megatron_ext.run_report import check_not_finished

        # A --load that names no checkpoint is refused here too (a typo would otherwise train
        # from scratch and overwrite the checkpoints under --save); so is one of a finished
        # run (it would load for tens of seconds, train nothing and rewrite the report).
        found = resolve_load(cfg.checkpoint.load, save=cfg.checkpoint.save)
        check_not_finished(
            cfg.checkpoint.load,
            None if found is None else found[1],
            cfg.training.train_iters,
            finetune=cfg.checkpoint.finetune,
        )
    trainer = Trainer(cfg)
    if not cfg.training.exit_signal_handler:
        return _build_and_train(trainer)
    from megatron_ext.signals import ExitSignalHandler

    # Installed before the (long) setup: a signal during it stops before the first iteration.
    with ExitSignalHandler() as handler:
        trainer.exit_signals = handler
        return _build_and_train(trainer)


def _run_dir(cfg: DriverConfig) -> Optional[str]:
    """Rank 0 of a run whose report has no place (no --save, no --comm-report): a fresh
    run directory, named on the start-up lines (None on other ranks and otherwise)."""
    from megatron_ext.logging import is_rank_0
    from megatron_ext.run_report import fresh_run_dir

    if not cfg.ext.comm.accounting or cfg.ext.comm.report or cfg.checkpoint.save:
        return None
    if not is_rank_0():
        return None
    path = fresh_run_dir()
    print_rank_0(f"> run directory: {path} (no --save: the reports go here)")
    return path


def _build_and_train(trainer: Trainer) -> Dict[str, Any]:
    from megatron_ext.run_report import discard_if_empty

    trainer.setup_distributed()
    trainer.run_dir = _run_dir(trainer.cfg)
    try:
        trainer.build_data()
        trainer.build_model()
        trainer.build_optimizer()
        trainer.install_ext()
        return trainer.run()
    except BaseException:
        # A refusal (or any stop) before the run wrote anything leaves no empty runs/<stamp>.
        discard_if_empty(trainer.run_dir)
        raise


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point; returns the exit code."""
    from megatron_ext import quiet

    # Known-harmless library warnings off the screen (MEGATRON_EXT_VERBOSE_WARNINGS=1 shows
    # them), before megatron is imported.
    quiet.install()
    from megatron_ext.megatron.checkpoint import CheckpointSaveError
    from megatron_ext.protocols import NonFiniteError
    from megatron_ext.refusal import report_refusal
    from megatron_ext.state import StateMismatch

    # Every rank that refuses reports; the line is printed once per job and is out before
    # any rank exits (megatron_ext.refusal).
    try:
        cfg = parse_args(argv)
    except ConfigError as exc:
        report_refusal(f"megatron-ext train: error: {exc}")
        return 2
    try:
        run_training(cfg)
    except (ConfigError, StateMismatch) as exc:
        report_refusal(f"megatron-ext train: error: {exc}")
        return 2
    except CheckpointSaveError as exc:
        # Rank 0 holds every rank's failure; the others report only if it does not.
        report_refusal(f"megatron-ext train: error: {exc}", defer_s=0 if exc.detailed else 15)
        return 1
    except NonFiniteError as exc:
        # A NaN or Inf that nothing could skip, stopped before it was applied or saved.
        report_refusal(f"megatron-ext train: error: {str(exc).removeprefix('megatron-ext: ')}")
        return 1
    finally:
        import torch

        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
