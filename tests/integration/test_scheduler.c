/* Integration tests of pd-scheduler: a real 1P1D cluster on loopback (cluster.h) plus the
 * scheduler process, driven over HTTP with plain sockets. Checks the API contract's shapes
 * (§10, §11), validation messages (§3, §8), routing errors (404/405/401) and the relay
 * (streamed text equals non-streamed text under greedy). Every wait is bounded. */
#define _GNU_SOURCE
#include "harness.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <jansson.h>
#include <limits.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cluster.h"
#include "util/clock.h"

/* ---- a tiny HTTP client ------------------------------------------------------------------- */

typedef struct {
    int status;
    char headers[8192]; /* raw header block, lower-cased names kept as sent */
    char *body;         /* de-chunked, NUL-terminated (malloc'd) */
    size_t body_len;
} http_resp;

static void resp_free(http_resp *r)
{
    free(r->body);
    memset(r, 0, sizeof *r);
}

static int connect_port(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Sends raw bytes and reads until EOF (Connection: close) within timeout_ms. */
static int http_raw(int port, const char *req, size_t len, int timeout_ms, http_resp *out)
{
    memset(out, 0, sizeof *out);
    int fd = connect_port(port);
    if (fd < 0) return -1;
    size_t off = 0;
    while (off < len) {
        ssize_t w = write(fd, req + off, len - off);
        if (w <= 0) break;
        off += (size_t)w;
    }
    size_t cap = 65536, n = 0;
    char *buf = malloc(cap);
    int64_t deadline = pd_now_ns() + (int64_t)timeout_ms * PD_NS_PER_MS;
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int left = (int)((deadline - pd_now_ns()) / PD_NS_PER_MS);
        if (left <= 0 || poll(&p, 1, left) <= 0) break;
        if (n + 4096 > cap) buf = realloc(buf, cap *= 2);
        ssize_t r = read(fd, buf + n, cap - n - 1);
        if (r <= 0) break;
        n += (size_t)r;
    }
    close(fd);
    buf[n] = '\0';
    char *hend = strstr(buf, "\r\n\r\n");
    if (!hend || sscanf(buf, "HTTP/1.1 %d", &out->status) != 1) {
        free(buf);
        return -1;
    }
    size_t hl = (size_t)(hend - buf);
    snprintf(out->headers, sizeof out->headers, "%.*s", (int)hl, buf);
    const char *b = hend + 4;
    size_t bl = n - hl - 4;
    out->body = malloc(bl + 1);
    if (strcasestr(out->headers, "transfer-encoding: chunked")) {
        size_t o = 0;
        const char *p = b;
        while (p < b + bl) {
            unsigned long sz = strtoul(p, NULL, 16);
            const char *nl = strstr(p, "\r\n");
            if (!nl || sz == 0) break;
            memcpy(out->body + o, nl + 2, sz);
            o += sz;
            p = nl + 2 + sz + 2;
        }
        out->body_len = o;
    } else {
        memcpy(out->body, b, bl);
        out->body_len = bl;
    }
    out->body[out->body_len] = '\0';
    free(buf);
    return 0;
}

static int http_do(int port, const char *method, const char *path, const char *extra_headers,
                   const char *body, http_resp *out)
{
    size_t bl = body ? strlen(body) : 0;
    size_t cap = bl + 1024 + (extra_headers ? strlen(extra_headers) : 0);
    char *req = malloc(cap);
    int n = snprintf(req, cap,
                     "%s %s HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n%s%s"
                     "Content-Length: %zu\r\n\r\n",
                     method, path, extra_headers ? extra_headers : "",
                     body && !(extra_headers && strcasestr(extra_headers, "content-type"))
                         ? "Content-Type: application/json\r\n"
                         : "",
                     bl);
    if (body) memcpy(req + n, body, bl);
    int rc = http_raw(port, req, (size_t)n + bl, 60000, out);
    free(req);
    return rc;
}

/* Header value (case-insensitive name) into buf; NULL when absent. */
static const char *header(const http_resp *r, const char *name, char *buf, size_t n)
{
    char key[128];
    snprintf(key, sizeof key, "\r\n%s:", name);
    const char *p = strcasestr(r->headers, key);
    if (!p) return NULL;
    p += strlen(key);
    while (*p == ' ') p++;
    size_t l = strcspn(p, "\r\n");
    snprintf(buf, n, "%.*s", (int)l, p);
    return buf;
}

/* ---- the fixture: one 1P1D cluster and two schedulers ------------------------------------ */

static cl_cluster g_c;
static cl_proc g_sched, g_sched_key, g_sched_legacy;
static int g_port, g_port_key, g_port_legacy;
static bool g_ready, g_failed;
static char g_model[512];

static bool wait_health(cl_proc *p, int port, int timeout_s)
{
    int64_t deadline = pd_now_ns() + (int64_t)(CL_SEC((double)timeout_s) * PD_NS_PER_S);
    while (pd_now_ns() < deadline) {
        http_resp r;
        if (http_do(port, "GET", "/health", NULL, NULL, &r) == 0) {
            int st = r.status;
            resp_free(&r);
            if (st == 200) return true;
        }
        int status;
        if (p->pid > 0 && waitpid(p->pid, &status, WNOHANG) == p->pid) {
            p->pid = 0;
            return false;
        }
        pd_sleep_ns(100 * PD_NS_PER_MS);
    }
    return false;
}

static int start_scheduler_on(cl_cluster *cl, cl_proc *p, int *port, const char *name,
                              char *const extra[], const char *use_openai)
{
    static char genv[700], penv[256], henv[700];
    snprintf(genv, sizeof genv, "GLOBAL_RANK_TABLE_FILE_PATH=%s", cl->global);
    size_t at = (size_t)snprintf(penv, sizeof penv, "NODE_PORTS=");
    for (int k = 0; k < cl->n_prefill + cl->n_decode; k++)
        at += (size_t)snprintf(penv + at, sizeof penv - at, "%s%d", k ? "," : "", cl->ports[k]);
    snprintf(henv, sizeof henv, "RANK_TABLE_FILE_PATH=%s/local_ranktable_127.0.0.1_host.json",
             cl->dir);
    char uenv[32];
    snprintf(uenv, sizeof uenv, "USE_OPENAI=%s", use_openai);
    char *env[] = {genv, penv, henv, "VLLM_API_KEY=", uenv, NULL};
    *port = cl_free_port();
    char port_s[16], log[600];
    snprintf(port_s, sizeof port_s, "%d", *port);
    snprintf(log, sizeof log, "%s/%s.log", cl->dir, name);
    char *argv[40];
    int a = 0;
    /* PD_SCHED_WRAPPER="valgrind -q" (space-separated) runs the scheduler under a tool */
    static char wrap[256];
    const char *w = getenv("PD_SCHED_WRAPPER");
    snprintf(wrap, sizeof wrap, "%s", w ? w : "");
    for (char *save = NULL, *t = strtok_r(wrap, " ", &save); t && a < 8;
         t = strtok_r(NULL, " ", &save))
        argv[a++] = t;
    static char bin[1024];
    snprintf(bin, sizeof bin, "%s", cl_bin("scheduler/pd-scheduler"));
    argv[a++] = bin;
    char *fixed[] = {"--model",
                     g_model,
                     "--port",
                     port_s,
                     "--host",
                     "127.0.0.1",
                     "--max-model-len",
                     "512",
                     "--served-model-name",
                     "tiny",
                     "tiny-alias",
                     NULL};
    for (int i = 0; fixed[i]; i++) argv[a++] = fixed[i];
    for (int i = 0; extra && extra[i]; i++) argv[a++] = extra[i];
    argv[a] = NULL;
    if (cl_spawn(p, name, argv, env, log) != 0) return -1;
    if (!wait_health(p, *port, 30)) {
        cl_dump_log(p, 30);
        return -1;
    }
    return 0;
}

