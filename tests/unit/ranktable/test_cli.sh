#!/usr/bin/env bash
# CLI tests of pd-ranktable (gen / merge / check), run by meson with the built executable:
#   bash test_cli.sh path/to/pd-ranktable
# Goldens: tests/data/ranktable/guide_*.json, cut from the Ascend guide (see make_data.py).
# Prints one PASS/FAIL line per case and the harness summary line tests/run.sh counts.
set -u
RT=${1:?usage: test_cli.sh path/to/pd-ranktable}
DATA=${PD_TEST_DATA_DIR:-$(dirname "$0")/../../data}/ranktable
TMP=$(mktemp -d "${TMPDIR:-/tmp}/pdrt_cli.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
passed=0 failed=0

ok() { echo "PASS $1"; passed=$((passed + 1)); }
bad() { echo "FAIL $1: $2"; failed=$((failed + 1)); }
# expect NAME STATUS SUBSTRING CMD...: runs CMD, checks its exit status and that its output
# (stdout + stderr) contains SUBSTRING.
expect() {
    local name=$1 want=$2 substr=$3
    shift 3
    local out rc
    out=$("$@" 2>&1)
    rc=$?
    if [ "$rc" != "$want" ]; then bad "$name" "exit $rc, want $want; output: $out"; return; fi
    case "$out" in
    *"$substr"*) ok "$name" ;;
    *) bad "$name" "output does not contain \"$substr\": $out" ;;
    esac
}

# 1. The guide's example: four files with the guide's names, the global one byte-equal to
#    the guide's JSON (device IPs given per device id so that they match too).
D=$TMP/guide
expect gen_guide 0 "saved $D/local_ranktable_localhost_host.json" \
    "$RT" --mode gen --prefill-server-list 4,5 --decode-server-list 6,7 --api-server \
    --save-dir "$D" --server-ip localhost \
    --device-ip-list '-,-,-,-,10.**.**.22,10.**.**.23,29.**.**.56,29.**.**.72'
names=$(cd "$D" && ls | tr '\n' ' ')
want="global_ranktable_localhost.json local_ranktable_localhost_45.json local_ranktable_localhost_67.json local_ranktable_localhost_host.json "
[ "$names" = "$want" ] && ok gen_guide_file_names || bad gen_guide_file_names "got: $names"
cmp -s "$D/global_ranktable_localhost.json" "$DATA/guide_global.json" &&
    ok gen_guide_global_golden || bad gen_guide_global_golden "$(diff "$D/global_ranktable_localhost.json" "$DATA/guide_global.json")"
cmp -s "$D/local_ranktable_localhost_67.json" "$DATA/guide_local_67.json" &&
    ok gen_guide_local_golden || bad gen_guide_local_golden "differs from guide_local_67.json"

# Without --device-ip-list: same keys, order and strings, device IPs = the host address.
D2=$TMP/guide2
"$RT" --mode gen --prefill-server-list 4,5 --decode-server-list 6,7 --api-server \
    --save-dir "$D2" --server-ip 10.1.1.18 >/dev/null 2>&1
norm() { sed -e 's/"device_ip": "[^"]*"/"device_ip": IP/' -e 's/"10\.1\.1\.18"/"localhost"/g' "$1"; }
if [ -f "$D2/global_ranktable_10.1.1.18.json" ] &&
    [ "$(norm "$D2/global_ranktable_10.1.1.18.json")" = "$(norm "$DATA/guide_global.json")" ] &&
    grep -q '"device_ip": "10.1.1.18"' "$D2/global_ranktable_10.1.1.18.json"; then
    ok gen_guide_device_ips_aside
else
    bad gen_guide_device_ips_aside "global table differs from the guide beyond device IPs"
fi
expect check_gen_output 0 "ok: $D2/local_ranktable_10.1.1.18_67.json: decode 0 of" \
    "$RT" --mode check --global-ranktable-list "$D2/global_ranktable_10.1.1.18.json" \
    --local-ranktable-list "$D2"/local_ranktable_10.1.1.18_45.json \
    "$D2"/local_ranktable_10.1.1.18_67.json "$D2"/local_ranktable_10.1.1.18_host.json

# 2. 2P2D over two hosts: gen on each, merge, check the merged table with every local one.
A=$TMP/hostA B=$TMP/hostB M=$TMP/merged
"$RT" --mode gen --prefill-server-list 0,1 --decode-server-list 2,3 --api-server \
    --save-dir "$A" --server-ip 10.0.0.1 >/dev/null 2>&1
"$RT" --mode gen --prefill-server-list 0,1 --decode-server-list 2,3 \
    --save-dir "$B" --ip 10.0.0.2 >/dev/null 2>&1
[ ! -e "$B/local_ranktable_10.0.0.2_host.json" ] && ok gen_without_api_server_no_host_table ||
    bad gen_without_api_server_no_host_table "host table written"
expect check_fragment_says_merge 1 "run --mode merge" \
    "$RT" --mode check --global-ranktable-list "$B/global_ranktable_10.0.0.2.json"
