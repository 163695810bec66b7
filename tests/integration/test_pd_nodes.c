/* Integration tests of pd-prefill and pd-decode: real processes on loopback, ranktables from
 * pd-ranktable, driven with the gRPC client (Reserve -> Prefill -> Decode). */
#include "harness.h"

#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cluster.h"
#include "util/clock.h"

#define N_PROMPTS  32
#define MAX_TOKENS 16

static char g_model[512];

static const char *model_dir(void)
{
    if (!g_model[0] && cl_make_tiny(g_model, sizeof g_model) < 0) g_model[0] = '\0';
    return g_model[0] ? g_model : NULL;
}

/* Deterministic prompts of 4..63 byte-level token ids (present in every byte-level vocab). */
static void make_prompts(int32_t buf[N_PROMPTS][64], size_t *len, const int32_t *ptrs[])
{
    uint64_t x = 88172645463325252ull;
    for (int i = 0; i < N_PROMPTS; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        len[i] = 4 + x % 60;
        for (size_t j = 0; j < len[i]; j++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            buf[i][j] = (int32_t)(32 + x % 90);
        }
        ptrs[i] = buf[i];
    }
}

static Pd__SamplingParams sampling(double temperature, int64_t seed)
{
    return cl_sampling(temperature, seed, MAX_TOKENS);
}

/* Runs n prompts through the cluster (prefill/decode instances chosen round-robin) and compares
 * the token ids with pd-generate's, bit for bit. Returns mismatching prompts. */
static int compare_split_colocated(cl_cluster *c, int n, double temperature, int64_t seed)
{
    static int32_t buf[N_PROMPTS][64];
    size_t len[N_PROMPTS];
    const int32_t *ptrs[N_PROMPTS];
    make_prompts(buf, len, ptrs);
    static cl_result ref[N_PROMPTS], got;
    if (cl_reference(c->model, ptrs, len, (size_t)n, MAX_TOKENS, temperature, seed, c->dir, ref) <
        0) {
        printf("    reference: %s\n", pd_last_error());
        return n;
    }
    Pd__SamplingParams sp = sampling(temperature, seed);
    int bad = 0;
    for (int i = 0; i < n; i++) {
        char id[64];
        snprintf(id, sizeof id, "req-%d-%lld-%d", i, (long long)seed, (int)(temperature * 100));
        int pk = i % c->n_prefill, dk = c->n_prefill + i % c->n_decode;
        if (cl_generate(c, pk, dk, id, ptrs[i], len[i], &sp, &got) < 0) {
            printf("    prompt %d: %s\n", i, got.error);
            bad++;
            continue;
        }
        bool same = got.n == ref[i].n && memcmp(got.tokens, ref[i].tokens, got.n * 4) == 0 &&
                    strcmp(got.finish, ref[i].finish) == 0;
        if (!same) {
            printf("    prompt %d differs: split %zu tokens (%s), colocated %zu (%s); first %d vs "
                   "%d\n",
                   i, got.n, got.finish, ref[i].n, ref[i].finish, got.n ? got.tokens[0] : -1,
                   ref[i].n ? ref[i].tokens[0] : -1);
            bad++;
        }
    }
    return bad;
}

static void run_shape(const char *prefill, const char *decode, int n_prompts)
{
    const char *model = model_dir();
    ASSERT_MSG(model, "pd-mkmodel failed");
    cl_cluster c;
    int rc = cl_start(&c, model, prefill, decode, NULL);
    if (rc < 0) {
        printf("    %s\n", pd_last_error());
        cl_stop_all(&c);
        ASSERT_OK(rc);
    }
    int bad_greedy = compare_split_colocated(&c, n_prompts, 0.0, 7);
    int bad_seeded = compare_split_colocated(&c, n_prompts, 0.8, 1234);
    if (bad_greedy || bad_seeded)
        for (int k = 0; k < c.n_prefill + c.n_decode; k++) cl_dump_log(&c.procs[k], 10);
    int bad_exit = cl_stop_all(&c);
    ASSERT_EQ_INT(bad_greedy, 0);
    ASSERT_EQ_INT(bad_seeded, 0);
    ASSERT_EQ_INT(bad_exit, 0); /* every node drained and exited 0 on SIGTERM */
}

TEST(pd_1p1d_split_equals_colocated)
{
    run_shape("0", "1", N_PROMPTS);
}

TEST(pd_2p1d_split_equals_colocated)
{
    run_shape("0 1", "2", 8);
}

TEST(pd_1p2d_split_equals_colocated)
{
    run_shape("0", "1 2", 8);
}

TEST(pd_prefill_tp2_to_decode_tp1)
{
    run_shape("0,1", "2", N_PROMPTS);
}

