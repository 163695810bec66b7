/* Unit tests of the HTTP/1.1 server: a real server on a loopback port, its loop on a thread,
 * driven by raw blocking sockets from the test thread. */
#include "harness.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include "http/http_server.h"
#include "util/clock.h"

/* ---- the server under test ----------------------------------------------------------------- */

typedef struct {
    uv_loop_t loop;
    uv_async_t stop_async;
    pd_http_server *srv;
    pthread_t thread;
    int port;
    atomic_int aborts;
    atomic_int stopped;
    atomic_size_t max_pending; /* largest unsent byte count seen by /flood */
    atomic_int busy;           /* PD_EBUSY answers seen by /flood */
    atomic_int handled;        /* requests handed to the handler */
} fixture;

typedef struct {
    uv_timer_t timer;
    pd_http_exchange *ex;
    int left;
    fixture *fx;
} job;

static void job_closed(uv_handle_t *h)
{
    free(h->data);
}

static void slow_reply(uv_timer_t *t)
{
    job *j = t->data;
    pd_http_respond(j->ex, 200, "text/plain", "slow", 4, NULL);
    uv_close((uv_handle_t *)&j->timer, job_closed);
}

static void stream_tick(uv_timer_t *t)
{
    job *j = t->data;
    char line[64];
    if (pd_http_aborted(j->ex)) {
        pd_http_stream_end(j->ex);
        uv_close((uv_handle_t *)&j->timer, job_closed);
        return;
    }
    if (j->left == 0) {
        pd_http_stream_write(j->ex, "data: [DONE]\n\n", 14);
        pd_http_stream_end(j->ex);
        uv_close((uv_handle_t *)&j->timer, job_closed);
        return;
    }
    int n = snprintf(line, sizeof line, "data: {\"i\":%d}\n\n", 3 - j->left);
    pd_http_stream_write(j->ex, line, (size_t)n);
    j->left--;
}

static void hang_aborted(void *arg)
{
    job *j = arg;
    atomic_fetch_add(&j->fx->aborts, 1);
    pd_http_respond(j->ex, 200, NULL, NULL, 0, NULL); /* must still end the exchange */
    free(j);
}

static void flood(void *arg);

static void flood_closed(void *arg)
{
    job *j = arg;
    atomic_fetch_add(&j->fx->aborts, 1);
    pd_http_stream_end(j->ex);
    free(j);
}

/* Writes 4 KiB chunks until the connection refuses, then waits for the drain callback. */
static void flood(void *arg)
{
    job *j = arg;
    static char chunk[4096];
    memset(chunk, 'x', sizeof chunk);
    while (j->left > 0) {
        int rc = pd_http_stream_write(j->ex, chunk, sizeof chunk);
        size_t pending = pd_http_stream_pending(j->ex);
        if (pending > atomic_load(&j->fx->max_pending)) atomic_store(&j->fx->max_pending, pending);
        if (rc == PD_EBUSY) {
            atomic_fetch_add(&j->fx->busy, 1);
            pd_http_on_drain(j->ex, flood, j);
            return;
        }
        if (rc < 0) return; /* closed: the abort callback ends it */
        j->left--;
    }
    pd_http_on_abort(j->ex, NULL, NULL);
    pd_http_stream_end(j->ex);
    free(j);
}

static void ticks_aborted(void *arg)
{
    job *j = arg;
    atomic_fetch_add(&j->fx->aborts, 1); /* the timer sees pd_http_aborted and ends it */
}

/* The owner's checks from the headers: /secret needs "X-Key: k" (as an API key). */
static int on_headers(void *ctx, const pd_http_exchange *ex, char *message, size_t msg_cap,
                      char *extra, size_t extra_cap)
{
    (void)ctx;
    const char *key = pd_http_header(ex, "X-Key");
    if (strcmp(pd_http_path(ex), "/secret") != 0 || (key && strcmp(key, "k") == 0)) return 0;
    snprintf(message, msg_cap, "Unauthorized");
    snprintf(extra, extra_cap, "WWW-Authenticate: Bearer\r\n");
    return 401;
}

static void on_refused(void *ctx, const pd_http_exchange *ex, int status, const char *message,
                       char *extra, size_t extra_cap)
{
    (void)ctx;
    (void)message;
    size_t used = strlen(extra);
    snprintf(extra + used, extra_cap - used, "X-Refused: %d %s\r\n", status, pd_http_path(ex));
}

