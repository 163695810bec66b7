/* pd-scheduler: /metrics in Prometheus text: vLLM's series (so existing dashboards work) and
 * pd:* series for KV transfer and instance health.
 *
 * Design: counters and histograms of requests are updated where their events happen
 * (server_request.c); the gauges, the info gauge, and the series that follow the instances'
 * cumulative Stats (the engines' queues, steps, preemptions, prefix cache) are computed when
 * /metrics is read, so no timer runs for them. The engine-side figures are a heartbeat old.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server_internal.h"
#include "util/status.h"

/* Counter m follows a cluster-wide cumulative figure: it grows by what the figure grew since
 * *seen (an instance that restarts from 0 lowers the figure; the counter waits until it is
 * passed again). */
static void follow_counter(pd_metric *m, const char *const *labels, int64_t now, int64_t *seen)
{
    if (now <= *seen) return;
    pd_metric_inc(m, labels, (double)(now - *seen));
    *seen = now;
}

static const double ITER_BUCKETS[] = {1,   8,    16,   32,   64,   128,  256,
                                      512, 1024, 2048, 4096, 8192, 16384};
#define NB(a) (sizeof(a) / sizeof *(a))

/* vllm:iteration_tokens_total grows by the engine steps the instances ran since the last read:
 * each power-of-two bin of StatsReply.step_tokens goes to the first bucket at or above its
 * upper end (exact, the buckets being powers of two), the last bin to +Inf. */
static void follow_steps(pd_apiserver *s)
{
    int64_t bins[PD_ENGINE_STEP_BINS], sum;
    pd_reg_step_tokens(s->reg, bins, &sum);
    double counts[NB(ITER_BUCKETS) + 1] = {0};
    bool grew = false;
    for (size_t i = 0; i < PD_ENGINE_STEP_BINS; i++) {
        if (bins[i] <= s->steps_seen[i]) continue;
        size_t j = 0; /* bin i holds 2^(i-1) < t <= 2^i */
        while (j < NB(ITER_BUCKETS) && ITER_BUCKETS[j] < (double)((int64_t)1 << i)) j++;
        if (i + 1 == PD_ENGINE_STEP_BINS) j = NB(ITER_BUCKETS); /* every larger t */
        counts[j] += (double)(bins[i] - s->steps_seen[i]);
        s->steps_seen[i] = bins[i];
        grew = true;
    }
    if (!grew) return;
    pd_metric_merge(s->m_iter, s->labels, counts, NB(counts), (double)(sum - s->steps_sum_seen));
    s->steps_sum_seen = sum;
}

/* vllm:cache_config_info: 1 per instance whose Info was read, its KV cache configuration in the
 * labels (vLLM's names and value spellings). Rebuilt on each read: a restarted instance may
 * bring another. */
static void cache_config(pd_apiserver *s)
{
    pd_metric_clear(s->m_cache_info);
    pd_metric_clear(s->m_stage);
    for (int k = 0; k < pd_reg_count(s->reg); k++) {
        pd_reg_cache_info ci;
        if (!pd_reg_cache_config(s->reg, k, &ci)) continue;
        char bs[16], nb[24];
        snprintf(bs, sizeof bs, "%d", ci.block_size);
        snprintf(nb, sizeof nb, "%lld", (long long)ci.num_blocks);
        const char *lv[8] = {s->labels[0],
                             s->labels[1],
                             rt_role_name(pd_reg_role(s->reg, k)),
                             pd_reg_name(s->reg, k),
                             bs,
                             ci.kv_dtype,
                             ci.prefix_caching ? "True" : "False",
                             nb};
        pd_metric_set(s->m_cache_info, lv, 1);
        /* pd:pipeline_stage_seconds_total: this process's, as the instance counts it (a
           restarted instance starts again from 0, a counter reset) */
        double sec[PD_ENGINE_MAX_PP];
        int n = pd_reg_stage_seconds(s->reg, k, sec);
        for (int st = 0; st < n; st++) {
            char stage[12];
            snprintf(stage, sizeof stage, "%d", st);
            const char *sl[4] = {s->labels[0], rt_role_name(pd_reg_role(s->reg, k)),
                                 pd_reg_name(s->reg, k), stage};
            pd_metric_set(s->m_stage, sl, sec[st]);
        }
    }
}

