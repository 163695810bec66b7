#!/usr/bin/python3
"""The engine's beam search (use_beam_search) against tests/reference/beam_ref.py, vLLM 0.5's
search over the numpy reference model: token for token, finish reasons equal, cumulative
logprob and score within 1e-4, on three model shapes (pd-mkmodel tiny llama, tiny qwen2 with
biases and tied embeddings, small), prompts of 1, 7 and 37 tokens (the last over two blocks of
16: its last block is copied on write), an EOS that ends beams inside the width and one that
never does, length_penalty 0.5 / 1 / 2 with each early_stopping value, n < best_of, stop token
ids, ignore_eos, stop ids frequent enough that each early_stopping rule gives its own answer,
and two searches preempting each other's beams in a small pool. Each case also runs split
(beam_run --split: prefilled on one engine, the KV moved, the search imported on another) and
must answer bit for bit as colocated. Also: the prompt's blocks are held once whatever the
width, an abort mid-search gives every block back (colocated and split), and with logprobs
each token's logprob and top ones are the reference's.

The EOS is chosen per case by editing the model copy's config.json (the engine takes it from
there when the directory has no tokenizer); usage: test_beam.py BEAM_RUN. Prints
harness-style lines.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

SRC = os.environ.get("PD_SOURCE_ROOT", os.path.join(os.path.dirname(__file__), "..", "..", ".."))
BUILD = os.environ.get("PD_BUILD_ROOT")
BEAM_REF = os.path.join(SRC, "tests", "reference", "beam_ref.py")
sys.dont_write_bytecode = True  # nothing written into the source tree
sys.path.insert(0, os.path.join(SRC, "tests", "unit", "model"))
import test_llama_ref as harness  # noqa: E402  check() and mkmodel() of the python tests

PD_ECANCELLED = -13
MAX_MODEL_LEN = 256
TOL = 1e-4
check, mkmodel = harness.check, harness.mkmodel


def with_eos(src, dst, eos):
    """A copy of model src whose only EOS is eos: config.json edited, no tokenizer or
    generation config (their EOS ids would come first), weights linked."""
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            if not os.path.exists(os.path.join(dst, f)):
                os.symlink(os.path.join(src, f), os.path.join(dst, f))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["eos_token_id"] = eos
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def args_of(prompt, width, n, max_tokens, lp, early, extra):
    return ["--prompt-ids", ",".join(map(str, prompt)), "--width", str(width), "--n", str(n),
            "--max-tokens", str(max_tokens), "--length-penalty", str(lp), "--early-stopping",
            early, "--max-model-len", str(MAX_MODEL_LEN), *extra]


def engine(beam_run, model, *args):
    out = subprocess.run([beam_run, "--model", model, *args], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def reference(model, eos, *args):
    out = subprocess.run(["/usr/bin/python3", BEAM_REF, "--model", model, "--eos", str(eos),
                          *args], check=True, capture_output=True, text=True, timeout=300)
    return json.loads(out.stdout)["beams"]


def same_beams(got, want, what):
    assert len(got) == len(want), f"{what}: {len(got)} beams, want {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g["tokens"] == w["tokens"], f"{what}: beam {i} tokens {g['tokens']} != {w['tokens']}"
        assert g["finish_reason"] == w["finish_reason"], f"{what}: beam {i} {g} != {w}"
        for k in ("cumulative_logprob", "score"):
            assert abs(g[k] - w[k]) < TOL, f"{what}: beam {i} {k} {g[k]} != {w[k]}"


def main():
    if not BUILD or len(sys.argv) != 2:
        print("SKIP: PD_BUILD_ROOT not set or no beam_run given")
        return 77
    beam_run = sys.argv[1]
    tmp = tempfile.mkdtemp(prefix="pd_beam_")
    shapes = {
        "tiny": mkmodel(os.path.join(tmp, "tiny"), "--preset", "tiny"),
        "qwen2": mkmodel(os.path.join(tmp, "qwen2"), "--preset", "tiny", "--arch", "qwen2",
                         "--tie-embeddings"),
        "small": mkmodel(os.path.join(tmp, "small"), "--preset", "small"),
    }
    prompts = {"tiny": [5, 300, 17, 1200, 44, 9, 650], "qwen2": [77],
               "small": [(i * 37 + 11) % 4000 + 3 for i in range(37)]}

    def case(shape, width, n, max_tokens, lps, earlies, eos_pick, extra=()):
        """eos_pick "inside": a token of the best beam of a search that ignores EOS (it ends
        some beams); "outside": a token of no candidate of that search's beams."""
        base, prompt = shapes[shape], prompts[shape]
        free = reference(base, -1, *args_of(prompt, width, width, max_tokens, 1.0, "false", ()))
        seen = {t for b in free for t in b["tokens"]}
        if eos_pick == "inside":
            eos = free[0]["tokens"][1]
        else:
            eos = next(t for t in range(100, 2000) if t not in seen)
        model = with_eos(base, os.path.join(tmp, f"{shape}-eos{eos}"), eos)
        stops = 0
        for lp in lps:
            for early in earlies:
                a = args_of(prompt, width, n, max_tokens, lp, early, extra)
                want = reference(model, eos, *a)
                got = engine(beam_run, model, *a)
                same_beams(got["beams"], want, f"{shape} lp {lp} early {early} eos {eos}")
                assert got["statuses"] == [0] * n, got["statuses"]
                assert got["kv_blocks_free_end"] == got["kv_blocks_free_start"], got
                split = engine(beam_run, model, *a, "--split")
                assert split["beams"] == got["beams"], \
                    f"split != colocated: {split['beams']} != {got['beams']}"
                assert split["kv_blocks_free_end"] == split["kv_blocks_free_start"], split
                stops += sum(b["finish_reason"] == "stop" for b in want)
        if eos_pick == "inside" and "--ignore-eos" not in extra:
            assert stops > 0, "no beam ended with the EOS"
        if eos_pick == "outside":
            assert stops == 0, "a beam ended with the EOS outside the width"

    lps, earlies = (0.5, 1.0, 2.0), ("false", "true", "never")
    check("tiny_eos_inside", lambda: case("tiny", 4, 3, 8, lps, earlies, "inside"))
    check("tiny_eos_outside", lambda: case("tiny", 3, 2, 6, (1.0,), earlies, "outside"))
    check("qwen2_eos_inside", lambda: case("qwen2", 2, 2, 10, lps, earlies, "inside"))
    check("small_eos_inside", lambda: case("small", 4, 2, 6, (0.5, 2.0), earlies, "inside"))
    check("tiny_ignore_eos", lambda: case("tiny", 3, 1, 7, (1.0,), ("never",), "inside",
                                          ("--ignore-eos",)))

    def stop_token_ids():
        base, prompt = shapes["tiny"], prompts["tiny"]
        free = reference(base, -1, *args_of(prompt, 4, 4, 8, 1.0, "false", ()))
        stop = free[1]["tokens"][2]
        model = with_eos(base, os.path.join(tmp, "tiny-eos1"), 1)
        a = args_of(prompt, 4, 4, 8, 1.0, "false", ("--stop-token-ids", str(stop)))
        want = reference(model, 1, *a)
        assert any(b["finish_reason"] == "stop" for b in want), want
        same_beams(engine(beam_run, model, *a)["beams"], want, "stop_token_ids")

    def prompt_blocks_once():
        """37 prompt tokens (blocks of 16: two full ones shared by every beam), width 8: the
        blocks in use never exceed the full prompt blocks once plus each beam's own tail."""
        model = with_eos(shapes["tiny"], os.path.join(tmp, "tiny-eos1"), 1)
        prompt = prompts["small"]
        got = engine(beam_run, model, *args_of(prompt, 8, 1, 12, 1.0, "false", ("--ignore-eos",)))
        bs = got["block_size"]
        full, tail = len(prompt) // bs, len(prompt) % bs
        bound = full + 8 * -(-(tail + 12) // bs)
        assert got["kv_blocks_peak_used"] <= bound, (got, bound)
        assert got["kv_blocks_peak_used"] < 8 * -(-len(prompt) // bs), got
        assert got["kv_blocks_free_end"] == got["kv_blocks_free_start"], got

    def abort_frees_every_block():
        model = with_eos(shapes["tiny"], os.path.join(tmp, "tiny-eos1"), 1)
        for steps in (0, 1, 3, 6):
            for split in ((), ("--split",)):
                got = engine(beam_run, model, *args_of(prompts["small"], 4, 2, 40, 1.0, "never",
                                                       ("--ignore-eos", "--abort-after-steps",
                                                        str(steps), *split)))
                assert got["statuses"] == [PD_ECANCELLED] * 2, (split, got)
                assert got["kv_blocks_free_end"] == got["kv_blocks_free_start"], (split, got)

    def early_stopping_decides():
        """Every fifth id a stop id: beams finish every round, so the finished set fills long
        before max_tokens and with length_penalty 2 (longer beams score higher) the three
        early_stopping rules answer differently; the engine follows each."""
        base, prompt = shapes["tiny"], prompts["tiny"]
        model = with_eos(base, os.path.join(tmp, "tiny-eos1"), 1)
        stops = ",".join(str(t) for t in range(0, 2048, 5))
        for width in (3, 4):
            answers = set()
            for lp in (0.5, 2.0):
                for early in earlies:
                    a = args_of(prompt, width, width, 10, lp, early, ("--stop-token-ids", stops))
                    want = reference(model, 1, *a)
                    same_beams(engine(beam_run, model, *a)["beams"], want,
                               f"width {width} lp {lp} early {early}")
                    if lp == 2.0:
                        answers.add(json.dumps([b["tokens"] for b in want]))
            assert len(answers) >= 2, f"width {width}: early_stopping changed nothing"

    def preempted_beams():
        """Two searches at once in a pool of 16 blocks, less than their 18 at the peak: beams
        are preempted and recompute, and both answer as the reference does; so do 8 searches,
        and 4 imported ones, in that pool; a search whose blocks cannot all fit in the pool is
        refused at add."""
        model = with_eos(shapes["tiny"], os.path.join(tmp, "tiny-eos1"), 1)
        a = args_of(prompts["small"], 4, 2, 40, 1.0, "false", ("--ignore-eos",))
        want = reference(model, 1, *a)
        got = engine(beam_run, model, *a, "--copies", "2", "--num-kv-blocks", "16")
        same_beams(got["beams"], want, "preempted")
        assert got["preemptions"] > 0, got
        assert got["kv_blocks_free_end"] == got["kv_blocks_free_start"], got
        # liveness: 8 searches at once (4 imported, split) in that pool all answer alike
        for more in (("--copies", "8"), ("--copies", "4", "--split")):
            got = engine(beam_run, model, *a, *more, "--num-kv-blocks", "16")
            same_beams(got["beams"], want, f"preempted {more}")
            assert got["preemptions"] > 0, got
            assert got["kv_blocks_free_end"] == got["kv_blocks_free_start"], got
        out = subprocess.run([beam_run, "--model", model, "--num-kv-blocks", "20",
                              *args_of(prompts["small"], 8, 1, 40, 1.0, "false", ())],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and "best_of: a beam search of 8 beams may hold 26 KV " \
            "blocks, the pool has 20" in out.stderr, out.stderr

    def logprobs():
        """logprobs 0 and 3 (more than 2W = 4 top tokens): each token's logprob and its step's
        top ones as the reference's, split and colocated alike."""
        model = with_eos(shapes["tiny"], os.path.join(tmp, "tiny-eos1"), 1)
        for k in (0, 5):
            a = args_of(prompts["small"], 2, 2, 6, 1.0, "false", ("--logprobs", str(k)))
            want = reference(model, 1, *a)
            got = engine(beam_run, model, *a)
            same_beams(got["beams"], want, f"logprobs {k}")
            for g, w in zip(got["beams"], want):
                assert len(g["logprobs"]) == len(w["logprobs"]) == len(g["tokens"]), (g, w)
                for (gl, gt), (wl, wt) in zip(g["logprobs"], w["logprobs"]):
                    assert abs(gl - wl) < TOL, (gl, wl)
                    assert [i for i, _ in gt] == [i for i, _ in wt], (gt, wt)
                    assert all(abs(x - y) < TOL for (_, x), (_, y) in zip(gt, wt)), (gt, wt)
                assert abs(sum(lp for lp, _ in g["logprobs"]) - g["cumulative_logprob"]) < TOL
            split = engine(beam_run, model, *a, "--split")
            assert split["beams"] == got["beams"], "split != colocated with logprobs"

    check("stop_token_ids", stop_token_ids)
    check("logprobs", logprobs)
    check("preempted_beams", preempted_beams)
    check("early_stopping_decides", early_stopping_decides)
    check("prompt_blocks_once", prompt_blocks_once)
    check("abort_frees_every_block", abort_frees_every_block)
    shutil.rmtree(tmp)
    print(f"harness: {harness.passed} passed, {harness.failed} failed, 0 skipped")
    return 1 if harness.failed else 0


if __name__ == "__main__":
    sys.exit(main())
