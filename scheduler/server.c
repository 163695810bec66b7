/* pd-scheduler: start-up, HTTP routes, the per-request PD chain and the SSE relay (sched.h).
 *
 * Threads and ownership:
 * - The libuv loop thread owns sockets, every sreq's client-facing state and its arena.
 * - The gRPC client thread runs each choice's chain Reserve(D) -> Prefill(P) -> Decode(D). It
 *   only reads what the loop built before the chain started (prompt ids, packed sampling
 *   parameters, decode targets) and appends results to the choice's pending records under the
 *   request's mutex, then puts the request on the ready list and wakes the loop (uv_async; the
 *   callback drains the whole list).
 * - Reference counts are touched on the loop thread only: one for the HTTP exchange, one per
 *   running chain (dropped when the loop sees the chain's last record). The request and its
 *   arena are freed in one place, when the count reaches zero.
 * Pending records are double-buffered (swap under the mutex), so the relay allocates nothing per
 * token once the buffers have grown to their working size.
 *
 * Token events arrive batched: per decode instance the scheduler keeps one Relay stream open
 * (pd.proto), named in each DecodeRequest, on which the node sends one RelayBatch per decode
 * step with the events of all this scheduler's requests, instead of one gRPC message per token
 * on each Decode stream (gRPC's per-message cost was most of the relay's CPU). A relayed
 * choice's Decode stream carries no message; it stays open until the final event has come
 * over the relay, and is then cancelled here, so aborts, node failures and the chain's end
 * work exactly as for a Decode stream that carries the events itself (which is what a node
 * does when the relay was not open yet). The rpc thread maps request ids to choices (relay
 * events name their request) from the Decode call's start to its end; backpressure for a
 * relayed choice is a Pause call that makes the node hold its events.
 *
 * n > 1: the choices of one prompt share its KV. The first (the leader) starts at once; the
 * others wait (deferred) until the decode instance has stepped the leader, when the prompt's full
 * blocks are in both instances' prefix caches: each follower then prefills only the prompt's
 * last partial block on the prefill instance, and the decode instance that holds the leader
 * reserves the cached blocks, so only that block moves (vLLM v1's n child requests share the
 * prompt's blocks through its prefix cache the same way). Prompts of at most one block, and
 * clusters without prefix caching, start every choice at once.
 */
#include "sched.h"

#include <ctype.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <uv.h>

#include "api.h"
#include "http/http_server.h"
#include "json/json.h"
#include "metrics/metrics.h"
#include "model/config.h"
#include "pd_config.h"
#include "registry.h"
#include "rpc/pd_msg.h"
#include "sbuf.h"
#include "util/clock.h"
#include "util/hash.h"
#include "util/log.h"
#include "util/status.h"

/* ---- per-request state -------------------------------------------------------------------- */

typedef struct {
    size_t text_off, text_len; /* into the pending text buffer */
    int n_tokens;              /* 0 or 1 */
    bool final;
    char finish[8]; /* "stop", "length" or "" */
    int stop_kind;  /* 0 null, 1 token, 2 string */
    int32_t stop_token;
    size_t stop_off, stop_len; /* stop string, into the pending text buffer */
    int64_t prompt_tokens;
    int32_t token; /* the sampled id (when n_tokens > 0) */
    bool has_logprob;
    float logprob;
    size_t top_off, n_top; /* into the pending top arrays */
} tok_rec;

typedef struct {
    tok_rec *recs;
    size_t n, cap;
    pd_sb text;       /* token texts and stop strings of recs */
    int32_t *top_ids; /* (cap_top,) top logprob ids of recs */
    float *top_lps;   /* (cap_top,) their logprobs */
    size_t n_top, cap_top;
} rec_buf;

typedef struct sreq sreq;

enum { PH_RESERVE = 0, PH_PREFILL = 1, PH_DECODE = 2 };

typedef struct choice {
    sreq *r;
    int index; /* choice index = prompt_idx * n + i */
    int prompt_idx;
    char sub_id[48]; /* request id the nodes see */
    /* set by the loop before the chain starts; read-only afterwards */
    int d_node;
    int64_t d_tokens; /* charged to d_node in the registry (pick_for) */
    Pd__DecodeTarget **targets;
    size_t n_targets;
    Pd__SamplingParams sampling; /* arrays in the request arena */
    /* chain state: rpc thread (and the loop under r->mu for cancellation) */
    int p_node;       /* under r->mu */
    int64_t p_tokens; /* charged to p_node (pick_for) */
    int attempts;
    uint64_t call_id[3]; /* per phase, under r->mu */
    bool in_phase[3];
    int32_t *block_ids; /* malloc'd copy of the reservation (rpc thread) */
    size_t n_block_ids;
    int64_t decode_cached; /* leading prompt tokens whose KV the reservation holds already */
    /* results: under r->mu */
    rec_buf pending;
    bool chain_done; /* the chain posted its last record */
    int err_http;    /* 0, or the status of a failure */
    char err[256];
    int64_t kv_bytes;
    double kv_seconds, prefill_seconds;
    int64_t cached_tokens; /* of its prompt, found in the prefill instance's prefix cache */
    bool kv_reported;
    bool admit_wait;    /* Reserve was refused for lack of KV: the loop queues the choice */
    bool reserve_retry; /* Reserve found its decode instance gone: the loop picks another */
    bool rx_paused;     /* its Decode stream waits until the loop has taken the pending records */
    bool relayed;       /* its events come over the decode instance's relay (under r->mu) */
    bool final_rx;      /* its final event arrived (under r->mu) */
    uint64_t rx_bytes;  /* relayed: packed event bytes received (under r->mu) */
    uint64_t credit;    /* relayed: packed event bytes the node may send in all (under r->mu) */
    uint64_t pause_seq; /* relayed: Pause calls sent (under r->mu) */
    struct choice *map_next; /* the rpc thread's request-id map */
    bool mapped;
    int reserve_tries; /* rpc thread */
    bool admitted;     /* a retried Reserve succeeded */
    /* admission queue (loop thread) */
    bool in_queue, retrying;
    struct choice *q_prev, *q_next;
    bool deferred; /* an n > 1 follower waiting for its leader (see the file-top comment) */
    /* loop side */
    rec_buf work;
    bool chain_running; /* holds a reference */
    bool finished;
    char finish[8];
    int stop_kind;
    int32_t stop_token;
    char *stop_string; /* malloc'd */
    int64_t completion_tokens;
    pd_sb text;       /* non-streaming: the whole text */
    int64_t text_cps; /* code points of the token strings listed so far: a completions
                         logprob's text_offset (the previous one + its token's length, as
                         vLLM counts; a byte token held back still counts its "\ufffd") */
    pd_sb lp[4];      /* non-streaming logprobs: completions text_offset, token_logprobs,
                       * tokens, top_logprobs items; chat: lp[0] holds the content items */
    bool first_sent;  /* streaming: this choice's first chunk went out */
    int64_t last_tok_ns;
    int32_t *gen; /* the generated ids (malloc'd; NULL after a failed growth), for note_decode */
    size_t n_gen, cap_gen;
} choice;

struct sreq {
    pd_sched *s;
    pd_http_exchange *ex; /* NULL once the exchange has ended */
    pd_arena *a;
    pthread_mutex_t mu;
    int refs;    /* loop thread only */
    bool queued; /* on the ready list (under s->qmu) */
    sreq *next_ready;
    sreq *prev, *next; /* live list (loop thread) */
    bool aborted;      /* under mu: the chain must not start new calls */
    char id[33];
    char hdr[80]; /* "X-Request-Id: ...\r\n" */
    int64_t created;
    int64_t t_accept, t_prefill, t_first, t_last;
    pd_api_request req;
    int n_choices;
    choice *choices;
    int64_t prompt_tokens; /* summed over prompts, each once */
    bool streaming_started;
    bool done;    /* the response was completed or failed */
    bool counted; /* counts against --max-concurrent-requests */
    bool waiting; /* counted in num_requests_waiting */
    bool running; /* counted in num_requests_running */
    int n_queued; /* choices waiting in the admission queue */
    pd_sb out;    /* unsent stream bytes (backpressure) */
    bool paused;  /* the decode streams are paused until out drains */
    pd_sb ev;     /* scratch for one event */
    bool drain_registered;
    /* parsing on the libuv threadpool (tokenization and templates never block the loop) */
    uv_work_t work;
    pd_api_kind kind;
    pd_api_limits lim; /* a copy for the worker */
    char *body;        /* (body_len,) copy of the request body, in the arena */
    size_t body_len;
    int parse_rc, parse_http;
    char parse_err[1024];
};

/* The Relay stream on one decode instance (see the file-top comment); under pd_sched.rl_mu. */
typedef struct {
    bool open; /* started and not ended: DecodeRequests name it */
    int gen;   /* bumped per stream: a closed stream's callback leaves a newer one alone */
    char id[48];
    uint64_t call_id;
} relay_st;

enum { CMAP_BUCKETS = 4096 };

struct pd_sched {
    pd_sched_params p;
    uv_loop_t loop;
    uv_async_t async;
    uv_signal_t sig_int, sig_term;
    bool signals;
    pd_http_server *http;
    int port;
    pd_rpc_client *rpc;
    pd_reg *reg;
    pd_tok *tok;
    pd_chat_template *tmpl;
    pd_chat_template *tmpl_tools; /* the model's 'tool_use' template, or NULL (§13.1) */
    json_t *chat_vars;
    json_t *default_kwargs; /* --default-chat-template-kwargs, or NULL */
    pd_generation_config gen;
    pd_api_limits lim;
    int64_t L;
    int32_t vocab;
    /* ready list (rpc thread -> loop) */
    pthread_mutex_t qmu;
    sreq *ready_head, *ready_tail;
    bool closing;       /* under qmu: the loop is gone; posts are dropped */
    bool wake_pending;  /* under qmu: posted from the rpc thread, the loop not yet woken */
    uint8_t *went_down; /* (n instances,) under qmu: left the routing set, not yet handled */
    pthread_mutex_t rl_mu;
    relay_st *relays;           /* (n instances,) under rl_mu */
    char relay_tag[17];         /* this process's part of relay ids */
    choice *cmap[CMAP_BUCKETS]; /* rpc thread: relayed choices by sub_id */
    bool any_down;              /* under qmu */
    atomic_bool shutdown_requested;
    bool stopping;          /* loop: shutdown in progress (new requests get 503, /health 503) */
    bool halted;            /* loop: past the drain: everything is being closed */
    int64_t drain_deadline; /* loop: when the drain ends (pd_now_ns) */
    uv_timer_t drain_timer;
    sreq *live;       /* loop thread */
    int64_t inflight; /* requests counted against the limit (loop thread) */
    /* admission queue (loop thread): choices waiting for decode KV capacity, oldest first; only
     * the head is retried, one Reserve at a time */
    choice *admit_head, *admit_tail;
    bool admit_busy; /* the head's retry is in flight */
    bool admit_kick; /* capacity may have been freed: retry the head after this round */
    uv_timer_t admit_timer;
    bool admit_timer_on;
    int64_t n_waiting, n_running;
    uint64_t rng;
    /* metrics */
    pd_metrics *m;
    pd_metric *m_cache_q, *m_cache_h;
    int64_t cache_q_seen, cache_h_seen;
    pd_metric *m_running, *m_waiting, *m_kv, *m_gpu_kv, *m_preempt, *m_prompt, *m_gen, *m_success,
        *m_h_prompt, *m_h_gen, *m_h_n, *m_h_max, *m_ttft, *m_tpot, *m_e2e, *m_queue, *m_prefill,
        *m_decode, *m_infer, *m_kv_bytes, *m_kv_secs, *m_up, *m_unsent;
    int64_t preempt_seen;
    pd_sb tokbuf, lpbuf[4]; /* loop-thread scratch for logprob token texts and fragments */
    const char *labels[2];  /* model_name, engine */
};

/* ---- small helpers -------------------------------------------------------------------------- */

static uint64_t next_rand(pd_sched *s)
{
    return pd_mix64(s->rng += 0x9e3779b97f4a7c15ull);
}

static void hex32(pd_sched *s, char out[33])
{
    snprintf(out, 33, "%016llx%016llx", (unsigned long long)next_rand(s),
             (unsigned long long)next_rand(s));
}

static void rec_buf_free(rec_buf *b)
{
    free(b->top_ids);
    free(b->top_lps);
    free(b->recs);
    pd_sb_free(&b->text);
    memset(b, 0, sizeof *b);
}

/* Appends one token event to b (rpc thread, under r->mu). */
static void rec_push(rec_buf *b, const Pd__TokenEvent *ev)
{
    if (b->n == b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 16;
        tok_rec *p = realloc(b->recs, cap * sizeof *p);
        if (!p) return; /* dropped; the final record still ends the choice via chain_done */
        b->recs = p;
        b->cap = cap;
    }
    tok_rec *t = &b->recs[b->n++];
    memset(t, 0, sizeof *t);
    t->text_off = b->text.len;
    pd_sb_add(&b->text, ev->text.data ? (const char *)ev->text.data : "", ev->text.len);
    t->text_len = ev->text.len;
    t->n_tokens = (int)ev->n_token_ids;
    t->final = ev->final;
    snprintf(t->finish, sizeof t->finish, "%s", ev->finish_reason ? ev->finish_reason : "");
    t->stop_kind = ev->stop_kind;
    t->stop_token = ev->stop_token;
    t->stop_off = b->text.len;
    t->stop_len = ev->stop_string ? strlen(ev->stop_string) : 0;
    if (t->stop_len) pd_sb_add(&b->text, ev->stop_string, t->stop_len);
    t->prompt_tokens = ev->prompt_tokens;
    t->token = ev->n_token_ids ? ev->token_ids[0] : -1;
    t->has_logprob = ev->has_logprob;
    t->logprob = ev->logprob;
    t->top_off = b->n_top;
    if (ev->n_top_logprobs && b->n_top + ev->n_top_logprobs > b->cap_top) {
        size_t cap = b->cap_top ? b->cap_top : 64;
        while (cap < b->n_top + ev->n_top_logprobs) cap *= 2;
        int32_t *ids = realloc(b->top_ids, cap * sizeof *ids);
        if (ids) b->top_ids = ids;
        float *lps = ids ? realloc(b->top_lps, cap * sizeof *lps) : NULL;
        if (lps) b->top_lps = lps;
        if (ids && lps) b->cap_top = cap;
    }
    if (b->n_top + ev->n_top_logprobs <= b->cap_top) {
        for (size_t i = 0; i < ev->n_top_logprobs; i++) {
            b->top_ids[b->n_top + i] = ev->top_logprobs[i]->id;
            b->top_lps[b->n_top + i] = ev->top_logprobs[i]->logprob;
        }
        t->n_top = ev->n_top_logprobs;
        b->n_top += t->n_top;
    }
}

