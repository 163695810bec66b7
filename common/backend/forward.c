/* The Llama-family forward pass over the backend operation table (see forward.h).
 *
 * Design: llama2.c's single readable pass, but every step is an op of the table, so the same
 * code drives the CPU and CUDA backends. Per step, the host derives what the backend needs from
 * the engine's per-sequence description (positions, KV slots through the block tables, RoPE
 * cos/sin rows with the model's rope_scaling, output rows) into buffers sized at create, hands
 * it over with one `plan`, and then issues the layer ops. Weights are loaded as this rank's
 * slices (q/k/v/gate/up by output rows, o/down by input columns), so tensor parallelism only
 * adds an all-reduce after o_proj and down_proj. Where the backend has the fused ops (backend.h:
 * q/k/v in one matmul_multi, gate/up with the SwiGLU in one matmul_swiglu, rotary + cache
 * write, residual add + the next norm),
 * the pass issues those instead of the plain ops they stand for (params.no_fused: never). Where
 * the backend's q/k/v and gate/up projections also take the norm before them (norm_in), the
 * residual add and the norm go with them: the sum is written to the stream's other buffer, as
 * the projection's blocks still read the old rows. A model with per-head q/k norms (Qwen3) runs
 * those norms between the projection and the rotary step, so it takes neither the fused
 * projection + rotary op nor the norm_in ops.
 */
#include "backend/forward.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "util/status.h"

typedef struct {
    pd_weight *ln1;          /* (1, H) f32 */
    pd_weight *wq, *wk, *wv; /* (nq_loc*D, H), (nkv_loc*D, H), (nkv_loc*D, H) */
    pd_weight *bq, *bk, *bv; /* (1, nq_loc*D), (1, nkv_loc*D) x2, or NULL */
    pd_weight *qn, *kn;      /* (1, D) per-head q and k norms (Qwen3), or NULL */
    pd_weight *wo;           /* (H, nq_loc*D): input columns of this rank's heads */
    pd_weight *bo;           /* (1, H) on rank 0 only, or NULL */
    pd_weight *ln2;          /* (1, H) */
    pd_weight *wg, *wu;      /* (I_loc, H) */
    pd_weight *wd;           /* (H, I_loc) */
    float k_scale, v_scale;  /* the checkpoint's fp8 KV cache scales (1 when not stored) */
} fwd_layer;

struct pd_forward {
    pd_backend *b;
    const pd_backend_ops *o;
    pd_forward_params p;
    pd_model_config cfg;
    size_t H, V, D, I_loc, nq_loc, nkv_loc, n_layers;
    size_t layer0;    /* the model's index of layers[0] (pipeline stage) */
    bool first, last; /* the stage embeds tokens / computes logits */
    float eps, attn_scale;

    fwd_layer *layers;  /* (n_layers) */
    pd_weight *embed;   /* (V, H) */
    pd_weight *norm;    /* (1, H) */
    pd_weight *lm_head; /* (V, H); == embed when tied */
    size_t weight_bytes, step_bytes;

    /* device activations, act dtype; rows = max_tokens unless noted */
    void *x;      /* (rows, H) residual stream: xb[0] at a step's start, then where the sum went */
    void *xb[2];  /* its buffers; xb[1] only with the norm_in ops (else NULL) */
    void *h;      /* (rows, H) normed input of a sublayer */
    void *q;      /* (rows, nq_loc*D) */
    void *k;      /* (rows, nkv_loc*D) */
    void *v;      /* (rows, nkv_loc*D) */
    void *att;    /* (rows, nq_loc*D) attention output */
    void *t;      /* (rows, H) sublayer output before the residual add */
    void *g;      /* (rows, I_loc) gate, then swiglu result */
    void *u;      /* (rows, I_loc) up */
    void *xo;     /* (max_out, H) rows whose logits are wanted */
    void *logits; /* (max_out, V) */

