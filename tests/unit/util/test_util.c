/* Unit tests: status/error messages, logging, arena, clock, thread pool, signals. */
#include "harness.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#include "util/arena.h"
#include "util/clock.h"
#include "util/log.h"
#include "util/signals.h"
#include "util/status.h"
#include "util/threadpool.h"

TEST(status_message_and_name)
{
    int rc = pd_error(PD_EINVAL, "field %s: bad %d", "x", 3);
    ASSERT_EQ_INT(rc, PD_EINVAL);
    ASSERT_STR_EQ(pd_last_error(), "field x: bad 3");
    ASSERT_STR_EQ(pd_status_name(PD_EINVAL), "EINVAL");
    ASSERT_STR_EQ(pd_status_name(PD_ECANCELLED), "ECANCELLED");
    ASSERT_STR_EQ(pd_status_name(12345), "EUNKNOWN");
}

TEST(status_prefix_keeps_message)
{
    pd_error(PD_EPARSE, "line 3: oops");
    ASSERT_EQ_INT(pd_error_prefix(PD_EPARSE, "config.json"), PD_EPARSE);
    ASSERT_STR_EQ(pd_last_error(), "config.json: line 3: oops");
}

static int inner(void)
{
    return pd_error(PD_ENOTFOUND, "tensor w missing");
}
static int outer(void)
{
    PD_CHECK(inner());
    return PD_OK;
}

TEST(status_check_adds_breadcrumb)
{
    ASSERT_EQ_INT(outer(), PD_ENOTFOUND);
    ASSERT_STR_EQ(pd_last_error(), "tensor w missing");
    ASSERT_CONTAINS(pd_last_error_trace(), "test_util.c:");
    pd_error_clear();
    ASSERT_STR_EQ(pd_last_error(), "");
    ASSERT_STR_EQ(pd_last_error_trace(), "");
}

static void *other_thread_error(void *arg)
{
    pd_error(PD_EIO, "other thread");
    *(int *)arg = strcmp(pd_last_error(), "other thread") == 0;
    return NULL;
}

TEST(status_is_thread_local)
{
    pd_error(PD_EINVAL, "main thread");
    pthread_t t;
    int ok = 0;
    pthread_create(&t, NULL, other_thread_error, &ok);
    pthread_join(t, NULL);
    ASSERT(ok);
    ASSERT_STR_EQ(pd_last_error(), "main thread");
}

/* Reads everything the logger wrote to a pipe. */
static void log_capture(char *buf, size_t n, void (*emit)(void))
{
    int p[2];
    if (pipe(p) != 0) abort();
    pd_log_set_fd(p[1]);
    emit();
    pd_log_set_fd(2);
    close(p[1]);
    ssize_t r = read(p[0], buf, n - 1);
    buf[r > 0 ? r : 0] = '\0';
    close(p[0]);
}

static void emit_lines(void)
{
    pd_log_set_level(PD_LOG_INFO);
    pd_log_set_role("prefill");
    PD_INFO("req-7", "hello %d\nworld", 42);
    PD_DEBUG("req-8", "hidden");
    PD_WARN(NULL, "no request");
}

TEST(log_line_format)
{
    char buf[4096];
    log_capture(buf, sizeof buf, emit_lines);
    /* 2026-11-22T10:54:23.123Z INFO  prefill req-7 hello 42 world */
    char *nl = strchr(buf, '\n');
    ASSERT(nl != NULL);
    *nl = '\0';
    ASSERT_EQ_INT(strlen(buf) > 24, 1);
    ASSERT_EQ_INT(buf[4], '-');
    ASSERT_EQ_INT(buf[10], 'T');
    ASSERT_EQ_INT(buf[23], 'Z');
    ASSERT_CONTAINS(buf, " INFO  prefill req-7 hello 42 world");
    ASSERT_CONTAINS(nl + 1, "WARN  prefill - no request");
    ASSERT(strstr(nl + 1, "hidden") == NULL);
}

TEST(log_level_parse)
{
    pd_log_level lv;
    ASSERT_OK(pd_log_parse_level("DEBUG", &lv));
    ASSERT_EQ_INT(lv, PD_LOG_DEBUG);
    ASSERT_OK(pd_log_parse_level("warning", &lv));
    ASSERT_EQ_INT(lv, PD_LOG_WARN);
    ASSERT_ERR(pd_log_parse_level("loud", &lv), PD_EINVAL, "log level 'loud'");
}

TEST(log_env_level)
{
    setenv("PD_LOG_LEVEL", "error", 1);
    pd_log_init("decode");
    ASSERT_EQ_INT(pd_log_get_level(), PD_LOG_ERROR);
    unsetenv("PD_LOG_LEVEL");
    pd_log_set_level(PD_LOG_INFO);
}

TEST(arena_alignment_and_growth)
{
    pd_arena *a = pd_arena_create(64);
    ASSERT(a != NULL);
    char *p1 = pd_arena_alloc(a, 3, 1);
    double *d = pd_arena_alloc(a, sizeof(double) * 4, sizeof(double));
    ASSERT(p1 && d);
    ASSERT_EQ_INT((uintptr_t)d % sizeof(double), 0);
    /* larger than the chunk: a new chunk is made */
    char *big = pd_arena_alloc(a, 10000, 64);
    ASSERT(big != NULL);
    ASSERT_EQ_INT((uintptr_t)big % 64, 0);
    memset(big, 7, 10000);
    ASSERT_EQ_INT(pd_arena_used(a), 3 + 32 + 10000);
    ASSERT(pd_arena_alloc(a, 8, 3) == NULL); /* not a power of two */
    pd_arena_destroy(a);
}

