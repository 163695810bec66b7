/* gRPC C-core server and client (see rpc.h).
 *
 * Server: one completion queue and one thread. Every batch started on a call carries a tag
 * naming the call and the step; the thread dispatches completions to the call's state machine:
 *   ACCEPT -> {SEND_INITIAL_METADATA, RECV_MESSAGE} + {RECV_CLOSE_ON_SERVER}
 *   RECV   -> handler(request)
 *   handler ends the call -> queued messages go out one SEND at a time, then FINISH
 *            (a single message + status go out as one batch: the unary fast path)
 *   CLOSE  -> completes at the end of the call, or early when the client cancels (cancel_cb)
 * A call is freed when no batch is outstanding and its handler has ended it.
 *
 * Client: one completion queue and thread for all channels. A unary call is one batch; a
 * stream is a start batch, a RECV_MESSAGE loop and a RECV_STATUS batch started up front, with
 * done delivered after both the status and the end of the messages.
 */
#include "rpc/rpc.h"

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/clock.h"
#include "util/log.h"
#include "util/status.h"

#define DEFAULT_MAX_MESSAGE (64u << 20)
#define CQ_POLL_MS          100
/* Longest wait between a channel's connection attempts (gRPC's default grows 1 s x 1.6 per
 * failure up to 120 s), and the longest one attempt may take (gRPC's minimum connect timeout,
 * 20 s by default): a peer restarted after a long outage, or whose link comes back after its
 * SYNs were lost, is reached within about a second (pd-scheduler's heartbeat period), not after
 * the next attempt or SYN retransmission tens of seconds later. */
#define RECONNECT_BACKOFF_MAX_MS 1000
/* A connection that stops answering (a link down, a host gone without a reset) is closed when
 * a keepalive ping gets no answer within KEEPALIVE_MS of being sent (one is sent every
 * KEEPALIVE_MS): its calls fail and the channel connects anew, instead of its RPCs waiting on
 * TCP's retransmissions, whose gaps grow to many seconds while the link is down, once it is back.
 * The servers accept pings that often (SERVER_MIN_PING_MS). */
#define KEEPALIVE_MS       2000
#define SERVER_MIN_PING_MS 1000

typedef enum {
    T_ACCEPT,
    T_RECV,
    T_SEND,
    T_FINISH,
    T_CLOSE,
    T_SHUTDOWN,
    T_CSTART,
    T_CMSG,
    T_CSTATUS,
    T_CUNARY
} tag_kind;

typedef struct {
    tag_kind kind;
    void *obj;
} tag;

const char *pd_rpc_status_name(int st)
{
    static const char *const names[] = {
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    };
    return st >= 0 && st < (int)(sizeof names / sizeof names[0]) ? names[st] : "UNKNOWN";
}

/* Copies a received byte buffer into one malloc'd block (NUL-terminated; *len excludes it). */
static uint8_t *bb_read(grpc_byte_buffer *bb, size_t *len)
{
    grpc_byte_buffer_reader r;
    if (!grpc_byte_buffer_reader_init(&r, bb)) return NULL;
    grpc_slice s = grpc_byte_buffer_reader_readall(&r);
    grpc_byte_buffer_reader_destroy(&r);
    size_t n = GRPC_SLICE_LENGTH(s);
    uint8_t *out = malloc(n + 1);
    if (out) {
        memcpy(out, GRPC_SLICE_START_PTR(s), n);
        out[n] = 0;
        *len = n;
    }
    grpc_slice_unref(s);
    return out;
}

