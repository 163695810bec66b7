/* Batch scheduler (sched.h): FCFS continuous batching with chunked prefill and preemption by
 * recompute, in the style of vLLM v1's scheduler.
 *
 * Both queues are intrusive doubly linked lists kept sorted by arrival key (arrival number, then
 * fork index), so "oldest first" is the list order, the preemption victim (the youngest running
 * sequence) is the tail, and a preempted sequence re-enters the waiting queue at its arrival
 * position, ahead of everything that arrived after it. Running sequences are served front to
 * back and victims are taken from the back, so a victim is never one already scheduled in the
 * step being built: either a later sequence or the current one itself.
 */
#include "engine/sched.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/status.h"

typedef struct list_node {
    pd_sched_seq *prev, *next;
} list_node;

typedef struct {
    pd_sched_seq *head, *tail;
    size_t n;
} seq_list;

struct pd_sched_seq {
    pd_sched *s;
    void *user;
    int32_t *tokens; /* (max_model_len) prompt then generated ids */
    size_t n_tokens;
    size_t n_prompt;
    size_t n_computed; /* tokens whose K/V are in the cache */
    pd_kvtable *table;
    pd_seq_state state;
    uint64_t arrival;        /* order key: arrival number ... */
    uint32_t sub;            /* ... then fork index (0 for the parent) */
    uint32_t n_forked;       /* children forked from this sequence so far */
    size_t pending_children; /* forks still to come (reserved against max_num_seqs) */
    uint32_t n_preempt;
    pd_kv_block_key chain; /* prefix cache: the key of block n_chain - 1 ... */
    size_t n_chain;        /* ... and the blocks [0, n_chain) registered or taken from it */
    size_t n_cached;       /* tokens taken from the prefix cache at the first admission */
    bool admitted;         /* admitted once (n_cached is set) */
    size_t lp_next;        /* prompt logits wanted for positions [lp_next, n_prompt - 1);
                              SIZE_MAX: none */
    list_node q;           /* link in waiting or running */
    list_node all;         /* link in the list of every sequence */
};

struct pd_sched {
    pd_sched_params p;
    pd_kvpool *pool;
    seq_list waiting, running;
    pd_sched_seq *all_head;
    size_t running_slots; /* running sequences + their pending children */
    uint64_t next_arrival;
    uint64_t n_preemptions;
    uint64_t cache_queries, cache_hits; /* tokens (pd_sched_prefix_cache_stats) */
    pd_sched_item *items;               /* (max_num_seqs) */
    size_t n_items;
    pd_kv_block_copy *copies; /* (max_num_seqs) at most one copy per scheduled sequence */
    size_t n_copies;
};

pd_sched_params pd_sched_default_params(void)
{
    return (pd_sched_params){
        .max_num_seqs = 256,
        .max_num_batched_tokens = 2048,
        .max_model_len = 2048,
        .max_prefill_chunk = 0,
    };
}

int pd_sched_check_params(const pd_sched_params *p)
{
    if (p->max_model_len == 0) return pd_error(PD_EINVAL, "max_model_len must be at least 1");
    if (p->max_num_seqs == 0) return pd_error(PD_EINVAL, "max_num_seqs must be at least 1");
    if (!p->chunked_prefill && p->max_num_batched_tokens < p->max_model_len)
        return pd_error(PD_EINVAL,
                        "max_num_batched_tokens (%zu) is smaller than max_model_len (%zu). This "
                        "effectively limits the maximum sequence length to max_num_batched_tokens "
                        "and makes vLLM reject longer sequences. Please increase "
                        "max_num_batched_tokens or decrease max_model_len.",
                        p->max_num_batched_tokens, p->max_model_len);
    if (p->max_num_batched_tokens < p->max_num_seqs)
        return pd_error(PD_EINVAL,
                        "max_num_batched_tokens (%zu) must be greater than or equal to "
                        "max_num_seqs (%zu).",
                        p->max_num_batched_tokens, p->max_num_seqs);
    return PD_OK;
}

/* ---- sorted intrusive lists ----------------------------------------------------------------- */

static bool key_before(const pd_sched_seq *a, const pd_sched_seq *b)
{
    return a->arrival < b->arrival || (a->arrival == b->arrival && a->sub < b->sub);
}

