/* pd-mkmodel: writes a deterministic synthetic Llama-family model in Hugging Face layout.
 *
 *   pd-mkmodel --preset tiny --out DIR [--dtype bfloat16] [--seed 7] [--shards 2] ...
 *
 * Output: config.json, model.safetensors (or N shards + model.safetensors.index.json),
 * generation_config.json, tokenizer.json (a byte-level BPE trained here on a built-in corpus,
 * or copied with --tokenizer-from) and tokenizer_config.json (ChatML chat template).
 *
 * Design: every weight element is a pure function of (seed, tensor name, element index)
 * (splitmix64 finalizer over a counter, four 16-bit uniforms summed into an approximately
 * normal value), so the same arguments give the same bytes, shards hold the same values as a
 * single file, and optional tensors (biases) do not shift the others. Generation is split over
 * the thread pool. Scales: projections std 1/sqrt(fan_in), norms 1 +- 0.1, embeddings std 1
 * and an lm_head whose logits have std ~3, so greedy decoding produces varied tokens (tied
 * embeddings: a zero-mean final norm instead, see build_specs).
 *
 * Quantized checkpoints (mkquant.h): --quantize awq|gptq|fp8|w8a8 generates the same float
 * weights (rounded to the model dtype, as the float checkpoint stores them), quantizes each of
 * the 7 linears of a layer (q/k/v/o_proj, gate/up/down_proj) round-to-nearest and writes that
 * format's tensors instead of "<prefix>.weight"; embeddings, lm_head, norms and biases stay in the
 * model dtype; config.json gets the format's "quantization_config".
 *   --quantize awq        AutoAWQ GEMM: 4 bit, zero points, groups of --group-size (default
 *                         128) input rows: qweight, qzeros, scales
 *   --quantize gptq       AutoGPTQ: qweight, qzeros, scales, g_idx, with
 *     --bits 4|8            bits per value (default 4)
 *     --group-size N|-1     input rows per group (default 128; -1: one group per output row)
 *     --desc-act            act order: groups from a pseudo-random permutation of the input rows
 *     --sym                 symmetric (zero point 2^(bits-1)); default asymmetric
 *     --checkpoint-format gptq|gptq_v2   v1 stores zero - 1 (default gptq), v2 the zero itself
 *   --quantize fp8        weight F8_E4M3 and a per-tensor weight_scale, with
 *     --activation-scheme dynamic|static   static also writes input_scale (default dynamic)
 *   --quantize w8a8       compressed-tensors int8: weight I8 and a per-row weight_scale
 * A quantization flag without --quantize, or with a method it does not apply to, is refused; so
 * is a --group-size that does not divide every linear's in_features.
 */
#include <dirent.h>
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bpe_train.h"
#include "mkquant.h"
#include "json/json.h"
#include "model/config.h"
#include "model/dtype.h"
#include "model/model.h"
#include "model/safetensors.h"
#include "util/args.h"
#include "util/clock.h"
#include "util/fmt.h"
#include "util/hash.h"
#include "util/status.h"
#include "util/threadpool.h"

static const char *const k_specials[] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
#define N_SPECIALS 3

static const char k_chat_template[] =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}";

typedef struct {
    const char *name;
    int64_t hidden, inter, layers, heads, kv_heads, vocab, max_pos;
    double eps;
    pd_dtype dtype;
} preset;

static const preset k_presets[] = {
    {"tiny", 128, 384, 4, 4, 2, 2048, 2048, 1e-6, PD_DTYPE_F32},
    {"small", 512, 1408, 8, 8, 4, 4096, 2048, 1e-6, PD_DTYPE_F32},
    {"medium", 768, 2560, 12, 12, 4, 8192, 4096, 1e-6, PD_DTYPE_F32},
    {"1b", 2048, 5632, 22, 32, 4, 32000, 2048, 1e-5, PD_DTYPE_BF16},
};

/* ---- weight generation ------------------------------------------------------------------ */

