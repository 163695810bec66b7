/* SIMD kernels of the CPU backend: matrix products y = x . W^T with W (out, in) row-major as
 * stored in checkpoints, for f32, bf16 and f16 weights, in a portable scalar version and an
 * AVX-512 version chosen at run time; and the AVX-512 attention inner loop.
 *
 * Design: "dot-product" tiles. Both x rows and W rows are contiguous along the reduction
 * dimension K, so an (M x N) register tile keeps M*N 16-lane accumulators, loads M x vectors
 * and N W vectors per 16 k, and reduces each accumulator once at the end. Each output element
 * therefore sees the same sequence of operations (lane l sums k = l, l+16, ... in increasing
 * order, then a fixed reduction tree) whatever the tile shape, the batch size n, or the thread
 * split: a row's result is bit-identical alone or in a batch, in one prefill chunk or many.
 * That is the determinism the engine needs, and why no BLAS GEMM is used here (OpenBLAS picks
 * a GEMV path for one row and a blocked GEMM for many). bf16/f16 weights are widened to f32 in
 * registers (exact), so they cost half the memory traffic and give the same result as
 * converting at load.
 *
 * The bf16 compute mode (compute_dtype BF16, vLLM's --dtype bfloat16) has one more kernel when
 * the CPU has avx512_bf16: the caller rounds each x row to bf16 once per matmul
 * (cpu_round_bf16_avx512bf16) and the same tiles use vdpbf16ps, whose lane l adds the two
 * products of k = 2l, 2l+1 of each 32-element step into an f32 accumulator; half the
 * instructions of the widening kernel and no widening. The same fixed order per output element
 * holds, so it is batch-invariant too. Only its functions are compiled for avx512_bf16 (a target
 * attribute), so the file builds with any compiler and runs on any CPU.
 */
#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu_internal.h"
#include "model/dtype.h"
#include "pd_config.h"

int cpu_have_avx512(void)
{
#if defined(__x86_64__)
    __builtin_cpu_init();
    /* F16C from CPUID leaf 1 (ECX bit 29): clang before 15 has no "f16c" for
       __builtin_cpu_supports, and a VM may hide it while showing AVX-512F */
    unsigned a, b, c, d;
    bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
    return __builtin_cpu_supports("avx512f") && f16c;
#else
    return 0;
#endif
}

