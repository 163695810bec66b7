#!/usr/bin/env bash
# Security checks (issue #9 item 6) against a real 1P1D cluster started through
# deploy/start_servers.sh, every process at --log-level debug:
#   - bind addresses: the ranktables put server_ip on 127.0.0.2 and device_ip on 127.0.0.3
#     (loopback aliases, so a socket bound to 0.0.0.0 or 127.0.0.1 shows); every listening TCP
#     socket of pd-prefill is on 127.0.0.2, pd-decode's gRPC port on 127.0.0.2 and its data-plane
#     port on 127.0.0.3, and pd-scheduler listens only on its --host (127.0.0.4). Sockets are
#     found from /proc/PID/fd and /proc/net/tcp{,6}. A node started with --host binds there
#     instead ("unless asked").
#   - API key (VLLM_API_KEY, or --api-key): every generation endpoint (/v1/completions, /v1/chat/completions,
#     /v1/models, and /generate on a second scheduler with USE_OPENAI=0) answers 401 with a
#     WWW-Authenticate header to no key, a wrong key, the key with a suffix, a prefix of it, the
#     wrong scheme, and 200 to the right one; /health and /metrics stay open.
#   - the key (and the wrong keys tried) never appear in any log, with debug logging on.
#   - request size limits: a body of exactly --max-request-body-bytes passes the limit, one byte
#     more gets 413 (Content-Length and chunked), headers over 64 KiB get 431, and the
#     scheduler keeps serving.
#   - bodies in flight: 40 connections with a wrong key each announce a 16 MiB body and send all
#     of it but the last byte: each gets 401 from its headers, and the scheduler's peak RSS
#     (VmHWM) stays under 100 MB (it buffered every body, 643 MB, until the key was checked at
#     the end); the same with the right key: --max-body-bytes-in-flight (32 MiB here) admits two
#     bodies and answers the others 503 with Retry-After at once, under 100 MB as well.
# Bounded in time; stops everything it started; exit 0 = pass.
set -uo pipefail
# shellcheck source=tests/integration/lib_cluster.sh
. "$(dirname "$0")/lib_cluster.sh"

srv_ip=127.0.0.2 dev_ip=127.0.0.3 sched_ip=127.0.0.4 limit=8192
key="sk-sec-$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n')"
"$bin/tools/mkmodel/pd-mkmodel" --preset tiny --out "$work/tiny" >/dev/null || fail "pd-mkmodel"
"$bin/ranktable/cli/pd-ranktable" --mode gen --prefill-server-list 0 --decode-server-list 1 \
    --api-server --server-ip "$srv_ip" --save-dir "$work" >/dev/null || fail "pd-ranktable"
