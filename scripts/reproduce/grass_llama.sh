#!/usr/bin/env bash
# Grass paper, LLaMA pre-training on C4 (Dolma): 60M / 350M / 1B (Table 2: Grass and the
# full-rank baseline, one run after another) or the 13B single-GPU memory run (Figure 3)
# (configs/megatron_lm/llama_{60m,350m,1b}_grass_8gpu.yaml and llama_13b_grass_1gpu.yaml hold
# the settings and their sources).
#
# Usage:
#   MEGATRON_LM_DIR=/path/to/Megatron-LM DATA_PREFIX=/data/c4_text_document \
#   TOKENIZER_MODEL=/data/t5-spiece.model scripts/reproduce/grass_llama.sh 60m [more flags...]
#
# Data: 'megatron-ext prepare-data --tokenizer-type SentencePieceTokenizer --tokenizer-model
# $TOKENIZER_MODEL --input c4-train.*.json.gz --output-prefix /data/c4' (local files).
#
# Environment: RUNS ("full grass" for 60m/350m/1b, "grass" for 13b; 'full' is --grass-method
# none), RUNS_DIR (runs/grass_llama_<size>), SUBMIT (local | slurm), NODES (1), DRY_RUN (1:
# check and print the commands; scripts/reproduce/common.sh), GPUS_PER_NODE (8; 1 for 13b)
# and what scripts/pretrain_gpt_ext.sh reads.
set -euo pipefail
# shellcheck source=scripts/reproduce/common.sh
. "$(dirname "$0")/common.sh"

SIZE=${1:?usage: grass_llama.sh 60m|350m|1b|13b [more flags...]}
shift
case "$SIZE" in
    60m|350m|1b) DEFAULT_RUNS="full grass"; GPUS=8; CONFIG_FILE=llama_${SIZE}_grass_8gpu.yaml ;;
    13b) DEFAULT_RUNS="grass"; GPUS=1; CONFIG_FILE=llama_13b_grass_1gpu.yaml ;;
    *) echo "grass_llama.sh: size must be 60m, 350m, 1b or 13b, got '$SIZE'" >&2; exit 2 ;;
esac
: "${DATA_PREFIX:?set DATA_PREFIX to C4 in the Megatron indexed format (..._text_document)}"
: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the T5 SentencePiece model (spiece.model)}"
RUNS=${RUNS:-$DEFAULT_RUNS}
RUNS_DIR=${RUNS_DIR:-$ROOT/runs/grass_llama_$SIZE}
export DATA_PREFIX TOKENIZER_MODEL
launch_init "$CONFIG_FILE" "$GPUS" 1

for run in $RUNS; do
    pick_run "$run" full "--grass-method none" grass ""
    echo "== Grass LLaMA $SIZE: $run -> $RUNS_DIR/$run ($SUBMIT)"
    launch_run "grass-$SIZE-$run" "$RUNS_DIR/$run" "${RUN_FLAGS[@]}" "$@"
done
