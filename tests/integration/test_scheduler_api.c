/* pd-scheduler's routes and shapes: /health, /version, /v1/models, 404/405, the API key, the
 * body limit and the order of the checks before it (§2, §3), the completions and chat bodies and
 * streams key for key (§10, §11: streamed text equals non-streamed text under greedy), n=2 with
 * several prompts. */
#define _GNU_SOURCE
#include "scheduler_common.h"

#include <stdlib.h>

/* ---- tests --------------------------------------------------------------------------------- */

TEST(sched_health_version_models)
{
    FIXTURE();
    http_resp r;
    ASSERT(http_do(g_port, "GET", "/health", NULL, NULL, &r) == 0);
    ASSERT_EQ_INT(r.status, 200);
    ASSERT_EQ_INT(r.body_len, 0);
    resp_free(&r);
    ASSERT(http_do(g_port, "GET", "/version", NULL, NULL, &r) == 0);
    ASSERT_EQ_INT(r.status, 200);
    ASSERT_STR_EQ(r.body, "{\"version\":\"0.1.0\"}");
    resp_free(&r);
    ASSERT(http_do(g_port, "GET", "/v1/models", NULL, NULL, &r) == 0);
    ASSERT_EQ_INT(r.status, 200);
    json_t *o = json_loads(r.body, 0, NULL);
    ASSERT(o);
    json_t *data = json_object_get(o, "data");
    ASSERT_EQ_INT(json_array_size(data), 2);
    char keys[512];
    keys_of(json_array_get(data, 0), keys, sizeof keys);
    ASSERT_STR_EQ(keys, "id,object,created,owned_by,root,parent,max_model_len,permission");
    ASSERT_STR_EQ(json_string_value(json_object_get(json_array_get(data, 1), "id")), "tiny-alias");
    ASSERT_EQ_INT(json_integer_value(json_object_get(json_array_get(data, 0), "max_model_len")),
                  512);
    const char *perm = json_string_value(json_object_get(
        json_array_get(json_object_get(json_array_get(data, 0), "permission"), 0), "id"));
    ASSERT(is_id(perm, "modelperm-"));
    json_decref(o);
    resp_free(&r);
}

TEST(sched_404_405)
{
    FIXTURE();
    http_resp r;
    ASSERT(http_do(g_port, "GET", "/nope", NULL, NULL, &r) == 0);
    ASSERT_EQ_INT(r.status, 404);
    ASSERT_STR_EQ(r.body, "{\"error\":{\"message\":\"Not Found\",\"type\":\"NotFoundError\","
                          "\"param\":null,\"code\":404}}");
    resp_free(&r);
    ASSERT(http_do(g_port, "POST", "/generate", NULL, "{}", &r) == 0);
    ASSERT_EQ_INT(r.status, 404); /* the legacy route is not served with USE_OPENAI=1 */
    resp_free(&r);
    ASSERT(http_do(g_port, "GET", "/v1/completions", NULL, NULL, &r) == 0);
    ASSERT_EQ_INT(r.status, 405);
    char h[64];
    ASSERT_STR_EQ(header(&r, "Allow", h, sizeof h), "POST");
    ASSERT_CONTAINS(r.body, "\"type\":\"MethodNotAllowedError\"");
    ASSERT_CONTAINS(r.body, "\"message\":\"Method Not Allowed\"");
    resp_free(&r);
    ASSERT(http_do(g_port, "POST", "/health", NULL, "", &r) == 0);
    ASSERT_EQ_INT(r.status, 405);
    ASSERT_STR_EQ(header(&r, "Allow", h, sizeof h), "GET");
    resp_free(&r);
}

/* vLLM's /tokenize (a completions or a chat body) and /detokenize, and the probes /ping,
 * /v2/health/live and /v2/health/ready. The ids /tokenize gives are the ones a completion
 * counts as its prompt (usage), the chat form renders the template (more tokens than the bare
 * text), and /detokenize gives the text back. */
