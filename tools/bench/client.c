/* pd-bench HTTP client: one blocking connection per streaming request.
 *
 * Design: the request is written whole (Content-Length, Connection: close), then the response
 * is fed to llhttp as it arrives; llhttp strips the chunked framing and hands body bytes to
 * on_body, which splits them into events (SSE "data:" payloads separated by a blank line, or
 * NDJSON lines for /generate). An event's timestamp is taken right after the recv() that
 * completed it, before parsing, so parsing cost never shifts the figures. The usage gives the
 * token counts, as vLLM's benchmark client reads them; a token event is a chunk whose choice
 * carries text (completions) or a non-role delta (chat). Servers differ in how they end a
 * choice: vLLM and pdserve send one chunk per token, the last one with its finish_reason, and
 * the usage in a chunk of its own; llama-server and OpenAI close a choice with one more chunk,
 * a finish_reason and nothing else: in chat an empty delta, which is no token; with the usage
 * in the same chunk (llama-server), which is no token either; otherwise an empty text or
 * content, which pdserve and vLLM also send for a last token whose text is empty, so such a
 * chunk counts as a token only when the usage needs it (when no other chunk accounts for that
 * token). A server may send fewer chunks than tokens (llama-server holds back the bytes of an
 * incomplete character and sends them with the next token), never more. A request of a
 * mixed workload (pdb_shape) picks its own endpoint, may ask for one JSON body instead of a
 * stream (kept whole and parsed at the end), and may close its connection after k token chunks
 * on purpose: that is how a client abort reaches the server.
 */
#define _GNU_SOURCE /* memmem */
#include <errno.h>
#include <jansson.h>
#include <llhttp.h>
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include "bench.h"
#include "util/clock.h"
#include "util/status.h"

int pdb_target_init(pdb_target *t, const char *base_url, const char *endpoint)
{
    memset(t, 0, sizeof *t);
    const char *p = base_url;
    if (strncmp(p, "http://", 7) != 0)
        return pd_error(PD_EINVAL, "--base-url: expected http://HOST:PORT, got \"%s\"", base_url);
    p += 7;
    size_t hl = strcspn(p, ":/");
    if (hl == 0 || hl >= sizeof t->host)
        return pd_error(PD_EINVAL, "--base-url: bad host in \"%s\"", base_url);
    memcpy(t->host, p, hl);
    p += hl;
    snprintf(t->port, sizeof t->port, "80");
    if (*p == ':') {
        p++;
        size_t pl = strspn(p, "0123456789");
        if (pl == 0 || pl >= sizeof t->port || atoi(p) < 1 || atoi(p) > 65535)
            return pd_error(PD_EINVAL, "--base-url: bad port in \"%s\"", base_url);
        memcpy(t->port, p, pl);
        t->port[pl] = 0;
        p += pl;
    }
    if (*p && *p != '/')
        return pd_error(PD_EINVAL, "--base-url: unexpected \"%s\" in \"%s\"", p, base_url);
    size_t prefix = strlen(p);
    while (prefix > 0 && p[prefix - 1] == '/') prefix--;
    if (strcmp(endpoint, "/v1/completions") == 0)
        t->endpoint = PDB_EP_COMPLETIONS;
    else if (strcmp(endpoint, "/v1/chat/completions") == 0)
        t->endpoint = PDB_EP_CHAT;
    else if (strcmp(endpoint, "/generate") == 0)
        t->endpoint = PDB_EP_GENERATE;
    else
        return pd_error(PD_EINVAL,
                        "--endpoint: expected /v1/completions, /v1/chat/completions or /generate, "
                        "got \"%s\"",
                        endpoint);
    if (prefix + strlen(endpoint) >= sizeof t->path)
        return pd_error(PD_EINVAL, "--base-url: path too long");
    memcpy(t->path, p, prefix);
    memcpy(t->path + prefix, endpoint, strlen(endpoint) + 1);
    memcpy(t->prefix, p, prefix);
    t->prefix[prefix] = 0;
    t->timeout_s = 600;
    return PD_OK;
}

