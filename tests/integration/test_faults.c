/* Fault injection on a real 2P2D cluster on loopback (issue #9 item 1), driven through
 * pd-scheduler over HTTP and, for the KV lease, straight through the pd.proto control plane:
 *   - kill -9 a decode instance under 32 concurrent streams: the streams on it end with the
 *     in-band error and [DONE] within 5 s, the others finish, new requests are served by the
 *     other decode instance, and the killed one rejoins when started again on its port;
 *   - kill -9 a prefill instance that holds requests which have not streamed anything: they are
 *     retried on the other prefill instance and succeed;
 *   - SIGSTOP a decode and a prefill instance: deadlines fire, no client hangs, both rejoin
 *     after SIGCONT and hold no state for the requests that were failed over;
 *   - a decode instance killed and restarted while the prefill instance holds the KV of a
 *     prompt under its lease: the prefill instance frees it (Stats: nothing held);
 *   - a decode instance restarted after a 32 s outage rejoins the routing set within 5 s.
 * Every wait is bounded; every process is stopped at the end, also when a check fails. */
#define _GNU_SOURCE
#include "harness.h"

#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include "backend/backend.h"
#include "cluster.h"
#include "../../scheduler/registry.h"
#include "transfer/kv_tcp.h"
#include "util/clock.h"
#include "util/log.h"

/* ---- the fixture: 2 prefill + 2 decode instances and one scheduler --------------------------- */

enum { P0 = 0, P1 = 1, D0 = 2, D1 = 3 };

static cl_cluster g_c;
static cl_proc g_sched;
static int g_port;
static bool g_ready, g_failed;
static char g_model[512];

static bool fixture(void)
{
    if (g_ready || g_failed) return g_ready;
    g_failed = true;
    if (cl_make_tiny(g_model, sizeof g_model) < 0) return false;
    if (cl_start(&g_c, g_model, "0 1", "2 3", NULL) < 0) {
        printf("    cl_start: %s\n", pd_last_error());
        cl_stop_all(&g_c);
        return false;
    }
    if (cl_sched_start(&g_c, &g_sched, "scheduler", NULL, &g_port) < 0) {
        printf("    %s\n", pd_last_error());
        cl_stop_all(&g_c);
        return false;
    }
    g_failed = false;
    g_ready = true;
    return true;
}

#define FIXTURE()                                                                                  \
    do {                                                                                           \
        if (!fixture()) ASSERT_MSG(0, "the cluster did not start");                                \
    } while (0)

/* ---- helpers --------------------------------------------------------------------------------- */

static const char *const LOST_EVENT =
    "data: {\"error\":{\"message\":\"Generation failed: the decode instance stopped "
    "responding.\",\"type\":\"InternalServerError\",\"param\":null,\"code\":500}}\n\n"
    "data: [DONE]\n\n";

/* Opens n streaming completions of max_tokens tokens each on the scheduler at port. */
static int open_streams_on(int port, cl_conn *cs, int n, int max_tokens)
{
    for (int i = 0; i < n; i++) {
        char body[256];
        snprintf(body, sizeof body,
                 "{\"prompt\":\"Once upon a time %d\",\"max_tokens\":%d,\"ignore_eos\":true,"
                 "\"stream\":true}",
                 i, max_tokens);
        if (cl_conn_open(&cs[i], port, "POST", "/v1/completions", NULL, body, false) < 0) {
            printf("    stream %d: %s\n", i, pd_last_error());
            for (int j = 0; j < i; j++) cl_conn_close(&cs[j]);
            return -1;
        }
    }
    return 0;
}

static int open_streams(cl_conn *cs, int n, int max_tokens)
{
    return open_streams_on(g_port, cs, n, max_tokens);
}

/* Polls until every stream has its first bytes (true) or timeout_ms passed. */
static bool wait_first_bytes(cl_conn *cs, int n, int timeout_ms)
{
    int64_t deadline = pd_now_ns() + (int64_t)CL_MS(timeout_ms) * PD_NS_PER_MS;
    for (;;) {
        int have = 0;
        for (int i = 0; i < n; i++) have += cs[i].t_first_ns != 0;
        if (have == n) return true;
        if (pd_now_ns() > deadline) return false;
        cl_conn_poll(cs, (size_t)n, 100, 0);
    }
}

typedef struct {
    int ok, lost, other;
    double worst_lost_s; /* latest [DONE] of a lost stream after t0 */
} stream_tally;

/* Sorts finished streams into completed (finish_reason length, [DONE], no error), lost (the
 * contract's in-band error, then [DONE], and nothing after) and anything else (printed). */
static stream_tally tally(cl_conn *cs, int n, int64_t t0)
{
    stream_tally t = {0};
    for (int i = 0; i < n; i++) {
        char *b = cl_conn_body(&cs[i]);
        size_t bl = b ? strlen(b) : 0, ll = strlen(LOST_EVENT);
        bool done = bl >= 14 && strcmp(b + bl - 14, "data: [DONE]\n\n") == 0;
        if (cs[i].status == 200 && done && bl >= ll && strcmp(b + bl - ll, LOST_EVENT) == 0) {
            t.lost++;
            double s = (double)(cs[i].t_done_ns - t0) / 1e9;
            if (s > t.worst_lost_s) t.worst_lost_s = s;
        } else if (cs[i].status == 200 && done && strstr(b, "\"finish_reason\":\"length\"") &&
                   !strstr(b, "\"error\"")) {
            t.ok++;
        } else {
            t.other++;
            printf("    stream %d: status %d, %zu body bytes, ends \"%s\"\n", i, cs[i].status, bl,
                   b && bl > 200 ? b + bl - 200 : (b ? b : "(no body)"));
        }
        free(b);
    }
    return t;
}

static void close_all(cl_conn *cs, int n)
{
    for (int i = 0; i < n; i++) cl_conn_close(&cs[i]);
}

/* Sends n short completions one after the other; returns how many got 200. */
static int short_requests(int n)
{
    int ok = 0;
    for (int i = 0; i < n; i++) {
        char *b = NULL;
        int st =
            cl_http(g_port, "POST", "/v1/completions",
                    "{\"prompt\":\"Hello\",\"max_tokens\":4,\"ignore_eos\":true}", 30000, &b, NULL);
        if (st == 200)
            ok++;
        else
            printf("    short request %d: status %d: %s\n", i, st, b ? b : "");
        free(b);
    }
    return ok;
}

static int64_t stat_of(int k, int64_t (*get)(const Pd__StatsReply *))
{
    Pd__StatsReply *s = cl_stats(&g_c, k);
    if (!s) return -1;
    int64_t v = get(s);
    pd__stats_reply__free_unpacked(s, NULL);
    return v;
}

static int64_t st_finished(const Pd__StatsReply *s)
{
    return s->requests_finished;
}

/* Node k holds nothing: no running, waiting or held sequence, no lease, every KV block free. */
static bool node_idle(int k)
{
    Pd__StatsReply *s = cl_stats(&g_c, k);
    if (!s) return false;
    bool idle = s->num_running == 0 && s->num_waiting == 0 && s->num_held == 0 &&
                s->leases_held == 0 && s->kv_blocks_free == s->kv_blocks_total &&
                s->reserved_tokens == 0;
    pd__stats_reply__free_unpacked(s, NULL);
    return idle;
}

