/* 1P1D split serving on one GPU equals colocated GPU serving: a prefill and a decode instance
 * (real pd-prefill / pd-decode processes, --device cuda, bf16) on the same GPU move the KV by
 * CUDA IPC (and, in the second case, through host memory over TCP); every greedy and seeded
 * request's tokens must equal pd-generate's on the same GPU, one request at a time (bf16
 * rounding depends on the batch's shape, so the reference runs the same shapes). Exits 77
 * without a GPU. */
#include <stdio.h>
#include <string.h>

#include "harness.h"

#include "cluster.h"
#include "cuda_test_util.h"

#define N_PROMPTS  12
#define MAX_TOKENS 24

static int compare(cl_cluster *c, const char *transport, double temperature, int64_t seed)
{
    static int32_t buf[N_PROMPTS][96];
    size_t len[N_PROMPTS];
    const int32_t *ptrs[N_PROMPTS];
    uint64_t x = 88172645463325252ull;
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

static void split_case(const char *transport)
{
    if (!ctu_have_gpu()) SKIP(pd_last_error());
    char model[512];
    ASSERT_OK(cl_make_tiny(model, sizeof model));
    char *extra[] = {"--device",
                     "cuda",
                     "--dtype",
                     "bfloat16",
                     "--kv-transport",
                     (char *)transport,
                     "--gpu-memory-utilization",
                     "0.25",
                     NULL};
    cl_cluster c;
    int rc = cl_start(&c, model, "0", "1", extra);
    if (rc < 0) {
        printf("    %s\n", pd_last_error());
        cl_stop_all(&c);
        ASSERT_OK(rc);
    }
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