/* ---- result buffers ----------------------------------------------------------------------- */

int pdb_result_init(pdb_result *r, int64_t expect_tokens, bool record_events)
{
    memset(r, 0, sizeof *r);
    r->prompt_tokens = -1;
    r->output_tokens = -1;
    r->cap_tok = (size_t)(expect_tokens > 0 ? expect_tokens : 16) + 8;
    r->tok_ns = malloc(r->cap_tok * sizeof *r->tok_ns);
    r->tok_fin = malloc(r->cap_tok * sizeof *r->tok_fin);
    if (!r->tok_ns || !r->tok_fin) return pd_error(PD_ENOMEM, "out of memory");
    if (record_events) {
        r->cap_ev = r->cap_tok + 8;
        r->ev = malloc(r->cap_ev * sizeof *r->ev);
        r->ev_cap = r->cap_ev * 256;
        r->ev_text = malloc(r->ev_cap);
        if (!r->ev || !r->ev_text) return pd_error(PD_ENOMEM, "out of memory");
    }
    return PD_OK;
}

void pdb_result_free(pdb_result *r)
{
    free(r->tok_ns);
    free(r->tok_fin);
    free(r->ev);
    free(r->ev_text);
    memset(r, 0, sizeof *r);
}

/* Doubles *cap until it holds need elements; *buf keeps its contents. */
static int grow(void **buf, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return PD_OK;
    size_t c = *cap ? *cap : 16;
    while (c < need) c *= 2;
    void *nb = realloc(*buf, c * elem);
    if (!nb) return pd_error(PD_ENOMEM, "out of memory");
    *buf = nb;
    *cap = c;
    return PD_OK;
}

/* ---- the streaming reader ------------------------------------------------------------------ */

typedef struct {
    const pdb_target *t;
    pdb_endpoint ep;     /* this request's endpoint */
    bool stream;         /* false: the body is one JSON document, kept in body */
    int logprobs;        /* logprobs asked for: token chunks must carry them */
    int64_t abort_after; /* > 0: stop reading after this many token chunks */
    bool abort_now;      /* abort_after reached */
    char *body;          /* (body_len) non-streaming body */
    size_t body_len, body_cap;
    pdb_result *r;
    int status;    /* HTTP status */
    bool complete; /* llhttp saw the end of the message */
    bool done;     /* [DONE] seen */
    bool failed;   /* r->error set */
    int64_t now;   /* time of the recv() being parsed */
    char *line;    /* current event / line being assembled (body bytes) */
    size_t line_len, line_cap;
    char errbody[200]; /* start of a non-200 body, for the message */
    size_t errbody_len;
    int64_t gen_lines; /* /generate: lines seen */
} reader;

static void fail(reader *rd, const char *fmt, const char *detail)
{
    if (rd->failed) return;
    rd->failed = true;
    rd->r->ok = false;
    snprintf(rd->r->error, sizeof rd->r->error, fmt, detail);
}

static void record_event(reader *rd, const char *data, size_t len)
{
    pdb_result *r = rd->r;
    if (!r->ev) return;
    if (grow((void **)&r->ev, &r->cap_ev, r->n_ev + 1, sizeof *r->ev) < 0 ||
        grow((void **)&r->ev_text, &r->ev_cap, r->ev_len + len + 1, 1) < 0) {
        fail(rd, "%s", "out of memory");
        return;
    }
    r->ev[r->n_ev].ns = rd->now;
    r->ev[r->n_ev].off = r->ev_len;
    memcpy(r->ev_text + r->ev_len, data, len);
    r->ev_text[r->ev_len + len] = 0;
    r->ev_len += len + 1;
    r->n_ev++;
}

