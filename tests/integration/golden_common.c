/* The golden tests' fixture and helpers (declared in golden.h): the tiny model's 1P1D cluster
 * with its pd-scheduler processes (main, generation_config.json model dir B in two modes,
 * metrics, legacy), started on first use and stopped by zz_shutdown; one request per
 * connection over cl_conn; the request helpers that several test files share. */
#define _GNU_SOURCE
#include "golden.h"

#include <ctype.h>
#include <dirent.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

cl_cluster g_c;
cl_proc g_dead, g_tmpl;
static cl_proc g_main, g_gen, g_genvllm, g_metrics, g_legacy;
int g_port, g_port_gen, g_port_genvllm, g_port_metrics, g_port_legacy;
bool g_ready;
static bool g_failed;
char g_model[512];
static char g_model_gen[600];
int g_eos = -1, g_extra_eos = -1;

/* Every process of the test: SIGKILL (a start-up that failed half-way). cluster.c does the same
 * at exit and on SIGTERM/SIGINT. */
static void kill_children(void)
{
    for (int k = 0; k < 16; k++)
        if (g_c.procs[k].pid > 0) kill(g_c.procs[k].pid, SIGKILL);
    cl_proc *s[] = {&g_main, &g_gen, &g_genvllm, &g_metrics, &g_legacy, &g_dead, &g_tmpl};
    for (size_t i = 0; i < sizeof s / sizeof *s; i++)
        if (s[i]->pid > 0) kill(s[i]->pid, SIGKILL);
}

int sched_spawn(cl_proc *p, const char *name, const char *use_openai, const char *node_ports,
                const char *model, char *const extra[], int *port)
{
    char genv[700], penv[256], uenv[32], port_s[16], log[700], bin[1024];
    snprintf(genv, sizeof genv, "GLOBAL_RANK_TABLE_FILE_PATH=%s", g_c.global);
    if (node_ports)
        snprintf(penv, sizeof penv, "NODE_PORTS=%s", node_ports);
    else
        snprintf(penv, sizeof penv, "NODE_PORTS=%d,%d", g_c.ports[0], g_c.ports[1]);
    snprintf(uenv, sizeof uenv, "USE_OPENAI=%s", use_openai);
    char *env[] = {genv, penv, "RANK_TABLE_FILE_PATH=", "VLLM_API_KEY=", uenv, NULL};
    *port = cl_free_port();
    snprintf(port_s, sizeof port_s, "%d", *port);
    snprintf(log, sizeof log, "%s/%s.log", g_c.dir, name);
    snprintf(bin, sizeof bin, "%s", cl_bin("scheduler/pd-scheduler"));
    char len[16];
    snprintf(len, sizeof len, "%d", L_MAIN);
    char *argv[32] = {bin,
                      "--model",
                      (char *)(model ? model : g_model),
                      "--port",
                      port_s,
                      "--host",
                      "127.0.0.1",
                      "--served-model-name",
                      "tiny",
                      "--max-model-len",
                      len};
    int a = 11;
    for (int i = 0; extra && extra[i] && a < 31; i++) argv[a++] = extra[i];
    argv[a] = NULL;
    return cl_spawn(p, name, argv, env, log);
}

int wait_status(int port, const char *path, int want, int timeout_s)
{
    int64_t deadline = pd_now_ns() + (int64_t)timeout_s * PD_NS_PER_S;
    int st = -1;
    while (pd_now_ns() < deadline) {
        st = cl_http(port, "GET", path, NULL, 2000, NULL, NULL);
        if (st > 0 && (want == 0 || st == want)) return st;
        pd_sleep_ns(100 * PD_NS_PER_MS);
    }
    return st;
}

int write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    int ok = fputs(text, f) >= 0;
    return (fclose(f) == 0 && ok) ? 0 : -1;
}

/* The primary EOS id (tokenizer_config.json eos_token, looked up in tokenizer.json's
 * added_tokens) and the first other id of generation_config.json's eos_token_id. */
static bool read_eos_ids(void)
{
    char path[700];
    snprintf(path, sizeof path, "%s/tokenizer_config.json", g_model);
    json_t *tc = json_load_file(path, 0, NULL);
    snprintf(path, sizeof path, "%s/tokenizer.json", g_model);
    json_t *tj = json_load_file(path, 0, NULL);
    snprintf(path, sizeof path, "%s/generation_config.json", g_model);
    json_t *gc = json_load_file(path, 0, NULL);
    bool ok = false;
    const char *eos = tc ? json_string_value(json_object_get(tc, "eos_token")) : NULL;
    size_t i;
    json_t *t;
    if (eos && tj) json_array_foreach(json_object_get(tj, "added_tokens"), i, t)
        {
            if (strcmp(json_string_value(json_object_get(t, "content")), eos) == 0)
                g_eos = (int)json_integer_value(json_object_get(t, "id"));
        }
    json_t *ids = gc ? json_object_get(gc, "eos_token_id") : NULL;
    json_array_foreach(ids, i, t)
    {
        if ((int)json_integer_value(t) != g_eos && g_extra_eos < 0)
            g_extra_eos = (int)json_integer_value(t);
    }
    ok = g_eos >= 0 && g_extra_eos >= 0;
    json_decref(tc);
    json_decref(tj);
    json_decref(gc);
    return ok;
}

