/* pd-scheduler: HTTP routes (docs/api.md §1, §2): route, method and API key checks,
 * /health, /version, /v1/models, and the entry of generation requests.
 *
 * Design: the route, method and key checks (gate) run when a request's headers are complete
 * (the HTTP layer's headers hook), before any body byte is buffered, so a request refused there
 * costs no memory however large a body it announces; the HTTP layer's own 413 and 503 come only
 * after them. A generation request's body is copied and parsed (chat template, tokenization) on
 * the libuv threadpool, touching only its own request, so a long prompt never blocks the loop.
 */
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd_config.h"
#include "server_internal.h"
#include "util/clock.h"
#include "util/hash.h"
#include "util/log.h"
#include "util/status.h"

uint64_t srv_next_rand(pd_apiserver *s)
{
    return pd_mix64(s->rng += 0x9e3779b97f4a7c15ull);
}

static void hex32(pd_apiserver *s, char out[33])
{
    snprintf(out, 33, "%016llx%016llx", (unsigned long long)srv_next_rand(s),
             (unsigned long long)srv_next_rand(s));
}

static bool media_is_json(const char *ct)
{
    if (!ct) return false;
    while (*ct == ' ' || *ct == '\t') ct++;
    size_t n = strcspn(ct, ";");
    while (n > 0 && (ct[n - 1] == ' ' || ct[n - 1] == '\t')) n--;
    return n == 16 && strncasecmp(ct, "application/json", 16) == 0;
}

static bool key_ok(const pd_apiserver *s, const char *auth)
{
    const char *key = s->p.api_key;
    if (!key) return true;
    if (!auth) return false;
    size_t kl = strlen(key), al = strlen(auth);
    /* "Bearer " + key, compared in constant time over the expected length */
    unsigned diff = al != kl + 7;
    const char *want = "Bearer ";
    for (size_t i = 0; i < kl + 7; i++) {
        char w = i < 7 ? want[i] : key[i - 7];
        char g = i < al ? auth[i] : 0;
        diff |= (unsigned)(w ^ g);
    }
    return diff == 0;
}

static void parse_work(uv_work_t *w);
static void parse_done(uv_work_t *w, int status);

/* ---- parsing request bodies (the threadpool) --------------------------------------------------
 */

static void parse_job_done(uv_work_t *w, int status);

static void parse_job_start(pd_apiserver *s, srv_parse_job *j)
{
    if (j->bytes >= SRV_BIG_BODY) s->big_running = true;
    uv_queue_work(&s->loop, &j->work, j->fn, parse_job_done);
}

static void parse_job_done(uv_work_t *w, int status)
{
    srv_parse_job *j = (srv_parse_job *)w;
    pd_apiserver *s = w->loop->data;
    s->parse_bytes -= j->bytes;
    if (j->bytes >= SRV_BIG_BODY) {
        s->big_running = false;
        malloc_trim(0); /* a large body's parse leaves free pages in the workers' arenas */
        srv_parse_job *next = s->big_head;
        if (next) {
            s->big_head = next->next;
            if (!s->big_head) s->big_tail = NULL;
            parse_job_start(s, next);
        }
    }
    j->done(w, status);
}

void srv_parse_submit(pd_apiserver *s, srv_parse_job *j, size_t bytes, uv_work_cb fn,
                      uv_after_work_cb done)
{
    j->bytes = bytes;
    j->fn = fn;
    j->done = done;
    j->next = NULL;
    s->parse_bytes += bytes;
    if (bytes < SRV_BIG_BODY || !s->big_running) {
        parse_job_start(s, j);
    } else if (s->big_tail) {
        s->big_tail->next = j;
        s->big_tail = j;
    } else {
        s->big_head = s->big_tail = j;
    }
}

