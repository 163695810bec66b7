/* Integration tests of pd-prefill and pd-decode: real processes on loopback, ranktables from
 * pd-ranktable, driven with the gRPC client (Reserve -> Prefill -> Decode). */
#include "harness.h"

#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cluster.h"
#include "rpc/pd_msg.h"
#include "util/clock.h"
#include "util/threadpool.h"

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
 * the token ids with pd-generate's (with the extra flags, NULL ok), bit for bit. Returns
 * mismatching prompts. */
static int compare_split_colocated(cl_cluster *c, int n, double temperature, int64_t seed,
                                   char *const extra[])
{
    static int32_t buf[N_PROMPTS][64];
    size_t len[N_PROMPTS];
    const int32_t *ptrs[N_PROMPTS];
    make_prompts(buf, len, ptrs);
    static cl_result ref[N_PROMPTS], got;
    if (cl_reference_ex(c->model, ptrs, len, (size_t)n, MAX_TOKENS, temperature, seed, c->dir,
                        extra, ref) < 0) {
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

/* A cluster of the test model in the shape given (cl_start's prefill and decode lists, extra
 * node flags, NULL ok); on a failure the error is printed and what started is stopped. */
static int start_shape(cl_cluster *c, const char *prefill, const char *decode, char *const extra[])
{
    const char *model = model_dir();
    if (!model) return pd_error(PD_EINTERNAL, "pd-mkmodel failed");
    int rc = cl_start(c, model, prefill, decode, extra);
    if (rc < 0) {
        printf("    %s\n", pd_last_error());
        cl_stop_all(c);
    }
    return rc;
}

/* extra: flags of the nodes and of pd-generate alike (NULL ok); node_only: more flags of the
 * nodes alone (NULL ok). */
static void run_shape_ex(const char *prefill, const char *decode, int n_prompts,
                         char *const extra[], char *const node_only[])
{
    char *nodes[16];
    size_t n = 0;
    for (char *const *a = extra; a && *a && n < 15; a++) nodes[n++] = *a;
    for (char *const *a = node_only; a && *a && n < 15; a++) nodes[n++] = *a;
    nodes[n] = NULL;
    cl_cluster c;
    ASSERT_OK(start_shape(&c, prefill, decode, nodes));
    int bad_greedy = compare_split_colocated(&c, n_prompts, 0.0, 7, extra);
    int bad_seeded = compare_split_colocated(&c, n_prompts, 0.8, 1234, extra);
    if (bad_greedy || bad_seeded)
        for (int k = 0; k < c.n_prefill + c.n_decode; k++) cl_dump_log(&c.procs[k], 10);
    int bad_exit = cl_stop_all(&c);
    ASSERT_EQ_INT(bad_greedy, 0);
    ASSERT_EQ_INT(bad_seeded, 0);
    ASSERT_EQ_INT(bad_exit, 0); /* every node drained and exited 0 on SIGTERM */
}

static void run_shape(const char *prefill, const char *decode, int n_prompts, char *const extra[])
{
    run_shape_ex(prefill, decode, n_prompts, extra, NULL);
}

TEST(pd_1p1d_split_equals_colocated)
{
    run_shape("0", "1", N_PROMPTS, NULL);
}

/* --enable-chunked-prefill with a 16-token step: every prompt (up to 64 tokens) prefills over
 * several steps on the prefill instance, and the tokens equal pd-generate's unchunked run. */
TEST(pd_1p1d_chunked_prefill_equals_colocated)
{
    char *chunked[] = {
        "--enable-chunked-prefill", "--max-num-batched-tokens", "16", "--max-num-seqs", "8", NULL};
    run_shape_ex("0", "1", 8, NULL, chunked);
}

/* --dtype bfloat16 on the CPU (bf16 matmuls): instances and pd-generate in the same mode give the
 * same tokens, so the mode is batch- and chunk-invariant end to end too. */
TEST(pd_1p1d_bf16_split_equals_colocated)
{
    char *bf16[] = {"--dtype", "bfloat16", NULL};
    run_shape("0", "1", 8, bf16);
}

/* Speculative decoding on the decode instance (n-gram drafts; the prefill instance ignores the
 * flags): the tokens equal pd-generate's plain decoding, greedy and seeded. */
TEST(pd_1p1d_speculative_decode_equals_colocated)
{
    char *spec[] = {"--speculative-model",
                    "[ngram]",
                    "--num-speculative-tokens",
                    "4",
                    "--ngram-prompt-lookup-max",
                    "3",
                    NULL};
    run_shape_ex("0", "1", 8, NULL, spec);
}

TEST(pd_2p1d_split_equals_colocated)
{
    run_shape("0 1", "2", 8, NULL);
}

TEST(pd_1p2d_split_equals_colocated)
{
    run_shape("0", "1 2", 8, NULL);
}

TEST(pd_prefill_tp2_to_decode_tp1)
{
    run_shape("0,1", "2", N_PROMPTS, NULL);
}

/* The decode instance's prefix cache: a prompt that starts with an earlier prompt's blocks is
 * reserved with them (Reserve's prompt_ids), the prefill instance sends the KV of the other
 * tokens only (every prefill rank to every decode rank whose heads it holds), and the tokens
 * still equal pd-generate's. */
static void prefix_cache_case(const char *prefill, const char *decode)
{
    static int32_t a[40], b[64];
    for (int i = 0; i < 64; i++) b[i] = (int32_t)(32 + (i * 17) % 90);
    memcpy(a, b, sizeof a);
    const int32_t *ptrs[2] = {a, b};
    size_t len[2] = {40, 64};
    cl_cluster c;
    ASSERT_OK(start_shape(&c, prefill, decode, NULL));
    static cl_result ref[2], got[2];
    int rc = cl_reference(c.model, ptrs, len, 2, MAX_TOKENS, 0.0, 0, c.dir, ref);
    Pd__SamplingParams sp = sampling(0.0, 0);
    for (int i = 0; i < 2 && rc >= 0; i++) {
        char id[32];
        snprintf(id, sizeof id, "prefix-%d", i);
        rc = cl_generate(&c, 0, c.n_prefill, id, ptrs[i], len[i], &sp, &got[i]);
        if (rc < 0) printf("    prompt %d: %s\n", i, got[i].error);
    }
    int bad_exit = cl_stop_all(&c);
    ASSERT_OK(rc);
    printf("    P %s, D %s: KV moved: %lld bytes for 40 tokens, then %lld for 64 tokens of which "
           "the decode instance held %lld\n",
           prefill, decode, (long long)got[0].kv_bytes, (long long)got[1].kv_bytes,
           (long long)got[1].decode_cached);
    ASSERT_EQ_INT(got[0].decode_cached, 0);
    ASSERT_EQ_INT(got[1].decode_cached, 32); /* the first prompt's two full blocks */
    ASSERT(got[0].kv_bytes > 0);
    ASSERT_EQ_INT(got[1].kv_bytes * 40, got[0].kv_bytes * (64 - 32)); /* bytes per token alike */
    for (int i = 0; i < 2; i++) {
        ASSERT_EQ_INT(got[i].n, ref[i].n);
        ASSERT(memcmp(got[i].tokens, ref[i].tokens, got[i].n * sizeof(int32_t)) == 0);
    }
    ASSERT_EQ_INT(bad_exit, 0);
}

TEST(pd_decode_prefix_cache_skips_transfer)
{
    prefix_cache_case("0", "1");
}

/* The same across tensor-parallel sizes: P TP 2 to D TP 1, and P TP 1 to D TP 2. */
TEST(pd_decode_prefix_cache_tp)
{
    prefix_cache_case("0,1", "2");
    prefix_cache_case("0", "1,2");
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
    ASSERT_CONTAINS(text,
                    "--tensor-parallel-size 2 x --pipeline-parallel-size 1 does not match the "
                    "1 device(s)");
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
    /* a compute dtype the CPU backend does not have */
    char *f16[] = {prefill, "--model", (char *)model, "--port", "1", "--dtype", "float16", NULL};
    refused(f16, env, log, text, sizeof text);
    ASSERT_CONTAINS(text, "--dtype float16: the CPU backend computes in float32 or bfloat16");
    ASSERT_EQ_INT(cl_stop_all(&c), 0);
}

/* ---- the relay's credit (pd.proto PauseRequest) -------------------------------------------- */

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int events, other; /* events of the request under test; events on its Decode stream */
    uint64_t bytes;    /* their packed bytes */
    bool final, relay_done, decode_done;
    int decode_status;
} relay_watch;

static void on_relay_batch(void *arg, const uint8_t *m, size_t len)
{
    relay_watch *w = arg;
    Pd__RelayBatch *b = pd__relay_batch__unpack(NULL, len, m);
    pthread_mutex_lock(&w->mu);
    for (size_t i = 0; b && i < b->n_events; i++) {
        Pd__TokenEvent *ev = pd__token_event__unpack(NULL, b->events[i].len, b->events[i].data);
        w->events++;
        w->bytes += b->events[i].len;
        w->final |= ev && ev->final;
        if (ev) pd__token_event__free_unpacked(ev, NULL);
    }
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    if (b) pd__relay_batch__free_unpacked(b, NULL);
}

static void on_relay_end(void *arg, int st, const char *d, const uint8_t *r, size_t len)
{
    relay_watch *w = arg;
    (void)st, (void)d, (void)r, (void)len;
    pthread_mutex_lock(&w->mu);
    w->relay_done = true;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

static void on_decode_event(void *arg, const uint8_t *m, size_t len)
{
    relay_watch *w = arg;
    (void)m, (void)len;
    pthread_mutex_lock(&w->mu);
    w->other++;
    pthread_mutex_unlock(&w->mu);
}

static void on_decode_end(void *arg, int st, const char *d, const uint8_t *r, size_t len)
{
    relay_watch *w = arg;
    (void)d, (void)r, (void)len;
    pthread_mutex_lock(&w->mu);
    w->decode_done = true;
    w->decode_status = st;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

/* Waits up to timeout_ms until the relay carried at least `events` events; the count. */
static int relay_wait(relay_watch *w, int events, int timeout_ms)
{
    int64_t until = pd_now_ns() + (int64_t)timeout_ms * PD_NS_PER_MS;
    pthread_mutex_lock(&w->mu);
    while (w->events < events && pd_now_ns() < until) {
        pthread_mutex_unlock(&w->mu);
        pd_sleep_ns(5 * PD_NS_PER_MS);
        pthread_mutex_lock(&w->mu);
    }
    int n = w->events;
    pthread_mutex_unlock(&w->mu);
    return n;
}

static bool grant(cl_cluster *c, int dk, const char *id, uint64_t seq, uint64_t credit)
{
    Pd__PauseRequest q = PD__PAUSE_REQUEST__INIT;
    q.request_id = (char *)id;
    q.seq = seq;
    q.credit = credit;
    int st;
    Pd__PauseReply *r = (Pd__PauseReply *)cl_call(cl_node(c, dk), "/pd.PD/Pause", &q.base,
                                                  &pd__pause_reply__descriptor, 3000, &st);
    bool found = r && r->found;
    if (r) pd__pause_reply__free_unpacked(r, NULL);
    return found;
}

/* Opens a Relay stream named relay_id to decode node 1 of c, its events into w (set up here),
 * and waits until the node has it (there is no "open" message). */
static void relay_open(cl_cluster *c, const char *relay_id, relay_watch *w, uint64_t *call)
{
    memset(w, 0, sizeof *w);
    w->decode_status = -1;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    Pd__RelayRequest rq = PD__RELAY_REQUEST__INIT;
    rq.relay_id = (char *)relay_id;
    uint8_t rbuf[64];
    pd_rpc_stream_async(cl_node(c, 1), "/pd.PD/Relay", rbuf, pd__relay_request__pack(&rq, rbuf),
                        60000, on_relay_batch, on_relay_end, w, call);
    pd_sleep_ns(300 * PD_NS_PER_MS);
}

/* A relayed request's events leave the decode instance only as far as its credit goes: with 1
 * byte of credit, one event comes; a Pause granting one more byte than has arrived lets exactly
 * one more through; a stale Pause (older seq) changes nothing; a large grant brings the rest, in
 * order, and the final event. The Decode stream itself carries nothing and ends when cancelled. */
TEST(pd_relay_credit)
{
    enum { TOKENS = 24 };
    const char *model = model_dir();
    ASSERT(model);
    cl_cluster c;
    ASSERT_OK(cl_start(&c, model, "0", "1", NULL));
    relay_watch w;
    uint64_t relay_call = 0, decode_call = 0;
    relay_open(&c, "test-relay", &w, &relay_call);
    Pd__StatsReply *s0 = stats(&c, 1);
    int32_t prompt[8] = {72, 101, 108, 108, 111, 32, 119, 111};
    Pd__SamplingParams sp = cl_sampling(0, 0, TOKENS);
    sp.ignore_eos = true;
    static cl_result first;
    uint64_t seed = 0;
    int32_t tok = -1;
    int rc = cl_prefill(&c, 0, 1, "credit-1", prompt, 8, &sp, NULL, NULL, &first, &seed, &tok);
    Pd__DecodeRequest dq = PD__DECODE_REQUEST__INIT;
    dq.request_id = "credit-1";
    dq.prompt_ids = prompt;
    dq.n_prompt_ids = 8;
    sp.has_seed = true;
    sp.seed = (int64_t)seed;
    dq.sampling = &sp;
    dq.first_token = tok;
    dq.relay_id = "test-relay";
    dq.relay_credit = 1;
    size_t len = 0;
    uint8_t *buf = rc == PD_OK ? pd_msg_pack(&dq.base, &len) : NULL;
    if (buf)
        pd_rpc_stream_async(cl_node(&c, 1), "/pd.PD/Decode", buf, len, 60000, on_decode_event,
                            on_decode_end, &w, &decode_call);
    free(buf);
    /* the engine finishes all TOKENS meanwhile; what it made waits on the instance */
    int n1 = buf ? relay_wait(&w, 1, 10000) : 0;
    pd_sleep_ns(300 * PD_NS_PER_MS);
    pthread_mutex_lock(&w.mu);
    int n1_later = w.events;
    uint64_t b1 = w.bytes;
    pthread_mutex_unlock(&w.mu);
    bool g2 = grant(&c, 1, "credit-1", 2, b1 + 1);
    int n2 = relay_wait(&w, 2, 10000);
    pd_sleep_ns(300 * PD_NS_PER_MS);
    bool stale = grant(&c, 1, "credit-1", 1, 1u << 30); /* older seq: ignored */
    pd_sleep_ns(300 * PD_NS_PER_MS);
    pthread_mutex_lock(&w.mu);
    int n2_later = w.events;
    pthread_mutex_unlock(&w.mu);
    bool g3 = grant(&c, 1, "credit-1", 3, 1u << 30);
    int n3 = relay_wait(&w, TOKENS - 1, 10000);
    pthread_mutex_lock(&w.mu);
    bool final = w.final;
    int other = w.other;
    bool decode_open = !w.decode_done;
    pthread_mutex_unlock(&w.mu);
    Pd__StatsReply *s1 = stats(&c, 1);
    printf("    prefill %d; relay events: %d, %d after 300 ms (credit 1 byte); %d, %d after 300 ms "
           "(credit +1 byte past %llu); %d with the rest granted, final %d; on the Decode stream "
           "%d; relay_pauses +%lld\n",
           rc, n1, n1_later, n2, n2_later, (unsigned long long)b1, n3, final, other,
           s0 && s1 ? (long long)(s1->relay_pauses - s0->relay_pauses) : -1LL);
    /* the caller ends the Decode stream after the final event, then the relay */
    if (decode_call) pd_rpc_cancel(c.client, decode_call);
    pd_rpc_cancel(c.client, relay_call);
    pthread_mutex_lock(&w.mu);
    while (!(w.relay_done && (w.decode_done || !decode_call))) pthread_cond_wait(&w.cv, &w.mu);
    pthread_mutex_unlock(&w.mu);
    if (s0) pd__stats_reply__free_unpacked(s0, NULL);
    if (s1) pd__stats_reply__free_unpacked(s1, NULL);
    pthread_mutex_destroy(&w.mu);
    pthread_cond_destroy(&w.cv);
    int bad_exit = cl_stop_all(&c);
    ASSERT_EQ_INT(rc, PD_OK);
    ASSERT_EQ_INT(n1, 1);
    ASSERT_EQ_INT(n1_later, 1);
    ASSERT(g2);
    ASSERT_EQ_INT(n2, 2);
    ASSERT_EQ_INT(n2_later, 2);
    ASSERT(!stale);
    ASSERT(g3);
    ASSERT_EQ_INT(n3, TOKENS - 1); /* the first token came with the Prefill reply */
    ASSERT(final);
    ASSERT_EQ_INT(other, 0);
    ASSERT(decode_open);
    ASSERT_EQ_INT(bad_exit, 0);
}

/* A reservation made with the caller's relay_id goes when that Relay stream closes (the caller,
 * a pd-scheduler, is gone), not after its TTL: one that no Decode has taken is freed at once. */
TEST(pd_reservation_dropped_with_its_relay)
{
    const char *model = model_dir();
    ASSERT(model);
    cl_cluster c;
    ASSERT_OK(cl_start(&c, model, "0", "1", NULL));
    relay_watch w;
    uint64_t relay_call = 0;
    relay_open(&c, "gone-relay", &w, &relay_call);
    Pd__ReserveRequest q = PD__RESERVE_REQUEST__INIT;
    q.request_id = "held-1";
    q.num_prompt_tokens = 20;
    q.ttl_ms = 60000;
    q.relay_id = "gone-relay";
    int st;
    Pd__ReserveReply *rr = (Pd__ReserveReply *)cl_call(cl_node(&c, 1), "/pd.PD/Reserve", &q.base,
                                                       &pd__reserve_reply__descriptor, 3000, &st);
    Pd__StatsReply *s0 = stats(&c, 1);
    int64_t held0 = s0 ? s0->num_held : -1;
    pd_rpc_cancel(c.client, relay_call);
    int64_t held1 = -1, deadline = pd_now_ns() + 5 * PD_NS_PER_S;
    while (held1 != 0 && pd_now_ns() < deadline) {
        Pd__StatsReply *s1 = stats(&c, 1);
        held1 = s1 ? s1->num_held : -1;
        if (s1) pd__stats_reply__free_unpacked(s1, NULL);
        if (held1 != 0) pd_sleep_ns(50 * PD_NS_PER_MS);
    }
    pthread_mutex_lock(&w.mu);
    while (!w.relay_done) pthread_cond_wait(&w.cv, &w.mu);
    pthread_mutex_unlock(&w.mu);
    printf("    held reservations: %lld with the relay open, %lld once it closed\n",
           (long long)held0, (long long)held1);
    if (rr) pd__reserve_reply__free_unpacked(rr, NULL);
    if (s0) pd__stats_reply__free_unpacked(s0, NULL);
    pthread_mutex_destroy(&w.mu);
    pthread_cond_destroy(&w.cv);
    int bad_exit = cl_stop_all(&c);
    ASSERT(rr);
    ASSERT_EQ_INT(held0, 1);
    ASSERT_EQ_INT(held1, 0);
    ASSERT_EQ_INT(bad_exit, 0);
}

/* The KV transport an instance reports is the one that carried the KV: in PrefillReply for the
 * request, and in Info for its latest transfer (the label pd-scheduler gives
 * pd:kv_transfer_bytes_total): TCP between CPU instances. */
TEST(pd_kv_transport_reported_on_cpu)
{
    const char *model = model_dir();
    ASSERT(model);
    cl_cluster c;
    ASSERT_OK(cl_start(&c, model, "0", "1", NULL));
    static int32_t prompt[64];
    for (int i = 0; i < 64; i++) prompt[i] = 40 + i % 50;
    static cl_result res;
    uint64_t seed;
    int32_t first;
    ASSERT_OK(cl_prefill(&c, 0, 1, "xport", prompt, 64, NULL, NULL, NULL, &res, &seed, &first));
    ASSERT(res.kv_bytes > 0);
    ASSERT_STR_EQ(res.kv_transport, "tcp");
    int st;
    Pd__AbortRequest aq = PD__ABORT_REQUEST__INIT; /* the reservation nobody decodes */
    aq.request_id = "xport";
    ProtobufCMessage *ar =
        cl_call(cl_node(&c, 1), "/pd.PD/Abort", &aq.base, &pd__abort_reply__descriptor, 3000, &st);
    ASSERT(ar);
    protobuf_c_message_free_unpacked(ar, NULL);
    for (int k = 0; k < 2; k++) { /* the prefill instance sent it, the decode one received it */
        Pd__InfoRequest iq = PD__INFO_REQUEST__INIT;
        Pd__InfoReply *info = (Pd__InfoReply *)cl_call(cl_node(&c, k), "/pd.PD/Info", &iq.base,
                                                       &pd__info_reply__descriptor, 3000, &st);
        ASSERT(info);
        ASSERT_STR_EQ(info->kv_transport, "tcp");
        pd__info_reply__free_unpacked(info, NULL);
    }
    ASSERT_EQ_INT(cl_stop_all(&c), 0);
}

/* An instance warms up before it can be reached (the first request must not pay the first pass
 * over the weights): the first Info it answers already reports its warm-up (a dummy prefill of
 * max(16, max_num_seqs) tokens, so 64 here, and a decode step) and the engine's creation, its log
 * says so at INFO before the serving line, and its Stats count no prompt token of it. */
TEST(pd_node_warms_up_before_ready)
{
    const char *model = model_dir();
    ASSERT(model);
    cl_cluster c;
    ASSERT_OK(cl_start(&c, model, "0", "1", NULL));
    for (int k = 0; k < 2; k++) {
        int st;
        Pd__InfoRequest iq = PD__INFO_REQUEST__INIT;
        Pd__InfoReply *info = (Pd__InfoReply *)cl_call(cl_node(&c, k), "/pd.PD/Info", &iq.base,
                                                       &pd__info_reply__descriptor, 3000, &st);
        ASSERT(info);
        ASSERT_EQ_INT(info->warmup_tokens, 64);
        ASSERT(info->warmup_seconds > 0 && info->load_seconds > 0);
        pd__info_reply__free_unpacked(info, NULL);
        Pd__StatsRequest sq = PD__STATS_REQUEST__INIT;
        Pd__StatsReply *s = (Pd__StatsReply *)cl_call(cl_node(&c, k), "/pd.PD/Stats", &sq.base,
                                                      &pd__stats_reply__descriptor, 3000, &st);
        ASSERT(s);
        ASSERT_EQ_INT(s->prompt_tokens, 0);
        ASSERT_EQ_INT(s->generation_tokens, 0);
        ASSERT_EQ_INT(s->kv_blocks_free, s->kv_blocks_total);
        pd__stats_reply__free_unpacked(s, NULL);
        FILE *f = fopen(c.procs[k].log, "r");
        ASSERT(f);
        char line[1024];
        int warm = 0, serving = 0, n = 0;
        while (fgets(line, sizeof line, f)) {
            n++;
            if (!warm && strstr(line, " INFO ") && strstr(line, "start-up: load ") &&
                strstr(line, "warm-up ") && strstr(line, "(64-token prefill and a decode step)"))
                warm = n;
            if (!serving && strstr(line, "serving ")) serving = n;
        }
        fclose(f);
        ASSERT_MSG(warm > 0 && serving > warm, "node %d: start-up line %d, serving line %d", k,
                   warm, serving);
    }
    ASSERT_EQ_INT(cl_stop_all(&c), 0);
}

/* Runs pd-generate on the tiny model over `n` prompts of 200 ids with --max-tokens 56 (each
 * prompt needs 256 KV tokens, 16 blocks of 16) and the extra options; returns the KV pool's
 * blocks from its "KV cache:" line, or -1 (the log is printed). */
static long generate_kv_blocks(const char *model, int n, char *const extra[])
{
    char ids[600], log[600];
    snprintf(ids, sizeof ids, "%s/kv_need.ids", pdt_tmp_dir());
    snprintf(log, sizeof log, "%s/kv_need.log", pdt_tmp_dir());
    FILE *f = fopen(ids, "w");
    if (!f) return -1;
    for (int i = 0; i < n; i++)
        for (int j = 0; j < 200; j++)
            fprintf(f, "%d%c", 32 + (i * 7 + j) % 90, j < 199 ? ',' : '\n');
    fclose(f);
    char *argv[16] = {(char *)cl_bin("tools/generate/pd-generate"),
                      "--model",
                      (char *)model,
                      "--prompts-file",
                      ids,
                      "--max-tokens",
                      "56",
                      "--cpu-threads",
                      "1"};
    for (int i = 0, k = 9; extra && extra[i] && k < 15; i++, k++) argv[k] = extra[i];
    int st = cl_run(argv, log, 120);
    long blocks = -1;
    char line[1024];
    f = fopen(log, "r");
    while (f && fgets(line, sizeof line, f)) {
        const char *p = strstr(line, "KV cache: ");
        if (p) blocks = strtol(p + 10, NULL, 10);
    }
    if (f) fclose(f);
    if (st != 0 || blocks < 0) {
        printf("    pd-generate exited with %d; its log %s:\n", st, log);
        f = fopen(log, "r");
        while (f && fgets(line, sizeof line, f)) printf("    %s", line);
        if (f) fclose(f);
        return -1;
    }
    return blocks;
}

/* pd-generate's KV pool holds what the run needs at once (issue 28 item 6), not a share of the
 * host's memory (it took 31-35 s and 9-10 GB to start): the prompts in flight at once, each with
 * its --max-tokens, in whole blocks, never below one sequence of the model's context (2048
 * tokens, 128 blocks, for tiny); --kv-cache-bytes caps it below that need. */
TEST(pd_generate_sizes_kv_by_need)
{
    const char *model = model_dir();
    ASSERT(model);
    ASSERT_EQ_INT(generate_kv_blocks(model, 16, NULL), 16 * 16); /* all 16 in flight */
    char *two[] = {"--concurrency", "2", NULL};                  /* 2 x 16 < 128 */
    ASSERT_EQ_INT(generate_kv_blocks(model, 16, two), 128);
    char *cap[] = {"--kv-cache-bytes", "6553600", NULL}; /* 200 blocks of 32 KiB */
    ASSERT_EQ_INT(generate_kv_blocks(model, 16, cap), 200);
}

/* ---- cores: the host budget and pinning (docs/nodes.md "Cores") ---------------------------- */

/* pd-generate's greedy text for one prompt under the environment assignment env (NULL: none),
 * in out; its log must contain want. Returns 0 or -1 (the log is printed). */
static int generate_text(const char *model, const char *env, const char *want, char *out,
                         size_t cap)
{
    char log[600], line[1024];
    snprintf(log, sizeof log, "%s/cores.log", pdt_tmp_dir());
    unlink(log); /* cl_run appends */
    char *argv[] = {(char *)cl_bin("tools/generate/pd-generate"),
                    "--model",
                    (char *)model,
                    "--prompt-ids",
                    "5,9,77,300,41,8,19,1000,3,64,12,7,200,90,15,33,21",
                    "--max-tokens",
                    "24",
                    "--temperature",
                    "0",
                    NULL};
    char name[64] = "", *eq = env ? strchr(env, '=') : NULL;
    if (eq) {
        snprintf(name, sizeof name, "%.*s", (int)(eq - env), env);
        setenv(name, eq + 1, 1);
    }
    int st = cl_run(argv, log, 60);
    if (eq) unsetenv(name);
    bool seen = false;
    out[0] = '\0';
    FILE *f = fopen(log, "r");
    while (f && fgets(line, sizeof line, f)) {
        if (strstr(line, want)) seen = true;
        if (strncmp(line, "20", 2) != 0)
            strncat(out, line, cap - strlen(out) - 1); /* not a log line */
    }
    if (f) fclose(f);
    if (st == 0 && seen && out[0]) return 0;
    printf("    pd-generate (%s) exited with %d, \"%s\" %s in its log %s:\n", env ? env : "", st,
           want, seen ? "found" : "not found", log);
    f = fopen(log, "r");
    while (f && fgets(line, sizeof line, f)) printf("    %s", line);
    if (f) fclose(f);
    return -1;
}

/* The threads' placement changes no token: the host budget (default), no budget, pinned to one
 * core, pinned to two in either order. */
TEST(pd_generate_same_tokens_pinned_or_shared)
{
    const char *model = model_dir();
    ASSERT(model);
    static char base[4096], other[4096];
    ASSERT_OK(generate_text(model, NULL, "core budget host", base, sizeof base));
    ASSERT_OK(generate_text(model, "PD_CPU_BUDGET=off", "core budget off", other, sizeof other));
    ASSERT_STR_EQ(other, base);
    ASSERT_OK(
        generate_text(model, "VLLM_CPU_OMP_THREADS_BIND=0", "threads pinned", other, sizeof other));
    ASSERT_STR_EQ(other, base);
    if (pd_cpu_count() >= 2) {
        ASSERT_OK(generate_text(model, "VLLM_CPU_OMP_THREADS_BIND=1,0", "threads pinned", other,
                                sizeof other));
        ASSERT_STR_EQ(other, base);
    }
}

/* Bad core settings stop an instance at start-up with the variable named. */
TEST(pd_node_refuses_bad_cpu_env)
{
    const char *model = model_dir();
    ASSERT(model);
    cl_cluster c;
    ASSERT_OK(cl_start(&c, model, "0", "1", NULL));
    char log[600], genv[700], lenv[700], text[4096];
    snprintf(genv, sizeof genv, "GLOBAL_RANK_TABLE_FILE_PATH=%s", c.global);
    snprintf(lenv, sizeof lenv, "RANK_TABLE_FILE_PATH=%s/local_ranktable_127.0.0.1_1.json", c.dir);
    snprintf(log, sizeof log, "%s/bad.log", c.dir);
    char *argv[] = {
        (char *)cl_bin("decode_node/pd-decode"), "--model", (char *)model, "--port", "1", NULL};
    char *bind[] = {genv, lenv, "VLLM_CPU_OMP_THREADS_BIND=0-1|2-3", NULL};
    refused(argv, bind, log, text, sizeof text);
    ASSERT_CONTAINS(text, "VLLM_CPU_OMP_THREADS_BIND: 2 core lists for 1 tensor-parallel rank");
    char *budget[] = {genv, lenv, "PD_CPU_BUDGET=../x", NULL};
    refused(argv, budget, log, text, sizeof text);
    ASSERT_CONTAINS(text, "PD_CPU_BUDGET: '../x' is not host, off or a name");
    ASSERT_EQ_INT(cl_stop_all(&c), 0);
}
