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
# comm_report.json), SUBMIT (local | slurm), NODES (1), DRY_RUN (1: check and print the
# commands; scripts/reproduce/common.sh), GPUS_PER_NODE (8) and what pretrain_gpt_ext.sh reads.
set -euo pipefail
# shellcheck source=scripts/reproduce/common.sh
. "$(dirname "$0")/common.sh"

: "${DATA_PREFIX:?set DATA_PREFIX to OpenWebText in the Megatron indexed format (..._text_document)}"
: "${VOCAB_FILE:?set VOCAB_FILE to the GPT-2 vocab (gpt2-vocab.json)}"
: "${MERGE_FILE:?set MERGE_FILE to the GPT-2 merges (gpt2-merges.txt)}"
RUNS=${RUNS:-"dense 8 16 64 128"}
RUNS_DIR=${RUNS_DIR:-$ROOT/runs/separate_gpt2_345m}
export DATA_PREFIX VOCAB_FILE MERGE_FILE
launch_init gpt2_345m_separate_8gpu.yaml 8 1

for run in $RUNS; do
    sweep_run "$run" ratio --separate-ratio
    echo "== SEPARATE GPT-2 345M: $run -> $run_dir ($SUBMIT)"
    launch_run "separate-345m-$run" "$run_dir" "${RUN_FLAGS[@]}" "$@"
done
