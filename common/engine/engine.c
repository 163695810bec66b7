/* The engine (engine.h): parameters, create / free and queries. A request's way through it is
 * in engine_request.c (adding, aborting, the inbox), engine_step.c (the step loop),
 * engine_ranks.c (the forward pass on every tensor-parallel rank) and engine_events.c (the output
 * queue); engine_internal.h holds what they share, with the threads and locks.
 *
 * Design: everything a step needs is sized here, at create: the backend group's ranks and their
 * forward passes, the KV pools (as many blocks as the group says fit), the step arrays, the event
 * slots and the sampler's workspace. Nothing here knows which backend the ranks run on.
 */
#include "engine/engine.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "engine/engine_internal.h"
#include "util/clock.h"
#include "util/log.h"
#include "util/status.h"

/* ---- defaults ------------------------------------------------------------------------------- */

pd_engine_params pd_engine_default_params(void)
{
    return (pd_engine_params){
        .model_dir = NULL,
        .model = NULL,
        .tok = NULL,
        .backend = NULL,
        .tp_size = 1,
        .pp_size = 1,
        .n_threads = 0,
        .n_cuda_devices = 0,
        .gpu_memory_utilization = 0.9,
        .dtype = -1,
        .block_size = 16,
        .kv_cache_bytes = 0,
        .cpu_kvcache_space_gib = PD_ENGINE_CPU_KVCACHE_SPACE_GIB,
        .max_kv_tokens = 0,
        .num_kv_blocks = 0,
        .enable_prefix_caching = true,
        .max_num_seqs = pd_sched_default_params().max_num_seqs, /* the batch scheduler's */
        .max_num_batched_tokens = 0,
        .max_model_len = 0,
        .max_prefill_chunk = 0,
        .spec_num_tokens = 0,
        .spec_ngram_max = 4,
        .spec_ngram_min = 1,
        .spec_disable_batch = 0,
        .spec_max_step_rows = 32,
        .seed = -1,
        .max_logprobs = 20,
        .prompt_logprob_rows = 128,
        .event_capacity = 0,
        .on_event = NULL,
        .on_event_ctx = NULL,
        .on_logits = NULL,
        .on_logits_ctx = NULL,
    };
}

/* ---- create / free ------------------------------------------------------------------------ */

