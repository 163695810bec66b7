// The CUDA backend's fused ops (cuda_be.cuh; backend.h's "fused ops": vLLM's QKV projection,
// gate-up projection + SiluAndMul, fused_add_rms_norm, rotary + cache write, and the norms that
// the projections after them take): their tape entries, and their execution on the step stream.
//
// Design: for decode rows (n <= CUDA_GEMV_MAX_N) a fused op is one GEMV launch with the rest in
// its prologue and epilogue (k_gemv.cu); otherwise, or with PD_CUDA_FUSED=0, it issues the plain
// ops it stands for (cuda_ops.cu), which give the same result bit for bit.
#include <limits.h>
#include <string.h>

#include "backend/cuda/cuda_be.cuh"

// ---- execution from a tape entry ----------------------------------------------------------------

// matmul_multi's entry: x = p[0]; weight i's w, bias, y = p[1 + i], p[1 + M + i], p[1 + 2M + i].
#define MM_W(e, i) ((const pd_weight *)(e)->p[1 + (i)])
#define MM_B(e, i) ((const pd_weight *)(e)->p[1 + PD_MATMUL_MULTI_MAX + (i)])
#define MM_Y(e, i) ((void *)(e)->p[1 + 2 * PD_MATMUL_MULTI_MAX + (i)])

#define PRE_ADD(e)  ((e)->p[PRE_P])
#define PRE_XOUT(e) ((void *)(e)->p[PRE_P + 1])
#define PRE_W(e)    ((const pd_weight *)(e)->p[PRE_P + 2])
#define PRE_H(e)    ((void *)(e)->p[PRE_P + 3])

// Decode rows: all weights in one GEMV launch (same x, same dtype); otherwise one by one.
int exec_matmul_multi(cuda_be *cb, const tape_ent *e)
{
    const size_t n = e->z[0], nw = e->z[1];
    if (n <= CUDA_GEMV_MAX_N && nw <= CUDA_GEMV_MAX_MATS) {
        const void *W[CUDA_GEMV_MAX_MATS];
        const float *bias[CUDA_GEMV_MAX_MATS];
        void *y[CUDA_GEMV_MAX_MATS];
        size_t out[CUDA_GEMV_MAX_MATS];
        int same = 1;
        for (size_t i = 0; i < nw; i++) {
            W[i] = MM_W(e, i)->data;
            out[i] = MM_W(e, i)->rows;
            bias[i] = MM_B(e, i) ? (const float *)MM_B(e, i)->data : NULL;
            y[i] = MM_Y(e, i);
            same &= MM_W(e, i)->dtype == MM_W(e, 0)->dtype;
        }
        int rc = same ? cuda_gemv_multi(cb->stream, cb->act, e->p[0], n, (int)nw, W,
                                        (int)MM_W(e, 0)->dtype, out, MM_W(e, 0)->cols, bias, y)
                      : PD_EUNSUPPORTED;
        if (rc != PD_EUNSUPPORTED) return rc;
    }
    for (size_t i = 0; i < nw; i++)
        PD_CHECK(exec_matmul(cb, e->p[0], n, MM_W(e, i), MM_B(e, i), MM_Y(e, i)));
    return PD_OK;
}

// Rotary embedding of q and k and the KV-cache write of the step's rows, one launch.
int exec_rope_kv_write(cuda_be *cb, const pd_kv *kv, int layer, void *q, size_t nq, const void *k,
                       const void *v)
{
    return cuda_rope_kv_write(cb->stream, cb->act, q, k, v, cb->n_tokens, nq, kv->p.n_kv_heads,
                              kv->p.head_dim, cb->d_cos, cb->d_sin, cb->rope_dim / 2, cb->d_slots,
                              kv_k(kv, layer), kv_v(kv, layer));
}

// The norm of a norm_* entry (p[0]: the residual rows) for its GEMV, or NULL (a plain entry).
static const cuda_norm_in *entry_norm(const tape_ent *e, cuda_norm_in *nm)
{
    if (!PRE_W(e)) return NULL;
    *nm = {PRE_ADD(e), PRE_XOUT(e), (const float *)PRE_W(e)->data, e->f};
    return nm;
}

// A norm_* entry's norm as its own launch (where its GEMV does not take it): into h, which the
// entry's projection then reads instead of p[0] (*x). No-op for a plain entry.
static int exec_prenorm(cuda_be *cb, const tape_ent *e, size_t dim, const void **x)
{
    if (!PRE_W(e)) return PD_OK;
    const float *w = (const float *)PRE_W(e)->data;
    *x = PRE_H(e);
    if (PRE_ADD(e))
        return cuda_add_rmsnorm(cb->stream, cb->act, e->p[0], PRE_ADD(e), PRE_XOUT(e), w, e->f,
                                e->z[0], dim, PRE_H(e));
    return cuda_rmsnorm(cb->stream, cb->act, e->p[0], w, e->f, e->z[0], dim, PRE_H(e));
}

