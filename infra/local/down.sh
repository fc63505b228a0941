#!/usr/bin/env bash
# Stop exactly the services infra/local/up.sh started (by their PID files and process groups).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
STATE=${CEMLAB_HOME:-$ROOT/.cemlab}
RUN="$STATE/run"

stop() {  # name: SIGTERM the process group, wait up to 20 s, then SIGKILL what is left and
          # wait (up to 10 s) until the kernel has removed it
  local pidfile="$RUN/$1.pid" pid
  [ -s "$pidfile" ] || return 0
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    echo "stopping $1 (process group $pid)"
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 1 40); do
      pgrep -g "$pid" >/dev/null 2>&1 || break
      sleep 0.5
    done
    kill -KILL -- "-$pid" 2>/dev/null || true
    for _ in $(seq 1 20); do
      pgrep -g "$pid" >/dev/null 2>&1 || kill -0 "$pid" 2>/dev/null || break
      sleep 0.5
    done
  fi
  rm -f "$pidfile"
}

stop ray
stop mlflow
rm -f "$STATE/services.env"