static void handler(void *ctx, pd_http_exchange *ex)
{
    fixture *fx = ctx;
    const char *path = pd_http_path(ex);
    atomic_fetch_add(&fx->handled, 1);
    if (strcmp(path, "/hello") == 0 || strcmp(path, "/secret") == 0) {
        pd_http_respond(ex, 200, "text/plain", "hi", 2, "X-Test: 1\r\n");
    } else if (strcmp(path, "/echo") == 0) {
        size_t len;
        const char *body = pd_http_body(ex, &len);
        char *reply = pd_arena_sprintf(
            pd_http_arena(ex), "%s %s q=%s len=%zu ct=%s body=%.*s", pd_http_method(ex), path,
            pd_http_query(ex), len,
            pd_http_header(ex, "content-type") ? pd_http_header(ex, "Content-TYPE") : "-", (int)len,
            body);
        pd_http_respond(ex, 200, "text/plain", reply, strlen(reply), NULL);
    } else if (strcmp(path, "/slow") == 0 || strcmp(path, "/stream") == 0) {
        job *j = calloc(1, sizeof *j);
        j->ex = ex;
        j->left = 3;
        j->fx = fx;
        uv_timer_init(&fx->loop, &j->timer);
        j->timer.data = j;
        if (path[1] == 's' && path[2] == 'l') {
            uv_timer_start(&j->timer, slow_reply, 50, 0);
        } else {
            pd_http_stream_begin(ex, 200, "text/event-stream; charset=utf-8", NULL);
            uv_timer_start(&j->timer, stream_tick, 5, 5);
        }
    } else if (strcmp(path, "/ticks") == 0) { /* a chunk every 10 ms for 3 s */
        job *j = calloc(1, sizeof *j);
        j->ex = ex;
        j->left = 300;
        j->fx = fx;
        uv_timer_init(&fx->loop, &j->timer);
        j->timer.data = j;
        pd_http_on_abort(ex, ticks_aborted, j);
        pd_http_stream_begin(ex, 200, "text/event-stream; charset=utf-8", NULL);
        uv_timer_start(&j->timer, stream_tick, 10, 10);
    } else if (strcmp(path, "/hang") == 0) {
        job *j = calloc(1, sizeof *j);
        j->ex = ex;
        j->fx = fx;
        pd_http_on_abort(ex, hang_aborted, j);
    } else if (strcmp(path, "/flood") == 0) {
        job *j = calloc(1, sizeof *j);
        j->ex = ex;
        j->fx = fx;
        j->left = 1024; /* 4 MiB in all */
        pd_http_on_abort(ex, flood_closed, j);
        pd_http_stream_begin(ex, 200, "application/octet-stream", NULL);
        flood(j);
    } else {
        pd_http_respond_error(ex, 404, "Not Found", NULL);
    }
}

static void on_stopped(void *arg)
{
    fixture *fx = arg;
    atomic_store(&fx->stopped, 1);
    uv_close((uv_handle_t *)&fx->stop_async, NULL);
}

static void on_stop_async(uv_async_t *a)
{
    fixture *fx = a->data;
    pd_http_server_stop(fx->srv, on_stopped, fx);
}

static void *loop_main(void *arg)
{
    fixture *fx = arg;
    uv_run(&fx->loop, UV_RUN_DEFAULT);
    return NULL;
}

/* in_flight: max_body_in_flight (0: the default). */
static fixture *fx_start_bounded(int header_timeout_ms, int idle_timeout_ms, size_t in_flight)
{
    signal(SIGPIPE, SIG_IGN); /* as pd-scheduler: writes to a gone client fail instead */
    fixture *fx = calloc(1, sizeof *fx);
    uv_loop_init(&fx->loop);
    uv_async_init(&fx->loop, &fx->stop_async, on_stop_async);
    fx->stop_async.data = fx;
    pd_http_params p = pd_http_default_params();
    p.max_body_bytes = 1000;
    p.max_header_bytes = 2048;
    p.header_timeout_ms = header_timeout_ms;
    p.body_timeout_ms = header_timeout_ms;
    p.idle_timeout_ms = idle_timeout_ms;
    p.max_stream_buffer = 64 * 1024;
    if (in_flight) p.max_body_in_flight = in_flight;
    if (pd_http_server_start(&fx->loop, &p, handler, fx, &fx->srv) < 0) {
        printf("    server start: %s\n", pd_last_error());
        return NULL;
    }
    pd_http_server_on_headers(fx->srv, on_headers);
    pd_http_server_on_refused(fx->srv, on_refused);
    fx->port = pd_http_server_port(fx->srv);
    pthread_create(&fx->thread, NULL, loop_main, fx);
    return fx;
}