// Decode rows: one GEMV launch with the rotary embedding and the KV write in its epilogue (and
// the norm before it, for norm_qkv_rope_kv_write); otherwise the norm, matmul_multi, then
// rope_kv_write. The entry is matmul_multi's (3 weights), the pool after it, the layer in z[2].
int exec_qkv_rope_kv_write(cuda_be *cb, const tape_ent *e)
{
    const pd_kv *kv = (const pd_kv *)e->p[1 + 3 * PD_MATMUL_MULTI_MAX];
    const int layer = (int)e->z[2];
    const size_t D = kv->p.head_dim, nq = MM_W(e, 0)->rows / D;
    cuda_norm_in nb;
    const cuda_norm_in *nm = entry_norm(e, &nb);
    if (MM_W(e, 1)->dtype == MM_W(e, 0)->dtype && MM_W(e, 2)->dtype == MM_W(e, 0)->dtype) {
        const void *W[3];
        const float *bias[3];
        for (int i = 0; i < 3; i++) {
            W[i] = MM_W(e, i)->data;
            bias[i] = MM_B(e, i) ? (const float *)MM_B(e, i)->data : NULL;
        }
        int rc =
            cuda_gemv_qkv_rope(cb->stream, cb->act, e->p[0], e->z[0], W, (int)MM_W(e, 0)->dtype, nq,
                               kv->p.n_kv_heads, D, MM_W(e, 0)->cols, bias, MM_Y(e, 0), cb->d_cos,
                               cb->d_sin, cb->d_slots, kv_k(kv, layer), kv_v(kv, layer), nm);
        if (rc != PD_EUNSUPPORTED) return rc;
    }
    tape_ent m = *e;
    PD_CHECK(exec_prenorm(cb, e, MM_W(e, 0)->cols, &m.p[0]));
    PD_CHECK(exec_matmul_multi(cb, &m));
    return exec_rope_kv_write(cb, kv, layer, MM_Y(e, 0), nq, MM_Y(e, 1), MM_Y(e, 2));
}

// Decode rows: one GEMV launch ending in the SwiGLU (and starting with the norm, for
// norm_matmul_swiglu); otherwise the norm, gate and up, then swiglu.
int exec_matmul_swiglu(cuda_be *cb, const tape_ent *e)
{
    const pd_weight *wg = (const pd_weight *)e->p[1], *wu = (const pd_weight *)e->p[2];
    const size_t n = e->z[0];
    void *g = (void *)e->p[3], *u = (void *)e->p[4], *out = (void *)e->p[5];
    cuda_norm_in nb;
    const cuda_norm_in *nm = entry_norm(e, &nb);
    if (n <= CUDA_GEMV_MAX_N && wg->dtype == wu->dtype) {
        int rc = cuda_gemv_swiglu(cb->stream, cb->act, e->p[0], n, wg->data, wu->data,
                                  (int)wg->dtype, wg->rows, wg->cols, out, nm);
        if (rc != PD_EUNSUPPORTED) return rc;
    }
    const void *x = e->p[0];
    PD_CHECK(exec_prenorm(cb, e, wg->cols, &x));
    PD_CHECK(exec_matmul(cb, x, n, wg, NULL, g));
    PD_CHECK(exec_matmul(cb, x, n, wu, NULL, u));
    return cuda_swiglu(cb->stream, cb->act, g, u, n * wg->rows, out);
}

// ---- ops --------------------------------------------------------------------------------------

// A matmul_multi tape entry of op `op` (checked: one x for every weight).
static int multi_entry(int op, const void *x, size_t n, size_t n_w, const pd_weight *const *w,
                       const pd_weight *const *bias, void *const *y, tape_ent *e)
{
    if (n_w < 1 || n_w > PD_MATMUL_MULTI_MAX)
        return pd_error(PD_EINVAL, "cuda matmul: %zu weights in one call, expected 1 to %d", n_w,
                        PD_MATMUL_MULTI_MAX);
    *e = ent(op);
    e->p[0] = x;
    for (size_t i = 0; i < n_w; i++) {
        PD_CHECK(matmul_check(w[i], bias ? bias[i] : NULL, n));
        if (w[i]->cols != w[0]->cols)
            return pd_error(PD_EINVAL, "cuda matmul: weight %zu has %zu columns, weight 0 has %zu",
                            i, w[i]->cols, w[0]->cols);
        e->p[1 + i] = w[i];
        e->p[1 + PD_MATMUL_MULTI_MAX + i] = bias ? bias[i] : NULL;
        e->p[1 + 2 * PD_MATMUL_MULTI_MAX + i] = y[i];
    }
    e->z[0] = n;
    e->z[1] = n_w;
    return PD_OK;
}

