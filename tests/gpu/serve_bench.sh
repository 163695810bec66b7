#!/usr/bin/env bash
# Serves one model as 1P1D (one pd-prefill + one pd-decode instance) on ONE device behind
# pd-scheduler, benchmarks it with pd-bench at each concurrency level, runs the colocated
# baseline (pd-generate, one process, the same prompts) and prints one markdown table.
#
#   tests/gpu/serve_bench.sh --bin-dir BUILD_DIR --model DIR [--device cuda|cpu] [--dtype D]
#       [--kv-transport auto|tcp|nccl|cuda_ipc] [--concurrency "1 16 64"] [--num-prompts 128]
#       [--input-len 512] [--output-len 128] [--work-dir DIR] [--gpu-memory-utilization 0.4]
#       [--gpu N] [--max-model-len N] [--warmup 2] [--timeout 540] [--health-timeout 180]
# --device defaults to cuda, --dtype and --kv-transport to auto (passed to both instances);
# --gpu: the GPU both instances share (default: the first of CUDA_VISIBLE_DEVICES, else 0);
# --warmup: pd-bench warm-up requests per level; --timeout: seconds for the whole run;
# --health-timeout: seconds for all three processes to come up (within --timeout).
# BUILD_DIR: a build directory (or an install prefix's bin/); LD_LIBRARY_PATH is the caller's.
#
# Design choices:
# - Both instances share one GPU. The ranktable stays an ordinary one (prefill device 0,
#   decode device 1: start_servers.sh and pd-scheduler refuse a device shared by two
#   instances) and CUDA_VISIBLE_DEVICES=<the GPU> is exported: device 0 is then that GPU, and
#   device 1, not visible, falls back to ordinal 0 (docs/nodes.md, --device): the same GPU.
# - The instances start one after the other (prefill, decode, scheduler), each once the previous
#   one listens: the CUDA KV sizing reads the GPU's free memory, so two loads at once would race.
#   Each gets --gpu-memory-utilization F (0.4 by default, so both fit).
# - The colocated baseline runs after the servers are stopped (it takes the whole GPU) on the
#   prompts pd-bench saved (--save-dataset), at the same concurrency levels.
# - Every long step runs in the background under `timeout` (what is left of --timeout) and the
#   script `wait`s for it, so Ctrl-C or SIGTERM is handled at once; the EXIT trap stops every
#   process the script started (TERM, then KILL after 8 s), on success and on failure.
# - Only bash, coreutils and python3's standard library are needed (no curl, jq or numpy).
#
# Outputs, in the work directory (default: a new ${TMPDIR:-/tmp}/pd-serve-bench.XXXXXX):
# {prefill,decode,scheduler}.log, bench_c<C>.json (pd-bench --result-file) and .log,
# colocated_c<C>.jsonl and .log, prompts.ids, table.md.
# Exit status: 0 done, 1 a step failed (its log is printed), 2 usage error, 124 --timeout hit,
# 130/143 interrupted.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
me=serve_bench.sh

bin_dir="" model="" device=cuda dtype=auto transport=auto levels="1 16 64" num_prompts=128
input_len=512 output_len=128 work="" gpu_util=0.4 gpu="" max_model_len="" warmup=2
timeout_s=540 health_s=180
usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "$me: $*" >&2; exit 1; }
bad() { echo "$me: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
    -h | --help) usage; exit 0 ;;
    --bin-dir | --model | --device | --dtype | --kv-transport | --concurrency | --num-prompts | \
        --input-len | --output-len | --work-dir | --gpu-memory-utilization | --gpu | \
        --max-model-len | --warmup | --timeout | --health-timeout)
        [ $# -ge 2 ] || bad "$1 needs a value"
        case "$1" in
        --bin-dir) bin_dir=$2 ;;
        --model) model=$2 ;;
        --device) device=$2 ;;
        --dtype) dtype=$2 ;;
        --kv-transport) transport=$2 ;;
        --concurrency) levels=$2 ;;
        --num-prompts) num_prompts=$2 ;;
        --input-len) input_len=$2 ;;
        --output-len) output_len=$2 ;;
        --work-dir) work=$2 ;;
        --gpu-memory-utilization) gpu_util=$2 ;;
        --gpu) gpu=$2 ;;
        --max-model-len) max_model_len=$2 ;;
        --warmup) warmup=$2 ;;
        --timeout) timeout_s=$2 ;;
        --health-timeout) health_s=$2 ;;
        esac
        shift ;;
    *) bad "unknown argument '$1' (try --help)" ;;
    esac
    shift
