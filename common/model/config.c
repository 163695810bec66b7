/* config.json / generation_config.json parsing and RoPE frequencies (see config.h).
 *
 * Defaults follow transformers' LlamaConfig, MistralConfig, Qwen2Config and Qwen3Config so that a
 * file that leaves a field out means what it means to Hugging Face. Every getter error is prefixed
 * with the file name, giving "<file>: <field>: <problem>".
 */
#include "model/config.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "json/json.h"
#include "util/status.h"

static const struct {
    const char *arch_name;
    const char *model_type;
    pd_arch arch;
} k_archs[] = {
    {"LlamaForCausalLM", "llama", PD_ARCH_LLAMA},
    {"MistralForCausalLM", "mistral", PD_ARCH_MISTRAL},
    {"Qwen2ForCausalLM", "qwen2", PD_ARCH_QWEN2},
    {"Qwen3ForCausalLM", "qwen3", PD_ARCH_QWEN3},
};
#define N_ARCHS (sizeof k_archs / sizeof k_archs[0])

const char *pd_arch_name(pd_arch arch)
{
    for (size_t i = 0; i < N_ARCHS; i++)
        if (k_archs[i].arch == arch) return k_archs[i].arch_name;
    return "?";
}

const char *pd_arch_model_type(pd_arch arch)
{
    for (size_t i = 0; i < N_ARCHS; i++)
        if (k_archs[i].arch == arch) return k_archs[i].model_type;
    return "?";
}

const char *pd_rope_type_name(pd_rope_type t)
{
    switch (t) {
    case PD_ROPE_NONE: return "default";
    case PD_ROPE_LINEAR: return "linear";
    case PD_ROPE_DYNAMIC: return "dynamic";
    case PD_ROPE_LLAMA3: return "llama3";
    }
    return "?";
}

pd_model_config pd_model_config_default(void)
{
    pd_model_config c;
    memset(&c, 0, sizeof c);
    c.arch = PD_ARCH_LLAMA;
    c.rms_norm_eps = 1e-6;
    c.rope_theta = 10000.0;
    c.rope_scaling.type = PD_ROPE_NONE;
    c.rope_scaling.factor = 1.0;
    c.max_position_embeddings = 2048;
    c.torch_dtype = PD_DTYPE_F32;
    c.bos_token_id = 1;
    c.n_eos_token_ids = 1;
    c.eos_token_ids[0] = 2;
    return c;
}

/* Reads "eos_token_id": an int, a list of ints, or null/absent (n = 0). */
static int get_id_list(const json_t *root, const char *key, int64_t *ids, int *n)
{
    json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) {
        *n = 0;
        return 0;
    }
    if (json_is_array(v)) {
        size_t cnt = json_array_size(v);
        if (cnt > PD_MAX_EOS_IDS)
            return pd_error(PD_EINVAL, "%s: at most %d ids supported, got %zu", key, PD_MAX_EOS_IDS,
                            cnt);
        for (size_t i = 0; i < cnt; i++) {
            char p[64];
            pdj_path_index(p, sizeof p, key, i);
            PD_CHECK(pdj_as_int(json_array_get(v, i), p, &ids[i]));
            if (ids[i] < 0)
                return pd_error(PD_EINVAL, "%s: must be >= 0, got %lld", p, (long long)ids[i]);
        }
        *n = (int)cnt;
        return 1;
    }
    PD_CHECK(pdj_as_int(v, key, &ids[0]));
    if (ids[0] < 0)
        return pd_error(PD_EINVAL, "%s: must be >= 0, got %lld", key, (long long)ids[0]);
    *n = 1;
    return 1;
}

int pd_arch_from_model_type(const char *model_type, pd_arch *out)
{
    for (size_t i = 0; i < N_ARCHS; i++) {
        if (strcmp(model_type, k_archs[i].model_type) == 0) {
            *out = k_archs[i].arch;
            return PD_OK;
        }
    }
    return PD_EUNSUPPORTED;
}

