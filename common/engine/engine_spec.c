/* Speculative decoding in the engine (engine_internal.h, engine/spec.h): n-gram drafts join the
 * step's decoding items before the step is built, and their rows' logits are sampled in turn after
 * it, each draft accepted while the token sampled equals it.
 *
 * Design: a draft costs a row of the step, a logits row and an event slot, so drafts are added
 * while the step stays within spec_max_step_rows rows (past that, a step's time grows with its
 * rows and drafts stop being nearly free: large batches decode without them), the logits rows
 * reserved for them and the output queue's room allow. Sequences that sample under a grammar,
 * want prompt logprobs or have not sampled yet take none. Rejected drafts give their slots back at
 * once (pd_sched_drafts_done).
 *
 * A draft row is not free on every backend (on the CPU a step of 1 + k rows costs about 1 + k / 4
 * of a one-row step), so a sequence whose drafts are mostly rejected stops proposing: each keeps
 * a decaying average of the share of its drafts accepted, and below SPEC_MIN_RATE it rests
 * SPEC_REST steps, then tries again (its text may have started to repeat).
 */
#include "engine/engine_internal.h"
#include "engine/spec.h"
#include "util/status.h"

#define SPEC_MIN_RATE 0.25f /* acceptance below which a sequence rests */
#define SPEC_REST     8     /* steps of rest */
#define SPEC_DECAY    0.5f  /* weight of the last draft step in the average */

int eng_spec_propose(pd_engine *e)
{
    const pd_engine_params *p = &e->p;
    if (p->spec_disable_batch && pd_sched_num_running(e->sched) >= p->spec_disable_batch)
        return PD_OK;
    size_t queue = eng_queue_free(e), K = p->spec_num_tokens;
    /* one event per item is the step's own; drafts may use what is left */
    size_t events_left = queue > e->so.n_items ? queue - e->so.n_items : 0;
    for (size_t i = 0; i < e->so.n_items && e->so.n_tokens < p->spec_max_step_rows; i++) {
        const pd_sched_item *it = &e->so.items[i];
        eng_seq *s = pd_seq_user(it->seq);
        eng_req *r = s->req;
        size_t n_out = pd_seq_num_output(it->seq);
        if (it->n_new != 1 || !it->sample || it->lp_n || s->gm || r->beam || r->abort_requested ||
            n_out == 0) /* a beam search ranks its beams' own rows only */
            continue;
        if (s->spec_rest > 0) {
            s->spec_rest--;
            continue;
        }
        size_t k = K, rows = p->spec_max_step_rows - e->so.n_tokens;
        if (k > rows) k = rows;
        if (k > events_left) k = events_left;
        if (r->sp.max_tokens > 0) { /* the step emits the accepted drafts and one token more */
            size_t left = (size_t)r->sp.max_tokens > n_out ? (size_t)r->sp.max_tokens - n_out : 0;
            if (k + 1 > left) k = left > 0 ? left - 1 : 0;
        }
        size_t n_tok;
        const int32_t *tok = pd_seq_tokens(it->seq, &n_tok);
        int32_t *d = e->spec_drafts + i * K;
        k = pd_spec_ngram_propose(tok, n_tok, p->spec_ngram_min, p->spec_ngram_max, k, d);
        if (k == 0) continue;
        int rc = pd_sched_add_drafts(e->sched, &e->so, i, d, k);
        if (rc == PD_EBUSY) break; /* no blocks or rows: none for the younger ones either */
        PD_CHECK(rc);
        events_left -= k;
    }
    return PD_OK;
}

int eng_spec_process(pd_engine *e, size_t i, const float *logits)
{
    const pd_sched_item *it = &e->so.items[i];
    eng_seq *s = pd_seq_user(it->seq);
    if (s->req->abort_requested) return PD_OK; /* its abort is applied at the next boundary */
    const int32_t *d = e->spec_drafts + i * e->p.spec_num_tokens;
    size_t accepted = 0;
    for (size_t row = 0;; row++) {
        PD_CHECK(eng_sample_emit(e, s, logits + row * e->vocab));
        if (s->ended || row == it->n_draft) break;
        size_t n;
        const int32_t *tok = pd_seq_tokens(it->seq, &n);
        if (tok[n - 1] != d[row]) break;
        pd_sched_accept_draft(e->sched, it->seq); /* the row computed with it holds its K/V */
        e->stats.spec_accepted_per_pos[accepted++]++;
    }
    pd_sched_drafts_done(e->sched, it->seq);
    float rate = (float)accepted / (float)it->n_draft;
    s->spec_rate = SPEC_DECAY * rate + (1.0f - SPEC_DECAY) * s->spec_rate;
    if (s->spec_rate < SPEC_MIN_RATE) {
        s->spec_rest = SPEC_REST;
        s->spec_rate = SPEC_MIN_RATE; /* the next try starts from the threshold */
    }
    e->stats.spec_drafts++;
    e->stats.spec_draft_tokens += it->n_draft;
    e->stats.spec_accepted_tokens += accepted;
    return PD_OK;
}
