#!/usr/bin/env bash
# Stops what `deploy/quickstart.sh --detach` started (SIGTERM: each process drains and exits).
#   deploy/stop.sh [--work-dir DIR]
[ -n "${BASH_VERSION:-}" ] || exec bash "$0" "$@" # `sh stop.sh` (dash) re-runs under bash
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work="$root/.cache/quickstart"
case "${1:-}" in
-h|--help) sed -n '2,3p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
--work-dir) work=$2 ;;
esac
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