static void handle_generation(pd_apiserver *s, pd_http_exchange *ex, pd_api_kind kind)
{
    sreq *r = calloc(1, sizeof *r);
    pd_arena *a = pd_arena_create(16384);
    if (!r || !a) {
        free(r);
        pd_arena_free(a);
        pd_http_respond_error(ex, 500, "out of memory", NULL);
        return;
    }
    r->s = s;
    r->a = a;
    r->ex = ex;
    r->refs = 1;
    pthread_mutex_init(&r->mu, NULL);
    hex32(s, r->id);
    snprintf(r->hdr, sizeof r->hdr, "X-Request-Id: %s\r\n", r->id);
    r->created = pd_wall_ns() / PD_NS_PER_S;
    r->t_accept = pd_now_ns();
    r->next = s->live;
    if (s->live) s->live->prev = r;
    s->live = r;
    pd_http_set_user(ex, r);
    pd_http_on_abort(ex, srv_on_client_abort, r);
    const char *cid = pd_http_header(ex, "X-Request-Id");
    PD_INFO(r->id, "%s %s%s%s", pd_http_method(ex), pd_http_path(ex),
            cid ? " client X-Request-Id " : "", cid ? cid : "");
    if (kind != PD_API_GENERATE && !media_is_json(pd_http_header(ex, "Content-Type"))) {
        srv_reject(r, 400, "Unsupported Media Type: Only 'application/json' is allowed", NULL);
        return;
    }
    r->kind = kind;
    r->lim = s->lim;
    r->lim.max_n = pd_reg_max_num_seqs(s->reg); /* n <= the smallest decode --max-num-seqs */
    r->body = pd_http_body_take(ex, &r->body_len);
    r->work.work.data = r;
    r->refs++; /* the worker's */
    srv_parse_submit(s, &r->work, r->body_len, parse_work, parse_done);
}

/* Threadpool: parse, render, tokenize. Touches only r->lim, r->body, r->a and r->req. */
static void parse_work(uv_work_t *w)
{
    sreq *r = w->data;
    r->parse_http = 400;
    r->parse_rc = pd_api_parse(&r->lim, r->kind, r->body ? r->body : "", r->body_len, r->a, &r->req,
                               &r->parse_http);
    if (r->parse_rc < 0) snprintf(r->parse_err, sizeof r->parse_err, "%s", pd_last_error());
    free(r->body); /* what the request keeps of it is in r->a */
    r->body = NULL;
}

/* Loop: the parse result; admission, then srv_dispatch. */
static void parse_done(uv_work_t *w, int status)
{
    sreq *r = w->data;
    pd_apiserver *s = r->s;
    if (r->done || !r->ex) { /* the client left while the request was parsed */
        srv_sreq_unref(r);
        return;
    }
    srv_sreq_unref(r); /* the worker's reference; the exchange's keeps r alive */
    if (status != 0) {
        srv_reject(r, 503, "The server is shutting down.", "Retry-After: 5\r\n");
        return;
    }
    if (r->parse_rc < 0) {
        PD_INFO(r->id, "rejected (%d): %s", r->parse_http, r->parse_err);
        srv_reject(r, r->parse_http, r->parse_err, NULL);
        return;
    }
    /* admission */
    if (s->stopping) {
        srv_reject(r, 503, "The server is shutting down.", "Retry-After: 5\r\n");
        return;
    }
    if (s->p.max_concurrent_requests > 0 && s->inflight >= s->p.max_concurrent_requests) {
        char msg[128];
        snprintf(msg, sizeof msg,
                 "The server is at its limit of %lld concurrent requests; retry later.",
                 (long long)s->p.max_concurrent_requests);
        srv_reject(r, 503, msg, "Retry-After: 1\r\n");
        return;
    }
    if (r->req.max_tokens != 0) {
        if (pd_reg_up_count(s->reg, RT_ROLE_PREFILL) == 0) {
            srv_reject(r, 503, "No healthy prefill instance is available.", "Retry-After: 5\r\n");
            return;
        }
        if (pd_reg_up_count(s->reg, RT_ROLE_DECODE) == 0) {
            srv_reject(r, 503, "No healthy decode instance is available.", "Retry-After: 5\r\n");
            return;
        }
    }
    r->counted = true;
    s->inflight++;
    r->waiting = true;
    srv_dispatch(r);
}

/* ---- plain routes ---------------------------------------------------------------------------- */

