/* Helpers of the GPU tests (see cuda_test_util.h). */
#include "cuda_test_util.h"

#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_info.h"
#include "util/hash.h"
#include "util/status.h"

int ctu_have_gpu(void)
{
    pd_cuda_info info;
    return pd_cuda_query(0, &info) == PD_OK;
}

int ctu_gpu_count(void)
{
    pd_cuda_info info;
    return pd_cuda_query(0, &info) == PD_OK ? info.device_count : 0;
}

pd_backend_params ctu_cpu_ref_params(void)
{
    pd_backend_params cp = pd_backend_default_params();
    cp.n_threads = 1;
    cp.weight_dtype = PD_DTYPE_F32;
    return cp;
}

int ctu_pair_open(cuda_pair *p, int gpu_weight_dtype)
{
    memset(p, 0, sizeof *p);
    pd_backend_params cp = ctu_cpu_ref_params();
    PD_CHECK(pd_backend_cpu_create(&cp, &p->b[PAIR_CPU]));
    pd_backend_params gp = pd_backend_default_params();
    gp.weight_dtype = gpu_weight_dtype;
    int rc = pd_backend_cuda_create(&gp, &p->b[PAIR_GPU]);
    if (rc < 0) {
        pd_backend_free(p->b[PAIR_CPU]);
        p->b[PAIR_CPU] = NULL;
        return rc;
    }
    for (int i = 0; i < 2; i++) p->o[i] = pd_backend_get_ops(p->b[i]);
    return PD_OK;
}

void ctu_pair_close(cuda_pair *p)
{
    for (int i = 0; i < 2; i++) pd_backend_free(p->b[i]);
    memset(p, 0, sizeof *p);
}

float ctu_rand(uint64_t *seed, float scale)
{
    uint64_t x = pd_mix64(*seed += 0x9e3779b97f4a7c15ull);
    float u = (float)(x >> 40) / (float)(1ull << 24); /* [0, 1) */
    return pd_bf16_to_f32(pd_f32_to_bf16((2.0f * u - 1.0f) * scale));
}

void ctu_fill(float *x, size_t n, uint64_t *seed, float scale)
{
    for (size_t i = 0; i < n; i++) x[i] = ctu_rand(seed, scale);
}

int ctu_act_alloc(pd_backend *b, size_t n, void **out)
{
    size_t e = pd_dtype_size(pd_backend_act_dtype(b));
    return pd_backend_get_ops(b)->buf_alloc(b, (n ? n : 1) * e, out);
}

int ctu_act_upload(pd_backend *b, const float *x, size_t n, void **out)
{
    const pd_backend_ops *o = pd_backend_get_ops(b);
    pd_dtype dt = pd_backend_act_dtype(b);
    PD_CHECK(ctu_act_alloc(b, n, out));
    size_t bytes = n * pd_dtype_size(dt);
    void *tmp = malloc(bytes ? bytes : 1);
    if (!tmp) return pd_error(PD_ENOMEM, "ctu_act_upload: out of memory");
    pd_from_f32_n(dt, x, tmp, n);
    int rc = o->upload(b, *out, tmp, bytes);
    if (rc == 0) rc = o->sync(b);
    free(tmp);
    return rc;
}

int ctu_act_download(pd_backend *b, const void *buf, size_t n, float *out)
{
    const pd_backend_ops *o = pd_backend_get_ops(b);
    PD_CHECK(o->download_f32(b, out, buf, n));
    return o->sync(b);
}

double ctu_nmse(const float *a, const float *ref, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    if (den == 0) return num == 0 ? 0 : INFINITY;
    return num / den;
}

double ctu_rel_err(const float *a, const float *ref, size_t n)
{
    return sqrt(ctu_nmse(a, ref, n));
}

/* ---- whole-model runs ---------------------------------------------------------------------- */

int ctu_make_model(const char *base, const char *preset, const char *dtype, char *out,
                   size_t out_size)
{
    return ctu_make_model_arch(base, preset, dtype, "", out, out_size);
}

int ctu_make_model_arch(const char *base, const char *preset, const char *dtype, const char *arch,
                        char *out, size_t out_size)
{
    snprintf(out, out_size, "%s/%s%s%s%s%s", base, preset, dtype[0] ? "-" : "", dtype,
             arch[0] ? "-" : "", arch);
    char probe[4096];
    snprintf(probe, sizeof probe, "%s/config.json", out);
    FILE *fp = fopen(probe, "r");
    if (fp) {
        fclose(fp);
        return PD_OK;
    }
    char exe[2048];
    const char *env = getenv("PD_MKMODEL");
    if (env && env[0]) {
        snprintf(exe, sizeof exe, "%s", env);
    } else {
        const char *root = getenv("PD_BUILD_ROOT");
        if (!root) return pd_error(PD_ENOTFOUND, "neither PD_MKMODEL nor PD_BUILD_ROOT is set");
        snprintf(exe, sizeof exe, "%s/tools/mkmodel/pd-mkmodel", root);
    }
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "'%s' --preset %s --out '%s'%s%s%s%s >/dev/null", exe, preset, out,
             dtype[0] ? " --dtype " : "", dtype, arch[0] ? " --arch " : "", arch);
    int st = system(cmd);
    if (st != 0) return pd_error(PD_EIO, "'%s' failed (status %d)", cmd, st);
    return PD_OK;
}

