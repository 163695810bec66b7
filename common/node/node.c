/* pd-prefill / pd-decode runtime (see node.h): the core both roles share. The prefill half is
 * node_prefill.c, the decode half node_decode.c (node_internal.h lists what each holds).
 *
 * Design: one request table under one lock (n->mu) holds every request the node has state for;
 * the engine only signals that events are ready (wake_mu, never held with mu) and one
 * dispatcher thread drains them into the role's half, so neither the engine thread nor a gRPC
 * handler ever waits on the other.
 */
#include "node/node.h"

#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "node/node_internal.h"
#include "pd_config.h"
#if PD_HAVE_CUDA
#include "backend/cuda/cuda_info.h"
#endif
#include "util/clock.h"
#include "util/log.h"
#include "util/signals.h"
#include "util/status.h"

static const char *role_str(rt_role r)
{
    return rt_role_name(r);
}

/* ---- request table --------------------------------------------------------------------------- */

req *node_req_find(pd_node *n, const char *id)
{
    pd_idmap_link *l = pd_idmap_get(&n->reqs, id);
    return l ? REQ_OF(l) : NULL;
}

static req *table_find_call(pd_node *n, const pd_rpc_call *call)
{
    PD_IDMAP_FOREACH(&n->reqs, l, nx)
    if (REQ_OF(l)->call == call) return REQ_OF(l);
    return NULL;
}

/* Creates and inserts; NULL with PD_EEXIST / PD_ENOMEM set. Called with n->mu held. */
req *node_req_add(pd_node *n, const char *id)
{
    if (node_req_find(n, id)) {
        pd_error(PD_EEXIST, "request %s is already in progress here", id);
        return NULL;
    }
    req *r = calloc(1, sizeof *r);
    pd_arena *a = pd_arena_create(4096);
    if (!r || !a) {
        free(r);
        pd_arena_free(a);
        pd_error(PD_ENOMEM, "out of memory");
        return NULL;
    }
    snprintf(r->id, sizeof r->id, "%s", id);
    r->arena = a;
    r->t_received = pd_now_ns();
    pd_idmap_put(&n->reqs, &r->link, r->id);
    return r;
}

/* ---- relayed events ------------------------------------------------------------------------ */

/* Room for `more` events. */
int node_ev_list_grow(ev_list *l, size_t more)
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
int node_ev_list_push(ev_list *l, uint8_t *buf, size_t len)
{
    if (node_ev_list_grow(l, 1) < 0) {
        free(buf);
        return PD_ENOMEM;
    }
    l->v[l->n++] = (ProtobufCBinaryData){.len = len, .data = buf};
    return PD_OK;
}

/* Frees the events; keeps the array for the next round. */
void node_ev_list_clear(ev_list *l)
{
    for (size_t i = 0; i < l->n; i++) free(l->v[i].data);
    l->n = 0;
}

void node_ev_list_free(ev_list *l)
{
    node_ev_list_clear(l);
    free(l->v);
    *l = (ev_list){0};
}

/* Unlinks and frees. Called with n->mu held. */
void node_req_remove(pd_node *n, req *r)
{
    pd_idmap_del(&n->reqs, &r->link);
    pthread_cond_broadcast(&n->cv);
    node_ev_list_free(&r->held);
    pd_arena_free(r->arena);
    free(r);
}

/* ---- helpers ------------------------------------------------------------------------------- */

/* pd_rpc_reply of m: PD_ECANCELLED when the caller was already gone. */
int node_reply(pd_rpc_call *call, const ProtobufCMessage *m)
{
    size_t len = 0;
    uint8_t *buf = pd_msg_pack(m, &len);
    if (!buf) return pd_rpc_fail(call, PD_RPC_INTERNAL, "out of memory");
    int rc = pd_rpc_reply(call, buf, len);
    free(buf);
    return rc;
}

