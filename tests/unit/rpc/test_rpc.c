/* Unit tests of the gRPC layer: a real server on a loopback port and the async/sync client. */
#include "harness.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include "rpc/rpc.h"
#include "util/clock.h"

static atomic_int g_cancels;

/* ---- server methods ---------------------------------------------------------------------- */

static void echo(void *ctx, pd_rpc_call *call, const uint8_t *req, size_t len)
{
    (void)ctx;
    pd_rpc_reply(call, req, len);
}

static void fail(void *ctx, pd_rpc_call *call, const uint8_t *req, size_t len)
{
    (void)ctx, (void)req, (void)len;
    pd_rpc_fail(call, PD_RPC_NOT_FOUND, "no such request");
}

typedef struct {
    pd_rpc_call *call;
    int n;
} count_job;

/* Streams n messages "0".."n-1" from another thread, as an engine would. */
static void *count_thread(void *arg)
{
    count_job *j = arg;
    for (int i = 0; i < j->n; i++) {
        char m[16];
        int len = snprintf(m, sizeof m, "%d", i);
        if (pd_rpc_stream_send(j->call, m, (size_t)len) < 0) break;
    }
    pd_rpc_stream_end(j->call, PD_RPC_OK, "");
    free(j);
    return NULL;
}

static void count(void *ctx, pd_rpc_call *call, const uint8_t *req, size_t len)
{
    (void)ctx, (void)len;
    count_job *j = malloc(sizeof *j);
    j->call = call;
    j->n = atoi((const char *)req);
    pthread_t t;
    pthread_create(&t, NULL, count_thread, j);
    pthread_detach(t);
}

static void hang_cancelled(void *arg, pd_rpc_call *call)
{
    (void)arg;
    atomic_fetch_add(&g_cancels, 1);
    pd_rpc_stream_end(call, PD_RPC_CANCELLED, "cancelled");
}

static void hang(void *ctx, pd_rpc_call *call, const uint8_t *req, size_t len)
{
    (void)ctx, (void)req, (void)len;
    pd_rpc_stream_send(call, "first", 5);
    pd_rpc_on_cancel(call, hang_cancelled, NULL);
}

static atomic_llong g_hang_deadline; /* the last Hang call's pd_rpc_deadline_ns */

static void hang_noting_deadline(void *ctx, pd_rpc_call *call, const uint8_t *req, size_t len)
{
    atomic_store(&g_hang_deadline, (long long)pd_rpc_deadline_ns(call));
    hang(ctx, call, req, len);
}

/* Replies from another thread and goes on using the call after the reply, as a handler that
 * defers its work does (node_defer_guided): the hold keeps the call valid until the release. */
static atomic_int g_later_done; /* 1: the call read back its method name after the reply */

static void *later_thread(void *arg)
{
    pd_rpc_call *call = arg;
    pd_rpc_reply(call, "later", 5);
    usleep(300 * 1000); /* the reply has gone and its batch ended: unheld, the call is freed */
    int same = strcmp(pd_rpc_method_name(call), "/t.T/Later") == 0 && !pd_rpc_cancelled(call);
    pd_rpc_call_release(call);
    atomic_store(&g_later_done, same ? 1 : -1);
    return NULL;
}

static void later(void *ctx, pd_rpc_call *call, const uint8_t *req, size_t len)
{
    (void)ctx, (void)req, (void)len;
    pd_rpc_call_hold(call);
    pthread_t t;
    pthread_create(&t, NULL, later_thread, call);
    pthread_detach(t);
}

static const pd_rpc_method methods[] = {
    {"/t.T/Echo", PD_RPC_UNARY, echo, NULL},
    {"/t.T/Fail", PD_RPC_UNARY, fail, NULL},
    {"/t.T/Count", PD_RPC_SERVER_STREAM, count, NULL},
    {"/t.T/Hang", PD_RPC_SERVER_STREAM, hang_noting_deadline, NULL},
    {"/t.T/Later", PD_RPC_UNARY, later, NULL},
};