static int start_scheduler(cl_proc *p, int *port, const char *name, char *const extra[],
                           const char *use_openai)
{
    return start_scheduler_on(&g_c, p, port, name, extra, use_openai);
}

static bool fixture(void)
{
    if (g_ready || g_failed) return g_ready;
    g_failed = true;
    if (cl_make_tiny(g_model, sizeof g_model) < 0) return false;
    if (cl_start(&g_c, g_model, "0", "1", NULL) < 0) {
        printf("    cl_start: %s\n", pd_last_error());
        return false;
    }
    char *main_args[] = {"--max-request-body-bytes", "65536", NULL};
    if (start_scheduler(&g_sched, &g_port, "scheduler", main_args, "1") < 0) {
        printf("    pd-scheduler did not become healthy\n");
        return false;
    }
    char *key_args[] = {
        "--api-key", "sk-test", "--max-concurrent-requests", "1", "--max-request-body-bytes",
        "65536",     NULL};
    if (start_scheduler(&g_sched_key, &g_port_key, "scheduler_key", key_args, "1") < 0) {
        printf("    pd-scheduler (api key) did not become healthy\n");
        return false;
    }
    if (start_scheduler(&g_sched_legacy, &g_port_legacy, "scheduler_legacy", NULL, "0") < 0) {
        printf("    pd-scheduler (USE_OPENAI=0) did not become healthy\n");
        return false;
    }
    g_failed = false;
    g_ready = true;
    return true;
}

#define FIXTURE()                                                                                  \
    do {                                                                                           \
        if (!fixture()) {                                                                          \
            ASSERT_MSG(0, "the cluster did not start");                                            \
        }                                                                                          \
    } while (0)

/* ---- helpers for the API ------------------------------------------------------------------- */

/* Keys of a JSON object in order, joined by ','. */
static void keys_of(const json_t *o, char *buf, size_t n)
{
    buf[0] = '\0';
    const char *k;
    json_t *v;
    size_t at = 0;
    json_object_foreach((json_t *)o, k, v)
    {
        at += (size_t)snprintf(buf + at, n - at, "%s%s", at ? "," : "", k);
        if (at >= n) break;
    }
}

static bool is_id(const char *s, const char *prefix)
{
    size_t pl = strlen(prefix);
    if (!s || strncmp(s, prefix, pl) != 0 || strlen(s) != pl + 32) return false;
    for (size_t i = pl; s[i]; i++)
        if (!isxdigit((unsigned char)s[i]) || isupper((unsigned char)s[i])) return false;
    return true;
}

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

typedef struct {
    const char *path, *body;
    int status;
    const char *message; /* exact; NULL: prefix in `prefix` */
    const char *prefix;
} bad_case;

