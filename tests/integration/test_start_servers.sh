#!/usr/bin/env bash
# Launches pd-prefill, pd-decode and pd-scheduler through deploy/start_servers.sh with one
# command line each (the Ascend guide's way), completes a chat request, and stops them.
# Bounded in time; stops everything it started; exit 0 = pass.
set -uo pipefail
src=${PD_SOURCE_ROOT:?} bin=${PD_BUILD_ROOT:?}
work=$(mktemp -d "${TMPDIR:-/tmp}/pdss.XXXXXX")
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
    for p in "${pids[@]}"; do
        for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$p" 2>/dev/null
    done
    rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$work"/*.log; do echo "--- $f"; tail -n 15 "$f"; done; exit 1; }
free_port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

"$bin/tools/mkmodel/pd-mkmodel" --preset tiny --out "$work/tiny" >/dev/null || fail "pd-mkmodel"
"$bin/ranktable/cli/pd-ranktable" --mode gen --prefill-server-list 0 --decode-server-list 1 \
    --api-server --server-ip 127.0.0.1 --save-dir "$work" >/dev/null || fail "pd-ranktable"
pp=$(free_port) dp=$(free_port) sp=$(free_port)
export GLOBAL_RANK_TABLE_FILE_PATH="$work/global_ranktable_127.0.0.1.json"
export NODE_PORTS="$pp,$dp" USE_OPENAI=1 PD_BIN_DIR="$bin"
# one command line for every role, as in the guide (only the port differs)
args=(--model "$work/tiny" --tensor-parallel-size 1 --max-model-len 512 --max-num-seqs 16
      --max-num-batched-tokens 1024 --host 127.0.0.1 --served-model-name tiny --cpu-threads 1
      --kv-cache-bytes 16777216)
for spec in "prefill:0:$pp" "decode:1:$dp" "scheduler:host:$sp"; do
    IFS=: read -r role table port <<<"$spec"
    RANK_TABLE_FILE_PATH="$work/local_ranktable_127.0.0.1_$table.json" \
        "$src/deploy/start_servers.sh" "${args[@]}" --port "$port" >"$work/$role.log" 2>&1 &
    pids+=($!)
done

ok=0
for _ in $(seq 300); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$sp/health")" = 200 ] && { ok=1; break; }
    sleep 0.1
done
[ $ok = 1 ] || fail "/health did not become 200 within 30 s"
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
