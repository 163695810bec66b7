/* Golden tests of generation semantics (§7, §9): §18.20 (the scheduler equals pd-generate and
 * the numpy forward pass on the tiny model), §18.21-24 and 26 (default max_tokens,
 * generation_config.json defaults, EOS and min_tokens), §18.25 (a stop string spanning two
 * tokens), §18.27 (UTF-8 through byte tokens), §18.28 (seeds and batch neighbours). */
#define _GNU_SOURCE
#include "golden.h"

#include <stdlib.h>
#include <unistd.h>

/* ---- generation semantics (§7, §9) -------------------------------------------------------- */

/* §18.20 (tiny model, completions): greedy and seeded token ids through pd-scheduler equal the
 * colocated engine, pd-generate, on the same prompts (ids from return_tokens_as_token_ids). */
TEST(golden_20_scheduler_equals_colocated)
{
    FIXTURE();
    static const int32_t p0[] = {12, 200, 37, 5, 90}, p1[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11},
                         p2[] = {777};
    const int32_t *prompts[] = {p0, p1, p2};
    size_t lens[] = {5, 11, 1};
    static cl_result ref[3];
    static const double temps[] = {0.0, 0.8};
    for (int t = 0; t < 2; t++) {
        ASSERT_MSG(cl_reference(g_model, prompts, lens, 3, 12, temps[t], 7, pdt_tmp_dir(), ref) ==
                       0,
                   "pd-generate: %s", pd_last_error());
        for (int i = 0; i < 3; i++) {
            char body[512];
            size_t at = (size_t)snprintf(body, sizeof body, "{\"prompt\":[");
            for (size_t j = 0; j < lens[i]; j++)
                at += (size_t)snprintf(body + at, sizeof body - at, "%s%d", j ? "," : "",
                                       prompts[i][j]);
            snprintf(body + at, sizeof body - at,
                     "],\"max_tokens\":12,\"temperature\":%.1f,\"seed\":7,\"logprobs\":0,"
                     "\"return_tokens_as_token_ids\":true}",
                     temps[t]);
            json_t *o = post_ok(g_port, "/v1/completions", body);
            ASSERT(o);
            char got[512], want[512] = "";
            response_ids(o, got, sizeof got);
            for (size_t j = 0; j < ref[i].n; j++)
                snprintf(want + strlen(want), sizeof want - strlen(want), "%d,", ref[i].tokens[j]);
            char text[2048];
            snprintf(text, sizeof text, "%s", choice_text(o, 0));
            json_decref(o);
            ASSERT_MSG(strcmp(got, want) == 0, "T=%.1f prompt %d: scheduler %s, pd-generate %s",
                       temps[t], i, got, want);
            ASSERT_STR_EQ(text, ref[i].text);
        }
    }
}

/* §18.20, the numpy leg: greedy token ids through pd-scheduler equal the independent float64
 * numpy forward pass (tests/reference/llama_ref.py) on the same model and prompt ids. */
TEST(golden_20_scheduler_equals_numpy)
{
    FIXTURE();
    if (access("/usr/bin/python3", X_OK) != 0) SKIP("/usr/bin/python3 (numpy) not available");
    static const char *const prompts[] = {"12,200,37,5,90", "1,2,3,4,5,6,7,8,9,10,11", "777"};
    for (int i = 0; i < 3; i++) {
        char got[512] = "", want[512] = "";
        ASSERT_MSG(numpy_greedy(g_model, prompts[i], 12, want, sizeof want), "%s", want);
        char body[512];
        snprintf(body, sizeof body,
                 "{\"prompt\":[%s],\"max_tokens\":12,\"temperature\":0,\"ignore_eos\":true,"
                 "\"logprobs\":0,\"return_tokens_as_token_ids\":true}",
                 prompts[i]);
        json_t *o = post_ok(g_port, "/v1/completions", body);
        ASSERT(o);
        response_ids(o, got, sizeof got);
        json_decref(o);
        ASSERT_MSG(strcmp(got, want) == 0, "prompt %d: scheduler %s, numpy %s", i, got, want);
    }
}

