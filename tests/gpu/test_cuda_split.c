/* 1P1D split serving on one GPU equals colocated GPU serving: a prefill and a decode instance
 * (real pd-prefill / pd-decode processes, --device cuda, bf16) on the same GPU move the KV by
 * CUDA IPC (and, in the second case, through host memory over TCP); every greedy and seeded
 * request's tokens must equal pd-generate's on the same GPU, one request at a time (bf16
 * rounding depends on the batch's shape, so the reference runs the same shapes); a prompt whose
 * first blocks the decode instance holds pulls only the rest. Exits 77 without a GPU.
 *
 * The same over NCCL, prefill on GPU 0 and decode on GPU 1; and the NCCL watchdog: a decode
 * process frozen then killed while the prefill side's ncclSend waits for it leaves the prefill
 * process serving (the transfer fails fast, the next request succeeds over a restarted decode on
 * a fresh connection and link). With one GPU both run there, each node an NCCL host of its own
 * (PD_TEST_NCCL_HOST_PER_NODE, cluster.h): NCCL then carries the KV over its socket transport
 * on loopback, which proves the NCCL code, not NVLink's speed. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "harness.h"

#include "cluster.h"
#include "cuda_test_util.h"
#include "util/clock.h"

#define N_PROMPTS  12
#define MAX_TOKENS 24

static int compare(cl_cluster *c, const char *transport, double temperature, int64_t seed)
{
    static int32_t buf[N_PROMPTS][96];
    size_t len[N_PROMPTS];
    const int32_t *ptrs[N_PROMPTS];
    /* prompts of their own per call: a prompt sent again would find its blocks in the prefill
       instance's prefix cache and compute only its tail, with GEMMs of other shapes than the
       reference's (bf16 rounds differently), and the comparison is bit for bit */
    uint64_t x = 88172645463325252ull ^ ((uint64_t)seed * 0x9e3779b97f4a7c15ull);
    for (int i = 0; i < N_PROMPTS; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        len[i] = 5 + x % 90; /* prompts ending inside and on the edge of 16-token blocks */
        for (size_t j = 0; j < len[i]; j++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            buf[i][j] = (int32_t)(32 + x % 90);
        }
        ptrs[i] = buf[i];
    }
    static cl_result ref[N_PROMPTS], got;
    char *gen[] = {"--cuda-device", "0", "--dtype", "bfloat16", "--concurrency", "1", NULL};
    if (cl_reference_ex(c->model, ptrs, len, N_PROMPTS, MAX_TOKENS, temperature, seed, c->dir, gen,
                        ref) < 0) {
        printf("    reference: %s\n", pd_last_error());
        return N_PROMPTS;
    }
    Pd__SamplingParams sp = cl_sampling(temperature, seed, MAX_TOKENS);
    int bad = 0;
    for (int i = 0; i < N_PROMPTS; i++) {
        char id[64];
        snprintf(id, sizeof id, "gpu-%d-%lld", i, (long long)seed);
        if (cl_generate(c, 0, 1, id, ptrs[i], len[i], &sp, &got) < 0) {
            printf("    prompt %d: %s\n", i, got.error);
            bad++;
        } else if (got.n != ref[i].n || memcmp(got.tokens, ref[i].tokens, got.n * 4) != 0) {
            size_t k = 0;
            while (k < got.n && k < ref[i].n && got.tokens[k] == ref[i].tokens[k]) k++;
            printf("    prompt %d (%zu tokens): split and colocated differ at token %zu\n", i,
                   len[i], k);
            bad++;
        }
    }
    printf("    --kv-transport %s, temperature %.1f: %d of %d requests identical to colocated\n",
           transport, temperature, N_PROMPTS - bad, N_PROMPTS);
    return bad;
}

/* A 1P1D cluster of the tiny model on the GPU (bf16, a quarter of its memory each) with the
 * given KV transport and --kv-lease-seconds (NULL: the default), prefix caching on or off;
 * stopped again on failure. */
