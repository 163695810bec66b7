/* Engine tests on the tiny synthetic model (pd-mkmodel --preset tiny): batching determinism
 * (64 concurrent requests = each alone, greedy and seeded), preemption, aborts, n > 1 block
 * sharing, chunked prefill, CPU tensor parallelism, PD hand-over through exported KV, stop
 * strings, the engine thread, and parameter errors with vLLM's wording. */
#include "harness.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

#include "backend/forward.h"
#include "engine/engine.h"
#include "engine/spec.h"
#include "engine/kvpool.h"
#include "kv_move.h"
#include "model/model.h"
#include "grammar/grammar.h"
#include "tokenizer/tokenizer.h"
#include "util/log.h"

#define MAX_REQ 64
#define MAX_N   4
#define MAX_OUT 64

/* ---- the shared model ---------------------------------------------------------------------- */

static pd_model *g_model;
static pd_tok *g_tok;
static char g_dir[1024];

/* Writes the tiny model once per process and loads it; NULL with a test failure on error. */
static int tiny(void)
{
    if (g_model) return PD_OK;
    pd_log_set_level(PD_LOG_WARN); /* one start-up line per engine would drown the results */
    const char *build = getenv("PD_BUILD_ROOT");
    if (!build) return pd_error(PD_ENOTFOUND, "PD_BUILD_ROOT is not set (run through meson)");
    snprintf(g_dir, sizeof g_dir, "%s/tiny", pdt_tmp_dir());
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "%s/tools/mkmodel/pd-mkmodel --preset tiny --out %s > /dev/null",
             build, g_dir);
    if (system(cmd) != 0) return pd_error(PD_EIO, "%s failed", cmd);
    PD_CHECK(pd_model_load(g_dir, &g_model));
    PD_CHECK(pd_tok_load(g_dir, &g_tok));
    return PD_OK;
}

__attribute__((destructor)) static void free_tiny(void)
{
    pd_model_free(g_model);
    pd_tok_free(g_tok);
}

static pd_engine_params base_params(void)
{
    pd_engine_params p = pd_engine_default_params();
    p.model = g_model;
    p.tok = g_tok;
    p.n_threads = 2;
    p.max_model_len = 256;
    p.max_num_batched_tokens = 512;
    p.max_num_seqs = 64;
    p.num_kv_blocks = 2048;
    return p;
}

/* ---- requests and their outputs -------------------------------------------------------------- */

typedef struct {
    char id[32];
    int32_t prompt[256];
    size_t n_prompt;
    pd_sampling_params sp;
    const char *stop[2];
} treq;

typedef struct {
    int32_t toks[MAX_N][MAX_OUT];
    size_t n[MAX_N];
    char text[MAX_N][4096];
    size_t tlen[MAX_N];
    bool final[MAX_N];
    int status[MAX_N];
    pd_finish_reason finish[MAX_N];
    pd_stop_reason_kind stop_kind[MAX_N];
    char stop_string[MAX_N][64];
    int64_t completion[MAX_N];
    int n_logprob_events;
    bool held;
    int32_t blocks[64];
    size_t n_blocks;
    uint64_t seed;
} tout;

static uint32_t lcg(uint32_t *s)
{
    *s = *s * 1664525u + 1013904223u;
    return *s >> 8;
}

/* Request i: a prompt of a mixed length, greedy for even i, seeded sampling for odd i. */
static void make_req(treq *r, int i, size_t vocab)
{
    memset(r, 0, sizeof *r);
    snprintf(r->id, sizeof r->id, "req-%d", i);
    uint32_t s = 1234u + (uint32_t)i * 7919u;
    r->n_prompt = 1 + (size_t)(lcg(&s) % 120);
    for (size_t k = 0; k < r->n_prompt; k++) r->prompt[k] = (int32_t)(3 + lcg(&s) % (vocab - 3));
    r->sp = pd_sampling_default_params();
    r->sp.max_tokens = 4 + (int64_t)(lcg(&s) % 28);
    r->sp.ignore_eos = (i % 3) != 0;
    if (i % 2 == 0) {
        r->sp.temperature = 0.0;
    } else {
        r->sp.temperature = 0.8;
        r->sp.top_p = 0.9;
        r->sp.has_seed = true;
        r->sp.seed = 1000 + i;
    }
}

static int req_index(const char *id)
{
    return atoi(id + 4);
}

/* Drains every event into outs (indexed by the request id's number). Fails on a bad event. */
static int drain(pd_engine *e, tout *outs)
{
    const pd_engine_event *ev;
    while (pd_engine_next_event(e, &ev)) {
        int i = req_index(ev->request_id);
        if (i < 0 || i >= MAX_REQ || ev->seq_index >= MAX_N) {
            pd_engine_event_done(e);
            return pd_error(PD_EINTERNAL, "event for unknown request %s", ev->request_id);
        }
        tout *o = &outs[i];
        uint32_t c = ev->seq_index;
        if (o->final[c]) {
            pd_engine_event_done(e);
            return pd_error(PD_EINTERNAL, "event after the final one for %s/%u", ev->request_id, c);
        }
        for (size_t k = 0; k < ev->n_tokens && o->n[c] < MAX_OUT; k++)
            o->toks[c][o->n[c]++] = ev->token_ids[k];
        if (o->tlen[c] + ev->text_len < sizeof o->text[c]) {
            memcpy(o->text[c] + o->tlen[c], ev->text, ev->text_len);
            o->tlen[c] += ev->text_len;
            o->text[c][o->tlen[c]] = '\0';
        }
        if (ev->has_logprob) o->n_logprob_events++;
        o->completion[c] = ev->completion_tokens;
        if (ev->final) {
            o->final[c] = true;
            o->status[c] = ev->status;
            o->finish[c] = ev->finish;
            o->stop_kind[c] = ev->stop_kind;
            if (ev->stop_string) snprintf(o->stop_string[c], 64, "%s", ev->stop_string);
            if (ev->held) {
                o->held = true;
                o->n_blocks = ev->n_blocks;
                memcpy(o->blocks, ev->block_ids, ev->n_blocks * sizeof(int32_t));
                o->seed = ev->seed;
            }
        }
        pd_engine_event_done(e);
    }
    return PD_OK;
}

static int add_req(pd_engine *e, const treq *r, pd_engine_phase phase)
{
    pd_engine_request rq = {.request_id = r->id,
                            .prompt_ids = r->prompt,
                            .n_prompt = r->n_prompt,
                            .sampling = &r->sp,
                            .phase = phase};
    return pd_engine_add(e, &rq);
}

/* Steps until nothing is left, draining after each step. */
static int run_to_end(pd_engine *e, tout *outs)
{
    for (int it = 0; it < 100000; it++) {
        if (!pd_engine_has_work(e)) return drain(e, outs);
        bool did;
        PD_CHECK(pd_engine_step(e, &did));
        PD_CHECK(drain(e, outs));
    }
    return pd_error(PD_ETIMEOUT, "engine did not finish");
}

/* Runs each request alone on a fresh engine of params p. */
static int run_alone(const pd_engine_params *p, const treq *reqs, int n, tout *outs)
{
    pd_engine *e;
    PD_CHECK(pd_engine_create(p, &e));
    int rc = PD_OK;
    for (int i = 0; i < n && rc >= 0; i++) {
        rc = add_req(e, &reqs[i], PD_PHASE_FULL);
        if (rc >= 0) rc = run_to_end(e, outs);
    }
    pd_engine_free(e);
    return rc;
}

/* True when both runs produced the same tokens; otherwise prints where they part. */
static bool same_tokens(const tout *a, const tout *b, int n_choices)
{
    for (int c = 0; c < n_choices; c++) {
        size_t k = 0;
        while (k < a->n[c] && k < b->n[c] && a->toks[c][k] == b->toks[c][k]) k++;
        if (a->n[c] != b->n[c] || a->n[c] == 0 || k < a->n[c]) {
            printf("    choice %d: %zu vs %zu tokens, first difference at %zu (status %d/%d)\n", c,
                   a->n[c], b->n[c], k, a->status[c], b->status[c]);
            return false;
        }
    }
    return true;
}

/* ---- tests ------------------------------------------------------------------------------- */

TEST(engine_64_concurrent_equal_alone)
{
    ASSERT_OK(tiny());
    static treq reqs[MAX_REQ];
    static tout alone[MAX_REQ], batch[MAX_REQ];
    memset(alone, 0, sizeof alone);
    memset(batch, 0, sizeof batch);
    pd_engine_params p = base_params();
    for (int i = 0; i < MAX_REQ; i++) make_req(&reqs[i], i, pd_tok_vocab_size(g_tok));
    ASSERT_OK(run_alone(&p, reqs, MAX_REQ, alone));
    pd_engine *e;
    ASSERT_OK(pd_engine_create(&p, &e));
    size_t prompts = 0;
    for (int i = 0; i < MAX_REQ; i++) {
        ASSERT_OK(add_req(e, &reqs[i], PD_PHASE_FULL));
        prompts += reqs[i].n_prompt;
    }
    pd_engine_stats st;
    pd_engine_get_stats(e, &st);
    ASSERT_EQ_INT(st.queued_tokens, prompts); /* nothing computed yet */
    ASSERT_OK(pd_engine_step(e, NULL));
    pd_engine_get_stats(e, &st);
    ASSERT(st.queued_tokens < prompts); /* the first step's prompt rows */
    ASSERT_OK(run_to_end(e, batch));
    pd_engine_get_stats(e, &st);
    ASSERT_EQ_INT(st.queued_tokens, 0);
    ASSERT_EQ_INT(st.kv_blocks_free, st.kv_blocks_total);
    ASSERT_EQ_INT(st.requests_finished, MAX_REQ);
    ASSERT(st.steps < 200); /* they really ran together */
    pd_engine_free(e);
    int greedy = 0, seeded = 0;
    for (int i = 0; i < MAX_REQ; i++) {
        ASSERT_MSG(same_tokens(&alone[i], &batch[i], 1), "request %d differs in the batch", i);
        ASSERT(batch[i].final[0] && batch[i].status[0] == 0);
        ASSERT(batch[i].finish[0] != PD_FINISH_NONE);
        ASSERT_STR_EQ(batch[i].text[0], alone[i].text[0]);
        if (reqs[i].sp.temperature == 0.0)
            greedy++;
        else
            seeded++;
    }
    ASSERT(greedy == 32 && seeded == 32);
}

/* Requests arriving while others run, with several prefill chunk sizes: every composition of
 * steps gives each request exactly its tokens alone. */
TEST(engine_staggered_arrivals_and_chunks_equal_alone)
{
    ASSERT_OK(tiny());
    static treq reqs[24];
    static tout alone[MAX_REQ], mixed[MAX_REQ];
    memset(alone, 0, sizeof alone);
    pd_engine_params p = base_params();
    for (int i = 0; i < 24; i++) make_req(&reqs[i], i + 30, pd_tok_vocab_size(g_tok));
    for (int i = 0; i < 24; i++) snprintf(reqs[i].id, sizeof reqs[i].id, "req-%d", i);
    ASSERT_OK(run_alone(&p, reqs, 24, alone));
    static const size_t chunks[] = {0, 1, 7, 16, 33, 64};
    for (size_t c = 0; c < sizeof chunks / sizeof chunks[0]; c++) {
        memset(mixed, 0, sizeof mixed);
        p.max_prefill_chunk = chunks[c];
        p.max_num_batched_tokens = 256 + 37 * c;
        p.max_model_len = 256;
        pd_engine *e;
        ASSERT_OK(pd_engine_create(&p, &e));
        int added = 0, rc = PD_OK;
        for (int step = 0; rc >= 0 && (added < 24 || pd_engine_has_work(e)); step++) {
            while (added < 24 && (size_t)added <= (size_t)step * (c + 1) / 2)
                rc = add_req(e, &reqs[added++], PD_PHASE_FULL);
            if (rc >= 0) rc = pd_engine_step(e, NULL);
            if (rc >= 0) rc = drain(e, mixed);
            if (step > 5000) rc = pd_error(PD_ETIMEOUT, "did not finish");
        }
        pd_engine_free(e);
        ASSERT_OK(rc);
        for (int i = 0; i < 24; i++)
            ASSERT_MSG(same_tokens(&alone[i], &mixed[i], 1),
                       "request %d differs with chunk %zu (budget %zu)", i, chunks[c],
                       p.max_num_batched_tokens);
    }
}

