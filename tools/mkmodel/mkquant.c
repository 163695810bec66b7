/* pd-mkmodel --quantize (mkquant.h): flags, round-to-nearest quantization, one packer per format.
 *
 * Design: quantization is plain round-to-nearest (no calibration data exists for a synthetic
 * model), computed once per linear into an mkq_linear, split over the thread pool by output rows
 * so the bytes do not depend on the thread count. Each format's packer only rearranges that.
 */
#include "mkquant.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/args.h"
#include "util/hash.h"
#include "util/status.h"

#define GOLDEN      0x9e3779b97f4a7c15ull
#define TASK_ELEMS  65536 /* weight elements per pool task */
#define FP8_MAX     448.0f
#define INT8_MAX_Q  127.0f
#define INPUT_RANGE 16.0f /* fp8 static: max |x| the input_scale covers (see scaled_pack) */

#define M(m) (1u << (m))

/* Every flag parsed here, with the methods it applies to. Index i is bit i of mkq_opts.given. */
enum { F_QUANTIZE = 0, F_BITS, F_GROUP, F_DESC, F_SYM, F_FORMAT, F_ACT, N_FLAGS };
static const struct {
    const char *flag;
    unsigned methods;
    const char *methods_text;
} k_flags[N_FLAGS] = {
    [F_QUANTIZE] = {"--quantize", ~0u, ""},
    [F_BITS] = {"--bits", M(MKQ_AWQ) | M(MKQ_GPTQ), "awq and gptq"},
    [F_GROUP] = {"--group-size", M(MKQ_AWQ) | M(MKQ_GPTQ), "awq and gptq"},
    [F_DESC] = {"--desc-act", M(MKQ_GPTQ), "gptq"},
    [F_SYM] = {"--sym", M(MKQ_GPTQ), "gptq"},
    [F_FORMAT] = {"--checkpoint-format", M(MKQ_GPTQ), "gptq"},
    [F_ACT] = {"--activation-scheme", M(MKQ_FP8), "fp8"},
};

static const char *const k_methods[] = {"none", "awq", "gptq", "fp8", "w8a8"};

mkq_opts mkq_default_opts(void)
{
    mkq_opts o;
    memset(&o, 0, sizeof o);
    o.method = MKQ_NONE;
    o.bits = 4;
    o.group_size = 128;
    return o;
}

static int flag_index(const char *flag)
{
    for (int i = 0; i < N_FLAGS; i++)
        if (strcmp(k_flags[i].flag, flag) == 0) return i;
    return -1;
}

const char *mkq_method_name(mkq_method m)
{
    return (unsigned)m < sizeof k_methods / sizeof k_methods[0] ? k_methods[m] : "?";
}

/* arg as one of names[0..n) (index into *out), or PD_EINVAL naming flag and the choices. */
static int parse_choice(const char *flag, const char *arg, const char *const *names, int n,
                        const char *choices, int *out)
{
    for (int i = 0; i < n; i++)
        if (strcmp(arg, names[i]) == 0) {
            *out = i;
            return PD_OK;
        }
    return pd_error(PD_EINVAL, "%s: expected %s, got \"%s\"", flag, choices, arg);
}

int mkq_parse(mkq_opts *o, const char *flag, const char *arg)
{
    static const char *const formats[] = {"gptq", "gptq_v2"};
    static const char *const schemes[] = {"dynamic", "static"};
    const int f = flag_index(flag);
    int i = 0;
    int64_t v = 0;
    if (f < 0) return pd_error(PD_EINVAL, "%s: not a quantization flag", flag);
    o->given |= 1u << f;
    switch (f) {
    case F_QUANTIZE:
        PD_CHECK(parse_choice(flag, arg, k_methods + 1, 4, "awq, gptq, fp8 or w8a8", &i));
        o->method = (mkq_method)(i + 1);
        break;
    case F_BITS:
        PD_CHECK(pd_arg_i64(flag, arg, 4, 8, &v));
        if (v != 4 && v != 8) return pd_error(PD_EINVAL, "%s: expected 4 or 8, got %s", flag, arg);
        o->bits = (int)v;
        break;
    case F_GROUP:
        PD_CHECK(pd_arg_i64(flag, arg, -1, INT64_C(1) << 24, &v));
        if (v == 0)
            return pd_error(PD_EINVAL, "%s: expected a positive integer or -1, got 0", flag);
        o->group_size = v;
        break;
    case F_DESC: o->desc_act = true; break;
    case F_SYM: o->sym = true; break;
    case F_FORMAT:
        PD_CHECK(parse_choice(flag, arg, formats, 2, "gptq or gptq_v2", &i));
        o->v2 = i == 1;
        break;
    case F_ACT:
        PD_CHECK(parse_choice(flag, arg, schemes, 2, "dynamic or static", &i));
        o->act_static = i == 1;
        break;
    }
    return PD_OK;
}

