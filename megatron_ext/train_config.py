"""Flags of the ``megatron-ext train`` driver, with Megatron-LM's names.

What it does:
    The driver trains megatron-core GPT models without a Megatron-LM checkout. Its flags
    are generated from the dataclasses below by :mod:`megatron_ext.config` and use exactly
    Megatron-LM's names (``--num-layers``, ``--micro-batch-size``, ``--lr-decay-style``,
    ``--use-distributed-optimizer``, ...) so a Megatron user's command line carries over.
    Model presets (``--model gpt-tiny``) and run files (``--config FILE.yaml``) set
    defaults; flags on the command line override both. :func:`layout_sizes` checks a parsed
    configuration against the number of ranks and gives the parallel sizes (the driver's,
    and the benchmarks' check of a command before they launch it).

Constraints:
    Pure Python (no torch, no Megatron): parsing and validation happen before any process
    group or model exists, so bad flags fail fast with a message naming the flag;
    :func:`driver_layout` gives the methods' checks the run they validate against.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional

from megatron_ext.config import ConfigError, arg, check_positive, flag_of

__all__ = [
    "ModelArgs",
    "ParallelArgs",
    "TrainingArgs",
    "CheckpointArgs",
    "LoggingArgs",
    "DRIVER_CONFIG_CLASSES",
    "config_search_path",
    "find_config_file",
    "load_yaml_defaults",
    "layout_sizes",
]


class _DriverArgs:
    """Base of the driver's flag dataclasses: their flags carry Megatron-LM's names, with no
    prefix (each subclass sets its argparse group, ``ARG_GROUP``)."""

    ARG_PREFIX: ClassVar[str] = ""


@dataclass(frozen=True, kw_only=True)
class ModelArgs(_DriverArgs):
    """GPT / LLaMA-style model shape (megatron-core GPTModel, local or TE layer spec)."""

    ARG_GROUP: ClassVar[str] = "model"

    num_layers: int = 4
    """Number of transformer layers."""

    hidden_size: int = 256
    """Transformer hidden size."""

    ffn_hidden_size: Optional[int] = None
    """MLP hidden size (default 4 * hidden size)."""

    num_attention_heads: int = 4
    """Number of attention heads."""

    group_query_attention: bool = False
    """Use grouped-query attention (with --num-query-groups)."""

    num_query_groups: Optional[int] = None
    """Number of key/value groups for grouped-query attention."""

    seq_length: int = 128
    """Sequence length (tokens per sample)."""

    max_position_embeddings: Optional[int] = None
    """Maximum sequence length of the position embedding (default: --seq-length)."""

    normalization: str = field(default="LayerNorm", metadata=arg(choices=("LayerNorm", "RMSNorm")))
    """Normalization layer."""

    swiglu: bool = False
    """SwiGLU MLP activation (LLaMA style)."""

    position_embedding_type: str = field(
        default="learned_absolute", metadata=arg(choices=("learned_absolute", "rope"))
    )
    """Position embedding."""

    rotary_base: int = 10000
    """Base of the rotary position embedding."""

    untie_embeddings_and_output_weights: bool = False
    """Separate input embedding and output layer weights."""

    disable_bias_linear: bool = False
    """No bias in linear layers."""

    hidden_dropout: float = 0.1
    """Dropout probability after attention / MLP."""

    attention_dropout: float = 0.1
    """Dropout probability of attention weights."""

    init_method_std: float = 0.02
    """Standard deviation of the weight initialization."""

    transformer_impl: str = field(
        default="local", metadata=arg(choices=("local", "transformer_engine"))
    )
    """Layer implementation: megatron-core's local spec (every megatron_ext feature) or
    Transformer Engine (GPU with TE installed; only DP/PP compression)."""

    masked_softmax_fusion: bool = True
    """Fused scale-mask-softmax of the local spec's attention with --bf16 on a GPU (Apex's
    scaled_masked_softmax_cuda extension; a run without it is refused before start-up:
    pass --no-masked-softmax-fusion). CPU runs never fuse."""

    persist_layer_norm: bool = True
    """Megatron's persistent fused LayerNorm on a GPU (Megatron-LM's default; the local
    spec's norm is Apex's, and without Apex a run is refused before start-up: pass
    --no-persist-layer-norm). CPU runs never persist."""

    def __post_init__(self):
        cls = type(self)
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
            check_positive(cls, name, getattr(self, name))
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                ["--hidden-size", "--num-attention-heads"],
                f"hidden size {self.hidden_size} is not divisible by "
                f"{self.num_attention_heads} heads",
            )
        if self.group_query_attention:
            if not self.num_query_groups:
                raise ConfigError("--num-query-groups", "required with --group-query-attention")
            if self.num_attention_heads % self.num_query_groups:
                raise ConfigError(
                    ["--num-query-groups", "--num-attention-heads"],
                    "heads must be divisible by query groups",
                )
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ConfigError(flag_of(cls, name), f"must be in [0, 1), got {value}")


@dataclass(frozen=True, kw_only=True)
class ParallelArgs(_DriverArgs):
    """Parallel layout and DDP options."""

    ARG_GROUP: ClassVar[str] = "distributed"

    tensor_model_parallel_size: int = 1
    """Tensor-parallel size."""

    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size (1F1B schedule)."""

    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (gradients are reduce-scattered)."""

    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduction with the backward pass."""

    overlap_param_gather: bool = False
    """Overlap the distributed optimizer's parameter all-gather with the forward pass."""

    num_distributed_optimizer_instances: int = 1
    """Distributed-optimizer instances (consecutive data-parallel ranks each); more than one
    only as DiLoCo's sites (--outer-groups, the same number)."""

    ddp_bucket_size: Optional[int] = None
    """Gradient bucket size in elements (with --overlap-grad-reduce; default megatron's)."""

    accumulate_allreduce_grads_in_fp32: bool = False
    """Accumulate and reduce gradients in fp32 (always on with --bf16, as in Megatron-LM)."""

    distributed_backend: str = field(default="auto", metadata=arg(choices=("auto", "nccl", "gloo")))
    """torch.distributed backend: 'auto' = gloo with --cpu, else nccl."""

    distributed_timeout_minutes: int = 10
    """Timeout of collectives, in minutes."""

    def __post_init__(self):
        cls = type(self)
        check_positive(cls, "tensor_model_parallel_size", self.tensor_model_parallel_size)
        check_positive(cls, "pipeline_model_parallel_size", self.pipeline_model_parallel_size)
        check_positive(cls, "ddp_bucket_size", self.ddp_bucket_size)
        check_positive(
            cls, "num_distributed_optimizer_instances", self.num_distributed_optimizer_instances
        )
        if self.num_distributed_optimizer_instances > 1 and not self.use_distributed_optimizer:
            raise ConfigError(
                ["--num-distributed-optimizer-instances", "--use-distributed-optimizer"],
                "several distributed-optimizer instances need the distributed optimizer",
            )
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ConfigError(
                ["--overlap-param-gather", "--use-distributed-optimizer"],
                "parameter gather overlap needs the distributed optimizer",
            )