int cpu_have_avx512bf16(void)
{
#if defined(__x86_64__) && PD_HAVE_AVX512BF16
    return cpu_have_avx512() && __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

int cpu_have_avx512vnni(void)
{
#if defined(__x86_64__)
    return cpu_have_avx512() && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}

/* ---- W8A8 ------------------------------------------------------------------------------------ */

void cpu_quant_row_i8(const float *x, size_t K, size_t ld, uint8_t *row)
{
    float amax = 0.0f;
    for (size_t k = 0; k < K; k++) amax = fmaxf(amax, fabsf(x[k]));
    float sx = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    memcpy(row, &sx, sizeof sx);
    uint8_t *q = row + CPU_XQ_HEAD;
    for (size_t k = 0; k < K; k++) {
        float v = nearbyintf(x[k] * inv); /* the default rounding mode: half to even */
        v = v > 127.0f ? 127.0f : v < -128.0f ? -128.0f : v;
        q[k] = (uint8_t)((int)v + 128);
    }
    memset(q + K, 128, ld - K);
}

/* The row's sum and the output element, shared by both kernels. */
static inline float i8a8_out(int64_t dot_u, const struct pd_weight *w, size_t j, float sx,
                             const float *bias)
{
    int64_t dot = dot_u - 128 * (int64_t)w->wsum[j];
    float s = (float)dot * sx * w->scale[j];
    return bias ? s + bias[j] : s;
}

void cpu_mm_i8a8_scalar(const uint8_t *xq, size_t n, size_t ldx, const struct pd_weight *w,
                        size_t j0, size_t j1, const float *bias, float *y, size_t ldy)
{
    for (size_t i = 0; i < n; i++) {
        const uint8_t *row = xq + i * ldx;
        float sx;
        memcpy(&sx, row, sizeof sx);
        for (size_t j = j0; j < j1; j++) {
            const int8_t *wr = (const int8_t *)w->data + j * w->ld;
            int64_t d = 0;
            for (size_t k = 0; k < w->cols; k++) d += (int64_t)row[CPU_XQ_HEAD + k] * wr[k];
            y[i * ldy + j] = i8a8_out(d, w, j, sx, bias);
        }
    }
}

/* ---- scalar ---------------------------------------------------------------------------------- */

/* 8 partial sums over k = l mod 8, then a fixed pairwise tree. */
static float dot_w_scalar(const float *x, const void *w, pd_dtype dt, size_t K)
{
    float s[8] = {0};
    size_t k = 0;
    if (dt == PD_DTYPE_F32) {
        const float *wf = w;
        for (; k + 8 <= K; k += 8)
            for (int l = 0; l < 8; l++) s[l] += x[k + l] * wf[k + l];
        for (; k < K; k++) s[k & 7] += x[k] * wf[k];
    } else if (dt == PD_DTYPE_BF16) {
        const uint16_t *wh = w;
        for (; k + 8 <= K; k += 8)
            for (int l = 0; l < 8; l++) s[l] += x[k + l] * pd_bf16_to_f32(wh[k + l]);
        for (; k < K; k++) s[k & 7] += x[k] * pd_bf16_to_f32(wh[k]);
    } else {
        const uint16_t *wh = w;
        for (; k + 8 <= K; k += 8)
            for (int l = 0; l < 8; l++) s[l] += x[k + l] * pd_f16_to_f32(wh[k + l]);
        for (; k < K; k++) s[k & 7] += x[k] * pd_f16_to_f32(wh[k]);
    }
    return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

/* Stored value k of a quantized row, as f32. */
static float q_value(cpu_wq q, const uint8_t *row, size_t k)
{
    switch (q) {
    case CPU_WQ_U4: {
        uint8_t b = row[(k / 128) * 64 + 4 * (k % 16) + (k % 128) / 32];
        return (float)((k % 128) / 16 % 2 ? b >> 4 : b & 15);
    }
    case CPU_WQ_U8: return (float)row[k];
    case CPU_WQ_I8:
    case CPU_WQ_I8A8: return (float)(int8_t)row[k];
    case CPU_WQ_FP8: return pd_f8e4m3_to_f32(row[k]);
    case CPU_WQ_NONE: break;
    }
    return 0.0f;
}

/* dot_w_scalar's order with row j of a quantized weight dequantized on the fly. */
static float dot_q_scalar(const float *x, const struct pd_weight *w, size_t j)
{
    const uint8_t *row = (const uint8_t *)w->data + j * cpu_wq_row_bytes(w->q, w->ld);
    const float *sc = w->scale + j * w->ng, *zp = w->zero + j * w->ng;
    float s[8] = {0};
    for (size_t k = 0; k < w->cols; k++) {
        size_t g = k / w->gs;
        s[k & 7] += x[k] * ((q_value(w->q, row, k) - zp[g]) * sc[g]);
    }
    return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

void cpu_mm_scalar(const float *x, size_t n, size_t ldx, const struct pd_weight *w, size_t j0,
                   size_t j1, const float *bias, float *y, size_t ldy)
{
    size_t es = pd_dtype_size(w->dtype);
    for (size_t i = 0; i < n; i++) {
        const float *xi = x + i * ldx;
        for (size_t j = j0; j < j1; j++) {
            float s =
                w->q ? dot_q_scalar(xi, w, j)
                     : dot_w_scalar(xi, (const char *)w->data + j * w->ld * es, w->dtype, w->cols);
            if (bias) s += bias[j];
            y[i * ldy + j] = s;
        }
    }
}

float cpu_dot_scalar(const float *a, const float *b, size_t n)
{
    return dot_w_scalar(a, b, PD_DTYPE_F32, n);
}

void cpu_axpy_scalar(float *y, float s, const float *x, size_t n)
{
    for (size_t k = 0; k < n; k++) y[k] += s * x[k];
}

/* ---- AVX-512 --------------------------------------------------------------------------------- */
#if defined(__x86_64__)

#define AVX512 __attribute__((target("avx512f,f16c,fma")))
/* The tiles inlined into cpu_mm_avx512 are not instrumented either (see there): instrumented
 * code inlined into it would poison its scopes' stack and never unpoison the frame. */
#define INLINE_AVX512                                                                              \
    static inline __attribute__((always_inline, no_sanitize_address, target("avx512f,f16c,fma")))

/* 16 weights at element k of row p, widened to f32. dt is a compile-time constant at every
 * call site after inlining. */
INLINE_AVX512 __m512 load_w16(const void *p, pd_dtype dt, size_t k)
{
    if (dt == PD_DTYPE_F32) return _mm512_loadu_ps((const float *)p + k);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + k));
    if (dt == PD_DTYPE_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* Fixed reduction tree: halves 256, 128, 64, 32 (what _mm512_reduce_add_ps does, spelled out
 * so the order is ours). */
INLINE_AVX512 float hsum16(__m512 v)
{
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    __m128 d = _mm_add_ss(c, _mm_movehdup_ps(c));
    return _mm_cvtss_f32(d);
}

/* Small loops over the register tile must be unrolled completely so the accumulators stay in
 * registers (GCC's -O2 heuristics would not). */
#define UNROLL _Pragma("GCC unroll 8")

#define MT_MAX 6 /* x rows per tile */
#define NT_MAX 8 /* W rows per tile */

/* One (M x N) tile: x rows [0, M) (stride ldx), W rows [j, j + N) of wt. M, N and dt are
 * constants at each call site, so the accumulators live in registers. */
INLINE_AVX512 void tile(const float *x, size_t ldx, const struct pd_weight *wt, size_t j0,
                        pd_dtype dt, size_t K, const float *bias, float *y, size_t ldy, const int M,
                        const int N)
{
    __m512 acc[MT_MAX][NT_MAX];
    const size_t es = dt == PD_DTYPE_F32 ? 4 : 2, ldw = wt->ld;
    const char *w = (const char *)wt->data + j0 * ldw * es;
    UNROLL for (int i = 0; i < M; i++) UNROLL for (int j = 0; j < N; j++) acc[i][j] =
        _mm512_setzero_ps();
    size_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 wv[NT_MAX];
        UNROLL for (int j = 0; j < N; j++) wv[j] =
            load_w16((const char *)w + (size_t)j * ldw * es, dt, k);
        UNROLL for (int i = 0; i < M; i++)
        {
            __m512 xv = _mm512_loadu_ps(x + (size_t)i * ldx + k);
            UNROLL for (int j = 0; j < N; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    if (k < K) {
        /* x tail masked to zero; W rows are zero-padded to ldw, so a full load is in bounds. */
        __mmask16 m = (__mmask16)((1u << (K - k)) - 1u);
        __m512 wv[NT_MAX];
        UNROLL for (int j = 0; j < N; j++) wv[j] =
            load_w16((const char *)w + (size_t)j * ldw * es, dt, k);
        UNROLL for (int i = 0; i < M; i++)
        {
            __m512 xv = _mm512_maskz_loadu_ps(m, x + (size_t)i * ldx + k);
            UNROLL for (int j = 0; j < N; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    UNROLL for (int i = 0; i < M; i++) UNROLL for (int j = 0; j < N; j++)
    {
        float s = hsum16(acc[i][j]);
        if (bias) s += bias[j];
        y[(size_t)i * ldy + j] = s;
    }
}

/* 16 stored values of a U8, I8 or FP8 row p from column k (a multiple of 16), as f32. FP8 comes
 * out as the f16 whose bits are the byte's shifted into place: the value times 2^-8 (exact,
 * subnormals included); tile_q's scale carries the 2^8. */
INLINE_AVX512 __m512 load_q16(const uint8_t *p, cpu_wq q, size_t k)
{
    __m128i b = _mm_loadu_si128((const __m128i *)(p + k));
    if (q == CPU_WQ_U8) return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
    if (q == CPU_WQ_I8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    __m256i h = _mm256_cvtepu8_epi16(b);
    __m256i em = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7f)), 7);
    __m256i sg = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8);
    return _mm512_cvtph_ps(_mm256_or_si256(em, sg));
}

/* 16 weights of a U4 row from column k (a multiple of 16): the 128-column block's words shifted
 * so the chunk's nibbles are each lane's low 4 bits, which are all vpermps reads of an index,
 * looked up in the group's table t[v] = (v - z) * s. */
INLINE_AVX512 __m512 load_u4_lut(const uint8_t *p, size_t k, __m512 t)
{
    __m512i words = _mm512_loadu_si512((const void *)(p + (k / 128) * 64));
    __m512i idx = _mm512_srlv_epi32(words, _mm512_set1_epi32((int)(4 * ((k % 128) / 16))));
    return _mm512_permutexvar_ps(idx, t);
}

/* 16 weights of a quantized row p from column k, dequantized: U4 through its table t (passed as
 * s), the others as (v - z) * s. */
INLINE_AVX512 __m512 deq16(const uint8_t *p, cpu_wq q, size_t k, __m512 s, __m512 z)
{
    if (q == CPU_WQ_U4) return load_u4_lut(p, k, s);
    return _mm512_mul_ps(_mm512_sub_ps(load_q16(p, q, k), z), s);
}

/* tile for a quantized weight: each 16 weights dequantized in registers as (v - z) * s, one
 * rounding (U4: from a 16-entry table of those products per row and group), then the same
 * fmadd sequence per accumulator as tile (lane l over k = l, l + 16, ..., masked x at the tail),
 * group by group. Q is a constant at each call site. */
INLINE_AVX512 void tile_q(const float *x, size_t ldx, const struct pd_weight *wt, size_t j0,
                          cpu_wq q, size_t K, const float *bias, float *y, size_t ldy, const int M,
                          const int N)
{
    __m512 acc[MT_MAX][NT_MAX];
    const size_t rb = cpu_wq_row_bytes(q, wt->ld), gs = wt->gs, ng = wt->ng;
    const uint8_t *w = (const uint8_t *)wt->data + j0 * rb;
    const float *sc = wt->scale + j0 * ng, *zp = wt->zero + j0 * ng;
    const float unit = q == CPU_WQ_FP8 ? 256.0f : 1.0f;
    UNROLL for (int i = 0; i < M; i++) UNROLL for (int j = 0; j < N; j++) acc[i][j] =
        _mm512_setzero_ps();
    size_t k = 0;
    for (size_t g = 0; k < K; g++) {
        __m512 sv[NT_MAX], zv[NT_MAX], wv[NT_MAX];
        UNROLL for (int j = 0; j < N; j++)
        {
            sv[j] = _mm512_set1_ps(sc[(size_t)j * ng + g] * unit);
            zv[j] = _mm512_set1_ps(zp[(size_t)j * ng + g]);
            if (q == CPU_WQ_U4) /* the table: v = 0 .. 15 */
                sv[j] = _mm512_mul_ps(_mm512_sub_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                                   11, 12, 13, 14, 15),
                                                    zv[j]),
                                      sv[j]);
        }
        const size_t ke = (g + 1) * gs < K ? (g + 1) * gs : K;
        if (q == CPU_WQ_U4 && M <= 2) /* decode: whole 128-column blocks, one load, shifts by
                                         constants (more registers than the prefill tiles have;
                                         the same operations per accumulator either way) */
            for (; k + 128 <= ke && k % 128 == 0; k += 128) {
                UNROLL for (int c = 0; c < 8; c++)
                {
                    UNROLL for (int j = 0; j < N; j++) wv[j] = _mm512_permutexvar_ps(
                        _mm512_srli_epi32(
                            _mm512_load_si512((const void *)(w + (size_t)j * rb + k / 2)),
                            (unsigned)(4 * c)),
                        sv[j]);
                    UNROLL for (int i = 0; i < M; i++)
                    {
                        __m512 xv = _mm512_loadu_ps(x + (size_t)i * ldx + k + 16 * (size_t)c);
                        UNROLL for (int j = 0; j < N; j++) acc[i][j] =
                            _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
                    }
                }
            }
        for (; k + 16 <= ke; k += 16) {
            UNROLL for (int j = 0; j < N; j++) wv[j] =
                deq16(w + (size_t)j * rb, q, k, sv[j], zv[j]);
            UNROLL for (int i = 0; i < M; i++)
            {
                __m512 xv = _mm512_loadu_ps(x + (size_t)i * ldx + k);
                UNROLL for (int j = 0; j < N; j++) acc[i][j] =
                    _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
            }
        }
        if (k < ke) { /* K's tail (the last group): x masked, W padded */
            __mmask16 m = (__mmask16)((1u << (ke - k)) - 1u);
            UNROLL for (int j = 0; j < N; j++) wv[j] =
                deq16(w + (size_t)j * rb, q, k, sv[j], zv[j]);
            UNROLL for (int i = 0; i < M; i++)
            {
                __m512 xv = _mm512_maskz_loadu_ps(m, x + (size_t)i * ldx + k);
                UNROLL for (int j = 0; j < N; j++) acc[i][j] =
                    _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
            }
            k = ke;
        }
    }
    UNROLL for (int i = 0; i < M; i++) UNROLL for (int j = 0; j < N; j++)
    {
        float s = hsum16(acc[i][j]);
        if (bias) s += bias[j];
        y[(size_t)i * ldy + j] = s;
    }
}

/* Row tiles of up to M_ x rows against W rows [j0, j1) of w in tiles of N_ (remainder 1 by 1),
 * each by TILE (tile, tile_q or tile_bf16). */
#define TILE_ROWS(TILE, M_, N_, DT)                                                                \
    do {                                                                                           \
        size_t j = j0;                                                                             \
        for (; j + (N_) <= j1; j += (N_))                                                          \
            TILE(xi, ldx, w, j, DT, K, bias ? bias + j : NULL, yi + j, ldy, M_, N_);               \
        for (; j < j1; j++)                                                                        \
            TILE(xi, ldx, w, j, DT, K, bias ? bias + j : NULL, yi + j, ldy, M_, 1);                \
    } while (0)

/* A few rows (3 to 8: a small decode batch, or a sequence verifying drafts): W in blocks of 8 rows,
 * each block taken by every pair of x rows while it is in the L1 cache, so W is streamed once with
 * the decode tile's 8 loads in flight. */
#define FEW_BLOCK(TILE, XT, DT, M_) /* x rows [r, r + M_) against the W block at jb */             \
    do {                                                                                           \
        const XT *xr = x + r * ldx;                                                                \
        float *yr = y + r * ldy + jb;                                                              \
        if (jb + 8 <= j1)                                                                          \
            TILE(xr, ldx, w, jb, DT, K, bias ? bias + jb : NULL, yr, ldy, M_, 8);                  \
        else                                                                                       \
            for (size_t j = jb; j < j1; j++)                                                       \
                TILE(xr, ldx, w, j, DT, K, bias ? bias + j : NULL, yr + (j - jb), ldy, M_, 1);     \
    } while (0)
#define FEW_ROWS(TILE, XT, DT)                                                                     \
    do {                                                                                           \
        for (size_t jb = j0; jb < j1; jb += 8) {                                                   \
            size_t r = 0;                                                                          \
            for (; r + 2 <= n; r += 2) FEW_BLOCK(TILE, XT, DT, 2);                                 \
            if (r < n) FEW_BLOCK(TILE, XT, DT, 1);                                                 \
        }                                                                                          \
    } while (0)

/* The tile shapes for the n rows of x (element type XT): decode (n <= 2) streams W once, 8 rows
 * at a time to keep many loads in flight; a few rows (n <= 8) take W's blocks of 8 rows by pairs
 * (FEW_ROWS); prefill runs 6 x 4 tiles and one shorter row tile. Every output element sees the
 * same operations whatever the shape (one 16-lane accumulator over K, then hsum16). */
#define MM_SHAPES(TILE, XT, DT)                                                                    \
    do {                                                                                           \
        size_t i = 0;                                                                              \
        if (n <= 2) {                                                                              \
            const XT *xi = x;                                                                      \
            float *yi = y;                                                                         \
            if (n == 1)                                                                            \
                TILE_ROWS(TILE, 1, 8, DT);                                                         \
            else                                                                                   \
                TILE_ROWS(TILE, 2, 8, DT);                                                         \
            break;                                                                                 \
        }                                                                                          \
        if (n <= 8) {                                                                              \
            FEW_ROWS(TILE, XT, DT);                                                                \
            break;                                                                                 \
        }                                                                                          \
        for (; i + 6 <= n; i += 6) {                                                               \
            const XT *xi = x + i * ldx;                                                            \
            float *yi = y + i * ldy;                                                               \
            TILE_ROWS(TILE, 6, 4, DT);                                                             \
        }                                                                                          \
        const XT *xi = x + i * ldx;                                                                \
        float *yi = y + i * ldy;                                                                   \
        switch (n - i) {                                                                           \
        case 5: TILE_ROWS(TILE, 5, 4, DT); break;                                                  \
        case 4: TILE_ROWS(TILE, 4, 4, DT); break;                                                  \
        case 3: TILE_ROWS(TILE, 3, 4, DT); break;                                                  \
        case 2: TILE_ROWS(TILE, 2, 4, DT); break;                                                  \
        case 1: TILE_ROWS(TILE, 1, 4, DT); break;                                                  \
        default: break;                                                                            \
        }                                                                                          \
    } while (0)

INLINE_AVX512 void mm_dt(const float *x, size_t n, size_t ldx, const struct pd_weight *w, size_t j0,
                         size_t j1, const float *bias, float *y, size_t ldy, pd_dtype dt)
{
    const size_t K = w->cols;
    MM_SHAPES(tile, float, dt);
}

INLINE_AVX512 void mm_q(const float *x, size_t n, size_t ldx, const struct pd_weight *w, size_t j0,
                        size_t j1, const float *bias, float *y, size_t ldy, cpu_wq q)
{
    const size_t K = w->cols;
    MM_SHAPES(tile_q, float, q);
}

/* Not instrumented by AddressSanitizer: in the ASan build the many tile shapes inlined here
 * lose their register accumulators to the stack, each 64-byte spill checked by a call (decode
 * ran 2.8x slower than without the quantized tiles, enough to change what the timing tests of
 * integration/overload see). The tiles' reads stay in bounds by construction (rows padded to
 * ld, masked tails), which unit/backend and unit/backend_quant check on every shape. */
__attribute__((no_sanitize_address)) AVX512 void cpu_mm_avx512(const float *x, size_t n, size_t ldx,
                                                               const struct pd_weight *w, size_t j0,
                                                               size_t j1, const float *bias,
                                                               float *y, size_t ldy)
{
    switch (w->q) {
    case CPU_WQ_U4: mm_q(x, n, ldx, w, j0, j1, bias, y, ldy, CPU_WQ_U4); return;
    case CPU_WQ_U8: mm_q(x, n, ldx, w, j0, j1, bias, y, ldy, CPU_WQ_U8); return;
    case CPU_WQ_I8: mm_q(x, n, ldx, w, j0, j1, bias, y, ldy, CPU_WQ_I8); return;
    case CPU_WQ_FP8: mm_q(x, n, ldx, w, j0, j1, bias, y, ldy, CPU_WQ_FP8); return;
    case CPU_WQ_I8A8: /* never here: cpu_backend.c runs cpu_mm_i8a8_* on quantized x */
    case CPU_WQ_NONE: break;
    }
    switch (w->dtype) {
    case PD_DTYPE_F32: mm_dt(x, n, ldx, w, j0, j1, bias, y, ldy, PD_DTYPE_F32); break;
    case PD_DTYPE_BF16: mm_dt(x, n, ldx, w, j0, j1, bias, y, ldy, PD_DTYPE_BF16); break;
    case PD_DTYPE_F16: mm_dt(x, n, ldx, w, j0, j1, bias, y, ldy, PD_DTYPE_F16); break;
    default: break;
    }
}

AVX512 float cpu_dot_avx512(const float *a, const float *b, size_t n)
{
    __m512 acc = _mm512_setzero_ps();
    size_t k = 0;
    for (; k + 16 <= n; k += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), acc);
    if (k < n) {
        __mmask16 m = (__mmask16)((1u << (n - k)) - 1u);
        acc =
            _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + k), _mm512_maskz_loadu_ps(m, b + k), acc);
    }
    return hsum16(acc);
}

