#!/usr/bin/env bash
# Start the services of CEM Lab, both bound to CEMLAB_BIND_ADDRESS (default 127.0.0.1):
#   - a Ray head with token authentication (token generated into $CEMLAB_HOME/ray_auth_token),
#   - an MLflow tracking server: backend store CEMLAB_MLFLOW_BACKEND_URI (default SQLite under
#     $CEMLAB_HOME; postgresql://... on a cluster), artifacts proxied by the server (workers need
#     no storage credentials for MLflow) to $CEMLAB_STORAGE/mlartifacts, an s3:// URI when the
#     storage root is one; Host headers limited to the bind address, localhost and
#     CEMLAB_MLFLOW_ALLOWED_HOSTS (comma-separated: the names other nodes use).
# With a bind address other than loopback, this is the head node of a cluster that other hosts
# join (`cemlab join <bind>:<port> --token-file <a copy of ray_auth_token>`); Gloo is pinned to
# the interface that holds the address. The storage root (CEMLAB_STORAGE: a path, or s3://bucket/prefix with
# CEMLAB_S3_ENDPOINT_URL) is passed on to the Ray head, so jobs submitted to it use it; S3
# credentials are taken from the AWS_* environment of this script and never written to a file.
# CEMLAB_MLFLOW_AUTH=basic (for a head other hosts reach) serves MLflow's basic-auth app: every
# request but /health needs a user; the admin's password is CEMLAB_MLFLOW_ADMIN_PASSWORD or one
# generated into $CEMLAB_HOME/mlflow_admin_password (0600), users live in
# CEMLAB_MLFLOW_AUTH_DB_URI (default SQLite under $CEMLAB_HOME), and services.env carries the
# MLFLOW_TRACKING_USERNAME/PASSWORD that clients and the Ray head's workers send.
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

BIND=${CEMLAB_BIND_ADDRESS:-127.0.0.1}

# A free TCP port on $BIND (and on the other addresses given after it), preferring $1 (Ray's
# default 6379 is often Redis: never assume), and none of $TAKEN (the ports chosen before: the
# kernel may hand a just-closed ephemeral port out again, and two services on one port fail).
TAKEN=""
free_port() {
  TAKEN="$TAKEN" "$PY" - "$1" "$BIND" "${@:2}" <<'PY'
import os, socket, sys
addresses = list(dict.fromkeys(sys.argv[2:]))
taken = {int(p) for p in os.environ["TAKEN"].split()}
def free(port):
    socks = []
    try:
        for address in addresses:  # the same port on every address at once
            socks.append(socket.socket())
            socks[-1].bind((address, port))
            port = socks[-1].getsockname()[1]
        return None if port in taken else port
    except OSError:
        return None
    finally:
        for s in socks:
            s.close()
print(free(int(sys.argv[1])) or next((p for p in (free(0) for _ in range(50)) if p), None))
PY
}

wait_http() {  # url, seconds, name[, service whose process must stay alive meanwhile]
  for _ in $(seq 1 "$2"); do
    if [ -n "${4:-}" ] && ! alive "$4"; then
      echo "error: $3 exited while starting; the end of $LOGS/$4.log:" >&2
      tail -n 5 "$LOGS/$4.log" >&2
      return 1
    fi
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
# Ray's temp dir, one per home: Ray's default, /tmp/ray, is shared by every cluster on the host,
# and Ray's job supervisor points a submitted job's driver at the cluster named in its
# ray_current_cluster file, i.e. at the cluster started last on the host (another home's, or one
# since stopped), not at its own. Under /tmp and short: Ray's Unix sockets live under it (at
# most 107 bytes a path).
RAY_TEMP_DIR="/tmp/cemlab-ray-$(printf %s "$STATE" | sha256sum | cut -c1-10)"
if [ ! -s "$TOKEN" ]; then
  (umask 077 && "$PY" -c "import secrets; print(secrets.token_hex(32))" > "$TOKEN")
fi

MLFLOW_AUTH=${CEMLAB_MLFLOW_AUTH:-none}
AUTH_ARGS=()
case "$MLFLOW_AUTH" in
  none) ;;
  basic)
    ADMIN_PASSWORD_FILE="$STATE/mlflow_admin_password"
    if [ -n "${CEMLAB_MLFLOW_ADMIN_PASSWORD:-}" ]; then
      (umask 077 && printf '%s\n' "$CEMLAB_MLFLOW_ADMIN_PASSWORD" > "$ADMIN_PASSWORD_FILE")
    elif [ ! -s "$ADMIN_PASSWORD_FILE" ]; then  # kept: the auth store knows the admin by it
      (umask 077 && "$PY" -c "import secrets; print(secrets.token_urlsafe(24))" \
        > "$ADMIN_PASSWORD_FILE")
    fi
    # Owner-only: a PostgreSQL user store's URL carries its password.
    (umask 077 && cat > "$STATE/mlflow_auth.ini" <<INI
[mlflow]
default_permission = READ
database_uri = ${CEMLAB_MLFLOW_AUTH_DB_URI:-sqlite:///$STATE/mlflow_auth.db}
admin_username = admin
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
# One server worker: a cached credential check (PBKDF2 per request otherwise) is never stale.
auth_cache_ttl_seconds = 60
INI
)
    SECRET_KEY_FILE="$STATE/mlflow_flask_secret_key"  # signs the UI's CSRF tokens
    if [ ! -s "$SECRET_KEY_FILE" ]; then
      (umask 077 && "$PY" -c "import secrets; print(secrets.token_hex(32))" > "$SECRET_KEY_FILE")
    fi
    AUTH_ARGS=(--app-name basic-auth) ;;
  *) echo "error: CEMLAB_MLFLOW_AUTH must be none or basic, got '$MLFLOW_AUTH'" >&2; exit 2 ;;
