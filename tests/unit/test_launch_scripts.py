"""Every launch script and run file, submitted as its comments say, in its dry-run mode.

Each script runs (``DRY_RUN=1``) on a fresh copy of ``scripts/`` and ``configs/`` (no
``runs/`` or ``logs/`` folder), with a fake Megatron-LM checkout, data and tokenizer files in
``tmp_path`` and no Slurm (the reproduce scripts' ``SUBMIT=slurm`` path checks the batch
script's own dry run, then prints the sbatch line). Checked on the printed commands: every
flag given to ``pretrain_gpt.py`` exists in the parser of each supported Megatron-LM tag
(the committed ``tests/data/megatron_lm_<tag>_flags.txt``) or is megatron-ext's; the run's
folders are created; multi-node launches are refused without ``NODE_RANK`` /
``MASTER_ADDR`` or with fewer GPUs than the parallel layout needs; a run whose ``--save``
holds a checkpoint resumes from it instead of fine-tuning again; AQ-SGD's host memory per
node is stated before anything starts and a node with less memory refuses; every script
parses and refuses bash < 4.4 by name. All scripts run at once (a few seconds each).
"""

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

DATA = REPO / "tests" / "data"
TAGS = ("core_v0.16.1", "core_v0.19.0")

SCRIPTS = sorted(
    str(p.relative_to(REPO))
    for p in list((REPO / "scripts").rglob("*.sh")) + list((REPO / "scripts").rglob("*.sbatch"))
    if p.name != "common.sh"  # sourced by the reproduce scripts, not run
)

PACKAGE_INFO = "MAJOR = 0\nMINOR = 16\nPATCH = 1\nPRE_RELEASE = ''\n"


def _megatron_flags():
    flags = {}
    for tag in TAGS:
        lines = (DATA / f"megatron_lm_{tag}_flags.txt").read_text().split()
        flags[tag] = {line for line in lines if line.startswith("--")}
    from megatron_ext.megatron.lm import megatron_lm_extra_args

    parser = megatron_lm_extra_args(None)(argparse.ArgumentParser())
    ext = {o for o in parser._option_string_actions if o.startswith("--")}
    return flags, ext


def _commands(out):
    """The ``pretrain_gpt.py`` arguments of every torchrun line printed."""
    commands = []
    for line in out.splitlines():
        words = shlex.split(line) if "pretrain_gpt.py" in line and "torch" in line else []
        if words:
            commands.append(words[[w.endswith("pretrain_gpt.py") for w in words].index(True) + 1 :])
    return commands


