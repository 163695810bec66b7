/* Unit tests of config.json (real model families in tests/data/model, variants, errors that
 * name the file and the field, the JSON round trip), RoPE frequencies against the reference,
 * and generation_config.json. */
#include <stdio.h>
#include <string.h>

#include "model_common.h"
#include "json/json.h"
#include "model/config.h"
#include "model/model.h"

static const char *data_path(const char *name)
{
    static char buf[4][4096];
    static int k;
    char *b = buf[k++ % 4];
    snprintf(b, sizeof buf[0], "%s/model/%s", pdt_data_dir(), name);
    return b;
}

static int parse_config_text(const char *text, pd_model_config *c)
{
    json_t *root = NULL;
    int rc = pdj_loads(text, strlen(text), "inline", &root);
    if (rc < 0) return rc;
    rc = pd_model_config_from_json(root, "test/config.json", c);
    json_decref(root);
    return rc;
}

/* ---- config.json -------------------------------------------------------------------------- */

TEST(config_llama2)
{
    pd_model_config c;
    ASSERT_OK(pd_model_config_load(data_path("llama2-7b.config.json"), &c));
    ASSERT_EQ_INT(c.arch, PD_ARCH_LLAMA);
    ASSERT_EQ_INT(c.hidden_size, 4096);
    ASSERT_EQ_INT(c.intermediate_size, 11008);
    ASSERT_EQ_INT(c.num_hidden_layers, 32);
    ASSERT_EQ_INT(c.num_attention_heads, 32);
    ASSERT_EQ_INT(c.num_key_value_heads, 32);
    ASSERT_EQ_INT(c.head_dim, 128);
    ASSERT_NEAR(c.rms_norm_eps, 1e-5, 1e-12);
    ASSERT_NEAR(c.rope_theta, 10000.0, 0);
    ASSERT_EQ_INT(c.rope_scaling.type, PD_ROPE_NONE);
    ASSERT_EQ_INT(c.max_position_embeddings, 4096);
    ASSERT_EQ_INT(c.vocab_size, 32000);
    ASSERT(!c.tie_word_embeddings && !c.attention_bias && !c.qkv_bias && !c.o_bias);
    ASSERT(c.has_torch_dtype);
    ASSERT_EQ_INT(c.torch_dtype, PD_DTYPE_F16);
    ASSERT_EQ_INT(c.bos_token_id, 1);
    ASSERT_EQ_INT(c.n_eos_token_ids, 1);
    ASSERT_EQ_INT(c.eos_token_ids[0], 2);
    ASSERT_EQ_INT(c.sliding_window, 0);
}

TEST(config_llama31_rope_llama3_eos_list)
{
    pd_model_config c;
    ASSERT_OK(pd_model_config_load(data_path("llama3.1-8b-instruct.config.json"), &c));
    ASSERT_EQ_INT(c.num_key_value_heads, 8);
    ASSERT_EQ_INT(c.head_dim, 128);
    ASSERT_NEAR(c.rope_theta, 500000.0, 0);
    ASSERT_EQ_INT(c.rope_scaling.type, PD_ROPE_LLAMA3);
    ASSERT_NEAR(c.rope_scaling.factor, 8.0, 0);
    ASSERT_NEAR(c.rope_scaling.low_freq_factor, 1.0, 0);
    ASSERT_NEAR(c.rope_scaling.high_freq_factor, 4.0, 0);
    ASSERT_EQ_INT(c.rope_scaling.original_max_position_embeddings, 8192);
    ASSERT_EQ_INT(c.max_position_embeddings, 131072);
    ASSERT_EQ_INT(c.vocab_size, 128256);
    ASSERT_EQ_INT(c.torch_dtype, PD_DTYPE_BF16);
    ASSERT_EQ_INT(c.bos_token_id, 128000);
    ASSERT_EQ_INT(c.n_eos_token_ids, 3);
    ASSERT_EQ_INT(c.eos_token_ids[0], 128001);
    ASSERT_EQ_INT(c.eos_token_ids[1], 128008);
    ASSERT_EQ_INT(c.eos_token_ids[2], 128009);
}