esac

RAY_PORT=$(free_port "${CEMLAB_RAY_PORT:-6380}")
TAKEN="$RAY_PORT"
DASH_PORT=$(free_port "${CEMLAB_RAY_DASHBOARD_PORT:-8265}")
TAKEN="$TAKEN $DASH_PORT"
MLFLOW_PORT=$(free_port "${CEMLAB_MLFLOW_PORT:-5000}")
TAKEN="$TAKEN $MLFLOW_PORT"
# Fixed defaults of Ray that a second cluster on the machine (e.g. the tests') would collide on.
AGENT_PORT=$(free_port 52365 127.0.0.1)  # Ray's agent binds the node address and loopback
TAKEN="$TAKEN $AGENT_PORT"
CLIENT_PORT=$(free_port 10001)
MLFLOW_URI="http://$BIND:$MLFLOW_PORT"
# MLflow's backend store (any SQLAlchemy URL, e.g. postgresql://...); the ledger shares it.
BACKEND_URI="${CEMLAB_MLFLOW_BACKEND_URI:-sqlite:///$STATE/mlflow.db}"
LEDGER_URL="${CEMLAB_LEDGER_URL:-$BACKEND_URI}"
STORAGE="${CEMLAB_STORAGE:-$STATE}"
ARTIFACTS="${STORAGE%/}/mlartifacts"
ALLOWED="$BIND,$BIND:$MLFLOW_PORT,localhost,localhost:$MLFLOW_PORT,127.0.0.1:$MLFLOW_PORT"
ALLOWED="$ALLOWED${CEMLAB_MLFLOW_ALLOWED_HOSTS:+,$CEMLAB_MLFLOW_ALLOWED_HOSTS}"
# Fail here, in one line and without echoing a password, rather than in a server log. Database
# URLs travel in the environment, never on a command line (which `ps` shows to every user).
MLFLOW_BACKEND_STORE_URI="$BACKEND_URI" CEMLAB_LEDGER_URL="$LEDGER_URL" CEMLAB_STORAGE="$STORAGE" \
  "$PY" - <<'PY' || exit 2
import os
import sys
from workloads.core.reach import ServiceError, check_database
from workloads.core.storage import StorageRoot
try:
    check_database(os.environ["MLFLOW_BACKEND_STORE_URI"], "CEMLAB_MLFLOW_BACKEND_URI")
    check_database(os.environ["CEMLAB_LEDGER_URL"], "CEMLAB_LEDGER_URL")
    StorageRoot(uri=os.environ["CEMLAB_STORAGE"],
                endpoint_url=os.environ.get("CEMLAB_S3_ENDPOINT_URL") or None).check()
except ServiceError as e:
    sys.exit(f"error: {e}")
PY
LOCAL_ONLY=
GLOO_IFACE=
case "$BIND" in
  127.*|localhost) LOCAL_ONLY=1 ;;
  *) GLOO_IFACE=$("$PY" - "$BIND" <<'PY'
import sys, psutil
print(next((name for name, addrs in psutil.net_if_addrs().items()
            if any(a.address == sys.argv[1] for a in addrs)), ""))
PY
)
     [ -n "$GLOO_IFACE" ] || { echo "error: CEMLAB_BIND_ADDRESS $BIND is on no interface of this host" >&2; exit 2; } ;;
esac

# Owner-only: a PostgreSQL ledger URL carries its password.
(umask 077 && : > "$STATE/services.env.tmp")
cat > "$STATE/services.env.tmp" <<ENV
# Written by infra/local/up.sh: source this file to use the local CEM Lab services.
export CEMLAB_HOME="$STATE"
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH="$TOKEN"
export RAY_API_SERVER_ADDRESS="http://$BIND:$DASH_PORT"
export CEMLAB_RAY_GCS_ADDRESS="$BIND:$RAY_PORT"
export CEMLAB_RAY_TEMP_DIR="$RAY_TEMP_DIR"
export MLFLOW_TRACKING_URI="$MLFLOW_URI"
export CEMLAB_LEDGER_URL="$LEDGER_URL"
export CEMLAB_STORAGE="$STORAGE"
export CEMLAB_S3_ENDPOINT_URL="${CEMLAB_S3_ENDPOINT_URL:-}"
export PATH="$VENV_BIN:\$PATH"
ENV
if [ "$MLFLOW_AUTH" = basic ]; then
  cat >> "$STATE/services.env.tmp" <<ENV