TEST(sched_bad_inputs)
{
    FIXTURE();
    static const bad_case cases[] = {
        {"/v1/completions", "{\"prompt\":\"a\"", 400, NULL, "Invalid JSON in request body:"},
        {"/v1/completions", "[1,2]", 400, "Request body must be a JSON object.", NULL},
        {"/v1/completions", "{\"prompt\":NaN}", 400, NULL, "Invalid JSON in request body:"},
        {"/v1/completions", "{\"prompt\":\"a\",\"n\":\"2\"}", 400,
         "The field `n` must be an integer.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"n\":1.5}", 400,
         "The field `n` must be an integer.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"stream\":1}", 400,
         "The field `stream` must be a boolean.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"temperature\":\"hot\"}", 400,
         "The field `temperature` must be a number.", NULL},
        {"/v1/completions", "{\"prompt\":{}}", 400,
         "The field `prompt` must be a string, an array of strings, an array of integers, or an "
         "array of arrays of integers.",
         NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"stop\":3}", 400,
         "The field `stop` must be a string or an array of strings.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"model\":\"gpt-4\"}", 404,
         "The model `gpt-4` does not exist.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"n\":0}", 400, "n must be at least 1, got 0.",
         NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"temperature\":-1}", 400,
         "temperature must be non-negative, got -1.0.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"top_p\":1.5}", 400,
         "top_p must be in (0, 1], got 1.5.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"top_k\":-2}", 400,
         "top_k must be 0 (disable), or at least 1, got -2.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"presence_penalty\":2.5}", 400,
         "presence_penalty must be in [-2, 2], got 2.5.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"repetition_penalty\":0}", 400,
         "repetition_penalty must be greater than zero, got 0.0.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"min_p\":2}", 400,
         "min_p must be in [0, 1], got 2.0.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"max_tokens\":0}", 400,
         "max_tokens must be at least 1, got 0.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"best_of\":2}", 400,
         "best_of > n is not supported.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"stop\":[\"x\",\"\"]}", 400,
         "stop cannot contain an empty string.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"stop_token_ids\":[999999]}", 400,
         "Token id 999999 in stop_token_ids is out of vocabulary.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"logit_bias\":{\"abc\":1}}", 400,
         "Invalid key `abc` in logit_bias: keys must be token ids.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"allowed_token_ids\":[]}", 400,
         "allowed_token_ids is not allowed to be empty.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"priority\":3}", 400,
         "Got priority 3 but Priority scheduling is not enabled.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"stream_options\":{\"include_usage\":true}}", 400,
         "Stream options can only be defined when `stream=True`.", NULL},
        {"/v1/completions", "{\"max_tokens\":3}", 400,
         "At least one of `prompt` or `prompt_embeds` must be set.", NULL},
        {"/v1/completions", "{\"prompt\":[]}", 400,
         "The field `prompt` must not be an empty array.", NULL},
        {"/v1/completions", "{\"prompt\":[1,2,99999999]}", 400,
         "Token id 99999999 is out of vocabulary", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"suffix\":\"b\"}", 400,
         "suffix is not currently supported", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"use_beam_search\":true}", 400,
         "`use_beam_search` is not supported.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"guided_regex\":\"x+\"}", 400,
         "`guided_regex` is not supported.", NULL},
        {"/v1/completions", "{\"prompt\":\"a\",\"max_tokens\":600}", 400, NULL,
         "'max_tokens' or 'max_completion_tokens' is too large: 600. This model's maximum "
         "context length is 512 tokens and your request has "},
        {"/v1/completions", "{\"prompt\":\"a\",\"min_tokens\":20,\"max_tokens\":5}", 400,
         "min_tokens must be less than or equal to max_tokens=5, got 20.", NULL},
        {"/v1/chat/completions", "{\"messages\":[]}", 400,
         "The field `messages` must be a non-empty array.", NULL},
        {"/v1/chat/completions", "{\"messages\":[{\"role\":1,\"content\":\"x\"}]}", 400,
         "The field `messages[0].role` must be a string.", NULL},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\"}]}]}", 400,
         "Content part type 'image_url' is not supported by this model.", NULL},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_logprobs\":2}", 400,
         "when using `top_logprobs`, `logprobs` must be set to true.", NULL},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"continue_final_message\":true}",
         400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
         NULL},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tool_choice\":\"auto\"}", 400,
         "When using `tool_choice`, `tools` must be set.", NULL},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"chat_template\":\"{{x}}\"}", 400,
         "Chat template is passed with request, but --trust-request-chat-template is not set. "
         "Refused request with untrusted chat template.",
         NULL},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_completion_tokens\":0}", 400,
         "max_tokens must be at least 1, got 0.", NULL},
    };
    size_t n = sizeof cases / sizeof *cases;
    for (size_t i = 0; i < n; i++) {
        const bad_case *c = &cases[i];
        http_resp r;
        ASSERT(http_do(g_port, "POST", c->path, NULL, c->body, &r) == 0);
        ASSERT_MSG(r.status == c->status, "case %zu (%s): status %d, expected %d: %s", i, c->body,
                   r.status, c->status, r.body);
        json_t *o = json_loads(r.body, 0, NULL);
        ASSERT_MSG(o, "case %zu: body is not JSON: %s", i, r.body);
        json_t *e = json_object_get(o, "error");
        char keys[128];
        keys_of(e, keys, sizeof keys);
        ASSERT_STR_EQ(keys, "message,type,param,code");
        const char *type = json_string_value(json_object_get(e, "type"));
        ASSERT_STR_EQ(type, c->status == 404 ? "NotFoundError" : "BadRequestError");
        ASSERT_EQ_INT(json_integer_value(json_object_get(e, "code")), c->status);
        ASSERT(json_is_null(json_object_get(e, "param")));
        const char *msg = json_string_value(json_object_get(e, "message"));
        if (c->message)
            ASSERT_MSG(msg && strcmp(msg, c->message) == 0, "case %zu (%s): message \"%s\"", i,
                       c->body, msg ? msg : "(null)");
        else
            ASSERT_MSG(msg && strncmp(msg, c->prefix, strlen(c->prefix)) == 0,
                       "case %zu (%s): message \"%s\"", i, c->body, msg ? msg : "(null)");
        json_decref(o);
        resp_free(&r);
    }
    /* wrong content type */
    http_resp r;
    ASSERT(http_do(g_port, "POST", "/v1/completions", "Content-Type: text/plain\r\n",
                   "{\"prompt\":\"a\"}", &r) == 0);
    ASSERT_EQ_INT(r.status, 400);
    ASSERT_CONTAINS(r.body, "\"message\":\"Unsupported Media Type: Only 'application/json' is "
                            "allowed\"");
    resp_free(&r);
    ASSERT(http_do(g_port, "POST", "/v1/completions",
                   "Content-Type: Application/JSON; charset=utf-8\r\n",
                   "{\"prompt\":\"a\",\"max_tokens\":1}", &r) == 0);
    ASSERT_MSG(r.status == 200, "status %d: %s", r.status, r.body);
    resp_free(&r);
    /* the server keeps serving */
    ASSERT(http_do(g_port, "GET", "/health", NULL, NULL, &r) == 0);
    ASSERT_EQ_INT(r.status, 200);
    resp_free(&r);
}

TEST(sched_context_length_boundary)
{
    FIXTURE();
    /* P + M = L is accepted, P + M = L + 1 is not: find P with a token-id prompt */
    char body[8192];
    size_t at = (size_t)snprintf(body, sizeof body, "{\"prompt\":[");
    for (int i = 0; i < 500; i++)
        at += (size_t)snprintf(body + at, sizeof body - at, "%s%d", i ? "," : "", 40 + i % 50);
    snprintf(body + at, sizeof body - at, "],\"max_tokens\":12,\"temperature\":0}");
    http_resp r;
    ASSERT(http_do(g_port, "POST", "/v1/completions", NULL, body, &r) == 0);
    ASSERT_MSG(r.status == 200, "status %d: %s", r.status, r.body);
    resp_free(&r);
    snprintf(body + at, sizeof body - at, "],\"max_tokens\":13,\"temperature\":0}");
    ASSERT(http_do(g_port, "POST", "/v1/completions", NULL, body, &r) == 0);
    ASSERT_EQ_INT(r.status, 400);
    ASSERT_CONTAINS(r.body, "\"message\":\"'max_tokens' or 'max_completion_tokens' is too large: "
                            "13. This model's maximum context length is 512 tokens and your "
                            "request has 500 input tokens (13 > 512 - 500).\"");
    resp_free(&r);
}

TEST(sched_metrics_counts)
{
    FIXTURE();
    http_resp r;
    ASSERT(http_do(g_port, "GET", "/metrics", NULL, NULL, &r) == 0);
    ASSERT_EQ_INT(r.status, 200);
    ASSERT_CONTAINS(r.body, "# TYPE vllm:request_success_total counter");
    ASSERT_CONTAINS(r.body, "vllm:request_success_total{model_name=\"tiny\",engine=\"0\","
                            "finished_reason=\"abort\"}");
    ASSERT_CONTAINS(r.body, "vllm:time_to_first_token_seconds_bucket{model_name=\"tiny\","
                            "engine=\"0\",le=\"0.001\"}");
    ASSERT_CONTAINS(r.body, "pd:instance_up{role=\"prefill\",instance=\"127.0.0.1:");
    ASSERT_CONTAINS(r.body, "pd:kv_transfer_bytes_total{model_name=\"tiny\",transport=\"tcp\"");
    ASSERT_CONTAINS(r.body, "vllm:request_prompt_tokens_bucket{model_name=\"tiny\",engine=\"0\","
                            "le=\"500.0\"}");
    resp_free(&r);
}

