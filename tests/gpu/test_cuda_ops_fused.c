/* The CUDA backend's fused ops (matmul_multi, matmul_swiglu, add_rmsnorm, rope_kv_write,
 * qkv_rope_kv_write, the norm_* ops whose projection computes the norm) bit for bit against the
 * plain GPU ops they stand for, and within NMSE_MAX of the CPU backend. */
#include <stdlib.h>
#include <string.h>

#include "cuda_ops_common.h"

/* ---- fused ops ------------------------------------------------------------------------------ */

/* *same = 1 when GPU buffers a and b (n activations) are equal bit for bit. */
static int gpu_same(cuda_pair *p, const void *a, const void *b, size_t n, int *same)
{
    float *fa = malloc(n * sizeof(float)), *fb = malloc(n * sizeof(float));
    int rc = (fa && fb) ? PD_OK : pd_error(PD_ENOMEM, "gpu_same: out of memory");
    if (rc == 0) rc = ctu_act_download(p->b[PAIR_GPU], a, n, fa);
    if (rc == 0) rc = ctu_act_download(p->b[PAIR_GPU], b, n, fb);
    if (rc == 0) *same = memcmp(fa, fb, n * sizeof(float)) == 0;
    free(fa);
    free(fb);
    return rc;
}

/* matmul_multi on the GPU (one GEMV launch for n <= 8) = its matmuls one by one on the GPU, bit
 * for bit, and the CPU's matmuls within NMSE_MAX. */
static void fused_matmul_case(int mode)
{
    cuda_pair p;
    ASSERT_OK(ctu_pair_open(&p, mode));
    static const size_t shapes[][5] = {/* n, in, rows of w0, w1, w2 (0: two weights) */
                                       {1, 2048, 2048, 256, 256},
                                       {5, 64, 96, 32, 32},
                                       {8, 5632, 2048, 8, 0},
                                       {3, 4096, 13, 1, 700},
                                       {64, 512, 512, 128, 128}};
    uint64_t seed = 21;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        size_t n = shapes[si][0], in = shapes[si][1], nw = shapes[si][4] ? 3 : 2;
        float *x = malloc(n * in * sizeof(float));
        ASSERT(x);
        ctu_fill(x, n * in, &seed, 1.0f);
        pd_weight *w[2][3] = {{0}}, *bias[2][3] = {{0}};
        void *xb[2] = {0}, *yp[3][2] = {{0}}, *yf[3] = {0};
        ASSERT_OK(upload_both(&p, x, n * in, xb));
        for (size_t k = 0; k < nw; k++) {
            size_t out = shapes[si][2 + k];
            float *W = malloc(out * in * sizeof(float)), *bv = malloc(out * sizeof(float));
            ASSERT(W && bv);
            ctu_fill(W, out * in, &seed, 0.5f);
            ctu_fill(bv, out, &seed, 1.0f);
            pd_tensor wt = tensor_f32("proj.weight", W, out, in);
            pd_tensor bt = tensor_f32("proj.bias", bv, 0, out);
            for (int i = 0; i < 2; i++) {
                ASSERT_OK(p.o[i]->weight_load(p.b[i], &wt, NULL, &w[i][k]));
                if (k != 1) ASSERT_OK(p.o[i]->weight_load(p.b[i], &bt, NULL, &bias[i][k]));
            }
            ASSERT_OK(alloc_both(&p, n * out, yp[k]));
            ASSERT_OK(ctu_act_alloc(p.b[PAIR_GPU], n * out, &yf[k]));
            for (int i = 0; i < 2; i++)
                ASSERT_OK(p.o[i]->matmul(p.b[i], xb[i], n, w[i][k], bias[i][k], yp[k][i]));
            free(W);
            free(bv);
        }
        const pd_weight *ws[3] = {w[PAIR_GPU][0], w[PAIR_GPU][1], w[PAIR_GPU][2]};
        const pd_weight *bs[3] = {bias[PAIR_GPU][0], bias[PAIR_GPU][1], bias[PAIR_GPU][2]};
        ASSERT_OK(p.o[PAIR_GPU]->matmul_multi(p.b[PAIR_GPU], xb[PAIR_GPU], n, nw, ws, bs, yf));
        for (size_t k = 0; k < nw; k++) {
            size_t out = shapes[si][2 + k];
            int same = 0;
            double e;
            ASSERT_OK(gpu_same(&p, yf[k], yp[k][PAIR_GPU], n * out, &same));
            void *vs[2] = {yp[k][PAIR_CPU], yf[k]};
            ASSERT_OK(compare(&p, vs, n * out, &e));
            printf("    %s n %zu, in %zu, weight %zu of %zu (%zu rows): nmse vs CPU %.2e, %s\n",
                   mode < 0 ? "bf16" : "f32", n, in, k, nw, out, e,
                   same ? "= one by one" : "DIFFERS from one by one");
            ASSERT(same && e <= NMSE_MAX);
            for (int i = 0; i < 2; i++) {
                p.o[i]->weight_free(p.b[i], w[i][k]);
                if (bias[i][k]) p.o[i]->weight_free(p.b[i], bias[i][k]);
            }
            free_bufs(&p, yp[k]);
            p.o[PAIR_GPU]->buf_free(p.b[PAIR_GPU], yf[k]);
        }
        free_bufs(&p, xb);
        free(x);
    }
    ctu_pair_close(&p);
}