TEST(config_mistral_and_nemo_head_dim)
{
    pd_model_config c;
    ASSERT_OK(pd_model_config_load(data_path("mistral-7b-v0.1.config.json"), &c));
    ASSERT_EQ_INT(c.arch, PD_ARCH_MISTRAL);
    ASSERT_EQ_INT(c.num_key_value_heads, 8);
    ASSERT_EQ_INT(c.head_dim, 128);
    ASSERT_EQ_INT(c.sliding_window, 4096);
    ASSERT_EQ_INT(c.max_position_embeddings, 32768);
    const char *key;
    ASSERT_EQ_INT(pd_model_max_len(&c, &key), 4096); /* full attention equals the window's */
    ASSERT_STR_EQ(key, "sliding_window");
    ASSERT_OK(pd_model_config_load(data_path("mistral-nemo.config.json"), &c));
    ASSERT_EQ_INT(c.hidden_size, 5120);
    ASSERT_EQ_INT(c.head_dim, 128); /* not 5120 / 32 = 160 */
    ASSERT_EQ_INT(c.sliding_window, 0);
    ASSERT_NEAR(c.rope_theta, 1e6, 0);
    ASSERT_EQ_INT(pd_model_max_len(&c, &key), c.max_position_embeddings);
    ASSERT_STR_EQ(key, "max_position_embeddings");
}

TEST(config_qwen25_bias_tied)
{
    pd_model_config c;
    ASSERT_OK(pd_model_config_load(data_path("qwen2.5-0.5b-instruct.config.json"), &c));
    ASSERT_EQ_INT(c.arch, PD_ARCH_QWEN2);
    ASSERT(!c.attention_bias);
    ASSERT(c.qkv_bias); /* Qwen2 always has q/k/v biases */
    ASSERT(!c.o_bias);
    ASSERT(c.tie_word_embeddings);
    ASSERT_EQ_INT(c.head_dim, 64);
    ASSERT_EQ_INT(c.num_key_value_heads, 2);
    ASSERT_EQ_INT(c.sliding_window, 0); /* use_sliding_window false */
    ASSERT_EQ_INT(c.bos_token_id, 151643);
    ASSERT_EQ_INT(c.n_eos_token_ids, 1);
    ASSERT_EQ_INT(c.eos_token_ids[0], 151645);
    ASSERT_NEAR(c.rms_norm_eps, 1e-6, 1e-15);
}

TEST(config_qwen3_qk_norm)
{
    pd_model_config c;
    ASSERT_OK(pd_model_config_load(data_path("qwen3-0.6b.config.json"), &c));
    ASSERT_EQ_INT(c.arch, PD_ARCH_QWEN3);
    ASSERT(c.qk_norm);
    ASSERT(!c.attention_bias && !c.qkv_bias && !c.o_bias); /* no q/k/v biases, unlike Qwen2 */
    ASSERT_EQ_INT(c.head_dim, 128);                        /* not 1024 / 16 = 64 */
    ASSERT_EQ_INT(c.num_key_value_heads, 8);
    ASSERT_EQ_INT(c.max_position_embeddings, 40960);
    ASSERT_EQ_INT(c.sliding_window, 0); /* use_sliding_window false */
    ASSERT(c.tie_word_embeddings);
    ASSERT_NEAR(c.rope_theta, 1e6, 0);
    /* 0.44B without the embedding, as the model card says, 0.6B with it */
    ASSERT_EQ_INT(pd_model_param_count(&c) - c.vocab_size * c.hidden_size, 440467456);
}

