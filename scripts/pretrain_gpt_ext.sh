#!/usr/bin/env bash
# Launch Megatron-LM's pretrain_gpt.py with megatron-ext on this node (torchrun).
#
# Usage:
#   CONFIG=configs/megatron_lm/gpt2_345m_separate_8gpu.yaml \
#   MEGATRON_LM_DIR=/path/to/Megatron-LM scripts/pretrain_gpt_ext.sh [more flags...]
#
# Flags come from the run file CONFIG (a YAML mapping of Megatron-LM / megatron-ext flag names
# to values, see megatron_ext/megatron/lm/runfile.py), then from this script's arguments, which
# override the file's (the last value of a flag wins). Multi-node: start it once per node with
# NODE_RANK set (scripts/slurm/pretrain_gpt_ext.sbatch does that under Slurm).
#
# Environment (default):
#   MEGATRON_LM_DIR   Megatron-LM checkout at a supported tag, e.g. core_v0.16.1 (required)
#   CONFIG            run file (none: only the flags given here)
#   MODE              zero-touch: 'megatron-ext pretrain' runs the unmodified pretrain_gpt.py;
#                     patched: runs pretrain_gpt.py patched by 'megatron-ext patch' (zero-touch)
#   NNODES (1)  NODE_RANK (0)  GPUS_PER_NODE (8)  MASTER_ADDR (localhost)  MASTER_PORT (6000)
#   CPU               1: run on CPU with gloo, GPUS_PER_NODE processes (debugging) (0)
#   PYTHON            interpreter with megatron-ext and torch installed (python3)
#   TORCHRUN          torchrun command ("$PYTHON -m torch.distributed.run")
#   DRY_RUN           1: print the command instead of running it (0)
set -euo pipefail

: "${MEGATRON_LM_DIR:?set MEGATRON_LM_DIR to a Megatron-LM checkout (e.g. tag core_v0.16.1)}"
CONFIG=${CONFIG:-}
MODE=${MODE:-zero-touch}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
CPU=${CPU:-0}
PYTHON=${PYTHON:-python3}
TORCHRUN=${TORCHRUN:-"$PYTHON -m torch.distributed.run"}
DRY_RUN=${DRY_RUN:-0}

PRETRAIN_GPT="$MEGATRON_LM_DIR/pretrain_gpt.py"
if [[ ! -f "$PRETRAIN_GPT" ]]; then
    echo "pretrain_gpt_ext.sh: $PRETRAIN_GPT not found (MEGATRON_LM_DIR=$MEGATRON_LM_DIR)" >&2
    exit 2
fi

# Megatron-LM requires it for tensor parallelism with overlapped communication.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE"
    --nnodes "$NNODES"
    --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR"
    --master-port "$MASTER_PORT"
)

RUN_ARGS=()
if [[ -n "$CONFIG" ]]; then
    run_args_file=$(mktemp)
    trap 'rm -f "$run_args_file"' EXIT
    # NUL-separated, so values with spaces survive; a bad file stops here with its message.
    $PYTHON -m megatron_ext.megatron.lm.runfile --null "$CONFIG" > "$run_args_file"
    mapfile -d '' -t RUN_ARGS < "$run_args_file"
fi

case "$MODE" in
    zero-touch)
        LAUNCH_ARGS=(-m megatron_ext pretrain)
        if [[ "$CPU" == 1 ]]; then
            LAUNCH_ARGS+=(--cpu)
        fi
        LAUNCH_ARGS+=("$PRETRAIN_GPT")
        ;;
    patched)
        if ! grep -q "install_megatron_lm_hooks" "$PRETRAIN_GPT"; then
            echo "pretrain_gpt_ext.sh: $PRETRAIN_GPT is not patched;" \
                "run 'megatron-ext patch $MEGATRON_LM_DIR' or use MODE=zero-touch" >&2
            exit 2
        fi
        if [[ "$CPU" == 1 ]]; then
            export MEGATRON_EXT_CPU=1
        fi
        LAUNCH_ARGS=("$PRETRAIN_GPT")
        ;;
    *)
        echo "pretrain_gpt_ext.sh: MODE must be zero-touch or patched, got '$MODE'" >&2
        exit 2
        ;;
esac

# shellcheck disable=SC2206  # TORCHRUN is a command line on purpose
COMMAND=($TORCHRUN "${DISTRIBUTED_ARGS[@]}" "${LAUNCH_ARGS[@]}" "${RUN_ARGS[@]}" "$@")
if [[ "$DRY_RUN" == 1 ]]; then
    printf '%q ' "${COMMAND[@]}"
    printf '\n'
    exit 0
fi

# Pre-flight, once, before torchrun starts its processes: the checkout's release is supported
# and every Python package its training code imports is installed (names all that are missing).
REQUIREMENT_ARGS=("$MEGATRON_LM_DIR")
if [[ "$CPU" == 1 ]]; then
    REQUIREMENT_ARGS+=(--cpu)
fi
if [[ "$MODE" == patched ]]; then
    # pretrain_gpt.py's folder comes first on sys.path: megatron.core is the checkout's.
    REQUIREMENT_ARGS+=(--core-from checkout)
fi
$PYTHON -m megatron_ext.megatron.lm.requirements "${REQUIREMENT_ARGS[@]}"

exec "${COMMAND[@]}"