TEST(sched_tokenize_detokenize_probes)
{
    FIXTURE();
    http_resp r;
    const char *probes[][2] = {{"GET", "/ping"},
                               {"POST", "/ping"},
                               {"GET", "/v2/health/live"},
                               {"GET", "/v2/health/ready"}};
    for (size_t i = 0; i < 4; i++) {
        ASSERT(http_do(g_port, probes[i][0], probes[i][1], NULL, i == 1 ? "" : NULL, &r) == 0);
        ASSERT_MSG(r.status == 200, "%s %s: %d", probes[i][0], probes[i][1], r.status);
        resp_free(&r);
    }
    ASSERT(http_do(g_port, "DELETE", "/ping", NULL, NULL, &r) == 0);
    ASSERT_EQ_INT(r.status, 405);
    char h[64];
    ASSERT_STR_EQ(header(&r, "Allow", h, sizeof h), "GET, POST");
    resp_free(&r);

    ASSERT(http_do(g_port, "POST", "/tokenize", NULL,
                   "{\"model\":\"tiny\",\"prompt\":\"Hello world\",\"return_token_strs\":true}",
                   &r) == 0);
    ASSERT_EQ_INT(r.status, 200);
    json_t *o = json_loads(r.body, 0, NULL);
    resp_free(&r);
    ASSERT(o);
    json_t *toks = json_object_get(o, "tokens");
    size_t n = json_array_size(toks);
    ASSERT(n > 0);
    ASSERT_EQ_INT(json_integer_value(json_object_get(o, "count")), (int64_t)n);
    ASSERT_EQ_INT(json_integer_value(json_object_get(o, "max_model_len")), 512);
    ASSERT_EQ_INT(json_array_size(json_object_get(o, "token_strs")), n);
    /* the same prompt as a completion: its usage counts those tokens */
    ASSERT(http_do(g_port, "POST", "/v1/completions", NULL,
                   "{\"prompt\":\"Hello world\",\"max_tokens\":1}", &r) == 0);
    ASSERT_EQ_INT(r.status, 200);
    char want[64];
    snprintf(want, sizeof want, "\"prompt_tokens\":%zu", n);
    ASSERT_CONTAINS(r.body, want);
    resp_free(&r);
    /* back to text */
    char body[4096];
    size_t o2 = (size_t)snprintf(body, sizeof body, "{\"model\":\"tiny\",\"tokens\":[");
    for (size_t i = 0; i < n; i++)
        o2 += (size_t)snprintf(body + o2, sizeof body - o2, "%s%lld", i ? "," : "",
                               (long long)json_integer_value(json_array_get(toks, i)));
    snprintf(body + o2, sizeof body - o2, "]}");
    json_decref(o);
    ASSERT(http_do(g_port, "POST", "/detokenize", NULL, body, &r) == 0);
    ASSERT_EQ_INT(r.status, 200);
    ASSERT_CONTAINS(r.body, "Hello world\"}");
    resp_free(&r);
    /* the chat form renders the template around the message */
    ASSERT(http_do(g_port, "POST", "/tokenize", NULL,
                   "{\"messages\":[{\"role\":\"user\",\"content\":\"Hello world\"}]}", &r) == 0);
    ASSERT_EQ_INT(r.status, 200);
    o = json_loads(r.body, 0, NULL);
    ASSERT(o);
    ASSERT_MSG(json_array_size(json_object_get(o, "tokens")) > n, "%s", r.body);
    ASSERT(json_is_null(json_object_get(o, "token_strs")));
    json_decref(o);
    resp_free(&r);
    /* refusals as the generation routes give them */
    static const struct {
        const char *path, *body;
        int status;
        const char *message;
    } refused[] = {
        {"/tokenize", "{\"model\":\"nope\",\"prompt\":\"x\"}", 404,
         "The model `nope` does not exist."},
        {"/detokenize", "{\"tokens\":[1,99999999]}", 400, "Token id 99999999 is out of vocabulary"},
        {"/detokenize", "{\"model\":\"tiny\"}", 400, "The field `tokens` is required."},
        {"/tokenize", "{\"prompt\":[1,2]}", 400, "The field `prompt` must be a string."},
    };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        ASSERT(http_do(g_port, "POST", refused[i].path, NULL, refused[i].body, &r) == 0);
        ASSERT_EQ_INT(r.status, refused[i].status);
        ASSERT_CONTAINS(r.body, refused[i].message);
        resp_free(&r);
    }
}