    /* host step scratch, filled per step */
    int32_t *positions; /* (max_tokens) */
    int64_t *slots;     /* (max_tokens) */
    float *rope_cos;    /* (max_tokens, D/2) */
    float *rope_sin;    /* (max_tokens, D/2) */
    double *inv_freq;   /* (D/2) base frequencies (non-dynamic: fixed at create) */
    double *inv_dyn;    /* (D/2) per-sequence frequencies for dynamic NTK */
    double rope_scaling;
    /* cos and sin rows of positions [0, rope_tab_n) under inv_freq (not with dynamic NTK): a
     * row is the same for every step, and computing it (double cos and sin per pair) cost more
     * than a millisecond of host time per 2048-token prefill, before the step's first kernel */
    float *rope_tab; /* (rope_tab_cap, 2, D/2): cos row, then sin row */
    size_t rope_tab_n, rope_tab_cap;
};

/* Positions whose RoPE rows are kept (forward.rope_tab); later ones are computed per step. */
#define ROPE_TAB_MAX 32768

pd_forward_params pd_forward_default_params(void)
{
    pd_forward_params p = {
        .shard = {0, 1},
        .allreduce = NULL,
        .allreduce_ctx = NULL,
        .max_tokens = 2048,
        .max_seqs = 256,
        .max_out = 256,
        .kv_dtype = -1,
    };
    return p;
}

/* ---- weights ------------------------------------------------------------------------------------
 */

static int load(pd_forward *f, const pd_tensor *t, size_t row0, size_t nrows, size_t col0,
                size_t ncols, pd_weight **out)
{
    pd_weight_slice sl = {row0, nrows, col0, ncols};
    PD_CHECK(f->o->weight_load(f->b, t, &sl, out));
    f->weight_bytes += f->o->weight_nbytes(f->b, *out);
    return PD_OK;
}

static int load_all(pd_forward *f, const pd_tensor *t, pd_weight **out)
{
    return load(f, t, 0, 0, 0, 0, out);
}

static int load_weights(pd_forward *f, const pd_model_weights *mw)
{
    const size_t D = f->D, r = (size_t)f->p.shard.rank;
    const size_t q0 = r * f->nq_loc * D, kv0 = r * f->nkv_loc * D, i0 = r * f->I_loc;
    const size_t qn = f->nq_loc * D, kvn = f->nkv_loc * D;
    for (size_t l = 0; l < f->n_layers; l++) {
        const pd_layer_weights *w = &mw->layers[f->layer0 + l];
        fwd_layer *L = &f->layers[l];
        PD_CHECK(load_all(f, &w->input_layernorm, &L->ln1));
        L->k_scale = w->k_scale;
        L->v_scale = w->v_scale;
        PD_CHECK(load(f, &w->q_proj, q0, qn, 0, 0, &L->wq));
        PD_CHECK(load(f, &w->k_proj, kv0, kvn, 0, 0, &L->wk));
        PD_CHECK(load(f, &w->v_proj, kv0, kvn, 0, 0, &L->wv));
        if (w->q_bias.data) PD_CHECK(load(f, &w->q_bias, 0, 1, q0, qn, &L->bq));
        if (w->k_bias.data) PD_CHECK(load(f, &w->k_bias, 0, 1, kv0, kvn, &L->bk));
        if (w->v_bias.data) PD_CHECK(load(f, &w->v_bias, 0, 1, kv0, kvn, &L->bv));
        if (w->q_norm.data) PD_CHECK(load_all(f, &w->q_norm, &L->qn));
        if (w->k_norm.data) PD_CHECK(load_all(f, &w->k_norm, &L->kn));
        PD_CHECK(load(f, &w->o_proj, 0, 0, q0, qn, &L->wo));
        if (w->o_bias.data && r == 0) PD_CHECK(load_all(f, &w->o_bias, &L->bo));
        PD_CHECK(load_all(f, &w->post_attention_layernorm, &L->ln2));
        PD_CHECK(load(f, &w->gate_proj, i0, f->I_loc, 0, 0, &L->wg));
        PD_CHECK(load(f, &w->up_proj, i0, f->I_loc, 0, 0, &L->wu));
        PD_CHECK(load(f, &w->down_proj, 0, 0, i0, f->I_loc, &L->wd));
        pd_weight *m[] = {L->ln1, L->wq, L->wk, L->wv,  L->bq, L->bk, L->bv, L->qn,
                          L->kn,  L->wo, L->bo, L->ln2, L->wg, L->wu, L->wd};
        for (size_t i = 0; i < sizeof m / sizeof m[0]; i++)
            if (m[i]) f->step_bytes += f->o->weight_nbytes(f->b, m[i]);
    }
    if (f->first) PD_CHECK(load_all(f, &mw->embed_tokens, &f->embed));
    if (!f->last) return PD_OK;
    PD_CHECK(load_all(f, &mw->norm, &f->norm));
    if (mw->lm_head_tied && f->embed)
        f->lm_head = f->embed;
    else /* untied, or tied on a last stage that does not embed */
        PD_CHECK(load_all(f, mw->lm_head_tied ? &mw->embed_tokens : &mw->lm_head, &f->lm_head));
    f->step_bytes += f->o->weight_nbytes(f->b, f->norm) + f->o->weight_nbytes(f->b, f->lm_head);
    return PD_OK;
}

