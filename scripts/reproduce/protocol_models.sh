#!/usr/bin/env bash
# Protocol Models paper: the 8-layer 2B base model over 8 pipeline stages, the 640M
# compute-optimal run, or the LLaMA 8B run over 32 stages, each with 100x compressed
# pipeline activations and gradients (configs/megatron_lm/llama_{2b,640m}_protocol_8gpu.yaml
# and llama_8b_protocol_64gpu.yaml hold the settings and their sources).
#
# Usage:
#   MEGATRON_LM_DIR=/path/to/Megatron-LM DATA_PREFIX=/data/c4_text_document \
#   VOCAB_FILE=/data/gpt2-vocab.json MERGE_FILE=/data/gpt2-merges.txt \
#   scripts/reproduce/protocol_models.sh 2b [more flags...]
#
# 8b: TOKENIZER_MODEL instead of VOCAB_FILE / MERGE_FILE, and 32 pipeline stages x 2
# replicas = 64 GPUs on NODES (8) nodes of GPUS_PER_NODE (8) GPUs. Under Slurm:
#   SUBMIT=slurm MEGATRON_LM_DIR=... DATA_PREFIX=... TOKENIZER_MODEL=... \
#   scripts/reproduce/protocol_models.sh 8b
# Without Slurm, start it on each of the 8 nodes with the same environment plus
# NODE_RANK (0 .. 7) and MASTER_ADDR (the address of the node with NODE_RANK=0):
#   NODE_RANK=0 MASTER_ADDR=node0.example MEGATRON_LM_DIR=... DATA_PREFIX=... \
#   TOKENIZER_MODEL=... scripts/reproduce/protocol_models.sh 8b
# Fewer nodes x GPUs than the layout needs (TP x PP x CP, e.g. 32 for 8b) is refused.
#
# Environment: RUNS ("protocol none" for 2b, "protocol" otherwise; 'none' is the
# uncompressed baseline with the same settings), RUNS_DIR (runs/protocol_<size>),
# SUBMIT (local | slurm), NODES (1; 8 for 8b), GPUS_PER_NODE (8), DRY_RUN (1: check and
# print the commands; scripts/reproduce/common.sh), and what scripts/pretrain_gpt_ext.sh
# reads (MASTER_PORT, ...).
set -euo pipefail
# shellcheck source=scripts/reproduce/common.sh
. "$(dirname "$0")/common.sh"

SIZE=${1:?usage: protocol_models.sh 2b|640m|8b [more flags...]}
shift
case "$SIZE" in
    2b) DEFAULT_RUNS="protocol none"; DEFAULT_NODES=1; CONFIG_FILE=llama_2b_protocol_8gpu.yaml ;;
    640m) DEFAULT_RUNS="protocol"; DEFAULT_NODES=1; CONFIG_FILE=llama_640m_protocol_8gpu.yaml ;;
    8b) DEFAULT_RUNS="protocol"; DEFAULT_NODES=8; CONFIG_FILE=llama_8b_protocol_64gpu.yaml ;;
    *) echo "protocol_models.sh: size must be 2b, 640m or 8b, got '$SIZE'" >&2; exit 2 ;;
esac
: "${DATA_PREFIX:?set DATA_PREFIX to the data in the Megatron indexed format (..._text_document)}"
if [ "$SIZE" = 8b ]; then
    : "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the LLaMA-3 tokenizer (HuggingFace name or path)}"
    export TOKENIZER_MODEL
else
    : "${VOCAB_FILE:?set VOCAB_FILE to the GPT-2 BPE vocabulary (gpt2-vocab.json)}"
    : "${MERGE_FILE:?set MERGE_FILE to the GPT-2 BPE merges (gpt2-merges.txt)}"
    export VOCAB_FILE MERGE_FILE
fi
RUNS=${RUNS:-$DEFAULT_RUNS}
RUNS_DIR=${RUNS_DIR:-$ROOT/runs/protocol_$SIZE}
export DATA_PREFIX
launch_init "$CONFIG_FILE" 8 "$DEFAULT_NODES"

for run in $RUNS; do
    pick_run "$run" protocol "" none "--subspace-method none"
    echo "== Protocol Models $SIZE: $run -> $RUNS_DIR/$run ($SUBMIT, $NODES nodes)"
    launch_run "protocol-$SIZE-$run" "$RUNS_DIR/$run" "${RUN_FLAGS[@]}" "$@"
done