int op_matmul_multi(pd_backend *b, const void *x, size_t n, size_t n_w, const pd_weight *const *w,
                    const pd_weight *const *bias, void *const *y)
{
    if (BE(b)->unfused && n_w >= 1 && n_w <= PD_MATMUL_MULTI_MAX) {
        for (size_t i = 0; i < n_w; i++)
            PD_CHECK(op_matmul(b, x, n, w[i], bias ? bias[i] : NULL, y[i]));
        return PD_OK;
    }
    tape_ent e;
    PD_CHECK(multi_entry(T_MATMUL_MULTI, x, n, n_w, w, bias, y, &e));
    if (n == 0) return PD_OK;
    return step_op(BE(b), &e);
}

int op_rope_kv_write(pd_backend *b, pd_kv *kv, int layer, void *q, size_t n_q_heads, void *k,
                     const void *v)
{
    cuda_be *cb = BE(b);
    PD_CHECK(need_plan(cb, "rope_kv_write"));
    PD_CHECK(check_kv(cb, kv, layer, "rope_kv_write"));
    if (kv->p.head_dim != cb->rope_dim)
        return pd_error(PD_EINVAL, "cuda rope_kv_write: head_dim %zu != planned rope_dim %zu",
                        kv->p.head_dim, cb->rope_dim);
    if (cb->unfused) {
        PD_CHECK(op_rope(b, q, n_q_heads, kv->p.head_dim));
        PD_CHECK(op_rope(b, k, kv->p.n_kv_heads, kv->p.head_dim));
        return op_kv_write(b, kv, layer, k, v);
    }
    tape_ent e = ent(T_ROPE_KV_WRITE);
    e.p[0] = kv;
    e.p[1] = q;
    e.p[2] = k;
    e.p[3] = v;
    e.z[0] = (size_t)layer;
    e.z[1] = n_q_heads;
    return step_op(cb, &e);
}

// A norm_* op's arguments, for rows of dim elements.
static int prenorm_check(const pd_norm_in *pre, size_t n, size_t dim, const char *op)
{
    if (!pre->x || !pre->w || !pre->h || (pre->add && !pre->x_out))
        return pd_error(PD_EINVAL, "cuda %s: the norm needs x, w, h%s", op,
                        pre->add ? " and x_out (add given)" : "");
    if (pre->add && (pre->x_out == pre->x || pre->x_out == pre->add))
        return pd_error(PD_EINVAL,
                        "cuda %s: x_out must not be x or add (it is written while they "
                        "are read)",
                        op);
    return norm_check(pre->w, n, dim);
}

// A norm_* op's norm as its own launch (rows the GEMV does not take, PD_CUDA_FUSED=0): into
// pre->h.
static int op_prenorm(pd_backend *b, const pd_norm_in *pre, size_t n, size_t dim)
{
    return norm_entry(b, pre->x, pre->add, pre->x_out, pre->w, pre->eps, n, dim, pre->h);
}

// The entry's norm fields from pre (NULL: none).
static void set_prenorm(tape_ent *e, const pd_norm_in *pre)
{
    if (!pre) return;
    e->p[PRE_P] = pre->add;
    e->p[PRE_P + 1] = pre->x_out;
    e->p[PRE_P + 2] = pre->w;
    e->p[PRE_P + 3] = pre->h;
    e->f = pre->eps;
}

