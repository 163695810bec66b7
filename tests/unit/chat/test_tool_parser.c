/* Tool-call parsers (tokenizer/tool_parser.h) against what vLLM's hermes, llama3_json and
 * mistral parsers give for the same generated text. The expected values were worked out by
 * reading vLLM's extract_tool_calls (regexes, json.loads / json.dumps(ensure_ascii=False), the
 * content rules and the fallbacks): e.g. llama3_json's regex takes at most one level of nested
 * objects, so a deeper call is no call; mistral's fallback content is the text without
 * [TOOL_CALLS], stripped. Streaming is checked at every byte boundary (one split) and byte by
 * byte: the deltas must rebuild the same content and calls, each call's first delta carrying
 * its id, type and name once, and nothing may be taken back. tool_choice "required" (the
 * array vLLM's serving_chat validates as FunctionDefinitions, arguments json.dumps of the
 * parameters) and a named function (the text as is) go through the same checks.
 */
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "tokenizer/tool_parser.h"

enum { MAX_CALLS = 4 };

typedef struct {
    const char *name, *args;
} want_call;

typedef struct {
    pd_tool_kind kind;
    const char *text;
    const char *content; /* non-streaming; NULL: null */
    want_call calls[MAX_CALLS];
    int n;
    const char *streamed; /* what streams as content; NULL: not checked streamed (not JSON: what
                             was sent of a call stays sent) */
    bool stream_calls;    /* the streamed calls are `calls` (else none) */
    bool required;        /* tool_choice "required" (kind unused) */
} tool_case;

