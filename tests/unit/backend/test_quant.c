/* Quantized linears (model/quant.h) and the CPU backend's quantized matmul.
 *
 * Each format is written here from float weights by this file's own packers (the layouts as
 * docs/quantization.md states them: AWQ's [0,2,4,6,1,3,5,7] nibble order, GPTQ packed along the
 * input with g_idx and v1 zero points, fp8 e4m3, int8), into a real safetensors file, then
 * resolved through pd_qweight_resolve. Checked: pd_qweight_dequant gives exactly the values the
 * packer meant ((q - z) * s, one f32 rounding); the CPU backend's quantized matmul equals, bit
 * for bit, its float matmul on those dequantized values (every ISA, every tile shape, tensor
 * parallel slices); and malformed tensors are refused naming the tensor. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "harness.h"
#include "model/dtype.h"
#include "model/quant.h"
#include "model/safetensors.h"
#include "util/status.h"

static uint64_t rng = 0x243F6A8885A308D3ull;

static float frand(void) /* uniform in [-1, 1) */
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((double)(rng >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

/* ---- this file's packers --------------------------------------------------------------------- */

typedef struct {
    const char *name;
    const char *qc; /* quantization_config JSON */
    int64_t rows, cols;
} fmt_case;

/* A quantized linear written by this file: its tensors, and the dequantized values meant. */
typedef struct {
    pd_tensor t[6];
    void *buf[6];
    int n;
    float *deq; /* (rows, cols) */
} packed;

static void *add(packed *p, const char *name, pd_dtype dt, int ndim, int64_t a, int64_t b)
{
    pd_tensor *t = &p->t[p->n];
    memset(t, 0, sizeof *t);
    t->name = name;
    t->dtype = dt;
    t->ndim = ndim;
    t->shape[0] = a;
    t->shape[1] = b;
    t->nbytes = (size_t)pd_tensor_numel(t) * pd_dtype_size(dt);
    p->buf[p->n] = calloc(1, t->nbytes ? t->nbytes : 1);
    t->data = p->buf[p->n];
    return p->buf[p->n++];
}

static void packed_free(packed *p)
{
    for (int i = 0; i < p->n; i++) free(p->buf[i]);
    free(p->deq);
}

static const int k_awq_order[8] = {0, 2, 4, 6, 1, 3, 5, 7};

/* Round-to-nearest asymmetric integers of a group: scale (f16-rounded) and zero point. */
static void int_params(const float *w, size_t n, size_t stride, int bits, uint16_t *s16,
                       unsigned *z)
{
    float lo = 0, hi = 0;
    for (size_t i = 0; i < n; i++) {
        float v = w[i * stride];
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    const float qmax = (float)((1 << bits) - 1);
    *s16 = pd_f32_to_f16((hi - lo) / qmax + 1e-6f);
    float s = pd_f16_to_f32(*s16);
    float zf = roundf(-lo / s);
    *z = (unsigned)(zf < 0 ? 0 : zf > qmax ? qmax : zf);
}

static unsigned int_q(float w, float s, unsigned z, int bits)
{
    float q = roundf(w / s) + (float)z, qmax = (float)((1 << bits) - 1);
    return (unsigned)(q < 0 ? 0 : q > qmax ? qmax : q);
}

/* AWQ or GPTQ (bits, group G, act order when perm, v1 zero points when v1) from W (R, C). */
static void pack_int(packed *p, const float *W, int64_t R, int64_t C, bool awq, int bits, int64_t G,
                     bool act_order, bool v1)
{
    const int64_t ng = C / G, P = 32 / bits;
    int32_t *gidx = malloc((size_t)C * sizeof *gidx);
    for (int64_t k = 0; k < C; k++) gidx[k] = (int32_t)(k / G);
    if (act_order) /* a shuffle of the group assignment: every group still holds G rows */
        for (int64_t k = C - 1; k > 0; k--) {
            int64_t j = (int64_t)((frand() + 1.0f) * 0.5f * (float)(k + 1)) % (k + 1);
            int32_t t = gidx[k];
            gidx[k] = gidx[j];
            gidx[j] = t;
        }
    uint16_t *s16 = malloc((size_t)(ng * R) * 2);
    unsigned *z = malloc((size_t)(ng * R) * sizeof *z);
    float *col = malloc((size_t)G * sizeof *col);
    for (int64_t g = 0; g < ng; g++)
        for (int64_t r = 0; r < R; r++) {
            int64_t m = 0;
            for (int64_t k = 0; k < C; k++)
                if (gidx[k] == g) col[m++] = W[r * C + k];
            int_params(col, (size_t)G, 1, bits, &s16[g * R + r], &z[g * R + r]);
        }
    free(col);
    p->deq = malloc((size_t)(R * C) * sizeof(float));
    uint32_t *qw = awq ? add(p, "L.qweight", PD_DTYPE_I32, 2, C, R / 8)
                       : add(p, "L.qweight", PD_DTYPE_I32, 2, C / P, R);
    uint32_t *qz = awq ? add(p, "L.qzeros", PD_DTYPE_I32, 2, ng, R / 8)
                       : add(p, "L.qzeros", PD_DTYPE_I32, 2, ng, R / P);
    uint16_t *sc = add(p, "L.scales", PD_DTYPE_F16, 2, ng, R);
    memcpy(sc, s16, (size_t)(ng * R) * 2);
    for (int64_t r = 0; r < R; r++)
        for (int64_t k = 0; k < C; k++) {
            int64_t g = gidx[k];
            float s = pd_f16_to_f32(s16[g * R + r]);
            unsigned q = int_q(W[r * C + k], s, z[g * R + r], bits);
            p->deq[r * C + k] = ((float)q - (float)z[g * R + r]) * s;
            if (awq) {
                int i = 0;
                while (k_awq_order[i] != r % 8) i++;
                qw[k * (R / 8) + r / 8] |= q << (4 * i);
            } else {
                qw[(k / P) * R + r] |= q << (bits * (k % P));
            }
        }
    for (int64_t g = 0; g < ng; g++)
        for (int64_t r = 0; r < R; r++) {
            unsigned zs = z[g * R + r];
            if (awq) {
                int i = 0;
                while (k_awq_order[i] != r % 8) i++;
                qz[g * (R / 8) + r / 8] |= zs << (4 * i);
            } else {
                zs = v1 ? (zs - 1u) & ((1u << bits) - 1u) : zs;
                qz[g * (R / P) + r / P] |= zs << (bits * (r % P));
            }
        }
    if (v1) /* a stored 2^bits - 1 reads as 2^bits (zero 0 wrapped), as vLLM reads it */
        for (int64_t r = 0; r < R; r++)
            for (int64_t k = 0; k < C; k++) {
                int64_t g = gidx[k];
                if (z[g * R + r] == 0) {
                    float s = pd_f16_to_f32(s16[g * R + r]);
                    unsigned q = int_q(W[r * C + k], s, 0, bits);
                    p->deq[r * C + k] = ((float)q - (float)(1u << bits)) * s;
                }
            }
    if (!awq) memcpy(add(p, "L.g_idx", PD_DTYPE_I32, 1, C, 0), gidx, (size_t)C * 4);
    free(gidx);
    free(s16);
    free(z);
}

/* fp8 (per-tensor scale) or int8 (per-row scale) weights. */
static void pack_8bit(packed *p, const float *W, int64_t R, int64_t C, bool fp8, bool per_row)
{
    uint8_t *wq = add(p, "L.weight", fp8 ? PD_DTYPE_F8_E4M3 : PD_DTYPE_I8, 2, R, C);
    float *ws = per_row ? add(p, "L.weight_scale", PD_DTYPE_F32, 2, R, 1)
                        : add(p, "L.weight_scale", PD_DTYPE_F32, 0, 0, 0);
    p->deq = malloc((size_t)(R * C) * sizeof(float));
    float amax_all = 0;
    for (int64_t i = 0; i < R * C; i++) amax_all = fmaxf(amax_all, fabsf(W[i]));
    for (int64_t r = 0; r < R; r++) {
        float amax = 0;
        for (int64_t k = 0; k < C; k++) amax = fmaxf(amax, fabsf(W[r * C + k]));
        float s = (per_row ? amax : amax_all) / (fp8 ? 448.0f : 127.0f);
        ws[per_row ? r : 0] = s;
        for (int64_t k = 0; k < C; k++) {
            float v = W[r * C + k] / s;
            if (fp8) {
                wq[r * C + k] = pd_f32_to_f8e4m3(v);
                p->deq[r * C + k] = pd_f8e4m3_to_f32(wq[r * C + k]) * s;
            } else {
                float q = fminf(fmaxf(roundf(v), -127.0f), 127.0f);
                wq[r * C + k] = (uint8_t)(int8_t)q;
                p->deq[r * C + k] = (float)(int8_t)q * s; /* never -0 */
            }
        }
    }
}

/* W8A8 as vLLM computes it, written here from its definition: each x row (n, K) quantized to
 * int8 with scale max|x| / 127 (round half to even of x * 127 / max|x|), the exact integer dot
 * product with the int8 weight rows [r0, r0 + R) (columns [c0, c0 + K) of a (*, C) matrix), times
 * the row's scale and the weight row's scale. */
static void w8a8_reference(const float *x, size_t n, size_t K, const int8_t *w, const float *ws,
                           size_t r0, size_t R, int64_t C, size_t c0, float *y)
{
    for (size_t i = 0; i < n; i++) {
        float amax = 0;
        for (size_t k = 0; k < K; k++) amax = fmaxf(amax, fabsf(x[i * K + k]));
        float inv = amax > 0 ? 127.0f / amax : 0.0f, sx = amax / 127.0f;
        for (size_t r = 0; r < R; r++) {
            int64_t d = 0;
            for (size_t k = 0; k < K; k++)
                d += (int64_t)lrintf(x[i * K + k] * inv) * w[(r0 + r) * (size_t)C + c0 + k];
            y[i * R + r] = (float)d * sx * ws[r0 + r];
        }
    }
}

/* The formats under test: config, packer arguments. */
typedef struct {
    const char *name, *qc;
    int kind; /* 0 awq, 1 gptq, 2 fp8, 3 int8 */
    int bits;
    int64_t G;
    bool act_order, v1, per_row;
} fmt;

static const fmt k_fmts[] = {
    {"awq",
     "{\"quant_method\":\"awq\",\"bits\":4,\"group_size\":32,\"zero_point\":true,"
     "\"version\":\"gemm\"}",
     0, 4, 32, false, false, false},
    {"gptq4 v1",
     "{\"quant_method\":\"gptq\",\"bits\":4,\"group_size\":32,\"desc_act\":false,"
     "\"sym\":false}",
     1, 4, 32, false, true, false},
    {"gptq4 act order v2",
     "{\"quant_method\":\"gptq\",\"bits\":4,\"group_size\":16,"
     "\"desc_act\":true,\"sym\":false,\"checkpoint_format\":\"gptq_v2\"}",
     1, 4, 16, true, false, false},
    {"gptq8 v1",
     "{\"quant_method\":\"gptq\",\"bits\":8,\"group_size\":32,\"desc_act\":false,"
     "\"sym\":false}",
     1, 8, 32, false, true, false},
    {"gptq4 per channel",
     "{\"quant_method\":\"gptq\",\"bits\":4,\"group_size\":-1,"
     "\"sym\":false,\"checkpoint_format\":\"gptq_v2\"}",
     1, 4, -1, false, false, false},
    {"fp8", "{\"quant_method\":\"fp8\",\"activation_scheme\":\"dynamic\"}", 2, 8, 0, false, false,
     false},
    {"w8a8 int8",
     "{\"quant_method\":\"compressed-tensors\",\"format\":\"int-quantized\","
     "\"config_groups\":{\"group_0\":{\"targets\":[\"Linear\"],\"weights\":{"
     "\"num_bits\":8,\"type\":\"int\",\"symmetric\":true,\"strategy\":\"channel\","
     "\"dynamic\":false},\"input_activations\":{\"num_bits\":8,\"type\":\"int\","
     "\"symmetric\":true,\"strategy\":\"token\",\"dynamic\":true}}},"
     "\"ignore\":[\"lm_head\"]}",
     3, 8, 0, false, false, true},
};
#define N_FMTS (sizeof k_fmts / sizeof k_fmts[0])

static int parse_qc(const char *text, pd_quant_config *c)
{
    json_error_t je;
    json_t *j = json_loads(text, 0, &je);
    int rc = pd_quant_config_parse(j, c);
    json_decref(j);
    return rc;
}

/* Writes format f of W (R, C) to a file, opens it and resolves "L". */
static int make(const fmt *f, const float *W, int64_t R, int64_t C, pd_quant_config *qc, packed *p,
                pd_st **st, pd_qweight *q)
{
    memset(p, 0, sizeof *p);
    PD_CHECK(parse_qc(f->qc, qc));
    if (f->kind <= 1)
        pack_int(p, W, R, C, f->kind == 0, f->bits, f->G < 0 ? C : f->G, f->act_order, f->v1);
    else
        pack_8bit(p, W, R, C, f->kind == 2, f->per_row);
    char path[600];
    snprintf(path, sizeof path, "%s/q.safetensors", pdt_tmp_dir());
    PD_CHECK(pd_st_write(path, p->t, (size_t)p->n, NULL, NULL));
    PD_CHECK(pd_st_open(path, st));
    return pd_qweight_resolve(*st, qc, "L", R, C, q);
}

static pd_backend *cpu(pd_cpu_isa isa, int threads)
{
    pd_backend_params bp = pd_backend_default_params();
    bp.cpu_isa = isa;
    bp.n_threads = threads;
    pd_backend *b = NULL;
    return pd_backend_cpu_create(&bp, &b) < 0 ? NULL : b;
}

/* ---- tests ---------------------------------------------------------------------------------- */

/* Every format: the dequantized values are the packer's, and the quantized matmul equals the
 * float matmul on them bit for bit (scalar and AVX-512; 1 to 13 rows: decode, few-row and
 * prefill tiles; 2 threads), whole and as tensor-parallel row and column slices; int8 W8A8
 * (activations quantized per token) equals w8a8_reference bit for bit instead. */
TEST(quantized_matmul_equals_dequantized_float_matmul)
{
    const int64_t R = 48, C = 128;
    static const size_t ns[] = {1, 2, 3, 8, 13};
    pd_cpu_isa isas[2] = {PD_CPU_ISA_SCALAR, PD_CPU_ISA_AVX512};
    float *W = malloc((size_t)(R * C) * 4), *deq = malloc((size_t)(R * C) * 4);
    float *x = malloc(13 * (size_t)C * 4), *yq = malloc(13 * (size_t)R * 4),
          *yf = malloc(13 * (size_t)R * 4);
    for (int64_t i = 0; i < R * C; i++) W[i] = frand() * 0.5f;
    for (size_t i = 0; i < 13 * (size_t)C; i++) x[i] = frand();
    for (size_t f = 0; f < N_FMTS; f++) {
        pd_quant_config qc;
        packed p;
        pd_st *st = NULL;
        pd_qweight q;
        ASSERT_MSG(make(&k_fmts[f], W, R, C, &qc, &p, &st, &q) == 0, "%s: %s", k_fmts[f].name,
                   pd_last_error());
        ASSERT_OK(pd_qweight_dequant(&q, 0, R, 0, C, deq));
        ASSERT_MSG(memcmp(deq, p.deq, (size_t)(R * C) * 4) == 0, "%s: dequantized values differ",
                   k_fmts[f].name);
        pd_tensor tq = pd_qweight_tensor(&q);
        const int32_t *gidx = k_fmts[f].act_order ? p.buf[3] : NULL;
        /* whole; rows [16, 40) (column parallel); columns [64, 128) (row parallel) */
        const pd_weight_slice sls[3] = {{0, 0, 0, 0}, {16, 24, 0, 0}, {0, 0, 64, 64}};
        for (int si = 0; si < 3; si++) {
            const pd_weight_slice *sl = &sls[si];
            if (k_fmts[f].G < 0 && si == 2) continue; /* one group per row: not splittable */
            if (gidx && si == 2) { /* act order's groups straddle the halves: refused */
                pd_backend *b = cpu(PD_CPU_ISA_AUTO, 1);
                pd_weight *Wq = NULL;
                ASSERT(pd_backend_get_ops(b)->weight_load(b, &tq, sl, &Wq) == PD_EINVAL);
                ASSERT_CONTAINS(pd_last_error(), "split a quantization group");
                pd_backend_free(b);
                continue;
            }
            size_t rows = sl->nrows ? sl->nrows : (size_t)R;
            size_t cols = sl->ncols ? sl->ncols : (size_t)C;
            /* the float reference: the slice's dequantized values and x in the backend's column
               order (act order: sorted by group, stable) */
            size_t *ord = malloc(cols * sizeof *ord), m = 0;
            for (int32_t g = 0; m < cols; g++)
                for (size_t k = 0; k < cols; k++)
                    if (!gidx ? g == 0 : gidx[sl->col0 + k] == g) ord[m++] = k;
            float *wf = malloc(rows * cols * 4), *xs = malloc(13 * cols * 4),
                  *xo = malloc(13 * cols * 4);
            for (size_t r = 0; r < rows; r++)
                for (size_t k = 0; k < cols; k++)
                    wf[r * cols + k] = deq[(sl->row0 + r) * (size_t)C + sl->col0 + ord[k]];
            for (size_t r = 0; r < 13; r++)
                for (size_t k = 0; k < cols; k++) {
                    xs[r * cols + k] = x[r * (size_t)C + sl->col0 + k];
                    xo[r * cols + k] = x[r * (size_t)C + sl->col0 + ord[k]];
                }
            pd_tensor tf = {.name = "deq",
                            .dtype = PD_DTYPE_F32,
                            .ndim = 2,
                            .shape = {(int64_t)rows, (int64_t)cols},
                            .data = wf,
                            .nbytes = rows * cols * 4};
            for (int ii = 0; ii < 2; ii++) {
                pd_backend *b = cpu(isas[ii], 2);
                if (!b) continue; /* no AVX-512 here */
                const pd_backend_ops *o = pd_backend_get_ops(b);
                pd_weight *Wq = NULL, *Wf = NULL;
                ASSERT_MSG(o->weight_load(b, &tq, sl, &Wq) == 0, "%s slice %d: %s", k_fmts[f].name,
                           si, pd_last_error());
                ASSERT_OK(o->weight_load(b, &tf, NULL, &Wf));
                for (size_t ni = 0; ni < 5; ni++) {
                    ASSERT_OK(o->matmul(b, xs, ns[ni], Wq, NULL, yq));
                    if (qc.act_int8)
                        w8a8_reference(xo, ns[ni], cols, p.t[0].data, p.t[1].data, sl->row0, rows,
                                       C, sl->col0, yf);
                    else
                        ASSERT_OK(o->matmul(b, xo, ns[ni], Wf, NULL, yf));
                    ASSERT_MSG(memcmp(yq, yf, ns[ni] * rows * 4) == 0,
                               "%s isa %d slice %d n %zu: quantized != float matmul",
                               k_fmts[f].name, (int)isas[ii], si, ns[ni]);
                }
                o->weight_free(b, Wq);
                o->weight_free(b, Wf);
                pd_backend_free(b);
            }
            free(ord), free(wf), free(xs), free(xo);
        }
        packed_free(&p);
        pd_st_close(st);
    }
    free(W), free(deq), free(x), free(yq), free(yf);
}

/* Malformed checkpoints and configs are refused naming the tensor or field. */
TEST(malformed_quantized_tensors_named)
{
    const int64_t R = 16, C = 64;
    float *W = malloc((size_t)(R * C) * 4);
    for (int64_t i = 0; i < R * C; i++) W[i] = frand();
    pd_quant_config qc;
    packed p;
    pd_st *st = NULL;
    pd_qweight q;
    char path[600];
    snprintf(path, sizeof path, "%s/q.safetensors", pdt_tmp_dir());
    /* AWQ without scales; with scales of the wrong shape */
    ASSERT_OK(parse_qc(k_fmts[0].qc, &qc));
    memset(&p, 0, sizeof p);
    pack_int(&p, W, R, C, true, 4, 32, false, false);
    ASSERT_OK(pd_st_write(path, p.t, 2, NULL, NULL)); /* qweight, qzeros */
    ASSERT_OK(pd_st_open(path, &st));
    ASSERT(pd_qweight_resolve(st, &qc, "L", R, C, &q) == PD_ENOTFOUND);
    ASSERT_MSG(strstr(pd_last_error(), "'L.scales' not found"), "%s", pd_last_error());
    pd_st_close(st);
    p.t[2].shape[0] = 3; /* scales (3, 16) for 2 groups */
    p.t[2].nbytes = 3 * 16 * 2;
    p.buf[2] = realloc(p.buf[2], p.t[2].nbytes);
    memset(p.buf[2], 0, p.t[2].nbytes);
    p.t[2].data = p.buf[2];
    ASSERT_OK(pd_st_write(path, p.t, 3, NULL, NULL));
    ASSERT_OK(pd_st_open(path, &st));
    ASSERT(pd_qweight_resolve(st, &qc, "L", R, C, &q) == PD_EINVAL);
    ASSERT_MSG(strstr(pd_last_error(), "'L.scales': expected shape [2, 16], got [3, 16]"), "%s",
               pd_last_error());
    pd_st_close(st);
    packed_free(&p);
    /* GPTQ act order with a g_idx naming a group that does not exist, or unbalanced groups */
    ASSERT_OK(parse_qc(k_fmts[2].qc, &qc));
    memset(&p, 0, sizeof p);
    pack_int(&p, W, R, C, false, 4, 16, true, false);
    ((int32_t *)p.buf[3])[5] = 9;
    ASSERT_OK(pd_st_write(path, p.t, 4, NULL, NULL));
    ASSERT_OK(pd_st_open(path, &st));
    ASSERT(pd_qweight_resolve(st, &qc, "L", R, C, &q) == PD_EINVAL);
    ASSERT_MSG(strstr(pd_last_error(), "'L.g_idx': g_idx[5] = 9"), "%s", pd_last_error());
    pd_st_close(st);
    int32_t *gi = p.buf[3];
    gi[5] = (gi[5] + 1) % 4; /* a row moved to another group: 15 and 17 rows */
    ASSERT_OK(pd_st_write(path, p.t, 4, NULL, NULL));
    ASSERT_OK(pd_st_open(path, &st));
    ASSERT(pd_qweight_resolve(st, &qc, "L", R, C, &q) == PD_EINVAL);
    ASSERT_MSG(strstr(pd_last_error(), "input rows, expected group_size 16"), "%s",
               pd_last_error());
    pd_st_close(st);
    packed_free(&p);
    /* fp8 with an int8 weight; a column slice that splits a group (CPU) */
    ASSERT_OK(parse_qc(k_fmts[5].qc, &qc));
    memset(&p, 0, sizeof p);
    pack_8bit(&p, W, R, C, false, false);
    ASSERT_OK(pd_st_write(path, p.t, 2, NULL, NULL));
    ASSERT_OK(pd_st_open(path, &st));
    ASSERT(pd_qweight_resolve(st, &qc, "L", R, C, &q) == PD_EINVAL);
    ASSERT_MSG(strstr(pd_last_error(), "'L.weight': expected dtype F8_E4M3, got I8"), "%s",
               pd_last_error());
    pd_st_close(st);
    packed_free(&p);
    ASSERT_OK(make(&k_fmts[0], W, R, C, &qc, &p, &st, &q));
    pd_backend *b = cpu(PD_CPU_ISA_AUTO, 1);
    ASSERT(b);
    pd_tensor tq = pd_qweight_tensor(&q);
    pd_weight_slice half = {0, 0, 16, 32};
    pd_weight *Wq = NULL;
    ASSERT(pd_backend_get_ops(b)->weight_load(b, &tq, &half, &Wq) == PD_EINVAL);
    ASSERT_MSG(strstr(pd_last_error(), "split a quantization group of 32"), "%s", pd_last_error());
    pd_backend_free(b);
    pd_st_close(st);
    packed_free(&p);
    free(W);
}

/* Writes the tensors of layout e (tests/data/quant/public_layouts.json) except skip (NULL: none),
 * the first one's first dimension grown by grow, and resolves its module. */
static int write_layout(json_t *e, const char *skip, int grow, const pd_quant_config *qc,
                        pd_st **st, pd_qweight *q)
{
    const char *module = json_string_value(json_object_get(e, "module"));
    json_t *tensors = json_object_get(e, "tensors");
    pd_tensor t[8];
    char names[8][160];
    void *bufs[8] = {0};
    size_t n = 0;
    const char *key;
    json_t *v;
    json_object_foreach(tensors, key, v)
    {
        if (skip && strcmp(key, skip) == 0) continue;
        memset(&t[n], 0, sizeof t[n]);
        snprintf(names[n], sizeof names[n], "%s.%s", module, key);
        t[n].name = names[n];
        for (int d = 0; d < PD_DTYPE_ALL_COUNT; d++)
            if (strcmp(pd_dtype_st_name((pd_dtype)d), json_string_value(json_array_get(v, 0))) == 0)
                t[n].dtype = (pd_dtype)d;
        json_t *shape = json_array_get(v, 1);
        t[n].ndim = (int)json_array_size(shape);
        for (int d = 0; d < t[n].ndim; d++)
            t[n].shape[d] = json_integer_value(json_array_get(shape, (size_t)d)) +
                            (n == 0 && d == 0 ? grow : 0);
        t[n].nbytes = (size_t)pd_tensor_numel(&t[n]) * pd_dtype_size(t[n].dtype);
        bufs[n] = calloc(1, t[n].nbytes ? t[n].nbytes : 1);
        if (strcmp(key, "g_idx") == 0) /* groups in order */
            for (int64_t k = 0; k < t[n].shape[0]; k++)
                ((int32_t *)bufs[n])[k] = (int32_t)(k / qc->group_size);
        t[n].data = bufs[n];
        n++;
    }
    char path[600];
    snprintf(path, sizeof path, "%s/layout.safetensors", pdt_tmp_dir());
    int rc = pd_st_write(path, t, n, NULL, NULL);
    for (size_t i = 0; i < n; i++) free(bufs[i]);
    if (rc < 0) return rc;
    PD_CHECK(pd_st_open(path, st));
    return pd_qweight_resolve(*st, qc, module, json_integer_value(json_object_get(e, "out")),
                              json_integer_value(json_object_get(e, "in")), q);
}

/* Real layouts (shapes, dtypes, field names of public AWQ, GPTQ 4 and 8 bit, fp8 and W8A8
 * checkpoints) resolve; each tensor missing, and the first one misshapen, is refused naming it. */
TEST(public_checkpoint_layouts_resolve)
{
    char path[600];
    snprintf(path, sizeof path, "%s/quant/public_layouts.json", getenv("PD_TEST_DATA_DIR"));
    json_error_t je;
    json_t *all = json_load_file(path, 0, &je);
    ASSERT_MSG(all, "%s: %s", path, je.text);
    const char *name;
    json_t *e;
    int checked = 0;
    json_object_foreach(all, name, e)
    {
        if (name[0] == '_') continue;
        pd_quant_config qc;
        ASSERT_MSG(pd_quant_config_parse(json_object_get(e, "quantization_config"), &qc) == 0,
                   "%s: %s", name, pd_last_error());
        pd_st *st = NULL;
        pd_qweight q;
        ASSERT_MSG(write_layout(e, NULL, 0, &qc, &st, &q) == 0, "%s: %s", name, pd_last_error());
        pd_st_close(st);
        const char *module = json_string_value(json_object_get(e, "module"));
        const char *key;
        json_t *v;
        bool first = true;
        json_object_foreach(json_object_get(e, "tensors"), key, v)
        {
            char want[200];
            snprintf(want, sizeof want, "'%s.%s'", module, key);
            st = NULL;
            int rc = write_layout(e, key, 0, &qc, &st, &q);
            pd_st_close(st);
            if (strcmp(key, "g_idx") == 0 && !qc.desc_act) /* optional: groups k / G */
                ASSERT_MSG(rc == 0, "%s without g_idx: %s", name, pd_last_error());
            else
                ASSERT_MSG(rc == PD_ENOTFOUND && strstr(pd_last_error(), want),
                           "%s without %s: rc %d, %s", name, key, rc, pd_last_error());
            if (first) {
                st = NULL;
                rc = write_layout(e, NULL, 1, &qc, &st, &q);
                pd_st_close(st);
                ASSERT_MSG(rc == PD_EINVAL && strstr(pd_last_error(), want) &&
                               strstr(pd_last_error(), "expected shape"),
                           "%s with %s misshapen: rc %d, %s", name, key, rc, pd_last_error());
                first = false;
            }
        }
        checked++;
    }
    json_decref(all);
    ASSERT(checked == 6);
}

/* quantization_config as public checkpoints write it parses; unsupported variants are named. */
TEST(quantization_config_variants)
{
    pd_quant_config c;
    /* TheBloke/Llama-2-7B-AWQ, TheBloke/Llama-2-7B-GPTQ, neuralmagic FP8 (config.json) */
    ASSERT_OK(parse_qc("{\"bits\":4,\"group_size\":128,\"modules_to_not_convert\":null,"
                       "\"quant_method\":\"awq\",\"version\":\"gemm\",\"zero_point\":true}",
                       &c));
    ASSERT(c.method == PD_QUANT_AWQ && c.bits == 4 && c.group_size == 128);
    ASSERT_OK(parse_qc("{\"bits\":4,\"group_size\":128,\"damp_percent\":0.01,\"desc_act\":false,"
                       "\"sym\":true,\"true_sequential\":true,\"model_name_or_path\":null,"
                       "\"model_file_base_name\":\"model\",\"quant_method\":\"gptq\"}",
                       &c));
    ASSERT(c.method == PD_QUANT_GPTQ && c.sym && c.zero_minus_one && !c.desc_act);
    ASSERT_OK(parse_qc("{\"activation_scheme\":\"static\",\"ignored_layers\":[\"lm_head\"],"
                       "\"quant_method\":\"fp8\"}",
                       &c));
    ASSERT(c.method == PD_QUANT_FP8 && c.act_static && c.n_ignore == 0);
    ASSERT_OK(parse_qc(k_fmts[6].qc, &c));
    ASSERT(c.kind == PD_QKIND_INT8 && c.per_channel);
    ASSERT_OK(parse_qc("{\"quant_method\":\"compressed-tensors\",\"format\":\"float-quantized\","
                       "\"config_groups\":{\"g\":{\"targets\":[\"Linear\"],\"weights\":{"
                       "\"num_bits\":8,\"type\":\"float\",\"symmetric\":true,\"strategy\":"
                       "\"tensor\"}}},\"ignore\":[\"lm_head\",\"re:.*layers\\\\.0\\\\.mlp.*\"]}",
                       &c));
    ASSERT(c.kind == PD_QKIND_FP8 && !c.per_channel && c.n_ignore == 1);
    ASSERT(pd_quant_ignored(&c, "model.layers.0.mlp.down_proj"));
    ASSERT(!pd_quant_ignored(&c, "model.layers.10.mlp.down_proj"));
    static const struct {
        const char *qc, *msg;
    } bad[] = {
        {"{\"quant_method\":\"awq\",\"bits\":3}", "quantization_config.bits: AWQ with 3 bits"},
        {"{\"quant_method\":\"awq\",\"version\":\"gemv\"}", "quantization_config.version"},
        {"{\"quant_method\":\"gptq\",\"bits\":2}", "quantization_config.bits: GPTQ with 2 bits"},
        {"{\"quant_method\":\"gptq\",\"bits\":4,\"checkpoint_format\":\"marlin\"}",
         "quantization_config.checkpoint_format"},
        {"{\"quant_method\":\"gptq\",\"bits\":4,\"group_size\":0}", "group_size: must be"},
        {"{\"quant_method\":\"bitsandbytes\"}",
         "quantization_config.quant_method: \"bitsandbytes\""},
        {"{\"quant_method\":\"fp8\",\"weight_block_size\":[128,128]}", "weight_block_size"},
        {"{\"quant_method\":\"compressed-tensors\",\"format\":\"pack-quantized\"}",
         "quantization_config.format"},
        {"{\"bits\":4}", "quantization_config.quant_method: required"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ASSERT_MSG(parse_qc(bad[i].qc, &c) < 0, "%s was accepted", bad[i].qc);
        ASSERT_MSG(strstr(pd_last_error(), bad[i].msg), "%s: %s", bad[i].qc, pd_last_error());
    }
    /* --quantization against the checkpoint */
    ASSERT_OK(parse_qc(k_fmts[0].qc, &c));
    ASSERT_OK(pd_quant_check_flag("awq_marlin", &c, "m/config.json"));
    ASSERT_OK(pd_quant_check_flag(NULL, &c, "m/config.json"));
    ASSERT(pd_quant_check_flag("gptq", &c, "m/config.json") == PD_EINVAL);
    ASSERT_MSG(strstr(pd_last_error(), "--quantization gptq, but m/config.json's "
                                       "quantization_config.quant_method is awq"),
               "%s", pd_last_error());
    ASSERT(pd_quant_check_flag("q4_0", &c, "m/config.json") == PD_EINVAL);
    memset(&c, 0, sizeof c);
    ASSERT(pd_quant_check_flag("fp8", &c, "m/config.json") == PD_EINVAL);
    ASSERT_MSG(strstr(pd_last_error(), "has no quantization_config"), "%s", pd_last_error());
}

/* ---- the fp8 KV cache ------------------------------------------------------------------------ */

/* One pool of dtype dt (2 layers, 6 blocks of 16, 2 KV heads of D), written through a planned
 * step of T positions over blocks in reverse order. */
typedef struct {
    pd_backend *b;
    const pd_backend_ops *o;
    pd_kv *kv;
    int32_t ids[80], pos[80], qi[2], kl[1], bi[2], blocks[6];
    int64_t slots[80];
    float *cs, *sn;
} kv_case;

static void kv_case_open(kv_case *c, pd_cpu_isa isa, pd_dtype dt, size_t D, int T)
{
    memset(c, 0, sizeof *c);
    c->b = cpu(isa, 2);
    c->o = pd_backend_get_ops(c->b);
    pd_kv_params kp = {.n_layers = 2,
                       .n_blocks = 6,
                       .block_size = 16,
                       .n_kv_heads = 2,
                       .head_dim = D,
                       .dtype = dt};
    if (c->o->kv_create(c->b, &kp, &c->kv) < 0) c->kv = NULL;
    for (int i = 0; i < 6; i++) c->blocks[i] = 5 - i;
    for (int t = 0; t < T; t++) {
        c->pos[t] = t;
        c->slots[t] = (int64_t)c->blocks[t / 16] * 16 + t % 16;
    }
    c->qi[1] = c->kl[0] = T;
    c->bi[1] = (T + 15) / 16;
    c->cs = calloc((size_t)T * D / 2, 4);
    c->sn = calloc((size_t)T * D / 2, 4);
}

static int kv_case_plan(kv_case *c, size_t D, int T)
{
    pd_batch bt = {.n_tokens = (size_t)T,
                   .token_ids = c->ids,
                   .positions = c->pos,
                   .slots = c->slots,
                   .rope_cos = c->cs,
                   .rope_sin = c->sn,
                   .rope_dim = D,
                   .n_seqs = 1,
                   .q_indptr = c->qi,
                   .kv_len = c->kl,
                   .block_indptr = c->bi,
                   .block_ids = c->blocks};
    return c->o->plan(c->b, &bt);
}

static void kv_case_close(kv_case *c)
{
    if (c->kv) c->o->kv_free(c->b, c->kv);
    pd_backend_free(c->b);
    free(c->cs), free(c->sn);
}

/* An fp8 pool stores k / k_scale and v / v_scale in e4m3 (round to nearest even, saturating);
 * its attention equals, to f32 rounding, attention over an f32 pool holding the dequantized
 * values, for the AVX-512 kernel's head sizes and the generic loop's (36), on every ISA; its
 * bytes move through kv_export / kv_import unchanged (an fp8 transfer is a byte copy); the
 * view describes bytes of one element; scales on a float pool and bad scales are refused. */
TEST(fp8_kv_cache_attention_equals_dequantized)
{
    enum { T = 75, NQ = 4 };
    static const size_t dims[] = {36, 64, 128};
    static const pd_cpu_isa isa[2] = {PD_CPU_ISA_SCALAR, PD_CPU_ISA_AVX512};
    const float ks = 0.03f, vs = 0.011f;
    for (size_t di = 0; di < 3; di++) {
        const size_t D = dims[di], te = 2 * D, n = (size_t)T * te;
        float *k = malloc(n * 4), *v = malloc(n * 4), *q = malloc((size_t)T * NQ * D * 4);
        float *kd = malloc(n * 4), *vd = malloc(n * 4);
        float *o8 = malloc((size_t)T * NQ * D * 4), *o32 = malloc((size_t)T * NQ * D * 4);
        for (size_t i = 0; i < n; i++) k[i] = 2.0f * frand(), v[i] = 3.0f * frand();
        k[0] = 100.0f; /* 3333 scaled: saturates to 448 */
        for (size_t i = 0; i < (size_t)T * NQ * D; i++) q[i] = 2.0f * frand();
        /* what the pool must hold, and its dequantized values */
        uint8_t *want = malloc(2 * (size_t)6 * 16 * te);
        memset(want, 0, 2 * (size_t)6 * 16 * te);
        for (int t = 0; t < T; t++)
            for (size_t e = 0; e < te; e++) {
                size_t i = (size_t)t * te + e, at = (size_t)(t / 16) * 16 * te + (t % 16) * te + e;
                want[at] = pd_f32_to_f8e4m3(k[i] * (1.0f / ks));
                want[6 * 16 * te + at] = pd_f32_to_f8e4m3(v[i] * (1.0f / vs));
                kd[i] = pd_f8e4m3_to_f32(want[at]) * ks;
                vd[i] = pd_f8e4m3_to_f32(want[6 * 16 * te + at]) * vs;
            }
        ASSERT(want[0] == 0x7e); /* 448 */
        for (int ii = 0; ii < 2; ii++) {
            kv_case c8, c32, cin;
            kv_case_open(&c8, isa[ii], PD_DTYPE_F8_E4M3, D, T);
            kv_case_open(&c32, isa[ii], PD_DTYPE_F32, D, T);
            kv_case_open(&cin, isa[ii], PD_DTYPE_F8_E4M3, D, T);
            ASSERT(c8.kv && c32.kv && cin.kv);
            pd_kv_layer_view view;
            ASSERT_OK(c8.o->kv_layer(c8.b, c8.kv, 1, &view));
            ASSERT(view.dtype == PD_DTYPE_F8_E4M3 && view.head_stride == D &&
                   view.block_stride == 16 * te && view.host_visible);
            ASSERT_ERR(c32.o->kv_scales(c32.b, c32.kv, 1, ks, vs), PD_EINVAL,
                       "not a quantized dtype");
            ASSERT_ERR(c8.o->kv_scales(c8.b, c8.kv, 1, 0.0f, vs), PD_EINVAL, "positive and finite");
            ASSERT_ERR(c8.o->kv_scales(c8.b, c8.kv, 2, ks, vs), PD_ERANGE, "layer 2");
            ASSERT_OK(c8.o->kv_scales(c8.b, c8.kv, 1, ks, vs));
            ASSERT_OK(cin.o->kv_scales(cin.b, cin.kv, 1, ks, vs));
            ASSERT_OK(kv_case_plan(&c8, D, T));
            ASSERT_OK(c8.o->kv_write(c8.b, c8.kv, 1, k, v));
            ASSERT_OK(c8.o->attention(c8.b, c8.kv, 1, q, NQ, 0.2f, o8));
            /* the pool's bytes, through export; then imported into another fp8 pool */
            uint8_t *got = malloc(2 * (size_t)6 * 16 * te);
            pd_kv_range r = {
                .layer = 1, .block_ids = c8.blocks, .n_blocks = 5, .head0 = 0, .n_heads = 2};
            ASSERT_OK(c8.o->kv_export(c8.b, c8.kv, &r, got));
            for (size_t part = 0; part < 2; part++)
                for (size_t i = 0; i < (size_t)T * te; i++)
                    ASSERT_MSG(got[part * 5 * 16 * te + i] == want[part * 6 * 16 * te + i],
                               "D %zu: %s byte %zu: 0x%02x, want 0x%02x", D, part ? "V" : "K", i,
                               got[part * 5 * 16 * te + i], want[part * 6 * 16 * te + i]);
            ASSERT_OK(cin.o->kv_import(cin.b, cin.kv, &r, got));
            ASSERT_OK(kv_case_plan(&cin, D, T));
            float *oin = malloc((size_t)T * NQ * D * 4);
            ASSERT_OK(cin.o->attention(cin.b, cin.kv, 1, q, NQ, 0.2f, oin));
            ASSERT(memcmp(oin, o8, (size_t)T * NQ * D * 4) == 0);
            /* the f32 pool on the dequantized values */
            ASSERT_OK(kv_case_plan(&c32, D, T));
            ASSERT_OK(c32.o->kv_write(c32.b, c32.kv, 1, kd, vd));
            ASSERT_OK(c32.o->attention(c32.b, c32.kv, 1, q, NQ, 0.2f, o32));
            double worst = 0;
            for (size_t i = 0; i < (size_t)T * NQ * D; i++) {
                double err = fabs((double)o8[i] - o32[i]) / (1.0 + fabs((double)o32[i]));
                if (err > worst) worst = err;
            }
            ASSERT_MSG(worst < 2e-6, "isa %d D %zu: fp8 attention differs by %.3g", (int)isa[ii], D,
                       worst);
            free(got), free(oin);
            kv_case_close(&c8), kv_case_close(&c32), kv_case_close(&cin);
        }
        free(k), free(v), free(q), free(kd), free(vd), free(o8), free(o32), free(want);
    }
}

/* The checkpoint's KV scales under vLLM's names, the older ones, absent (1.0), and malformed
 * ones refused naming the tensor; --kv-cache-dtype's spellings. */
TEST(fp8_kv_cache_scales_and_flag)
{
    packed p;
    memset(&p, 0, sizeof p);
    *(float *)add(&p, "model.layers.0.self_attn.k_scale", PD_DTYPE_F32, 0, 0, 0) = 0.5f;
    *(float *)add(&p, "model.layers.0.self_attn.v_scale", PD_DTYPE_F32, 1, 1, 0) = 0.25f;
    *(float *)add(&p, "model.layers.1.self_attn.kv_scale", PD_DTYPE_F32, 0, 0, 0) = 2.0f;
    *(float *)add(&p, "model.layers.1.self_attn.k_proj.output_scale", PD_DTYPE_F32, 0, 0, 0) = 3.0f;
    add(&p, "model.layers.3.self_attn.k_scale", PD_DTYPE_F32, 1, 2, 0);
    *(float *)add(&p, "model.layers.4.self_attn.v_scale", PD_DTYPE_F32, 0, 0, 0) = -1.0f;
    char path[600];
    snprintf(path, sizeof path, "%s/kvs.safetensors", pdt_tmp_dir());
    ASSERT_OK(pd_st_write(path, p.t, (size_t)p.n, NULL, NULL));
    pd_st *st = NULL;
    ASSERT_OK(pd_st_open(path, &st));
    float k, v;
    bool found;
    ASSERT_OK(pd_quant_kv_scales(st, 0, &k, &v, &found));
    ASSERT(found && k == 0.5f && v == 0.25f);
    ASSERT_OK(pd_quant_kv_scales(st, 1, &k, &v, &found));
    ASSERT(found && k == 3.0f && v == 2.0f);
    ASSERT_OK(pd_quant_kv_scales(st, 2, &k, &v, &found));
    ASSERT(!found && k == 1.0f && v == 1.0f);
    ASSERT_ERR(pd_quant_kv_scales(st, 3, &k, &v, &found), PD_EINVAL,
               "tensor 'model.layers.3.self_attn.k_scale': expected one F32");
    ASSERT_ERR(pd_quant_kv_scales(st, 4, &k, &v, &found), PD_EINVAL,
               "tensor 'model.layers.4.self_attn.v_scale': a KV cache scale must be positive");
    pd_st_close(st);
    packed_free(&p);
    int dt;
    ASSERT_OK(pd_kv_cache_dtype_parse(NULL, &dt));
    ASSERT(dt == -1);
    ASSERT_OK(pd_kv_cache_dtype_parse("auto", &dt));
    ASSERT(dt == -1);
    ASSERT_OK(pd_kv_cache_dtype_parse("fp8", &dt));
    ASSERT(dt == PD_DTYPE_F8_E4M3);
    ASSERT_OK(pd_kv_cache_dtype_parse("fp8_e4m3", &dt));
    ASSERT(dt == PD_DTYPE_F8_E4M3);
    ASSERT_ERR(pd_kv_cache_dtype_parse("fp8_e5m2", &dt), PD_EINVAL,
               "--kv-cache-dtype: \"fp8_e5m2\" is not supported");
}