// qkv_rope_kv_write of x, or with pre (norm_qkv_rope_kv_write) of pre->h after the norm.
static int qkv_rope_kv_write(pd_backend *b, pd_kv *kv, int layer, const pd_norm_in *pre,
                             const void *x, size_t n, const pd_weight *const *w,
                             const pd_weight *const *bias, void *q, void *k, void *v)
{
    cuda_be *cb = BE(b);
    const size_t D = kv->p.head_dim, kv_row = kv->p.n_kv_heads * D;
    if (w[0]->rows % D || w[1]->rows != kv_row || w[2]->rows != kv_row)
        return pd_error(PD_EINVAL,
                        "cuda qkv_rope_kv_write: q, k, v have %zu, %zu, %zu rows; the pool holds "
                        "%zu heads of %zu",
                        w[0]->rows, w[1]->rows, w[2]->rows, kv->p.n_kv_heads, D);
    void *y[3] = {q, k, v};
    if (cb->unfused || n > CUDA_GEMV_MAX_N) { // no GEMV here: the ops' launches
        if (pre) {
            PD_CHECK(op_prenorm(b, pre, n, w[0]->cols));
            x = pre->h;
        }
        PD_CHECK(op_matmul_multi(b, x, n, 3, w, bias, y));
        return op_rope_kv_write(b, kv, layer, q, w[0]->rows / D, k, v);
    }
    PD_CHECK(need_plan(cb, "qkv_rope_kv_write"));
    PD_CHECK(check_kv(cb, kv, layer, "qkv_rope_kv_write"));
    if (D != cb->rope_dim || n != cb->n_tokens)
        return pd_error(PD_EINVAL,
                        "cuda qkv_rope_kv_write: head_dim %zu and %zu rows, planned rope_dim %zu "
                        "and %zu rows",
                        D, n, cb->rope_dim, cb->n_tokens);
    tape_ent e;
    PD_CHECK(multi_entry(T_QKV_ROPE_KV_WRITE, pre ? pre->x : x, n, 3, w, bias, y, &e));
    e.p[1 + 3 * PD_MATMUL_MULTI_MAX] = kv;
    e.z[2] = (size_t)layer;
    set_prenorm(&e, pre);
    return step_op(cb, &e);
}

int op_qkv_rope_kv_write(pd_backend *b, pd_kv *kv, int layer, const void *x, size_t n,
                         const pd_weight *const *w, const pd_weight *const *bias, void *q, void *k,
                         void *v)
{
    return qkv_rope_kv_write(b, kv, layer, NULL, x, n, w, bias, q, k, v);
}

int op_norm_qkv_rope_kv_write(pd_backend *b, pd_kv *kv, int layer, const pd_norm_in *pre, size_t n,
                              const pd_weight *const *w, const pd_weight *const *bias, void *q,
                              void *k, void *v)
{
    PD_CHECK(prenorm_check(pre, n, w[0]->cols, "norm_qkv_rope_kv_write"));
    return qkv_rope_kv_write(b, kv, layer, pre, NULL, n, w, bias, q, k, v);
}

int op_add_rmsnorm(pd_backend *b, void *y, const void *x, const pd_weight *w, float eps, size_t n,
                   size_t dim, void *h)
{
    PD_CHECK(norm_check(w, n, dim));
    if (BE(b)->unfused) {
        PD_CHECK(op_add(b, y, x, n * dim));
        return op_rmsnorm(b, y, w, eps, n, dim, h);
    }
    return norm_entry(b, y, x, y, w, eps, n, dim, h);
}

// matmul_swiglu of x, or with pre (norm_matmul_swiglu) of pre->h after the norm.
static int matmul_swiglu(pd_backend *b, const pd_norm_in *pre, const void *x, size_t n,
                         const pd_weight *wg, const pd_weight *wu, void *g, void *u, void *out)
{
    PD_CHECK(matmul_check(wg, NULL, n));
    PD_CHECK(matmul_check(wu, NULL, n));
    if (wg->rows != wu->rows || wg->cols != wu->cols)
        return pd_error(PD_EINVAL, "cuda matmul_swiglu: gate is (%zu, %zu), up (%zu, %zu)",
                        wg->rows, wg->cols, wu->rows, wu->cols);
    if (BE(b)->unfused) {
        if (pre) {
            PD_CHECK(op_prenorm(b, pre, n, wg->cols));
            x = pre->h;
        }
        PD_CHECK(op_matmul(b, x, n, wg, NULL, g));
        PD_CHECK(op_matmul(b, x, n, wu, NULL, u));
        return op_swiglu(b, g, u, n, wg->rows, out);
    }
    if (n == 0) return PD_OK;
    tape_ent e = ent(T_MATMUL_SWIGLU);
    e.p[0] = pre ? pre->x : x;
    e.p[1] = wg;
    e.p[2] = wu;
    e.p[3] = g;
    e.p[4] = u;
    e.p[5] = out;
    e.z[0] = n;
    set_prenorm(&e, pre);
    return step_op(BE(b), &e);
}

int op_matmul_swiglu(pd_backend *b, const void *x, size_t n, const pd_weight *wg,
                     const pd_weight *wu, void *g, void *u, void *out)
{
    return matmul_swiglu(b, NULL, x, n, wg, wu, g, u, out);
}

int op_norm_matmul_swiglu(pd_backend *b, const pd_norm_in *pre, size_t n, const pd_weight *wg,
                          const pd_weight *wu, void *g, void *u, void *out)
{
    PD_CHECK(prenorm_check(pre, n, wg->cols, "norm_matmul_swiglu"));
    return matmul_swiglu(b, pre, NULL, n, wg, wu, g, u, out);
}