static bool file_exists(const char *dir, const char *name)
{
    char path[4096];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

/* EOS ids (§7.1): the primary is the tokenizer's eos_token (else config.json's first); the
 * others come from generation_config.json (else config.json). */
static void setup_eos(pd_engine *e)
{
    const pd_model *m = e->model;
    int32_t primary = -1;
    if (e->tok) {
        const int32_t *ids;
        if (pd_tok_eos_ids(e->tok, &ids) > 0) primary = ids[0];
    }
    if (primary < 0 && m->config.n_eos_token_ids > 0) primary = (int32_t)m->config.eos_token_ids[0];
    const int64_t *extra = m->config.eos_token_ids;
    int n_extra = m->config.n_eos_token_ids;
    if (m->has_generation_config && m->generation.n_eos_token_ids > 0) {
        extra = m->generation.eos_token_ids;
        n_extra = m->generation.n_eos_token_ids;
    }
    e->n_eos = 0;
    if (primary >= 0) e->eos_ids[e->n_eos++] = primary;
    size_t first_extra = e->n_eos;
    for (int i = 0; i < n_extra && e->n_eos < PD_MAX_EOS_IDS + 1; i++) {
        int32_t id = (int32_t)extra[i];
        bool dup = false;
        for (size_t k = 0; k < e->n_eos; k++) dup |= e->eos_ids[k] == id;
        if (!dup && id >= 0 && (size_t)id < e->vocab) e->eos_ids[e->n_eos++] = id;
    }
    e->stop_model = (pd_stop_model){
        .eos_id = primary,
        .extra_eos_ids = e->eos_ids + first_extra,
        .n_extra_eos_ids = e->n_eos - first_extra,
        .max_model_len = (int64_t)e->p.max_model_len,
        .max_new_tokens = m->has_generation_config && m->generation.has_max_new_tokens
                              ? m->generation.max_new_tokens
                              : -1,
    };
}

size_t eng_max_out_rows(const pd_engine_params *p)
{
    return p->max_num_seqs + p->prompt_logprob_rows +
           (p->spec_num_tokens ? p->spec_max_step_rows : 0);
}

/* The scheduler's parameters, from the engine's (resolved by check_params). */
static pd_sched_params sched_params(const pd_engine_params *p)
{
    return (pd_sched_params){.max_num_seqs = p->max_num_seqs,
                             .max_num_batched_tokens = p->max_num_batched_tokens,
                             .max_model_len = p->max_model_len,
                             .chunked_prefill = p->enable_chunked_prefill,
                             .max_prefill_chunk = p->max_prefill_chunk,
                             .prefix_caching = p->enable_prefix_caching,
                             .max_prompt_logit_rows = p->prompt_logprob_rows};
}

static int check_params(pd_engine *e)
{
    pd_engine_params *p = &e->p;
    const pd_model_config *c = &e->model->config;
    if (p->pp_size == 0) p->pp_size = 1;
    const char *mb = getenv("PD_PP_MICRO_BATCHES");
    if (p->pp_micro_batches == 0 && mb && *mb) {
        char *end;
        long v = strtol(mb, &end, 10);
        if (*end || v < 1 || v > PD_ENGINE_MAX_PP)
            return pd_error(PD_EINVAL, "PD_PP_MICRO_BATCHES=%s: expected 1 to %d", mb,
                            PD_ENGINE_MAX_PP);
        p->pp_micro_batches = (int)v;
    }
    if (p->pp_micro_batches < 0 || p->pp_micro_batches > PD_ENGINE_MAX_PP)
        return pd_error(PD_EINVAL, "pp_micro_batches must be 0 to %d, got %d", PD_ENGINE_MAX_PP,
                        p->pp_micro_batches);
    size_t layer0, n;
    PD_CHECK(pd_engine_pp_layers((size_t)c->num_hidden_layers, p->pp_size, 0, &layer0, &n));
    if (p->pp_size > 1 && p->backend)
        return pd_error(PD_EINVAL, "pipeline parallel size %d needs a backend per rank",
                        p->pp_size);
    if (p->pp_size > 1 && p->n_cuda_devices && p->n_cuda_devices != p->tp_size * p->pp_size)
        return pd_error(PD_EINVAL,
                        "n_cuda_devices (%d) must be tensor_parallel_size x "
                        "pipeline_parallel_size (%d x %d)",
                        p->n_cuda_devices, p->tp_size, p->pp_size);
    pd_backend_group_params gp = eng_group_params(e, 0); /* reads the device fields only */
    PD_CHECK(pd_backend_group_check(&gp));
    if (c->num_attention_heads % p->tp_size)
        return pd_error(PD_EINVAL,
                        "Total number of attention heads (%lld) must be divisible by tensor "
                        "parallel size (%d).",
                        (long long)c->num_attention_heads, p->tp_size);
    if (p->block_size == 0) return pd_error(PD_EINVAL, "block_size must be at least 1");
    if (p->cpu_kvcache_space_gib > 1048576.0)
        return pd_error(PD_EINVAL, "cpu_kvcache_space_gib (%g) must be at most 1048576 (1 PiB)",
                        p->cpu_kvcache_space_gib);
    int64_t len = (int64_t)p->max_model_len;
    PD_CHECK(pd_model_resolve_max_len(c, &len));
    p->max_model_len = (size_t)len;
    if (p->max_num_batched_tokens == 0)
        p->max_num_batched_tokens = p->enable_chunked_prefill ? 512
                                    : p->max_model_len > 2048 ? p->max_model_len
                                                              : 2048;
    pd_sched_params sp = sched_params(p);
    PD_CHECK(pd_sched_check_params(&sp));
    if (p->max_logprobs < 0) return pd_error(PD_EINVAL, "max_logprobs must be >= 0");
    if (p->spec_num_tokens > PD_ENGINE_SPEC_MAX_TOKENS)
        return pd_error(PD_EINVAL, "num_speculative_tokens (%zu) must be at most %d",
                        p->spec_num_tokens, PD_ENGINE_SPEC_MAX_TOKENS);
    if (p->spec_num_tokens && (p->spec_ngram_min < 1 || p->spec_ngram_max < p->spec_ngram_min))
        return pd_error(PD_EINVAL,
                        "prompt_lookup_min (%zu) must be >= 1 and at most prompt_lookup_max (%zu)",
                        p->spec_ngram_min, p->spec_ngram_max);
    if (p->spec_num_tokens && p->spec_max_step_rows == 0)
        return pd_error(PD_EINVAL, "spec_max_step_rows must be at least 1");
    if (p->event_capacity == 0) p->event_capacity = 4 * p->max_num_seqs + 64;
    if (p->event_capacity < p->max_num_seqs + 1)
        return pd_error(PD_EINVAL, "event_capacity (%zu) must exceed max_num_seqs (%zu)",
                        p->event_capacity, p->max_num_seqs);
    return PD_OK;
}

static int create_kv(pd_engine *e)
{
    pd_engine_params *p = &e->p;
    size_t block_bytes = 0; /* of every rank together */
    for (int r = 0; r < e->n_ranks; r++) {
        pd_kv_params kr = pd_forward_kv_params(e->ranks[r].f, 0, p->block_size);
        block_bytes += pd_kv_block_bytes(&kr);
    }
    size_t n_blocks = p->num_kv_blocks;
    if (n_blocks == 0) {
        n_blocks = SIZE_MAX; /* what every stage's ranks hold (the block ids are shared) */
        for (int st = 0; st < e->pp; st++) {
            size_t n;
            pd_kv_params ks = pd_forward_kv_params(e->ranks[st * e->tp].f, 0, p->block_size);
            PD_CHECK(pd_backend_group_kv_blocks(e->groups[st], &ks, &n));
            if (n < n_blocks) n_blocks = n;
        }
        /* more than the workload can hold at once is never used: by default every sequence at
           full length; at least one sequence of max_model_len, which the check below needs */
        size_t useful = p->max_num_seqs * e->max_blocks_per_seq;
        if (p->max_kv_tokens > 0) {
            useful = (p->max_kv_tokens + p->block_size - 1) / p->block_size;
            if (useful < e->max_blocks_per_seq) useful = e->max_blocks_per_seq;
        }
        if (n_blocks > useful) n_blocks = useful;
    }
    PD_CHECK(pd_kv_check_capacity(n_blocks, p->block_size, (int64_t)p->max_model_len));
    for (int r = 0; r < e->n_ranks; r++) {
        pd_engine_rank *rk = &e->ranks[r];
        pd_kv_params kr = pd_forward_kv_params(rk->f, n_blocks, p->block_size);
        PD_CHECK(pd_backend_get_ops(rk->b)->kv_create(rk->b, &kr, &rk->kv));
        PD_CHECK(pd_forward_kv_init(rk->f, rk->kv));
        rk->bounce_bytes = pd_kv_block_bytes(&kr) / (size_t)kr.n_layers;
        rk->bounce = malloc(rk->bounce_bytes);
        if (rk->stage == e->pp - 1)
            rk->logits = malloc(eng_max_out_rows(p) * e->vocab * sizeof(float));
        if (!rk->bounce || (rk->stage == e->pp - 1 && !rk->logits))
            return pd_error(PD_ENOMEM, "engine: out of memory");
    }
    size_t tokens = n_blocks * p->block_size;
    if (e->kv_dtype >= 0 && !e->model->weights.kv_scales)
        PD_WARN("-", /* vLLM's warning, in its words */
                "Using KV cache scaling factor 1.0 for fp8_e4m3: the checkpoint stores no "
                "k_scale / v_scale. This may cause accuracy issues.");
    PD_INFO("-",
            "KV cache: %zu blocks x %zu tokens = %zu tokens (%.1f MiB per rank, %d rank(s)); "
            "maximum concurrency for %zu tokens per request: %.2fx",
            n_blocks, p->block_size, tokens,
            (double)(n_blocks * block_bytes) / (double)e->n_ranks / (1024.0 * 1024.0), e->n_ranks,
            p->max_model_len, (double)tokens / (double)p->max_model_len);
    size_t avail;
    if (p->n_cuda_devices == 0 && pd_kv_mem_available(&avail) == PD_OK &&
        n_blocks * block_bytes > avail)
        PD_WARN("-",
                "KV cache: %.1f MiB on the host is more than its MemAvailable (%.1f MiB); its "
                "pages are committed as they fill, so the host may run out of memory under load "
                "(set --kv-cache-bytes or VLLM_CPU_KVCACHE_SPACE)",
                (double)(n_blocks * block_bytes) / (1024.0 * 1024.0),
                (double)avail / (1024.0 * 1024.0));
    PD_CHECK(pd_kvpool_create(n_blocks, p->block_size, &e->pool));
    if (p->enable_prefix_caching) PD_CHECK(pd_kvpool_enable_prefix_cache(e->pool));
    return PD_OK;
}

static int create_buffers(pd_engine *e)
{
    pd_engine_params *p = &e->p;
    size_t S = p->max_num_seqs;
    e->st_tokens = malloc(p->max_num_batched_tokens * sizeof(int32_t));
    e->st_qindptr = malloc((S + 1) * sizeof(int32_t));
    e->st_kvlen = malloc(S * sizeof(int32_t));
    e->st_bindptr = malloc((S + 1) * sizeof(int32_t));
    e->st_blocks = malloc(S * e->max_blocks_per_seq * sizeof(int32_t));
    e->st_outrows = malloc(eng_max_out_rows(p) * sizeof(int32_t));
    e->spec_drafts = malloc(S * (p->spec_num_tokens ? p->spec_num_tokens : 1) * sizeof(int32_t));
    e->item_out = malloc(S * sizeof(int32_t));
    e->item_lp_out = malloc(S * sizeof(int32_t));
    e->cap = p->event_capacity;
    e->slots = calloc(e->cap, sizeof *e->slots);
    if (!e->st_tokens || !e->st_qindptr || !e->st_kvlen || !e->st_bindptr || !e->st_blocks ||
        !e->st_outrows || !e->item_out || !e->item_lp_out || !e->spec_drafts || !e->slots)
        return pd_error(PD_ENOMEM, "engine: out of memory for step buffers");
    size_t k = p->max_logprobs > 0 ? (size_t)p->max_logprobs : 1;
    for (size_t i = 0; i < e->cap; i++) {
        ev_slot *sl = &e->slots[i];
        sl->top_ids = malloc(k * sizeof *sl->top_ids);
        sl->top_lp = malloc(k * sizeof *sl->top_lp);
        sl->blocks = malloc(e->max_blocks_per_seq * sizeof *sl->blocks);
        if (!sl->top_ids || !sl->top_lp || !sl->blocks)
            return pd_error(PD_ENOMEM, "engine: out of memory for the output queue");
    }
    /* top-N logprobs for the logprobs field, and 2 x best_of for a beam search's candidates */
    size_t ws_top = p->max_logprobs > 2 * (int64_t)S ? (size_t)p->max_logprobs : 2 * S;
    PD_CHECK(pd_sampler_ws_create((int32_t)e->vocab, (int32_t)ws_top, &e->ws));
    return PD_OK;
}

int pd_engine_create(const pd_engine_params *params, pd_engine **out)
{
    *out = NULL;
    pd_engine *e = calloc(1, sizeof *e);
    if (!e) return pd_error(PD_ENOMEM, "engine: out of memory");
    e->p = *params;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->work_cv, NULL);
    pthread_mutex_init(&e->qmu, NULL);
    pthread_cond_init(&e->qcv, NULL);
    pthread_mutex_init(&e->rmu, NULL);
    pthread_cond_init(&e->rcv, NULL);
    pthread_mutex_init(&e->gmu, NULL);
    pthread_mutex_init(&e->mmu, NULL);
    pthread_cond_init(&e->mcv, NULL);
    atomic_init(&e->stop_req, false);
    int rc = PD_OK;
    PD_CHECK_GOTO(pd_idmap_init(&e->reqs, REQ_BUCKETS), rc, fail);
    if (e->p.model_dir) {
        PD_CHECK_GOTO(pd_model_load(e->p.model_dir, &e->own_model), rc, fail);
        e->model = e->own_model;
    } else if (e->p.model) {
        e->model = e->p.model;
    } else {
        rc = pd_error(PD_EINVAL, "engine: give params.model_dir or params.model");
        goto fail;
    }
    e->p.model = NULL;
    char cfg_file[4096];
    snprintf(cfg_file, sizeof cfg_file, "%s/config.json", e->model->dir ? e->model->dir : ".");
    PD_CHECK_GOTO(pd_quant_check_flag(e->p.quantization, &e->model->config.quant, cfg_file), rc,
                  fail);
    PD_CHECK_GOTO(pd_kv_cache_dtype_parse(e->p.kv_cache_dtype, &e->kv_dtype), rc, fail);
    e->tok = e->p.tok;
    /* a tokenizer named by --tokenizer must load; the model's own is optional */
    const char *tok_dir = e->p.tokenizer_dir ? e->p.tokenizer_dir : e->p.model_dir;
    if (!e->tok && tok_dir && (e->p.tokenizer_dir || file_exists(tok_dir, "tokenizer.json"))) {
        PD_CHECK_GOTO(pd_tok_load(tok_dir, &e->own_tok), rc, fail);
        e->tok = e->own_tok;
    }
    if (!e->tok && e->p.require_tokenizer) {
        rc = pd_error(PD_ENOTFOUND,
                      "%s/tokenizer.json: No such file or directory (answers are detokenized "
                      "here: give --tokenizer DIR)",
                      tok_dir ? tok_dir : ".");
        goto fail;
    }
    PD_CHECK_GOTO(check_params(e), rc, fail);
    e->tp = e->p.tp_size;
    e->pp = e->p.pp_size;
    e->n_ranks = e->tp * e->pp;
    e->hidden = (size_t)e->model->config.hidden_size;
    e->max_blocks_per_seq = (e->p.max_model_len + e->p.block_size - 1) / e->p.block_size;
    PD_CHECK_GOTO(eng_ranks_create(e), rc, fail);
    e->vocab = pd_forward_vocab(e->ranks[0].f);
    e->out = &e->ranks[(e->pp - 1) * e->tp];
    setup_eos(e);
    PD_CHECK_GOTO(create_kv(e), rc, fail);
    pd_sched_params sp = sched_params(&e->p);
    PD_CHECK_GOTO(pd_sched_create(&sp, e->pool, &e->sched), rc, fail);
    PD_CHECK_GOTO(create_buffers(e), rc, fail);
    PD_CHECK_GOTO(eng_ranks_start(e), rc, fail);
    e->stats.block_size = e->p.block_size;
    PD_INFO("-",
            "engine: %s, tp %d, pp %d, max_model_len %zu, max_num_seqs %zu, "
            "max_num_batched_tokens %zu, vocab %zu, %s",
            pd_arch_name(e->model->config.arch), e->tp, e->pp, e->p.max_model_len,
            e->p.max_num_seqs, e->p.max_num_batched_tokens, e->vocab,
            e->tok ? "with tokenizer" : "no tokenizer");
    if (e->p.spec_num_tokens)
        PD_INFO("-",
                "speculative decoding: [ngram], %zu draft tokens per step, n-grams of %zu to %zu, "
                "while steps have at most %zu rows%s",
                e->p.spec_num_tokens, e->p.spec_ngram_min, e->p.spec_ngram_max,
                e->p.spec_max_step_rows, e->p.spec_disable_batch ? " and fewer sequences run" : "");
    *out = e;
    return PD_OK;
fail:
    pd_engine_free(e);
    return rc;
}

