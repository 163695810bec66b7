/* The engine (engine.h): requests -> scheduled steps -> forward on every TP rank -> sampling,
 * incremental detokenization, stop checks -> events.
 *
 * Threads and locks:
 *   - e->mu guards the scheduler, the KV block pool, the request table and the inbox. The engine
 *     thread holds it while it schedules and while it commits and processes a step's results,
 *     never during the forward pass. Callers (add, abort, release, reserve, import) take it
 *     briefly. Aborts and imports are queued in the inbox and applied by the engine thread at a
 *     step boundary, so a sequence is never freed while a step in flight refers to it; adds and
 *     reservations only append to the waiting queue or take free blocks, which a step in flight
 *     never looks at, so they apply at once.
 *   - The output queue has its own mutex (qmu): one producer (the engine thread), one consumer.
 *   - Tensor-parallel ranks 1..t-1 run on their own threads, started per step through a
 *     generation counter (rmu/rcv) and joined the same way; their allreduce meets in a
 *     barrier that a failing rank can break so no rank waits forever.
 *   - All-reduce: on CUDA with every rank on its own GPU, NCCL (pd_nccl.h: ncclAllReduce in
 *     place on each rank's stream, no host round trip); otherwise (CPU, or ranks sharing a GPU,
 *     which NCCL refuses unless pd_nccl_multi_rank_gpu) the host-staged sum below. A rank that fails mid-step under NCCL
 *     cannot break a barrier: it gives the others RANK_FAIL_WAIT_MS to finish, then aborts the
 *     communicators so their waits end (the instance then refuses further steps).
 */
#include "engine/engine.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "backend/forward.h"
#include "pd_config.h"
#if PD_HAVE_CUDA
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/pd_nccl.h"
#endif
#include "engine/kvpool.h"
#include "engine/rng.h"
#include "engine/sched.h"
#include "util/arena.h"
#include "util/clock.h"
#include "util/log.h"
#include "util/status.h"
#include "util/threadpool.h"

#define REQ_BUCKETS       4096 /* request table: chained hash buckets */
#define RANK_FAIL_WAIT_MS 2000 /* NCCL: how long a failed rank waits for the others to finish */

/* ---- requests and sequences ------------------------------------------------------------------ */

typedef struct eng_req eng_req;

typedef struct {
    eng_req *req;
    uint32_t index;   /* choice index */
    pd_sched_seq *sq; /* NULL for a child not forked yet */
    pd_sampler_seq *smp;
    pd_stop *stop;
    pd_detok *detok; /* NULL without a tokenizer */
    bool ended;      /* its final event was pushed */
} eng_seq;

typedef enum {
    REQ_ACTIVE = 0,    /* queued, running, or ended and about to be freed */
    REQ_HELD = 1,      /* blocks kept outside the queues: a prefill-only hand-over (phase
                          PREFILL_ONLY, until release) or a reservation (phase FULL, until the
                          import or an abort) */
    REQ_IMPORTING = 2, /* a reservation whose import waits in the inbox */
} req_state;

struct eng_req {
    char id[PD_ENGINE_MAX_REQUEST_ID + 1];
    eng_req *hnext; /* hash chain */
    eng_req *inext; /* inbox chain (aborts and imports) */
    eng_req *fnext; /* list of requests to free after a step */
    bool in_inbox;
    bool free_mark;
    bool abort_requested;
    req_state state;
    pd_engine_phase phase;
    pd_arena *arena;       /* owns sp's arrays and strings */
    pd_sampling_params sp; /* has_seed always true (the engine draws a seed when absent) */
    size_t n_prompt;
    int32_t first_token; /* imported requests */
    uint32_t n;          /* choices */
    uint32_t n_live;     /* sequences without a final event */
    eng_seq seqs[];      /* (n) */
};

/* ---- output queue ------------------------------------------------------------------------------
 */

typedef struct {
    pd_engine_event ev;
    char id[PD_ENGINE_MAX_REQUEST_ID + 1];
    int32_t token;
    char *text; /* grows geometrically */
    size_t text_cap;
    char *stop_str; /* grows geometrically */
    size_t stop_cap;
    char err[256];
    int32_t *top_ids; /* (max_logprobs) */
    float *top_lp;    /* (max_logprobs) */
    int32_t *blocks;  /* (max_blocks_per_seq) */
} ev_slot;

/* ---- tensor-parallel ranks ------------------------------------------------------------------- */

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n;
    int arrived;
    uint64_t gen;
    bool broken;
} tp_barrier;

typedef struct pd_engine_rank pd_engine_rank;

struct pd_engine_rank {
    pd_engine *e;
    int r;
    pd_backend *b;
    bool own_backend;
    pd_forward *f;
    pd_kv *kv;
    float *logits;   /* (max_num_seqs, vocab) f32, host */
    float *stage;    /* (max_tokens * hidden) f32: this rank's partial sums for allreduce */
    uint8_t *bounce; /* (2 * block_size * n_kv_heads * head_dim * elem): one block of one
                        layer, K then V, for copy-on-write */
    size_t bounce_bytes;
    pthread_t thread;
    bool thread_started;
    int rc;        /* status of the last job */
    char err[512]; /* its message (thread-local errors do not cross threads) */
};

struct pd_engine {
    pd_engine_params p;
    /* model */
    pd_model *own_model;
    const pd_model *model;
    pd_tok *own_tok;
    const pd_tok *tok;
    size_t vocab;
    size_t hidden;
    int32_t eos_ids[PD_MAX_EOS_IDS + 1]; /* every model EOS id: primary first */
    size_t n_eos;
    pd_stop_model stop_model;
    /* ranks */
    int tp;
    pd_engine_rank *ranks; /* (tp) */
    tp_barrier bar;
    float *tp_sum; /* (max_tokens * hidden) f32: the reduced sums */
    size_t stage_elems;
    pthread_mutex_t rmu;
    pthread_cond_t rcv;
    uint64_t job_gen; /* bumped to start a rank job */
    int jobs_done;
    int ranks_running; /* ranks whose job of this step has not ended (under rmu) */
#if PD_HAVE_CUDA
    pd_nccl_tp *nccl; /* NCCL all-reduce over the ranks' GPUs; NULL: host-staged */
#endif
    bool ranks_quit;
    /* scheduling state (under mu) */
    pthread_mutex_t mu;
    pthread_cond_t work_cv; /* signalled on add/abort/release/import and stop */
    uint64_t work_gen;
    pd_kvpool *pool;
    pd_sched *sched;
    eng_req *buckets[REQ_BUCKETS];
    eng_req *inbox_head, *inbox_tail;
    uint64_t n_requests; /* requests ever added (seed derivation) */
    size_t n_held;
    bool closing;
    pd_engine_stats stats;
    /* one step (engine thread) */
    size_t max_blocks_per_seq;
    int32_t *st_tokens;  /* (max_num_batched_tokens) */
    int32_t *st_qindptr; /* (max_num_seqs + 1) */
    int32_t *st_kvlen;   /* (max_num_seqs) */
    int32_t *st_bindptr; /* (max_num_seqs + 1) */
    int32_t *st_blocks;  /* (max_num_seqs * max_blocks_per_seq) */
    int32_t *st_outrows; /* (max_num_seqs) */
    int32_t *item_out;   /* (max_num_seqs) logits row of each item, -1 when none */
    pd_step step;
    pd_sched_out so;
    pd_sampler_ws *ws;
    /* output queue */
    pthread_mutex_t qmu;
    pthread_cond_t qcv; /* signalled when the consumer frees a slot */
    ev_slot *slots;     /* (cap) */
    size_t cap, qhead, qcount;
    uint64_t n_pushed; /* events published so far */
    bool borrowed;     /* the consumer holds slots[qhead] */
    /* thread */
    pthread_t thread;
    bool running; /* the engine thread exists */
    atomic_bool stop_req;
    bool in_step; /* a step is executing (thread or synchronous) */
};