/* A token chunk's time; closing: a chunk that may carry no token (see the top). */
static void add_token(reader *rd, bool closing)
{
    pdb_result *r = rd->r;
    size_t cap = r->cap_tok;
    if (grow((void **)&r->tok_ns, &cap, r->n_tok + 1, sizeof *r->tok_ns) < 0 ||
        grow((void **)&r->tok_fin, &r->cap_tok, r->n_tok + 1, sizeof *r->tok_fin) < 0) {
        fail(rd, "%s", "out of memory");
        return;
    }
    r->tok_fin[r->n_tok] = closing;
    r->tok_ns[r->n_tok++] = rd->now;
}

/* What a choice of a stream chunk carries. */
typedef enum {
    CHUNK_TOKEN,   /* a token (its text may be empty: held back, or a special token) */
    CHUNK_ROLE,    /* chat: the role chunk that opens a choice */
    CHUNK_CLOSING, /* a finish_reason with an empty text or content and no logprobs, which is a
                      token's chunk on some servers and a closing one on others */
    CHUNK_NONE,    /* a finish_reason with an empty delta, or with the usage and no text: no
                      token */
} chunk_kind;

static bool is_empty_text(json_t *v)
{
    return !v || json_is_null(v) || (json_is_string(v) && json_string_length(v) == 0);
}

/* with_usage: the chunk also carries the usage (llama-server's closing chunk). */
static chunk_kind classify(json_t *c, bool with_usage)
{
    json_t *delta = json_object_get(c, "delta"), *lp = json_object_get(c, "logprobs");
    bool finish = json_is_string(json_object_get(c, "finish_reason"));
    bool no_lp = !lp || json_is_null(lp);
    if (delta) {
        if (json_object_get(delta, "role")) return CHUNK_ROLE;
        bool any = false;
        const char *key;
        json_t *v;
        json_object_foreach(delta, key, v)
        {
            if (!is_empty_text(v)) return CHUNK_TOKEN; /* a non-role delta */
            if (!json_is_null(v)) any = true;
        }
        if (!finish || !no_lp) return CHUNK_TOKEN;
        return !any || with_usage ? CHUNK_NONE : CHUNK_CLOSING;
    }
    if (!is_empty_text(json_object_get(c, "text")) || !finish || !no_lp) return CHUNK_TOKEN;
    return with_usage ? CHUNK_NONE : CHUNK_CLOSING;
}

/* Drops the times of the closing chunks that no token needs: the other chunks
 * account for want tokens already. The ones kept are the earliest. */
static void settle_closing_chunks(pdb_result *r, int64_t want)
{
    size_t n_fin = 0;
    for (size_t k = 0; k < r->n_tok; k++) n_fin += r->tok_fin[k];
    int64_t others = (int64_t)(r->n_tok - n_fin);
    size_t keep = want > others ? (size_t)(want - others) : 0;
    size_t o = 0;
    for (size_t k = 0; k < r->n_tok; k++) {
        if (r->tok_fin[k] && keep == 0) continue;
        if (r->tok_fin[k]) keep--;
        r->tok_ns[o++] = r->tok_ns[k];
    }
    r->n_tok = o;
}

/* Parses a payload that jansson refused because an object key holds "\u0000" (a token's text
 * as a top_logprobs key; valid JSON, but jansson keeps keys NUL-terminated): every "\u0000"
 * escape becomes "\ufffd", which changes no count this reader takes. NULL if still invalid. */
static json_t *load_nul_keys(const char *data, size_t len, json_error_t *je)
{
    if (!memmem(data, len, "\\u0000", 6)) return NULL;
    char *copy = malloc(len);
    if (!copy) return NULL;
    memcpy(copy, data, len);
    for (char *p = copy; (p = memmem(p, len - (size_t)(p - copy), "\\u0000", 6)) != NULL; p += 6)
        memcpy(p, "\\ufffd", 6);
    json_t *o = json_loadb(copy, len, JSON_ALLOW_NUL, je);
    free(copy);
    return o;
}

