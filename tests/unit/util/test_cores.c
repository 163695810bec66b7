/* Unit tests: the host core budget shared by thread pools (util/cores.h), its recovery from a
 * process that died holding cores, and pinning by VLLM_CPU_OMP_THREADS_BIND's core lists. Each
 * test uses a budget of its own name and removes it. */
#define _GNU_SOURCE
#include "harness.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "util/clock.h"
#include "util/cores.h"
#include "util/status.h"
#include "util/threadpool.h"

/* A budget name private to this process and test; its segment is removed by drop(). */
static const char *budget_name(const char *tag)
{
    static char name[64];
    snprintf(name, sizeof name, "test-%d-%s", (int)getpid(), tag);
    return name;
}

static void drop(const char *name)
{
    char path[96];
    snprintf(path, sizeof path, "/pdserve-cpu-%s", name);
    shm_unlink(path);
}

/* The free cores a new pool of budget name finds (opening recovers dead holders' cores), or
 * -1000 when it cannot open it. */
static int free_after_open(const char *name)
{
    pd_cores *c = NULL;
    if (pd_cores_open(name, 2, &c) != PD_OK) return -1000;
    int n = pd_cores_free_now(c);
    pd_cores_free(c);
    return n;
}

TEST(cores_bind_lists)
{
    int cpus[16], n = -1;
    ASSERT_OK(pd_cores_parse_bind(NULL, 0, 1, cpus, 16, &n));
    ASSERT_EQ_INT(n, 0);
    ASSERT_OK(pd_cores_parse_bind("all", 0, 2, cpus, 16, &n));
    ASSERT_EQ_INT(n, 0);
    ASSERT_OK(pd_cores_parse_bind("auto", 0, 1, cpus, 16, &n));
    ASSERT_EQ_INT(n, 0);
    ASSERT_OK(pd_cores_parse_bind("0,2,4-6", 0, 1, cpus, 16, &n));
    ASSERT_EQ_INT(n, 5);
    ASSERT_EQ_INT(cpus[0], 0);
    ASSERT_EQ_INT(cpus[1], 2);
    ASSERT_EQ_INT(cpus[4], 6);
    ASSERT_OK(pd_cores_parse_bind("0-3|4-7", 1, 2, cpus, 16, &n));
    ASSERT_EQ_INT(n, 4);
    ASSERT_EQ_INT(cpus[0], 4);
    ASSERT_EQ_INT(cpus[3], 7);
    ASSERT_ERR(pd_cores_parse_bind("0-3", 0, 2, cpus, 16, &n), PD_EINVAL,
               "VLLM_CPU_OMP_THREADS_BIND: 1 core list for 2 tensor-parallel ranks");
    ASSERT_ERR(pd_cores_parse_bind("0-3|x", 1, 2, cpus, 16, &n), PD_EINVAL,
               "VLLM_CPU_OMP_THREADS_BIND: 'x' is not a core list");
    ASSERT_ERR(pd_cores_parse_bind("3-1", 0, 1, cpus, 16, &n), PD_EINVAL, "'3-1'");
    ASSERT_ERR(pd_cores_parse_bind("0,", 0, 1, cpus, 16, &n), PD_EINVAL, "'0,'");
    ASSERT_ERR(pd_cores_parse_bind("1,1", 0, 1, cpus, 16, &n), PD_EINVAL, "core 1 listed twice");
    ASSERT_ERR(pd_cores_parse_bind("0-20", 0, 1, cpus, 16, &n), PD_EINVAL, "more than 16 cores");
    ASSERT_ERR(pd_cores_parse_bind("5000", 0, 1, cpus, 16, &n), PD_EINVAL, "'5000'");
}

TEST(cores_budget_names)
{
    const char *name = NULL;
    ASSERT_OK(pd_cores_budget_name(NULL, &name));
    ASSERT_STR_EQ(name, "host");
    ASSERT_OK(pd_cores_budget_name("host", &name));
    ASSERT_STR_EQ(name, "host");
    ASSERT_OK(pd_cores_budget_name("off", &name));
    ASSERT(name == NULL);
    ASSERT_OK(pd_cores_budget_name("rack-7", &name));
    ASSERT_STR_EQ(name, "rack-7");
    ASSERT_ERR(pd_cores_budget_name("a/b", &name), PD_EINVAL, "PD_CPU_BUDGET: 'a/b'");
    pd_cores *c = NULL;
    ASSERT_ERR(pd_cores_open("", 2, &c), PD_EINVAL, "cpu budget: name ''");
}

