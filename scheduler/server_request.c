/* pd-scheduler: a generation request's life on the loop thread: dispatch to the instances, the
 * records the chains posted (srv_on_async, process), backpressure towards the client, failure and
 * completion, and the one place a request is freed.
 *
 * Design: the loop alone changes a request's client-facing state; the other threads reach it
 * only through records on the ready list, which one uv_async callback drains.
 *
 * n > 1 (or best_of > 1: a choice is one of the best_of sequences of a prompt, of which the n
 * of the highest cumulative logprob are answered): the choices of one prompt share its KV. The
 * first (the leader) starts at once; the others wait (deferred) until the decode instance has
 * stepped the leader, when the prompt's full blocks are in both instances' prefix caches: each
 * follower then prefills only the prompt's last partial block on the prefill instance, and the
 * decode instance that holds the leader reserves the cached blocks, so only that block moves (vLLM
 * v1's n child requests share the prompt's blocks through its prefix cache the same way). Prompts
 * of at most one block, and clusters without prefix caching, start every choice at once.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rpc/pd_msg.h"
#include "server_internal.h"
#include "util/clock.h"
#include "util/fmt.h"
#include "util/log.h"
#include "util/status.h"

void srv_sreq_free(sreq *r)
{
    pd_apiserver *s = r->s;
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
        srv_rec_buf_free(&c->pending);
        srv_rec_buf_free(&c->work);
        pd_sb_free(&c->text);
        for (int k = 0; k < 4; k++) pd_sb_free(&c->lp[k]);
        free(c->stop_string);
        free(c->block_ids);
        free(c->gen);
        if (c->plp) pd__prompt_logprobs__free_unpacked(c->plp, NULL);
        pd_tool_stream_free(c->tools);
    }
    pd_sb_free(&r->out);
    pd_sb_free(&r->ev);
    free(r->body); /* NULL once parsed */
    pthread_mutex_destroy(&r->mu);
    pd_arena_free(r->a);
    free(r);
}

void srv_sreq_unref(sreq *r)
{
    if (--r->refs == 0) srv_sreq_free(r);
}

static double since(int64_t from_ns, int64_t to_ns)
{
    return from_ns > 0 && to_ns >= from_ns ? (double)(to_ns - from_ns) / 1e9 : 0.0;
}

/* Counts the request out of the limit and the gauges; ends the exchange's reference. */
static void request_close(sreq *r, const char *reason)
{
    pd_apiserver *s = r->s;
    if (r->done) return;
    r->done = true;
    if (r->counted) s->inflight--;
    r->counted = r->waiting = r->running = false;
    if (reason) {
        const char *lv[3] = {s->labels[0], s->labels[1], reason};
        pd_metric_inc(s->m_success, lv, 1);
        int64_t now = pd_now_ns();
        int64_t gen = 0, longest = 0;
        for (int i = 0; i < r->n_choices; i++) {
            gen += r->choices[i].completion_tokens;
            if (r->choices[i].completion_tokens > longest)
                longest = r->choices[i].completion_tokens;
        }
        pd_metric_observe(s->m_h_gen, s->labels, (double)gen);
        pd_metric_observe(s->m_h_max_gen, s->labels, (double)longest);
        pd_metric_observe(s->m_e2e, s->labels, since(r->t_accept, now));
        if (r->t_prefill) pd_metric_observe(s->m_infer, s->labels, since(r->t_prefill, now));
        if (r->t_first) pd_metric_observe(s->m_decode, s->labels, since(r->t_first, now));
        /* vLLM's mean time per output token: the decode time over the tokens after the first
           (of the longest choice, whose last token ends the decode time); 0 for one token */
        pd_metric_observe(s->m_req_tpot, s->labels,
                          longest > 1 ? since(r->t_first, now) / (double)(longest - 1) : 0.0);
    }
}

