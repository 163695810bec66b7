/* A backend group (group.h): the ranks' backends, their all-reduce, the KV pool's size.
 *
 * Design: written once for every build. What only CUDA can do (its backends, NCCL, GPU memory)
 * goes through backend/cuda/cuda_group.h, which a build without CUDA fills with refusals; the
 * all-reduce is a tp_allreduce.h implementation chosen at create, so nothing below branches on
 * which one runs.
 */
#include "backend/group.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/cuda/cuda_group.h"
#include "backend/tp_allreduce.h"
#include "engine/kvpool.h"
#include "util/clock.h"
#include "util/log.h"
#include "util/status.h"
#include "util/threadpool.h"

#define RANK_FAIL_WAIT_MS 2000 /* how long a failed rank waits for the others before an abort */

typedef struct {
    pd_backend_group *g;
    int rank;
} rank_ctx;

struct pd_backend_group {
    pd_backend_group_params p; /* p.cuda_devices points at devices */
    int devices[PD_BACKEND_GROUP_MAX_DEVICES];
    int n;
    pd_backend **b;      /* (n) */
    bool own;            /* the group created b (else b[0] is borrowed) */
    rank_ctx *ctx;       /* (n) the all-reduce's context of each rank */
    pd_tp_allreduce *ar; /* NULL for one rank */
    /* a step's rank jobs */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int running; /* ranks whose job of this step has not ended (under mu) */
};

int pd_backend_group_check(const pd_backend_group_params *p)
{
    if (p->n_ranks < 1)
        return pd_error(PD_EINVAL, "tensor_parallel_size must be at least 1, got %d", p->n_ranks);
    if (p->n_ranks > 1 && p->borrowed)
        return pd_error(PD_EINVAL,
                        "tensor_parallel_size %d needs engine-created CPU backends "
                        "(params.backend must be NULL)",
                        p->n_ranks);
    if (p->n_cuda_devices < 0 || p->n_cuda_devices > PD_BACKEND_GROUP_MAX_DEVICES)
        return pd_error(PD_EINVAL, "n_cuda_devices must be 0 to %d, got %d",
                        PD_BACKEND_GROUP_MAX_DEVICES, p->n_cuda_devices);
    if (p->n_cuda_devices > 0) {
        PD_CHECK(pd_cuda_group_check());
        if (p->borrowed)
            return pd_error(PD_EINVAL, "a borrowed backend and CUDA devices are exclusive");
        if (p->n_cuda_devices != p->n_ranks)
            return pd_error(PD_EINVAL, "%d CUDA devices for tensor_parallel_size %d",
                            p->n_cuda_devices, p->n_ranks);
        if (!(p->gpu_memory_utilization > 0 && p->gpu_memory_utilization <= 1))
            return pd_error(PD_EINVAL, "gpu_memory_utilization must be in (0, 1], got %g",
                            p->gpu_memory_utilization);
    }
    return PD_OK;
}

/* ---- create / free -------------------------------------------------------------------------
 */

