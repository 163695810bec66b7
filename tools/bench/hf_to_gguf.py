#!/usr/bin/env python3
"""Writes a Llama-shaped model in Hugging Face layout (a pd-mkmodel directory: config.json,
model.safetensors or shards with model.safetensors.index.json, tokenizer.json,
tokenizer_config.json) as one GGUF v3 file that llama.cpp loads, so llama-server can serve the
same weights as pdserve (tools/bench/bench_llama_server.sh). numpy only (the Debian
/usr/bin/python3 has it); no llama.cpp code.

  /usr/bin/python3 tools/bench/hf_to_gguf.py MODEL_DIR OUT.gguf [--outtype f32|bf16]

What llama.cpp expects, as its convert_hf_to_gguf.py writes it for LlamaForCausalLM:
  - the llama.* hyperparameter keys, tensor names token_embd / blk.N.attn_q ... / output;
  - q_proj and k_proj rows permuted from Hugging Face's rotate-half RoPE layout to llama.cpp's
    interleaved pairs: per head, row (2 * t + j) of the GGUF tensor is row (j * head_dim / 2 + t)
    of the checkpoint (k with the kv head count);
  - 1-D tensors (norms, biases) always f32; --outtype bf16 rounds the 2-D weights to nearest even;
  - the tokenizer as "gpt2" (byte-level BPE): tokens in id order (ids missing from tokenizer.json
    up to vocab_size become [PADi], type UNUSED), types NORMAL / CONTROL (special added tokens) /
    USER_DEFINED, merges "a b", the pre-tokenizer name llama.cpp knows ("gpt-2" for the GPT-2
    regex, "llama-bpe" for Llama 3's), bos / eos / pad ids, add_bos / add_eos and the chat
    template.
Anything else (SentencePiece vocabularies, llama3 / dynamic RoPE scaling, other architectures)
is refused with the field that is not supported.

Layout (GGUF v3, little-endian): magic, version, tensor count, KV count; KVs (key string, value
type, value); tensor infos (name, dims innermost first, ggml type, offset into the data); the data
section starting at a 32-byte aligned offset, each tensor 32-byte aligned in it.
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

ALIGN = 32
# GGUF value types (gguf-py GGUFValueType)
T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY = 4, 5, 6, 7, 8, 9
# ggml tensor types and llama file types
GGML_F32, GGML_F16, GGML_BF16 = 0, 1, 30
FILE_TYPE = {"f32": 0, "bf16": 32}
# llama.cpp token types
TOK_NORMAL, TOK_CONTROL, TOK_USER_DEFINED, TOK_UNUSED = 1, 3, 4, 5

# The pre-tokenizer regexes llama.cpp knows by name (llama-vocab.cpp), as tokenizer.json writes
# them in a Split pre-tokenizer.
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
ARCHS = ("LlamaForCausalLM", "MistralForCausalLM")


class Bad(Exception):
    pass


def fail(what):
    raise Bad(what)


# ---- reading the checkpoint ----------------------------------------------------------------

def load_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        fail(f"{path}: cannot read ({e.strerror})")
    except json.JSONDecodeError as e:
        fail(f"{path}: not JSON ({e})")


ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def safetensors_index(model_dir):
    """name -> (file, dtype name, shape, byte offset, byte length) over all shards."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted(set(load_json(index).get("weight_map", {}).values()))
        if not files:
            fail(f"{index}: weight_map is empty")
    else:
        files = ["model.safetensors"]
    out = {}
    for name in files:
        path = os.path.join(model_dir, name)
        try:
            with open(path, "rb") as f:
                (hlen,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(hlen))
        except (OSError, struct.error, ValueError) as e:
            fail(f"{path}: not a safetensors file ({e})")
        for tname, info in header.items():
            if tname == "__metadata__":
                continue
            if info.get("dtype") not in ST_DTYPES:
                fail(f"{path}: tensor {tname}: dtype {info.get('dtype')} (F32, F16, BF16 only)")
            begin, end = info["data_offsets"]
            out[tname] = (path, info["dtype"], tuple(info["shape"]), 8 + hlen + begin, end - begin)
    return out