void srv_abort_chains(sreq *r)
{
    pd_apiserver *s = r->s;
    pthread_mutex_lock(&r->mu);
    bool was = r->aborted;
    r->aborted = true;
    pthread_mutex_unlock(&r->mu);
    if (was) return;
    for (int i = 0; i < r->n_choices; i++) {
        choice *c = &r->choices[i];
        if (!c->chain_running) continue;
        if (c->in_queue || c->deferred) { /* nothing in flight and nothing held anywhere */
            srv_admit_unlink(s, c);
            c->deferred = false;
            srv_chain_end(c);
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
        if (in[PH_PREFILL] && pk >= 0) srv_send_abort(s, pk, c->sub_id);
        srv_send_abort(s, c->d_node, c->sub_id);
    }
}

void srv_end_exchange_ref(sreq *r)
{
    if (r->ex) {
        r->ex = NULL;
        srv_sreq_unref(r);
    }
}

void srv_respond_error(sreq *r, int status, const char *msg, const char *extra)
{
    char hdr[256];
    snprintf(hdr, sizeof hdr, "%s%s", r->hdr, extra ? extra : "");
    if (r->ex) pd_http_respond_error(r->ex, status, msg, hdr);
    srv_end_exchange_ref(r);
}

void srv_reject(sreq *r, int status, const char *msg, const char *extra)
{
    request_close(r, NULL);
    srv_respond_error(r, status, msg, extra);
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
        flow_op op = act ? srv_flow_plan(c, paused) : (flow_op){0};
        if (change && !paused) c->rx_paused = false; /* the loop has caught up too */
        pthread_mutex_unlock(&r->mu);
        if (act) srv_flow_apply(c, &op);
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
        srv_end_exchange_ref(r);
    }
}