static int create_backends(pd_backend_group *g)
{
    const pd_backend_group_params *p = &g->p;
    if (p->borrowed) {
        g->b[0] = p->borrowed;
        return PD_OK;
    }
    g->own = true;
    int cores = pd_cpu_count();
    int total = p->n_threads > 0 ? p->n_threads : cores;
    int per = total / g->n > 0 ? total / g->n : 1;
    /* with the budget, an explicit thread count is the rank's share: its pool has a thread for
       every core of the host (split across the ranks) and borrows the cores other instances
       leave idle; without --cpu-threads the share is the calling thread alone */
    int host_per = cores / g->n > 0 ? cores / g->n : 1;
    int pool = per > host_per ? per : host_per; /* threads of a budgeted rank's pool */
    int share = p->n_threads > 0 ? per : 1;
    const char *budget = NULL;
    bool pinned = false;
    if (p->n_cuda_devices == 0) PD_CHECK(pd_cores_budget_name(p->cpu_budget, &budget));
    for (int r = 0; r < g->n; r++) {
        pd_backend_params bp = pd_backend_default_params();
        bp.n_threads = per;
        int cpus[PD_CORES_MAX_CPUS], n_cpus = 0;
        if (p->n_cuda_devices == 0) {
            PD_CHECK(pd_cores_parse_bind(p->cpu_threads_bind, r, g->n, cpus, PD_CORES_MAX_CPUS,
                                         &n_cpus));
            bp.cpus = n_cpus ? cpus : NULL;
            bp.n_cpus = n_cpus;
            pinned = n_cpus > 0;
            bp.cpu_budget = n_cpus ? NULL : budget; /* pinned cores are the rank's own */
            if (bp.cpu_budget) bp.n_threads = pool;
            bp.cpu_share = share;
        }
        bp.max_tokens = p->max_tokens;
        bp.max_seqs = p->max_seqs;
        bp.max_blocks = p->max_blocks;
        bp.no_graphs = g->n > 1 || p->no_graphs; /* the all-reduce, or the pipeline, meets the
                                                    host mid-step */
        if (p->n_cuda_devices > 0) {
            bp.device = p->cuda_devices[r];
            bp.weight_dtype = p->dtype;
            PD_CHECK(pd_cuda_group_backend(&bp, &g->b[r]));
        } else {
            bp.compute_dtype = p->dtype;
            PD_CHECK(pd_backend_cpu_create(&bp, &g->b[r]));
        }
    }
    if (p->n_cuda_devices == 0) {
        if (pinned)
            PD_INFO("-", "CPU: %d rank(s), threads pinned (VLLM_CPU_OMP_THREADS_BIND=%s)", g->n,
                    p->cpu_threads_bind);
        else if (budget && p->n_threads > 0)
            PD_INFO("-",
                    "CPU: %d rank(s) x %d threads, %d always (--cpu-threads), the others on idle "
                    "cores; core budget %s",
                    g->n, pool, share, budget);
        else
            PD_INFO("-", "CPU: %d rank(s) x %d threads; core budget %s", g->n, per,
                    budget ? budget : "off (PD_CPU_BUDGET=off)");
    }
    return PD_OK;
}

/* NCCL when the CUDA half offers it, else the host-staged all-reduce; logged. */
static int choose_allreduce(pd_backend_group *g)
{
    if (g->n < 2) return PD_OK;
    if (g->p.n_cuda_devices > 0) {
        int rc = pd_cuda_group_allreduce(g->b, g->n, &g->ar);
        if (rc == PD_OK) return PD_OK;
        if (rc == PD_EUNSUPPORTED) {
            PD_INFO("-", "tensor parallel: %s; host-staged all-reduce over %d ranks",
                    pd_last_error(), g->n);
            return pd_tp_allreduce_host_create(g->n, g->p.max_allreduce_elems, &g->ar);
        }
        PD_WARN("-", "tensor parallel: NCCL unavailable (%s); host-staged all-reduce",
                pd_last_error());
    }
    PD_INFO("-", "tensor parallel: host-staged all-reduce over %d ranks", g->n);
    return pd_tp_allreduce_host_create(g->n, g->p.max_allreduce_elems, &g->ar);
}

int pd_backend_group_create(const pd_backend_group_params *p, pd_backend_group **out)
{
    *out = NULL;
    PD_CHECK(pd_backend_group_check(p));
    pd_backend_group *g = calloc(1, sizeof *g);
    if (!g) return pd_error(PD_ENOMEM, "backend group: out of memory");
    g->p = *p;
    if (p->n_cuda_devices > 0)
        memcpy(g->devices, p->cuda_devices, (size_t)p->n_cuda_devices * sizeof *g->devices);
    g->p.cuda_devices = g->devices;
    g->n = p->n_ranks;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    g->b = calloc((size_t)g->n, sizeof *g->b);
    g->ctx = calloc((size_t)g->n, sizeof *g->ctx);
    int rc = g->b && g->ctx ? PD_OK : pd_error(PD_ENOMEM, "backend group: out of memory");
    for (int r = 0; r < g->n && rc == PD_OK; r++) g->ctx[r] = (rank_ctx){g, r};
    if (rc == PD_OK) rc = create_backends(g);
    if (rc == PD_OK) rc = choose_allreduce(g);
    if (rc < 0) {
        pd_backend_group_free(g);
        return rc;
    }
    *out = g;
    return PD_OK;
}