done

# ---- checks of the command line (values the programs would refuse later are left to them) ----
is_count() { [[ $1 =~ ^[0-9]+$ ]] && [ "$((10#$1))" -ge "$2" ]; } # value, minimum
[ -n "$bin_dir" ] || bad "--bin-dir BUILD_DIR is required (try --help)"
[ -n "$model" ] || bad "--model DIR is required (try --help)"
[ -d "$bin_dir" ] || bad "--bin-dir $bin_dir: not a directory"
[ -f "$model/config.json" ] || bad "--model $model: no config.json there"
case "$device" in cpu | cuda) ;; *) bad "--device: expected cpu or cuda, got '$device'" ;; esac
for v in num-prompts:num_prompts:1 input-len:input_len:1 output-len:output_len:1 warmup:warmup:0 \
    timeout:timeout_s:10 health-timeout:health_s:1; do
    IFS=: read -r flag var min <<<"$v"
    is_count "${!var}" "$min" || bad "--$flag: expected an integer >= $min, got '${!var}'"
done
[ -z "$max_model_len" ] || is_count "$max_model_len" 1 ||
    bad "--max-model-len: expected a positive integer, got '$max_model_len'"
read -r -a conc <<<"$levels"
[ "${#conc[@]}" -gt 0 ] || bad "--concurrency: expected a list like \"1 16 64\""
for c in "${conc[@]}"; do
    is_count "$c" 1 || bad "--concurrency: '$c' is not a positive integer"
done
if [[ ! $gpu_util =~ ^(0?\.[0-9]+|1(\.0*)?)$ ]] || [[ $gpu_util =~ ^0?\.0*$ ]]; then
    bad "--gpu-memory-utilization: expected a number in (0, 1], got '$gpu_util'"
fi
if [ -z "$gpu" ]; then # the first GPU the caller lets us see
    gpu=${CUDA_VISIBLE_DEVICES:-0}
    gpu=${gpu%%,*}
    [ -n "$gpu" ] || gpu=0
fi
command -v python3 >/dev/null || die "python3 is required (standard library only)"
command -v timeout >/dev/null || die "timeout (coreutils) is required"

bin_dir=$(cd "$bin_dir" && pwd)
model=$(cd "$model" && pwd)
bin() { # path inside a build directory; also accepts an install prefix's bin/
    local p=$bin_dir/$1
    [ -x "$p" ] || p=$bin_dir/$(basename "$1")
    [ -x "$p" ] || die "--bin-dir $bin_dir: no executable $1 (or $(basename "$1")) there"
    echo "$p"
}
rt_bin=$(bin ranktable/cli/pd-ranktable)
bench_bin=$(bin tools/bench/pd-bench)
gen_bin=$(bin tools/generate/pd-generate)
for b in prefill_node/pd-prefill decode_node/pd-decode scheduler/pd-scheduler; do
    bin "$b" >/dev/null
done

if [ -z "$work" ]; then
    work=$(mktemp -d "${TMPDIR:-/tmp}/pd-serve-bench.XXXXXX")
else
    mkdir -p "$work"
    work=$(cd "$work" && pwd)
fi