void srv_request_fail(sreq *r, int status, const char *msg)
{
    PD_WARN(r->id, "request failed: %s", msg);
    srv_abort_chains(r);
    request_close(r, "abort");
    if (!r->streaming_started) {
        srv_respond_error(r, status, msg, status == 503 ? "Retry-After: 5\r\n" : NULL);
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
    srv_emit(r);
    pd_sb_str(&r->out, "data: [DONE]\n\n");
    flush_out(r);
}

/* best_of > n: the answer is each prompt's n sequences of the highest cumulative logprob, best
 * first (vLLM 0.5 sorts them so, a stable sort). */
static int pick_best(sreq *r)
{
    int w = r->req.best_of, n = r->req.sp.n;
    if (w <= n) return 0;
    r->answer = pd_arena_calloc(r->a, r->req.n_prompts * (size_t)n, sizeof *r->answer);
    int *idx = pd_arena_calloc(r->a, (size_t)w, sizeof *idx);
    if (!r->answer || !idx) return -1;
    for (size_t p = 0; p < r->req.n_prompts; p++) {
        for (int k = 0; k < w; k++) {
            int i = (int)p * w + k, j = k;
            for (; j > 0 && r->choices[idx[j - 1]].cum_logprob < r->choices[i].cum_logprob; j--)
                idx[j] = idx[j - 1];
            idx[j] = i;
        }
        memcpy(r->answer + p * (size_t)n, idx, (size_t)n * sizeof *idx);
    }
    r->n_answer = (int)r->req.n_prompts * n;
    return 0;
}

static void request_complete(sreq *r)
{
    const char *reason = "stop";
    for (int i = 0; i < r->n_choices; i++)
        if (strcmp(r->choices[i].finish, "length") == 0) reason = "length";
    request_close(r, reason);
    if (pick_best(r) < 0) {
        srv_respond_error(r, 500, "out of memory", NULL);
        return;
    }
    if (!r->req.stream) {
        srv_respond_full(r);
        return;
    }
    srv_stream_start(r);
    if (r->req.kind != PD_API_GENERATE) srv_finish_stream(r);
    flush_out(r);
}

/* Picks c's decode instance and its targets, and checks that a prefill instance is up (the
 * prefill instance is picked when c's Reserve goes out, srv_admit_or_reserve): NULL, or why it
 * could not (what was picked is given back). */
static const char *pick_instances(pd_apiserver *s, choice *c)
{
    sreq *r = c->r;
    c->d_node = srv_pick_for(s, c, RT_ROLE_DECODE, -1, &c->d_tokens);
    if (c->d_node < 0 ||
        pd_reg_decode_targets(s->reg, c->d_node, r->a, &c->targets, &c->n_targets) < 0) {
        pd_reg_release(s->reg, c->d_node, c->d_tokens);
        c->d_node = -1;
        return "No healthy decode instance is available.";
    }
    if (pd_reg_up_count(s->reg, RT_ROLE_PREFILL) > 0) return NULL; /* picked at its Reserve */
    pd_reg_release(s->reg, c->d_node, c->d_tokens);
    c->d_node = -1;
    return "No healthy prefill instance is available.";
}

/* Starts the deferred followers of leader l (n > 1, see the file-top comment): on the instances
 * picked now, which prefer those whose caches hold the leader's blocks. */
static void start_followers(pd_apiserver *s, sreq *r, const choice *l)
{
    for (int i = l->index + 1; i < l->index + r->req.best_of; i++) {
        choice *c = &r->choices[i];
        if (!c->deferred) continue;
        c->deferred = false;
        const char *why = pick_instances(s, c);
        if (why) {
            srv_chain_end(c);
            srv_request_fail(r, 503, why); /* ends the other followers too */
            return;
        }
        srv_admit_or_reserve(s, c);
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
static void note_decode(pd_apiserver *s, const choice *c)
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
    pd_apiserver *s = r->s;
    int64_t now = pd_now_ns();
    for (int i = 0; i < r->n_choices; i++) {
        choice *c = &r->choices[i];
        if (!c->chain_running && !c->rides) continue;
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
            op = srv_flow_plan(c, false);
        }
        bool chain_done = c->chain_done;
        int err_http = c->err_http;
        char err[256];
        snprintf(err, sizeof err, "%s", c->err);
        bool wait = c->admit_wait, admitted = c->admitted, retry = c->reserve_retry;
        c->admit_wait = c->admitted = c->reserve_retry = false;
        bool kv = !c->kv_reported && c->kv_bytes > 0;
        int64_t kv_bytes = c->kv_bytes;
        char tr[16];
        pd_str_copy(tr, sizeof tr, c->kv_transport);
        double kv_secs = c->kv_seconds;
        if (kv) c->kv_reported = true;
        pthread_mutex_unlock(&r->mu);
        if (resume) srv_flow_apply(c, &op);
        if (kv) {
            if (!tr[0]) pd_reg_transport(s->reg, c->d_node, tr, sizeof tr); /* not said: Info's */
            const char *lv[4] = {srv_model_name(s), tr[0] ? tr : "tcp",
                                 pd_reg_name(s->reg, c->p_node), pd_reg_name(s->reg, c->d_node)};
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
                if (c->last_tok_ns) {
                    double gap = since(c->last_tok_ns, now);
                    pd_metric_observe(s->m_tpot, s->labels, gap);
                    pd_metric_observe(s->m_itl, s->labels, gap);
                }
                c->last_tok_ns = now;
                c->completion_tokens += t->n_tokens;
                if (t->has_logprob) c->cum_logprob += t->logprob;
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
                    srv_stream_start(r);
                    srv_legacy_texts(r, &r->out, true);
                }
            } else if (r->req.stream) {
                pd_sb *lp = NULL;
                if (want_lp) {
                    for (int q = 0; q < 4; q++) pd_sb_reset(&s->lpbuf[q]);
                    srv_lp_prompt_items(r, c, s->lpbuf);
                    srv_lp_items(r, c, &c->work, t, s->lpbuf);
                    pd_sb_reset(&s->tokbuf);
                    srv_lp_object(&s->tokbuf, r->req.kind == PD_API_CHAT, s->lpbuf);
                    lp = &s->tokbuf;
                }
                srv_stream_start(r);
                srv_token_chunk(r, c, text, t->text_len, t->final, lp);
            } else {
                if (want_lp) srv_lp_prompt_items(r, c, c->lp);
                if (want_lp) srv_lp_items(r, c, &c->work, t, c->lp);
                pd_sb_add(&c->text, text, t->text_len);
            }
        }
        c->work.n = 0;
        /* a leader that the decode instance has stepped (or that ended well) lets its followers
         * go: the prompt's blocks are cached */
        if (!r->done && r->req.best_of > 1 && c->index % r->req.best_of == 0 &&
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
                srv_chain_end(c);
            } else {
                /* a lost instance's choice goes first, to the pick of another instance */
                srv_admit_wait(s, c, was_head || retry);
                if (retry) s->admit_kick = true;
            }
        }
        if (chain_done) {
            if (c->finished && !err_http) note_decode(s, c);
            s->admit_kick = true; /* KV was freed (or never taken): the head may fit now */
            c->chain_running = false;
            pd_reg_release(s->reg, c->d_node, c->d_tokens);
            pd_reg_release(s->reg, c->p_node, c->p_tokens); /* its prefill never ran */
            c->p_tokens = 0;
            if (!r->done && err_http) {
                srv_request_fail(r, err_http, err);
            } else if (!r->done && !c->finished) {
                if (!r->ex || pd_http_aborted(r->ex))
                    request_close(r, "abort");
                else
                    srv_request_fail(r, 500,
                                     "Generation failed: the stream ended without a final "
                                     "token.");
            }
            srv_sreq_unref(r); /* the chain's reference; r stays alive through the caller's ref */
        }
    }
    if (r->done) return;
    bool all = true;
    for (int i = 0; i < r->n_choices; i++) {
        const choice *c = &r->choices[i];
        if (c->rides && !c->finished && !srv_leader(r, c)->chain_running) {
            srv_request_fail(r, 500,
                             "Generation failed: the beam search ended without this choice.");
            return;
        }
        all = all && c->finished;
    }
    if (all) {
        request_complete(r);
        return;
    }
    if (r->req.stream)
        flush_out(r);
    else
        pause_decode(r, false); /* the relayed choices' credit, as their events were taken */
}