def read_f32(entry):
    """A checkpoint tensor as float32 (bf16 widened exactly)."""
    path, dtype, shape, offset, nbytes = entry
    raw = np.fromfile(path, dtype=ST_DTYPES[dtype], count=nbytes // np.dtype(ST_DTYPES[dtype]).itemsize,
                      offset=offset)
    if dtype == "BF16":
        raw = (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32, copy=False).reshape(shape)


def to_bf16(a):
    """float32 -> bf16 bits, round to nearest even (NaN kept NaN)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(a), np.uint16(0x7FC0), r)


def permute_rope(w, n_head):
    """Hugging Face rotate-half rows -> llama.cpp interleaved rows, per head (as LlamaModel.permute
    of convert_hf_to_gguf.py): (n_head, 2, hd/2, ...) -> (n_head, hd/2, 2, ...)."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        fail(f"q/k rows {rows} not divisible by 2 x {n_head} heads")
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---- hyperparameters and tensors -----------------------------------------------------------

def need(cfg, key, kind=int):
    v = cfg.get(key)
    if not isinstance(v, kind) or isinstance(v, bool):
        fail(f"config.json: {key}: expected {kind.__name__}, got {v!r}")
    return v


def hparams(cfg):
    arch = cfg.get("architectures") or [None]
    if arch[0] not in ARCHS:
        fail(f"config.json: architectures: {arch[0]!r} (supported: {', '.join(ARCHS)})")
    h = {k: need(cfg, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "vocab_size")}
    h["num_key_value_heads"] = cfg.get("num_key_value_heads") or h["num_attention_heads"]
    h["head_dim"] = cfg.get("head_dim") or h["hidden_size"] // h["num_attention_heads"]
    h["max_position_embeddings"] = cfg.get("max_position_embeddings", 2048)
    h["rms_norm_eps"] = float(cfg.get("rms_norm_eps", 1e-6))
    h["rope_theta"] = float(cfg.get("rope_theta", 10000.0))
    h["tie"] = bool(cfg.get("tie_word_embeddings", False))
    rs = cfg.get("rope_scaling")
    if rs:
        kind = rs.get("rope_type", rs.get("type"))
        if kind != "linear":
            fail(f"config.json: rope_scaling: type {kind!r} (none or linear only)")
        h["rope_linear"] = float(rs["factor"])
    return h


def tensor_plan(h, st):
    """[(gguf name, checkpoint name, heads to permute by or 0)] in llama.cpp's order."""
    plan = [("token_embd.weight", "model.embed_tokens.weight", 0)]
    per_layer = [("attn_norm.weight", "input_layernorm.weight", 0),
                 ("attn_q.weight", "self_attn.q_proj.weight", h["num_attention_heads"]),
                 ("attn_k.weight", "self_attn.k_proj.weight", h["num_key_value_heads"]),
                 ("attn_v.weight", "self_attn.v_proj.weight", 0),
                 ("attn_output.weight", "self_attn.o_proj.weight", 0),
                 ("attn_q.bias", "self_attn.q_proj.bias", h["num_attention_heads"]),
                 ("attn_k.bias", "self_attn.k_proj.bias", h["num_key_value_heads"]),
                 ("attn_v.bias", "self_attn.v_proj.bias", 0),
                 ("attn_output.bias", "self_attn.o_proj.bias", 0),
                 ("ffn_norm.weight", "post_attention_layernorm.weight", 0),
                 ("ffn_gate.weight", "mlp.gate_proj.weight", 0),
                 ("ffn_up.weight", "mlp.up_proj.weight", 0),
                 ("ffn_down.weight", "mlp.down_proj.weight", 0)]
    for i in range(h["num_hidden_layers"]):
        for g, hf, heads in per_layer:
            name = f"model.layers.{i}.{hf}"
            if name in st:
                plan.append((f"blk.{i}.{g}", name, heads))
            elif not hf.endswith(".bias"):
                fail(f"checkpoint: tensor {name} missing")
    plan.append(("output_norm.weight", "model.norm.weight", 0))
    if "lm_head.weight" in st and not h["tie"]:
        plan.append(("output.weight", "lm_head.weight", 0))
    elif not h["tie"]:
        fail("checkpoint: tensor lm_head.weight missing (and tie_word_embeddings is false)")
    for _, name, _ in plan:
        if name not in st:
            fail(f"checkpoint: tensor {name} missing")
    used = {name for _, name, _ in plan} | {"lm_head.weight"}
    extra = sorted(set(st) - used)
    if extra:
        fail(f"checkpoint: tensor {extra[0]} not part of a Llama model ({len(extra)} such)")
    return plan


