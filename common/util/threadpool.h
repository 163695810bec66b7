/* A small fork-join thread pool for data-parallel kernels.
 *
 * pd_pool_run(fn, ctx, n) calls fn(ctx, i, n) for every i in [0, n) across the pool's
 * threads (the caller is one of them) and returns when all calls are done. Workers spin
 * briefly between runs and then sleep, so back-to-back runs inside a forward pass cost
 * microseconds while an idle pool costs nothing. One run at a time per pool: a pool is
 * owned by one caller thread (an engine), not shared.
 */
#ifndef PD_UTIL_THREADPOOL_H
#define PD_UTIL_THREADPOOL_H

#include "util/cores.h"

typedef struct pd_threadpool pd_threadpool;
typedef void (*pd_task_fn)(void *ctx, int task, int n_tasks);

/* n_threads counts the caller: 1 runs everything inline. <= 0 means all online cores. */
pd_threadpool *pd_pool_create(int n_threads);
void pd_pool_free(pd_threadpool *pool);
int pd_pool_size(const pd_threadpool *pool);
void pd_pool_run(pd_threadpool *pool, pd_task_fn fn, void *ctx, int n_tasks);

/* Runs take their threads from budget (which the pool now owns; NULL: none): the caller's and
 * share - 1 workers' always (share <= 1: the caller's alone), the other workers' only while the
 * host has cores free (util/cores.h). */
void pd_pool_share(pd_threadpool *pool, pd_cores *budget, int share);

/* Pins worker i to cpus[i + 1] now and the next caller of pd_pool_run to cpus[0]; n must be the
 * pool's size. Errors name VLLM_CPU_OMP_THREADS_BIND (where the list comes from). */
int pd_pool_pin(pd_threadpool *pool, const int *cpus, int n);

/* Number of online cores (>= 1). */
int pd_cpu_count(void);

#endif
