/* Golden tests of /v1/models, /health and /metrics (§15, §16): §18.39 (/v1/models byte for
 * byte, /health 503 at start-up) and §18.40 (a strict parser of the text exposition format,
 * every series at start-up, exact counts after known traffic, KV bytes, prefix caching). */
#define _GNU_SOURCE
#include "golden.h"

#include <stdlib.h>
#include <time.h>

/* ---- /v1/models, /health, /metrics (§15, §16) -------------------------------------------- */

/* §18.39: /v1/models byte for byte (times and permission ids masked after checking them). */
TEST(golden_39_models_exact)
{
    FIXTURE();
    resp r;
    int64_t t0 = (int64_t)time(NULL);
    ASSERT(req(g_port, "GET", "/v1/models", NULL, NULL, &r) == 0);
    int64_t t1 = (int64_t)time(NULL);
    ASSERT_EQ_INT(r.status, 200);
    char h[128];
    ASSERT_STR_EQ(hdr(&r, "Content-Type", h, sizeof h), "application/json");
    json_t *o = json_loads(r.body, 0, NULL);
    ASSERT(o);
    json_t *data = json_object_get(o, "data");
    ASSERT_EQ_INT(json_array_size(data), 2);
    char want[4096];
    size_t at = (size_t)snprintf(want, sizeof want, "{\"object\":\"list\",\"data\":[");
    static const char *const names[] = {"tiny", "tiny-alias"};
    bool ok = true;
    for (size_t i = 0; i < 2; i++) {
        json_t *card = json_array_get(data, i);
        json_t *perm = json_array_get(json_object_get(card, "permission"), 0);
        int64_t created = json_integer_value(json_object_get(card, "created"));
        int64_t pcreated = json_integer_value(json_object_get(perm, "created"));
        const char *pid = json_string_value(json_object_get(perm, "id"));
        ok &= created >= t0 - 1 && created <= t1 + 1 && pcreated >= t0 - 1 && pcreated <= t1 + 1 &&
              is_hex_id(pid, "modelperm-");
        at += (size_t)snprintf(
            want + at, sizeof want - at,
            "%s{\"id\":\"%s\",\"object\":\"model\",\"created\":%lld,\"owned_by\":\"vllm\","
            "\"root\":\"%s\",\"parent\":null,\"max_model_len\":%d,\"permission\":[{\"id\":"
            "\"%s\",\"object\":\"model_permission\",\"created\":%lld,"
            "\"allow_create_engine\":false,\"allow_sampling\":true,\"allow_logprobs\":true,"
            "\"allow_search_indices\":false,\"allow_view\":true,\"allow_fine_tuning\":false,"
            "\"organization\":\"*\",\"group\":null,\"is_blocking\":false}]}",
            i ? "," : "", names[i], (long long)created, g_model, L_MAIN, pid ? pid : "",
            (long long)pcreated);
    }
    snprintf(want + at, sizeof want - at, "]}");
    json_decref(o);
    bool same = strcmp(r.body, want) == 0;
    if (!same) printf("    got  %s\n    want %s\n", r.body, want);
    resp_free(&r);
    ASSERT(ok);
    ASSERT(same);
    /* a fresh permission id on every call */
    ASSERT(req(g_port, "GET", "/v1/models", NULL, NULL, &r) == 0);
    bool fresh = r.body && strstr(want, "modelperm-") &&
                 strncmp(strstr(r.body, "modelperm-"), strstr(want, "modelperm-"), 42) != 0;
    resp_free(&r);
    ASSERT(fresh);
}

/* §18.39: /health is an empty 503 while no instance is in the routing set (start-up), and
 * /metrics shows pd:instance_up 0 for both. The scheduler is pointed at ports nobody serves. */
TEST(golden_39_health_503_startup)
{
    FIXTURE();
    char ports[64];
    int dead0 = cl_free_port(), dead1 = cl_free_port(), port;
    snprintf(ports, sizeof ports, "%d,%d", dead0, dead1);
    ASSERT(sched_spawn(&g_dead, "sched_dead", "1", ports, NULL, NULL, &port) == 0);
    bool answered = wait_status(port, "/health", 0, 20) > 0;
    resp r = {.conn = {.fd = -1}};
    answered = answered && req(port, "GET", "/health", NULL, NULL, &r) == 0;
    int st = r.status;
    char h[64] = "";
    hdr(&r, "Content-Length", h, sizeof h);
    size_t blen = r.body ? strlen(r.body) : 1;
    resp_free(&r);
    char *m = NULL;
    int mst = cl_http(port, "GET", "/metrics", NULL, 5000, &m, NULL);
    char pre[128];
    snprintf(pre, sizeof pre, "pd:instance_up{role=\"decode\",instance=\"127.0.0.1:%d\"} ", dead1);
    double up = m ? cl_metric(m, pre, -1) : -1;
    free(m);
    int stop = cl_stop(&g_dead, 10000);
    ASSERT(answered);
    ASSERT_EQ_INT(st, 503);
    ASSERT_STR_EQ(h, "0");
    ASSERT_EQ_INT(blen, 0);
    ASSERT_EQ_INT(mst, 200);
    ASSERT_NEAR(up, 0.0, 1e-9);
    ASSERT_EQ_INT(stop, 0);
}

/* ---- /metrics: a strict parser of the text exposition format ------------------------------ */

typedef struct {
    char name[96];    /* sample name */
    char labels[256]; /* label text between the braces */
    char value[32];   /* as written */
} sample;

typedef struct {
    char name[96], type[16];
    bool help;
    sample *s;
    int ns, cap;
} family;

typedef struct {
    family f[64];
    int nf;
    char err[256];
} expo;

