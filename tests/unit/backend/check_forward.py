#!/usr/bin/python3
"""The C forward pass against the independent numpy reference (tests/reference/llama_ref.py).

For each model variant (made by pd-mkmodel with its shape flags: GQA and MHA, head_dim !=
hidden/heads, rope_scaling none/linear/dynamic/llama3, tied/untied embeddings, q/k/v(/o) bias,
Llama/Mistral/Qwen2/Qwen3 (per-head q/k norms), f32/bf16/f16 weights, single file and sharded,
and quantized checkpoints: AWQ, GPTQ 4/8 bit with act order, symmetric, v1/v2 zero points, per
channel, fp8, int8 W8A8) and several prompts, runs fwd_dump and llama_ref.py and requires (a
quantized model's reference is llama_ref.py on the float model that the independent numpy
dequantizer tests/reference/quant_ref.py makes of it):
  * logits at the last prompt position within relative error 1e-4
    (max |c - ref| / max |ref|, ref in float64);
  * identical greedy tokens for 64 steps;
  * with --all-logits on one variant per group, every prompt position within 1e-4; also for a
    600-token prompt on LONG variants (RoPE rows past the first table sizes);
  * fwd_dump --check-determinism (bit-identical logits and tokens alone, chunked 1/3/7, and
    batched with other sequences) on a few variants, with both kernel families;
  * the bf16 compute mode (--compute-dtype bfloat16, pd-generate --dtype bfloat16) on a few
    variants, with both kernel families (auto: vdpbf16ps where the CPU has avx512_bf16; scalar:
    the emulation): every prompt position's logits within BF16_REL_TOL of the float64
    reference, --check-determinism, and pd-generate's greedy tokens equal to fwd_dump's.
Tiny shapes keep the whole run to a few seconds.

Also, with --generate: pd-generate --json greedy output equals the reference tokens, and a
batch of prompts (--prompts-file) gives each prompt the same tokens and text as running it
alone, greedy and with seeded top-p sampling.

usage: check_forward.py --mkmodel PD_MKMODEL --fwd-dump FWD_DUMP --ref LLAMA_REF_PY
                        [--generate PD_GENERATE] [--only NAME,...]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

REL_TOL = 1e-4
# The bf16 compute mode rounds every matmul input (and f32 weights) to bf16, unit roundoff
# u = 2^-8: each rounding perturbs an element by at most u relative, and the 2-layer variants
# have 9 roundings on the way to the logits (4 per layer, the LM head), whose independent
# errors grow like their square root (~3u). 4u leaves room; measured 3.1e-3 to 6.1e-3
# (docs/benchmarks.md). A kernel bug (a lost tail, a wrong pair order) is far above it; the
# exact rounding is checked op by op in test_backend (matmul_matches_reference).
BF16_REL_TOL = 4 * 2.0 ** -8
STEPS = 64

# name, pd-mkmodel flags
VARIANTS = [
    ("gqa_f32", []),
    ("mha", ["--heads", "4", "--kv-heads", "4"]),
    ("head_dim_48", ["--head-dim", "48"]),
    ("rope_linear", ["--rope-scaling", "linear:2"]),
    ("rope_dynamic", ["--rope-scaling", "dynamic:2", "--max-pos", "24"]),
    ("rope_llama3", ["--rope-scaling", "llama3:8", "--rope-theta", "500000"]),
    ("tied", ["--tie-embeddings"]),
    ("llama_bias", ["--qkv-bias"]),
    ("qwen2", ["--arch", "qwen2"]),
    ("mistral_mqa", ["--arch", "mistral", "--kv-heads", "1"]),
    ("bf16", ["--dtype", "bfloat16"]),
    ("f16", ["--dtype", "float16"]),
    ("sharded", ["--shards", "3"]),
    ("bf16_sharded_tied_qwen2", ["--dtype", "bfloat16", "--shards", "2", "--tie-embeddings",
                                 "--arch", "qwen2"]),
    ("qwen3", ["--arch", "qwen3", "--head-dim", "48"]),
    ("bf16_tied_qwen3", ["--dtype", "bfloat16", "--tie-embeddings", "--arch", "qwen3"]),
    ("awq", ["--quantize", "awq"]),
    ("awq_g32_qwen2", ["--quantize", "awq", "--group-size", "32", "--arch", "qwen2"]),
    ("gptq4_act_order", ["--quantize", "gptq", "--desc-act", "--group-size", "32"]),
    ("gptq8_sym_v2", ["--quantize", "gptq", "--bits", "8", "--sym", "--checkpoint-format",
                      "gptq_v2", "--shards", "2"]),
    ("gptq4_per_channel", ["--quantize", "gptq", "--group-size", "-1"]),
    ("fp8", ["--quantize", "fp8", "--dtype", "bfloat16"]),
    ("fp8_static", ["--quantize", "fp8", "--activation-scheme", "static"]),
    ("w8a8", ["--quantize", "w8a8"]),
]

PROMPTS = [
    [1, 2, 3],
    [17, 400, 1023, 5, 77, 902, 1500, 13, 13, 13, 8, 640, 2000, 31, 9, 1],
    [2045, 100],
]

ALL_LOGITS = {"gqa_f32", "rope_dynamic", "bf16"}
# a prompt past the forward's first RoPE table sizes (rows cached per position, the table
# doubling from 256 positions): every position's logits against the reference
LONG_PROMPT = [(i * 7919 + 13) % 2000 + 1 for i in range(600)]
LONG = {"gqa_f32", "rope_llama3"}
DETERMINISM = {"gqa_f32", "qwen2", "qwen3", "bf16", "head_dim_48", "awq", "gptq4_act_order", "w8a8",
               "fp8"}
GENERATE = {"gqa_f32", "qwen2", "qwen3", "awq", "gptq4_act_order", "w8a8"}
BF16_COMPUTE = {"gqa_f32", "bf16", "bf16_tied_qwen3"}


def check_bf16_compute(args, mdir, name):
    """The bf16 compute mode: all-position logits of PROMPTS[1] within BF16_REL_TOL, greedy
    tokens not degenerate, determinism, and pd-generate --dtype bfloat16 giving fwd_dump's
    greedy tokens (the same kernels through the engine). Returns (checks, failures)."""
    ids = ",".join(str(t) for t in PROMPTS[1])
    cmd = ["--model", mdir, "--prompt-ids", ids, "--steps", str(STEPS)]
    ref = json.loads(run([sys.executable, args.ref] + cmd + ["--all-logits"]))
    checks = fails = 0
    for isa in ("auto", "scalar"):
        got = json.loads(run([args.fwd_dump] + cmd + ["--all-logits", "--isa", isa,
                                                      "--compute-dtype", "bfloat16"]))
        checks += 1
        e = rel_err(got["all_logits"], ref["all_logits"])
        if not e <= BF16_REL_TOL or len(got["greedy_tokens"]) != STEPS or \
                len(set(got["greedy_tokens"])) < 4:
            print(f"FAIL {name}: bf16 compute ({isa}): all-position logits rel error {e:.3g} "
                  f"(tolerance {BF16_REL_TOL:.3g}), greedy {got['greedy_tokens'][:10]}")
            fails += 1
        else:
            print(f"ok  {name}: bf16 compute ({isa}): rel error {e:.3g}")
        checks += 1
        p = subprocess.run([args.fwd_dump, "--model", mdir, "--prompt-ids", ids, "--steps", "24",
                            "--check-determinism", "--isa", isa, "--compute-dtype", "bfloat16"],
                           capture_output=True, text=True)
        if p.returncode != 0:
            print(f"FAIL {name}: bf16 compute determinism ({isa}): {p.stderr.strip()}")
            fails += 1
        if args.generate and isa == "auto":
            checks += 1
            (o,) = gen_json(args.generate, mdir, ["--prompt-ids", ids, "--max-tokens",
                                                  str(STEPS), "--temperature", "0", "--dtype",
                                                  "bfloat16"])
            want = got["greedy_tokens"]
            if not o["token_ids"] or o["token_ids"] != want[:len(o["token_ids"])]:
                print(f"FAIL {name}: pd-generate --dtype bfloat16 {o['token_ids'][:8]} vs "
                      f"fwd_dump {want[:8]}")
                fails += 1
    return checks, fails


def gen_json(generate, mdir, extra):
    out = run([generate, "--model", mdir, "--json"] + extra)
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def check_generate(generate, mdir, name, ref_tokens, tmp):
    """pd-generate --json: greedy equals the reference (up to EOS); a batch of prompts from a
    .ids file gives every prompt the tokens it gets alone, greedy and seeded sampling."""
    fails = 0
    ids_file = os.path.join(tmp, name + ".ids")
    with open(ids_file, "w") as f:
        for p in PROMPTS:
            f.write(",".join(str(t) for t in p) + "\n")
    for pi, prompt in enumerate(PROMPTS):
        ids = ",".join(str(t) for t in prompt)
        (o,) = gen_json(generate, mdir, ["--prompt-ids", ids, "--max-tokens", str(STEPS),
                                         "--temperature", "0"])
        want = ref_tokens[pi]
        got = o["token_ids"]
        ok = o["prompt_token_ids"] == prompt and got == want[:len(got)] and (
            (o["finish_reason"] == "length" and len(got) == STEPS) or
            (o["finish_reason"] == "stop" and len(got) <= STEPS))
        if not ok:
            print(f"FAIL {name}: pd-generate greedy prompt {pi}: {o['finish_reason']} "
                  f"{got[:8]} vs reference {want[:8]}")
            fails += 1
    for extra in (["--temperature", "0"], ["--temperature", "0.8", "--seed", "3", "--top-p",
                                            "0.9"]):
        batch = gen_json(generate, mdir, ["--prompts-file", ids_file, "--max-tokens", "24"]
                         + extra)
        for pi, prompt in enumerate(PROMPTS):
            (alone,) = gen_json(generate, mdir, ["--prompt-ids", ",".join(map(str, prompt)),
                                                 "--max-tokens", "24"] + extra)
            if len(batch) != len(PROMPTS) or batch[pi]["token_ids"] != alone["token_ids"] or \
                    batch[pi]["text"] != alone["text"]:
                print(f"FAIL {name}: pd-generate {' '.join(extra)}: prompt {pi} batched differs "
                      f"from alone")
                fails += 1
    return fails


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(f"command failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr}\n")
        raise SystemExit(1)
    return p.stdout


def rel_err(c, r):
    c = np.asarray(c, dtype=np.float64)
    r = np.asarray(r, dtype=np.float64)
    if c.shape != r.shape:
        return float("inf")
    return float(np.max(np.abs(c - r)) / max(np.max(np.abs(r)), 1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mkmodel", required=True)
    ap.add_argument("--fwd-dump", required=True)
    ap.add_argument("--ref", required=True)
    ap.add_argument("--generate", default=None, help="pd-generate, checked on GENERATE variants")
    ap.add_argument("--only", default=None, help="comma-separated variant names")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else None

    failures = 0
    checks = 0
    with tempfile.TemporaryDirectory(prefix="pd_fwd_") as tmp:
        for name, flags in VARIANTS:
            if only and name not in only:
                continue
            mdir = os.path.join(tmp, name)
            run([args.mkmodel, "--preset", "tiny", "--out", mdir, "--layers", "2", "--seed", "7"]
                + flags)
            refdir = mdir
            # int8 W8A8: activations quantized per token in both (llama_ref.py --act-int8)
            refx = ["--act-int8"] if "w8a8" in flags else []
            if "--quantize" in flags:
                refdir = mdir + "_dequantized"
                run([sys.executable, os.path.join(os.path.dirname(args.ref), "quant_ref.py"),
                     "--model", mdir, "--out", refdir])
            worst = 0.0
            ref_tokens = []
            for pi, prompt in enumerate(PROMPTS):
                ids = ",".join(str(t) for t in prompt)
                want_all = name in ALL_LOGITS and pi == 1
                extra = ["--all-logits"] if want_all else []
                ref = json.loads(run([sys.executable, args.ref, "--model", refdir, "--prompt-ids",
                                      ids, "--steps", str(STEPS)] + extra + refx))
                got = json.loads(run([args.fwd_dump, "--model", mdir, "--prompt-ids", ids,
                                      "--steps", str(STEPS)] + extra))
                checks += 1
                ref_tokens.append(ref["greedy_tokens"])
                e = rel_err(got["prompt_logits_last"], ref["prompt_logits_last"])
                worst = max(worst, e)
                if not e <= REL_TOL:
                    print(f"FAIL {name} prompt {pi}: last-position logits rel error {e:.3g}")
                    failures += 1
                if got["greedy_tokens"] != ref["greedy_tokens"]:
                    k = next(i for i, (a, b) in enumerate(zip(got["greedy_tokens"],
                                                              ref["greedy_tokens"])) if a != b)
                    print(f"FAIL {name} prompt {pi}: greedy tokens differ from step {k}: "
                          f"{got['greedy_tokens'][k:k+5]} vs {ref['greedy_tokens'][k:k+5]}")
                    failures += 1
                if len(got["greedy_tokens"]) != STEPS or len(set(got["greedy_tokens"])) < 4:
                    print(f"FAIL {name} prompt {pi}: degenerate greedy output "
                          f"{got['greedy_tokens'][:10]}")
                    failures += 1
                if want_all:
                    ea = rel_err(got["all_logits"], ref["all_logits"])
                    worst = max(worst, ea)
                    if not ea <= REL_TOL:
                        print(f"FAIL {name} prompt {pi}: all-position logits rel error {ea:.3g}")
                        failures += 1
            if name in LONG:
                ids = ",".join(str(t) for t in LONG_PROMPT)
                cmd = ["--model", mdir, "--prompt-ids", ids, "--steps", "4", "--all-logits"]
                ref = json.loads(run([sys.executable, args.ref] + cmd))
                got = json.loads(run([args.fwd_dump] + cmd))
                checks += 1
                ea = rel_err(got["all_logits"], ref["all_logits"])
                worst = max(worst, ea)
                if not ea <= REL_TOL or got["greedy_tokens"] != ref["greedy_tokens"]:
                    print(f"FAIL {name}: {len(LONG_PROMPT)}-token prompt: all-position logits "
                          f"rel error {ea:.3g}, tokens equal: "
                          f"{got['greedy_tokens'] == ref['greedy_tokens']}")
                    failures += 1
            # the scalar kernels must agree with the reference too
            sc = json.loads(run([args.fwd_dump, "--model", mdir, "--prompt-ids",
                                 ",".join(str(t) for t in PROMPTS[1]), "--steps", str(STEPS),
                                 "--isa", "scalar", "--threads", "1"]))
            ref = json.loads(run([sys.executable, args.ref, "--model", refdir, "--prompt-ids",
                                  ",".join(str(t) for t in PROMPTS[1]), "--steps", str(STEPS)]
                                 + refx))
            es = rel_err(sc["prompt_logits_last"], ref["prompt_logits_last"])
            checks += 1
            if not es <= REL_TOL or sc["greedy_tokens"] != ref["greedy_tokens"]:
                print(f"FAIL {name}: scalar kernels: rel error {es:.3g}, tokens equal: "
                      f"{sc['greedy_tokens'] == ref['greedy_tokens']}")
                failures += 1
            if name in DETERMINISM:
                for isa in ("auto", "scalar"):
                    checks += 1
                    p = subprocess.run([args.fwd_dump, "--model", mdir, "--prompt-ids",
                                        ",".join(str(t) for t in PROMPTS[1]), "--steps", "24",
                                        "--check-determinism", "--isa", isa],
                                       capture_output=True, text=True)
                    if p.returncode != 0:
                        print(f"FAIL {name}: determinism ({isa}): {p.stderr.strip()}")
                        failures += 1
            if name in BF16_COMPUTE:
                c, f = check_bf16_compute(args, mdir, name)
                checks += c
                failures += f
            if args.generate and name in GENERATE:
                checks += 1
                failures += check_generate(args.generate, mdir, name, ref_tokens, tmp)
            print(f"{'ok  ' if failures == 0 else '    '}{name}: worst rel error {worst:.3g}")
    print(f"check_forward: {checks} checks, {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
