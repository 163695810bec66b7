/* Unit tests: status/error messages, logging, arena, clock, thread pool, signals, the flag
 * table. */
#include "harness.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "engine/engine.h"
#include "node/node.h"
#include "util/arena.h"
#include "util/clock.h"
#include "util/flags.h"
#include "util/fmt.h"
#include "util/idmap.h"
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

static int count_lines(const char *s, const char *needle)
{
    int n = 0;
    for (const char *p = strstr(s, needle); p; p = strstr(p + 1, needle)) n++;
    return n;
}

static void emit_limited(int times, const char *rid)
{
    for (int i = 0; i < times; i++)
        PD_WARN_EVERY(200, rid, "Reserve refused: KV cache full (%d)", i); /* one site */
}

static void emit_flood(void)
{
    pd_log_set_level(PD_LOG_INFO);
    pd_log_set_role("decode");
    emit_limited(95, "req-a"); /* the first line, 94 counted */
    pd_sleep_ns(250 * PD_NS_PER_MS);
    emit_limited(1, "req-b");                 /* the window has passed: written, with the count */
    emit_limited(3, "req-c");                 /* counted again */
    PD_WARN_EVERY(200, NULL, "another site"); /* a site of its own */
    pd_log_set_level(PD_LOG_ERROR);
    emit_limited(10, "req-d"); /* below the level: neither written nor counted */
    pd_log_set_level(PD_LOG_INFO);
    pd_sleep_ns(250 * PD_NS_PER_MS);
    emit_limited(1, "req-e");
}

/* A flood from one call site (the decode instance refusing Reserve 95 times a second while KV
 * is full) becomes one line per window, and the next line says how many were left out. */
