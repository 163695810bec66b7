#!/usr/bin/env python3
"""Multi-turn conversations against a pd-scheduler: each turn's prompt is the last turn's prompt,
its answer and new tokens, as a chat client sends them. Prints the output rate, the latency of
later turns and what the cluster did (KV moved, prefix cache hits) from the scheduler's /metrics.
Standard library only.

  python3 tools/bench/bench_turns.py --port 9460 --conversations 8 --turns 4 --concurrency 4

Token-id prompts (random ids below --vocab, a fixed seed); greedy, ignore_eos, so every answer
has --answer-len tokens, which come back as ids (logprobs with return_tokens_as_token_ids).
docs/benchmarks.md records the figures.
"""
import argparse
import json
import random
import threading
import time
import urllib.request

from bench_n import measure


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, required=True, help="pd-scheduler's port on 127.0.0.1")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4, help="requests per conversation")
    ap.add_argument("--concurrency", type=int, default=4, help="conversations in flight")
    ap.add_argument("--first-len", type=int, default=256, help="tokens of the first prompt")
    ap.add_argument("--turn-len", type=int, default=32, help="new tokens of each later turn")
    ap.add_argument("--answer-len", type=int, default=64, help="max_tokens of every turn")
    ap.add_argument("--vocab", type=int, default=4000, help="prompt ids are in [10, vocab)")
    ap.add_argument("--stats-wait", type=float, default=2.5,
                    help="seconds for the instances' Stats to reach the scheduler, waited "
                         "before and after the conversations")
    a = ap.parse_args()
    base = f"http://127.0.0.1:{a.port}"
    rng = random.Random(11)
    firsts = [[rng.randrange(10, a.vocab) for _ in range(a.first_len)]
              for _ in range(a.conversations)]
    news = [[[rng.randrange(10, a.vocab) for _ in range(a.turn_len)] for _ in range(a.turns)]
            for _ in range(a.conversations)]
    later, errors = [], []
    lock = threading.Lock()
    queue = list(range(a.conversations))

    def conversation(c):
        prompt = list(firsts[c])
        for t in range(a.turns):
            if t:
                prompt += news[c][t]
            body = json.dumps({"prompt": prompt, "max_tokens": a.answer_len, "ignore_eos": True,
                               "temperature": 0, "logprobs": 0,
                               "return_tokens_as_token_ids": True}).encode()
            t0 = time.time()
            req = urllib.request.Request(base + "/v1/completions", body,
                                         {"Content-Type": "application/json"})
            out = json.loads(urllib.request.urlopen(req, timeout=600).read())
            answer = [int(s.split(":", 1)[1]) for s in out["choices"][0]["logprobs"]["tokens"]]
            if len(answer) != a.answer_len:
                raise ValueError(f"{len(answer)} tokens")
            if t:
                with lock:
                    later.append(time.time() - t0)
            prompt += answer

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                c = queue.pop(0)
            try:
                conversation(c)
            except Exception as e:  # noqa: BLE001 - every failure is counted and shown
                with lock:
                    errors.append(f"conversation {c}: {e}")

    wall, m0, m1 = measure(base, worker, a.concurrency, a.stats_wait)
    for e in errors:
        print(e)
    later.sort()
    med = later[len(later) // 2] * 1e3 if later else float("nan")
    print(f"conversations {a.conversations} ({len(errors)} failed) x {a.turns} turns, "
          f"{a.concurrency} in flight, first prompt {a.first_len}, +{a.turn_len} per turn, answers "
          f"{a.answer_len}: wall {wall:.2f} s, "
          f"{a.conversations * a.turns * a.answer_len / wall:.1f} output tok/s, later turns' "
          f"latency median {med:.0f} ms, KV moved {(m1[0] - m0[0]) / 1e6:.1f} MB, prefix cache "
          f"hits {m1[2] - m0[2]:.0f} of {m1[1] - m0[1]:.0f} tokens")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
