#!/usr/bin/env bash
# Prefill backlog check (issue 29 item 3; not part of CI): a 1P1D cluster of the `small`
# pd-mkmodel model on loopback, every server with default flags (started with
# deploy/start_servers.sh), gets N completions of 1,500 distinct prompt tokens (16 output tokens)
# at once, more prefill work than one prefill instance finishes within the default
# --prefill-timeout (60 s) on a small machine. Prints the HTTP statuses and the slowest answer;
# exit 0 when every request got 200. A server that is only busy queues the work (or answers 503),
# never 500.
#
#   tests/soak/prefill_backlog.sh [--build DIR] [--sched-build DIR] [-n N] [--work-dir DIR]
#
# --sched-build: where pd-scheduler and pd-ranktable come from (another build, to compare a
# scheduler of another commit against the same instances); default --build (./build).
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$root/build sbin='' n=96 work=''
while [ $# -gt 0 ]; do
  case "$1" in
    --build) bin=$(cd "$2" && pwd); shift ;;
    --sched-build) sbin=$(cd "$2" && pwd); shift ;;
    -n) n=$2; shift ;;
    --work-dir) work=$2; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "prefill_backlog.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
  shift
done
sbin=${sbin:-$bin}
py=/usr/bin/python3
work=${work:-$(mktemp -d "${TMPDIR:-/tmp}/pdbacklog.XXXXXX")}
mkdir -p "$work"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  sleep 2
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
}
trap cleanup EXIT
free_port() { $py -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
"$bin/tools/mkmodel/pd-mkmodel" --preset small --out "$work/small" >/dev/null || exit 1
"$sbin/ranktable/cli/pd-ranktable" --mode gen --prefill-server-list 0 --decode-server-list 1 \
  --api-server --server-ip 127.0.0.1 --save-dir "$work" >/dev/null || exit 1
pp=$(free_port) dp=$(free_port) sp=$(free_port)
export GLOBAL_RANK_TABLE_FILE_PATH="$work/global_ranktable_127.0.0.1.json" NODE_PORTS="$pp,$dp" USE_OPENAI=1
for spec in "prefill:0:$pp:$bin" "decode:1:$dp:$bin" "scheduler:host:$sp:$sbin"; do
  IFS=: read -r role table port dir <<<"$spec"
  PD_BIN_DIR=$dir RANK_TABLE_FILE_PATH="$work/local_ranktable_127.0.0.1_$table.json" \
    "$root/deploy/start_servers.sh" --model "$work/small" --served-model-name small \
    --host 127.0.0.1 --port "$port" >"$work/$role.log" 2>&1 &
  pids+=($!)
done
for _ in $(seq 300); do curl -sf "http://127.0.0.1:$sp/health" >/dev/null && break; sleep 1; done
curl -sf "http://127.0.0.1:$sp/health" >/dev/null || { echo "the cluster did not start ($work)"; exit 1; }
$py - "$sp" "$n" <<'PY'
import collections, http.client, json, sys, threading, time
port, n, plen = int(sys.argv[1]), int(sys.argv[2]), 1500
res = [None] * n
def one(i):
    body = json.dumps({"model": "small", "max_tokens": 16, "ignore_eos": True,
                       "prompt": [3 + (i * 131 + t * 7) % 4000 for t in range(plen)]})
    t0 = time.time()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    d = r.read()
    res[i] = (r.status, time.time() - t0, d[:200])
threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
for t in threads: t.start()
for t in threads: t.join()
count = collections.Counter(r[0] for r in res)
print(f"{n} prompts of {plen} tokens at once: HTTP statuses {dict(sorted(count.items()))}; "
      f"the slowest answered after {max(r[1] for r in res):.1f} s")
bad = [r for r in res if r[0] != 200]
if bad: print("first non-200:", bad[0][0], bad[0][2].decode(errors="replace"))
sys.exit(1 if bad else 0)
PY
