/* Integration-test harness (see cluster.h). */
#define _XOPEN_SOURCE 700
#include "cluster.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "ranktable/ranktable.h"
#include "rpc/pd_msg.h"
#include "util/clock.h"

extern char **environ;

/* BUILD/tests/<suite>/<exe>: the build directory this program belongs to ("build" when
 * /proc/self/exe cannot be read). */
static char g_exe_root[900];
static void find_exe_root(void)
{
    ssize_t n = readlink("/proc/self/exe", g_exe_root, sizeof g_exe_root - 1);
    g_exe_root[n > 0 ? n : 0] = '\0';
    for (int up = 0; up < 3; up++) {
        char *slash = strrchr(g_exe_root, '/');
        if (slash) *slash = '\0';
    }
    if (!g_exe_root[0]) snprintf(g_exe_root, sizeof g_exe_root, "build");
}

const char *cl_bin(const char *rel)
{
    static _Thread_local char buf[1024];
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    const char *root = getenv("PD_BUILD_ROOT");
    if (!root) {
        pthread_once(&once, find_exe_root);
        root = g_exe_root;
    }
    snprintf(buf, sizeof buf, "%s/%s", root, rel);
    return buf;
}

/* Every process the harness starts is remembered: whatever happens to the test (a failed check,
 * meson's timeout), none outlives it - SIGKILL from atexit and from SIGTERM/SIGINT to each one
 * that is still our child. */
#define MAX_CHILDREN 1024
static pid_t g_children[MAX_CHILDREN];
static size_t g_n_children;

static bool is_our_child(pid_t pid)
{
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return false;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')'); /* the command name may hold spaces */
    int ppid = 0;
    return p && sscanf(p + 2, "%*c %d", &ppid) == 1 && ppid == (int)getpid();
}

static void kill_children(void)
{
    for (size_t i = 0; i < g_n_children; i++)
        if (is_our_child(g_children[i])) kill(g_children[i], SIGKILL);
}

static void on_fatal_signal(int sig)
{
    kill_children();
    signal(sig, SIG_DFL);
    raise(sig);
}

static void remember_child(pid_t pid)
{
    if (g_n_children == 0) {
        atexit(kill_children);
        signal(SIGTERM, on_fatal_signal);
        signal(SIGINT, on_fatal_signal);
    }
    if (g_n_children < MAX_CHILDREN) g_children[g_n_children++] = pid;
}

static int spawn_with(pid_t *pid, char *const argv[], char *const extra_env[], const char *out)
{
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    if (out) {
        posix_spawn_file_actions_addopen(&fa, 1, out, O_WRONLY | O_CREAT | O_APPEND, 0644);
        posix_spawn_file_actions_adddup2(&fa, 1, 2);
    }
    /* environment: ours plus the extra entries (which win) */
    size_t n_env = 0, n_extra = 0;
    while (environ[n_env]) n_env++;
    while (extra_env && extra_env[n_extra]) n_extra++;
    char **env = calloc(n_env + n_extra + 1, sizeof *env);
    size_t k = 0;
    for (size_t i = 0; i < n_env; i++) {
        bool overridden = false;
        for (size_t j = 0; j < n_extra; j++) {
            const char *eq = strchr(extra_env[j], '=');
            size_t kl = eq ? (size_t)(eq - extra_env[j]) + 1 : strlen(extra_env[j]);
            if (strncmp(environ[i], extra_env[j], kl) == 0) overridden = true;
        }
        if (!overridden) env[k++] = environ[i];
    }
    for (size_t j = 0; j < n_extra; j++) env[k++] = extra_env[j];
    /* PD_TEST_WRAPPER="valgrind --flags ...": every pd-* executable runs under that command
     * (tests/valgrind.sh); words split on spaces, the wrapper found on PATH */
    const char *wrap = getenv("PD_TEST_WRAPPER"), *base = strrchr(argv[0], '/');
    base = base ? base + 1 : argv[0];
    char wstore[1024], *wargv[160];
    int rc;
    if (wrap && *wrap && strncmp(base, "pd-", 3) == 0) {
        int n = 0;
        snprintf(wstore, sizeof wstore, "%s", wrap);
        for (char *save = NULL, *t = strtok_r(wstore, " ", &save); t && n < 32;
             t = strtok_r(NULL, " ", &save))
            wargv[n++] = t;
        for (int i = 0; argv[i] && n < 157; i++) wargv[n++] = argv[i];
        /* the nodes answer heartbeats that much later too: stretch the scheduler's */
        static char hb[32];
        if (strcmp(base, "pd-scheduler") == 0 && cl_time_scale() > 1.0) {
            snprintf(hb, sizeof hb, "%d", (int)(1000 * cl_time_scale()));
            wargv[n++] = "--heartbeat-ms";
            wargv[n++] = hb;
        }
        wargv[n] = NULL;
        rc = posix_spawnp(pid, wargv[0], &fa, NULL, wargv, env);
    } else {
        rc = posix_spawn(pid, argv[0], &fa, NULL, argv, env);
    }
    posix_spawn_file_actions_destroy(&fa);
    free(env);
    if (rc == 0) remember_child(*pid);
    return rc == 0 ? 0 : -1;
}

/* waitpid with a deadline: the exit status, or -2 when still running at the deadline.
 * PD_TEST_TIME_SCALE=F (valgrind runs) stretches the time left by F. */
