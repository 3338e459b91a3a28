#!/usr/bin/env bash
# AQ-SGD paper, GPT2-1.5B fine-tuning over 8 pipeline stages on WikiText2 or arXiv abstracts:
# uncompressed, fw3bw6 and fw4bw8 (and, with data parallelism, the same with the quantized DP
# exchange: the paper's end-to-end compression), one run after another
# (configs/megatron_lm/gpt2_1.5b_aqsgd_8gpu.yaml holds the settings and their sources).
#
# Usage:
#   MEGATRON_LM_DIR=/path/to/Megatron-LM PRETRAINED=/ckpt/gpt2-xl-megatron \
#   VOCAB_FILE=/data/gpt2-vocab.json MERGE_FILE=/data/gpt2-merges.txt \
#   INPUT="/data/wikitext-2-raw/wiki.train.raw" scripts/reproduce/aqsgd_gpt2_1.5b.sh wikitext2
#
# Data: DATA_PREFIX (an indexed dataset of the corpus), or INPUT (its files: .txt, .json,
# .jsonl, .csv, .parquet; arXiv abstracts as JSONL with --data-text-key in PREPARE_FLAGS),
# tokenized once with GPT-2 BPE into $RUNS_DIR/data by 'megatron-ext prepare-data'.
# PRETRAINED: a Megatron-LM checkpoint of GPT-2 XL (48 layers, hidden 1600, 25 heads, learned
# positions, LayerNorm); loaded with --finetune (model weights only). megatron-ext does not
# convert Hugging Face checkpoints: use Megatron-LM's checkpoint tools or your own converter.
#
# The fixed sample set is every whole 1024-token sample of the training split (SPLIT, default
# 98% of the data), rounded down to a multiple of the global batch; TRAIN_ITERS covers EPOCHS
# (10) epochs of it. Environment: RUNS ("none fw3bw6 fw4bw8"; add "fw3bw6+dp4 fw4bw8+dp4" for
# the quantized 4-bit DP exchange, which needs DP > 1, i.e. NODES x GPUS_PER_NODE > 8),
# RUNS_DIR (runs/aqsgd_gpt2_1.5b_<data>), EPOCHS, GLOBAL_BATCH_SIZE (32), BUFFER (host),
# SUBMIT (local | slurm), NODES (1), GPUS_PER_NODE (8), DRY_RUN (1: check and print the
# commands; scripts/reproduce/common.sh), and what pretrain_gpt_ext.sh reads.
#
# Memory: with BUFFER=host every rank keeps its stages' activations of every fixed sample in
# host memory: about 105 GB per node for WikiText2 on 8 GPUs (8 stages, 14 boundary sides x
# 7.5 GB), about 320 GB for arXiv abstracts. The exact figure is printed before training
# (also in the dry run and before sbatch), and a node with less available memory refuses to
# start; BUFFER=disk (BUFFER_DIR_ROOT on a large local disk) or more nodes (data-parallel
# ranks split the samples) need less per node.
#
# Requeue and restart: the first run fine-tunes PRETRAINED (--finetune --load); once
# RUN_DIR/checkpoints holds a checkpoint, scripts/pretrain_gpt_ext.sh loads it instead (no
# --finetune), so a requeued Slurm job or a second start continues the run.
set -euo pipefail
# shellcheck source=scripts/reproduce/common.sh
. "$(dirname "$0")/common.sh"

DATA=${1:?usage: aqsgd_gpt2_1.5b.sh wikitext2|arxiv [more flags...]}
shift
case "$DATA" in
    wikitext2|arxiv) ;;
    *) echo "aqsgd_gpt2_1.5b.sh: data must be wikitext2 or arxiv, got '$DATA'" >&2; exit 2 ;;
