"""Protocol Models in megatron-core: the subspace-confined GPT and the subspace exchange.

What it does:
    :func:`constrain_model` runs on the unwrapped model chunks (the runtime's model
    transform, before DDP and the optimizer exist) and makes every trainable writer of the
    residual stream write into ``S = span(U)``:

    * each transformer layer's attention ``linear_proj`` and MLP ``linear_fc2`` weight (and
      bias, if any) is projected onto ``S`` along its output dimension, and is registered as
      constrained (the optimizer hook keeps it there);
    * the token embedding becomes ``T_fixed + T_S``: megatron-core's ``word_embeddings``
      table is ``T_S`` (projected, constrained along its hidden dimension) and the embedding
      module's output gets ``T_fixed[tokens]`` added (a frozen Gaussian of
      ``--init-method-std``, generated from ``--subspace-seed`` on every stage, on the
      model's device in its dtype, never checkpointed); learned position embeddings are
      projected and constrained too (RoPE needs nothing);
    * with tied embeddings the head is untied by default (``--subspace-head untied``, as
      the reference code's full ``V x d`` head): it becomes its own full-rank weight,
      initialized to ``T_fixed + T_S`` (the tied model's function), and megatron-core no
      longer all-reduces the embedding's gradient with it. With ``--subspace-head tied``
      the LM head is ``T_fixed + T_S`` (the output layer's weight argument gets this
      tensor-parallel rank's vocabulary rows of ``T_fixed`` added), so its trainable part is
      only rank ``k``; megatron-core's copy of ``T_S`` on the last stage is constrained like
      the first stage's and its embedding-group gradient all-reduce is unchanged. A head the
      model already unties only reads the stream and stays as it is.

    By default (``--subspace-uncompressed-last-layers -1``) every transformer layer of the
    last pipeline stage stays unconstrained: its output never crosses a boundary (the
    reference code, one layer a stage, leaves the last stage's layer full rank). A count
    ``N >= 0`` leaves the last ``N`` layers free instead; they must lie on the last pipeline
    stage, so every stage boundary stays inside ``S``. The embedding is always ``T_fixed +
    T_S``.

    :func:`check_fixed_agrees` checks once, at install, that every rank drew the same
    ``T_fixed`` (it is drawn on the model's device by that device's generator, never sent):
    a checksum of its bits, all-reduced as a minimum and a maximum.

    :func:`basis_exchange` is the Grassmann update's communication: on the last stage ``A``
    is summed over data parallelism (and over tensor parallelism under sequence
    parallelism, where each rank holds a slice of the sequence), the step is taken once
    (data-parallel rank 0, tensor-parallel rank 0 of the last stage) and the new ``U`` is
    broadcast over that stage's data- and tensor-parallel groups and then down every
    pipeline, so that every rank holds the same bits. Counted as ``subspace`` traffic.

Constraints:
    The local layer spec (``--transformer-impl local``; the Transformer Engine spec is
    untested and refused). Hidden dropout must be 0 (dropout would push the stream out of ``S``); MoE
    layers, multi-token prediction and post-layernorm residuals are refused.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence

import torch

from megatron_ext.accounting import ProcessGroupTrafficMeter, collective_wire_bytes
from megatron_ext.collectives.subspace import SubspaceCodec
from megatron_ext.compressors.subspace import Subspace, grassmann_step, project
from megatron_ext.config import ConfigError
from megatron_ext.megatron.naming import global_param_names

__all__ = ["check_config", "constrain_model", "check_fixed_agrees", "basis_exchange", "WRITERS"]

WRITERS = ("self_attention.linear_proj", "mlp.linear_fc2")
"""The residual stream's writers inside a transformer layer (module paths)."""

_FLAG = "--subspace-method"


def _layers_on_last_stage(config: Any) -> int:
    pp = config.pipeline_model_parallel_size
    last = getattr(config, "num_layers_in_last_pipeline_stage", None)
    if last is not None:
        return last
    first = getattr(config, "num_layers_in_first_pipeline_stage", None)
    if pp == 1:
        return config.num_layers
    if first is None:
        return config.num_layers // pp
    return (config.num_layers - first) // (pp - 1)


