/* Golden tests of request validation and templates: §18.7 (context length), §18.5, 8, 9 (nulls,
 * unknown keys, model names, invalid UTF-8), §18.33-35 (request and model chat templates,
 * schedulers started here), §18.37 (the legacy /generate formats). */
#define _GNU_SOURCE
#include "golden.h"

#include <stdlib.h>
#include <unistd.h>

/* ---- validation (§8) and null handling (§0) ---------------------------------------------- */

/* A body of token ids 100, 101, ... (n of them) with the rest of the JSON after the prompt. */
static char *ids_body(int n, const char *rest)
{
    size_t cap = (size_t)n * 6 + strlen(rest) + 64, at = 0;
    char *b = malloc(cap);
    at += (size_t)snprintf(b + at, cap - at, "{\"prompt\":[");
    for (int i = 0; i < n; i++)
        at += (size_t)snprintf(b + at, cap - at, "%s%d", i ? "," : "", 100 + i);
    snprintf(b + at, cap - at, "]%s}", rest);
    return b;
}

/* POSTs body (freed here) and checks a 400 BadRequestError with exactly message (or, when
 * prefix_only, a message that starts with it). */
static bool expect_400(int port, const char *path, char *body, const char *message,
                       bool prefix_only, char *why, size_t wn)
{
    resp r;
    bool ok = post(port, path, body, &r) == 0 && r.status == 400;
    json_t *o = ok ? json_loads(r.body, 0, NULL) : NULL;
    json_t *e = json_object_get(o, "error");
    const char *msg = json_string_value(json_object_get(e, "message"));
    const char *type = json_string_value(json_object_get(e, "type"));
    ok = ok && msg && type && strcmp(type, "BadRequestError") == 0 &&
         json_integer_value(json_object_get(e, "code")) == 400 &&
         json_is_null(json_object_get(e, "param")) &&
         (prefix_only ? strncmp(msg, message, strlen(message)) == 0 : strcmp(msg, message) == 0);
    if (!ok)
        snprintf(why, wn, "%.200s -> %d %.300s; want 400 \"%.200s\"", body, r.status,
                 r.body ? r.body : "", message);
    json_decref(o);
    resp_free(&r);
    free(body);
    return ok;
}

/* §18.7: P = L and P + M = L + 1 for completions and chat with the §8.5 texts (M = 16 when
 * absent on completions); P + M = L is accepted; max_tokens null has no cap (§18.9). */
