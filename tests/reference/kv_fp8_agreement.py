#!/usr/bin/env python3
"""Teacher-forced greedy agreement of pdserve's fp8 KV cache (--kv-cache-dtype fp8).

  kv_fp8_agreement.py --generate PD_GENERATE --model DIR [--prompts N] [--tokens T]
                      [--prompt-len P] [--seed S] [--min-impl F] [--min-format F]

For N prompts of P random token ids: pd-generate writes T greedy tokens with its float KV cache
(the sequence); then, on prompt + sequence, every position's most likely next token is taken
(teacher forcing) by
  * pd-generate --kv-cache-dtype fp8 (prompt logprobs, rank 1),
  * llama_ref.py's float64 pass with a float KV cache, and with --kv-fp8 (the same e4m3 rounding
    and scales, independent of pdserve).
Prints the agreements as JSON:
  fp8_vs_float_kv   pd's fp8 choices = the sequence (pd's float-KV choices): the quality figure
  format            numpy fp8 choices = numpy float64 choices: what e4m3 itself costs
  impl              pd's fp8 choices = numpy fp8 choices: pdserve's kernels against the reference
Exits 1 when impl < --min-impl (default 0.98) or fp8_vs_float_kv < --min-format (default 0).
"""
import argparse
import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_ref  # noqa: E402


def generate(gen, model, ids, extra):
    out = subprocess.run([gen, "--model", model, "--prompt-ids", ",".join(map(str, ids)), "--json",
                          "--temperature", "0", "--ignore-eos", "--cpu-threads", "2"] + extra,
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--generate", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--min-impl", type=float, default=0.98)
    ap.add_argument("--min-format", type=float, default=0.0)
    a = ap.parse_args(argv)
    ref = llama_ref.Model(a.model)
    ref8 = llama_ref.Model(a.model, kv_fp8=True)
    rng = np.random.default_rng(a.seed)
    n = agree = fmt = impl = 0
    for _ in range(a.prompts):
        prompt = rng.integers(3, ref.cfg.vocab, a.prompt_len).tolist()
        seq = generate(a.generate, a.model, prompt, ["--max-tokens", str(a.tokens)])["token_ids"]
        ids = prompt + seq
        plp = generate(a.generate, a.model, ids, ["--max-tokens", "1", "--prompt-logprobs", "1",
                                                  "--kv-cache-dtype", "fp8"])["prompt_logprobs"]
        pd8 = [int(next(t for t, e in plp[i].items() if e["rank"] == 1))
               for i in range(len(prompt), len(ids))]
        choices = []
        for m in (ref, ref8):
            m.reset()
            logits = m.forward(ids, 0)
            choices.append(np.argmax(logits[len(prompt) - 1:len(ids) - 1], axis=-1).tolist())
        n += len(seq)
        agree += sum(p == s for p, s in zip(pd8, seq))
        fmt += sum(x == y for x, y in zip(choices[1], choices[0]))
        impl += sum(p == x for p, x in zip(pd8, choices[1]))
    res = {"positions": n, "fp8_vs_float_kv": agree / n, "format": fmt / n, "impl": impl / n}
    print(json.dumps(res))
    return 0 if res["impl"] >= a.min_impl and res["fp8_vs_float_kv"] >= a.min_format else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
