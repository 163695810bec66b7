/* Golden tests over the real-tokenizer model families (golden_clusters.c): §18.36 (prompt_tokens
 * and BOS against the independent tokenizer) and §18.20 (greedy output through pd-scheduler
 * equals pd-generate and the numpy forward pass for every family). */
#define _GNU_SOURCE
#include "golden.h"

#include <stdlib.h>

/* ---- real tokenizers (§18.36, §18.20) ----------------------------------------------------- */

/* prompt_tokens of one request that must succeed, or -1. */
static int64_t prompt_tokens_of(int port, const char *path, json_t *body)
{
    char *s = json_dumps(body, JSON_COMPACT);
    json_t *o = s ? post_ok(port, path, s) : NULL;
    free(s);
    int64_t n = o ? usage_of(o, "prompt_tokens") : -1;
    json_decref(o);
    return n;
}

/* §18.36: prompt_tokens over HTTP against the independent tokenizer (families.json: the JS
 * @huggingface/tokenizers over the same tokenizer.json, chat prompts rendered by
 * python3-jinja2). Completions text prompts: the post-processor's BOS is counted for the
 * Llama-2 tokenizer (ids_special = [1] + ids; also Mistral and TinyLlama) and nothing is added
 * for Llama-3 (this tokenizer.json has no TemplateProcessing) and Qwen3;
 * add_special_tokens:false counts the bare ids. Chat: the count with add_special_tokens false:
 * the template's own BOS once, never twice (for the Llama-2 tokenizer the double-BOS count,
 * ids_special, is one more, so the assertion tells them apart). */
TEST(golden_36_prompt_tokens_bos)
{
    for (size_t f = 0; f < N_FAM; f++) {
        xcluster *x = &g_fam[f];
        FAMILY(x);
        json_t *ref = family_ref(x);
        size_t i;
        json_t *c;
        json_array_foreach(json_object_get(ref, "completions"), i, c)
        {
            json_t *ids = json_object_get(c, "ids"), *sp = json_object_get(c, "ids_special");
            size_t n = json_array_size(ids), ns = json_array_size(sp);
            /* the reference itself: BOS first for Llama-2, nothing added otherwise */
            if (x->bos >= 0) {
                ASSERT_EQ_INT((long long)ns, (long long)n + 1);
                ASSERT_EQ_INT(json_integer_value(json_array_get(sp, 0)), x->bos);
            } else {
                ASSERT(json_equal(ids, sp));
            }
            json_t *body =
                json_pack("{s:O,s:i}", "prompt", json_object_get(c, "text"), "max_tokens", 1);
            int64_t got = prompt_tokens_of(x->port, "/v1/completions", body);
            json_object_set_new(body, "add_special_tokens", json_false());
            int64_t got_plain = prompt_tokens_of(x->port, "/v1/completions", body);
            json_decref(body);
            ASSERT_MSG(got == (int64_t)ns, "%s completions %s: prompt_tokens %lld, reference %zu",
                       x->name, json_string_value(json_object_get(c, "text")), (long long)got, ns);
            ASSERT_MSG(got_plain == (int64_t)n,
                       "%s completions add_special_tokens:false: prompt_tokens %lld, "
                       "reference %zu",
                       x->name, (long long)got_plain, n);
        }
        json_array_foreach(json_object_get(ref, "chat"), i, c)
        {
            json_t *ids = json_object_get(c, "ids");
            size_t n = json_array_size(ids),
                   ns = json_array_size(json_object_get(c, "ids_special"));
            /* the reference: never two BOS in front (Llama-2 and Mistral templates write one,
             * TinyLlama's none); the post-processor would add one more for the Llama-2
             * tokenizer, so the double-BOS count differs */
            int bos_id = x->bos >= 0 ? x->bos : 128000; /* Llama-3 <|begin_of_text|> */
            ASSERT(!(json_integer_value(json_array_get(ids, 0)) == bos_id &&
                     json_integer_value(json_array_get(ids, 1)) == bos_id));
            if (x->bos >= 0) ASSERT_EQ_INT((long long)ns, (long long)n + 1);
            json_t *body =
                json_pack("{s:O,s:i}", "messages", json_object_get(c, "messages"), "max_tokens", 1);
            int64_t got = prompt_tokens_of(x->port, "/v1/chat/completions", body);
            json_decref(body);
            ASSERT_MSG(got == (int64_t)n,
                       "%s chat %s: prompt_tokens %lld, reference %zu (add_special_tokens "
                       "true would give %zu)",
                       x->name, json_string_value(json_object_get(c, "name")), (long long)got, n,
                       ns);
        }
    }
}

#define FAM_MAX_TOKENS 10

