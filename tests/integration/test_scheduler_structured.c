/* Structured output through the 1P1D cluster (docs/structured_output.md): the guide's Knight
 * example, response_format json_object and json_schema, guided_regex, guided_choice,
 * guided_grammar, streaming, n = 3, the legacy /generate, and split serving equal to colocated
 * (a second api-server with --max-local-prefill-length, whose decode instance prefills itself).
 * The model has random weights: whatever an answer says, one that finishes with "stop" must be
 * valid, which an independent validator (Debian's python3-jsonschema, scheduler_common.h's
 * validate) checks. */
#define _GNU_SOURCE
#include "scheduler_common.h"

#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The guide's guided_json (Steps 9's structured-output example), as it is sent: a string. */
static const char KNIGHT_SCHEMA[] =
    "{\"title\": \"Character\", \"type\": \"object\", \"properties\": {\"name\": {\"title\": "
    "\"Name\", \"maxLength\": 10, \"type\": \"string\"}, \"age\": {\"title\": \"Age\", \"type\": "
    "\"integer\"}, \"armor\": {\"$ref\": \"#/definitions/Armor\"}, \"weapon\": {\"$ref\": "
    "\"#/definitions/Weapon\"}, \"strength\": {\"title\": \"Strength\", \"type\": \"integer\"}}, "
    "\"required\": [\"name\", \"age\", \"armor\", \"weapon\", \"strength\"], \"definitions\": "
    "{\"Armor\": {\"title\": \"Armor\", \"description\": \"An enumeration.\", \"enum\": "
    "[\"leather\", \"chainmail\", \"plate\"], \"type\": \"string\"}, \"Weapon\": {\"title\": "
    "\"Weapon\", \"description\": \"An enumeration.\", \"enum\": [\"sword\", \"axe\", \"mace\", "
    "\"spear\", \"bow\", \"crossbow\"], \"type\": \"string\"}}}";

static const char KNIGHT_PROMPT[] =
    "Meet our valorous character, named Knight, who has reached the age of 32. Clad in "
    "impenetrable plate armor, Knight is well-prepared for any battle. Armed with a trusty sword "
    "and boasting a strength score of 90, this character stands as a formidable warrior on the "
    "field.Please provide details for this character, including their Name, Age, preferred "
    "Armor, Weapon, and Strength";

/* The text of choice i of a completions (or chat) response, and its finish reason. */
static const char *choice_text(const json_t *o, size_t i, const char **finish)
{
    const json_t *c = json_array_get(json_object_get(o, "choices"), i);
    *finish = json_string_value(json_object_get(c, "finish_reason"));
    const json_t *t = json_object_get(c, "text");
    if (!t) t = json_object_get(json_object_get(c, "message"), "content");
    return json_string_value(t);
}

/* The guide's example, literally but for max_tokens (the random model writes whitespace): the
 * answer is a Character; other seeds and temperatures too. */
TEST(sched_structured_knight)
{
    FIXTURE();
    char *body = malloc(8192);
    ASSERT(body);
    json_t *js = json_string(KNIGHT_SCHEMA);
    char *sj = json_dumps(js, JSON_ENCODE_ANY);
    json_decref(js);
    int stops = 0;
    for (int k = 0; k < 4; k++) {
        snprintf(body, 8192,
                 "{\"model\":\"tiny\",\"prompt\":\"%s\",\"max_tokens\":360,\"temperature\":%s,"
                 "\"seed\":%d,\"guided_json\":%s}",
                 KNIGHT_PROMPT, k == 0 ? "0" : "1.0", k, sj);
        int st = 0;
        json_t *o = post_json(g_port, "/v1/completions", body, &st);
        ASSERT_EQ_INT(st, 200);
        const char *finish, *text = choice_text(o, 0, &finish);
        ASSERT(text && finish);
        if (strcmp(finish, "stop") == 0) {
            char why[2048];
            ASSERT_MSG(validate(KNIGHT_SCHEMA, text, why, sizeof why) == 0, "%s\n%s", text, why);
            stops++;
        }
        json_decref(o);
    }
    ASSERT_MSG(stops >= 3, "only %d of 4 answers finished", stops);
    free(sj);
    free(body);
}

