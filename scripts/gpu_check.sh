#!/usr/bin/env bash
# One command that proves the CUDA path on a CUDA machine, in under 8 minutes, with one summary table:
#   1. the CUDA unit tests (attention backends in float32/float16/bfloat16 over contexts of several
#      blocks, the sampler on the GPU) and the CPU-side checks of the CUDA decisions;
#   2. the runner against transformers (float32 reference, teacher-forced logits) in float16 and in
#      bfloat16, on the GPU, through every attention backend installed;
#   3. flash-attn vs triton vs torch on one random paged step (max difference, time per call);
#   4. bench_offline.py on a 1B-class random-weight model (Llama-3.2-1B's shape) in bfloat16.
#
#   scripts/gpu_check.sh             run everything (logs in gpu_check_logs/, one per step)
#   scripts/gpu_check.sh --dry-run   print the plan, run nothing (works without a GPU)
#
# Each step has a time limit, and the whole run stops starting steps at GPU_CHECK_BUDGET_S
# (default 470 s); a step that did not get to run is reported as skipped. Exit code 0 only
# when every step passed.
set -uo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
LOG_DIR=${GPU_CHECK_LOG_DIR:-gpu_check_logs}
BUDGET_S=${GPU_CHECK_BUDGET_S:-470}
DRY_RUN=0
case "${1:-}" in
  --dry-run) DRY_RUN=1 ;;
  "") ;;
  *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
esac

# name | time limit (s) | command
STEPS=(
  "cuda unit tests|150|$PY -m pytest -q -p no:cacheprovider -m cuda tests/worker/test_attention.py tests/worker/test_sampler.py"
  "cuda path (cpu-side)|90|$PY -m pytest -q -p no:cacheprovider tests/worker/test_cuda_path.py"
  "reference float16|90|$PY -m pytest -q -p no:cacheprovider -m cuda tests/worker/test_half_precision_reference.py -k cuda-float16"
  "reference bfloat16|90|$PY -m pytest -q -p no:cacheprovider -m cuda tests/worker/test_half_precision_reference.py -k cuda-bfloat16"
  "attention bf16: flash/triton/torch|60|$PY scripts/compare_attention.py --dtype bfloat16 --device cuda"
  "attention fp16: flash/triton/torch|60|$PY scripts/compare_attention.py --dtype float16 --device cuda"
  "bench_offline 1b bf16|180|$PY scripts/bench_offline.py --models 1b --dtypes bfloat16 --batch-sizes 1 64 --min-prompt 128 --max-prompt 512 --output-len 128 --device cuda"
)

if [[ $DRY_RUN == 1 ]]; then
  echo "gpu_check plan (budget ${BUDGET_S} s, logs in ${LOG_DIR}/):"
  for step in "${STEPS[@]}"; do
    IFS='|' read -r name limit cmd <<< "$step"
    printf '  %-36s %4ss  %s\n' "$name" "$limit" "$cmd"
  done
  exit 0
fi

if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device visible to torch (try --dry-run to see the plan)" >&2
  exit 2
fi

mkdir -p "$LOG_DIR"
{
  nvidia-smi -L 2>/dev/null || true
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
  $PY -c "from evenflow.worker.attention.selector import flash_attn_problem as p; print('flash-attn:', p() or 'usable')"
  $PY -c "import importlib.util as u; print('triton:', 'installed' if u.find_spec('triton') else 'not installed')"
} 2>&1 | tee "$LOG_DIR/environment.log"

START=$SECONDS
RESULTS=()
FAILED=0
for i in "${!STEPS[@]}"; do
  IFS='|' read -r name limit cmd <<< "${STEPS[$i]}"
  log="$LOG_DIR/$(printf '%02d' "$i")-${name//[^a-zA-Z0-9]/_}.log"
  left=$(( BUDGET_S - (SECONDS - START) ))
  if (( left < 20 )); then
    RESULTS+=("$name|SKIPPED|0|out of the ${BUDGET_S} s budget")
    FAILED=1
    continue
  fi
  (( limit > left )) && limit=$left
  echo "== $name (limit ${limit} s): $cmd"
  t0=$SECONDS
  timeout --signal=TERM --kill-after=10 "$limit" bash -c "$cmd" > "$log" 2>&1
  rc=$?
  took=$(( SECONDS - t0 ))
  note=$(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-70)
  if (( rc == 0 )); then status=PASS; elif (( rc == 124 || rc == 137 )); then status=TIMEOUT; FAILED=1; else status=FAIL; FAILED=1; fi
  RESULTS+=("$name|$status|$took|$note")
  tail -n 15 "$log"
done

echo
echo "| step | result | seconds | last line of its log |"
echo "|---|---|--:|---|"
for row in "${RESULTS[@]}"; do
  IFS='|' read -r name status took note <<< "$row"
  echo "| $name | $status | $took | ${note//|/\\|} |"
done
echo "total $(( SECONDS - START )) s; logs in $LOG_DIR/"
exit $FAILED
