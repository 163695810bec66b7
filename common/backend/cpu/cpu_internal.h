/* Internal interface of the CPU backend: its weight and KV structs and the kernels that the
 * op table (cpu_backend.c) calls. Not for use outside common/backend/cpu/. */
#ifndef PD_BACKEND_CPU_INTERNAL_H
#define PD_BACKEND_CPU_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"

/* How a quantized weight's values are stored (CPU_WQ_NONE: a float weight). */
typedef enum {
    CPU_WQ_NONE = 0,
    CPU_WQ_U4 = 1,   /* 0..15, two per byte: per 128 columns 16 little-endian 32-bit words, word
                        l holding column l + 16c in bits 4c .. 4c + 3 (c = 0 .. 7), so the 16
                        values of columns [16c, 16c + 16) are one load and one shift away from
                        32-bit lanes */
    CPU_WQ_U8 = 2,   /* 0..255, a byte each */
    CPU_WQ_I8 = 3,   /* int8, a byte each */
    CPU_WQ_FP8 = 4,  /* float8 e4m3fn, a byte each */
    CPU_WQ_I8A8 = 5, /* int8 as CPU_WQ_I8, times x quantized to int8 per row (W8A8, below) */
} cpu_wq;

/* A weight on the CPU backend: (rows, cols) with rows padded to ld elements (ld a multiple of
 * 16, of 32 in the bf16 compute mode, of 128 for U4; the padding zero-filled) so SIMD loads of a
 * row never need a mask; 64-byte aligned. Quantized (q != CPU_WQ_NONE): element (j, k) is (v -
 * zero[j, g]) * scale[j, g], v the stored value of column k and g = k / gs its group (gs a multiple
 * of 16; one group per row for I8/FP8, zero 0); with perm, column k of the stored rows is input
 * column perm[k] (GPTQ act order: the columns sorted by group), and x is permuted to match before
 * the product. */
struct pd_weight {
    pd_dtype dtype; /* F32, F16 or BF16 (vectors: always F32); F32 when quantized */
    size_t rows, cols;
    size_t ld;     /* elements between rows */
    void *data;    /* (rows, ld) in dtype, or the packed values (cpu_wq_row_bytes(q, ld) a row) */
    size_t nbytes; /* every byte the weight holds (scales, zeros and perm included) */
    cpu_wq q;
    size_t gs, ng;       /* quantized: columns per group, groups per row */
    float *scale, *zero; /* quantized: (rows, ng) */
    int32_t *perm;       /* quantized: (cols) input column of each stored column; NULL: identity */
    int32_t *wsum;       /* I8A8: (rows) the sum of each row's values */
};

/* W8A8 (CPU_WQ_I8A8), as vLLM computes it: each x row is quantized to int8 with its own scale
 * (dynamic, per token, symmetric: sx = max|x| / 127, q = round-half-even(x * (127 / max|x|))),
 * stored as a CPU_XQ_HEAD-byte header holding sx (f32) and then q + 128 as bytes, ld of them;
 * y[i, j] = (float)(sum_k q[i, k] w[j, k]) * sx[i] * scale[j] (+ bias[j]): an exact integer sum,
 * so every kernel and batch shape gives the same bits. */
#define CPU_XQ_HEAD 64
void cpu_quant_row_i8(const float *x, size_t K, size_t ld, uint8_t *row);
void cpu_quant_row_i8_avx512(const float *x, size_t K, size_t ld, uint8_t *row); /* same bytes */
void cpu_mm_i8a8_scalar(const uint8_t *xq, size_t n, size_t ldx, const struct pd_weight *w,
                        size_t j0, size_t j1, const float *bias, float *y, size_t ldy);
/* The same with avx512_vnni dot products (vpdpbusd); ld a multiple of 64. */
void cpu_mm_i8a8_vnni(const uint8_t *xq, size_t n, size_t ldx, const struct pd_weight *w, size_t j0,
                      size_t j1, const float *bias, float *y, size_t ldy);
/* 1 when the running CPU has avx512f, avx512bw, avx512vl and avx512_vnni. */
int cpu_have_avx512vnni(void);

/* Loads slice s (rows and columns resolved, in range) of t, a quantized linear (t->quant). */
int cpu_qweight_load(const pd_tensor *t, const pd_weight_slice *s, pd_weight **out);
/* Frees any CPU weight (NULL: no-op). */
void cpu_weight_release(pd_weight *w);

/* Bytes of one stored row of ld values. */
static inline size_t cpu_wq_row_bytes(cpu_wq q, size_t ld)
{
    return q == CPU_WQ_U4 ? ld / 2 : ld;
}