/* Each kind of constraint, through the split cluster. */
TEST(sched_structured_kinds)
{
    FIXTURE();
    char why[2048];
    int st;
    /* response_format json_object (chat): an object */
    json_t *o = post_json(g_port, "/v1/chat/completions",
                          "{\"messages\":[{\"role\":\"user\",\"content\":\"JSON please\"}],"
                          "\"max_tokens\":300,\"seed\":3,\"response_format\":{\"type\":"
                          "\"json_object\"}}",
                          &st);
    ASSERT_EQ_INT(st, 200);
    const char *finish, *text = choice_text(o, 0, &finish);
    ASSERT(text);
    if (strcmp(finish, "stop") == 0)
        ASSERT_MSG(validate("{\"type\":\"object\"}", text, why, sizeof why) == 0, "%s\n%s", text,
                   why);
    else
        ASSERT_STR_EQ(finish, "length");
    ASSERT_EQ_INT(text[0], '{');
    json_decref(o);
    /* response_format json_schema (chat), n = 3: every choice */
    static const char SCH[] = "{\"type\":\"object\",\"properties\":{\"ok\":{\"type\":\"boolean\"},"
                              "\"n\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":99}},"
                              "\"required\":[\"ok\",\"n\"]}";
    char body[2048];
    snprintf(body, sizeof body,
             "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":200,\"n\":3,"
             "\"seed\":5,\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":"
             "\"r\",\"strict\":true,\"schema\":%s}}}",
             SCH);
    o = post_json(g_port, "/v1/chat/completions", body, &st);
    ASSERT_EQ_INT(st, 200);
    ASSERT_EQ_INT(json_array_size(json_object_get(o, "choices")), 3);
    for (size_t i = 0; i < 3; i++) {
        text = choice_text(o, i, &finish);
        ASSERT_MSG(strcmp(finish, "stop") == 0, "choice %zu: %s after %s", i, finish, text);
        ASSERT_MSG(validate(SCH, text, why, sizeof why) == 0, "%s\n%s", text, why);
    }
    json_decref(o);
    /* guided_regex: the whole answer matches */
    o = post_json(g_port, "/v1/completions",
                  "{\"prompt\":\"id:\",\"max_tokens\":40,\"seed\":1,"
                  "\"guided_regex\":\"[a-z]{3}-[0-9]{2,4}\"}",
                  &st);
    ASSERT_EQ_INT(st, 200);
    text = choice_text(o, 0, &finish);
    ASSERT_STR_EQ(finish, "stop");
    regex_t re;
    ASSERT(regcomp(&re, "^[a-z]{3}-[0-9]{2,4}$", REG_EXTENDED | REG_NOSUB) == 0);
    ASSERT_MSG(regexec(&re, text, 0, NULL, 0) == 0, "%s", text);
    regfree(&re);
    json_decref(o);
    /* guided_choice, n = 3 */
    o = post_json(g_port, "/v1/completions",
                  "{\"prompt\":\"Is it?\",\"max_tokens\":20,\"n\":3,\"seed\":2,"
                  "\"guided_choice\":[\"yes\",\"no\",\"maybe not\"]}",
                  &st);
    ASSERT_EQ_INT(st, 200);
    for (size_t i = 0; i < 3; i++) {
        text = choice_text(o, i, &finish);
        ASSERT_STR_EQ(finish, "stop");
        ASSERT_MSG(!strcmp(text, "yes") || !strcmp(text, "no") || !strcmp(text, "maybe not"), "%s",
                   text);
    }
    json_decref(o);
    /* guided_grammar (GBNF): a sum of two digits in parentheses */
    o = post_json(
        g_port, "/v1/completions",
        "{\"prompt\":\"sum:\",\"max_tokens\":20,\"seed\":4,"
        "\"guided_grammar\":\"root ::= \\\"(\\\" d \\\"+\\\" d \\\")\\\"\\nd ::= [0-9]\"}",
        &st);
    ASSERT_EQ_INT(st, 200);
    text = choice_text(o, 0, &finish);
    ASSERT_STR_EQ(finish, "stop");
    ASSERT_MSG(strlen(text) == 5 && text[0] == '(' && text[2] == '+' && text[4] == ')', "%s", text);
    json_decref(o);
    /* legacy /generate with guided_json */
    http_resp r;
    ASSERT(http_do(g_port_legacy, "POST", "/generate", NULL,
                   "{\"prompt\":\"a\",\"max_tokens\":30,\"seed\":1,"
                   "\"guided_json\":{\"enum\":[\"red\",\"green\",7]}}",
                   &r) == 0);
    ASSERT_MSG(r.status == 200, "%d %s", r.status, r.body);
    o = json_loads(r.body, 0, NULL);
    resp_free(&r);
    const char *t = json_string_value(json_array_get(json_object_get(o, "text"), 0));
    ASSERT_MSG(t && (strstr(t, "a\"red\"") || strstr(t, "a\"green\"") || strstr(t, "a7")), "%s",
               t ? t : "(none)");
    json_decref(o);
}