TEST(cores_take_and_give)
{
    const char *name = budget_name("take");
    pd_cores *a = NULL, *b = NULL;
    ASSERT_OK(pd_cores_open(name, 3, &a));
    ASSERT_OK(pd_cores_open(name, 99, &b)); /* the first opener's count holds */
    ASSERT_EQ_INT(pd_cores_total(b), 3);
    ASSERT_EQ_INT(pd_cores_take(a, 5, 0), 2); /* its own core + the 2 left */
    ASSERT_EQ_INT(pd_cores_free_now(a), 0);
    ASSERT_EQ_INT(pd_cores_take(b, 2, 0), 0); /* the caller's core is never refused */
    ASSERT_EQ_INT(pd_cores_free_now(a), -1);
    pd_cores_give(a, 3);
    ASSERT_EQ_INT(pd_cores_take(b, 0, 0), 0);
    ASSERT_EQ_INT(pd_cores_free_now(a), 1);
    pd_cores_give(b, 2);
    ASSERT_EQ_INT(pd_cores_free_now(a), 3);
    /* a pool closed while holding cores gives them back */
    ASSERT_EQ_INT(pd_cores_take(b, 1, 0), 1);
    pd_cores_free(b);
    ASSERT_EQ_INT(pd_cores_free_now(a), 3);
    /* a share is taken whether free or not, the rest only while free */
    ASSERT_OK(pd_cores_open(name, 3, &b));
    ASSERT_EQ_INT(pd_cores_take(a, 4, 1), 2); /* its core + its share of 1 + the 1 left */
    ASSERT_EQ_INT(pd_cores_free_now(a), 0);
    ASSERT_EQ_INT(pd_cores_take(b, 4, 1), 1); /* its core and its share: 2 over the budget */
    ASSERT_EQ_INT(pd_cores_free_now(a), -2);
    ASSERT_EQ_INT(pd_cores_take(b, 1, 5), 1); /* a share above want is want */
    pd_cores_give(b, 2);
    pd_cores_give(b, 2);
    pd_cores_give(a, 3);
    ASSERT_EQ_INT(pd_cores_free_now(a), 3);
    pd_cores_free(b);
    pd_cores_free(a);
    drop(name);
}

/* A process killed mid-run (here: exiting without giving back) leaves its slot's count; the
 * next pool to open the budget returns those cores. */
TEST(cores_dead_holder_reclaimed)
{
    const char *name = budget_name("dead");
    pd_cores *a = NULL;
    ASSERT_OK(pd_cores_open(name, 2, &a));
    pid_t pid = fork();
    if (pid == 0) {
        pd_cores *c = NULL;
        if (pd_cores_open(name, 2, &c) != PD_OK || pd_cores_take(c, 1, 0) != 1) _exit(1);
        _exit(0); /* holding both cores */
    }
    ASSERT(pid > 0);
    int st = 0;
    ASSERT(waitpid(pid, &st, 0) == pid);
    ASSERT_EQ_INT(WIFEXITED(st) ? WEXITSTATUS(st) : -1, 0);
    ASSERT_EQ_INT(pd_cores_free_now(a), 0);
    ASSERT_EQ_INT(free_after_open(name), 2);
    pd_cores_free(a);
    drop(name);
}

/* Tasks that sleep, counting how many run at once (across pools) and on which threads. */
typedef struct {
    atomic_int *running, *peak;
    atomic_int foreign; /* tasks run by a thread other than the pool's caller */
    pthread_t caller;
    int64_t sleep_ns;
    atomic_bool *until; /* non-NULL: each task also lasts until it is set (10 s at most) */
} busy_ctx;

static void busy_task(void *ctx, int i, int n)
{
    busy_ctx *c = ctx;
    (void)i, (void)n;
    int now = atomic_fetch_add(c->running, 1) + 1;
    int p = atomic_load(c->peak);
    while (now > p && !atomic_compare_exchange_weak(c->peak, &p, now)) {
    }
    if (!pthread_equal(pthread_self(), c->caller)) atomic_fetch_add(&c->foreign, 1);
    pd_sleep_ns(c->sleep_ns);
    for (int64_t end = pd_now_ns() + 10 * PD_NS_PER_S;
         c->until && !atomic_load(c->until) && pd_now_ns() < end;)
        pd_sleep_ns(c->sleep_ns);
    atomic_fetch_sub(c->running, 1);
}

static pd_threadpool *shared_pool(int threads, const char *name, int cores)
{
    pd_threadpool *p = pd_pool_create(threads);
    pd_cores *c = NULL;
    if (!p || pd_cores_open(name, cores, &c) != PD_OK) {
        pd_pool_free(p);
        return NULL;
    }
    pd_pool_share(p, c, 1);
    return p;
}

