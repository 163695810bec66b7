/* gRPC control plane over the gRPC C core: a server with per-call state machines on one
 * completion queue, and an asynchronous client, both carrying opaque message bytes (the
 * protobuf-c messages of pd.proto are packed and unpacked by their callers).
 *
 * Design: each side runs one completion-queue thread. The server accepts calls for registered
 * methods (unary or server-streaming), receives the request and hands it to the method's handler
 * on that thread; the handler must not block: it answers at once or later from any thread
 * (typically an engine thread), with pd_rpc_reply / pd_rpc_fail for unary calls or
 * pd_rpc_stream_send ... pd_rpc_stream_end for streams. Stream messages are queued per call and
 * sent one at a time (gRPC allows one send in flight per call). A call the client cancels, or
 * whose deadline passes, runs the handler's cancel callback once; the handler still ends it.
 * The client runs every call with a deadline and delivers results through callbacks on its
 * thread; pd_rpc_unary is the synchronous form. Message size limits are explicit: a message over
 * max_message_bytes is refused by gRPC with RESOURCE_EXHAUSTED.
 */
#ifndef PD_RPC_RPC_H
#define PD_RPC_RPC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* gRPC status codes used in replies (numbering as in grpc/status.h). */
enum {
    PD_RPC_OK = 0,
    PD_RPC_CANCELLED = 1,
    PD_RPC_INVALID_ARGUMENT = 3,
    PD_RPC_DEADLINE_EXCEEDED = 4,
    PD_RPC_NOT_FOUND = 5,
    PD_RPC_ALREADY_EXISTS = 6,
    PD_RPC_RESOURCE_EXHAUSTED = 8,
    PD_RPC_FAILED_PRECONDITION = 9,
    PD_RPC_ABORTED = 10,
    PD_RPC_UNIMPLEMENTED = 12,
    PD_RPC_INTERNAL = 13,
    PD_RPC_UNAVAILABLE = 14,
};

/* Name of a gRPC status ("UNAVAILABLE"). */
const char *pd_rpc_status_name(int grpc_status);

/* ---- server -------------------------------------------------------------------------------- */

typedef struct pd_rpc_server pd_rpc_server;
typedef struct pd_rpc_call pd_rpc_call;

typedef enum { PD_RPC_UNARY = 0, PD_RPC_SERVER_STREAM = 1 } pd_rpc_kind;

/* Called on the server thread with the request bytes (valid during the call only). */
typedef void (*pd_rpc_handler)(void *ctx, pd_rpc_call *call, const uint8_t *req, size_t len);

typedef struct {
    const char *method; /* full name, e.g. "/pd.PD/Info" */
    pd_rpc_kind kind;
    pd_rpc_handler handler;
    void *ctx;
} pd_rpc_method;

typedef struct {
    const char *addr;         /* "127.0.0.1:0" (ephemeral), "10.0.0.5:8088" */
    size_t max_message_bytes; /* 64 MiB: received and sent */
    int concurrent_accepts;   /* calls that can be accepted at once (8) */
} pd_rpc_server_params;

pd_rpc_server_params pd_rpc_server_default_params(void);

/* methods[] (and the strings in it) must outlive the server. PD_EIO naming the address when it
 * cannot bind. */
int pd_rpc_server_start(const pd_rpc_server_params *p, const pd_rpc_method *methods,
                        size_t n_methods, pd_rpc_server **out);
int pd_rpc_server_port(const pd_rpc_server *s);
/* Stops accepting, cancels calls in flight (their cancel callbacks run), waits up to
 * grace_ms for handlers to end their calls, then frees everything. */
void pd_rpc_server_stop(pd_rpc_server *s, int grace_ms);

/* Unary: reply bytes + OK, or a failure status with details. Each ends the call. Any thread. */
int pd_rpc_reply(pd_rpc_call *call, const void *msg, size_t len);
int pd_rpc_fail(pd_rpc_call *call, int grpc_status, const char *details);
/* Server streaming: queue one message (copied); PD_ECANCELLED once the client is gone. */
int pd_rpc_stream_send(pd_rpc_call *call, const void *msg, size_t len);
/* Ends a stream after its queued messages, with a status. Ends the call. */
int pd_rpc_stream_end(pd_rpc_call *call, int grpc_status, const char *details);
/* Runs once (on the server thread) when the client cancels or the deadline passes before the
 * call has ended; never after the handler ended it. The call is valid during cb. Set it in the
 * handler, before handing the call to another thread. */
typedef void (*pd_rpc_cancel_fn)(void *arg, pd_rpc_call *call);
void pd_rpc_on_cancel(pd_rpc_call *call, pd_rpc_cancel_fn cb, void *arg);
int pd_rpc_cancelled(pd_rpc_call *call);
/* A handler that goes on with the call on another thread after it returns holds it first (in
 * the handler): the call stays valid, though ended from yet another thread, until the release
 * (its last use). Each hold has one release. */
