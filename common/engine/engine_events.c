/* The engine's output queue (engine_internal.h) and the events a sequence pushes to it.
 *
 * Design: a ring of event slots allocated at create, each with buffers that grow geometrically
 * and are kept, so a token's event allocates nothing once the buffers have grown; one producer
 * (the engine thread) and one consumer, which borrows the head slot until it calls
 * pd_engine_event_done. A step runs only when the queue has room for every sequence it may end.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"
#include "util/fmt.h"
#include "util/status.h"

/* ---- the queue ------------------------------------------------------------------------------ */

/* Grows the buffer *pbuf points to (any object pointer, cap in bytes) to need bytes. */
static int grow_buf(void *pbuf, size_t *cap, size_t need)
{
    if (need <= *cap) return PD_OK;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *buf;
    memcpy(&buf, pbuf, sizeof buf);
    void *nb = realloc(buf, c);
    if (!nb) return pd_error(PD_ENOMEM, "engine: out of memory for an event");
    memcpy(pbuf, &nb, sizeof nb);
    *cap = c;
    return PD_OK;
}

size_t eng_queue_free(pd_engine *e)
{
    pthread_mutex_lock(&e->qmu);
    size_t f = e->cap - e->qcount;
    pthread_mutex_unlock(&e->qmu);
    return f;
}

/* The next free slot, cleared; NULL when the queue is full (callers check room first). */
static ev_slot *slot_begin(pd_engine *e, const eng_seq *s)
{
    pthread_mutex_lock(&e->qmu);
    ev_slot *sl = e->qcount < e->cap ? &e->slots[(e->qhead + e->qcount) % e->cap] : NULL;
    pthread_mutex_unlock(&e->qmu);
    if (!sl) return NULL;
    free(sl->plp); /* its consumer is done with the event that carried them */
    sl->plp = NULL;
    memset(&sl->ev, 0, sizeof sl->ev);
    memcpy(sl->id, s->req->id, sizeof sl->id);
    sl->err[0] = '\0';
    sl->ev.request_id = sl->id;
    sl->ev.seq_index = s->index;
    sl->ev.token_ids = &sl->token;
    sl->ev.text = sl->text ? sl->text : "";
    sl->ev.error = sl->err;
    sl->ev.stop_string = NULL;
    sl->ev.top_ids = sl->top_ids;
    sl->ev.top_logprobs = sl->top_lp;
    sl->ev.block_ids = sl->blocks;
    sl->ev.prompt_tokens = (int64_t)s->req->n_prompt;
    sl->ev.completion_tokens = s->stop ? pd_stop_num_output(s->stop) : 0;
    sl->ev.seed = (uint64_t)s->req->sp.seed;
    return sl;
}

static void slot_publish(pd_engine *e)
{
    pthread_mutex_lock(&e->qmu);
    e->qcount++;
    e->n_pushed++;
    pthread_mutex_unlock(&e->qmu);
}

uint64_t eng_events_pushed(pd_engine *e)
{
    pthread_mutex_lock(&e->qmu);
    uint64_t n = e->n_pushed;
    pthread_mutex_unlock(&e->qmu);
    return n;
}

int pd_engine_next_event(pd_engine *e, const pd_engine_event **ev)
{
    pthread_mutex_lock(&e->qmu);
    int got = e->qcount > 0;
    if (got) {
        *ev = &e->slots[e->qhead].ev;
        e->borrowed = true;
    }
    pthread_mutex_unlock(&e->qmu);
    return got;
}

void pd_engine_event_done(pd_engine *e)
{
    pthread_mutex_lock(&e->qmu);
    if (e->borrowed && e->qcount > 0) {
        e->qhead = (e->qhead + 1) % e->cap;
        e->qcount--;
        e->borrowed = false;
        pthread_cond_broadcast(&e->qcv);
    }
    pthread_mutex_unlock(&e->qmu);
}

/* ---- a sequence's events --------------------------------------------------------------------- */

bool eng_seq_end_status(pd_engine *e, eng_seq *s, int status, const char *msg)
{
    if (s->ended) return true;
    /* a beam search answers n choices on its first n slots; the other slots end silently */
    if (!s->req->beam || s->index < (uint32_t)s->req->sp.n) {
        ev_slot *sl = slot_begin(e, s);
        if (!sl) return false;
        sl->ev.final = true;
        sl->ev.status = status;
        pd_str_copy(sl->err, sizeof sl->err, msg);
        slot_publish(e);
    }
    if (s->sq) pd_sched_finish(e->sched, s->sq);
    s->ended = true;
    s->req->n_live--;
    return true;
}