/* Sequences not handed to an instance yet: choices in the admission queue (waiting for decode KV
 * room) and the choices of n > 1 deferred until their leader's prompt is cached. */
static int64_t waiting_here(const pd_apiserver *s)
{
    int64_t n = 0;
    for (const sreq *r = s->live; r; r = r->next)
        for (int i = 0; !r->done && i < r->n_choices; i++)
            n += r->choices[i].in_queue || r->choices[i].deferred;
    return n;
}

void srv_handle_metrics(pd_apiserver *s, pd_http_exchange *ex)
{
    int64_t running, waiting;
    pd_reg_queues(s->reg, &running, &waiting);
    pd_metric_set(s->m_running, s->labels, (double)running);
    pd_metric_set(s->m_waiting, s->labels, (double)(waiting + waiting_here(s)));
    follow_steps(s);
    cache_config(s);
    double unsent = 0;
    for (const sreq *r = s->live; r; r = r->next)
        unsent += (double)r->out.len + (r->ex ? (double)pd_http_stream_pending(r->ex) : 0.0);
    pd_metric_set(s->m_unsent, s->labels, unsent); /* its one label: model_name */
    double kv = pd_reg_kv_usage(s->reg);
    pd_metric_set(s->m_kv, s->labels, kv);
    pd_metric_set(s->m_gpu_kv, s->labels, kv);
    follow_counter(s->m_preempt, s->labels, pd_reg_preemptions(s->reg), &s->preempt_seen);
    int64_t cq, ch;
    pd_reg_prefix_cache(s->reg, &cq, &ch);
    follow_counter(s->m_cache_q, s->labels, cq, &s->cache_q_seen);
    follow_counter(s->m_cache_h, s->labels, ch, &s->cache_h_seen);
    pd_reg_spec sp;
    pd_reg_spec_totals(s->reg, &sp);
    follow_counter(s->m_spec_drafts, s->labels, sp.drafts, &s->spec_seen.drafts);
    follow_counter(s->m_spec_draft_tokens, s->labels, sp.draft_tokens, &s->spec_seen.draft_tokens);
    follow_counter(s->m_spec_accepted, s->labels, sp.accepted, &s->spec_seen.accepted);
    for (int i = 0; i < PD_ENGINE_SPEC_MAX_TOKENS; i++) {
        if (sp.per_pos[i] == 0) continue; /* positions past num_speculative_tokens stay out */
        char pos[8];
        snprintf(pos, sizeof pos, "%d", i);
        const char *lv[3] = {s->labels[0], s->labels[1], pos};
        follow_counter(s->m_spec_pos, lv, sp.per_pos[i], &s->spec_seen.per_pos[i]);
    }
    char *text = pd_metrics_render(s->m);
    if (!text) {
        pd_http_respond_error(ex, 500, "out of memory", NULL);
        return;
    }
    pd_http_respond(ex, 200, "text/plain; version=0.0.4; charset=utf-8", text, strlen(text), NULL);
    free(text);
}

/* ---- metrics registration -------------------------------------------------------------------- */