/* §18.21: completions default to 16 tokens; chat without a limit runs to L - P ("length");
 * generation_config.json max_new_tokens caps both. */
TEST(golden_21_default_max_tokens)
{
    FIXTURE();
    char fr[32];
    ASSERT_EQ_INT(completion_tokens(g_port, "/v1/completions",
                                    "{\"prompt\":[1,2,3,4,5],\"ignore_eos\":true}", fr, sizeof fr,
                                    NULL, 0),
                  16);
    ASSERT_STR_EQ(fr, "length");
    /* chat: prompt tokens from the response, checked against completions with the same ids */
    json_t *o = post_ok(g_port, "/v1/chat/completions",
                        "{\"messages\":[{\"role\":\"user\",\"content\":\"Hello there\"}],"
                        "\"ignore_eos\":true,\"temperature\":0}");
    ASSERT(o);
    int64_t P = usage_of(o, "prompt_tokens"), C = usage_of(o, "completion_tokens");
    const char *f = json_string_value(
        json_object_get(json_array_get(json_object_get(o, "choices"), 0), "finish_reason"));
    bool length = f && strcmp(f, "length") == 0;
    json_decref(o);
    ASSERT(P > 0);
    ASSERT_EQ_INT(C, L_MAIN - P);
    ASSERT(length);
    /* max_new_tokens = GEN_CAP caps the default and an explicit larger value */
    ASSERT_EQ_INT(completion_tokens(g_port_gen, "/v1/completions",
                                    "{\"prompt\":[1,2,3,4,5],\"ignore_eos\":true}", fr, sizeof fr,
                                    NULL, 0),
                  GEN_CAP);
    ASSERT_STR_EQ(fr, "length");
    ASSERT_EQ_INT(completion_tokens(g_port_gen, "/v1/completions",
                                    "{\"prompt\":[1,2,3,4,5],\"max_tokens\":12,\"ignore_eos\":"
                                    "true}",
                                    fr, sizeof fr, NULL, 0),
                  GEN_CAP);
    ASSERT_EQ_INT(completion_tokens(g_port_gen, "/v1/chat/completions",
                                    "{\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}],"
                                    "\"ignore_eos\":true}",
                                    fr, sizeof fr, NULL, 0),
                  GEN_CAP);
    ASSERT_STR_EQ(fr, "length");
}

/* Text of a seeded completions request: prompt ids [7..14], max_tokens 8 (extra: more fields). */
static bool seeded(int port, int seed, const char *extra, char *out, size_t n)
{
    char body[512];
    snprintf(body, sizeof body,
             "{\"prompt\":[7,8,9,10,11,12,13,14],\"max_tokens\":8,\"ignore_eos\":true,"
             "\"seed\":%d%s}",
             seed, extra);
    return completion_tokens(port, "/v1/completions", body, NULL, 0, out, n) == 8;
}

/* §18.22/23: generation_config.json temperature 0.6, top_p 0.9, top_k 50 -> defaults 0.6 / 0.9 /
 * disabled; --generation-config vllm -> 1.0 / 1.0 / 0. top_k 0 and -1 = no top_k. Compared
 * through seeded sampling (§7.1: randomness is a function of seed, choice and step). */