/* One SSE data payload (OpenAI endpoints). */
static void on_sse_data(reader *rd, const char *data, size_t len)
{
    record_event(rd, data, len);
    if (len == 6 && memcmp(data, "[DONE]", 6) == 0) {
        rd->done = true;
        return;
    }
    json_error_t je;
    json_t *ev = json_loadb(data, len, JSON_ALLOW_NUL, &je); /* "\u0000" is valid JSON */
    if (!ev) ev = load_nul_keys(data, len, &je);
    if (!ev) {
        fail(rd, "malformed SSE event: %s", je.text);
        return;
    }
    json_t *err = json_object_get(ev, "error");
    if (err) {
        const char *msg = json_string_value(json_object_get(err, "message"));
        fail(rd, "in-band error: %s", msg ? msg : "(no message)");
        json_decref(ev);
        return;
    }
    json_t *choices = json_object_get(ev, "choices");
    if (json_is_array(choices) && json_array_size(choices) > 0) {
        json_t *c = json_array_get(choices, 0);
        chunk_kind kind = classify(c, json_is_object(json_object_get(ev, "usage")));
        if (kind == CHUNK_TOKEN || kind == CHUNK_CLOSING) add_token(rd, kind == CHUNK_CLOSING);
        if (kind == CHUNK_TOKEN) {
            if (rd->logprobs > 0 && !json_is_object(json_object_get(c, "logprobs")))
                fail(rd, "%s", "token chunk without the logprobs asked for");
            if (rd->abort_after > 0 && (int64_t)rd->r->n_tok >= rd->abort_after)
                rd->abort_now = true;
        }
    }
    json_t *usage = json_object_get(ev, "usage");
    if (json_is_object(usage)) {
        json_t *pt = json_object_get(usage, "prompt_tokens");
        json_t *ct = json_object_get(usage, "completion_tokens");
        if (json_is_integer(pt)) rd->r->prompt_tokens = json_integer_value(pt);
        if (json_is_integer(ct)) rd->r->output_tokens = json_integer_value(ct);
    }
    json_decref(ev);
}

/* One NDJSON line of the legacy /generate stream: a cumulative text per token. */
static void on_ndjson_line(reader *rd, const char *data, size_t len)
{
    record_event(rd, data, len);
    if (len >= 9 && memcmp(data, "{\"error\"", 8) == 0) {
        fail(rd, "in-band error: %.200s", data);
        return;
    }
    rd->gen_lines++;
    add_token(rd, false);
}

/* Splits body bytes into events; rd->line holds the unfinished one. */
static void feed_body(reader *rd, const char *at, size_t len)
{
    for (size_t i = 0; i < len; i++) {
        char c = at[i];
        if (grow((void **)&rd->line, &rd->line_cap, rd->line_len + 2, 1) < 0) {
            fail(rd, "%s", "out of memory");
            return;
        }
        rd->line[rd->line_len++] = c;
        rd->line[rd->line_len] = 0;
        if (c != '\n') continue;
        if (rd->t->endpoint == PDB_EP_GENERATE) {
            size_t l = rd->line_len - 1;
            if (l > 0) on_ndjson_line(rd, rd->line, l);
            rd->line_len = 0;
        } else if (rd->line_len >= 2 && rd->line[rd->line_len - 2] == '\n') {
            /* an event ends at a blank line; take its data: lines (one in practice) */
            char *ev = rd->line;
            size_t evlen = rd->line_len - 2;
            ev[evlen] = 0;
            if (evlen >= 5 && strncmp(ev, "data:", 5) == 0) {
                const char *d = ev + 5;
                if (*d == ' ') d++;
                on_sse_data(rd, d, strlen(d));
            } else if (evlen > 0 && ev[0] != ':') {
                fail(rd, "unexpected SSE line: %.100s", ev);
            }
            rd->line_len = 0;
        }
    }
}

/* The whole non-streaming answer: counts from usage, one entry per choice with its text and,
 * when asked for, its logprobs. */