static bool wait_idle(int k, int timeout_ms)
{
    int64_t deadline = pd_now_ns() + (int64_t)CL_MS(timeout_ms) * PD_NS_PER_MS;
    while (pd_now_ns() < deadline) {
        if (node_idle(k)) return true;
        pd_sleep_ns(100 * PD_NS_PER_MS);
    }
    Pd__StatsReply *s = cl_stats(&g_c, k);
    if (s) {
        printf(
            "    node %d not idle: running %lld, waiting %lld, held %lld, leases %lld, KV blocks "
            "free %lld of %lld, reserved tokens %lld\n",
            k, (long long)s->num_running, (long long)s->num_waiting, (long long)s->num_held,
            (long long)s->leases_held, (long long)s->kv_blocks_free, (long long)s->kv_blocks_total,
            (long long)s->reserved_tokens);
        pd__stats_reply__free_unpacked(s, NULL);
    }
    return false;
}

/* Short requests until node k has finished one more request than before (for up to 10 s:
 * routing weighs the load each instance reported at its last heartbeat, up to 1 s old). */
static bool reaches(int k)
{
    int64_t before = stat_of(k, st_finished);
    int64_t deadline = pd_now_ns() + (int64_t)CL_MS(10000) * PD_NS_PER_MS;
    while (pd_now_ns() < deadline) {
        if (short_requests(1) != 1) return false;
        if (stat_of(k, st_finished) > before) return true;
        pd_sleep_ns(50 * PD_NS_PER_MS);
    }
    return false;
}

static bool log_has(const cl_proc *p, const char *text)
{
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "grep -qF '%s' '%s'", text, p->log);
    return system(cmd) == 0;
}

/* ---- tests ----------------------------------------------------------------------------------- */

#define N_STREAMS 32

TEST(faults_decode_kill_midstream)
{
    FIXTURE();
    cl_conn cs[N_STREAMS];
    ASSERT(open_streams(cs, N_STREAMS, 1000) == 0);
    bool started = wait_first_bytes(cs, N_STREAMS, 30000);
    int running = 0;
    for (int i = 0; i < N_STREAMS; i++) running += cs[i].t_done_ns == 0;
    int64_t t_kill = pd_now_ns();
    cl_signal(&g_c.procs[D0], SIGKILL);
    bool all_done = cl_conn_wait_all(cs, N_STREAMS, CL_MS(60000));
    stream_tally t = tally(cs, N_STREAMS, t_kill);
    close_all(cs, N_STREAMS);
    printf("    %d streams running at the kill: %d completed, %d got the in-band error (last "
           "[DONE] %.3f s after the kill), %d other\n",
           running, t.ok, t.lost, t.worst_lost_s, t.other);
    ASSERT_MSG(started, "not every stream started within 30 s");
    ASSERT_MSG(running == N_STREAMS, "only %d of %d streams were still running at the kill",
               running, N_STREAMS);
    ASSERT_MSG(all_done, "a stream did not end within 60 s of the kill");
    ASSERT_EQ_INT(t.other, 0);
    ASSERT_MSG(t.lost >= 1 && t.ok >= 1, "expected streams on both decode instances");
    ASSERT_EQ_INT(t.ok + t.lost, N_STREAMS);
    ASSERT_MSG(t.worst_lost_s < CL_SEC(5.0), "in-band error %.3f s after the kill", t.worst_lost_s);

    /* once the heartbeat has taken it out (the window before that is
     * faults_y_decode_kill_before_heartbeat), new requests go to the remaining instance */
    ASSERT_MSG(cl_wait_instance(&g_c, g_port, D0, 0, 5000),
               "the killed decode instance is still in routing");
    int64_t d1_before = stat_of(D1, st_finished);
    ASSERT_EQ_INT(short_requests(8), 8);
    ASSERT_EQ_INT(stat_of(D1, st_finished) - d1_before, 8);

    /* started again on its port, it rejoins and serves */
    ASSERT_OK(cl_restart(&g_c, D0, CL_MS(30000)));
    ASSERT_MSG(cl_wait_instance(&g_c, g_port, D0, 1, 10000),
               "the restarted decode instance did not rejoin");
    ASSERT_MSG(reaches(D0), "no request reached the restarted decode instance");
    ASSERT(wait_idle(D1, 5000));
}

TEST(faults_prefill_kill_retry)
{
    FIXTURE();
    /* P0 hangs first, so that the requests routed to it have streamed nothing when it dies */
    cl_signal(&g_c.procs[P0], SIGSTOP);
    cl_conn cs[8];
    if (open_streams(cs, 8, 16) < 0) {
        cl_signal(&g_c.procs[P0], SIGCONT);
        ASSERT_MSG(0, "cannot open the streams");
    }
    cl_conn_poll(cs, 8, 300, 0);
    cl_signal(&g_c.procs[P0], SIGKILL);
    bool all_done = cl_conn_wait_all(cs, 8, CL_MS(30000));
    stream_tally t = tally(cs, 8, 0);
    close_all(cs, 8);
    ASSERT_MSG(all_done, "a request did not end within 30 s of the kill");
    ASSERT_EQ_INT(t.ok, 8);
    ASSERT_MSG(log_has(&g_sched, "retrying the prefill"), "no prefill was retried");
    ASSERT_EQ_INT(short_requests(4), 4);
    ASSERT_OK(cl_restart(&g_c, P0, CL_MS(30000)));
    ASSERT_MSG(cl_wait_instance(&g_c, g_port, P0, 1, 10000),
               "the restarted prefill instance did not rejoin");
    ASSERT_MSG(reaches(P0), "no request reached the restarted prefill instance");
}

TEST(faults_sigstop_rejoin)
{
    FIXTURE();
    /* a decode instance hangs under 16 streams */
    cl_conn cs[16];
    ASSERT(open_streams(cs, 16, 1000) == 0);
    bool started = wait_first_bytes(cs, 16, 30000);
    int64_t t_stop = pd_now_ns();
    cl_signal(&g_c.procs[D1], SIGSTOP);
    bool all_done = cl_conn_wait_all(cs, 16, CL_MS(30000));
    stream_tally t = tally(cs, 16, t_stop);
    close_all(cs, 16);
    printf("    SIGSTOP decode: %d completed, %d got the in-band error (last %.3f s after the "
           "stop), %d other\n",
           t.ok, t.lost, t.worst_lost_s, t.other);
    bool out = cl_wait_instance(&g_c, g_port, D1, 0, 5000);
    int served = short_requests(4);
    cl_signal(&g_c.procs[D1], SIGCONT);
    ASSERT_MSG(started, "not every stream started within 30 s");
    ASSERT_MSG(all_done, "a stream hung for 30 s behind the stopped decode instance");
    ASSERT_EQ_INT(t.other, 0);
    ASSERT_MSG(t.lost >= 1, "no stream was on the stopped decode instance");
    ASSERT_MSG(t.worst_lost_s < CL_SEC(10.0), "in-band error %.3f s after the stop",
               t.worst_lost_s);
    ASSERT_MSG(out, "the stopped decode instance stayed in routing");
    ASSERT_EQ_INT(served, 4);
    /* after SIGCONT: back in routing, nothing left of the failed-over streams, serving again */
    ASSERT_MSG(cl_wait_instance(&g_c, g_port, D1, 1, 10000),
               "the decode instance did not rejoin after SIGCONT");
    ASSERT_MSG(wait_idle(D1, 10000), "the decode instance still holds the failed-over streams");
    ASSERT_MSG(reaches(D1), "no request reached the decode instance after SIGCONT");

    /* a prefill instance hangs: requests still complete (routed or retried elsewhere) */
    cl_signal(&g_c.procs[P1], SIGSTOP);
    int64_t t0 = pd_now_ns();
    served = short_requests(6);
    double took = (double)(pd_now_ns() - t0) / 1e9;
    bool p_out = cl_wait_instance(&g_c, g_port, P1, 0, 5000);
    cl_signal(&g_c.procs[P1], SIGCONT);
    printf("    SIGSTOP prefill: 6 requests served in %.3f s\n", took);
    ASSERT_EQ_INT(served, 6);
    ASSERT_MSG(p_out, "the stopped prefill instance stayed in routing");
    ASSERT_MSG(cl_wait_instance(&g_c, g_port, P1, 1, 10000),
               "the prefill instance did not rejoin after SIGCONT");
    ASSERT_MSG(wait_idle(P1, 10000), "the prefill instance still holds state");
    ASSERT_MSG(reaches(P1), "no request reached the prefill instance after SIGCONT");
}

