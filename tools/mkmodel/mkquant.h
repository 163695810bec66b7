/* pd-mkmodel --quantize: round-to-nearest quantization of a linear layer and the stored tensors
 * of the checkpoint formats pdserve reads (AutoAWQ GEMM, AutoGPTQ v1 / GPTQModel v2, fp8,
 * compressed-tensors int8 W8A8), with their config.json "quantization_config".
 *
 * Design: mkq_quantize turns one (out, in) f32 weight into a format-neutral mkq_linear (a byte
 * per value, scales, zero points, the group of each input row); one packer per format lays it
 * out as that format's tensors, one tensor per call, as the safetensors writer asks for them.
 * The flags are parsed and cross-checked here, so every rule about them is in one place.
 */
#ifndef PD_MKMODEL_MKQUANT_H
#define PD_MKMODEL_MKQUANT_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#include "model/dtype.h"
#include "util/threadpool.h"

typedef enum { MKQ_NONE = 0, MKQ_AWQ, MKQ_GPTQ, MKQ_FP8, MKQ_W8A8 } mkq_method;

typedef struct {
    mkq_method method;
    int bits;           /* awq 4; gptq 4 or 8 (fp8 and w8a8: unused, always 8) */
    int64_t group_size; /* awq, gptq: input rows per group; -1 = one group (gptq) */
    bool desc_act;      /* gptq: act order, groups from a pseudo-random permutation */
    bool sym;           /* gptq: symmetric, zero point 2^(bits-1) */
    bool v2;            /* gptq: checkpoint_format gptq_v2 (zero points stored as they are) */
    bool act_static;    /* fp8: activation_scheme static (input_scale written) */
    unsigned given;     /* the flags given (bit i: k_flags[i] in mkquant.c), for mkq_check */
} mkq_opts;

/* No quantization; awq/gptq defaults bits 4, group 128, asymmetric, gptq v1, fp8 dynamic. */
mkq_opts mkq_default_opts(void);

/* "awq", "gptq", "fp8", "w8a8" ("none" for MKQ_NONE), as --quantize spells them. */
const char *mkq_method_name(mkq_method m);
/* Parses one flag (--quantize, --bits, --group-size, --desc-act, --sym, --checkpoint-format,
 * --activation-scheme; arg NULL for the switches) into o; PD_EINVAL naming the flag. */
int mkq_parse(mkq_opts *o, const char *flag, const char *arg);
/* The flags together: each one given only with --quantize and a method it applies to, and a
 * value that method takes (--bits 8 with awq is refused); PD_EINVAL naming the flag. */
int mkq_check(const mkq_opts *o);
/* A linear "prefix" of (rows, cols) = (out, in) that o cannot store (--group-size not dividing
 * in, out or in not a whole number of int32 words): PD_EINVAL naming the flag and the tensor. */
int mkq_check_linear(const mkq_opts *o, const char *prefix, int64_t rows, int64_t cols);

/* config.json's "quantization_config" for o (a new reference; NULL when out of memory). */
json_t *mkq_config_json(const mkq_opts *o);

/* ---- stored tensors ------------------------------------------------------------------------ */

#define MKQ_MAX_PARTS 4

typedef enum {
    MKQ_QWEIGHT = 0, /* awq, gptq */
    MKQ_QZEROS,
    MKQ_SCALES,
    MKQ_GIDX,    /* gptq */
    MKQ_WEIGHT,  /* fp8, w8a8 */
    MKQ_WSCALE,  /* fp8, w8a8 */
    MKQ_INSCALE, /* fp8 static */
} mkq_part;

typedef struct {
    mkq_part part;
    const char *suffix; /* "qweight": the tensor is "<prefix>.qweight" */
    pd_dtype dtype;
    int ndim;
    int64_t shape[2];
} mkq_tensor;

/* The stored tensors of a quantized (rows, cols) linear, in file order, into out; returns how
 * many (at most MKQ_MAX_PARTS). Shapes as mkq_check_linear accepted them. */
int mkq_tensors(const mkq_opts *o, int64_t rows, int64_t cols, mkq_tensor *out);

/* One quantized linear in a format-neutral form. Owns its buffers (mkq_linear_free). */
typedef struct {
    int64_t rows, cols;           /* out, in */
    int64_t group_size, n_groups; /* awq, gptq: group_size * n_groups == cols */
    uint8_t *val;      /* (rows, cols): awq/gptq 0 .. 2^bits - 1, fp8 the e4m3 byte, w8a8 int8 */
    uint16_t *scale16; /* (n_groups, rows) f16 bits: awq, gptq */
    uint8_t *zero;     /* (n_groups, rows) the zero point itself: awq, gptq */
    int32_t *order;    /* (cols): the input rows of group g are order[g*G .. (g+1)*G): awq, gptq */
    int32_t *g_idx;    /* (cols): group of each input row (the inverse of order): awq, gptq */
    float *scale32;    /* (rows) f32: w8a8 per row; fp8 the tensor's scale in every row */
} mkq_linear;

/* Quantizes w (rows, cols) f32 into q (its old buffers freed first), split over pool. key seeds
 * the act-order permutation (gptq --desc-act), so it is a function of seed and tensor name.
 * PD_ENOMEM when an allocation fails (q is then empty). */
int mkq_quantize(const mkq_opts *o, const float *w, int64_t rows, int64_t cols, uint64_t key,
                 pd_threadpool *pool, mkq_linear *q);
void mkq_linear_free(mkq_linear *q);

/* Writes part of q, in its stored layout (mkq_tensors), to buf. */
void mkq_pack(const mkq_opts *o, const mkq_linear *q, mkq_part part, void *buf);

#endif
