/* pd-prefill / pd-decode runtime (see node.h). */
#include "node/node.h"

#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/engine.h"
#include "pd_config.h"
#if PD_HAVE_CUDA
#include "backend/cuda/cuda_info.h"
#endif
#include "rpc/pd_msg.h"
#include "rpc/rpc.h"
#include "transfer/kv_tcp.h"
#include "util/clock.h"
#include "util/log.h"
#include "util/signals.h"
#include "util/status.h"

#define REQ_BUCKETS            4096
#define REAPER_PERIOD_MS       100
#define DEFAULT_RESERVE_TTL_MS 30000
#define RELAY_ID_MAX           64 /* bytes of a Relay stream id, NUL included */
#define RELAY_DONE_TTL_MS                                                                          \
    30000 /* a relayed request's Decode stream waits this long at most                             \
             for its caller's cancel after the final event */

/* Packed TokenEvents waiting to go out in a RelayBatch (each .data malloc'd, owned here). */
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
typedef struct req {
    struct req *next;
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
    relay *rl; /* decode: its events go to this Relay stream (NULL: to its own call) */
    char reserved_by[RELAY_ID_MAX]; /* decode: the Reserve's relay_id ("" none): a reservation
                                       no Decode has taken goes when that relay closes */
    ev_list held;       /* relayed: events waiting (paused or out of credit), in order */
    bool paused;        /* relayed: the caller's client reads slowly (Pause) */
    uint64_t pause_seq; /* the newest Pause applied */
    uint64_t credit;    /* relayed: packed event bytes it may send in all (0: no limit) */
    uint64_t sent;      /* relayed: packed event bytes sent so far */
    bool finished;      /* relayed: the engine's final event came (it may still be held) */
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
    int tp;
    pd_engine *e;
    const pd_model_config *cfg;
    pd_kv_params kvp; /* per rank */
    pd_rpc_server *srv;
    pd_rpc_method methods[8];
    pthread_mutex_t mu; /* the request table, job queue, counters */
    pthread_cond_t cv;
    pthread_mutex_t wake_mu; /* engine -> dispatcher wakeups; never held with mu */
    pthread_cond_t wake_cv;
    req *table[REQ_BUCKETS];
    size_t n_reqs;
    bool wake;
    atomic_bool stopping, draining, shutdown;
    bool threads_started, reaper_started;
    pthread_t dispatcher, reaper;
    /* prefill */
    pd_kv_tcp_sender *tx;
    pd_kv_share *shares;  /* (tp) the ranks' pools for CUDA IPC; NULL: KV moves over TCP */
    bool ipc_fallback;    /* --kv-transport auto: a destination that refuses IPC gets TCP */
    char no_ipc[32][300]; /* "host:port" of decode ranks that refused IPC (under mu) */
    int n_no_ipc;
    bool nccl;             /* KV over NCCL links (--kv-transport nccl, or auto on CUDA) */
    char no_nccl[32][300]; /* "host:port" of decode ranks that refused NCCL (under mu) */
    int n_no_nccl;
    job *jobs_head, *jobs_tail;
    pthread_t *workers;
    int n_workers;
    /* decode */
    pd_kv_tcp_receiver **rx;
    uint64_t epoch; /* random per process (Info, Stats): tells a restart on the same port */
    relay *relays;  /* open Relay streams (under mu) */
    int64_t relay_batches, relay_events, relay_pauses; /* cumulative (under mu) */
    /* counters (under mu) */
    int64_t kv_bytes, leases;
    double kv_seconds;
};

static const char *role_str(rt_role r)
{
    return rt_role_name(r);
}

/* ---- request table --------------------------------------------------------------------------- */

static size_t bucket(const char *id)
{
    uint32_t h = 2166136261u;
    for (; *id; id++) h = (h ^ (uint8_t)*id) * 16777619u;
    return h % REQ_BUCKETS;
}

static req *table_find(pd_node *n, const char *id)
{
    for (req *r = n->table[bucket(id)]; r; r = r->next)
        if (strcmp(r->id, id) == 0) return r;
    return NULL;
}

static req *table_find_call(pd_node *n, const pd_rpc_call *call)
{
    for (size_t b = 0; b < REQ_BUCKETS; b++)
        for (req *r = n->table[b]; r; r = r->next)
            if (r->call == call) return r;
    return NULL;
}

/* Creates and inserts; NULL with PD_EEXIST / PD_ENOMEM set. Called with n->mu held. */
static req *table_add(pd_node *n, const char *id)
{
    if (table_find(n, id)) {
        pd_error(PD_EEXIST, "request %s is already in progress here", id);
        return NULL;
    }
    req *r = calloc(1, sizeof *r);
    pd_arena *a = pd_arena_create(4096);
    if (!r || !a) {
        free(r);
        pd_arena_destroy(a);
        pd_error(PD_ENOMEM, "out of memory");
        return NULL;
    }
    snprintf(r->id, sizeof r->id, "%s", id);
    r->arena = a;
    r->t_received = pd_now_ns();
    size_t b = bucket(id);
    r->next = n->table[b];
    n->table[b] = r;
    n->n_reqs++;
    return r;
}

/* ---- relayed events ------------------------------------------------------------------------ */

/* Room for `more` events. */
static int ev_list_grow(ev_list *l, size_t more)
{
    if (l->n + more <= l->cap) return PD_OK;
    size_t cap = l->cap ? l->cap * 2 : 16;
    if (cap < l->n + more) cap = l->n + more;
    ProtobufCBinaryData *v = realloc(l->v, cap * sizeof *v);
    if (!v) return pd_error(PD_ENOMEM, "out of memory for relayed events");
    l->v = v, l->cap = cap;
    return PD_OK;
}

/* Takes buf (malloc'd, len bytes). PD_ENOMEM (buf freed) when the list cannot grow. */
static int ev_list_push(ev_list *l, uint8_t *buf, size_t len)
{
    if (ev_list_grow(l, 1) < 0) {
        free(buf);
        return PD_ENOMEM;
    }
    l->v[l->n++] = (ProtobufCBinaryData){.len = len, .data = buf};
    return PD_OK;
}

/* Frees the events; keeps the array for the next round. */
static void ev_list_clear(ev_list *l)
{
    for (size_t i = 0; i < l->n; i++) free(l->v[i].data);
    l->n = 0;
}

static void ev_list_free(ev_list *l)
{
    ev_list_clear(l);
    free(l->v);
    *l = (ev_list){0};
}

/* Sends rl's batch as one RelayBatch. A send that fails (the caller went away) is dropped: the
 * relay's cancel callback fails its requests. Called with n->mu held. */
static void relay_flush(pd_node *n, relay *rl)
{
    if (!rl->batch.n) return;
    n->relay_batches++;
    n->relay_events += (int64_t)rl->batch.n;
    Pd__RelayBatch m = PD__RELAY_BATCH__INIT;
    m.n_events = rl->batch.n;
    m.events = rl->batch.v;
    size_t len = 0;
    uint8_t *buf = pd_msg_pack(&m.base, &len);
    if (buf)
        pd_rpc_stream_send(rl->call, buf, len);
    else
        PD_WARN(NULL, "relay %s: out of memory packing %zu events; dropped", rl->id, rl->batch.n);
    free(buf);
    ev_list_clear(&rl->batch);
}

/* Unlinks and frees. Called with n->mu held. */
static void table_remove(pd_node *n, req *r)
{
    for (req **pp = &n->table[bucket(r->id)]; *pp; pp = &(*pp)->next)
        if (*pp == r) {
            *pp = r->next;
            n->n_reqs--;
            break;
        }
    pthread_cond_broadcast(&n->cv);
    ev_list_free(&r->held);
    pd_arena_destroy(r->arena);
    free(r);
}

/* ---- helpers ------------------------------------------------------------------------------- */

/* pd_rpc_reply of m: PD_ECANCELLED when the caller was already gone. */
static int reply_msg(pd_rpc_call *call, const ProtobufCMessage *m)
{
    size_t len = 0;
    uint8_t *buf = pd_msg_pack(m, &len);
    if (!buf) return pd_rpc_fail(call, PD_RPC_INTERNAL, "out of memory");
    int rc = pd_rpc_reply(call, buf, len);
    free(buf);
    return rc;
}

