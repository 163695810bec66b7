/* Beam search in the engine (engine_internal.h; docs/beam_search.md), with vLLM 0.5's semantics.
 *
 * A request with use_beam_search has W = best_of slots. Its prompt runs as one sequence (slot
 * 0); every later sequence is a fork (pd_sched_fork: the blocks are shared, the last partial
 * one copied on write), so the prompt's blocks are held once whatever the width. When every
 * running beam has computed its last token, a round runs:
 *   1. candidates: over the running beams (the parents, best first), the 2W most likely
 *      (parent, token) pairs by parent cumulative logprob + token logprob (log_softmax of the raw
 *      logits), ties in parent-then-token order;
 *   2. each candidate is stop-checked (EOS unless ignore_eos, stop ids: "stop"; its output
 *      reaching the effective max_tokens: "length"); the finished ones join the kept finished
 *      set, which keeps the W best by beam score;
 *   3. the search stops when no candidate runs on, or when W finished ones are kept and the
 *      early_stopping rule holds (true: at once; false: the best running score cannot beat the
 *      W-th finished one; "never": likewise with the running one scored at its longest length
 *      when length_penalty > 0);
 *   4. else the W best running candidates by score become the beams: a parent with no child is
 *      dropped (its blocks go back at once), a parent's first child takes its slot, the others
 *      fork from it; each appends its token.
 * Beam score = cumulative logprob / len ** length_penalty, len = prompt + output tokens, minus
 * one when the last token is the primary EOS. The answer is the n kept finished beams sorted by
 * score without that correction (vLLM's RequestOutput), each pushed as one final event with all
 * its tokens on slot j = choice j.
 *
 * Design choices: a slot keeps only its 2W best tokens of a step (enough: a pair in the global
 * top 2W is in its parent's top 2W), so beams need not step together: one that was preempted
 * recomputes and the round waits for it. The W - 1 children reserved at add stay reserved for
 * the whole search (a dropped beam passes its place on), so the beams never exceed best_of
 * sequences against max_num_seqs. Everything is allocated in the request's arena at add.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "engine/engine_internal.h"
#include "util/status.h"

int eng_beam_create(pd_engine *e, eng_req *r, const int32_t *prompt)
{
    uint32_t W = r->n;
    pd_arena *a = r->arena;
    eng_beam *b = pd_arena_calloc(a, 1, sizeof *b);
    if (!b) return pd_error(PD_ENOMEM, "engine: out of memory for a beam search");
    b->width = W;
    b->n_cand = 2 * (size_t)W < e->vocab ? 2 * W : (uint32_t)e->vocab;
    b->k = r->sp.logprobs;
    b->n_keep = b->k > (int32_t)b->n_cand ? (uint32_t)b->k : b->n_cand;
    b->max_out = (size_t)pd_stop_max_tokens(r->seqs[0].stop);
    b->prompt = pd_arena_calloc(a, r->n_prompt, sizeof *b->prompt);
    b->cum = pd_arena_calloc(a, W, sizeof *b->cum);
    b->ready = pd_arena_calloc(a, W, sizeof *b->ready);
    b->cand_tok = pd_arena_calloc(a, (size_t)W * b->n_keep, sizeof *b->cand_tok);
    b->cand_lp = pd_arena_calloc(a, (size_t)W * b->n_keep, sizeof *b->cand_lp);
    b->lp_tail = pd_arena_calloc(a, W, sizeof *b->lp_tail);
    b->lp_new = pd_arena_calloc(a, W, sizeof *b->lp_new);
    b->order = pd_arena_calloc(a, W, sizeof *b->order);
    b->cands = pd_arena_calloc(a, 2 * (size_t)W, sizeof *b->cands);
    b->fin = pd_arena_calloc(a, 3 * (size_t)W, sizeof *b->fin);
    b->fin_pool = pd_arena_calloc(a, 3 * (size_t)W * b->max_out, sizeof *b->fin_pool);
    b->fin_free = pd_arena_calloc(a, 3 * (size_t)W, sizeof *b->fin_free);
    b->kids = pd_arena_calloc(a, W, sizeof *b->kids);
    b->slot_of = pd_arena_calloc(a, W, sizeof *b->slot_of);
    b->dead = pd_arena_calloc(a, W, sizeof *b->dead);
    if (!b->prompt || !b->cum || !b->ready || !b->cand_tok || !b->cand_lp || !b->lp_tail ||
        !b->lp_new || !b->order || !b->cands || !b->fin || !b->fin_pool || !b->fin_free ||
        !b->kids || !b->slot_of || !b->dead)
        return pd_error(PD_ENOMEM, "engine: out of memory for a beam search of %u beams", W);
    memcpy(b->prompt, prompt, r->n_prompt * sizeof *prompt);
    b->n_order = 1; /* the prompt's sequence, slot 0 */
    for (uint32_t i = 0; i < 3 * W; i++) b->fin_free[i] = i;
    b->n_fin_free = 3 * W;
    r->beam = b;
    if (r->sp.n_stop > 0) { /* req_build made every slot's detokenizer (stop strings need one) */
        b->cand_dt = pd_arena_calloc(a, 2 * (size_t)W, sizeof *b->cand_dt);
        b->cand_st = pd_arena_calloc(a, 2 * (size_t)W, sizeof *b->cand_st);
        if (!b->cand_dt || !b->cand_st)
            return pd_error(PD_ENOMEM, "engine: out of memory for a beam search of %u beams", W);
        for (uint32_t i = 0; i < 2 * W; i++) {
            PD_CHECK(pd_detok_create(e->tok, r->sp.skip_special_tokens, prompt, r->n_prompt,
                                     &b->cand_dt[i]));
            PD_CHECK(pd_stop_create(&r->sp, &e->stop_model, (int64_t)r->n_prompt, &b->cand_st[i]));
        }
    }
    return PD_OK;
}

