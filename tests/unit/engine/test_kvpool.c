/* Unit tests of the KV block manager (kvpool.h) and the scheduler (sched.h), without a model:
 * a simulated engine loop drives the scheduler and checks budgets, FCFS order, chunking,
 * preemption and that every block comes back exactly once. */
#include "harness.h"

#include <stdlib.h>

#include "engine/kvpool.h"
#include "engine/sched.h"

/* ---- block manager ------------------------------------------------------------------------- */

TEST(kvpool_sizing_and_capacity_message)
{
    pd_kv_params p = {.n_layers = 2,
                      .n_blocks = 0,
                      .block_size = 16,
                      .n_kv_heads = 4,
                      .head_dim = 8,
                      .dtype = PD_DTYPE_F32};
    ASSERT_EQ_INT(pd_kv_block_bytes(&p), 2 * 2 * 16 * 4 * 8 * 4);
    ASSERT_EQ_INT(pd_kv_blocks_for_bytes(10 * pd_kv_block_bytes(&p) + 5, pd_kv_block_bytes(&p)),
                  10);
    ASSERT_OK(pd_kv_check_capacity(8, 16, 128));
    ASSERT_ERR(pd_kv_check_capacity(8, 16, 129), PD_EINVAL,
               "The model's max seq len (129) is larger than the maximum number of tokens that "
               "can be stored in KV cache (128).");
    ASSERT_ERR(pd_kv_check_capacity(0, 16, 1), PD_EINVAL, "No available memory for the cache");
    size_t bytes = 0;
    ASSERT_OK(pd_kv_mem_available(&bytes));
    ASSERT(bytes > 0);
}

TEST(kvpool_alloc_grow_free)
{
    pd_kvpool *p;
    ASSERT_ERR(pd_kvpool_create(0, 16, &p), PD_EINVAL, "n_blocks");
    ASSERT_OK(pd_kvpool_create(8, 4, &p));
    pd_kvtable *t;
    ASSERT_OK(pd_kvtable_create(p, 20, &t));
    ASSERT_EQ_INT(pd_kvtable_blocks_needed(t, 9), 3);
    ASSERT_OK(pd_kvtable_grow(t, 9, NULL, NULL));
    ASSERT_EQ_INT(pd_kvtable_num_blocks(t), 3);
    ASSERT_EQ_INT(pd_kvpool_num_free(p), 5);
    /* slot = block * block_size + offset */
    const int32_t *ids = pd_kvtable_ids(t);
    ASSERT_EQ_INT(pd_kvtable_slot(t, 0), ids[0] * 4);
    ASSERT_EQ_INT(pd_kvtable_slot(t, 6), ids[1] * 4 + 2);
    ASSERT_EQ_INT(pd_kvtable_slot(t, 9), -1);
    ASSERT_OK(pd_kvtable_grow(t, 12, NULL, NULL)); /* fits in block 3 */
    ASSERT_EQ_INT(pd_kvtable_num_blocks(t), 3);
    ASSERT_ERR(pd_kvtable_grow(t, 11, NULL, NULL), PD_EINVAL, "shrink");
    ASSERT_ERR(pd_kvtable_grow(t, 21, NULL, NULL), PD_ERANGE, "exceed");
    pd_kvtable *u;
    ASSERT_OK(pd_kvtable_create(p, 40, &u));
    ASSERT_ERR(pd_kvtable_grow(u, 24, NULL, NULL), PD_ENOMEM, "6 blocks needed, 5 free");
    ASSERT_EQ_INT(pd_kvtable_num_blocks(u), 0); /* nothing taken on failure */
    ASSERT_OK(pd_kvtable_grow(u, 20, NULL, NULL));
    ASSERT_EQ_INT(pd_kvpool_num_free(p), 0);
    ASSERT(!pd_kvpool_all_free(p));
    ASSERT_OK(pd_kvpool_verify(p));
    pd_kvtable_free(t);
    pd_kvtable_clear(u);
    pd_kvtable_clear(u); /* a second clear drops nothing */
    ASSERT(pd_kvpool_all_free(p));
    ASSERT_OK(pd_kvpool_verify(p));
    pd_kvtable_free(u);
    pd_kvpool_free(p);
}

