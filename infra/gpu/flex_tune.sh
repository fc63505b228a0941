#!/usr/bin/env bash
# FlexAttention's tuning options for CEM attention on a GPU machine (torch, Triton, pytest,
# tabulate; not this project's environment), as one budgeted run:
#
#   bash infra/gpu/flex_tune.sh [OUT_DIR] [BUDGET_S]     (PRESET=nano for a smaller model)
#
# 1. `attention_bench --sweep`: one kernel call under each candidate set of options (and the
#    floors: SDPA flash and cuDNN, FlexAttention without a score_mod), the fastest set written
#    to OUT_DIR/best.json;
# 2. the GPU tests of the compiled kernel under that set (outputs and gradients against the
#    explicit path), through CEMLAB_FLEX_KERNEL_OPTIONS;
# 3. the compiled CEM-134M step under that set, with its 30 longest kernels, then under the
#    default options.
# Each step is lib.sh's `step` (its own process and time limit out of BUDGET_S, default 540);
# logs and JSON go to OUT_DIR (default $OUT, else ./gpu-flex-tune).
set -u
source "$(dirname "$0")/lib.sh"  # begin, step
begin "${1:-${OUT:-gpu-flex-tune}}" "${2:-540}" tune.log

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$log"
step sweep 270 workloads.lm.attention_bench --preset "${PRESET:-cem-134m}" --sweep \
  --json-out "$out/sweep.json" --best-out "$out/best.json"
best=$(cat "$out/best.json" 2>/dev/null || echo '{}')
echo "== options: $best" | tee -a "$log"
left=$((deadline - $(date +%s)))
if [ "$best" != '{}' ] && [ "$left" -gt 60 ]; then
  echo "== the GPU tests under these options" | tee -a "$log"
  CEMLAB_FLEX_KERNEL_OPTIONS=$best timeout -s KILL $((left < 90 ? left : 90)) python3 -m pytest \
    -q -p no:cacheprovider tests/workloads/models/test_cem_theory.py -k compiled_flex >>"$log" 2>&1
  echo "== test: exit $?" | tee -a "$log"
fi
bench=(--preset "${PRESET:-llama-134m}" --precision bf16 --rounds 1 --seconds 3 --compile
       --variants "cem-best T=2")
[ "$best" != "{}" ] && (export CEMLAB_FLEX_KERNEL_OPTIONS=$best; step tuned 180 workloads.lm.step_bench \
  "${bench[@]}" --profile 30 --json-out "$out/cem-134m-tuned.json")
step default 150 workloads.lm.step_bench "${bench[@]}" --json-out "$out/cem-134m-default.json"
grep -h "^\[bench_attention\]\|fastest kernel options\|passed\|failed" "$log" | tail -30
python3 - "$out" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("cem-134m-*.json")):
    for row in json.loads(path.read_text()):
        print(path.stem, f"{row['step_ms']:.2f} ms", f"MFU {100 * row['mfu']:.1f} %",
              f"{row['peak_memory_mib']:,.0f} MiB", f"first step {row['first_step_s']:.0f} s")
PY