def check_config(config: Any, rank: int, uncompressed_last_layers: int = 0) -> None:
    """Refuse a model whose residual stream cannot be confined to a rank-``rank`` subspace
    (the same verdict on every rank: before any collective)."""
    last = _layers_on_last_stage(config)
    if uncompressed_last_layers >= 0 and uncompressed_last_layers > last:
        raise ConfigError(
            ["--subspace-uncompressed-last-layers", "--pipeline-model-parallel-size"],
            f"{uncompressed_last_layers} layers left uncompressed, but the last pipeline stage "
            f"holds {last}: the boundary after an uncompressed layer would leave the subspace",
        )
    if config.hidden_dropout:
        raise ConfigError(
            [_FLAG, "--hidden-dropout"],
            f"hidden dropout ({config.hidden_dropout}) pushes the residual stream out of the "
            "subspace; pass --hidden-dropout 0",
        )
    if getattr(config, "apply_residual_connection_post_layernorm", False):
        raise ConfigError(
            [_FLAG, "--apply-residual-connection-post-layernorm"],
            "the residual stream must be the sum of the writers' outputs (pre-norm)",
        )
    if getattr(config, "num_moe_experts", None):
        raise ConfigError(
            [_FLAG, "--num-experts"],
            "mixture-of-experts layers write the residual stream through expert weights "
            "that are not constrained",
        )
    if getattr(config, "mtp_num_layers", None):
        raise ConfigError([_FLAG, "--mtp-num-layers"], "multi-token prediction is unsupported")
    if not 0 < rank < config.hidden_size:
        raise ConfigError(
            ["--subspace-rank", "--subspace-compression-rate"],
            f"the subspace rank must be in [1, {config.hidden_size - 1}] (hidden size "
            f"{config.hidden_size}), got {rank}",
        )


def _writer(layer: torch.nn.Module, path: str) -> torch.nn.Module:
    module: Any = layer
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            break
    weight = getattr(module, "weight", None)
    d = layer.config.hidden_size
    if weight is None or weight.dim() != 2 or weight.shape[0] != d:
        raise ConfigError(
            _FLAG,
            f"transformer layer {layer.layer_number} has no '{path}' linear layer writing the "
            f"hidden size {d} (found {type(module).__name__}): its residual writers cannot "
            "be constrained",
        )
    return module


def _tp_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank()


def _wrap_embedding(embedding: torch.nn.Module, subspace: Subspace, codec: SubspaceCodec) -> None:
    """Add ``T_fixed[tokens]`` to the embedding's output and hand the ids to the codec."""
    original = embedding.forward

    def forward(input_ids, position_ids, *args, **kwargs):
        out = original(input_ids, position_ids, *args, **kwargs)
        ids = input_ids.t()  # [s, b], as megatron's sequence-first activations
        if out.shape[0] != ids.shape[0]:  # sequence parallel: this rank's slice
            n = out.shape[0]
            r = _tp_rank()
            ids = ids[r * n : (r + 1) * n]
        fixed = subspace.on(out.device).fixed
        codec.push_token_ids(ids)
        return out + fixed[ids].to(out.dtype)

    embedding.forward = forward


def _wrap_tied_head(output_layer: torch.nn.Module, subspace: Subspace) -> None:
    """The tied LM head reads ``T_fixed + T_S``: add this rank's vocabulary rows of T_fixed."""
    original = output_layer.forward

    def forward(input_, *args, weight=None, **kwargs):
        if weight is not None:
            fixed = subspace.on(weight.device).fixed
            rows = weight.shape[0]
            r = _tp_rank()
            weight = weight + fixed[r * rows : (r + 1) * rows].to(weight.dtype)
        return original(input_, *args, weight=weight, **kwargs)

    output_layer.forward = forward