AVX512 void cpu_axpy_avx512(float *y, float s, const float *x, size_t n)
{
    __m512 sv = _mm512_set1_ps(s);
    size_t k = 0;
    for (; k + 16 <= n; k += 16)
        _mm512_storeu_ps(y + k,
                         _mm512_fmadd_ps(sv, _mm512_loadu_ps(x + k), _mm512_loadu_ps(y + k)));
    if (k < n) {
        __mmask16 m = (__mmask16)((1u << (n - k)) - 1u);
        _mm512_mask_storeu_ps(
            y + k, m,
            _mm512_fmadd_ps(sv, _mm512_maskz_loadu_ps(m, x + k), _mm512_maskz_loadu_ps(m, y + k)));
    }
}

/* 16 vectors -> one vector of their 16 horizontal sums (lane j = sum of a[j]), by a fixed
 * shuffle-add tree (pairs within 128-bit lanes, then across lanes). */
INLINE_AVX512 __m512 reduce16x16(const __m512 *a)
{
    __m512 b[8], c[4], d[2];
    UNROLL for (int i = 0; i < 8; i++) b[i] = _mm512_add_ps(
        _mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    UNROLL for (int i = 0; i < 4; i++) c[i] =
        _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                      _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    UNROLL for (int i = 0; i < 2; i++) d[i] =
        _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                      _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88),
                         _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

/* exp(x) for 16 lanes, x <= 0 (relative error ~1e-7): 2^n * p(r), r = x - n ln2 in
 * [-ln2/2, ln2/2], p the degree-7 Taylor polynomial; scalef gives 0 on underflow. */
INLINE_AVX512 __m512 exp16(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Attention for one query head, keys in blocks of 16 (block b = positions 16b .. 16b+15, the
 * same blocks for every row, so a row's result does not depend on the batch): 16 dot products
 * as 16 register accumulators reduced together by reduce16x16, a vector exp, one online-softmax
 * rescale per block, and the output accumulator in NV registers (head_dim = 16 * NV). */
/* 16 values of a KV row p from element 16 v: f32, or fp8 as load_q16 reads it (the value
 * times 2^-8; attn_regs folds 2^8 and the layer's scale into the score scale and the output). */
INLINE_AVX512 __m512 kv16(const uint8_t *p, int v, const int F8)
{
    return F8 ? load_q16(p, CPU_WQ_FP8, 16 * (size_t)v)
              : _mm512_loadu_ps((const float *)p + 16 * v);
}

INLINE_AVX512 void attn_regs(const float *q, const cpu_kv_layer *kv, int kv_head,
                             const int32_t *block_table, size_t n_ctx, float scale, float *out,
                             const int NV, const int F8)
{
    __m512 qv[8], acc[8];
    float pbuf[16];
    const size_t bs = kv->block_size, D = kv->head_dim, es = F8 ? 1 : sizeof(float);
    const __m512 vscale = _mm512_set1_ps(F8 ? scale * kv->k_scale * 256.0f : scale);
    UNROLL for (int v = 0; v < NV; v++)
    {
        qv[v] = _mm512_loadu_ps(q + 16 * v);
        acc[v] = _mm512_setzero_ps();
    }
    float m = -INFINITY, l = 0.0f;
    const uint8_t *keys[16], *vals[16];
    for (size_t c0 = 0; c0 < n_ctx; c0 += 16) {
        size_t cn = n_ctx - c0 < 16 ? n_ctx - c0 : 16;
        __mmask16 valid = (__mmask16)(cn == 16 ? 0xFFFFu : (1u << cn) - 1u);
        for (size_t t = 0; t < 16; t++) {
            size_t pos = c0 + (t < cn ? t : 0);
            size_t slot = (size_t)block_table[pos / bs] * bs + pos % bs;
            size_t off = (slot * kv->token_elems + (size_t)kv_head * D) * es;
            keys[t] = (const uint8_t *)kv->k + off;
            vals[t] = (const uint8_t *)kv->v + off;
        }
        __m512 dots[16];
        UNROLL for (int t = 0; t < 16; t++)
        {
            __m512 d = _mm512_mul_ps(qv[0], kv16(keys[t], 0, F8));
            UNROLL for (int v = 1; v < NV; v++) d = _mm512_fmadd_ps(qv[v], kv16(keys[t], v, F8), d);
            dots[t] = d;
        }
        __m512 sc = _mm512_mul_ps(reduce16x16(dots), vscale);
        sc = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, sc);
        float mc = _mm512_reduce_max_ps(sc);
        float m_new = mc > m ? mc : m;
        if (m != -INFINITY && m_new != m) {
            float alpha = expf(m - m_new);
            __m512 va = _mm512_set1_ps(alpha);
            l *= alpha;
            UNROLL for (int v = 0; v < NV; v++) acc[v] = _mm512_mul_ps(acc[v], va);
        }
        m = m_new;
        __m512 pv = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(sc, _mm512_set1_ps(m))));
        l += hsum16(pv);
        _mm512_storeu_ps(pbuf, pv);
        for (size_t t = 0; t < cn; t++) {
            __m512 pb = _mm512_set1_ps(pbuf[t]);
            UNROLL for (int v = 0; v < NV; v++) acc[v] =
                _mm512_fmadd_ps(pb, kv16(vals[t], v, F8), acc[v]);
        }
    }
    __m512 inv = _mm512_set1_ps(F8 ? kv->v_scale * 256.0f / l : 1.0f / l);
    UNROLL for (int v = 0; v < NV; v++) _mm512_storeu_ps(out + 16 * v, _mm512_mul_ps(acc[v], inv));
}