TEST(golden_07_context_length)
{
    FIXTURE();
    char why[1024] = "", msg[512];
    snprintf(msg, sizeof msg,
             "This model's maximum context length is %d tokens. However, your request has %d "
             "input tokens. Please reduce the length of the input messages.",
             L_MAIN, L_MAIN);
    ASSERT_MSG(expect_400(g_port, "/v1/completions", ids_body(L_MAIN, ",\"max_tokens\":1"), msg,
                          false, why, sizeof why),
               "%s", why);
    snprintf(msg, sizeof msg,
             "'max_tokens' or 'max_completion_tokens' is too large: 2. This model's maximum "
             "context length is %d tokens and your request has %d input tokens (2 > %d - %d).",
             L_MAIN, L_MAIN - 1, L_MAIN, L_MAIN - 1);
    ASSERT_MSG(expect_400(g_port, "/v1/completions", ids_body(L_MAIN - 1, ",\"max_tokens\":2"), msg,
                          false, why, sizeof why),
               "%s", why);
    /* no max_tokens: M = 16 */
    snprintf(msg, sizeof msg,
             "'max_tokens' or 'max_completion_tokens' is too large: 16. This model's maximum "
             "context length is %d tokens and your request has 50 input tokens (16 > %d - 50).",
             L_MAIN, L_MAIN);
    ASSERT_MSG(expect_400(g_port, "/v1/completions", ids_body(50, ""), msg, false, why, sizeof why),
               "%s", why);
    /* P + M = L: accepted; max_tokens null: up to L - P */
    char *b = ids_body(L_MAIN - 1, ",\"max_tokens\":1,\"ignore_eos\":true");
    int64_t ct = completion_tokens(g_port, "/v1/completions", b, NULL, 0, NULL, 0);
    free(b);
    ASSERT_EQ_INT(ct, 1);
    char fr[32];
    b = ids_body(50, ",\"max_tokens\":null,\"ignore_eos\":true,\"temperature\":0");
    ct = completion_tokens(g_port, "/v1/completions", b, fr, sizeof fr, NULL, 0);
    free(b);
    ASSERT_EQ_INT(ct, L_MAIN - 50);
    ASSERT_STR_EQ(fr, "length");
    /* chat: P from a request that fits, then M = L - P + 1 (refused) and M = L - P (served) */
    const char *chat = "{\"messages\":[{\"role\":\"user\",\"content\":\"Hello there\"}],"
                       "\"ignore_eos\":true,\"temperature\":0,\"max_completion_tokens\":%d}";
    char body[512];
    snprintf(body, sizeof body, chat, 1);
    json_t *o = post_ok(g_port, "/v1/chat/completions", body);
    ASSERT(o);
    int P = (int)usage_of(o, "prompt_tokens");
    json_decref(o);
    ASSERT(P > 0 && P < L_MAIN - 1);
    snprintf(body, sizeof body, chat, L_MAIN - P + 1);
    snprintf(msg, sizeof msg,
             "'max_tokens' or 'max_completion_tokens' is too large: %d. This model's maximum "
             "context length is %d tokens and your request has %d input tokens (%d > %d - %d).",
             L_MAIN - P + 1, L_MAIN, P, L_MAIN - P + 1, L_MAIN, P);
    ASSERT_MSG(
        expect_400(g_port, "/v1/chat/completions", strdup(body), msg, false, why, sizeof why), "%s",
        why);
    snprintf(body, sizeof body, chat, L_MAIN - P);
    ASSERT_EQ_INT(completion_tokens(g_port, "/v1/chat/completions", body, fr, sizeof fr, NULL, 0),
                  L_MAIN - P);
    ASSERT_STR_EQ(fr, "length");
    /* chat with P >= L: the first message, whatever P is */
    char big[2048];
    size_t at =
        (size_t)snprintf(big, sizeof big, "{\"messages\":[{\"role\":\"user\",\"content\":\"");
    for (int i = 0; i < 80; i++) at += (size_t)snprintf(big + at, sizeof big - at, "w%d ", i);
    snprintf(big + at, sizeof big - at, "\"}]}");
    snprintf(msg, sizeof msg,
             "This model's maximum context length is %d tokens. However, your request has ",
             L_MAIN);
    resp r;
    ASSERT(post(g_port, "/v1/chat/completions", big, &r) == 0);
    ASSERT_EQ_INT(r.status, 400);
    json_t *e = json_loads(r.body, 0, NULL);
    const char *m = json_string_value(json_object_get(json_object_get(e, "error"), "message"));
    int pin = -1;
    char tail[128] = "";
    bool ok = m && strncmp(m, msg, strlen(msg)) == 0 &&
              sscanf(m + strlen(msg), "%d%127[^\n]", &pin, tail) == 2;
    json_decref(e);
    resp_free(&r);
    ASSERT(ok);
    ASSERT(pin >= L_MAIN);
    ASSERT_STR_EQ(tail, " input tokens. Please reduce the length of the input messages.");
}

/* §18.9: unknown keys are ignored, and null equals absent for every optional field (greedy, so
 * the texts compare). */