/* Feeds token through detokenizer d (NULL: no text) and checker st and appends the text to
 * show to sl->text at *tlen; when it ends the sequence, also the detokenizer's held tail (as
 * the checker lets it through) and the stop string (sl->ev.stop_string). *sr: the push's. */
static int text_push(ev_slot *sl, pd_detok *d, pd_stop *st, int32_t token, size_t *tlen,
                     pd_stop_result *sr)
{
    const char *delta = "";
    size_t dlen = 0;
    if (d) PD_CHECK(pd_detok_push(d, token, &delta, &dlen));
    PD_CHECK(pd_stop_push(st, token, delta, dlen, sr));
    PD_CHECK(grow_buf(&sl->text, &sl->text_cap, *tlen + sr->text_len + 1));
    memcpy(sl->text + *tlen, sr->text, sr->text_len);
    *tlen += sr->text_len;
    if (sr->finish == PD_FINISH_NONE) return PD_OK;
    const char *tail = "";
    size_t tail_len = 0;
    if (d) PD_CHECK(pd_detok_flush(d, &tail, &tail_len));
    pd_stop_result fr;
    PD_CHECK(pd_stop_flush(st, tail, tail_len, &fr));
    PD_CHECK(grow_buf(&sl->text, &sl->text_cap, *tlen + fr.text_len + 1));
    memcpy(sl->text + *tlen, fr.text, fr.text_len);
    *tlen += fr.text_len;
    if (sr->stop_kind == PD_STOP_REASON_STRING && sr->stop_string) {
        size_t n = strlen(sr->stop_string);
        PD_CHECK(grow_buf(&sl->stop_str, &sl->stop_cap, n + 1));
        memcpy(sl->stop_str, sr->stop_string, n + 1);
        sl->ev.stop_string = sl->stop_str;
    }
    return PD_OK;
}

int eng_seq_emit_token(pd_engine *e, eng_seq *s, int32_t token, const pd_sample_result *res)
{
    eng_req *r = s->req;
    ev_slot *sl = slot_begin(e, s);
    if (!sl) return pd_error(PD_EINTERNAL, "engine: output queue overflow");
    pd_stop_result sr;
    /* a grammar complete with nothing to follow (or past an EOS that ignore_eos kept) ends
     * the answer here, as an EOS would */
    if (s->gm && pd_gmatcher_is_terminated(s->gm)) pd_stop_complete(s->stop);
    size_t tlen = 0;
    PD_CHECK(text_push(sl, s->detok, s->stop, token, &tlen, &sr));
    if (sr.finish != PD_FINISH_NONE) {
        sl->ev.finish = sr.finish;
        sl->ev.stop_kind = sr.stop_kind;
        sl->ev.stop_token = sr.stop_token;
    }
    sl->text[tlen] = '\0';
    sl->ev.text = sl->text;
    sl->ev.text_len = tlen;
    sl->token = token;
    sl->ev.n_tokens = 1;
    sl->ev.completion_tokens = pd_stop_num_output(s->stop);
    if (res && r->sp.logprobs >= 0) {
        sl->ev.has_logprob = true;
        sl->ev.logprob = res->logprob;
        int32_t k = res->n_top < e->p.max_logprobs ? res->n_top : e->p.max_logprobs;
        memcpy(sl->top_ids, res->top_ids, (size_t)k * sizeof *sl->top_ids);
        memcpy(sl->top_lp, res->top_logprobs, (size_t)k * sizeof *sl->top_lp);
        sl->ev.n_top = k;
    }
    if (r->plp && s->index == 0) { /* the slot owns them from here */
        sl->plp = r->plp;
        r->plp = NULL;
        sl->ev.prompt_logprobs = sl->plp;
    }
    bool finished = sr.finish != PD_FINISH_NONE;
    if (r->phase == PD_PHASE_PREFILL_ONLY) {
        const pd_kvtable *t = pd_seq_table(s->sq);
        size_t nb = pd_kvtable_num_blocks(t);
        memcpy(sl->blocks, pd_kvtable_ids(t), nb * sizeof *sl->blocks);
        sl->ev.n_blocks = nb;
        sl->ev.cached_tokens = pd_seq_num_cached(s->sq);
        sl->ev.held = true;
        sl->ev.final = true;
        PD_CHECK(pd_sched_hold(e->sched, s->sq));
        r->state = REQ_HELD;
        e->n_held++;
        s->ended = true;
        r->n_live--;
    } else if (finished) {
        sl->ev.final = true;
        pd_sched_finish(e->sched, s->sq);
        s->ended = true;
        r->n_live--;
    }
    slot_publish(e);
    return PD_OK;
}

/* A beam's text: its tokens decoded and stop-checked as a sampled sequence's are (held-back
 * bytes, a stop token's or stop string's text dropped unless include_stop_str_in_output), into
 * sl->text; its stop string into sl->stop_str. */
