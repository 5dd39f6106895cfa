#!/bin/bash
# Issue 35's GPU measurements in ONE device call, each step with its own time limit, so that a
# session lent a GPU (15 minutes of device time) spends it measuring, not assembling commands.
# Here: `bash bench/device_wheels.sh`; then the device tool with carry [".whl"] and timeout_s 600:
#   bash bench/device_run.sh bash bench/gpu_session.sh
# Each step's output goes to $OUT/<step>.log (and its tail to the reply); a step that fails or runs
# past its limit does not stop the next. What each answers (docs/benchmarks.md, bk_kernel.py):
#  1 kernel_check: the kernel against float64 (masked lengths, tile edges, split-K, a column-major
#    factor) and the device check of every candidate: "runs_on True".
#  2 bk_kernel: each SmolLM2 shape's clipped sum: kernel, split, cuBLAS's plain product.
#  3 step_512, step_256: a teacher step, non-private against bk (kernel) and bk with the split.
#  4 bf16_factors: the norm margin on the GPU: "never larger: True" is what BF16_NORM_MARGIN claims.
set -u
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.log"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/device.log"
step() {  # step NAME SECONDS CMD...
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - t0)) s"
    grep -v "^Loading\|it/s\]" "$OUT/$name.log" | tail -n 25
}
step kernel_check 90 python3 -c 'import ast; t = ast.parse(open("tests/privacy/test_bk_families.py").read())
exec(next(n.value.value for n in t.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "_KERNEL_CHECK"))'
step bk_kernel 120 python3 bench/bk_kernel.py --batch 512 --seq 128
MODES="--preset smollm2-135m --device cuda --precision bf16 --seq 128 --steps 30 --modes nonprivate full-bk full-bk-split"
step step_512 120 python3 bench/teacher_modes.py $MODES --batch 512
step step_256 90 python3 bench/teacher_modes.py $MODES --batch 256
step bf16_factors 60 python3 bench/bk_bf16_factors.py --device cuda --layers 4 --vocab 49152
