#!/usr/bin/env bash
# Launches pd-prefill, pd-decode and pd-scheduler through deploy/start_servers.sh with one
# command line each (the Ascend guide's way), completes a chat request, and stops them.
# Also: `sh start_servers.sh` (dash, as the guide runs it), and that every role accepts every
# role's flags and vLLM's no-op flags (--flag value and --flag=value), each role's --help run
# through start_servers.sh after them; unknown, valueless and bad flags are refused by name.
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

# `sh start_servers.sh --help` (dash): without the ranktable variables it prints its own usage
out=$(env -u GLOBAL_RANK_TABLE_FILE_PATH -u RANK_TABLE_FILE_PATH sh "$src/deploy/start_servers.sh" --help 2>&1) ||
    fail "sh start_servers.sh --help failed: $out"
grep -q "Per-instance launcher" <<<"$out" || fail "sh start_servers.sh --help: no usage: $out"

# one command line serves every role, with vLLM's flags too: each role parses it, then --help
noop=(--disable-log-requests --disable-log-stats --trust-remote-code --use-v2-block-manager
      --disable-custom-all-reduce --revision main --load-format safetensors
      --tokenizer-mode auto --distributed-executor-backend mp)
for form in space eq; do
    if [ $form = space ]; then
        more=(--device cuda --served-model-name tiny tiny-alias --shutdown-timeout 2.5 --swap-space 16
              --enable-chunked-prefill --speculative-model [ngram] --num-speculative-tokens 5
              --ngram-prompt-lookup-max 4)
    else
        more=(--device=cuda --served-model-name=tiny --shutdown-timeout=2.5 --swap-space=16
              --no-enable-chunked-prefill
              '--speculative-config={"method":"ngram","num_speculative_tokens":3}')
    fi
    for table in 0 1 host; do
        out=$(RANK_TABLE_FILE_PATH="$work/local_ranktable_127.0.0.1_$table.json" sh "$src/deploy/start_servers.sh" \
            "${args[@]}" "${more[@]}" "${noop[@]}" --enforce-eager --api-key k --port 1 --help 2>&1) ||
            fail "role of table $table refused the common command line ($form): $out"
        grep -q "^usage: .*pd-\(scheduler\|prefill\|decode\)" <<<"$out" || fail "table $table: no --help text: $out"
        for f in --swap-space "${noop[@]}"; do
            [[ $f == --* ]] || continue # a value
            grep -q -- "$f\( [^ :]*\)\?: a vLLM flag with no effect in pdserve" <<<"$out" ||
                fail "table $table: $f not logged: $out"
        done
        [ $table = host ] || grep -q -- "--enforce-eager: CUDA graphs off" <<<"$out" ||
            fail "table $table: --enforce-eager not applied: $out"
    done
done
# --log-level applies to what parsing logs, wherever it stands on the line
for exe in scheduler/pd-scheduler prefill_node/pd-prefill decode_node/pd-decode; do
    out=$("$bin/$exe" --trust-remote-code --log-level warn --help 2>&1) || fail "$exe --log-level warn --help: $out"
    grep -q -- "a vLLM flag with no effect" <<<"$out" && fail "$exe: INFO line under --log-level warn: $out"
done
# refusals name the flag, on every executable
for exe in scheduler/pd-scheduler prefill_node/pd-prefill decode_node/pd-decode; do
    for spec in "unknown flag '--frobnicate'|--frobnicate" \
                "unknown flag '--frobnicate'|--frobnicate --port 1" \
                "--shutdown-timeout: expected a number|--shutdown-timeout abc" \
                "--shutdown-timeout: expected seconds in [0, 86400]|--shutdown-timeout=-1" \
                "--shutdown-timeout: expected seconds in [0, 86400]|--shutdown-timeout 1e9" \
                "--swap-space: expected a number|--swap-space x" \
                "got 'pt' (pdserve reads safetensors checkpoints)|--load-format pt" \
                "--disable-log-requests takes no value|--disable-log-requests=1" \
                "--enforce-eager takes no value|--enforce-eager=true"; do
        want=${spec%%|*}
        read -ra argv <<<"${spec#*|}"
        out=$("$bin/$exe" "${argv[@]}" 2>&1); st=$?
        [ $st = 2 ] || fail "$exe ${argv[*]}: exit $st, want 2: $out"
        grep -qF -- "$want" <<<"$out" || fail "$exe ${argv[*]}: want \"$want\": $out"
    done
done

# SIGTERM: every role drains and exits 0
for i in 2 0 1; do kill "${pids[$i]}"; done
for i in 0 1 2; do
    wait "${pids[$i]}"; st=$?
    [ $st = 0 ] || fail "process $i exited with $st after SIGTERM"
done
pids=()
echo "PASS start_servers: 3 roles from one command line, chat completed, sh and vLLM flags, clean shutdown"
