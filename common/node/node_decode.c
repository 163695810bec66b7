/* The decode half of a node (see node_internal.h): Reserve allocates a prompt's blocks and
 * expects their KV on each rank's receiver (kv_tcp.h); Decode admits the imported sequence and
 * streams its tokens, on its own call or, for a scheduler that opened one, on a Relay stream
 * that carries the events of many requests in one message per dispatcher round, paced by the
 * scheduler's Pause and credit.
 *
 * Design: a reservation is a request in the table that no Decode has taken yet; it goes exactly
 * once, by Decode, by Abort, by the relay it was made for closing, or by the reaper when its TTL
 * passes, each dropping its expected imports, its blocks and its entry together
 * (drop_reservation).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "node/node_internal.h"
#include "util/clock.h"
#include "util/log.h"
#include "util/status.h"

#define REAPER_PERIOD_MS       100
#define DEFAULT_RESERVE_TTL_MS 30000
#define RELAY_DONE_TTL_MS                                                                          \
    30000 /* a relayed request's Decode stream waits this long at most                             \
             for its caller's cancel after the final event */

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
    node_ev_list_clear(&rl->batch);
}

static void on_kv_imported(void *arg, const char *id, int status)
{
    pd_node *n = arg;
    pthread_mutex_lock(&n->mu);
    req *r = node_req_find(n, id);
    if (r && status == PD_OK) r->kv_ranks_done++;
    pthread_mutex_unlock(&n->mu);
    PD_DEBUG(id, "KV imported on one rank (status %d)", status);
}

/* Frees reservation r (no Decode has started on it): its expected transfers, its blocks, its
 * entry. Called with n->mu held. */
static void drop_reservation(pd_node *n, req *r)
{
    for (int k = 0; k < n->n_ranks; k++) pd_kv_rx_cancel(n->rx[k], r->id);
    pd_engine_abort(n->e, r->id);
    node_req_remove(n, r);
}

