#!/usr/bin/env python3
"""Hugging Face transformers `generate` decode speed on the same model directory bench_cuda
uses, for the CUDA-backend comparison in docs/benchmarks.md.

    hf_decode_bench.py MODEL_DIR [--prompt 128] [--gen 128]

Greedy decoding at batch 1 in bfloat16 on cuda:0. Decode tokens/s is measured as
(gen - 1) / (time of generate(gen tokens) - time of generate(1 token)), so the prompt's
prefill is not counted, matching bench_cuda's decode figure.
"""
import argparse
import time

import torch
from transformers import AutoModelForCausalLM


def timed_generate(model, ids, n):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    torch.cuda.synchronize()
    assert out.shape[1] == ids.shape[1] + n
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    a = ap.parse_args()
    model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.bfloat16).cuda()
    model.eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (1, a.prompt), generator=g).cuda()
    with torch.no_grad():
        timed_generate(model, ids, 8)  # warm-up
        t1 = min(timed_generate(model, ids, 1) for _ in range(3))
        tn = min(timed_generate(model, ids, a.gen) for _ in range(2))
    tps = (a.gen - 1) / (tn - t1)
    print(f"hf transformers {__import__('transformers').__version__} generate, bf16, batch 1: "
          f"{tps:.1f} decode tokens/s ({1e3 / tps:.2f} ms/token, prompt {a.prompt}, "
          f"gen {a.gen})")


if __name__ == "__main__":
    main()