def _untie_head(chunk: torch.nn.Module, subspace: Subspace, pre: bool, post: bool) -> None:
    """Give a tied model's LM head its own full-rank weight ``T_fixed + T_S`` (this rank's
    vocabulary rows), as an untied model has, and stop megatron-core treating the embedding
    and the head as one parameter (no embedding-group gradient all-reduce). Runs after the
    embedding ``T_S`` was projected onto ``S``, so the model computes the same function as
    the tied one at initialization."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    chunk.share_embeddings_and_output_weights = False
    if pre:
        emb = chunk.embedding.word_embeddings.weight
        for attr in ("shared_embedding", "zero_out_wgrad"):
            if hasattr(emb, attr):
                delattr(emb, attr)
    if not post:
        return
    head = chunk.output_layer
    source = chunk.embedding.word_embeddings.weight if pre else head.weight
    fixed = subspace.on(source.device).fixed
    rows = source.shape[0]
    r = _tp_rank()
    with torch.no_grad():
        value = source.detach() + fixed[r * rows : (r + 1) * rows].to(source.dtype)
    if pre:  # one stage: megatron allocated no head weight (it read the embedding's)
        weight = torch.nn.Parameter(value.clone())
        set_tensor_model_parallel_attributes(weight, True, 0, 1)
        weight.is_embedding_or_output_parameter = True
        head.weight = weight
    else:  # the last stage's copy of T_S becomes the head
        with torch.no_grad():
            head.weight.copy_(value)
        for attr in ("shared", "shared_embedding"):
            if hasattr(head.weight, attr):
                delattr(head.weight, attr)


def constrain_model(
    model_chunks: Sequence[torch.nn.Module],
    subspace: Subspace,
    codec: SubspaceCodec,
    *,
    uncompressed_last_layers: int,
    untie_head: bool = True,
) -> Dict[str, int]:
    """Confine the chunks' residual writers to ``S`` (module docstring). The caller has
    checked the model config with :func:`check_config` (before building ``subspace``).

    Returns:
        Global FQN of every constrained parameter -> its dimension of size ``d``.

    Raises:
        ConfigError: a setting or a layer that cannot be constrained (names the flag).
    """
    from megatron.core.transformer.transformer_layer import TransformerLayer

    constrained: Dict[str, int] = {}
    for chunk in model_chunks:
        config = chunk.config
        if config.hidden_size != subspace.d:
            raise ValueError(f"hidden size {config.hidden_size} != subspace's {subspace.d}")
        names = global_param_names(chunk)
        post = bool(getattr(chunk, "post_process", True))
        if uncompressed_last_layers < 0:  # the last stage's layers: no boundary after them
            first_free = 0 if post else config.num_layers
        else:
            first_free = config.num_layers - uncompressed_last_layers  # layers > this: free
        params: List[tuple] = []
        for module in chunk.modules():
            if not isinstance(module, TransformerLayer):
                continue
            if module.layer_number > first_free:
                if not post:
                    raise ConfigError(
                        ["--subspace-uncompressed-last-layers", "--pipeline-model-parallel-size"],
                        f"layer {module.layer_number} is left uncompressed but is not on the "
                        "last pipeline stage: the boundary after it would leave the subspace",
                    )
                continue
            for path in WRITERS:
                writer = _writer(module, path)
                params.append((writer.weight, 0))
                bias = getattr(writer, "bias", None)
                if isinstance(bias, torch.nn.Parameter) and bias.requires_grad:
                    params.append((bias, 0))
        # The device the chunk will run on. Before Megatron moves the chunk to the GPU, its
        # linear weights are already there but torch-built parameters (a non-Apex norm, the
        # position embedding) are still on the CPU: every stage must draw T_fixed with the
        # same generator, so take the first parameter off the CPU, if any.
        device = next(
            (p.device for p in chunk.parameters() if p.device.type != "cpu"), torch.device("cpu")
        )
        dtype = config.params_dtype
        vocab = getattr(chunk, "vocab_size", None)
        tied = bool(getattr(chunk, "share_embeddings_and_output_weights", False))
        pre = bool(getattr(chunk, "pre_process", True))
        # Every stage embeds, decodes a boundary or reads the tied head: each needs T_fixed.
        subspace.make_fixed(vocab, config.init_method_std, dtype, device)
        if pre:
            emb = chunk.embedding
            params.append((emb.word_embeddings.weight, 1))
            pos = getattr(emb, "position_embeddings", None)
            if pos is not None:
                params.append((pos.weight, 1))
            _wrap_embedding(emb, subspace, codec)
        if post and tied and not untie_head:
            _wrap_tied_head(chunk.output_layer, subspace)
            if not pre:
                params.append((chunk.output_layer.weight, 1))
        subspace.on(device)
        with torch.no_grad():
            for param, axis in params:
                u = subspace.u.to(param.device)  # a CPU parameter moves with the chunk later
                param.copy_(project(param, u, axis))
                constrained[names[param]] = axis
            if tied and untie_head and post and not pre:  # the copy of T_S the head starts from
                weight = chunk.output_layer.weight
                weight.copy_(project(weight, subspace.u.to(weight.device), 1))
        if tied and untie_head:
            _untie_head(chunk, subspace, pre, post)
    return constrained


def check_fixed_agrees(subspace: Subspace, group: Any = None) -> None:
    """Raise unless every rank of ``group`` (default: all) holds the same ``T_fixed`` bits.

    One int64 checksum (the sum of the bit patterns, with no temporary of the table's size)
    and two one-element all-reduces, once at install.

    Raises:
        RuntimeError: the ranks drew different tables (models built on different kinds of
            device, whose generators differ).
    """
    fixed = subspace.fixed
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[fixed.element_size()]
    checksum = fixed.view(bits).sum(dtype=torch.int64).reshape(1)
    low, high = checksum.clone(), checksum.clone()
    torch.distributed.all_reduce(low, op=torch.distributed.ReduceOp.MIN, group=group)
    torch.distributed.all_reduce(high, op=torch.distributed.ReduceOp.MAX, group=group)
    if not torch.equal(low, high):
        raise RuntimeError(
            f"{_FLAG}: the ranks drew different frozen token embeddings T_fixed (checksums "
            f"{int(low)} .. {int(high)}); it is drawn on each model's device, so every rank "
            "must build its model on the same kind of device (--use-cpu-initialization)"
        )


def basis_exchange(
    subspace: Subspace, lr: float, *, owner: bool, sequence_parallel: bool, meter: Any = None
) -> Callable[[], torch.Tensor]:
    """The Grassmann update's collective (module docstring): returns ``update() -> U``.

    Args:
        subspace: the run's subspace (``A`` accumulated on the last stage).
        lr: ``--subspace-lr``.
        owner: this rank is on the last pipeline stage (it holds ``A``).
        sequence_parallel: ``A`` is partial per tensor-parallel rank.
        meter: byte accounting (category ``subspace``).
    """
    from megatron.core import parallel_state as ps

    def record(op: str, t: torch.Tensor, group: Any) -> None:
        size = torch.distributed.get_world_size(group)
        if meter is not None and size > 1:
            wire = collective_wire_bytes(op, t.numel() * t.element_size(), size)
            meter.record("subspace", sent=wire, recv=wire)

    def broadcast(t: torch.Tensor, group: Any, src_local: int) -> None:
        if torch.distributed.get_world_size(group) == 1:
            return
        record("broadcast", t, group)
        src = torch.distributed.get_global_rank(group, src_local)
        with ProcessGroupTrafficMeter.tagged("subspace"):
            torch.distributed.broadcast(t, src=src, group=group)

    def update() -> torch.Tensor:
        u = subspace.u
        new = torch.empty_like(u)
        if owner:
            a = subspace.a if subspace.a is not None else torch.zeros(subspace.d, subspace.d)
            a = a.to(u.device)
            tp = ps.get_tensor_model_parallel_group()
            dp = ps.get_data_parallel_group(with_context_parallel=True)
            groups = ([tp] if sequence_parallel else []) + [dp]
            for group in groups:
                if torch.distributed.get_world_size(group) > 1:
                    record("all_reduce", a, group)
                    with ProcessGroupTrafficMeter.tagged("subspace"):
                        torch.distributed.all_reduce(a, group=group)
            if ps.get_tensor_model_parallel_rank() == 0 and torch.distributed.get_rank(dp) == 0:
                new = grassmann_step(u, a, lr)
            broadcast(new, dp, 0)
            broadcast(new, tp, 0)
        pp = ps.get_pipeline_model_parallel_group()
        broadcast(new, pp, torch.distributed.get_world_size(pp) - 1)
        return new

    return update