void pd_engine_free(pd_engine *e)
{
    if (!e) return;
    pd_engine_stop(e);
    pthread_mutex_lock(&e->mu);
    e->closing = true;
    for (pd_idmap_link *l; (l = pd_idmap_first(&e->reqs));) {
        pd_idmap_del(&e->reqs, l);
        eng_req_free(e, PD_IDMAP_ENTRY(l, eng_req, link));
    }
    pd_idmap_free(&e->reqs);
    pthread_mutex_unlock(&e->mu);
    pd_sched_free(e->sched);
    pd_kvpool_free(e->pool);
    eng_ranks_free(e);
    pd_model_free(e->own_model);
    pd_tok_free(e->own_tok);
    if (e->slots) {
        for (size_t i = 0; i < e->cap; i++) {
            free(e->slots[i].text);
            free(e->slots[i].tokens);
            free(e->slots[i].stop_str);
            free(e->slots[i].top_ids);
            free(e->slots[i].top_lp);
            free(e->slots[i].beam_lp);
            free(e->slots[i].beam_top_ids);
            free(e->slots[i].beam_top_lp);
            free(e->slots[i].blocks);
            free(e->slots[i].plp);
        }
        free(e->slots);
    }
    free(e->st_tokens);
    free(e->st_qindptr);
    free(e->st_kvlen);
    free(e->st_bindptr);
    free(e->st_blocks);
    free(e->st_outrows);
    free(e->item_out);
    free(e->item_lp_out);
    free(e->spec_drafts);
    pd_sampler_ws_free(e->ws);
    eng_masks_stop(e);
    pd_gcache_free(e->gcache);
    pd_gvocab_free(e->gvocab);
    pthread_mutex_destroy(&e->gmu);
    pthread_mutex_destroy(&e->mmu);
    pthread_cond_destroy(&e->mcv);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->work_cv);
    pthread_mutex_destroy(&e->qmu);
    pthread_cond_destroy(&e->qcv);
    pthread_mutex_destroy(&e->rmu);
    pthread_cond_destroy(&e->rcv);
    free(e);
}

