/* tool_choice "required" and a named function through the 1P1D cluster (docs/api.md §13.7):
 * structured output makes the model write the calls, the api-server answers them as vLLM's
 * serving_chat does. The model has random weights, so the tests check structure, not values:
 * finish_reason, ids, names among the tools, arguments that are JSON objects valid under their
 * tool's parameters (python3-jsonschema, scheduler_common.h's validate), and the streamed
 * arguments concatenating to the non-streamed ones for the same seed. */
#include "scheduler_common.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Two functions, one with nested parameters (an array of objects, an object). Short strings,
 * enums for numbers (a random model writes digits without end) and short arrays keep its
 * answers within max_tokens. */
static const char WEATHER_PARAMS[] =
    "{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\",\"maxLength\":8},"
    "\"unit\":{\"enum\":[\"celsius\",\"fahrenheit\"]}},\"required\":[\"city\",\"unit\"]}";
static const char TRIP_PARAMS[] =
    "{\"type\":\"object\",\"properties\":{\"stops\":{\"type\":\"array\",\"maxItems\":2,"
    "\"items\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\","
    "\"maxLength\":6},\"nights\":{\"enum\":[1,2,3]}},\"required\":[\"city\",\"nights\"]}},"
    "\"budget\":{\"type\":\"object\",\"properties\":{\"amount\":{\"enum\":[100,250.5,-1e3]},"
    "\"currency\":{\"enum\":[\"EUR\",\"USD\"]}},\"required\":[\"amount\",\"currency\"]}},"
    "\"required\":[\"stops\",\"budget\"]}";

/* "logit_bias":{...} pushing every whitespace-only token of the model's vocabulary down: the
 * grammar lets JSON have whitespace anywhere between tokens, and the random model would spend
 * max_tokens on it. Read once from its tokenizer.json (byte-level: Ġ Ċ ĉ č are the bytes). */
static const char *ws_bias(void)
{
    static char bias[2048];
    if (bias[0]) return bias;
    char path[600];
    snprintf(path, sizeof path, "%s/tokenizer.json", g_model);
    json_t *tok = json_load_file(path, 0, NULL);
    const json_t *vocab = json_object_get(json_object_get(tok, "model"), "vocab");
    size_t at = (size_t)snprintf(bias, sizeof bias, ",\"logit_bias\":{");
    bool any = false;
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)vocab, k, v)
    {
        bool ws = k[0] != '\0';
        for (const char *c = k; ws && *c; c += 2) /* each a two-byte UTF-8 letter */
            ws = strncmp(c, "\xc4\xa0", 2) == 0 || strncmp(c, "\xc4\x8a", 2) == 0 ||
                 strncmp(c, "\xc4\x89", 2) == 0 || strncmp(c, "\xc4\x8d", 2) == 0;
        if (!ws || at + 32 >= sizeof bias) continue;
        at += (size_t)snprintf(bias + at, sizeof bias - at, "%s\"%lld\":-100", any ? "," : "",
                               (long long)json_integer_value(v));
        any = true;
    }
    json_decref(tok);
    snprintf(bias + at, sizeof bias - at, "}");
    if (!any) bias[0] = '\0';
    return bias;
}

/* A chat request with both tools; tool_choice as JSON text, extra fields after it. */
static char *tools_body(const char *tool_choice, int seed, int max_tokens, bool stream)
{
    char *b = malloc(8192);
    if (!b) return NULL;
    snprintf(b, 8192,
             "{\"model\":\"tiny\",\"messages\":[{\"role\":\"user\",\"content\":\"Plan a trip to "
             "Paris and tell me its weather.\"}],\"tools\":[{\"type\":\"function\",\"function\":"
             "{\"name\":\"get_weather\",\"description\":\"Current weather\",\"parameters\":%s}},"
             "{\"type\":\"function\",\"function\":{\"name\":\"plan_trip\",\"parameters\":%s}}],"
             "\"tool_choice\":%s,\"seed\":%d,\"temperature\":1.0,\"max_tokens\":%d%s%s}",
             WEATHER_PARAMS, TRIP_PARAMS, tool_choice, seed, max_tokens,
             stream ? ",\"stream\":true" : "", ws_bias());
    return b;
}