/* vLLM's enable_chunked_prefill: a step budget below max_model_len is refused without it (vLLM's
 * message), and with it every prompt longer than the budget prefills over several steps, each
 * request still getting its tokens alone. */
TEST(engine_chunked_prefill_budget_below_max_model_len)
{
    ASSERT_OK(tiny());
    static treq reqs[8];
    static tout alone[MAX_REQ], chunked[MAX_REQ];
    memset(alone, 0, sizeof alone);
    memset(chunked, 0, sizeof chunked);
    pd_engine_params p = base_params();
    for (int i = 0; i < 8; i++) make_req(&reqs[i], i + 70, pd_tok_vocab_size(g_tok));
    for (int i = 0; i < 8; i++) snprintf(reqs[i].id, sizeof reqs[i].id, "req-%d", i);
    ASSERT_OK(run_alone(&p, reqs, 8, alone));
    p.max_num_batched_tokens = 64;
    pd_engine *e = NULL;
    ASSERT_ERR(pd_engine_create(&p, &e), PD_EINVAL,
               "max_num_batched_tokens (64) is smaller than max_model_len (256).");
    p.enable_chunked_prefill = true;
    ASSERT_OK(pd_engine_create(&p, &e));
    int rc = PD_OK;
    for (int i = 0; rc >= 0 && i < 8; i++) rc = add_req(e, &reqs[i], PD_PHASE_FULL);
    size_t steps = 0;
    while (rc >= 0 && pd_engine_has_work(e) && steps++ < 5000) {
        rc = pd_engine_step(e, NULL);
        if (rc >= 0) rc = drain(e, chunked);
    }
    pd_engine_free(e);
    ASSERT_OK(rc);
    size_t longest = 0;
    for (int i = 0; i < 8; i++) {
        if (reqs[i].n_prompt > longest) longest = reqs[i].n_prompt;
        ASSERT_MSG(same_tokens(&alone[i], &chunked[i], 1), "request %d differs when chunked", i);
    }
    ASSERT_MSG(longest > 64, "no prompt longer than the budget (%zu)", longest);
}

TEST(engine_text_is_the_incremental_decode)
{
    ASSERT_OK(tiny());
    static treq r;
    static tout o[MAX_REQ];
    memset(o, 0, sizeof o);
    make_req(&r, 1, pd_tok_vocab_size(g_tok));
    r.sp.ignore_eos = true;
    pd_engine_params p = base_params();
    ASSERT_OK(run_alone(&p, &r, 1, o));
    ASSERT_EQ_INT(o[1].finish[0], PD_FINISH_LENGTH);
    ASSERT_EQ_INT((int64_t)o[1].n[0], r.sp.max_tokens);
    ASSERT_EQ_INT(o[1].completion[0], r.sp.max_tokens);
    /* the deltas add up to decode(prompt + output) minus decode(prompt) */
    int32_t all[300];
    memcpy(all, r.prompt, r.n_prompt * sizeof(int32_t));
    memcpy(all + r.n_prompt, o[1].toks[0], o[1].n[0] * sizeof(int32_t));
    char *full, *pre;
    size_t full_len, pre_len;
    ASSERT_OK(pd_tok_decode(g_tok, all, r.n_prompt + o[1].n[0], true, &full, &full_len));
    ASSERT_OK(pd_tok_decode(g_tok, all, r.n_prompt, true, &pre, &pre_len));
    bool ok = full_len >= pre_len && strcmp(full + pre_len, o[1].text[0]) == 0;
    free(full);
    free(pre);
    ASSERT(ok);
}

/* 16 requests in a pool small enough to preempt (by recompute) give each the tokens it gives
 * alone; then the same with structured output (an open-ended regex: the matchers and masks
 * survive preemption; an EOS where the regex may end stops a request even with ignore_eos). */
TEST(engine_small_pool_preempts_outputs_identical)
{
    ASSERT_OK(tiny());
    static treq reqs[16];
    static tout alone[MAX_REQ], batch[MAX_REQ];
    static const char RX[] = "[a-z]+( [a-z]+)*";
    for (int guided = 0; guided < 2; guided++) {
        memset(alone, 0, sizeof alone);
        memset(batch, 0, sizeof batch);
        pd_engine_params p = base_params();
        p.max_model_len = 160;
        p.max_num_batched_tokens = 160;
        p.num_kv_blocks = 12; /* 192 tokens for 16 sequences of up to 150 */
        for (int i = 0; i < 16; i++) {
            make_req(&reqs[i], i, pd_tok_vocab_size(g_tok));
            reqs[i].sp.max_tokens = 24;
            reqs[i].sp.ignore_eos = true;
            if (guided) {
                reqs[i].sp.guided_kind = PD_GSPEC_REGEX;
                reqs[i].sp.guided = RX;
                reqs[i].sp.guided_len = strlen(RX);
            }
        }
        ASSERT_OK(run_alone(&p, reqs, 16, alone));
        pd_engine *e;
        ASSERT_OK(pd_engine_create(&p, &e));
        for (int i = 0; i < 16; i++) ASSERT_OK(add_req(e, &reqs[i], PD_PHASE_FULL));
        ASSERT_OK(run_to_end(e, batch));
        pd_engine_stats st;
        pd_engine_get_stats(e, &st);
        ASSERT(st.num_preemptions > 0);
        ASSERT_EQ_INT(st.kv_blocks_free, st.kv_blocks_total);
        pd_engine_free(e);
        for (int i = 0; i < 16; i++) {
            ASSERT_MSG(same_tokens(&alone[i], &batch[i], 1),
                       "request %d differs after preemption (guided %d)", i, guided);
            if (!guided) continue;
            /* letters and single spaces (after a U+FFFD the detokenizer may write first: the
             * random prompt's incomplete UTF-8 tail, decoded with the first output token) */
            const char *t = batch[i].text[0];
            size_t k0 = strncmp(t, "\xef\xbf\xbd", 3) == 0 ? 3 : 0;
            for (size_t k = k0; k < batch[i].tlen[0]; k++)
                ASSERT_MSG((t[k] >= 'a' && t[k] <= 'z') ||
                               (t[k] == ' ' && k > k0 && t[k - 1] != ' '),
                           "request %d: %s", i, t);
        }
    }
}

/* Requests of a shared 70-token prefix (4 full blocks), some repeating an earlier prompt whole,
 * some with n = 2: with prefix caching, arriving while the prefix's owners still run or after
 * they finished, in a pool so small that sequences are preempted and cached blocks evicted,
 * every choice gets exactly the tokens it gets without the cache, and the cache is hit. */
TEST(engine_prefix_cache_outputs_identical)
{
    ASSERT_OK(tiny());
    enum { N = 16 };
    static treq reqs[N];
    static tout ref[MAX_REQ], late[MAX_REQ], small[MAX_REQ];
    memset(ref, 0, sizeof ref);
    memset(late, 0, sizeof late);
    memset(small, 0, sizeof small);
    for (int i = 0; i < N; i++) {
        make_req(&reqs[i], i, pd_tok_vocab_size(g_tok));
        if (i % 5 == 4) { /* the whole prompt of the request before it */
            memcpy(reqs[i].prompt, reqs[i - 1].prompt, sizeof reqs[i].prompt);
            reqs[i].n_prompt = reqs[i - 1].n_prompt;
        } else {
            reqs[i].n_prompt = 71 + (size_t)(i * 7) % 40;
            if (i) memcpy(reqs[i].prompt, reqs[0].prompt, 70 * sizeof(int32_t));
        }
        reqs[i].sp.max_tokens = 20;
        reqs[i].sp.ignore_eos = true;
        if (i % 4 == 1) reqs[i].sp.n = 2; /* seeded: two different choices */
    }
    pd_engine_params p = base_params();
    p.enable_prefix_caching = false;
    pd_engine *e;
    ASSERT_OK(pd_engine_create(&p, &e));
    for (int i = 0; i < N; i++) ASSERT_OK(add_req(e, &reqs[i], PD_PHASE_FULL));
    ASSERT_OK(run_to_end(e, ref));
    pd_engine_stats st;
    pd_engine_get_stats(e, &st);
    ASSERT_EQ_INT(st.prefix_cache_hits, 0);
    ASSERT_EQ_INT(st.kv_blocks_cached, 0);
    pd_engine_free(e);

    p.enable_prefix_caching = true;
    ASSERT_OK(pd_engine_create(&p, &e));
    for (int i = 0; i < N / 2; i++) ASSERT_OK(add_req(e, &reqs[i], PD_PHASE_FULL));
    for (int k = 0; k < 3; k++) ASSERT_OK(pd_engine_step(e, NULL)); /* the first ones run */
    ASSERT_OK(drain(e, late));
    for (int i = N / 2; i < N; i++) ASSERT_OK(add_req(e, &reqs[i], PD_PHASE_FULL));
    ASSERT_OK(run_to_end(e, late));
    pd_engine_get_stats(e, &st);
    /* the later half at least finds the 4 shared blocks (the first half arrived together) */
    ASSERT(st.prefix_cache_hits >= (N / 2) * 64);
    ASSERT(st.kv_blocks_cached > 0);
    ASSERT_EQ_INT(st.kv_blocks_free, st.kv_blocks_total);
    pd_engine_free(e);

    p.num_kv_blocks = 24; /* 384 slots for 20 sequences of 90-130 tokens */
    ASSERT_OK(pd_engine_create(&p, &e));
    for (int i = 0; i < N; i++) ASSERT_OK(add_req(e, &reqs[i], PD_PHASE_FULL));
    ASSERT_OK(run_to_end(e, small));
    pd_engine_get_stats(e, &st);
    ASSERT(st.num_preemptions > 0);
    ASSERT(st.prefix_cache_hits > 0);
    ASSERT_EQ_INT(st.kv_blocks_free, st.kv_blocks_total);
    pd_engine_free(e);
    for (int i = 0; i < N; i++) {
        int n = (int)reqs[i].sp.n;
        ASSERT_MSG(same_tokens(&ref[i], &late[i], n), "request %d differs with the cache", i);
        ASSERT_MSG(same_tokens(&ref[i], &small[i], n),
                   "request %d differs with the cache in a small pool", i);
        for (int c = 0; c < n; c++) ASSERT_STR_EQ(late[i].text[c], ref[i].text[c]);
    }
}

TEST(engine_chunked_prefill_equals_one_chunk)
{
    ASSERT_OK(tiny());
    static treq reqs[8];
    static tout one[MAX_REQ], chunked[MAX_REQ];
    memset(one, 0, sizeof one);
    memset(chunked, 0, sizeof chunked);
    for (int i = 0; i < 8; i++) make_req(&reqs[i], 20 + i, pd_tok_vocab_size(g_tok));
    for (int i = 0; i < 8; i++) snprintf(reqs[i].id, sizeof reqs[i].id, "req-%d", i);
    pd_engine_params p = base_params();
    pd_engine *e;
    ASSERT_OK(pd_engine_create(&p, &e));
    for (int i = 0; i < 8; i++) ASSERT_OK(add_req(e, &reqs[i], PD_PHASE_FULL));
    ASSERT_OK(run_to_end(e, one));
    pd_engine_free(e);
    p.max_prefill_chunk = 5;
    ASSERT_OK(pd_engine_create(&p, &e));
    for (int i = 0; i < 8; i++) ASSERT_OK(add_req(e, &reqs[i], PD_PHASE_FULL));
    ASSERT_OK(run_to_end(e, chunked));
    pd_engine_stats st;
    pd_engine_get_stats(e, &st);
    pd_engine_free(e);
    ASSERT(st.steps > 120 / 5); /* the longest prompt took many steps */
    for (int i = 0; i < 8; i++)
        ASSERT_MSG(same_tokens(&one[i], &chunked[i], 1), "request %d differs when chunked", i);
}