/* matmul_swiglu on the GPU (one GEMV launch ending in the SwiGLU where rows split over at most 2
 * warps, n <= 8) = matmul, matmul, swiglu on the GPU bit for bit, and the CPU's within
 * 2 x NMSE_MAX: in bf16 the result carries the error of two chained ops (gate and up rounded to
 * bf16, then the SwiGLU's own rounding), each checked alone against NMSE_MAX above; on the H100
 * the 154 values of n 2 x 77 rows gave 1.41e-5. */
static void fused_swiglu_case(int mode)
{
    cuda_pair p;
    ASSERT_OK(ctu_pair_open(&p, mode));
    static const size_t shapes[][3] = {/* n, in, rows: 1 warp per row, 2, 3 (plain), 6 (plain),
                                          cuBLAS (plain) */
                                       {1, 2048, 5632}, {5, 64, 96},   {3, 4096, 701},
                                       {2, 5632, 77},   {8, 12288, 5}, {64, 512, 128}};
    uint64_t seed = 27;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        size_t n = shapes[si][0], in = shapes[si][1], rows = shapes[si][2], ny = n * rows;
        float *x = malloc(n * in * 4), *wg = malloc(rows * in * 4), *wu = malloc(rows * in * 4);
        ASSERT(x && wg && wu);
        ctu_fill(x, n * in, &seed, 1.0f);
        ctu_fill(wg, rows * in, &seed, 0.5f);
        ctu_fill(wu, rows * in, &seed, 0.5f);
        pd_tensor tg = tensor_f32("gate_proj.weight", wg, rows, in);
        pd_tensor tu = tensor_f32("up_proj.weight", wu, rows, in);
        pd_weight *g_w[2], *u_w[2];
        void *xb[2] = {0}, *gb[2] = {0}, *ub[2] = {0}, *ob[2] = {0}, *gs = NULL, *us = NULL,
             *of = NULL;
        for (int i = 0; i < 2; i++) {
            ASSERT_OK(p.o[i]->weight_load(p.b[i], &tg, NULL, &g_w[i]));
            ASSERT_OK(p.o[i]->weight_load(p.b[i], &tu, NULL, &u_w[i]));
        }
        ASSERT_OK(upload_both(&p, x, n * in, xb));
        ASSERT_OK(alloc_both(&p, ny, gb));
        ASSERT_OK(alloc_both(&p, ny, ub));
        ASSERT_OK(alloc_both(&p, ny, ob));
        ASSERT_OK(ctu_act_alloc(p.b[PAIR_GPU], ny, &gs));
        ASSERT_OK(ctu_act_alloc(p.b[PAIR_GPU], ny, &us));
        ASSERT_OK(ctu_act_alloc(p.b[PAIR_GPU], ny, &of));
        for (int i = 0; i < 2; i++) {
            ASSERT_OK(p.o[i]->matmul(p.b[i], xb[i], n, g_w[i], NULL, gb[i]));
            ASSERT_OK(p.o[i]->matmul(p.b[i], xb[i], n, u_w[i], NULL, ub[i]));
            ASSERT_OK(p.o[i]->swiglu(p.b[i], gb[i], ub[i], n, rows, ob[i]));
        }
        ASSERT_OK(p.o[PAIR_GPU]->matmul_swiglu(p.b[PAIR_GPU], xb[PAIR_GPU], n, g_w[PAIR_GPU],
                                               u_w[PAIR_GPU], gs, us, of));
        int same = 0;
        double e;
        ASSERT_OK(gpu_same(&p, of, ob[PAIR_GPU], ny, &same));
        void *vs[2] = {ob[PAIR_CPU], of};
        ASSERT_OK(compare(&p, vs, ny, &e));
        printf("    %s matmul_swiglu n %zu, in %zu, %zu rows: nmse vs CPU %.2e, %s\n",
               mode < 0 ? "bf16" : "f32", n, in, rows, e,
               same ? "= matmul, matmul, swiglu" : "DIFFERS from matmul, matmul, swiglu");
        ASSERT(same && e <= 2 * NMSE_MAX);
        for (int i = 0; i < 2; i++) {
            p.o[i]->weight_free(p.b[i], g_w[i]);
            p.o[i]->weight_free(p.b[i], u_w[i]);
        }
        free_bufs(&p, xb);
        free_bufs(&p, gb);
        free_bufs(&p, ub);
        free_bufs(&p, ob);
        p.o[PAIR_GPU]->buf_free(p.b[PAIR_GPU], gs);
        p.o[PAIR_GPU]->buf_free(p.b[PAIR_GPU], us);
        p.o[PAIR_GPU]->buf_free(p.b[PAIR_GPU], of);
        free(x);
        free(wg);
        free(wu);
    }
    ctu_pair_close(&p);
}

