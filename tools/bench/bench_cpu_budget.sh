#!/usr/bin/env bash
# Instances sharing one box (issue 28 item 2): two 1P1D clusters of the same pd-mkmodel model on
# loopback, default flags, one with the host core budget (PD_CPU_BUDGET=host, the default) and
# one without (PD_CPU_BUDGET=off: every instance runs a thread per core whenever it works);
# pd-bench runs the same load against each in turn (an idle cluster's threads sleep), for each
# concurrency and several rounds, printing output rate, TTFT and TPOT. Every (concurrency, round)
# has prompts of its own (no prefix-cache hits across them); both clusters get the same ones.
#
#   tools/bench/bench_cpu_budget.sh [--build DIR] [--model DIR | --preset P] [--input-len 256]
#       [--output-len 64] [--prompts 32] [--concurrency "1 16"] [--rounds 3]
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$root/build model="" preset=medium ilen=256 olen=64 prompts=32 concs="1 16" rounds=3
while [ $# -gt 0 ]; do
  case "$1" in
    --build) bin=$(cd "$2" && pwd); shift ;;
    --model) model=$(cd "$2" && pwd); shift ;;
    --preset) preset=$2; shift ;;
    --input-len) ilen=$2; shift ;;
    --output-len) olen=$2; shift ;;
    --prompts) prompts=$2; shift ;;
    --concurrency) concs=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "bench_cpu_budget.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
  shift
done
bench_name=budget
# shellcheck source=tools/bench/lib_bench.sh
source "$root/tools/bench/lib_bench.sh"
if [ -z "$model" ]; then
  model=$work/m
  "$bin/tools/mkmodel/pd-mkmodel" --preset "$preset" --out "$model" >/dev/null || exit 1
fi
budget="budget-$$"
start_1p1d shared "$model" PD_CPU_BUDGET="$budget" || exit 1
port_shared=$sched_port
start_1p1d off "$model" PD_CPU_BUDGET=off || exit 1
port_off=$sched_port
trap 'cleanup; rm -f "/dev/shm/pdserve-cpu-$budget"' EXIT
for c in $concs; do
  for round in $(seq "$rounds"); do
    for spec in "shared:$port_shared" "off:$port_off"; do
      IFS=: read -r name port <<<"$spec"
      bench_line "$round" "C=$c $name" --base-url "http://127.0.0.1:$port" --model m \
        --num-prompts "$prompts" --random-input-len "$ilen" --random-output-len "$olen" \
        --request-rate inf --max-concurrency "$c" --seed "$((c * 1000 + round))"
    done
  done
done
