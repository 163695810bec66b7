/* HTTP/1.1 server on libuv + llhttp for pd-scheduler (and any process that serves HTTP).
 *
 * Design: one libuv loop thread owns every socket. A request is parsed completely (headers and
 * body, Content-Length or chunked, with `Expect: 100-continue` answered) into an exchange, then
 * handed to the handler on the loop thread. The handler answers at once or later (after work on
 * other threads came back through uv_async), with exactly one pd_http_respond() or a stream
 * (pd_http_stream_begin / _write / _end). Pipelined requests wait, parsed bytes buffered, until
 * the exchange ahead of them has ended, so responses go out in order. The owner's checks that
 * need no body (route, method, API key) run as soon as a request's headers are complete
 * (pd_http_server_on_headers), so a refused request's body is never buffered.
 *
 * A client that closes its sending side (EOF) after a complete request still gets the answer:
 * TCP cannot tell a half-close from a close until a write fails, so EOF never aborts an exchange;
 * a failed write or a connection reset does (the exchange's abort callback runs; the scheduler
 * turns it into an abort sent to P and D).
 *
 * Limits (each answered as the API contract says, then the connection is closed): body over
 * max_body_bytes -> 413 (straight away when Content-Length, a chunk size or 100-continue
 * announce it), request-body bytes buffered over all connections past max_body_in_flight ->
 * 503 with Retry-After (when the headers or a chunk size announce the bytes), headers over
 * max_header_bytes -> 431 (trailer fields after a chunked body count too; they are dropped,
 * never seen as headers), malformed HTTP -> 400 (also RFC 9112's: no Host or two in HTTP/1.1,
 * a version other than 1.0 and 1.1, whitespace between a field name and its colon), headers not
 * complete within header_timeout_ms or body not complete within body_timeout_ms -> 408
 * (slowloris), an idle keep-alive connection is closed after idle_timeout_ms. A refusal while
 * a body may still be arriving reads and drops what the client sends, for at most 2 s from the
 * refusal (a lingering close; the answer's write is bounded by the same 2 s), so that a client
 * still sending sees the answer rather than a reset. A stream never queues more than
 * max_stream_buffer unsent bytes: pd_http_stream_write refuses with PD_EBUSY and the drain callback
 * says when to continue (backpressure towards the token source).
 *
 * Memory: an exchange owns a request-scoped arena (pd_http_arena) and its body, freed in exactly
 * one place, when the exchange ends; every write copies its bytes and frees them in the write
 * callback. While an exchange is in flight a connection reads ahead at most max_header_bytes.
 */
#ifndef PD_HTTP_SERVER_H
#define PD_HTTP_SERVER_H

#include <stdbool.h>
#include <stddef.h>
#include <uv.h>

#include "util/arena.h"

typedef struct pd_http_server pd_http_server;
typedef struct pd_http_exchange pd_http_exchange;

typedef struct {
    const char *host;         /* bind address ("127.0.0.1"; "0.0.0.0" or "::" for all) */
    int port;                 /* 0 = ephemeral (tests); pd_http_server_port tells which */
    size_t max_body_bytes;    /* 16 MiB */
    size_t max_header_bytes;  /* 64 KiB: request line + header names and values */
    int header_timeout_ms;    /* 10000: from the first byte of a request to its last header */
    int body_timeout_ms;      /* 60000: from the end of the headers to the end of the body */
    int idle_timeout_ms;      /* 60000: keep-alive connection with no request in progress */
    size_t max_stream_buffer; /* 1 MiB of unsent response bytes per connection */
    int max_connections;      /* 65536: further connections are accepted and closed at once */
    /* 64 MiB: request-body bytes of requests still arriving, over all connections (a
     * Content-Length body counts in full from its headers on, a chunked one chunk by chunk from
     * each size line on, until the request is complete); 0 = no bound */
    size_t max_body_in_flight;
} pd_http_params;

pd_http_params pd_http_default_params(void);

/* Called on the loop thread once per complete request. The exchange stays valid until the
 * handler ends it (respond, or stream_end); it must always be ended, also after an abort. */
typedef void (*pd_http_handler)(void *ctx, pd_http_exchange *ex);

/* Binds, listens and starts accepting on loop. PD_EIO naming the address when it cannot bind.
 * The process must ignore SIGPIPE (pd-scheduler does): a write to a client that has gone would
 * otherwise end it instead of failing. */
int pd_http_server_start(uv_loop_t *loop, const pd_http_params *params, pd_http_handler handler,
                         void *ctx, pd_http_server **out);
int pd_http_server_port(const pd_http_server *s);
/* The owner's checks that need no body (an API's route, method and key), run when a request's
 * headers are complete, before any of its body is read: ex holds the request line and headers
 * (pd_http_body is empty), ctx is the handler's. Returns 0 to read on (the request reaches the
 * handler when complete), or the status to answer at once; message (msg_cap bytes, empty on
 * entry) is the error body's message and extra ("Name: value\r\n" lines, extra_cap bytes,
 * empty on entry) its header lines. A refused request never reaches the handler. When its body
 * is still to come, the answer carries Connection: close and the connection closes (after a
 * lingering close); else the connection is kept as after any answer. */
typedef int (*pd_http_headers_fn)(void *ctx, const pd_http_exchange *ex, char *message,
                                  size_t msg_cap, char *extra, size_t extra_cap);
void pd_http_server_on_headers(pd_http_server *s, pd_http_headers_fn fn);
/* Told when the server refuses, on its own, a request whose headers passed the owner's checks:
 * status 413 (body over max_body_bytes) or 503 (max_body_in_flight reached), with the error
 * body's message. The owner may append header lines to extra (extra_cap bytes in all; it holds
 * the server's own, such as Retry-After) and log. The connection closes. */
