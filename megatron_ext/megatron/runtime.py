"""Everything megatron_ext installs into one megatron-core training run, in one object.

What it does:
    :meth:`ExtRuntime.create` validates the feature configs
    (:class:`~megatron_ext.config.ExtConfig`) against the parallel layout, builds each
    family's selected method from the registry (``megatron_ext.methods``) with a
    :class:`~megatron_ext.methods.registry.MethodContext` (step clock, process groups, byte
    meter, and handles on the model, optimizer and scheduler that fill in at install), and
    sets up byte accounting. Then, in the order a training script builds things:

    * :meth:`ExtRuntime.transform_model` on the unwrapped model chunks, *before*
      megatron-core's DDP wrapper and optimizer allocate gradient buffers and state (the
      model-transform seam of methods that change parameters);
    * :meth:`ExtRuntime.install` once DDP and the optimizer exist: the data-parallel
      gradient seam (``ddp.install_grad_sync``) with the selected reducer, the pipeline
      communicator (``p2p.ExtP2PCommunicator``) with the selected codec for the schedules'
      ``p2p_communicator=`` argument, the linear-layer seam (``linear.install_linear_hooks``),
      the optimizer-step seam (``optimizer.install_optimizer_hooks``) and an
      :class:`~megatron_ext.state.ExtState` holding every stateful piece for checkpoints.

    The training loop calls :meth:`ExtRuntime.begin_step` / :meth:`ExtRuntime.end_step`
    around each iteration. :class:`StockRuntime` is the same interface with nothing
    installed (the stock megatron-core baseline of parity tests and benchmarks).

Why one object:
    Our driver and the Megatron-LM integration install the same things in the same order;
    keeping it here means there is one place that decides what "all seams installed" is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_ext.accounting import CommMeter, ProcessGroupTrafficMeter, Traffic
from megatron_ext.autograd.linear import PassThroughLinearHook
from megatron_ext.config import (
    ConfigError,
    ExtConfig,
    ParallelLayout,
    validate_ext_config,
)
from megatron_ext.methods.registry import (
    Components,
    ProcessGroups,
    TrainingHandles,
    build_components,
)
from megatron_ext.state import ExtState, StepClock

if TYPE_CHECKING:  # megatron.core's p2p module is imported at install, not with this one
    from megatron_ext.autograd.linear import LinearHook
    from megatron_ext.collectives.grad_reducer import GradReducer
    from megatron_ext.collectives.p2p import P2PCodec
    from megatron_ext.megatron.ddp import GradSyncHandle
    from megatron_ext.megatron.linear import LinearHooksHandle
    from megatron_ext.megatron.optimizer import OptimizerHooksHandle
    from megatron_ext.megatron.p2p import ExtP2PCommunicator
    from megatron_ext.methods.registry import SampleSpace
    from megatron_ext.protocols import OptimizerHook

__all__ = ["Runtime", "ExtRuntime", "StockRuntime", "install", "parallel_layout"]


def parallel_layout(ddp_config: Any = None, transformer_impl: str = "local") -> ParallelLayout:
    """The parallel layout of the current megatron-core run (from parallel_state).

    Args:
        ddp_config: the ``DistributedDataParallelConfig`` the model is (or will be) wrapped
            with; None for a run without DDP.
        transformer_impl: 'local' or 'transformer_engine'.
    """
    from megatron.core import parallel_state as ps

    return ParallelLayout(
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        data_parallel_size=ps.get_data_parallel_world_size(),
        virtual_pipeline_model_parallel_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        use_distributed_optimizer=bool(ddp_config and ddp_config.use_distributed_optimizer),
        overlap_grad_reduce=bool(ddp_config and ddp_config.overlap_grad_reduce),
        num_distributed_optimizer_instances=(
            ddp_config.num_distributed_optimizer_instances if ddp_config else 1
        ),
        transformer_impl=transformer_impl,
    )


def _process_groups() -> ProcessGroups:
    from megatron.core import parallel_state as ps

    return ProcessGroups(
        dp=ps.get_data_parallel_group(with_context_parallel=False),
        dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
        tp=ps.get_tensor_model_parallel_group(check_initialized=False),
        pp=ps.get_pipeline_model_parallel_group(),
        embd=ps.get_embedding_group(check_initialized=False),
    )


def _traffic_classifier() -> Callable[[Any, str], str]:
    """Category of an untagged ProcessGroup call: tensor parallelism, the distributed
    optimizer's parameter gather, or other."""
    from megatron.core import parallel_state as ps

    def names(*groups):
        return {g.group_name for g in groups if g is not None and hasattr(g, "group_name")}

    tp = names(ps.get_tensor_model_parallel_group(check_initialized=False))
    dp = names(
        ps.get_data_parallel_group(with_context_parallel=False),
        ps.get_data_parallel_group(with_context_parallel=True),
        ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True),
    )

    def classify(group, kind):
        name = getattr(group, "group_name", None)
        if name in tp:
            return "tp"
        if name in dp and kind == "all_gather":
            return "dp-param"
        return "other"

    return classify