/* add_rmsnorm on the GPU = add then rmsnorm on the GPU (residual and normed rows) bit for bit,
 * and the CPU's within NMSE_MAX. */
static void fused_norm_case(int mode)
{
    cuda_pair p;
    ASSERT_OK(ctu_pair_open(&p, mode));
    static const size_t shapes[][2] = {{1, 2048}, {7, 100}, {33, 4097}, {3, 12288}, {2, 16384}};
    uint64_t seed = 23;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        size_t n = shapes[si][0], dim = shapes[si][1], ne = n * dim;
        float *x = malloc(ne * sizeof(float)), *t = malloc(ne * sizeof(float));
        float *w = malloc(dim * sizeof(float));
        ASSERT(x && t && w);
        ctu_fill(x, ne, &seed, 3.0f);
        ctu_fill(t, ne, &seed, 3.0f);
        ctu_fill(w, dim, &seed, 2.0f);
        pd_tensor wt = tensor_f32("norm.weight", w, 0, dim);
        pd_weight *ww[2];
        void *xb[2] = {0}, *tb[2] = {0}, *hb[2] = {0}, *xf = NULL, *hf = NULL;
        for (int i = 0; i < 2; i++) ASSERT_OK(p.o[i]->weight_load(p.b[i], &wt, NULL, &ww[i]));
        ASSERT_OK(upload_both(&p, x, ne, xb));
        ASSERT_OK(upload_both(&p, t, ne, tb));
        ASSERT_OK(alloc_both(&p, ne, hb));
        ASSERT_OK(ctu_act_upload(p.b[PAIR_GPU], x, ne, &xf));
        ASSERT_OK(ctu_act_alloc(p.b[PAIR_GPU], ne, &hf));
        for (int i = 0; i < 2; i++) {
            ASSERT_OK(p.o[i]->add(p.b[i], xb[i], tb[i], ne));
            ASSERT_OK(p.o[i]->rmsnorm(p.b[i], xb[i], ww[i], 1e-5f, n, dim, hb[i]));
        }
        ASSERT_OK(p.o[PAIR_GPU]->add_rmsnorm(p.b[PAIR_GPU], xf, tb[PAIR_GPU], ww[PAIR_GPU], 1e-5f,
                                             n, dim, hf));
        int same_x = 0, same_h = 0;
        double e;
        ASSERT_OK(gpu_same(&p, xf, xb[PAIR_GPU], ne, &same_x));
        ASSERT_OK(gpu_same(&p, hf, hb[PAIR_GPU], ne, &same_h));
        void *vs[2] = {hb[PAIR_CPU], hf};
        ASSERT_OK(compare(&p, vs, ne, &e));
        printf("    %s add_rmsnorm (%zu, %zu): nmse vs CPU %.2e, sum %s, normed %s\n",
               mode < 0 ? "bf16" : "f32", n, dim, e, same_x ? "=" : "DIFFERS",
               same_h ? "=" : "DIFFERS");
        ASSERT(same_x && same_h && e <= NMSE_MAX);
        for (int i = 0; i < 2; i++) p.o[i]->weight_free(p.b[i], ww[i]);
        free_bufs(&p, xb);
        free_bufs(&p, tb);
        free_bufs(&p, hb);
        p.o[PAIR_GPU]->buf_free(p.b[PAIR_GPU], xf);
        p.o[PAIR_GPU]->buf_free(p.b[PAIR_GPU], hf);
        free(x);
        free(t);
        free(w);
    }
    ctu_pair_close(&p);
}

