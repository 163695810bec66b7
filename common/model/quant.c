/* Quantized checkpoints: quantization_config parsing, the tensors of a quantized linear, and
 * their decoding (quant.h).
 *
 * Design: every packing order lives here and nowhere else. pd_qweight_unpack turns any format
 * into one plain form (a byte per value, f32 scales and zero points per row and group), which
 * backends repack for their kernels; pd_qweight_dequant gives the f32 weights themselves.
 */
#include "model/quant.h"

#include <math.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json/json.h"
#include "util/status.h"

#define QC "quantization_config"

const char *pd_quant_method_name(pd_quant_method m)
{
    switch (m) {
    case PD_QUANT_NONE: return "none";
    case PD_QUANT_AWQ: return "awq";
    case PD_QUANT_GPTQ: return "gptq";
    case PD_QUANT_FP8: return "fp8";
    case PD_QUANT_COMPRESSED: return "compressed-tensors";
    }
    return "?";
}

/* ---- quantization_config ----------------------------------------------------------------- */

/* The first of two spellings of an integer field (AutoAWQ wrote "w_bit" and "q_group_size"). */
static int get_int2(const json_t *qc, const char *key, const char *alt, int64_t lo, int64_t hi,
                    int64_t *out)
{
    int rc = pdj_get_int_range(qc, QC, key, PDJ_NULL_IS_ABSENT, lo, hi, out);
    if (rc != 0 || !alt) return rc;
    return pdj_get_int_range(qc, QC, alt, PDJ_NULL_IS_ABSENT, lo, hi, out);
}

/* A module list ("ignore", "ignored_layers") into cfg->ignore; lm_head is never quantized here
 * anyway, so it is accepted and not stored. */
static int parse_ignore(const json_t *qc, const char *key, pd_quant_config *c)
{
    json_t *arr = NULL;
    PD_CHECK(pdj_get_array(qc, QC, key, PDJ_NULL_IS_ABSENT, &arr));
    size_t i;
    json_t *v;
    json_array_foreach(arr, i, v)
    {
        char path[96];
        const char *s;
        snprintf(path, sizeof path, QC ".%s[%zu]", key, i);
        PD_CHECK(pdj_as_string(v, path, &s));
        if (strcmp(s, "lm_head") == 0) continue;
        if (c->n_ignore == PD_QUANT_MAX_IGNORE || strlen(s) >= sizeof c->ignore[0])
            return pd_error(PD_EUNSUPPORTED, "%s: more than %d entries or one longer than %zu",
                            path, PD_QUANT_MAX_IGNORE, sizeof c->ignore[0] - 1);
        if (strncmp(s, "re:", 3) == 0) {
            regex_t re;
            if (regcomp(&re, s + 3, REG_EXTENDED | REG_NOSUB) != 0)
                return pd_error(PD_EINVAL, "%s: \"%s\" is not a regular expression", path, s);
            regfree(&re);
        }
        snprintf(c->ignore[c->n_ignore++], sizeof c->ignore[0], "%s", s);
    }
    return PD_OK;
}

static int parse_awq(const json_t *qc, pd_quant_config *c)
{
    int64_t bits = 4;
    PD_CHECK(get_int2(qc, "bits", "w_bit", 1, 64, &bits));
    if (bits != 4)
        return pd_error(PD_EUNSUPPORTED, QC ".bits: AWQ with %lld bits is not supported (4)",
                        (long long)bits);
    c->bits = 4;
    c->group_size = 128;
    PD_CHECK(get_int2(qc, "group_size", "q_group_size", -1, INT64_C(1) << 24, &c->group_size));
    bool zp = true;
    PD_CHECK(pdj_get_bool(qc, QC, "zero_point", PDJ_NULL_IS_ABSENT, &zp));
    if (!zp) return pd_error(PD_EUNSUPPORTED, QC ".zero_point: false is not supported (true)");
    const char *ver = "gemm";
    PD_CHECK(pdj_get_string(qc, QC, "version", PDJ_NULL_IS_ABSENT, &ver));
    if (strcasecmp(ver, "gemm") != 0)
        return pd_error(PD_EUNSUPPORTED, QC ".version: \"%s\" is not supported (gemm)", ver);
    return PD_OK;
}

