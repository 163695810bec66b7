/* Element types: names, sizes, and the bulk conversion loops (the scalar conversions are
 * inline in dtype.h so kernels can use them; these loops are written to vectorize). */
#include "model/dtype.h"

#include "util/status.h"

size_t pd_dtype_size(pd_dtype dt)
{
    switch (dt) {
    case PD_DTYPE_F32: return 4;
    case PD_DTYPE_F16: return 2;
    case PD_DTYPE_BF16: return 2;
    case PD_DTYPE_I32: return 4;
    case PD_DTYPE_I8:
    case PD_DTYPE_U8:
    case PD_DTYPE_F8_E4M3: return 1;
    }
    return 0;
}

const char *pd_dtype_name(pd_dtype dt)
{
    switch (dt) {
    case PD_DTYPE_F32: return "float32";
    case PD_DTYPE_F16: return "float16";
    case PD_DTYPE_BF16: return "bfloat16";
    case PD_DTYPE_I32: return "int32";
    case PD_DTYPE_I8: return "int8";
    case PD_DTYPE_U8: return "uint8";
    case PD_DTYPE_F8_E4M3: return "float8_e4m3fn";
    }
    return "?";
}

const char *pd_dtype_st_name(pd_dtype dt)
{
    switch (dt) {
    case PD_DTYPE_F32: return "F32";
    case PD_DTYPE_F16: return "F16";
    case PD_DTYPE_BF16: return "BF16";
    case PD_DTYPE_I32: return "I32";
    case PD_DTYPE_I8: return "I8";
    case PD_DTYPE_U8: return "U8";
    case PD_DTYPE_F8_E4M3: return "F8_E4M3";
    }
    return "?";
}

int pd_dtype_parse(const char *s, pd_dtype *out)
{
    static const struct {
        const char *name;
        pd_dtype dt;
    } names[] = {
        {"float32", PD_DTYPE_F32}, {"F32", PD_DTYPE_F32},     {"float", PD_DTYPE_F32},
        {"fp32", PD_DTYPE_F32},    {"float16", PD_DTYPE_F16}, {"F16", PD_DTYPE_F16},
        {"half", PD_DTYPE_F16},    {"fp16", PD_DTYPE_F16},    {"bfloat16", PD_DTYPE_BF16},
        {"BF16", PD_DTYPE_BF16},   {"bf16", PD_DTYPE_BF16},
    };
    if (!s) return pd_error(PD_EINVAL, "dtype: missing");
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (strcmp(s, names[i].name) == 0) {
            *out = names[i].dt;
            return PD_OK;
        }
    }
    return pd_error(PD_EUNSUPPORTED,
                    "unsupported dtype \"%s\" (expected float32, float16 or bfloat16)", s);
}

/* Blocks of a fixed 16 elements: gcc's -O2 cost model ("very cheap") vectorizes loops only
 * when no scalar epilogue is needed, which a constant trip count guarantees. */
#define BLOCKED(n, body)                                                                           \
    do {                                                                                           \
        size_t i_ = 0;                                                                             \
        for (; i_ + 16 <= (n); i_ += 16)                                                           \
            for (size_t k_ = 0; k_ < 16; k_++) {                                                   \
                size_t i = i_ + k_;                                                                \
                body;                                                                              \
            }                                                                                      \
        for (size_t i = i_; i < (n); i++) body;                                                    \
    } while (0)

void pd_bf16_to_f32_n(const uint16_t *restrict src, float *restrict dst, size_t n)
{
    BLOCKED(n, dst[i] = pd_bf16_to_f32(src[i]));
}

void pd_f32_to_bf16_n(const float *restrict src, uint16_t *restrict dst, size_t n)
{
    BLOCKED(n, dst[i] = pd_f32_to_bf16(src[i]));
}

void pd_f16_to_f32_n(const uint16_t *restrict src, float *restrict dst, size_t n)
{
    BLOCKED(n, dst[i] = pd_f16_to_f32(src[i]));
}

void pd_f32_to_f16_n(const float *restrict src, uint16_t *restrict dst, size_t n)
{
    BLOCKED(n, dst[i] = pd_f32_to_f16(src[i]));
}

void pd_to_f32_n(pd_dtype src_dtype, const void *src, float *dst, size_t n)
{
    switch (src_dtype) {
    case PD_DTYPE_F32: memcpy(dst, src, n * sizeof(float)); break;
    case PD_DTYPE_F16: pd_f16_to_f32_n(src, dst, n); break;
    case PD_DTYPE_BF16: pd_bf16_to_f32_n(src, dst, n); break;
    case PD_DTYPE_I32: BLOCKED(n, dst[i] = (float)((const int32_t *)src)[i]); break;
    case PD_DTYPE_I8: BLOCKED(n, dst[i] = (float)((const int8_t *)src)[i]); break;
    case PD_DTYPE_U8: BLOCKED(n, dst[i] = (float)((const uint8_t *)src)[i]); break;
    case PD_DTYPE_F8_E4M3: BLOCKED(n, dst[i] = pd_f8e4m3_to_f32(((const uint8_t *)src)[i])); break;
    }
}

void pd_from_f32_n(pd_dtype dst_dtype, const float *src, void *dst, size_t n)
{
    switch (dst_dtype) {
    case PD_DTYPE_F32: memcpy(dst, src, n * sizeof(float)); break;
    case PD_DTYPE_F16: pd_f32_to_f16_n(src, dst, n); break;
    case PD_DTYPE_BF16: pd_f32_to_bf16_n(src, dst, n); break;
    default: break;
    }
}
