#!/usr/bin/env bash
# pd-bench against a real 1P1D cluster (deploy issue, acceptance): starts pd-prefill, pd-decode
# and pd-scheduler through deploy/start_servers.sh on free ports with the tiny synthetic model,
# runs pd-bench (16 prompts, concurrency 4) writing its JSON result and the raw SSE timestamps
# of the same run, then recomputes TTFT and ITL from those raw events with an independent
# Python parser and requires agreement within 5 %, 16 completed requests, no failure and
# exactly 16 x output-length generated tokens. Also checks that a bad option and a dead server
# give clear errors, and runs the soak's mixed workload (--workload mixed --duration, client
# aborts) with every request shape seen in the raw events and both KV pools whole afterwards
# (--node-stats), and that prompts of a shared prefix hit the prefill instance's prefix cache.
# Bounded in time; stops everything it started; exit 0 = pass.
set -uo pipefail
# shellcheck source=tests/integration/lib_cluster.sh
. "$(dirname "$0")/lib_cluster.sh"
bench="$bin/tools/bench/pd-bench"

# option errors are clear and exit 1, before any network traffic
out=$("$bench" --endpoint /v2/foo 2>&1); st=$?
[ $st = 1 ] && grep -q -- "--endpoint: expected" <<<"$out" || fail "bad --endpoint: status $st, $out"
out=$("$bench" --random-range-ratio 1.5 --base-url http://127.0.0.1:1 2>&1); st=$?
[ $st = 1 ] && grep -q -- "--random-range-ratio" <<<"$out" || fail "bad ratio: status $st, $out"

start_1p1d

# the acceptance run: completions with token-id prompts, 16 prompts, 4 in flight
n=16 olen=24
"$bench" --base-url "http://127.0.0.1:$sp" --endpoint /v1/completions --model tiny \
    --num-prompts $n --random-input-len 48 --random-output-len $olen --max-concurrency 4 \
    --warmup 2 --seed 3 --goodput ttft:60000,e2el:60000 --timeout 60 \
    --result-file "$work/result.json" --dump-timestamps "$work/ts.jsonl" \
    >"$work/bench.log" 2>&1 || fail "pd-bench exited with $?: $(cat "$work/bench.log")"
cat "$work/bench.log"
$py - "$work/result.json" "$work/ts.jsonl" $n $olen 48 <<'PY' || fail "pd-bench figures disagree"
import json, sys
res = json.load(open(sys.argv[1]))
n, olen, ilen = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
assert res["completed"] == n and res["failed"] == 0, (res["completed"], res["failed"], res["errors"])
assert res["total_output_tokens"] == n * olen, res["total_output_tokens"]
assert res["output_lens"] == [olen] * n, res["output_lens"]
assert res["total_input_tokens"] == n * ilen, res["total_input_tokens"]   # id prompts, no BOS
assert res["max_concurrency"] == 4 and res["request_goodput"] > 0
# independent recomputation from the raw stream: classify every SSE payload ourselves
ttfts, itls, counted = [], [], 0
for line in open(sys.argv[2]):
    r = json.loads(line)
    assert r["ok"], r
    tok_times, usage, done = [], None, False
    for t, payload in r["events"]:
        if payload == "[DONE]":
            done = True
            continue
        ev = json.loads(payload)
        assert "error" not in ev, ev
        if ev["choices"]:
            assert len(ev["choices"]) == 1 and "text" in ev["choices"][0], ev
            tok_times.append(t)
        if ev.get("usage"):
            usage = ev["usage"]
    assert done and usage and usage["completion_tokens"] == len(tok_times) == olen, (usage, len(tok_times))
    ttfts.append((tok_times[0] - r["send_ns"]) / 1e6)
    itls += [(b - a) / 1e6 for a, b in zip(tok_times, tok_times[1:])]
    counted += 1
assert counted == n, counted
mean = lambda v: sum(v) / len(v)
for name, mine, theirs in (("TTFT", mean(ttfts), res["mean_ttft_ms"]),
                           ("ITL", mean(itls), res["mean_itl_ms"])):
    rel = abs(mine - theirs) / max(mine, 1e-9)
    print(f"{name} mean: from raw SSE {mine:.3f} ms, pd-bench {theirs:.3f} ms, diff {rel*100:.3f} %")
    assert rel <= 0.05, name
# the per-request lists agree with the raw stream too
assert all(abs(a * 1e3 - b) <= 0.05 * b + 1e-6 for a, b in zip(res["ttfts"], ttfts))
assert len(res["itls"]) == n and all(len(g) == olen - 1 for g in res["itls"])
# summary statistics as numpy computes them (percentiles with linear interpolation)
import numpy as np
e2es = [e * 1e3 for e in res["e2els"]]
tpots = [(e - t) / (olen - 1) for e, t in zip(e2es, [x * 1e3 for x in res["ttfts"]])]
for name, v in (("ttft", ttfts), ("itl", itls), ("tpot", tpots), ("e2el", e2es)):
    for stat, ref in (("mean", np.mean(v)), ("median", np.median(v)), ("std", np.std(v)),
                      ("p90", np.percentile(v, 90)), ("p99", np.percentile(v, 99))):
        got = res[f"{stat}_{name}_ms"]
        assert abs(got - ref) <= 1e-3 * abs(ref) + 1e-6, (stat, name, got, ref)
dur = res["duration"]
assert abs(res["output_throughput"] - n * olen / dur) <= 1e-6 * res["output_throughput"]
assert abs(res["request_throughput"] - n / dur) <= 1e-6 * res["request_throughput"]
PY

# chat with random words, Poisson arrivals: every request completes with exact lengths
"$bench" --base-url "http://127.0.0.1:$sp" --endpoint /v1/chat/completions --model tiny \
    --num-prompts 6 --random-input-len 16 --random-output-len 8 --random-range-ratio 0.5 \
    --request-rate 20 --seed 5 --timeout 60 --quiet --result-file "$work/chat.json" \
    >"$work/chat.log" 2>&1 || fail "pd-bench chat exited with $?: $(cat "$work/chat.log")"
$py - "$work/chat.json" <<'PY' || fail "chat run: $(cat "$work/chat.log")"
import json, sys
r = json.load(open(sys.argv[1]))
assert r["completed"] == 6 and r["failed"] == 0, r["errors"]
assert all(4 <= o <= 12 for o in r["output_lens"]) and r["total_output_tokens"] == sum(r["output_lens"])
assert r["request_rate"] == 20 and all(l > 0 for l in r["input_lens"])
PY

# a JSONL dataset; the wrong model name is counted as a failure with the server's message
printf '{"prompt":"Hello there","output_len":5}\n{"prompt":"Tell me a story"}\n' >"$work/p.jsonl"
"$bench" --base-url "http://127.0.0.1:$sp" --model nosuch --dataset jsonl \
    --dataset-path "$work/p.jsonl" --num-prompts 2 --quiet >"$work/bad.log" 2>&1 && fail "all-failed run exited 0"
grep -q "Failed requests: *2" "$work/bad.log" && grep -q "HTTP 404" "$work/bad.log" ||
    fail "unclear failure report: $(cat "$work/bad.log")"
"$bench" --base-url "http://127.0.0.1:$sp" --model tiny --dataset jsonl --random-output-len 3 \
    --dataset-path "$work/p.jsonl" --num-prompts 2 --quiet --result-file "$work/jl.json" \
    >"$work/jl.log" 2>&1 || fail "jsonl run: $(cat "$work/jl.log")"
$py -c 'import json,sys; r=json.load(open(sys.argv[1])); assert r["output_lens"]==[5,3], r["output_lens"]' \
    "$work/jl.json" || fail "jsonl output lengths"

# a mixed workload for a fixed duration (the soak's traffic, tests/soak/soak.sh): completions and
# chat, streaming and not, n = 2, logprobs, client aborts; then both KV pools are whole again
"$bench" --base-url "http://127.0.0.1:$sp" --model tiny --workload mixed --abort-ratio 0.3 \
    --num-prompts 40 --random-input-len 24 --random-output-len 12 --random-range-ratio 0.5 \
    --request-rate 25 --duration 3 --max-concurrency 8 --seed 9 --timeout 60 --quiet \
    --result-file "$work/mixed.json" --dump-timestamps "$work/mixed.jsonl" >"$work/mixed.log" 2>&1 ||
    fail "mixed run: $(cat "$work/mixed.log")"
grep -q "Aborted requests (by the client):" "$work/mixed.log" || fail "no abort count: $(cat "$work/mixed.log")"
$py - "$work/mixed.json" "$work/mixed.jsonl" <<'PY' || fail "mixed run: $(cat "$work/mixed.log")"
import json, sys
r = json.load(open(sys.argv[1]))
n = r["num_prompts"]
assert r["failed"] == 0, r["error_kinds"]
assert 40 <= n <= 120 and r["completed"] + r["aborted"] == n and r["aborted"] > 0, (n, r["completed"], r["aborted"])
kinds = {"chat stream": 0, "chat body": 0, "completion stream": 0, "completion body": 0, "n=2": 0, "logprobs": 0}
for line in open(sys.argv[2]):
    d = json.loads(line)
    if not d["events"]:
        continue
    first = json.loads(d["events"][0][1])
    chunk = first["object"].endswith(".chunk") or first["object"] == "text_completion" and len(d["events"]) > 1
    kind = ("chat " if first["object"].startswith("chat") else "completion ") + ("stream" if chunk else "body")
    kinds[kind] += 1
    bodies = [json.loads(p) for _, p in d["events"] if p != "[DONE]"]
    if any(c.get("index") == 1 for b in bodies for c in b.get("choices", [])):
        kinds["n=2"] += 1
    if any(c.get("logprobs") for b in bodies for c in b.get("choices", [])):
        kinds["logprobs"] += 1
assert all(v > 0 for v in kinds.values()), kinds
print(f"mixed: {n} requests, {r['aborted']} aborted, shapes {kinds}")
PY
for port in "$pp" "$dp"; do
    for _ in $(seq 50); do
        "$bench" --node-stats "127.0.0.1:$port" >"$work/stats.json" || fail "--node-stats 127.0.0.1:$port"
        $py -c 'import json,sys; s=json.load(open(sys.argv[1])); sys.exit(0 if s["kv_blocks_free"]==s["kv_blocks_total"]>0 and s["num_running"]==0 else 1)' \
            "$work/stats.json" && break
        sleep 0.1
    done
    $py -c 'import json,sys; s=json.load(open(sys.argv[1])); assert s["kv_blocks_free"]==s["kv_blocks_total"]>0, s' \
        "$work/stats.json" || fail "KV pool of 127.0.0.1:$port not whole after the mixed run"
done
# prompts of a shared 64-token prefix (--random-prefix-len): the prefill instance finds it in its
# prefix cache for every prompt after the first (its Stats counters, read directly)
"$bench" --node-stats "127.0.0.1:$pp" >"$work/pc0.json" || fail "--node-stats before the prefix run"
"$bench" --base-url "http://127.0.0.1:$sp" --model tiny --num-prompts 4 --random-prefix-len 64 \
    --random-input-len 8 --random-output-len 2 --max-concurrency 1 --seed 5 --timeout 60 \
    --quiet >"$work/pc.log" 2>&1 || fail "prefix run: $(cat "$work/pc.log")"
"$bench" --node-stats "127.0.0.1:$pp" >"$work/pc1.json" || fail "--node-stats after the prefix run"
$py - "$work/pc0.json" "$work/pc1.json" <<'PY' || fail "prefix cache counters"
import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:3])
q, h = (b[k] - a[k] for k in ("prefix_cache_queries", "prefix_cache_hits"))
assert (q, h) == (4 * 72, 3 * 64), (q, h)   # 4 prompts of 72 tokens; 3 find 4 blocks each
print(f"prefix cache: {h} of {q} prompt tokens hit")
PY
# tools/bench/bench_n.py: n = 3 on 40-token prompts; the later choices of each prompt find its two
# full blocks on both instances (scheduler.md, n > 1), 2 x 2 x 32 hits on each of the two
$py "$src/tools/bench/bench_n.py" --port "$sp" --requests 2 --concurrency 2 --n 3 --prompt-len 40 \
    --max-tokens 4 --vocab 1000 --stats-wait 2.5 >"$work/bench_n.log" 2>&1 ||
    fail "bench_n.py: $(cat "$work/bench_n.log")"
