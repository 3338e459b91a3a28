"""Everything megatron_ext installs into one megatron-core training run, in one object.

What it does:
    :func:`install` takes the feature configs (:class:`~megatron_ext.config.ExtConfig`),
    the DDP-wrapped model chunks and the megatron optimizer, validates the combination
    against the parallel layout, and installs every seam:

    * the data-parallel gradient seam (``ddp.install_grad_sync``) with the selected
      reducer (pass-through: :class:`DenseGradReducer`);
    * the pipeline communicator (``p2p.ExtP2PCommunicator``) with the selected codec, for
      the schedules' ``p2p_communicator=`` argument;
    * the linear-layer seam (``linear.install_linear_hooks``) on the layers matching
      ``--grass-layers``;
    * the optimizer-step seam (``optimizer.install_optimizer_hooks``);
    * byte accounting: a :class:`CommMeter` fed by the seams and a
      :class:`ProcessGroupTrafficMeter` for what the seams do not see;
    * an :class:`~megatron_ext.state.ExtState` holding every stateful piece for
      checkpoints.

    The training loop calls :meth:`ExtRuntime.begin_step` / :meth:`ExtRuntime.end_step`
    around each iteration.

Why one object:
    Our driver and the Megatron-LM integration install the same things in the same order;
    keeping it here means there is one place that decides what "all seams installed" is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megatron_ext.accounting import CommMeter, ProcessGroupTrafficMeter, Traffic
from megatron_ext.autograd.linear import LinearHook, PassThroughLinearHook
from megatron_ext.collectives.grad_reducer import DenseGradReducer, GradReducer
from megatron_ext.collectives.p2p import IdentityCodec, P2PCodec
from megatron_ext.config import ExtConfig, ParallelLayout, validate_ext_config
from megatron_ext.megatron.ddp import GradSyncHandle, StepClock, install_grad_sync
from megatron_ext.megatron.linear import LinearHooksHandle, install_linear_hooks
from megatron_ext.megatron.optimizer import OptimizerHooksHandle, install_optimizer_hooks
from megatron_ext.optim.hooks import OptimizerHook
from megatron_ext.state import ExtState

__all__ = ["ExtRuntime", "install", "parallel_layout", "GRAD_REDUCERS", "P2P_CODECS"]


def _separate(cfg: ExtConfig, **_):
    from megatron_ext.collectives.separate import SeparateReducer

    return SeparateReducer(cfg.separate), []


def _radius(cfg: ExtConfig, **_):
    from megatron_ext.collectives.radius import RadiusOptimizerHook, RadiusReducer

    reducer = RadiusReducer(cfg.radius)
    return reducer, [RadiusOptimizerHook(reducer)]


def _powersgd(cfg: ExtConfig, **_):
    from megatron_ext.collectives.powersgd import PowerSGDReducer

    return PowerSGDReducer(cfg.powersgd), []


# Method name -> factory. A method is selectable on the command line once it is listed in
# config.py's *_METHODS and has a factory here (a test checks both). Gradient reducers come
# with the optimizer hooks they need (Radius selects its indices after the optimizer step).
GRAD_REDUCERS: Dict[str, Callable[..., Tuple[GradReducer, List[OptimizerHook]]]] = {
    "none": lambda cfg, **_: (DenseGradReducer(), []),
    "separate": _separate,
    "radius": _radius,
    "powersgd": _powersgd,
}
P2P_CODECS: Dict[str, Callable[..., P2PCodec]] = {"none": lambda cfg, **_: IdentityCodec()}
LINEAR_HOOKS: Dict[str, Callable[..., LinearHook]] = {
    "none": lambda cfg, **_: PassThroughLinearHook()
}


def parallel_layout(
    model_chunks: Sequence[torch.nn.Module], transformer_impl: str = "local"
) -> ParallelLayout:
    """The parallel layout of the current megatron-core run (from parallel_state)."""
    from megatron.core import parallel_state as ps

    ddp_config = getattr(model_chunks[0], "ddp_config", None)
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


def _group_names() -> Tuple[set, set]:
    from megatron.core import parallel_state as ps

    def names(*groups):
        out = set()
        for g in groups:
            if g is not None and hasattr(g, "group_name"):
                out.add(g.group_name)
        return out

    tp = names(ps.get_tensor_model_parallel_group(check_initialized=False))
    dp = names(
        ps.get_data_parallel_group(with_context_parallel=False),
        ps.get_data_parallel_group(with_context_parallel=True),
        ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True),
    )
    return tp, dp


@dataclass
class ExtRuntime:
    """Installed seams and accounting of one run (see module docstring)."""

    config: ExtConfig
    layout: ParallelLayout
    clock: StepClock
    meter: CommMeter
    pg_meter: Optional[ProcessGroupTrafficMeter]
    reducer: GradReducer
    communicator: Optional[Any]
    state: ExtState
    grad_handle: Optional[GradSyncHandle] = None
    linear_handle: Optional[LinearHooksHandle] = None
    optimizer_handle: Optional[OptimizerHooksHandle] = None
    last_pg_tagged: Dict[str, Traffic] = field(default_factory=dict)
    pg_collection: Optional[Any] = None

    def begin_step(
        self,
        step: int,
        *,
        sample_ids_fn: Optional[Callable[[int], torch.Tensor]] = None,
        forward_only: bool = False,
    ) -> None:
        """Call before each ``forward_backward_func`` of training (or evaluation).

        Args:
            step: 0-based training iteration.
            sample_ids_fn: microbatch -> dataset sample indices of this DP rank.
            forward_only: evaluation pass.
        """
        if not forward_only:
            self.clock.step = step
        if self.communicator is not None:
            self.communicator.begin_step(
                step, sample_ids_fn=sample_ids_fn, forward_only=forward_only
            )

    def end_step(self) -> Dict[str, Traffic]:
        """Close the iteration: returns this rank's bytes by category.

        Seam categories (dp-grad, pp-act, pp-grad) come from the seams; the rest from the
        process-group meter's untagged transfers.
        """
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

    def remove(self) -> None:
        """Undo every installation (for tests and in-process reuse)."""
        for handle in (self.grad_handle, self.linear_handle, self.optimizer_handle):
            if handle is not None:
                handle.remove()
        if self.pg_meter is not None:
            self.pg_meter.remove()
            self.pg_meter = None


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
    return pgc


def install(
    cfg: ExtConfig,
    *,
    model_chunks: Sequence[torch.nn.Module],
    optimizer: Any,
    model_config: Any,
    transformer_impl: str = "local",
    optimizer_hooks: Sequence[OptimizerHook] = (),
) -> ExtRuntime:
    """Validate ``cfg`` against the run and install every seam (see module docstring).

    Args:
        cfg: megatron_ext feature configs.
        model_chunks: DDP-wrapped model chunks.
        optimizer: megatron-core optimizer.
        model_config: the model's TransformerConfig (for the P2P communicator).
        transformer_impl: 'local' or 'transformer_engine' (which layer spec was built).
        optimizer_hooks: extra optimizer hooks (the methods add their own).

    Returns:
        The runtime handle.

    Raises:
        ConfigError: unsupported flag combination (names the flags).
    """
    from megatron.core import parallel_state as ps

    layout = parallel_layout(model_chunks, transformer_impl)
    validate_ext_config(cfg, layout)

    clock = StepClock()
    meter = CommMeter(enabled=cfg.comm.accounting)
    pg_meter = None
    if cfg.comm.accounting:
        tp_names, dp_names = _group_names()

        def classify(group, kind):
            name = getattr(group, "group_name", None)
            if name in tp_names:
                return "tp"
            if name in dp_names and kind == "all_gather":
                return "dp-param"
            return "other"

        pg_meter = ProcessGroupTrafficMeter(classify).install()

    reducer, reducer_hooks = GRAD_REDUCERS[cfg.grad.method](cfg, layout=layout)
    optimizer_hooks = list(reducer_hooks) + list(optimizer_hooks)
    rank = torch.distributed.get_rank()
    state = ExtState(
        settings=cfg.state_settings(),
        layout={
            "tp": layout.tensor_model_parallel_size,
            "pp": layout.pipeline_model_parallel_size,
            "dp": layout.data_parallel_size,
            "world": torch.distributed.get_world_size(),
            "rank": rank,
        },
    )
    runtime = ExtRuntime(
        config=cfg,
        layout=layout,
        clock=clock,
        meter=meter,
        pg_meter=pg_meter,
        reducer=reducer,
        communicator=None,
        state=state,
    )
    try:
        runtime.grad_handle = install_grad_sync(model_chunks, reducer, clock=clock, meter=meter)
        state.register("grad_reducer", reducer)
        if layout.pipeline_model_parallel_size > 1:
            from megatron_ext.megatron.p2p import ExtP2PCommunicator

            codec = P2P_CODECS[cfg.p2p.method](cfg.p2p, layout=layout)
            runtime.communicator = ExtP2PCommunicator(
                ps.get_pipeline_model_parallel_group(), model_config, codec=codec, meter=meter
            )
            state.register("p2p_codec", codec)
        linear_hook = LINEAR_HOOKS[cfg.grass.method](cfg.grass, layout=layout)
        if transformer_impl == "local" or not isinstance(linear_hook, PassThroughLinearHook):
            runtime.linear_handle = install_linear_hooks(
                model_chunks, linear_hook, cfg.grass.layers
            )
        runtime.optimizer_handle = install_optimizer_hooks(
            optimizer, model_chunks, list(optimizer_hooks), clock=clock
        )
        for i, hook in enumerate(optimizer_hooks):
            state.register(f"optimizer_hook.{i}.{hook.name}", hook)
    except Exception:
        runtime.remove()
        raise
    return runtime
