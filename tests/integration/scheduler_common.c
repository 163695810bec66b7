/* pd-scheduler integration tests' HTTP client and fixture (declared in scheduler_common.h): a
 * plain-socket client (one request per connection, chunked bodies decoded), and one 1P1D
 * cluster with three schedulers (main, API key with one concurrent request, USE_OPENAI=0),
 * started on first use and stopped by sched_zz_shutdown. */
#define _GNU_SOURCE
#include "scheduler_common.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---- a tiny HTTP client ------------------------------------------------------------------- */

void resp_free(http_resp *r)
{
    free(r->body);
    memset(r, 0, sizeof *r);
}

int connect_port(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

int http_raw(int port, const char *req, size_t len, bool half_close, int timeout_ms, http_resp *out)
{
    memset(out, 0, sizeof *out);
    int fd = connect_port(port);
    if (fd < 0) return -1;
    size_t off = 0;
    while (off < len) {
        ssize_t w = write(fd, req + off, len - off);
        if (w <= 0) break;
        off += (size_t)w;
    }
    if (half_close) shutdown(fd, SHUT_WR);
    size_t cap = 65536, n = 0;
    char *buf = malloc(cap);
    int64_t deadline = pd_now_ns() + (int64_t)timeout_ms * PD_NS_PER_MS;
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int left = (int)((deadline - pd_now_ns()) / PD_NS_PER_MS);
        if (left <= 0 || poll(&p, 1, left) <= 0) break;
        if (n + 4096 > cap) buf = realloc(buf, cap *= 2);
        ssize_t r = read(fd, buf + n, cap - n - 1);
        if (r <= 0) break;
        n += (size_t)r;
    }
    close(fd);
    buf[n] = '\0';
    char *hend = strstr(buf, "\r\n\r\n");
    if (!hend || sscanf(buf, "HTTP/1.1 %d", &out->status) != 1) {
        free(buf);
        return -1;
    }
    size_t hl = (size_t)(hend - buf);
    snprintf(out->headers, sizeof out->headers, "%.*s", (int)hl, buf);
    const char *b = hend + 4;
    size_t bl = n - hl - 4;
    out->body = malloc(bl + 1);
    if (strcasestr(out->headers, "transfer-encoding: chunked")) {
        size_t o = 0;
        const char *p = b;
        while (p < b + bl) {
            unsigned long sz = strtoul(p, NULL, 16);
            const char *nl = strstr(p, "\r\n");
            if (!nl || sz == 0) break;
            memcpy(out->body + o, nl + 2, sz);
            o += sz;
            p = nl + 2 + sz + 2;
        }
        out->body_len = o;
    } else {
        memcpy(out->body, b, bl);
        out->body_len = bl;
    }
    out->body[out->body_len] = '\0';
    free(buf);
    return 0;
}

int http_do(int port, const char *method, const char *path, const char *extra_headers,
            const char *body, http_resp *out)
{
    size_t bl = body ? strlen(body) : 0;
    size_t cap = bl + 1024 + (extra_headers ? strlen(extra_headers) : 0);
    char *req = malloc(cap);
    int n = snprintf(req, cap,
                     "%s %s HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n%s%s"
                     "Content-Length: %zu\r\n\r\n",
                     method, path, extra_headers ? extra_headers : "",
                     body && !(extra_headers && strcasestr(extra_headers, "content-type"))
                         ? "Content-Type: application/json\r\n"
                         : "",
                     bl);
    if (body) memcpy(req + n, body, bl);
    int rc = http_raw(port, req, (size_t)n + bl, false, 60000, out);
    free(req);
    return rc;
}

const char *header(const http_resp *r, const char *name, char *buf, size_t n)
{
    char key[128];
    snprintf(key, sizeof key, "\r\n%s:", name);
    const char *p = strcasestr(r->headers, key);
    if (!p) return NULL;
    p += strlen(key);
    while (*p == ' ') p++;
    size_t l = strcspn(p, "\r\n");
    snprintf(buf, n, "%.*s", (int)l, p);
    return buf;
}

/* ---- the fixture: one 1P1D cluster and three schedulers ---------------------------------- */

cl_cluster g_c;
cl_proc g_sched, g_sched_key, g_sched_legacy;
int g_port, g_port_key, g_port_legacy;
bool g_ready;
static bool g_failed;
char g_model[512];