/* ---- defaults ------------------------------------------------------------------------------- */

pd_engine_params pd_engine_default_params(void)
{
    return (pd_engine_params){
        .model_dir = NULL,
        .model = NULL,
        .tok = NULL,
        .backend = NULL,
        .tp_size = 1,
        .n_threads = 0,
        .n_cuda_devices = 0,
        .gpu_memory_utilization = 0.9,
        .cuda_weight_dtype = -1,
        .block_size = 16,
        .kv_cache_bytes = 0,
        .kv_cache_fraction = 0.4,
        .num_kv_blocks = 0,
        .enable_prefix_caching = true,
        .max_num_seqs = 256,
        .max_num_batched_tokens = 0,
        .max_model_len = 0,
        .max_prefill_chunk = 0,
        .seed = -1,
        .max_logprobs = 20,
        .event_capacity = 0,
        .on_event = NULL,
        .on_event_ctx = NULL,
        .on_logits = NULL,
        .on_logits_ctx = NULL,
    };
}

/* ---- small helpers -------------------------------------------------------------------------- */

static uint32_t hash_id(const char *s)
{
    uint32_t h = 2166136261u; /* FNV-1a */
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 16777619u;
    return h % REQ_BUCKETS;
}

static eng_req *req_find(pd_engine *e, const char *id)
{
    for (eng_req *r = e->buckets[hash_id(id)]; r; r = r->hnext)
        if (strcmp(r->id, id) == 0) return r;
    return NULL;
}

static void req_unlink(pd_engine *e, eng_req *r)
{
    eng_req **pp = &e->buckets[hash_id(r->id)];
    while (*pp && *pp != r) pp = &(*pp)->hnext;
    if (*pp) *pp = r->hnext;
}

static void req_free(pd_engine *e, eng_req *r)
{
    for (uint32_t i = 0; i < r->n; i++) {
        eng_seq *s = &r->seqs[i];
        if (s->sq) pd_sched_seq_free(e->sched, s->sq);
        pd_sampler_seq_free(s->smp);
        pd_stop_free(s->stop);
        pd_detok_free(s->detok);
    }
    pd_arena_destroy(r->arena);
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

static int grow_buf(char **buf, size_t *cap, size_t need)
{
    if (need <= *cap) return PD_OK;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    char *nb = realloc(*buf, c);
    if (!nb) return pd_error(PD_ENOMEM, "engine: out of memory for an event");
    *buf = nb;
    *cap = c;
    return PD_OK;
}

/* ---- tensor-parallel barrier and allreduce -----------------------------------------------------
 */

static int barrier_init(tp_barrier *b, int n)
{
    memset(b, 0, sizeof *b);
    b->n = n;
    if (pthread_mutex_init(&b->mu, NULL)) return pd_error(PD_EINTERNAL, "engine: mutex init");
    if (pthread_cond_init(&b->cv, NULL)) {
        pthread_mutex_destroy(&b->mu);
        return pd_error(PD_EINTERNAL, "engine: cond init");
    }
    return PD_OK;
}

static void barrier_destroy(tp_barrier *b)
{
    pthread_mutex_destroy(&b->mu);
    pthread_cond_destroy(&b->cv);
}

/* Waits for all n ranks; PD_EINTERNAL when another rank broke the barrier (failed). */
static int barrier_wait(tp_barrier *b)
{
    pthread_mutex_lock(&b->mu);
    if (b->broken) {
        pthread_mutex_unlock(&b->mu);
        return pd_error(PD_EINTERNAL, "tensor parallel: another rank failed");
    }
    uint64_t gen = b->gen;
    if (++b->arrived == b->n) {
        b->arrived = 0;
        b->gen++;
        pthread_cond_broadcast(&b->cv);
    } else {
        while (gen == b->gen && !b->broken) pthread_cond_wait(&b->cv, &b->mu);
    }
    bool broken = b->broken && gen == b->gen;
    pthread_mutex_unlock(&b->mu);
    return broken ? pd_error(PD_EINTERNAL, "tensor parallel: another rank failed") : PD_OK;
}

static void barrier_break(tp_barrier *b)
{
    pthread_mutex_lock(&b->mu);
    b->broken = true;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
}

static void barrier_reset(tp_barrier *b)
{
    pthread_mutex_lock(&b->mu);
    b->broken = false;
    b->arrived = 0;
    pthread_mutex_unlock(&b->mu);
}

/* pd_allreduce_fn: every rank stages its partial sums on the host, then each rank adds a slice of
 * the elements in rank order (rank 0 + rank 1 + ...: the result does not depend on timing), then
 * every rank uploads the full sum. Two barriers: after staging, after summing. */
static int tp_allreduce(void *ctx, pd_backend *b, void *buf, size_t n_elems)
{
    pd_engine_rank *rk = ctx;
    pd_engine *e = rk->e;
    const pd_backend_ops *o = pd_backend_get_ops(b);
    if (n_elems > e->stage_elems)
        return pd_error(PD_ERANGE, "allreduce: %zu elements exceed the staging size %zu", n_elems,
                        e->stage_elems);
    PD_CHECK(o->download_f32(b, rk->stage, buf, n_elems));
    PD_CHECK(o->sync(b));
    PD_CHECK(barrier_wait(&e->bar));
    size_t t = (size_t)e->tp, r = (size_t)rk->r;
    size_t lo = n_elems * r / t, hi = n_elems * (r + 1) / t;
    for (size_t j = lo; j < hi; j++) {
        float s = e->ranks[0].stage[j];
        for (size_t k = 1; k < t; k++) s += e->ranks[k].stage[j];
        e->tp_sum[j] = s;
    }
    PD_CHECK(barrier_wait(&e->bar));
    PD_CHECK(o->upload_f32(b, buf, e->tp_sum, n_elems)); /* into the activation dtype */
    PD_CHECK(o->sync(b));
    return PD_OK;
}

/* Whether the all-reduce goes through host staging (rk->stage, e->tp_sum). */
static bool host_staged(const pd_engine *e)
{
#if PD_HAVE_CUDA
    if (e->nccl) return false;
#endif
    return e->tp > 1;
}

#if PD_HAVE_CUDA
/* pd_allreduce_fn over NCCL (see the file-top comment). */
static int nccl_allreduce(void *ctx, pd_backend *b, void *buf, size_t n_elems)
{
    pd_engine_rank *rk = ctx;
    (void)b;
    return pd_nccl_tp_allreduce(rk->e->nccl, rk->r, buf, n_elems);
}
#endif

/* A rank failed: under NCCL, ranks waiting for its contribution would wait forever, so unless every
 * other rank ends its job within RANK_FAIL_WAIT_MS (they failed the same way, before any
 * all-reduce) the communicators are aborted. */
static void rank_failed(pd_engine *e)
{
    if (e->tp > 1) barrier_break(&e->bar);
#if PD_HAVE_CUDA
    if (!e->nccl) return;
    int64_t deadline = pd_now_ns() + (int64_t)RANK_FAIL_WAIT_MS * PD_NS_PER_MS;
    pthread_mutex_lock(&e->rmu);
    while (e->ranks_running > 1 && pd_now_ns() < deadline) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 20 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&e->rcv, &e->rmu, &ts);
    }
    bool stuck = e->ranks_running > 1;
    pthread_mutex_unlock(&e->rmu);
    if (stuck) pd_nccl_tp_abort(e->nccl);
