"""Checks of values and of the environment made before a run starts, for both hosts.

What it does:
    * :data:`FLAG_RANGES` is the one table of the allowed range of every numeric flag,
      keyed by its argparse destination: Megatron-LM's flags under Megatron-LM's names
      (``lr``, ``adam_beta1``, ``init_method_std``, ...; ``megatron-ext train`` uses the
      same names) and every megatron-ext flag (``outer_lr``, ``separate_block_size``, ...).
      Floating-point values must be finite (NaN and infinity pass ordinary comparisons such
      as ``value <= 0`` unnoticed). :func:`check_flag_values` checks whatever flags of the
      table a parsed namespace holds; a value outside its range is refused with one line
      naming the flag and the range, e.g. ``--adam-beta1: must be a finite number in
      [0, 1), got 2.0``.
    * :func:`check_flag_relations`: relations between flags that would otherwise fail deep
      inside the run (a learned position embedding shorter than a sample, ``--min-lr``
      above ``--lr``, a ``--split`` that gives training no documents, a warm-up as long as
      the decay) or do nothing without a word (a DiLoCo ``--outer-interval`` longer than
      ``--train-iters``).
    * Environment (:func:`check_transformer_engine`, :func:`check_backend`,
      :func:`check_writable`): Transformer Engine requested but not installed, NCCL
      requested without CUDA devices or without NCCL in the torch build, an output
      directory that cannot be written.
    * Memory estimates: :func:`sample_index_bytes` (megatron-core's GPTDataset index
      build) and :func:`check_fits_host_memory`, which compares an estimate with the
      memory this node has available.

Why one place:
    The same Megatron-LM flags reach megatron-core through our driver
    (``megatron_ext.train.parse_args``) and through Megatron-LM's ``pretrain_gpt.py`` (the
    session's ``validate_args`` hook runs :func:`check_flag_values` before Megatron-LM's
    own checks, which end in assertion tracebacks). Before this, a NaN learning rate, an
    Adam beta of 2 or a negative seed passed every check and ended in a worker traceback
    (torch's ``Invalid learning rate``, numpy's seed range, an all-NaN model).

Constraints:
    Pure Python at import time (torch only inside :func:`check_backend`): the driver calls
    it while parsing, before any process group or model exists. A flag missing from a
    namespace (another host, another release) or left at None is not checked. Ranges
    state what the value must be for the run to work, not what is sensible: tuning stays
    the user's.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple

from megatron_ext.options.base import ConfigError

__all__ = [
    "Range",
    "FLAG_RANGES",
    "SEED_MAX",
    "flag_of_dest",
    "check_flag_values",
    "check_flag_relations",
    "check_transformer_engine",
    "check_backend",
    "check_writable",
    "sample_index_bytes",
    "check_fits_host_memory",
    "available_memory",
    "available_host_memory",
    "agreed_minimum",
    "format_bytes",
]

SEED_MAX = 2**31 - 1
"""Largest ``--seed``: numpy takes seeds below 2**32, and Megatron-LM and the driver add
100 per pipeline stage (Megatron-LM also 10 per data-parallel rank) to it."""


@dataclass(frozen=True)
class Range:
    """An allowed range of a numeric flag (bounds inclusive unless ``*_open``)."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False

    def describe(self) -> str:
        """The range in words: ``a finite number in [0, 1)``, ``an integer >= 1``."""
        kind = "an integer" if self.integer else "a finite number"
        low, high = _fmt(self.low), _fmt(self.high)
        if self.low is not None and self.high is not None:
            left = "(" if self.low_open else "["
            right = ")" if self.high_open else "]"
            return f"{kind} in {left}{low}, {high}{right}"
        if self.low is not None:
            return f"{kind} {'>' if self.low_open else '>='} {low}"
        if self.high is not None:
            return f"{kind} {'<' if self.high_open else '<='} {high}"
        return kind

    def admits(self, value: Any) -> bool:
        """Whether ``value`` lies in the range (booleans and non-numbers never do)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.integer and not isinstance(value, int):
            return False
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return False
        return True


def _fmt(x: Optional[float]) -> str:
    if x is None:
        return ""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _count(low: int = 1) -> Range:
    return Range(low=low, integer=True)


_INTEGER = Range(integer=True)
_POSITIVE = Range(low=0, low_open=True)
_NON_NEGATIVE = Range(low=0)
_PROBABILITY = Range(low=0, high=1, high_open=True)  # dropout, Adam betas, momentum
_FRACTION = Range(low=0, high=1)
_SEED = Range(low=0, high=SEED_MAX, integer=True)


FLAG_RANGES: Dict[str, Range] = {
    # -- model ---------------------------------------------------------------------------
    "num_layers": _count(),
    "hidden_size": _count(),
    "ffn_hidden_size": _count(),
    "num_attention_heads": _count(),
    "num_query_groups": _count(),
    "kv_channels": _count(),
    "seq_length": _count(),
    "max_position_embeddings": _count(),
    "rotary_base": _count(),  # 0 makes every rotary frequency infinite (NaN loss)
    "rotary_percent": Range(low=0, high=1, low_open=True),
    "hidden_dropout": _PROBABILITY,
    "attention_dropout": _PROBABILITY,
    "init_method_std": _NON_NEGATIVE,
    "vocab_size": _count(),
    # -- parallelism and distributed -------------------------------------------------------
    "tensor_model_parallel_size": _count(),
    "pipeline_model_parallel_size": _count(),
    "context_parallel_size": _count(),
    "num_distributed_optimizer_instances": _count(),
    "ddp_bucket_size": _count(),
    "distributed_timeout_minutes": _count(),
    "num_threads": _count(),
    # -- batch, schedule, optimizer ----------------------------------------------------------
    "micro_batch_size": _count(),
    "global_batch_size": _count(),
    "train_iters": _count(),
    "train_samples": _count(),
    "lr": _POSITIVE,
    "min_lr": _NON_NEGATIVE,
    "lr_warmup_iters": _count(0),
    "lr_warmup_samples": _count(0),
    "lr_warmup_fraction": _FRACTION,
    "lr_decay_iters": _count(),
    "lr_decay_samples": _count(),
    "weight_decay": _NON_NEGATIVE,
    "start_weight_decay": _NON_NEGATIVE,
    "end_weight_decay": _NON_NEGATIVE,
    "adam_beta1": _PROBABILITY,
    "adam_beta2": _PROBABILITY,
    "adam_eps": _POSITIVE,  # 0 divides 0 by 0 where a gradient entry is 0 from the start
    "sgd_momentum": _PROBABILITY,
    "clip_grad": _NON_NEGATIVE,
    "seed": _SEED,
    # -- mixed precision (Megatron-LM) -------------------------------------------------------
    "loss_scale": _POSITIVE,
    "initial_loss_scale": _POSITIVE,
    "min_loss_scale": _POSITIVE,
    "loss_scale_window": _POSITIVE,
    "hysteresis": _count(),
    # -- evaluation, checkpoints, logging ----------------------------------------------------
    "eval_interval": _count(0),
    "eval_iters": _count(0),
    "exit_interval": _count(),
    "save_interval": _count(),
    "log_interval": _count(),
    "check_weight_hash_across_dp_replicas_interval": _count(),
    "fixed_samples": _count(),
    # -- megatron-ext: SEPARATE --------------------------------------------------------------
    "separate_ratio": _count(),
    "separate_block_size": _count(),
    "separate_ef_beta": _NON_NEGATIVE,  # 0: no error feedback
    "separate_reset_interval": _count(),
    "separate_refresh_interval": _count(0),
    "separate_seed": _INTEGER,  # hashed (any integer)
    "separate_adapt_interval": _count(),
    "separate_min_ratio": _count(),
    "separate_max_ratio": _count(),
    # -- megatron-ext: Radius, PowerSGD, quantized, QuantizedAdam ----------------------------
    "radius_density": Range(low=0, high=1, low_open=True),
    "radius_interval": _count(),
    "radius_dense_steps": _count(0),
    "powersgd_approx_rank": _count(),
    "powersgd_start_step": _count(0),
    "powersgd_min_compression_rate": Range(low=1),
    "powersgd_seed": _INTEGER,  # hashed (any integer)
    "quantized_bits": _count(),
    "quantized_block_size": _count(),
    "quantized_adam_bits": _count(),
    "quantized_adam_block_size": _count(),
    "quantized_adam_warmup_steps": _count(),
    # -- megatron-ext: AQ-SGD, Grass, Protocol Models ----------------------------------------
    "aqsgd_fw_bits": _count(),
    "aqsgd_bw_bits": _count(),
    "aqsgd_warmup_epochs": _count(0),
    "aqsgd_seed": _count(0),
    "grass_rank": _count(),
    "grass_update_interval": _count(0),
    "grass_scale": _POSITIVE,
    "grass_rewarmup_steps": _count(0),
    "grass_sketch_size": _count(0),
    "grass_seed": _count(0),
    "subspace_rank": _count(0),
    "subspace_compression_rate": Range(low=1),
    "subspace_min_rank": _count(0),
    "subspace_seed": _count(0),
    "subspace_update_interval": _count(0),
    "subspace_lr": _POSITIVE,
    "subspace_uncompressed_last_layers": _count(-1),  # -1: the last stage's layers
    "subspace_reproject_interval": _count(0),
    # -- megatron-ext: DiLoCo ------------------------------------------------------------------
    "outer_interval": _count(),
    "outer_lr": _POSITIVE,
    "outer_momentum": _PROBABILITY,
    "outer_groups": _count(),
    "outer_fragments": _count(),
    "outer_delay": _count(0),
    "outer_merge_alpha": _FRACTION,
    "outer_site_id": _count(0),
    "outer_sites": _count(),
    "outer_min_sites": _count(),
    "outer_quorum_timeout": _POSITIVE,
    "outer_timeout": _POSITIVE,
}
"""Allowed range of every numeric flag, by argparse destination (see module docstring).
tests/unit/test_validation.py checks that every numeric field of the driver's and
megatron-ext's option dataclasses has an entry."""