static uint64_t name_hash(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

/* Approximately N(0, 1): Irwin-Hall sum of four 16-bit uniforms, centred and scaled. */
static inline float gauss(uint64_t r)
{
    uint32_t s = (uint32_t)(r & 0xffff) + (uint32_t)((r >> 16) & 0xffff) +
                 (uint32_t)((r >> 32) & 0xffff) + (uint32_t)(r >> 48);
    /* mean 4 * 32767.5, variance 4 * (65536^2 - 1) / 12 */
    return ((float)s - 131070.0f) * (1.0f / 37837.2f);
}

/* How a tensor's elements are drawn. Tied embeddings pair column j + H/2 with column j:
 * same magnitude, random sign; the final norm then uses g[j + H/2] = -g[j]. So for every
 * token sum_j e_j^2 g_j = 0 exactly: the token's own embedding, still in the residual stream,
 * adds nothing to its own logit (otherwise greedy decoding keeps repeating the input token). */
typedef enum { W_NORMAL = 0, W_PAIRED_COLS, W_ANTISYM } wkind;

typedef struct {
    pd_tensor t;
    char name[128];
    float mean, std;
    wkind kind;
} wspec;

typedef struct {
    const wspec *spec;
    uint64_t key; /* mix of seed and name */
    void *buf;
    size_t numel;
} fill_job;

#define FILL_CHUNK 65536
#define RES_TIED   2.0f /* residual branch scale with tied embeddings (see build_specs) */

#define GOLDEN 0x9e3779b97f4a7c15ull

/* Element i of a tensor, as float32 (before rounding to the stored dtype). */
static inline float weight_at(const wspec *w, uint64_t key, size_t i)
{
    if (w->kind == W_NORMAL) return w->mean + w->std * gauss(pd_mix64(key + i * GOLDEN));
    const size_t cols = (size_t)w->t.shape[w->t.ndim - 1], half = cols / 2;
    const size_t col = i % cols;
    if (col < half) return w->mean + w->std * gauss(pd_mix64(key + i * GOLDEN));
    const size_t mate = i - half;
    float v = w->mean + w->std * gauss(pd_mix64(key + mate * GOLDEN));
    if (w->kind == W_ANTISYM) return -v;
    float a = fabsf(v);
    return (pd_mix64(~key + i * GOLDEN) >> 63) ? -a : a;
}

static void fill_task(void *ctx, int task, int n_tasks)
{
    const fill_job *j = ctx;
    (void)n_tasks;
    size_t lo = (size_t)task * FILL_CHUNK;
    size_t hi = lo + FILL_CHUNK < j->numel ? lo + FILL_CHUNK : j->numel;
    const wspec *w = j->spec;
    const uint64_t key = j->key;
    switch (w->t.dtype) {
    case PD_DTYPE_F32: {
        float *o = j->buf;
        for (size_t i = lo; i < hi; i++) o[i] = weight_at(w, key, i);
        break;
    }
    case PD_DTYPE_BF16: {
        uint16_t *o = j->buf;
        for (size_t i = lo; i < hi; i++) o[i] = pd_f32_to_bf16(weight_at(w, key, i));
        break;
    }
    case PD_DTYPE_F16: {
        uint16_t *o = j->buf;
        for (size_t i = lo; i < hi; i++) o[i] = pd_f32_to_f16(weight_at(w, key, i));
        break;
    }
    default: break; /* generated tensors are float (build_specs) */
    }
}

/* The key of a tensor's element stream: a mix of seed and name. */
static uint64_t tensor_key(uint64_t seed, const char *name)
{
    return pd_mix64(seed ^ name_hash(name));
}

/* Generates w into buf (its nbytes), split over pool. */
static void fill_float(const wspec *w, uint64_t seed, pd_threadpool *pool, void *buf)
{
    fill_job j = {w, tensor_key(seed, w->name), buf, (size_t)pd_tensor_numel(&w->t)};
    size_t tasks = (j.numel + FILL_CHUNK - 1) / FILL_CHUNK;
    pd_pool_run(pool, fill_task, &j, (int)tasks);
}

/* The canonical tensor list of a config, in Hugging Face names. */
static int build_specs(const pd_model_config *c, pd_dtype dt, wspec **out, size_t *n_out)
{
    const int64_t H = c->hidden_size, I = c->intermediate_size, V = c->vocab_size;
    const int64_t Q = c->num_attention_heads * c->head_dim;
    const int64_t KV = c->num_key_value_heads * c->head_dim;
    size_t cap = 4 + (size_t)c->num_hidden_layers * 15;
    wspec *s = calloc(cap, sizeof *s);
    if (!s) return pd_error(PD_ENOMEM, "out of memory");
    size_t n = 0;
    const float lm_std = 3.0f / sqrtf((float)H);
    wkind kind = W_NORMAL;
#define ADD(nd, d0, d1, mu, sd, ...)                                                               \
    do {                                                                                           \
        wspec *w_ = &s[n++];                                                                       \
        w_->kind = kind;                                                                           \
        snprintf(w_->name, sizeof w_->name, __VA_ARGS__);                                          \
        w_->t.name = w_->name;                                                                     \
        w_->t.dtype = dt;                                                                          \
        w_->t.ndim = nd;                                                                           \
        w_->t.shape[0] = d0;                                                                       \
        w_->t.shape[1] = d1;                                                                       \
        w_->t.nbytes = (size_t)pd_tensor_numel(&w_->t) * pd_dtype_size(dt);                        \
        w_->mean = mu;                                                                             \
        w_->std = sd;                                                                              \
    } while (0)
    kind = c->tie_word_embeddings ? W_PAIRED_COLS : W_NORMAL;
    ADD(2, V, H, 0.0f, 1.0f, "model.embed_tokens.weight");
    kind = W_NORMAL;
    for (int64_t l = 0; l < c->num_hidden_layers; l++) {
        /* tied: residual branches 2x larger, so the token's own embedding is a smaller part
         * of the final hidden state (measured: fewer immediate repeats in greedy output) */
        const float br = c->tie_word_embeddings ? RES_TIED : 1.0f;
        const float sH = 1.0f / sqrtf((float)H), sQ = br / sqrtf((float)Q),
                    sI = br / sqrtf((float)I);
        const char *p = "model.layers";
        ADD(1, H, 0, 1.0f, 0.1f, "%s.%lld.input_layernorm.weight", p, (long long)l);
        ADD(2, Q, H, 0.0f, sH, "%s.%lld.self_attn.q_proj.weight", p, (long long)l);
        ADD(2, KV, H, 0.0f, sH, "%s.%lld.self_attn.k_proj.weight", p, (long long)l);
        ADD(2, KV, H, 0.0f, sH, "%s.%lld.self_attn.v_proj.weight", p, (long long)l);
        if (c->qkv_bias) {
            ADD(1, Q, 0, 0.0f, 0.2f, "%s.%lld.self_attn.q_proj.bias", p, (long long)l);
            ADD(1, KV, 0, 0.0f, 0.2f, "%s.%lld.self_attn.k_proj.bias", p, (long long)l);
            ADD(1, KV, 0, 0.0f, 0.2f, "%s.%lld.self_attn.v_proj.bias", p, (long long)l);
        }
        if (c->qk_norm) {
            ADD(1, c->head_dim, 0, 1.0f, 0.1f, "%s.%lld.self_attn.q_norm.weight", p, (long long)l);
            ADD(1, c->head_dim, 0, 1.0f, 0.1f, "%s.%lld.self_attn.k_norm.weight", p, (long long)l);
        }
        ADD(2, H, Q, 0.0f, sQ, "%s.%lld.self_attn.o_proj.weight", p, (long long)l);
        if (c->o_bias) ADD(1, H, 0, 0.0f, 0.2f, "%s.%lld.self_attn.o_proj.bias", p, (long long)l);
        ADD(1, H, 0, 1.0f, 0.1f, "%s.%lld.post_attention_layernorm.weight", p, (long long)l);
        ADD(2, I, H, 0.0f, sH, "%s.%lld.mlp.gate_proj.weight", p, (long long)l);
        ADD(2, I, H, 0.0f, sH, "%s.%lld.mlp.up_proj.weight", p, (long long)l);
        ADD(2, H, I, 0.0f, sI, "%s.%lld.mlp.down_proj.weight", p, (long long)l);
    }
    /* tied: logits = E . (norm(h) * g); a zero-mean, antisymmetric g (see wkind) gives
     * logits of std ~3 with no bias toward the current token */
    if (c->tie_word_embeddings) {
        kind = W_ANTISYM;
        ADD(1, H, 0, 0.0f, lm_std, "model.norm.weight");
        kind = W_NORMAL;
    } else {
        ADD(1, H, 0, 1.0f, 0.1f, "model.norm.weight");
    }
    if (!c->tie_word_embeddings) ADD(2, V, H, 0.0f, lm_std, "lm_head.weight");
#undef ADD
    *out = s;
    *n_out = n;
    return PD_OK;
}

/* ---- checkpoint files -------------------------------------------------------------------- */

/* One tensor of the checkpoint: a generated float tensor, or one stored part of a quantized
 * linear. */
typedef struct {
    pd_tensor t;
    char name[160];
    size_t spec; /* the float tensor (index into the wspec list) it comes from */
    int part;    /* -1: that tensor itself; else the mkq_part of it quantized */
} stensor;

/* The 7 linears of a layer (q/k/v/o_proj, gate/up/down_proj): the 2-D "*_proj.weight". */
static bool is_linear(const wspec *w)
{
    static const char tail[] = "_proj.weight";
    const size_t n = strlen(w->name), t = sizeof tail - 1;
    return w->t.ndim == 2 && n > t && strcmp(w->name + n - t, tail) == 0;
}

/* A linear's module name: its weight's name without ".weight". */
static void linear_prefix(const wspec *w, char *buf, size_t n)
{
    snprintf(buf, n, "%.*s", (int)(strlen(w->name) - strlen(".weight")), w->name);
}

/* Refuses a quantization q cannot apply to every linear of c (before any file is written). */
static int check_quant_shapes(const pd_model_config *c, pd_dtype dt, const mkq_opts *q)
{
    if (q->method == MKQ_NONE) return PD_OK;
    wspec *specs = NULL;
    size_t n = 0;
    PD_CHECK(build_specs(c, dt, &specs, &n));
    int rc = PD_OK;
    for (size_t i = 0; i < n && rc == PD_OK; i++) {
        if (!is_linear(&specs[i])) continue;
        char prefix[128];
        linear_prefix(&specs[i], prefix, sizeof prefix);
        rc = mkq_check_linear(q, prefix, specs[i].t.shape[0], specs[i].t.shape[1]);
    }
    free(specs);
    return rc;
}

/* The stored tensors, in file order: each float tensor, or a linear's quantized parts. */
static int build_stored(const wspec *specs, size_t n, const mkq_opts *q, stensor **out,
                        size_t *n_out)
{
    stensor *st = calloc(n * MKQ_MAX_PARTS, sizeof *st);
    if (!st) return pd_error(PD_ENOMEM, "out of memory");
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        const wspec *w = &specs[i];
        mkq_tensor parts[MKQ_MAX_PARTS];
        int np = q->method != MKQ_NONE && is_linear(w)
                     ? mkq_tensors(q, w->t.shape[0], w->t.shape[1], parts)
                     : 0;
        if (np == 0) {
            st[m].t = w->t;
            snprintf(st[m].name, sizeof st[m].name, "%s", w->name);
            st[m].t.name = st[m].name;
            st[m].spec = i;
            st[m++].part = -1;
            continue;
        }
        char prefix[128];
        linear_prefix(w, prefix, sizeof prefix);
        for (int p = 0; p < np; p++) {
            stensor *s = &st[m++];
            snprintf(s->name, sizeof s->name, "%s.%s", prefix, parts[p].suffix);
            s->t.name = s->name;
            s->t.dtype = parts[p].dtype;
            s->t.ndim = parts[p].ndim;
            s->t.shape[0] = parts[p].shape[0];
            s->t.shape[1] = parts[p].shape[1];
            s->t.nbytes = (size_t)pd_tensor_numel(&s->t) * pd_dtype_size(s->t.dtype);
            s->spec = i;
            s->part = (int)parts[p].part;
        }
    }
    *out = st;
    *n_out = m;
    return PD_OK;
}