static int wait_until(pid_t pid, int64_t deadline_ns)
{
    double f = cl_time_scale();
    if (f > 1.0) deadline_ns = pd_now_ns() + (int64_t)((double)(deadline_ns - pd_now_ns()) * f);
    for (;;) {
        int st;
        pid_t r = waitpid(pid, &st, WNOHANG);
        if (r == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        if (r < 0 && errno != EINTR) return -1;
        if (pd_now_ns() >= deadline_ns) return -2;
        pd_sleep_ns(5 * PD_NS_PER_MS);
    }
}

int cl_run(char *const argv[], const char *out_file, int timeout_s)
{
    pid_t pid;
    if (spawn_with(&pid, argv, NULL, out_file) != 0) return -1;
    int st = wait_until(pid, pd_now_ns() + (int64_t)timeout_s * PD_NS_PER_S);
    if (st == -2) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        return -1;
    }
    return st;
}

int cl_spawn(cl_proc *p, const char *name, char *const argv[], char *const env[], const char *log)
{
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "%s", name);
    snprintf(p->log, sizeof p->log, "%s", log);
    return spawn_with(&p->pid, argv, env, log);
}

int cl_stop(cl_proc *p, int timeout_ms)
{
    if (p->pid <= 0) return 0;
    kill(p->pid, SIGCONT); /* a stopped process cannot handle SIGTERM */
    kill(p->pid, SIGTERM);
    int st = wait_until(p->pid, pd_now_ns() + (int64_t)timeout_ms * PD_NS_PER_MS);
    if (st == -2) {
        kill(p->pid, SIGKILL);
        waitpid(p->pid, NULL, 0);
        st = -1;
    }
    p->pid = 0;
    return st;
}

int cl_wait(cl_proc *p, int timeout_ms)
{
    if (p->pid <= 0) return -1;
    int st = wait_until(p->pid, pd_now_ns() + (int64_t)timeout_ms * PD_NS_PER_MS);
    if (st == -2) {
        kill(p->pid, SIGKILL);
        waitpid(p->pid, NULL, 0);
        st = -1;
    }
    p->pid = 0;
    return st;
}

void cl_signal(cl_proc *p, int sig)
{
    if (p->pid > 0) kill(p->pid, sig);
    if (sig == SIGKILL && p->pid > 0) {
        waitpid(p->pid, NULL, 0);
        p->pid = 0;
    }
}

int cl_make_tiny(char *out, size_t n)
{
    snprintf(out, n, "%s/tiny", pdt_tmp_dir());
    char *mk[] = {
        (char *)cl_bin("tools/mkmodel/pd-mkmodel"), "--preset", "tiny", "--out", out, NULL};
    char log[600];
    snprintf(log, sizeof log, "%s/mkmodel.log", pdt_tmp_dir());
    if (cl_run(mk, log, 120) == 0) return 0;
    printf("    pd-mkmodel failed (%s)\n", log);
    return -1;
}

void cl_dump_log(const cl_proc *p, int lines)
{
    char cmd[700];
    printf("    --- last %d lines of %s (%s) ---\n", lines, p->name, p->log);
    fflush(stdout);
    snprintf(cmd, sizeof cmd, "tail -n %d '%s' | sed 's/^/    | /'", lines, p->log);
    int rc = system(cmd);
    /* a sanitizer's report ends with its legend: its first lines say what and where */
    snprintf(cmd, sizeof cmd,
             "grep -m1 -A14 -E '==ERROR: |runtime error: ' '%s' | sed 's/^/    sanitizer | /'",
             p->log);
    rc = system(cmd);
    (void)rc;
}

int cl_free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 ||
        getsockname(fd, (struct sockaddr *)&a, &len) != 0) {
        close(fd);
        return -1;
    }
    int port = ntohs(a.sin_port);
    close(fd);
    return port;
}

/* ---- cluster ------------------------------------------------------------------------------- */

pd_rpc_channel *cl_node(cl_cluster *c, int k)
{
    return c->ch[k];
}

ProtobufCMessage *cl_call(pd_rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                          const ProtobufCMessageDescriptor *reply_desc, int timeout_ms, int *st)
{
    size_t len = 0, rlen = 0;
    uint8_t *buf = pd_msg_pack(req, &len), *resp = NULL;
    int gst = 0;
    int rc = pd_rpc_unary(ch, method, buf, len, timeout_ms, &resp, &rlen, &gst);
    free(buf);
    if (st) *st = gst;
    if (rc < 0) return NULL;
    ProtobufCMessage *m = protobuf_c_message_unpack(reply_desc, NULL, rlen, resp);
    free(resp);
    if (!m) {
        if (st) *st = PD_RPC_INTERNAL;
        pd_error(PD_EPARSE, "%s: reply does not parse", method);
    }
    return m;
}

static int split_args(const char *list, char *store, size_t cap, char **argv, int max)
{
    snprintf(store, cap, "%s", list);
    int n = 0;
    for (char *save = NULL, *t = strtok_r(store, " ", &save); t && n < max;
         t = strtok_r(NULL, " ", &save))
        argv[n++] = t;
    return n;
}

/* A malloc'd copy of a NULL-terminated string vector (NULL when out of memory). */
static char **dup_strv(char *const v[])
{
    size_t n = 0;
    while (v[n]) n++;
    char **d = calloc(n + 1, sizeof *d);
    for (size_t i = 0; d && i < n; i++) d[i] = strdup(v[i]);
    return d;
}

static void free_strv(char **v)
{
    for (size_t i = 0; v && v[i]; i++) free(v[i]);
    free(v);
}

