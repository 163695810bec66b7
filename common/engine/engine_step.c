/* The engine's step loop (engine_internal.h): one step (apply the inbox, schedule, run the
 * forward pass on every rank, then sample, detokenize and stop-check each sequence that produced
 * logits), pd_engine_step, and the engine thread that runs steps until pd_engine_stop.
 *
 * Design: the engine lock is held while scheduling and while committing the results, never
 * during the forward pass, so requests can be added meanwhile. A failed forward pass ends the
 * step's sequences with its error; the engine itself goes on.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "engine/engine_internal.h"
#include "util/clock.h"
#include "util/log.h"
#include "util/status.h"

/* ---- one step ----------------------------------------------------------------------------- */

static bool has_work_locked(pd_engine *e)
{
    return e->inbox_head || pd_sched_num_running(e->sched) || pd_sched_num_waiting(e->sched);
}

bool pd_engine_has_work(pd_engine *e)
{
    pthread_mutex_lock(&e->mu);
    bool w = has_work_locked(e);
    pthread_mutex_unlock(&e->mu);
    return w;
}

/* Fills e->step from e->so (under mu). */
static int build_step(pd_engine *e)
{
    size_t row = 0, nb_total = 0, n_out = 0;
    e->st_qindptr[0] = 0;
    e->st_bindptr[0] = 0;
    for (size_t i = 0; i < e->so.n_items; i++) {
        const pd_sched_item *it = &e->so.items[i];
        size_t n_tok;
        const int32_t *tok = pd_seq_tokens(it->seq, &n_tok);
        memcpy(e->st_tokens + row, tok + it->start, it->n_new * sizeof *tok);
        /* prompt logprobs: these rows' logits too, before the sampled row (they precede it) */
        e->item_lp_out[i] = (int32_t)n_out;
        for (size_t p = it->lp_start; p < it->lp_start + it->lp_n; p++)
            e->st_outrows[n_out++] = (int32_t)(row + p - it->start);
        row += it->n_new;
        e->st_qindptr[i + 1] = (int32_t)row;
        e->st_kvlen[i] = (int32_t)(it->start + it->n_new);
        const pd_kvtable *t = pd_seq_table(it->seq);
        size_t nb = pd_kvtable_num_blocks(t);
        memcpy(e->st_blocks + nb_total, pd_kvtable_ids(t), nb * sizeof(int32_t));
        nb_total += nb;
        e->st_bindptr[i + 1] = (int32_t)nb_total;
        if (it->sample) { /* the last row, and with drafts the rows that verify them */
            e->item_out[i] = (int32_t)n_out;
            for (size_t d = it->n_draft + 1; d > 0; d--)
                e->st_outrows[n_out++] = (int32_t)(row - d);
        } else {
            e->item_out[i] = -1;
        }
    }
    e->step = (pd_step){
        .n_seqs = e->so.n_items,
        .token_ids = e->st_tokens,
        .q_indptr = e->st_qindptr,
        .kv_len = e->st_kvlen,
        .block_indptr = e->st_bindptr,
        .block_ids = e->st_blocks,
        .n_out = n_out,
        .out_rows = e->st_outrows,
    };
    return PD_OK;
}

/* Fills the prompt logprobs of item i's prompt-logprob rows: row p's logits give those of
 * prompt token p + 1 (under mu). */
static int prompt_logprobs(pd_engine *e, size_t i)
{
    const pd_sched_item *it = &e->so.items[i];
    eng_req *r = ((eng_seq *)pd_seq_user(it->seq))->req;
    pd_prompt_logprobs *plp = r->plp;
    if (!plp || r->abort_requested) return PD_OK;
    size_t n_tok;
    const int32_t *tok = pd_seq_tokens(it->seq, &n_tok);
    for (size_t k = 0; k < it->lp_n; k++) {
        size_t pos = it->lp_start + k + 1, nt = (size_t)plp->n_top;
        const float *row = e->out->logits + (size_t)(e->item_lp_out[i] + (int32_t)k) * e->vocab;
        pd_sample_result res;
        PD_CHECK(pd_sampler_logprobs(row, (int32_t)e->vocab, plp->n_top, tok[pos], e->ws, &res,
                                     &plp->rank[pos]));
        plp->logprob[pos] = res.logprob;
        memcpy(plp->top_ids + pos * nt, res.top_ids, nt * sizeof *res.top_ids);
        memcpy(plp->top_logprobs + pos * nt, res.top_logprobs, nt * sizeof *res.top_logprobs);
    }
    return PD_OK;
}