/* What pd_st_write's fill callback needs; lin caches the last quantized linear, whose parts
 * are asked for one after another. */
typedef struct {
    const wspec *specs;
    const stensor *st; /* the tensors of the file being written, in order */
    uint64_t seed;
    const mkq_opts *q;
    pd_threadpool *pool;
    size_t cached; /* the spec lin holds; SIZE_MAX: none */
    mkq_linear lin;
} fill_ctx;

/* Quantizes float tensor i into f->lin: its values rounded to the model dtype first, as the
 * float checkpoint stores them. */
static int quantize_spec(fill_ctx *f, size_t i)
{
    const wspec *w = &f->specs[i];
    const size_t numel = (size_t)pd_tensor_numel(&w->t);
    float *x = malloc(numel * sizeof *x);                                     /* (out, in) f32 */
    void *raw = w->t.dtype == PD_DTYPE_F32 ? (void *)x : malloc(w->t.nbytes); /* model dtype */
    if (!x || !raw) {
        if (raw != x) free(raw);
        free(x);
        return pd_error(PD_ENOMEM, "out of memory quantizing %s", w->name);
    }
    fill_float(w, f->seed, f->pool, raw);
    if (raw != x) {
        pd_to_f32_n(w->t.dtype, raw, x, numel);
        free(raw);
    }
    f->cached = SIZE_MAX;
    int rc = mkq_quantize(f->q, x, w->t.shape[0], w->t.shape[1], ~tensor_key(f->seed, w->name),
                          f->pool, &f->lin);
    free(x);
    PD_CHECK(rc);
    f->cached = i;
    return PD_OK;
}

static int fill_tensor(void *ctx, size_t index, void *buf, size_t nbytes)
{
    fill_ctx *f = ctx;
    const stensor *s = &f->st[index];
    (void)nbytes;
    if (s->part < 0) {
        fill_float(&f->specs[s->spec], f->seed, f->pool, buf);
        return PD_OK;
    }
    if (f->cached != s->spec) PD_CHECK(quantize_spec(f, s->spec));
    mkq_pack(f->q, &f->lin, (mkq_part)s->part, buf);
    return PD_OK;
}

/* Contiguous groups of roughly total/shards bytes, none empty: shard_of[i] for n items of
 * bytes[i] (a quantized linear's parts are one item, so they stay in one file). */