static int start_1p1d(cl_cluster *c, const char *transport, const char *lease_s, bool cache)
{
    char model[512];
    PD_CHECK(cl_make_tiny(model, sizeof model));
    char *extra[] = {"--device",
                     "cuda",
                     "--dtype",
                     "bfloat16",
                     "--kv-transport",
                     (char *)transport,
                     "--gpu-memory-utilization",
                     "0.25",
                     cache ? "--enable-prefix-caching" : "--no-enable-prefix-caching",
                     lease_s ? "--kv-lease-seconds" : NULL,
                     (char *)lease_s,
                     NULL};
    int rc = cl_start(c, model, "0", "1", extra);
    if (rc < 0) {
        printf("    %s\n", pd_last_error());
        cl_stop_all(c);
    }
    return rc;
}

static void split_case(const char *transport)
{
    if (!ctu_have_gpu()) SKIP(pd_last_error());
    cl_cluster c;
    ASSERT_OK(start_1p1d(&c, transport, NULL, true));
    int bad = compare(&c, transport, 0.0, 7) + compare(&c, transport, 0.8, 1234);
    if (bad)
        for (int k = 0; k < 2; k++) cl_dump_log(&c.procs[k], 12);
    ASSERT_EQ_INT(cl_stop_all(&c), 0);
    ASSERT_EQ_INT(bad, 0);
}

TEST(cuda_split_ipc_equals_colocated)
{
    split_case("cuda_ipc");
}

TEST(cuda_split_tcp_equals_colocated)
{
    split_case("tcp");
}

/* The decode instance's prefix cache over CUDA IPC: a prompt that starts with an earlier
 * prompt's blocks is reserved with them and only the rest of its KV is pulled. pd-generate,
 * one prompt at a time with its own prefix cache, computes the same shapes (the second prompt's
 * tail after its cached blocks), so the tokens must be equal bit for bit. */
TEST(cuda_split_ipc_decode_prefix_cache)
{
    if (!ctu_have_gpu()) SKIP(pd_last_error());
    static int32_t a[40], b[64];
    for (int i = 0; i < 64; i++) b[i] = (int32_t)(32 + (i * 29) % 90);
    memcpy(a, b, sizeof a);
    const int32_t *ptrs[2] = {a, b};
    size_t len[2] = {40, 64};
    cl_cluster c;
    ASSERT_OK(start_1p1d(&c, "cuda_ipc", NULL, true));
    static cl_result ref[2], got[2];
    char *gen[] = {"--cuda-device", "0", "--dtype", "bfloat16", "--concurrency", "1", NULL};
    int rc = cl_reference_ex(c.model, ptrs, len, 2, MAX_TOKENS, 0.0, 0, c.dir, gen, ref);
    if (rc < 0) printf("    reference: %s\n", pd_last_error());
    Pd__SamplingParams sp = cl_sampling(0.0, 0, MAX_TOKENS);
    for (int i = 0; i < 2 && rc >= 0; i++) {
        char id[32];
        snprintf(id, sizeof id, "gpu-prefix-%d", i);
        rc = cl_generate(&c, 0, 1, id, ptrs[i], len[i], &sp, &got[i]);
        if (rc < 0) printf("    prompt %d: %s\n", i, got[i].error);
    }
    ASSERT_EQ_INT(cl_stop_all(&c), 0);
    ASSERT_OK(rc);
    printf("    KV pulled: %lld bytes for 40 tokens, then %lld for 64 tokens of which the decode "
           "instance held %lld\n",
           (long long)got[0].kv_bytes, (long long)got[1].kv_bytes, (long long)got[1].decode_cached);
    ASSERT_EQ_INT(got[1].decode_cached, 32);
    ASSERT_EQ_INT(got[1].kv_bytes * 40, got[0].kv_bytes * (64 - 32));
    for (int i = 0; i < 2; i++) {
        size_t k = 0;
        while (k < got[i].n && k < ref[i].n && got[i].tokens[k] == ref[i].tokens[k]) k++;
        ASSERT_MSG(got[i].n == ref[i].n && k == got[i].n,
                   "prompt %d: split and colocated differ at token %zu", i, k);
    }
}

