/* pd-bench: the serving benchmark (vLLM `bench serve` style) for pd-scheduler's HTTP API.
 *
 *   pd-bench [--base-url http://127.0.0.1:9000] [--endpoint /v1/completions] [--model NAME]
 *            [--num-prompts 100] [--dataset random|jsonl] [--dataset-path F]
 *            [--random-input-len 128] [--random-output-len 32] [--random-range-ratio 0]
 *            [--random-prefix-len 0] [--random-num-prefixes 1]
 *            [--random-vocab-size 2048] [--request-rate inf] [--max-concurrency C]
 *            [--warmup N] [--seed 0] [--goodput ttft:MS,tpot:MS,e2el:MS] [--api-key KEY]
 *            [--result-file F.json] [--dump-timestamps F.jsonl] [--save-dataset F]
 *            [--timeout S] [--quiet] [--workload plain|mixed] [--abort-ratio R] [--duration S]
 *            [--extra-body JSON]
 *   pd-bench --node-stats HOST:PORT     (one pd-prefill/pd-decode Stats reply as JSON, then exit)
 *
 * --workload mixed gives every request its own shape (pdb_dataset_mix: completions or chat,
 * streaming or one JSON body, n = 2, logprobs, and with --abort-ratio some client aborts
 * mid-stream); an aborted request is counted apart, neither completed nor failed. --duration S
 * keeps sending at --request-rate (finite) for S seconds instead of --num-prompts requests; the
 * --num-prompts prompts are then reused in turn. Non-streaming answers have no token times:
 * they count in E2EL and throughput, not in TTFT/TPOT/ITL. --summary-only leaves the
 * per-request arrays out of --result-file (long runs); "first_errors" (at most 20) stays.
 * --extra-body '{"guided_json": {...}}' adds (or overrides) members of every request body, e.g.
 * structured output or sampling fields.
 *
 * --save-dataset writes the prompts, one per line, in pd-generate's --prompts-file format
 * (comma-separated ids for id prompts: name the file *.ids), so the colocated baseline can
 * replay exactly the same prompts.
 *
 * Design: requests are sent by a pool of worker threads, one blocking connection per request
 * (client.c). Arrival times are drawn up front (Poisson: exponential gaps with mean
 * 1/--request-rate, or all at t=0 for inf); a worker takes the next request in order, sleeps
 * until its arrival time and sends it, so --max-concurrency workers enforce the concurrency
 * limit the way vLLM's semaphore does (a request that arrives while all are busy waits).
 * Every request streams with ignore_eos and max_tokens = its output length, so lengths are
 * exact. Metrics follow vLLM's definitions: TTFT = send -> first token chunk, TPOT =
 * (E2E - TTFT) / (output tokens - 1) for requests with more than one token, ITL = gaps between
 * consecutive token chunks, E2EL = send -> end of stream.
 */
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bench.h"
#include "engine/rng.h"
#include "json/json.h"
#include "rpc/pd.pb-c.h"
#include "rpc/rpc.h"
#include "util/args.h"
#include "util/clock.h"
#include "util/status.h"

typedef struct {
    const char *base_url, *endpoint, *model, *dataset, *dataset_path, *result_file, *dump_file,
        *api_key, *goodput, *save_dataset, *node_stats, *extra_body;
    int64_t num_prompts, input_len, output_len, vocab, max_concurrency, warmup, seed, timeout_s;
    int64_t prefix_len; /* --random-prefix-len: tokens every random prompt starts with */
    int64_t n_prefixes; /* --random-num-prefixes: distinct such prefixes, in turn */
    double range_ratio, request_rate; /* request_rate: INFINITY = all at once */
    double duration_s;                /* > 0: send for this long (finite rate) */
    double abort_ratio;               /* mixed workload: share of streams aborted */
    bool quiet, mixed, summary_only;
    double slo_ttft_ms, slo_tpot_ms, slo_e2el_ms; /* < 0: not set */
} bench_args;

static bench_args default_args(void)
{
    return (bench_args){.base_url = "http://127.0.0.1:9000",
                        .endpoint = "/v1/completions",
                        .dataset = "random",
                        .num_prompts = 100,
                        .input_len = 128,
                        .output_len = 32,
                        .n_prefixes = 1,
                        .vocab = 2048,
                        .timeout_s = 600,
                        .request_rate = INFINITY,
                        .slo_ttft_ms = -1,
                        .slo_tpot_ms = -1,
                        .slo_e2el_ms = -1};
}

static void usage(FILE *o)
{
    fprintf(o, "usage: pd-bench [--base-url http://HOST:PORT] [--endpoint /v1/completions|"
               "/v1/chat/completions|/generate]\n"
               "                [--model NAME] [--num-prompts N] [--dataset random|jsonl] "
               "[--dataset-path F]\n"
               "                [--random-input-len N] [--random-output-len N] "
               "[--random-range-ratio R] [--random-vocab-size V]\n"
               "                [--random-prefix-len N] [--random-num-prefixes K]\n"
               "                [--request-rate R|inf] [--max-concurrency C] [--warmup N] "
               "[--seed S]\n"
               "                [--goodput ttft:MS,tpot:MS,e2el:MS] [--api-key KEY] "
               "[--result-file F.json]\n"
               "                [--dump-timestamps F.jsonl] [--save-dataset F] [--timeout S] "
               "[--quiet]\n"
               "                [--workload plain|mixed] [--abort-ratio R] [--duration S] "
               "[--summary-only]\n"
               "                [--extra-body JSON]\n"
               "       pd-bench --node-stats HOST:PORT\n");
}

