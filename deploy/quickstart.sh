#!/usr/bin/env bash
# README command 1: installs dependencies, builds, makes the `tiny` synthetic model (or serves
# --model DIR), generates ranktables for 1 prefill + 1 decode on 127.0.0.1, starts pd-prefill,
# pd-decode and pd-scheduler through deploy/start_servers.sh, waits for /health, sends one chat
# request and prints the answer. Then it keeps serving in the foreground (Ctrl-C stops all three),
# or with --detach leaves them running (deploy/stop.sh stops them).
#
#   deploy/quickstart.sh [--model DIR] [--port 9000] [--prefill-port 8088] [--decode-port 8089]
#                        [--work-dir DIR] [--detach]
[ -n "${BASH_VERSION:-}" ] || exec bash "$0" "$@" # `sh quickstart.sh` (dash) re-runs under bash
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

model="" port=9000 pport=8088 dport=8089 work="$root/.cache/quickstart" detach=0
while [ $# -gt 0 ]; do
    case "$1" in
    --model) model=$2; shift ;;
    --port) port=$2; shift ;;
    --prefill-port) pport=$2; shift ;;
    --decode-port) dport=$2; shift ;;
    --work-dir) work=$2; shift ;;
    --detach) detach=1 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "quickstart.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
    esac
    shift
done

step() { echo "== $*"; }

step "dependencies"
deploy/install_deps.sh
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then export NVCC=/usr/local/cuda/bin/nvcc; fi

# A release build of its own (tests/run.sh builds build/ with checks on and warnings as errors)
step "build (build-release/)"
[ -f build-release/build.ninja ] || meson setup build-release --buildtype=release >/dev/null
ninja -C build-release -j "$(nproc)" >/dev/null
export PD_BIN_DIR=$PWD/build-release

mkdir -p "$work"
if [ -z "$model" ]; then
    model="$work/tiny"
    if [ ! -f "$model/config.json" ]; then
        step "synthetic model: pd-mkmodel --preset tiny --out $model"
        build-release/tools/mkmodel/pd-mkmodel --preset tiny --out "$model" >/dev/null
    fi
fi
[ -f "$model/config.json" ] || { echo "quickstart.sh: $model has no config.json" >&2; exit 1; }

step "ranktables for 1P1D on 127.0.0.1"
rtdir="$work/ranktable"
rm -rf "$rtdir" && mkdir -p "$rtdir"
build-release/ranktable/cli/pd-ranktable --mode gen --prefill-server-list 0 --decode-server-list 1 \
    --api-server --server-ip 127.0.0.1 --save-dir "$rtdir" >/dev/null
export GLOBAL_RANK_TABLE_FILE_PATH="$rtdir/global_ranktable_127.0.0.1.json"
export NODE_PORTS="$pport,$dport"
export USE_OPENAI=${USE_OPENAI:-1}
name=$(basename "$model")
common=(--model "$model" --served-model-name "$name" --max-model-len 1024 --max-num-seqs 64
        --max-num-batched-tokens 2048 --host 127.0.0.1)

pids="$work/pids"
rm -rf "$pids" && mkdir -p "$pids"
start() { # role, local table, port
    RANK_TABLE_FILE_PATH="$rtdir/$2" nohup deploy/start_servers.sh "${common[@]}" --port "$3" \
        >"$work/$1.log" 2>&1 &
    echo $! >"$pids/$1.pid"
}
stop_all() {
    for r in scheduler prefill decode; do
        [ -f "$pids/$r.pid" ] && kill "$(cat "$pids/$r.pid")" 2>/dev/null || true
    done
    for f in "$pids"/*.pid; do
        [ -f "$f" ] || continue
        for _ in $(seq 100); do kill -0 "$(cat "$f")" 2>/dev/null || break; sleep 0.1; done
        rm -f "$f"
    done
}

step "starting pd-prefill :$pport, pd-decode :$dport, pd-scheduler :$port (logs in $work)"
start prefill local_ranktable_127.0.0.1_0.json "$pport"
start decode local_ranktable_127.0.0.1_1.json "$dport"
start scheduler local_ranktable_127.0.0.1_host.json "$port"
[ "$detach" = 1 ] || trap 'echo; step "stopping"; stop_all; exit 0' INT TERM

for _ in $(seq 600); do
    code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health" || true)
    [ "$code" = 200 ] && break
    for r in prefill decode scheduler; do
        if ! kill -0 "$(cat "$pids/$r.pid")" 2>/dev/null; then
            echo "quickstart.sh: $r exited; last lines of $work/$r.log:" >&2
            tail -n 20 "$work/$r.log" >&2
            stop_all
            exit 1
        fi
    done
    sleep 0.2
done
[ "$code" = 200 ] || { echo "quickstart.sh: /health never became 200" >&2; stop_all; exit 1; }

step "chat request"
reply=$(curl -s "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' \
    -d "{\"model\":\"$name\",\"messages\":[{\"role\":\"user\",\"content\":\"Hello! Who are you?\"}],\"max_tokens\":24,\"temperature\":0}")
echo "$reply"
python3 - "$reply" <<'PY' 2>/dev/null || true
import json, sys
print("answer:", json.loads(sys.argv[1])["choices"][0]["message"]["content"])
PY

cat <<TXT
== serving on http://127.0.0.1:$port (model name "$name"). Try:
   curl -N http://127.0.0.1:$port/v1/chat/completions -H 'Content-Type: application/json' \\
     -d '{"model":"$name","messages":[{"role":"user","content":"Hi"}],"stream":true,"max_tokens":16}'
TXT
if [ "$detach" = 1 ]; then
    echo "== detached: pid files in $pids; stop with deploy/stop.sh"
    exit 0
fi
echo "== Ctrl-C stops all three"
wait