#endif
}

/* ---- one rank's share of a step: copy-on-write copies, then the forward pass --------------------
 */

static int rank_copy_blocks(pd_engine_rank *rk, const pd_kv_block_copy *c, size_t n)
{
    const pd_backend_ops *o = pd_backend_get_ops(rk->b);
    int n_layers = (int)rk->e->model->config.num_hidden_layers;
    size_t n_heads = (size_t)rk->e->model->config.num_key_value_heads / (size_t)rk->e->tp;
    for (size_t i = 0; i < n; i++) {
        for (int l = 0; l < n_layers; l++) {
            pd_kv_range src = {
                .layer = l, .block_ids = &c[i].src, .n_blocks = 1, .head0 = 0, .n_heads = n_heads};
            pd_kv_range dst = src;
            dst.block_ids = &c[i].dst;
            PD_CHECK(o->kv_export(rk->b, rk->kv, &src, rk->bounce));
            PD_CHECK(o->sync(rk->b));
            PD_CHECK(o->kv_import(rk->b, rk->kv, &dst, rk->bounce));
        }
    }
    if (n) PD_CHECK(o->sync(rk->b));
    return PD_OK;
}

static void rank_job(pd_engine_rank *rk)
{
    pd_engine *e = rk->e;
    int rc = rank_copy_blocks(rk, e->so.copies, e->so.n_copies);
    if (rc >= 0) rc = pd_forward_run(rk->f, rk->kv, &e->step, rk->logits);
    rk->rc = rc;
    if (rc < 0) {
        snprintf(rk->err, sizeof rk->err, "rank %d: %s", rk->r, pd_last_error());
        rank_failed(e);
    } else {
        rk->err[0] = '\0';
    }
    if (e->tp > 1) {
        pthread_mutex_lock(&e->rmu);
        e->ranks_running--;
        pthread_cond_broadcast(&e->rcv);
        pthread_mutex_unlock(&e->rmu);
    }
}

static void *rank_main(void *arg)
{
    pd_engine_rank *rk = arg;
    pd_engine *e = rk->e;
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&e->rmu);
        while (e->job_gen == seen && !e->ranks_quit) pthread_cond_wait(&e->rcv, &e->rmu);
        if (e->ranks_quit) {
            pthread_mutex_unlock(&e->rmu);
            return NULL;
        }
        seen = e->job_gen;
        pthread_mutex_unlock(&e->rmu);
        rank_job(rk);
        pthread_mutex_lock(&e->rmu);
        e->jobs_done++;
        pthread_cond_broadcast(&e->rcv);
        pthread_mutex_unlock(&e->rmu);
    }
}

/* Runs the current step on every rank (rank 0 here) and waits for all of them. */
static int run_ranks(pd_engine *e)
{
    if (e->tp > 1) {
        pthread_mutex_lock(&e->rmu);
        e->jobs_done = 0;
        e->ranks_running = e->tp;
        e->job_gen++;
        pthread_cond_broadcast(&e->rcv);
        pthread_mutex_unlock(&e->rmu);
    }
    rank_job(&e->ranks[0]);
    if (e->tp > 1) {
        pthread_mutex_lock(&e->rmu);
        while (e->jobs_done < e->tp - 1) pthread_cond_wait(&e->rcv, &e->rmu);
        pthread_mutex_unlock(&e->rmu);
        barrier_reset(&e->bar);
    }
    for (int r = 0; r < e->tp; r++)
        if (e->ranks[r].rc < 0) return pd_error(e->ranks[r].rc, "%s", e->ranks[r].err);
    return PD_OK;
}

/* ---- events ---------------------------------------------------------------------------------- */

static size_t queue_free(pd_engine *e)
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

/* Ends one sequence with status (PD_ECANCELLED or an error) and pushes its final event. Returns
 * false when the queue had no room (nothing done). Called under mu. */
static bool seq_end_status(pd_engine *e, eng_seq *s, int status, const char *msg)
{
    if (s->ended) return true;
    ev_slot *sl = slot_begin(e, s);
    if (!sl) return false;
    sl->ev.final = true;
    sl->ev.status = status;
    snprintf(sl->err, sizeof sl->err, "%s", msg ? msg : "");
    slot_publish(e);
    if (s->sq) pd_sched_finish(e->sched, s->sq);
    s->ended = true;
    s->req->n_live--;
    return true;
}

/* Frees a request once every sequence has ended and it holds nothing (under mu). */
static void req_maybe_free(pd_engine *e, eng_req *r)
{
    if (r->n_live > 0 || r->state == REQ_HELD || r->in_inbox) return;
    req_unlink(e, r);
    e->stats.requests_finished++;
    req_free(e, r);
}

/* Feeds one new token of s through the detokenizer and the stop checker and pushes its event
 * (res: the sampler's result for logprobs, or NULL). Finishes the sequence when the checker says
 * so (prefill-only sequences are held instead). Under mu; the caller checked the queue has room. */