/* gRPC status for an engine/library status. */
static int rpc_status(int st)
{
    switch (st) {
    case PD_EINVAL:
    case PD_ERANGE:
    case PD_EPARSE: return PD_RPC_INVALID_ARGUMENT;
    case PD_EEXIST: return PD_RPC_ALREADY_EXISTS;
    case PD_ENOTFOUND: return PD_RPC_NOT_FOUND;
    case PD_EBUSY:
    case PD_ENOMEM: return PD_RPC_RESOURCE_EXHAUSTED;
    case PD_ETIMEOUT: return PD_RPC_DEADLINE_EXCEEDED;
    case PD_ECLOSED: return PD_RPC_UNAVAILABLE;
    case PD_ECANCELLED: return PD_RPC_CANCELLED;
    case PD_EUNSUPPORTED: return PD_RPC_FAILED_PRECONDITION;
    default: return PD_RPC_INTERNAL;
    }
}

/* Engine event -> TokenEvent allocated in a. */
static Pd__TokenEvent *event_to_proto(const pd_engine_event *ev, pd_arena *a)
{
    Pd__TokenEvent *m = pd_arena_calloc(a, 1, sizeof *m);
    if (!m) return NULL;
    pd__token_event__init(m);
    if (ev->n_tokens) {
        m->token_ids = pd_arena_alloc(a, ev->n_tokens * sizeof(int32_t), 0);
        if (!m->token_ids) return NULL;
        memcpy(m->token_ids, ev->token_ids, ev->n_tokens * sizeof(int32_t));
        m->n_token_ids = ev->n_tokens;
    }
    if (ev->text_len) {
        m->text.data = pd_arena_alloc(a, ev->text_len, 1);
        if (!m->text.data) return NULL;
        memcpy(m->text.data, ev->text, ev->text_len);
        m->text.len = ev->text_len;
    }
    m->final = ev->final;
    m->status = ev->status;
    m->error = pd_arena_strdup(a, ev->error ? ev->error : "");
    const char *fr = pd_finish_reason_name(ev->finish);
    m->finish_reason = pd_arena_strdup(a, fr ? fr : "");
    m->stop_kind = (int32_t)ev->stop_kind;
    m->stop_token = ev->stop_token;
    m->stop_string = pd_arena_strdup(a, ev->stop_string ? ev->stop_string : "");
    m->prompt_tokens = ev->prompt_tokens;
    m->completion_tokens = ev->completion_tokens;
    m->has_logprob = ev->has_logprob;
    m->logprob = ev->logprob;
    if (ev->n_top > 0) {
        Pd__TopLogprob *tl = pd_arena_calloc(a, (size_t)ev->n_top, sizeof *tl);
        Pd__TopLogprob **pp = pd_arena_calloc(a, (size_t)ev->n_top, sizeof *pp);
        if (!tl || !pp) return NULL;
        for (int32_t i = 0; i < ev->n_top; i++) {
            pd__top_logprob__init(&tl[i]);
            tl[i].id = ev->top_ids[i];
            tl[i].logprob = ev->top_logprobs[i];
            pp[i] = &tl[i];
        }
        m->top_logprobs = pp;
        m->n_top_logprobs = (size_t)ev->n_top;
    }
    if (!m->error || !m->finish_reason || !m->stop_string) return NULL;
    return m;
}

static bool valid_request_id(const char *id)
{
    size_t len = id ? strlen(id) : 0;
    return len > 0 && len <= PD_ENGINE_MAX_REQUEST_ID && len < PD_KV_REQUEST_ID_MAX;
}

/* Abort requested through gRPC cancellation (client gone, deadline). */
static void on_call_cancelled(void *arg, pd_rpc_call *call)
{
    pd_node *n = arg;
    char id[PD_ENGINE_MAX_REQUEST_ID + 1] = "";
    pthread_mutex_lock(&n->mu);
    req *r = table_find_call(n, call);
    if (r && r->finished) { /* relayed, after its final event (the caller's expected end), or
                               with events still waiting for a client that went away */
        pd_rpc_stream_end(call, PD_RPC_CANCELLED, "");
        table_remove(n, r);
        r = NULL;
    }
    if (r) {
        snprintf(id, sizeof id, "%s", r->id);
        r->caller_gone = true;
    }
    if (r && r->handed_over) atomic_store(&r->cancel, true); /* the transfer frees the KV */
    pthread_mutex_unlock(&n->mu);
    if (id[0]) {
        PD_INFO(id, "%s: call cancelled by the caller; aborting", pd_rpc_method_name(call));
        pd_engine_abort(n->e, id);
    }
}

/* ---- common methods -------------------------------------------------------------------------- */

static void h_info(void *ctx, pd_rpc_call *call, const uint8_t *b, size_t len)
{
    pd_node *n = ctx;
    (void)b, (void)len;
    pd_arena *a = pd_arena_create(4096);
    Pd__InfoReply m = PD__INFO_REPLY__INIT;
    m.role = (char *)role_str(n->role);
    m.instance_index = (int32_t)n->index;
    m.server_id = (char *)n->inst->server_id;
    m.server_ip = (char *)n->inst->server_ip;
    m.tp_size = n->tp;
    Pd__RankInfo *ri = pd_arena_calloc(a, (size_t)n->tp, sizeof *ri);
    Pd__RankInfo **rp = pd_arena_calloc(a, (size_t)n->tp, sizeof *rp);
    for (int r = 0; r < n->tp; r++) {
        pd__rank_info__init(&ri[r]);
        ri[r].rank = r;
        ri[r].device_id = n->inst->devices[r].ordinal;
        ri[r].device_ip = (char *)n->inst->devices[r].device_ip;
        ri[r].data_port = n->rx ? pd_kv_tcp_receiver_port(n->rx[r]) : 0;
        ri[r].kv_head0 = (int32_t)(n->kvp.n_kv_heads * (size_t)r);
        ri[r].kv_heads = (int32_t)n->kvp.n_kv_heads;
        rp[r] = &ri[r];
    }
    m.ranks = rp;
    m.n_ranks = (size_t)n->tp;
    m.model_name = (char *)n->p.served_model_name;
    m.max_model_len = (int64_t)pd_engine_max_model_len(n->e);
    m.block_size = (int32_t)pd_engine_block_size(n->e);
    m.vocab_size = (int64_t)pd_engine_vocab(n->e);
    m.num_layers = (int32_t)n->cfg->num_hidden_layers;
    m.num_kv_heads = (int32_t)n->cfg->num_key_value_heads;
    m.head_dim = (int32_t)n->cfg->head_dim;
    m.kv_dtype = (char *)pd_dtype_name(n->kvp.dtype);
    m.kv_transport = "tcp";
    m.version = PD_VERSION;
    m.max_num_seqs = (int32_t)n->p.max_num_seqs;
    m.instance_epoch = n->epoch;
    m.prefix_caching = n->p.enable_prefix_caching;
    reply_msg(call, &m.base);
    pd_arena_destroy(a);
}

static void h_stats(void *ctx, pd_rpc_call *call, const uint8_t *b, size_t len)
{
    pd_node *n = ctx;
    (void)b, (void)len;
    pd_engine_stats st;
    pd_engine_get_stats(n->e, &st);
    Pd__StatsReply m = PD__STATS_REPLY__INIT;
    m.num_running = (int64_t)st.num_running;
    m.num_waiting = (int64_t)st.num_waiting;
    m.num_held = (int64_t)st.num_held;
    m.kv_blocks_total = (int64_t)st.kv_blocks_total;
    m.kv_blocks_free = (int64_t)st.kv_blocks_free;
    m.num_preemptions = (int64_t)st.num_preemptions;
    m.queued_tokens = (int64_t)st.queued_tokens;
    m.prefix_cache_queries = (int64_t)st.prefix_cache_queries;
    m.prefix_cache_hits = (int64_t)st.prefix_cache_hits;
    m.prompt_tokens = (int64_t)st.prompt_tokens;
    m.generation_tokens = (int64_t)st.generation_tokens;
    m.requests_finished = (int64_t)st.requests_finished;
    pthread_mutex_lock(&n->mu);
    m.leases_held = n->leases;
    m.kv_transfer_bytes = n->kv_bytes;
    m.kv_transfer_seconds = n->kv_seconds;
    int64_t reserved = 0;
    if (n->role == RT_ROLE_DECODE)
        for (size_t b2 = 0; b2 < REQ_BUCKETS; b2++)
            for (req *r = n->table[b2]; r; r = r->next)
                if (!r->decoding) reserved += (int64_t)(r->n_blocks * st.block_size);
    m.reserved_tokens = reserved;
    /* the blocks in use less the reservations (which hold blocks too: counted once, there) */
    int64_t used = (int64_t)((st.kv_blocks_total - st.kv_blocks_free) * st.block_size);
    m.running_tokens = used > reserved ? used - reserved : 0;
    m.relay_batches = n->relay_batches;
    m.relay_events = n->relay_events;
    m.relay_pauses = n->relay_pauses;
    pthread_mutex_unlock(&n->mu);
    if (n->rx) {
        for (int r = 0; r < n->tp; r++) {
            pd_kv_rx_stats rs;
            pd_kv_rx_get_stats(n->rx[r], &rs);
            m.kv_transfer_bytes += (int64_t)rs.bytes;
        }
    }
    m.draining = atomic_load(&n->draining);
    m.instance_epoch = n->epoch;
    reply_msg(call, &m.base);
}