/* Inserts seq keeping arrival order; scans from the tail (new arrivals go last: O(1)). */
static void list_insert_sorted(seq_list *l, pd_sched_seq *seq)
{
    pd_sched_seq *after = l->tail;
    while (after && key_before(seq, after)) after = after->q.prev;
    seq->q.prev = after;
    seq->q.next = after ? after->q.next : l->head;
    if (seq->q.next)
        seq->q.next->q.prev = seq;
    else
        l->tail = seq;
    if (after)
        after->q.next = seq;
    else
        l->head = seq;
    l->n++;
}

static void list_remove(seq_list *l, pd_sched_seq *seq)
{
    if (seq->q.prev)
        seq->q.prev->q.next = seq->q.next;
    else
        l->head = seq->q.next;
    if (seq->q.next)
        seq->q.next->q.prev = seq->q.prev;
    else
        l->tail = seq->q.prev;
    seq->q.prev = seq->q.next = NULL;
    l->n--;
}

/* ---- lifetime ------------------------------------------------------------------------------- */

int pd_sched_create(const pd_sched_params *p, pd_kvpool *pool, pd_sched **out)
{
    *out = NULL;
    PD_CHECK(pd_sched_check_params(p));
    if (p->prefix_caching && !pd_kvpool_prefix_cache_enabled(pool))
        return pd_error(PD_EINVAL, "scheduler: prefix caching needs the pool's prefix cache");
    pd_sched *s = calloc(1, sizeof *s);
    if (!s) return pd_error(PD_ENOMEM, "scheduler: out of memory");
    s->p = *p;
    s->pool = pool;
    s->items = calloc(p->max_num_seqs, sizeof *s->items);
    s->copies = calloc(p->max_num_seqs, sizeof *s->copies);
    if (!s->items || !s->copies) {
        pd_sched_free(s);
        return pd_error(PD_ENOMEM, "scheduler: out of memory for %zu sequences", p->max_num_seqs);
    }
    *out = s;
    return PD_OK;
}

void pd_sched_free(pd_sched *s)
{
    if (!s) return;
    while (s->all_head) pd_sched_seq_free(s, s->all_head);
    free(s->items);
    free(s->copies);
    free(s);
}

static int seq_alloc(pd_sched *s, void *user, pd_sched_seq **out)
{
    pd_sched_seq *seq = calloc(1, sizeof *seq);
    if (!seq) return pd_error(PD_ENOMEM, "scheduler: out of memory for a sequence");
    seq->tokens = malloc(s->p.max_model_len * sizeof *seq->tokens);
    int rc = seq->tokens ? pd_kvtable_create(s->pool, s->p.max_model_len, &seq->table)
                         : pd_error(PD_ENOMEM, "scheduler: out of memory for a sequence");
    if (rc < 0) {
        free(seq->tokens);
        free(seq);
        return rc;
    }
    seq->s = s;
    seq->user = user;
    seq->state = PD_SEQ_NEW;
    seq->lp_next = SIZE_MAX;
    seq->all.next = s->all_head;
    if (s->all_head) s->all_head->all.prev = seq;
    s->all_head = seq;
    *out = seq;
    return PD_OK;
}

int pd_sched_seq_create(pd_sched *s, const int32_t *prompt, size_t n_prompt, void *user,
                        pd_sched_seq **out)
{
    *out = NULL;
    if (n_prompt == 0) return pd_error(PD_EINVAL, "The decoder prompt cannot be empty");
    if (n_prompt >= s->p.max_model_len)
        return pd_error(PD_EINVAL,
                        "This model's maximum context length is %zu tokens. However, your request "
                        "has %zu input tokens. Please reduce the length of the input messages.",
                        s->p.max_model_len, n_prompt);
    pd_sched_seq *seq;
    PD_CHECK(seq_alloc(s, user, &seq));
    memcpy(seq->tokens, prompt, n_prompt * sizeof *prompt);
    seq->n_tokens = seq->n_prompt = n_prompt;
    seq->arrival = s->next_arrival++;
    *out = seq;
    return PD_OK;
}

int pd_sched_seq_want_prompt_logits(pd_sched *s, pd_sched_seq *seq)
{
    if (s->p.max_prompt_logit_rows == 0)
        return pd_error(PD_EINVAL, "scheduler: prompt logprobs need max_prompt_logit_rows > 0");
    if (seq->state != PD_SEQ_NEW)
        return pd_error(PD_EINVAL, "scheduler: prompt logits of a queued sequence");
    seq->lp_next = 0;
    return PD_OK;
}

