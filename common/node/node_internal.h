/* Internals of a prefill or decode instance (node.h), shared by its three files:
 *   node.c          the shared core: the request table, the gRPC methods every node serves
 *                   (Info, Stats, Abort), the dispatcher of engine events, the lifetime
 *   node_prefill.c  the prefill half: Prefill, the transfer workers that send the KV
 *   node_decode.c   the decode half: Reserve, Decode, the Relay streams and their flow
 *                   control, the reaper of expired reservations
 * Not for use outside common/node/.
 */
#ifndef PD_NODE_NODE_INTERNAL_H
#define PD_NODE_NODE_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/engine.h"
#include "node/node.h"
#include "rpc/pd_msg.h"
#include "rpc/rpc.h"
#include "transfer/kv_route.h"
#include "transfer/kv_tcp.h"
#include "util/idmap.h"
#include "util/arena.h"

#define REQ_BUCKETS  4096 /* of the request map */
#define RELAY_ID_MAX 64   /* bytes of a Relay stream id, NUL included */

typedef struct {
    ProtobufCBinaryData *v;
    size_t n, cap;
} ev_list;

/* A scheduler's Relay stream (pd.proto): the events of every request whose Decode named it go
 * out in one RelayBatch per dispatcher round instead of one message per token on each Decode
 * stream. Listed in n->relays under n->mu; freed when its caller cancels it. */
typedef struct relay {
    struct relay *next;
    char id[RELAY_ID_MAX];
    pd_rpc_call *call;
    ev_list batch; /* this round's events */
} relay;

/* One request this node holds state for. Lives in the table under n->mu. */
/* The request of a map link. */
#define REQ_OF(l) PD_IDMAP_ENTRY(l, req, link)

typedef struct req {
    pd_idmap_link link; /* in pd_node.reqs, keyed by id */
    char id[PD_ENGINE_MAX_REQUEST_ID + 1];
    pd_rpc_call *call; /* prefill: the Prefill call; decode: the Decode stream once opened */
    pd_arena *arena;
    int64_t t_received;
    /* prefill */
    Pd__DecodeTarget *targets; /* (n_targets) copied */
    size_t n_targets;
    int32_t *dst_blocks; /* (n_dst_blocks) */
    size_t n_dst_blocks;
    size_t n_prompt;    /* tokens of the prompt */
    size_t skip_blocks; /* leading blocks the decode side holds already (decode_cached_tokens) */
    int lease_ms;
    /* decode */
    int64_t deadline_ns; /* reservation TTL */
    int32_t *blocks;
    size_t n_blocks;
    int kv_ranks_done;
    bool decoding, first_seen;
    bool local; /* decode: reserved for a Decode with local_prefill (no blocks, no KV) */
    relay *rl;  /* decode: its events go to this Relay stream (NULL: to its own call) */
    char reserved_by[RELAY_ID_MAX]; /* decode: the Reserve's relay_id ("" none): a reservation
                                       no Decode has taken goes when that relay closes */
    ev_list held;       /* relayed: events waiting (paused or out of credit), in order */
    bool paused;        /* relayed: the caller's client reads slowly (Pause) */
    uint64_t pause_seq; /* the newest Pause applied */
    uint64_t credit;    /* relayed: packed event bytes it may send in all (0: no limit) */
    uint64_t sent;      /* relayed: packed event bytes sent so far */
    int finals;         /* decode: final events still to come (a beam search's n, else 1) */
    bool finished;      /* relayed: the engine's last final event came (it may still be held) */
    bool done;          /* relayed: the final event is out; the Decode call waits for the
                           caller's cancel (so the caller ends it after that event) */
    bool caller_gone;   /* decode: its call was cancelled before its final event */
    int64_t done_ns;
    bool handed_over;   /* prefill: a transfer worker owns the request now */
    atomic_bool cancel; /* prefill: aborted while its KV is being sent; the send gives up */
} req;

/* A finished prefill waiting for its KV hand-over. */
typedef struct job {
    struct job *next;
    req *r;
    Pd__TokenEvent *first; /* in r->arena */
    int32_t *src_blocks;   /* (n_src_blocks) in r->arena */
    size_t n_src_blocks;
    uint64_t seed;
    int64_t cached_tokens; /* of the prompt, from the prefix cache */
    bool needs_transfer;
} job;