static void h_abort(void *ctx, pd_rpc_call *call, const uint8_t *b, size_t len)
{
    pd_node *n = ctx;
    Pd__AbortRequest *q = pd__abort_request__unpack(NULL, len, b);
    if (!q || !valid_request_id(q->request_id)) {
        if (q) pd__abort_request__free_unpacked(q, NULL);
        pd_rpc_fail(call, PD_RPC_INVALID_ARGUMENT, "Abort: malformed request");
        return;
    }
    Pd__AbortReply m = PD__ABORT_REPLY__INIT;
    m.found = pd_engine_abort(n->e, q->request_id) == PD_OK;
    if (n->tx) {
        pthread_mutex_lock(&n->mu);
        req *r = table_find(n, q->request_id);
        if (r && r->handed_over) { /* its KV is being sent: stop the send, which frees the KV */
            atomic_store(&r->cancel, true);
            m.found = true;
        }
        pthread_mutex_unlock(&n->mu);
    }
    if (n->rx) {
        pthread_mutex_lock(&n->mu);
        req *r = table_find(n, q->request_id);
        if (r && !r->decoding) { /* a reservation nobody decodes: drop it now */
            for (int k = 0; k < n->tp; k++) pd_kv_rx_cancel(n->rx[k], r->id);
            table_remove(n, r);
            m.found = true;
        }
        pthread_mutex_unlock(&n->mu);
    }
    PD_INFO(q->request_id, "abort requested (%s)", m.found ? "found" : "not found");
    pd__abort_request__free_unpacked(q, NULL);
    reply_msg(call, &m.base);
}

/* ---- prefill --------------------------------------------------------------------------------- */

static void h_prefill(void *ctx, pd_rpc_call *call, const uint8_t *b, size_t len)
{
    pd_node *n = ctx;
    if (atomic_load(&n->draining)) {
        pd_rpc_fail(call, PD_RPC_UNAVAILABLE, "the prefill instance is shutting down");
        return;
    }
    Pd__PrefillRequest *q = pd__prefill_request__unpack(NULL, len, b);
    if (!q || !valid_request_id(q->request_id) || q->n_prompt_ids == 0 || q->n_targets == 0) {
        if (q) pd__prefill_request__free_unpacked(q, NULL);
        pd_rpc_fail(call, PD_RPC_INVALID_ARGUMENT,
                    "Prefill: request_id, prompt_ids and targets are required");
        return;
    }
    size_t bs = pd_engine_block_size(n->e);
    size_t need = (q->n_prompt_ids + bs - 1) / bs;
    char bad[200] = "";
    if (q->n_decode_block_ids != need)
        snprintf(bad, sizeof bad, "Prefill: %zu decode blocks for %zu prompt tokens, expected %zu",
                 q->n_decode_block_ids, q->n_prompt_ids, need);
    else if (q->decode_cached_tokens < 0 || (size_t)q->decode_cached_tokens >= q->n_prompt_ids ||
             (size_t)q->decode_cached_tokens % bs)
        snprintf(bad, sizeof bad,
                 "Prefill: decode_cached_tokens %lld is not a multiple of the block size %zu "
                 "below the prompt's %zu tokens",
                 (long long)q->decode_cached_tokens, bs, q->n_prompt_ids);
    if (bad[0]) {
        pd__prefill_request__free_unpacked(q, NULL);
        pd_rpc_fail(call, PD_RPC_INVALID_ARGUMENT, bad);
        return;
    }
    pthread_mutex_lock(&n->mu);
    req *r = table_add(n, q->request_id);
    int rc = r ? PD_OK : PD_EEXIST;
    if (r) {
        r->call = call;
        r->lease_ms = q->lease_ms > 0 ? q->lease_ms : n->p.kv_lease_s * 1000;
        r->n_targets = q->n_targets;
        r->targets = pd_arena_calloc(r->arena, q->n_targets, sizeof *r->targets);
        r->n_dst_blocks = q->n_decode_block_ids;
        r->n_prompt = q->n_prompt_ids;
        r->skip_blocks = (size_t)q->decode_cached_tokens / bs;
        r->dst_blocks = pd_arena_alloc(r->arena, need * sizeof(int32_t), 0);
        for (size_t i = 0; r->targets && i < q->n_targets; i++) {
            r->targets[i] = *q->targets[i];
            r->targets[i].host = pd_arena_strdup(r->arena, q->targets[i]->host);
        }
        if (r->dst_blocks) memcpy(r->dst_blocks, q->decode_block_ids, need * sizeof(int32_t));
        pd_sampling_params sp;
        rc = pd_msg_sampling_from_proto(q->sampling, r->arena, &sp);
        if (rc == PD_OK && (!r->targets || !r->dst_blocks))
            rc = pd_error(PD_ENOMEM, "out of memory");
        if (rc == PD_OK) {
            pd_engine_request er = {.request_id = r->id,
                                    .prompt_ids = q->prompt_ids,
                                    .n_prompt = q->n_prompt_ids,
                                    .sampling = &sp,
                                    .phase = PD_PHASE_PREFILL_ONLY};
            rc = pd_engine_add(n->e, &er);
        }
        if (rc < 0) table_remove(n, r);
    }
    char msg[512];
    snprintf(msg, sizeof msg, "%s", pd_last_error());
    pthread_mutex_unlock(&n->mu);
    if (rc < 0) {
        PD_WARN(q->request_id, "Prefill refused: %s", msg);
        pd_rpc_fail(call, rpc_status(rc), msg);
    } else {
        pd_rpc_on_cancel(call, on_call_cancelled, n);
        PD_DEBUG(q->request_id, "prefill admitted: %zu prompt tokens", q->n_prompt_ids);
    }
    pd__prefill_request__free_unpacked(q, NULL);
}

/* Whether addr ("host:port") is in list (32 entries, *count used); remember = add it. */
static bool addr_listed(pd_node *n, char (*list)[300], int *count, const char *addr, bool remember)
{
    pthread_mutex_lock(&n->mu);
    bool found = false;
    for (int i = 0; i < *count && !found; i++) found = strcmp(list[i], addr) == 0;
    if (!found && remember && *count < 32) snprintf(list[(*count)++], 300, "%s", addr);
    pthread_mutex_unlock(&n->mu);
    return found;
}

/* Whether addr ("host:port") has refused CUDA IPC before; remember = mark it so. */
static bool ipc_refused(pd_node *n, const char *addr, bool remember)
{
    return addr_listed(n, n->no_ipc, &n->n_no_ipc, addr, remember);
}

/* The same for NCCL links. */
static bool nccl_refused(pd_node *n, const char *addr, bool remember)
{
    return addr_listed(n, n->no_nccl, &n->n_no_nccl, addr, remember);
}

