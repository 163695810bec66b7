/* bench_pd: PD-specific figures (not a test; results go to docs/benchmarks.md).
 *
 *   bench_pd kv [--tokens 2048] [--layers 12] [--kv-heads 4] [--head-dim 64] [--reps 5]
 *       KV transfer over TCP on loopback (kv_tcp.h) between two CPU-backend pools, for a prompt
 *       of --tokens tokens (defaults: the `medium` preset's KV shape), next to a raw TCP copy of
 *       the same number of bytes over loopback in the same run. Best and median of --reps.
 *   bench_pd ttft --model DIR [--prompt-len 512] [--reps 5] [--threads 1] [--device cpu|cuda]
 *                 [--kv-transport T]
 *       Time to first token of one prompt split (a real 1P1D cluster started like the
 *       integration tests, client-side Reserve + Prefill as pd-scheduler sends them; the Info
 *       call before them, which pd-scheduler makes only in its heartbeat, is not timed) and
 *       colocated (an in-process engine: add -> first token), both with --threads CPU threads
 *       per process, or both on GPU 0 with --device cuda (each with a quarter of its memory;
 *       --kv-transport picks the nodes' transport). Each repetition is printed (repetition 0 is
 *       the first request of a fresh process), then the medians.
 *   bench_pd sched --model DIR [--prompt-len 64] [--reps 100] [--streams 32] [--tokens 512]
 *       pd-scheduler's cost: time to first token of a streaming completions request through
 *       pd-scheduler against the same request sent to the nodes directly (Reserve + Prefill),
 *       in alternating pairs; then --streams concurrent streams of --tokens tokens and the
 *       scheduler's CPU time (utime + stime) per streamed token.
 */
#define _XOPEN_SOURCE 700
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "cluster.h"
#include "engine/engine.h"
#include "transfer/kv_tcp.h"
#include "harness.h" /* pdt_tmp_dir, provided below: this program has its own main */
#include "util/clock.h"
#include "util/status.h"

/* cluster.c keeps its files under the test harness's temporary directory. */
static char g_tmp[256];
const char *pdt_tmp_dir(void)
{
    if (!g_tmp[0]) {
        snprintf(g_tmp, sizeof g_tmp, "/tmp/bench_pd.XXXXXX");
        if (!mkdtemp(g_tmp)) abort();
    }
    return g_tmp;
}

static long arg_long(int argc, char **argv, const char *name, long def)
{
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], name) == 0) return strtol(argv[i + 1], NULL, 10);
    return def;
}

static const char *arg_str(int argc, char **argv, const char *name)
{
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], name) == 0) return argv[i + 1];
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* ---- KV transfer vs raw TCP ----------------------------------------------------------------- */

typedef struct {
    int fd;
    size_t bytes;
} sink_arg;

static void *raw_sink(void *p)
{
    sink_arg *a = p;
    char *buf = malloc(1 << 20);
    size_t got = 0;
    while (got < a->bytes) {
        ssize_t r = read(a->fd, buf, 1 << 20);
        if (r <= 0) break;
        got += (size_t)r;
    }
    ssize_t w = write(a->fd, "k", 1); /* the "acknowledgement" */
    (void)w;
    free(buf);
    return NULL;
}

