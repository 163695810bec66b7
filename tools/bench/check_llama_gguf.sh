#!/usr/bin/env bash
# Proves tools/bench/hf_to_gguf.py against llama.cpp: a pd-mkmodel model written to GGUF, served
# by llama-server, must tokenize text as pdserve does and decode greedily the same tokens as
# pd-generate --temperature 0 for the same prompt ids. Prints each prompt's first difference and
# exits 1 when a prompt agrees on fewer than --min-match tokens (float rounding may part the two
# late in a long output; the f32 model agrees much longer than bf16).
#
#   tools/bench/check_llama_gguf.sh --llama-server BIN [--build DIR] [--model DIR | --preset tiny
#       [--mkmodel "FLAGS"]] [--outtype f32] [--tokens 32] [--min-match 16] [--prompts 4]
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$root/build llama="" model="" gguf="" preset=tiny mkflags="" outtype=f32 ntok=32 minm=16 nprompts=4
while [ $# -gt 0 ]; do
  case "$1" in
    --llama-server) llama=$2; shift ;;
    --build) bin=$(cd "$2" && pwd); shift ;;
    --model) model=$2; shift ;;
    --preset) preset=$2; shift ;;
    --mkmodel) mkflags=$2; shift ;;
    --outtype) outtype=$2; shift ;;
    --tokens) ntok=$2; shift ;;
    --min-match) minm=$2; shift ;;
    --prompts) nprompts=$2; shift ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "check_llama_gguf.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
  shift
done
bench_name=gguf
# shellcheck source=tools/bench/lib_bench.sh
source "$root/tools/bench/lib_bench.sh"
peer_model || exit $?
start_llama "$llama" -c 2048 -t 2 -np 1 || exit 1
vocab=$(/usr/bin/python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["vocab_size"])' "$model/config.json")
# prompts: ids drawn with a fixed seed below the vocabulary's specials, 8 + 8 i tokens long
/usr/bin/python3 - "$vocab" "$nprompts" >"$work/p.ids" <<'EOF'
import random, sys
vocab, n = int(sys.argv[1]), int(sys.argv[2])
rng = random.Random(7)
for i in range(n):
    print(",".join(str(rng.randrange(3, vocab - 3)) for _ in range(8 + 8 * i)))
EOF
"$bin/tools/generate/pd-generate" --model "$model" --prompts-file "$work/p.ids" --max-tokens "$ntok" \
  --temperature 0 --json >"$work/pd.jsonl" || exit 1
text="The history of the city, its people and their work: 1,234 words in 56 lines!"
"$bin/tools/generate/pd-generate" --model "$model" --prompt "$text" --max-tokens 1 --temperature 0 \
  --json >"$work/pd-text.jsonl" || exit 1
/usr/bin/python3 - "$llama_port" "$ntok" "$minm" "$text" "$work/pd.jsonl" "$work/pd-text.jsonl" <<'EOF'
import json, sys, urllib.request
port, ntok, minm, text, pd_file, pd_text = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:]
def post(path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=300))
ok = True
ours = json.loads(open(pd_text).readline())["prompt_token_ids"]
theirs = post("/tokenize", {"content": text})["tokens"]
print(f"tokenize: pdserve {len(ours)} ids, llama-server {len(theirs)} ids: "
      f"{'same' if ours == theirs else 'DIFFERENT'}")
ok &= ours == theirs
for i, line in enumerate(open(pd_file)):
    pd = json.loads(line)
    r = post("/completion", {"prompt": pd["prompt_token_ids"], "n_predict": ntok, "temperature": 0,
                             "return_tokens": True, "cache_prompt": False})
    a, b = pd["token_ids"], r["tokens"]
    same = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
    print(f"prompt {i} ({len(pd['prompt_token_ids'])} ids): pdserve {len(a)} tokens, llama-server "
          f"{len(b)}, first {same} equal" + (f"; then {a[same:same + 4]} vs {b[same:same + 4]}"
                                             if same < min(len(a), len(b)) else ""))
    ok &= same >= min(minm, len(a), len(b)) and (same < min(len(a), len(b)) or len(a) == len(b))
print("check_llama_gguf: " + ("agree" if ok else "DISAGREE"))
sys.exit(0 if ok else 1)
EOF
