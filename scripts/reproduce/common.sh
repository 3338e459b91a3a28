# Sourced by scripts/reproduce/*.sh (not run by itself) right after 'set -euo pipefail': the
# bash version check, ROOT (the megatron-ext checkout), and what starts the commands of a
# reproduction or prints them (DRY_RUN=1): run_cmd for a plain command; launch_init, then
# launch_run once per run, for a training run on this node or as a Slurm job; pick_run and
# sweep_run for the flags of a run named in RUNS. scripts/test_megatron_core_release.sh
# sources it for run_cmd.
#
# A training reproduction sets its run file's variables, calls launch_init RUN_FILE GPUS NODES
# (the defaults of CONFIG, GPUS_PER_NODE and NODES), and then launch_run NAME RUN_DIR
# [flags...] once per run.
#
# Environment:
#   SUBMIT   local: run on this node now (scripts/pretrain_gpt_ext.sh, its output also in
#            RUN_DIR/train.log); slurm: one sbatch job per run (scripts/slurm/
#            pretrain_gpt_ext.sbatch, log in RUN_DIR/slurm-<job id>.out), checked first with
#            the batch script's dry run so that a run that cannot work is not queued.
#   NODES    nodes of a run (NNODES); local multi-node: start the script on every node with
#            NODE_RANK (0 .. NODES-1) and MASTER_ADDR (the address of node 0).
#   DRY_RUN  1: check and print the commands (sbatch line, or node 0's torchrun line), start
#            nothing.
# shellcheck shell=bash

# bash >= 4.4 ('set -u' with empty arrays); RHEL/CentOS 7 ships 4.2.
if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < 404)); then
    echo "$0: needs bash >= 4.4, this is bash $BASH_VERSION; run it with a newer bash" \
        "(e.g. 'module load bash', then: bash $0)" >&2
    exit 2
fi

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DRY_RUN=${DRY_RUN:-0}

# run_cmd CMD...: run it, or print it (DRY_RUN=1).
run_cmd() {
    if [[ "$DRY_RUN" == 1 ]]; then
        printf '%q ' "$@"
        printf '\n'
    else
        "$@"
    fi
}

# launch_init RUN_FILE GPUS NODES: CONFIG (default configs/megatron_lm/RUN_FILE),
# GPUS_PER_NODE (default GPUS) and NODES (default NNODES, else NODES) for every run; check
# SUBMIT (default local) and hand DRY_RUN to scripts/pretrain_gpt_ext.sh. Called once, after
# the script's own arguments and variables are checked.
launch_init() {
    export CONFIG=${CONFIG:-$ROOT/configs/megatron_lm/$1}
    export GPUS_PER_NODE=${GPUS_PER_NODE:-$2}
    NODES=${NODES:-${NNODES:-$3}}
    SUBMIT=${SUBMIT:-local}
    case "$SUBMIT" in
        local|slurm) ;;
        *) echo "$(basename "$0"): SUBMIT must be local or slurm, got '$SUBMIT'" >&2; exit 2 ;;
    esac
    export DRY_RUN
}

# launch_run NAME RUN_DIR [flags for pretrain_gpt.py...]
launch_run() {
    local name=$1 run_dir=$2
    shift 2
    export RUN_DIR=$run_dir NNODES=$NODES
    mkdir -p "$run_dir"
    if [[ "$SUBMIT" == slurm ]]; then
        local submit=(sbatch --nodes "$NODES" --gpus-per-node "$GPUS_PER_NODE"
            --job-name "$name" --output "$run_dir/slurm-%j.out"
            scripts/slurm/pretrain_gpt_ext.sbatch "$@")
        # The batch script's own checks, on this node, before the job waits in the queue.
        (cd "$ROOT" && DRY_RUN=1 EXT_DIR="$ROOT" bash scripts/slurm/pretrain_gpt_ext.sbatch "$@") \
            > "$run_dir/dry-run.txt"
        if [[ "$DRY_RUN" == 1 ]]; then
            cat "$run_dir/dry-run.txt"
            printf 'would submit: (cd %q &&' "$ROOT"
            printf ' %q' "${submit[@]}"
            printf ')\n'
        else
            (cd "$ROOT" && "${submit[@]}")
        fi
    elif [[ "$DRY_RUN" == 1 ]]; then
        "$ROOT/scripts/pretrain_gpt_ext.sh" "$@"
    else
        "$ROOT/scripts/pretrain_gpt_ext.sh" "$@" 2>&1 | tee "$run_dir/train.log"
    fi
}

# pick_run RUN WORD1 FLAGS1 WORD2 FLAGS2: RUN_FLAGS of RUN, one of the two words RUNS may hold
# (a method and its baseline), each given with its flags (one string split at spaces; empty:
# the run file as it is); another RUN exits 2 naming both words.
pick_run() {
    case "$1" in
        "$2") read -ra RUN_FLAGS <<< "$3" ;;
        "$4") read -ra RUN_FLAGS <<< "$5" ;;
        *) echo "$(basename "$0"): RUNS holds '$2' and/or '$4', got '$1'" >&2; exit 2 ;;
    esac
}

# sweep_run RUN NAME FLAG: run_dir and RUN_FLAGS of one run of a sweep over FLAG's values with
# a dense baseline: 'dense' is --grad-compression none in RUNS_DIR/dense, another RUN is
# FLAG RUN in RUNS_DIR/NAME_RUN.
sweep_run() {
    if [[ "$1" == dense ]]; then
        run_dir="$RUNS_DIR/dense"
        RUN_FLAGS=(--grad-compression none)
    else
        run_dir="$RUNS_DIR/$2_$1"
        RUN_FLAGS=("$3" "$1")
    fi
}