static void post_ready(sreq *r)
{
    pd_sched *s = r->s;
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
    /* on the rpc thread the wake-up waits for the end of the burst (on_rpc_idle): one loop
     * wake-up per burst of tokens, not per token. Under the lock: the loop sets closing under
     * it before closing the handle. */
    if (pd_rpc_on_client_thread())
        s->wake_pending = true;
    else if (!s->closing)
        uv_async_send(&s->async);
    pthread_mutex_unlock(&s->qmu);
}

/* The rpc thread's burst of callbacks is over: wake the loop once for all of it. */
static void on_rpc_idle(void *arg)
{
    pd_sched *s = arg;
    pthread_mutex_lock(&s->qmu);
    if (s->wake_pending && !s->closing) uv_async_send(&s->async);
    s->wake_pending = false;
    pthread_mutex_unlock(&s->qmu);
}

/* pd_reg_pick_cached for c's prompt on role (not exclude): the tokens the request brings there
 * (prefill: the prompt; decode: the prompt and max_tokens) less those the instance's cache likely
 * holds are charged to it, *charged: that, for pd_reg_release. */
static int pick_for(pd_sched *s, const choice *c, rt_role role, int exclude, int64_t *charged)
{
    const pd_api_prompt *pr = &c->r->req.prompts[c->prompt_idx];
    int64_t tokens = (int64_t)pr->n_ids + (role == RT_ROLE_DECODE ? pr->max_tokens : 0), hit = 0;
    int k = pd_reg_pick_cached(s->reg, role, pr->ids, pr->n_ids, tokens, exclude, &hit);
    *charged = tokens - hit;
    return k;
}

/* ---- the chain (rpc thread) ------------------------------------------------------------------ */

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
    post_ready(r); /* before unlocking: once chain_done is visible the loop may free r */
    pthread_mutex_unlock(&r->mu);
}

static void chain_end(choice *c)
{
    sreq *r = c->r;
    pthread_mutex_lock(&r->mu);
    c->chain_done = true;
    post_ready(r); /* before unlocking: once chain_done is visible the loop may free r */
    pthread_mutex_unlock(&r->mu);
}

static void noop_done(void *arg, int st, const char *d, const uint8_t *resp, size_t len)
{
    (void)arg, (void)st, (void)d, (void)resp, (void)len;
}

/* Fire-and-forget Abort of sub_id on node k. */
static void send_abort(pd_sched *s, int k, const char *sub_id)
{
    Pd__AbortRequest q = PD__ABORT_REQUEST__INIT;
    q.request_id = (char *)sub_id;
    uint8_t buf[128];
    if (pd__abort_request__get_packed_size(&q) > sizeof buf) return;
    size_t len = pd__abort_request__pack(&q, buf);
    pd_reg_unary(s->reg, k, "/pd.PD/Abort", buf, len, s->p.rpc_timeout_ms, noop_done, NULL, NULL);
}

/* ---- relayed token events (see the file-top comment) ---------------------------------------- */

typedef struct { /* which Relay stream a callback belongs to */
    pd_sched *s;
    int k, gen;
} relay_ctx;

static size_t cmap_bucket(const char *id)
{
    uint32_t h = 2166136261u;
    for (; *id; id++) h = (h ^ (uint8_t)*id) * 16777619u;
    return h % CMAP_BUCKETS;
}

/* The map is the rpc thread's: entries are added before a relayed Decode call starts and
 * removed when it ends, both on that thread, where relay batches are read too. */
static void cmap_add(pd_sched *s, choice *c)
{
    size_t b = cmap_bucket(c->sub_id);
    c->map_next = s->cmap[b];
    s->cmap[b] = c;
    c->mapped = true;
}

static void cmap_del(pd_sched *s, choice *c)
{
    if (!c->mapped) return;
    for (choice **pp = &s->cmap[cmap_bucket(c->sub_id)]; *pp; pp = &(*pp)->map_next)
        if (*pp == c) {
            *pp = c->map_next;
            break;
        }
    c->mapped = false;
}

static choice *cmap_find(pd_sched *s, const char *id)
{
    for (choice *c = s->cmap[cmap_bucket(id)]; c; c = c->map_next)
        if (strcmp(c->sub_id, id) == 0) return c;
    return NULL;
}

static void on_relay_msg(void *arg, const uint8_t *msg, size_t len);

static void on_relay_done(void *arg, int st, const char *details, const uint8_t *resp, size_t len)
{
    relay_ctx *x = arg;
    pd_sched *s = x->s;
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
static void relay_for(pd_sched *s, int k, char *out)
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

static uint64_t choice_credit(const choice *c)
{
    uint64_t each = RELAY_CREDIT / (uint64_t)c->r->n_choices;
    return each > RELAY_CREDIT_MIN ? each : RELAY_CREDIT_MIN;
}

/* What stopping or resuming a choice's events takes, decided under r->mu (flow_plan) and done
 * after it is released (flow_apply): a Decode stream that carries the events is paused where it
 * is read, so HTTP/2 flow control holds the node's sends back; a relayed choice's node stops by
 * itself when its credit runs out, and a Pause call grants more while the client keeps up. */
typedef struct {
    uint64_t call_id;
    bool relayed, paused, send;
    uint64_t seq, credit;
} flow_op;

static flow_op flow_plan(choice *c, bool paused)
{
    flow_op op = {.call_id = c->in_phase[PH_DECODE] ? c->call_id[PH_DECODE] : 0,
                  .relayed = c->relayed,
                  .paused = paused};
    uint64_t window = choice_credit(c);
    if (c->relayed && !paused && c->rx_bytes + window / 2 > c->credit) {
        c->credit = c->rx_bytes + window;
        op.send = true;
        op.seq = ++c->pause_seq;
        op.credit = c->credit;
    }
    return op;
}

typedef struct {
    pd_sched *s;
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

static void flow_apply(choice *c, const flow_op *op)
{
    pd_sched *s = c->r->s;
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
                 s->p.rpc_timeout_ms, g ? on_grant_done : noop_done, g, NULL);
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
        send_abort(c->r->s, c->d_node, c->sub_id);
        chain_end(c);
        return NULL;
    }
    return buf;
}

static void chain_started(choice *c, int ph, uint64_t id)
{
    pthread_mutex_lock(&c->r->mu);
    c->call_id[ph] = id;
    bool aborted = c->r->aborted;
    pthread_mutex_unlock(&c->r->mu);
    if (aborted) pd_rpc_cancel(c->r->s->rpc, id);
}

static void on_prefill_done(void *arg, int st, const char *details, const uint8_t *resp,
                            size_t len);

static void start_prefill(choice *c)
{
    sreq *r = c->r;
    pd_sched *s = r->s;
    const pd_api_prompt *pr = &r->req.prompts[c->prompt_idx];
    Pd__PrefillRequest q = PD__PREFILL_REQUEST__INIT;
    q.request_id = c->sub_id;
    q.prompt_ids = pr->ids;
    q.n_prompt_ids = pr->n_ids;
    q.sampling = &c->sampling;
    q.targets = c->targets;
    q.n_targets = c->n_targets;
    q.decode_block_ids = c->block_ids;
    q.n_decode_block_ids = c->n_block_ids;
    q.decode_cached_tokens = c->decode_cached;
    q.lease_ms = s->p.prefill_timeout_ms;
    size_t len = 0;
    uint8_t *buf = chain_pack(c, PH_PREFILL, &q.base, &len);
    if (!buf) return;
    pthread_mutex_lock(&r->mu);
    int pk = c->p_node;
    pthread_mutex_unlock(&r->mu);
    uint64_t id = 0;
    pd_reg_unary(s->reg, pk, "/pd.PD/Prefill", buf, len, s->p.prefill_timeout_ms, on_prefill_done,
                 c, &id);
    free(buf);
    chain_started(c, PH_PREFILL, id);
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
        rec_push(&c->pending, ev);
        c->final_rx |= ev->final;
    }
    /* the loop is behind: stop this choice's Decode stream until it has caught up (what waits
     * here stays bounded; the rest waits on the decode instance, as a relayed choice's does
     * once its credit is used) */
    bool pause = c->pending.n >= PENDING_PAUSE && !c->rx_paused && !c->relayed;
    flow_op op = {0};
    if (pause) {
        c->rx_paused = true;
        op = flow_plan(c, true);
    }
    pthread_mutex_unlock(&c->r->mu);
    if (pause) flow_apply(c, &op);
    post_ready(c->r);
}

static void on_decode_msg(void *arg, const uint8_t *msg, size_t len)
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
    pd_sched *s = x->s;
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
            if (ev->final) end_id = c->call_id[PH_DECODE];
            pthread_mutex_unlock(&c->r->mu);
        }
        if (ev) pd__token_event__free_unpacked(ev, NULL);
        if (end_id) pd_rpc_cancel(s->rpc, end_id); /* on_decode_done ends the chain */
    }
    pd__relay_batch__free_unpacked(b, NULL);
}

static void on_decode_done(void *arg, int st, const char *details, const uint8_t *resp, size_t len)
{
    choice *c = arg;
    (void)resp, (void)len;
    cmap_del(c->r->s, c);
    pthread_mutex_lock(&c->r->mu);
    bool aborted = c->r->aborted;
    bool final_seen = c->final_rx;
    pthread_mutex_unlock(&c->r->mu);
    if (st != PD_RPC_OK && !aborted && !final_seen) {
        PD_WARN(c->r->id, "Decode stream of %s ended with %s: %s", c->sub_id,
                pd_rpc_status_name(st), details);
        chain_fail(c, 500, "Generation failed: the decode instance stopped responding.");
        return;
    }
    chain_end(c);
}

static void on_prefill_done(void *arg, int st, const char *details, const uint8_t *resp, size_t len)
{
    choice *c = arg;
    sreq *r = c->r;
    pd_sched *s = r->s;
    pthread_mutex_lock(&r->mu);
    int pk = c->p_node;
    bool aborted = r->aborted;
    pthread_mutex_unlock(&r->mu);
    pd_reg_release(s->reg, pk, c->p_tokens);
    if (aborted) {
        /* abort_chains passes a chain that ended by then: the reservation on D is ours to free */
        send_abort(s, c->d_node, c->sub_id);
        chain_end(c);
        return;
    }
    Pd__PrefillReply *m = st == PD_RPC_OK ? pd__prefill_reply__unpack(NULL, len, resp) : NULL;
    if (!m || !m->first) {
        /* nothing has reached the client: try another prefill instance */
        PD_WARN(r->id, "Prefill of %s on %s failed: %s: %s", c->sub_id, pd_reg_name(s->reg, pk),
                pd_rpc_status_name(st), m ? "reply without a first token" : details);
        if (m) pd__prefill_reply__free_unpacked(m, NULL);
        send_abort(s, pk, c->sub_id);
        int64_t charged = 0;
        int next = c->attempts < 2 ? pick_for(s, c, RT_ROLE_PREFILL, pk, &charged) : -1;
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
        chain_fail(c, 500, "Prefill failed: %s: %s", pd_rpc_status_name(st),
                   details && *details ? details : "no reply");
        return;
    }
    pthread_mutex_lock(&r->mu);
    c->kv_bytes = m->kv_bytes;
    c->kv_seconds = m->kv_seconds;
    c->prefill_seconds = m->prefill_seconds;
    c->cached_tokens = m->cached_tokens;
    if (m->first->status != 0) {
        c->err_http = 500;
        snprintf(c->err, sizeof c->err, "Generation failed: %s", m->first->error);
    } else {
        rec_push(&c->pending, m->first);
    }
    bool final = m->first->final || m->first->status != 0;
    pthread_mutex_unlock(&r->mu);
    int32_t first = m->first->n_token_ids ? m->first->token_ids[0] : -1;
    uint64_t seed = m->seed;
    pd__prefill_reply__free_unpacked(m, NULL);
    if (final) {
        send_abort(s, c->d_node, c->sub_id); /* frees the reservation if D still holds it */
        chain_end(c);
        return;
    }
    post_ready(r);
    /* Decode on D with the seed in use */
    const pd_api_prompt *pr = &r->req.prompts[c->prompt_idx];
    Pd__SamplingParams ds = c->sampling;
    ds.has_seed = true;
    ds.seed = (int64_t)seed;
    Pd__DecodeRequest q = PD__DECODE_REQUEST__INIT;
    q.request_id = c->sub_id;
    q.prompt_ids = pr->ids;
    q.n_prompt_ids = pr->n_ids;
    q.sampling = &ds;
    q.first_token = first;
    char relay_id[48];
    relay_for(s, c->d_node, relay_id);
    q.relay_id = relay_id;
    q.relay_credit = choice_credit(c);
    size_t qlen = 0;
    uint8_t *buf = chain_pack(c, PH_DECODE, &q.base, &qlen);
    if (!buf) return;
    if (relay_id[0]) {
        pthread_mutex_lock(&r->mu);
        c->relayed = true;
        c->credit = q.relay_credit;
        pthread_mutex_unlock(&r->mu);
        cmap_add(s, c);
    }
    uint64_t id = 0;
    /* no deadline: a generation may last any time; a decode instance that stops answering
       its heartbeat fails its streams (instance_lost), a client that leaves cancels them */
    pd_reg_stream(s->reg, c->d_node, "/pd.PD/Decode", buf, qlen, PD_RPC_NO_DEADLINE, on_decode_msg,
                  on_decode_done, c, &id);
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
        if (st == PD_RPC_OK) send_abort(r->s, c->d_node, c->sub_id);
        chain_end(c);
        return;
    }
    if ((st == PD_RPC_UNAVAILABLE || st == PD_RPC_CANCELLED) && c->reserve_tries < 2) {
        /* the instance died since the last heartbeat (or the heartbeat found it gone while the
           call waited: instance_lost cancelled it): out of routing now, and another one; should
           it come back, it drops the reservation nobody will use */
        c->reserve_tries++;
        PD_WARN(r->id, "Reserve of %s on %s failed: %s; trying another decode instance", c->sub_id,
                pd_reg_name(r->s->reg, c->d_node), details);
        pd_reg_report_failure(r->s->reg, c->d_node, details);
        send_abort(r->s, c->d_node, c->sub_id);
        pthread_mutex_lock(&r->mu);
        c->reserve_retry = true;
        post_ready(r);
        pthread_mutex_unlock(&r->mu);
        return;
    }
    if (st == PD_RPC_RESOURCE_EXHAUSTED) {
        /* the decode instance has no KV room now: the loop queues the choice and retries */
        pthread_mutex_lock(&r->mu);
        c->admit_wait = true;
        post_ready(r);
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
    memcpy(c->block_ids, m->block_ids, m->n_block_ids * sizeof *c->block_ids);
    c->n_block_ids = m->n_block_ids;
    c->decode_cached = m->cached_tokens;
    pd__reserve_reply__free_unpacked(m, NULL);
    pthread_mutex_lock(&r->mu);
    c->admitted = true; /* after a retry from the queue, the next queued choice may go */
    post_ready(r);
    pthread_mutex_unlock(&r->mu);
    start_prefill(c);
}