static int beam_text(pd_engine *e, const eng_req *r, ev_slot *sl, const int32_t *toks, size_t n)
{
    pd_detok *d = NULL;
    pd_stop *st = NULL;
    int rc = pd_detok_create(e->tok, r->sp.skip_special_tokens, r->beam->prompt, r->n_prompt, &d);
    if (rc >= 0) rc = pd_stop_create(&r->sp, &e->stop_model, (int64_t)r->n_prompt, &st);
    size_t tlen = 0;
    pd_stop_result sr = {0};
    for (size_t i = 0; i < n && rc >= 0 && sr.finish == PD_FINISH_NONE; i++)
        rc = text_push(sl, d, st, toks[i], &tlen, &sr);
    if (rc >= 0 && sr.finish == PD_FINISH_NONE) { /* cannot happen: the search stopped it */
        const char *tail = "";
        size_t tail_len = 0;
        rc = pd_detok_flush(d, &tail, &tail_len);
        if (rc >= 0) rc = grow_buf(&sl->text, &sl->text_cap, tlen + tail_len + 1);
        if (rc >= 0) memcpy(sl->text + tlen, tail, tail_len);
        tlen += rc >= 0 ? tail_len : 0;
    }
    pd_detok_free(d);
    pd_stop_free(st);
    PD_CHECK(rc);
    sl->text[tlen] = '\0';
    sl->ev.text = sl->text;
    sl->ev.text_len = tlen;
    return PD_OK;
}

/* A beam's logprobs from its chain (n links, the last f->lp), into the slot's beam arrays. */
static int beam_logprobs(ev_slot *sl, const eng_beam_cand *f, int32_t k)
{
    size_t n = f->n_tokens, nk = n * (size_t)k;
    PD_CHECK(grow_buf(&sl->beam_lp, &sl->beam_lp_cap, n * sizeof(float)));
    PD_CHECK(grow_buf(&sl->beam_top_ids, &sl->beam_ids_cap, (nk ? nk : 1) * sizeof(int32_t)));
    PD_CHECK(grow_buf(&sl->beam_top_lp, &sl->beam_top_cap, (nk ? nk : 1) * sizeof(float)));
    const eng_beam_lp *l = f->lp;
    for (size_t i = n; i-- > 0; l = l->prev) {
        if (!l) return pd_error(PD_EINTERNAL, "engine: a beam's logprobs are %zu short", i + 1);
        sl->beam_lp[i] = l->logprob;
        memcpy(sl->beam_top_ids + i * (size_t)k, l->top_ids, (size_t)k * sizeof(int32_t));
        memcpy(sl->beam_top_lp + i * (size_t)k, l->top_lps, (size_t)k * sizeof(float));
    }
    sl->ev.has_logprob = true;
    sl->ev.token_logprobs = sl->beam_lp;
    sl->ev.top_ids = sl->beam_top_ids;
    sl->ev.top_logprobs = sl->beam_top_lp;
    sl->ev.n_top = k;
    return PD_OK;
}

int eng_seq_emit_beam(pd_engine *e, eng_seq *s, const eng_beam_cand *f)
{
    eng_req *r = s->req;
    ev_slot *sl = slot_begin(e, s);
    if (!sl) return pd_error(PD_EINTERNAL, "engine: output queue overflow");
    size_t n = f->n_tokens;
    PD_CHECK(grow_buf(&sl->tokens, &sl->tokens_cap, n * sizeof *f->tokens));
    memcpy(sl->tokens, f->tokens, n * sizeof *f->tokens);
    if (e->tok) {
        PD_CHECK(beam_text(e, r, sl, f->tokens, n));
    } else {
        PD_CHECK(grow_buf(&sl->text, &sl->text_cap, 1));
        sl->text[0] = '\0';
        sl->ev.text = sl->text;
        sl->ev.text_len = 0;
    }
    if (r->beam->k >= 0) PD_CHECK(beam_logprobs(sl, f, r->beam->k));
    sl->ev.token_ids = sl->tokens;
    sl->ev.n_tokens = n;
    sl->ev.completion_tokens = (int64_t)n;
    sl->ev.has_cumulative_logprob = true;
    sl->ev.cumulative_logprob = f->cum;
    sl->ev.final = true;
    sl->ev.finish = f->fin.finish;
    sl->ev.stop_kind = f->fin.stop_kind;
    sl->ev.stop_token = f->fin.stop_token;
    if (r->plp && s->index == 0) { /* the slot owns them from here */
        sl->plp = r->plp;
        r->plp = NULL;
        sl->ev.prompt_logprobs = sl->plp;
    }
    slot_publish(e);
    return PD_OK;
}
