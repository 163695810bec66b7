#!/usr/bin/env python3
"""pdserve across hosts: network namespaces on a bridge, each its own host with its own address.

Part 1, 3 hosts (prefill, decode, scheduler): each host generates its ranktable (pd-ranktable
--mode gen, inside its namespace: the first host by the default address, the others with
--server-ip), the scheduler host merges them (the guide's step 5), every instance is started by
deploy/start_servers.sh in its namespace, bound to its host's address (nothing listens on any
other), and its greedy completions and a stream equal colocated pd-generate's.

Part 2, 2P2D over 4 hosts (P0, P1, D0, D1) and the scheduler on a fifth:
  - split == colocated across the hosts, both decode hosts serving;
  - D0's link goes down under 8 long streams: D0's streams end with the in-band error and
    [DONE] within 5 s, D1's finish, the next request is served on D1; the link comes back and
    D0 rejoins (pd:instance_up) within 5 s and serves again (the times are printed);
  - D0's KV data port dropped by iptables (its control plane answers): the transfer there fails
    when its lease runs out (half the scheduler's --prefill-timeout 4), the prefill log names it,
    the KV is freed (the prefill instances hold nothing) and the request is served on D1;
  - the scheduler host cannot reach P1 (iptables): P1 leaves the routing set, requests are
    served by P0; the rule removed, P1 rejoins within 5 s.

Needs root, iproute2 and iptables (deploy/install_deps.sh); exits 77 with the reason otherwise.
Everything it makes (namespaces, veth pairs, the bridge, its iptables rule, processes) is removed
at exit. PD_KEEP_WORK=1 keeps the work directory (logs).
"""
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request

SRC = os.environ["PD_SOURCE_ROOT"]
BIN = os.environ["PD_BUILD_ROOT"]
SCALE = float(os.environ.get("PD_TEST_TIME_SCALE", "1"))
RANKTABLE = f"{BIN}/ranktable/cli/pd-ranktable"
GENERATE = f"{BIN}/tools/generate/pd-generate"
MKMODEL = f"{BIN}/tools/mkmodel/pd-mkmodel"
PROMPTS = ["red green blue red green blue", "one two three four five six seven",
           "the cat sat on the"]
P_PORT, D_PORT, S_PORT = 8088, 8089, 9000
PREFILL_TIMEOUT = 4   # the scheduler's --prefill-timeout: the KV lease is half of it
LONG = 1800   # tokens of a long stream (the small model: --max-model-len 2048)


def skip(why):
    print(f"SKIP: {why}")
    sys.exit(77)


def fail(why):
    raise AssertionError(why)


