#!/usr/bin/env bash
# Runs every pdserve test: installs what is missing, builds build/ (CUDA objects too when nvcc
# exists) and build-asan/ (ASan + UBSan), runs unit, integration, GPU and deploy tests in both, and
# ends with one line "N passed, M failed, K skipped". Exit status non-zero on any failure.
#   tests/run.sh            full run (what CI does)
#   tests/run.sh --fast     skip the sanitizer build
#   tests/run.sh --suite S  only meson suite S (unit, integration, gpu, deploy); may repeat
# GPU tests exit 77 without a device and are counted as skipped, with the reason printed.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
start=$(date +%s)

fast=0
suites=()
while [ $# -gt 0 ]; do
  case "$1" in
    --fast) fast=1 ;;
    --suite) shift; suites+=(--suite "$1") ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
  shift
done

deploy/install_deps.sh || { echo "run.sh: dependency install failed"; echo "0 passed, 1 failed"; exit 1; }
tests/npm_cache.sh || { echo "run.sh: npm packages for reference tests could not be installed"; echo "0 passed, 1 failed"; exit 1; }

# nvcc is found through PATH; fall back to the usual toolkit location so CUDA objects build.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export NVCC=/usr/local/cuda/bin/nvcc
fi

jobs=$(nproc)
# Warnings are errors here (and in CI), not in a user's build (meson.build's default).
builds=("build|-Dwerror=true -Dcuda=auto")
[ "$fast" = 1 ] || builds+=("build-asan|-Dwerror=true -Dsanitize=true -Db_lundef=false -Dcuda=disabled")

passed=0; failed=0; skipped=0; rc=0
for spec in "${builds[@]}"; do
  dir=${spec%%|*}; opts=${spec#*|}
  echo "== $dir ($opts)"
  if [ ! -f "$dir/build.ninja" ]; then
    # shellcheck disable=SC2086
    meson setup "$dir" $opts >"$dir.setup.log" 2>&1 || { cat "$dir.setup.log"; echo "run.sh: meson setup $dir failed"; failed=$((failed+1)); rc=1; continue; }
    rm -f "$dir.setup.log"
  else
    meson configure "$dir" -Dwerror=true >/dev/null # a directory made before with another default
  fi
  if ! ninja -C "$dir" -j "$jobs" >"$dir/ninja.log" 2>&1; then
    grep -E "error|FAILED" -A5 "$dir/ninja.log" | head -60
    echo "run.sh: build $dir failed"; failed=$((failed+1)); rc=1; continue
  fi
  mult=1; [ "$dir" = build-asan ] && mult=3
  meson test -C "$dir" --num-processes "$jobs" -t "$mult" --print-errorlogs "${suites[@]}" >"$dir/test.log" 2>&1 || rc=1
  counts=$(/usr/bin/python3 tests/count_results.py "$dir/meson-logs/testlog.json") || { echo "run.sh: no test log in $dir"; failed=$((failed+1)); rc=1; continue; }
  read -r p f s <<<"$(tail -n 1 <<<"$counts")"
  sed '$d' <<<"$counts"
  echo "   $dir: $p passed, $f failed, $s skipped"
  passed=$((passed+p)); failed=$((failed+f)); skipped=$((skipped+s))
  [ "$f" -gt 0 ] && rc=1
done

echo "== run time $(( $(date +%s) - start )) s"
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ] && [ $rc -eq 0 ]
