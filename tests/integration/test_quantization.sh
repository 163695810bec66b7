#!/usr/bin/env bash
# Quantized checkpoints served split: for AWQ, GPTQ (4 bit act order, 8 bit symmetric v2), fp8
# and int8 W8A8 models written by pd-mkmodel --quantize, a 1P1D cluster started by
# deploy/start_servers.sh with --quantization as vLLM spells it answers greedy completions whose
# token ids equal colocated pd-generate's on the same checkpoint (the prefill instance computed
# the prompt's KV from the quantized weights, the decode instance the rest); and the start-up
# refusals: a --quantization that is not the checkpoint's, and one given for a float checkpoint.
# The fp8 KV cache (--kv-cache-dtype fp8) the same way, with the KV bytes each request moves and
# the teacher-forced agreement with the numpy reference's e4m3 cache (kv_fp8_agreement.py).
set -u
# shellcheck source=tests/integration/lib_cluster.sh
. "$(dirname "$0")/lib_cluster.sh"

mk() { # DIR FLAGS...: a tiny quantized model with the tokenizer
    local d=$1
    shift
    "$bin/tools/mkmodel/pd-mkmodel" --preset tiny --layers 2 --out "$d" "$@" >/dev/null || fail "pd-mkmodel $*"
}

# start-up refusals, naming the flag and the checkpoint's method
mk "$work/awq" --quantize awq
mk "$work/float"
refuse() { # MODEL WANT FLAGS...
    local m=$1 want=$2 out
    shift 2
    out=$(timeout 60 "$bin/tools/generate/pd-generate" --model "$m" --prompt-ids 1,2 --max-tokens 1 "$@" 2>&1) &&
        fail "accepted: $m $*"
    grep -qF -- "$want" <<<"$out" || fail "for $m $*: want '$want', got: $out"
}
refuse "$work/awq" "--quantization gptq, but $work/awq/config.json's quantization_config.quant_method is awq" \
    --quantization gptq
refuse "$work/float" "--quantization awq, but $work/float/config.json has no quantization_config" \
    --quantization awq
refuse "$work/awq" '--quantization: unknown method "q4_0"' --quantization q4_0
refuse "$work/float" '--kv-cache-dtype: "fp8_e5m2" is not supported' --kv-cache-dtype fp8_e5m2

prompts=("red green blue red green blue" "one two three four five six seven")
for spec in "awq:awq_marlin:--quantize awq" \
            "gptq4:gptq:--quantize gptq --desc-act --group-size 32" \
            "gptq8:gptq:--quantize gptq --bits 8 --sym --checkpoint-format gptq_v2" \
            "fp8:fp8:--quantize fp8" \
            "w8a8:smoothquant:--quantize w8a8"; do
    IFS=: read -r name method flags <<<"$spec"
    model="$work/$name"
    # shellcheck disable=SC2086 # the flags are words
    [ -d "$model" ] || mk "$model" $flags
    start_1p1d --quantization "$method"
    for p in "${prompts[@]}"; do
        body=$(printf '{"model":"tiny","prompt":"%s","max_tokens":24,"ignore_eos":true,"temperature":0,"return_tokens_as_token_ids":true,"logprobs":0}' "$p")
        got=$(curl -s "http://127.0.0.1:$sp/v1/completions" -H 'Content-Type: application/json' -d "$body") ||
            fail "$name: completion"
        ids=$($py -c 'import json,sys; r=json.loads(sys.argv[1]); print(",".join(t.split(":")[1] for t in r["choices"][0]["logprobs"]["tokens"]))' "$got") ||
            fail "$name: completion: $got"
        want=$("$bin/tools/generate/pd-generate" --model "$model" --prompt "$p" --max-tokens 24 --ignore-eos \
            --temperature 0 --json --cpu-threads 1 --quantization "$method" 2>/dev/null |
            $py -c 'import json,sys; print(",".join(map(str, json.load(sys.stdin)["token_ids"])))') ||
            fail "$name: pd-generate"
        [ "$ids" = "$want" ] || fail "$name: served $ids, colocated pd-generate $want"
        [ "$(tr ',' '\n' <<<"$ids" | sort -u | wc -l)" -ge 4 ] || fail "$name: degenerate output $ids"
    done
    echo "ok $name ($method): 1P1D greedy = pd-generate"
    stop_all
done