void eng_beam_destroy(pd_engine *e, eng_req *r)
{
    eng_beam *b = r->beam;
    if (!b) return;
    eng_beam_free(e, r);
    for (uint32_t i = 0; b->cand_dt && i < 2 * b->width; i++) {
        pd_detok_free(b->cand_dt[i]);
        pd_stop_free(b->cand_st[i]);
    }
}

void eng_beam_free(pd_engine *e, eng_req *r)
{
    eng_beam *b = r->beam;
    if (!b) return;
    for (uint32_t i = 0; i < b->n_dead; i++) pd_sched_seq_free(e->sched, b->dead[i]);
    b->n_dead = 0;
}

int eng_beam_candidates(pd_engine *e, eng_seq *s, const float *logits)
{
    eng_beam *b = s->req->beam;
    pd_sample_result res;
    PD_CHECK(
        pd_sampler_logprobs(logits, (int32_t)e->vocab, (int32_t)b->n_keep, 0, e->ws, &res, NULL));
    size_t o = (size_t)s->index * b->n_keep;
    for (int32_t j = 0; j < res.n_top; j++) {
        b->cand_tok[o + (size_t)j] = res.top_ids[j];
        b->cand_lp[o + (size_t)j] = res.top_logprobs[j];
    }
    b->ready[s->index] = true;
    return PD_OK;
}

/* vLLM's Sequence.get_beam_search_score over seq_len tokens. */
static double beam_score(double cum, size_t seq_len, double length_penalty)
{
    return cum / pow((double)seq_len, length_penalty);
}

/* The score a candidate is ranked by: len minus one when its last token is the primary EOS. */
static double ranked_score(const pd_engine *e, const eng_req *r, double cum, size_t n_out,
                           int32_t last)
{
    size_t len = r->n_prompt + n_out - (e->stop_model.eos_id >= 0 && last == e->stop_model.eos_id);
    return beam_score(cum, len, r->sp.length_penalty);
}

/* Stable insertion sort of c[0..n) by score, best first. */
static void sort_by_score(eng_beam_cand *c, uint32_t n)
{
    for (uint32_t i = 1; i < n; i++) {
        eng_beam_cand x = c[i];
        uint32_t j = i;
        for (; j > 0 && x.score > c[j - 1].score; j--) c[j] = c[j - 1];
        c[j] = x;
    }
}