struct pd_node {
    pd_node_params p;
    rt_global *g;
    rt_local *l;
    rt_role role;
    size_t index;
    const rt_instance *inst;
    int tp, pp, n_ranks; /* rank r: tensor-parallel rank r % tp of pipeline stage r / tp */
    pd_engine *e;
    const pd_model_config *cfg;
    pd_kv_params kvp; /* a rank's pool, but n_layers: the model's (pd_engine_rank_kv: a rank's) */
    pd_rpc_server *srv;
    pd_rpc_method methods[8];
    pthread_mutex_t mu; /* the request table, job queue, counters */
    pthread_cond_t cv;
    pthread_mutex_t wake_mu; /* engine -> dispatcher wakeups; never held with mu */
    pthread_cond_t wake_cv;
    pd_idmap reqs; /* req by id (reqs.count: requests in progress) */
    bool wake;
    atomic_bool stopping, draining, shutdown;
    bool threads_started, reaper_started;
    pthread_t dispatcher, reaper;
    /* prefill */
    pd_kv_route *route;    /* which transport carries each KV send (--kv-transport) */
    char kv_transport[16]; /* the transport of the latest transfer ("": none yet; under mu) */
    job *jobs_head, *jobs_tail;
    pthread_t *workers;
    int n_workers;
    /* decode */
    pd_kv_tcp_receiver **rx;
    uint64_t epoch; /* random per process (Info, Stats): tells a restart on the same port */
    double load_s, warmup_s; /* start-up (Info): engine creation, its warm-up */
    size_t warmup_tokens;
    relay *relays;                                     /* open Relay streams (under mu) */
    int64_t relay_batches, relay_events, relay_pauses; /* cumulative (under mu) */
    int n_deferred;    /* calls handled on a thread of their own (node_defer_guided; under mu) */
    bool defer_closed; /* pd_node_free began: no more deferrals (under mu) */
    /* counters (under mu) */
    int64_t kv_bytes, leases;
    double kv_seconds;
};

/* ---- the core (node.c) ---- */

/* The request table. Called with n->mu held. node_req_add: NULL with PD_EEXIST / PD_ENOMEM
 * set; node_req_remove unlinks and frees (and wakes a drain waiting on the table). */
req *node_req_find(pd_node *n, const char *id);

/* Structured output: an RPC handler must not block, and compiling a request's grammar may take
 * long (seconds for some schemas). When m asks for a grammar the engine has not compiled yet,
 * the call is taken off the RPC thread: a thread of its own compiles it, then runs fn(n, call,
 * b, len) again (where it no longer defers). Returns true when it took the call (the caller
 * returns at once and frees what it unpacked); false: handle it now. */
bool node_defer_guided(pd_node *n, pd_rpc_call *call, const Pd__SamplingParams *m,
                       void (*fn)(void *ctx, pd_rpc_call *call, const uint8_t *b, size_t len),
                       const uint8_t *b, size_t len);
req *node_req_add(pd_node *n, const char *id);
void node_req_remove(pd_node *n, req *r);

/* Packed events: room for `more`; push takes buf (malloc'd, len bytes; freed on PD_ENOMEM);
 * clear frees the events and keeps the array; free frees both. */
int node_ev_list_grow(ev_list *l, size_t more);
int node_ev_list_push(ev_list *l, uint8_t *buf, size_t len);
void node_ev_list_clear(ev_list *l);
void node_ev_list_free(ev_list *l);

/* pd_rpc_reply of m: PD_ECANCELLED when the caller was already gone. */
int node_reply(pd_rpc_call *call, const ProtobufCMessage *m);
/* gRPC status for an engine/library status. */
int node_rpc_status(int st);
/* Engine event -> TokenEvent allocated in a (NULL: out of memory). */
Pd__TokenEvent *node_event_to_proto(const pd_engine_event *ev, pd_arena *a);
bool node_valid_request_id(const char *id);
/* pd_rpc_on_cancel callback of a Prefill or Decode call: aborts its request. */
void node_on_call_cancelled(void *arg, pd_rpc_call *call);

/* ---- the prefill half (node_prefill.c) ---- */

/* The route of --kv-transport and the transfer workers. */
int node_prefill_start(pd_node *n, bool on_cuda);
/* Joins the workers (n->stopping is set), frees the route. */
void node_prefill_stop(pd_node *n);
/* Its methods into m; returns how many. */
size_t node_prefill_methods(pd_node *n, pd_rpc_method *m);
/* Abort of id: stops the send of its KV when a transfer worker has it. Whether it did. */
bool node_prefill_abort(pd_node *n, const char *id);
/* Dispatcher: a prefill request's event. Called with n->mu held. */
void node_prefill_event(pd_node *n, req *r, const pd_engine_event *ev);

/* ---- the decode half (node_decode.c) ---- */

/* A KV receiver per rank, and the reaper. */
int node_decode_start(pd_node *n);
/* Joins the reaper (n->stopping is set), stops the receivers, frees the relays. */
void node_decode_stop(pd_node *n);
size_t node_decode_methods(pd_node *n, pd_rpc_method *m);
/* Abort of id: drops its reservation when no Decode has started on it. Whether it did. */
bool node_decode_abort(pd_node *n, const char *id);
/* Dispatcher: a decode request's event. Called with n->mu held. */
void node_decode_event(pd_node *n, req *r, const pd_engine_event *ev);
/* Dispatcher: one RelayBatch per relay for the events of this round. */
void node_relays_flush(pd_node *n);

#endif