static int seq_emit_token(pd_engine *e, eng_seq *s, int32_t token, const pd_sample_result *res)
{
    eng_req *r = s->req;
    ev_slot *sl = slot_begin(e, s);
    if (!sl) return pd_error(PD_EINTERNAL, "engine: output queue overflow");
    const char *delta = "";
    size_t dlen = 0;
    if (s->detok) PD_CHECK(pd_detok_push(s->detok, token, &delta, &dlen));
    pd_stop_result sr;
    PD_CHECK(pd_stop_push(s->stop, token, delta, dlen, &sr));
    size_t tlen = 0;
    PD_CHECK(grow_buf(&sl->text, &sl->text_cap, sr.text_len + 1));
    memcpy(sl->text, sr.text, sr.text_len);
    tlen = sr.text_len;
    if (sr.finish != PD_FINISH_NONE) {
        const char *tail = "";
        size_t tail_len = 0;
        if (s->detok) PD_CHECK(pd_detok_flush(s->detok, &tail, &tail_len));
        pd_stop_result fr;
        PD_CHECK(pd_stop_flush(s->stop, tail, tail_len, &fr));
        PD_CHECK(grow_buf(&sl->text, &sl->text_cap, tlen + fr.text_len + 1));
        memcpy(sl->text + tlen, fr.text, fr.text_len);
        tlen += fr.text_len;
        sl->ev.finish = sr.finish;
        sl->ev.stop_kind = sr.stop_kind;
        sl->ev.stop_token = sr.stop_token;
        if (sr.stop_kind == PD_STOP_REASON_STRING && sr.stop_string) {
            size_t n = strlen(sr.stop_string);
            PD_CHECK(grow_buf(&sl->stop_str, &sl->stop_cap, n + 1));
            memcpy(sl->stop_str, sr.stop_string, n + 1);
            sl->ev.stop_string = sl->stop_str;
        }
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

/* ---- inbox -------------------------------------------------------------------------------------
 */

/* Applies queued aborts and imports while the output queue has room (under mu). */
static int apply_inbox(pd_engine *e)
{
    while (e->inbox_head) {
        eng_req *r = e->inbox_head;
        size_t need = r->abort_requested ? r->n_live : 1;
        if (queue_free(e) < need) return PD_EBUSY;
        e->inbox_head = r->inext;
        if (!e->inbox_head) e->inbox_tail = NULL;
        r->in_inbox = false;
        if (r->abort_requested) {
            for (uint32_t i = 0; i < r->n; i++)
                seq_end_status(e, &r->seqs[i], PD_ECANCELLED, "request aborted");
            if (r->state == REQ_HELD) {
                /* a held hand-over or reservation: its blocks go back now */
                pd_sched_finish(e->sched, r->seqs[0].sq);
                e->n_held--;
                r->state = REQ_ACTIVE;
            }
        } else if (r->state == REQ_IMPORTING) {
            eng_seq *s = &r->seqs[0];
            r->state = REQ_ACTIVE;
            int rc = pd_sampler_seq_append(s->smp, r->first_token);
            if (rc >= 0) rc = seq_emit_token(e, s, r->first_token, NULL);
            if (rc >= 0 && !s->ended) rc = pd_sched_admit_computed(e->sched, s->sq, r->n_prompt);
            if (rc < 0) seq_end_status(e, s, rc, pd_last_error());
        }
        req_maybe_free(e, r);
    }
    return PD_OK;
}

/* ---- adding requests ------------------------------------------------------------------------ */

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
    if (sp.n_stop > 0 && !e->tok)
        return pd_error(PD_EINVAL, "stop strings need a tokenizer; this engine has none");
    if (rq->phase == PD_PHASE_PREFILL_ONLY && sp.n != 1)
        return pd_error(PD_EUNSUPPORTED, "n > 1 is not supported for prefill-only requests");

    eng_req *r = calloc(1, sizeof *r + (size_t)sp.n * sizeof(eng_seq));
    if (!r) return pd_error(PD_ENOMEM, "engine: out of memory for a request");
    snprintf(r->id, sizeof r->id, "%s", rq->request_id);
    r->phase = rq->phase;
    r->n = (uint32_t)sp.n;
    r->n_live = r->n;
    r->n_prompt = rq->n_prompt;
    int rc = PD_OK;
    r->arena = pd_arena_create(0);
    if (!r->arena) {
        rc = pd_error(PD_ENOMEM, "engine: out of memory for a request");
        goto fail;
    }
    PD_CHECK_GOTO(pd_sampling_params_clone(&sp, r->arena, &r->sp), rc, fail);
    for (uint32_t i = 0; i < r->n; i++) {
        eng_seq *s = &r->seqs[i];
        s->req = r;
        s->index = i;
        PD_CHECK_GOTO(pd_sampler_seq_create(&r->sp, (int32_t)e->vocab, e->eos_ids, e->n_eos, i,
                                            rq->prompt_ids, rq->n_prompt, &s->smp),
                      rc, fail);
        PD_CHECK_GOTO(pd_stop_create(&r->sp, &e->stop_model, (int64_t)rq->n_prompt, &s->stop), rc,
                      fail);
        if (e->tok)
            PD_CHECK_GOTO(pd_detok_create(e->tok, r->sp.skip_special_tokens, rq->prompt_ids,
                                          rq->n_prompt, &s->detok),
                          rc, fail);
    }
    *out = r;
    return PD_OK;
fail:
    for (uint32_t i = 0; i < r->n; i++) {
        pd_sampler_seq_free(r->seqs[i].smp);
        pd_stop_free(r->seqs[i].stop);
        pd_detok_free(r->seqs[i].detok);
    }
    pd_arena_destroy(r->arena);
    free(r);
    return rc;
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
    pthread_mutex_lock(&e->mu);
    int rc = PD_OK;
    if (e->closing)
        rc = pd_error(PD_ECLOSED, "engine is shutting down");
    else if (req_find(e, r->id))
        rc = pd_error(PD_EEXIST, "request id '%s' is already in use", r->id);
    if (rc >= 0)
        rc = pd_sched_seq_create(e->sched, rq->prompt_ids, rq->n_prompt, &r->seqs[0],
                                 &r->seqs[0].sq);
    if (rc >= 0) rc = pd_sched_add(e->sched, r->seqs[0].sq, r->n - 1);
    if (rc >= 0) {
        r->state = REQ_ACTIVE;
        r->hnext = e->buckets[hash_id(r->id)];
        e->buckets[hash_id(r->id)] = r;
        r = NULL;
        wake_engine(e);
    }
    if (r) req_free(e, r); /* frees its scheduler sequence too, under the lock */
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
        req_maybe_free(e, r);
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
        r->hnext = e->buckets[hash_id(r->id)];
        e->buckets[hash_id(r->id)] = r;
        r = NULL;
    }
    if (r) req_free(e, r);
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
    if (first_token < 0 || (size_t)first_token >= e->vocab)
        return pd_error(PD_EINVAL, "Token id %d is out of vocabulary", first_token);
    if (rq->sampling->n != 1) return pd_error(PD_EINVAL, "an imported request has n = 1");
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
    if (rc >= 0)
        rc = pd_sched_seq_set_prompt(e->sched, r->seqs[0].sq, rq->prompt_ids, rq->n_prompt);
    if (rc >= 0) rc = pd_sched_append(e->sched, r->seqs[0].sq, first_token);
    if (rc >= 0) {
        /* move the built per-sequence state into the reservation */
        pd_arena *old = r->arena;
        r->arena = built->arena;
        built->arena = old;
        r->sp = built->sp;
        r->seqs[0].smp = built->seqs[0].smp;
        r->seqs[0].stop = built->seqs[0].stop;
        r->seqs[0].detok = built->seqs[0].detok;
        built->seqs[0].smp = NULL;
        built->seqs[0].stop = NULL;
        built->seqs[0].detok = NULL;
        r->first_token = first_token;
        r->state = REQ_IMPORTING;
        e->n_held--;
        inbox_push(e, r);
        wake_engine(e);
    }
    pthread_mutex_unlock(&e->mu);
    req_free(e, built);
    return rc;
}

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
        row += it->n_new;
        e->st_qindptr[i + 1] = (int32_t)row;
        e->st_kvlen[i] = (int32_t)(it->start + it->n_new);
        const pd_kvtable *t = pd_seq_table(it->seq);
        size_t nb = pd_kvtable_num_blocks(t);
        memcpy(e->st_blocks + nb_total, pd_kvtable_ids(t), nb * sizeof(int32_t));
        nb_total += nb;
        e->st_bindptr[i + 1] = (int32_t)nb_total;
        if (it->sample) {
            e->item_out[i] = (int32_t)n_out;
            e->st_outrows[n_out++] = (int32_t)(row - 1);
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

/* Samples, detokenizes and stop-checks the sequence of item i (under mu). For a request with
 * n > 1 whose prompt just finished, forks the other choices first: they share the prompt's
 * blocks and each samples from the same logits row with its own choice index. */
static int process_item(pd_engine *e, size_t i, const float *logits)
{
    const pd_sched_item *it = &e->so.items[i];
    eng_seq *s = pd_seq_user(it->seq);
    eng_req *r = s->req;
    if (r->abort_requested) return PD_OK; /* its abort is applied at the next boundary */
    if (s->index == 0 && pd_seq_num_output(it->seq) == 0 && r->n > 1 && !r->seqs[1].sq) {
        for (uint32_t c = 1; c < r->n; c++)
            PD_CHECK(pd_sched_fork(e->sched, it->seq, &r->seqs[c], &r->seqs[c].sq));
    }
    uint32_t first = s->index, last = s->index;
    if (s->index == 0 && pd_seq_num_output(it->seq) == 0 && r->n > 1) last = r->n - 1;
    for (uint32_t c = first; c <= last; c++) {
        eng_seq *cs = &r->seqs[c];
        if (cs->ended) continue;
        if (e->p.on_logits)
            e->p.on_logits(e->p.on_logits_ctx, r->id, c, pd_sampler_seq_num_output(cs->smp), logits,
                           e->vocab);
        pd_sample_result res;
        PD_CHECK(pd_sample(cs->smp, logits, e->ws, &res));
        PD_CHECK(pd_sched_append(e->sched, cs->sq, res.token));
        e->stats.generation_tokens++;
        PD_CHECK(seq_emit_token(e, cs, res.token, &res));
    }
    return PD_OK;
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
        req_maybe_free(e, r);
    }
}