/* "ttft:200,tpot:50,e2el:2000" -> SLOs in ms. */
static int parse_goodput(const char *s, bench_args *a)
{
    char buf[256];
    if (strlen(s) >= sizeof buf) return pd_error(PD_EINVAL, "--goodput: too long");
    strcpy(buf, s);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        char *colon = strchr(tok, ':');
        if (!colon) return pd_error(PD_EINVAL, "--goodput: expected NAME:MS, got \"%s\"", tok);
        *colon = 0;
        double v;
        PD_CHECK(pd_arg_f64("--goodput", colon + 1, &v));
        if (v <= 0) return pd_error(PD_EINVAL, "--goodput %s: must be positive", tok);
        if (!strcmp(tok, "ttft"))
            a->slo_ttft_ms = v;
        else if (!strcmp(tok, "tpot"))
            a->slo_tpot_ms = v;
        else if (!strcmp(tok, "e2el"))
            a->slo_e2el_ms = v;
        else
            return pd_error(PD_EINVAL, "--goodput: unknown metric \"%s\" (ttft, tpot, e2el)", tok);
    }
    return PD_OK;
}

/* Returns 0, 1 for --help, or a negative status. */
static int parse_args(int argc, char **argv, bench_args *a)
{
    *a = default_args();
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        if (!strcmp(o, "-h") || !strcmp(o, "--help")) return 1;
        if (!strcmp(o, "--quiet")) {
            a->quiet = true;
            continue;
        }
        if (!strcmp(o, "--summary-only")) {
            a->summary_only = true;
            continue;
        }
        if (i + 1 >= argc) return pd_error(PD_EINVAL, "%s: needs a value (see --help)", o);
        const char *v = argv[++i];
        if (!strcmp(o, "--base-url"))
            a->base_url = v;
        else if (!strcmp(o, "--endpoint"))
            a->endpoint = v;
        else if (!strcmp(o, "--model"))
            a->model = v;
        else if (!strcmp(o, "--dataset") || !strcmp(o, "--dataset-name"))
            a->dataset = v;
        else if (!strcmp(o, "--dataset-path"))
            a->dataset_path = v;
        else if (!strcmp(o, "--result-file"))
            a->result_file = v;
        else if (!strcmp(o, "--save-dataset"))
            a->save_dataset = v;
        else if (!strcmp(o, "--dump-timestamps"))
            a->dump_file = v;
        else if (!strcmp(o, "--api-key"))
            a->api_key = v;
        else if (!strcmp(o, "--node-stats"))
            a->node_stats = v;
        else if (!strcmp(o, "--extra-body"))
            a->extra_body = v;
        else if (!strcmp(o, "--workload")) {
            if (strcmp(v, "plain") && strcmp(v, "mixed"))
                return pd_error(PD_EINVAL, "--workload: expected plain or mixed, got \"%s\"", v);
            a->mixed = !strcmp(v, "mixed");
        } else if (!strcmp(o, "--abort-ratio")) {
            PD_CHECK(pd_arg_f64(o, v, &a->abort_ratio));
            if (!(a->abort_ratio >= 0 && a->abort_ratio <= 1))
                return pd_error(PD_EINVAL, "--abort-ratio: must be in [0, 1], got %s", v);
        } else if (!strcmp(o, "--duration")) {
            PD_CHECK(pd_arg_f64(o, v, &a->duration_s));
            if (!(a->duration_s > 0 && a->duration_s <= 7 * 86400.0))
                return pd_error(PD_EINVAL, "--duration: must be in (0, 604800] seconds, got %s", v);
        } else if (!strcmp(o, "--goodput"))
            PD_CHECK(parse_goodput(v, a));
        else if (!strcmp(o, "--num-prompts"))
            PD_CHECK(pd_arg_i64(o, v, 1, 10000000, &a->num_prompts));
        else if (!strcmp(o, "--random-input-len"))
            PD_CHECK(pd_arg_i64(o, v, 1, 1 << 24, &a->input_len));
        else if (!strcmp(o, "--random-output-len"))
            PD_CHECK(pd_arg_i64(o, v, 1, 1 << 24, &a->output_len));
        else if (!strcmp(o, "--random-prefix-len"))
            PD_CHECK(pd_arg_i64(o, v, 0, 1 << 24, &a->prefix_len));
        else if (!strcmp(o, "--random-num-prefixes"))
            PD_CHECK(pd_arg_i64(o, v, 1, 1 << 20, &a->n_prefixes));
        else if (!strcmp(o, "--random-vocab-size"))
            PD_CHECK(pd_arg_i64(o, v, 4, 1 << 24, &a->vocab));
        else if (!strcmp(o, "--max-concurrency"))
            PD_CHECK(pd_arg_i64(o, v, 1, 4096, &a->max_concurrency));
        else if (!strcmp(o, "--warmup"))
            PD_CHECK(pd_arg_i64(o, v, 0, 100000, &a->warmup));
        else if (!strcmp(o, "--seed"))
            PD_CHECK(pd_arg_i64(o, v, 0, INT64_MAX, &a->seed));
        else if (!strcmp(o, "--timeout"))
            PD_CHECK(pd_arg_i64(o, v, 1, 86400, &a->timeout_s));
        else if (!strcmp(o, "--random-range-ratio"))
            PD_CHECK(pd_arg_f64(o, v, &a->range_ratio));
        else if (!strcmp(o, "--request-rate")) {
            if (!strcmp(v, "inf"))
                a->request_rate = INFINITY;
            else {
                PD_CHECK(pd_arg_f64(o, v, &a->request_rate));
                if (a->request_rate <= 0)
                    return pd_error(PD_EINVAL, "--request-rate: must be positive or inf");
            }
        } else
            return pd_error(PD_EINVAL, "unknown option \"%s\" (see --help)", o);
    }
    if (strcmp(a->dataset, "random") && strcmp(a->dataset, "jsonl"))
        return pd_error(PD_EINVAL, "--dataset: expected random or jsonl, got \"%s\"", a->dataset);
    if (!strcmp(a->dataset, "jsonl") && !a->dataset_path)
        return pd_error(PD_EINVAL, "--dataset jsonl needs --dataset-path F");
    if (a->api_key && strlen(a->api_key) > 512)
        return pd_error(PD_EINVAL, "--api-key: longer than 512 bytes");
    if (a->duration_s > 0 && isinf(a->request_rate))
        return pd_error(PD_EINVAL, "--duration needs a finite --request-rate");
    if (a->abort_ratio > 0 && !a->mixed)
        return pd_error(PD_EINVAL, "--abort-ratio needs --workload mixed");
    if (a->mixed && strcmp(a->endpoint, "/generate") == 0)
        return pd_error(PD_EINVAL, "--workload mixed: the OpenAI endpoints only (not /generate)");
    return PD_OK;
}