def _schedule_pg_collection():
    """The process groups megatron's pipeline schedules build when none are passed."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgc = ProcessGroupCollection()
    pgc.tp = ps.get_tensor_model_parallel_group()
    pgc.pp = ps.get_pipeline_model_parallel_group()
    pgc.embd = ps.get_embedding_group(check_initialized=False)
    pgc.pos_embd = ps.get_position_embedding_group(check_initialized=False)
    pgc.cp = ps.get_context_parallel_group()
    pgc.dp_cp = ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=False)
    # megatron-core 0.19's default collection (schedules._build_default_pg_collection) also
    # carries these two; both fields exist in 0.16's ProcessGroupCollection too.
    pgc.tp_dp_cp = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    pgc.dp = ps.get_data_parallel_group(with_context_parallel=False, partial_data_parallel=False)
    return pgc


class Runtime:
    """What the training loop talks to (see module docstring)."""

    meter: CommMeter
    communicator: Optional[ExtP2PCommunicator] = None

    def begin_step(
        self,
        step: int,
        *,
        sample_ids_fn: Optional[Callable[[int], torch.Tensor]] = None,
        forward_only: bool = False,
    ) -> None:
        """Call before each ``forward_backward_func`` of training (or evaluation)."""

    def end_step(self, update_successful: bool = True) -> Dict[str, Traffic]:
        """Close the iteration: this rank's bytes by category (``update_successful``: the
        optimizer step was taken)."""
        return {}

    def forward_backward_kwargs(self) -> Dict[str, Any]:
        """Extra arguments for megatron's ``forward_backward_func``."""
        return {}

    def remove(self) -> None:
        """Undo every installation (for tests and in-process reuse)."""


class StockRuntime(Runtime):
    """Nothing of megatron_ext installed: stock megatron-core, no bytes counted."""

    def __init__(self) -> None:
        self.meter = CommMeter(enabled=False)


