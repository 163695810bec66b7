/* Every op of the CUDA backend against the CPU backend (test-backend-ops style): random
 * bf16-representable inputs, several shapes including odd sizes, NMSE <= 1e-5 against the CPU's
 * f32 results; attention with GQA ratios 1, 3, 8, head dims 64/96/128/256, block sizes 16 and 5,
 * mixed prefill/decode/chunked rows in one step over shuffled (non-contiguous) block tables and a
 * long decode context that takes the split (flash-decoding) path; KV export/import; the fused
 * ops (matmul_multi, matmul_swiglu, add_rmsnorm, rope_kv_write, qkv_rope_kv_write) bit for bit
 * against the plain GPU ops they stand for; and the errors the backend must return instead of
 * crashing. Exits 77 without a GPU. */
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#include "backend/cuda/cuda_backend.h"
#include "cuda_test_util.h"

#define NMSE_MAX 1e-5

#define NEED_GPU()                                                                                 \
    do {                                                                                           \
        if (!ctu_have_gpu()) SKIP(pd_last_error());                                                \
    } while (0)

/* A pd_tensor over host f32 data of shape (rows, cols) (rows 0: 1-D of cols). */
static pd_tensor tensor_f32(const char *name, const float *data, size_t rows, size_t cols)
{
    pd_tensor t;
    memset(&t, 0, sizeof t);
    t.name = name;
    t.dtype = PD_DTYPE_F32;
    if (rows) {
        t.ndim = 2;
        t.shape[0] = (int64_t)rows;
        t.shape[1] = (int64_t)cols;
    } else {
        t.ndim = 1;
        t.shape[0] = (int64_t)cols;
        rows = 1;
    }
    t.data = data;
    t.nbytes = rows * cols * sizeof(float);
    t.file = "test";
    return t;
}

/* Compares buffers bufs[0] (CPU) and bufs[1] (GPU) of n activations. */
static int compare(cuda_pair *p, void *bufs[2], size_t n, double *nmse)
{
    float *a = malloc(n * sizeof(float)), *r = malloc(n * sizeof(float));
    int rc = (a && r) ? PD_OK : pd_error(PD_ENOMEM, "compare: out of memory");
    if (rc == 0) rc = ctu_act_download(p->b[PAIR_CPU], bufs[PAIR_CPU], n, r);
    if (rc == 0) rc = ctu_act_download(p->b[PAIR_GPU], bufs[PAIR_GPU], n, a);
    if (rc == 0) *nmse = ctu_nmse(a, r, n);
    free(a);
    free(r);
    return rc;
}

static void free_bufs(cuda_pair *p, void *bufs[2])
{
    for (int i = 0; i < 2; i++)
        if (bufs[i]) p->o[i]->buf_free(p->b[i], bufs[i]);
    bufs[0] = bufs[1] = NULL;
}

static int upload_both(cuda_pair *p, const float *x, size_t n, void *bufs[2])
{
    for (int i = 0; i < 2; i++) PD_CHECK(ctu_act_upload(p->b[i], x, n, &bufs[i]));
    return PD_OK;
}

static int alloc_both(cuda_pair *p, size_t n, void *bufs[2])
{
    for (int i = 0; i < 2; i++) PD_CHECK(ctu_act_alloc(p->b[i], n, &bufs[i]));
    return PD_OK;
}

/* mode: -1 = bf16 activations (default), PD_DTYPE_F32 = the f32 precision mode */
static void elementwise_case(int mode)
{
    cuda_pair p;
    ASSERT_OK(ctu_pair_open(&p, mode));
    /* 2048 .. 16384: the register-resident kernel's block sizes; the rest the general one */
    static const size_t shapes[][2] = {{1, 64},    {7, 100},  {33, 4097}, {130, 2048},
                                       {3, 12288}, {2, 6144}, {2, 16384}};
    uint64_t seed = 1;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        size_t n = shapes[si][0], dim = shapes[si][1], ne = n * dim;
        float *x = malloc(ne * sizeof(float)), *x2 = malloc(ne * sizeof(float));
        float *w = malloc(dim * sizeof(float));
        ASSERT(x && x2 && w);
        ctu_fill(x, ne, &seed, 3.0f);
        ctu_fill(x2, ne, &seed, 3.0f);
        ctu_fill(w, dim, &seed, 2.0f);
        pd_tensor wt = tensor_f32("norm.weight", w, 0, dim);
        pd_weight *ww[2];
        void *xb[2] = {0}, *x2b[2] = {0}, *yb[2] = {0};
        double e_norm, e_norm_inplace, e_swiglu, e_add;
        for (int i = 0; i < 2; i++) ASSERT_OK(p.o[i]->weight_load(p.b[i], &wt, NULL, &ww[i]));
        ASSERT_OK(upload_both(&p, x, ne, xb));
        ASSERT_OK(upload_both(&p, x2, ne, x2b));
        ASSERT_OK(alloc_both(&p, ne, yb));
        for (int i = 0; i < 2; i++)
            ASSERT_OK(p.o[i]->rmsnorm(p.b[i], xb[i], ww[i], 1e-6f, n, dim, yb[i]));
        ASSERT_OK(compare(&p, yb, ne, &e_norm));
        for (int i = 0; i < 2; i++) /* in place on x2 */
            ASSERT_OK(p.o[i]->rmsnorm(p.b[i], x2b[i], ww[i], 1e-5f, n, dim, x2b[i]));
        ASSERT_OK(compare(&p, x2b, ne, &e_norm_inplace));
        for (int i = 0; i < 2; i++) ASSERT_OK(p.o[i]->swiglu(p.b[i], xb[i], x2b[i], n, dim, yb[i]));
        ASSERT_OK(compare(&p, yb, ne, &e_swiglu));
        for (int i = 0; i < 2; i++) ASSERT_OK(p.o[i]->add(p.b[i], yb[i], xb[i], ne));
        ASSERT_OK(compare(&p, yb, ne, &e_add));
        printf("    %s (%zu, %zu): nmse rmsnorm %.2e, in-place %.2e, swiglu %.2e, add %.2e\n",
               pd_dtype_name(pd_backend_act_dtype(p.b[PAIR_GPU])), n, dim, e_norm, e_norm_inplace,
               e_swiglu, e_add);
        ASSERT(e_norm <= NMSE_MAX && e_norm_inplace <= NMSE_MAX);
        ASSERT(e_swiglu <= NMSE_MAX && e_add <= NMSE_MAX);
        for (int i = 0; i < 2; i++) p.o[i]->weight_free(p.b[i], ww[i]);
        free_bufs(&p, xb);
        free_bufs(&p, x2b);
        free_bufs(&p, yb);
        free(x);
        free(x2);
        free(w);
    }
    ctu_pair_close(&p);
}

