#!/usr/bin/env bash
# A GPU node the project has never seen, reporting back in one command (issue 46; docs/gpu.md "Send us your
# node"). On the node, from the repository root:
#
#   bash scripts/node_report.sh                  # every GPU of the node; MESH="dp=2,tp=2,pp=2" adds N-D layouts
#
# It runs compare.py on the GPUs (NCCL, JAX on the GPUs) and the same layout simulated on the node's CPU (gloo,
# simulated XLA devices), at the same sizes and dtype (--size cpu, float64: parity to 1e-12 on both), then
# `compare.py diff CPU GPU`: parity against both references, collectives by kind, count and bytes per op and mesh
# axis (what XLA:GPU or NCCL chose differently from XLA:CPU and gloo), state and memory. Step times compare as
# ratios within each file (the GPU's are not the CPU's). Everything lands in $OUT (default ./node_report):
# gpu.json, cpu.json, diff.md, diff.json, log.txt, and node_report.tar.gz to send (it holds no data of yours:
# the fixtures are generated from seeds; the provenance names the machine's packages, GPUs and git commit).
# DEVICE=cpu runs both sides on the CPU (the script's own check, with WORLD=2 and SIZE=tiny: a few minutes).
set -u
OUT=${OUT:-node_report}
PY=${PY:-python3}
DEVICE=${DEVICE:-gpu}
SIZE=${SIZE:-cpu}
WORLD=${WORLD:-$("$PY" -c "from shared.env import local_gpu_count; print(local_gpu_count())")}
[ "$WORLD" -ge 1 ] 2>/dev/null || { echo "node_report: no GPU visible (give WORLD=N, or DEVICE=cpu WORLD=2)"; exit 2; }
mkdir -p "$OUT"
LOG="$OUT/log.txt"
: >"$LOG"
COMMON=(--world-size "$WORLD" --size "$SIZE" --dtype float64 --quiet)
[ -n "${MESH:-}" ] && COMMON+=(--mesh "$MESH" --model transformer)
[ -n "${PATTERNS:-}" ] && COMMON+=(--patterns "$PATTERNS")
run() {  # run NAME CMD...: the command's output into the log, its status and time on the screen
    local name=$1 start=$SECONDS rc
    shift
    echo "=== $name ($(date -u +%T)): $*" | tee -a "$LOG"
    "$@" >>"$LOG" 2>&1
    rc=$?
    echo "--- $name: rc=$rc in $((SECONDS - start)) s" | tee -a "$LOG"
    return $rc
}
run gpu "$PY" compare.py --device "$DEVICE" "${COMMON[@]}" --json "$OUT/gpu.json"
run cpu "$PY" compare.py --device cpu "${COMMON[@]}" --json "$OUT/cpu.json"
# exit 1 from diff means "something differs": that is the report, not a failure of this script
run diff "$PY" compare.py diff "$OUT/cpu.json" "$OUT/gpu.json" --fail-on changed --markdown "$OUT/diff.md" \
    --json "$OUT/diff.json"
tar -czf "$OUT/node_report.tar.gz" -C "$OUT" gpu.json cpu.json diff.md diff.json log.txt 2>>"$LOG"
echo "send $OUT/node_report.tar.gz (docs/gpu.md: Send us your node)"
