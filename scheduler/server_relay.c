/* pd-scheduler: token events into choices (rpc thread), and backpressure from the client back
 * to the decode instances.
 *
 * Design: token events arrive batched. Per decode instance the scheduler keeps one Relay stream
 * open (pd.proto), named in each DecodeRequest, on which the node sends one RelayBatch per decode
 * step with the events of all this scheduler's requests, instead of one gRPC message per token
 * on each Decode stream (gRPC's per-message cost was most of the relay's CPU). A relayed
 * choice's Decode stream carries no message; it stays open until the final event has come
 * over the relay, and is then cancelled here, so aborts, node failures and the chain's end
 * work exactly as for a Decode stream that carries the events itself (which is what a node
 * does when the relay was not open yet). The rpc thread maps request ids to choices (relay
 * events name their request) from the Decode call's start to its end. Backpressure: a Decode
 * stream that carries the events is paused where it is read; a relayed choice has a credit of
 * packed event bytes, and a Pause call grants more while the client keeps up.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server_internal.h"
#include "util/log.h"

void srv_rec_buf_free(rec_buf *b)
{
    free(b->top_ids);
    free(b->top_lps);
    free(b->recs);
    pd_sb_free(&b->text);
    memset(b, 0, sizeof *b);
}

/* Appends token i of ev's n (one record each; an event without a token is one record): ev's
 * text, finish and stop reason go with the last, each token's logprobs with its own. */
static void rec_push_token(rec_buf *b, const Pd__TokenEvent *ev, size_t i, size_t n)
{
    if (b->n == b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 16;
        tok_rec *p = realloc(b->recs, cap * sizeof *p);
        if (!p) return; /* dropped; the final record still ends the choice via chain_done */
        b->recs = p;
        b->cap = cap;
    }
    bool last = i + 1 == n;
    tok_rec *t = &b->recs[b->n++];
    memset(t, 0, sizeof *t);
    t->text_off = b->text.len;
    if (last) pd_sb_add(&b->text, ev->text.data ? (const char *)ev->text.data : "", ev->text.len);
    t->text_len = last ? ev->text.len : 0;
    t->n_tokens = ev->n_token_ids ? 1 : 0;
    t->final = last && ev->final;
    snprintf(t->finish, sizeof t->finish, "%s", last && ev->finish_reason ? ev->finish_reason : "");
    t->stop_kind = last ? ev->stop_kind : 0;
    t->stop_token = ev->stop_token;
    t->stop_off = b->text.len;
    t->stop_len = last && ev->stop_string ? strlen(ev->stop_string) : 0;
    if (t->stop_len) pd_sb_add(&b->text, ev->stop_string, t->stop_len);
    t->prompt_tokens = ev->prompt_tokens;
    t->token = ev->n_token_ids ? ev->token_ids[i] : -1;
    bool each = ev->n_token_logprobs == n; /* a beam's answer: per token */
    t->has_logprob = ev->has_logprob;
    t->logprob = each ? ev->token_logprobs[i] : ev->logprob;
    size_t k = each ? ev->n_top_logprobs / n : ev->n_top_logprobs;
    Pd__TopLogprob *const *top = ev->top_logprobs + (each ? i * k : 0);
    t->top_off = b->n_top;
    if (k && b->n_top + k > b->cap_top) {
        size_t cap = b->cap_top ? b->cap_top : 64;
        while (cap < b->n_top + k) cap *= 2;
        int32_t *ids = realloc(b->top_ids, cap * sizeof *ids);
        if (ids) b->top_ids = ids;
        float *lps = ids ? realloc(b->top_lps, cap * sizeof *lps) : NULL;
        if (lps) b->top_lps = lps;
        if (ids && lps) b->cap_top = cap;
    }
    if (b->n_top + k <= b->cap_top) {
        for (size_t j = 0; j < k; j++) {
            b->top_ids[b->n_top + j] = top[j]->id;
            b->top_lps[b->n_top + j] = top[j]->logprob;
        }
        t->n_top = k;
        b->n_top += k;
    }
}

void srv_rec_push(rec_buf *b, const Pd__TokenEvent *ev)
{
    size_t n = ev->n_token_ids ? ev->n_token_ids : 1;
    for (size_t i = 0; i < n; i++) rec_push_token(b, ev, i, n);
}

typedef struct { /* which Relay stream a callback belongs to */
    pd_apiserver *s;
    int k, gen;
} relay_ctx;

/* The map is the rpc thread's: entries are added before a relayed Decode call starts and
 * removed when it ends, both on that thread, where relay batches are read too. */
void srv_cmap_add(pd_apiserver *s, choice *c)
{
    pd_idmap_put(&s->cmap, &c->map_link, c->sub_id);
    c->mapped = true;
}

void srv_cmap_del(pd_apiserver *s, choice *c)
{
    if (!c->mapped) return;
    pd_idmap_del(&s->cmap, &c->map_link);
    c->mapped = false;
}

