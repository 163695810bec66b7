/* bench_cpu: CPU backend benchmarks for docs/benchmarks.md (not a test).
 *
 *   bench_cpu --model DIR [--threads N] [--prompt-len 512] [--decode-steps 64] [--reps 3]
 *             [--bw-mib 2048] [--weight-dtype float32|bfloat16|float16]
 *             [--compute-dtype float32|bfloat16] [--isa auto|scalar|avx512|avx512bf16] [--fused
 * 1|0]
 *
 * Prints, for the same process and thread count:
 *  - read bandwidth of a vectorized STREAM-style read loop (sum of a buffer much larger than
 *    the L3, split over the threads), best of reps;
 *  - decode batch 1: tokens/s after a short prompt, weight bytes streamed per token, and the
 *    fraction of the bandwidth bound (bytes/token x tokens/s / read bandwidth);
 *  - prefill of prompt-len tokens in one step: tokens/s and matmul GFLOP/s;
 *  - the backend's own matmul on the same shapes in isolation (GFLOP/s) and the fraction the
 *    prefill reaches; OpenBLAS sgemm on the same shapes for reference, and whether OpenBLAS
 *    gives a row the same bits alone (M = 1) as inside M = prompt-len (why it is not used).
 * --fused 0 runs the model through the plain ops only (pd_forward_params.no_fused), for the
 * before/after of the backend's fused ops. --compute-dtype bfloat16 runs the bf16 compute mode
 * (matmul rows rounded to bf16; with avx512_bf16 the vdpbf16ps kernel, with --isa avx512 the f32
 * kernels on the rounded rows). Every figure is printed for each repetition, then
 * best and spread.
 */
#include <cblas.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/forward.h"
#include "model/model.h"
#include "model/quant.h"
#include "util/clock.h"
#include "util/status.h"
#include "util/threadpool.h"

/* ---- read bandwidth ---------------------------------------------------------------------------
 */

typedef struct {
    const float *buf;
    size_t n; /* floats */
    float sums[64];
    int avx512;
} bw_ctx;

#if defined(__x86_64__)
__attribute__((target("avx512f"))) static float read_avx512(const float *p, size_t n)
{
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        a0 = _mm512_add_ps(a0, _mm512_load_ps(p + i));
        a1 = _mm512_add_ps(a1, _mm512_load_ps(p + i + 16));
        a2 = _mm512_add_ps(a2, _mm512_load_ps(p + i + 32));
        a3 = _mm512_add_ps(a3, _mm512_load_ps(p + i + 48));
    }
    float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    for (; i < n; i++) s += p[i];
    return s;
}
#endif

static float read_scalar(const float *p, size_t n)
{
    float s[8] = {0};
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) s[l] += p[i + l];
    for (; i < n; i++) s[0] += p[i];
    return s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
}

static void bw_task(void *vctx, int task, int n_tasks)
{
    bw_ctx *c = vctx;
    size_t per = (c->n / (size_t)n_tasks) & ~(size_t)63;
    const float *p = c->buf + per * (size_t)task;
#if defined(__x86_64__)
    if (c->avx512) {
        c->sums[task & 63] = read_avx512(p, per);
        return;
    }
#endif
    c->sums[task & 63] = read_scalar(p, per);
}

static double measure_bw(pd_threadpool *pool, size_t mib, int reps, int avx512)
{
    size_t bytes = mib << 20;
    float *buf = aligned_alloc(64, bytes);
    if (!buf) return 0;
    for (size_t i = 0; i < bytes / 4; i++) buf[i] = (float)(i & 1023);
    bw_ctx c = {.buf = buf, .n = bytes / 4, .avx512 = avx512};
    int nt = pd_pool_size(pool);
    double best = 0;
    for (int r = 0; r < reps + 1; r++) {
        double t0 = pd_now_s();
        pd_pool_run(pool, bw_task, &c, nt);
        double dt = pd_now_s() - t0;
        size_t read = ((c.n / (size_t)nt) & ~(size_t)63) * (size_t)nt * 4;
        double gbs = (double)read / dt / 1e9;
        if (r > 0 && gbs > best) best = gbs; /* rep 0 warms up */
    }
    free(buf);
    return best;
}

