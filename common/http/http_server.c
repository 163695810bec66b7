/* HTTP/1.1 server on libuv + llhttp (see http_server.h for the contract).
 *
 * Per connection: received bytes are appended to an input buffer and fed to llhttp while no
 * exchange is in flight. A request becomes an exchange when its headers are complete (line and
 * headers, for the owner's checks); its body is attached when the message completes, which
 * pauses the parser (HPE_PAUSED from on_message_complete) and hands the exchange to the handler.
 * Bytes after it stay in the input buffer until the exchange ends, which is how pipelined
 * requests are answered in order. Reading continues meanwhile (at most max_header_bytes ahead),
 * so a reset connection is seen and reported as an abort; EOF only marks the connection to close
 * once what was received has been answered. One timer per connection enforces the header, body,
 * idle and lingering-close timeouts.
 *
 * The parser (http_parse: llhttp, the request being assembled, the header/body limits) knows
 * nothing of sockets: it reports to its owner through hooks (a request begins, its headers are
 * complete, its body starts, body bytes are announced and released, it is complete). A
 * connection is one owner; pd_http_parse_buffer is the other, so tests and the fuzzer run
 * exactly the code that parses what clients send. The server counts the announced body bytes of
 * all its connections against max_body_in_flight.
 */
#include "http/http_server.h"

#include <jansson.h>
#include <llhttp.h>
#include <pthread.h>
#include <ctype.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "util/log.h"
#include "util/status.h"

enum timer_kind { T_NONE, T_HEADER, T_BODY, T_IDLE, T_LINGER };

/* A refusal while a body may still be arriving: how long the connection keeps reading (and
 * dropping) what the client sends after the answer, before it closes. */
#define LINGER_MS 2000

/* Bytes one read takes at most. */
#define READ_BYTES 65536

typedef struct conn conn;

typedef struct {
    size_t name, value; /* offsets into the header scratch buffer */
} hdr_ref;

struct pd_http_exchange {
    conn *c; /* NULL once the connection is gone */
    pd_arena *arena;
    char *method, *path, *query, *body;
    char *body_buf; /* what body points to when the body is not empty; freed with the exchange */
    size_t body_len;
    char **hnames, **hvalues;
    size_t n_headers;
    bool keep_alive, streaming, aborted;
    size_t max_stream_buffer;
    void (*abort_cb)(void *);
    void *abort_arg;
    void (*drain_cb)(void *);
    void *drain_arg;
    void *user;
};

struct pd_http_server {
    uv_loop_t *loop;
    uv_tcp_t listener;
    pd_http_params p;
    pd_http_handler handler;
    void *ctx;
    conn *conns; /* doubly linked list of open connections */
    int n_conns;
    bool stopping;
    int handles_open; /* listener + connections not yet freed */
    void (*on_stopped)(void *);
    void *stopped_arg;
    pd_http_headers_fn on_headers; /* NULL: every request reaches the handler */
    pd_http_refused_fn on_refused; /* NULL: the server's 413 and 503 go out as they are */
    size_t body_in_flight;         /* announced body bytes of requests still arriving */
};

/* What a parser tells its owner (a connection, or pd_http_parse_buffer). */
typedef struct {
    void (*begin)(void *owner); /* a request starts */
    /* its headers are complete (ex: line and headers, no body); 0 to read on, else the owner
     * has answered it: the parser drops it (and stops when body_pending) */
    int (*headers)(void *owner, const pd_http_exchange *ex, bool body_pending);
    void (*body_start)(void *owner, bool continue_100); /* "Expect: 100-continue" was sent */
    bool (*reserve)(void *owner, size_t bytes); /* body bytes announced; false: none left (503) */
    void (*release)(void *owner, size_t bytes); /* what reserve took, when the request is over */
    void (*request)(void *owner, pd_http_exchange *ex); /* complete; the owner takes ex */
} parse_hooks;

/* One connection's request parser: llhttp plus the request being assembled. */
typedef struct {
    llhttp_t llp; /* .data = this struct */
    const pd_http_params *lim;
    const parse_hooks *hooks;
    void *owner;
    bool in_message;  /* inside a request (between begin and complete) */
    bool in_trailers; /* after the last chunk of a chunked body: trailer fields */
    /* url + header names/values, each NUL-terminated, in one scratch buffer */
    char *scratch;
    size_t scratch_len, scratch_cap;
    size_t url_len;
    hdr_ref *hdrs;
    size_t n_hdrs, hdrs_cap;
    bool last_was_value;
    size_t header_bytes;
    pd_http_exchange *ex; /* the request, from its headers on; NULL outside one */
    bool answered;        /* the owner refused it from its headers: dropped, not handed over */
    size_t announced;     /* body bytes announced (Content-Length, or the chunk sizes so far)
                             and reserved from the owner */
    char *body;           /* the body so far (announced + 1 bytes at most); handed to ex */
    size_t body_len, body_cap;
    int err_status; /* a check failed inside a callback: 400 / 413 / 431 / 503, 500 (memory) */
} http_parse;

struct conn {
    uv_tcp_t tcp;
    uv_timer_t timer;
    http_parse ps;
    pd_http_server *srv;
    conn *prev, *next;
    int handles_open;
    bool closing, close_after_write, in_execute, reading;
    bool peer_eof;  /* the client sent EOF: answer what it sent in full, then close */
    bool lingering; /* refused with a body arriving: drop input, close after the answer */
    bool shut;      /* the lingering close has begun (shutdown sent, T_LINGER armed) */
    uv_shutdown_t shutdown_req;
    enum timer_kind timer_kind;
    /* input not yet parsed */
    char *in;
    size_t in_len, in_cap;
    pd_http_exchange *ex; /* in flight */
    size_t write_pending; /* bytes handed to uv_write, not yet written */
};

typedef struct {
    uv_write_t req;
    conn *c;
    size_t len;
    char data[];
} wreq;

static void conn_process(conn *c);
static void conn_close(conn *c);
static void conn_finish(conn *c);
static void conn_read_start(conn *c);
static void parse_release(http_parse *ps);
static void parse_free(http_parse *ps);

pd_http_params pd_http_default_params(void)
{
    return (pd_http_params){
        .host = "127.0.0.1",
        .port = 0,
        .max_body_bytes = 16u << 20,
        .max_header_bytes = 64u << 10,
        .header_timeout_ms = 10000,
        .body_timeout_ms = 60000,
        .idle_timeout_ms = 60000,
        .max_stream_buffer = 1u << 20,
        .max_connections = 65536,
        .max_body_in_flight = 64u << 20,
    };
}