/* ---- create / free ------------------------------------------------------------------------ */

static int alloc_act(pd_forward *f, void **buf, size_t rows, size_t cols)
{
    size_t es = pd_dtype_size(pd_backend_act_dtype(f->b));
    return f->o->buf_alloc(f->b, rows * cols * es, buf);
}

void pd_forward_free(pd_forward *f)
{
    if (!f) return;
    const pd_backend_ops *o = f->o;
    if (f->layers) {
        for (size_t l = 0; l < f->n_layers; l++) {
            fwd_layer *L = &f->layers[l];
            pd_weight *m[] = {L->ln1, L->wq, L->wk, L->wv,  L->bq, L->bk, L->bv, L->qn,
                              L->kn,  L->wo, L->bo, L->ln2, L->wg, L->wu, L->wd};
            for (size_t i = 0; i < sizeof m / sizeof m[0]; i++)
                if (m[i]) o->weight_free(f->b, m[i]);
        }
        free(f->layers);
    }
    if (f->lm_head && f->lm_head != f->embed) o->weight_free(f->b, f->lm_head);
    if (f->embed) o->weight_free(f->b, f->embed);
    if (f->norm) o->weight_free(f->b, f->norm);
    void *bufs[] = {f->xb[0], f->xb[1], f->h, f->q, f->k,  f->v,
                    f->att,   f->t,     f->g, f->u, f->xo, f->logits};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i]) o->buf_free(f->b, bufs[i]);
    free(f->positions);
    free(f->slots);
    free(f->rope_cos);
    free(f->rope_sin);
    free(f->inv_freq);
    free(f->inv_dyn);
    free(f->rope_tab);
    free(f);
}