static choice *cmap_find(pd_apiserver *s, const char *id)
{
    pd_idmap_link *l = pd_idmap_get(&s->cmap, id);
    return l ? PD_IDMAP_ENTRY(l, choice, map_link) : NULL;
}

static void on_relay_msg(void *arg, const uint8_t *msg, size_t len);

static void on_relay_done(void *arg, int st, const char *details, const uint8_t *resp, size_t len)
{
    relay_ctx *x = arg;
    pd_apiserver *s = x->s;
    (void)resp, (void)len;
    pthread_mutex_lock(&s->rl_mu);
    if (s->relays[x->k].gen == x->gen) s->relays[x->k].open = false;
    pthread_mutex_unlock(&s->rl_mu);
    if (st != PD_RPC_CANCELLED) /* its requests fail through their own Decode streams */
        PD_WARN(NULL, "relay stream on %s ended: %s: %s", pd_reg_name(s->reg, x->k),
                pd_rpc_status_name(st), details ? details : "");
    free(x);
}

/* The relay id of decode instance k for a new DecodeRequest (out: 48 bytes), opening the
 * stream when none is open. The node sends the events on the Decode stream itself when it does
 * not know the id (the stream failed to start or is not there yet), which works as well. */
void srv_relay_for(pd_apiserver *s, int k, char *out)
{
    pthread_mutex_lock(&s->rl_mu);
    relay_st *rl = &s->relays[k];
    bool start = !rl->open;
    if (start) {
        rl->open = true;
        rl->gen++;
        snprintf(rl->id, sizeof rl->id, "%s-%d-%d", s->relay_tag, k, rl->gen);
    }
    int gen = rl->gen;
    snprintf(out, sizeof rl->id, "%s", rl->id);
    pthread_mutex_unlock(&s->rl_mu);
    if (!start) return;
    relay_ctx *x = malloc(sizeof *x);
    Pd__RelayRequest q = PD__RELAY_REQUEST__INIT;
    q.relay_id = out;
    uint8_t buf[128];
    if (!x || pd__relay_request__get_packed_size(&q) > sizeof buf) {
        free(x);
        pthread_mutex_lock(&s->rl_mu);
        if (rl->gen == gen) rl->open = false;
        pthread_mutex_unlock(&s->rl_mu);
        return;
    }
    *x = (relay_ctx){s, k, gen};
    PD_INFO(NULL, "opening relay stream %s on %s", out, pd_reg_name(s->reg, k));
    uint64_t id = 0;
    pd_reg_stream(s->reg, k, "/pd.PD/Relay", buf, pd__relay_request__pack(&q, buf),
                  PD_RPC_NO_DEADLINE, on_relay_msg, on_relay_done, x, &id);
    pthread_mutex_lock(&s->rl_mu);
    if (rl->gen == gen) rl->call_id = id;
    pthread_mutex_unlock(&s->rl_mu);
}

/* Packed event bytes a relayed request's decode instance may send beyond what the scheduler
 * has written out (DecodeRequest.relay_credit), shared by its choices (at least 2 KiB each):
 * more is granted when half of a choice's is left, unless the client reads slowly. 96 KiB is
 * about 470 events with 20 top logprobs (~800 KiB of SSE), a few thousand without. */
enum { RELAY_CREDIT = 96 * 1024, RELAY_CREDIT_MIN = 2 * 1024 };

uint64_t srv_choice_credit(const choice *c)
{
    uint64_t each = RELAY_CREDIT / (uint64_t)c->r->n_choices;
    return each > RELAY_CREDIT_MIN ? each : RELAY_CREDIT_MIN;
}

flow_op srv_flow_plan(choice *c, bool paused)
{
    flow_op op = {.call_id = c->in_phase[PH_DECODE] ? c->call_id[PH_DECODE] : 0,
                  .relayed = c->relayed,
                  .paused = paused};
    uint64_t window = srv_choice_credit(c);
    if (c->relayed && !paused && c->rx_bytes + window / 2 > c->credit) {
        c->credit = c->rx_bytes + window;
        op.send = true;
        op.seq = ++c->pause_seq;
        op.credit = c->credit;
    }
    return op;
}

typedef struct {
    pd_apiserver *s;
    char sub_id[48];
} grant_ctx;

/* A credit grant that did not reach the decode instance leaves its choice with nothing more
 * coming: its Decode stream is cancelled, which fails the choice as a decode instance that
 * stopped responding. Only statuses that come from the rpc thread (the owner of the request-id
 * map) are acted on; the others mean a scheduler shutting down or a call that never started. */
static void on_grant_done(void *arg, int st, const char *details, const uint8_t *resp, size_t len)
{
    grant_ctx *g = arg;
    (void)resp, (void)len;
    bool lost = st == PD_RPC_DEADLINE_EXCEEDED || st == PD_RPC_UNAVAILABLE ||
                st == PD_RPC_RESOURCE_EXHAUSTED;
    choice *c = lost ? cmap_find(g->s, g->sub_id) : NULL;
    if (c) {
        pthread_mutex_lock(&c->r->mu);
        uint64_t id = c->in_phase[PH_DECODE] ? c->call_id[PH_DECODE] : 0;
        pthread_mutex_unlock(&c->r->mu);
        PD_WARN(c->r->id, "relay credit for %s not granted on %s: %s: %s; ending it", c->sub_id,
                pd_reg_name(g->s->reg, c->d_node), pd_rpc_status_name(st), details);
        if (id) pd_rpc_cancel(g->s->rpc, id);
    }
    free(g);
}

