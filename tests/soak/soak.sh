#!/usr/bin/env bash
# Soak test (issue #9 item 5; not part of CI, see tests/soak/README.md): a 1P1D cluster started
# with deploy/start_servers.sh on loopback with a small pd-mkmodel model, saturation measured
# with pd-bench (mixed workload at unlimited rate), then the same mixed traffic (completions and
# chat, streaming and not, varied lengths, n = 2, logprobs, client aborts) at a fraction of that
# request rate for a given duration, every process's RSS sampled from /proc to a CSV, and at the
# end these checks:
#   1. RSS of each server after the warm-up stays within +-RSS_TOL % of its first post-warm-up
#      sample;
#   2. zero unexpected errors: pd-bench failed requests == 0 (client aborts are intended), no
#      ERROR line in any server log, and nothing on the decode instance freed only by its time
#      limit (an expired reservation, a relayed Decode call its caller never ended);
#   3. the KV pools are whole again: pd-prefill and pd-decode Stats (pd-bench --node-stats) show
#      kv_blocks_free == kv_blocks_total and nothing running, waiting, held or reserved, and the
#      scheduler's /metrics shows vllm:kv_cache_usage_perc 0 and no running request;
#   4. the API key (random per run) appears in no server log.
# Exit 0 = every check passed. Everything it starts is stopped on exit, also on failure.
#
#   tests/soak/soak.sh [--duration S] [--load F] [--warmup S] [--sample S] [--build DIR]
#                      [--work-dir DIR] [--preset tiny|small] [--concurrency C] [--rss-tol PCT]
#                      [--sat-prompts N] [--abort-ratio R] [--soak-concurrency C2]
# --concurrency C bounds the requests in flight in both runs (default 32): the soak's Poisson
# arrivals wait at the client beyond it, so a machine that gets slower mid-run (it is shared)
# delays requests instead of pushing the decode KV pool into RESOURCE_EXHAUSTED refusals.
# --soak-concurrency C2 (default C) overrides it for the soak alone: with C2 far above C and
# --load above 1 it is an overload test.
set -uo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
duration=1800 load=0.8 warmup="" sample=5 build="$here/build" work="" preset=tiny conc=32
rss_tol=10 sat_prompts=1500 abort_ratio=0.05 soak_conc=
while [ $# -gt 0 ]; do
    case "$1" in
    --duration) duration=$2 ;;
    --load) load=$2 ;;
    --warmup) warmup=$2 ;;
    --sample) sample=$2 ;;
    --build) build=$2 ;;
    --work-dir) work=$2 ;;
    --preset) preset=$2 ;;
    --concurrency) conc=$2 ;;
    --rss-tol) rss_tol=$2 ;;
    --sat-prompts) sat_prompts=$2 ;;
    --abort-ratio) abort_ratio=$2 ;;
    --soak-concurrency) soak_conc=$2 ;;
    -h | --help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "soak.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    [ $# -ge 2 ] || { echo "soak.sh: $1 needs a value" >&2; exit 2; }
    shift 2
done
[ -n "$soak_conc" ] || soak_conc=$conc
for v in duration sample conc sat_prompts soak_conc; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || { echo "soak.sh: --${v//_/-} must be a positive integer" >&2; exit 2; }
done
[ -z "$warmup" ] && warmup=$(( duration / 6 > 30 ? duration / 6 : 30 ))
if ! [[ $warmup =~ ^[0-9]+$ ]] || [ "$warmup" -ge "$duration" ]; then
    echo "soak.sh: --warmup must be an integer below --duration" >&2
    exit 2
fi
py=/usr/bin/python3
for exe in prefill_node/pd-prefill decode_node/pd-decode scheduler/pd-scheduler \
           ranktable/cli/pd-ranktable tools/bench/pd-bench tools/mkmodel/pd-mkmodel; do
    [ -x "$build/$exe" ] || { echo "soak.sh: $build/$exe not built (ninja -C $build)" >&2; exit 2; }