static void expo_free(expo *e)
{
    for (int i = 0; i < e->nf; i++) free(e->f[i].s);
}

static family *expo_family(expo *e, const char *name)
{
    for (int i = 0; i < e->nf; i++)
        if (strcmp(e->f[i].name, name) == 0) return &e->f[i];
    return NULL;
}

/* Parses Prometheus text exposition 0.0.4: "# HELP n text", "# TYPE n type", then samples
 * "name{labels} value" that belong to that family (name, or name_bucket/_count/_sum for a
 * histogram). Returns false with e->err on the first violation. */
static bool expo_parse(const char *text, expo *e)
{
    memset(e, 0, sizeof *e);
    family *cur = NULL;
    const char *p = text;
    while (*p) {
        const char *nl = strchr(p, '\n');
        if (!nl) {
            snprintf(e->err, sizeof e->err, "last line without a newline");
            return false;
        }
        char line[512];
        snprintf(line, sizeof line, "%.*s", (int)(nl - p), p);
        p = nl + 1;
        if (strncmp(line, "# HELP ", 7) == 0) {
            if (e->nf == 64) return false;
            cur = &e->f[e->nf++];
            sscanf(line + 7, "%95s", cur->name);
            cur->help = true;
            if (expo_family(e, cur->name) != cur) {
                snprintf(e->err, sizeof e->err, "family %s twice", cur->name);
                return false;
            }
            continue;
        }
        if (strncmp(line, "# TYPE ", 7) == 0) {
            char nm[96];
            if (!cur || sscanf(line + 7, "%95s %15s", nm, cur->type) != 2 ||
                strcmp(nm, cur->name) != 0 || cur->ns) {
                snprintf(e->err, sizeof e->err, "TYPE without its HELP: %.160s", line);
                return false;
            }
            continue;
        }
        if (line[0] == '#' || !cur || !cur->type[0]) {
            snprintf(e->err, sizeof e->err, "sample or comment outside a family: %.160s", line);
            return false;
        }
        sample s;
        memset(&s, 0, sizeof s);
        const char *brace = strchr(line, '{'), *sp = strrchr(line, ' ');
        if (!sp) {
            snprintf(e->err, sizeof e->err, "no value: %.160s", line);
            return false;
        }
        if (brace && brace < sp) {
            const char *close = strstr(brace, "} ");
            if (!close) {
                snprintf(e->err, sizeof e->err, "bad labels: %.160s", line);
                return false;
            }
            snprintf(s.name, sizeof s.name, "%.*s", (int)(brace - line), line);
            snprintf(s.labels, sizeof s.labels, "%.*s", (int)(close - brace - 1), brace + 1);
        } else {
            snprintf(s.name, sizeof s.name, "%.*s", (int)(sp - line), line);
        }
        snprintf(s.value, sizeof s.value, "%s", sp + 1);
        char *end;
        strtod(s.value, &end);
        if (*end || (!strchr(s.value, '.') && !strchr(s.value, 'e') && !strstr(s.value, "Inf") &&
                     !strstr(s.value, "NaN"))) {
            snprintf(e->err, sizeof e->err, "value not a float: %.160s", line);
            return false;
        }
        size_t fl = strlen(cur->name);
        bool belongs = strcmp(s.name, cur->name) == 0;
        if (strcmp(cur->type, "histogram") == 0)
            belongs = strncmp(s.name, cur->name, fl) == 0 &&
                      (strcmp(s.name + fl, "_bucket") == 0 || strcmp(s.name + fl, "_count") == 0 ||
                       strcmp(s.name + fl, "_sum") == 0);
        if (!belongs) {
            snprintf(e->err, sizeof e->err, "sample %s in family %s", s.name, cur->name);
            return false;
        }
        if (cur->ns == cur->cap) {
            cur->cap = cur->cap ? 2 * cur->cap : 16;
            cur->s = realloc(cur->s, (size_t)cur->cap * sizeof *cur->s);
        }
        cur->s[cur->ns++] = s;
    }
    return true;
}

static const char *const LATENCY_LE[] = {
    "0.3",  "0.5",  "0.8",  "1.0",  "1.5",   "2.0",   "2.5",   "5.0",   "10.0",   "15.0",   "20.0",
    "30.0", "40.0", "50.0", "60.0", "120.0", "240.0", "480.0", "960.0", "1920.0", "7680.0", NULL};
static const char *const TTFT_LE[] = {"0.001", "0.005", "0.01",  "0.02",   "0.04", "0.06",
                                      "0.08",  "0.1",   "0.25",  "0.5",    "0.75", "1.0",
                                      "2.5",   "5.0",   "7.5",   "10.0",   "20.0", "40.0",
                                      "80.0",  "160.0", "640.0", "2560.0", NULL};
static const char *const TPOT_LE[] = {"0.01", "0.025", "0.05", "0.075", "0.1",  "0.15", "0.2",
                                      "0.3",  "0.4",   "0.5",  "0.75",  "1.0",  "2.5",  "5.0",
                                      "7.5",  "10.0",  "20.0", "40.0",  "80.0", NULL};
static const char *const N_LE[] = {"1.0", "2.0", "5.0", "10.0", "20.0", NULL};
/* 1-2-5 up to L = 64 */
static const char *const TOK_LE[] = {"1.0", "2.0", "5.0", "10.0", "20.0", "50.0", NULL};
static const char *const ITER_LE[] = {"1.0",    "8.0",    "16.0",    "32.0",   "64.0",
                                      "128.0",  "256.0",  "512.0",   "1024.0", "2048.0",
                                      "4096.0", "8192.0", "16384.0", NULL};

#define STD_LABELS "model_name=\"tiny\",engine=\"0\""

