/* The engine's tensor-parallel ranks (engine_internal.h): each rank's forward pass over its
 * backend of the group (backend/group.h), the threads of ranks 1..t-1, and one step's job on
 * every rank: copy-on-write block copies, then the forward pass.
 *
 * Design: rank 0 runs on the engine thread; the others wait for a generation counter (rmu/rcv)
 * and report back through jobs_done, so a step costs two wake-ups per rank and no thread is
 * created per step. The backend group hears when the jobs begin and end, so a rank that fails
 * can never leave the others waiting in an all-reduce.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

#include "engine/engine_internal.h"
#include "util/status.h"

_Static_assert(PD_ENGINE_MAX_CUDA_DEVICES == PD_BACKEND_GROUP_MAX_DEVICES,
               "the engine's cuda_devices fit a backend group");

/* ---- one rank's share of a step ----------------------------------------------------------------
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
    if (rc < 0)
        snprintf(rk->err, sizeof rk->err, "rank %d: %s", rk->r, pd_last_error());
    else
        rk->err[0] = '\0';
    pd_backend_group_rank_end(e->group, rk->r, rc);
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
    if (e->tp > 1) {
        pd_backend_group_step_begin(e->group);
        pthread_mutex_lock(&e->rmu);
        e->jobs_done = 0;
        e->job_gen++;
        pthread_cond_broadcast(&e->rcv);
        pthread_mutex_unlock(&e->rmu);
    }
    rank_job(&e->ranks[0]);
    if (e->tp > 1) {
        pthread_mutex_lock(&e->rmu);
        while (e->jobs_done < e->tp - 1) pthread_cond_wait(&e->rcv, &e->rmu);
        pthread_mutex_unlock(&e->rmu);
        pd_backend_group_step_end(e->group);
    }
    for (int r = 0; r < e->tp; r++)
        if (e->ranks[r].rc < 0) return pd_error(e->ranks[r].rc, "%s", e->ranks[r].err);
    return PD_OK;
}

/* ---- create / free --------------------------------------------------------------------------
 */

pd_backend_group_params eng_group_params(const pd_engine *e)
{
    const pd_engine_params *p = &e->p;
    return (pd_backend_group_params){
        .n_ranks = p->tp_size,
        .borrowed = p->backend,
        .n_threads = p->n_threads,
        .cpu_threads_bind = p->cpu_threads_bind,
        .cpu_budget = p->cpu_budget,
        .n_cuda_devices = p->n_cuda_devices,
        .cuda_devices = p->cuda_devices,
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
    pd_backend_group_params gp = eng_group_params(e);
    PD_CHECK(pd_backend_group_create(&gp, &e->group));
    e->ranks = calloc((size_t)e->tp, sizeof *e->ranks);
    if (!e->ranks) return pd_error(PD_ENOMEM, "engine: out of memory");
    for (int r = 0; r < e->tp; r++) {
        pd_engine_rank *rk = &e->ranks[r];
        rk->e = e;
        rk->r = r;
        rk->b = pd_backend_group_backend(e->group, r);
        pd_forward_params fp = pd_forward_default_params();
        fp.shard = (pd_shard){r, e->tp};
        pd_backend_group_allreduce(e->group, r, &fp.allreduce, &fp.allreduce_ctx);
        fp.max_tokens = p->max_num_batched_tokens;
        fp.max_seqs = p->max_num_seqs;
        fp.max_out = eng_max_out_rows(p);
        fp.kv_dtype = e->kv_dtype;
        PD_CHECK(pd_forward_create(rk->b, e->model, &fp, &rk->f));
    }
    return PD_OK;
}

int eng_ranks_start(pd_engine *e)
{
    for (int r = 1; r < e->tp; r++) {
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
        for (int r = 0; r < e->tp; r++)
            if (e->ranks[r].thread_started) pthread_join(e->ranks[r].thread, NULL);
        for (int r = 0; r < e->tp; r++) {
            pd_engine_rank *rk = &e->ranks[r];
            if (rk->kv) pd_backend_get_ops(rk->b)->kv_free(rk->b, rk->kv);
            pd_forward_free(rk->f);
            free(rk->logits);
            free(rk->bounce);
        }
        free(e->ranks);
        e->ranks = NULL;
    }
    pd_backend_group_free(e->group); /* after every pool and forward pass on its backends */
    e->group = NULL;
}
