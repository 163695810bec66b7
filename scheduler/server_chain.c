/* pd-scheduler: the PD chain of one choice, on the gRPC client thread: Reserve on its decode
 * instance D, Prefill on its prefill instance P (which moves the prompt's KV into the blocks D
 * reserved), then the Decode stream on D; and the hand-over of results to the loop.
 *
 * Design: each step is started from the callback of the step before, so no thread ever waits
 * on an instance. A step checks the request's aborted flag under its mutex before it starts a
 * call and records the call's id, so the loop can cancel whatever is in flight (srv_abort_chains).
 * A failure before anything reached the client is retried elsewhere (another prefill instance;
 * another decode instance for a Reserve whose instance is gone); later ones fail the choice.
 * The chain never touches a socket: it appends to the choice under the request's mutex and puts
 * the request on the ready list, with one loop wake-up per burst of callbacks (srv_post_ready).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rpc/pd_msg.h"
#include "server_internal.h"
#include "transfer/kv_tcp.h"
#include "util/fmt.h"
#include "util/log.h"

void srv_post_ready(sreq *r)
{
    pd_apiserver *s = r->s;
    pthread_mutex_lock(&s->qmu);
    if (!s->closing && !r->queued) {
        r->queued = true;
        r->next_ready = NULL;
        if (s->ready_tail)
            s->ready_tail->next_ready = r;
        else
            s->ready_head = r;
        s->ready_tail = r;
    }
    /* on the rpc thread the wake-up waits for the end of the burst (srv_on_rpc_idle): one loop
     * wake-up per burst of tokens, not per token. Under the lock: the loop sets closing under
     * it before closing the handle. */
    if (pd_rpc_on_client_thread())
        s->wake_pending = true;
    else if (!s->closing)
        uv_async_send(&s->async);
    pthread_mutex_unlock(&s->qmu);
}

/* The rpc thread's burst of callbacks is over: wake the loop once for all of it. */
void srv_on_rpc_idle(void *arg)
{
    pd_apiserver *s = arg;
    pthread_mutex_lock(&s->qmu);
    if (s->wake_pending && !s->closing) uv_async_send(&s->async);
    s->wake_pending = false;
    pthread_mutex_unlock(&s->qmu);
}

int srv_pick_for(pd_apiserver *s, const choice *c, rt_role role, int exclude, int64_t *charged)
{
    const pd_api_prompt *pr = &c->r->req.prompts[c->prompt_idx];
    int64_t tokens = (int64_t)pr->n_ids + (role == RT_ROLE_DECODE ? pr->max_tokens : 0), hit = 0;
    int k = pd_reg_pick_cached(s->reg, role, pr->ids, pr->n_ids, tokens, exclude, &hit);
    *charged = tokens - hit;
    return k;
}