done
[ -n "$work" ] || work="$here/.cache/soak/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$work/bin" || exit 2
log() { echo "$(date -u +%H:%M:%S) soak: $*" | tee -a "$work/soak.log"; }

# A copy of the executables: rebuilding the tree during a long run cannot change what runs.
for exe in prefill_node/pd-prefill decode_node/pd-decode scheduler/pd-scheduler \
           ranktable/cli/pd-ranktable tools/bench/pd-bench tools/mkmodel/pd-mkmodel; do
    cp "$build/$exe" "$work/bin/" || exit 2
done
bin="$work/bin"

pids=() bench_pid=""
cleanup() {
    [ -n "$bench_pid" ] && kill "$bench_pid" 2>/dev/null
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
    for p in "${pids[@]}" $bench_pid; do
        for _ in $(seq 150); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$p" 2>/dev/null
    done
}
trap cleanup EXIT
trap 'exit 130' INT TERM
fail() { log "FAIL: $*"; exit 1; }
free_port() { $py -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

log "work dir $work, duration ${duration} s, warm-up ${warmup} s, load $load, sample every ${sample} s"
log "machine: $(nproc) cores, loadavg at start $(cut -d' ' -f1-3 /proc/loadavg)"
"$bin/pd-mkmodel" --preset "$preset" --out "$work/model" >"$work/mkmodel.log" 2>&1 || fail "pd-mkmodel"
"$bin/pd-ranktable" --mode gen --prefill-server-list 0 --decode-server-list 1 --api-server \
    --server-ip 127.0.0.1 --save-dir "$work" >/dev/null || fail "pd-ranktable"
pp=$(free_port) dp=$(free_port) sp=$(free_port)
key="soak-$(od -An -N8 -tx8 /dev/urandom | tr -d ' ')"
export GLOBAL_RANK_TABLE_FILE_PATH="$work/global_ranktable_127.0.0.1.json"
export NODE_PORTS="$pp,$dp" USE_OPENAI=1 PD_BIN_DIR="$bin" VLLM_API_KEY="$key"
args=(--model "$work/model" --tensor-parallel-size 1 --max-model-len 1024 --max-num-seqs 32
      --max-num-batched-tokens 2048 --host 127.0.0.1 --served-model-name soak --cpu-threads 1
      --kv-cache-bytes 33554432 --max-concurrent-requests 256)
for spec in "prefill:0:$pp" "decode:1:$dp" "scheduler:host:$sp"; do
    IFS=: read -r role table port <<<"$spec"
    RANK_TABLE_FILE_PATH="$work/local_ranktable_127.0.0.1_$table.json" \
        "$here/deploy/start_servers.sh" "${args[@]}" --port "$port" >"$work/$role.log" 2>&1 &
    pids+=($!)
done
url="http://127.0.0.1:$sp"
up=0
for _ in $(seq 600); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "$url/health")" = 200 ] && { up=1; break; }
    sleep 0.1
done
[ $up = 1 ] || fail "/health did not become 200 within 60 s"
log "cluster up: prefill pid ${pids[0]} :$pp, decode pid ${pids[1]} :$dp, scheduler pid ${pids[2]} :$sp"

bench_common=(--base-url "$url" --model soak --api-key "$key" --workload mixed
              --random-input-len 96 --random-output-len 24 --random-range-ratio 0.75
              --abort-ratio "$abort_ratio" --timeout 120)

# 1. saturation: the same mix at unlimited rate, --concurrency requests in flight
"$bin/pd-bench" "${bench_common[@]}" --num-prompts "$sat_prompts" --request-rate inf \
    --max-concurrency "$conc" --warmup 8 --seed 1 --quiet --result-file "$work/saturation.json" \
    >"$work/saturation.log" 2>&1 || fail "saturation run: $(tail -n 5 "$work/saturation.log")"
