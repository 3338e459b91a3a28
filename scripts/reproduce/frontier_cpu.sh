#!/usr/bin/env bash
# Measurements on the 2-core CPU machine: the quality-versus-bytes frontier at
# 1,024 and 4,096 tokens per step, the SEPARATE readings, and time to target measured
# inside netbench at 1 Gbit/s, 100 Mbit/s and 10 Mbit/s; then the report
# (docs/performance/frontier/). About 2.5 hours on 2 cores; the netbench runs need root and
# a quiet machine (they run at --priority -10).
#
# Usage: scripts/reproduce/frontier_cpu.sh [RUNS_DIR]   (default runs/frontier-16)
# DRY_RUN=1: print the commands instead of running them.
set -euo pipefail
# shellcheck source=scripts/reproduce/common.sh
. "$(dirname "$0")/common.sh"

OUT=${1:-$ROOT/runs/frontier-16}
cd "$ROOT"
B8=(--batch-sizes 8 --iters 8=300)
B32=(--batch-sizes 32 --iters 32=150)
PYTHON=${PYTHON:-python}
run() { run_cmd "$PYTHON" benchmarks/frontier.py "$@"; }

# Frontier, 1,024 tokens a step, 300 steps (loss only: loopback).
run "${B8[@]}" --out "$OUT/b8" --points separate:ratio=2,4,8,32 powersgd:approx_rank=7,55 \
    radius:density=0.1,0.2 linear/topr:rank=64 \
    separate:ratio=16:blocks=layer separate:ratio=16:refresh_interval=0
# Radius at density 0.6; Grass top-r at other ranks.
run "${B8[@]}" --out "$OUT/b8-extra" --points radius:density=0.6 linear/topr:rank=32,128
# The spread of SEPARATE-16 over projection seeds (how far apart two readings must be).
run "${B8[@]}" --out "$OUT/b8-seeds" --points separate:ratio=16:seed=7,99 \
    separate:ratio=16:blocks=layer:seed=7
# Time to target (these runs are also the frontier's none, SEPARATE-16, PowerSGD rank 14
# and Radius 0.4 points at 1,024 tokens: the loss does not depend on the link).
run "${B8[@]}" --out "$OUT/ttt-1gbit" --bandwidths 1gbit --priority -10 \
    --points none powersgd:approx_rank=14 separate:ratio=16 radius:density=0.4
run "${B8[@]}" --out "$OUT/ttt-100mbit" --bandwidths 100mbit --time-limit 100mbit=480 \
    --priority -10 --points powersgd:approx_rank=14 separate:ratio=16
# A dense step takes ~3 s at 100 Mbit/s: the whole dense run, ~16 minutes.
run "${B8[@]}" --out "$OUT/ttt-100mbit-none" --bandwidths 100mbit --time-limit 100mbit=1100 \
    --priority -10 --points none
# At 10 Mbit/s a dense step takes ~25 s: PowerSGD starts compressing at step 2 there.
run "${B8[@]}" --out "$OUT/ttt-10mbit" --bandwidths 10mbit --time-limit 10mbit=720 \
    --priority -10 --points powersgd:approx_rank=14:start_step=2
run "${B8[@]}" --out "$OUT/ttt-10mbit-none" --bandwidths 10mbit --time-limit 10mbit=240 \
    --priority -10 --points none
# Frontier, 4,096 tokens a step, 150 steps, with the control: dense at 1/16 of the batch.
run "${B32[@]}" --out "$OUT/b32" --points none separate:ratio=16 powersgd:approx_rank=14 \
    none:batch_div=16 separate:ratio=4,32 radius:density=0.4 \
    separate:ratio=16:blocks=layer separate:ratio=16:refresh_interval=0 \
    separate:ratio=16:ef_beta=0
# PowerSGD at 4,096 tokens: a lower rank, and rank 14 dense for 10% of the steps (not 30).
run "${B32[@]}" --out "$OUT/b32-powersgd" --points powersgd:approx_rank=7 \
    powersgd:approx_rank=14:start_step=15
run_cmd megatron-ext report "$OUT"/b8 "$OUT"/b8-extra "$OUT"/b8-seeds "$OUT"/ttt-1gbit \
    "$OUT"/ttt-100mbit "$OUT"/ttt-100mbit-none "$OUT"/ttt-10mbit "$OUT"/ttt-10mbit-none \
    "$OUT"/b32 "$OUT"/b32-powersgd --out "$OUT/report"