/* Samples, detokenizes and stop-checks the sequence of item i (under mu). For a request with
 * n > 1 whose prompt just finished, forks the other choices first: they share the prompt's
 * blocks and each samples from the same logits row with its own choice index. */
static int process_item(pd_engine *e, size_t i, const float *logits)
{
    const pd_sched_item *it = &e->so.items[i];
    eng_seq *s = pd_seq_user(it->seq);
    eng_req *r = s->req;
    if (r->abort_requested) return PD_OK; /* its abort is applied at the next boundary */
    if (r->beam) return eng_beam_candidates(e, s, logits); /* the round comes after the items */
    if (s->index == 0 && pd_seq_num_output(it->seq) == 0 && r->n > 1 && !r->seqs[1].sq) {
        for (uint32_t c = 1; c < r->n; c++)
            PD_CHECK(pd_sched_fork(e->sched, it->seq, &r->seqs[c], &r->seqs[c].sq));
    }
    uint32_t first = s->index, last = s->index;
    if (s->index == 0 && pd_seq_num_output(it->seq) == 0 && r->n > 1) last = r->n - 1;
    for (uint32_t c = first; c <= last; c++)
        if (!r->seqs[c].ended) PD_CHECK(eng_sample_emit(e, &r->seqs[c], logits));
    return PD_OK;
}

int eng_sample_emit(pd_engine *e, eng_seq *s, const float *logits)
{
    if (e->p.on_logits)
        e->p.on_logits(e->p.on_logits_ctx, s->req->id, s->index, pd_sampler_seq_num_output(s->smp),
                       logits, e->vocab);
    pd_sample_result res;
    if (s->gm && s->mask_rc < 0) /* the mask thread's (thread-local errors stay there) */
        return pd_error(s->mask_rc, "structured output: the token mask failed (%s)",
                        pd_status_name(s->mask_rc));
    /* structured output: only what the grammar allows next (masks_start) */
    PD_CHECK(pd_sample(s->smp, logits, s->gm ? s->mask : NULL, e->ws, &res));
    if (s->gm) PD_CHECK(pd_gmatcher_accept_token(s->gm, res.token));
    PD_CHECK(pd_sched_append(e->sched, s->sq, res.token));
    e->stats.generation_tokens++;
    return eng_seq_emit_token(e, s, res.token, &res);
}

/* Ends every sequence of r with the error rc (its message copied to msg) (under mu). */
static void end_request(pd_engine *e, eng_req *r, int rc, char *msg, size_t cap)
{
    snprintf(msg, cap, "%s", pd_last_error());
    PD_WARN(r->id, "request failed: %s", msg);
    for (uint32_t c = 0; c < r->n; c++) eng_seq_end_status(e, &r->seqs[c], rc, msg);
}

/* Frees, once each, the requests of the last schedule's items that have ended (under mu). The
 * items point into sequences that this frees, so they are not read afterwards. */
static void free_ended_requests(pd_engine *e)
{
    eng_req *list = NULL;
    for (size_t i = 0; i < e->so.n_items; i++) {
        eng_req *r = ((eng_seq *)pd_seq_user(e->so.items[i].seq))->req;
        if (r->free_mark || r->n_live > 0 || r->in_inbox || r->state == REQ_HELD) continue;
        r->free_mark = true;
        r->fnext = list;
        list = r;
    }
    e->so.n_items = 0;
    while (list) {
        eng_req *r = list;
        list = r->fnext;
        eng_req_maybe_free(e, r);
    }
}

/* ---- structured-output masks, made while the forward pass runs ------------------------------- */

/* Calls f on every guided sequence that draws from this step's logits: each item with a logits
 * row, and for a request whose prompt just finished, every choice (process_item's set). */
static bool each_guided(pd_engine *e, void (*f)(eng_seq *))
{
    bool any = false;
    for (size_t i = 0; i < e->so.n_items; i++) {
        if (e->item_out[i] < 0) continue;
        const pd_sched_item *it = &e->so.items[i];
        eng_seq *s = pd_seq_user(it->seq);
        eng_req *r = s->req;
        uint32_t last = s->index;
        if (s->index == 0 && pd_seq_num_output(it->seq) == 0 && r->n > 1) last = r->n - 1;
        for (uint32_t c = s->index; c <= last; c++) {
            eng_seq *cs = &r->seqs[c];
            if (!cs->gm || cs->ended) continue;
            any = true;
            if (f) f(cs);
        }
    }
    return any;
}

