/* bench_cuda: GPU figures for docs/benchmarks.md (CUDA backend section).
 *
 *   bench_cuda --model DIR [--prompt 128] [--gen 128] [--prefill 2048] [--batch 64]
 *              [--ops-only] [--iters 200] [--no-fused]
 *
 * Prints, for the model in DIR (made by `pd-mkmodel --preset 1b`):
 *   - device-to-device copy bandwidth (GB/s, read + write, 1 GiB) measured in the same run;
 *   - decode at batch 1: tokens/s over --gen steps after a --prompt token prefill (each step is
 *     a full pd_forward_run: host planning, all kernels, logits download into pinned memory;
 *     the host argmax that picks the next token is not timed), against the memory bound =
 *     copy bandwidth / bytes of weights streamed per step;
 *   - prefill of --prefill tokens in one step (best of 3), and the time of the same GEMMs alone
 *     (the backend's matmul op on weights of the same shapes: q, k, v, o, gate, up, down per
 *     layer + lm_head for one row): prefill efficiency = GEMM time / prefill time;
 *   - the decode step's weight GEMVs alone, back to back in a CUDA graph (gemv_chain), against
 *     the copy bandwidth: what the GEMV kernels reach with nothing between them;
 *   - decode throughput at --batch sequences (tokens/s over --gen steps, step time only);
 *   - per-op timings at decode shapes (matmul through the op table vs cuBLAS's GemmEx called
 *     directly, the cost of one small element-wise op = the launch floor, attention at decode
 *     contexts 64 / 512 / 4096 for batch 1 and 64, RMSNorm of 1 and 64 rows), to show where a
 *     decode step's time goes; --ops-only prints these alone (--iters calls each), e.g. under
 *     Nsight Compute for kernel times without the host's launch cost.
 * --no-fused runs the model through the plain ops only (pd_forward_params.no_fused: separate
 * q/k/v GEMVs, gate + up + swiglu, rope + rope + kv_write, add + rmsnorm), for the before/after
 * of the backend's fused ops.
 * Design: the model is driven through the same ctu_runner the GPU tests use (pd_forward over
 * the backend op table), so the figures are those of the code the engine runs.
 */
#include <cublas_v2.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_info.h"
#include "cuda_test_util.h"
#include "util/clock.h"
#include "util/status.h"

typedef struct {
    const char *model;
    int prompt, gen, prefill, batch;
    int ops_only; /* --ops-only: only the per-op timings (e.g. under a profiler) */
    int iters;    /* --iters: calls timed per op (200) */
    int no_fused; /* --no-fused: the plain ops only */
} bench_opts;

/* A bf16 weight of (out, in), or a vector of in when out is 0, from host on b (the benchmarks'
 * weights: shapes matter, not values). */
static int load_bf16(pd_backend *b, const uint16_t *host, size_t out, size_t in, pd_weight **w)
{
    pd_tensor t;
    memset(&t, 0, sizeof t);
    t.name = "bench.weight";
    t.dtype = PD_DTYPE_BF16;
    t.ndim = out ? 2 : 1;
    t.shape[0] = (int64_t)(out ? out : in);
    if (out) t.shape[1] = (int64_t)in;
    t.data = host;
    t.nbytes = (out ? out : 1) * in * 2;
    return pd_backend_get_ops(b)->weight_load(b, &t, NULL, w);
}

