# Sourced by scripts/reproduce/*.sh (not run by itself): start one run of a reproduction on
# this node or as a Slurm job, or print what would start (DRY_RUN=1).
#
# The sourcing script sets ROOT (the megatron-ext checkout), CONFIG, GPUS_PER_NODE and the
# run file's variables, and calls launch_run NAME RUN_DIR [flags...] once per run.
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

SUBMIT=${SUBMIT:-local}
DRY_RUN=${DRY_RUN:-0}
case "$SUBMIT" in
    local|slurm) ;;
    *) echo "$(basename "$0"): SUBMIT must be local or slurm, got '$SUBMIT'" >&2; exit 2 ;;
esac
export DRY_RUN

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