/* The first position from start on whose prompt logits seq still wants. */
static size_t lp_from(const pd_sched_seq *seq, size_t start)
{
    return seq->lp_next > start ? seq->lp_next : start;
}

static bool wants_lp(const pd_sched_seq *seq)
{
    return seq->lp_next != SIZE_MAX && seq->lp_next + 1 < seq->n_prompt;
}

int pd_sched_add(pd_sched *s, pd_sched_seq *seq, size_t n_children)
{
    if (seq->state != PD_SEQ_NEW) return pd_error(PD_EINVAL, "scheduler: sequence already queued");
    if (n_children + 1 > s->p.max_num_seqs)
        return pd_error(PD_EINVAL, "n must be at most %zu, got %zu.", s->p.max_num_seqs,
                        n_children + 1);
    seq->pending_children = n_children;
    seq->state = PD_SEQ_WAITING;
    list_insert_sorted(&s->waiting, seq);
    return PD_OK;
}

static void take_cached(pd_sched *s, pd_sched_seq *seq);

int pd_sched_reserve(pd_sched *s, pd_sched_seq *seq, size_t n_tokens, bool use_cache,
                     size_t *n_cached)
{
    if (seq->state != PD_SEQ_NEW)
        return pd_error(PD_EINVAL, "scheduler: reserve of a queued sequence");
    if (n_tokens == 0 || n_tokens >= s->p.max_model_len || n_tokens != seq->n_tokens)
        return pd_error(PD_EINVAL, "reserve: %zu tokens (max_model_len %zu, prompt %zu)", n_tokens,
                        s->p.max_model_len, seq->n_tokens);
    if (use_cache) take_cached(s, seq); /* n_computed = the cached tokens, for now */
    size_t cached = seq->n_computed;
    seq->n_computed = 0; /* a HELD sequence has computed nothing until its KV is admitted */
    size_t need = pd_kvtable_blocks_needed(seq->table, n_tokens);
    if (need > pd_kvpool_num_free(s->pool)) {
        pd_kvtable_clear(seq->table); /* cached blocks go back, still cached */
        seq->n_chain = 0;
        return pd_error(PD_EBUSY, "KV cache full: %zu blocks needed for %zu tokens, %zu free", need,
                        n_tokens, pd_kvpool_num_free(s->pool));
    }
    PD_CHECK(pd_kvtable_grow(seq->table, n_tokens, NULL, NULL));
    if (use_cache && s->p.prefix_caching) {
        s->cache_queries += n_tokens;
        s->cache_hits += cached;
    }
    seq->state = PD_SEQ_HELD;
    if (n_cached) *n_cached = cached;
    return PD_OK;
}

int pd_sched_seq_set_prompt(const pd_sched *s, pd_sched_seq *seq, const int32_t *prompt,
                            size_t n_prompt)
{
    if ((seq->state != PD_SEQ_NEW && seq->state != PD_SEQ_HELD) || seq->n_tokens != seq->n_prompt)
        return pd_error(PD_EINVAL, "scheduler: prompt of a sequence that already ran");
    if (n_prompt != seq->n_prompt)
        return pd_error(PD_EINVAL, "prompt has %zu tokens but %zu were reserved", n_prompt,
                        seq->n_prompt);
    size_t cached = seq->n_chain * pd_kvpool_block_size(s->pool);
    if (cached && memcmp(seq->tokens, prompt, cached * sizeof *prompt) != 0)
        return pd_error(PD_EINVAL,
                        "prompt differs from the reserved one in its first %zu tokens, whose "
                        "cached KV the reservation holds",
                        cached);
    memcpy(seq->tokens, prompt, n_prompt * sizeof *prompt);
    return PD_OK;
}

int pd_sched_admit_computed(pd_sched *s, pd_sched_seq *seq, size_t n_computed, size_t n_children)
{
    if (seq->state != PD_SEQ_HELD)
        return pd_error(PD_EINVAL, "scheduler: admit of a sequence that holds no reservation");
    if (n_computed > pd_kvtable_num_tokens(seq->table) || n_computed > seq->n_tokens)
        return pd_error(PD_EINVAL, "scheduler: %zu computed tokens but %zu reserved, %zu known",
                        n_computed, pd_kvtable_num_tokens(seq->table), seq->n_tokens);
    if (n_children + 1 > s->p.max_num_seqs)
        return pd_error(PD_EINVAL, "n must be at most %zu, got %zu.", s->p.max_num_seqs,
                        n_children + 1);
    seq->n_computed = n_computed;
    seq->pending_children = n_children;
    seq->state = PD_SEQ_WAITING;
    list_insert_sorted(&s->waiting, seq);
    return PD_OK;
}