/* Times the GEMMs of one prefill step of n rows on weights shaped like cfg's. */
static int gemm_time(pd_backend *b, const pd_model_config *c, size_t n, double *secs, double *flops)
{
    const pd_backend_ops *o = pd_backend_get_ops(b);
    size_t H = (size_t)c->hidden_size, I = (size_t)c->intermediate_size;
    size_t D = (size_t)c->head_dim, Nq = (size_t)c->num_attention_heads;
    size_t Nkv = (size_t)c->num_key_value_heads, V = (size_t)c->vocab_size;
    size_t L = (size_t)c->num_hidden_layers;
    size_t shapes[8][3] = {/* rows n, out, in */
                           {n, Nq * D, H}, {n, Nkv * D, H}, {n, Nkv * D, H}, {n, H, Nq * D},
                           {n, I, H},      {n, I, H},       {n, H, I},       {1, V, H}};
    pd_weight *w[8] = {0};
    void *x = NULL, *y = NULL;
    size_t maxdim = H > I ? H : I;
    if (Nq * D > maxdim) maxdim = Nq * D;
    int rc = PD_OK;
    uint16_t *host = NULL;
    size_t host_n = V * H > I * H ? V * H : I * H;
    host = malloc(host_n * 2);
    if (!host) return pd_error(PD_ENOMEM, "gemm_time: out of memory");
    uint64_t seed = 1;
    for (size_t i = 0; i < host_n; i++) host[i] = pd_f32_to_bf16(ctu_rand(&seed, 0.05f));
    for (int i = 0; i < 8 && rc == 0; i++)
        rc = load_bf16(b, host, shapes[i][1], shapes[i][2], &w[i]);
    if (rc == 0) rc = o->buf_alloc(b, n * maxdim * 2, &x);
    if (rc == 0) rc = o->buf_alloc(b, n * (maxdim > V ? maxdim : V) * 2, &y);
    if (rc == 0) rc = o->upload(b, x, host, n * maxdim * 2);
    double best = 1e30, fl = 0;
    for (int rep = 0; rep < 4 && rc == 0; rep++) {
        rc = o->sync(b);
        double t0 = pd_now_s();
        fl = 0;
        for (size_t l = 0; l < L && rc == 0; l++)
            for (int i = 0; i < 7 && rc == 0; i++) {
                rc = o->matmul(b, x, shapes[i][0], w[i], NULL, y);
                fl += 2.0 * (double)shapes[i][0] * (double)shapes[i][1] * (double)shapes[i][2];
            }
        if (rc == 0) rc = o->matmul(b, x, 1, w[7], NULL, y);
        fl += 2.0 * (double)V * (double)H;
        if (rc == 0) rc = o->sync(b);
        double t = pd_now_s() - t0;
        if (rep > 0 && t < best) best = t; /* rep 0 warms cuBLAS up */
    }
    for (int i = 0; i < 8; i++)
        if (w[i]) o->weight_free(b, w[i]);
    if (x) o->buf_free(b, x);
    if (y) o->buf_free(b, y);
    free(host);
    *secs = best;
    *flops = fl;
    return rc;
}

/* The decode step's weight GEMVs alone, back to back at batch 1 (per layer q/k/v in one
 * matmul_multi, o, gate/up + SwiGLU in one matmul_swiglu, down; then the LM head), on weights of
 * c's shapes, captured from the step stream into a CUDA graph as the step's own graph is (with
 * programmatic dependent launch where the backend uses it), and timed per graph launch with
 * events. Against the copy bandwidth this is how close the GEMV kernels come with nothing
 * between them; the decode step's time less this is what its other kernels (norms, attention)
 * and their boundaries cost. A failure is printed and does not end the benchmark. */