/* ---- running ------------------------------------------------------------------------------- */

typedef struct {
    const pdb_target *t;
    const pdb_dataset *d;
    pdb_result *res;       /* (n) */
    const int64_t *arrive; /* (n) arrival offsets from t0, ns */
    size_t n;
    uint64_t seed;
    int64_t t0;
    pthread_mutex_t mu;
    size_t next, done; /* guarded by mu */
} run_state;

static void *worker(void *arg)
{
    run_state *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        size_t i = s->next < s->n ? s->next++ : s->n;
        pthread_mutex_unlock(&s->mu);
        if (i >= s->n) break;
        int64_t wait = s->t0 + s->arrive[i] - pd_now_ns();
        if (wait > 0) pd_sleep_ns(wait);
        pdb_request_run(s->t, &s->d->items[i % s->d->n], s->seed + i, &s->res[i]);
        pthread_mutex_lock(&s->mu);
        s->done++;
        pthread_mutex_unlock(&s->mu);
    }
    return NULL;
}

static void progress(size_t done, size_t n, double elapsed)
{
    int width = 40, fill = n ? (int)((double)done / (double)n * width) : width;
    char bar[64];
    for (int k = 0; k < width; k++) bar[k] = k < fill ? '=' : ' ';
    bar[width] = 0;
    fprintf(stderr, "\r[%s] %zu/%zu  %.1f s", bar, done, n, elapsed);
    fflush(stderr);
}

/* Runs n requests (dataset items i % d->n) with the given arrival offsets; results in res. */
static int run_batch(const pdb_target *t, const pdb_dataset *d, pdb_result *res,
                     const int64_t *arrive, size_t n, size_t workers, uint64_t seed, bool bar,
                     int64_t *t0_out)
{
    run_state s = {.t = t, .d = d, .res = res, .arrive = arrive, .n = n, .seed = seed};
    pthread_mutex_init(&s.mu, NULL);
    pthread_t *th = calloc(workers, sizeof *th);
    if (!th) return pd_error(PD_ENOMEM, "out of memory");
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    s.t0 = pd_now_ns();
    *t0_out = s.t0;
    size_t started = 0;
    int rc = PD_OK;
    for (; started < workers; started++) {
        if (pthread_create(&th[started], &attr, worker, &s) != 0) {
            rc = pd_error(PD_EINTERNAL, "cannot start worker thread %zu", started);
            break;
        }
    }
    if (bar) {
        for (;;) {
            pthread_mutex_lock(&s.mu);
            size_t done = s.done;
            pthread_mutex_unlock(&s.mu);
            progress(done, n, (double)(pd_now_ns() - s.t0) / 1e9);
            if (done >= n || started == 0) break;
            pd_sleep_ns(100 * PD_NS_PER_MS);
        }
        fputc('\n', stderr);
    }
    for (size_t k = 0; k < started; k++) pthread_join(th[k], NULL);
    if (rc < 0 && started > 0) rc = PD_OK; /* fewer workers, same requests */
    pthread_attr_destroy(&attr);
    pthread_mutex_destroy(&s.mu);
    free(th);
    return rc;
}