/* Waits up to timeout_ms until node k answers Info; fails early when its process exited. */
static int wait_info(cl_cluster *c, int k, int timeout_ms)
{
    int64_t deadline = pd_now_ns() + (int64_t)timeout_ms * PD_NS_PER_MS;
    for (;;) {
        Pd__InfoRequest q = PD__INFO_REQUEST__INIT;
        int st;
        ProtobufCMessage *r =
            cl_call(c->ch[k], "/pd.PD/Info", &q.base, &pd__info_reply__descriptor, 1000, &st);
        if (r) {
            protobuf_c_message_free_unpacked(r, NULL);
            return PD_OK;
        }
        int status;
        if (waitpid(c->procs[k].pid, &status, WNOHANG) == c->procs[k].pid) {
            c->procs[k].pid = 0;
            cl_dump_log(&c->procs[k], 20);
            return pd_error(PD_EINTERNAL, "node %d exited during start-up", k);
        }
        if (pd_now_ns() > deadline) {
            cl_dump_log(&c->procs[k], 20);
            return pd_error(PD_ETIMEOUT, "node %d did not answer Info within %d ms", k, timeout_ms);
        }
        pd_sleep_ns(50 * PD_NS_PER_MS);
    }
}

/* PD_TEST_NCCL_HOST_PER_NODE=1 (cluster.h): every node its own NCCL host. */
static bool nccl_host_per_node(void)
{
    const char *e = getenv("PD_TEST_NCCL_HOST_PER_NODE");
    return e && strcmp(e, "1") == 0;
}

int cl_start(cl_cluster *c, const char *model_dir, const char *prefill_list,
             const char *decode_list, char *const extra_args[])
{
    static int seq;
    memset(c, 0, sizeof *c);
    snprintf(c->dir, sizeof c->dir, "%s/cluster%d", pdt_tmp_dir(), seq++);
    mkdir(c->dir, 0755);
    snprintf(c->model, sizeof c->model, "%s", model_dir);
    /* ranktables from the CLI, as users make them */
    char pstore[256], dstore[256], *pl[16], *dl[16];
    int np = split_args(prefill_list, pstore, sizeof pstore, pl, 16);
    int nd = split_args(decode_list, dstore, sizeof dstore, dl, 16);
    char *argv[64];
    int a = 0;
    argv[a++] = (char *)cl_bin("ranktable/cli/pd-ranktable");
    argv[a++] = "--mode";
    argv[a++] = "gen";
    argv[a++] = "--prefill-server-list";
    for (int i = 0; i < np; i++) argv[a++] = pl[i];
    argv[a++] = "--decode-server-list";
    for (int i = 0; i < nd; i++) argv[a++] = dl[i];
    argv[a++] = "--api-server";
    argv[a++] = "--server-ip";
    argv[a++] = "127.0.0.1";
    argv[a++] = "--save-dir";
    argv[a++] = c->dir;
    argv[a] = NULL;
    char out[400];
    snprintf(out, sizeof out, "%s/ranktable.log", c->dir);
    if (cl_run(argv, out, 30) != 0)
        return pd_error(PD_EINTERNAL, "pd-ranktable gen failed (%s)", out);
    snprintf(c->global, sizeof c->global, "%s/global_ranktable_127.0.0.1.json", c->dir);
    rt_global *g = NULL;
    PD_CHECK(rt_global_load_file(c->global, 0, NULL, &g));
    c->n_prefill = (int)rt_global_instance_count(g, RT_ROLE_PREFILL);
    c->n_decode = (int)rt_global_instance_count(g, RT_ROLE_DECODE);
    PD_CHECK(pd_rpc_client_create(&c->client));
    for (int k = 0; k < c->n_prefill + c->n_decode; k++) {
        const rt_instance *inst = rt_global_node(g, (size_t)k);
        char local_name[256], local[600], genv[700], lenv[700], port[16], log[400];
        rt_local_file_name(local_name, sizeof local_name, "127.0.0.1", inst);
        snprintf(local, sizeof local, "%s/%s", c->dir, local_name);
        snprintf(genv, sizeof genv, "GLOBAL_RANK_TABLE_FILE_PATH=%s", c->global);
        snprintf(lenv, sizeof lenv, "RANK_TABLE_FILE_PATH=%s", local);
        c->ports[k] = cl_free_port();
        snprintf(port, sizeof port, "%d", c->ports[k]);
        bool prefill = inst->role == RT_ROLE_PREFILL;
        snprintf(log, sizeof log, "%s/%s%zu.log", c->dir, prefill ? "prefill" : "decode",
                 inst->index);
        char *nargv[64];
        int m = 0;
        nargv[m++] =
            (char *)strdup(cl_bin(prefill ? "prefill_node/pd-prefill" : "decode_node/pd-decode"));
        char *fixed[] = {"--model",
                         (char *)c->model,
                         "--port",
                         port,
                         "--max-model-len",
                         "1024",
                         "--kv-cache-bytes",
                         "33554432",
                         "--cpu-threads",
                         "1",
                         "--max-num-seqs",
                         "64",
                         "--shutdown-timeout",
                         "5",
                         NULL};
        for (int i = 0; fixed[i]; i++) nargv[m++] = fixed[i];
        for (int i = 0; extra_args && extra_args[i] && m < 60; i++) nargv[m++] = extra_args[i];
        nargv[m] = NULL;
        char hostid[64];
        snprintf(hostid, sizeof hostid, "NCCL_HOSTID=pdtest-%d-node%d", (int)getpid(), k);
        char *env[8] = {genv, lenv, NULL};
        if (nccl_host_per_node()) {
            char *more[] = {hostid,
                            "NCCL_SOCKET_IFNAME=lo",
                            "NCCL_P2P_DISABLE=1",
                            "NCCL_SHM_DISABLE=1",
                            "NCCL_IB_DISABLE=1",
                            NULL};
            for (int i = 0; more[i]; i++) env[2 + i] = more[i];
        }
        int rc = cl_spawn(&c->procs[k], prefill ? "pd-prefill" : "pd-decode", nargv, env, log);
        c->argv[k] = dup_strv(nargv);
        c->env[k] = dup_strv(env);
        free(nargv[0]);
        if (rc != 0) {
            rt_global_free(g);
            return pd_error(PD_EINTERNAL, "cannot start node %d", k);
        }
        char target[64];
        snprintf(target, sizeof target, "127.0.0.1:%d", c->ports[k]);
        PD_CHECK(pd_rpc_channel_create(c->client, target, 0, &c->ch[k]));
    }
    rt_global_free(g);
    /* wait until every node answers Info (model load included), 60 s for all of them */
    int64_t deadline = pd_now_ns() + 60 * PD_NS_PER_S;
    for (int k = 0; k < c->n_prefill + c->n_decode; k++) {
        int64_t left_ms = (deadline - pd_now_ns()) / PD_NS_PER_MS;
        PD_CHECK(wait_info(c, k, left_ms > 0 ? (int)left_ms : 0));
    }
    return PD_OK;
}

