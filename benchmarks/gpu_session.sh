#!/usr/bin/env bash
# Runs on a lent GPU machine (Python 3.12, CUDA torch, no megatron-core, no package registry):
# installs the carried megatron-core wheel, then runs the named stages in order, each under
# its own time limit, logging to $OUT (or runs/gpu-session). A failing stage does not stop
# the others. Usage (from the repository root, with .whl/ and .cache/ carried):
#   bash benchmarks/gpu_session.sh env tiny one-gpu kernels tests grass llama pp2
# Stages:
#   env      GPU, torch, megatron-core versions; copy floor and matmul rate (sanity)
#   tests    the gpu test set under torch.cuda.set_sync_debug_mode("warn") (report: syncs.json)
#   kernels  benchmarks/kernels.py GPU rows (fp32 and bf16, 1e6-1e9)
#   tiny     every method through the driver on gpt-tiny (fp32): runs at all on CUDA?
#   one-gpu  gpt2-345m bf16 through the driver: tokens/s, peak memory, per-method overhead
#   llama    llama-1b bf16: none and Grass (r 256) through the driver
#   grass    benchmarks/grass_throughput.py at llama-1b shapes on CUDA (layer times)
#   pp2      AQ-SGD and Protocol Models, PP=2 as two ranks sharing the GPU over gloo
#   profile  torch.profiler over steady gpt2-345m steps per method (profile_<method>.txt)
set -u
OUT=${OUT:-runs/gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MEGATRON_EXT_CACHE=$PWD/.cache/tests
# No Apex on a stock CUDA torch: the unfused softmax and torch's norm.
EXTRA=${EXTRA:---no-masked-softmax-fusion --no-persist-layer-norm}
if ! python3 -c "import megatron.core" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/megatron_core-*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
else
    export PYTHONPATH=$PWD
fi
# The limit of a stage in seconds (STAGE_LIMIT_<name>, else 240).
limit() { local v="STAGE_LIMIT_${1//-/_}"; echo "${!v:-240}"; }
stage() {
    local name=$1
    shift
    local t0=$SECONDS
    echo "=== stage $name (limit $(limit "$name") s)"
    timeout -k 10 "$(limit "$name")" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== stage $name rc=$rc $((SECONDS - t0)) s"
    tail -n "${TAIL:-25}" "$OUT/$name.log"
}
for s in "$@"; do
    case $s in
    env)
        stage env bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv;
            python3 - <<EOF
import torch, megatron.core, sys
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "megatron-core", megatron.core.__version__, torch.cuda.get_device_name())
x = torch.randn(2**28, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record(); [y.copy_(x) for _ in range(10)]; e.record(); torch.cuda.synchronize()
print("copy GB/s (read+write)", 2 * x.numel() * 4 * 10 / (s.elapsed_time(e) / 1e3) / 1e9)
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
for _ in range(3): a @ b
s.record(); [a @ b for _ in range(10)]; e.record(); torch.cuda.synchronize()
print("bf16 matmul TFLOP/s", 2 * 8192**3 * 10 / (s.elapsed_time(e) / 1e3) / 1e12)
EOF'
        ;;
    tests)
        stage tests env MEGATRON_EXT_SYNC_REPORT="$OUT/syncs.json" python3 -m pytest -q -m gpu \
            -p no:cacheprovider tests/gpu -rs
        ;;
    kernels)
        stage kernels python3 benchmarks/kernels.py --devices cuda ${KERNEL_ARGS:-} --out "$OUT/kernels"
        cp "$OUT/kernels/kernels.json" "$OUT/" 2>/dev/null
        ;;
    tiny)
        stage tiny python3 benchmarks/one_gpu.py --model gpt-tiny --no-bf16 --iters 10 --skip 4 \
            --micro-batch-size 4 --grass-rank 16 --timeout 90 --extra "$EXTRA" --out "$OUT/tiny"
        ;;
    one-gpu)
        stage one-gpu python3 benchmarks/one_gpu.py --model gpt2-345m --iters ${ITERS:-30} \
            --micro-batch-size 8 --timeout 150 --extra "$EXTRA" --out "$OUT/one-gpu"
        cp "$OUT/one-gpu/one_gpu.json" "$OUT/one_gpu-gpt2-345m.json" 2>/dev/null
        ;;
    llama)
        stage llama python3 benchmarks/one_gpu.py --model llama-1b --methods none,grass \
            --grass-rank 256 --iters 20 --skip 6 --micro-batch-size 16 --timeout 200 --extra "$EXTRA" \
            --out "$OUT/llama"
        cp "$OUT/llama/one_gpu.json" "$OUT/one_gpu-llama-1b.json" 2>/dev/null
        ;;
    grass)
        stage grass python3 benchmarks/grass_throughput.py --device cuda --model llama-1b \
            --ranks 64,128,256,512 --tokens 4096 --out "$OUT/grass"
        cp "$OUT/grass/grass_throughput.json" "$OUT/" 2>/dev/null
        ;;
    pp2)
        stage pp2 bash -c "for m in ${PP2_METHODS:-'p2p-compression aqsgd' 'subspace-method protocol'}; do
            set -- \$m; torchrun --nproc-per-node 2 -m megatron_ext.train --model gpt-tiny \
            --distributed-backend gloo --pipeline-model-parallel-size 2 --fixed-samples 32 \
            --global-batch-size 8 --train-iters 12 --lr-warmup-iters 1 --eval-iters 0 \
            --log-interval 4 --hidden-dropout 0 $EXTRA --\$1 \$2 >$OUT/pp2-\$2.log 2>&1;
            echo \$2 rc=\$?; grep -v Warn $OUT/pp2-\$2.log | grep -m 12 -i 'error\|iteration  *[0-9]*/\|done'; done"
        ;;
    profile)
        stage profile bash -c "for m in ${PROFILE_METHODS:-none separate powersgd grass}; do
            case \$m in none) f=;; grass) f='--grass-method topr --grass-rank 256 --grass-update-interval 1000';;
            powersgd) f='--grad-compression powersgd --powersgd-approx-rank 48 --powersgd-start-step 2';;
            *) f=\"--grad-compression \$m\";; esac
            python3 benchmarks/profile_step.py --label \$m --warmup 4 --steps 3 --top 22 --out $OUT -- \
                --model gpt2-345m --bf16 --micro-batch-size 8 $EXTRA \$f 2>&1 | grep -v Warn | tail -n 60; done"
        ;;
    *)
        echo "unknown stage $s"
        ;;
    esac
done