/* Sends the held KV of j to every decode rank; returns a status. */
static int transfer_kv(pd_node *n, job *j, int64_t *bytes, double *seconds)
{
    req *r = j->r;
    size_t p_heads = n->kvp.n_kv_heads;
    for (size_t t = 0; t < r->n_targets; t++) {
        const Pd__DecodeTarget *dt = &r->targets[t];
        char addr[300];
        snprintf(addr, sizeof addr, "%s:%d", dt->host, dt->port);
        for (int rank = 0; rank < n->tp; rank++) {
            size_t h0, nh;
            pd_kv_head_overlap(p_heads * (size_t)rank, p_heads, (size_t)dt->kv_head0,
                               (size_t)dt->kv_heads, &h0, &nh);
            if (nh == 0) continue;
            pd_kv_send_req sr = {.request_id = r->id,
                                 .host = dt->host,
                                 .port = dt->port,
                                 .backend = pd_engine_backend(n->e, rank),
                                 .kv = pd_engine_kv(n->e, rank),
                                 .kv_params = n->kvp,
                                 .src_head0 = p_heads * (size_t)rank,
                                 /* the blocks the decode side lacks */
                                 .block_ids = j->src_blocks + r->skip_blocks,
                                 .n_blocks = j->n_src_blocks - r->skip_blocks,
                                 .n_tokens = r->n_prompt - r->skip_blocks * n->kvp.block_size,
                                 .head0 = h0,
                                 .n_heads = nh,
                                 .timeout_ms = r->lease_ms,
                                 .cancel = &r->cancel};
            /* auto: CUDA IPC, else NCCL, else TCP, per decode rank (what it accepted before) */
            bool use_nccl = n->nccl && !(n->ipc_fallback && nccl_refused(n, addr, false));
            /* auto leaves NCCL to processes on GPUs of their own */
            sr.nccl_distinct_gpus = n->ipc_fallback;
            if (n->shares && !(n->ipc_fallback && ipc_refused(n, addr, false)))
                sr.share = &n->shares[rank];
            else
                sr.nccl = use_nccl;
            pd_kv_send_stats st;
            int rc = pd_kv_tcp_send(n->tx, &sr, &st);
            if (rc == PD_EUNSUPPORTED && sr.share && n->ipc_fallback) {
                PD_INFO(r->id, "%s; KV to %s moves over %s from now on", pd_last_error(), addr,
                        use_nccl ? "NCCL (TCP where it fails)" : "TCP");
                ipc_refused(n, addr, true);
                sr.share = NULL;
                sr.nccl = use_nccl;
                rc = pd_kv_tcp_send(n->tx, &sr, &st);
            }
            /* auto: a decode rank that refused NCCL, or whose link could not be made (no request
             * frame went out), gets TCP */
            if (rc < 0 && rc != PD_ECANCELLED && sr.nccl && n->ipc_fallback &&
                (rc == PD_EUNSUPPORTED || st.frames == 0)) {
                PD_INFO(r->id, "%s; KV to %s moves over TCP from now on", pd_last_error(), addr);
                nccl_refused(n, addr, true);
                sr.nccl = 0;
                rc = pd_kv_tcp_send(n->tx, &sr, &st);
            }
            *bytes += (int64_t)st.bytes;
            *seconds += st.seconds;
            if (rc < 0)
                return pd_error_prefix(rc, "KV transfer to %s (rank %d -> %zu)", addr, rank, t);
        }
    }
    return PD_OK;
}

static void *transfer_worker(void *arg)
{
    pd_node *n = arg;
    for (;;) {
        pthread_mutex_lock(&n->mu);
        while (!n->jobs_head && !n->stopping) pthread_cond_wait(&n->cv, &n->mu);
        job *j = n->jobs_head;
        if (j) {
            n->jobs_head = j->next;
            if (!n->jobs_head) n->jobs_tail = NULL;
        }
        pthread_mutex_unlock(&n->mu);
        if (!j) return NULL; /* stopping and nothing left */
        req *r = j->r;
        int64_t bytes = 0;
        double seconds = 0;
        int rc = j->needs_transfer ? transfer_kv(n, j, &bytes, &seconds) : PD_OK;
        char msg[512];
        snprintf(msg, sizeof msg, "%s", pd_last_error());
        pd_engine_release(n->e, r->id);
        pthread_mutex_lock(&n->mu);
        n->leases--;
        n->kv_bytes += bytes;
        n->kv_seconds += seconds;
        pthread_mutex_unlock(&n->mu);
        if (rc < 0) {
            PD_WARN(r->id, "%s; KV released", msg);
            pd_rpc_fail(r->call,
                        rpc_status(rc) == PD_RPC_INTERNAL ? PD_RPC_UNAVAILABLE : rpc_status(rc),
                        msg);
        } else {
            Pd__PrefillReply m = PD__PREFILL_REPLY__INIT;
            m.first = j->first;
            m.seed = j->seed;
            m.cached_tokens = j->cached_tokens;
            m.kv_bytes = bytes;
            m.kv_seconds = seconds;
            m.prefill_seconds = (double)(pd_now_ns() - r->t_received) / 1e9 - seconds;
            PD_DEBUG(r->id, "prefill done: %lld KV bytes in %.3f s", (long long)bytes, seconds);
            reply_msg(r->call, &m.base);
        }
        pthread_mutex_lock(&n->mu);
        table_remove(n, r); /* frees j too: it lives in r->arena */
        pthread_mutex_unlock(&n->mu);
    }
}

/* Dispatcher: a prefill request's event. Called with n->mu held. */
static void prefill_event(pd_node *n, req *r, const pd_engine_event *ev)
{
    /* PREFILL_ONLY emits one final event; anything after it (an abort racing the hand-over)
     * is the transfer worker's business, which ends the call and frees the request */
    if (!ev->final || r->handed_over) return;
    if (ev->status < 0 || !ev->held) {
        int st = ev->status == PD_ECANCELLED ? PD_RPC_CANCELLED : rpc_status(ev->status);
        pd_rpc_fail(r->call, st, ev->error && ev->error[0] ? ev->error : "prefill failed");
        if (ev->held) pd_engine_release(n->e, r->id);
        table_remove(n, r);
        return;
    }
    job *j = pd_arena_calloc(r->arena, 1, sizeof *j);
    Pd__TokenEvent *first = event_to_proto(ev, r->arena);
    int32_t *blocks = pd_arena_alloc(r->arena, ev->n_blocks * sizeof(int32_t), 0);
    if (!j || !first || !blocks) {
        pd_rpc_fail(r->call, PD_RPC_INTERNAL, "out of memory");
        pd_engine_release(n->e, r->id);
        table_remove(n, r);
        return;
    }
    if (ev->n_blocks != r->n_dst_blocks) {
        char msg[160];
        snprintf(msg, sizeof msg, "prefill holds %zu blocks, the decode side reserved %zu",
                 ev->n_blocks, r->n_dst_blocks);
        pd_rpc_fail(r->call, PD_RPC_INTERNAL, msg);
        pd_engine_release(n->e, r->id);
        table_remove(n, r);
        return;
    }
    memcpy(blocks, ev->block_ids, ev->n_blocks * sizeof(int32_t));
    /* the engine's PREFILL_ONLY event is final for this node; for the request it is final only
     * when the first token already finished it */
    first->final = ev->finish != PD_FINISH_NONE;
    j->r = r;
    j->first = first;
    j->src_blocks = blocks;
    j->n_src_blocks = ev->n_blocks;
    j->seed = ev->seed;
    j->cached_tokens = (int64_t)ev->cached_tokens;
    /* a first token that already ends the request needs no decode side */
    j->needs_transfer = ev->finish == PD_FINISH_NONE;
    n->leases++;
    r->handed_over = true;
    if (n->jobs_tail)
        n->jobs_tail->next = j;
    else
        n->jobs_head = j;
    n->jobs_tail = j;
    pthread_cond_broadcast(&n->cv);
}

/* ---- decode ---------------------------------------------------------------------------------- */

static void on_kv_imported(void *arg, const char *id, int status)
{
    pd_node *n = arg;
    pthread_mutex_lock(&n->mu);
    req *r = table_find(n, id);
    if (r && status == PD_OK) r->kv_ranks_done++;
    pthread_mutex_unlock(&n->mu);
    PD_DEBUG(id, "KV imported on one rank (status %d)", status);
}

/* Frees reservation r (no Decode has started on it): its expected transfers, its blocks, its
 * entry. Called with n->mu held. */
static void drop_reservation(pd_node *n, req *r)
{
    for (int k = 0; k < n->tp; k++) pd_kv_rx_cancel(n->rx[k], r->id);
    pd_engine_abort(n->e, r->id);
    table_remove(n, r);
}