/* ---- KV lease: driven through the control plane ---------------------------------------------- */

typedef struct {
    const char *id;
    int pk, dk;
    int lease_ms;
    Pd__ReserveReply *rr;
    Pd__InfoReply *info;
    int status; /* gRPC status of Prefill */
    double seconds;
} prefill_job;

static void *prefill_thread(void *arg)
{
    prefill_job *j = arg;
    static const int32_t prompt[] = {11, 12, 13, 14, 15, 16, 17, 18, 19, 20};
    Pd__DecodeTarget tg[16], *tp[16];
    for (size_t r = 0; r < j->info->n_ranks && r < 16; r++) {
        pd__decode_target__init(&tg[r]);
        tg[r].host = j->info->ranks[r]->device_ip;
        tg[r].port = j->info->ranks[r]->data_port;
        tg[r].kv_head0 = j->info->ranks[r]->kv_head0;
        tg[r].kv_heads = j->info->ranks[r]->kv_heads;
        tp[r] = &tg[r];
    }
    Pd__SamplingParams sp = PD__SAMPLING_PARAMS__INIT;
    sp.n = 1;
    sp.top_p = 1;
    sp.repetition_penalty = 1;
    sp.logprobs = -1;
    sp.max_tokens = 16;
    sp.ignore_eos = true;
    Pd__PrefillRequest q = PD__PREFILL_REQUEST__INIT;
    q.request_id = (char *)j->id;
    q.prompt_ids = (int32_t *)prompt;
    q.n_prompt_ids = sizeof prompt / sizeof prompt[0];
    q.sampling = &sp;
    q.targets = tp;
    q.n_targets = j->info->n_ranks;
    q.decode_block_ids = j->rr->block_ids;
    q.n_decode_block_ids = j->rr->n_block_ids;
    q.lease_ms = j->lease_ms;
    int64_t t0 = pd_now_ns();
    ProtobufCMessage *m = cl_call(cl_node(&g_c, j->pk), "/pd.PD/Prefill", &q.base,
                                  &pd__prefill_reply__descriptor, 60000, &j->status);
    j->seconds = (double)(pd_now_ns() - t0) / 1e9;
    if (m) protobuf_c_message_free_unpacked(m, NULL);
    return NULL;
}

static int64_t st_leases(const Pd__StatsReply *s)
{
    return s->leases_held;
}

/* Reserve of tokens on dk and Info of dk, for a Prefill that targets it. */
static bool reserve_on(int dk, const char *id, int tokens, Pd__ReserveReply **rr,
                       Pd__InfoReply **info)
{
    int st;
    Pd__InfoRequest iq = PD__INFO_REQUEST__INIT;
    *info = (Pd__InfoReply *)cl_call(cl_node(&g_c, dk), "/pd.PD/Info", &iq.base,
                                     &pd__info_reply__descriptor, 5000, &st);
    Pd__ReserveRequest q = PD__RESERVE_REQUEST__INIT;
    q.request_id = (char *)id;
    q.num_prompt_tokens = tokens;
    q.ttl_ms = 60000;
    *rr = (Pd__ReserveReply *)cl_call(cl_node(&g_c, dk), "/pd.PD/Reserve", &q.base,
                                      &pd__reserve_reply__descriptor, 5000, &st);
    if (!*info || !*rr) printf("    Info/Reserve on node %d: %s\n", dk, pd_last_error());
    return *info && *rr;
}

static void free_reserve(prefill_job *j)
{
    if (j->rr) pd__reserve_reply__free_unpacked(j->rr, NULL);
    if (j->info) pd__info_reply__free_unpacked(j->info, NULL);
    j->rr = NULL;
    j->info = NULL;
}

static void abort_on(int k, const char *id)
{
    Pd__AbortRequest q = PD__ABORT_REQUEST__INIT;
    q.request_id = (char *)id;
    int st;
    ProtobufCMessage *m =
        cl_call(cl_node(&g_c, k), "/pd.PD/Abort", &q.base, &pd__abort_reply__descriptor, 5000, &st);
    if (m) protobuf_c_message_free_unpacked(m, NULL);
}

/* A Reserve that waits on a decode instance the heartbeat then finds gone (stopped, so the call
 * hangs instead of failing) is cancelled and tried on the other decode instance, as one that
 * fails at once is: nothing has been streamed for the request. Two requests one after the other
 * while D1 is stopped: picks among equal loads rotate, so one is routed to D1. Once D1 runs
 * again it holds nothing of them. Regression: the heartbeat failed such a request with a 500
 * while its Reserve was pending. */
TEST(faults_pending_reserve_on_lost_decode_retried)
{
    FIXTURE();
    ASSERT(wait_idle(D0, 5000) && wait_idle(D1, 5000));
    ASSERT_MSG(cl_wait_instance(&g_c, g_port, D1, 1, 5000), "decode instance 1 is not in routing");
    cl_signal(&g_c.procs[D1], SIGSTOP);
    int64_t t0 = pd_now_ns();
    int served = short_requests(2);
    double took = (double)(pd_now_ns() - t0) / 1e9;
    bool out = cl_wait_instance(&g_c, g_port, D1, 0, 5000);
    cl_signal(&g_c.procs[D1], SIGCONT);
    bool back = cl_wait_instance(&g_c, g_port, D1, 1, 10000);
    bool idle = back && wait_idle(D1, 10000);
    printf("    decode instance stopped: %d of 2 requests served in %.3f s\n", served, took);
    ASSERT_EQ_INT(served, 2);
    ASSERT_MSG(out, "the stopped decode instance stayed in routing");
    ASSERT_MSG(back, "the decode instance did not rejoin after SIGCONT");
    ASSERT_MSG(idle, "the decode instance kept the cancelled reservation");
}

static int64_t st_reserved(const Pd__StatsReply *s)
{
    return s->reserved_tokens;
}

/* 8 streams reserve on both decode instances while the prefill instances are held (SIGSTOP, for
 * less than a heartbeat's deadline); then decode instance 1 gets sig and the prefill instances
 * go on. The tally of the streams, within 30 s. */
static stream_tally decode_lost_round(int sig, bool *both, double *took)
{
    enum { N = 8 };
    cl_signal(&g_c.procs[P0], SIGSTOP);
    cl_signal(&g_c.procs[P1], SIGSTOP);
    cl_conn cs[N];
    int64_t t0 = pd_now_ns();
    bool opened = open_streams(cs, N, 8) == 0;
    *both = false;
    while (opened && !*both && pd_now_ns() < t0 + 600 * PD_NS_PER_MS) {
        *both = stat_of(D0, st_reserved) > 0 && stat_of(D1, st_reserved) > 0;
        if (!*both) pd_sleep_ns(10 * PD_NS_PER_MS);
    }
    cl_signal(&g_c.procs[D1], sig);
    cl_signal(&g_c.procs[P0], SIGCONT);
    cl_signal(&g_c.procs[P1], SIGCONT);
    stream_tally t = {.other = N};
    if (opened) {
        if (!cl_conn_wait_all(cs, N, CL_MS(30000))) printf("    a stream hung for 30 s\n");
        t = tally(cs, N, t0);
        close_all(cs, N);
    }
    *took = (double)(pd_now_ns() - t0) / 1e9;
    return t;
}