/* ---- metrics and output --------------------------------------------------------------------- */

typedef struct {
    size_t completed, failed, good, aborted, streamed; /* streamed: completed with token times */
    int64_t in_tokens, out_tokens;
    double duration_s;
    pdb_stats ttft, tpot, itl, e2el;      /* ms */
    double *ttfts, *tpots, *itls, *e2els; /* ms; (completed), (n_tpot), (n_itl), (completed) */
    size_t n_tpot, n_itl;
} summary;

static void summary_free(summary *m)
{
    free(m->ttfts);
    free(m->tpots);
    free(m->itls);
    free(m->e2els);
}

static int summarize(const bench_args *a, const pdb_dataset *d, const pdb_result *res, size_t n,
                     double duration_s, summary *m)
{
    memset(m, 0, sizeof *m);
    m->duration_s = duration_s;
    size_t itl_cap = 0;
    for (size_t i = 0; i < n; i++)
        if (res[i].ok && res[i].n_tok > 1) itl_cap += res[i].n_tok - 1;
    m->ttfts = malloc((n + 1) * sizeof(double));
    m->tpots = malloc((n + 1) * sizeof(double));
    m->e2els = malloc((n + 1) * sizeof(double));
    m->itls = malloc((itl_cap + 1) * sizeof(double));
    if (!m->ttfts || !m->tpots || !m->e2els || !m->itls)
        return pd_error(PD_ENOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        const pdb_result *r = &res[i];
        if (!r->ok) {
            m->failed++;
            continue;
        }
        if (r->aborted) {
            m->aborted++;
            continue;
        }
        double e2el = (double)(r->t_end - r->t_send) / 1e6;
        int64_t out = r->output_tokens;
        double ttft = e2el, tpot = 0.0;
        if (r->streamed && r->n_tok > 0) {
            ttft = (double)(r->tok_ns[0] - r->t_send) / 1e6;
            if (out > 1) {
                tpot = (e2el - ttft) / (double)(out - 1);
                m->tpots[m->n_tpot++] = tpot;
            }
            for (size_t k = 1; k < r->n_tok; k++)
                m->itls[m->n_itl++] = (double)(r->tok_ns[k] - r->tok_ns[k - 1]) / 1e6;
            m->ttfts[m->streamed++] = ttft;
        }
        m->e2els[m->completed] = e2el;
        m->completed++;
        m->out_tokens += out;
        int64_t pin = r->prompt_tokens >= 0 ? r->prompt_tokens : d->items[i % d->n].input_len;
        if (pin > 0) m->in_tokens += pin;
        bool good = (a->slo_ttft_ms < 0 || ttft <= a->slo_ttft_ms) &&
                    (a->slo_tpot_ms < 0 || tpot <= a->slo_tpot_ms) &&
                    (a->slo_e2el_ms < 0 || e2el <= a->slo_e2el_ms);
        if (good) m->good++;
    }
    PD_CHECK(pdb_stats_compute(m->ttfts, m->streamed, &m->ttft));
    PD_CHECK(pdb_stats_compute(m->tpots, m->n_tpot, &m->tpot));
    PD_CHECK(pdb_stats_compute(m->itls, m->n_itl, &m->itl));
    PD_CHECK(pdb_stats_compute(m->e2els, m->completed, &m->e2el));
    return PD_OK;
}

static bool has_goodput(const bench_args *a)
{
    return a->slo_ttft_ms > 0 || a->slo_tpot_ms > 0 || a->slo_e2el_ms > 0;
}

static void print_stats(const char *title, const char *abbr, const pdb_stats *s)
{
    int pad = (50 - (int)strlen(title)) / 2;
    printf("%.*s%s%.*s\n", pad, "--------------------------------------------------", title,
           50 - pad - (int)strlen(title), "--------------------------------------------------");
    char k[64];
    snprintf(k, sizeof k, "Mean %s (ms):", abbr);
    printf("%-40s %-10.2f\n", k, s->mean);
    snprintf(k, sizeof k, "Median %s (ms):", abbr);
    printf("%-40s %-10.2f\n", k, s->median);
    snprintf(k, sizeof k, "P90 %s (ms):", abbr);
    printf("%-40s %-10.2f\n", k, s->p90);
    snprintf(k, sizeof k, "P99 %s (ms):", abbr);
    printf("%-40s %-10.2f\n", k, s->p99);
}