static int parse_arch(const json_t *root, pd_arch *out)
{
    json_t *archs = NULL;
    PD_CHECK(pdj_get_array(root, "", "architectures", PDJ_NULL_IS_ABSENT, &archs));
    if (archs && json_array_size(archs) > 0) {
        const char *name;
        PD_CHECK(pdj_as_string(json_array_get(archs, 0), "architectures[0]", &name));
        for (size_t i = 0; i < N_ARCHS; i++) {
            if (strcmp(name, k_archs[i].arch_name) == 0) {
                *out = k_archs[i].arch;
                return PD_OK;
            }
        }
        return pd_error(PD_EUNSUPPORTED,
                        "architectures[0]: unsupported architecture \"%s\" (supported: "
                        "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)",
                        name);
    }
    const char *mt = NULL;
    int rc = pdj_get_string(root, "", "model_type", PDJ_NULL_IS_ABSENT, &mt);
    PD_CHECK(rc);
    if (rc == 0) return pd_error(PD_EINVAL, "architectures: required (or model_type)");
    if (pd_arch_from_model_type(mt, out) == PD_OK) return PD_OK;
    return pd_error(PD_EUNSUPPORTED, "model_type: unsupported model type \"%s\" (supported: %s)",
                    mt, PD_MODEL_TYPES);
}

static int parse_rope_scaling(const json_t *root, pd_rope_scaling *rs)
{
    json_t *o = NULL;
    PD_CHECK(pdj_get_object(root, "", "rope_scaling", PDJ_NULL_IS_ABSENT, &o));
    rs->type = PD_ROPE_NONE;
    rs->factor = 1.0;
    rs->low_freq_factor = 0;
    rs->high_freq_factor = 0;
    rs->original_max_position_embeddings = 0;
    if (!o) return PD_OK;
    /* transformers accepts the legacy key "type" for "rope_type" */
    const char *t = NULL;
    int rc = pdj_get_string(o, "rope_scaling", "rope_type", PDJ_NULL_IS_ABSENT, &t);
    PD_CHECK(rc);
    if (rc == 0) {
        rc = pdj_get_string(o, "rope_scaling", "type", PDJ_NULL_IS_ABSENT, &t);
        PD_CHECK(rc);
        if (rc == 0) return pd_error(PD_EINVAL, "rope_scaling.rope_type: required");
    }
    if (strcmp(t, "default") == 0) return PD_OK;
    if (strcmp(t, "linear") == 0)
        rs->type = PD_ROPE_LINEAR;
    else if (strcmp(t, "dynamic") == 0)
        rs->type = PD_ROPE_DYNAMIC;
    else if (strcmp(t, "llama3") == 0)
        rs->type = PD_ROPE_LLAMA3;
    else
        return pd_error(PD_EUNSUPPORTED,
                        "rope_scaling.rope_type: unsupported \"%s\" (supported: default, linear, "
                        "dynamic, llama3)",
                        t);
    PD_CHECK(
        pdj_get_double_range(o, "rope_scaling", "factor", PDJ_REQUIRED, 1e-6, 1e6, &rs->factor));
    if (rs->type == PD_ROPE_LLAMA3) {
        PD_CHECK(pdj_get_double_range(o, "rope_scaling", "low_freq_factor", PDJ_REQUIRED, 1e-9, 1e9,
                                      &rs->low_freq_factor));
        PD_CHECK(pdj_get_double_range(o, "rope_scaling", "high_freq_factor", PDJ_REQUIRED, 1e-9,
                                      1e9, &rs->high_freq_factor));
        if (!(rs->high_freq_factor > rs->low_freq_factor))
            return pd_error(PD_EINVAL,
                            "rope_scaling.high_freq_factor: must be greater than "
                            "low_freq_factor (%g <= %g)",
                            rs->high_freq_factor, rs->low_freq_factor);
        PD_CHECK(pdj_get_int_range(o, "rope_scaling", "original_max_position_embeddings",
                                   PDJ_REQUIRED, 1, INT64_C(1) << 32,
                                   &rs->original_max_position_embeddings));
    }
    return PD_OK;
}

