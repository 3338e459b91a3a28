"""The benchmarks' shared set-up: one import for what every benchmark script uses.

One module per job, every public name re-exported here (``from benchmarks.common import
make_report``):

* :mod:`.environment`: what a number depends on (:func:`environment`, :data:`REPO_ROOT`);
* :mod:`.machine`: the shared machine (idle waits, contention, priority; ``--quiet-wait``,
  ``--priority``);
* :mod:`.reports`: the common JSON report (:func:`make_report`, :func:`write_report`,
  :func:`validate_report`; :func:`write_results` at a benchmark's end, :class:`SweepReport`
  for a sweep of runs) and markdown tables (:func:`format_table`); :func:`read_jsonl` (the
  driver's ``log.jsonl``) comes from :mod:`megatron_ext.report`;
* :mod:`.models`: GPT presets' shapes and PowerSGD's rank at equal bytes;
* :mod:`.methods`: the registry's methods as benchmark flags (``--family``, ``--methods`` and
  each method's options) and settings;
* :mod:`.runs`: the CPU driver's command, its run folder and what a run left there, logged
  and measured command runs, list flags, the median.

A driver run's layout is checked with ``megatron_ext.train_config.layout_sizes``, the driver's
own check. Torch is imported lazily (only :func:`environment` needs it), so the step-time and
convergence drivers stay light; nothing here imports megatron.
"""

from benchmarks.common.environment import (
    REPO_ROOT,
    default_out_dir,
    device_description,
    environment,
    source_fingerprint,
)
from benchmarks.common.machine import (
    CpuMonitor,
    PriorityBooster,
    add_machine_args,
    set_priority,
    wait_for_quiet,
)
from benchmarks.common.methods import (
    MethodSettings,
    add_family_args,
    add_method_args,
    check_methods,
    family_methods,
    method_choices,
)
from benchmarks.common.models import (
    equal_bytes_rank,
    equal_bytes_rank_for_shapes,
    gpt_matrix_shapes,
    gpt_vector_numel,
    load_model_preset,
    squareish_shape,
)
from benchmarks.common.reports import (
    BENCHMARKS,
    SCHEMA_VERSION,
    SweepReport,
    format_table,
    make_report,
    validate_report,
    write_report,
    write_results,
)
from benchmarks.common.runs import (
    add_lr_schedule_args,
    add_run_args,
    driver_command,
    extra_train_flags,
    fresh_run_dir,
    lr_schedule_flags,
    median,
    parse_list,
    parse_per,
    run_json,
    run_logged,
    run_measured,
    run_records,
    shell_join,
    stdout_tail,
    time_limit,
)
from megatron_ext.report import read_jsonl

__all__ = [
    "REPO_ROOT",
    "SCHEMA_VERSION",
    "BENCHMARKS",
    "environment",
    "device_description",
    "source_fingerprint",
    "default_out_dir",
    "make_report",
    "add_method_args",
    "method_choices",
    "MethodSettings",
    "add_family_args",
    "check_methods",
    "family_methods",
    "add_machine_args",
    "write_report",
    "write_results",
    "SweepReport",
    "validate_report",
    "format_table",
    "equal_bytes_rank",
    "equal_bytes_rank_for_shapes",
    "squareish_shape",
    "gpt_matrix_shapes",
    "gpt_vector_numel",
    "load_model_preset",
    "driver_command",
    "lr_schedule_flags",
    "add_lr_schedule_args",
    "add_run_args",
    "extra_train_flags",
    "parse_per",
    "time_limit",
    "median",
    "read_jsonl",
    "run_logged",
    "run_measured",
    "run_records",
    "run_json",
    "stdout_tail",
    "fresh_run_dir",
    "parse_list",
    "shell_join",
    "CpuMonitor",
    "wait_for_quiet",
    "set_priority",
    "PriorityBooster",
]