static void on_json_body(reader *rd)
{
    record_event(rd, rd->body ? rd->body : "", rd->body_len);
    json_error_t je;
    json_t *o = json_loadb(rd->body ? rd->body : "", rd->body_len, JSON_ALLOW_NUL, &je);
    if (!o) o = load_nul_keys(rd->body ? rd->body : "", rd->body_len, &je);
    if (!o) {
        fail(rd, "malformed JSON body: %s", je.text);
        return;
    }
    json_t *choices = json_object_get(o, "choices");
    json_t *usage = json_object_get(o, "usage");
    if (!json_is_array(choices) || !json_is_object(usage)) {
        fail(rd, "%s", "JSON body without choices or usage");
        json_decref(o);
        return;
    }
    json_t *pt = json_object_get(usage, "prompt_tokens");
    json_t *ct = json_object_get(usage, "completion_tokens");
    if (json_is_integer(pt)) rd->r->prompt_tokens = json_integer_value(pt);
    if (json_is_integer(ct)) rd->r->output_tokens = json_integer_value(ct);
    size_t i;
    json_t *c;
    json_array_foreach(choices, i, c)
    {
        json_t *text = rd->ep == PDB_EP_CHAT
                           ? json_object_get(json_object_get(c, "message"), "content")
                           : json_object_get(c, "text");
        if (!json_is_string(text)) {
            fail(rd, "%s", "a choice without its text");
            break;
        }
        if (rd->logprobs > 0 && !json_is_object(json_object_get(c, "logprobs"))) {
            fail(rd, "%s", "a choice without the logprobs asked for");
            break;
        }
    }
    rd->r->n_choices = json_array_size(choices);
    json_decref(o);
}

static int cb_body(llhttp_t *p, const char *at, size_t len)
{
    reader *rd = p->data;
    if (rd->status == 200 && !rd->stream) {
        if (grow((void **)&rd->body, &rd->body_cap, rd->body_len + len + 1, 1) < 0) {
            fail(rd, "%s", "out of memory");
            return 0;
        }
        memcpy(rd->body + rd->body_len, at, len);
        rd->body_len += len;
        rd->body[rd->body_len] = 0;
        return 0;
    }
    if (rd->status != 200) {
        size_t room = sizeof rd->errbody - 1 - rd->errbody_len;
        size_t k = len < room ? len : room;
        memcpy(rd->errbody + rd->errbody_len, at, k);
        rd->errbody_len += k;
        rd->errbody[rd->errbody_len] = 0;
        return 0;
    }
    feed_body(rd, at, len);
    return 0;
}

static int cb_headers_complete(llhttp_t *p)
{
    reader *rd = p->data;
    rd->status = p->status_code;
    return 0;
}

static int cb_message_complete(llhttp_t *p)
{
    ((reader *)p->data)->complete = true;
    return 0;
}

static int connect_to(const pdb_target *t, char *err, size_t errn)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    int gai = getaddrinfo(t->host, t->port, &hints, &res);
    if (gai != 0) {
        snprintf(err, errn, "cannot resolve %s: %s", t->host, gai_strerror(gai));
        return -1;
    }
    int fd = -1, e = 0;
    for (struct addrinfo *a = res; a; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) break;
        e = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0) snprintf(err, errn, "connect %s:%s: %s", t->host, t->port, strerror(e));
    return fd;
}

