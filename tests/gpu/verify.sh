#!/usr/bin/env bash
# The GPU verification pass in one command, on a GPU machine (docs/gpu.md): runs the test suites
# from a pack made by tests/gpu/devpack.sh, then every GPU benchmark of docs/benchmarks.md, and
# writes each one's output under OUT_DIR. Run from a copy of the source tree:
#   tests/gpu/verify.sh [--pack .devpack] [--out DIR] [--model DIR] [--skip-suites] [--ncu]
#                       [--only STEP,STEP...]
# Steps (each bounded by `timeout`): versions (GPU, NCCL libraries, peers installed); gpu, unit
# and integration suites; nccl_split and nccl_tp (the NCCL cases alone: KV over NCCL, the
# watchdog, TP 2 over NCCL; with one GPU in the one-GPU arrangement, docs/gpu.md), nccl_tp_wheel
# (the TP case again with the newest NCCL of the Python environment's wheels preloaded, when it
# is newer than the one linked); pd-mkmodel --preset 1b (unless --model names a model);
# bench_cuda (fused ops, then --no-fused, then serialized launches: PD_CUDA_PDL=0, then the WMMA
# prefill attention kernel: PD_CUDA_ATTN_TC=wmma); bench_kv_ipc; bench_pd ttft (CUDA IPC, TCP,
# NCCL); hf_generate and hf_generate_compiled (transformers generate on the same weights, eager
# and with a static cache under torch.compile); serve_bench.sh (1P1D on the GPU behind
# pd-scheduler, CUDA IPC); with --ncu, per-kernel times of two eager decode steps (ncu CSV,
# summed per kernel by ncu_summary.py), and ncu's detailed sections for two prefill attention
# launches and one decode layer's GEMVs. --only runs the steps named (and mkmodel when a step
# needs the model), for a device session too short for all of them; nccl_split and nccl_tp run
# only when named there.
# Ends with the list of steps and their exit status; exit 1 when any failed.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
pack=$root/.devpack out=${OUT:-/tmp/pdserve-verify} suites=1 ncu=0 model=/tmp/pdserve-1b only=
while [ $# -gt 0 ]; do
  case "$1" in
    --pack) pack=$(cd "$2" && pwd); shift ;;
    --out) out=$2; shift ;;
    --model) model=$2; shift ;;
    --skip-suites) suites=0 ;;
    --ncu) ncu=1 ;;
    --only) only=",$2,"; shift ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "verify.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
  shift
done
[ -f "$pack/run_tests.py" ] || { echo "verify.sh: no pack in $pack (tests/gpu/devpack.sh makes one)" >&2; exit 2; }
mkdir -p "$out"
unpack=/tmp/pdserve-pack
B=$unpack/build
# Tests call /usr/bin/python3 with numpy; where only another python3 on PATH has it (the lent
# machines' PyTorch environment), run them with that one's site-packages.
if ! /usr/bin/python3 -c 'import numpy' 2>/dev/null && python3 -c 'import numpy' 2>/dev/null; then
  sp=$(python3 -c 'import numpy,os;print(os.path.dirname(os.path.dirname(numpy.__file__)))')
  export PYTHONPATH=$sp${PYTHONPATH:+:$PYTHONPATH}