DEFAULT_LR_WARMUP_ITERS = 10
"""The driver's learning-rate warm-up when --lr-warmup-iters is not given (shorter for a
decay of 10 iterations or fewer)."""


@dataclass(frozen=True, kw_only=True)
class TrainingArgs(_DriverArgs):
    """Batch, optimizer, schedule and precision."""

    ARG_GROUP: ClassVar[str] = "training"

    micro_batch_size: int = 2
    """Samples per microbatch per data-parallel rank."""

    global_batch_size: Optional[int] = None
    """Samples per iteration over all data-parallel ranks (default: micro batch * DP)."""

    train_iters: int = 100
    """Training iterations."""

    lr: float = 1e-3
    """Peak learning rate."""

    min_lr: float = 1e-4
    """Minimum learning rate of the decay."""

    lr_decay_style: str = field(
        default="cosine",
        metadata=arg(choices=("constant", "linear", "cosine", "inverse-square-root")),
    )
    """Learning-rate decay."""

    lr_warmup_iters: Optional[int] = None
    """Linear warm-up iterations (default: 10, or one less than the decay's iterations when
    the decay is shorter, so that a run of a few iterations needs no warm-up flag)."""

    lr_decay_iters: Optional[int] = None
    """Iterations of the decay (default: --train-iters)."""

    weight_decay: float = 0.1
    """Decoupled weight decay."""

    adam_beta1: float = 0.9
    """AdamW beta1."""

    adam_beta2: float = 0.95
    """AdamW beta2."""

    adam_eps: float = 1e-8
    """AdamW epsilon."""

    clip_grad: float = 1.0
    """Gradient clipping by global norm (0 disables)."""

    override_opt_param_scheduler: bool = field(
        default=False, metadata=arg(aliases=("--override-opt_param-scheduler",))
    )
    """On --load, use this run's learning-rate schedule (--lr, --min-lr, --lr-warmup-iters,
    --lr-decay-iters / --train-iters, --lr-decay-style, --weight-decay) instead of the
    checkpoint's; the schedule continues from the checkpoint's step (Megatron-LM's flag).
    Without it or --use-checkpoint-opt-param-scheduler, a schedule that differs from the
    checkpoint's is refused."""

    use_checkpoint_opt_param_scheduler: bool = field(
        default=False, metadata=arg(aliases=("--use-checkpoint-opt_param-scheduler",))
    )
    """On --load, continue the checkpoint's learning-rate schedule and ignore this run's
    schedule flags (Megatron-LM's flag)."""

    bf16: bool = False
    """bf16 parameters and activations with fp32 main parameters and gradients."""

    seed: int = 1234
    """Random seed (initialization, dropout, data order)."""

    eval_interval: int = 0
    """Evaluate on the validation split every N iterations (0: only at the end)."""

    eval_iters: int = 2
    """Validation iterations per evaluation (0 disables evaluation)."""

    exit_interval: Optional[int] = None
    """Stop (after saving when --save is set) at this iteration, e.g. to test resume."""

    check_weight_hash_across_dp_replicas_interval: Optional[int] = None
    """Check every N iterations (and before the first) that the data-parallel replicas hold
    bit-identical weights: SHA-1 of each parameter, all-gathered over the data-parallel
    group; a mismatch stops training naming the parameters (Megatron-LM's flag of the same
    name and semantics)."""

    exit_signal_handler: bool = False
    """On SIGTERM (Slurm preemption, ``kill``) or SIGINT (Ctrl-C) finish the current
    iteration, save when --save is set, and exit with status 0 (Megatron-LM's flag, for
    both signals). All ranks agree on the iteration (one tiny all-reduce per iteration).
    Under torchrun the save must fit in its --shutdown-timeout (default 30 s)."""

    cpu: bool = False
    """Run megatron-core on CPU with the gloo backend (megatron_ext.megatron.cpu)."""

    num_threads: Optional[int] = None
    """torch intra-op threads per rank (default with --cpu: cores / ranks on this node)."""

    def __post_init__(self):
        cls = type(self)
        for name in ("micro_batch_size", "train_iters", "lr"):
            check_positive(cls, name, getattr(self, name))
        check_positive(cls, "global_batch_size", self.global_batch_size)
        check_positive(cls, "lr_warmup_iters", self.lr_warmup_iters, allow_zero=True)
        check_positive(cls, "eval_interval", self.eval_interval, allow_zero=True)
        check_positive(cls, "eval_iters", self.eval_iters, allow_zero=True)
        check_positive(cls, "exit_interval", self.exit_interval)
        check_positive(cls, "num_threads", self.num_threads)
        check_positive(
            cls,
            "check_weight_hash_across_dp_replicas_interval",
            self.check_weight_hash_across_dp_replicas_interval,
        )
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ConfigError(
                [
                    flag_of(cls, "override_opt_param_scheduler"),
                    flag_of(cls, "use_checkpoint_opt_param_scheduler"),
                ],
                "give at most one: use this run's schedule or the checkpoint's",
            )
        if self.min_lr > self.lr:
            raise ConfigError(["--min-lr", "--lr"], f"min lr {self.min_lr} > lr {self.lr}")
        decay = self.lr_decay_iters or self.train_iters
        if self.lr_warmup_iters is None:
            # The default scales down for short runs (a fixed 10 refused every run of 10
            # iterations or fewer, before any other check could speak).
            object.__setattr__(self, "lr_warmup_iters", min(DEFAULT_LR_WARMUP_ITERS, decay - 1))
        if self.lr_warmup_iters >= decay:
            raise ConfigError(
                [
                    "--lr-warmup-iters",
                    "--lr-decay-iters" if self.lr_decay_iters else "--train-iters",
                ],
                f"warm-up ({self.lr_warmup_iters} iterations) must be shorter than the decay "
                f"({decay} iterations)",
            )