TEST(golden_09_nulls_and_unknown_keys)
{
    FIXTURE();
    char a[2048], b[2048];
    ASSERT(completion_tokens(g_port, "/v1/completions",
                             "{\"prompt\":[3,4,5,6],\"max_tokens\":6,\"temperature\":0}", NULL, 0,
                             a, sizeof a) > 0);
    ASSERT(
        completion_tokens(
            g_port, "/v1/completions",
            "{\"prompt\":[3,4,5,6],\"max_tokens\":6,\"temperature\":0,\"no_such_key\":{\"x\":"
            "[1,null]},\"model\":null,\"echo\":null,\"n\":null,\"best_of\":null,\"top_p\":null,"
            "\"top_k\":null,\"min_p\":null,\"repetition_penalty\":null,\"presence_penalty\":"
            "null,\"frequency_penalty\":null,\"logit_bias\":null,\"logprobs\":null,\"seed\":null,"
            "\"stop\":null,\"stop_token_ids\":null,\"stream\":null,\"stream_options\":null,"
            "\"include_stop_str_in_output\":null,\"ignore_eos\":null,\"min_tokens\":null,"
            "\"skip_special_tokens\":null,\"spaces_between_special_tokens\":null,"
            "\"truncate_prompt_tokens\":null,\"allowed_token_ids\":null,\"add_special_tokens\":"
            "null,\"return_tokens_as_token_ids\":null,\"priority\":null,\"use_beam_search\":"
            "null,\"length_penalty\":null,\"suffix\":null,\"prompt_embeds\":null,"
            "\"prompt_logprobs\":null,\"guided_json\":null,\"guided_regex\":null,"
            "\"guided_choice\":null,\"guided_grammar\":null,\"logits_processors\":null,"
            "\"response_format\":null,\"user\":null,\"request_id\":null}",
            NULL, 0, b, sizeof b) > 0);
    ASSERT_STR_EQ(b, a);
    const char *base = "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":5,"
                       "\"temperature\":0";
    char body[2048];
    snprintf(body, sizeof body, "%s}", base);
    ASSERT(completion_tokens(g_port, "/v1/chat/completions", body, NULL, 0, a, sizeof a) > 0);
    snprintf(body, sizeof body,
             "%s,\"unknown\":true,\"max_completion_tokens\":null,\"n\":null,\"top_logprobs\":null,"
             "\"logprobs\":null,\"echo\":null,\"add_generation_prompt\":null,"
             "\"continue_final_message\":null,\"add_special_tokens\":null,\"chat_template\":null,"
             "\"chat_template_kwargs\":null,\"documents\":null,\"tools\":null,\"tool_choice\":"
             "null,\"response_format\":null,\"stream_options\":null,\"bad_words\":null,"
             "\"structural_tag\":null,\"parallel_tool_calls\":null,\"reasoning_effort\":null}",
             base);
    ASSERT(completion_tokens(g_port, "/v1/chat/completions", body, NULL, 0, b, sizeof b) > 0);
    ASSERT_STR_EQ(b, a);
    /* §18.8: an empty model and an alias are served; the response names the first name */
    static const char *const models[] = {"\"\"", "\"tiny-alias\"", "null"};
    for (size_t i = 0; i < 3; i++) {
        snprintf(body, sizeof body, "{\"prompt\":[3,4],\"max_tokens\":1,\"model\":%s}", models[i]);
        json_t *o = post_ok(g_port, "/v1/completions", body);
        ASSERT(o);
        bool first = strcmp(json_string_value(json_object_get(o, "model")), "tiny") == 0;
        json_decref(o);
        ASSERT_MSG(first, "model %s", models[i]);
    }
    /* §18.5: invalid UTF-8 inside a JSON string is invalid JSON */
    char why[1024];
    ASSERT_MSG(expect_400(g_port, "/v1/completions", strdup("{\"prompt\":\"a\xff\xfe\"}"),
                          "Invalid JSON in request body:", true, why, sizeof why),
               "%s", why);
}

/* §18.33 and the render rows of §8.3 and §8.4 (request templates: the main scheduler runs with
 * --trust-request-chat-template). */