int cl_stop_all(cl_cluster *c)
{
    int bad = 0;
    for (int k = 0; k < 16; k++)
        if (c->ch[k]) pd_rpc_channel_free(c->ch[k]);
    if (c->client) pd_rpc_client_free(c->client);
    for (int k = 0; k < c->n_prefill + c->n_decode; k++) {
        if (c->procs[k].pid <= 0) continue;
        int st = cl_stop(&c->procs[k], 10000);
        if (st != 0) {
            printf("    %s (node %d) exited with %d\n", c->procs[k].name, k, st);
            cl_dump_log(&c->procs[k], 15);
            bad++;
        }
    }
    memset(c->ch, 0, sizeof c->ch);
    c->client = NULL;
    for (int k = 0; k < 16; k++) {
        free_strv(c->argv[k]);
        free_strv(c->env[k]);
        c->argv[k] = c->env[k] = NULL;
    }
    return bad;
}

/* ---- one split request ------------------------------------------------------------------------
 */

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    cl_result *out;
    bool done;
} stream_ctx;

static void append_event(cl_result *out, const Pd__TokenEvent *ev)
{
    for (size_t i = 0; i < ev->n_token_ids && out->n < 4096; i++)
        out->tokens[out->n++] = ev->token_ids[i];
    size_t tl = strlen(out->text);
    if (ev->text.len && tl + ev->text.len < sizeof out->text) {
        memcpy(out->text + tl, ev->text.data, ev->text.len);
        out->text[tl + ev->text.len] = '\0';
    }
    if (ev->final) snprintf(out->finish, sizeof out->finish, "%s", ev->finish_reason);
    if (ev->status) {
        out->status = PD_RPC_INTERNAL;
        snprintf(out->error, sizeof out->error, "%s", ev->error);
    }
}

static void on_stream_msg(void *arg, const uint8_t *m, size_t len)
{
    stream_ctx *s = arg;
    Pd__TokenEvent *ev = pd__token_event__unpack(NULL, len, m);
    pthread_mutex_lock(&s->mu);
    if (ev) append_event(s->out, ev);
    pthread_mutex_unlock(&s->mu);
    if (ev) pd__token_event__free_unpacked(ev, NULL);
}