static int parse_gptq(const json_t *qc, pd_quant_config *c)
{
    int64_t bits = 0;
    PD_CHECK(pdj_get_int_range(qc, QC, "bits", PDJ_REQUIRED, 1, 64, &bits));
    if (bits != 4 && bits != 8)
        return pd_error(PD_EUNSUPPORTED, QC ".bits: GPTQ with %lld bits is not supported (4, 8)",
                        (long long)bits);
    c->bits = (int)bits;
    c->group_size = 128;
    PD_CHECK(pdj_get_int_range(qc, QC, "group_size", PDJ_NULL_IS_ABSENT, -1, INT64_C(1) << 24,
                               &c->group_size));
    c->sym = true;
    PD_CHECK(pdj_get_bool(qc, QC, "desc_act", PDJ_NULL_IS_ABSENT, &c->desc_act));
    PD_CHECK(pdj_get_bool(qc, QC, "sym", PDJ_NULL_IS_ABSENT, &c->sym));
    const char *fmt = "gptq";
    PD_CHECK(pdj_get_string(qc, QC, "checkpoint_format", PDJ_NULL_IS_ABSENT, &fmt));
    if (strcmp(fmt, "gptq") == 0)
        c->zero_minus_one = true;
    else if (strcmp(fmt, "gptq_v2") != 0)
        return pd_error(PD_EUNSUPPORTED,
                        QC ".checkpoint_format: \"%s\" is not supported (gptq, gptq_v2)", fmt);
    bool marlin = false;
    PD_CHECK(pdj_get_bool(qc, QC, "is_marlin_format", PDJ_NULL_IS_ABSENT, &marlin));
    if (marlin)
        return pd_error(PD_EUNSUPPORTED, QC ".is_marlin_format: Marlin-packed GPTQ checkpoints "
                                            "are not supported");
    return PD_OK;
}

static int parse_fp8(const json_t *qc, pd_quant_config *c)
{
    c->kind = PD_QKIND_FP8;
    c->bits = 8;
    const char *as = "dynamic";
    PD_CHECK(pdj_get_string(qc, QC, "activation_scheme", PDJ_NULL_IS_ABSENT, &as));
    if (strcmp(as, "static") == 0)
        c->act_static = true;
    else if (strcmp(as, "dynamic") != 0)
        return pd_error(PD_EUNSUPPORTED,
                        QC ".activation_scheme: \"%s\" is not supported (dynamic, static)", as);
    const json_t *wbs = json_object_get(qc, "weight_block_size");
    if (wbs && !json_is_null(wbs))
        return pd_error(PD_EUNSUPPORTED,
                        QC ".weight_block_size: block-wise fp8 scales are not supported");
    return parse_ignore(qc, "ignored_layers", c);
}

/* compressed-tensors: one config group targeting Linear, 8-bit int or float weights with
 * channel or tensor scales, 8-bit (or no) input activations. */