/* Computes y[i, j] = dot(x[i, :], W[j, :]) (+ bias[j]) for rows i < n of x (row stride ldx) and
 * W rows j in [j0, j1); y row stride ldy, column j at y[i * ldy + j].
 * Contract: y[i, j] depends only on x[i, :], W[j, :] and bias[j] (the reduction order over
 * K = w->cols is fixed), never on n, j0, j1 or the other rows. */
typedef void (*cpu_mm_fn)(const float *x, size_t n, size_t ldx, const struct pd_weight *w,
                          size_t j0, size_t j1, const float *bias, float *y, size_t ldy);

void cpu_mm_scalar(const float *x, size_t n, size_t ldx, const struct pd_weight *w, size_t j0,
                   size_t j1, const float *bias, float *y, size_t ldy);
void cpu_mm_avx512(const float *x, size_t n, size_t ldx, const struct pd_weight *w, size_t j0,
                   size_t j1, const float *bias, float *y, size_t ldy);

/* The bf16 compute mode's dot-product kernel (avx512_bf16): the same contract with x rows
 * already rounded to bf16 (stride ldx = w->ld, zero-padded to it) and w bf16 with ld a multiple
 * of 32. cpu_round_bf16_avx512bf16 rounds one row x (K) to bf16 (nearest even) into xb (ld),
 * zero-filling [K, ld). Without avx512_bf16 the mode rounds x to bf16 values kept in f32 and
 * runs cpu_mm_fn (cpu_backend.c). */
void cpu_mm_avx512bf16(const uint16_t *x, size_t n, size_t ldx, const struct pd_weight *w,
                       size_t j0, size_t j1, const float *bias, float *y, size_t ldy);
void cpu_round_bf16_avx512bf16(const float *x, size_t K, uint16_t *xb, size_t ld);

/* Dot product and axpy used by attention, with the same ISA split.
 * cpu_dot: sum_k a[k] * b[k] in a fixed order. cpu_axpy: y[k] += s * x[k]. */
typedef float (*cpu_dot_fn)(const float *a, const float *b, size_t n);
typedef void (*cpu_axpy_fn)(float *y, float s, const float *x, size_t n);
float cpu_dot_scalar(const float *a, const float *b, size_t n);
float cpu_dot_avx512(const float *a, const float *b, size_t n);
void cpu_axpy_scalar(float *y, float s, const float *x, size_t n);
void cpu_axpy_avx512(float *y, float s, const float *x, size_t n);

/* 1 when the running CPU has the features the AVX-512 kernels need (avx512f, f16c). */
int cpu_have_avx512(void);
/* 1 when it also has avx512_bf16 and this build has the kernel (PD_HAVE_AVX512BF16). */
int cpu_have_avx512bf16(void);

/* ---- row kernels (cpu_ops.c) ---------------------------------------------------------------- */

#define CPU_MAX_HEAD_DIM 512 /* attention keeps one head's accumulator on the stack */
#define CPU_ATTN_CHUNK   128 /* keys scored per online-softmax rescale */

/* One layer of the KV pool: K and V each (n_blocks, block_size, n_kv_heads, head_dim), f32, or
 * fp8 e4m3 bytes holding k / k_scale and v / v_scale. */
typedef struct {
    const void *k;
    const void *v;
    size_t block_size;
    size_t token_elems; /* n_kv_heads * head_dim */
    size_t head_dim;
    bool fp8;
    float k_scale, v_scale; /* fp8 only */
} cpu_kv_layer;

/* y (dim) = (x * rsqrt(mean(x^2) + eps)) * w. y may equal x. */
void cpu_rmsnorm_row(const float *x, const float *w, float eps, size_t dim, float *y,
                     cpu_dot_fn dot);
/* out (dim) = silu(gate) * up; out may alias either input. */
void cpu_swiglu_row(const float *gate, const float *up, size_t dim, float *out);
/* x (n_heads, head_dim) rotated in place by one row of cos/sin (head_dim / 2 each). */
void cpu_rope_row(float *x, size_t n_heads, size_t head_dim, const float *cos_row,
                  const float *sin_row);
/* out (head_dim) = softmax(q . K[0..n_ctx)^T * scale) . V[0..n_ctx) for one query head q
 * (head_dim) against kv head kv_head, positions mapped to slots through block_table.
 * n_ctx >= 1; head_dim <= CPU_MAX_HEAD_DIM. */
void cpu_attention_head(const float *q, const cpu_kv_layer *kv, int kv_head,
                        const int32_t *block_table, size_t n_ctx, float scale, float *out,
                        cpu_dot_fn dot, cpu_axpy_fn axpy);
/* The same with q and the accumulator in AVX-512 registers, for head_dim a multiple of 16 up to
 * 128 (cpu_matmul.c). Returns 0 without doing anything for other head sizes. */
int cpu_attention_head_avx512(const float *q, const cpu_kv_layer *kv, int kv_head,
                              const int32_t *block_table, size_t n_ctx, float scale, float *out);

#endif
