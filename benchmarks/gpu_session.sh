#!/usr/bin/env bash
# The GPU session: one command on a lent GPU machine (Python 3.12, CUDA torch, no
# megatron-core, no package registry) that checks and measures what a CPU cannot, inside a
# lease's single-command limit, and packs every log and report into one archive under $OUT.
#
# Usage (from the repository root; .whl/ carried, holding the megatron-core cp312 wheel,
# pydantic's wheels and Megatron-LM's source archive core_v0.19.0.tar.gz):
#   bash benchmarks/gpu_session.sh [--dry-run] [STAGE ...]
# Default stages: env checks kernels one-gpu one-gpu-eager (the order is the priority: a
# stage starts only while the session's deadline leaves it its limit, else it is reported as
# not run).
#
# Stages:
#   env            GPU, torch, megatron-core; the card's copy floor and bf16 matmul rate
#   checks         two checks side by side (correctness only, no timing):
#                    tests: the gpu test set (tests/gpu) under the synchronization recorder
#                      (syncs.json): fused kernels against eager on the device, every seam and
#                      method (DiLoCo's outer step included) on the device against the CPU;
#                    lm-fp16: Megatron-LM's pretrain_gpt.py with --fp16 (loss scaling) and
#                      each DP method and DiLoCo, DP=2 over gloo on the one GPU (the ranks
#                      share it), replicas checked by Megatron-LM (tests/megatron_lm/test_fp16.py)
#   kernels        compress + decompress against a device copy, eager and fused (benchmarks/
#                  kernels.py at 1e7 and 1e8 elements, fp32 and bf16; benchmarks/dp_kernels.py)
#   one-gpu        gpt2-345m bf16 step time per DP method with the fused kernels (the default
#                  --fused-kernels auto compiles them on CUDA) against no compression
#   one-gpu-eager  the same for SEPARATE and the quantized exchange with --fused-kernels off
#   profile        torch.profiler over steady gpt2-345m steps (device time per method)
#   diloco         DiLoCo on CUDA at gpt2-345m (one site): inner step against none, outer step
#   llama          llama-1b bf16 through the driver: none and Grass (r 256), tokens/s and memory
#   grass          Grass's projected layers at llama-1b shapes (benchmarks/grass_throughput.py)
# (profile, diloco, llama and grass are not in the default list: they follow it when a lease
# has time left, e.g. `... gpu_session.sh llama grass diloco` as a second command.)
#
# Environment: OUT (default runs/gpu-session), DEADLINE (seconds the whole session may take,
# default 470: a lease's 8-minute command), STAGE_LIMIT_<stage> (seconds), ITERS (one-gpu),
# KERNEL_SIZES / KERNEL_MODES / KERNEL_BUDGET (kernels; the budget counts compilation too),
# PROFILE_METHODS (profile), GPU_TESTS (a -k selection of tests/gpu), LM_METHODS (a -k
# selection of the fp16 methods), LM_NPROC (ranks of each fp16 run; default the test's 2).
# --dry-run runs the same stages on the CPU at toy sizes (tests/unit/test_gpu_session.py):
# the gpu tests against the CPU, Megatron-LM with --cpu (MEGATRON_LM_DIR must be set), the
# kernels at small sizes, gpt-tiny through the driver; it checks this script, not the GPU.
set -u
DRY=0
if [[ ${1:-} == --dry-run ]]; then
    DRY=1
    shift