def run(*cmd, check=True, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if check and r.returncode != 0:
        fail(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()}")
    return r


class Net:
    """A bridge and one namespace per host on it (198.18.X.i/24; 198.18.0.0/15 is the
    benchmarking range, RFC 2544, so it meets no real network). The root namespace has .254."""

    def __init__(self):
        self.tag = f"pd{os.getpid() % 100000}"
        self.prefix = f"198.18.{os.getpid() % 200 + 20}"
        self.bridge = f"{self.tag}br"
        self.hosts = []
        self.forward_rule = None
        try:
            run("ip", "link", "add", self.bridge, "type", "bridge")
            run("ip", "addr", "add", f"{self.prefix}.254/24", "dev", self.bridge)
            run("ip", "link", "set", self.bridge, "up")
            # Once dockerd has run, FORWARD's policy is DROP and bridged frames may pass iptables.
            rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
            run("iptables", "-I", *rule)
            self.forward_rule = rule
        except AssertionError:
            self.close()
            raise

    def add_host(self):
        i = len(self.hosts) + 1
        ns, veth, ip = f"{self.tag}h{i}", f"{self.tag}v{i}", f"{self.prefix}.{i}"
        run("ip", "netns", "add", ns)
        self.hosts.append(ns)
        run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        run("ip", "link", "set", veth, "master", self.bridge, "up")
        run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        run("ip", "-n", ns, "link", "set", "eth0", "up")
        run("ip", "-n", ns, "link", "set", "lo", "up")
        return Host(self, ns, veth, ip)

    def close(self):
        for ns in self.hosts:
            run("ip", "netns", "del", ns, check=False)   # takes its veth pair along
        if self.forward_rule:
            run("iptables", "-D", *self.forward_rule, check=False)
        run("ip", "link", "del", self.bridge, check=False)


class Host:
    def __init__(self, net, ns, veth, ip):
        self.net, self.ns, self.veth, self.ip = net, ns, veth, ip

    def cmd(self, *argv):
        return ["ip", "netns", "exec", self.ns, *argv]

    def link(self, up):
        run("ip", "link", "set", self.veth, "up" if up else "down")

    def iptables(self, *rule):
        run(*self.cmd("iptables", *rule))

    def listeners(self):
        out = run(*self.cmd("ss", "-Hltn")).stdout
        # gRPC listens on an IPv4 address through an IPv6 socket: [::ffff:a.b.c.d]:port
        return [re.sub(r"^\[::ffff:(.*)\]:", r"\1:", line.split()[3])
                for line in out.splitlines() if line.strip()]


class Cluster:
    """Processes started in the hosts' namespaces; stop() ends them all (SIGTERM, then -9)."""

    def __init__(self, work):
        self.work, self.procs = work, []

    def start(self, host, name, env, argv):
        log = open(os.path.join(self.work, f"{name}.log"), "w")
        p = subprocess.Popen(host.cmd("env", *[f"{k}={v}" for k, v in env.items()], *argv),
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs.append((name, p))
        return p

    def log(self, name):
        with open(os.path.join(self.work, f"{name}.log")) as f:
            return f.read()

    def stop(self):
        for _, p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        end = time.time() + 10
        for _, p in self.procs:
            try:
                p.wait(max(0.1, end - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs = []


def wait_for(what, pred, timeout):
    end = time.time() + timeout * SCALE
    while time.time() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    fail(f"{what}: not within {timeout * SCALE:.0f} s")


def http_get(url, timeout=2):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except Exception as e:  # noqa: BLE001 - any failure is "not yet"
        return None, str(e)


def completion(base, prompt, max_tokens=24, timeout=30):
    body = {"model": "small", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "return_tokens_as_token_ids": True, "logprobs": 0}
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout * SCALE) as r:
        out = json.load(r)
    return [int(t.split(":")[1]) for t in out["choices"][0]["logprobs"]["tokens"]]


class Stream(threading.Thread):
    """One streaming completion; records when its first and last bytes came, the tokens, an
    in-band error and [DONE]."""

    def __init__(self, host, port, prompt, max_tokens):
        super().__init__(daemon=True)
        self.host, self.port, self.prompt, self.max_tokens = host, port, prompt, max_tokens
        self.ids, self.error, self.done, self.finish = [], None, False, None
        self.first_at = self.end_at = None
        self.exc = None

    def run(self):
        body = {"model": "small", "prompt": self.prompt, "max_tokens": self.max_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True,
                "return_tokens_as_token_ids": True, "logprobs": 0}
        try:
            c = http.client.HTTPConnection(self.host, self.port, timeout=120 * SCALE)
            c.request("POST", "/v1/completions", json.dumps(body),
                      {"Content-Type": "application/json"})
            r = c.getresponse()
            if r.status != 200:
                self.error = f"HTTP {r.status}: {r.read()[:200]!r}"
                return
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if self.first_at is None:
                    self.first_at = time.time()
                data = line[6:]
                if data == "[DONE]":
                    self.done = True
                    break
                ev = json.loads(data)
                if "error" in ev:
                    self.error = ev["error"]["message"]
                    continue
                ch = ev["choices"][0]
                self.ids += [int(t.split(":")[1]) for t in (ch.get("logprobs") or {}).get("tokens", [])]
                self.finish = ch.get("finish_reason") or self.finish
        except Exception as e:  # noqa: BLE001 - reported by the checks
            self.exc = repr(e)
        finally:
            self.end_at = time.time()


def metrics(base):
    st, text = http_get(f"{base}/metrics")
    if st != 200:
        fail(f"{base}/metrics: {text}")
    return text


def series(text, name):
    """{labels: value} of one metric family's samples."""
    out = {}
    for line in text.splitlines():
        m = re.match(re.escape(name) + r"\{([^}]*)\} (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def transfers(base, decode):
    """KV transfers into one decode instance so far (pd:kv_transfer_seconds counts)."""
    return sum(v for k, v in series(metrics(base), "pd:kv_transfer_seconds_count").items()
               if f'decode_instance="{decode}"' in k)


def instance_up(base, role, name):
    v = series(metrics(base), "pd:instance_up").get(f'role="{role}",instance="{name}"')
    return v == 1.0


def node_stats(host, port):
    r = run(f"{BIN}/tools/bench/pd-bench", "--node-stats", f"{host}:{port}", check=False)
    return json.loads(r.stdout) if r.returncode == 0 else None


def colocated(model):
    want = []
    for p in PROMPTS:
        r = run(GENERATE, "--model", model, "--prompt", p, "--max-tokens", "24", "--ignore-eos",
                "--temperature", "0", "--json", "--cpu-threads", "1")
        want.append(json.loads(r.stdout)["token_ids"])
    return want


def gen_tables(work, spec):
    """spec: [(host, gen flags)] in merge order; the tables of host h go to work/<ns>/; the last
    host merges them. Returns (merged global table, {(host, name): local table})."""
    globals_ = []
    for i, (h, flags) in enumerate(spec):
        d = os.path.join(work, h.ns)
        os.makedirs(d, exist_ok=True)
        argv = [RANKTABLE, "--mode", "gen", *flags, "--save-dir", d]
        if i > 0:   # the first host finds its own address (the default: its first non-loopback)
            argv += ["--server-ip", h.ip]
        run(*h.cmd(*argv))
        g = os.path.join(d, f"global_ranktable_{h.ip}.json")
        if not os.path.exists(g):
            fail(f"pd-ranktable gen on {h.ns} did not write {g} (its address is {h.ip})")
        globals_.append(g)
    merger = spec[-1][0]
    d = os.path.join(work, merger.ns)
    run(*merger.cmd(RANKTABLE, "--mode", "merge", "--global-ranktable-list", *globals_,
                    "--save-dir", d))
    return os.path.join(d, "global_ranktable_merge.json")


def start_instances(cl, model, merged, node_ports, instances, sched_host, sched_extra=()):
    """instances: [(host, name, local table suffix, extra flags)]."""
    common = ["--model", model, "--tensor-parallel-size", "1", "--max-model-len", "2048",
              "--max-num-seqs", "16", "--max-num-batched-tokens", "2048",
              "--served-model-name", "small", "--cpu-threads", "1",
              "--kv-cache-bytes", "536870912", "--enable-prefix-caching"]
    env = {"GLOBAL_RANK_TABLE_FILE_PATH": merged, "NODE_PORTS": node_ports, "USE_OPENAI": "1",
           "PD_BIN_DIR": BIN}
    for h, name, table, port, extra in instances:
        e = dict(env, RANK_TABLE_FILE_PATH=os.path.join(cl.work, h.ns,
                                                        f"local_ranktable_{h.ip}_{table}.json"))
        cl.start(h, name, e, [f"{SRC}/deploy/start_servers.sh", *common, *extra,
                              "--host", h.ip, "--port", str(port)])
    e = dict(env, RANK_TABLE_FILE_PATH=os.path.join(cl.work, sched_host.ns,
                                                    f"local_ranktable_{sched_host.ip}_host.json"))
    cl.start(sched_host, "scheduler", e, [f"{SRC}/deploy/start_servers.sh", *common,
                                          *sched_extra, "--host", sched_host.ip,
                                          "--port", str(S_PORT)])
    base = f"http://{sched_host.ip}:{S_PORT}"
    t0 = time.time()

    def healthy():
        dead = [n for n, p in cl.procs if p.poll() is not None]
        if dead:
            fail(f"{', '.join(dead)} exited at start-up")
        return http_get(f"{base}/health")[0] == 200
    wait_for("the scheduler's /health", healthy, 60)
    return base, time.time() - t0


def check_split_equals_colocated(base, want, what):
    for p, w in zip(PROMPTS, want):
        got = completion(base, p)
        if got != w:
            fail(f"{what}: {p!r} served {got}, colocated {w}")
    host, port = base[len("http://"):].split(":")
    s = Stream(host, int(port), PROMPTS[0], 24)
    s.start()
    s.join(60 * SCALE)
    if not s.done or s.error or s.ids != want[0]:
        fail(f"{what}: stream {s.ids} (error {s.error}, [DONE] {s.done}), colocated {want[0]}")


def part1(net, work, model, want):
    hp, hd, hs = net.add_host(), net.add_host(), net.add_host()
    merged = gen_tables(work, [(hp, ["--prefill-server-list", "0"]),
                               (hd, ["--decode-server-list", "0"]),
                               (hs, ["--api-server"])])
    cl = Cluster(work)
    try:
        base, healthy = start_instances(cl, model, merged, f"{P_PORT},{D_PORT}",
                                        [(hp, "p3-prefill", "0", P_PORT, []),
                                         (hd, "p3-decode", "0", D_PORT, [])], hs)
        for h in (hp, hd, hs):
            bad = [a for a in h.listeners() if not a.startswith(h.ip + ":")]
            if bad:
                fail(f"{h.ns} ({h.ip}) has listeners on other addresses: {bad}")
        check_split_equals_colocated(base, want, "3 hosts")
        print(f"ok 3 hosts (prefill {hp.ip}, decode {hd.ip}, scheduler {hs.ip}): tables made per "
              f"host and merged; every listener on its host's address; completions and a stream "
              f"= colocated pd-generate (healthy {healthy:.2f} s after start)")
    finally:
        cl.stop()


def part2(net, work, model, want):
    hp0, hp1, hd0, hd1, hs = (net.add_host() for _ in range(5))
    merged = gen_tables(work, [(hp0, ["--prefill-server-list", "0"]),
                               (hp1, ["--prefill-server-list", "0"]),
                               (hd0, ["--decode-server-list", "0"]),
                               (hd1, ["--decode-server-list", "0"]),
                               (hs, ["--api-server"])])
    cl = Cluster(work)
    try:
        base, _ = start_instances(
            cl, model, merged, f"{P_PORT},{P_PORT},{D_PORT},{D_PORT}",
            [(hp0, "prefill0", "0", P_PORT, []), (hp1, "prefill1", "0", P_PORT, []),
             (hd0, "decode0", "0", D_PORT, []), (hd1, "decode1", "0", D_PORT, [])], hs,
            ["--prefill-timeout", str(PREFILL_TIMEOUT)])
        d0, d1 = f"{hd0.ip}:{D_PORT}", f"{hd1.ip}:{D_PORT}"
        p1 = f"{hp1.ip}:{P_PORT}"
        wait_for("all four instances up",
                 lambda: all(instance_up(base, r, n) for r, n in
                             (("prefill", f"{hp0.ip}:{P_PORT}"), ("prefill", p1),
                              ("decode", d0), ("decode", d1))), 30)

        # split == colocated across hosts, both decode hosts serving
        for _ in range(2):
            check_split_equals_colocated(base, want, "2P2D over 4 hosts")
        n0, n1 = transfers(base, d0), transfers(base, d1)
        if not (n0 and n1):
            fail(f"both decode hosts should have served: transfers D0 {n0}, D1 {n1}")
        print(f"ok 2P2D over 4 hosts + a scheduler host: completions and streams = colocated "
              f"pd-generate (KV transfers to D0 {n0:.0f}, to D1 {n1:.0f})")

        # D0's link goes down under long streams
        streams = [Stream(hs.ip, S_PORT, f"{PROMPTS[i % 3]} {i}", LONG) for i in range(8)]
        b0, b1 = transfers(base, d0), transfers(base, d1)
        for s in streams:
            s.start()
        wait_for("every stream's first bytes", lambda: all(s.first_at for s in streams), 30)
        on_d0, on_d1 = transfers(base, d0) - b0, transfers(base, d1) - b1
        if on_d0 < 1 or on_d1 < 1 or on_d0 + on_d1 != len(streams):
            fail(f"the streams should be spread over both decode hosts: D0 {on_d0}, D1 {on_d1}")
        if any(s.end_at for s in streams):
            fail("a stream ended before the link went down (make them longer)")
        t_down = time.time()
        hd0.link(False)
        for s in streams:
            s.join(120 * SCALE)
        lost = [s for s in streams if s.error]
        whole = [s for s in streams if not s.error]
        if len(lost) != on_d0 or any(not s.done for s in streams):
            fail(f"{on_d0} streams on D0: {len(lost)} got the in-band error; [DONE] on "
                 f"{sum(s.done for s in streams)} of {len(streams)}; "
                 f"{[(s.error, s.exc) for s in streams]}")
        if any("decode instance" not in s.error for s in lost):
            fail(f"unexpected in-band errors: {[s.error for s in lost]}")
        if any(s.finish != "length" or len(s.ids) != LONG for s in whole):
            fail(f"streams on D1 should be whole: {[(s.finish, len(s.ids)) for s in whole]}")
        worst = max(s.end_at for s in lost) - t_down
        if worst > 5 * SCALE:
            fail(f"the in-band error came {worst:.3f} s after the link went down (bound 5 s)")
        b1 = transfers(base, d1)
        t = time.time()
        completion(base, PROMPTS[1])
        if transfers(base, d1) != b1 + 1:
            fail("the request after the link went down was not served on D1")
        print(f"ok D0's link down under {len(streams)} streams: the {len(lost)} on D0 ended with "
              f"the in-band error and [DONE], the last {worst:.3f} s after the link went down; the "
              f"{len(whole)} on D1 finished whole; the next request served on D1 in "
              f"{time.time() - t:.3f} s")

        t_up = time.time()
        hd0.link(True)
        wait_for("D0 back in the routing set", lambda: instance_up(base, "decode", d0), 60)
        rejoin = time.time() - t_up
        if rejoin > 5 * SCALE:
            fail(f"D0 rejoined {rejoin:.3f} s after its link came back (bound 5 s)")
        b0 = transfers(base, d0)
        wait_for("a request served on D0 again",
                 lambda: completion(base, PROMPTS[2]) and transfers(base, d0) > b0, 30)
        print(f"ok D0's link back: in the routing set {rejoin:.3f} s later, and serving")

        # the KV data port of D0 dropped, its control plane up
        m = re.search(r"KV data plane \(rank by rank\): (\S+):(\d+)", cl.log("decode0"))
        if not m:
            fail("decode0's log does not name its KV data plane address")
        kv_port = m.group(2)
        rule = ["INPUT", "-p", "tcp", "--dport", kv_port, "-j", "DROP"]
        hd0.iptables("-A", *rule)
        try:
            b0, b1 = transfers(base, d0), transfers(base, d1)
            t = time.time()
            # sent until one was routed to D0 (the balancer spreads requests over idle hosts)
            served, cut = 0, f"KV transfer to {hd0.ip}:{kv_port}"
            while cut not in cl.log("prefill0") + cl.log("prefill1"):
                if served == 8:
                    fail(f"8 requests and no prefill instance reported a transfer to D0's KV port")
                completion(base, PROMPTS[served % 3], timeout=60)
                served += 1
            took = time.time() - t
            line = next(x for x in (cl.log("prefill0") + cl.log("prefill1")).splitlines() if cut in x)
            if "timed out" not in line:
                fail(f"the transfer to D0 should have run out of its lease: {line}")
            if transfers(base, d0) != b0 or transfers(base, d1) != b1 + served:
                fail(f"all {served} requests should have been served on D1: D0 "
                     f"{transfers(base, d0) - b0:.0f}, D1 {transfers(base, d1) - b1:.0f}")

            def idle(h):
                st = node_stats(h.ip, P_PORT)
                return st is not None and not (st["leases_held"] or st["num_held"]
                                               or st["num_running"])
            wait_for("the prefill instances holding nothing", lambda: idle(hp0) and idle(hp1), 10)
            print(f"ok D0's KV port {kv_port} dropped (its control plane up): the transfer there "
                  f"failed when its lease ran out ({PREFILL_TIMEOUT / 2:g} s), reported by the "
                  f"prefill instance, its KV freed; the request then served on D1 ({served} "
                  f"request(s), {took:.3f} s)")
        finally:
            hd0.iptables("-D", *rule)

        # the scheduler's host cannot reach P1
        rule = ["OUTPUT", "-d", hp1.ip, "-j", "DROP"]
        hs.iptables("-A", *rule)
        t = time.time()
        try:
            wait_for("P1 out of the routing set", lambda: not instance_up(base, "prefill", p1), 20)
            gone = time.time() - t
            for i in range(6):
                completion(base, PROMPTS[i % 3])
        finally:
            hs.iptables("-D", *rule)
        t = time.time()
        wait_for("P1 back in the routing set", lambda: instance_up(base, "prefill", p1), 60)
        back = time.time() - t
        if back > 5 * SCALE:
            fail(f"P1 rejoined {back:.3f} s after the rule went (bound 5 s)")
        print(f"ok the scheduler's host cut off from P1: out of the routing set after {gone:.3f} s, "
              f"6 of 6 requests served by P0 meanwhile; P1 back {back:.3f} s after the rule went")
    finally:
        cl.stop()


def main():
    if os.geteuid() != 0:
        skip("network namespaces need root")
    for tool in ("ip", "iptables", "ss"):
        if not shutil.which(tool):
            skip(f"{tool} is not installed (deploy/install_deps.sh installs iproute2 and iptables)")
    probe = f"pdprobe{os.getpid()}"
    if run("ip", "netns", "add", probe, check=False).returncode != 0:
        skip("this machine does not allow network namespaces (ip netns add failed)")
    run("ip", "netns", "del", probe)
    # meson's timeout sends SIGTERM: unwind, so that the finally blocks remove what was made
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))
    work = tempfile.mkdtemp(prefix="pdhosts.")
    model = os.path.join(work, "small")
    net, ok = None, False
    try:
        run(MKMODEL, "--preset", "small", "--out", model)   # ~3.5 ms a token: streams that last
        want = colocated(model)
        net = Net()
        part1(net, work, model, want)
        part2(net, work, model, want)
        ok = True
    except Exception as e:  # noqa: BLE001 - every failure prints the logs
        print(f"FAIL: {e}" if isinstance(e, AssertionError) else f"FAIL: {traceback.format_exc()}")
        for f in sorted(os.listdir(work)):
            if f.endswith(".log"):
                print(f"--- {f}")
                with open(os.path.join(work, f)) as fh:
                    print("".join(fh.readlines()[-15:]), end="")
    finally:
        if net:
            net.close()
        if not os.environ.get("PD_KEEP_WORK"):
            shutil.rmtree(work, ignore_errors=True)
    print("PASS" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