bool model_like(const char *name, const char *const *skip, char *out, size_t n)
{
    snprintf(out, n, "%s/%s", pdt_tmp_dir(), name);
    if (mkdir(out, 0755) != 0) return false;
    DIR *d = opendir(g_model);
    if (!d) return false;
    bool ok = true;
    for (struct dirent *e = readdir(d); e && ok; e = readdir(d)) {
        if (e->d_name[0] == '.') continue;
        bool skipped = false;
        for (size_t i = 0; skip && skip[i]; i++) skipped |= strcmp(skip[i], e->d_name) == 0;
        if (skipped) continue;
        char from[1200], to[1200];
        snprintf(from, sizeof from, "%s/%s", g_model, e->d_name);
        snprintf(to, sizeof to, "%s/%s", out, e->d_name);
        ok = symlink(from, to) == 0;
    }
    closedir(d);
    return ok;
}

/* Model directory B for the schedulers: the tiny model with its own generation_config.json
 * (§7.1 overrides and max_new_tokens). */
static bool make_model_gen(void)
{
    static const char *const skip[] = {"generation_config.json", NULL};
    if (!model_like("tiny_gen", skip, g_model_gen, sizeof g_model_gen)) return false;
    char path[800], text[512];
    snprintf(path, sizeof path, "%s/generation_config.json", g_model_gen);
    snprintf(text, sizeof text,
             "{\"eos_token_id\":[%d,%d],\"temperature\":0.6,\"top_p\":0.9,\"top_k\":50,"
             "\"do_sample\":true,\"max_new_tokens\":%d}\n",
             g_eos, g_extra_eos, GEN_CAP);
    return write_file(path, text) == 0;
}

bool fixture(void)
{
    if (g_ready || g_failed) return g_ready;
    g_failed = true;
    if (cl_make_tiny(g_model, sizeof g_model) < 0) return false;
    if (!read_eos_ids() || !make_model_gen()) {
        printf("    cannot read the EOS ids or write model dir B\n");
        return false;
    }
    if (cl_start(&g_c, g_model, "0", "1", NULL) < 0) {
        printf("    cl_start: %s\n", pd_last_error());
        cl_stop_all(&g_c);
        return false;
    }
    char lim[16], len[16];
    snprintf(lim, sizeof lim, "%d", BODY_LIMIT);
    snprintf(len, sizeof len, "%d", L_MAIN);
    char *main_args[] = {
        "--max-model-len",     len,          "--max-request-body-bytes",      lim,
        "--served-model-name", "tiny-alias", "--trust-request-chat-template", NULL};
    char *metrics_args[] = {"--max-model-len", len, NULL};
    char *vllm_args[] = {"--max-model-len", len, "--generation-config", "vllm", NULL};
    bool ok = cl_sched_start(&g_c, &g_main, "sched_main", main_args, &g_port) == 0 &&
              cl_sched_start(&g_c, &g_metrics, "sched_metrics", metrics_args, &g_port_metrics) == 0;
    /* B: same cluster, the scheduler reads model dir B (generation_config.json) */
    char saved[sizeof g_c.model];
    memcpy(saved, g_c.model, sizeof saved);
    snprintf(g_c.model, sizeof g_c.model, "%.299s", g_model_gen);
    ok = ok && cl_sched_start(&g_c, &g_gen, "sched_gen", metrics_args, &g_port_gen) == 0 &&
         cl_sched_start(&g_c, &g_genvllm, "sched_genvllm", vllm_args, &g_port_genvllm) == 0;
    memcpy(g_c.model, saved, sizeof saved);
    ok = ok && sched_spawn(&g_legacy, "sched_legacy", "0", NULL, NULL, NULL, &g_port_legacy) == 0 &&
         wait_status(g_port_legacy, "/health", 200, 30) == 200;
    if (!ok) {
        printf("    %s\n", pd_last_error());
        kill_children();
        cl_stop_all(&g_c);
        return false;
    }
    g_failed = false;
    g_ready = true;
    return true;
}