/* §18.20 beyond the tiny model: for Llama-2 (MHA, SentencePiece-style tokenizer with BOS),
 * Mistral (GQA 4:1, Mistral architecture), TinyLlama (GQA 8:2, Zephyr-style template without
 * BOS), Llama-3.2 (GQA 4:1, llama3 RoPE scaling, tied embeddings, byte-level BPE), Qwen2.5
 * (QKV bias, tied, Qwen tokenizer) and Qwen3 (per-head q/k norms, head_dim 32 with hidden 64
 * and 4 heads, the Qwen3 tokenizer and its own chat template) shapes, greedy output through
 * pd-scheduler, completions (text prompts) and chat (messages), equals colocated pd-generate run on
 * the independent reference's prompt ids (families.json): the same token ids and the same text; and
 * those pd-generate ids equal the float64 numpy forward pass (llama_ref.py) on the same ids. The
 * scheduler tokenizes and renders itself, so its tokenizer and template are in the comparison
 * too. */
TEST(golden_20_families_equal_colocated)
{
    for (size_t f = 0; f < N_FAM; f++) {
        xcluster *x = &g_fam[f];
        FAMILY(x);
        json_t *ref = family_ref(x);
        json_t *comp = json_object_get(ref, "completions"), *chat = json_object_get(ref, "chat");
        size_t nc = json_array_size(comp), nt = json_array_size(chat), np = nc + nt;
        static int32_t ids[8][512];
        static cl_result out[8];
        const int32_t *prompts[8];
        size_t lens[8];
        ASSERT(np <= 8);
        for (size_t i = 0; i < np; i++) {
            json_t *e = i < nc ? json_array_get(comp, i) : json_array_get(chat, i - nc);
            lens[i] = json_ids(json_object_get(e, i < nc ? "ids_special" : "ids"), ids[i], 512);
            prompts[i] = ids[i];
        }
        ASSERT_MSG(cl_reference(x->model, prompts, lens, np, FAM_MAX_TOKENS, 0.0, 0, pdt_tmp_dir(),
                                out) == 0,
                   "pd-generate on %s: %s", x->name, pd_last_error());
        for (size_t i = 0; i < np; i++) { /* the numpy leg: pd-generate = float64 reference */
            char csv[4096] = "", ref_ids[1024], gen_ids[1024] = "";
            for (size_t j = 0; j < lens[i]; j++)
                snprintf(csv + strlen(csv), sizeof csv - strlen(csv), "%s%d", j ? "," : "",
                         ids[i][j]);
            ASSERT_MSG(numpy_greedy(x->model, csv, FAM_MAX_TOKENS, ref_ids, sizeof ref_ids), "%s",
                       ref_ids);
            for (size_t j = 0; j < out[i].n; j++)
                snprintf(gen_ids + strlen(gen_ids), sizeof gen_ids - strlen(gen_ids), "%d,",
                         out[i].tokens[j]);
            /* pd-generate may stop early on EOS; the reference always runs FAM_MAX_TOKENS */
            ASSERT_MSG(out[i].n > 0, "%s prompt %zu: pd-generate made no token", x->name, i);
            ASSERT_MSG(strncmp(ref_ids, gen_ids, strlen(gen_ids)) == 0,
                       "%s prompt %zu: pd-generate %s, numpy %s", x->name, i, gen_ids, ref_ids);
        }
        for (size_t i = 0; i < np; i++) {
            bool is_chat = i >= nc;
            json_t *e = is_chat ? json_array_get(chat, i - nc) : json_array_get(comp, i);
            json_t *body =
                json_pack("{s:O,s:i,s:f,s:b}", is_chat ? "messages" : "prompt",
                          json_object_get(e, is_chat ? "messages" : "text"), "max_tokens",
                          FAM_MAX_TOKENS, "temperature", 0.0, "return_tokens_as_token_ids", 1);
            if (is_chat)
                json_object_set_new(body, "logprobs", json_true());
            else
                json_object_set_new(body, "logprobs", json_integer(0));
            char *s = json_dumps(body, JSON_COMPACT);
            json_decref(body);
            json_t *o = post_ok(x->port, is_chat ? "/v1/chat/completions" : "/v1/completions", s);
            free(s);
            ASSERT(o);
            char got[1024], want[1024] = "", text[4096];
            response_ids(o, got, sizeof got);
            snprintf(text, sizeof text, "%s", choice_text(o, 0) ? choice_text(o, 0) : "(null)");
            int64_t pt = usage_of(o, "prompt_tokens");
            json_decref(o);
            for (size_t j = 0; j < out[i].n; j++)
                snprintf(want + strlen(want), sizeof want - strlen(want), "%d,", out[i].tokens[j]);
            ASSERT_EQ_INT(pt, (long long)lens[i]);
            ASSERT_MSG(strcmp(got, want) == 0, "%s %s %zu: scheduler %s, pd-generate %s", x->name,
                       is_chat ? "chat" : "completions", is_chat ? i - nc : i, got, want);
            ASSERT_MSG(strcmp(text, out[i].text) == 0,
                       "%s %s %zu: scheduler text \"%s\", pd-generate \"%s\"", x->name,
                       is_chat ? "chat" : "completions", is_chat ? i - nc : i, text, out[i].text);
        }
    }
}