static int parse_compressed(const json_t *qc, pd_quant_config *c)
{
    const char *fmt = NULL;
    PD_CHECK(pdj_get_string(qc, QC, "format", PDJ_REQUIRED, &fmt));
    if (strcmp(fmt, "int-quantized") != 0 && strcmp(fmt, "float-quantized") != 0 &&
        strcmp(fmt, "naive-quantized") != 0)
        return pd_error(PD_EUNSUPPORTED,
                        QC ".format: \"%s\" is not supported (int-quantized, float-quantized, "
                           "naive-quantized)",
                        fmt);
    json_t *groups = NULL;
    PD_CHECK(pdj_get_object(qc, QC, "config_groups", PDJ_REQUIRED, &groups));
    if (json_object_size(groups) != 1)
        return pd_error(PD_EUNSUPPORTED, QC ".config_groups: %zu groups, only one is supported",
                        json_object_size(groups));
    const char *gname = json_object_iter_key(json_object_iter(groups));
    json_t *g = json_object_iter_value(json_object_iter(groups));
    char gp[160], wp[200];
    snprintf(gp, sizeof gp, QC ".config_groups.%s", gname);
    if (!json_is_object(g)) return pd_error(PD_EINVAL, "%s: expected an object", gp);
    json_t *targets = NULL, *w = NULL, *in = NULL;
    PD_CHECK(pdj_get_array(g, gp, "targets", PDJ_REQUIRED, &targets));
    if (json_array_size(targets) != 1 || !json_is_string(json_array_get(targets, 0)) ||
        strcmp(json_string_value(json_array_get(targets, 0)), "Linear") != 0)
        return pd_error(PD_EUNSUPPORTED, "%s.targets: only [\"Linear\"] is supported", gp);
    PD_CHECK(pdj_get_object(g, gp, "weights", PDJ_REQUIRED, &w));
    PD_CHECK(pdj_get_object(g, gp, "input_activations", PDJ_NULL_IS_ABSENT, &in));
    snprintf(wp, sizeof wp, "%s.weights", gp);
    int64_t nb = 0;
    PD_CHECK(pdj_get_int_range(w, wp, "num_bits", PDJ_REQUIRED, 1, 64, &nb));
    const char *type = NULL, *strategy = NULL;
    PD_CHECK(pdj_get_string(w, wp, "type", PDJ_REQUIRED, &type));
    PD_CHECK(pdj_get_string(w, wp, "strategy", PDJ_REQUIRED, &strategy));
    bool sym = false, dyn = false;
    PD_CHECK(pdj_get_bool(w, wp, "symmetric", PDJ_REQUIRED, &sym));
    PD_CHECK(pdj_get_bool(w, wp, "dynamic", PDJ_NULL_IS_ABSENT, &dyn));
    if (nb != 8)
        return pd_error(PD_EUNSUPPORTED, "%s.num_bits: %lld is not supported (8)", wp,
                        (long long)nb);
    if (strcmp(type, "int") == 0)
        c->kind = PD_QKIND_INT8;
    else if (strcmp(type, "float") == 0)
        c->kind = PD_QKIND_FP8;
    else
        return pd_error(PD_EUNSUPPORTED, "%s.type: \"%s\" is not supported (int, float)", wp, type);
    if (!sym) return pd_error(PD_EUNSUPPORTED, "%s.symmetric: false is not supported", wp);
    if (dyn) return pd_error(PD_EUNSUPPORTED, "%s.dynamic: true is not supported", wp);
    if (strcmp(strategy, "channel") == 0)
        c->per_channel = true;
    else if (strcmp(strategy, "tensor") != 0)
        return pd_error(PD_EUNSUPPORTED, "%s.strategy: \"%s\" is not supported (channel, tensor)",
                        wp, strategy);
    if (in) {
        snprintf(wp, sizeof wp, "%s.input_activations", gp);
        PD_CHECK(pdj_get_int_range(in, wp, "num_bits", PDJ_REQUIRED, 1, 64, &nb));
        if (nb != 8)
            return pd_error(PD_EUNSUPPORTED, "%s.num_bits: %lld is not supported (8)", wp,
                            (long long)nb);
        const char *at = NULL, *as = NULL;
        bool adyn = false;
        PD_CHECK(pdj_get_string(in, wp, "type", PDJ_NULL_IS_ABSENT, &at));
        PD_CHECK(pdj_get_string(in, wp, "strategy", PDJ_NULL_IS_ABSENT, &as));
        PD_CHECK(pdj_get_bool(in, wp, "dynamic", PDJ_NULL_IS_ABSENT, &adyn));
        c->act_int8 = c->kind == PD_QKIND_INT8 && at && strcmp(at, "int") == 0 && adyn && as &&
                      strcmp(as, "token") == 0;
    }
    c->bits = 8;
    return parse_ignore(qc, "ignore", c);
}

int pd_quant_config_parse(const json_t *qc, pd_quant_config *out)
{
    pd_quant_config c;
    memset(&c, 0, sizeof c);
    if (!qc || json_is_null(qc)) {
        *out = c;
        return PD_OK;
    }
    if (!json_is_object(qc))
        return pd_error(PD_EINVAL, QC ": expected an object, got %s", pdj_type_name(qc));
    const char *m = NULL;
    PD_CHECK(pdj_get_string(qc, QC, "quant_method", PDJ_REQUIRED, &m));
    if (strcmp(m, "awq") == 0) {
        c.method = PD_QUANT_AWQ;
        PD_CHECK(parse_awq(qc, &c));
    } else if (strcmp(m, "gptq") == 0) {
        c.method = PD_QUANT_GPTQ;
        PD_CHECK(parse_gptq(qc, &c));
    } else if (strcmp(m, "fp8") == 0) {
        c.method = PD_QUANT_FP8;
        PD_CHECK(parse_fp8(qc, &c));
    } else if (strcmp(m, "compressed-tensors") == 0) {
        c.method = PD_QUANT_COMPRESSED;
        PD_CHECK(parse_compressed(qc, &c));
    } else {
        return pd_error(PD_EUNSUPPORTED,
                        QC ".quant_method: \"%s\" is not supported (awq, gptq, fp8, "
                           "compressed-tensors)",
                        m);
    }
    if (c.kind == PD_QKIND_INT && (c.group_size == 0 || c.group_size < -1))
        return pd_error(PD_EINVAL, QC ".group_size: must be positive or -1, got %lld",
                        (long long)c.group_size);
    *out = c;
    return PD_OK;
}