static void print_report(const bench_args *a, const summary *m, const char *first_error)
{
    double dur = m->duration_s > 0 ? m->duration_s : 1e-9;
    printf("============ Serving Benchmark Result ============\n");
    printf("%-40s %-10zu\n", "Successful requests:", m->completed);
    printf("%-40s %-10zu\n", "Failed requests:", m->failed);
    if (a->mixed) printf("%-40s %-10zu\n", "Aborted requests (by the client):", m->aborted);
    if (first_error) printf("%-40s %s\n", "First error:", first_error);
    if (a->max_concurrency)
        printf("%-40s %-10lld\n", "Maximum request concurrency:", (long long)a->max_concurrency);
    if (isinf(a->request_rate))
        printf("%-40s %-10s\n", "Request rate (req/s):", "inf");
    else
        printf("%-40s %-10.2f\n", "Request rate (req/s):", a->request_rate);
    printf("%-40s %-10.2f\n", "Benchmark duration (s):", m->duration_s);
    printf("%-40s %-10lld\n", "Total input tokens:", (long long)m->in_tokens);
    printf("%-40s %-10lld\n", "Total generated tokens:", (long long)m->out_tokens);
    printf("%-40s %-10.2f\n", "Request throughput (req/s):", (double)m->completed / dur);
    if (has_goodput(a))
        printf("%-40s %-10.2f\n", "Request goodput (req/s):", (double)m->good / dur);
    printf("%-40s %-10.2f\n", "Output token throughput (tok/s):", (double)m->out_tokens / dur);
    printf("%-40s %-10.2f\n",
           "Total Token throughput (tok/s):", (double)(m->in_tokens + m->out_tokens) / dur);
    print_stats("Time to First Token", "TTFT", &m->ttft);
    print_stats("Time per Output Token (excl. 1st token)", "TPOT", &m->tpot);
    print_stats("Inter-token Latency", "ITL", &m->itl);
    print_stats("End-to-end Latency", "E2EL", &m->e2el);
    printf("==================================================\n");
    fflush(stdout);
}

static void set_stats(json_t *o, const char *name, const pdb_stats *s)
{
    char k[64];
    snprintf(k, sizeof k, "mean_%s_ms", name);
    json_object_set_new(o, k, json_real(s->mean));
    snprintf(k, sizeof k, "median_%s_ms", name);
    json_object_set_new(o, k, json_real(s->median));
    snprintf(k, sizeof k, "std_%s_ms", name);
    json_object_set_new(o, k, json_real(s->std));
    snprintf(k, sizeof k, "p90_%s_ms", name);
    json_object_set_new(o, k, json_real(s->p90));
    snprintf(k, sizeof k, "p99_%s_ms", name);
    json_object_set_new(o, k, json_real(s->p99));
}

