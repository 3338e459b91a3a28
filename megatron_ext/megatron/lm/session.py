"""What megatron-ext does inside one Megatron-LM training process, independent of the release.

What it does:
    :class:`MegatronLMSession` holds the per-process state of the integration and does the
    work the release-specific hook modules (``core_v0_16``) call into:

    * :meth:`~MegatronLMSession.configure`: after Megatron-LM's ``validate_args``, build
      :class:`~megatron_ext.config.ExtConfig` from the parsed args and check it against the
      parallel layout and the Megatron-LM options the hooks rely on (checkpoint format,
      CUDA graphs, FSDP, CPU execution needs);
    * :meth:`~MegatronLMSession.model_provider` (0.16) / :meth:`~MegatronLMSession.pre_wrap_hook`
      (0.19): build the methods and run their model transforms on each chunk Megatron-LM
      builds, before it moves, converts and DDP-wraps it (Grass's virtual parameters);
    * :meth:`~MegatronLMSession.install_runtime`: once the DDP model chunks and the
      optimizer exist (before Megatron-LM loads a checkpoint), install every seam
      (:func:`megatron_ext.megatron.runtime.install`) and log once on rank 0 what was
      installed;
    * per iteration: :meth:`~MegatronLMSession.begin_train_step` /
      :meth:`~MegatronLMSession.end_train_step` around ``train_step`` (Megatron-LM's
      iteration and the ``MegatronPretrainingSampler`` sample ids),
      :meth:`~MegatronLMSession.before_forward_backward` for every schedule call (evaluation
      included) and the schedule kwargs (``p2p_communicator=``, ``pg_collection=``);
    * logging: the interval's bytes per category, summed over ranks, as a field of
      Megatron-LM's iteration line and as TensorBoard / W&B scalars;
    * checkpoints: megatron-ext's per-rank state in ``torch_dist`` and ``torch``
      checkpoints (:mod:`megatron_ext.megatron.lm.checkpoint`), their checksums (written at
      save, verified before a load: :mod:`megatron_ext.megatron.checksums`), and, with
      Megatron-LM's ``--exit-signal-handler``, child processes shielded from its exit
      signal (:mod:`megatron_ext.child_processes`);
    * the JSON communication report at the end of training.

Why a session object:
    Megatron-LM's seams move between releases but what has to happen at them does not. A
    hook module for a new release only maps that release's functions onto these methods.

Constraints:
    One model/optimizer per process (what ``pretrain()`` builds). Errors a user can fix
    (a bad flag, an unsupported combination, a checkpoint whose megatron-ext state does
    not fit) end the process with exit code 2 and a message naming the flag, on every rank
    alike, through :meth:`~MegatronLMSession.clean_errors`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from megatron_ext.accounting import (
    ProcessGroupTrafficMeter,
    Traffic,
    all_ranks_totals,
    collective_device,
    comm_report,
    comm_scalars,
    format_traffic,
)
from megatron_ext.config import ConfigError, ExtConfig, ext_config_from_args, validate_ext_config
from megatron_ext.logging import is_rank_0, print_rank_0
from megatron_ext.megatron.lm import checkpoint as lm_ckpt
from megatron_ext.megatron.lm.arguments import (
    check_load_not_finished,
    check_megatron_lm_args,
    layout_from_args,
    microbatches,
)
from megatron_ext.megatron.lm.releases import MegatronLMRelease, UnsupportedReleaseError
from megatron_ext.megatron.save_checks import check_finite_for_save
from megatron_ext.preflight import (
    PreflightError,
    check_megatron_lm_defaults,
    check_save_interval,
)
from megatron_ext.protocols import NonFiniteError
from megatron_ext.refusal import report_refusal
from megatron_ext.run_report import (
    discard_if_empty,
    fresh_run_dir,
    report_file,
    write_report,
)
from megatron_ext.state import StateMismatch
from megatron_ext.validation import (
    check_backend,
    check_flag_relations,
    check_flag_values,
    check_transformer_engine,
    check_writable,
)

if TYPE_CHECKING:  # megatron.core is imported when the process groups exist, not with this
    from megatron.core.optimizer import MegatronOptimizer

    from megatron_ext.megatron.data import FixedSampleSampler
    from megatron_ext.megatron.runtime import ExtRuntime
    from megatron_ext.methods.registry import SampleSpace

__all__ = ["MegatronLMSession"]


@dataclass
class _LoadContext:
    """What the hooks learn while Megatron-LM's ``load_checkpoint`` runs."""

    include: Optional[bool] = None
    """Load megatron-ext state (None: no checkpoint was found)."""

    where: str = ""
    """The checkpoint being loaded."""

    loaded: Optional[Dict[str, Any]] = None
    """This rank's state read from a torch_dist checkpoint."""

    checkpoint_name: Optional[str] = None
    """Megatron-LM's checkpoint name of the load (torch format: the per-(TP,PP) file)."""

    reason: str = ""
    """Why state was not loaded, for the log."""

    loaded_optimizer: bool = False
    """Megatron-LM asked for the optimizer's state (a load template was built with it)."""

    adam_step: Optional[float] = None
    """The torch Adam ``step`` the checkpoint's distributed-optimizer state holds."""

    sharded: Optional[Dict[Any, Any]] = None
    """Path -> sharded object of the torch_dist load template (names what is checked)."""


