/* The prefill half of a node (see node_internal.h): Prefill runs the prompt as a PREFILL_ONLY
 * request; its final event hands the request to a transfer worker, which sends the held KV to
 * every decode rank whose heads overlap a prefill rank's, by the transport the route picks
 * (kv_route.h), and replies with the first token once the decode side acknowledged.
 *
 * Design: the KV stays leased to the request until the worker is done with it (acknowledged,
 * failed, aborted or out of time: --kv-lease-seconds bounds the send), so no path frees it
 * twice or early; an abort while the worker sends sets the request's cancel flag, which the send
 * looks at every 50 ms.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "node/node_internal.h"
#include "util/clock.h"
#include "util/log.h"
#include "util/status.h"

static void h_prefill(void *ctx, pd_rpc_call *call, const uint8_t *b, size_t len)
{
    pd_node *n = ctx;
    if (atomic_load(&n->draining)) {
        pd_rpc_fail(call, PD_RPC_UNAVAILABLE, "the prefill instance is shutting down");
        return;
    }
    Pd__PrefillRequest *q = pd__prefill_request__unpack(NULL, len, b);
    if (!q || !node_valid_request_id(q->request_id) || q->n_prompt_ids == 0 || q->n_targets == 0) {
        if (q) pd__prefill_request__free_unpacked(q, NULL);
        pd_rpc_fail(call, PD_RPC_INVALID_ARGUMENT,
                    "Prefill: request_id, prompt_ids and targets are required");
        return;
    }
    if (node_defer_guided(n, call, q->sampling, h_prefill, b, len)) {
        pd__prefill_request__free_unpacked(q, NULL);
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
    req *r = node_req_add(n, q->request_id);
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
        if (rc < 0) node_req_remove(n, r);
    }
    char msg[512];
    snprintf(msg, sizeof msg, "%s", pd_last_error());
    pthread_mutex_unlock(&n->mu);
    if (rc < 0) {
        PD_WARN(q->request_id, "Prefill refused: %s", msg);
        pd_rpc_fail(call, node_rpc_status(rc), msg);
    } else {
        pd_rpc_on_cancel(call, node_on_call_cancelled, n);
        PD_DEBUG(q->request_id, "prefill admitted: %zu prompt tokens", q->n_prompt_ids);
    }
    pd__prefill_request__free_unpacked(q, NULL);
}

/* Sends the held KV of j to every decode rank: from each prefill rank the (layer, head) ranges
 * it shares with the decode rank (heads under different tensor-parallel sizes, layers under
 * different pipeline stages); returns a status. *transport: the transport that carried it (the
 * last send's). */