int mkq_check(const mkq_opts *o)
{
    for (int f = F_QUANTIZE + 1; f < N_FLAGS; f++) {
        if (!(o->given & (1u << f))) continue;
        if (o->method == MKQ_NONE)
            return pd_error(PD_EINVAL, "%s needs --quantize (it applies to %s)", k_flags[f].flag,
                            k_flags[f].methods_text);
        if (!(k_flags[f].methods & M(o->method)))
            return pd_error(PD_EINVAL, "%s does not apply to --quantize %s (only to %s)",
                            k_flags[f].flag, k_methods[o->method], k_flags[f].methods_text);
    }
    if (o->method == MKQ_AWQ && o->bits != 4)
        return pd_error(PD_EINVAL, "--bits %d: --quantize awq is 4-bit only", o->bits);
    if (o->method == MKQ_AWQ && o->group_size == -1)
        return pd_error(PD_EINVAL,
                        "--group-size -1: --quantize awq needs groups (per channel is gptq only)");
    return PD_OK;
}

static bool is_int(const mkq_opts *o)
{
    return o->method == MKQ_AWQ || o->method == MKQ_GPTQ;
}

/* Input rows per group of a linear with cols inputs. */
static int64_t group_of(const mkq_opts *o, int64_t cols)
{
    return o->group_size == -1 ? cols : o->group_size;
}

/* Values per int32 word along the packed dimension (awq packs 8 output columns, gptq 32 / bits
 * input rows and zero points of 32 / bits output columns). */
static int64_t per_word(const mkq_opts *o)
{
    return 32 / o->bits;
}

int mkq_check_linear(const mkq_opts *o, const char *prefix, int64_t rows, int64_t cols)
{
    if (!is_int(o)) return PD_OK;
    const int64_t G = group_of(o, cols), P = per_word(o);
    char m[48]; /* how the flags named the format */
    snprintf(m, sizeof m, "--quantize %s%s", k_methods[o->method],
             o->method == MKQ_GPTQ ? (o->bits == 8 ? " --bits 8" : " --bits 4") : "");
    if (cols % G != 0)
        return pd_error(PD_EINVAL, "--group-size %lld does not divide in_features %lld of %s",
                        (long long)G, (long long)cols, prefix);
    if (rows % P != 0)
        return pd_error(PD_EINVAL,
                        "%s: out_features %lld of %s is not a multiple of %lld (values per int32)",
                        m, (long long)rows, prefix, (long long)P);
    if (o->method == MKQ_GPTQ && cols % P != 0)
        return pd_error(PD_EINVAL,
                        "%s: in_features %lld of %s is not a multiple of %lld (values per int32)",
                        m, (long long)cols, prefix, (long long)P);
    return PD_OK;
}

/* ---- config.json --------------------------------------------------------------------------- */

/* One compressed-tensors int8 scheme (weights: per channel, static; activations: per token). */
static json_t *int8_scheme(const char *strategy, bool dynamic)
{
    return json_pack("{s:i, s:s, s:b, s:s, s:b}", "num_bits", 8, "type", "int", "symmetric", 1,
                     "strategy", strategy, "dynamic", (int)dynamic);
}