static int gemv_chain(pd_backend *b, const pd_model_config *c, double copy_gbs)
{
    const pd_backend_ops *o = pd_backend_get_ops(b);
    size_t H = (size_t)c->hidden_size, I = (size_t)c->intermediate_size;
    size_t QD = (size_t)c->num_attention_heads * (size_t)c->head_dim;
    size_t KD = (size_t)c->num_key_value_heads * (size_t)c->head_dim;
    size_t V = (size_t)c->vocab_size, L = (size_t)c->num_hidden_layers;
    enum { WQ, WK, WV, WO, WG, WU, WD, NW };
    const size_t shape[NW][2] = {{QD, H}, {KD, H}, {KD, H}, {H, QD}, {I, H}, {I, H}, {H, I}};
    pd_weight **w = calloc(L * NW + 1, sizeof *w);
    size_t host_n = V * H > I * H ? V * H : I * H, act = (I > QD ? I : QD) + V;
    uint16_t *host = malloc(host_n * 2);
    void *x = NULL, *y[4] = {NULL};
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    cudaEvent_t ev[2] = {NULL, NULL};
    double bytes = 0, best = 1e30, sum = 0;
    int rc = w && host ? PD_OK : pd_error(PD_ENOMEM, "gemv chain: out of memory");
    uint64_t seed = 3;
    for (size_t i = 0; rc == PD_OK && i < host_n; i++)
        host[i] = pd_f32_to_bf16(ctu_rand(&seed, 0.05f));
    for (size_t i = 0; rc == PD_OK && i <= L * NW; i++) {
        size_t out = i == L * NW ? V : shape[i % NW][0], in = i == L * NW ? H : shape[i % NW][1];
        rc = load_bf16(b, host, out, in, &w[i]);
        bytes += (double)(out * in * 2);
    }
    if (rc == PD_OK) rc = o->buf_alloc(b, act * 4, &x);
    for (int i = 0; i < 4 && rc == PD_OK; i++) rc = o->buf_alloc(b, act * 4, &y[i]);
    if (rc == PD_OK) rc = o->upload(b, x, host, act * 2);
    /* one pass eagerly (anything the ops set up on first use), then the same pass captured */
    void *stream = NULL;
    for (int pass = 0; pass < 2 && rc == PD_OK; pass++) {
        if (pass == 1) {
            rc = pd_backend_cuda_step_stream(b, &stream);
            cudaError_t e = rc == PD_OK ? cudaStreamBeginCapture((cudaStream_t)stream,
                                                                 cudaStreamCaptureModeThreadLocal)
                                        : cudaSuccess;
            if (e != cudaSuccess) rc = pd_error(PD_EINTERNAL, "capture: %s", cudaGetErrorString(e));
            if (rc < 0) break;
        }
        for (size_t l = 0; l < L && rc == PD_OK; l++) {
            pd_weight **lw = w + l * NW;
            const pd_weight *qkv[3] = {lw[WQ], lw[WK], lw[WV]};
            void *out3[3] = {y[0], y[1], y[2]};
            rc = o->matmul_multi(b, x, 1, 3, qkv, NULL, out3);
            if (rc == PD_OK) rc = o->matmul(b, y[0], 1, lw[WO], NULL, y[3]);
            if (rc == PD_OK) rc = o->matmul_swiglu(b, x, 1, lw[WG], lw[WU], y[0], y[1], y[0]);
            if (rc == PD_OK) rc = o->matmul(b, y[0], 1, lw[WD], NULL, y[3]);
        }
        if (rc == PD_OK) rc = o->matmul(b, x, 1, w[L * NW], NULL, y[3]);
        if (pass == 1) {
            cudaError_t e = cudaStreamEndCapture((cudaStream_t)stream, &graph);
            if (rc == PD_OK && e != cudaSuccess)
                rc = pd_error(PD_EINTERNAL, "capture: %s", cudaGetErrorString(e));
        } else if (rc == PD_OK) {
            rc = o->sync(b);
        }
    }
    cudaError_t e = cudaSuccess;
    if (rc == PD_OK) e = cudaGraphInstantiate(&exec, graph, 0);
    for (int i = 0; i < 2 && e == cudaSuccess; i++) e = cudaEventCreate(&ev[i]);
    int reps = 0;
    for (int r = 0; r < 23 && rc == PD_OK && e == cudaSuccess; r++) {
        e = cudaEventRecord(ev[0], (cudaStream_t)stream);
        if (e == cudaSuccess) e = cudaGraphLaunch(exec, (cudaStream_t)stream);
        if (e == cudaSuccess) e = cudaEventRecord(ev[1], (cudaStream_t)stream);
        if (e == cudaSuccess) e = cudaEventSynchronize(ev[1]);
        float ms = 0;
        if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, ev[0], ev[1]);
        if (e == cudaSuccess && r >= 3) { /* 3 warm-up launches */
            sum += ms / 1e3;
            reps++;
            if (ms / 1e3 < best) best = ms / 1e3;
        }
    }
    if (rc == PD_OK && e != cudaSuccess)
        rc = pd_error(PD_EINTERNAL, "gemv chain graph: %s", cudaGetErrorString(e));
    if (rc == PD_OK)
        printf("decode GEMVs alone (batch 1, %zu launches in a CUDA graph, %.1f MiB of weights): "
               "best %.3f ms = %.0f GB/s, %.1f%% of the copy; mean %.3f ms over %d launches\n",
               L * 4 + 1, bytes / 1048576.0, best * 1e3, bytes / best / 1e9,
               100.0 * bytes / best / (copy_gbs * 1e9), sum / reps * 1e3, reps);
    else
        printf("decode GEMVs alone: not measured: %s\n", pd_last_error());
    for (int i = 0; i < 2; i++)
        if (ev[i]) cudaEventDestroy(ev[i]);
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    for (size_t i = 0; w && i <= L * NW; i++)
        if (w[i]) o->weight_free(b, w[i]);
    free(w);
    if (x) o->buf_free(b, x);
    for (int i = 0; i < 4; i++)
        if (y[i]) o->buf_free(b, y[i]);
    free(host);
    return PD_OK;
}