TEST(sched_logprobs)
{
    FIXTURE();
    http_resp r;
    ASSERT(http_do(g_port, "POST", "/v1/completions", NULL,
                   "{\"prompt\":\"Hello world\",\"max_tokens\":5,\"temperature\":0,"
                   "\"ignore_eos\":true,\"logprobs\":2}",
                   &r) == 0);
    ASSERT_MSG(r.status == 200, "status %d: %s", r.status, r.body);
    json_t *o = json_loads(r.body, 0, NULL);
    ASSERT(o);
    json_t *lp = json_object_get(json_array_get(json_object_get(o, "choices"), 0), "logprobs");
    char keys[256];
    keys_of(lp, keys, sizeof keys);
    ASSERT_STR_EQ(keys, "text_offset,token_logprobs,tokens,top_logprobs");
    json_t *off = json_object_get(lp, "text_offset"), *tl = json_object_get(lp, "token_logprobs");
    json_t *toks = json_object_get(lp, "tokens"), *top = json_object_get(lp, "top_logprobs");
    ASSERT_EQ_INT(json_array_size(off), 5);
    ASSERT_EQ_INT(json_array_size(tl), 5);
    ASSERT_EQ_INT(json_array_size(toks), 5);
    ASSERT_EQ_INT(json_array_size(top), 5);
    ASSERT_EQ_INT(json_integer_value(json_array_get(off, 0)), 0);
    for (size_t i = 0; i < 5; i++) {
        if (i)
            ASSERT(json_integer_value(json_array_get(off, i)) >=
                   json_integer_value(json_array_get(off, i - 1)));
        double v = json_number_value(json_array_get(tl, i));
        ASSERT(v <= 0 && v >= -9999.0);
        json_t *d = json_array_get(top, i);
        ASSERT(json_object_size(d) >= 1 && json_object_size(d) <= 3);
        /* greedy: the sampled token is the most likely one */
        const char *k;
        json_t *x;
        json_object_foreach(d, k, x) ASSERT(json_number_value(x) <= v + 1e-6);
    }
    json_decref(o);
    resp_free(&r);

    ASSERT(http_do(g_port, "POST", "/v1/chat/completions", NULL,
                   "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":3,"
                   "\"temperature\":0,\"ignore_eos\":true,\"logprobs\":true,\"top_logprobs\":3,"
                   "\"stream\":true}",
                   &r) == 0);
    ASSERT_MSG(r.status == 200, "status %d: %s", r.status, r.body);
    char *ev[16];
    int n = cl_sse_events(r.body, ev, 16);
    ASSERT_EQ_INT(n, 1 + 3 + 1);
    for (int i = 1; i <= 3; i++) {
        json_t *e = json_loads(ev[i], 0, NULL);
        ASSERT(e);
        json_t *c = json_object_get(
            json_object_get(json_array_get(json_object_get(e, "choices"), 0), "logprobs"),
            "content");
        ASSERT_EQ_INT(json_array_size(c), 1);
        json_t *item = json_array_get(c, 0);
        keys_of(item, keys, sizeof keys);
        ASSERT_STR_EQ(keys, "token,logprob,bytes,top_logprobs");
        const char *tok = json_string_value(json_object_get(item, "token"));
        json_t *bytes = json_object_get(item, "bytes");
        ASSERT_EQ_INT(json_array_size(bytes), strlen(tok));
        for (size_t j = 0; j < strlen(tok); j++)
            ASSERT_EQ_INT(json_integer_value(json_array_get(bytes, j)), (unsigned char)tok[j]);
        json_t *tops = json_object_get(item, "top_logprobs");
        ASSERT_EQ_INT(json_array_size(tops), 3);
        for (size_t j = 1; j < 3; j++)
            ASSERT(json_number_value(json_object_get(json_array_get(tops, j), "logprob")) <=
                   json_number_value(json_object_get(json_array_get(tops, j - 1), "logprob")));
        json_decref(e);
    }
    resp_free(&r);
}

TEST(sched_legacy_generate)
{
    FIXTURE();
    http_resp r;
    ASSERT(http_do(g_port_legacy, "POST", "/v1/completions", NULL, "{\"prompt\":\"a\"}", &r) == 0);
    ASSERT_EQ_INT(r.status, 404);
    resp_free(&r);
    ASSERT(http_do(g_port_legacy, "POST", "/generate", "Content-Type: text/plain\r\n",
                   "{\"prompt\":\"San Francisco is a\",\"max_tokens\":6,\"temperature\":0,"
                   "\"ignore_eos\":true}",
                   &r) == 0);
    ASSERT_MSG(r.status == 200, "status %d: %s", r.status, r.body);
    const char *pre = "{\"text\":[\"San Francisco is a";
    ASSERT_MSG(strncmp(r.body, pre, strlen(pre)) == 0, "body %s", r.body);
    json_t *o = json_loads(r.body, 0, NULL);
    ASSERT(o);
    char full[4096];
    snprintf(full, sizeof full, "%s",
             json_string_value(json_array_get(json_object_get(o, "text"), 0)));
    json_decref(o);
    resp_free(&r);
    ASSERT(http_do(g_port_legacy, "POST", "/generate", NULL,
                   "{\"prompt\":\"San Francisco is a\",\"max_tokens\":6,\"temperature\":0,"
                   "\"ignore_eos\":true,\"stream\":true}",
                   &r) == 0);
    ASSERT_MSG(r.status == 200, "status %d: %s", r.status, r.body);
    char h[64];
    ASSERT_STR_EQ(header(&r, "Content-Type", h, sizeof h), "application/x-ndjson");
    int lines = 0;
    char last[4096] = "";
    for (char *save = NULL, *line = strtok_r(r.body, "\n", &save); line;
         line = strtok_r(NULL, "\n", &save)) {
        const char *lpre = "{\"text\": [\"San Francisco is a";
        ASSERT_MSG(strncmp(line, lpre, strlen(lpre)) == 0, "line %s", line);
        json_t *e = json_loads(line, 0, NULL);
        ASSERT(e);
        const char *t = json_string_value(json_array_get(json_object_get(e, "text"), 0));
        ASSERT(strncmp(t, last, strlen(last)) == 0); /* cumulative */
        snprintf(last, sizeof last, "%s", t);
        json_decref(e);
        lines++;
    }
    ASSERT_EQ_INT(lines, 6);
    ASSERT_STR_EQ(last, full);
    resp_free(&r);
    ASSERT(http_do(g_port_legacy, "POST", "/generate", NULL, "{\"prompt\":\"a\",\"echo\":true}",
                   &r) == 0);
    ASSERT_EQ_INT(r.status, 400);
    ASSERT_CONTAINS(r.body, "\"message\":\"Unsupported sampling parameter: `echo`.\"");
    resp_free(&r);
    ASSERT(http_do(g_port_legacy, "POST", "/generate", NULL, "{\"max_tokens\":3}", &r) == 0);
    ASSERT_EQ_INT(r.status, 400);
    ASSERT_CONTAINS(r.body, "\"message\":\"The field `prompt` is required.\"");
    resp_free(&r);
    ASSERT(http_do(g_port_legacy, "POST", "/generate", NULL, "{\"prompt\":[1]}", &r) == 0);
    ASSERT_EQ_INT(r.status, 400);
    ASSERT_CONTAINS(r.body, "\"message\":\"The field `prompt` must be a string.\"");
    resp_free(&r);
}

