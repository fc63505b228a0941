#!/usr/bin/env bash
# The Triton CEM attention kernel (CEMAttention.kernel: triton; docs/benchmarks.md, "The Triton
# CEM attention kernel") on a GPU machine, as one budgeted run, steps in order of worth:
#
#   tests          its quick tests on CUDA tensors (tests/workloads/models/test_cem_triton.py
#                  -k cuda -m "not slow": one small shape against the math kernel in fp32 and
#                  bf16, causality, the layer compiled and under autocast), 120 s at most
#   attention      one attention call at CEM-134M's sizes (workloads.lm.attention_bench): the
#                  Triton kernel, with and without c, against the whole FlexAttention path
#   cem-compiled   step_bench's CEM-134M (cem-best T=2), compiled, bf16, on the Triton kernel,
#                  with its 30 longest kernels
#   llama-compiled step_bench's Llama-134M, compiled, bf16
#   tests-slow     the rest of its tests on CUDA tensors (every shape, T and KQ-diagonal mode)
#   grid           a four-trial Ray Tune grid of CEM-134M on the Triton kernel (four learning
#                  rates, 40 steps of 8 x 2048 tokens each, DeepSpeed ZeRO-1, compiled, bf16)
#                  through `cemlab run`, on CORPUS; it first installs what the trial stack
#                  lacks (ray, deepspeed, mlflow, ...: from STACK, a tarball that
#                  infra/gpu/pack_stack.sh makes, which also gives CORPUS its default; else
#                  from WHEELS, a folder of wheels; else from the package index) and is
#                  skipped, saying why, when that fails or CORPUS is unset
#   eager          step_bench's CEM-134M on the Triton kernel and Llama-134M, eager
#
#   CORPUS='corpus/*.txt' [STACK=stack.tar.xz | WHEELS=dir] [STEPS=tests,attention,...] \
#     bash infra/gpu/triton_check.sh [OUT_DIR] [BUDGET_S]
#
# (PRESET=nano PRECISION=fp32 STEPS=cem-compiled,llama-compiled,eager: a dry run of the
# benches; on a CPU the Triton kernel needs TRITON_INTERPRET=1.) Each step is its own process
# with its own time limit, cut to what is left of BUDGET_S (default 570); one that would get
# under 30 s is skipped. Logs and each bench's JSON go to OUT_DIR (default $OUT, else
# ./gpu-triton); a summary table ends the output. On a machine without a package index, the
# trial stack must be on the machine before the grid: STACK (about 45 MB) or WHEELS.
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
source "$here/infra/gpu/lib.sh"  # begin, step
begin "${1:-${OUT:-gpu-triton}}" "${2:-570}" triton.log
cd "$here"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
export CEMLAB_HOME=${CEMLAB_HOME:-/tmp/cemlab-home}
steps=",${STEPS:-tests,attention,cem-compiled,llama-compiled,tests-slow,grid,eager},"
wants() { [[ $steps == *",$1,"* ]]; }
preset=${PRESET:-llama-134m}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee -a "$log"

tests=(-q -p no:cacheprovider -k cuda tests/workloads/models/test_cem_triton.py)  # on CUDA tensors
wants tests && step tests 120 pytest "${tests[@]}" -m "not slow"
wants attention && step attention 120 workloads.lm.attention_bench --preset "cem-${preset#*-}" \
  --cases "alibi_flex_attention,Triton kernel,Triton kernel (no shared scores)" \
  --json-out "$out/attention.json"
bench=(--preset "$preset" --precision "${PRECISION:-bf16}" --rounds 1 --seconds 3)
wants cem-compiled && step cem-compiled 200 workloads.lm.step_bench --cem-kernel triton "${bench[@]}" \
  --variants "cem-best T=2" --compile --profile 30 --json-out "$out/cem-compiled.json"
wants llama-compiled && step llama-compiled 90 workloads.lm.step_bench "${bench[@]}" \
  --variants llama --compile --json-out "$out/llama-compiled.json"

wants tests-slow && step tests-slow 240 pytest "${tests[@]}" -m slow