static int transfer_kv(pd_node *n, job *j, int64_t *bytes, double *seconds, const char **transport)
{
    req *r = j->r;
    size_t p_heads = n->kvp.n_kv_heads, all_layers = (size_t)n->kvp.n_layers;
    for (size_t t = 0; t < r->n_targets; t++) {
        const Pd__DecodeTarget *dt = &r->targets[t];
        pd_kv_part dst = {(size_t)dt->kv_head0, (size_t)dt->kv_heads, (size_t)dt->kv_layer0,
                          dt->kv_layers > 0 ? (size_t)dt->kv_layers : all_layers};
        for (int rank = 0; rank < n->n_ranks; rank++) {
            size_t layer0;
            pd_kv_params kp = pd_engine_rank_kv(n->e, rank, &layer0);
            pd_kv_part src = {p_heads * (size_t)(rank % n->tp), p_heads, layer0,
                              (size_t)kp.n_layers},
                       part;
            if (!pd_kv_plan(&src, &dst, &part)) continue;
            pd_kv_send_req sr = {.request_id = r->id,
                                 .host = dt->host,
                                 .port = dt->port,
                                 .backend = pd_engine_backend(n->e, rank),
                                 .kv = pd_engine_kv(n->e, rank),
                                 .kv_params = kp,
                                 .layer0 = layer0,
                                 .send_layer0 = part.layer0,
                                 .send_layers = part.n_layers,
                                 .src_head0 = src.head0,
                                 /* the blocks the decode side lacks */
                                 .block_ids = j->src_blocks + r->skip_blocks,
                                 .n_blocks = j->n_src_blocks - r->skip_blocks,
                                 .n_tokens = r->n_prompt - r->skip_blocks * n->kvp.block_size,
                                 .head0 = part.head0,
                                 .n_heads = part.n_heads,
                                 .timeout_ms = r->lease_ms,
                                 .cancel = &r->cancel};
            pd_kv_send_stats st;
            int rc = pd_kv_route_send(n->route, rank, &sr, &st);
            *bytes += (int64_t)st.bytes;
            *seconds += st.seconds;
            *transport = st.transport;
            if (rc < 0)
                return pd_error_prefix(rc, "KV transfer to %s:%d (rank %d -> %zu)", dt->host,
                                       dt->port, rank, t);
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
        const char *transport = NULL;
        int rc = j->needs_transfer ? transfer_kv(n, j, &bytes, &seconds, &transport) : PD_OK;
        char msg[512];
        snprintf(msg, sizeof msg, "%s", pd_last_error());
        pd_engine_release(n->e, r->id);
        pthread_mutex_lock(&n->mu);
        n->leases--;
        n->kv_bytes += bytes;
        n->kv_seconds += seconds;
        if (rc == PD_OK && transport)
            snprintf(n->kv_transport, sizeof n->kv_transport, "%s", transport);
        pthread_mutex_unlock(&n->mu);
        if (rc < 0) {
            /* the decode side did not take the KV (gone, refused, out of time): ABORTED tells
               the scheduler to reserve on a decode instance again; an abort stays CANCELLED */
            PD_WARN(r->id, "%s; KV released", msg);
            pd_rpc_fail(r->call, rc == PD_ECANCELLED ? PD_RPC_CANCELLED : PD_RPC_ABORTED, msg);
        } else {
            Pd__PrefillReply m = PD__PREFILL_REPLY__INIT;
            m.first = j->first;
            m.seed = j->seed;
            m.cached_tokens = j->cached_tokens;
            m.kv_bytes = bytes;
            m.kv_seconds = seconds;
            m.kv_transport = (char *)(transport ? transport : "");
            m.prefill_seconds = (double)(pd_now_ns() - r->t_received) / 1e9 - seconds;
            PD_DEBUG(r->id, "prefill done: %lld KV bytes in %.3f s", (long long)bytes, seconds);
            node_reply(r->call, &m.base);
        }
        pthread_mutex_lock(&n->mu);
        node_req_remove(n, r); /* frees j too: it lives in r->arena */
        pthread_mutex_unlock(&n->mu);
    }
}

/* Dispatcher: a prefill request's event. Called with n->mu held. */
void node_prefill_event(pd_node *n, req *r, const pd_engine_event *ev)
{
    /* PREFILL_ONLY emits one final event; anything after it (an abort racing the hand-over)
     * is the transfer worker's business, which ends the call and frees the request */
    if (!ev->final || r->handed_over) return;
    if (ev->status < 0 || !ev->held) {
        int st = ev->status == PD_ECANCELLED ? PD_RPC_CANCELLED : node_rpc_status(ev->status);
        pd_rpc_fail(r->call, st, ev->error && ev->error[0] ? ev->error : "prefill failed");
        if (ev->held) pd_engine_release(n->e, r->id);
        node_req_remove(n, r);
        return;
    }
    job *j = pd_arena_calloc(r->arena, 1, sizeof *j);
    Pd__TokenEvent *first = node_event_to_proto(ev, r->arena);
    int32_t *blocks = pd_arena_alloc(r->arena, ev->n_blocks * sizeof(int32_t), 0);
    if (!j || !first || !blocks) {
        pd_rpc_fail(r->call, PD_RPC_INTERNAL, "out of memory");
        pd_engine_release(n->e, r->id);
        node_req_remove(n, r);
        return;
    }
    if (ev->n_blocks != r->n_dst_blocks) {
        char msg[160];
        snprintf(msg, sizeof msg, "prefill holds %zu blocks, the decode side reserved %zu",
                 ev->n_blocks, r->n_dst_blocks);
        pd_rpc_fail(r->call, PD_RPC_INTERNAL, msg);
        pd_engine_release(n->e, r->id);
        node_req_remove(n, r);
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

int node_prefill_start(pd_node *n, bool on_cuda)
{
    pd_backend **backends = calloc((size_t)n->n_ranks, sizeof *backends);
    const pd_kv **kvs = calloc((size_t)n->n_ranks, sizeof *kvs);
    int rc = backends && kvs ? PD_OK : pd_error(PD_ENOMEM, "out of memory");
    for (int r = 0; rc == PD_OK && r < n->n_ranks; r++) {
        backends[r] = pd_engine_backend(n->e, r);
        kvs[r] = pd_engine_kv(n->e, r);
    }
    pd_kv_route_params rp = {.transport = n->p.kv_transport ? n->p.kv_transport : "auto",
                             .device = on_cuda,
                             .n_ranks = n->n_ranks,
                             .backends = backends,
                             .kvs = kvs};
    if (rc == PD_OK) rc = pd_kv_route_create(&rp, &n->route);
    free(backends);
    free(kvs);
    if (rc < 0) return rc;
    n->n_workers = n->p.transfer_workers > 0 ? n->p.transfer_workers : 1;
    n->workers = calloc((size_t)n->n_workers, sizeof *n->workers);
    for (int i = 0; n->workers && i < n->n_workers; i++)
        pthread_create(&n->workers[i], NULL, transfer_worker, n);
    return PD_OK;
}

void node_prefill_stop(pd_node *n)
{
    for (int i = 0; n->workers && i < n->n_workers; i++) pthread_join(n->workers[i], NULL);
    free(n->workers);
    n->workers = NULL;
    pd_kv_route_free(n->route);
    n->route = NULL;
}

size_t node_prefill_methods(pd_node *n, pd_rpc_method *m)
{
    m[0] = (pd_rpc_method){"/pd.PD/Prefill", PD_RPC_UNARY, h_prefill, n};
    return 1;
}

bool node_prefill_abort(pd_node *n, const char *id)
{
    pthread_mutex_lock(&n->mu);
    req *r = node_req_find(n, id);
    bool found = r && r->handed_over;
    if (found) atomic_store(&r->cancel, true); /* the send stops and frees the KV */
    pthread_mutex_unlock(&n->mu);
    return found;
}
