"""DiLoCo (``--outer-method diloco``): refusals, factory and registration.

Its options, :class:`~megatron_ext.options.outer.OuterConfig`, live in the leaf package
(the outer step in ``megatron_ext.optim`` reads them without importing the registry).

The algorithm is ``megatron_ext.optim.diloco`` (the outer Nesterov-SGD step on the
pseudo-gradient, its fragments and the dense outer exchange). This module turns the flags
into the sites' process groups (the gradient seam reduces over a site's ranks through
:attr:`~megatron_ext.methods.registry.Components.grad_group`, which the other methods also
see as their data-parallel group) and the optimizer hook that runs the outer step, through
the other methods' :attr:`~megatron_ext.methods.registry.Components.outer_view` (Grass).
"""

from __future__ import annotations

from megatron_ext.methods.registry import Components, Method, MethodContext, register
from megatron_ext.options.base import ConfigError
from megatron_ext.options.outer import OuterConfig

__all__ = ["OuterConfig", "METHOD"]


def _validate(cfg, layout) -> None:
    """Every refusal of DiLoCo against the run (the driver's and pretrain_gpt.py's alike)."""
    o = cfg.options_for(OuterConfig)
    if o.transport == "torchft":
        _validate_torchft(o, layout)
    else:
        _validate_one_world(o, layout)
    dp = layout.data_parallel_size
    g = o.num_sites(dp)
    if dp % g:
        raise ConfigError(
            "--outer-groups",
            f"{g} sites do not divide the data-parallel size {dp} (world / (TP x PP))",
        )
    if cfg.enabled("grad") and dp // g == 1:
        raise ConfigError(
            ["--grad-compression", "--outer-groups"],
            f"{g} sites of one rank each have no data-parallel reduction to compress (it "
            "would only make the gradient lossy); use fewer sites or --grad-compression none",
        )
    instances = layout.num_distributed_optimizer_instances
    if (layout.use_distributed_optimizer or instances != 1) and instances != g:
        # Inside a site the distributed optimizer is megatron-core's own instance: its
        # shards, parameter gather and gradient statistics stay within the instance's
        # consecutive data-parallel ranks (a site); the gradient seam drops the all-reduce
        # across instances.
        raise ConfigError(
            ["--num-distributed-optimizer-instances", "--outer-groups"],
            f"with --use-distributed-optimizer each of the {g} sites is one "
            f"distributed-optimizer instance: pass --num-distributed-optimizer-instances {g} "
            f"(got {instances})",
        )
    if cfg.enabled("subspace"):
        # DiLoCo's post_step runs after Protocol Models' constrained AdamW step (the runtime
        # puts the outer hooks first, their post_step last): the outer step writes the last
        # weights. They stay in S when S is fixed and the exchange is exact: the
        # snapshot and the sites' weights are in S, so are their differences and momentum.
        # A Grassmann update would move S under the snapshot, a compressed exchange adds
        # components outside S.
        from megatron_ext.methods.protocol import SubspaceConfig

        sub = cfg.options_for(SubspaceConfig)
        if sub.update_interval:
            raise ConfigError(
                ["--outer-method", "--subspace-update-interval"],
                "DiLoCo with Protocol Models needs a fixed subspace (--subspace-update-interval "
                "0): a Grassmann update moves S under the last synchronized weights",
            )
        if o.compression != "none":
            raise ConfigError(
                ["--outer-compression", "--subspace-method"],
                "with Protocol Models the pseudo-gradient exchange must be exact "
                "(--outer-compression none): a compressed one adds components outside S",
            )


def _validate_one_world(o: OuterConfig, layout) -> None:
    """What sites inside one world cannot honour."""
    if layout.per_token_loss:
        # finalize_model_grads divides by the token count of every data-parallel rank,
        # while a site's gradient holds the site's tokens only.
        raise ConfigError(
            ["--outer-method", "--calculate-per-token-loss"],
            "the token count is summed over all data-parallel ranks, not over a DiLoCo site",
        )
    sites = o.num_sites(layout.data_parallel_size)
    if sites > 1 and layout.replica_hash_interval:
        # Between outer steps the sites' weights differ. (Checkpoints are supported: each
        # rank's megatron-ext state keeps its own weights and AdamW state.)
        raise ConfigError(
            ["--check-weight-hash-across-dp-replicas-interval", "--outer-groups"],
            f"{sites} DiLoCo sites hold different weights between outer steps; the replica "
            "hash check assumes identical data-parallel replicas (supported with "
            "--outer-groups 1 only)",
        )