/* The JSON body for p sent to endpoint ep (a new string, free()). */
static char *request_body(const pdb_target *t, pdb_endpoint ep, const pdb_prompt *p, uint64_t seed)
{
    const pdb_shape *sh = &p->shape;
    bool stream = !sh->set || sh->stream;
    json_t *b = json_object();
    if (t->model && ep != PDB_EP_GENERATE) json_object_set_new(b, "model", json_string(t->model));
    if (ep == PDB_EP_CHAT) {
        json_t *msgs = json_pack("[{s:s,s:s}]", "role", "user", "content", p->text ? p->text : "");
        json_object_set_new(b, "messages", msgs);
    } else if (p->ids) {
        json_t *ids = json_array();
        for (size_t i = 0; i < p->n_ids; i++) json_array_append_new(ids, json_integer(p->ids[i]));
        json_object_set_new(b, "prompt", ids);
    } else {
        json_object_set_new(b, "prompt", json_string(p->text ? p->text : ""));
    }
    json_object_set_new(b, "max_tokens", json_integer(p->output_len));
    json_object_set_new(b, "ignore_eos", json_true());
    json_object_set_new(b, "temperature", json_real(0.0));
    json_object_set_new(b, "seed", json_integer((json_int_t)(seed & 0x7fffffffffffffffull)));
    json_object_set_new(b, "stream", json_boolean(stream));
    if (stream && ep != PDB_EP_GENERATE)
        json_object_set_new(b, "stream_options", json_pack("{s:b}", "include_usage", 1));
    if (sh->set && sh->n > 1) json_object_set_new(b, "n", json_integer(sh->n));
    if (sh->set && sh->logprobs > 0) {
        if (ep == PDB_EP_CHAT) {
            json_object_set_new(b, "logprobs", json_true());
            json_object_set_new(b, "top_logprobs", json_integer(sh->logprobs));
        } else {
            json_object_set_new(b, "logprobs", json_integer(sh->logprobs));
        }
    }
    if (t->extra_body) json_object_update(b, t->extra_body); /* they win over the above */
    char *s = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    return s;
}

