#!/usr/bin/env python3
"""Hugging Face transformers `generate` decode speed on the same model directory bench_cuda
uses, for the CUDA-backend comparison in docs/benchmarks.md.

    hf_decode_bench.py MODEL_DIR [--prompt 128] [--gen 128] [--compile] [--ttft-prompt N]

Greedy decoding at batch 1 in bfloat16 on cuda:0. Decode tokens/s is measured as
(gen - 1) / (time of generate(gen tokens) - time of generate(1 token)), so the prompt's
prefill is not counted, matching bench_cuda's decode figure; TTFT is the time of
generate(1 token), best of 3, for the --prompt tokens and, with --ttft-prompt, for a prompt of
that length too (measured last: its larger static cache would not fit the compiled graphs).

--compile: the stronger peer that transformers documents for fast generation: a static KV cache
(cache_implementation="static"), with which generate runs its decode steps under torch.compile
(CompileConfig mode "reduce-overhead": CUDA graphs; the prompt's prefill stays eager). The
warm-up generates the longest run first, so the static cache is made once at its largest size and
every timed call reuses it (and the compiled graphs); the line printed counts the graphs
torch.compile made.
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
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--ttft-prompt", type=int, default=0)
    a = ap.parse_args()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).cuda()
    model.eval()
    if a.compile:
        # generate compiles the decode steps itself once the cache is static (transformers'
        # automatic compilation), with this configuration
        from transformers import CompileConfig
        model.generation_config.cache_implementation = "static"
        model.generation_config.compile_config = CompileConfig(fullgraph=True,
                                                               mode="reduce-overhead")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (1, a.prompt), generator=g).cuda()
    with torch.no_grad():
        t0 = time.perf_counter()
        for n in ((a.gen, a.gen, 1, 1) if a.compile else (8,)):  # warm-up (compilation)
            timed_generate(model, ids, n)
        warm = time.perf_counter() - t0
        t1 = min(timed_generate(model, ids, 1) for _ in range(3))
        tn = min(timed_generate(model, ids, a.gen) for _ in range(2))
        if a.ttft_prompt:
            long_ids = torch.randint(3, model.config.vocab_size, (1, a.ttft_prompt),
                                     generator=g).cuda()
            timed_generate(model, long_ids, 1)
            t_long = min(timed_generate(model, long_ids, 1) for _ in range(3))
    tps = (a.gen - 1) / (tn - t1)
    how = "eager"
    if a.compile:
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        how = f"static cache + torch.compile(reduce-overhead), {graphs} compiled graphs"
    print(f"hf transformers {__import__('transformers').__version__} generate ({how}), torch "
          f"{torch.__version__}, bf16, batch 1: {tps:.1f} decode tokens/s "
          f"({1e3 / tps:.2f} ms/token), TTFT {1e3 * t1:.2f} ms (prompt {a.prompt}, gen {a.gen}; "
          f"warm-up {warm:.1f} s)")
    if a.ttft_prompt:
        print(f"TTFT for a {a.ttft_prompt}-token prompt: {1e3 * t_long:.2f} ms")


if __name__ == "__main__":
    main()
