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
import random
import time

from bench_n import cache_summary, common_args, complete, measure, random_ids


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_args(ap)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4, help="requests per conversation")
    ap.add_argument("--concurrency", type=int, default=4, help="conversations in flight")
    ap.add_argument("--first-len", type=int, default=256, help="tokens of the first prompt")
    ap.add_argument("--turn-len", type=int, default=32, help="new tokens of each later turn")
    ap.add_argument("--answer-len", type=int, default=64, help="max_tokens of every turn")
    a = ap.parse_args()
    base = f"http://127.0.0.1:{a.port}"
    rng = random.Random(11)
    firsts = [random_ids(rng, a.first_len, a.vocab) for _ in range(a.conversations)]
    news = [[random_ids(rng, a.turn_len, a.vocab) for _ in range(a.turns)]
            for _ in range(a.conversations)]
    later = []

    def conversation(c):
        prompt = list(firsts[c])
        for t in range(a.turns):
            if t:
                prompt += news[c][t]
            t0 = time.time()
            out = complete(base, {"prompt": prompt, "max_tokens": a.answer_len,
                                  "ignore_eos": True, "temperature": 0, "logprobs": 0,
                                  "return_tokens_as_token_ids": True})
            answer = [int(s.split(":", 1)[1]) for s in out["choices"][0]["logprobs"]["tokens"]]
            if len(answer) != a.answer_len:
                raise ValueError(f"{len(answer)} tokens")
            if t:
                later.append(time.time() - t0)  # list.append is atomic
            prompt += answer

    wall, m0, m1, errors = measure(base, a.conversations, conversation, "conversation",
                                   a.concurrency, a.stats_wait)
    for e in errors:
        print(e)
    later.sort()
    med = later[len(later) // 2] * 1e3 if later else float("nan")
    print(f"conversations {a.conversations} ({len(errors)} failed) x {a.turns} turns, "
          f"{a.concurrency} in flight, first prompt {a.first_len}, +{a.turn_len} per turn, answers "
          f"{a.answer_len}: wall {wall:.2f} s, "
          f"{a.conversations * a.turns * a.answer_len / wall:.1f} output tok/s, later turns' "
          f"latency median {med:.0f} ms, {cache_summary(m0, m1)}")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
