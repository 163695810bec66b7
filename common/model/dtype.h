/* Element types of checkpoint tensors and bit-exact conversions between them.
 *
 * Checkpoints store weights as float32, float16 (IEEE binary16) or bfloat16. Backends either
 * use them as stored or convert at load, so the conversions here are exact where exactness is
 * defined: f32 -> bf16/f16 round to nearest, ties to even; NaN stays NaN (quiet, sign kept);
 * f16 subnormals are produced and read correctly; overflow to f16 gives +-inf.
 * Scalar conversions are static inline (hot loops call them); the bulk versions are plain
 * loops over them that the compiler vectorizes.
 */
#ifndef PD_MODEL_DTYPE_H
#define PD_MODEL_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* On-disk/wire values: only grow at the end. The first PD_DTYPE_COUNT are the float dtypes
 * weights, activations and the KV cache are computed in; the others are the stored parts of
 * quantized checkpoints (packed int32 nibbles, int8 / uint8 values, float8 e4m3 weights), which
 * only model/quant.h reads and no --dtype names. */
typedef enum {
    PD_DTYPE_F32 = 0,
    PD_DTYPE_F16 = 1,
    PD_DTYPE_BF16 = 2,
    PD_DTYPE_I32 = 3,
    PD_DTYPE_I8 = 4,
    PD_DTYPE_U8 = 5,
    PD_DTYPE_F8_E4M3 = 6, /* float8_e4m3fn: bias 7, no infinities, 0x7f/0xff NaN, max 448 */
} pd_dtype;

#define PD_DTYPE_COUNT     3 /* the float dtypes: F32, F16, BF16 */
#define PD_DTYPE_ALL_COUNT 7

/* 1 for F32, F16 and BF16. */
static inline int pd_dtype_is_float(pd_dtype dt)
{
    return dt == PD_DTYPE_F32 || dt == PD_DTYPE_F16 || dt == PD_DTYPE_BF16;
}

/* Bytes per element (4, 2, 2, 4, 1, 1, 1); 0 for an out-of-range value. */
size_t pd_dtype_size(pd_dtype dt);
/* torch_dtype spelling: "float32", "float16", "bfloat16", "int32", "int8", "uint8",
 * "float8_e4m3fn" ("?" for an out-of-range value). */
const char *pd_dtype_name(pd_dtype dt);
/* safetensors spelling: "F32", "F16", "BF16", "I32", "I8", "U8", "F8_E4M3". */
const char *pd_dtype_st_name(pd_dtype dt);
/* Accepts the float dtypes only, in either spelling above, plus "float", "half", "fp32", "fp16",
 * "bf16" (case-sensitive). Returns PD_OK, or PD_EUNSUPPORTED with a message naming s. */
int pd_dtype_parse(const char *s, pd_dtype *out);

/* ---- scalar conversions ------------------------------------------------------------------ */

static inline uint32_t pd_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float pd_f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* bfloat16 is the high half of a float32: exact widening. */
static inline float pd_bf16_to_f32(uint16_t h)
{
    return pd_f32_from_bits((uint32_t)h << 16);
}

