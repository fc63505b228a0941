#!/usr/bin/env bash
# Stop exactly the services infra/local/up.sh started (by their PID files and process groups).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
STATE=${CEMLAB_HOME:-$ROOT/.cemlab}
RUN="$STATE/run"

gone() {  # pid -p|-g: wait up to 20 s (0.5 s steps) until the process (-p) or process
          # group (-g) is gone; true when it is
  for _ in $(seq 1 40); do
    if [ "$2" = -g ]; then pgrep -g "$1" >/dev/null 2>&1 || return 0
    else kill -0 "$1" 2>/dev/null || return 0; fi
    sleep 0.5
  done
  return 1
}

stop() {  # name [leader]: SIGTERM the process group (with "leader": its leader first, then what
          # it left), wait up to 20 s, then SIGKILL what is left and wait (up to 20 s) for the
          # kernel to remove it
  local pidfile="$RUN/$1.pid" pid
  [ -s "$pidfile" ] || return 0
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    echo "stopping $1 (process group $pid)"
    if [ "${2:-}" = leader ]; then
      kill -TERM "$pid" 2>/dev/null
      gone "$pid" -p
    fi
    kill -TERM -- "-$pid" 2>/dev/null
    gone "$pid" -g || { kill -KILL -- "-$pid" 2>/dev/null; gone "$pid" -g; }
  fi
  rm -f "$pidfile"
}

# `ray start --block` stops its own processes on SIGTERM (up.sh turns its drain off); a SIGTERM
# to the whole group left it, the GCS and the autoscaler monitor waiting on one another until
# the SIGKILL 20 s later. The MLflow server's leader takes longer to stop alone (7 s) than with
# its workers (2 s).
stop ray leader
stop mlflow
rm -f "$STATE/services.env"
