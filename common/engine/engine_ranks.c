/* The engine's ranks (engine_internal.h): pipeline stages of tensor-parallel ranks, each rank's
 * forward pass over its backend of its stage's group (backend/group.h), the threads of ranks
 * 1..n-1, and one step's job on every rank: copy-on-write block copies, then the forward pass
 * of its stage's layers.
 *
 * Design: rank r is tensor-parallel rank r % tp of stage r / tp (vLLM's order); each stage is a
 * backend group of its own, so its all-reduce joins its tensor-parallel ranks only. Rank 0 runs
 * on the engine thread; the others wait for a generation counter (rmu/rcv) and report back
 * through jobs_done, so a step costs two wake-ups per rank and no thread is created per step.
 * A stage after the first waits until its predecessor's tensor-parallel rank 0 has put the
 * residual stream of the step into the hand-over buffer (stage_gen), then runs; the stages of
 * one step run one after another (no micro-batches). The backend groups hear when the jobs
 * begin and end, so a rank that fails can never leave the others waiting in an all-reduce, and
 * a failed stage fails the stages after it without running them.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"
#include "util/clock.h"
#include "util/status.h"

_Static_assert(PD_ENGINE_MAX_CUDA_DEVICES == PD_BACKEND_GROUP_MAX_DEVICES,
               "the engine's cuda_devices fit a backend group");

/* ---- one rank's share of a step ----------------------------------------------------------------
 */