const char *pd_http_reason(int status)
{
    switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 204: return "No Content";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 413: return "Payload Too Large";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 503: return "Service Unavailable";
    default: return "Unknown";
    }
}

const char *pd_http_error_type(int status)
{
    switch (status) {
    case 400: return "BadRequestError";
    case 401: return "AuthenticationError";
    case 404: return "NotFoundError";
    case 405: return "MethodNotAllowedError";
    case 408: return "RequestTimeoutError";
    case 413: return "PayloadTooLargeError";
    case 431: return "RequestHeaderFieldsTooLargeError";
    case 503: return "ServiceUnavailableError";
    default: return "InternalServerError";
    }
}

/* ---- writing ------------------------------------------------------------------------------ */

static void conn_arm(conn *c, enum timer_kind k);

static void on_write(uv_write_t *req, int status)
{
    wreq *w = (wreq *)req;
    conn *c = w->c;
    c->write_pending -= w->len;
    free(w);
    if (status < 0) {
        conn_close(c);
        return;
    }
    pd_http_exchange *ex = c->ex;
    if (ex && ex->drain_cb && c->write_pending <= ex->max_stream_buffer / 2) {
        void (*cb)(void *) = ex->drain_cb;
        ex->drain_cb = NULL;
        cb(ex->drain_arg);
    }
    if (c->close_after_write && c->write_pending == 0)
        conn_finish(c);
    else if (c->write_pending == 0 && !c->ex && !c->ps.in_message && !c->closing &&
             c->timer_kind == T_NONE)
        conn_arm(c, T_IDLE); /* an idle timeout that fired during the write starts over */
}

/* Queues the concatenation of n parts as one write (copied). */
static int conn_writev(conn *c, const void *const *parts, const size_t *lens, int n)
{
    if (c->closing) return PD_ECLOSED;
    size_t total = 0;
    for (int i = 0; i < n; i++) total += lens[i];
    /* nothing queued: write straight from the callers' buffers; only what the socket does not
     * take now is copied and queued (the common SSE case costs one writev, no allocation) */
    size_t done = 0;
    if (c->write_pending == 0 && n <= 4) {
        uv_buf_t now[4];
        for (int i = 0; i < n; i++) now[i] = uv_buf_init((char *)parts[i], (unsigned)lens[i]);
        int w = uv_try_write((uv_stream_t *)&c->tcp, now, (unsigned)n);
        if (w > 0) done = (size_t)w;
        if (done == total) return PD_OK;
        /* an error (a peer gone) surfaces through the queued write's callback, as without
         * this shortcut: closing here would run the abort callback inside the caller's write */
    }
    wreq *w = malloc(sizeof *w + (total - done));
    if (!w) return pd_error(PD_ENOMEM, "http: out of memory for a %zu-byte write", total);
    w->c = c;
    w->len = total - done;
    size_t off = 0, skip = done;
    for (int i = 0; i < n; i++) {
        size_t from = skip < lens[i] ? skip : lens[i];
        skip -= from;
        memcpy(w->data + off, (const char *)parts[i] + from, lens[i] - from);
        off += lens[i] - from;
    }
    uv_buf_t b = uv_buf_init(w->data, (unsigned)w->len);
    int rc = uv_write(&w->req, (uv_stream_t *)&c->tcp, &b, 1, on_write);
    if (rc < 0) {
        free(w);
        conn_close(c);
        return pd_error(PD_ECLOSED, "http: write failed: %s", uv_strerror(rc));
    }
    c->write_pending += w->len;
    return PD_OK;
}

static int conn_write(conn *c, const void *data, size_t len)
{
    return conn_writev(c, &data, &len, 1);
}

/* Status line + headers into buf; returns the length (0 if it did not fit). */
static size_t format_head(char *buf, size_t cap, int status, const char *content_type,
                          long long content_length, bool chunked, bool close,
                          const char *extra_headers)
{
    int n = snprintf(buf, cap, "HTTP/1.1 %d %s\r\n", status, pd_http_reason(status));
    if (content_type) n += snprintf(buf + n, cap - (size_t)n, "Content-Type: %s\r\n", content_type);
    if (chunked)
        n += snprintf(buf + n, cap - (size_t)n, "Transfer-Encoding: chunked\r\n");
    else
        n += snprintf(buf + n, cap - (size_t)n, "Content-Length: %lld\r\n", content_length);
    if (close) n += snprintf(buf + n, cap - (size_t)n, "Connection: close\r\n");
    n += snprintf(buf + n, cap - (size_t)n, "%s\r\n", extra_headers ? extra_headers : "");
    return (size_t)n < cap ? (size_t)n : 0;
}

/* An error response the server produces by itself (no exchange); close: the connection closes
 * once it is written. The message is one of the server's or its owner's (no JSON escaping). */
static int conn_answer(conn *c, int status, const char *message, const char *extra_headers,
                       bool close)
{
    char body[512], head[1024];
    int bl = snprintf(body, sizeof body,
                      "{\"error\":{\"message\":\"%s\",\"type\":\"%s\",\"param\":null,\"code\":%d}}",
                      message, pd_http_error_type(status), status);
    size_t hl =
        format_head(head, sizeof head, status, "application/json", bl, false, close, extra_headers);
    const void *parts[2] = {head, body};
    size_t lens[2] = {hl, (size_t)bl};
    return conn_writev(c, parts, lens, 2);
}

/* The server's own error response, after which the connection closes. linger: the client may
 * still be sending a body, so the connection keeps reading and dropping it until the answer is
 * out and the client closes too, or LINGER_MS have passed (a lingering close): closing with
 * unread bytes would reset the connection, and a client still sending would see the reset
 * instead of the answer. */
static void conn_fail(conn *c, int status, const char *message, const char *extra_headers,
                      bool linger)
{
    if (c->closing || c->close_after_write) return;
    if (linger && !c->peer_eof) {
        c->lingering = true;
        c->in_len = 0;
        if (!c->reading) {
            c->reading = true;
            conn_read_start(c);
        }
        conn_arm(c, T_LINGER); /* bounds the write as well */
    } else if (c->reading) {
        uv_read_stop((uv_stream_t *)&c->tcp);
        c->reading = false;
    }
    c->close_after_write = true;
    if (conn_answer(c, status, message, extra_headers, true) == PD_OK && c->write_pending == 0)
        conn_finish(c);
}

