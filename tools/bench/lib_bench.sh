# shellcheck shell=bash
# Shared by the benchmark scripts of tools/bench (source it after setting $bench_name): a work
# directory removed at exit with the processes in $pids, and free_port.
work=$(mktemp -d "${TMPDIR:-/tmp}/pd${bench_name:-bench}.XXXXXX")
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  sleep 2
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  rm -rf "$work"
}
trap cleanup EXIT
free_port() { /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