/* Whether candidate c's text ends with a stop string: decoded and checked on copies of its
 * parent's detokenizer and checker (kept for the beam it may become); sets c->fin if so. */
static int check_stop_string(eng_req *r, eng_beam_cand *c)
{
    eng_beam *b = r->beam;
    const eng_seq *p = &r->seqs[c->parent];
    pd_detok *d = b->cand_dt[c->scratch];
    pd_stop *st = b->cand_st[c->scratch];
    PD_CHECK(pd_detok_copy_state(d, p->detok));
    PD_CHECK(pd_stop_copy_state(st, p->stop));
    const char *delta;
    size_t dlen;
    PD_CHECK(pd_detok_push(d, c->token, &delta, &dlen));
    pd_stop_result sr;
    PD_CHECK(pd_stop_push(st, c->token, delta, dlen, &sr));
    if (sr.stop_kind == PD_STOP_REASON_STRING) c->fin = sr;
    return PD_OK;
}

/* Step 1: the 2W best (parent, token) pairs, best first, ties in parent-then-token order, into
 * cands (*n_cands of them); with step 2's stop check. */
static int gather(const pd_engine *e, eng_req *r, uint32_t *n_cands)
{
    eng_beam *b = r->beam;
    uint32_t cap = 2 * b->width, n = 0;
    for (uint32_t k = 0; k < b->n_order; k++) {
        uint32_t slot = b->order[k];
        const int32_t *tok = b->cand_tok + (size_t)slot * b->n_keep;
        const double *lp = b->cand_lp + (size_t)slot * b->n_keep;
        size_t n_out = pd_seq_num_output(r->seqs[slot].sq) + 1;
        for (uint32_t j = 0; j < b->n_cand; j++) {
            double v = b->cum[slot] + lp[j];
            if (n == cap && !(v > b->cands[cap - 1].cum)) break; /* lp[] is descending */
            uint32_t pos = n < cap ? n++ : cap - 1;
            for (; pos > 0 && v > b->cands[pos - 1].cum; pos--) b->cands[pos] = b->cands[pos - 1];
            eng_beam_cand *c = &b->cands[pos];
            *c = (eng_beam_cand){.parent = slot,
                                 .token = tok[j],
                                 .logprob = (float)lp[j],
                                 .cum = v,
                                 .n_tokens = n_out};
        }
    }
    /* step 2's stop check (vLLM 0.5: stop tokens, then stop strings, then the length) */
    for (uint32_t i = 0; i < n; i++) {
        eng_beam_cand *c = &b->cands[i];
        c->fin.stop_token = -1;
        c->scratch = i;
        if (pd_stop_check_token(r->seqs[0].stop, c->token, &c->fin) == PD_FINISH_NONE) {
            if (b->cand_st) PD_CHECK(check_stop_string(r, c));
            if (c->fin.finish == PD_FINISH_NONE && c->n_tokens >= b->max_out)
                c->fin.finish = PD_FINISH_LENGTH;
        }
        c->score = ranked_score(e, r, c->cum, c->n_tokens, c->token);
    }
    *n_cands = n;
    return PD_OK;
}

/* With logprobs: candidate c's token as the next link of its parent's chain (in the arena). */
static const eng_beam_lp *lp_link(eng_req *r, const eng_beam_cand *c)
{
    eng_beam *b = r->beam;
    size_t k = (size_t)b->k;
    eng_beam_lp *l = pd_arena_alloc(r->arena, sizeof *l + k * (sizeof(int32_t) + sizeof(float)), 0);
    if (!l) return NULL;
    l->prev = b->lp_tail[c->parent];
    l->logprob = c->logprob;
    l->top_ids = (int32_t *)(l + 1);
    l->top_lps = (float *)(l->top_ids + k);
    size_t o = (size_t)c->parent * b->n_keep;
    for (size_t i = 0; i < k; i++) {
        l->top_ids[i] = b->cand_tok[o + i];
        l->top_lps[i] = (float)b->cand_lp[o + i];
    }
    return l;
}

/* Step 2: moves the finished candidates into the kept set (the W best stay) and compacts the
 * running ones, sorted by score, to the front of cands. *n_all receives the finished ones there
 * were (kept and new, before the cut), *n_run the running count. */