static int config_parse(const json_t *root, pd_model_config *out)
{
    if (!json_is_object(root))
        return pd_error(PD_EINVAL, "expected a JSON object, got %s", pdj_type_name(root));
    pd_model_config c = pd_model_config_default();
    PD_CHECK(parse_arch(root, &c.arch));
    if (c.arch == PD_ARCH_MISTRAL) c.max_position_embeddings = 4096 * 32;
    const bool qwen = c.arch == PD_ARCH_QWEN2 || c.arch == PD_ARCH_QWEN3;
    if (qwen) {
        c.max_position_embeddings = 32768;
        c.bos_token_id = -1;
        c.n_eos_token_ids = 0;
    }
    const int R = PDJ_REQUIRED, O = PDJ_NULL_IS_ABSENT;
    const int64_t big = INT64_C(1) << 24;
    PD_CHECK(pdj_get_int_range(root, "", "hidden_size", R, 1, big, &c.hidden_size));
    PD_CHECK(pdj_get_int_range(root, "", "intermediate_size", R, 1, big, &c.intermediate_size));
    PD_CHECK(pdj_get_int_range(root, "", "num_hidden_layers", R, 1, 4096, &c.num_hidden_layers));
    PD_CHECK(
        pdj_get_int_range(root, "", "num_attention_heads", R, 1, 65536, &c.num_attention_heads));
    c.num_key_value_heads = c.arch == PD_ARCH_MISTRAL ? 8 : c.num_attention_heads;
    PD_CHECK(
        pdj_get_int_range(root, "", "num_key_value_heads", O, 1, 65536, &c.num_key_value_heads));
    if (c.num_attention_heads % c.num_key_value_heads != 0)
        return pd_error(PD_EINVAL,
                        "num_key_value_heads: %lld does not divide num_attention_heads %lld",
                        (long long)c.num_key_value_heads, (long long)c.num_attention_heads);
    int rc = pdj_get_int_range(root, "", "head_dim", O, 2, 65536, &c.head_dim);
    PD_CHECK(rc);
    if (rc == 0 && c.arch == PD_ARCH_QWEN3) {
        c.head_dim = 128; /* Qwen3Config's default */
    } else if (rc == 0) {
        if (c.hidden_size % c.num_attention_heads != 0)
            return pd_error(PD_EINVAL,
                            "head_dim: absent and hidden_size %lld is not a multiple of "
                            "num_attention_heads %lld",
                            (long long)c.hidden_size, (long long)c.num_attention_heads);
        c.head_dim = c.hidden_size / c.num_attention_heads;
    }
    if (c.head_dim % 2 != 0)
        return pd_error(PD_EINVAL, "head_dim: must be even for rotary embeddings, got %lld",
                        (long long)c.head_dim);
    PD_CHECK(pdj_get_double_range(root, "", "rms_norm_eps", O, 1e-30, 1.0, &c.rms_norm_eps));
    PD_CHECK(pdj_get_double_range(root, "", "rope_theta", O, 1e-6, 1e30, &c.rope_theta));
    PD_CHECK(pdj_get_int_range(root, "", "max_position_embeddings", O, 1, INT64_C(1) << 32,
                               &c.max_position_embeddings));
    PD_CHECK(pdj_get_int_range(root, "", "vocab_size", R, 1, big, &c.vocab_size));
    PD_CHECK(pdj_get_bool(root, "", "tie_word_embeddings", O, &c.tie_word_embeddings));
    PD_CHECK(pdj_get_bool(root, "", "attention_bias", O, &c.attention_bias));
    c.qkv_bias = c.attention_bias || c.arch == PD_ARCH_QWEN2;
    c.o_bias = c.attention_bias && c.arch != PD_ARCH_QWEN2;
    c.qk_norm = c.arch == PD_ARCH_QWEN3;
    bool mlp_bias = false;
    PD_CHECK(pdj_get_bool(root, "", "mlp_bias", O, &mlp_bias));
    if (mlp_bias) return pd_error(PD_EUNSUPPORTED, "mlp_bias: true is not supported");
    const char *act = NULL;
    PD_CHECK(pdj_get_string(root, "", "hidden_act", O, &act));
    if (act && strcmp(act, "silu") != 0)
        return pd_error(PD_EUNSUPPORTED, "hidden_act: unsupported \"%s\" (only silu)", act);
    const char *dt = NULL;
    rc = pdj_get_string(root, "", "torch_dtype", O, &dt);
    PD_CHECK(rc);
    const char *dt_key = "torch_dtype";
    if (rc == 0) {
        dt_key = "dtype"; /* newer transformers write "dtype" */
        rc = pdj_get_string(root, "", "dtype", O, &dt);
        PD_CHECK(rc);
    }
    if (rc == 1) {
        if (pd_dtype_parse(dt, &c.torch_dtype) < 0)
            return pd_error(PD_EUNSUPPORTED,
                            "%s: unsupported \"%s\" (expected float32, float16 or bfloat16)",
                            dt_key, dt);
        c.has_torch_dtype = true;
    }
    int64_t bos = -1;
    rc = pdj_get_int_range(root, "", "bos_token_id", O, 0, big, &bos);
    PD_CHECK(rc);
    if (rc == 1)
        c.bos_token_id = bos;
    else if (json_is_null(json_object_get(root, "bos_token_id")))
        c.bos_token_id = -1;
    if (json_object_get(root, "eos_token_id"))
        PD_CHECK(get_id_list(root, "eos_token_id", c.eos_token_ids, &c.n_eos_token_ids));
    PD_CHECK(parse_rope_scaling(root, &c.rope_scaling));
    /* sliding_window: Mistral applies it when set; Qwen2/3 only with use_sliding_window */
    int64_t sw = 0;
    PD_CHECK(pdj_get_int_range(root, "", "sliding_window", O, 0, INT64_C(1) << 32, &sw));
    bool use_sw = !qwen;
    PD_CHECK(pdj_get_bool(root, "", "use_sliding_window", O, &use_sw));
    c.sliding_window = use_sw ? sw : 0;
    PD_CHECK(pd_quant_config_parse(json_object_get(root, "quantization_config"), &c.quant));
    *out = c;
    return PD_OK;
}