static fixture *fx_start(int header_timeout_ms, int idle_timeout_ms)
{
    return fx_start_bounded(header_timeout_ms, idle_timeout_ms, 0);
}

static int fx_stop(fixture *fx)
{
    uv_async_send(&fx->stop_async);
    pthread_join(fx->thread, NULL);
    int ok = atomic_load(&fx->stopped) && uv_loop_close(&fx->loop) == 0;
    free(fx);
    return ok;
}

/* ---- a tiny blocking client ---------------------------------------------------------------- */

/* rcvbuf > 0 shrinks the receive buffer before connecting (so the window is negotiated small). */
static int cli_connect_rcvbuf(int port, int rcvbuf)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (rcvbuf > 0) setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static int cli_connect(int port)
{
    return cli_connect_rcvbuf(port, 0);
}

static void cli_send(int fd, const char *s)
{
    size_t n = strlen(s), off = 0;
    while (off < n) {
        ssize_t w = write(fd, s + off, n - off);
        if (w <= 0) return;
        off += (size_t)w;
    }
}

/* Reads until `want` appears in the accumulated data, EOF, or timeout_ms. Returns bytes read;
 * *eof tells whether the peer closed. */
static size_t cli_read_until(int fd, char *buf, size_t cap, const char *want, int timeout_ms,
                             int *eof)
{
    size_t len = 0;
    int64_t deadline = pd_now_ns() + (int64_t)timeout_ms * PD_NS_PER_MS;
    *eof = 0;
    buf[0] = '\0';
    while (len + 1 < cap) {
        if (want && strstr(buf, want)) break;
        int left = (int)((deadline - pd_now_ns()) / PD_NS_PER_MS);
        if (left <= 0) break;
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        if (poll(&pfd, 1, left) <= 0) break;
        ssize_t r = read(fd, buf + len, cap - 1 - len);
        if (r <= 0) {
            *eof = 1;
            break;
        }
        len += (size_t)r;
        buf[len] = '\0';
    }
    return len;
}

static int count(const char *hay, const char *needle)
{
    int n = 0;
    for (const char *p = strstr(hay, needle); p; p = strstr(p + 1, needle)) n++;
    return n;
}

/* ---- tests --------------------------------------------------------------------------------- */