int pd_forward_create(pd_backend *b, const pd_model *m, const pd_forward_params *params,
                      pd_forward **out)
{
    pd_forward_params p = params ? *params : pd_forward_default_params();
    const pd_model_config *c = &m->config;
    if (p.shard.size < 1 || p.shard.rank < 0 || p.shard.rank >= p.shard.size)
        return pd_error(PD_EINVAL, "forward: shard rank %d of size %d is invalid", p.shard.rank,
                        p.shard.size);
    if (c->num_key_value_heads % p.shard.size || c->intermediate_size % p.shard.size)
        return pd_error(PD_EINVAL,
                        "forward: tensor-parallel size %d must divide num_key_value_heads (%lld) "
                        "and intermediate_size (%lld)",
                        p.shard.size, (long long)c->num_key_value_heads,
                        (long long)c->intermediate_size);
    if (p.shard.size > 1 && !p.allreduce)
        return pd_error(PD_EUNSUPPORTED, "forward: tensor-parallel size %d needs an allreduce",
                        p.shard.size);
    if (p.max_tokens == 0 || p.max_seqs == 0 || p.max_out == 0)
        return pd_error(PD_EINVAL, "forward: max_tokens, max_seqs and max_out must be > 0");
    if (c->head_dim % 2)
        return pd_error(PD_EINVAL, "forward: head_dim %lld must be even for RoPE",
                        (long long)c->head_dim);
    size_t total = (size_t)c->num_hidden_layers;
    if (p.layer0 >= total || p.n_layers > total - p.layer0)
        return pd_error(PD_EINVAL, "forward: layers [%zu, +%zu) outside the model's %zu", p.layer0,
                        p.n_layers, total);
    if (p.n_layers == 0) p.n_layers = total - p.layer0;
    if (p.kv_dtype >= 0 && (p.kv_dtype != PD_DTYPE_F8_E4M3 || !pd_backend_get_ops(b)->kv_scales))
        return pd_error(PD_EUNSUPPORTED,
                        "--kv-cache-dtype: the %s backend has no %s KV cache (auto: the "
                        "activation dtype)",
                        pd_backend_get_ops(b)->name, pd_dtype_name((pd_dtype)p.kv_dtype));

    pd_forward *f = calloc(1, sizeof *f);
    if (!f) return pd_error(PD_ENOMEM, "forward: out of memory");
    f->b = b;
    f->o = pd_backend_get_ops(b);
    f->p = p;
    f->cfg = *c;
    f->H = (size_t)c->hidden_size;
    f->V = (size_t)c->vocab_size;
    f->D = (size_t)c->head_dim;
    f->n_layers = p.n_layers;
    f->layer0 = p.layer0;
    f->first = p.layer0 == 0;
    f->last = p.layer0 + p.n_layers == total;
    f->nq_loc = (size_t)(c->num_attention_heads / p.shard.size);
    f->nkv_loc = (size_t)(c->num_key_value_heads / p.shard.size);
    f->I_loc = (size_t)(c->intermediate_size / p.shard.size);
    f->eps = (float)c->rms_norm_eps;
    f->attn_scale = (float)(1.0 / sqrt((double)c->head_dim));

    int rc;
    const size_t T = p.max_tokens, half = f->D / 2;
    f->layers = calloc(f->n_layers, sizeof *f->layers);
    f->positions = malloc(T * sizeof *f->positions);
    f->slots = malloc(T * sizeof *f->slots);
    f->rope_cos = malloc(T * half * sizeof(float));
    f->rope_sin = malloc(T * half * sizeof(float));
    f->inv_freq = malloc(half * sizeof(double));
    f->inv_dyn = malloc(half * sizeof(double));
    if (!f->layers || !f->positions || !f->slots || !f->rope_cos || !f->rope_sin || !f->inv_freq ||
        !f->inv_dyn) {
        rc = pd_error(PD_ENOMEM, "forward: out of memory");
        goto fail;
    }
    PD_CHECK_GOTO(pd_rope_inv_freq(c, 0, f->inv_freq, &f->rope_scaling), rc, fail);
    PD_CHECK_GOTO(load_weights(f, &m->weights), rc, fail);
    size_t qd = f->nq_loc * f->D, kvd = f->nkv_loc * f->D;
    PD_CHECK_GOTO(alloc_act(f, &f->xb[0], T, f->H), rc, fail);
    if (f->o->norm_qkv_rope_kv_write && f->o->norm_matmul_swiglu && !p.no_fused && !c->qk_norm)
        PD_CHECK_GOTO(alloc_act(f, &f->xb[1], T, f->H), rc, fail);
    f->x = f->xb[0];
    PD_CHECK_GOTO(alloc_act(f, &f->h, T, f->H), rc, fail);
    PD_CHECK_GOTO(alloc_act(f, &f->q, T, qd), rc, fail);
    PD_CHECK_GOTO(alloc_act(f, &f->k, T, kvd), rc, fail);
    PD_CHECK_GOTO(alloc_act(f, &f->v, T, kvd), rc, fail);
    PD_CHECK_GOTO(alloc_act(f, &f->att, T, qd), rc, fail);
    PD_CHECK_GOTO(alloc_act(f, &f->t, T, f->H), rc, fail);
    PD_CHECK_GOTO(alloc_act(f, &f->g, T, f->I_loc), rc, fail);
    PD_CHECK_GOTO(alloc_act(f, &f->u, T, f->I_loc), rc, fail);
    if (f->last) {
        PD_CHECK_GOTO(alloc_act(f, &f->xo, p.max_out, f->H), rc, fail);
        PD_CHECK_GOTO(alloc_act(f, &f->logits, p.max_out, f->V), rc, fail);
    }
    *out = f;
    return PD_OK;
fail:
    pd_forward_free(f);
    return rc;
}