int64_t pd_model_max_len(const pd_model_config *c, const char **key)
{
    bool window = c->sliding_window > 0 && c->sliding_window < c->max_position_embeddings;
    if (key) *key = window ? "sliding_window" : "max_position_embeddings";
    return window ? c->sliding_window : c->max_position_embeddings;
}

int pd_model_resolve_max_len(const pd_model_config *c, int64_t *max_model_len)
{
    const char *key;
    const int64_t derived = pd_model_max_len(c, &key);
    if (*max_model_len == 0) *max_model_len = derived;
    if (*max_model_len > derived)
        return pd_error(PD_EINVAL,
                        "User-specified max_model_len (%lld) is greater than the derived "
                        "max_model_len (%s=%lld in model's config.json%s). This may lead to "
                        "incorrect model outputs or CUDA errors.",
                        (long long)*max_model_len, key, (long long)derived,
                        derived < c->max_position_embeddings
                            ? "; attention is not windowed here, so the context stops at the "
                              "window"
                            : "");
    return PD_OK;
}

int pd_model_config_from_json(const json_t *root, const char *what, pd_model_config *out)
{
    int rc = config_parse(root, out);
    if (rc < 0) return pd_error_prefix(rc, "%s", what);
    return PD_OK;
}

int pd_model_config_load(const char *file, pd_model_config *out)
{
    json_t *root = NULL;
    PD_CHECK(pdj_load_file(file, &root));
    int rc = pd_model_config_from_json(root, file, out);
    json_decref(root);
    return rc;
}

static json_t *id_list_json(const int64_t *ids, int n)
{
    if (n == 0) return json_null();
    if (n == 1) return json_integer(ids[0]);
    json_t *a = json_array();
    for (int i = 0; a && i < n; i++) json_array_append_new(a, json_integer(ids[i]));
    return a;
}