bool pd_quant_ignored(const pd_quant_config *cfg, const char *module)
{
    for (int i = 0; i < cfg->n_ignore; i++) {
        const char *e = cfg->ignore[i];
        if (strncmp(e, "re:", 3) != 0) {
            if (strcmp(e, module) == 0) return true;
            continue;
        }
        /* matched whole, as Python's re.match over the full name with $ */
        char anchored[sizeof cfg->ignore[0] + 8];
        snprintf(anchored, sizeof anchored, "^(%s)$", e + 3);
        regex_t re;
        if (regcomp(&re, anchored, REG_EXTENDED | REG_NOSUB) != 0) continue;
        bool hit = regexec(&re, module, 0, NULL, 0) == 0;
        regfree(&re);
        if (hit) return true;
    }
    return false;
}

int pd_quant_check_flag(const char *flag, const pd_quant_config *cfg, const char *config_file)
{
    static const char *const known[] = {"none",        "awq", "awq_marlin",         "gptq",
                                        "gptq_marlin", "fp8", "compressed-tensors", "smoothquant"};
    bool ok = !flag;
    for (size_t i = 0; i < sizeof known / sizeof known[0] && !ok; i++)
        ok = strcmp(flag, known[i]) == 0;
    if (!ok)
        return pd_error(PD_EINVAL,
                        "--quantization: unknown method \"%s\" (none, awq, awq_marlin, gptq, "
                        "gptq_marlin, fp8, compressed-tensors, smoothquant)",
                        flag);
    if (!flag || strcmp(flag, "none") == 0) return PD_OK;
    const char *want = flag;
    if (strcmp(flag, "awq_marlin") == 0) want = "awq";
    if (strcmp(flag, "gptq_marlin") == 0) want = "gptq";
    bool sq = strcmp(flag, "smoothquant") == 0; /* int8 W8A8, as compressed-tensors store it */
    if (sq) want = "compressed-tensors";
    const char *have = pd_quant_method_name(cfg->method);
    if (cfg->method == PD_QUANT_NONE)
        return pd_error(PD_EINVAL,
                        "--quantization %s, but %s has no quantization_config (a float "
                        "checkpoint: leave --quantization out, or quantize it first)",
                        flag, config_file);
    if (strcmp(want, have) != 0 || (sq && cfg->kind != PD_QKIND_INT8))
        return pd_error(
            PD_EINVAL, "--quantization %s, but %s's quantization_config.quant_method is %s%s", flag,
            config_file, have, sq && cfg->method == PD_QUANT_COMPRESSED ? " with fp8 weights" : "");
    return PD_OK;
}

/* ---- a quantized linear ------------------------------------------------------------------ */

static int expect(const pd_st *st, const char *prefix, const char *suffix, int dtype, int ndim,
                  int64_t a, int64_t b, pd_tensor *out)
{
    char name[256];
    snprintf(name, sizeof name, "%s.%s", prefix, suffix);
    const int64_t shape[2] = {a, b};
    return pd_st_expect(st, name, dtype, ndim, shape, out);
}

/* A scale of n values (1: per tensor): shape [] or [1] for one value, [n] or [n, 1] for n. */
static int expect_scale(const pd_st *st, const char *prefix, const char *suffix, int64_t n,
                        pd_tensor *out)
{
    char name[256];
    snprintf(name, sizeof name, "%s.%s", prefix, suffix);
    const pd_tensor *t = pd_st_get(st, name);
    if (t && pd_tensor_numel(t) == n && t->ndim <= 2 && (t->ndim < 2 || t->shape[1] == 1)) {
        if (!pd_dtype_is_float(t->dtype))
            return pd_error(PD_EINVAL, "%s: tensor '%s': expected dtype F32, F16 or BF16, got %s",
                            t->file, name, pd_dtype_st_name(t->dtype));
        *out = *t;
        return PD_OK;
    }
    return expect(st, prefix, suffix, PD_ST_FLOAT, n == 1 ? 1 : 2, n, 1, out);
}