# ---- lifetime: every process we start is listed; the EXIT trap stops them all ---------------
t_start=$(date +%s)
deadline=$((t_start + timeout_s))
pids=()   # background processes (servers, the current step)
timed_out=0
remaining() { echo $((deadline - $(date +%s))); }
stop_all() {
    local p alive=() n
    for p in "${pids[@]+"${pids[@]}"}"; do
        if kill -0 "$p" 2>/dev/null; then
            kill -TERM "$p" 2>/dev/null || true
            alive+=("$p")
        fi
    done
    # the nodes drain for --shutdown-timeout (5 s below); give them a little longer, then KILL
    for ((n = 0; n < 80; n++)); do
        local any=0
        for p in "${alive[@]+"${alive[@]}"}"; do kill -0 "$p" 2>/dev/null && any=1; done
        [ "$any" = 0 ] && break
        sleep 0.1
    done
    for p in "${alive[@]+"${alive[@]}"}"; do
        if kill -0 "$p" 2>/dev/null; then
            echo "$me: pid $p did not stop after SIGTERM; sending SIGKILL" >&2
            kill -KILL "$p" 2>/dev/null || true
        fi
    done
    for p in "${alive[@]+"${alive[@]}"}"; do wait "$p" 2>/dev/null || true; done
    pids=()
}
on_exit() {
    local rc=$?
    trap - EXIT INT TERM
    if [ "${#pids[@]}" -gt 0 ]; then
        echo "== stopping ${#pids[@]} process(es) started by $me"
        stop_all
    fi
    [ "$timed_out" = 1 ] && rc=124
    [ "$rc" = 0 ] || echo "$me: failed (exit $rc); logs in $work" >&2
    exit "$rc"
}
trap on_exit EXIT
trap 'echo "$me: interrupted" >&2; exit 130' INT
trap 'echo "$me: terminated" >&2; exit 143' TERM

step() { echo "== $*"; }
out_of_time() {
    timed_out=1
    die "the --timeout budget of $timeout_s s ran out during: $*"
}
# run_step STDOUT_FILE STDERR_FILE CMD...: runs CMD in the background under `timeout` with what
# is left of the budget, waits for it (so a signal interrupts the wait at once) and returns its
# status. Only CMD's output is redirected: the script's own messages stay on the terminal.
run_step() {
    local out=$1 err=$2 left rc=0
    shift 2
    left=$(remaining)
    [ "$left" -gt 0 ] || out_of_time "$(basename "$1")"
    if [ "$out" = "$err" ]; then
        timeout -k 5 "$left" "$@" </dev/null >"$out" 2>&1 &
    else
        timeout -k 5 "$left" "$@" </dev/null >"$out" 2>"$err" &
    fi
    pids+=("$!")
    wait "$!" || rc=$?
    unset 'pids[${#pids[@]}-1]'
    [ "$rc" != 124 ] || out_of_time "$(basename "$1")"
    return "$rc"
}
show_log() { # file, lines
    echo "---- last ${2:-40} lines of $1" >&2
    tail -n "${2:-40}" "$1" >&2 || true
    echo "----" >&2
}

# ---- ranktables, ports ---------------------------------------------------------------------
where=$device
[ "$device" = cpu ] || where="$device (GPU $gpu for both instances)"
step "work dir $work; model $model; device $where, dtype $dtype, kv transport $transport"
rtdir=$work/ranktable
rm -rf "$rtdir"
mkdir -p "$rtdir"
run_step "$work/ranktable.log" "$work/ranktable.log" \
    "$rt_bin" --mode gen --prefill-server-list 0 --decode-server-list 1 --api-server \
    --server-ip 127.0.0.1 --save-dir "$rtdir" ||
    { show_log "$work/ranktable.log"; die "pd-ranktable --mode gen failed"; }
export GLOBAL_RANK_TABLE_FILE_PATH=$rtdir/global_ranktable_127.0.0.1.json
read -r pport dport sport vocab name < <(python3 - "$model" <<'PY'
import json, os, socket, sys
# three free loopback ports, held open together so they differ
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
ports = [s.getsockname()[1] for s in socks]
for s in socks:
    s.close()
cfg = json.load(open(os.path.join(sys.argv[1], "config.json")))
vocab = min(int(cfg.get("vocab_size", 2048)), 2048)  # pd-bench's random token ids stay below it
print(*ports, vocab, os.path.basename(sys.argv[1].rstrip("/")) or "model")
PY
)
[ -n "${name:-}" ] || die "could not pick ports or read $model/config.json"
export NODE_PORTS=$pport,$dport USE_OPENAI=1 PD_BIN_DIR=$bin_dir

