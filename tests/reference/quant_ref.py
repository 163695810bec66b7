#!/usr/bin/python3
"""Independent numpy dequantizer for quantized Hugging Face Llama-family checkpoints.

Written from the published format descriptions (AutoAWQ's GEMM layout, AutoGPTQ / GPTQModel,
vLLM's fp8 and compressed-tensors loaders), not from pdserve's C code, so that it can judge the
C loader's dequantization. Reads a model directory exactly as published: config.json (its
"quantization_config") and model.safetensors or model.safetensors.index.json with its shards
(the safetensors format is parsed here with numpy). Writes a float32 model directory that
tests/reference/llama_ref.py runs, or dumps one dequantized linear as JSON.

Quantized linears are found by their tensors, whatever their name (in practice the 7 decoder
linears self_attn.{q,k,v,o}_proj and mlp.{gate,up,down}_proj of each layer; lm_head too when a
checkpoint quantizes it). With --out every decoder linear of every layer must be present,
quantized or float; --dump-tensor reads and checks only the one linear it prints. A linear
has logical shape (out, in) = nn.Linear's (out_features, in_features).

Formats ("quant_method" of config.json's "quantization_config"):
  * "awq" (bits 4, group_size G > 0, zero_point true, version "gemm"; missing fields take
    transformers' AwqConfig defaults 4 / 128 / true / "gemm"; version compared case-blind):
    prefix.qweight I32 [in, out/8], prefix.qzeros I32 [in/G, out/8], prefix.scales F16
    [in/G, out]. Nibble i (bits 4i..4i+3) of the int32 at column c holds output column
    8c + ORDER[i], ORDER = [0, 2, 4, 6, 1, 3, 5, 7], for qweight and qzeros alike.
    W^T[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n], q and z unsigned 0..15.
  * "gptq" (bits 4 or 8, group_size G > 0 or -1 = one group of all rows, desc_act, sym,
    checkpoint_format "gptq" (v1, the default) or "gptq_v2"): P = 32 / bits;
    prefix.qweight I32 [in/P, out] (element r holds input rows P*r + i at bits i*bits..),
    prefix.qzeros I32 [n_groups, out/P] (element c holds output columns P*c + i at bits
    i*bits..), prefix.scales F16 [n_groups, out], prefix.g_idx I32 [in] (optional: absent means
    g_idx[k] = k // G; required when desc_act is true), n_groups = in / G. Zero point: v1 stores
    z - 1 (z = (stored & (2^bits - 1)) + 1), v2 stores z. sym true: z = 2^(bits-1) for every
    group (the stored zeros are still read and checked; a stored zero that decodes to another
    value is reported on stderr and the constant is used, as vLLM's symmetric kernels do).
    W^T[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n].
  * "fp8" (activation_scheme "dynamic" or "static"; no weight_block_size): prefix.weight
    F8_E4M3 (out, in), prefix.weight_scale F32 shape [] or [1], prefix.input_scale F32 scalar
    (required with "static", dropped from the output). W[n, k] = f8_to_f32(w[n, k]) * scale.
    float8_e4m3fn is decoded exactly: sign bit, 4-bit exponent with bias 7, 3-bit mantissa,
    subnormals (exponent 0: m * 2^-9), 0x7f / 0xff NaN, no infinities (max 448).
  * "compressed-tensors" (format "int-quantized"; each config group's weights: num_bits 8,
    type "int", symmetric, strategy "channel" or "tensor", dynamic false; input_activations
    null or 8-bit int symmetric "token" dynamic; kv_cache_scheme null): prefix.weight I8
    (out, in), prefix.weight_scale F32/F16/BF16 [out, 1] (channel) or [1] (tensor).
    W[n, k] = w[n, k] * scale[n]. Activation quantization (W8A8's per-token int8 x) is not part
    of the weights and is not simulated: the float model is the dequantized-weight model.

Arithmetic: (q - z) is an exact small integer converted to float32, the scale (F16 / BF16 / F32)
is widened exactly to float32, and their float32 product is the one rounding; fp8 and int8
weights are likewise exact in float32 before the one multiplication by the float32 scale.
Tensors that are not quantized linears (embeddings, norms, biases, float linears) are copied,
widened to float32 (F16 / BF16 / F32 / F64 accepted; any other dtype is an error).

Errors (exit status 1, message on stderr naming the tensor or config field): a missing tensor,
a wrong shape or dtype, a g_idx entry outside 0..n_groups-1, an unknown quant_method or an
unsupported variant (AWQ bits != 4 or version != gemm or zero_point false, GPTQ bits not 4/8,
unknown checkpoint_format, fp8 block scales, compressed-tensors formats other than int8
int-quantized), and a config.json without "quantization_config".

CLI:
  quant_ref.py --model QDIR --out FDIR
      writes FDIR/model.safetensors (float32; every quantized linear as prefix.weight (out, in),
      its qweight / qzeros / scales / g_idx / weight_scale / input_scale dropped; tensors sorted
      by name) and FDIR/config.json (config.json without "quantization_config", with
      "torch_dtype": "float32"); copies tokenizer.json, tokenizer_config.json and
      generation_config.json when QDIR has them. FDIR then runs under llama_ref.py --model FDIR.
  quant_ref.py --model QDIR --dump-tensor PREFIX
      prints JSON {"shape": [out, in], "values": [out*in floats, row-major]} of the dequantized
      float32 matrix of the quantized linear PREFIX (e.g. model.layers.0.self_attn.q_proj; a
      trailing ".weight" is ignored). Each value is the float32's exact value as a double
      (Python's shortest round-trip repr of it), so strtof or strtod both read back the float32
      exactly; non-finite values are the strings "NaN", "Infinity", "-Infinity".
"""
import argparse
import json
import os
import shutil
import sys