static int write_result(const bench_args *a, const pdb_dataset *d, const pdb_result *res, size_t n,
                        const summary *m)
{
    double dur = m->duration_s > 0 ? m->duration_s : 1e-9;
    char date[32];
    time_t now = time(NULL);
    struct tm tmv;
    strftime(date, sizeof date, "%Y%m%d-%H%M%S", gmtime_r(&now, &tmv));
    json_t *o = json_object();
    json_object_set_new(o, "date", json_string(date));
    json_object_set_new(o, "backend", json_string("pdserve"));
    json_object_set_new(o, "base_url", json_string(a->base_url));
    json_object_set_new(o, "endpoint", json_string(a->endpoint));
    json_object_set_new(o, "model_id", a->model ? json_string(a->model) : json_null());
    json_object_set_new(o, "dataset", json_string(a->dataset));
    json_object_set_new(o, "num_prompts", json_integer((json_int_t)n));
    json_object_set_new(o, "request_rate",
                        isinf(a->request_rate) ? json_string("inf") : json_real(a->request_rate));
    json_object_set_new(o, "max_concurrency",
                        a->max_concurrency ? json_integer(a->max_concurrency) : json_null());
    json_object_set_new(o, "warmup", json_integer(a->warmup));
    json_object_set_new(o, "seed", json_integer(a->seed));
    json_object_set_new(o, "duration", json_real(m->duration_s));
    json_object_set_new(o, "completed", json_integer((json_int_t)m->completed));
    json_object_set_new(o, "failed", json_integer((json_int_t)m->failed));
    json_object_set_new(o, "aborted", json_integer((json_int_t)m->aborted));
    json_object_set_new(o, "workload", json_string(a->mixed ? "mixed" : "plain"));
    json_object_set_new(o, "duration_limit",
                        a->duration_s > 0 ? json_real(a->duration_s) : json_null());
    json_object_set_new(o, "total_input_tokens", json_integer(m->in_tokens));
    json_object_set_new(o, "total_output_tokens", json_integer(m->out_tokens));
    json_object_set_new(o, "request_throughput", json_real((double)m->completed / dur));
    json_object_set_new(o, "request_goodput",
                        has_goodput(a) ? json_real((double)m->good / dur) : json_null());
    json_object_set_new(o, "output_throughput", json_real((double)m->out_tokens / dur));
    json_object_set_new(o, "total_token_throughput",
                        json_real((double)(m->in_tokens + m->out_tokens) / dur));
    json_t *slo = json_object();
    if (a->slo_ttft_ms > 0) json_object_set_new(slo, "ttft", json_real(a->slo_ttft_ms));
    if (a->slo_tpot_ms > 0) json_object_set_new(slo, "tpot", json_real(a->slo_tpot_ms));
    if (a->slo_e2el_ms > 0) json_object_set_new(slo, "e2el", json_real(a->slo_e2el_ms));
    json_object_set_new(o, "goodput_slo_ms", slo);
    set_stats(o, "ttft", &m->ttft);
    set_stats(o, "tpot", &m->tpot);
    set_stats(o, "itl", &m->itl);
    set_stats(o, "e2el", &m->e2el);
    json_t *first = json_array();
    for (size_t i = 0; i < n && json_array_size(first) < 20; i++)
        if (!res[i].ok) json_array_append_new(first, json_string(res[i].error));
    json_object_set_new(o, "first_errors", first);
    /* failures by kind: the message up to its first digit (ids and counts vary) */
    json_t *kinds = json_object();
    for (size_t i = 0; i < n; i++) {
        if (res[i].ok) continue;
        char k[64];
        snprintf(k, sizeof k, "%.*s", (int)strcspn(res[i].error, "0123456789"), res[i].error);
        json_t *c = json_object_get(kinds, k);
        json_object_set_new(kinds, k, json_integer(c ? json_integer_value(c) + 1 : 1));
    }
    json_object_set_new(o, "error_kinds", kinds);
    if (a->summary_only) {
        int rc = pdj_dump_file(o, a->result_file, 2);
        json_decref(o);
        return rc < 0 ? pd_error_prefix(rc, "--result-file %s", a->result_file) : PD_OK;
    }
    /* per request, in request order (vLLM keeps seconds here) */
    json_t *ins = json_array(), *outs = json_array(), *ttfts = json_array(), *itls = json_array(),
           *e2es = json_array(), *errs = json_array();
    for (size_t i = 0; i < n; i++) {
        const pdb_result *r = &res[i];
        bool ok = r->ok && !r->aborted;
        bool timed = ok && r->streamed && r->n_tok > 0;
        int64_t pin = r->prompt_tokens >= 0 ? r->prompt_tokens : d->items[i % d->n].input_len;
        json_array_append_new(ins, json_integer(ok ? pin : 0));
        json_array_append_new(outs, json_integer(ok ? r->output_tokens : 0));
        /* TTFT: seconds when streamed, null for a non-streaming answer, 0 when failed */
        json_t *ttft = !ok      ? json_real(0.0)
                       : !timed ? json_null()
                                : json_real((double)(r->tok_ns[0] - r->t_send) / 1e9);
        json_array_append_new(ttfts, ttft);
        json_array_append_new(e2es, json_real(ok ? (double)(r->t_end - r->t_send) / 1e9 : 0.0));
        json_t *gaps = json_array();
        for (size_t k = 1; timed && k < r->n_tok; k++)
            json_array_append_new(gaps, json_real((double)(r->tok_ns[k] - r->tok_ns[k - 1]) / 1e9));
        json_array_append_new(itls, gaps);
        json_array_append_new(
            errs, json_string(r->ok ? (r->aborted ? "aborted by the client" : "") : r->error));
    }
    json_object_set_new(o, "input_lens", ins);
    json_object_set_new(o, "output_lens", outs);
    json_object_set_new(o, "ttfts", ttfts);
    json_object_set_new(o, "itls", itls);
    json_object_set_new(o, "e2els", e2es);
    json_object_set_new(o, "errors", errs);
    int rc = pdj_dump_file(o, a->result_file, 2);
    json_decref(o);
    return rc < 0 ? pd_error_prefix(rc, "--result-file %s", a->result_file) : PD_OK;
}

/* The prompts in pd-generate's --prompts-file format: ids comma-separated, or the text. */
static int write_dataset(const char *file, const pdb_dataset *d)
{
    FILE *f = fopen(file, "w");
    if (!f) return pd_error(PD_EIO, "--save-dataset %s: cannot create", file);
    int rc = PD_OK;
    for (size_t i = 0; i < d->n; i++) {
        const pdb_prompt *p = &d->items[i];
        if (p->ids) {
            for (size_t k = 0; k < p->n_ids; k++) fprintf(f, "%s%d", k ? "," : "", p->ids[k]);
        } else if (strchr(p->text, '\n')) {
            rc = pd_error(PD_EINVAL, "--save-dataset: prompt %zu has a newline", i);
            break;
        } else {
            fputs(p->text, f);
        }
        fputc('\n', f);
    }
    if (fclose(f) != 0 && rc == PD_OK)
        rc = pd_error(PD_EIO, "--save-dataset %s: write failed", file);
    return rc;
}

/* One JSON line per request: {"index", "ok", "send_ns", "end_ns", "events": [[ns, payload]]},
 * every event of the stream with the monotonic time its last byte arrived. */
