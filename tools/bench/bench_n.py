#!/usr/bin/env python3
"""Completions with n > 1 against a pd-scheduler: latency, output rate, and what the cluster did
(KV moved, prefix cache hits) from the scheduler's /metrics. Standard library only.

  python3 tools/bench/bench_n.py --port 9420 --requests 8 --concurrency 1 --n 4 \\
      --prompt-len 512 --max-tokens 32

Prompts are random token ids below --vocab (a fixed seed, one prompt per request, so the same
arguments send the same prompts); request i uses seed i, temperature 1 and ignore_eos, so every
choice generates --max-tokens tokens. docs/benchmarks.md records the figures.
"""
import argparse
import json
import random
import threading
import time
import urllib.request


def metric_sums(base):
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()

    def total(name):
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))

    return (total("pd:kv_transfer_bytes_total"), total("vllm:prefix_cache_queries_total"),
            total("vllm:prefix_cache_hits_total"))


def common_args(ap):
    """The options both benchmark scripts take: --port, --vocab, --stats-wait."""
    ap.add_argument("--port", type=int, required=True, help="pd-scheduler's port on 127.0.0.1")
    ap.add_argument("--vocab", type=int, default=4000, help="prompt ids are in [10, vocab)")
    ap.add_argument("--stats-wait", type=float, default=2.5,
                    help="seconds for the instances' Stats to reach the scheduler, waited "
                         "before and after the run")


def random_ids(rng, n, vocab):
    """n random prompt ids in [10, vocab)."""
    return [rng.randrange(10, vocab) for _ in range(n)]


def complete(base, payload):
    """POST /v1/completions with payload (a dict); the parsed response."""
    req = urllib.request.Request(base + "/v1/completions", json.dumps(payload).encode(),
                                 {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=600).read())


def cache_summary(before, after):
    """What the cluster did between two metric_sums reads, for a report line."""
    return (f"KV moved {(after[0] - before[0]) / 1e6:.1f} MB, prefix cache hits "
            f"{after[2] - before[2]:.0f} of {after[1] - before[1]:.0f} tokens")


def measure(base, n_items, run_one, name, concurrency, stats_wait):
    """Runs run_one(i) for i < n_items on `concurrency` threads between two reads of
    metric_sums, each after stats_wait seconds (the instances' Stats reach the scheduler by their
    heartbeat, so the counters of earlier traffic and of this run are in): (wall seconds, before,
    after, the failures as "<name> i: error")."""
    lock = threading.Lock()
    queue, errors = list(range(n_items)), []

    def work():
        while True:
            with lock:
                if not queue:
                    return
                i = queue.pop(0)
            try:
                run_one(i)
            except Exception as e:  # noqa: BLE001 - every failure is counted and shown
                with lock:
                    errors.append(f"{name} {i}: {e}")

    time.sleep(stats_wait)
    before = metric_sums(base)
    t0 = time.time()
    threads = [threading.Thread(target=work) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.time() - t0
    time.sleep(stats_wait)
    return wall, before, metric_sums(base), errors


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_args(ap)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight")
    ap.add_argument("--n", type=int, default=4, help="choices per request")
    ap.add_argument("--prompt-len", type=int, default=512, help="prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args()
    base = f"http://127.0.0.1:{a.port}"
    rng = random.Random(7)
    prompts = [random_ids(rng, a.prompt_len, a.vocab) for _ in range(a.requests)]
    lat = []

    def request(i):
        t0 = time.time()
        out = complete(base, {"prompt": prompts[i], "n": a.n, "max_tokens": a.max_tokens,
                              "ignore_eos": True, "temperature": 1.0, "seed": i})
        if len(out["choices"]) != a.n:
            raise ValueError(f"{len(out['choices'])} choices")
        lat.append(time.time() - t0)  # list.append is atomic

    wall, m0, m1, errors = measure(base, a.requests, request, "request", a.concurrency,
                                   a.stats_wait)
    for e in errors:
        print(e)
    lat.sort()
    med = lat[len(lat) // 2] * 1e3 if lat else float("nan")
    top = lat[-1] * 1e3 if lat else float("nan")
    print(f"requests {a.requests} ({len(errors)} failed), {a.concurrency} in flight, n {a.n}, "
          f"prompt {a.prompt_len}, max_tokens {a.max_tokens}: wall {wall:.2f} s, "
          f"{len(lat) * a.n * a.max_tokens / wall:.1f} output tok/s, latency median {med:.0f} ms, "
          f"max {top:.0f} ms, {cache_summary(m0, m1)}")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
