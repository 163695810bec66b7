/* A loaded Llama-family checkpoint (Llama 2/3, Mistral, Qwen2, Qwen3, TinyLlama): its configuration
 * and every decoder weight resolved by its Hugging Face name into a pd_tensor view.
 *
 * Design: loading checks every tensor the architecture needs (presence, dtype, shape) once, so
 * a backend walks pd_model_weights without a single lookup or check of its own. Weights stay as
 * stored, mmapped, in any of F32/F16/BF16 (one dtype per tensor; they may differ between
 * tensors); converting or repacking them is the backend's choice. In a quantized checkpoint
 * (config.quant) the seven linears of each layer are pd_tensors standing for their quantized
 * tensors (pd_tensor.quant, model/quant.h) unless its ignore list names them. Unlike most pdserve
 * structs pd_model is readable: backends iterate its weights directly. It is immutable after load
 * and may be read from any number of threads.
 *
 * Shapes below use H = hidden_size, I = intermediate_size, V = vocab_size, D = head_dim,
 * Nq = num_attention_heads, Nkv = num_key_value_heads; (rows, cols) row-major, i.e. a
 * projection y = W x has W of shape (out, in) as PyTorch's nn.Linear stores it.
 */
#ifndef PD_MODEL_MODEL_H
#define PD_MODEL_MODEL_H

#include <stdbool.h>
#include <stddef.h>

#include "model/config.h"
#include "model/safetensors.h"

typedef struct {
    pd_tensor input_layernorm; /* (H)         model.layers.{i}.input_layernorm.weight */
    pd_tensor q_proj;          /* (Nq*D, H)   model.layers.{i}.self_attn.q_proj.weight */
    pd_tensor k_proj;          /* (Nkv*D, H)  ...self_attn.k_proj.weight */
    pd_tensor v_proj;          /* (Nkv*D, H)  ...self_attn.v_proj.weight */
    pd_tensor q_bias;          /* (Nq*D)      ...q_proj.bias   when config.qkv_bias */
    pd_tensor k_bias;          /* (Nkv*D)     ...k_proj.bias   when config.qkv_bias */
    pd_tensor v_bias;          /* (Nkv*D)     ...v_proj.bias   when config.qkv_bias */
    pd_tensor q_norm;          /* (D)         ...self_attn.q_norm.weight when config.qk_norm */
    pd_tensor k_norm;          /* (D)         ...self_attn.k_norm.weight when config.qk_norm */
    pd_tensor o_proj;          /* (H, Nq*D)   ...self_attn.o_proj.weight */
    pd_tensor o_bias;          /* (H)         ...o_proj.bias   when config.o_bias */
    pd_tensor post_attention_layernorm; /* (H)         ...post_attention_layernorm.weight */
    pd_tensor gate_proj;                /* (I, H)      ...mlp.gate_proj.weight */
    pd_tensor up_proj;                  /* (I, H)      ...mlp.up_proj.weight */
    pd_tensor down_proj;                /* (H, I)      ...mlp.down_proj.weight */
    float k_scale, v_scale; /* the fp8 KV cache's scales, ...self_attn.k_scale / v_scale (or
                               their older names, pd_quant_kv_scales); 1 when not stored */
} pd_layer_weights;
/* An absent bias or norm is a zeroed pd_tensor (data == NULL). */

typedef struct {
    pd_tensor embed_tokens;   /* (V, H)  model.embed_tokens.weight */
    pd_layer_weights *layers; /* (num_hidden_layers) */
    pd_tensor norm;           /* (H)     model.norm.weight (final RMSNorm) */
    pd_tensor lm_head;        /* (V, H)  lm_head.weight; a copy of embed_tokens' view when tied */
    bool kv_scales;           /* some layer's KV cache scales were stored */
    bool lm_head_tied;        /* lm_head is embed_tokens (config.tie_word_embeddings) */
} pd_model_weights;

typedef struct pd_model {
    char *dir; /* the directory given to pd_model_load (owned) */
    pd_model_config config;
    bool has_generation_config;      /* generation_config.json was present */
    pd_generation_config generation; /* all fields absent when the file is not there */
    pd_model_weights weights;
    size_t weight_bytes;  /* sum of nbytes of the distinct tensors above */
    pd_st *st;            /* owns the mappings the tensor views point into */
    pd_qweight *qweights; /* the quantized linears the weights' pd_tensor.quant point at */
    size_t n_qweights;
} pd_model;

/* Loads dir/config.json, dir/generation_config.json (optional), and the safetensors in dir
 * (model.safetensors or model.safetensors.index.json with its shards), and resolves every weight.
 * A missing tensor or a shape mismatch fails with PD_ENOTFOUND/PD_EINVAL naming the file, the
 * tensor, and the expected vs actual shape. With tie_word_embeddings false and no lm_head.weight
 * the load fails; with it true, a stored lm_head.weight is ignored and lm_head = embed_tokens. */
int pd_model_load(const char *dir, pd_model **out);
void pd_model_free(pd_model *m);

/* Number of parameters of a config (embedding counted once when tied, twice when not). */
int64_t pd_model_param_count(const pd_model_config *cfg);

#endif