TEST(kvpool_fork_shares_and_copies_on_write)
{
    pd_kvpool *p;
    ASSERT_OK(pd_kvpool_create(16, 4, &p));
    pd_kvtable *parent, *kids[3];
    ASSERT_OK(pd_kvtable_create(p, 32, &parent));
    ASSERT_OK(pd_kvtable_grow(parent, 10, NULL, NULL)); /* 3 blocks, last holds 2 tokens */
    for (int i = 0; i < 3; i++) {
        ASSERT_OK(pd_kvtable_create(p, 32, &kids[i]));
        ASSERT_OK(pd_kvtable_fork(kids[i], parent));
    }
    ASSERT_EQ_INT(pd_kvpool_num_free(p), 13); /* 4 sequences, 3 blocks in use */
    const int32_t *pid = pd_kvtable_ids(parent);
    ASSERT_EQ_INT(pd_kvpool_refcount(p, pid[0]), 4);
    ASSERT_EQ_INT(pd_kvtable_blocks_needed(kids[0], 11), 1); /* copy of the partial block */
    pd_kv_block_copy cow;
    size_t n_cow = 9;
    ASSERT_ERR(pd_kvtable_grow(kids[0], 11, NULL, NULL), PD_EINVAL, "copy-on-write");
    ASSERT_OK(pd_kvtable_grow(kids[0], 11, &cow, &n_cow));
    ASSERT_EQ_INT(n_cow, 1);
    ASSERT_EQ_INT(cow.src, pid[2]);
    ASSERT(cow.dst != pid[2]);
    ASSERT_EQ_INT(pd_kvtable_ids(kids[0])[2], cow.dst);
    ASSERT_EQ_INT(pd_kvtable_ids(kids[0])[0], pid[0]); /* full blocks stay shared */
    ASSERT_EQ_INT(pd_kvpool_refcount(p, pid[2]), 3);
    /* Growing a table whose partial block is no longer shared copies nothing. */
    for (int i = 1; i < 3; i++) {
        ASSERT_OK(pd_kvtable_grow(kids[i], 11, &cow, &n_cow));
        ASSERT_EQ_INT(n_cow, 1);
    }
    ASSERT_EQ_INT(pd_kvpool_refcount(p, pid[2]), 1);
    ASSERT_OK(pd_kvtable_grow(parent, 11, &cow, &n_cow));
    ASSERT_EQ_INT(n_cow, 0);
    ASSERT_EQ_INT(pd_kvpool_num_cow(p), 3);
    ASSERT_EQ_INT(pd_kvpool_num_free(p), 16 - 3 - 3);
    ASSERT_OK(pd_kvpool_verify(p));
    /* A fork at a block boundary needs no copy. */
    pd_kvtable *a, *b;
    ASSERT_OK(pd_kvtable_create(p, 32, &a));
    ASSERT_OK(pd_kvtable_create(p, 32, &b));
    ASSERT_OK(pd_kvtable_grow(a, 8, NULL, NULL));
    ASSERT_OK(pd_kvtable_fork(b, a));
    ASSERT_ERR(pd_kvtable_fork(b, a), PD_EINVAL, "not empty");
    ASSERT_EQ_INT(pd_kvtable_blocks_needed(b, 9), 1);
    ASSERT_OK(pd_kvtable_grow(b, 9, &cow, &n_cow));
    ASSERT_EQ_INT(n_cow, 0);
    pd_kvtable_free(a);
    pd_kvtable_free(b);
    pd_kvtable_free(parent);
    for (int i = 0; i < 3; i++) pd_kvtable_free(kids[i]);
    ASSERT(pd_kvpool_all_free(p));
    ASSERT_OK(pd_kvpool_verify(p));
    pd_kvpool_free(p);
}

/* ---- scheduler ---------------------------------------------------------------------------- */

/* Blocks registered by content are found by a later table while held and while free; freed
 * ones are handed out again after uncached free blocks, least recently freed first, and then
 * no longer found. */