TEST(engine_abort_mid_generation_returns_pool_to_full)
{
    ASSERT_OK(tiny());
    static treq reqs[12];
    static tout o[MAX_REQ];
    memset(o, 0, sizeof o);
    pd_engine_params p = base_params();
    p.max_num_seqs = 4; /* some wait while others run */
    p.max_prefill_chunk = 16;
    pd_engine *e;
    ASSERT_OK(pd_engine_create(&p, &e));
    for (int i = 0; i < 12; i++) {
        make_req(&reqs[i], i, pd_tok_vocab_size(g_tok));
        reqs[i].sp.max_tokens = 30;
        reqs[i].sp.ignore_eos = true;
        if (i == 5) reqs[i].sp.n = 3;
        ASSERT_OK(add_req(e, &reqs[i], PD_PHASE_FULL));
    }
    ASSERT_ERR(pd_engine_abort(e, "nope"), PD_ENOTFOUND, "no live request");
    for (int s = 0; s < 6; s++) {
        ASSERT_OK(pd_engine_step(e, NULL));
        ASSERT_OK(drain(e, o));
    }
    pd_engine_stats st;
    pd_engine_get_stats(e, &st);
    ASSERT(st.num_running > 0 && st.num_waiting > 0);
    ASSERT(st.kv_blocks_free < st.kv_blocks_total);
    /* abort running ones, a waiting one, and twice the same id */
    ASSERT_OK(pd_engine_abort(e, "req-0"));
    ASSERT_OK(pd_engine_abort(e, "req-0"));
    ASSERT_OK(pd_engine_abort(e, "req-11"));
    for (int s = 0; s < 30; s++) {
        ASSERT_OK(pd_engine_step(e, NULL));
        ASSERT_OK(drain(e, o));
        if (s == 3) ASSERT_OK(pd_engine_abort(e, "req-5")); /* n = 3, mid-generation */
    }
    for (int i = 1; i < 12; i++) (void)pd_engine_abort(e, reqs[i].id); /* whatever is left */
    ASSERT_OK(run_to_end(e, o));
    pd_engine_get_stats(e, &st);
    ASSERT_EQ_INT(st.kv_blocks_free, st.kv_blocks_total);
    ASSERT_EQ_INT(st.num_running + st.num_waiting + st.num_held, 0);
    ASSERT_EQ_INT(st.requests_finished, 12);
    ASSERT(o[0].final[0] && o[0].status[0] == PD_ECANCELLED);
    ASSERT(o[0].n[0] > 0 && o[0].n[0] < 30);
    ASSERT(o[11].final[0] && o[11].status[0] == PD_ECANCELLED);
    for (int c = 0; c < 3; c++) ASSERT(o[5].final[c]);
    for (int i = 0; i < 12; i++) ASSERT(o[i].final[0]);
    pd_engine_free(e);
}

TEST(engine_n4_shares_prompt_blocks)
{
    ASSERT_OK(tiny());
    static treq r, r1;
    static tout o[MAX_REQ], o1[MAX_REQ];
    memset(o, 0, sizeof o);
    memset(o1, 0, sizeof o1);
    make_req(&r, 3, pd_tok_vocab_size(g_tok));
    r.n_prompt = 40; /* 2 full blocks + 8 tokens */
    r.sp.n = 4;
    r.sp.max_tokens = 12;
    r.sp.ignore_eos = true;
    pd_engine_params p = base_params();
    pd_engine *e;
    ASSERT_OK(pd_engine_create(&p, &e));
    ASSERT_OK(add_req(e, &r, PD_PHASE_FULL));
    ASSERT_OK(pd_engine_step(e, NULL)); /* prefill, 4 first tokens */
    ASSERT_OK(drain(e, o));
    pd_engine_stats st;
    pd_engine_get_stats(e, &st);
    ASSERT_EQ_INT(st.num_running, 4);
    ASSERT_EQ_INT(st.kv_blocks_total - st.kv_blocks_free, 3); /* one copy of the prompt */
    ASSERT_OK(pd_engine_step(e, NULL)); /* 3 copy-on-write copies of the partial block */
    ASSERT_OK(drain(e, o));
    pd_engine_get_stats(e, &st);
    ASSERT_EQ_INT(st.kv_blocks_total - st.kv_blocks_free, 6);
    ASSERT_OK(run_to_end(e, o));
    pd_engine_get_stats(e, &st);
    ASSERT_EQ_INT(st.kv_blocks_free, st.kv_blocks_total);
    pd_engine_free(e);
    for (int c = 0; c < 4; c++) {
        ASSERT_EQ_INT(o[3].n[c], 12);
        ASSERT_EQ_INT(o[3].finish[c], PD_FINISH_LENGTH);
    }
    ASSERT(memcmp(o[3].toks[0], o[3].toks[1], 12 * sizeof(int32_t)) != 0); /* seeded choices */
    /* choice 0 equals the same request with n = 1 (same seed, index 0) */
    r1 = r;
    r1.sp.n = 1;
    ASSERT_OK(run_alone(&p, &r1, 1, o1));
    ASSERT(memcmp(o[3].toks[0], o1[3].toks[0], 12 * sizeof(int32_t)) == 0);
}

/* Logits observer: stores the first max_rows rows seen for request "req-0" choice 0. */
typedef struct {
    float *rows; /* (max_rows, vocab) */
    size_t max_rows, n_rows, vocab;
} logit_log;

static void log_logits(void *ctx, const char *id, uint32_t seq, int64_t step, const float *l,
                       size_t vocab)
{
    logit_log *lg = ctx;
    if (strcmp(id, "req-0") != 0 || seq != 0 || lg->n_rows >= lg->max_rows) return;
    lg->vocab = vocab;
    memcpy(lg->rows + lg->n_rows * vocab, l, vocab * sizeof(float));
    lg->n_rows++;
}

/* The n-gram proposer: the longest suffix n-gram within [min, max] that occurs earlier, its most
 * recent occurrence, at most k of the tokens after it, none without a match. */
TEST(spec_ngram_proposer)
{
    int32_t out[8];
    /* suffix "7 8" occurs at 1 (then 9 5 ...) and at 5 (then 3 7 8): the most recent one wins,
       and the proposal runs up to the end of the tokens */
    const int32_t a[] = {6, 7, 8, 9, 5, 7, 8, 3, 7, 8};
    ASSERT_EQ_INT(pd_spec_ngram_propose(a, 10, 1, 2, 4, out), 3);
    ASSERT(out[0] == 3 && out[1] == 7 && out[2] == 8);
    /* with max 3 the 3-gram "3 7 8" does not occur earlier, so n = 2 is used, capped at k = 1 */
    ASSERT_EQ_INT(pd_spec_ngram_propose(a, 10, 1, 3, 1, out), 1);
    ASSERT_EQ_INT(out[0], 3);
    /* min 3: no 3-gram match, nothing proposed */
    ASSERT_EQ_INT(pd_spec_ngram_propose(a, 10, 3, 4, 4, out), 0);
    /* the longest match wins over a more recent shorter one: "1 2 3" at 0 (then 4), "3" at 5 */
    const int32_t b[] = {1, 2, 3, 4, 9, 3, 5, 1, 2, 3};
    ASSERT_EQ_INT(pd_spec_ngram_propose(b, 10, 1, 3, 3, out), 3);
    ASSERT(out[0] == 4 && out[1] == 9 && out[2] == 3);
    /* a loop: the proposal continues it */
    const int32_t c[] = {4, 5, 4, 5, 4, 5};
    ASSERT_EQ_INT(pd_spec_ngram_propose(c, 6, 1, 4, 5, out), 2);
    ASSERT(out[0] == 4 && out[1] == 5);
    ASSERT_EQ_INT(pd_spec_ngram_propose(c, 1, 1, 4, 5, out), 0);
    ASSERT_EQ_INT(pd_spec_ngram_propose(c, 6, 1, 4, 0, out), 0);
}

/* Logits observer: an FNV-1a hash of the bytes of every row sampled, by request index and output
 * position (choice 0). */
typedef struct {
    uint64_t h[MAX_REQ][MAX_OUT];
    size_t n_rows;
} logit_hashes;

static void hash_logits(void *ctx, const char *id, uint32_t seq, int64_t step, const float *l,
                        size_t vocab)
{
    logit_hashes *lh = ctx;
    int i = req_index(id);
    if (i < 0 || i >= MAX_REQ || seq != 0 || step < 0 || step >= MAX_OUT) return;
    uint64_t h = 1469598103934665603ull;
    const unsigned char *b = (const unsigned char *)l;
    for (size_t k = 0; k < vocab * sizeof(float); k++) h = (h ^ b[k]) * 1099511628211ull;
    lh->h[i][step] = h;
    lh->n_rows++;
}

/* Speculative decoding (n-gram drafts, 4 per step) in a batch of greedy and seeded requests gives
 * each request the tokens, text, finish and logits (every row's bits) of plain decoding alone;
 * some drafts are accepted and some rejected, and every block comes back. */
TEST(engine_spec_ngram_equals_plain_decoding)
{
    ASSERT_OK(tiny());
    enum { N = 12 };
    static treq reqs[N];
    static tout plain[MAX_REQ], spec[MAX_REQ];
    static logit_hashes lp, ls;
    memset(plain, 0, sizeof plain);
    memset(spec, 0, sizeof spec);
    memset(&lp, 0, sizeof lp);
    memset(&ls, 0, sizeof ls);
    for (int i = 0; i < N; i++) {
        make_req(&reqs[i], i + 90, pd_tok_vocab_size(g_tok));
        snprintf(reqs[i].id, sizeof reqs[i].id, "req-%d", i);
        /* a prompt that repeats a phrase (what prompt lookup finds), outputs long enough for the
           random model's loops */
        size_t phrase = 3 + (size_t)i % 5, reps = 2 + (size_t)i % 3;
        for (size_t k = phrase; k < phrase * reps; k++)
            reqs[i].prompt[k] = reqs[i].prompt[k % phrase];
        reqs[i].n_prompt = phrase * reps;
        reqs[i].sp.max_tokens = 40 + i;
        reqs[i].sp.ignore_eos = i % 4 != 0;
    }
    pd_engine_params p = base_params();
    p.on_logits = hash_logits;
    p.on_logits_ctx = &lp;
    ASSERT_OK(run_alone(&p, reqs, N, plain));
    p.on_logits_ctx = &ls;
    p.spec_num_tokens = 4;
    p.spec_ngram_max = 3;
    pd_engine *e;
    ASSERT_OK(pd_engine_create(&p, &e));
    int rc = PD_OK;
    for (int i = 0; i < N && rc >= 0; i++) rc = add_req(e, &reqs[i], PD_PHASE_FULL);
    if (rc >= 0) rc = run_to_end(e, spec);
    pd_engine_stats st;
    pd_engine_get_stats(e, &st);
    pd_engine_free(e);
    ASSERT_OK(rc);
    for (int i = 0; i < N; i++) {
        ASSERT_MSG(same_tokens(&plain[i], &spec[i], 1), "request %d differs with drafts", i);
        ASSERT_MSG(plain[i].tlen[0] == spec[i].tlen[0] &&
                       memcmp(plain[i].text[0], spec[i].text[0], plain[i].tlen[0]) == 0 &&
                       plain[i].finish[0] == spec[i].finish[0],
                   "request %d: text or finish differs with drafts", i);
        for (size_t k = 0; k < plain[i].n[0]; k++)
            ASSERT_MSG(lp.h[i][k] == ls.h[i][k], "request %d: logits of output %zu differ", i, k);
    }
    printf("    %llu drafts steps, %llu draft tokens, %llu accepted; %zu plain rows, %zu spec\n",
           (unsigned long long)st.spec_drafts, (unsigned long long)st.spec_draft_tokens,
           (unsigned long long)st.spec_accepted_tokens, lp.n_rows, ls.n_rows);
    ASSERT(st.spec_accepted_tokens > 0);
    ASSERT(st.spec_accepted_tokens < st.spec_draft_tokens);
    ASSERT_EQ_INT(st.spec_accepted_per_pos[0] >= st.spec_accepted_per_pos[1], 1);
    ASSERT_EQ_INT(st.kv_blocks_free, st.kv_blocks_total);
    ASSERT_EQ_INT(lp.n_rows, ls.n_rows);
}

