/* Unit tests of common/model's dtypes: names, f16 and bf16 conversions (exhaustive over the 65536
 * f16 values, rounding), the bulk converters against the scalar ones. */
#include <float.h>
#include <stdlib.h>
#include <string.h>

#include "model_common.h"
#include "model/dtype.h"

/* ---- dtype -------------------------------------------------------------------------------- */

TEST(dtype_names_and_parse)
{
    ASSERT_EQ_INT(pd_dtype_size(PD_DTYPE_F32), 4);
    ASSERT_EQ_INT(pd_dtype_size(PD_DTYPE_F16), 2);
    ASSERT_EQ_INT(pd_dtype_size(PD_DTYPE_BF16), 2);
    ASSERT_STR_EQ(pd_dtype_name(PD_DTYPE_BF16), "bfloat16");
    ASSERT_STR_EQ(pd_dtype_name(PD_DTYPE_F16), "float16");
    ASSERT_STR_EQ(pd_dtype_st_name(PD_DTYPE_F32), "F32");
    ASSERT_STR_EQ(pd_dtype_st_name(PD_DTYPE_BF16), "BF16");
    pd_dtype d;
    ASSERT_OK(pd_dtype_parse("bfloat16", &d));
    ASSERT_EQ_INT(d, PD_DTYPE_BF16);
    ASSERT_OK(pd_dtype_parse("F16", &d));
    ASSERT_EQ_INT(d, PD_DTYPE_F16);
    ASSERT_OK(pd_dtype_parse("float32", &d));
    ASSERT_EQ_INT(d, PD_DTYPE_F32);
    ASSERT_ERR(pd_dtype_parse("int8", &d), PD_EUNSUPPORTED, "int8");
}