static void handle_models(pd_apiserver *s, pd_http_exchange *ex)
{
    pd_sb b = {0};
    long long now = (long long)(pd_wall_ns() / PD_NS_PER_S);
    pd_sb_str(&b, "{\"object\":\"list\",\"data\":[");
    for (int i = 0; i < s->p.n_served_names; i++) {
        char perm[33];
        hex32(s, perm);
        pd_sb_str(&b, i ? ",{\"id\":" : "{\"id\":");
        pd_sb_json_str(&b, s->p.served_names[i], strlen(s->p.served_names[i]));
        pd_sb_printf(&b,
                     ",\"object\":\"model\",\"created\":%lld,\"owned_by\":\"vllm\",\"root\":", now);
        pd_sb_json_str(&b, s->p.model, strlen(s->p.model));
        pd_sb_printf(
            &b,
            ",\"parent\":null,\"max_model_len\":%lld,\"permission\":[{\"id\":\"modelperm-%s\","
            "\"object\":\"model_permission\",\"created\":%lld,\"allow_create_engine\":false,"
            "\"allow_sampling\":true,\"allow_logprobs\":true,\"allow_search_indices\":false,"
            "\"allow_view\":true,\"allow_fine_tuning\":false,\"organization\":\"*\","
            "\"group\":null,\"is_blocking\":false}]}",
            (long long)s->L, perm, now);
    }
    pd_sb_str(&b, "]}");
    if (pd_sb_failed(&b))
        pd_http_respond_error(ex, 500, "out of memory", NULL);
    else
        pd_http_respond(ex, 200, "application/json", b.p, b.len, NULL);
    pd_sb_free(&b);
}

/* ---- /tokenize and /detokenize (§15) ------------------------------------------------------ */

/* One request: parsed (and tokenized) on the threadpool, as a generation body is. */
typedef struct {
    srv_parse_job work;
    pd_http_exchange *ex; /* NULL once the client has gone */
    bool detokenize;
    char *body; /* taken from the exchange (malloc'd; NULL when empty), freed once parsed */
    size_t len;
    pd_arena *a;
    pd_api_limits lim;
    pd_api_request req; /* tokenize */
    const char *text;   /* detokenize */
    int rc, http;
    char err[512];
} tok_job;

static void tok_abort(void *arg)
{
    tok_job *j = arg;
    pd_http_respond_error(j->ex, 500, "client disconnected", NULL);
    j->ex = NULL;
}

static void tok_work(uv_work_t *w)
{
    tok_job *j = w->data;
    const char *body = j->body ? j->body : "";
    j->rc = j->detokenize
                ? pd_api_detokenize(&j->lim, body, j->len, j->a, &j->text, &j->http)
                : pd_api_parse(&j->lim, PD_API_TOKENIZE, body, j->len, j->a, &j->req, &j->http);
    if (j->rc < 0) snprintf(j->err, sizeof j->err, "%s", pd_last_error());
    free(j->body);
    j->body = NULL;
}

/* vLLM's answers: {"count", "max_model_len", "tokens", "token_strs"} and {"prompt"}. */
static void tok_respond(tok_job *j)
{
    pd_sb b = {0};
    if (j->detokenize) {
        pd_sb_str(&b, "{\"prompt\":");
        pd_sb_json_str(&b, j->text, strlen(j->text));
        pd_sb_str(&b, "}");
    } else {
        const pd_api_prompt *p = &j->req.prompts[0];
        pd_sb_printf(&b, "{\"count\":%zu,\"max_model_len\":%lld,\"tokens\":[", p->n_ids,
                     (long long)j->lim.max_model_len);
        for (size_t i = 0; i < p->n_ids; i++) pd_sb_printf(&b, "%s%d", i ? "," : "", p->ids[i]);
        pd_sb_str(&b, "],\"token_strs\":");
        if (!j->req.token_strs) pd_sb_str(&b, "null");
        for (size_t i = 0; j->req.token_strs && i < p->n_ids; i++) {
            const char *t = pd_tok_id_to_token(j->lim.tok, p->ids[i]);
            pd_sb_str(&b, i ? "," : "[");
            pd_sb_json_str(&b, t ? t : "", t ? strlen(t) : 0);
        }
        if (j->req.token_strs) pd_sb_str(&b, p->n_ids ? "]" : "[]");
        pd_sb_str(&b, "}");
    }
    if (pd_sb_failed(&b))
        pd_http_respond_error(j->ex, 500, "out of memory", NULL);
    else
        pd_http_respond(j->ex, 200, "application/json", b.p, b.len, NULL);
    pd_sb_free(&b);
}

static void tok_done(uv_work_t *w, int status)
{
    tok_job *j = w->data;
    if (j->ex) { /* else the client has gone */
        if (status != 0)
            pd_http_respond_error(j->ex, 503, "The server is shutting down.", "Retry-After: 5\r\n");
        else if (j->rc < 0)
            pd_http_respond_error(j->ex, j->http, j->err, NULL);
        else
            tok_respond(j);
    }
    pd_arena_free(j->a);
    free(j);
}