static void on_shutdown(uv_shutdown_t *req, int status)
{
    conn *c = req->data;
    if (status < 0 && !c->closing) conn_close(c);
}

/* The answer that ends the connection has been written: close, or, lingering, send FIN and read
 * on until the client closes or T_LINGER fires. */
static void conn_finish(conn *c)
{
    if (c->closing || c->shut) return;
    if (!c->lingering || c->peer_eof) { /* the client has sent all (its EOF was read) */
        conn_close(c);
        return;
    }
    c->shut = true;
    c->shutdown_req.data = c;
    if (uv_shutdown(&c->shutdown_req, (uv_stream_t *)&c->tcp, on_shutdown) < 0) conn_close(c);
}

/* ---- timers ------------------------------------------------------------------------------- */

static void on_timer(uv_timer_t *t)
{
    conn *c = t->data;
    enum timer_kind k = c->timer_kind;
    c->timer_kind = T_NONE;
    if (k == T_IDLE) {
        /* the last response may still be on its way to a slow reader: the idle time starts
         * once it has been written out (on_write re-arms) */
        if (c->write_pending == 0) conn_close(c);
    } else if (k == T_LINGER) {
        conn_close(c);
    } else if (k == T_HEADER || k == T_BODY) {
        PD_DEBUG(NULL, "http: %s timeout, closing connection", k == T_HEADER ? "header" : "body");
        conn_fail(c, 408, "Request timed out.", NULL, false);
    }
}

static void conn_arm(conn *c, enum timer_kind k)
{
    int ms = 0;
    const pd_http_params *p = &c->srv->p;
    switch (k) {
    case T_HEADER: ms = p->header_timeout_ms; break;
    case T_BODY: ms = p->body_timeout_ms; break;
    case T_IDLE: ms = p->idle_timeout_ms; break;
    case T_LINGER: ms = LINGER_MS; break;
    case T_NONE: break;
    }
    c->timer_kind = k;
    if (k == T_NONE || ms <= 0)
        uv_timer_stop(&c->timer);
    else
        uv_timer_start(&c->timer, on_timer, (uint64_t)ms, 0);
}

/* ---- connection lifetime ----------------------------------------------------------------- */

static void server_handle_closed(pd_http_server *s)
{
    if (--s->handles_open == 0 && s->stopping) {
        void (*cb)(void *) = s->on_stopped;
        void *arg = s->stopped_arg;
        free(s);
        if (cb) cb(arg);
    }
}

static void on_conn_handle_closed(uv_handle_t *h)
{
    conn *c = h->data;
    if (--c->handles_open > 0) return;
    pd_http_server *s = c->srv;
    free(c->in);
    parse_free(&c->ps);
    free(c);
    server_handle_closed(s);
}

static void conn_close(conn *c)
{
    if (c->closing) return;
    c->closing = true;
    pd_http_server *s = c->srv;
    if (c->prev)
        c->prev->next = c->next;
    else
        s->conns = c->next;
    if (c->next) c->next->prev = c->prev;
    s->n_conns--;
    parse_release(&c->ps); /* a body still arriving stops counting now */
    pd_http_exchange *ex = c->ex;
    if (ex) { /* the client left before its response ended */
        c->ex = NULL;
        ex->c = NULL;
        ex->aborted = true;
        if (ex->abort_cb) {
            void (*cb)(void *) = ex->abort_cb;
            ex->abort_cb = NULL;
            cb(ex->abort_arg);
        }
    }
    uv_timer_stop(&c->timer);
    uv_close((uv_handle_t *)&c->timer, on_conn_handle_closed);
    uv_close((uv_handle_t *)&c->tcp, on_conn_handle_closed);
}

/* ---- parsing ------------------------------------------------------------------------------ */

static int grow(char **buf, size_t *cap, size_t need)
{
    if (need <= *cap) return 0;
    size_t n = *cap ? *cap : 256;
    while (n < need) n *= 2;
    char *p = realloc(*buf, n);
    if (!p) return -1;
    *buf = p;
    *cap = n;
    return 0;
}

static int scratch_append(http_parse *ps, const char *at, size_t len)
{
    ps->header_bytes += len;
    if (ps->header_bytes > ps->lim->max_header_bytes) {
        ps->err_status = 431;
        return -1;
    }
    if (grow(&ps->scratch, &ps->scratch_cap, ps->scratch_len + len + 1) < 0) return -1;
    memcpy(ps->scratch + ps->scratch_len, at, len);
    ps->scratch_len += len;
    return 0;
}

static void exchange_free(pd_http_exchange *ex);

/* Gives back the body bytes this request reserved from the owner (it is complete, refused, or
 * its connection is gone). */
static void parse_release(http_parse *ps)
{
    if (ps->announced == 0) return;
    ps->hooks->release(ps->owner, ps->announced);
    ps->announced = 0;
}

/* Drops the request being parsed (an error ended it, or its connection). */
static void parse_abandon(http_parse *ps)
{
    parse_release(ps);
    if (ps->ex) exchange_free(ps->ex);
    ps->ex = NULL;
    ps->body_len = 0;
}

static int on_message_begin(llhttp_t *p)
{
    http_parse *ps = p->data;
    parse_abandon(ps); /* nothing is left of the previous request; this keeps it so */
    ps->answered = false;
    ps->scratch_len = 0;
    ps->url_len = 0;
    ps->n_hdrs = 0;
    ps->last_was_value = false;
    ps->header_bytes = 0;
    ps->body_len = 0;
    ps->err_status = 0;
    ps->in_message = true;
    ps->in_trailers = false;
    ps->hooks->begin(ps->owner);
    return 0;
}

static int on_url(llhttp_t *p, const char *at, size_t len)
{
    http_parse *ps = p->data;
    if (scratch_append(ps, at, len) < 0) return -1;
    ps->url_len += len;
    return 0;
}

/* Trailer fields (after a chunked body) count towards max_header_bytes but are not kept: no
 * handler reads them, and the request's headers must not change after its body. */
static int skip_trailer(http_parse *ps, size_t len)
{
    ps->header_bytes += len;
    if (ps->header_bytes > ps->lim->max_header_bytes) {
        ps->err_status = 431;
        return -1;
    }
    return 0;
}

