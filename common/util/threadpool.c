/* Fork-join pool (see threadpool.h). A run publishes (fn, ctx, n) and bumps a
 * generation counter; threads claim task indices from a counter tagged with the generation, so
 * uneven tasks balance themselves. Workers spin ~50 µs on the generation before sleeping on a
 * condvar. A worker joins a run only with one of its tickets: the caller hands out as many as
 * the host's core budget grants (util/cores.h), and a worker without one sleeps at once instead
 * of spinning on a core another instance needs. */
#define _GNU_SOURCE
#include "util/threadpool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "util/cores.h"
#include "util/log.h"
#include "util/status.h"

#define SPIN_ITERS 20000

struct pd_threadpool {
    int n_threads; /* including the caller */
    pthread_t *threads;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_uint generation;
    /* (generation << 32) | next task index. A task is claimed only by a CAS that sees the
     * claimer's generation, so a worker still finishing an old run can never take (or count)
     * a task of the next one. */
    _Atomic uint64_t next;
    atomic_int done_tasks;
    atomic_int sleepers;
    atomic_bool stop;
    /* the run being published: written while `next` carries the new generation with the
     * index closed (UINT32_MAX), so no worker of any generation can claim meanwhile */
    pd_task_fn fn;
    void *ctx;
    atomic_int n_tasks;
    atomic_int tickets; /* workers that may still join the current run */
    pd_cores *budget;   /* owned; NULL: every worker joins every run */
    int share;          /* with budget: threads a run takes whether cores are free or not */
    int pin_caller;     /* a core to pin the next caller of pd_pool_run to, or -1 */
};

int pd_cpu_count(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Runs tasks of generation gen until none is left to claim. The run's fn/ctx/n are read only
 * after a successful claim: a claim proves the run is gen's and still incomplete, so the caller
 * cannot be publishing the next one. */
static void run_tasks(pd_threadpool *p, unsigned gen)
{
    for (;;) {
        uint64_t v = atomic_load_explicit(&p->next, memory_order_acquire);
        if ((unsigned)(v >> 32) != gen ||
            (uint32_t)v >= (uint32_t)atomic_load_explicit(&p->n_tasks, memory_order_acquire))
            return;
        if (!atomic_compare_exchange_weak(&p->next, &v, v + 1)) continue;
        int n = atomic_load_explicit(&p->n_tasks, memory_order_relaxed);
        p->fn(p->ctx, (int)(uint32_t)v, n);
        atomic_fetch_add_explicit(&p->done_tasks, 1, memory_order_release);
    }
}

static bool take_ticket(pd_threadpool *p)
{
    int t = atomic_load(&p->tickets);
    while (t > 0)
        if (atomic_compare_exchange_weak(&p->tickets, &t, t - 1)) return true;
    return false;
}

static void *worker_main(void *arg)
{
    pd_threadpool *p = arg;
    /* the generation at create, not the current one: a worker that starts after the first run
       was published must still join it */
    unsigned seen = 0;
    int spins = 0;
    for (;;) {
        while (atomic_load_explicit(&p->generation, memory_order_acquire) == seen &&
               !atomic_load(&p->stop)) {
            if (++spins < SPIN_ITERS) {
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->sleepers, 1);
            while (atomic_load(&p->generation) == seen && !atomic_load(&p->stop))
                pthread_cond_wait(&p->cv, &p->mu);
            atomic_fetch_sub(&p->sleepers, 1);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->stop)) return NULL;
        seen = atomic_load_explicit(&p->generation, memory_order_acquire);
        if (take_ticket(p)) {
            run_tasks(p, seen);
            spins = 0; /* the next run is likely microseconds away */
        } else {
            spins = SPIN_ITERS; /* the budget gave this run fewer workers: sleep */
        }
    }
}