static void h_reserve(void *ctx, pd_rpc_call *call, const uint8_t *b, size_t len)
{
    pd_node *n = ctx;
    if (atomic_load(&n->draining)) {
        pd_rpc_fail(call, PD_RPC_UNAVAILABLE, "the decode instance is shutting down");
        return;
    }
    Pd__ReserveRequest *q = pd__reserve_request__unpack(NULL, len, b);
    if (!q || !valid_request_id(q->request_id) || q->num_prompt_tokens <= 0 ||
        (q->n_prompt_ids && q->n_prompt_ids != (size_t)q->num_prompt_tokens)) {
        if (q) pd__reserve_request__free_unpacked(q, NULL);
        pd_rpc_fail(call, PD_RPC_INVALID_ARGUMENT,
                    "Reserve: request_id and num_prompt_tokens > 0 are required, and prompt_ids "
                    "when given has num_prompt_tokens ids");
        return;
    }
    size_t bs = pd_engine_block_size(n->e), cap = (size_t)q->num_prompt_tokens / bs + 2;
    size_t cached = 0;
    pthread_mutex_lock(&n->mu);
    req *r = table_add(n, q->request_id);
    int rc = r ? PD_OK : PD_EEXIST;
    if (r) {
        r->blocks = pd_arena_alloc(r->arena, cap * sizeof(int32_t), 0);
        rc = r->blocks ? pd_engine_reserve(n->e, r->id, (size_t)q->num_prompt_tokens,
                                           q->n_prompt_ids ? q->prompt_ids : NULL, r->blocks, cap,
                                           &r->n_blocks, &cached)
                       : pd_error(PD_ENOMEM, "out of memory");
        /* the transfer brings the blocks after the cached ones */
        int k = 0;
        for (; rc == PD_OK && k < n->tp; k++)
            rc = pd_kv_rx_expect(n->rx[k], r->id, r->blocks + cached / bs,
                                 r->n_blocks - cached / bs, (size_t)q->num_prompt_tokens - cached);
        if (rc < 0) {
            char keep[512];
            snprintf(keep, sizeof keep, "%s", pd_last_error());
            while (k-- > 1) pd_kv_rx_cancel(n->rx[k - 1], r->id);
            pd_engine_abort(n->e, r->id);
            table_remove(n, r);
            pd_error(rc, "%s", keep);
        } else {
            int ttl = q->ttl_ms > 0 ? q->ttl_ms : DEFAULT_RESERVE_TTL_MS;
            r->deadline_ns = pd_now_ns() + (int64_t)ttl * PD_NS_PER_MS;
            snprintf(r->reserved_by, sizeof r->reserved_by, "%s", q->relay_id ? q->relay_id : "");
        }
    }
    char msg[512];
    snprintf(msg, sizeof msg, "%s", pd_last_error());
    Pd__ReserveReply m = PD__RESERVE_REPLY__INIT;
    if (rc == PD_OK) {
        m.block_ids = r->blocks;
        m.n_block_ids = r->n_blocks;
        m.cached_tokens = (int64_t)cached;
        /* packed under the lock: r cannot go away meanwhile. A caller that has gone (it gave up
           on this instance and reserved elsewhere) never learns the blocks: drop them */
        if (reply_msg(call, &m.base) == PD_ECANCELLED) {
            PD_INFO(r->id, "Reserve cancelled by its caller; blocks freed");
            drop_reservation(n, r);
        }
    }
    pthread_mutex_unlock(&n->mu);
    if (rc < 0) {
        PD_WARN(q->request_id, "Reserve refused: %s", msg);
        pd_rpc_fail(call, rpc_status(rc), msg);
    }
    pd__reserve_request__free_unpacked(q, NULL);
}

static void h_decode(void *ctx, pd_rpc_call *call, const uint8_t *b, size_t len)
{
    pd_node *n = ctx;
    Pd__DecodeRequest *q = pd__decode_request__unpack(NULL, len, b);
    if (!q || !valid_request_id(q->request_id) || q->n_prompt_ids == 0) {
        if (q) pd__decode_request__free_unpacked(q, NULL);
        pd_rpc_stream_end(call, PD_RPC_INVALID_ARGUMENT,
                          "Decode: request_id and prompt_ids are required");
        return;
    }
    int st = PD_RPC_OK;
    char msg[512] = "";
    pthread_mutex_lock(&n->mu);
    req *r = table_find(n, q->request_id);
    if (!r) {
        st = PD_RPC_NOT_FOUND;
        snprintf(msg, sizeof msg, "Decode %s: no reservation (expired or aborted)", q->request_id);
    } else if (r->decoding) {
        st = PD_RPC_ALREADY_EXISTS;
        snprintf(msg, sizeof msg, "Decode %s: already decoding", q->request_id);
    } else if (r->kv_ranks_done < n->tp) {
        st = PD_RPC_FAILED_PRECONDITION;
        snprintf(msg, sizeof msg, "Decode %s: KV not received yet (%d of %d ranks)", q->request_id,
                 r->kv_ranks_done, n->tp);
    } else {
        pd_sampling_params sp;
        int rc = pd_msg_sampling_from_proto(q->sampling, r->arena, &sp);
        if (rc == PD_OK) {
            pd_engine_request er = {.request_id = r->id,
                                    .prompt_ids = q->prompt_ids,
                                    .n_prompt = q->n_prompt_ids,
                                    .sampling = &sp,
                                    .phase = PD_PHASE_FULL};
            rc = pd_engine_add_imported(n->e, &er, q->first_token);
        }
        if (rc < 0) {
            st = rpc_status(rc);
            snprintf(msg, sizeof msg, "%s", pd_last_error());
            pd_engine_abort(n->e, r->id);
            table_remove(n, r);
        } else {
            r->call = call;
            r->decoding = true;
            /* a relay not (yet) open here: the events go on this call, which the caller reads */
            for (relay *rl = n->relays; q->relay_id && q->relay_id[0] && rl; rl = rl->next)
                if (strcmp(rl->id, q->relay_id) == 0) r->rl = rl;
            r->credit = q->relay_credit;
        }
    }
    pthread_mutex_unlock(&n->mu);
    if (st != PD_RPC_OK) {
        PD_WARN(q->request_id, "%s", msg);
        pd_rpc_stream_end(call, st, msg);
    } else {
        pd_rpc_on_cancel(call, on_call_cancelled, n);
    }
    pd__decode_request__free_unpacked(q, NULL);
}

/* Moves r's waiting events to its relay's batch while it is not paused and has credit; after
 * the final one the Decode call waits for the caller's cancel. Called with n->mu held. */
static void relay_release(req *r)
{
    size_t k = 0;
    uint64_t sent = r->sent;
    while (k < r->held.n && !r->paused && (!r->credit || sent < r->credit))
        sent += r->held.v[k++].len;
    if (!k || ev_list_grow(&r->rl->batch, k) < 0) return; /* no room: they wait for the next */
    memcpy(r->rl->batch.v + r->rl->batch.n, r->held.v, k * sizeof *r->held.v);
    r->rl->batch.n += k;
    r->sent = sent;
    r->held.n -= k;
    memmove(r->held.v, r->held.v + k, r->held.n * sizeof *r->held.v);
    if (!r->held.n && r->finished) {
        r->done = true;
        r->done_ns = pd_now_ns();
    }
}

/* Dispatcher: a relayed request's (non-failed) event joins its waiting events, which go out as
 * flow control allows. Called with n->mu held. */
static void relay_event(pd_node *n, req *r, const pd_engine_event *ev)
{
    pd_arena *a = pd_arena_create(1024);
    Pd__TokenEvent *m = a ? event_to_proto(ev, a) : NULL;
    size_t len = 0;
    uint8_t *buf = NULL;
    if (m) {
        m->request_id = r->id;
        buf = pd_msg_pack(&m->base, &len);
    }
    pd_arena_destroy(a);
    bool waiting = r->held.n > 0;
    int rc = buf ? ev_list_push(&r->held, buf, len) : PD_ENOMEM;
    if (rc < 0) {
        pd_rpc_stream_end(r->call, PD_RPC_INTERNAL, "out of memory relaying an event");
        if (!ev->final) pd_engine_abort(n->e, r->id);
        table_remove(n, r);
        return;
    }
    r->finished = ev->final;
    relay_release(r);
    n->relay_pauses += !waiting && r->held.n > 0;
}

/* Dispatcher: a decode request's event. Called with n->mu held. */
static void decode_event(pd_node *n, req *r, const pd_engine_event *ev)
{
    if (!r->call) { /* a reservation aborted before Decode: nothing to tell */
        if (ev->final) table_remove(n, r);
        return;
    }
    bool first = !r->first_seen;
    r->first_seen = true;
    /* the first token came to the scheduler from the prefill side already */
    if (first && !ev->final && ev->n_tokens) return;
    if (r->caller_gone) {
        /* cancelled: nobody reads its events, and its final one (the abort's, or the end of a
           generation the abort came too late for) ends the call now (relayed: not after the
           wait for a cancel that already came) */
        if (ev->final) {
            pd_rpc_stream_end(r->call, PD_RPC_CANCELLED, "");
            table_remove(n, r);
        }
        return;
    }
    if (r->rl && ev->status >= 0) {
        relay_event(n, r, ev);
        return;
    }
    if (ev->status < 0) {
        int st = ev->status == PD_ECANCELLED ? PD_RPC_CANCELLED : rpc_status(ev->status);
        pd_rpc_stream_end(r->call, st, ev->error && ev->error[0] ? ev->error : "decode failed");
        table_remove(n, r);
        return;
    }
    pd_arena *a = pd_arena_create(1024);
    Pd__TokenEvent *m = a ? event_to_proto(ev, a) : NULL;
    size_t len = 0;
    uint8_t *buf = m ? pd_msg_pack(&m->base, &len) : NULL;
    int rc = buf ? pd_rpc_stream_send(r->call, buf, len) : PD_ENOMEM;
    free(buf);
    pd_arena_destroy(a);
    if (rc == PD_ECANCELLED) {
        pd_engine_abort(n->e, r->id); /* the final cancelled event ends it */
        return;
    }
    if (ev->final || rc < 0) {
        pd_rpc_stream_end(r->call, rc < 0 ? PD_RPC_INTERNAL : PD_RPC_OK, "");
        if (!ev->final) pd_engine_abort(n->e, r->id);
        table_remove(n, r);
    }
}