def _value(args, flag):
    return args[len(args) - 1 - args[::-1].index(flag) + 1]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A fresh copy of the scripts and run files, and the files their comments ask for."""
    root = tmp_path_factory.mktemp("launch")
    ext = root / "megatron-ext"
    shutil.copytree(REPO / "scripts", ext / "scripts")
    shutil.copytree(REPO / "configs", ext / "configs")
    lm = root / "Megatron-LM"
    (lm / "megatron" / "core").mkdir(parents=True)
    (lm / "megatron" / "core" / "package_info.py").write_text(PACKAGE_INFO)
    (lm / "pretrain_gpt.py").write_text("raise SystemExit('a dry run must not start it')\n")
    data = root / "data"
    data.mkdir()
    for name in ("gpt2-vocab.json", "gpt2-merges.txt", "spiece.model"):
        (data / name).write_text("x")
    (root / "gpt2-xl").mkdir()
    # A real indexed dataset: aqsgd_gpt2_1.5b.sh counts its samples.
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(data / "corpus.bin"), dtype=np.uint16)
    for _ in range(40):
        builder.add_document(torch.arange(1000) % 500, [1000])
    builder.finalize(str(data / "corpus.idx"))
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "MASTER_", "NODE", "NNODES", "GPUS_PER_NODE", "RUNS"))
    }
    env.update(
        PYTHONPATH=str(REPO),
        PYTHON=sys.executable,
        OMP_NUM_THREADS="1",
        DRY_RUN="1",
        MEGATRON_LM_DIR=str(lm),
        DATA_PREFIX=str(data / "corpus"),
        VOCAB_FILE=str(data / "gpt2-vocab.json"),
        MERGE_FILE=str(data / "gpt2-merges.txt"),
        TOKENIZER_MODEL=str(data / "spiece.model"),
        PRETRAINED=str(root / "gpt2-xl"),
        PYTHONWARNINGS="ignore",
    )
    return {"root": root, "ext": ext, "env": env}


# name: (script and its arguments, environment); all started at once by ``runs``.
CASES = {
    "pretrain_cpu": (
        ["scripts/pretrain_gpt_ext.sh", "--pipeline-model-parallel-size", "2"],
        dict(CONFIG="configs/megatron_lm/gpt_tiny_separate_cpu.yaml", CPU="1", GPUS_PER_NODE="2"),
    ),
    "pretrain_multinode_no_master": (
        ["scripts/pretrain_gpt_ext.sh"],
        dict(CONFIG="configs/megatron_lm/gpt_tiny_separate_cpu.yaml", NNODES="2", NODE_RANK="1"),
    ),
    "sbatch": (
        ["scripts/slurm/pretrain_gpt_ext.sbatch", "--train-iters", "3"],
        dict(CONFIG="configs/megatron_lm/gpt_tiny_separate_cpu.yaml", CPU="1", NNODES="2",
             GPUS_PER_NODE="2"),
    ),  # fmt: skip
    "separate": (["scripts/reproduce/separate_gpt2_345m.sh"], dict(RUNS="16")),
    "radius": (["scripts/reproduce/radius_gpt.sh", "2.0b"], dict(BASELINE="0")),
    "radius355m": (["scripts/reproduce/radius_gpt.sh", "355m"], dict(BASELINE="0")),
    "aqsgd": (
        ["scripts/reproduce/aqsgd_gpt2_1.5b.sh", "wikitext2"],
        dict(RUNS="fw3bw6 fw4bw8", SUBMIT="slurm", BUFFER="host"),
    ),
    "grass": (["scripts/reproduce/grass_llama.sh", "60m"], dict(RUNS="full grass")),
    "grass350m": (["scripts/reproduce/grass_llama.sh", "350m"], dict(RUNS="grass")),
    "grass1b": (["scripts/reproduce/grass_llama.sh", "1b"], dict(RUNS="grass")),
    "grass13b": (["scripts/reproduce/grass_llama.sh", "13b"], {}),
    "grass_multinode_no_rank": (
        ["scripts/reproduce/grass_llama.sh", "1b"],
        dict(RUNS="grass", NODES="2", MASTER_ADDR="node0"),
    ),
    "protocol2b": (["scripts/reproduce/protocol_models.sh", "2b"], dict(RUNS="protocol")),
    "protocol640m": (["scripts/reproduce/protocol_models.sh", "640m"], {}),
    "protocol8b": (["scripts/reproduce/protocol_models.sh", "8b"], dict(SUBMIT="slurm")),
    "protocol8b_one_node": (["scripts/reproduce/protocol_models.sh", "8b"], dict(NODES="1")),
    "frontier": (["scripts/reproduce/frontier_cpu.sh"], {}),
    "release_tests": (["scripts/test_megatron_core_release.sh", "0.19.2"], {}),
}


@pytest.fixture(scope="module")
def runs(world):
    """Every case's (exit code, stdout, stderr), the cases run in parallel."""
    ext = world["ext"]
    # The resumed run: its checkpoint folder holds Megatron-LM's tracker file.
    resumed = ext / "runs" / "aqsgd_gpt2_1.5b_wikitext2" / "fw4bw8" / "checkpoints"
    resumed.mkdir(parents=True)
    (resumed / "latest_checkpointed_iteration.txt").write_text("100\n")
    procs = {}
    for name, (argv, env) in CASES.items():
        procs[name] = subprocess.Popen(
            ["bash", str(ext / argv[0])] + argv[1:],
            cwd=ext,
            env={**world["env"], **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        results[name] = (proc.returncode, out, err)
    return results


COMMON = REPO / "scripts" / "reproduce" / "common.sh"
SOURCE_COMMON = '\n# shellcheck source=scripts/reproduce/common.sh\n. "$(dirname "$0")/common.sh"\n'
VERSION_CHECK = re.compile(r"\n# bash >= 4\.4.*?\nfi\n", re.S)


def _version_check(script):
    """The bash version check ``script`` runs before anything else: its own, right after
    'set -euo pipefail', or, where it sources scripts/reproduce/common.sh right there,
    common.sh's (its first command)."""
    text = (REPO / script).read_text()
    after_set = text.index("set -euo pipefail") + 17
    if text.startswith(SOURCE_COMMON, after_set):
        subprocess.run(["bash", "-n", str(COMMON)], check=True)
        text, after_set = COMMON.read_text(), None
    match = VERSION_CHECK.search(text)
    assert match, f"{script}: no bash version check"
    if after_set is None:
        before = text[: match.start()].splitlines()
        assert all(not line.strip() or line.startswith("#") for line in before), before
    else:
        assert match.start() == after_set
    return match.group(0)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_parses_and_refuses_old_bash_by_name(script, tmp_path):
    subprocess.run(["bash", "-n", str(REPO / script)], check=True)
    check = (
        _version_check(script).replace("BASH_VERSINFO", "FAKE").replace("BASH_VERSION", "FAKE_V")
    )
    for version, refused in [((4, 2, 46), True), ((4, 4, 20), False), ((5, 1, 16), False)]:
        setup = f"FAKE=({' '.join(map(str, version))}); FAKE_V={'.'.join(map(str, version))}"
        proc = subprocess.run(
            ["bash", "-c", f"{setup}\n{check}\necho passed", script],
            capture_output=True,
            text=True,
        )
        if refused:
            assert proc.returncode == 2 and "passed" not in proc.stdout
            assert "needs bash >= 4.4, this is bash 4.2.46" in proc.stderr
        else:
            assert proc.returncode == 0 and "passed" in proc.stdout, proc.stderr


def test_every_script_and_run_file_is_exercised(runs):
    assert {argv[0] for argv, _ in CASES.values()} == set(SCRIPTS)
    started = set()
    for _, _, err in runs.values():
        started |= {Path(f).name for f in re.findall(r"megatron-ext: run file (\S+)", err)}
    assert started == {p.name for p in (REPO / "configs" / "megatron_lm").glob("*.yaml")}


def test_dry_runs_print_commands_whose_flags_exist_in_every_tag(runs, world):
    flags, ext_flags = _megatron_flags()
    expected = {
        "pretrain_cpu": 1,
        "sbatch": 1,
        "separate": 1,
        "radius": 1,
        "radius355m": 1,
        "aqsgd": 2,
        "grass": 2,
        "grass350m": 1,
        "grass1b": 1,
        "grass13b": 1,
        "protocol2b": 1,
        "protocol640m": 1,
        "protocol8b": 1,
    }
    for name, count in expected.items():
        code, out, err = runs[name]
        assert code == 0, (name, err)
        commands = _commands(out)
        assert len(commands) == count, (name, out)
        for args in commands:
            for tag in TAGS:
                unknown = [
                    a for a in args if a.startswith("--") and a not in flags[tag] | ext_flags
                ]
                assert not unknown, (name, tag, unknown)
            save = _value(args, "--save") if "--save" in args else None
            if save:  # the run's folder exists (Megatron-LM makes checkpoints/ in it)
                assert Path(save).parent.is_dir(), (name, save)
                assert str(Path(save)).startswith(str(world["ext"] / "runs")), (name, save)
    # Every node's command under Slurm, and the sbatch line with the run's log folder.
    code, out, _ = runs["protocol8b"]
    assert "--nnodes 8" in out and "--nproc-per-node 8" in out
    submit = [line for line in out.splitlines() if line.startswith("would submit:")]
    assert len(submit) == 1 and "sbatch --nodes 8 --gpus-per-node 8" in submit[0]
    log = re.search(r"--output (\S+)/slurm-%j.out", submit[0]).group(1)
    assert Path(log).is_dir()
    # pretrain_gpt_ext.sh: the run file's flags, then the script's (the last value wins).
    args = _commands(runs["pretrain_cpu"][1])[0]
    assert args[-2:] == ["--pipeline-model-parallel-size", "2"]
    assert "-m megatron_ext pretrain --cpu" in runs["pretrain_cpu"][1]
    # The batch script: srun line and node 0's command with the signal handler.
    out = runs["sbatch"][1]
    assert out.splitlines()[1].startswith("srun --kill-on-bad-exit=1")
    assert "--nnodes 2 --node-rank 0" in out and "--exit-signal-handler --train-iters 3" in out


def test_other_scripts_dry_runs_print_their_commands(runs):
    code, out, err = runs["frontier"]
    assert code == 0, err
    lines = out.splitlines()
    assert sum("benchmarks/frontier.py" in line for line in lines) == 10
    assert lines[-1].startswith("megatron-ext report")
    sys.path.insert(0, str(REPO))
    try:
        from benchmarks.frontier import build_parser
    finally:
        sys.path.remove(str(REPO))
    for line in lines[:-1]:  # the options exist (argparse exits on an unknown one)
        build_parser().parse_args(shlex.split(line)[2:])
    from megatron_ext.report import build_parser as report_parser

    report_parser().parse_args(shlex.split(lines[-1])[2:])
    code, out, err = runs["release_tests"]
    assert code == 0, err
    assert "megatron-core==0.19.2" in out and "python -m pytest" in out


def test_multi_node_launches_name_what_is_missing(runs):
    code, _, err = runs["pretrain_multinode_no_master"]
    assert code != 0 and "NNODES=2: set MASTER_ADDR" in err
    code, _, err = runs["grass_multinode_no_rank"]
    assert code != 0 and "NNODES=2: set NODE_RANK" in err
    code, out, err = runs["protocol8b_one_node"]
    assert code == 2 and not _commands(out)
    assert (
        "--pipeline-model-parallel-size 32 x --context-parallel-size 1 = 32 ranks per model "
        "replica, but NNODES 1 x GPUS_PER_NODE 8 = 8 ranks is fewer: use 4 or more nodes" in err
    )


def test_requeued_run_resumes_from_its_own_checkpoint(runs, world):
    code, out, err = runs["aqsgd"]
    assert code == 0, err
    first, resumed = _commands(out)
    # fw3bw6 starts from GPT-2 XL; fw4bw8 has a checkpoint of its own: no --finetune.
    assert "--finetune" in first and _value(first, "--load") == world["env"]["PRETRAINED"]
    run_dir = world["ext"] / "runs" / "aqsgd_gpt2_1.5b_wikitext2" / "fw4bw8"
    assert "--finetune" not in resumed and resumed.count("--load") == 1
    assert _value(resumed, "--load") == _value(resumed, "--save") == str(run_dir / "checkpoints")
    assert f"resuming from this run's checkpoint in {run_dir}/checkpoints (iteration 100)" in err


def test_aqsgd_memory_is_stated_before_start(runs):
    code, out, err = runs["aqsgd"]
    # 32 fixed samples (the corpus's whole 1024-token samples), 8 stages on one node: 14
    # boundary sides of 32 x 1024 x 1600 x 2 B (bf16).
    assert 32 * 1024 * 1600 * 2 * 14 == 1_468_006_400
    line = (
        "megatron-ext: needs ~1.47 GB of host memory per node for AQ-SGD buffers in host "
        "memory (32 samples per data-parallel rank x 1024 tokens x 1600 x 2 B = 104.86 MB per "
        "boundary side; 8 ranks a node)"
    )
    assert err.count(line) == 2, err  # once per run, before its sbatch line


def test_a_node_with_too_little_memory_refuses_before_torchrun(world, tmp_path):
    env = {
        **world["env"],
        "DRY_RUN": "0",
        "CONFIG": "configs/megatron_lm/gpt2_1.5b_aqsgd_8gpu.yaml",
        "RUN_DIR": str(tmp_path),
        "FIXED_SAMPLES": str(10**9),  # ~46 PB of host buffers
        "TRAIN_ITERS": "10",
        "BUFFER": "host",
        "TORCHRUN": "touch " + str(tmp_path / "started"),
    }
    proc = subprocess.run(
        ["bash", str(world["ext"] / "scripts/pretrain_gpt_ext.sh")],
        cwd=world["ext"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "per node but" in proc.stderr and "is available memory on this node" in proc.stderr
    assert "--aqsgd-buffer" in proc.stderr
    assert not (tmp_path / "started").exists()


def test_the_printed_aqsgd_figure_is_what_the_codec_allocates():
    """The pre-flight's plan against benchmarks/state_memory.py's meta allocation."""
    sys.path.insert(0, str(REPO))
    try:
        from benchmarks import state_memory
    finally:
        sys.path.remove(str(REPO))
    import torch

    from megatron_ext.memory import aqsgd_buffer_plan

    row = state_memory.measure_aqsgd("gpt2-xl", 2304, {})
    plan = aqsgd_buffer_plan(
        num_samples=2304, seq_length=1024, hidden_size=1600, activation_dtype=torch.bfloat16,
        pipeline_parallel=8, world_size=8, ranks_per_node=8,
    )  # fmt: skip
    assert row["per_side"] == plan.per_side == 2304 * 1024 * 1600 * 2
    # The finding: ~105 GB of host buffers on one node (14 boundary sides of 7.5 GB).
    assert row["per_node_8_stages"] == plan.per_node_max == 14 * plan.per_side
    # Two nodes of 8 with DP=2: stages 0-3 on node 0 (7 sides), halved samples per rank.
    two = aqsgd_buffer_plan(
        num_samples=2304, seq_length=1024, hidden_size=1600, activation_dtype=torch.bfloat16,
        pipeline_parallel=8, world_size=16, ranks_per_node=8,
    )  # fmt: skip
    assert two.per_node == [7 * 2 * two.per_side, 7 * 2 * two.per_side]
    assert two.per_side * 2 == plan.per_side
    # Ranks to stages as Megatron-LM orders them: 3 stages x DP 2 on 3 nodes of 2 GPUs.
    small = dict(num_samples=4, seq_length=2, hidden_size=1, activation_dtype=torch.float32)
    default = aqsgd_buffer_plan(**small, pipeline_parallel=3, world_size=6, ranks_per_node=2)
    side = 2 * 2 * 1 * 4  # 2 samples per DP rank x 2 tokens x hidden 1 x fp32
    assert default.per_side == side and default.per_node == [2 * side, 4 * side, 2 * side]
    mapped = aqsgd_buffer_plan(
        **small, pipeline_parallel=3, world_size=6, ranks_per_node=2, tp_pp_dp_mapping=True
    )
    assert mapped.per_node == [3 * side, 2 * side, 3 * side]


def test_grass_and_protocol_state_is_stated_before_start(runs):
    """The Grass and Protocol Models run files state their method state per GPU."""
    code, out, err = runs["grass350m"]
    # 24 layers x (Q, K, V: 3 x 128 rows of 1024 + proj: 128 rows of 1024 + SwiGLU gate and
    # up (2736 x 1024 each, columns projected): 2736 x 2 x 128 + fc2: 128 rows of 2736).
    assert 24 * (3 * 128 * 1024 + 128 * 1024 + 2736 * 2 * 128 + 128 * 2736) == 37_797_888
    # The dense weights: 24 x (3072 + 1024 + 5472 + 2736) x 1024 = 302.38M.
    assert 24 * (3072 + 1024 + 5472 + 2736) * 1024 == 302_383_104
    line = (
        "megatron-ext: needs ~1.37 GB of GPU memory per GPU for Grass state (96 projected "
        "weights a stage, r=128 per part: virtual parameters 37.80M x 18 B (bf16 + gradient "
        "+ Adam) = 680.36 MB, selection 151.94 MB, sketches at a selection step 360.97 MB + "
        "176.16 MB all-reduced); saves ~3.47 GB against the dense gradient and Adam state of "
        "those weights (302.38M x 16 B = 4.84 GB)"
    )
    assert err.count(line) == 1, err
    # 50257 GPT-2 pieces padded to 50304; the last of 8 stages adds A and the staged g^T g.
    assert 1536 * 15 * 4 + 50304 * 1536 * 2 + 2 * 1536**2 * 4 == 173_500_416
    line = (
        "megatron-ext: needs ~173.50 MB of GPU memory per GPU for Protocol Models state (k=15 "
        "of d=1536: U 1536 x 15 x 4 B = 92.16 KB and T_fixed 50304 x 1536 x 2 B = 154.53 MB on "
        "each of 8 stages; the last stage's Grassmann accumulator A and staged g^T g 2 x "
        "1536^2 x 4 B = 18.87 MB)"
    )
    assert runs["protocol640m"][2].count(line) == 1, runs["protocol640m"][2]
    # LLaMA-3's tokenizer is a model file: T_fixed is stated per row, not guessed.
    assert "T_fixed 8.19 KB per vocabulary row (not counted" in runs["protocol8b"][2]
    for name in ("grass", "grass1b", "grass13b", "protocol2b"):
        assert "GPU memory per GPU for" in runs[name][2], name


def test_the_printed_grass_and_protocol_figures_are_what_the_classes_hold():
    """megatron_ext.state_plan against benchmarks/state_memory.py's meta measurement of the
    real GrassLayer / Subspace objects (GPT: Q, K, V rows; LLaMA with GQA and SwiGLU: gate
    and up columns)."""
    sys.path.insert(0, str(REPO))
    try:
        from benchmarks import state_memory
    finally:
        sys.path.remove(str(REPO))
    for model in ("tiny", "tiny-llama"):
        row = state_memory.measure_grass(model, {"rank": 8, "sketch_size": 16})
        assert row["persistent"] == row["plan_selection_bytes"] > 0, model
        assert row["sketch_bytes"] == row["plan_sketch_bytes"] > 0, model
        assert row["grass_param_grad_adam_bytes"] == row["plan_virtual_bytes"], model
        assert row["dense_grad_adam_bytes"] == row["plan_dense_bytes"], model
        exact = state_memory.measure_grass(model, {"rank": 8, "sketch_size": 0})
        assert exact["sketch_bytes"] == exact["plan_sketch_bytes"] > row["sketch_bytes"]
    row = state_memory.measure_protocol("tiny-llama", {"min_rank": 0})
    # U, T_fixed and the one A the measured build stages (the plan's last stage: two).
    assert row["persistent"] == (
        row["plan_u_bytes"] + row["plan_fixed_bytes"] + row["plan_accumulator_bytes"] // 2
    )
    assert row["plan_fixed_bytes"] == 512 * 64 * 2 and row["plan_u_bytes"] == 64 * 1 * 4