int fixture_stop(void)
{
    int bad = 0;
    cl_proc *s[] = {&g_main, &g_gen, &g_genvllm, &g_metrics, &g_legacy};
    for (size_t i = 0; i < sizeof s / sizeof *s; i++) {
        int st = cl_stop(s[i], 10000);
        if (st != 0) {
            cl_dump_log(s[i], 30);
            bad++;
        }
    }
    bad += cl_stop_all(&g_c);
    g_ready = false;
    return bad;
}

/* ---- HTTP helpers ------------------------------------------------------------------------- */

void resp_free(resp *r)
{
    free(r->body);
    r->body = NULL;
    cl_conn_close(&r->conn); /* also frees the received bytes */
}

void conn_hangup(cl_conn *c)
{
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
}

int req(int port, const char *method, const char *path, const char *headers, const char *body,
        resp *r)
{
    memset(r, 0, sizeof *r);
    if (cl_conn_open(&r->conn, port, method, path, headers, body, false) < 0) return -1;
    bool done = cl_conn_wait_all(&r->conn, 1, REQ_TIMEOUT_MS);
    /* [DONE] can arrive before the terminating chunk: read until EOF */
    int64_t deadline = pd_now_ns() + 5 * PD_NS_PER_S;
    while (!r->conn.eof && r->conn.fd >= 0 && pd_now_ns() < deadline)
        cl_conn_poll(&r->conn, 1, 100, 0);
    conn_hangup(&r->conn);
    r->status = r->conn.status;
    r->body = cl_conn_body(&r->conn);
    return done && r->body ? 0 : -1;
}

int post(int port, const char *path, const char *body, resp *r)
{
    return req(port, "POST", path, NULL, body, r);
}

const char *hdr(const resp *r, const char *name, char *buf, size_t n)
{
    return cl_conn_header(&r->conn, name, buf, n);
}

bool is_hex_id(const char *s, const char *prefix)
{
    size_t pl = strlen(prefix);
    if (!s || strncmp(s, prefix, pl) != 0 || strlen(s) != pl + 32) return false;
    for (size_t i = pl; s[i]; i++)
        if (!isdigit((unsigned char)s[i]) && !(s[i] >= 'a' && s[i] <= 'f')) return false;
    return true;
}

char *jstr(const char *s)
{
    json_t *v = json_string(s);
    char *out = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    json_decref(v);
    return out;
}

const char *choice_text(json_t *o, size_t i)
{
    json_t *c = json_array_get(json_object_get(o, "choices"), i);
    json_t *t = json_object_get(c, "text");
    if (!t) t = json_object_get(json_object_get(c, "message"), "content");
    if (!t) t = json_object_get(json_object_get(c, "delta"), "content");
    return json_string_value(t);
}

int64_t usage_of(json_t *o, const char *key)
{
    return json_integer_value(json_object_get(json_object_get(o, "usage"), key));
}

json_t *post_ok(int port, const char *path, const char *body)
{
    resp r;
    if (post(port, path, body, &r) != 0 || r.status != 200) {
        printf("    %s %s -> %d %s\n", path, body, r.status, r.body ? r.body : "");
        resp_free(&r);
        return NULL;
    }
    json_t *o = json_loads(r.body, JSON_ALLOW_NUL, NULL); /* a token's text may be U+0000 */
    resp_free(&r);
    return o;
}

/* ---- request helpers ------------------------------------------------------------------------ */

int stream_events(int port, const char *path, const char *body, json_t **ev, int cap,
                  bool *done_last)
{
    resp r;
    if (post(port, path, body, &r) != 0 || r.status != 200) {
        printf("    %s -> %d %s\n", body, r.status, r.body ? r.body : "");
        resp_free(&r);
        return -1;
    }
    char *raw[256];
    int n = cl_sse_events(r.body, raw, 256);
    int k = 0;
    *done_last = n > 0 && strcmp(raw[n - 1], "[DONE]") == 0;
    for (int i = 0; i < n && k < cap; i++) {
        if (strcmp(raw[i], "[DONE]") == 0) continue;
        ev[k] = json_loads(raw[i], JSON_ALLOW_NUL, NULL);
        if (!ev[k]) break;
        k++;
    }
    resp_free(&r);
    return n < 0 ? -1 : k;
}

void free_events(json_t **ev, int n)
{
    for (int i = 0; i < n; i++) json_decref(ev[i]);
}

