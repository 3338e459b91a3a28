#!/usr/bin/env bash
# Radius paper, GPT-355M or GPT-2.0B on OpenWebText with DP=64 (16 nodes x 4 A100), global
# batch 512, dense all-reduce until iteration 80,000 (355M) / 60,000 (2.0B), then Radius with
# T=200 (configs/megatron_lm/gpt_{355m,2.0b}_radius_64gpu.yaml hold the settings and sources).
#
# Usage (submits one Slurm job per run; SUBMIT=local runs on this node instead):
#   MEGATRON_LM_DIR=/path/to/Megatron-LM DATA_PREFIX=/data/openwebtext_text_document \
#   VOCAB_FILE=/data/gpt2-vocab.json MERGE_FILE=/data/gpt2-merges.txt \
#   scripts/reproduce/radius_gpt.sh 2.0b [more flags...]
#
# Environment: DENSITIES (0.4 for 2.0b, 0.5 for 355m; e.g. "0.5 0.4 0.3" for the sweep),
# BASELINE (1: also the dense all-reduce run), RUNS_DIR (runs/radius_gpt_<size>),
# SUBMIT (slurm | local), NODES (16), GPUS_PER_NODE (4), DRY_RUN (1: check and print the
# commands; scripts/reproduce/common.sh), and what pretrain_gpt_ext.sh reads.
set -euo pipefail
# shellcheck source=scripts/reproduce/common.sh
. "$(dirname "$0")/common.sh"

SIZE=${1:?usage: radius_gpt.sh 355m|2.0b [more flags...]}
shift
case "$SIZE" in
    355m) DEFAULT_DENSITIES=0.5 ;;
    2.0b) DEFAULT_DENSITIES=0.4 ;;
    *) echo "radius_gpt.sh: size must be 355m or 2.0b, got '$SIZE'" >&2; exit 2 ;;
esac
: "${DATA_PREFIX:?set DATA_PREFIX to OpenWebText in the Megatron indexed format (..._text_document)}"
: "${VOCAB_FILE:?set VOCAB_FILE to the GPT-2 vocab (gpt2-vocab.json)}"
: "${MERGE_FILE:?set MERGE_FILE to the GPT-2 merges (gpt2-merges.txt)}"
DENSITIES=${DENSITIES:-$DEFAULT_DENSITIES}
BASELINE=${BASELINE:-1}
RUNS_DIR=${RUNS_DIR:-$ROOT/runs/radius_gpt_$SIZE}
SUBMIT=${SUBMIT:-slurm}
export DATA_PREFIX VOCAB_FILE MERGE_FILE
launch_init "gpt_${SIZE}_radius_64gpu.yaml" 4 16

RUNS=()
if [[ "$BASELINE" == 1 ]]; then
    RUNS+=(dense)
fi
for density in $DENSITIES; do
    RUNS+=("$density")
done

for run in "${RUNS[@]}"; do
    sweep_run "$run" density --radius-density
    echo "== Radius GPT-$SIZE: $run -> $run_dir ($SUBMIT)"
    launch_run "radius-$SIZE-$run" "$run_dir" "${RUN_FLAGS[@]}" "$@"
done