static void h_reserve(void *ctx, pd_rpc_call *call, const uint8_t *b, size_t len)
{
    pd_node *n = ctx;
    if (atomic_load(&n->draining)) {
        pd_rpc_fail(call, PD_RPC_UNAVAILABLE, "the decode instance is shutting down");
        return;
    }
    Pd__ReserveRequest *q = pd__reserve_request__unpack(NULL, len, b);
    if (!q || !node_valid_request_id(q->request_id) || q->num_prompt_tokens <= 0 ||
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
    req *r = node_req_add(n, q->request_id);
    int rc = r ? PD_OK : PD_EEXIST;
    if (r && q->local_prefill) {
        /* prefilled here (Decode with local_prefill): nothing to reserve, no KV to expect; the
           engine queues the sequence until it has the blocks, as pd-generate's does */
        r->local = true;
        r->n_blocks = 0;
    } else if (r) {
        r->blocks = pd_arena_alloc(r->arena, cap * sizeof(int32_t), 0);
        rc = r->blocks ? pd_engine_reserve(n->e, r->id, (size_t)q->num_prompt_tokens,
                                           q->n_prompt_ids ? q->prompt_ids : NULL, r->blocks, cap,
                                           &r->n_blocks, &cached)
                       : pd_error(PD_ENOMEM, "out of memory");
        /* the transfer brings the blocks after the cached ones */
        int k = 0;
        for (; rc == PD_OK && k < n->n_ranks; k++)
            rc = pd_kv_rx_expect(n->rx[k], r->id, r->blocks + cached / bs,
                                 r->n_blocks - cached / bs, (size_t)q->num_prompt_tokens - cached);
        if (rc < 0) {
            char keep[512];
            snprintf(keep, sizeof keep, "%s", pd_last_error());
            while (k-- > 1) pd_kv_rx_cancel(n->rx[k - 1], r->id);
            pd_engine_abort(n->e, r->id);
            node_req_remove(n, r);
            pd_error(rc, "%s", keep);
        }
    }
    if (rc == PD_OK) {
        int ttl = q->ttl_ms > 0 ? q->ttl_ms : DEFAULT_RESERVE_TTL_MS;
        r->deadline_ns = pd_now_ns() + (int64_t)ttl * PD_NS_PER_MS;
        snprintf(r->reserved_by, sizeof r->reserved_by, "%s", q->relay_id ? q->relay_id : "");
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
        if (node_reply(call, &m.base) == PD_ECANCELLED) {
            PD_INFO(r->id, "Reserve cancelled by its caller; blocks freed");
            drop_reservation(n, r);
        }
    }
    pthread_mutex_unlock(&n->mu);
    if (rc == PD_EBUSY) /* no room: the scheduler retries every 10 ms while it lasts */
        PD_WARN_EVERY(1000, q->request_id, "Reserve refused: %s", msg);
    else if (rc < 0)
        PD_WARN(q->request_id, "Reserve refused: %s", msg);
    if (rc < 0) pd_rpc_fail(call, node_rpc_status(rc), msg);
    pd__reserve_request__free_unpacked(q, NULL);
}

static void h_decode(void *ctx, pd_rpc_call *call, const uint8_t *b, size_t len)
{
    pd_node *n = ctx;
    Pd__DecodeRequest *q = pd__decode_request__unpack(NULL, len, b);
    if (!q || !node_valid_request_id(q->request_id) || q->n_prompt_ids == 0) {
        if (q) pd__decode_request__free_unpacked(q, NULL);
        pd_rpc_stream_end(call, PD_RPC_INVALID_ARGUMENT,
                          "Decode: request_id and prompt_ids are required");
        return;
    }
    if (node_defer_guided(n, call, q->sampling, h_decode, b, len)) {
        pd__decode_request__free_unpacked(q, NULL);
        return;
    }
    int st = PD_RPC_OK;
    char msg[512] = "";
    pthread_mutex_lock(&n->mu);
    bool local = q->local_prefill;
    req *r = node_req_find(n, q->request_id);
    if (!r) {
        st = PD_RPC_NOT_FOUND;
        snprintf(msg, sizeof msg, "Decode %s: no reservation (expired or aborted)", q->request_id);
    } else if (r->decoding || r->local != local) {
        st = PD_RPC_ALREADY_EXISTS;
        snprintf(msg, sizeof msg, "Decode %s: %s", q->request_id,
                 r->decoding ? "already decoding" : "local_prefill differs from its Reserve's");
    } else if (!local && r->kv_ranks_done < n->n_ranks) {
        st = PD_RPC_FAILED_PRECONDITION;
        snprintf(msg, sizeof msg, "Decode %s: KV not received yet (%d of %d ranks)", q->request_id,
                 r->kv_ranks_done, n->n_ranks);
    } else {
        pd_sampling_params sp;
        int rc = pd_msg_sampling_from_proto(q->sampling, r->arena, &sp);
        if (rc == PD_OK) {
            pd_engine_request er = {.request_id = r->id,
                                    .prompt_ids = q->prompt_ids,
                                    .n_prompt = q->n_prompt_ids,
                                    .sampling = &sp,
                                    .phase = PD_PHASE_FULL};
            rc = local ? pd_engine_add(n->e, &er) /* prefilled here, as pd-generate does */
                       : pd_engine_add_imported(n->e, &er, q->first_token);
        }
        if (rc < 0) {
            st = node_rpc_status(rc);
            snprintf(msg, sizeof msg, "%s", pd_last_error());
            pd_engine_abort(n->e, r->id);
            node_req_remove(n, r);
        } else {
            r->call = call;
            r->decoding = true;
            r->finals = sp.use_beam_search ? sp.n : 1;
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
        pd_rpc_on_cancel(call, node_on_call_cancelled, n);
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
    if (!k || node_ev_list_grow(&r->rl->batch, k) < 0) return; /* no room: they wait for the next */
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
static void relay_event(pd_node *n, req *r, const pd_engine_event *ev, bool last)
{
    pd_arena *a = pd_arena_create(1024);
    Pd__TokenEvent *m = a ? node_event_to_proto(ev, a) : NULL;
    size_t len = 0;
    uint8_t *buf = NULL;
    if (m) {
        m->request_id = r->id;
        buf = pd_msg_pack(&m->base, &len);
    }
    pd_arena_free(a);
    bool waiting = r->held.n > 0;
    int rc = buf ? node_ev_list_push(&r->held, buf, len) : PD_ENOMEM;
    if (rc < 0) {
        pd_rpc_stream_end(r->call, PD_RPC_INTERNAL, "out of memory relaying an event");
        if (!ev->final) pd_engine_abort(n->e, r->id);
        node_req_remove(n, r);
        return;
    }
    r->finished = last;
    relay_release(r);
    n->relay_pauses += !waiting && r->held.n > 0;
}

/* Dispatcher: a decode request's event. Called with n->mu held. */
void node_decode_event(pd_node *n, req *r, const pd_engine_event *ev)
{
    if (!r->call) { /* a reservation aborted before Decode: nothing to tell */
        if (ev->final) node_req_remove(n, r);
        return;
    }
    bool first = !r->first_seen;
    r->first_seen = true;
    /* the first token came to the scheduler from the prefill side already (not when it was
       prefilled here) */
    if (first && !r->local && !ev->final && ev->n_tokens) return;
    if (r->caller_gone) {
        /* cancelled: nobody reads its events, and its final one (the abort's, or the end of a
           generation the abort came too late for) ends the call now (relayed: not after the
           wait for a cancel that already came) */
        if (ev->final) {
            pd_rpc_stream_end(r->call, PD_RPC_CANCELLED, "");
            node_req_remove(n, r);
        }
        return;
    }
    /* a beam search's n choices end one by one: its call ends with the last */
    bool last = ev->final && (ev->status < 0 || --r->finals <= 0);
    if (r->rl && ev->status >= 0) {
        relay_event(n, r, ev, last);
        return;
    }
    if (ev->status < 0) {
        int st = ev->status == PD_ECANCELLED ? PD_RPC_CANCELLED : node_rpc_status(ev->status);
        pd_rpc_stream_end(r->call, st, ev->error && ev->error[0] ? ev->error : "decode failed");
        node_req_remove(n, r);
        return;
    }
    pd_arena *a = pd_arena_create(1024);
    Pd__TokenEvent *m = a ? node_event_to_proto(ev, a) : NULL;
    size_t len = 0;
    uint8_t *buf = m ? pd_msg_pack(&m->base, &len) : NULL;
    int rc = buf ? pd_rpc_stream_send(r->call, buf, len) : PD_ENOMEM;
    free(buf);
    pd_arena_free(a);
    if (rc == PD_ECANCELLED) {
        pd_engine_abort(n->e, r->id); /* the final cancelled event ends it */
        return;
    }
    if (last || rc < 0) {
        pd_rpc_stream_end(r->call, rc < 0 ? PD_RPC_INTERNAL : PD_RPC_OK, "");
        if (!last) pd_engine_abort(n->e, r->id);
        node_req_remove(n, r);
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
    if (rl) PD_IDMAP_FOREACH(&n->reqs, l, nx)
        {
            req *r = REQ_OF(l);
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
                node_req_remove(n, r);
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
        node_ev_list_free(&rl->batch);
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
    if (!q || !node_valid_request_id(q->request_id)) {
        if (q) pd__pause_request__free_unpacked(q, NULL);
        pd_rpc_fail(call, PD_RPC_INVALID_ARGUMENT, "Pause: malformed request");
        return;
    }
    Pd__PauseReply m = PD__PAUSE_REPLY__INIT;
    pthread_mutex_lock(&n->mu);
    req *r = node_req_find(n, q->request_id);
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
    node_reply(call, &m.base);
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
        PD_IDMAP_FOREACH(&n->reqs, l, nx)
        {
            req *r = REQ_OF(l);
            if (r->done && now - r->done_ns > (int64_t)RELAY_DONE_TTL_MS * PD_NS_PER_MS) {
                PD_WARN(r->id, "relayed request not closed by its caller; ending it");
                pd_rpc_stream_end(r->call, PD_RPC_OK, "");
                node_req_remove(n, r);
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

void node_relays_flush(pd_node *n)
{
    pthread_mutex_lock(&n->mu);
    for (relay *rl = n->relays; rl; rl = rl->next) relay_flush(n, rl);
    pthread_mutex_unlock(&n->mu);
}

int node_decode_start(pd_node *n)
{
    n->rx = calloc((size_t)n->n_ranks, sizeof *n->rx);
    if (!n->rx) return pd_error(PD_ENOMEM, "out of memory");
    for (int r = 0; r < n->n_ranks; r++) {
        size_t layer0;
        pd_kv_rx_params rp = {.host = n->inst->devices[r].device_ip,
                              .port = 0,
                              .backend = pd_engine_backend(n->e, r),
                              .kv = pd_engine_kv(n->e, r),
                              .kv_params = pd_engine_rank_kv(n->e, r, &layer0),
                              .head0 = n->kvp.n_kv_heads * (size_t)(r % n->tp)};
        rp.layer0 = layer0;
        PD_CHECK(pd_kv_tcp_receiver_start(&rp, on_kv_imported, n, &n->rx[r]));
    }
    pthread_create(&n->reaper, NULL, reaper_main, n);
    n->reaper_started = true;
    return PD_OK;
}

void node_decode_stop(pd_node *n)
{
    if (n->reaper_started) pthread_join(n->reaper, NULL);
    n->reaper_started = false;
    for (int r = 0; n->rx && r < n->n_ranks; r++) pd_kv_tcp_receiver_stop(n->rx[r]);
    free(n->rx);
    n->rx = NULL;
    while (n->relays) { /* the server stopped before their callers cancelled them */
        relay *rl = n->relays;
        n->relays = rl->next;
        node_ev_list_free(&rl->batch);
        free(rl);
    }
}

size_t node_decode_methods(pd_node *n, pd_rpc_method *m)
{
    m[0] = (pd_rpc_method){"/pd.PD/Reserve", PD_RPC_UNARY, h_reserve, n};
    m[1] = (pd_rpc_method){"/pd.PD/Decode", PD_RPC_SERVER_STREAM, h_decode, n};
    m[2] = (pd_rpc_method){"/pd.PD/Relay", PD_RPC_SERVER_STREAM, h_relay, n};
    m[3] = (pd_rpc_method){"/pd.PD/Pause", PD_RPC_UNARY, h_pause, n};
    return 4;
}

bool node_decode_abort(pd_node *n, const char *id)
{
    pthread_mutex_lock(&n->mu);
    req *r = node_req_find(n, id);
    bool found = r && !r->decoding;
    if (found) { /* a reservation nobody decodes: drop it now */
        for (int k = 0; k < n->n_ranks; k++) pd_kv_rx_cancel(n->rx[k], r->id);
        node_req_remove(n, r);
    }
    pthread_mutex_unlock(&n->mu);
    return found;
}