static int on_header_field(llhttp_t *p, const char *at, size_t len)
{
    http_parse *ps = p->data;
    /* RFC 9112 §5.1: no whitespace between a field name and its colon (llhttp takes "Name :"
     * for a name with a blank in it) */
    if (memchr(at, ' ', len) || memchr(at, '\t', len)) {
        ps->err_status = 400;
        return -1;
    }
    if (ps->in_trailers) return skip_trailer(ps, len);
    if (ps->n_hdrs == 0 || ps->last_was_value) {
        /* a new header: NUL-end the url (first header) or the previous value */
        if (scratch_append(ps, "", 1) < 0) return -1;
        if (ps->n_hdrs == ps->hdrs_cap) {
            size_t cap = ps->hdrs_cap ? ps->hdrs_cap * 2 : 16;
            hdr_ref *h = realloc(ps->hdrs, cap * sizeof *h);
            if (!h) return -1;
            ps->hdrs = h;
            ps->hdrs_cap = cap;
        }
        ps->hdrs[ps->n_hdrs].name = ps->scratch_len;
        ps->hdrs[ps->n_hdrs].value = (size_t)-1;
        ps->n_hdrs++;
        ps->last_was_value = false;
    }
    return scratch_append(ps, at, len);
}

static int on_header_value(llhttp_t *p, const char *at, size_t len)
{
    http_parse *ps = p->data;
    if (ps->in_trailers) return skip_trailer(ps, len);
    if (ps->n_hdrs == 0) return -1;
    hdr_ref *h = &ps->hdrs[ps->n_hdrs - 1];
    if (!ps->last_was_value) {
        if (scratch_append(ps, "", 1) < 0) return -1; /* end of the name */
        h->value = ps->scratch_len;
        ps->last_was_value = true;
    }
    return scratch_append(ps, at, len);
}

static const char *scratch_header(const http_parse *ps, const char *name)
{
    for (size_t i = 0; i < ps->n_hdrs; i++)
        if (ps->hdrs[i].value != (size_t)-1 &&
            strcasecmp(ps->scratch + ps->hdrs[i].name, name) == 0)
            return ps->scratch + ps->hdrs[i].value;
    return NULL;
}

static pd_http_exchange *exchange_build(const http_parse *ps);

/* RFC 9112 §2.3, §3.2: HTTP/1.0 or 1.1 only (llhttp takes a request line without a version for
 * HTTP/0.9, and any "HTTP/d.d"), with at most one Host, and one in HTTP/1.1. */
static bool protocol_ok(const http_parse *ps)
{
    const llhttp_t *p = &ps->llp;
    if (p->http_major != 1 || p->http_minor > 1) return false;
    int hosts = 0;
    for (size_t i = 0; i < ps->n_hdrs; i++)
        if (strcasecmp(ps->scratch + ps->hdrs[i].name, "host") == 0) hosts++;
    return hosts == 1 || (hosts == 0 && p->http_minor == 0);
}

/* Announces n more body bytes: reserved from the owner, or the request is refused (503). */
static int announce(http_parse *ps, uint64_t n)
{
    if (n == 0) return 0;
    if (!ps->hooks->reserve(ps->owner, (size_t)n)) {
        ps->err_status = 503;
        return -1;
    }
    ps->announced += (size_t)n;
    return 0;
}

static int on_headers_complete(llhttp_t *p)
{
    http_parse *ps = p->data;
    /* NUL-terminate the url (no headers) or the last value */
    if (scratch_append(ps, "", 1) < 0) return -1;
    if (ps->n_hdrs > 0 && !ps->last_was_value) { /* a name without a value */
        ps->hdrs[ps->n_hdrs - 1].value = ps->scratch_len - 1;
    }
    if (!protocol_ok(ps)) {
        ps->err_status = 400;
        return -1;
    }
    ps->ex = exchange_build(ps);
    if (!ps->ex) {
        ps->err_status = 500;
        return -1;
    }
    /* the owner's checks come first (docs/api.md §2: route, method and key before the size) */
    bool chunked = p->flags & F_CHUNKED;
    bool body_pending = chunked || ((p->flags & F_CONTENT_LENGTH) && p->content_length > 0);
    if (ps->hooks->headers(ps->owner, ps->ex, body_pending) != 0) {
        ps->answered = true;
        return body_pending ? -1 : 0; /* stop: the owner has answered and closes */
    }
    if ((p->flags & F_CONTENT_LENGTH) && p->content_length > ps->lim->max_body_bytes) {
        ps->err_status = 413;
        return -1;
    }
    if (!chunked && announce(ps, p->content_length) < 0) return -1;
    ps->in_trailers = true; /* any field from now on is a trailer */
    const char *expect = scratch_header(ps, "expect");
    ps->hooks->body_start(ps->owner, expect && strcasecmp(expect, "100-continue") == 0);
    return 0;
}

/* A chunk's size line: the body's growth is known before its bytes come (content_length holds
 * the chunk's size here), so a body that would pass the limit gets its 413 at once. */
static int on_chunk_header(llhttp_t *p)
{
    http_parse *ps = p->data;
    if (p->content_length > ps->lim->max_body_bytes - ps->announced) {
        ps->err_status = 413;
        return -1;
    }
    return announce(ps, p->content_length);
}

/* Body bytes: never more than announced (llhttp delivers at most the announced lengths). */
static int on_body(llhttp_t *p, const char *at, size_t len)
{
    http_parse *ps = p->data;
    size_t need = ps->body_len + len + 1;
    if (need > ps->body_cap) {
        /* a Content-Length body is allocated once, at its size; a chunked one grows */
        char *b = p->flags & F_CHUNKED ? NULL : realloc(ps->body, ps->announced + 1);
        if (b) {
            ps->body = b;
            ps->body_cap = ps->announced + 1;
        } else if (!(p->flags & F_CHUNKED) || grow(&ps->body, &ps->body_cap, need) < 0) {
            ps->err_status = 500;
            return -1;
        }
    }
    memcpy(ps->body + ps->body_len, at, len);
    ps->body_len += len;
    return 0;
}

static void exchange_free(pd_http_exchange *ex)
{
    free(ex->body_buf);
    pd_arena_free(ex->arena);
    free(ex);
}

/* The request target's path and query. Origin-form "/p?q" as it is; absolute-form
 * "scheme://authority/p?q", which a server must accept (RFC 9112 §3.2.2), by its path ("/" when
 * it has none), so that it is routed like the origin form. */