/* ---- helpers ------------------------------------------------------------------------------------
 */

typedef struct {
    double v[32];
    int n;
} series;

static void add(series *s, double v)
{
    if (s->n < 32) s->v[s->n++] = v;
}

static void report(const char *what, const char *unit, const series *s)
{
    double best = 0, worst = 1e300;
    printf("%s:", what);
    for (int i = 0; i < s->n; i++) {
        printf(" %.2f", s->v[i]);
        if (s->v[i] > best) best = s->v[i];
        if (s->v[i] < worst) worst = s->v[i];
    }
    printf(" %s | best %.2f, spread %.1f%%\n", unit, best,
           best > 0 ? 100.0 * (best - worst) / best : 0);
}

static double best_of(const series *s)
{
    double b = 0;
    for (int i = 0; i < s->n; i++)
        if (s->v[i] > b) b = s->v[i];
    return b;
}

static void fill_rand(float *x, size_t n, uint64_t seed)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = (float)((double)(seed >> 40) / 16777216.0 - 0.5);
    }
}

/* One sequence: prefill ids, then greedy-free decode of `steps` tokens (the next token is fixed
 * to keep the work identical across reps). Returns prefill and decode seconds. */
static int run_seq(pd_forward *f, pd_kv *kv, const int32_t *ids, size_t n, size_t steps,
                   size_t block_size, int32_t *blocks, float *logits, double *t_pre, double *t_dec)
{
    int32_t qi[2] = {0, (int32_t)n}, kvl[1] = {(int32_t)n}, bi[2] = {0, 0}, orow[1];
    size_t need = (n + steps + block_size - 1) / block_size;
    bi[1] = (int32_t)need;
    orow[0] = (int32_t)n - 1;
    pd_step st = {.n_seqs = 1,
                  .token_ids = ids,
                  .q_indptr = qi,
                  .kv_len = kvl,
                  .block_indptr = bi,
                  .block_ids = blocks,
                  .n_out = 1,
                  .out_rows = orow};
    double t0 = pd_now_s();
    PD_CHECK(pd_forward_run(f, kv, &st, logits));
    *t_pre = pd_now_s() - t0;
    int32_t tok = ids[0];
    qi[1] = 1;
    orow[0] = 0;
    st.token_ids = &tok;
    t0 = pd_now_s();
    for (size_t s = 0; s < steps; s++) {
        kvl[0] = (int32_t)(n + s + 1);
        PD_CHECK(pd_forward_run(f, kv, &st, logits));
    }
    *t_dec = pd_now_s() - t0;
    return PD_OK;
}

