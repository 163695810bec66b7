#!/usr/bin/env bash
# Pipeline parallelism served split: 1P1D clusters started by deploy/start_servers.sh from
# generated ranktables whose instances have 2 or 4 devices, each instance its own tensor-parallel
# x pipeline-parallel shape: P(PP 2) -> D(TP 2), P(TP 2) -> D(PP 2), P(TP 2 x PP 2) -> D(PP 4).
# The KV moves as the (layer, head) overlaps of every prefill rank with every decode rank; the
# greedy completions (and a stream) equal colocated pd-generate's unsplit run on the same
# 5-layer model (uneven stages: 3 + 2, 1 + 1 + 2 + 1). And the refusal of a shape that is not
# the instance's device count.
set -u
# shellcheck source=tests/integration/lib_cluster.sh
. "$(dirname "$0")/lib_cluster.sh"

model="$work/tiny5"
"$bin/tools/mkmodel/pd-mkmodel" --preset tiny --layers 5 --out "$model" >/dev/null || fail "pd-mkmodel"
prompts=("red green blue red green blue" "one two three four five six seven" "the cat sat on the")
want=()
for p in "${prompts[@]}"; do
    want+=("$("$bin/tools/generate/pd-generate" --model "$model" --prompt "$p" --max-tokens 24 \
        --ignore-eos --temperature 0 --json --cpu-threads 1 2>/dev/null |
        $py -c 'import json,sys; print(",".join(map(str, json.load(sys.stdin)["token_ids"])))')") ||
        fail "pd-generate"
done

for spec in "0,1:2,3:--pipeline-parallel-size 2:--tensor-parallel-size 2" \
            "0,1:2,3:--tensor-parallel-size 2:--pipeline-parallel-size 2" \
            "0,1,2,3:4,5,6,7:--tensor-parallel-size 2 --pipeline-parallel-size 2:--pipeline-parallel-size 4"; do
    IFS=: read -r prefill_devices decode_devices pflags dflags <<<"$spec"
    prefill_extra="--tensor-parallel-size 1 $pflags" decode_extra="--tensor-parallel-size 1 $dflags" \
        start_1p1d
    for i in "${!prompts[@]}"; do
        body=$(printf '{"model":"tiny","prompt":"%s","max_tokens":24,"ignore_eos":true,"temperature":0,"return_tokens_as_token_ids":true,"logprobs":0}' "${prompts[$i]}")
        got=$(curl -s "http://127.0.0.1:$sp/v1/completions" -H 'Content-Type: application/json' -d "$body")
        ids=$($py -c 'import json,sys; r=json.loads(sys.argv[1]); print(",".join(t.split(":")[1] for t in r["choices"][0]["logprobs"]["tokens"]))' "$got") ||
            fail "P($pflags) -> D($dflags): completion: $got"
        [ "$ids" = "${want[$i]}" ] || fail "P($pflags) -> D($dflags): served $ids, colocated ${want[$i]}"
    done
    # a stream: the same tokens, then [DONE]
    body=$(printf '{"model":"tiny","prompt":"%s","max_tokens":24,"ignore_eos":true,"temperature":0,"stream":true,"return_tokens_as_token_ids":true,"logprobs":0}' "${prompts[0]}")
    ids=$(curl -sN "http://127.0.0.1:$sp/v1/completions" -H 'Content-Type: application/json' -d "$body" |
        $py -c '
import json, sys
ids, done = [], False
for line in sys.stdin:
    line = line.strip()
    if line == "data: [DONE]": done = True
    elif line.startswith("data: "):
        ids += [t.split(":")[1] for t in json.loads(line[6:])["choices"][0]["logprobs"]["tokens"]]
print(",".join(ids) if done else "no [DONE]")') || fail "stream"
    [ "$ids" = "${want[0]}" ] || fail "P($pflags) -> D($dflags): streamed $ids, colocated ${want[0]}"
    grep -q "TP 1, PP 2\|TP 2, PP 1\|TP 2, PP 2\|TP 1, PP 4" "$work/prefill.log" || fail "no TP/PP start-up line"
    # each stage of each instance reports its compute time (Stats reach /metrics each heartbeat)
    np=$(grep -o -- "--pipeline-parallel-size [0-9]" <<<"$pflags" | grep -o "[0-9]$" || echo 1)
    nd=$(grep -o -- "--pipeline-parallel-size [0-9]" <<<"$dflags" | grep -o "[0-9]$" || echo 1)
    for _ in $(seq 50); do
        series=$(curl -s "http://127.0.0.1:$sp/metrics" | grep '^pd:pipeline_stage_seconds_total' |
            awk '$NF > 0' | grep -o 'role="[a-z]*".*stage="[0-9]*"' | sed 's/instance="[^"]*",//' | sort -u)
        [ "$(grep -c prefill <<<"$series")" = "$np" ] && [ "$(grep -c decode <<<"$series")" = "$nd" ] && break
        sleep 0.1
    done
    [ "$(grep -c prefill <<<"$series")" = "$np" ] && [ "$(grep -c decode <<<"$series")" = "$nd" ] ||
        fail "pd:pipeline_stage_seconds_total: want $np prefill and $nd decode stages busy, got: $series"
    echo "ok P($pflags) -> D($dflags): completions and a stream = colocated pd-generate"
    stop_all
done

# 2 devices cannot be 2 x 2 ranks
prefill_devices=0,1 decode_devices=2,3 prefill_extra="--tensor-parallel-size 2 --pipeline-parallel-size 2" no_wait=1 start_1p1d
wait_log "$work/prefill.log" "tensor-parallel-size 2 x --pipeline-parallel-size 2 does not match the 2 device\\(s\\) of prefill instance 0" ||
    fail "a 2 x 2 shape on 2 devices was not refused"
stop_all
echo "ok a tensor x pipeline shape that is not the device count is refused"
echo "PASS"
