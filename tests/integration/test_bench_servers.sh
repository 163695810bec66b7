#!/usr/bin/env bash
# pd-bench measures servers other than pdserve (issue 28 item 5): a small Python server replays,
# for every request, a response captured byte for byte from llama.cpp's llama-server
# (tests/data/bench/, its README says how), and pd-bench must count every request as completed
# with the usage's 16 tokens, one TTFT and one ITL per token chunk after the first: llama-server
# closes a choice with one more chunk (chat: an empty delta; completions: an empty text) carrying
# finish_reason and the usage, which is no token, and in chat it sent 16 tokens in 14 chunks
# (held-back bytes of incomplete characters). A stream with more token chunks than its usage
# says must still fail. Bounded in time; stops what it starts; exit 0 = pass.
set -uo pipefail
# shellcheck source=tests/integration/lib_cluster.sh
. "$(dirname "$0")/lib_cluster.sh"
bench="$bin/tools/bench/pd-bench"
data=${PD_TEST_DATA_DIR:?}/bench

# replay.py PORT FILE EXTRA: answers each request (headers, then Content-Length bytes) with FILE,
# its first token chunk sent EXTRA more times
cat >"$work/replay.py" <<'PY'
import socket, sys, threading
port, path, extra = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
raw = open(path, 'rb').read()
head, body = raw.split(b'\r\n\r\n', 1)
chunks, rest = [], body
while True:                       # the chunked body as (size line + data + CRLF) pieces
    size_line, rest = rest.split(b'\r\n', 1)
    size = int(size_line, 16)
    chunks.append(size_line + b'\r\n' + rest[:size + 2])
    rest = rest[size + 2:]
    if size == 0:
        break
k = next(i for i, c in enumerate(chunks)
         if b'"content":"' in c or (b'"text":"' in c and b'"text":""' not in c))
chunks[k:k] = [chunks[k]] * extra
resp = head + b'\r\n\r\n' + b''.join(chunks)
def serve(c):
    buf = b''
    while b'\r\n\r\n' not in buf:
        d = c.recv(65536)
        if not d:
            return c.close()
        buf += d
    h, b = buf.split(b'\r\n\r\n', 1)
    n = next((int(l.split(b':')[1]) for l in h.split(b'\r\n')
              if l.lower().startswith(b'content-length:')), 0)
    while len(b) < n:
        d = c.recv(65536)
        if not d:
            break
        b += d
    c.sendall(resp)
    c.close()
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('127.0.0.1', port))
s.listen(16)
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
PY

# run_case NAME FILE ENDPOINT EXTRA: replays FILE on a free port, runs pd-bench (4 prompts of 16
# tokens) against it, leaves its result in $work/NAME.json and its status in $st
run_case() {
    local name=$1 file=$2 endpoint=$3 extra=$4 port
    port=$(free_port)
    $py "$work/replay.py" "$port" "$data/$file" "$extra" 2>"$work/$name-replay.log" &
    local rp=$!
    pids+=($rp)
    for _ in $(seq 50); do
        $py -c "import socket; socket.create_connection(('127.0.0.1', $port))" 2>/dev/null && break
        sleep 0.1
    done
    timeout 60 "$bench" --base-url "http://127.0.0.1:$port" --endpoint "$endpoint" --model m \
        --num-prompts 4 --random-input-len 32 --random-output-len 16 --max-concurrency 2 \
        --warmup 0 --seed 7 --timeout 10 --result-file "$work/$name.json" \
        >"$work/$name-bench.log" 2>&1
    st=$?
    kill "$rp" 2>/dev/null
    wait "$rp" 2>/dev/null
}

# check NAME CHUNKS: 4 completed of 16 tokens each, CHUNKS - 1 ITLs per request
check() {
    $py - "$work/$1.json" "$2" <<'PY' || fail "$1: pd-bench's figures: $(cat "$work/$1-bench.log")"
import json, sys
r, chunks = json.load(open(sys.argv[1])), int(sys.argv[2])
assert r["completed"] == 4 and r["failed"] == 0, (r["completed"], r["failed"], r["errors"])
assert r["output_lens"] == [16] * 4 and r["total_output_tokens"] == 64, r["output_lens"]
assert all(t and t > 0 for t in r["ttfts"]), r["ttfts"]
assert [len(g) for g in r["itls"]] == [chunks - 1] * 4, [len(g) for g in r["itls"]]
PY
}

# chat: a role chunk, 14 content chunks, a closing chunk with an empty delta and the usage
run_case chat llama_server_chat.http /v1/chat/completions 0
[ $st = 0 ] || fail "chat: pd-bench exited with $st: $(cat "$work/chat-bench.log")"
check chat 14
# completions: 16 chunks with text, a closing chunk with an empty text and the usage
run_case comp llama_server_completions.http /v1/completions 0
[ $st = 0 ] || fail "completions: pd-bench exited with $st: $(cat "$work/comp-bench.log")"
check comp 16

# 17 token chunks for the usage's 16 tokens: every request fails, saying why
for c in "chat llama_server_chat.http /v1/chat/completions 3" \
    "comp llama_server_completions.http /v1/completions 1"; do
    read -r name file endpoint extra <<<"$c"
    run_case "$name-dup" "$file" "$endpoint" "$extra"
    $py - "$work/$name-dup.json" <<'PY' || fail "$name-dup: $(cat "$work/$name-dup-bench.log")"
import json, sys
r = json.load(open(sys.argv[1]))
assert r["completed"] == 0 and r["failed"] == 4, (r["completed"], r["failed"])
assert all("token chunks for 16 completion tokens" in e for e in r["errors"]), r["errors"]
PY
done
echo "PASS: pd-bench measures llama-server's captured streams (chat and completions)"