/* Checks a vllm histogram family: buckets exactly les (then +Inf), _count, _sum, the standard
 * labels; *count and *sum, and the cumulative bucket counts in buckets[] (may be NULL). */
static bool check_hist(expo *e, const char *name, const char *const *les, double *count,
                       double *sum, double *buckets, char *why, size_t wn)
{
    family *f = expo_family(e, name);
    if (!f || strcmp(f->type, "histogram") != 0) {
        snprintf(why, wn, "%s missing or not a histogram", name);
        return false;
    }
    int nle = 0;
    while (les[nle]) nle++;
    if (f->ns != nle + 3) {
        snprintf(why, wn, "%s: %d samples, want %d", name, f->ns, nle + 3);
        return false;
    }
    for (int i = 0; i <= nle; i++) {
        char want[256], sn[128];
        snprintf(want, sizeof want, STD_LABELS ",le=\"%s\"", i < nle ? les[i] : "+Inf");
        snprintf(sn, sizeof sn, "%s_bucket", name);
        if (strcmp(f->s[i].name, sn) != 0 || strcmp(f->s[i].labels, want) != 0) {
            snprintf(why, wn, "%s bucket %d: %s{%.120s}, want {%.120s}", name, i, f->s[i].name,
                     f->s[i].labels, want);
            return false;
        }
        if (buckets) buckets[i] = atof(f->s[i].value);
    }
    char cn[128], sm[128];
    snprintf(cn, sizeof cn, "%s_count", name);
    snprintf(sm, sizeof sm, "%s_sum", name);
    if (strcmp(f->s[nle + 1].name, cn) != 0 || strcmp(f->s[nle + 1].labels, STD_LABELS) != 0 ||
        strcmp(f->s[nle + 2].name, sm) != 0 || strcmp(f->s[nle + 2].labels, STD_LABELS) != 0) {
        snprintf(why, wn, "%s: _count/_sum lines out of order or mislabelled", name);
        return false;
    }
    if (atof(f->s[nle].value) != atof(f->s[nle + 1].value)) {
        snprintf(why, wn, "%s: +Inf bucket != _count", name);
        return false;
    }
    *count = atof(f->s[nle + 1].value);
    *sum = atof(f->s[nle + 2].value);
    return true;
}

/* A gauge or counter family with exactly one sample with the standard labels; its value. */
static bool check_single(expo *e, const char *name, const char *type, double *v, char *why,
                         size_t wn)
{
    family *f = expo_family(e, name);
    if (!f || strcmp(f->type, type) != 0 || f->ns != 1 || strcmp(f->s[0].name, name) != 0 ||
        strcmp(f->s[0].labels, STD_LABELS) != 0) {
        snprintf(why, wn, "%s: missing, not a %s, or not one sample {" STD_LABELS "}", name, type);
        return false;
    }
    *v = atof(f->s[0].value);
    return true;
}

typedef struct {
    double prompt_total, gen_total, ok_stop, ok_length, ok_abort, running, waiting;
    double n_count, n_sum, n_b[8], mt_count, mt_sum, mt_b[8];
    double pt_count, pt_sum, pt_b[8], gt_count, gt_sum, gt_b[8];
    double ttft_count, tpot_count, e2e_count, queue_count, prefill_count, decode_count, infer_count;
    double kv_bytes, kv_count;
    double cache_queries, cache_hits;
    double iter_count, iter_sum, iter_b[16], mg_count, mg_sum, mg_b[8], bo_count, bo_sum, bo_b[8];
    double itl_count, rtpot_count;
} snapshot;

/* vllm:cache_config_info: one series per instance, its KV cache configuration in the labels
 * (the block count as the instance's own Stats give it), value 1. */
static bool check_cache_info(expo *e, char *why, size_t wn)
{
    family *f = expo_family(e, "vllm:cache_config_info");
    if (!f || strcmp(f->type, "gauge") != 0 || f->ns != 2) {
        snprintf(why, wn, "vllm:cache_config_info: missing, not a gauge, or not 2 series");
        return false;
    }
    for (int k = 0; k < 2; k++) {
        Pd__StatsReply *st = cl_stats(&g_c, k);
        char want[400];
        snprintf(want, sizeof want,
                 STD_LABELS ",role=\"%s\",instance=\"127.0.0.1:%d\",block_size=\"16\","
                            "cache_dtype=\"float32\",enable_prefix_caching=\"True\","
                            "num_gpu_blocks=\"%lld\"",
                 k ? "decode" : "prefill", g_c.ports[k],
                 st ? (long long)st->kv_blocks_total : -1LL);
        if (st) pd__stats_reply__free_unpacked(st, NULL);
        if (strcmp(f->s[k].labels, want) != 0 || strcmp(f->s[k].value, "1.0") != 0) {
            snprintf(why, wn, "vllm:cache_config_info: {%.180s} %s, want {%.180s} 1.0",
                     f->s[k].labels, f->s[k].value, want);
            return false;
        }
    }
    return true;
}

