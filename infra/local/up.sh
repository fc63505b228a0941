#!/usr/bin/env bash
# Start the local services of CEM Lab, both bound to 127.0.0.1:
#   - a Ray head with token authentication (token generated into $CEMLAB_HOME/ray_auth_token),
#   - an MLflow tracking server with a SQLite backend store under $CEMLAB_HOME.
# The storage root (CEMLAB_STORAGE: a path, or s3://bucket/prefix with CEMLAB_S3_ENDPOINT_URL) is
# passed on to the Ray head, so jobs submitted to it use it; S3 credentials are taken from the
# AWS_* environment of this script and never written to a file.
# Writes $CEMLAB_HOME/services.env (source it to talk to them) and one PID file per service, so
# that down.sh stops exactly what this started. Idempotent: running services are left alone.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
STATE=${CEMLAB_HOME:-$ROOT/.cemlab}
mkdir -p "$STATE"
STATE=$(cd "$STATE" && pwd)
VENV_BIN=${VENV_BIN:-$ROOT/.venv/bin}
PY="$VENV_BIN/python"
RUN="$STATE/run"
LOGS="$STATE/logs"
mkdir -p "$RUN" "$LOGS"

alive() { [ -s "$RUN/$1.pid" ] && kill -0 "$(cat "$RUN/$1.pid")" 2>/dev/null; }

# A free TCP port on 127.0.0.1, preferring $1 (Ray's default 6379 is often Redis: never assume).
free_port() {
  "$PY" - "$1" <<'PY'
import socket, sys
def free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return s.getsockname()[1]
        except OSError:
            return None
print(free(int(sys.argv[1])) or free(0))
PY
}

wait_http() {  # url, seconds, name
  for _ in $(seq 1 "$2"); do
    # Any HTTP answer counts (the Ray dashboard answers 401 without the token).
    if "$PY" - "$1" 2>/dev/null <<'PY'; then return 0; fi
import sys, urllib.error, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=2)
except urllib.error.HTTPError:
    pass
PY
    sleep 1
  done
  echo "error: $3 did not answer at $1 within $2 s (log: $LOGS)" >&2
  return 1
}

if alive ray && alive mlflow && [ -s "$STATE/services.env" ]; then
  echo "services already running ($STATE/services.env)"
  exit 0
fi
"$(dirname "${BASH_SOURCE[0]}")/down.sh" >/dev/null 2>&1 || true

TOKEN="$STATE/ray_auth_token"
if [ ! -s "$TOKEN" ]; then
  (umask 077 && "$PY" -c "import secrets; print(secrets.token_hex(32))" > "$TOKEN")
fi

RAY_PORT=$(free_port "${CEMLAB_RAY_PORT:-6380}")
DASH_PORT=$(free_port "${CEMLAB_RAY_DASHBOARD_PORT:-8265}")
MLFLOW_PORT=$(free_port "${CEMLAB_MLFLOW_PORT:-5000}")
# Fixed defaults of Ray that a second cluster on the machine (e.g. the tests') would collide on.
AGENT_PORT=$(free_port 52365)
CLIENT_PORT=$(free_port 10001)
MLFLOW_URI="http://127.0.0.1:$MLFLOW_PORT"
# MLflow's backend store (any SQLAlchemy URL, e.g. postgresql://...); the ledger shares it.
BACKEND_URI="${CEMLAB_MLFLOW_BACKEND_URI:-sqlite:///$STATE/mlflow.db}"
LEDGER_URL="${CEMLAB_LEDGER_URL:-$BACKEND_URI}"

cat > "$STATE/services.env.tmp" <<ENV
# Written by infra/local/up.sh: source this file to use the local CEM Lab services.
export CEMLAB_HOME="$STATE"
# Ray resolves 127.0.0.1 to the host's address unless told this node is local-only.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH="$TOKEN"
export RAY_API_SERVER_ADDRESS="http://127.0.0.1:$DASH_PORT"
export CEMLAB_RAY_GCS_ADDRESS="127.0.0.1:$RAY_PORT"
export MLFLOW_TRACKING_URI="$MLFLOW_URI"
export CEMLAB_LEDGER_URL="$LEDGER_URL"
export CEMLAB_STORAGE="${CEMLAB_STORAGE:-$STATE}"
export CEMLAB_S3_ENDPOINT_URL="${CEMLAB_S3_ENDPOINT_URL:-}"
export PATH="$VENV_BIN:\$PATH"
ENV
mv "$STATE/services.env.tmp" "$STATE/services.env"
# shellcheck disable=SC1091
source "$STATE/services.env"

echo "starting MLflow tracking server on $MLFLOW_URI (store: ${BACKEND_URI%%://*}, ledger too)"
setsid "$VENV_BIN/mlflow" server --host 127.0.0.1 --port "$MLFLOW_PORT" --workers 1 \
  --backend-store-uri "$BACKEND_URI" \
  --artifacts-destination "$STATE/mlartifacts" \
  > "$LOGS/mlflow.log" 2>&1 < /dev/null &
echo $! > "$RUN/mlflow.pid"

echo "starting Ray head on 127.0.0.1:$RAY_PORT (dashboard http://127.0.0.1:$DASH_PORT, token auth)"
setsid "$VENV_BIN/ray" start --head --block --disable-usage-stats \
  --node-ip-address=127.0.0.1 --port="$RAY_PORT" \
  --dashboard-host=127.0.0.1 --dashboard-port="$DASH_PORT" \
  --dashboard-agent-listen-port="$AGENT_PORT" --ray-client-server-port="$CLIENT_PORT" \
  --num-cpus="${CEMLAB_RAY_CPUS:-$(nproc)}" --object-store-memory=$((1024 * 1024 * 1024)) \
  > "$LOGS/ray.log" 2>&1 < /dev/null &
echo $! > "$RUN/ray.pid"

wait_http "$MLFLOW_URI/health" 120 "MLflow"
wait_http "http://127.0.0.1:$DASH_PORT/api/version" 120 "the Ray dashboard"
# Jobs are handed to the node's dashboard agent: submitting before it listens fails.
wait_http "http://127.0.0.1:$AGENT_PORT/" 120 "the Ray dashboard agent"
echo "services up: source $STATE/services.env"