static void fill_one(eng_seq *s)
{
    s->mask_rc = pd_gmatcher_fill_mask(s->gm, s->mask);
}

static void *mask_main(void *arg)
{
    pd_engine *e = arg;
    pthread_mutex_lock(&e->mmu);
    for (;;) {
        while (e->m_done == e->m_job && !e->m_quit) pthread_cond_wait(&e->mcv, &e->mmu);
        if (e->m_quit) break;
        pthread_mutex_unlock(&e->mmu);
        each_guided(e, fill_one);
        pthread_mutex_lock(&e->mmu);
        e->m_done = e->m_job;
        pthread_cond_broadcast(&e->mcv);
    }
    pthread_mutex_unlock(&e->mmu);
    return NULL;
}

/* Starts the masks of this step's guided sequences on the mask thread (started at the first
 * use); false when there are none, or when the thread cannot start (then they are made here,
 * before the forward pass). */
static bool masks_start(pd_engine *e)
{
    if (!each_guided(e, NULL)) return false;
    if (!e->mthread_on && pthread_create(&e->mthread, NULL, mask_main, e) == 0)
        e->mthread_on = true;
    if (!e->mthread_on) {
        each_guided(e, fill_one);
        return false;
    }
    pthread_mutex_lock(&e->mmu);
    e->m_job++;
    pthread_cond_broadcast(&e->mcv);
    pthread_mutex_unlock(&e->mmu);
    return true;
}

static void masks_wait(pd_engine *e)
{
    pthread_mutex_lock(&e->mmu);
    while (e->m_done != e->m_job) pthread_cond_wait(&e->mcv, &e->mmu);
    pthread_mutex_unlock(&e->mmu);
}

void eng_masks_stop(pd_engine *e)
{
    if (!e->mthread_on) return;
    pthread_mutex_lock(&e->mmu);
    e->m_quit = true;
    pthread_cond_broadcast(&e->mcv);
    pthread_mutex_unlock(&e->mmu);
    pthread_join(e->mthread, NULL);
    e->mthread_on = false;
}

/* The pd_engine_stats.step_tokens bin of a step of n_tokens tokens (>= 1). */
static size_t step_bin(size_t n_tokens)
{
    size_t bin = 0;
    while (bin + 1 < PD_ENGINE_STEP_BINS && ((size_t)1 << bin) < n_tokens) bin++;
    return bin;
}

