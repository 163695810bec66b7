#!/usr/bin/env bash
# Quantized checkpoints served split: for AWQ, GPTQ (4 bit act order, 8 bit symmetric v2), fp8
# and int8 W8A8 models written by pd-mkmodel --quantize, a 1P1D cluster started by
# deploy/start_servers.sh with --quantization as vLLM spells it answers greedy completions whose
# token ids equal colocated pd-generate's on the same checkpoint (the prefill instance computed
# the prompt's KV from the quantized weights, the decode instance the rest); and the start-up
# refusals: a --quantization that is not the checkpoint's, and one given for a float checkpoint.
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
echo "PASS"