void srv_on_instance_change(void *arg, int k, bool up)
{
    pd_apiserver *s = arg;
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

/* Instance k left the routing set: a prefill call waiting on it is cancelled (its callback
 * retries on another prefill instance). A choice whose decode instance it was and whose Decode
 * has not started has streamed nothing: its Reserve call, or its Prefill call (whose KV was
 * bound for k), is cancelled, and the callback tries another decode instance. A request
 * decoding on it fails with the contract's in-band error. */
static void instance_lost(pd_apiserver *s, int k)
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
            bool decoding = c->in_phase[PH_DECODE];
            bool prefilling = c->in_phase[PH_PREFILL] && !decoding;
            bool on_k = c->p_node == k;
            uint64_t id = c->call_id[PH_PREFILL];
            bool reserving = c->in_phase[PH_RESERVE] && !c->in_phase[PH_PREFILL];
            uint64_t rid = c->call_id[PH_RESERVE];
            bool done = c->chain_done || c->reserve_retry; /* retry: picks another instance */
            bool mine = decode && c->d_node == k && !done;
            if (mine && prefilling) c->decode_lost = true;
            pthread_mutex_unlock(&r->mu);
            if (done) continue;
            if (!decode && on_k && prefilling && id) pd_rpc_cancel(s->rpc, id);
            if (!mine) continue;
            if (decoding)
                fail = true;
            else if (prefilling && id)
                pd_rpc_cancel(s->rpc, id);
            else if (reserving && rid)
                pd_rpc_cancel(s->rpc, rid);
            /* else the Reserve is being sent: it fails or, answered, its KV transfer does */
        }
        if (fail) {
            PD_WARN(r->id, "decode instance %s left the routing set", pd_reg_name(s->reg, k));
            srv_request_fail(r, 500, "Generation failed: the decode instance stopped responding.");
        }
    }
}