/* A decode instance fails after its Reserve succeeded, before Decode started: nothing has reached
 * the client, so the request goes to the other decode instance (Reserve, Prefill again) instead
 * of failing. Killed: the KV transfers to it fail (Prefill ends with ABORTED), or the scheduler
 * sees it leave first. Stopped: the transfers hang until the heartbeat takes it out of routing,
 * which cancels those Prefill calls. Either way every stream completes on D0. Regression: such
 * requests failed with a 500 (6 of 16 in an outside test). */
TEST(faults_decode_lost_before_decode_rerouted)
{
    FIXTURE();
    static const int sigs[] = {SIGKILL, SIGSTOP};
    for (int i = 0; i < 2; i++) {
        ASSERT(wait_idle(P0, 10000) && wait_idle(P1, 10000));
        ASSERT(wait_idle(D0, 10000) && wait_idle(D1, 10000));
        ASSERT_MSG(cl_wait_instance(&g_c, g_port, D1, 1, 10000),
                   "decode instance 1 is not in routing");
        bool both;
        double took;
        stream_tally t = decode_lost_round(sigs[i], &both, &took);
        int rs = sigs[i] == SIGKILL ? cl_restart(&g_c, D1, CL_MS(30000))
                                    : (cl_signal(&g_c.procs[D1], SIGCONT), 0);
        printf("    decode instance 1 %s after its reservations: %d of 8 streams completed in "
               "%.3f s, %d lost, %d other\n",
               sigs[i] == SIGKILL ? "killed" : "stopped", t.ok, took, t.lost, t.other);
        ASSERT_MSG(both, "not both decode instances held reservations within 0.6 s");
        ASSERT_EQ_INT(t.ok, 8);
        ASSERT_OK(rs);
        ASSERT_MSG(cl_wait_instance(&g_c, g_port, D1, 1, 10000),
                   "decode instance 1 did not rejoin");
    }
    ASSERT(wait_idle(D1, 10000));
    ASSERT_MSG(reaches(D1), "no request reached decode instance 1 after it rejoined");
}

/* The decode side stops acknowledging while the prefill instance holds the KV under its lease:
 * (a) it stays stopped: the lease runs out and frees the KV; (b) it is killed and started again
 * on its port: the broken transfer frees the KV at once. Stats must show nothing held. */
TEST(faults_lease_freed_on_decode_restart)
{
    FIXTURE();
    ASSERT(wait_idle(P1, 10000));
    /* (a) lease expiry */
    prefill_job j = {.id = "lease-expires", .pk = P1, .dk = D0, .lease_ms = 1500};
    ASSERT(reserve_on(D0, j.id, 10, &j.rr, &j.info));
    cl_signal(&g_c.procs[D0], SIGSTOP);
    pthread_t th;
    pthread_create(&th, NULL, prefill_thread, &j);
    int64_t leases_seen = 0;
    int64_t deadline = pd_now_ns() + 5 * PD_NS_PER_S;
    while (leases_seen == 0 && pd_now_ns() < deadline) {
        leases_seen = stat_of(P1, st_leases);
        pd_sleep_ns(20 * PD_NS_PER_MS);
    }
    pthread_join(th, NULL);
    bool idle = wait_idle(P1, 5000);
    cl_signal(&g_c.procs[D0], SIGCONT);
    abort_on(D0, j.id);
    free_reserve(&j);
    printf("    lease of 1.5 s: Prefill failed with %d after %.3f s\n", j.status, j.seconds);
    ASSERT_EQ_INT(leases_seen, 1);
    ASSERT_MSG(j.status != PD_RPC_OK, "Prefill succeeded without the decode side");
    ASSERT_MSG(j.seconds < CL_SEC(5.0), "the lease did not expire in time (%.3f s)", j.seconds);
    ASSERT_MSG(idle, "the prefill instance still holds KV after the lease ran out");
    ASSERT(wait_idle(D0, 5000));

    /* (b) the decode instance dies and comes back while the lease is held */
    prefill_job k = {.id = "lease-broken", .pk = P1, .dk = D0, .lease_ms = 30000};
    ASSERT(reserve_on(D0, k.id, 10, &k.rr, &k.info));
    cl_signal(&g_c.procs[D0], SIGSTOP);
    pthread_create(&th, NULL, prefill_thread, &k);
    leases_seen = 0;
    deadline = pd_now_ns() + 5 * PD_NS_PER_S;
    while (leases_seen == 0 && pd_now_ns() < deadline) {
        leases_seen = stat_of(P1, st_leases);
        pd_sleep_ns(20 * PD_NS_PER_MS);
    }
    int64_t t_kill = pd_now_ns();
    cl_signal(&g_c.procs[D0], SIGKILL);
    int rs = cl_restart(&g_c, D0, CL_MS(30000));
    idle = wait_idle(P1, 10000);
    double freed_s = (double)(pd_now_ns() - t_kill) / 1e9;
    pthread_join(th, NULL);
    free_reserve(&k);
    printf("    decode restarted under a 30 s lease: KV freed within %.3f s, Prefill status %d\n",
           freed_s, k.status);
    ASSERT_EQ_INT(leases_seen, 1);
    ASSERT_OK(rs);
    ASSERT_MSG(idle, "the prefill instance still holds KV after the decode instance restarted");
    ASSERT_MSG(k.status != PD_RPC_OK, "Prefill succeeded although its decode side died");
    ASSERT_MSG(freed_s < CL_SEC(10.0), "KV freed %.3f s after the kill", freed_s);
    /* the restarted decode instance takes KV from the same prefill instance */
    static const int32_t prompt[] = {21, 22, 23, 24, 25};
    cl_result res;
    ASSERT_OK(cl_generate(&g_c, P1, D0, "lease-after", prompt, 5, NULL, &res));
    ASSERT_EQ_INT(res.n, 16);
    ASSERT(wait_idle(P1, 5000));
    ASSERT(wait_idle(D0, 5000));
    /* and the scheduler, which may not have seen it go (a restart between two heartbeats),
     * sends it requests with its new data ports (Stats' instance_epoch changed) */
    ASSERT_MSG(reaches(D0), "no request through the scheduler reached the restarted instance");
}

/* A decode instance hangs while prefill instance P1 is sending it the KV of as many prompts as P1
 * has transfer workers; the scheduler gives up on them (cancels the Prefill calls and sends
 * Abort, as it does when the instance leaves the routing set). P1 must free their KV and
 * workers at once, not when the 30 s leases run out, and serve a request for the other decode
 * instance meanwhile. Regression: Abort did not reach a transfer in progress, so the KV stayed
 * held and every other request on P1 waited for a transfer worker until the leases expired. */