AVX512 int cpu_attention_head_avx512(const float *q, const cpu_kv_layer *kv, int kv_head,
                                     const int32_t *block_table, size_t n_ctx, float scale,
                                     float *out)
{
    if (kv->head_dim % 16 || kv->head_dim > 128) return 0;
    int nv = (int)(kv->head_dim / 16);
    /* NV and F8 are compile-time constants in each call: the loops unroll per head size */
#define ATTN_CASE(n)                                                                               \
    case n:                                                                                        \
        if (kv->fp8)                                                                               \
            attn_regs(q, kv, kv_head, block_table, n_ctx, scale, out, n, 1);                       \
        else                                                                                       \
            attn_regs(q, kv, kv_head, block_table, n_ctx, scale, out, n, 0);                       \
        return 1;
    switch (nv) {
        ATTN_CASE(1)
        ATTN_CASE(2)
        ATTN_CASE(3)
        ATTN_CASE(4)
        ATTN_CASE(5)
        ATTN_CASE(6)
        ATTN_CASE(7)
        ATTN_CASE(8)
#undef ATTN_CASE
    default: return 0;
    }
}

#define AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma")))
#define INLINE_AVX512VNNI                                                                          \
    static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512vnni,"     \
                                                       "fma")))

/* cpu_quant_row_i8 in 16 lanes: the same max, product and rounding (vcvtps2dq rounds half to
 * even, as nearbyintf does in the default mode), so the same bytes. */