/* One step; *did_work false when nothing was scheduled. */
static int step_once(pd_engine *e, bool *did_work)
{
    *did_work = false;
    int64_t t0 = pd_now_ns();
    pthread_mutex_lock(&e->mu);
    int rc = apply_inbox(e);
    if (rc == PD_OK && queue_free(e) < e->p.max_num_seqs) rc = PD_EBUSY;
    if (rc == PD_EBUSY) {
        pthread_mutex_unlock(&e->mu);
        return pd_error(PD_EBUSY, "output queue full: drain the events");
    }
    rc = pd_sched_schedule(e->sched, &e->so);
    if (rc >= 0) rc = build_step(e);
    if (rc < 0 || e->so.n_items == 0) {
        e->so.n_items = 0;
        pthread_mutex_unlock(&e->mu);
        return rc;
    }
    e->stats.num_preemptions = pd_sched_num_preemptions(e->sched);
    pthread_mutex_unlock(&e->mu);

    int64_t t1 = pd_now_ns();
    int frc = run_ranks(e); /* no lock: adds and reservations may proceed meanwhile */
    int64_t t2 = pd_now_ns();

    pthread_mutex_lock(&e->mu);
    e->stats.forward_ns += (uint64_t)(t2 - t1);
    *did_work = true;
    e->stats.steps++;
    pd_sched_commit(e->sched);
    char msg[512];
    if (frc < 0) {
        /* the step's sequences cannot continue: end them (all choices) with the error */
        snprintf(msg, sizeof msg, "%s", pd_last_error());
        PD_ERROR("-", "step failed: %s", msg);
        for (size_t i = 0; i < e->so.n_items; i++) {
            eng_req *r = ((eng_seq *)pd_seq_user(e->so.items[i].seq))->req;
            for (uint32_t c = 0; c < r->n; c++) seq_end_status(e, &r->seqs[c], frc, msg);
        }
    } else {
        for (size_t i = 0; i < e->so.n_items; i++) {
            const pd_sched_item *it = &e->so.items[i];
            eng_seq *s = pd_seq_user(it->seq);
            size_t np = pd_seq_num_prompt(it->seq);
            if (it->start < np)
                e->stats.prompt_tokens +=
                    (it->start + it->n_new < np ? it->start + it->n_new : np) - it->start;
            if (e->item_out[i] < 0) continue;
            const float *row = e->ranks[0].logits + (size_t)e->item_out[i] * e->vocab;
            int prc = process_item(e, i, row);
            if (prc < 0) {
                snprintf(msg, sizeof msg, "%s", pd_last_error());
                PD_WARN(s->req->id, "sequence %u failed: %s", s->index, msg);
                for (uint32_t c = 0; c < s->req->n; c++)
                    seq_end_status(e, &s->req->seqs[c], prc, msg);
            }
        }
    }
    free_ended_requests(e);
    e->stats.step_ns += (uint64_t)(pd_now_ns() - t0);
    pthread_mutex_unlock(&e->mu);
    if (frc < 0) return pd_error(frc, "%s", msg);
    return PD_OK;
}

/* ---- running ------------------------------------------------------------------------------- */

static uint64_t events_pushed(pd_engine *e)
{
    pthread_mutex_lock(&e->qmu);
    uint64_t n = e->n_pushed;
    pthread_mutex_unlock(&e->qmu);
    return n;
}

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
    uint64_t before = events_pushed(e);
    int rc = step_once(e, &dw);
    pthread_mutex_lock(&e->mu);
    e->in_step = false;
    pthread_mutex_unlock(&e->mu);
    if (events_pushed(e) != before && e->p.on_event) e->p.on_event(e->p.on_event_ctx);
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
        uint64_t before = events_pushed(e);
        bool dw = false;
        int rc = step_once(e, &dw);
        if (events_pushed(e) != before && e->p.on_event) e->p.on_event(e->p.on_event_ctx);
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

/* ---- create / destroy ------------------------------------------------------------------------ */