TEST(faults_stuck_transfer_aborted)
{
    FIXTURE();
    enum { N = 4 }; /* pd-prefill's transfer workers */
    ASSERT(wait_idle(P1, 10000));
    prefill_job jobs[N];
    char ids[N][32];
    pthread_t th[N];
    int reserved = 0;
    for (; reserved < N; reserved++) {
        snprintf(ids[reserved], sizeof ids[reserved], "stuck-%d", reserved);
        jobs[reserved] = (prefill_job){.id = ids[reserved], .pk = P1, .dk = D0, .lease_ms = 30000};
        if (!reserve_on(D0, ids[reserved], 10, &jobs[reserved].rr, &jobs[reserved].info)) break;
    }
    if (reserved < N) {
        for (int i = 0; i < reserved; i++) free_reserve(&jobs[i]);
        ASSERT_MSG(0, "Reserve on the decode instance failed");
    }
    cl_signal(&g_c.procs[D0], SIGSTOP);
    for (int i = 0; i < N; i++) pthread_create(&th[i], NULL, prefill_thread, &jobs[i]);
    int64_t leases = 0;
    int64_t deadline = pd_now_ns() + 10 * PD_NS_PER_S;
    while (leases < N && pd_now_ns() < deadline) {
        leases = stat_of(P1, st_leases);
        pd_sleep_ns(20 * PD_NS_PER_MS);
    }
    if (leases < N) { /* what kept a transfer from being held: the instances' own words */
        printf("    %lld of %d leases held after 10 s\n", (long long)leases, N);
        Pd__StatsReply *st = cl_stats(&g_c, P1);
        if (st)
            printf("    prefill 1: running %lld, waiting %lld, held %lld, finished %lld\n",
                   (long long)st->num_running, (long long)st->num_waiting, (long long)st->num_held,
                   (long long)st->requests_finished);
        if (st) pd__stats_reply__free_unpacked(st, NULL);
        for (int i = 0; i < N; i++)
            printf("    job %d: status %d after %.3f s\n", i, jobs[i].status, jobs[i].seconds);
        cl_dump_log(&g_c.procs[P1], 40);
        cl_dump_log(&g_c.procs[D0], 20);
    }
    int64_t t0 = pd_now_ns();
    for (int i = 0; i < N; i++) abort_on(P1, ids[i]);
    bool idle = wait_idle(P1, 3000);
    double freed_s = (double)(pd_now_ns() - t0) / 1e9;
    /* the other decode instance is served by P1 meanwhile */
    static const int32_t prompt[] = {61, 62, 63, 64, 65, 66};
    cl_result res;
    int rc = cl_generate(&g_c, P1, D1, "beside-stuck", prompt, 6, NULL, &res);
    double other_s = (double)(pd_now_ns() - t0) / 1e9;
    cl_signal(&g_c.procs[D0], SIGCONT);
    int failed = 0;
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        failed += jobs[i].status != PD_RPC_OK;
        abort_on(D0, ids[i]);
        free_reserve(&jobs[i]);
    }
    printf("    %d transfers stuck on a stopped decode instance: KV freed %.3f s after Abort, a "
           "request for the other decode instance done %.3f s after it\n",
           N, freed_s, other_s);
    ASSERT_EQ_INT(leases, N);
    ASSERT_MSG(idle, "the prefill instance still holds the aborted requests' KV after 3 s");
    ASSERT_OK(rc);
    ASSERT_MSG(other_s < CL_SEC(5.0), "the request beside the stuck transfers took %.3f s",
               other_s);
    ASSERT_EQ_INT(failed, N);
    ASSERT(wait_idle(D0, 5000));
}

/* ---- a prefill retried after a broken KV transfer -------------------------------------------- */

typedef struct {
    const char *id;
    size_t n_tokens; /* the prompt's */
    int status;      /* of the partial send */
} partial_kv;

/* Plays a prefill instance that dies half-way through its transfer: sends the reservation's
 * first KV head of every layer (zeros, not the prompt's KV) to decode rank 0, then hangs up.
 * Like a prefill instance, it sends only the blocks after the reply's cached_tokens. */
static int send_partial_kv(void *arg, const Pd__InfoReply *info, const Pd__ReserveReply *rr)
{
    partial_kv *pk = arg;
    pk->status = PD_EINTERNAL;
    if (info->n_ranks < 1 || info->ranks[0]->kv_heads < 2)
        return pd_error(PD_EINVAL, "the decode rank holds fewer than 2 KV heads");
    const Pd__RankInfo *rk = info->ranks[0];
    pd_backend_params bp = pd_backend_default_params();
    bp.n_threads = 1;
    pd_backend *b = NULL;
    PD_CHECK(pd_backend_cpu_create(&bp, &b));
    pd_kv_params kp = {.n_layers = info->num_layers,
                       .n_blocks = rr->n_block_ids,
                       .block_size = (size_t)info->block_size,
                       .n_kv_heads = (size_t)rk->kv_heads,
                       .head_dim = (size_t)info->head_dim,
                       .dtype = PD_DTYPE_F32};
    pd_kv *kv = NULL;
    int32_t blocks[64];
    for (size_t i = 0; i < rr->n_block_ids && i < 64; i++) blocks[i] = (int32_t)i;
    int rc = rr->n_block_ids <= 64 ? pd_backend_get_ops(b)->kv_create(b, &kp, &kv)
                                   : pd_error(PD_ERANGE, "too many blocks");
    pd_kv_tcp_sender *tx = NULL;
    if (rc == PD_OK) rc = pd_kv_tcp_sender_create(&tx);
    size_t skip = (size_t)rr->cached_tokens / (size_t)info->block_size;
    if (rc == PD_OK && skip >= rr->n_block_ids)
        rc = pd_error(PD_EINVAL, "%lld cached tokens of %zu blocks", (long long)rr->cached_tokens,
                      rr->n_block_ids);
    if (rc == PD_OK) {
        pd_kv_send_req r = {.request_id = pk->id,
                            .host = rk->device_ip,
                            .port = rk->data_port,
                            .backend = b,
                            .kv = kv,
                            .kv_params = kp,
                            .src_head0 = (size_t)rk->kv_head0,
                            .block_ids = blocks + skip,
                            .n_blocks = rr->n_block_ids - skip,
                            .n_tokens = pk->n_tokens - (size_t)rr->cached_tokens,
                            .head0 = (size_t)rk->kv_head0,
                            .n_heads = 1,
                            .timeout_ms = 10000};
        pd_kv_send_stats st;
        rc = pd_kv_tcp_send(tx, &r, &st);
    }
    pk->status = rc;
    pd_kv_tcp_sender_free(tx); /* hangs up */
    if (kv) pd_backend_get_ops(b)->kv_free(b, kv);
    pd_backend_free(b);
    return rc;
}

/* A prefill instance dies after part of the prompt's KV reached the decode instance, and the
 * prefill is retried on another instance with the same reservation (docs/nodes.md, request
 * lifecycle): the decode side must take the retry's frames, also for the (layer, head) pairs that
 * had arrived, and the output must be the one of an undisturbed run. Regression: they were refused
 * ("layer 0 head 0 sent twice") and the retried request failed. */
TEST(faults_prefill_retry_after_partial_kv)
{
    FIXTURE();
    static const int32_t prompt[] = {31, 32, 33, 34, 35, 36, 37, 38, 39, 40,
                                     41, 42, 43, 44, 45, 46, 47, 48, 49, 50};
    size_t n = sizeof prompt / sizeof prompt[0];
    cl_result ref, got;
    ASSERT_OK(cl_generate(&g_c, P0, D1, "partial-ref", prompt, n, NULL, &ref));
    partial_kv pk = {.id = "partial-kv", .n_tokens = n};
    int rc = cl_generate_hook(&g_c, P1, D1, pk.id, prompt, n, NULL, send_partial_kv, &pk, &got);
    if (rc < 0) abort_on(D1, pk.id); /* the reservation, when the request failed before Decode */
    ASSERT_MSG(pk.status == PD_OK, "the partial transfer itself failed");
    ASSERT_MSG(rc == PD_OK, "the prefill after a broken transfer failed: %s", got.error);
    ASSERT_EQ_INT(got.n, ref.n);
    ASSERT(memcmp(got.tokens, ref.tokens, ref.n * sizeof ref.tokens[0]) == 0);
    ASSERT(wait_idle(P1, 5000));
    ASSERT(wait_idle(D1, 5000));
}

/* A client *cl and a registry *reg of the live cluster with the scheduler's max_model_len
 * (0: none), its heartbeat started (every 200 ms); *round: its first heartbeat round completed
 * within 10 s. The caller frees both. */