TEST(config_tinyllama)
{
    pd_model_config c;
    ASSERT_OK(pd_model_config_load(data_path("tinyllama-1.1b-chat.config.json"), &c));
    ASSERT_EQ_INT(c.hidden_size, 2048);
    ASSERT_EQ_INT(c.num_hidden_layers, 22);
    ASSERT_EQ_INT(c.num_key_value_heads, 4);
    ASSERT_EQ_INT(c.head_dim, 64);
    ASSERT_EQ_INT(c.intermediate_size, 5632);
    ASSERT_EQ_INT(pd_model_param_count(&c), 1100048384); /* TinyLlama's published 1.1B */
}

#define MINI                                                                                       \
    "\"hidden_size\": 64, \"intermediate_size\": 128, \"num_hidden_layers\": 2, "                  \
    "\"num_attention_heads\": 4, \"vocab_size\": 100"

TEST(config_variants)
{
    pd_model_config c;
    /* defaults: head_dim = hidden / heads, kv = heads, Llama bos 1 eos 2, theta 1e4, eps 1e-6 */
    ASSERT_OK(parse_config_text("{\"architectures\": [\"LlamaForCausalLM\"], " MINI "}", &c));
    ASSERT_EQ_INT(c.head_dim, 16);
    ASSERT_EQ_INT(c.num_key_value_heads, 4);
    ASSERT_EQ_INT(c.bos_token_id, 1);
    ASSERT_EQ_INT(c.n_eos_token_ids, 1);
    ASSERT_EQ_INT(c.eos_token_ids[0], 2);
    ASSERT_NEAR(c.rope_theta, 10000, 0);
    ASSERT_NEAR(c.rms_norm_eps, 1e-6, 0);
    ASSERT_EQ_INT(c.max_position_embeddings, 2048);
    ASSERT(!c.has_torch_dtype);
    /* model_type when architectures is absent; head_dim null means the default */
    ASSERT_OK(parse_config_text("{\"model_type\": \"qwen2\", \"head_dim\": null, " MINI "}", &c));
    ASSERT_EQ_INT(c.arch, PD_ARCH_QWEN2);
    ASSERT_EQ_INT(c.head_dim, 16);
    ASSERT(c.qkv_bias && !c.o_bias);
    ASSERT_EQ_INT(c.bos_token_id, -1); /* Qwen2Config has no default bos/eos */
    ASSERT_EQ_INT(c.n_eos_token_ids, 0);
    /* Qwen3: head_dim 128 when absent, q/k norms, attention_bias on q, k, v and o */
    ASSERT_OK(
        parse_config_text("{\"model_type\": \"qwen3\", \"attention_bias\": true, " MINI "}", &c));
    ASSERT_EQ_INT(c.arch, PD_ARCH_QWEN3);
    ASSERT_EQ_INT(c.head_dim, 128);
    ASSERT(c.qk_norm && c.qkv_bias && c.o_bias);
    ASSERT_EQ_INT(c.bos_token_id, -1);
    ASSERT_EQ_INT(c.max_position_embeddings, 32768);
    /* explicit head_dim, eos null, bos null, newer "dtype" key */
    ASSERT_OK(parse_config_text("{\"model_type\": \"llama\", \"head_dim\": 32, \"eos_token_id\": "
                                "null, \"bos_token_id\": null, \"dtype\": \"bfloat16\", " MINI "}",
                                &c));
    ASSERT_EQ_INT(c.head_dim, 32);
    ASSERT_EQ_INT(c.n_eos_token_ids, 0);
    ASSERT_EQ_INT(c.bos_token_id, -1);
    ASSERT(c.has_torch_dtype && c.torch_dtype == PD_DTYPE_BF16);
    /* Llama attention_bias: q, k, v and o biases */
    ASSERT_OK(
        parse_config_text("{\"model_type\": \"llama\", \"attention_bias\": true, " MINI "}", &c));
    ASSERT(c.attention_bias && c.qkv_bias && c.o_bias);
    /* rope_scaling: legacy "type", dynamic, default, null */
    ASSERT_OK(parse_config_text("{\"model_type\": \"llama\", \"rope_scaling\": {\"type\": "
                                "\"linear\", \"factor\": 4.0}, " MINI "}",
                                &c));
    ASSERT_EQ_INT(c.rope_scaling.type, PD_ROPE_LINEAR);
    ASSERT_NEAR(c.rope_scaling.factor, 4.0, 0);
    ASSERT_OK(parse_config_text("{\"model_type\": \"llama\", \"rope_scaling\": {\"rope_type\": "
                                "\"dynamic\", \"factor\": 2}, " MINI "}",
                                &c));
    ASSERT_EQ_INT(c.rope_scaling.type, PD_ROPE_DYNAMIC);
    ASSERT_OK(parse_config_text("{\"model_type\": \"llama\", \"rope_scaling\": {\"rope_type\": "
                                "\"default\"}, " MINI "}",
                                &c));
    ASSERT_EQ_INT(c.rope_scaling.type, PD_ROPE_NONE);
    ASSERT_NEAR(c.rope_scaling.factor, 1.0, 0);
    /* eos as a one-element list */
    ASSERT_OK(
        parse_config_text("{\"model_type\": \"llama\", \"eos_token_id\": [7], " MINI "}", &c));
    ASSERT_EQ_INT(c.n_eos_token_ids, 1);
    ASSERT_EQ_INT(c.eos_token_ids[0], 7);
    /* MistralConfig defaults: 8 KV heads, 4096 * 32 positions */
    ASSERT_OK(parse_config_text("{\"model_type\": \"mistral\", \"hidden_size\": 256, "
                                "\"intermediate_size\": 1, \"num_hidden_layers\": 1, "
                                "\"num_attention_heads\": 32, \"vocab_size\": 10}",
                                &c));
    ASSERT_EQ_INT(c.num_key_value_heads, 8);
    ASSERT_EQ_INT(c.max_position_embeddings, 131072);
}

