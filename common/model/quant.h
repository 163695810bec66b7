/* Quantized checkpoints: config.json's "quantization_config", the stored tensors of a quantized
 * linear layer, and their decoding into values, scales and zero points.
 *
 * Formats (as vLLM reads them; docs/quantization.md has the byte layouts):
 *   awq                 AutoAWQ GEMM, 4 bit, groups of group_size input rows, zero points:
 *                       qweight I32 (in, out/8), qzeros I32 (in/G, out/8), scales F16 (in/G, out);
 *                       nibble i of an int32 at column c holds output column 8c +
 * [0,2,4,6,1,3,5,7][i]. gptq                AutoGPTQ / GPTQModel, 4 or 8 bit: qweight I32
 * (in*bits/32, out) packed along the input, qzeros I32 (groups, out*bits/32), scales F16 (groups,
 * out), g_idx I32 (in) (act order: any assignment of input rows to groups); checkpoint_format gptq
 * (v1) stores zero - 1, gptq_v2 the zero itself. fp8                 weight F8_E4M3 (out, in),
 * weight_scale F32 per tensor; activation_scheme dynamic or static (input_scale F32, read and
 * checked, see below). compressed-tensors  llm-compressor: int8 W8A8 (weight I8 (out, in),
 * weight_scale (out, 1) or per tensor, input activations int8 per token, dynamic) and fp8 W8A8
 *                       (weight F8_E4M3, the same scales).
 * Integer formats dequantize as w = (q - z) * s, fp8 and int8 as w = q * s: one f32 rounding of
 * the exact (q - z) times the scale widened to f32, which is what every backend computes.
 *
 * Activations: awq and gptq are weight-only (x in the compute dtype). Int8 W8A8 with dynamic
 * per-token int8 input activations (SmoothQuant checkpoints) quantizes x as vLLM does (act_int8;
 * the CPU backend's integer kernels). fp8 and the other schemes also quantize activations in
 * vLLM; pdserve multiplies their dequantized weights by x in the compute dtype instead (the
 * weight bytes, which bound decode, are the same; the values differ from vLLM's by the
 * activation rounding, docs/quantization.md).
 *
 * Design: the model loader (model.c) resolves each quantized linear into a pd_qweight whose
 * tensors are checked here once (presence, dtype, shape, with the tensor named); backends read
 * it only through pd_qweight_unpack / pd_qweight_dequant, so no backend knows a packing order.
 */
#ifndef PD_MODEL_QUANT_H
#define PD_MODEL_QUANT_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#include "model/safetensors.h"

#define PD_QUANT_MAX_IGNORE 16

/* Enums only grow at the end. */
typedef enum {
    PD_QUANT_NONE = 0,
    PD_QUANT_AWQ = 1,
    PD_QUANT_GPTQ = 2,
    PD_QUANT_FP8 = 3,
    PD_QUANT_COMPRESSED = 4, /* compressed-tensors */
} pd_quant_method;

/* What the values of a quantized linear are. */
typedef enum {
    PD_QKIND_INT = 0,  /* unsigned 0 .. 2^bits - 1 with a zero point per group (awq, gptq) */
    PD_QKIND_FP8 = 1,  /* float8 e4m3fn, scale per output row */
    PD_QKIND_INT8 = 2, /* signed -128 .. 127, scale per output row */
} pd_qkind;

typedef struct {
    pd_quant_method method;
    pd_qkind kind;
    int bits;            /* 4 or 8 */
    int64_t group_size;  /* INT: input rows per group; -1 = one group per output row */
    bool desc_act;       /* gptq: act order (g_idx required) */
    bool sym;            /* gptq: symmetric (zero 2^(bits-1)) */
    bool zero_minus_one; /* gptq v1: stored zero points are zero - 1 */
    bool act_static;     /* fp8: activation_scheme static (input_scale per linear) */
    bool per_channel;    /* fp8 / int8: weight_scale per output row (else per tensor) */
    bool act_int8;       /* int8 W8A8: input activations int8, dynamic, per token */
    /* compressed-tensors "ignore": module names, or "re:" + a regular expression (POSIX
       extended, matched whole) of modules left unquantized */
    char ignore[PD_QUANT_MAX_IGNORE][128];
    int n_ignore;
} pd_quant_config;

/* vLLM's --quantization spelling of a method: "awq", "gptq", "fp8", "compressed-tensors";
 * "none" for PD_QUANT_NONE. */
const char *pd_quant_method_name(pd_quant_method m);

