/* Golden tests that take the cluster apart, so they run last: §18.19 (a client that disconnects
 * frees every instance) and §18.18 (the only prefill instance dies before the first token),
 * then zz_shutdown, which stops every cluster the tests started (this file is linked last so
 * that it registers last). */
#define _GNU_SOURCE
#include "golden.h"

#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>

/* True when node k holds nothing for any request (no running, waiting, held sequences or
 * leases, every KV block free); polls up to timeout_ms. */
static bool node_idle(int k, int timeout_ms)
{
    int64_t deadline = pd_now_ns() + (int64_t)timeout_ms * PD_NS_PER_MS;
    for (;;) {
        Pd__StatsReply *s = cl_stats(&g_c, k);
        bool idle = s && s->num_running == 0 && s->num_waiting == 0 && s->num_held == 0 &&
                    s->leases_held == 0 && s->kv_blocks_free == s->kv_blocks_total;
        if (s) pd__stats_reply__free_unpacked(s, NULL);
        if (idle) return true;
        if (pd_now_ns() > deadline) return false;
        pd_sleep_ns(100 * PD_NS_PER_MS);
    }
}

/* §18.19: a client that disconnects mid-stream frees the KV on every instance (prefill and
 * decode), and request_success_total{finished_reason="abort"} goes up by exactly 1. Also with
 * n = 3 on a 40-token prompt, whose followers wait for the leader when the client leaves. */
TEST(golden_19_disconnect_frees_every_instance)
{
    FIXTURE();
    const char *key = "vllm:request_success_total{model_name=\"tiny\",engine=\"0\","
                      "finished_reason=\"abort\"} ";
    char n3[1024];
    prompt40_body(n3, sizeof n3, 302,
                  "\"n\":3,\"max_tokens\":20,\"ignore_eos\":true,\"stream\":true");
    const char *bodies[] = {"{\"prompt\":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20],"
                            "\"max_tokens\":40,\"ignore_eos\":true,\"stream\":true}",
                            n3};
    for (int b = 0; b < 2; b++) {
        char *m = get_metrics(g_port_metrics);
        ASSERT(m);
        double before = cl_metric(m, key, -1);
        free(m);
        ASSERT(before >= 0);
        cl_conn c;
        ASSERT(cl_conn_open(&c, g_port_metrics, "POST", "/v1/completions", NULL, bodies[b], true) ==
               0);
        int64_t deadline = pd_now_ns() + 30 * PD_NS_PER_S;
        while (!strstr(c.buf ? c.buf : "", "data: ") && !c.eof && pd_now_ns() < deadline)
            cl_conn_poll(&c, 1, 100, 0);
        bool streaming = c.buf && strstr(c.buf, "data: ") && !strstr(c.buf, "[DONE]");
        cl_conn_close(&c);
        ASSERT_MSG(streaming, "request %d: the stream did not start (or ended before the hang-up)",
                   b);
        double after = before;
        deadline = pd_now_ns() + 10 * PD_NS_PER_S;
        while (after == before && pd_now_ns() < deadline) {
            pd_sleep_ns(100 * PD_NS_PER_MS);
            m = get_metrics(g_port_metrics);
            after = m ? cl_metric(m, key, before) : before;
            free(m);
        }
        ASSERT_NEAR(after, before + 1, 1e-9);
        ASSERT_MSG(node_idle(0, 10000), "request %d: the prefill instance still holds state", b);
        ASSERT_MSG(node_idle(1, 10000), "request %d: the decode instance still holds state", b);
    }
}

/* §18.18: the only prefill instance dies before the first token of a stream: the client gets a
 * plain HTTP 500 or 503 with the §3 JSON body, not an SSE stream (§2). The instance is then
 * started again on its port and the cluster serves again. Runs last: it restarts a node. */
TEST(golden_18_single_prefill_killed_before_first_token)
{
    FIXTURE();
    cl_signal(&g_c.procs[0], SIGSTOP); /* hangs: the request cannot get its first token */
    cl_conn c;
    int rc = cl_conn_open(&c, g_port, "POST", "/v1/completions", NULL,
                          "{\"prompt\":[1,2,3],\"max_tokens\":4,\"stream\":true}", false);
    cl_conn_poll(&c, 1, 300, 0);
    cl_signal(&g_c.procs[0], SIGKILL);
    bool done = rc == 0 && cl_conn_wait_all(&c, 1, 30000);
    char *body = cl_conn_body(&c);
    char ct[128] = "";
    cl_conn_header(&c, "Content-Type", ct, sizeof ct);
    int st = c.status;
    cl_conn_close(&c);
    json_t *o = body ? json_loads(body, 0, NULL) : NULL;
    json_t *e = json_object_get(o, "error");
    const char *type = json_string_value(json_object_get(e, "type"));
    int64_t code = json_integer_value(json_object_get(e, "code"));
    bool typed = type && ((st == 500 && strcmp(type, "InternalServerError") == 0) ||
                          (st == 503 && strcmp(type, "ServiceUnavailableError") == 0));
    char got[512];
    snprintf(got, sizeof got, "%d %s", st, body ? body : "(no body)");
    json_decref(o);
    free(body);
    printf("    prefill lost before the first token: %s\n", got);
    /* start it again before any assertion, so the shutdown test finds a whole cluster */
    cl_proc *p = &g_c.procs[0];
    int wst;
    if (p->pid > 0 && waitpid(p->pid, &wst, 0) == p->pid) p->pid = 0;
    int restarted = cl_restart(&g_c, 0, 30000);
    int health = wait_status(g_port, "/health", 200, 30);
    ASSERT(done);
    ASSERT_MSG(st == 500 || st == 503, "status: %s", got);
    ASSERT_STR_EQ(ct, "application/json");
    ASSERT_MSG(typed && code == st, "error body: %s", got);
    ASSERT_EQ_INT(restarted, 0);
    ASSERT_EQ_INT(health, 200);
    /* served again once the scheduler has the restarted instance back in its routing set */
    int64_t deadline = pd_now_ns() + 30 * PD_NS_PER_S;
    int again = -1;
    while (again != 200 && pd_now_ns() < deadline) {
        again =
            cl_http(g_port, "POST", "/v1/completions",
                    "{\"prompt\":[1,2,3],\"max_tokens\":2,\"ignore_eos\":true}", 30000, NULL, NULL);
        if (again != 200) pd_sleep_ns(200 * PD_NS_PER_MS);
    }
    ASSERT_EQ_INT(again, 200);
}

TEST(zz_shutdown)
{
    bool any = g_ready;
    int bad = xclusters_stop(&any); /* the real-tokenizer and -inf clusters, where started */
    if (!any) SKIP("no cluster");
    if (g_ready) bad += fixture_stop();
    ASSERT_EQ_INT(bad, 0);
}
