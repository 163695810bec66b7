#!/usr/bin/env bash
# README's first command and its curl examples, verbatim: deploy/quickstart.sh --detach serves
# 1P1D + pd-scheduler on the README's ports (9000, 8088, 8089), then every curl line of the
# "While it serves" block runs exactly as printed and must succeed with the expected content.
# Skips (77) when one of those ports is taken. Bounded in time; stops what it started.
set -uo pipefail
src=${PD_SOURCE_ROOT:?}
py=/usr/bin/python3
work=$(mktemp -d "${TMPDIR:-/tmp}/pdreadme.XXXXXX")
cleanup() {
    "$src/deploy/stop.sh" --work-dir "$work/qs" >/dev/null 2>&1
    [ -n "${PD_KEEP_WORK:-}" ] || rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$work"/qs/*.log "$work"/*.out; do [ -f "$f" ] && { echo "--- $f"; tail -n 15 "$f"; }; done; exit 1; }

for port in 9000 8088 8089; do
    if ! $py -c "import socket,sys; s=socket.socket(); s.bind(('127.0.0.1',$port))" 2>/dev/null; then
        echo "SKIP: port $port (used by the README's commands) is taken on this machine"
        exit 77
    fi
done

# the curl block that follows "While it serves:" in README.md, continuation lines joined
$py - "$src/README.md" >"$work/curls.txt" <<'PY' || fail "README.md has no curl block after 'While it serves:'"
import sys
text = open(sys.argv[1]).read()
block = text.split("While it serves:", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
cmds, cur = [], ""
for line in block.strip().splitlines():
    cur += line[:-1] + " " if line.endswith("\\") else line
    if not line.endswith("\\"):
        cmds.append(cur.strip())
        cur = ""
assert len(cmds) >= 4 and all(c.startswith("curl ") for c in cmds), cmds
print("\n".join(cmds))
PY

cd "$src" || fail "no source root"
timeout 600 deploy/quickstart.sh --detach --work-dir "$work/qs" >"$work/quickstart.out" 2>&1 ||
    fail "deploy/quickstart.sh --detach failed"
grep -q '"object":"chat.completion"' "$work/quickstart.out" || fail "quickstart printed no chat completion"

i=0
while IFS= read -r cmd; do
    i=$((i + 1))
    out=$(timeout 60 bash -c "$cmd" 2>"$work/curl$i.err") || fail "README command $i failed: $cmd"
    case "$cmd" in
    *chat/completions*) want='data: [DONE]' ;;
    *v1/completions*) want='"object":"text_completion"' ;;
    *v1/models*) want='"id":"tiny"' ;;
    *metrics*) want='vllm:request_success_total' ;;
    *) want='' ;;
    esac
    grep -qF -- "$want" <<<"$out" || fail "README command $i: output lacks '$want': $cmd -> ${out:0:300}"
done <"$work/curls.txt"
[ "$i" -ge 4 ] || fail "only $i README commands ran"
echo "PASS readme: quickstart --detach, then $i curl examples verbatim"