static bool file_exists(const char *dir, const char *name)
{
    char path[4096];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

/* EOS ids (§7.1): the primary is the tokenizer's eos_token (else config.json's first); the
 * others come from generation_config.json (else config.json). */
static void setup_eos(pd_engine *e)
{
    const pd_model *m = e->model;
    int32_t primary = -1;
    if (e->tok) {
        const int32_t *ids;
        if (pd_tok_eos_ids(e->tok, &ids) > 0) primary = ids[0];
    }
    if (primary < 0 && m->config.n_eos_token_ids > 0) primary = (int32_t)m->config.eos_token_ids[0];
    const int64_t *extra = m->config.eos_token_ids;
    int n_extra = m->config.n_eos_token_ids;
    if (m->has_generation_config && m->generation.n_eos_token_ids > 0) {
        extra = m->generation.eos_token_ids;
        n_extra = m->generation.n_eos_token_ids;
    }
    e->n_eos = 0;
    if (primary >= 0) e->eos_ids[e->n_eos++] = primary;
    size_t first_extra = e->n_eos;
    for (int i = 0; i < n_extra && e->n_eos < PD_MAX_EOS_IDS + 1; i++) {
        int32_t id = (int32_t)extra[i];
        bool dup = false;
        for (size_t k = 0; k < e->n_eos; k++) dup |= e->eos_ids[k] == id;
        if (!dup && id >= 0 && (size_t)id < e->vocab) e->eos_ids[e->n_eos++] = id;
    }
    e->stop_model = (pd_stop_model){
        .eos_id = primary,
        .extra_eos_ids = e->eos_ids + first_extra,
        .n_extra_eos_ids = e->n_eos - first_extra,
        .max_model_len = (int64_t)e->p.max_model_len,
        .max_new_tokens = m->has_generation_config && m->generation.has_max_new_tokens
                              ? m->generation.max_new_tokens
                              : -1,
    };
}

static int check_params(pd_engine *e)
{
    pd_engine_params *p = &e->p;
    const pd_model_config *c = &e->model->config;
    if (p->tp_size < 1)
        return pd_error(PD_EINVAL, "tensor_parallel_size must be at least 1, got %d", p->tp_size);
    if (p->tp_size > 1 && p->backend)
        return pd_error(PD_EINVAL,
                        "tensor_parallel_size %d needs engine-created CPU backends "
                        "(params.backend must be NULL)",
                        p->tp_size);
    if (p->n_cuda_devices < 0 || p->n_cuda_devices > PD_ENGINE_MAX_CUDA_DEVICES)
        return pd_error(PD_EINVAL, "n_cuda_devices must be 0 to %d, got %d",
                        PD_ENGINE_MAX_CUDA_DEVICES, p->n_cuda_devices);
    if (p->n_cuda_devices > 0) {
        if (!PD_HAVE_CUDA)
            return pd_error(PD_EUNSUPPORTED,
                            "this build has no CUDA backend (configure with meson "
                            "-Dcuda=enabled on a machine with nvcc, cuBLAS and NCCL)");
        if (p->backend)
            return pd_error(PD_EINVAL, "a borrowed backend and CUDA devices are exclusive");
        if (p->n_cuda_devices != p->tp_size)
            return pd_error(PD_EINVAL, "%d CUDA devices for tensor_parallel_size %d",
                            p->n_cuda_devices, p->tp_size);
        if (!(p->gpu_memory_utilization > 0 && p->gpu_memory_utilization <= 1))
            return pd_error(PD_EINVAL, "gpu_memory_utilization must be in (0, 1], got %g",
                            p->gpu_memory_utilization);
    }
    if (c->num_attention_heads % p->tp_size)
        return pd_error(PD_EINVAL,
                        "Total number of attention heads (%lld) must be divisible by tensor "
                        "parallel size (%d).",
                        (long long)c->num_attention_heads, p->tp_size);
    if (p->block_size == 0) return pd_error(PD_EINVAL, "block_size must be at least 1");
    const char *key;
    const int64_t derived = pd_model_max_len(c, &key);
    if (p->max_model_len == 0) p->max_model_len = (size_t)derived;
    if ((int64_t)p->max_model_len > derived)
        return pd_error(PD_EINVAL,
                        "User-specified max_model_len (%zu) is greater than the derived "
                        "max_model_len (%s=%lld in model's config.json%s). This may lead to "
                        "incorrect model outputs or CUDA errors.",
                        p->max_model_len, key, (long long)derived,
                        derived < c->max_position_embeddings
                            ? "; attention is not windowed here, so the context stops at the "
                              "window"
                            : "");
    if (p->max_num_batched_tokens == 0)
        p->max_num_batched_tokens = p->max_model_len > 2048 ? p->max_model_len : 2048;
    pd_sched_params sp = {.max_num_seqs = p->max_num_seqs,
                          .max_num_batched_tokens = p->max_num_batched_tokens,
                          .max_model_len = p->max_model_len,
                          .max_prefill_chunk = p->max_prefill_chunk};
    PD_CHECK(pd_sched_check_params(&sp));
    if (p->max_logprobs < 0) return pd_error(PD_EINVAL, "max_logprobs must be >= 0");
    if (p->event_capacity == 0) p->event_capacity = 4 * p->max_num_seqs + 64;
    if (p->event_capacity < p->max_num_seqs + 1)
        return pd_error(PD_EINVAL, "event_capacity (%zu) must exceed max_num_seqs (%zu)",
                        p->event_capacity, p->max_num_seqs);
    return PD_OK;
}

/* NCCL when every rank has a GPU of its own (or NCCL takes several ranks per GPU:
 * pd_nccl_multi_rank_gpu), else the host-staged all-reduce; logged. */
static int choose_allreduce(pd_engine *e)
{
    if (e->tp < 2) return PD_OK;
#if PD_HAVE_CUDA
    if (e->p.n_cuda_devices > 0) {
        bool distinct = true;
        for (int r = 0; r < e->tp; r++)
            for (int q = 0; q < r; q++)
                distinct = distinct && e->p.cuda_devices[q] != e->p.cuda_devices[r];
        if (distinct || pd_nccl_multi_rank_gpu()) {
            pd_backend *bs[PD_ENGINE_MAX_CUDA_DEVICES];
            for (int r = 0; r < e->tp; r++) bs[r] = e->ranks[r].b;
            if (pd_nccl_tp_create(bs, e->tp, &e->nccl) == PD_OK) return PD_OK;
            PD_WARN("-", "tensor parallel: NCCL unavailable (%s); host-staged all-reduce",
                    pd_last_error());
        } else {
            PD_INFO("-",
                    "tensor parallel: ranks share a GPU (NCCL takes one rank per GPU); "
                    "host-staged all-reduce over %d ranks",
                    e->tp);
            return PD_OK;
        }
    }
#endif
    PD_INFO("-", "tensor parallel: host-staged all-reduce over %d ranks", e->tp);
    return PD_OK;
}

static int create_ranks(pd_engine *e)
{
    pd_engine_params *p = &e->p;
    int total = p->n_threads > 0 ? p->n_threads : pd_cpu_count();
    int per = total / e->tp > 0 ? total / e->tp : 1;
    e->ranks = calloc((size_t)e->tp, sizeof *e->ranks);
    if (!e->ranks) return pd_error(PD_ENOMEM, "engine: out of memory");
    for (int r = 0; r < e->tp; r++) {
        pd_engine_rank *rk = &e->ranks[r];
        rk->e = e;
        rk->r = r;
        if (p->backend) {
            rk->b = p->backend;
        } else {
            pd_backend_params bp = pd_backend_default_params();
            bp.n_threads = per;
            bp.max_tokens = p->max_num_batched_tokens;
            bp.max_seqs = p->max_num_seqs;
            bp.max_blocks = p->max_num_seqs * e->max_blocks_per_seq;
            bp.no_graphs = e->tp > 1; /* the all-reduce synchronizes with the host mid-step */
#if PD_HAVE_CUDA
            if (p->n_cuda_devices > 0) {
                bp.device = p->cuda_devices[r];
                bp.weight_dtype = p->cuda_weight_dtype;
                PD_CHECK(pd_backend_cuda_create(&bp, &rk->b));
            } else
#endif
                PD_CHECK(pd_backend_cpu_create(&bp, &rk->b));
            rk->own_backend = true;
        }
    }
    PD_CHECK(choose_allreduce(e));
    for (int r = 0; r < e->tp; r++) {
        pd_engine_rank *rk = &e->ranks[r];
        pd_forward_params fp = pd_forward_default_params();
        fp.shard = (pd_shard){r, e->tp};
        fp.allreduce = e->tp > 1 ? tp_allreduce : NULL;
#if PD_HAVE_CUDA
        if (e->nccl) fp.allreduce = nccl_allreduce;
#endif
        fp.allreduce_ctx = rk;
        fp.max_tokens = p->max_num_batched_tokens;
        fp.max_seqs = p->max_num_seqs;
        fp.max_out = p->max_num_seqs;
        PD_CHECK(pd_forward_create(rk->b, e->model, &fp, &rk->f));
    }
    return PD_OK;
}

static int create_kv(pd_engine *e)
{
    pd_engine_params *p = &e->p;
    pd_kv_params kp = pd_forward_kv_params(e->ranks[0].f, 0, p->block_size);
    size_t block_bytes = pd_kv_block_bytes(&kp);
    size_t n_blocks = p->num_kv_blocks;
#if PD_HAVE_CUDA
    if (n_blocks == 0 && p->kv_cache_bytes == 0 && p->n_cuda_devices > 0) {
        /* what --gpu-memory-utilization leaves after the weights and buffers; the smallest
         * rank decides (every rank holds the same block ids) */
        for (int r = 0; r < e->tp; r++) {
            size_t nb = 0;
            PD_CHECK(pd_backend_cuda_kv_blocks(e->ranks[r].b, &kp, p->gpu_memory_utilization, &nb));
            if (r == 0 || nb < n_blocks) n_blocks = nb;
        }
        size_t useful = p->max_num_seqs * e->max_blocks_per_seq;
        if (n_blocks > useful) n_blocks = useful;
    }
#endif
    if (n_blocks == 0) {
        size_t budget = p->kv_cache_bytes;
        if (budget == 0) {
            PD_CHECK(pd_kv_default_cpu_bytes(p->kv_cache_fraction, &budget));
            budget /= (size_t)e->tp; /* the ranks share the host's memory */
        }
        n_blocks = pd_kv_blocks_for_bytes(budget, block_bytes);
        /* more than every sequence at full length can never be used */
        size_t useful = p->max_num_seqs * e->max_blocks_per_seq;
        if (n_blocks > useful) n_blocks = useful;
    }
    PD_CHECK(pd_kv_check_capacity(n_blocks, p->block_size, (int64_t)p->max_model_len));
    kp.n_blocks = n_blocks;
    for (int r = 0; r < e->tp; r++) {
        pd_engine_rank *rk = &e->ranks[r];
        pd_kv_params kr = pd_forward_kv_params(rk->f, n_blocks, p->block_size);
        PD_CHECK(pd_backend_get_ops(rk->b)->kv_create(rk->b, &kr, &rk->kv));
        rk->bounce_bytes = pd_kv_block_bytes(&kr) / (size_t)kr.n_layers;
        rk->bounce = malloc(rk->bounce_bytes);
        rk->logits = malloc(p->max_num_seqs * e->vocab * sizeof(float));
        if (!rk->bounce || !rk->logits) return pd_error(PD_ENOMEM, "engine: out of memory");
        if (host_staged(e)) {
            rk->stage = malloc(e->stage_elems * sizeof(float));
            if (!rk->stage) return pd_error(PD_ENOMEM, "engine: out of memory for TP staging");
        }
    }
    size_t tokens = n_blocks * p->block_size;
    PD_INFO("-",
            "KV cache: %zu blocks x %zu tokens = %zu tokens (%.1f MiB per rank, %d rank(s)); "
            "maximum concurrency for %zu tokens per request: %.2fx",
            n_blocks, p->block_size, tokens, (double)(n_blocks * block_bytes) / (1024.0 * 1024.0),
            e->tp, p->max_model_len, (double)tokens / (double)p->max_model_len);
    PD_CHECK(pd_kvpool_create(n_blocks, p->block_size, &e->pool));
    if (p->enable_prefix_caching) PD_CHECK(pd_kvpool_enable_prefix_cache(e->pool));
    return PD_OK;
}

static int create_buffers(pd_engine *e)
{
    pd_engine_params *p = &e->p;
    size_t S = p->max_num_seqs;
    e->st_tokens = malloc(p->max_num_batched_tokens * sizeof(int32_t));
    e->st_qindptr = malloc((S + 1) * sizeof(int32_t));
    e->st_kvlen = malloc(S * sizeof(int32_t));
    e->st_bindptr = malloc((S + 1) * sizeof(int32_t));
    e->st_blocks = malloc(S * e->max_blocks_per_seq * sizeof(int32_t));
    e->st_outrows = malloc(S * sizeof(int32_t));
    e->item_out = malloc(S * sizeof(int32_t));
    e->cap = p->event_capacity;
    e->slots = calloc(e->cap, sizeof *e->slots);
    if (!e->st_tokens || !e->st_qindptr || !e->st_kvlen || !e->st_bindptr || !e->st_blocks ||
        !e->st_outrows || !e->item_out || !e->slots)
        return pd_error(PD_ENOMEM, "engine: out of memory for step buffers");
    size_t k = p->max_logprobs > 0 ? (size_t)p->max_logprobs : 1;
    for (size_t i = 0; i < e->cap; i++) {
        ev_slot *sl = &e->slots[i];
        sl->top_ids = malloc(k * sizeof *sl->top_ids);
        sl->top_lp = malloc(k * sizeof *sl->top_lp);
        sl->blocks = malloc(e->max_blocks_per_seq * sizeof *sl->blocks);
        if (!sl->top_ids || !sl->top_lp || !sl->blocks)
            return pd_error(PD_ENOMEM, "engine: out of memory for the output queue");
    }
    if (host_staged(e)) {
        e->tp_sum = malloc(e->stage_elems * sizeof(float));
        if (!e->tp_sum) return pd_error(PD_ENOMEM, "engine: out of memory for TP staging");
    }
    PD_CHECK(pd_sampler_ws_create((int32_t)e->vocab, p->max_logprobs, &e->ws));
    return PD_OK;
}

static int start_rank_threads(pd_engine *e)
{
    for (int r = 1; r < e->tp; r++) {
        if (pthread_create(&e->ranks[r].thread, NULL, rank_main, &e->ranks[r]))
            return pd_error(PD_EINTERNAL, "engine: cannot start the thread of rank %d", r);
        e->ranks[r].thread_started = true;
    }
    return PD_OK;
}

int pd_engine_create(const pd_engine_params *params, pd_engine **out)
{
    *out = NULL;
    pd_engine *e = calloc(1, sizeof *e);
    if (!e) return pd_error(PD_ENOMEM, "engine: out of memory");
    e->p = *params;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->work_cv, NULL);
    pthread_mutex_init(&e->qmu, NULL);
    pthread_cond_init(&e->qcv, NULL);
    pthread_mutex_init(&e->rmu, NULL);
    pthread_cond_init(&e->rcv, NULL);
    atomic_init(&e->stop_req, false);
    int rc = PD_OK;
    if (e->p.model_dir) {
        PD_CHECK_GOTO(pd_model_load(e->p.model_dir, &e->own_model), rc, fail);
        e->model = e->own_model;
    } else if (e->p.model) {
        e->model = e->p.model;
    } else {
        rc = pd_error(PD_EINVAL, "engine: give params.model_dir or params.model");
        goto fail;
    }
    e->p.model = NULL;
    e->tok = e->p.tok;
    if (!e->tok && e->p.model_dir && file_exists(e->p.model_dir, "tokenizer.json")) {
        PD_CHECK_GOTO(pd_tok_load(e->p.model_dir, &e->own_tok), rc, fail);
        e->tok = e->own_tok;
    }
    PD_CHECK_GOTO(check_params(e), rc, fail);
    e->tp = e->p.tp_size;
    e->hidden = (size_t)e->model->config.hidden_size;
    e->max_blocks_per_seq = (e->p.max_model_len + e->p.block_size - 1) / e->p.block_size;
    e->stage_elems = e->p.max_num_batched_tokens * e->hidden;
    if (e->tp > 1) PD_CHECK_GOTO(barrier_init(&e->bar, e->tp), rc, fail);
    PD_CHECK_GOTO(create_ranks(e), rc, fail);
    e->vocab = pd_forward_vocab(e->ranks[0].f);
    setup_eos(e);
    PD_CHECK_GOTO(create_kv(e), rc, fail);
    pd_sched_params sp = {.max_num_seqs = e->p.max_num_seqs,
                          .max_num_batched_tokens = e->p.max_num_batched_tokens,
                          .max_model_len = e->p.max_model_len,
                          .max_prefill_chunk = e->p.max_prefill_chunk,
                          .prefix_caching = e->p.enable_prefix_caching};
    PD_CHECK_GOTO(pd_sched_create(&sp, e->pool, &e->sched), rc, fail);
    PD_CHECK_GOTO(create_buffers(e), rc, fail);
    PD_CHECK_GOTO(start_rank_threads(e), rc, fail);
    e->stats.block_size = e->p.block_size;
    PD_INFO("-",
            "engine: %s, tp %d, max_model_len %zu, max_num_seqs %zu, max_num_batched_tokens %zu, "
            "vocab %zu, %s",
            pd_arch_name(e->model->config.arch), e->tp, e->p.max_model_len, e->p.max_num_seqs,
            e->p.max_num_batched_tokens, e->vocab, e->tok ? "with tokenizer" : "no tokenizer");
    *out = e;
    return PD_OK;
fail:
    pd_engine_destroy(e);
    return rc;
}