# ---- tokenizer -----------------------------------------------------------------------------

def pre_tokenizer_name(tok):
    pre = tok.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    if pre.get("type") == "Sequence":
        steps = pre.get("pretokenizers", [])
        splits = [s for s in steps if s.get("type") == "Split"]
        if (len(splits) == 1 and splits[0].get("pattern", {}).get("Regex") == LLAMA3_REGEX and
                any(s.get("type") == "ByteLevel" and not s.get("use_regex", True) for s in steps)):
            return "llama-bpe"
    fail(f"tokenizer.json: pre_tokenizer {json.dumps(pre)[:120]}: not the GPT-2 or Llama 3 "
         "byte-level pre-tokenizer")


def tokenizer_kvs(model_dir, h, cfg):
    tok = load_json(os.path.join(model_dir, "tokenizer.json"))
    tcfg_path = os.path.join(model_dir, "tokenizer_config.json")
    tcfg = load_json(tcfg_path) if os.path.exists(tcfg_path) else {}
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        fail(f"tokenizer.json: model: type {model.get('type')!r}"
             f"{' with byte_fallback' if model.get('byte_fallback') else ''} "
             "(byte-level BPE only)")
    pre = pre_tokenizer_name(tok)
    n = h["vocab_size"]
    tokens, types = [None] * n, [TOK_UNUSED] * n
    for text, i in model.get("vocab", {}).items():
        if not 0 <= i < n:
            fail(f"tokenizer.json: model.vocab: id {i} of {text!r} not below vocab_size {n}")
        tokens[i], types[i] = text, TOK_NORMAL
    for a in tok.get("added_tokens", []):
        i = a["id"]
        if not 0 <= i < n:
            fail(f"tokenizer.json: added_tokens: id {i} not below vocab_size {n}")
        looks = a["content"].startswith("<|") and a["content"].endswith("|>")
        tokens[i] = a["content"]
        types[i] = TOK_CONTROL if a.get("special") or looks else TOK_USER_DEFINED
    for i in range(n):
        if tokens[i] is None:
            tokens[i] = f"[PAD{i}]"
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    def special_id(name):
        v = cfg.get(f"{name}_token_id")
        if isinstance(v, list):
            v = v[0] if v else None
        if v is None:
            t = tcfg.get(f"{name}_token")
            t = t.get("content") if isinstance(t, dict) else t
            v = next((a["id"] for a in tok.get("added_tokens", []) if a["content"] == t), None)
        return v

    kvs = [("tokenizer.ggml.model", T_STRING, "gpt2"), ("tokenizer.ggml.pre", T_STRING, pre),
           ("tokenizer.ggml.tokens", T_ARRAY, (T_STRING, tokens)),
           ("tokenizer.ggml.token_type", T_ARRAY, (T_INT32, types)),
           ("tokenizer.ggml.merges", T_ARRAY, (T_STRING, merges))]
    for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        v = special_id(name)
        if v is not None:
            kvs.append((f"tokenizer.ggml.{key}_token_id", T_UINT32, int(v)))
    for key in ("add_bos_token", "add_eos_token"):
        if isinstance(tcfg.get(key), bool):
            kvs.append((f"tokenizer.ggml.{key}", T_BOOL, tcfg[key]))
    if isinstance(tcfg.get("chat_template"), str):
        kvs.append(("tokenizer.chat_template", T_STRING, tcfg["chat_template"]))
    return kvs


# ---- writing -------------------------------------------------------------------------------