/* Round to nearest even; NaN -> quiet NaN with the same sign. */
static inline uint16_t pd_f32_to_bf16(float f)
{
    uint32_t u = pd_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* IEEE binary16 -> float32, exact (subnormals, inf, NaN payload kept). Written as selects,
 * not branches, so loops over it vectorize. */
static inline float pd_f16_to_f32(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t em = h & 0x7fffu;
    const uint32_t normal = (em << 13) + 0x38000000u;              /* exponent bias 15 -> 127 */
    const uint32_t infnan = (em << 13) | 0x7f800000u;              /* payload kept */
    const float sub = (float)(int32_t)em * 5.9604644775390625e-8f; /* em * 2^-24, exact */
    uint32_t m = 0u - (uint32_t)(em >= 0x400u);                    /* all ones when normal */
    uint32_t r = (normal & m) | (pd_f32_bits(sub) & ~m);
    m = 0u - (uint32_t)(em >= 0x7c00u);
    r = (infnan & m) | (r & ~m);
    return pd_f32_from_bits(sign | r);
}

/* float32 -> IEEE binary16, round to nearest even; overflow -> inf; NaN -> quiet NaN.
 * Results below the smallest normal half come from one float addition: 0.5f has a unit in the
 * last place of 2^-24, the half subnormal step, so the FPU's own rounding gives
 * round-to-nearest-even of |f| / 2^-24. Selects, not branches, so loops vectorize. */
static inline uint16_t pd_f32_to_f16(float f)
{
    const uint32_t u = pd_f32_bits(f);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const uint32_t a = u & 0x7fffffffu;
    uint32_t v = a - 0x38000000u; /* exponent bias 127 -> 15 */
    v += 0xfffu + ((v >> 13) & 1u);
    const uint32_t normal = v >> 13;
    const uint32_t sub = pd_f32_bits(pd_f32_from_bits(a) + 0.5f) - 0x3f000000u;
    /* masks (all ones / zero) rather than ?: so the compiler keeps straight-line code */
    uint32_t m = 0u - (uint32_t)(a >= 0x38800000u); /* >= 2^-14: a normal half */
    uint32_t r = (normal & m) | (sub & ~m);
    m = 0u - (uint32_t)(a >= 0x477ff000u); /* >= 65520: rounds to inf */
    r = (0x7c00u & m) | (r & ~m);
    m = 0u - (uint32_t)(a > 0x7f800000u); /* NaN: quiet, top payload bits kept */
    r = ((0x7e00u | ((a >> 13) & 0x3ffu)) & m) | (r & ~m);
    return (uint16_t)(sign | r);
}

/* float8 e4m3fn -> float32, exact: the byte's exponent and mantissa moved into a float's
 * (subnormals scaled by their exponent), NaN for 0x7f / 0xff. */
static inline float pd_f8e4m3_to_f32(uint8_t b)
{
    const uint32_t sign = (uint32_t)(b & 0x80u) << 24;
    const uint32_t em = b & 0x7fu;
    if (em == 0x7fu) return pd_f32_from_bits(sign | 0x7fc00000u);
    float mag = em >= 8u ? pd_f32_from_bits(((em + (120u << 3)) << 20)) /* bias 7 -> 127 */
                         : (float)em * 0.001953125f;                    /* em * 2^-9 */
    return pd_f32_from_bits(sign | pd_f32_bits(mag));
}

/* float32 -> float8 e4m3fn, round to nearest even, saturating to +-448 (what torch's
 * to(float8_e4m3fn) does after a clamp, as quantizers write checkpoints); NaN -> 0x7f. */
static inline uint8_t pd_f32_to_f8e4m3(float f)
{
    const uint32_t u = pd_f32_bits(f);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    const uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint8_t)(sign | 0x7fu);
    if (a >= 0x43e00000u) return (uint8_t)(sign | 0x7eu); /* >= 448 */
    if (a < 0x3c800000u) {                                /* < 2^-6: subnormal steps of 2^-9 */
        /* |f| / 2^-9 (below 8) rounded to nearest even by the FPU: next to 2^23 a float's
           unit in the last place is 1 */
        float q = pd_f32_from_bits(a) * 512.0f + 8388608.0f;
        return (uint8_t)(sign | (uint8_t)(pd_f32_bits(q) - 0x4b000000u));
    }
    uint32_t v = a - (120u << 23); /* exponent bias 127 -> 7 */
    v += 0x7ffffu + ((v >> 20) & 1u);
    uint32_t r = v >> 20;
    if (r > 0x7eu) r = 0x7eu;
    return (uint8_t)(sign | r);
}

/* ---- bulk conversions (n elements; src and dst must not overlap) -------------------------- */

void pd_bf16_to_f32_n(const uint16_t *src, float *dst, size_t n);
void pd_f32_to_bf16_n(const float *src, uint16_t *dst, size_t n);
void pd_f16_to_f32_n(const uint16_t *src, float *dst, size_t n);
void pd_f32_to_f16_n(const float *src, uint16_t *dst, size_t n);
/* Any stored dtype -> float32 (a copy for F32; integers by value). */
void pd_to_f32_n(pd_dtype src_dtype, const void *src, float *dst, size_t n);
/* float32 -> a float dtype (a copy for F32); other dtypes are left untouched. */
void pd_from_f32_n(pd_dtype dst_dtype, const float *src, void *dst, size_t n);

#endif