def flag_of_dest(dest: str) -> str:
    """The command-line flag of an argparse destination (``adam_beta1`` -> ``--adam-beta1``)."""
    return "--" + dest.replace("_", "-")


def check_flag_values(args: Any, dests: Optional[Iterable[str]] = None) -> None:
    """Refuse any flag of :data:`FLAG_RANGES` whose value on ``args`` is out of its range.

    Args:
        args: a parsed namespace (or any object with the destinations as attributes);
            missing attributes and None values are not checked.
        dests: check only these destinations (default: the whole table).

    Raises:
        ConfigError: naming the first flag out of range, its range and the value.
    """
    for dest in FLAG_RANGES if dests is None else dests:
        value = getattr(args, dest, None)
        if value is None:
            continue
        allowed = FLAG_RANGES[dest]
        if not allowed.admits(value):
            raise ConfigError(flag_of_dest(dest), f"must be {allowed.describe()}, got {value!r}")


def _split_shares(split: str) -> Optional[Sequence[float]]:
    """megatron-core's reading of ``--split`` (comma or slash separated), None if unreadable."""
    try:
        return [float(x) for x in re.split(r"[,/]", split) if x.strip()]
    except ValueError:
        return None


def check_flag_relations(args: Any) -> None:
    """Refuse flag combinations that would fail inside the run (see module docstring).

    Raises:
        ConfigError: naming the flags.
    """
    seq = getattr(args, "seq_length", None)
    positions = getattr(args, "max_position_embeddings", None)
    embedding = getattr(args, "position_embedding_type", "learned_absolute")
    if seq and positions is not None and embedding == "learned_absolute" and positions < seq:
        raise ConfigError(
            ["--max-position-embeddings", "--seq-length"],
            f"the learned position embedding has {positions} positions, fewer than the {seq} "
            f"tokens of a sample: pass --max-position-embeddings >= {seq} (or a shorter "
            "--seq-length)",
        )
    lr, min_lr = getattr(args, "lr", None), getattr(args, "min_lr", None)
    if lr is not None and min_lr is not None and min_lr > lr:
        raise ConfigError(["--min-lr", "--lr"], f"min lr {min_lr} > lr {lr}")
    _check_schedules(args)
    split = getattr(args, "split", None)
    training = getattr(args, "train_iters", None) or getattr(args, "train_samples", None)
    if isinstance(split, str) and training:
        shares = _split_shares(split)
        if shares is not None and (not shares or shares[0] <= 0):
            raise ConfigError(
                "--split",
                f"{split!r} gives the training split no documents (its first share is 0); "
                "training needs a share > 0, e.g. --split 969,30,1",
            )


