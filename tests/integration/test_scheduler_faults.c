/* pd-scheduler when things go wrong: a client that disconnects (the abort is counted and the
 * instances are freed), a prefill instance that hangs (retried on another, on a 2P1D cluster
 * of its own), SIGTERM (the drain, on a cluster of its own), bad start-up configurations. */
#define _GNU_SOURCE
#include "scheduler_common.h"

#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

TEST(sched_client_disconnect_aborts)
{
    FIXTURE();
    http_resp r;
    ASSERT(http_do(g_port, "GET", "/metrics", NULL, NULL, &r) == 0);
    const char *key = "finished_reason=\"abort\"} ";
    const char *p = strstr(r.body, key);
    ASSERT(p);
    double before = atof(p + strlen(key));
    resp_free(&r);
    /* a long stream; the client reads the first event and hangs up */
    int fd = connect_port(g_port);
    ASSERT(fd >= 0);
    const char *body = "{\"prompt\":\"Once upon a time\",\"max_tokens\":400,\"ignore_eos\":true,"
                       "\"stream\":true}";
    char req[1024];
    int n =
        snprintf(req, sizeof req,
                 "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 "Content-Length: %zu\r\n\r\n%s",
                 strlen(body), body);
    ASSERT(write(fd, req, (size_t)n) == n);
    char buf[4096];
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    ASSERT(poll(&pfd, 1, 30000) == 1);
    ASSERT(read(fd, buf, sizeof buf) > 0);
    close(fd);
    /* the abort is counted and the instances are free again */
    double after = before;
    int64_t deadline = pd_now_ns() + (int64_t)(CL_SEC(10.0) * PD_NS_PER_S);
    while (after == before && pd_now_ns() < deadline) {
        pd_sleep_ns(100 * PD_NS_PER_MS);
        ASSERT(http_do(g_port, "GET", "/metrics", NULL, NULL, &r) == 0);
        p = strstr(r.body, key);
        after = p ? atof(p + strlen(key)) : before;
        resp_free(&r);
    }
    ASSERT_NEAR(after, before + 1, 0.01);
    /* the decode instance holds no sequence for it any more */
    deadline = pd_now_ns() + (int64_t)(CL_SEC(10.0) * PD_NS_PER_S);
    int64_t running = -1;
    while (pd_now_ns() < deadline) {
        Pd__StatsRequest q = PD__STATS_REQUEST__INIT;
        int st;
        Pd__StatsReply *s =
            (Pd__StatsReply *)cl_call(cl_node(&g_c, 1), "/pd.PD/Stats", &q.base,
                                      &pd__stats_reply__descriptor, CL_MS(2000), &st);
        ASSERT(s);
        running = s->num_running + s->num_held;
        bool all_free = s->kv_blocks_free == s->kv_blocks_total;
        pd__stats_reply__free_unpacked(s, NULL);
        if (running == 0 && all_free) break;
        pd_sleep_ns(100 * PD_NS_PER_MS);
    }
    ASSERT_EQ_INT(running, 0);
}

/* 2P1D: a prefill instance hangs; the request routed to it is cancelled when the heartbeat
 * takes it out and is retried on the other prefill instance. */
TEST(sched_prefill_retry)
{
    FIXTURE();
    cl_cluster c2;
    cl_proc sp;
    int port = 0;
    ASSERT(side_cluster(&c2, "0 1", "2", &sp, &port, "scheduler_2p1d", NULL));
    cl_signal(&c2.procs[0], SIGSTOP);
    int ok = 0;
    for (int i = 0; i < 3; i++) {
        http_resp r;
        if (http_do(port, "POST", "/v1/completions", NULL,
                    "{\"prompt\":\"Retry me\",\"max_tokens\":4,\"temperature\":0}", &r) == 0) {
            ok += r.status == 200;
            if (r.status != 200) printf("    status %d: %s\n", r.status, r.body);
            resp_free(&r);
        }
    }
    cl_signal(&c2.procs[0], SIGKILL);
    char cmd[800];
    snprintf(cmd, sizeof cmd, "grep -q 'retrying the prefill' '%s'", sp.log);
    int retried = system(cmd);
    int st = cl_stop(&sp, 10000);
    int bad = cl_stop_all(&c2);
    ASSERT_EQ_INT(ok, 3);
    ASSERT_EQ_INT(retried, 0);
    ASSERT_EQ_INT(st, 0);
    ASSERT_EQ_INT(bad, 0);
}

/* Reads fd until the peer closes it (or 10 s pass) into buf (NUL-terminated). */
static void read_to_close(int fd, char *buf, size_t cap)
{
    size_t at = 0;
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    int64_t end = pd_now_ns() + 10 * PD_NS_PER_S;
    while (at + 1 < cap && pd_now_ns() < end && poll(&pfd, 1, 1000) >= 0) {
        ssize_t n = read(fd, buf + at, cap - 1 - at);
        if (n <= 0) break;
        at += (size_t)n;
    }
    buf[at] = '\0';
}

/* SIGTERM drains (§3, §11.5): /health and new requests get 503 while the listener stays open;
 * a stream in flight ends with its finish or the in-band 503, then [DONE]; a request still in
 * flight at --shutdown-timeout gets the 503; the process exits 0. */