static void on_stream_done(void *arg, int st, const char *details, const uint8_t *r, size_t len)
{
    stream_ctx *s = arg;
    (void)r, (void)len;
    pthread_mutex_lock(&s->mu);
    if (st != PD_RPC_OK) {
        s->out->status = st;
        snprintf(s->out->error, sizeof s->out->error, "Decode: %s: %s", pd_rpc_status_name(st),
                 details);
    }
    s->done = true;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

int cl_generate(cl_cluster *c, int pk, int dk, const char *id, const int32_t *prompt,
                size_t n_prompt, const Pd__SamplingParams *sampling, cl_result *out)
{
    return cl_generate_hook(c, pk, dk, id, prompt, n_prompt, sampling, NULL, NULL, out);
}

/* cl_generate's default sampling: greedy, 16 tokens, no seed. */
static Pd__SamplingParams greedy16(void)
{
    Pd__SamplingParams g = cl_sampling(0, 0, 16);
    g.has_seed = false;
    return g;
}

int cl_prefill(cl_cluster *c, int pk, int dk, const char *id, const int32_t *prompt,
               size_t n_prompt, const Pd__SamplingParams *sampling, cl_reserved_fn hook,
               void *hook_arg, cl_result *out, uint64_t *seed_out, int32_t *first_out)
{
    memset(out, 0, sizeof *out);
    int st = 0;
    /* the decode instance's ranks */
    Pd__InfoRequest iq = PD__INFO_REQUEST__INIT;
    Pd__InfoReply *info = (Pd__InfoReply *)cl_call(c->ch[dk], "/pd.PD/Info", &iq.base,
                                                   &pd__info_reply__descriptor, 5000, &st);
    if (!info) goto fail;
    out->t_start = pd_now_s();
    Pd__ReserveRequest rq = PD__RESERVE_REQUEST__INIT;
    rq.request_id = (char *)id;
    rq.num_prompt_tokens = (int64_t)n_prompt;
    rq.ttl_ms = 30000;
    rq.prompt_ids = (int32_t *)prompt;
    rq.n_prompt_ids = n_prompt;
    Pd__ReserveReply *rr = (Pd__ReserveReply *)cl_call(c->ch[dk], "/pd.PD/Reserve", &rq.base,
                                                       &pd__reserve_reply__descriptor, 5000, &st);
    if (!rr) {
        pd__info_reply__free_unpacked(info, NULL);
        goto fail;
    }
    if (hook && hook(hook_arg, info, rr) < 0) {
        pd__info_reply__free_unpacked(info, NULL);
        pd__reserve_reply__free_unpacked(rr, NULL);
        goto fail;
    }
    Pd__DecodeTarget tg[16], *tp[16];
    for (size_t r = 0; r < info->n_ranks && r < 16; r++) {
        pd__decode_target__init(&tg[r]);
        tg[r].host = info->ranks[r]->device_ip;
        tg[r].port = info->ranks[r]->data_port;
        tg[r].kv_head0 = info->ranks[r]->kv_head0;
        tg[r].kv_heads = info->ranks[r]->kv_heads;
        tp[r] = &tg[r];
    }
    Pd__SamplingParams greedy = greedy16();
    if (!sampling) sampling = &greedy;
    Pd__PrefillRequest pq = PD__PREFILL_REQUEST__INIT;
    pq.request_id = (char *)id;
    pq.prompt_ids = (int32_t *)prompt;
    pq.n_prompt_ids = n_prompt;
    pq.sampling = (Pd__SamplingParams *)sampling;
    pq.targets = tp;
    pq.n_targets = info->n_ranks;
    pq.decode_block_ids = rr->block_ids;
    pq.n_decode_block_ids = rr->n_block_ids;
    pq.decode_cached_tokens = out->decode_cached = rr->cached_tokens;
    pq.lease_ms = 10000;
    Pd__PrefillReply *pr = (Pd__PrefillReply *)cl_call(c->ch[pk], "/pd.PD/Prefill", &pq.base,
                                                       &pd__prefill_reply__descriptor, 30000, &st);
    pd__info_reply__free_unpacked(info, NULL);
    pd__reserve_reply__free_unpacked(rr, NULL);
    if (!pr) goto fail;
    out->t_first = pd_now_s();
    out->prefill_seconds = pr->prefill_seconds;
    out->kv_seconds = pr->kv_seconds;
    out->kv_bytes = pr->kv_bytes;
    snprintf(out->kv_transport, sizeof out->kv_transport, "%s", pr->kv_transport);
    append_event(out, pr->first);
    bool final = pr->first->final;
    *seed_out = pr->seed;
    *first_out = pr->first->n_token_ids ? pr->first->token_ids[0] : -1;
    pd__prefill_reply__free_unpacked(pr, NULL);
    if (final) return out->status ? pd_error(PD_EINTERNAL, "%s", out->error) : 1;
    return PD_OK;
fail:
    out->status = st ? st : PD_RPC_INTERNAL;
    snprintf(out->error, sizeof out->error, "%s", pd_last_error());
    return pd_error(PD_EINTERNAL, "%s", out->error);
}

int cl_generate_hook(cl_cluster *c, int pk, int dk, const char *id, const int32_t *prompt,
                     size_t n_prompt, const Pd__SamplingParams *sampling, cl_reserved_fn hook,
                     void *hook_arg, cl_result *out)
{
    uint64_t seed = 0;
    int32_t first = -1;
    int rc =
        cl_prefill(c, pk, dk, id, prompt, n_prompt, sampling, hook, hook_arg, out, &seed, &first);
    if (rc != PD_OK) return rc < 0 ? rc : PD_OK;
    Pd__SamplingParams ds = sampling ? *sampling : greedy16();
    ds.has_seed = true;
    ds.seed = (int64_t)seed;
    Pd__DecodeRequest dq = PD__DECODE_REQUEST__INIT;
    dq.request_id = (char *)id;
    dq.prompt_ids = (int32_t *)prompt;
    dq.n_prompt_ids = n_prompt;
    dq.sampling = &ds;
    dq.first_token = first;
    size_t len = 0;
    uint8_t *buf = pd_msg_pack(&dq.base, &len);
    stream_ctx s = {.out = out};
    pthread_mutex_init(&s.mu, NULL);
    pthread_cond_init(&s.cv, NULL);
    pd_rpc_stream_async(c->ch[dk], "/pd.PD/Decode", buf, len, 60000, on_stream_msg, on_stream_done,
                        &s, NULL);
    free(buf);
    pthread_mutex_lock(&s.mu);
    while (!s.done) pthread_cond_wait(&s.cv, &s.mu);
    pthread_mutex_unlock(&s.mu);
    pthread_mutex_destroy(&s.mu);
    pthread_cond_destroy(&s.cv);
    if (out->status) return pd_error(PD_EINTERNAL, "%s", out->error);
    return PD_OK;
}

Pd__SamplingParams cl_sampling(double temperature, int64_t seed, int max_tokens)
{
    Pd__SamplingParams s = PD__SAMPLING_PARAMS__INIT;
    s.n = 1;
    s.temperature = temperature;
    s.top_p = 1;
    s.repetition_penalty = 1;
    s.logprobs = -1;
    s.max_tokens = max_tokens;
    s.skip_special_tokens = true;
    s.has_seed = true;
    s.seed = seed;
    return s;
}

int cl_reference(const char *model, const int32_t *const *prompts, const size_t *n_prompt, size_t n,
                 int max_tokens, double temperature, int64_t seed, const char *dir, cl_result *out)
{
    return cl_reference_ex(model, prompts, n_prompt, n, max_tokens, temperature, seed, dir, NULL,
                           out);
}

int cl_reference_ex(const char *model, const int32_t *const *prompts, const size_t *n_prompt,
                    size_t n, int max_tokens, double temperature, int64_t seed, const char *dir,
                    char *const extra[], cl_result *out)
{
    char ids[600], json[600], mt[16], tt[32], sd[32];
    snprintf(ids, sizeof ids, "%s/prompts.ids", dir);
    snprintf(json, sizeof json, "%s/reference.jsonl", dir);
    FILE *f = fopen(ids, "w");
    if (!f) return pd_error(PD_EIO, "%s: cannot write", ids);
    for (size_t i = 0; i < n; i++) {
        for (size_t j = 0; j < n_prompt[i]; j++) fprintf(f, "%s%d", j ? "," : "", prompts[i][j]);
        fputc('\n', f);
    }
    fclose(f);
    unlink(json);
    snprintf(mt, sizeof mt, "%d", max_tokens);
    snprintf(tt, sizeof tt, "%.17g", temperature);
    snprintf(sd, sizeof sd, "%lld", (long long)seed);
    char *argv[] = {(char *)cl_bin("tools/generate/pd-generate"),
                    "--model",
                    (char *)model,
                    "--prompts-file",
                    ids,
                    "--json",
                    "--max-tokens",
                    mt,
                    "--temperature",
                    tt,
                    "--seed",
                    sd,
                    "--cpu-threads",
                    "1",
                    NULL,
                    NULL,
                    NULL,
                    NULL,
                    NULL,
                    NULL,
                    NULL,
                    NULL,
                    NULL};
    for (size_t i = 0, k = 14; extra && extra[i] && k + 1 < sizeof argv / sizeof argv[0]; i++, k++)
        argv[k] = extra[i];
    int st = cl_run(argv, json, 300);
    if (st != 0) return pd_error(PD_EINTERNAL, "pd-generate exited with %d (see %s)", st, json);
    f = fopen(json, "r");
    static char line[1 << 20]; /* prompt logprobs make long lines */
    size_t k = 0;
    while (f && k < n && fgets(line, sizeof line, f)) {
        if (line[0] != '{') continue; /* log lines */
        json_error_t err;             /* a sampled byte token may be U+0000 */
        json_t *o = json_loads(line, JSON_ALLOW_NUL, &err);
        if (!o) {
            fclose(f);
            return pd_error(PD_EINTERNAL, "%s: result %zu: %s", json, k, err.text);
        }
        memset(&out[k], 0, sizeof out[k]);
        json_t *toks = json_object_get(o, "token_ids");
        for (size_t i = 0; i < json_array_size(toks) && i < 4096; i++)
            out[k].tokens[out[k].n++] = (int32_t)json_integer_value(json_array_get(toks, i));
        const char *fin = json_string_value(json_object_get(o, "finish_reason"));
        const char *txt = json_string_value(json_object_get(o, "text"));
        snprintf(out[k].finish, sizeof out[k].finish, "%s", fin ? fin : "");
        snprintf(out[k].text, sizeof out[k].text, "%s", txt ? txt : "");
        json_t *plp = json_object_get(o, "prompt_logprobs");
        if (plp) out[k].prompt_logprobs = json_dumps(plp, JSON_COMPACT);
        json_decref(o);
        k++;
    }
    if (f) fclose(f);
    if (k != n)
        return pd_error(PD_EINTERNAL, "pd-generate printed %zu results for %zu prompts", k, n);
    return PD_OK;
}

/* ---- faults, HTTP clients, process figures ------------------------------------------------ */

int cl_restart(cl_cluster *c, int k, int timeout_ms)
{
    if (k < 0 || k >= c->n_prefill + c->n_decode || !c->argv[k] || !c->env[k])
        return pd_error(PD_EINVAL, "node %d was not started by cl_start", k);
    if (c->procs[k].pid > 0) return pd_error(PD_EEXIST, "node %d is still running", k);
    char name[64], log[512];
    snprintf(name, sizeof name, "%s", c->procs[k].name);
    snprintf(log, sizeof log, "%s", c->procs[k].log);
    if (cl_spawn(&c->procs[k], name, c->argv[k], c->env[k], log) != 0)
        return pd_error(PD_EINTERNAL, "cannot start node %d again", k);
    return wait_info(c, k, timeout_ms);
}

Pd__StatsReply *cl_stats(cl_cluster *c, int k)
{
    Pd__StatsRequest q = PD__STATS_REQUEST__INIT;
    int st;
    return (Pd__StatsReply *)cl_call(c->ch[k], "/pd.PD/Stats", &q.base,
                                     &pd__stats_reply__descriptor, 2000, &st);
}

int cl_sched_start(cl_cluster *c, cl_proc *p, const char *name, char *const extra[], int *port)
{
    char genv[700], penv[256], henv[700];
    snprintf(genv, sizeof genv, "GLOBAL_RANK_TABLE_FILE_PATH=%s", c->global);
    size_t at = (size_t)snprintf(penv, sizeof penv, "NODE_PORTS=");
    for (int k = 0; k < c->n_prefill + c->n_decode && at < sizeof penv; k++)
        at += (size_t)snprintf(penv + at, sizeof penv - at, "%s%d", k ? "," : "", c->ports[k]);
    snprintf(henv, sizeof henv, "RANK_TABLE_FILE_PATH=%s/local_ranktable_127.0.0.1_host.json",
             c->dir);
    char *env[] = {genv, penv, henv, "VLLM_API_KEY=", "USE_OPENAI=1", NULL};
    *port = cl_free_port();
    char port_s[16], log[512], bin[1024];
    snprintf(port_s, sizeof port_s, "%d", *port);
    snprintf(log, sizeof log, "%s/%s.log", c->dir, name);
    snprintf(bin, sizeof bin, "%s", cl_bin("scheduler/pd-scheduler"));
    char *argv[64];
    int a = 0;
    char *fixed[] = {bin,      "--model",   c->model,          "--port", port_s,
                     "--host", "127.0.0.1", "--max-model-len", "1024",   "--served-model-name",
                     "tiny",   NULL};
    for (int i = 0; fixed[i]; i++) argv[a++] = fixed[i];
    for (int i = 0; extra && extra[i] && a < 63; i++) argv[a++] = extra[i];
    argv[a] = NULL;
    if (cl_spawn(p, name, argv, env, log) != 0)
        return pd_error(PD_EINTERNAL, "cannot start pd-scheduler");
    int64_t deadline = pd_now_ns() + 30 * PD_NS_PER_S;
    while (pd_now_ns() < deadline) {
        if (cl_http(*port, "GET", "/health", NULL, 2000, NULL, NULL) == 200) return PD_OK;
        int status;
        if (waitpid(p->pid, &status, WNOHANG) == p->pid) {
            p->pid = 0;
            cl_dump_log(p, 20);
            return pd_error(PD_EINTERNAL, "pd-scheduler exited during start-up (%s)", log);
        }
        pd_sleep_ns(100 * PD_NS_PER_MS);
    }
    cl_dump_log(p, 20);
    cl_stop(p, 5000);
    return pd_error(PD_ETIMEOUT, "pd-scheduler did not become healthy within 30 s (%s)", log);
}

int cl_conn_open_raw(cl_conn *c, int port, const char *req, size_t len)
{
    memset(c, 0, sizeof *c);
    c->fd = -1;
    c->t_open_ns = pd_now_ns();
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return pd_error(PD_EIO, "socket: %s", strerror(errno));
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        int e = errno;
        close(fd);
        return pd_error(PD_EIO, "connect 127.0.0.1:%d: %s", port, strerror(e));
    }
    c->fd = fd;
    size_t off = 0;
    while (off < len) {
        ssize_t w = send(fd, req + off, len - off, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            int e = errno;
            cl_conn_close(c);
            return pd_error(PD_EIO, "send to 127.0.0.1:%d: %s", port, strerror(e));
        }
        off += (size_t)w;
    }
    return PD_OK;
}