static void assign_shards(const uint64_t *bytes, size_t n, int shards, int *shard_of)
{
    uint64_t total = 0, acc = 0;
    for (size_t i = 0; i < n; i++) total += bytes[i];
    int cur = 0;
    for (size_t i = 0; i < n; i++) {
        size_t left = n - i;
        if (cur < shards - 1 && i > 0 &&
            (acc >= (total * (uint64_t)(cur + 1)) / (uint64_t)shards ||
             left == (size_t)(shards - 1 - cur)))
            cur++;
        shard_of[i] = cur;
        acc += bytes[i];
    }
}

static int stensor_name_cmp(const void *a, const void *b)
{
    return strcmp((*(const stensor *const *)a)->name, (*(const stensor *const *)b)->name);
}

/* model.safetensors.index.json: total size and each tensor's shard, names sorted as
 * transformers writes them. */
static int write_index(const char *dir, const stensor *st, size_t n, const int *shard_of,
                       int shards, uint64_t total)
{
    const stensor **sorted = malloc(n * sizeof *sorted);
    if (!sorted) return pd_error(PD_ENOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) sorted[i] = &st[i];
    qsort(sorted, n, sizeof *sorted, stensor_name_cmp);
    json_t *index = json_object();
    json_t *meta = json_object();
    json_object_set_new(meta, "total_size", json_integer((json_int_t)total));
    json_object_set_new(index, "metadata", meta);
    json_t *wm = json_object();
    for (size_t k = 0; k < n; k++) {
        char f[64];
        snprintf(f, sizeof f, "model-%05d-of-%05d.safetensors", shard_of[sorted[k]->spec] + 1,
                 shards);
        json_object_set_new(wm, sorted[k]->name, json_string(f));
    }
    json_object_set_new(index, "weight_map", wm);
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    int rc = pdj_dump_file(index, path, 2);
    json_decref(index);
    free(sorted);
    return rc;
}

/* Writes the weights (quantized per q) as one file or shards + index; *total_out: their bytes. */
static int write_weights(const char *dir, const pd_model_config *c, pd_dtype dt, const mkq_opts *q,
                         uint64_t seed, int shards, pd_threadpool *pool, uint64_t *total_out)
{
    wspec *specs = NULL;
    size_t n = 0, n_st = 0;
    PD_CHECK(build_specs(c, dt, &specs, &n));
    int rc = PD_OK;
    stensor *st = NULL;
    pd_tensor *views = NULL;
    uint64_t *bytes = calloc(n, sizeof *bytes);
    int *shard_of = calloc(n, sizeof *shard_of);
    fill_ctx fc = {specs, NULL, seed, q, pool, SIZE_MAX, {0}};
    if (!bytes || !shard_of) {
        rc = pd_error(PD_ENOMEM, "out of memory");
        goto done;
    }
    if ((size_t)shards > n) {
        rc = pd_error(PD_EINVAL, "--shards %d: the model has only %zu tensors", shards, n);
        goto done;
    }
    PD_CHECK_GOTO(build_stored(specs, n, q, &st, &n_st), rc, done);
    views = calloc(n_st, sizeof *views);
    if (!views) {
        rc = pd_error(PD_ENOMEM, "out of memory");
        goto done;
    }
    uint64_t total = 0;
    for (size_t i = 0; i < n_st; i++) {
        bytes[st[i].spec] += st[i].t.nbytes;
        total += st[i].t.nbytes;
    }
    assign_shards(bytes, n, shards, shard_of);
    char path[4096];
    for (int s = 0; s < shards; s++) {
        size_t first = n_st, cnt = 0;
        for (size_t i = 0; i < n_st; i++)
            if (shard_of[st[i].spec] == s) {
                if (first == n_st) first = i;
                views[cnt++] = st[i].t;
            }
        fc.st = &st[first];
        if (shards == 1)
            snprintf(path, sizeof path, "%s/model.safetensors", dir);
        else
            snprintf(path, sizeof path, "%s/model-%05d-of-%05d.safetensors", dir, s + 1, shards);
        PD_CHECK_GOTO(pd_st_write(path, views, cnt, fill_tensor, &fc), rc, done);
    }
    if (shards > 1) PD_CHECK_GOTO(write_index(dir, st, n_st, shard_of, shards, total), rc, done);
    *total_out = total;
done:
    mkq_linear_free(&fc.lin);
    free(views);
    free(st);
    free(bytes);
    free(shard_of);
    free(specs);
    return rc;
}

/* Removes checkpoint files a previous run left in dir (model.safetensors, its index, shards
 * of any count): a stale index would otherwise shadow a new single-file checkpoint. */
/* mkdir -p dir: the directory and any missing parents (0755); the failing one named. */
static int make_dirs(const char *dir)
{
    char path[4096];
    if (pd_str_copy(path, sizeof path, dir) >= sizeof path)
        return pd_error(PD_EINVAL, "--out: path too long");
    for (char *p = path + 1;; p++) {
        bool end = *p == '\0';
        if (*p != '/' && !end) continue;
        *p = '\0';
        if (mkdir(path, 0755) != 0 && errno != EEXIST)
            return pd_error(PD_EIO, "--out: cannot create %s: %s", path, strerror(errno));
        if (end) return PD_OK;
        *p = '/';
    }
}

static int remove_old_checkpoint(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) return pd_error(PD_EIO, "%s: %s", dir, strerror(errno));
    struct dirent *e;
    int rc = PD_OK;
    while ((e = readdir(d)) != NULL) {
        int a, b, n = -1;
        int shard = sscanf(e->d_name, "model-%5d-of-%5d.safetensors%n", &a, &b, &n) == 2 &&
                    n == (int)strlen(e->d_name);
        if (!shard && strcmp(e->d_name, "model.safetensors") != 0 &&
            strcmp(e->d_name, "model.safetensors.index.json") != 0)
            continue;
        char p[4096];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        if (unlink(p) != 0) {
            rc = pd_error(PD_EIO, "%s: %s", p, strerror(errno));
            break;
        }
    }
    closedir(d);
    return rc;
}

/* ---- tokenizer files -------------------------------------------------------------------- */