def _check_schedules(args: Any) -> None:
    """Schedules counted in iterations that do not fit in ``--train-iters``.

    * The learning-rate warm-up must end before the decay does (megatron-core asserts it in
      its scheduler, at the first step, as an ``AssertionError``).
    * DiLoCo's first outer step of every fragment must come within the run: fragment ``i``
      of ``F`` is first synchronized after ``i * H // F`` inner steps, fragment 0 after
      ``H`` (``--outer-interval``), the last of them. With ``H > --train-iters`` the sites
      train apart and never exchange anything: not DiLoCo, and nothing says so. Refused
      rather than warned about: a warning scrolls away in the run's log, and the fix is one
      flag.

    Runs counted in samples (Megatron-LM's ``--train-samples``) are not checked.

    Raises:
        ConfigError: naming the flags.
    """
    iters = getattr(args, "train_iters", None)
    if not iters:
        return
    warmup = getattr(args, "lr_warmup_iters", None)
    decay_iters = getattr(args, "lr_decay_iters", None)
    decay = decay_iters or iters
    if warmup and warmup >= decay:
        decay_flag = "--lr-decay-iters" if decay_iters else "--train-iters"
        raise ConfigError(
            ["--lr-warmup-iters", decay_flag],
            f"the learning-rate warm-up ({warmup} iterations) must end before the decay does "
            f"({decay_flag} {decay}): pass --lr-warmup-iters below {decay}",
        )
    if getattr(args, "outer_method", "none") != "diloco":
        return
    interval = getattr(args, "outer_interval", None)
    fragments = getattr(args, "outer_fragments", None) or 1
    if interval and interval > iters:
        if fragments > 1:
            what = (
                f"fragment 0 of {fragments} is first synchronized after {interval} inner steps "
                f"(fragment i after i x {interval} / {fragments}), the run has {iters}: "
                "fragment 0 would never be synchronized"
            )
        else:
            what = (
                f"first outer step comes after {interval} inner steps, the run has {iters}: "
                "the sites would train apart and never synchronize"
            )
        raise ConfigError(
            ["--outer-interval", "--train-iters"],
            f"DiLoCo's {what}; pass --outer-interval {iters} or less (or more --train-iters)",
        )


