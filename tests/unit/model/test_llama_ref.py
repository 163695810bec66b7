#!/usr/bin/python3
"""Checks tests/reference/llama_ref.py on tiny models written by pd-mkmodel.

What is checked: the CLI contract the forward-pass tests rely on (keys, lengths, finite values),
greedy output is not degenerate, the KV-cache generation loop agrees with recomputing the whole
sequence, the safetensors parser reads bf16/f16 exactly as numpy rounds float32, sharded and
single-file checkpoints give identical logits, and the attention/RMSNorm/RoPE math agrees with a
deliberately naive loop implementation on a 1-layer model; and tests/reference/beam_ref.py
(vLLM 0.5 beam search on that model): width 1 without EOS is greedy, and every answered beam's
logprob and score agree with one fresh forward pass. Prints harness-style lines.
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

SRC = os.environ.get("PD_SOURCE_ROOT", os.path.join(os.path.dirname(__file__), "..", "..", ".."))
BUILD = os.environ.get("PD_BUILD_ROOT")
REF = os.path.join(SRC, "tests", "reference", "llama_ref.py")
sys.dont_write_bytecode = True  # nothing written into the source tree
sys.path.insert(0, os.path.dirname(REF))
import llama_ref  # noqa: E402

passed = failed = 0


def mkmodel(out, *args):
    exe = os.path.join(BUILD, "tools", "mkmodel", "pd-mkmodel")
    subprocess.run([exe, "--out", out, *args], check=True, stdout=subprocess.DEVNULL)
    return out


def run_ref(model, ids, steps, *extra):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run(["/usr/bin/python3", REF, "--model", model, "--prompt-ids",
                        ",".join(map(str, ids)), "--steps", str(steps), "--out", f.name, *extra],
                       check=True)
        with open(f.name) as g:
            return json.load(g)


def llama_ref_log_softmax(x):
    m = np.max(x)
    return x - m - np.log(np.sum(np.exp(x - m)))


def check(name, fn):
    global passed, failed
    try:
        fn()
        print(f"PASS {name}")
        passed += 1
    except Exception as e:  # report and continue with the other checks
        print(f"FAIL {name}: {type(e).__name__}: {e}")
        failed += 1


def main():
    if not BUILD:
        print("SKIP: PD_BUILD_ROOT not set")
        return 77
    tmp = tempfile.mkdtemp(prefix="pd_llama_ref_")
    tiny = mkmodel(os.path.join(tmp, "tiny"), "--preset", "tiny")
    qwen = mkmodel(os.path.join(tmp, "qwen"), "--preset", "tiny", "--arch", "qwen2",
                   "--tie-embeddings", "--dtype", "bfloat16", "--shards", "2")
    qwen1 = mkmodel(os.path.join(tmp, "qwen1"), "--preset", "tiny", "--arch", "qwen2",
                    "--tie-embeddings", "--dtype", "bfloat16")
    f16 = mkmodel(os.path.join(tmp, "f16"), "--preset", "tiny", "--dtype", "float16")
    prompt = [5, 300, 17, 1200, 44, 9, 650]

    def cli_contract():
        r = run_ref(tiny, prompt, 12, "--all-logits", "--step-logits")
        v = json.load(open(os.path.join(tiny, "config.json")))["vocab_size"]
        assert r["precision"] == "float64"
        assert len(r["prompt_logits_last"]) == v
        assert len(r["greedy_tokens"]) == 12 and len(r["step_logits_max_abs"]) == 12
        assert len(r["all_logits"]) == len(prompt) and all(len(x) == v for x in r["all_logits"])
        assert r["all_logits"][-1] == r["prompt_logits_last"]
        assert len(r["step_logits"]) == 12 and r["step_logits"][0] == r["prompt_logits_last"]
        assert np.all(np.isfinite(np.array(r["all_logits"])))
        for t, lg, m in zip(r["greedy_tokens"], r["step_logits"], r["step_logits_max_abs"]):
            assert t == int(np.argmax(lg)) and abs(m - float(np.max(np.abs(lg)))) < 1e-12
        # stdout mode prints the same JSON
        out = subprocess.run(["/usr/bin/python3", REF, "--model", tiny, "--prompt-ids",
                              ",".join(map(str, prompt)), "--steps", "3"], check=True,
                             capture_output=True, text=True).stdout
        assert json.loads(out)["greedy_tokens"] == r["greedy_tokens"][:3]
        # bad ids are refused with a message
        bad = subprocess.run(["/usr/bin/python3", REF, "--model", tiny, "--prompt-ids", "1,x"],
                             capture_output=True, text=True)
        assert bad.returncode != 0 and "--prompt-ids" in bad.stderr

    def not_degenerate():
        for model in (tiny, qwen, f16):
            r = run_ref(model, prompt, 32)
            toks = r["greedy_tokens"]
            assert len(set(toks)) >= 8, f"{model}: only {len(set(toks))} distinct tokens: {toks}"
            lg = np.array(r["prompt_logits_last"])
            assert 1.0 < lg.std() < 20.0, f"{model}: logit std {lg.std()}"

    def kv_cache_matches_recompute():
        for model in (tiny, qwen):
            r = run_ref(model, prompt, 10, "--step-logits")
            m = llama_ref.Model(model)
            seq = prompt + r["greedy_tokens"]
            for k in (0, 4, 9):
                m.reset()
                full = m.forward(seq[:len(prompt) + k], 0)[-1]
                step = np.array(r["step_logits"][k])
                err = np.max(np.abs(full - step)) / np.max(np.abs(step))
                assert err < 1e-10, f"{model} step {k}: rel err {err}"

    def dtype_parsing_exact():
        w32 = llama_ref.load_weights(tiny)
        wbf = llama_ref.load_weights(mkmodel(os.path.join(tmp, "bf"), "--preset", "tiny",
                                             "--dtype", "bfloat16"))
        w16 = llama_ref.load_weights(f16)
        for name in ("model.layers.1.self_attn.q_proj.weight", "model.norm.weight"):
            a = w32[name].astype(np.float32)
            u = a.view(np.uint32).astype(np.uint64)
            rne = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32) << 16
            want_bf = rne.astype(np.uint32).view(np.float32).astype(np.float64)
            assert np.array_equal(wbf[name], want_bf), name
            assert np.array_equal(w16[name], a.astype(np.float16).astype(np.float64)), name

    def sharded_equals_single():
        a = run_ref(qwen, prompt, 5)
        b = run_ref(qwen1, prompt, 5)
        assert a == b

    def naive_one_layer():
        # a 1-layer GQA model with q/k/v bias and linear RoPE, recomputed with explicit loops
        d = mkmodel(os.path.join(tmp, "one"), "--preset", "tiny", "--layers", "1", "--arch",
                    "qwen2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                    "--rope-scaling", "linear:2")
        m = llama_ref.Model(d)
        c, w = m.cfg, m.w
        ids = [3, 1000, 77, 5]
        m.reset()
        got = m.forward(ids, 0)
        D, Hq, Hk = c.head_dim, c.heads, c.kv_heads

        def norm(x, g):
            return np.array([x[i] * g[i] / np.sqrt(sum(v * v for v in x) / len(x) + c.eps)
                             for i in range(len(x))])

        def rope(vec, pos):
            out = np.zeros(D)
            for i in range(D // 2):
                th = pos * (c.theta ** (-2.0 * i / D)) / 2.0  # linear factor 2
                x1, x2 = vec[i], vec[i + D // 2]
                out[i] = x1 * np.cos(th) - x2 * np.sin(th)
                out[i + D // 2] = x2 * np.cos(th) + x1 * np.sin(th)
            return out

        p = "model.layers.0."
        xs = [m.embed[t].copy() for t in ids]
        qs, ks, vs = [], [], []
        for pos, x in enumerate(xs):
            h = norm(x, w[p + "input_layernorm.weight"])
            q = w[p + "self_attn.q_proj.weight"] @ h + w[p + "self_attn.q_proj.bias"]
            k = w[p + "self_attn.k_proj.weight"] @ h + w[p + "self_attn.k_proj.bias"]
            v = w[p + "self_attn.v_proj.weight"] @ h + w[p + "self_attn.v_proj.bias"]
            qs.append([rope(q[j * D:(j + 1) * D], pos) for j in range(Hq)])
            ks.append([rope(k[j * D:(j + 1) * D], pos) for j in range(Hk)])
            vs.append([v[j * D:(j + 1) * D] for j in range(Hk)])
        for t in range(len(ids)):
            heads = []
            for j in range(Hq):
                kv = j // (Hq // Hk)
                s = np.array([qs[t][j] @ ks[u][kv] / np.sqrt(D) for u in range(t + 1)])
                e = np.exp(s - s.max())
                pr = e / e.sum()
                heads.append(sum(pr[u] * vs[u][kv] for u in range(t + 1)))
            x = xs[t] + w[p + "self_attn.o_proj.weight"] @ np.concatenate(heads)
            h = norm(x, w[p + "post_attention_layernorm.weight"])
            g = w[p + "mlp.gate_proj.weight"] @ h
            u = w[p + "mlp.up_proj.weight"] @ h
            x = x + w[p + "mlp.down_proj.weight"] @ (g / (1 + np.exp(-g)) * u)
            logits = m.embed @ norm(x, w["model.norm.weight"])  # tied (qwen2 tiny: untied)
            if not c.tie:
                logits = w["lm_head.weight"] @ norm(x, w["model.norm.weight"])
            err = np.max(np.abs(logits - got[t])) / np.max(np.abs(logits))
            assert err < 1e-12, f"position {t}: rel err {err}"

    def dynamic_rope_changes_with_length():
        d = mkmodel(os.path.join(tmp, "dyn"), "--preset", "tiny", "--rope-scaling", "dynamic:2",
                    "--max-pos", "8")
        s = mkmodel(os.path.join(tmp, "nodyn"), "--preset", "tiny", "--max-pos", "8")
        short = [5, 300, 17]
        a, b = run_ref(d, short, 1), run_ref(s, short, 1)
        assert a["prompt_logits_last"] == b["prompt_logits_last"]  # below max_pos: default
        long_ = prompt + prompt
        a, b = run_ref(d, long_, 1), run_ref(s, long_, 1)
        assert a["prompt_logits_last"] != b["prompt_logits_last"]

    beam_ref = os.path.join(SRC, "tests", "reference", "beam_ref.py")

    def run_beams(model, ids, *extra):
        out = subprocess.run(["/usr/bin/python3", beam_ref, "--model", model, "--prompt-ids",
                              ",".join(map(str, ids)), *extra], check=True, capture_output=True,
                             text=True).stdout
        return json.loads(out)["beams"]

    def beam_width1_is_greedy():
        g = run_ref(tiny, prompt, 8)["greedy_tokens"]
        b = run_beams(tiny, prompt, "--width", "1", "--max-tokens", "8", "--ignore-eos")
        assert len(b) == 1 and b[0]["tokens"] == g and b[0]["finish_reason"] == "length", (b, g)

    def beam_scores_recompute():
        """Each answered beam's cumulative logprob is the sum of its tokens' log-softmax values
        from one fresh forward pass over prompt + tokens (the search's KV forks are right), its
        score follows vLLM's formula, the answer is best first, finish reasons are consistent;
        an EOS among the greedy path's tokens ends some beams inside the width."""
        g = run_ref(tiny, prompt, 4)["greedy_tokens"]
        eos = g[2]
        m = llama_ref.Model(tiny)
        stops = 0
        for lp in ("0.5", "1", "2"):
            for early in ("false", "true", "never"):
                beams = run_beams(tiny, prompt, "--width", "4", "--n", "3", "--max-tokens", "6",
                                  "--length-penalty", lp, "--early-stopping", early,
                                  "--eos", str(eos))
                assert len(beams) == 3, beams
                scores = [b["score"] for b in beams]
                assert scores == sorted(scores, reverse=True), scores
                for b in beams:
                    t = b["tokens"]
                    m.reset()
                    logits = m.forward(prompt + t[:-1], 0)[len(prompt) - 1:]
                    cum = sum(float(llama_ref_log_softmax(lg)[x]) for lg, x in zip(logits, t))
                    assert abs(cum - b["cumulative_logprob"]) < 1e-9, (cum, b)
                    want = cum / ((len(prompt) + len(t)) ** float(lp))
                    assert abs(want - b["score"]) < 1e-12, (want, b)
                    if b["finish_reason"] == "stop":
                        assert t[-1] == eos and eos not in t[:-1], b
                        stops += 1
                    else:
                        assert b["finish_reason"] == "length" and len(t) == 6 and eos not in t, b
        assert stops > 0, "no beam ended with EOS"

    for name, fn in [("cli_contract", cli_contract), ("not_degenerate", not_degenerate),
                     ("beam_width1_is_greedy", beam_width1_is_greedy),
                     ("beam_scores_recompute", beam_scores_recompute),
                     ("kv_cache_matches_recompute", kv_cache_matches_recompute),
                     ("dtype_parsing_exact", dtype_parsing_exact),
                     ("sharded_equals_single", sharded_equals_single),
                     ("naive_one_layer", naive_one_layer),
                     ("dynamic_rope_changes_with_length", dynamic_rope_changes_with_length)]:
        check(name, fn)
    subprocess.run(["rm", "-rf", tmp])
    print(f"harness: {passed} passed, {failed} failed, 0 skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