TEST(pool_threads_bounded_by_budget)
{
    const char *name = budget_name("bound");
    static atomic_int running, peak;
    for (int cores = 1; cores <= 3; cores++) {
        pd_threadpool *p = shared_pool(4, name, cores);
        ASSERT(p != NULL);
        busy_ctx c = {.running = &running,
                      .peak = &peak,
                      .caller = pthread_self(),
                      .sleep_ns = 300 * PD_NS_PER_US};
        atomic_store(&peak, 0);
        /* 5 runs, then more (5 s at most) until a worker has joined: a loaded machine may
           leave the workers unscheduled for a while */
        int64_t end = pd_now_ns() + 5 * PD_NS_PER_S;
        for (int round = 0; round < 5 || (cores > 1 && atomic_load(&peak) < 2 && pd_now_ns() < end);
             round++)
            pd_pool_run(p, busy_task, &c, 40);
        ASSERT_MSG(atomic_load(&peak) <= cores, "%d cores: %d tasks ran at once", cores,
                   atomic_load(&peak));
        if (cores == 1) ASSERT_EQ_INT(atomic_load(&c.foreign), 0);
        if (cores == 3)
            ASSERT_MSG(atomic_load(&peak) >= 2, "3 cores, 4 threads: never more than %d at once",
                       atomic_load(&peak));
        pd_pool_free(p);
        drop(name);
    }
}

typedef struct {
    pd_threadpool *pool;
    busy_ctx *c;
    int n_tasks;
} run_arg;

static void *run_thread(void *arg)
{
    run_arg *r = arg;
    r->c->caller = pthread_self();
    pd_pool_run(r->pool, busy_task, r->c, r->n_tasks);
    return NULL;
}

/* Two pools of 2 threads on a budget of 2 cores: while one run holds both cores, the other
 * pool's run gets only its caller (3 threads at once, not 4); afterwards every core is free.
 * Pool a's tasks last until b's run is over, so a's worker joins however loaded the machine. */
TEST(pools_share_the_budget)
{
    const char *name = budget_name("share");
    static atomic_int running, peak;
    pd_threadpool *a = shared_pool(2, name, 2), *b = shared_pool(2, name, 2);
    ASSERT(a && b);
    static atomic_bool b_done;
    atomic_store(&b_done, false);
    busy_ctx ca = {
        .running = &running, .peak = &peak, .sleep_ns = PD_NS_PER_MS / 2, .until = &b_done};
    busy_ctx cb = {
        .running = &running, .peak = &peak, .caller = pthread_self(), .sleep_ns = PD_NS_PER_MS};
    run_arg ra = {a, &ca, 4};
    pthread_t t;
    ASSERT(pthread_create(&t, NULL, run_thread, &ra) == 0);
    int64_t deadline = pd_now_ns() + 5 * PD_NS_PER_S;
    while (atomic_load(&ca.foreign) == 0 && pd_now_ns() < deadline) pd_sleep_ns(PD_NS_PER_MS / 4);
    pd_pool_run(b, busy_task, &cb, 10);
    atomic_store(&b_done, true);
    pthread_join(t, NULL);
    ASSERT_MSG(atomic_load(&ca.foreign) > 0, "pool a never used its worker");
    ASSERT_EQ_INT(atomic_load(&cb.foreign), 0);
    ASSERT_MSG(atomic_load(&peak) <= 3, "%d tasks at once on 2 cores", atomic_load(&peak));
    pd_pool_free(a);
    ASSERT_EQ_INT(free_after_open(name), 2);
    pd_pool_free(b);
    drop(name);
}

typedef struct {
    atomic_int bad;
    pthread_t caller;
    int caller_cpu, worker_cpu;
} pin_ctx;

static void pin_task(void *ctx, int i, int n)
{
    pin_ctx *c = ctx;
    (void)i, (void)n;
    int want = pthread_equal(pthread_self(), c->caller) ? c->caller_cpu : c->worker_cpu;
    if (sched_getcpu() != want) atomic_fetch_add(&c->bad, 1);
    pd_sleep_ns(50 * PD_NS_PER_US);
}

TEST(pool_pinned_by_bind_list)
{
    cpu_set_t mine;
    ASSERT(sched_getaffinity(0, sizeof mine, &mine) == 0);
    int allowed[2], n_allowed = 0;
    for (int cpu = 0; cpu < CPU_SETSIZE && n_allowed < 2; cpu++)
        if (CPU_ISSET(cpu, &mine)) allowed[n_allowed++] = cpu;
    if (n_allowed < 2) SKIP("one core: nothing to pin apart");
    int cpus[2] = {allowed[1], allowed[0]};
    pd_threadpool *p = pd_pool_create(2);
    ASSERT(p != NULL);
    ASSERT_ERR(pd_pool_pin(p, cpus, 1), PD_EINVAL, "VLLM_CPU_OMP_THREADS_BIND: 1 cores for 2");
    ASSERT_OK(pd_pool_pin(p, cpus, 2));
    pin_ctx c = {.caller = pthread_self(), .caller_cpu = cpus[0], .worker_cpu = cpus[1]};
    for (int round = 0; round < 5; round++) pd_pool_run(p, pin_task, &c, 20);
    ASSERT_EQ_INT(atomic_load(&c.bad), 0);
    pd_pool_free(p);
    cpu_set_t all = mine; /* this thread was pinned as the pool's caller: undo */
    ASSERT(sched_setaffinity(0, sizeof all, &all) == 0);
}