/* o[k] as a string, "" when it is not one. */
static const char *jstr(const json_t *o, const char *k)
{
    const char *s = json_string_value(json_object_get(o, k));
    return s ? s : "";
}

static const char *params_of(const char *name)
{
    if (!name) return NULL;
    if (strcmp(name, "get_weather") == 0) return WEATHER_PARAMS;
    if (strcmp(name, "plan_trip") == 0) return TRIP_PARAMS;
    return NULL;
}

/* The calls of a non-streamed choice: checked (id, type, a tool's name, arguments valid under
 * its parameters); their names and arguments into names[] / args[] (malloc'd). 0 when well
 * formed, else -1 with why. */
enum { MAX_CALLS = 16 };
typedef struct {
    char *names[MAX_CALLS], *args[MAX_CALLS];
    int n;
} calls;

static void calls_free(calls *c)
{
    for (int i = 0; i < c->n; i++) free(c->names[i]), free(c->args[i]);
    memset(c, 0, sizeof *c);
}

static int check_call(const char *name, const char *args, char *why, size_t n)
{
    const char *params = params_of(name);
    if (!params) {
        snprintf(why, n, "name '%s' is not a tool", name ? name : "(none)");
        return -1;
    }
    json_t *a = args ? json_loads(args, 0, NULL) : NULL;
    bool obj = json_is_object(a);
    json_decref(a);
    if (!obj) {
        snprintf(why, n, "arguments '%s' are not a JSON object", args ? args : "(none)");
        return -1;
    }
    return validate(params, args, why, n) == 0 ? 0 : -1;
}

static int full_calls(const json_t *choice, calls *out, char *why, size_t n)
{
    memset(out, 0, sizeof *out);
    const json_t *msg = json_object_get(choice, "message");
    const json_t *tc = json_object_get(msg, "tool_calls");
    const char *content = json_string_value(json_object_get(msg, "content"));
    if (!content || content[0]) {
        snprintf(why, n, "content is not \"\"");
        return -1;
    }
    for (size_t i = 0; i < json_array_size(tc) && out->n < MAX_CALLS; i++) {
        const json_t *c = json_array_get(tc, i), *fn = json_object_get(c, "function");
        const char *name = json_string_value(json_object_get(fn, "name"));
        const char *args = json_string_value(json_object_get(fn, "arguments"));
        if (!is_id(json_string_value(json_object_get(c, "id")), "chatcmpl-tool-") ||
            strcmp(jstr(c, "type"), "function") != 0) {
            snprintf(why, n, "call %zu: id or type", i);
            return -1;
        }
        if (check_call(name, args, why, n) < 0) return -1;
        out->names[out->n] = strdup(name);
        out->args[out->n] = strdup(args);
        out->n++;
    }
    if (!out->n) snprintf(why, n, "no tool_calls");
    return out->n ? 0 : -1;
}

/* The streamed calls of choice 0 (SSE body): ids, types and names on each call's first delta
 * only, arguments concatenated per index; the final finish_reason; whether content other than
 * the role chunk's "" came. */