static void chain_fail(choice *c, int http, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void chain_fail(choice *c, int http, const char *fmt, ...)
{
    sreq *r = c->r;
    pthread_mutex_lock(&r->mu);
    if (!c->err_http) {
        c->err_http = http;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(c->err, sizeof c->err, fmt, ap);
        va_end(ap);
    }
    c->chain_done = true;
    srv_post_ready(r); /* before unlocking: once chain_done is visible the loop may free r */
    pthread_mutex_unlock(&r->mu);
}

void srv_chain_end(choice *c)
{
    sreq *r = c->r;
    pthread_mutex_lock(&r->mu);
    c->chain_done = true;
    srv_post_ready(r); /* before unlocking: once chain_done is visible the loop may free r */
    pthread_mutex_unlock(&r->mu);
}

void srv_noop_done(void *arg, int st, const char *d, const uint8_t *resp, size_t len)
{
    (void)arg, (void)st, (void)d, (void)resp, (void)len;
}

void srv_send_abort(pd_apiserver *s, int k, const char *sub_id)
{
    Pd__AbortRequest q = PD__ABORT_REQUEST__INIT;
    q.request_id = (char *)sub_id;
    uint8_t buf[128];
    if (pd__abort_request__get_packed_size(&q) > sizeof buf) return;
    size_t len = pd__abort_request__pack(&q, buf);
    pd_reg_unary(s->reg, k, "/pd.PD/Abort", buf, len, s->p.rpc_timeout_ms, srv_noop_done, NULL,
                 NULL);
}

/* Starts a call of phase ph unless the request was aborted; records its id for cancellation. */
static bool chain_begin(choice *c, int ph)
{
    pthread_mutex_lock(&c->r->mu);
    bool ok = !c->r->aborted;
    if (ok) c->in_phase[ph] = true;
    pthread_mutex_unlock(&c->r->mu);
    return ok;
}

/* Packs m, the request of phase ph's call, and starts that phase: the buffer (malloc'd), or
 * NULL when packing failed (the choice failed) or the request was aborted (the chain ended). */
static uint8_t *chain_pack(choice *c, int ph, const ProtobufCMessage *m, size_t *len)
{
    uint8_t *buf = pd_msg_pack(m, len);
    if (!buf) {
        chain_fail(c, 500, "out of memory packing the %s request",
                   ph == PH_PREFILL ? "Prefill" : "Decode");
        return NULL;
    }
    if (!chain_begin(c, ph)) { /* aborted: D holds the reservation (or the KV) */
        free(buf);
        srv_send_abort(c->r->s, c->d_node, c->sub_id);
        srv_chain_end(c);
        return NULL;
    }
    return buf;
}

static void chain_started(choice *c, int ph, uint64_t id)
{
    pthread_mutex_lock(&c->r->mu);
    c->call_id[ph] = id;
    /* aborted, or (a Prefill) its decode instance was lost before the id was known here */
    bool cancel = c->r->aborted || (ph == PH_PREFILL && c->decode_lost);
    pthread_mutex_unlock(&c->r->mu);
    if (cancel) pd_rpc_cancel(c->r->s->rpc, id);
}

/* Decode instances a choice moves on to after the first fails it before Decode. */
enum { DECODE_RETRIES = 3 };

static void on_prefill_done(void *arg, int st, const char *details, const uint8_t *resp,
                            size_t len);
static void start_decode(choice *c, Pd__SamplingParams *sp, int32_t first, bool local);

/* c's decode instance failed it before anything reached the client (its Reserve found it gone,
 * or it did not take the prompt's KV): the reservation is given up and the loop picks another
 * decode instance for c (srv_admit_wait). gone: the instance cannot be reached, so it leaves
 * the routing set now (not for a refusal: its other streams may be well). Should it come back,
 * it drops the reservation nobody will use. */
static void retry_decode(choice *c, const char *what, const char *details, bool gone)
{
    sreq *r = c->r;
    c->reserve_tries++;
    PD_WARN(r->id, "%s of %s on %s failed: %s; trying another decode instance", what, c->sub_id,
            pd_reg_name(r->s->reg, c->d_node), details);
    if (gone) pd_reg_report_failure(r->s->reg, c->d_node, details);
    srv_send_abort(r->s, c->d_node, c->sub_id);
    c->d_avoid = c->d_node;
    free(c->block_ids);
    c->block_ids = NULL;
    c->n_block_ids = 0;
    pthread_mutex_lock(&r->mu);
    /* The next try reserves under a fresh id: the decode instance runs calls concurrently, so
       the Abort just sent may reach it after the next Reserve (on the same instance, the only
       one or the one picked again), which would then find the old reservation (ALREADY_EXISTS)
       or be freed by it. Nothing has a Decode call or relay under the old id yet. */
    srv_choice_sub_id(r, c->index, c->reserve_tries, c->sub_id, sizeof c->sub_id);
    c->in_phase[PH_PREFILL] = false; /* the next Reserve is the call in flight */
    c->call_id[PH_PREFILL] = 0;
    c->decode_lost = false;
    c->reserve_retry = true;
    srv_post_ready(r);
    pthread_mutex_unlock(&r->mu);
}

void srv_choice_sub_id(const sreq *r, int i, int tries, char *out, size_t cap)
{
    char id[64];
    if (r->n_choices == 1)
        snprintf(id, sizeof id, "%s", r->id);
    else
        snprintf(id, sizeof id, "%s-%d", r->id, i);
    size_t n = strlen(id);
    if (tries > 0) snprintf(id + n, sizeof id - n, ".%d", tries);
    if (strlen(id) >= PD_KV_REQUEST_ID_MAX) id[n] = '\0'; /* no room: the id as before */
    snprintf(out, cap, "%s", id);
}

static void start_prefill(choice *c)
{
    sreq *r = c->r;
    pd_apiserver *s = r->s;
    const pd_api_prompt *pr = &r->req.prompts[c->prompt_idx];
    Pd__PrefillRequest q = PD__PREFILL_REQUEST__INIT;
    q.request_id = c->sub_id;
    q.prompt_ids = pr->ids;
    q.n_prompt_ids = pr->n_ids;
    q.sampling = &c->sampling;
    Pd__SamplingParams plain;
    if (c->sampling.use_beam_search) {
        /* a search's prefill computes the prompt's KV only: its token is not used, the decode
         * instance expands the beams (docs/beam_search.md) */
        plain = c->sampling;
        plain.use_beam_search = false;
        plain.best_of = plain.early_stopping = 0;
        plain.length_penalty = 0.0;
        plain.n = 1;
        plain.min_tokens = 2; /* no stop token may end it there: its KV must move */
        plain.max_tokens = -1;
        plain.n_stop = 0;
        plain.logprobs = -1;
        q.sampling = &plain;
    }
    q.targets = c->targets;
    q.n_targets = c->n_targets;
    q.decode_block_ids = c->block_ids;
    q.n_decode_block_ids = c->n_block_ids;
    q.decode_cached_tokens = c->decode_cached;
    /* half the call's deadline: a decode side that does not take the KV (its data plane cut
       off, say) fails the call ABORTED while there is time to try another decode instance */
    q.lease_ms = srv_prefill_timeout_ms(s) / 2;
    size_t len = 0;
    uint8_t *buf = chain_pack(c, PH_PREFILL, &q.base, &len);
    if (!buf) return;
    pthread_mutex_lock(&r->mu);
    int pk = c->p_node;
    pthread_mutex_unlock(&r->mu);
    uint64_t id = 0;
    pd_reg_unary(s->reg, pk, "/pd.PD/Prefill", buf, len, srv_prefill_timeout_ms(s), on_prefill_done,
                 c, &id);
    free(buf);
    chain_started(c, PH_PREFILL, id);
}

static void on_decode_done(void *arg, int st, const char *details, const uint8_t *resp, size_t len)
{
    choice *c = arg;
    (void)resp, (void)len;
    srv_cmap_del(c->r->s, c);
    pthread_mutex_lock(&c->r->mu);
    bool aborted = c->r->aborted;
    bool final_seen = c->final_rx;
    pthread_mutex_unlock(&c->r->mu);
    if (st == PD_RPC_INVALID_ARGUMENT && !aborted && !final_seen) {
        /* refused by the decode instance's engine (a beam search its pool cannot hold, a
           best_of above its max_num_seqs): the request's fault, with the engine's words */
        chain_fail(c, 400, "%s", details && *details ? details : "Decode: invalid request");
        return;
    }
    if (st != PD_RPC_OK && !aborted && !final_seen) {
        PD_WARN(c->r->id, "Decode stream of %s ended with %s: %s", c->sub_id,
                pd_rpc_status_name(st), details);
        /* the instance's own error for the request (a grammar it cannot follow, memory) is
           passed on in its words; a broken connection or a deadline is the instance gone */
        bool gone = st == PD_RPC_UNAVAILABLE || st == PD_RPC_DEADLINE_EXCEEDED ||
                    st == PD_RPC_CANCELLED || !details || !*details;
        if (gone)
            chain_fail(c, 500, "Generation failed: the decode instance stopped responding.");
        else
            chain_fail(c, 500, "Generation failed: %s", details);
        return;
    }
    srv_chain_end(c);
}

static void on_prefill_done(void *arg, int st, const char *details, const uint8_t *resp, size_t len)
{
    choice *c = arg;
    sreq *r = c->r;
    pd_apiserver *s = r->s;
    pthread_mutex_lock(&r->mu);
    int pk = c->p_node;
    bool aborted = r->aborted;
    pthread_mutex_unlock(&r->mu);
    if (st == PD_RPC_OK) pd_reg_prefill_done(s->reg, pk, c->p_tokens);
    pd_reg_release(s->reg, pk, c->p_tokens);
    c->p_tokens = 0; /* given back: the loop gives back only what a chain still holds */
    if (aborted) {
        /* srv_abort_chains passes a chain that ended by then: the reservation on D is ours to free
         */
        srv_send_abort(s, c->d_node, c->sub_id);
        srv_chain_end(c);
        return;
    }
    Pd__PrefillReply *m = st == PD_RPC_OK ? pd__prefill_reply__unpack(NULL, len, resp) : NULL;
    pthread_mutex_lock(&r->mu);
    bool decode_lost = c->decode_lost;
    pthread_mutex_unlock(&r->mu);
    if (!m && (st == PD_RPC_ABORTED || decode_lost) && c->reserve_tries < DECODE_RETRIES) {
        /* the decode side did not take the KV (ABORTED: gone, refused or out of time), or left
           the routing set meanwhile (instance_lost cancelled the call): nothing has reached the
           client, so the prompt goes to another decode instance, prefilled again */
        srv_send_abort(s, pk, c->sub_id);
        retry_decode(c, "Prefill", details, false); /* the queue picks both instances again */
        return;
    }
    if (!m || !m->first) {
        /* nothing has reached the client: try another prefill instance */
        PD_WARN(r->id, "Prefill of %s on %s failed: %s: %s", c->sub_id, pd_reg_name(s->reg, pk),
                pd_rpc_status_name(st), m ? "reply without a first token" : details);
        if (m) pd__prefill_reply__free_unpacked(m, NULL);
        srv_send_abort(s, pk, c->sub_id);
        int64_t charged = 0;
        int next = c->attempts < 2 ? srv_pick_for(s, c, RT_ROLE_PREFILL, pk, &charged) : -1;
        if (next >= 0) {
            c->attempts++;
            c->p_tokens = charged;
            pthread_mutex_lock(&r->mu);
            c->p_node = next;
            pthread_mutex_unlock(&r->mu);
            PD_INFO(r->id, "retrying the prefill of %s on %s", c->sub_id,
                    pd_reg_name(s->reg, next));
            start_prefill(c);
            return;
        }
        /* out of time: the prefill instances are busy (or stuck), not the request wrong */
        chain_fail(c, st == PD_RPC_DEADLINE_EXCEEDED ? 503 : 500, "Prefill failed: %s: %s",
                   pd_rpc_status_name(st), details && *details ? details : "no reply");
        return;
    }
    pthread_mutex_lock(&r->mu);
    c->kv_bytes = m->kv_bytes;
    pd_str_copy(c->kv_transport, sizeof c->kv_transport, m->kv_transport);
    c->kv_seconds = m->kv_seconds;
    c->prefill_seconds = m->prefill_seconds;
    c->cached_tokens = m->cached_tokens;
    bool beam = c->sampling.use_beam_search; /* its first token is not the answer's */
    if (m->first->status != 0) {
        c->err_http = 500;
        snprintf(c->err, sizeof c->err, "Generation failed: %s", m->first->error);
    } else {
        if (m->first->prompt_logprobs) { /* kept for the response; the loop reads them */
            if (c->plp) pd__prompt_logprobs__free_unpacked(c->plp, NULL);
            c->plp = m->first->prompt_logprobs;
            m->first->prompt_logprobs = NULL;
        }
        if (!beam) srv_rec_push(&c->pending, m->first);
    }
    bool final = (m->first->final && !beam) || m->first->status != 0;
    pthread_mutex_unlock(&r->mu);
    int32_t first = m->first->n_token_ids && !beam ? m->first->token_ids[0] : -1;
    uint64_t seed = m->seed;
    pd__prefill_reply__free_unpacked(m, NULL);
    if (final) {
        srv_send_abort(s, c->d_node, c->sub_id); /* frees the reservation if D still holds it */
        srv_chain_end(c);
        return;
    }
    srv_post_ready(r);
    /* Decode on D with the seed in use */
    Pd__SamplingParams ds = c->sampling;
    ds.has_seed = true;
    ds.seed = (int64_t)seed;
    ds.has_prompt_logprobs = false; /* the prefill computed them */
    start_decode(c, &ds, first, false);
}

/* The Decode stream of c on its decode instance: after its Prefill (first: the token P sampled,
 * sp with the seed P used), or for the whole request (local: D prefills the prompt itself). */
static void start_decode(choice *c, Pd__SamplingParams *sp, int32_t first, bool local)
{
    sreq *r = c->r;
    pd_apiserver *s = r->s;
    const pd_api_prompt *pr = &r->req.prompts[c->prompt_idx];
    Pd__DecodeRequest q = PD__DECODE_REQUEST__INIT;
    q.request_id = c->sub_id;
    q.prompt_ids = pr->ids;
    q.n_prompt_ids = pr->n_ids;
    q.sampling = sp;
    q.first_token = first;
    q.local_prefill = local;
    char relay_id[48];
    srv_relay_for(s, c->d_node, relay_id);
    q.relay_id = relay_id;
    q.relay_credit = srv_choice_credit(c);
    size_t qlen = 0;
    uint8_t *buf = chain_pack(c, PH_DECODE, &q.base, &qlen);
    if (!buf) return;
    if (relay_id[0]) {
        pthread_mutex_lock(&r->mu);
        c->relayed = true;
        c->credit = q.relay_credit;
        pthread_mutex_unlock(&r->mu);
        srv_cmap_add(s, c);
    }
    uint64_t id = 0;
    /* no deadline: a generation may last any time; a decode instance that stops answering
       its heartbeat fails its streams (instance_lost), a client that leaves cancels them */
    pd_reg_stream(s->reg, c->d_node, "/pd.PD/Decode", buf, qlen, PD_RPC_NO_DEADLINE,
                  srv_on_decode_msg, on_decode_done, c, &id);
    free(buf);
    chain_started(c, PH_DECODE, id);
}

static void on_reserve_done(void *arg, int st, const char *details, const uint8_t *resp, size_t len)
{
    choice *c = arg;
    sreq *r = c->r;
    pthread_mutex_lock(&r->mu);
    bool aborted = r->aborted;
    pthread_mutex_unlock(&r->mu);
    if (aborted) {
        if (st == PD_RPC_OK) srv_send_abort(r->s, c->d_node, c->sub_id);
        srv_chain_end(c);
        return;
    }
    if ((st == PD_RPC_UNAVAILABLE || st == PD_RPC_CANCELLED) && c->reserve_tries < DECODE_RETRIES) {
        /* the instance died since the last heartbeat (or the heartbeat found it gone while the
           call waited: instance_lost cancelled it) */
        retry_decode(c, "Reserve", details, true);
        return;
    }
    if (st == PD_RPC_RESOURCE_EXHAUSTED) {
        /* the decode instance has no KV room now: the loop queues the choice and retries */
        pthread_mutex_lock(&r->mu);
        c->admit_wait = true;
        srv_post_ready(r);
        pthread_mutex_unlock(&r->mu);
        return;
    }
    Pd__ReserveReply *m = st == PD_RPC_OK ? pd__reserve_reply__unpack(NULL, len, resp) : NULL;
    if (!m) {
        chain_fail(c, 500, "Reserve on the decode instance failed: %s: %s", pd_rpc_status_name(st),
                   details && *details ? details : "bad reply");
        return;
    }
    c->block_ids = malloc((m->n_block_ids ? m->n_block_ids : 1) * sizeof *c->block_ids);
    if (!c->block_ids) {
        pd__reserve_reply__free_unpacked(m, NULL);
        chain_fail(c, 500, "out of memory");
        return;
    }
    if (m->n_block_ids) memcpy(c->block_ids, m->block_ids, m->n_block_ids * sizeof *c->block_ids);
    c->n_block_ids = m->n_block_ids;
    c->decode_cached = m->cached_tokens;
    pd__reserve_reply__free_unpacked(m, NULL);
    pthread_mutex_lock(&r->mu);
    c->admitted = true; /* after a retry from the queue, the next queued choice may go */
    srv_post_ready(r);
    pthread_mutex_unlock(&r->mu);
    if (c->local)
        start_decode(c, &c->sampling, -1, true);
    else
        start_prefill(c);
}

void srv_send_reserve(choice *c)
{
    sreq *r = c->r;
    pd_apiserver *s = r->s;
    const pd_api_prompt *pr = &r->req.prompts[c->prompt_idx];
    Pd__ReserveRequest q = PD__RESERVE_REQUEST__INIT;
    q.request_id = c->sub_id;
    q.num_prompt_tokens = (int64_t)pr->n_ids;
    q.ttl_ms = srv_prefill_timeout_ms(s);
    q.prompt_ids = pr->ids; /* the decode instance's prefix cache may hold its first blocks */
    q.n_prompt_ids = pr->n_ids;
    char relay_id[48];
    srv_relay_for(s, c->d_node, relay_id); /* should this scheduler die, the reservation goes too */
    q.relay_id = relay_id;
    q.local_prefill = c->local;
    size_t len = 0;
    uint8_t *buf = pd_msg_pack(&q.base, &len);
    if (!buf) {
        chain_fail(c, 500, "out of memory packing the Reserve request");
        return;
    }
    pthread_mutex_lock(&r->mu);
    c->in_phase[PH_RESERVE] = true;
    pthread_mutex_unlock(&r->mu);
    uint64_t id = 0;
    pd_reg_unary(s->reg, c->d_node, "/pd.PD/Reserve", buf, len, s->p.rpc_timeout_ms,
                 on_reserve_done, c, &id);
    free(buf);
    pthread_mutex_lock(&r->mu);
    c->call_id[PH_RESERVE] = id;
    pthread_mutex_unlock(&r->mu);
}