void pd_backend_group_free(pd_backend_group *g)
{
    if (!g) return;
    if (g->ar) g->ar->ops->free(g->ar); /* before the backends whose streams it used */
    if (g->own && g->b)
        for (int r = 0; r < g->n; r++) pd_backend_free(g->b[r]);
    free(g->b);
    free(g->ctx);
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
    free(g);
}

int pd_backend_group_size(const pd_backend_group *g)
{
    return g->n;
}

pd_backend *pd_backend_group_backend(const pd_backend_group *g, int rank)
{
    return g->b[rank];
}

/* ---- the all-reduce ---------------------------------------------------------------------------
 */

/* pd_allreduce_fn: the chosen implementation, for the rank of ctx. */
static int group_allreduce(void *ctx, pd_backend *b, void *buf, size_t n_elems)
{
    rank_ctx *c = ctx;
    pd_tp_allreduce *ar = c->g->ar;
    return ar->ops->run(ar, c->rank, b, buf, n_elems);
}

void pd_backend_group_allreduce(pd_backend_group *g, int rank, pd_allreduce_fn *fn, void **ctx)
{
    *fn = g->ar ? group_allreduce : NULL;
    *ctx = &g->ctx[rank];
}

const char *pd_backend_group_allreduce_name(const pd_backend_group *g)
{
    return g->ar ? g->ar->ops->name : "none";
}

/* ---- a step's rank jobs -----------------------------------------------------------------------
 */

void pd_backend_group_step_begin(pd_backend_group *g)
{
    if (g->n < 2) return;
    pthread_mutex_lock(&g->mu);
    g->running = g->n;
    pthread_mutex_unlock(&g->mu);
}

/* A rank failed: ranks waiting for its contribution must not wait forever. What fail cannot end
 * is aborted unless every other rank ends its job within RANK_FAIL_WAIT_MS (they failed the same
 * way, before any all-reduce). */
static void rank_failed(pd_backend_group *g)
{
    const pd_tp_allreduce_ops *o = g->ar->ops;
    if (o->fail) o->fail(g->ar);
    if (!o->abort) return;
    int64_t deadline = pd_now_ns() + (int64_t)RANK_FAIL_WAIT_MS * PD_NS_PER_MS;
    pthread_mutex_lock(&g->mu);
    while (g->running > 1 && pd_now_ns() < deadline) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 20 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
        pthread_cond_timedwait(&g->cv, &g->mu, &ts);
    }
    bool stuck = g->running > 1;
    pthread_mutex_unlock(&g->mu);
    if (stuck) o->abort(g->ar);
}

void pd_backend_group_rank_end(pd_backend_group *g, int rank, int status)
{
    (void)rank;
    if (g->n < 2) return;
    if (status < 0) rank_failed(g);
    pthread_mutex_lock(&g->mu);
    g->running--;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

void pd_backend_group_step_end(pd_backend_group *g)
{
    if (g->n < 2 || !g->ar->ops->step_end) return;
    g->ar->ops->step_end(g->ar);
}

/* ---- KV sizing --------------------------------------------------------------------------------
 */

int pd_backend_group_kv_blocks(pd_backend_group *g, const pd_kv_params *kp, size_t *n_blocks)
{
    *n_blocks = 0;
    if (g->p.n_cuda_devices > 0 && g->p.kv_cache_bytes == 0)
        return pd_cuda_group_kv_blocks(g->b, g->n, kp, g->p.gpu_memory_utilization, n_blocks);
    size_t budget = g->p.kv_cache_bytes ? g->p.kv_cache_bytes : g->p.cpu_kv_bytes;
    *n_blocks = pd_kv_blocks_for_bytes(budget, pd_kv_block_bytes(kp));
    return PD_OK;
}
