"""DiLoCo (``--outer-method diloco``): options, factory and registration.

The algorithm is ``megatron_ext.optim.diloco`` (the outer Nesterov-SGD step on the
pseudo-gradient, its fragments and the dense outer exchange). This module turns the flags
into the sites' process groups (the gradient seam reduces over a site's ranks through
:attr:`~megatron_ext.methods.registry.Components.grad_group`, which the other methods also
see as their data-parallel group) and the optimizer hook that runs the outer step, through
the other methods' :attr:`~megatron_ext.methods.registry.Components.outer_view` (Grass).
"""

from __future__ import annotations

from dataclasses import field
from typing import Optional

from megatron_ext.methods.registry import Components, Method, MethodContext, register
from megatron_ext.options.base import (
    RUN_ONLY,
    ConfigError,
    arg,
    check_choice,
    check_positive,
    flag_of,
    options_dataclass,
)
from megatron_ext.options.outer import OUTER_EXCHANGES

__all__ = ["OuterConfig", "METHOD"]

_STATE_DEVICES = ("device", "cpu")
_TRANSPORTS = ("world", "torchft")


@options_dataclass(group="megatron-ext: outer synchronization (DiLoCo)", prefix="outer")
class OuterConfig:
    """DiLoCo: sites train apart for H steps, then average their pseudo-gradients."""

    interval: int = 100
    """H: inner steps between two outer synchronizations of a fragment (DiLoCo paper: 500;
    torchft's sync_every)."""

    lr: float = 0.7
    """Outer learning rate (DiLoCo paper: 0.7)."""

    momentum: float = 0.9
    """Outer momentum (DiLoCo paper: 0.9)."""

    nesterov: bool = True
    """Nesterov momentum in the outer SGD step (DiLoCo paper: on)."""

    groups: Optional[int] = None
    """G: the data-parallel ranks form G sites of consecutive ranks; inside a site ordinary
    data parallelism every step, across sites only the outer synchronization. Default: the
    data-parallel size (each rank its own site: pure DiLoCo)."""

    fragments: int = 1
    """F: streaming DiLoCo; the parameters are split into F fragments (contiguous in FQN
    order, balanced by size) and fragment i is synchronized at offset i*H/F of each cycle of
    H steps."""

    delay: int = 0
    """tau: inner steps a fragment's exchange overlaps (Streaming DiLoCo's tau, torchft's
    fragment_sync_delay): its pseudo-gradient is sent after step t and applied after step
    t + tau; 0: blocking, applied at once. tau < H. A compressed exchange
    (--outer-compression) then runs on a worker thread."""

    merge_alpha: float = 0.0
    """alpha: after the outer step the fragment's weights become alpha * local + (1 - alpha)
    * global (Streaming DiLoCo's alpha, torchft's fragment_update_alpha); 0: the global
    weights (the sites agree after every sync)."""

    state_device: str = field(default="device", metadata=arg(choices=_STATE_DEVICES))
    """Where the fp32 outer state (last synchronized parameters, outer momentum) lives:
    'device' (the parameters' device) or 'cpu' (host memory)."""

    compression: str = "none"
    """Compression of the pseudo-gradient exchange, error feedback kept across outer syncs:
    'none' (dense fp32 all-reduce), 'quantized' (4-bit rows of 256, as Streaming DiLoCo),
    'radius' (top-k of 1/64 per chunk of 4096, as SparseLoCo), 'separate' (ratio 16),
    'powersgd' (rank 4). The exchange's own settings are these defaults, not the
    --quantized-* / --radius-* / --separate-* / --powersgd-* flags (those configure
    --grad-compression inside a site)."""

    transport: str = field(default="world", metadata=arg(choices=_TRANSPORTS))
    """How the sites talk at an outer step: 'world' (every site is a run of data-parallel
    ranks of one torch.distributed world, --outer-groups; a failure anywhere stops every
    site) or 'torchft' (each site is its own job, this one; the outer step goes through
    torchft's Manager and lighthouse: a dead site is dropped at the next quorum, a started or
    restarted one recovers the global state from a live peer; megatron_ext/optim/diloco_ft.py)."""

    site_id: Optional[int] = None
    """With --outer-transport torchft: this job's site (torchft replica id), unique among the
    sites; a restarted site keeps its id."""

    sites: Optional[int] = None
    """With --outer-transport torchft: N, the site ids are 0..N-1; each site trains on its
    own 1/N of the training samples (disjoint shards: megatron_ext/train.py; in
    pretrain_gpt.py megatron_ext/megatron/lm/session.py)."""

    lighthouse: Optional[str] = field(default=None, metadata=RUN_ONLY)
    """With --outer-transport torchft: the lighthouse address, e.g. http://host:29510
    (megatron-ext lighthouse starts one). Default: the TORCHFT_LIGHTHOUSE environment variable."""

    min_sites: int = field(default=1, metadata=RUN_ONLY)
    """With --outer-transport torchft: an outer step commits only with at least this many
    sites present (torchft's min_replica_size); with fewer, the sites wait (up to
    --outer-quorum-timeout) for others."""

    quorum_timeout: float = field(default=600.0, metadata=RUN_ONLY)
    """With --outer-transport torchft: seconds an outer step may wait for its quorum (the
    other sites reaching the same step, a dead one being dropped); training stops with an
    error past it."""

    timeout: float = field(default=60.0, metadata=RUN_ONLY)
    """With --outer-transport torchft: seconds for the exchange's collectives and a live
    recovery's transfer; a failed attempt is retried over the sites still alive."""

    def __post_init__(self):
        cls = type(self)
        check_positive(cls, "interval", self.interval)
        check_positive(cls, "lr", self.lr)
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(flag_of(cls, "momentum"), f"must be in [0, 1), got {self.momentum}")
        if self.groups is not None:
            check_positive(cls, "groups", self.groups)
        check_positive(cls, "fragments", self.fragments)
        if self.fragments > self.interval:
            raise ConfigError(
                [flag_of(cls, "fragments"), flag_of(cls, "interval")],
                f"{self.fragments} fragments need an interval of at least as many steps, got "
                f"{self.interval}",
            )
        check_positive(cls, "delay", self.delay, allow_zero=True)
        if self.delay >= self.interval:
            raise ConfigError(
                [flag_of(cls, "delay"), flag_of(cls, "interval")],
                f"a fragment's exchange must land before its next one: delay {self.delay} "
                f"needs an interval above it, got {self.interval}",
            )
        if not 0.0 <= self.merge_alpha <= 1.0:
            raise ConfigError(
                flag_of(cls, "merge_alpha"), f"must be in [0, 1], got {self.merge_alpha}"
            )
        check_choice(cls, "state_device", self.state_device)
        if self.compression not in OUTER_EXCHANGES:
            raise ConfigError(
                flag_of(cls, "compression"),
                f"unknown exchange {self.compression!r} (choose from "
                f"{', '.join(OUTER_EXCHANGES)})",
            )
        check_choice(cls, "transport", self.transport)
        check_positive(cls, "min_sites", self.min_sites)
        check_positive(cls, "quorum_timeout", self.quorum_timeout)
        check_positive(cls, "timeout", self.timeout)
        if self.transport == "torchft":
            _check_torchft(self)

    def num_sites(self, dp: int) -> int:
        """G for a data-parallel size ``dp`` (sites inside this world: 1 with torchft, where
        the whole job is one site)."""
        if self.transport == "torchft":
            return 1
        return dp if self.groups is None else self.groups