TEST(log_rate_limited_site)
{
    char buf[8192];
    log_capture(buf, sizeof buf, emit_flood);
    ASSERT_EQ_INT(count_lines(buf, "\n"), 4);
    ASSERT_EQ_INT(count_lines(buf, "Reserve refused"), 3);
    ASSERT_CONTAINS(buf, "WARN  decode req-a Reserve refused: KV cache full (0)\n");
    const char *b =
        strstr(buf, "req-b Reserve refused: KV cache full (0) (repeated 94 times in the last ");
    ASSERT_MSG(b, "%s", buf);
    ASSERT_CONTAINS(b, " s)\n");
    ASSERT_CONTAINS(buf, "WARN  decode - another site\n");
    ASSERT_CONTAINS(buf, "req-e Reserve refused: KV cache full (0) (repeated 3 times in the last ");
    ASSERT(strstr(buf, "req-c") == NULL && strstr(buf, "req-d") == NULL);
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
    pd_arena_free(a);
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
    pd_arena_free(a);
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
        pd_pool_free(p);
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
    pd_pool_free(p);
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
    pd_pool_free(p);
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

/* ---- the flag table (util/flags.h) ---------------------------------------------------------- */

typedef struct {
    const char *model, *names[4], *dtype, *api_key, *ports;
    int n_names, port, shutdown_s;
    size_t max_num_seqs;
    int64_t seed;
    double gpu_util;
    bool prefix_caching, vllm_config;
} flag_params;

static const pd_flag_bind FLAG_BINDS[] = {
    PD_BIND(flag_params, "--model", PD_BIND_STR, model),
    {.name = "--served-model-name",
     .type = PD_BIND_STRV,
     .off = offsetof(flag_params, names),
     .count_off = offsetof(flag_params, n_names),
     .max = 4},
    PD_BIND(flag_params, "--port", PD_BIND_INT, port),
    PD_BIND(flag_params, "--shutdown-timeout", PD_BIND_INT, shutdown_s),
    PD_BIND(flag_params, "--max-num-seqs", PD_BIND_SIZE, max_num_seqs),
    PD_BIND(flag_params, "--seed", PD_BIND_I64, seed),
    PD_BIND(flag_params, "--dtype", PD_BIND_STR, dtype),
    PD_BIND(flag_params, "--gpu-memory-utilization", PD_BIND_F64, gpu_util),
    PD_BIND(flag_params, "--enable-prefix-caching", PD_BIND_BOOL, prefix_caching),
    PD_BIND(flag_params, "--generation-config", PD_BIND_BOOL, vllm_config),
    PD_BIND(flag_params, "--api-key", PD_BIND_STR, api_key),
    PD_BIND(flag_params, "NODE_PORTS", PD_BIND_STR, ports),
};
#define N_FLAG_BINDS (sizeof FLAG_BINDS / sizeof *FLAG_BINDS)

static int parse_flags(unsigned role, flag_params *p, char **argv)
{
    int argc = 0;
    while (argv[argc]) argc++;
    memset(p, 0, sizeof *p);
    p->prefix_caching = true;
    bool help;
    return pd_flags_parse(role, FLAG_BINDS, N_FLAG_BINDS, argc, argv, p, &help);
}

/* vLLM's spellings (--a_b, --a=b), values into each C type, a choice's alias, a switch and its
 * --no- form, N [N...], a fraction rounded up into an int. */
TEST(flags_parse_spellings_and_types)
{
    flag_params p;
    char *argv[] = {"x",
                    "--model",
                    "/m",
                    "--served_model_name",
                    "a",
                    "b",
                    "--port=8001",
                    "--max-num-seqs",
                    "64",
                    "--seed=-1",
                    "--dtype",
                    "half",
                    "--gpu_memory_utilization",
                    "0.5",
                    "--no-enable-prefix-caching",
                    "--shutdown-timeout",
                    "2.5",
                    "--generation-config",
                    "vllm",
                    NULL};
    ASSERT_OK(parse_flags(PD_ROLE_ALL, &p, argv));
    ASSERT_STR_EQ(p.model, "/m");
    ASSERT_EQ_INT(p.n_names, 2);
    ASSERT_STR_EQ(p.names[1], "b");
    ASSERT_EQ_INT(p.port, 8001);
    ASSERT_EQ_INT(p.max_num_seqs, 64);
    ASSERT_EQ_INT(p.seed, -1);
    ASSERT_STR_EQ(p.dtype, "float16");
    ASSERT(p.gpu_util == 0.5);
    ASSERT(!p.prefix_caching);
    ASSERT_EQ_INT(p.shutdown_s, 3);
    ASSERT(p.vllm_config);
    char *again[] = {"x", "--served-model-name", "a", "--port",
                     "1", "--served-model-name", "c", NULL};
    ASSERT_OK(parse_flags(PD_ROLE_ALL, &p, again)); /* names given twice: both lists count */
    ASSERT_EQ_INT(p.n_names, 2);
    ASSERT_STR_EQ(p.names[0], "a");
    ASSERT_STR_EQ(p.names[1], "c");
}

/* Refusals name the flag; another role's flag is checked but not stored; vLLM's no-op flags
 * are accepted. */
TEST(flags_parse_refusals_and_other_roles)
{
    flag_params p;
    char *unknown[] = {"x", "--frobnicate", "1", NULL};
    ASSERT_ERR(parse_flags(PD_ROLE_PREFILL, &p, unknown), PD_EINVAL, "unknown flag '--frobnicate'");
    char *missing[] = {"x", "--model", NULL};
    ASSERT_ERR(parse_flags(PD_ROLE_PREFILL, &p, missing), PD_EINVAL, "--model: missing value");
    char *valued[] = {"x", "--enable-prefix-caching=1", NULL};
    ASSERT_ERR(parse_flags(PD_ROLE_PREFILL, &p, valued), PD_EINVAL,
               "--enable-prefix-caching takes no value");
    char *range[] = {"x", "--max-num-seqs", "0", NULL};
    ASSERT_ERR(parse_flags(PD_ROLE_PREFILL, &p, range), PD_EINVAL,
               "--max-num-seqs: expected an integer in [1, 1048576], got \"0\"");
    char *choice[] = {"x", "--dtype", "fp8", NULL};
    ASSERT_ERR(parse_flags(PD_ROLE_PREFILL, &p, choice), PD_EINVAL,
               "--dtype: expected auto, float32, bfloat16 or float16, got 'fp8'");
    char *open_lo[] = {"x", "--gpu-memory-utilization", "0", NULL};
    ASSERT_ERR(parse_flags(PD_ROLE_PREFILL, &p, open_lo), PD_EINVAL,
               "--gpu-memory-utilization: expected a number in (0, 1], got \"0\"");
    /* --api-key is the scheduler's: a prefill accepts it and stores nothing; a bad value of
       another role's flag is refused all the same (one command line, one verdict) */
    char *other[] = {"x", "--api-key", "k", "--swap-space", "4", "--trust-remote-code", NULL};
    ASSERT_OK(parse_flags(PD_ROLE_PREFILL, &p, other));
    ASSERT(p.api_key == NULL);
    ASSERT_OK(parse_flags(PD_ROLE_SCHEDULER, &p, other));
    ASSERT_STR_EQ(p.api_key, "k");
    char *other_bad[] = {"x", "--max-num-seqs", "abc", NULL};
    ASSERT_ERR(parse_flags(PD_ROLE_SCHEDULER, &p, other_bad), PD_EINVAL, "--max-num-seqs");
}

/* vLLM's flags that change nothing here are accepted in both spellings; a value pdserve cannot
 * honour is refused with the reason. */
TEST(flags_vllm_no_effect_values)
{
    flag_params p;
    char *ok[] = {"x",
                  "--revision",
                  "main",
                  "--load-format",
                  "safetensors",
                  "--tokenizer_mode",
                  "auto",
                  "--use-v2-block-manager",
                  "--distributed-executor-backend=mp",
                  "--disable-custom-all-reduce",
                  NULL};
    ASSERT_OK(parse_flags(PD_ROLE_PREFILL, &p, ok));
    ASSERT_OK(parse_flags(PD_ROLE_SCHEDULER, &p, ok));
    char *pt[] = {"x", "--load-format", "pt", NULL};
    ASSERT_ERR(parse_flags(PD_ROLE_DECODE, &p, pt), PD_EINVAL,
               "--load-format: expected auto or safetensors, got 'pt' (pdserve reads safetensors "
               "checkpoints)");
    char *ray[] = {"x", "--distributed-executor-backend", "ray", NULL};
    ASSERT_ERR(parse_flags(PD_ROLE_DECODE, &p, ray), PD_EINVAL,
               "--distributed-executor-backend: expected mp or uni, got 'ray' (an instance runs "
               "its tensor-parallel ranks as threads of one process)");
    char *mistral[] = {"x", "--tokenizer-mode", "mistral", NULL};
    ASSERT_ERR(parse_flags(PD_ROLE_SCHEDULER, &p, mistral), PD_EINVAL, "one tokenizer");
}

/* The environment fills what the command line did not set (and only for the roles it is
 * bound in); the flag wins over its variable. */
TEST(flags_environment_fallbacks)
{
    setenv("VLLM_API_KEY", "from-env", 1);
    setenv("NODE_PORTS", "1,2", 1);
    flag_params p;
    char *none[] = {"x", NULL};
    ASSERT_OK(parse_flags(PD_ROLE_SCHEDULER, &p, none));
    ASSERT_STR_EQ(p.api_key, "from-env");
    ASSERT_STR_EQ(p.ports, "1,2");
    char *flag[] = {"x", "--api-key", "from-flag", NULL};
    ASSERT_OK(parse_flags(PD_ROLE_SCHEDULER, &p, flag));
    ASSERT_STR_EQ(p.api_key, "from-flag");
    ASSERT_OK(parse_flags(PD_ROLE_DECODE, &p, none));
    ASSERT(p.api_key == NULL && p.ports == NULL);
    unsetenv("VLLM_API_KEY");
    unsetenv("NODE_PORTS");
}

/* --help lists the role's bound flags with the defaults read from the defaults struct, and the
 * other roles' flags as accepted. */
TEST(flags_usage_reads_defaults)
{
    flag_params d = {.max_num_seqs = 321, .dtype = "auto", .prefix_caching = true};
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    ASSERT(f);
    pd_flags_usage(f, PD_ROLE_PREFILL, "x --model DIR", "intro", FLAG_BINDS, N_FLAG_BINDS, &d);
    fclose(f);
    ASSERT(strstr(text, "usage: x --model DIR\nintro"));
    ASSERT(strstr(text, "(default: 321)"));
    ASSERT(strstr(text, "--[no-]enable-prefix-caching"));
    ASSERT(strstr(text, "--dtype auto|float32|bfloat16|float16"));
    ASSERT(!strstr(text, "half"));      /* aliases are accepted, not listed */
    ASSERT(strstr(text, " --api-key")); /* the scheduler's, under the other roles' flags */
    ASSERT(strstr(text, "--swap-space GiB"));
    free(text);
}

/* A bounded copy keeps what fits and never ends inside a UTF-8 sequence. */
TEST(str_copy_cuts_on_a_character)
{
    char b[6];
    ASSERT_EQ_INT(pd_str_copy(b, sizeof b, "abc"), 3);
    ASSERT_STR_EQ(b, "abc");
    ASSERT_EQ_INT(pd_str_copy(b, sizeof b, "abcdefg"), 5);
    ASSERT_STR_EQ(b, "abcde");
    ASSERT_EQ_INT(pd_str_copy(b, sizeof b, "abc\xe2\x82\xac"), 3); /* U+20AC would not fit */
    ASSERT_STR_EQ(b, "abc");
    ASSERT_EQ_INT(pd_str_copy(b, sizeof b, NULL), 0);
    ASSERT_STR_EQ(b, "");
}

/* ---- the id map (util/idmap.h) -------------------------------------------------------------- */

typedef struct {
    char id[16];
    int value;
    pd_idmap_link link;
} idmap_obj;

/* put / get / del with colliding chains (3 buckets), iteration that deletes as it goes. */
TEST(idmap_put_get_del_iterate)
{
    pd_idmap m;
    ASSERT_OK(pd_idmap_init(&m, 3));
    static idmap_obj objs[50];
    for (int i = 0; i < 50; i++) {
        snprintf(objs[i].id, sizeof objs[i].id, "req-%d", i);
        objs[i].value = i;
        pd_idmap_put(&m, &objs[i].link, objs[i].id);
    }
    ASSERT_EQ_INT(m.count, 50);
    for (int i = 0; i < 50; i++) {
        char id[16];
        snprintf(id, sizeof id, "req-%d", i);
        pd_idmap_link *l = pd_idmap_get(&m, id);
        ASSERT(l);
        ASSERT_EQ_INT(PD_IDMAP_ENTRY(l, idmap_obj, link)->value, i);
    }
    ASSERT(pd_idmap_get(&m, "req-50") == NULL);
    ASSERT(pd_idmap_del(&m, &objs[7].link));
    ASSERT(!pd_idmap_del(&m, &objs[7].link));
    ASSERT(pd_idmap_get(&m, "req-7") == NULL);
    int seen = 0, sum = 0;
    for (pd_idmap_link *l = pd_idmap_first(&m), *nx; l; l = nx) {
        nx = pd_idmap_next(&m, l);
        idmap_obj *o = PD_IDMAP_ENTRY(l, idmap_obj, link);
        seen++;
        sum += o->value;
        if (o->value % 2) ASSERT(pd_idmap_del(&m, l)); /* deleting while iterating */
    }
    ASSERT_EQ_INT(seen, 49);
    ASSERT_EQ_INT(sum, 49 * 50 / 2 - 7);
    ASSERT_EQ_INT(m.count, 25); /* the even ones */
    pd_idmap_free(&m);
    ASSERT_ERR(pd_idmap_init(&m, 0), PD_EINVAL, "0 buckets");
}

/* VLLM_CPU_KVCACHE_SPACE (issue 28 item 6, issue 29 item 9) reaches the instances' engine as
 * its CPU KV budget in GiB (fractions allowed), next to --kv-cache-bytes; out of range or not a
 * number is refused by name. */
TEST(flags_cpu_kvcache_space_env)
{
    char *none[] = {"x", NULL};
    pd_node_params p;
    unsetenv("VLLM_CPU_KVCACHE_SPACE");
    ASSERT_OK(pd_node_parse_args(1, none, RT_ROLE_DECODE, &p));
    ASSERT(p.engine.cpu_kvcache_space_gib == PD_ENGINE_CPU_KVCACHE_SPACE_GIB);
    ASSERT(p.engine.kv_cache_bytes == 0);
    setenv("VLLM_CPU_KVCACHE_SPACE", "0.5", 1);
    ASSERT_OK(pd_node_parse_args(1, none, RT_ROLE_PREFILL, &p));
    ASSERT(p.engine.cpu_kvcache_space_gib == 0.5);
    char *bytes[] = {"x", "--kv-cache-bytes", "1048576", NULL};
    ASSERT_OK(pd_node_parse_args(3, bytes, RT_ROLE_DECODE, &p));
    ASSERT(p.engine.cpu_kvcache_space_gib == 0.5 && p.engine.kv_cache_bytes == 1048576);
    setenv("VLLM_CPU_KVCACHE_SPACE", "-1", 1);
    ASSERT_ERR(pd_node_parse_args(1, none, RT_ROLE_DECODE, &p), PD_EINVAL,
               "VLLM_CPU_KVCACHE_SPACE");
    setenv("VLLM_CPU_KVCACHE_SPACE", "four", 1);
    ASSERT_ERR(pd_node_parse_args(1, none, RT_ROLE_DECODE, &p), PD_EINVAL,
               "VLLM_CPU_KVCACHE_SPACE");
    unsetenv("VLLM_CPU_KVCACHE_SPACE");
}