TEST(sched_api_key)
{
    FIXTURE();
    static const char *const bad_auth[] = {NULL, "Authorization: Bearer wrong\r\n",
                                           "Authorization: bearer sk-test\r\n",
                                           "Authorization: Bearer sk-test2\r\n"};
    http_resp r;
    char h[64];
    for (size_t i = 0; i < 4; i++) {
        ASSERT(http_do(g_port_key, "GET", "/v1/models", bad_auth[i], NULL, &r) == 0);
        ASSERT_EQ_INT(r.status, 401);
        ASSERT_STR_EQ(header(&r, "WWW-Authenticate", h, sizeof h), "Bearer");
        ASSERT_STR_EQ(r.body, "{\"error\":{\"message\":\"Unauthorized\",\"type\":"
                              "\"AuthenticationError\",\"param\":null,\"code\":401}}");
        resp_free(&r);
    }
    ASSERT(http_do(g_port_key, "GET", "/v1/models", "Authorization: Bearer sk-test\r\n", NULL,
                   &r) == 0);
    ASSERT_EQ_INT(r.status, 200);
    resp_free(&r);
    /* a 401 to a generation request carries an X-Request-Id (§1); /v1/models' does not */
    ASSERT(http_do(g_port_key, "POST", "/v1/completions", NULL, "{}", &r) == 0);
    ASSERT_EQ_INT(r.status, 401);
    ASSERT(is_id(header(&r, "X-Request-Id", h, sizeof h), ""));
    resp_free(&r);
    ASSERT(http_do(g_port_key, "GET", "/v1/models", NULL, NULL, &r) == 0);
    ASSERT_EQ_INT(r.status, 401);
    ASSERT(header(&r, "X-Request-Id", h, sizeof h) == NULL);
    resp_free(&r);
    ASSERT(http_do(g_port_key, "GET", "/health", NULL, NULL, &r) == 0);
    ASSERT_EQ_INT(r.status, 200);
    resp_free(&r);
    ASSERT(http_do(g_port_key, "GET", "/metrics", NULL, NULL, &r) == 0);
    ASSERT_EQ_INT(r.status, 200);
    resp_free(&r);
    /* any /v1/ path needs the key before it is routed (it answered 404 for an unknown one, so a
     * client without the key could tell which routes exist); other paths are routed first */
    static const struct {
        const char *method, *path, *auth;
        int status;
        bool id;
    } order[] = {
        {"GET", "/v1/nope", NULL, 401, false},
        {"GET", "/v1/nope", "Authorization: Bearer sk-test\r\n", 404, false},
        {"POST", "/v1/completions/", NULL, 401, false},
        {"PUT", "/v1/completions", NULL, 401, true},
        {"PUT", "/v1/completions", "Authorization: Bearer sk-test\r\n", 405, false},
        {"GET", "/nope", NULL, 404, false},
        {"POST", "/generate", NULL, 404, false}, /* a legacy route: not served here */
    };
    for (size_t i = 0; i < sizeof order / sizeof *order; i++) {
        ASSERT(http_do(g_port_key, order[i].method, order[i].path, order[i].auth, NULL, &r) == 0);
        ASSERT_MSG(r.status == order[i].status, "%s %s: %d", order[i].method, order[i].path,
                   r.status);
        if (r.status == 401) ASSERT_STR_EQ(header(&r, "WWW-Authenticate", h, sizeof h), "Bearer");
        ASSERT_MSG(!header(&r, "X-Request-Id", h, sizeof h) == !order[i].id, "%s %s: X-Request-Id",
                   order[i].method, order[i].path);
        resp_free(&r);
    }
}

/* HTTP/1.1 as RFC 9112 has it, end to end: the absolute form of a target is routed by its path;
 * no Host, two Hosts, whitespace before a colon and a request line without a version get 400; a
 * client that shuts down its sending side after a complete request still gets the answer. */
TEST(sched_http_conformance)
{
    FIXTURE();
    char req[1024];
    http_resp r;
    int n = snprintf(req, sizeof req,
                     "GET http://127.0.0.1:%d/v1/models HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n"
                     "Connection: close\r\n\r\n",
                     g_port, g_port);
    ASSERT(http_raw(g_port, req, (size_t)n, false, 10000, &r) == 0);
    ASSERT_EQ_INT(r.status, 200);
    ASSERT_CONTAINS(r.body, "\"object\":\"list\"");
    resp_free(&r);
    static const char *const bad[] = {
        "GET /health HTTP/1.1\r\n\r\n",
        "GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        "GET /health HTTP/1.1\r\nHost: a\r\nX-A : b\r\n\r\n",
        "GET /health\r\n\r\n",
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        ASSERT_MSG(http_raw(g_port, bad[i], strlen(bad[i]), false, 10000, &r) == 0,
                   "case %zu: no HTTP/1.1 response", i);
        ASSERT_MSG(r.status == 400, "case %zu: %d", i, r.status);
        ASSERT_CONTAINS(r.body, "\"message\":\"Malformed HTTP request.\"");
        resp_free(&r);
    }
    const char *body = "{\"prompt\":\"Half close\",\"max_tokens\":4,\"ignore_eos\":true}";
    n = snprintf(req, sizeof req,
                 "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 "Content-Length: %zu\r\n\r\n%s",
                 strlen(body), body);
    ASSERT(http_raw(g_port, req, (size_t)n, true, 30000, &r) == 0);
    ASSERT_MSG(r.status == 200, "%d %s", r.status, r.body);
    ASSERT_CONTAINS(r.body, "\"completion_tokens\":4");
    resp_free(&r);
}