common=(--model "$model" --served-model-name "$name" --host 127.0.0.1)
[ -z "$max_model_len" ] || common+=(--max-model-len "$max_model_len")
node_args=(--device "$device" --dtype "$dtype" --kv-transport "$transport" --shutdown-timeout 5)
if [ "$device" = cuda ]; then
    node_args+=(--gpu-memory-utilization "$gpu_util")
    export CUDA_VISIBLE_DEVICES=$gpu # for both instances and pd-generate: see the top comment
fi

# ---- servers -------------------------------------------------------------------------------
start() { # role, local table, port, extra args...
    local role=$1 table=$2 port=$3
    shift 3
    RANK_TABLE_FILE_PATH=$rtdir/$table "$root/deploy/start_servers.sh" "${common[@]}" \
        --port "$port" "$@" </dev/null >"$work/$role.log" 2>&1 &
    pids+=("$!")
    eval "${role}_pid=$!"
}
health_deadline=$(($(date +%s) + health_s))
[ "$health_deadline" -le "$deadline" ] || health_deadline=$deadline
not_up() { # role, what
    for r in prefill decode scheduler; do [ -f "$work/$r.log" ] && show_log "$work/$r.log"; done
    die "$1 $2"
}
# Waits until the role's process accepts TCP on its port (python3 probe) or fails.
wait_listen() { # role, port
    local pid_var=${1}_pid
    while :; do
        kill -0 "${!pid_var}" 2>/dev/null ||
            not_up "$1" "exited during start-up (log: $work/$1.log)"
        python3 -c 'import socket, sys
socket.create_connection(("127.0.0.1", int(sys.argv[1])), 1).close()' "$2" 2>/dev/null &&
            return 0
        [ "$(date +%s)" -lt "$health_deadline" ] ||
            not_up "$1" "is not listening on 127.0.0.1:$2 after $health_s s (log: $work/$1.log)"
        sleep 0.5
    done
}
step "starting pd-prefill :$pport"
start prefill local_ranktable_127.0.0.1_0.json "$pport" "${node_args[@]}"
wait_listen prefill "$pport"
step "starting pd-decode :$dport"
start decode local_ranktable_127.0.0.1_1.json "$dport" "${node_args[@]}"
wait_listen decode "$dport"
step "starting pd-scheduler :$sport"
start scheduler local_ranktable_127.0.0.1_host.json "$sport"
while :; do
    for r in prefill decode scheduler; do
        v=${r}_pid
        kill -0 "${!v}" 2>/dev/null || not_up "$r" "exited (log: $work/$r.log)"
    done
    python3 - "$sport" 2>/dev/null <<'PY' && break
import sys, urllib.request
with urllib.request.urlopen("http://127.0.0.1:%s/health" % sys.argv[1], timeout=2) as r:
    sys.exit(0 if r.status == 200 else 1)
PY
    [ "$(date +%s)" -lt "$health_deadline" ] ||
        not_up "pd-scheduler" "/health on 127.0.0.1:$sport is not 200 after $health_s s"
    sleep 0.5
done
step "serving (/health 200 after $(($(date +%s) - t_start)) s)"

# ---- pd-bench per concurrency level ---------------------------------------------------------
for c in "${conc[@]}"; do
    step "pd-bench: concurrency $c, $num_prompts prompts, input $input_len, output $output_len"
    save=()
    [ -f "$work/prompts.ids" ] || save=(--save-dataset "$work/prompts.ids")
    rm -f "$work/bench_c$c.json"
    run_step "$work/bench_c$c.log" "$work/bench_c$c.log" \
        "$bench_bin" --base-url "http://127.0.0.1:$sport" --endpoint /v1/completions \
        --model "$name" --dataset random --num-prompts "$num_prompts" \
        --random-input-len "$input_len" --random-output-len "$output_len" \
        --random-vocab-size "$vocab" --request-rate inf --max-concurrency "$c" \
        --warmup "$warmup" --seed 0 --quiet --result-file "$work/bench_c$c.json" "${save[@]}" ||
        { show_log "$work/bench_c$c.log"; die "pd-bench failed at concurrency $c"; }
    python3 - "$work/bench_c$c.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("   %d completed, %d failed in %.2f s; %.1f output tokens/s%s" % (
    r["completed"], r["failed"], r["duration"], r["output_throughput"],
    "; first error: " + r["first_errors"][0] if r["first_errors"] else ""))
