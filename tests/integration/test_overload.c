/* Overload and hostile clients against pd-scheduler in front of a real 1P1D cluster on loopback
 * (issue #9 items 2 and 3):
 *   - 4x --max-concurrent-requests at once: the excess gets 503 with Retry-After: 1 and the
 *     contract's body, every admitted request completes, the scheduler's memory stays bounded;
 *   - the decode instance's KV is all reserved: requests wait in the admission queue, are served
 *     once KV frees up within --queue-timeout, and get the documented 503 after it;
 *   - slowloris: an idle connection, trickled headers, a trickled body and an idle keep-alive
 *     connection are closed after --header-timeout / --body-timeout / --timeout-keep-alive;
 *   - slow SSE readers are held by backpressure with a bounded buffer and lose nothing;
 *   - thousands of connections opened and dropped leave no descriptor and no memory behind
 *     (the scheduler's /proc/<pid>/fd count and VmRSS before and after).
 * Every wait is bounded; every process is stopped at the end, also when a check fails. */
#define _GNU_SOURCE
#include "harness.h"

#include <jansson.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include "cluster.h"
#include "util/clock.h"

enum { LIMIT = 8, P0 = 0, D0 = 1 };

static cl_cluster g_c;
static cl_proc g_sched;
static int g_port;
static bool g_ready, g_failed;
static char g_model[512];