static int check_g_idx(const pd_qweight *q, const char *prefix)
{
    const int32_t *g = q->g_idx.data;
    int64_t *count = calloc((size_t)q->n_groups, sizeof *count);
    if (!count) return pd_error(PD_ENOMEM, "model: out of memory");
    int rc = PD_OK;
    for (int64_t k = 0; k < q->cols && rc == PD_OK; k++) {
        if (g[k] < 0 || g[k] >= q->n_groups)
            rc = pd_error(PD_EINVAL,
                          "%s: tensor '%s.g_idx': g_idx[%lld] = %d, not a group in [0, "
                          "%lld)",
                          q->g_idx.file, prefix, (long long)k, g[k], (long long)q->n_groups);
        else
            count[g[k]]++;
    }
    for (int64_t i = 0; i < q->n_groups && rc == PD_OK; i++)
        if (count[i] != q->group_size)
            rc = pd_error(PD_EINVAL,
                          "%s: tensor '%s.g_idx': group %lld holds %lld input rows, expected "
                          "group_size %lld",
                          q->g_idx.file, prefix, (long long)i, (long long)count[i],
                          (long long)q->group_size);
    free(count);
    return rc;
}

static int resolve_int(const pd_st *st, const char *prefix, pd_qweight *q)
{
    const pd_quant_config *c = q->cfg;
    const int64_t rows = q->rows, cols = q->cols;
    q->group_size = c->group_size == -1 ? cols : c->group_size;
    if (cols % q->group_size != 0)
        return pd_error(PD_EINVAL,
                        "%s: in_features %lld is not a multiple of quantization_config.group_size "
                        "%lld",
                        prefix, (long long)cols, (long long)q->group_size);
    q->n_groups = cols / q->group_size;
    const int64_t P = 32 / c->bits, G = q->n_groups;
    if (c->method == PD_QUANT_AWQ) {
        if (rows % 8 != 0)
            return pd_error(PD_EINVAL, "%s: out_features %lld is not a multiple of 8 (AWQ)", prefix,
                            (long long)rows);
        PD_CHECK(expect(st, prefix, "qweight", PD_DTYPE_I32, 2, cols, rows / 8, &q->qweight));
        PD_CHECK(expect(st, prefix, "qzeros", PD_DTYPE_I32, 2, G, rows / 8, &q->qzeros));
        PD_CHECK(expect(st, prefix, "scales", PD_ST_FLOAT, 2, G, rows, &q->scales));
        return PD_OK;
    }
    if (rows % P != 0 || cols % P != 0)
        return pd_error(PD_EINVAL, "%s: (%lld, %lld) is not a multiple of %lld values per int32",
                        prefix, (long long)rows, (long long)cols, (long long)P);
    PD_CHECK(expect(st, prefix, "qweight", PD_DTYPE_I32, 2, cols / P, rows, &q->qweight));
    PD_CHECK(expect(st, prefix, "qzeros", PD_DTYPE_I32, 2, G, rows / P, &q->qzeros));
    PD_CHECK(expect(st, prefix, "scales", PD_ST_FLOAT, 2, G, rows, &q->scales));
    char name[256];
    snprintf(name, sizeof name, "%s.g_idx", prefix);
    if (pd_st_get(st, name) || c->desc_act) {
        PD_CHECK(expect(st, prefix, "g_idx", PD_DTYPE_I32, 1, cols, 0, &q->g_idx));
        PD_CHECK(check_g_idx(q, prefix));
    }
    return PD_OK;
}

int pd_qweight_resolve(const pd_st *st, const pd_quant_config *cfg, const char *prefix,
                       int64_t rows, int64_t cols, pd_qweight *out)
{
    pd_qweight q;
    memset(&q, 0, sizeof q);
    if (strlen(prefix) >= sizeof q.prefix)
        return pd_error(PD_EINVAL, "%s: module name too long", prefix);
    snprintf(q.prefix, sizeof q.prefix, "%s", prefix);
    q.cfg = cfg;
    q.rows = rows;
    q.cols = cols;
    if (cfg->kind == PD_QKIND_INT) {
        PD_CHECK(resolve_int(st, prefix, &q));
    } else {
        int dt = cfg->kind == PD_QKIND_FP8 ? PD_DTYPE_F8_E4M3 : PD_DTYPE_I8;
        PD_CHECK(expect(st, prefix, "weight", dt, 2, rows, cols, &q.weight));
        /* fp8 checkpoints: one scale; compressed-tensors: per the strategy */
        PD_CHECK(
            expect_scale(st, prefix, "weight_scale", cfg->per_channel ? rows : 1, &q.weight_scale));
        if (cfg->act_static) PD_CHECK(expect_scale(st, prefix, "input_scale", 1, &q.input_scale));
    }
    q.nbytes = q.qweight.nbytes + q.qzeros.nbytes + q.scales.nbytes + q.g_idx.nbytes +
               q.weight.nbytes + q.weight_scale.nbytes + q.input_scale.nbytes;
    *out = q;
    return PD_OK;
}

