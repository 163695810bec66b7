#!/usr/bin/env bash
# Stops what `deploy/quickstart.sh --detach` started (SIGTERM: each process drains and exits).
#   deploy/stop.sh [--work-dir DIR]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work="$root/.cache/quickstart"
[ "${1:-}" = "--work-dir" ] && work=$2
pids="$work/pids"
[ -d "$pids" ] || { echo "stop.sh: nothing to stop ($pids does not exist)"; exit 0; }
for role in scheduler prefill decode; do # the api-server first: no new requests reach the nodes
    f="$pids/$role.pid"
    [ -f "$f" ] || continue
    pid=$(cat "$f")
    if kill "$pid" 2>/dev/null; then
        for _ in $(seq 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && { echo "stop.sh: $(basename "$f" .pid) did not exit; killing"; kill -9 "$pid"; }
        echo "stopped $(basename "$f" .pid)"
    fi
    rm -f "$f"
done