TEST(cuda_rmsnorm_swiglu_add)
{
    NEED_GPU();
    elementwise_case(-1);
    elementwise_case(PD_DTYPE_F32);
}

/* matmul with bias or not, for one GPU weight dtype, over odd shapes and weight slices. */
static void matmul_case(int gpu_wdtype)
{
    cuda_pair p;
    ASSERT_OK(ctu_pair_open(&p, gpu_wdtype));
    /* n <= 8 with in % 8 == 0 takes the GEMV kernel, the others cuBLAS */
    static const size_t shapes[][3] = {{1, 64, 96},     {5, 100, 37},    {64, 512, 1408},
                                       {130, 257, 513}, {3, 2048, 4099}, {8, 256, 300},
                                       {2, 5632, 77},   {2, 20480, 33},  {1, 4096, 3},
                                       {7, 12288, 5}}; /* in > 2048: the GEMV split over warps */
    uint64_t seed = 7 + (uint64_t)gpu_wdtype;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        size_t n = shapes[si][0], in = shapes[si][1], out = shapes[si][2];
        /* The stored matrix has 3 extra rows and 2 extra cols; we load a slice of it. */
        size_t R = out + 3, C = in + 2;
        float *W = malloc(R * C * sizeof(float)), *x = malloc(n * in * sizeof(float));
        float *bias = malloc(out * sizeof(float));
        ASSERT(W && x && bias);
        ctu_fill(W, R * C, &seed, 0.5f);
        ctu_fill(x, n * in, &seed, 1.0f);
        ctu_fill(bias, out, &seed, 1.0f);
        pd_tensor wt = tensor_f32("proj.weight", W, R, C);
        pd_tensor bt = tensor_f32("proj.bias", bias, 0, out);
        pd_weight_slice sl = {2, out, 1, in};
        pd_weight *ww[2], *bw[2];
        void *xb[2] = {0}, *yb[2] = {0};
        for (int i = 0; i < 2; i++) {
            ASSERT_OK(p.o[i]->weight_load(p.b[i], &wt, &sl, &ww[i]));
            ASSERT_OK(p.o[i]->weight_load(p.b[i], &bt, NULL, &bw[i]));
        }
        ASSERT_OK(upload_both(&p, x, n * in, xb));
        ASSERT_OK(alloc_both(&p, n * out, yb));
        double e_plain, e_bias;
        for (int i = 0; i < 2; i++) ASSERT_OK(p.o[i]->matmul(p.b[i], xb[i], n, ww[i], NULL, yb[i]));
        ASSERT_OK(compare(&p, yb, n * out, &e_plain));
        for (int i = 0; i < 2; i++)
            ASSERT_OK(p.o[i]->matmul(p.b[i], xb[i], n, ww[i], bw[i], yb[i]));
        ASSERT_OK(compare(&p, yb, n * out, &e_bias));
        printf("    %s weights (%zu x %zu) . (%zu x %zu)^T: nmse %.2e, with bias %.2e\n",
               gpu_wdtype < 0 ? "default" : pd_dtype_name((pd_dtype)gpu_wdtype), n, in, out, in,
               e_plain, e_bias);
        ASSERT(e_plain <= NMSE_MAX && e_bias <= NMSE_MAX);
        for (int i = 0; i < 2; i++) {
            p.o[i]->weight_free(p.b[i], ww[i]);
            p.o[i]->weight_free(p.b[i], bw[i]);
        }
        free_bufs(&p, xb);
        free_bufs(&p, yb);
        free(W);
        free(x);
        free(bias);
    }
    ctu_pair_close(&p);
}