# the devices get their own address, as on a machine whose data NICs differ from its host NIC
for f in "$work"/*ranktable_"$srv_ip"*.json; do
    sed -i "s/\"device_ip\": \"$srv_ip\"/\"device_ip\": \"$dev_ip\"/" "$f" || fail "sed $f"
done
grep -q "\"device_ip\": \"$dev_ip\"" "$work/global_ranktable_$srv_ip.json" || fail "device_ip not rewritten"
"$bin/ranktable/cli/pd-ranktable" --mode check --global-ranktable-list "$work/global_ranktable_$srv_ip.json" \
    >"$work/check.log" 2>&1 || fail "rewritten ranktable refused: $(cat "$work/check.log")"

free_port_on() { $py -c 'import socket,sys; s=socket.socket(); s.bind((sys.argv[1],0)); print(s.getsockname()[1])' "$1"; }
pp=$(free_port_on $srv_ip) dp=$(free_port_on $srv_ip) sp=$(free_port_on $sched_ip) gp=$(free_port_on $sched_ip)
export GLOBAL_RANK_TABLE_FILE_PATH="$work/global_ranktable_$srv_ip.json"
export NODE_PORTS="$pp,$dp" PD_BIN_DIR="$bin" VLLM_API_KEY="$key"
# no --host for the nodes: they must take the ranktable's addresses
node_args=(--model "$work/tiny" --max-model-len 512 --max-num-seqs 8 --cpu-threads 1
           --kv-cache-bytes 16777216 --served-model-name tiny --log-level debug)
start() { # role (for the reader: start_servers.sh finds it) table port log [extra args...]
    local table=$2 port=$3 log=$4
    shift 4
    RANK_TABLE_FILE_PATH="$work/local_ranktable_${srv_ip}_$table.json" \
        "$src/deploy/start_servers.sh" "${node_args[@]}" --port "$port" "$@" >"$work/$log.log" 2>&1 &
    pids+=($!)
}
start prefill 0 "$pp" prefill
start decode 1 "$dp" decode
USE_OPENAI=1 start scheduler host "$sp" scheduler --host "$sched_ip" --max-request-body-bytes "$limit"
# the legacy one takes the key from --api-key instead of the environment (both paths checked)
USE_OPENAI=0 VLLM_API_KEY='' start scheduler host "$gp" legacy --host "$sched_ip" --api-key "$key" \
    --max-body-bytes-in-flight 33554432
for port in "$sp" "$gp"; do
    ok=0
    for _ in $(seq 300); do
        [ "$(curl -s -o /dev/null -w '%{http_code}' "http://$sched_ip:$port/health")" = 200 ] && { ok=1; break; }
        sleep 0.1
    done
    [ $ok = 1 ] || fail "/health on $sched_ip:$port did not become 200 within 30 s"
done

# ---- listening sockets ----------------------------------------------------------------------
listeners() { # pid -> "addr:port" lines of its listening TCP sockets (IPv4 and IPv6)
    $py - "$1" <<'PY'
import os, socket, struct, sys
pid = sys.argv[1]
inodes = set()
for fd in os.listdir(f"/proc/{pid}/fd"):
    try:
        t = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        continue
    if t.startswith("socket:["):
        inodes.add(t[8:-1])
for name, fam in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
    for line in open(f"/proc/net/{name}").readlines()[1:]:
        f = line.split()
        if f[3] != "0A" or f[9] not in inodes:   # 0A = LISTEN
            continue
        addr, port = f[1].split(":")
        raw = bytes.fromhex(addr)
        # /proc prints the address as host-order 32-bit words
        raw = b"".join(struct.pack("<I", struct.unpack(">I", raw[i:i + 4])[0]) for i in range(0, len(raw), 4))
        ip = socket.inet_ntop(fam, raw)
        # an IPv6 socket bound to a v4-mapped address (gRPC does this) serves that IPv4 address only
        if ip.startswith("::ffff:") and "." in ip:
            ip = ip[7:]
        print(f"{ip}:{int(port, 16)}")
PY
}
check_listen() { # name pid expected-lines...
    local name=$1 pid=$2
    shift 2
    local got want
    got=$(listeners "$pid" | sort)
    want=$(printf '%s\n' "$@" | sort)
    [ -n "$got" ] || fail "$name (pid $pid): no listening socket found"
    [ "$got" = "$want" ] || fail "$name listens on [$(tr '\n' ' ' <<<"$got")], expected [$(tr '\n' ' ' <<<"$want")]"
    echo "ok: $name listens on $(tr '\n' ' ' <<<"$got")"
}
dport=$(listeners "${pids[1]}" | sed -n "s/^$dev_ip:\([0-9]*\)$/\1/p" | head -n 1)
[ -n "$dport" ] || fail "pd-decode: no data-plane listener on $dev_ip ($(listeners "${pids[1]}" | tr '\n' ' '))"
check_listen pd-prefill "${pids[0]}" "$srv_ip:$pp"
check_listen pd-decode "${pids[1]}" "$srv_ip:$dp" "$dev_ip:$dport"
check_listen pd-scheduler "${pids[2]}" "$sched_ip:$sp"
check_listen "pd-scheduler (legacy)" "${pids[3]}" "$sched_ip:$gp"

# ---- the API key -----------------------------------------------------------------------------
$py - "$sched_ip" "$sp" "$gp" "$key" "$limit" <<'PY' || fail "API key / size limit checks"
import http.client, json, sys
host, sp, gp, key, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])

def call(port, method, path, body=None, headers=None, chunked=False):
    c = http.client.HTTPConnection(host, port, timeout=30)
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    if chunked:
        c.putrequest(method, path)
        for k, v in h.items():
            c.putheader(k, v)
        c.putheader("Transfer-Encoding", "chunked")
        c.endheaders()
        for i in range(0, len(body), 1000):
            part = body[i:i + 1000]
            c.send(b"%x\r\n%s\r\n" % (len(part), part))
        c.send(b"0\r\n\r\n")
    else:
        c.request(method, path, body=body, headers=h)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, dict((k.lower(), v) for k, v in r.getheaders()), data

bad = {
    "no header": None,
    "wrong key": "Bearer sk-wrong-0123456789",
    "key with a suffix": "Bearer " + key + "x",
    "a prefix of the key": "Bearer " + key[:-1],
    "empty bearer": "Bearer ",
    "no scheme": key,
    "Basic scheme": "Basic " + key,
    "lower-case scheme": "bearer " + key,
    "two spaces": "Bearer  " + key,
}
comp = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0}).encode()
chat = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()
stream = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 2, "stream": True}).encode()
gen = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
endpoints = [
    (sp, "POST", "/v1/completions", comp),
    (sp, "POST", "/v1/completions", stream),
    (sp, "POST", "/v1/chat/completions", chat),
    (sp, "GET", "/v1/models", None),
    (gp, "POST", "/generate", gen),
]
for port, method, path, body in endpoints:
    for what, auth in bad.items():
        st, h, data = call(port, method, path, body, {"Authorization": auth} if auth is not None else {})
        assert st == 401, (path, what, st, data)
        assert h.get("www-authenticate", "").startswith("Bearer"), (path, what, h)
        assert json.loads(data)["error"]["code"] == 401, (path, what, data)
    st, h, data = call(port, method, path, body, {"Authorization": "Bearer " + key})
    assert st == 200, (path, "right key", st, data)
    print(f"ok: {method} {path} (port {port}): 401 for {len(bad)} wrong authorizations, 200 with the key")
for path in ("/health", "/metrics"):
    st, _, _ = call(sp, "GET", path)
    assert st == 200, (path, st)
print("ok: /health and /metrics need no key")

# ---- size limits ------------------------------------------------------------------------------
auth = {"Authorization": "Bearer " + key}
def padded(n):   # a valid completions body of exactly n bytes
    base = {"model": "tiny", "prompt": "Hi", "max_tokens": 1, "temperature": 0, "user": ""}
    b = json.dumps(base, separators=(",", ":")).encode()
    base["user"] = "u" * (n - len(b))
    b = json.dumps(base, separators=(",", ":")).encode()
    assert len(b) == n, (len(b), n)
    return b
st, _, data = call(sp, "POST", "/v1/completions", padded(limit), auth)
assert st == 200, ("body at the limit", st, data)
for chunked in (False, True):
    st, _, data = call(sp, "POST", "/v1/completions", padded(limit + 1), auth, chunked=chunked)
    e = json.loads(data)["error"]
    assert st == 413 and e["message"] == f"Request body exceeds {limit} bytes.", (chunked, st, data)
print(f"ok: a {limit}-byte body is served, {limit + 1} bytes get 413 (Content-Length and chunked)")
st, _, data = call(sp, "POST", "/v1/completions", comp, dict(auth, **{"X-Pad": "p" * (65 << 10)}))
assert st == 431, ("large headers", st, data)
print("ok: headers over 64 KiB get 431")
st, _, data = call(sp, "POST", "/v1/completions", comp, auth)
assert st == 200, ("after the limits", st, data)
print("ok: the scheduler still serves after the refusals")
PY

# ---- request bodies in flight: the flood of large bodies -------------------------------------------
# the legacy scheduler: the default --max-request-body-bytes (16 MiB), --max-body-bytes-in-flight 32 MiB
$py - "$sched_ip" "$gp" "$key" "${pids[3]}" <<'PY' || fail "bodies in flight"
import socket, sys, time
host, port, key, pid = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
N, CL = 40, 16 << 20

def kib(field):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

def flood(auth):
    """N connections each announcing CL bytes and sending all but the last; returns the sockets
    and what each has received 10 s later at most (b"" for none)."""
    head = (f"POST /generate HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: {auth}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {CL}\r\n\r\n").encode()
    chunk = b" " * (1 << 20)
    socks, sent = [], 0
    for _ in range(N):
        s = socket.create_connection((host, port), timeout=10)
        try:
            s.sendall(head)
            left = CL - 1
            while left > 0:  # the server drops what a refused request sends, for up to 2 s
                n = min(left, len(chunk))
                s.sendall(chunk[:n])
                left -= n
                sent += n
        except OSError:
            pass
        socks.append(s)
    print(f"    {sent} body bytes sent on {N} connections")
    got, deadline = [], time.time() + 10
    for s in socks:
        data = b""
        s.settimeout(max(0.2, deadline - time.time()))
        try:
            while b"}}" not in data:
                d = s.recv(65536)
                if not d:
                    break
                data += d
        except OSError:
            pass
        got.append(data)
    return socks, got

hwm0 = kib("VmHWM")
t0 = time.time()
socks, got = flood("Bearer sk-wrong-0123456789")
secs = time.time() - t0
hwm = kib("VmHWM")
for s in socks:
    s.close()
bad = [g[:60] for g in got if not g.startswith(b"HTTP/1.1 401 Unauthorized\r\n")]
print(f"ok?: {N} connections x {CL}-byte bodies (all but the last byte sent) with a wrong key in "
      f"{secs:.2f} s: {N - len(bad)} got 401; scheduler VmHWM {hwm0} -> {hwm} KiB")
assert not bad, bad[:3]
assert hwm < 100 * 1000, hwm
print(f"ok: a wrong key gets 401 from the headers: {N} x 16 MiB announced, peak RSS {hwm // 1024} MiB")

socks, got = flood("Bearer " + key)
hwm = kib("VmHWM")
held = sum(1 for g in got if not g)
refused = [g for g in got if g.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")]
print(f"ok?: the same with the key: {held} bodies held, {len(refused)} refused with 503; "
      f"scheduler VmHWM {hwm} KiB")
for s in socks:
    s.close()
assert held == 2 and len(refused) == N - 2, [g[:40] for g in got]
for g in refused:
    assert b"\r\nRetry-After: 1\r\n" in g and b"\r\nX-Request-Id: " in g, g
    assert (b'"message":"The server is at its limit of 33554432 request body bytes in flight; '
            b'retry later."') in g, g
assert hwm < 100 * 1000, hwm
# the held bodies stopped counting with their connections: two fit again, a third does not
time.sleep(0.5)
head = (f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Length: {CL}\r\n\r\n{{").encode()
again = [socket.create_connection((host, port), timeout=5) for _ in range(3)]
for s in again:
    s.sendall(head)
    time.sleep(0.1)
answers = []
for s in again:
    s.settimeout(0.5)
    try:
        answers.append(s.recv(65536))
    except socket.timeout:
        answers.append(b"")
    s.close()
assert answers[0] == b"" and answers[1] == b"" and answers[2].startswith(b"HTTP/1.1 503"), answers
print(f"ok: --max-body-bytes-in-flight: 2 bodies of 16 MiB held, {N - 2} answered 503 "
      f"(Retry-After: 1) at once, peak RSS {hwm // 1024} MiB; the bytes are free again once "
      "the connections close")
PY

# ---- the key in logs ---------------------------------------------------------------------------
for f in prefill decode scheduler; do # (the legacy /generate path logs nothing at debug level)
    grep -q ' DEBUG ' "$work/$f.log" || fail "$f.log has no DEBUG line: debug logging was not on"
done
if grep -n -F -e "$key" -e "${key:0:12}" -e "sk-wrong-0123456789" "$work"/*.log; then
    fail "an API key (or a part of one) appears in a log"
fi
echo "ok: no key in $(cat "$work"/{prefill,decode,scheduler,legacy}.log | wc -l) log lines at debug level"

# ---- "unless asked": a node given --host binds there --------------------------------------------
kill "${pids[0]}"; wait "${pids[0]}"
pp2=$(free_port_on 127.0.0.5)
RANK_TABLE_FILE_PATH="$work/local_ranktable_${srv_ip}_0.json" \
    "$src/deploy/start_servers.sh" "${node_args[@]}" --port "$pp2" --host 127.0.0.5 >"$work/prefill2.log" 2>&1 &
pids[0]=$!
for _ in $(seq 300); do [ -n "$(listeners "${pids[0]}")" ] && break; sleep 0.1; done
check_listen "pd-prefill --host 127.0.0.5" "${pids[0]}" "127.0.0.5:$pp2"

for i in 2 3 0 1; do kill "${pids[$i]}"; done
for i in 0 1 2 3; do
    wait "${pids[$i]}"; st=$?
    [ $st = 0 ] || fail "process $i exited with $st after SIGTERM"
done
pids=()
echo "PASS security: bind addresses, API key on every generation endpoint, no key in logs, size limits, bodies in flight"