int64_t completion_tokens(int port, const char *path, const char *body, char *fr, size_t frn,
                          char *text, size_t tn)
{
    json_t *o = post_ok(port, path, body);
    if (!o) return -1;
    json_t *c = json_array_get(json_object_get(o, "choices"), 0);
    if (fr) snprintf(fr, frn, "%s", json_string_value(json_object_get(c, "finish_reason")));
    if (text) snprintf(text, tn, "%s", choice_text(o, 0));
    int64_t ct = usage_of(o, "completion_tokens");
    json_decref(o);
    return ct;
}

int token_id_of(const char *s)
{
    int id = -1;
    if (!s || sscanf(s, "token_id:%d", &id) != 1) return -1;
    return id;
}

void response_ids(json_t *o, char *out, size_t n)
{
    json_t *lp = json_object_get(json_array_get(json_object_get(o, "choices"), 0), "logprobs");
    json_t *toks = json_object_get(lp, "tokens");
    out[0] = '\0';
    size_t i;
    json_t *v;
    if (toks) {
        json_array_foreach(toks, i, v)
            snprintf(out + strlen(out), n - strlen(out), "%d,", token_id_of(json_string_value(v)));
    } else {
        json_array_foreach(json_object_get(lp, "content"), i, v)
            snprintf(out + strlen(out), n - strlen(out), "%d,",
                     token_id_of(json_string_value(json_object_get(v, "token"))));
    }
}

bool numpy_greedy(const char *model, const char *prompt_ids, int steps, char *want, size_t wn)
{
    const char *root = getenv("PD_SOURCE_ROOT");
    char path[700];
    snprintf(path, sizeof path, "%s/numpy_ref.json", pdt_tmp_dir());
    size_t cl = strlen(prompt_ids) + strlen(model) + 1536;
    char *cmd = malloc(cl);
    snprintf(cmd, cl,
             "/usr/bin/python3 '%s/tests/reference/llama_ref.py' --model '%s' --prompt-ids %s "
             "--steps %d --out '%s'",
             root ? root : ".", model, prompt_ids, steps, path);
    int rc = system(cmd);
    free(cmd);
    json_t *ref = rc == 0 ? json_load_file(path, 0, NULL) : NULL;
    json_t *ids = json_object_get(ref, "greedy_tokens");
    if (!json_is_array(ids)) {
        snprintf(want, wn, "llama_ref.py on %s failed (exit %d) or printed no greedy_tokens", model,
                 rc);
        json_decref(ref);
        return false;
    }
    want[0] = '\0';
    size_t k;
    json_t *v;
    json_array_foreach(ids, k, v)
        snprintf(want + strlen(want), wn - strlen(want), "%d,", (int)json_integer_value(v));
    json_decref(ref);
    return true;
}

/* GPT-2 byte-level table: the vocabulary string of byte b (UTF-8, into out). */
static void byte_piece(unsigned b, char *out)
{
    unsigned cp = b;
    if (!((b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae))) {
        unsigned n = 0;
        for (unsigned x = 0; x < b; x++)
            if (!((x >= 0x21 && x <= 0x7e) || (x >= 0xa1 && x <= 0xac) || (x >= 0xae))) n++;
        cp = 256 + n;
    }
    if (cp < 0x80) {
        out[0] = (char)cp, out[1] = 0;
    } else {
        out[0] = (char)(0xC0 | (cp >> 6)), out[1] = (char)(0x80 | (cp & 0x3F)), out[2] = 0;
    }
}

int byte_token(unsigned b)
{
    char path[700], piece[4];
    snprintf(path, sizeof path, "%s/tokenizer.json", g_model);
    json_t *t = json_load_file(path, 0, NULL);
    byte_piece(b, piece);
    json_t *id = json_object_get(json_object_get(json_object_get(t, "model"), "vocab"), piece);
    int r = json_is_integer(id) ? (int)json_integer_value(id) : -1;
    json_decref(t);
    return r;
}

char *get_metrics(int port)
{
    resp r;
    if (req(port, "GET", "/metrics", NULL, NULL, &r) != 0 || r.status != 200) {
        resp_free(&r);
        return NULL;
    }
    char h[128];
    const char *ct = hdr(&r, "Content-Type", h, sizeof h);
    bool ok = ct && strcmp(ct, "text/plain; version=0.0.4; charset=utf-8") == 0;
    char *body = r.body;
    r.body = NULL;
    resp_free(&r);
    if (!ok) {
        free(body);
        return NULL;
    }
    return body;
}

void prompt40_body(char *body, size_t n, int base, const char *rest)
{
    size_t o = (size_t)snprintf(body, n, "{\"prompt\":[");
    for (int i = 0; i < 40; i++)
        o += (size_t)snprintf(body + o, n - o, "%s%d", i ? "," : "", base + 7 * i);
    snprintf(body + o, n - o, "],%s}", rest);
}
