/* pd-scheduler at its limits: --max-concurrent-requests, the prefix cache hits it reports
 * (--enable-prompt-tokens-details), the admission queue that waits for decode KV capacity; then
 * the decode instance lost (it breaks the cluster) and sched_zz_shutdown, so this file is
 * linked last and its tests register last. */
#define _GNU_SOURCE
#include "scheduler_common.h"

#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

TEST(sched_concurrency_limit)
{
    FIXTURE();
    const char *auth = "Authorization: Bearer sk-test\r\n";
    int fd = open_long_stream(g_port_key, auth);
    ASSERT(fd >= 0);
    http_resp r;
    ASSERT(http_do(g_port_key, "POST", "/v1/completions", auth,
                   "{\"prompt\":\"a\",\"max_tokens\":2}", &r) == 0);
    close(fd);
    ASSERT_EQ_INT(r.status, 503);
    char h[64];
    ASSERT_STR_EQ(header(&r, "Retry-After", h, sizeof h), "1");
    ASSERT_STR_EQ(r.body, "{\"error\":{\"message\":\"The server is at its limit of 1 concurrent "
                          "requests; retry later.\",\"type\":\"ServiceUnavailableError\","
                          "\"param\":null,\"code\":503}}");
    resp_free(&r);
    /* once the first request is gone (client closed), the next one is served */
    int64_t deadline = pd_now_ns() + (int64_t)(CL_SEC(10.0) * PD_NS_PER_S);
    int st = 0;
    while (pd_now_ns() < deadline) {
        ASSERT(http_do(g_port_key, "POST", "/v1/completions", auth,
                       "{\"prompt\":\"a\",\"max_tokens\":2}", &r) == 0);
        st = r.status;
        resp_free(&r);
        if (st == 200) break;
        pd_sleep_ns(50 * PD_NS_PER_MS);
    }
    ASSERT_EQ_INT(st, 200);
}

/* --enable-prompt-tokens-details: the usage tells the prompt tokens the prefill instance found
 * in its prefix cache (vLLM's field), in a response body and in a stream's usage chunk; without
 * the flag it stays null. A 40-token prompt, sent again, finds its 2 full 16-token blocks. */
TEST(sched_prompt_tokens_details_cached)
{
    FIXTURE();
    char *extra[] = {"--enable-prompt-tokens-details", NULL};
    cl_proc sp;
    int port = 0;
    ASSERT_MSG(start_scheduler(&sp, &port, "scheduler_details", extra, "1") == 0,
               "pd-scheduler with --enable-prompt-tokens-details did not start");
    char body[1024], stream[1100];
    size_t o = (size_t)snprintf(body, sizeof body, "{\"prompt\":[");
    for (int i = 0; i < 40; i++)
        o += (size_t)snprintf(body + o, sizeof body - o, "%s%d", i ? "," : "", 700 + 3 * i);
    snprintf(body + o, sizeof body - o, "],\"max_tokens\":2,\"ignore_eos\":true");
    snprintf(stream, sizeof stream, "%s,\"stream\":true,\"stream_options\":{}}", body);
    strcat(body, "}");
    http_resp r[4];
    int got = 0;
    got += http_do(port, "POST", "/v1/completions", NULL, body, &r[0]) == 0;
    got += http_do(port, "POST", "/v1/completions", NULL, body, &r[1]) == 0;
    got += http_do(port, "POST", "/v1/completions", NULL, stream, &r[2]) == 0;
    got += http_do(g_port, "POST", "/v1/completions", NULL, body, &r[3]) == 0;
    int stopped = cl_stop(&sp, 10000);
    ASSERT_EQ_INT(got, 4);
    for (int i = 0; i < 4; i++) ASSERT_EQ_INT(r[i].status, 200);
    /* the first may find what earlier tests left; the second finds at least this one's */
    ASSERT_CONTAINS(r[1].body, "\"prompt_tokens_details\":{\"cached_tokens\":32}");
    ASSERT_CONTAINS(r[2].body, "\"usage\":{\"prompt_tokens\":40,\"total_tokens\":42,"
                               "\"completion_tokens\":2,\"prompt_tokens_details\":"
                               "{\"cached_tokens\":32}}");
    ASSERT_CONTAINS(r[3].body, "\"prompt_tokens_details\":null"); /* the flag is off there */
    for (int i = 0; i < 4; i++) resp_free(&r[i]);
    ASSERT_EQ_INT(stopped, 0);
}