static void split_target(const char *url, size_t len, const char **path, size_t *plen,
                         const char **query, size_t *qlen)
{
    size_t start = 0, i = 0;
    while (i < len && (isalnum((unsigned char)url[i]) || strchr("+-.", url[i])) &&
           (i > 0 || isalpha((unsigned char)url[i])))
        i++;
    if (i > 0 && len - i >= 3 && memcmp(url + i, "://", 3) == 0) {
        start = i + 3;
        while (start < len && url[start] != '/' && url[start] != '?') start++;
    }
    const char *q = memchr(url + start, '?', len - start);
    size_t end = q ? (size_t)(q - url) : len;
    *path = start < end ? url + start : "/";
    *plen = start < end ? end - start : 1;
    *query = q ? q + 1 : "";
    *qlen = q ? len - end - 1 : 0;
}

/* The request's line and headers as an exchange, everything copied into its arena; the body is
 * attached when the message completes. NULL when out of memory. ex->c is left NULL for the
 * owner to set. */
static pd_http_exchange *exchange_build(const http_parse *ps)
{
    pd_http_exchange *ex = calloc(1, sizeof *ex);
    pd_arena *a = pd_arena_create(4096);
    if (!ex || !a) {
        free(ex);
        pd_arena_free(a);
        return NULL;
    }
    ex->arena = a;
    ex->keep_alive = llhttp_should_keep_alive(&ps->llp);
    ex->max_stream_buffer = ps->lim->max_stream_buffer;
    ex->method = (char *)llhttp_method_name((llhttp_method_t)ps->llp.method);
    const char *path, *query;
    size_t plen, qlen;
    split_target(ps->scratch, ps->url_len, &path, &plen, &query, &qlen);
    ex->path = pd_arena_strndup(a, path, plen);
    ex->query = pd_arena_strndup(a, query, qlen);
    ex->n_headers = ps->n_hdrs;
    ex->hnames = pd_arena_calloc(a, ps->n_hdrs + 1, sizeof(char *));
    ex->hvalues = pd_arena_calloc(a, ps->n_hdrs + 1, sizeof(char *));
    ex->body = "";
    if (!ex->path || !ex->query || !ex->hnames || !ex->hvalues) {
        exchange_free(ex);
        return NULL;
    }
    for (size_t i = 0; i < ps->n_hdrs; i++) {
        ex->hnames[i] = pd_arena_strdup(a, ps->scratch + ps->hdrs[i].name);
        ex->hvalues[i] = pd_arena_strdup(a, ps->scratch + ps->hdrs[i].value);
        if (!ex->hnames[i] || !ex->hvalues[i]) {
            exchange_free(ex);
            return NULL;
        }
    }
    return ex;
}

static int on_message_complete(llhttp_t *p)
{
    http_parse *ps = p->data;
    ps->in_message = false;
    pd_http_exchange *ex = ps->ex;
    ps->ex = NULL;
    parse_release(ps); /* the body now belongs to the request */
    if (ps->answered) {
        exchange_free(ex);
    } else {
        if (ps->body_len > 0) { /* the buffer goes with the request (cap > body_len) */
            ps->body[ps->body_len] = '\0';
            ex->body = ex->body_buf = ps->body;
            ex->body_len = ps->body_len;
            ps->body = NULL;
            ps->body_cap = ps->body_len = 0;
        }
        ps->hooks->request(ps->owner, ex);
    }
    return HPE_PAUSED;
}

static llhttp_settings_t g_settings;
static pthread_once_t g_settings_once = PTHREAD_ONCE_INIT;

static void settings_init(void)
{
    llhttp_settings_init(&g_settings);
    g_settings.on_message_begin = on_message_begin;
    g_settings.on_url = on_url;
    g_settings.on_header_field = on_header_field;
    g_settings.on_header_value = on_header_value;
    g_settings.on_headers_complete = on_headers_complete;
    g_settings.on_chunk_header = on_chunk_header;
    g_settings.on_body = on_body;
    g_settings.on_message_complete = on_message_complete;
}

static void parse_init(http_parse *ps, const pd_http_params *lim, const parse_hooks *hooks,
                       void *owner)
{
    pthread_once(&g_settings_once, settings_init);
    memset(ps, 0, sizeof *ps);
    llhttp_init(&ps->llp, HTTP_REQUEST, &g_settings);
    ps->llp.data = ps;
    ps->lim = lim;
    ps->hooks = hooks;
    ps->owner = owner;
}

static void parse_free(http_parse *ps)
{
    parse_abandon(ps);
    free(ps->scratch);
    free(ps->hdrs);
    free(ps->body);
}

typedef enum { FEED_MORE, FEED_REQUEST, FEED_ERROR } feed_result;

/* Runs the parser over in[0, len). FEED_MORE: every byte consumed, a request may be under way.
 * FEED_REQUEST: a request completed and went to the owner after *used bytes; the parser stays
 * paused until llhttp_resume. FEED_ERROR: the bytes break HTTP or a limit (parse_error). */
static feed_result parse_feed(http_parse *ps, const char *in, size_t len, size_t *used)
{
    llhttp_errno_t err = llhttp_execute(&ps->llp, in, len);
    if (err == HPE_OK) {
        *used = len;
        return FEED_MORE;
    }
    if (err == HPE_PAUSED) {
        *used = (size_t)(llhttp_get_error_pos(&ps->llp) - in);
        return FEED_REQUEST;
    }
    *used = len;
    return FEED_ERROR;
}

/* After FEED_ERROR: the status to answer, its message and header lines (extra, n bytes). */
static int parse_error(const http_parse *ps, char *msg, size_t n, char *extra, size_t extra_n)
{
    int status = ps->err_status ? ps->err_status : 400;
    extra[0] = '\0';
    switch (status) {
    case 413: snprintf(msg, n, "Request body exceeds %zu bytes.", ps->lim->max_body_bytes); break;
    case 431: snprintf(msg, n, "Request headers too large."); break;
    case 500: snprintf(msg, n, "out of memory"); break;
    case 503:
        snprintf(msg, n,
                 "The server is at its limit of %zu request body bytes in flight; retry later.",
                 ps->lim->max_body_in_flight);
        snprintf(extra, extra_n, "Retry-After: 1\r\n");
        break;
    default: snprintf(msg, n, "Malformed HTTP request."); break;
    }
    return status;
}

/* ---- a connection as the parser's owner ---------------------------------------------------- */

static void conn_on_begin(void *owner)
{
    conn_arm(owner, T_HEADER);
}