static bool wait_health(cl_proc *p, int port, int timeout_s)
{
    int64_t deadline = pd_now_ns() + (int64_t)(CL_SEC((double)timeout_s) * PD_NS_PER_S);
    while (pd_now_ns() < deadline) {
        http_resp r;
        if (http_do(port, "GET", "/health", NULL, NULL, &r) == 0) {
            int st = r.status;
            resp_free(&r);
            if (st == 200) return true;
        }
        int status;
        if (p->pid > 0 && waitpid(p->pid, &status, WNOHANG) == p->pid) {
            p->pid = 0;
            return false;
        }
        pd_sleep_ns(100 * PD_NS_PER_MS);
    }
    return false;
}

int start_scheduler_on(cl_cluster *cl, cl_proc *p, int *port, const char *name, char *const extra[],
                       const char *use_openai)
{
    static char genv[700], penv[256], henv[700];
    snprintf(genv, sizeof genv, "GLOBAL_RANK_TABLE_FILE_PATH=%s", cl->global);
    size_t at = (size_t)snprintf(penv, sizeof penv, "NODE_PORTS=");
    for (int k = 0; k < cl->n_prefill + cl->n_decode; k++)
        at += (size_t)snprintf(penv + at, sizeof penv - at, "%s%d", k ? "," : "", cl->ports[k]);
    snprintf(henv, sizeof henv, "RANK_TABLE_FILE_PATH=%s/local_ranktable_127.0.0.1_host.json",
             cl->dir);
    char uenv[32];
    snprintf(uenv, sizeof uenv, "USE_OPENAI=%s", use_openai);
    char *env[] = {genv, penv, henv, "VLLM_API_KEY=", uenv, NULL};
    *port = cl_free_port();
    char port_s[16], log[600];
    snprintf(port_s, sizeof port_s, "%d", *port);
    snprintf(log, sizeof log, "%s/%s.log", cl->dir, name);
    char *argv[40];
    int a = 0;
    /* PD_SCHED_WRAPPER="valgrind -q" (space-separated) runs the scheduler under a tool */
    static char wrap[256];
    const char *w = getenv("PD_SCHED_WRAPPER");
    snprintf(wrap, sizeof wrap, "%s", w ? w : "");
    for (char *save = NULL, *t = strtok_r(wrap, " ", &save); t && a < 8;
         t = strtok_r(NULL, " ", &save))
        argv[a++] = t;
    static char bin[1024];
    snprintf(bin, sizeof bin, "%s", cl_bin("scheduler/pd-scheduler"));
    argv[a++] = bin;
    char *fixed[] = {"--model",
                     g_model,
                     "--port",
                     port_s,
                     "--host",
                     "127.0.0.1",
                     "--max-model-len",
                     "512",
                     "--served-model-name",
                     "tiny",
                     "tiny-alias",
                     NULL};
    for (int i = 0; fixed[i]; i++) argv[a++] = fixed[i];
    for (int i = 0; extra && extra[i]; i++) argv[a++] = extra[i];
    argv[a] = NULL;
    if (cl_spawn(p, name, argv, env, log) != 0) return -1;
    if (!wait_health(p, *port, 30)) {
        cl_dump_log(p, 30);
        return -1;
    }
    return 0;
}

int start_scheduler(cl_proc *p, int *port, const char *name, char *const extra[],
                    const char *use_openai)
{
    return start_scheduler_on(&g_c, p, port, name, extra, use_openai);
}

bool fixture(void)
{
    if (g_ready || g_failed) return g_ready;
    g_failed = true;
    if (cl_make_tiny(g_model, sizeof g_model) < 0) return false;
    if (cl_start(&g_c, g_model, "0", "1", NULL) < 0) {
        printf("    cl_start: %s\n", pd_last_error());
        return false;
    }
    char *main_args[] = {"--max-request-body-bytes", "65536", NULL};
    if (start_scheduler(&g_sched, &g_port, "scheduler", main_args, "1") < 0) {
        printf("    pd-scheduler did not become healthy\n");
        return false;
    }
    char *key_args[] = {
        "--api-key", "sk-test", "--max-concurrent-requests", "1", "--max-request-body-bytes",
        "65536",     NULL};
    if (start_scheduler(&g_sched_key, &g_port_key, "scheduler_key", key_args, "1") < 0) {
        printf("    pd-scheduler (api key) did not become healthy\n");
        return false;
    }
    if (start_scheduler(&g_sched_legacy, &g_port_legacy, "scheduler_legacy", NULL, "0") < 0) {
        printf("    pd-scheduler (USE_OPENAI=0) did not become healthy\n");
        return false;
    }
    g_failed = false;
    g_ready = true;
    return true;
}
/* ---- helpers for the API ------------------------------------------------------------------- */