/* Per-op timings (us per call, wall clock over 200 calls + sync). */
static int op_micro(pd_backend *b, const pd_model_config *c, int iters)
{
    const pd_backend_ops *o = pd_backend_get_ops(b);
    size_t H = (size_t)c->hidden_size, I = (size_t)c->intermediate_size;
    size_t V = (size_t)c->vocab_size;
    size_t KV = (size_t)c->num_key_value_heads * (size_t)c->head_dim;
    size_t shapes[5][2] = {{KV, H}, {H, H}, {I, H}, {H, I}, {V, H}}; /* out, in */
    size_t maxw = V * H > I * H ? V * H : I * H;
    uint16_t *host = malloc(maxw * 2);
    if (!host) return pd_error(PD_ENOMEM, "op_micro: out of memory");
    uint64_t seed = 5;
    for (size_t i = 0; i < maxw; i++) host[i] = pd_f32_to_bf16(ctu_rand(&seed, 0.05f));
    void *x = NULL, *y = NULL;
    int rc = o->buf_alloc(b, 64 * (I > V ? I : V) * 2, &x);
    if (rc == 0) rc = o->buf_alloc(b, 64 * (I > V ? I : V) * 2, &y);
    if (rc == 0) rc = o->upload(b, x, host, 64 * I * 2);
    cublasHandle_t cublas = NULL;
    if (rc == 0 && cublasCreate(&cublas) != CUBLAS_STATUS_SUCCESS)
        rc = pd_error(PD_EINTERNAL, "op_micro: cublasCreate failed");
    void *wdev = NULL;
    if (rc == 0) rc = o->buf_alloc(b, maxw * 2, &wdev);
    for (int si = 0; si < 5 && rc == 0; si++) {
        size_t out = shapes[si][0], in = shapes[si][1];
        pd_weight *w = NULL;
        rc = load_bf16(b, host, out, in, &w);
        if (rc == 0) rc = o->upload(b, wdev, host, out * in * 2);
        for (int ni = 0; ni < 2 && rc == 0; ni++) {
            int n = ni ? 64 : 1;
            double us[2];
            for (int k = 0; k < 2 && rc == 0; k++) { /* 0: op, 1: cuBLAS direct */
                const float one = 1.0f, zero = 0.0f;
                double t0 = 0;
                for (int it = 0; it < iters + 10 && rc == 0; it++) {
                    if (it == 10) {
                        rc = o->sync(b);
                        t0 = pd_now_s();
                    }
                    if (k == 0) {
                        rc = o->matmul(b, x, (size_t)n, w, NULL, y);
                    } else if (cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, (int)out, n, (int)in,
                                            &one, wdev, CUDA_R_16BF, (int)in, x, CUDA_R_16BF,
                                            (int)in, &zero, y, CUDA_R_16BF, (int)out,
                                            CUBLAS_COMPUTE_32F,
                                            CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
                        rc = pd_error(PD_EINTERNAL, "op_micro: cublasGemmEx failed");
                    }
                }
                if (rc == 0) rc = o->sync(b);
                if (k == 1 && rc == 0 && cudaDeviceSynchronize() != cudaSuccess)
                    rc = pd_error(PD_EINTERNAL, "op_micro: device sync failed");
                us[k] = (pd_now_s() - t0) / iters * 1e6;
            }
            if (rc == 0)
                printf("  matmul n=%-2d (%5zu x %5zu): op %7.1f us (%5.0f GB/s of weights); "
                       "cuBLAS GemmEx %7.1f us (%5.0f GB/s)\n",
                       n, out, in, us[0], out * in * 2 / us[0] / 1e3, us[1],
                       out * in * 2 / us[1] / 1e3);
        }
        if (w) o->weight_free(b, w);
    }
    if (rc == 0) {
        double t0 = 0;
        for (int it = 0; it < iters + 10 && rc == 0; it++) {
            if (it == 10) {
                rc = o->sync(b);
                t0 = pd_now_s();
            }
            rc = o->add(b, y, x, 4096);
        }
        if (rc == 0) rc = o->sync(b);
        printf("  add of 4096 elements (launch floor): %.2f us per op\n",
               (pd_now_s() - t0) / iters * 1e6);
    }
    if (cublas) cublasDestroy(cublas);
    if (wdev) o->buf_free(b, wdev);
    if (x) o->buf_free(b, x);
    if (y) o->buf_free(b, y);
    free(host);
    return rc;
}

