#!/usr/bin/env bash
# A whole train step through DeepSpeed in each engine setting, on a GPU machine that has torch
# but not this project's environment (deepspeed, pydantic, pydantic-settings, pyyaml and
# tabulate must import): `cemlab train` of Llama-134M, compiled, bf16, batch 8 x 2048, 40
# steps on CORPUS (a glob of text files), train steps 4-5 profiled, once per line of SETTINGS
# (NAME ZERO_STAGE JSON: the ZeRO stage and the --deepspeed config of that run) and, with BASE
# (another checkout of this project), once more from BASE in its default setting, first:
#
#   CORPUS='corpus/*.txt' [BASE=dir] bash infra/gpu/engine.sh [OUT_DIR] [BUDGET_S]
#
# (PRESET=nano for a dry run on a CPU.)
#
# Each run is its own process with its own time limit (lib.sh's `step`), its log in
# OUT_DIR/engine.log and its metrics in OUT_DIR/<name>-metrics.json; a table ends the output:
# the step time and tokens/s over steps 11-40, train_mfu, the profiled steps' wall and busy
# time, the peak memory and the test loss, which every setting should share.
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)
source "$here/infra/gpu/lib.sh"  # begin, step
begin "${1:-${OUT:-gpu-engine}}" "${2:-420}" engine.log
export CEMLAB_HOME=${CEMLAB_HOME:-/tmp/cemlab-home}  # one prepared corpus for every run

# DeepSpeed's own defaults for the two keys runtime.optim.deepspeed_config sets otherwise
ds_own='"bf16":{"check_grad_overflow":true},"zero_optimization":{"contiguous_gradients":true}'
SETTINGS=${SETTINGS:-"default 1 {}
deepspeed-defaults 1 {$ds_own}
zero-2 2 {}
zero-0 0 {}"}
trial=(--preset "${PRESET:-llama-134m}" --engine deepspeed --compile true --precision bf16
       --batch-size 8 --steps 40 --corpus "$CORPUS" --profile 30)

if [ -n "${BASE:-}" ]; then
  (cd "$BASE" && step before 150 orchestrator train "${trial[@]}" --zero-stage 1 \
    --metrics-json "$out/before-metrics.json")
fi
cd "$here"
while read -r name zero config; do
  [ -n "$name" ] || continue
  step "$name" 120 orchestrator train "${trial[@]}" --zero-stage "$zero" --deepspeed "$config" \
    --metrics-json "$out/$name-metrics.json"
done <<<"$SETTINGS"

python3 - "$out" <<'PY'
import json, pathlib, statistics, sys
from tabulate import tabulate
rows = []
runs = sorted(pathlib.Path(sys.argv[1]).glob("*-metrics.json"), key=lambda p: p.stat().st_mtime)
for path in runs:
    m = json.loads(path.read_text())
    h, f, p = m["history"], m["final"], m.get("profile", {})
    rate = statistics.median(h["tokens_per_s"][s] for s in ("20", "30", "40"))
    per_step = h["tokens_seen"]["40"] / 40
    rows.append({"setting": path.name.removesuffix("-metrics.json"),
                 "step_ms": 1e3 * per_step / rate,
                 "tokens_per_s": rate, "train_mfu_%": 100 * f["train_mfu"],
                 "profiled_wall_ms": p.get("wall_ms_per_step"),
                 "profiled_busy_ms": p.get("busy_ms_per_step"),
                 "peak_MiB": f["peak_memory_mib"], "test_loss": f"{f['test_loss']:.4f}"})
print(tabulate(rows, headers="keys", floatfmt=",.2f"))
PY