/* Every §16 series of the metrics scheduler, with exact names, types, labels and buckets. */
static bool read_snapshot(snapshot *s, char *why, size_t wn)
{
    memset(s, 0, sizeof *s);
    char *text = get_metrics(g_port_metrics);
    if (!text) {
        snprintf(why, wn, "GET /metrics failed or wrong Content-Type");
        return false;
    }
    expo e;
    if (getenv("GOLDEN_DEBUG")) printf("%s", text);
    bool ok = expo_parse(text, &e);
    if (!ok) snprintf(why, wn, "exposition: %s", e.err);
    free(text);
    double d, sum;
    ok = ok && check_single(&e, "vllm:num_requests_running", "gauge", &s->running, why, wn) &&
         check_single(&e, "vllm:num_requests_waiting", "gauge", &s->waiting, why, wn) &&
         check_single(&e, "vllm:kv_cache_usage_perc", "gauge", &d, why, wn) &&
         check_single(&e, "vllm:gpu_cache_usage_perc", "gauge", &d, why, wn) &&
         check_single(&e, "vllm:num_preemptions_total", "counter", &d, why, wn) &&
         check_single(&e, "vllm:prefix_cache_queries_total", "counter", &s->cache_queries, why,
                      wn) &&
         check_single(&e, "vllm:prefix_cache_hits_total", "counter", &s->cache_hits, why, wn) &&
         check_single(&e, "vllm:prompt_tokens_total", "counter", &s->prompt_total, why, wn) &&
         check_single(&e, "vllm:generation_tokens_total", "counter", &s->gen_total, why, wn);
    if (ok) {
        family *f = expo_family(&e, "vllm:request_success_total");
        static const char *const reasons[] = {"stop", "length", "abort"};
        double *vals[] = {&s->ok_stop, &s->ok_length, &s->ok_abort};
        ok = f && strcmp(f->type, "counter") == 0 && f->ns == 3;
        for (int i = 0; ok && i < 3; i++) {
            char want[128];
            snprintf(want, sizeof want, STD_LABELS ",finished_reason=\"%s\"", reasons[i]);
            ok = strcmp(f->s[i].labels, want) == 0 &&
                 strcmp(f->s[i].name, "vllm:request_success_total") == 0;
            *vals[i] = ok ? atof(f->s[i].value) : 0;
        }
        if (!ok) snprintf(why, wn, "vllm:request_success_total: not the three reasons in order");
    }
    ok = ok &&
         check_hist(&e, "vllm:request_prompt_tokens", TOK_LE, &s->pt_count, &s->pt_sum, s->pt_b,
                    why, wn) &&
         check_hist(&e, "vllm:request_generation_tokens", TOK_LE, &s->gt_count, &s->gt_sum, s->gt_b,
                    why, wn) &&
         check_hist(&e, "vllm:request_params_n", N_LE, &s->n_count, &s->n_sum, s->n_b, why, wn) &&
         check_hist(&e, "vllm:request_params_max_tokens", TOK_LE, &s->mt_count, &s->mt_sum, s->mt_b,
                    why, wn) &&
         check_hist(&e, "vllm:request_params_best_of", N_LE, &s->bo_count, &s->bo_sum, s->bo_b, why,
                    wn) &&
         check_hist(&e, "vllm:request_max_num_generation_tokens", TOK_LE, &s->mg_count, &s->mg_sum,
                    s->mg_b, why, wn) &&
         check_hist(&e, "vllm:iteration_tokens_total", ITER_LE, &s->iter_count, &s->iter_sum,
                    s->iter_b, why, wn) &&
         check_hist(&e, "vllm:inter_token_latency_seconds", TPOT_LE, &s->itl_count, &sum, NULL, why,
                    wn) &&
         check_hist(&e, "vllm:request_time_per_output_token_seconds", TPOT_LE, &s->rtpot_count,
                    &sum, NULL, why, wn) &&
         check_cache_info(&e, why, wn) &&
         check_hist(&e, "vllm:time_to_first_token_seconds", TTFT_LE, &s->ttft_count, &sum, NULL,
                    why, wn) &&
         check_hist(&e, "vllm:time_per_output_token_seconds", TPOT_LE, &s->tpot_count, &sum, NULL,
                    why, wn) &&
         check_hist(&e, "vllm:e2e_request_latency_seconds", LATENCY_LE, &s->e2e_count, &sum, NULL,
                    why, wn) &&
         check_hist(&e, "vllm:request_queue_time_seconds", LATENCY_LE, &s->queue_count, &sum, NULL,
                    why, wn) &&
         check_hist(&e, "vllm:request_prefill_time_seconds", LATENCY_LE, &s->prefill_count, &sum,
                    NULL, why, wn) &&
         check_hist(&e, "vllm:request_decode_time_seconds", LATENCY_LE, &s->decode_count, &sum,
                    NULL, why, wn) &&
         check_hist(&e, "vllm:request_inference_time_seconds", LATENCY_LE, &s->infer_count, &sum,
                    NULL, why, wn);
    /* counters: HELP/TYPE/sample names end in _total; pd:instance_up per instance */
    for (int i = 0; ok && i < e.nf; i++) {
        family *f = &e.f[i];
        size_t l = strlen(f->name);
        if (strcmp(f->type, "counter") == 0 && (l < 6 || strcmp(f->name + l - 6, "_total") != 0)) {
            snprintf(why, wn, "counter %s does not end in _total", f->name);
            ok = false;
        }
    }
    family *up = ok ? expo_family(&e, "pd:instance_up") : NULL;
    if (ok) {
        char w0[128], w1[128];
        snprintf(w0, sizeof w0, "role=\"prefill\",instance=\"127.0.0.1:%d\"", g_c.ports[0]);
        snprintf(w1, sizeof w1, "role=\"decode\",instance=\"127.0.0.1:%d\"", g_c.ports[1]);
        ok = up && strcmp(up->type, "gauge") == 0 && up->ns == 2 &&
             strcmp(up->s[0].labels, w0) == 0 && strcmp(up->s[1].labels, w1) == 0 &&
             atof(up->s[0].value) == 1.0 && atof(up->s[1].value) == 1.0;
        if (!ok) snprintf(why, wn, "pd:instance_up: not {%s} 1.0 and {%s} 1.0", w0, w1);
    }
    /* the pd:kv_transfer_* series of a (prefill, decode, transport) triple appear at its first
     * transfer: before that the families may be present without samples */
    family *kb = ok ? expo_family(&e, "pd:kv_transfer_bytes_total") : NULL;
    if (kb && kb->ns > 0) {
        char w[256];
        snprintf(w, sizeof w,
                 "model_name=\"tiny\",transport=\"tcp\",prefill_instance=\"127.0.0.1:%d\","
                 "decode_instance=\"127.0.0.1:%d\"",
                 g_c.ports[0], g_c.ports[1]);
        ok = strcmp(kb->type, "counter") == 0 && kb->ns == 1 && strcmp(kb->s[0].labels, w) == 0;
        if (!ok) snprintf(why, wn, "pd:kv_transfer_bytes_total: want one sample {%.200s}", w);
        s->kv_bytes = ok ? atof(kb->s[0].value) : 0;
        family *ks = expo_family(&e, "pd:kv_transfer_seconds");
        ok = ok && ks && strcmp(ks->type, "histogram") == 0 && ks->ns == 14 + 3;
        if (ok) {
            char wi[300];
            snprintf(wi, sizeof wi, "%s,le=\"+Inf\"", w);
            ok = strcmp(ks->s[14].labels, wi) == 0;
            s->kv_count = atof(ks->s[15].value);
        }
        if (!ok && !why[0]) snprintf(why, wn, "pd:kv_transfer_seconds: wrong series");
    }
    expo_free(&e);
    return ok;
}