/* Pipeline parallelism: vLLM's layer split (and VLLM_PP_LAYER_PARTITION's); a model of 5 layers
 * split into 2, 4 and 5 stages, alone and under TP 2, one batch or micro-batches, gives every
 * request the tokens and the logits (every row's bits) of the unsplit model at the same TP: a
 * stage hands the next the residual stream and the pending sublayer output, so the same
 * operations run, and a row's logits do not depend on its batch. n = 2 copies a shared block on
 * every stage's ranks; every block comes back. */
TEST(engine_pp_matches_pp1)
{
    size_t l0, n;
    static const struct {
        size_t layers;
        int pp;
        size_t want[4]; /* layer counts per stage */
    } split[] = {{22, 4, {5, 6, 6, 5}}, {5, 2, {3, 2}}, {5, 4, {1, 1, 2, 1}}, {8, 3, {3, 3, 2}}};
    for (size_t i = 0; i < sizeof split / sizeof split[0]; i++) {
        size_t at = 0;
        for (int st = 0; st < split[i].pp; st++) {
            ASSERT_OK(pd_engine_pp_layers(split[i].layers, split[i].pp, st, &l0, &n));
            ASSERT_MSG(l0 == at && n == split[i].want[st], "%zu layers, pp %d, stage %d: %zu+%zu",
                       split[i].layers, split[i].pp, st, l0, n);
            at += n;
        }
    }
    ASSERT_ERR(pd_engine_pp_layers(2, 3, 0, &l0, &n), PD_EINVAL, "at most the model's 2 layers");
    setenv("VLLM_PP_LAYER_PARTITION", "1,4", 1);
    ASSERT_OK(pd_engine_pp_layers(5, 2, 1, &l0, &n));
    ASSERT(l0 == 1 && n == 4);
    ASSERT_ERR(pd_engine_pp_layers(5, 3, 0, &l0, &n), PD_EINVAL,
               "VLLM_PP_LAYER_PARTITION=1,4: 2 stage(s) of 5 layers in all");
    setenv("VLLM_PP_LAYER_PARTITION", "2,x", 1);
    ASSERT_ERR(pd_engine_pp_layers(5, 2, 0, &l0, &n), PD_EINVAL, "expected positive layer counts");
    unsetenv("VLLM_PP_LAYER_PARTITION");

    ASSERT_OK(tiny());
    char dir[1100], cmd[4096];
    snprintf(dir, sizeof dir, "%s/tiny5", pdt_tmp_dir());
    snprintf(cmd, sizeof cmd,
             "%s/tools/mkmodel/pd-mkmodel --preset tiny --layers 5 --out %s > /dev/null",
             getenv("PD_BUILD_ROOT"), dir);
    ASSERT_EQ_INT(system(cmd), 0);
    pd_model *m = NULL;
    ASSERT_OK(pd_model_load(dir, &m));
    enum { N = 5 };
    static treq reqs[N];
    static tout ref[MAX_REQ], got[MAX_REQ];
    static logit_hashes lr, lg;
    for (int i = 0; i < N; i++) {
        make_req(&reqs[i], 3 * i + 1, pd_tok_vocab_size(g_tok)); /* greedy and seeded */
        snprintf(reqs[i].id, sizeof reqs[i].id, "req-%d", i);
        reqs[i].sp.max_tokens = 12;
        reqs[i].sp.ignore_eos = true;
    }
    reqs[4].sp.n = 2;
    static const int cfg[][3] = {{1, 2, 0}, {1, 2, 2}, {1, 4, 3}, {1, 5, 5}, {2, 2, 0}, {2, 2, 2}};
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
        pd_engine_params p = base_params();
        p.model = m;
        p.tp_size = cfg[c][0];
        p.on_logits = hash_logits;
        if (c == 0 || cfg[c][0] != cfg[c - 1][0]) { /* the unsplit model at this TP */
            memset(ref, 0, sizeof ref);
            memset(&lr, 0, sizeof lr);
            p.on_logits_ctx = &lr;
            ASSERT_OK(run_alone(&p, reqs, N, ref));
        }
        memset(got, 0, sizeof got);
        memset(&lg, 0, sizeof lg);
        p.pp_size = cfg[c][1];
        p.pp_micro_batches = cfg[c][2];
        p.on_logits_ctx = &lg;
        pd_engine *e;
        ASSERT_OK(pd_engine_create(&p, &e));
        ASSERT_EQ_INT(pd_engine_pp_size(e), cfg[c][1]);
        int rc = PD_OK;
        for (int i = 0; i < N && rc >= 0; i++) rc = add_req(e, &reqs[i], PD_PHASE_FULL);
        if (rc >= 0) rc = run_to_end(e, got);
        pd_engine_stats st;
        pd_engine_get_stats(e, &st);
        pd_engine_free(e);
        ASSERT_OK(rc);
        for (int i = 0; i < N; i++) {
            ASSERT_MSG(same_tokens(&ref[i], &got[i], i == 4 ? 2 : 1),
                       "tp %d pp %d micro %d: request %d differs", cfg[c][0], cfg[c][1], cfg[c][2],
                       i);
            for (size_t k = 0; k < ref[i].n[0]; k++)
                ASSERT_MSG(lr.h[i][k] == lg.h[i][k],
                           "tp %d pp %d micro %d: request %d: logits %zu differ", cfg[c][0],
                           cfg[c][1], cfg[c][2], i, k);
        }
        ASSERT_EQ_INT(lr.n_rows, lg.n_rows);
        ASSERT_EQ_INT(st.kv_blocks_free, st.kv_blocks_total);
    }
    pd_engine_params p = base_params();
    p.model = m;
    p.pp_size = 6;
    pd_engine *e = NULL;
    ASSERT_ERR(pd_engine_create(&p, &e), PD_EINVAL, "pipeline parallel size 6");
    pd_model_free(m);
}

/* Q(a, x), the regularized upper incomplete gamma function (the chi-square survival function
 * is Q(df / 2, chi2 / 2)): its series below a + 1, its continued fraction above. */
static double gamma_q(double a, double x)
{
    if (x <= 0.0) return 1.0;
    double lg = lgamma(a);
    if (x < a + 1.0) {
        double sum = 1.0 / a, term = sum;
        for (int n = 1; n < 1000 && fabs(term) > fabs(sum) * 1e-15; n++) {
            term *= x / (a + n);
            sum += term;
        }
        return 1.0 - sum * exp(-x + a * log(x) - lg);
    }
    double b = x + 1.0 - a, c = 1e300, d = 1.0 / b, h = d;
    for (int i = 1; i < 1000; i++) {
        double an = -i * (i - a);
        b += 2.0;
        d = an * d + b;
        if (fabs(d) < 1e-300) d = 1e-300;
        c = b + an / c;
        if (fabs(c) < 1e-300) c = 1e-300;
        d = 1.0 / d;
        double del = d * c;
        h *= del;
        if (fabs(del - 1.0) < 1e-15) break;
    }
    return exp(-x + a * log(x) - lg) * h;
}

/* Chi-square test of homogeneity of two samples of tokens (counts ca, cb over vocab ids; the
 * ids expected fewer than 5 times in either sample pooled into one category): its p-value. */
static double chi2_same(const uint32_t *ca, const uint32_t *cb, size_t vocab, int *df)
{
    double na = 0, nb = 0;
    for (size_t t = 0; t < vocab; t++) na += ca[t], nb += cb[t];
    double n = na + nb, chi2 = 0, pool_a = 0, pool_b = 0;
    int cats = 0;
    for (size_t t = 0; t <= vocab; t++) {
        double a = t < vocab ? ca[t] : pool_a, b = t < vocab ? cb[t] : pool_b;
        double ea = na * (a + b) / n, eb = nb * (a + b) / n;
        if (a + b == 0) continue;
        if (t < vocab && (ea < 5 || eb < 5)) { /* pooled */
            pool_a += a;
            pool_b += b;
            continue;
        }
        if (t == vocab && (ea < 5 || eb < 5)) break; /* a pool too small to count */
        chi2 += (a - ea) * (a - ea) / ea + (b - eb) * (b - eb) / eb;
        cats++;
    }
    *df = cats - 1;
    return cats > 1 ? gamma_q((cats - 1) / 2.0, chi2 / 2.0) : 1.0;
}

/* Output tokens 1..3 (token 0 is the prefill's, drawn before any draft) of `draws` sampled
 * choices (temperature 0.5, top_k 8) of prompt ids, n = 8 per request, each request its own seed
 * from seed0: counts[pos][token]. spec: with n-gram drafts (3 per step). */
static int sample_counts(const int32_t *prompt, size_t n_prompt, bool spec, int64_t seed0,
                         int draws, uint32_t *counts, size_t vocab, pd_engine_stats *st)
{
    pd_engine_params p = base_params();
    p.max_num_seqs = 8; /* a step of 8 sequences and their drafts stays within 32 rows */
    if (spec) p.spec_num_tokens = 3, p.spec_ngram_max = 3;
    pd_engine *e;
    PD_CHECK(pd_engine_create(&p, &e));
    pd_sampling_params sp = pd_sampling_default_params();
    sp.n = 8;
    sp.temperature = 0.5;
    sp.top_k = 8;
    sp.max_tokens = 4;
    sp.ignore_eos = true;
    sp.has_seed = true;
    int rc = PD_OK;
    for (int q = 0; q * 8 < draws && rc >= 0; q++) {
        char id[32];
        snprintf(id, sizeof id, "stat-%d", q);
        sp.seed = seed0 + q;
        pd_engine_request rq = {
            .request_id = id, .prompt_ids = prompt, .n_prompt = n_prompt, .sampling = &sp};
        rc = pd_engine_add(e, &rq);
        size_t pos[8] = {0};
        while (rc >= 0 && pd_engine_has_work(e)) {
            bool did;
            rc = pd_engine_step(e, &did);
            const pd_engine_event *ev;
            while (rc >= 0 && pd_engine_next_event(e, &ev)) {
                for (size_t k = 0; k < ev->n_tokens && ev->seq_index < 8; k++) {
                    size_t at = pos[ev->seq_index]++;
                    if (at >= 1 && at <= 3) counts[(at - 1) * vocab + (size_t)ev->token_ids[k]]++;
                }
                if (ev->status < 0) rc = pd_error(PD_EINTERNAL, "%s", ev->error);
                pd_engine_event_done(e);
            }
        }
    }
    pd_engine_get_stats(e, st);
    pd_engine_free(e);
    return rc;
}