@dataclass(frozen=True, kw_only=True)
class CheckpointArgs(_DriverArgs):
    """Checkpoints (megatron-core dist_checkpointing, torch_dist format)."""

    ARG_GROUP: ClassVar[str] = "checkpointing"

    save: Optional[str] = None
    """Directory to save checkpoints to (also the default place of the reports)."""

    load: Optional[str] = None
    """Checkpoint to resume from: a directory (its latest checkpoint, from
    latest_checkpointed_iteration.txt) or one of its iter_XXXXXXX directories (that
    iteration). A --load holding no checkpoint is refused, except when it is also --save
    (then a first run starts from scratch and later runs resume)."""

    save_interval: Optional[int] = None
    """Save every N iterations (and at the end)."""

    finetune: bool = False
    """Fine-tune: load only the model weights of --load's latest checkpoint (a megatron-ext
    train or Megatron-LM torch_dist checkpoint of the same model), then start at iteration
    0 with a fresh optimizer, learning-rate schedule and megatron-ext state (Megatron-LM's
    --finetune)."""

    def __post_init__(self):
        check_positive(type(self), "save_interval", self.save_interval)
        if self.save_interval and not self.save:
            raise ConfigError(["--save-interval", "--save"], "a save interval needs --save")
        if self.finetune and not self.load:
            raise ConfigError(["--finetune", "--load"], "fine-tuning needs a checkpoint to load")