def _validate_torchft(o: OuterConfig, layout) -> None:
    """The needs of --outer-transport torchft: an address, torchft itself, and data that
    can be cut into the sites' disjoint blocks (the driver's one pass, Megatron-LM's
    samplers)."""
    import os

    if layout.fixed_samples is not None:
        raise ConfigError(
            ["--outer-transport", "--fixed-samples"],
            "sites in separate jobs read disjoint blocks of the training data; "
            "--fixed-samples would give every site the same samples",
        )
    if layout.dataloader_type not in (None, "single", "cyclic"):
        raise ConfigError(
            ["--outer-transport", "--dataloader-type"],
            f"sites in separate jobs read disjoint blocks of the training split through "
            f"Megatron-LM's samplers (single or cyclic), not {layout.dataloader_type!r}",
        )

    if not (o.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")):
        raise ConfigError(
            ["--outer-transport", "--outer-lighthouse"],
            "torchft needs the lighthouse's address (http://host:port, from megatron-ext "
            "lighthouse), or TORCHFT_LIGHTHOUSE in the environment",
        )
    from megatron_ext.optim.diloco_ft import torchft_missing

    missing = torchft_missing()
    if missing:
        raise ConfigError("--outer-transport", missing)


def _build_torchft(ctx: MethodContext) -> Components:
    """One site of --outer-transport torchft: the whole job is the site (its data-parallel
    group reduces every step), the outer step goes through torchft."""
    import torch

    from megatron_ext.optim.diloco_ft import FaultTolerantDiLoCoHook

    o = ctx.options
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    hook = FaultTolerantDiLoCoHook(o, meter=ctx.meter, rank=rank)

    def describe() -> str:
        return (
            f"DiLoCo over torchft: site {o.site_id} (at least {o.min_sites} per outer step), "
            f"H={o.interval}, outer lr {o.lr:g}, momentum {o.momentum:g}"
            f"{' (Nesterov)' if o.nesterov else ''}, weight {hook.weight:g} tokens per outer "
            f"step, exchange {o.compression}"
        )

    def on_install() -> None:
        samples = ctx.handles.samples
        if samples is not None:
            # A site's weight in the average: the tokens it trained on in one outer cycle.
            hook.weight = float(
                samples.dp_size
                * samples.micro_batch_size
                * samples.num_microbatches
                * samples.seq_length
                * o.interval
            )
        hook.view_wrappers = [c.outer_view for c in ctx.peers.values() if c.outer_view]
        hook.setup(ctx.handles.new_optimizer_view())

    return Components(
        optimizer_hooks=[hook], describe=describe, on_install=on_install, on_step=hook.on_step
    )


def _build(ctx: MethodContext) -> Components:
    from megatron_ext.optim.diloco import DiLoCoHook, site_groups

    o = ctx.options
    if o.transport == "torchft":
        return _build_torchft(ctx)
    g = o.num_sites(ctx.layout.data_parallel_size)
    dp, dp_cp = ctx.groups.dp, ctx.groups.dp_cp
    if dp is not None and dp_cp is not None:
        import torch

        if torch.distributed.get_world_size(dp_cp) != torch.distributed.get_world_size(dp):
            # The sites split the data-parallel group without context parallelism; megatron
            # reduces gradients over the one with it, which the site's group would drop.
            raise ConfigError(
                ["--outer-method", "--context-parallel-size"],
                "DiLoCo's sites are runs of data-parallel ranks; context parallelism is not "
                "supported with them",
            )
    if dp is None:
        raise RuntimeError("megatron-ext: DiLoCo's sites split the data-parallel process group")
    inner, outer, site = site_groups(dp, g)
    hook = DiLoCoHook(o, outer, meter=ctx.meter)

    def describe() -> str:
        return (
            f"DiLoCo: site {site} of {g}, H={o.interval}, {o.fragments} fragment(s), outer "
            f"lr {o.lr:g}, momentum {o.momentum:g}{' (Nesterov)' if o.nesterov else ''}"
            + (f", exchange overlapped with {o.delay} step(s)" if o.delay else "")
            + (f", merge alpha {o.merge_alpha:g}" if o.merge_alpha else "")
        )

    def on_install() -> None:
        # Sized at start, from the weights before the first step (the same on every site);
        # a checkpoint load that follows then writes this rank's state over it.
        # Weights other methods train outside the optimizer's parameters (Grass's frozen
        # projected weights): the outer step reads and writes them through their views.
        hook.view_wrappers = [c.outer_view for c in ctx.peers.values() if c.outer_view]
        hook.setup(ctx.handles.new_optimizer_view())

    return Components(
        optimizer_hooks=[hook], grad_group=inner, describe=describe, on_install=on_install
    )


METHOD = register(
    Method(
        name="diloco",
        family="outer",
        build=_build,
        options=OuterConfig,
        summary="sites train apart, outer Nesterov SGD on the averaged pseudo-gradient every H steps",
        validate=_validate,
        bench_label=lambda o: f"diloco-h{o.interval}",
    )
)
