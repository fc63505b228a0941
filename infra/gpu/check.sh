#!/usr/bin/env bash
# The GPU checks (docs/benchmarks.md) as one run on a GPU machine that has torch, Triton,
# pytest, scipy and tabulate but not this project's environment: the GPU tests (compiled
# FlexAttention, the profile's kernel count), one CEM attention kernel call by how it reads the
# shared scores (workloads.lm.attention_bench), the bench of cem-134m and Llama-134M compiled
# (with their 30 longest kernels), a trial through DeepSpeed in this process (`cemlab train`,
# where deepspeed, pydantic, pydantic-settings and pyyaml import; with the profile of two whole
# train steps, optimizer included), then the eager bench of both models:
#
#   bash infra/gpu/check.sh [OUT_DIR] [BUDGET_S]    (PRESET=nano for a dry run on a CPU)
#
# Each step is its own process with its own time limit, taken from what is left of BUDGET_S
# (default 540), so a step that hangs or fails costs only itself: a step cut off dumps every
# thread's stack (faulthandler) into the log, to show where its time went. Steps run in order
# of worth, and one that would get under 30 s is skipped. Logs and each bench's JSON go to
# OUT_DIR (default $OUT, else ./gpu-check); a summary table ends the output. The trial trains
# on CORPUS (a glob of text files; default the embedded Shakespeare, which a machine without
# a network cannot fetch).
set -u
source "$(dirname "$0")/lib.sh"  # begin, step
begin "${1:-${OUT:-gpu-check}}" "${2:-540}" check.log

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm \
    --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee -a "$log"

left=$((deadline - $(date +%s)))
echo "== the GPU tests: compiled FlexAttention, the kernel count (limit 180 s)" | tee -a "$log"
timeout -s KILL $((left < 180 ? left : 180)) python3 -m pytest -q -p no:cacheprovider \
  tests/workloads/models/test_cem_theory.py tests/workloads/runtime/test_timing.py \
  -k "compiled_flex or each_kernel" >>"$log" 2>&1
echo "== test: exit $?" | tee -a "$log"

step attention 150 workloads.lm.attention_bench --preset "${PRESET:-llama-134m}" \
  --json-out "$out/attention.json"
bench=(--preset "${PRESET:-llama-134m}" --precision bf16 --rounds 1 --seconds 3)
step cem-134m-compiled 200 workloads.lm.step_bench "${bench[@]}" --variants "cem-best T=2" --compile \
  --profile 30 --json-out "$out/cem-134m-compiled.json"
step llama-compiled 90 workloads.lm.step_bench "${bench[@]}" --variants llama --compile --profile 30 \
  --json-out "$out/llama-compiled.json"
if python3 -c "import deepspeed, pydantic, pydantic_settings, yaml" 2>/dev/null; then
  corpus=()
  [ -n "${CORPUS:-}" ] && corpus=(--corpus "$CORPUS")
  step trial-deepspeed 150 orchestrator train --preset "${PRESET:-llama-134m}" --engine deepspeed \
    --zero-stage 1 --compile true --precision bf16 --batch-size 8 --steps 40 "${corpus[@]}" \
    --profile 30 --metrics-json "$out/trial-deepspeed-metrics.json"
else
  echo "== trial-deepspeed: skipped, deepspeed, pydantic(-settings) or yaml does not import" | tee -a "$log"
fi
step eager 120 workloads.lm.step_bench "${bench[@]}" --variants "llama,cem-best T=2" \
  --json-out "$out/eager.json"

python3 - "$out" <<'EOF'
import json, pathlib, sys
from tabulate import tabulate
rows = []
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    if path.stem.endswith("-metrics") or path.stem == "attention":  # not model rows
        continue
    for row in json.loads(path.read_text()):
        rows.append({"run": path.stem, "variant": row["variant"], "step_ms": row["step_ms"],
                     "tokens_per_s": row["tokens_per_s"], "TFLOP/s": row["gflops_per_s"] / 1e3,
                     "mfu_%": 100 * row["mfu"], "peak_MiB": row["peak_memory_mib"],
                     "first_step_s": row["first_step_s"]})
print(tabulate(rows, headers="keys", floatfmt=",.1f"))
EOF