/* An ambiguous guided_grammar (its parses double with every "a"; min_tokens keeps EOS out): the
 * request ends with a 500 in the decode instance's words, naming the grammar or the mask, in
 * bounded time, and the cluster serves on. */
TEST(sched_structured_ambiguous_grammar_ends_with_an_error)
{
    FIXTURE();
    int st;
    json_t *o = post_json(g_port, "/v1/completions",
                          "{\"prompt\":\"a\",\"max_tokens\":200,\"min_tokens\":100,\"seed\":2,"
                          "\"guided_grammar\":\"root: \\\"a\\\" (root | )+\\n\"}",
                          &st);
    char *dump = o ? json_dumps(o, JSON_COMPACT) : NULL;
    ASSERT_MSG(st == 500, "%d %s", st, dump ? dump : "(no body)");
    ASSERT_MSG(dump && (strstr(dump, "too ambiguous") || strstr(dump, "token mask failed")),
               "%d %s", st, dump ? dump : "(no body)");
    free(dump);
    json_decref(o);
    o = post_json(g_port, "/v1/completions",
                  "{\"prompt\":\"a\",\"max_tokens\":8,\"seed\":2,\"guided_choice\":[\"x\",\"y\"]}",
                  &st);
    ASSERT_EQ_INT(st, 200);
    json_decref(o);
}

/* Streaming: the deltas concatenate to the non-streamed answer (seeded), which is valid. */
TEST(sched_structured_stream_equals_full)
{
    FIXTURE();
    static const char SCH[] = "{\"type\":\"array\",\"items\":{\"enum\":[\"ab\",\"cd\",1.5]},"
                              "\"minItems\":2,\"maxItems\":4}";
    char body[1024];
    snprintf(body, sizeof body,
             "{\"prompt\":\"list:\",\"max_tokens\":120,\"seed\":9,\"guided_json\":%s%s}", SCH, "");
    int st;
    json_t *o = post_json(g_port, "/v1/completions", body, &st);
    ASSERT_EQ_INT(st, 200);
    const char *finish, *full = choice_text(o, 0, &finish);
    ASSERT_STR_EQ(finish, "stop");
    char why[2048];
    ASSERT_MSG(validate(SCH, full, why, sizeof why) == 0, "%s\n%s", full, why);
    snprintf(body, sizeof body,
             "{\"prompt\":\"list:\",\"max_tokens\":120,\"seed\":9,\"stream\":true,"
             "\"guided_json\":%s}",
             SCH);
    http_resp r;
    ASSERT(http_do(g_port, "POST", "/v1/completions", NULL, body, &r) == 0);
    ASSERT_EQ_INT(r.status, 200);
    char *ev[256];
    int n = cl_sse_events(r.body, ev, 256);
    ASSERT(n >= 2);
    ASSERT_STR_EQ(ev[n - 1], "[DONE]");
    char text[4096] = "";
    for (int i = 0; i < n - 1; i++) {
        json_t *c = json_loads(ev[i], 0, NULL);
        ASSERT(c);
        const char *f, *d = choice_text(c, 0, &f);
        if (d) strncat(text, d, sizeof text - strlen(text) - 1);
        json_decref(c);
    }
    ASSERT_STR_EQ(text, full);
    resp_free(&r);
    json_decref(o);
}

/* Split serving (prefill samples the first token, decode the rest) equals colocated serving
 * (the decode instance prefills itself), greedy and seeded: both sides apply the same grammar
 * from the same state. */
TEST(sched_structured_split_equals_colocated)
{
    FIXTURE();
    cl_proc lp;
    int lport = 0;
    ASSERT_MSG(start_colocated_scheduler(&lp, &lport, "scheduler_local") == 0,
               "pd-scheduler with --max-local-prefill-length did not start");
    json_t *js = json_string(KNIGHT_SCHEMA);
    char *sj = json_dumps(js, JSON_ENCODE_ANY);
    json_decref(js);
    char *body = malloc(8192);
    ASSERT(body && sj);
    static const char *const sampling[] = {"\"temperature\":0", "\"temperature\":1,\"seed\":11",
                                           "\"temperature\":0.8,\"top_p\":0.9,\"seed\":12"};
    for (size_t k = 0; k < 3; k++) {
        snprintf(body, 8192, "{\"prompt\":\"%s\",\"max_tokens\":360,%s,\"guided_json\":%s}",
                 KNIGHT_PROMPT, sampling[k], sj);
        int s1, s2;
        json_t *a = post_json(g_port, "/v1/completions", body, &s1);
        json_t *b = post_json(lport, "/v1/completions", body, &s2);
        ASSERT_EQ_INT(s1, 200);
        ASSERT_EQ_INT(s2, 200);
        const char *fa, *fb, *ta = choice_text(a, 0, &fa), *tb = choice_text(b, 0, &fb);
        ASSERT_MSG(ta && tb && strcmp(ta, tb) == 0, "split:\n%s\ncolocated:\n%s", ta, tb);
        ASSERT_STR_EQ(fa, fb);
        json_decref(a);
        json_decref(b);
    }
    free(body);
    free(sj);
    ASSERT_EQ_INT(cl_stop(&lp, 10000), 0);
}