/* ---- queries ------------------------------------------------------------------------------- */

void pd_engine_get_stats(pd_engine *e, pd_engine_stats *out)
{
    pthread_mutex_lock(&e->mu);
    *out = e->stats;
    out->num_running = pd_sched_num_running(e->sched);
    out->num_waiting = pd_sched_num_waiting(e->sched);
    out->num_held = e->n_held;
    out->queued_tokens = pd_sched_num_queued_tokens(e->sched);
    out->num_preemptions = pd_sched_num_preemptions(e->sched);
    out->kv_blocks_total = pd_kvpool_num_blocks(e->pool);
    out->kv_blocks_free = pd_kvpool_num_free(e->pool);
    out->kv_blocks_cached = pd_kvpool_num_cached(e->pool);
    pd_sched_prefix_cache_stats(e->sched, &out->prefix_cache_queries, &out->prefix_cache_hits);
    out->block_size = e->p.block_size;
    pthread_mutex_unlock(&e->mu);
    for (int s = 0; s < e->pp; s++)
        out->stage_seconds[s] =
            (double)atomic_load_explicit(&e->ranks[s * e->tp].busy_ns, memory_order_relaxed) /
            PD_NS_PER_S;
}

size_t pd_engine_max_model_len(const pd_engine *e)
{
    return e->p.max_model_len;
}
size_t pd_engine_block_size(const pd_engine *e)
{
    return e->p.block_size;
}
pd_dtype pd_engine_kv_dtype(const pd_engine *e)
{
    return pd_forward_kv_params(e->ranks[0].f, 0, e->p.block_size).dtype;
}
size_t pd_engine_vocab(const pd_engine *e)
{
    return e->vocab;
}
const char *pd_engine_allreduce_name(const pd_engine *e)
{
    return pd_backend_group_allreduce_name(e->groups[0]);
}

int pd_engine_tp_size(const pd_engine *e)
{
    return e->tp;
}
int pd_engine_pp_size(const pd_engine *e)
{
    return e->pp;
}
const pd_tok *pd_engine_tokenizer(const pd_engine *e)
{
    return e->tok;
}
const pd_model_config *pd_engine_model_config(const pd_engine *e)
{
    return &e->model->config;
}

pd_backend *pd_engine_backend(const pd_engine *e, int rank)
{
    return rank >= 0 && rank < e->n_ranks ? e->ranks[rank].b : NULL;
}

pd_kv_params pd_engine_rank_kv(const pd_engine *e, int rank, size_t *layer0)
{
    const pd_forward *f = e->ranks[rank].f;
    *layer0 = pd_forward_layer0(f);
    return pd_forward_kv_params(f, pd_kvpool_num_blocks(e->pool), e->p.block_size);
}

pd_kv *pd_engine_kv(const pd_engine *e, int rank)
{
    return rank >= 0 && rank < e->n_ranks ? e->ranks[rank].kv : NULL;
}