/* Copies src to dst byte for byte (atomically: temporary name, then rename). */
static int copy_file(const char *src, const char *dst)
{
    FILE *in = fopen(src, "rb");
    if (!in)
        return pd_error(errno == ENOENT ? PD_ENOTFOUND : PD_EIO, "%s: %s", src, strerror(errno));
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", dst, (int)getpid());
    FILE *out = fopen(tmp, "wb");
    if (!out) {
        int e = errno;
        fclose(in);
        return pd_error(PD_EIO, "%s: %s", tmp, strerror(e));
    }
    char buf[1 << 16];
    size_t n;
    int bad = 0;
    while ((n = fread(buf, 1, sizeof buf, in)) > 0)
        if (fwrite(buf, 1, n, out) != n) bad = 1;
    bad |= ferror(in);
    fclose(in);
    bad |= fclose(out) != 0;
    if (bad || rename(tmp, dst) != 0) {
        unlink(tmp);
        return pd_error(PD_EIO, "copying %s to %s failed", src, dst);
    }
    return PD_OK;
}

/* Parses a tokenizer file; huge integers (model_max_length = 1e30 in many published
 * tokenizer_config.json files) are read as reals instead of failing. */
static int load_json_lenient(const char *file, json_t **out)
{
    FILE *f = fopen(file, "rb");
    if (!f)
        return pd_error(errno == ENOENT ? PD_ENOTFOUND : PD_EIO, "%s: %s", file, strerror(errno));
    json_error_t err;
    *out = json_loadf(f, JSON_DECODE_INT_AS_REAL | JSON_REJECT_DUPLICATES, &err);
    fclose(f);
    if (!*out)
        return pd_error(PD_EPARSE, "%s: line %d column %d: %s", file, err.line, err.column,
                        err.text);
    return PD_OK;
}

/* A token id read leniently (integers may come back as reals); -1 when not an id. */
static int64_t json_id(const json_t *v)
{
    if (!json_is_number(v)) return -1;
    double d = json_number_value(v);
    return d >= 0 && d < 1e12 && d == (double)(int64_t)d ? (int64_t)d : -1;
}

/* A special token named by tokenizer_config.json (a string or {"content": ...}) -> its id. */
static int64_t special_id(const json_t *tcfg, const char *key, const json_t *tok)
{
    const json_t *v = json_object_get(tcfg, key);
    if (json_is_object(v)) v = json_object_get(v, "content");
    if (!json_is_string(v)) return -1;
    const char *s = json_string_value(v);
    size_t i;
    json_t *a;
    json_array_foreach(json_object_get(tok, "added_tokens"), i, a)
    {
        const json_t *c = json_object_get(a, "content");
        if (json_is_string(c) && strcmp(json_string_value(c), s) == 0)
            return json_id(json_object_get(a, "id"));
    }
    const json_t *id = json_object_get(json_object_get(json_object_get(tok, "model"), "vocab"), s);
    return json_id(id);
}

/* Copies the tokenizer from src_dir; sets vocab size and bos/eos ids in c from it. */
static int tokenizer_from(const char *src_dir, const char *out_dir, pd_model_config *c)
{
    char src[4096], dst[4096];
    json_t *tok = NULL, *tcfg = NULL;
    snprintf(src, sizeof src, "%s/tokenizer.json", src_dir);
    PD_CHECK(load_json_lenient(src, &tok));
    int rc = PD_OK;
    int64_t max_id = -1;
    const json_t *vocab = json_object_get(json_object_get(tok, "model"), "vocab");
    const char *k;
    json_t *v;
    size_t i;
    if (!json_is_object(vocab)) {
        rc = pd_error(PD_EINVAL, "%s: model.vocab: expected an object", src);
        goto done;
    }
    json_object_foreach((json_t *)vocab, k, v) if (json_id(v) > max_id) max_id = json_id(v);
    json_array_foreach(json_object_get(tok, "added_tokens"), i, v)
    {
        int64_t id = json_id(json_object_get(v, "id"));
        if (id > max_id) max_id = id;
    }
    if (max_id < 0) {
        rc = pd_error(PD_EINVAL, "%s: no token ids", src);
        goto done;
    }
    c->vocab_size = max_id + 1;
    snprintf(dst, sizeof dst, "%s/tokenizer.json", out_dir);
    PD_CHECK_GOTO(copy_file(src, dst), rc, done);
    snprintf(src, sizeof src, "%s/tokenizer_config.json", src_dir);
    snprintf(dst, sizeof dst, "%s/tokenizer_config.json", out_dir);
    PD_CHECK_GOTO(load_json_lenient(src, &tcfg), rc, done);
    c->bos_token_id = special_id(tcfg, "bos_token", tok);
    int64_t eos = special_id(tcfg, "eos_token", tok);
    c->n_eos_token_ids = eos >= 0 ? 1 : 0;
    c->eos_token_ids[0] = eos;
    PD_CHECK_GOTO(copy_file(src, dst), rc, done);
done:
    json_decref(tok);
    json_decref(tcfg);
    return rc;
}

static int write_tokenizer_config(const char *dir, int64_t first_special)
{
    json_t *o = json_object();
    json_object_set_new(o, "add_bos_token", json_false());
    json_object_set_new(o, "add_eos_token", json_false());
    json_object_set_new(o, "add_prefix_space", json_false());
    json_t *dec = json_object();
    for (int i = 0; i < N_SPECIALS; i++) {
        json_t *a = json_object();
        json_object_set_new(a, "content", json_string(k_specials[i]));
        json_object_set_new(a, "lstrip", json_false());
        json_object_set_new(a, "normalized", json_false());
        json_object_set_new(a, "rstrip", json_false());
        json_object_set_new(a, "single_word", json_false());
        json_object_set_new(a, "special", json_true());
        char id[32];
        snprintf(id, sizeof id, "%lld", (long long)(first_special + i));
        json_object_set_new(dec, id, a);
    }
    json_object_set_new(o, "added_tokens_decoder", dec);
    json_t *extra = json_array();
    json_array_append_new(extra, json_string("<|im_start|>"));
    json_array_append_new(extra, json_string("<|im_end|>"));
    json_object_set_new(o, "additional_special_tokens", extra);
    json_object_set_new(o, "bos_token", json_string("<|endoftext|>"));
    json_object_set_new(o, "chat_template", json_string(k_chat_template));
    json_object_set_new(o, "clean_up_tokenization_spaces", json_false());
    json_object_set_new(o, "eos_token", json_string("<|im_end|>"));
    json_object_set_new(o, "errors", json_string("replace"));
    json_object_set_new(o, "model_max_length", json_integer(32768));
    json_object_set_new(o, "pad_token", json_string("<|endoftext|>"));
    json_object_set_new(o, "split_special_tokens", json_false());
    json_object_set_new(o, "tokenizer_class", json_string("Qwen2Tokenizer"));
    json_object_set_new(o, "unk_token", json_null());
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    int rc = pdj_dump_file(o, path, 2);
    json_decref(o);
    return rc;
}

