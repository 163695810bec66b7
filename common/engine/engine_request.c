/* The engine's requests (engine_internal.h): the request table, building a request's
 * per-sequence state, adding, aborting, releasing, reserving and importing requests, and the
 * inbox through which aborts and imports reach the engine thread.
 *
 * Design: a request is built (parameters copied and checked, samplers, stop checkers and
 * detokenizers created) before the engine lock is taken, so the lock covers only the table and
 * the scheduler. Everything a request owns is freed in one place, eng_req_free.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"
#include "engine/rng.h"
#include "util/status.h"

/* ---- the request table ------------------------------------------------------------------------
 */

static eng_req *req_find(pd_engine *e, const char *id)
{
    pd_idmap_link *l = pd_idmap_get(&e->reqs, id);
    return l ? PD_IDMAP_ENTRY(l, eng_req, link) : NULL;
}

void eng_req_free(pd_engine *e, eng_req *r)
{
    eng_beam_destroy(e, r);
    for (uint32_t i = 0; i < r->n; i++) {
        eng_seq *s = &r->seqs[i];
        if (s->sq) pd_sched_seq_free(e->sched, s->sq);
        pd_sampler_seq_free(s->smp);
        pd_stop_free(s->stop);
        pd_detok_free(s->detok);
        pd_gmatcher_free(s->gm);
        free(s->mask);
    }
    pd_arena_free(r->arena);
    free(r->plp);
    free(r);
}

static void inbox_push(pd_engine *e, eng_req *r)
{
    if (r->in_inbox) return;
    r->in_inbox = true;
    r->inext = NULL;
    if (e->inbox_tail)
        e->inbox_tail->inext = r;
    else
        e->inbox_head = r;
    e->inbox_tail = r;
}

static void wake_engine(pd_engine *e)
{
    e->work_gen++;
    pthread_cond_broadcast(&e->work_cv);
}

