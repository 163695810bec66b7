/* Checkpoint loading: config + safetensors -> resolved, shape-checked weight views (model.h).
 *
 * Design: every weight is looked up by its Hugging Face name and checked against the shape the
 * config implies here, once; errors carry the file, the tensor and expected vs actual shape.
 */
#include "model/model.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "util/status.h"

int64_t pd_model_param_count(const pd_model_config *c)
{
    const int64_t H = c->hidden_size, I = c->intermediate_size, D = c->head_dim;
    const int64_t q = c->num_attention_heads * D, kv = c->num_key_value_heads * D;
    int64_t layer = 2 * H                /* norms */
                    + q * H + 2 * kv * H /* q, k, v */
                    + H * q              /* o */
                    + 3 * H * I;         /* gate, up, down */
    if (c->qkv_bias) layer += q + 2 * kv;
    if (c->o_bias) layer += H;
    if (c->qk_norm) layer += 2 * D;
    int64_t emb = c->vocab_size * H;
    return emb * (c->tie_word_embeddings ? 1 : 2) + c->num_hidden_layers * layer + H;
}

/* Finds name, checks it holds floats and its shape: ndim dims (a, b). */
static int resolve(const pd_st *st, pd_tensor *out, const char *name, int ndim, int64_t a,
                   int64_t b)
{
    const int64_t shape[2] = {a, b};
    return pd_st_expect(st, name, PD_ST_FLOAT, ndim, shape, out);
}

/* Linear layer `module` of layer l, (rows, cols): module.weight, or its quantized tensors
 * when the checkpoint is quantized and the module is not in its ignore list. */
static int linear(pd_model *m, int l, pd_tensor *out, const char *module, int64_t rows,
                  int64_t cols)
{
    char prefix[128], name[160];
    snprintf(prefix, sizeof prefix, "model.layers.%d.%s", l, module);
    const pd_quant_config *qc = &m->config.quant;
    if (qc->method == PD_QUANT_NONE || pd_quant_ignored(qc, prefix)) {
        snprintf(name, sizeof name, "%s.weight", prefix);
        return resolve(m->st, out, name, 2, rows, cols);
    }
    pd_qweight *q = &m->qweights[m->n_qweights];
    PD_CHECK(pd_qweight_resolve(m->st, qc, prefix, rows, cols, q));
    m->n_qweights++;
    *out = pd_qweight_tensor(q);
    return PD_OK;
}