/* Wall-clock us per call of fn(b, ctx) over `iters` calls after 10 warm-up calls, + sync. When the
 * GPU work of a call is shorter than the host's cost of issuing it, this reads the launch floor
 * (printed by op_micro as "add of 4096 elements"). */
typedef int (*bench_fn)(pd_backend *b, void *ctx);
static int time_calls(pd_backend *b, bench_fn fn, void *ctx, int iters, double *us)
{
    const pd_backend_ops *o = pd_backend_get_ops(b);
    int rc = PD_OK;
    double t0 = 0;
    for (int it = 0; it < iters + 10 && rc == 0; it++) {
        if (it == 10) {
            rc = o->sync(b);
            t0 = pd_now_s();
        }
        if (rc == 0) rc = fn(b, ctx);
    }
    if (rc == 0) rc = o->sync(b);
    *us = (pd_now_s() - t0) / iters * 1e6;
    return rc;
}

typedef struct {
    const pd_kv *kv;
    const void *q;
    void *out;
    size_t nqh;
    float scale;
} attn_call;

static int attn_once(pd_backend *b, void *ctx)
{
    attn_call *a = ctx;
    return pd_backend_get_ops(b)->attention(b, a->kv, 0, a->q, a->nqh, a->scale, a->out);
}

typedef struct {
    const void *x;
    const pd_weight *w;
    size_t n, dim;
    void *y;
} norm_call;

static int norm_once(pd_backend *b, void *ctx)
{
    norm_call *a = ctx;
    return pd_backend_get_ops(b)->rmsnorm(b, a->x, a->w, 1e-5f, a->n, a->dim, a->y);
}

/* Attention at decode shapes of the model's head layout: `batch` sequences of one new row each at
 * context ctx (block size 16, each sequence's blocks interleaved with the others' in the pool),
 * through the op table (host planning of the work list included, once per step as in decode);
 * and RMSNorm of n rows of the hidden size. us per op, and the KV (or activation) bytes read per
 * us as GB/s. */