/* The caller of a Relay stream went away (or the node stops): its requests that still wait for
 * events fail, since what was queued for them is lost; the stream ends. */
static void on_relay_cancelled(void *arg, pd_rpc_call *call)
{
    pd_node *n = arg;
    pthread_mutex_lock(&n->mu);
    relay *rl = NULL;
    for (relay **pp = &n->relays; *pp; pp = &(*pp)->next)
        if ((*pp)->call == call) {
            rl = *pp;
            *pp = rl->next;
            break;
        }
    for (size_t b = 0; rl && b < REQ_BUCKETS; b++)
        for (req *r = n->table[b], *next; r; r = next) {
            next = r->next;
            if (!r->decoding && n->rx && strcmp(r->reserved_by, rl->id) == 0) {
                PD_INFO(r->id, "the relay of its caller closed before Decode; reservation freed");
                drop_reservation(n, r);
                continue;
            }
            if (r->rl != rl) continue;
            r->rl = NULL;
            if (r->finished) { /* the engine is done with it: nothing more comes */
                pd_rpc_stream_end(r->call, r->done ? PD_RPC_CANCELLED : PD_RPC_UNAVAILABLE,
                                  r->done ? "" : "the relay stream of this request closed");
                table_remove(n, r);
                continue;
            }
            pd_rpc_stream_end(r->call, PD_RPC_UNAVAILABLE,
                              "the relay stream of this request closed");
            r->call = NULL; /* the engine's final event frees it */
            pd_engine_abort(n->e, r->id);
        }
    if (rl) {
        PD_INFO(NULL, "relay closed: %s", rl->id);
        pd_rpc_stream_end(call, PD_RPC_CANCELLED, "");
        ev_list_free(&rl->batch);
        free(rl);
    }
    pthread_mutex_unlock(&n->mu);
}

static void h_relay(void *ctx, pd_rpc_call *call, const uint8_t *b, size_t len)
{
    pd_node *n = ctx;
    Pd__RelayRequest *q = pd__relay_request__unpack(NULL, len, b);
    size_t idlen = q && q->relay_id ? strlen(q->relay_id) : 0;
    if (idlen == 0 || idlen >= RELAY_ID_MAX) {
        if (q) pd__relay_request__free_unpacked(q, NULL);
        pd_rpc_stream_end(call, PD_RPC_INVALID_ARGUMENT,
                          "Relay: relay_id is required (at most 63 bytes)");
        return;
    }
    relay *rl = calloc(1, sizeof *rl);
    bool dup = false;
    pthread_mutex_lock(&n->mu);
    for (relay *o = n->relays; o; o = o->next) dup |= strcmp(o->id, q->relay_id) == 0;
    if (rl && !dup) {
        snprintf(rl->id, sizeof rl->id, "%s", q->relay_id);
        rl->call = call;
        rl->next = n->relays;
        n->relays = rl;
    }
    pthread_mutex_unlock(&n->mu);
    if (!rl || dup) {
        pd_rpc_stream_end(call, rl ? PD_RPC_ALREADY_EXISTS : PD_RPC_RESOURCE_EXHAUSTED,
                          rl ? "Relay: this relay_id is open already" : "out of memory");
        free(rl);
    } else {
        PD_INFO(NULL, "relay open: %s", q->relay_id);
        pd_rpc_on_cancel(call, on_relay_cancelled, n);
    }
    pd__relay_request__free_unpacked(q, NULL);
}

static void h_pause(void *ctx, pd_rpc_call *call, const uint8_t *b, size_t len)
{
    pd_node *n = ctx;
    Pd__PauseRequest *q = pd__pause_request__unpack(NULL, len, b);
    if (!q || !valid_request_id(q->request_id)) {
        if (q) pd__pause_request__free_unpacked(q, NULL);
        pd_rpc_fail(call, PD_RPC_INVALID_ARGUMENT, "Pause: malformed request");
        return;
    }
    Pd__PauseReply m = PD__PAUSE_REPLY__INIT;
    pthread_mutex_lock(&n->mu);
    req *r = table_find(n, q->request_id);
    if (r && r->rl && q->seq > r->pause_seq) {
        m.found = true;
        r->pause_seq = q->seq;
        r->paused = q->paused;
        if (q->credit > r->credit) r->credit = q->credit;
        size_t waiting = r->held.n;
        relay_release(r);
        if (r->held.n < waiting) relay_flush(n, r->rl);
    }
    pthread_mutex_unlock(&n->mu);
    pd__pause_request__free_unpacked(q, NULL);
    reply_msg(call, &m.base);
}

/* Drops reservations whose Decode did not start in time. */
static void *reaper_main(void *arg)
{
    pd_node *n = arg;
    pthread_mutex_lock(&n->mu);
    while (!n->stopping) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += REAPER_PERIOD_MS * PD_NS_PER_MS;
        if (ts.tv_nsec >= PD_NS_PER_S) ts.tv_sec++, ts.tv_nsec -= PD_NS_PER_S;
        pthread_cond_timedwait(&n->cv, &n->mu, &ts);
        int64_t now = pd_now_ns();
        for (size_t b = 0; b < REQ_BUCKETS; b++)
            for (req *r = n->table[b], *next; r; r = next) {
                next = r->next;
                if (r->done && now - r->done_ns > (int64_t)RELAY_DONE_TTL_MS * PD_NS_PER_MS) {
                    PD_WARN(r->id, "relayed request not closed by its caller; ending it");
                    pd_rpc_stream_end(r->call, PD_RPC_OK, "");
                    table_remove(n, r);
                    continue;
                }
                if (r->decoding || now < r->deadline_ns) continue;
                PD_WARN(r->id, "reservation expired before Decode started; blocks freed");
                drop_reservation(n, r);
            }
    }
    pthread_mutex_unlock(&n->mu);
    return NULL;
}

/* ---- event dispatch ----------------------------------------------------------------------- */

/* Engine thread: events are ready. Takes only wake_mu, so the engine never waits on the
 * request table (whose holders call into the engine). */
static void on_engine_event(void *ctx)
{
    pd_node *n = ctx;
    pthread_mutex_lock(&n->wake_mu);
    n->wake = true;
    pthread_cond_signal(&n->wake_cv);
    pthread_mutex_unlock(&n->wake_mu);
}

static void *dispatcher_main(void *arg)
{
    pd_node *n = arg;
    for (;;) {
        pthread_mutex_lock(&n->wake_mu);
        if (!n->wake && !n->stopping) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 100 * PD_NS_PER_MS; /* also polls: a missed wakeup costs 100 ms */
            if (ts.tv_nsec >= PD_NS_PER_S) ts.tv_sec++, ts.tv_nsec -= PD_NS_PER_S;
            pthread_cond_timedwait(&n->wake_cv, &n->wake_mu, &ts);
        }
        n->wake = false;
        bool stop = n->stopping;
        pthread_mutex_unlock(&n->wake_mu);
        const pd_engine_event *ev;
        while (pd_engine_next_event(n->e, &ev) == 1) {
            pthread_mutex_lock(&n->mu);
            req *r = table_find(n, ev->request_id);
            if (r && n->role == RT_ROLE_PREFILL)
                prefill_event(n, r, ev);
            else if (r)
                decode_event(n, r, ev);
            else if (ev->held) /* the request went away meanwhile: do not leak its blocks */
                pd_engine_release(n->e, ev->request_id);
            pthread_mutex_unlock(&n->mu);
            pd_engine_event_done(n->e);
        }
        pthread_mutex_lock(&n->mu); /* one RelayBatch per relay for everything drained above */
        for (relay *rl = n->relays; rl; rl = rl->next) relay_flush(n, rl);
        pthread_mutex_unlock(&n->mu);
        if (stop) return NULL;
    }
}

/* ---- lifetime ------------------------------------------------------------------------------- */