/* Seconds to push bytes through a loopback TCP connection and get one byte back. */
static double raw_tcp_copy(size_t bytes)
{
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t al = sizeof a;
    bind(ls, (struct sockaddr *)&a, sizeof a);
    getsockname(ls, (struct sockaddr *)&a, &al);
    listen(ls, 1);
    int c = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1, buf = 4 << 20;
    setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(c, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
    connect(c, (struct sockaddr *)&a, sizeof a);
    int s = accept(ls, NULL, NULL);
    setsockopt(s, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
    sink_arg sa = {.fd = s, .bytes = bytes};
    pthread_t t;
    pthread_create(&t, NULL, raw_sink, &sa);
    char *data = malloc(bytes);
    memset(data, 7, bytes);
    double t0 = pd_now_s();
    size_t off = 0;
    while (off < bytes) {
        ssize_t w = write(c, data + off, bytes - off);
        if (w <= 0) break;
        off += (size_t)w;
    }
    char k;
    ssize_t r = read(c, &k, 1);
    (void)r;
    double dt = pd_now_s() - t0;
    pthread_join(t, NULL);
    free(data);
    close(c);
    close(s);
    close(ls);
    return dt;
}

static void on_done(void *arg, const char *id, int status)
{
    (void)id, (void)status;
    __atomic_add_fetch((int *)arg, 1, __ATOMIC_SEQ_CST);
}

static int bench_kv(int argc, char **argv)
{
    size_t tokens = (size_t)arg_long(argc, argv, "--tokens", 2048);
    pd_kv_params kp = {.n_layers = (int)arg_long(argc, argv, "--layers", 12),
                       .block_size = 16,
                       .n_kv_heads = (size_t)arg_long(argc, argv, "--kv-heads", 4),
                       .head_dim = (size_t)arg_long(argc, argv, "--head-dim", 64),
                       .dtype = PD_DTYPE_F32};
    int reps = (int)arg_long(argc, argv, "--reps", 5);
    if (reps < 1 || reps > 100000 || tokens == 0) {
        fprintf(stderr, "usage: bench_pd kv [--tokens N>=1] [--layers N] [--kv-heads N] "
                        "[--head-dim N] [--reps 1..100000]\n");
        return 2;
    }
    size_t n_blocks = (tokens + kp.block_size - 1) / kp.block_size;
    kp.n_blocks = n_blocks + 8;
    pd_backend_params bp = pd_backend_default_params();
    bp.n_threads = 1;
    pd_backend *bs, *bd;
    pd_kv *ks, *kd;
    if (pd_backend_cpu_create(&bp, &bs) < 0 || pd_backend_cpu_create(&bp, &bd) < 0 ||
        pd_backend_get_ops(bs)->kv_create(bs, &kp, &ks) < 0 ||
        pd_backend_get_ops(bd)->kv_create(bd, &kp, &kd) < 0) {
        fprintf(stderr, "bench_pd: %s\n", pd_last_error());
        return 1;
    }
    int32_t *blocks = malloc(n_blocks * sizeof *blocks);
    for (size_t i = 0; i < n_blocks; i++) blocks[i] = (int32_t)i;
    int done = 0;
    pd_kv_rx_params rp = {.host = "127.0.0.1", .backend = bd, .kv = kd, .kv_params = kp};
    pd_kv_tcp_receiver *rx;
    pd_kv_tcp_sender *tx;
    if (pd_kv_tcp_receiver_start(&rp, on_done, &done, &rx) < 0 ||
        pd_kv_tcp_sender_create(&tx) < 0) {
        fprintf(stderr, "bench_pd: %s\n", pd_last_error());
        return 1;
    }
    size_t bytes =
        2 * n_blocks * kp.block_size * kp.n_kv_heads * kp.head_dim * 4 * (size_t)kp.n_layers;
    double best_raw = 1e30, *kv_s = malloc((size_t)reps * sizeof *kv_s);
    for (int r = 0; r < reps; r++) {
        char id[32];
        snprintf(id, sizeof id, "bench-%d", r);
        pd_kv_rx_expect(rx, id, blocks, n_blocks, 0);
        pd_kv_send_req q = {.request_id = id,
                            .host = "127.0.0.1",
                            .port = pd_kv_tcp_receiver_port(rx),
                            .backend = bs,
                            .kv = ks,
                            .kv_params = kp,
                            .block_ids = blocks,
                            .n_blocks = n_blocks,
                            .head0 = 0,
                            .n_heads = kp.n_kv_heads,
                            .timeout_ms = 60000};
        pd_kv_send_stats st;
        if (pd_kv_tcp_send(tx, &q, &st) < 0) {
            fprintf(stderr, "bench_pd: %s\n", pd_last_error());
            return 1;
        }
        double raw = raw_tcp_copy(bytes);
        printf("  rep %d: kv transfer %.2f GB/s (%llu bytes, %llu frames in %llu writes, %.3f ms); "
               "raw tcp copy %.2f GB/s (%.3f ms)\n",
               r, st.bytes / st.seconds / 1e9, (unsigned long long)st.bytes,
               (unsigned long long)st.frames, (unsigned long long)st.writes, st.seconds * 1e3,
               bytes / raw / 1e9, raw * 1e3);
        kv_s[r] = st.seconds;
        if (raw < best_raw) best_raw = raw;
    }
    qsort(kv_s, (size_t)reps, sizeof *kv_s, cmp_double);
    double best_kv = kv_s[0];
    printf("kv transfer of %zu tokens (%d layers x %zu kv heads x %zu, f32; %.1f MiB): best %.2f "
           "GB/s (%.3f ms), median %.3f ms; raw TCP copy of the same bytes: best %.2f GB/s; ratio "
           "%.1f%%\n",
           tokens, kp.n_layers, kp.n_kv_heads, kp.head_dim, bytes / 1048576.0,
           bytes / best_kv / 1e9, best_kv * 1e3, kv_s[reps / 2] * 1e3, bytes / best_raw / 1e9,
           100.0 * best_raw / best_kv);
    free(kv_s);
    pd_kv_tcp_sender_free(tx);
    pd_kv_tcp_receiver_stop(rx);
    pd_backend_get_ops(bs)->kv_free(bs, ks);
    pd_backend_get_ops(bd)->kv_free(bd, kd);
    pd_backend_free(bs);
    pd_backend_free(bd);
    free(blocks);
    return 0;
}

/* ---- TTFT split vs colocated ------------------------------------------------------------------
 */

static int bench_ttft(int argc, char **argv)
{
    const char *model = arg_str(argc, argv, "--model");
    size_t len = (size_t)arg_long(argc, argv, "--prompt-len", 512);
    int reps = (int)arg_long(argc, argv, "--reps", 5);
    int threads = (int)arg_long(argc, argv, "--threads", 1);
    const char *device = arg_str(argc, argv, "--device"),
               *xport = arg_str(argc, argv, "--kv-transport");
    bool cuda = device && strcmp(device, "cuda") == 0;
    if (!model || reps < 1 || reps > 64 || threads < 1 || threads > 4096 ||
        (device && !cuda && strcmp(device, "cpu") != 0)) {
        fprintf(stderr, "usage: bench_pd ttft --model DIR [--prompt-len N] [--reps N<=64] "
                        "[--threads N] [--device cpu|cuda] [--kv-transport T]\n");
        return 2;
    }
    int32_t *prompt = malloc(len * sizeof *prompt);
    double split[64], colo[64], split_prefill[64], split_kv[64];
    Pd__SamplingParams sp = PD__SAMPLING_PARAMS__INIT;
    /* two tokens: the KV moves to the decode side before the first token is answered */
    sp.n = 1, sp.top_p = 1, sp.repetition_penalty = 1, sp.logprobs = -1, sp.max_tokens = 2;
    sp.skip_special_tokens = true, sp.has_seed = true;

    /* colocated: one engine in this process, --threads threads */
    pd_engine_params ep = pd_engine_default_params();
    ep.model_dir = model;
    ep.n_threads = threads;
    /* one KV budget for both arms, above what a max_model_len sequence takes (1b preset: 46 MB
       for 2048 tokens in bf16; medium: 50 MB in f32); the nodes' replaces the cluster's 32 MiB */
    ep.kv_cache_bytes = cuda ? (size_t)1 << 30 : (size_t)256 << 20;
    char kvb[32], nthr[16];
    snprintf(kvb, sizeof kvb, "%zu", ep.kv_cache_bytes);
    snprintf(nthr, sizeof nthr, "%d", threads);
    ep.max_model_len = len + 64 > 2048 ? len + 64 : 2048;
    if (cuda) { /* GPU 0, bf16 */
        ep.n_cuda_devices = 1;
        ep.cuda_devices[0] = 0;
    }
    pd_engine *e;
    if (pd_engine_create(&ep, &e) < 0) {
        fprintf(stderr, "bench_pd: %s\n", pd_last_error());
        return 1;
    }
    pd_sampling_params gp = pd_sampling_default_params();
    gp.temperature = 0, gp.max_tokens = 1, gp.has_seed = true;
    for (int r = 0; r < reps; r++) {
        for (size_t i = 0; i < len; i++) prompt[i] = (int32_t)(40 + (i * 7 + (size_t)r) % 200);
        char id[32];
        snprintf(id, sizeof id, "colo-%d", r);
        pd_engine_request q = {.request_id = id,
                               .prompt_ids = prompt,
                               .n_prompt = len,
                               .sampling = &gp,
                               .phase = PD_PHASE_FULL};
        double t0 = pd_now_s();
        if (pd_engine_add(e, &q) < 0) {
            fprintf(stderr, "bench_pd: %s\n", pd_last_error());
            pd_engine_free(e);
            free(prompt);
            return 1;
        }
        bool first = false;
        while (!first) {
            bool did;
            if (pd_engine_step(e, &did) < 0 && !did) break;
            const pd_engine_event *ev;
            while (pd_engine_next_event(e, &ev) == 1) {
                if (ev->n_tokens && !first) {
                    first = true;
                    colo[r] = pd_now_s() - t0;
                }
                pd_engine_event_done(e);
            }
        }
        while (pd_engine_has_work(e)) { /* let it finish */
            bool did;
            pd_engine_step(e, &did);
            const pd_engine_event *ev;
            while (pd_engine_next_event(e, &ev) == 1) pd_engine_event_done(e);
        }
    }
    pd_engine_free(e);

    /* split: a 1P1D cluster on loopback (on GPU 0 both, with --device cuda) */
    cl_cluster c;
    char mml[32];
    snprintf(mml, sizeof mml, "%zu", (size_t)ep.max_model_len);
    char *gpu_args[] = {"--device",
                        "cuda",
                        "--kv-cache-bytes",
                        kvb,
                        "--kv-transport",
                        (char *)(xport ? xport : "auto"),
                        "--max-model-len",
                        mml,
                        NULL};
    char *cpu_args[] = {"--kv-cache-bytes",
                        kvb,
                        "--cpu-threads",
                        nthr,
                        "--kv-transport",
                        (char *)(xport ? xport : "auto"),
                        "--max-model-len",
                        mml,
                        NULL};
    if (cl_start(&c, model, "0", "1", cuda ? gpu_args : cpu_args) < 0) {
        fprintf(stderr, "bench_pd: %s\n", pd_last_error());
        cl_stop_all(&c);
        return 1;
    }
    static cl_result res;
    for (int r = 0; r < reps; r++) {
        for (size_t i = 0; i < len; i++) prompt[i] = (int32_t)(40 + (i * 7 + (size_t)r) % 200);
        char id[32];
        snprintf(id, sizeof id, "split-%d", r);
        if (cl_generate(&c, 0, 1, id, prompt, len, &sp, &res) < 0) {
            fprintf(stderr, "bench_pd: %s\n", res.error);
            cl_stop_all(&c);
            return 1;
        }
        split[r] = res.t_first - res.t_start; /* Reserve + Prefill (KV transfer included) */
        split_prefill[r] = res.prefill_seconds;
        split_kv[r] = res.kv_seconds;
    }
    cl_stop_all(&c);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", pdt_tmp_dir());
    if (system(cmd) != 0) fprintf(stderr, "bench_pd: could not remove %s\n", pdt_tmp_dir());
    for (int r = 0; r < reps; r++)
        printf("  rep %d: colocated %.2f ms, split %.2f ms (prefill instance: prefill %.2f ms, "
               "KV transfer %.2f ms)\n",
               r, colo[r] * 1e3, split[r] * 1e3, split_prefill[r] * 1e3, split_kv[r] * 1e3);
    qsort(colo, (size_t)reps, sizeof(double), cmp_double);
    qsort(split, (size_t)reps, sizeof(double), cmp_double);
    double mc = colo[reps / 2], ms = split[reps / 2];
    char where[48];
    snprintf(where, sizeof where, "%d CPU thread(s) per process", threads);
    printf("ttft, %zu-token prompt, %s, KV transport %s: colocated median %.2f ms, split "
           "median %.2f ms, added by splitting %.2f ms (%.1f%%)\n",
           len, cuda ? "GPU 0 (bf16)" : where, xport ? xport : "auto", mc * 1e3, ms * 1e3,
           (ms - mc) * 1e3, 100.0 * (ms - mc) / mc);
    free(prompt);
    return 0;
}

/* ---- pd-scheduler: TTFT overhead and relay cost -------------------------------------------- */

/* utime + stime of pid in seconds (/proc/<pid>/stat fields 14 and 15). */
static double proc_cpu_s(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')'); /* the command name may hold spaces */
    unsigned long ut = 0, st = 0;
    if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st) != 2)
        return -1;
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