void pd_engine_destroy(pd_engine *e)
{
    if (!e) return;
    pd_engine_stop(e);
    pthread_mutex_lock(&e->mu);
    e->closing = true;
    for (size_t b = 0; b < REQ_BUCKETS; b++) {
        while (e->buckets[b]) {
            eng_req *r = e->buckets[b];
            e->buckets[b] = r->hnext;
            req_free(e, r);
        }
    }
    pthread_mutex_unlock(&e->mu);
    pd_sched_destroy(e->sched);
    pd_kvpool_destroy(e->pool);
    if (e->ranks) {
        pthread_mutex_lock(&e->rmu);
        e->ranks_quit = true;
        pthread_cond_broadcast(&e->rcv);
        pthread_mutex_unlock(&e->rmu);
        for (int r = 0; r < e->tp; r++)
            if (e->ranks[r].thread_started) pthread_join(e->ranks[r].thread, NULL);
#if PD_HAVE_CUDA
        pd_nccl_tp_destroy(e->nccl); /* before the backends whose streams it used */
        e->nccl = NULL;
#endif
        for (int r = 0; r < e->tp; r++) {
            pd_engine_rank *rk = &e->ranks[r];
            if (rk->kv) pd_backend_get_ops(rk->b)->kv_free(rk->b, rk->kv);
            pd_forward_destroy(rk->f);
            if (rk->own_backend) pd_backend_destroy(rk->b);
            free(rk->logits);
            free(rk->stage);
            free(rk->bounce);
        }
        free(e->ranks);
    }
    if (e->tp > 1) barrier_destroy(&e->bar);
    free(e->tp_sum);
    pd_model_free(e->own_model);
    pd_tok_free(e->own_tok);
    if (e->slots) {
        for (size_t i = 0; i < e->cap; i++) {
            free(e->slots[i].text);
            free(e->slots[i].stop_str);
            free(e->slots[i].top_ids);
            free(e->slots[i].top_lp);
            free(e->slots[i].blocks);
        }
        free(e->slots);
    }
    free(e->st_tokens);
    free(e->st_qindptr);
    free(e->st_kvlen);
    free(e->st_bindptr);
    free(e->st_blocks);
    free(e->st_outrows);
    free(e->item_out);
    pd_sampler_ws_free(e->ws);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->work_cv);
    pthread_mutex_destroy(&e->qmu);
    pthread_cond_destroy(&e->qcv);
    pthread_mutex_destroy(&e->rmu);
    pthread_cond_destroy(&e->rcv);
    free(e);
}