grep -q "requests 2 (0 failed).*prefix cache hits 256 of 480 tokens" "$work/bench_n.log" ||
    fail "bench_n.py: $(cat "$work/bench_n.log")"
# tools/bench/bench_turns.py: 2 conversations of 2 turns (40 tokens, then those, 8 answered and 8
# new): turn 2 finds 2 blocks on each instance (the decode one computed 47 tokens of turn 1)
$py "$src/tools/bench/bench_turns.py" --port "$sp" --conversations 2 --turns 2 --concurrency 2 \
    --first-len 40 --turn-len 8 --answer-len 8 --vocab 1000 >"$work/bench_turns.log" 2>&1 ||
    fail "bench_turns.py: $(cat "$work/bench_turns.log")"
grep -q "conversations 2 (0 failed).*prefix cache hits 128 of 384 tokens" "$work/bench_turns.log" ||
    fail "bench_turns.py: $(cat "$work/bench_turns.log")"
out=$("$bench" --duration 5 2>&1); st=$?
[ $st = 2 ] && grep -q -- "--duration needs a finite --request-rate" <<<"$out" || fail "--duration without a rate: $st, $out"
out=$("$bench" --abort-ratio 0.1 2>&1); st=$?
[ $st = 2 ] && grep -q -- "--abort-ratio needs --workload mixed" <<<"$out" || fail "--abort-ratio alone: $st, $out"

for i in 2 0 1; do kill "${pids[$i]}"; done
for i in 0 1 2; do wait "${pids[$i]}"; done
pids=()
# a server that is gone: failures, exit 1, the connect error named
"$bench" --base-url "http://127.0.0.1:$sp" --num-prompts 2 --random-input-len 4 \
    --random-output-len 2 --quiet >"$work/dead.log" 2>&1 && fail "dead server: exit 0"
grep -q "connect 127.0.0.1:$sp" "$work/dead.log" || fail "dead server: $(cat "$work/dead.log")"
echo "PASS bench: pd-bench against 1P1D agrees with the raw SSE timestamps"
