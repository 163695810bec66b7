#!/usr/bin/python3
"""Independent numpy reference for Llama-family decoders (Llama 2/3, Mistral, Qwen2, Qwen3,
TinyLlama).

Written from the Hugging Face transformers definitions (modeling_llama.py, modeling_qwen2.py,
modeling_qwen3.py,
modeling_rope_utils.py), not from pdserve's C code, so that it can judge the C forward pass.
Reads a model directory exactly as published: config.json and model.safetensors or
model.safetensors.index.json with its shards (the safetensors format is parsed here with numpy).

Precision: every weight is widened to float64 and the whole forward pass runs in float64
(bf16 -> f32 by shifting into the high half, f16 via numpy's IEEE half), so the reference is
a high-precision value of the model the checkpoint defines. RoPE inverse frequencies are also
computed in float64 (transformers uses float32; the two agree to ~1e-7 relative).

Semantics that follow transformers exactly:
  * RMSNorm: x / sqrt(mean(x^2) + eps) * weight.
  * RoPE with the rotate_half convention (pair i is dims i and i + head_dim/2), inv_freq from
    ROPE_INIT_FUNCTIONS: default, linear (inv_freq / factor), llama3 (frequency bands), dynamic
    (NTK base that grows with the sequence). For dynamic, as transformers' dynamic_rope_update
    does, each forward call uses seq_len = max(position in the call) + 1 (at least
    max_position_embeddings); keys already in the KV cache keep the rotation they were given.
    A prompt is one call; each generated token is one call.
  * Attention: GQA (query head h reads KV head h // (n_heads / n_kv_heads)), scale
    head_dim ** -0.5, causal mask, softmax; q/k/v biases for Qwen2 or attention_bias, o_proj bias
    for attention_bias except on Qwen2. Qwen3: q and k of each head RMS-normed over head_dim
    (self_attn.q_norm / k_norm, eps rms_norm_eps) after the projection, before RoPE; head_dim
    defaults to 128.
  * MLP: down(silu(gate(x)) * up(x)). LM head: lm_head.weight, or embed_tokens when
    tie_word_embeddings is true.

  * --act-int8 (int8 W8A8 checkpoints, with a model dequantized by quant_ref.py): the input of
    every decoder linear quantized per token as vLLM's dynamic int8 activations (Model.lin).
  * --kv-fp8 (vLLM's --kv-cache-dtype fp8): each K (after RoPE) and V entering the cache is
    rounded to float8 e4m3 (round half to even, saturating at 448) after dividing by the layer's
    self_attn.k_scale / v_scale (1.0 when the checkpoint has none), and multiplied back.

CLI:
  llama_ref.py --model DIR --prompt-ids 1,2,3 [--steps N] [--out FILE.json] [--all-logits]
               [--step-logits] [--act-int8] [--kv-fp8]
prints (or writes) JSON:
  {"prompt_logits_last": [V floats, logits at the last prompt position],
   "greedy_tokens": [N ids, argmax generation appending each id],
   "step_logits_max_abs": [N floats, max |logit| of the logits each greedy id came from],
   "all_logits": [[V floats] per prompt position]   (with --all-logits),
   "step_logits": [[V floats] per greedy step]      (with --step-logits),
   "precision": "float64"}
"""
import argparse
import json
import math
import os
import sys

import numpy as np

# ---------------------------------------------------------------------------------------------
# safetensors