pd_tensor pd_qweight_tensor(const pd_qweight *q)
{
    pd_tensor t;
    memset(&t, 0, sizeof t);
    t.name = q->prefix;
    t.dtype = PD_DTYPE_F32; /* not stored as such: data is NULL */
    t.ndim = 2;
    t.shape[0] = q->rows;
    t.shape[1] = q->cols;
    t.nbytes = q->nbytes;
    t.file = q->qweight.data ? q->qweight.file : q->weight.file;
    t.quant = q;
    return t;
}

/* ---- decoding ------------------------------------------------------------------------------ */

/* Element i of a float tensor, as f32. */
static float elem_f32(const pd_tensor *t, int64_t i)
{
    float f;
    pd_to_f32_n(t->dtype, (const char *)t->data + (size_t)i * pd_dtype_size(t->dtype), &f, 1);
    return f;
}

int pd_kv_cache_dtype_parse(const char *flag, int *out)
{
    if (!flag || strcmp(flag, "auto") == 0) {
        *out = -1;
        return PD_OK;
    }
    if (strcmp(flag, "fp8") == 0 || strcmp(flag, "fp8_e4m3") == 0) {
        *out = PD_DTYPE_F8_E4M3;
        return PD_OK;
    }
    return pd_error(PD_EINVAL,
                    "--kv-cache-dtype: \"%s\" is not supported (auto, fp8, fp8_e4m3; pdserve "
                    "stores an fp8 KV cache as e4m3)",
                    flag);
}

/* One optional KV scale: 0 when absent, else the value of a single positive finite float. */
static int kv_scale(const pd_st *st, int layer, const char *suffix, float *out)
{
    char name[160];
    snprintf(name, sizeof name, "model.layers.%d.self_attn.%s", layer, suffix);
    const pd_tensor *t = pd_st_get(st, name);
    *out = 0.0f;
    if (!t) return PD_OK;
    if (!pd_dtype_is_float(t->dtype) || pd_tensor_numel(t) != 1)
        return pd_error(PD_EINVAL,
                        "%s: tensor '%s': expected one F32, F16 or BF16 value (a KV cache scale), "
                        "got dtype %s with %lld elements",
                        t->file, name, pd_dtype_st_name(t->dtype), (long long)pd_tensor_numel(t));
    float v = elem_f32(t, 0);
    if (!(v > 0.0f) || !isfinite(v))
        return pd_error(PD_EINVAL,
                        "%s: tensor '%s': a KV cache scale must be positive and finite, "
                        "got %g",
                        t->file, name, (double)v);
    *out = v;
    return PD_OK;
}

int pd_quant_kv_scales(const pd_st *st, int layer, float *k_scale, float *v_scale, bool *found)
{
    float k, v, kv;
    PD_CHECK(kv_scale(st, layer, "k_scale", &k));
    PD_CHECK(kv_scale(st, layer, "v_scale", &v));
    if (k == 0.0f) PD_CHECK(kv_scale(st, layer, "k_proj.output_scale", &k));
    if (v == 0.0f) PD_CHECK(kv_scale(st, layer, "v_proj.output_scale", &v));
    PD_CHECK(kv_scale(st, layer, "kv_scale", &kv));
    if (k == 0.0f) k = kv;
    if (v == 0.0f) v = kv;
    *found = k > 0.0f || v > 0.0f;
    *k_scale = k > 0.0f ? k : 1.0f;
    *v_scale = v > 0.0f ? v : 1.0f;
    return PD_OK;
}

/* The value of an INT8 byte, an FP8 byte, or an INT value, as f32. */
static float pd_qvalue_f32(pd_qkind kind, uint8_t v)
{
    if (kind == PD_QKIND_INT8) return (float)(int8_t)v;
    if (kind == PD_QKIND_FP8) return pd_f8e4m3_to_f32(v);
    return (float)v;
}