/* Layer 1 of kv (nblk whole blocks of nkv heads x D) as f32 into out (2 * nblk * 16 * nkv * D). */
static int pool_layer_f32(pd_backend *b, pd_kv *kv, size_t nblk, size_t nkv, size_t D, float *out)
{
    const pd_backend_ops *o = pd_backend_get_ops(b);
    size_t ne = 2 * nblk * 16 * nkv * D;
    int32_t *ids = malloc(nblk * 4);
    uint16_t *raw = malloc(ne * 2);
    int rc = ids && raw ? PD_OK : pd_error(PD_ENOMEM, "out of memory");
    for (size_t i = 0; ids && i < nblk; i++) ids[i] = (int32_t)i;
    pd_kv_range rg = {1, ids, nblk, 0, nkv};
    int f32 = pd_backend_act_dtype(b) == PD_DTYPE_F32;
    if (rc == PD_OK) rc = o->kv_export(b, kv, &rg, f32 ? (void *)out : (void *)raw);
    if (rc == PD_OK) rc = o->sync(b);
    if (rc == PD_OK && !f32) pd_bf16_to_f32_n(raw, out, ne);
    free(ids);
    free(raw);
    return rc;
}

/* The three arms of a rotary + KV-write comparison (CPU, GPU plain, GPU fused: backends kb,
 * pools kv, rotated q of nq_elems elements): whether the fused GPU arm's q and pool (layer 1,
 * nblk blocks) equal the plain GPU arm's bit for bit, and their NMSE against the CPU's. */
typedef struct {
    int same_q, same_kv;
    double e_q, e_kv;
} rope_verdict;

static int rope_kv_compare(cuda_pair *p, pd_backend *const kb[3], pd_kv *const kv[3],
                           void *const q[3], size_t nq_elems, size_t nblk, size_t nkv, size_t D,
                           rope_verdict *v)
{
    PD_CHECK(gpu_same(p, q[2], q[1], nq_elems, &v->same_q));
    void *qs[2] = {q[0], q[2]};
    PD_CHECK(compare(p, qs, nq_elems, &v->e_q));
    size_t ne = 2 * nblk * 16 * nkv * D;
    float *pool[3] = {malloc(ne * 4), malloc(ne * 4), malloc(ne * 4)};
    int rc = pool[0] && pool[1] && pool[2] ? PD_OK : pd_error(PD_ENOMEM, "out of memory");
    for (int i = 0; i < 3 && rc == PD_OK; i++)
        rc = pool_layer_f32(kb[i], kv[i], nblk, nkv, D, pool[i]);
    if (rc == PD_OK) {
        v->same_kv = memcmp(pool[1], pool[2], ne * 4) == 0;
        v->e_kv = ctu_nmse(pool[2], pool[0], ne);
    }
    for (int i = 0; i < 3; i++) free(pool[i]);
    return rc;
}

/* rope_kv_write on the GPU = rope, rope, kv_write on the GPU (q and the pool) bit for bit, and the
 * CPU's within NMSE_MAX; a head_dim other than the planned rope_dim is refused. */