pd_threadpool *pd_pool_create(int n_threads)
{
    if (n_threads <= 0) n_threads = pd_cpu_count();
    pd_threadpool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->n_threads = n_threads;
    p->pin_caller = -1;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    if (n_threads > 1) {
        p->threads = calloc((size_t)n_threads - 1, sizeof *p->threads);
        if (!p->threads) {
            free(p);
            return NULL;
        }
        for (int i = 0; i < n_threads - 1; i++) {
            if (pthread_create(&p->threads[i], NULL, worker_main, p) != 0) {
                p->n_threads = i + 1; /* keep the ones that started */
                break;
            }
        }
    }
    return p;
}

void pd_pool_free(pd_threadpool *p)
{
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, true);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_threads - 1; i++) pthread_join(p->threads[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    pd_cores_free(p->budget);
    free(p->threads);
    free(p);
}

int pd_pool_size(const pd_threadpool *p)
{
    return p->n_threads;
}

void pd_pool_share(pd_threadpool *p, pd_cores *budget, int share)
{
    pd_cores_free(p->budget);
    p->budget = budget;
    p->share = share > 1 ? share : 1;
}

int pd_pool_pin(pd_threadpool *p, const int *cpus, int n)
{
    if (n != p->n_threads)
        return pd_error(PD_EINVAL, "VLLM_CPU_OMP_THREADS_BIND: %d cores for %d threads", n,
                        p->n_threads);
    for (int i = 0; i < n - 1; i++) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus[i + 1], &set);
        int rc = pthread_setaffinity_np(p->threads[i], sizeof set, &set);
        if (rc != 0)
            return pd_error(PD_EINVAL, "VLLM_CPU_OMP_THREADS_BIND: cannot run on core %d: %s",
                            cpus[i + 1], strerror(rc));
    }
    cpu_set_t mine;
    if (sched_getaffinity(0, sizeof mine, &mine) == 0 && !CPU_ISSET(cpus[0], &mine))
        return pd_error(PD_EINVAL,
                        "VLLM_CPU_OMP_THREADS_BIND: core %d is not one this process may "
                        "run on",
                        cpus[0]);
    p->pin_caller = cpus[0];
    return PD_OK;
}

static void run_inline(pd_task_fn fn, void *ctx, int n_tasks)
{
    for (int i = 0; i < n_tasks; i++) fn(ctx, i, n_tasks);
}

void pd_pool_run(pd_threadpool *p, pd_task_fn fn, void *ctx, int n_tasks)
{
    if (n_tasks <= 0) return;
    if (p->pin_caller >= 0) {
        if (pd_cores_pin_self(p->pin_caller) != PD_OK) PD_WARN("-", "%s", pd_last_error());
        p->pin_caller = -1;
    }
    int want = (n_tasks < p->n_threads ? n_tasks : p->n_threads) - 1;
    int extra = p->budget ? pd_cores_take(p->budget, want, p->share - 1) : want;
    if (extra == 0) {
        run_inline(fn, ctx, n_tasks);
        if (p->budget) pd_cores_give(p->budget, 1);
        return;
    }
    unsigned gen = atomic_load(&p->generation) + 1;
    /* close: a late worker of the previous run now sees a foreign generation and leaves */
    atomic_store(&p->next, ((uint64_t)gen << 32) | UINT32_MAX);
    p->fn = fn;
    p->ctx = ctx;
    atomic_store(&p->n_tasks, n_tasks);
    atomic_store(&p->done_tasks, 0);
    atomic_store(&p->tickets, extra);
    /* open, then wake the workers */
    atomic_store_explicit(&p->next, (uint64_t)gen << 32, memory_order_release);
    atomic_store(&p->generation, gen); /* seq_cst: ordered before the load of sleepers below, so
                                          a worker going to sleep sees it or is woken */
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
    run_tasks(p, gen);
    while (atomic_load_explicit(&p->done_tasks, memory_order_acquire) < n_tasks) cpu_relax();
    /* A ticket left untaken (the run was over before its worker came) stays: the worker that
       takes it finds no task and spins on, ready for the next run. */
    if (p->budget) pd_cores_give(p->budget, 1 + extra);
}