TEST(golden_22_generation_config_defaults)
{
    FIXTURE();
    char def[4096] = "", expl[4096] = "", hf[4096] = "", a[512], b[512];
    for (int seed = 1; seed <= 4; seed++) {
        ASSERT(seeded(g_port_gen, seed, "", a, sizeof a));
        ASSERT(seeded(g_port_gen, seed, ",\"temperature\":0.6,\"top_p\":0.9,\"top_k\":0", b,
                      sizeof b));
        ASSERT_MSG(strcmp(a, b) == 0, "seed %d: defaults \"%s\" != explicit 0.6/0.9/0 \"%s\"", seed,
                   a, b);
        strcat(def, a);
        strcat(expl, b);
        ASSERT(seeded(g_port_gen, seed, ",\"temperature\":1.0,\"top_p\":1.0,\"top_k\":0", b,
                      sizeof b));
        strcat(hf, b);
    }
    /* the defaults are not the built-in ones (so the comparison above could fail) */
    ASSERT_MSG(strcmp(def, hf) != 0, "generation_config.json defaults had no effect");
    /* vllm mode: the built-in defaults */
    for (int seed = 1; seed <= 4; seed++) {
        ASSERT(seeded(g_port_genvllm, seed, "", a, sizeof a));
        ASSERT(seeded(g_port_genvllm, seed, ",\"temperature\":1.0,\"top_p\":1.0,\"top_k\":0", b,
                      sizeof b));
        ASSERT_MSG(strcmp(a, b) == 0, "vllm mode, seed %d: \"%s\" != \"%s\"", seed, a, b);
    }
    /* §18.23 on the main scheduler (no sampling overrides): top_k 0 / -1 / absent agree */
    for (int seed = 1; seed <= 3; seed++) {
        char none[512], k0[512], km1[512];
        ASSERT(seeded(g_port, seed, "", none, sizeof none));
        ASSERT(seeded(g_port, seed, ",\"top_k\":0", k0, sizeof k0));
        ASSERT(seeded(g_port, seed, ",\"top_k\":-1", km1, sizeof km1));
        ASSERT_STR_EQ(k0, none);
        ASSERT_STR_EQ(km1, none);
    }
}

/* §18.24 and §18.26: EOS and min_tokens, forced with logit_bias under greedy (§9.4: the bias is
 * added before the argmax). */
TEST(golden_24_eos_and_min_tokens)
{
    FIXTURE();
    char body[512];
    resp r;
    /* primary EOS: stop, stop_reason null, the EOS counted, its text not in the output */
    snprintf(body, sizeof body,
             "{\"prompt\":[30,31,32],\"max_tokens\":5,\"temperature\":0,"
             "\"logit_bias\":{\"%d\":100}}",
             g_eos);
    json_t *o = post_ok(g_port, "/v1/completions", body);
    ASSERT(o);
    json_t *c = json_array_get(json_object_get(o, "choices"), 0);
    ASSERT_STR_EQ(json_string_value(json_object_get(c, "finish_reason")), "stop");
    ASSERT(json_is_null(json_object_get(c, "stop_reason")));
    ASSERT_STR_EQ(choice_text(o, 0), "");
    ASSERT_EQ_INT(usage_of(o, "completion_tokens"), 1);
    json_decref(o);
    /* the generation-config extra EOS id: stop_reason is the id */
    snprintf(body, sizeof body,
             "{\"prompt\":[30,31,32],\"max_tokens\":5,\"temperature\":0,"
             "\"logit_bias\":{\"%d\":100}}",
             g_extra_eos);
    o = post_ok(g_port, "/v1/completions", body);
    ASSERT(o);
    c = json_array_get(json_object_get(o, "choices"), 0);
    ASSERT_STR_EQ(json_string_value(json_object_get(c, "finish_reason")), "stop");
    ASSERT_EQ_INT(json_integer_value(json_object_get(c, "stop_reason")), g_extra_eos);
    ASSERT(json_is_integer(json_object_get(c, "stop_reason")));
    json_decref(o);
    /* chat: the same on the primary EOS */
    snprintf(body, sizeof body,
             "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":5,"
             "\"temperature\":0,\"logit_bias\":{\"%d\":100}}",
             g_eos);
    o = post_ok(g_port, "/v1/chat/completions", body);
    ASSERT(o);
    c = json_array_get(json_object_get(o, "choices"), 0);
    ASSERT_STR_EQ(json_string_value(json_object_get(c, "finish_reason")), "stop");
    ASSERT(json_is_null(json_object_get(c, "stop_reason")));
    ASSERT_EQ_INT(usage_of(o, "completion_tokens"), 1);
    json_decref(o);
    /* ignore_eos runs to max_tokens, through both ids */
    for (int k = 0; k < 2; k++) {
        snprintf(body, sizeof body,
                 "{\"prompt\":[30,31,32],\"max_tokens\":5,\"temperature\":0,\"ignore_eos\":true,"
                 "\"logit_bias\":{\"%d\":100}}",
                 k ? g_extra_eos : g_eos);
        char fr[32];
        ASSERT_EQ_INT(completion_tokens(g_port, "/v1/completions", body, fr, sizeof fr, NULL, 0),
                      5);
        ASSERT_STR_EQ(fr, "length");
    }
    /* min_tokens 4: EOS gets probability 0 for 4 tokens, then the bias wins: 5 tokens, stop */
    snprintf(body, sizeof body,
             "{\"prompt\":[30,31,32],\"max_tokens\":10,\"min_tokens\":4,\"temperature\":0,"
             "\"logit_bias\":{\"%d\":100}}",
             g_eos);
    o = post_ok(g_port, "/v1/completions", body);
    ASSERT(o);
    c = json_array_get(json_object_get(o, "choices"), 0);
    ASSERT_STR_EQ(json_string_value(json_object_get(c, "finish_reason")), "stop");
    ASSERT(json_is_null(json_object_get(c, "stop_reason")));
    ASSERT_EQ_INT(usage_of(o, "completion_tokens"), 5);
    json_decref(o);
    /* a min_tokens above the effective max_tokens (chat: L - P) is refused */
    ASSERT(post(g_port, "/v1/completions",
                "{\"prompt\":[1,2,3,4],\"max_tokens\":3,\"min_tokens\":4}", &r) == 0);
    ASSERT_EQ_INT(r.status, 400);
    ASSERT_CONTAINS(r.body, "\"message\":\"min_tokens must be less than or equal to "
                            "max_tokens=3, got 4.\"");
    resp_free(&r);
}

