#!/usr/bin/env bash
# Per-instance launcher, as in the Ascend PD-separation guide (steps 6-8): the same command line
# starts any role. The role comes from matching the local ranktable inside the global one:
#   scheduler (the *_host.json table) -> pd-scheduler, prefill -> pd-prefill, decode -> pd-decode.
# Environment: GLOBAL_RANK_TABLE_FILE_PATH, RANK_TABLE_FILE_PATH (required); NODE_PORTS (required
# by the scheduler); USE_OPENAI (scheduler, default 1). Every flag is passed through unchanged.
# Executables: $PD_BIN_DIR (a build directory or an install prefix's bin/), else ./build-release
# (deploy/quickstart.sh's) or ./build of this checkout, else PATH. `sh start_servers.sh` works too (as the guide runs it): it re-runs under bash.
# --help: without the two ranktable variables, prints this text; with them, the role's executable
# prints its flags (every executable accepts every role's flags).
[ -n "${BASH_VERSION:-}" ] || exec bash "$0" "$@" # `sh start_servers.sh` (dash) re-runs under bash
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)

if [ -z "${GLOBAL_RANK_TABLE_FILE_PATH:-}" ] || [ -z "${RANK_TABLE_FILE_PATH:-}" ]; then
    for a in "$@"; do
        case "$a" in -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
    done
fi

find_bin() { # name, path inside a build directory
    local dir dirs=("$here/build-release" "$here/build")
    [ -z "${PD_BIN_DIR:-}" ] || dirs=("$PD_BIN_DIR")
    for dir in "${dirs[@]}"; do
        if [ -x "$dir/$2" ]; then echo "$dir/$2"; return; fi
        if [ -x "$dir/$1" ]; then echo "$dir/$1"; return; fi
    done
    command -v "$1" || { echo "start_servers.sh: $1 not found (build first, or set PD_BIN_DIR)" >&2; exit 1; }
}

: "${GLOBAL_RANK_TABLE_FILE_PATH:?start_servers.sh: GLOBAL_RANK_TABLE_FILE_PATH is not set (the global ranktable of the cluster)}"
: "${RANK_TABLE_FILE_PATH:?start_servers.sh: RANK_TABLE_FILE_PATH is not set (the local ranktable of this instance)}"
for f in "$GLOBAL_RANK_TABLE_FILE_PATH" "$RANK_TABLE_FILE_PATH"; do
    [ -r "$f" ] || { echo "start_servers.sh: cannot read $f" >&2; exit 1; }
done

rt=$(find_bin pd-ranktable ranktable/cli/pd-ranktable)
if ! out=$("$rt" --mode check --global-ranktable-list "$GLOBAL_RANK_TABLE_FILE_PATH" \
                 --local-ranktable-list "$RANK_TABLE_FILE_PATH" 2>&1); then
    echo "start_servers.sh: $RANK_TABLE_FILE_PATH does not match an instance of $GLOBAL_RANK_TABLE_FILE_PATH:" >&2
    echo "$out" >&2
    exit 1
fi
role=$(sed -n 's/^ok: .*: \(scheduler\|prefill\|decode\) [0-9][0-9]* of .*/\1/p' <<<"$out" | tail -n 1)

case "$role" in
scheduler)
    : "${NODE_PORTS:?start_servers.sh: NODE_PORTS is not set (one port per prefill then decode instance)}"
    exec "$(find_bin pd-scheduler scheduler/pd-scheduler)" "$@" ;;
prefill) exec "$(find_bin pd-prefill prefill_node/pd-prefill)" "$@" ;;
decode) exec "$(find_bin pd-decode decode_node/pd-decode)" "$@" ;;
*)
    echo "start_servers.sh: could not tell the role of $RANK_TABLE_FILE_PATH:" >&2
    echo "$out" >&2
    exit 1 ;;
esac