static int send_all(int fd, const char *buf, size_t len)
{
    while (len > 0) {
        ssize_t w = send(fd, buf, len, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        buf += w;
        len -= (size_t)w;
    }
    return 0;
}

void pdb_request_run(const pdb_target *t, const pdb_prompt *p, uint64_t seed, pdb_result *r)
{
    const pdb_shape *sh = &p->shape;
    r->ok = r->aborted = false;
    r->streamed = !sh->set || sh->stream;
    r->error[0] = 0;
    r->n_tok = r->n_ev = r->ev_len = r->n_choices = 0;
    r->prompt_tokens = r->output_tokens = -1;
    reader rd = {.t = t,
                 .r = r,
                 .ep = sh->set ? sh->ep : t->endpoint,
                 .stream = r->streamed,
                 .logprobs = sh->set ? sh->logprobs : 0,
                 .abort_after = sh->set && sh->stream ? sh->abort_after : 0};
    char path[600];
    snprintf(path, sizeof path, "%s%s", t->prefix,
             rd.ep == PDB_EP_CHAT          ? "/v1/chat/completions"
             : rd.ep == PDB_EP_COMPLETIONS ? "/v1/completions"
                                           : "/generate");
    char *body = request_body(t, rd.ep, p, seed);
    char head[1200];
    int fd = -1;
    r->t_send = pd_now_ns();
    r->t_end = r->t_send;
    if (!body) {
        fail(&rd, "%s", "out of memory");
        goto out;
    }
    char auth[600] = "";
    if (t->api_key) snprintf(auth, sizeof auth, "Authorization: Bearer %s\r\n", t->api_key);
    size_t blen = strlen(body);
    int hn = snprintf(head, sizeof head,
                      "POST %s HTTP/1.1\r\nHost: %s:%s\r\nContent-Type: application/json\r\n"
                      "Accept: %s\r\n%sContent-Length: %zu\r\n"
                      "Connection: close\r\n\r\n",
                      sh->set ? path : t->path, t->host, t->port,
                      rd.stream ? "text/event-stream" : "application/json", auth, blen);
    if (hn < 0 || (size_t)hn >= sizeof head) {
        fail(&rd, "%s", "request head too long");
        goto out;
    }
    char err[300];
    fd = connect_to(t, err, sizeof err);
    if (fd < 0) {
        fail(&rd, "%.240s", err);
        goto out;
    }
    if (send_all(fd, head, strlen(head)) < 0 || send_all(fd, body, blen) < 0) {
        fail(&rd, "send: %s", strerror(errno));
        goto out;
    }
    llhttp_settings_t st;
    llhttp_settings_init(&st);
    st.on_body = cb_body;
    st.on_headers_complete = cb_headers_complete;
    st.on_message_complete = cb_message_complete;
    llhttp_t parser;
    llhttp_init(&parser, HTTP_RESPONSE, &st);
    parser.data = &rd;
    char buf[16384];
    while (!rd.complete && !rd.failed && !rd.abort_now) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int pr = poll(&pfd, 1, t->timeout_s * 1000);
        if (pr < 0 && errno == EINTR) continue;
        if (pr == 0) {
            fail(&rd, "%s", "timed out waiting for the server");
            break;
        }
        ssize_t n = recv(fd, buf, sizeof buf, 0);
        rd.now = pd_now_ns();
        if (n < 0) {
            if (errno == EINTR) continue;
            fail(&rd, "recv: %s", strerror(errno));
            break;
        }
        if (n == 0) {
            llhttp_errno_t fe = llhttp_finish(&parser);
            if (!rd.complete && fe != HPE_OK)
                fail(&rd, "%s", "connection closed mid-response");
            else if (!rd.complete)
                fail(&rd, "%s", "connection closed before a response");
            break;
        }
        llhttp_errno_t pe = llhttp_execute(&parser, buf, (size_t)n);
        if (pe != HPE_OK && !rd.failed) {
            fail(&rd, "bad HTTP response: %s", llhttp_errno_name(pe));
            break;
        }
    }
    r->t_end = pd_now_ns();
    if (rd.failed) goto out;
    if (rd.abort_now) { /* closing the socket below is the abort */
        r->ok = r->aborted = true;
        goto out;
    }
    if (rd.status != 200) {
        char msg[260];
        snprintf(msg, sizeof msg, "HTTP %d: %s", rd.status, rd.errbody);
        fail(&rd, "%.240s", msg);
        goto out;
    }
    if (!rd.stream) {
        on_json_body(&rd);
        if (rd.failed) goto out;
    } else if (rd.ep == PDB_EP_GENERATE) {
        r->output_tokens = rd.gen_lines;
    } else {
        if (!rd.done) {
            fail(&rd, "%s", "stream ended without [DONE]");
            goto out;
        }
        if (r->output_tokens < 0) {
            fail(&rd, "%s", "no usage chunk in the stream");
            goto out;
        }
    }
    if (rd.stream && r->n_tok == 0) {
        fail(&rd, "%s", "no token arrived");
        goto out;
    }
    if (rd.ep != PDB_EP_GENERATE) {
        /* ignore_eos: every choice runs to max_tokens */
        int n = sh->set && sh->n > 1 ? sh->n : 1;
        int64_t want = (int64_t)n * p->output_len;
        char msg[160];
        if (r->output_tokens != want) {
            snprintf(msg, sizeof msg, "usage says %lld completion tokens, expected %d x %lld",
                     (long long)r->output_tokens, n, (long long)p->output_len);
            fail(&rd, "%s", msg);
            goto out;
        }
        if (rd.stream) settle_closing_chunks(r, want);
        if (rd.stream && (int64_t)r->n_tok > want) {
            snprintf(msg, sizeof msg, "%zu token chunks for %lld completion tokens", r->n_tok,
                     (long long)want);
            fail(&rd, "%s", msg);
            goto out;
        }
        if (!rd.stream && r->n_choices != (size_t)n) {
            snprintf(msg, sizeof msg, "%zu choices, expected %d", r->n_choices, n);
            fail(&rd, "%s", msg);
            goto out;
        }
    }
    r->ok = true;
out:
    if (fd >= 0) close(fd);
    free(body);
    free(rd.line);
    free(rd.body);
}