static int write_dump(const char *file, const pdb_result *res, size_t n)
{
    FILE *f = fopen(file, "w");
    if (!f) return pd_error(PD_EIO, "--dump-timestamps %s: cannot create", file);
    int rc = PD_OK;
    for (size_t i = 0; i < n && rc == PD_OK; i++) {
        const pdb_result *r = &res[i];
        json_t *ev = json_array();
        for (size_t k = 0; k < r->n_ev; k++)
            json_array_append_new(
                ev, json_pack("[I,s]", (json_int_t)r->ev[k].ns, r->ev_text + r->ev[k].off));
        json_t *o =
            json_pack("{s:I,s:b,s:I,s:I,s:o}", "index", (json_int_t)i, "ok", r->ok, "send_ns",
                      (json_int_t)r->t_send, "end_ns", (json_int_t)r->t_end, "events", ev);
        char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
        if (!s || fprintf(f, "%s\n", s) < 0)
            rc = pd_error(PD_EIO, "--dump-timestamps %s: write failed", file);
        free(s);
        json_decref(o);
    }
    if (fclose(f) != 0 && rc == PD_OK)
        rc = pd_error(PD_EIO, "--dump-timestamps %s: write failed", file);
    return rc;
}

/* --node-stats: one Stats call to a pd-prefill/pd-decode instance, printed as one JSON line
 * (the soak test checks that the KV pools are whole again at the end). */
static int node_stats(const char *target, int timeout_s)
{
    pd_rpc_client *c = NULL;
    pd_rpc_channel *ch = NULL;
    uint8_t *resp = NULL, req[16];
    size_t rlen = 0;
    Pd__StatsRequest q = PD__STATS_REQUEST__INIT;
    size_t qlen = pd__stats_request__pack(&q, req);
    int rc = pd_rpc_client_create(&c);
    if (rc == PD_OK) rc = pd_rpc_channel_create(c, target, 0, &ch);
    if (rc == PD_OK)
        rc = pd_rpc_unary(ch, "/pd.PD/Stats", req, qlen, timeout_s * 1000, &resp, &rlen, NULL);
    if (ch) pd_rpc_channel_free(ch);
    if (c) pd_rpc_client_free(c);
    if (rc < 0) return pd_error_prefix(rc, "--node-stats %s", target);
    Pd__StatsReply *st = pd__stats_reply__unpack(NULL, rlen, resp);
    free(resp);
    if (!st) return pd_error(PD_EPARSE, "--node-stats %s: the Stats reply does not parse", target);
    json_t *o = json_pack(
        "{s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:b}", "num_running",
        (json_int_t)st->num_running, "num_waiting", (json_int_t)st->num_waiting, "num_held",
        (json_int_t)st->num_held, "kv_blocks_total", (json_int_t)st->kv_blocks_total,
        "kv_blocks_free", (json_int_t)st->kv_blocks_free, "num_preemptions",
        (json_int_t)st->num_preemptions, "queued_tokens", (json_int_t)st->queued_tokens,
        "running_tokens", (json_int_t)st->running_tokens, "reserved_tokens",
        (json_int_t)st->reserved_tokens, "leases_held", (json_int_t)st->leases_held,
        "kv_transfer_bytes", (json_int_t)st->kv_transfer_bytes, "prompt_tokens",
        (json_int_t)st->prompt_tokens, "requests_finished", (json_int_t)st->requests_finished,
        "prefix_cache_queries", (json_int_t)st->prefix_cache_queries, "prefix_cache_hits",
        (json_int_t)st->prefix_cache_hits, "draining", (int)st->draining);
    pd__stats_reply__free_unpacked(st, NULL);
    char *text = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!text) return pd_error(PD_ENOMEM, "out of memory");
    printf("%s\n", text);
    free(text);
    return PD_OK;
}