/* Non-streaming completions: §10 shape, X-Request-Id, usage. Returns the text in out. */
static void completion(const char *body, char *out, size_t n, int *completion_tokens)
{
    http_resp r;
    out[0] = '\0';
    ASSERT(http_do(g_port, "POST", "/v1/completions", NULL, body, &r) == 0);
    ASSERT_MSG(r.status == 200, "status %d: %s", r.status, r.body);
    json_t *o = json_loads(r.body, 0, NULL);
    ASSERT(o);
    char keys[512];
    keys_of(o, keys, sizeof keys);
    ASSERT_STR_EQ(keys, "id,object,created,model,choices,service_tier,system_fingerprint,usage,"
                        "kv_transfer_params");
    const char *id = json_string_value(json_object_get(o, "id"));
    ASSERT(is_id(id, "cmpl-"));
    char h[64];
    ASSERT_STR_EQ(header(&r, "X-Request-Id", h, sizeof h), id + 5);
    ASSERT_STR_EQ(json_string_value(json_object_get(o, "object")), "text_completion");
    ASSERT_STR_EQ(json_string_value(json_object_get(o, "model")), "tiny");
    json_t *c0 = json_array_get(json_object_get(o, "choices"), 0);
    keys_of(c0, keys, sizeof keys);
    ASSERT_STR_EQ(keys, "index,text,logprobs,finish_reason,stop_reason,prompt_logprobs");
    json_t *u = json_object_get(o, "usage");
    keys_of(u, keys, sizeof keys);
    ASSERT_STR_EQ(keys, "prompt_tokens,total_tokens,completion_tokens,prompt_tokens_details");
    int64_t pt = json_integer_value(json_object_get(u, "prompt_tokens"));
    int64_t ct = json_integer_value(json_object_get(u, "completion_tokens"));
    ASSERT(pt > 0 && ct > 0);
    ASSERT_EQ_INT(json_integer_value(json_object_get(u, "total_tokens")), pt + ct);
    snprintf(out, n, "%s", json_string_value(json_object_get(c0, "text")));
    *completion_tokens = (int)ct;
    json_decref(o);
    resp_free(&r);
}

TEST(sched_body_limit)
{
    FIXTURE();
    /* one byte over --max-request-body-bytes: 413 and the contract's message */
    size_t n = 65537;
    char *body = malloc(n + 1);
    memset(body, ' ', n);
    body[0] = '{';
    body[n - 1] = '}';
    body[n] = '\0';
    http_resp r;
    char h[64];
    ASSERT(http_do(g_port, "POST", "/v1/completions", NULL, body, &r) == 0);
    ASSERT_EQ_INT(r.status, 413);
    ASSERT_STR_EQ(r.body, "{\"error\":{\"message\":\"Request body exceeds 65536 bytes.\","
                          "\"type\":\"PayloadTooLargeError\",\"param\":null,\"code\":413}}");
    ASSERT(is_id(header(&r, "X-Request-Id", h, sizeof h), ""));
    resp_free(&r);
    /* §2: route and method, then the key, come before the body size */
    static const struct {
        int *port;
        const char *method, *path, *auth;
        int status;
        const char *header, *value;
    } first[] = {
        {&g_port, "POST", "/nope", NULL, 404, NULL, NULL},
        {&g_port, "PUT", "/v1/completions", NULL, 405, "Allow", "POST"},
        {&g_port, "POST", "/health", NULL, 405, "Allow", "GET"},
        {&g_port_key, "POST", "/v1/chat/completions", NULL, 401, "WWW-Authenticate", "Bearer"},
        {&g_port_key, "POST", "/v1/chat/completions", "Authorization: Bearer sk-test\r\n", 413,
         NULL, NULL},
    };
    for (size_t i = 0; i < sizeof first / sizeof *first; i++) {
        ASSERT(http_do(*first[i].port, first[i].method, first[i].path, first[i].auth, body, &r) ==
               0);
        ASSERT_MSG(r.status == first[i].status, "case %zu: %d %s", i, r.status, r.body);
        if (first[i].header)
            ASSERT_STR_EQ(header(&r, first[i].header, h, sizeof h), first[i].value);
        resp_free(&r);
    }
    body[n - 2] = '}';
    body[n - 1] = '\0'; /* exactly at the limit: parsed (and rejected for the missing prompt) */
    ASSERT(http_do(g_port, "POST", "/v1/completions", NULL, body, &r) == 0);
    free(body);
    ASSERT_EQ_INT(r.status, 400);
    ASSERT_CONTAINS(r.body, "At least one of `prompt` or `prompt_embeds` must be set.");
    resp_free(&r);
}