# The fp8 KV cache, with scales calibrated into the checkpoint (k_scale / v_scale, read by both
# instances): served split (the prefill instance's fp8 KV moved over TCP) = colocated
# pd-generate with the same flag; pd:kv_transfer_bytes_total grows by 2 x layers x prompt tokens
# x KV heads x head_dim bytes per request, a quarter of the float32 cache's (half of bf16's).
model="$work/kvfp8"
mk "$model"
$py "$src/tests/reference/kv_calibrate.py" "$model" >/dev/null || fail "kv_calibrate.py"
kv_bytes() { curl -s "http://127.0.0.1:$sp/metrics" | awk '/^pd:kv_transfer_bytes_total/ {s += $NF} END {printf "%.0f", s}'; }
geom=$($py -c 'import json,sys; c=json.load(open(sys.argv[1])); print(c["num_hidden_layers"] * c["num_key_value_heads"] * c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]))' "$model/config.json")
declare -A per_token
for kvd in auto fp8; do
    start_1p1d --kv-cache-dtype "$kvd"
    for p in "${prompts[@]}"; do
        body=$(printf '{"model":"tiny","prompt":"%s","max_tokens":24,"ignore_eos":true,"temperature":0,"return_tokens_as_token_ids":true,"logprobs":0}' "$p")
        got=$(curl -s "http://127.0.0.1:$sp/v1/completions" -H 'Content-Type: application/json' -d "$body")
        ids=$($py -c 'import json,sys; r=json.loads(sys.argv[1]); print(",".join(t.split(":")[1] for t in r["choices"][0]["logprobs"]["tokens"]))' "$got") ||
            fail "kv $kvd: completion: $got"
        want=$("$bin/tools/generate/pd-generate" --model "$model" --prompt "$p" --max-tokens 24 --ignore-eos \
            --temperature 0 --json --cpu-threads 1 --kv-cache-dtype "$kvd" 2>/dev/null |
            $py -c 'import json,sys; print(",".join(map(str, json.load(sys.stdin)["token_ids"])))') ||
            fail "kv $kvd: pd-generate"
        [ "$ids" = "$want" ] || fail "kv $kvd: served $ids, colocated pd-generate $want"
    done
    # the bytes one request moves (a prompt nothing cached; Stats reach /metrics each heartbeat)
    before=$(kv_bytes)
    got=$(curl -s "http://127.0.0.1:$sp/v1/completions" -H 'Content-Type: application/json' \
        -d "{\"model\":\"tiny\",\"prompt\":\"bytes moved by the $kvd cache for this prompt\",\"max_tokens\":2}")
    n=$($py -c 'import json,sys; print(json.loads(sys.argv[1])["usage"]["prompt_tokens"])' "$got") ||
        fail "kv $kvd: completion: $got"
    for _ in $(seq 50); do
        after=$(kv_bytes)
        [ "$after" != "$before" ] && break
        sleep 0.1
    done
    per_token[$kvd]=$(( (after - before) / n ))
    [ $(( (after - before) % n )) = 0 ] || fail "kv $kvd: $((after - before)) bytes for $n tokens"
    grep -q "Using KV cache scaling factor 1.0" "$work/prefill.log" && fail "kv $kvd: the checkpoint's scales were not read"
    echo "ok kv-cache-dtype $kvd: 1P1D greedy = pd-generate; ${per_token[$kvd]} KV bytes per prompt token"
    stop_all
done
[ "${per_token[fp8]}" = $((2 * geom)) ] || fail "fp8 KV: ${per_token[fp8]} bytes per token, want $((2 * geom))"
[ "${per_token[auto]}" = $((8 * geom)) ] || fail "float32 KV: ${per_token[auto]} bytes per token, want $((8 * geom))"

# a prefill instance with an fp8 cache and a decode instance with a float32 one: the scheduler
# keeps the one verified second out (the decode instance, or the prefill one when it came up
# later), naming both dtypes and the flag
prefill_extra="--kv-cache-dtype fp8" decode_extra="--kv-cache-dtype auto" no_wait=1 start_1p1d
wait_log "$work/scheduler.log" "does not fit this scheduler: its KV cache holds (float32, prefill instance 0's holds float8_e4m3fn|float8_e4m3fn, decode instance 0's holds float32): start every instance with the same --kv-cache-dtype" ||
    fail "mixed KV cache dtypes were not refused"
code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$sp/v1/completions" -H 'Content-Type: application/json' -d '{"model":"tiny","prompt":"hi","max_tokens":2}')
[ "$code" = 503 ] || fail "mixed KV cache dtypes: HTTP $code, want 503"
stop_all
echo "ok mixed --kv-cache-dtype refused by the scheduler"
# the same for KV blocks of another size
prefill_extra="--block-size 32" no_wait=1 start_1p1d
wait_log "$work/scheduler.log" "its KV blocks hold (16 tokens, prefill instance 0's hold 32|32 tokens, decode instance 0's hold 16): start every instance with the same --block-size" ||
    fail "mixed block sizes were not refused"
stop_all
echo "ok mixed --block-size refused by the scheduler"

# teacher-forced: pdserve's fp8 choices = the numpy reference's with the same e4m3 rounding
$py "$src/tests/reference/kv_fp8_agreement.py" --generate "$bin/tools/generate/pd-generate" \
    --model "$model" --prompts 2 --tokens 48 --min-impl 0.98 || fail "fp8 KV agreement"
echo "PASS"
