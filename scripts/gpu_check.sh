#!/usr/bin/env bash
# The checks a lent one-GPU machine runs (docs/gpu.md), in order of value, each step under its own time
# limit so a slow one cannot cost the rest:
#   versions and devices (doctor --probe-only), bench --profile (matmul rates by size and by training shape at
#   the power limit's clock, FlashAttention's rate, device copy), the models' own GEMMs (scripts/gpu_shapes.py), a
#   measured training step against the planner's (scripts/gpu_step_check.py), the
#   gpu-marked tests, compare.py at world size 1 on NCCL and JAX on the GPU (float32, TF32 off), and a
#   larger single-GPU timing run (bfloat16: float32's 5e-5 parameter tolerance is below AdamW's
#   amplified round-off at D=512, shared/tolerances.py).
# Then (issue 46) the flagship cold and warm at the GPU sizes, bench --overhead, doctor's whole run.
# Everything lands in $OUT (default ./gpu_out): log.txt, profile.json, bench.json, speed.json, flagship.json,
# flagship_warm.json, overhead.json;
# scripts/readme_figures.py --only gpu renders docs/gpu.md's measured block from copies of them in docs/gpu/.
# pytest runs without the suite's xdist options (-o addopts=-ra): a machine's own pytest-xdist may not know them.
#
#   bash scripts/gpu_check.sh                 # on the GPU node, from the repository root
#   SPEED=0 bash scripts/gpu_check.sh         # without the timing run (it outlasted its 170 s on an H200)
set -u
OUT=${OUT:-gpu_out}
PY=${PY:-python3}
DEVICE=${DEVICE:-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LOG="$OUT/log.txt"
step() {  # step NAME SECONDS CMD...: the command's output into the log, then its status and time
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo "=== $name ($(date -u +%T)): $*" | tee -a "$LOG"
    timeout "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    echo "--- $name: rc=$rc in $((SECONDS - start)) s" | tee -a "$LOG"
}
if ! "$PY" -c "import torch.distributed as d; d.all_gather_single" 2>/dev/null; then  # torch < 2.13 (a lent image's 2.11)
    export PYTHONPATH="$PWD/scripts/torch_compat:$PYTHONPATH"
    echo "torch < 2.13: 2.13's all_gather_single / reduce_scatter_single aliased (scripts/torch_compat)" | tee -a "$LOG"
fi
step nvidia-smi 20 nvidia-smi
step versions 60 "$PY" -c "import sys, torch, jax, flax, optax; print(sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, '| jax', jax.__version__, '| flax', flax.__version__, '| optax', optax.__version__)"
step doctor 90 "$PY" compare.py doctor --probe-only
step bench 120 "$PY" compare.py bench --world-size 1 --device "$DEVICE" --profile "$OUT/profile.json" \
    --json "$OUT/bench.json"
step shapes 60 "$PY" scripts/gpu_shapes.py "$OUT"
step step-check 120 "$PY" scripts/gpu_step_check.py "$OUT"
step pytest-gpu 180 env PARALLEL_TWINS_TEST_JAX_PLATFORMS=cuda,cpu "$PY" -m pytest -m gpu -o addopts=-ra -q \
    -p no:cacheprovider tests/test_gpu.py tests/test_cp.py
# issue 46: the flagship as a user types it (GPU: --size gpu, float32), cold then warm (JAX's compilation cache
# in $OUT/jax-cache, so the first is cold on any machine), its table; the harness's cost at the same sizes;
# doctor's whole run. DEVICE=cpu (the script's check on a CPU): --size tiny, so it runs in minutes.
SIZE=${SIZE:-$([ "$DEVICE" = cpu ] && echo tiny || echo gpu)}
export PARALLEL_TWINS_CACHE="$OUT/jax-cache"
rm -rf "$OUT/jax-cache"
# (the limits: the GPU's budget with room; on a 2-core CPU the cold flagship is JAX's compilation, ~5 min even at
# --size tiny: a DEVICE=cpu check at 240 s was cut at 246 s)
FLAG_LIMIT=${FLAG_LIMIT:-$([ "$DEVICE" = cpu ] && echo 600 || echo 240)}
step flagship-cold "$FLAG_LIMIT" "$PY" compare.py --device "$DEVICE" --size "$SIZE" --json "$OUT/flagship.json"
step flagship-warm "$FLAG_LIMIT" "$PY" compare.py --device "$DEVICE" --size "$SIZE" --quiet --json "$OUT/flagship_warm.json"
step overhead 300 "$PY" compare.py bench --overhead --device "$DEVICE" --size "$SIZE" --quiet --json "$OUT/overhead.json"
step doctor-full 120 "$PY" compare.py doctor
# (not on DEVICE=cpu unless SPEED=1: D=512, T=256 outlasts its 170 s on 2 CPU cores, and times nothing a GPU run needs)
[ "${SPEED:-$([ "$DEVICE" = cpu ] && echo 0 || echo 1)}" = 1 ] && step speed 170 "$PY" compare.py --world-size 1 --device "$DEVICE" --dtype bfloat16 --model transformer \
    --patterns dp,fsdp,tp,pp --layers 4 --dim 512 --seq 256 --batch 16 --microbatches 4 --vocab 1024 \
    --steps 10 --json "$OUT/speed.json"
grep -- "^--- " "$LOG"