read -r sat rate < <($py - "$work/saturation.json" "$load" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["failed"] == 0, r["errors"]
sat = r["num_prompts"] / r["duration"]   # completed + aborted: every request offered
print(f"{sat:.3f} {sat * float(sys.argv[2]):.3f}")
PY
) || fail "saturation result: $(tail -n 5 "$work/saturation.log")"
log "saturation: $sat req/s (mixed, unlimited rate, $conc in flight); soak rate $rate req/s, $soak_conc in flight at most"

# 2. the soak: Poisson arrivals at $rate for $duration s, RSS and metrics sampled meanwhile
csv="$work/rss.csv"
echo "t_s,prefill_rss_kb,decode_rss_kb,scheduler_rss_kb,bench_rss_kb,kv_usage,running,loadavg1" >"$csv"
t0=$(date +%s)
"$bin/pd-bench" "${bench_common[@]}" --num-prompts 2000 --request-rate "$rate" \
    --duration "$duration" --max-concurrency "$soak_conc" --seed 2 --quiet \
    --summary-only --result-file "$work/soak.json" >"$work/soak_bench.log" 2>&1 &
bench_pid=$!
rss() { sed -n 's/^VmRSS:[[:space:]]*\([0-9]*\) kB/\1/p' "/proc/$1/status" 2>/dev/null || echo 0; }
metric() { sed -n "s/^$1{[^}]*} \\(.*\\)/\\1/p" <<<"$2" | head -n 1; }
while kill -0 "$bench_pid" 2>/dev/null; do
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null || fail "server pid $p died (see $work/*.log)"; done
    m=$(curl -s --max-time 5 "$url/metrics")
    echo "$(( $(date +%s) - t0 )),$(rss "${pids[0]}"),$(rss "${pids[1]}"),$(rss "${pids[2]}"),$(rss "$bench_pid"),$(metric 'vllm:kv_cache_usage_perc' "$m"),$(metric 'vllm:num_requests_running' "$m"),$(cut -d' ' -f1 /proc/loadavg)" >>"$csv"
    sleep "$sample"
done
wait "$bench_pid"
bench_st=$? bench_pid=""
log "pd-bench ended with status $bench_st after $(( $(date +%s) - t0 )) s"
sed -n '/Serving Benchmark Result/,/^=*$/p' "$work/soak_bench.log" | tee -a "$work/soak.log"

# 3. the end state: every pool whole (the scheduler learns node stats by heartbeat: poll)
end_ok=0
for _ in $(seq 60); do
    "$bin/pd-bench" --node-stats "127.0.0.1:$pp" >"$work/prefill_stats.json" 2>&1 &&
        "$bin/pd-bench" --node-stats "127.0.0.1:$dp" >"$work/decode_stats.json" 2>&1 &&
        curl -s --max-time 5 "$url/metrics" >"$work/metrics_end.txt" &&
        $py - "$work/prefill_stats.json" "$work/decode_stats.json" "$work/metrics_end.txt" <<'PY' && { end_ok=1; break; }
import json, re, sys
for f in sys.argv[1:3]:
    s = json.load(open(f))
    assert s["kv_blocks_total"] > 0 and s["kv_blocks_free"] == s["kv_blocks_total"], (f, s)
    for k in ("num_running", "num_waiting", "num_held", "reserved_tokens", "leases_held", "queued_tokens", "running_tokens"):
        assert s[k] == 0, (f, k, s)
m = open(sys.argv[3]).read()
for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"):
    v = re.search(r"^" + re.escape(name) + r"\{[^}]*\} (\S+)$", m, re.M)
    assert v and float(v.group(1)) == 0.0, (name, v and v.group(1))
PY
    sleep 1
done
log "prefill stats at the end: $(cat "$work/prefill_stats.json")"
log "decode stats at the end:  $(cat "$work/decode_stats.json")"