TEST(sched_completions_stream_equals_full)
{
    FIXTURE();
    char full[8192];
    int ct = 0;
    completion("{\"model\":\"tiny-alias\",\"prompt\":\"The quick brown fox\",\"max_tokens\":12,"
               "\"temperature\":0,\"ignore_eos\":true}",
               full, sizeof full, &ct);
    ASSERT_EQ_INT(ct, 12);
    /* stream with stream_options {} -> usage chunk */
    http_resp r;
    ASSERT(http_do(g_port, "POST", "/v1/completions", NULL,
                   "{\"prompt\":\"The quick brown fox\",\"max_tokens\":12,\"temperature\":0,"
                   "\"ignore_eos\":true,\"stream\":true,\"stream_options\":{}}",
                   &r) == 0);
    ASSERT_MSG(r.status == 200, "status %d: %s", r.status, r.body);
    char h[128];
    ASSERT_STR_EQ(header(&r, "Content-Type", h, sizeof h), "text/event-stream; charset=utf-8");
    char *ev[64];
    int n = cl_sse_events(r.body, ev, 64);
    ASSERT_MSG(n == 12 + 2, "%d events", n);
    ASSERT_STR_EQ(ev[n - 1], "[DONE]");
    char text[8192] = "";
    int64_t created = -1;
    for (int i = 0; i < 12; i++) {
        json_t *o = json_loads(ev[i], 0, NULL);
        ASSERT(o);
        char keys[256];
        keys_of(o, keys, sizeof keys);
        ASSERT_STR_EQ(keys, "id,object,created,model,choices,usage");
        ASSERT(json_is_null(json_object_get(o, "usage")));
        if (created < 0) created = json_integer_value(json_object_get(o, "created"));
        ASSERT_EQ_INT(json_integer_value(json_object_get(o, "created")), created);
        json_t *c0 = json_array_get(json_object_get(o, "choices"), 0);
        keys_of(c0, keys, sizeof keys);
        ASSERT_STR_EQ(keys, "index,text,logprobs,finish_reason,stop_reason");
        strcat(text, json_string_value(json_object_get(c0, "text")));
        if (i < 11)
            ASSERT(json_is_null(json_object_get(c0, "finish_reason")));
        else
            ASSERT_STR_EQ(json_string_value(json_object_get(c0, "finish_reason")), "length");
        json_decref(o);
    }
    ASSERT_STR_EQ(text, full);
    json_t *u = json_loads(ev[12], 0, NULL);
    ASSERT(u);
    ASSERT_EQ_INT(json_array_size(json_object_get(u, "choices")), 0);
    char keys[256];
    keys_of(json_object_get(u, "usage"), keys, sizeof keys);
    ASSERT_STR_EQ(keys, "prompt_tokens,total_tokens,completion_tokens");
    ASSERT_EQ_INT(
        json_integer_value(json_object_get(json_object_get(u, "usage"), "completion_tokens")), 12);
    json_decref(u);
    resp_free(&r);
}

