/* The host-staged tensor-parallel all-reduce (tp_allreduce.h), for every backend.
 *
 * Design: every rank downloads its partial sums as f32 into a staging buffer of its own, then
 * each rank adds a slice of the elements in rank order (rank 0 + rank 1 + ...: the result does
 * not depend on timing), then every rank uploads the full sum (converted to its activation
 * dtype). Two barriers: after staging, after summing. A rank that fails breaks the barrier so no
 * rank waits forever; step_end mends it for the next step.
 */
#include "backend/tp_allreduce.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "util/status.h"

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n;
    int arrived;
    uint64_t gen;
    bool broken;
} tp_barrier;

typedef struct {
    pd_tp_allreduce base;
    int n;
    size_t max_elems;
    tp_barrier bar;
    bool bar_ready;
    float **stage; /* (n) each (max_elems) f32: rank r's partial sums */
    float *sum;    /* (max_elems) f32: the reduced sums */
} host_allreduce;

/* ---- barrier ----------------------------------------------------------------------------------
 */

static int barrier_init(tp_barrier *b, int n)
{
    memset(b, 0, sizeof *b);
    b->n = n;
    if (pthread_mutex_init(&b->mu, NULL))
        return pd_error(PD_EINTERNAL, "tensor parallel: mutex init");
    if (pthread_cond_init(&b->cv, NULL)) {
        pthread_mutex_destroy(&b->mu);
        return pd_error(PD_EINTERNAL, "tensor parallel: cond init");
    }
    return PD_OK;
}

static void barrier_free(tp_barrier *b)
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

/* ---- the all-reduce ---------------------------------------------------------------------------
 */

static int host_run(pd_tp_allreduce *base, int rank, pd_backend *b, void *buf, size_t n_elems)
{
    host_allreduce *a = (host_allreduce *)base;
    const pd_backend_ops *o = pd_backend_get_ops(b);
    if (n_elems > a->max_elems)
        return pd_error(PD_ERANGE, "allreduce: %zu elements exceed the staging size %zu", n_elems,
                        a->max_elems);
    PD_CHECK(o->download_f32(b, a->stage[rank], buf, n_elems));
    PD_CHECK(o->sync(b));
    PD_CHECK(barrier_wait(&a->bar));
    size_t t = (size_t)a->n, r = (size_t)rank;
    size_t lo = n_elems * r / t, hi = n_elems * (r + 1) / t;
    for (size_t j = lo; j < hi; j++) {
        float s = a->stage[0][j];
        for (size_t k = 1; k < t; k++) s += a->stage[k][j];
        a->sum[j] = s;
    }
    PD_CHECK(barrier_wait(&a->bar));
    PD_CHECK(o->upload_f32(b, buf, a->sum, n_elems)); /* into the activation dtype */
    PD_CHECK(o->sync(b));
    return PD_OK;
}

static void host_fail(pd_tp_allreduce *base)
{
    tp_barrier *b = &((host_allreduce *)base)->bar;
    pthread_mutex_lock(&b->mu);
    b->broken = true;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
}

static void host_step_end(pd_tp_allreduce *base)
{
    tp_barrier *b = &((host_allreduce *)base)->bar;
    pthread_mutex_lock(&b->mu);
    b->broken = false;
    b->arrived = 0;
    pthread_mutex_unlock(&b->mu);
}

static void host_ar_free(pd_tp_allreduce *base)
{
    host_allreduce *a = (host_allreduce *)base;
    if (!a) return;
    if (a->bar_ready) barrier_free(&a->bar);
    if (a->stage)
        for (int r = 0; r < a->n; r++) free(a->stage[r]);
    free(a->stage);
    free(a->sum);
    free(a);
}

static const pd_tp_allreduce_ops host_ops = {
    .name = "host",
    .run = host_run,
    .fail = host_fail,
    .abort = NULL,
    .step_end = host_step_end,
    .free = host_ar_free,
};

int pd_tp_allreduce_host_create(int n_ranks, size_t max_elems, pd_tp_allreduce **out)
{
    *out = NULL;
    host_allreduce *a = calloc(1, sizeof *a);
    if (!a) return pd_error(PD_ENOMEM, "tensor parallel: out of memory for the staging");
    a->base.ops = &host_ops;
    a->n = n_ranks;
    a->max_elems = max_elems;
    int rc = barrier_init(&a->bar, n_ranks);
    a->bar_ready = rc == PD_OK;
    a->stage = rc == PD_OK ? calloc((size_t)n_ranks, sizeof *a->stage) : NULL;
    a->sum = rc == PD_OK ? malloc(max_elems * sizeof(float)) : NULL;
    if (rc == PD_OK && (!a->stage || !a->sum))
        rc = pd_error(PD_ENOMEM, "tensor parallel: out of memory for the staging");
    for (int r = 0; r < n_ranks && rc == PD_OK; r++) {
        a->stage[r] = malloc(max_elems * sizeof(float));
        if (!a->stage[r])
            rc = pd_error(PD_ENOMEM, "tensor parallel: out of memory for the staging");
    }
    if (rc < 0) {
        host_ar_free(&a->base);
        return rc;
    }
    *out = &a->base;
    return PD_OK;
}