static const double LAT_BUCKETS[] = {0.3,  0.5,   0.8,   1.0,   1.5,   2.0,    2.5,
                                     5.0,  10.0,  15.0,  20.0,  30.0,  40.0,   50.0,
                                     60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
static const double TTFT_BUCKETS[] = {0.001, 0.005, 0.01, 0.02,  0.04,  0.06,  0.08, 0.1,
                                      0.25,  0.5,   0.75, 1.0,   2.5,   5.0,   7.5,  10.0,
                                      20.0,  40.0,  80.0, 160.0, 640.0, 2560.0};
static const double TPOT_BUCKETS[] = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,  0.4, 0.5,
                                      0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
static const double N_BUCKETS[] = {1, 2, 5, 10, 20};
static const double KV_BUCKETS[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                                    0.25,  0.5,    1.0,   2.5,  5.0,   10.0, 30.0};

int srv_metrics_init(pd_apiserver *s)
{
    s->m = pd_metrics_create();
    if (!s->m) return pd_error(PD_ENOMEM, "metrics: out of memory");
    s->labels[0] = srv_model_name(s);
    s->labels[1] = "0";
    double b125[64];
    size_t n125 = pd_metrics_125_buckets((double)s->L, b125, 64);
    const char *ml = "model_name,engine";
    pd_metrics *m = s->m;
#define ADD(var, type, name, help, labels, b, nb)                                                  \
    do {                                                                                           \
        if (!(var = pd_metrics_add(m, type, name, help, labels, b, nb))) return PD_EINVAL;         \
    } while (0)
    ADD(s->m_running, PD_METRIC_GAUGE, "vllm:num_requests_running",
        "Number of requests in model execution batches.", ml, NULL, 0);
    ADD(s->m_waiting, PD_METRIC_GAUGE, "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.", ml, NULL, 0);
    ADD(s->m_kv, PD_METRIC_GAUGE, "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.", ml, NULL, 0);
    ADD(s->m_gpu_kv, PD_METRIC_GAUGE, "vllm:gpu_cache_usage_perc",
        "GPU KV-cache usage. 1 means 100 percent usage.", ml, NULL, 0);
    ADD(s->m_preempt, PD_METRIC_COUNTER, "vllm:num_preemptions_total",
        "Cumulative number of preemption from the engine.", ml, NULL, 0);
    ADD(s->m_cache_q, PD_METRIC_COUNTER, "vllm:prefix_cache_queries_total",
        "Prefix cache queries, in terms of number of queried tokens.", ml, NULL, 0);
    ADD(s->m_cache_h, PD_METRIC_COUNTER, "vllm:prefix_cache_hits_total",
        "Prefix cache hits, in terms of number of cached tokens.", ml, NULL, 0);
    ADD(s->m_spec_drafts, PD_METRIC_COUNTER, "vllm:spec_decode_num_drafts_total",
        "Number of spec decoding drafts.", ml, NULL, 0);
    ADD(s->m_spec_draft_tokens, PD_METRIC_COUNTER, "vllm:spec_decode_num_draft_tokens_total",
        "Number of draft tokens.", ml, NULL, 0);
    ADD(s->m_spec_accepted, PD_METRIC_COUNTER, "vllm:spec_decode_num_accepted_tokens_total",
        "Number of accepted tokens.", ml, NULL, 0);
    ADD(s->m_spec_pos, PD_METRIC_COUNTER, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "Accepted tokens per draft position.", "model_name,engine,position", NULL, 0);
    ADD(s->m_prompt, PD_METRIC_COUNTER, "vllm:prompt_tokens_total",
        "Number of prefill tokens processed.", ml, NULL, 0);
    ADD(s->m_gen, PD_METRIC_COUNTER, "vllm:generation_tokens_total",
        "Number of generation tokens processed.", ml, NULL, 0);
    ADD(s->m_success, PD_METRIC_COUNTER, "vllm:request_success_total",
        "Count of successfully processed requests.", "model_name,engine,finished_reason", NULL, 0);
    ADD(s->m_h_prompt, PD_METRIC_HISTOGRAM, "vllm:request_prompt_tokens",
        "Number of prefill tokens processed.", ml, b125, n125);
    ADD(s->m_h_gen, PD_METRIC_HISTOGRAM, "vllm:request_generation_tokens",
        "Number of generation tokens processed.", ml, b125, n125);
    ADD(s->m_iter, PD_METRIC_HISTOGRAM, "vllm:iteration_tokens_total",
        "Histogram of number of tokens per engine_step.", ml, ITER_BUCKETS, NB(ITER_BUCKETS));
    ADD(s->m_h_max_gen, PD_METRIC_HISTOGRAM, "vllm:request_max_num_generation_tokens",
        "Histogram of maximum number of requested generation tokens.", ml, b125, n125);
    ADD(s->m_h_n, PD_METRIC_HISTOGRAM, "vllm:request_params_n",
        "Histogram of the n request parameter.", ml, N_BUCKETS, NB(N_BUCKETS));
    ADD(s->m_h_best_of, PD_METRIC_HISTOGRAM, "vllm:request_params_best_of",
        "Histogram of the best_of request parameter.", ml, N_BUCKETS, NB(N_BUCKETS));
    ADD(s->m_h_max, PD_METRIC_HISTOGRAM, "vllm:request_params_max_tokens",
        "Histogram of the max_tokens request parameter.", ml, b125, n125);
    ADD(s->m_ttft, PD_METRIC_HISTOGRAM, "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.", ml, TTFT_BUCKETS, NB(TTFT_BUCKETS));
    ADD(s->m_tpot, PD_METRIC_HISTOGRAM, "vllm:time_per_output_token_seconds",
        "Histogram of time per output token in seconds.", ml, TPOT_BUCKETS, NB(TPOT_BUCKETS));
    ADD(s->m_itl, PD_METRIC_HISTOGRAM, "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.", ml, TPOT_BUCKETS, NB(TPOT_BUCKETS));
    ADD(s->m_req_tpot, PD_METRIC_HISTOGRAM, "vllm:request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.", ml, TPOT_BUCKETS,
        NB(TPOT_BUCKETS));
    ADD(s->m_e2e, PD_METRIC_HISTOGRAM, "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.", ml, LAT_BUCKETS, NB(LAT_BUCKETS));
    ADD(s->m_queue, PD_METRIC_HISTOGRAM, "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.", ml, LAT_BUCKETS, NB(LAT_BUCKETS));
    ADD(s->m_prefill, PD_METRIC_HISTOGRAM, "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.", ml, LAT_BUCKETS, NB(LAT_BUCKETS));
    ADD(s->m_decode, PD_METRIC_HISTOGRAM, "vllm:request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.", ml, LAT_BUCKETS, NB(LAT_BUCKETS));
    ADD(s->m_infer, PD_METRIC_HISTOGRAM, "vllm:request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.", ml, LAT_BUCKETS, NB(LAT_BUCKETS));
    ADD(s->m_cache_info, PD_METRIC_GAUGE, "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        "model_name,engine,role,instance,block_size,cache_dtype,enable_prefix_caching,"
        "num_gpu_blocks",
        NULL, 0);
    ADD(s->m_kv_bytes, PD_METRIC_COUNTER, "pd:kv_transfer_bytes_total",
        "KV payload bytes moved from prefill to decode.",
        "model_name,transport,prefill_instance,decode_instance", NULL, 0);
    ADD(s->m_kv_secs, PD_METRIC_HISTOGRAM, "pd:kv_transfer_seconds",
        "Per request KV transfer time in seconds.",
        "model_name,transport,prefill_instance,decode_instance", KV_BUCKETS, NB(KV_BUCKETS));
    ADD(s->m_up, PD_METRIC_GAUGE, "pd:instance_up", "1 while the instance is in the routing set.",
        "role,instance", NULL, 0);
    ADD(s->m_stage, PD_METRIC_COUNTER, "pd:pipeline_stage_seconds_total",
        "Seconds each pipeline stage of an instance spent computing its part of the steps.",
        "model_name,role,instance,stage", NULL, 0);
    ADD(s->m_unsent, PD_METRIC_GAUGE, "pd:stream_unsent_bytes",
        "Bytes of streamed responses held for clients that read slowly (relay and HTTP layer).",
        "model_name", NULL, 0);
#undef ADD
    pd_metric *zero[] = {s->m_running, s->m_waiting,   s->m_kv,        s->m_gpu_kv,  s->m_preempt,
                         s->m_prompt,  s->m_gen,       s->m_h_prompt,  s->m_h_gen,   s->m_h_n,
                         s->m_h_max,   s->m_ttft,      s->m_tpot,      s->m_e2e,     s->m_queue,
                         s->m_prefill, s->m_decode,    s->m_infer,     s->m_cache_q, s->m_cache_h,
                         s->m_iter,    s->m_h_max_gen, s->m_h_best_of, s->m_itl,     s->m_req_tpot};
    for (size_t i = 0; i < NB(zero); i++) pd_metric_touch(zero[i], s->labels);
    pd_metric_touch(s->m_unsent, s->labels);
    static const char *const reasons[] = {"stop", "length", "abort"};
    for (size_t i = 0; i < 3; i++) {
        const char *lv[3] = {s->labels[0], s->labels[1], reasons[i]};
        pd_metric_touch(s->m_success, lv);
    }
    for (int k = 0; k < pd_reg_count(s->reg); k++) {
        const char *lv[2] = {rt_role_name(pd_reg_role(s->reg, k)), pd_reg_name(s->reg, k)};
        pd_metric_touch(s->m_up, lv);
    }
    return PD_OK;
}