static int attn_norm_micro(pd_backend *b, const pd_model_config *c, int iters)
{
    const pd_backend_ops *o = pd_backend_get_ops(b);
    const size_t nqh = (size_t)c->num_attention_heads, kvh = (size_t)c->num_key_value_heads;
    const size_t D = (size_t)c->head_dim, H = (size_t)c->hidden_size, bs = 16;
    static const int ctxs[3] = {64, 512, 4096}, batches[2] = {1, 64};
    size_t max_blocks = 64 * ((4096 + bs - 1) / bs);
    size_t nq = 64 * nqh * D;
    pd_kv *kv = NULL;
    pd_kv_params kp = {1, max_blocks, bs, kvh, D, o->act_dtype(b)};
    int rc = o->kv_create(b, &kp, &kv);
    size_t esz = o->act_dtype(b) == PD_DTYPE_F32 ? 4 : 2;
    void *q = NULL, *out = NULL;
    int32_t *tok = malloc(64 * 4), *pos = malloc(64 * 4), *qip = malloc(65 * 4);
    int32_t *kvl = malloc(64 * 4), *bip = malloc(65 * 4), *bid = malloc(max_blocks * 4);
    int32_t *orow = malloc(64 * 4);
    int64_t *slots = malloc(64 * 8);
    float *cs = malloc(64 * (D / 2 + 1) * sizeof(float));
    uint16_t *host = malloc((nq > H * 64 ? nq : H * 64) * 2);
    if (!tok || !pos || !qip || !kvl || !bip || !bid || !orow || !slots || !cs || !host)
        rc = rc < 0 ? rc : pd_error(PD_ENOMEM, "attn_norm_micro: out of memory");
    uint64_t seed = 7;
    if (rc == 0) {
        for (size_t i = 0; i < (nq > H * 64 ? nq : H * 64); i++)
            host[i] = pd_f32_to_bf16(ctu_rand(&seed, 1.0f));
        for (size_t i = 0; i < 64 * (D / 2 + 1); i++) cs[i] = 1.0f;
    }
    if (rc == 0) {
        float *qf = malloc(nq * sizeof(float));
        if (!qf) rc = pd_error(PD_ENOMEM, "attn_norm_micro: out of memory");
        for (size_t i = 0; qf && i < nq; i++) qf[i] = pd_bf16_to_f32(host[i]);
        if (rc == 0) rc = ctu_act_upload(b, qf, nq, &q); /* (64, nqh, D) activations */
        free(qf);
    }
    if (rc == 0) rc = ctu_act_alloc(b, nq, &out); /* (64, nqh, D) activations */
    for (int bi = 0; bi < 2 && rc == 0; bi++)
        for (int ci = 0; ci < 3 && rc == 0; ci++) {
            size_t nb = (size_t)batches[bi], ctx = (size_t)ctxs[ci];
            size_t per = (ctx + bs - 1) / bs;
            for (size_t s = 0; s < nb; s++) {
                tok[s] = 1;
                pos[s] = (int32_t)ctx - 1;
                qip[s] = (int32_t)s;
                kvl[s] = (int32_t)ctx;
                bip[s] = (int32_t)(s * per);
                orow[s] = (int32_t)s;
                for (size_t k = 0; k < per; k++) bid[s * per + k] = (int32_t)(k * nb + s);
                slots[s] = (int64_t)bid[s * per + (ctx - 1) / bs] * (int64_t)bs +
                           (int64_t)((ctx - 1) % bs);
            }
            qip[nb] = (int32_t)nb;
            bip[nb] = (int32_t)(nb * per);
            pd_batch bt;
            memset(&bt, 0, sizeof bt);
            bt.n_tokens = nb;
            bt.token_ids = tok;
            bt.positions = pos;
            bt.slots = slots;
            bt.rope_cos = cs;
            bt.rope_sin = cs;
            bt.rope_dim = D;
            bt.n_seqs = nb;
            bt.q_indptr = qip;
            bt.kv_len = kvl;
            bt.block_indptr = bip;
            bt.block_ids = bid;
            bt.n_out = nb;
            bt.out_rows = orow;
            rc = o->plan(b, &bt);
            /* a repeated step shape starts a graph capture: the sync ends it, ops run eagerly */
            if (rc == 0) rc = o->sync(b);
            attn_call a = {kv, q, out, nqh, 1.0f / 8.0f};
            double us = 0;
            if (rc == 0) rc = time_calls(b, attn_once, &a, iters, &us);
            if (rc == 0)
                printf("  attention decode batch %-2zu ctx %4zu (%zu/%zu heads x %zu): %7.1f us "
                       "(%5.0f GB/s of KV)\n",
                       nb, ctx, nqh, kvh, D, us, 2.0 * nb * ctx * kvh * D * esz / us / 1e3);
        }
    pd_weight *w = NULL;
    if (rc == 0) rc = load_bf16(b, host, 0, H, &w);
    for (int ni = 0; ni < 2 && rc == 0; ni++) {
        size_t n = ni ? 64 : 1;
        norm_call a = {q, w, n, H, out};
        double us = 0;
        rc = time_calls(b, norm_once, &a, iters, &us);
        if (rc == 0)
            printf("  rmsnorm n=%-2zu dim %zu: %7.2f us (%5.0f GB/s read + write)\n", n, H, us,
                   2.0 * n * H * esz / us / 1e3);
    }
    if (w) o->weight_free(b, w);
    if (q) o->buf_free(b, q);
    if (out) o->buf_free(b, out);
    if (kv) o->kv_free(b, kv);
    free(tok);
    free(pos);
    free(qip);
    free(kvl);
    free(bip);
    free(bid);
    free(orow);
    free(slots);
    free(cs);
    free(host);
    return rc;
}

static int fill_prompt(int32_t *p, size_t n, size_t vocab, uint64_t *seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (int32_t)((ctu_rand(seed, 1.0f) + 1.0f) * 0.5f * (float)(vocab - 1));
    return PD_OK;
}

