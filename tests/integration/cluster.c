/* Integration-test harness (see cluster.h). */
#define _XOPEN_SOURCE 700
#include "cluster.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "ranktable/ranktable.h"
#include "rpc/pd_msg.h"
#include "util/clock.h"

extern char **environ;

const char *cl_bin(const char *rel)
{
    static _Thread_local char buf[1024];
    const char *root = getenv("PD_BUILD_ROOT");
    snprintf(buf, sizeof buf, "%s/%s", root ? root : "build", rel);
    return buf;
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
    int rc = posix_spawn(pid, argv[0], &fa, NULL, argv, env);
    posix_spawn_file_actions_destroy(&fa);
    free(env);
    return rc == 0 ? 0 : -1;
}

/* waitpid with a deadline: the exit status, or -2 when still running at the deadline. */
static int wait_until(pid_t pid, int64_t deadline_ns)
{
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

void cl_dump_log(const cl_proc *p, int lines)
{
    char cmd[700];
    printf("    --- last %d lines of %s (%s) ---\n", lines, p->name, p->log);
    fflush(stdout);
    snprintf(cmd, sizeof cmd, "tail -n %d '%s' | sed 's/^/    | /'", lines, p->log);
    int rc = system(cmd);
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
        char *env[] = {genv, lenv, NULL};
        int rc = cl_spawn(&c->procs[k], prefill ? "pd-prefill" : "pd-decode", nargv, env, log);
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
    /* wait until every node answers Info (model load included) */
    int64_t deadline = pd_now_ns() + 60 * PD_NS_PER_S;
    for (int k = 0; k < c->n_prefill + c->n_decode; k++) {
        for (;;) {
            Pd__InfoRequest q = PD__INFO_REQUEST__INIT;
            int st;
            ProtobufCMessage *r =
                cl_call(c->ch[k], "/pd.PD/Info", &q.base, &pd__info_reply__descriptor, 1000, &st);
            if (r) {
                protobuf_c_message_free_unpacked(r, NULL);
                break;
            }
            int status;
            if (waitpid(c->procs[k].pid, &status, WNOHANG) == c->procs[k].pid) {
                c->procs[k].pid = 0;
                cl_dump_log(&c->procs[k], 20);
                return pd_error(PD_EINTERNAL, "node %d exited during start-up", k);
            }
            if (pd_now_ns() > deadline) {
                cl_dump_log(&c->procs[k], 20);
                return pd_error(PD_ETIMEOUT, "node %d did not answer Info within 60 s", k);
            }
            pd_sleep_ns(50 * PD_NS_PER_MS);
        }
    }
    return PD_OK;
}

int cl_stop_all(cl_cluster *c)
{
    int bad = 0;
    for (int k = 0; k < 16; k++)
        if (c->ch[k]) pd_rpc_channel_destroy(c->ch[k]);
    if (c->client) pd_rpc_client_destroy(c->client);
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
    memset(out, 0, sizeof *out);
    int st = 0;
    /* the decode instance's ranks */
    Pd__InfoRequest iq = PD__INFO_REQUEST__INIT;
    Pd__InfoReply *info = (Pd__InfoReply *)cl_call(c->ch[dk], "/pd.PD/Info", &iq.base,
                                                   &pd__info_reply__descriptor, 5000, &st);
    if (!info) goto fail;
    Pd__ReserveRequest rq = PD__RESERVE_REQUEST__INIT;
    rq.request_id = (char *)id;
    rq.num_prompt_tokens = (int64_t)n_prompt;
    rq.ttl_ms = 30000;
    Pd__ReserveReply *rr = (Pd__ReserveReply *)cl_call(c->ch[dk], "/pd.PD/Reserve", &rq.base,
                                                       &pd__reserve_reply__descriptor, 5000, &st);
    if (!rr) {
        pd__info_reply__free_unpacked(info, NULL);
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
    Pd__SamplingParams greedy = PD__SAMPLING_PARAMS__INIT;
    if (!sampling) {
        greedy.n = 1;
        greedy.top_p = 1;
        greedy.repetition_penalty = 1;
        greedy.logprobs = -1;
        greedy.max_tokens = 16;
        greedy.skip_special_tokens = true;
        sampling = &greedy;
    }
    Pd__PrefillRequest pq = PD__PREFILL_REQUEST__INIT;
    pq.request_id = (char *)id;
    pq.prompt_ids = (int32_t *)prompt;
    pq.n_prompt_ids = n_prompt;
    pq.sampling = (Pd__SamplingParams *)sampling;
    pq.targets = tp;
    pq.n_targets = info->n_ranks;
    pq.decode_block_ids = rr->block_ids;
    pq.n_decode_block_ids = rr->n_block_ids;
    pq.lease_ms = 10000;
    Pd__PrefillReply *pr = (Pd__PrefillReply *)cl_call(c->ch[pk], "/pd.PD/Prefill", &pq.base,
                                                       &pd__prefill_reply__descriptor, 30000, &st);
    pd__info_reply__free_unpacked(info, NULL);
    pd__reserve_reply__free_unpacked(rr, NULL);
    if (!pr) goto fail;
    out->t_first = pd_now_s();
    append_event(out, pr->first);
    bool final = pr->first->final;
    uint64_t seed = pr->seed;
    int32_t first = pr->first->n_token_ids ? pr->first->token_ids[0] : -1;
    pd__prefill_reply__free_unpacked(pr, NULL);
    if (final) return out->status ? PD_EINTERNAL : PD_OK;
    Pd__SamplingParams ds = *sampling;
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
fail:
    out->status = st ? st : PD_RPC_INTERNAL;
    snprintf(out->error, sizeof out->error, "%s", pd_last_error());
    return pd_error(PD_EINTERNAL, "%s", out->error);
}

int cl_reference(const char *model, const int32_t *const *prompts, const size_t *n_prompt, size_t n,
                 int max_tokens, double temperature, int64_t seed, const char *dir, cl_result *out)
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
                    NULL};
    int st = cl_run(argv, json, 300);
    if (st != 0) return pd_error(PD_EINTERNAL, "pd-generate exited with %d (see %s)", st, json);
    f = fopen(json, "r");
    char line[65536];
    size_t k = 0;
    while (f && k < n && fgets(line, sizeof line, f)) {
        if (line[0] != '{') continue; /* log lines */
        json_error_t err;
        json_t *o = json_loads(line, 0, &err);
        if (!o) continue;
        memset(&out[k], 0, sizeof out[k]);
        json_t *toks = json_object_get(o, "token_ids");
        for (size_t i = 0; i < json_array_size(toks) && i < 4096; i++)
            out[k].tokens[out[k].n++] = (int32_t)json_integer_value(json_array_get(toks, i));
        const char *fin = json_string_value(json_object_get(o, "finish_reason"));
        const char *txt = json_string_value(json_object_get(o, "text"));
        snprintf(out[k].finish, sizeof out[k].finish, "%s", fin ? fin : "");
        snprintf(out[k].text, sizeof out[k].text, "%s", txt ? txt : "");
        json_decref(o);
        k++;
    }
    if (f) fclose(f);
    if (k != n)
        return pd_error(PD_EINTERNAL, "pd-generate printed %zu results for %zu prompts", k, n);
    return PD_OK;
}