TEST(cuda_matmul_bf16)
{
    NEED_GPU();
    matmul_case(-1);
}

TEST(cuda_matmul_f16)
{
    NEED_GPU();
    matmul_case(PD_DTYPE_F16);
}

TEST(cuda_matmul_f32)
{
    NEED_GPU();
    matmul_case(PD_DTYPE_F32);
}

/* A single-sequence step of n rows at positions 0..n-1 with cos/sin tables for rope_dim. */
typedef struct {
    int32_t *tok, *pos, *qip, *kvl, *bip, *bid, *out_rows;
    int64_t *slots;
    float *cos_t, *sin_t;
    pd_batch b;
} simple_step;

static int simple_step_make(simple_step *s, size_t n, size_t vocab, size_t rope_dim, uint64_t *seed)
{
    memset(s, 0, sizeof *s);
    size_t half = rope_dim / 2, nblk = (n + 15) / 16;
    s->tok = calloc(n, 4);
    s->pos = calloc(n, 4);
    s->slots = calloc(n, 8);
    s->out_rows = calloc(n, 4);
    s->qip = calloc(2, 4);
    s->kvl = calloc(1, 4);
    s->bip = calloc(2, 4);
    s->bid = calloc(nblk, 4);
    s->cos_t = calloc(n * half, 4);
    s->sin_t = calloc(n * half, 4);
    if (!s->tok || !s->pos || !s->slots || !s->out_rows || !s->qip || !s->kvl || !s->bip ||
        !s->bid || !s->cos_t || !s->sin_t)
        return pd_error(PD_ENOMEM, "simple_step: out of memory");
    size_t n_out = 0;
    for (size_t r = 0; r < n; r++) {
        s->tok[r] =
            (int32_t)(((uint64_t)(ctu_rand(seed, 1.0f) + 1.0f) * 1000003u + r * 7919u) % vocab);
        s->pos[r] = (int32_t)r;
        s->slots[r] = (int64_t)r;
        if (r % 3 == 1 || r == n - 1) s->out_rows[n_out++] = (int32_t)r;
        for (size_t i = 0; i < half; i++) {
            double ang = (double)r * pow(10000.0, -2.0 * (double)i / (double)rope_dim);
            s->cos_t[r * half + i] = (float)cos(ang);
            s->sin_t[r * half + i] = (float)sin(ang);
        }
    }
    for (size_t i = 0; i < nblk; i++) s->bid[i] = (int32_t)i;
    s->qip[1] = (int32_t)n;
    s->kvl[0] = (int32_t)n;
    s->bip[1] = (int32_t)nblk;
    s->b.n_tokens = n;
    s->b.token_ids = s->tok;
    s->b.positions = s->pos;
    s->b.slots = s->slots;
    s->b.rope_cos = s->cos_t;
    s->b.rope_sin = s->sin_t;
    s->b.rope_dim = rope_dim;
    s->b.n_seqs = 1;
    s->b.q_indptr = s->qip;
    s->b.kv_len = s->kvl;
    s->b.block_indptr = s->bip;
    s->b.block_ids = s->bid;
    s->b.n_out = n_out;
    s->b.out_rows = s->out_rows;
    return PD_OK;
}

static void simple_step_free(simple_step *s)
{
    free(s->tok);
    free(s->pos);
    free(s->slots);
    free(s->out_rows);
    free(s->qip);
    free(s->kvl);
    free(s->bip);
    free(s->bid);
    free(s->cos_t);
    free(s->sin_t);
}