/* Greedy stream of a text prompt without stop strings: each token's newly visible text
 * (pieces[i], at most 64) and the count. */
static int greedy_pieces(const char *prompt, int max_tokens, char pieces[][64], int cap)
{
    char body[512];
    snprintf(body, sizeof body,
             "{\"prompt\":\"%s\",\"max_tokens\":%d,\"temperature\":0,\"ignore_eos\":true,"
             "\"stream\":true}",
             prompt, max_tokens);
    json_t *ev[128];
    bool done;
    int n = stream_events(g_port, "/v1/completions", body, ev, 128, &done);
    int k = 0;
    for (int i = 0; i < n && k < cap; i++) {
        const char *t = choice_text(ev[i], 0);
        snprintf(pieces[k++], 64, "%s", t ? t : "");
    }
    free_events(ev, n);
    return n == max_tokens ? k : -1;
}

static bool printable_ascii(const char *s)
{
    for (; *s; s++)
        if ((unsigned char)*s < 0x20 || (unsigned char)*s > 0x7e || *s == '"' || *s == '\\')
            return false;
    return true;
}

/* Expected §9.2 chunks: the pieces (all ASCII, so code points = bytes) with stop string s
 * matched first at offset pos (ending in token j), hold-back B = len(longest) - 1. */
static int expected_chunks(char pieces[][64], int j, size_t pos, size_t match_len, size_t B,
                           bool include, char out[][128])
{
    char vis[4096] = "";
    size_t released = 0;
    for (int k = 0; k <= j; k++) {
        strcat(vis, pieces[k]);
        size_t upto;
        if (k == j)
            upto = include ? pos + match_len : pos;
        else if (include)
            upto = strlen(vis);
        else
            upto = strlen(vis) > B ? strlen(vis) - B : 0;
        if (upto < released) upto = released;
        snprintf(out[k], 128, "%.*s", (int)(upto - released), vis + released);
        released = upto;
    }
    return j + 1;
}