void keys_of(const json_t *o, char *buf, size_t n)
{
    buf[0] = '\0';
    const char *k;
    json_t *v;
    size_t at = 0;
    json_object_foreach((json_t *)o, k, v)
    {
        at += (size_t)snprintf(buf + at, n - at, "%s%s", at ? "," : "", k);
        if (at >= n) break;
    }
}

bool is_id(const char *s, const char *prefix)
{
    size_t pl = strlen(prefix);
    if (!s || strncmp(s, prefix, pl) != 0 || strlen(s) != pl + 32) return false;
    for (size_t i = pl; s[i]; i++)
        if (!isxdigit((unsigned char)s[i]) || isupper((unsigned char)s[i])) return false;
    return true;
}

int open_long_stream(int port, const char *auth)
{
    int fd = connect_port(port);
    if (fd < 0) return -1;
    const char *body = "{\"prompt\":\"Once upon a time\",\"max_tokens\":480,\"ignore_eos\":true,"
                       "\"stream\":true}";
    char req[1024];
    int n =
        snprintf(req, sizeof req,
                 "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 "%sContent-Length: %zu\r\n\r\n%s",
                 auth ? auth : "", strlen(body), body);
    if (write(fd, req, (size_t)n) != n) {
        close(fd);
        return -1;
    }
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    char buf[256];
    if (poll(&pfd, 1, 30000) != 1 || read(fd, buf, sizeof buf) <= 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* POST body to path on port; the parsed response (200 asserted by the caller). */
int start_colocated_scheduler(cl_proc *p, int *port, const char *name)
{
    char *extra[] = {"--max-local-prefill-length", "4096", NULL};
    return start_scheduler(p, port, name, extra, "1");
}

bool side_cluster(cl_cluster *c, const char *prefill, const char *decode, cl_proc *sp, int *port,
                  const char *name, char *const args[])
{
    if (cl_start(c, g_model, prefill, decode, NULL) < 0) {
        printf("    cl_start: %s\n", pd_last_error());
        return false;
    }
    if (start_scheduler_on(c, sp, port, name, args, "1") < 0) {
        printf("    %s did not start\n", name);
        cl_stop_all(c);
        return false;
    }
    /* /health answers once one instance of each role is in; tests that spread work wait for all */
    if (!cl_wait_instance(c, *port, -1, 1, 30000)) {
        printf("    %s: not every instance joined its routing set\n", name);
        cl_stop(sp, 10000);
        cl_stop_all(c);
        return false;
    }
    return true;
}

json_t *post_json(int port, const char *path, const char *body, int *status)
{
    http_resp r;
    if (http_do(port, "POST", path, NULL, body, &r) != 0) return NULL;
    *status = r.status;
    json_t *o = json_loads(r.body, 0, NULL);
    if (r.status != 200) printf("    %s -> %d: %.400s\n", path, r.status, r.body);
    resp_free(&r);
    return o;
}

/* 0 when instance (JSON text) is valid under schema (JSON text), by python3-jsonschema. */
int validate(const char *schema, const char *instance, char *why, size_t n)
{
    char dir[] = "/tmp/pdso.XXXXXX", sp[64], ip[64], out[80];
    if (!mkdtemp(dir)) return -1;
    snprintf(sp, sizeof sp, "%s/s.json", dir);
    snprintf(ip, sizeof ip, "%s/i.json", dir);
    snprintf(out, sizeof out, "%s/out", dir);
    FILE *f = fopen(sp, "w"), *g = fopen(ip, "w");
    if (f) fputs(schema, f);
    if (g) fputs(instance, g);
    if (f) fclose(f);
    if (g) fclose(g);
    char *argv[] = {"/usr/bin/python3",
                    "-c",
                    "import json, sys, jsonschema\n"
                    "s = json.load(open(sys.argv[1]))\n"
                    "jsonschema.Draft7Validator.check_schema(s)\n"
                    "jsonschema.Draft7Validator(s).validate(json.load(open(sys.argv[2])))",
                    sp,
                    ip,
                    NULL};
    int rc = cl_run(argv, out, 30);
    why[0] = 0;
    FILE *o = fopen(out, "r");
    if (o) {
        size_t k = fread(why, 1, n - 1, o);
        why[k] = 0;
        fclose(o);
    }
    unlink(sp), unlink(ip), unlink(out), rmdir(dir);
    return rc;
}