def pack_string(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


SCALAR = {T_UINT32: "<I", T_INT32: "<i", T_FLOAT32: "<f", T_BOOL: "<?"}


def pack_value(vtype, v):
    if vtype == T_STRING:
        return pack_string(v)
    if vtype == T_ARRAY:
        etype, items = v
        head = struct.pack("<IQ", etype, len(items))
        if etype == T_STRING:
            return head + b"".join(pack_string(s) for s in items)
        return head + struct.pack(f"<{len(items)}{SCALAR[etype][1]}", *items)
    return struct.pack(SCALAR[vtype], v)


def pad(n):
    return (ALIGN - n % ALIGN) % ALIGN


def convert(model_dir, out, outtype):
    cfg = load_json(os.path.join(model_dir, "config.json"))
    h = hparams(cfg)
    st = safetensors_index(model_dir)
    plan = tensor_plan(h, st)
    kvs = [("general.architecture", T_STRING, "llama"),
           ("general.name", T_STRING, os.path.basename(os.path.normpath(model_dir))),
           ("llama.block_count", T_UINT32, h["num_hidden_layers"]),
           ("llama.context_length", T_UINT32, h["max_position_embeddings"]),
           ("llama.embedding_length", T_UINT32, h["hidden_size"]),
           ("llama.feed_forward_length", T_UINT32, h["intermediate_size"]),
           ("llama.attention.head_count", T_UINT32, h["num_attention_heads"]),
           ("llama.attention.head_count_kv", T_UINT32, h["num_key_value_heads"]),
           ("llama.rope.freq_base", T_FLOAT32, h["rope_theta"]),
           ("llama.attention.layer_norm_rms_epsilon", T_FLOAT32, h["rms_norm_eps"]),
           ("llama.attention.key_length", T_UINT32, h["head_dim"]),
           ("llama.attention.value_length", T_UINT32, h["head_dim"]),
           ("general.file_type", T_UINT32, FILE_TYPE[outtype]),
           ("llama.vocab_size", T_UINT32, h["vocab_size"]),
           ("llama.rope.dimension_count", T_UINT32, h["head_dim"])]
    if "rope_linear" in h:
        kvs += [("llama.rope.scaling.type", T_STRING, "linear"),
                ("llama.rope.scaling.factor", T_FLOAT32, h["rope_linear"])]
    kvs += [("general.quantization_version", T_UINT32, 2)]
    kvs += tokenizer_kvs(model_dir, h, cfg)

    # tensor infos first: every size is known from the checkpoint's shapes
    infos, offset = [], 0
    for gname, hname, heads in plan:
        shape = st[hname][2]
        gtype = GGML_BF16 if outtype == "bf16" and len(shape) == 2 else GGML_F32
        nbytes = int(np.prod(shape)) * (2 if gtype == GGML_BF16 else 4)
        infos.append((gname, hname, heads, shape, gtype, offset, nbytes))
        offset += nbytes + pad(nbytes)

    head = b"GGUF" + struct.pack("<IQQ", 3, len(infos), len(kvs))
    head += b"".join(pack_string(k) + struct.pack("<I", t) + pack_value(t, v) for k, t, v in kvs)
    for gname, _, _, shape, gtype, off, _ in infos:
        head += pack_string(gname) + struct.pack("<I", len(shape))
        head += struct.pack(f"<{len(shape)}Q", *reversed(shape)) + struct.pack("<IQ", gtype, off)
    head += b"\0" * pad(len(head))
    tmp = out + ".tmp"
    with open(tmp, "wb") as f:
        f.write(head)
        for gname, hname, heads, shape, gtype, _, nbytes in infos:
            w = read_f32(st[hname])
            if heads:
                w = permute_rope(w, heads)
            data = (to_bf16(w) if gtype == GGML_BF16 else np.ascontiguousarray(w)).tobytes()
            assert len(data) == nbytes
            f.write(data + b"\0" * pad(nbytes))
    os.replace(tmp, out)
    return len(infos), os.path.getsize(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("--outtype", choices=sorted(FILE_TYPE), default="f32")
    a = ap.parse_args()
    try:
        n, size = convert(a.model_dir, a.out, a.outtype)
    except Bad as e:
        print(f"hf_to_gguf: {a.model_dir}: {e}", file=sys.stderr)
        return 1
    print(f"hf_to_gguf: {a.model_dir} -> {a.out}: {n} tensors, {a.outtype}, {size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
