#!/usr/bin/env python3
"""Calibrates the fp8 KV cache scales of a checkpoint, as llm-compressor and AutoFP8 store them.

  kv_calibrate.py MODEL_DIR [--prompts N] [--tokens T] [--seed S]

Runs llama_ref.py's float64 forward pass (independent of pdserve) over N prompts of T random
token ids, takes each layer's largest |K| (after RoPE: what the cache holds) and |V|, and writes
model.layers.{l}.self_attn.k_scale and .v_scale = amax / 448 (float8 e4m3's largest value), F32
scalars, into MODEL_DIR: a new shard kv_scales.safetensors named by model.safetensors.index.json
(the index is made when the checkpoint is one file). Prints one line per layer.
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_ref  # noqa: E402

E4M3_MAX = 448.0


def write_safetensors(path, tensors):
    """tensors: {name: float32 scalar}; shape [] each."""
    header, blob = {}, b""
    for name, v in tensors.items():
        data = struct.pack("<f", v)
        header[name] = {"dtype": "F32", "shape": [], "data_offsets": [len(blob), len(blob) + 4]}
        blob += data
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + blob)


def tensor_names(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return [k for k in json.loads(f.read(n)) if k != "__metadata__"]


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    m = llama_ref.Model(a.model)
    c = m.cfg
    rng = np.random.default_rng(a.seed)
    kmax = np.zeros(c.layers)
    vmax = np.zeros(c.layers)
    for _ in range(a.prompts):
        m.reset()
        m.forward(rng.integers(0, c.vocab, a.tokens).tolist(), 0)
        for l in range(c.layers):
            kmax[l] = max(kmax[l], np.abs(m.k_cache[l]).max())
            vmax[l] = max(vmax[l], np.abs(m.v_cache[l]).max())
    scales = {}
    for l in range(c.layers):
        scales[f"model.layers.{l}.self_attn.k_scale"] = float(np.float32(kmax[l] / E4M3_MAX))
        scales[f"model.layers.{l}.self_attn.v_scale"] = float(np.float32(vmax[l] / E4M3_MAX))
        print(f"layer {l}: max|K| {kmax[l]:.4g} max|V| {vmax[l]:.4g}")
    write_safetensors(os.path.join(a.model, "kv_scales.safetensors"), scales)
    index = os.path.join(a.model, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            idx = json.load(f)
    else:
        single = os.path.join(a.model, "model.safetensors")
        idx = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in tensor_names(single)}}
    idx["weight_map"].update({n: "kv_scales.safetensors" for n in scales})
    with open(index, "w") as f:
        json.dump(idx, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