/* The owner's checks on the request line and headers; a refusal is answered here. */
static int conn_on_headers(void *owner, const pd_http_exchange *ex, bool body_pending)
{
    conn *c = owner;
    pd_http_server *s = c->srv;
    char msg[160] = "", extra[256] = "";
    int status =
        s->on_headers ? s->on_headers(s->ctx, ex, msg, sizeof msg, extra, sizeof extra) : 0;
    if (status == 0) return 0;
    PD_DEBUG(NULL, "http: %d from the headers: %s", status, msg);
    if (body_pending) { /* its body is not read: the connection cannot carry another request */
        conn_fail(c, status, msg, extra, true);
    } else {
        bool close = !ex->keep_alive;
        if (close) {
            c->close_after_write = true;
            if (c->reading) {
                uv_read_stop((uv_stream_t *)&c->tcp);
                c->reading = false;
            }
        }
        if (conn_answer(c, status, msg, extra, close) == PD_OK && close && c->write_pending == 0)
            conn_finish(c);
    }
    return status;
}

static void conn_on_body_start(void *owner, bool continue_100)
{
    conn *c = owner;
    if (continue_100) {
        static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
        conn_write(c, cont, sizeof cont - 1);
    }
    conn_arm(c, T_BODY);
}

static bool conn_reserve(void *owner, size_t n)
{
    pd_http_server *s = ((conn *)owner)->srv;
    if (s->p.max_body_in_flight && n > s->p.max_body_in_flight - s->body_in_flight) return false;
    s->body_in_flight += n;
    return true;
}

static void conn_release(void *owner, size_t n)
{
    ((conn *)owner)->srv->body_in_flight -= n;
}

static void conn_on_request(void *owner, pd_http_exchange *ex)
{
    conn *c = owner;
    conn_arm(c, T_NONE);
    ex->c = c;
    c->ex = ex;
    c->srv->handler(c->srv->ctx, ex);
}

static const parse_hooks g_conn_hooks = {conn_on_begin, conn_on_headers, conn_on_body_start,
                                         conn_reserve,  conn_release,    conn_on_request};

/* Frees the input buffer between requests when nothing is pending in it. Inside a request (a
 * body arriving) or a lingering close it is kept for the next read: one buffer per connection,
 * not one per read (an allocation per read would also fill ASan's quarantine). */
static void conn_input_trim(conn *c)
{
    if (c->in_len > 0 || c->ps.in_message || c->lingering) return;
    free(c->in);
    c->in = NULL;
    c->in_cap = 0;
}

/* Feeds buffered input to the parser while no exchange is in flight. */
static void conn_process(conn *c)
{
    while (!c->closing && !c->close_after_write && !c->ex && c->in_len > 0) {
        size_t used = 0;
        c->in_execute = true;
        feed_result fr = parse_feed(&c->ps, c->in, c->in_len, &used);
        c->in_execute = false;
        if (c->closing) return;
        if (fr == FEED_MORE) {
            c->in_len = 0;
        } else if (fr == FEED_REQUEST) {
            memmove(c->in, c->in + used, c->in_len - used);
            c->in_len -= used;
            if (!c->ex) llhttp_resume(&c->ps.llp); /* answered synchronously, or refused */
        } else if (c->close_after_write) {         /* refused from its headers: answered already */
            parse_abandon(&c->ps);
            c->in_len = 0;
            return;
        } else {
            char msg[160], extra[256];
            int status = parse_error(&c->ps, msg, sizeof msg, extra, sizeof extra);
            const pd_http_exchange *hx = c->ps.ex; /* the headers were complete */
            if (hx && (status == 413 || status == 503) && c->srv->on_refused)
                c->srv->on_refused(c->srv->ctx, hx, status, msg, extra, sizeof extra);
            PD_DEBUG(NULL, "http: %d: %s (%s)", status, msg,
                     llhttp_errno_name(llhttp_get_errno(&c->ps.llp)));
            parse_abandon(&c->ps);
            c->in_len = 0;
            conn_fail(c, status, msg, extra, hx != NULL); /* a body may be arriving */
            return;
        }
    }
    if (c->closing || c->close_after_write) return;
    if (!c->ex) {
        /* the client sent EOF: what it sent in full has been answered; a partial request
         * never completes */
        if (c->peer_eof) {
            c->close_after_write = true;
            if (c->write_pending == 0) conn_close(c);
            return;
        }
        /* between requests: the idle timeout runs (inside one, the header/body timeout does) */
        if (!c->ps.in_message && c->timer_kind != T_IDLE) conn_arm(c, T_IDLE);
    }
    /* read on: at most max_header_bytes ahead of an exchange in flight (on_read) */
    if (!c->reading && !c->peer_eof && (!c->ex || c->in_len < c->srv->p.max_header_bytes)) {
        c->reading = true;
        conn_read_start(c);
    }
    conn_input_trim(c);
}

/* ---- the parser over a buffer -------------------------------------------------------------- */

typedef struct {
    pd_http_parse_result *res;
    pd_http_exchange *ex; /* the request just completed */
} buf_owner;

static void buf_on_begin(void *owner)
{
    (void)owner;
}

static int buf_on_headers(void *owner, const pd_http_exchange *ex, bool body_pending)
{
    (void)owner;
    (void)ex;
    (void)body_pending;
    return 0;
}

static void buf_on_body_start(void *owner, bool continue_100)
{
    buf_owner *b = owner;
    if (continue_100) b->res->n_continue++;
}

static bool buf_reserve(void *owner, size_t n)
{
    (void)owner;
    (void)n;
    return true;
}

static void buf_release(void *owner, size_t n)
{
    (void)owner;
    (void)n;
}

static void buf_on_request(void *owner, pd_http_exchange *ex)
{
    buf_owner *b = owner;
    b->ex = ex;
}

static const parse_hooks g_buf_hooks = {buf_on_begin, buf_on_headers, buf_on_body_start,
                                        buf_reserve,  buf_release,    buf_on_request};