typedef struct {
    pd_rpc_server *srv;
    pd_rpc_client *cl;
    pd_rpc_channel *ch;
} fixture;

static int fx_start(fixture *fx, size_t channel_max)
{
    memset(fx, 0, sizeof *fx);
    pd_rpc_server_params p = pd_rpc_server_default_params();
    if (pd_rpc_server_start(&p, methods, sizeof methods / sizeof *methods, &fx->srv) < 0) return -1;
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", pd_rpc_server_port(fx->srv));
    if (pd_rpc_client_create(&fx->cl) < 0) return -1;
    return pd_rpc_channel_create(fx->cl, target, channel_max, &fx->ch);
}

static void fx_stop(fixture *fx)
{
    pd_rpc_channel_free(fx->ch);
    pd_rpc_client_free(fx->cl);
    pd_rpc_server_stop(fx->srv, 1000);
}

/* ---- a stream collector ------------------------------------------------------------------- */

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n_msgs;
    char last[64];
    int in_order;
    int done, status;
    char details[128];
} collector;

static void col_init(collector *c)
{
    memset(c, 0, sizeof *c);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    c->in_order = 1;
}

static void col_msg(void *arg, const uint8_t *m, size_t len)
{
    collector *c = arg;
    pthread_mutex_lock(&c->mu);
    char want[16];
    snprintf(want, sizeof want, "%d", c->n_msgs);
    if (len != strlen(want) || memcmp(m, want, len) != 0) c->in_order = 0;
    snprintf(c->last, sizeof c->last, "%.*s", (int)len, (const char *)m);
    c->n_msgs++;
    pthread_mutex_unlock(&c->mu);
}

static void col_done(void *arg, int status, const char *details, const uint8_t *r, size_t len)
{
    collector *c = arg;
    (void)r, (void)len;
    pthread_mutex_lock(&c->mu);
    c->done++;
    c->status = status;
    snprintf(c->details, sizeof c->details, "%s", details);
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
}

static int col_wait(collector *c, int ms)
{
    int64_t deadline = pd_now_ns() + (int64_t)ms * PD_NS_PER_MS;
    pthread_mutex_lock(&c->mu);
    while (!c->done && pd_now_ns() < deadline) {
        pthread_mutex_unlock(&c->mu);
        pd_sleep_ns(PD_NS_PER_MS);
        pthread_mutex_lock(&c->mu);
    }
    int d = c->done;
    pthread_mutex_unlock(&c->mu);
    return d;
}

/* ---- tests -------------------------------------------------------------------------------- */

TEST(rpc_unary_echo)
{
    fixture fx;
    ASSERT_OK(fx_start(&fx, 0));
    uint8_t *resp = NULL;
    size_t len = 0;
    int st = -1;
    ASSERT_OK(pd_rpc_unary(fx.ch, "/t.T/Echo", "hello", 5, 2000, &resp, &len, &st));
    ASSERT_EQ_INT(st, PD_RPC_OK);
    ASSERT_EQ_INT(len, 5);
    ASSERT(memcmp(resp, "hello", 5) == 0);
    free(resp);
    fx_stop(&fx);
}

TEST(rpc_call_held_after_reply)
{
    fixture fx;
    ASSERT_OK(fx_start(&fx, 0));
    uint8_t *resp = NULL;
    size_t len = 0;
    int st = -1;
    atomic_store(&g_later_done, 0);
    ASSERT_OK(pd_rpc_unary(fx.ch, "/t.T/Later", "x", 1, 2000, &resp, &len, &st));
    ASSERT_EQ_INT(st, PD_RPC_OK);
    ASSERT(len == 5 && memcmp(resp, "later", 5) == 0);
    free(resp);
    for (int i = 0; i < 500 && !atomic_load(&g_later_done); i++) usleep(10 * 1000);
    ASSERT_EQ_INT(atomic_load(&g_later_done), 1); /* ASan: no use after free on that thread */
    fx_stop(&fx);
}