class MegatronLMSession:
    """megatron-ext inside one Megatron-LM training process (see module docstring).

    Args:
        release: the Megatron-LM release being hooked.
        cpu: whether CPU execution is on.
    """

    def __init__(self, release: MegatronLMRelease, cpu: bool):
        self.release = release
        self.cpu = cpu
        self.cpu_set_flags: List[str] = []
        self.cfg: Optional[ExtConfig] = None
        self.runtime: Optional[ExtRuntime] = None
        """The installed runtime (from :meth:`install_runtime` on)."""
        self._created: Optional[ExtRuntime] = None
        self.hook_names: List[str] = []
        self.python_shims: List[str] = []
        self.start_iteration: Optional[int] = None
        self.last_iteration: Optional[int] = None
        self.interval: Dict[str, Traffic] = {}
        self.interval_steps = 0
        self.pending_log_field = ""
        self._step: Optional[int] = None
        self._sample_ids_fn: Optional[Callable[[int], torch.Tensor]] = None
        self._fixed: Optional[FixedSampleSampler] = None
        self._load: Optional[_LoadContext] = None
        self._saving = False
        self._optimizer: Optional[MegatronOptimizer] = None
        self._model_chunks: List[torch.nn.Module] = []
        self._saving_iteration: Optional[int] = None
        self._report_written = False
        self.run_dir: Optional[str] = None
        """Rank 0's directory for the report of a run without --save (made at configure)."""

    # -- errors ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def clean_errors(self) -> Iterator[None]:
        """Turn user-fixable errors into ``megatron-ext: error: ...`` and exit code 2."""
        try:
            yield
        except (ConfigError, PreflightError, StateMismatch, UnsupportedReleaseError) as exc:
            # Every refusing rank reports: the line is printed once, by the first of them,
            # and is out before any of them exits (megatron_ext.refusal).
            discard_if_empty(self.run_dir)  # a refusal leaves no empty runs/<stamp>
            report_refusal(f"megatron-ext: error: {exc}")
            raise SystemExit(2) from None

    @contextlib.contextmanager
    def stop_on_nonfinite(self) -> Iterator[None]:
        """Turn a :class:`~megatron_ext.protocols.NonFiniteError` (a NaN or Inf that
        nothing could skip, stopped before it was applied or saved) or a refused save into
        one line, printed once, and exit code 1."""
        try:
            yield
        except (NonFiniteError, lm_ckpt.CheckpointSaveError) as exc:
            discard_if_empty(self.run_dir)
            report_refusal(f"megatron-ext: error: {str(exc).removeprefix('megatron-ext: ')}")
            raise SystemExit(1) from None

    # -- arguments ---------------------------------------------------------------------------

    def check_values(self, args: argparse.Namespace) -> None:
        """Before Megatron-LM's ``validate_args``: every numeric flag in its range and the
        flag relations of :mod:`megatron_ext.validation` (the driver's table), refused with
        one line naming the flag instead of an assertion or a failure inside training; and
        ``--save`` without ``--save-interval``, which that function only asserts.

        Raises:
            ConfigError: naming the flag and its range.
            PreflightError: naming ``--save-interval``.
        """
        check_flag_values(args)
        check_flag_relations(args)
        check_save_interval(args)

    def configure(self, args: argparse.Namespace) -> ExtConfig:
        """Build and check megatron-ext's config from Megatron-LM's validated args.

        Raises:
            ConfigError, PreflightError: naming the flag(s).
        """
        if self.cpu:
            # First: it sets the CUDA-only fusions off, which the checks below read, and a
            # missing CPU flag is the fix to name before any GPU-side advice.
            from megatron_ext.megatron.lm.cpu import check_cpu_args

            self.cpu_set_flags = check_cpu_args(args)
        # The zero-touch launcher checked these already; a patched pretrain_gpt.py did not.
        check_megatron_lm_defaults(args)
        cfg = ext_config_from_args(args)
        validate_ext_config(cfg, layout_from_args(args))
        check_megatron_lm_args(args, cfg)
        # The environment, as the driver checks it: before any process group or model.
        check_transformer_engine(args.transformer_impl)
        check_backend(getattr(args, "distributed_backend", None), self.cpu)
        check_writable(args.save, "--save")
        check_load_not_finished(args)
        if (
            self.run_dir is None
            and cfg.comm.accounting
            and not cfg.comm.report
            and not args.save
            and is_rank_0()
        ):
            # The report's place (the working directory was overwritten by the next run).
            self.run_dir = fresh_run_dir()
            print_rank_0(
                f"> megatron-ext: run directory: {self.run_dir} (no --save: the reports go here)"
            )
        if getattr(args, "exit_signal_handler", False):
            # Megatron-LM catches this one signal to save and exit (--exit-signal, default
            # SIGTERM); the checkpoint writer processes it starts must outlive it until the
            # save is done (they die with their rank: megatron_ext.child_processes).
            from megatron_ext.child_processes import shield_children

            shield_children((args.exit_signal,))
        self.cfg = cfg
        return cfg

    # -- installation ------------------------------------------------------------------------

    def _create_runtime(self, args: argparse.Namespace) -> ExtRuntime:
        """Build the selected methods (once per process; the process groups exist)."""
        from megatron_ext.megatron.runtime import ExtRuntime

        # validate_args was bypassed when cfg is None (e.g. --yaml-cfg goes through
        # validate_yaml).
        cfg = self.cfg if self.cfg is not None else self.configure(args)
        if self._created is None:
            self._created = ExtRuntime.create(cfg, layout_from_args(args))
        return self._created

    def _check_one_model(self) -> None:
        if self.runtime is not None:
            raise ConfigError(
                "--optimizer",
                "megatron-ext hooks one model and optimizer per process; Megatron-LM built a "
                "second model for training",
            )

    def model_provider(
        self, provider: Callable[..., Any], args: argparse.Namespace
    ) -> Callable[..., Any]:
        """``get_model``'s model provider, followed by the methods' model transforms.

        Megatron-LM (0.16) calls it once per model chunk, before it moves the chunk to the GPU,
        converts it to fp16/bf16 and wraps it in DDP: a method that changes parameters
        (Grass's virtual parameters) does so before DDP and the optimizer allocate
        gradient buffers and state for them, as in the megatron-core driver.
        """
        self._check_one_model()
        runtime = self._create_runtime(args)

        def build(*p_args: Any, **p_kwargs: Any) -> torch.nn.Module:
            model = provider(*p_args, **p_kwargs)
            with self.clean_errors():
                runtime.transform_model([model])
            return model

        return build

    def pre_wrap_hook(
        self, args: argparse.Namespace
    ) -> Callable[[List[torch.nn.Module]], List[torch.nn.Module]]:
        """A hook for 0.19's ``ModelConfig.pre_wrap_hooks``: the methods' model transforms
        on the built chunks (all of this rank's), before Megatron-LM wraps them."""
        self._check_one_model()
        runtime = self._create_runtime(args)

        def hook(model_chunks: List[torch.nn.Module]) -> List[torch.nn.Module]:
            with self.clean_errors():
                runtime.transform_model(list(model_chunks))
            return model_chunks

        return hook

    def install_runtime(
        self,
        model_chunks: List[torch.nn.Module],
        optimizer: MegatronOptimizer,
        args: argparse.Namespace,
    ) -> None:
        """Install every seam on the model chunks and the optimizer (once per process)."""
        from megatron.core.utils import get_model_config

        if self.runtime is not None:
            raise ConfigError(
                "--optimizer",
                "megatron-ext hooks one model and optimizer per process; Megatron-LM built a "
                "second optimizer",
            )
        self._optimizer = optimizer
        self._model_chunks = list(model_chunks)
        self.runtime = self._create_runtime(args).install(
            list(model_chunks),
            optimizer,
            model_config=get_model_config(model_chunks[0]),
            transformer_impl=args.transformer_impl,
            samples=self._sample_space(args),
        )
        self._log_installed(args)

    def _fixed_sampler(self, args: argparse.Namespace) -> Optional[FixedSampleSampler]:
        """This rank's :class:`~megatron_ext.megatron.data.FixedSampleSampler` (or None)."""
        if getattr(args, "fixed_samples", None) is None:
            return None
        if self._fixed is None:
            from megatron.core import parallel_state as ps

            from megatron_ext.megatron.data import fixed_sample_sampler

            dp_size = ps.get_data_parallel_world_size()
            self._fixed = fixed_sample_sampler(
                args.fixed_samples,
                args.micro_batch_size,
                microbatches(args, dp_size),
                ps.get_data_parallel_rank(),
                dp_size,
                args.seed,
            )
        return self._fixed

    def _sample_space(self, args: argparse.Namespace) -> SampleSpace:
        """The training samples as Megatron-LM's data loader hands them to this rank."""
        from megatron.core import parallel_state as ps

        from megatron_ext.methods.registry import SampleSpace

        fixed = self._fixed_sampler(args)
        dp_size = ps.get_data_parallel_world_size()
        return SampleSpace(
            fixed=fixed is not None,
            num_samples=0 if fixed is None else fixed.num_samples,
            dp_rank=ps.get_data_parallel_rank(),
            dp_size=dp_size,
            micro_batch_size=args.micro_batch_size,
            num_microbatches=microbatches(args, dp_size),
            seq_length=args.seq_length,
            train_iters=getattr(args, "train_iters", None),
        )

    def train_data_loader(
        self, dataset: Any, consumed_samples: int, args: argparse.Namespace
    ) -> Any:
        """Fixed-sample mode's training data loader (None: leave it to Megatron-LM).

        Called for every split Megatron-LM builds a loader for; only the training split of
        a run with ``--fixed-samples`` gets one here: epochs over the first N samples of
        the split, which Megatron-LM's dataset built once, so an id always means the same
        tokens.

        Raises:
            ConfigError: naming ``--fixed-samples`` when the split has fewer samples.
        """
        fixed = self._fixed_sampler(args)
        if fixed is None or dataset is None:
            return None
        from megatron.core.datasets.utils import Split

        split = getattr(dataset, "split", getattr(dataset, "index_split", None))
        if split != Split.train:
            return None
        if len(dataset) < fixed.num_samples:
            raise ConfigError(
                "--fixed-samples",
                f"the training split has {len(dataset)} samples, fewer than the "
                f"{fixed.num_samples} fixed samples asked for",
            )
        from megatron_ext.megatron.data import FixedSampleBatchSampler

        print_rank_0(
            f"> megatron-ext: fixed samples: {fixed.num_samples} of the training split, "
            f"{fixed.per_rank} per data-parallel rank, a new order each epoch "
            f"(from consumed samples {consumed_samples})"
        )
        return torch.utils.data.DataLoader(
            dataset,
            batch_sampler=FixedSampleBatchSampler(fixed, consumed_samples),
            num_workers=args.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=args.num_workers > 0,
        )

    def _site_of_sites(self) -> Optional[Tuple[int, int]]:
        """``(site, sites)`` of ``--outer-transport torchft`` (each site its own job), else
        None."""
        from megatron_ext.options.outer import OuterConfig

        if self.cfg is None or not self.cfg.enabled("outer"):
            return None
        outer = self.cfg.options_for(OuterConfig)
        if outer.transport != "torchft":
            return None
        return outer.site_id, outer.sites

    def train_valid_test_num_samples(
        self, numbers: Tuple[Any, ...], args: argparse.Namespace
    ) -> Tuple:
        """Megatron-LM's dataset sizes; with sites in separate jobs the training split holds
        every site's samples (N times this job's), so that each site reads a block of its
        own (:meth:`site_dataset`)."""
        sites = self._site_of_sites()
        if sites is None or numbers[0] is None:
            return numbers
        return (numbers[0] * sites[1], *numbers[1:])

    def site_dataset(self, dataset: Any, args: argparse.Namespace) -> Any:
        """The training split as this site reads it: with sites in separate jobs (torchft),
        site ``s`` of ``N`` reads the ``s``-th of ``N`` equal blocks of the split (disjoint
        shards; Megatron-LM's sampler then runs over the block, its consumed samples and
        resume included). Other splits, and one-world runs, unchanged."""
        sites = self._site_of_sites()
        if sites is None or dataset is None:
            return dataset
        from megatron.core.datasets.utils import Split

        split = getattr(dataset, "split", getattr(dataset, "index_split", None))
        if split != Split.train:
            return dataset
        site, num_sites = sites
        block = len(dataset) // num_sites
        print_rank_0(
            f"> megatron-ext: DiLoCo site {site} of {num_sites} reads the training samples "
            f"[{site * block}, {(site + 1) * block}) of {len(dataset)}"
        )
        return torch.utils.data.Subset(dataset, range(site * block, (site + 1) * block))

    def _log_installed(self, args: argparse.Namespace) -> None:
        rt = self.check_installed()
        cfg = rt.config
        seams = [
            f"grad reducer {type(rt.reducer).__name__} (--grad-compression {cfg.method('grad')})"
        ]
        if rt.communicator is not None:
            selector = (
                f"--subspace-method {cfg.method('subspace')}"
                if cfg.enabled("subspace")
                else f"--p2p-compression {cfg.method('p2p')}"
            )
            seams.append(f"P2P {type(rt.communicator).__name__} ({selector})")
        if rt.linear_handle is not None:
            seams.append(f"linear hooks (--grass-method {cfg.method('linear')})")
        seams.append("optimizer-step hooks")
        seams.append("byte accounting " + ("on" if cfg.comm.accounting else "off"))
        ckpt = {
            "torch_dist": f"ShardedObject '{lm_ckpt.SHARDED_OBJECT_KEY}' per rank",
            "torch": f"<iter dir>/{lm_ckpt.RANK_FILE_DIR}/rank_XXXXX.pt per rank",
        }.get(args.ckpt_format, "none")
        print_rank_0(
            f"> megatron-ext: hooked Megatron-LM {self.release.tag}: "
            f"{', '.join(self.hook_names)}\n"
            f"> megatron-ext: seams: {'; '.join(seams)}\n"
            f"> megatron-ext: checkpointed state ({args.ckpt_format}): {ckpt}; state objects: "
            f"{', '.join(rt.state.names) or 'none'}\n"
            f"> megatron-ext: CPU execution {'on' if self.cpu else 'off'}"
            + (f" (set: {' '.join(self.cpu_set_flags)})" if self.cpu_set_flags else "")
            + "; communication "
            f"report: {self.report_path(args) if cfg.comm.accounting else 'off'}"
        )
        for line in rt.descriptions():
            print_rank_0(f"> megatron-ext: {line}")
        if self.python_shims:
            need = ".".join(map(str, self.release.requires_python))
            print_rank_0(
                f"> megatron-ext: Python {sys.version_info.major}.{sys.version_info.minor} is "
                f"older than the {need} Megatron-LM {self.release.tag} declares; backported: "
                f"{', '.join(self.python_shims)}"
            )

    def check_installed(self) -> ExtRuntime:
        """The installed runtime; raises unless :meth:`install_runtime` ran (called when
        training starts)."""
        if self.runtime is None:
            raise ConfigError(
                "--optimizer",
                "megatron-ext's hooks never saw the optimizer being built (only "
                "get_megatron_optimizer / get_megatron_muon_optimizer are hooked); "
                "training would run without megatron-ext",
            )
        return self.runtime

    # -- iterations ----------------------------------------------------------------------------

    def begin_train_step(self, iteration: Optional[int], args: argparse.Namespace) -> None:
        """Before Megatron-LM's ``train_step`` (``iteration``: 0-based, steps done so far)."""
        step = getattr(args, "curr_iteration", 0) if iteration is None else iteration
        if self.start_iteration is None:
            self.start_iteration = step
        self._step = step
        self._sample_ids_fn = self._sample_ids(args)

    def end_train_step(self, update_successful: bool = True) -> None:
        """After ``train_step``: close the step's byte accounting and per-step state.

        Args:
            update_successful: whether Megatron-LM took the optimizer step (not
                ``skipped_iter``; the same on every rank).
        """
        totals = self.check_installed().end_step(update_successful=update_successful)
        for category, traffic in totals.items():
            self.interval.setdefault(category, Traffic()).add(traffic)
        self.interval_steps += 1
        self.last_iteration = (self._step or 0) + 1
        self._step = None
        self._sample_ids_fn = None

    def _sample_ids(self, args: argparse.Namespace) -> Optional[Callable[[int], torch.Tensor]]:
        """Microbatch -> dataset sample ids of this DP rank (MegatronPretrainingSampler, or
        the fixed-sample sampler of ``--fixed-samples``)."""
        if args.dataloader_type not in (None, "single"):
            return None
        consumed = args.consumed_train_samples
        fixed = self._fixed_sampler(args)
        if fixed is not None:
            return lambda microbatch: fixed.indices(consumed, microbatch)
        from megatron.core import parallel_state as ps

        from megatron_ext.megatron.data import sample_indices

        mbs = args.micro_batch_size
        dp_rank = ps.get_data_parallel_rank()
        dp_size = ps.get_data_parallel_world_size()
        return lambda microbatch: sample_indices(consumed, microbatch, mbs, dp_rank, dp_size)

    def before_forward_backward(
        self, forward_only: bool, args: argparse.Namespace
    ) -> Dict[str, Any]:
        """Before each schedule call; returns the extra schedule kwargs."""
        if self.runtime is None:
            return {}
        if forward_only or self._step is None:
            # Evaluation (also before training starts, e.g. --skip-train).
            self.runtime.begin_step(getattr(args, "curr_iteration", 0), forward_only=forward_only)
        else:
            # Also on a rerun of the same iteration (rerun state machine): counters restart.
            self.runtime.begin_step(self._step, sample_ids_fn=self._sample_ids_fn)
        return self.runtime.forward_backward_kwargs()

    # -- logging -------------------------------------------------------------------------------

    def interval_log_field(
        self, iteration: int, is_first_iteration: bool, args: argparse.Namespace
    ) -> str:
        """The log-line field of the interval ending at ``iteration`` ('' if none is due).

        Collective (all ranks): Megatron-LM prints on the same iterations everywhere.
        """
        if self.runtime is None or not self.runtime.config.comm.accounting:
            return ""
        if not (iteration % args.log_interval == 0 or is_first_iteration):
            return ""
        sums, _ = all_ranks_totals(self.interval)
        steps = max(1, self.interval_steps)
        self.interval, self.interval_steps = {}, 0
        self._write_scalars(sums, steps, iteration)
        return format_traffic(sums, steps)

    @staticmethod
    def _write_scalars(sums: Dict[str, Traffic], steps: int, iteration: int) -> None:
        from megatron.training.global_vars import (
            get_tensorboard_writer,
            get_wandb_writer,
        )

        writer = get_tensorboard_writer()
        wandb_writer = get_wandb_writer()
        if writer is None and wandb_writer is None:
            return
        scalars = comm_scalars(sums, steps)
        if writer is not None:
            for name, value in scalars.items():
                writer.add_scalar(name, value, iteration)
        if wandb_writer is not None:
            wandb_writer.log(scalars, iteration)

    def decorate_log_line(self, message: Any) -> Any:
        """Append the pending bytes field to Megatron-LM's iteration line."""
        field = self.pending_log_field
        if (
            field
            and isinstance(message, str)
            and " iteration " in message
            and "consumed samples" in message
        ):
            self.pending_log_field = ""
            return message + field
        return message

    # -- report --------------------------------------------------------------------------------

    def report_path(self, args: argparse.Namespace) -> str:
        """``--comm-report``, else ``<save>/comm_report.json``, else the run directory's."""
        return report_file(self.check_installed().config.comm.report, args.save, self.run_dir)

    def end_training(self, args: argparse.Namespace) -> None:
        """Training has ended (collective): what is still in flight finishes (DiLoCo's
        overlapped exchanges, before Megatron-LM's final save), then the report."""
        if self.runtime is not None:
            self.runtime.finish()
        self.write_report(args)

    def write_report(self, args: argparse.Namespace) -> None:
        """Write the JSON communication report (collective; rank 0 writes). Once per run."""
        rt = self.runtime
        if rt is None or not rt.config.comm.accounting or self._report_written:
            return
        self._report_written = True
        meter = rt.meter
        layout = rt.layout
        report = {
            "source": "Megatron-LM pretrain (megatron-ext hooks)",
            "megatron_lm_release": self.release.tag,
            "start_iteration": self.start_iteration,
            "final_iteration": self.last_iteration,
            "steps_this_run": meter.num_steps,
            "layout": {
                "tp": layout.tensor_model_parallel_size,
                "pp": layout.pipeline_model_parallel_size,
                "dp": layout.data_parallel_size,
                "world": torch.distributed.get_world_size(),
            },
            "global_batch_size": args.global_batch_size,
            "micro_batch_size": args.micro_batch_size,
            "ext": rt.config.summary(),
            "comm": comm_report(meter),
        }
        if is_rank_0():
            path = self.report_path(args)
            # A resume adds its segment to the run's report (megatron_ext.run_report).
            for note in write_report(path, report, self.start_iteration):
                print(f"> megatron-ext: {note}", flush=True)
            print(f"> megatron-ext: communication report: {path}", flush=True)

    # -- checkpoints ---------------------------------------------------------------------------

    def before_generate_state_dict(self, optimizer: Any) -> None:
        """Before ``generate_state_dict``: a load template needs optimizer state to exist.

        megatron-core's distributed optimizer builds its load template from its state
        (``DistributedOptimizer.state_dict`` asserts one common Adam ``step``); torch's Adam
        (no TE/Apex, e.g. on CPU) has none before its first step, so resuming failed. As in
        megatron-ext's own driver, megatron's ``_init_optimizer_states_with_dummy_values``
        fills it; the load overwrites every value. Only when the optimizer is being loaded
        (Megatron-LM passes None with ``--no-load-optim`` / ``--finetune``).
        """
        if self._load is not None and optimizer is not None:
            self._load.loaded_optimizer = True
            lm_ckpt.init_optimizer_state_for_load(optimizer)

    def extend_state_dict(self, state_dict: Dict[str, Any], args: argparse.Namespace) -> None:
        """Add megatron-ext entries to a dict built by ``generate_state_dict``."""
        if self.runtime is None:
            return
        if self._load is not None:
            # A load template (Megatron-LM builds one for torch_dist checkpoints only, also
            # when --auto-detect-ckpt-format finds one): ask for this rank's object.
            if self._load.include:
                state_dict[lm_ckpt.STATE_KEY] = lm_ckpt.sharded_state_object(self.runtime)
            self._load.sharded = dict(lm_ckpt.sharded_leaves(state_dict))
            return
        state_dict[lm_ckpt.META_KEY] = lm_ckpt.ext_meta(self.runtime)
        if args.ckpt_format == "torch_dist":
            state_dict[lm_ckpt.STATE_KEY] = lm_ckpt.sharded_state_object(
                self.runtime, snapshot=bool(args.async_save)
            )
            # Every rank builds this dict (torch_dist) before anything is written: no NaN
            # or Inf in Megatron-LM's model and optimizer or in ours gets saved.
            assert self._saving_iteration is not None, "save_checkpoint builds this dict"
            check_finite_for_save(state_dict, args.save, self._saving_iteration)

    def before_save(self, iteration: int, release: bool, args: argparse.Namespace) -> None:
        """Before Megatron-LM's ``save_checkpoint``: the torch format's per-rank files."""
        if self.runtime is None or args.save is None:
            return
        from megatron.training.checkpointing import get_checkpoint_name

        directory = get_checkpoint_name(args.save, iteration, release=release, return_base_dir=True)
        self._saving_iteration = iteration
        if args.ckpt_format == "torch":
            # Megatron-LM's legacy format builds its state dict on some ranks only: the
            # model's parameters and our state are checked here, on every rank.
            state = self.runtime.state.state_dict()
            check_finite_for_save(
                {"model": [dict(c.named_parameters()) for c in self._model_chunks], "ext": state},
                args.save,
                iteration,
            )
            lm_ckpt.save_rank_file(directory, self.runtime, state=state)
            where = f"{os.path.join(directory, lm_ckpt.RANK_FILE_DIR)}/rank_XXXXX.pt"
        else:
            where = f"{directory} (ShardedObject '{lm_ckpt.SHARDED_OBJECT_KEY}')"
        print_rank_0(
            f"> megatron-ext: saving the state of {torch.distributed.get_world_size()} ranks "
            f"at iteration {iteration} to {where}"
        )

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Megatron-LM's ``save_checkpoint`` runs (its ``dist_checkpointing.save`` calls are
        the checkpoint's)."""
        self._saving = True
        try:
            yield
        finally:
            self._saving = False

    def after_dist_checkpointing_save(self, checkpoint_dir: str, request: Any) -> Any:
        """After ``dist_checkpointing.save`` of a torch_dist checkpoint (collective): its
        checksum manifest, before Megatron-LM moves the marker; for an asynchronous save
        (``request``), as a finalize step ahead of Megatron-LM's own. Returns ``request``."""
        if not self._saving:
            return request
        from megatron_ext.megatron import checksums

        if request is None:
            checksums.write_manifest(checkpoint_dir)
        else:
            request.add_finalize_fn(lambda: checksums.write_manifest(checkpoint_dir))
        return request

    def after_save(self, iteration: int, release: bool, args: argparse.Namespace) -> None:
        """After Megatron-LM's ``save_checkpoint`` (collective): the torch format's checksum
        manifest (Megatron-LM has moved the marker already; see
        :mod:`megatron_ext.megatron.checksums`)."""
        if args.save is None or args.ckpt_format != "torch":
            return
        from megatron.training.checkpointing import get_checkpoint_name

        from megatron_ext.megatron import checksums

        directory = get_checkpoint_name(args.save, iteration, release=release, return_base_dir=True)
        checksums.write_manifest(directory)

    def verify_checksums(self, load_arg: str, args: argparse.Namespace) -> None:
        """Before Megatron-LM's ``load_checkpoint`` reads anything (collective): the files of
        the checkpoint it will load match their checksums (or ``--no-verify-checkpoint-
        checksums``)."""
        directory = lm_ckpt.iteration_dir_to_verify(args, load_arg)
        if directory is None or not os.path.isdir(directory):
            return
        from megatron_ext.megatron import checksums

        verify = self.cfg.checkpoint.verify_checksums if self.cfg is not None else True
        checksums.verify_checkpoint(directory, verify=verify)

    def begin_load(self) -> None:
        """Megatron-LM's ``load_checkpoint`` starts."""
        self._load = _LoadContext() if self.runtime is not None else None

    def on_base_checkpoint(self, result: Any, rank0: bool, args: argparse.Namespace) -> None:
        """Seen the return value of ``checkpointing._load_base_checkpoint`` during a load.

        ``rank0=True`` returns the common state (torch_dist) or the first legacy file: the
        megatron-ext metadata there decides whether the load template asks for our object.
        ``rank0=False`` returns the loaded state of this rank.
        """
        ctx = self._load
        if ctx is None:
            return
        state_dict, checkpoint_name, release = result[0], result[1], result[2]
        if state_dict is None:
            return
        if ctx.include is None:
            ctx.where = lm_ckpt.iteration_dir_of(str(checkpoint_name))
            if args.finetune or release:
                ctx.include = False
                ctx.reason = "--finetune" if args.finetune else "release checkpoint"
            else:
                rt = self.check_installed()
                ctx.include = lm_ckpt.decide_load(
                    state_dict.get(lm_ckpt.META_KEY),
                    rt,
                    rt.config.checkpoint.on_mismatch,
                    ctx.where,
                )
                ctx.reason = "" if ctx.include else "--ext-state-on-mismatch reset"
        if not rank0:
            ctx.checkpoint_name = str(checkpoint_name)
            ctx.adam_step = lm_ckpt.saved_adam_step(state_dict.get("optimizer"))
            # Every loaded float finite, or every rank stops naming the tensor and the file
            # (torch_dist: the .distcp file; torch: this rank's model_optim_rng.pt).
            lm_ckpt.check_finite(
                ctx.sharded or {},
                state_dict,
                ctx.where,
                file=None if os.path.isdir(ctx.checkpoint_name) else ctx.checkpoint_name,
            )
            if ctx.include and lm_ckpt.STATE_KEY in state_dict:
                ctx.loaded = state_dict[lm_ckpt.STATE_KEY]

    def name_load_error(self, exc: BaseException, args: argparse.Namespace) -> None:
        """Megatron-LM's ``load_checkpoint`` raised ``exc``: raise a CheckpointError naming
        the file of a torch_dist checkpoint that cannot be read, if one is found (else
        return, and ``exc`` propagates). Errors of dist_checkpointing name no file."""
        if self._load is None or isinstance(exc, (ConfigError, StateMismatch)):
            return
        directory = self._load.where or lm_ckpt.iteration_dir_to_load(args)
        if not directory or not os.path.isfile(os.path.join(directory, "metadata.json")):
            return
        bad = lm_ckpt.unreadable_file(directory)
        if bad is not None:
            raise lm_ckpt.CheckpointError(f"cannot load {directory}: {bad}") from exc

    def end_load(self) -> Optional[_LoadContext]:
        """Megatron-LM's ``load_checkpoint`` returned (or raised)."""
        ctx, self._load = self._load, None
        if ctx is not None and ctx.loaded_optimizer and self._optimizer is not None:
            lm_ckpt.restore_adam_steps(self._optimizer, ctx.adam_step)
        return ctx

    def finish_load(self, ctx: Optional[_LoadContext], args: argparse.Namespace) -> None:
        """Load megatron-ext's state after Megatron-LM loaded its own (collective)."""
        if ctx is None or ctx.include is None:
            return
        if not ctx.include:
            print_rank_0(f"> megatron-ext: state not loaded from {ctx.where} ({ctx.reason})")
            return
        rt = self.check_installed()
        state = ctx.loaded
        source = f"ShardedObject '{lm_ckpt.SHARDED_OBJECT_KEY}'"
        if state is None:
            name = ctx.checkpoint_name
            if name is None:
                raise StateMismatch(f"{ctx.where}: Megatron-LM's load gave this rank no state")
            if os.path.isdir(name):
                raise StateMismatch(
                    f"{ctx.where} has megatron-ext metadata but no "
                    f"'{lm_ckpt.SHARDED_OBJECT_KEY}' objects"
                )
            directory = lm_ckpt.iteration_dir_of(name)
            path = lm_ckpt.rank_file(directory, torch.distributed.get_rank())
            missing = torch.tensor(
                [0 if os.path.isfile(path) else 1], dtype=torch.int64, device=collective_device()
            )
            with ProcessGroupTrafficMeter.untracked():
                torch.distributed.all_reduce(missing)
            if missing.item():
                # Raises with --ext-state-on-mismatch error, else warns: start fresh.
                lm_ckpt.decide_load(
                    None,
                    rt,
                    rt.config.checkpoint.on_mismatch,
                    f"{directory} ({missing.item()} ranks lack "
                    f"{lm_ckpt.RANK_FILE_DIR}/rank_XXXXX.pt)",
                )
                return
            state = lm_ckpt.load_rank_file(path)
            source = f"{lm_ckpt.RANK_FILE_DIR}/rank_XXXXX.pt"
        rt.state.load_state_dict(state)
        print_rank_0(
            f"> megatron-ext: loaded the state of {torch.distributed.get_world_size()} ranks "
            f"from {ctx.where} ({source}; objects: {', '.join(rt.state.names)})"
        )