int pd_http_parse_buffer(const pd_http_params *params, const char *buf, size_t len, size_t piece,
                         void (*on_request)(void *arg, pd_http_exchange *ex), void *arg,
                         pd_http_parse_result *out)
{
    memset(out, 0, sizeof *out);
    buf_owner b = {.res = out};
    http_parse ps;
    parse_init(&ps, params, &g_buf_hooks, &b);
    int rc = PD_OK;
    size_t off = 0;
    while (off < len) {
        /* one read's worth; what a read leaves unparsed goes first into the next execute in
         * the server, which for llhttp (a streaming parser) is the same as continuing here */
        size_t end = piece && len - off > piece ? off + piece : len;
        while (off < end) {
            size_t used = 0;
            feed_result fr = parse_feed(&ps, buf + off, end - off, &used);
            off += used;
            if (fr == FEED_ERROR) {
                if (ps.err_status == 500) {
                    rc = pd_error(PD_ENOMEM, "http: out of memory for a request");
                    goto done;
                }
                char extra[64];
                out->error_status = parse_error(&ps, out->error_message, sizeof out->error_message,
                                                extra, sizeof extra);
                goto done;
            }
            if (fr == FEED_REQUEST) {
                pd_http_exchange *ex = b.ex;
                b.ex = NULL;
                out->n_requests++;
                bool keep = ex->keep_alive;
                if (on_request) on_request(arg, ex);
                exchange_free(ex);
                if (!keep) goto done; /* the server answers, then closes: the rest is unread */
                llhttp_resume(&ps.llp);
            }
        }
    }
    out->partial = ps.in_message;
done:
    out->consumed = off;
    parse_free(&ps);
    return rc;
}

/* A connection reads into its input buffer, which holds only what is not parsed yet (bytes that
 * arrived while an exchange was in flight: at most max_header_bytes + READ_BYTES); between
 * requests an empty one is freed (conn_input_trim), so idle keep-alive connections hold none. */
static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    conn *c = h->data;
    (void)suggested;
    if (grow(&c->in, &c->in_cap, c->in_len + READ_BYTES) < 0) {
        buf->base = NULL;
        buf->len = 0;
        return;
    }
    buf->base = c->in + c->in_len;
    buf->len = c->in_cap - c->in_len;
}

static void on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf)
{
    conn *c = stream->data;
    (void)buf;
    if (c->lingering) { /* refused: what still comes is dropped until the client closes */
        c->in_len = 0;
        if (nread == UV_EOF) {
            /* the client has sent all: close once the answer is out (conn_finish) */
            c->peer_eof = true;
            c->reading = false;
            if (c->write_pending == 0) conn_close(c);
        } else if (nread < 0) {
            conn_close(c);
        }
        return;
    }
    if (nread == UV_EOF) {
        /* the client will send nothing more; it may still read (a half-close, RFC 9112 §9.6),
         * and TCP cannot tell that from a close until a write fails: an exchange in flight goes
         * on (a failed write aborts it), what was received is answered, then the connection
         * closes (conn_process). libuv has stopped reading. Once a stream has started, EOF is a
         * client that left (none half-closes in the middle of reading an answer): it is
         * aborted at once, as a reset is. */
        if (c->ex && c->ex->streaming) {
            conn_close(c);
            return;
        }
        c->peer_eof = true;
        c->reading = false;
        conn_input_trim(c);
        if (!c->ex) conn_process(c);
        return;
    }
    if (nread < 0) { /* reset or error: a pending exchange is aborted */
        conn_close(c);
        return;
    }
    c->in_len += (size_t)nread;
    if (c->ex) {
        /* an exchange is in flight: reading goes on so that a reset is seen at once, but only
         * max_header_bytes ahead (the next pipelined request waits in the kernel) */
        if (c->in_len >= c->srv->p.max_header_bytes) {
            uv_read_stop(stream);
            c->reading = false;
        }
        conn_input_trim(c);
        return;
    }
    conn_process(c);
}

static void conn_read_start(conn *c)
{
    uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
}

static void on_connection(uv_stream_t *server, int status)
{
    pd_http_server *s = server->data;
    if (status < 0 || s->stopping) return;
    conn *c = calloc(1, sizeof *c);
    if (!c) return;
    c->srv = s;
    uv_tcp_init(s->loop, &c->tcp);
    uv_timer_init(s->loop, &c->timer);
    c->tcp.data = c->timer.data = c;
    c->handles_open = 2;
    s->handles_open++;
    c->next = s->conns;
    if (s->conns) s->conns->prev = c;
    s->conns = c;
    s->n_conns++;
    if (uv_accept(server, (uv_stream_t *)&c->tcp) < 0 || s->n_conns > s->p.max_connections) {
        conn_close(c);
        return;
    }
    uv_tcp_nodelay(&c->tcp, 1);
    parse_init(&c->ps, &s->p, &g_conn_hooks, c);
    c->reading = true;
    conn_read_start(c);
    conn_arm(c, T_HEADER); /* a connection that never sends a request is a slowloris too */
}

/* ---- exchange API --------------------------------------------------------------------------- */

static void exchange_end(pd_http_exchange *ex)
{
    conn *c = ex->c;
    bool keep = ex->keep_alive;
    exchange_free(ex);
    if (!c) return;
    c->ex = NULL;
    if (!keep) {
        c->close_after_write = true;
        if (c->reading) {
            uv_read_stop((uv_stream_t *)&c->tcp);
            c->reading = false;
        }
        if (c->write_pending == 0) conn_close(c);
        return;
    }
    llhttp_resume(&c->ps.llp);
    if (!c->in_execute) conn_process(c);
}

const char *pd_http_method(const pd_http_exchange *ex)
{
    return ex->method;
}
const char *pd_http_path(const pd_http_exchange *ex)
{
    return ex->path;
}
const char *pd_http_query(const pd_http_exchange *ex)
{
    return ex->query;
}
const char *pd_http_header(const pd_http_exchange *ex, const char *name)
{
    for (size_t i = 0; i < ex->n_headers; i++)
        if (strcasecmp(ex->hnames[i], name) == 0) return ex->hvalues[i];
    return NULL;
}
const char *pd_http_body(const pd_http_exchange *ex, size_t *len)
{
    if (len) *len = ex->body_len;
    return ex->body;
}
char *pd_http_body_take(pd_http_exchange *ex, size_t *len)
{
    char *b = ex->body_buf;
    *len = b ? ex->body_len : 0;
    ex->body_buf = NULL;
    ex->body = "";
    ex->body_len = 0;
    return b;
}

pd_arena *pd_http_arena(pd_http_exchange *ex)
{
    return ex->arena;
}
void pd_http_set_user(pd_http_exchange *ex, void *user)
{
    ex->user = user;
}
void *pd_http_user(const pd_http_exchange *ex)
{
    return ex->user;
}
int pd_http_aborted(const pd_http_exchange *ex)
{
    return ex->aborted;
}
void pd_http_on_abort(pd_http_exchange *ex, void (*cb)(void *), void *arg)
{
    ex->abort_cb = cb;
    ex->abort_arg = arg;
}
void pd_http_on_drain(pd_http_exchange *ex, void (*cb)(void *), void *arg)
{
    ex->drain_cb = cb;
    ex->drain_arg = arg;
}
size_t pd_http_stream_pending(const pd_http_exchange *ex)
{
    return ex->c ? ex->c->write_pending : 0;
}