void srv_flow_apply(choice *c, const flow_op *op)
{
    pd_apiserver *s = c->r->s;
    if (!op->relayed) {
        if (op->call_id) pd_rpc_stream_pause(s->rpc, op->call_id, op->paused);
        return;
    }
    if (!op->send) return;
    Pd__PauseRequest q = PD__PAUSE_REQUEST__INIT;
    q.request_id = c->sub_id;
    q.seq = op->seq;
    q.credit = op->credit;
    uint8_t buf[128];
    if (pd__pause_request__get_packed_size(&q) > sizeof buf) return;
    grant_ctx *g = malloc(sizeof *g);
    if (g) *g = (grant_ctx){.s = s}, snprintf(g->sub_id, sizeof g->sub_id, "%s", c->sub_id);
    pd_reg_unary(s->reg, c->d_node, "/pd.PD/Pause", buf, pd__pause_request__pack(&q, buf),
                 s->p.rpc_timeout_ms, g ? on_grant_done : srv_noop_done, g, NULL);
}

/* Token records of one choice the rpc thread may hold for the loop before it stops reading that
 * Decode stream (about 100 KiB of SSE with 20 top logprobs). */
enum { PENDING_PAUSE = 64 };

/* A token event of c, from its Decode stream or its relay (`size` packed bytes; rpc thread). */
static void choice_event(choice *c, const Pd__TokenEvent *ev, size_t size)
{
    pthread_mutex_lock(&c->r->mu);
    c->rx_bytes += size;
    if (ev->status != 0) {
        if (!c->err_http) {
            c->err_http = 500;
            snprintf(c->err, sizeof c->err, "Generation failed: %s", ev->error);
        }
    } else {
        /* a beam search's choice j comes on its leader's chain (pd.proto's TokenEvent.index) */
        int j = ev->index > 0 && ev->index <= c->n_riders ? ev->index : 0;
        srv_rec_push(&c[j].pending, ev);
        c->finals_rx += ev->final;
        c->final_rx = c->finals_rx > c->n_riders;
    }
    /* the loop is behind: stop this choice's Decode stream until it has caught up (what waits
     * here stays bounded; the rest waits on the decode instance, as a relayed choice's does
     * once its credit is used) */
    bool pause = c->pending.n >= PENDING_PAUSE && !c->rx_paused && !c->relayed;
    flow_op op = {0};
    if (pause) {
        c->rx_paused = true;
        op = srv_flow_plan(c, true);
    }
    pthread_mutex_unlock(&c->r->mu);
    if (pause) srv_flow_apply(c, &op);
    srv_post_ready(c->r);
}

void srv_on_decode_msg(void *arg, const uint8_t *msg, size_t len)
{
    choice *c = arg;
    Pd__TokenEvent *ev = pd__token_event__unpack(NULL, len, msg);
    if (!ev) return;
    pthread_mutex_lock(&c->r->mu);
    c->relayed = false; /* the node did not know the relay: this stream carries the events */
    pthread_mutex_unlock(&c->r->mu);
    choice_event(c, ev, 0);
    pd__token_event__free_unpacked(ev, NULL);
}

/* A batch from decode instance k's relay: each event to its choice; a final one ends the
 * choice's Decode stream (cancelled here, as the node expects). */
static void on_relay_msg(void *arg, const uint8_t *msg, size_t len)
{
    relay_ctx *x = arg;
    pd_apiserver *s = x->s;
    Pd__RelayBatch *b = pd__relay_batch__unpack(NULL, len, msg);
    if (!b) {
        PD_WARN(NULL, "relay on %s: undecodable batch of %zu bytes dropped",
                pd_reg_name(s->reg, x->k), len);
        return;
    }
    for (size_t i = 0; i < b->n_events; i++) {
        Pd__TokenEvent *ev = pd__token_event__unpack(NULL, b->events[i].len, b->events[i].data);
        choice *c = ev && ev->request_id ? cmap_find(s, ev->request_id) : NULL;
        uint64_t end_id = 0;
        if (c) {
            choice_event(c, ev, b->events[i].len);
            pthread_mutex_lock(&c->r->mu);
            if (ev->final && c->final_rx) end_id = c->call_id[PH_DECODE];
            pthread_mutex_unlock(&c->r->mu);
        }
        if (ev) pd__token_event__free_unpacked(ev, NULL);
        if (end_id) pd_rpc_cancel(s->rpc, end_id); /* on_decode_done ends the chain */
    }
    pd__relay_batch__free_unpacked(b, NULL);
}