int pd_sched_append(pd_sched *s, pd_sched_seq *seq, int32_t token)
{
    if (seq->n_tokens >= s->p.max_model_len)
        return pd_error(PD_ERANGE, "sequence at max_model_len (%zu)", s->p.max_model_len);
    seq->tokens[seq->n_tokens++] = token;
    return PD_OK;
}

int pd_sched_fork(pd_sched *s, pd_sched_seq *parent, void *user, pd_sched_seq **out)
{
    *out = NULL;
    if (parent->state != PD_SEQ_RUNNING || parent->n_computed != parent->n_tokens)
        return pd_error(PD_EINVAL, "scheduler: fork needs a running sequence with all tokens "
                                   "computed");
    if (parent->pending_children == 0)
        return pd_error(PD_EINVAL, "scheduler: fork beyond the children reserved at add");
    pd_sched_seq *c;
    PD_CHECK(seq_alloc(s, user, &c));
    int rc = pd_kvtable_fork(c->table, parent->table);
    if (rc < 0) {
        pd_sched_seq_free(s, c);
        return rc;
    }
    memcpy(c->tokens, parent->tokens, parent->n_tokens * sizeof *c->tokens);
    c->n_tokens = parent->n_tokens;
    c->n_prompt = parent->n_prompt;
    c->n_computed = parent->n_computed;
    c->chain = parent->chain;
    c->n_chain = parent->n_chain;
    c->arrival = parent->arrival;
    c->sub = parent->sub + ++parent->n_forked;
    c->state = PD_SEQ_RUNNING;
    parent->pending_children--; /* the slot it reserved now belongs to c */
    list_insert_sorted(&s->running, c);
    *out = c;
    return PD_OK;
}

int pd_sched_pass_children(pd_sched *s, pd_sched_seq *from, pd_sched_seq *to, size_t n)
{
    (void)s;
    if (from->state != PD_SEQ_RUNNING || to->state != PD_SEQ_RUNNING || from->pending_children < n)
        return pd_error(PD_EINVAL, "scheduler: %zu reserved children cannot pass (%zu held)", n,
                        from->pending_children);
    from->pending_children -= n;
    to->pending_children += n;
    return PD_OK;
}

int pd_sched_finish_into(pd_sched *s, pd_sched_seq *seq, pd_sched_seq *heir)
{
    if (seq->state != PD_SEQ_RUNNING || heir->state != PD_SEQ_RUNNING || seq == heir)
        return pd_error(PD_EINVAL, "scheduler: finish_into needs two running sequences");
    heir->pending_children += 1 + seq->pending_children;
    s->running_slots += 1 + seq->pending_children; /* pd_sched_finish takes them off */
    pd_sched_finish(s, seq);
    return PD_OK;
}

int pd_sched_hold(pd_sched *s, pd_sched_seq *seq)
{
    if (seq->state != PD_SEQ_RUNNING)
        return pd_error(PD_EINVAL, "scheduler: hold of a sequence that is not running");
    list_remove(&s->running, seq);
    s->running_slots -= 1 + seq->pending_children;
    seq->pending_children = 0;
    seq->state = PD_SEQ_HELD;
    return PD_OK;
}

void pd_sched_finish(pd_sched *s, pd_sched_seq *seq)
{
    switch (seq->state) {
    case PD_SEQ_WAITING: list_remove(&s->waiting, seq); break;
    case PD_SEQ_RUNNING:
        list_remove(&s->running, seq);
        s->running_slots -= 1 + seq->pending_children;
        break;
    case PD_SEQ_FINISHED: return;
    default: break;
    }
    seq->pending_children = 0;
    pd_kvtable_clear(seq->table);
    seq->state = PD_SEQ_FINISHED;
}

void pd_sched_seq_free(pd_sched *s, pd_sched_seq *seq)
{
    if (!seq) return;
    pd_sched_finish(s, seq);
    if (seq->all.prev)
        seq->all.prev->all.next = seq->all.next;
    else
        s->all_head = seq->all.next;
    if (seq->all.next) seq->all.next->all.prev = seq->all.prev;
    pd_kvtable_free(seq->table);
    free(seq->tokens);
    free(seq);
}