int main(int argc, char **argv)
{
    const char *model = NULL, *wdt_s = NULL, *cdt_s = NULL, *isa_s = "auto";
    int threads = 0, reps = 3, fused = 1;
    size_t prompt_len = 512, steps = 64, bw_mib = 2048;
    for (int i = 1; i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        if (!strcmp(a, "--model"))
            model = v;
        else if (!strcmp(a, "--threads"))
            threads = atoi(v);
        else if (!strcmp(a, "--prompt-len"))
            prompt_len = (size_t)atol(v);
        else if (!strcmp(a, "--decode-steps"))
            steps = (size_t)atol(v);
        else if (!strcmp(a, "--reps"))
            reps = atoi(v);
        else if (!strcmp(a, "--bw-mib"))
            bw_mib = (size_t)atol(v);
        else if (!strcmp(a, "--weight-dtype"))
            wdt_s = v;
        else if (!strcmp(a, "--compute-dtype"))
            cdt_s = v;
        else if (!strcmp(a, "--isa"))
            isa_s = v;
        else if (!strcmp(a, "--fused"))
            fused = atoi(v);
        else {
            fprintf(stderr, "bench_cpu: unknown option %s\n", a);
            return 2;
        }
    }
    if (!model || reps < 1 || reps > 30 || prompt_len < 2 || prompt_len > 8192) {
        fprintf(stderr, "usage: bench_cpu --model DIR [--threads N] [--prompt-len 512] "
                        "[--decode-steps 64] [--reps 3] [--bw-mib 2048] [--weight-dtype D] "
                        "[--compute-dtype D] [--isa auto|scalar|avx512|avx512bf16] "
                        "[--fused 1|0]\n");
        return 2;
    }
    pd_backend_params bp = pd_backend_default_params();
    bp.n_threads = threads;
    pd_dtype wd = PD_DTYPE_F32, cd = PD_DTYPE_F32;
    if (pd_cpu_isa_parse(isa_s, &bp.cpu_isa) < 0 || (wdt_s && pd_dtype_parse(wdt_s, &wd) < 0) ||
        (cdt_s && pd_dtype_parse(cdt_s, &cd) < 0)) {
        fprintf(stderr, "bench_cpu: %s\n", pd_last_error());
        return 2;
    }
    if (wdt_s) bp.weight_dtype = (int)wd;
    if (cdt_s) bp.compute_dtype = (int)cd;
    pd_model *m = NULL;
    pd_backend *b = NULL;
    pd_forward *f = NULL;
    pd_kv *kv = NULL;
    int rc = pd_model_load(model, &m);
    if (rc == 0) rc = pd_backend_cpu_create(&bp, &b);
    pd_forward_params fp = pd_forward_default_params();
    fp.max_tokens = prompt_len;
    fp.max_out = 1;
    fp.no_fused = !fused;
    if (rc == 0) rc = pd_forward_create(b, m, &fp, &f);
    const size_t BS = 16, per_seq = (prompt_len + steps + BS) / BS;
    const pd_backend_ops *o = b ? pd_backend_get_ops(b) : NULL;
    pd_kv_params kp;
    if (rc == 0) {
        kp = pd_forward_kv_params(f, per_seq, BS);
        rc = o->kv_create(b, &kp, &kv);
    }
    if (rc < 0) {
        fprintf(stderr, "bench_cpu: %s\n", pd_last_error());
        return 1;
    }
    int nthreads = threads > 0 ? threads : pd_cpu_count();
    const pd_model_config *c = &m->config;
    printf("model %s: hidden %lld, layers %lld, heads %lld/%lld, head_dim %lld, inter %lld, "
           "vocab %lld; threads %d\n",
           model, (long long)c->hidden_size, (long long)c->num_hidden_layers,
           (long long)c->num_attention_heads, (long long)c->num_key_value_heads,
           (long long)c->head_dim, (long long)c->intermediate_size, (long long)c->vocab_size,
           nthreads);
    printf("weights on backend: %.1f MiB; streamed per decode step: %.1f MiB\n",
           pd_forward_weight_bytes(f) / 1048576.0, pd_forward_bytes_per_step(f) / 1048576.0);

    /* bandwidth: its own pool with the same thread count */
    pd_threadpool *pool = pd_pool_create(nthreads);
#if defined(__x86_64__)
    __builtin_cpu_init();
    int avx = __builtin_cpu_supports("avx512f");
#else
    int avx = 0;
#endif
    series bw = {0};
    for (int r = 0; r < reps; r++) add(&bw, measure_bw(pool, bw_mib, 3, avx));
    pd_pool_free(pool);
    report("read bandwidth", "GB/s", &bw);

    /* the backend's n = 1 matmul streaming one large f32 weight (bw-mib, K = hidden): how close
     * the decode kernel alone gets to the read bandwidth, without per-op overheads */
    {
        size_t K = (size_t)c->hidden_size, rows = (bw_mib << 20) / (K * 4);
        float *wbuf = malloc(rows * K * 4), *xv = malloc(K * 4), *yv = malloc(rows * 4);
        pd_weight *Wbig = NULL;
        if (wbuf && xv && yv) {
            fill_rand(wbuf, rows * K, 3);
            fill_rand(xv, K, 4);
            pd_tensor t = {.name = "gemv",
                           .dtype = PD_DTYPE_F32,
                           .ndim = 2,
                           .shape = {(int64_t)rows, (int64_t)K},
                           .data = wbuf,
                           .nbytes = rows * K * 4};
            rc = o->weight_load(b, &t, NULL, &Wbig);
        }
        free(wbuf);
        series gv = {0};
        for (int r = 0; r < reps && rc == 0 && Wbig; r++) {
            rc = o->matmul(b, xv, 1, Wbig, NULL, yv);
            double t0 = pd_now_s();
            for (int k = 0; k < 4 && rc == 0; k++) rc = o->matmul(b, xv, 1, Wbig, NULL, yv);
            double dt = (pd_now_s() - t0) / 4;
            add(&gv, (double)o->weight_nbytes(b, Wbig) / dt / 1e9);
        }
        if (Wbig) o->weight_free(b, Wbig);
        free(xv), free(yv);
        report("matmul n=1 streaming one large f32 weight", "GB/s", &gv);
    }

    /* decode and prefill */
    int32_t *ids = malloc(prompt_len * sizeof(int32_t));
    int32_t *blocks = malloc(per_seq * sizeof(int32_t));
    float *logits = malloc((size_t)c->vocab_size * sizeof(float));
    for (size_t i = 0; i < prompt_len; i++)
        ids[i] = (int32_t)((i * 7919 + 13) % (size_t)c->vocab_size);
    for (size_t i = 0; i < per_seq; i++) blocks[i] = (int32_t)i;
    series dec = {0}, pre = {0}, frac = {0};
    double bytes_tok = (double)pd_forward_bytes_per_step(f);
    size_t short_prompt = 16;
    for (int r = 0; r < reps && rc == 0; r++) {
        double tp, td;
        rc = run_seq(f, kv, ids, short_prompt, steps, BS, blocks, logits, &tp, &td);
        if (rc) break;
        double tps = (double)steps / td;
        add(&dec, tps);
        add(&frac, 100.0 * bytes_tok * tps / 1e9 / best_of(&bw));
    }
    series pre_gf = {0};
    const double Hd = (double)c->hidden_size, Id = (double)c->intermediate_size,
                 qd = (double)(c->num_attention_heads * c->head_dim),
                 kvd = (double)(c->num_key_value_heads * c->head_dim);
    const double layer_flops_row = 2.0 * (Hd * qd + 2 * Hd * kvd + qd * Hd + 3 * Hd * Id);
    const double mm_flops = layer_flops_row * (double)c->num_hidden_layers * (double)prompt_len +
                            2.0 * Hd * (double)c->vocab_size;
    for (int r = 0; r < reps && rc == 0; r++) {
        double tp, td;
        rc = run_seq(f, kv, ids, prompt_len, 0, BS, blocks, logits, &tp, &td);
        if (rc) break;
        add(&pre, (double)prompt_len / tp);
        add(&pre_gf, mm_flops / tp / 1e9);
    }
    if (rc < 0) {
        fprintf(stderr, "bench_cpu: %s\n", pd_last_error());
        return 1;
    }
    report("decode batch 1", "tokens/s", &dec);
    report("decode fraction of bandwidth bound", "%", &frac);
    char what[128];
    snprintf(what, sizeof what, "prefill %zu tokens", prompt_len);
    report(what, "tokens/s", &pre);
    report("prefill matmul throughput", "GFLOP/s", &pre_gf);

    /* the same matmul shapes in isolation: layer 0's seven projections with n = prompt_len */
    const pd_layer_weights *L = &m->weights.layers[0];
    const pd_tensor *mats[7] = {&L->q_proj,    &L->k_proj,  &L->v_proj,   &L->o_proj,
                                &L->gate_proj, &L->up_proj, &L->down_proj};
    pd_weight *W[7] = {0};
    size_t maxd = (size_t)(Id > Hd ? Id : Hd);
    if (qd > (double)maxd) maxd = (size_t)qd;
    float *x = aligned_alloc(64, prompt_len * maxd * 4),
          *y = aligned_alloc(64, prompt_len * maxd * 4);
    fill_rand(x, prompt_len * maxd, 1);
    double one_layer_flops = layer_flops_row * (double)prompt_len;
    for (int i = 0; i < 7 && rc == 0; i++) rc = o->weight_load(b, mats[i], NULL, &W[i]);
    series iso = {0}, fr2 = {0}, blas = {0};
    for (int r = 0; r < reps && rc == 0; r++) {
        double t0 = pd_now_s();
        for (int rep = 0; rep < 4; rep++)
            for (int i = 0; i < 7 && rc == 0; i++) rc = o->matmul(b, x, prompt_len, W[i], NULL, y);
        double dt = (pd_now_s() - t0) / 4;
        add(&iso, one_layer_flops / dt / 1e9);
    }
    for (int r = 0; r < pre_gf.n && iso.n; r++) add(&fr2, 100.0 * pre_gf.v[r] / best_of(&iso));
    report("backend matmul, same shapes in isolation", "GFLOP/s", &iso);
    report("prefill fraction of isolated matmul throughput", "%", &fr2);

    /* OpenBLAS sgemm on the same shapes (f32 copies of the weights) */
    openblas_set_num_threads(nthreads);
    float *wf[7];
    for (int i = 0; i < 7; i++) {
        size_t nel = (size_t)pd_tensor_numel(mats[i]);
        wf[i] = malloc(nel * 4);
        if (mats[i]->quant) /* a quantized checkpoint: its dequantized values */
            rc = pd_qweight_dequant(mats[i]->quant, 0, mats[i]->shape[0], 0, mats[i]->shape[1],
                                    wf[i]);
        else
            pd_to_f32_n(mats[i]->dtype, mats[i]->data, wf[i], nel);
    }
    for (int r = 0; r < reps; r++) {
        double t0 = pd_now_s();
        for (int rep = 0; rep < 4; rep++)
            for (int i = 0; i < 7; i++) {
                int out = (int)mats[i]->shape[0], in = (int)mats[i]->shape[1];
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)prompt_len, out, in, 1.0f,
                            x, in, wf[i], in, 0.0f, y, out);
            }
        double dt = (pd_now_s() - t0) / 4;
        add(&blas, one_layer_flops / dt / 1e9);
    }
    report("OpenBLAS sgemm, same shapes", "GFLOP/s", &blas);
    /* does OpenBLAS give row 0 the same bits alone as in the full batch? */
    {
        int out = (int)mats[4]->shape[0], in = (int)mats[4]->shape[1];
        float *y1 = malloc((size_t)out * 4);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)prompt_len, out, in, 1.0f, x, in,
                    wf[4], in, 0.0f, y, out);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, 1, out, in, 1.0f, x, in, wf[4], in,
                    0.0f, y1, out);
        int same = memcmp(y, y1, (size_t)out * 4) == 0;
        printf("OpenBLAS row 0 alone (M=1) vs in M=%zu: %s\n", prompt_len,
               same ? "bit-identical" : "DIFFERENT bits");
        free(y1);
    }
    for (int i = 0; i < 7; i++) {
        free(wf[i]);
        if (W[i]) o->weight_free(b, W[i]);
    }
    free(x), free(y), free(ids), free(blocks), free(logits);
    o->kv_free(b, kv);
    pd_forward_free(f);
    pd_backend_free(b);
    pd_model_free(m);
    if (rc < 0) {
        fprintf(stderr, "bench_cpu: %s\n", pd_last_error());
        return 1;
    }
    return 0;
}
