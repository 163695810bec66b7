#!/usr/bin/env bash
# Speculative decoding through the guide's launcher: a 1P1D cluster whose every role gets the
# n-gram flags on one command line (deploy/start_servers.sh; the prefill instance and the
# api-server ignore them), greedy and seeded completions whose token ids equal pd-generate's
# plain decoding of the same prompts, vllm:spec_decode_* counters on /metrics, and the flags'
# refusals (vLLM's messages, naming what is wrong).
set -u
# shellcheck source=tests/integration/lib_cluster.sh
. "$(dirname "$0")/lib_cluster.sh"

# refusals, before any cluster: the flags are checked at parse time (exit 2)
refuse() {
    local want=$1 out
    shift
    out=$("$bin/decode_node/pd-decode" --model /nonexistent --port 1 "$@" 2>&1) && fail "accepted: $*"
    grep -qF -- "$want" <<<"$out" || fail "for $*: want '$want', got: $out"
}
refuse "Expected both speculative_model and num_speculative_tokens to be provided, but found speculative_model=[ngram] and num_speculative_tokens=None." \
    --speculative-model '[ngram]'
refuse "draft models are not supported yet" --speculative-model /models/draft --num-speculative-tokens 3
refuse "ngram_prompt_lookup_max=0 must be > 0" --speculative-model '[ngram]' --num-speculative-tokens 3
refuse "prompt_lookup_min=4 must be <= prompt_lookup_max=2" --speculative-model '[ngram]' \
    --num-speculative-tokens 3 --ngram-prompt-lookup-max 2 --ngram-prompt-lookup-min 4
refuse "--speculative-config: method eagle is not supported" \
    --speculative-config '{"method":"eagle","num_speculative_tokens":3}'
refuse "--speculative-config: unknown key 'draft_tensor_parallel_size'" \
    --speculative-config '{"method":"ngram","num_speculative_tokens":3,"draft_tensor_parallel_size":1}'
refuse "cannot be combined" --speculative-config '{"method":"ngram","num_speculative_tokens":3}' \
    --speculative-model '[ngram]'

start_1p1d --speculative-model '[ngram]' --num-speculative-tokens 4 --ngram-prompt-lookup-max 3
grep -q "speculative decoding: \[ngram\]" "$work/decode.log" || fail "decode log: no speculative decoding line"

# prompts that repeat a phrase (what prompt lookup finds); greedy, then seeded sampling
prompts=("red green blue red green blue red green blue" "one two three four one two three four one two")
for i in 0 1; do
    for mode in greedy seeded; do
        if [ $mode = greedy ]; then samp='"temperature":0'; gen=(--temperature 0);
        else samp='"temperature":0.8,"top_p":0.9,"seed":77'; gen=(--temperature 0.8 --top-p 0.9 --seed 77); fi
        body=$(printf '{"model":"tiny","prompt":"%s","max_tokens":48,"ignore_eos":true,%s,"return_tokens_as_token_ids":true,"logprobs":0}' \
            "${prompts[$i]}" "$samp")
        got=$(curl -s "http://127.0.0.1:$sp/v1/completions" -H 'Content-Type: application/json' -d "$body") ||
            fail "completion $i $mode"
        ids=$($py -c 'import json,sys; r=json.loads(sys.argv[1]); print(",".join(t.split(":")[1] for t in r["choices"][0]["logprobs"]["tokens"]))' "$got") ||
            fail "completion $i $mode: $got"
        want=$("$bin/tools/generate/pd-generate" --model "$work/tiny" --prompt "${prompts[$i]}" --max-tokens 48 \
            "${gen[@]}" --json --cpu-threads 1 2>/dev/null | $py -c 'import json,sys; print(",".join(map(str, json.load(sys.stdin)["token_ids"])))') ||
            fail "pd-generate $i $mode"
        [ "$ids" = "$want" ] || fail "prompt $i ($mode): served $ids, plain decoding $want"
    done
done

m=$(curl -s "http://127.0.0.1:$sp/metrics")
val() { awk -v n="$1" '$1 ~ "^"n"\\{" {print $2}' <<<"$m" | head -1; }
drafts=$(val vllm:spec_decode_num_drafts_total) dt=$(val vllm:spec_decode_num_draft_tokens_total)
acc=$(val vllm:spec_decode_num_accepted_tokens_total)
if [ -z "$drafts" ] || [ -z "$dt" ] || [ -z "$acc" ]; then
    fail "no vllm:spec_decode_* counters: $(grep spec_decode <<<"$m")"
fi
$py -c 'import sys; d,t,a=map(float,sys.argv[1:]); sys.exit(0 if d>0 and t>=d and 0<a<=t else 1)' "$drafts" "$dt" "$acc" ||
    fail "spec counters: drafts $drafts, draft tokens $dt, accepted $acc"
grep -q '^vllm:spec_decode_num_accepted_tokens_per_pos_total{.*position="0"}' <<<"$m" || fail "no per-position counter"
echo "speculative: drafts $drafts, draft tokens $dt, accepted $acc"
echo "PASS"