AVX512VNNI void cpu_quant_row_i8_avx512(const float *x, size_t K, size_t ld, uint8_t *row)
{
    __m512 am = _mm512_setzero_ps();
    size_t k = 0;
    for (; k + 16 <= K; k += 16) am = _mm512_max_ps(am, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
    if (k < K)
        am = _mm512_max_ps(
            am, _mm512_abs_ps(_mm512_maskz_loadu_ps((__mmask16)((1u << (K - k)) - 1u), x + k)));
    float amax = _mm512_reduce_max_ps(am);
    float sx = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    memcpy(row, &sx, sizeof sx);
    uint8_t *q = row + CPU_XQ_HEAD;
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i lo = _mm512_set1_epi32(-128), hi = _mm512_set1_epi32(127),
                  off = _mm512_set1_epi32(128);
    for (k = 0; k < K; k += 16) {
        __mmask16 m = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1u);
        __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + k), vinv));
        v = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(v, lo), hi), off);
        _mm_mask_storeu_epi8(q + k, m, _mm512_cvtepi32_epi8(v));
    }
    memset(q + K, 128, ld - K);
}

/* The horizontal sums of a[0..3] as the four lanes of one vector. */
INLINE_AVX512VNNI __m128i reduce4_epi32(const __m512i *a)
{
    __m512i ab =
        _mm512_add_epi32(_mm512_unpacklo_epi32(a[0], a[1]), _mm512_unpackhi_epi32(a[0], a[1]));
    __m512i cd =
        _mm512_add_epi32(_mm512_unpacklo_epi32(a[2], a[3]), _mm512_unpackhi_epi32(a[2], a[3]));
    __m512i abcd = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
    __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(abcd), _mm512_extracti64x4_epi64(abcd, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* An (M x N) W8A8 tile: 64 products per vpdpbusd (x bytes unsigned, w signed), int32 lanes,
 * reduced exactly. The rows' headers hold their scales (cpu_quant_row_i8). */
INLINE_AVX512VNNI void tile_i8(const uint8_t *x, size_t ldx, const struct pd_weight *wt, size_t j0,
                               int dt, size_t K, const float *bias, float *y, size_t ldy,
                               const int M, const int N)
{
    __m512i acc[MT_MAX][NT_MAX];
    const int8_t *w = (const int8_t *)wt->data + j0 * wt->ld;
    UNROLL for (int i = 0; i < M; i++) UNROLL for (int j = 0; j < N; j++) acc[i][j] =
        _mm512_setzero_si512();
    for (size_t k = 0; k < K; k += 64) {
        __m512i wv[NT_MAX];
        UNROLL for (int j = 0; j < N; j++) wv[j] =
            _mm512_loadu_si512((const void *)(w + (size_t)j * wt->ld + k));
        UNROLL for (int i = 0; i < M; i++)
        {
            __m512i xv = _mm512_loadu_si512((const void *)(x + (size_t)i * ldx + CPU_XQ_HEAD + k));
            UNROLL for (int j = 0; j < N; j++) acc[i][j] =
                _mm512_dpbusd_epi32(acc[i][j], xv, wv[j]);
        }
    }
    UNROLL for (int i = 0; i < M; i++)
    {
        float sx;
        memcpy(&sx, x + (size_t)i * ldx, sizeof sx);
        int j = 0;
        for (; j + 4 <= N; j += 4) { /* four outputs at once: i8a8_out's operations, in order */
            __m128i d = _mm_sub_epi32(
                reduce4_epi32(&acc[i][j]),
                _mm_slli_epi32(_mm_loadu_si128((const __m128i *)(wt->wsum + j0 + (size_t)j)), 7));
            __m128 v = _mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(d), _mm_set1_ps(sx)),
                                  _mm_loadu_ps(wt->scale + j0 + (size_t)j));
            if (bias) v = _mm_add_ps(v, _mm_loadu_ps(bias + j));
            _mm_storeu_ps(y + (size_t)i * ldy + j, v);
        }
        for (; j < N; j++) /* integer sums: any order is exact */
            y[(size_t)i * ldy + j] = i8a8_out(_mm512_reduce_add_epi32(acc[i][j]), wt,
                                              j0 + (size_t)j, sx, bias ? bias - j0 : NULL);
    }
}

