#!/usr/bin/python3
"""Makes a model whose raw logits are exactly -inf for every token but a few (§18 item 29:
"-inf is written as -9999.0"), from a float32 Llama-layout model made by pd-mkmodel.

No request can make a raw logit -inf on an ordinary model: logprobs come from the raw logits
(§9.4), so logit_bias and allowed_token_ids do not change them. Here the model itself does it,
with exact arithmetic rather than large numbers:
  - hidden dimension 0 of the residual stream is held at exactly 1.0: column 0 of
    embed_tokens is 1.0, and row 0 of every o_proj and down_proj (and their biases) is 0, so
    no layer writes to it; model.norm.weight[0] = 1.0, so the final hidden state has
    h[0] = 1 / rms(x) > 0 at every position;
  - lm_head row t is (-inf, 0, ..., 0) for every token t outside FINITE, so its logit is
    -inf * h[0] + 0 = -inf; the FINITE rows keep their weights and get finite logits.
So only FINITE tokens can be sampled, their probabilities sum to 1, and a top_logprobs list
longer than len(FINITE) must carry -inf entries (written -9999.0).

Usage: neginf_model.py SRC_DIR OUT_DIR
Writes OUT_DIR/model.safetensors, copies the other files (config with tie_word_embeddings
false), and writes OUT_DIR/finite_ids.json: the FINITE ids, chosen from tokenizer.json as the
first 6 vocabulary entries of 3 or more ASCII letters (distinct texts, so a completions
top_logprobs object keeps one key per id).
"""
import json
import os
import shutil
import struct
import sys

import numpy as np

N_FINITE = 6


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] != "F32":
            sys.exit("%s: %s is %s; only float32 models are supported" % (path, name, info["dtype"]))
        lo, hi = info["data_offsets"]
        tensors[name] = np.frombuffer(data[lo:hi], dtype="<f4").reshape(info["shape"]).copy()
    return header.get("__metadata__"), tensors


def write_safetensors(path, metadata, tensors):
    header, blobs, off = {}, [], 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name in sorted(tensors):
        b = tensors[name].astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape),
                        "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: neginf_model.py SRC_DIR OUT_DIR")
    src, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    meta, t = read_safetensors(os.path.join(src, "model.safetensors"))
    emb = t["model.embed_tokens.weight"]  # (vocab, hidden)
    head = t.get("lm_head.weight", emb).copy()  # (vocab, hidden); untied below
    emb[:, 0] = 1.0
    for name, w in t.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            w[0, :] = 0.0  # (hidden, in): output row 0
        elif name.endswith(("self_attn.o_proj.bias", "mlp.down_proj.bias")):
            w[0] = 0.0
    t["model.norm.weight"][0] = 1.0

    with open(os.path.join(src, "tokenizer.json"), encoding="utf-8") as f:
        vocab = json.load(f)["model"]["vocab"]
    finite = sorted(i for tok, i in vocab.items() if len(tok) >= 3 and tok.isascii() and tok.isalpha())
    finite = finite[:N_FINITE]
    if len(finite) < N_FINITE:
        sys.exit("tokenizer.json: fewer than %d alphabetic tokens" % N_FINITE)
    keep = np.zeros(head.shape[0], dtype=bool)
    keep[finite] = True
    head[~keep, :] = 0.0
    head[~keep, 0] = -np.inf
    t["lm_head.weight"] = head
    write_safetensors(os.path.join(out, "model.safetensors"), meta, t)

    for name in os.listdir(src):
        if name in ("model.safetensors", "config.json") or name.startswith("."):
            continue
        shutil.copy(os.path.join(src, name), os.path.join(out, name))
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["tie_word_embeddings"] = False
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out, "finite_ids.json"), "w", encoding="utf-8") as f:
        json.dump(finite, f)


if __name__ == "__main__":
    main()