pd_kv_params pd_forward_kv_params(const pd_forward *f, size_t n_blocks, size_t block_size)
{
    pd_kv_params kp = {
        .n_layers = (int)f->n_layers,
        .n_blocks = n_blocks,
        .block_size = block_size,
        .n_kv_heads = f->nkv_loc,
        .head_dim = f->D,
        .dtype = f->p.kv_dtype >= 0 ? (pd_dtype)f->p.kv_dtype : pd_backend_act_dtype(f->b),
    };
    return kp;
}

int pd_forward_kv_init(const pd_forward *f, pd_kv *kv)
{
    if (f->p.kv_dtype < 0) return PD_OK;
    for (size_t l = 0; l < f->n_layers; l++)
        PD_CHECK(f->o->kv_scales(f->b, kv, (int)l, f->layers[l].k_scale, f->layers[l].v_scale));
    return PD_OK;
}

size_t pd_forward_vocab(const pd_forward *f)
{
    return f->V;
}

size_t pd_forward_hidden(const pd_forward *f)
{
    return f->H;
}

size_t pd_forward_weight_bytes(const pd_forward *f)
{
    return f->weight_bytes;
}

size_t pd_forward_bytes_per_step(const pd_forward *f)
{
    return f->step_bytes;
}

/* ---- one step
 * ------------------------------------------------------------------------------------ */

/* cos and sin of position pos under inv / scaling, into cr and sr (half each). As transformers:
 * angle = float32(pos) * float32(inv_freq) in float32, then cos/sin times the attention
 * scaling. */
static void rope_row(int32_t pos, const double *inv, double scaling, size_t half, float *cr,
                     float *sr)
{
    for (size_t j = 0; j < half; j++) {
        float ang = (float)pos * (float)inv[j];
        cr[j] = (float)(cos((double)ang) * scaling);
        sr[j] = (float)(sin((double)ang) * scaling);
    }
}

/* Extends rope_tab to cover position pos (below ROPE_TAB_MAX), doubling its capacity. */
static int rope_tab_cover(pd_forward *f, int32_t pos)
{
    const size_t half = f->D / 2, need = (size_t)pos + 1;
    if (need <= f->rope_tab_n) return PD_OK;
    if (need > f->rope_tab_cap) {
        size_t cap = f->rope_tab_cap ? f->rope_tab_cap : 256;
        while (cap < need) cap *= 2;
        if (cap > ROPE_TAB_MAX) cap = ROPE_TAB_MAX;
        float *t = realloc(f->rope_tab, cap * 2 * half * sizeof(float));
        if (!t) return pd_error(PD_ENOMEM, "forward: out of memory (RoPE table)");
        f->rope_tab = t;
        f->rope_tab_cap = cap;
    }
    for (size_t p = f->rope_tab_n; p < need; p++) {
        float *row = f->rope_tab + p * 2 * half;
        rope_row((int32_t)p, f->inv_freq, f->rope_scaling, half, row, row + half);
    }
    f->rope_tab_n = need;
    return PD_OK;
}