/* ---- responses (loop thread) ------------------------------------------------------------------
 */

static void sreq_unref(sreq *r);

static void sreq_free(sreq *r)
{
    pd_sched *s = r->s;
    /* still on the ready list (posted after its last reference was taken): unlink it */
    pthread_mutex_lock(&s->qmu);
    if (r->queued) {
        sreq *prev = NULL;
        for (sreq *q = s->ready_head; q; prev = q, q = q->next_ready) {
            if (q != r) continue;
            if (prev)
                prev->next_ready = r->next_ready;
            else
                s->ready_head = r->next_ready;
            if (s->ready_tail == r) s->ready_tail = prev;
            break;
        }
        r->queued = false;
    }
    pthread_mutex_unlock(&s->qmu);
    if (r->prev)
        r->prev->next = r->next;
    else if (s->live == r)
        s->live = r->next;
    if (r->next) r->next->prev = r->prev;
    for (int i = 0; r->choices && i < r->n_choices; i++) {
        choice *c = &r->choices[i];
        rec_buf_free(&c->pending);
        rec_buf_free(&c->work);
        pd_sb_free(&c->text);
        for (int k = 0; k < 4; k++) pd_sb_free(&c->lp[k]);
        free(c->stop_string);
        free(c->block_ids);
        free(c->gen);
    }
    pd_sb_free(&r->out);
    pd_sb_free(&r->ev);
    pthread_mutex_destroy(&r->mu);
    pd_arena_destroy(r->a);
    free(r);
}

static void sreq_unref(sreq *r)
{
    if (--r->refs == 0) sreq_free(r);
}

static double since(int64_t from_ns, int64_t to_ns)
{
    return from_ns > 0 && to_ns >= from_ns ? (double)(to_ns - from_ns) / 1e9 : 0.0;
}

/* Counts the request out of the limit and the gauges; ends the exchange's reference. */
static void request_close(sreq *r, const char *reason)
{
    pd_sched *s = r->s;
    if (r->done) return;
    r->done = true;
    if (r->counted) s->inflight--;
    if (r->waiting) s->n_waiting--;
    if (r->running) s->n_running--;
    r->counted = r->waiting = r->running = false;
    if (reason) {
        const char *lv[3] = {s->labels[0], s->labels[1], reason};
        pd_metric_inc(s->m_success, lv, 1);
        int64_t now = pd_now_ns();
        int64_t gen = 0;
        for (int i = 0; i < r->n_choices; i++) gen += r->choices[i].completion_tokens;
        pd_metric_observe(s->m_h_gen, s->labels, (double)gen);
        pd_metric_observe(s->m_e2e, s->labels, since(r->t_accept, now));
        if (r->t_prefill) pd_metric_observe(s->m_infer, s->labels, since(r->t_prefill, now));
        if (r->t_first) pd_metric_observe(s->m_decode, s->labels, since(r->t_first, now));
    }
}

/* ---- admission queue (loop thread) ------------------------------------------------------------
 * A choice whose Reserve every decode instance refused for lack of KV waits here, oldest first.
 * Only the head is retried, one Reserve at a time: when a chain ends (its KV is freed) and every
 * ADMIT_RETRY_MS. A request that waited --queue-timeout gets 503. */

enum { ADMIT_RETRY_MS = 10 };

static void admit_enqueue(pd_sched *s, choice *c, bool front)
{
    sreq *r = c->r;
    c->in_queue = true;
    c->q_prev = front ? NULL : s->admit_tail;
    c->q_next = front ? s->admit_head : NULL;
    if (c->q_prev)
        c->q_prev->q_next = c;
    else
        s->admit_head = c;
    if (c->q_next)
        c->q_next->q_prev = c;
    else
        s->admit_tail = c;
    if (r->n_queued++ == 0 && r->running) {
        r->running = false;
        s->n_running--;
        r->waiting = true;
        s->n_waiting++;
    }
}

static void admit_unlink(pd_sched *s, choice *c)
{
    sreq *r = c->r;
    if (!c->in_queue) return;
    c->in_queue = false;
    if (c->q_prev)
        c->q_prev->q_next = c->q_next;
    else
        s->admit_head = c->q_next;
    if (c->q_next)
        c->q_next->q_prev = c->q_prev;
    else
        s->admit_tail = c->q_prev;
    c->q_prev = c->q_next = NULL;
    if (--r->n_queued == 0 && r->waiting) {
        r->waiting = false;
        s->n_waiting--;
        r->running = true;
        s->n_running++;
        r->t_prefill = pd_now_ns(); /* admitted: the queue time ends here */
    }
}

/* Aborts every chain of r (cancels calls, sends Abort to P and D). */
static void abort_chains(sreq *r)
{
    pd_sched *s = r->s;
    pthread_mutex_lock(&r->mu);
    bool was = r->aborted;
    r->aborted = true;
    pthread_mutex_unlock(&r->mu);
    if (was) return;
    for (int i = 0; i < r->n_choices; i++) {
        choice *c = &r->choices[i];
        if (!c->chain_running) continue;
        if (c->in_queue || c->deferred) { /* nothing in flight and nothing held anywhere */
            admit_unlink(s, c);
            c->deferred = false;
            chain_end(c);
            continue;
        }
        pthread_mutex_lock(&r->mu);
        uint64_t ids[3];
        bool in[3];
        memcpy(ids, c->call_id, sizeof ids);
        memcpy(in, c->in_phase, sizeof in);
        int pk = c->p_node;
        bool done = c->chain_done;
        pthread_mutex_unlock(&r->mu);
        if (done) continue;
        for (int ph = 0; ph < 3; ph++)
            if (in[ph] && ids[ph]) pd_rpc_cancel(s->rpc, ids[ph]);
        if (in[PH_PREFILL] && pk >= 0) send_abort(s, pk, c->sub_id);
        send_abort(s, c->d_node, c->sub_id);
    }
}

/* Drops the exchange's reference; call right after the exchange ended (it is freed then). */
static void end_exchange_ref(sreq *r)
{
    if (r->ex) {
        r->ex = NULL;
        sreq_unref(r);
    }
}

static void respond_error(sreq *r, int status, const char *msg, const char *extra)
{
    char hdr[256];
    snprintf(hdr, sizeof hdr, "%s%s", r->hdr, extra ? extra : "");
    if (r->ex) pd_http_respond_error(r->ex, status, msg, hdr);
    end_exchange_ref(r);
}

/* Answers an error before dispatch: counts the request out, then ends the exchange (which may
 * free r). */
static void reject(sreq *r, int status, const char *msg, const char *extra)
{
    request_close(r, NULL);
    respond_error(r, status, msg, extra);
}

static void flush_out(sreq *r);

/* Stream bytes a slow client may leave unsent here (on top of the HTTP layer's own bound)
 * before its decode instances are held back. */
enum { SSE_PAUSE_BYTES = 256 * 1024 };

/* Stops or resumes r's events (backpressure towards the decode instances); while they flow,
 * also tops up the relayed choices' credit, so a relayed choice gets more only once the loop
 * has written out what came before. */
static void pause_decode(sreq *r, bool paused)
{
    bool change = r->paused != paused;
    if (change)
        PD_DEBUG(r->id, "%s the decode instances (%zu stream bytes unsent)",
                 paused ? "the client reads slowly: holding back" : "resuming", r->out.len);
    r->paused = paused;
    for (int i = 0; i < r->n_choices; i++) {
        choice *c = &r->choices[i];
        pthread_mutex_lock(&r->mu);
        bool act = change || paused || c->relayed; /* a stream may have started since */
        flow_op op = act ? flow_plan(c, paused) : (flow_op){0};
        if (change && !paused) c->rx_paused = false; /* the loop has caught up too */
        pthread_mutex_unlock(&r->mu);
        if (act) flow_apply(c, &op);
    }
}

static void on_drain(void *arg)
{
    sreq *r = arg;
    r->drain_registered = false;
    flush_out(r);
}

/* Writes r->out to the client; on backpressure keeps it and waits for the drain callback. */
static void flush_out(sreq *r)
{
    if (!r->ex) return;
    if (r->out.len > 0) {
        int rc = pd_http_stream_write(r->ex, r->out.p, r->out.len);
        if (!r->ex) return; /* the write found the client gone: the abort ended the exchange */
        if (rc == PD_EBUSY) {
            pause_decode(r, r->paused || r->out.len > SSE_PAUSE_BYTES);
            if (!r->drain_registered) {
                r->drain_registered = true;
                pd_http_on_drain(r->ex, on_drain, r);
            }
            return;
        }
        pd_sb_reset(&r->out);
    }
    pause_decode(r, false);
    if (r->done && !r->drain_registered) {
        pd_http_stream_end(r->ex);
        end_exchange_ref(r);
    }
}

static void emit(sreq *r)
{
    pd_sb_add(&r->out, "data: ", 6);
    pd_sb_add(&r->out, r->ev.p, r->ev.len);
    pd_sb_add(&r->out, "\n\n", 2);
    pd_sb_reset(&r->ev);
}

static const char *model_name(const pd_sched *s)
{
    return s->p.served_names[0];
}

static void chunk_head(sreq *r)
{
    pd_sched *s = r->s;
    bool chat = r->req.kind == PD_API_CHAT;
    pd_sb_printf(&r->ev, "{\"id\":\"%s%s\",\"object\":\"%s\",\"created\":%lld,\"model\":",
                 chat ? "chatcmpl-" : "cmpl-", r->id,
                 chat ? "chat.completion.chunk" : "text_completion", (long long)r->created);
    pd_sb_json_str(&r->ev, model_name(s), strlen(model_name(s)));
    pd_sb_str(&r->ev, ",\"choices\":[");
}

/* A usage object. details: with prompt_tokens_details (a response body; stream usage leaves it
 * out); cached > 0 (--enable-prompt-tokens-details): it is {"cached_tokens": cached}, also in a
 * stream's usage, as vLLM writes it. */
static void usage_obj(pd_sb *b, int64_t p, int64_t c, bool details, int64_t cached)
{
    pd_sb_printf(b, "{\"prompt_tokens\":%lld,\"total_tokens\":%lld,\"completion_tokens\":%lld",
                 (long long)p, (long long)(p + c), (long long)c);
    if (cached > 0)
        pd_sb_printf(b, ",\"prompt_tokens_details\":{\"cached_tokens\":%lld}", (long long)cached);
    else if (details)
        pd_sb_str(b, ",\"prompt_tokens_details\":null");
    pd_sb_str(b, "}");
}

/* The request's prompt tokens found in the prefix cache (each prompt's first choice: the
 * others may find what it computed), or 0 without --enable-prompt-tokens-details. */
static int64_t cached_tokens(const sreq *r)
{
    if (!r->s->p.enable_prompt_tokens_details || r->req.n_prompts == 0) return 0;
    int n = r->n_choices / (int)r->req.n_prompts;
    int64_t sum = 0;
    for (int i = 0; i < r->n_choices; i += n) sum += r->choices[i].cached_tokens;
    return sum;
}

static void stop_reason_json(pd_sb *b, const choice *c)
{
    if (c->stop_kind == 1)
        pd_sb_printf(b, "%d", c->stop_token);
    else if (c->stop_kind == 2 && c->stop_string)
        pd_sb_json_str(b, c->stop_string, strlen(c->stop_string));
    else
        pd_sb_str(b, "null");
}

static int64_t choice_prompt_tokens(const sreq *r, const choice *c)
{
    return (int64_t)r->req.prompts[c->prompt_idx].n_ids;
}

/* ---- logprobs (§12) ---- */

/* The text of one token for logprobs: decoded alone (U+FFFD for bytes that are not valid UTF-8
 * on their own) or "token_id:{id}". Into s->tokbuf. */
static void token_text(pd_sched *s, bool as_ids, int32_t id)
{
    pd_sb_reset(&s->tokbuf);
    if (as_ids) {
        pd_sb_printf(&s->tokbuf, "token_id:%d", id);
        return;
    }
    char *t = NULL;
    size_t n = 0;
    if (pd_tok_decode(s->tok, &id, 1, false, &t, &n) == 0) pd_sb_add(&s->tokbuf, t, n);
    free(t);
    if (!s->tokbuf.p) pd_sb_add(&s->tokbuf, "", 0);
}

static void sep(pd_sb *b)
{
    if (b->len) pd_sb_add(b, ",", 1);
}

static void utf8_bytes(pd_sb *b, const char *t, size_t n)
{
    pd_sb_add(b, "[", 1);
    for (size_t i = 0; i < n; i++) pd_sb_printf(b, "%s%u", i ? "," : "", (unsigned char)t[i]);
    pd_sb_add(b, "]", 1);
}

static size_t code_points(const char *t, size_t n)
{
    size_t cp = 0;
    for (size_t i = 0; i < n; i++) cp += ((unsigned char)t[i] & 0xC0) != 0x80;
    return cp;
}

static void lp_value(pd_sb *b, float lp)
{
    double v = isfinite(lp) ? (double)lp : -9999.0;
    if (v < -9999.0) v = -9999.0;
    pd_sb_double(b, v);
}

/* Appends token t's logprob items to out[0..3] (completions: text_offset, token_logprobs,
 * tokens, top_logprobs; chat: out[0] gets one content item). */
