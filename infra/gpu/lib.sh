# Sourced by the GPU scripts (check.sh, engine.sh): `step` runs one budgeted Python step.
# The caller sets `deadline` (epoch seconds) and `log` (the file every step appends to).

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