# ------------------------------------------------------------------------------------------
# Environment
# ------------------------------------------------------------------------------------------


def check_transformer_engine(transformer_impl: Optional[str]) -> None:
    """Refuse ``--transformer-impl transformer_engine`` where Transformer Engine cannot be
    imported (megatron-core would fail building its layer spec: ``NameError:
    TESpecProvider``).

    Raises:
        ConfigError: naming ``--transformer-impl`` and why the import failed.
    """
    if transformer_impl != "transformer_engine":
        return
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken build (OSError, ...)
        raise ConfigError(
            "--transformer-impl",
            "transformer_engine needs NVIDIA Transformer Engine, which cannot be imported "
            f"here ({type(exc).__name__}: {exc}); install transformer_engine[pytorch] or "
            "pass --transformer-impl local",
        ) from None


def check_backend(backend: Optional[str], cpu: bool, *, cpu_flag: str = "--cpu") -> None:
    """Refuse NCCL where it cannot run: with CPU execution, without NCCL in the torch build,
    or without a CUDA device.

    Args:
        backend: ``--distributed-backend`` (``auto`` stands for gloo with CPU execution,
            NCCL otherwise: the driver's rule).
        cpu: CPU execution is on.
        cpu_flag: how the user turns CPU execution on (named in the message).

    Raises:
        ConfigError: naming ``--distributed-backend``.
    """
    if backend != "nccl":
        return
    if cpu:
        raise ConfigError(
            ["--distributed-backend", cpu_flag],
            f"NCCL moves CUDA tensors only; {cpu_flag} runs on CPU with gloo: drop "
            "--distributed-backend nccl (or pass gloo)",
        )
    import torch

    if not torch.distributed.is_nccl_available():
        raise ConfigError(
            "--distributed-backend",
            f"this torch build ({torch.__version__}) has no NCCL; pass --distributed-backend "
            f"gloo with {cpu_flag}, or install a CUDA build of torch",
        )
    if not torch.cuda.is_available():
        raise ConfigError(
            ["--distributed-backend", cpu_flag],
            f"NCCL needs CUDA devices and none is visible; pass {cpu_flag} to run on CPU "
            "with gloo",
        )


