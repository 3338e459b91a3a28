#!/usr/bin/env bash
# Launch Megatron-LM's pretrain_gpt.py with megatron-ext on this node (torchrun).
#
# Usage:
#   CONFIG=configs/megatron_lm/gpt2_345m_separate_8gpu.yaml \
#   MEGATRON_LM_DIR=/path/to/Megatron-LM scripts/pretrain_gpt_ext.sh [more flags...]
#
# Flags come from the run file CONFIG (a YAML mapping of Megatron-LM / megatron-ext flag names
# to values, see megatron_ext/runfile.py), then from this script's arguments, which
# override the file's (the last value of a flag wins). Multi-node: start it once per node with
# NNODES, NODE_RANK and MASTER_ADDR set (scripts/slurm/pretrain_gpt_ext.sbatch does that under
# Slurm).
#
# Environment (default):
#   MEGATRON_LM_DIR   Megatron-LM checkout at a supported tag, e.g. core_v0.16.1 (required)
#   CONFIG            run file (none: only the flags given here)
#   MODE              zero-touch: 'megatron-ext pretrain' runs the unmodified pretrain_gpt.py;
#                     patched: runs pretrain_gpt.py patched by 'megatron-ext patch' (zero-touch)
#   NNODES (1)  GPUS_PER_NODE (8)  MASTER_PORT (6000)
#   NODE_RANK, MASTER_ADDR  this node's rank and the first node's address: required when
#                     NNODES > 1 (one node: 0 and localhost)
#   CPU               1: run on CPU with gloo, GPUS_PER_NODE processes (debugging) (0)
#   PYTHON            interpreter with megatron-ext and torch installed (python3)
#   TORCHRUN          torchrun command ("$PYTHON -m torch.distributed.run")
#   DRY_RUN           1: check, then print the command instead of running it (0)
#
# Before torchrun starts (python -m megatron_ext.preflight, also in the dry run):
# a run whose --save holds a checkpoint resumes from it (--load <save>, --finetune dropped:
# requeued and restarted jobs continue); the nodes must hold the parallel layout; data and
# tokenizer files must exist; the memory AQ-SGD's buffers need is printed and, outside the dry
# run, compared with this node's available memory.
set -euo pipefail
# bash >= 4.4 ('set -u' with empty arrays); RHEL/CentOS 7 ships 4.2.
if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < 404)); then
    echo "$0: needs bash >= 4.4, this is bash $BASH_VERSION; run it with a newer bash" \
        "(e.g. 'module load bash', then: bash $0)" >&2
    exit 2
fi

: "${MEGATRON_LM_DIR:?set MEGATRON_LM_DIR to a Megatron-LM checkout (e.g. tag core_v0.16.1)}"
CONFIG=${CONFIG:-}
MODE=${MODE:-zero-touch}
NNODES=${NNODES:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
if [[ "$NNODES" != 1 ]]; then
    # Every node would otherwise wait for its own localhost at the rendezvous.
    : "${NODE_RANK:?NNODES=$NNODES: set NODE_RANK to the rank of this node (0 .. NNODES-1)}"
    : "${MASTER_ADDR:?NNODES=$NNODES: set MASTER_ADDR to the address of the node with NODE_RANK=0}"
    if [[ "$MASTER_ADDR" == localhost || "$MASTER_ADDR" == 127.* ]]; then
        echo "pretrain_gpt_ext.sh: NNODES=$NNODES needs MASTER_ADDR set to the address of" \
            "node 0, not $MASTER_ADDR" >&2
        exit 2
    fi
fi
NODE_RANK=${NODE_RANK:-0}
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
# Signals torchrun forwards to the ranks (its --signals-to-handle; older torch ignores the
# variable): SIGUSR1 too, Slurm's usual --signal choice (with Megatron-LM's --exit-signal
# SIGUSR1). Unhandled, a SIGUSR1 from Slurm kills torchrun, and its ranks die with it
# (megatron_ext/child_processes.py).
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE"
    --nnodes "$NNODES"
    --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR"
    --master-port "$MASTER_PORT"
)

# The run file's arguments, then this script's, checked and with the resume applied
# (NUL-separated, so values with spaces survive; a refusal stops here with its message).
PREFLIGHT_ARGS=(--null --nodes "$NNODES" --gpus-per-node "$GPUS_PER_NODE")
if [[ -n "$CONFIG" ]]; then
    PREFLIGHT_ARGS+=(--config "$CONFIG")
fi
if [[ "$DRY_RUN" == 1 ]]; then
    PREFLIGHT_ARGS+=(--dry-run)
fi
run_args_file=$(mktemp)
trap 'rm -f "$run_args_file"' EXIT
$PYTHON -m megatron_ext.preflight "${PREFLIGHT_ARGS[@]}" -- "$@" > "$run_args_file"
RUN_ARGS=()
while IFS= read -r -d '' arg; do
    RUN_ARGS+=("$arg")
done < "$run_args_file"

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
COMMAND=($TORCHRUN "${DISTRIBUTED_ARGS[@]}" "${LAUNCH_ARGS[@]}" "${RUN_ARGS[@]}")
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
