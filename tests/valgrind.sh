#!/usr/bin/env bash
# Valgrind memcheck over the C tests (issue #9 item 6; not part of CI: it takes tens of minutes).
# Every C unit test and every C integration test runs under
#   valgrind --leak-check=full --errors-for-leak-kinds=definite --error-exitcode=99
# and so does every pd-* process the integration harness (tests/integration/cluster.c) spawns:
# PD_TEST_WRAPPER carries the valgrind command line to it, PD_TEST_TIME_SCALE stretches the
# harness's process deadlines (and the --heartbeat-ms it gives pd-scheduler) and meson's
# --timeout-multiplier the test timeouts. Shell and
# Python tests are not run (they test scripts, not memory). Each process writes its own log;
# at the end every log with an error or a definite leak is listed with its first stack.
# Exit 0 = every test passed and no process reported an error or a definitely lost block.
#
#   tests/valgrind.sh [--build DIR] [--out DIR] [--suite unit|integration|all] [--jobs N]
#                     [--time-scale F] [TEST_NAME...]
# --build: a configured build without sanitizers (default build-valgrind, set up with
# -Dcuda=disabled --buildtype debugoptimized when missing); --out: where the logs go (default
# DIR/valgrind-logs, emptied first); TEST_NAME: meson test names (default: the suite's C tests).
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build="$here/build-valgrind" out="" suite=all jobs=1 scale=20 names=()
while [ $# -gt 0 ]; do
    case "$1" in
    --build) build=$2; shift ;;
    --out) out=$2; shift ;;
    --suite) suite=$2; shift ;;
    --jobs) jobs=$2; shift ;;
    --time-scale) scale=$2; shift ;;
    -h | --help) sed -n '2,17p' "$0"; exit 0 ;;
    -*) echo "valgrind.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) names+=("$1") ;;
    esac
    shift
done
case "$suite" in unit | integration | all) ;; *) echo "valgrind.sh: --suite unit|integration|all" >&2; exit 2 ;; esac
[[ $jobs =~ ^[1-9][0-9]*$ ]] || { echo "valgrind.sh: --jobs must be a positive integer" >&2; exit 2; }
[[ $scale =~ ^[1-9][0-9]*$ ]] || { echo "valgrind.sh: --time-scale must be a positive integer" >&2; exit 2; }
command -v valgrind >/dev/null || { echo "valgrind.sh: valgrind is not installed (deploy/install_deps.sh)" >&2; exit 2; }
build=$(cd "$(dirname "$build")" && pwd)/$(basename "$build")
if [ ! -f "$build/build.ninja" ]; then
    meson setup "$build" "$here" -Dcuda=disabled --buildtype debugoptimized >/dev/null || exit 2
fi
grep -q -- '-fsanitize' "$build/build.ninja" &&
    { echo "valgrind.sh: $build is a sanitizer build; valgrind needs a plain one" >&2; exit 2; }
ninja -C "$build" >"$build/valgrind-ninja.log" 2>&1 || { tail -n 20 "$build/valgrind-ninja.log"; exit 2; }
[ -n "$out" ] || out="$build/valgrind-logs"
mkdir -p "$out" && rm -f "$out"/vg.*.log
out=$(cd "$out" && pwd)

if [ ${#names[@]} -eq 0 ]; then
    # the C tests: executables built in this tree (not bash/python, not the test that already
    # runs valgrind itself)
    mapfile -t names < <(meson introspect "$build" --tests | /usr/bin/python3 -c '
import json, sys
build, suite = sys.argv[1], sys.argv[2]
for t in json.load(sys.stdin):
    s = [x.split(":")[-1] for x in t["suite"]]
    if (suite == "all" or suite in s) and t["cmd"][0].startswith(build + "/"):
        print(t["name"])' "$build" "$suite")
fi
[ ${#names[@]} -gt 0 ] || { echo "valgrind.sh: no test selected" >&2; exit 2; }

vg="valgrind --tool=memcheck --leak-check=full --errors-for-leak-kinds=definite"
vg+=" --show-leak-kinds=definite --error-exitcode=99 --num-callers=30 --child-silent-after-fork=yes"
vg+=" --log-file=$out/vg.%p.log"
echo "valgrind.sh: ${#names[@]} tests under valgrind ($(valgrind --version)), logs in $out"
start=$(date +%s)
PD_TEST_WRAPPER="$vg" PD_TEST_TIME_SCALE="$scale" \
    meson test -C "$build" --no-rebuild --wrapper "$vg" --timeout-multiplier "$scale" \
    --num-processes "$jobs" --print-errorlogs "${names[@]}" 2>&1 | tee "$out/meson-test.log" |
    grep -E '^ *[0-9]+/[0-9]+ |^(Ok|Fail|Timeout|Skipped):' | awk '!seen[$0]++'
test_st=${PIPESTATUS[0]}

# Every process's verdict from its log: errors (ERROR SUMMARY) and definite leaks, each with its
# first stacks. A log without a summary is a process that never finished: one killed with
# SIGKILL (the fault tests do that on purpose; listed, not counted) or one that crashed
# (valgrind writes "Process terminating": counted).
/usr/bin/python3 - "$out" <<'PY'
import glob, os, re, sys
out = sys.argv[1]
logs = sorted(glob.glob(os.path.join(out, "vg.*.log")), key=lambda f: int(re.sub(r"\D", "", f) or 0))
bad, killed, procs = 0, [], {}
for f in logs:
    text = open(f, errors="replace").read()
    cmd = re.search(r"^==\d+== Command: (\S+)", text, re.M)
    name = os.path.basename(cmd.group(1)) if cmd else "?"
    procs[name] = procs.get(name, 0) + 1
    errs = re.search(r"ERROR SUMMARY: (\d+) errors", text)
    lost = re.search(r"definitely lost: ([\d,]+) bytes in ([\d,]+) blocks", text)
    crash = re.search(r"Process terminating with default action of signal (\d+)", text)
    if not errs and not crash:
        killed.append(f"{name} ({os.path.basename(f)})")
        continue
    n_err = int(errs.group(1)) if errs else -1
    n_lost = int(lost.group(1).replace(",", "")) if lost else 0
    if n_err == 0 and not n_lost and not crash:
        continue
    bad += 1
    what = f"{n_err} errors, {n_lost} bytes definitely lost" + (f", terminated by signal {crash.group(1)}" if crash else "")
    print(f"\n=== {name} ({os.path.basename(f)}): {what}")
    shown = 0
    for b in re.split(r"^==\d+== $", text, flags=re.M):
        if shown < 6 and re.search(r"(Invalid|uninitialised|definitely lost in|Mismatched|overlap|Syscall param|Process terminating)", b):
            lines = b.strip().splitlines()[:24]
            where = "test code" if any(re.search(r"\((test_\w+|harness|cluster)\.c:", l) for l in lines) else "product code"
            print(f"--- ({where})")
            print("\n".join(lines))
            shown += 1
print(f"\nvalgrind.sh: {len(logs)} processes checked ({', '.join(f'{k} x{v}' for k, v in sorted(procs.items()))}); "
      f"{bad} with errors, definite leaks or a crash")
if killed:
    print(f"valgrind.sh: {len(killed)} ended without a summary (SIGKILL, e.g. by a fault test): {', '.join(killed)}")
sys.exit(1 if bad else 0)
PY
vg_st=$?
echo "valgrind.sh: meson test exit $test_st, $(( $(date +%s) - start )) s"
[ "$test_st" = 0 ] && [ "$vg_st" = 0 ]