void srv_on_async(uv_async_t *h)
{
    pd_apiserver *s = h->data;
    if (atomic_load(&s->shutdown_requested) && !s->stopping) srv_begin_drain(s);
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
    /* Each request leaves the detached list just before it is processed: a srv_post_ready until
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
        srv_sreq_unref(r);
    }
    if (s->admit_kick) srv_admit_pump(s);
}

/* ---- request entry (loop thread) ------------------------------------------------------------- */

void srv_on_client_abort(void *arg)
{
    sreq *r = arg;
    PD_INFO(r->id, "client disconnected: aborting on every instance");
    srv_abort_chains(r);
    request_close(r, "abort");
    if (r->ex) {
        if (r->streaming_started)
            pd_http_stream_end(r->ex);
        else
            pd_http_respond_error(r->ex, 500, "client disconnected", NULL);
    }
    srv_end_exchange_ref(r);
}

/* Starts the chain of every choice; on a routing failure answers 503. */
void srv_dispatch(sreq *r)
{
    pd_apiserver *s = r->s;
    int n = r->req.best_of; /* sequences per prompt: the answer's n are picked at the end */
    r->n_choices = (int)r->req.n_prompts * n;
    r->choices = pd_arena_calloc(r->a, (size_t)r->n_choices, sizeof *r->choices);
    if (!r->choices) {
        srv_reject(r, 500, "out of memory", NULL);
        return;
    }
    for (size_t i = 0; i < r->req.n_prompts; i++)
        r->prompt_tokens += (int64_t)r->req.prompts[i].n_ids;
    bool beam = r->req.sp.use_beam_search; /* one chain per prompt, see choice.rides */
    pd_metric_observe(s->m_h_n, s->labels, r->req.sp.n);
    pd_metric_observe(s->m_h_best_of, s->labels, beam ? r->req.sp.best_of : n);
    /* once per request (n choices are one request): the first prompt's max_tokens (prompts
     * differ only with max_tokens:null, which leaves each prompt the rest of the context) */
    pd_metric_observe(s->m_h_max, s->labels, (double)r->req.prompts[0].max_tokens);
    pd_metric_inc(s->m_prompt, s->labels, (double)r->prompt_tokens);
    pd_metric_observe(s->m_h_prompt, s->labels, (double)r->prompt_tokens);
    /* n > 1: the block size of an instance that caches prefixes, for the followers */
    int cache_bs = 0;
    if (n > 1 && !beam) cache_bs = pd_reg_cache_block(s->reg, RT_ROLE_PREFILL);
    if (n > 1 && !beam && !cache_bs) cache_bs = pd_reg_cache_block(s->reg, RT_ROLE_DECODE);
    for (int i = 0; i < r->n_choices; i++) {
        choice *c = &r->choices[i];
        c->r = r;
        c->index = i;
        c->prompt_idx = i / n;
        c->p_node = c->d_node = c->d_avoid = -1;
        c->rides = beam && i % n;
        c->n_riders = beam && !c->rides ? n - 1 : 0;
        srv_choice_sub_id(r, i, 0, c->sub_id, sizeof c->sub_id);
        /* each choice's text goes through its own tool parser (a non-streamed one at the end) */
        if (r->req.stream && r->req.parse_tools)
            c->tools = pd_tool_stream_create(r->lim.tool_parser, srv_next_rand(s));
        else if (r->req.stream && (r->req.tools_required || r->req.tool_named))
            c->tools = pd_tool_stream_create_forced(r->req.tool_named, srv_next_rand(s));
        if (r->req.stream && (r->req.parse_tools || r->req.tools_required || r->req.tool_named) &&
            !c->tools) {
            srv_reject(r, 500, "out of memory", NULL);
            return;
        }
    }
    /* completions max_tokens 0 with echo: the prompt only, nothing generated */
    if (r->req.max_tokens == 0) {
        for (int i = 0; i < r->n_choices; i++) {
            r->choices[i].finished = true;
            snprintf(r->choices[i].finish, sizeof r->choices[i].finish, "length");
            if (r->req.stream) {
                srv_stream_start(r);
                srv_token_chunk(r, &r->choices[i], "", 0, true, NULL);
            }
        }
        request_complete(r);
        return;
    }
    for (int i = 0; i < r->n_choices; i++) {
        choice *c = &r->choices[i];
        if (c->rides) continue;
        const pd_api_prompt *pr = &r->req.prompts[c->prompt_idx];
        pd_sampling_params sp = r->req.sp;
        sp.n = beam ? r->req.sp.n : 1;
        sp.max_tokens = pr->max_tokens;
        if (sp.has_seed && r->n_choices > 1) sp.seed = r->req.sp.seed + i; /* per choice */
        if (n > r->req.sp.n && sp.logprobs < 0) sp.logprobs = 0;           /* the sampled tokens' */
        pd__sampling_params__init(&c->sampling);
        if (pd_msg_sampling_to_proto(&sp, r->a, &c->sampling) < 0) {
            for (int j = 0; j < i; j++) {
                choice *cj = &r->choices[j];
                pd_reg_release(s->reg, cj->d_node, cj->d_tokens);
                pd_reg_release(s->reg, cj->p_node, cj->p_tokens);
            }
            srv_request_fail(r, 500, pd_last_error());
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
            srv_request_fail(r, 503, why);
            return;
        }
    }
    r->t_prefill = pd_now_ns();
    r->waiting = false;
    r->running = true;
    /* requests already waiting for KV or prefill room go first */
    for (int i = 0; i < r->n_choices; i++) {
        choice *c = &r->choices[i];
        if (c->rides) continue;
        c->chain_running = true;
        r->refs++;
        if (!c->deferred) srv_admit_or_reserve(s, c);
        if (r->done) break; /* no prefill instance was up after all */
    }
}