int64_t pd_qweight_group(const pd_qweight *q, int64_t k)
{
    return q->g_idx.data ? ((const int32_t *)q->g_idx.data)[k] : k / q->group_size;
}

/* The bits-wide field i of a packed int32. */
static unsigned field(uint32_t packed, int bits, int i)
{
    return (packed >> (bits * i)) & ((1u << bits) - 1u);
}

/* AWQ: nibble i holds column 8c + [0,2,4,6,1,3,5,7][i]; the nibble of column n: */
static const int k_awq_nibble[8] = {0, 4, 1, 5, 2, 6, 3, 7};

static unsigned int_value(const pd_qweight *q, int64_t n, int64_t k)
{
    const uint32_t *qw = q->qweight.data;
    if (q->cfg->method == PD_QUANT_AWQ)
        return field(qw[k * (q->rows / 8) + n / 8], 4, k_awq_nibble[n % 8]);
    const int bits = q->cfg->bits, P = 32 / bits;
    return field(qw[(k / P) * q->rows + n], bits, (int)(k % P));
}

static float int_zero(const pd_qweight *q, int64_t n, int64_t g)
{
    const uint32_t *qz = q->qzeros.data;
    if (q->cfg->method == PD_QUANT_AWQ)
        return (float)field(qz[g * (q->rows / 8) + n / 8], 4, k_awq_nibble[n % 8]);
    const int bits = q->cfg->bits, P = 32 / bits;
    unsigned z = field(qz[g * (q->rows / P) + n / P], bits, (int)(n % P));
    /* v1 checkpoints store zero - 1; like vLLM, a stored 2^bits - 1 reads as 2^bits */
    return (float)(z + (q->cfg->zero_minus_one ? 1u : 0u));
}

void pd_qweight_unpack(const pd_qweight *q, int64_t r0, int64_t nr, int64_t c0, int64_t nc,
                       uint8_t *val, float *scale, float *zero)
{
    if (q->cfg->kind != PD_QKIND_INT) {
        const uint8_t *w = q->weight.data;
        for (int64_t r = 0; r < nr && val; r++)
            memcpy(val + r * nc, w + (r0 + r) * q->cols + c0, (size_t)nc);
        for (int64_t r = 0; r < nr && scale; r++)
            scale[r] = elem_f32(&q->weight_scale, q->cfg->per_channel ? r0 + r : 0);
        return;
    }
    const int64_t G = q->n_groups;
    for (int64_t k = 0; k < nc && val; k++)
        for (int64_t r = 0; r < nr; r++) val[r * nc + k] = (uint8_t)int_value(q, r0 + r, c0 + k);
    for (int64_t g = 0; g < G; g++)
        for (int64_t r = 0; r < nr; r++) {
            if (scale) scale[r * G + g] = elem_f32(&q->scales, g * q->rows + r0 + r);
            if (zero) zero[r * G + g] = int_zero(q, r0 + r, g);
        }
}

int pd_qweight_dequant(const pd_qweight *q, int64_t r0, int64_t nr, int64_t c0, int64_t nc,
                       float *out)
{
    const bool is_int = q->cfg->kind == PD_QKIND_INT;
    const int64_t G = is_int ? q->n_groups : 1;
    uint8_t *val = malloc((size_t)(nr * nc));
    float *scale = malloc((size_t)(nr * G) * sizeof *scale);
    float *zero = is_int ? malloc((size_t)(nr * G) * sizeof *zero) : NULL;
    if (!val || !scale || (is_int && !zero)) {
        free(val);
        free(scale);
        free(zero);
        return pd_error(PD_ENOMEM, "dequantize: out of memory (%lld x %lld)", (long long)nr,
                        (long long)nc);
    }
    pd_qweight_unpack(q, r0, nr, c0, nc, val, scale, zero);
    for (int64_t r = 0; r < nr; r++)
        for (int64_t k = 0; k < nc; k++) {
            float v = pd_qvalue_f32(q->cfg->kind, val[r * nc + k]);
            if (is_int) {
                int64_t g = pd_qweight_group(q, c0 + k);
                out[r * nc + k] = (v - zero[r * G + g]) * scale[r * G + g];
            } else {
                out[r * nc + k] = v * scale[r];
            }
        }
    free(val);
    free(scale);
    free(zero);
    return PD_OK;
}