static int stream_calls(char *body, calls *out, char *finish, size_t fn, bool *content, char *why,
                        size_t n)
{
    memset(out, 0, sizeof *out);
    *content = false;
    finish[0] = '\0';
    char *ev[512];
    int k = cl_sse_events(body, ev, 512);
    if (k < 2 || strcmp(ev[k - 1], "[DONE]") != 0) {
        snprintf(why, n, "%d events, no [DONE]", k);
        return -1;
    }
    for (int e = 0; e < k - 1; e++) {
        json_t *o = json_loads(ev[e], 0, NULL);
        const json_t *ch = json_array_get(json_object_get(o, "choices"), 0);
        const json_t *d = json_object_get(ch, "delta");
        const char *c = json_string_value(json_object_get(d, "content"));
        if (c && c[0]) *content = true;
        const char *f = json_string_value(json_object_get(ch, "finish_reason"));
        if (f) snprintf(finish, fn, "%s", f);
        const json_t *tcs = json_object_get(d, "tool_calls");
        for (size_t i = 0; i < json_array_size(tcs); i++) {
            const json_t *t = json_array_get(tcs, i), *func = json_object_get(t, "function");
            int idx = (int)json_integer_value(json_object_get(t, "index"));
            const char *id = json_string_value(json_object_get(t, "id"));
            const char *name = json_string_value(json_object_get(func, "name"));
            const char *args = json_string_value(json_object_get(func, "arguments"));
            if (id) { /* a call's first delta */
                if (idx != out->n || out->n >= MAX_CALLS || !is_id(id, "chatcmpl-tool-") || !name ||
                    strcmp(jstr(t, "type"), "function")) {
                    snprintf(why, n, "first delta %s", ev[e]);
                    json_decref(o);
                    return -1;
                }
                out->names[out->n] = strdup(name);
                out->args[out->n] = strdup("");
                out->n++;
            } else if (idx < 0 || idx >= out->n || name) {
                snprintf(why, n, "delta %s", ev[e]);
                json_decref(o);
                return -1;
            }
            if (args) {
                char *a = out->args[idx];
                size_t la = strlen(a), lb = strlen(args);
                char *m = realloc(a, la + lb + 1);
                if (!m) {
                    snprintf(why, n, "out of memory");
                    json_decref(o);
                    return -1;
                }
                memcpy(m + la, args, lb + 1);
                out->args[idx] = m;
            }
        }
        json_decref(o);
    }
    return 0;
}

/* stream_calls of the streamed answer to tools_body(tool_choice, seed, 400 tokens). */
static int streamed_calls(const char *tool_choice, int seed, calls *out, char *finish, size_t fn,
                          bool *content, char *why, size_t n)
{
    char *body = tools_body(tool_choice, seed, 400, true);
    http_resp r;
    int rc = body ? http_do(g_port, "POST", "/v1/chat/completions", NULL, body, &r) : -1;
    free(body);
    if (rc != 0) {
        snprintf(why, n, "no response");
        return -1;
    }
    if (r.status != 200) {
        snprintf(why, n, "status %d: %.300s", r.status, r.body);
        resp_free(&r);
        return -1;
    }
    rc = stream_calls(r.body, out, finish, fn, content, why, n);
    resp_free(&r);
    return rc;
}

/* "required": every finished answer is a list of calls of the tools with valid arguments,
 * content "", finish_reason "tool_calls"; streamed with the same seed, the same calls (the
 * fragments concatenate to the non-streamed arguments) and finish_reason "tool_calls". An
 * answer max_tokens cut is vLLM's 400. */
TEST(sched_tools_required)
{
    FIXTURE();
    int served = 0, two_tools = 0;
    for (int seed = 1; seed <= 4; seed++) {
        char *body = tools_body("\"required\"", seed, 400, false);
        ASSERT(body);
        int st = 0;
        json_t *o = post_json(g_port, "/v1/chat/completions", body, &st);
        free(body);
        ASSERT(o);
        if (st == 400) { /* only when the answer did not end within max_tokens */
            const char *m =
                json_string_value(json_object_get(json_object_get(o, "error"), "message"));
            ASSERT_MSG(m && strstr(m, "tool_choice \"required\"") && strstr(m, "\"length\""), "%s",
                       m ? m : "(no message)");
            json_decref(o);
            continue;
        }
        ASSERT_EQ_INT(st, 200);
        const json_t *ch = json_array_get(json_object_get(o, "choices"), 0);
        ASSERT_STR_EQ(json_string_value(json_object_get(ch, "finish_reason")), "tool_calls");
        calls full, str;
        char why[2048], finish[32];
        ASSERT_MSG(full_calls(ch, &full, why, sizeof why) == 0, "seed %d: %s", seed, why);
        json_decref(o);
        served++;
        for (int i = 0; i < full.n; i++)
            if (strcmp(full.names[i], full.names[0]) != 0) two_tools = 1;

        bool content;
        int rc = streamed_calls("\"required\"", seed, &str, finish, sizeof finish, &content, why,
                                sizeof why);
        ASSERT_MSG(rc == 0, "seed %d: %s", seed, why);
        ASSERT(!content);
        ASSERT_STR_EQ(finish, "tool_calls");
        ASSERT_EQ_INT(str.n, full.n);
        for (int i = 0; i < full.n; i++) {
            ASSERT_STR_EQ(str.names[i], full.names[i]);
            ASSERT_STR_EQ(str.args[i], full.args[i]);
        }
        calls_free(&full);
        calls_free(&str);
    }
    ASSERT_MSG(served >= 2, "only %d of 4 answers ended within max_tokens", served);
    printf("    %d answers, calls of both tools in one: %s\n", served, two_tools ? "yes" : "no");
}