TEST(http_keep_alive_two_requests)
{
    fixture *fx = fx_start(2000, 2000);
    ASSERT(fx);
    int fd = cli_connect(fx->port), eof;
    char buf[4096];
    cli_send(fd, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
    cli_read_until(fd, buf, sizeof buf, "hi", 2000, &eof);
    ASSERT_CONTAINS(buf, "HTTP/1.1 200 OK\r\n");
    ASSERT_CONTAINS(buf, "Content-Length: 2\r\n");
    ASSERT_CONTAINS(buf, "X-Test: 1\r\n");
    cli_send(fd, "GET /nope HTTP/1.1\r\nHost: x\r\n\r\n");
    cli_read_until(fd, buf, sizeof buf, "}}", 2000, &eof);
    ASSERT_CONTAINS(buf, "HTTP/1.1 404 Not Found");
    ASSERT_CONTAINS(buf, "{\"error\":{\"message\":\"Not Found\",\"type\":\"NotFoundError\","
                         "\"param\":null,\"code\":404}}");
    ASSERT(!eof);
    close(fd);
    ASSERT(fx_stop(fx));
}

TEST(http_pipelined_answers_in_order)
{
    fixture *fx = fx_start(2000, 2000);
    int fd = cli_connect(fx->port), eof;
    char buf[8192];
    /* the middle request answers after 50 ms: the third must still come last */
    cli_send(fd, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\nGET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
                 "POST /echo?a=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc");
    cli_read_until(fd, buf, sizeof buf, "body=abc", 3000, &eof);
    const char *hi = strstr(buf, "\r\n\r\nhi"), *slow = strstr(buf, "slow"),
               *echo = strstr(buf, "POST /echo q=a=1 len=3");
    ASSERT(hi && slow && echo);
    ASSERT(hi < slow && slow < echo);
    close(fd);
    ASSERT(fx_stop(fx));
}

TEST(http_chunked_request_body)
{
    fixture *fx = fx_start(2000, 2000);
    int fd = cli_connect(fx->port), eof;
    char buf[4096];
    cli_send(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                 "Content-Type: application/json\r\n\r\n4\r\n{\"a\"\r\n3\r\n:1}\r\n0\r\n\r\n");
    cli_read_until(fd, buf, sizeof buf, "body=", 2000, &eof);
    cli_read_until(fd, buf + strlen(buf), sizeof buf - strlen(buf), "}", 500, &eof);
    ASSERT_CONTAINS(buf, "len=7 ct=application/json body={\"a\":1}");
    close(fd);
    ASSERT(fx_stop(fx));
}

TEST(http_expect_100_continue)
{
    fixture *fx = fx_start(2000, 2000);
    int fd = cli_connect(fx->port), eof;
    char buf[4096];
    cli_send(fd,
             "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n");
    cli_read_until(fd, buf, sizeof buf, "\r\n\r\n", 2000, &eof);
    ASSERT_STR_EQ(buf, "HTTP/1.1 100 Continue\r\n\r\n");
    cli_send(fd, "ok");
    cli_read_until(fd, buf, sizeof buf, "body=ok", 2000, &eof);
    ASSERT_CONTAINS(buf, "HTTP/1.1 200 OK");
    /* over the limit: 413 at once, no 100 */
    cli_send(
        fd,
        "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n");
    cli_read_until(fd, buf, sizeof buf, "}}", 2000, &eof);
    ASSERT_CONTAINS(buf, "HTTP/1.1 413 Payload Too Large");
    ASSERT(strstr(buf, "100 Continue") == NULL);
    close(fd);
    ASSERT(fx_stop(fx));
}

TEST(http_body_too_large_413_and_close)
{
    fixture *fx = fx_start(2000, 2000);
    int fd = cli_connect(fx->port), eof;
    char buf[4096];
    cli_send(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1001\r\n\r\n");
    cli_read_until(fd, buf, sizeof buf, "NEVER", 2000, &eof);
    ASSERT_CONTAINS(buf, "HTTP/1.1 413 Payload Too Large\r\n");
    ASSERT_CONTAINS(buf, "Connection: close");
    ASSERT_CONTAINS(buf, "\"message\":\"Request body exceeds 1000 bytes.\",\"type\":"
                         "\"PayloadTooLargeError\"");
    ASSERT(eof);
    close(fd);
    /* chunked body that grows past the limit */
    fd = cli_connect(fx->port);
    char big[601];
    memset(big, 'a', 600);
    big[600] = '\0';
    char req[4096];
    snprintf(req, sizeof req,
             "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
             "258\r\n%s\r\n258\r\n%s\r\n0\r\n\r\n",
             big, big);
    cli_send(fd, req);
    cli_read_until(fd, buf, sizeof buf, "NEVER", 2000, &eof);
    ASSERT_CONTAINS(buf, "HTTP/1.1 413");
    ASSERT(eof);
    close(fd);
    ASSERT(fx_stop(fx));
}

TEST(http_headers_too_large_431)
{
    fixture *fx = fx_start(2000, 2000);
    int fd = cli_connect(fx->port), eof;
    char buf[4096], req[4096];
    char val[3000];
    memset(val, 'v', sizeof val - 1);
    val[sizeof val - 1] = '\0';
    snprintf(req, sizeof req, "GET /hello HTTP/1.1\r\nHost: x\r\nX-Big: %s\r\n\r\n", val);
    cli_send(fd, req);
    cli_read_until(fd, buf, sizeof buf, "NEVER", 2000, &eof);
    ASSERT_CONTAINS(buf, "HTTP/1.1 431 Request Header Fields Too Large");
    ASSERT_CONTAINS(buf, "\"type\":\"RequestHeaderFieldsTooLargeError\"");
    ASSERT(eof);
    close(fd);
    ASSERT(fx_stop(fx));
}

TEST(http_malformed_400_and_close)
{
    fixture *fx = fx_start(2000, 2000);
    int fd = cli_connect(fx->port), eof;
    char buf[4096];
    cli_send(fd, "THIS IS NOT HTTP\r\n\r\n");
    cli_read_until(fd, buf, sizeof buf, "NEVER", 2000, &eof);
    ASSERT_CONTAINS(buf, "HTTP/1.1 400 Bad Request");
    ASSERT_CONTAINS(buf, "\"type\":\"BadRequestError\"");
    ASSERT(eof);
    close(fd);
    /* the server still serves */
    fd = cli_connect(fx->port);
    cli_send(fd, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
    cli_read_until(fd, buf, sizeof buf, "hi", 2000, &eof);
    ASSERT_CONTAINS(buf, "200 OK");
    close(fd);
    ASSERT(fx_stop(fx));
}

TEST(http_partial_request_times_out_408)
{
    fixture *fx = fx_start(200, 5000);
    int fd = cli_connect(fx->port), eof;
    char buf[4096];
    cli_send(fd, "GET /hello HTTP/1.1\r\nHost: x"); /* never finishes its headers */
    int64_t t0 = pd_now_ns();
    cli_read_until(fd, buf, sizeof buf, "NEVER", 3000, &eof);
    int64_t ms = (pd_now_ns() - t0) / PD_NS_PER_MS;
    ASSERT_CONTAINS(buf, "HTTP/1.1 408 Request Timeout");
    ASSERT(eof);
    ASSERT(ms < 2000);
    close(fd);
    ASSERT(fx_stop(fx));
}

TEST(http_idle_connection_closed)
{
    fixture *fx = fx_start(2000, 150);
    int fd = cli_connect(fx->port), eof;
    char buf[4096];
    cli_send(fd, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
    cli_read_until(fd, buf, sizeof buf, "hi", 2000, &eof);
    ASSERT_CONTAINS(buf, "200 OK");
    cli_read_until(fd, buf, sizeof buf, "NEVER", 2000, &eof);
    ASSERT(eof);
    ASSERT_EQ_INT(strlen(buf), 0); /* closed without a response */
    close(fd);
    ASSERT(fx_stop(fx));
}

TEST(http_connection_close_honoured)
{
    fixture *fx = fx_start(2000, 2000);
    int fd = cli_connect(fx->port), eof;
    char buf[4096];
    cli_send(fd, "GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    cli_read_until(fd, buf, sizeof buf, "NEVER", 2000, &eof);
    ASSERT_CONTAINS(buf, "Connection: close\r\n");
    ASSERT_CONTAINS(buf, "\r\n\r\nhi");
    ASSERT(eof);
    close(fd);
    /* HTTP/1.0 without keep-alive closes too */
    fd = cli_connect(fx->port);
    cli_send(fd, "GET /hello HTTP/1.0\r\n\r\n");
    cli_read_until(fd, buf, sizeof buf, "NEVER", 2000, &eof);
    ASSERT_CONTAINS(buf, "200 OK");
    ASSERT(eof);
    close(fd);
    ASSERT(fx_stop(fx));
}

TEST(http_sse_stream_chunks)
{
    fixture *fx = fx_start(2000, 2000);
    int fd = cli_connect(fx->port), eof;
    char buf[4096];
    cli_send(fd, "GET /stream HTTP/1.1\r\nHost: x\r\n\r\n");
    cli_read_until(fd, buf, sizeof buf, "0\r\n\r\n", 3000, &eof);
    ASSERT_CONTAINS(buf, "Content-Type: text/event-stream; charset=utf-8\r\n");
    ASSERT_CONTAINS(buf, "Transfer-Encoding: chunked\r\n");
    ASSERT_CONTAINS(buf, "\r\nf\r\ndata: {\"i\":0}\n\n\r\n");
    ASSERT_CONTAINS(buf, "data: {\"i\":2}\n\n");
    ASSERT_CONTAINS(buf, "e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n");
    ASSERT_EQ_INT(count(buf, "data: "), 4);
    /* keep-alive after a stream */
    cli_send(fd, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
    cli_read_until(fd, buf, sizeof buf, "hi", 2000, &eof);
    ASSERT_CONTAINS(buf, "200 OK");
    close(fd);
    ASSERT(fx_stop(fx));
}

/* A connection reset while the handler works (a client that closed with unread bytes, or a
 * proxy that gave up) aborts the exchange at once. */
TEST(http_client_disconnect_aborts_exchange)
{
    fixture *fx = fx_start(2000, 2000);
    int fd = cli_connect(fx->port);
    cli_send(fd, "GET /hang HTTP/1.1\r\nHost: x\r\n\r\n");
    pd_sleep_ns(50 * PD_NS_PER_MS);
    ASSERT_EQ_INT(atomic_load(&fx->aborts), 0);
    struct linger lg = {.l_onoff = 1, .l_linger = 0}; /* close() sends a reset */
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
    close(fd);
    for (int i = 0; i < 200 && atomic_load(&fx->aborts) == 0; i++) pd_sleep_ns(5 * PD_NS_PER_MS);
    ASSERT_EQ_INT(atomic_load(&fx->aborts), 1);
    ASSERT(fx_stop(fx));
}

/* A client that closes during a stream (EOF, then a reset for the next bytes) aborts the
 * exchange at the first write that fails. */
TEST(http_closed_client_aborts_stream)
{
    fixture *fx = fx_start(2000, 2000);
    int fd = cli_connect(fx->port), eof;
    char buf[4096];
    cli_send(fd, "GET /ticks HTTP/1.1\r\nHost: x\r\n\r\n");
    cli_read_until(fd, buf, sizeof buf, "data: ", 2000, &eof);
    ASSERT_CONTAINS(buf, "200 OK");
    int64_t t0 = pd_now_ns();
    close(fd);
    for (int i = 0; i < 200 && atomic_load(&fx->aborts) == 0; i++) pd_sleep_ns(5 * PD_NS_PER_MS);
    ASSERT_EQ_INT(atomic_load(&fx->aborts), 1);
    ASSERT((pd_now_ns() - t0) / PD_NS_PER_MS < 500); /* a few ticks, not the 3 s of the stream */
    ASSERT(fx_stop(fx));
}

/* A client that shuts down its sending side after complete requests (RFC 9112 §9.6) gets its
 * answers, then the connection closes; nothing is aborted. It used to get no response: EOF was
 * taken for a client gone. */
TEST(http_half_close_still_answered)
{
    fixture *fx = fx_start(2000, 2000);
    int fd = cli_connect(fx->port), eof;
    char buf[4096];
    cli_send(fd, "GET /slow HTTP/1.1\r\nHost: x\r\n\r\n");
    shutdown(fd, SHUT_WR);
    cli_read_until(fd, buf, sizeof buf, "NEVER", 2000, &eof);
    ASSERT_CONTAINS(buf, "HTTP/1.1 200 OK");
    ASSERT_CONTAINS(buf, "\r\n\r\nslow");
    ASSERT(eof);
    close(fd);
    /* pipelined, the first answered later than the second arrived */
    fd = cli_connect(fx->port);
    cli_send(fd, "GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET /hello HTTP/1.1\r\nHost: x\r\n\r\n");
    shutdown(fd, SHUT_WR);
    cli_read_until(fd, buf, sizeof buf, "NEVER", 2000, &eof);
    ASSERT_EQ_INT(count(buf, "HTTP/1.1 200 OK"), 2);
    ASSERT(strstr(buf, "slow") < strstr(buf, "\r\n\r\nhi"));
    ASSERT(eof);
    close(fd);
    /* a partial request is never completed: closed without an answer */
    fd = cli_connect(fx->port);
    cli_send(fd, "GET /hello HTTP/1.1\r\nHost: x\r\n");
    shutdown(fd, SHUT_WR);
    cli_read_until(fd, buf, sizeof buf, "NEVER", 2000, &eof);
    ASSERT_EQ_INT(strlen(buf), 0);
    ASSERT(eof);
    close(fd);
    ASSERT_EQ_INT(atomic_load(&fx->aborts), 0);
    ASSERT(fx_stop(fx));
}

/* The owner's headers hook answers before the body is read: a request it refuses never reaches
 * the handler and none of its body is buffered (an unauthenticated client could otherwise make
 * the server hold max_body_bytes per connection). With a body still to come, the answer closes
 * the connection, after a lingering close: the client may send the rest and then reads EOF (not
 * a reset). Without a body, the connection stays open. */
TEST(http_headers_hook_refuses_before_the_body)
{
    fixture *fx = fx_start(2000, 2000);
    int fd = cli_connect(fx->port), eof;
    char buf[4096];
    int64_t t0 = pd_now_ns();
    cli_send(fd, "POST /secret HTTP/1.1\r\nHost: x\r\nContent-Length: 900\r\n\r\n0123456789");
    cli_read_until(fd, buf, sizeof buf, "}}", 2000, &eof);
    ASSERT((pd_now_ns() - t0) / PD_NS_PER_MS < 1000); /* at once, not at the body timeout */
    ASSERT_CONTAINS(buf, "HTTP/1.1 401 Unauthorized\r\n");
    ASSERT_CONTAINS(buf, "WWW-Authenticate: Bearer\r\n");
    ASSERT_CONTAINS(buf, "Connection: close\r\n");
    ASSERT_CONTAINS(buf, "\"type\":\"AuthenticationError\"");
    ASSERT_EQ_INT(pd_http_server_body_bytes_in_flight(fx->srv), 0);
    static char rest[890];
    memset(rest, 'r', sizeof rest);
    ASSERT_EQ_INT(write(fd, rest, sizeof rest), (int)sizeof rest);
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    ASSERT_EQ_INT(poll(&pfd, 1, 3000), 1);
    ASSERT_EQ_INT(read(fd, buf, sizeof buf), 0); /* EOF, not ECONNRESET */
    close(fd);
    /* the key lets it through; a refusal without a body keeps the connection */
    fd = cli_connect(fx->port);
    cli_send(fd, "GET /secret HTTP/1.1\r\nHost: x\r\n\r\n");
    cli_read_until(fd, buf, sizeof buf, "}}", 2000, &eof);
    ASSERT_CONTAINS(buf, "HTTP/1.1 401 Unauthorized\r\n");
    ASSERT(strstr(buf, "Connection: close") == NULL);
    cli_send(fd, "POST /secret HTTP/1.1\r\nHost: x\r\nX-Key: k\r\nContent-Length: 2\r\n\r\nab");
    cli_read_until(fd, buf, sizeof buf, "hi", 2000, &eof);
    ASSERT_CONTAINS(buf, "HTTP/1.1 200 OK");
    ASSERT(!eof);
    close(fd);
    ASSERT_EQ_INT(atomic_load(&fx->handled), 1);
    ASSERT(fx_stop(fx));
}

/* The server's body bytes in flight once they are want, or after 1 s. */
static size_t in_flight_becomes(fixture *fx, size_t want)
{
    for (int i = 0; i < 200 && pd_http_server_body_bytes_in_flight(fx->srv) != want; i++)
        pd_sleep_ns(5 * PD_NS_PER_MS);
    return pd_http_server_body_bytes_in_flight(fx->srv);
}

/* Bodies announced by requests still arriving count against max_body_in_flight over all
 * connections; a request that would pass it gets 503 with Retry-After at once (from its
 * headers, or from the chunk size line), and bytes count no more once a request completes or
 * its connection goes. */
TEST(http_body_bytes_in_flight_bounded)
{
    fixture *fx = fx_start_bounded(2000, 2000, 2000);
    int a = cli_connect(fx->port), b = cli_connect(fx->port), eof;
    char buf[4096];
    static const char held[] = "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nab";
    cli_send(a, held);
    cli_send(b, held);
    ASSERT_EQ_INT(in_flight_becomes(fx, 2000), 2000);
    int c = cli_connect(fx->port);
    cli_send(c, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n");
    cli_read_until(c, buf, sizeof buf, "}}", 2000, &eof);
    ASSERT_CONTAINS(buf, "HTTP/1.1 503 Service Unavailable\r\n");
    ASSERT_CONTAINS(buf, "Retry-After: 1\r\n");
    ASSERT_CONTAINS(buf, "X-Refused: 503 /echo\r\n");
    ASSERT_CONTAINS(buf, "\"message\":\"The server is at its limit of 2000 request body bytes "
                         "in flight; retry later.\",\"type\":\"ServiceUnavailableError\"");
    close(c);
    /* a completes: its 1000 bytes are its request's now */
    static char rest[998];
    memset(rest, 'x', sizeof rest);
    ASSERT_EQ_INT(write(a, rest, sizeof rest), (int)sizeof rest);
    cli_read_until(a, buf, sizeof buf, "body=", 2000, &eof);
    ASSERT_CONTAINS(buf, "len=1000");
    ASSERT_EQ_INT(pd_http_server_body_bytes_in_flight(fx->srv), 1000);
    /* a chunked body counts chunk by chunk: with 1500 held, a chunk of 500 fits, the next chunk's
     * size line does not (its body, 501 bytes, is within max_body_bytes) */
    int d = cli_connect(fx->port);
    cli_send(d, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n");
    cli_send(a, "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1f4\r\n");
    ASSERT_EQ_INT(in_flight_becomes(fx, 2000), 2000);
    char chunk[600];
    memset(chunk, 'y', 500);
    memcpy(chunk + 500, "\r\n1\r\n", 5);
    ASSERT_EQ_INT(write(a, chunk, 505), 505);
    cli_read_until(a, buf, sizeof buf, "}}", 2000, &eof);
    ASSERT_CONTAINS(buf, "HTTP/1.1 503 Service Unavailable\r\n");
    close(a);
    close(d);
    close(b); /* b's body never came: its bytes go with its connection */
    ASSERT_EQ_INT(in_flight_becomes(fx, 0), 0);
    ASSERT(fx_stop(fx));
}

/* A chunk size line that takes the body past max_body_bytes gets 413 at once, not 408 when the
 * body timeout runs out (the chunk's bytes never come). */
TEST(http_chunk_over_limit_413_at_once)
{
    fixture *fx = fx_start(2000, 2000);
    int fd = cli_connect(fx->port), eof;
    char buf[4096];
    int64_t t0 = pd_now_ns();
    cli_send(fd, "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n7d0\r\n");
    cli_read_until(fd, buf, sizeof buf, "}}", 3000, &eof);
    ASSERT_CONTAINS(buf, "HTTP/1.1 413 Payload Too Large\r\n");
    ASSERT_CONTAINS(buf, "X-Refused: 413 /echo\r\n");
    ASSERT((pd_now_ns() - t0) / PD_NS_PER_MS < 1000);
    close(fd);
    ASSERT_EQ_INT(atomic_load(&fx->handled), 0);
    ASSERT(fx_stop(fx));
}

TEST(http_backpressure_bounds_unsent_bytes)
{
    fixture *fx = fx_start(2000, 2000);
    int fd = cli_connect_rcvbuf(fx->port, 16384), eof;
    cli_send(fd, "GET /flood HTTP/1.1\r\nHost: x\r\n\r\n");
    pd_sleep_ns(200 * PD_NS_PER_MS); /* the client reads nothing: the server must hold back */
    ASSERT(atomic_load(&fx->max_pending) <= 64 * 1024);
    /* now read everything: 1024 chunks of 4096 bytes */
    size_t total = 0;
    static char buf[1 << 16];
    int64_t deadline = pd_now_ns() + 10 * PD_NS_PER_S;
    while (pd_now_ns() < deadline) {
        size_t n = cli_read_until(fd, buf, sizeof buf, "0\r\n\r\n", 3000, &eof);
        total += n;
        if (n >= 5 && memcmp(buf + n - 5, "0\r\n\r\n", 5) == 0) break;
        if (eof || n == 0) break;
    }
    ASSERT_MSG(total > 1024u * 4096u, "read %zu bytes, eof %d", total, eof);
    ASSERT(atomic_load(&fx->max_pending) <= 64 * 1024);
    ASSERT(atomic_load(&fx->busy) > 0); /* the limit was reached and waited out */
    ASSERT_EQ_INT(atomic_load(&fx->aborts), 0);
    close(fd);
    ASSERT(fx_stop(fx));
}

TEST(http_stop_with_open_connections)
{
    fixture *fx = fx_start(2000, 2000);
    int a = cli_connect(fx->port), b = cli_connect(fx->port);
    cli_send(b, "GET /hang HTTP/1.1\r\nHost: x\r\n\r\n");
    pd_sleep_ns(50 * PD_NS_PER_MS);
    ASSERT(fx_stop(fx)); /* the hung exchange is aborted and ended; every handle closed */
    close(a);
    close(b);
}

TEST(http_bind_error_names_address)
{
    uv_loop_t loop;
    uv_loop_init(&loop);
    pd_http_params p = pd_http_default_params();
    p.host = "not-an-address";
    pd_http_server *s = NULL;
    ASSERT_ERR(pd_http_server_start(&loop, &p, handler, NULL, &s), PD_EINVAL,
               "--host 'not-an-address'");
    ASSERT_EQ_INT(uv_loop_close(&loop), 0);
}

TEST(http_reason_and_types)
{
    ASSERT_STR_EQ(pd_http_reason(503), "Service Unavailable");
    ASSERT_STR_EQ(pd_http_error_type(401), "AuthenticationError");
    ASSERT_STR_EQ(pd_http_error_type(500), "InternalServerError");
    ASSERT_STR_EQ(pd_http_error_type(599), "InternalServerError");
}