expect merge_two_hosts 0 "saved $M/global_ranktable_merge.json: 2 prefill (TP 2), 2 decode (TP 2)" \
    "$RT" --mode merge --global-ranktable-list "$A/global_ranktable_10.0.0.1.json" \
    "$B/global_ranktable_10.0.0.2.json" --save-dir "$M"
expect check_merged 0 "ok: $B/local_ranktable_10.0.0.2_23.json: decode 1 of" \
    "$RT" --mode check --global-ranktable-list "$M/global_ranktable_merge.json" \
    --local-ranktable-list "$A"/local_*.json "$B"/local_*.json
grep -q '"server_count": "2"' "$M/global_ranktable_merge.json" && ok merged_counts ||
    bad merged_counts "server_count not updated"

# 3. Two schedulers: merge fails and says so.
C=$TMP/hostC
"$RT" --mode gen --decode-server-list 4,5 --api-server --save-dir "$C" --server-ip 10.0.0.3 \
    >/dev/null 2>&1
expect merge_two_schedulers 1 "both carry a scheduler (group \"0\")" \
    "$RT" --mode merge --global-ranktable-list "$A/global_ranktable_10.0.0.1.json" \
    "$C/global_ranktable_10.0.0.3.json" --save-dir "$TMP/m2"
[ ! -e "$TMP/m2/global_ranktable_merge.json" ] && ok merge_failure_writes_nothing ||
    bad merge_failure_writes_nothing "file written"
expect merge_needs_two 1 "merge needs at least two" \
    "$RT" --mode merge --global-ranktable-list "$A/global_ranktable_10.0.0.1.json"

# 4. check prints every problem and exits 1; a local table that matches nothing is reported.
out=$("$RT" --mode check --global-ranktable-list "$DATA/bad/g_three_problems.json" 2>&1)
rc=$?
n=$(printf '%s\n' "$out" | grep -c '^error: .*g_three_problems.json: ')
[ "$rc" = 1 ] && [ "$n" = 3 ] && ok check_prints_every_problem ||
    bad check_prints_every_problem "exit $rc, $n problems: $out"
expect check_local_no_match 1 "l_no_match.json: matches no instance of" \
    "$RT" --mode check --global-ranktable-list "$DATA/good_1p1d.json" \
    --local-ranktable-list "$DATA/bad/l_no_match.json"
expect check_parse_error 1 "g_parse_error.json: line 4 column 23:" \
    "$RT" --mode check --global-ranktable-list "$DATA/bad/g_parse_error.json"

# 5. Argument errors.
expect gen_bad_list 1 "--decode-server-list[0]: \"6,,7\": empty entry 1" \
    "$RT" --mode gen --prefill-server-list 4,5 --decode-server-list 6,,7 --server-ip h \
    --save-dir "$TMP/x"
expect gen_device_twice 1 "device 5 on host h is already used" \
    "$RT" --mode gen --prefill-server-list 4,5 --decode-server-list 5,6 --server-ip h \
    --save-dir "$TMP/x"
expect gen_shared_allowed 0 "saved" \
    "$RT" --mode gen --prefill-server-list 0 --decode-server-list 0 --server-ip h \
    --allow-shared-devices --save-dir "$TMP/x"
# Pipeline stages: an instance's devices are TP x PP ranks.
P=$TMP/pp
expect gen_pipeline 0 "host 10.0.0.9: 1 prefill (TP 1 x PP 2); 1 decode (TP 2 x PP 1); scheduler" \
    "$RT" --mode gen --prefill-server-list 0,1 --decode-server-list 2,3 --api-server \
    --save-dir "$P" --server-ip 10.0.0.9 --prefill-pipeline-parallel-size 2
expect check_pipeline 0 "1 prefill (TP 2 x PP 1); 1 decode (TP 1 x PP 2)" \
    "$RT" --mode check --global-ranktable-list "$P/global_ranktable_10.0.0.9.json" \
    --decode-pipeline-parallel-size 2
expect gen_pipeline_indivisible 1 "prefill instances have 3 device(s): not tensor-parallel size x 2 pipeline stages" \
    "$RT" --mode gen --prefill-server-list 0,1,2 --decode-server-list 3 --save-dir "$TMP/pp3" \
    --server-ip 10.0.0.9 --prefill-pipeline-parallel-size 2
[ -e "$TMP/pp3" ] && bad gen_pipeline_indivisible_writes_nothing "$TMP/pp3 exists" ||
    ok gen_pipeline_indivisible_writes_nothing
expect pipeline_bad_value 1 "--decode-pipeline-parallel-size: expected 1 to 16, got \"0\"" \
    "$RT" --mode check --global-ranktable-list "$P/global_ranktable_10.0.0.9.json" \
    --decode-pipeline-parallel-size 0
expect unknown_option 2 "unknown option \"--bogus\"" "$RT" --bogus
expect bad_mode 2 "--mode must be gen, merge or check" "$RT" --mode nope
expect help 0 "usage:" "$RT" --help

echo "harness: $passed passed, $failed failed, 0 skipped"
[ "$failed" = 0 ]
