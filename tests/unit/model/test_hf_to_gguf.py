#!/usr/bin/python3
"""Checks tools/bench/hf_to_gguf.py on tiny pd-mkmodel models, reading its GGUF back with a reader
written here from the format's description (not the writer's code): header and 32-byte
alignment, the llama.* keys against config.json, the tokenizer keys against tokenizer.json, every
tensor's bytes against the checkpoint (q/k rows moved as llama.cpp's interleaved RoPE wants them:
per head, GGUF row 2t + j is checkpoint row j * head_dim / 2 + t), bf16 as float32 rounded to
nearest even (ties to even on crafted halfway values), tied embeddings without output.weight, biases; bad inputs refused naming the field.
That llama.cpp decodes these files as pdserve does is tools/bench/check_llama_gguf.sh's job (it
needs a llama.cpp build). Prints harness-style lines.
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy as np

SRC = os.environ.get("PD_SOURCE_ROOT", os.path.join(os.path.dirname(__file__), "..", "..", ".."))
BUILD = os.environ.get("PD_BUILD_ROOT")
TOOL = os.path.join(SRC, "tools", "bench", "hf_to_gguf.py")
sys.dont_write_bytecode = True  # nothing written into the source tree
sys.path.insert(0, os.path.dirname(TOOL))
import hf_to_gguf  # noqa: E402


def read_gguf(path):
    """(kvs, {name: (dims innermost first, ggml type, bytes)}) of a GGUF v3 file."""
    buf = open(path, "rb").read()
    pos = 0

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return v if len(v) > 1 else v[0]

    def string():
        nonlocal pos
        n = take("Q")
        pos += n
        return buf[pos - n:pos].decode("utf-8")

    scalars = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
               12: "d"}

    def value(t):
        if t == 8:
            return string()
        if t == 9:
            et, n = take("I"), take("Q")
            return [value(et) for _ in range(n)]
        return take(scalars[t])

    assert buf[:4] == b"GGUF", buf[:4]
    pos = 4
    version, n_tensors, n_kv = take("I"), take("Q"), take("Q")
    assert version == 3, version
    kvs = {}
    for _ in range(n_kv):
        k = string()
        kvs[k] = value(take("I"))
    infos = []
    for _ in range(n_tensors):
        name, nd = string(), take("I")
        dims = [take("Q") for _ in range(nd)]
        infos.append((name, dims, take("I"), take("Q")))
    start = (pos + 31) // 32 * 32
    assert all(b == 0 for b in buf[pos:start]), "padding before the data is not zero"
    tensors = {}
    for i, (name, dims, t, off) in enumerate(infos):
        assert off % 32 == 0, f"{name}: offset {off} not 32-byte aligned"
        size = int(np.prod(dims)) * {0: 4, 30: 2}[t]
        end = infos[i + 1][3] if i + 1 < len(infos) else len(buf) - start
        assert off + size <= end, f"{name}: data overlaps the next tensor"
        tensors[name] = (dims, t, buf[start + off:start + off + size])
    return kvs, tensors


def read_safetensors(path):
    raw = open(path, "rb").read()
    n = struct.unpack_from("<Q", raw)[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, info in header.items():
        if name != "__metadata__":
            b, e = info["data_offsets"]
            out[name] = np.frombuffer(raw[8 + n + b:8 + n + e], np.float32).reshape(info["shape"])
    return out


def convert(model, out, *extra):
    return subprocess.run(["/usr/bin/python3", TOOL, model, out, *extra], capture_output=True,
                          text=True)


def mkmodel(out, *args):
    exe = os.path.join(BUILD, "tools", "mkmodel", "pd-mkmodel")
    subprocess.run([exe, "--preset", "tiny", "--out", out, *args], check=True,
                   stdout=subprocess.DEVNULL)
    return out


def as_f32(dims, t, data):
    shape = list(reversed(dims))
    if t == 0:
        return np.frombuffer(data, np.float32).reshape(shape)
    return (np.frombuffer(data, np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)


def hf_rows(w, heads):
    """The checkpoint's row order back from GGUF's, by the loop the docstring states."""
    hd = w.shape[0] // heads
    out = np.empty_like(w)
    for h in range(heads):
        for t in range(hd // 2):
            for j in range(2):
                out[h * hd + j * hd // 2 + t] = w[h * hd + 2 * t + j]
    return out


def check_model(model, gguf, outtype):
    cfg = json.load(open(os.path.join(model, "config.json")))
    tok = json.load(open(os.path.join(model, "tokenizer.json")))
    r = convert(model, gguf, "--outtype", outtype)
    assert r.returncode == 0, r.stderr
    kvs, tensors = read_gguf(gguf)
    assert kvs["general.architecture"] == "llama"
    for key, hf in [("block_count", "num_hidden_layers"), ("embedding_length", "hidden_size"),
                    ("feed_forward_length", "intermediate_size"),
                    ("attention.head_count", "num_attention_heads"),
                    ("attention.head_count_kv", "num_key_value_heads"),
                    ("context_length", "max_position_embeddings"),
                    ("rope.dimension_count", "head_dim"), ("vocab_size", "vocab_size")]:
        assert kvs["llama." + key] == cfg[hf], (key, kvs["llama." + key], cfg[hf])
    assert np.float32(kvs["llama.attention.layer_norm_rms_epsilon"]) == np.float32(cfg["rms_norm_eps"])
    assert kvs["general.file_type"] == {"f32": 0, "bf16": 32}[outtype]
    # tokenizer: ids in order, specials CONTROL, merges as "a b"
    want = {i: t for t, i in tok["model"]["vocab"].items()}
    want.update({a["id"]: a["content"] for a in tok["added_tokens"]})
    assert kvs["tokenizer.ggml.tokens"] == [want[i] for i in range(cfg["vocab_size"])]
    specials = {a["id"] for a in tok["added_tokens"]}
    assert kvs["tokenizer.ggml.token_type"] == [3 if i in specials else 1
                                                for i in range(cfg["vocab_size"])]
    assert kvs["tokenizer.ggml.merges"] == tok["model"]["merges"]
    assert (kvs["tokenizer.ggml.model"], kvs["tokenizer.ggml.pre"]) == ("gpt2", "gpt-2")
    assert kvs["tokenizer.ggml.bos_token_id"] == cfg["bos_token_id"]
    assert kvs["tokenizer.ggml.eos_token_id"] == cfg["eos_token_id"]
    assert kvs["tokenizer.ggml.add_bos_token"] is False
    assert "<|im_start|>" in kvs["tokenizer.chat_template"]
    # tensors
    st = read_safetensors(os.path.join(model, "model.safetensors"))
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    if not cfg["tie_word_embeddings"]:
        names["output.weight"] = "lm_head.weight"
    per_layer = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
                 "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
                 "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for i in range(cfg["num_hidden_layers"]):
        for g, hf in per_layer.items():
            for kind in ("weight", "bias"):
                if f"model.layers.{i}.{hf}.{kind}" in st:
                    names[f"blk.{i}.{g}.{kind}"] = f"model.layers.{i}.{hf}.{kind}"
    assert sorted(tensors) == sorted(names), sorted(set(tensors) ^ set(names))
    for g, hf in names.items():
        dims, t, data = tensors[g]
        ref = st[hf]
        assert list(reversed(dims)) == list(ref.shape), (g, dims, ref.shape)
        assert t == (30 if outtype == "bf16" and ref.ndim == 2 else 0), (g, t)
        w = as_f32(dims, t, data)
        if ".attn_q." in g or ".attn_k." in g:
            w = hf_rows(w, cfg["num_attention_heads"] if ".attn_q." in g else cfg["num_key_value_heads"])
        if t == 0:
            assert np.array_equal(w, ref), g
        else:  # nearest bf16: within half a bf16 ulp of the float32 value, ties to even
            bits = np.frombuffer(data, np.uint16).reshape(ref.shape)
            if ".attn_q." in g or ".attn_k." in g:
                bits = hf_rows(bits, cfg["num_attention_heads"] if ".attn_q." in g else cfg["num_key_value_heads"])
            u = ref.view(np.uint32)
            low = u & 0xFFFF
            up = (low > 0x8000) | ((low == 0x8000) & ((u >> 16) & 1 == 1))
            assert np.array_equal(bits, ((u >> 16) + up).astype(np.uint16)), g
    return kvs


def bf16_ties_to_even():
    # 1 + 2^-8 and 1 + 3 * 2^-8 sit halfway between bf16 neighbours: even mantissas win
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20, np.nan], np.float32)
    got = hf_to_gguf.to_bf16(x)
    assert list(got[:4]) == [0x3F80, 0x3F82, 0xBF80, 0x3F81], [hex(v) for v in got]
    assert (got[4] & 0x7F80) == 0x7F80 and (got[4] & 0x7F) != 0, hex(got[4])


def refused(model, tmp, edit, field):
    bad = os.path.join(tmp, "bad")
    shutil.rmtree(bad, ignore_errors=True)
    shutil.copytree(model, bad)
    for name, change in edit.items():
        path = os.path.join(bad, name)
        doc = json.load(open(path))
        change(doc)
        json.dump(doc, open(path, "w"))
    r = convert(bad, os.path.join(tmp, "bad.gguf"))
    assert r.returncode == 1 and field in r.stderr, (r.returncode, r.stderr)
    assert not os.path.exists(os.path.join(tmp, "bad.gguf"))


def main():
    if not BUILD:
        print("SKIP: PD_BUILD_ROOT not set")
        return 77
    tmp = tempfile.mkdtemp(prefix="pd_hf_to_gguf_")
    tiny = mkmodel(os.path.join(tmp, "tiny"))
    tied = mkmodel(os.path.join(tmp, "tied"), "--tie-embeddings", "--qkv-bias")
    cases = [
        ("f32_exact", lambda: check_model(tiny, os.path.join(tmp, "a.gguf"), "f32")),
        ("bf16_nearest_tied_with_biases",
         lambda: check_model(tied, os.path.join(tmp, "b.gguf"), "bf16")),
        ("bf16_ties_to_even", bf16_ties_to_even),
        ("refuses_missing_hidden_size",
         lambda: refused(tiny, tmp, {"config.json": lambda c: c.pop("hidden_size")}, "hidden_size")),
        ("refuses_llama3_rope_scaling",
         lambda: refused(tiny, tmp, {"config.json": lambda c: c.update(
             rope_scaling={"rope_type": "llama3", "factor": 8.0})}, "rope_scaling")),
        ("refuses_other_architecture",
         lambda: refused(tiny, tmp, {"config.json": lambda c: c.update(
             architectures=["Qwen2ForCausalLM"])}, "architectures")),
        ("refuses_sentencepiece_vocabulary",
         lambda: refused(tiny, tmp, {"tokenizer.json": lambda t: t["model"].update(
             byte_fallback=True)}, "byte_fallback")),
        ("refuses_unknown_pre_tokenizer",
         lambda: refused(tiny, tmp, {"tokenizer.json": lambda t: t.update(
             pre_tokenizer={"type": "Whitespace"})}, "pre_tokenizer")),
    ]
    passed = failed = 0
    for name, fn in cases:
        try:
            fn()
            print(f"PASS {name}")
            passed += 1
        except Exception as e:  # report and continue with the other cases
            print(f"FAIL {name}: {type(e).__name__}: {e}")
            failed += 1
    shutil.rmtree(tmp)
    print(f"harness: {passed} passed, {failed} failed, 0 skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