json_t *mkq_config_json(const mkq_opts *o)
{
    const json_int_t G = (json_int_t)o->group_size;
    switch (o->method) {
    case MKQ_NONE: return NULL;
    case MKQ_AWQ: /* AutoAWQ */
        return json_pack("{s:s, s:i, s:I, s:b, s:s}", "quant_method", "awq", "bits", 4,
                         "group_size", G, "zero_point", 1, "version", "gemm");
    case MKQ_GPTQ: /* AutoGPTQ / GPTQModel */
        return json_pack("{s:i, s:I, s:b, s:b, s:s, s:s}", "bits", o->bits, "group_size", G,
                         "desc_act", (int)o->desc_act, "sym", (int)o->sym, "quant_method", "gptq",
                         "checkpoint_format", o->v2 ? "gptq_v2" : "gptq");
    case MKQ_FP8:
        return json_pack("{s:s, s:s}", "quant_method", "fp8", "activation_scheme",
                         o->act_static ? "static" : "dynamic");
    case MKQ_W8A8: /* llm-compressor */
        return json_pack("{s:s, s:s, s:{s:{s:[s], s:o, s:o}}, s:[s], s:s, s:n}", "quant_method",
                         "compressed-tensors", "format", "int-quantized", "config_groups",
                         "group_0", "targets", "Linear", "weights", int8_scheme("channel", false),
                         "input_activations", int8_scheme("token", true), "ignore", "lm_head",
                         "quantization_status", "compressed", "kv_cache_scheme");
    }
    return NULL;
}

/* ---- stored tensors ------------------------------------------------------------------------ */

static mkq_tensor tensor(mkq_part part, const char *suffix, pd_dtype dt, int ndim, int64_t d0,
                         int64_t d1)
{
    mkq_tensor t = {part, suffix, dt, ndim, {d0, d1}};
    return t;
}

int mkq_tensors(const mkq_opts *o, int64_t rows, int64_t cols, mkq_tensor *out)
{
    const int64_t ng = is_int(o) ? cols / group_of(o, cols) : 0, P = per_word(o);
    int n = 0;
    switch (o->method) {
    case MKQ_NONE: break;
    case MKQ_AWQ:
        out[n++] = tensor(MKQ_QWEIGHT, "qweight", PD_DTYPE_I32, 2, cols, rows / P);
        out[n++] = tensor(MKQ_QZEROS, "qzeros", PD_DTYPE_I32, 2, ng, rows / P);
        out[n++] = tensor(MKQ_SCALES, "scales", PD_DTYPE_F16, 2, ng, rows);
        break;
    case MKQ_GPTQ:
        out[n++] = tensor(MKQ_QWEIGHT, "qweight", PD_DTYPE_I32, 2, cols / P, rows);
        out[n++] = tensor(MKQ_QZEROS, "qzeros", PD_DTYPE_I32, 2, ng, rows / P);
        out[n++] = tensor(MKQ_SCALES, "scales", PD_DTYPE_F16, 2, ng, rows);
        out[n++] = tensor(MKQ_GIDX, "g_idx", PD_DTYPE_I32, 1, cols, 0);
        break;
    case MKQ_FP8: /* per-tensor scales are 0-d tensors, as fp8 checkpoints store them */
        out[n++] = tensor(MKQ_WEIGHT, "weight", PD_DTYPE_F8_E4M3, 2, rows, cols);
        out[n++] = tensor(MKQ_WSCALE, "weight_scale", PD_DTYPE_F32, 0, 0, 0);
        if (o->act_static) out[n++] = tensor(MKQ_INSCALE, "input_scale", PD_DTYPE_F32, 0, 0, 0);
        break;
    case MKQ_W8A8:
        out[n++] = tensor(MKQ_WEIGHT, "weight", PD_DTYPE_I8, 2, rows, cols);
        out[n++] = tensor(MKQ_WSCALE, "weight_scale", PD_DTYPE_F32, 2, rows, 1);
        break;
    }
    return n;
}

/* ---- quantization -------------------------------------------------------------------------- */

void mkq_linear_free(mkq_linear *q)
{
    free(q->val);
    free(q->scale16);
    free(q->zero);
    free(q->order);
    free(q->g_idx);
    free(q->scale32);
    memset(q, 0, sizeof *q);
}

typedef struct {
    const mkq_opts *o;
    const float *w; /* (rows, cols) f32 */
    mkq_linear *q;
    int64_t rows_per_task;
} qjob;

static void task_rows(const qjob *j, int task, int64_t *r0, int64_t *r1)
{
    *r0 = (int64_t)task * j->rows_per_task;
    *r1 = *r0 + j->rows_per_task < j->q->rows ? *r0 + j->rows_per_task : j->q->rows;
}

/* The f16 at or above x (x > 0): scales are stored as f16, and one not below the exact scale
 * keeps the group's range within 2^bits - 1 steps, so clamping costs at most s/2. */