static snapshot g_after; /* the metrics scheduler after the known traffic */
static bool g_after_ok;

/* §18.40: every §16 series at start-up, with exact names, types, labels and buckets, at 0. */
TEST(golden_40_metrics_startup)
{
    FIXTURE();
    snapshot s;
    char why[512] = "";
    ASSERT_MSG(read_snapshot(&s, why, sizeof why), "at start-up: %s", why);
    double *zero[] = {&s.prompt_total, &s.gen_total,   &s.ok_stop,     &s.ok_length,
                      &s.ok_abort,     &s.running,     &s.waiting,     &s.pt_count,
                      &s.gt_count,     &s.n_count,     &s.mt_count,    &s.ttft_count,
                      &s.tpot_count,   &s.e2e_count,   &s.queue_count, &s.prefill_count,
                      &s.decode_count, &s.infer_count, &s.kv_bytes,    &s.bo_count,
                      &s.mg_count,     &s.itl_count,   &s.rtpot_count};
    for (size_t i = 0; i < sizeof zero / sizeof *zero; i++)
        ASSERT_MSG(*zero[i] == 0.0, "series %zu is %g at start-up", i, *zero[i]);
}

/* §18.40: exact counters and histogram counts after known traffic on the metrics scheduler:
 *  A, B: prompt 5 ids, max_tokens 3, ignore_eos -> 3 tokens, length (B streamed)
 *  C: prompt 3 ids, n 2, max_tokens 2 -> 2 x 2 tokens, length
 *  D: prompt 4 ids, max_tokens 3, EOS forced -> 1 token, stop */
TEST(golden_40_metrics_after_traffic)
{
    FIXTURE();
    char d[256], why[512] = "";
    snprintf(d, sizeof d,
             "{\"prompt\":[30,31,32,33],\"max_tokens\":3,\"temperature\":0,"
             "\"logit_bias\":{\"%d\":100}}",
             g_eos);
    const char *bodies[] = {
        "{\"prompt\":[1,2,3,4,5],\"max_tokens\":3,\"ignore_eos\":true}",
        "{\"prompt\":[6,7,8,9,10],\"max_tokens\":3,\"ignore_eos\":true,\"stream\":true}",
        "{\"prompt\":[11,12,13],\"n\":2,\"max_tokens\":2,\"ignore_eos\":true}", d};
    for (int i = 0; i < 4; i++) {
        resp r;
        ASSERT(post(g_port_metrics, "/v1/completions", bodies[i], &r) == 0);
        int st = r.status;
        resp_free(&r);
        ASSERT_EQ_INT(st, 200);
    }
    /* request-level series are observed when each request ends: wait for the fourth */
    snapshot s;
    int64_t deadline = pd_now_ns() + 10 * PD_NS_PER_S;
    bool got = false;
    while (pd_now_ns() < deadline && !got) {
        /* the engines' queues come with the instances' next Stats (a heartbeat) */
        got = read_snapshot(&s, why, sizeof why) && s.e2e_count >= 4 && s.kv_count >= 4 &&
              s.running == 0 && s.waiting == 0;
        if (!got) pd_sleep_ns(100 * PD_NS_PER_MS);
    }
    ASSERT_MSG(got, "after traffic: %s", why);
    g_after = s;
    g_after_ok = true;
    ASSERT_NEAR(s.prompt_total, 5 + 5 + 3 + 4, 1e-9);
    ASSERT_NEAR(s.gen_total, 3 + 3 + 4 + 1, 1e-9);
    ASSERT_NEAR(s.ok_stop, 1, 1e-9);
    ASSERT_NEAR(s.ok_length, 3, 1e-9);
    ASSERT_NEAR(s.ok_abort, 0, 1e-9);
    ASSERT_NEAR(s.running, 0, 1e-9);
    ASSERT_NEAR(s.waiting, 0, 1e-9);
    /* buckets le 1,2,5,10,20,50,+Inf */
    static const double pt_b[] = {0, 0, 4, 4, 4, 4, 4}; /* prompt tokens 5,5,3,4 */
    static const double gt_b[] = {1, 1, 4, 4, 4, 4, 4}; /* generated 3,3,4,1 */
    static const double n_b[] = {3, 4, 4, 4, 4, 4};     /* n 1,1,2,1 (best_of: the same) */
    static const double mg_b[] = {1, 2, 4, 4, 4, 4, 4}; /* longest choice 3,3,2,1 */
    for (int i = 0; i < 7; i++) {
        ASSERT_MSG(s.pt_b[i] == pt_b[i], "request_prompt_tokens bucket %d: %g", i, s.pt_b[i]);
        ASSERT_MSG(s.gt_b[i] == gt_b[i], "request_generation_tokens bucket %d: %g", i, s.gt_b[i]);
        ASSERT_MSG(s.mg_b[i] == mg_b[i], "request_max_num_generation_tokens bucket %d: %g", i,
                   s.mg_b[i]);
        if (i < 6) ASSERT_MSG(s.n_b[i] == n_b[i], "request_params_n bucket %d: %g", i, s.n_b[i]);
        if (i < 6)
            ASSERT_MSG(s.bo_b[i] == n_b[i], "request_params_best_of bucket %d: %g", i, s.bo_b[i]);
    }
    ASSERT_NEAR(s.pt_sum, 17, 1e-9);
    ASSERT_NEAR(s.gt_sum, 11, 1e-9);
    ASSERT_NEAR(s.n_sum, 5, 1e-9);
    ASSERT_NEAR(s.bo_sum, 5, 1e-9);
    ASSERT_NEAR(s.mg_sum, 9, 1e-9);
    double counts[] = {s.pt_count,    s.gt_count,      s.n_count,      s.ttft_count,  s.e2e_count,
                       s.queue_count, s.prefill_count, s.decode_count, s.infer_count, s.kv_count,
                       s.bo_count,    s.mg_count,      s.rtpot_count};
    for (size_t i = 0; i < sizeof counts / sizeof *counts; i++)
        ASSERT_MSG(counts[i] == 4, "request-level histogram %zu counted %g, want 4", i, counts[i]);
    /* one per token after each choice's first: 2 + 2 + 1 + 1 + 0 */
    ASSERT_NEAR(s.tpot_count, 6, 1e-9);
    ASSERT_NEAR(s.itl_count, 6, 1e-9);
}