TEST(sched_sigterm_drains)
{
    FIXTURE();
    cl_cluster c2;
    cl_proc sp;
    int port = 0;
    char *args[] = {"--shutdown-timeout", "1.5", NULL};
    ASSERT(side_cluster(&c2, "0", "1", &sp, &port, "scheduler_drain", args));
    int stream = open_long_stream(port, NULL);
    /* a request that cannot end before the deadline: its prefill instance is stopped */
    cl_signal(&c2.procs[0], SIGSTOP);
    int stuck = connect_port(port);
    static const char body[] = "{\"prompt\":\"Hi\",\"max_tokens\":4}";
    char stuck_req[256];
    int sl = snprintf(stuck_req, sizeof stuck_req,
                      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      "application/json\r\nContent-Length: %zu\r\n\r\n%s",
                      sizeof body - 1, body);
    bool sent = stuck >= 0 && write(stuck, stuck_req, (size_t)sl) == sl;
    usleep(200 * 1000);
    int64_t t_term = pd_now_ns();
    cl_signal(&sp, SIGTERM);
    usleep(100 * 1000);
    http_resp h, n;
    int hrc = http_do(port, "GET", "/health", NULL, NULL, &h);
    int nrc = http_do(port, "POST", "/v1/completions", NULL, "{\"prompt\":\"x\"}", &n);
    static char out[1 << 20];
    char stuck_out[4096];
    out[0] = stuck_out[0] = '\0';
    if (stream >= 0) read_to_close(stream, out, sizeof out);
    if (sent) read_to_close(stuck, stuck_out, sizeof stuck_out);
    cl_signal(&c2.procs[0], SIGCONT);
    int st = cl_wait(&sp, 10000);
    double took = (double)(pd_now_ns() - t_term) / 1e9;
    if (st != 0) cl_dump_log(&sp, 30);
    int bad = cl_stop_all(&c2);
    if (stream >= 0) close(stream);
    if (stuck >= 0) close(stuck);
    ASSERT(stream >= 0 && sent);
    ASSERT_EQ_INT(hrc, 0);
    ASSERT_EQ_INT(h.status, 503);
    resp_free(&h);
    ASSERT_EQ_INT(nrc, 0);
    ASSERT_EQ_INT(n.status, 503);
    char hv[64];
    ASSERT_STR_EQ(header(&n, "Retry-After", hv, sizeof hv), "5");
    ASSERT_CONTAINS(n.body, "\"message\":\"The server is shutting down.\"");
    resp_free(&n);
    size_t ol = strlen(out); /* chunked: [DONE], then the last chunk */
    ASSERT_MSG(strstr(out, "data: [DONE]\n\n") && ol > 5 && strcmp(out + ol - 5, "0\r\n\r\n") == 0,
               "stream: ...%s", out + (ol > 300 ? ol - 300 : 0));
    ASSERT_MSG(strstr(out, "\"finish_reason\":\"length\"") ||
                   strstr(out, "data: {\"error\":{\"message\":\"The server is shutting down.\","
                               "\"type\":\"ServiceUnavailableError\""),
               "stream: ...%s", out + (ol > 300 ? ol - 300 : 0));
    ASSERT_CONTAINS(stuck_out, "HTTP/1.1 503");
    ASSERT_CONTAINS(stuck_out, "Retry-After: 5");
    ASSERT_CONTAINS(stuck_out, "\"message\":\"The server is shutting down.\"");
    ASSERT_EQ_INT(st, 0);
    ASSERT_MSG(took > 1.4 && took < 6.0, "exit %.2f s after SIGTERM", took);
    ASSERT_EQ_INT(bad, 0);
}

/* Start-up errors name the problem; an instance whose identity does not match its ranktable
 * entry stays out of routing with a logged reason. */
TEST(sched_startup_checks)
{
    FIXTURE();
    char genv[700], penv[64], log[600], port_s[16];
    snprintf(genv, sizeof genv, "GLOBAL_RANK_TABLE_FILE_PATH=%s", g_c.global);
    snprintf(port_s, sizeof port_s, "%d", cl_free_port());
    char *argv[] = {(char *)cl_bin("scheduler/pd-scheduler"),
                    "--model",
                    g_model,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    port_s,
                    NULL};
    /* one port for two instances */
    snprintf(penv, sizeof penv, "NODE_PORTS=%d", g_c.ports[0]);
    snprintf(log, sizeof log, "%s/sched_badports.log", g_c.dir);
    char *env1[] = {genv, penv, NULL};
    cl_proc p;
    ASSERT(cl_spawn(&p, "badports", argv, env1, log) == 0);
    ASSERT_EQ_INT(cl_wait(&p, 20000), 1);
    char cmd[800];
    snprintf(cmd, sizeof cmd,
             "grep -q 'NODE_PORTS: 1 port(s) given but .* lists 1 prefill + 1 decode' '%s'", log);
    ASSERT_EQ_INT(system(cmd), 0);
    /* the ports swapped: each instance answers with the other role */
    snprintf(penv, sizeof penv, "NODE_PORTS=%d,%d", g_c.ports[1], g_c.ports[0]);
    snprintf(log, sizeof log, "%s/sched_swapped.log", g_c.dir);
    char *env2[] = {genv, penv, NULL};
    ASSERT(cl_spawn(&p, "swapped", argv, env2, log) == 0);
    int port = atoi(port_s);
    int64_t deadline = pd_now_ns() + (int64_t)(CL_SEC(20.0) * PD_NS_PER_S);
    int status = 0;
    while (pd_now_ns() < deadline) {
        http_resp r;
        if (http_do(port, "GET", "/health", NULL, NULL, &r) == 0) {
            status = r.status;
            resp_free(&r);
            snprintf(cmd, sizeof cmd,
                     "grep -q \"identity does not match the ranktable: answers as role 'decode', "
                     "the ranktable says 'prefill'\" '%s'",
                     log);
            if (system(cmd) == 0) break;
        }
        pd_sleep_ns(100 * PD_NS_PER_MS);
    }
    int st = cl_stop(&p, 10000);
    ASSERT_EQ_INT(status, 503);
    ASSERT_EQ_INT(system(cmd), 0);
    ASSERT_EQ_INT(st, 0);
}