fi
STAGES=("$@")
[[ ${#STAGES[@]} -eq 0 ]] && STAGES=(env checks kernels one-gpu one-gpu-eager)
OUT=${OUT:-runs/gpu-session}
DEADLINE=${DEADLINE:-470}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOGS=$OUT/session
mkdir -p "$LOGS"
SUMMARY=$LOGS/summary.txt
: >"$SUMMARY"
export PYTHONUNBUFFERED=1 MEGATRON_EXT_CACHE=$PWD/.cache/tests
# One compile cache for every process of the session: a kernel compiled by the tests is
# loaded, not compiled again, by the benchmarks.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/megatron-ext-inductor}
# No Apex on a stock CUDA torch: the unfused softmax and torch's norm.
EXTRA=${EXTRA:---no-masked-softmax-fusion --no-persist-layer-norm}
PY=${PYTHON:-python3}

note() { echo "$*" | tee -a "$SUMMARY"; }

setup() {
    local site=/tmp/megatron-ext-site
    if ! $PY -c "import importlib.metadata as m; m.version('megatron-core')" 2>/dev/null; then
        if ! ls .whl/*.whl >/dev/null 2>&1; then
            note "setup: megatron-core is not installed and no wheels in .whl/ (carry .whl)"
            return 1
        fi
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" .whl/*.whl || return 1
        export PYTHONPATH=$PWD:$site
    else
        export PYTHONPATH=$PWD
    fi
    if [[ -z ${MEGATRON_LM_DIR:-} ]]; then
        local archive
        archive=$(ls .whl/core_v*.tar.gz 2>/dev/null | tail -n 1)
        if [[ -n $archive ]]; then
            export MEGATRON_LM_DIR=/tmp/megatron-lm-$(basename "$archive" .tar.gz)
            mkdir -p "$MEGATRON_LM_DIR"
            tar -xzf "$archive" -C "$MEGATRON_LM_DIR" || return 1
            # Megatron-LM runs `make` on its dataset helpers at start-up; the megatron-core
            # wheel's compiled helpers (same source) make that a no-op, so the session needs
            # neither Python's headers nor a compiler on the machine.
            $PY - "$MEGATRON_LM_DIR/megatron/core/datasets" .whl/megatron_core-*.whl <<'EOF' || return 1
import sys, zipfile
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name.startswith("megatron/core/datasets/helpers_cpp") and name.endswith(".so"):
                with open(f"{sys.argv[1]}/{name.rsplit('/', 1)[1]}", "wb") as f:
                    f.write(z.read(name))
                print("helpers from", wheel)
EOF
        fi
    fi
    note "setup: megatron-core $($PY -c 'import importlib.metadata as m; print(m.version("megatron-core"))')," \
        "Megatron-LM ${MEGATRON_LM_DIR:-(none)}, dry run $DRY"
}

# limit NAME: the stage's limit in seconds (STAGE_LIMIT_<name>, else its default).
limit() {
    local v="STAGE_LIMIT_${1//-/_}" d
    case $1 in
    env) d=20 ;;
    checks) d=200 ;;
    kernels) d=60 ;;
    one-gpu) d=150 ;;
    one-gpu-eager) d=60 ;;
    profile) d=90 ;;
    diloco) d=60 ;;
    llama) d=150 ;;
    grass) d=90 ;;
    *) d=120 ;;
    esac
    echo "${!v:-$d}"
}

# stage NAME CMD...: runs CMD under the stage's limit if the deadline leaves room for it.
stage() {
    local name=$1 lim left t0=$SECONDS rc
    shift
    lim=$(limit "$name")
    left=$((DEADLINE - SECONDS))
    if ((left < lim / 2)); then
        note "=== stage $name NOT RUN: ${left} s left of the deadline, its limit is ${lim} s"
        return
    fi
    ((lim > left)) && lim=$left
    echo "=== stage $name (limit $lim s)"
    timeout -k 5 "$lim" bash -c '"$@"' "$name" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
    note "=== stage $name rc=$rc $((SECONDS - t0)) s$( ((rc == 124)) && echo ' (TIMED OUT)')"
    tail -n "${TAIL:-12}" "$LOGS/$name.log"
}

run_env() {
    # shellcheck disable=SC2016
    $PY - <<'EOF'
import importlib.metadata, sys, torch
dev = "cuda" if torch.cuda.is_available() else "cpu"
name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "megatron-core", importlib.metadata.version("megatron-core"), "device", name)
n = 2**28 if dev == "cuda" else 2**22
x = torch.randn(n, device=dev); y = torch.empty_like(x)
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
import time
for _ in range(3): y.copy_(x)
sync(); t = time.perf_counter()
for _ in range(10): y.copy_(x)
sync(); dt = (time.perf_counter() - t) / 10
print(f"copy GB/s (read+write) {2 * n * 4 / dt / 1e9:.0f}")
m = 8192 if dev == "cuda" else 512
a = torch.randn(m, m, device=dev, dtype=torch.bfloat16); b = torch.randn_like(a)
for _ in range(3): a @ b
sync(); t = time.perf_counter()
for _ in range(10): a @ b
sync(); dt = (time.perf_counter() - t) / 10
print(f"bf16 matmul TFLOP/s {2 * m**3 / dt / 1e12:.1f}")
EOF
}

run_checks() {
    local gpu_env=() lm_env=() tests_args=()
    if ((DRY)); then
        gpu_env=(MEGATRON_EXT_GPU_TESTS_DEVICE=cpu)
        tests_args=(-k "${DRY_TESTS:-seams and (diloco or parity) or quant_cuda and exchange}")
    else
        lm_env=(MEGATRON_EXT_LM_DEVICE=cuda)
        [[ -n ${LM_NPROC:-} ]] && lm_env+=(MEGATRON_EXT_LM_NPROC="$LM_NPROC")
        [[ -n ${GPU_TESTS:-} ]] && tests_args=(-k "$GPU_TESTS")
    fi
    env "${gpu_env[@]}" MEGATRON_EXT_SYNC_REPORT="$LOGS/syncs.json" $PY -m pytest -q -m gpu \
        -p no:cacheprovider tests/gpu -rs --durations=12 "${tests_args[@]}" \
        >"$LOGS/tests.log" 2>&1 &
    local tests=$!
    local lm_rc=0 parallel=()
    $PY -c "import xdist" 2>/dev/null && parallel=(-n "${LM_WORKERS:-3}")
    if [[ -n ${MEGATRON_LM_DIR:-} ]]; then
        env "${lm_env[@]}" $PY -m pytest -q -p no:cacheprovider tests/megatron_lm/test_fp16.py \
            -k "${LM_METHODS:-not none}" -rs --durations=8 "${parallel[@]}" \
            >"$LOGS/lm-fp16.log" 2>&1
        lm_rc=$?
    else
        echo "MEGATRON_LM_DIR unset and no archive in .whl/: Megatron-LM fp16 not run" \
            | tee "$LOGS/lm-fp16.log"
        lm_rc=1
    fi
    wait $tests
    local tests_rc=$?
    echo "tests rc=$tests_rc: $(tail -n 1 "$LOGS/tests.log")"
    echo "lm-fp16 rc=$lm_rc: $(tail -n 1 "$LOGS/lm-fp16.log")"
    return $((tests_rc || lm_rc))
}

run_kernels() {
    local common=(--sizes "${KERNEL_SIZES:-1e7,1e8}" --dtypes fp32,bf16 --block-sizes 256
        --quant-bits 4 --devices cuda --repeats 7 --cuda-budget-s "${KERNEL_BUDGET:-20}")
    local dp=(--device cuda --numel 100000000)
    if ((DRY)); then
        common=(--sizes 1e5 --dtypes fp32 --block-sizes 256 --quant-bits 4 --devices cpu
            --threads 1 --repeats 2 --warmup 1 --methods copy,separate,quantized)
        dp=(--device cpu --numel 100000 --hidden 64 --repeats 2)
    fi
    local mode rc=0
    for mode in ${KERNEL_MODES:-off on}; do
        $PY benchmarks/kernels.py "${common[@]}" --fused-kernels $mode \
            --out "$LOGS/kernels-$mode" || rc=1
    done
    $PY benchmarks/dp_kernels.py "${dp[@]}" || rc=1
    return $rc
}

run_one_gpu() {
    local methods=$1 tag=$2
    shift 2
    local args=(--model gpt2-345m --iters "${ITERS:-16}" --skip 6 --micro-batch-size 8
        --timeout 100)
    ((DRY)) && args=(--cpu --model gpt-tiny --iters 4 --skip 2 --timeout 120)
    $PY benchmarks/one_gpu.py "${args[@]}" --methods "$methods" --extra "$EXTRA $*" \
        --out "$LOGS/$tag"
}

run_llama() {
    local args=(--model llama-1b --methods none,grass --grass-rank 256 --iters 16 --skip 6
        --micro-batch-size 16 --timeout 140)
    ((DRY)) && args=(--cpu --model gpt-tiny --methods none,grass --grass-rank 16 --iters 4
        --skip 2 --timeout 120)
    $PY benchmarks/one_gpu.py "${args[@]}" --extra "$EXTRA" --out "$LOGS/llama"
}

run_grass() {
    local args=(--device cuda --model llama-1b --ranks 128,256 --tokens 4096)
    ((DRY)) && args=(--device cpu --model gpt-tiny --ranks 16 --tokens 64 --repeats 1)
    $PY benchmarks/grass_throughput.py "${args[@]}" --out "$LOGS/grass"
}

run_profile() {
    local m f model="--model gpt2-345m --bf16 --micro-batch-size 8 $EXTRA"
    ((DRY)) && model="--model gpt-tiny --cpu"
    for m in ${PROFILE_METHODS:-none separate quantized}; do
        case $m in
        none) f= ;;
        *) f="--grad-compression $m" ;;
        esac
        # shellcheck disable=SC2086
        $PY benchmarks/profile_step.py --label "$m" --warmup 4 --steps 3 --top 22 --out "$LOGS" \
            -- $model $f 2>&1 | tail -n 40
    done
}

pack() {
    # Every file back in one archive (a lease returns at most 8 files), plus the summary.
    tar -czf "$OUT/gpu-session.tar.gz" -C "$OUT" session
    cp "$SUMMARY" "$OUT/summary.txt"
    echo "=== packed $(du -h "$OUT/gpu-session.tar.gz" | cut -f1) into $OUT/gpu-session.tar.gz"
}

export DRY LOGS PY EXTRA SUMMARY
export -f note run_env run_checks run_kernels run_one_gpu run_profile run_llama run_grass
trap pack EXIT
if ! setup >"$LOGS/setup.log" 2>&1; then
    note "setup failed:"
    tail -n 20 "$LOGS/setup.log"
    exit 1
fi
cat "$LOGS/setup.log"
if ((DRY)); then
    [[ -z ${MEGATRON_LM_DIR:-} ]] && note "dry run without MEGATRON_LM_DIR: lm-fp16 not run"
fi
for s in "${STAGES[@]}"; do
    case $s in
    env) stage env run_env ;;
    checks) stage checks run_checks ;;
    kernels) stage kernels run_kernels ;;
    one-gpu) stage one-gpu run_one_gpu none,separate,powersgd,radius,quantized one-gpu ;;
    one-gpu-eager)
        stage one-gpu-eager run_one_gpu separate,quantized one-gpu-eager --fused-kernels off
        ;;
    profile) stage profile run_profile ;;
    diloco) stage diloco run_one_gpu none,diloco diloco ;;
    llama) stage llama run_llama ;;
    grass) stage grass run_grass ;;
    *)
        note "unknown stage $s (env checks kernels one-gpu one-gpu-eager profile diloco llama" \
            "grass)"
        ;;
    esac
done
note "=== session $SECONDS s"
