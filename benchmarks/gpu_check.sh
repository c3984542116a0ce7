#!/usr/bin/env bash
# One prepared check of TapeSAC on a machine with one GPU (about 4 minutes), stage by stage:
#   0 versions   Python and package versions, the GPU; fails loudly on anything missing
#   1 install    pip install --no-deps --no-build-isolation . (the machine has no internet)
#   2 correctness  bitwise replay with dropout on the CUDA generators
#   2b readiness no memory left by forwards without backward, a custom op with its own dropout
#                replays bitwise, reserved memory raises the fragmentation estimate at most
#                once, the MoE example bitwise under deterministic algorithms
#   3 timing     CUDA-event node times against the wall time of the same forward
#   3b host      host time per op (no checkpointing, torch checkpoint, TapeSAC recorded and
#                steady state) beside the blocks' kernel time per op, on the ~1B model (bf16)
#   4 limit      allocator peaks of planned steps against the Controller's limit
#   4b mixed     a plan mixing plain, torch-checkpoint, attention-saving and must-only blocks (~1B)
#                (bf16): bitwise with dropout, timed against no checkpointing and torch checkpoint
#   4c offload   the ~1B model (bf16) at a limit 0.7 of the way from a step's start to must-only's
#                peak: the plan (offloading over the measured link) against full checkpointing
#                under save_on_cpu(pin_memory=True); metered peaks, bandwidths, copy time hidden
#   5 frontier   TapeSAC vs full checkpointing vs torchtitan's policy (and the others in those
#                families) on a Qwen3-style ~1B model, seq 2048, bf16
# Everything goes under one folder (first argument, default gpu_check_<date>), each stage's
# output as soon as the stage ends; a summary is printed at the end.
#
# On CPU at tiny size (what tests/test_frontier_bench.py runs):
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_SIZE=tiny GPU_CHECK_INSTALL=0 benchmarks/gpu_check.sh OUT
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-gpu_check_$(date +%Y%m%d_%H%M%S)}"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
SIZE="${GPU_CHECK_SIZE:-full}"             # full: the sizes below; tiny: seconds on a CPU
INSTALL="${GPU_CHECK_INSTALL:-1}"
PY="${PYTHON:-python}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"  # deterministic cuBLAS (stage 2b)

if [ "$SIZE" = tiny ]; then
  STAGE_SIZE=tiny
  FRONTIER=(--size tiny --steps 3 --warmup 1 --fractions 0.5,1)
  OFFLOAD=(--fraction 1.0)  # the tiny model's peak is its loss: must-only's peak, where offload gains
else
  STAGE_SIZE=small
  FRONTIER=(--size 1b --seq 2048 --batch 2 --dtype bf16 --steps 10 --warmup 2)
  OFFLOAD=(--fraction 0.7)
fi

stage() {  # stage NAME COMMAND...: run, keep its output, record pass/fail
  local name="$1"; shift
  local start=$SECONDS
  echo "=== $name: $*" | tee -a "$OUT/log.txt"
  "$@" > "$OUT/$name.out" 2>&1
  local rc=$?
  tail -n 5 "$OUT/$name.out"
  local verdict=PASS; [ $rc -ne 0 ] && verdict="FAIL (exit $rc, see $OUT/$name.out)"
  echo "$name: $verdict ($((SECONDS - start)) s)" | tee -a "$SUMMARY"
  return $rc
}

# 0. Versions first: a missing package stops everything here, clearly.
if ! stage 0_versions "$PY" -m benchmarks.gpu_stages versions --device "$DEVICE" --out "$OUT/0_versions.json"; then
  echo "gpu_check: missing packages or device, see $OUT/0_versions.out" >&2
  cat "$OUT/0_versions.out" >&2
  exit 1
fi
if [ "$INSTALL" = 1 ]; then
  # Not fatal: the stages below run from this checkout (PYTHONPATH) either way.
  stage 1_install "$PY" -m pip install --no-deps --no-build-isolation --no-index "$ROOT"
fi
stage 2_correctness "$PY" -m benchmarks.gpu_stages correctness --device "$DEVICE" --size "$STAGE_SIZE" --out "$OUT/2_correctness.json"
stage 2b_readiness "$PY" -m benchmarks.gpu_stages readiness --device "$DEVICE" --size "$STAGE_SIZE" --out "$OUT/2b_readiness.json"
stage 3_timing "$PY" -m benchmarks.gpu_stages timing --device "$DEVICE" --size "$STAGE_SIZE" --out "$OUT/3_timing.json"
stage 3b_host "$PY" -m benchmarks.gpu_stages host --device "$DEVICE" --size "$STAGE_SIZE" --out "$OUT/3b_host.json"
stage 4_limit "$PY" -m benchmarks.gpu_stages limit --device "$DEVICE" --size "$STAGE_SIZE" --out "$OUT/4_limit.json"
stage 4b_mixed "$PY" -m benchmarks.gpu_stages mixed --device "$DEVICE" --size "$STAGE_SIZE" --out "$OUT/4b_mixed.json"
stage 4c_offload "$PY" -m benchmarks.gpu_stages offload --device "$DEVICE" --size "$STAGE_SIZE" "${OFFLOAD[@]}" --out "$OUT/4c_offload.json"
stage 5_frontier "$PY" -m benchmarks.frontier --device "$DEVICE" "${FRONTIER[@]}" \
  --families none,full,torch_sac,tapesac_policy,tapesac --out-dir "$OUT/frontier" --markdown "$OUT/RESULTS.md"

echo "=== summary ($OUT)"
cat "$SUMMARY"
[ -f "$OUT/RESULTS.md" ] && grep -A40 "against each baseline" "$OUT/RESULTS.md" | head -20
! grep -q FAIL "$SUMMARY"
