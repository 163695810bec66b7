#!/usr/bin/env bash
# Launches pd-prefill, pd-decode and pd-scheduler through deploy/start_servers.sh with one
# command line each (the Ascend guide's way), completes a chat request, and stops them.
# Bounded in time; stops everything it started; exit 0 = pass.
set -uo pipefail
# shellcheck source=tests/integration/lib_cluster.sh
. "$(dirname "$0")/lib_cluster.sh"
start_1p1d
reply=$(curl -s -m 30 "http://127.0.0.1:$sp/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"model":"tiny","messages":[{"role":"user","content":"Hello"}],"max_tokens":8,"temperature":0}')
/usr/bin/python3 - "$reply" <<'PY' || fail "bad chat reply: $reply"
import json, sys
r = json.loads(sys.argv[1])
assert r["object"] == "chat.completion", r
assert r["usage"]["completion_tokens"] == 8, r["usage"]
assert r["choices"][0]["finish_reason"] == "length"
PY

# a table that matches no instance is refused with a clear message
echo '{"version":"1.0","status":"completed","group_id":"0","server_count":"1","server_list":[{"server_id":"9.9.9.9","server_ip":"9.9.9.9","device":[{"device_id":"7","device_ip":"9.9.9.9","rank_id":"0"}]}]}' >"$work/stray.json"
out=$(RANK_TABLE_FILE_PATH="$work/stray.json" "$src/deploy/start_servers.sh" "${args[@]}" --port 1 2>&1) && fail "stray table accepted"
grep -q "does not match an instance" <<<"$out" || fail "unclear message for a stray table: $out"

# SIGTERM: every role drains and exits 0
for i in 2 0 1; do kill "${pids[$i]}"; done
for i in 0 1 2; do
    wait "${pids[$i]}"; st=$?
    [ $st = 0 ] || fail "process $i exited with $st after SIGTERM"
done
pids=()
echo "PASS start_servers: 3 roles from one command line, chat completed, clean shutdown"