static int rank_copy_blocks(pd_engine_rank *rk, const pd_kv_block_copy *c, size_t n)
{
    const pd_backend_ops *o = pd_backend_get_ops(rk->b);
    int n_layers = pd_forward_kv_params(rk->f, 0, 1).n_layers; /* its stage's */
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

/* Waits for the stage before rk's to hand over micro-batch m of this step; its status. */
static int wait_stage(pd_engine_rank *rk, int m)
{
    pd_engine *e = rk->e;
    int s = rk->stage - 1;
    pthread_mutex_lock(&e->rmu);
    while (e->stage_gen[s] != e->job_gen || (e->stage_rc[s] >= 0 && e->stage_mb[s] <= m))
        pthread_cond_wait(&e->rcv, &e->rmu);
    int rc = e->stage_rc[s];
    pthread_mutex_unlock(&e->rmu);
    return rc < 0 ? pd_error(PD_ECANCELLED, "pipeline stage %d failed", s) : PD_OK;
}

/* Stage rk's hand-over: micro-batches [0, n) are in stage_x, or the stage failed (rc). */
static void give_stage(pd_engine_rank *rk, int n, int rc)
{
    pd_engine *e = rk->e;
    pthread_mutex_lock(&e->rmu);
    e->stage_rc[rk->stage] = rc;
    e->stage_mb[rk->stage] = n;
    e->stage_gen[rk->stage] = e->job_gen;
    pthread_cond_broadcast(&e->rcv);
    pthread_mutex_unlock(&e->rmu);
}

/* Splits e->step into up to pp_micro_batches micro-batches of whole sequences, about as many
 * token rows each, so that stage s runs micro-batch m while stage s + 1 runs m - 1. The
 * sub-steps point into the step's arrays; their index arrays are rebased into mb_ints. */
static void split_step(pd_engine *e)
{
    const pd_step *st = &e->step;
    int want = e->p.pp_micro_batches > 0 ? e->p.pp_micro_batches
               : e->p.n_cuda_devices > 0 ? e->pp
                                         : 1;
    int M = want < (int)st->n_seqs ? want : (int)st->n_seqs;
    if (M < 1) M = 1;
    e->n_mb = M;
    const int32_t *q = st->q_indptr, *bi = st->block_indptr;
    size_t rows = (size_t)q[st->n_seqs], a = 0, out = 0;
    int32_t *w = e->mb_ints;
    for (int m = 0; m < M; m++) {
        size_t b = a + 1; /* at least one sequence, and room for one each after it */
        while (b < st->n_seqs - (size_t)(M - 1 - m) &&
               (size_t)q[b] * (size_t)M < rows * (size_t)(m + 1))
            b++;
        if (m == M - 1) b = st->n_seqs;
        pd_step *sub = &e->mb[m].st;
        int32_t *qi = w, *bp = w + (b - a + 1), *orow = bp + (b - a + 1);
        for (size_t i = 0; i <= b - a; i++) {
            qi[i] = q[a + i] - q[a];
            bp[i] = bi[a + i] - bi[a];
        }
        size_t n_out = 0, out0 = out;
        while (out < st->n_out && st->out_rows[out] < q[b])
            orow[n_out++] = st->out_rows[out++] - q[a];
        *sub = (pd_step){.n_seqs = b - a,
                         .token_ids = st->token_ids + q[a],
                         .q_indptr = qi,
                         .kv_len = st->kv_len + a,
                         .block_indptr = bp,
                         .block_ids = st->block_ids + bi[a],
                         .n_out = n_out,
                         .out_rows = orow};
        e->mb[m].row0 = (size_t)q[a];
        e->mb[m].out0 = out0;
        w = orow + n_out;
        a = b;
    }
}

static void rank_job(pd_engine_rank *rk)
{
    pd_engine *e = rk->e;
    bool gives = rk->stage < e->pp - 1 && rk->t == 0; /* the hand-over to the next stage */
    int rc = rank_copy_blocks(rk, e->so.copies, e->so.n_copies);
    int64_t busy = 0, t0 = pd_now_ns();
    if (e->pp == 1) {
        if (rc >= 0) rc = pd_forward_run(rk->f, rk->kv, &e->step, rk->logits);
        busy = pd_now_ns() - t0;
    } else {
        size_t H = e->hidden;
        int m = 0;
        for (; m < e->n_mb && rc >= 0; m++) {
            size_t x = 2 * e->mb[m].row0 * H;
            if (rk->stage > 0) rc = wait_stage(rk, m);
            t0 = pd_now_ns();
            if (rc >= 0)
                rc = pd_forward_run_stage(
                    rk->f, rk->kv, &e->mb[m].st,
                    rk->stage > 0 ? e->stage_x[rk->stage - 1] + x : NULL,
                    rk->stage == e->pp - 1 ? NULL : (gives ? e->stage_x[rk->stage] : rk->x_out) + x,
                    rk->logits ? rk->logits + e->mb[m].out0 * e->vocab : NULL);
            busy += pd_now_ns() - t0;
            if (gives && rc >= 0) give_stage(rk, m + 1, rc);
        }
        if (gives && rc < 0) give_stage(rk, m, rc);
    }
    if (rk->t == 0) atomic_fetch_add_explicit(&rk->busy_ns, busy, memory_order_relaxed);
    rk->rc = rc;
    if (rc < 0)
        snprintf(rk->err, sizeof rk->err, "rank %d (pipeline stage %d): %s", rk->r, rk->stage,
                 pd_last_error());
    else
        rk->err[0] = '\0';
    pd_backend_group_rank_end(e->groups[rk->stage], rk->t, rc);
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

int eng_ranks_run(pd_engine *e)
{
    if (e->pp > 1) split_step(e);
    if (e->n_ranks > 1) {
        for (int s = 0; s < e->pp; s++) pd_backend_group_step_begin(e->groups[s]);
        pthread_mutex_lock(&e->rmu);
        e->jobs_done = 0;
        e->job_gen++;
        pthread_cond_broadcast(&e->rcv);
        pthread_mutex_unlock(&e->rmu);
    }
    rank_job(&e->ranks[0]);
    if (e->n_ranks > 1) {
        pthread_mutex_lock(&e->rmu);
        while (e->jobs_done < e->n_ranks - 1) pthread_cond_wait(&e->rcv, &e->rmu);
        pthread_mutex_unlock(&e->rmu);
        for (int s = 0; s < e->pp; s++) pd_backend_group_step_end(e->groups[s]);
    }
    /* the first failure (a later stage's is "stage s failed") */
    for (int r = 0; r < e->n_ranks; r++)
        if (e->ranks[r].rc < 0 && e->ranks[r].rc != PD_ECANCELLED)
            return pd_error(e->ranks[r].rc, "%s", e->ranks[r].err);
    for (int r = 0; r < e->n_ranks; r++)
        if (e->ranks[r].rc < 0) return pd_error(e->ranks[r].rc, "%s", e->ranks[r].err);
    return PD_OK;
}

/* vLLM's get_pp_indices (the last stage, which computes the logits, gets no extra layer). */
int pd_engine_pp_layers(size_t n_layers, int pp, int stage, size_t *layer0, size_t *count)
{
    size_t part[PD_ENGINE_MAX_PP];
    const char *env = getenv("VLLM_PP_LAYER_PARTITION");
    if (pp < 1 || pp > PD_ENGINE_MAX_PP || (size_t)pp > n_layers)
        return pd_error(PD_EINVAL,
                        "pipeline parallel size %d: must be 1 to %d and at most the model's %zu "
                        "layers",
                        pp, PD_ENGINE_MAX_PP, n_layers);
    if (env && *env) {
        size_t sum = 0;
        int n = 0;
        const char *c = env;
        while (*c && n < PD_ENGINE_MAX_PP + 1) {
            char *end;
            long v = strtol(c, &end, 10);
            if (end == c || v <= 0 || (*end && *end != ','))
                return pd_error(PD_EINVAL,
                                "VLLM_PP_LAYER_PARTITION=%s: expected positive layer counts "
                                "separated by commas",
                                env);
            if (n < PD_ENGINE_MAX_PP) part[n] = (size_t)v;
            n++;
            sum += (size_t)v;
            c = *end ? end + 1 : end;
        }
        if (n != pp || sum != n_layers)
            return pd_error(PD_EINVAL,
                            "VLLM_PP_LAYER_PARTITION=%s: %d stage(s) of %zu layers in all, the "
                            "pipeline has %d stage(s) and the model %zu layers",
                            env, n, sum, pp, n_layers);
    } else {
        for (int s = 0; s < pp; s++) part[s] = n_layers / (size_t)pp;
        for (size_t i = 2; i < n_layers % (size_t)pp + 2; i++) part[pp - (int)i]++;
    }
    *layer0 = 0;
    for (int s = 0; s < stage; s++) *layer0 += part[s];
    *count = part[stage];
    return PD_OK;
}

/* ---- create / free --------------------------------------------------------------------------
 */

pd_backend_group_params eng_group_params(const pd_engine *e, int stage)
{
    const pd_engine_params *p = &e->p;
    return (pd_backend_group_params){
        .n_ranks = p->tp_size,
        .borrowed = p->backend,
        .no_graphs = p->pp_size > 1, /* the stages meet on the host mid-step */
        .n_threads = p->n_threads,
        .cpu_threads_bind = p->cpu_threads_bind,
        .cpu_budget = p->cpu_budget,
        /* a stage's devices (with one stage, as given: the group checks them) */
        .n_cuda_devices = p->pp_size > 1 && p->n_cuda_devices > 0 ? p->tp_size : p->n_cuda_devices,
        .cuda_devices = p->cuda_devices + (p->n_cuda_devices > 0 ? stage * p->tp_size : 0),
        .dtype = p->dtype,
        .gpu_memory_utilization = p->gpu_memory_utilization,
        .max_tokens = p->max_num_batched_tokens,
        .max_seqs = p->max_num_seqs,
        .max_blocks = p->max_num_seqs * e->max_blocks_per_seq,
        .max_allreduce_elems = p->max_num_batched_tokens * e->hidden,
        .kv_cache_bytes = p->kv_cache_bytes,
        .cpu_kv_bytes = (size_t)((p->cpu_kvcache_space_gib > 0 ? p->cpu_kvcache_space_gib
                                                               : PD_ENGINE_CPU_KVCACHE_SPACE_GIB) *
                                 1073741824.0),
    };
}

int eng_ranks_create(pd_engine *e)
{
    pd_engine_params *p = &e->p;
    size_t H = e->hidden, T = p->max_num_batched_tokens;
    for (int st = 0; st < e->pp; st++) {
        pd_backend_group_params gp = eng_group_params(e, st);
        PD_CHECK(pd_backend_group_create(&gp, &e->groups[st]));
        if (st < e->pp - 1 && !(e->stage_x[st] = malloc(2 * T * H * sizeof(float))))
            return pd_error(PD_ENOMEM, "engine: out of memory");
    }
    if (e->pp > 1) { /* each micro-batch: (n + 1) + (n + 1) + its out rows */
        size_t n = 2 * (p->max_num_seqs + PD_ENGINE_MAX_PP) + eng_max_out_rows(p);
        if (!(e->mb_ints = malloc(n * sizeof(int32_t))))
            return pd_error(PD_ENOMEM, "engine: out of memory");
    }
    e->ranks = calloc((size_t)e->n_ranks, sizeof *e->ranks);
    if (!e->ranks) return pd_error(PD_ENOMEM, "engine: out of memory");
    for (int r = 0; r < e->n_ranks; r++) {
        pd_engine_rank *rk = &e->ranks[r];
        rk->e = e;
        rk->r = r;
        rk->stage = r / e->tp;
        rk->t = r % e->tp;
        pd_backend_group *g = e->groups[rk->stage];
        rk->b = pd_backend_group_backend(g, rk->t);
        pd_forward_params fp = pd_forward_default_params();
        fp.shard = (pd_shard){rk->t, e->tp};
        pd_backend_group_allreduce(g, rk->t, &fp.allreduce, &fp.allreduce_ctx);
        fp.max_tokens = p->max_num_batched_tokens;
        fp.max_seqs = p->max_num_seqs;
        fp.max_out = eng_max_out_rows(p);
        fp.kv_dtype = e->kv_dtype;
        PD_CHECK(pd_engine_pp_layers((size_t)e->model->config.num_hidden_layers, e->pp, rk->stage,
                                     &fp.layer0, &fp.n_layers));
        PD_CHECK(pd_forward_create(rk->b, e->model, &fp, &rk->f));
        if (rk->stage < e->pp - 1 && rk->t > 0 && !(rk->x_out = malloc(2 * T * H * sizeof(float))))
            return pd_error(PD_ENOMEM, "engine: out of memory");
    }
    return PD_OK;
}

int eng_ranks_start(pd_engine *e)
{
    for (int r = 1; r < e->n_ranks; r++) {
        if (pthread_create(&e->ranks[r].thread, NULL, rank_main, &e->ranks[r]))
            return pd_error(PD_EINTERNAL, "engine: cannot start the thread of rank %d", r);
        e->ranks[r].thread_started = true;
    }
    return PD_OK;
}

void eng_ranks_free(pd_engine *e)
{
    if (e->ranks) {
        pthread_mutex_lock(&e->rmu);
        e->ranks_quit = true;
        pthread_cond_broadcast(&e->rcv);
        pthread_mutex_unlock(&e->rmu);
        for (int r = 0; r < e->n_ranks; r++)
            if (e->ranks[r].thread_started) pthread_join(e->ranks[r].thread, NULL);
        for (int r = 0; r < e->n_ranks; r++) {
            pd_engine_rank *rk = &e->ranks[r];
            if (rk->kv) pd_backend_get_ops(rk->b)->kv_free(rk->b, rk->kv);
            pd_forward_free(rk->f);
            free(rk->logits);
            free(rk->bounce);
            free(rk->x_out);
        }
        free(e->ranks);
        e->ranks = NULL;
    }
    for (int st = 0; st < PD_ENGINE_MAX_PP; st++) {
        pd_backend_group_free(e->groups[st]); /* after every pool and forward pass on it */
        e->groups[st] = NULL;
        free(e->stage_x[st]);
        e->stage_x[st] = NULL;
    }
    free(e->mb_ints);
    e->mb_ints = NULL;
}