static int write_generation_config(const char *dir, const pd_model_config *c, int64_t pad)
{
    json_t *o = json_object();
    if (c->bos_token_id >= 0) json_object_set_new(o, "bos_token_id", json_integer(c->bos_token_id));
    json_t *eos = json_array();
    for (int i = 0; i < c->n_eos_token_ids; i++)
        json_array_append_new(eos, json_integer(c->eos_token_ids[i]));
    json_object_set_new(o, "eos_token_id", eos);
    if (pad >= 0) json_object_set_new(o, "pad_token_id", json_integer(pad));
    json_object_set_new(o, "transformers_version", json_string("4.46.0"));
    char path[4096];
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    int rc = pdj_dump_file(o, path, 2);
    json_decref(o);
    return rc;
}

/* ---- command line ----------------------------------------------------------------------- */

static void usage(FILE *f)
{
    fprintf(f, "usage: pd-mkmodel --preset tiny|small|medium|1b --out DIR [options]\n"
               "  --dtype float32|bfloat16|float16   weight dtype (preset default)\n"
               "  --seed N                           weight seed (default 0)\n"
               "  --shards N                         write N shards + index (default 1)\n"
               "  --tokenizer-from DIR               copy tokenizer.json/tokenizer_config.json;\n"
               "                                     vocab size and bos/eos ids come from them\n"
               "  --arch llama|mistral|qwen2|qwen3   architecture (default llama; qwen3 adds\n"
               "                                     per-head q/k norms)\n"
               "  --hidden N --intermediate N --layers N --heads N --kv-heads N --head-dim N\n"
               "  --vocab N                          tokenizer size incl. 3 special tokens\n"
               "  --max-pos N --rope-theta X --rms-eps X\n"
               "  --tie-embeddings                   tie lm_head to embed_tokens\n"
               "  --qkv-bias                         attention_bias: true (Llama/Mistral: q,k,v,o\n"
               "                                     biases; Qwen2 always has q,k,v biases)\n"
               "  --rope-scaling linear:F|dynamic:F|llama3:F\n"
               "  --threads N                        generation threads (default: all cores)\n"
               "  --quantize awq|gptq|fp8|w8a8       quantize the 7 linears of each layer\n"
               "  --bits 4|8                         gptq: 4 (default) or 8 bits; awq: 4\n"
               "  --group-size N                     awq, gptq: input rows per group (default\n"
               "                                     128; -1: one per output row, gptq only)\n"
               "  --desc-act                         gptq: act order (permuted groups, g_idx)\n"
               "  --sym                              gptq: symmetric (default asymmetric)\n"
               "  --checkpoint-format gptq|gptq_v2   gptq: zero points stored as zero - 1 (gptq,\n"
               "                                     default) or as they are (gptq_v2)\n"
               "  --activation-scheme dynamic|static fp8: static writes input_scale (default\n"
               "                                     dynamic)\n");
}

static int parse_f64(const char *opt, const char *s, double *out)
{
    PD_CHECK(pd_arg_f64(opt, s, out));
    if (*out <= 0) return pd_error(PD_EINVAL, "%s: expected a positive number, got \"%s\"", opt, s);
    return PD_OK;
}

static int parse_rope(const char *s, pd_model_config *c)
{
    const char *colon = strchr(s, ':');
    if (!colon) return pd_error(PD_EINVAL, "--rope-scaling: expected TYPE:FACTOR, got \"%s\"", s);
    size_t tl = (size_t)(colon - s);
    pd_rope_scaling *r = &c->rope_scaling;
    memset(r, 0, sizeof *r);
    if (tl == 6 && strncmp(s, "linear", tl) == 0)
        r->type = PD_ROPE_LINEAR;
    else if (tl == 7 && strncmp(s, "dynamic", tl) == 0)
        r->type = PD_ROPE_DYNAMIC;
    else if (tl == 6 && strncmp(s, "llama3", tl) == 0)
        r->type = PD_ROPE_LLAMA3;
    else
        return pd_error(PD_EINVAL,
                        "--rope-scaling: unknown type in \"%s\" (linear, dynamic, "
                        "llama3)",
                        s);
    PD_CHECK(parse_f64("--rope-scaling", colon + 1, &r->factor));
    if (r->type == PD_ROPE_LLAMA3) { /* Llama 3.1's published values */
        r->low_freq_factor = 1.0;
        r->high_freq_factor = 4.0;
        r->original_max_position_embeddings = 8192;
    }
    return PD_OK;
}

typedef struct {
    const char *preset, *out, *tokenizer_from;
    bool has_dtype;
    pd_dtype dtype;
    uint64_t seed;
    int shards, threads;
} options;