def _check_torchft(o: OuterConfig) -> None:
    """What --outer-transport torchft cannot serve (yet), refused naming the flags."""
    cls = type(o)
    t = flag_of(cls, "transport")
    if o.site_id is None or o.site_id < 0:
        raise ConfigError([t, flag_of(cls, "site_id")], "each site needs its id (0, 1, ...)")
    if o.sites is None or not 0 <= o.site_id < o.sites:
        raise ConfigError(
            [flag_of(cls, "sites"), flag_of(cls, "site_id")],
            f"the site ids are 0 .. N-1 for N sites (each reads its own 1/N of the data): "
            f"got site {o.site_id} of {o.sites}",
        )
    if o.min_sites > o.sites:
        raise ConfigError(
            [flag_of(cls, "min_sites"), flag_of(cls, "sites")],
            f"{o.min_sites} sites per outer step cannot be reached with {o.sites} sites",
        )
    if o.groups not in (None, 1):
        raise ConfigError(
            [t, flag_of(cls, "groups")],
            "with torchft each job is one site (its data-parallel ranks reduce every step); "
            "start one job per site instead of --outer-groups",
        )
    # torchft's Manager takes one step at a time (quorum, collectives, commit vote): a
    # fragment's overlapped outer step must be voted on before the next fragment's quorum.
    gap = min(
        ((i + 1) * o.interval) // o.fragments - (i * o.interval) // o.fragments
        for i in range(o.fragments)
    )
    if o.delay >= gap:
        raise ConfigError(
            [t, flag_of(cls, "delay"), flag_of(cls, "fragments")],
            f"over torchft a fragment's exchange must land before the next fragment's outer "
            f"step starts (one torchft step at a time): delay {o.delay} must be below "
            f"{gap}, the fewest steps between two fragments' outer steps",
        )


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