TEST(arena_strings_and_reset)
{
    pd_arena *a = pd_arena_create(0);
    char *s = pd_arena_strdup(a, "hello");
    char *f = pd_arena_sprintf(a, "%s-%d", s, 5);
    char *n = pd_arena_strndup(a, "abcdef", 3);
    ASSERT_STR_EQ(s, "hello");
    ASSERT_STR_EQ(f, "hello-5");
    ASSERT_STR_EQ(n, "abc");
    for (int i = 0; i < 1000; i++) ASSERT(pd_arena_alloc(a, 100, 0) != NULL);
    pd_arena_reset(a);
    ASSERT_EQ_INT(pd_arena_used(a), 0);
    int *z = pd_arena_calloc(a, 16, sizeof(int));
    ASSERT(z != NULL);
    for (int i = 0; i < 16; i++) ASSERT_EQ_INT(z[i], 0);
    ASSERT(pd_arena_calloc(a, SIZE_MAX / 2, 4) == NULL); /* overflow */
    pd_arena_destroy(a);
}

TEST(clock_monotonic_and_sleep)
{
    int64_t t0 = pd_now_ns();
    pd_sleep_ns(2 * PD_NS_PER_MS);
    int64_t t1 = pd_now_ns();
    ASSERT(t1 - t0 >= 2 * PD_NS_PER_MS);
    ASSERT(pd_wall_ns() > 1600000000LL * PD_NS_PER_S); /* after 2020 */
    ASSERT(pd_now_s() > 0);
}

typedef struct {
    atomic_int hits[1000];
    atomic_int calls;
} pool_ctx;

static void pool_task(void *ctx, int i, int n)
{
    pool_ctx *c = ctx;
    (void)n;
    atomic_fetch_add(&c->hits[i], 1);
    atomic_fetch_add(&c->calls, 1);
}

TEST(threadpool_runs_each_task_once)
{
    for (int threads = 1; threads <= 4; threads++) {
        pd_threadpool *p = pd_pool_create(threads);
        ASSERT(p != NULL);
        ASSERT_EQ_INT(pd_pool_size(p), threads);
        static pool_ctx c;
        for (int round = 0; round < 50; round++) {
            memset(&c, 0, sizeof c);
            int n = 1 + (round * 37) % 1000;
            pd_pool_run(p, pool_task, &c, n);
            ASSERT_EQ_INT(atomic_load(&c.calls), n);
            for (int i = 0; i < n; i++) ASSERT_EQ_INT(atomic_load(&c.hits[i]), 1);
        }
        pd_pool_destroy(p);
    }
}

typedef struct {
    atomic_int *hits; /* (n) per-task hit counters of this run */
} race_ctx;

static void race_task(void *ctx, int i, int n)
{
    race_ctx *c = ctx;
    (void)n;
    atomic_fetch_add(&c->hits[i], 1);
}

/* Back-to-back runs of alternating sizes: a worker still leaving run k must never take or
 * count a task of run k + 1 (the bug seen with 16 threads: early returns, wrong results). */
TEST(threadpool_back_to_back_runs_never_mix)
{
    pd_threadpool *p = pd_pool_create(8);
    static atomic_int hits[2][256];
    race_ctx c[2];
    for (int round = 0; round < 100000; round++) {
        int k = round & 1, n = k ? 256 : 3 + round % 7;
        c[k].hits = hits[k];
        for (int i = 0; i < n; i++) atomic_store(&hits[k][i], 0);
        pd_pool_run(p, race_task, &c[k], n);
        for (int i = 0; i < n; i++)
            ASSERT_MSG(atomic_load(&hits[k][i]) == 1, "round %d task %d ran %d times", round, i,
                       atomic_load(&hits[k][i]));
    }
    pd_pool_destroy(p);
}

TEST(threadpool_after_idle_sleep)
{
    pd_threadpool *p = pd_pool_create(3);
    static pool_ctx c;
    memset(&c, 0, sizeof c);
    pd_sleep_ns(20 * PD_NS_PER_MS); /* workers go to sleep on the condvar */
    pd_pool_run(p, pool_task, &c, 100);
    ASSERT_EQ_INT(atomic_load(&c.calls), 100);
    pd_pool_run(p, pool_task, &c, 0); /* no tasks: returns at once */
    ASSERT_EQ_INT(atomic_load(&c.calls), 100);
    ASSERT(pd_cpu_count() >= 1);
    pd_pool_destroy(p);
}

TEST(signals_flag_and_pipe)
{
    ASSERT_OK(pd_signals_install());
    pd_signals_reset();
    ASSERT_EQ_INT(pd_signal_received(), 0);
    raise(SIGTERM);
    ASSERT_EQ_INT(pd_signal_received(), SIGTERM);
    char b;
    ASSERT_EQ_INT(read(pd_signals_fd(), &b, 1), 1);
    raise(SIGINT); /* the first signal is kept */
    ASSERT_EQ_INT(pd_signal_received(), SIGTERM);
    pd_signals_reset();
    ASSERT_EQ_INT(pd_signal_received(), 0);
    raise(SIGPIPE); /* ignored: must not kill the test */
}
