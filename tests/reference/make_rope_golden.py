#!/usr/bin/python3
"""Writes tests/data/model/rope_golden.json: RoPE inverse frequencies computed by llama_ref.py
(transformers' ROPE_INIT_FUNCTIONS re-implemented in numpy) for configs covering every
rope_scaling type. The C test (tests/unit/model/test_model_config.c) parses each config with
pd_model_config_from_json and compares pd_rope_inv_freq to these values.

    /usr/bin/python3 tests/reference/make_rope_golden.py > tests/data/model/rope_golden.json
"""
import json
import os
import sys

sys.dont_write_bytecode = True  # nothing written into the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_ref  # noqa: E402

BASE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 100}
CASES = [
    ({"head_dim": 64}, [1]),
    ({"rope_theta": 500000.0, "head_dim": 128,
      "rope_scaling": {"type": "linear", "factor": 2.0}}, [1]),
    ({"max_position_embeddings": 2048, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     [1, 2048, 2049, 4096, 10000]),
    ({"rope_theta": 500000.0, "head_dim": 128, "max_position_embeddings": 131072,
      "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}, [1]),
    ({"head_dim": 32, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192}}, [1]),
]
out = []
for extra, seq_lens in CASES:
    cfg = dict(BASE, **extra)
    c = llama_ref.Config(cfg)
    for s in seq_lens:
        f, scale = llama_ref.inv_freq(c, s)
        out.append({"config": cfg, "seq_len": s, "attention_scaling": scale,
                    "inv_freq": [float(x) for x in f]})
json.dump(out, sys.stdout, indent=1)
print()