TEST(cuda_embed_rope_gather)
{
    NEED_GPU();
    cuda_pair p;
    ASSERT_OK(ctu_pair_open(&p, -1));
    static const size_t shapes[][4] = {/* n, vocab, heads, head_dim */
                                       {1, 50, 4, 64},
                                       {37, 1000, 3, 128},
                                       {300, 4096, 8, 96},
                                       {5, 77, 2, 256},
                                       {9, 60, 5, 36}}; /* 18 pairs: 1 per thread */
    uint64_t seed = 3;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        size_t n = shapes[si][0], V = shapes[si][1], nh = shapes[si][2], D = shapes[si][3];
        size_t H = nh * D;
        simple_step st;
        ASSERT_OK(simple_step_make(&st, n, V, D, &seed));
        float *table = malloc(V * H * sizeof(float)), *x = malloc(n * H * sizeof(float));
        ASSERT(table && x);
        ctu_fill(table, V * H, &seed, 1.0f);
        ctu_fill(x, n * H, &seed, 2.0f);
        pd_tensor tt = tensor_f32("embed_tokens.weight", table, V, H);
        pd_weight *tw[2];
        void *eb[2] = {0}, *xb[2] = {0}, *gb[2] = {0};
        for (int i = 0; i < 2; i++) {
            ASSERT_OK(p.o[i]->weight_load(p.b[i], &tt, NULL, &tw[i]));
            ASSERT_OK(p.o[i]->plan(p.b[i], &st.b));
        }
        ASSERT_OK(alloc_both(&p, n * H, eb));
        ASSERT_OK(upload_both(&p, x, n * H, xb));
        ASSERT_OK(alloc_both(&p, st.b.n_out * H, gb));
        double e_embed, e_rope, e_gather;
        for (int i = 0; i < 2; i++) ASSERT_OK(p.o[i]->embed(p.b[i], tw[i], eb[i]));
        ASSERT_OK(compare(&p, eb, n * H, &e_embed));
        for (int i = 0; i < 2; i++) ASSERT_OK(p.o[i]->rope(p.b[i], xb[i], nh, D));
        ASSERT_OK(compare(&p, xb, n * H, &e_rope));
        for (int i = 0; i < 2; i++) ASSERT_OK(p.o[i]->gather_rows(p.b[i], xb[i], H, gb[i]));
        ASSERT_OK(compare(&p, gb, st.b.n_out * H, &e_gather));
        printf("    n %zu, vocab %zu, %zu heads x %zu: nmse embed %.2e, rope %.2e, gather %.2e\n",
               n, V, nh, D, e_embed, e_rope, e_gather);
        ASSERT(e_embed == 0.0); /* a bf16-representable table is copied exactly */
        ASSERT(e_rope <= NMSE_MAX && e_gather <= NMSE_MAX);
        for (int i = 0; i < 2; i++) p.o[i]->weight_free(p.b[i], tw[i]);
        free_bufs(&p, eb);
        free_bufs(&p, xb);
        free_bufs(&p, gb);
        free(table);
        free(x);
        simple_step_free(&st);
    }
    ctu_pair_close(&p);
}

/* ---- attention ---------------------------------------------------------------------------------
 */

typedef struct {
    int past, rows; /* cached tokens before the step; rows the step adds */
} seq_spec;

typedef struct {
    size_t n_seqs, n_tokens, n_blk_total;
    int32_t *tok, *pos, *qip, *kvl, *bip, *bid;
    int64_t *slots;
    float *cos_t, *sin_t; /* (n_tokens, D / 2): identity rotation (attention tests skip rope) */
    pd_batch b;
} paged_step;

/* Rows of each sequence s at positions [from_s, to_s) with its block table (block ids from the
 * shuffled pool order `perm`, assigned per sequence in order). */
static int paged_step_make(paged_step *ps, const seq_spec *sp, size_t ns, int fill,
                           size_t block_size, const int32_t *perm, size_t D)
{
    memset(ps, 0, sizeof *ps);
    size_t n = 0, nb = 0;
    for (size_t s = 0; s < ns; s++) {
        n += (size_t)(fill ? sp[s].past : sp[s].rows);
        nb += ((size_t)(sp[s].past + sp[s].rows) + block_size - 1) / block_size;
    }
    ps->tok = calloc(n + 1, 4);
    ps->pos = calloc(n + 1, 4);
    ps->slots = calloc(n + 1, 8);
    ps->qip = calloc(ns + 1, 4);
    ps->kvl = calloc(ns + 1, 4);
    ps->bip = calloc(ns + 1, 4);
    ps->bid = calloc(nb + 1, 4);
    ps->cos_t = malloc((n + 1) * (D / 2) * sizeof(float));
    ps->sin_t = calloc((n + 1) * (D / 2), sizeof(float));
    if (!ps->tok || !ps->pos || !ps->slots || !ps->qip || !ps->kvl || !ps->bip || !ps->bid ||
        !ps->cos_t || !ps->sin_t)
        return pd_error(PD_ENOMEM, "paged_step: out of memory");
    size_t r = 0, bi = 0;
    for (size_t s = 0; s < ns; s++) {
        int total = sp[s].past + sp[s].rows;
        size_t nblk = ((size_t)total + block_size - 1) / block_size;
        for (size_t k = 0; k < nblk; k++) ps->bid[bi + k] = perm[bi + k];
        int p0 = fill ? 0 : sp[s].past, p1 = fill ? sp[s].past : total;
        for (int pos = p0; pos < p1; pos++, r++) {
            ps->pos[r] = pos;
            ps->tok[r] = pos % 13;
            ps->slots[r] = (int64_t)ps->bid[bi + (size_t)pos / block_size] * (int64_t)block_size +
                           (int64_t)((size_t)pos % block_size);
        }
        ps->qip[s + 1] = (int32_t)r;
        ps->kvl[s] = p1;
        bi += nblk;
        ps->bip[s + 1] = (int32_t)bi;
    }
    for (size_t i = 0; i < (n + 1) * (D / 2); i++) ps->cos_t[i] = 1.0f;
    ps->n_seqs = ns;
    ps->n_tokens = n;
    ps->b.rope_cos = ps->cos_t;
    ps->b.rope_sin = ps->sin_t;
    ps->b.rope_dim = D;
    ps->b.n_tokens = n;
    ps->b.token_ids = ps->tok;
    ps->b.positions = ps->pos;
    ps->b.slots = ps->slots;
    ps->b.n_seqs = ns;
    ps->b.q_indptr = ps->qip;
    ps->b.kv_len = ps->kvl;
    ps->b.block_indptr = ps->bip;
    ps->b.block_ids = ps->bid;
    return PD_OK;
}