/* A streaming completions request whose prompt is the token ids given (no tokenizer work). */
static void ids_body(char *body, size_t cap, const int32_t *ids, size_t n, int max_tokens)
{
    size_t at = (size_t)snprintf(body, cap, "{\"model\":\"tiny\",\"prompt\":[");
    for (size_t i = 0; i < n && at < cap; i++)
        at += (size_t)snprintf(body + at, cap - at, "%s%d", i ? "," : "", ids[i]);
    snprintf(body + at, cap - at, "],\"max_tokens\":%d,\"ignore_eos\":true,\"stream\":true}",
             max_tokens);
}

static int bench_sched(int argc, char **argv)
{
    const char *model = arg_str(argc, argv, "--model");
    size_t len = (size_t)arg_long(argc, argv, "--prompt-len", 64);
    int reps = (int)arg_long(argc, argv, "--reps", 100);
    int streams = (int)arg_long(argc, argv, "--streams", 32);
    int tokens = (int)arg_long(argc, argv, "--tokens", 512);
    if (!model || reps < 1 || reps > 1000 || len < 1 || len > 900 || streams < 1 || streams > 256 ||
        tokens < 2 || tokens + (int)len > 1024) {
        fprintf(stderr, "usage: bench_pd sched --model DIR [--prompt-len N<=900] [--reps N<=1000] "
                        "[--streams N<=256] [--tokens N] (prompt-len + tokens <= 1024)\n");
        return 2;
    }
    cl_cluster c;
    cl_proc sp;
    int port = 0;
    /* each pair sends one prompt twice (directly, then through pd-scheduler): without the
       prefix cache both compute it whole, so the difference is the scheduler's alone */
    char *node_args[] = {"--no-enable-prefix-caching", NULL};
    if (cl_start(&c, model, "0", "1", node_args) < 0 ||
        cl_sched_start(&c, &sp, "sched", NULL, &port) < 0) {
        fprintf(stderr, "bench_pd: %s\n", pd_last_error());
        cl_stop_all(&c);
        return 1;
    }
    int32_t *prompt = malloc(len * sizeof *prompt);
    size_t cap = len * 8 + 256;
    char *body = malloc(cap);
    double *direct = malloc((size_t)reps * sizeof(double));
    double *via = malloc((size_t)reps * sizeof(double));
    double *diff = malloc((size_t)reps * sizeof(double));
    static cl_result res;
    Pd__SamplingParams sp2 = PD__SAMPLING_PARAMS__INIT;
    sp2.n = 1, sp2.top_p = 1, sp2.repetition_penalty = 1, sp2.logprobs = -1, sp2.max_tokens = 2;
    sp2.skip_special_tokens = true, sp2.ignore_eos = true;
    int rc = 0;
    /* pairs: the same prompt length sent to the nodes directly (Reserve + Prefill, as the
     * scheduler does) and through pd-scheduler (HTTP, parse, route, relay), alternating */
    for (int r = -5; r < reps && rc == 0; r++) { /* 5 warm-up pairs */
        for (size_t i = 0; i < len; i++)
            prompt[i] = (int32_t)(40 + (i * 7 + (size_t)(r + 5)) % 200);
        char id[32];
        snprintf(id, sizeof id, "direct-%d", r + 5);
        if (cl_generate(&c, 0, 1, id, prompt, len, &sp2, &res) < 0) {
            fprintf(stderr, "bench_pd: direct: %s\n", res.error);
            rc = 1;
            break;
        }
        double d = res.t_first - res.t_start;
        ids_body(body, cap, prompt, len, 2);
        cl_conn k;
        if (cl_conn_open(&k, port, "POST", "/v1/completions", NULL, body, true) < 0) {
            fprintf(stderr, "bench_pd: %s\n", pd_last_error());
            rc = 1;
            break;
        }
        int64_t deadline = pd_now_ns() + 30 * PD_NS_PER_S;
        while (!k.t_first_ns && k.fd >= 0 && pd_now_ns() < deadline) cl_conn_poll(&k, 1, 100, 0);
        bool first = k.t_first_ns != 0;
        double v = first ? (double)(k.t_first_ns - k.t_open_ns) / 1e9 : 0;
        bool done = first && cl_conn_wait_all(&k, 1, 30000);
        bool ok = done && k.status == 200;
        cl_conn_close(&k);
        if (!ok) {
            fprintf(stderr, "bench_pd: a request through pd-scheduler failed\n");
            rc = 1;
            break;
        }
        if (r < 0) continue;
        direct[r] = d, via[r] = v, diff[r] = v - d;
    }
    /* relay: concurrent streams of `tokens` tokens each; the scheduler's CPU time per token */
    double cpu0 = proc_cpu_s(sp.pid), t0 = pd_now_s();
    cl_conn *ks = calloc((size_t)streams, sizeof *ks);
    for (int i = 0; i < streams && rc == 0; i++) {
        for (size_t j = 0; j < len; j++) prompt[j] = (int32_t)(40 + (j * 11 + (size_t)i) % 200);
        ids_body(body, cap, prompt, len, tokens);
        if (cl_conn_open(&ks[i], port, "POST", "/v1/completions", NULL, body, false) < 0) rc = 1;
    }
    Pd__StatsReply *st0 = cl_stats(&c, 1);
    bool all = rc == 0 && cl_conn_wait_all(ks, (size_t)streams, 300000);
    double cpu1 = proc_cpu_s(sp.pid), t1 = pd_now_s();
    Pd__StatsReply *st1 = cl_stats(&c, 1); /* the decode instance's relay counters */
    long rl_events = st0 && st1 ? (long)(st1->relay_events - st0->relay_events) : -1;
    long rl_batches = st0 && st1 ? (long)(st1->relay_batches - st0->relay_batches) : -1;
    long rl_pauses = st0 && st1 ? (long)(st1->relay_pauses - st0->relay_pauses) : -1;
    if (st0) pd__stats_reply__free_unpacked(st0, NULL);
    if (st1) pd__stats_reply__free_unpacked(st1, NULL);
    long chunks = 0;
    for (int i = 0; i < streams; i++) {
        for (const char *q = ks[i].buf; q && (q = strstr(q, "\"text\":")); q++) chunks++;
        cl_conn_close(&ks[i]);
    }
    free(ks);
    cl_stop(&sp, 10000);
    cl_stop_all(&c);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", pdt_tmp_dir());
    if (system(cmd) != 0) fprintf(stderr, "bench_pd: could not remove %s\n", pdt_tmp_dir());
    if (rc == 0 && all) {
        qsort(direct, (size_t)reps, sizeof(double), cmp_double);
        qsort(via, (size_t)reps, sizeof(double), cmp_double);
        qsort(diff, (size_t)reps, sizeof(double), cmp_double);
        int p90 = reps * 9 / 10;
        printf("ttft, %zu-token prompt, %d pairs: direct (Reserve + Prefill) p50 %.3f ms p90 %.3f "
               "ms; through pd-scheduler (HTTP) p50 %.3f ms p90 %.3f ms; overhead p50(via) - "
               "p50(direct) %.3f ms, median of paired differences %.3f ms\n",
               len, reps, direct[reps / 2] * 1e3, direct[p90] * 1e3, via[reps / 2] * 1e3,
               via[p90] * 1e3, (via[reps / 2] - direct[reps / 2]) * 1e3, diff[reps / 2] * 1e3);
        printf(
            "relay: %d streams x %d tokens = %ld token chunks in %.2f s; pd-scheduler CPU %.3f s "
            "= %.1f us per streamed token; the decode instance sent %ld events in %ld relay "
            "batches, %ld pauses\n",
            streams, tokens, chunks, t1 - t0, cpu1 - cpu0,
            chunks ? (cpu1 - cpu0) / (double)chunks * 1e6 : 0.0, rl_events, rl_batches, rl_pauses);
    } else if (rc == 0) {
        fprintf(stderr, "bench_pd: the relay streams did not finish\n");
        rc = 1;
    }
    free(prompt);
    free(body);
    free(direct);
    free(via);
    free(diff);
    return rc;
}

int main(int argc, char **argv)
{
    if (argc >= 2 && strcmp(argv[1], "sched") == 0) return bench_sched(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "kv") == 0) return bench_kv(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "ttft") == 0) return bench_ttft(argc, argv);
    fprintf(stderr,
            "usage: bench_pd kv [...] | bench_pd ttft --model DIR [...] | bench_pd sched ...\n");
    return 2;
}