static uint16_t f16_at_or_above(float x)
{
    uint16_t h = pd_f32_to_f16(x);
    if (pd_f16_to_f32(h) < x) h++;
    return h;
}

/* Round to nearest, as AutoGPTQ's quantizer: over the group's input rows the range
 * [lo, hi] = [min(min w, 0), max(max w, 0)], or [-max|w|, max|w|] when symmetric ([-1, 1] when
 * all are 0); maxq = 2^bits - 1; s = (hi - lo) / maxq, rounded up to f16 (it is stored as f16, and
 * q is computed with the stored s); z = round(-lo / s), symmetric 2^(bits-1);
 * q = clamp(round(w / s) + z, 0, maxq); round = ties to even (torch.round). So
 * |w - (q - z) s| <= s / 2 for every w.
 * min_zero1 (gptq v1, which stores z - 1 and so cannot store z = 0): a group whose z would be 0
 * (lo above -s / 2) uses z = 1 and s = hi / (maxq - 1) instead, which still covers [lo, hi]. */
static void rtn_group(const float *w, const int32_t *k, int64_t G, int bits, bool sym,
                      bool min_zero1, uint8_t *val, uint16_t *s_out, uint8_t *z_out)
{
    const float maxq = (float)((1 << bits) - 1);
    float lo = 0.0f, hi = 0.0f;
    for (int64_t i = 0; i < G; i++) {
        lo = fminf(lo, w[k[i]]);
        hi = fmaxf(hi, w[k[i]]);
    }
    if (sym) {
        hi = fmaxf(hi, -lo);
        lo = -hi;
    }
    if (hi == lo) {
        lo = -1.0f;
        hi = 1.0f;
    }
    uint16_t h = f16_at_or_above((hi - lo) / maxq);
    float s = pd_f16_to_f32(h);
    float z = sym ? (float)(1 << (bits - 1)) : fminf(fmaxf(nearbyintf(-lo / s), 0.0f), maxq);
    if (min_zero1 && z < 1.0f) {
        h = f16_at_or_above(hi / (maxq - 1.0f));
        s = pd_f16_to_f32(h);
        z = 1.0f;
    }
    for (int64_t i = 0; i < G; i++) {
        float q = nearbyintf(w[k[i]] / s) + z;
        val[k[i]] = (uint8_t)fminf(fmaxf(q, 0.0f), maxq);
    }
    *s_out = h;
    *z_out = (uint8_t)z;
}

/* awq, gptq: every (output row, group) of the task's rows. */
static void int_task(void *ctx, int task, int n_tasks)
{
    const qjob *j = ctx;
    const mkq_opts *o = j->o;
    mkq_linear *q = j->q;
    const bool gptq = o->method == MKQ_GPTQ;
    int64_t r0, r1;
    (void)n_tasks;
    task_rows(j, task, &r0, &r1);
    for (int64_t n = r0; n < r1; n++)
        for (int64_t g = 0; g < q->n_groups; g++) {
            const size_t sz = (size_t)(g * q->rows + n);
            rtn_group(j->w + n * q->cols, q->order + g * q->group_size, q->group_size, o->bits,
                      gptq && o->sym, gptq && !o->v2, q->val + n * q->cols, &q->scale16[sz],
                      &q->zero[sz]);
        }
}

/* fp8, w8a8: scale32[n] = max |w[n, :]|. */
static void absmax_task(void *ctx, int task, int n_tasks)
{
    const qjob *j = ctx;
    int64_t r0, r1;
    (void)n_tasks;
    task_rows(j, task, &r0, &r1);
    for (int64_t n = r0; n < r1; n++) {
        const float *w = j->w + n * j->q->cols;
        float m = 0.0f;
        for (int64_t k = 0; k < j->q->cols; k++) m = fmaxf(m, fabsf(w[k]));
        j->q->scale32[n] = m;
    }
}

/* Row maxima -> scales: fp8 one per tensor, max|w| / 448; w8a8 per row, max|w_row| / 127
 * (f32, as stored; 1 for an all-zero tensor or row). */