static void lp_items(sreq *r, choice *c, const rec_buf *w, const tok_rec *t, pd_sb out[4])
{
    pd_sched *s = r->s;
    bool ids = r->req.tokens_as_ids;
    const int32_t *top = w->top_ids ? w->top_ids + t->top_off : NULL;
    const float *tlp = w->top_lps ? w->top_lps + t->top_off : NULL;
    if (r->req.kind == PD_API_CHAT) {
        sep(&out[0]);
        token_text(s, ids, t->token);
        pd_sb_str(&out[0], "{\"token\":");
        pd_sb_json_str(&out[0], s->tokbuf.p, s->tokbuf.len);
        pd_sb_str(&out[0], ",\"logprob\":");
        lp_value(&out[0], t->logprob);
        pd_sb_str(&out[0], ",\"bytes\":");
        utf8_bytes(&out[0], s->tokbuf.p, s->tokbuf.len);
        pd_sb_str(&out[0], ",\"top_logprobs\":[");
        for (size_t i = 0; i < t->n_top; i++) {
            token_text(s, ids, top[i]);
            pd_sb_str(&out[0], i ? ",{\"token\":" : "{\"token\":");
            pd_sb_json_str(&out[0], s->tokbuf.p, s->tokbuf.len);
            pd_sb_str(&out[0], ",\"logprob\":");
            lp_value(&out[0], tlp[i]);
            pd_sb_str(&out[0], ",\"bytes\":");
            utf8_bytes(&out[0], s->tokbuf.p, s->tokbuf.len);
            pd_sb_str(&out[0], "}");
        }
        pd_sb_str(&out[0], "]}");
        return;
    }
    for (int k = 0; k < 4; k++) sep(&out[k]);
    pd_sb_printf(&out[0], "%lld", (long long)c->text_cps);
    lp_value(&out[1], t->logprob);
    token_text(s, ids, t->token);
    c->text_cps += (int64_t)code_points(s->tokbuf.p, s->tokbuf.len);
    pd_sb_json_str(&out[2], s->tokbuf.p, s->tokbuf.len);
    /* {sampled: lp, then the top ones; a text that repeats appears once} */
    pd_sb_str(&out[3], "{");
    pd_sb_json_str(&out[3], s->tokbuf.p, s->tokbuf.len);
    pd_sb_add(&out[3], ":", 1);
    lp_value(&out[3], t->logprob);
    char seen[32][64];
    size_t n_seen = 0;
    snprintf(seen[n_seen++], sizeof seen[0], "%s", s->tokbuf.p);
    for (size_t i = 0; i < t->n_top; i++) {
        token_text(s, ids, top[i]);
        bool dup = false;
        for (size_t j = 0; j < n_seen && !dup; j++) dup = strcmp(seen[j], s->tokbuf.p) == 0;
        if (dup) continue;
        if (n_seen < 32) snprintf(seen[n_seen++], sizeof seen[0], "%s", s->tokbuf.p);
        pd_sb_add(&out[3], ",", 1);
        pd_sb_json_str(&out[3], s->tokbuf.p, s->tokbuf.len);
        pd_sb_add(&out[3], ":", 1);
        lp_value(&out[3], tlp[i]);
    }
    pd_sb_str(&out[3], "}");
}

/* The logprobs object from items (see lp_items). */
static void lp_object(pd_sb *b, bool chat, pd_sb items[4])
{
    if (chat) {
        pd_sb_str(b, "{\"content\":[");
        pd_sb_add(b, items[0].p ? items[0].p : "", items[0].len);
        pd_sb_str(b, "]}");
        return;
    }
    static const char *const keys[4] = {"text_offset", "token_logprobs", "tokens", "top_logprobs"};
    for (int k = 0; k < 4; k++) {
        pd_sb_printf(b, "%s\"%s\":[", k ? "," : "{", keys[k]);
        pd_sb_add(b, items[k].p ? items[k].p : "", items[k].len);
        pd_sb_str(b, "]");
    }
    pd_sb_str(b, "}");
}

/* ,"logprobs":...,"finish_reason":... of a chunk's choice. A non-final chat chunk has no
 * stop_reason key; a non-final completions chunk has "stop_reason":null (§11.2, §11.3). */
static void choice_tail(pd_sb *sb, const choice *c, const pd_sb *lp, bool final,
                        bool null_stop_reason)
{
    pd_sb_str(sb, ",\"logprobs\":");
    if (lp)
        pd_sb_add(sb, lp->p, lp->len);
    else
        pd_sb_str(sb, "null");
    pd_sb_str(sb, ",\"finish_reason\":");
    if (final) {
        pd_sb_printf(sb, "\"%s\",\"stop_reason\":", c->finish);
        stop_reason_json(sb, c);
    } else {
        pd_sb_str(sb, null_stop_reason ? "null,\"stop_reason\":null" : "null");
    }
}

/* One token chunk of choice c with text (len bytes); final adds finish and stop reasons.
 * lp: the chunk's logprobs object, or NULL for null. */
static void token_chunk(sreq *r, choice *c, const char *text, size_t len, bool final,
                        const pd_sb *lp)
{
    bool chat = r->req.kind == PD_API_CHAT;
    chunk_head(r);
    pd_sb_printf(&r->ev, "{\"index\":%d,", c->index);
    if (chat) {
        pd_sb_str(&r->ev, "\"delta\":{\"content\":");
        pd_sb_json_str(&r->ev, text, len);
        pd_sb_str(&r->ev, "}");
        choice_tail(&r->ev, c, lp, final, false);
        pd_sb_str(&r->ev, "}]");
        if (r->req.continuous_usage) {
            pd_sb_str(&r->ev, ",\"usage\":");
            usage_obj(&r->ev, choice_prompt_tokens(r, c), c->completion_tokens, false, 0);
        }
        pd_sb_str(&r->ev, "}");
    } else {
        pd_sb_str(&r->ev, "\"text\":");
        if (!c->first_sent && r->req.echo) {
            /* echo: the prompt text, then the first token's text, in one string */
            pd_sb tmp = {0};
            const char *pt = r->req.prompts[c->prompt_idx].text;
            pd_sb_str(&tmp, pt ? pt : "");
            pd_sb_add(&tmp, text, len);
            pd_sb_json_str(&r->ev, tmp.p ? tmp.p : "", tmp.len);
            pd_sb_free(&tmp);
        } else {
            pd_sb_json_str(&r->ev, text, len);
        }
        choice_tail(&r->ev, c, lp, final, true);
        pd_sb_str(&r->ev, "}],\"usage\":");
        if (r->req.continuous_usage)
            usage_obj(&r->ev, choice_prompt_tokens(r, c), c->completion_tokens, true, 0);
        else
            pd_sb_str(&r->ev, "null");
        pd_sb_str(&r->ev, "}");
    }
    c->first_sent = true;
    emit(r);
}

/* Status line, headers and (chat) the role and echo chunks: sent with the first event. */
static void stream_start(sreq *r)
{
    if (r->streaming_started || !r->ex) return;
    r->streaming_started = true;
    if (r->req.kind == PD_API_GENERATE) {
        pd_http_stream_begin(r->ex, 200, "application/x-ndjson", r->hdr);
        return;
    }
    pd_http_stream_begin(r->ex, 200, "text/event-stream; charset=utf-8", r->hdr);
    if (r->req.kind != PD_API_CHAT) return;
    for (int i = 0; i < r->n_choices; i++) {
        chunk_head(r);
        pd_sb_printf(&r->ev, "{\"index\":%d,\"delta\":{\"role\":", i);
        pd_sb_json_str(&r->ev, r->req.role, strlen(r->req.role));
        pd_sb_str(&r->ev, ",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}]");
        if (r->req.continuous_usage) {
            pd_sb_str(&r->ev, ",\"usage\":");
            usage_obj(&r->ev, choice_prompt_tokens(r, &r->choices[i]), 0, false, 0);
        }
        pd_sb_str(&r->ev, "}");
        emit(r);
    }
    if (r->req.echo_text) {
        for (int i = 0; i < r->n_choices; i++) {
            chunk_head(r);
            pd_sb_printf(&r->ev, "{\"index\":%d,\"delta\":{\"content\":", i);
            pd_sb_json_str(&r->ev, r->req.echo_text, strlen(r->req.echo_text));
            pd_sb_str(&r->ev, "},\"logprobs\":null,\"finish_reason\":null}]}");
            emit(r);
        }
    }
}

static void finish_stream(sreq *r)
{
    if (r->req.include_usage) {
        int64_t comp = 0;
        for (int i = 0; i < r->n_choices; i++) comp += r->choices[i].completion_tokens;
        chunk_head(r);
        pd_sb_str(&r->ev, "],\"usage\":");
        usage_obj(&r->ev, r->prompt_tokens, comp, false, cached_tokens(r));
        pd_sb_str(&r->ev, "}");
        emit(r);
    }
    pd_sb_str(&r->out, "data: [DONE]\n\n");
}

/* Legacy /generate: the prompt + text of every choice, {"text": [...]} in Python's default
 * json.dumps style (stream lines, ending in \n) or compact (the non-streaming body). */
static void legacy_texts(sreq *r, pd_sb *b, bool python_style)
{
    pd_sb_str(b, python_style ? "{\"text\": [" : "{\"text\":[");
    for (int i = 0; i < r->n_choices; i++) {
        choice *c = &r->choices[i];
        pd_sb_reset(&r->s->tokbuf);
        pd_sb_str(&r->s->tokbuf, r->req.prompts[c->prompt_idx].text);
        pd_sb_add(&r->s->tokbuf, c->text.p ? c->text.p : "", c->text.len);
        if (i) pd_sb_str(b, python_style ? ", " : ",");
        if (python_style)
            pd_sb_json_str_ascii(b, r->s->tokbuf.p, r->s->tokbuf.len);
        else
            pd_sb_json_str(b, r->s->tokbuf.p, r->s->tokbuf.len);
    }
    pd_sb_str(b, python_style ? "]}\n" : "]}");
}

static void respond_full(sreq *r)
{
    pd_sched *s = r->s;
    bool chat = r->req.kind == PD_API_CHAT;
    pd_sb *b = &r->ev;
    pd_sb_reset(b);
    if (r->req.kind == PD_API_GENERATE) {
        legacy_texts(r, b, false);
        if (r->ex) pd_http_respond(r->ex, 200, "application/json", b->p, b->len, r->hdr);
        end_exchange_ref(r);
        return;
    }
    pd_sb_printf(b, "{\"id\":\"%s%s\",\"object\":\"%s\",\"created\":%lld,\"model\":",
                 chat ? "chatcmpl-" : "cmpl-", r->id, chat ? "chat.completion" : "text_completion",
                 (long long)r->created);
    pd_sb_json_str(b, model_name(s), strlen(model_name(s)));
    pd_sb_str(b, ",\"choices\":[");
    int64_t comp = 0;
    for (int i = 0; i < r->n_choices; i++) {
        choice *c = &r->choices[i];
        comp += c->completion_tokens;
        pd_sb_printf(b, "%s{\"index\":%d,", i ? "," : "", c->index);
        if (chat) {
            pd_sb_str(b, "\"message\":{\"role\":");
            pd_sb_json_str(b, r->req.role, strlen(r->req.role));
            pd_sb_str(b, ",\"content\":");
            pd_sb tmp = {0};
            if (r->req.echo_text) pd_sb_str(&tmp, r->req.echo_text);
            pd_sb_add(&tmp, c->text.p ? c->text.p : "", c->text.len);
            pd_sb_json_str(b, tmp.p ? tmp.p : "", tmp.len);
            pd_sb_free(&tmp);
            pd_sb_str(b, ",\"refusal\":null,\"annotations\":null,\"audio\":null,"
                         "\"function_call\":null,\"tool_calls\":[],\"reasoning_content\":null},"
                         "\"logprobs\":");
            if (r->req.sp.logprobs >= 0)
                lp_object(b, true, c->lp);
            else
                pd_sb_str(b, "null");
            pd_sb_str(b, ",");
            pd_sb_printf(b, "\"finish_reason\":\"%s\",\"stop_reason\":", c->finish);
            stop_reason_json(b, c);
            pd_sb_str(b, "}");
        } else {
            pd_sb_str(b, "\"text\":");
            pd_sb tmp = {0};
            if (r->req.echo) pd_sb_str(&tmp, r->req.prompts[c->prompt_idx].text);
            pd_sb_add(&tmp, c->text.p ? c->text.p : "", c->text.len);
            pd_sb_json_str(b, tmp.p ? tmp.p : "", tmp.len);
            pd_sb_free(&tmp);
            pd_sb_str(b, ",\"logprobs\":");
            if (r->req.sp.logprobs >= 0)
                lp_object(b, false, c->lp);
            else
                pd_sb_str(b, "null");
            pd_sb_printf(b, ",\"finish_reason\":\"%s\",\"stop_reason\":", c->finish);
            stop_reason_json(b, c);
            pd_sb_str(b, ",\"prompt_logprobs\":null}");
        }
    }
    pd_sb_str(b, "],\"service_tier\":null,\"system_fingerprint\":null,\"usage\":");
    usage_obj(b, r->prompt_tokens, comp, true, cached_tokens(r));
    pd_sb_str(b, chat ? ",\"prompt_logprobs\":null,\"kv_transfer_params\":null}"
                      : ",\"kv_transfer_params\":null}");
    if (pd_sb_failed(b)) {
        respond_error(r, 500, "out of memory building the response", NULL);
        return;
    }
    if (r->ex) pd_http_respond(r->ex, 200, "application/json", b->p, b->len, r->hdr);
    end_exchange_ref(r);
}

/* A failure of the request: HTTP error before the first event, in-band error after it. */
static void request_fail(sreq *r, int status, const char *msg)
{
    PD_WARN(r->id, "request failed: %s", msg);
    abort_chains(r);
    request_close(r, "abort");
    if (!r->streaming_started) {
        respond_error(r, status, msg, status == 503 ? "Retry-After: 5\r\n" : NULL);
        return;
    }
    if (r->req.kind == PD_API_GENERATE) {
        pd_sb_str(&r->out, "{\"error\": {\"message\": ");
        pd_sb_json_str_ascii(&r->out, msg, strlen(msg));
        pd_sb_printf(&r->out, ", \"type\": \"%s\", \"param\": null, \"code\": %d}}\n",
                     pd_http_error_type(status), status);
        flush_out(r);
        return;
    }
    pd_sb_reset(&r->ev);
    pd_sb_str(&r->ev, "{\"error\":{\"message\":");
    pd_sb_json_str(&r->ev, msg, strlen(msg));
    pd_sb_printf(&r->ev, ",\"type\":\"%s\",\"param\":null,\"code\":%d}}",
                 pd_http_error_type(status), status);
    emit(r);
    pd_sb_str(&r->out, "data: [DONE]\n\n");
    flush_out(r);
}