static int resolve_weights(pd_model *m)
{
    const pd_model_config *c = &m->config;
    const pd_st *st = m->st;
    const int64_t H = c->hidden_size, I = c->intermediate_size, V = c->vocab_size;
    const int64_t Q = c->num_attention_heads * c->head_dim;
    const int64_t KV = c->num_key_value_heads * c->head_dim;
    pd_model_weights *w = &m->weights;
    w->layers = calloc((size_t)c->num_hidden_layers, sizeof *w->layers);
    if (!w->layers) return pd_error(PD_ENOMEM, "model: out of memory");
    if (c->quant.method != PD_QUANT_NONE) {
        m->qweights = calloc((size_t)c->num_hidden_layers * 7, sizeof *m->qweights);
        if (!m->qweights) return pd_error(PD_ENOMEM, "model: out of memory");
    }
    PD_CHECK(resolve(st, &w->embed_tokens, "model.embed_tokens.weight", 2, V, H));
    PD_CHECK(resolve(st, &w->norm, "model.norm.weight", 1, H, 0));
    if (c->tie_word_embeddings) {
        w->lm_head = w->embed_tokens;
        w->lm_head_tied = true;
    } else {
        PD_CHECK(resolve(st, &w->lm_head, "lm_head.weight", 2, V, H));
    }
    for (int l = 0; l < (int)c->num_hidden_layers; l++) {
        pd_layer_weights *L = &w->layers[l];
        char f[160];
#define R1(field, suffix, a)                                                                       \
    (snprintf(f, sizeof f, "model.layers.%d.%s", l, suffix), resolve(st, &L->field, f, 1, a, 0))
#define R2(field, suffix, a, b) linear(m, l, &L->field, suffix, a, b)
        PD_CHECK(R1(input_layernorm, "input_layernorm.weight", H));
        PD_CHECK(R2(q_proj, "self_attn.q_proj", Q, H));
        PD_CHECK(R2(k_proj, "self_attn.k_proj", KV, H));
        PD_CHECK(R2(v_proj, "self_attn.v_proj", KV, H));
        if (c->qkv_bias) {
            PD_CHECK(R1(q_bias, "self_attn.q_proj.bias", Q));
            PD_CHECK(R1(k_bias, "self_attn.k_proj.bias", KV));
            PD_CHECK(R1(v_bias, "self_attn.v_proj.bias", KV));
        }
        if (c->qk_norm) {
            PD_CHECK(R1(q_norm, "self_attn.q_norm.weight", c->head_dim));
            PD_CHECK(R1(k_norm, "self_attn.k_norm.weight", c->head_dim));
        }
        PD_CHECK(R2(o_proj, "self_attn.o_proj", H, Q));
        if (c->o_bias) PD_CHECK(R1(o_bias, "self_attn.o_proj.bias", H));
        PD_CHECK(R1(post_attention_layernorm, "post_attention_layernorm.weight", H));
        PD_CHECK(R2(gate_proj, "mlp.gate_proj", I, H));
        PD_CHECK(R2(up_proj, "mlp.up_proj", I, H));
        PD_CHECK(R2(down_proj, "mlp.down_proj", H, I));
        bool found;
        PD_CHECK(pd_quant_kv_scales(st, l, &L->k_scale, &L->v_scale, &found));
        w->kv_scales |= found;
#undef R1
#undef R2
    }
    size_t bytes = w->embed_tokens.nbytes + w->norm.nbytes;
    if (!w->lm_head_tied) bytes += w->lm_head.nbytes;
    for (int l = 0; l < (int)c->num_hidden_layers; l++) {
        const pd_layer_weights *L = &w->layers[l];
        bytes += L->input_layernorm.nbytes + L->q_proj.nbytes + L->k_proj.nbytes +
                 L->v_proj.nbytes + L->q_bias.nbytes + L->k_bias.nbytes + L->v_bias.nbytes +
                 L->q_norm.nbytes + L->k_norm.nbytes + L->o_proj.nbytes + L->o_bias.nbytes +
                 L->post_attention_layernorm.nbytes + L->gate_proj.nbytes + L->up_proj.nbytes +
                 L->down_proj.nbytes;
    }
    m->weight_bytes = bytes;
    return PD_OK;
}

int pd_model_load(const char *dir, pd_model **out)
{
    *out = NULL;
    struct stat sb;
    if (stat(dir, &sb) != 0)
        return pd_error(errno == ENOENT ? PD_ENOTFOUND : PD_EIO, "%s: %s", dir, strerror(errno));
    if (!S_ISDIR(sb.st_mode)) return pd_error(PD_EINVAL, "%s: not a directory", dir);
    pd_model *m = calloc(1, sizeof *m);
    if (!m || !(m->dir = strdup(dir))) {
        free(m);
        return pd_error(PD_ENOMEM, "model: out of memory");
    }
    int rc;
    char p[4096];
    snprintf(p, sizeof p, "%s/config.json", dir);
    PD_CHECK_GOTO(pd_model_config_load(p, &m->config), rc, fail);
    m->generation = pd_generation_config_default();
    snprintf(p, sizeof p, "%s/generation_config.json", dir);
    if (stat(p, &sb) == 0) {
        PD_CHECK_GOTO(pd_generation_config_load(p, &m->generation), rc, fail);
        m->has_generation_config = true;
    }
    PD_CHECK_GOTO(pd_st_open(dir, &m->st), rc, fail);
    PD_CHECK_GOTO(resolve_weights(m), rc, fail);
    *out = m;
    return PD_OK;
fail:
    pd_model_free(m);
    return rc;
}

void pd_model_free(pd_model *m)
{
    if (!m) return;
    pd_st_close(m->st);
    free(m->weights.layers);
    free(m->qweights);
    free(m->dir);
    free(m);
}