TEST(config_errors_name_file_and_field)
{
    static const struct {
        const char *json;
        int code;
        const char *msg;
    } cases[] = {
        {"{\"architectures\": [\"GPT2LMHeadModel\"], " MINI "}", PD_EUNSUPPORTED,
         "test/config.json: architectures[0]: unsupported architecture \"GPT2LMHeadModel\""},
        {"{\"model_type\": \"gpt2\", " MINI "}", PD_EUNSUPPORTED, "model_type: unsupported"},
        {"{" MINI "}", PD_EINVAL, "test/config.json: architectures: required"},
        {"{\"model_type\": \"llama\", \"hidden_size\": \"64\", \"intermediate_size\": 1, "
         "\"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"vocab_size\": 10}",
         PD_EINVAL, "test/config.json: hidden_size: expected integer, got string"},
        {"{\"model_type\": \"llama\", \"intermediate_size\": 1, \"num_hidden_layers\": 1, "
         "\"num_attention_heads\": 4, \"vocab_size\": 10}",
         PD_EINVAL, "hidden_size: required"},
        {"{\"model_type\": \"llama\", \"num_key_value_heads\": 3, " MINI "}", PD_EINVAL,
         "num_key_value_heads: 3 does not divide num_attention_heads 4"},
        {"{\"model_type\": \"llama\", \"num_attention_heads\": 3, \"hidden_size\": 64, "
         "\"intermediate_size\": 1, \"num_hidden_layers\": 1, \"vocab_size\": 10}",
         PD_EINVAL,
         "head_dim: absent and hidden_size 64 is not a multiple of num_attention_heads 3"},
        {"{\"model_type\": \"llama\", \"head_dim\": 15, " MINI "}", PD_EINVAL,
         "head_dim: must be even"},
        {"{\"model_type\": \"llama\", \"hidden_act\": \"gelu\", " MINI "}", PD_EUNSUPPORTED,
         "hidden_act: unsupported \"gelu\""},
        {"{\"model_type\": \"llama\", \"mlp_bias\": true, " MINI "}", PD_EUNSUPPORTED, "mlp_bias"},
        {"{\"model_type\": \"llama\", \"torch_dtype\": \"float8_e4m3fn\", " MINI "}",
         PD_EUNSUPPORTED, "torch_dtype: unsupported \"float8_e4m3fn\""},
        {"{\"model_type\": \"llama\", \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4},"
         " " MINI "}",
         PD_EUNSUPPORTED, "rope_scaling.rope_type: unsupported \"yarn\""},
        {"{\"model_type\": \"llama\", \"rope_scaling\": {\"rope_type\": \"linear\"}, " MINI "}",
         PD_EINVAL, "test/config.json: rope_scaling.factor: required"},
        {"{\"model_type\": \"llama\", \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": "
         "8, \"low_freq_factor\": 1, \"high_freq_factor\": 4}, " MINI "}",
         PD_EINVAL, "rope_scaling.original_max_position_embeddings: required"},
        {"{\"model_type\": \"llama\", \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": "
         "8, \"low_freq_factor\": 4, \"high_freq_factor\": 4, "
         "\"original_max_position_embeddings\": 8192}, " MINI "}",
         PD_EINVAL, "rope_scaling.high_freq_factor: must be greater than low_freq_factor"},
        {"{\"model_type\": \"llama\", \"rope_scaling\": {\"factor\": 2}, " MINI "}", PD_EINVAL,
         "rope_scaling.rope_type: required"},
        {"{\"model_type\": \"llama\", \"rope_scaling\": 3, " MINI "}", PD_EINVAL,
         "rope_scaling: expected object, got integer"},
        {"{\"model_type\": \"llama\", \"eos_token_id\": [1, \"x\"], " MINI "}", PD_EINVAL,
         "eos_token_id[1]: expected integer"},
        {"{\"model_type\": \"llama\", \"eos_token_id\": -3, " MINI "}", PD_EINVAL,
         "eos_token_id: must be >= 0"},
        {"{\"model_type\": \"llama\", \"rms_norm_eps\": 0, " MINI "}", PD_EINVAL,
         "rms_norm_eps: must be between"},
        {"{\"model_type\": \"llama\", \"vocab_size\": 0, \"hidden_size\": 64, "
         "\"intermediate_size\": 1, \"num_hidden_layers\": 1, \"num_attention_heads\": 4}",
         PD_EINVAL, "vocab_size: must be between 1"},
        {"{\"model_type\": \"llama\", \"tie_word_embeddings\": 1, " MINI "}", PD_EINVAL,
         "tie_word_embeddings: expected boolean"},
        {"[1, 2]", PD_EINVAL, "test/config.json: expected a JSON object, got array"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        pd_model_config c;
        int rc = parse_config_text(cases[i].json, &c);
        ASSERT_MSG(rc == cases[i].code, "case %zu: expected %s, got %s (%s)", i,
                   pd_status_name(cases[i].code), pd_status_name(rc), pd_last_error());
        ASSERT_MSG(strstr(pd_last_error(), cases[i].msg), "case %zu: \"%s\" lacks \"%s\"", i,
                   pd_last_error(), cases[i].msg);
    }
    /* a file that is not JSON: the file name and the line */
    const char *p = tmp_path("bad_config.json");
    ASSERT(write_text(p, "{\n \"hidden_size\": 64,\n oops\n}") == 0);
    pd_model_config c;
    ASSERT_ERR(pd_model_config_load(p, &c), PD_EPARSE, "bad_config.json: line 3");
    ASSERT_ERR(pd_model_config_load(tmp_path("absent.json"), &c), PD_ENOTFOUND, "absent.json");
}

TEST(config_to_json_roundtrip)
{
    pd_model_config a, b;
    ASSERT_OK(pd_model_config_load(data_path("llama3.1-8b-instruct.config.json"), &a));
    json_t *j = pd_model_config_to_json(&a);
    ASSERT(j);
    int rc = pd_model_config_from_json(j, "roundtrip", &b);
    json_decref(j);
    ASSERT_OK(rc);
    ASSERT(memcmp(&a, &b, sizeof a) == 0);
    ASSERT_OK(pd_model_config_load(data_path("qwen2.5-0.5b-instruct.config.json"), &a));
    j = pd_model_config_to_json(&a);
    rc = pd_model_config_from_json(j, "roundtrip", &b);
    json_decref(j);
    ASSERT_OK(rc);
    ASSERT(memcmp(&a, &b, sizeof a) == 0);
}

/* pd_rope_inv_freq against values from tests/reference/llama_ref.py (numpy, written from
 * transformers' ROPE_INIT_FUNCTIONS); regenerate with tests/reference/make_rope_golden.py. */
TEST(rope_inv_freq_matches_reference)
{
    json_t *g = NULL;
    ASSERT_OK(pdj_load_file(data_path("rope_golden.json"), &g));
    size_t i;
    json_t *e;
    int n_checked = 0, types_seen = 0;
    json_array_foreach(g, i, e)
    {
        pd_model_config c;
        int rc = pd_model_config_from_json(json_object_get(e, "config"), "golden", &c);
        if (rc < 0) {
            json_decref(g);
            ASSERT_OK(rc);
        }
        types_seen |= 1 << c.rope_scaling.type;
        json_t *want = json_object_get(e, "inv_freq");
        double f[1024], scale = 0;
        ASSERT((size_t)c.head_dim / 2 == json_array_size(want));
        rc = pd_rope_inv_freq(&c, json_integer_value(json_object_get(e, "seq_len")), f, &scale);
        if (rc < 0) json_decref(g);
        ASSERT_OK(rc);
        ASSERT_NEAR(scale, json_number_value(json_object_get(e, "attention_scaling")), 0);
        for (size_t k = 0; k < json_array_size(want); k++) {
            double w = json_number_value(json_array_get(want, k));
            if (!(fabs(f[k] - w) <= 1e-13 * fabs(w))) {
                json_decref(g);
                ASSERT_MSG(0, "case %zu freq %zu: %.17g vs %.17g", i, k, f[k], w);
            }
            n_checked++;
        }
    }
    json_decref(g);
    ASSERT(n_checked > 300);
    ASSERT_EQ_INT(types_seen, 0xf); /* default, linear, dynamic, llama3 */
}

TEST(rope_properties)
{
    pd_model_config c = pd_model_config_default();
    c.head_dim = 8;
    c.rope_theta = 10000;
    double f[4], g[4];
    ASSERT_OK(pd_rope_inv_freq(&c, 1, f, NULL));
    ASSERT_NEAR(f[0], 1.0, 0);
    ASSERT_NEAR(f[1], 0.1, 1e-15); /* 10000^(-2/8) */
    ASSERT_NEAR(f[2], 0.01, 1e-16);
    ASSERT_NEAR(f[3], 0.001, 1e-17);
    /* linear: every frequency divided by the factor */
    c.rope_scaling.type = PD_ROPE_LINEAR;
    c.rope_scaling.factor = 4;
    ASSERT_OK(pd_rope_inv_freq(&c, 1, g, NULL));
    for (int i = 0; i < 4; i++) ASSERT_NEAR(g[i], f[i] / 4, 1e-18);
    /* dynamic: unchanged up to max_position_embeddings, lower frequencies beyond it */
    c.rope_scaling.type = PD_ROPE_DYNAMIC;
    c.rope_scaling.factor = 2;
    c.max_position_embeddings = 100;
    ASSERT_OK(pd_rope_inv_freq(&c, 100, g, NULL));
    for (int i = 0; i < 4; i++) ASSERT_NEAR(g[i], f[i], 1e-18);
    ASSERT_OK(pd_rope_inv_freq(&c, 300, g, NULL));
    ASSERT_NEAR(g[0], 1.0, 0);
    for (int i = 1; i < 4; i++) ASSERT(g[i] < f[i]);
    /* base * (2 * 300 / 100 - 1)^(8/6) */
    ASSERT_NEAR(g[1], pow(10000 * pow(5.0, 8.0 / 6.0), -0.25), 1e-15);
    c.head_dim = 7;
    ASSERT_ERR(pd_rope_inv_freq(&c, 1, g, NULL), PD_EINVAL, "head_dim");
}

/* ---- generation_config.json --------------------------------------------------------------- */

TEST(generation_config_files)
{
    pd_generation_config g;
    ASSERT_OK(
        pd_generation_config_load(data_path("qwen2.5-0.5b-instruct.generation_config.json"), &g));
    ASSERT(g.has_do_sample && g.do_sample);
    ASSERT(g.has_temperature);
    ASSERT_NEAR(g.temperature, 0.7, 0);
    ASSERT(g.has_top_p);
    ASSERT_NEAR(g.top_p, 0.8, 0);
    ASSERT(g.has_top_k);
    ASSERT_EQ_INT(g.top_k, 20);
    ASSERT(g.has_repetition_penalty);
    ASSERT_NEAR(g.repetition_penalty, 1.1, 0);
    ASSERT(!g.has_min_p && !g.has_max_new_tokens);
    ASSERT(g.has_bos_token_id && g.bos_token_id == 151643);
    ASSERT(g.has_pad_token_id && g.pad_token_id == 151643);
    ASSERT_EQ_INT(g.n_eos_token_ids, 2);
    ASSERT_EQ_INT(g.eos_token_ids[0], 151645);
    ASSERT_EQ_INT(g.eos_token_ids[1], 151643);
    ASSERT_OK(
        pd_generation_config_load(data_path("tinyllama-1.1b-chat.generation_config.json"), &g));
    ASSERT(!g.has_temperature && !g.has_top_p && !g.has_top_k && !g.has_do_sample);
    ASSERT_EQ_INT(g.n_eos_token_ids, 1);
    ASSERT_EQ_INT(g.eos_token_ids[0], 2);
    ASSERT(g.has_pad_token_id && g.pad_token_id == 0);
    ASSERT_OK(
        pd_generation_config_load(data_path("llama3.1-8b-instruct.generation_config.json"), &g));
    ASSERT_EQ_INT(g.n_eos_token_ids, 3);
    ASSERT_NEAR(g.temperature, 0.6, 0);
}

TEST(generation_config_inline_and_errors)
{
    pd_generation_config g;
    json_t *j = json_pack("{s:f, s:i, s:f, s:i, s:n}", "min_p", 0.05, "max_new_tokens", 256,
                          "temperature", 0.0, "top_k", -1, "top_p");
    ASSERT_OK(pd_generation_config_from_json(j, "gen.json", &g));
    json_decref(j);
    ASSERT(g.has_min_p && g.min_p == 0.05);
    ASSERT(g.has_max_new_tokens && g.max_new_tokens == 256);
    ASSERT(g.has_temperature && g.temperature == 0.0); /* set to 0 differs from absent */
    ASSERT(g.has_top_k && g.top_k == -1);
    ASSERT(!g.has_top_p); /* null counts as absent */
    ASSERT_EQ_INT(g.n_eos_token_ids, 0);
    j = json_pack("{s:f}", "top_p", 1.5);
    ASSERT_ERR(pd_generation_config_from_json(j, "gen.json", &g), PD_EINVAL,
               "gen.json: top_p: must be between 0 and 1");
    json_decref(j);
    j = json_pack("{s:s}", "temperature", "hot");
    ASSERT_ERR(pd_generation_config_from_json(j, "gen.json", &g), PD_EINVAL,
               "gen.json: temperature: expected number");
    json_decref(j);
    j = json_pack("{s:[i,s]}", "eos_token_id", 2, "x");
    ASSERT_ERR(pd_generation_config_from_json(j, "gen.json", &g), PD_EINVAL,
               "gen.json: eos_token_id[1]");
    json_decref(j);
}