pd_node_params pd_node_default_params(void)
{
    return (pd_node_params){
        .role = RT_ROLE_PREFILL,
        .max_num_seqs = 256,
        .enable_prefix_caching = true,
        .block_size = 16,
        .seed = -1,
        .shutdown_timeout_s = 30,
        .kv_lease_s = 30,
        .kv_transport = "auto",
        .device = "cpu",
        .dtype = "auto",
        .gpu_memory_utilization = 0.9,
        .transfer_workers = 4,
    };
}

static int node_load_ranktables(pd_node *n)
{
    const pd_node_params *p = &n->p;
    if (!p->global_ranktable || !*p->global_ranktable)
        return pd_error(PD_EINVAL, "GLOBAL_RANK_TABLE_FILE_PATH is not set");
    if (!p->local_ranktable || !*p->local_ranktable)
        return pd_error(PD_EINVAL, "RANK_TABLE_FILE_PATH is not set");
    PD_CHECK(rt_global_load_file(p->global_ranktable, p->ranktable_flags, NULL, &n->g));
    PD_CHECK(rt_local_load_file(p->local_ranktable, 0, NULL, &n->l));
    rt_role role;
    size_t index;
    PD_CHECK(rt_find_instance(n->g, n->l, &role, &index));
    if (role != p->role)
        return pd_error(PD_EINVAL, "%s: this local ranktable is a %s instance, not a %s one",
                        p->local_ranktable, rt_role_name(role), rt_role_name(p->role));
    n->role = role;
    n->index = index;
    n->epoch = (uint64_t)pd_wall_ns() ^ ((uint64_t)getpid() << 40) ^ (uint64_t)(uintptr_t)n;
    n->inst = rt_global_instance(n->g, role, index);
    n->tp = (int)n->inst->n_devices;
    if (p->tensor_parallel_size > 0 && p->tensor_parallel_size != n->tp)
        return pd_error(PD_EINVAL,
                        "--tensor-parallel-size %d does not match the %d device(s) of "
                        "%s instance %zu in %s",
                        p->tensor_parallel_size, n->tp, rt_role_name(role), index,
                        p->global_ranktable);
    return PD_OK;
}

/* --device and --dtype into the engine's parameters. On CUDA, rank r runs on the ranktable's
 * device_id when every id of the instance is a visible ordinal (the whole host's GPUs are
 * visible), else on ordinal r (a container that sees only this instance's GPUs, as
 * deploy/run_instance.sh starts them). */
static int node_device(pd_node *n, pd_engine_params *ep)
{
    const pd_node_params *p = &n->p;
    bool cuda = strcmp(p->device, "cuda") == 0;
    if (!cuda) {
        if (strcmp(p->dtype, "auto") != 0 && strcmp(p->dtype, "float32") != 0)
            return pd_error(PD_EINVAL,
                            "--dtype %s: the CPU backend computes in float32 (use auto or "
                            "float32, or --device cuda)",
                            p->dtype);
        return PD_OK;
    }
#if PD_HAVE_CUDA
    pd_cuda_info info;
    if (pd_cuda_query(0, &info) < 0) return pd_error_prefix(PD_ENOTFOUND, "--device cuda");
    bool physical = true;
    for (int r = 0; r < n->tp; r++)
        physical = physical && n->inst->devices[r].ordinal < info.device_count;
    ep->n_cuda_devices = n->tp;
    for (int r = 0; r < n->tp && r < PD_ENGINE_MAX_CUDA_DEVICES; r++) {
        ep->cuda_devices[r] = physical ? n->inst->devices[r].ordinal : r;
        PD_INFO(NULL, "rank %d: device_id %s -> CUDA device %d (%d visible)", r,
                n->inst->devices[r].device_id, ep->cuda_devices[r], info.device_count);
    }
    ep->gpu_memory_utilization = p->gpu_memory_utilization;
    ep->cuda_weight_dtype = strcmp(p->dtype, "float32") == 0    ? PD_DTYPE_F32
                            : strcmp(p->dtype, "float16") == 0  ? PD_DTYPE_F16
                            : strcmp(p->dtype, "bfloat16") == 0 ? PD_DTYPE_BF16
                                                                : -1;
    return PD_OK;
#else
    (void)ep;
    return pd_error(PD_EUNSUPPORTED,
                    "--device cuda: this build has no CUDA backend (configure with meson "
                    "-Dcuda=enabled on a machine with nvcc, cuBLAS and NCCL)");
#endif
}

/* --kv-transport on a prefill instance: cuda_ipc shares every rank's pool, nccl sends over NCCL
 * links, auto does both on CUDA (IPC first) and falls back per decode rank (IPC -> NCCL -> TCP),
 * tcp never shares. */
static int node_shares(pd_node *n, const char *xport, bool on_cuda)
{
    if (strcmp(xport, "tcp") == 0 || !on_cuda) return PD_OK;
    n->ipc_fallback = strcmp(xport, "auto") == 0;
    if (strcmp(xport, "nccl") == 0 || n->ipc_fallback) {
        const pd_backend_ops *o = pd_backend_get_ops(pd_engine_backend(n->e, 0));
        n->nccl = o->kv_link_send != NULL;
        if (!n->nccl && !n->ipc_fallback)
            return pd_error(PD_EUNSUPPORTED, "--kv-transport nccl: the %s backend has no NCCL",
                            pd_backend_name(pd_engine_backend(n->e, 0)));
        if (strcmp(xport, "nccl") == 0) {
            PD_INFO(NULL, "KV transport: NCCL (device to device, one link per decode rank)");
            return PD_OK;
        }
    }
    n->shares = calloc((size_t)n->tp, sizeof *n->shares);
    if (!n->shares) return pd_error(PD_ENOMEM, "out of memory");
    for (int r = 0; r < n->tp; r++) {
        pd_backend *b = pd_engine_backend(n->e, r);
        const pd_backend_ops *o = pd_backend_get_ops(b);
        int rc = o->kv_share ? o->kv_share(b, pd_engine_kv(n->e, r), &n->shares[r])
                             : pd_error(PD_EUNSUPPORTED, "the %s backend cannot share its KV pool",
                                        pd_backend_name(b));
        if (rc < 0 && !n->ipc_fallback)
            return pd_error_prefix(rc, "--kv-transport cuda_ipc (rank %d)", r);
        if (rc < 0) {
            PD_WARN(NULL, "--kv-transport auto: %s; KV moves over TCP", pd_last_error());
            free(n->shares);
            n->shares = NULL;
            return PD_OK;
        }
    }
    PD_INFO(NULL, "KV transport: CUDA IPC (device to device)%s",
            n->ipc_fallback ? (n->nccl ? ", NCCL for decode ranks that cannot map it, TCP for "
                                         "those that refuse NCCL"
                                       : ", TCP for decode ranks that cannot map it")
                            : "");
    return PD_OK;
}