static void fused_rope_kv_case(int mode)
{
    cuda_pair p;
    ASSERT_OK(ctu_pair_open(&p, mode));
    /* n, q heads, kv heads, head_dim (36: 18 pairs, rotated 1 per thread, not 16 bytes) */
    static const size_t shapes[][4] = {
        {1, 32, 4, 64}, {37, 12, 4, 128}, {300, 8, 1, 64}, {7, 6, 2, 36}};
    uint64_t seed = 25;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        size_t n = shapes[si][0], nq = shapes[si][1], nkv = shapes[si][2], D = shapes[si][3];
        size_t nblk = (n + 15) / 16 + 2;
        simple_step st;
        ASSERT_OK(simple_step_make(&st, n, 100, D, &seed));
        float *q = malloc(n * nq * D * 4), *k = malloc(n * nkv * D * 4),
              *v = malloc(n * nkv * D * 4);
        ASSERT(q && k && v);
        ctu_fill(q, n * nq * D, &seed, 2.0f);
        ctu_fill(k, n * nkv * D, &seed, 2.0f);
        ctu_fill(v, n * nkv * D, &seed, 2.0f);
        pd_kv *kv[3]; /* CPU, GPU plain, GPU fused */
        pd_backend *kb[3] = {p.b[PAIR_CPU], p.b[PAIR_GPU], p.b[PAIR_GPU]};
        void *qb[3], *kbuf[3], *vb[3];
        for (int i = 0; i < 3; i++) {
            const pd_backend_ops *o = pd_backend_get_ops(kb[i]);
            pd_kv_params kp = {2, nblk, 16, nkv, D, pd_backend_act_dtype(kb[i])};
            ASSERT_OK(o->kv_create(kb[i], &kp, &kv[i]));
            ASSERT_OK(ctu_act_upload(kb[i], q, n * nq * D, &qb[i]));
            ASSERT_OK(ctu_act_upload(kb[i], k, n * nkv * D, &kbuf[i]));
            ASSERT_OK(ctu_act_upload(kb[i], v, n * nkv * D, &vb[i]));
            ASSERT_OK(o->plan(kb[i], &st.b));
            if (i == 2) {
                ASSERT_OK(o->rope_kv_write(kb[i], kv[i], 1, qb[i], nq, kbuf[i], vb[i]));
                continue;
            }
            ASSERT_OK(o->rope(kb[i], qb[i], nq, D));
            ASSERT_OK(o->rope(kb[i], kbuf[i], nkv, D));
            ASSERT_OK(o->kv_write(kb[i], kv[i], 1, kbuf[i], vb[i]));
        }
        rope_verdict rv;
        ASSERT_OK(rope_kv_compare(&p, kb, kv, qb, n * nq * D, nblk, nkv, D, &rv));
        printf("    %s rope_kv_write n %zu, %zu/%zu heads x %zu: nmse vs CPU q %.2e, kv %.2e; q "
               "%s, pool %s\n",
               mode < 0 ? "bf16" : "f32", n, nq, nkv, D, rv.e_q, rv.e_kv,
               rv.same_q ? "=" : "DIFFERS", rv.same_kv ? "=" : "DIFFERS");
        ASSERT(rv.same_q && rv.same_kv && rv.e_q <= NMSE_MAX && rv.e_kv <= NMSE_MAX);
        if (si == 0) {
            pd_kv_params kp = {1, 4, 16, nkv, D / 2, pd_backend_act_dtype(p.b[PAIR_GPU])};
            pd_kv *narrow;
            ASSERT_OK(p.o[PAIR_GPU]->kv_create(p.b[PAIR_GPU], &kp, &narrow));
            ASSERT_ERR(
                p.o[PAIR_GPU]->rope_kv_write(p.b[PAIR_GPU], narrow, 0, qb[2], nq, kbuf[2], vb[2]),
                PD_EINVAL, "planned rope_dim");
            p.o[PAIR_GPU]->kv_free(p.b[PAIR_GPU], narrow);
        }
        for (int i = 0; i < 3; i++) {
            const pd_backend_ops *o = pd_backend_get_ops(kb[i]);
            o->buf_free(kb[i], qb[i]);
            o->buf_free(kb[i], kbuf[i]);
            o->buf_free(kb[i], vb[i]);
            o->kv_free(kb[i], kv[i]);
        }
        free(q);
        free(k);
        free(v);
        simple_step_free(&st);
    }
    ctu_pair_close(&p);
}

/* qkv_rope_kv_write on the GPU (decode rows: one GEMV launch rotating q and k and writing the
 * pool in its epilogue) = matmul_multi then rope_kv_write on the GPU (q and the pool) bit for
 * bit, and the plain ops on the CPU within NMSE_MAX; shapes with 1 and 2 warps per row, a head
 * of 36 (18 pairs, 2 per block), biases, and rows of 3 warps and prefill rows (n > 8), which
 * take the two ops' launches. */