import numpy as np

DECODER_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


class QuantError(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# safetensors

_NP_DTYPE = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "BF16": "<u2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U8": "u1",
    "F8_E4M3": "u1",
}


class Tensor:
    """One tensor of a safetensors file, read on demand."""

    def __init__(self, path, name, dtype, shape, begin, end, data_start):
        self.path, self.name, self.dtype = path, name, dtype
        self.shape = tuple(shape)
        self.begin, self.end, self.data_start = begin, end, data_start

    def raw(self):
        """The tensor as stored: a numpy array of its storage dtype (BF16 as uint16, F8 as
        uint8) and its shape."""
        mm = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.data_start)
        buf = np.asarray(mm[self.begin:self.end])
        return buf.view(_NP_DTYPE[self.dtype]).reshape(self.shape)

    def as_f32(self):
        """A float tensor widened exactly to float32 (F64 is rounded)."""
        a = self.raw()
        if self.dtype == "BF16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        if self.dtype in ("F16", "F32", "F64"):
            return a.astype(np.float32)
        raise QuantError(f"tensor {self.name}: dtype {self.dtype} is not a float dtype")


def _read_header(path):
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise QuantError(f"{path}: shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n <= 0 or 8 + n > size:
            raise QuantError(f"{path}: bad header length {n}")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise QuantError(f"{path}: header is not JSON: {e}") from None
    data_len = size - 8 - n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = info.get("dtype")
        if dt not in _NP_DTYPE:
            raise QuantError(f"{path}: tensor {name}: unsupported dtype {dt}")
        shape = info.get("shape")
        b, e = info.get("data_offsets", (None, None))
        if not isinstance(shape, list) or any(not isinstance(d, int) or d < 0 for d in shape):
            raise QuantError(f"{path}: tensor {name}: bad shape {shape}")
        want = int(np.prod(shape, dtype=np.int64)) * np.dtype(_NP_DTYPE[dt]).itemsize
        if not (isinstance(b, int) and isinstance(e, int) and 0 <= b <= e <= data_len
                and e - b == want):
            raise QuantError(f"{path}: tensor {name}: data_offsets {[b, e]} do not hold "
                             f"{dt} {shape} inside {data_len} data bytes")
        out[name] = Tensor(path, name, dt, shape, b, e, 8 + n)
    return out


def open_tensors(model_dir):
    """{name: Tensor} over model.safetensors or the shards of model.safetensors.index.json."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            wm = json.load(f).get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise QuantError(f"{index}: no weight_map")
        tensors = {}
        for shard in sorted(set(wm.values())):
            for name, t in _read_header(os.path.join(model_dir, shard)).items():
                if name in tensors:
                    raise QuantError(f"tensor {name}: in two shards ({shard} and "
                                     f"{os.path.basename(tensors[name].path)})")
                tensors[name] = t
        for name, shard in wm.items():
            if name not in tensors:
                raise QuantError(f"tensor {name}: listed in the index for {shard} but absent")
        return tensors
    path = os.path.join(model_dir, "model.safetensors")
    if not os.path.exists(path):
        raise QuantError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    return _read_header(path)


def write_safetensors(path, entries):
    """entries: list of (name, shape, producer) with producer() -> float32 array of shape.
    Writes a float32 safetensors file, one tensor at a time."""
    header = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, shape, _ in entries:
        n = int(np.prod(shape, dtype=np.int64)) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * ((-len(hb)) % 8)
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(len(hb).to_bytes(8, "little"))
            f.write(hb)
            for name, shape, producer in entries:
                a = producer()
                if a.dtype != np.float32 or a.shape != tuple(shape):
                    raise AssertionError(f"{name}: produced {a.dtype} {a.shape}, want {shape}")
                f.write(np.ascontiguousarray(a).astype("<f4", copy=False).tobytes())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ---------------------------------------------------------------------------------------------
# number formats


def _fp8_e4m3fn_table():
    """float32 value of each of the 256 float8_e4m3fn bit patterns."""
    b = np.arange(256, dtype=np.int64)
    sign = b >> 7
    exp = (b >> 3) & 0xF
    man = b & 0x7
    mag = np.where(exp == 0,
                   np.ldexp(man.astype(np.float64), -9),  # subnormal: (m / 8) * 2^(1 - 7)
                   np.ldexp(1.0 + man / 8.0, (exp - 7).astype(np.int64)))
    val = np.where(sign == 1, -mag, mag)
    val = np.where((b & 0x7F) == 0x7F, np.nan, val)
    return val.astype(np.float32)


FP8_E4M3FN = _fp8_e4m3fn_table()


def unpack_along(packed, bits, axis_last):
    """Splits each int32 into 32/bits unsigned fields, field i at bits i*bits... Returns
    (..., P) with the fields in order i = 0..P-1 on a new last axis (axis_last True) or a new
    axis after the first (axis_last False: (rows, P, cols))."""
    u = packed.view(np.uint32) if packed.dtype == np.int32 else packed.astype(np.uint32)
    p = 32 // bits
    mask = np.uint32((1 << bits) - 1)
    fields = [((u >> np.uint32(bits * i)) & mask).astype(np.int32) for i in range(p)]
    return np.stack(fields, axis=-1 if axis_last else 1)


# ---------------------------------------------------------------------------------------------
# config


def _field(qc, key, default, kind):
    """quantization_config[key] (default when absent or null), checked to be of type kind."""
    v = qc.get(key)
    if v is None:
        v = default
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise QuantError(f"quantization_config.{key}: unexpected value {v!r}")
    return v


class QuantConfig:
    def __init__(self, cfg):
        qc = cfg.get("quantization_config")
        if not isinstance(qc, dict):
            raise QuantError("config.json: no quantization_config")
        self.method = qc.get("quant_method")
        if self.method == "awq":
            self.bits = _field(qc, "bits", 4, int)
            if self.bits != 4:
                raise QuantError(f"quantization_config.bits: {self.bits} unsupported for awq "
                                 "(only 4)")
            self.group = _field(qc, "group_size", 128, int)
            if self.group <= 0:
                raise QuantError(f"quantization_config.group_size: {self.group} unsupported for "
                                 "awq (must be > 0)")
            if not _field(qc, "zero_point", True, bool):
                raise QuantError("quantization_config.zero_point: false unsupported for awq")
            ver = _field(qc, "version", "gemm", str)
            if ver.lower() != "gemm":
                raise QuantError(f"quantization_config.version: {ver!r} unsupported for awq "
                                 "(only gemm)")
        elif self.method == "gptq":
            if qc.get("bits") is None:
                raise QuantError("quantization_config.bits: missing")
            self.bits = _field(qc, "bits", None, int)
            if self.bits not in (4, 8):
                raise QuantError(f"quantization_config.bits: {self.bits} unsupported for gptq "
                                 "(only 4 or 8)")
            self.group = _field(qc, "group_size", 128, int)
            if self.group == 0 or self.group < -1:
                raise QuantError(f"quantization_config.group_size: {self.group} invalid")
            self.desc_act = _field(qc, "desc_act", False, bool)
            self.sym = _field(qc, "sym", True, bool)
            fmt = _field(qc, "checkpoint_format", "gptq", str)
            if fmt not in ("gptq", "gptq_v2"):
                raise QuantError(f"quantization_config.checkpoint_format: {fmt!r} unsupported "
                                 "(gptq or gptq_v2)")
            self.v2 = fmt == "gptq_v2"
            if qc.get("is_marlin_format"):
                raise QuantError("quantization_config.is_marlin_format: marlin-packed gptq "
                                 "unsupported")
        elif self.method == "fp8":
            scheme = _field(qc, "activation_scheme", "dynamic", str)
            if scheme not in ("dynamic", "static"):
                raise QuantError(f"quantization_config.activation_scheme: {scheme!r} "
                                 "unsupported (dynamic or static)")
            self.static = scheme == "static"
            if qc.get("weight_block_size") is not None:
                raise QuantError("quantization_config.weight_block_size: block-wise fp8 "
                                 "unsupported (per-tensor only)")
            fmt = qc.get("fmt", "e4m3")
            if fmt != "e4m3":
                raise QuantError(f"quantization_config.fmt: {fmt!r} unsupported (e4m3)")
        elif self.method == "compressed-tensors":
            self._compressed_tensors(qc)
        else:
            raise QuantError(f"quantization_config.quant_method: unknown {self.method!r} "
                             "(awq, gptq, fp8, compressed-tensors)")

    def _compressed_tensors(self, qc):
        fmt = qc.get("format")
        if fmt != "int-quantized":
            raise QuantError(f"quantization_config.format: {fmt!r} unsupported "
                             "(only int-quantized)")
        if qc.get("kv_cache_scheme") is not None:
            raise QuantError("quantization_config.kv_cache_scheme: unsupported (must be null)")
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise QuantError("quantization_config.config_groups: missing or empty")
        self.strategies = set()
        for gname, g in groups.items():
            where = f"quantization_config.config_groups.{gname}"
            if not isinstance(g, dict):
                raise QuantError(f"{where}: not an object")
            w = g.get("weights")
            if not isinstance(w, dict):
                raise QuantError(f"{where}.weights: missing")
            want = {"num_bits": 8, "type": "int", "symmetric": True}
            for k, v in want.items():
                if w.get(k) != v:
                    raise QuantError(f"{where}.weights.{k}: {w.get(k)!r} unsupported "
                                     f"(only {v!r})")
            if w.get("dynamic", False):
                raise QuantError(f"{where}.weights.dynamic: true unsupported")
            if w.get("strategy") not in ("channel", "tensor"):
                raise QuantError(f"{where}.weights.strategy: {w.get('strategy')!r} "
                                 "unsupported (channel or tensor)")
            self.strategies.add(w["strategy"])
            a = g.get("input_activations")
            if a is not None:
                want = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                        "dynamic": True}
                for k, v in want.items():
                    if a.get(k) != v:
                        raise QuantError(f"{where}.input_activations.{k}: {a.get(k)!r} "
                                         f"unsupported (only {v!r})")


# ---------------------------------------------------------------------------------------------
# dequantization


def _need(tensors, name, dtype, ndim=None):
    t = tensors.get(name)
    if t is None:
        raise QuantError(f"tensor {name}: missing")
    if isinstance(dtype, str):
        dtype = (dtype,)
    if t.dtype not in dtype:
        raise QuantError(f"tensor {name}: dtype {t.dtype}, expected {' or '.join(dtype)}")
    if ndim is not None and len(t.shape) != ndim:
        raise QuantError(f"tensor {name}: shape {list(t.shape)}, expected {ndim} dimensions")
    return t


def _shape_is(t, want):
    if tuple(t.shape) != tuple(want):
        raise QuantError(f"tensor {t.name}: shape {list(t.shape)}, expected {list(want)}")


class Linear:
    """One quantized linear: validated at construction, dequantized by weight()."""

    def __init__(self, qc, tensors, prefix):
        self.qc, self.prefix = qc, prefix
        self.consumed = []
        m = qc.method
        if m == "awq":
            self._check_awq(tensors)
        elif m == "gptq":
            self._check_gptq(tensors)
        elif m == "fp8":
            self._check_fp8(tensors)
        else:
            self._check_ct(tensors)

    # -- AWQ -------------------------------------------------------------------------------
    def _check_awq(self, T):
        p, G = self.prefix, self.qc.group
        qw = _need(T, p + ".qweight", "I32", 2)
        qz = _need(T, p + ".qzeros", "I32", 2)
        sc = _need(T, p + ".scales", "F16", 2)
        n_in, out = qw.shape[0], sc.shape[1]
        if out % 8:
            raise QuantError(f"tensor {sc.name}: {out} output columns, not a multiple of 8")
        _shape_is(qw, (n_in, out // 8))
        if n_in % G:
            raise QuantError(f"tensor {qw.name}: {n_in} input rows, not a multiple of "
                             f"quantization_config.group_size {G}")
        _shape_is(qz, (n_in // G, out // 8))
        _shape_is(sc, (n_in // G, out))
        self.t = (qw, qz, sc)
        self.consumed = [qw.name, qz.name, sc.name]
        self.shape = (out, n_in)

    def _awq_weight(self):
        qw, qz, sc = self.t
        G = self.qc.group

        def unpack(a):  # (rows, out/8) -> (rows, out), ORDER interleave
            f = unpack_along(a, 4, axis_last=True)  # (rows, out/8, 8): f[..., i] = nibble i
            u = np.empty_like(f)
            u[..., list(AWQ_ORDER)] = f  # nibble i -> column 8c + ORDER[i]
            return u.reshape(a.shape[0], -1)

        q = unpack(qw.raw())
        z = np.repeat(unpack(qz.raw()), G, axis=0)
        s = np.repeat(sc.as_f32(), G, axis=0)
        wt = (q - z).astype(np.float32) * s  # (in, out)
        return np.ascontiguousarray(wt.T)

    # -- GPTQ ------------------------------------------------------------------------------
    def _check_gptq(self, T):
        p, qc = self.prefix, self.qc
        P = 32 // qc.bits
        qw = _need(T, p + ".qweight", "I32", 2)
        qz = _need(T, p + ".qzeros", "I32", 2)
        sc = _need(T, p + ".scales", "F16", 2)
        n_in, out = qw.shape[0] * P, qw.shape[1]
        G = n_in if qc.group == -1 else qc.group
        if n_in % G:
            raise QuantError(f"tensor {qw.name}: {n_in} input rows, not a multiple of "
                             f"quantization_config.group_size {G}")
        ng = n_in // G
        if out % P:
            raise QuantError(f"tensor {qw.name}: {out} output columns, not a multiple of {P}")
        _shape_is(sc, (ng, out))
        _shape_is(qz, (ng, out // P))
        self.consumed = [qw.name, qz.name, sc.name]
        gi = T.get(p + ".g_idx")
        if gi is not None:
            _need(T, gi.name, "I32", 1)
            _shape_is(gi, (n_in,))
            g = gi.raw().astype(np.int64)
            bad = np.nonzero((g < 0) | (g >= ng))[0]
            if bad.size:
                raise QuantError(f"tensor {gi.name}: entry {int(bad[0])} = {int(g[bad[0]])} "
                                 f"outside 0..{ng - 1}")
            self.consumed.append(gi.name)
        elif qc.desc_act:
            raise QuantError(f"tensor {p}.g_idx: missing (quantization_config.desc_act is true)")
        else:
            g = np.arange(n_in, dtype=np.int64) // G
        self.g = g
        self.t = (qw, qz, sc)
        self.shape = (out, n_in)

    def _gptq_weight(self):
        qw, qz, sc = self.t
        qc = self.qc
        bits = qc.bits
        q = unpack_along(qw.raw(), bits, axis_last=False)  # (in/P, P, out)
        q = q.reshape(-1, q.shape[2])  # row P*r + i
        zs = unpack_along(qz.raw(), bits, axis_last=True)  # (ng, out/P, P)
        zs = zs.reshape(zs.shape[0], -1)  # column P*c + i
        z = zs if qc.v2 else zs + 1
        if qc.sym:
            zsym = 1 << (bits - 1)
            off = np.argwhere(z != zsym)
            if off.size:
                gr, col = (int(v) for v in off[0])
                print(f"quant_ref: warning: tensor {qz.name}: sym is true but group {gr} column "
                      f"{col} stores a zero point of {int(z[gr, col])} (want {zsym}); using "
                      f"{zsym}", file=sys.stderr)
            z = np.full_like(z, zsym)
        s = sc.as_f32()
        wt = (q - z[self.g]).astype(np.float32) * s[self.g]
        return np.ascontiguousarray(wt.T)

    # -- FP8 -------------------------------------------------------------------------------
    def _check_fp8(self, T):
        p = self.prefix
        w = _need(T, p + ".weight", "F8_E4M3", 2)
        ws = _need(T, p + ".weight_scale", "F32")
        if ws.shape not in ((), (1,)):
            raise QuantError(f"tensor {ws.name}: shape {list(ws.shape)}, expected [] or [1] "
                             "(per-tensor scale)")
        self.consumed = [w.name, ws.name]
        ins = T.get(p + ".input_scale")
        if self.qc.static or ins is not None:
            ins = _need(T, p + ".input_scale", "F32")
            if ins.shape not in ((), (1,)):
                raise QuantError(f"tensor {ins.name}: shape {list(ins.shape)}, expected [] or "
                                 "[1]")
            self.consumed.append(ins.name)
        self.t = (w, ws)
        self.shape = w.shape

    def _fp8_weight(self):
        w, ws = self.t
        return FP8_E4M3FN[w.raw()] * ws.as_f32().reshape(())

    # -- compressed-tensors int8 -----------------------------------------------------------
    def _check_ct(self, T):
        p = self.prefix
        w = _need(T, p + ".weight", "I8", 2)
        ws = _need(T, p + ".weight_scale", ("F32", "F16", "BF16"))
        out = w.shape[0]
        ok = []
        if "channel" in self.qc.strategies:
            ok.append((out, 1))
        if "tensor" in self.qc.strategies:
            ok.append((1,))
        if ws.shape not in ok:
            raise QuantError(f"tensor {ws.name}: shape {list(ws.shape)}, expected "
                             f"{' or '.join(str(list(s)) for s in ok)}")
        self.consumed = [w.name, ws.name]
        zp = T.get(p + ".weight_zero_point")
        if zp is not None:
            if zp.dtype not in ("I8", "I32", "F32", "F16", "BF16") or zp.shape != ws.shape:
                raise QuantError(f"tensor {zp.name}: {zp.dtype} {list(zp.shape)}, expected "
                                 f"the shape of {ws.name}")
            if np.any(zp.raw() != 0):
                raise QuantError(f"tensor {zp.name}: nonzero zero point (symmetric weights "
                                 "expected)")
            self.consumed.append(zp.name)
        self.t = (w, ws)
        self.shape = w.shape

    def _ct_weight(self):
        w, ws = self.t
        s = ws.as_f32().reshape(-1, 1)  # (out, 1) or (1, 1)
        return w.raw().astype(np.float32) * s

    def weight(self):
        """The dequantized float32 (out, in) matrix."""
        m = self.qc.method
        if m == "awq":
            a = self._awq_weight()
        elif m == "gptq":
            a = self._gptq_weight()
        elif m == "fp8":
            a = self._fp8_weight()
        else:
            a = self._ct_weight()
        assert a.dtype == np.float32 and a.shape == tuple(self.shape), (a.dtype, a.shape)
        return a


def quant_prefixes(qc, tensors):
    """The prefixes of every quantized linear in tensors, found by their tensors' names (and,
    for fp8 and compressed-tensors, the dtype of their .weight)."""
    prefixes = set()
    if qc.method in ("awq", "gptq"):
        for n in tensors:
            for suf in (".qweight", ".qzeros", ".scales", ".g_idx"):
                if n.endswith(suf):
                    prefixes.add(n[: -len(suf)])
        for p in prefixes:
            if p + ".weight" in tensors:
                raise QuantError(f"tensor {p}.weight: present beside the quantized "
                                 f"{p}.qweight / .scales")
    elif qc.method == "fp8":
        for n, t in tensors.items():
            if n.endswith(".weight") and t.dtype == "F8_E4M3":
                prefixes.add(n[: -len(".weight")])
            if n.endswith(".weight_scale") or n.endswith(".input_scale"):
                prefixes.add(n.rsplit(".", 1)[0])
    else:
        for n, t in tensors.items():
            if n.endswith(".weight") and t.dtype == "I8":
                prefixes.add(n[: -len(".weight")])
            if n.endswith(".weight_scale") or n.endswith(".weight_zero_point"):
                prefixes.add(n.rsplit(".", 1)[0])
    return prefixes


def check_decoder_linears(cfg, tensors, linears):
    n = cfg.get("num_hidden_layers")
    if not isinstance(n, int) or n <= 0:
        raise QuantError(f"config.json num_hidden_layers: {n!r}")
    for l in range(n):
        for lin in DECODER_LINEARS:
            p = f"model.layers.{l}.{lin}"
            if p not in linears and p + ".weight" not in tensors:
                raise QuantError(f"tensor {p}.weight: missing (neither quantized nor float)")


def load(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    qc = QuantConfig(cfg)
    return cfg, qc, open_tensors(model_dir)


def convert(model_dir, out_dir):
    if os.path.abspath(model_dir) == os.path.abspath(out_dir):
        raise QuantError("--out: must differ from --model")
    cfg, qc, tensors = load(model_dir)
    linears = {p: Linear(qc, tensors, p) for p in sorted(quant_prefixes(qc, tensors))}
    check_decoder_linears(cfg, tensors, linears)
    consumed = set()
    entries = []
    for p, lin in linears.items():
        consumed.update(lin.consumed)
        entries.append((p + ".weight", lin.shape, lin.weight))
    for name, t in tensors.items():
        if name in consumed:
            continue
        if t.dtype not in FLOAT_DTYPES:
            raise QuantError(f"tensor {name}: dtype {t.dtype} is not part of a quantized "
                             "linear and not a float dtype")
        entries.append((name, t.shape, t.as_f32))
    entries.sort(key=lambda e: e[0])
    names = [e[0] for e in entries]
    if len(set(names)) != len(names):
        raise QuantError("duplicate output tensor names")
    os.makedirs(out_dir, exist_ok=True)
    if os.path.exists(os.path.join(out_dir, "model.safetensors.index.json")):
        raise QuantError(f"{out_dir}: has a model.safetensors.index.json (it would shadow the "
                         "model.safetensors written here)")
    write_safetensors(os.path.join(out_dir, "model.safetensors"), entries)
    fcfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    fcfg["torch_dtype"] = "float32"
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(fcfg, f, indent=2)
        f.write("\n")
    for fn in COPIED_FILES:
        src = os.path.join(model_dir, fn)
        if os.path.exists(src):
            shutil.copyfile(src, os.path.join(out_dir, fn))


def dump(model_dir, name):
    _, qc, tensors = load(model_dir)
    prefix = name[: -len(".weight")] if name.endswith(".weight") else name
    if prefix not in quant_prefixes(qc, tensors):
        if prefix + ".weight" in tensors or prefix in tensors:
            raise QuantError(f"--dump-tensor: {prefix} is not a quantized linear")
        raise QuantError(f"--dump-tensor: no quantized linear {prefix}")
    w = Linear(qc, tensors, prefix).weight()
    vals = w.reshape(-1).astype(np.float64).tolist()  # exact: every float32 is a double
    if not np.isfinite(w).all():
        vals = [v if np.isfinite(v) else ("NaN" if np.isnan(v) else
                                          ("Infinity" if v > 0 else "-Infinity")) for v in vals]
    sys.stdout.write(json.dumps({"shape": list(w.shape), "values": vals}) + "\n")


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="quantized model directory")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--out", help="write the float32 model directory here")
    g.add_argument("--dump-tensor", metavar="PREFIX",
                   help="print one dequantized linear as JSON")
    a = ap.parse_args(argv)
    try:
        if a.dump_tensor:
            dump(a.model, a.dump_tensor)
        else:
            convert(a.model, a.out)
    except QuantError as e:
        print(f"quant_ref: {e}", file=sys.stderr)
        return 1
    except (OSError, json.JSONDecodeError) as e:
        print(f"quant_ref: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