static void paged_step_free(paged_step *ps)
{
    free(ps->tok);
    free(ps->pos);
    free(ps->slots);
    free(ps->qip);
    free(ps->kvl);
    free(ps->bip);
    free(ps->bid);
    free(ps->cos_t);
    free(ps->sin_t);
}

/* Writes random K/V for the step's rows into both pools (after plan). */
static int write_random_kv(cuda_pair *p, pd_kv *kv[2], int layer, size_t n, size_t kvh, size_t D,
                           uint64_t *seed)
{
    size_t ne = n * kvh * D;
    float *k = malloc((ne ? ne : 1) * sizeof(float)), *v = malloc((ne ? ne : 1) * sizeof(float));
    if (!k || !v) return pd_error(PD_ENOMEM, "write_random_kv: out of memory");
    ctu_fill(k, ne, seed, 2.0f);
    ctu_fill(v, ne, seed, 1.0f);
    int rc = PD_OK;
    for (int i = 0; i < 2 && rc == 0; i++) {
        void *kb = NULL, *vb = NULL;
        rc = ctu_act_upload(p->b[i], k, ne, &kb);
        if (rc == 0) rc = ctu_act_upload(p->b[i], v, ne, &vb);
        if (rc == 0) rc = p->o[i]->kv_write(p->b[i], kv[i], layer, kb, vb);
        if (rc == 0) rc = p->o[i]->sync(p->b[i]);
        if (kb) p->o[i]->buf_free(p->b[i], kb);
        if (vb) p->o[i]->buf_free(p->b[i], vb);
    }
    free(k);
    free(v);
    return rc;
}