int cl_conn_open(cl_conn *c, int port, const char *method, const char *path,
                 const char *extra_headers, const char *body, bool keep_alive)
{
    size_t bl = body ? strlen(body) : 0;
    size_t cap = bl + 1024 + (extra_headers ? strlen(extra_headers) : 0);
    char *req = malloc(cap);
    if (!req) return pd_error(PD_ENOMEM, "out of memory");
    int n = snprintf(
        req, cap, "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\n%s%s%sContent-Length: %zu\r\n\r\n", method,
        path, keep_alive ? "" : "Connection: close\r\n", extra_headers ? extra_headers : "",
        body ? "Content-Type: application/json\r\n" : "", bl);
    if (body) memcpy(req + n, body, bl);
    int rc = cl_conn_open_raw(c, port, req, (size_t)n + bl);
    free(req);
    return rc;
}

void cl_conn_close(cl_conn *c)
{
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
    free(c->buf);
    c->buf = NULL;
    c->len = c->cap = 0;
}

/* Reads what one readable connection has (up to max_read bytes; 0 = until it would block). */
static void conn_read(cl_conn *c, size_t max_read)
{
    size_t got = 0;
    for (;;) {
        if (c->len + 4097 > c->cap) {
            size_t cap = c->cap ? c->cap * 2 : 65536;
            char *b = realloc(c->buf, cap);
            if (!b) return;
            c->buf = b;
            c->cap = cap;
        }
        size_t want = c->cap - c->len - 1;
        if (max_read && want > max_read - got) want = max_read - got;
        ssize_t r = recv(c->fd, c->buf + c->len, want, MSG_DONTWAIT);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        if (r <= 0) { /* EOF or reset */
            c->eof = true;
            close(c->fd);
            c->fd = -1;
            if (!c->t_done_ns) c->t_done_ns = pd_now_ns();
            break;
        }
        if (!c->t_first_ns) c->t_first_ns = pd_now_ns();
        size_t from = c->len > 16 ? c->len - 16 : 0;
        c->len += (size_t)r;
        got += (size_t)r;
        c->buf[c->len] = '\0';
        if (!c->status) sscanf(c->buf, "HTTP/1.1 %d", &c->status);
        if (!c->t_done_ns && strstr(c->buf + from, "data: [DONE]")) c->t_done_ns = pd_now_ns();
        if (max_read && got >= max_read) break;
    }
}