TEST(golden_33_template_errors)
{
    FIXTURE();
    char why[1024] = "";
    const char *msgs = "\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"},{\"role\":\"user\","
                       "\"content\":\"again\"}]";
    char body[1024];
    snprintf(body, sizeof body,
             "{%s,\"chat_template\":\"{%% for m in messages %%}{%% if (m.role == 'user') != "
             "(loop.index0 %% 2 == 0) %%}{{ raise_exception('Conversation roles must alternate "
             "user/assistant/user/assistant/...') }}{%% endif %%}{{ m.content }}{%% endfor "
             "%%}\"}",
             msgs);
    ASSERT_MSG(expect_400(g_port, "/v1/chat/completions", strdup(body),
                          "Conversation roles must alternate user/assistant/user/assistant/...",
                          false, why, sizeof why),
               "%s", why);
    snprintf(body, sizeof body, "{%s,\"chat_template\":\"{{ messages[0].content + 1 }}\"}", msgs);
    ASSERT_MSG(expect_400(g_port, "/v1/chat/completions", strdup(body),
                          "Chat template error: ", true, why, sizeof why),
               "%s", why);
    snprintf(body, sizeof body,
             "{%s,\"continue_final_message\":true,\"add_generation_prompt\":false,"
             "\"chat_template\":\"{%% for m in messages %%}{{ m.role }}{%% endfor %%}\"}",
             msgs);
    ASSERT_MSG(expect_400(g_port, "/v1/chat/completions", strdup(body),
                          "continue_final_message is set but the final message does not appear "
                          "in the chat after applying the chat template!",
                          false, why, sizeof why),
               "%s", why);
    /* a request template outside the subset: 400 (compiled per request) */
    snprintf(body, sizeof body,
             "{%s,\"chat_template\":\"{%% macro f() %%}x{%% endmacro %%}{{ f() }}\"}", msgs);
    resp r;
    ASSERT(post(g_port, "/v1/chat/completions", body, &r) == 0);
    ASSERT_EQ_INT(r.status, 400);
    ASSERT_CONTAINS(r.body, "\"type\":\"BadRequestError\"");
    resp_free(&r);
    /* structured output: one kind of guided decoding at a time, named in the request's order */
    static const struct {
        const char *fields, *want;
    } order[] = {
        {"\"guided_grammar\":\"root ::= \\\"a\\\"\",\"guided_choice\":[\"a\"]",
         "You can only use one kind of guided decoding but multiple are specified: `guided_choice` "
         "and `guided_grammar`."},
        {"\"structural_tag\":\"t\",\"guided_grammar\":\"g\"", "`structural_tag` is not supported."},
        {"\"guided_regex\":\"r\",\"guided_json\":{}",
         "You can only use one kind of guided decoding but multiple are specified: `guided_json` "
         "and `guided_regex`."},
    };
    for (size_t i = 0; i < sizeof order / sizeof *order; i++) {
        snprintf(body, sizeof body, "{%s,%s}", msgs, order[i].fields);
        ASSERT_MSG(expect_400(g_port, "/v1/chat/completions", strdup(body), order[i].want, false,
                              why, sizeof why),
                   "%s", why);
    }
}

/* True when the file at path contains needle. */
static bool file_has(const char *path, const char *needle)
{
    FILE *f = fopen(path, "r");
    if (!f) return false;
    char *buf = malloc(1 << 20);
    size_t n = buf ? fread(buf, 1, (1 << 20) - 1, f) : 0;
    fclose(f);
    if (!buf) return false;
    buf[n] = '\0';
    bool has = strstr(buf, needle) != NULL;
    free(buf);
    return has;
}

/* §18.34/35: a model without a chat template serves completions and answers chat with the §8.3
 * 400; --chat-template FILE fixes it; a model template outside the §13.4 subset (a macro) makes
 * the scheduler exit 1 with the §13.1 message. */
