# shellcheck shell=bash
# Shared by the shell integration tests (source it): a work directory removed at exit (kept
# with PD_KEEP_WORK=1), process cleanup, fail(), free_port(), and start_1p1d, which starts
# pd-prefill, pd-decode and pd-scheduler on free ports through deploy/start_servers.sh with one
# command line (the tiny synthetic model, or $model) and waits for /health (not with $no_wait
# set); stop_all stops them.
# Needs PD_SOURCE_ROOT and PD_BUILD_ROOT (set by meson's test_env).
src=${PD_SOURCE_ROOT:?} bin=${PD_BUILD_ROOT:?}
py=/usr/bin/python3
work=$(mktemp -d "${TMPDIR:-/tmp}/pdit.XXXXXX")
pids=()
cleanup_pids() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
    for p in "${pids[@]}"; do
        for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$p" 2>/dev/null
    done
}
cleanup() {
    cleanup_pids
    [ -n "${PD_KEEP_WORK:-}" ] || rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$work"/*.log; do echo "--- $f"; tail -n 15 "$f"; done; exit 1; }
free_port() { $py -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# wait_log FILE REGEX: true once FILE has a line matching REGEX (grep -E), false after 30 s.
wait_log() {
    for _ in $(seq 300); do
        grep -qE -- "$2" "$1" 2>/dev/null && return 0
        sleep 0.1
    done
    return 1
}

# Stops what was started (the pids) and forgets it, so a test can start another cluster.
stop_all() {
    cleanup_pids
    pids=()
}

# Sets pp, dp, sp (ports), args (the common command line, with start_1p1d's arguments at its
# end) and pids (prefill, decode, scheduler). The model is $model when set (made by the caller),
# else the tiny synthetic model, made here as $work/tiny. $prefill_extra and $decode_extra, when
# set, are more words for that role's command line alone; $prefill_devices and $decode_devices
# (default 0 and 1) the instances' device lists ("0,1": two ranks).
start_1p1d() {
    local m=${model:-$work/tiny}
    [ -n "${model:-}" ] || "$bin/tools/mkmodel/pd-mkmodel" --preset tiny --out "$m" >/dev/null ||
        fail "pd-mkmodel"
    local pdev=${prefill_devices:-0} ddev=${decode_devices:-1}
    "$bin/ranktable/cli/pd-ranktable" --mode gen --prefill-server-list "$pdev" \
        --decode-server-list "$ddev" --api-server --server-ip 127.0.0.1 --save-dir "$work" \
        >/dev/null || fail "pd-ranktable"
    pp=$(free_port) dp=$(free_port) sp=$(free_port)
    export GLOBAL_RANK_TABLE_FILE_PATH="$work/global_ranktable_127.0.0.1.json"
    export NODE_PORTS="$pp,$dp" USE_OPENAI=1 PD_BIN_DIR="$bin"
    # one command line for every role, as in the guide (only the port differs)
    args=(--model "$m" --tensor-parallel-size 1 --max-model-len 512 --max-num-seqs 16
          --max-num-batched-tokens 1024 --host 127.0.0.1 --served-model-name tiny --cpu-threads 1
          --kv-cache-bytes 16777216 --enable-prefix-caching "$@")
    local spec role table port
    for spec in "prefill:${pdev//,/}:$pp" "decode:${ddev//,/}:$dp" "scheduler:host:$sp"; do
        IFS=: read -r role table port <<<"$spec"
        local extra=()
        [ "$role" = prefill ] && read -ra extra <<<"${prefill_extra:-}"
        [ "$role" = decode ] && read -ra extra <<<"${decode_extra:-}"
        RANK_TABLE_FILE_PATH="$work/local_ranktable_127.0.0.1_$table.json" \
            "$src/deploy/start_servers.sh" "${args[@]}" "${extra[@]}" --port "$port" >"$work/$role.log" 2>&1 &
        pids+=($!)
    done
    [ -n "${no_wait:-}" ] && return 0
    for _ in $(seq 300); do
        [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$sp/health")" = 200 ] && return 0
        sleep 0.1
    done
    fail "/health did not become 200 within 30 s"
}