/* §18.40 / §16: request_params_max_tokens is observed once per request (n choices make one
 * request): effective max_tokens 3, 3, 2, 3. */
TEST(golden_40_metrics_max_tokens_per_request)
{
    if (!g_after_ok) SKIP("no snapshot after traffic");
    static const double mt_b[] = {0, 1, 4, 4, 4, 4, 4};
    for (int i = 0; i < 7; i++)
        ASSERT_MSG(g_after.mt_b[i] == mt_b[i],
                   "request_params_max_tokens bucket %d (le %s): %g, "
                   "want %g",
                   i, i < 6 ? TOK_LE[i] : "+Inf", g_after.mt_b[i], mt_b[i]);
    ASSERT_NEAR(g_after.mt_count, 4, 1e-9);
    ASSERT_NEAR(g_after.mt_sum, 11, 1e-9);
}

/* KV bytes of one token of the golden model (f32 KV on the CPU backend), 0 when its config.json
 * does not read. */
static int64_t kv_bytes_per_token(void)
{
    char path[700];
    snprintf(path, sizeof path, "%s/config.json", g_model);
    json_t *cfg = json_load_file(path, 0, NULL);
    int64_t per_tok = json_integer_value(json_object_get(cfg, "num_hidden_layers")) * 2 *
                      json_integer_value(json_object_get(cfg, "num_key_value_heads")) *
                      json_integer_value(json_object_get(cfg, "head_dim")) * 4;
    json_decref(cfg);
    return per_tok;
}

/* §18.40: pd:kv_transfer_bytes_total grows by each request's KV size: P tokens x layers x (K,V)
 * x kv_heads x head_dim x 4 bytes (f32 KV on the CPU backend). The prompt's tokens move, not
 * whole blocks; each choice that goes on to decode moves its own copy (the n=2 request's
 * prompts are shorter than a block, so nothing is shared: 5 + 5 + 3 + 3), and the request whose
 * first token ends it (EOS) moves none. */
TEST(golden_40_metrics_kv_bytes)
{
    if (!g_after_ok) SKIP("no snapshot after traffic");
    int64_t per_tok = kv_bytes_per_token();
    ASSERT(per_tok > 0);
    ASSERT_MSG(g_after.kv_bytes == (double)(16 * per_tok),
               "kv_transfer_bytes_total %g after 16 moved prompt tokens, want %lld (%lld per "
               "token)",
               g_after.kv_bytes, (long long)(16 * per_tok), (long long)per_tok);
}

/* A snapshot once the prefix cache counters and the engine steps stay put over more than a
 * heartbeat period: the instances served earlier tests (and other schedulers), whose last Stats
 * must be in. */
static bool steady_snapshot(snapshot *s0, char *why, size_t wn)
{
    for (int i = 0; i < 8; i++) {
        snapshot s;
        if (!read_snapshot(s0, why, wn)) return false;
        pd_sleep_ns((int64_t)CL_MS(1200) * PD_NS_PER_MS); /* a heartbeat and then some */
        if (!read_snapshot(&s, why, wn)) return false;
        if (s.cache_queries == s0->cache_queries && s.cache_hits == s0->cache_hits &&
            s.iter_count == s0->iter_count && s.iter_sum == s0->iter_sum)
            return true;
    }
    snprintf(why, wn, "the prefix cache counters or engine steps kept moving without traffic");
    return false;
}

/* Waits (10 s at most, stretched by cl_time_scale) until the prefix cache counters have grown
 * from s0's by queries and hits; *s: the last snapshot. */
static bool cache_grown(const snapshot *s0, double queries, double hits, snapshot *s, char *why,
                        size_t wn)
{
    int64_t deadline = pd_now_ns() + (int64_t)(CL_SEC(10) * PD_NS_PER_S);
    for (;;) {
        if (read_snapshot(s, why, wn) && s->cache_hits - s0->cache_hits >= hits &&
            s->cache_queries - s0->cache_queries >= queries)
            return true;
        if (pd_now_ns() > deadline) return false;
        pd_sleep_ns(100 * PD_NS_PER_MS);
    }
}