export MLFLOW_TRACKING_USERNAME=admin
export MLFLOW_TRACKING_PASSWORD="$(cat "$ADMIN_PASSWORD_FILE")"
ENV
fi
if [ -n "$LOCAL_ONLY" ]; then
  # Ray resolves 127.0.0.1 to the host's address unless told this node is local-only; a node
  # that joins a cluster with this set panics, so it is written for a loopback head only.
  echo "export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" >> "$STATE/services.env.tmp"
fi
mv "$STATE/services.env.tmp" "$STATE/services.env"
# shellcheck disable=SC1091
source "$STATE/services.env"

echo "starting MLflow tracking server on $MLFLOW_URI (store: ${BACKEND_URI%%://*}, ledger too;" \
  "artifacts: $ARTIFACTS; auth: $MLFLOW_AUTH)"
(
  umask 077  # what the server creates (the auth store's password hashes) is owner-only
  export MLFLOW_S3_ENDPOINT_URL="${CEMLAB_S3_ENDPOINT_URL:-}" MLFLOW_BACKEND_STORE_URI="$BACKEND_URI"
  # No job runner: MLflow's GenAI jobs are not used here, and its three Huey consumer processes
  # cost about 16 core-seconds at every start and 0.7 GB of memory.
  export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false
  if [ "$MLFLOW_AUTH" = basic ]; then
    export MLFLOW_AUTH_CONFIG_PATH="$STATE/mlflow_auth.ini"
    export MLFLOW_AUTH_ADMIN_PASSWORD="$MLFLOW_TRACKING_PASSWORD"
    MLFLOW_FLASK_SERVER_SECRET_KEY=$(cat "$SECRET_KEY_FILE")
    export MLFLOW_FLASK_SERVER_SECRET_KEY
  fi
  exec setsid "$VENV_BIN/mlflow" server --host "$BIND" --port "$MLFLOW_PORT" --workers 1 \
    --artifacts-destination "$ARTIFACTS" --allowed-hosts "$ALLOWED" \
    ${AUTH_ARGS[@]+"${AUTH_ARGS[@]}"} > "$LOGS/mlflow.log" 2>&1 < /dev/null
) &
echo $! > "$RUN/mlflow.pid"

echo "starting Ray head on $BIND:$RAY_PORT (dashboard http://$BIND:$DASH_PORT, token auth)"
# No drain on SIGTERM (down.sh): it waits for Serve-style traffic we do not have, and a node that
# has run a job (its detached actors live on) waited out the whole 30 s.
# The log monitor, which streams workers' output to their drivers, reads every log file it holds
# open ten times a second and lists the log directory as often: it lists it every 0.5 s instead
# and moves an ended worker's files aside once 64 are open (not 200), which cuts its CPU by more
# than half on a node whose trials start and end many workers (docs/benchmarks.md).
RAY_LOG_MONITOR_MANY_FILES_THRESHOLD=0 RAY_LOG_MONITOR_MAX_OPEN_FILES=64 \
RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0 ${GLOO_IFACE:+env GLOO_SOCKET_IFNAME=$GLOO_IFACE} \
setsid "$VENV_BIN/ray" start --head --block --disable-usage-stats \
  --node-ip-address="$BIND" --port="$RAY_PORT" --temp-dir="$RAY_TEMP_DIR" \
  --dashboard-host="$BIND" --dashboard-port="$DASH_PORT" \
  --dashboard-agent-listen-port="$AGENT_PORT" --ray-client-server-port="$CLIENT_PORT" \
  --num-cpus="${CEMLAB_RAY_CPUS:-$(nproc)}" --object-store-memory=$((1024 * 1024 * 1024)) \
  > "$LOGS/ray.log" 2>&1 < /dev/null &
echo $! > "$RUN/ray.pid"

# A service that does not come up takes the others down with it: nothing is left running.
trap '"$(dirname "${BASH_SOURCE[0]}")/down.sh" >&2' ERR
wait_http "$MLFLOW_URI/health" 120 "MLflow" mlflow
wait_http "http://$BIND:$DASH_PORT/api/version" 120 "the Ray dashboard" ray
# Jobs are handed to the node's dashboard agent: submitting before it listens fails.
wait_http "http://$BIND:$AGENT_PORT/" 120 "the Ray dashboard agent"
echo "services up: source $STATE/services.env"