# 4. verdict
errors=$(cat "$work/prefill.log" "$work/decode.log" "$work/scheduler.log" | grep -c ' ERROR ')
grep -h ' ERROR ' "$work/prefill.log" "$work/decode.log" "$work/scheduler.log" | head -n 5 >"$work/errors_head.txt"
# state that only its time limit freed: KV whose owner forgot it, a call nobody ended
stale_re='reservation expired before Decode started|relayed request not closed by its caller'
stale=$(grep -cE "$stale_re" "$work/decode.log")
grep -hE "$stale_re" "$work/decode.log" | head -n 5 >>"$work/errors_head.txt"
grep -q -F "$key" "$work/prefill.log" "$work/decode.log" "$work/scheduler.log" && fail "the API key appears in a log"
$py - "$csv" "$work/soak.json" "$warmup" "$rss_tol" "$bench_st" "$end_ok" "$errors" "$stale" <<'PY' | tee -a "$work/soak.log"
import csv, json, sys
rows = list(csv.DictReader(open(sys.argv[1])))
res = json.load(open(sys.argv[2]))
warm, tol, bench_st, end_ok, errors = float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
stale = int(sys.argv[8])
ok = True
def check(cond, msg):
    global ok
    print(("PASS " if cond else "FAIL ") + msg)
    ok &= bool(cond)
after = [r for r in rows if float(r["t_s"]) >= warm]
check(len(after) >= 2, f"{len(after)} RSS samples after the {warm:.0f} s warm-up ({len(rows)} in all)")
for proc in ("prefill", "decode", "scheduler"):
    v = [int(r[f"{proc}_rss_kb"]) for r in after if int(r[f"{proc}_rss_kb"]) > 0]
    if not v:
        check(False, f"{proc}: no RSS sample")
        continue
    ref, lo, hi = v[0], min(v), max(v)
    first = int(rows[0][f"{proc}_rss_kb"])
    check(lo >= ref * (1 - tol / 100) and hi <= ref * (1 + tol / 100),
          f"{proc} RSS after warm-up: ref {ref} kB, min {lo} kB ({(lo/ref-1)*100:+.1f} %), "
          f"max {hi} kB ({(hi/ref-1)*100:+.1f} %), last {v[-1]} kB; first sample {first} kB")
load = [float(r["loadavg1"]) for r in rows]
print(f"INFO machine loadavg(1 min) during the soak: min {min(load):.2f}, mean {sum(load)/len(load):.2f}, max {max(load):.2f}")
check(bench_st == 0, f"pd-bench exit status {bench_st}")
n = res["num_prompts"]
check(res["failed"] == 0, f"requests: {n} sent, {res['completed']} completed, {res['aborted']} aborted by the client, "
      f"{res['failed']} failed" + (f" (by kind: {res['error_kinds']})" if res["failed"] else ""))
print(f"INFO offered {res['request_rate']:.3f} req/s for {res['duration']:.0f} s; achieved {res['request_throughput']:.3f} completed req/s, "
      f"{res['output_throughput']:.1f} output tok/s; TTFT mean {res['mean_ttft_ms']:.1f} ms p99 {res['p99_ttft_ms']:.1f} ms; "
      f"E2EL mean {res['mean_e2el_ms']:.1f} ms p99 {res['p99_e2el_ms']:.1f} ms")
check(errors == 0, f"{errors} ERROR lines in the server logs")
check(stale == 0, f"{stale} decode reservations or calls freed only by their time limit")
check(end_ok == 1, "KV pools whole again at the end (prefill and decode Stats, scheduler /metrics)")
print("SOAK " + ("PASSED" if ok else "FAILED"))
sys.exit(0 if ok else 1)
PY
st=${PIPESTATUS[0]}
[ -s "$work/errors_head.txt" ] && { log "first ERROR (and time-limit) lines:"; tee -a "$work/soak.log" <"$work/errors_head.txt"; }
log "figures: $work/soak.log, RSS samples: $csv"
exit "$st"