TEST(rpc_failure_status_and_unknown_method)
{
    fixture fx;
    ASSERT_OK(fx_start(&fx, 0));
    uint8_t *resp = NULL;
    int st = -1;
    ASSERT_ERR(pd_rpc_unary(fx.ch, "/t.T/Fail", "x", 1, 2000, &resp, NULL, &st), PD_EINTERNAL,
               "/t.T/Fail: NOT_FOUND: no such request");
    ASSERT_EQ_INT(st, PD_RPC_NOT_FOUND);
    ASSERT_ERR(pd_rpc_unary(fx.ch, "/t.T/Nope", "x", 1, 2000, &resp, NULL, &st), PD_EINTERNAL,
               "UNIMPLEMENTED");
    ASSERT_EQ_INT(st, PD_RPC_UNIMPLEMENTED);
    fx_stop(&fx);
}

TEST(rpc_stream_in_order_from_another_thread)
{
    fixture fx;
    ASSERT_OK(fx_start(&fx, 0));
    collector c;
    col_init(&c);
    ASSERT_OK(
        pd_rpc_stream_async(fx.ch, "/t.T/Count", "500", 3, 5000, col_msg, col_done, &c, NULL));
    ASSERT(col_wait(&c, 5000));
    ASSERT_EQ_INT(c.status, PD_RPC_OK);
    ASSERT_EQ_INT(c.n_msgs, 500);
    ASSERT(c.in_order);
    ASSERT_EQ_INT(c.done, 1);
    fx_stop(&fx);
}

TEST(rpc_deadline_cancels_server_side)
{
    fixture fx;
    ASSERT_OK(fx_start(&fx, 0));
    atomic_store(&g_cancels, 0);
    collector c;
    col_init(&c);
    int64_t t0 = pd_now_ns();
    ASSERT_OK(pd_rpc_stream_async(fx.ch, "/t.T/Hang", "x", 1, 200, NULL, col_done, &c, NULL));
    ASSERT(col_wait(&c, 5000));
    ASSERT_EQ_INT(c.status, PD_RPC_DEADLINE_EXCEEDED);
    ASSERT((pd_now_ns() - t0) / PD_NS_PER_MS < 2000);
    for (int i = 0; i < 500 && atomic_load(&g_cancels) == 0; i++) pd_sleep_ns(PD_NS_PER_MS);
    ASSERT_EQ_INT(atomic_load(&g_cancels), 1);
    fx_stop(&fx);
}

/* A stream started with PD_RPC_NO_DEADLINE carries none to the server, outlives a deadline that
 * would have ended it, and still ends on the client's cancel. */
TEST(rpc_stream_without_deadline)
{
    fixture fx;
    ASSERT_OK(fx_start(&fx, 0));
    atomic_store(&g_cancels, 0);
    collector c, d;
    col_init(&c);
    col_init(&d);
    uint64_t id = 0;
    ASSERT_OK(pd_rpc_stream_async(fx.ch, "/t.T/Hang", "x", 1, 100, NULL, col_done, &d, NULL));
    ASSERT(col_wait(&d, 5000));
    ASSERT_EQ_INT(d.status, PD_RPC_DEADLINE_EXCEEDED);
    int64_t finite = atomic_load(&g_hang_deadline);
    ASSERT(finite > 0 && finite < INT64_MAX);
    ASSERT_OK(pd_rpc_stream_async(fx.ch, "/t.T/Hang", "x", 1, PD_RPC_NO_DEADLINE, NULL, col_done,
                                  &c, &id));
    for (int i = 0; i < 2000 && atomic_load(&g_hang_deadline) != INT64_MAX; i++)
        pd_sleep_ns(PD_NS_PER_MS);
    ASSERT_EQ_INT(atomic_load(&g_hang_deadline), INT64_MAX);
    ASSERT(!col_wait(&c, 300)); /* three times the deadline that ended the first */
    pd_rpc_cancel(fx.cl, id);
    ASSERT(col_wait(&c, 5000));
    ASSERT_EQ_INT(c.status, PD_RPC_CANCELLED);
    for (int i = 0; i < 2000 && atomic_load(&g_cancels) < 2; i++) pd_sleep_ns(PD_NS_PER_MS);
    ASSERT_EQ_INT(atomic_load(&g_cancels), 2);
    fx_stop(&fx);
}