static int live_registry(pd_rpc_client **cl, pd_reg **reg, int64_t max_model_len, bool *round)
{
    char ports[64];
    snprintf(ports, sizeof ports, "%d,%d,%d,%d", g_c.ports[0], g_c.ports[1], g_c.ports[2],
             g_c.ports[3]);
    *reg = NULL;
    *round = false;
    PD_CHECK(pd_rpc_client_create(cl));
    PD_CHECK(pd_reg_create(g_c.global, ports, *cl, reg));
    pd_reg_set_max_model_len(*reg, max_model_len);
    PD_CHECK(pd_reg_start(*reg, 200, 2000, NULL, NULL));
    *round = pd_reg_wait_round(*reg, 10000);
    return PD_OK;
}

/* The scheduler's registry against the live cluster: with every instance idle (equal load),
 * picks take turns over the instances of a role, and an instance out of the routing set is never
 * picked. Regression: the round-robin cursor ran over all instances, not the role's, so with
 * 2 prefill + 2 decode instances ties went 3:1 to the first one of each role. */
TEST(faults_registry_round_robin)
{
    FIXTURE();
    for (int k = 0; k < 4; k++) ASSERT(wait_idle(k, 5000));
    pd_rpc_client *cl = NULL;
    pd_reg *reg = NULL;
    bool round;
    int rc = live_registry(&cl, &reg, 0, &round);
    int picks[4] = {0}, none = 0;
    for (int i = 0; round && i < 8; i++) {
        int p = pd_reg_pick(reg, RT_ROLE_PREFILL, 0, -1),
            d = pd_reg_pick(reg, RT_ROLE_DECODE, 0, -1);
        if (p < 0 || d < 0) none++;
        if (p >= 0) picks[p]++;
        if (d >= 0) picks[d]++;
    }
    /* an instance that stops answering leaves the routing set and is not picked */
    cl_signal(&g_c.procs[D1], SIGSTOP);
    int64_t deadline = pd_now_ns() + (int64_t)CL_MS(10000) * PD_NS_PER_MS;
    while (round && pd_reg_is_up(reg, D1) && pd_now_ns() < deadline) pd_sleep_ns(50 * PD_NS_PER_MS);
    bool out = round && !pd_reg_is_up(reg, D1);
    int to_d0 = 0;
    for (int i = 0; out && i < 4; i++) to_d0 += pd_reg_pick(reg, RT_ROLE_DECODE, 0, -1) == D0;
    cl_signal(&g_c.procs[D1], SIGCONT);
    /* back after SIGCONT; a failure reported by a caller takes it out at once, and the next
     * heartbeat that it answers brings it back */
    deadline = pd_now_ns() + (int64_t)CL_MS(10000) * PD_NS_PER_MS;
    while (round && !pd_reg_is_up(reg, D1) && pd_now_ns() < deadline)
        pd_sleep_ns(50 * PD_NS_PER_MS);
    bool back = round && pd_reg_is_up(reg, D1);
    if (back) pd_reg_report_failure(reg, D1, "Reserve failed: UNAVAILABLE (test)");
    bool reported_out = back && !pd_reg_is_up(reg, D1);
    while (back && !pd_reg_is_up(reg, D1) && pd_now_ns() < deadline) pd_sleep_ns(50 * PD_NS_PER_MS);
    bool rejoined = back && pd_reg_is_up(reg, D1);
    pd_reg_free(reg);
    pd_rpc_client_free(cl);
    printf("    8 picks per role among idle instances: prefill %d/%d, decode %d/%d\n", picks[P0],
           picks[P1], picks[D0], picks[D1]);
    ASSERT_OK(rc);
    ASSERT(round);
    ASSERT_EQ_INT(none, 0);
    ASSERT_EQ_INT(picks[P0], 4);
    ASSERT_EQ_INT(picks[P1], 4);
    ASSERT_EQ_INT(picks[D0], 4);
    ASSERT_EQ_INT(picks[D1], 4);
    ASSERT(out);
    ASSERT_EQ_INT(to_d0, 4);
    ASSERT_MSG(back, "decode instance 1 did not rejoin after SIGCONT");
    ASSERT(reported_out);
    ASSERT_MSG(rejoined, "decode instance 1 did not rejoin after a reported failure");
    ASSERT_MSG(cl_wait_instance(&g_c, g_port, D1, 1, 10000),
               "decode instance 1 did not rejoin after SIGCONT");
}

/* The scheduler's registry with a max_model_len above the instances' (1024): none joins the
 * routing set, each logged with both values; at 1024 every one joins. Regression: a scheduler at
 * 2048 in front of nodes at 1024 admitted a 1199-token prompt, whose Reserve then failed with
 * INVALID_ARGUMENT ("maximum context length is 1024"), a 500 to the client. */
TEST(faults_registry_max_model_len)
{
    FIXTURE();
    char path[600];
    snprintf(path, sizeof path, "%s/registry_max_model_len.log", g_c.dir);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    ASSERT(fd >= 0);
    pd_log_set_fd(fd); /* the registry's warnings, to read back */
    pd_rpc_client *cl = NULL, *cl2 = NULL;
    pd_reg *big = NULL, *fits = NULL;
    bool round_big, round_fits;
    int rc = live_registry(&cl, &big, 2048, &round_big);
    int rc2 = live_registry(&cl2, &fits, 1024, &round_fits);
    int up_big = 0, up_fits = 0;
    for (int k = 0; k < 4; k++) {
        up_big += rc == PD_OK && pd_reg_is_up(big, k);
        up_fits += rc2 == PD_OK && pd_reg_is_up(fits, k);
    }
    pd_reg_free(big);
    pd_reg_free(fits);
    if (cl) pd_rpc_client_free(cl);
    if (cl2) pd_rpc_client_free(cl2);
    pd_log_set_fd(2);
    close(fd);
    char cmd[1000];
    snprintf(cmd, sizeof cmd,
             "test \"$(grep -c \"out of the routing set: does not fit this scheduler: its "
             "max_model_len 1024 is less than the scheduler's --max-model-len 2048\" '%s')\" -ge 4",
             path);
    bool logged = system(cmd) == 0;
    printf("    instances up: %d with the scheduler at 2048, %d at 1024\n", up_big, up_fits);
    ASSERT_OK(rc);
    ASSERT_OK(rc2);
    ASSERT(round_big && round_fits);
    ASSERT_EQ_INT(up_big, 0);
    ASSERT_EQ_INT(up_fits, 4);
    ASSERT_MSG(logged, "no warning per instance naming both max_model_len values in %s", path);
}

/* Prefix-aware prefill routing against the live cluster (2 idle prefill instances, 16-token
 * blocks): a prompt goes back to the instance that took its leading blocks before, as far as
 * they match, unless that instance has more queued work than the blocks would save; a prompt
 * that shares nothing takes turns as before. */