/* Speculative decoding keeps the sampled distribution (issue 33): 16,000 draws of output tokens
 * 1..3 with n-gram drafts against 16,000 without (other seeds), on a prompt that ends in the
 * random model's own greedy run (whose repeats the drafts follow: about a quarter accepted),
 * chi-square test of homogeneity per position: p > 0.01 each. The seeds are fixed, so the test
 * is deterministic. A verifier that keeps its first draft row even when the sampled token
 * differs gives p = 0 at output token 2 (tried). */
TEST(engine_spec_keeps_the_sampled_distribution)
{
    ASSERT_OK(tiny());
    size_t V = pd_tok_vocab_size(g_tok);
    static treq base;
    make_req(&base, 0, V);
    int32_t prompt[256];
    size_t n_prompt = 6;
    memcpy(prompt, base.prompt, n_prompt * sizeof *prompt);
    /* the prompt: 6 ids and the model's greedy continuation of them, 200 tokens, whose
       repeats the drafts follow */
    base.n_prompt = n_prompt;
    base.sp.temperature = 0.0;
    base.sp.max_tokens = 200;
    base.sp.ignore_eos = true;
    pd_engine_params p = base_params();
    pd_engine *g;
    ASSERT_OK(pd_engine_create(&p, &g));
    int rc = add_req(g, &base, PD_PHASE_FULL);
    while (rc >= 0 && pd_engine_has_work(g)) {
        bool did;
        rc = pd_engine_step(g, &did);
        const pd_engine_event *ev;
        while (rc >= 0 && pd_engine_next_event(g, &ev)) {
            for (size_t k = 0; k < ev->n_tokens && n_prompt < 206; k++)
                prompt[n_prompt++] = ev->token_ids[k];
            pd_engine_event_done(g);
        }
    }
    pd_engine_free(g);
    ASSERT_OK(rc);
    ASSERT_EQ_INT(n_prompt, 206);
    uint32_t *ca = calloc(3 * V, sizeof *ca), *cb = calloc(3 * V, sizeof *cb);
    ASSERT(ca && cb);
    pd_engine_stats sa, sb;
    enum { DRAWS = 16000 };
    ASSERT_OK(sample_counts(prompt, n_prompt, true, 1, DRAWS, ca, V, &sa));
    ASSERT_OK(sample_counts(prompt, n_prompt, false, 1000001, DRAWS, cb, V, &sb));
    printf("    with drafts: %llu draft tokens, %llu accepted\n",
           (unsigned long long)sa.spec_draft_tokens, (unsigned long long)sa.spec_accepted_tokens);
    ASSERT(sa.spec_accepted_tokens > DRAWS / 10);
    ASSERT(sa.spec_draft_tokens - sa.spec_accepted_tokens > DRAWS / 10);
    for (int pos = 0; pos < 3; pos++) {
        int df = 0;
        double pv = chi2_same(ca + (size_t)pos * V, cb + (size_t)pos * V, V, &df);
        printf("    output token %d: chi-square p = %.3f (%d degrees of freedom)\n", pos + 1, pv,
               df);
        ASSERT_MSG(pv > 0.01, "output token %d: p = %g", pos + 1, pv);
        ASSERT(df >= 3);
    }
    free(ca);
    free(cb);
}

/* Runs six requests (one with n = 2) on model m at TP 1 and TP 2: the same logits within
 * 1e-5 relative and the same tokens. */
static void tp2_matches_tp1(pd_model *m)
{
    static treq reqs[6];
    static tout o1[MAX_REQ], o2[MAX_REQ];
    memset(o1, 0, sizeof o1);
    memset(o2, 0, sizeof o2);
    for (int i = 0; i < 6; i++) {
        make_req(&reqs[i], 2 * i, pd_tok_vocab_size(g_tok)); /* greedy */
        snprintf(reqs[i].id, sizeof reqs[i].id, "req-%d", i);
        reqs[i].sp.max_tokens = 16;
        reqs[i].sp.ignore_eos = true;
    }
    reqs[5].sp.n = 2; /* copy-on-write of a shared block on both ranks */
    reqs[5].n_prompt = 40;
    size_t V = (size_t)m->config.vocab_size;
    logit_log l1 = {.rows = malloc(16 * V * sizeof(float)), .max_rows = 16};
    logit_log l2 = {.rows = malloc(16 * V * sizeof(float)), .max_rows = 16};
    ASSERT(l1.rows && l2.rows);
    pd_engine_params p = base_params();
    p.model = m;
    p.on_logits = log_logits;
    p.on_logits_ctx = &l1;
    pd_engine *e;
    int rc = pd_engine_create(&p, &e);
    if (rc >= 0) {
        for (int i = 0; i < 6 && rc >= 0; i++) rc = add_req(e, &reqs[i], PD_PHASE_FULL);
        if (rc >= 0) rc = run_to_end(e, o1);
        pd_engine_free(e);
    }
    p.tp_size = 2;
    p.on_logits_ctx = &l2;
    if (rc >= 0) rc = pd_engine_create(&p, &e);
    if (rc >= 0) {
        if (pd_engine_tp_size(e) != 2) rc = pd_error(PD_EINTERNAL, "tp size not 2");
        for (int i = 0; i < 6 && rc >= 0; i++) rc = add_req(e, &reqs[i], PD_PHASE_FULL);
        if (rc >= 0) rc = run_to_end(e, o2);
        pd_engine_free(e);
    }
    double max_diff = 0.0, max_abs = 0.0;
    for (size_t k = 0; rc >= 0 && k < l1.n_rows * V; k++) {
        double d = fabs((double)l1.rows[k] - (double)l2.rows[k]);
        if (d > max_diff) max_diff = d;
        if (fabs(l1.rows[k]) > max_abs) max_abs = fabs(l1.rows[k]);
    }
    size_t rows1 = l1.n_rows, rows2 = l2.n_rows;
    free(l1.rows);
    free(l2.rows);
    ASSERT_OK(rc);
    ASSERT_EQ_INT(rows1, 16);
    ASSERT_EQ_INT(rows2, 16);
    printf("    tp2 vs tp1: max |logit diff| %.3g (max |logit| %.3g)\n", max_diff, max_abs);
    ASSERT(max_diff <= 1e-5 * (max_abs > 1.0 ? max_abs : 1.0));
    for (int i = 0; i < 6; i++)
        ASSERT_MSG(same_tokens(&o1[i], &o2[i], i == 5 ? 2 : 1), "request %d differs under TP = 2",
                   i);
}

TEST(engine_tp2_matches_tp1)
{
    ASSERT_OK(tiny());
    tp2_matches_tp1(g_model);
}

/* Qwen3's per-head q/k norms (every rank holds the whole norm weights) and a head_dim that is
 * not hidden / heads. The tokenizer is the tiny model's: pd-mkmodel writes the same one. */
TEST(engine_tp2_matches_tp1_qwen3)
{
    ASSERT_OK(tiny());
    char dir[1100], cmd[4096];
    snprintf(dir, sizeof dir, "%s/tiny_qwen3", pdt_tmp_dir());
    snprintf(cmd, sizeof cmd,
             "%s/tools/mkmodel/pd-mkmodel --preset tiny --arch qwen3 --head-dim 48 --out %s "
             "> /dev/null",
             getenv("PD_BUILD_ROOT"), dir);
    ASSERT_EQ_INT(system(cmd), 0);
    pd_model *m = NULL;
    ASSERT_OK(pd_model_load(dir, &m));
    ASSERT(m->config.qk_norm && m->config.head_dim == 48);
    tp2_matches_tp1(m);
    pd_model_free(m);
}

TEST(engine_prefill_then_decode_through_exported_kv)
{
    ASSERT_OK(tiny());
    static treq r;
    static tout full[MAX_REQ], pre[MAX_REQ], dec[MAX_REQ];
    memset(full, 0, sizeof full);
    memset(pre, 0, sizeof pre);
    memset(dec, 0, sizeof dec);
    make_req(&r, 7, pd_tok_vocab_size(g_tok)); /* seeded sampling */
    r.sp.max_tokens = 20;
    r.sp.ignore_eos = true;
    r.sp.has_seed = false; /* the prefill side draws it; the decode side must reuse it */
    pd_engine_params p = base_params();
    p.seed = 99;
    pd_engine *P, *D;
    ASSERT_OK(pd_engine_create(&p, &P));
    p.num_kv_blocks = 100; /* different pool, different block ids */
    ASSERT_OK(pd_engine_create(&p, &D));
    ASSERT_OK(add_req(P, &r, PD_PHASE_PREFILL_ONLY));
    ASSERT_OK(run_to_end(P, pre));
    ASSERT(pre[7].final[0] && pre[7].held);
    ASSERT_EQ_INT(pre[7].n[0], 1);
    ASSERT_EQ_INT(pre[7].n_blocks, (r.n_prompt + 15) / 16);
    pd_engine_stats st;
    pd_engine_get_stats(P, &st);
    ASSERT_EQ_INT(st.num_held, 1);
    ASSERT_EQ_INT(st.kv_blocks_total - st.kv_blocks_free, pre[7].n_blocks);

    int32_t dblocks[64];
    size_t n_dblocks = 0;
    ASSERT_ERR(pd_engine_reserve(D, r.id, r.n_prompt, NULL, dblocks, 0, &n_dblocks, NULL),
               PD_EINVAL, "block ids needed");
    ASSERT_OK(pd_engine_reserve(D, r.id, r.n_prompt, NULL, dblocks, 64, &n_dblocks, NULL));
    ASSERT_EQ_INT(n_dblocks, pre[7].n_blocks);
    ASSERT_ERR(pd_engine_reserve(D, r.id, r.n_prompt, NULL, dblocks, 64, &n_dblocks, NULL),
               PD_EEXIST, "already in use");
    ASSERT_OK(kv_move(P, pre[7].blocks, D, dblocks, n_dblocks));
    ASSERT_ERR(pd_engine_release(P, "nope"), PD_ENOTFOUND, "no held");
    ASSERT_OK(pd_engine_release(P, r.id));
    pd_engine_get_stats(P, &st);
    ASSERT_EQ_INT(st.kv_blocks_free, st.kv_blocks_total);
    ASSERT_EQ_INT(st.num_held, 0);

    treq rd = r;
    rd.sp.has_seed = true;
    rd.sp.seed = (int64_t)pre[7].seed;
    pd_engine_request rq = {.request_id = rd.id,
                            .prompt_ids = rd.prompt,
                            .n_prompt = rd.n_prompt,
                            .sampling = &rd.sp,
                            .phase = PD_PHASE_FULL};
    ASSERT_OK(pd_engine_add_imported(D, &rq, pre[7].toks[0][0]));
    ASSERT_OK(run_to_end(D, dec));
    pd_engine_get_stats(D, &st);
    ASSERT_EQ_INT(st.kv_blocks_free, st.kv_blocks_total);
    /* colocated reference with the same seed */
    ASSERT_OK(run_alone(&p, &rd, 1, full));
    ASSERT_EQ_INT(dec[7].n[0], 20);
    ASSERT(same_tokens(&full[7], &dec[7], 1));
    ASSERT_STR_EQ(dec[7].text[0], full[7].text[0]);
    /* a reservation that is never imported is undone by abort */
    ASSERT_OK(pd_engine_reserve(D, "req-9", 40, NULL, dblocks, 64, &n_dblocks, NULL));
    ASSERT_OK(pd_engine_abort(D, "req-9"));
    ASSERT_OK(run_to_end(D, dec));
    pd_engine_get_stats(D, &st);
    ASSERT_EQ_INT(st.kv_blocks_free, st.kv_blocks_total);
    ASSERT(dec[9].final[0] && dec[9].status[0] == PD_ECANCELLED);
    /* a reservation larger than the free pool is refused */
    pd_engine_free(D);
    p.num_kv_blocks = 16;
    ASSERT_OK(pd_engine_create(&p, &D));
    ASSERT_OK(pd_engine_reserve(D, "req-1", 200, NULL, dblocks, 64, &n_dblocks, NULL));
    ASSERT_ERR(pd_engine_reserve(D, "req-2", 200, NULL, dblocks, 64, &n_dblocks, NULL), PD_EBUSY,
               "KV cache full");
    pd_engine_free(D);
    pd_engine_free(P);
}