TEST(rpc_client_cancel)
{
    fixture fx;
    ASSERT_OK(fx_start(&fx, 0));
    atomic_store(&g_cancels, 0);
    collector c;
    col_init(&c);
    uint64_t id = 0;
    ASSERT_OK(pd_rpc_stream_async(fx.ch, "/t.T/Hang", "x", 1, 10000, NULL, col_done, &c, &id));
    pd_sleep_ns(50 * PD_NS_PER_MS);
    ASSERT_EQ_INT(pd_rpc_client_inflight(fx.cl), 1);
    pd_rpc_cancel(fx.cl, id);
    ASSERT(col_wait(&c, 3000));
    ASSERT_EQ_INT(c.status, PD_RPC_CANCELLED);
    pd_rpc_cancel(fx.cl, id); /* ended: a no-op */
    /* the server hears of the cancel later (RST_STREAM); a loaded CI machine under ASan can
     * take a second for it */
    for (int i = 0; i < 5000 && atomic_load(&g_cancels) == 0; i++) pd_sleep_ns(PD_NS_PER_MS);
    ASSERT_EQ_INT(atomic_load(&g_cancels), 1);
    ASSERT_EQ_INT(pd_rpc_client_inflight(fx.cl), 0);
    fx_stop(&fx);
}

static atomic_int g_unary_ok;
static void count_ok(void *arg, int status, const char *d, const uint8_t *r, size_t len)
{
    (void)arg, (void)d;
    if (status == PD_RPC_OK && len == 4 && memcmp(r, "ping", 4) == 0)
        atomic_fetch_add(&g_unary_ok, 1);
}

TEST(rpc_many_concurrent_calls)
{
    fixture fx;
    ASSERT_OK(fx_start(&fx, 0));
    atomic_store(&g_unary_ok, 0);
    for (int i = 0; i < 300; i++)
        ASSERT_OK(pd_rpc_unary_async(fx.ch, "/t.T/Echo", "ping", 4, 10000, count_ok, NULL, NULL));
    for (int i = 0; i < 10000 && pd_rpc_client_inflight(fx.cl) > 0; i++) pd_sleep_ns(PD_NS_PER_MS);
    ASSERT_EQ_INT(atomic_load(&g_unary_ok), 300);
    fx_stop(&fx);
}

TEST(rpc_message_size_limits)
{
    fixture fx;
    ASSERT_OK(fx_start(&fx, 1u << 20)); /* the channel takes at most 1 MiB */
    size_t big = 8u << 20;
    uint8_t *buf = malloc(big);
    for (size_t i = 0; i < big; i++) buf[i] = (uint8_t)(i * 31);
    uint8_t *resp = NULL;
    size_t len = 0;
    int st = -1;
    /* 8 MiB request: over the channel's send limit */
    ASSERT_EQ_INT(pd_rpc_unary(fx.ch, "/t.T/Echo", buf, big, 5000, &resp, &len, &st), PD_EINTERNAL);
    ASSERT_EQ_INT(st, PD_RPC_RESOURCE_EXHAUSTED);
    pd_rpc_channel_free(fx.ch);
    /* a channel with the default 64 MiB limit carries it both ways */
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", pd_rpc_server_port(fx.srv));
    ASSERT_OK(pd_rpc_channel_create(fx.cl, target, 0, &fx.ch));
    ASSERT_OK(pd_rpc_unary(fx.ch, "/t.T/Echo", buf, big, 10000, &resp, &len, &st));
    ASSERT_EQ_INT(len, big);
    ASSERT(memcmp(resp, buf, big) == 0);
    free(resp);
    free(buf);
    fx_stop(&fx);
}