static Pd__StatsReply *stats(cl_cluster *c, int k)
{
    Pd__StatsRequest q = PD__STATS_REQUEST__INIT;
    int st;
    return (Pd__StatsReply *)cl_call(cl_node(c, k), "/pd.PD/Stats", &q.base,
                                     &pd__stats_reply__descriptor, 3000, &st);
}

TEST(pd_reservation_without_prefill_expires)
{
    const char *model = model_dir();
    ASSERT(model);
    cl_cluster c;
    ASSERT_OK(cl_start(&c, model, "0", "1", NULL));
    Pd__StatsReply *before = stats(&c, 1);
    ASSERT(before);
    Pd__ReserveRequest rq = PD__RESERVE_REQUEST__INIT;
    rq.request_id = "orphan";
    rq.num_prompt_tokens = 100;
    rq.ttl_ms = 300; /* the prefill side "dies" before sending anything */
    int st;
    ProtobufCMessage *rr = cl_call(cl_node(&c, 1), "/pd.PD/Reserve", &rq.base,
                                   &pd__reserve_reply__descriptor, 3000, &st);
    ASSERT_MSG(rr, "Reserve: %s", pd_last_error());
    protobuf_c_message_free_unpacked(rr, NULL);
    Pd__StatsReply *held = stats(&c, 1);
    ASSERT(held->kv_blocks_free < before->kv_blocks_free);
    ASSERT_EQ_INT(held->reserved_tokens, 112); /* 7 blocks of 16 */
    pd_sleep_ns(800 * PD_NS_PER_MS);
    Pd__StatsReply *after = stats(&c, 1);
    ASSERT_EQ_INT(after->kv_blocks_free, before->kv_blocks_free);
    ASSERT_EQ_INT(after->reserved_tokens, 0);
    /* Decode for the expired reservation is refused */
    Pd__DecodeRequest dq = PD__DECODE_REQUEST__INIT;
    dq.request_id = "orphan";
    int32_t ids[1] = {40};
    dq.prompt_ids = ids;
    dq.n_prompt_ids = 1;
    ProtobufCMessage *none =
        cl_call(cl_node(&c, 1), "/pd.PD/Decode", &dq.base, &pd__token_event__descriptor, 3000, &st);
    ASSERT(none == NULL);
    ASSERT_EQ_INT(st, PD_RPC_NOT_FOUND);
    pd__stats_reply__free_unpacked(before, NULL);
    pd__stats_reply__free_unpacked(held, NULL);
    pd__stats_reply__free_unpacked(after, NULL);
    ASSERT_EQ_INT(cl_stop_all(&c), 0);
}

TEST(pd_decode_stalled_prefill_lease_frees_kv)
{
    const char *model = model_dir();
    ASSERT(model);
    cl_cluster c;
    ASSERT_OK(cl_start(&c, model, "0", "1", NULL));
    Pd__StatsReply *before = stats(&c, 0);
    ASSERT(before);
    /* Reserve on the decode instance, then freeze it: the transfer cannot be acknowledged */
    cl_signal(&c.procs[1], SIGSTOP);
    static int32_t prompt[300];
    for (int i = 0; i < 300; i++) prompt[i] = 40 + i % 50;
    Pd__SamplingParams sp = sampling(0, 1);
    cl_result r;
    int64_t t0 = pd_now_ns();
    /* cl_generate's Reserve goes to the frozen instance: do the steps by hand */
    cl_signal(&c.procs[1], SIGCONT);
    Pd__ReserveRequest rq = PD__RESERVE_REQUEST__INIT;
    rq.request_id = "stalled";
    rq.num_prompt_tokens = 300;
    rq.ttl_ms = 30000;
    int st;
    Pd__ReserveReply *rr = (Pd__ReserveReply *)cl_call(cl_node(&c, 1), "/pd.PD/Reserve", &rq.base,
                                                       &pd__reserve_reply__descriptor, 3000, &st);
    ASSERT(rr);
    Pd__InfoRequest iq = PD__INFO_REQUEST__INIT;
    Pd__InfoReply *info = (Pd__InfoReply *)cl_call(cl_node(&c, 1), "/pd.PD/Info", &iq.base,
                                                   &pd__info_reply__descriptor, 3000, &st);
    ASSERT(info);
    cl_signal(&c.procs[1], SIGSTOP); /* now the decode side hangs mid-transfer */
    Pd__DecodeTarget tg = PD__DECODE_TARGET__INIT, *tp = &tg;
    tg.host = info->ranks[0]->device_ip;
    tg.port = info->ranks[0]->data_port;
    tg.kv_head0 = info->ranks[0]->kv_head0;
    tg.kv_heads = info->ranks[0]->kv_heads;
    Pd__PrefillRequest pq = PD__PREFILL_REQUEST__INIT;
    pq.request_id = "stalled";
    pq.prompt_ids = prompt;
    pq.n_prompt_ids = 300;
    pq.sampling = &sp;
    pq.targets = &tp;
    pq.n_targets = 1;
    pq.decode_block_ids = rr->block_ids;
    pq.n_decode_block_ids = rr->n_block_ids;
    pq.lease_ms = 700;
    ProtobufCMessage *pr = cl_call(cl_node(&c, 0), "/pd.PD/Prefill", &pq.base,
                                   &pd__prefill_reply__descriptor, 10000, &st);
    int64_t ms = (pd_now_ns() - t0) / PD_NS_PER_MS;
    ASSERT(pr == NULL);
    ASSERT(st != PD_RPC_OK);
    ASSERT_MSG(ms < 5000, "the lease took %lld ms to expire", (long long)ms);
    Pd__StatsReply *after = stats(&c, 0);
    ASSERT(after);
    ASSERT_EQ_INT(after->leases_held, 0);
    ASSERT_EQ_INT(after->kv_blocks_free, before->kv_blocks_free); /* the KV was freed */
    cl_signal(&c.procs[1], SIGCONT);
    (void)r;
    pd__reserve_reply__free_unpacked(rr, NULL);
    pd__info_reply__free_unpacked(info, NULL);
    pd__stats_reply__free_unpacked(before, NULL);
    pd__stats_reply__free_unpacked(after, NULL);
    ASSERT_EQ_INT(cl_stop_all(&c), 0);
}