@dataclass(frozen=True, kw_only=True)
class LoggingArgs(_DriverArgs):
    """Log line, TensorBoard, progress."""

    ARG_GROUP: ClassVar[str] = "logging"

    log_interval: int = 10
    """Print the iteration log line every N iterations."""

    tensorboard_dir: Optional[str] = None
    """Write TensorBoard scalars (loss, lr, grad norm, bytes per category) here."""

    log_json: Optional[str] = None
    """Append one JSON record per logged iteration to this file (default: <save>/log.jsonl
    when --save is set)."""

    progress: bool = True
    """Show a progress bar on the last rank when its output is a terminal."""

    def __post_init__(self):
        check_positive(type(self), "log_interval", self.log_interval)


DRIVER_CONFIG_CLASSES = (ModelArgs, ParallelArgs, TrainingArgs, CheckpointArgs, LoggingArgs)


def config_search_path() -> List[str]:
    """Directories searched for ``--model NAME`` / ``--config NAME``.

    ``$MEGATRON_EXT_CONFIGS`` (os.pathsep-separated), the repository's ``configs/`` (source
    or editable install) and ``<prefix>/share/megatron-ext/configs`` (wheel install).
    """
    paths = [p for p in os.environ.get("MEGATRON_EXT_CONFIGS", "").split(os.pathsep) if p]
    here = os.path.dirname(os.path.abspath(__file__))
    paths.append(os.path.join(os.path.dirname(here), "configs"))
    paths.append(os.path.join(sys.prefix, "share", "megatron-ext", "configs"))
    return paths