static void request_complete(sreq *r)
{
    const char *reason = "stop";
    for (int i = 0; i < r->n_choices; i++)
        if (strcmp(r->choices[i].finish, "length") == 0) reason = "length";
    request_close(r, reason);
    if (!r->req.stream) {
        respond_full(r);
        return;
    }
    stream_start(r);
    if (r->req.kind != PD_API_GENERATE) finish_stream(r);
    flush_out(r);
}

/* Asks c's decode instance to reserve the prompt's KV (the first step of the chain). */
static void send_reserve(choice *c)
{
    sreq *r = c->r;
    pd_sched *s = r->s;
    const pd_api_prompt *pr = &r->req.prompts[c->prompt_idx];
    Pd__ReserveRequest q = PD__RESERVE_REQUEST__INIT;
    q.request_id = c->sub_id;
    q.num_prompt_tokens = (int64_t)pr->n_ids;
    q.ttl_ms = s->p.prefill_timeout_ms;
    q.prompt_ids = pr->ids; /* the decode instance's prefix cache may hold its first blocks */
    q.n_prompt_ids = pr->n_ids;
    char relay_id[48];
    relay_for(s, c->d_node, relay_id); /* should this scheduler die, the reservation goes too */
    q.relay_id = relay_id;
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

/* Fails the requests that waited --queue-timeout in the admission queue. */
static void admit_expire(pd_sched *s)
{
    int64_t limit = (int64_t)(s->p.queue_timeout_s * 1e9);
    int64_t now = pd_now_ns();
    for (bool again = true; again;) {
        again = false;
        for (choice *c = s->admit_head; c; c = c->q_next) {
            if (now - c->r->t_accept < limit) continue;
            char msg[96];
            snprintf(msg, sizeof msg, "Timed out after %g s waiting for capacity.",
                     s->p.queue_timeout_s);
            request_fail(c->r, 503, msg); /* unlinks every queued choice of the request */
            again = true;
            break;
        }
    }
}

/* Retries the head of the admission queue on the decode instance picked as at first (the least
 * loaded, less what its prefix cache likely holds of the prompt). */
static void admit_pump(pd_sched *s)
{
    s->admit_kick = false;
    if (s->admit_busy || !s->admit_head) return;
    choice *c = s->admit_head;
    sreq *r = c->r;
    admit_unlink(s, c);
    int old = c->d_node;
    pd_reg_release(s->reg, old, c->d_tokens);
    c->d_node = pick_for(s, c, RT_ROLE_DECODE, -1, &c->d_tokens);
    if (c->d_node < 0 ||
        (c->d_node != old &&
         pd_reg_decode_targets(s->reg, c->d_node, r->a, &c->targets, &c->n_targets) < 0)) {
        chain_end(c);
        request_fail(r, 503, "No healthy decode instance is available.");
        return;
    }
    c->retrying = true;
    s->admit_busy = true;
    send_reserve(c);
}

static void on_admit_timer(uv_timer_t *t)
{
    pd_sched *s = t->data;
    admit_expire(s);
    admit_pump(s);
    if (!s->admit_head && !s->admit_busy) {
        uv_timer_stop(t);
        s->admit_timer_on = false;
    }
}

/* Puts c in the admission queue (at the front when it was the head being retried). */
static void admit_wait(pd_sched *s, choice *c, bool front)
{
    admit_enqueue(s, c, front);
    if (!s->admit_timer_on) {
        s->admit_timer_on = true;
        uv_timer_start(&s->admit_timer, on_admit_timer, ADMIT_RETRY_MS, ADMIT_RETRY_MS);
    }
}

/* Picks c's decode and prefill instances and the decode targets: NULL, or why it could not (what
 * was picked is given back). */
static const char *pick_instances(pd_sched *s, choice *c)
{
    sreq *r = c->r;
    c->d_node = pick_for(s, c, RT_ROLE_DECODE, -1, &c->d_tokens);
    if (c->d_node < 0 ||
        pd_reg_decode_targets(s->reg, c->d_node, r->a, &c->targets, &c->n_targets) < 0) {
        pd_reg_release(s->reg, c->d_node, c->d_tokens);
        c->d_node = -1;
        return "No healthy decode instance is available.";
    }
    c->p_node = pick_for(s, c, RT_ROLE_PREFILL, -1, &c->p_tokens);
    if (c->p_node >= 0) return NULL;
    pd_reg_release(s->reg, c->d_node, c->d_tokens);
    c->d_node = -1;
    return "No healthy prefill instance is available.";
}

/* Starts the deferred followers of leader l (n > 1, see the file-top comment): on the instances
 * picked now, which prefer those whose caches hold the leader's blocks. */
static void start_followers(pd_sched *s, sreq *r, const choice *l)
{
    for (int i = l->index + 1; i < l->index + r->req.sp.n; i++) {
        choice *c = &r->choices[i];
        if (!c->deferred) continue;
        c->deferred = false;
        const char *why = pick_instances(s, c);
        if (why) {
            chain_end(c);
            request_fail(r, 503, why); /* ends the other followers too */
            return;
        }
        if (s->admit_head || s->admit_busy)
            admit_wait(s, c, false);
        else
            send_reserve(c);
    }
}

/* Appends a generated id to c->gen (which is dropped if it cannot grow). */
static void gen_push(choice *c, int32_t token)
{
    if (c->n_gen == c->cap_gen && (c->gen || !c->cap_gen)) {
        size_t cap = c->cap_gen ? 2 * c->cap_gen : 64;
        int32_t *g = realloc(c->gen, cap * sizeof *g);
        if (!g) free(c->gen);
        c->gen = g;
        c->cap_gen = cap;
    }
    if (c->gen) c->gen[c->n_gen++] = token;
}

/* A choice that finished well: its decode instance computed the prompt and every generated
 * token but the last, whose full blocks its prefix cache now holds; the registry learns them, so
 * that a later turn (whose prompt starts with this one and its answer) is routed there. */
static void note_decode(pd_sched *s, const choice *c)
{
    const pd_api_prompt *pr = &c->r->req.prompts[c->prompt_idx];
    if (!c->gen || c->n_gen < 2) return; /* nothing decoded there beyond the prompt */
    size_t n = pr->n_ids + c->n_gen - 1;
    int32_t *ids = malloc(n * sizeof *ids);
    if (!ids) return;
    memcpy(ids, pr->ids, pr->n_ids * sizeof *ids);
    memcpy(ids + pr->n_ids, c->gen, (c->n_gen - 1) * sizeof *ids);
    pd_reg_note_cached(s->reg, c->d_node, ids, n);
    free(ids);
}

/* Applies the pending records of every choice of r (loop thread). */
static void process(sreq *r)
{
    pd_sched *s = r->s;
    int64_t now = pd_now_ns();
    for (int i = 0; i < r->n_choices; i++) {
        choice *c = &r->choices[i];
        if (!c->chain_running) continue;
        /* swap the pending buffer in */
        pthread_mutex_lock(&r->mu);
        rec_buf spare = c->work;
        c->work = c->pending;
        c->pending = spare;
        c->pending.n = 0;
        c->pending.n_top = 0;
        pd_sb_reset(&c->pending.text);
        /* caught up: read the stream again, unless the client's own backpressure holds it */
        bool resume = c->rx_paused && !r->paused;
        flow_op op = {0};
        if (resume) {
            c->rx_paused = false;
            op = flow_plan(c, false);
        }
        bool chain_done = c->chain_done;
        int err_http = c->err_http;
        char err[256];
        snprintf(err, sizeof err, "%s", c->err);
        bool wait = c->admit_wait, admitted = c->admitted, retry = c->reserve_retry;
        c->admit_wait = c->admitted = c->reserve_retry = false;
        bool kv = !c->kv_reported && c->kv_bytes > 0;
        int64_t kv_bytes = c->kv_bytes;
        double kv_secs = c->kv_seconds;
        if (kv) c->kv_reported = true;
        pthread_mutex_unlock(&r->mu);
        if (resume) flow_apply(c, &op);
        if (kv) {
            char tr[16];
            pd_reg_transport(s->reg, c->d_node, tr, sizeof tr);
            const char *lv[4] = {model_name(s), tr[0] ? tr : "tcp", pd_reg_name(s->reg, c->p_node),
                                 pd_reg_name(s->reg, c->d_node)};
            pd_metric_inc(s->m_kv_bytes, lv, (double)kv_bytes);
            pd_metric_observe(s->m_kv_secs, lv, kv_secs);
        }
        for (size_t k = 0; k < c->work.n && !r->done; k++) {
            const tok_rec *t = &c->work.recs[k];
            const char *text = c->work.text.p ? c->work.text.p + t->text_off : "";
            if (t->n_tokens > 0) {
                if (!r->t_first) {
                    r->t_first = now;
                    pd_metric_observe(s->m_ttft, s->labels, since(r->t_accept, now));
                    pd_metric_observe(s->m_queue, s->labels, since(r->t_accept, r->t_prefill));
                    if (r->t_prefill)
                        pd_metric_observe(s->m_prefill, s->labels, since(r->t_prefill, now));
                }
                if (c->last_tok_ns)
                    pd_metric_observe(s->m_tpot, s->labels, since(c->last_tok_ns, now));
                c->last_tok_ns = now;
                c->completion_tokens += t->n_tokens;
                gen_push(c, t->token);
                pd_metric_inc(s->m_gen, s->labels, t->n_tokens);
            }
            if (t->final) {
                c->finished = true;
                snprintf(c->finish, sizeof c->finish, "%s", t->finish[0] ? t->finish : "stop");
                c->stop_kind = t->stop_kind;
                c->stop_token = t->stop_token;
                free(c->stop_string);
                c->stop_string =
                    t->stop_len ? strndup(c->work.text.p + t->stop_off, t->stop_len) : NULL;
            }
            bool want_lp =
                r->req.sp.logprobs >= 0 && t->n_tokens > 0 && r->req.kind != PD_API_GENERATE;
            if (r->req.kind == PD_API_GENERATE) {
                pd_sb_add(&c->text, text, t->text_len);
                if (r->req.stream && t->n_tokens > 0) {
                    stream_start(r);
                    legacy_texts(r, &r->out, true);
                }
            } else if (r->req.stream) {
                pd_sb *lp = NULL;
                if (want_lp) {
                    for (int q = 0; q < 4; q++) pd_sb_reset(&s->lpbuf[q]);
                    lp_items(r, c, &c->work, t, s->lpbuf);
                    pd_sb_reset(&s->tokbuf);
                    lp_object(&s->tokbuf, r->req.kind == PD_API_CHAT, s->lpbuf);
                    lp = &s->tokbuf;
                }
                stream_start(r);
                token_chunk(r, c, text, t->text_len, t->final, lp);
            } else {
                if (want_lp) lp_items(r, c, &c->work, t, c->lp);
                pd_sb_add(&c->text, text, t->text_len);
            }
        }
        c->work.n = 0;
        /* a leader that the decode instance has stepped (or that ended well) lets its followers
         * go: the prompt's blocks are cached */
        if (!r->done && r->req.sp.n > 1 && c->index % r->req.sp.n == 0 &&
            (c->completion_tokens >= 2 || (c->finished && !err_http)))
            start_followers(s, r, c);
        bool was_head = c->retrying;
        if (c->retrying && (wait || retry || admitted || chain_done)) { /* it has its answer */
            c->retrying = false;
            s->admit_busy = false;
            if (!wait) s->admit_kick = true; /* admitted: the next one may fit too */
        }
        if ((wait || retry) && !chain_done) {
            if (r->done) {
                chain_end(c);
            } else {
                /* a lost instance's choice goes first, to the pick of another instance */
                admit_wait(s, c, was_head || retry);
                if (retry) s->admit_kick = true;
            }
        }
        if (chain_done) {
            if (c->finished && !err_http) note_decode(s, c);
            s->admit_kick = true; /* KV was freed (or never taken): the head may fit now */
            c->chain_running = false;
            pd_reg_release(s->reg, c->d_node, c->d_tokens);
            if (!r->done && err_http) {
                request_fail(r, err_http, err);
            } else if (!r->done && !c->finished) {
                if (!r->ex || pd_http_aborted(r->ex))
                    request_close(r, "abort");
                else
                    request_fail(r, 500,
                                 "Generation failed: the stream ended without a final "
                                 "token.");
            }
            sreq_unref(r); /* the chain's reference; r stays alive through the caller's ref */
        }
    }
    if (r->done) return;
    bool all = true;
    for (int i = 0; i < r->n_choices; i++) all = all && r->choices[i].finished;
    if (all) {
        request_complete(r);
        return;
    }
    if (r->req.stream)
        flush_out(r);
    else
        pause_decode(r, false); /* the relayed choices' credit, as their events were taken */
}

static void begin_drain(pd_sched *s);

/* Instance k left the routing set: a prefill call waiting on it is cancelled (its callback
 * retries on another prefill instance), and so is a Reserve call (its callback tries another
 * decode instance: nothing has been streamed for the request); a request decoding on it fails
 * with the contract's in-band error. */
static void instance_lost(pd_sched *s, int k)
{
    bool decode = pd_reg_role(s->reg, k) == RT_ROLE_DECODE;
    for (sreq *r = s->live, *next; r; r = next) {
        next = r->next;
        if (r->done) continue;
        bool fail = false;
        for (int i = 0; i < r->n_choices; i++) {
            choice *c = &r->choices[i];
            if (!c->chain_running || c->in_queue || c->deferred)
                continue; /* queued: picks again on retry; deferred: picks when it starts */
            pthread_mutex_lock(&r->mu);
            bool pre = c->p_node == k && c->in_phase[PH_PREFILL] && !c->in_phase[PH_DECODE];
            uint64_t id = c->call_id[PH_PREFILL];
            bool reserving = c->in_phase[PH_RESERVE] && !c->in_phase[PH_PREFILL];
            uint64_t rid = c->call_id[PH_RESERVE];
            bool done = c->chain_done || c->reserve_retry; /* retry: picks another instance */
            pthread_mutex_unlock(&r->mu);
            if (done) continue;
            if (!decode && pre && id) pd_rpc_cancel(s->rpc, id);
            if (decode && c->d_node == k && reserving && rid)
                pd_rpc_cancel(s->rpc, rid);
            else if (decode && c->d_node == k)
                fail = true;
        }
        if (fail) {
            PD_WARN(r->id, "decode instance %s left the routing set", pd_reg_name(s->reg, k));
            request_fail(r, 500, "Generation failed: the decode instance stopped responding.");
        }
    }
}

static void on_async(uv_async_t *h)
{
    pd_sched *s = h->data;
    if (atomic_load(&s->shutdown_requested) && !s->stopping) begin_drain(s);
    pthread_mutex_lock(&s->qmu);
    if (s->any_down) {
        s->any_down = false;
        for (int k = 0; k < pd_reg_count(s->reg); k++) {
            if (!s->went_down[k]) continue;
            s->went_down[k] = 0;
            pthread_mutex_unlock(&s->qmu);
            instance_lost(s, k);
            pthread_mutex_lock(&s->qmu);
        }
    }
    sreq *list = s->ready_head;
    s->ready_head = s->ready_tail = NULL;
    pthread_mutex_unlock(&s->qmu);
    /* Each request leaves the detached list just before it is processed: a post_ready until
     * then finds it still queued (and its news is read by process), one after it re-queues it.
     * Clearing every `queued` flag up front would let a re-queue overwrite next_ready and cut
     * the rest of this list off, leaving those requests unprocessed for good. */
    for (sreq *r = list, *next; r; r = next) {
        pthread_mutex_lock(&s->qmu);
        next = r->next_ready;
        r->queued = false;
        pthread_mutex_unlock(&s->qmu);
        r->refs++; /* hold r while its chains' references are dropped */
        process(r);
        sreq_unref(r);
    }
    if (s->admit_kick) admit_pump(s);
}

/* ---- request entry (loop thread) --------------------------------------------------------------
 */

static void on_client_abort(void *arg)
{
    sreq *r = arg;
    PD_INFO(r->id, "client disconnected: aborting on every instance");
    abort_chains(r);
    request_close(r, "abort");
    if (r->ex) {
        if (r->streaming_started)
            pd_http_stream_end(r->ex);
        else
            pd_http_respond_error(r->ex, 500, "client disconnected", NULL);
    }
    end_exchange_ref(r);
}

/* Starts the chain of every choice; on a routing failure answers 503. */
static void dispatch(sreq *r)
{
    pd_sched *s = r->s;
    int n = r->req.sp.n;
    r->n_choices = (int)r->req.n_prompts * n;
    r->choices = pd_arena_calloc(r->a, (size_t)r->n_choices, sizeof *r->choices);
    if (!r->choices) {
        reject(r, 500, "out of memory", NULL);
        return;
    }
    for (size_t i = 0; i < r->req.n_prompts; i++)
        r->prompt_tokens += (int64_t)r->req.prompts[i].n_ids;
    pd_metric_observe(s->m_h_n, s->labels, n);
    /* once per request (n choices are one request): the first prompt's max_tokens (prompts
     * differ only with max_tokens:null, which leaves each prompt the rest of the context) */
    pd_metric_observe(s->m_h_max, s->labels, (double)r->req.prompts[0].max_tokens);
    pd_metric_inc(s->m_prompt, s->labels, (double)r->prompt_tokens);
    pd_metric_observe(s->m_h_prompt, s->labels, (double)r->prompt_tokens);
    /* n > 1: the block size of an instance that caches prefixes, for the followers */
    int cache_bs = 0;
    if (n > 1) cache_bs = pd_reg_cache_block(s->reg, RT_ROLE_PREFILL);
    if (n > 1 && !cache_bs) cache_bs = pd_reg_cache_block(s->reg, RT_ROLE_DECODE);
    for (int i = 0; i < r->n_choices; i++) {
        choice *c = &r->choices[i];
        c->r = r;
        c->index = i;
        c->prompt_idx = i / n;
        c->p_node = c->d_node = -1;
        if (r->n_choices == 1)
            snprintf(c->sub_id, sizeof c->sub_id, "%s", r->id);
        else
            snprintf(c->sub_id, sizeof c->sub_id, "%s-%d", r->id, i);
    }
    /* completions max_tokens 0 with echo: the prompt only, nothing generated */
    if (r->req.max_tokens == 0) {
        for (int i = 0; i < r->n_choices; i++) {
            r->choices[i].finished = true;
            snprintf(r->choices[i].finish, sizeof r->choices[i].finish, "length");
            if (r->req.stream) {
                stream_start(r);
                token_chunk(r, &r->choices[i], "", 0, true, NULL);
            }
        }
        request_complete(r);
        return;
    }
    for (int i = 0; i < r->n_choices; i++) {
        choice *c = &r->choices[i];
        const pd_api_prompt *pr = &r->req.prompts[c->prompt_idx];
        pd_sampling_params sp = r->req.sp;
        sp.n = 1;
        sp.max_tokens = pr->max_tokens;
        if (sp.has_seed && r->n_choices > 1) sp.seed = r->req.sp.seed + i; /* per choice */
        pd__sampling_params__init(&c->sampling);
        if (pd_msg_sampling_to_proto(&sp, r->a, &c->sampling) < 0) {
            for (int j = 0; j < i; j++) {
                choice *cj = &r->choices[j];
                pd_reg_release(s->reg, cj->d_node, cj->d_tokens);
                pd_reg_release(s->reg, cj->p_node, cj->p_tokens);
            }
            request_fail(r, 500, pd_last_error());
            return;
        }
        if (i % n && cache_bs && pr->n_ids > (size_t)cache_bs) { /* waits for its leader */
            c->deferred = true;
            continue;
        }
        const char *why = pick_instances(s, c);
        if (why) {
            for (int j = 0; j < i; j++) { /* give back what was picked so far */
                choice *cj = &r->choices[j];
                pd_reg_release(s->reg, cj->d_node, cj->d_tokens);
                pd_reg_release(s->reg, cj->p_node, cj->p_tokens);
                cj->d_node = cj->p_node = -1;
            }
            request_fail(r, 503, why);
            return;
        }
    }
    r->t_prefill = pd_now_ns();
    if (r->waiting) {
        r->waiting = false;
        s->n_waiting--;
    }
    r->running = true;
    s->n_running++;
    /* requests already waiting for KV capacity go first */
    bool queue = s->admit_head || s->admit_busy;
    for (int i = 0; i < r->n_choices; i++) {
        choice *c = &r->choices[i];
        c->chain_running = true;
        r->refs++;
        if (c->deferred) continue;
        if (queue)
            admit_wait(s, c, false);
        else
            send_reserve(c);
    }
}

static bool media_is_json(const char *ct)
{
    if (!ct) return false;
    while (*ct == ' ' || *ct == '\t') ct++;
    size_t n = strcspn(ct, ";");
    while (n > 0 && (ct[n - 1] == ' ' || ct[n - 1] == '\t')) n--;
    return n == 16 && strncasecmp(ct, "application/json", 16) == 0;
}

static bool key_ok(const pd_sched *s, const char *auth)
{
    const char *key = s->p.api_key;
    if (!key) return true;
    if (!auth) return false;
    size_t kl = strlen(key), al = strlen(auth);
    /* "Bearer " + key, compared in constant time over the expected length */
    unsigned diff = al != kl + 7;
    const char *want = "Bearer ";
    for (size_t i = 0; i < kl + 7; i++) {
        char w = i < 7 ? want[i] : key[i - 7];
        char g = i < al ? auth[i] : 0;
        diff |= (unsigned)(w ^ g);
    }
    return diff == 0;
}

static void parse_work(uv_work_t *w);
static void parse_done(uv_work_t *w, int status);

static void handle_generation(pd_sched *s, pd_http_exchange *ex, pd_api_kind kind)
{
    sreq *r = calloc(1, sizeof *r);
    pd_arena *a = pd_arena_create(16384);
    if (!r || !a) {
        free(r);
        pd_arena_destroy(a);
        pd_http_respond_error(ex, 500, "out of memory", NULL);
        return;
    }
    r->s = s;
    r->a = a;
    r->ex = ex;
    r->refs = 1;
    pthread_mutex_init(&r->mu, NULL);
    hex32(s, r->id);
    snprintf(r->hdr, sizeof r->hdr, "X-Request-Id: %s\r\n", r->id);
    r->created = pd_wall_ns() / PD_NS_PER_S;
    r->t_accept = pd_now_ns();
    r->next = s->live;
    if (s->live) s->live->prev = r;
    s->live = r;
    pd_http_set_user(ex, r);
    pd_http_on_abort(ex, on_client_abort, r);
    const char *cid = pd_http_header(ex, "X-Request-Id");
    PD_INFO(r->id, "%s %s%s%s", pd_http_method(ex), pd_http_path(ex),
            cid ? " client X-Request-Id " : "", cid ? cid : "");
    if (kind != PD_API_GENERATE && !media_is_json(pd_http_header(ex, "Content-Type"))) {
        reject(r, 400, "Unsupported Media Type: Only 'application/json' is allowed", NULL);
        return;
    }
    size_t len = 0;
    const char *body = pd_http_body(ex, &len);
    r->kind = kind;
    r->lim = s->lim;
    r->lim.max_n = pd_reg_max_num_seqs(s->reg); /* n <= the smallest decode --max-num-seqs */
    r->body = pd_arena_alloc(r->a, len + 1, 1);
    if (!r->body) {
        reject(r, 500, "out of memory", NULL);
        return;
    }
    memcpy(r->body, body, len);
    r->body[len] = '\0';
    r->body_len = len;
    r->work.data = r;
    r->refs++; /* the worker's */
    uv_queue_work(&s->loop, &r->work, parse_work, parse_done);
}

/* Threadpool: parse, render, tokenize. Touches only r->lim, r->body, r->a and r->req. */
static void parse_work(uv_work_t *w)
{
    sreq *r = w->data;
    r->parse_http = 400;
    r->parse_rc =
        pd_api_parse(&r->lim, r->kind, r->body, r->body_len, r->a, &r->req, &r->parse_http);
    if (r->parse_rc < 0) snprintf(r->parse_err, sizeof r->parse_err, "%s", pd_last_error());
}

/* Loop: the parse result; admission, then dispatch. */
static void parse_done(uv_work_t *w, int status)
{
    sreq *r = w->data;
    pd_sched *s = r->s;
    if (r->done || !r->ex) { /* the client left while the request was parsed */
        sreq_unref(r);
        return;
    }
    sreq_unref(r); /* the worker's reference; the exchange's keeps r alive */
    if (status != 0) {
        reject(r, 503, "The server is shutting down.", "Retry-After: 5\r\n");
        return;
    }
    if (r->parse_rc < 0) {
        PD_INFO(r->id, "rejected (%d): %s", r->parse_http, r->parse_err);
        reject(r, r->parse_http, r->parse_err, NULL);
        return;
    }
    /* admission */
    if (s->stopping) {
        reject(r, 503, "The server is shutting down.", "Retry-After: 5\r\n");
        return;
    }
    if (s->p.max_concurrent_requests > 0 && s->inflight >= s->p.max_concurrent_requests) {
        char msg[128];
        snprintf(msg, sizeof msg,
                 "The server is at its limit of %lld concurrent requests; retry later.",
                 (long long)s->p.max_concurrent_requests);
        reject(r, 503, msg, "Retry-After: 1\r\n");
        return;
    }
    if (r->req.max_tokens != 0) {
        if (pd_reg_up_count(s->reg, RT_ROLE_PREFILL) == 0) {
            reject(r, 503, "No healthy prefill instance is available.", "Retry-After: 5\r\n");
            return;
        }
        if (pd_reg_up_count(s->reg, RT_ROLE_DECODE) == 0) {
            reject(r, 503, "No healthy decode instance is available.", "Retry-After: 5\r\n");
            return;
        }
    }
    r->counted = true;
    s->inflight++;
    r->waiting = true;
    s->n_waiting++;
    dispatch(r);
}

/* ---- plain routes ---------------------------------------------------------------------------- */

static void handle_models(pd_sched *s, pd_http_exchange *ex)
{
    pd_sb b = {0};
    long long now = (long long)(pd_wall_ns() / PD_NS_PER_S);
    pd_sb_str(&b, "{\"object\":\"list\",\"data\":[");
    for (int i = 0; i < s->p.n_served_names; i++) {
        char perm[33];
        hex32(s, perm);
        pd_sb_str(&b, i ? ",{\"id\":" : "{\"id\":");
        pd_sb_json_str(&b, s->p.served_names[i], strlen(s->p.served_names[i]));
        pd_sb_printf(&b,
                     ",\"object\":\"model\",\"created\":%lld,\"owned_by\":\"vllm\",\"root\":", now);
        pd_sb_json_str(&b, s->p.model, strlen(s->p.model));
        pd_sb_printf(
            &b,
            ",\"parent\":null,\"max_model_len\":%lld,\"permission\":[{\"id\":\"modelperm-%s\","
            "\"object\":\"model_permission\",\"created\":%lld,\"allow_create_engine\":false,"
            "\"allow_sampling\":true,\"allow_logprobs\":true,\"allow_search_indices\":false,"
            "\"allow_view\":true,\"allow_fine_tuning\":false,\"organization\":\"*\","
            "\"group\":null,\"is_blocking\":false}]}",
            (long long)s->L, perm, now);
    }
    pd_sb_str(&b, "]}");
    if (pd_sb_failed(&b))
        pd_http_respond_error(ex, 500, "out of memory", NULL);
    else
        pd_http_respond(ex, 200, "application/json", b.p, b.len, NULL);
    pd_sb_free(&b);
}

/* Counter m follows a cluster-wide cumulative figure: it grows by what the figure grew since
 * *seen (an instance that restarts from 0 lowers the figure; the counter waits until it is
 * passed again). */
static void follow_counter(pd_metric *m, const char *const *labels, int64_t now, int64_t *seen)
{
    if (now <= *seen) return;
    pd_metric_inc(m, labels, (double)(now - *seen));
    *seen = now;
}

static void handle_metrics(pd_sched *s, pd_http_exchange *ex)
{
    pd_metric_set(s->m_running, s->labels, (double)s->n_running);
    pd_metric_set(s->m_waiting, s->labels, (double)s->n_waiting);
    double unsent = 0;
    for (const sreq *r = s->live; r; r = r->next)
        unsent += (double)r->out.len + (r->ex ? (double)pd_http_stream_pending(r->ex) : 0.0);
    pd_metric_set(s->m_unsent, s->labels, unsent); /* its one label: model_name */
    double kv = pd_reg_kv_usage(s->reg);
    pd_metric_set(s->m_kv, s->labels, kv);
    pd_metric_set(s->m_gpu_kv, s->labels, kv);
    follow_counter(s->m_preempt, s->labels, pd_reg_preemptions(s->reg), &s->preempt_seen);
    int64_t cq, ch;
    pd_reg_prefix_cache(s->reg, &cq, &ch);
    follow_counter(s->m_cache_q, s->labels, cq, &s->cache_q_seen);
    follow_counter(s->m_cache_h, s->labels, ch, &s->cache_h_seen);
    char *text = pd_metrics_render(s->m);
    if (!text) {
        pd_http_respond_error(ex, 500, "out of memory", NULL);
        return;
    }
    pd_http_respond(ex, 200, "text/plain; version=0.0.4; charset=utf-8", text, strlen(text), NULL);
    free(text);
}

/* The routes (api_contract.md §1). */
static const struct {
    const char *path, *method;
    int mode; /* 0 always, 1 openai, 2 legacy */
    bool auth, generation;
} ROUTES[] = {
    {"/health", "GET", 0, false, false},        {"/metrics", "GET", 0, false, false},
    {"/version", "GET", 0, false, false},       {"/v1/models", "GET", 1, true, false},
    {"/v1/completions", "POST", 1, true, true}, {"/v1/chat/completions", "POST", 1, true, true},
    {"/generate", "POST", 2, true, true},
};

/* The first steps of §2: route and method (404/405), then the API key (401). Returns 0 with the
 * ROUTES index in *hit when they pass, else the status, with its message and header lines in
 * extra (cap bytes); a 401 to a generation request carries an X-Request-Id of its own, as every
 * answer to one does (§1), and is logged under it. */
static int gate(pd_sched *s, const pd_http_exchange *ex, int *hit, const char **msg, char *extra,
                size_t cap)
{
    const char *path = pd_http_path(ex), *method = pd_http_method(ex);
    *hit = -1;
    for (size_t i = 0; i < sizeof ROUTES / sizeof *ROUTES; i++) {
        if (strcmp(path, ROUTES[i].path) != 0) continue;
        if (ROUTES[i].mode == 1 && !s->p.use_openai) continue;
        if (ROUTES[i].mode == 2 && s->p.use_openai) continue;
        *hit = (int)i;
    }
    if (*hit < 0) {
        *msg = "Not Found";
        return 404;
    }
    if (strcmp(method, ROUTES[*hit].method) != 0) {
        *msg = "Method Not Allowed";
        snprintf(extra, cap, "Allow: %s\r\n", ROUTES[*hit].method);
        return 405;
    }
    if (ROUTES[*hit].auth && !key_ok(s, pd_http_header(ex, "Authorization"))) {
        *msg = "Unauthorized";
        char id[33] = "";
        if (ROUTES[*hit].generation) {
            hex32(s, id);
            PD_INFO(id, "%s %s: 401 (API key missing or wrong)", method, path);
        }
        snprintf(extra, cap, "WWW-Authenticate: Bearer\r\n%s%s%s", *id ? "X-Request-Id: " : "", id,
                 *id ? "\r\n" : "");
        return 401;
    }
    return 0;
}

/* A body over --max-request-body-bytes: the 413 comes after route, method and key (§2). */
static int on_too_large(void *ctx, const pd_http_exchange *ex, char *message, size_t msg_cap,
                        char *extra, size_t extra_cap)
{
    int hit;
    const char *msg;
    int status = gate(ctx, ex, &hit, &msg, extra, extra_cap);
    if (status) {
        snprintf(message, msg_cap, "%s", msg);
        return status;
    }
    if (ROUTES[hit].generation) {
        char id[33];
        hex32(ctx, id);
        PD_INFO(id, "%s %s: 413 (%s)", pd_http_method(ex), pd_http_path(ex), message);
        snprintf(extra, extra_cap, "X-Request-Id: %s\r\n", id);
    }
    return 413;
}

static void on_http(void *ctx, pd_http_exchange *ex)
{
    pd_sched *s = ctx;
    int hit;
    const char *msg;
    char extra[160] = "";
    int status = gate(s, ex, &hit, &msg, extra, sizeof extra);
    if (status) {
        pd_http_respond_error(ex, status, msg, extra);
        return;
    }
    switch (hit) {
    case 0: {
        bool ok = !s->stopping && pd_reg_up_count(s->reg, RT_ROLE_PREFILL) > 0 &&
                  pd_reg_up_count(s->reg, RT_ROLE_DECODE) > 0;
        pd_http_respond(ex, ok ? 200 : 503, NULL, "", 0, NULL);
        return;
    }
    case 1: handle_metrics(s, ex); return;
    case 2: {
        const char *v = "{\"version\":\"" PD_VERSION "\"}";
        pd_http_respond(ex, 200, "application/json", v, strlen(v), NULL);
        return;
    }
    case 3: handle_models(s, ex); return;
    case 4: handle_generation(s, ex, PD_API_COMPLETIONS); return;
    case 5: handle_generation(s, ex, PD_API_CHAT); return;
    case 6: handle_generation(s, ex, PD_API_GENERATE); return;
    default: pd_http_respond_error(ex, 404, "Not Found", NULL); return;
    }
}

/* ---- metrics registration -----------------------------------------------------------------------
 */

static const double LAT_BUCKETS[] = {0.3,  0.5,   0.8,   1.0,   1.5,   2.0,    2.5,
                                     5.0,  10.0,  15.0,  20.0,  30.0,  40.0,   50.0,
                                     60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
static const double TTFT_BUCKETS[] = {0.001, 0.005, 0.01, 0.02,  0.04,  0.06,  0.08, 0.1,
                                      0.25,  0.5,   0.75, 1.0,   2.5,   5.0,   7.5,  10.0,
                                      20.0,  40.0,  80.0, 160.0, 640.0, 2560.0};
static const double TPOT_BUCKETS[] = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,  0.4, 0.5,
                                      0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
static const double N_BUCKETS[] = {1, 2, 5, 10, 20};
static const double KV_BUCKETS[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                    0.25,  0.5,    1.0,   2.5,  5.0,   10.0, 30.0};

#define NB(a) (sizeof(a) / sizeof *(a))

static void on_instance_change(void *arg, int k, bool up)
{
    pd_sched *s = arg;
    const char *lv[2] = {rt_role_name(pd_reg_role(s->reg, k)), pd_reg_name(s->reg, k)};
    pd_metric_set(s->m_up, lv, up ? 1.0 : 0.0);
    if (up) return;
    /* the loop fails or retries the requests that wait on it (a hung instance would otherwise
     * hold them until their deadlines) */
    pthread_mutex_lock(&s->qmu);
    if (!s->closing) {
        s->went_down[k] = 1;
        s->any_down = true;
        uv_async_send(&s->async);
    }
    pthread_mutex_unlock(&s->qmu);
}

static int metrics_init(pd_sched *s)
{
    s->m = pd_metrics_create();
    if (!s->m) return pd_error(PD_ENOMEM, "metrics: out of memory");
    s->labels[0] = model_name(s);
    s->labels[1] = "0";
    double b125[64];
    size_t n125 = pd_metrics_125_buckets((double)s->L, b125, 64);
    const char *ml = "model_name,engine";
    pd_metrics *m = s->m;
#define ADD(var, type, name, help, labels, b, nb)                                                  \
    do {                                                                                           \
        if (!(var = pd_metrics_add(m, type, name, help, labels, b, nb))) return PD_EINVAL;         \
    } while (0)
    ADD(s->m_running, PD_METRIC_GAUGE, "vllm:num_requests_running",
        "Number of requests in model execution batches.", ml, NULL, 0);
    ADD(s->m_waiting, PD_METRIC_GAUGE, "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.", ml, NULL, 0);
    ADD(s->m_kv, PD_METRIC_GAUGE, "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.", ml, NULL, 0);
    ADD(s->m_gpu_kv, PD_METRIC_GAUGE, "vllm:gpu_cache_usage_perc",
        "GPU KV-cache usage. 1 means 100 percent usage.", ml, NULL, 0);
    ADD(s->m_preempt, PD_METRIC_COUNTER, "vllm:num_preemptions_total",
        "Cumulative number of preemption from the engine.", ml, NULL, 0);
    ADD(s->m_cache_q, PD_METRIC_COUNTER, "vllm:prefix_cache_queries_total",
        "Prefix cache queries, in terms of number of queried tokens.", ml, NULL, 0);
    ADD(s->m_cache_h, PD_METRIC_COUNTER, "vllm:prefix_cache_hits_total",
        "Prefix cache hits, in terms of number of cached tokens.", ml, NULL, 0);
    ADD(s->m_prompt, PD_METRIC_COUNTER, "vllm:prompt_tokens_total",
        "Number of prefill tokens processed.", ml, NULL, 0);
    ADD(s->m_gen, PD_METRIC_COUNTER, "vllm:generation_tokens_total",
        "Number of generation tokens processed.", ml, NULL, 0);
    ADD(s->m_success, PD_METRIC_COUNTER, "vllm:request_success_total",
        "Count of successfully processed requests.", "model_name,engine,finished_reason", NULL, 0);
    ADD(s->m_h_prompt, PD_METRIC_HISTOGRAM, "vllm:request_prompt_tokens",
        "Number of prefill tokens processed.", ml, b125, n125);
    ADD(s->m_h_gen, PD_METRIC_HISTOGRAM, "vllm:request_generation_tokens",
        "Number of generation tokens processed.", ml, b125, n125);
    ADD(s->m_h_n, PD_METRIC_HISTOGRAM, "vllm:request_params_n",
        "Histogram of the n request parameter.", ml, N_BUCKETS, NB(N_BUCKETS));
    ADD(s->m_h_max, PD_METRIC_HISTOGRAM, "vllm:request_params_max_tokens",
        "Histogram of the max_tokens request parameter.", ml, b125, n125);
    ADD(s->m_ttft, PD_METRIC_HISTOGRAM, "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.", ml, TTFT_BUCKETS, NB(TTFT_BUCKETS));
    ADD(s->m_tpot, PD_METRIC_HISTOGRAM, "vllm:time_per_output_token_seconds",
        "Histogram of time per output token in seconds.", ml, TPOT_BUCKETS, NB(TPOT_BUCKETS));
    ADD(s->m_e2e, PD_METRIC_HISTOGRAM, "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.", ml, LAT_BUCKETS, NB(LAT_BUCKETS));
    ADD(s->m_queue, PD_METRIC_HISTOGRAM, "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.", ml, LAT_BUCKETS, NB(LAT_BUCKETS));
    ADD(s->m_prefill, PD_METRIC_HISTOGRAM, "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.", ml, LAT_BUCKETS, NB(LAT_BUCKETS));
    ADD(s->m_decode, PD_METRIC_HISTOGRAM, "vllm:request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.", ml, LAT_BUCKETS, NB(LAT_BUCKETS));
    ADD(s->m_infer, PD_METRIC_HISTOGRAM, "vllm:request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.", ml, LAT_BUCKETS, NB(LAT_BUCKETS));
    ADD(s->m_kv_bytes, PD_METRIC_COUNTER, "pd:kv_transfer_bytes_total",
        "KV payload bytes moved from prefill to decode.",
        "model_name,transport,prefill_instance,decode_instance", NULL, 0);
    ADD(s->m_kv_secs, PD_METRIC_HISTOGRAM, "pd:kv_transfer_seconds",
        "Per request KV transfer time in seconds.",
        "model_name,transport,prefill_instance,decode_instance", KV_BUCKETS, NB(KV_BUCKETS));
    ADD(s->m_up, PD_METRIC_GAUGE, "pd:instance_up", "1 while the instance is in the routing set.",
        "role,instance", NULL, 0);
    ADD(s->m_unsent, PD_METRIC_GAUGE, "pd:stream_unsent_bytes",
        "Bytes of streamed responses held for clients that read slowly (relay and HTTP layer).",
        "model_name", NULL, 0);
#undef ADD
    pd_metric *zero[] = {s->m_running, s->m_waiting, s->m_kv,       s->m_gpu_kv,  s->m_preempt,
                         s->m_prompt,  s->m_gen,     s->m_h_prompt, s->m_h_gen,   s->m_h_n,
                         s->m_h_max,   s->m_ttft,    s->m_tpot,     s->m_e2e,     s->m_queue,
                         s->m_prefill, s->m_decode,  s->m_infer,    s->m_cache_q, s->m_cache_h};
    for (size_t i = 0; i < NB(zero); i++) pd_metric_touch(zero[i], s->labels);
    pd_metric_touch(s->m_unsent, s->labels);
    static const char *const reasons[] = {"stop", "length", "abort"};
    for (size_t i = 0; i < 3; i++) {
        const char *lv[3] = {s->labels[0], s->labels[1], reasons[i]};
        pd_metric_touch(s->m_success, lv);
    }
    for (int k = 0; k < pd_reg_count(s->reg); k++) {
        const char *lv[2] = {rt_role_name(pd_reg_role(s->reg, k)), pd_reg_name(s->reg, k)};
        pd_metric_touch(s->m_up, lv);
    }
    return PD_OK;
}

/* ---- lifecycle
 * ------------------------------------------------------------------------------------ */

pd_sched_params pd_sched_default_params(void)
{
    pd_sched_params p;
    memset(&p, 0, sizeof p);
    p.host = "0.0.0.0";
    p.port = 8000;
    p.max_concurrent_requests = 4096;
    p.max_request_body_bytes = 16 * 1024 * 1024;
    p.queue_timeout_s = 600;
    p.keep_alive_s = 5;
    p.header_timeout_s = 10;
    p.body_timeout_s = 60;
    p.response_role = "assistant";
    p.max_logprobs = 20;
    p.use_openai = true;
    p.heartbeat_ms = 1000;
    p.rpc_timeout_ms = 5000;
    p.prefill_timeout_ms = 60000;
    p.shutdown_timeout_s = 30;
    return p;
}

/* The _host local table must be the scheduler of the global table. */
static int check_host_table(const pd_sched_params *p, const rt_global *g)
{
    if (!p->local_ranktable || !*p->local_ranktable) return PD_OK;
    rt_local *l = NULL;
    PD_CHECK(rt_local_load_file(p->local_ranktable, 0, NULL, &l));
    int rc = PD_OK;
    const rt_instance *mine = rt_local_instance(l), *sch = rt_global_scheduler(g);
    if (!rt_local_is_host(l))
        rc = pd_error(PD_EINVAL, "RANK_TABLE_FILE_PATH=%s: not a scheduler (_host) table",
                      p->local_ranktable);
    else if (!sch || strcmp(mine->server_id, sch->server_id) != 0 ||
             strcmp(mine->server_ip, sch->server_ip) != 0)
        rc = pd_error(PD_EINVAL,
                      "RANK_TABLE_FILE_PATH=%s: server %s (%s) is not the scheduler of %s",
                      p->local_ranktable, mine->server_id, mine->server_ip, p->global_ranktable);
    rt_local_free(l);
    return rc;
}

static int load_model(pd_sched *s)
{
    const pd_sched_params *p = &s->p;
    char path[4096];
    PD_CHECK(pd_tok_load(p->model, &s->tok));
    snprintf(path, sizeof path, "%s/config.json", p->model);
    pd_model_config cfg;
    PD_CHECK(pd_model_config_load(path, &cfg));
    s->vocab = (int32_t)cfg.vocab_size;
    if (pd_tok_vocab_size(s->tok) > s->vocab) s->vocab = pd_tok_vocab_size(s->tok);
    s->L = p->max_model_len > 0 ? p->max_model_len : pd_model_max_len(&cfg, NULL);
    s->gen = pd_generation_config_default();
    snprintf(path, sizeof path, "%s/generation_config.json", p->model);
    if (access(path, F_OK) == 0) PD_CHECK(pd_generation_config_load(path, &s->gen));
    /* chat template: a model without one still serves completions */
    char *src = NULL, *what = NULL, *tsrc = NULL, *twhat = NULL;
    int rc = pd_chat_select(p->model, p->chat_template, false, &src, &what);
    if (rc == PD_OK) rc = pd_chat_select(p->model, p->chat_template, true, &tsrc, &twhat);
    if (rc == PD_OK && src) rc = pd_chat_compile(src, what, &s->tmpl);
    if (rc == PD_OK && src && tsrc && strcmp(tsrc, src) != 0) /* a list with a 'tool_use' entry */
        rc = pd_chat_compile(tsrc, twhat, &s->tmpl_tools);
    free(src);
    free(what);
    free(tsrc);
    free(twhat);
    PD_CHECK(rc);
    if (!s->tmpl) PD_WARN(NULL, "the model has no chat template: chat requests get 400");
    PD_CHECK(pd_chat_config_vars(pd_tok_config(s->tok), &s->chat_vars));
    if (p->default_chat_template_kwargs) {
        PD_CHECK(pdj_loads(p->default_chat_template_kwargs, strlen(p->default_chat_template_kwargs),
                           "--default-chat-template-kwargs", &s->default_kwargs));
        if (!json_is_object(s->default_kwargs))
            return pd_error(PD_EINVAL, "--default-chat-template-kwargs: must be a JSON object");
    }
    pd_api_limits *l = &s->lim;
    l->served_names = s->p.served_names;
    l->n_served_names = s->p.n_served_names;
    l->max_model_len = s->L;
    l->vocab = s->vocab;
    l->max_logprobs = p->max_logprobs;
    l->defaults = p->generation_config_vllm ? pd_sampling_default_params()
                                            : pd_sampling_model_params(&s->gen);
    l->max_new_tokens = // a row of the table --generation-config vllm skips (contract §7.1)
        !p->generation_config_vllm && s->gen.has_max_new_tokens ? s->gen.max_new_tokens : -1;
    l->response_role = p->response_role;
    l->tok = s->tok;
    l->chat_template = s->tmpl;
    l->chat_template_tools = s->tmpl_tools;
    l->chat_config_vars = s->chat_vars;
    l->trust_request_template = p->trust_request_chat_template;
    l->default_kwargs = s->default_kwargs;
    if (!p->generation_config_vllm)
        PD_INFO(NULL,
                "generation config defaults: temperature %g top_p %g top_k %d min_p %g "
                "repetition_penalty %g max_new_tokens %lld",
                l->defaults.temperature, l->defaults.top_p, l->defaults.top_k, l->defaults.min_p,
                l->defaults.repetition_penalty, (long long)l->max_new_tokens);
    return PD_OK;
}

int pd_sched_create(const pd_sched_params *p, pd_sched **out)
{
    *out = NULL;
    if (!p->model) return pd_error(PD_EINVAL, "--model is required");
    pd_sched *s = calloc(1, sizeof *s);
    if (!s) return pd_error(PD_ENOMEM, "out of memory");
    s->p = *p;
    if (s->p.n_served_names == 0) {
        s->p.served_names[0] = s->p.model;
        s->p.n_served_names = 1;
    }
    pthread_mutex_init(&s->qmu, NULL);
    pthread_mutex_init(&s->rl_mu, NULL);
    s->rng = (uint64_t)pd_wall_ns() ^ ((uint64_t)getpid() << 32);
    int fd = open("/dev/urandom", O_RDONLY);
    if (fd >= 0) {
        uint64_t x;
        if (read(fd, &x, sizeof x) == (ssize_t)sizeof x) s->rng ^= x;
        close(fd);
    }
    uv_loop_init(&s->loop);
    s->async.data = s;
    uv_async_init(&s->loop, &s->async, on_async);
    s->admit_timer.data = s;
    uv_timer_init(&s->loop, &s->admit_timer);
    s->drain_timer.data = s;
    uv_timer_init(&s->loop, &s->drain_timer);
    int rc;
    PD_CHECK_GOTO(load_model(s), rc, fail);
    PD_CHECK_GOTO(pd_rpc_client_create(&s->rpc), rc, fail);
    pd_rpc_client_set_idle_hook(s->rpc, on_rpc_idle, s);
    PD_CHECK_GOTO(pd_reg_create(p->global_ranktable, p->node_ports, s->rpc, &s->reg), rc, fail);
    PD_CHECK_GOTO(check_host_table(p, pd_reg_global(s->reg)), rc, fail);
    s->went_down = calloc((size_t)pd_reg_count(s->reg), 1);
    s->relays = calloc((size_t)pd_reg_count(s->reg), sizeof *s->relays);
    snprintf(s->relay_tag, sizeof s->relay_tag, "%016llx", (unsigned long long)next_rand(s));
    if (!s->went_down || !s->relays) {
        rc = pd_error(PD_ENOMEM, "out of memory");
        goto fail;
    }
    PD_CHECK_GOTO(metrics_init(s), rc, fail);
    pd_http_params hp = pd_http_default_params();
    hp.host = p->host;
    hp.port = p->port;
    hp.max_body_bytes = (size_t)p->max_request_body_bytes;
    hp.idle_timeout_ms = (int)(p->keep_alive_s * 1000 + 0.5);
    hp.header_timeout_ms = (int)(p->header_timeout_s * 1000 + 0.5);
    hp.body_timeout_ms = (int)(p->body_timeout_s * 1000 + 0.5);
    PD_CHECK_GOTO(pd_http_server_start(&s->loop, &hp, on_http, s, &s->http), rc, fail);
    pd_http_server_on_too_large(s->http, on_too_large);
    s->port = pd_http_server_port(s->http);
    pd_reg_set_max_model_len(s->reg, s->L); /* an instance with a smaller L stays out */
    PD_CHECK_GOTO(pd_reg_start(s->reg, p->heartbeat_ms, p->heartbeat_ms, on_instance_change, s), rc,
                  fail);
    PD_INFO(NULL, "pd-scheduler listening on %s:%d (model %s, max-model-len %lld, %d instances)",
            p->host, s->port, s->p.served_names[0], (long long)s->L, pd_reg_count(s->reg));
    *out = s;
    return PD_OK;
fail:
    pd_sched_free(s);
    return rc;
}

int pd_sched_port(const pd_sched *s)
{
    return s->port;
}

static void on_http_stopped(void *arg)
{
    pd_sched *s = arg;
    s->http = NULL;
    /* from here on the rpc and heartbeat threads must not touch the async handle */
    pthread_mutex_lock(&s->qmu);
    s->closing = true;
    pthread_mutex_unlock(&s->qmu);
    uv_close((uv_handle_t *)&s->async, NULL);
    uv_close((uv_handle_t *)&s->admit_timer, NULL);
    uv_close((uv_handle_t *)&s->drain_timer, NULL);
    if (s->signals) {
        uv_close((uv_handle_t *)&s->sig_int, NULL);
        uv_close((uv_handle_t *)&s->sig_term, NULL);
    }
}

/* The end of a shutdown: whatever is still in flight is aborted, the HTTP server closes. */
static void begin_stop(pd_sched *s)
{
    if (s->halted) return;
    s->halted = s->stopping = true;
    uv_timer_stop(&s->drain_timer);
    for (sreq *r = s->live; r; r = r->next) abort_chains(r);
    if (s->http)
        pd_http_server_stop(s->http, on_http_stopped, s);
    else
        on_http_stopped(s);
}

enum { DRAIN_TICK_MS = 50, DRAIN_FLUSH_MS = 2000 };

/* Every DRAIN_TICK_MS of a drain: stops once no request is left; at the deadline, the requests
 * still in flight fail with the contract's 503 (in-band once streaming started) and the server
 * stops when their answers have gone out, or DRAIN_FLUSH_MS later at most. */
static void on_drain_tick(uv_timer_t *t)
{
    pd_sched *s = t->data;
    int64_t now = pd_now_ns();
    if (!s->live || now >= s->drain_deadline + (int64_t)DRAIN_FLUSH_MS * PD_NS_PER_MS) {
        begin_stop(s);
        return;
    }
    if (now < s->drain_deadline) return;
    int left = 0;
    for (sreq *r = s->live; r; r = r->next) left += !r->done;
    if (left) PD_WARN(NULL, "shutdown: failing %d request(s) still in progress", left);
    for (sreq *r = s->live, *next; r; r = next) {
        next = r->next;
        if (!r->done) request_fail(r, 503, "The server is shutting down.");
    }
}

/* SIGTERM, SIGINT or pd_sched_shutdown: new requests get 503 "The server is shutting down."
 * and /health 503 while the requests in flight go on for up to --shutdown-timeout seconds (the
 * listener stays open, so clients get an answer, not a refused connection); then on_drain_tick
 * ends them. A second signal stops at once. */
static void begin_drain(pd_sched *s)
{
    if (s->stopping) {
        if (!s->halted) PD_INFO(NULL, "shutdown: second request, stopping now");
        begin_stop(s);
        return;
    }
    s->stopping = true;
    int n = 0;
    for (sreq *r = s->live; r; r = r->next) n += !r->done;
    PD_INFO(NULL, "shutting down: %d request(s) in flight, draining for up to %g s", n,
            s->p.shutdown_timeout_s);
    s->drain_deadline = pd_now_ns() + (int64_t)(s->p.shutdown_timeout_s * 1e9);
    if (!s->live)
        begin_stop(s);
    else
        uv_timer_start(&s->drain_timer, on_drain_tick, DRAIN_TICK_MS, DRAIN_TICK_MS);
}

static void on_signal(uv_signal_t *h, int sig)
{
    (void)sig;
    begin_drain(h->data);
}

int pd_sched_run(pd_sched *s, bool install_signals)
{
    if (install_signals) {
        s->signals = true;
        uv_signal_init(&s->loop, &s->sig_int);
        uv_signal_init(&s->loop, &s->sig_term);
        s->sig_int.data = s->sig_term.data = s;
        uv_signal_start(&s->sig_int, on_signal, SIGINT);
        uv_signal_start(&s->sig_term, on_signal, SIGTERM);
        signal(SIGPIPE, SIG_IGN);
    }
    if (atomic_load(&s->shutdown_requested)) begin_drain(s);
    uv_run(&s->loop, UV_RUN_DEFAULT);
    return PD_OK;
}

void pd_sched_shutdown(pd_sched *s)
{
    atomic_store(&s->shutdown_requested, true);
    pthread_mutex_lock(&s->qmu);
    if (!s->closing) uv_async_send(&s->async);
    pthread_mutex_unlock(&s->qmu);
}

void pd_sched_free(pd_sched *s)
{
    if (!s) return;
    if (s->http || !s->stopping) {
        /* never ran (start-up failure): close what is open */
        if (s->http) pd_http_server_stop(s->http, NULL, NULL);
        s->http = NULL;
        if (!uv_is_closing((uv_handle_t *)&s->async)) uv_close((uv_handle_t *)&s->async, NULL);
        if (!uv_is_closing((uv_handle_t *)&s->admit_timer))
            uv_close((uv_handle_t *)&s->admit_timer, NULL);
        if (!uv_is_closing((uv_handle_t *)&s->drain_timer))
            uv_close((uv_handle_t *)&s->drain_timer, NULL);
        uv_run(&s->loop, UV_RUN_DEFAULT);
    }
    pthread_mutex_lock(&s->qmu);
    s->closing = true;
    pthread_mutex_unlock(&s->qmu);
    if (s->reg) pd_reg_close(s->reg); /* stops the heartbeat, refuses new calls */
    pd_rpc_client_destroy(s->rpc);    /* cancels the calls in flight; every callback has run */
    pd_reg_free(s->reg);
    while (s->live) sreq_free(s->live);
    uv_loop_close(&s->loop);
    pd_metrics_destroy(s->m);
    pd_sb_free(&s->tokbuf);
    for (int k = 0; k < 4; k++) pd_sb_free(&s->lpbuf[k]);
    pd_chat_free(s->tmpl);
    pd_chat_free(s->tmpl_tools);
    json_decref(s->chat_vars);
    json_decref(s->default_kwargs);
    pd_tok_free(s->tok);
    pthread_mutex_destroy(&s->qmu);
    free(s->went_down);
    free(s->relays);
    pthread_mutex_destroy(&s->rl_mu);
    free(s);
}