/* gRPC status for an engine/library status. */
int node_rpc_status(int st)
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
Pd__TokenEvent *node_event_to_proto(const pd_engine_event *ev, pd_arena *a)
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
    m->index = (int32_t)ev->seq_index;
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
    /* a beam's answer: every token's logprob, and n_top entries per token */
    size_t n_top =
        (size_t)(ev->n_top > 0 ? ev->n_top : 0) * (ev->token_logprobs ? ev->n_tokens : 1);
    if (ev->token_logprobs) {
        m->token_logprobs = pd_arena_alloc(a, ev->n_tokens * sizeof(float) + 1, 0);
        if (!m->token_logprobs) return NULL;
        memcpy(m->token_logprobs, ev->token_logprobs, ev->n_tokens * sizeof(float));
        m->n_token_logprobs = ev->n_tokens;
    }
    if (n_top > 0) {
        Pd__TopLogprob *tl = pd_arena_calloc(a, n_top, sizeof *tl);
        Pd__TopLogprob **pp = pd_arena_calloc(a, n_top, sizeof *pp);
        if (!tl || !pp) return NULL;
        for (size_t i = 0; i < n_top; i++) {
            pd__top_logprob__init(&tl[i]);
            tl[i].id = ev->top_ids[i];
            tl[i].logprob = ev->top_logprobs[i];
            pp[i] = &tl[i];
        }
        m->top_logprobs = pp;
        m->n_top_logprobs = n_top;
    }
    const pd_prompt_logprobs *plp = ev->prompt_logprobs;
    if (plp && plp->n_prompt > 1) {
        size_t n = plp->n_prompt - 1, nt = (size_t)plp->n_top;
        Pd__PromptLogprobs *pl = pd_arena_calloc(a, 1, sizeof *pl);
        if (!pl) return NULL;
        pd__prompt_logprobs__init(pl);
        pl->n_top = plp->n_top;
        /* copied: the prefill reply is packed after the event's slot was given back */
        pl->logprob = pd_arena_alloc(a, n * sizeof(float), 0);
        pl->rank = pd_arena_alloc(a, n * sizeof(int32_t), 0);
        pl->top_ids = pd_arena_alloc(a, n * nt * sizeof(int32_t) + 1, 0);
        pl->top_logprobs = pd_arena_alloc(a, n * nt * sizeof(float) + 1, 0);
        if (!pl->logprob || !pl->rank || !pl->top_ids || !pl->top_logprobs) return NULL;
        memcpy(pl->logprob, plp->logprob + 1, n * sizeof(float));
        memcpy(pl->rank, plp->rank + 1, n * sizeof(int32_t));
        memcpy(pl->top_ids, plp->top_ids + nt, n * nt * sizeof(int32_t));
        memcpy(pl->top_logprobs, plp->top_logprobs + nt, n * nt * sizeof(float));
        pl->n_logprob = pl->n_rank = n;
        pl->n_top_ids = pl->n_top_logprobs = n * nt;
        m->prompt_logprobs = pl;
    }
    if (!m->error || !m->finish_reason || !m->stop_string) return NULL;
    return m;
}

bool node_valid_request_id(const char *id)
{
    size_t len = id ? strlen(id) : 0;
    return len > 0 && len <= PD_ENGINE_MAX_REQUEST_ID && len < PD_KV_REQUEST_ID_MAX;
}