/* §18.25: a stop string spanning two tokens (the greedy output picks which): truncated text,
 * stop_reason, include_stop_str_in_output, the §9.2 hold-back chunks exactly, and list order
 * between two strings that match in the same step. min_tokens (§18.26) disables the check. */
TEST(golden_25_stop_string_spanning)
{
    FIXTURE();
    static const char *const prompts[] = {"Once upon a time", "The quick brown fox", "Hello",
                                          "In the beginning", "A B C D"};
    char pieces[24][64];
    int n = -1, j = -1;
    char s[128] = "", s2[128] = "";
    size_t pos = 0;
    const char *prompt = NULL;
    for (size_t p = 0; p < sizeof prompts / sizeof *prompts && j < 0; p++) {
        prompt = prompts[p];
        n = greedy_pieces(prompts[p], 20, pieces, 24);
        ASSERT(n == 20);
        char text[4096] = "";
        size_t start[24];
        for (int k = 0; k < n; k++) {
            start[k] = strlen(text);
            strcat(text, pieces[k]);
        }
        if (!printable_ascii(text)) continue;
        /* s = last char of piece k + all of piece k+1, first found at the k/k+1 boundary */
        for (int k = 2; k + 1 < n && j < 0; k++) {
            size_t lk = strlen(pieces[k]), lk1 = strlen(pieces[k + 1]);
            if (lk == 0 || lk1 < 2) continue;
            snprintf(s, sizeof s, "%c%s", pieces[k][lk - 1], pieces[k + 1]);
            snprintf(s2, sizeof s2, "%s", pieces[k + 1]);
            const char *m = strstr(text, s), *m2 = strstr(text, s2);
            if (!m || (size_t)(m - text) != start[k] + lk - 1) continue;
            if (!m2 || (size_t)(m2 - text) != start[k + 1]) continue;
            j = k + 1;
            pos = (size_t)(m - text);
        }
    }
    if (j < 0) SKIP("no greedy output with a stop string spanning two tokens");
    char *qs = jstr(s), *qs2 = jstr(s2);
    printf("    prompt \"%s\": stop %s spans tokens %d and %d\n", prompt, qs, j - 1, j);
    char body[1024], text_want[4096] = "";
    for (int k = 0; k < j; k++) strcat(text_want, pieces[k]);
    text_want[pos] = '\0';
    /* non-streaming: truncated before the match; kept with include_stop_str_in_output */
    snprintf(body, sizeof body,
             "{\"prompt\":\"%s\",\"max_tokens\":20,\"temperature\":0,\"ignore_eos\":true,"
             "\"stop\":[%s]}",
             prompt, qs);
    json_t *o = post_ok(g_port, "/v1/completions", body);
    ASSERT(o);
    json_t *c = json_array_get(json_object_get(o, "choices"), 0);
    ASSERT_STR_EQ(choice_text(o, 0), text_want);
    ASSERT_STR_EQ(json_string_value(json_object_get(c, "finish_reason")), "stop");
    ASSERT_STR_EQ(json_string_value(json_object_get(c, "stop_reason")), s);
    ASSERT_EQ_INT(usage_of(o, "completion_tokens"), j + 1);
    json_decref(o);
    snprintf(body, sizeof body,
             "{\"prompt\":\"%s\",\"max_tokens\":20,\"temperature\":0,\"ignore_eos\":true,"
             "\"stop\":[%s],\"include_stop_str_in_output\":true}",
             prompt, qs);
    o = post_ok(g_port, "/v1/completions", body);
    ASSERT(o);
    char with[4096];
    snprintf(with, sizeof with, "%s%s", text_want, s);
    ASSERT_STR_EQ(choice_text(o, 0), with);
    json_decref(o);
    /* streaming: the chunks of §9.2 / §11.4, with and without include_stop_str_in_output */
    for (int inc = 0; inc < 2; inc++) {
        char want[24][128];
        int nw = expected_chunks(pieces, j, pos, strlen(s), strlen(s) - 1, inc, want);
        snprintf(body, sizeof body,
                 "{\"prompt\":\"%s\",\"max_tokens\":20,\"temperature\":0,\"ignore_eos\":true,"
                 "\"stop\":[%s],\"include_stop_str_in_output\":%s,\"stream\":true}",
                 prompt, qs, inc ? "true" : "false");
        json_t *ev[64];
        bool done;
        int ne = stream_events(g_port, "/v1/completions", body, ev, 64, &done);
        ASSERT_EQ_INT(ne, nw);
        bool ok = true;
        char why[512] = "";
        for (int k = 0; k < ne && ok; k++) {
            const char *t = choice_text(ev[k], 0);
            json_t *ck = json_array_get(json_object_get(ev[k], "choices"), 0);
            const char *fr = json_string_value(json_object_get(ck, "finish_reason"));
            ok = t && strcmp(t, want[k]) == 0 &&
                 (k == ne - 1 ? fr && strcmp(fr, "stop") == 0 : fr == NULL);
            if (!ok)
                snprintf(why, sizeof why, "include=%d chunk %d: \"%s\" (finish %s), want \"%s\"",
                         inc, k, t ? t : "(null)", fr ? fr : "null", want[k]);
        }
        free_events(ev, ne);
        ASSERT_MSG(ok, "%s", why);
    }
    /* list order: s2 (piece j alone) matches in the same step; the first listed wins */
    snprintf(body, sizeof body,
             "{\"prompt\":\"%s\",\"max_tokens\":20,\"temperature\":0,\"ignore_eos\":true,"
             "\"stop\":[%s,%s]}",
             prompt, qs2, qs);
    o = post_ok(g_port, "/v1/completions", body);
    ASSERT(o);
    c = json_array_get(json_object_get(o, "choices"), 0);
    ASSERT_STR_EQ(json_string_value(json_object_get(c, "stop_reason")), s2);
    char w2[4096];
    snprintf(w2, sizeof w2, "%.*s", (int)pos + 1, with);
    ASSERT_STR_EQ(choice_text(o, 0), w2);
    json_decref(o);
    snprintf(body, sizeof body,
             "{\"prompt\":\"%s\",\"max_tokens\":20,\"temperature\":0,\"ignore_eos\":true,"
             "\"stop\":[%s,%s]}",
             prompt, qs, qs2);
    o = post_ok(g_port, "/v1/completions", body);
    ASSERT(o);
    c = json_array_get(json_object_get(o, "choices"), 0);
    ASSERT_STR_EQ(json_string_value(json_object_get(c, "stop_reason")), s);
    ASSERT_STR_EQ(choice_text(o, 0), text_want);
    json_decref(o);
    /* §18.26: with min_tokens past the match, the string is not checked while it occurs */
    snprintf(body, sizeof body,
             "{\"prompt\":\"%s\",\"max_tokens\":20,\"temperature\":0,\"ignore_eos\":true,"
             "\"stop\":[%s],\"min_tokens\":%d}",
             prompt, qs, j + 1);
    o = post_ok(g_port, "/v1/completions", body);
    free(qs);
    free(qs2);
    ASSERT(o);
    char all[4096] = "";
    for (int k = 0; k < n; k++) strcat(all, pieces[k]);
    const char *t = choice_text(o, 0);
    /* the only occurrence is gone: the text runs to max_tokens unless s occurs again later */
    bool later = strstr(all + pos + 1, s) != NULL;
    if (!later) {
        ASSERT_STR_EQ(t, all);
        ASSERT_EQ_INT(usage_of(o, "completion_tokens"), 20);
    } else {
        ASSERT(strlen(t) > pos);
    }
    json_decref(o);
}