/* One step; *did_work false when nothing was scheduled. */
static int step_once(pd_engine *e, bool *did_work)
{
    *did_work = false;
    int64_t t0 = pd_now_ns();
    pthread_mutex_lock(&e->mu);
    int rc = eng_apply_inbox(e);
    if (rc == PD_OK && eng_queue_free(e) < e->p.max_num_seqs) rc = PD_EBUSY;
    if (rc == PD_EBUSY) {
        pthread_mutex_unlock(&e->mu);
        return pd_error(PD_EBUSY, "output queue full: drain the events");
    }
    rc = pd_sched_schedule(e->sched, &e->so);
    if (rc >= 0 && e->p.spec_num_tokens) rc = eng_spec_propose(e);
    if (rc >= 0) rc = build_step(e);
    if (rc < 0 || e->so.n_items == 0) {
        e->so.n_items = 0;
        pthread_mutex_unlock(&e->mu);
        return rc;
    }
    e->stats.num_preemptions = pd_sched_num_preemptions(e->sched);
    bool masking = masks_start(e); /* under mu: the step's items are fixed from here */
    pthread_mutex_unlock(&e->mu);

    int64_t t1 = pd_now_ns();
    int frc = eng_ranks_run(e); /* no lock: adds and reservations may proceed meanwhile */
    int64_t t2 = pd_now_ns();
    if (masking) masks_wait(e);

    pthread_mutex_lock(&e->mu);
    e->stats.forward_ns += (uint64_t)(t2 - t1);
    *did_work = true;
    e->stats.steps++;
    e->stats.step_tokens[step_bin(e->so.n_tokens)]++;
    e->stats.step_tokens_sum += e->so.n_tokens;
    pd_sched_commit(e->sched);
    char msg[512];
    if (frc < 0) {
        /* the step's sequences cannot continue: end them (all choices) with the error */
        snprintf(msg, sizeof msg, "%s", pd_last_error());
        PD_ERROR("-", "step failed: %s", msg);
        for (size_t i = 0; i < e->so.n_items; i++) {
            eng_req *r = ((eng_seq *)pd_seq_user(e->so.items[i].seq))->req;
            for (uint32_t c = 0; c < r->n; c++) eng_seq_end_status(e, &r->seqs[c], frc, msg);
        }
    } else {
        for (size_t i = 0; i < e->so.n_items; i++) {
            const pd_sched_item *it = &e->so.items[i];
            eng_seq *s = pd_seq_user(it->seq);
            size_t np = pd_seq_num_prompt(it->seq);
            if (it->start < np)
                e->stats.prompt_tokens +=
                    (it->start + it->n_new < np ? it->start + it->n_new : np) - it->start;
            int prc = it->lp_n ? prompt_logprobs(e, i) : PD_OK;
            if (prc == PD_OK && e->item_out[i] < 0) continue;
            const float *logits = e->out->logits + (size_t)e->item_out[i] * e->vocab;
            if (prc == PD_OK)
                prc = it->n_draft ? eng_spec_process(e, i, logits) : process_item(e, i, logits);
            if (prc < 0) end_request(e, s->req, prc, msg, sizeof msg);
        }
        /* beam searches whose beams all have their candidates now */
        for (size_t i = 0; i < e->so.n_items; i++) {
            eng_req *r = ((eng_seq *)pd_seq_user(e->so.items[i].seq))->req;
            int brc = r->beam ? eng_beam_round(e, r) : PD_OK;
            if (brc < 0) end_request(e, r, brc, msg, sizeof msg);
        }
    }
    free_ended_requests(e);
    e->stats.step_ns += (uint64_t)(pd_now_ns() - t0);
    pthread_mutex_unlock(&e->mu);
    if (frc < 0) return pd_error(frc, "%s", msg);
    return PD_OK;
}

/* ---- warm-up --------------------------------------------------------------------------------- */

/* One dummy sequence of n_rows new tokens at positions [kv_len - n_rows, kv_len) in blocks 0, 1,
 * ... through every rank's forward pass, its last row's logits wanted. */
static int warmup_step(pd_engine *e, size_t n_rows, size_t kv_len)
{
    size_t bs = e->p.block_size, nb = (kv_len + bs - 1) / bs;
    for (size_t i = 0; i < n_rows; i++) /* ids past the specials of small vocabularies */
        e->st_tokens[i] = (int32_t)((kv_len - n_rows + i) * 7919 % e->vocab);
    for (size_t b = 0; b < nb; b++) e->st_blocks[b] = (int32_t)b;
    e->st_qindptr[0] = 0, e->st_qindptr[1] = (int32_t)n_rows;
    e->st_kvlen[0] = (int32_t)kv_len;
    e->st_bindptr[0] = 0, e->st_bindptr[1] = (int32_t)nb;
    e->st_outrows[0] = (int32_t)(n_rows - 1);
    e->step = (pd_step){.n_seqs = 1,
                        .token_ids = e->st_tokens,
                        .q_indptr = e->st_qindptr,
                        .kv_len = e->st_kvlen,
                        .block_indptr = e->st_bindptr,
                        .block_ids = e->st_blocks,
                        .n_out = 1,
                        .out_rows = e->st_outrows};
    return eng_ranks_run(e);
}