/* Abort requested through gRPC cancellation (client gone, deadline). */
void node_on_call_cancelled(void *arg, pd_rpc_call *call)
{
    pd_node *n = arg;
    char id[PD_ENGINE_MAX_REQUEST_ID + 1] = "";
    pthread_mutex_lock(&n->mu);
    req *r = table_find_call(n, call);
    if (r && r->finished) { /* relayed, after its final event (the caller's expected end), or
                               with events still waiting for a client that went away */
        pd_rpc_stream_end(call, PD_RPC_CANCELLED, "");
        node_req_remove(n, r);
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

/* The transport of this node's latest KV transfer (sent: prefill; received: decode), or before
 * the first: the route's first choice (prefill), "tcp" (decode). */
static void kv_transport_label(pd_node *n, char *buf, size_t cap)
{
    pthread_mutex_lock(&n->mu);
    snprintf(buf, cap, "%s", n->kv_transport);
    pthread_mutex_unlock(&n->mu);
    if (buf[0]) return;
    pd_kv_rx_stats rs = {0};
    if (n->rx) pd_kv_rx_get_stats(n->rx[0], &rs);
    snprintf(buf, cap, "%s",
             n->route       ? pd_kv_route_first(n->route)
             : rs.transport ? rs.transport
                            : "tcp");
}

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
    m.pp_size = n->pp;
    Pd__RankInfo *ri = pd_arena_calloc(a, (size_t)n->n_ranks, sizeof *ri);
    Pd__RankInfo **rp = pd_arena_calloc(a, (size_t)n->n_ranks, sizeof *rp);
    for (int r = 0; r < n->n_ranks; r++) {
        size_t layer0;
        pd_kv_params kp = pd_engine_rank_kv(n->e, r, &layer0);
        pd__rank_info__init(&ri[r]);
        ri[r].rank = r;
        ri[r].device_id = n->inst->devices[r].ordinal;
        ri[r].device_ip = (char *)n->inst->devices[r].device_ip;
        ri[r].data_port = n->rx ? pd_kv_tcp_receiver_port(n->rx[r]) : 0;
        ri[r].kv_head0 = (int32_t)(n->kvp.n_kv_heads * (size_t)(r % n->tp));
        ri[r].kv_heads = (int32_t)n->kvp.n_kv_heads;
        ri[r].kv_layer0 = (int32_t)layer0;
        ri[r].kv_layers = kp.n_layers;
        rp[r] = &ri[r];
    }
    m.ranks = rp;
    m.n_ranks = (size_t)n->n_ranks;
    m.model_name = (char *)n->p.served_model_name;
    m.max_model_len = (int64_t)pd_engine_max_model_len(n->e);
    m.block_size = (int32_t)pd_engine_block_size(n->e);
    m.vocab_size = (int64_t)pd_engine_vocab(n->e);
    m.num_layers = (int32_t)n->cfg->num_hidden_layers;
    m.num_kv_heads = (int32_t)n->cfg->num_key_value_heads;
    m.head_dim = (int32_t)n->cfg->head_dim;
    m.kv_dtype = (char *)pd_dtype_name(n->kvp.dtype);
    char transport[16];
    kv_transport_label(n, transport, sizeof transport);
    m.kv_transport = transport;
    m.version = PD_VERSION;
    m.max_num_seqs = (int32_t)n->p.engine.max_num_seqs;
    m.instance_epoch = n->epoch;
    m.prefix_caching = n->p.engine.enable_prefix_caching;
    m.load_seconds = n->load_s;
    m.warmup_seconds = n->warmup_s;
    m.warmup_tokens = (int64_t)n->warmup_tokens;
    node_reply(call, &m.base);
    pd_arena_free(a);
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
    int64_t bins[PD_ENGINE_STEP_BINS];
    for (size_t i = 0; i < PD_ENGINE_STEP_BINS; i++) bins[i] = (int64_t)st.step_tokens[i];
    m.n_step_tokens = PD_ENGINE_STEP_BINS;
    m.step_tokens = bins;
    m.step_tokens_sum = (int64_t)st.step_tokens_sum;
    m.spec_drafts = (int64_t)st.spec_drafts;
    m.spec_draft_tokens = (int64_t)st.spec_draft_tokens;
    m.spec_accepted_tokens = (int64_t)st.spec_accepted_tokens;
    int64_t pos[PD_ENGINE_SPEC_MAX_TOKENS];
    for (size_t i = 0; i < PD_ENGINE_SPEC_MAX_TOKENS; i++)
        pos[i] = (int64_t)st.spec_accepted_per_pos[i];
    m.n_spec_accepted_per_pos = n->p.engine.spec_num_tokens;
    m.spec_accepted_per_pos = pos;
    m.n_stage_seconds = (size_t)n->pp;
    m.stage_seconds = st.stage_seconds;
    pthread_mutex_lock(&n->mu);
    m.leases_held = n->leases;
    m.kv_transfer_bytes = n->kv_bytes;
    m.kv_transfer_seconds = n->kv_seconds;
    int64_t reserved = 0;
    if (n->role == RT_ROLE_DECODE) PD_IDMAP_FOREACH(&n->reqs, l, nx)
    if (!REQ_OF(l)->decoding) reserved += (int64_t)(REQ_OF(l)->n_blocks * st.block_size);
    m.reserved_tokens = reserved;
    /* the blocks in use less the reservations (which hold blocks too: counted once, there) */
    int64_t used = (int64_t)((st.kv_blocks_total - st.kv_blocks_free) * st.block_size);
    m.running_tokens = used > reserved ? used - reserved : 0;
    m.relay_batches = n->relay_batches;
    m.relay_events = n->relay_events;
    m.relay_pauses = n->relay_pauses;
    pthread_mutex_unlock(&n->mu);
    if (n->rx) {
        for (int r = 0; r < n->n_ranks; r++) {
            pd_kv_rx_stats rs;
            pd_kv_rx_get_stats(n->rx[r], &rs);
            m.kv_transfer_bytes += (int64_t)rs.bytes;
        }
    }
    m.draining = atomic_load(&n->draining);
    m.instance_epoch = n->epoch;
    node_reply(call, &m.base);
}

static void h_abort(void *ctx, pd_rpc_call *call, const uint8_t *b, size_t len)
{
    pd_node *n = ctx;
    Pd__AbortRequest *q = pd__abort_request__unpack(NULL, len, b);
    if (!q || !node_valid_request_id(q->request_id)) {
        if (q) pd__abort_request__free_unpacked(q, NULL);
        pd_rpc_fail(call, PD_RPC_INVALID_ARGUMENT, "Abort: malformed request");
        return;
    }
    Pd__AbortReply m = PD__ABORT_REPLY__INIT;
    m.found = pd_engine_abort(n->e, q->request_id) == PD_OK;
    if (n->route && node_prefill_abort(n, q->request_id)) m.found = true;
    if (n->rx && node_decode_abort(n, q->request_id)) m.found = true;
    PD_INFO(q->request_id, "abort requested (%s)", m.found ? "found" : "not found");
    pd__abort_request__free_unpacked(q, NULL);
    node_reply(call, &m.base);
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
            req *r = node_req_find(n, ev->request_id);
            if (r && n->role == RT_ROLE_PREFILL)
                node_prefill_event(n, r, ev);
            else if (r)
                node_decode_event(n, r, ev);
            else if (ev->held) /* the request went away meanwhile: do not leak its blocks */
                pd_engine_release(n->e, ev->request_id);
            pthread_mutex_unlock(&n->mu);
            pd_engine_event_done(n->e);
        }
        node_relays_flush(n); /* one RelayBatch per relay for everything drained above */
        if (stop) return NULL;
    }
}