static void handle_tokenize(pd_apiserver *s, pd_http_exchange *ex, bool detokenize)
{
    if (!media_is_json(pd_http_header(ex, "Content-Type"))) {
        pd_http_respond_error(ex, 400, "Unsupported Media Type: Only 'application/json' is allowed",
                              NULL);
        return;
    }
    tok_job *j = calloc(1, sizeof *j);
    pd_arena *a = pd_arena_create(16384);
    if (!j || !a) {
        free(j);
        pd_arena_free(a);
        pd_http_respond_error(ex, 500, "out of memory", NULL);
        return;
    }
    *j = (tok_job){.ex = ex, .detokenize = detokenize, .a = a, .lim = s->lim};
    j->body = pd_http_body_take(ex, &j->len);
    j->work.work.data = j;
    pd_http_on_abort(ex, tok_abort, j);
    srv_parse_submit(s, &j->work, j->len, tok_work, tok_done);
}

/* What a route answers with (srv_on_http). */
typedef enum {
    R_READY, /* /health and the probes that mean the same: 200 when it can serve, else 503 */
    R_LIVE,  /* 200 while the process answers */
    R_METRICS,
    R_VERSION,
    R_MODELS,
    R_COMPLETIONS,
    R_CHAT,
    R_GENERATE,
    R_TOKENIZE,
    R_DETOKENIZE,
} route_id;

/* The routes (docs/api.md §1); method: one, or two separated by ", " (the Allow header). */
static const struct {
    const char *path, *method;
    int mode; /* 0 always, 1 openai, 2 legacy */
    bool auth, generation;
    route_id id;
} ROUTES[] = {
    {"/health", "GET", 0, false, false, R_READY},
    {"/metrics", "GET", 0, false, false, R_METRICS},
    {"/version", "GET", 0, false, false, R_VERSION},
    {"/v1/models", "GET", 1, true, false, R_MODELS},
    {"/v1/completions", "POST", 1, true, true, R_COMPLETIONS},
    {"/v1/chat/completions", "POST", 1, true, true, R_CHAT},
    {"/generate", "POST", 2, true, true, R_GENERATE},
    {"/tokenize", "POST", 1, false, false, R_TOKENIZE},
    {"/detokenize", "POST", 1, false, false, R_DETOKENIZE},
    {"/ping", "GET, POST", 0, false, false, R_READY},      /* SageMaker's */
    {"/v2/health/live", "GET", 0, false, false, R_LIVE},   /* KServe's */
    {"/v2/health/ready", "GET", 0, false, false, R_READY}, /* KServe's */
};

/* method is one of route i's. */
static bool route_method(size_t i, const char *method)
{
    const char *m = ROUTES[i].method;
    size_t n = strlen(method);
    for (;;) {
        if (strncmp(m, method, n) == 0 && (m[n] == '\0' || m[n] == ',')) return true;
        m = strchr(m, ',');
        if (!m) return false;
        m += 2;
    }
}

/* The ROUTES index of path in this USE_OPENAI mode, or -1. */
static int route_find(const pd_apiserver *s, const char *path)
{
    for (size_t i = 0; i < sizeof ROUTES / sizeof *ROUTES; i++) {
        if (strcmp(path, ROUTES[i].path) != 0) continue;
        if (ROUTES[i].mode == 1 && !s->p.use_openai) continue;
        if (ROUTES[i].mode == 2 && s->p.use_openai) continue;
        return (int)i;
    }
    return -1;
}

/* The HTTP layer's headers hook, the first steps of §2 from the request line and headers: with an
 * API key, any path under /v1/ needs it first (401; as vLLM's middleware does, so that a client
 * without the key learns nothing of which /v1/ routes exist); then route and method (404/405); then
 * the key of the other protected routes (401), and a large body past --max-body-bytes-in-flight
 * (503). Returns 0 when they pass, else the status, with its message (msg_cap bytes) and header
 * lines in extra (cap bytes); a 401 to a generation route carries an X-Request-Id of its own, as
 * every answer to one does (§1), and is logged under it. */