int main(int argc, char **argv)
{
    bench_args a;
    pdb_target t = {0};
    pdb_dataset d = {0};
    pdb_result *res = NULL, *wres = NULL;
    int64_t *arrive = NULL;
    summary m = {0};
    size_t n = 0, nw = 0;
    int rc = parse_args(argc, argv, &a);
    if (rc == 1) {
        usage(stdout);
        return 0;
    }
    if (rc < 0) {
        fprintf(stderr, "pd-bench: %s\n", pd_last_error());
        usage(stderr);
        return 2;
    }
    if (a.node_stats) {
        rc = node_stats(a.node_stats, (int)a.timeout_s);
        goto out;
    }
    PD_CHECK_GOTO(pdb_target_init(&t, a.base_url, a.endpoint), rc, out);
    t.model = a.model;
    t.api_key = a.api_key;
    t.timeout_s = (int)a.timeout_s;
    if (a.extra_body) {
        json_error_t je;
        t.extra_body = json_loads(a.extra_body, 0, &je);
        if (!json_is_object(t.extra_body)) {
            rc = pd_error(PD_EINVAL, "--extra-body: a JSON object is needed (%s)",
                          t.extra_body ? "not an object" : je.text);
            goto out;
        }
    }
    size_t n_prompts = (size_t)a.num_prompts;
    if (!strcmp(a.dataset, "random"))
        rc = pdb_dataset_random(&d, n_prompts, a.prefix_len, a.n_prefixes, a.input_len,
                                a.output_len, a.range_ratio, a.vocab,
                                t.endpoint == PDB_EP_COMPLETIONS && !a.mixed, (uint64_t)a.seed);
    else
        rc = pdb_dataset_jsonl(&d, a.dataset_path, n_prompts, a.output_len);
    if (rc < 0) goto out;
    if (a.mixed) PD_CHECK_GOTO(pdb_dataset_mix(&d, a.abort_ratio, (uint64_t)a.seed), rc, out);

    if (a.save_dataset) PD_CHECK_GOTO(write_dataset(a.save_dataset, &d), rc, out);
    /* Poisson process: exponential gaps with mean 1/rate (rng stream 3, one draw per request);
     * with --duration, as many requests as arrive before it ends */
    n = a.duration_s > 0 ? 0 : d.n;
    if (a.duration_s > 0) {
        for (double ts = 0.0;; n++) {
            ts += -log1p(-pd_rng_uniform((uint64_t)a.seed, (uint32_t)n, 0, 3)) / a.request_rate;
            if (ts >= a.duration_s || n >= UINT32_MAX) break;
        }
        if (n == 0) {
            rc = pd_error(PD_EINVAL, "--duration %g s at --request-rate %g: no request arrives",
                          a.duration_s, a.request_rate);
            goto out;
        }
    }
    res = calloc(n, sizeof *res);
    arrive = calloc(n, sizeof *arrive);
    if (!res || !arrive) {
        rc = pd_error(PD_ENOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++)
        PD_CHECK_GOTO(pdb_result_init(&res[i], d.items[i % d.n].output_len, a.dump_file != NULL),
                      rc, out);
    double tsum = 0.0;
    for (size_t i = 0; i < n; i++) {
        if (!isinf(a.request_rate)) {
            double u = pd_rng_uniform((uint64_t)a.seed, (uint32_t)i, 0, 3);
            tsum += -log1p(-u) / a.request_rate;
        }
        arrive[i] = (int64_t)(tsum * 1e9);
    }
    size_t workers = a.max_concurrency ? (size_t)a.max_concurrency : n;
    if (workers > n) workers = n;
    if (workers > 1024) workers = 1024;
    bool bar = !a.quiet && isatty(STDERR_FILENO);
    int64_t t0;

    if (a.warmup > 0) {
        nw = (size_t)a.warmup;
        wres = calloc(nw, sizeof *wres);
        int64_t *zero = calloc(nw, sizeof *zero);
        if (!wres || !zero) {
            free(zero);
            rc = pd_error(PD_ENOMEM, "out of memory");
            goto out;
        }
        for (size_t i = 0; i < nw; i++)
            if ((rc = pdb_result_init(&wres[i], d.items[i % d.n].output_len, false)) < 0) break;
        if (rc == 0) {
            if (!a.quiet) fprintf(stderr, "pd-bench: %zu warm-up requests\n", nw);
            rc = run_batch(&t, &d, wres, zero, nw, workers < nw ? workers : nw,
                           (uint64_t)a.seed + 1000000007ull, false, &t0);
        }
        free(zero);
        if (rc < 0) goto out;
        for (size_t i = 0; i < nw; i++)
            if (!wres[i].ok) {
                rc = pd_error(PD_EIO, "warm-up request %zu failed: %s", i, wres[i].error);
                goto out;
            }
    }

    if (!a.quiet)
        fprintf(stderr, "pd-bench: %zu requests to %s%s, %zu in flight at most\n", n, a.base_url,
                t.path, workers);
    PD_CHECK_GOTO(run_batch(&t, &d, res, arrive, n, workers, (uint64_t)a.seed, bar, &t0), rc, out);
    int64_t t_end = t0;
    for (size_t i = 0; i < n; i++)
        if (res[i].t_end > t_end) t_end = res[i].t_end;
    PD_CHECK_GOTO(summarize(&a, &d, res, n, (double)(t_end - t0) / 1e9, &m), rc, out);
    const char *first_error = NULL;
    for (size_t i = 0; i < n && !first_error; i++)
        if (!res[i].ok) first_error = res[i].error;
    print_report(&a, &m, first_error);
    if (a.result_file) PD_CHECK_GOTO(write_result(&a, &d, res, n, &m), rc, out);
    if (a.dump_file) PD_CHECK_GOTO(write_dump(a.dump_file, res, n), rc, out);
    rc = m.completed == 0
             ? pd_error(PD_EIO, "every request failed (first: %s)", first_error ? first_error : "?")
             : PD_OK;
out:
    if (rc < 0) fprintf(stderr, "pd-bench: %s\n", pd_last_error());
    json_decref(t.extra_body);
    summary_free(&m);
    for (size_t i = 0; res && i < n; i++) pdb_result_free(&res[i]);
    for (size_t i = 0; wres && i < nw; i++) pdb_result_free(&wres[i]);
    free(res);
    free(wres);
    free(arrive);
    pdb_dataset_free(&d);
    return rc < 0 ? 1 : 0;
}