/* Fills *out from config.json's "quantization_config" (qc; NULL or JSON null: PD_QUANT_NONE).
 * Every field is checked: an unknown quant_method, AWQ version other than gemm or bits other
 * than 4, GPTQ bits other than 4 or 8, compressed-tensors schemes other than int8 / fp8 W8A8,
 * ... give PD_EUNSUPPORTED or PD_EINVAL naming "quantization_config.<field>". */
int pd_quant_config_parse(const json_t *qc, pd_quant_config *out);

/* true when module (e.g. "model.layers.0.mlp.down_proj") is in the config's ignore list. */
bool pd_quant_ignored(const pd_quant_config *cfg, const char *module);

/* Checks --quantization (vLLM's spelling; "awq_marlin" and "gptq_marlin" count as awq and gptq,
 * "none" or NULL means "as the checkpoint says") against the checkpoint's config; PD_EINVAL
 * naming both when they disagree ("--quantization awq, but config.json's
 * quantization_config.quant_method is gptq"). */
int pd_quant_check_flag(const char *flag, const pd_quant_config *cfg, const char *config_file);

/* --kv-cache-dtype (vLLM's spelling): NULL or "auto" -> -1 (the KV cache holds the activation
 * dtype); "fp8" and "fp8_e4m3" -> PD_DTYPE_F8_E4M3. PD_EINVAL naming the flag otherwise
 * (fp8_e5m2 included: pdserve stores fp8 KV as e4m3). */
int pd_kv_cache_dtype_parse(const char *flag, int *out);

/* The fp8 KV cache's per-layer scales of a checkpoint (stored = value / scale), as vLLM reads
 * them: model.layers.{layer}.self_attn.k_scale and .v_scale, else the older
 * self_attn.k_proj.output_scale / v_proj.output_scale, else one self_attn.kv_scale for both;
 * 1.0 for what is absent. *found is set when any was stored. PD_EINVAL naming the tensor when
 * one is present but not a single positive finite float. */
int pd_quant_kv_scales(const pd_st *st, int layer, float *k_scale, float *v_scale, bool *found);

/* One quantized linear layer: logical shape (rows, cols) = (out, in), and its stored tensors
 * (absent ones zeroed). */
typedef struct pd_qweight {
    char prefix[128]; /* the module, e.g. "model.layers.0.self_attn.q_proj" */
    const pd_quant_config *cfg;
    int64_t rows, cols;
    int64_t group_size; /* INT: input rows per group (cols when per channel) */
    int64_t n_groups;   /* INT: cols / group_size */
    pd_tensor qweight, qzeros, scales, g_idx; /* INT */
    pd_tensor weight, weight_scale;           /* FP8, INT8 */
    pd_tensor input_scale;                    /* FP8 static */
    size_t nbytes;                            /* all stored bytes */
} pd_qweight;

/* Resolves prefix (e.g. "model.layers.0.self_attn.q_proj") of st as a quantized linear of shape
 * (rows, cols): every tensor present with its dtype and shape; a missing or misshapen one is
 * PD_ENOTFOUND / PD_EINVAL naming file, tensor, expected and actual shape. Also checks that
 * g_idx values are groups and every group of act order holds group_size rows. */
int pd_qweight_resolve(const pd_st *st, const pd_quant_config *cfg, const char *prefix,
                       int64_t rows, int64_t cols, pd_qweight *out);

/* The pd_tensor standing for q in pd_model_weights (pd_tensor.quant = q). */
pd_tensor pd_qweight_tensor(const pd_qweight *q);

/* The group of input column k (g_idx, else k / group_size). */
int64_t pd_qweight_group(const pd_qweight *q, int64_t k);

/* Rows [r0, r0 + nr), columns [c0, c0 + nc) as stored values and per-row scales:
 *   val   (nr, nc) uint8: INT the value 0 .. 2^bits - 1; FP8 the e4m3 byte; INT8 the int8's byte
 *   scale (nr, n_groups) f32 for INT, (nr) for FP8 / INT8 (a per-tensor scale repeated)
 *   zero  (nr, n_groups) f32 for INT (the zero point, an integer); NULL for the others.
 * Any of the three may be NULL to skip it. */
void pd_qweight_unpack(const pd_qweight *q, int64_t r0, int64_t nr, int64_t c0, int64_t nc,
                       uint8_t *val, float *scale, float *zero);

/* The dequantized f32 values of rows [r0, r0 + nr), columns [c0, c0 + nc) into out (nr, nc):
 * (q - z) * s or q * s as above. Allocates its scratch (the unpacked rows); PD_ENOMEM when
 * that fails. */
int pd_qweight_dequant(const pd_qweight *q, int64_t r0, int64_t nr, int64_t c0, int64_t nc,
                       float *out);

#endif