static void set_scales(const mkq_opts *o, mkq_linear *q)
{
    if (o->method == MKQ_FP8) {
        float m = 0.0f;
        for (int64_t n = 0; n < q->rows; n++) m = fmaxf(m, q->scale32[n]);
        for (int64_t n = 0; n < q->rows; n++) q->scale32[n] = m > 0.0f ? m / FP8_MAX : 1.0f;
        return;
    }
    for (int64_t n = 0; n < q->rows; n++)
        q->scale32[n] = q->scale32[n] > 0.0f ? q->scale32[n] / INT8_MAX_Q : 1.0f;
}

/* fp8: e4m3(w / s), round to nearest even, saturating; w8a8: clamp(round(w / s), -127, 127)
 * with ties to even. */
static void scaled_task(void *ctx, int task, int n_tasks)
{
    const qjob *j = ctx;
    const mkq_linear *q = j->q;
    const bool fp8 = j->o->method == MKQ_FP8;
    int64_t r0, r1;
    (void)n_tasks;
    task_rows(j, task, &r0, &r1);
    for (int64_t n = r0; n < r1; n++) {
        const float *w = j->w + n * q->cols;
        uint8_t *v = q->val + n * q->cols;
        const float s = q->scale32[n];
        for (int64_t k = 0; k < q->cols; k++) {
            const float x = w[k] / s;
            v[k] = fp8 ? pd_f32_to_f8e4m3(x)
                       : (uint8_t)(int8_t)fminf(fmaxf(nearbyintf(x), -INT8_MAX_Q), INT8_MAX_Q);
        }
    }
}

/* The input rows of each group (order) and the group of each row (g_idx): consecutive rows, or
 * with act order a pseudo-random permutation (Fisher-Yates keyed by key) cut into groups, so
 * g_idx[k] = (rank of k in the permutation) / G and the groups are not monotone. */
static void make_groups(mkq_linear *q, bool act_order, uint64_t key)
{
    const int64_t C = q->cols;
    for (int64_t k = 0; k < C; k++) q->order[k] = (int32_t)k;
    for (int64_t i = C - 1; act_order && i > 0; i--) {
        int64_t r = (int64_t)(pd_mix64(key + (uint64_t)i * GOLDEN) % (uint64_t)(i + 1));
        int32_t t = q->order[i];
        q->order[i] = q->order[r];
        q->order[r] = t;
    }
    for (int64_t r = 0; r < C; r++) q->g_idx[q->order[r]] = (int32_t)(r / q->group_size);
}

int mkq_quantize(const mkq_opts *o, const float *w, int64_t rows, int64_t cols, uint64_t key,
                 pd_threadpool *pool, mkq_linear *q)
{
    mkq_linear_free(q);
    q->rows = rows;
    q->cols = cols;
    const size_t n = (size_t)(rows * cols);
    q->val = malloc(n);
    if (is_int(o)) {
        q->group_size = group_of(o, cols);
        q->n_groups = cols / q->group_size;
        const size_t ns = (size_t)(q->n_groups * rows);
        q->scale16 = malloc(ns * sizeof *q->scale16);
        q->zero = malloc(ns);
        q->order = malloc((size_t)cols * sizeof *q->order);
        q->g_idx = malloc((size_t)cols * sizeof *q->g_idx);
    } else {
        q->scale32 = malloc((size_t)rows * sizeof *q->scale32);
    }
    if (!q->val || (is_int(o) ? !q->scale16 || !q->zero || !q->order || !q->g_idx : !q->scale32)) {
        mkq_linear_free(q);
        return pd_error(PD_ENOMEM, "out of memory quantizing a (%lld, %lld) linear",
                        (long long)rows, (long long)cols);
    }
    qjob j = {o, w, q, cols >= TASK_ELEMS ? 1 : TASK_ELEMS / cols};
    const int tasks = (int)((rows + j.rows_per_task - 1) / j.rows_per_task);
    if (is_int(o)) {
        make_groups(q, o->method == MKQ_GPTQ && o->desc_act, key);
        pd_pool_run(pool, int_task, &j, tasks);
    } else {
        pd_pool_run(pool, absmax_task, &j, tasks);
        set_scales(o, q);
        pd_pool_run(pool, scaled_task, &j, tasks);
    }
    return PD_OK;
}

/* ---- packers ------------------------------------------------------------------------------- */

/* AutoAWQ GEMM: nibble i of word c holds output column 8c + k_awq_order[i]. */
static const int k_awq_order[8] = {0, 2, 4, 6, 1, 3, 5, 7};