install_trial_stack() {  # makes the trial stack importable (STACK, else pip); 0 when all of it imports
  local check="import ray.tune, ray.train, deepspeed, mlflow, pydantic, pydantic_settings, yaml"
  check+=", sqlalchemy, alembic, tokenizers, pyarrow, pandas, scipy, safetensors, tabulate"
  python3 -c "$check" 2>/dev/null && return 0
  if [ -n "${STACK:-}" ]; then  # pack_stack.sh's site folder and corpus
    echo "== unpacking the trial stack ($STACK)" | tee -a "$log"
    mkdir -p /tmp/cemlab-stack && tar -xJf "$STACK" -C /tmp/cemlab-stack || return 1
    export PYTHONPATH="$PYTHONPATH:/tmp/cemlab-stack/site"
    python3 -c "$check" >>"$log" 2>&1
    return
  fi
  # Keep the machine's torch and Triton: a dependency's torch range must not replace them.
  python3 -c "import torch, triton
print(f'torch=={torch.__version__}\ntriton=={triton.__version__}')" >"$out/constraints.txt"
  local source=(--retries 1 --timeout 20)
  [ -n "${WHEELS:-}" ] && source=(--no-index --find-links "$WHEELS")
  echo "== installing the trial stack (${WHEELS:-package index})" | tee -a "$log"
  timeout -s KILL 240 python3 -m pip install -q "${source[@]}" -c "$out/constraints.txt" \
    "ray[default,train,tune]>=2.50" "deepspeed>=0.17" "mlflow>=3.0" "alembic>=1.20" \
    "sqlalchemy>=2.0" "pydantic>=2.7" "pydantic-settings>=2.4" pyyaml tokenizers pyarrow pandas \
    scipy safetensors tabulate >>"$log" 2>&1
  python3 -c "$check" >>"$log" 2>&1
}

if wants grid; then
  [ -n "${STACK:-}" ] && CORPUS=${CORPUS:-/tmp/cemlab-stack/corpus/*.txt}
  if [ -z "${CORPUS:-}" ]; then
    echo "== grid: skipped, CORPUS (a glob of text files) is unset" | tee -a "$log"
  elif ! install_trial_stack; then
    echo "== grid: skipped, the trial stack does not import (see $log)" | tee -a "$log"
  else
    spec="$out/cem-134m-triton-grid.yaml"
    resources="{num_workers: 1, cpus_per_worker: 8, use_gpu: true, gpu_memory_gb: 80,
            memory_per_worker_gb: 16}"
    nvidia-smi -L >/dev/null 2>&1 || resources="{num_workers: 1, cpus_per_worker: 1}"  # dry run
    cat >"$spec" <<EOF
name: cem-134m-triton-grid
description: CEM-134M on the Triton attention kernel, four learning rates, 40 steps each
data:
  source: text_files
  paths: "$CORPUS"
  vocab_size: 32000
sizes: [$preset]
variants:
  cem-best: {attention: cem, mlp: cem, attn_steps: 2, mlp_steps: 2, kq_diag: shared,
             attn_preconditioner: diag_lowrank, mlp_preconditioner: diag_lowrank}
learning_rates: [0.001, 0.002, 0.004, 0.008]
budget:
  tokens: 655360
training:
  batch_size: 8
  micro_batch_size: 8
  eval_interval: 20
  eval_sequences: 16
engine:
  zero_stage: 1
  precision: ${PRECISION:-bf16}
  compile: true
resources: $resources
EOF
    CEMLAB_CEM_KERNEL=triton step grid 360 orchestrator run "$spec"
    step grid-status 30 orchestrator status "$spec"
  fi
fi

wants eager && step eager 120 workloads.lm.step_bench --cem-kernel triton \
  "${bench[@]}" --variants "llama,cem-best T=2" --json-out "$out/eager.json"

python3 - "$out" <<'PY'
import json, pathlib, sys
from tabulate import tabulate
rows = []
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    if path.stem == "attention":  # not model rows
        continue
    for row in json.loads(path.read_text()):
        rows.append({"run": path.stem, "variant": row["variant"], "step_ms": row["step_ms"],
                     "tokens_per_s": row["tokens_per_s"], "mfu_%": 100 * row["mfu"],
                     "peak_MiB": row["peak_memory_mib"], "first_step_s": row["first_step_s"]})
print(tabulate(rows, headers="keys", floatfmt=",.1f"))
PY