AVX512VNNI void cpu_mm_i8a8_vnni(const uint8_t *x, size_t n, size_t ldx, const struct pd_weight *w,
                                 size_t j0, size_t j1, const float *bias, float *y, size_t ldy)
{
    const size_t K = w->ld;
    MM_SHAPES(tile_i8, uint8_t, 0);
}

#else /* not x86-64: the AVX-512 entry points are never selected (cpu_have_avx512() == 0) */

void cpu_mm_avx512(const float *x, size_t n, size_t ldx, const struct pd_weight *w, size_t j0,
                   size_t j1, const float *bias, float *y, size_t ldy)
{
    cpu_mm_scalar(x, n, ldx, w, j0, j1, bias, y, ldy);
}
float cpu_dot_avx512(const float *a, const float *b, size_t n)
{
    return cpu_dot_scalar(a, b, n);
}
void cpu_axpy_avx512(float *y, float s, const float *x, size_t n)
{
    cpu_axpy_scalar(y, s, x, n);
}
int cpu_attention_head_avx512(const float *q, const cpu_kv_layer *kv, int kv_head,
                              const int32_t *block_table, size_t n_ctx, float scale, float *out)
{
    return 0;
}
void cpu_mm_i8a8_vnni(const uint8_t *x, size_t n, size_t ldx, const struct pd_weight *w, size_t j0,
                      size_t j1, const float *bias, float *y, size_t ldy)
{
    cpu_mm_i8a8_scalar(x, n, ldx, w, j0, j1, bias, y, ldy);
}
void cpu_quant_row_i8_avx512(const float *x, size_t K, size_t ld, uint8_t *row)
{
    cpu_quant_row_i8(x, K, ld, row);
}