TEST(sched_chat_full_and_stream)
{
    FIXTURE();
    const char *body = "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi there\"}],"
                       "\"max_tokens\":10,\"temperature\":0,\"ignore_eos\":true%s}";
    char req[512];
    snprintf(req, sizeof req, body, "");
    http_resp r;
    ASSERT(http_do(g_port, "POST", "/v1/chat/completions", NULL, req, &r) == 0);
    ASSERT_MSG(r.status == 200, "status %d: %s", r.status, r.body);
    json_t *o = json_loads(r.body, 0, NULL);
    ASSERT(o);
    char keys[512];
    keys_of(o, keys, sizeof keys);
    ASSERT_STR_EQ(keys, "id,object,created,model,choices,service_tier,system_fingerprint,usage,"
                        "prompt_logprobs,kv_transfer_params");
    ASSERT(is_id(json_string_value(json_object_get(o, "id")), "chatcmpl-"));
    json_t *c0 = json_array_get(json_object_get(o, "choices"), 0);
    keys_of(c0, keys, sizeof keys);
    ASSERT_STR_EQ(keys, "index,message,logprobs,finish_reason,stop_reason");
    json_t *msg = json_object_get(c0, "message");
    keys_of(msg, keys, sizeof keys);
    ASSERT_STR_EQ(keys, "role,content,refusal,annotations,audio,function_call,tool_calls,"
                        "reasoning_content");
    ASSERT_STR_EQ(json_string_value(json_object_get(msg, "role")), "assistant");
    char full[8192];
    snprintf(full, sizeof full, "%s", json_string_value(json_object_get(msg, "content")));
    ASSERT_EQ_INT(
        json_integer_value(json_object_get(json_object_get(o, "usage"), "completion_tokens")), 10);
    ASSERT_STR_EQ(json_string_value(json_object_get(c0, "finish_reason")), "length");
    json_decref(o);
    resp_free(&r);

    snprintf(req, sizeof req, body, ",\"stream\":true,\"stream_options\":{\"include_usage\":true}");
    ASSERT(http_do(g_port, "POST", "/v1/chat/completions", NULL, req, &r) == 0);
    ASSERT_MSG(r.status == 200, "status %d: %s", r.status, r.body);
    char *ev[64];
    int n = cl_sse_events(r.body, ev, 64);
    ASSERT_MSG(n == 1 + 10 + 1 + 1, "%d events", n);
    ASSERT_STR_EQ(ev[n - 1], "[DONE]");
    /* role chunk, byte for byte after the id/created prefix */
    ASSERT_CONTAINS(ev[0], "\"object\":\"chat.completion.chunk\"");
    ASSERT_CONTAINS(ev[0], ",\"model\":\"tiny\",\"choices\":[{\"index\":0,\"delta\":{\"role\":"
                           "\"assistant\",\"content\":\"\"},\"logprobs\":null,"
                           "\"finish_reason\":null}]}");
    char text[8192] = "";
    for (int i = 1; i <= 10; i++) {
        json_t *e = json_loads(ev[i], 0, NULL);
        ASSERT(e);
        keys_of(e, keys, sizeof keys);
        ASSERT_STR_EQ(keys, "id,object,created,model,choices"); /* no usage key */
        json_t *c = json_array_get(json_object_get(e, "choices"), 0);
        keys_of(c, keys, sizeof keys);
        ASSERT_STR_EQ(keys, i < 10 ? "index,delta,logprobs,finish_reason"
                                   : "index,delta,logprobs,finish_reason,stop_reason");
        strcat(text, json_string_value(json_object_get(json_object_get(c, "delta"), "content")));
        json_decref(e);
    }
    ASSERT_STR_EQ(text, full);
    ASSERT_CONTAINS(ev[11], "\"choices\":[],\"usage\":{\"prompt_tokens\":");
    ASSERT_CONTAINS(ev[11], ",\"completion_tokens\":10}}");
    resp_free(&r);
}

TEST(sched_n2_and_multi_prompt)
{
    FIXTURE();
    http_resp r;
    ASSERT(http_do(g_port, "POST", "/v1/completions", NULL,
                   "{\"prompt\":[\"Hello\",\"World\"],\"n\":2,\"max_tokens\":4,\"temperature\":0,"
                   "\"ignore_eos\":true}",
                   &r) == 0);
    ASSERT_MSG(r.status == 200, "status %d: %s", r.status, r.body);
    json_t *o = json_loads(r.body, 0, NULL);
    ASSERT(o);
    json_t *ch = json_object_get(o, "choices");
    ASSERT_EQ_INT(json_array_size(ch), 4);
    for (size_t i = 0; i < 4; i++)
        ASSERT_EQ_INT(json_integer_value(json_object_get(json_array_get(ch, i), "index")), i);
    /* greedy: both choices of one prompt are identical */
    ASSERT_STR_EQ(json_string_value(json_object_get(json_array_get(ch, 0), "text")),
                  json_string_value(json_object_get(json_array_get(ch, 1), "text")));
    ASSERT_EQ_INT(
        json_integer_value(json_object_get(json_object_get(o, "usage"), "completion_tokens")), 16);
    json_decref(o);
    resp_free(&r);
}