int pd_engine_warmup(pd_engine *e, size_t n_tokens, size_t *n_run)
{
    if (n_run) *n_run = 0;
    pthread_mutex_lock(&e->mu);
    bool busy = e->running || e->in_step || has_work_locked(e) || !pd_kvpool_all_free(e->pool) ||
                e->n_held > 0;
    if (!busy) e->in_step = true;
    pthread_mutex_unlock(&e->mu);
    if (busy) return pd_error(PD_EBUSY, "engine: warm-up only before the first request");
    size_t n = n_tokens ? n_tokens : e->p.max_num_seqs > 16 ? e->p.max_num_seqs : 16;
    size_t pool_tokens = pd_kvpool_num_blocks(e->pool) * e->p.block_size;
    if (n > e->p.max_num_batched_tokens) n = e->p.max_num_batched_tokens;
    if (n > e->p.max_model_len - 1) n = e->p.max_model_len - 1; /* room for the decode row */
    if (n > pool_tokens - 1) n = pool_tokens - 1;
    e->so.n_copies = 0; /* no copy-on-write orders in the rank jobs */
    int rc = n > 0 ? warmup_step(e, n, n) : PD_OK;
    if (rc == PD_OK && n > 0) rc = warmup_step(e, 1, n + 1);
    pthread_mutex_lock(&e->mu);
    e->in_step = false;
    pthread_mutex_unlock(&e->mu);
    if (rc < 0) return pd_error_prefix(rc, "engine warm-up");
    if (n_run) *n_run = n;
    return PD_OK;
}

/* ---- running ------------------------------------------------------------------------------- */

int pd_engine_step(pd_engine *e, bool *did_work)
{
    bool dw = false;
    pthread_mutex_lock(&e->mu);
    if (e->running || e->in_step) {
        pthread_mutex_unlock(&e->mu);
        return pd_error(PD_EBUSY, "engine: a step is already running (engine thread started?)");
    }
    e->in_step = true;
    pthread_mutex_unlock(&e->mu);
    uint64_t before = eng_events_pushed(e);
    int rc = step_once(e, &dw);
    pthread_mutex_lock(&e->mu);
    e->in_step = false;
    pthread_mutex_unlock(&e->mu);
    if (eng_events_pushed(e) != before && e->p.on_event) e->p.on_event(e->p.on_event_ctx);
    if (did_work) *did_work = dw;
    return rc;
}

static void *engine_main(void *arg)
{
    pd_engine *e = arg;
    for (;;) {
        pthread_mutex_lock(&e->mu);
        while (!atomic_load(&e->stop_req) && !has_work_locked(e))
            pthread_cond_wait(&e->work_cv, &e->mu);
        uint64_t gen = e->work_gen;
        pthread_mutex_unlock(&e->mu);
        if (atomic_load(&e->stop_req)) break;
        uint64_t before = eng_events_pushed(e);
        bool dw = false;
        int rc = step_once(e, &dw);
        if (eng_events_pushed(e) != before && e->p.on_event) e->p.on_event(e->p.on_event_ctx);
        if (rc == PD_EBUSY) {
            /* output queue full: wait until the consumer frees room for a step */
            pthread_mutex_lock(&e->qmu);
            while (!atomic_load(&e->stop_req) && e->cap - e->qcount < e->p.max_num_seqs)
                pthread_cond_wait(&e->qcv, &e->qmu);
            pthread_mutex_unlock(&e->qmu);
        } else if (!dw) {
            /* nothing could be scheduled (e.g. blocks held): wait for a change */
            pthread_mutex_lock(&e->mu);
            while (!atomic_load(&e->stop_req) && e->work_gen == gen)
                pthread_cond_wait(&e->work_cv, &e->mu);
            pthread_mutex_unlock(&e->mu);
        }
    }
    return NULL;
}

int pd_engine_start(pd_engine *e)
{
    pthread_mutex_lock(&e->mu);
    int rc = PD_OK;
    if (e->running || e->in_step) rc = pd_error(PD_EBUSY, "engine: already running");
    if (rc == PD_OK) {
        atomic_store(&e->stop_req, false);
        if (pthread_create(&e->thread, NULL, engine_main, e))
            rc = pd_error(PD_EINTERNAL, "engine: cannot start the engine thread");
        else
            e->running = true;
    }
    pthread_mutex_unlock(&e->mu);
    return rc;
}

void pd_engine_stop(pd_engine *e)
{
    pthread_mutex_lock(&e->mu);
    bool running = e->running;
    atomic_store(&e->stop_req, true);
    pthread_cond_broadcast(&e->work_cv);
    pthread_mutex_unlock(&e->mu);
    pthread_mutex_lock(&e->qmu);
    pthread_cond_broadcast(&e->qcv);
    pthread_mutex_unlock(&e->qmu);
    if (!running) return;
    pthread_join(e->thread, NULL);
    pthread_mutex_lock(&e->mu);
    e->running = false;
    pthread_mutex_unlock(&e->mu);
}