TEST(faults_registry_prefix_affinity)
{
    FIXTURE();
    for (int k = 0; k < 4; k++) ASSERT(wait_idle(k, 5000));
    pd_rpc_client *cl = NULL;
    pd_reg *reg = NULL;
    bool round;
    int rc = live_registry(&cl, &reg, 0, &round);
    int32_t a[48], b[48], a2[40], turn2[88], alt[88];
    int64_t dhit[4] = {0};
    int da = -1, da2 = -1, dt = -1, dalt = -1;
    for (int i = 0; i < 48; i++) a[i] = 100 + i, b[i] = 300 + i;
    for (int i = 0; i < 40; i++) a2[i] = i < 32 ? a[i] : 500 + i;
    int64_t hit[6] = {0};
    int pa = -1, again = -1, part = -1, excl = -1, busy = -1, other = -1;
    if (round) {
        pa = pd_reg_pick_cached(reg, RT_ROLE_PREFILL, a, 48, 48, -1, &hit[0]);
        pd_reg_release(reg, pa, 48 - hit[0]); /* equal loads again */
        again = pd_reg_pick_cached(reg, RT_ROLE_PREFILL, a, 48, 48, -1, &hit[1]);
        pd_reg_release(reg, again, 48 - hit[1]);
        part = pd_reg_pick_cached(reg, RT_ROLE_PREFILL, a2, 40, 40, -1,
                                  &hit[2]); /* its first 2 blocks are a's */
        pd_reg_release(reg, part, 40 - hit[2]);
        /* 100 tokens queued on a's instance outweigh the 48 its cache would save */
        int q = pd_reg_pick(reg, RT_ROLE_PREFILL, 100, pa == P0 ? P1 : P0);
        busy = pd_reg_pick_cached(reg, RT_ROLE_PREFILL, a, 48, 48, -1, &hit[4]);
        pd_reg_release(reg, busy, 48 - hit[4]);
        pd_reg_release(reg, q, 100);
        excl = pd_reg_pick_cached(reg, RT_ROLE_PREFILL, b, 48, 48, busy,
                                  &hit[3]); /* b: new everywhere */
        pd_reg_release(reg, excl, 48 - hit[3]);
        other = pd_reg_pick_cached(reg, RT_ROLE_PREFILL, b, 48, 48, -1, &hit[5]);
        pd_reg_release(reg, other, 48 - hit[5]);
        /* decode instances alike: a's reservation goes where a's blocks went */
        da = pd_reg_pick_cached(reg, RT_ROLE_DECODE, a, 48, 64, -1, &dhit[0]);
        pd_reg_release(reg, da, 64 - dhit[0]);
        da2 = pd_reg_pick_cached(reg, RT_ROLE_DECODE, a, 48, 64, -1, &dhit[1]);
        pd_reg_release(reg, da2, 64 - dhit[1]);
        /* a later turn: a, the 24 tokens generated for it, 16 new ones. Once a's sequence on
         * da is noted, the block of generated tokens da computed counts there too (48 + 23
         * tokens: 4 full blocks); a turn after another answer finds a's 3 blocks only */
        for (int i = 0; i < 88; i++) turn2[i] = i < 48 ? a[i] : 700 + i;
        memcpy(alt, turn2, sizeof alt);
        alt[60] = 1;
        dalt = pd_reg_pick_cached(reg, RT_ROLE_DECODE, alt, 88, 104, -1, &dhit[2]);
        pd_reg_release(reg, dalt, 104 - dhit[2]);
        pd_reg_note_cached(reg, da, turn2, 48 + 24 - 1);
        dt = pd_reg_pick_cached(reg, RT_ROLE_DECODE, turn2, 88, 104, -1, &dhit[3]);
        pd_reg_release(reg, dt, 104 - dhit[3]);
    }
    pd_reg_free(reg);
    pd_rpc_client_free(cl);
    printf("    prompt a -> %d (hit %lld), again -> %d (hit %lld), a's first 32 tokens -> %d (hit "
           "%lld), busy -> %d (hit %lld), b excluding %d -> %d, b again -> %d (hit %lld)\n",
           pa, (long long)hit[0], again, (long long)hit[1], part, (long long)hit[2], busy,
           (long long)hit[4], busy, excl, other, (long long)hit[5]);
    ASSERT_OK(rc);
    ASSERT(round);
    ASSERT(pa == P0 || pa == P1);
    ASSERT_EQ_INT(hit[0], 0);
    ASSERT_EQ_INT(again, pa);
    ASSERT_EQ_INT(hit[1], 48);
    ASSERT_EQ_INT(part, pa);
    ASSERT_EQ_INT(hit[2], 32);
    ASSERT(busy >= 0 && busy != pa);
    ASSERT_EQ_INT(hit[4], 0);
    ASSERT(excl >= 0 && excl != busy);
    ASSERT_EQ_INT(hit[3], 0);
    ASSERT_EQ_INT(other, excl); /* b went there */
    ASSERT_EQ_INT(hit[5], 48);
    printf("    decode: prompt a -> %d (hit %lld), again -> %d (hit %lld)\n", da,
           (long long)dhit[0], da2, (long long)dhit[1]);
    ASSERT(da == D0 || da == D1);
    ASSERT_EQ_INT(dhit[0], 0);
    ASSERT_EQ_INT(da2, da);
    ASSERT_EQ_INT(dhit[1], 48);
    printf("    decode, the next turn after another answer -> %d (hit %lld); after a's sequence "
           "was noted -> %d (hit %lld)\n",
           dalt, (long long)dhit[2], dt, (long long)dhit[3]);
    ASSERT_EQ_INT(dalt, da);
    ASSERT_EQ_INT(dhit[2], 48);
    ASSERT_EQ_INT(dt, da);
    ASSERT_EQ_INT(dhit[3], 64);
}

static int64_t st_queries(const Pd__StatsReply *s)
{
    return s->prefix_cache_queries;
}

static int64_t st_hits(const Pd__StatsReply *s)
{
    return s->prefix_cache_hits;
}

/* A conversation's next turn goes to the decode instance that holds the last turn's answer
 * (scheduler.md: the scheduler notes a finished sequence's blocks). Turn 1: a 48-token prompt
 * and 40 generated tokens, whose first 87 the decode instance computed (5 full blocks: the
 * prompt's 3 and 2 of the answer). Then that instance carries 96 reserved tokens and the other
 * 32, so that only the answer's blocks make it the cheaper pick (96 - 80 < 32 < 96 - 48). Turn 2
 * (turn 1's prompt and answer, 16 new tokens) must go there and find 80 tokens in its cache. */
