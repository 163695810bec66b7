#!/usr/bin/env bash
# Quantized checkpoints on the CPU (issue 34): for a preset made by pd-mkmodel as bf16, AWQ 4 bit
# and int8 W8A8 (the same float weights), bench_cpu's decode batch 1 (tokens/s and the fraction
# of the read-bandwidth bound at each model's bytes per token) and 512-token prefill, for our
# bf16 checkpoint both in f32 compute and in the bf16 compute mode (--dtype bfloat16); and, as the
# peer in the same rounds, llama.cpp's llama-bench on the same weights converted to GGUF
# (tools/bench/hf_to_gguf.py) and quantized by its own llama-quantize to Q4_0 (token embedding and
# output kept bf16, like ours): tg128 and pp512. Rounds alternate the runs; the table gives each
# figure's median over the rounds.
#
#   tools/bench/bench_quant.sh --llama DIR [--build DIR] [--preset medium] [--threads 2]
#       [--rounds 3]
# DIR: llama.cpp's build/bin (llama-bench, llama-quantize).
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$root/build preset=medium threads=2 rounds=3 llama=
while [ $# -gt 0 ]; do
  case "$1" in
    --build) bin=$(cd "$2" && pwd); shift ;;
    --llama) llama=$(cd "$2" && pwd); shift ;;
    --preset) preset=$2; shift ;;
    --threads) threads=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "bench_quant.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$llama" ] || { echo "bench_quant.sh: --llama DIR (llama.cpp's build/bin) is required" >&2; exit 2; }
bench_name=quant
# shellcheck source=tools/bench/lib_bench.sh
source "$root/tools/bench/lib_bench.sh"
py=/usr/bin/python3
mk="$bin/tools/mkmodel/pd-mkmodel"
"$mk" --preset "$preset" --dtype bfloat16 --out "$work/bf16" >/dev/null || exit 1
"$mk" --preset "$preset" --dtype bfloat16 --quantize awq --out "$work/awq" >/dev/null || exit 1
"$mk" --preset "$preset" --dtype bfloat16 --quantize w8a8 --out "$work/w8a8" >/dev/null || exit 1
$py "$root/tools/bench/hf_to_gguf.py" "$work/bf16" "$work/bf16.gguf" --outtype bf16 >/dev/null || exit 1
"$llama/llama-quantize" --output-tensor-type bf16 --token-embedding-type bf16 "$work/bf16.gguf" \
  "$work/q4_0.gguf" Q4_0 >"$work/quantize.log" 2>&1 || { cat "$work/quantize.log"; exit 1; }

# bench_cpu's lines "NAME: v1 v2 ... UNIT | best ..." -> "key value" for the figures we keep
ours() { # NAME MODEL [bench_cpu flags]
  local name=$1 model=$2
  shift 2
  "$bin/tests/unit/backend/bench_cpu" --model "$model" --threads "$threads" --reps 1 \
    --decode-steps 64 "$@" 2>&1 |
    awk -v n="$name" -F': ' '/^decode batch 1:/ {split($2, a, " "); print n, "decode", a[1]}
      /^decode fraction of bandwidth bound:/ {split($2, a, " "); print n, "bound%", a[1]}
      /^prefill 512 tokens:/ {split($2, a, " "); print n, "prefill", a[1]}
      /^weights on backend/ {sub(/.*streamed per decode step: /, ""); print n, "MiB", $0}'
}
llama_bench() {
  "$llama/llama-bench" -m "$work/q4_0.gguf" -t "$threads" -p 512 -n 128 -r 1 -o csv 2>/dev/null |
    $py -c 'import csv,sys
for r in csv.DictReader(sys.stdin):
    print("llama.cpp-Q4_0", "prefill" if r["n_prompt"] != "0" else "decode", r["avg_ts"])'
}
for r in $(seq "$rounds"); do
  echo "round $r: $(uptime | sed 's/.*load/load/')" >&2
  ours awq "$work/awq"
  llama_bench
  ours w8a8 "$work/w8a8"
  ours bf16-f32compute "$work/bf16"
  ours bf16-bf16compute "$work/bf16" --compute-dtype bfloat16
done >"$work/results.txt"
$py - "$work/results.txt" <<'EOF'
import statistics, sys
vals = {}
for line in open(sys.argv[1]):
    name, key, v = line.split(None, 2)
    vals.setdefault((name, key), []).append(float(v.split()[0]))
names = ["awq", "llama.cpp-Q4_0", "w8a8", "bf16-f32compute", "bf16-bf16compute"]
print("| run | MiB read per token | decode tok/s (median) | % of bandwidth bound | prefill 512 tok/s (median) |")
print("| --- | --- | --- | --- | --- |")
for n in names:
    d = vals.get((n, "decode"), [])
    b = vals.get((n, "bound%"), [])
    p = vals.get((n, "prefill"), [])
    mib = vals.get((n, "MiB"))
    f = lambda xs: f"{statistics.median(xs):.1f} ({', '.join(f'{x:.0f}' for x in xs)})" if xs else "-"
    print(f"| {n} | {mib[0] if mib else '-'} | {f(d)} | "
          f"{f'{statistics.median(b):.1f}' if b else '-'} | {f(p)} |")
awq, ll = vals.get(("awq", "decode")), vals.get(("llama.cpp-Q4_0", "decode"))
if awq and ll:
    print(f"\nAWQ decode / llama.cpp Q4_0 decode: {statistics.median(awq) / statistics.median(ll):.2f}x")
w8, bf = vals.get(("w8a8", "prefill")), vals.get(("bf16-bf16compute", "prefill"))
bf32 = vals.get(("bf16-f32compute", "prefill"))
if w8 and bf and bf32:
    print(f"W8A8 prefill / bf16 prefill: {statistics.median(w8) / statistics.median(bf):.2f}x "
          f"(bf16 compute mode), {statistics.median(w8) / statistics.median(bf32):.2f}x (f32 compute)")
EOF