int ctu_runner_open(ctu_runner *r, pd_backend *b, const pd_model *m, size_t n_seqs, size_t max_ctx,
                    size_t max_tokens)
{
    return ctu_runner_open_ex(r, b, m, n_seqs, max_ctx, max_tokens, 0);
}

int ctu_runner_open_ex(ctu_runner *r, pd_backend *b, const pd_model *m, size_t n_seqs,
                       size_t max_ctx, size_t max_tokens, int no_fused)
{
    memset(r, 0, sizeof *r);
    r->b = b;
    r->n_seqs = n_seqs;
    r->block_size = 16;
    r->blocks_per_seq = (max_ctx + r->block_size - 1) / r->block_size;
    r->max_tokens = max_tokens;
    pd_forward_params fp = pd_forward_default_params();
    fp.max_tokens = max_tokens;
    fp.max_seqs = n_seqs;
    fp.max_out = n_seqs;
    fp.no_fused = no_fused;
    PD_CHECK(pd_forward_create(b, m, &fp, &r->f));
    r->vocab = pd_forward_vocab(r->f);
    pd_kv_params kp = pd_forward_kv_params(r->f, n_seqs * r->blocks_per_seq + 3, r->block_size);
    int rc = pd_backend_get_ops(b)->kv_create(b, &kp, &r->kv);
    if (rc < 0) {
        pd_forward_free(r->f);
        r->f = NULL;
        return rc;
    }
    r->ctx_len = calloc(n_seqs, sizeof(int32_t));
    if (strcmp(pd_backend_name(b), "cuda") == 0) {
        if (cudaMallocHost((void **)&r->logits, n_seqs * r->vocab * sizeof(float)) == cudaSuccess)
            r->pinned = 1;
        else
            r->logits = NULL;
    } else {
        r->logits = malloc(n_seqs * r->vocab * sizeof(float));
    }
    r->tok = malloc(max_tokens * sizeof(int32_t));
    r->qip = malloc((n_seqs + 1) * sizeof(int32_t));
    r->kvl = malloc(n_seqs * sizeof(int32_t));
    r->bip = malloc((n_seqs + 1) * sizeof(int32_t));
    r->bid = malloc(n_seqs * r->blocks_per_seq * sizeof(int32_t));
    r->out_rows = malloc(n_seqs * sizeof(int32_t));
    if (!r->ctx_len || !r->logits || !r->tok || !r->qip || !r->kvl || !r->bip || !r->bid ||
        !r->out_rows) {
        ctu_runner_close(r);
        return pd_error(PD_ENOMEM, "ctu_runner_open: out of memory");
    }
    return PD_OK;
}

void ctu_runner_close(ctu_runner *r)
{
    if (r->kv) pd_backend_get_ops(r->b)->kv_free(r->b, r->kv);
    pd_forward_free(r->f);
    free(r->ctx_len);
    if (r->pinned)
        cudaFreeHost(r->logits);
    else
        free(r->logits);
    free(r->tok);
    free(r->qip);
    free(r->kvl);
    free(r->bip);
    free(r->bid);
    free(r->out_rows);
    memset(r, 0, sizeof *r);
}

int ctu_runner_step(ctu_runner *r, size_t n, const int32_t *seqs, const int32_t *const *toks,
                    const int32_t *rows)
{
    size_t nt = 0, nb = 0;
    r->qip[0] = 0;
    r->bip[0] = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t s = seqs[i];
        if (s < 0 || (size_t)s >= r->n_seqs || rows[i] < 1)
            return pd_error(PD_EINVAL, "ctu_runner_step: bad sequence %d / rows %d", s, rows[i]);
        if (nt + (size_t)rows[i] > r->max_tokens)
            return pd_error(PD_EINVAL, "ctu_runner_step: over %zu rows", r->max_tokens);
        memcpy(r->tok + nt, toks[i], (size_t)rows[i] * sizeof(int32_t));
        nt += (size_t)rows[i];
        r->qip[i + 1] = (int32_t)nt;
        int32_t len = r->ctx_len[s] + rows[i];
        size_t need = ((size_t)len + r->block_size - 1) / r->block_size;
        if (need > r->blocks_per_seq)
            return pd_error(PD_EINVAL, "ctu_runner_step: sequence %d over its context", s);
        r->kvl[i] = len;
        /* interleaved: block k of sequence s is k * n_seqs + s */
        for (size_t k = 0; k < need; k++) r->bid[nb++] = (int32_t)(k * r->n_seqs + (size_t)s);
        r->bip[i + 1] = (int32_t)nb;
        r->out_rows[i] = (int32_t)nt - 1;
    }
    pd_step st = {n, r->tok, r->qip, r->kvl, r->bip, r->bid, n, r->out_rows};
    PD_CHECK(pd_forward_run(r->f, r->kv, &st, r->logits));
    for (size_t i = 0; i < n; i++) r->ctx_len[seqs[i]] += rows[i];
    return PD_OK;
}

int32_t ctu_argmax(const float *v, size_t n)
{
    size_t best = 0;
    for (size_t i = 1; i < n; i++)
        if (v[i] > v[best]) best = i;
    return (int32_t)best;
}