static grpc_byte_buffer *bb_make(const void *data, size_t len)
{
    grpc_slice s = grpc_slice_from_copied_buffer(data, len);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

static grpc_arg int_arg(const char *key, int v)
{
    grpc_arg a;
    a.type = GRPC_ARG_INTEGER;
    a.key = (char *)key;
    a.value.integer = v;
    return a;
}

static int64_t deadline_to_ns(gpr_timespec d)
{
    if (gpr_time_cmp(d, gpr_inf_future(d.clock_type)) == 0) return INT64_MAX;
    gpr_timespec now = gpr_now(d.clock_type);
    gpr_timespec left = gpr_time_sub(d, now);
    return pd_now_ns() + (int64_t)left.tv_sec * PD_NS_PER_S + left.tv_nsec;
}

static gpr_timespec deadline_in(int timeout_ms)
{
    if (timeout_ms == PD_RPC_NO_DEADLINE) return gpr_inf_future(GPR_CLOCK_MONOTONIC);
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                        gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
}

static pthread_mutex_t g_init_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_init_refs;

static void rpc_init(void)
{
    pthread_mutex_lock(&g_init_mu);
    if (g_init_refs++ == 0) grpc_init();
    pthread_mutex_unlock(&g_init_mu);
}

static void rpc_shutdown(void)
{
    pthread_mutex_lock(&g_init_mu);
    if (--g_init_refs == 0) grpc_shutdown();
    pthread_mutex_unlock(&g_init_mu);
}

/* ====================================================================== server ============ */

typedef struct msg_node {
    struct msg_node *next;
    grpc_byte_buffer *bb;
} msg_node;

typedef struct accept_slot {
    tag t;
    grpc_call *call;
    grpc_call_details details;
    grpc_metadata_array md;
} accept_slot;

struct pd_rpc_call {
    pd_rpc_server *s;
    grpc_call *call;
    const pd_rpc_method *m; /* NULL: unknown method */
    char method_name[128];
    int64_t deadline_ns;
    pthread_mutex_t mu;
    tag t_recv, t_send, t_finish, t_close;
    grpc_byte_buffer *recv_bb, *send_bb;
    int cancelled_flag; /* written by RECV_CLOSE_ON_SERVER */
    int ops;            /* batches outstanding, and holds (pd_rpc_call_hold) */
    bool handler_ref;   /* the handler has not ended the call yet */
    bool ended, send_in_flight, finish_started, cancelled;
    bool freeing; /* call_should_free said yes: one thread is freeing it */
    msg_node *q_head, *q_tail;
    int end_status;
    char end_details[256];
    grpc_slice details_slice;
    pd_rpc_cancel_fn cancel_cb;
    void *cancel_arg;
    pd_rpc_call *prev, *next; /* server's list */
};

struct pd_rpc_server {
    grpc_server *server;
    grpc_completion_queue *cq;
    pthread_t thread;
    const pd_rpc_method *methods;
    size_t n_methods;
    int port;
    accept_slot *slots;
    int n_slots;
    tag t_shutdown;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pd_rpc_call *calls;
    int live_calls;
    bool stopping, shutdown_done, cq_shutdown;
    atomic_bool release_all; /* stop() gave up waiting for handlers */
};

pd_rpc_server_params pd_rpc_server_default_params(void)
{
    return (pd_rpc_server_params){
        .addr = "127.0.0.1:0", .max_message_bytes = DEFAULT_MAX_MESSAGE, .concurrent_accepts = 8};
}

static void post_accept(pd_rpc_server *s, accept_slot *slot)
{
    grpc_call_details_init(&slot->details);
    grpc_metadata_array_init(&slot->md);
    slot->call = NULL;
    grpc_call_error e = grpc_server_request_call(s->server, &slot->call, &slot->details, &slot->md,
                                                 s->cq, s->cq, &slot->t);
    if (e != GRPC_CALL_OK) {
        grpc_call_details_destroy(&slot->details);
        grpc_metadata_array_destroy(&slot->md);
        slot->t.obj = NULL; /* not posted */
        PD_WARN(NULL, "rpc: request_call failed: %d", (int)e);
    }
}

/* True (once) when the call can be freed: no batch outstanding and the handler has ended it
 * (or the server is force-releasing). Called with c->mu held; the caller frees it after
 * unlocking, and no other thread touches the call after that decision. */
static bool call_should_free(pd_rpc_call *c)
{
    if (c->freeing || c->ops > 0 || (c->handler_ref && !atomic_load(&c->s->release_all)))
        return false;
    c->freeing = true;
    return true;
}

/* Unlinks from the server and releases everything. */
static void call_free(pd_rpc_call *c)
{
    pd_rpc_server *s = c->s;
    pthread_mutex_lock(&s->mu);
    if (c->prev)
        c->prev->next = c->next;
    else
        s->calls = c->next;
    if (c->next) c->next->prev = c->prev;
    s->live_calls--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    while (c->q_head) {
        msg_node *n = c->q_head;
        c->q_head = n->next;
        grpc_byte_buffer_destroy(n->bb);
        free(n);
    }
    if (c->recv_bb) grpc_byte_buffer_destroy(c->recv_bb);
    if (c->send_bb) grpc_byte_buffer_destroy(c->send_bb);
    if (c->finish_started) grpc_slice_unref(c->details_slice);
    grpc_call_unref(c->call);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

/* Starts the next send or the final status. Called with c->mu held. */
static void call_pump(pd_rpc_call *c)
{
    if (c->send_in_flight || c->finish_started) return;
    grpc_op ops[3];
    memset(ops, 0, sizeof ops);
    if (c->q_head && !(c->ended && c->q_head == c->q_tail)) {
        msg_node *n = c->q_head;
        c->q_head = n->next;
        if (!c->q_head) c->q_tail = NULL;
        c->send_bb = n->bb;
        free(n);
        ops[0].op = GRPC_OP_SEND_MESSAGE;
        ops[0].data.send_message.send_message = c->send_bb;
        c->send_in_flight = true;
        c->ops++;
        if (grpc_call_start_batch(c->call, ops, 1, &c->t_send, NULL) != GRPC_CALL_OK) {
            c->ops--;
            c->send_in_flight = false;
        }
        return;
    }
    if (!c->ended) return;
    size_t n_ops = 0;
    if (c->q_head) { /* exactly one message left: send it with the status */
        msg_node *n = c->q_head;
        c->q_head = c->q_tail = NULL;
        c->send_bb = n->bb;
        free(n);
        ops[n_ops].op = GRPC_OP_SEND_MESSAGE;
        ops[n_ops].data.send_message.send_message = c->send_bb;
        n_ops++;
    }
    c->details_slice = grpc_slice_from_copied_string(c->end_details);
    ops[n_ops].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n_ops].data.send_status_from_server.trailing_metadata_count = 0;
    ops[n_ops].data.send_status_from_server.status = (grpc_status_code)c->end_status;
    ops[n_ops].data.send_status_from_server.status_details = &c->details_slice;
    n_ops++;
    c->finish_started = true;
    c->ops++;
    if (grpc_call_start_batch(c->call, ops, n_ops, &c->t_finish, NULL) != GRPC_CALL_OK) c->ops--;
}

/* Handler side: marks the call ended (once). Returns PD_EINVAL when it already was. */
static int call_end(pd_rpc_call *c, const void *msg, size_t len, bool with_msg, int status,
                    const char *details)
{
    pthread_mutex_lock(&c->mu);
    if (c->ended) {
        pthread_mutex_unlock(&c->mu);
        return pd_error(PD_EINVAL, "rpc %s: call already ended", c->method_name);
    }
    int rc = c->cancelled ? pd_error(PD_ECANCELLED, "rpc %s: cancelled", c->method_name) : PD_OK;
    if (with_msg && !c->cancelled) {
        msg_node *n = malloc(sizeof *n);
        if (n) {
            n->next = NULL;
            n->bb = bb_make(msg, len);
            if (c->q_tail)
                c->q_tail->next = n;
            else
                c->q_head = n;
            c->q_tail = n;
        } else {
            status = PD_RPC_INTERNAL;
            details = "out of memory";
        }
    }
    c->ended = true;
    c->end_status = status;
    snprintf(c->end_details, sizeof c->end_details, "%s", details ? details : "");
    c->handler_ref = false;
    call_pump(c);
    bool f = call_should_free(c);
    pthread_mutex_unlock(&c->mu);
    if (f) call_free(c);
    return rc;
}

int pd_rpc_reply(pd_rpc_call *c, const void *msg, size_t len)
{
    return call_end(c, msg, len, true, PD_RPC_OK, "");
}

int pd_rpc_fail(pd_rpc_call *c, int grpc_status, const char *details)
{
    return call_end(c, NULL, 0, false, grpc_status, details);
}

int pd_rpc_stream_end(pd_rpc_call *c, int grpc_status, const char *details)
{
    return call_end(c, NULL, 0, false, grpc_status, details);
}

int pd_rpc_stream_send(pd_rpc_call *c, const void *msg, size_t len)
{
    pthread_mutex_lock(&c->mu);
    int rc = PD_OK;
    if (c->ended) {
        rc = pd_error(PD_EINVAL, "rpc %s: send after end", c->method_name);
    } else if (c->cancelled) {
        rc = pd_error(PD_ECANCELLED, "rpc %s: cancelled by the client", c->method_name);
    } else {
        msg_node *n = malloc(sizeof *n);
        if (!n) {
            rc = pd_error(PD_ENOMEM, "rpc: out of memory");
        } else {
            n->next = NULL;
            n->bb = bb_make(msg, len);
            if (c->q_tail)
                c->q_tail->next = n;
            else
                c->q_head = n;
            c->q_tail = n;
            call_pump(c);
        }
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

void pd_rpc_on_cancel(pd_rpc_call *c, pd_rpc_cancel_fn cb, void *arg)
{
    pthread_mutex_lock(&c->mu);
    c->cancel_cb = cb;
    c->cancel_arg = arg;
    bool now = c->cancelled && cb && !c->ended;
    pthread_mutex_unlock(&c->mu);
    if (now) cb(arg, c); /* already cancelled: tell at once */
}

void pd_rpc_call_hold(pd_rpc_call *c)
{
    pthread_mutex_lock(&c->mu); /* a pseudo-op: the call is freed only when ops reach 0 */
    c->ops++;
    pthread_mutex_unlock(&c->mu);
}

void pd_rpc_call_release(pd_rpc_call *c)
{
    pthread_mutex_lock(&c->mu);
    c->ops--;
    bool f = call_should_free(c);
    pthread_mutex_unlock(&c->mu);
    if (f) call_free(c);
}

int pd_rpc_cancelled(pd_rpc_call *c)
{
    pthread_mutex_lock(&c->mu);
    int v = c->cancelled;
    pthread_mutex_unlock(&c->mu);
    return v;
}

int64_t pd_rpc_deadline_ns(const pd_rpc_call *c)
{
    return c->deadline_ns;
}

const char *pd_rpc_method_name(const pd_rpc_call *c)
{
    return c->method_name;
}

static void server_new_call(pd_rpc_server *s, accept_slot *slot)
{
    pd_rpc_call *c = calloc(1, sizeof *c);
    if (!c) {
        grpc_call_cancel(slot->call, NULL);
        grpc_call_unref(slot->call);
        return;
    }
    c->s = s;
    c->call = slot->call;
    pthread_mutex_init(&c->mu, NULL);
    c->t_recv = (tag){T_RECV, c};
    c->t_send = (tag){T_SEND, c};
    c->t_finish = (tag){T_FINISH, c};
    c->t_close = (tag){T_CLOSE, c};
    c->handler_ref = true;
    c->deadline_ns = deadline_to_ns(slot->details.deadline);
    char *name = grpc_slice_to_c_string(slot->details.method);
    snprintf(c->method_name, sizeof c->method_name, "%s", name);
    gpr_free(name);
    for (size_t i = 0; i < s->n_methods; i++)
        if (strcmp(s->methods[i].method, c->method_name) == 0) c->m = &s->methods[i];
    grpc_call_details_destroy(&slot->details);
    grpc_metadata_array_destroy(&slot->md);

    pthread_mutex_lock(&s->mu);
    c->next = s->calls;
    if (s->calls) s->calls->prev = c;
    s->calls = c;
    s->live_calls++;
    pthread_mutex_unlock(&s->mu);

    grpc_op ops[2];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_RECV_MESSAGE;
    ops[1].data.recv_message.recv_message = &c->recv_bb;
    pthread_mutex_lock(&c->mu);
    c->ops += 2;
    if (grpc_call_start_batch(c->call, ops, 2, &c->t_recv, NULL) != GRPC_CALL_OK) c->ops--;
    grpc_op close_op;
    memset(&close_op, 0, sizeof close_op);
    close_op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    close_op.data.recv_close_on_server.cancelled = &c->cancelled_flag;
    if (grpc_call_start_batch(c->call, &close_op, 1, &c->t_close, NULL) != GRPC_CALL_OK) c->ops--;
    pthread_mutex_unlock(&c->mu);
}

static void server_on_recv(pd_rpc_call *c, bool success)
{
    pthread_mutex_lock(&c->mu);
    c->ops--;
    grpc_byte_buffer *bb = c->recv_bb;
    c->recv_bb = NULL;
    pthread_mutex_unlock(&c->mu);
    size_t len = 0;
    uint8_t *req = success && bb ? bb_read(bb, &len) : NULL;
    if (bb) grpc_byte_buffer_destroy(bb);
    if (!c->m) {
        PD_DEBUG(NULL, "rpc: unknown method %s", c->method_name);
        free(req);
        call_end(c, NULL, 0, false, PD_RPC_UNIMPLEMENTED, "unknown method");
        return;
    }
    if (!req) {
        call_end(c, NULL, 0, false, PD_RPC_INVALID_ARGUMENT, "no request message");
        return;
    }
    pd_rpc_call_hold(c); /* the handler may end the call and still use it */
    c->m->handler(c->m->ctx, c, req, len);
    free(req);
    pd_rpc_call_release(c);
}

static void server_on_close(pd_rpc_call *c)
{
    pthread_mutex_lock(&c->mu); /* the close op stays counted while the callback runs */
    pd_rpc_cancel_fn cb = NULL;
    void *arg = NULL;
    if (c->cancelled_flag && !c->cancelled) {
        c->cancelled = true;
        if (!c->ended) { /* an ended call's handler has let go of it */
            cb = c->cancel_cb;
            arg = c->cancel_arg;
        }
        /* drop queued messages: nobody will read them */
        while (c->q_head) {
            msg_node *n = c->q_head;
            c->q_head = n->next;
            grpc_byte_buffer_destroy(n->bb);
            free(n);
        }
        c->q_tail = NULL;
    }
    pthread_mutex_unlock(&c->mu);
    if (cb) cb(arg, c);
    pthread_mutex_lock(&c->mu);
    c->ops--;
    bool f = call_should_free(c);
    pthread_mutex_unlock(&c->mu);
    if (f) call_free(c);
}

static void server_on_send(pd_rpc_call *c, tag_kind kind)
{
    pthread_mutex_lock(&c->mu);
    c->ops--;
    if (c->send_bb) {
        grpc_byte_buffer_destroy(c->send_bb);
        c->send_bb = NULL;
    }
    if (kind == T_SEND) {
        c->send_in_flight = false;
        call_pump(c);
    }
    bool f = call_should_free(c);
    pthread_mutex_unlock(&c->mu);
    if (f) call_free(c);
}

static void *server_main(void *arg)
{
    pd_rpc_server *s = arg;
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(s->cq, deadline_in(CQ_POLL_MS), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
        if (ev.type == GRPC_OP_COMPLETE) {
            tag *t = ev.tag;
            switch (t->kind) {
            case T_ACCEPT: {
                accept_slot *slot = t->obj;
                if (ev.success && slot->call) {
                    server_new_call(s, slot);
                } else {
                    grpc_call_details_destroy(&slot->details);
                    grpc_metadata_array_destroy(&slot->md);
                }
                pthread_mutex_lock(&s->mu);
                bool again = !s->stopping;
                pthread_mutex_unlock(&s->mu);
                if (again) post_accept(s, slot);
                break;
            }
            case T_RECV: server_on_recv(t->obj, ev.success); break;
            case T_CLOSE: server_on_close(t->obj); break;
            case T_SEND:
            case T_FINISH: server_on_send(t->obj, t->kind); break;
            case T_SHUTDOWN:
                pthread_mutex_lock(&s->mu);
                s->shutdown_done = true;
                pthread_cond_broadcast(&s->cv);
                pthread_mutex_unlock(&s->mu);
                break;
            default: break;
            }
        }
        pthread_mutex_lock(&s->mu);
        bool done = s->shutdown_done && s->live_calls == 0 && !s->cq_shutdown;
        if (done) s->cq_shutdown = true;
        pthread_mutex_unlock(&s->mu);
        if (done) grpc_completion_queue_shutdown(s->cq);
    }
    return NULL;
}

int pd_rpc_server_start(const pd_rpc_server_params *p, const pd_rpc_method *methods,
                        size_t n_methods, pd_rpc_server **out)
{
    rpc_init();
    pd_rpc_server *s = calloc(1, sizeof *s);
    if (!s) {
        rpc_shutdown();
        return pd_error(PD_ENOMEM, "rpc: out of memory");
    }
    s->methods = methods;
    s->n_methods = n_methods;
    s->n_slots = p->concurrent_accepts > 0 ? p->concurrent_accepts : 8;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    int max = p->max_message_bytes ? (int)p->max_message_bytes : (int)DEFAULT_MAX_MESSAGE;
    grpc_arg args[] = {
        int_arg(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, max),
        int_arg(GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, max),
        int_arg(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, SERVER_MIN_PING_MS),
        int_arg(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1)};
    grpc_channel_args cargs = {sizeof args / sizeof args[0], args};
    s->cq = grpc_completion_queue_create_for_next(NULL);
    s->server = grpc_server_create(&cargs, NULL);
    grpc_server_register_completion_queue(s->server, s->cq, NULL);
    grpc_server_credentials *creds = grpc_insecure_server_credentials_create();
    s->port = grpc_server_add_http2_port(s->server, p->addr, creds);
    grpc_server_credentials_release(creds);
    if (s->port == 0) {
        int rc = pd_error(PD_EIO, "rpc: cannot listen on %s", p->addr);
        grpc_server_destroy(s->server);
        grpc_completion_queue_shutdown(s->cq);
        while (grpc_completion_queue_next(s->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
               GRPC_QUEUE_SHUTDOWN) {
        }
        grpc_completion_queue_destroy(s->cq);
        pthread_mutex_destroy(&s->mu);
        pthread_cond_destroy(&s->cv);
        free(s);
        rpc_shutdown();
        return rc;
    }
    grpc_server_start(s->server);
    s->slots = calloc((size_t)s->n_slots, sizeof *s->slots);
    for (int i = 0; s->slots && i < s->n_slots; i++) {
        s->slots[i].t = (tag){T_ACCEPT, &s->slots[i]};
        post_accept(s, &s->slots[i]);
    }
    s->t_shutdown = (tag){T_SHUTDOWN, s};
    pthread_create(&s->thread, NULL, server_main, s);
    *out = s;
    return PD_OK;
}

int pd_rpc_server_port(const pd_rpc_server *s)
{
    return s->port;
}

void pd_rpc_server_stop(pd_rpc_server *s, int grace_ms)
{
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->stopping = true;
    pthread_mutex_unlock(&s->mu);
    grpc_server_shutdown_and_notify(s->server, s->cq, &s->t_shutdown);
    grpc_server_cancel_all_calls(s->server);
    /* wait for handlers to end their calls (their cancel callbacks have told them) */
    int64_t deadline = pd_now_ns() + (int64_t)grace_ms * PD_NS_PER_MS;
    pthread_mutex_lock(&s->mu);
    while (s->live_calls > 0 && pd_now_ns() < deadline) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 10 * PD_NS_PER_MS;
        if (ts.tv_nsec >= PD_NS_PER_S) {
            ts.tv_sec++;
            ts.tv_nsec -= PD_NS_PER_S;
        }
        pthread_cond_timedwait(&s->cv, &s->mu, &ts);
    }
    if (s->live_calls > 0) {
        PD_WARN(NULL, "rpc: %d call(s) not ended by their handlers within %d ms; dropping them",
                s->live_calls, grace_ms);
        atomic_store(&s->release_all, true);
    }
    /* calls whose batches are all done but whose handler still holds them: no event will
     * come for them, so free them here (the thread frees the others as their batches end) */
    pd_rpc_call *idle[64];
    for (;;) {
        size_t k = 0;
        for (pd_rpc_call *c = s->calls; c && k < 64; c = c->next) {
            pthread_mutex_lock(&c->mu);
            if (call_should_free(c)) idle[k++] = c;
            pthread_mutex_unlock(&c->mu);
        }
        pthread_mutex_unlock(&s->mu);
        for (size_t i = 0; i < k; i++) call_free(idle[i]);
        pthread_mutex_lock(&s->mu);
        if (k < 64) break;
    }
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    grpc_server_destroy(s->server);
    grpc_completion_queue_destroy(s->cq);
    free(s->slots);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
    rpc_shutdown();
}

/* ====================================================================== client ============ */

typedef struct cpending {
    pd_rpc_client *cl;
    pd_rpc_channel *ch;
    uint64_t id;
    grpc_call *call;
    bool stream;
    tag t_start, t_msg, t_status;
    grpc_metadata_array init_md, trail_md;
    grpc_status_code status;
    grpc_slice details;
    grpc_byte_buffer *req_bb, *resp_bb;
    atomic_int ops; /* batches outstanding */
    bool recv_done, status_done;
    bool paused, parked; /* under cl->mu: reading stopped; parked: no RECV_MESSAGE posted */
    bool finishing;      /* under cl->mu: the last batch completed; p is about to go */
    pd_rpc_msg_fn on_msg;
    pd_rpc_done_fn done;
    void *arg;
    struct cpending *prev, *next;
} cpending;

struct pd_rpc_client {
    grpc_completion_queue *cq;
    void (*idle_fn)(void *arg);
    void *idle_arg;
    pthread_t thread;
    pthread_mutex_t mu;
    cpending *live;
    int n_live;
    uint64_t next_id;
    bool stopping;
};

struct pd_rpc_channel {
    pd_rpc_client *cl;
    grpc_channel *ch;
    int refs; /* the owner + each call in flight; under cl->mu */
};

static void channel_unref_locked(pd_rpc_channel *ch)
{
    if (--ch->refs == 0) {
        grpc_channel_destroy(ch->ch);
        free(ch);
    }
}

static void client_finish(cpending *p)
{
    pd_rpc_client *cl = p->cl;
    size_t len = 0;
    uint8_t *resp = NULL;
    int status = (int)p->status;
    const char *why = NULL;
    if (!p->stream && status == GRPC_STATUS_OK) {
        resp = p->resp_bb ? bb_read(p->resp_bb, &len) : NULL;
        if (!resp) { /* OK without a message: a protocol error */
            status = PD_RPC_INTERNAL;
            why = "reply carried no message";
        }
    }
    char *details = grpc_slice_to_c_string(p->details);
    /* out of the live list first: once done has run, the call is no longer in flight */
    pthread_mutex_lock(&cl->mu);
    if (p->prev)
        p->prev->next = p->next;
    else
        cl->live = p->next;
    if (p->next) p->next->prev = p->prev;
    cl->n_live--;
    pthread_mutex_unlock(&cl->mu);
    p->done(p->arg, status, why ? why : details, resp, len);
    gpr_free(details);
    free(resp);
    pthread_mutex_lock(&cl->mu);
    channel_unref_locked(p->ch);
    pthread_mutex_unlock(&cl->mu);
    if (p->req_bb) grpc_byte_buffer_destroy(p->req_bb);
    if (p->resp_bb) grpc_byte_buffer_destroy(p->resp_bb);
    grpc_metadata_array_destroy(&p->init_md);
    grpc_metadata_array_destroy(&p->trail_md);
    grpc_slice_unref(p->details);
    grpc_call_unref(p->call);
    free(p);
}

static void client_post_recv(cpending *p)
{
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &p->resp_bb;
    atomic_fetch_add(&p->ops, 1);
    if (grpc_call_start_batch(p->call, &op, 1, &p->t_msg, NULL) != GRPC_CALL_OK) {
        atomic_fetch_sub(&p->ops, 1);
        p->recv_done = true;
    }
}

static _Thread_local bool t_client_thread;

bool pd_rpc_on_client_thread(void)
{
    return t_client_thread;
}

void pd_rpc_client_set_idle_hook(pd_rpc_client *cl, void (*fn)(void *arg), void *arg)
{
    cl->idle_fn = fn;
    cl->idle_arg = arg;
}

static void *client_main(void *arg)
{
    pd_rpc_client *cl = arg;
    t_client_thread = true;
    int burst = 0;
    for (;;) {
        /* what is ready now first; before blocking, the idle hook ends the burst */
        grpc_event ev = grpc_completion_queue_next(cl->cq, gpr_time_0(GPR_CLOCK_REALTIME), NULL);
        if (ev.type == GRPC_QUEUE_TIMEOUT || burst >= 64) {
            if (burst > 0 && cl->idle_fn) cl->idle_fn(cl->idle_arg);
            burst = 0;
            if (ev.type == GRPC_QUEUE_TIMEOUT)
                ev = grpc_completion_queue_next(cl->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        }
        if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
        if (ev.type != GRPC_OP_COMPLETE) continue;
        burst++;
        tag *t = ev.tag;
        cpending *p = t->obj;
        switch (t->kind) {
        case T_CUNARY: break;
        case T_CSTART:
            if (ev.success)
                client_post_recv(p);
            else
                p->recv_done = true;
            break;
        case T_CMSG:
            if (ev.success && p->resp_bb) {
                size_t len = 0;
                uint8_t *m = bb_read(p->resp_bb, &len);
                grpc_byte_buffer_destroy(p->resp_bb);
                p->resp_bb = NULL;
                if (m && p->on_msg) p->on_msg(p->arg, m, len);
                free(m);
                pthread_mutex_lock(&cl->mu);
                p->parked = p->paused;
                if (!p->parked) client_post_recv(p);
                pthread_mutex_unlock(&cl->mu);
            } else {
                p->recv_done = true;
            }
            break;
        case T_CSTATUS:
            pthread_mutex_lock(&cl->mu);
            p->status_done = true;
            if (p->parked) { /* the stream ended: read what is left */
                p->parked = p->paused = false;
                client_post_recv(p);
            }
            pthread_mutex_unlock(&cl->mu);
            break;
        default: break;
        }
        /* decided under the lock: pd_rpc_stream_pause must not post on a finishing call */
        pthread_mutex_lock(&cl->mu);
        bool last = atomic_fetch_sub(&p->ops, 1) == 1;
        p->finishing = last;
        pthread_mutex_unlock(&cl->mu);
        if (last) client_finish(p);
    }
    return NULL;
}

int pd_rpc_client_create(pd_rpc_client **out)
{
    rpc_init();
    pd_rpc_client *cl = calloc(1, sizeof *cl);
    if (!cl) {
        rpc_shutdown();
        return pd_error(PD_ENOMEM, "rpc: out of memory");
    }
    pthread_mutex_init(&cl->mu, NULL);
    cl->cq = grpc_completion_queue_create_for_next(NULL);
    cl->next_id = 1;
    pthread_create(&cl->thread, NULL, client_main, cl);
    *out = cl;
    return PD_OK;
}

void pd_rpc_client_free(pd_rpc_client *cl)
{
    if (!cl) return;
    pthread_mutex_lock(&cl->mu);
    cl->stopping = true;
    for (cpending *p = cl->live; p; p = p->next) grpc_call_cancel(p->call, NULL);
    pthread_mutex_unlock(&cl->mu);
    /* every call completes (cancelled) and is finished by the thread; then shut the queue */
    for (;;) {
        pthread_mutex_lock(&cl->mu);
        int n = cl->n_live;
        pthread_mutex_unlock(&cl->mu);
        if (n == 0) break;
        pd_sleep_ns(PD_NS_PER_MS);
    }
    grpc_completion_queue_shutdown(cl->cq);
    pthread_join(cl->thread, NULL);
    grpc_completion_queue_destroy(cl->cq);
    pthread_mutex_destroy(&cl->mu);
    free(cl);
    rpc_shutdown();
}

int pd_rpc_channel_create(pd_rpc_client *cl, const char *target, size_t max_message_bytes,
                          pd_rpc_channel **out)
{
    pd_rpc_channel *ch = calloc(1, sizeof *ch);
    if (!ch) return pd_error(PD_ENOMEM, "rpc: out of memory");
    int max = max_message_bytes ? (int)max_message_bytes : (int)DEFAULT_MAX_MESSAGE;
    /* No BDP probing and 256 KiB stream windows: a paused stream (pd_rpc_stream_pause) holds at
     * most that much here, the rest waits on the server; a message up to that size (the
     * scheduler's relay batches: ~100 bytes per request and step) needs no window update. */
    grpc_arg args[] = {int_arg(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, max),
                       int_arg(GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, max),
                       int_arg(GRPC_ARG_HTTP2_BDP_PROBE, 0),
                       int_arg(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 256 << 10),
                       int_arg(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, RECONNECT_BACKOFF_MAX_MS),
                       int_arg(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, RECONNECT_BACKOFF_MAX_MS),
                       int_arg(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, RECONNECT_BACKOFF_MAX_MS),
                       int_arg(GRPC_ARG_KEEPALIVE_TIME_MS, KEEPALIVE_MS),
                       int_arg(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, KEEPALIVE_MS),
                       int_arg(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1),
                       int_arg(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0)};
    grpc_channel_args cargs = {sizeof args / sizeof args[0], args};
    grpc_channel_credentials *creds = grpc_insecure_credentials_create();
    ch->ch = grpc_channel_create(target, creds, &cargs);
    grpc_channel_credentials_release(creds);
    if (!ch->ch) {
        free(ch);
        return pd_error(PD_EINVAL, "rpc: bad target '%s'", target);
    }
    ch->cl = cl;
    ch->refs = 1;
    *out = ch;
    return PD_OK;
}

void pd_rpc_channel_free(pd_rpc_channel *ch)
{
    if (!ch) return;
    pd_rpc_client *cl = ch->cl;
    pthread_mutex_lock(&cl->mu);
    channel_unref_locked(ch);
    pthread_mutex_unlock(&cl->mu);
}

static int start_call(pd_rpc_channel *ch, const char *method, const void *req, size_t len,
                      int timeout_ms, bool stream, pd_rpc_msg_fn on_msg, pd_rpc_done_fn done,
                      void *arg, uint64_t *id)
{
    pd_rpc_client *cl = ch->cl;
    if (timeout_ms <= 0 && timeout_ms != PD_RPC_NO_DEADLINE) {
        int rc = pd_error(PD_EINVAL, "rpc %s: a deadline is required", method);
        done(arg, PD_RPC_INVALID_ARGUMENT, pd_last_error(), NULL, 0);
        return rc;
    }
    cpending *p = calloc(1, sizeof *p);
    if (!p) {
        done(arg, PD_RPC_INTERNAL, "out of memory", NULL, 0);
        return pd_error(PD_ENOMEM, "rpc: out of memory");
    }
    p->cl = cl;
    p->ch = ch;
    p->stream = stream;
    p->on_msg = on_msg;
    p->done = done;
    p->arg = arg;
    p->t_start = (tag){stream ? T_CSTART : T_CUNARY, p};
    p->t_msg = (tag){T_CMSG, p};
    p->t_status = (tag){T_CSTATUS, p};
    grpc_metadata_array_init(&p->init_md);
    grpc_metadata_array_init(&p->trail_md);
    p->details = grpc_empty_slice();
    grpc_slice m = grpc_slice_from_copied_string(method);
    p->call = grpc_channel_create_call(ch->ch, NULL, GRPC_PROPAGATE_DEFAULTS, cl->cq, m, NULL,
                                       deadline_in(timeout_ms), NULL);
    grpc_slice_unref(m);
    p->req_bb = bb_make(req, len);

    pthread_mutex_lock(&cl->mu);
    p->id = cl->next_id++;
    if (id) *id = p->id;
    p->next = cl->live;
    if (cl->live) cl->live->prev = p;
    cl->live = p;
    cl->n_live++;
    ch->refs++;
    if (cl->stopping) grpc_call_cancel(p->call, NULL);
    pthread_mutex_unlock(&cl->mu);

    grpc_op ops[6];
    memset(ops, 0, sizeof ops);
    size_t n = 0;
    ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n++].data.send_message.send_message = p->req_bb;
    ops[n++].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[n].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[n++].data.recv_initial_metadata.recv_initial_metadata = &p->init_md;
    grpc_op status_op;
    memset(&status_op, 0, sizeof status_op);
    status_op.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    status_op.data.recv_status_on_client.trailing_metadata = &p->trail_md;
    status_op.data.recv_status_on_client.status = &p->status;
    status_op.data.recv_status_on_client.status_details = &p->details;
    if (!stream) {
        ops[n].op = GRPC_OP_RECV_MESSAGE;
        ops[n++].data.recv_message.recv_message = &p->resp_bb;
        ops[n++] = status_op;
    }
    /* ops is only touched by this thread until the batch is started; the completion thread
     * reads p->ops after events, so count every batch before starting any. */
    atomic_store(&p->ops, stream ? 2 : 1);
    p->status = GRPC_STATUS_INTERNAL; /* until RECV_STATUS writes the real one */
    grpc_call_error e = grpc_call_start_batch(p->call, ops, n, &p->t_start, NULL);
    if (e != GRPC_CALL_OK) { /* nothing started: finish here (done runs on this thread) */
        atomic_store(&p->ops, 0);
        client_finish(p);
        return pd_error(PD_EINTERNAL, "rpc %s: start_batch failed: %d", method, (int)e);
    }
    if (stream &&
        grpc_call_start_batch(p->call, &status_op, 1, &p->t_status, NULL) != GRPC_CALL_OK) {
        p->status_done = true;
        grpc_call_cancel(p->call, NULL);
        if (atomic_fetch_sub(&p->ops, 1) == 1) client_finish(p);
    }
    return PD_OK;
}

int pd_rpc_unary_async(pd_rpc_channel *ch, const char *method, const void *req, size_t len,
                       int timeout_ms, pd_rpc_done_fn done, void *arg, uint64_t *id)
{
    return start_call(ch, method, req, len, timeout_ms, false, NULL, done, arg, id);
}

int pd_rpc_stream_async(pd_rpc_channel *ch, const char *method, const void *req, size_t len,
                        int timeout_ms, pd_rpc_msg_fn on_msg, pd_rpc_done_fn done, void *arg,
                        uint64_t *id)
{
    return start_call(ch, method, req, len, timeout_ms, true, on_msg, done, arg, id);
}

void pd_rpc_cancel(pd_rpc_client *cl, uint64_t id)
{
    pthread_mutex_lock(&cl->mu);
    for (cpending *p = cl->live; p; p = p->next)
        if (p->id == id) {
            grpc_call_cancel(p->call, NULL);
            break;
        }
    pthread_mutex_unlock(&cl->mu);
}

void pd_rpc_stream_pause(pd_rpc_client *cl, uint64_t id, bool paused)
{
    pthread_mutex_lock(&cl->mu);
    for (cpending *p = cl->live; p; p = p->next) {
        if (p->id != id) continue;
        if (!p->stream || p->finishing) break;
        p->paused = paused;
        if (!paused && p->parked) {
            p->parked = false;
            client_post_recv(p);
        }
        break;
    }
    pthread_mutex_unlock(&cl->mu);
}

int pd_rpc_client_inflight(pd_rpc_client *cl)
{
    pthread_mutex_lock(&cl->mu);
    int n = cl->n_live;
    pthread_mutex_unlock(&cl->mu);
    return n;
}

/* ---- synchronous unary ---- */

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done;
    int status;
    char details[256];
    uint8_t *resp;
    size_t len;
} sync_wait;

static void sync_done(void *arg, int status, const char *details, const uint8_t *resp, size_t len)
{
    sync_wait *w = arg;
    pthread_mutex_lock(&w->mu);
    w->status = status;
    snprintf(w->details, sizeof w->details, "%s", details ? details : "");
    if (status == PD_RPC_OK && resp) {
        w->resp = malloc(len + 1);
        if (w->resp) {
            memcpy(w->resp, resp, len);
            w->resp[len] = 0;
            w->len = len;
        }
    }
    w->done = true;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

int pd_rpc_unary(pd_rpc_channel *ch, const char *method, const void *req, size_t len,
                 int timeout_ms, uint8_t **resp, size_t *resp_len, int *grpc_status)
{
    sync_wait w;
    memset(&w, 0, sizeof w);
    pthread_mutex_init(&w.mu, NULL);
    pthread_cond_init(&w.cv, NULL);
    pd_rpc_unary_async(ch, method, req, len, timeout_ms, sync_done, &w, NULL);
    pthread_mutex_lock(&w.mu);
    while (!w.done) pthread_cond_wait(&w.cv, &w.mu);
    pthread_mutex_unlock(&w.mu);
    pthread_mutex_destroy(&w.mu);
    pthread_cond_destroy(&w.cv);
    if (grpc_status) *grpc_status = w.status;
    if (w.status == PD_RPC_OK && w.resp) {
        *resp = w.resp;
        if (resp_len) *resp_len = w.len;
        return PD_OK;
    }
    free(w.resp);
    int code = w.status == PD_RPC_DEADLINE_EXCEEDED ? PD_ETIMEOUT
               : w.status == PD_RPC_UNAVAILABLE     ? PD_ECLOSED
               : w.status == PD_RPC_CANCELLED       ? PD_ECANCELLED
                                                    : PD_EINTERNAL;
    return pd_error(code, "%s: %s: %s", method, pd_rpc_status_name(w.status), w.details);
}