static int run(int argc, char **argv)
{
    enum {
        O_DTYPE = 256,
        O_SEED,
        O_TOKFROM,
        O_SHARDS,
        O_ARCH,
        O_HIDDEN,
        O_INTER,
        O_LAYERS,
        O_HEADS,
        O_KVHEADS,
        O_HEADDIM,
        O_VOCAB,
        O_MAXPOS,
        O_THETA,
        O_EPS,
        O_TIE,
        O_BIAS,
        O_ROPE,
        O_THREADS,
        O_QUANT /* every quantization flag: mkq_parse tells them apart */
    };
    static const struct option longopts[] = {{"preset", required_argument, 0, 'p'},
                                             {"out", required_argument, 0, 'o'},
                                             {"dtype", required_argument, 0, O_DTYPE},
                                             {"seed", required_argument, 0, O_SEED},
                                             {"tokenizer-from", required_argument, 0, O_TOKFROM},
                                             {"shards", required_argument, 0, O_SHARDS},
                                             {"arch", required_argument, 0, O_ARCH},
                                             {"hidden", required_argument, 0, O_HIDDEN},
                                             {"intermediate", required_argument, 0, O_INTER},
                                             {"layers", required_argument, 0, O_LAYERS},
                                             {"heads", required_argument, 0, O_HEADS},
                                             {"kv-heads", required_argument, 0, O_KVHEADS},
                                             {"head-dim", required_argument, 0, O_HEADDIM},
                                             {"vocab", required_argument, 0, O_VOCAB},
                                             {"max-pos", required_argument, 0, O_MAXPOS},
                                             {"rope-theta", required_argument, 0, O_THETA},
                                             {"rms-eps", required_argument, 0, O_EPS},
                                             {"tie-embeddings", no_argument, 0, O_TIE},
                                             {"qkv-bias", no_argument, 0, O_BIAS},
                                             {"rope-scaling", required_argument, 0, O_ROPE},
                                             {"threads", required_argument, 0, O_THREADS},
                                             {"quantize", required_argument, 0, O_QUANT},
                                             {"bits", required_argument, 0, O_QUANT},
                                             {"group-size", required_argument, 0, O_QUANT},
                                             {"desc-act", no_argument, 0, O_QUANT},
                                             {"sym", no_argument, 0, O_QUANT},
                                             {"checkpoint-format", required_argument, 0, O_QUANT},
                                             {"activation-scheme", required_argument, 0, O_QUANT},
                                             {"help", no_argument, 0, 'h'},
                                             {0, 0, 0, 0}};
    options o = {.shards = 1};
    mkq_opts q = mkq_default_opts();
    /* overrides: -1 = preset value */
    int64_t ov_hidden = -1, ov_inter = -1, ov_layers = -1, ov_heads = -1, ov_kv = -1, ov_hd = -1,
            ov_vocab = -1, ov_maxpos = -1, v;
    double ov_theta = -1, ov_eps = -1;
    bool tie = false, bias = false;
    pd_arch arch = PD_ARCH_LLAMA;
    pd_model_config rope_holder = pd_model_config_default();
    const int64_t big = INT64_C(1) << 20;
    int ch, li = -1;
    char flag[64];
    opterr = 0;
    while ((ch = getopt_long(argc, argv, "p:o:h", longopts, &li)) != -1) {
        switch (ch) {
        case 'p': o.preset = optarg; break;
        case 'o': o.out = optarg; break;
        case 'h': usage(stdout); return 1;
        case O_DTYPE:
            PD_CHECK(pd_dtype_parse(optarg, &o.dtype));
            o.has_dtype = true;
            break;
        case O_SEED:
            PD_CHECK(pd_arg_i64("--seed", optarg, 0, INT64_MAX, &v));
            o.seed = (uint64_t)v;
            break;
        case O_TOKFROM: o.tokenizer_from = optarg; break;
        case O_SHARDS:
            PD_CHECK(pd_arg_i64("--shards", optarg, 1, 999, &v));
            o.shards = (int)v;
            break;
        case O_THREADS:
            PD_CHECK(pd_arg_i64("--threads", optarg, 1, 1024, &v));
            o.threads = (int)v;
            break;
        case O_ARCH:
            if (pd_arch_from_model_type(optarg, &arch) < 0)
                return pd_error(PD_EINVAL, "--arch: expected one of %s, got \"%s\"", PD_MODEL_TYPES,
                                optarg);
            break;
        case O_HIDDEN: PD_CHECK(pd_arg_i64("--hidden", optarg, 2, big, &ov_hidden)); break;
        case O_INTER: PD_CHECK(pd_arg_i64("--intermediate", optarg, 1, big, &ov_inter)); break;
        case O_LAYERS: PD_CHECK(pd_arg_i64("--layers", optarg, 1, 1024, &ov_layers)); break;
        case O_HEADS: PD_CHECK(pd_arg_i64("--heads", optarg, 1, 4096, &ov_heads)); break;
        case O_KVHEADS: PD_CHECK(pd_arg_i64("--kv-heads", optarg, 1, 4096, &ov_kv)); break;
        case O_HEADDIM: PD_CHECK(pd_arg_i64("--head-dim", optarg, 2, 4096, &ov_hd)); break;
        case O_VOCAB:
            PD_CHECK(pd_arg_i64("--vocab", optarg, 256 + N_SPECIALS, 1 << 18, &ov_vocab));
            break;
        case O_MAXPOS:
            PD_CHECK(pd_arg_i64("--max-pos", optarg, 1, INT64_C(1) << 24, &ov_maxpos));
            break;
        case O_THETA: PD_CHECK(parse_f64("--rope-theta", optarg, &ov_theta)); break;
        case O_EPS: PD_CHECK(parse_f64("--rms-eps", optarg, &ov_eps)); break;
        case O_TIE: tie = true; break;
        case O_BIAS: bias = true; break;
        case O_ROPE: PD_CHECK(parse_rope(optarg, &rope_holder)); break;
        case O_QUANT:
            snprintf(flag, sizeof flag, "--%s", longopts[li].name);
            PD_CHECK(mkq_parse(&q, flag, optarg));
            break;
        default:
            return pd_error(PD_EINVAL, "unknown or incomplete option \"%s\" (see --help)",
                            argv[optind - 1]);
        }
    }
    if (optind < argc) return pd_error(PD_EINVAL, "unexpected argument \"%s\"", argv[optind]);
    PD_CHECK(mkq_check(&q));
    if (!o.preset || !o.out) {
        usage(stderr);
        return pd_error(PD_EINVAL, "--preset and --out are required");
    }
    const preset *ps = NULL;
    for (size_t i = 0; i < sizeof k_presets / sizeof k_presets[0]; i++)
        if (strcmp(k_presets[i].name, o.preset) == 0) ps = &k_presets[i];
    if (!ps)
        return pd_error(PD_EINVAL, "--preset: expected tiny, small, medium or 1b, got \"%s\"",
                        o.preset);

    pd_model_config c = pd_model_config_default();
    c.arch = arch;
    c.hidden_size = ov_hidden > 0 ? ov_hidden : ps->hidden;
    c.intermediate_size = ov_inter > 0 ? ov_inter : ps->inter;
    c.num_hidden_layers = ov_layers > 0 ? ov_layers : ps->layers;
    c.num_attention_heads = ov_heads > 0 ? ov_heads : ps->heads;
    c.num_key_value_heads = ov_kv > 0 ? ov_kv : (ov_heads > 0 ? ov_heads : ps->kv_heads);
    if (ov_kv <= 0 && ov_heads > 0 && ps->heads % ps->kv_heads == 0 &&
        ov_heads % (ps->heads / ps->kv_heads) == 0)
        c.num_key_value_heads = ov_heads / (ps->heads / ps->kv_heads);
    if (c.num_attention_heads % c.num_key_value_heads != 0)
        return pd_error(PD_EINVAL, "--kv-heads %lld must divide --heads %lld",
                        (long long)c.num_key_value_heads, (long long)c.num_attention_heads);
    if (ov_hd > 0) {
        c.head_dim = ov_hd;
    } else {
        if (c.hidden_size % c.num_attention_heads != 0)
            return pd_error(PD_EINVAL,
                            "hidden %lld is not a multiple of heads %lld: give "
                            "--head-dim",
                            (long long)c.hidden_size, (long long)c.num_attention_heads);
        c.head_dim = c.hidden_size / c.num_attention_heads;
    }
    if (c.head_dim % 2 != 0)
        return pd_error(PD_EINVAL, "head dim %lld must be even", (long long)c.head_dim);
    c.max_position_embeddings = ov_maxpos > 0 ? ov_maxpos : ps->max_pos;
    c.rope_theta = ov_theta > 0 ? ov_theta : 10000.0;
    c.rms_norm_eps = ov_eps > 0 ? ov_eps : ps->eps;
    c.rope_scaling = rope_holder.rope_scaling;
    c.tie_word_embeddings = tie;
    c.attention_bias = bias;
    c.qkv_bias = bias || arch == PD_ARCH_QWEN2;
    c.o_bias = bias && arch != PD_ARCH_QWEN2;
    c.qk_norm = arch == PD_ARCH_QWEN3;
    c.sliding_window = 0;
    pd_dtype dt = o.has_dtype ? o.dtype : ps->dtype;
    c.torch_dtype = dt;
    c.has_torch_dtype = true;

    const int64_t n_tensors =
        2 + (c.tie_word_embeddings ? 0 : 1) +
        c.num_hidden_layers * (9 + (c.qkv_bias ? 3 : 0) + (c.o_bias ? 1 : 0) + (c.qk_norm ? 2 : 0));
    if (o.shards > n_tensors)
        return pd_error(PD_EINVAL, "--shards %d: the model has only %lld tensors", o.shards,
                        (long long)n_tensors);
    PD_CHECK(check_quant_shapes(&c, dt, &q));
    PD_CHECK(make_dirs(o.out));
    PD_CHECK(remove_old_checkpoint(o.out));
    char path[4096];
    int64_t pad = -1;
    double t0 = pd_now_s();
    if (o.tokenizer_from) {
        PD_CHECK(tokenizer_from(o.tokenizer_from, o.out, &c));
    } else {
        int64_t vocab = ov_vocab > 0 ? ov_vocab : ps->vocab;
        bpe_model *bpe = NULL;
        PD_CHECK(bpe_train(pd_mkmodel_corpus, strlen(pd_mkmodel_corpus), vocab - N_SPECIALS, &bpe));
        snprintf(path, sizeof path, "%s/tokenizer.json", o.out);
        int rc = bpe_write_tokenizer_json(bpe, k_specials, N_SPECIALS, path);
        int64_t base = bpe_size(bpe);
        bpe_free(bpe);
        PD_CHECK(rc);
        PD_CHECK(write_tokenizer_config(o.out, base));
        c.vocab_size = base + N_SPECIALS;
        c.bos_token_id = base; /* <|endoftext|> */
        c.n_eos_token_ids = 1;
        c.eos_token_ids[0] = base + 2; /* <|im_end|> */
        pad = base;
    }
    double t_tok = pd_now_s() - t0;
    json_t *cj = pd_model_config_to_json(&c);
    if (!cj) return pd_error(PD_ENOMEM, "out of memory");
    if (q.method != MKQ_NONE &&
        json_object_set_new(cj, "quantization_config", mkq_config_json(&q)) != 0) {
        json_decref(cj);
        return pd_error(PD_ENOMEM, "out of memory");
    }
    snprintf(path, sizeof path, "%s/config.json", o.out);
    int rc = pdj_dump_file(cj, path, 2);
    json_decref(cj);
    PD_CHECK(rc);
    pd_model_config gen = c;
    if (!o.tokenizer_from) { /* generation stops at either end marker */
        gen.n_eos_token_ids = 2;
        gen.eos_token_ids[1] = pad;
    }
    PD_CHECK(write_generation_config(o.out, &gen, pad));

    pd_threadpool *pool = pd_pool_create(o.threads > 0 ? o.threads : 0);
    if (!pool) return pd_error(PD_ENOMEM, "cannot create the thread pool");
    double t1 = pd_now_s();
    uint64_t bytes = 0;
    rc = write_weights(o.out, &c, dt, &q, o.seed, o.shards, pool, &bytes);
    pd_pool_free(pool);
    PD_CHECK(rc);
    double t_w = pd_now_s() - t1;
    int64_t params = pd_model_param_count(&c);
    printf("pd-mkmodel: %s (%s) -> %s: %lld params, vocab %lld, %s%s%s, %.1f MB in %d file(s); "
           "tokenizer %.2f s, weights %.2f s\n",
           ps->name, pd_arch_name(c.arch), o.out, (long long)params, (long long)c.vocab_size,
           pd_dtype_name(dt), q.method != MKQ_NONE ? ", quantized " : "",
           q.method != MKQ_NONE ? mkq_method_name(q.method) : "", (double)bytes / 1e6, o.shards,
           t_tok, t_w);
    return PD_OK;
}

int main(int argc, char **argv)
{
    int rc = run(argc, argv);
    if (rc == 1) return 0; /* --help */
    if (rc < 0) {
        fprintf(stderr, "pd-mkmodel: %s\n", pd_last_error());
        return 2;
    }
    return 0;
}