void pd_rpc_call_hold(pd_rpc_call *call);
void pd_rpc_call_release(pd_rpc_call *call);
/* The client's deadline as pd_now_ns() time (INT64_MAX when none). */
int64_t pd_rpc_deadline_ns(const pd_rpc_call *call);
/* The method name of the call. */
const char *pd_rpc_method_name(const pd_rpc_call *call);

/* ---- client -------------------------------------------------------------------------------- */

typedef struct pd_rpc_client pd_rpc_client;   /* a completion-queue thread; many channels */
typedef struct pd_rpc_channel pd_rpc_channel; /* one target "host:port" */

int pd_rpc_client_create(pd_rpc_client **out);
/* Batching hook: fn(arg) runs on the client thread after a burst of callbacks, when no further
 * completion is ready at once (or after every 64 callbacks of a longer burst), so a consumer can
 * wake its own thread once per burst instead of once per message. Set before any call starts. */
void pd_rpc_client_set_idle_hook(pd_rpc_client *c, void (*fn)(void *arg), void *arg);
/* True on the client thread of any pd_rpc_client (inside callbacks and the idle hook). */
bool pd_rpc_on_client_thread(void);
/* Cancels every call in flight (their callbacks run with CANCELLED), joins the thread, frees.
 * Channels must be destroyed first. */
void pd_rpc_client_free(pd_rpc_client *c);

/* max_message_bytes: largest message received or sent (0 = 64 MiB). While the target cannot be
 * reached the channel tries again about once a second (gRPC's reconnect backoff capped at 1 s,
 * not its default 120 s), so a peer restarted after a long outage answers within about a
 * second of listening again. */
int pd_rpc_channel_create(pd_rpc_client *c, const char *target, size_t max_message_bytes,
                          pd_rpc_channel **out);
/* Calls started on the channel keep running; the channel is released when they end. */
void pd_rpc_channel_free(pd_rpc_channel *ch);

/* Final outcome of a call: grpc_status PD_RPC_OK or another code, with details. For unary calls
 * resp/len hold the reply (valid during the callback). Runs on the client thread. */
typedef void (*pd_rpc_done_fn)(void *arg, int grpc_status, const char *details, const uint8_t *resp,
                               size_t len);
/* One message of a server stream (valid during the callback). Runs on the client thread. */
typedef void (*pd_rpc_msg_fn)(void *arg, const uint8_t *msg, size_t len);

/* timeout_ms of a call that ends only when it is cancelled, when its peer ends it or when the
 * connection fails: for a stream whose life has no bound known in advance (a generation), where
 * the caller watches the peer's liveness otherwise (the scheduler's heartbeat). */
#define PD_RPC_NO_DEADLINE (-1)

/* Starts a unary call; done runs exactly once (also on failure to start: then from this
 * thread, and the return value is negative). *id (may be NULL) names the call for
 * pd_rpc_cancel. timeout_ms > 0, or PD_RPC_NO_DEADLINE: any other value is refused. */
int pd_rpc_unary_async(pd_rpc_channel *ch, const char *method, const void *req, size_t len,
                       int timeout_ms, pd_rpc_done_fn done, void *arg, uint64_t *id);
/* Starts a server-streaming call: on_msg for each message in order, then done exactly once. */
int pd_rpc_stream_async(pd_rpc_channel *ch, const char *method, const void *req, size_t len,
                        int timeout_ms, pd_rpc_msg_fn on_msg, pd_rpc_done_fn done, void *arg,
                        uint64_t *id);
/* Cancels call id if it is still in flight (done then runs with CANCELLED); a no-op for a call
 * that has ended. Any thread. */
void pd_rpc_cancel(pd_rpc_client *c, uint64_t id);
/* Flow control of a server stream: while paused, no further message is read, so HTTP/2 flow
 * control holds the server's sends back (its unsent messages wait on its side). Resuming reads
 * on. A no-op for a call that has ended. Any thread. */
void pd_rpc_stream_pause(pd_rpc_client *c, uint64_t id, bool paused);
/* Calls in flight on this client. */
int pd_rpc_client_inflight(pd_rpc_client *c);

/* Synchronous unary call. Returns PD_OK with *resp (malloc'd, caller frees) or a status:
 * PD_ETIMEOUT for DEADLINE_EXCEEDED, PD_ECLOSED for UNAVAILABLE, PD_EINTERNAL otherwise, with a
 * message "METHOD: STATUS_NAME: details". *grpc_status (may be NULL) gets the gRPC code. */
int pd_rpc_unary(pd_rpc_channel *ch, const char *method, const void *req, size_t len,
                 int timeout_ms, uint8_t **resp, size_t *resp_len, int *grpc_status);

#endif