/* One PD hand-over, as the nodes do it: r prefilled on P, reserved on D with its prompt ids
 * (*n_cached: the tokens D's prefix cache holds), the KV of the other blocks moved, P's blocks
 * released, r admitted on D with P's seed and first token and run there. */
static int hand_over(pd_engine *P, pd_engine *D, const treq *r, tout *pre, tout *dec,
                     int32_t *dblocks, size_t *n_cached)
{
    int i = req_index(r->id);
    PD_CHECK(add_req(P, r, PD_PHASE_PREFILL_ONLY));
    PD_CHECK(run_to_end(P, pre));
    size_t nb = 0;
    PD_CHECK(pd_engine_reserve(D, r->id, r->n_prompt, r->prompt, dblocks, 64, &nb, n_cached));
    size_t skip = *n_cached / 16;
    if (nb != pre[i].n_blocks || skip >= nb)
        return pd_error(PD_EINTERNAL, "%zu blocks reserved, %zu cached, %zu prefilled", nb, skip,
                        pre[i].n_blocks);
    PD_CHECK(kv_move(P, pre[i].blocks + skip, D, dblocks + skip, nb - skip));
    PD_CHECK(pd_engine_release(P, r->id));
    treq rd = *r;
    rd.sp.has_seed = true;
    rd.sp.seed = (int64_t)pre[i].seed;
    pd_engine_request rq = {.request_id = rd.id,
                            .prompt_ids = rd.prompt,
                            .n_prompt = rd.n_prompt,
                            .sampling = &rd.sp,
                            .phase = PD_PHASE_FULL};
    PD_CHECK(pd_engine_add_imported(D, &rq, pre[i].toks[0][0]));
    return run_to_end(D, dec);
}

/* The decode side's prefix cache: a reservation with the prompt's ids starts with the cached
 * blocks of an earlier request's prompt (imported, then decoded there), only the other blocks'
 * KV moves, and the tokens equal a colocated run's; an import whose prompt differs from the
 * reserved one in the cached tokens is refused. */
TEST(engine_decode_reservation_takes_cached_prefix)
{
    ASSERT_OK(tiny());
    static treq a, b;
    static tout pre[MAX_REQ], dec[MAX_REQ], full[MAX_REQ];
    memset(pre, 0, sizeof pre);
    memset(dec, 0, sizeof dec);
    memset(full, 0, sizeof full);
    size_t vocab = pd_tok_vocab_size(g_tok);
    make_req(&a, 2, vocab); /* greedy */
    a.n_prompt = 40;
    for (size_t k = 0; k < a.n_prompt; k++) a.prompt[k] = (int32_t)(3 + (k * 37) % (vocab - 3));
    a.sp.max_tokens = 12;
    a.sp.ignore_eos = true;
    b = a; /* the same first 40 tokens, then 10 more */
    snprintf(b.id, sizeof b.id, "req-4");
    b.n_prompt = 50;
    for (size_t k = 40; k < b.n_prompt; k++) b.prompt[k] = (int32_t)(5 + k);
    pd_engine_params p = base_params();
    pd_engine *P, *D;
    ASSERT_OK(pd_engine_create(&p, &P));
    p.num_kv_blocks = 100; /* other block ids than P's */
    ASSERT_OK(pd_engine_create(&p, &D));
    int32_t da[64], db[64];
    size_t ca = 99, cb = 0;
    ASSERT_OK(hand_over(P, D, &a, pre, dec, da, &ca));
    ASSERT_EQ_INT(ca, 0);
    ASSERT_OK(hand_over(P, D, &b, pre, dec, db, &cb));
    /* a's blocks 0 and 1 (tokens 0-31); block 2 holds a's generated tokens from 40 on */
    ASSERT_EQ_INT(cb, 32);
    ASSERT_EQ_INT(db[0], da[0]);
    ASSERT_EQ_INT(db[1], da[1]);
    pd_engine_stats st;
    pd_engine_get_stats(D, &st);
    ASSERT_EQ_INT(st.prefix_cache_queries, 90);
    ASSERT_EQ_INT(st.prefix_cache_hits, 32);
    treq both[2] = {a, b};
    ASSERT_OK(run_alone(&p, both, 2, full));
    ASSERT(same_tokens(&full[2], &dec[2], 1));
    ASSERT(same_tokens(&full[4], &dec[4], 1));
    ASSERT_STR_EQ(dec[4].text[0], full[4].text[0]);

    /* reserved with b's ids, imported with other first tokens: refused, then undone */
    int32_t dc[64];
    size_t n = 0, cc = 0;
    ASSERT_OK(pd_engine_reserve(D, "req-6", b.n_prompt, b.prompt, dc, 64, &n, &cc));
    ASSERT_EQ_INT(cc, 48); /* b's third block too, now */
    treq c = b;
    snprintf(c.id, sizeof c.id, "req-6");
    c.prompt[3] ^= 1;
    c.sp.has_seed = true;
    pd_engine_request rq = {.request_id = c.id,
                            .prompt_ids = c.prompt,
                            .n_prompt = c.n_prompt,
                            .sampling = &c.sp,
                            .phase = PD_PHASE_FULL};
    ASSERT_ERR(pd_engine_add_imported(D, &rq, 7), PD_EINVAL, "prompt differs");
    ASSERT_OK(pd_engine_abort(D, "req-6"));
    ASSERT_OK(run_to_end(D, dec));
    pd_engine_get_stats(D, &st);
    ASSERT_EQ_INT(st.kv_blocks_free, st.kv_blocks_total);
    pd_engine_free(D);
    pd_engine_free(P);
}

TEST(engine_stop_string_stop_id_length_logprobs_and_seedless)
{
    ASSERT_OK(tiny());
    static treq r;
    static tout o[MAX_REQ], s[MAX_REQ];
    memset(o, 0, sizeof o);
    memset(s, 0, sizeof s);
    make_req(&r, 2, pd_tok_vocab_size(g_tok)); /* greedy */
    ASSERT(r.n_prompt < 200);
    r.sp.ignore_eos = true;
    r.sp.max_tokens = 30;
    r.sp.logprobs = 3;
    pd_engine_params p = base_params();
    ASSERT_OK(run_alone(&p, &r, 1, o));
    ASSERT_EQ_INT(o[2].n_logprob_events, 30);
    /* stop at a piece of the middle of the text */
    size_t len = o[2].tlen[0];
    ASSERT(len > 12);
    char stop[8];
    memcpy(stop, o[2].text[0] + len / 2, 4);
    stop[4] = '\0';
    r.stop[0] = stop;
    r.sp.stop = r.stop;
    r.sp.n_stop = 1;
    ASSERT_OK(run_alone(&p, &r, 1, s));
    ASSERT_EQ_INT(s[2].finish[0], PD_FINISH_STOP);
    ASSERT_EQ_INT(s[2].stop_kind[0], PD_STOP_REASON_STRING);
    ASSERT_STR_EQ(s[2].stop_string[0], stop);
    const char *hit = strstr(o[2].text[0], stop);
    ASSERT(hit);
    ASSERT_EQ_INT(s[2].tlen[0], (size_t)(hit - o[2].text[0])); /* text ends before the match */
    ASSERT(strncmp(s[2].text[0], o[2].text[0], s[2].tlen[0]) == 0);
    /* a stop token id: the 3rd token of the plain run ends it (with its token counted) */
    int32_t stop_id = o[2].toks[0][2];
    int first = 0;
    while (o[2].toks[0][first] != stop_id) first++;
    static tout t[MAX_REQ];
    memset(t, 0, sizeof t);
    r.sp.n_stop = 0;
    r.sp.stop_token_ids = &stop_id;
    r.sp.n_stop_token_ids = 1;
    ASSERT_OK(run_alone(&p, &r, 1, t));
    ASSERT_EQ_INT(t[2].finish[0], PD_FINISH_STOP);
    ASSERT_EQ_INT(t[2].stop_kind[0], PD_STOP_REASON_TOKEN);
    ASSERT_EQ_INT(t[2].n[0], first + 1);
    ASSERT_EQ_INT(t[2].completion[0], first + 1);
    /* the context length ends a request without max_tokens: P + output = max_model_len */
    memset(t, 0, sizeof t);
    r.sp.n_stop_token_ids = 0;
    r.sp.max_tokens = -1;
    r.sp.logprobs = -1;
    for (size_t k = r.n_prompt; k < 250; k++) r.prompt[k] = (int32_t)(3 + k);
    r.n_prompt = 250;
    ASSERT_OK(run_alone(&p, &r, 1, t));
    ASSERT_EQ_INT(t[2].finish[0], PD_FINISH_LENGTH);
    ASSERT_EQ_INT(t[2].n[0], 256 - 250);
    /* without a seed, an engine seed makes runs repeatable */
    r.sp = pd_sampling_default_params();
    r.sp.max_tokens = 10;
    r.sp.ignore_eos = true;
    p.seed = 5;
    static tout a[MAX_REQ], b[MAX_REQ];
    memset(a, 0, sizeof a);
    memset(b, 0, sizeof b);
    ASSERT_OK(run_alone(&p, &r, 1, a));
    ASSERT_OK(run_alone(&p, &r, 1, b));
    ASSERT(same_tokens(&a[2], &b[2], 1));
}

/* ---- prompt logprobs ------------------------------------------------------------------------ */

/* The reference: the prompt's logits row by row from a forward pass of its own (one chunk,
 * every row out) on a CPU backend, and their log_softmax in double. */
static int ref_prompt_logits(const int32_t *ids, size_t n, float **logits, size_t *vocab)
{
    pd_backend_params bp = pd_backend_default_params();
    bp.n_threads = 2;
    pd_backend *b = NULL;
    pd_forward *f = NULL;
    pd_kv *kv = NULL;
    PD_CHECK(pd_backend_cpu_create(&bp, &b));
    pd_forward_params fp = pd_forward_default_params();
    fp.max_tokens = n;
    fp.max_out = n;
    int rc = pd_forward_create(b, g_model, &fp, &f);
    size_t nb = (n + 15) / 16;
    pd_kv_params kp = rc < 0 ? (pd_kv_params){0} : pd_forward_kv_params(f, nb, 16);
    if (rc >= 0) rc = pd_backend_get_ops(b)->kv_create(b, &kp, &kv);
    int32_t q[2] = {0, (int32_t)n}, kvlen = (int32_t)n, bi[2] = {0, (int32_t)nb}, blocks[64],
            rows[256];
    for (size_t i = 0; i < nb; i++) blocks[i] = (int32_t)i;
    for (size_t i = 0; i < n; i++) rows[i] = (int32_t)i;
    pd_step st = {.n_seqs = 1,
                  .token_ids = ids,
                  .q_indptr = q,
                  .kv_len = &kvlen,
                  .block_indptr = bi,
                  .block_ids = blocks,
                  .n_out = n,
                  .out_rows = rows};
    if (rc >= 0) *vocab = pd_forward_vocab(f);
    if (rc >= 0 && !(*logits = malloc(n * *vocab * sizeof(float)))) rc = PD_ENOMEM;
    if (rc >= 0) rc = pd_forward_run(f, kv, &st, *logits);
    if (kv) pd_backend_get_ops(b)->kv_free(b, kv);
    pd_forward_free(f);
    pd_backend_free(b);
    return rc;
}