/* Tool calling end to end with tool_choice "auto" (--tool-call-parser hermes): a grammar makes
 * the random model write a hermes call, which the parser turns into `tool_calls`, streamed and
 * not, with finish_reason "tool_calls". */
TEST(sched_structured_forces_auto_tool_call)
{
    FIXTURE();
    char *flags[] = {"--enable-auto-tool-choice", "--tool-call-parser", "hermes", NULL};
    cl_proc sp;
    int port = 0;
    ASSERT_MSG(start_scheduler(&sp, &port, "scheduler_tool_grammar", flags, "1") == 0,
               "pd-scheduler with --tool-call-parser hermes did not start");
    static const char BODY[] =
        "{\"messages\":[{\"role\":\"user\",\"content\":\"Weather in Paris?\"}],\"tools\":[{"
        "\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":"
        "\"object\",\"properties\":{\"city\":{\"type\":\"string\"}},\"required\":[\"city\"]}}}],"
        "\"max_tokens\":80,\"seed\":7%s,\"guided_regex\":\"<tool_call>\\\\n\\\\{\\\"name\\\": "
        "\\\"get_weather\\\", \\\"arguments\\\": \\\\{\\\"city\\\": \\\"(Paris|Lima)\\\"\\\\}\\\\}"
        "\\\\n</tool_call>\"}";
    char body[2048];
    snprintf(body, sizeof body, BODY, "");
    int st;
    json_t *o = post_json(port, "/v1/chat/completions", body, &st);
    ASSERT_EQ_INT(st, 200);
    const json_t *c = json_array_get(json_object_get(o, "choices"), 0);
    ASSERT_STR_EQ(json_string_value(json_object_get(c, "finish_reason")), "tool_calls");
    const json_t *msg = json_object_get(c, "message");
    ASSERT(json_is_null(json_object_get(msg, "content")));
    const json_t *call = json_array_get(json_object_get(msg, "tool_calls"), 0);
    const json_t *fn = json_object_get(call, "function");
    ASSERT_STR_EQ(json_string_value(json_object_get(fn, "name")), "get_weather");
    const char *args = json_string_value(json_object_get(fn, "arguments"));
    ASSERT_MSG(
        args && (!strcmp(args, "{\"city\": \"Paris\"}") || !strcmp(args, "{\"city\": \"Lima\"}")),
        "%s", args ? args : "(none)");
    ASSERT(is_id(json_string_value(json_object_get(call, "id")), "chatcmpl-tool-"));
    /* streamed: the same call in deltas, the arguments concatenating to the same string */
    snprintf(body, sizeof body, BODY, ",\"stream\":true");
    http_resp r;
    ASSERT(http_do(port, "POST", "/v1/chat/completions", NULL, body, &r) == 0);
    ASSERT_EQ_INT(r.status, 200);
    char *ev[128];
    int n = cl_sse_events(r.body, ev, 128);
    char streamed[256] = "", name[64] = "", finish[32] = "";
    for (int i = 0; i < n - 1; i++) {
        json_t *k = json_loads(ev[i], 0, NULL);
        ASSERT(k);
        const json_t *ch = json_array_get(json_object_get(k, "choices"), 0);
        const json_t *d = json_object_get(json_object_get(ch, "delta"), "tool_calls");
        const json_t *f = json_object_get(json_array_get(d, 0), "function");
        if (json_is_string(json_object_get(f, "name")))
            snprintf(name, sizeof name, "%s", json_string_value(json_object_get(f, "name")));
        if (json_is_string(json_object_get(f, "arguments")))
            strncat(streamed, json_string_value(json_object_get(f, "arguments")),
                    sizeof streamed - strlen(streamed) - 1);
        if (json_is_string(json_object_get(ch, "finish_reason")))
            snprintf(finish, sizeof finish, "%s",
                     json_string_value(json_object_get(ch, "finish_reason")));
        json_decref(k);
    }
    ASSERT_STR_EQ(name, "get_weather");
    ASSERT_STR_EQ(streamed, args);
    ASSERT_STR_EQ(finish, "tool_calls");
    resp_free(&r);
    json_decref(o);
    ASSERT_EQ_INT(cl_stop(&sp, 10000), 0);
}