fi
summary=()
named() { [[ $only == *",$1,"* ]]; }
want() { [ -z "$only" ] || named "$1"; }
step() { # name, timeout, command...
  local name=$1 t=$2; shift 2
  want "$name" || return 0
  echo "== $name ($(date -u +%H:%M:%S))"
  timeout "$t" "$@" >"$out/$name.txt" 2>&1
  local rc=$?
  grep -vE " INFO |^\s*$" "$out/$name.txt" | tail -n "${TAILN:-25}"
  summary+=("$name: exit $rc")
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
n_gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
nv=$(python3 -c 'import site,glob,os;print(":".join(d for sp in site.getsitepackages() for d in glob.glob(os.path.join(sp,"nvidia","*","lib"))))' 2>/dev/null)
# NCCL's version of a libnccl.so.2 (ncclGetVersion), e.g. 22809
nccl_version() { python3 -c 'import ctypes,sys;v=ctypes.c_int();ctypes.CDLL(sys.argv[1]).ncclGetVersion(ctypes.byref(v));print(v.value)' "$1" 2>/dev/null; }
versions() {
  for f in /usr/local/cuda/lib64/libnccl.so.2 $(echo "$nv" | tr : '\n' | sed 's|$|/libnccl.so.2|'); do
    [ -e "$f" ] && echo "NCCL $(nccl_version "$f") at $f"
  done
  python3 -m pip list 2>/dev/null | grep -iE '^(torch|transformers|vllm|sglang|tensorrt.llm|nvidia-nccl\S*) ' || true
  python3 -c 'import vllm' 2>&1 | tail -1; python3 -c 'import sglang' 2>&1 | tail -1
}
want versions && versions 2>&1 | tee "$out/versions.txt"
step gpu_suite 900 python3 "$pack/run_tests.py" --suite gpu --unpack "$unpack" --logs "$out/gpu_logs.tgz"
if [ "$suites" = 1 ]; then
  step other_suites 900 python3 "$pack/run_tests.py" --suite unit --suite integration --jobs 12 --unpack "$unpack"
fi
# The NCCL cases alone, when named (the gpu suite runs them too)
named nccl_split && TAILN=60 step nccl_split 400 python3 "$pack/run_tests.py" --verbose --unpack "$unpack" --test gpu/cuda_split \
  --case cuda_split_nccl_equals_colocated --case cuda_split_nccl_dead_decode_leaves_prefill_serving
tp_cases=(--case cuda_engine_tp2_matches_tp1_f32_mode --case cuda_engine_tp2_nccl_matches_tp1_f32_mode)
named nccl_tp && TAILN=60 step nccl_tp 300 python3 "$pack/run_tests.py" --verbose --unpack "$unpack" --test gpu/cuda_engine "${tp_cases[@]}"
# The newest NCCL among the Python environment's wheels, when newer than the one linked
newest= newest_v=$(nccl_version /usr/local/cuda/lib64/libnccl.so.2)
for d in $(echo "$nv" | tr : ' '); do
  v=$(nccl_version "$d/libnccl.so.2")
  [ -n "$v" ] && [ "$v" -gt "${newest_v:-0}" ] && newest=$d/libnccl.so.2 newest_v=$v
done
if [ -n "$newest" ]; then
  LD_PRELOAD=$newest TAILN=40 step nccl_tp_wheel 300 python3 "$pack/run_tests.py" --verbose --unpack "$unpack" \
    --test gpu/cuda_engine --case cuda_engine_tp2_nccl_matches_tp1_f32_mode
fi
export LD_LIBRARY_PATH=$unpack/lib:/usr/local/cuda/lib64:$nv:${LD_LIBRARY_PATH:-}
export PD_BUILD_ROOT=$B
if [ -z "$only" ] || [[ $only == *,bench* || $only == *,ttft* || $only == *,hf_* || $only == *,serve* || $only == *,ncu* ]]; then
  only=${only:+$only,mkmodel,}
  [ -f "$model/config.json" ] || step mkmodel 300 "$B/tools/mkmodel/pd-mkmodel" --preset 1b --out "$model" --threads "$(nproc)"
fi
step bench_cuda 300 "$B/tests/gpu/bench_cuda" --model "$model"
step bench_cuda_plain_ops 300 "$B/tests/gpu/bench_cuda" --model "$model" --no-fused
PD_CUDA_PDL=0 step bench_cuda_no_pdl 300 "$B/tests/gpu/bench_cuda" --model "$model"
PD_CUDA_ATTN_TC=wmma step bench_cuda_wmma_prefill 300 "$B/tests/gpu/bench_cuda" --model "$model" --gen 8 --batch 4
step bench_kv_ipc 120 "$B/tests/gpu/bench_kv_ipc"
for t in cuda_ipc tcp; do
  step "ttft_$t" 200 "$B/tests/integration/bench_pd" ttft --model "$model" --prompt-len 1984 --reps 7 --device cuda --kv-transport "$t"
done
# NCCL with one GPU: each instance an NCCL host of its own (socket transport on loopback)
[ "$n_gpus" -ge 2 ] || export PD_TEST_NCCL_HOST_PER_NODE=1
step ttft_nccl 200 "$B/tests/integration/bench_pd" ttft --model "$model" --prompt-len 1984 --reps 7 --device cuda --kv-transport nccl
unset PD_TEST_NCCL_HOST_PER_NODE
step hf_generate 300 python3 "$root/tests/gpu/hf_decode_bench.py" "$model" --ttft-prompt 1984
step hf_generate_compiled 400 python3 "$root/tests/gpu/hf_decode_bench.py" "$model" --compile --ttft-prompt 1984
step serve_bench 600 "$root/tests/gpu/serve_bench.sh" --bin-dir "$B" --model "$model" --device cuda --dtype bfloat16 --kv-transport cuda_ipc --timeout 580 --work-dir "$out/serve"
if [ "$ncu" = 1 ] && command -v ncu >/dev/null; then
  # 138 launches per eager decode step of the 1b preset with the fused ops (22 layers x 6:
  # q/k/v with the norm, attention, the merge of its splits (contexts over 32), o, gate/up with
  # the norm, down; then embed, the last add, gather, final norm, LM head, download): two steps
  PD_CUDA_GRAPHS=0 TAILN=0 step ncu_decode 300 ncu --launch-skip 600 --launch-count 276 --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv --page raw "$B/tests/gpu/bench_cuda" --model "$model" --prompt 32 --gen 8 --prefill 16 --batch 1
  step ncu_decode_summary 30 python3 "$root/tests/gpu/ncu_summary.py" "$out/ncu_decode.txt" 2
  # where the time of the two kernels furthest from their goals goes (ncu's "detailed" set:
  # throughput, warp stall reasons, occupancy, memory tables): layers 0 and 1 of the 2048-token
  # prefill's tensor-core attention (the 1-token prompt before it takes the CUDA-core kernel),
  # and the four GEMV launches of decode layer 11 (q/k/v, o, gate/up + SwiGLU, down; skipped
  # before them: the prompt's LM head and 4 steps of 22 x 4 + 1 GEMVs)
  TAILN=0 step ncu_prefill_attention 300 ncu --kernel-name regex:attn_tc_mma --launch-count 2 --set detailed "$B/tests/gpu/bench_cuda" --model "$model" --prompt 1 --gen 8 --batch 1
  PD_CUDA_GRAPHS=0 TAILN=0 step ncu_decode_gemv 300 ncu --kernel-name regex:gemv_kernel --launch-skip 401 --launch-count 4 --set detailed "$B/tests/gpu/bench_cuda" --model "$model" --prompt 32 --gen 8 --prefill 16 --batch 1
fi
echo "== summary"
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
! grep -qv "exit 0$" "$out/summary.txt"