/* Prefix caching: the same 40-token prompt twice; the second finds its first two 16-token
 * blocks on the prefill instance (its third block holds the last token, always computed), and
 * the decode instance's reservation finds them too (the first request's, registered when it
 * decoded), so their KV does not move. Each instance counts the prompt's 40 tokens per lookup;
 * the counters are the instances' sums, from their Stats (the heartbeat). */
TEST(golden_40_metrics_prefix_cache)
{
    FIXTURE();
    snapshot s0, s;
    char why[512] = "";
    ASSERT_MSG(steady_snapshot(&s0, why, sizeof why), "before: %s", why);
    char body[1024];
    prompt40_body(body, sizeof body, 500, "\"max_tokens\":2,\"ignore_eos\":true");
    for (int i = 0; i < 2; i++) {
        resp r;
        ASSERT(post(g_port_metrics, "/v1/completions", body, &r) == 0);
        int st = r.status;
        resp_free(&r);
        ASSERT_EQ_INT(st, 200);
    }
    bool got = cache_grown(&s0, 160, 64, &s, why, sizeof why);
    ASSERT_MSG(got, "prefix cache counters: %s; queries %g -> %g, hits %g -> %g", why,
               s0.cache_queries, s.cache_queries, s0.cache_hits, s.cache_hits);
    ASSERT_NEAR(s.cache_queries - s0.cache_queries, 160, 1e-9); /* 2 x 40 on each instance */
    ASSERT_NEAR(s.cache_hits - s0.cache_hits, 64, 1e-9);        /* 32 on each, the second time */
}

/* n > 1 shares the prompt's KV: of an n=4 request's choices on a 40-token prompt, the first is
 * prefilled and moved whole; the other three start once the decode instance has stepped it, find
 * its two full blocks in both instances' caches, and prefill and move only the last 8 tokens:
 * (40 + 3 x 8) tokens of KV instead of 4 x 40, 3 x 32 hits on each instance. Each choice still
 * equals the n=1 request with its seed (seed + index). */
TEST(golden_40_metrics_n_shares_prompt)
{
    FIXTURE();
    int64_t per_tok = kv_bytes_per_token();
    ASSERT(per_tok > 0);
    snapshot s0, s;
    char why[512] = "";
    ASSERT_MSG(steady_snapshot(&s0, why, sizeof why), "before: %s", why);
    char body[1024];
    prompt40_body(body, sizeof body, 301,
                  "\"n\":4,\"max_tokens\":4,\"ignore_eos\":true,\"temperature\":1.0,\"seed\":5");
    json_t *o = post_ok(g_port_metrics, "/v1/completions", body);
    ASSERT(o);
    bool got = cache_grown(&s0, 320, 192, &s, why, sizeof why);
    double kv = s.kv_bytes - s0.kv_bytes;
    if (!got || s.cache_queries - s0.cache_queries != 320 || s.cache_hits - s0.cache_hits != 192 ||
        kv != (double)(64 * per_tok))
        json_decref(o);
    ASSERT_MSG(got, "prefix cache counters: %s; queries %g -> %g, hits %g -> %g", why,
               s0.cache_queries, s.cache_queries, s0.cache_hits, s.cache_hits);
    ASSERT_NEAR(s.cache_queries - s0.cache_queries, 320, 1e-9); /* 4 x 40 on each instance */
    ASSERT_NEAR(s.cache_hits - s0.cache_hits, 192, 1e-9);       /* 3 x 32 on each */
    ASSERT_MSG(kv == (double)(64 * per_tok), "%g KV bytes moved, want %lld (64 tokens)", kv,
               (long long)(64 * per_tok));
    json_t *ch = json_object_get(o, "choices");
    for (size_t i = 0; i < 4; i++) {
        char one[1024], rest[160];
        snprintf(rest, sizeof rest,
                 "\"max_tokens\":4,\"ignore_eos\":true,\"temperature\":1.0,\"seed\":%zu", 5 + i);
        prompt40_body(one, sizeof one, 301, rest);
        json_t *a = post_ok(g_port, "/v1/completions", one);
        json_t *c = json_array_get(ch, i);
        const char *want = json_string_value(
            json_object_get(json_array_get(json_object_get(a, "choices"), 0), "text"));
        const char *have = json_string_value(json_object_get(c, "text"));
        bool same = want && have &&
                    json_integer_value(json_object_get(c, "index")) == (json_int_t)i &&
                    strcmp(want, have) == 0;
        char msg[300];
        snprintf(msg, sizeof msg, "choice %zu: \"%.100s\", alone with seed %zu: \"%.100s\"", i,
                 have ? have : "(none)", 5 + i, want ? want : "(none)");
        json_decref(a);
        if (!same) json_decref(o);
        ASSERT_MSG(same, "%s", msg);
    }
    json_decref(o);
}

/* vllm:iteration_tokens_total: the engines' steps by the tokens they ran, summed over the
 * instances (from their Stats, a heartbeat later). A 5-token prompt with 3 tokens generated: the
 * prefill instance runs one step of 5 tokens (le 8) and samples the first token; the decode
 * instance two steps of 1 token (the first token's row, then the second's; the third token ends
 * the request without a row of its own). */
