/* pd-scheduler: the admission queue (loop thread). A choice waits here, oldest first, when
 * every decode instance refused its KV reservation for lack of room, or when the prefill
 * instances have more work in flight than they finish in PREFILL_HORIZON_S (take_prefill);
 * a request that waited --queue-timeout gets 503.
 *
 * Design: only the head is retried, one Reserve at a time, when a chain ends (its KV is freed)
 * and every ADMIT_RETRY_MS; while anything waits, new requests queue behind it (srv_dispatch).
 * So requests get KV and prefill time in arrival order, and a full cluster sees one probe at a
 * time, not one per waiting request. A queued choice holds no prefill charge: the work a prefill
 * instance has in flight is what it was given, so a backlog waits here (bounded by
 * --queue-timeout, answered 503) rather than on the instance, where it would hold decode KV
 * reservations and run into --prefill-timeout.
 */
#include <stdio.h>

#include "server_internal.h"
#include "util/clock.h"

enum { ADMIT_RETRY_MS = 10 };
/* The most work a prefill instance is given ahead, in seconds of its measured rate (less when
 * --prefill-timeout is short: half of it). */
#define PREFILL_HORIZON_S 5.0

/* Conditional disaggregation: whether c's decode instance prefills its prompt itself, the
 * tokens it likely lacks in its prefix cache being at most --max-local-prefill-length (what the
 * pick of the decode instance charged it, less max_tokens). Not with prompt logprobs: the
 * scheduler takes them from the Prefill reply. Always for a beam search whose prompt leaves room
 * for one token only: the prefill's own token would end it there, and no KV would move. */
static bool prefill_locally(const pd_apiserver *s, const choice *c)
{
    const pd_api_prompt *pr = &c->r->req.prompts[c->prompt_idx];
    if (c->sampling.use_beam_search && (int64_t)pr->n_ids + 1 >= s->L) return true;
    return s->p.max_local_prefill_length > 0 && !c->sampling.has_prompt_logprobs &&
           c->d_tokens - pr->max_tokens <= s->p.max_local_prefill_length;
}

/* Picks c's prefill instance when one has room for its prompt (pd_reg_pick_room): the most work
 * in flight there, c's included, is what it finishes in PREFILL_HORIZON_S (or half of
 * --prefill-timeout) at its measured rate, or, before it has one, a context's worth (L tokens).
 * The instance, -1 when none is up, PD_REG_BUSY when none has room. */
static int take_prefill(pd_apiserver *s, choice *c)
{
    const pd_api_prompt *pr = &c->r->req.prompts[c->prompt_idx];
    pd_reg_room room = {.horizon_s = s->p.prefill_timeout_s / 2, .unmeasured_max = s->L};
    if (room.horizon_s > PREFILL_HORIZON_S) room.horizon_s = PREFILL_HORIZON_S;
    int64_t hit = 0;
    int k = pd_reg_pick_room(s->reg, RT_ROLE_PREFILL, pr->ids, pr->n_ids, (int64_t)pr->n_ids, &room,
                             &hit);
    if (k < 0) return k;
    pthread_mutex_lock(&c->r->mu);
    c->p_node = k;
    pthread_mutex_unlock(&c->r->mu);
    c->p_tokens = (int64_t)pr->n_ids - hit;
    return k;
}

static void admit_enqueue(pd_apiserver *s, choice *c, bool front)
{
    sreq *r = c->r;
    pd_reg_release(s->reg, c->p_node, c->p_tokens);
    c->p_tokens = 0;
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
        r->waiting = true;
    }
}

void srv_admit_unlink(pd_apiserver *s, choice *c)
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
        r->running = true;
        r->t_prefill = pd_now_ns(); /* admitted: the queue time ends here */
    }
}

/* Fails the requests that waited --queue-timeout in the admission queue. */
static void admit_expire(pd_apiserver *s)
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
            srv_request_fail(c->r, 503, msg); /* unlinks every queued choice of the request */
            again = true;
            break;
        }
    }
}

/* Retries the head of the admission queue on the decode instance picked as at first (the least
 * loaded, less what its prefix cache likely holds of the prompt). */
void srv_admit_pump(pd_apiserver *s)
{
    s->admit_kick = false;
    if (s->admit_busy || !s->admit_head) return;
    choice *c = s->admit_head;
    sreq *r = c->r;
    c->local = prefill_locally(s, c);
    int p_node = c->local ? 0 : take_prefill(s, c);
    if (p_node == PD_REG_BUSY) return; /* the timer tries again */
    srv_admit_unlink(s, c);
    if (p_node < 0) {
        srv_chain_end(c);
        srv_request_fail(r, 503, "No healthy prefill instance is available.");
        return;
    }
    int old = c->d_node;
    pd_reg_release(s->reg, old, c->d_tokens);
    c->d_node = srv_pick_for(s, c, RT_ROLE_DECODE, c->d_avoid, &c->d_tokens);
    if (c->d_node < 0 && c->d_avoid >= 0) /* the one it failed on is the only one up */
        c->d_node = srv_pick_for(s, c, RT_ROLE_DECODE, -1, &c->d_tokens);
    if (c->d_node < 0 ||
        (c->d_node != old &&
         pd_reg_decode_targets(s->reg, c->d_node, r->a, &c->targets, &c->n_targets) < 0)) {
        pd_reg_release(s->reg, c->p_node, c->p_tokens);
        c->p_tokens = 0;
        srv_chain_end(c);
        srv_request_fail(r, 503, "No healthy decode instance is available.");
        return;
    }
    c->retrying = true;
    s->admit_busy = true;
    srv_send_reserve(c);
}

static void on_admit_timer(uv_timer_t *t)
{
    pd_apiserver *s = t->data;
    admit_expire(s);
    srv_admit_pump(s);
    if (!s->admit_head && !s->admit_busy) {
        uv_timer_stop(t);
        s->admit_timer_on = false;
    }
}

void srv_admit_wait(pd_apiserver *s, choice *c, bool front)
{
    admit_enqueue(s, c, front);
    if (!s->admit_timer_on) {
        s->admit_timer_on = true;
        uv_timer_start(&s->admit_timer, on_admit_timer, ADMIT_RETRY_MS, ADMIT_RETRY_MS);
    }
}

void srv_admit_or_reserve(pd_apiserver *s, choice *c)
{
    c->local = prefill_locally(s, c);
    int k = s->admit_head || s->admit_busy ? PD_REG_BUSY : c->local ? 0 : take_prefill(s, c);
    if (k >= 0) {
        srv_send_reserve(c);
    } else if (k == PD_REG_BUSY) {
        srv_admit_wait(s, c, false);
    } else {
        srv_chain_end(c);
        srv_request_fail(c->r, 503, "No healthy prefill instance is available.");
    }
}