/* The official OpenAI Node SDK against pd-scheduler (skipped when the SDK is not cached:
 * tests/npm_cache.sh openai@4). */
TEST(sched_openai_node_sdk)
{
    FIXTURE();
    const char *cache = getenv("PD_NPM_CACHE");
    const char *root = getenv("PD_SOURCE_ROOT");
    char cdir[700], pkg[800];
    if (cache)
        snprintf(cdir, sizeof cdir, "%s", cache);
    else
        snprintf(cdir, sizeof cdir, "%s/.cache/npm", root ? root : ".");
    snprintf(pkg, sizeof pkg, "%s/node_modules/openai/package.json", cdir);
    if (access(pkg, R_OK) != 0)
        SKIP("openai SDK not in the npm cache (tests/npm_cache.sh openai@4)");
    char script[800], url[64], out[800], cenv[PATH_MAX + 32];
    snprintf(script, sizeof script, "%s/scheduler/openai_sdk.mjs", pdt_data_dir());
    snprintf(url, sizeof url, "http://127.0.0.1:%d/v1", g_port);
    snprintf(out, sizeof out, "%s/openai_sdk.out", g_c.dir);
    char abs[PATH_MAX];
    snprintf(cenv, sizeof cenv, "PD_NPM_CACHE=%s", realpath(cdir, abs) ? abs : cdir);
    char *argv[] = {"/usr/bin/node", script, url, "tiny", NULL};
    char *env[] = {cenv, NULL};
    cl_proc p;
    ASSERT(cl_spawn(&p, "node", argv, env, out) == 0);
    int st = cl_wait(&p, 60000);
    if (st != 0) cl_dump_log(&p, 20);
    ASSERT_EQ_INT(st, 0);
}

TEST(sched_client_disconnect_aborts)
{
    FIXTURE();
    http_resp r;
    ASSERT(http_do(g_port, "GET", "/metrics", NULL, NULL, &r) == 0);
    const char *key = "finished_reason=\"abort\"} ";
    const char *p = strstr(r.body, key);
    ASSERT(p);
    double before = atof(p + strlen(key));
    resp_free(&r);
    /* a long stream; the client reads the first event and hangs up */
    int fd = connect_port(g_port);
    ASSERT(fd >= 0);
    const char *body = "{\"prompt\":\"Once upon a time\",\"max_tokens\":400,\"ignore_eos\":true,"
                       "\"stream\":true}";
    char req[1024];
    int n =
        snprintf(req, sizeof req,
                 "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 "Content-Length: %zu\r\n\r\n%s",
                 strlen(body), body);
    ASSERT(write(fd, req, (size_t)n) == n);
    char buf[4096];
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    ASSERT(poll(&pfd, 1, 30000) == 1);
    ASSERT(read(fd, buf, sizeof buf) > 0);
    close(fd);
    /* the abort is counted and the instances are free again */
    double after = before;
    int64_t deadline = pd_now_ns() + (int64_t)(CL_SEC(10.0) * PD_NS_PER_S);
    while (after == before && pd_now_ns() < deadline) {
        pd_sleep_ns(100 * PD_NS_PER_MS);
        ASSERT(http_do(g_port, "GET", "/metrics", NULL, NULL, &r) == 0);
        p = strstr(r.body, key);
        after = p ? atof(p + strlen(key)) : before;
        resp_free(&r);
    }
    ASSERT_NEAR(after, before + 1, 0.01);
    /* the decode instance holds no sequence for it any more */
    deadline = pd_now_ns() + (int64_t)(CL_SEC(10.0) * PD_NS_PER_S);
    int64_t running = -1;
    while (pd_now_ns() < deadline) {
        Pd__StatsRequest q = PD__STATS_REQUEST__INIT;
        int st;
        Pd__StatsReply *s =
            (Pd__StatsReply *)cl_call(cl_node(&g_c, 1), "/pd.PD/Stats", &q.base,
                                      &pd__stats_reply__descriptor, CL_MS(2000), &st);
        ASSERT(s);
        running = s->num_running + s->num_held;
        bool all_free = s->kv_blocks_free == s->kv_blocks_total;
        pd__stats_reply__free_unpacked(s, NULL);
        if (running == 0 && all_free) break;
        pd_sleep_ns(100 * PD_NS_PER_MS);
    }
    ASSERT_EQ_INT(running, 0);
}