static uint64_t splitmix64(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

void eng_req_maybe_free(pd_engine *e, eng_req *r)
{
    if (r->n_live > 0 || r->state == REQ_HELD || r->in_inbox) return;
    pd_idmap_del(&e->reqs, &r->link);
    e->stats.requests_finished++;
    eng_req_free(e, r);
}

/* ---- the inbox ------------------------------------------------------------------------------- */

int eng_apply_inbox(pd_engine *e)
{
    while (e->inbox_head) {
        eng_req *r = e->inbox_head;
        size_t need = r->abort_requested ? r->n_live : 1;
        if (eng_queue_free(e) < need) return PD_EBUSY;
        e->inbox_head = r->inext;
        if (!e->inbox_head) e->inbox_tail = NULL;
        r->in_inbox = false;
        if (r->abort_requested) {
            for (uint32_t i = 0; i < r->n; i++)
                eng_seq_end_status(e, &r->seqs[i], PD_ECANCELLED, "request aborted");
            if (r->state == REQ_HELD) {
                /* a held hand-over or reservation: its blocks go back now */
                pd_sched_finish(e->sched, r->seqs[0].sq);
                e->n_held--;
                r->state = REQ_ACTIVE;
            }
        } else if (r->state == REQ_IMPORTING && r->beam) {
            /* its last prompt position is computed again here: the first expansion comes from
             * its logits, as a colocated search's does */
            eng_seq *s = &r->seqs[0];
            r->state = REQ_ACTIVE;
            int rc = pd_sched_admit_computed(e->sched, s->sq, r->n_prompt - 1, r->n - 1);
            if (rc < 0)
                for (uint32_t i = 0; i < r->n; i++)
                    eng_seq_end_status(e, &r->seqs[i], rc, pd_last_error());
        } else if (r->state == REQ_IMPORTING) {
            eng_seq *s = &r->seqs[0];
            r->state = REQ_ACTIVE;
            int rc = pd_sampler_seq_append(s->smp, r->first_token);
            if (rc >= 0 && s->gm) rc = pd_gmatcher_accept_token(s->gm, r->first_token);
            if (rc >= 0) rc = eng_seq_emit_token(e, s, r->first_token, NULL);
            if (rc >= 0 && !s->ended) rc = pd_sched_admit_computed(e->sched, s->sq, r->n_prompt, 0);
            if (rc < 0) eng_seq_end_status(e, s, rc, pd_last_error());
        }
        eng_req_maybe_free(e, r);
    }
    return PD_OK;
}

/* ---- adding requests ------------------------------------------------------------------------ */

/* The engine's grammar cache, made with the vocabulary at the first guided request (under
 * gmu). */
static int grammar_cache(pd_engine *e, pd_gcache **out)
{
    *out = NULL;
    if (!e->tok)
        return pd_error(PD_EINVAL, "structured output needs a tokenizer; this engine has none");
    int rc = PD_OK;
    pthread_mutex_lock(&e->gmu);
    if (!e->gcache) {
        rc = pd_gvocab_from_tok(e->tok, e->eos_ids, e->n_eos, &e->gvocab);
        if (rc >= 0) {
            size_t n = (size_t)pd_gvocab_size(e->gvocab);
            e->gmask_words = pd_gmask_words((int32_t)(n > e->vocab ? n : e->vocab));
            e->gcache = pd_gcache_create(e->gvocab, PD_ENGINE_GRAMMAR_CACHE);
            if (!e->gcache) {
                pd_gvocab_free(e->gvocab);
                e->gvocab = NULL;
                rc = pd_error(PD_ENOMEM, "engine: out of memory for structured output");
            }
        }
    }
    *out = e->gcache;
    pthread_mutex_unlock(&e->gmu);
    return rc;
}

static pd_gspec guided_spec(const pd_sampling_params *sp)
{
    return (pd_gspec){.kind = (pd_gspec_kind)sp->guided_kind,
                      .text = sp->guided,
                      .len = sp->guided_len,
                      .ws_pattern = sp->guided_ws,
                      .strict = true};
}

/* The grammar of a guided request (sp->guided_kind set), compiled through the engine's cache
 * on the caller's thread, never the engine thread's. */
static int req_grammar(pd_engine *e, const pd_sampling_params *sp, pd_grammar **out)
{
    *out = NULL;
    pd_gcache *c = NULL;
    PD_CHECK(grammar_cache(e, &c));
    pd_gspec spec = guided_spec(sp);
    return pd_gcache_get(c, &spec, out, NULL);
}

bool pd_engine_grammar_ready(pd_engine *e, const pd_sampling_params *sp)
{
    pd_gcache *c = NULL;
    if (!sp->guided_kind || grammar_cache(e, &c) < 0) return true;
    pd_gspec spec = guided_spec(sp);
    return pd_gcache_has(c, &spec);
}

void pd_engine_grammar_warm(pd_engine *e, const pd_sampling_params *sp)
{
    pd_grammar *g = NULL;
    if (sp->guided_kind && req_grammar(e, sp, &g) >= 0) pd_grammar_unref(g);
}

/* What beam search (engine_beam.c) takes beyond pd_sampling_params_validate's checks: the
 * width against max_num_seqs and the vocabulary, the search's most blocks against the pool (a
 * pool that cannot hold them all at once would leave its beams preempting each other), and none of
 * the sampling fields its log-softmax ranking does not apply (each named in the message). */
static int beam_check(const pd_engine *e, const pd_sampling_params *sp, size_t rq_n_prompt,
                      pd_engine_phase phase)
{
    int32_t w = sp->best_of > 0 ? sp->best_of : sp->n;
    if ((size_t)w > e->p.max_num_seqs)
        return pd_error(PD_EINVAL, "best_of must be at most %zu, got %d.", e->p.max_num_seqs, w);
    if (2 * (size_t)w > e->vocab)
        return pd_error(PD_EINVAL,
                        "best_of: beam search needs a vocabulary of at least 2 x %d "
                        "tokens, the model has %zu",
                        w, e->vocab);
    /* the most blocks the search may hold: the prompt's full blocks once, each beam its tail */
    size_t bs = e->p.block_size, P = rq_n_prompt;
    int64_t max_out = pd_stop_effective_max_tokens(sp, &e->stop_model, (int64_t)P);
    size_t need = P / bs + (size_t)w * ((P % bs + (size_t)max_out + bs - 1) / bs);
    if (need > pd_kvpool_num_blocks(e->pool))
        return pd_error(PD_EINVAL,
                        "best_of: a beam search of %d beams may hold %zu KV blocks, the pool has "
                        "%zu (lower best_of or max_tokens)",
                        w, need, pd_kvpool_num_blocks(e->pool));
    const char *field =
        phase != PD_PHASE_FULL ? "a prefill-only request" : pd_sampling_beam_unsupported(sp);
    if (field)
        return pd_error(PD_EUNSUPPORTED, "use_beam_search: %s is not supported with beam search",
                        field);
    return PD_OK;
}

/* Builds a request object: copies and validates the parameters (rq->sampling not NULL) and
 * creates the per-sequence sampler, stop checker and detokenizer (no engine state touched). */
static int req_build(pd_engine *e, const pd_engine_request *rq, eng_req **out)
{
    *out = NULL;
    if (!rq->request_id || !rq->request_id[0])
        return pd_error(PD_EINVAL, "request id must be a non-empty string");
    if (strlen(rq->request_id) > PD_ENGINE_MAX_REQUEST_ID)
        return pd_error(PD_EINVAL, "request id longer than %d bytes", PD_ENGINE_MAX_REQUEST_ID);
    if (rq->n_prompt == 0 || !rq->prompt_ids)
        return pd_error(PD_EINVAL, "The decoder prompt cannot be empty");
    if (rq->n_prompt >= e->p.max_model_len)
        return pd_error(PD_EINVAL,
                        "This model's maximum context length is %zu tokens. However, your request "
                        "has %zu input tokens. Please reduce the length of the input messages.",
                        e->p.max_model_len, rq->n_prompt);
    for (size_t i = 0; i < rq->n_prompt; i++)
        if (rq->prompt_ids[i] < 0 || (size_t)rq->prompt_ids[i] >= e->vocab)
            return pd_error(PD_EINVAL, "Token id %d is out of vocabulary", rq->prompt_ids[i]);
    pd_sampling_params sp = *rq->sampling;
    PD_CHECK(pd_sampling_params_validate(&sp, (int32_t)e->vocab));
    if (sp.n > (int32_t)e->p.max_num_seqs)
        return pd_error(PD_EINVAL, "n must be at most %zu, got %d.", e->p.max_num_seqs, sp.n);
    if (sp.logprobs > e->p.max_logprobs)
        return pd_error(PD_EINVAL,
                        "Requested sample logprobs of %d, which is greater than max allowed: %d",
                        sp.logprobs, e->p.max_logprobs);
    if (sp.prompt_logprobs < -1)
        return pd_error(PD_EINVAL, "`prompt_logprobs` must be a positive value.");
    if (sp.prompt_logprobs > e->p.max_logprobs)
        return pd_error(PD_EINVAL,
                        "Requested prompt logprobs of %d, which is greater than max allowed: %d",
                        sp.prompt_logprobs, e->p.max_logprobs);
    if (sp.prompt_logprobs >= 0 && e->p.prompt_logprob_rows == 0)
        return pd_error(PD_EINVAL, "prompt_logprobs: this engine has prompt_logprob_rows 0");
    if (sp.n_stop > 0 && !e->tok)
        return pd_error(PD_EINVAL, "stop strings need a tokenizer; this engine has none");
    if (rq->phase == PD_PHASE_PREFILL_ONLY && sp.n != 1)
        return pd_error(PD_EUNSUPPORTED, "n > 1 is not supported for prefill-only requests");
    int32_t n_seqs = sp.n;
    if (sp.use_beam_search) {
        PD_CHECK(beam_check(e, &sp, rq->n_prompt, rq->phase));
        n_seqs = sp.best_of > 0 ? sp.best_of : sp.n;
    }

    eng_req *r = calloc(1, sizeof *r + (size_t)n_seqs * sizeof(eng_seq));
    if (!r) return pd_error(PD_ENOMEM, "engine: out of memory for a request");
    snprintf(r->id, sizeof r->id, "%s", rq->request_id);
    r->phase = rq->phase;
    r->n = (uint32_t)n_seqs;
    r->n_live = r->n;
    r->n_prompt = rq->n_prompt;
    int rc = PD_OK;
    pd_grammar *g = NULL;
    r->arena = pd_arena_create(0);
    if (!r->arena) {
        rc = pd_error(PD_ENOMEM, "engine: out of memory for a request");
        goto fail;
    }
    PD_CHECK_GOTO(pd_sampling_params_clone(&sp, r->arena, &r->sp), rc, fail);
    if (sp.guided_kind) PD_CHECK_GOTO(req_grammar(e, &sp, &g), rc, fail);
    for (uint32_t i = 0; i < r->n; i++) {
        eng_seq *s = &r->seqs[i];
        s->req = r;
        s->index = i;
        s->spec_rate = 1.0f;
        PD_CHECK_GOTO(pd_sampler_seq_create(&r->sp, (int32_t)e->vocab, e->eos_ids, e->n_eos, i,
                                            rq->prompt_ids, rq->n_prompt, &s->smp),
                      rc, fail);
        PD_CHECK_GOTO(pd_stop_create(&r->sp, &e->stop_model, (int64_t)rq->n_prompt, &s->stop), rc,
                      fail);
        if (e->tok)
            PD_CHECK_GOTO(pd_detok_create(e->tok, r->sp.skip_special_tokens, rq->prompt_ids,
                                          rq->n_prompt, &s->detok),
                          rc, fail);
        if (g) {
            PD_CHECK_GOTO(pd_gmatcher_create(g, &s->gm), rc, fail);
            /* zeroed: ids past the tokenizer's (padding rows of lm_head) are never allowed */
            if (!(s->mask = calloc(e->gmask_words, sizeof *s->mask))) {
                rc = pd_error(PD_ENOMEM, "engine: out of memory for a token mask");
                goto fail;
            }
        }
    }
    if (sp.use_beam_search) PD_CHECK_GOTO(eng_beam_create(e, r, rq->prompt_ids), rc, fail);
    pd_grammar_unref(g);
    *out = r;
    return PD_OK;
fail:
    pd_grammar_unref(g);
    eng_beam_destroy(e, r);
    for (uint32_t i = 0; i < r->n; i++) {
        pd_sampler_seq_free(r->seqs[i].smp);
        pd_stop_free(r->seqs[i].stop);
        pd_detok_free(r->seqs[i].detok);
        pd_gmatcher_free(r->seqs[i].gm);
        free(r->seqs[i].mask);
    }
    pd_arena_free(r->arena);
    free(r);
    return rc;
}

/* The prompt logprobs buffer of a request that asked for them (k = prompt_logprobs >= 0). */
static pd_prompt_logprobs *plp_alloc(size_t n_prompt, int32_t k, size_t vocab)
{
    size_t nt = (size_t)k < vocab ? (size_t)k : vocab;
    size_t bytes = sizeof(pd_prompt_logprobs) + n_prompt * (sizeof(float) + sizeof(int32_t)) +
                   n_prompt * nt * (sizeof(int32_t) + sizeof(float));
    pd_prompt_logprobs *p = calloc(1, bytes);
    if (!p) return NULL;
    p->n_prompt = n_prompt;
    p->n_top = (int32_t)nt;
    p->logprob = (float *)(p + 1);
    p->rank = (int32_t *)(p->logprob + n_prompt);
    p->top_ids = p->rank + n_prompt;
    p->top_logprobs = (float *)(p->top_ids + n_prompt * nt);
    return p;
}

/* The seed of a request that gave none (under mu). */
static int64_t draw_seed(pd_engine *e)
{
    uint64_t k = e->n_requests;
    if (e->p.seed < 0) return (int64_t)pd_rng_random_seed();
    return (int64_t)splitmix64((uint64_t)e->p.seed ^ splitmix64(k));
}

int pd_engine_add(pd_engine *e, const pd_engine_request *rq)
{
    /* A request without a seed gets one now, so every choice's sampler is keyed by it and the
     * prefill side can hand it to the decode side. */
    pd_sampling_params sp;
    if (rq->sampling)
        sp = *rq->sampling;
    else
        sp = pd_sampling_model_params(e->model->has_generation_config ? &e->model->generation
                                                                      : NULL);
    if (!sp.has_seed) {
        pthread_mutex_lock(&e->mu);
        sp.seed = draw_seed(e);
        e->n_requests++;
        pthread_mutex_unlock(&e->mu);
        sp.has_seed = true;
    }
    pd_engine_request rq2 = *rq;
    rq2.sampling = &sp;
    eng_req *r;
    PD_CHECK(req_build(e, &rq2, &r));
    int rc = PD_OK;
    if (r->sp.prompt_logprobs >= 0 &&
        !(r->plp = plp_alloc(rq->n_prompt, r->sp.prompt_logprobs, e->vocab))) {
        eng_req_free(e, r);
        return pd_error(PD_ENOMEM, "engine: out of memory for prompt logprobs");
    }
    pthread_mutex_lock(&e->mu);
    if (e->closing)
        rc = pd_error(PD_ECLOSED, "engine is shutting down");
    else if (req_find(e, r->id))
        rc = pd_error(PD_EEXIST, "request id '%s' is already in use", r->id);
    if (rc >= 0)
        rc = pd_sched_seq_create(e->sched, rq->prompt_ids, rq->n_prompt, &r->seqs[0],
                                 &r->seqs[0].sq);
    if (rc >= 0 && r->plp) rc = pd_sched_seq_want_prompt_logits(e->sched, r->seqs[0].sq);
    if (rc >= 0) rc = pd_sched_add(e->sched, r->seqs[0].sq, r->n - 1);
    if (rc >= 0) {
        r->state = REQ_ACTIVE;
        pd_idmap_put(&e->reqs, &r->link, r->id);
        r = NULL;
        wake_engine(e);
    }
    if (r) eng_req_free(e, r); /* frees its scheduler sequence too, under the lock */
    pthread_mutex_unlock(&e->mu);
    return rc;
}

int pd_engine_abort(pd_engine *e, const char *request_id)
{
    pthread_mutex_lock(&e->mu);
    eng_req *r = req_find(e, request_id);
    int rc = PD_OK;
    if (!r) {
        rc = pd_error(PD_ENOTFOUND, "no live request '%s'", request_id);
    } else {
        r->abort_requested = true;
        inbox_push(e, r);
        wake_engine(e);
    }
    pthread_mutex_unlock(&e->mu);
    return rc;
}

int pd_engine_release(pd_engine *e, const char *request_id)
{
    pthread_mutex_lock(&e->mu);
    eng_req *r = req_find(e, request_id);
    int rc = PD_OK;
    if (!r || r->state != REQ_HELD || r->phase != PD_PHASE_PREFILL_ONLY) {
        rc = pd_error(PD_ENOTFOUND, "no held prefill-only request '%s'", request_id);
    } else {
        /* held sequences are in no step: free at once */
        pd_sched_finish(e->sched, r->seqs[0].sq);
        e->n_held--;
        r->state = REQ_ACTIVE;
        eng_req_maybe_free(e, r);
        wake_engine(e);
    }
    pthread_mutex_unlock(&e->mu);
    return rc;
}

int pd_engine_reserve(pd_engine *e, const char *request_id, size_t n_tokens,
                      const int32_t *prompt_ids, int32_t *block_ids, size_t cap, size_t *n_blocks,
                      size_t *n_cached)
{
    if (!request_id || !request_id[0] || strlen(request_id) > PD_ENGINE_MAX_REQUEST_ID)
        return pd_error(PD_EINVAL, "request id must be 1 to %d bytes", PD_ENGINE_MAX_REQUEST_ID);
    if (n_tokens == 0 || n_tokens >= e->p.max_model_len)
        return pd_error(PD_EINVAL,
                        "This model's maximum context length is %zu tokens. However, your request "
                        "has %zu input tokens. Please reduce the length of the input messages.",
                        e->p.max_model_len, n_tokens);
    size_t nb = (n_tokens + e->p.block_size - 1) / e->p.block_size;
    if (cap < nb)
        return pd_error(PD_EINVAL, "reserve: %zu block ids needed, room for %zu", nb, cap);
    eng_req *r = calloc(1, sizeof *r + sizeof(eng_seq));
    if (!r) return pd_error(PD_ENOMEM, "engine: out of memory for a reservation");
    snprintf(r->id, sizeof r->id, "%s", request_id);
    r->n = 1;
    r->n_live = 1;
    r->n_prompt = n_tokens;
    r->seqs[0].req = r;
    r->arena = pd_arena_create(0);
    /* without prompt_ids, the real ids arrive with pd_engine_add_imported */
    int32_t *zeros = prompt_ids ? NULL : calloc(n_tokens, sizeof *zeros);
    const int32_t *ids = prompt_ids ? prompt_ids : zeros;
    size_t cached = 0;
    int rc = (r->arena && ids) ? PD_OK : pd_error(PD_ENOMEM, "engine: out of memory");
    pthread_mutex_lock(&e->mu);
    if (rc >= 0 && e->closing) rc = pd_error(PD_ECLOSED, "engine is shutting down");
    if (rc >= 0 && req_find(e, request_id))
        rc = pd_error(PD_EEXIST, "request id '%s' is already in use", request_id);
    if (rc >= 0) rc = pd_sched_seq_create(e->sched, ids, n_tokens, &r->seqs[0], &r->seqs[0].sq);
    if (rc >= 0)
        rc = pd_sched_reserve(e->sched, r->seqs[0].sq, n_tokens, prompt_ids != NULL, &cached);
    if (rc >= 0) {
        if (n_cached) *n_cached = cached;
        const pd_kvtable *t = pd_seq_table(r->seqs[0].sq);
        memcpy(block_ids, pd_kvtable_ids(t), nb * sizeof *block_ids);
        *n_blocks = nb;
        r->state = REQ_HELD; /* held blocks, not in the queues */
        r->phase = PD_PHASE_FULL;
        e->n_held++;
        pd_idmap_put(&e->reqs, &r->link, r->id);
        r = NULL;
    }
    if (r) eng_req_free(e, r);
    pthread_mutex_unlock(&e->mu);
    free(zeros);
    return rc;
}

int pd_engine_add_imported(pd_engine *e, const pd_engine_request *rq, int32_t first_token)
{
    if (!rq->sampling || !rq->sampling->has_seed)
        return pd_error(PD_EINVAL, "an imported request needs the prefill side's seed");
    if (rq->phase != PD_PHASE_FULL)
        return pd_error(PD_EINVAL, "an imported request runs in phase FULL");
    bool beam = rq->sampling->use_beam_search;
    if (!beam && (first_token < 0 || (size_t)first_token >= e->vocab))
        return pd_error(PD_EINVAL, "Token id %d is out of vocabulary", first_token);
    if (!beam && rq->sampling->n != 1)
        return pd_error(PD_EINVAL, "an imported request has n = 1 (or searches beams)");
    eng_req *built;
    PD_CHECK(req_build(e, rq, &built));
    pthread_mutex_lock(&e->mu);
    eng_req *r = req_find(e, rq->request_id);
    int rc = PD_OK;
    if (!r || r->state != REQ_HELD || r->phase != PD_PHASE_FULL || r->abort_requested)
        rc = pd_error(PD_ENOTFOUND, "no reservation for request '%s'", rq->request_id);
    else if (r->n_prompt != rq->n_prompt)
        rc = pd_error(PD_EINVAL, "request '%s': prompt has %zu tokens but %zu were reserved",
                      rq->request_id, rq->n_prompt, r->n_prompt);
    pd_sched_seq *sq = rc >= 0 ? r->seqs[0].sq : NULL;
    if (rc >= 0) rc = pd_sched_seq_set_prompt(e->sched, sq, rq->prompt_ids, rq->n_prompt);
    if (rc >= 0 && !beam) rc = pd_sched_append(e->sched, sq, first_token);
    if (rc >= 0) {
        /* the built request takes the reservation's place and its sequence */
        pd_seq_set_user(sq, &built->seqs[0]);
        built->seqs[0].sq = sq;
        r->seqs[0].sq = NULL;
        pd_idmap_del(&e->reqs, &r->link);
        eng_req_free(e, r);
        built->first_token = beam ? -1 : first_token;
        built->state = REQ_IMPORTING;
        pd_idmap_put(&e->reqs, &built->link, built->id);
        e->n_held--;
        inbox_push(e, built);
        wake_engine(e);
        built = NULL;
    }
    pthread_mutex_unlock(&e->mu);
    if (built) eng_req_free(e, built);
    return rc;
}
