#!/usr/bin/env bash
# pdserve against its peer llama.cpp on one box (issue 28): the same pd-mkmodel model served by a
# pdserve 1P1D cluster (deploy/start_servers.sh, default flags) and by llama-server (the model
# written to GGUF by tools/bench/hf_to_gguf.py); pd-bench sends the same chat load to each in
# interleaved rounds (for every round, every concurrency: pdserve, then llama-server) and prints
# output rate, median TTFT and TPOT, and goodput: the requests within both SLOs (--goodput, as
# vLLM's `bench serve --goodput ttft:2000 tpot:50`), as a fraction and a rate.
#
#   tools/bench/bench_llama_server.sh --llama-server BIN [--build DIR] [--model DIR | --preset P
#       [--mkmodel "FLAGS"]] [--gguf FILE] [--outtype f32|bf16] [--llama-args "-t 2 -np 16"]
#       [--input-len 256] [--output-len 64] [--prompts 64] [--concurrency "1 16"] [--rounds 3]
#       [--goodput ttft:2000,tpot:50] [--pd-args "FLAGS"]
#
# --pd-args: flags for pdserve's instances (every role's command line gets them, as in the guide,
# e.g. "--cpu-threads 1" for a static split or "--enable-chunked-prefill"); default none.
#
# The chat endpoint carries text prompts (pd-bench's random words, the same for both servers and
# tokenized by each with the same tokenizer); llama-server's /v1/completions takes no token ids.
# llama-server's context (-c) is --llama-args' if given, else parallel slots x (2 x prompt words
# + output + 64) tokens: a slot's share must hold the whole prompt, which llama-server would
# otherwise truncate (pd-mkmodel's tokenizer makes about 1.45 tokens of a word). Everything
# started is stopped at exit.
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$root/build llama="" model="" preset=small mkflags="" gguf="" outtype=f32 largs="-t 2 -np 16"
ilen=256 olen=64 prompts=64 concs="1 16" rounds=3 goodput=ttft:2000,tpot:50 pd_args=""
while [ $# -gt 0 ]; do
  case "$1" in
    --llama-server) llama=$2; shift ;;
    --build) bin=$(cd "$2" && pwd); shift ;;
    --model) model=$2; shift ;;
    --preset) preset=$2; shift ;;
    --mkmodel) mkflags=$2; shift ;;
    --gguf) gguf=$2; shift ;;
    --outtype) outtype=$2; shift ;;
    --llama-args) largs=$2; shift ;;
    --input-len) ilen=$2; shift ;;
    --output-len) olen=$2; shift ;;
    --prompts) prompts=$2; shift ;;
    --concurrency) concs=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --goodput) goodput=$2; shift ;;
    --pd-args) pd_args=$2; shift ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "bench_llama_server.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
  shift
done
bench_name=llama
# shellcheck source=tools/bench/lib_bench.sh
source "$root/tools/bench/lib_bench.sh"
peer_model || exit $?
case " $largs " in
  *" -c "*|*" --ctx-size "*) ;;
  *) slots=$(sed -n 's/.*\(-np\|--parallel\) \([0-9]*\).*/\2/p' <<<"$largs")
     largs="$largs -c $(( ${slots:-1} * (2 * ilen + olen + 64) ))" ;;
esac
# shellcheck disable=SC2086 # largs is a list of flags
start_llama "$llama" $largs || exit 1
start_1p1d pd "$model" || exit 1
echo "pdserve $(git -C "$root" rev-parse --short HEAD) ${pd_args:-(default flags)}, model $model, llama-server $llama $largs ($gguf), $prompts prompts of $ilen words," \
  "$olen output tokens, goodput $goodput; load average $(cut -d' ' -f1-3 /proc/loadavg)"

# one pd-bench run, one line from its result file. Every run draws its own prompts (seed from
# round and concurrency, the same for both servers), so no prompt is in a prefix cache.
run() {
  local round=$1 conc=$2 name=$3 port=$4 n=${5:-$prompts} seed=$(($1 * 1000 + $2)) res="$work/r.json"
  rm -f "$res"
  "$bin/tools/bench/pd-bench" --base-url "http://127.0.0.1:$port" --endpoint /v1/chat/completions \
    --model m --num-prompts "$n" --random-input-len "$ilen" --random-output-len "$olen" \
    --request-rate inf --max-concurrency "$conc" --seed "$seed" --goodput "$goodput" \
    --result-file "$res" --summary-only >"$work/bench.out" 2>&1
  [ -s "$res" ] || { echo "round $round C=$conc $name: pd-bench failed:"; tail -3 "$work/bench.out"; return; }
  /usr/bin/python3 - "$res" "round $round C=$conc $name" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
good = round(r["request_goodput"] * r["duration"])
print(f"{sys.argv[2]:<28} failed {r['failed']}, {r['total_input_tokens']} prompt tokens, "
      f"output {r['output_throughput']:.1f} tok/s, "
      f"TTFT median {r['median_ttft_ms']:.1f} ms, TPOT median {r['median_tpot_ms']:.2f} ms, "
      f"goodput {good}/{r['num_prompts']} ({r['request_goodput']:.2f} req/s)")
EOF
}
run 0 4 warm-up "$sched_port" 4 >/dev/null # first requests of each server, not measured
run 0 4 warm-up "$llama_port" 4 >/dev/null
for round in $(seq "$rounds"); do
  for conc in $concs; do
    run "$round" "$conc" pdserve "$sched_port"
    run "$round" "$conc" llama-server "$llama_port"
    kill -0 "$llama_pid" 2>/dev/null || {
      echo "llama-server exited:" >&2; tail -5 "$work/llama-server.log" >&2; exit 1; }
  done
done