TEST(rpc_unreachable_server_fails_within_deadline)
{
    pd_rpc_client *cl;
    pd_rpc_channel *ch;
    ASSERT_OK(pd_rpc_client_create(&cl));
    ASSERT_OK(pd_rpc_channel_create(cl, "127.0.0.1:1", 0, &ch)); /* nothing listens on port 1 */
    uint8_t *resp = NULL;
    int st = -1;
    int64_t t0 = pd_now_ns();
    int rc = pd_rpc_unary(ch, "/t.T/Echo", "x", 1, 500, &resp, NULL, &st);
    ASSERT(rc == PD_ECLOSED || rc == PD_ETIMEOUT);
    ASSERT(st == PD_RPC_UNAVAILABLE || st == PD_RPC_DEADLINE_EXCEEDED);
    ASSERT((pd_now_ns() - t0) / PD_NS_PER_MS < 3000);
    ASSERT_ERR(pd_rpc_unary(ch, "/t.T/Echo", "x", 1, 0, &resp, NULL, &st), PD_EINTERNAL,
               "a deadline is required");
    ASSERT_ERR(pd_rpc_unary(ch, "/t.T/Echo", "x", 1, -2, &resp, NULL, &st), PD_EINTERNAL,
               "a deadline is required");
    pd_rpc_channel_free(ch);
    pd_rpc_client_free(cl);
}

/* A peer that is down but listening: accepts each connection and closes it at once, so every
 * connection attempt of a channel fails its handshake, and notes when each one came. */
typedef struct {
    int fd;
    atomic_bool stop;
    int n;
    int64_t at_ns[64];
} refuser;

static void *refuser_main(void *arg)
{
    refuser *r = arg;
    while (!atomic_load(&r->stop)) {
        struct pollfd pfd = {.fd = r->fd, .events = POLLIN};
        if (poll(&pfd, 1, 20) <= 0) continue;
        int c = accept(r->fd, NULL, NULL);
        if (c < 0) continue;
        if (r->n < 64) r->at_ns[r->n++] = pd_now_ns();
        close(c);
    }
    return NULL;
}

/* A channel whose peer stays unreachable keeps trying to connect about once a second, and a
 * server that comes back on the port answers within about a second. Regression: gRPC's default
 * backoff (1 s, x1.6 per failure, up to 120 s) left a pd-decode restarted after a 50 s outage out
 * of pd-scheduler's routing set for another 24 s (the attempts after 4 s of failures: 0, 1, 2.6,
 * 5.2 s, gaps of 2.6 s and more). */