static uint32_t awq_word(const uint8_t *v, int64_t stride, int64_t c)
{
    uint32_t word = 0;
    for (int i = 0; i < 8; i++) word |= (uint32_t)v[(8 * c + k_awq_order[i]) * stride] << (4 * i);
    return word;
}

/* qweight (in, out/8), qzeros (groups, out/8), scales (groups, out). */
static void awq_pack(const mkq_linear *q, mkq_part part, void *buf)
{
    uint32_t *o = buf;
    const int64_t R = q->rows, C = q->cols, W = R / 8;
    switch (part) {
    case MKQ_QWEIGHT:
        for (int64_t k = 0; k < C; k++)
            for (int64_t c = 0; c < W; c++) o[k * W + c] = awq_word(q->val + k, C, c);
        break;
    case MKQ_QZEROS:
        for (int64_t g = 0; g < q->n_groups; g++)
            for (int64_t c = 0; c < W; c++) o[g * W + c] = awq_word(q->zero + g * R, 1, c);
        break;
    case MKQ_SCALES: memcpy(buf, q->scale16, (size_t)(q->n_groups * R) * sizeof(uint16_t)); break;
    default: break;
    }
}

/* GPTQ: 32 / bits values per word, value i at bits i * bits (sequential); each value minus sub
 * (1 for v1 zero points), masked to bits. */
static uint32_t gptq_word(const uint8_t *v, int64_t stride, int bits, int sub)
{
    const uint32_t mask = (1u << bits) - 1u;
    uint32_t word = 0;
    for (int i = 0; i < 32 / bits; i++)
        word |= ((uint32_t)(v[i * stride] - sub) & mask) << (i * bits);
    return word;
}

/* qweight (in / P, out) packed along the input, qzeros (groups, out / P), scales (groups, out),
 * g_idx (in). */
static void gptq_pack(const mkq_opts *o, const mkq_linear *q, mkq_part part, void *buf)
{
    uint32_t *w = buf;
    const int64_t R = q->rows, C = q->cols, P = per_word(o);
    switch (part) {
    case MKQ_QWEIGHT:
        for (int64_t r = 0; r < C / P; r++)
            for (int64_t n = 0; n < R; n++)
                w[r * R + n] = gptq_word(q->val + n * C + r * P, 1, o->bits, 0);
        break;
    case MKQ_QZEROS:
        for (int64_t g = 0; g < q->n_groups; g++)
            for (int64_t c = 0; c < R / P; c++)
                w[g * (R / P) + c] = gptq_word(q->zero + g * R + c * P, 1, o->bits, o->v2 ? 0 : 1);
        break;
    case MKQ_SCALES: memcpy(buf, q->scale16, (size_t)(q->n_groups * R) * sizeof(uint16_t)); break;
    case MKQ_GIDX: memcpy(buf, q->g_idx, (size_t)C * sizeof(int32_t)); break;
    default: break;
    }
}

/* fp8 and w8a8: the value bytes as they are, the f32 scale per tensor (fp8) or per row (w8a8).
 * fp8 static input_scale: no calibration data exists, so it covers a fixed |x| <= INPUT_RANGE
 * (pdserve reads and checks it but computes activations in the model dtype, quant.h). */
static void scaled_pack(const mkq_opts *o, const mkq_linear *q, mkq_part part, void *buf)
{
    const float in_scale = INPUT_RANGE / FP8_MAX;
    switch (part) {
    case MKQ_WEIGHT: memcpy(buf, q->val, (size_t)(q->rows * q->cols)); break;
    case MKQ_WSCALE:
        memcpy(buf, q->scale32, (o->method == MKQ_FP8 ? 1 : (size_t)q->rows) * sizeof(float));
        break;
    case MKQ_INSCALE: memcpy(buf, &in_scale, sizeof in_scale); break;
    default: break;
    }
}

void mkq_pack(const mkq_opts *o, const mkq_linear *q, mkq_part part, void *buf)
{
    switch (o->method) {
    case MKQ_NONE: break;
    case MKQ_AWQ: awq_pack(q, part, buf); break;
    case MKQ_GPTQ: gptq_pack(o, q, part, buf); break;
    case MKQ_FP8:
    case MKQ_W8A8: scaled_pack(o, q, part, buf); break;
    }
}