def _read_safetensors(path):
    """Returns {name: np.ndarray float64} for one file, checking the header against the data."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n <= 0 or 8 + n > size:
            raise ValueError(f"{path}: bad header length {n}")
        header = json.loads(f.read(n).decode("utf-8"))
    raw = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        shape = tuple(info["shape"])
        buf = np.asarray(raw[b:e])
        dt = info["dtype"]
        if dt == "F32":
            a = buf.view("<f4").astype(np.float64)
        elif dt == "F16":
            a = buf.view("<f2").astype(np.float64)
        elif dt == "BF16":
            a = (buf.view("<u2").astype(np.uint32) << 16).view("<f4").astype(np.float64)
        elif dt == "F64":
            a = buf.view("<f8").astype(np.float64)
        else:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {dt}")
        out[name] = a.reshape(shape)
    return out


def load_weights(model_dir):
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            wm = json.load(f)["weight_map"]
        tensors = {}
        for shard in sorted(set(wm.values())):
            tensors.update(_read_safetensors(os.path.join(model_dir, shard)))
        return tensors
    return _read_safetensors(os.path.join(model_dir, "model.safetensors"))


# ---------------------------------------------------------------------------------------------
# config


class Config:
    def __init__(self, d):
        arch = (d.get("architectures") or [None])[0]
        mt = d.get("model_type")
        self.qwen2 = arch == "Qwen2ForCausalLM" or (arch is None and mt == "qwen2")
        self.mistral = arch == "MistralForCausalLM" or (arch is None and mt == "mistral")
        self.qwen3 = arch == "Qwen3ForCausalLM" or (arch is None and mt == "qwen3")
        self.hidden = d["hidden_size"]
        self.inter = d["intermediate_size"]
        self.layers = d["num_hidden_layers"]
        self.heads = d["num_attention_heads"]
        kv = d.get("num_key_value_heads")
        self.kv_heads = kv if kv is not None else (8 if self.mistral else self.heads)
        hd = d.get("head_dim")
        self.head_dim = hd if hd is not None else (128 if self.qwen3 else self.hidden // self.heads)
        self.eps = d.get("rms_norm_eps", 1e-6)
        self.theta = d.get("rope_theta", 10000.0)
        default_max = 32768 if (self.qwen2 or self.qwen3) else (4096 * 32 if self.mistral else 2048)
        self.max_pos = d.get("max_position_embeddings", default_max)
        self.vocab = d["vocab_size"]
        self.tie = bool(d.get("tie_word_embeddings", False))
        ab = bool(d.get("attention_bias", False))
        self.qkv_bias = True if self.qwen2 else ab
        self.o_bias = False if self.qwen2 else ab
        rs = d.get("rope_scaling")
        self.rope_type = "default"
        self.rope = {}
        if rs:
            self.rope_type = rs.get("rope_type", rs.get("type", "default"))
            self.rope = rs
        if self.rope_type not in ("default", "linear", "dynamic", "llama3"):
            raise ValueError(f"unsupported rope_type {self.rope_type}")


def inv_freq(cfg, seq_len):
    """transformers ROPE_INIT_FUNCTIONS[rope_type](config, device, seq_len) in float64."""
    dim = cfg.head_dim
    base = cfg.theta
    exps = np.arange(0, dim, 2, dtype=np.int64).astype(np.float64) / dim
    if cfg.rope_type == "dynamic":
        factor = cfg.rope["factor"]
        sl = max(seq_len, cfg.max_pos)
        base = base * ((factor * sl / cfg.max_pos) - (factor - 1)) ** (dim / (dim - 2))
    f = 1.0 / (base ** exps)
    if cfg.rope_type == "linear":
        f = f / cfg.rope["factor"]
    elif cfg.rope_type == "llama3":
        factor = cfg.rope["factor"]
        low = cfg.rope["low_freq_factor"]
        high = cfg.rope["high_freq_factor"]
        old = cfg.rope["original_max_position_embeddings"]
        low_wl = old / low
        high_wl = old / high
        wl = 2 * math.pi / f
        scaled = np.where(wl > low_wl, f / factor, f)
        smooth = (old / wl - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wl < high_wl) & ~(wl > low_wl)
        f = np.where(medium, smoothed, scaled)
    return f, 1.0  # attention_scaling is 1.0 for all four types


# ---------------------------------------------------------------------------------------------
# model


def rms_norm(x, w, eps):
    var = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(var + eps) * w


def rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def e4m3(x):
    """x rounded to float8 e4m3fn values: 3 mantissa bits, exponent >= -6 (subnormals below
    2^-6 in steps of 2^-9), round half to even, saturating at +-448."""
    a = np.abs(x)
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    q = np.exp2(np.maximum(e, -6.0) - 3.0)
    return np.sign(x) * np.minimum(np.rint(a / q) * q, 448.0)


def silu(x):
    return x / (1.0 + np.exp(-x))


class Model:
    def __init__(self, model_dir, act_int8=False, kv_fp8=False):
        self.act_int8 = act_int8
        self.kv_fp8 = kv_fp8
        with open(os.path.join(model_dir, "config.json")) as f:
            self.cfg = Config(json.load(f))
        self.w = load_weights(model_dir)
        c = self.cfg
        self.embed = self.w["model.embed_tokens.weight"]
        self.lm_head = self.embed if c.tie else self.w["lm_head.weight"]
        assert self.embed.shape == (c.vocab, c.hidden), self.embed.shape

    def lin(self, h, name):
        """h @ W^T for the linear `name`; with act_int8 (W8A8, as vLLM's dynamic per-token int8
        activations), each row of h first becomes q * max|h| / 127, q = round-half-even(h * 127 /
        max|h|) in [-127, 127]."""
        if self.act_int8:
            amax = np.max(np.abs(h), axis=-1, keepdims=True)
            inv = np.divide(127.0, amax, out=np.zeros_like(amax), where=amax > 0)
            h = np.rint(h * inv) * (amax / 127.0)
        return h @ self.w[name].T

    def reset(self):
        c = self.cfg
        self.k_cache = [np.zeros((0, c.kv_heads, c.head_dim)) for _ in range(c.layers)]
        self.v_cache = [np.zeros((0, c.kv_heads, c.head_dim)) for _ in range(c.layers)]

    def forward(self, ids, start_pos):
        """Runs ids at positions start_pos.. through the model; returns logits (T, V)."""
        c = self.cfg
        w = self.w
        T = len(ids)
        pos = np.arange(start_pos, start_pos + T, dtype=np.float64)
        freq, att_scale = inv_freq(c, start_pos + T)
        ang = np.outer(pos, freq)  # (T, D/2)
        emb = np.concatenate([ang, ang], axis=-1)
        cos = (np.cos(emb) * att_scale)[:, None, :]  # (T, 1, D)
        sin = (np.sin(emb) * att_scale)[:, None, :]
        x = self.embed[np.asarray(ids)]
        group = c.heads // c.kv_heads
        scale = c.head_dim ** -0.5
        total = start_pos + T
        # causal mask over (T, total): query t sees keys 0 .. start_pos + t
        mask = np.arange(total)[None, :] > (start_pos + np.arange(T))[:, None]
        for l in range(c.layers):
            p = f"model.layers.{l}."
            h = rms_norm(x, w[p + "input_layernorm.weight"], c.eps)
            q = self.lin(h, p + "self_attn.q_proj.weight")
            k = self.lin(h, p + "self_attn.k_proj.weight")
            v = self.lin(h, p + "self_attn.v_proj.weight")
            if c.qkv_bias:
                q = q + w[p + "self_attn.q_proj.bias"]
                k = k + w[p + "self_attn.k_proj.bias"]
                v = v + w[p + "self_attn.v_proj.bias"]
            q = q.reshape(T, c.heads, c.head_dim)
            k = k.reshape(T, c.kv_heads, c.head_dim)
            v = v.reshape(T, c.kv_heads, c.head_dim)
            if c.qwen3:
                q = rms_norm(q, w[p + "self_attn.q_norm.weight"], c.eps)
                k = rms_norm(k, w[p + "self_attn.k_norm.weight"], c.eps)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            if self.kv_fp8:
                ks = float(w.get(p + "self_attn.k_scale", 1.0))
                vs = float(w.get(p + "self_attn.v_scale", 1.0))
                k = e4m3(k / ks) * ks
                v = e4m3(v / vs) * vs
            self.k_cache[l] = np.concatenate([self.k_cache[l], k], axis=0)
            self.v_cache[l] = np.concatenate([self.v_cache[l], v], axis=0)
            K = np.repeat(self.k_cache[l], group, axis=1)  # (total, H, D)
            V = np.repeat(self.v_cache[l], group, axis=1)
            s = np.einsum("thd,shd->hts", q, K) * scale  # (H, T, total)
            s = np.where(mask[None, :, :], -np.inf, s)
            s = s - s.max(axis=-1, keepdims=True)
            pr = np.exp(s)
            pr = pr / pr.sum(axis=-1, keepdims=True)
            a = np.einsum("hts,shd->thd", pr, V).reshape(T, c.heads * c.head_dim)
            o = self.lin(a, p + "self_attn.o_proj.weight")
            if c.o_bias:
                o = o + w[p + "self_attn.o_proj.bias"]
            x = x + o
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], c.eps)
            g = self.lin(h, p + "mlp.gate_proj.weight")
            u = self.lin(h, p + "mlp.up_proj.weight")
            x = x + self.lin(silu(g) * u, p + "mlp.down_proj.weight")
        x = rms_norm(x, w["model.norm.weight"], c.eps)
        return x @ self.lm_head.T


def emit_json(obj, path):
    """Writes obj as one JSON line to path, or prints it when path is None."""
    text = json.dumps(obj)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    ap.add_argument("--steps", type=int, default=0, help="greedy tokens to generate")
    ap.add_argument("--out", help="write the JSON here instead of stdout")
    ap.add_argument("--all-logits", action="store_true", help="logits of every prompt position")
    ap.add_argument("--step-logits", action="store_true", help="logits of every greedy step")
    ap.add_argument("--act-int8", action="store_true",
                    help="W8A8: quantize the input of every decoder linear to int8 per token")
    ap.add_argument("--kv-fp8", action="store_true",
                    help="an fp8 e4m3 KV cache with the checkpoint's k_scale / v_scale")
    a = ap.parse_args(argv)
    try:
        ids = [int(s) for s in a.prompt_ids.split(",") if s.strip() != ""]
    except ValueError:
        ap.error(f"--prompt-ids: expected comma-separated integers, got {a.prompt_ids!r}")
    if not ids:
        ap.error("--prompt-ids: at least one id")
    if a.steps < 0:
        ap.error("--steps: must be >= 0")
    m = Model(a.model, act_int8=a.act_int8, kv_fp8=a.kv_fp8)
    for t in ids:
        if not 0 <= t < m.cfg.vocab:
            ap.error(f"--prompt-ids: id {t} outside the vocabulary (size {m.cfg.vocab})")
    m.reset()
    logits = m.forward(ids, 0)
    last = logits[-1]
    out = {"precision": "float64", "prompt_logits_last": last.tolist()}
    if a.all_logits:
        out["all_logits"] = logits.tolist()
    greedy, maxabs, steps = [], [], []
    cur = last
    pos = len(ids)
    for _ in range(a.steps):
        tok = int(np.argmax(cur))
        greedy.append(tok)
        maxabs.append(float(np.max(np.abs(cur))))
        if a.step_logits:
            steps.append(cur.tolist())
        cur = m.forward([tok], pos)[-1]
        pos += 1
    out["greedy_tokens"] = greedy
    out["step_logits_max_abs"] = maxabs
    if a.step_logits:
        out["step_logits"] = steps
    emit_json(out, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