/* ---- admission: requests wait for decode KV capacity ---------------------------------------- */

typedef struct {
    int port;
    const char *body;
    int status;
    char retry_after[16];
    char message[160];
} adm_call;

static void *adm_thread(void *arg)
{
    adm_call *a = arg;
    http_resp r;
    a->status = -1;
    if (http_do(a->port, "POST", "/v1/completions", NULL, a->body, &r) != 0) return NULL;
    a->status = r.status;
    header(&r, "Retry-After", a->retry_after, sizeof a->retry_after);
    json_t *j = json_loads(r.body, 0, NULL);
    const char *m = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
    snprintf(a->message, sizeof a->message, "%s", m ? m : "");
    json_decref(j);
    resp_free(&r);
    return NULL;
}

/* Runs n copies of body at once; counts 200s and the 503s whose message is want_503. */
static int adm_burst(int port, const char *body, int n, const char *want_503, int *ok, int *timed)
{
    adm_call calls[16];
    pthread_t th[16];
    *ok = *timed = 0;
    for (int i = 0; i < n; i++) {
        calls[i] = (adm_call){.port = port, .body = body};
        pthread_create(&th[i], NULL, adm_thread, &calls[i]);
    }
    int other = 0;
    for (int i = 0; i < n; i++) {
        pthread_join(th[i], NULL);
        if (calls[i].status == 200) {
            (*ok)++;
        } else if (calls[i].status == 503 && want_503 && strcmp(calls[i].message, want_503) == 0 &&
                   strcmp(calls[i].retry_after, "5") == 0) {
            (*timed)++;
        } else {
            printf("    request %d: HTTP %d Retry-After '%s': %s\n", i, calls[i].status,
                   calls[i].retry_after, calls[i].message);
            other++;
        }
    }
    return other;
}

/* A decode instance with room for one request's KV at a time: concurrent requests wait in the
 * scheduler's admission queue instead of failing, and --queue-timeout ends a wait with 503. */
TEST(sched_admission_queue)
{
    FIXTURE();
    /* tiny: 2 KiB of KV per token, 16-token blocks -> 16 blocks = 256 tokens per rank; every
     * request sends the same prompt, which prefix caching would prefill in no time, draining
     * the queue faster than the timeouts this case needs */
    char *node_args[] = {"--kv-cache-bytes",           "524288", "--max-model-len", "256",
                         "--no-enable-prefix-caching", NULL};
    cl_cluster c2;
    ASSERT_OK(cl_start(&c2, g_model, "0", "1", node_args));
    cl_proc sp, sq;
    int port = 0, port_q = 0;
    char *patient[] = {"--max-model-len", "256", NULL};
    char *hasty[] = {"--max-model-len", "256", "--queue-timeout", "0.05", NULL};
    if (start_scheduler_on(&c2, &sp, &port, "scheduler_admit", patient, "1") < 0 ||
        start_scheduler_on(&c2, &sq, &port_q, "scheduler_admit_q", hasty, "1") < 0) {
        cl_stop(&sp, 5000);
        cl_stop_all(&c2);
        ASSERT_MSG(0, "schedulers on the small-KV cluster did not start");
    }
    /* 200 prompt tokens (13 blocks): only one request's prompt fits at a time */
    char body[2048];
    size_t at = (size_t)snprintf(body, sizeof body, "{\"prompt\":[");
    for (int i = 0; i < 200; i++)
        at += (size_t)snprintf(body + at, sizeof body - at, "%s%d", i ? "," : "", 10 + i % 90);
    snprintf(body + at, sizeof body - at, "],\"max_tokens\":24,\"ignore_eos\":true}");
    int ok = 0, timed = 0;
    int bad = adm_burst(port, body, 8, NULL, &ok, &timed);
    int ok_q = 0, timed_q = 0;
    int bad_q = adm_burst(port_q, body, 16, "Timed out after 0.05 s waiting for capacity.", &ok_q,
                          &timed_q);
    http_resp r;
    bool got = http_do(port, "GET", "/metrics", NULL, NULL, &r) == 0;
    int a = cl_stop(&sp, 10000), b = cl_stop(&sq, 10000);
    int nodes = cl_stop_all(&c2);
    ASSERT(got);
    printf("    patient: %d ok; queue-timeout 0.05 s: %d ok, %d timed out\n", ok, ok_q, timed_q);
    ASSERT_EQ_INT(bad, 0);
    ASSERT_EQ_INT(ok, 8); /* every request waited its turn and completed */
    ASSERT_EQ_INT(bad_q, 0);
    ASSERT(ok_q >= 1);
    ASSERT(timed_q >= 1);
    /* the queue time is measured */
    ASSERT_CONTAINS(r.body,
                    "vllm:request_queue_time_seconds_count{model_name=\"tiny\",engine=\"0\"} 8.0");
    resp_free(&r);
    ASSERT_EQ_INT(a, 0);
    ASSERT_EQ_INT(b, 0);
    ASSERT_EQ_INT(nodes, 0);
}