static void fused_qkv_rope_case(int mode)
{
    cuda_pair p;
    ASSERT_OK(ctu_pair_open(&p, mode));
    /* n, in, q heads, kv heads, head_dim, with biases */
    static const size_t shapes[][6] = {{1, 2048, 32, 4, 64, 0},
                                       {3, 4096, 8, 2, 128, 1},
                                       {8, 64, 6, 2, 36, 1},
                                       {2, 5632, 4, 2, 64, 0},
                                       {20, 256, 4, 2, 64, 1}};
    uint64_t seed = 29;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        size_t n = shapes[si][0], in = shapes[si][1], nq = shapes[si][2], nkv = shapes[si][3],
               D = shapes[si][4], nblk = (n + 15) / 16 + 2;
        size_t rows[3] = {nq * D, nkv * D, nkv * D};
        simple_step st;
        ASSERT_OK(simple_step_make(&st, n, 100, D, &seed));
        float *x = malloc(n * in * 4);
        ASSERT(x);
        ctu_fill(x, n * in, &seed, 1.0f);
        pd_backend *kb[3] = {p.b[PAIR_CPU], p.b[PAIR_GPU], p.b[PAIR_GPU]}; /* CPU, plain, fused */
        pd_weight *w[3][3], *bias[3][3];
        void *xb[3], *y[3][3];
        pd_kv *kv[3];
        for (int m = 0; m < 3; m++) {
            float *W = malloc(rows[m] * in * 4), *bv = malloc(rows[m] * 4);
            ASSERT(W && bv);
            ctu_fill(W, rows[m] * in, &seed, 0.5f);
            ctu_fill(bv, rows[m], &seed, 1.0f);
            pd_tensor wt = tensor_f32("proj.weight", W, rows[m], in);
            pd_tensor bt = tensor_f32("proj.bias", bv, 0, rows[m]);
            for (int i = 0; i < 3; i++) {
                const pd_backend_ops *o = pd_backend_get_ops(kb[i]);
                ASSERT_OK(o->weight_load(kb[i], &wt, NULL, &w[i][m]));
                bias[i][m] = NULL;
                if (shapes[si][5]) ASSERT_OK(o->weight_load(kb[i], &bt, NULL, &bias[i][m]));
                ASSERT_OK(ctu_act_alloc(kb[i], n * rows[m], &y[i][m]));
            }
            free(W);
            free(bv);
        }
        for (int i = 0; i < 3; i++) {
            const pd_backend_ops *o = pd_backend_get_ops(kb[i]);
            pd_kv_params kp = {2, nblk, 16, nkv, D, pd_backend_act_dtype(kb[i])};
            ASSERT_OK(o->kv_create(kb[i], &kp, &kv[i]));
            ASSERT_OK(ctu_act_upload(kb[i], x, n * in, &xb[i]));
            ASSERT_OK(o->plan(kb[i], &st.b));
            const pd_weight *ws[3] = {w[i][0], w[i][1], w[i][2]};
            const pd_weight *bs[3] = {bias[i][0], bias[i][1], bias[i][2]};
            if (i == 2) {
                ASSERT_OK(o->qkv_rope_kv_write(kb[i], kv[i], 1, xb[i], n, ws, bs, y[i][0], y[i][1],
                                               y[i][2]));
            } else if (i == 1) {
                ASSERT_OK(o->matmul_multi(kb[i], xb[i], n, 3, ws, bs, y[i]));
                ASSERT_OK(o->rope_kv_write(kb[i], kv[i], 1, y[i][0], nq, y[i][1], y[i][2]));
            } else {
                for (int m = 0; m < 3; m++)
                    ASSERT_OK(o->matmul(kb[i], xb[i], n, ws[m], bs[m], y[i][m]));
                ASSERT_OK(o->rope(kb[i], y[i][0], nq, D));
                ASSERT_OK(o->rope(kb[i], y[i][1], nkv, D));
                ASSERT_OK(o->kv_write(kb[i], kv[i], 1, y[i][1], y[i][2]));
            }
        }
        void *qs[3] = {y[0][0], y[1][0], y[2][0]};
        rope_verdict rv;
        ASSERT_OK(rope_kv_compare(&p, kb, kv, qs, n * rows[0], nblk, nkv, D, &rv));
        printf("    %s qkv_rope_kv_write n %zu, in %zu, %zu/%zu heads x %zu%s: nmse vs CPU q %.2e, "
               "kv %.2e; q %s, pool %s\n",
               mode < 0 ? "bf16" : "f32", n, in, nq, nkv, D, shapes[si][5] ? ", biases" : "",
               rv.e_q, rv.e_kv, rv.same_q ? "=" : "DIFFERS", rv.same_kv ? "=" : "DIFFERS");
        ASSERT(rv.same_q && rv.same_kv && rv.e_q <= NMSE_MAX && rv.e_kv <= NMSE_MAX);
        for (int i = 0; i < 3; i++) {
            const pd_backend_ops *o = pd_backend_get_ops(kb[i]);
            for (int m = 0; m < 3; m++) {
                o->weight_free(kb[i], w[i][m]);
                if (bias[i][m]) o->weight_free(kb[i], bias[i][m]);
                o->buf_free(kb[i], y[i][m]);
            }
            o->buf_free(kb[i], xb[i]);
            o->kv_free(kb[i], kv[i]);
        }
        free(x);
        simple_step_free(&st);
    }
    ctu_pair_close(&p);
}

