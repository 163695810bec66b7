#!/usr/bin/env bash
# Beam search served split (issue 32): one 1P1D cluster of a pd-mkmodel model on loopback
# (deploy/start_servers.sh, default flags plus --cpu-threads); per round one greedy completion
# and one beam search of width W (use_beam_search, best_of W), both of N tokens (ignore_eos), the
# same prompt, one at a time; prints each one's wall time (curl's time_total) and their ratio.
# A warm-up pair runs first.
#
#   tools/bench/bench_beam.sh [--build DIR] [--preset medium] [--width 4] [--tokens 64]
#       [--rounds 5] [--cpu-threads 2] [--prompt TEXT]
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$root/build preset=medium width=4 tokens=64 rounds=5 threads=2
prompt="The history of the city"
while [ $# -gt 0 ]; do
  case "$1" in
    --build) bin=$(cd "$2" && pwd); shift ;;
    --preset) preset=$2; shift ;;
    --width) width=$2; shift ;;
    --tokens) tokens=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --cpu-threads) threads=$2; shift ;;
    --prompt) prompt=$2; shift ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "bench_beam.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
  shift
done
bench_name=beam
# shellcheck source=tools/bench/lib_bench.sh
source "$root/tools/bench/lib_bench.sh"
"$bin/tools/mkmodel/pd-mkmodel" --preset "$preset" --out "$work/m" >/dev/null || exit 1
pd_args="--cpu-threads $threads --max-model-len 1024"
start_1p1d beam "$work/m" || exit 1
body() { # $1: extra fields
  /usr/bin/python3 -c 'import json,sys; print(json.dumps(dict(model="m", prompt=sys.argv[1],
    max_tokens=int(sys.argv[2]), ignore_eos=True, temperature=0, **json.loads(sys.argv[3]))))' \
    "$prompt" "$tokens" "$1"
}
greedy=$(body '{}') beam=$(body "{\"use_beam_search\": true, \"best_of\": $width}")
run() { # $1: body; prints the wall time, checks the answer's length
  local t
  t=$(curl -s -o "$work/out.json" -w '%{time_total}' "http://127.0.0.1:$sched_port/v1/completions" \
    -H 'Content-Type: application/json' -d "$1") || return 1
  /usr/bin/python3 -c 'import json,sys; u=json.load(open(sys.argv[1]))["usage"]
sys.exit(0 if u["completion_tokens"] == int(sys.argv[2]) else 1)' "$work/out.json" "$tokens" ||
    { echo "bench_beam.sh: bad answer: $(cat "$work/out.json")" >&2; return 1; }
  echo "$t"
}
run "$greedy" >/dev/null && run "$beam" >/dev/null || exit 1
echo "round greedy_s beam_w${width}_s ratio"
for r in $(seq "$rounds"); do
  g=$(run "$greedy") && b=$(run "$beam") || exit 1
  /usr/bin/python3 -c 'import sys; g,b=map(float,sys.argv[2:]); print(sys.argv[1], g, b, round(b/g,2))' "$r" "$g" "$b"
done
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