json_t *pd_model_config_to_json(const pd_model_config *c)
{
    json_t *o = json_object();
    if (!o) return NULL;
    json_t *archs = json_array();
    json_array_append_new(archs, json_string(pd_arch_name(c->arch)));
    json_object_set_new(o, "architectures", archs);
    json_object_set_new(o, "model_type", json_string(pd_arch_model_type(c->arch)));
    json_object_set_new(o, "attention_bias", json_boolean(c->attention_bias));
    json_object_set_new(o, "bos_token_id",
                        c->bos_token_id >= 0 ? json_integer(c->bos_token_id) : json_null());
    json_object_set_new(o, "eos_token_id", id_list_json(c->eos_token_ids, c->n_eos_token_ids));
    json_object_set_new(o, "head_dim", json_integer(c->head_dim));
    json_object_set_new(o, "hidden_act", json_string("silu"));
    json_object_set_new(o, "hidden_size", json_integer(c->hidden_size));
    json_object_set_new(o, "intermediate_size", json_integer(c->intermediate_size));
    json_object_set_new(o, "max_position_embeddings", json_integer(c->max_position_embeddings));
    json_object_set_new(o, "num_attention_heads", json_integer(c->num_attention_heads));
    json_object_set_new(o, "num_hidden_layers", json_integer(c->num_hidden_layers));
    json_object_set_new(o, "num_key_value_heads", json_integer(c->num_key_value_heads));
    json_object_set_new(o, "rms_norm_eps", json_real(c->rms_norm_eps));
    json_object_set_new(o, "rope_theta", json_real(c->rope_theta));
    if (c->rope_scaling.type == PD_ROPE_NONE) {
        json_object_set_new(o, "rope_scaling", json_null());
    } else {
        json_t *rs = json_object();
        json_object_set_new(rs, "rope_type", json_string(pd_rope_type_name(c->rope_scaling.type)));
        json_object_set_new(rs, "factor", json_real(c->rope_scaling.factor));
        if (c->rope_scaling.type == PD_ROPE_LLAMA3) {
            json_object_set_new(rs, "low_freq_factor", json_real(c->rope_scaling.low_freq_factor));
            json_object_set_new(rs, "high_freq_factor",
                                json_real(c->rope_scaling.high_freq_factor));
            json_object_set_new(rs, "original_max_position_embeddings",
                                json_integer(c->rope_scaling.original_max_position_embeddings));
        }
        json_object_set_new(o, "rope_scaling", rs);
    }
    if (c->arch == PD_ARCH_QWEN2 || c->arch == PD_ARCH_QWEN3) {
        json_object_set_new(o, "use_sliding_window", json_boolean(c->sliding_window > 0));
        json_object_set_new(o, "sliding_window",
                            c->sliding_window > 0 ? json_integer(c->sliding_window) : json_null());
    } else if (c->arch == PD_ARCH_MISTRAL) {
        json_object_set_new(o, "sliding_window",
                            c->sliding_window > 0 ? json_integer(c->sliding_window) : json_null());
    }
    json_object_set_new(o, "tie_word_embeddings", json_boolean(c->tie_word_embeddings));
    json_object_set_new(o, "torch_dtype", json_string(pd_dtype_name(c->torch_dtype)));
    json_object_set_new(o, "transformers_version", json_string("4.46.0"));
    json_object_set_new(o, "use_cache", json_true());
    json_object_set_new(o, "vocab_size", json_integer(c->vocab_size));
    return o;
}