/* The norm_* ops on the GPU (decode rows: the projection's GEMV computes the norm, and writes
 * the residual sum, itself) = add, rmsnorm, then matmul_swiglu / qkv_rope_kv_write on the GPU bit
 * for bit: the SwiGLU output, q, the pool and the sum; x is left as it was. Shapes: the 1b decode
 * shape (256 norm threads), a short row, no add (the first layer); rows the GEMVs do not take,
 * where the norm kernel runs first: 6 warps a row (in 12288, also 2 chunks per norm thread), 3
 * warps, and prefill rows (n > 8). */
static void norm_proj_case(int mode)
{
    cuda_pair p;
    ASSERT_OK(ctu_pair_open(&p, mode));
    pd_backend *b = p.b[PAIR_GPU];
    const pd_backend_ops *o = p.o[PAIR_GPU];
    ASSERT(o->norm_matmul_swiglu && o->norm_qkv_rope_kv_write);
    /* n, in, add, SwiGLU rows, q heads, kv heads, head_dim */
    static const size_t shapes[][7] = {{1, 2048, 1, 5632, 32, 4, 64}, {3, 64, 1, 96, 4, 2, 16},
                                       {2, 12288, 1, 64, 4, 2, 64},   {1, 2048, 0, 256, 8, 2, 64},
                                       {2, 5632, 1, 77, 4, 2, 64},    {20, 256, 1, 128, 4, 2, 64}};
    uint64_t seed = 31;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const size_t n = shapes[si][0], in = shapes[si][1], rows = shapes[si][3];
        const size_t nq = shapes[si][4], nkv = shapes[si][5], D = shapes[si][6];
        const size_t ne = n * in, nblk = (n + 15) / 16 + 1,
                     qkv_rows[3] = {nq * D, nkv * D, nkv * D};
        const int add = (int)shapes[si][2];
        float *host[3] = {malloc(ne * 4), malloc(ne * 4), malloc(in * 4)}; /* x, t, norm */
        ASSERT(host[0] && host[1] && host[2]);
        ctu_fill(host[0], ne, &seed, 3.0f);
        ctu_fill(host[1], ne, &seed, 3.0f);
        ctu_fill(host[2], in, &seed, 2.0f);
        pd_tensor nt = tensor_f32("norm.weight", host[2], 0, in);
        pd_weight *nw, *w[5]; /* gate, up, q, k, v */
        ASSERT_OK(o->weight_load(b, &nt, NULL, &nw));
        for (int m = 0; m < 5; m++) {
            size_t r = m < 2 ? rows : qkv_rows[m - 2];
            float *W = malloc(r * in * 4);
            ASSERT(W);
            ctu_fill(W, r * in, &seed, 0.5f);
            pd_tensor wt = tensor_f32("proj.weight", W, r, in);
            ASSERT_OK(o->weight_load(b, &wt, NULL, &w[m]));
            free(W);
        }
        simple_step st;
        ASSERT_OK(simple_step_make(&st, n, 100, D, &seed));
        ASSERT_OK(o->plan(b, &st.b));
        /* arm 0: the plain sequence; arm 1: the norm ops. xs[0] is summed in place, xs[1] kept. */
        void *xs[2], *t, *xo, *x0, *h[2], *g[2], *u[2], *y[2], *q[2], *k[2], *v[2];
        pd_kv *kv[2];
        ASSERT_OK(ctu_act_upload(b, host[1], ne, &t));
        ASSERT_OK(ctu_act_upload(b, host[0], ne, &x0));
        ASSERT_OK(ctu_act_alloc(b, ne, &xo));
        for (int a = 0; a < 2; a++) {
            ASSERT_OK(ctu_act_upload(b, host[0], ne, &xs[a]));
            ASSERT_OK(ctu_act_alloc(b, ne, &h[a]));
            ASSERT_OK(ctu_act_alloc(b, n * rows, &g[a]));
            ASSERT_OK(ctu_act_alloc(b, n * rows, &u[a]));
            ASSERT_OK(ctu_act_alloc(b, n * rows, &y[a]));
            ASSERT_OK(ctu_act_alloc(b, n * qkv_rows[0], &q[a]));
            ASSERT_OK(ctu_act_alloc(b, n * qkv_rows[1], &k[a]));
            ASSERT_OK(ctu_act_alloc(b, n * qkv_rows[1], &v[a]));
            pd_kv_params kp = {2, nblk, 16, nkv, D, pd_backend_act_dtype(b)};
            ASSERT_OK(o->kv_create(b, &kp, &kv[a]));
        }
        const pd_weight *qkv[3] = {w[2], w[3], w[4]}, *nob[3] = {NULL, NULL, NULL};
        if (add) ASSERT_OK(o->add(b, xs[0], t, ne));
        ASSERT_OK(o->rmsnorm(b, xs[0], nw, 1e-5f, n, in, h[0]));
        ASSERT_OK(o->matmul_swiglu(b, h[0], n, w[0], w[1], g[0], u[0], y[0]));
        ASSERT_OK(o->qkv_rope_kv_write(b, kv[0], 1, h[0], n, qkv, nob, q[0], k[0], v[0]));
        pd_norm_in pre = {xs[1], add ? t : NULL, add ? xo : NULL, nw, 1e-5f, h[1]};
        ASSERT_OK(o->norm_matmul_swiglu(b, &pre, n, w[0], w[1], g[1], u[1], y[1]));
        ASSERT_OK(o->norm_qkv_rope_kv_write(b, kv[1], 1, &pre, n, qkv, nob, q[1], k[1], v[1]));
        int same_y = 0, same_q = 0, same_sum = 1, same_x = 0;
        ASSERT_OK(gpu_same(&p, y[0], y[1], n * rows, &same_y));
        ASSERT_OK(gpu_same(&p, q[0], q[1], n * qkv_rows[0], &same_q));
        if (add) ASSERT_OK(gpu_same(&p, xo, xs[0], ne, &same_sum));
        ASSERT_OK(gpu_same(&p, xs[1], x0, ne, &same_x));
        size_t pe = 2 * nblk * 16 * nkv * D;
        float *pool[2] = {malloc(pe * 4), malloc(pe * 4)};
        ASSERT(pool[0] && pool[1]);
        for (int a = 0; a < 2; a++) ASSERT_OK(pool_layer_f32(b, kv[a], nblk, nkv, D, pool[a]));
        int same_kv = memcmp(pool[0], pool[1], pe * 4) == 0;
        printf("    %s norm ops n %zu, in %zu%s: swiglu %s, q %s, pool %s, sum %s, x %s\n",
               mode < 0 ? "bf16" : "f32", n, in, add ? ", add" : "", same_y ? "=" : "DIFFERS",
               same_q ? "=" : "DIFFERS", same_kv ? "=" : "DIFFERS", same_sum ? "=" : "DIFFERS",
               same_x ? "kept" : "CHANGED");
        ASSERT(same_y && same_q && same_kv && same_sum && same_x);
        /* the sum must not land on what the GEMV reads */
        pd_norm_in bad = pre;
        bad.x_out = xs[1];
        if (add)
            ASSERT_ERR(o->norm_matmul_swiglu(b, &bad, n, w[0], w[1], g[1], u[1], y[1]), PD_EINVAL,
                       "x_out must not be x");
        for (int a = 0; a < 2; a++) {
            void *bufs[] = {xs[a], h[a], g[a], u[a], y[a], q[a], k[a], v[a]};
            for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) o->buf_free(b, bufs[i]);
            o->kv_free(b, kv[a]);
            free(pool[a]);
        }
        o->buf_free(b, t);
        o->buf_free(b, xo);
        o->buf_free(b, x0);
        o->weight_free(b, nw);
        for (int m = 0; m < 5; m++) o->weight_free(b, w[m]);
        for (int i = 0; i < 3; i++) free(host[i]);
        simple_step_free(&st);
    }
    ctu_pair_close(&p);
}

TEST(cuda_fused_ops)
{
    NEED_GPU();
    fused_matmul_case(-1);
    fused_matmul_case(PD_DTYPE_F32);
    fused_swiglu_case(-1);
    fused_swiglu_case(PD_DTYPE_F32);
    fused_norm_case(-1);
    fused_norm_case(PD_DTYPE_F32);
    fused_rope_kv_case(-1);
    fused_rope_kv_case(PD_DTYPE_F32);
    fused_qkv_rope_case(-1);
    fused_qkv_rope_case(PD_DTYPE_F32);
    norm_proj_case(-1);
    norm_proj_case(PD_DTYPE_F32);
}