PY
done
for r in prefill decode scheduler; do
    v=${r}_pid
    kill -0 "${!v}" 2>/dev/null ||
        { show_log "$work/$r.log"; die "$r exited during the benchmark"; }
done
step "stopping the servers (the colocated baseline takes the device next)"
stop_all

# ---- colocated baseline: pd-generate on the same prompts -------------------------------------
gen_dev=()
[ "$device" = cpu ] || gen_dev=(--cuda-device 0 --dtype "$dtype")
for c in "${conc[@]}"; do
    step "pd-generate (colocated): concurrency $c"
    run_step "$work/colocated_c$c.jsonl" "$work/colocated_c$c.log" \
        "$gen_bin" --model "$model" --prompts-file "$work/prompts.ids" \
        --max-tokens "$output_len" --concurrency "$c" --json --bench "${gen_dev[@]}" ||
        { show_log "$work/colocated_c$c.log"; die "pd-generate failed at concurrency $c"; }
done

# ---- the table ------------------------------------------------------------------------------
step "results"
python3 - "$work" "$num_prompts" "$output_len" "${conc[@]}" <<'PY' | tee "$work/table.md"
import json, os, re, sys
work, n_prompts, out_len, levels = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
bench_re = re.compile(
    r"bench: prefill \d+ tokens in ([0-9.]+) s .*; decode \d+ tokens in ([0-9.]+) s")
cols = ["concurrency", "req/s", "output tok/s", "TTFT mean (ms)", "TTFT median (ms)",
        "TTFT p99 (ms)", "TPOT mean (ms)", "ITL p99 (ms)", "E2EL mean (ms)", "failed",
        "colocated output tok/s"]
print("| " + " | ".join(cols) + " |")
print("| " + " | ".join("---:" for _ in cols) + " |")
notes = []
for c in levels:
    r = json.load(open(os.path.join(work, "bench_c%s.json" % c)))
    # colocated: generated tokens / (start -> last token), from pd-generate's JSON lines and
    # its "bench:" line (engine time only, model load excluded, as pd-bench excludes start-up)
    gen_tokens = 0
    with open(os.path.join(work, "colocated_c%s.jsonl" % c)) as f:
        for line in f:
            if line.strip():
                gen_tokens += len(json.loads(line)["token_ids"])
    m = None
    with open(os.path.join(work, "colocated_c%s.log" % c)) as f:
        for line in f:
            m = bench_re.search(line) or m
    if m is None:
        sys.exit("serve_bench.sh: no 'bench:' line in colocated_c%s.log" % c)
    secs = float(m.group(1)) + float(m.group(2))
    coloc = gen_tokens / secs if secs > 0 else float("nan")
    if gen_tokens != n_prompts * out_len:
        notes.append("concurrency %s: the colocated run generated %d tokens, not %d "
                     "(pd-generate stops at EOS; pd-bench sends ignore_eos)"
                     % (c, gen_tokens, n_prompts * out_len))
    if r["failed"]:
        notes.append("concurrency %s: %d failed; first error: %s" %
                     (c, r["failed"], (r.get("first_errors") or ["?"])[0]))
    row = [c, "%.2f" % r["request_throughput"], "%.1f" % r["output_throughput"]]
    row += ["%.2f" % r[k] for k in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                                   "mean_tpot_ms", "p99_itl_ms", "mean_e2el_ms")]
    row += [str(r["failed"]), "%.1f" % coloc]
    print("| " + " | ".join(row) + " |")
for n in notes:
    print("\nNote: " + n)
PY
step "done in $(($(date +%s) - t_start)) s; files in $work"