TEST(kvpool_prefix_cache_hits_and_lru_eviction)
{
    pd_kvpool *p;
    ASSERT_OK(pd_kvpool_create(6, 4, &p));
    int32_t toks[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    pd_kvtable *a, *b, *c, *d;
    ASSERT_OK(pd_kvtable_create(p, 24, &a));
    ASSERT_OK(pd_kvtable_create(p, 24, &b));
    ASSERT_OK(pd_kvtable_create(p, 24, &c));
    ASSERT_OK(pd_kvtable_create(p, 24, &d));
    pd_kv_block_key k[3];
    for (int i = 0; i < 3; i++) k[i] = pd_kvpool_block_key(p, i ? &k[i - 1] : NULL, toks + 4 * i);
    /* off: nothing is registered or found */
    ASSERT_OK(pd_kvtable_grow(a, 12, NULL, NULL));
    pd_kvpool_cache_block(p, pd_kvtable_ids(a)[0], &k[0]);
    ASSERT(!pd_kvtable_append_cached(b, &k[0]));
    ASSERT_OK(pd_kvpool_enable_prefix_cache(p));
    ASSERT(pd_kvpool_prefix_cache_enabled(p));
    for (int i = 0; i < 3; i++) pd_kvpool_cache_block(p, pd_kvtable_ids(a)[i], &k[i]);
    ASSERT_EQ_INT(pd_kvpool_num_cached(p), 3);
    ASSERT_OK(pd_kvpool_verify(p));
    /* the same key chained differently, or other tokens, is another key */
    pd_kv_block_key other = pd_kvpool_block_key(p, &k[0], toks);
    ASSERT(!pd_kvtable_append_cached(b, &other));
    ASSERT(pd_kvtable_append_cached(b, &k[0]));
    ASSERT(pd_kvtable_append_cached(b, &k[1]));
    ASSERT_EQ_INT(pd_kvtable_num_tokens(b), 8);
    ASSERT_EQ_INT(pd_kvtable_ids(b)[1], pd_kvtable_ids(a)[1]);
    ASSERT_EQ_INT(pd_kvpool_refcount(p, pd_kvtable_ids(a)[1]), 2);
    /* a block of the same content computed again is not registered twice */
    ASSERT_OK(pd_kvtable_grow(c, 4, NULL, NULL));
    pd_kvpool_cache_block(p, pd_kvtable_ids(c)[0], &k[0]);
    ASSERT_EQ_INT(pd_kvpool_num_cached(p), 3);
    pd_kvtable_clear(c);
    int32_t a2 = pd_kvtable_ids(a)[2];
    pd_kvtable_clear(a); /* blocks 0 and 1 stay held by b; block 2 is free and cached */
    pd_kvtable_clear(b);
    ASSERT(pd_kvpool_all_free(p));
    ASSERT_EQ_INT(pd_kvpool_num_cached(p), 3);
    ASSERT_OK(pd_kvpool_verify(p));
    /* a free cached block is taken back from the free list */
    ASSERT(pd_kvtable_append_cached(d, &k[0]));
    ASSERT_EQ_INT(pd_kvpool_num_free(p), 5);
    pd_kvtable_clear(d);
    /* 3 uncached blocks go first, then the least recently freed cached one (a's block 2) */
    ASSERT_OK(pd_kvtable_grow(c, 16, NULL, NULL));
    ASSERT_EQ_INT(pd_kvtable_ids(c)[3], a2);
    ASSERT_EQ_INT(pd_kvpool_num_evictions(p), 1);
    ASSERT_EQ_INT(pd_kvpool_num_cached(p), 2);
    ASSERT_OK(pd_kvpool_verify(p));
    ASSERT(pd_kvtable_append_cached(d, &k[0]));
    ASSERT(pd_kvtable_append_cached(d, &k[1]));
    ASSERT(!pd_kvtable_append_cached(d, &k[2])); /* evicted */
    /* a table's blocks are freed last first: its later blocks are evicted before its first */
    pd_kvtable_clear(d);
    ASSERT_OK(pd_kvtable_grow(c, 20, NULL, NULL));
    ASSERT(pd_kvtable_append_cached(d, &k[0]));
    ASSERT(!pd_kvtable_append_cached(d, &k[1]));
    ASSERT_EQ_INT(pd_kvpool_num_evictions(p), 2);
    ASSERT_OK(pd_kvpool_verify(p));
    /* only into a table of full blocks */
    pd_kvtable_clear(d);
    ASSERT_OK(pd_kvtable_grow(d, 2, NULL, NULL));
    ASSERT(!pd_kvtable_append_cached(d, &k[0]));
    pd_kvtable_free(a);
    pd_kvtable_free(b);
    pd_kvtable_free(c);
    pd_kvtable_free(d);
    ASSERT(pd_kvpool_all_free(p));
    ASSERT_OK(pd_kvpool_verify(p));
    pd_kvpool_free(p);
}

TEST(sched_param_errors_use_vllm_wording)
{
    pd_sched_params p = pd_sched_default_params();
    ASSERT_EQ_INT(p.max_num_seqs, 256);
    ASSERT_OK(pd_sched_check_params(&p));
    p.max_num_batched_tokens = 512;
    ASSERT_ERR(pd_sched_check_params(&p), PD_EINVAL,
               "max_num_batched_tokens (512) is smaller than max_model_len (2048). This "
               "effectively limits the maximum sequence length to max_num_batched_tokens and "
               "makes vLLM reject longer sequences. Please increase max_num_batched_tokens or "
               "decrease max_model_len.");
    p = pd_sched_default_params();
    p.max_num_seqs = 4096;
    ASSERT_ERR(pd_sched_check_params(&p), PD_EINVAL,
               "max_num_batched_tokens (2048) must be greater than or equal to max_num_seqs "
               "(4096).");
    p = pd_sched_default_params();
    p.max_model_len = 64;
    pd_kvpool *pool;
    ASSERT_OK(pd_kvpool_create(8, 16, &pool));
    pd_sched *s;
    ASSERT_OK(pd_sched_create(&p, pool, &s));
    int32_t prompt[64] = {0};
    pd_sched_seq *q;
    ASSERT_ERR(pd_sched_seq_create(s, prompt, 64, NULL, &q), PD_EINVAL,
               "This model's maximum context length is 64 tokens. However, your request has 64 "
               "input tokens. Please reduce the length of the input messages.");
    ASSERT_ERR(pd_sched_seq_create(s, prompt, 0, NULL, &q), PD_EINVAL, "cannot be empty");
    pd_sched_free(s);
    pd_kvpool_free(pool);
}

/* A simulated engine: sequence i wants out_len[i] output tokens; the "model" emits token
 * 1000 * i + k as output k. Its K/V cache is a shadow array with one value per slot, what a
 * model would compute for (token, position): every step checks that a sequence's context is in
 * its blocks (after the step's copy-on-write orders) and writes its rows. Returns the step
 * count, or -1 on a failed check. */
typedef struct {
    size_t n;
    size_t *prompt_len;
    size_t *out_len;
    pd_sched_seq **seqs;
    size_t *first_step;   /* step in which each sequence first ran */
    size_t max_rows_seen; /* largest n_tokens of a step */
    size_t max_items_seen;
    size_t max_chunk_seen; /* largest n_new of a prefilling (n_new > 1) item */
    bool mixed_seen;       /* a step with both a decode row and a prefill chunk */
    size_t preempt_events;
    size_t shared;   /* sim_add_all: every prompt starts with the same `shared` tokens */
    int64_t *shadow; /* (pool blocks x block_size) the simulated K/V of each slot, -1 = none */
} sim;

static int64_t kv_of(int32_t token, size_t pos)
{
    return ((int64_t)token << 24) | (int64_t)pos;
}

static int sim_shadow(sim *m, const pd_kvpool *pool)
{
    size_t n = pd_kvpool_num_blocks(pool) * pd_kvpool_block_size(pool);
    if (!m->shadow && (m->shadow = malloc(n * sizeof *m->shadow)))
        for (size_t i = 0; i < n; i++) m->shadow[i] = -1;
    return m->shadow ? PD_OK : PD_ENOMEM;
}

/* Writes (write) or checks the simulated K/V of q's tokens [from, to); false on a mismatch. */
static bool sim_kv(sim *m, const pd_sched_seq *q, size_t from, size_t to, bool write)
{
    size_t n;
    const int32_t *t = pd_seq_tokens(q, &n);
    for (size_t pos = from; pos < to; pos++) {
        int64_t slot = pd_kvtable_slot(pd_seq_table(q), pos);
        if (slot < 0) return false;
        if (write)
            m->shadow[slot] = kv_of(t[pos], pos);
        else if (m->shadow[slot] != kv_of(t[pos], pos))
            return false;
    }
    return true;
}

static int sim_run(pd_sched *s, pd_kvpool *pool, sim *m, size_t max_steps)
{
    if (sim_shadow(m, pool) < 0) return -1;
    size_t bs = pd_kvpool_block_size(pool);
    for (size_t step = 0; step < max_steps; step++) {
        pd_sched_out o;
        if (pd_sched_schedule(s, &o) < 0) return -1;
        for (size_t i = 0; i < o.n_copies; i++)
            memcpy(m->shadow + (size_t)o.copies[i].dst * bs,
                   m->shadow + (size_t)o.copies[i].src * bs, bs * sizeof *m->shadow);
        if (o.n_items == 0) {
            if (pd_sched_num_running(s) == 0 && pd_sched_num_waiting(s) == 0) return (int)step;
            pdt_fail(__FILE__, __LINE__, "empty step with work left");
            return -1;
        }
        m->preempt_events += o.n_preempted;
        if (o.n_tokens > m->max_rows_seen) m->max_rows_seen = o.n_tokens;
        if (o.n_items > m->max_items_seen) m->max_items_seen = o.n_items;
        bool dec = false, pre = false;
        size_t rows = 0;
        for (size_t i = 0; i < o.n_items; i++) {
            const pd_sched_item *it = &o.items[i];
            size_t idx = (size_t)(uintptr_t)pd_seq_user(it->seq);
            if (m->first_step[idx] == (size_t)-1) m->first_step[idx] = step;
            if (it->n_new > 1 && it->n_new > m->max_chunk_seen) m->max_chunk_seen = it->n_new;
            if (it->n_new == 1 && pd_seq_num_output(it->seq) > 0)
                dec = true;
            else
                pre = true;
            if (it->start != pd_seq_num_computed(it->seq)) return -1;
            if (pd_kvtable_num_tokens(pd_seq_table(it->seq)) < it->start + it->n_new) return -1;
            if (!sim_kv(m, it->seq, 0, it->start, false)) {
                pdt_fail(__FILE__, __LINE__,
                         "step %zu: sequence %zu's context is not in its "
                         "blocks",
                         step, idx);
                return -1;
            }
            sim_kv(m, it->seq, it->start, it->start + it->n_new, true);
            rows += it->n_new;
        }
        if (dec && pre) m->mixed_seen = true;
        if (rows != o.n_tokens) return -1;
        pd_sched_commit(s);
        for (size_t i = 0; i < o.n_items; i++) {
            const pd_sched_item *it = &o.items[i];
            if (!it->sample) continue;
            pd_sched_seq *q = it->seq;
            size_t idx = (size_t)(uintptr_t)pd_seq_user(q);
            size_t k = pd_seq_num_output(q);
            if (pd_sched_append(s, q, (int32_t)(1000 * idx + k)) < 0) return -1;
            if (k + 1 == m->out_len[idx]) pd_sched_finish(s, q);
        }
        if (pd_kvpool_verify(pool) < 0) return -1;
    }
    pdt_fail(__FILE__, __LINE__, "did not finish in %zu steps", max_steps);
    return -1;
}

static void sim_init(sim *m, size_t n)
{
    memset(m, 0, sizeof *m);
    m->n = n;
    m->prompt_len = calloc(n, sizeof(size_t));
    m->out_len = calloc(n, sizeof(size_t));
    m->seqs = calloc(n, sizeof(pd_sched_seq *));
    m->first_step = malloc(n * sizeof(size_t));
    for (size_t i = 0; i < n; i++) m->first_step[i] = (size_t)-1;
}

static void sim_free(sim *m)
{
    free(m->prompt_len);
    free(m->out_len);
    free(m->seqs);
    free(m->first_step);
    free(m->shadow);
}

/* Checks each sequence's tokens: prompt, then 1000 * i + k. */
static bool sim_tokens_ok(const sim *m)
{
    for (size_t i = 0; i < m->n; i++) {
        size_t n;
        const int32_t *t = pd_seq_tokens(m->seqs[i], &n);
        if (n != m->prompt_len[i] + m->out_len[i]) return false;
        for (size_t k = 0; k < m->out_len[i]; k++)
            if (t[m->prompt_len[i] + k] != (int32_t)(1000 * i + k)) return false;
    }
    return true;
}

static int sim_add_all(pd_sched *s, sim *m)
{
    int32_t prompt[256];
    for (size_t i = 0; i < m->n; i++) {
        for (size_t k = 0; k < m->prompt_len[i]; k++)
            prompt[k] = (int32_t)(k < m->shared ? 5000 + k : i + k);
        PD_CHECK(
            pd_sched_seq_create(s, prompt, m->prompt_len[i], (void *)(uintptr_t)i, &m->seqs[i]));
        PD_CHECK(pd_sched_add(s, m->seqs[i], 0));
    }
    return PD_OK;
}

TEST(sched_budgets_chunking_and_mixing)
{
    pd_kvpool *pool;
    ASSERT_OK(pd_kvpool_create(256, 4, &pool));
    pd_sched_params p = {.max_num_seqs = 5,
                         .max_num_batched_tokens = 64,
                         .max_model_len = 64,
                         .max_prefill_chunk = 7};
    pd_sched *s;
    ASSERT_OK(pd_sched_create(&p, pool, &s));
    sim m;
    sim_init(&m, 12);
    for (size_t i = 0; i < m.n; i++) {
        m.prompt_len[i] = 3 + (i * 11) % 40;
        m.out_len[i] = 2 + (i * 7) % 13;
    }
    ASSERT_OK(sim_add_all(s, &m));
    int steps = sim_run(s, pool, &m, 1000);
    ASSERT(steps > 0);
    ASSERT(sim_tokens_ok(&m));
    ASSERT(m.max_rows_seen <= 64);
    ASSERT(m.max_items_seen <= 5);
    ASSERT_EQ_INT(m.max_chunk_seen, 7); /* long prompts were chunked at 7 rows */
    ASSERT(m.mixed_seen);
    ASSERT_EQ_INT(pd_sched_num_preemptions(s), 0);
    /* FCFS: sequences start in arrival order. */
    for (size_t i = 1; i < m.n; i++) ASSERT(m.first_step[i] >= m.first_step[i - 1]);
    ASSERT(pd_kvpool_all_free(pool));
    pd_sched_free(s);
    sim_free(&m);
    pd_kvpool_free(pool);
}

TEST(sched_small_pool_preempts_youngest_and_finishes)
{
    /* 12 blocks of 4 tokens = 48 slots for 6 sequences of up to 30 tokens. */
    pd_kvpool *pool;
    ASSERT_OK(pd_kvpool_create(12, 4, &pool));
    pd_sched_params p = {.max_num_seqs = 8,
                         .max_num_batched_tokens = 48,
                         .max_model_len = 48,
                         .max_prefill_chunk = 0};
    pd_sched *s;
    ASSERT_OK(pd_sched_create(&p, pool, &s));
    sim m;
    sim_init(&m, 6);
    for (size_t i = 0; i < m.n; i++) {
        m.prompt_len[i] = 5 + i;
        m.out_len[i] = 20;
    }
    ASSERT_OK(sim_add_all(s, &m));
    int steps = sim_run(s, pool, &m, 2000);
    ASSERT(steps > 0);
    ASSERT(pd_sched_num_preemptions(s) > 0);
    ASSERT_EQ_INT(m.preempt_events, pd_sched_num_preemptions(s));
    /* The oldest sequence is never the victim while younger ones run. */
    ASSERT_EQ_INT(pd_seq_num_preemptions(m.seqs[0]), 0);
    uint32_t young = 0;
    for (size_t i = 3; i < m.n; i++) young += pd_seq_num_preemptions(m.seqs[i]);
    ASSERT(young > 0);
    ASSERT(sim_tokens_ok(&m));
    ASSERT(pd_kvpool_all_free(pool));
    ASSERT_OK(pd_kvpool_verify(pool));
    pd_sched_free(s);
    sim_free(&m);
    pd_kvpool_free(pool);
}

TEST(sched_abort_anywhere_frees_every_block_once)
{
    pd_kvpool *pool;
    ASSERT_OK(pd_kvpool_create(64, 4, &pool));
    pd_sched_params p = {.max_num_seqs = 4,
                         .max_num_batched_tokens = 32,
                         .max_model_len = 32,
                         .max_prefill_chunk = 3};
    pd_sched *s;
    ASSERT_OK(pd_sched_create(&p, pool, &s));
    int32_t prompt[20];
    for (int i = 0; i < 20; i++) prompt[i] = i;
    pd_sched_seq *q[8];
    for (int i = 0; i < 8; i++) {
        ASSERT_OK(pd_sched_seq_create(s, prompt, 10 + i, NULL, &q[i]));
        ASSERT_OK(pd_sched_add(s, q[i], 0));
    }
    pd_sched_out o;
    ASSERT_OK(pd_sched_schedule(s, &o));
    ASSERT_EQ_INT(o.n_items, 4);   /* max_num_seqs */
    ASSERT_EQ_INT(o.n_tokens, 12); /* chunks of 3 */
    pd_sched_commit(s);
    pd_sched_finish(s, q[1]); /* running, mid-prefill */
    pd_sched_finish(s, q[6]); /* waiting */
    pd_sched_finish(s, q[6]); /* twice is a no-op */
    ASSERT_EQ_INT(pd_seq_get_state(q[1]), PD_SEQ_FINISHED);
    ASSERT_EQ_INT(pd_sched_num_running(s), 3);
    ASSERT_EQ_INT(pd_sched_num_waiting(s), 3);
    ASSERT_OK(pd_kvpool_verify(pool));
    /* A reservation, then its abort. */
    pd_sched_seq *r;
    ASSERT_OK(pd_sched_seq_create(s, prompt, 9, NULL, &r));
    ASSERT_OK(pd_sched_reserve(s, r, 9, false, NULL));
    ASSERT_EQ_INT(pd_seq_get_state(r), PD_SEQ_HELD);
    ASSERT_EQ_INT(pd_kvtable_num_blocks(pd_seq_table(r)), 3);
    pd_sched_seq_free(s, r);
    for (int i = 0; i < 8; i++) pd_sched_seq_free(s, q[i]);
    ASSERT(pd_kvpool_all_free(pool));
    ASSERT_OK(pd_kvpool_verify(pool));
    /* A reservation that cannot fit is refused before anything is taken. */
    int32_t big[31] = {0};
    pd_kvpool *tiny;
    ASSERT_OK(pd_kvpool_create(4, 4, &tiny));
    pd_sched *s2;
    ASSERT_OK(pd_sched_create(&p, tiny, &s2));
    ASSERT_OK(pd_sched_seq_create(s2, big, 20, NULL, &r));
    ASSERT_ERR(pd_sched_reserve(s2, r, 20, false, NULL), PD_EBUSY, "KV cache full");
    ASSERT(pd_kvpool_all_free(tiny));
    pd_sched_free(s2); /* frees r too */
    pd_kvpool_free(tiny);
    pd_sched_free(s);
    pd_kvpool_free(pool);
}

TEST(sched_fork_shares_prompt_and_imported_sequences_continue)
{
    pd_kvpool *pool;
    ASSERT_OK(pd_kvpool_create(32, 4, &pool));
    pd_sched_params p = {.max_num_seqs = 4,
                         .max_num_batched_tokens = 32,
                         .max_model_len = 32,
                         .max_prefill_chunk = 0};
    pd_sched *s;
    ASSERT_OK(pd_sched_create(&p, pool, &s));
    int32_t prompt[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    pd_sched_seq *par, *other;
    ASSERT_OK(pd_sched_seq_create(s, prompt, 10, NULL, &par));
    ASSERT_OK(pd_sched_add(s, par, 3)); /* n = 4 */
    ASSERT_ERR(pd_sched_add(s, par, 3), PD_EINVAL, "already queued");
    ASSERT_OK(pd_sched_seq_create(s, prompt, 4, NULL, &other));
    ASSERT_OK(pd_sched_add(s, other, 0));
    pd_sched_out o;
    ASSERT_OK(pd_sched_schedule(s, &o));
    ASSERT_EQ_INT(o.n_items, 1); /* 1 + 3 children fill max_num_seqs */
    ASSERT(o.items[0].sample);
    pd_sched_commit(s);
    pd_sched_seq *kid[3];
    for (int i = 0; i < 3; i++) ASSERT_OK(pd_sched_fork(s, par, NULL, &kid[i]));
    pd_sched_seq *extra;
    ASSERT_ERR(pd_sched_fork(s, par, NULL, &extra), PD_EINVAL, "beyond");
    ASSERT_EQ_INT(pd_kvpool_num_free(pool), 32 - 3); /* 4 sequences on 3 blocks */
    ASSERT_OK(pd_sched_append(s, par, 100));
    for (int i = 0; i < 3; i++) ASSERT_OK(pd_sched_append(s, kid[i], 101 + i));
    ASSERT_OK(pd_sched_schedule(s, &o));
    ASSERT_EQ_INT(o.n_items, 4);
    ASSERT_EQ_INT(o.n_copies, 3); /* three of the four copy the shared partial block */
    ASSERT_EQ_INT(pd_kvpool_num_free(pool), 32 - 6);
    pd_sched_commit(s);
    pd_sched_seq_free(s, par);
    for (int i = 0; i < 3; i++) pd_sched_seq_free(s, kid[i]);

    /* An imported sequence: reserve, admit with 9 computed tokens and a first token. */
    pd_sched_seq *imp;
    ASSERT_OK(pd_sched_seq_create(s, prompt, 9, NULL, &imp));
    ASSERT_OK(pd_sched_reserve(s, imp, 9, false, NULL));
    ASSERT_OK(pd_sched_append(s, imp, 77));
    ASSERT_OK(pd_sched_admit_computed(s, imp, 9, 0));
    ASSERT_OK(pd_sched_schedule(s, &o));
    bool found = false;
    for (size_t i = 0; i < o.n_items; i++)
        if (o.items[i].seq == imp) {
            found = true;
            ASSERT_EQ_INT(o.items[i].start, 9);
            ASSERT_EQ_INT(o.items[i].n_new, 1);
            ASSERT(o.items[i].sample);
        }
    ASSERT(found);
    pd_sched_commit(s);
    /* A held prefill-only sequence keeps its blocks until finished. */
    ASSERT_OK(pd_sched_hold(s, imp));
    ASSERT_EQ_INT(pd_kvtable_num_blocks(pd_seq_table(imp)), 3);
    pd_sched_free(s);
    ASSERT(pd_kvpool_all_free(pool));
    pd_kvpool_free(pool);
}

/* Imported sequences (KV from a prefill instance) wait holding their prompt's blocks. When they
 * fill the pool, none can take the block for its next token and nothing runs: the youngest give
 * their KV up (recomputed later) so that the oldest runs, and every sequence finishes with its
 * tokens. Regression: a decode instance under overload stalled for good with 0 running. */
TEST(sched_waiting_imports_filling_the_pool_still_finish)
{
    pd_kvpool *pool;
    ASSERT_OK(pd_kvpool_create(16, 4, &pool));
    pd_sched_params p = {.max_num_seqs = 8,
                         .max_num_batched_tokens = 64,
                         .max_model_len = 32,
                         .max_prefill_chunk = 0};
    pd_sched *s;
    ASSERT_OK(pd_sched_create(&p, pool, &s));
    sim m;
    sim_init(&m, 8);
    int32_t prompt[8];
    for (size_t i = 0; i < m.n; i++) {
        m.prompt_len[i] = 8; /* two full blocks: the next token needs a third */
        m.out_len[i] = 6;
        for (size_t k = 0; k < 8; k++) prompt[k] = (int32_t)(i + k);
        ASSERT_OK(pd_sched_seq_create(s, prompt, 8, (void *)(uintptr_t)i, &m.seqs[i]));
        ASSERT_OK(pd_sched_reserve(s, m.seqs[i], 8, false, NULL));
        ASSERT_OK(pd_sched_append(s, m.seqs[i], (int32_t)(1000 * i))); /* the first token */
        ASSERT_OK(pd_sched_admit_computed(s, m.seqs[i], 8, 0));
        ASSERT_OK(sim_shadow(&m, pool));
        ASSERT(sim_kv(&m, m.seqs[i], 0, 8, true)); /* what the import wrote */
    }
    ASSERT_EQ_INT(pd_kvpool_num_free(pool), 0);
    int steps = sim_run(s, pool, &m, 1000);
    ASSERT(steps > 0);
    ASSERT(sim_tokens_ok(&m));
    ASSERT(pd_sched_num_preemptions(s) > 0);
    ASSERT(pd_kvpool_all_free(pool));
    pd_sched_free(s);
    sim_free(&m);
    pd_kvpool_free(pool);
}

/* A running sequence with nothing to compute (a beam waiting for its search's round) does not
 * count as running: the oldest waiting sequence that does not fit still makes a younger waiting
 * one that holds KV give it up. Regression: a search's preempted beam waited for good while a
 * younger import held the blocks it needed and its siblings idled. */
TEST(sched_idle_running_lets_waiting_holders_give_way)
{
    pd_kvpool *pool;
    ASSERT_OK(pd_kvpool_create(8, 4, &pool));
    pd_sched_params p = {.max_num_seqs = 8,
                         .max_num_batched_tokens = 64,
                         .max_model_len = 32,
                         .max_prefill_chunk = 0};
    pd_sched *s;
    ASSERT_OK(pd_sched_create(&p, pool, &s));
    int32_t prompt[24];
    for (int i = 0; i < 24; i++) prompt[i] = i + 1;
    pd_sched_seq *idle, *head, *young;
    ASSERT_OK(pd_sched_seq_create(s, prompt, 4, NULL, &idle));
    ASSERT_OK(pd_sched_add(s, idle, 0));
    pd_sched_out o;
    ASSERT_OK(pd_sched_schedule(s, &o));
    ASSERT_EQ_INT(o.n_items, 1);
    pd_sched_commit(s); /* computed, nothing appended: idle, one block */
    ASSERT_OK(pd_sched_seq_create(s, prompt, 8, NULL, &head));   /* older: two blocks */
    ASSERT_OK(pd_sched_seq_create(s, prompt, 24, NULL, &young)); /* younger: six blocks */
    ASSERT_OK(pd_sched_reserve(s, young, 24, false, NULL));
    ASSERT_OK(pd_sched_admit_computed(s, young, 23, 0));
    ASSERT_OK(pd_sched_add(s, head, 0));
    ASSERT_EQ_INT(pd_kvpool_num_free(pool), 1);
    ASSERT_OK(pd_sched_schedule(s, &o));
    ASSERT_EQ_INT(o.n_items, 1);
    ASSERT(o.items[0].seq == head);
    ASSERT_EQ_INT(pd_kvtable_num_blocks(pd_seq_table(young)), 0);
    ASSERT_EQ_INT(pd_seq_num_computed(young), 0);
    ASSERT_EQ_INT(pd_sched_num_preemptions(s), 1);
    pd_sched_commit(s);
    pd_sched_free(s);
    ASSERT(pd_kvpool_all_free(pool));
    pd_kvpool_free(pool);
}

/* Prefix caching in the scheduler: a prompt that shares full blocks with one computed before
 * starts after them; its last token is always computed (its logits give the next token), also
 * when every block of it is cached; the counters add up. */
TEST(sched_prefix_cache_skips_cached_blocks)
{
    pd_kvpool *pool;
    ASSERT_OK(pd_kvpool_create(32, 4, &pool));
    pd_sched_params p = {.max_num_seqs = 4,
                         .max_num_batched_tokens = 64,
                         .max_model_len = 64,
                         .prefix_caching = true};
    pd_sched *s;
    ASSERT_ERR(pd_sched_create(&p, pool, &s), PD_EINVAL, "needs the pool's prefix cache");
    ASSERT_OK(pd_kvpool_enable_prefix_cache(pool));
    ASSERT_OK(pd_sched_create(&p, pool, &s));
    int32_t pa[10] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, pb[11] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 50, 51};
    pd_sched_seq *a, *b, *c;
    pd_sched_out o;
    ASSERT_OK(pd_sched_seq_create(s, pa, 10, NULL, &a));
    ASSERT_OK(pd_sched_add(s, a, 0));
    ASSERT_OK(pd_sched_schedule(s, &o));
    ASSERT_EQ_INT(o.items[0].start, 0);
    ASSERT_EQ_INT(o.items[0].n_new, 10);
    pd_sched_commit(s);
    ASSERT_EQ_INT(pd_kvpool_num_cached(pool), 2); /* the two full blocks */
    int32_t a0 = pd_kvtable_ids(pd_seq_table(a))[0], a1 = pd_kvtable_ids(pd_seq_table(a))[1];
    pd_sched_finish(s, a);
    ASSERT_OK(pd_sched_seq_create(s, pb, 11, NULL, &b));
    ASSERT_OK(pd_sched_add(s, b, 0));
    ASSERT_OK(pd_sched_seq_create(s, pa, 8, NULL, &c)); /* exactly a's two full blocks */
    ASSERT_OK(pd_sched_add(s, c, 0));
    ASSERT_OK(pd_sched_schedule(s, &o));
    ASSERT_EQ_INT(o.n_items, 2);
    ASSERT_EQ_INT(o.items[0].start, 8); /* tokens 0..7 cached, 8 differs in the block after */
    ASSERT_EQ_INT(o.items[0].n_new, 3);
    ASSERT_EQ_INT(o.items[1].start, 4); /* its second block holds its last token: recomputed */
    ASSERT_EQ_INT(o.items[1].n_new, 4);
    ASSERT_EQ_INT(o.n_tokens, 7);
    const int32_t *ib = pd_kvtable_ids(pd_seq_table(b)), *ic = pd_kvtable_ids(pd_seq_table(c));
    ASSERT_EQ_INT(ib[0], a0);
    ASSERT_EQ_INT(ib[1], a1);
    ASSERT_EQ_INT(ic[0], a0);
    ASSERT(ic[1] != a1);
    uint64_t q = 0, h = 0;
    pd_sched_prefix_cache_stats(s, &q, &h);
    ASSERT_EQ_INT(q, 10 + 11 + 8);
    ASSERT_EQ_INT(h, 8 + 4);
    pd_sched_commit(s);
    /* a's second block's tokens as a first block: other positions and context, no hit */
    int32_t pd_[9] = {4, 5, 6, 7, 100, 101, 102, 103, 8};
    pd_sched_seq *d;
    ASSERT_OK(pd_sched_seq_create(s, pd_, 9, NULL, &d));
    ASSERT_OK(pd_sched_add(s, d, 0));
    ASSERT_OK(pd_sched_schedule(s, &o));
    ASSERT_EQ_INT(o.n_items, 1); /* b and c wait for a sampled token */
    ASSERT(o.items[0].seq == d);
    ASSERT_EQ_INT(o.items[0].start, 0);
    ASSERT_EQ_INT(o.items[0].n_new, 9);
    pd_sched_commit(s);
    pd_sched_free(s);
    ASSERT(pd_kvpool_all_free(pool));
    ASSERT_OK(pd_kvpool_verify(pool));
    pd_kvpool_free(pool);
}

/* Prompts sharing 13 tokens in a pool too small for all of them: sequences are preempted and
 * cached blocks evicted, yet every step finds each sequence's context in its blocks (the
 * simulated K/V), the cache is hit, and every block comes back. */
TEST(sched_prefix_cache_under_preemption_and_eviction)
{
    pd_kvpool *pool;
    ASSERT_OK(pd_kvpool_create(14, 4, &pool));
    ASSERT_OK(pd_kvpool_enable_prefix_cache(pool));
    pd_sched_params p = {.max_num_seqs = 8,
                         .max_num_batched_tokens = 56,
                         .max_model_len = 56,
                         .max_prefill_chunk = 6,
                         .prefix_caching = true};
    pd_sched *s;
    ASSERT_OK(pd_sched_create(&p, pool, &s));
    sim m;
    sim_init(&m, 10);
    m.shared = 13;
    for (size_t i = 0; i < m.n; i++) {
        m.prompt_len[i] = 14 + (i * 5) % 9;
        m.out_len[i] = 6 + (i * 3) % 11;
    }
    ASSERT_OK(sim_add_all(s, &m));
    int steps = sim_run(s, pool, &m, 4000);
    ASSERT(steps > 0);
    ASSERT(sim_tokens_ok(&m));
    ASSERT(pd_sched_num_preemptions(s) > 0);
    ASSERT(pd_kvpool_num_evictions(pool) > 0);
    uint64_t q = 0, h = 0;
    pd_sched_prefix_cache_stats(s, &q, &h);
    ASSERT(h >= 12 * 5); /* the later prompts at least find the 3 shared full blocks */
    ASSERT(h < q);
    ASSERT(pd_kvpool_all_free(pool));
    ASSERT_OK(pd_kvpool_verify(pool));
    pd_sched_free(s);
    sim_free(&m);
    pd_kvpool_free(pool);
}