static int is_nan16(uint16_t h)
{
    return (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
}
static int is_nan_bf16(uint16_t h)
{
    return (h & 0x7f80) == 0x7f80 && (h & 0x7f);
}

TEST(dtype_f16_roundtrip_all_65536)
{
    for (uint32_t h = 0; h < 65536; h++) {
        float f = pd_f16_to_f32((uint16_t)h);
        uint16_t back = pd_f32_to_f16(f);
        if (is_nan16((uint16_t)h)) {
            ASSERT_MSG(isnan(f) && is_nan16(back), "f16 NaN 0x%04x not kept", h);
            ASSERT_EQ_INT(back & 0x8000, h & 0x8000);
        } else {
            ASSERT_MSG(back == h, "f16 0x%04x -> %.10g -> 0x%04x", h, (double)f, back);
        }
    }
    /* known values, independent of the conversion code */
    ASSERT(pd_f16_to_f32(0x3c00) == 1.0f);
    ASSERT(pd_f16_to_f32(0xc000) == -2.0f);
    ASSERT(pd_f16_to_f32(0x7bff) == 65504.0f);
    ASSERT(pd_f16_to_f32(0x0001) == ldexpf(1.0f, -24)); /* smallest subnormal */
    ASSERT(pd_f16_to_f32(0x03ff) == ldexpf(1023.0f, -24));
    ASSERT(pd_f16_to_f32(0x0400) == ldexpf(1.0f, -14));
    ASSERT(isinf(pd_f16_to_f32(0x7c00)) && pd_f16_to_f32(0xfc00) < 0);
    ASSERT(pd_f16_to_f32(0x8000) == 0.0f && signbit(pd_f16_to_f32(0x8000)));
}

/* Every midpoint between adjacent finite f16 values rounds to the even neighbour, and the
 * floats just below/above it round down/up: round-to-nearest-even checked exhaustively. */
TEST(dtype_f16_rounding_exhaustive)
{
    for (uint32_t h = 0; h < 0x7bff; h++) {
        float a = pd_f16_to_f32((uint16_t)h), b = pd_f16_to_f32((uint16_t)(h + 1));
        float mid = (float)(((double)a + (double)b) / 2); /* exact in f32 */
        uint16_t even = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;
        ASSERT_MSG(pd_f32_to_f16(mid) == even, "midpoint of 0x%04x: got 0x%04x", h,
                   pd_f32_to_f16(mid));
        ASSERT_MSG(pd_f32_to_f16(nextafterf(mid, 0.0f)) == h, "below midpoint of 0x%04x", h);
        ASSERT_MSG(pd_f32_to_f16(nextafterf(mid, INFINITY)) == h + 1, "above mid 0x%04x", h);
        ASSERT_MSG(pd_f32_to_f16(-mid) == (even | 0x8000), "negative midpoint 0x%04x", h);
    }
    /* overflow: 65520 is the midpoint between 65504 and 2^16 -> rounds to inf (even) */
    ASSERT_EQ_INT(pd_f32_to_f16(65519.996f), 0x7bff);
    ASSERT_EQ_INT(pd_f32_to_f16(65520.0f), 0x7c00);
    ASSERT_EQ_INT(pd_f32_to_f16(1e10f), 0x7c00);
    ASSERT_EQ_INT(pd_f32_to_f16(-1e10f), 0xfc00);
    ASSERT_EQ_INT(pd_f32_to_f16(INFINITY), 0x7c00);
    /* underflow: 2^-25 is the midpoint between 0 and the smallest subnormal -> 0 (even) */
    ASSERT_EQ_INT(pd_f32_to_f16(ldexpf(1.0f, -25)), 0x0000);
    ASSERT_EQ_INT(pd_f32_to_f16(ldexpf(1.5f, -25)), 0x0001);
    ASSERT_EQ_INT(pd_f32_to_f16(ldexpf(1.0f, -30)), 0x0000);
    ASSERT_EQ_INT(pd_f32_to_f16(-ldexpf(1.0f, -30)), 0x8000);
    ASSERT(is_nan16(pd_f32_to_f16(NAN)));
}

TEST(dtype_bf16_roundtrip_and_rounding)
{
    for (uint32_t h = 0; h < 65536; h++) {
        float f = pd_bf16_to_f32((uint16_t)h);
        uint16_t back = pd_f32_to_bf16(f);
        if (is_nan_bf16((uint16_t)h)) {
            ASSERT_MSG(isnan(f) && is_nan_bf16(back), "bf16 NaN 0x%04x not kept", h);
            continue;
        }
        ASSERT_MSG(back == h, "bf16 0x%04x -> 0x%04x", h, back);
        if ((h & 0x7fff) >= 0x7f7f) continue; /* no finite upper neighbour */
        uint32_t mid_bits = (h << 16) | 0x8000u;
        float mid = pd_f32_from_bits(mid_bits);
        uint16_t up = (uint16_t)(h + 1);
        uint16_t even = (h & 1) ? up : (uint16_t)h;
        ASSERT_MSG(pd_f32_to_bf16(mid) == even, "bf16 midpoint of 0x%04x", h);
        ASSERT_MSG(pd_f32_to_bf16(pd_f32_from_bits(mid_bits - 1)) == h, "below mid 0x%04x", h);
        ASSERT_MSG(pd_f32_to_bf16(pd_f32_from_bits(mid_bits + 1)) == up, "above mid 0x%04x", h);
    }
    ASSERT_EQ_INT(pd_f32_to_bf16(1.0f), 0x3f80);
    ASSERT_EQ_INT(pd_f32_to_bf16(3.0e38f), 0x7f62);
    ASSERT_EQ_INT(pd_f32_to_bf16(FLT_MAX), 0x7f80); /* rounds up to inf */
    ASSERT(is_nan_bf16(pd_f32_to_bf16(NAN)));
    ASSERT(is_nan_bf16(pd_f32_to_bf16(pd_f32_from_bits(0x7f800001u)))); /* sNaN stays NaN */
    ASSERT(is_nan_bf16(pd_f32_to_bf16(pd_f32_from_bits(0xffffffffu))));
}

TEST(dtype_bulk_matches_scalar)
{
    enum { N = 4099 };
    float src[N], out[N], back[N];
    uint16_t h[N];
    uint64_t s = 12345;
    for (int i = 0; i < N; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        src[i] = pd_f32_from_bits((uint32_t)(s >> 32));
        if (isnan(src[i])) src[i] = 1.5f;
    }
    pd_f32_to_f16_n(src, h, N);
    for (int i = 0; i < N; i++) ASSERT_EQ_INT(h[i], pd_f32_to_f16(src[i]));
    pd_f16_to_f32_n(h, out, N);
    pd_to_f32_n(PD_DTYPE_F16, h, back, N);
    for (int i = 0; i < N; i++) ASSERT(pd_f32_bits(out[i]) == pd_f32_bits(pd_f16_to_f32(h[i])));
    ASSERT(memcmp(out, back, sizeof out) == 0);
    pd_from_f32_n(PD_DTYPE_BF16, src, h, N);
    for (int i = 0; i < N; i++) ASSERT_EQ_INT(h[i], pd_f32_to_bf16(src[i]));
    pd_bf16_to_f32_n(h, out, N);
    for (int i = 0; i < N; i++) ASSERT(pd_f32_bits(out[i]) == (uint32_t)h[i] << 16);
    pd_to_f32_n(PD_DTYPE_F32, src, out, N);
    ASSERT(memcmp(out, src, sizeof out) == 0);
}
