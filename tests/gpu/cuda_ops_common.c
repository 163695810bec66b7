/* Helpers of the CUDA op tests (declared in cuda_ops_common.h): host tensors, the same buffer on
 * both backends and their NMSE, and the batches of one step (a single sequence, or paged
 * sequences over a shuffled block table) with their K/V. */
#include "cuda_ops_common.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

pd_tensor tensor_f32(const char *name, const float *data, size_t rows, size_t cols)
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

int compare(cuda_pair *p, void *bufs[2], size_t n, double *nmse)
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

void free_bufs(cuda_pair *p, void *bufs[2])
{
    for (int i = 0; i < 2; i++)
        if (bufs[i]) p->o[i]->buf_free(p->b[i], bufs[i]);
    bufs[0] = bufs[1] = NULL;
}

int upload_both(cuda_pair *p, const float *x, size_t n, void *bufs[2])
{
    for (int i = 0; i < 2; i++) PD_CHECK(ctu_act_upload(p->b[i], x, n, &bufs[i]));
    return PD_OK;
}

int alloc_both(cuda_pair *p, size_t n, void *bufs[2])
{
    for (int i = 0; i < 2; i++) PD_CHECK(ctu_act_alloc(p->b[i], n, &bufs[i]));
    return PD_OK;
}

int simple_step_make(simple_step *s, size_t n, size_t vocab, size_t rope_dim, uint64_t *seed)
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

void simple_step_free(simple_step *s)
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

int paged_step_make(paged_step *ps, const seq_spec *sp, size_t ns, int fill, size_t block_size,
                    const int32_t *perm, size_t D)
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

void paged_step_free(paged_step *ps)
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

int write_random_kv(cuda_pair *p, pd_kv *kv[2], int layer, size_t n, size_t kvh, size_t D,
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
