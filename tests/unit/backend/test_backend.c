/* Op-level tests of the CPU backend against naive double-precision references: matmul with
 * f32/bf16/f16 weights and odd sizes on every kernel family (scalar, AVX-512 and AVX-512 BF16
 * when the CPU has them), in f32 and in the bf16 compute mode, bit-identical rows across batch
 * sizes and thread counts in both modes, RMSNorm, SwiGLU, RoPE, embedding,
 * paged GQA attention with scattered block tables, KV export/import, slices and every rejected
 * input; the fused ops against the plain ones. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "harness.h"
#include "model/dtype.h"

/* ---- helpers -----------------------------------------------------------------------------------
 */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static float frand(void) /* uniform in [-1, 1) */
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (float)((double)(rng_state >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static void fill(float *x, size_t n)
{
    for (size_t i = 0; i < n; i++) x[i] = frand();
}

/* A host tensor of shape (rows, cols) (or (cols) when rows == 0) in dtype, from f32 values;
 * the f32 values are replaced by what the dtype stores, so references see the same numbers. */
typedef struct {
    pd_tensor t;
    void *buf;
} host_tensor;

static void ht_make(host_tensor *h, const char *name, pd_dtype dt, size_t rows, size_t cols,
                    float *vals)
{
    size_t n = (rows ? rows : 1) * cols;
    memset(h, 0, sizeof *h);
    h->buf = malloc(n * pd_dtype_size(dt));
    pd_from_f32_n(dt, vals, h->buf, n);
    pd_to_f32_n(dt, h->buf, vals, n);
    h->t.name = name;
    h->t.dtype = dt;
    h->t.ndim = rows ? 2 : 1;
    if (rows) {
        h->t.shape[0] = (int64_t)rows;
        h->t.shape[1] = (int64_t)cols;
    } else {
        h->t.shape[0] = (int64_t)cols;
    }
    h->t.data = h->buf;
    h->t.nbytes = n * pd_dtype_size(dt);
}

static pd_backend *make_backend_mode(pd_cpu_isa isa, int threads, int weight_dtype,
                                     int compute_dtype)
{
    pd_backend_params p = pd_backend_default_params();
    p.cpu_isa = isa;
    p.n_threads = threads;
    p.weight_dtype = weight_dtype;
    p.compute_dtype = compute_dtype;
    pd_backend *b = NULL;
    if (pd_backend_cpu_create(&p, &b) < 0) return NULL;
    return b;
}

static pd_backend *make_backend(pd_cpu_isa isa, int threads, int weight_dtype)
{
    return make_backend_mode(isa, threads, weight_dtype, -1);
}

static int have_isa(pd_cpu_isa isa)
{
    pd_backend *b = make_backend(isa, 1, -1);
    pd_backend_free(b);
    return b != NULL;
}

/* Number of ISAs to test and their values: scalar, then those the CPU has. */
static int isas(pd_cpu_isa out[3])
{
    int n = 0;
    out[n++] = PD_CPU_ISA_SCALAR;
    if (have_isa(PD_CPU_ISA_AVX512)) out[n++] = PD_CPU_ISA_AVX512;
    if (have_isa(PD_CPU_ISA_AVX512_BF16)) out[n++] = PD_CPU_ISA_AVX512_BF16;
    return n;
}

/* ---- matmul
 * -------------------------------------------------------------------------------------- */

/* y = x W^T + bias for every dtype/ISA/size combination, in f32 and in the bf16 compute mode,
 * vs a double reference with a scale-aware bound: |y - ref| <= 1e-6 * sum_k |x_k w_k| + 1e-30.
 * In the bf16 mode the reference takes x and W rounded to bf16 (nearest even; products exact,
 * sums in double): the kernels differ from it only by f32 accumulation (and vdpbf16ps adding
 * its pairs of products inside the instruction), so the same bound holds. Against the unrounded
 * x and W each product is then off by at most (1 + 2^-8)^2 - 1 = 2^-7 + 2^-16 relative (bf16
 * keeps 8 significant bits: unit roundoff 2^-8), so |y - ref_f64| <= (2^-7 + 2^-16) *
 * sum_k |x_k w_k| (+ the f32 bound); checked too, and that the rounding shows at all (most
 * elements outside the f32 bound of the unrounded reference). Sizes around the 16- and
 * 32-element steps and every tile shape. */
TEST(matmul_matches_reference)
{
    static const size_t ns[] = {1, 2, 3, 5, 7, 13};
    static const size_t ks[] = {1, 15, 16, 17, 31, 32, 33, 100};
    static const size_t outs[] = {1, 3, 9, 17};
    static const pd_dtype dts[] = {PD_DTYPE_F32, PD_DTYPE_BF16, PD_DTYPE_F16};
    pd_cpu_isa isa[3];
    int n_isa = isas(isa);
    int checked = 0;
    size_t bf16_elems = 0, bf16_rounded = 0;
    for (int mi = 0; mi < 2 * n_isa; mi++) {
        int ii = mi % n_isa, bf = mi >= n_isa;
        pd_backend *b = make_backend_mode(isa[ii], 2, -1, bf ? PD_DTYPE_BF16 : -1);
        ASSERT(b);
        const pd_backend_ops *o = pd_backend_get_ops(b);
        for (size_t di = 0; di < 3; di++)
            for (size_t ki = 0; ki < 8; ki++)
                for (size_t oi = 0; oi < 4; oi++)
                    for (size_t ni = 0; ni < 6; ni++) {
                        size_t n = ns[ni], K = ks[ki], out = outs[oi];
                        float *x = malloc(n * K * 4), *w = malloc(out * K * 4),
                              *bias = malloc(out * 4), *y = malloc(n * out * 4);
                        fill(x, n * K);
                        fill(w, out * K);
                        fill(bias, out);
                        host_tensor hw, hb;
                        ht_make(&hw, "w", dts[di], out, K, w);
                        ht_make(&hb, "b", PD_DTYPE_F32, 0, out, bias);
                        pd_weight *W = NULL, *B = NULL;
                        int rc1 = o->weight_load(b, &hw.t, NULL, &W);
                        int rc2 = o->weight_load(b, &hb.t, NULL, &B);
                        int rc3 = (rc1 == 0 && rc2 == 0) ? o->matmul(b, x, n, W, B, y) : -1;
                        double worst = 0, worst_f64 = 0;
                        for (size_t i = 0; i < n && rc3 == 0; i++)
                            for (size_t j = 0; j < out; j++) {
                                double ref = bias[j], ref64 = bias[j], mag = fabs(bias[j]);
                                for (size_t k = 0; k < K; k++) {
                                    float xk = x[i * K + k], wk = w[j * K + k];
                                    ref64 += (double)xk * wk;
                                    mag += fabs((double)xk * wk);
                                    if (bf) {
                                        xk = pd_bf16_to_f32(pd_f32_to_bf16(xk));
                                        wk = pd_bf16_to_f32(pd_f32_to_bf16(wk));
                                    }
                                    ref += (double)xk * wk;
                                }
                                double yv = y[i * out + j];
                                double err = fabs(yv - ref) / (mag * 1e-6 + 1e-30);
                                double err64 = !bf ? 0
                                                   : fabs(yv - ref64) /
                                                         (mag * (0x1p-7 + 0x1p-16 + 1e-6) + 1e-30);
                                if (err > worst) worst = err;
                                if (err64 > worst_f64) worst_f64 = err64;
                                bf16_elems += bf;
                                bf16_rounded += bf && fabs(yv - ref64) > mag * 1e-6;
                            }
                        o->weight_free(b, W);
                        o->weight_free(b, B);
                        free(x), free(w), free(bias), free(y), free(hw.buf), free(hb.buf);
                        ASSERT_OK(rc1);
                        ASSERT_OK(rc2);
                        ASSERT_OK(rc3);
                        ASSERT_MSG(worst <= 1.0 && worst_f64 <= 1.0,
                                   "isa %d compute %s dtype %s n %zu K %zu out %zu: error %.3g x "
                                   "bound, %.3g x the bf16 bound against the unrounded values",
                                   (int)isa[ii], bf ? "bf16" : "f32", pd_dtype_name(dts[di]), n, K,
                                   out, worst, worst_f64);
                        checked++;
                    }
        pd_backend_free(b);
    }
    ASSERT(checked == 2 * n_isa * 3 * 8 * 4 * 6);
    ASSERT_MSG(bf16_rounded > bf16_elems / 2, "bf16 mode: only %zu of %zu elements show rounding",
               bf16_rounded, bf16_elems);
}

/* A row's result is bit-identical whether it is computed alone, in a batch of 2 to 9 or of 37 at
 * any position (every tile shape: decode, few rows, prefill), and with 1 or 2 threads, in f32 and
 * in the bf16 compute mode; weight_dtype bf16 conversion at load equals bf16 storage. */
TEST(matmul_rows_bit_identical_across_batches_and_threads)
{
    const size_t K = 200, out = 75, N = 37;
    pd_cpu_isa isa[3];
    int n_isa = isas(isa);
    float *x = malloc(N * K * 4), *w = malloc(out * K * 4), *yb = malloc(N * out * 4),
          *y1 = malloc(out * 4), *yt = malloc(N * out * 4);
    fill(x, N * K);
    fill(w, out * K);
    host_tensor hw;
    ht_make(&hw, "w", PD_DTYPE_F32, out, K, w);
    int ok = 1;
    for (int mi = 0; mi < 2 * n_isa && ok; mi++) {
        int ii = mi % n_isa, cdt = mi < n_isa ? -1 : PD_DTYPE_BF16;
        pd_backend *b2 = make_backend_mode(isa[ii], 2, -1, cdt),
                   *b1 = make_backend_mode(isa[ii], 1, -1, cdt);
        ASSERT(b1 && b2);
        const pd_backend_ops *o = pd_backend_get_ops(b2);
        pd_weight *W2 = NULL, *W1 = NULL;
        ASSERT_OK(o->weight_load(b2, &hw.t, NULL, &W2));
        ASSERT_OK(o->weight_load(b1, &hw.t, NULL, &W1));
        ASSERT_OK(o->matmul(b2, x, N, W2, NULL, yb));
        ASSERT_OK(o->matmul(b1, x, N, W1, NULL, yt));
        ok = memcmp(yb, yt, N * out * 4) == 0;
        for (size_t r = 0; r < N && ok; r++) {
            ASSERT_OK(o->matmul(b2, x + r * K, 1, W2, NULL, y1));
            ok = memcmp(y1, yb + r * out, out * 4) == 0;
            for (size_t m = 2; m <= 9 && ok && r + m <= N; m++) { /* decode, few, prefill */
                float ys[9 * 75];
                ASSERT_OK(o->matmul(b2, x + r * K, m, W2, NULL, ys));
                ok = memcmp(ys, yb + r * out, m * out * 4) == 0;
            }
        }
        o->weight_free(b2, W2);
        o->weight_free(b1, W1);
        pd_backend_free(b1);
        pd_backend_free(b2);
        ASSERT_MSG(ok,
                   "isa %d compute dtype %d: a row differs between batch sizes or thread counts",
                   (int)isa[ii], cdt);
    }
    /* weight_dtype = bf16 converts at load: identical to a bf16-stored tensor */
    pd_backend *bc = make_backend(PD_CPU_ISA_AUTO, 2, PD_DTYPE_BF16);
    pd_backend *bs = make_backend(PD_CPU_ISA_AUTO, 2, -1);
    ASSERT(bc && bs);
    const pd_backend_ops *o = pd_backend_get_ops(bc);
    host_tensor hb;
    float *wcopy = malloc(out * K * 4);
    memcpy(wcopy, w, out * K * 4);
    ht_make(&hb, "wb", PD_DTYPE_BF16, out, K, wcopy);
    pd_weight *Wc = NULL, *Ws = NULL;
    ASSERT_OK(o->weight_load(bc, &hw.t, NULL, &Wc));
    ASSERT_OK(o->weight_load(bs, &hb.t, NULL, &Ws));
    ASSERT(o->weight_nbytes(bc, Wc) == o->weight_nbytes(bs, Ws));
    ASSERT_OK(o->matmul(bc, x, N, Wc, NULL, yb));
    ASSERT_OK(o->matmul(bs, x, N, Ws, NULL, yt));
    ok = memcmp(yb, yt, N * out * 4) == 0;
    o->weight_free(bc, Wc);
    o->weight_free(bs, Ws);
    pd_backend_free(bc);
    pd_backend_free(bs);
    free(x), free(w), free(yb), free(y1), free(yt), free(hw.buf), free(hb.buf), free(wcopy);
    ASSERT_MSG(ok, "bf16 converted at load differs from bf16 stored");
}

/* The bf16 mode's refusals: a compute dtype the CPU does not have, another weight dtype, more
 * rows than the workspace holds. */
TEST(bf16_mode_errors)
{
    pd_backend_params p = pd_backend_default_params();
    pd_backend *b = NULL;
    p.compute_dtype = PD_DTYPE_F16;
    ASSERT_ERR(pd_backend_cpu_create(&p, &b), PD_EUNSUPPORTED, "compute_dtype");
    p.compute_dtype = PD_DTYPE_BF16;
    p.weight_dtype = PD_DTYPE_F32;
    ASSERT_ERR(pd_backend_cpu_create(&p, &b), PD_EINVAL, "weight_dtype");
    p.weight_dtype = -1;
    p.max_tokens = 4;
    p.n_threads = 1;
    ASSERT_OK(pd_backend_cpu_create(&p, &b));
    const pd_backend_ops *o = pd_backend_get_ops(b);
    float w[3 * 40], x[5 * 40], y[5 * 3];
    fill(w, 3 * 40);
    fill(x, 5 * 40);
    host_tensor hw;
    ht_make(&hw, "w", PD_DTYPE_F32, 3, 40, w);
    pd_weight *W = NULL;
    ASSERT_OK(o->weight_load(b, &hw.t, NULL, &W));
    ASSERT(o->weight_nbytes(b, W) == 3 * 64 * 2); /* bf16, rows padded to 64 elements */
    ASSERT_OK(o->matmul(b, x, 4, W, NULL, y));
    ASSERT_ERR(o->matmul(b, x, 5, W, NULL, y), PD_EINVAL, "max_tokens");
    o->weight_free(b, W);
    free(hw.buf);
    pd_backend_free(b);
}

TEST(weight_slices_and_errors)
{
    pd_backend *b = make_backend(PD_CPU_ISA_AUTO, 1, -1);
    ASSERT(b);
    const pd_backend_ops *o = pd_backend_get_ops(b);
    const size_t R = 6, C = 10;
    float w[60], x[10], y[6];
    for (size_t i = 0; i < R * C; i++) w[i] = (float)i;
    host_tensor h;
    ht_make(&h, "model.layers.0.mlp.up_proj.weight", PD_DTYPE_F32, R, C, w);
    /* rows [2, 5) x cols [3, 10): y[j] = sum_k x[k] * w[(2+j)*C + 3+k] */
    pd_weight_slice sl = {2, 3, 3, 7};
    pd_weight *W = NULL;
    ASSERT_OK(o->weight_load(b, &h.t, &sl, &W));
    for (size_t k = 0; k < 7; k++) x[k] = (float)(k + 1);
    ASSERT_OK(o->matmul(b, x, 1, W, NULL, y));
    for (size_t j = 0; j < 3; j++) {
        double ref = 0;
        for (size_t k = 0; k < 7; k++) ref += x[k] * w[(2 + j) * C + 3 + k];
        ASSERT_NEAR(y[j], ref, 1e-3);
    }
    o->weight_free(b, W);
    pd_weight_slice bad = {4, 3, 0, 0};
    ASSERT_ERR(o->weight_load(b, &h.t, &bad, &W), PD_EINVAL, "up_proj.weight");
    pd_weight_slice badc = {0, 0, 5, 6};
    ASSERT_ERR(o->weight_load(b, &h.t, &badc, &W), PD_EINVAL, "outside (6, 10)");
    pd_tensor t3 = h.t;
    t3.ndim = 3;
    t3.shape[2] = 1;
    ASSERT_ERR(o->weight_load(b, &t3, NULL, &W), PD_EINVAL, "expected 1 or 2 dimensions");
    pd_tensor t0 = h.t;
    t0.data = NULL;
    ASSERT_ERR(o->weight_load(b, &t0, NULL, &W), PD_EINVAL, "has no data");
    /* 1-D slice (a bias) */
    host_tensor hv;
    float v[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    ht_make(&hv, "bias", PD_DTYPE_BF16, 0, 8, v);
    pd_weight_slice vs = {0, 1, 4, 4};
    ASSERT_OK(o->weight_load(b, &hv.t, &vs, &W));
    ASSERT(o->weight_nbytes(b, W) == 16 * 4); /* one row, padded to 16 f32 */
    o->weight_free(b, W);
    free(h.buf);
    free(hv.buf);
    /* a forced ISA or dtype that does not exist */
    pd_backend_params p = pd_backend_default_params();
    p.weight_dtype = 7;
    pd_backend *bb = NULL;
    ASSERT_ERR(pd_backend_cpu_create(&p, &bb), PD_EINVAL, "weight_dtype");
    pd_backend_free(b);
}

/* ---- row ops ----------------------------------------------------------------------------------
 */

TEST(rmsnorm_swiglu_add_match_reference)
{
    pd_cpu_isa isa[3];
    int n_isa = isas(isa);
    const size_t n = 5, dim = 37;
    float x[5 * 37], g[5 * 37], u[5 * 37], wv[37], y[5 * 37];
    fill(x, n * dim);
    fill(g, n * dim);
    fill(u, n * dim);
    fill(wv, dim);
    for (int ii = 0; ii < n_isa; ii++) {
        pd_backend *b = make_backend(isa[ii], 2, -1);
        ASSERT(b);
        const pd_backend_ops *o = pd_backend_get_ops(b);
        host_tensor hw;
        float wcopy[37];
        memcpy(wcopy, wv, sizeof wv);
        ht_make(&hw, "norm", PD_DTYPE_F16, 0, dim, wcopy);
        pd_weight *W = NULL;
        ASSERT_OK(o->weight_load(b, &hw.t, NULL, &W));
        ASSERT_OK(o->rmsnorm(b, x, W, 1e-5f, n, dim, y));
        for (size_t r = 0; r < n; r++) {
            double ss = 0;
            for (size_t k = 0; k < dim; k++) ss += (double)x[r * dim + k] * x[r * dim + k];
            double inv = 1.0 / sqrt(ss / dim + 1e-5);
            for (size_t k = 0; k < dim; k++)
                ASSERT_NEAR(y[r * dim + k], x[r * dim + k] * inv * wcopy[k], 1e-5);
        }
        pd_weight *bad = NULL;
        host_tensor hb;
        float bv[36] = {0};
        ht_make(&hb, "short", PD_DTYPE_F32, 0, 36, bv);
        ASSERT_OK(o->weight_load(b, &hb.t, NULL, &bad));
        ASSERT_ERR(o->rmsnorm(b, x, bad, 1e-5f, n, dim, y), PD_EINVAL, "expected (1, 37)");
        o->weight_free(b, bad);
        o->weight_free(b, W);
        free(hw.buf);
        free(hb.buf);

        ASSERT_OK(o->swiglu(b, g, u, n, dim, y));
        for (size_t i = 0; i < n * dim; i++) {
            double s = g[i] / (1.0 + exp(-(double)g[i]));
            ASSERT_NEAR(y[i], s * u[i], 1e-6);
        }
        memcpy(y, x, sizeof x);
        ASSERT_OK(o->add(b, y, g, n * dim));
        for (size_t i = 0; i < n * dim; i++) ASSERT(y[i] == x[i] + g[i]);
        pd_backend_free(b);
    }
}

/* ---- a small paged step: plan, embed, rope, kv_write, attention, gather ---------------------- */

enum { NQ = 4, NKV = 2, HD = 6, BS = 4, NBLK = 16 };

typedef struct {
    size_t n_tokens, n_seqs;
    int32_t token_ids[16], positions[16], q_indptr[4], kv_len[3], block_indptr[4], block_ids[12],
        out_rows[3];
    int64_t slots[16];
    float cosv[16 * HD / 2], sinv[16 * HD / 2];
} step_desc;

/* Three sequences: seq 0 prefill of 5 rows (positions 0..4), seq 1 a decode row at position 6
 * (positions 0..5 written by an earlier step), seq 2 a chunk of 3 rows at positions 2..4.
 * Blocks are scattered (not in order). */
static void make_step(step_desc *s, int earlier)
{
    memset(s, 0, sizeof *s);
    static const int32_t blocks[] = {7, 2, 11, 0, 5, 9, 14};
    /* seq0: blocks 7,2 ; seq1: 11,0 ; seq2: 5,9,14 (needs only 2) */
    s->n_seqs = 3;
    int32_t bind[4] = {0, 2, 4, 7};
    memcpy(s->block_indptr, bind, sizeof bind);
    memcpy(s->block_ids, blocks, sizeof blocks);
    if (earlier) {
        /* seq 1's positions 0..5 and seq 2's positions 0..1, one row each per position */
        int32_t qi[4] = {0, 0, 6, 8};
        int32_t kl[3] = {0, 6, 2};
        memcpy(s->q_indptr, qi, sizeof qi);
        memcpy(s->kv_len, kl, sizeof kl);
        s->n_tokens = 8;
        for (int r = 0; r < 8; r++) s->positions[r] = r < 6 ? r : r - 6;
    } else {
        int32_t qi[4] = {0, 5, 6, 9};
        int32_t kl[3] = {5, 7, 5};
        memcpy(s->q_indptr, qi, sizeof qi);
        memcpy(s->kv_len, kl, sizeof kl);
        s->n_tokens = 9;
        int32_t pos[9] = {0, 1, 2, 3, 4, 6, 2, 3, 4};
        memcpy(s->positions, pos, sizeof pos);
    }
    for (size_t seq = 0; seq < 3; seq++)
        for (int32_t r = s->q_indptr[seq]; r < s->q_indptr[seq + 1]; r++) {
            int32_t p = s->positions[r];
            s->slots[r] = (int64_t)s->block_ids[s->block_indptr[seq] + p / BS] * BS + p % BS;
        }
    for (size_t r = 0; r < s->n_tokens; r++) {
        s->token_ids[r] = (int32_t)((r * 7 + 3) % 11);
        for (int i = 0; i < HD / 2; i++) {
            double ang = s->positions[r] * pow(10000.0, -2.0 * i / HD);
            s->cosv[r * HD / 2 + i] = (float)cos(ang);
            s->sinv[r * HD / 2 + i] = (float)sin(ang);
        }
    }
    s->out_rows[0] = 4;
    s->out_rows[1] = earlier ? 5 : 5;
    s->out_rows[2] = earlier ? 7 : 8;
}

static pd_batch to_batch(step_desc *s, size_t n_out)
{
    pd_batch bt = {.n_tokens = s->n_tokens,
                   .token_ids = s->token_ids,
                   .positions = s->positions,
                   .slots = s->slots,
                   .rope_cos = s->cosv,
                   .rope_sin = s->sinv,
                   .rope_dim = HD,
                   .n_seqs = s->n_seqs,
                   .q_indptr = s->q_indptr,
                   .kv_len = s->kv_len,
                   .block_indptr = s->block_indptr,
                   .block_ids = s->block_ids,
                   .n_out = n_out,
                   .out_rows = s->out_rows};
    return bt;
}

TEST(paged_attention_matches_reference)
{
    pd_cpu_isa isa[3];
    int n_isa = isas(isa);
    /* Per sequence, the contiguous k/v of every position (ref), filled over two steps. */
    float kref[3][8][NKV * HD], vref[3][8][NKV * HD];
    for (int ii = 0; ii < n_isa; ii++) {
        pd_backend *b = make_backend(isa[ii], 2, -1);
        ASSERT(b);
        const pd_backend_ops *o = pd_backend_get_ops(b);
        pd_kv_params kp = {.n_layers = 2,
                           .n_blocks = NBLK,
                           .block_size = BS,
                           .n_kv_heads = NKV,
                           .head_dim = HD,
                           .dtype = PD_DTYPE_F32};
        pd_kv *kv = NULL;
        ASSERT_OK(o->kv_create(b, &kp, &kv));
        rng_state = 12345;
        for (int stepi = 0; stepi < 2; stepi++) {
            step_desc s;
            make_step(&s, stepi == 0);
            pd_batch bt = to_batch(&s, 3);
            ASSERT_OK(o->plan(b, &bt));
            size_t n = s.n_tokens;
            float k[16 * NKV * HD], v[16 * NKV * HD], q[16 * NQ * HD], out[16 * NQ * HD];
            float q0[16 * NQ * HD], k0[16 * NKV * HD];
            fill(k, n * NKV * HD);
            fill(v, n * NKV * HD);
            fill(q, n * NQ * HD);
            memcpy(q0, q, sizeof q);
            memcpy(k0, k, sizeof k);
            ASSERT_OK(o->rope(b, q, NQ, HD));
            ASSERT_OK(o->rope(b, k, NKV, HD));
            /* rope reference */
            for (size_t r = 0; r < n; r++)
                for (int h = 0; h < NKV; h++)
                    for (int i = 0; i < HD / 2; i++) {
                        float c = s.cosv[r * HD / 2 + i], sn = s.sinv[r * HD / 2 + i];
                        const float *kk = k0 + (r * NKV + h) * HD;
                        ASSERT_NEAR(k[(r * NKV + h) * HD + i], kk[i] * c - kk[i + HD / 2] * sn,
                                    1e-6);
                        ASSERT_NEAR(k[(r * NKV + h) * HD + i + HD / 2],
                                    kk[i + HD / 2] * c + kk[i] * sn, 1e-6);
                    }
            ASSERT_OK(o->kv_write(b, kv, 1, k, v));
            for (size_t sq = 0; sq < 3; sq++)
                for (int32_t r = s.q_indptr[sq]; r < s.q_indptr[sq + 1]; r++) {
                    memcpy(kref[sq][s.positions[r]], k + r * NKV * HD, NKV * HD * 4);
                    memcpy(vref[sq][s.positions[r]], v + r * NKV * HD, NKV * HD * 4);
                }
            ASSERT_OK(o->attention(b, kv, 1, q, NQ, 0.4f, out));
            for (size_t sq = 0; sq < 3; sq++)
                for (int32_t r = s.q_indptr[sq]; r < s.q_indptr[sq + 1]; r++)
                    for (int h = 0; h < NQ; h++) {
                        int g = h / (NQ / NKV);
                        const float *qh = q + (r * NQ + h) * HD;
                        int ctx = s.positions[r] + 1;
                        double sc[8], mx = -1e300, sum = 0;
                        for (int t = 0; t < ctx; t++) {
                            sc[t] = 0;
                            for (int d = 0; d < HD; d++)
                                sc[t] += (double)qh[d] * kref[sq][t][g * HD + d];
                            sc[t] *= 0.4;
                            if (sc[t] > mx) mx = sc[t];
                        }
                        for (int t = 0; t < ctx; t++) sum += sc[t] = exp(sc[t] - mx);
                        for (int d = 0; d < HD; d++) {
                            double acc = 0;
                            for (int t = 0; t < ctx; t++) acc += sc[t] * vref[sq][t][g * HD + d];
                            ASSERT_NEAR(out[(r * NQ + h) * HD + d], acc / sum, 2e-6);
                        }
                    }
            /* gather */
            float gat[3 * NQ * HD];
            ASSERT_OK(o->gather_rows(b, out, NQ * HD, gat));
            for (int i = 0; i < 3; i++)
                ASSERT(memcmp(gat + i * NQ * HD, out + s.out_rows[i] * NQ * HD, NQ * HD * 4) == 0);
        }
        /* export layer 1, blocks {11, 0}, kv head 1 -> seq 1's positions 0..6, head 1 */
        int32_t ids[2] = {11, 0};
        pd_kv_range rg = {.layer = 1, .block_ids = ids, .n_blocks = 2, .head0 = 1, .n_heads = 1};
        float host[2 * 2 * BS * HD];
        ASSERT_OK(o->kv_export(b, kv, &rg, host));
        for (int p = 0; p < 7; p++)
            for (int d = 0; d < HD; d++) {
                ASSERT(host[p * HD + d] == kref[1][p][HD + d]);
                ASSERT(host[2 * BS * HD + p * HD + d] == vref[1][p][HD + d]);
            }
        /* import into blocks {3, 4} of layer 0 and read back through the raw view */
        int32_t ids2[2] = {3, 4};
        pd_kv_range rg2 = {.layer = 0, .block_ids = ids2, .n_blocks = 2, .head0 = 1, .n_heads = 1};
        ASSERT_OK(o->kv_import(b, kv, &rg2, host));
        pd_kv_layer_view vw;
        ASSERT_OK(o->kv_layer(b, kv, 0, &vw));
        ASSERT(vw.host_visible && vw.dtype == PD_DTYPE_F32);
        ASSERT(vw.token_stride == NKV * HD * 4 && vw.block_stride == BS * NKV * HD * 4);
        const float *k0v = (const float *)((const char *)vw.k + 3 * vw.block_stride +
                                           2 * vw.token_stride + vw.head_stride);
        ASSERT(memcmp(k0v, kref[1][2] + HD, HD * 4) == 0);
        int32_t badids[1] = {NBLK};
        pd_kv_range rg3 = {
            .layer = 0, .block_ids = badids, .n_blocks = 1, .head0 = 0, .n_heads = 1};
        ASSERT_ERR(o->kv_export(b, kv, &rg3, host), PD_ERANGE, "block_ids[0] = 16");
        pd_kv_range rg4 = {.layer = 2, .block_ids = ids, .n_blocks = 1, .head0 = 0, .n_heads = 1};
        ASSERT_ERR(o->kv_export(b, kv, &rg4, host), PD_ERANGE, "layer 2");
        pd_kv_range rg5 = {.layer = 0, .block_ids = ids, .n_blocks = 1, .head0 = 1, .n_heads = 2};
        ASSERT_ERR(o->kv_import(b, kv, &rg5, host), PD_ERANGE, "heads");
        o->kv_free(b, kv);
        pd_backend_free(b);
    }
}

/* The fused ops (matmul_multi, matmul_swiglu, add_rmsnorm, rope_kv_write) give bit for bit what the
 * plain ops they stand for give, on each ISA, with 1 and 3 threads, for decode and prefill row
 * counts; and their bad inputs are refused with the field named. */
TEST(fused_ops_equal_plain_ops)
{
    pd_cpu_isa isa[3];
    int n_isa = isas(isa);
    enum { K = 72, O0 = 40, O1 = 9, O2 = 17, MAXN = 9 };
    const size_t outs[3] = {O0, O1, O2};
    for (int ii = 0; ii < n_isa; ii++)
        for (int threads = 1; threads <= 3; threads += 2) {
            pd_backend *b = make_backend(isa[ii], threads, -1);
            ASSERT(b);
            const pd_backend_ops *o = pd_backend_get_ops(b);
            ASSERT(o->matmul_multi && o->matmul_swiglu && o->add_rmsnorm && o->rope_kv_write);
            rng_state = 777;
            host_tensor hw[3], hb[3];
            pd_weight *W[3], *B[3];
            for (int i = 0; i < 3; i++) {
                float *w = malloc(outs[i] * K * 4), *bias = malloc(outs[i] * 4);
                fill(w, outs[i] * K);
                fill(bias, outs[i]);
                ht_make(&hw[i], "w", i == 1 ? PD_DTYPE_F16 : PD_DTYPE_BF16, outs[i], K, w);
                ht_make(&hb[i], "b", PD_DTYPE_F32, 0, outs[i], bias);
                ASSERT_OK(o->weight_load(b, &hw[i].t, NULL, &W[i]));
                ASSERT_OK(o->weight_load(b, &hb[i].t, NULL, &B[i]));
                free(w), free(bias);
            }
            float x[MAXN * K], fused[3][MAXN * O0], plain[3][MAXN * O0];
            fill(x, MAXN * K);
            for (size_t n = 1; n <= MAXN; n += 4) {
                const pd_weight *ws[3] = {W[0], W[1], W[2]}, *bs[3] = {B[0], NULL, B[2]};
                void *ys[3] = {fused[0], fused[1], fused[2]};
                ASSERT_OK(o->matmul_multi(b, x, n, 3, ws, bs, ys));
                for (int i = 0; i < 3; i++) ASSERT_OK(o->matmul(b, x, n, W[i], bs[i], plain[i]));
                for (int i = 0; i < 3; i++)
                    ASSERT(memcmp(fused[i], plain[i], n * outs[i] * 4) == 0);
                ASSERT_OK(o->matmul_multi(b, x, n, 2, ws, NULL, ys)); /* no biases */
                ASSERT_OK(o->matmul(b, x, n, W[0], NULL, plain[0]));
                ASSERT(memcmp(fused[0], plain[0], n * O0 * 4) == 0);
            }
            const pd_weight *ws[3] = {W[0], W[1], W[2]};
            void *ys[3] = {fused[0], fused[1], fused[2]};
            ASSERT_ERR(o->matmul_multi(b, x, 1, 0, ws, NULL, ys), PD_EINVAL, "0 weights");
            ASSERT_ERR(o->matmul_multi(b, x, 1, 5, ws, NULL, ys), PD_EINVAL, "5 weights");
            const pd_weight *wrong_bias[2] = {B[1], NULL}; /* 9 elements for 40 rows */
            ASSERT_ERR(o->matmul_multi(b, x, 1, 2, ws, wrong_bias, ys), PD_EINVAL,
                       "expected (1, 40)");
            host_tensor hn;
            float wn[K], *narrow = malloc(5 * 8 * 4);
            fill(narrow, 5 * 8);
            ht_make(&hn, "narrow", PD_DTYPE_F32, 5, 8, narrow);
            pd_weight *Wn;
            ASSERT_OK(o->weight_load(b, &hn.t, NULL, &Wn));
            const pd_weight *mixed[2] = {W[0], Wn};
            ASSERT_ERR(o->matmul_multi(b, x, 1, 2, mixed, NULL, ys), PD_EINVAL,
                       "weight 1 has 8 columns");
            o->weight_free(b, Wn);
            free(narrow), free(hn.buf);

            /* matmul_swiglu = matmul(gate), matmul(up), swiglu; W[1] (9 rows) is not W[0]'s shape
             */
            for (size_t n = 1; n <= MAXN; n += 4) {
                float g[MAXN * O0], u[MAXN * O0];
                ASSERT_OK(o->matmul_swiglu(b, x, n, W[0], W[0], g, u, fused[0]));
                ASSERT_OK(o->matmul(b, x, n, W[0], NULL, plain[0]));
                ASSERT_OK(o->matmul(b, x, n, W[0], NULL, plain[1]));
                ASSERT_OK(o->swiglu(b, plain[0], plain[1], n, O0, plain[2]));
                ASSERT(memcmp(fused[0], plain[2], n * O0 * 4) == 0);
            }
            ASSERT_ERR(o->matmul_swiglu(b, x, 1, W[0], W[1], fused[1], fused[2], fused[0]),
                       PD_EINVAL, "gate has 40 rows, up 9");

            /* add_rmsnorm = add, then rmsnorm */
            fill(wn, K);
            ht_make(&hn, "norm", PD_DTYPE_F32, 0, K, wn);
            ASSERT_OK(o->weight_load(b, &hn.t, NULL, &Wn));
            float r0[MAXN * K], r1[MAXN * K], t[MAXN * K], h0[MAXN * K], h1[MAXN * K];
            fill(r0, MAXN * K);
            fill(t, MAXN * K);
            memcpy(r1, r0, sizeof r0);
            ASSERT_OK(o->add_rmsnorm(b, r0, t, Wn, 1e-5f, MAXN, K, h0));
            ASSERT_OK(o->add(b, r1, t, MAXN * K));
            ASSERT_OK(o->rmsnorm(b, r1, Wn, 1e-5f, MAXN, K, h1));
            ASSERT(memcmp(r0, r1, sizeof r0) == 0 && memcmp(h0, h1, sizeof h0) == 0);
            ASSERT_ERR(o->add_rmsnorm(b, r0, t, Wn, 1e-5f, MAXN, K - 1, h0), PD_EINVAL,
                       "expected (1, 71)");
            o->weight_free(b, Wn);
            free(hn.buf);

            /* rope_kv_write = rope(q), rope(k), kv_write(k, v) */
            pd_kv_params kp = {2, NBLK, BS, NKV, HD, PD_DTYPE_F32};
            pd_kv *kv[2];
            for (int i = 0; i < 2; i++) ASSERT_OK(o->kv_create(b, &kp, &kv[i]));
            step_desc sd;
            make_step(&sd, 0);
            pd_batch bt = to_batch(&sd, 3);
            ASSERT_OK(o->plan(b, &bt));
            size_t n = sd.n_tokens;
            float q[2][16 * NQ * HD], k[2][16 * NKV * HD], v[16 * NKV * HD];
            fill(q[0], n * NQ * HD);
            fill(k[0], n * NKV * HD);
            fill(v, n * NKV * HD);
            memcpy(q[1], q[0], sizeof q[0]);
            memcpy(k[1], k[0], sizeof k[0]);
            ASSERT_OK(o->rope_kv_write(b, kv[0], 1, q[0], NQ, k[0], v));
            ASSERT_OK(o->rope(b, q[1], NQ, HD));
            ASSERT_OK(o->rope(b, k[1], NKV, HD));
            ASSERT_OK(o->kv_write(b, kv[1], 1, k[1], v));
            ASSERT(memcmp(q[0], q[1], n * NQ * HD * 4) == 0);
            float pool[2][2 * NBLK * BS * NKV * HD];
            int32_t all[NBLK];
            for (int i = 0; i < NBLK; i++) all[i] = i;
            pd_kv_range rg = {1, all, NBLK, 0, NKV};
            for (int i = 0; i < 2; i++) ASSERT_OK(o->kv_export(b, kv[i], &rg, pool[i]));
            ASSERT(memcmp(pool[0], pool[1], sizeof pool[0]) == 0);
            ASSERT_ERR(o->rope_kv_write(b, kv[0], 2, q[0], NQ, k[0], v), PD_ERANGE, "layer 2");
            for (int i = 0; i < 2; i++) o->kv_free(b, kv[i]);
            for (int i = 0; i < 3; i++) {
                o->weight_free(b, W[i]);
                o->weight_free(b, B[i]);
                free(hw[i].buf), free(hb[i].buf);
            }
            pd_backend_free(b);
        }
}

TEST(plan_and_step_errors)
{
    pd_backend *b = make_backend(PD_CPU_ISA_AUTO, 1, -1);
    ASSERT(b);
    const pd_backend_ops *o = pd_backend_get_ops(b);
    step_desc s;
    make_step(&s, 0);
    pd_batch bt = to_batch(&s, 3);
    float q[16 * NQ * HD] = {0};
    ASSERT_ERR(o->rope(b, q, NQ, HD), PD_EINVAL, "no planned step");
    pd_batch bad = bt;
    int32_t qi[4] = {0, 5, 4, 9};
    bad.q_indptr = qi;
    ASSERT_ERR(o->plan(b, &bad), PD_EINVAL, "q_indptr decreases at sequence 1");
    bad = bt;
    int32_t pos[9] = {0, 1, 2, 3, 5, 6, 2, 3, 4};
    bad.positions = pos;
    ASSERT_ERR(o->plan(b, &bad), PD_ERANGE, "positions[4] = 5");
    bad = bt;
    int32_t outr[3] = {4, 4, 8};
    bad.out_rows = outr;
    ASSERT_ERR(o->plan(b, &bad), PD_EINVAL, "out_rows[1]");
    bad = bt;
    bad.rope_dim = 5;
    ASSERT_ERR(o->plan(b, &bad), PD_ERANGE, "rope_dim 5");
    bad = bt;
    bad.n_tokens = 100000;
    ASSERT_ERR(o->plan(b, &bad), PD_ERANGE, "n_tokens 100000");
    ASSERT_OK(o->plan(b, &bt));
    ASSERT_ERR(o->rope(b, q, NQ, 8), PD_EINVAL, "rope_dim 6");

    /* embedding: token id outside the table */
    float tab[11 * 3];
    fill(tab, 33);
    host_tensor ht;
    ht_make(&ht, "embed", PD_DTYPE_BF16, 11, 3, tab);
    pd_weight *E = NULL;
    ASSERT_OK(o->weight_load(b, &ht.t, NULL, &E));
    float e[9 * 3];
    ASSERT_OK(o->embed(b, E, e));
    for (size_t r = 0; r < 9; r++)
        for (int c = 0; c < 3; c++) ASSERT(e[r * 3 + c] == tab[s.token_ids[r] * 3 + c]);
    s.token_ids[2] = 11;
    ASSERT_OK(o->plan(b, &bt));
    ASSERT_ERR(o->embed(b, E, e), PD_ERANGE, "token_ids[2] = 11");
    o->weight_free(b, E);
    free(ht.buf);

    /* KV: slot outside the pool; block table too short; query heads not a multiple */
    pd_kv_params kp = {.n_layers = 1,
                       .n_blocks = 8,
                       .block_size = BS,
                       .n_kv_heads = NKV,
                       .head_dim = HD,
                       .dtype = PD_DTYPE_F32};
    pd_kv *kv = NULL;
    ASSERT_OK(o->kv_create(b, &kp, &kv));
    s.token_ids[2] = 1;
    float k[16 * NKV * HD] = {0};
    ASSERT_OK(o->plan(b, &bt));
    ASSERT_ERR(o->kv_write(b, kv, 0, k, k), PD_ERANGE, "outside the pool [0, 32)");
    ASSERT_ERR(o->attention(b, kv, 0, q, NQ, 1.0f, q), PD_ERANGE, "block_ids[2] = 11");
    ASSERT_ERR(o->attention(b, kv, 0, q, 3, 1.0f, q), PD_EINVAL, "not a multiple");
    ASSERT_ERR(o->kv_write(b, kv, 1, k, k), PD_ERANGE, "layer 1");
    s.kv_len[0] = 9;
    int32_t posx[9] = {4, 5, 6, 7, 8, 6, 2, 3, 4};
    pd_batch b2 = bt;
    b2.positions = posx;
    ASSERT_OK(o->plan(b, &b2));
    ASSERT_ERR(o->attention(b, kv, 0, q, NQ, 1.0f, q), PD_ERANGE, "kv_len 9 exceeds its 2 blocks");
    o->kv_free(b, kv);
    pd_kv_params kb = kp;
    kb.dtype = PD_DTYPE_BF16;
    ASSERT_ERR(o->kv_create(b, &kb, &kv), PD_EUNSUPPORTED, "bfloat16");
    kb = kp;
    kb.head_dim = 1024;
    ASSERT_ERR(o->kv_create(b, &kb, &kv), PD_EUNSUPPORTED, "head_dim 1024");
    pd_backend_free(b);
}

/* Attention for several head sizes (the AVX-512 register kernel covers multiples of 16 up to
 * 128, the generic loop the rest) over 150 positions, so the online softmax crosses a key
 * chunk; GQA 6 query heads over 2 kv heads, blocks of 16 in reverse order. */
TEST(attention_head_sizes_and_long_context)
{
    static const size_t dims[] = {6, 16, 32, 48, 64, 128, 136};
    enum { T = 150, NQH = 6, NKH = 2, B = 16 };
    pd_cpu_isa isa[3];
    int n_isa = isas(isa);
    int32_t ids[T], pos[T], qi[2] = {0, T}, kl[1] = {T}, bi[2] = {0, 10}, blocks[10];
    int64_t slots[T];
    for (int i = 0; i < 10; i++) blocks[i] = 9 - i;
    for (int t = 0; t < T; t++) {
        ids[t] = 0;
        pos[t] = t;
        slots[t] = (int64_t)blocks[t / B] * B + t % B;
    }
    for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
        size_t D = dims[di];
        float *q = malloc(T * NQH * D * 4), *k = malloc(T * NKH * D * 4),
              *v = malloc(T * NKH * D * 4), *out = malloc(T * NQH * D * 4);
        float *cs = calloc(T * D / 2, 4), *sn = calloc(T * D / 2, 4);
        fill(q, T * NQH * D);
        fill(k, T * NKH * D);
        fill(v, T * NKH * D);
        for (size_t i = 0; i < T * NQH * D; i++) q[i] *= 3.0f; /* peaky softmax */
        for (int ii = 0; ii < n_isa; ii++) {
            pd_backend *b = make_backend(isa[ii], 2, -1);
            ASSERT(b);
            const pd_backend_ops *o = pd_backend_get_ops(b);
            pd_kv_params kp = {.n_layers = 1,
                               .n_blocks = 10,
                               .block_size = B,
                               .n_kv_heads = NKH,
                               .head_dim = D,
                               .dtype = PD_DTYPE_F32};
            pd_kv *kv = NULL;
            ASSERT_OK(o->kv_create(b, &kp, &kv));
            pd_batch bt = {.n_tokens = T,
                           .token_ids = ids,
                           .positions = pos,
                           .slots = slots,
                           .rope_cos = cs,
                           .rope_sin = sn,
                           .rope_dim = D % 2 ? D + 1 : D,
                           .n_seqs = 1,
                           .q_indptr = qi,
                           .kv_len = kl,
                           .block_indptr = bi,
                           .block_ids = blocks,
                           .n_out = 0,
                           .out_rows = NULL};
            ASSERT_OK(o->plan(b, &bt));
            ASSERT_OK(o->kv_write(b, kv, 0, k, v));
            ASSERT_OK(o->attention(b, kv, 0, q, NQH, 0.125f, out));
            double worst = 0;
            for (int r = 0; r < T; r += 7)
                for (int h = 0; h < NQH; h++) {
                    int g = h / (NQH / NKH);
                    double sc[T], mx = -1e300, sum = 0;
                    for (int t = 0; t <= r; t++) {
                        double d = 0;
                        for (size_t e = 0; e < D; e++)
                            d += (double)q[(r * NQH + h) * D + e] * k[(t * NKH + g) * D + e];
                        sc[t] = d * 0.125;
                        if (sc[t] > mx) mx = sc[t];
                    }
                    for (int t = 0; t <= r; t++) sum += sc[t] = exp(sc[t] - mx);
                    for (size_t e = 0; e < D; e++) {
                        double acc = 0;
                        for (int t = 0; t <= r; t++) acc += sc[t] * v[(t * NKH + g) * D + e];
                        double err = fabs(out[(r * NQH + h) * D + e] - acc / sum);
                        if (err > worst) worst = err;
                    }
                }
            o->kv_free(b, kv);
            pd_backend_free(b);
            ASSERT_MSG(worst < 5e-6, "isa %d head_dim %zu: attention error %.3g", (int)isa[ii], D,
                       worst);
        }
        free(q), free(k), free(v), free(out), free(cs), free(sn);
    }
}