static int keep_finished(eng_req *r, uint32_t n, uint32_t *n_run, uint32_t *n_all)
{
    eng_beam *b = r->beam;
    uint32_t nf = b->n_fin, nr = 0;
    for (uint32_t i = 0; i < n; i++) {
        eng_beam_cand c = b->cands[i];
        if (c.fin.finish == PD_FINISH_NONE) {
            b->cands[nr++] = c;
            continue;
        }
        if (b->k >= 0 && !(c.lp = lp_link(r, &c)))
            return pd_error(PD_ENOMEM, "engine: out of memory for a beam's logprobs");
        size_t n_tok;
        const int32_t *all = pd_seq_tokens(r->seqs[c.parent].sq, &n_tok);
        c.tokens = b->fin_pool + (size_t)b->fin_free[--b->n_fin_free] * b->max_out;
        memcpy(c.tokens, all + r->n_prompt, (c.n_tokens - 1) * sizeof *c.tokens);
        c.tokens[c.n_tokens - 1] = c.token;
        b->fin[nf++] = c;
    }
    sort_by_score(b->fin, nf); /* kept ones first among equals, as they came first */
    b->n_fin = nf < b->width ? nf : b->width;
    for (uint32_t i = b->n_fin; i < nf; i++)
        b->fin_free[b->n_fin_free++] = (uint32_t)((b->fin[i].tokens - b->fin_pool) / b->max_out);
    sort_by_score(b->cands, nr);
    *n_run = nr;
    *n_all = nf;
    return PD_OK;
}

/* Step 3: vLLM 0.5's _check_beam_search_early_stopping, given W finished ones. */
static bool early_stop(const pd_engine *e, const eng_req *r)
{
    const eng_beam *b = r->beam;
    const eng_beam_cand *best = &b->cands[0], *worst = &b->fin[b->width - 1];
    double lp = r->sp.length_penalty;
    switch (r->sp.early_stopping) {
    case PD_EARLY_STOPPING_TRUE: return true;
    case PD_EARLY_STOPPING_NEVER:
        if (lp > 0.0) {
            size_t longest = r->n_prompt + b->max_out;
            if (longest < e->p.max_model_len) longest = e->p.max_model_len;
            return worst->score >= beam_score(best->cum, longest, lp);
        }
        return worst->score >= best->score;
    default: return worst->score >= best->score;
    }
}

/* The search stopped: pushes the answer (the kept finished beams by uncorrected score, n of
 * them) and ends every slot; the request's blocks go back now. */
static int answer(pd_engine *e, eng_req *r)
{
    eng_beam *b = r->beam;
    for (uint32_t i = 0; i < b->n_fin; i++)
        b->fin[i].score =
            beam_score(b->fin[i].cum, r->n_prompt + b->fin[i].n_tokens, r->sp.length_penalty);
    sort_by_score(b->fin, b->n_fin);
    int rc = PD_OK;
    for (uint32_t j = 0; j < (uint32_t)r->sp.n; j++) {
        eng_seq *s = &r->seqs[j];
        if (j < b->n_fin) {
            int erc = eng_seq_emit_beam(e, s, &b->fin[j]);
            if (erc < 0 && rc == PD_OK) rc = erc;
            if (erc >= 0) continue;
        }
        eng_seq_end_status(e, s, PD_EINTERNAL,
                           j < b->n_fin ? pd_last_error() : "beam search: too few finished beams");
    }
    for (uint32_t i = 0; i < r->n; i++) {
        eng_seq *s = &r->seqs[i];
        if (s->sq) pd_sched_finish(e->sched, s->sq);
        if (!s->ended) {
            s->ended = true;
            r->n_live--;
        }
    }
    return rc;
}