def find_config_file(name: str, subdir: str, flag: str) -> str:
    """Resolve a config name or path (``gpt-tiny``, ``configs/x.yaml``) to a file."""
    if os.path.isfile(name):
        return name
    candidates = []
    for base in config_search_path():
        for stem in (name, f"{name}.yaml", f"{name}.yml"):
            path = os.path.join(base, subdir, stem) if subdir else os.path.join(base, stem)
            candidates.append(path)
            if os.path.isfile(path):
                return path
    available = set()
    for base in config_search_path():
        folder = os.path.join(base, subdir)
        if os.path.isdir(folder):
            available.update(
                os.path.splitext(f)[0] for f in os.listdir(folder) if f.endswith((".yaml", ".yml"))
            )
    raise ConfigError(
        flag,
        f"no config named {name!r}; available: {', '.join(sorted(available)) or 'none'} "
        f"(searched {', '.join(config_search_path())})",
    )


def load_yaml_defaults(path: str, parser: argparse.ArgumentParser, flag: str) -> Dict[str, Any]:
    """Read a YAML mapping of argument names (``num_layers`` or ``num-layers``) to values.

    Raises:
        ConfigError: unreadable file or a key that is not a flag of ``parser``.
    """
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(flag, f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(flag, f"{path} must hold a mapping of flag names to values")
    dests = {a.dest for a in parser._actions}
    out = {}
    for key, value in data.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in dests:
            raise ConfigError(flag, f"{path}: unknown setting {key!r}")
        out[dest] = value
    return out


def layout_sizes(cfg: Any, world_size: int) -> Dict[str, int]:
    """The parallel sizes of a driver run on ``world_size`` ranks, checked.

    Args:
        cfg: the parsed driver configuration (``megatron_ext.train.DriverConfig``).
        world_size: ranks of the run.

    Returns:
        ``tp``, ``pp``, ``dp``, the global batch ``gbs`` and ``num_microbatches`` per step.

    Raises:
        ConfigError: naming the flags of a layout that does not divide (world size by
            TP x PP, global batch by micro batch x DP, layers by PP, heads and query groups
            by TP, DP by the distributed-optimizer instances).
    """
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
    instances = cfg.parallel.num_distributed_optimizer_instances
    if dp % instances:
        raise ConfigError(
            "--num-distributed-optimizer-instances",
            f"{instances} instances do not divide the data-parallel size {dp}",
        )
    return {"tp": tp, "pp": pp, "dp": dp, "gbs": gbs, "num_microbatches": gbs // (mbs * dp)}


def driver_layout(cfg: Any, sizes: Dict[str, int]) -> Any:
    """The :class:`~megatron_ext.config.ParallelLayout` of a driver run, from its flags and
    :func:`layout_sizes` (the same one ``parallel_state`` gives once the groups exist: the
    driver has no virtual pipeline), so the methods' combination checks run before the
    ranks start talking."""
    from megatron_ext.config import ParallelLayout

    p = cfg.parallel
    return ParallelLayout(
        tensor_model_parallel_size=sizes["tp"],
        pipeline_model_parallel_size=sizes["pp"],
        data_parallel_size=sizes["dp"],
        use_distributed_optimizer=p.use_distributed_optimizer,
        overlap_grad_reduce=p.overlap_grad_reduce,
        num_distributed_optimizer_instances=p.num_distributed_optimizer_instances,
        transformer_impl=cfg.model.transformer_impl,
        replica_hash_interval=cfg.training.check_weight_hash_across_dp_replicas_interval or 0,
        fixed_samples=cfg.data.fixed_samples,
    )