static bool fixture(void)
{
    if (g_ready || g_failed) return g_ready;
    g_failed = true;
    /* Under ASan, freed memory sits in a quarantine (256 MiB by default) and would read as growth
     * in the RSS checks below: keep it small in the processes this test starts. */
    const char *asan = getenv("ASAN_OPTIONS");
    char opts[512];
    snprintf(opts, sizeof opts, "%s%squarantine_size_mb=8:thread_local_quarantine_size_kb=64",
             asan ? asan : "", asan && *asan ? ":" : "");
    setenv("ASAN_OPTIONS", opts, 1);
    if (cl_make_tiny(g_model, sizeof g_model) < 0) return false;
    if (cl_start(&g_c, g_model, "0", "1", NULL) < 0) {
        printf("    cl_start: %s\n", pd_last_error());
        cl_stop_all(&g_c);
        return false;
    }
    char limit[16];
    snprintf(limit, sizeof limit, "%d", LIMIT);
    char *args[] = {"--max-concurrent-requests",
                    limit,
                    "--queue-timeout",
                    "1",
                    "--timeout-keep-alive",
                    "1",
                    "--header-timeout",
                    "1",
                    "--body-timeout",
                    "1",
                    NULL};
    if (cl_sched_start(&g_c, &g_sched, "scheduler", args, &g_port) < 0) {
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

/* Time bounds stretched under valgrind (cl_time_scale), where VmRSS says nothing either. */
#define RSS_CHECKS (cl_time_scale() == 1.0)
/* VmRSS growth allowed where a bounded process should not grow. Under ASan, freed memory goes
 * through a quarantine first (kept to 8 MiB in the processes this test starts). */
#if defined(__SANITIZE_ADDRESS__)
#define RSS_SLACK_KB 12288
#else
#define RSS_SLACK_KB 2048
#endif

static double secs(int64_t from, int64_t to)
{
    return (double)(to - from) / 1e9;
}

static void close_all(cl_conn *cs, int n)
{
    for (int i = 0; i < n; i++) cl_conn_close(&cs[i]);
}

/* Waits up to timeout_ms until the scheduler has at most want descriptors open; the count. */
static int settle_fds(int want, int timeout_ms)
{
    int64_t deadline = pd_now_ns() + (int64_t)timeout_ms * PD_NS_PER_MS;
    int n = cl_fd_count(g_sched.pid);
    while (n > want && pd_now_ns() < deadline) {
        pd_sleep_ns(50 * PD_NS_PER_MS);
        n = cl_fd_count(g_sched.pid);
    }
    return n;
}

/* Decode instance D0 holds nothing (no sequence, no reservation, every KV block free). */
static bool decode_idle(int timeout_ms)
{
    int64_t deadline = pd_now_ns() + (int64_t)CL_MS(timeout_ms) * PD_NS_PER_MS;
    while (pd_now_ns() < deadline) {
        Pd__StatsReply *s = cl_stats(&g_c, D0);
        bool idle = s && s->num_running == 0 && s->num_waiting == 0 && s->reserved_tokens == 0 &&
                    s->kv_blocks_free == s->kv_blocks_total;
        if (s) pd__stats_reply__free_unpacked(s, NULL);
        if (idle) return true;
        pd_sleep_ns(100 * PD_NS_PER_MS);
    }
    Pd__StatsReply *s = cl_stats(&g_c, D0);
    if (s) {
        printf("    decode instance not idle: running %lld, waiting %lld, KV blocks free %lld of "
               "%lld, reserved tokens %lld\n",
               (long long)s->num_running, (long long)s->num_waiting, (long long)s->kv_blocks_free,
               (long long)s->kv_blocks_total, (long long)s->reserved_tokens);
        pd__stats_reply__free_unpacked(s, NULL);
    }
    return false;
}

/* The admitted stream ended as a complete one: finish_reason length, usage, [DONE]. */
static bool stream_complete(const cl_conn *c, int completion_tokens)
{
    char *b = cl_conn_body(c);
    size_t bl = b ? strlen(b) : 0;
    char want[64];
    snprintf(want, sizeof want, "\"completion_tokens\":%d}", completion_tokens);
    bool ok = b && bl >= 14 && strcmp(b + bl - 14, "data: [DONE]\n\n") == 0 &&
              strstr(b, "\"finish_reason\":\"length\"") && strstr(b, want) &&
              !strstr(b, "\"error\"");
    if (!ok) printf("    incomplete stream: %.300s...\n", b ? b : "(no body)");
    free(b);
    return ok;
}

static const char *const LIMIT_BODY =
    "{\"error\":{\"message\":\"The server is at its limit of 8 concurrent requests; retry "
    "later.\",\"type\":\"ServiceUnavailableError\",\"param\":null,\"code\":503}}";

typedef struct {
    int admitted, rejected, bad;
    int max_overlap; /* most admitted streams between first byte and end at one moment */
} wave_result;

/* 4 x LIMIT streaming completions opened at once. */
static wave_result overload_wave(void)
{
    enum { N = 4 * LIMIT };
    cl_conn cs[N];
    wave_result w = {0};
    const char *body = "{\"prompt\":\"Overload\",\"max_tokens\":400,\"ignore_eos\":true,"
                       "\"stream\":true,\"stream_options\":{\"include_usage\":true}}";
    int opened = 0;
    for (; opened < N; opened++)
        if (cl_conn_open(&cs[opened], g_port, "POST", "/v1/completions", NULL, body, false) < 0)
            break;
    if (opened < N) {
        printf("    open: %s\n", pd_last_error());
        close_all(cs, opened);
        w.bad = N;
        return w;
    }
    bool done = cl_conn_wait_all(cs, N, CL_MS(60000));
    for (int i = 0; i < N; i++) {
        char ra[16];
        if (cs[i].status == 200 && stream_complete(&cs[i], 400)) {
            w.admitted++;
            int overlap = 0;
            for (int j = 0; j < N; j++)
                overlap += cs[j].status == 200 && cs[j].t_first_ns <= cs[i].t_first_ns &&
                           cs[j].t_done_ns >= cs[i].t_first_ns;
            if (overlap > w.max_overlap) w.max_overlap = overlap;
        } else if (cs[i].status == 503) {
            char *b = cl_conn_body(&cs[i]);
            bool exact = b && strcmp(b, LIMIT_BODY) == 0 &&
                         cl_conn_header(&cs[i], "Retry-After", ra, sizeof ra) &&
                         strcmp(ra, "1") == 0;
            if (exact)
                w.rejected++;
            else {
                w.bad++;
                printf("    503 not as documented: %s\n", b ? b : "(no body)");
            }
            free(b);
        } else {
            w.bad++;
            printf("    stream %d: status %d\n", i, cs[i].status);
        }
    }
    if (!done) w.bad++;
    close_all(cs, N);
    return w;
}

/* ---- item 2: overload ------------------------------------------------------------------------ */

TEST(overload_4x_limit)
{
    FIXTURE();
    enum { WARM = 3, WAVES = 6 };
    ASSERT_EQ_INT(cl_http(g_port, "GET", "/health", NULL, 5000, NULL, NULL), 200);
    long rss0 = cl_rss_kb(g_sched.pid), rss_warm = 0, rss_end = 0;
    wave_result w[WARM + WAVES];
    for (int k = 0; k < WARM + WAVES; k++) {
        w[k] = overload_wave();
        long rss = cl_rss_kb(g_sched.pid);
        if (k == WARM - 1) rss_warm = rss;
        if (k == WARM + WAVES - 1) rss_end = rss;
        printf("    wave %d: %d admitted (at most %d streaming at once), %d rejected with 503, "
               "%d bad; scheduler VmRSS %ld KiB\n",
               k + 1, w[k].admitted, w[k].max_overlap, w[k].rejected, w[k].bad, rss);
    }
    printf("    scheduler VmRSS %ld KiB before, %ld KiB after %d warm-up waves, %ld KiB after %d "
           "more\n",
           rss0, rss_warm, WARM, rss_end, WAVES);
    for (int k = 0; k < WARM + WAVES; k++) {
        ASSERT_EQ_INT(w[k].bad, 0);
        ASSERT_EQ_INT(w[k].admitted + w[k].rejected, 4 * LIMIT);
        ASSERT_MSG(w[k].admitted >= LIMIT, "wave %d: only %d admitted", k + 1, w[k].admitted);
        ASSERT_MSG(w[k].rejected >= LIMIT, "wave %d: only %d rejected", k + 1, w[k].rejected);
        ASSERT_MSG(w[k].max_overlap <= LIMIT, "wave %d: %d streams at once", k + 1,
                   w[k].max_overlap);
    }
    /* bounded: once warm, more waves of the same load do not grow the scheduler */
    ASSERT_MSG(!RSS_CHECKS || rss_end - rss_warm < RSS_SLACK_KB,
               "VmRSS grew by %ld KiB over %d waves", rss_end - rss_warm, WAVES);
    ASSERT(decode_idle(5000));
}

/* Reserves every free KV block of the decode instance (what a burst of long prompts would hold);
 * returns how many reservations were made, ids "hog-<i>". */
static int hog_kv(int max)
{
    static const int sizes[] = {1008, 256, 64, 16};
    int n = 0;
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        int tokens = sizes[k];
        for (; n < max; n++) {
            char id[32];
            snprintf(id, sizeof id, "hog-%d", n);
            Pd__ReserveRequest q = PD__RESERVE_REQUEST__INIT;
            q.request_id = id;
            q.num_prompt_tokens = tokens;
            q.ttl_ms = 60000;
            int st;
            ProtobufCMessage *m = cl_call(cl_node(&g_c, D0), "/pd.PD/Reserve", &q.base,
                                          &pd__reserve_reply__descriptor, 5000, &st);
            if (!m) break;
            protobuf_c_message_free_unpacked(m, NULL);
        }
    }
    return n;
}

static void unhog_kv(int n)
{
    for (int i = 0; i < n; i++) {
        char id[32];
        snprintf(id, sizeof id, "hog-%d", i);
        Pd__AbortRequest q = PD__ABORT_REQUEST__INIT;
        q.request_id = id;
        int st;
        ProtobufCMessage *m = cl_call(cl_node(&g_c, D0), "/pd.PD/Abort", &q.base,
                                      &pd__abort_reply__descriptor, 5000, &st);
        if (m) protobuf_c_message_free_unpacked(m, NULL);
    }
}

/* Lines of a log file that contain needle (0 when it cannot be read). */
static int log_count(const char *path, const char *needle)
{
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char line[4096];
    int n = 0;
    while (fgets(line, sizeof line, f))
        if (strstr(line, needle)) n++;
    fclose(f);
    return n;
}

TEST(overload_queue_timeout)
{
    FIXTURE();
    ASSERT(decode_idle(5000));
    int hogs = hog_kv(256);
    /* the refusals of the hog and of the queued requests' retries (every 10 ms) */
    int refused_before = log_count(g_c.procs[D0].log, "Reserve refused");
    Pd__StatsReply *s = cl_stats(&g_c, D0);
    int64_t free_blocks = s ? s->kv_blocks_free : -1;
    if (s) pd__stats_reply__free_unpacked(s, NULL);
    printf("    %d reservations hold the decode instance's KV (%lld blocks free)\n", hogs,
           (long long)free_blocks);
    /* (a) no KV for --queue-timeout (1 s): the documented 503 */
    const char *body = "{\"prompt\":\"Queued request\",\"max_tokens\":8,\"ignore_eos\":true}";
    cl_conn a;
    int rc = cl_conn_open(&a, g_port, "POST", "/v1/completions", NULL, body, false);
    bool a_done = rc == 0 && cl_conn_wait_all(&a, 1, CL_MS(10000));
    double a_s = secs(a.t_open_ns, a.t_done_ns);
    char *a_body = rc == 0 ? cl_conn_body(&a) : NULL;
    char ra[16] = "";
    if (rc == 0) cl_conn_header(&a, "Retry-After", ra, sizeof ra);
    int a_status = a.status;
    if (rc == 0) cl_conn_close(&a);
    /* (b) KV frees up 0.4 s after the request came: it waits, then is served */
    cl_conn b;
    int rb = cl_conn_open(&b, g_port, "POST", "/v1/completions", NULL, body, false);
    if (rb == 0) cl_conn_poll(&b, 1, 400, 0);
    int b_early = b.status;
    unhog_kv(hogs);
    bool b_done = rb == 0 && cl_conn_wait_all(&b, 1, CL_MS(10000));
    double b_s = secs(b.t_open_ns, b.t_done_ns);
    int b_status = b.status;
    if (rb == 0) cl_conn_close(&b);
    int refused = log_count(g_c.procs[D0].log, "Reserve refused") - refused_before;
    printf("    queue timeout: %d after %.3f s (Retry-After %s); KV freed after 0.4 s: %d after "
           "%.3f s; %d \"Reserve refused\" lines in the decode log meanwhile\n",
           a_status, a_s, ra, b_status, b_s, refused);
    ASSERT_MSG(free_blocks == 0, "%lld KV blocks still free", (long long)free_blocks);
    ASSERT_MSG(a_done, "the queued request got no answer within 10 s");
    ASSERT_EQ_INT(a_status, 503);
    ASSERT_STR_EQ(a_body, "{\"error\":{\"message\":\"Timed out after 1 s waiting for capacity.\","
                          "\"type\":\"ServiceUnavailableError\",\"param\":null,\"code\":503}}");
    free(a_body);
    ASSERT_STR_EQ(ra, "5");
    ASSERT_MSG(a_s >= 0.9 && a_s < CL_SEC(3.0), "timed out after %.3f s, not ~1 s", a_s);
    ASSERT_MSG(b_early == 0, "the request was answered (%d) while it should wait", b_early);
    ASSERT_MSG(b_done, "the request did not end after the KV was freed");
    ASSERT_EQ_INT(b_status, 200);
    ASSERT(decode_idle(5000));
    /* ~1.4 s of retries every 10 ms: about 140 refusals, logged once a second (2 or 3 lines, a
     * fourth should the waits stretch); before the rate limit, one line each */
    ASSERT_MSG(refused >= 1 && refused <= 4, "%d \"Reserve refused\" lines", refused);
}

/* ---- item 3: slow and hostile clients -------------------------------------------------------- */

/* Sends the bytes of s one at a time every gap_ms until the server answers or closes; returns
 * seconds from open to the server's close (or -1 after limit_ms). */
static double trickle(cl_conn *c, const char *s, int gap_ms, int limit_ms)
{
    int64_t deadline = c->t_open_ns + (int64_t)CL_MS(limit_ms) * PD_NS_PER_MS;
    for (size_t i = 0; s[i] && c->fd >= 0 && pd_now_ns() < deadline; i++) {
        if (send(c->fd, s + i, 1, MSG_NOSIGNAL) != 1) break;
        cl_conn_poll(c, 1, gap_ms, 0);
    }
    while (c->fd >= 0 && pd_now_ns() < deadline) cl_conn_poll(c, 1, 50, 0);
    return c->fd < 0 ? secs(c->t_open_ns, c->t_done_ns) : -1;
}

TEST(clients_slowloris)
{
    FIXTURE();
    int fd0 = settle_fds(0, 0);
    /* connected, nothing sent: closed after the header timeout (1 s) with 408 */
    cl_conn idle;
    ASSERT_OK(cl_conn_open_raw(&idle, g_port, "", 0));
    double t_idle = trickle(&idle, "", 100, 5000);
    int st_idle = idle.status;
    cl_conn_close(&idle);
    /* headers trickled one byte every 100 ms: 408 once the header timeout passes */
    cl_conn hdr;
    const char *line = "POST /v1/completions HTTP/1.1\r\n";
    ASSERT_OK(cl_conn_open_raw(&hdr, g_port, line, strlen(line)));
    double t_hdr = trickle(&hdr,
                           "Host: 127.0.0.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
                           "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n",
                           100, 5000);
    char *hdr_body = cl_conn_body(&hdr);
    int st_hdr = hdr.status;
    cl_conn_close(&hdr);
    /* headers complete, body trickled: 408 once the body timeout passes */
    cl_conn body;
    const char *head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                       "Content-Type: application/json\r\nContent-Length: 200\r\n\r\n{";
    ASSERT_OK(cl_conn_open_raw(&body, g_port, head, strlen(head)));
    double t_body = trickle(&body,
                            "\"prompt\":\"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
                            "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
                            100, 5000);
    int st_body = body.status;
    cl_conn_close(&body);
    /* keep-alive: a request is answered, then the idle connection is closed after 1 s */
    cl_conn ka;
    ASSERT_OK(cl_conn_open(&ka, g_port, "GET", "/health", NULL, NULL, true));
    int64_t t_answer = 0;
    int64_t deadline = pd_now_ns() + 5 * PD_NS_PER_S;
    while (ka.fd >= 0 && pd_now_ns() < deadline) {
        cl_conn_poll(&ka, 1, 50, 0);
        if (!t_answer && ka.status) t_answer = pd_now_ns();
    }
    double t_ka = ka.fd < 0 && t_answer ? secs(t_answer, ka.t_done_ns) : -1;
    int st_ka = ka.status;
    cl_conn_close(&ka);
    /* 200 slowloris connections at once: all closed, no descriptor left */
    enum { M = 200 };
    static cl_conn many[M];
    const char *partial = "GET /health HTTP/1.1\r\nHost: x\r\n";
    int opened = 0;
    for (; opened < M; opened++)
        if (cl_conn_open_raw(&many[opened], g_port, partial, strlen(partial)) < 0) break;
    int fd_peak = cl_fd_count(g_sched.pid); /* once the scheduler has accepted them all */
    for (int64_t until = pd_now_ns() + 900 * PD_NS_PER_MS;
         fd_peak < fd0 + opened && pd_now_ns() < until; fd_peak = cl_fd_count(g_sched.pid))
        pd_sleep_ns(10 * PD_NS_PER_MS);
    bool all_closed = cl_conn_wait_all(many, (size_t)opened, CL_MS(5000));
    int n408 = 0;
    for (int i = 0; i < opened; i++) n408 += many[i].status == 408;
    close_all(many, opened);
    int fd1 = settle_fds(fd0, 3000);
    printf("    closed after: idle %.3f s (%d), trickled headers %.3f s (%d), trickled body %.3f s "
           "(%d), idle keep-alive %.3f s (%d); %d slowloris connections: %d got 408; scheduler "
           "fds %d before, %d at the peak, %d after\n",
           t_idle, st_idle, t_hdr, st_hdr, t_body, st_body, t_ka, st_ka, opened, n408, fd0, fd_peak,
           fd1);
    ASSERT_MSG(t_idle >= 0.9 && t_idle < CL_SEC(3.0), "idle connection closed after %.3f s",
               t_idle);
    ASSERT_EQ_INT(st_idle, 408);
    ASSERT_MSG(t_hdr >= 0.9 && t_hdr < CL_SEC(3.0), "trickled headers closed after %.3f s", t_hdr);
    ASSERT_EQ_INT(st_hdr, 408);
    ASSERT_STR_EQ(hdr_body, "{\"error\":{\"message\":\"Request timed out.\",\"type\":"
                            "\"RequestTimeoutError\",\"param\":null,\"code\":408}}");
    free(hdr_body);
    ASSERT_MSG(t_body >= 0.9 && t_body < CL_SEC(3.0), "trickled body closed after %.3f s", t_body);
    ASSERT_EQ_INT(st_body, 408);
    ASSERT_EQ_INT(st_ka, 200);
    ASSERT_MSG(t_ka >= 0.9 && t_ka < CL_SEC(3.0), "idle keep-alive closed after %.3f s", t_ka);
    ASSERT_EQ_INT(opened, M);
    ASSERT(all_closed);
    ASSERT_EQ_INT(n408, M);
    ASSERT_MSG(fd_peak >= fd0 + M, "the connections were not open at once (%d fds)", fd_peak);
    ASSERT_EQ_INT(fd1, fd0);
}

/* What one slow SSE reader saw. */
typedef struct {
    bool done, complete;
    size_t read_slow, unread; /* bytes read while trickling, then at full speed */
    double fast_s;            /* seconds to read the rest at full speed */
    long rss0, rss_peak;      /* scheduler VmRSS (KiB) before and at most while stalled */
    double unsent_peak;       /* most pd:stream_unsent_bytes seen while stalled */
    long d_rss0, d_rss_peak;  /* the decode instance's */
} slow_reader_result;

/* One chat stream with `choices` choices of 900 tokens and 20 top logprobs each (about 1.6 MB
 * of SSE per choice) read at 1 KiB per 100 ms for 3 s, then at full speed. */
static slow_reader_result slow_reader(const cl_proc *sched, int port, int choices)
{
    enum { TOKENS = 900 };
    slow_reader_result o = {0};
    o.rss0 = o.rss_peak = cl_rss_kb(sched->pid);
    o.d_rss0 = o.d_rss_peak = cl_rss_kb(g_c.procs[D0].pid);
    char body[512];
    snprintf(body, sizeof body,
             "{\"messages\":[{\"role\":\"user\",\"content\":\"Slow reader\"}],"
             "\"max_tokens\":%d,\"n\":%d,\"ignore_eos\":true,\"logprobs\":true,"
             "\"top_logprobs\":20,\"stream\":true,\"stream_options\":{\"include_usage\":true}}",
             TOKENS, choices);
    cl_conn c;
    if (cl_conn_open(&c, port, "POST", "/v1/chat/completions", NULL, body, false) < 0) {
        printf("    %s\n", pd_last_error());
        return o;
    }
    /* generation is long over after 3 s: what the client has not read sits somewhere */
    int64_t until = pd_now_ns() + 3 * PD_NS_PER_S;
    while (pd_now_ns() < until) {
        pd_sleep_ns(100 * PD_NS_PER_MS);
        cl_conn_poll(&c, 1, 0, 1024);
        long r = cl_rss_kb(sched->pid), d = cl_rss_kb(g_c.procs[D0].pid);
        if (r > o.rss_peak) o.rss_peak = r;
        if (d > o.d_rss_peak) o.d_rss_peak = d;
        char *m = NULL;
        if (cl_http(port, "GET", "/metrics", NULL, 5000, &m, NULL) == 200) {
            double u = cl_metric(m, "pd:stream_unsent_bytes{model_name=\"tiny\"} ", -1);
            if (u > o.unsent_peak) o.unsent_peak = u;
        }
        free(m);
    }
    o.read_slow = c.len;
    int64_t t_fast = pd_now_ns();
    o.done = cl_conn_wait_all(&c, 1, CL_MS(60000));
    o.fast_s = secs(t_fast, pd_now_ns());
    o.unread = c.len - o.read_slow;
    o.complete = c.status == 200 && stream_complete(&c, TOKENS * choices);
    cl_conn_close(&c);
    printf("    slow SSE reader, n=%d: %zu bytes read in 3 s, then %zu bytes in %.3f s; scheduler "
           "held at most %.0f unsent bytes (pd:stream_unsent_bytes), VmRSS %ld KiB before, %ld "
           "KiB at most while stalled (+%ld KiB); decode VmRSS %ld -> %ld KiB (+%ld KiB)\n",
           choices, o.read_slow, o.unread, o.fast_s, o.unsent_peak, o.rss0, o.rss_peak,
           o.rss_peak - o.rss0, o.d_rss0, o.d_rss_peak, o.d_rss_peak - o.d_rss0);
    return o;
}

/* A client that reads its SSE stream slowly loses nothing: everything arrives, in order and
 * complete, once it reads again, and the instances are left with nothing held. The events come
 * over the scheduler's relay stream, batched (12 choices decode together, so a batch carries
 * several), and the decode instance holds them while the client stalls (their credit is used
 * up and the scheduler grants no more until the client reads again). */
TEST(clients_slow_sse_reader)
{
    FIXTURE();
    ASSERT(decode_idle(5000));
    Pd__StatsReply *s0 = cl_stats(&g_c, D0);
    ASSERT(s0);
    slow_reader_result o = slow_reader(&g_sched, g_port, 12);
    Pd__StatsReply *s1 = cl_stats(&g_c, D0);
    int64_t events = s1 ? s1->relay_events - s0->relay_events : 0;
    int64_t batches = s1 ? s1->relay_batches - s0->relay_batches : 0;
    int64_t pauses = s1 ? s1->relay_pauses - s0->relay_pauses : 0;
    pd__stats_reply__free_unpacked(s0, NULL);
    if (s1) pd__stats_reply__free_unpacked(s1, NULL);
    printf("    relay: %lld events in %lld batches, %lld pauses\n", (long long)events,
           (long long)batches, (long long)pauses);
    ASSERT(o.done);
    ASSERT(o.complete);
    ASSERT_MSG(o.unread > 8u * 1024 * 1024, "only %zu bytes were left unread", o.unread);
    ASSERT(decode_idle(10000));
    ASSERT_MSG(events >= 12 * 899, "%lld events came over the relay, 12 x 899 expected",
               (long long)events);
    ASSERT_MSG(batches > 0 && batches * 4 <= events, "%lld events in %lld relay batches",
               (long long)events, (long long)batches);
    ASSERT_MSG(pauses >= 1, "the decode instance never held a relayed request's events");
}

/* A chat request with 6 choices of 900 tokens and 20 top logprobs each, read at full speed:
 * the status; *body (malloc'd) the response. */
static int big_chat(int port, bool stream, char **body)
{
    char req[512];
    snprintf(req, sizeof req,
             "{\"messages\":[{\"role\":\"user\",\"content\":\"Big\"}],\"max_tokens\":900,"
             "\"n\":6,\"ignore_eos\":true,\"logprobs\":true,\"top_logprobs\":20,\"stream\":%s}",
             stream ? "true" : "false");
    return cl_http(port, "POST", "/v1/chat/completions", req, 60000, body, NULL);
}

/* The scheduler holds a bounded amount for a slow reader, whatever the output size: the HTTP
 * layer's 1 MiB (one write past it when nothing was pending) and 256 KiB of stream bytes before
 * it stops granting the decode instance relay credit, plus what that credit lets through: 96 KiB
 * of packed events per request, ~8x that in SSE with 20 top logprobs (~800 KiB). About 2.1 MiB
 * at worst, 2.5 MiB allowed for ~9.5 MB of output, as its pd:stream_unsent_bytes gauge shows
 * while the client stalls. VmRSS is reported, not bounded: it also moves with the allocator (a
 * burst of freed messages is not always handed back).
 * Regressions: the whole output was buffered (+12 to +17 MB of VmRSS) while gRPC's BDP probing
 * let each paused stream's HTTP/2 window grow to megabytes (common/rpc/rpc.c turns it off); and
 * 3.5 MB were held when the relay's only brake was a Pause call racing the decode steps. */
TEST(clients_slow_sse_bounded)
{
    FIXTURE();
    ASSERT(decode_idle(5000));
    /* a fresh scheduler per try: heap that an earlier request freed would hide the growth */
    double worst = 0;
    for (int k = 0; k < 3; k++) {
        cl_proc sp;
        int port;
        char name[32];
        snprintf(name, sizeof name, "scheduler_slow%d", k);
        ASSERT_OK(cl_sched_start(&g_c, &sp, name, NULL, &port));
        /* warm, as a long-running scheduler is: one big stream read at full speed first */
        char *warm = NULL;
        int wst = big_chat(port, true, &warm);
        free(warm);
        if (wst != 200) cl_stop(&sp, 10000);
        ASSERT_EQ_INT(wst, 200);
        slow_reader_result o = slow_reader(&sp, port, 6);
        int st = cl_stop(&sp, 10000);
        ASSERT(o.done && o.complete);
        ASSERT_EQ_INT(st, 0);
        if (o.unsent_peak > worst) worst = o.unsent_peak;
        ASSERT(decode_idle(10000));
    }
    ASSERT_MSG(worst > 0, "pd:stream_unsent_bytes never showed the stalled stream");
    ASSERT_MSG(worst < 2.5 * 1024 * 1024,
               "the scheduler held %.0f unsent bytes for one slow reader", worst);
}

/* A non-streaming response has no client to wait for: the scheduler grants relay credit as it
 * takes the events, so a response many times the credit (6 x 900 tokens with 20 top logprobs,
 * ~1.1 MB of packed events) completes. */
TEST(relay_credit_non_streaming)
{
    FIXTURE();
    ASSERT(decode_idle(5000));
    char *body = NULL;
    int st = big_chat(g_port, false, &body);
    json_error_t jerr;
    json_t *j = st == 200 && body ? json_loads(body, JSON_ALLOW_NUL, &jerr) : NULL;
    if (!j) printf("    %s: %.200s\n", body ? jerr.text : "no body", body ? body : "");
    json_t *ch = json_object_get(j, "choices");
    size_t full = 0;
    for (size_t i = 0; i < json_array_size(ch); i++) {
        json_t *lp = json_object_get(json_object_get(json_array_get(ch, i), "logprobs"), "content");
        full += json_array_size(lp) == 900;
    }
    json_t *ct = json_object_get(json_object_get(j, "usage"), "completion_tokens");
    printf("    status %d, %zu of 6 choices with 900 logprobs entries, completion_tokens %lld\n",
           st, full, (long long)json_integer_value(ct));
    int64_t tokens = json_integer_value(ct);
    json_decref(j);
    free(body);
    ASSERT_EQ_INT(st, 200);
    ASSERT_EQ_INT((int)full, 6);
    ASSERT_EQ_INT((int)tokens, 5400);
    ASSERT(decode_idle(10000));
}

/* Opens and drops `rounds` x 100 connections (after 2 warm-up rounds), one in `stream_every`
 * a streaming completion dropped ~50 ms after it was sent (0: none), the others dropped right
 * after connect, with partial headers, with a partial body, or after two pipelined GETs without
 * reading. Checks that nothing is left behind: the scheduler's descriptors, its VmRSS, KV on the
 * decode instance, and that it still serves. */
static void churn(int rounds, int stream_every)
{
    enum { PER_ROUND = 100 };
    const char *stream_body = "{\"prompt\":\"Churn\",\"max_tokens\":200,\"ignore_eos\":true,"
                              "\"stream\":true}";
    char stream_req[512];
    snprintf(stream_req, sizeof stream_req,
             "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             "Content-Length: %zu\r\n\r\n%s",
             strlen(stream_body), stream_body);
    const char *reqs[5] = {
        "",                                                  /* connect, close */
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConte", /* partial headers */
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: 100\r\n\r\n{\"prompt\":", /* partial body */
        "GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
        stream_req, /* a stream, dropped at whatever stage it reached */
    };
    int fd_base = 0;
    long rss_base = 0, rss_mid = 0;
    int n_conns = 0, n_streams = 0;
    static cl_conn cs[PER_ROUND];
    for (int round = 0; round < rounds + 2; round++) {
        int opened = 0;
        for (int i = 0; i < PER_ROUND; i++) {
            int kind = stream_every && i % stream_every == 0 ? 4 : i % 4;
            if (cl_conn_open_raw(&cs[i], g_port, reqs[kind], strlen(reqs[kind])) < 0) break;
            opened++;
            if (round >= 2) n_streams += kind == 4;
        }
        /* let the scheduler see every request (and start the streams), then drop everything */
        cl_conn_poll(cs, (size_t)opened, 50, 0);
        close_all(cs, opened);
        if (round >= 2) n_conns += opened;
        if (opened < PER_ROUND) ASSERT_MSG(0, "round %d: %s", round, pd_last_error());
        if (round == 1) { /* two warm-up rounds: allocator arenas, thread pools */
            ASSERT(decode_idle(10000));
            fd_base = settle_fds(0, 0);
            pd_sleep_ns(200 * PD_NS_PER_MS);
            fd_base = cl_fd_count(g_sched.pid);
            rss_base = cl_rss_kb(g_sched.pid);
        }
        if (round == rounds / 2 + 1) rss_mid = cl_rss_kb(g_sched.pid);
    }
    int fd_after = settle_fds(fd_base, 5000);
    bool idle = decode_idle(10000);
    long rss_after = cl_rss_kb(g_sched.pid);
    printf("    %d connections opened and dropped (%d of them streams): scheduler fds %d -> %d, "
           "VmRSS %ld KiB -> %ld KiB (half-way %ld KiB)\n",
           n_conns, n_streams, fd_base, fd_after, rss_base, rss_after, rss_mid);
    ASSERT_EQ_INT(fd_after, fd_base);
    ASSERT(idle);
    /* A leak grows with the connections, so the second half of the rounds shows it as well as the
     * first; the allocator's own growth (thread arenas, fragmentation) comes in steps and levels
     * off (runs here: +0.3 to +8 MiB in all, at most +1.7 MiB in the second half) */
    ASSERT_MSG(!RSS_CHECKS || rss_after - rss_mid < 2 * RSS_SLACK_KB,
               "VmRSS grew by %ld KiB in the second half of the rounds", rss_after - rss_mid);
    ASSERT_MSG(!RSS_CHECKS || rss_after - rss_base < 8 * RSS_SLACK_KB, "VmRSS grew by %ld KiB",
               rss_after - rss_base);
    /* still serving */
    ASSERT_EQ_INT(cl_http(g_port, "POST", "/v1/completions",
                          "{\"prompt\":\"After\",\"max_tokens\":4,\"ignore_eos\":true}", 30000,
                          NULL, NULL),
                  200);
}

/* Thousands of connections opened and dropped before or after a response: nothing leaks. */
TEST(clients_connection_churn)
{
    FIXTURE();
    churn(50, 0);
}

/* Streaming requests dropped at every stage (parsing, Reserve, Prefill, mid-stream) among the
 * churn.
 * Regression: when a chunk write found the client gone, the connection was closed inside the
 * write and its abort ended the exchange (r->ex = NULL); flush_out then called
 * pd_http_stream_end(NULL) and pd-scheduler died with SIGSEGV, leaving the KV reservations of
 * its requests on the decode instance. */
TEST(clients_stream_drop_churn)
{
    FIXTURE();
    churn(100, 25);
}

/* ---- issue 29 item 3: a prefill backlog alone ------------------------------------------------ */

/* A second scheduler on the same cluster with a short --prefill-timeout: a burst of long prompts
 * is more prefill work than the instance finishes within it. The backlog waits in the admission
 * queue (the prefill instance gets what it finishes within its horizon), so every request
 * completes; none gets 500 (before: DEADLINE_EXCEEDED for those at the back of the queue). */
/* A completion body whose prompt is n token ids, distinct for each k (no prefix cache hit). */
static void backlog_body(char *buf, size_t cap, int k, int n)
{
    size_t len = (size_t)snprintf(buf, cap, "{\"prompt\":[");
    for (int t = 0; t < n; t++)
        len += (size_t)snprintf(buf + len, cap - len, "%s%d", t ? "," : "",
                                3 + (k * 131 + t * 7) % 200);
    snprintf(buf + len, cap - len, "],\"max_tokens\":2,\"ignore_eos\":true}");
}

TEST(overload_prefill_backlog)
{
    FIXTURE();
    enum { N = 24, PROMPT = 1000 };
    static char body[PROMPT * 5 + 64];
    /* the deadline: 3 times what one such request takes alone here (the fastest of three, so
       that one slow moment of a loaded machine does not stretch it; at least 0.3 s), so that
       one prefill always fits it, and the burst (24 of them) does not */
    double one = 0;
    for (int k = 0; k < 3; k++) {
        backlog_body(body, sizeof body, N + k, PROMPT);
        int64_t t1 = pd_now_ns();
        ASSERT_EQ_INT(cl_http(g_port, "POST", "/v1/completions", body, 60000, NULL, NULL), 200);
        double t = secs(t1, pd_now_ns());
        if (k == 0 || t < one) one = t;
    }
    double deadline = 3 * one < 0.3 ? 0.3 : 3 * one;
    char dl[32];
    snprintf(dl, sizeof dl, "%.3f", deadline);
    cl_proc sp;
    int port = 0;
    char *args[] = {"--prefill-timeout", dl, "--queue-timeout", "120", NULL};
    ASSERT_MSG(cl_sched_start(&g_c, &sp, "sched_backlog", args, &port) == 0, "%s", pd_last_error());
    cl_conn cs[N];
    int opened = 0, ok = 0, s500 = 0, other = 0;
    for (; opened < N; opened++) {
        backlog_body(body, sizeof body, opened, PROMPT);
        if (cl_conn_open(&cs[opened], port, "POST", "/v1/completions", NULL, body, false) < 0)
            break;
    }
    int64_t t0 = pd_now_ns();
    bool done = opened == N && cl_conn_wait_all(cs, (size_t)opened, CL_MS(120000));
    double last = 0;
    for (int i = 0; i < opened; i++) {
        if (cs[i].status == 200)
            ok++;
        else if (cs[i].status == 500)
            s500++;
        else
            other++;
        if (cs[i].status != 200) {
            char *b = cl_conn_body(&cs[i]);
            printf("    request %d: %d %s\n", i, cs[i].status, b ? b : "");
            free(b);
        }
        if (cs[i].t_done_ns && secs(t0, cs[i].t_done_ns) > last) last = secs(t0, cs[i].t_done_ns);
    }
    printf("    one prompt of %d tokens alone: %.3f s; %d at once, --prefill-timeout %s: %d x 200, "
           "%d x 500, %d other; the last answered after %.2f s\n",
           PROMPT, one, opened, dl, ok, s500, other, last);
    close_all(cs, opened);
    int st = cl_stop(&sp, 10000);
    if (st != 0 || ok != N) cl_dump_log(&sp, 20);
    ASSERT_EQ_INT(opened, N);
    ASSERT(done);
    ASSERT_EQ_INT(s500, 0);
    ASSERT_EQ_INT(ok, N);
    /* the test means something only if the burst took longer than one deadline */
    ASSERT_MSG(last > 2 * deadline, "the burst took %.2f s: not a backlog", last);
    ASSERT_EQ_INT(st, 0);
    ASSERT(decode_idle(5000));
}

/* ---- issue 29 item 4: huge prompts ----------------------------------------------------------- */

/* 24 chat requests of 15.7 MB of prompt text sent at once to a fresh scheduler with default
 * flags, and a small chat request sent behind them: tokenization stops once a prompt cannot fit,
 * so the big ones get 400 (or 503 for the bytes in flight) quickly; the small one does not wait
 * behind them; the scheduler's peak stays under 300 MB and it gives the memory back after. */
TEST(overload_huge_prompts)
{
    FIXTURE();
    enum { N = 24, TEXT = 15700000 };
    cl_proc sp;
    int port = 0;
    ASSERT_MSG(cl_sched_start(&g_c, &sp, "sched_huge", NULL, &port) == 0, "%s", pd_last_error());
    long rss0 = cl_rss_kb(sp.pid);
    static const char head[] = "{\"messages\":[{\"role\":\"user\",\"content\":\"";
    static const char tail[] = "\"}],\"max_tokens\":4}";
    static const char words[] = "All work and no play makes Jack a dull boy. ";
    char *body = malloc(sizeof head + TEXT + sizeof tail);
    ASSERT(body != NULL);
    size_t len = sizeof head - 1;
    memcpy(body, head, len);
    for (size_t k = 0; k < TEXT; k++) body[len + k] = words[k % (sizeof words - 1)];
    len += TEXT;
    memcpy(body + len, tail, sizeof tail); /* with its NUL */
    cl_conn cs[N + 1];
    int opened = 0;
    for (; opened < N; opened++)
        if (cl_conn_open(&cs[opened], port, "POST", "/v1/chat/completions", NULL, body, false) < 0)
            break;
    free(body);
    bool small_ok =
        opened == N && cl_conn_open(&cs[N], port, "POST", "/v1/chat/completions", NULL,
                                    "{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],"
                                    "\"max_tokens\":4}",
                                    false) == 0;
    int n = small_ok ? N + 1 : opened;
    bool done = cl_conn_wait_all(cs, (size_t)n, CL_MS(120000));
    int s400 = 0, s503 = 0, other = 0;
    double last = 0;
    for (int i = 0; i < opened; i++) {
        s400 += cs[i].status == 400;
        s503 += cs[i].status == 503;
        if (cs[i].status != 400 && cs[i].status != 503) {
            other++;
            printf("    big request %d: status %d\n", i, cs[i].status);
        }
        if (cs[i].t_done_ns && secs(cs[i].t_open_ns, cs[i].t_done_ns) > last)
            last = secs(cs[i].t_open_ns, cs[i].t_done_ns);
    }
    char *b400 = NULL;
    for (int i = 0; i < opened && !b400; i++)
        if (cs[i].status == 400) b400 = cl_conn_body(&cs[i]);
    double small_s = small_ok && cs[N].t_done_ns ? secs(cs[N].t_open_ns, cs[N].t_done_ns) : -1;
    int small_status = small_ok ? cs[N].status : 0;
    close_all(cs, n);
    usleep(300 * 1000);
    long hwm = cl_status_kb(sp.pid, "VmHWM"), rss1 = cl_rss_kb(sp.pid);
    printf("    %d chat bodies of %d bytes of text at once: %d x 400, %d x 503, %d other, the "
           "slowest answered %.2f s after it was sent; the small request: %d after %.3f s\n",
           opened, TEXT, s400, s503, other, last, small_status, small_s);
    printf("    400: %s\n", b400 ? b400 : "(none)");
    printf("    scheduler VmRSS %ld KiB before, peak (VmHWM) %ld KiB, %ld KiB after\n", rss0, hwm,
           rss1);
    int st = cl_stop(&sp, 10000);
    if (st != 0) cl_dump_log(&sp, 20);
    ASSERT_EQ_INT(opened, N);
    ASSERT(done);
    ASSERT_EQ_INT(other, 0);
    ASSERT_MSG(b400 && strstr(b400, "maximum context length is 1024 tokens"), "400: %s",
               b400 ? b400 : "(none)");
    free(b400);
    ASSERT_EQ_INT(small_status, 200);
    ASSERT_MSG(small_s < 1.0 * cl_time_scale(), "the small request took %.3f s", small_s);
    ASSERT_MSG(!RSS_CHECKS || hwm < 300 * 1024, "peak VmHWM %ld KiB", hwm);
    ASSERT_MSG(!RSS_CHECKS || rss1 - rss0 < 16 * 1024, "VmRSS %ld KiB after, %ld before", rss1,
               rss0);
    ASSERT_EQ_INT(st, 0);
}

TEST(zz_shutdown)
{
    if (!g_ready) SKIP("no cluster");
    int s = cl_stop(&g_sched, 10000);
    if (s != 0) cl_dump_log(&g_sched, 30);
    int bad = cl_stop_all(&g_c);
    g_ready = false;
    ASSERT_EQ_INT(s, 0);
    ASSERT_EQ_INT(bad, 0);
}