typedef void (*pd_http_refused_fn)(void *ctx, const pd_http_exchange *ex, int status,
                                   const char *message, char *extra, size_t extra_cap);
void pd_http_server_on_refused(pd_http_server *s, pd_http_refused_fn fn);
/* Open connections (for metrics and tests). */
int pd_http_server_connections(const pd_http_server *s);
/* Request-body bytes counted against max_body_in_flight now (tests). */
size_t pd_http_server_body_bytes_in_flight(const pd_http_server *s);
/* Stops listening and closes every connection (in-flight exchanges get their abort callback and
 * must still be ended by their handlers, which is allowed after stop). on_stopped runs on the
 * loop once every handle is closed; the server is freed then. */
void pd_http_server_stop(pd_http_server *s, void (*on_stopped)(void *arg), void *arg);

/* ---- the request ------------------------------------------------------------------------- */
const char *pd_http_method(const pd_http_exchange *ex); /* "GET", "POST", ... */
const char *pd_http_path(const pd_http_exchange *ex);   /* URL path, without the query */
const char *pd_http_query(const pd_http_exchange *ex);  /* after '?', or "" */
/* First value of a header (name compared case-insensitively), or NULL. */
const char *pd_http_header(const pd_http_exchange *ex, const char *name);
/* Body bytes (NUL-terminated for convenience; len excludes the NUL). */
const char *pd_http_body(const pd_http_exchange *ex, size_t *len);
/* Takes the body out of the exchange (which is left with an empty one): malloc'd and
 * NUL-terminated, *len bytes, the caller's to free; NULL when the body is empty. */
char *pd_http_body_take(pd_http_exchange *ex, size_t *len);
/* Request-scoped arena, freed when the exchange ends. */
pd_arena *pd_http_arena(pd_http_exchange *ex);
/* Opaque slot for the handler's per-request state. */
void pd_http_set_user(pd_http_exchange *ex, void *user);
void *pd_http_user(const pd_http_exchange *ex);
/* 1 once the client has gone (the abort callback has run or will run): a write failed or the
 * connection was reset. EOF alone is not a disconnect (a client may half-close). */
int pd_http_aborted(const pd_http_exchange *ex);
/* Runs once, on the loop thread, if the client disconnects before the exchange ends (as
 * pd_http_aborted says). */
void pd_http_on_abort(pd_http_exchange *ex, void (*cb)(void *arg), void *arg);

/* ---- responses (loop thread only) -------------------------------------------------------- */
/* extra_headers: NULL or complete lines "Name: value\r\n...". */
/* A complete response with Content-Length; ends the exchange. PD_ECLOSED if the client is gone
 * (the exchange still ends). */
int pd_http_respond(pd_http_exchange *ex, int status, const char *content_type, const char *body,
                    size_t len, const char *extra_headers);
/* The API contract's error body {"error":{"message","type","param":null,"code"}} with the type
 * named after the status (400 BadRequestError, ...); ends the exchange. */
int pd_http_respond_error(pd_http_exchange *ex, int status, const char *message,
                          const char *extra_headers);
/* Starts a chunked response (status line and headers go out now). */
int pd_http_stream_begin(pd_http_exchange *ex, int status, const char *content_type,
                         const char *extra_headers);
/* Sends one chunk. PD_EBUSY (nothing queued) when the connection already holds
 * max_stream_buffer unsent bytes: wait for the drain callback. PD_ECLOSED when the client is gone.
 */
int pd_http_stream_write(pd_http_exchange *ex, const void *data, size_t len);
/* Unsent bytes queued on the connection. */
size_t pd_http_stream_pending(const pd_http_exchange *ex);
/* Runs (once per registration) when unsent bytes fall to half of max_stream_buffer or below. */
void pd_http_on_drain(pd_http_exchange *ex, void (*cb)(void *arg), void *arg);
/* Ends the chunked response and the exchange. */
int pd_http_stream_end(pd_http_exchange *ex);

/* ---- the parser without a socket (tests, fuzzing) --------------------------------------- */

typedef struct {
    int n_requests;          /* complete requests handed to on_request */
    int n_continue;          /* "100 Continue" interim responses the server would have sent */
    int error_status;        /* 0, or what the server answers before closing: 400 malformed
                                (RFC 9112's Host, version and field-name rules included), 413
                                body over max_body_bytes, 431 headers over max_header_bytes */
    char error_message[160]; /* the message of that answer's error body */
    bool partial;            /* buf ends inside a request (the server waits for more, then 408) */
    size_t consumed;         /* bytes parsed; after a request without keep-alive the server
                                closes, so the bytes after it are never parsed */
} pd_http_parse_result;

/* Runs one connection's request parser (the code every connection runs, with params' limits)
 * over buf as if it had arrived on the socket in reads of piece bytes (0: one read). Each
 * complete request is handed to on_request (may be NULL) as an exchange to read with the
 * accessors above; it is freed when the callback returns, so it must not be responded to.
 * Stops at the first error or after a request that does not keep the connection alive, as the
 * server does. There is no owner here: no headers hook, and max_body_in_flight does not apply.
 * PD_OK with *out filled (a rejected request is not a failure), or PD_ENOMEM. */
int pd_http_parse_buffer(const pd_http_params *params, const char *buf, size_t len, size_t piece,
                         void (*on_request)(void *arg, pd_http_exchange *ex), void *arg,
                         pd_http_parse_result *out);

/* Reason phrase for a status code ("Not Found"); "Unknown" for others. */
const char *pd_http_reason(int status);
/* The contract's error type for a status ("NotFoundError"). */
const char *pd_http_error_type(int status);

#endif