/* ---- one step ------------------------------------------------------------------------------- */

static void preempt(pd_sched *s, pd_sched_seq *seq)
{
    list_remove(&s->running, seq);
    s->running_slots -= 1 + seq->pending_children;
    pd_kvtable_clear(seq->table);
    seq->n_computed = 0;
    seq->state = PD_SEQ_WAITING;
    seq->n_preempt++;
    s->n_preemptions++;
    list_insert_sorted(&s->waiting, seq);
}

/* Nothing runs and the oldest waiting sequence does not fit: younger waiting sequences that
 * hold KV (imported from a prefill instance, or reserved for one) give it up, youngest first,
 * until need blocks are free; they recompute it when their turn comes. Without this, waiting
 * sequences holding KV could fill the pool so that none of them can take its next block and
 * nothing ever runs again. "Nothing runs" counts the running sequences with nothing to compute:
 * the beams of a search waiting for a preempted sibling (docs/beam_search.md), which would
 * otherwise wait for good. Returns how many gave their KV up. */
static size_t evict_waiting(pd_sched *s, const pd_sched_seq *head, size_t need)
{
    size_t n = 0;
    for (pd_sched_seq *v = s->waiting.tail; v && v != head && need > pd_kvpool_num_free(s->pool);
         v = v->q.prev) {
        if (pd_kvtable_num_blocks(v->table) == 0) continue;
        pd_kvtable_clear(v->table);
        v->n_computed = 0;
        v->n_preempt++;
        s->n_preemptions++;
        n++;
    }
    return n;
}

/* Prefix caching: the key of seq's block n_chain (chained onto the key of the block before). */
static pd_kv_block_key next_key(const pd_sched *s, const pd_sched_seq *seq)
{
    return pd_kvpool_block_key(s->pool, seq->n_chain ? &seq->chain : NULL,
                               seq->tokens + seq->n_chain * pd_kvpool_block_size(s->pool));
}

/* Prefix caching: a waiting sequence without KV takes the cached blocks of its longest cached
 * prefix of full blocks, short of its last token, which is always computed (its logits give the
 * next token). */
static void take_cached(pd_sched *s, pd_sched_seq *seq)
{
    if (!s->p.prefix_caching || seq->n_computed || pd_kvtable_num_blocks(seq->table) ||
        wants_lp(seq))
        return;
    size_t bs = pd_kvpool_block_size(s->pool), full = (seq->n_tokens - 1) / bs;
    for (seq->n_chain = 0; seq->n_chain < full; seq->n_chain++) {
        pd_kv_block_key k = next_key(s, seq);
        if (!pd_kvtable_append_cached(seq->table, &k)) break;
        seq->chain = k;
    }
    seq->n_computed = seq->n_chain * bs;
}

/* Prefix caching: registers seq's full blocks whose K/V are now computed. */
static void cache_computed(pd_sched *s, pd_sched_seq *seq)
{
    if (!s->p.prefix_caching) return;
    size_t full = seq->n_computed / pd_kvpool_block_size(s->pool);
    for (; seq->n_chain < full; seq->n_chain++) {
        pd_kv_block_key k = next_key(s, seq);
        pd_kvpool_cache_block(s->pool, pd_kvtable_ids(seq->table)[seq->n_chain], &k);
        seq->chain = k;
    }
}

/* Rows seq may take now: its uncomputed tokens, capped by the budget, while prefilling by
 * max_prefill_chunk, and when it wants prompt logits by the lp_budget rows left for them. */
static size_t rows_for(const pd_sched *s, const pd_sched_seq *seq, size_t budget, size_t lp_budget)
{
    size_t n = seq->n_tokens - seq->n_computed;
    if (n > 1 && s->p.max_prefill_chunk && n > s->p.max_prefill_chunk) n = s->p.max_prefill_chunk;
    if (wants_lp(seq) && seq->n_computed + 1 < seq->n_prompt) {
        size_t free_rows = lp_from(seq, seq->n_computed) - seq->n_computed;
        if (n > free_rows + lp_budget) n = free_rows + lp_budget;
    }
    return n < budget ? n : budget;
}