/* Opens a long streaming completion on port and returns the socket once the first bytes came. */
static int open_long_stream(int port, const char *auth)
{
    int fd = connect_port(port);
    if (fd < 0) return -1;
    const char *body = "{\"prompt\":\"Once upon a time\",\"max_tokens\":480,\"ignore_eos\":true,"
                       "\"stream\":true}";
    char req[1024];
    int n =
        snprintf(req, sizeof req,
                 "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 "%sContent-Length: %zu\r\n\r\n%s",
                 auth ? auth : "", strlen(body), body);
    if (write(fd, req, (size_t)n) != n) {
        close(fd);
        return -1;
    }
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    char buf[256];
    if (poll(&pfd, 1, 30000) != 1 || read(fd, buf, sizeof buf) <= 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* A cluster of its own (prefill and decode server lists as cl_start takes them) with a
 * scheduler on it (extra flags args); false, with both stopped, when either did not start. */
static bool side_cluster(cl_cluster *c, const char *prefill, const char *decode, cl_proc *sp,
                         int *port, const char *name, char *const args[])
{
    if (cl_start(c, g_model, prefill, decode, NULL) < 0) {
        printf("    cl_start: %s\n", pd_last_error());
        return false;
    }
    if (start_scheduler_on(c, sp, port, name, args, "1") < 0) {
        printf("    %s did not start\n", name);
        cl_stop_all(c);
        return false;
    }
    return true;
}

/* 2P1D: a prefill instance hangs; the request routed to it is cancelled when the heartbeat
 * takes it out and is retried on the other prefill instance. */
TEST(sched_prefill_retry)
{
    FIXTURE();
    cl_cluster c2;
    cl_proc sp;
    int port = 0;
    ASSERT(side_cluster(&c2, "0 1", "2", &sp, &port, "scheduler_2p1d", NULL));
    cl_signal(&c2.procs[0], SIGSTOP);
    int ok = 0;
    for (int i = 0; i < 3; i++) {
        http_resp r;
        if (http_do(port, "POST", "/v1/completions", NULL,
                    "{\"prompt\":\"Retry me\",\"max_tokens\":4,\"temperature\":0}", &r) == 0) {
            ok += r.status == 200;
            if (r.status != 200) printf("    status %d: %s\n", r.status, r.body);
            resp_free(&r);
        }
    }
    cl_signal(&c2.procs[0], SIGKILL);
    char cmd[800];
    snprintf(cmd, sizeof cmd, "grep -q 'retrying the prefill' '%s'", sp.log);
    int retried = system(cmd);
    int st = cl_stop(&sp, 10000);
    int bad = cl_stop_all(&c2);
    ASSERT_EQ_INT(ok, 3);
    ASSERT_EQ_INT(retried, 0);
    ASSERT_EQ_INT(st, 0);
    ASSERT_EQ_INT(bad, 0);
}

/* Reads fd until the peer closes it (or 10 s pass) into buf (NUL-terminated). */
static void read_to_close(int fd, char *buf, size_t cap)
{
    size_t at = 0;
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    int64_t end = pd_now_ns() + 10 * PD_NS_PER_S;
    while (at + 1 < cap && pd_now_ns() < end && poll(&pfd, 1, 1000) >= 0) {
        ssize_t n = read(fd, buf + at, cap - 1 - at);
        if (n <= 0) break;
        at += (size_t)n;
    }
    buf[at] = '\0';
}

/* SIGTERM drains (§3, §11.5): /health and new requests get 503 while the listener stays open;
 * a stream in flight ends with its finish or the in-band 503, then [DONE]; a request still in
 * flight at --shutdown-timeout gets the 503; the process exits 0. */
TEST(sched_sigterm_drains)
{
    FIXTURE();
    cl_cluster c2;
    cl_proc sp;
    int port = 0;
    char *args[] = {"--shutdown-timeout", "1.5", NULL};
    ASSERT(side_cluster(&c2, "0", "1", &sp, &port, "scheduler_drain", args));
    int stream = open_long_stream(port, NULL);
    /* a request that cannot end before the deadline: its prefill instance is stopped */
    cl_signal(&c2.procs[0], SIGSTOP);
    int stuck = connect_port(port);
    static const char body[] = "{\"prompt\":\"Hi\",\"max_tokens\":4}";
    char stuck_req[256];
    int sl = snprintf(stuck_req, sizeof stuck_req,
                      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      "application/json\r\nContent-Length: %zu\r\n\r\n%s",
                      sizeof body - 1, body);
    bool sent = stuck >= 0 && write(stuck, stuck_req, (size_t)sl) == sl;
    usleep(200 * 1000);
    int64_t t_term = pd_now_ns();
    cl_signal(&sp, SIGTERM);
    usleep(100 * 1000);
    http_resp h, n;
    int hrc = http_do(port, "GET", "/health", NULL, NULL, &h);
    int nrc = http_do(port, "POST", "/v1/completions", NULL, "{\"prompt\":\"x\"}", &n);
    static char out[1 << 20];
    char stuck_out[4096];
    out[0] = stuck_out[0] = '\0';
    if (stream >= 0) read_to_close(stream, out, sizeof out);
    if (sent) read_to_close(stuck, stuck_out, sizeof stuck_out);
    cl_signal(&c2.procs[0], SIGCONT);
    int st = cl_wait(&sp, 10000);
    double took = (double)(pd_now_ns() - t_term) / 1e9;
    if (st != 0) cl_dump_log(&sp, 30);
    int bad = cl_stop_all(&c2);
    if (stream >= 0) close(stream);
    if (stuck >= 0) close(stuck);
    ASSERT(stream >= 0 && sent);
    ASSERT_EQ_INT(hrc, 0);
    ASSERT_EQ_INT(h.status, 503);
    resp_free(&h);
    ASSERT_EQ_INT(nrc, 0);
    ASSERT_EQ_INT(n.status, 503);
    char hv[64];
    ASSERT_STR_EQ(header(&n, "Retry-After", hv, sizeof hv), "5");
    ASSERT_CONTAINS(n.body, "\"message\":\"The server is shutting down.\"");
    resp_free(&n);
    size_t ol = strlen(out); /* chunked: [DONE], then the last chunk */
    ASSERT_MSG(strstr(out, "data: [DONE]\n\n") && ol > 5 && strcmp(out + ol - 5, "0\r\n\r\n") == 0,
               "stream: ...%s", out + (ol > 300 ? ol - 300 : 0));
    ASSERT_MSG(strstr(out, "\"finish_reason\":\"length\"") ||
                   strstr(out, "data: {\"error\":{\"message\":\"The server is shutting down.\","
                               "\"type\":\"ServiceUnavailableError\""),
               "stream: ...%s", out + (ol > 300 ? ol - 300 : 0));
    ASSERT_CONTAINS(stuck_out, "HTTP/1.1 503");
    ASSERT_CONTAINS(stuck_out, "Retry-After: 5");
    ASSERT_CONTAINS(stuck_out, "\"message\":\"The server is shutting down.\"");
    ASSERT_EQ_INT(st, 0);
    ASSERT_MSG(took > 1.4 && took < 6.0, "exit %.2f s after SIGTERM", took);
    ASSERT_EQ_INT(bad, 0);
}

/* Start-up errors name the problem; an instance whose identity does not match its ranktable
 * entry stays out of routing with a logged reason. */
TEST(sched_startup_checks)
{
    FIXTURE();
    char genv[700], penv[64], log[600], port_s[16];
    snprintf(genv, sizeof genv, "GLOBAL_RANK_TABLE_FILE_PATH=%s", g_c.global);
    snprintf(port_s, sizeof port_s, "%d", cl_free_port());
    char *argv[] = {(char *)cl_bin("scheduler/pd-scheduler"),
                    "--model",
                    g_model,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    port_s,
                    NULL};
    /* one port for two instances */
    snprintf(penv, sizeof penv, "NODE_PORTS=%d", g_c.ports[0]);
    snprintf(log, sizeof log, "%s/sched_badports.log", g_c.dir);
    char *env1[] = {genv, penv, NULL};
    cl_proc p;
    ASSERT(cl_spawn(&p, "badports", argv, env1, log) == 0);
    ASSERT_EQ_INT(cl_wait(&p, 20000), 1);
    char cmd[800];
    snprintf(cmd, sizeof cmd,
             "grep -q 'NODE_PORTS: 1 port(s) given but .* lists 1 prefill + 1 decode' '%s'", log);
    ASSERT_EQ_INT(system(cmd), 0);
    /* the ports swapped: each instance answers with the other role */
    snprintf(penv, sizeof penv, "NODE_PORTS=%d,%d", g_c.ports[1], g_c.ports[0]);
    snprintf(log, sizeof log, "%s/sched_swapped.log", g_c.dir);
    char *env2[] = {genv, penv, NULL};
    ASSERT(cl_spawn(&p, "swapped", argv, env2, log) == 0);
    int port = atoi(port_s);
    int64_t deadline = pd_now_ns() + (int64_t)(CL_SEC(20.0) * PD_NS_PER_S);
    int status = 0;
    while (pd_now_ns() < deadline) {
        http_resp r;
        if (http_do(port, "GET", "/health", NULL, NULL, &r) == 0) {
            status = r.status;
            resp_free(&r);
            snprintf(cmd, sizeof cmd,
                     "grep -q \"identity does not match the ranktable: answers as role 'decode', "
                     "the ranktable says 'prefill'\" '%s'",
                     log);
            if (system(cmd) == 0) break;
        }
        pd_sleep_ns(100 * PD_NS_PER_MS);
    }
    int st = cl_stop(&p, 10000);
    ASSERT_EQ_INT(status, 503);
    ASSERT_EQ_INT(system(cmd), 0);
    ASSERT_EQ_INT(st, 0);
}

TEST(sched_concurrency_limit)
{
    FIXTURE();
    const char *auth = "Authorization: Bearer sk-test\r\n";
    int fd = open_long_stream(g_port_key, auth);
    ASSERT(fd >= 0);
    http_resp r;
    ASSERT(http_do(g_port_key, "POST", "/v1/completions", auth,
                   "{\"prompt\":\"a\",\"max_tokens\":2}", &r) == 0);
    close(fd);
    ASSERT_EQ_INT(r.status, 503);
    char h[64];
    ASSERT_STR_EQ(header(&r, "Retry-After", h, sizeof h), "1");
    ASSERT_STR_EQ(r.body, "{\"error\":{\"message\":\"The server is at its limit of 1 concurrent "
                          "requests; retry later.\",\"type\":\"ServiceUnavailableError\","
                          "\"param\":null,\"code\":503}}");
    resp_free(&r);
    /* once the first request is gone (client closed), the next one is served */
    int64_t deadline = pd_now_ns() + (int64_t)(CL_SEC(10.0) * PD_NS_PER_S);
    int st = 0;
    while (pd_now_ns() < deadline) {
        ASSERT(http_do(g_port_key, "POST", "/v1/completions", auth,
                       "{\"prompt\":\"a\",\"max_tokens\":2}", &r) == 0);
        st = r.status;
        resp_free(&r);
        if (st == 200) break;
        pd_sleep_ns(50 * PD_NS_PER_MS);
    }
    ASSERT_EQ_INT(st, 200);
}

/* --enable-prompt-tokens-details: the usage tells the prompt tokens the prefill instance found
 * in its prefix cache (vLLM's field), in a response body and in a stream's usage chunk; without
 * the flag it stays null. A 40-token prompt, sent again, finds its 2 full 16-token blocks. */
TEST(sched_prompt_tokens_details_cached)
{
    FIXTURE();
    char *extra[] = {"--enable-prompt-tokens-details", NULL};
    cl_proc sp;
    int port = 0;
    ASSERT_MSG(start_scheduler(&sp, &port, "scheduler_details", extra, "1") == 0,
               "pd-scheduler with --enable-prompt-tokens-details did not start");
    char body[1024], stream[1100];
    size_t o = (size_t)snprintf(body, sizeof body, "{\"prompt\":[");
    for (int i = 0; i < 40; i++)
        o += (size_t)snprintf(body + o, sizeof body - o, "%s%d", i ? "," : "", 700 + 3 * i);
    snprintf(body + o, sizeof body - o, "],\"max_tokens\":2,\"ignore_eos\":true");
    snprintf(stream, sizeof stream, "%s,\"stream\":true,\"stream_options\":{}}", body);
    strcat(body, "}");
    http_resp r[4];
    int got = 0;
    got += http_do(port, "POST", "/v1/completions", NULL, body, &r[0]) == 0;
    got += http_do(port, "POST", "/v1/completions", NULL, body, &r[1]) == 0;
    got += http_do(port, "POST", "/v1/completions", NULL, stream, &r[2]) == 0;
    got += http_do(g_port, "POST", "/v1/completions", NULL, body, &r[3]) == 0;
    int stopped = cl_stop(&sp, 10000);
    ASSERT_EQ_INT(got, 4);
    for (int i = 0; i < 4; i++) ASSERT_EQ_INT(r[i].status, 200);
    /* the first may find what earlier tests left; the second finds at least this one's */
    ASSERT_CONTAINS(r[1].body, "\"prompt_tokens_details\":{\"cached_tokens\":32}");
    ASSERT_CONTAINS(r[2].body, "\"usage\":{\"prompt_tokens\":40,\"total_tokens\":42,"
                               "\"completion_tokens\":2,\"prompt_tokens_details\":"
                               "{\"cached_tokens\":32}}");
    ASSERT_CONTAINS(r[3].body, "\"prompt_tokens_details\":null"); /* the flag is off there */
    for (int i = 0; i < 4; i++) resp_free(&r[i]);
    ASSERT_EQ_INT(stopped, 0);
}

/* ---- admission: requests wait for decode KV capacity ---------------------------------------- */

typedef struct {
    int port;
    const char *body;
    int status;
    char retry_after[16];
    char message[160];
} adm_call;

static void *adm_thread(void *arg)
{
    adm_call *a = arg;
    http_resp r;
    a->status = -1;
    if (http_do(a->port, "POST", "/v1/completions", NULL, a->body, &r) != 0) return NULL;
    a->status = r.status;
    header(&r, "Retry-After", a->retry_after, sizeof a->retry_after);
    json_t *j = json_loads(r.body, 0, NULL);
    const char *m = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
    snprintf(a->message, sizeof a->message, "%s", m ? m : "");
    json_decref(j);
    resp_free(&r);
    return NULL;
}

/* Runs n copies of body at once; counts 200s and the 503s whose message is want_503. */
static int adm_burst(int port, const char *body, int n, const char *want_503, int *ok, int *timed)
{
    adm_call calls[16];
    pthread_t th[16];
    *ok = *timed = 0;
    for (int i = 0; i < n; i++) {
        calls[i] = (adm_call){.port = port, .body = body};
        pthread_create(&th[i], NULL, adm_thread, &calls[i]);
    }
    int other = 0;
    for (int i = 0; i < n; i++) {
        pthread_join(th[i], NULL);
        if (calls[i].status == 200) {
            (*ok)++;
        } else if (calls[i].status == 503 && want_503 && strcmp(calls[i].message, want_503) == 0 &&
                   strcmp(calls[i].retry_after, "5") == 0) {
            (*timed)++;
        } else {
            printf("    request %d: HTTP %d Retry-After '%s': %s\n", i, calls[i].status,
                   calls[i].retry_after, calls[i].message);
            other++;
        }
    }
    return other;
}

/* A decode instance with room for one request's KV at a time: concurrent requests wait in the
 * scheduler's admission queue instead of failing, and --queue-timeout ends a wait with 503. */
TEST(sched_admission_queue)
{
    FIXTURE();
    /* tiny: 2 KiB of KV per token, 16-token blocks -> 16 blocks = 256 tokens per rank; every
     * request sends the same prompt, which prefix caching would prefill in no time, draining
     * the queue faster than the timeouts this case needs */
    char *node_args[] = {"--kv-cache-bytes",           "524288", "--max-model-len", "256",
                         "--no-enable-prefix-caching", NULL};
    cl_cluster c2;
    ASSERT_OK(cl_start(&c2, g_model, "0", "1", node_args));
    cl_proc sp, sq;
    int port = 0, port_q = 0;
    char *patient[] = {"--max-model-len", "256", NULL};
    char *hasty[] = {"--max-model-len", "256", "--queue-timeout", "0.05", NULL};
    if (start_scheduler_on(&c2, &sp, &port, "scheduler_admit", patient, "1") < 0 ||
        start_scheduler_on(&c2, &sq, &port_q, "scheduler_admit_q", hasty, "1") < 0) {
        cl_stop(&sp, 5000);
        cl_stop_all(&c2);
        ASSERT_MSG(0, "schedulers on the small-KV cluster did not start");
    }
    /* 200 prompt tokens (13 blocks): only one request's prompt fits at a time */
    char body[2048];
    size_t at = (size_t)snprintf(body, sizeof body, "{\"prompt\":[");
    for (int i = 0; i < 200; i++)
        at += (size_t)snprintf(body + at, sizeof body - at, "%s%d", i ? "," : "", 10 + i % 90);
    snprintf(body + at, sizeof body - at, "],\"max_tokens\":24,\"ignore_eos\":true}");
    int ok = 0, timed = 0;
    int bad = adm_burst(port, body, 8, NULL, &ok, &timed);
    int ok_q = 0, timed_q = 0;
    int bad_q = adm_burst(port_q, body, 16, "Timed out after 0.05 s waiting for capacity.", &ok_q,
                          &timed_q);
    http_resp r;
    bool got = http_do(port, "GET", "/metrics", NULL, NULL, &r) == 0;
    int a = cl_stop(&sp, 10000), b = cl_stop(&sq, 10000);
    int nodes = cl_stop_all(&c2);
    ASSERT(got);
    printf("    patient: %d ok; queue-timeout 0.05 s: %d ok, %d timed out\n", ok, ok_q, timed_q);
    ASSERT_EQ_INT(bad, 0);
    ASSERT_EQ_INT(ok, 8); /* every request waited its turn and completed */
    ASSERT_EQ_INT(bad_q, 0);
    ASSERT(ok_q >= 1);
    ASSERT(timed_q >= 1);
    /* the queue time is measured */
    ASSERT_CONTAINS(r.body,
                    "vllm:request_queue_time_seconds_count{model_name=\"tiny\",engine=\"0\"} 8.0");
    resp_free(&r);
    ASSERT_EQ_INT(a, 0);
    ASSERT_EQ_INT(b, 0);
    ASSERT_EQ_INT(nodes, 0);
}

TEST(sched_y_decode_lost)
{
    FIXTURE();
    /* a stream is running when the decode instance hangs: the heartbeat takes it out of the
     * routing set and the client gets the in-band error and [DONE] */
    int fd = open_long_stream(g_port, NULL);
    ASSERT(fd >= 0);
    cl_signal(&g_c.procs[1], SIGSTOP);
    char buf[1 << 16];
    size_t n = 0;
    int64_t deadline = pd_now_ns() + (int64_t)(CL_SEC(20.0) * PD_NS_PER_S);
    while (n < sizeof buf - 1 && pd_now_ns() < deadline) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        if (poll(&pfd, 1, 200) != 1) continue;
        ssize_t k = read(fd, buf + n, sizeof buf - 1 - n);
        if (k <= 0) break;
        n += (size_t)k;
        buf[n] = '\0';
        if (strstr(buf, "data: [DONE]")) break;
    }
    buf[n] = '\0';
    close(fd);
    ASSERT_CONTAINS(buf, "data: {\"error\":{\"message\":\"Generation failed: the decode instance "
                         "stopped responding.\",\"type\":\"InternalServerError\",\"param\":null,"
                         "\"code\":500}}\n\n");
    ASSERT_CONTAINS(buf, "data: [DONE]\n\n");
    cl_signal(&g_c.procs[1], SIGKILL);
    http_resp r;
    ASSERT(http_do(g_port, "GET", "/health", NULL, NULL, &r) == 0);
    ASSERT_EQ_INT(r.status, 503);
    ASSERT_EQ_INT(r.body_len, 0);
    resp_free(&r);
    ASSERT(http_do(g_port, "POST", "/v1/completions", NULL, "{\"prompt\":\"a\"}", &r) == 0);
    ASSERT_EQ_INT(r.status, 503);
    char h[64];
    ASSERT_STR_EQ(header(&r, "Retry-After", h, sizeof h), "5");
    ASSERT_CONTAINS(r.body, "\"message\":\"No healthy decode instance is available.\"");
    resp_free(&r);
    ASSERT(http_do(g_port, "GET", "/metrics", NULL, NULL, &r) == 0);
    ASSERT_CONTAINS(r.body, "pd:instance_up{role=\"decode\",instance=\"127.0.0.1:");
    char want[128];
    snprintf(want, sizeof want, "pd:instance_up{role=\"decode\",instance=\"127.0.0.1:%d\"} 0.0",
             g_c.ports[1]);
    ASSERT_CONTAINS(r.body, want);
    resp_free(&r);
}

TEST(sched_zz_shutdown)
{
    if (!g_ready) SKIP("no cluster");
    int a = cl_stop(&g_sched, 10000);
    int b = cl_stop(&g_sched_key, 10000);
    int l = cl_stop(&g_sched_legacy, 10000);
    if (l != 0) cl_dump_log(&g_sched_legacy, 30);
    if (a != 0) cl_dump_log(&g_sched, 30);
    if (b != 0) cl_dump_log(&g_sched_key, 30);
    int bad = cl_stop_all(&g_c); /* the decode instance was killed: pid 0, not counted */
    g_ready = false;
    ASSERT_EQ_INT(a, 0);
    ASSERT_EQ_INT(b, 0);
    ASSERT_EQ_INT(l, 0);
    ASSERT_EQ_INT(bad, 0);
}
