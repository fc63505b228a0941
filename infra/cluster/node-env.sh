# Environment of a CEM Lab node started by the Ray cluster launcher (infra/cluster/*.yaml).
#
# Sourced, never executed, inside the node's container: by the head and worker start commands
# right before `ray start` (so the raylet, every Ray worker and every job driver inherit it) and
# from ~/.bashrc (for `ray exec` and `ray attach`). Reads the directory CEMLAB_CLUSTER_DIR
# (default /home/ray/.cemlab-cluster, the file_mounts target of ~/.cemlab-cluster on the machine
# that ran `ray up`), which holds
#   auth_token   the cluster's Ray token (`ray get-auth-token --generate`), and
#   cemlab.env   KEY=value lines: CEMLAB_STORAGE, MLFLOW_TRACKING_URI, CEMLAB_LEDGER_URL and the
#                storage credentials (infra/cluster/cemlab.env.example).
# Returns non-zero, so that `. node-env.sh && ray start ...` starts nothing, when one of them is
# missing, or when the tracking server or the ledger resolves to this node's loopback: a worker
# on another node could never reach it.

cemlab_dir="${CEMLAB_CLUSTER_DIR:-/home/ray/.cemlab-cluster}"
if [ ! -s "$cemlab_dir/auth_token" ] || [ ! -s "$cemlab_dir/cemlab.env" ]; then
  echo "node-env: $cemlab_dir must hold auth_token and cemlab.env (docs/deploy.md)" >&2
  return 1
fi

set -a
# shellcheck disable=SC1091
. "$cemlab_dir/cemlab.env"
set +a

# Token authentication on every node, with the one token that `ray up` synced here.
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH="$cemlab_dir/auth_token"
# A switch for single-machine setups (infra/local): it must never reach a cluster node.
unset RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER

for var in CEMLAB_STORAGE MLFLOW_TRACKING_URI CEMLAB_LEDGER_URL; do
  if [ -z "${!var:-}" ]; then
    echo "node-env: $var is not set in $cemlab_dir/cemlab.env" >&2
    return 1
  fi
done

# Gloo and NCCL pick their network interface from the hostname, which in a container can resolve
# to loopback: pin both to the interface of the default route (no iproute2 needed).
cemlab_iface=$(awk '$2 == "00000000" { print $1; exit }' "${CEMLAB_ROUTE_TABLE:-/proc/net/route}")
if [ -z "$cemlab_iface" ]; then
  echo "node-env: no default route, cannot choose GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME" >&2
  return 1
fi
export GLOO_SOCKET_IFNAME="$cemlab_iface" NCCL_SOCKET_IFNAME="$cemlab_iface"

python - <<'PY' || return 1
import ipaddress
import os
import socket
import sys
from urllib.parse import urlsplit

problems = []
for var in ("MLFLOW_TRACKING_URI", "CEMLAB_LEDGER_URL"):
    host = urlsplit(os.environ[var]).hostname
    if not host:
        problems.append(f"{var} names no host")
        continue
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError as error:
        problems.append(f"{var}: cannot resolve {host} ({error})")
        continue
    if any(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        problems.append(f"{var}: {host} is this node's loopback, unreachable from other nodes")
for problem in problems:
    print(f"node-env: {problem}", file=sys.stderr)
sys.exit(1 if problems else 0)
PY
