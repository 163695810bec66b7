/* Row kernels of the CPU backend other than matrix products: RMSNorm, SwiGLU, RoPE, and paged
 * attention for one (row, query head).
 *
 * Design: every kernel works on whole rows with a reduction order that depends only on the row
 * (never on the batch), matching Hugging Face's float32 math step by step: RMSNorm as
 * (x * rsqrt(mean(x^2) + eps)) * w, RoPE in the rotate_half convention with cos/sin tables
 * computed once per step by the forward pass, attention as softmax(q.k * scale) . v evaluated in
 * chunks of keys with one rescale per chunk (online softmax), so no scratch grows with the
 * context. Dot products and axpy go through the ISA-selected function pointers.
 */
#include <math.h>
#include <string.h>

#include "backend/cpu/cpu_internal.h"

void cpu_rmsnorm_row(const float *x, const float *w, float eps, size_t dim, float *y,
                     cpu_dot_fn dot)
{
    float ms = dot(x, x, dim) / (float)dim;
    float r = 1.0f / sqrtf(ms + eps);
    for (size_t k = 0; k < dim; k++) y[k] = (x[k] * r) * w[k];
}

void cpu_swiglu_row(const float *gate, const float *up, size_t dim, float *out)
{
    for (size_t k = 0; k < dim; k++) {
        float g = gate[k];
        out[k] = (g / (1.0f + expf(-g))) * up[k];
    }
}

void cpu_rope_row(float *x, size_t n_heads, size_t head_dim, const float *cos_row,
                  const float *sin_row)
{
    size_t half = head_dim / 2;
    for (size_t h = 0; h < n_heads; h++) {
        float *xh = x + h * head_dim;
        for (size_t i = 0; i < half; i++) {
            float x1 = xh[i], x2 = xh[i + half];
            float c = cos_row[i], s = sin_row[i];
            xh[i] = x1 * c - x2 * s;
            xh[i + half] = x2 * c + x1 * s;
        }
    }
}

/* The head_dim values of a pool at element off: f32 in place, or fp8 times scale into buf. */
static const float *kv_row(const cpu_kv_layer *kv, const void *pool, float scale, size_t off,
                           float *buf)
{
    if (!kv->fp8) return (const float *)pool + off;
    const uint8_t *p = (const uint8_t *)pool + off;
    for (size_t d = 0; d < kv->head_dim; d++) buf[d] = pd_f8e4m3_to_f32(p[d]) * scale;
    return buf;
}

void cpu_attention_head(const float *q, const cpu_kv_layer *kv, int kv_head,
                        const int32_t *block_table, size_t n_ctx, float scale, float *out,
                        cpu_dot_fn dot, cpu_axpy_fn axpy)
{
    float sc[CPU_ATTN_CHUNK];
    float acc[CPU_MAX_HEAD_DIM], row[CPU_MAX_HEAD_DIM];
    const size_t D = kv->head_dim, bs = kv->block_size;
    float m = -INFINITY, l = 0.0f;
    memset(acc, 0, D * sizeof(float));
    for (size_t c0 = 0; c0 < n_ctx; c0 += CPU_ATTN_CHUNK) {
        size_t cn = n_ctx - c0 < CPU_ATTN_CHUNK ? n_ctx - c0 : CPU_ATTN_CHUNK;
        float mc = -INFINITY;
        for (size_t t = 0; t < cn; t++) {
            size_t pos = c0 + t;
            size_t slot = (size_t)block_table[pos / bs] * bs + pos % bs;
            const float *key =
                kv_row(kv, kv->k, kv->k_scale, slot * kv->token_elems + (size_t)kv_head * D, row);
            sc[t] = dot(q, key, D) * scale;
            if (sc[t] > mc) mc = sc[t];
        }
        float m_new = mc > m ? mc : m;
        if (m != -INFINITY && m_new != m) {
            float alpha = expf(m - m_new);
            l *= alpha;
            for (size_t d = 0; d < D; d++) acc[d] *= alpha;
        }
        m = m_new;
        for (size_t t = 0; t < cn; t++) {
            size_t pos = c0 + t;
            size_t slot = (size_t)block_table[pos / bs] * bs + pos % bs;
            const float *val =
                kv_row(kv, kv->v, kv->v_scale, slot * kv->token_elems + (size_t)kv_head * D, row);
            float p = expf(sc[t] - m);
            l += p;
            axpy(acc, p, val, D);
        }
    }
    float inv = 1.0f / l;
    for (size_t d = 0; d < D; d++) out[d] = acc[d] * inv;
}