TEST(golden_34_35_model_templates)
{
    FIXTURE();
    /* tiny without a template: tokenizer_config.json minus chat_template */
    static const char *const skip[] = {"tokenizer_config.json", "chat_template.jinja", NULL};
    char dir[600], path[800], tmpl_file[800];
    ASSERT(model_like("tiny_notmpl", skip, dir, sizeof dir));
    snprintf(path, sizeof path, "%s/tokenizer_config.json", g_model);
    json_t *tc = json_load_file(path, 0, NULL);
    ASSERT(tc);
    const char *chatml = json_string_value(json_object_get(tc, "chat_template"));
    snprintf(tmpl_file, sizeof tmpl_file, "%s/chatml.jinja", pdt_tmp_dir());
    bool wrote = chatml && write_file(tmpl_file, chatml) == 0;
    json_object_del(tc, "chat_template");
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    wrote = wrote && json_dump_file(tc, path, JSON_INDENT(2)) == 0;
    json_decref(tc);
    ASSERT(wrote);
    const char *chat = "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":2}";
    int port;
    ASSERT(sched_spawn(&g_tmpl, "sched_notmpl", "1", NULL, dir, NULL, &port) == 0);
    int health = wait_status(port, "/health", 200, 30);
    char *body = NULL;
    int st_chat = cl_http(port, "POST", "/v1/chat/completions", chat, 30000, &body, NULL);
    int st_cmpl = cl_http(port, "POST", "/v1/completions", "{\"prompt\":[1,2],\"max_tokens\":2}",
                          30000, NULL, NULL);
    int stop = cl_stop(&g_tmpl, 10000);
    char got[600];
    snprintf(got, sizeof got, "%s", body ? body : "");
    free(body);
    ASSERT_EQ_INT(health, 200);
    ASSERT_EQ_INT(st_chat, 400);
    ASSERT_STR_EQ(got,
                  "{\"error\":{\"message\":\"This model has no chat template; start the server "
                  "with --chat-template, or use /v1/completions.\",\"type\":"
                  "\"BadRequestError\",\"param\":null,\"code\":400}}");
    ASSERT_EQ_INT(st_cmpl, 200);
    ASSERT_EQ_INT(stop, 0);
    /* --chat-template FILE */
    char *with_file[] = {"--chat-template", tmpl_file, NULL};
    ASSERT(sched_spawn(&g_tmpl, "sched_tmplfile", "1", NULL, dir, with_file, &port) == 0);
    health = wait_status(port, "/health", 200, 30);
    st_chat = cl_http(port, "POST", "/v1/chat/completions", chat, 30000, NULL, NULL);
    stop = cl_stop(&g_tmpl, 10000);
    ASSERT_EQ_INT(health, 200);
    ASSERT_EQ_INT(st_chat, 200);
    ASSERT_EQ_INT(stop, 0);
    /* a macro in the model's chat_template.jinja: exit 1 and the message ({construct} is the
     * kind: tag, filter, test or method; {name} its name, as tests/unit/chat reads §13.1) */
    static const char *const skip2[] = {"chat_template.jinja", NULL};
    char dir2[600];
    ASSERT(model_like("tiny_macro", skip2, dir2, sizeof dir2));
    snprintf(path, sizeof path, "%s/chat_template.jinja", dir2);
    ASSERT(write_file(path, "{% macro greet(x) %}{{ x }}{% endmacro %}{{ greet('hi') }}\n") == 0);
    ASSERT(sched_spawn(&g_tmpl, "sched_macro", "1", NULL, dir2, NULL, &port) == 0);
    char log[700];
    snprintf(log, sizeof log, "%s", g_tmpl.log);
    int code = cl_wait(&g_tmpl, 20000);
    if (!file_has(log, "chat template: unsupported tag 'macro' at line 1; pass "
                       "--chat-template to override"))
        cl_dump_log(&g_tmpl, 5);
    ASSERT_EQ_INT(code, 1);
    ASSERT_MSG(file_has(log, "chat template: unsupported tag 'macro' at line 1; pass "
                             "--chat-template to override"),
               "the §13.1 message is not in %s", log);
}

/* §18.37: legacy /generate: n=2 gives two strings per line; the stream is written like Python's
 * json.dumps (", " and ": ", \u escapes, prompt included); the non-streaming body is compact
 * with raw UTF-8; an incomplete byte at the end is U+FFFD. */