/* Two GPUs: prefill on GPU 0, decode on GPU 1. One: both on it, each node an NCCL host of its
 * own (NCCL refuses two ranks on one GPU of one host). */
static void nccl_arrangement(void)
{
    if (ctu_gpu_count() >= 2) return;
    setenv("PD_TEST_NCCL_HOST_PER_NODE", "1", 1);
    printf("    one GPU: each node an NCCL host of its own (NCCL's socket transport on "
           "loopback)\n");
}

TEST(cuda_split_nccl_equals_colocated)
{
    if (!ctu_have_gpu()) SKIP(pd_last_error());
    nccl_arrangement();
    split_case("nccl");
}

/* ---- watchdog ---- */

#define D_NODE 1 /* the decode instance in the cluster (prefill first) */

static cl_cluster g_wd;
static pthread_t g_killer;
static int g_killer_started;

static void *kill_decode_later(void *arg)
{
    (void)arg;
    pd_sleep_ns(1500 * PD_NS_PER_MS); /* the prefill side is inside ncclSend by then */
    cl_signal(&g_wd.procs[D_NODE], SIGKILL);
    return NULL;
}

/* cl_generate_hook: after Reserve, freeze the decode process (its link stops answering) and kill
 * it 1.5 s later, while the prefill's send waits on it. */
static int freeze_then_kill(void *arg, const Pd__InfoReply *info, const Pd__ReserveReply *rr)
{
    (void)arg, (void)info, (void)rr;
    cl_signal(&g_wd.procs[D_NODE], SIGSTOP);
    g_killer_started = pthread_create(&g_killer, NULL, kill_decode_later, NULL) == 0;
    return 0;
}

TEST(cuda_split_nccl_dead_decode_leaves_prefill_serving)
{
    if (!ctu_have_gpu()) SKIP(pd_last_error());
    nccl_arrangement();
    /* no prefix cache: the request after the restart repeats the first one's prompt, and its
       tokens must be the first one's bit for bit (a cached prefix changes the GEMM shapes) */
    ASSERT_OK(start_1p1d(&g_wd, "nccl", "20", false));
    int32_t prompt[40];
    for (int i = 0; i < 40; i++) prompt[i] = 32 + (i * 7) % 90;
    Pd__SamplingParams sp = cl_sampling(0.0, 7, 16);
    static cl_result warm, dead, after;
    /* the first request makes the NCCL link */
    ASSERT_OK(cl_generate(&g_wd, 0, 1, "wd-warm", prompt, 40, &sp, &warm));
    int64_t t0 = pd_now_ns();
    int rc =
        cl_generate_hook(&g_wd, 0, 1, "wd-dead", prompt, 40, &sp, freeze_then_kill, NULL, &dead);
    double failed_after = (double)(pd_now_ns() - t0) / 1e9;
    if (g_killer_started) pthread_join(g_killer, NULL);
    printf("    decode frozen then killed mid-transfer: request %s after %.2f s (%s)\n",
           rc < 0 ? "failed" : "succeeded", failed_after, rc < 0 ? dead.error : "");
    ASSERT(rc < 0);
    ASSERT_MSG(failed_after < 10.0,
               "the prefill side waited %.1f s (the lease is 20 s): the dead "
               "peer was not noticed",
               failed_after);
    /* the prefill process still serves: a restarted decode gets the next request */
    ASSERT_OK(cl_restart(&g_wd, D_NODE, 60000));
    ASSERT_OK(cl_generate(&g_wd, 0, 1, "wd-after", prompt, 40, &sp, &after));
    ASSERT_EQ_INT(after.n, warm.n);
    ASSERT(memcmp(after.tokens, warm.tokens, warm.n * sizeof(int32_t)) == 0);
    int bad = cl_stop_all(&g_wd);
    if (bad)
        for (int k = 0; k < 2; k++) cl_dump_log(&g_wd.procs[k], 20);
    ASSERT_EQ_INT(bad, 0);
}
