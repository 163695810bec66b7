# shellcheck shell=bash
# Shared by the benchmark scripts of tools/bench (source it after setting $bench_name): a work
# directory removed at exit with the processes in $pids, and free_port.
work=$(mktemp -d "${TMPDIR:-/tmp}/pd${bench_name:-bench}.XXXXXX")
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  sleep 2
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT
free_port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# start_1p1d NAME MODEL_DIR [VAR=VALUE ...]: a 1P1D cluster of MODEL_DIR on loopback
# (deploy/start_servers.sh, default flags and the words of $pd_args, if set, on every role's
# command line as in the guide; the assignments go into every process's environment) with its
# scheduler; logs in $work/NAME-*.log; sets $sched_port and waits (120 s) for /health.
# Needs $bin (the build directory) and $root.
start_1p1d() {
  local name=$1 model=$2 dir="$work/$1"
  shift 2
  mkdir -p "$dir"
  "$bin/ranktable/cli/pd-ranktable" --mode gen --prefill-server-list 0 --decode-server-list 1 \
    --api-server --server-ip 127.0.0.1 --save-dir "$dir" >/dev/null || return 1
  local pp dp spec role table port
  pp=$(free_port) dp=$(free_port) sched_port=$(free_port)
  for spec in "prefill:0:$pp" "decode:1:$dp" "scheduler:host:$sched_port"; do
    IFS=: read -r role table port <<<"$spec"
    # shellcheck disable=SC2086 # pd_args is a list of flags
    env "$@" GLOBAL_RANK_TABLE_FILE_PATH="$dir/global_ranktable_127.0.0.1.json" \
      NODE_PORTS="$pp,$dp" USE_OPENAI=1 PD_BIN_DIR="$bin" \
      RANK_TABLE_FILE_PATH="$dir/local_ranktable_127.0.0.1_$table.json" \
      "$root/deploy/start_servers.sh" --model "$model" --served-model-name m --host 127.0.0.1 \
      --port "$port" ${pd_args:-} >"$work/$name-$role.log" 2>&1 &
    pids+=($!)
  done
  wait_health "$sched_port" "start_1p1d $name" "$work/$name-*.log"
}

# wait_health PORT WHAT LOGS: waits (120 s) for http://127.0.0.1:PORT/health to answer 200.
wait_health() {
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 1; done
  echo "$2: no /health after 120 s (logs: $3)" >&2
  return 1
}

# The llama.cpp peer (docs/benchmarks.md, "Peer: llama.cpp").
# peer_model: checks $llama (the llama-server executable; exit status 2 when it is not one), sets $model (unless set: pd-mkmodel --preset $preset $mkflags into $work/m) and
# $gguf (unless set: $model through hf_to_gguf.py as $outtype into $work/m.gguf).
peer_model() {
  [ -x "$llama" ] || { echo "$(basename "$0"): --llama-server: '$llama' is not an executable" >&2; return 2; }
  if [ -z "$model" ]; then
    model=$work/m
    # shellcheck disable=SC2086 # extra pd-mkmodel flags
    "$bin/tools/mkmodel/pd-mkmodel" --preset "$preset" $mkflags --out "$model" >/dev/null || return 1
  fi
  if [ -z "$gguf" ]; then
    gguf=$work/m.gguf
    /usr/bin/python3 "$root/tools/bench/hf_to_gguf.py" "$model" "$gguf" --outtype "$outtype" || return 1
  fi
}

# start_llama BIN [ARGS...]: llama-server BIN on $gguf on loopback with ARGS; log
# $work/llama-server.log; sets $llama_port and $llama_pid and waits (120 s) for /health.
start_llama() {
  local exe=$1
  shift
  llama_port=$(free_port)
  "$exe" -m "$gguf" --host 127.0.0.1 --port "$llama_port" "$@" >"$work/llama-server.log" 2>&1 &
  llama_pid=$!
  pids+=("$llama_pid")
  wait_health "$llama_port" llama-server "$work/llama-server.log" || {
    tail -5 "$work/llama-server.log" >&2; return 1; }
}

# bench_line ROUND NAME pd-bench-args...: one pd-bench run (summary only), its failures, output
# rate, median TTFT and TPOT as "round R NAME ..." lines.
bench_line() {
  local round=$1 name=$2
  shift 2
  "$bin/tools/bench/pd-bench" "$@" --summary-only 2>&1 |
    awk -v r="$round" -v n="$name" '/Failed requests|Output token throughput|Median TTFT|Median TPOT/ {
      sub(/^[ \t]+/, ""); printf "round %s %-12s %s\n", r, n, $0 }'
}