static int run(const bench_opts *op)
{
    pd_cuda_info info;
    PD_CHECK(pd_cuda_query(0, &info));
    double bw = 0;
    PD_CHECK(pd_cuda_d2d_bandwidth(0, (size_t)1 << 30, 20, &bw));
    printf("device: %s, %d SMs; d2d copy %.0f GB/s (read+write, 1 GiB, best of 20)\n", info.name,
           info.sm_count, bw);

    pd_model *m;
    PD_CHECK(pd_model_load(op->model, &m));
    pd_backend *b;
    pd_backend_params bp = pd_backend_default_params();
    int rc = pd_backend_cuda_create(&bp, &b);
    if (rc < 0) {
        pd_model_free(m);
        return rc;
    }
    const pd_model_config *c = &m->config;
    size_t max_ctx = (size_t)(op->prompt + op->gen);
    if ((size_t)op->prefill + 16 > max_ctx) max_ctx = (size_t)op->prefill + 16;
    size_t nseq = op->batch > 4 ? (size_t)op->batch : 4;
    size_t max_tokens = op->prefill > 2048 ? (size_t)op->prefill : 2048;
    ctu_runner r;
    double t0 = pd_now_s();
    rc = ctu_runner_open_ex(&r, b, m, nseq, max_ctx, max_tokens, op->no_fused);
    if (rc < 0) goto out_model;
    printf("model %s: %lld layers, hidden %lld, %lld/%lld heads, vocab %lld; weights %.1f MiB on "
           "the GPU (%s), loaded in %.1f s; %s ops\n",
           op->model, (long long)c->num_hidden_layers, (long long)c->hidden_size,
           (long long)c->num_attention_heads, (long long)c->num_key_value_heads,
           (long long)c->vocab_size, pd_forward_weight_bytes(r.f) / 1048576.0, "bf16",
           pd_now_s() - t0, op->no_fused ? "plain" : "fused");
    size_t V = r.vocab;
    if (op->ops_only) {
        printf("per-op timings at decode shapes:\n");
        rc = op_micro(b, c, op->iters);
        if (rc == 0) rc = attn_norm_micro(b, c, op->iters);
        ctu_runner_close(&r);
        goto out_model;
    }
    int32_t *prompt = malloc((size_t)(op->prefill + op->prompt * (int)nseq + 16) * 4);
    int32_t *seqs = malloc(nseq * 4), *rows = malloc(nseq * 4), *next = malloc(nseq * 4);
    const int32_t **toks = malloc(nseq * sizeof *toks);
    if (!prompt || !seqs || !rows || !next || !toks) {
        rc = pd_error(PD_ENOMEM, "bench: out of memory");
        goto out;
    }
    uint64_t seed = 99;
    fill_prompt(prompt, (size_t)(op->prefill + op->prompt * (int)nseq + 16), V, &seed);

    /* ---- decode, batch 1 ---- */
    {
        int32_t s0 = 0, np = op->prompt, one = 1;
        const int32_t *tp = prompt;
        rc = ctu_runner_step(&r, 1, &s0, &tp, &np);
        if (rc < 0) goto out;
        int32_t tok = ctu_argmax(r.logits, V);
        /* warm-up steps are part of the context but not timed */
        for (int i = 0; i < 4 && rc == 0; i++) {
            tp = &tok;
            rc = ctu_runner_step(&r, 1, &s0, &tp, &one);
            tok = ctu_argmax(r.logits, V);
        }
        if (rc < 0) goto out;
        int steps = op->gen - 4;
        double dt = 0;
        for (int i = 0; i < steps && rc == 0; i++) {
            tp = &tok;
            double ts = pd_now_s();
            rc = ctu_runner_step(&r, 1, &s0, &tp, &one);
            dt += pd_now_s() - ts;
            tok = ctu_argmax(r.logits, V);
        }
        if (rc < 0) goto out;
        double tps = steps / dt;
        double bytes = (double)pd_forward_bytes_per_step(r.f);
        double bound = bw * 1e9 / bytes;
        printf("decode batch 1: %.1f tokens/s (%.3f ms/token over %d steps, context %d..%d); "
               "bytes/step %.1f MiB; bandwidth bound %.1f tokens/s; %.1f%% of bound\n",
               tps, 1e3 * dt / steps, steps, op->prompt + 4, op->prompt + op->gen,
               bytes / 1048576.0, bound, 100.0 * tps / bound);
        gemv_chain(b, c, bw);
    }

    /* ---- prefill ---- */
    {
        double best = 1e30;
        for (int rep = 1; rep <= 3 && rc == 0; rep++) {
            int32_t s = rep, np = op->prefill;
            const int32_t *tp = prompt + op->prompt;
            r.ctx_len[s] = 0;
            double ts = pd_now_s();
            rc = ctu_runner_step(&r, 1, &s, &tp, &np);
            double dt = pd_now_s() - ts;
            if (dt < best) best = dt;
        }
        if (rc < 0) goto out;
        double gsec = 0, gflops = 0;
        rc = gemm_time(b, c, (size_t)op->prefill, &gsec, &gflops);
        if (rc < 0) goto out;
        printf("prefill %d tokens: %.2f ms (%.0f tokens/s); its GEMMs alone: %.2f ms (%.0f "
               "TFLOP/s bf16); prefill at %.1f%% of GEMM throughput\n",
               op->prefill, best * 1e3, op->prefill / best, gsec * 1e3, gflops / gsec / 1e12,
               100.0 * gsec / best);
    }

    /* ---- decode, batch N ---- */
    {
        size_t nb = (size_t)op->batch;
        for (size_t s = 0; s < nseq; s++) r.ctx_len[s] = 0;
        size_t per_step = (size_t)(2048 / op->prompt);
        if (per_step < 1) per_step = 1;
        for (size_t s0 = 0; s0 < nb && rc == 0; s0 += per_step) {
            size_t k = nb - s0 < per_step ? nb - s0 : per_step;
            for (size_t i = 0; i < k; i++) {
                seqs[i] = (int32_t)(s0 + i);
                rows[i] = op->prompt;
                toks[i] = prompt + (s0 + i) * (size_t)op->prompt;
            }
            rc = ctu_runner_step(&r, k, seqs, toks, rows);
            for (size_t i = 0; i < k; i++) next[s0 + i] = ctu_argmax(r.logits + i * V, V);
        }
        if (rc < 0) goto out;
        for (size_t i = 0; i < nb; i++) {
            seqs[i] = (int32_t)i;
            rows[i] = 1;
        }
        int steps = op->gen;
        double dt = 0;
        for (int t = 0; t < steps + 2 && rc == 0; t++) {
            for (size_t i = 0; i < nb; i++) toks[i] = &next[i];
            double ts = pd_now_s();
            rc = ctu_runner_step(&r, nb, seqs, toks, rows);
            if (t >= 2) dt += pd_now_s() - ts; /* 2 warm-up steps */
            for (size_t i = 0; i < nb; i++) next[i] = ctu_argmax(r.logits + i * V, V);
        }
        if (rc < 0) goto out;
        printf("decode batch %zu: %.0f tokens/s (%.3f ms/step over %d steps, context %d..%d)\n", nb,
               nb * (double)steps / dt, 1e3 * dt / steps, steps, op->prompt + 2,
               op->prompt + op->gen + 2);
    }
    printf("per-op timings at decode shapes:\n");
    rc = op_micro(b, c, op->iters);
    if (rc == 0) rc = attn_norm_micro(b, c, op->iters);
out:
    free(prompt);
    free(seqs);
    free(rows);
    free(next);
    free(toks);
    ctu_runner_close(&r);
out_model:
    pd_backend_free(b);
    pd_model_free(m);
    return rc;
}

