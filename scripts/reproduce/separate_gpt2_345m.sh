#!/usr/bin/env bash
# SEPARATE paper, GPT-2 345M on OpenWebText, 8 GPUs: the dense AdamW baseline and SEPARATE
# with compression ratios 8, 16, 64 and 128, one run after another
# (configs/megatron_lm/gpt2_345m_separate_8gpu.yaml holds the settings and their sources).
#
# Usage:
#   MEGATRON_LM_DIR=/path/to/Megatron-LM DATA_PREFIX=/data/openwebtext_text_document \
#   VOCAB_FILE=/data/gpt2-vocab.json MERGE_FILE=/data/gpt2-merges.txt \
#   scripts/reproduce/separate_gpt2_345m.sh [more flags...]
#
# Environment: RUNS ("dense 8 16 64 128": which runs, 'dense' is --grad-compression none),
# RUNS_DIR (runs/separate_gpt2_345m: one folder per run with checkpoints, TensorBoard and
# comm_report.json), and everything scripts/pretrain_gpt_ext.sh reads (GPUS_PER_NODE, ...).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
: "${DATA_PREFIX:?set DATA_PREFIX to OpenWebText in the Megatron indexed format (..._text_document)}"
: "${VOCAB_FILE:?set VOCAB_FILE to the GPT-2 vocab (gpt2-vocab.json)}"
: "${MERGE_FILE:?set MERGE_FILE to the GPT-2 merges (gpt2-merges.txt)}"
RUNS=${RUNS:-"dense 8 16 64 128"}
RUNS_DIR=${RUNS_DIR:-$ROOT/runs/separate_gpt2_345m}
export CONFIG=${CONFIG:-$ROOT/configs/megatron_lm/gpt2_345m_separate_8gpu.yaml}
export GPUS_PER_NODE=${GPUS_PER_NODE:-8}
export DATA_PREFIX VOCAB_FILE MERGE_FILE

for run in $RUNS; do
    if [[ "$run" == dense ]]; then
        export RUN_DIR="$RUNS_DIR/dense"
        RUN_FLAGS=(--grad-compression none)
    else
        export RUN_DIR="$RUNS_DIR/ratio_$run"
        RUN_FLAGS=(--separate-ratio "$run")
    fi
    mkdir -p "$RUN_DIR"
    echo "== SEPARATE GPT-2 345M: $run -> $RUN_DIR"
    "$ROOT/scripts/pretrain_gpt_ext.sh" "${RUN_FLAGS[@]}" "$@" 2>&1 | tee "$RUN_DIR/train.log"
done