/* Runs argv (a node that must refuse to start) and returns its log in text (cap bytes), or
 * "" when it did not exit with status 1 within 30 s. */
static void refused(char *const argv[], char *const env[], const char *log, char *text, size_t cap)
{
    cl_proc p;
    text[0] = '\0';
    unlink(log);
    if (cl_spawn(&p, "refused", argv, env, log) != 0 || cl_wait(&p, 30000) != 1) return;
    FILE *f = fopen(log, "r");
    size_t n = f ? fread(text, 1, cap - 1, f) : 0;
    text[n] = '\0';
    if (f) fclose(f);
}

TEST(pd_node_refuses_wrong_tp_and_unknown_instance)
{
    const char *model = model_dir();
    ASSERT(model);
    cl_cluster c;
    ASSERT_OK(cl_start(&c, model, "0", "1", NULL));
    char log[600], local[600], genv[700], lenv[700], text[4096];
    snprintf(local, sizeof local, "%s/local_ranktable_127.0.0.1_0.json", c.dir);
    snprintf(genv, sizeof genv, "GLOBAL_RANK_TABLE_FILE_PATH=%s", c.global);
    snprintf(lenv, sizeof lenv, "RANK_TABLE_FILE_PATH=%s", local);
    snprintf(log, sizeof log, "%s/bad.log", c.dir);
    char *env[] = {genv, lenv, NULL};
    char prefill[1024]; /* cl_bin's buffer is reused by the next call */
    snprintf(prefill, sizeof prefill, "%s", cl_bin("prefill_node/pd-prefill"));
    /* TP 2 for a one-device instance */
    char *tp2[] = {prefill, "--model", (char *)model, "--port", "1", "--tensor-parallel-size",
                   "2",     NULL};
    refused(tp2, env, log, text, sizeof text);
    ASSERT_CONTAINS(text, "--tensor-parallel-size 2 does not match the 1 device(s)");
    /* a decode binary pointed at the prefill instance's table */
    char *role[] = {
        (char *)cl_bin("decode_node/pd-decode"), "--model", (char *)model, "--port", "1", NULL};
    refused(role, env, log, text, sizeof text);
    ASSERT_CONTAINS(text, "is a prefill instance, not a decode one");
    /* KV transports this instance cannot use */
    char *ipc[] = {prefill, "--model",        (char *)model, "--port",
                   "1",     "--kv-transport", "cuda_ipc",    NULL};
    refused(ipc, env, log, text, sizeof text);
    ASSERT_CONTAINS(text, "--kv-transport cuda_ipc needs --device cuda");
    char *nccl[] = {prefill, "--model",        (char *)model, "--port",
                    "1",     "--kv-transport", "nccl",        NULL};
    refused(nccl, env, log, text, sizeof text);
    ASSERT_CONTAINS(text, "--kv-transport nccl needs --device cuda");
    ASSERT_EQ_INT(cl_stop_all(&c), 0);
}