TEST(sched_y_decode_lost)
{
    FIXTURE();
    /* a stream is running when the decode instance hangs: the heartbeat takes it out of the
     * routing set and the client gets the in-band error and [DONE] */
    int fd = open_long_stream(g_port, NULL);
    ASSERT(fd >= 0);
    cl_signal(&g_c.procs[1], SIGSTOP);
    char buf[1 << 16];
    size_t n = 0;
    int64_t deadline = pd_now_ns() + (int64_t)(CL_SEC(20.0) * PD_NS_PER_S);
    while (n < sizeof buf - 1 && pd_now_ns() < deadline) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        if (poll(&pfd, 1, 200) != 1) continue;
        ssize_t k = read(fd, buf + n, sizeof buf - 1 - n);
        if (k <= 0) break;
        n += (size_t)k;
        buf[n] = '\0';
        if (strstr(buf, "data: [DONE]")) break;
    }
    buf[n] = '\0';
    close(fd);
    ASSERT_CONTAINS(buf, "data: {\"error\":{\"message\":\"Generation failed: the decode instance "
                         "stopped responding.\",\"type\":\"InternalServerError\",\"param\":null,"
                         "\"code\":500}}\n\n");
    ASSERT_CONTAINS(buf, "data: [DONE]\n\n");
    cl_signal(&g_c.procs[1], SIGKILL);
    http_resp r;
    ASSERT(http_do(g_port, "GET", "/health", NULL, NULL, &r) == 0);
    ASSERT_EQ_INT(r.status, 503);
    ASSERT_EQ_INT(r.body_len, 0);
    resp_free(&r);
    ASSERT(http_do(g_port, "POST", "/v1/completions", NULL, "{\"prompt\":\"a\"}", &r) == 0);
    ASSERT_EQ_INT(r.status, 503);
    char h[64];
    ASSERT_STR_EQ(header(&r, "Retry-After", h, sizeof h), "5");
    ASSERT_CONTAINS(r.body, "\"message\":\"No healthy decode instance is available.\"");
    resp_free(&r);
    ASSERT(http_do(g_port, "GET", "/metrics", NULL, NULL, &r) == 0);
    ASSERT_CONTAINS(r.body, "pd:instance_up{role=\"decode\",instance=\"127.0.0.1:");
    char want[128];
    snprintf(want, sizeof want, "pd:instance_up{role=\"decode\",instance=\"127.0.0.1:%d\"} 0.0",
             g_c.ports[1]);
    ASSERT_CONTAINS(r.body, want);
    resp_free(&r);
}

TEST(sched_zz_shutdown)
{
    if (!g_ready) SKIP("no cluster");
    int a = cl_stop(&g_sched, 10000);
    int b = cl_stop(&g_sched_key, 10000);
    int l = cl_stop(&g_sched_legacy, 10000);
    if (l != 0) cl_dump_log(&g_sched_legacy, 30);
    if (a != 0) cl_dump_log(&g_sched, 30);
    if (b != 0) cl_dump_log(&g_sched_key, 30);
    int bad = cl_stop_all(&g_c); /* the decode instance was killed: pid 0, not counted */
    g_ready = false;
    ASSERT_EQ_INT(a, 0);
    ASSERT_EQ_INT(b, 0);
    ASSERT_EQ_INT(l, 0);
    ASSERT_EQ_INT(bad, 0);
}
