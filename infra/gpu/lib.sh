# Sourced by the GPU scripts (check.sh, engine.sh, flex_tune.sh, triton_check.sh): `begin` sets up a
# budgeted run, `step` runs one budgeted Python step of it.

begin() {  # begin OUT_DIR BUDGET_S LOG_NAME: sets out (made, absolute), deadline (epoch s), log
  out=$(realpath -m "$1")
  mkdir -p "$out"
  deadline=$(($(date +%s) + $2))
  log="$out/$3"
  export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/cemlab-inductor}
}

step() {  # step NAME LIMIT_S MODULE ARGS...: python -m MODULE ARGS, cut off at LIMIT_S or the budget
  local name=$1 limit=$2 module=$3 left
  shift 3
  left=$((deadline - $(date +%s)))
  if [ "$left" -lt 30 ]; then
    echo "== $name: skipped, ${left} s of the budget left" | tee -a "$log"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit} s): python -m $module $*" | tee -a "$log"
  local began=$(date +%s)
  timeout -s KILL $((limit + 10)) python3 -c "
import faulthandler, runpy, sys
faulthandler.dump_traceback_later($limit, exit=True)
sys.argv = ['$module'] + sys.argv[1:]
runpy.run_module('$module', run_name='__main__')
" "$@" >>"$log" 2>&1
  echo "== $name: exit $?, $(($(date +%s) - began)) s" | tee -a "$log"
}