def check_writable(path: Optional[str], flag: str) -> None:
    """Create directory ``path`` if needed and write (then remove) a small file in it.

    Every process that calls it probes for itself (its own file name), so on several nodes
    each checks its view of a shared file system. A read-only file system, a missing
    permission or a path through a file fails here, before start-up, instead of at the
    first checkpoint.

    Raises:
        ConfigError: naming ``flag``, the path and the operating system's reason.
    """
    if not path:
        return
    probe = os.path.join(path, f".megatron_ext_write_probe.{os.uname().nodename}.{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "w") as f:
            f.write("megatron-ext write probe\n")
        os.remove(probe)
    except OSError as exc:
        raise ConfigError(
            flag,
            f"cannot write to {path}: {exc.strerror or exc} "
            f"({exc.filename or path}); choose a writable directory",
        ) from None


# ------------------------------------------------------------------------------------------
# Memory estimates
# ------------------------------------------------------------------------------------------


def format_bytes(num: float) -> str:
    """``69.70 GiB`` style."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num >= scale:
            return f"{num / scale:.2f} {unit}"
    return f"{int(num)} bytes"


def sample_index_bytes(
    num_samples: int,
    seq_length: int,
    num_tokens: int,
    num_documents: int,
    add_extra_token: int = 1,
) -> Tuple[int, int]:
    """Peak host memory of building megatron-core's GPTDataset indices for one split.

    megatron-core (``gpt_dataset._build_document_sample_shuffle_indices``) repeats the
    split's documents for ``E`` epochs, the fewest with ``E * T >= S * L + extra``
    (``S`` samples of ``L`` tokens from ``T`` tokens in ``D`` documents per epoch), then:

    * the document index: ``numpy.mgrid[0:E, 0:D]`` is an int64 array of shape
      ``(2, E, D)`` (16 E D bytes) from which an int32 copy is taken (4 E D bytes):
      ``20 E D`` bytes at its peak;
    * the sample index, ``N + 1`` pairs of offsets with ``N = (E T - extra) // L`` samples
      (at most int64: ``16 (N + 1)`` bytes), and the shuffle index (at most int64, ``8 N``
      bytes, plus a concatenated copy of the same size), next to the int32 document index.

    Returns:
        ``(max(20 E D, 4 E D + 32 (N + 1)) bytes, E)``; an estimate within a few percent of
        what numpy allocates (the 69.7 GiB numpy asked for at ``--train-iters 1000000000``
        on the embedded corpus is its ``16 E D`` term).
    """
    num_tokens = max(int(num_tokens), 1)
    requested = int(num_samples) * int(seq_length) + add_extra_token
    epochs = max(1, -(-requested // num_tokens))
    samples = (epochs * num_tokens - add_extra_token) // int(seq_length)
    documents = epochs * int(num_documents)
    return max(20 * documents, 4 * documents + 32 * (samples + 1)), epochs


def available_host_memory() -> Optional[int]:
    """This node's available memory in bytes (``MemAvailable``), None if unknown."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001  (no psutil or no /proc: unknown, not an error)
        return None


def available_memory(device: Any) -> Optional[int]:
    """Bytes that can still be allocated on ``device``: free CUDA memory
    (``torch.cuda.mem_get_info``), or this node's ``MemAvailable`` for the CPU; None when
    unknown (a meta device, no psutil)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        return available_host_memory()
    return None


def agreed_minimum(value: Optional[int], group: Any = None, device: Any = None) -> Optional[int]:
    """The smallest ``value`` over the ranks of ``group`` (collective when torch.distributed
    is initialized; None anywhere gives None), so that ranks measuring memory a moment
    apart refuse alike, with the same line. ``device``: where the reduced value lives
    (default: the group's collective device)."""
    import torch

    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return value
    from megatron_ext.accounting import ProcessGroupTrafficMeter, collective_device

    flag = torch.tensor([-1 if value is None else int(value)], dtype=torch.int64)
    flag = flag.to(device if device is not None else collective_device(group))
    with ProcessGroupTrafficMeter.untracked():
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
    low = int(flag.item())
    return None if low < 0 else low


def check_fits_host_memory(
    needed: int, flags: Sequence[str] | str, what: str, *, available: Optional[int] = None
) -> None:
    """Refuse ``what`` when its estimated ``needed`` bytes exceed this node's available
    memory (``MemAvailable``; nothing is refused when that is unknown).

    Raises:
        ConfigError: naming ``flags``, the estimate and the available memory.
    """
    if available is None:
        available = available_host_memory()
    if available is None or needed <= available:
        return
    raise ConfigError(
        flags,
        f"{what} needs about {format_bytes(needed)} of host memory, more than the "
        f"{format_bytes(available)} available on this node",
    )