/* Strict UTF-8 check (no overlongs, no surrogates, nothing above U+10FFFF). */
static bool valid_utf8(const unsigned char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        size_t k;
        unsigned min;
        if (c < 0x80) {
            i++;
            continue;
        } else if (c >= 0xC2 && c <= 0xDF) {
            k = 1, min = 0x80;
        } else if (c >= 0xE0 && c <= 0xEF) {
            k = 2, min = 0x800;
        } else if (c >= 0xF0 && c <= 0xF4) {
            k = 3, min = 0x10000;
        } else {
            return false;
        }
        unsigned cp = c & (0x3Fu >> k);
        for (size_t j = 1; j <= k; j++) {
            if (i + j >= n || (s[i + j] & 0xC0) != 0x80) return false;
            cp = (cp << 6) | (s[i + j] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
        i += k + 1;
    }
    return true;
}

/* Bytes as hex pairs (static buffer, for messages). */
static const char *hexs(const unsigned char *b, size_t n)
{
    static char out[256];
    size_t at = 0;
    for (size_t i = 0; i < n && at + 4 < sizeof out; i++)
        at += (size_t)snprintf(out + at, sizeof out - at, "%s%02x", i ? " " : "", b[i]);
    out[at] = '\0';
    return out;
}

/* python3's UTF-8 decoder with errors="replace" (one U+FFFD per maximal ill-formed
 * subsequence, as §9.3 asks) over the bytes; out gets the result. */
static bool python_decode(const unsigned char *bytes, size_t n, char *out, size_t cap)
{
    char hex[1024] = "", path[700], script[1400];
    for (size_t i = 0; i < n; i++) sprintf(hex + 2 * i, "%02x", bytes[i]);
    snprintf(path, sizeof path, "%s/py_decode.out", pdt_tmp_dir());
    unlink(path); /* cl_spawn appends */
    snprintf(script, sizeof script,
             "import sys; sys.stdout.buffer.write(bytes.fromhex('%s').decode('utf-8', "
             "'replace').encode('utf-8'))",
             hex);
    char *argv[] = {"/usr/bin/python3", "-c", script, NULL};
    char *pyenv[] = {NULL};
    cl_proc p;
    if (cl_spawn(&p, "python3", argv, pyenv, path) != 0 || cl_wait(&p, 30000) != 0) return false;
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    size_t k = fread(out, 1, cap - 1, f);
    out[k] = '\0';
    fclose(f);
    return true;
}

/* §18.27: UTF-8 through byte tokens. Sampling among the tokens of bytes C3 and A9 gives a mix of
 * complete "é" and stray bytes: every chunk is valid UTF-8, the stream equals the full text, and
 * both equal python3's decoding of the sampled bytes. One E2 byte at "length" is U+FFFD. */
TEST(golden_27_utf8_byte_tokens)
{
    FIXTURE();
    int c3 = byte_token(0xC3), a9 = byte_token(0xA9), e2 = byte_token(0xE2);
    ASSERT(c3 >= 0 && a9 >= 0 && e2 >= 0);
    char body[512];
    snprintf(body, sizeof body,
             "{\"prompt\":[5,6,7],\"max_tokens\":1,\"temperature\":0,\"allowed_token_ids\":[%d]}",
             e2);
    char text[1024], fr[32];
    ASSERT_EQ_INT(
        completion_tokens(g_port, "/v1/completions", body, fr, sizeof fr, text, sizeof text), 1);
    ASSERT_STR_EQ(text, "\xEF\xBF\xBD");
    ASSERT_STR_EQ(fr, "length");
    for (int seed = 1; seed <= 3; seed++) {
        const char *fmt = "{\"prompt\":[5,6,7],\"max_tokens\":12,\"temperature\":1.0,"
                          "\"seed\":%d,\"allowed_token_ids\":[%d,%d],\"ignore_eos\":true%s}";
        snprintf(body, sizeof body, fmt, seed, c3, a9,
                 ",\"logprobs\":0,\"return_tokens_as_token_ids\":true");
        json_t *o = post_ok(g_port, "/v1/completions", body);
        ASSERT(o);
        json_t *toks = json_object_get(
            json_object_get(json_array_get(json_object_get(o, "choices"), 0), "logprobs"),
            "tokens");
        unsigned char bytes[32];
        size_t nb = 0;
        size_t i;
        json_t *t;
        json_array_foreach(toks, i, t)
        {
            int id = -1;
            sscanf(json_string_value(t) ? json_string_value(t) : "", "token_id:%d", &id);
            if (nb < sizeof bytes) bytes[nb++] = id == c3 ? 0xC3 : id == a9 ? 0xA9 : 0;
        }
        char full[1024];
        snprintf(full, sizeof full, "%s", choice_text(o, 0));
        json_decref(o);
        ASSERT_EQ_INT(nb, 12);
        char ref[1024];
        ASSERT(python_decode(bytes, nb, ref, sizeof ref));
        ASSERT_MSG(strcmp(full, ref) == 0,
                   "seed %d: text \"%s\", python3 on the sampled bytes "
                   "%s: \"%s\"",
                   seed, full, hexs(bytes, nb), ref);
        /* the same seed streamed: valid UTF-8 in every chunk, the same text */
        snprintf(body, sizeof body, fmt, seed, c3, a9, ",\"stream\":true");
        json_t *ev[32];
        bool done;
        int ne = stream_events(g_port, "/v1/completions", body, ev, 32, &done);
        ASSERT_EQ_INT(ne, 12);
        char cat[1024] = "";
        bool valid = true;
        for (int k = 0; k < ne; k++) {
            const char *piece = choice_text(ev[k], 0);
            valid &= piece && valid_utf8((const unsigned char *)piece, strlen(piece));
            strncat(cat, piece ? piece : "", sizeof cat - strlen(cat) - 1);
        }
        free_events(ev, ne);
        ASSERT(valid);
        ASSERT_STR_EQ(cat, ref);
    }
}

/* §18.28: the same seed gives the same text twice, and with other requests in the batch. */
TEST(golden_28_seed_batch_invariance)
{
    FIXTURE();
    const char *mine = "{\"prompt\":\"Seeded story\",\"max_tokens\":16,\"temperature\":1.0,"
                       "\"seed\":1234,\"ignore_eos\":true}";
    char a[2048], b[2048];
    ASSERT_EQ_INT(completion_tokens(g_port, "/v1/completions", mine, NULL, 0, a, sizeof a), 16);
    ASSERT_EQ_INT(completion_tokens(g_port, "/v1/completions", mine, NULL, 0, b, sizeof b), 16);
    ASSERT_STR_EQ(b, a);
    /* again with three neighbours of other lengths in flight at the same time */
    static const char *const others[] = {
        "{\"prompt\":\"A much longer neighbour prompt with several words\",\"max_tokens\":24,"
        "\"temperature\":1.0,\"ignore_eos\":true}",
        "{\"prompt\":[1,2,3],\"max_tokens\":20,\"temperature\":0.7,\"seed\":5,\"ignore_eos\":"
        "true,\"n\":2}",
        "{\"prompt\":\"x\",\"max_tokens\":18,\"ignore_eos\":true}"};
    cl_conn cs[4];
    int opened = 0;
    bool ok = true;
    for (int i = 0; i < 3 && ok; i++, opened++)
        ok = cl_conn_open(&cs[i], g_port, "POST", "/v1/completions", NULL, others[i], false) == 0;
    ok = ok && cl_conn_open(&cs[3], g_port, "POST", "/v1/completions", NULL, mine, false) == 0;
    if (ok) opened = 4;
    ok = ok && cl_conn_wait_all(cs, 4, REQ_TIMEOUT_MS);
    char *body = ok ? cl_conn_body(&cs[3]) : NULL;
    int st = ok ? cs[3].status : 0;
    for (int i = 0; i < opened; i++) cl_conn_close(&cs[i]);
    json_t *o = body ? json_loads(body, 0, NULL) : NULL;
    free(body);
    ASSERT(ok);
    ASSERT_EQ_INT(st, 200);
    ASSERT(o);
    snprintf(b, sizeof b, "%s", choice_text(o, 0) ? choice_text(o, 0) : "");
    json_decref(o);
    ASSERT_STR_EQ(b, a);
}
