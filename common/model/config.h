/* Model configuration: config.json and generation_config.json of a Hugging Face checkpoint,
 * and the RoPE frequencies they imply.
 *
 * Design: one plain struct per file, filled from a default (pd_model_config_default) and then
 * from JSON through common/json getters, so every bad field is reported as
 * "<file>: <field>: <problem>". Fields that Hugging Face derives (head_dim, num_key_value_heads,
 * q/k/v bias for Qwen2, the q/k norms of Qwen3) are resolved here once, so backends read one value
 * and never re-derive. RoPE inverse frequencies follow transformers' ROPE_INIT_FUNCTIONS (default,
 * linear, dynamic, llama3), computed in double precision (transformers computes them in float32;
 * the values agree to float32 rounding).
 */
#ifndef PD_MODEL_CONFIG_H
#define PD_MODEL_CONFIG_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#include "model/dtype.h"
#include "model/quant.h"

/* Enums only grow at the end. */
typedef enum {
    PD_ARCH_LLAMA = 0,
    PD_ARCH_MISTRAL = 1,
    PD_ARCH_QWEN2 = 2,
    PD_ARCH_QWEN3 = 3
} pd_arch;

typedef enum {
    PD_ROPE_NONE = 0,    /* absent, null, or rope_type "default" */
    PD_ROPE_LINEAR = 1,  /* position interpolation: inv_freq / factor */
    PD_ROPE_DYNAMIC = 2, /* dynamic NTK: base grows with the sequence length */
    PD_ROPE_LLAMA3 = 3,  /* Llama 3.1 frequency-band scaling */
} pd_rope_type;

typedef struct {
    pd_rope_type type;
    double factor;                            /* linear/dynamic/llama3; 1.0 when type is NONE */
    double low_freq_factor;                   /* llama3 only */
    double high_freq_factor;                  /* llama3 only */
    int64_t original_max_position_embeddings; /* llama3 only (0 otherwise) */
} pd_rope_scaling;

#define PD_MAX_EOS_IDS 16

typedef struct {
    pd_arch arch;              /* from "architectures"[0], else "model_type" */
    int64_t hidden_size;       /* d_model */
    int64_t intermediate_size; /* MLP width */
    int64_t num_hidden_layers;
    int64_t num_attention_heads;
    int64_t num_key_value_heads; /* default num_attention_heads; divides it */
    int64_t head_dim;            /* default hidden_size / num_attention_heads (Qwen3: 128) */
    double rms_norm_eps;         /* default 1e-6 */
    double rope_theta;           /* default 10000 */
    pd_rope_scaling rope_scaling;
    int64_t max_position_embeddings; /* default 2048 */
    int64_t vocab_size;
    bool tie_word_embeddings; /* default false (Qwen2 small models set true) */
    bool attention_bias;      /* the config field as written (default false) */
    bool qkv_bias;            /* q/k/v_proj carry a bias: attention_bias, or Qwen2 */
    bool o_bias;              /* o_proj carries a bias: attention_bias, except for Qwen2 */
    bool qk_norm;             /* q and k RMS-normed per head before RoPE (Qwen3) */
    bool has_torch_dtype;
    pd_dtype torch_dtype; /* F32 when absent */
    int64_t bos_token_id; /* -1 when absent or null */
    int n_eos_token_ids;  /* 0 when absent; "eos_token_id" may be an int or a list */
    int64_t eos_token_ids[PD_MAX_EOS_IDS];
    int64_t sliding_window; /* 0 when absent/null/disabled; caps the context (pd_model_max_len) */
    pd_quant_config quant;  /* "quantization_config" (method PD_QUANT_NONE when absent) */
} pd_model_config;

/* Llama defaults as transformers' LlamaConfig has them (sizes 0: must come from the file). */
pd_model_config pd_model_config_default(void);

/* Fills *out from a parsed config.json object; what names the source in messages
 * ("dir/config.json"). Validates: positive sizes, heads divisible by kv heads, hidden_act
 * "silu", no mlp_bias, known rope_scaling type with its fields, supported architecture.
 * PD_EINVAL/PD_EUNSUPPORTED with "<what>: <field>: ..." on failure. */
int pd_model_config_from_json(const json_t *root, const char *what, pd_model_config *out);
/* Loads and parses a config.json file (errors name the file). */
int pd_model_config_load(const char *file, pd_model_config *out);
/* A config.json object for cfg (new reference, NULL on out of memory): architectures,
 * model_type, torch_dtype, hidden_act and every field above. Used by pd-mkmodel. */
json_t *pd_model_config_to_json(const pd_model_config *cfg);

/* The longest context the model is served at: max_position_embeddings, and at most
 * sliding_window where the config sets one, because pdserve attends over the whole context (as
 * vLLM does with --disable-sliding-window), which equals the model's sliding-window attention
 * only up to the window. *key (may be NULL) names the limiting config.json field. */
int64_t pd_model_max_len(const pd_model_config *cfg, const char **key);
/* --max-model-len against the model, the same on every role: 0 becomes pd_model_max_len; a
 * larger value is refused with vLLM's message. */
int pd_model_resolve_max_len(const pd_model_config *cfg, int64_t *max_model_len);

/* "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM". */
const char *pd_arch_name(pd_arch arch);
/* "llama", "mistral", "qwen2", "qwen3". */
const char *pd_arch_model_type(pd_arch arch);
/* The model_type names, for messages. */
#define PD_MODEL_TYPES "llama, mistral, qwen2, qwen3"
/* The architecture of a model_type (one of PD_MODEL_TYPES): PD_OK, else PD_EUNSUPPORTED (no
 * message set). */
int pd_arch_from_model_type(const char *model_type, pd_arch *out);
/* "default", "linear", "dynamic", "llama3". */
const char *pd_rope_type_name(pd_rope_type t);

/* RoPE inverse frequencies for head_dim/2 rotary pairs (rotate_half convention: pair i is
 * dimensions i and i + head_dim/2; angle = position * inv_freq[i]) and the attention scaling
 * applied to cos/sin (1.0 for the four supported types). seq_len is the current sequence length
 * (largest position + 1); only PD_ROPE_DYNAMIC depends on it (transformers uses
 * max(seq_len, max_position_embeddings)). inv_freq: (head_dim/2,) doubles, caller-provided.
 * attention_scaling may be NULL. */
int pd_rope_inv_freq(const pd_model_config *cfg, int64_t seq_len, double *inv_freq,
                     double *attention_scaling);

/* generation_config.json: every field optional; has_* says whether the file set it. */
typedef struct {
    bool has_do_sample;
    bool do_sample;
    bool has_temperature;
    double temperature;
    bool has_top_p;
    double top_p;
    bool has_top_k;
    int64_t top_k;
    bool has_min_p;
    double min_p;
    bool has_repetition_penalty;
    double repetition_penalty;
    bool has_max_new_tokens;
    int64_t max_new_tokens;
    bool has_bos_token_id;
    int64_t bos_token_id;
    bool has_pad_token_id;
    int64_t pad_token_id;
    int n_eos_token_ids; /* 0: absent; an int or a list in the file */
    int64_t eos_token_ids[PD_MAX_EOS_IDS];
} pd_generation_config;

/* Every field absent. */
pd_generation_config pd_generation_config_default(void);
int pd_generation_config_from_json(const json_t *root, const char *what, pd_generation_config *out);
/* Loads a generation_config.json file (errors name the file). */
int pd_generation_config_load(const char *file, pd_generation_config *out);

#endif