TEST(golden_37_legacy_generate)
{
    FIXTURE();
    resp r;
    ASSERT(post(g_port_legacy, "/generate",
                "{\"prompt\":\"caf\\u00e9\",\"max_tokens\":3,\"temperature\":0,\"ignore_eos\":"
                "true,\"n\":2}",
                &r) == 0);
    ASSERT_MSG(r.status == 200, "%d %s", r.status, r.body);
    json_t *o = json_loads(r.body, 0, NULL);
    ASSERT(o);
    json_t *t = json_object_get(o, "text");
    ASSERT_EQ_INT(json_array_size(t), 2);
    char full[1024];
    snprintf(full, sizeof full, "%s", json_string_value(json_array_get(t, 0)));
    ASSERT_STR_EQ(json_string_value(json_array_get(t, 1)), full);
    json_decref(o);
    ASSERT(strncmp(full, "caf\xC3\xA9", 5) == 0);
    /* compact, raw UTF-8 */
    char *q = jstr(full);
    char want[2200];
    snprintf(want, sizeof want, "{\"text\":[%s,%s]}", q, q);
    free(q);
    ASSERT_STR_EQ(r.body, want);
    resp_free(&r);
    /* stream: 3 lines, each with both choices' cumulative text, Python json.dumps style */
    ASSERT(post(g_port_legacy, "/generate",
                "{\"prompt\":\"caf\\u00e9\",\"max_tokens\":3,\"temperature\":0,\"ignore_eos\":"
                "true,\"n\":2,\"stream\":true}",
                &r) == 0);
    ASSERT_EQ_INT(r.status, 200);
    char h[64];
    ASSERT_STR_EQ(hdr(&r, "Content-Type", h, sizeof h), "application/x-ndjson");
    int lines = 0;
    bool ok = true;
    char last[1024] = "", last1[1024] = "", why[600] = "";
    for (char *save = NULL, *line = strtok_r(r.body, "\n", &save); line && ok;
         line = strtok_r(NULL, "\n", &save), lines++) {
        json_t *e = json_loads(line, 0, NULL);
        json_t *a = json_object_get(e, "text");
        const char *t0 = json_string_value(json_array_get(a, 0));
        const char *t1 = json_string_value(json_array_get(a, 1));
        /* rebuilt in the json.dumps style: ASCII-only, \u escapes */
        char rebuilt[1024];
        size_t at = (size_t)snprintf(rebuilt, sizeof rebuilt, "{\"text\": [");
        for (int k = 0; k < 2 && t0 && t1; k++) {
            const unsigned char *s = (const unsigned char *)(k ? t1 : t0);
            at += (size_t)snprintf(rebuilt + at, sizeof rebuilt - at, "%s\"", k ? ", " : "");
            while (*s && at < sizeof rebuilt - 16) {
                unsigned cp = *s++;
                if (cp >= 0x80) {
                    int extra = cp >= 0xF0 ? 3 : cp >= 0xE0 ? 2 : 1;
                    cp &= 0x3Fu >> extra;
                    for (int x = 0; x < extra && *s; x++) cp = (cp << 6) | (*s++ & 0x3F);
                }
                if (cp >= 0x10000) {
                    cp -= 0x10000;
                    at += (size_t)snprintf(rebuilt + at, sizeof rebuilt - at, "\\u%04x\\u%04x",
                                           0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
                } else if (cp > 0x7f || cp < 0x20 || cp == '"' || cp == '\\') {
                    const char *esc = cp == '"'    ? "\\\""
                                      : cp == '\\' ? "\\\\"
                                      : cp == '\n' ? "\\n"
                                      : cp == '\t' ? "\\t"
                                      : cp == '\r' ? "\\r"
                                      : cp == '\b' ? "\\b"
                                      : cp == '\f' ? "\\f"
                                                   : NULL;
                    if (esc)
                        at += (size_t)snprintf(rebuilt + at, sizeof rebuilt - at, "%s", esc);
                    else
                        at += (size_t)snprintf(rebuilt + at, sizeof rebuilt - at, "\\u%04x", cp);
                } else {
                    rebuilt[at++] = (char)cp;
                    rebuilt[at] = '\0';
                }
            }
            at += (size_t)snprintf(rebuilt + at, sizeof rebuilt - at, "\"");
        }
        snprintf(rebuilt + at, sizeof rebuilt - at, "]}");
        ok = t0 && t1 && strcmp(line, rebuilt) == 0 &&
             strncmp(line, "{\"text\": [\"caf\\u00e9", 20) == 0 &&
             strncmp(t0, last, strlen(last)) == 0;
        if (!ok) snprintf(why, sizeof why, "line %d: %.250s (want %.250s)", lines, line, rebuilt);
        if (t0) snprintf(last, sizeof last, "%s", t0);
        if (t1) snprintf(last1, sizeof last1, "%s", t1);
        json_decref(e);
    }
    resp_free(&r);
    ASSERT_MSG(ok, "%s", why);
    /* a line each time any choice receives a token: 3 (both choices per step) to 6 */
    ASSERT_MSG(lines >= 3 && lines <= 6, "%d lines", lines);
    ASSERT_STR_EQ(last, full);
    ASSERT_STR_EQ(last1, full);
    /* one E2 byte at the end: U+FFFD, raw in the body */
    char body[256];
    snprintf(body, sizeof body,
             "{\"prompt\":\"ab\",\"max_tokens\":1,\"temperature\":0,\"allowed_token_ids\":[%d]}",
             byte_token(0xE2));
    ASSERT(post(g_port_legacy, "/generate", body, &r) == 0);
    ASSERT_EQ_INT(r.status, 200);
    ASSERT_STR_EQ(r.body, "{\"text\":[\"ab\xEF\xBF\xBD\"]}");
    resp_free(&r);
}