/* Positions, slots and RoPE rows for every row of the step; validates the step first. */
static int prepare_step(pd_forward *f, size_t block_size, const pd_step *st, size_t *n_tokens)
{
    if (st->n_seqs == 0 || st->n_seqs > f->p.max_seqs)
        return pd_error(PD_ERANGE, "forward: n_seqs %zu outside [1, %zu]", st->n_seqs,
                        f->p.max_seqs);
    if (!st->token_ids || !st->q_indptr || !st->kv_len || !st->block_indptr ||
        (st->n_out && !st->out_rows))
        return pd_error(PD_EINVAL, "forward: a required step array is NULL");
    if (st->q_indptr[0] != 0 || st->block_indptr[0] != 0)
        return pd_error(PD_EINVAL, "forward: q_indptr[0] and block_indptr[0] must be 0");
    size_t n = (size_t)st->q_indptr[st->n_seqs];
    if (st->q_indptr[st->n_seqs] <= 0 || n > f->p.max_tokens)
        return pd_error(PD_ERANGE, "forward: %lld rows outside [1, %zu]",
                        (long long)st->q_indptr[st->n_seqs], f->p.max_tokens);
    if (st->n_out > f->p.max_out)
        return pd_error(PD_ERANGE, "forward: n_out %zu > max_out %zu", st->n_out, f->p.max_out);
    const size_t half = f->D / 2;
    const int dynamic = f->cfg.rope_scaling.type == PD_ROPE_DYNAMIC;
    for (size_t s = 0; s < st->n_seqs; s++) {
        int32_t r0 = st->q_indptr[s], r1 = st->q_indptr[s + 1];
        if (r1 < r0) return pd_error(PD_EINVAL, "forward: q_indptr decreases at sequence %zu", s);
        int32_t ns = r1 - r0, len = st->kv_len[s];
        if (len < ns || (ns > 0 && len < 1))
            return pd_error(PD_EINVAL, "forward: sequence %zu: kv_len %d < its %d new rows", s, len,
                            ns);
        int32_t b0 = st->block_indptr[s], b1 = st->block_indptr[s + 1];
        if (b1 < b0)
            return pd_error(PD_EINVAL, "forward: block_indptr decreases at sequence %zu", s);
        if ((size_t)len > (size_t)(b1 - b0) * block_size)
            return pd_error(PD_ERANGE,
                            "forward: sequence %zu: kv_len %d needs more than its %d blocks of "
                            "%zu tokens",
                            s, len, b1 - b0, block_size);
        const double *inv = f->inv_freq;
        double scaling = f->rope_scaling;
        if (dynamic && ns > 0) {
            PD_CHECK(pd_rope_inv_freq(&f->cfg, len, f->inv_dyn, &scaling));
            inv = f->inv_dyn;
        }
        for (int32_t i = 0; i < ns; i++) {
            size_t r = (size_t)(r0 + i);
            int32_t pos = len - ns + i;
            f->positions[r] = pos;
            f->slots[r] =
                (int64_t)st->block_ids[b0 + pos / (int32_t)block_size] * (int64_t)block_size +
                pos % (int32_t)block_size;
            float *cr = f->rope_cos + r * half, *sr = f->rope_sin + r * half;
            if (!dynamic && pos < ROPE_TAB_MAX) {
                PD_CHECK(rope_tab_cover(f, pos));
                const float *row = f->rope_tab + (size_t)pos * 2 * half;
                memcpy(cr, row, half * sizeof(float));
                memcpy(sr, row + half, half * sizeof(float));
            } else {
                rope_row(pos, inv, scaling, half, cr, sr);
            }
        }
    }
    *n_tokens = n;
    return PD_OK;
}

/* The fused ops of the backend (backend.h) when it has them and they are not turned off, else
 * the plain ops they stand for. */
static int matmuls(pd_forward *f, const void *x, size_t n, size_t n_w, const pd_weight *const *w,
                   const pd_weight *const *bias, void *const *y)
{
    if (f->o->matmul_multi && !f->p.no_fused)
        return f->o->matmul_multi(f->b, x, n, n_w, w, bias, y);
    for (size_t i = 0; i < n_w; i++)
        PD_CHECK(f->o->matmul(f->b, x, n, w[i], bias ? bias[i] : NULL, y[i]));
    return PD_OK;
}

/* x += t (the sublayer output), h = rmsnorm(x, w). */
static int add_rmsnorm(pd_forward *f, const pd_weight *w, size_t n)
{
    if (f->o->add_rmsnorm && !f->p.no_fused)
        return f->o->add_rmsnorm(f->b, f->x, f->t, w, f->eps, n, f->H, f->h);
    PD_CHECK(f->o->add(f->b, f->x, f->t, n * f->H));
    return f->o->rmsnorm(f->b, f->x, w, f->eps, n, f->H, f->h);
}