int cl_conn_poll(cl_conn *cs, size_t n, int timeout_ms, size_t max_read)
{
    struct pollfd *p = calloc(n ? n : 1, sizeof *p);
    size_t *idx = calloc(n ? n : 1, sizeof *idx);
    size_t m = 0;
    for (size_t i = 0; p && idx && i < n; i++) {
        if (cs[i].fd < 0) continue;
        p[m] = (struct pollfd){.fd = cs[i].fd, .events = POLLIN};
        idx[m++] = i;
    }
    if (m > 0 && poll(p, (nfds_t)m, timeout_ms) > 0)
        for (size_t j = 0; j < m; j++)
            if (p[j].revents) conn_read(&cs[idx[j]], max_read);
    int open = 0;
    for (size_t i = 0; i < n; i++) open += cs[i].fd >= 0;
    free(p);
    free(idx);
    return open;
}

bool cl_conn_wait_all(cl_conn *cs, size_t n, int timeout_ms)
{
    int64_t deadline = pd_now_ns() + (int64_t)timeout_ms * PD_NS_PER_MS;
    for (;;) {
        bool all = true;
        for (size_t i = 0; i < n; i++) all = all && (cs[i].t_done_ns || cs[i].fd < 0);
        if (all) return true;
        int left = (int)((deadline - pd_now_ns()) / PD_NS_PER_MS);
        if (left <= 0) return false;
        cl_conn_poll(cs, n, left < 100 ? left : 100, 0);
    }
}