/* Checks plp (k top entries) against log_softmax of the reference rows: position i's values
 * come from row i - 1. */
static int check_prompt_logprobs(const pd_prompt_logprobs *plp, const int32_t *ids, size_t n,
                                 const float *ref, size_t V, int32_t k)
{
    if (!plp || plp->n_prompt != n || plp->n_top != k)
        return pd_error(PD_EINTERNAL, "prompt logprobs missing or of the wrong size");
    for (size_t i = 1; i < n; i++) {
        const float *row = ref + (i - 1) * V;
        double mx = row[0], sum = 0.0;
        for (size_t v = 1; v < V; v++) mx = row[v] > mx ? row[v] : mx;
        for (size_t v = 0; v < V; v++) sum += exp((double)row[v] - mx);
        double lse = mx + log(sum);
        int32_t rank = 0;
        for (size_t v = 0; v < V; v++) rank += row[v] >= row[ids[i]];
        if (fabs(plp->logprob[i] - ((double)row[ids[i]] - lse)) > 1e-4 || plp->rank[i] != rank)
            return pd_error(PD_EINTERNAL, "position %zu: logprob %g rank %d, reference %g rank %d",
                            i, plp->logprob[i], plp->rank[i], (double)row[ids[i]] - lse, rank);
        bool used[4096] = {false};
        for (int32_t j = 0; j < k; j++) { /* the j-th largest logit, lower id on ties */
            size_t best = V;
            for (size_t v = 0; v < V; v++)
                if (!used[v] && (best == V || row[v] > row[best])) best = v;
            used[best] = true;
            int32_t id = plp->top_ids[i * (size_t)k + (size_t)j];
            double lp = plp->top_logprobs[i * (size_t)k + (size_t)j];
            if (id != (int32_t)best || fabs(lp - ((double)row[best] - lse)) > 1e-4)
                return pd_error(PD_EINTERNAL, "position %zu top %d: id %d (%g), reference %zu (%g)",
                                i, j, id, lp, best, (double)row[best] - lse);
        }
    }
    return PD_OK;
}

/* Runs r on e to the end; *plp receives a copy of the prompt logprobs its events carried (NULL
 * when none), *n_plp how many events carried them, *cached the first event's cached tokens. */
static int run_plp(pd_engine *e, const treq *r, pd_engine_phase phase, pd_prompt_logprobs **plp,
                   int *n_plp, size_t *cached)
{
    *plp = NULL;
    *n_plp = 0;
    PD_CHECK(add_req(e, r, phase));
    for (int it = 0; it < 10000 && pd_engine_has_work(e); it++) {
        bool did;
        PD_CHECK(pd_engine_step(e, &did));
        const pd_engine_event *ev;
        while (pd_engine_next_event(e, &ev)) {
            if (ev->status < 0) return pd_error(ev->status, "%s", ev->error);
            if (ev->n_tokens && ev->completion_tokens == 1 && ev->seq_index == 0)
                *cached = ev->cached_tokens;
            const pd_prompt_logprobs *p = ev->prompt_logprobs;
            if (p && ++*n_plp == 1) {
                size_t nt = (size_t)p->n_top, bytes = p->n_prompt * (1 + nt) * 8;
                pd_prompt_logprobs *c = malloc(sizeof *c + bytes);
                *c = *p;
                c->logprob = (float *)(c + 1);
                c->rank = (int32_t *)(c->logprob + p->n_prompt);
                c->top_ids = c->rank + p->n_prompt;
                c->top_logprobs = (float *)(c->top_ids + p->n_prompt * nt);
                memcpy(c->logprob, p->logprob, p->n_prompt * sizeof(float));
                memcpy(c->rank, p->rank, p->n_prompt * sizeof(int32_t));
                memcpy(c->top_ids, p->top_ids, p->n_prompt * nt * sizeof(int32_t));
                memcpy(c->top_logprobs, p->top_logprobs, p->n_prompt * nt * sizeof(float));
                *plp = c;
            }
            pd_engine_event_done(e);
        }
    }
    if (phase == PD_PHASE_PREFILL_ONLY) PD_CHECK(pd_engine_release(e, r->id));
    return PD_OK;
}

/* prompt_logprobs equal log_softmax of the model's logits for every prompt row, with chunked
 * prefill and a small per-step row budget, without the prefix cache (its cached blocks would have
 * no logits), for n = 2 (choice 0's first event carries them) and on the prefill-only path
 * (the same bits as the colocated run). */
TEST(engine_prompt_logprobs_equal_reference)
{
    ASSERT_OK(tiny());
    static treq r;
    make_req(&r, 0, pd_tok_vocab_size(g_tok));
    r.n_prompt = 70; /* 4 full blocks + 6: the first run caches them */
    for (size_t i = 0; i < r.n_prompt; i++) r.prompt[i] = (int32_t)(3 + (i * 37) % 200);
    r.sp.max_tokens = 3;
    float *ref = NULL;
    size_t V = 0;
    ASSERT_OK(ref_prompt_logits(r.prompt, r.n_prompt, &ref, &V));
    ASSERT(V <= 4096);
    pd_engine_params p = base_params();
    p.enable_prefix_caching = true;
    p.max_prefill_chunk = 9;
    p.prompt_logprob_rows = 4; /* 70 rows take many steps */
    pd_engine *e;
    ASSERT_OK(pd_engine_create(&p, &e));
    pd_prompt_logprobs *plp = NULL, *held = NULL;
    int n_plp = 0;
    size_t cached = 99;
    pd_engine_stats st;
    ASSERT_OK(run_plp(e, &r, PD_PHASE_FULL, &plp, &n_plp, &cached)); /* caches the prompt */
    ASSERT(plp == NULL && n_plp == 0);
    snprintf(r.id, sizeof r.id, "req-1");
    r.sp.prompt_logprobs = 5;
    r.sp.n = 2;
    ASSERT_OK(run_plp(e, &r, PD_PHASE_FULL, &plp, &n_plp, &cached));
    ASSERT_EQ_INT(n_plp, 1);
    pd_engine_get_stats(e, &st);
    ASSERT_EQ_INT(st.prefix_cache_hits, 0); /* the cached prefix was not taken */
    ASSERT_OK(check_prompt_logprobs(plp, r.prompt, r.n_prompt, ref, V, 5));
    /* without prompt logprobs the same prompt takes the cache */
    snprintf(r.id, sizeof r.id, "req-2");
    r.sp.prompt_logprobs = -1;
    r.sp.n = 1;
    pd_prompt_logprobs *none = NULL;
    ASSERT_OK(run_plp(e, &r, PD_PHASE_FULL, &none, &n_plp, &cached));
    pd_engine_get_stats(e, &st);
    ASSERT_EQ_INT(st.prefix_cache_hits, 64);
    ASSERT(none == NULL);
    /* prefill-only (the split path): the hand-over event carries the same values */
    snprintf(r.id, sizeof r.id, "req-3");
    r.sp.prompt_logprobs = 5;
    ASSERT_OK(run_plp(e, &r, PD_PHASE_PREFILL_ONLY, &held, &n_plp, &cached));
    ASSERT_EQ_INT(n_plp, 1);
    ASSERT_EQ_INT(cached, 0);
    ASSERT(held != NULL);
    ASSERT(memcmp(held->logprob + 1, plp->logprob + 1, (r.n_prompt - 1) * sizeof(float)) == 0);
    ASSERT(memcmp(held->top_ids, plp->top_ids, r.n_prompt * 5 * sizeof(int32_t)) == 0);
    /* above --max-logprobs: vLLM's words */
    r.sp.prompt_logprobs = 21;
    snprintf(r.id, sizeof r.id, "req-4");
    ASSERT_ERR(add_req(e, &r, PD_PHASE_FULL), PD_EINVAL,
               "Requested prompt logprobs of 21, which is greater than max allowed: 20");
    pd_engine_free(e);
    free(plp);
    free(held);
    free(ref);
}

/* ---- the engine thread -------------------------------------------------------------------- */

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int wakeups;
} waker;

static void on_event(void *ctx)
{
    waker *w = ctx;
    pthread_mutex_lock(&w->mu);
    w->wakeups++;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

TEST(engine_thread_streams_events)
{
    ASSERT_OK(tiny());
    static treq reqs[16];
    static tout alone[MAX_REQ], th[MAX_REQ];
    memset(alone, 0, sizeof alone);
    memset(th, 0, sizeof th);
    for (int i = 0; i < 16; i++) make_req(&reqs[i], i, pd_tok_vocab_size(g_tok));
    pd_engine_params p = base_params();
    ASSERT_OK(run_alone(&p, reqs, 16, alone));
    waker w = {.wakeups = 0};
    pthread_mutex_init(&w.mu, NULL);
    pthread_cond_init(&w.cv, NULL);
    p.on_event = on_event;
    p.on_event_ctx = &w;
    p.event_capacity = 80; /* small: the thread waits for the consumer */
    pd_engine *e;
    ASSERT_OK(pd_engine_create(&p, &e));
    ASSERT_OK(pd_engine_start(e));
    ASSERT_ERR(pd_engine_step(e, NULL), PD_EBUSY, "already running");
    for (int i = 0; i < 16; i++) ASSERT_OK(add_req(e, &reqs[i], PD_PHASE_FULL));
    int finals = 0, rc = PD_OK;
    for (int spins = 0; finals < 16 && spins < 20000 && rc >= 0; spins++) {
        pthread_mutex_lock(&w.mu);
        if (w.wakeups == 0) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 10 * 1000 * 1000;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&w.cv, &w.mu, &ts);
        }
        w.wakeups = 0;
        pthread_mutex_unlock(&w.mu);
        rc = drain(e, th);
        finals = 0;
        for (int i = 0; i < 16; i++) finals += th[i].final[0];
    }
    pd_engine_stop(e);
    pd_engine_free(e);
    pthread_mutex_destroy(&w.mu);
    pthread_cond_destroy(&w.cv);
    ASSERT_OK(rc);
    ASSERT_EQ_INT(finals, 16);
    for (int i = 0; i < 16; i++) ASSERT(same_tokens(&alone[i], &th[i], 1));
}

/* ---- errors ------------------------------------------------------------------------------- */