#endif

/* ---- AVX-512 BF16 ---------------------------------------------------------------------------- */
#if defined(__x86_64__) && PD_HAVE_AVX512BF16

#define AVX512BF16 __attribute__((target("avx512f,avx512bf16,f16c,fma")))
#define INLINE_AVX512BF16                                                                          \
    static inline __attribute__((always_inline, target("avx512f,avx512bf16,f16c,fma")))

/* One (M x N) tile of the bf16 compute mode: x rows bf16 (stride ldx), W rows bf16 (stride
 * ldw), both zero-padded to K, a multiple of 32, so every load is whole. dt is BF16 (the only
 * weight dtype of the mode; the parameter keeps TILE_ROWS' call shape). */
INLINE_AVX512BF16 void tile_bf16(const uint16_t *x, size_t ldx, const struct pd_weight *wt,
                                 size_t j0, pd_dtype dt, size_t K, const float *bias, float *y,
                                 size_t ldy, const int M, const int N)
{
    __m512 acc[MT_MAX][NT_MAX];
    const size_t ldw = wt->ld;
    const uint16_t *wh = (const uint16_t *)wt->data + j0 * ldw;
    UNROLL for (int i = 0; i < M; i++) UNROLL for (int j = 0; j < N; j++) acc[i][j] =
        _mm512_setzero_ps();
    for (size_t k = 0; k < K; k += 32) {
        __m512bh wv[NT_MAX];
        UNROLL for (int j = 0; j < N; j++) wv[j] =
            (__m512bh)_mm512_loadu_si512(wh + (size_t)j * ldw + k);
        UNROLL for (int i = 0; i < M; i++)
        {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (size_t)i * ldx + k);
            UNROLL for (int j = 0; j < N; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    UNROLL for (int i = 0; i < M; i++) UNROLL for (int j = 0; j < N; j++)
    {
        float s = hsum16(acc[i][j]);
        if (bias) s += bias[j];
        y[(size_t)i * ldy + j] = s;
    }
}

AVX512BF16 void cpu_mm_avx512bf16(const uint16_t *x, size_t n, size_t ldx,
                                  const struct pd_weight *w, size_t j0, size_t j1,
                                  const float *bias, float *y, size_t ldy)
{
    const size_t K = w->ld;
    MM_SHAPES(tile_bf16, uint16_t, PD_DTYPE_BF16);
}

AVX512BF16 void cpu_round_bf16_avx512bf16(const float *x, size_t K, uint16_t *xb, size_t ld)
{
    size_t k = 0;
    for (; k + 32 <= K; k += 32)
        _mm512_storeu_si512(xb + k, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + k + 16),
                                                                 _mm512_loadu_ps(x + k)));
    if (k < K) {
        /* Masked loads give zeros past K: the tail vector is the row's zero padding too. */
        uint32_t m = K - k >= 32 ? 0xFFFFFFFFu : (1u << (K - k)) - 1u;
        __m512 lo = _mm512_maskz_loadu_ps((__mmask16)m, x + k);
        __m512 hi = _mm512_maskz_loadu_ps((__mmask16)(m >> 16), x + k + 16);
        _mm512_storeu_si512(xb + k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        k += 32;
    }
    for (; k < ld; k++) xb[k] = 0;
}

#else /* not x86-64, or a compiler without the avx512_bf16 intrinsics: never selected              \
         (cpu_have_avx512bf16() == 0) */

void cpu_mm_avx512bf16(const uint16_t *x, size_t n, size_t ldx, const struct pd_weight *w,
                       size_t j0, size_t j1, const float *bias, float *y, size_t ldy)
{
    (void)x, (void)n, (void)ldx, (void)w, (void)j0, (void)j1, (void)bias, (void)y, (void)ldy;
    abort();
}
void cpu_round_bf16_avx512bf16(const float *x, size_t K, uint16_t *xb, size_t ld)
{
    (void)x, (void)K, (void)xb, (void)ld;
    abort();
}

#endif