/* Case-insensitive search for needle in hay. */
static const char *find_ci(const char *hay, const char *needle)
{
    size_t nl = strlen(needle);
    for (; *hay; hay++)
        if (strncasecmp(hay, needle, nl) == 0) return hay;
    return NULL;
}

const char *cl_conn_header(const cl_conn *c, const char *name, char *buf, size_t n)
{
    if (!c->buf) return NULL;
    const char *end = strstr(c->buf, "\r\n\r\n");
    if (!end) return NULL;
    char key[128];
    snprintf(key, sizeof key, "\r\n%s:", name);
    const char *p = find_ci(c->buf, key);
    if (!p || p > end) return NULL;
    p += strlen(key);
    while (*p == ' ') p++;
    size_t l = strcspn(p, "\r\n");
    snprintf(buf, n, "%.*s", (int)l, p);
    return buf;
}

char *cl_conn_body(const cl_conn *c)
{
    if (!c->buf) return NULL;
    const char *hend = strstr(c->buf, "\r\n\r\n");
    if (!hend) return NULL;
    const char *b = hend + 4;
    size_t bl = c->len - (size_t)(b - c->buf);
    char *out = malloc(bl + 1);
    if (!out) return NULL;
    size_t hl = (size_t)(hend - c->buf);
    char *hdr = strndup(c->buf, hl);
    bool chunked = hdr && find_ci(hdr, "\r\ntransfer-encoding: chunked");
    free(hdr);
    if (!chunked) {
        memcpy(out, b, bl);
        out[bl] = '\0';
        return out;
    }
    size_t o = 0;
    const char *p = b, *end = b + bl;
    while (p < end) {
        char *after;
        unsigned long sz = strtoul(p, &after, 16);
        const char *nl = strstr(p, "\r\n");
        if (!nl || after == p || sz == 0 || nl + 2 + sz > end) break;
        memcpy(out + o, nl + 2, sz);
        o += sz;
        p = nl + 2 + sz + 2;
    }
    out[o] = '\0';
    return out;
}

int cl_http(int port, const char *method, const char *path, const char *body, int timeout_ms,
            char **out_body, char *retry_after)
{
    if (out_body) *out_body = NULL;
    if (retry_after) retry_after[0] = '\0';
    cl_conn c;
    if (cl_conn_open(&c, port, method, path, NULL, body, false) < 0) return -1;
    int64_t deadline = pd_now_ns() + (int64_t)timeout_ms * PD_NS_PER_MS;
    while (c.fd >= 0) {
        int left = (int)((deadline - pd_now_ns()) / PD_NS_PER_MS);
        if (left <= 0) break;
        cl_conn_poll(&c, 1, left, 0);
    }
    int st = c.eof ? c.status : -1;
    if (st > 0 && out_body) *out_body = cl_conn_body(&c);
    if (st > 0 && retry_after) cl_conn_header(&c, "Retry-After", retry_after, 16);
    cl_conn_close(&c);
    return st > 0 ? st : -1;
}

double cl_metric(const char *metrics, const char *prefix, double def)
{
    size_t pl = strlen(prefix);
    for (const char *p = metrics; p && *p;) {
        if (strncmp(p, prefix, pl) == 0) return atof(p + pl);
        p = strchr(p, '\n');
        if (p) p++;
    }
    return def;
}

/* pd:instance_up of node k of c in the exposition text m (-1 when it has no such line). */
static double instance_up(const cl_cluster *c, const char *m, int k)
{
    char prefix[160];
    snprintf(prefix, sizeof prefix, "pd:instance_up{role=\"%s\",instance=\"127.0.0.1:%d\"} ",
             k < c->n_prefill ? "prefill" : "decode", c->ports[k]);
    return cl_metric(m, prefix, -1);
}

bool cl_wait_instance(const cl_cluster *c, int port, int k, double want, int timeout_ms)
{
    int lo = k < 0 ? 0 : k, hi = k < 0 ? c->n_prefill + c->n_decode : k + 1;
    int64_t deadline = pd_now_ns() + (int64_t)CL_MS(timeout_ms) * PD_NS_PER_MS;
    while (pd_now_ns() < deadline) {
        char *m = NULL; /* one /metrics read a poll, for every node asked about */
        bool all = cl_http(port, "GET", "/metrics", NULL, 5000, &m, NULL) == 200;
        for (int i = lo; all && i < hi; i++) all = instance_up(c, m, i) == want;
        free(m);
        if (all) return true;
        pd_sleep_ns(100 * PD_NS_PER_MS);
    }
    return false;
}

double cl_time_scale(void)
{
    const char *e = getenv("PD_TEST_TIME_SCALE");
    double f = e ? atof(e) : 1.0;
    return f > 1.0 ? f : 1.0;
}

long cl_status_kb(pid_t pid, const char *field)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    long kb = -1;
    size_t n = strlen(field);
    while (fgets(line, sizeof line, f))
        if (strncmp(line, field, n) == 0 && line[n] == ':' &&
            sscanf(line + n + 1, " %ld kB", &kb) == 1)
            break;
    fclose(f);
    return kb;
}

long cl_rss_kb(pid_t pid)
{
    return cl_status_kb(pid, "VmRSS");
}

int cl_fd_count(pid_t pid)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
    DIR *d = opendir(path);
    if (!d) return -1;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

int cl_sse_events(char *body, char **ev, int cap)
{
    int n = 0;
    char *p = body;
    while (*p && n < cap) {
        if (strncmp(p, "data: ", 6) != 0) return -1;
        p += 6;
        char *end = strstr(p, "\n\n");
        if (!end) return -1;
        *end = '\0';
        ev[n++] = p;
        p = end + 2;
    }
    return *p ? -1 : n;
}