/* ---- lifetime ------------------------------------------------------------------------------- */

pd_node_params pd_node_default_params(void)
{
    return (pd_node_params){
        .role = RT_ROLE_PREFILL,
        .shutdown_timeout_s = 30,
        .kv_lease_s = 30,
        .kv_transport = "auto",
        .device = "cpu",
        .dtype = "auto",
        .transfer_workers = 4,
        .spec = pd_spec_flags_default(),
        .engine = pd_engine_default_params(),
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
    n->n_ranks = (int)n->inst->n_devices;
    n->pp = p->pipeline_parallel_size > 0 ? p->pipeline_parallel_size : 1;
    n->tp = p->tensor_parallel_size > 0 ? p->tensor_parallel_size : n->n_ranks / n->pp;
    if (n->tp * n->pp != n->n_ranks)
        return pd_error(PD_EINVAL,
                        "--tensor-parallel-size %d x --pipeline-parallel-size %d does not match "
                        "the %d device(s) of %s instance %zu in %s",
                        n->tp, n->pp, n->n_ranks, rt_role_name(role), index, p->global_ranktable);
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
    ep->dtype = strcmp(p->dtype, "float32") == 0    ? PD_DTYPE_F32
                : strcmp(p->dtype, "float16") == 0  ? PD_DTYPE_F16
                : strcmp(p->dtype, "bfloat16") == 0 ? PD_DTYPE_BF16
                                                    : -1;
    if (!cuda) {
        if (ep->dtype == PD_DTYPE_F16)
            return pd_error(PD_EINVAL,
                            "--dtype %s: the CPU backend computes in float32 or bfloat16 (use "
                            "auto, float32 or bfloat16, or --device cuda)",
                            p->dtype);
        if (p->gpu_memory_utilization_set)
            PD_INFO(NULL,
                    "--gpu-memory-utilization %g: no effect on the CPU backend, whose KV pool is "
                    "--kv-cache-bytes",
                    p->engine.gpu_memory_utilization);
        return PD_OK;
    }
#if PD_HAVE_CUDA
    pd_cuda_info info;
    if (pd_cuda_query(0, &info) < 0) return pd_error_prefix(PD_ENOTFOUND, "--device cuda");
    bool physical = true;
    for (int r = 0; r < n->n_ranks; r++)
        physical = physical && n->inst->devices[r].ordinal < info.device_count;
    ep->n_cuda_devices = n->n_ranks;
    for (int r = 0; r < n->n_ranks && r < PD_ENGINE_MAX_CUDA_DEVICES; r++) {
        ep->cuda_devices[r] = physical ? n->inst->devices[r].ordinal : r;
        PD_INFO(NULL, "rank %d: device_id %s -> CUDA device %d (%d visible)", r,
                n->inst->devices[r].device_id, ep->cuda_devices[r], info.device_count);
    }
    return PD_OK;
#else
    (void)ep;
    return pd_error(PD_EUNSUPPORTED,
                    "--device cuda: this build has no CUDA backend (configure with meson "
                    "-Dcuda=enabled on a machine with nvcc, cuBLAS and NCCL)");
#endif
}

int pd_node_create(const pd_node_params *p, pd_node **out)
{
    int64_t t_start = pd_now_ns();
    if (!p->engine.model_dir) return pd_error(PD_EINVAL, "--model is required");
    if (p->port <= 0 || p->port > 65535)
        return pd_error(PD_EINVAL, "--port is required (1..65535)");
    bool on_cuda = p->device && strcmp(p->device, "cuda") == 0;
    PD_CHECK(pd_kv_route_check(p->kv_transport ? p->kv_transport : "auto", on_cuda));
    pd_node *n = calloc(1, sizeof *n);
    if (!n) return pd_error(PD_ENOMEM, "out of memory");
    n->p = *p;
    if (pd_idmap_init(&n->reqs, REQ_BUCKETS) < 0) {
        free(n);
        return PD_ENOMEM;
    }
    if (!n->p.served_model_name) n->p.served_model_name = p->engine.model_dir;
    pthread_mutex_init(&n->mu, NULL);
    pthread_cond_init(&n->cv, NULL);
    pthread_mutex_init(&n->wake_mu, NULL);
    pthread_cond_init(&n->wake_cv, NULL);
    int rc = node_load_ranktables(n);
    if (rc < 0) goto fail;
    pd_log_set_role(rt_role_name(n->role));

    pd_engine_params ep = p->engine;
    ep.tp_size = n->tp;
    ep.pp_size = n->pp;
    ep.on_event = on_engine_event;
    ep.on_event_ctx = n;
    rc = node_device(n, &ep);
    if (rc < 0) goto fail;
    ep.require_tokenizer = true; /* the text of every answer is detokenized here */
    rc = pd_engine_create(&ep, &n->e);
    if (rc < 0) goto fail;
    int64_t t_loaded = pd_now_ns();
    /* before anything can reach the instance: the first request must not pay the first pass */
    rc = pd_engine_warmup(n->e, 0, &n->warmup_tokens);
    if (rc < 0) goto fail;
    int64_t t_warm = pd_now_ns();
    n->load_s = (double)(t_loaded - t_start) / PD_NS_PER_S;
    n->warmup_s = (double)(t_warm - t_loaded) / PD_NS_PER_S;
    n->cfg = pd_engine_model_config(n->e);
    pd_engine_stats st;
    pd_engine_get_stats(n->e, &st);
    n->kvp = (pd_kv_params){.n_layers = (int)n->cfg->num_hidden_layers,
                            .n_blocks = st.kv_blocks_total,
                            .block_size = pd_engine_block_size(n->e),
                            .n_kv_heads = (size_t)n->cfg->num_key_value_heads / (size_t)n->tp,
                            .head_dim = (size_t)n->cfg->head_dim,
                            .dtype = pd_engine_kv_dtype(n->e)};

    rc = n->role == RT_ROLE_DECODE ? node_decode_start(n) : node_prefill_start(n, on_cuda);
    if (rc < 0) goto fail;
    pthread_create(&n->dispatcher, NULL, dispatcher_main, n);
    n->threads_started = true;
    rc = pd_engine_start(n->e);
    if (rc < 0) goto fail;

    size_t nm = 0;
    n->methods[nm++] = (pd_rpc_method){"/pd.PD/Info", PD_RPC_UNARY, h_info, n};
    n->methods[nm++] = (pd_rpc_method){"/pd.PD/Stats", PD_RPC_UNARY, h_stats, n};
    n->methods[nm++] = (pd_rpc_method){"/pd.PD/Abort", PD_RPC_UNARY, h_abort, n};
    nm += n->role == RT_ROLE_PREFILL ? node_prefill_methods(n, n->methods + nm)
                                     : node_decode_methods(n, n->methods + nm);
    char addr[300];
    snprintf(addr, sizeof addr, "%s:%d", p->host ? p->host : n->inst->server_ip, p->port);
    pd_rpc_server_params sp = pd_rpc_server_default_params();
    sp.addr = addr;
    rc = pd_rpc_server_start(&sp, n->methods, nm, &n->srv);
    if (rc < 0) goto fail;
    PD_INFO(NULL,
            "start-up: load %.3f s, warm-up %.3f s (%zu-token prefill and a decode step), "
            "total %.3f s",
            n->load_s, n->warmup_s, n->warmup_tokens,
            (double)(pd_now_ns() - t_start) / PD_NS_PER_S);
    PD_INFO(NULL,
            "%s instance %zu (server %s, %d device(s), TP %d, PP %d) serving %s on %s; KV pool "
            "%zu blocks x %zu tokens",
            rt_role_name(n->role), n->index, n->inst->server_id, n->n_ranks, n->tp, n->pp,
            n->p.served_model_name, addr, n->kvp.n_blocks, n->kvp.block_size);
    if (n->rx) { /* the ports a firewall between the hosts must let through */
        char dp[1024];
        size_t len = 0;
        for (int r = 0; r < n->n_ranks && len < sizeof dp; r++)
            len +=
                (size_t)snprintf(dp + len, sizeof dp - len, "%s%s:%d", r ? ", " : "",
                                 n->inst->devices[r].device_ip, pd_kv_tcp_receiver_port(n->rx[r]));
        PD_INFO(NULL, "KV data plane (rank by rank): %s", dp);
    }
    *out = n;
    return PD_OK;
fail:;
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", pd_last_error());
    pd_node_free(n);
    return pd_error(rc, "%s", msg);
}

/* ---- structured output: compiling off the RPC thread ---------------------------------------- */

typedef struct {
    pd_node *n;
    pd_rpc_call *call;
    void (*fn)(void *ctx, pd_rpc_call *call, const uint8_t *b, size_t len);
    uint8_t *b; /* the request's bytes */
    size_t len;
    pd_sampling_params sp; /* its guided fields, into text / ws */
    char *text, *ws;
} defer_job;

static _Thread_local bool t_deferred; /* this thread runs a deferred call: no second deferral */

static void *defer_main(void *arg)
{
    defer_job *j = arg;
    pd_node *n = j->n;
    pd_engine_grammar_warm(n->e, &j->sp);
    t_deferred = true;
    j->fn(n, j->call, j->b, j->len);
    pd_rpc_call_release(j->call); /* the engine may have ended it already */
    free(j->b);
    free(j->text);
    free(j->ws);
    free(j);
    pthread_mutex_lock(&n->mu);
    n->n_deferred--;
    pthread_cond_broadcast(&n->cv);
    pthread_mutex_unlock(&n->mu);
    return NULL;
}

bool node_defer_guided(pd_node *n, pd_rpc_call *call, const Pd__SamplingParams *m,
                       void (*fn)(void *ctx, pd_rpc_call *call, const uint8_t *b, size_t len),
                       const uint8_t *b, size_t len)
{
    if (t_deferred || !m || !m->guided_kind) return false;
    pd_sampling_params sp = pd_sampling_default_params();
    sp.guided_kind = m->guided_kind;
    sp.guided = (const char *)m->guided.data;
    sp.guided_len = m->guided.len;
    sp.guided_ws = m->guided_ws && m->guided_ws[0] ? m->guided_ws : NULL;
    if (pd_engine_grammar_ready(n->e, &sp)) return false;
    defer_job *j = calloc(1, sizeof *j);
    if (!j) return false;
    *j = (defer_job){.n = n, .call = call, .fn = fn, .len = len, .sp = sp};
    j->b = malloc(len ? len : 1);
    j->text = malloc(sp.guided_len + 1);
    j->ws = sp.guided_ws ? strdup(sp.guided_ws) : NULL;
    if (!j->b || !j->text || (sp.guided_ws && !j->ws)) goto inline_;
    memcpy(j->b, b, len);
    if (sp.guided_len) memcpy(j->text, sp.guided, sp.guided_len);
    j->text[sp.guided_len] = '\0';
    j->sp.guided = j->text;
    j->sp.guided_ws = j->ws;
    pthread_attr_t at;
    pthread_t t;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    pd_rpc_call_hold(call); /* valid on the thread, after this handler returns */
    pthread_mutex_lock(&n->mu);
    bool ok = !n->defer_closed && pthread_create(&t, &at, defer_main, j) == 0;
    if (ok) n->n_deferred++;
    pthread_mutex_unlock(&n->mu);
    pthread_attr_destroy(&at);
    if (ok) return true;
    pd_rpc_call_release(call);
inline_: /* no thread: compile here, as before */
    free(j->b);
    free(j->text);
    free(j->ws);
    free(j);
    return false;
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
    while (n->reqs.count > 0 && pd_now_ns() < deadline) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 50 * PD_NS_PER_MS;
        if (ts.tv_nsec >= PD_NS_PER_S) ts.tv_sec++, ts.tv_nsec -= PD_NS_PER_S;
        pthread_cond_timedwait(&n->cv, &n->mu, &ts);
    }
    size_t left = n->reqs.count;
    pthread_mutex_unlock(&n->mu);
    if (left) {
        PD_WARN(NULL, "aborting %zu request(s) still in progress", left);
        char ids[64][PD_ENGINE_MAX_REQUEST_ID + 1];
        for (;;) {
            size_t k = 0;
            pthread_mutex_lock(&n->mu);
            PD_IDMAP_FOREACH(&n->reqs, l, nx)
            if (k < 64) snprintf(ids[k++], sizeof ids[0], "%s", REQ_OF(l)->id);
            pthread_mutex_unlock(&n->mu);
            for (size_t i = 0; i < k; i++) pd_engine_abort(n->e, ids[i]);
            if (k < 64) break;
        }
    }
    return PD_OK;
}

void pd_node_free(pd_node *n)
{
    if (!n) return;
    /* deferred calls (node_defer_guided) finish first: they use the server and the engine */
    pthread_mutex_lock(&n->mu);
    n->defer_closed = true;
    while (n->n_deferred > 0) pthread_cond_wait(&n->cv, &n->mu);
    pthread_mutex_unlock(&n->mu);
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
    node_decode_stop(n);
    node_prefill_stop(n);
    for (pd_idmap_link *l; (l = pd_idmap_first(&n->reqs));) node_req_remove(n, REQ_OF(l));
    pd_idmap_free(&n->reqs);
    pd_engine_free(n->e);
    rt_global_free(n->g);
    rt_local_free(n->l);
    pthread_mutex_destroy(&n->mu);
    pthread_cond_destroy(&n->cv);
    pthread_mutex_destroy(&n->wake_mu);
    pthread_cond_destroy(&n->wake_cv);
    free(n);
}