/* A sublayer's input norm, h = rmsnorm(x += t, w) (add: false for the first layer, x as it is):
 * handed to the projection after it as *pre when the backend takes it there (f->x then becomes
 * the other buffer, which that projection writes the sum to), else done now (*pre = NULL). */
static int sublayer_norm(pd_forward *f, bool add, const pd_weight *w, size_t n, pd_norm_in *in,
                         const pd_norm_in **pre)
{
    *pre = NULL;
    if (f->xb[1]) {
        void *other = f->x == f->xb[0] ? f->xb[1] : f->xb[0];
        *in = (pd_norm_in){f->x, add ? f->t : NULL, add ? other : NULL, w, f->eps, f->h};
        if (add) f->x = other;
        *pre = in;
        return PD_OK;
    }
    if (add) return add_rmsnorm(f, w, n);
    return f->o->rmsnorm(f->b, f->x, w, f->eps, n, f->H, f->h);
}

/* g = silu(h . gate^T) * (h . up^T) (u: scratch); pre: h's norm, done by the projection. */
static int gate_up_swiglu(pd_forward *f, const fwd_layer *L, size_t n, const pd_norm_in *pre)
{
    if (pre) return f->o->norm_matmul_swiglu(f->b, pre, n, L->wg, L->wu, f->g, f->u, f->g);
    if (f->o->matmul_swiglu && !f->p.no_fused)
        return f->o->matmul_swiglu(f->b, f->h, n, L->wg, L->wu, f->g, f->u, f->g);
    const pd_weight *w[] = {L->wg, L->wu};
    void *y[] = {f->g, f->u};
    PD_CHECK(matmuls(f, f->h, n, 2, w, NULL, y));
    return f->o->swiglu(f->b, f->g, f->u, n, f->I_loc, f->g);
}

/* q, k, v of the normed rows (f->h); q and k per-head normed (Qwen3) and rotated; k, v into the
 * pool's layer; pre: h's norm, done by the projection. */
static int qkv_rope_kv_write(pd_forward *f, const fwd_layer *L, size_t n, pd_kv *kv, int layer,
                             const pd_norm_in *pre)
{
    const pd_weight *w[] = {L->wq, L->wk, L->wv}, *bias[] = {L->bq, L->bk, L->bv};
    if (pre)
        return f->o->norm_qkv_rope_kv_write(f->b, kv, layer, pre, n, w, bias, f->q, f->k, f->v);
    if (f->o->qkv_rope_kv_write && !f->p.no_fused && !L->qn)
        return f->o->qkv_rope_kv_write(f->b, kv, layer, f->h, n, w, bias, f->q, f->k, f->v);
    void *y[] = {f->q, f->k, f->v};
    PD_CHECK(matmuls(f, f->h, n, 3, w, bias, y));
    if (L->qn) { /* Qwen3: each head's q and k RMS-normed over head_dim, in place */
        PD_CHECK(f->o->rmsnorm(f->b, f->q, L->qn, f->eps, n * f->nq_loc, f->D, f->q));
        PD_CHECK(f->o->rmsnorm(f->b, f->k, L->kn, f->eps, n * f->nkv_loc, f->D, f->k));
    }
    if (f->o->rope_kv_write && !f->p.no_fused)
        return f->o->rope_kv_write(f->b, kv, layer, f->q, f->nq_loc, f->k, f->v);
    PD_CHECK(f->o->rope(f->b, f->q, f->nq_loc, f->D));
    PD_CHECK(f->o->rope(f->b, f->k, f->nkv_loc, f->D));
    return f->o->kv_write(f->b, kv, layer, f->k, f->v);
}

size_t pd_forward_layer0(const pd_forward *f)
{
    return f->layer0;
}

int pd_forward_run(pd_forward *f, pd_kv *kv, const pd_step *st, float *logits)
{
    return pd_forward_run_stage(f, kv, st, NULL, NULL, logits);
}