class ExtRuntime(Runtime):
    """Built methods, installed seams and accounting of one run (see module docstring)."""

    def __init__(
        self,
        config: ExtConfig,
        layout: ParallelLayout,
        *,
        clock: StepClock,
        meter: CommMeter,
        handles: TrainingHandles,
        components: Dict[str, Components],
    ):
        self.config = config
        self.layout = layout
        self.clock = clock
        self.meter = meter
        # Process-group traffic is metered from install() on (with comm accounting).
        self.pg_meter: Optional[ProcessGroupTrafficMeter] = None
        self.handles = handles
        self.components = components
        self._state: Optional[ExtState] = None
        self.communicator: Optional[ExtP2PCommunicator] = None
        self.grad_handle: Optional[GradSyncHandle] = None
        self.linear_handle: Optional[LinearHooksHandle] = None
        self.optimizer_handle: Optional[OptimizerHooksHandle] = None
        self.last_pg_tagged: Dict[str, Traffic] = {}
        self.pg_collection = None
        self._transformed = False
        self._installed = False

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def create(cls, cfg: ExtConfig, layout: ParallelLayout) -> "ExtRuntime":
        """Validate ``cfg`` against ``layout`` and build every selected method.

        Call after the process groups exist (``parallel_state`` initialized) and before the
        model is wrapped in DDP.

        Raises:
            ConfigError: unsupported flag combination (names the flags).
        """
        validate_ext_config(cfg, layout)
        from megatron_ext import kernels

        kernels.set_mode(cfg.kernels.fused)
        clock = StepClock()
        meter = CommMeter(enabled=cfg.comm.accounting)
        handles = TrainingHandles()
        components = build_components(
            cfg, layout, clock=clock, meter=meter, groups=_process_groups(), handles=handles
        )
        return cls(cfg, layout, clock=clock, meter=meter, handles=handles, components=components)

    @property
    def state(self) -> ExtState:
        """The checkpointed state objects (from :meth:`install` on)."""
        if self._state is None:
            raise RuntimeError("megatron-ext: the runtime has state from install() on")
        return self._state

    @property
    def reducer(self) -> GradReducer:
        """The gradient reducer of the ``grad`` family (``none``'s is the dense one)."""
        reducer = self.components["grad"].reducer
        if reducer is None:
            raise RuntimeError("megatron-ext: the grad family's method built no reducer")
        return reducer

    @property
    def pipeline_codec(self) -> P2PCodec:
        """The codec of pipeline transfers: Protocol Models' when selected (it implies its
        own), else the ``p2p`` family's (``none``'s is the dense one)."""
        sub = self.components.get("subspace")
        if sub is not None and sub.codec is not None:
            return sub.codec
        codec = self.components["p2p"].codec
        if codec is None:
            raise RuntimeError("megatron-ext: the p2p family's method built no codec")
        return codec

    @property
    def linear_hook(self) -> Tuple[LinearHook, str]:
        """The ``linear`` family's hook and the pattern of the layers it applies to
        (``none``'s is the pass-through)."""
        linear = self.components["linear"]
        if linear.linear_hook is None or linear.linear_layers is None:
            raise RuntimeError("megatron-ext: the linear family's method built no linear hook")
        return linear.linear_hook, linear.linear_layers

    def _optimizer_hooks(self) -> List[OptimizerHook]:
        # The outer synchronization (DiLoCo) wraps everything the inner step does: its hooks
        # come first, so that their post_step runs last (post_step runs in reverse order),
        # after every other hook has written the weights (Protocol Models' constrained AdamW
        # step), and the outer step's weights are the iteration's last word.
        from megatron_ext.methods import registry

        order = sorted(self.components, key=lambda name: not registry.family(name).spans_sites)
        return [h for family in order for h in self.components[family].optimizer_hooks]

    def descriptions(self) -> List[str]:
        """The methods' log lines about what they changed on this rank (installed runtime)."""
        return [c.describe() for c in self.components.values() if c.describe is not None]

    def transform_model(self, model_chunks: Sequence[torch.nn.Module]) -> None:
        """Apply the methods' model transforms to the unwrapped chunks (before DDP)."""
        if self._installed:
            raise RuntimeError("model transforms must run before install()")
        for comp in self.components.values():
            if comp.model_transform is not None:
                comp.model_transform(list(model_chunks))
        self._transformed = True

    def install(
        self,
        model_chunks: Sequence[torch.nn.Module],
        optimizer: Any,
        *,
        model_config: Any,
        scheduler: Any = None,
        transformer_impl: str = "local",
        optimizer_hooks: Sequence[OptimizerHook] = (),
        samples: Optional[SampleSpace] = None,
    ) -> "ExtRuntime":
        """Install every seam on the DDP-wrapped chunks and the optimizer (see module doc).

        Args:
            model_chunks: DDP-wrapped model chunks.
            optimizer: megatron-core optimizer.
            model_config: the model's TransformerConfig (for the P2P communicator).
            scheduler: the LR scheduler, handed to methods that need it.
            transformer_impl: 'local' or 'transformer_engine' (which layer spec was built).
            optimizer_hooks: extra optimizer hooks (the methods add their own).
            samples: the :class:`~megatron_ext.methods.registry.SampleSpace` of training
                (methods with per-sample state need it).

        Returns:
            ``self``.
        """
        from megatron.core import parallel_state as ps

        from megatron_ext.collectives.grad_reducer import ReducerStepHook
        from megatron_ext.megatron.ddp import install_grad_sync
        from megatron_ext.megatron.linear import install_linear_hooks
        from megatron_ext.megatron.optimizer import (
            MegatronOptimizerView,
            install_optimizer_hooks,
        )

        needs_transform = [
            fam for fam, comp in self.components.items() if comp.model_transform is not None
        ]
        if needs_transform and not self._transformed:
            from megatron_ext.methods import registry

            raise ConfigError(
                [registry.family(f).flag for f in needs_transform],
                "this method changes the model before megatron-core's DDP wraps it; the "
                "caller installed megatron-ext on an already wrapped model",
            )
        self.handles.model_chunks = list(model_chunks)
        self.handles.optimizer = optimizer
        self.handles.scheduler = scheduler
        self.handles.model_config = model_config
        self.handles.samples = samples
        self.handles.optimizer_view = lambda: MegatronOptimizerView(
            optimizer, self.handles.model_chunks, self.clock
        )
        layout = self.layout
        if self.config.comm.accounting:
            self.pg_meter = ProcessGroupTrafficMeter(_traffic_classifier()).install()
        self._state = ExtState(
            settings=self.config.state_settings(),
            run_only=self.config.run_only_settings(),
            layout={
                "tp": layout.tensor_model_parallel_size,
                "pp": layout.pipeline_model_parallel_size,
                "dp": layout.data_parallel_size,
                "world": torch.distributed.get_world_size(),
                "rank": torch.distributed.get_rank(),
            },
        )
        hooks = self._optimizer_hooks() + list(optimizer_hooks)
        try:
            grad_groups = [c.grad_group for c in self.components.values() if c.grad_group]
            self.grad_handle = install_grad_sync(
                model_chunks,
                self.reducer,
                clock=self.clock,
                meter=self.meter,
                group=grad_groups[0] if grad_groups else None,
            )
            self.state.register("grad_reducer", self.reducer)
            if layout.pipeline_model_parallel_size > 1:
                from megatron_ext.megatron.p2p import ExtP2PCommunicator

                codec = self.pipeline_codec
                self.communicator = ExtP2PCommunicator(
                    ps.get_pipeline_model_parallel_group(),
                    model_config,
                    codec=codec,
                    meter=self.meter,
                )
                self.state.register("p2p_codec", codec)
            linear_hook, linear_layers = self.linear_hook
            if transformer_impl == "local" or not isinstance(linear_hook, PassThroughLinearHook):
                self.linear_handle = install_linear_hooks(model_chunks, linear_hook, linear_layers)
            # The reducer's step transaction (commit or drop its staged state once megatron
            # has decided whether the step is applied) runs first, around every other hook;
            # it holds no state and is not checkpointed.
            step_hooks = [] if self.reducer.name == "none" else [ReducerStepHook(self.reducer)]
            self.optimizer_handle = install_optimizer_hooks(
                optimizer, model_chunks, step_hooks + hooks, clock=self.clock
            )
            # Named by what they are, not by their position among the hooks (two hooks of one
            # name are refused by the registry).
            for hook in hooks:
                self.state.register(f"optimizer_hook.{hook.name}", hook)
            for fam, comp in self.components.items():
                for name, obj in comp.state.items():
                    self.state.register(f"{fam}.{name}", obj)
            for comp in self.components.values():
                if comp.on_install is not None:
                    comp.on_install()
            # A method's uncompressed warm-up (AQ-SGD's --aqsgd-warmup-epochs, set on the
            # clock by its on_install) covers the data-parallel exchange too.
            self.reducer.dense_before_step = self.clock.dense_before_step
        except Exception:
            self.remove()
            raise
        self._installed = True
        return self

    # -- the loop ------------------------------------------------------------------------------

    def begin_step(self, step, *, sample_ids_fn=None, forward_only=False) -> None:
        """Call before each ``forward_backward_func`` of training (or evaluation).

        Args:
            step: 0-based training iteration.
            sample_ids_fn: microbatch -> dataset sample indices of this DP rank.
            forward_only: evaluation pass.
        """
        if not forward_only:
            self.clock.step = step
            for comp in self.components.values():
                if comp.on_step is not None:
                    comp.on_step(step)
        if self.communicator is not None:
            self.communicator.begin_step(
                step, sample_ids_fn=sample_ids_fn, forward_only=forward_only
            )

    def end_step(self, update_successful: bool = True) -> Dict[str, Traffic]:
        """Close the iteration: returns this rank's bytes by category.

        Seam categories (dp-grad, pp-act, pp-grad) come from the seams; the rest from the
        process-group meter's untagged transfers.

        Args:
            update_successful: whether the optimizer step was taken (megatron-core's
                ``optimizer.step()`` result, the same on every rank); per-step codec state
                of a skipped step is dropped.
        """
        if self.communicator is not None:
            # Per-step state of the codec (AQ-SGD's buffer updates) is committed here, so
            # a step that megatron replays never applies its updates twice, and dropped
            # when the step was skipped (the buffers stay as before it).
            self.communicator.codec.end_step(commit=update_successful)
        if self.pg_meter is not None:
            untagged, tagged = self.pg_meter.end_step()
            self.last_pg_tagged = tagged
            self.meter.merge(untagged)
        return self.meter.end_step()

    def forward_backward_kwargs(self) -> Dict[str, Any]:
        """Extra arguments for megatron's ``forward_backward_func``."""
        if self.communicator is None:
            return {}
        if self.pg_collection is None:  # built once: the groups live as long as the runtime
            self.pg_collection = _schedule_pg_collection()
        return {"p2p_communicator": self.communicator, "pg_collection": self.pg_collection}

    def finish(self) -> None:
        """End of training (collective): optimizer hooks with work in flight finish it (DiLoCo's
        overlapped exchanges), before the report is written and the process groups go away."""
        if self.optimizer_handle is not None:
            for hook in self.optimizer_handle.hooks:
                hook.finish()

    def remove(self) -> None:
        """Undo every installation (for tests and in-process reuse)."""
        self.finish()
        for handle in (self.grad_handle, self.linear_handle, self.optimizer_handle):
            if handle is not None:
                handle.remove()
        self.grad_handle = self.linear_handle = self.optimizer_handle = None
        if self.pg_meter is not None:
            self.pg_meter.remove()
            self.pg_meter = None