static int add_item(pd_sched *s, pd_sched_seq *seq, size_t n_new)
{
    size_t n_cow = 0;
    PD_CHECK(pd_kvtable_grow(seq->table, seq->n_computed + n_new, &s->copies[s->n_copies], &n_cow));
    s->n_copies += n_cow;
    pd_sched_item *it = &s->items[s->n_items++];
    *it = (pd_sched_item){
        .seq = seq,
        .start = seq->n_computed,
        .n_new = n_new,
        .sample = seq->n_computed + n_new == seq->n_tokens,
    };
    if (wants_lp(seq)) {
        size_t a = lp_from(seq, it->start), b = it->start + n_new;
        if (b > seq->n_prompt - 1) b = seq->n_prompt - 1;
        if (a < b) it->lp_start = a, it->lp_n = b - a;
    }
    return PD_OK;
}

int pd_sched_schedule(pd_sched *s, pd_sched_out *out)
{
    s->n_items = 0;
    s->n_copies = 0;
    size_t budget = s->p.max_num_batched_tokens;
    size_t lp_budget = s->p.max_prompt_logit_rows;
    size_t n_preempted = 0;

    /* 1. Running sequences, oldest first; make room by preempting the youngest. */
    for (pd_sched_seq *seq = s->running.head; seq && budget > 0;) {
        size_t n_new = rows_for(s, seq, budget, lp_budget);
        if (n_new == 0) { /* nothing uncomputed (cannot happen between engine steps) */
            seq = seq->q.next;
            continue;
        }
        bool self_preempted = false;
        while (pd_kvtable_blocks_needed(seq->table, seq->n_computed + n_new) >
               pd_kvpool_num_free(s->pool)) {
            pd_sched_seq *victim = s->running.tail;
            preempt(s, victim);
            n_preempted++;
            if (victim == seq) {
                self_preempted = true;
                break;
            }
        }
        if (self_preempted) break; /* it was the tail: nothing after it is running */
        PD_CHECK(add_item(s, seq, n_new));
        budget -= n_new;
        lp_budget -= s->items[s->n_items - 1].lp_n;
        seq = seq->q.next; /* read after preempting: victims left from the tail */
    }

    /* 2. Admit waiting sequences in arrival order while they fit (not after a preemption). */
    while (n_preempted == 0 && budget > 0 && s->waiting.head) {
        pd_sched_seq *seq = s->waiting.head;
        if (s->running_slots + 1 + seq->pending_children > s->p.max_num_seqs) break;
        bool fresh = seq->n_computed == 0 && pd_kvtable_num_blocks(seq->table) == 0;
        if (fresh) take_cached(s, seq);
        size_t n_new = rows_for(s, seq, budget, lp_budget);
        size_t need = pd_kvtable_blocks_needed(seq->table, seq->n_computed + n_new);
        if (n_new > 0 && need > pd_kvpool_num_free(s->pool) && s->n_items == 0)
            n_preempted += evict_waiting(s, seq, need);
        if (n_new == 0 || need > pd_kvpool_num_free(s->pool)) {
            if (fresh) { /* not admitted: the cached blocks go back (still cached) */
                pd_kvtable_clear(seq->table);
                seq->n_computed = 0;
            }
            break;
        }
        if (fresh && s->p.prefix_caching) {
            s->cache_queries += seq->n_tokens;
            s->cache_hits += seq->n_computed;
        }
        if (!seq->admitted) seq->n_cached = fresh ? seq->n_computed : 0;
        seq->admitted = true;
        list_remove(&s->waiting, seq);
        seq->state = PD_SEQ_RUNNING;
        s->running_slots += 1 + seq->pending_children;
        list_insert_sorted(&s->running, seq);
        PD_CHECK(add_item(s, seq, n_new));
        budget -= n_new;
        lp_budget -= s->items[s->n_items - 1].lp_n;
    }

    out->n_items = s->n_items;
    out->items = s->items;
    out->n_tokens = s->p.max_num_batched_tokens - budget;
    out->n_copies = s->n_copies;
    out->copies = s->copies;
    out->n_preempted = n_preempted;
    return PD_OK;
}

void pd_sched_commit(pd_sched *s)
{
    for (size_t i = 0; i < s->n_items; i++) {
        pd_sched_item *it = &s->items[i];
        it->seq->n_computed += it->n_new - it->n_draft;
        it->seq->n_tokens -= it->n_draft; /* drafts come back one by one when accepted */
        if (it->lp_n) it->seq->lp_next = it->lp_start + it->lp_n;
        cache_computed(s, it->seq);
    }
    s->n_items = 0;
    s->n_copies = 0;
}