static const tool_case CASES[] = {
    /* hermes */
    {PD_TOOL_HERMES,
     "Let me check.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", "
     "\"unit\": \"celsius\"}}\n</tool_call>",
     "Let me check.",
     {{"get_weather", "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}},
     1,
     "Let me check.",
     true,
     false},
    {PD_TOOL_HERMES,
     "<tool_call>{\"name\":\"f\",\"arguments\":{\"a\":1,\"b\":[true,null,2.50,-0,1E2],"
     "\"c\":\"\\u00e9\\n\\ud83d\\ude00\",\"d\":\"\xc3\xa9/\\/\"}}</tool_call>",
     NULL,
     {{"f",
       "{\"a\": 1, \"b\": [true, null, 2.5, 0, 100.0], \"c\": \"\xc3\xa9\\n\xf0\x9f\x98\x80\", "
       "\"d\": \"\xc3\xa9//\"}"}},
     1,
     "",
     true,
     false},
    {PD_TOOL_HERMES,
     "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n<tool_call>{\"arguments\": "
     "{\"x\": \"y\"}, \"name\": \"b\"}</tool_call>",
     NULL,
     {{"a", "{}"}, {"b", "{\"x\": \"y\"}"}},
     2,
     "",
     true,
     false},
    {PD_TOOL_HERMES,
     "<tool_call>{\"name\": \"a\", \"arguments\": {\"x\": 12}}",
     NULL,
     {{"a", "{\"x\": 12}"}},
     1,
     "",
     true,
     false},
    {PD_TOOL_HERMES,
     "Hi <tool_call>{\"name\": \"a\", \"arguments\": {\"x\": }}</tool_call>",
     "Hi <tool_call>{\"name\": \"a\", \"arguments\": {\"x\": }}</tool_call>",
     {{0}},
     0,
     NULL,
     false,
     false},
    {PD_TOOL_HERMES,
     "<tool_call>{\"name\": \"a\"}</tool_call>",
     "<tool_call>{\"name\": \"a\"}</tool_call>",
     {{0}},
     0,
     NULL,
     false,
     false},
    {PD_TOOL_HERMES,
     "<tool_call>{\"name\": 3, \"arguments\": {}}</tool_call>",
     "<tool_call>{\"name\": 3, \"arguments\": {}}</tool_call>",
     {{0}},
     0,
     NULL,
     false,
     false},
    {PD_TOOL_HERMES,
     "Hello, <tool world <tool_cal",
     "Hello, <tool world <tool_cal",
     {{0}},
     0,
     "Hello, <tool world <tool_cal",
     false,
     false},
    /* llama3_json */
    {PD_TOOL_LLAMA3_JSON,
     "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
     NULL,
     {{"get_weather", "{\"city\": \"Paris\"}"}},
     1,
     "",
     true,
     false},
    {PD_TOOL_LLAMA3_JSON,
     "<|python_tag|>{\"name\": \"a\", \"arguments\": {\"x\": 1}}; {\"name\": \"b\", "
     "\"parameters\": {\"y\": [2, \"z\"]}}",
     NULL,
     {{"a", "{\"x\": 1}"}, {"b", "{\"y\": [2, \"z\"]}"}},
     2,
     "",
     true,
     false},
    /* found anywhere when whole, streamed only when the text starts with it (vLLM's both) */
    {PD_TOOL_LLAMA3_JSON,
     "Sure! {\"name\": \"a\", \"parameters\": {\"x\": 1}} done",
     NULL,
     {{"a", "{\"x\": 1}"}},
     1,
     "Sure! {\"name\": \"a\", \"parameters\": {\"x\": 1}} done",
     false,
     false},
    {PD_TOOL_LLAMA3_JSON,
     "Plain text, no call.",
     "Plain text, no call.",
     {{0}},
     0,
     "Plain text, no call.",
     false,
     false},
    {PD_TOOL_LLAMA3_JSON, "<|pyth", "<|pyth", {{0}}, 0, "<|pyth", false, false},
    /* the regex's nesting limit and its split at ';' */
    {PD_TOOL_LLAMA3_JSON,
     "{\"name\": \"a\", \"parameters\": {\"x\": {\"y\": {\"z\": 1}}}}",
     "{\"name\": \"a\", \"parameters\": {\"x\": {\"y\": {\"z\": 1}}}}",
     {{0}},
     0,
     NULL,
     false,
     false},
    {PD_TOOL_LLAMA3_JSON,
     "{\"name\": \"a\", \"parameters\": {\"s\": \"x;y\"}}",
     "{\"name\": \"a\", \"parameters\": {\"s\": \"x;y\"}}",
     {{0}},
     0,
     NULL,
     false,
     false},
    {PD_TOOL_LLAMA3_JSON, "{\"name\": \"a\"}", "{\"name\": \"a\"}", {{0}}, 0, NULL, false, false},
    /* mistral */
    {PD_TOOL_MISTRAL,
     "[TOOL_CALLS][{\"name\": \"add\", \"arguments\": {\"a\": 3.5, \"b\": 4}}]",
     NULL,
     {{"add", "{\"a\": 3.5, \"b\": 4}"}},
     1,
     "",
     true,
     false},
    {PD_TOOL_MISTRAL,
     "Sure.[TOOL_CALLS] [{\"name\": \"a\", \"arguments\": {}}, {\"name\": \"b\", "
     "\"arguments\": {\"q\": \"x\"}}]",
     "Sure.",
     {{"a", "{}"}, {"b", "{\"q\": \"x\"}"}},
     2,
     "Sure.",
     true,
     false},
    {PD_TOOL_MISTRAL, "[TOOL_CALLS] not json ", "not json", {{0}}, 0, "", false, false},
    {PD_TOOL_MISTRAL, "hello [TOOL", "hello [TOOL", {{0}}, 0, "hello [TOOL", false, false},
    /* tool_choice "required": content "", no text around the calls, "arguments" no alias */
    {PD_TOOL_HERMES,
     "[{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}]",
     "",
     {{"get_weather", "{\"city\": \"Paris\"}"}},
     1,
     "",
     true,
     true},
    {PD_TOOL_HERMES,
     "\n [ {\"parameters\":{\"steps\":[{\"n\":1,\"at\":{\"lat\":48.850,\"lon\":2E0}}],"
     "\"note\":\"caf\\u00e9 \\\"x\\\"\",\"arguments\":null},\"name\":\"plan\"} ,{\"name\":\"a\","
     "\"parameters\":{}},{\"name\":\"b\",\"parameters\":null}]\n",
     "",
     {{"plan", "{\"steps\": [{\"n\": 1, \"at\": {\"lat\": 48.85, \"lon\": 2.0}}], \"note\": "
               "\"caf\xc3\xa9 \\\"x\\\"\", \"arguments\": null}"},
      {"a", "{}"},
      {"b", "null"}},
     3,
     "",
     true,
     true},
    {PD_TOOL_HERMES, "[]", "", {{0}}, 0, "", false, true},
};
#define N_CASES (sizeof CASES / sizeof CASES[0])

static bool id_ok(pd_tool_kind k, const char *id)
{
    size_t n = strlen(id);
    if (k == PD_TOOL_MISTRAL) {
        if (n != 9) return false;
        for (size_t i = 0; i < n; i++)
            if (!strchr("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", id[i]))
                return false;
        return true;
    }
    if (n != 14 + 32 || strncmp(id, "chatcmpl-tool-", 14) != 0) return false;
    for (size_t i = 14; i < n; i++)
        if (!strchr("0123456789abcdef", id[i])) return false;
    return true;
}

TEST(tool_extract_as_vllm)
{
    for (size_t t = 0; t < N_CASES; t++) {
        const tool_case *e = &CASES[t];
        pd_tool_calls r;
        if (e->required)
            ASSERT_OK(pd_tool_extract_forced(NULL, e->text, strlen(e->text), 42 + t, &r));
        else
            ASSERT_OK(pd_tool_extract(e->kind, e->text, strlen(e->text), 42 + t, &r));
        ASSERT_MSG((size_t)e->n == r.n, "case %zu: %zu calls, want %d", t, r.n, e->n);
        if (e->content) {
            ASSERT_MSG(r.content && r.content_len == strlen(e->content) &&
                           memcmp(r.content, e->content, r.content_len) == 0,
                       "case %zu: content '%.*s', want '%s'", t, (int)r.content_len,
                       r.content ? r.content : "(null)", e->content);
        } else {
            ASSERT_MSG(!r.content, "case %zu: content '%s', want null", t, r.content);
        }
        for (int i = 0; i < e->n; i++) {
            ASSERT_MSG(strcmp(r.calls[i].name, e->calls[i].name) == 0, "case %zu: name '%s'", t,
                       r.calls[i].name);
            ASSERT_MSG(strcmp(r.calls[i].arguments, e->calls[i].args) == 0,
                       "case %zu call %d: arguments '%s', want '%s'", t, i, r.calls[i].arguments,
                       e->calls[i].args);
            ASSERT_MSG(id_ok(e->kind, r.calls[i].id), "case %zu: id '%s'", t, r.calls[i].id);
            if (i) ASSERT(strcmp(r.calls[i].id, r.calls[i - 1].id) != 0);
        }
        pd_tool_calls_free(&r);
    }
}

/* ---- streaming ---- */

typedef struct {
    char content[1024];
    size_t content_len;
    bool any_content;
    char names[MAX_CALLS][64], ids[MAX_CALLS][48], args[MAX_CALLS][512];
    int n;
    bool called;
    char err[256];
} streamed;

/* Appends delta d to s; false (s->err set) when it breaks the shape vLLM sends. */
static bool take(streamed *s, const pd_tool_delta *d)
{
    if (d->content) {
        if (s->content_len + d->content_len >= sizeof s->content) return false;
        memcpy(s->content + s->content_len, d->content, d->content_len);
        s->content_len += d->content_len;
        s->any_content = true;
    }
    for (size_t i = 0; i < d->n_calls; i++) {
        const pd_tool_delta_call *c = &d->calls[i];
        if (c->first) {
            if (c->index != s->n) {
                snprintf(s->err, sizeof s->err, "first delta of call %d, expected %d", c->index,
                         s->n);
                return false;
            }
            snprintf(s->names[s->n], sizeof s->names[0], "%s", c->name);
            snprintf(s->ids[s->n], sizeof s->ids[0], "%s", c->id);
            s->args[s->n][0] = '\0';
            s->n++;
        } else if (c->index < 0 || c->index >= s->n) {
            snprintf(s->err, sizeof s->err, "arguments of call %d before its name", c->index);
            return false;
        } else if (!c->args_len) {
            snprintf(s->err, sizeof s->err, "an empty delta of call %d", c->index);
            return false;
        }
        if ((c->args != NULL) != (c->args_len > 0)) {
            snprintf(s->err, sizeof s->err, "call %d: an arguments key without arguments",
                     c->index);
            return false;
        }
        if (c->args_len) strncat(s->args[c->index], c->args, c->args_len);
    }
    return true;
}

/* Streams text cut at the offsets cuts[0..n_cuts) (increasing). */
static bool stream_text(const tool_case *e, const char *text, const size_t *cuts, size_t n_cuts,
                        streamed *s)
{
    memset(s, 0, sizeof *s);
    pd_tool_stream *st =
        e->required ? pd_tool_stream_create_forced(NULL, 7) : pd_tool_stream_create(e->kind, 7);
    if (!st) return false;
    size_t at = 0, len = strlen(text);
    bool ok = true;
    for (size_t i = 0; i <= n_cuts && ok; i++) {
        size_t end = i < n_cuts ? cuts[i] : len;
        pd_tool_delta d;
        ok = pd_tool_stream_feed(st, text + at, end - at, i == n_cuts, &d) == PD_OK && take(s, &d);
        at = end;
    }
    s->called = pd_tool_stream_called(st);
    pd_tool_stream_free(st);
    return ok;
}

static bool same(const tool_case *e, const streamed *s, char *why, size_t n)
{
    if (s->content_len != strlen(e->streamed) || memcmp(s->content, e->streamed, s->content_len)) {
        snprintf(why, n, "content '%.*s'", (int)s->content_len, s->content);
        return false;
    }
    int want = e->stream_calls ? e->n : 0;
    if (s->n != want || s->called != (want > 0)) {
        snprintf(why, n, "%d calls (called %d)", s->n, s->called);
        return false;
    }
    for (int i = 0; i < want; i++) {
        if (strcmp(s->names[i], e->calls[i].name) || strcmp(s->args[i], e->calls[i].args) ||
            !id_ok(e->kind, s->ids[i])) {
            snprintf(why, n, "call %d: %s %s args '%s'", i, s->ids[i], s->names[i], s->args[i]);
            return false;
        }
    }
    return true;
}

TEST(tool_stream_every_split)
{
    for (size_t t = 0; t < N_CASES; t++) {
        const tool_case *e = &CASES[t];
        if (!e->streamed) continue;
        size_t len = strlen(e->text);
        streamed s;
        char why[512];
        /* one delta; then two, cut at every byte */
        for (size_t cut = 0; cut <= len; cut++) {
            ASSERT_MSG(stream_text(e, e->text, &cut, cut < len ? 1 : 0, &s), "case %zu cut %zu: %s",
                       t, cut, s.err);
            ASSERT_MSG(same(e, &s, why, sizeof why), "case %zu cut %zu: %s", t, cut, why);
        }
        /* byte by byte */
        size_t *cuts = malloc(len * sizeof *cuts);
        ASSERT(cuts);
        for (size_t i = 0; i + 1 < len; i++) cuts[i] = i + 1;
        bool ok = stream_text(e, e->text, cuts, len ? len - 1 : 0, &s);
        free(cuts);
        ASSERT_MSG(ok, "case %zu bytewise: %s", t, s.err);
        ASSERT_MSG(same(e, &s, why, sizeof why), "case %zu bytewise: %s", t, why);
    }
}

/* The first delta of a call carries id, type and name; a value is sent only once the text
 * fixes it: a number waits for what ends it, a string's characters go out as they come. */
TEST(tool_stream_delta_shape)
{
    pd_tool_stream *st = pd_tool_stream_create(PD_TOOL_HERMES, 3);
    ASSERT(st);
    pd_tool_delta d;
    const char *parts[] = {"Hi <tool", "_call>{\"name\": \"get_w",
                           "eather\", \"arguments\": {\"n\": 1", "2, \"s\": \"ab",
                           "c\"}}</tool_call>"};
    ASSERT_OK(pd_tool_stream_feed(st, parts[0], strlen(parts[0]), false, &d));
    ASSERT(d.content && d.content_len == 3 && memcmp(d.content, "Hi ", 3) == 0);
    ASSERT_EQ_INT(d.n_calls, 0);
    ASSERT_OK(pd_tool_stream_feed(st, parts[1], strlen(parts[1]), false, &d));
    ASSERT(!d.content && d.n_calls == 0); /* the name is not whole yet: no chunk */
    ASSERT_OK(pd_tool_stream_feed(st, parts[2], strlen(parts[2]), false, &d));
    ASSERT_EQ_INT(d.n_calls, 1);
    ASSERT(d.calls[0].first && strcmp(d.calls[0].name, "get_weather") == 0);
    ASSERT(id_ok(PD_TOOL_HERMES, d.calls[0].id));
    ASSERT(d.calls[0].args_len == 6 && memcmp(d.calls[0].args, "{\"n\": ", 6) == 0);
    ASSERT_OK(pd_tool_stream_feed(st, parts[3], strlen(parts[3]), false, &d));
    ASSERT(d.n_calls == 1 && !d.calls[0].first && d.calls[0].index == 0);
    ASSERT(d.calls[0].args_len == 12 && memcmp(d.calls[0].args, "12, \"s\": \"ab", 12) == 0);
    ASSERT_OK(pd_tool_stream_feed(st, parts[4], strlen(parts[4]), false, &d));
    ASSERT(d.n_calls == 1 && d.calls[0].args_len == 3 && memcmp(d.calls[0].args, "c\"}", 3) == 0);
    ASSERT_OK(pd_tool_stream_feed(st, "", 0, true, &d));
    ASSERT(!d.content && d.n_calls == 0);
    ASSERT(pd_tool_stream_called(st));
    pd_tool_stream_free(st);
}

TEST(tool_kind_names)
{
    pd_tool_kind k;
    ASSERT_OK(pd_tool_kind_from_name("llama3_json", &k));
    ASSERT_EQ_INT(k, PD_TOOL_LLAMA3_JSON);
    ASSERT(pd_tool_kind_from_name("pythonic", &k) == PD_EINVAL);
    ASSERT(strstr(pd_last_error(), "hermes, llama3_json or mistral"));
    ASSERT(strcmp(pd_tool_required_token(PD_TOOL_MISTRAL), "[TOOL_CALLS]") == 0);
    ASSERT(!pd_tool_required_token(PD_TOOL_HERMES));
}

/* "required" text that is not an array of {name, parameters: object or null} is refused with a
 * message (vLLM's validation error, a 400); what streamed of a cut call stays streamed. */
TEST(tool_required_refused)
{
    static const char *const bad[] = {
        "[{\"name\": \"a\", \"parameters\": {\"x\": 1", /* max_tokens cut it */
        "",
        "{\"name\": \"a\", \"parameters\": {}}",
        "[{\"name\": \"a\", \"arguments\": {}}]",
        "[{\"name\": \"a\"}]",
        "[{\"name\": 1, \"parameters\": {}}]",
        "[{\"name\": \"a\", \"parameters\": 3}]",
        "[{\"name\": \"a\", \"parameters\": [1]}]",
        "[{\"name\": \"a\", \"parameters\": {}}] x",
        "[{\"name\": \"a\", \"parameters\": {}},]",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        pd_tool_calls r;
        ASSERT_MSG(pd_tool_extract_forced(NULL, bad[i], strlen(bad[i]), 1, &r) == PD_EINVAL,
                   "case %zu accepted", i);
        ASSERT(strstr(pd_last_error(), "not a JSON array"));
        ASSERT(r.n == 0 && !r.calls && !r.content);
    }
    pd_tool_stream *st = pd_tool_stream_create_forced(NULL, 5);
    ASSERT(st);
    pd_tool_delta d;
    ASSERT_OK(pd_tool_stream_feed(st, bad[0], strlen(bad[0]), false, &d));
    ASSERT(!d.content && d.n_calls == 1 && d.calls[0].first);
    ASSERT(strcmp(d.calls[0].name, "a") == 0 && id_ok(PD_TOOL_HERMES, d.calls[0].id));
    ASSERT(d.calls[0].args_len == 6 && memcmp(d.calls[0].args, "{\"x\": ", 6) == 0);
    ASSERT_OK(pd_tool_stream_feed(st, "", 0, true, &d)); /* the end: the call is not whole */
    ASSERT(!d.content && d.n_calls == 0);
    ASSERT(pd_tool_stream_called(st));
    pd_tool_stream_free(st);
}

/* A named function: the text is the arguments as generated, content ""; streamed, every delta
 * (an empty one too) is an arguments delta of call 0, the first with id and name, and the
 * finish reason stays the generation's. */
TEST(tool_named)
{
    const char *text = "{ \"city\" :\"Paris\"}";
    pd_tool_calls r;
    ASSERT_OK(pd_tool_extract_forced("get_weather", text, strlen(text), 9, &r));
    ASSERT(r.n == 1 && r.content && r.content_len == 0 && r.content[0] == '\0');
    ASSERT(strcmp(r.calls[0].name, "get_weather") == 0 && strcmp(r.calls[0].arguments, text) == 0);
    ASSERT(id_ok(PD_TOOL_HERMES, r.calls[0].id));
    pd_tool_calls_free(&r);

    pd_tool_stream *st = pd_tool_stream_create_forced("get_weather", 9);
    ASSERT(st);
    const char *parts[] = {"{ \"ci", "", "ty\" :\"Paris\"}", ""};
    char args[64] = "";
    char id[48] = "";
    for (int i = 0; i < 4; i++) {
        pd_tool_delta d;
        ASSERT_OK(pd_tool_stream_feed(st, parts[i], strlen(parts[i]), i == 3, &d));
        ASSERT(!d.content && d.n_calls == 1 && d.calls[0].index == 0);
        ASSERT(d.calls[0].first == (i == 0) && d.calls[0].args);
        ASSERT(d.calls[0].args_len == strlen(parts[i]));
        if (i == 0) {
            ASSERT(strcmp(d.calls[0].name, "get_weather") == 0);
            ASSERT(id_ok(PD_TOOL_HERMES, d.calls[0].id));
            snprintf(id, sizeof id, "%s", d.calls[0].id);
        }
        strncat(args, d.calls[0].args, d.calls[0].args_len);
    }
    ASSERT(strcmp(args, text) == 0 && id[0]);
    ASSERT(!pd_tool_stream_called(st));
    pd_tool_stream_free(st);
}