TEST(faults_next_turn_follows_the_answer)
{
    FIXTURE();
    for (int k = 0; k < 4; k++) ASSERT(wait_idle(k, 5000));
    char body[2048];
    size_t o = (size_t)snprintf(body, sizeof body, "{\"prompt\":[");
    for (int i = 0; i < 48; i++)
        o += (size_t)snprintf(body + o, sizeof body - o, "%s%d", i ? "," : "", 200 + 3 * i);
    snprintf(body + o, sizeof body - o,
             "],\"max_tokens\":40,\"ignore_eos\":true,\"temperature\":0,\"logprobs\":0,"
             "\"return_tokens_as_token_ids\":true}");
    int64_t q0[2] = {stat_of(D0, st_queries), stat_of(D1, st_queries)};
    char *resp = NULL;
    int st = cl_http(g_port, "POST", "/v1/completions", body, 30000, &resp, NULL);
    json_t *js = st == 200 && resp ? json_loads(resp, 0, NULL) : NULL;
    free(resp);
    json_t *toks = json_object_get(
        json_object_get(json_array_get(json_object_get(js, "choices"), 0), "logprobs"), "tokens");
    int32_t gen[40];
    size_t n_gen = 0;
    for (size_t i = 0; i < json_array_size(toks) && n_gen < 40; i++) {
        const char *t = json_string_value(json_array_get(toks, i));
        if (t && strncmp(t, "token_id:", 9) == 0) gen[n_gen++] = (int32_t)atoi(t + 9);
    }
    json_decref(js);
    ASSERT_EQ_INT(st, 200);
    ASSERT_EQ_INT(n_gen, 40);
    int dx = -1;
    for (int k = 0; k < 2; k++)
        if (stat_of(D0 + k, st_queries) > q0[k]) dx = D0 + k;
    ASSERT_MSG(dx >= 0, "turn 1 reached no decode instance's prefix cache");
    int dy = dx == D0 ? D1 : D0;
    Pd__ReserveReply *rr[2] = {NULL, NULL};
    Pd__InfoReply *info[2] = {NULL, NULL};
    bool held = reserve_on(dx, "hold-x", 96, &rr[0], &info[0]) &&
                reserve_on(dy, "hold-y", 32, &rr[1], &info[1]);
    pd_sleep_ns(2500 * PD_NS_PER_MS); /* the scheduler's view of both loads: its heartbeat */
    int64_t h0[2] = {stat_of(dx, st_hits), stat_of(dy, st_hits)};
    int64_t q1[2] = {stat_of(dx, st_queries), stat_of(dy, st_queries)};
    o = (size_t)snprintf(body, sizeof body, "{\"prompt\":[");
    for (int i = 0; i < 104; i++) {
        int id = i < 48 ? 200 + 3 * i : i < 88 ? gen[i - 48] : 900 + i;
        o += (size_t)snprintf(body + o, sizeof body - o, "%s%d", i ? "," : "", id);
    }
    snprintf(body + o, sizeof body - o, "],\"max_tokens\":2,\"ignore_eos\":true}");
    resp = NULL;
    int st2 = held ? cl_http(g_port, "POST", "/v1/completions", body, 30000, &resp, NULL) : -1;
    free(resp);
    int64_t h1[2] = {stat_of(dx, st_hits), stat_of(dy, st_hits)};
    int64_t q2[2] = {stat_of(dx, st_queries), stat_of(dy, st_queries)};
    abort_on(dx, "hold-x");
    abort_on(dy, "hold-y");
    for (int k = 0; k < 2; k++) {
        if (rr[k]) pd__reserve_reply__free_unpacked(rr[k], NULL);
        if (info[k]) pd__info_reply__free_unpacked(info[k], NULL);
    }
    printf("    turn 1 on node %d; turn 2: queries +%lld / +%lld, hits +%lld / +%lld (node %d / "
           "%d)\n",
           dx, (long long)(q2[0] - q1[0]), (long long)(q2[1] - q1[1]), (long long)(h1[0] - h0[0]),
           (long long)(h1[1] - h0[1]), dx, dy);
    ASSERT(held);
    ASSERT_EQ_INT(st2, 200);
    ASSERT_EQ_INT(q2[0] - q1[0], 104); /* turn 2 reserved on dx */
    ASSERT_EQ_INT(q2[1] - q1[1], 0);
    ASSERT_EQ_INT(h1[0] - h0[0], 80); /* the prompt's 3 blocks and the answer's 2 */
    for (int k = 0; k < 4; k++) ASSERT(wait_idle(k, 5000));
}

/* A scheduler killed while it streams: the decode instances lose its relay streams and Decode
 * calls at once, abort its requests and free their KV, and keep serving another scheduler. */
TEST(faults_scheduler_kill_midstream)
{
    FIXTURE();
    cl_proc sp;
    int port;
    ASSERT_OK(cl_sched_start(&g_c, &sp, "scheduler_killed", NULL, &port));
    cl_conn cs[8];
    ASSERT(open_streams_on(port, cs, 8, 1000) == 0);
    bool started = wait_first_bytes(cs, 8, 30000);
    int64_t t_kill = pd_now_ns();
    cl_signal(&sp, SIGKILL);
    cl_wait(&sp, 10000);
    close_all(cs, 8);
    bool idle =
        wait_idle(D0, 5000) && wait_idle(D1, 5000) && wait_idle(P0, 5000) && wait_idle(P1, 5000);
    double idle_s = (double)(pd_now_ns() - t_kill) / 1e9;
    bool closed =
        log_has(&g_c.procs[D0], "relay closed: ") || log_has(&g_c.procs[D1], "relay closed: ");
    printf("    every instance idle %.3f s after the kill (relay closed: %s)\n", idle_s,
           closed ? "yes" : "no");
    ASSERT_MSG(started, "not every stream started within 30 s");
    ASSERT_MSG(idle, "an instance still holds the killed scheduler's requests");
    ASSERT_MSG(closed, "no decode instance logged its relay stream closing");
    int served = short_requests(8);
    if (served != 8)
        for (int k = 0; k < g_c.n_prefill + g_c.n_decode; k++) cl_dump_log(&g_c.procs[k], 15);
    ASSERT_EQ_INT(served, 8);
}

/* A decode instance dies while idle and requests arrive before the heartbeat has noticed:
 * nothing has been streamed for them, so a failed Reserve should be tried on the other decode
 * instance, as a failed Prefill is tried on another prefill instance (docs/nodes.md, request
 * lifecycle; issue #9: "new requests go to the remaining decode instance"). Regression: a Reserve
 * that failed with UNAVAILABLE ended the request with a 500 (scheduler/server_chain.c
 * on_reserve_done now takes the instance out of routing and picks another). */
TEST(faults_y_decode_kill_before_heartbeat)
{
    FIXTURE();
    ASSERT(wait_idle(D0, 5000) && wait_idle(D1, 5000));
    ASSERT_MSG(cl_wait_instance(&g_c, g_port, D0, 1, 5000), "decode instance 0 is not in routing");
    cl_signal(&g_c.procs[D0], SIGKILL);
    int served = short_requests(8);
    bool out = cl_wait_instance(&g_c, g_port, D0, 0, 5000);
    int rs = cl_restart(&g_c, D0, CL_MS(30000));
    bool back = rs == PD_OK && cl_wait_instance(&g_c, g_port, D0, 1, 10000);
    printf("    decode instance killed while idle: %d of 8 requests right after served\n", served);
    ASSERT(out);
    ASSERT(back);
    ASSERT_EQ_INT(served, 8);
}

/* A decode instance restarted after a long outage rejoins within a heartbeat or two.
 * Regression: the scheduler's channel to it retried the connection on gRPC's default backoff
 * (1 s, x1.6 per failure, up to 120 s), so after a 50 s outage it rejoined 24 s after it was
 * back (and /health stayed 503 that long in a 1P1D cluster); common/rpc/rpc.c caps the backoff
 * at 1 s. After 32 s of failures the default's next attempt is ~11 s away. */
TEST(faults_y_decode_rejoin_after_long_outage)
{
    FIXTURE();
    ASSERT(wait_idle(D1, 5000));
    ASSERT_MSG(cl_wait_instance(&g_c, g_port, D1, 1, 5000), "decode instance 1 is not in routing");
    cl_signal(&g_c.procs[D1], SIGKILL);
    bool out = cl_wait_instance(&g_c, g_port, D1, 0, 5000);
    pd_sleep_ns(32 * PD_NS_PER_S); /* the outage: every heartbeat fails to connect */
    int rs = cl_restart(&g_c, D1, CL_MS(30000));
    int64_t t_back = pd_now_ns();
    bool back = rs == PD_OK && cl_wait_instance(&g_c, g_port, D1, 1, 30000);
    double took = (double)(pd_now_ns() - t_back) / 1e9;
    printf("    decode instance back after a 32 s outage: in routing %.3f s after it answered "
           "Info\n",
           took);
    ASSERT(out);
    ASSERT_OK(rs);
    ASSERT_MSG(back, "the restarted decode instance did not rejoin within 30 s");
    ASSERT_MSG(took < CL_SEC(5.0),
               "the restarted decode instance rejoined %.3f s after it was back", took);
    ASSERT_MSG(reaches(D1), "no request reached the restarted decode instance");
}

TEST(faults_zz_shutdown)
{
    if (!g_ready) SKIP("no cluster");
    int s = cl_stop(&g_sched, 10000);
    if (s != 0) cl_dump_log(&g_sched, 30);
    int bad = cl_stop_all(&g_c);
    g_ready = false;
    ASSERT_EQ_INT(s, 0);
    ASSERT_EQ_INT(bad, 0);
}