int pd_rope_inv_freq(const pd_model_config *cfg, int64_t seq_len, double *inv_freq,
                     double *attention_scaling)
{
    const int64_t dim = cfg->head_dim;
    if (dim < 2 || dim % 2 != 0)
        return pd_error(PD_EINVAL, "rope: head_dim must be even and >= 2, got %lld",
                        (long long)dim);
    const pd_rope_scaling *rs = &cfg->rope_scaling;
    double base = cfg->rope_theta;
    if (rs->type == PD_ROPE_DYNAMIC) {
        /* transformers _compute_dynamic_ntk_parameters: seq_len = max(seq_len, max_pos) */
        double mp = (double)cfg->max_position_embeddings;
        double sl = seq_len > cfg->max_position_embeddings ? (double)seq_len : mp;
        base =
            base * pow(rs->factor * sl / mp - (rs->factor - 1.0), (double)dim / (double)(dim - 2));
    }
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i++) inv_freq[i] = 1.0 / pow(base, (double)(2 * i) / (double)dim);
    if (rs->type == PD_ROPE_LINEAR) {
        for (int64_t i = 0; i < half; i++) inv_freq[i] /= rs->factor;
    } else if (rs->type == PD_ROPE_LLAMA3) {
        /* transformers _compute_llama3_parameters */
        const double old_ctx = (double)rs->original_max_position_embeddings;
        const double low_wl = old_ctx / rs->low_freq_factor;
        const double high_wl = old_ctx / rs->high_freq_factor;
        for (int64_t i = 0; i < half; i++) {
            double f = inv_freq[i];
            double wl = 2.0 * M_PI / f;
            double scaled = wl > low_wl ? f / rs->factor : f;
            if (!(wl < high_wl) && !(wl > low_wl)) {
                double smooth = (old_ctx / wl - rs->low_freq_factor) /
                                (rs->high_freq_factor - rs->low_freq_factor);
                scaled = (1.0 - smooth) * scaled / rs->factor + smooth * scaled;
            }
            inv_freq[i] = scaled;
        }
    }
    if (attention_scaling) *attention_scaling = 1.0;
    return PD_OK;
}

pd_generation_config pd_generation_config_default(void)
{
    pd_generation_config g;
    memset(&g, 0, sizeof g);
    return g;
}

#define GEN_OPT(getter, key, field, ...)                                                           \
    do {                                                                                           \
        int r_ = getter(root, "", key, PDJ_NULL_IS_ABSENT, __VA_ARGS__ & g.field);                 \
        PD_CHECK(r_);                                                                              \
        g.has_##field = r_ == 1;                                                                   \
    } while (0)

static int gen_parse(const json_t *root, pd_generation_config *out)
{
    if (!json_is_object(root))
        return pd_error(PD_EINVAL, "expected a JSON object, got %s", pdj_type_name(root));
    pd_generation_config g = pd_generation_config_default();
    GEN_OPT(pdj_get_bool, "do_sample", do_sample, );
    GEN_OPT(pdj_get_double_range, "temperature", temperature, 0.0, 1e6, );
    GEN_OPT(pdj_get_double_range, "top_p", top_p, 0.0, 1.0, );
    GEN_OPT(pdj_get_int_range, "top_k", top_k, -1, INT64_C(1) << 31, );
    GEN_OPT(pdj_get_double_range, "min_p", min_p, 0.0, 1.0, );
    GEN_OPT(pdj_get_double_range, "repetition_penalty", repetition_penalty, 1e-6, 1e6, );
    GEN_OPT(pdj_get_int_range, "max_new_tokens", max_new_tokens, 0, INT64_C(1) << 40, );
    GEN_OPT(pdj_get_int_range, "bos_token_id", bos_token_id, 0, INT64_C(1) << 31, );
    GEN_OPT(pdj_get_int_range, "pad_token_id", pad_token_id, 0, INT64_C(1) << 31, );
    PD_CHECK(get_id_list(root, "eos_token_id", g.eos_token_ids, &g.n_eos_token_ids));
    *out = g;
    return PD_OK;
}

int pd_generation_config_from_json(const json_t *root, const char *what, pd_generation_config *out)
{
    int rc = gen_parse(root, out);
    if (rc < 0) return pd_error_prefix(rc, "%s", what);
    return PD_OK;
}

int pd_generation_config_load(const char *file, pd_generation_config *out)
{
    json_t *root = NULL;
    PD_CHECK(pdj_load_file(file, &root));
    int rc = pd_generation_config_from_json(root, file, out);
    json_decref(root);
    return rc;
}