int pd_node_create(const pd_node_params *p, pd_node **out)
{
    if (!p->model_dir) return pd_error(PD_EINVAL, "--model is required");
    if (p->port <= 0 || p->port > 65535)
        return pd_error(PD_EINVAL, "--port is required (1..65535)");
    const char *xport = p->kv_transport ? p->kv_transport : "auto";
    bool on_cuda = p->device && strcmp(p->device, "cuda") == 0;
    if (strcmp(xport, "nccl") == 0 && !on_cuda)
        return pd_error(PD_EINVAL, "--kv-transport nccl needs --device cuda (NCCL moves the KV "
                                   "between GPU memories)");
    if (strcmp(xport, "cuda_ipc") == 0 && !on_cuda)
        return pd_error(PD_EINVAL, "--kv-transport cuda_ipc needs --device cuda (the KV pool "
                                   "must be in GPU memory)");
    pd_node *n = calloc(1, sizeof *n);
    if (!n) return pd_error(PD_ENOMEM, "out of memory");
    n->p = *p;
    if (!n->p.served_model_name) n->p.served_model_name = p->model_dir;
    pthread_mutex_init(&n->mu, NULL);
    pthread_cond_init(&n->cv, NULL);
    pthread_mutex_init(&n->wake_mu, NULL);
    pthread_cond_init(&n->wake_cv, NULL);
    int rc = node_load_ranktables(n);
    if (rc < 0) goto fail;
    pd_log_set_role(rt_role_name(n->role));

    pd_engine_params ep = pd_engine_default_params();
    ep.model_dir = p->model_dir;
    ep.tp_size = n->tp;
    ep.n_threads = p->cpu_threads;
    ep.block_size = p->block_size;
    ep.kv_cache_bytes = p->kv_cache_bytes;
    ep.max_num_seqs = p->max_num_seqs;
    ep.enable_prefix_caching = p->enable_prefix_caching;
    ep.max_num_batched_tokens = p->max_num_batched_tokens;
    ep.max_model_len = p->max_model_len;
    ep.seed = p->seed;
    ep.on_event = on_engine_event;
    ep.on_event_ctx = n;
    rc = node_device(n, &ep);
    if (rc < 0) goto fail;
    rc = pd_engine_create(&ep, &n->e);
    if (rc < 0) goto fail;
    n->cfg = pd_engine_model_config(n->e);
    pd_engine_stats st;
    pd_engine_get_stats(n->e, &st);
    n->kvp = (pd_kv_params){.n_layers = (int)n->cfg->num_hidden_layers,
                            .n_blocks = st.kv_blocks_total,
                            .block_size = pd_engine_block_size(n->e),
                            .n_kv_heads = (size_t)n->cfg->num_key_value_heads / (size_t)n->tp,
                            .head_dim = (size_t)n->cfg->head_dim,
                            .dtype = pd_backend_act_dtype(pd_engine_backend(n->e, 0))};

    if (n->role == RT_ROLE_DECODE) {
        n->rx = calloc((size_t)n->tp, sizeof *n->rx);
        for (int r = 0; n->rx && r < n->tp; r++) {
            pd_kv_rx_params rp = {.host = n->inst->devices[r].device_ip,
                                  .port = 0,
                                  .backend = pd_engine_backend(n->e, r),
                                  .kv = pd_engine_kv(n->e, r),
                                  .kv_params = n->kvp,
                                  .head0 = n->kvp.n_kv_heads * (size_t)r};
            rc = pd_kv_tcp_receiver_start(&rp, on_kv_imported, n, &n->rx[r]);
            if (rc < 0) goto fail;
        }
        if (!n->rx) {
            rc = pd_error(PD_ENOMEM, "out of memory");
            goto fail;
        }
    } else {
        rc = pd_kv_tcp_sender_create(&n->tx);
        if (rc < 0) goto fail;
        rc = node_shares(n, xport, on_cuda);
        if (rc < 0) goto fail;
        n->n_workers = p->transfer_workers > 0 ? p->transfer_workers : 1;
        n->workers = calloc((size_t)n->n_workers, sizeof *n->workers);
        for (int i = 0; n->workers && i < n->n_workers; i++)
            pthread_create(&n->workers[i], NULL, transfer_worker, n);
    }
    pthread_create(&n->dispatcher, NULL, dispatcher_main, n);
    n->threads_started = true;
    if (n->role == RT_ROLE_DECODE) {
        pthread_create(&n->reaper, NULL, reaper_main, n);
        n->reaper_started = true;
    }
    rc = pd_engine_start(n->e);
    if (rc < 0) goto fail;

    size_t nm = 0;
    n->methods[nm++] = (pd_rpc_method){"/pd.PD/Info", PD_RPC_UNARY, h_info, n};
    n->methods[nm++] = (pd_rpc_method){"/pd.PD/Stats", PD_RPC_UNARY, h_stats, n};
    n->methods[nm++] = (pd_rpc_method){"/pd.PD/Abort", PD_RPC_UNARY, h_abort, n};
    if (n->role == RT_ROLE_PREFILL) {
        n->methods[nm++] = (pd_rpc_method){"/pd.PD/Prefill", PD_RPC_UNARY, h_prefill, n};
    } else {
        n->methods[nm++] = (pd_rpc_method){"/pd.PD/Reserve", PD_RPC_UNARY, h_reserve, n};
        n->methods[nm++] = (pd_rpc_method){"/pd.PD/Decode", PD_RPC_SERVER_STREAM, h_decode, n};
        n->methods[nm++] = (pd_rpc_method){"/pd.PD/Relay", PD_RPC_SERVER_STREAM, h_relay, n};
        n->methods[nm++] = (pd_rpc_method){"/pd.PD/Pause", PD_RPC_UNARY, h_pause, n};
    }
    char addr[300];
    snprintf(addr, sizeof addr, "%s:%d", p->host ? p->host : n->inst->server_ip, p->port);
    pd_rpc_server_params sp = pd_rpc_server_default_params();
    sp.addr = addr;
    rc = pd_rpc_server_start(&sp, n->methods, nm, &n->srv);
    if (rc < 0) goto fail;
    PD_INFO(NULL,
            "%s instance %zu (server %s, %d device(s), TP %d) serving %s on %s; KV pool "
            "%zu blocks x %zu tokens",
            rt_role_name(n->role), n->index, n->inst->server_id, n->tp, n->tp,
            n->p.served_model_name, addr, n->kvp.n_blocks, n->kvp.block_size);
    *out = n;
    return PD_OK;
fail:;
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", pd_last_error());
    pd_node_destroy(n);
    return pd_error(rc, "%s", msg);
}

int pd_node_port(const pd_node *n)
{
    return pd_rpc_server_port(n->srv);
}

void pd_node_shutdown(pd_node *n)
{
    atomic_store(&n->shutdown, true);
}

int pd_node_run(pd_node *n)
{
    int sfd = pd_signals_fd();
    while (!pd_signal_received() && !atomic_load(&n->shutdown)) {
        struct pollfd pfd = {.fd = sfd, .events = POLLIN};
        poll(&pfd, sfd >= 0 ? 1 : 0, 100);
    }
    PD_INFO(NULL, "shutting down: draining for up to %d s", n->p.shutdown_timeout_s);
    atomic_store(&n->draining, true);
    int64_t deadline = pd_now_ns() + (int64_t)n->p.shutdown_timeout_s * PD_NS_PER_S;
    pthread_mutex_lock(&n->mu);
    while (n->n_reqs > 0 && pd_now_ns() < deadline) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 50 * PD_NS_PER_MS;
        if (ts.tv_nsec >= PD_NS_PER_S) ts.tv_sec++, ts.tv_nsec -= PD_NS_PER_S;
        pthread_cond_timedwait(&n->cv, &n->mu, &ts);
    }
    size_t left = n->n_reqs;
    pthread_mutex_unlock(&n->mu);
    if (left) {
        PD_WARN(NULL, "aborting %zu request(s) still in progress", left);
        char ids[64][PD_ENGINE_MAX_REQUEST_ID + 1];
        for (;;) {
            size_t k = 0;
            pthread_mutex_lock(&n->mu);
            for (size_t b = 0; b < REQ_BUCKETS && k < 64; b++)
                for (req *r = n->table[b]; r && k < 64; r = r->next)
                    snprintf(ids[k++], sizeof ids[0], "%s", r->id);
            pthread_mutex_unlock(&n->mu);
            for (size_t i = 0; i < k; i++) pd_engine_abort(n->e, ids[i]);
            if (k < 64) break;
        }
    }
    return PD_OK;
}

void pd_node_destroy(pd_node *n)
{
    if (!n) return;
    if (n->srv) pd_rpc_server_stop(n->srv, 2000);
    if (n->e) pd_engine_stop(n->e);
    pthread_mutex_lock(&n->mu);
    n->stopping = true;
    pthread_cond_broadcast(&n->cv);
    pthread_mutex_unlock(&n->mu);
    pthread_mutex_lock(&n->wake_mu);
    pthread_cond_signal(&n->wake_cv);
    pthread_mutex_unlock(&n->wake_mu);
    if (n->threads_started) pthread_join(n->dispatcher, NULL);
    if (n->reaper_started) pthread_join(n->reaper, NULL);
    for (int i = 0; n->workers && i < n->n_workers; i++) pthread_join(n->workers[i], NULL);
    free(n->workers);
    for (int r = 0; n->rx && r < n->tp; r++) pd_kv_tcp_receiver_stop(n->rx[r]);
    free(n->rx);
    while (n->relays) { /* the server stopped before their callers cancelled them */
        relay *rl = n->relays;
        n->relays = rl->next;
        ev_list_free(&rl->batch);
        free(rl);
    }
    pd_kv_tcp_sender_destroy(n->tx);
    free(n->shares);
    for (size_t b = 0; b < REQ_BUCKETS; b++)
        while (n->table[b]) table_remove(n, n->table[b]);
    pd_engine_destroy(n->e);
    rt_global_free(n->g);
    rt_local_free(n->l);
    pthread_mutex_destroy(&n->mu);
    pthread_cond_destroy(&n->cv);
    pthread_mutex_destroy(&n->wake_mu);
    pthread_cond_destroy(&n->wake_cv);
    free(n);
}