def install(
    cfg: ExtConfig,
    *,
    model_chunks: Sequence[torch.nn.Module],
    optimizer: Any,
    model_config: Any,
    transformer_impl: str = "local",
    scheduler: Any = None,
    optimizer_hooks: Sequence[OptimizerHook] = (),
    samples: Optional[SampleSpace] = None,
) -> ExtRuntime:
    """Create the runtime and install it on an already wrapped model in one call.

    For methods without a model transform (every DP, P2P and pass-through method); a method
    that transforms the model needs :meth:`ExtRuntime.create` and
    :meth:`ExtRuntime.transform_model` before DDP wraps it, and is refused here.

    Args:
        cfg: the feature configs.
        model_chunks: DDP-wrapped model chunks.
        optimizer: megatron-core optimizer.
        model_config: the model's TransformerConfig (for the P2P communicator).
        transformer_impl: 'local' or 'transformer_engine' (which layer spec was built).
        scheduler: the LR scheduler, handed to methods that need it.
        optimizer_hooks: extra optimizer hooks (the methods add their own).
        samples: the :class:`~megatron_ext.methods.registry.SampleSpace` of training
            (methods with per-sample state need it).
    """
    ddp_config = getattr(model_chunks[0], "ddp_config", None)
    runtime = ExtRuntime.create(cfg, parallel_layout(ddp_config, transformer_impl))
    return runtime.install(
        model_chunks,
        optimizer,
        model_config=model_config,
        scheduler=scheduler,
        transformer_impl=transformer_impl,
        optimizer_hooks=optimizer_hooks,
        samples=samples,
    )