static void attention_case_mode(int mode, size_t nqh, size_t kvh, size_t D, size_t bs,
                                const seq_spec *sp, size_t ns, const char *label)
{
    cuda_pair p;
    ASSERT_OK(ctu_pair_open(&p, mode));
    uint64_t seed = 11 + nqh * 131 + D;
    size_t n_blocks = 0;
    for (size_t s = 0; s < ns; s++) n_blocks += ((size_t)(sp[s].past + sp[s].rows) + bs - 1) / bs;
    n_blocks += 17; /* spare blocks so the shuffled ids are not a dense prefix */
    int32_t *perm = malloc(n_blocks * sizeof(int32_t));
    ASSERT(perm);
    for (size_t i = 0; i < n_blocks; i++) perm[i] = (int32_t)i;
    for (size_t i = n_blocks - 1; i > 0; i--) {
        size_t j = (size_t)((ctu_rand(&seed, 1.0f) + 1.0f) * 0.5f * (float)(i + 1)) % (i + 1);
        int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    pd_kv *kv[2];
    const int layer = 1;
    for (int i = 0; i < 2; i++) {
        pd_kv_params kp = {2, n_blocks, bs, kvh, D, pd_backend_act_dtype(p.b[i])};
        ASSERT_OK(p.o[i]->kv_create(p.b[i], &kp, &kv[i]));
    }
    paged_step fill, step;
    ASSERT_OK(paged_step_make(&fill, sp, ns, 1, bs, perm, D));
    ASSERT_OK(paged_step_make(&step, sp, ns, 0, bs, perm, D));
    /* the fill step cannot hold sequences without cached tokens: drop them from it */
    {
        size_t w = 0;
        for (size_t s = 0; s < ns; s++) {
            if (sp[s].past == 0) continue;
            int32_t b0 = fill.bip[s], b1 = fill.bip[s + 1];
            fill.kvl[w] = fill.kvl[s];
            fill.qip[w + 1] = fill.qip[s + 1];
            memmove(fill.bid + fill.bip[w], fill.bid + b0, (size_t)(b1 - b0) * 4);
            fill.bip[w + 1] = fill.bip[w] + (b1 - b0);
            w++;
        }
        fill.b.n_seqs = w;
    }
    if (fill.b.n_seqs) {
        for (int i = 0; i < 2; i++) ASSERT_OK(p.o[i]->plan(p.b[i], &fill.b));
        ASSERT_OK(write_random_kv(&p, kv, layer, fill.n_tokens, kvh, D, &seed));
    }
    for (int i = 0; i < 2; i++) ASSERT_OK(p.o[i]->plan(p.b[i], &step.b));
    ASSERT_OK(write_random_kv(&p, kv, layer, step.n_tokens, kvh, D, &seed));
    size_t nq = step.n_tokens * nqh * D;
    float *q = malloc(nq * sizeof(float));
    ASSERT(q);
    ctu_fill(q, nq, &seed, 2.0f);
    void *qb[2] = {0}, *ob[2] = {0};
    ASSERT_OK(upload_both(&p, q, nq, qb));
    ASSERT_OK(alloc_both(&p, nq, ob));
    float scale = 1.0f / sqrtf((float)D);
    for (int i = 0; i < 2; i++)
        ASSERT_OK(p.o[i]->attention(p.b[i], kv[i], layer, qb[i], nqh, scale, ob[i]));
    double e;
    ASSERT_OK(compare(&p, ob, nq, &e));
    /* a second call in the same step reuses the work list and must agree */
    double e2;
    ASSERT_OK(p.o[PAIR_GPU]->attention(p.b[PAIR_GPU], kv[PAIR_GPU], layer, qb[PAIR_GPU], nqh, scale,
                                       ob[PAIR_GPU]));
    ASSERT_OK(compare(&p, ob, nq, &e2));
    printf("    %s (%s): %zu q heads / %zu kv heads x %zu, block %zu, %zu rows: nmse %.2e\n", label,
           pd_dtype_name(pd_backend_act_dtype(p.b[PAIR_GPU])), nqh, kvh, D, bs, step.n_tokens, e);
    ASSERT(e <= NMSE_MAX && e2 == e);
    free_bufs(&p, qb);
    free_bufs(&p, ob);
    free(q);
    paged_step_free(&fill);
    paged_step_free(&step);
    for (int i = 0; i < 2; i++) p.o[i]->kv_free(p.b[i], kv[i]);
    free(perm);
    ctu_pair_close(&p);
}

static void attention_case(size_t nqh, size_t kvh, size_t D, size_t bs, const seq_spec *sp,
                           size_t ns, const char *label)
{
    attention_case_mode(-1, nqh, kvh, D, bs, sp, ns, label);
}

/* prefill from 0, decode at 700, chunked prefill continuation, long decode, short decode */
static const seq_spec k_mixed[] = {{0, 37}, {700, 1}, {20, 5}, {3000, 1}, {100, 1}};

TEST(cuda_attention_mixed_gqa8)
{
    NEED_GPU();
    attention_case(32, 4, 64, 16, k_mixed, 5, "mixed");
}

TEST(cuda_attention_mixed_gqa8_f32_mode)
{
    NEED_GPU();
    attention_case_mode(PD_DTYPE_F32, 32, 4, 64, 16, k_mixed, 5, "mixed");
}

TEST(cuda_attention_mixed_mha)
{
    NEED_GPU();
    attention_case(8, 8, 64, 16, k_mixed, 5, "mixed");
}

TEST(cuda_attention_mixed_gqa3_d128_bs5)
{
    NEED_GPU();
    attention_case(12, 4, 128, 5, k_mixed, 5, "mixed");
}

TEST(cuda_attention_d96_d256)
{
    NEED_GPU();
    static const seq_spec s[] = {{0, 70}, {333, 1}, {64, 33}};
    attention_case(16, 2, 96, 16, s, 3, "d96");
    attention_case(8, 1, 256, 16, s, 3, "d256");
}

/* head_dim not a multiple of 8 (bf16) or 4 (f32): the scalar chunk path; 200: wide heads */
TEST(cuda_attention_odd_head_dims)
{
    NEED_GPU();
    static const seq_spec s[] = {{0, 70}, {333, 1}, {64, 33}, {1500, 1}};
    attention_case(8, 2, 36, 16, s, 4, "d36");
    attention_case_mode(PD_DTYPE_F32, 8, 2, 34, 16, s, 4, "d34 f32");
    attention_case_mode(PD_DTYPE_F32, 8, 2, 36, 5, s, 4, "d36 f32, block 5");
    attention_case(16, 2, 200, 16, s, 4, "d200");
}

TEST(cuda_attention_long_decode_split)
{
    NEED_GPU();
    static const seq_spec one[] = {{5000, 1}};
    attention_case(32, 4, 64, 16, one, 1, "one long decode (split)");
    static const seq_spec two[] = {{2047, 1}, {4100, 1}};
    attention_case(32, 8, 128, 16, two, 2, "two long decodes (split)");
}

TEST(cuda_attention_long_prefill)
{
    NEED_GPU();
    static const seq_spec s[] = {{0, 1000}, {500, 300}};
    attention_case(32, 4, 64, 16, s, 2, "prefill 1000 + chunk 300");
}

/* The older WMMA prefill kernel (PD_CUDA_ATTN_TC=wmma, read when a backend is created) on the
 * tensor-core shapes above; the default runs the mma.sync kernel. */
TEST(cuda_attention_prefill_wmma_kernel)
{
    NEED_GPU();
    setenv("PD_CUDA_ATTN_TC", "wmma", 1);
    attention_case(32, 4, 64, 16, k_mixed, 5, "mixed, wmma");
    attention_case(12, 4, 128, 5, k_mixed, 5, "mixed d128 block 5, wmma");
    static const seq_spec s[] = {{0, 1000}, {500, 300}};
    attention_case(32, 4, 64, 16, s, 2, "prefill 1000 + chunk 300, wmma");
    unsetenv("PD_CUDA_ATTN_TC");
}

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

/* ---- KV export / import
 * -------------------------------------------------------------------------- */

TEST(cuda_kv_export_import)
{
    NEED_GPU();
    cuda_pair p;
    ASSERT_OK(ctu_pair_open(&p, -1));
    const size_t kvh = 4, D = 64, bs = 16, nblocks = 40;
    static const seq_spec sp[] = {{0, 150}};
    int32_t perm[64];
    for (int i = 0; i < 64; i++) perm[i] = (i * 7 + 3) % (int)nblocks;
    pd_kv *kv[2];
    for (int i = 0; i < 2; i++) {
        pd_kv_params kp = {3, nblocks, bs, kvh, D, pd_backend_act_dtype(p.b[i])};
        ASSERT_OK(p.o[i]->kv_create(p.b[i], &kp, &kv[i]));
    }
    paged_step st;
    ASSERT_OK(paged_step_make(&st, sp, 1, 0, bs, perm, D));
    for (int i = 0; i < 2; i++) ASSERT_OK(p.o[i]->plan(p.b[i], &st.b));
    uint64_t seed = 5;
    ASSERT_OK(write_random_kv(&p, kv, 2, st.n_tokens, kvh, D, &seed));
    /* export blocks 3 (consecutive run 10, 11 included) for heads [1, 3) and all heads */
    int32_t ids[] = {perm[0], perm[1], 10, 11, 12, perm[5]};
    const size_t nb = sizeof ids / sizeof ids[0];
    for (int full = 0; full < 2; full++) {
        pd_kv_range r = {2, ids, nb, full ? 0 : 1, full ? kvh : 2};
        size_t ne = 2 * nb * bs * r.n_heads * D;
        float *cpu = malloc(ne * sizeof(float)), *gpu32 = malloc(ne * sizeof(float));
        uint16_t *gpu = malloc(ne * 2), *back = malloc(ne * 2);
        ASSERT(cpu && gpu && gpu32 && back);
        ASSERT_OK(p.o[PAIR_CPU]->kv_export(p.b[PAIR_CPU], kv[PAIR_CPU], &r, cpu));
        ASSERT_OK(p.o[PAIR_CPU]->sync(p.b[PAIR_CPU]));
        ASSERT_OK(p.o[PAIR_GPU]->kv_export(p.b[PAIR_GPU], kv[PAIR_GPU], &r, gpu));
        ASSERT_OK(p.o[PAIR_GPU]->sync(p.b[PAIR_GPU]));
        pd_bf16_to_f32_n(gpu, gpu32, ne);
        ASSERT(ctu_nmse(gpu32, cpu, ne) == 0.0); /* bf16-representable values copy exactly */
        /* import into other blocks (reversed order) and export again */
        int32_t ids2[6];
        for (size_t i = 0; i < nb; i++) ids2[i] = (int32_t)(nblocks - 1 - i);
        pd_kv_range r2 = r;
        r2.layer = 0;
        r2.block_ids = ids2;
        ASSERT_OK(p.o[PAIR_GPU]->kv_import(p.b[PAIR_GPU], kv[PAIR_GPU], &r2, gpu));
        ASSERT_OK(p.o[PAIR_GPU]->kv_export(p.b[PAIR_GPU], kv[PAIR_GPU], &r2, back));
        ASSERT_OK(p.o[PAIR_GPU]->sync(p.b[PAIR_GPU]));
        ASSERT(memcmp(gpu, back, ne * 2) == 0);
        printf("    %s heads: %zu blocks exported (matches CPU) and re-imported\n",
               full ? "all" : "[1, 3)", nb);
        free(cpu);
        free(gpu);
        free(gpu32);
        free(back);
    }
    /* kv_layer view describes the same pool */
    pd_kv_layer_view view;
    ASSERT_OK(p.o[PAIR_GPU]->kv_layer(p.b[PAIR_GPU], kv[PAIR_GPU], 2, &view));
    ASSERT_EQ_INT(view.head_stride, D * 2);
    ASSERT_EQ_INT(view.block_stride, bs * kvh * D * 2);
    ASSERT_EQ_INT(view.host_visible, 0);
    /* bad ranges */
    int32_t bad_id[] = {(int32_t)nblocks};
    pd_kv_range bad = {2, bad_id, 1, 0, kvh};
    uint16_t tmp[2 * 16 * 4 * 64];
    ASSERT_ERR(p.o[PAIR_GPU]->kv_export(p.b[PAIR_GPU], kv[PAIR_GPU], &bad, tmp), PD_EINVAL,
               "block_ids[0]");
    pd_kv_range badh = {2, ids, 1, 3, 2};
    ASSERT_ERR(p.o[PAIR_GPU]->kv_import(p.b[PAIR_GPU], kv[PAIR_GPU], &badh, tmp), PD_EINVAL,
               "heads");
    pd_kv_range badl = {3, ids, 1, 0, 1};
    ASSERT_ERR(p.o[PAIR_GPU]->kv_export(p.b[PAIR_GPU], kv[PAIR_GPU], &badl, tmp), PD_EINVAL,
               "layer 3");
    paged_step_free(&st);
    for (int i = 0; i < 2; i++) p.o[i]->kv_free(p.b[i], kv[i]);
    ctu_pair_close(&p);
}

/* ---- errors
 * ---------------------------------------------------------------------------------------- */

TEST(cuda_errors)
{
    NEED_GPU();
    pd_backend_params bp = pd_backend_default_params();
    bp.max_tokens = 64;
    bp.max_seqs = 4;
    bp.max_blocks = 16;
    pd_backend *b;
    bp.weight_dtype = 7;
    ASSERT_ERR(pd_backend_cuda_create(&bp, &b), PD_EUNSUPPORTED, "weight_dtype 7");
    bp.weight_dtype = -1;
    bp.device = 99;
    ASSERT_ERR(pd_backend_cuda_create(&bp, &b), PD_ENOTFOUND, "device 99");
    bp.device = 0;
    ASSERT_OK(pd_backend_cuda_create(&bp, &b));
    const pd_backend_ops *o = pd_backend_get_ops(b);
    ASSERT_STR_EQ(o->name, "cuda");
    ASSERT_EQ_INT(pd_backend_act_dtype(b), PD_DTYPE_BF16);

    pd_kv *kv;
    pd_kv_params kp = {1, 4, 16, 2, 64, PD_DTYPE_F32};
    ASSERT_ERR(o->kv_create(b, &kp, &kv), PD_EUNSUPPORTED, "float32");
    kp.dtype = PD_DTYPE_BF16;
    ASSERT_OK(o->kv_create(b, &kp, &kv));

    uint64_t seed = 9;
    simple_step st;
    ASSERT_OK(simple_step_make(&st, 100, 50, 64, &seed));
    ASSERT_ERR(o->plan(b, &st.b), PD_ERANGE, "n_tokens 100");
    simple_step_free(&st);
    ASSERT_OK(simple_step_make(&st, 40, 50, 64, &seed));
    st.b.rope_dim = 512;
    ASSERT_ERR(o->plan(b, &st.b), PD_ERANGE, "rope_dim 512");
    st.b.rope_dim = 64;
    st.pos[5] = 3; /* positions must increase within a sequence */
    ASSERT_ERR(o->plan(b, &st.b), PD_EINVAL, "not increasing");
    st.pos[5] = 5;
    ASSERT_OK(o->plan(b, &st.b));
    /* 40 tokens need 3 blocks of 16: a table of 2 is refused at kv_write / attention */
    st.bip[1] = 2;
    ASSERT_OK(o->plan(b, &st.b));
    void *buf;
    ASSERT_OK(o->buf_alloc(b, 40 * 2 * 64 * 2, &buf));
    ASSERT_ERR(o->kv_write(b, kv, 0, buf, buf), PD_EINVAL, "needs 3 blocks");
    st.bip[1] = 3;
    st.slots[7] = 64; /* pool has 4 * 16 slots */
    ASSERT_OK(o->plan(b, &st.b));
    ASSERT_ERR(o->kv_write(b, kv, 0, buf, buf), PD_EINVAL, "slots[7]");
    ASSERT_ERR(o->attention(b, kv, 1, buf, 4, 0.1f, buf), PD_EINVAL, "layer 1");
    st.slots[7] = 7;
    ASSERT_OK(o->plan(b, &st.b));
    ASSERT_ERR(o->attention(b, kv, 0, buf, 3, 0.1f, buf), PD_EINVAL, "multiple of 2");
    ASSERT_ERR(o->rope(b, buf, 2, 32), PD_EINVAL, "rope_dim 64");

    float table[10 * 8];
    for (int i = 0; i < 80; i++) table[i] = (float)i;
    pd_tensor tt = tensor_f32("embed.weight", table, 10, 8);
    pd_weight *w;
    pd_weight_slice sl = {8, 3, 0, 0};
    ASSERT_ERR(o->weight_load(b, &tt, &sl, &w), PD_EINVAL, "embed.weight");
    ASSERT_OK(o->weight_load(b, &tt, NULL, &w));
    ASSERT_EQ_INT(o->weight_nbytes(b, w), 10 * 8 * 2);
    ASSERT_ERR(o->embed(b, w, buf), PD_EINVAL, "vocab 10"); /* token ids reach 49 */
    o->weight_free(b, w);
    ASSERT_OK(o->sync(b));

    /* KV-pool sizing by --gpu-memory-utilization */
    pd_kv_params kvp = {22, 0, 16, 4, 64, PD_DTYPE_BF16};
    size_t nblk = 0;
    ASSERT_ERR(pd_backend_cuda_kv_blocks(b, &kvp, 0.0, &nblk), PD_EINVAL, "not in (0, 1]");
    ASSERT_ERR(pd_backend_cuda_kv_blocks(b, &kvp, 1e-9, &nblk), PD_ENOMEM,
               "no room for one KV block");
    ASSERT_OK(pd_backend_cuda_kv_blocks(b, &kvp, 0.9, &nblk));
    printf("    --gpu-memory-utilization 0.9: %zu blocks of 16 tokens (22 layers, 4 x 64 bf16)\n",
           nblk);
    ASSERT(nblk >= 1);
    size_t nblk2 = 0;
    ASSERT_OK(pd_backend_cuda_kv_blocks(b, &kvp, 0.95, &nblk2));
    ASSERT(nblk2 > nblk);
    o->buf_free(b, buf);
    o->kv_free(b, kv);
    simple_step_free(&st);
    pd_backend_free(b);
}
