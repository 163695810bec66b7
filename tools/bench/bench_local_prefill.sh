#!/usr/bin/env bash
# Conditional disaggregation on one box (issue 28 item 3): one 1P1D cluster of a pd-mkmodel
# model on loopback (deploy/start_servers.sh, default flags) and two schedulers in front of it,
# one always split and one with --max-local-prefill-length N; pd-bench runs the same short-prompt
# load against each in turn, for several rounds, and prints output rate, TTFT and TPOT per round.
#
#   tools/bench/bench_local_prefill.sh [--build DIR] [--preset small] [--max-local N]
#       [--input-len 32] [--output-len 32] [--prompts 64] [--concurrency 16] [--rounds 3]
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$root/build preset=small local=64 ilen=32 olen=32 prompts=64 conc=16 rounds=3
while [ $# -gt 0 ]; do
  case "$1" in
    --build) bin=$(cd "$2" && pwd); shift ;;
    --preset) preset=$2; shift ;;
    --max-local) local=$2; shift ;;
    --input-len) ilen=$2; shift ;;
    --output-len) olen=$2; shift ;;
    --prompts) prompts=$2; shift ;;
    --concurrency) conc=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "bench_local_prefill.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
  shift
done
bench_name=local
# shellcheck source=tools/bench/lib_bench.sh
source "$root/tools/bench/lib_bench.sh"
"$bin/tools/mkmodel/pd-mkmodel" --preset "$preset" --out "$work/m" >/dev/null || exit 1
"$bin/ranktable/cli/pd-ranktable" --mode gen --prefill-server-list 0 --decode-server-list 1 \
  --api-server --server-ip 127.0.0.1 --save-dir "$work" >/dev/null || exit 1
pp=$(free_port) dp=$(free_port) s0=$(free_port) s1=$(free_port)
export GLOBAL_RANK_TABLE_FILE_PATH="$work/global_ranktable_127.0.0.1.json" NODE_PORTS="$pp,$dp"
export USE_OPENAI=1 PD_BIN_DIR="$bin"
for spec in "prefill:0:$pp:" "decode:1:$dp:" "split:host:$s0:" "local:host:$s1:--max-local-prefill-length $local"; do
  IFS=: read -r role table port extra <<<"$spec"
  # shellcheck disable=SC2086 # extra is a flag and its value
  RANK_TABLE_FILE_PATH="$work/local_ranktable_127.0.0.1_$table.json" "$root/deploy/start_servers.sh" \
    --model "$work/m" --served-model-name m --host 127.0.0.1 --port "$port" $extra >"$work/$role.log" 2>&1 &
  pids+=($!)
done
for p in $s0 $s1; do
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$p/health" >/dev/null && break; sleep 1; done
done
for round in $(seq "$rounds"); do
  for p in $s0 $s1; do
    name="split"; [ "$p" = "$s1" ] && name="local<=$local"
    bench_line "$round" "$name" --base-url "http://127.0.0.1:$p" --model m --num-prompts "$prompts" \
      --random-input-len "$ilen" --random-output-len "$olen" --request-rate inf \
      --max-concurrency "$conc" --seed "$round"
  done
done