/* ---- speculative decoding -------------------------------------------------------------------- */

int pd_sched_add_drafts(pd_sched *s, pd_sched_out *out, size_t item, const int32_t *drafts,
                        size_t k)
{
    if (item >= s->n_items) return pd_error(PD_EINVAL, "scheduler: no item %zu", item);
    pd_sched_item *it = &s->items[item];
    pd_sched_seq *seq = it->seq;
    if (k == 0) return PD_OK;
    if (it->n_new != 1 || !it->sample || it->n_draft || it->lp_n)
        return pd_error(PD_EINVAL, "scheduler: drafts need a one-row decoding item");
    if (out->n_tokens + k > s->p.max_num_batched_tokens || seq->n_tokens + k >= s->p.max_model_len)
        return pd_error(PD_EBUSY, "scheduler: no room for %zu drafts", k);
    size_t n_cow = 0;
    if (pd_kvtable_blocks_needed(seq->table, seq->n_tokens + k) > pd_kvpool_num_free(s->pool))
        return pd_error(PD_EBUSY, "scheduler: no blocks for %zu drafts", k);
    /* the item's own row made the block of its position writable: no copy-on-write here */
    PD_CHECK(pd_kvtable_grow(seq->table, seq->n_tokens + k, NULL, &n_cow));
    memcpy(seq->tokens + seq->n_tokens, drafts, k * sizeof *drafts);
    seq->n_tokens += k;
    it->n_new += k;
    it->n_draft = k;
    out->n_tokens += k;
    return PD_OK;
}

void pd_sched_accept_draft(pd_sched *s, pd_sched_seq *seq)
{
    seq->n_computed++;
    cache_computed(s, seq);
}

void pd_sched_drafts_done(pd_sched *s, pd_sched_seq *seq)
{
    (void)s;
    if (seq->state == PD_SEQ_RUNNING) pd_kvtable_truncate(seq->table, seq->n_computed + 1);
}

/* ---- queries --------------------------------------------------------------------------------- */

size_t pd_sched_num_waiting(const pd_sched *s)
{
    return s->waiting.n;
}
size_t pd_sched_num_running(const pd_sched *s)
{
    return s->running.n;
}
size_t pd_sched_num_queued_tokens(const pd_sched *s)
{
    size_t n = 0;
    const seq_list *lists[2] = {&s->waiting, &s->running};
    for (int i = 0; i < 2; i++)
        for (const pd_sched_seq *q = lists[i]->head; q; q = q->q.next)
            if (q->n_computed < q->n_prompt) n += q->n_prompt - q->n_computed;
    return n;
}
uint64_t pd_sched_num_preemptions(const pd_sched *s)
{
    return s->n_preemptions;
}
void pd_sched_prefix_cache_stats(const pd_sched *s, uint64_t *queries, uint64_t *hits)
{
    *queries = s->cache_queries;
    *hits = s->cache_hits;
}
const pd_sched_params *pd_sched_get_params(const pd_sched *s)
{
    return &s->p;
}

pd_seq_state pd_seq_get_state(const pd_sched_seq *seq)
{
    return seq->state;
}
size_t pd_seq_num_reserved(const pd_sched_seq *seq)
{
    return seq->pending_children;
}
void *pd_seq_user(const pd_sched_seq *seq)
{
    return seq->user;
}

void pd_seq_set_user(pd_sched_seq *seq, void *user)
{
    seq->user = user;
}
const int32_t *pd_seq_tokens(const pd_sched_seq *seq, size_t *n)
{
    *n = seq->n_tokens;
    return seq->tokens;
}
size_t pd_seq_num_prompt(const pd_sched_seq *seq)
{
    return seq->n_prompt;
}
size_t pd_seq_num_output(const pd_sched_seq *seq)
{
    return seq->n_tokens - seq->n_prompt;
}
size_t pd_seq_num_computed(const pd_sched_seq *seq)
{
    return seq->n_computed;
}
size_t pd_seq_num_cached(const pd_sched_seq *seq)
{
    return seq->n_cached;
}
uint32_t pd_seq_num_preemptions(const pd_sched_seq *seq)
{
    return seq->n_preempt;
}
const pd_kvtable *pd_seq_table(const pd_sched_seq *seq)
{
    return seq->table;
}