int pd_http_respond(pd_http_exchange *ex, int status, const char *content_type, const char *body,
                    size_t len, const char *extra_headers)
{
    conn *c = ex->c;
    int rc = PD_OK;
    if (!c || ex->streaming) {
        rc = c ? pd_error(PD_EINVAL, "http: respond after stream_begin")
               : pd_error(PD_ECLOSED, "http: client disconnected");
    } else {
        char head[1024];
        size_t hl = format_head(head, sizeof head, status, content_type, (long long)len, false,
                                !ex->keep_alive, extra_headers);
        if (hl == 0) {
            rc = pd_error(PD_EINVAL, "http: response headers too long");
        } else {
            const void *parts[2] = {head, body};
            size_t lens[2] = {hl, len};
            rc = conn_writev(c, parts, lens, body ? 2 : 1);
        }
    }
    exchange_end(ex);
    return rc;
}

int pd_http_respond_error(pd_http_exchange *ex, int status, const char *message,
                          const char *extra_headers)
{
    json_t *j = json_pack("{s:{s:s, s:s, s:n, s:i}}", "error", "message", message, "type",
                          pd_http_error_type(status), "param", "code", status);
    char *body = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    int rc = pd_http_respond(ex, status, "application/json", body ? body : "",
                             body ? strlen(body) : 0, extra_headers);
    free(body);
    return rc;
}

int pd_http_stream_begin(pd_http_exchange *ex, int status, const char *content_type,
                         const char *extra_headers)
{
    if (!ex->c) return pd_error(PD_ECLOSED, "http: client disconnected");
    if (ex->streaming) return pd_error(PD_EINVAL, "http: stream already started");
    char head[1024];
    size_t hl = format_head(head, sizeof head, status, content_type, 0, true, !ex->keep_alive,
                            extra_headers);
    if (hl == 0) return pd_error(PD_EINVAL, "http: response headers too long");
    ex->streaming = true;
    return conn_write(ex->c, head, hl);
}

int pd_http_stream_write(pd_http_exchange *ex, const void *data, size_t len)
{
    conn *c = ex->c;
    if (!c) return pd_error(PD_ECLOSED, "http: client disconnected");
    if (!ex->streaming) return pd_error(PD_EINVAL, "http: stream_write before stream_begin");
    if (len == 0) return PD_OK; /* a zero-length chunk would end the body */
    if (c->write_pending + len > ex->max_stream_buffer && c->write_pending > 0) return PD_EBUSY;
    char size[32];
    int sl = snprintf(size, sizeof size, "%zx\r\n", len);
    const void *parts[3] = {size, data, "\r\n"};
    size_t lens[3] = {(size_t)sl, len, 2};
    return conn_writev(c, parts, lens, 3);
}

int pd_http_stream_end(pd_http_exchange *ex)
{
    int rc = PD_OK;
    if (!ex->c)
        rc = pd_error(PD_ECLOSED, "http: client disconnected");
    else if (ex->streaming)
        rc = conn_write(ex->c, "0\r\n\r\n", 5);
    else
        rc = pd_error(PD_EINVAL, "http: stream_end without stream_begin");
    exchange_end(ex);
    return rc;
}

/* ---- server ------------------------------------------------------------------------------- */

int pd_http_server_start(uv_loop_t *loop, const pd_http_params *params, pd_http_handler handler,
                         void *ctx, pd_http_server **out)
{
    pd_http_server *s = calloc(1, sizeof *s);
    if (!s) return pd_error(PD_ENOMEM, "http: out of memory");
    s->loop = loop;
    s->p = *params;
    s->handler = handler;
    s->ctx = ctx;
    struct sockaddr_storage addr;
    int rc = uv_ip4_addr(params->host, params->port, (struct sockaddr_in *)&addr);
    if (rc < 0) rc = uv_ip6_addr(params->host, params->port, (struct sockaddr_in6 *)&addr);
    if (rc < 0) {
        free(s);
        return pd_error(PD_EINVAL, "--host '%s': not an IPv4 or IPv6 address", params->host);
    }
    uv_tcp_init(loop, &s->listener);
    s->listener.data = s;
    s->handles_open = 1;
    rc = uv_tcp_bind(&s->listener, (const struct sockaddr *)&addr, 0);
    if (rc == 0) rc = uv_listen((uv_stream_t *)&s->listener, 1024, on_connection);
    if (rc < 0) {
        int e = pd_error(PD_EIO, "cannot listen on %s:%d: %s", params->host, params->port,
                         uv_strerror(rc));
        s->stopping = true;
        uv_close((uv_handle_t *)&s->listener, NULL);
        uv_run(loop, UV_RUN_NOWAIT); /* let the close callback run before freeing */
        free(s);
        return e;
    }
    *out = s;
    return PD_OK;
}

void pd_http_server_on_headers(pd_http_server *s, pd_http_headers_fn fn)
{
    s->on_headers = fn;
}

void pd_http_server_on_refused(pd_http_server *s, pd_http_refused_fn fn)
{
    s->on_refused = fn;
}

size_t pd_http_server_body_bytes_in_flight(const pd_http_server *s)
{
    return s->body_in_flight;
}

int pd_http_server_port(const pd_http_server *s)
{
    struct sockaddr_storage addr;
    int len = sizeof addr;
    if (uv_tcp_getsockname(&s->listener, (struct sockaddr *)&addr, &len) < 0) return -1;
    if (addr.ss_family == AF_INET6) return ntohs(((struct sockaddr_in6 *)&addr)->sin6_port);
    return ntohs(((struct sockaddr_in *)&addr)->sin_port);
}

int pd_http_server_connections(const pd_http_server *s)
{
    return s->n_conns;
}

static void on_listener_closed(uv_handle_t *h)
{
    server_handle_closed(h->data);
}

void pd_http_server_stop(pd_http_server *s, void (*on_stopped)(void *), void *arg)
{
    if (s->stopping) return;
    s->stopping = true;
    s->on_stopped = on_stopped;
    s->stopped_arg = arg;
    while (s->conns) conn_close(s->conns);
    uv_close((uv_handle_t *)&s->listener, on_listener_closed);
}