/* Step 4: the W best running candidates become the beams. */
static int next_beams(pd_engine *e, eng_req *r, uint32_t nb)
{
    eng_beam *b = r->beam;
    /* the new beams' logprobs links, while the parents' chains are as they were */
    for (uint32_t j = 0; j < nb && b->k >= 0; j++)
        if (!(b->lp_new[j] = lp_link(r, &b->cands[j])))
            return pd_error(PD_ENOMEM, "engine: out of memory for a beam's logprobs");
    memset(b->kids, 0, b->width * sizeof *b->kids);
    for (uint32_t j = 0; j < nb; j++) b->kids[b->cands[j].parent]++;
    uint32_t anchor = b->cands[0].parent;
    pd_sched_seq *asq = r->seqs[anchor].sq;
    /* drop the childless parents: their places pass to the anchor, as do the other parents'
     * reserved children, so that every fork below finds one */
    for (uint32_t k = 0; k < b->n_order; k++) {
        uint32_t slot = b->order[k];
        pd_sched_seq *sq = r->seqs[slot].sq;
        if (slot == anchor) continue;
        if (b->kids[slot] == 0) {
            PD_CHECK(pd_sched_finish_into(e->sched, sq, asq));
            b->dead[b->n_dead++] = sq;
            r->seqs[slot].sq = NULL;
        } else {
            PD_CHECK(pd_sched_pass_children(e->sched, sq, asq, pd_seq_num_reserved(sq)));
        }
    }
    /* a parent's first child takes its slot, the others fork from it (before any append) */
    uint32_t free_slot = 0;
    for (uint32_t j = 0; j < nb; j++) {
        uint32_t p = b->cands[j].parent;
        if (b->kids[p] & 0x80000000u) {
            while (r->seqs[free_slot].sq) free_slot++;
            pd_sched_seq *psq = r->seqs[p].sq;
            if (p != anchor) PD_CHECK(pd_sched_pass_children(e->sched, asq, psq, 1));
            PD_CHECK(pd_sched_fork(e->sched, psq, &r->seqs[free_slot], &r->seqs[free_slot].sq));
            b->slot_of[j] = free_slot;
        } else {
            b->kids[p] |= 0x80000000u; /* taken */
            b->slot_of[j] = p;
        }
    }
    /* each new beam takes over its candidate's logprobs chain, detokenizer and checker */
    for (uint32_t j = 0; j < nb; j++) {
        uint32_t slot = b->slot_of[j];
        const eng_beam_cand *c = &b->cands[j];
        if (b->k >= 0) b->lp_tail[slot] = b->lp_new[j];
        if (b->cand_st) {
            PD_CHECK(pd_detok_copy_state(r->seqs[slot].detok, b->cand_dt[c->scratch]));
            PD_CHECK(pd_stop_copy_state(r->seqs[slot].stop, b->cand_st[c->scratch]));
        }
    }
    for (uint32_t j = 0; j < nb; j++) {
        uint32_t slot = b->slot_of[j];
        PD_CHECK(pd_sched_append(e->sched, r->seqs[slot].sq, b->cands[j].token));
        b->cum[slot] = b->cands[j].cum;
        b->order[j] = slot;
        e->stats.generation_tokens++;
    }
    b->n_order = nb;
    memset(b->ready, 0, b->width * sizeof *b->ready);
    return PD_OK;
}

int eng_beam_round(pd_engine *e, eng_req *r)
{
    eng_beam *b = r->beam;
    if (r->abort_requested || r->n_live == 0) return PD_OK;
    for (uint32_t k = 0; k < b->n_order; k++) {
        const pd_sched_seq *sq = r->seqs[b->order[k]].sq;
        size_t n_tok;
        pd_seq_tokens(sq, &n_tok);
        if (!b->ready[b->order[k]] || pd_seq_get_state(sq) != PD_SEQ_RUNNING ||
            pd_seq_num_computed(sq) != n_tok)
            return PD_OK; /* a beam was preempted: the round waits until it recomputed */
    }
    eng_beam_free(e, r); /* last round's dropped beams: no step refers to them any more */
    uint32_t n = 0, n_run = 0, n_fin = 0;
    PD_CHECK(gather(e, r, &n));
    PD_CHECK(keep_finished(r, n, &n_run, &n_fin));
    bool stop = n_run == 0 || (n_fin >= b->width && early_stop(e, r));
    if (stop) return answer(e, r);
    return next_beams(e, r, n_run < b->width ? n_run : b->width);
}