int pd_forward_run_stage(pd_forward *f, pd_kv *kv, const pd_step *st, const float *x_in,
                         float *x_out, float *logits)
{
    if (!f->first != !!x_in || !f->last != !!x_out)
        return pd_error(PD_EINVAL, "forward: layers [%zu, +%zu) of %lld take %s and give %s",
                        f->layer0, f->n_layers, (long long)f->cfg.num_hidden_layers,
                        f->first ? "token ids" : "the residual stream",
                        f->last ? "logits" : "the residual stream");
    pd_backend *b = f->b;
    const pd_backend_ops *o = f->o;
    pd_kv_layer_view view;
    PD_CHECK(o->kv_layer(b, kv, 0, &view));
    size_t block_size = view.block_stride / view.token_stride, n = 0;
    PD_CHECK(prepare_step(f, block_size, st, &n));

    pd_batch bt = {
        .n_tokens = n,
        .token_ids = st->token_ids,
        .positions = f->positions,
        .slots = f->slots,
        .rope_cos = f->rope_cos,
        .rope_sin = f->rope_sin,
        .rope_dim = f->D,
        .n_seqs = st->n_seqs,
        .q_indptr = st->q_indptr,
        .kv_len = st->kv_len,
        .block_indptr = st->block_indptr,
        .block_ids = st->block_ids,
        .n_out = st->n_out,
        .out_rows = st->out_rows,
    };
    PD_CHECK(o->plan(b, &bt));
    f->x = f->xb[0]; /* every step the same buffers: a recorded step replays as it is */
    const size_t H = f->H;
    if (f->first) {
        PD_CHECK(o->embed(b, f->embed, f->x));
    } else {
        PD_CHECK(o->upload_f32(b, f->x, x_in, n * H));
        PD_CHECK(o->upload_f32(b, f->t, x_in + n * H, n * H));
    }
    pd_norm_in in;
    const pd_norm_in *pre;
    for (size_t l = 0; l < f->n_layers; l++) {
        const fwd_layer *L = &f->layers[l];
        /* attention block: x += o_proj(attn(rope(q), rope(k), v)); its input norm takes the
         * previous MLP's add (none before the model's first layer) */
        PD_CHECK(sublayer_norm(f, l > 0 || !f->first, L->ln1, n, &in, &pre));
        PD_CHECK(qkv_rope_kv_write(f, L, n, kv, (int)l, pre));
        PD_CHECK(o->attention(b, kv, (int)l, f->q, f->nq_loc, f->attn_scale, f->att));
        PD_CHECK(o->matmul(b, f->att, n, L->wo, L->bo, f->t));
        if (f->p.shard.size > 1) PD_CHECK(f->p.allreduce(f->p.allreduce_ctx, b, f->t, n * H));
        /* MLP block: x += down(silu(gate(h)) * up(h)) */
        PD_CHECK(sublayer_norm(f, true, L->ln2, n, &in, &pre));
        PD_CHECK(gate_up_swiglu(f, L, n, pre));
        PD_CHECK(o->matmul(b, f->g, n, L->wd, NULL, f->t));
        if (f->p.shard.size > 1) PD_CHECK(f->p.allreduce(f->p.allreduce_ctx, b, f->t, n * H));
    }
    if (!f->last) {
        PD_CHECK(o->download_f32(b, x_out, f->x, n * H));
        PD_CHECK(o->download_f32(b, x_out + n * H, f->t, n * H));
        return o->sync(b);
    }
    if (f->n_layers) PD_CHECK(o->add(b, f->x, f->t, n * H));
    if (st->n_out == 0) return o->sync(b);
    PD_CHECK(o->gather_rows(b, f->x, H, f->xo));
    PD_CHECK(o->rmsnorm(b, f->xo, f->norm, f->eps, st->n_out, H, f->xo));
    PD_CHECK(o->matmul(b, f->xo, st->n_out, f->lm_head, NULL, f->logits));
    PD_CHECK(o->download_f32(b, logits, f->logits, st->n_out * f->V));
    return o->sync(b);
}