TEST(golden_40_metrics_iteration_tokens)
{
    FIXTURE();
    snapshot s0, s;
    char why[512] = "";
    ASSERT_MSG(steady_snapshot(&s0, why, sizeof why), "before: %s", why);
    resp r;
    ASSERT(post(g_port_metrics, "/v1/completions",
                "{\"prompt\":[40,41,42,43,44],\"max_tokens\":3,\"ignore_eos\":true}", &r) == 0);
    int st = r.status;
    resp_free(&r);
    ASSERT_EQ_INT(st, 200);
    int64_t deadline = pd_now_ns() + (int64_t)(CL_SEC(10) * PD_NS_PER_S);
    bool got = false;
    while (!got && pd_now_ns() < deadline) {
        got = read_snapshot(&s, why, sizeof why) && s.iter_count - s0.iter_count >= 3 &&
              s.iter_sum - s0.iter_sum >= 7;
        if (!got) pd_sleep_ns(100 * PD_NS_PER_MS);
    }
    ASSERT_MSG(got, "steps %g -> %g, tokens %g -> %g: %s", s0.iter_count, s.iter_count, s0.iter_sum,
               s.iter_sum, why);
    ASSERT_NEAR(s.iter_count - s0.iter_count, 3, 1e-9);
    ASSERT_NEAR(s.iter_sum - s0.iter_sum, 7, 1e-9);
    ASSERT_NEAR(s.iter_b[0] - s0.iter_b[0], 2, 1e-9); /* le 1: the decode steps */
    ASSERT_NEAR(s.iter_b[1] - s0.iter_b[1], 3, 1e-9); /* le 8 (cumulative): and the prefill */
}

/* vllm:num_requests_running / _waiting are the engines' queues, as vLLM reports them: with
 * --max-num-seqs 1 on both instances, eight concurrent requests of 100 tokens (their KV fits the
 * decode pool's 64 blocks together) prefill one at a time and decode one at a time; the rest wait
 * in the engines' queues, and /metrics shows them waiting, with at most one running per instance.
 * (The gauges used to count the scheduler's dispatched requests: 8 running, 0 waiting.) Once
 * they are done, both gauges go back to 0. */
TEST(golden_40_metrics_waiting_on_decode)
{
    FIXTURE();
    cl_cluster c;
    memset(&c, 0, sizeof c);
    char *node_args[] = {"--max-num-seqs", "1", NULL};
    if (cl_start(&c, g_model, "0", "1", node_args) < 0) {
        char why[512];
        snprintf(why, sizeof why, "%s", pd_last_error());
        cl_stop_all(&c);
        ASSERT_MSG(false, "cl_start: %s", why);
    }
    cl_proc sp;
    int port = 0;
    char *sched_args[] = {"--heartbeat-ms", "100", NULL};
    if (cl_sched_start(&c, &sp, "sched_queues", sched_args, &port) < 0) {
        char why[512];
        snprintf(why, sizeof why, "%s", pd_last_error());
        cl_stop_all(&c);
        ASSERT_MSG(false, "pd-scheduler: %s", why);
    }
    enum { N = 8 };
    cl_conn conns[N];
    bool opened = true;
    for (int i = 0; i < N; i++) {
        char body[160];
        snprintf(body, sizeof body,
                 "{\"prompt\":[%d,2,3,4],\"max_tokens\":100,\"ignore_eos\":true}", 10 + i);
        opened &= cl_conn_open(&conns[i], port, "POST", "/v1/completions", NULL, body, false) == 0;
    }
    const char *run_p = "vllm:num_requests_running{model_name=\"tiny\",engine=\"0\"} ";
    const char *wait_p = "vllm:num_requests_waiting{model_name=\"tiny\",engine=\"0\"} ";
    double max_running = 0, max_waiting = 0, running = -1, waiting = -1;
    int64_t deadline = pd_now_ns() + (int64_t)(CL_SEC(30) * PD_NS_PER_S);
    int n_open = opened ? N : 0;
    while (n_open > 0 && pd_now_ns() < deadline) {
        n_open = cl_conn_poll(conns, N, 20, 0);
        char *m = get_metrics(port);
        running = m ? cl_metric(m, run_p, -1) : -1;
        waiting = m ? cl_metric(m, wait_p, -1) : -1;
        free(m);
        if (running > max_running) max_running = running;
        if (waiting > max_waiting) max_waiting = waiting;
    }
    int ok = 0;
    for (int i = 0; i < N; i++) {
        ok += opened && conns[i].status == 200;
        cl_conn_close(&conns[i]);
    }
    /* idle: both gauges at 0 with the instances' next Stats */
    deadline = pd_now_ns() + (int64_t)(CL_SEC(5) * PD_NS_PER_S);
    do {
        char *m = get_metrics(port);
        running = m ? cl_metric(m, run_p, -1) : -1;
        waiting = m ? cl_metric(m, wait_p, -1) : -1;
        free(m);
        if (running == 0 && waiting == 0) break;
        pd_sleep_ns(50 * PD_NS_PER_MS);
    } while (pd_now_ns() < deadline);
    if (n_open || ok != N) {
        cl_dump_log(&sp, 20);
        for (int k = 0; k < 2; k++) cl_dump_log(&c.procs[k], 20);
    }
    int st = cl_stop(&sp, 10000);
    int bad = cl_stop_all(&c);
    printf("    at most %g running, %g waiting\n", max_running, max_waiting);
    ASSERT(opened);
    ASSERT_EQ_INT(n_open, 0);
    ASSERT_EQ_INT(ok, N);
    ASSERT_MSG(max_waiting >= 2, "num_requests_waiting never above %g", max_waiting);
    ASSERT_MSG(max_running >= 1 && max_running <= 2,
               "num_requests_running up to %g with one sequence per instance", max_running);
    ASSERT_NEAR(running, 0, 1e-9);
    ASSERT_NEAR(waiting, 0, 1e-9);
    ASSERT_EQ_INT(st, 0);
    ASSERT_EQ_INT(bad, 0);
}