esac
: "${PRETRAINED:?set PRETRAINED to a Megatron-LM checkpoint of GPT-2 XL (loaded with --finetune)}"
: "${VOCAB_FILE:?set VOCAB_FILE to the GPT-2 vocab (gpt2-vocab.json)}"
: "${MERGE_FILE:?set MERGE_FILE to the GPT-2 merges (gpt2-merges.txt)}"
PYTHON=${PYTHON:-python}
RUNS=${RUNS:-"none fw3bw6 fw4bw8"}
RUNS_DIR=${RUNS_DIR:-$ROOT/runs/aqsgd_gpt2_1.5b_$DATA}
EPOCHS=${EPOCHS:-10}
export GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-32}
export SPLIT=${SPLIT:-98,2,0}
export PRETRAINED VOCAB_FILE MERGE_FILE
launch_init gpt2_1.5b_aqsgd_8gpu.yaml 8 1

if [[ -z "${DATA_PREFIX:-}" ]]; then
    : "${INPUT:?set DATA_PREFIX (an indexed dataset) or INPUT (the corpus files to tokenize)}"
    DATA_PREFIX="$RUNS_DIR/data/${DATA}_text_document"
    if [[ ! -f "$DATA_PREFIX.idx" ]]; then
        # shellcheck disable=SC2206  # INPUT and PREPARE_FLAGS are word lists
        PREPARE=("$PYTHON" -m megatron_ext prepare-data --tokenizer-type GPT2BPETokenizer
            --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"
            --input $INPUT --output-prefix "$DATA_PREFIX" ${PREPARE_FLAGS:-})
        if [[ "${DRY_RUN:-0}" == 1 ]]; then
            printf 'would run:'
            printf ' %q' "${PREPARE[@]}"
            printf '\n(the runs depend on the sample count of the tokenized data: run once'
            printf ' without DRY_RUN to tokenize, or set DATA_PREFIX, then DRY_RUN=1 again)\n'
            exit 0
        fi
        mkdir -p "$RUNS_DIR/data"
        "${PREPARE[@]}"
    fi
fi
export DATA_PREFIX

# Whole samples of the training split (a sample is seq-length + 1 tokens), a multiple of the
# global batch, and the iterations of EPOCHS epochs over them.
read -r FIXED_SAMPLES TRAIN_ITERS < <("$PYTHON" - "$DATA_PREFIX" "$SPLIT" "$GLOBAL_BATCH_SIZE" \
    "$EPOCHS" <<'PY'
import sys
from megatron_ext.megatron.data import indexed_dataset_stats

prefix, split, gbs, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
weights = [float(w) for w in split.replace("/", ",").split(",")]
_, tokens = indexed_dataset_stats(prefix)
samples = int(tokens * weights[0] / sum(weights)) // 1025 // gbs * gbs
if samples < gbs:
    sys.exit(f"the training split holds {samples} samples of 1024 tokens, fewer than a batch")
print(samples, epochs * samples // gbs)
PY
)
export FIXED_SAMPLES TRAIN_ITERS
echo "== $DATA: $FIXED_SAMPLES fixed samples, $TRAIN_ITERS iterations ($EPOCHS epochs)"

for run in $RUNS; do
    case "$run" in
        none) RUN_FLAGS=(--p2p-compression none --grad-compression none) ;;
        fw*bw*)
            bits=${run%%+*}
            fw=${bits#fw}; fw=${fw%%bw*}; bw=${bits##*bw}
            RUN_FLAGS=(--p2p-compression aqsgd --aqsgd-fw-bits "$fw" --aqsgd-bw-bits "$bw")
            if [[ "$run" == *+dp* ]]; then
                RUN_FLAGS+=(--grad-compression quantized --quantized-bits "${run##*+dp}")
            else
                RUN_FLAGS+=(--grad-compression none)
            fi ;;
        *) echo "aqsgd_gpt2_1.5b.sh: unknown run '$run' (none, fw<k>bw<k>[+dp<k>])" >&2; exit 2 ;;
    esac
    export BUFFER_DIR="${BUFFER_DIR_ROOT:-$RUNS_DIR/$run}/aqsgd_buffers"
    echo "== AQ-SGD GPT2-1.5B $DATA: $run -> $RUNS_DIR/$run ($SUBMIT)"
    launch_run "aqsgd-$DATA-$run" "$RUNS_DIR/$run" "${RUN_FLAGS[@]}" "$@"
done