TEST(engine_bad_parameters_vllm_wording)
{
    ASSERT_OK(tiny());
    pd_engine *e = NULL;
    pd_engine_params p = base_params();
    p.max_num_batched_tokens = 100;
    p.max_model_len = 256;
    ASSERT_ERR(pd_engine_create(&p, &e), PD_EINVAL,
               "max_num_batched_tokens (100) is smaller than max_model_len (256).");
    p = base_params();
    p.num_kv_blocks = 15; /* 240 tokens < 256 */
    ASSERT_ERR(pd_engine_create(&p, &e), PD_EINVAL,
               "The model's max seq len (256) is larger than the maximum number of tokens that "
               "can be stored in KV cache (240).");
    p = base_params();
    p.max_model_len = 100000;
    p.max_num_batched_tokens = 100000;
    ASSERT_ERR(pd_engine_create(&p, &e), PD_EINVAL,
               "User-specified max_model_len (100000) is greater than the derived max_model_len");
    /* a sliding window caps the context: attention here is not windowed */
    pd_model windowed = *g_model;
    windowed.config.sliding_window = 128;
    p = base_params();
    p.model = &windowed;
    ASSERT_ERR(pd_engine_create(&p, &e), PD_EINVAL,
               "User-specified max_model_len (256) is greater than the derived max_model_len "
               "(sliding_window=128 in model's config.json; attention is not windowed here, so "
               "the context stops at the window).");
    p.max_model_len = 0;
    ASSERT_OK(pd_engine_create(&p, &e));
    size_t len = pd_engine_max_model_len(e);
    pd_engine_free(e);
    e = NULL;
    ASSERT_EQ_INT(len, 128);
    p = base_params();
    p.tp_size = 3;
    ASSERT_ERR(pd_engine_create(&p, &e), PD_EINVAL,
               "Total number of attention heads (4) must be divisible by tensor parallel size "
               "(3).");
    p = base_params();
    p.max_num_seqs = 1024;
    ASSERT_ERR(pd_engine_create(&p, &e), PD_EINVAL,
               "max_num_batched_tokens (512) must be greater than or equal to max_num_seqs");
    ASSERT(e == NULL);

    p = base_params();
    p.max_num_seqs = 8;
    ASSERT_OK(pd_engine_create(&p, &e));
    treq r;
    make_req(&r, 0, pd_tok_vocab_size(g_tok));
    r.n_prompt = 200;
    pd_engine_params q = p;
    (void)q;
    ASSERT_OK(add_req(e, &r, PD_PHASE_FULL));
    ASSERT_ERR(add_req(e, &r, PD_PHASE_FULL), PD_EEXIST, "already in use");
    snprintf(r.id, sizeof r.id, "req-1");
    int32_t big[256] = {0};
    pd_engine_request rq = {
        .request_id = "req-2", .prompt_ids = big, .n_prompt = 256, .sampling = &r.sp};
    ASSERT_ERR(pd_engine_add(e, &rq), PD_EINVAL,
               "This model's maximum context length is 256 tokens. However, your request has "
               "256 input tokens. Please reduce the length of the input messages.");
    rq.n_prompt = 0;
    ASSERT_ERR(pd_engine_add(e, &rq), PD_EINVAL, "The decoder prompt cannot be empty");
    rq.n_prompt = 3;
    big[1] = 1 << 20;
    ASSERT_ERR(pd_engine_add(e, &rq), PD_EINVAL, "Token id 1048576 is out of vocabulary");
    big[1] = 5;
    pd_sampling_params sp = r.sp;
    sp.n = 9;
    rq.sampling = &sp;
    ASSERT_ERR(pd_engine_add(e, &rq), PD_EINVAL, "n must be at most 8, got 9.");
    sp.n = 1;
    sp.logprobs = 21;
    ASSERT_ERR(pd_engine_add(e, &rq), PD_EINVAL,
               "Requested sample logprobs of 21, which is greater than max allowed: 20");
    sp.logprobs = -1;
    sp.top_p = 1.5;
    ASSERT_ERR(pd_engine_add(e, &rq), PD_EINVAL, "top_p must be in (0, 1], got 1.5.");
    sp.top_p = 1.0;
    sp.n = 2;
    rq.phase = PD_PHASE_PREFILL_ONLY;
    ASSERT_ERR(pd_engine_add(e, &rq), PD_EUNSUPPORTED, "prefill-only");
    rq.phase = PD_PHASE_FULL;
    ASSERT_ERR(pd_engine_add_imported(e, &rq, 5), PD_EINVAL, "seed");
    pd_engine_free(e); /* with a request still queued: freed, no leak */
}

/* CUDA devices: refused with a clear error where no GPU can serve (a build without the CUDA
 * backend, or no usable device); bad combinations are refused before anything is allocated. */
TEST(engine_cuda_device_errors)
{
    ASSERT_OK(tiny());
    pd_engine_params p = base_params();
    pd_engine *e = NULL;
    p.n_cuda_devices = 1;
    p.cuda_devices[0] = 0;
    int rc = pd_engine_create(&p, &e);
    if (rc == PD_OK) { /* a machine with a GPU and a CUDA build: that path is tests/gpu's */
        pd_engine_free(e);
    } else {
        ASSERT(rc == PD_EUNSUPPORTED || rc == PD_ENOTFOUND);
        ASSERT_CONTAINS(pd_last_error(), "CUDA");
    }
    p.n_cuda_devices = 2; /* != tp_size */
    ASSERT(pd_engine_create(&p, &e) < 0);
    p.n_cuda_devices = 17;
    ASSERT_ERR(pd_engine_create(&p, &e), PD_EINVAL, "n_cuda_devices must be 0 to 16");
}

/* A decode engine whose pool is filled by imported prompts (each waiting with its KV, none able
 * to take the block for its next token): the youngest give their KV up and recompute it, and
 * every request's tokens equal the colocated run's. Regression: nothing ran again. */
TEST(engine_imports_filling_the_pool_recompute_and_match)
{
    ASSERT_OK(tiny());
    enum { N = 6 };
    static treq r[N];
    static tout full[MAX_REQ], pre[MAX_REQ], dec[MAX_REQ];
    memset(full, 0, sizeof full);
    memset(pre, 0, sizeof pre);
    memset(dec, 0, sizeof dec);
    pd_engine_params p = base_params();
    pd_engine *P, *D;
    ASSERT_OK(pd_engine_create(&p, &P));
    p.num_kv_blocks = 2 * N; /* each 32-token prompt fills two blocks: the pool, exactly */
    p.max_model_len = 64;
    ASSERT_OK(pd_engine_create(&p, &D));
    for (int i = 0; i < N; i++) {
        make_req(&r[i], i, pd_tok_vocab_size(g_tok));
        r[i].n_prompt = 32;
        r[i].sp.max_tokens = 12;
        r[i].sp.ignore_eos = true;
        r[i].sp.has_seed = true;
        r[i].sp.seed = 500 + i;
        ASSERT_OK(add_req(P, &r[i], PD_PHASE_PREFILL_ONLY));
    }
    ASSERT_OK(run_to_end(P, pre));
    for (int i = 0; i < N; i++) {
        ASSERT(pre[i].held && pre[i].n_blocks == 2);
        int32_t dblocks[2];
        size_t nb = 0;
        ASSERT_OK(pd_engine_reserve(D, r[i].id, 32, NULL, dblocks, 2, &nb, NULL));
        ASSERT_OK(kv_move(P, pre[i].blocks, D, dblocks, nb));
        ASSERT_OK(pd_engine_release(P, r[i].id));
        pd_engine_request rq = {.request_id = r[i].id,
                                .prompt_ids = r[i].prompt,
                                .n_prompt = 32,
                                .sampling = &r[i].sp,
                                .phase = PD_PHASE_FULL};
        ASSERT_OK(pd_engine_add_imported(D, &rq, pre[i].toks[0][0]));
    }
    pd_engine_stats st;
    pd_engine_get_stats(D, &st);
    ASSERT_EQ_INT(st.kv_blocks_free, 0);
    ASSERT_OK(run_to_end(D, dec));
    pd_engine_get_stats(D, &st);
    ASSERT_EQ_INT(st.kv_blocks_free, st.kv_blocks_total);
    ASSERT(st.num_preemptions > 0);
    printf("    %d imports on a %d-block pool: %llu preemptions\n", N, 2 * N,
           (unsigned long long)st.num_preemptions);
    p.num_kv_blocks = 0;
    ASSERT_OK(run_alone(&p, r, N, full));
    for (int i = 0; i < N; i++) {
        ASSERT_EQ_INT(dec[i].n[0], 12);
        ASSERT_MSG(same_tokens(&full[i], &dec[i], 1), "request %d differs from colocated", i);
    }
    pd_engine_free(D);
    pd_engine_free(P);
}

/* The warm-up (vLLM's dummy run) leaves nothing behind but the K/V it wrote into free blocks:
 * no step, token or cached block in the statistics, every block free, and requests that then
 * take those very blocks give the tokens a fresh engine gives. It runs max(16, max_num_seqs)
 * tokens by default, within max_model_len - 1, and only before the first request. */
TEST(engine_warmup_leaves_no_trace)
{
    ASSERT_OK(tiny());
    enum { N = 8 };
    static treq r[N];
    static tout warm[MAX_REQ], cold[MAX_REQ];
    memset(warm, 0, sizeof warm);
    memset(cold, 0, sizeof cold);
    for (int i = 0; i < N; i++) make_req(&r[i], i, pd_tok_vocab_size(g_tok));
    pd_engine_params p = base_params();
    pd_engine *e;
    ASSERT_OK(pd_engine_create(&p, &e));
    size_t n = 0;
    ASSERT_OK(pd_engine_warmup(e, 0, &n));
    ASSERT_EQ_INT(n, 64); /* max(16, max_num_seqs) */
    pd_engine_stats st;
    pd_engine_get_stats(e, &st);
    ASSERT_EQ_INT(st.steps, 0);
    ASSERT_EQ_INT(st.prompt_tokens, 0);
    ASSERT_EQ_INT(st.generation_tokens, 0);
    ASSERT_EQ_INT(st.kv_blocks_cached, 0);
    ASSERT_EQ_INT(st.kv_blocks_free, st.kv_blocks_total);
    ASSERT_OK(pd_engine_warmup(e, 100000, &n)); /* capped: max_model_len 256 - 1 */
    ASSERT_EQ_INT(n, 255);
    for (int i = 0; i < N; i++) { /* one at a time: each starts at block 0, which holds junk */
        ASSERT_OK(add_req(e, &r[i], PD_PHASE_FULL));
        if (i == 0) ASSERT_ERR(pd_engine_warmup(e, 0, NULL), PD_EBUSY, "before the first request");
        ASSERT_OK(run_to_end(e, warm));
    }
    pd_engine_free(e);
    ASSERT_OK(run_alone(&p, r, N, cold));
    for (int i = 0; i < N; i++)
        ASSERT_MSG(same_tokens(&warm[i], &cold[i], 1), "request %d differs after the warm-up", i);
}

/* The CPU KV pool's size (vLLM's rule): the budget per rank is kv_cache_bytes, else
 * cpu_kvcache_space_gib (VLLM_CPU_KVCACHE_SPACE, 4 GiB by default), cut to what the workload
 * can hold at once: max_num_seqs sequences of max_model_len tokens, or max_kv_tokens, but never
 * below one sequence of max_model_len. */
TEST(engine_cpu_kv_pool_sized_by_need)
{
    ASSERT_OK(tiny());
    pd_engine_params p = base_params(); /* 64 sequences of 256 tokens: 16 blocks each */
    p.num_kv_blocks = 0;
    struct {
        double gib;
        size_t bytes, max_kv_tokens, blocks;
    } cases[] = {
        {0, 0, 0, 64 * 16}, /* 4 GiB hold far more than 64 x 256 tokens */
        {PD_ENGINE_CPU_KVCACHE_SPACE_GIB, 0, 0, 64 * 16},
        {1.0 / 1024, 0, 0, 32},     /* 1 MiB of 32 KiB blocks */
        {0, 40 * 32768 + 5, 0, 40}, /* --kv-cache-bytes wins */
        {1.0 / 1024, 40 * 32768, 0, 40},
        {0, 0, 1000, 63}, /* the run's need: ceil(1000 / 16) blocks */
        {0, 0, 100, 16},  /* but one max_model_len sequence at least */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        p.cpu_kvcache_space_gib = cases[i].gib;
        p.kv_cache_bytes = cases[i].bytes;
        p.max_kv_tokens = cases[i].max_kv_tokens;
        pd_engine *e;
        ASSERT_OK(pd_engine_create(&p, &e));
        pd_engine_stats st;
        pd_engine_get_stats(e, &st);
        ASSERT_MSG(st.kv_blocks_total == cases[i].blocks, "case %zu: %zu blocks, expected %zu", i,
                   st.kv_blocks_total, cases[i].blocks);
        pd_engine_free(e);
    }
    p.cpu_kvcache_space_gib = 2e6;
    pd_engine *e;
    ASSERT_ERR(pd_engine_create(&p, &e), PD_EINVAL, "cpu_kvcache_space_gib");
}