int srv_on_headers(void *ctx, const pd_http_exchange *ex, char *msg, size_t msg_cap, char *extra,
                   size_t cap)
{
    pd_apiserver *s = ctx;
    const char *path = pd_http_path(ex), *method = pd_http_method(ex);
    int hit = route_find(s, path);
    bool key = key_ok(s, pd_http_header(ex, "Authorization"));
    bool v1 = strncmp(path, "/v1/", 4) == 0;
    if (!key && (v1 || (hit >= 0 && ROUTES[hit].auth && route_method((size_t)hit, method)))) {
        snprintf(msg, msg_cap, "Unauthorized");
        char id[33] = "";
        if (hit >= 0 && ROUTES[hit].generation) {
            hex32(s, id);
            PD_INFO(id, "%s %s: 401 (API key missing or wrong)", method, path);
        }
        snprintf(extra, cap, "WWW-Authenticate: Bearer\r\n%s%s%s", *id ? "X-Request-Id: " : "", id,
                 *id ? "\r\n" : "");
        return 401;
    }
    if (hit < 0) {
        snprintf(msg, msg_cap, "Not Found");
        return 404;
    }
    if (!route_method((size_t)hit, method)) {
        snprintf(msg, msg_cap, "Method Not Allowed");
        snprintf(extra, cap, "Allow: %s\r\n", ROUTES[hit].method);
        return 405;
    }
    /* A large body counts against --max-body-bytes-in-flight until it is parsed, not only while
     * it arrives (the HTTP layer's count): so bodies waiting for the large-body worker are
     * bounded as well. Small ones pass: they never wait behind large ones. */
    const char *cl = pd_http_header(ex, "Content-Length");
    unsigned long long n = cl ? strtoull(cl, NULL, 10) : 0;
    size_t limit = pd_apiserver_body_bytes_in_flight(&s->p),
           held = s->parse_bytes + pd_http_server_body_bytes_in_flight(s->http);
    if (n >= SRV_BIG_BODY && (held >= limit || n > limit - held)) {
        snprintf(msg, msg_cap,
                 "The server is at its limit of %zu request body bytes in flight; retry later.",
                 limit);
        snprintf(extra, cap, "Retry-After: 1\r\n");
        srv_on_refused(s, ex, 503, msg, extra, cap); /* as the HTTP layer's own 503 */
        return 503;
    }
    return 0;
}

/* The HTTP layer's headers hook: §2 steps 2-3 before the body is read. */
/* The HTTP layer's own 413 (body over --max-request-body-bytes) or 503
 * (--max-body-bytes-in-flight) to a request that passed the gate: on a generation route it
 * carries an X-Request-Id and is logged under it (§1). */
void srv_on_refused(void *ctx, const pd_http_exchange *ex, int status, const char *message,
                    char *extra, size_t extra_cap)
{
    int hit = route_find(ctx, pd_http_path(ex));
    if (hit < 0 || !ROUTES[hit].generation) return;
    char id[33];
    hex32(ctx, id);
    PD_INFO(id, "%s %s: %d (%s)", pd_http_method(ex), pd_http_path(ex), status, message);
    size_t used = strlen(extra);
    snprintf(extra + used, extra_cap - used, "X-Request-Id: %s\r\n", id);
}

/* A complete request that passed the gate (srv_on_headers). */
void srv_on_http(void *ctx, pd_http_exchange *ex)
{
    pd_apiserver *s = ctx;
    int hit = route_find(s, pd_http_path(ex));
    if (hit < 0) { /* the gate let only routes through */
        pd_http_respond_error(ex, 404, "Not Found", NULL);
        return;
    }
    switch (ROUTES[hit].id) {
    case R_READY: {
        bool ready = !s->stopping && pd_reg_up_count(s->reg, RT_ROLE_PREFILL) > 0 &&
                     pd_reg_up_count(s->reg, RT_ROLE_DECODE) > 0;
        pd_http_respond(ex, ready ? 200 : 503, NULL, "", 0, NULL);
        return;
    }
    case R_LIVE: pd_http_respond(ex, 200, NULL, "", 0, NULL); return;
    case R_METRICS: srv_handle_metrics(s, ex); return;
    case R_VERSION: {
        const char *v = "{\"version\":\"" PD_VERSION "\"}";
        pd_http_respond(ex, 200, "application/json", v, strlen(v), NULL);
        return;
    }
    case R_MODELS: handle_models(s, ex); return;
    case R_COMPLETIONS: handle_generation(s, ex, PD_API_COMPLETIONS); return;
    case R_CHAT: handle_generation(s, ex, PD_API_CHAT); return;
    case R_GENERATE: handle_generation(s, ex, PD_API_GENERATE); return;
    case R_TOKENIZE: handle_tokenize(s, ex, false); return;
    case R_DETOKENIZE: handle_tokenize(s, ex, true); return;
    }
}