TEST(rpc_reconnect_backoff_bounded)
{
    refuser r = {.fd = socket(AF_INET, SOCK_STREAM, 0)};
    ASSERT(r.fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t alen = sizeof a;
    int one = 1;
    setsockopt(r.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    ASSERT(bind(r.fd, (struct sockaddr *)&a, sizeof a) == 0 && listen(r.fd, 16) == 0 &&
           getsockname(r.fd, (struct sockaddr *)&a, &alen) == 0);
    int port = ntohs(a.sin_port);
    pthread_t t;
    ASSERT(pthread_create(&t, NULL, refuser_main, &r) == 0);
    pd_rpc_client *cl;
    pd_rpc_channel *ch;
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", port);
    ASSERT_OK(pd_rpc_client_create(&cl));
    ASSERT_OK(pd_rpc_channel_create(cl, target, 0, &ch));
    /* calls every 100 ms for 6 s, as a heartbeat would make them: each fails */
    int ok = 0;
    int64_t t0 = pd_now_ns();
    while (pd_now_ns() - t0 < 6 * PD_NS_PER_S) {
        uint8_t *resp = NULL;
        if (pd_rpc_unary(ch, "/t.T/Echo", "x", 1, 200, &resp, NULL, NULL) == PD_OK) ok++;
        free(resp);
        pd_sleep_ns(100 * PD_NS_PER_MS);
    }
    int64_t t_end = pd_now_ns();
    atomic_store(&r.stop, true);
    pthread_join(t, NULL);
    close(r.fd);
    /* the longest time without an attempt in [t0, t_end] */
    int64_t worst_ns = 0, prev = t0;
    for (int i = 0; i <= r.n; i++) {
        int64_t at = i < r.n ? r.at_ns[i] : t_end;
        if (at - prev > worst_ns) worst_ns = at - prev;
        prev = at;
    }
    double worst = (double)worst_ns / 1e9;
    /* the server is back on the port */
    pd_rpc_server_params p = pd_rpc_server_default_params();
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    p.addr = addr;
    pd_rpc_server *srv = NULL;
    int started = pd_rpc_server_start(&p, methods, 4, &srv);
    int64_t t_back = pd_now_ns();
    double answered = -1;
    while (started == PD_OK && pd_now_ns() - t_back < 10 * PD_NS_PER_S) {
        uint8_t *resp = NULL;
        int rc = pd_rpc_unary(ch, "/t.T/Echo", "x", 1, 200, &resp, NULL, NULL);
        free(resp);
        if (rc == PD_OK) {
            answered = (double)(pd_now_ns() - t_back) / 1e9;
            break;
        }
        pd_sleep_ns(100 * PD_NS_PER_MS);
    }
    pd_rpc_channel_free(ch);
    pd_rpc_client_free(cl);
    if (srv) pd_rpc_server_stop(srv, 1000);
    printf("    %d connection attempts in 6 s, at most %.2f s apart; answered %.2f s after the "
           "server came back\n",
           r.n, worst, answered);
    ASSERT_EQ_INT(ok, 0);
    ASSERT_MSG(worst < 1.8, "%.2f s without a connection attempt (%d attempts in 6 s)", worst, r.n);
    ASSERT_OK(started);
    ASSERT_MSG(answered >= 0 && answered < 2.0, "the server answered %.2f s after it came back",
               answered);
}

TEST(rpc_stop_cancels_calls_in_flight)
{
    fixture fx;
    ASSERT_OK(fx_start(&fx, 0));
    atomic_store(&g_cancels, 0);
    collector c;
    col_init(&c);
    ASSERT_OK(pd_rpc_stream_async(fx.ch, "/t.T/Hang", "x", 1, 10000, NULL, col_done, &c, NULL));
    pd_sleep_ns(50 * PD_NS_PER_MS);
    int64_t t0 = pd_now_ns();
    pd_rpc_server_stop(fx.srv, 2000);
    ASSERT((pd_now_ns() - t0) / PD_NS_PER_MS < 1500); /* the handler ended its call at once */
    ASSERT_EQ_INT(atomic_load(&g_cancels), 1);
    ASSERT(col_wait(&c, 3000));
    ASSERT(c.status != PD_RPC_OK);
    pd_rpc_channel_free(fx.ch);
    pd_rpc_client_free(fx.cl);
}

TEST(rpc_bind_error)
{
    pd_rpc_server_params p = pd_rpc_server_default_params();
    p.addr = "256.1.1.1:5";
    pd_rpc_server *s = NULL;
    ASSERT_ERR(pd_rpc_server_start(&p, methods, 4, &s), PD_EIO, "cannot listen on 256.1.1.1:5");
    ASSERT_STR_EQ(pd_rpc_status_name(PD_RPC_UNAVAILABLE), "UNAVAILABLE");
    ASSERT_STR_EQ(pd_rpc_status_name(99), "UNKNOWN");
}