/* ---- queries ------------------------------------------------------------------------------- */

void pd_engine_get_stats(pd_engine *e, pd_engine_stats *out)
{
    pthread_mutex_lock(&e->mu);
    *out = e->stats;
    out->num_running = pd_sched_num_running(e->sched);
    out->num_waiting = pd_sched_num_waiting(e->sched);
    out->num_held = e->n_held;
    out->queued_tokens = pd_sched_num_queued_tokens(e->sched);
    out->num_preemptions = pd_sched_num_preemptions(e->sched);
    out->kv_blocks_total = pd_kvpool_num_blocks(e->pool);
    out->kv_blocks_free = pd_kvpool_num_free(e->pool);
    out->kv_blocks_cached = pd_kvpool_num_cached(e->pool);
    pd_sched_prefix_cache_stats(e->sched, &out->prefix_cache_queries, &out->prefix_cache_hits);
    out->block_size = e->p.block_size;
    pthread_mutex_unlock(&e->mu);
}

size_t pd_engine_max_model_len(const pd_engine *e)
{
    return e->p.max_model_len;
}
size_t pd_engine_block_size(const pd_engine *e)
{
    return e->p.block_size;
}
size_t pd_engine_vocab(const pd_engine *e)
{
    return e->vocab;
}
const char *pd_engine_allreduce_name(const pd_engine *e)
{
#if PD_HAVE_CUDA
    return e->tp < 2 ? "none" : e->nccl ? "nccl" : "host";
#else
    return e->tp < 2 ? "none" : "host";
#endif
}

int pd_engine_tp_size(const pd_engine *e)
{
    return e->tp;
}
const pd_tok *pd_engine_tokenizer(const pd_engine *e)
{
    return e->tok;
}
const pd_model_config *pd_engine_model_config(const pd_engine *e)
{
    return &e->model->config;
}

pd_backend *pd_engine_backend(const pd_engine *e, int rank)
{
    return rank >= 0 && rank < e->tp ? e->ranks[rank].b : NULL;
}

pd_kv *pd_engine_kv(const pd_engine *e, int rank)
{
    return rank >= 0 && rank < e->tp ? e->ranks[rank].kv : NULL;
}