int main(int argc, char **argv)
{
    bench_opts op = {NULL, 128, 128, 2048, 64, 0, 200, 0};
    static const struct option lo[] = {{"model", required_argument, 0, 'm'},
                                       {"prompt", required_argument, 0, 'p'},
                                       {"gen", required_argument, 0, 'g'},
                                       {"prefill", required_argument, 0, 'f'},
                                       {"batch", required_argument, 0, 'b'},
                                       {"ops-only", no_argument, 0, 'o'},
                                       {"iters", required_argument, 0, 'i'},
                                       {"no-fused", no_argument, 0, 'n'},
                                       {0, 0, 0, 0}};
    int ch;
    while ((ch = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (ch) {
        case 'm': op.model = optarg; break;
        case 'p': op.prompt = atoi(optarg); break;
        case 'g': op.gen = atoi(optarg); break;
        case 'f': op.prefill = atoi(optarg); break;
        case 'b': op.batch = atoi(optarg); break;
        case 'o': op.ops_only = 1; break;
        case 'i': op.iters = atoi(optarg); break;
        case 'n': op.no_fused = 1; break;
        default:
            fprintf(stderr, "usage: bench_cuda --model DIR [--prompt N] [--gen N] "
                            "[--prefill N] [--batch N] [--ops-only] [--iters N] [--no-fused]\n");
            return 2;
        }
    }
    if (!op.model || op.prompt < 1 || op.gen < 8 || op.prefill < 1 || op.batch < 1 ||
        op.prompt > 2048 || op.iters < 1) {
        fprintf(stderr, "bench_cuda: --model is required; --prompt in [1, 2048], --gen >= 8, "
                        "--prefill >= 1, --batch >= 1, --iters >= 1\n");
        return 2;
    }
    int rc = run(&op);
    if (rc < 0) {
        fprintf(stderr, "bench_cuda: %s: %s\n", pd_status_name(rc), pd_last_error());
        return rc == PD_ENOTFOUND ? 77 : 1;
    }
    return 0;
}