/* max_tokens cuts the array: vLLM's 400 (the answer does not validate as a list of calls),
 * naming the finish reason; streamed, whatever was streamed stays, and the finish reason is
 * "tool_calls" exactly when a call went out. */
TEST(sched_tools_required_cut)
{
    FIXTURE();
    char *body = tools_body("\"required\"", 3, 6, false);
    ASSERT(body);
    int st = 0;
    json_t *o = post_json(g_port, "/v1/chat/completions", body, &st);
    free(body);
    ASSERT(o);
    ASSERT_EQ_INT(st, 400);
    const char *m = json_string_value(json_object_get(json_object_get(o, "error"), "message"));
    ASSERT_MSG(m && strstr(m, "not a JSON array") && strstr(m, "max_tokens"), "%s",
               m ? m : "(none)");
    json_decref(o);
    body = tools_body("\"required\"", 3, 6, true);
    ASSERT(body);
    http_resp r;
    ASSERT(http_do(g_port, "POST", "/v1/chat/completions", NULL, body, &r) == 0);
    free(body);
    ASSERT_EQ_INT(r.status, 200);
    calls str;
    char why[512], finish[32];
    bool content;
    int rc = stream_calls(r.body, &str, finish, sizeof finish, &content, why, sizeof why);
    resp_free(&r);
    ASSERT_MSG(rc == 0, "%s", why);
    ASSERT(!content);
    ASSERT_STR_EQ(finish, str.n ? "tool_calls" : "length");
    calls_free(&str);
}

/* A named function: one call of it whose arguments are the whole answer (valid under its
 * parameters), content "", finish_reason the generation's ("stop"), streamed and not; the
 * streamed arguments are the non-streamed ones. */
TEST(sched_tools_named)
{
    FIXTURE();
    static const char NAMED[] = "{\"type\":\"function\",\"function\":{\"name\":\"plan_trip\"}}";
    int served = 0;
    for (int seed = 1; seed <= 3; seed++) {
        char *body = tools_body(NAMED, seed, 400, false);
        ASSERT(body);
        int st = 0;
        json_t *o = post_json(g_port, "/v1/chat/completions", body, &st);
        free(body);
        ASSERT(o);
        ASSERT_EQ_INT(st, 200);
        const json_t *ch = json_array_get(json_object_get(o, "choices"), 0);
        char f[32];
        snprintf(f, sizeof f, "%s", jstr(ch, "finish_reason"));
        const json_t *tc = json_object_get(json_object_get(ch, "message"), "tool_calls");
        ASSERT_EQ_INT(json_array_size(tc), 1);
        const char *full_args = json_string_value(
            json_object_get(json_object_get(json_array_get(tc, 0), "function"), "arguments"));
        ASSERT(full_args);
        char *saved = strdup(full_args);
        ASSERT(saved);
        calls full, str;
        char why[2048], finish[32];
        if (strcmp(f, "stop") == 0) {
            ASSERT_MSG(full_calls(ch, &full, why, sizeof why) == 0, "seed %d: %s", seed, why);
            ASSERT_STR_EQ(full.names[0], "plan_trip");
            calls_free(&full);
            served++;
        } else {
            ASSERT_STR_EQ(f, "length");
        }
        json_decref(o);
        bool content;
        int rc =
            streamed_calls(NAMED, seed, &str, finish, sizeof finish, &content, why, sizeof why);
        ASSERT_MSG(rc == 0, "seed %d: %s", seed, why);
        ASSERT(!content);
        ASSERT_STR_EQ(finish, f);
        ASSERT_EQ_INT(str.n, 1);
        ASSERT_STR_EQ(str.names[0], "plan_trip");
        ASSERT_STR_EQ(str.args[0], saved);
        free(saved);
        calls_free(&str);
    }
    ASSERT_MSG(served >= 2, "only %d of 3 answers ended within max_tokens", served);
}
