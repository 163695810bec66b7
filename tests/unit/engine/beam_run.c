/* beam_run: runs one beam search request through the engine and prints its answer as JSON in
 * tests/reference/beam_ref.py's shape, for test_beam.py to compare with that reference.
 *
 *   beam_run --model DIR --prompt-ids 1,2,3 --width W [--n N] --max-tokens M
 *            [--length-penalty X] [--early-stopping false|true|never] [--ignore-eos]
 *            [--stop-token-ids 5,6] [--max-model-len L] [--abort-after-steps K]
 *            [--copies C] [--num-kv-blocks B] [--split] [--logprobs K]
 *
 * Prints {"beams": [{"tokens", "cumulative_logprob", "score", "finish_reason"}, ...],
 * "kv_blocks_free_start", "kv_blocks_free_end", "kv_blocks_peak_used", "block_size",
 * "statuses": [...], "preemptions"}: the free blocks of the pool before the request and after it
 * ended, the most blocks in use after any step, each choice's final status (0, or PD_ECANCELLED
 * after --abort-after-steps K aborted it after K steps) and the engine's preemptions. --copies C
 * runs C copies of the request at once (they must answer alike; copy 0 is printed), in a pool of
 * --num-kv-blocks B blocks (4096). The engine runs on 2 threads with the model's EOS
 * (config.json's eos_token_id when the model directory has no tokenizer).
 * --logprobs K asks each token's logprob and K top ones: every beam then has "logprobs":
 * [[logprob, [[id, logprob], ...K]], ...] per token. --split runs each copy as the nodes of a split
 * deployment do (docs/beam_search.md): a second engine prefills the prompt as a plain prefill-only
 * request, the search's engine reserves the prompt's blocks, the KV moves between them (kv_export /
 * kv_import), and the search is admitted with pd_engine_add_imported, which computes the prompt's
 * last position again.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "kv_move.h"
#include "util/args.h"
#include "util/log.h"
#include "util/status.h"

#define MAX_IDS 1024
#define MAX_W   64
#define MAX_C   8

typedef struct {
    const char *model;
    int32_t prompt[MAX_IDS], stop_ids[MAX_IDS];
    size_t n_prompt, n_stop_ids;
    int64_t width, n, max_tokens, max_model_len, abort_after, copies, kv_blocks, logprobs;
    double length_penalty;
    int32_t early;
    bool ignore_eos, split;
} args_t;

typedef struct {
    int32_t *toks;
    float *lps;      /* (n) with --logprobs */
    int32_t *top_id; /* (n, k) */
    float *top_lp;   /* (n, k) */
    int32_t k;
    size_t n;
    double cum;
    const char *finish;
    int status;
    bool done;
} choice_t;

static int parse_list(const char *flag, const char *s, int32_t *out, size_t *n)
{
    *n = 0;
    while (*s) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < 0 || *n == MAX_IDS)
            return pd_error(PD_EINVAL, "%s: expected comma-separated ids, got \"%s\"", flag, s);
        out[(*n)++] = (int32_t)v;
        s = *end == ',' ? end + 1 : end;
    }
    return PD_OK;
}

static int parse(int argc, char **argv, args_t *a)
{
    *a = (args_t){.n = 1,
                  .length_penalty = 1.0,
                  .abort_after = -1,
                  .copies = 1,
                  .kv_blocks = 4096,
                  .logprobs = -1};
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        if (!strcmp(o, "--ignore-eos") || !strcmp(o, "--split")) {
            *(!strcmp(o, "--split") ? &a->split : &a->ignore_eos) = true;
            continue;
        }
        if (i + 1 >= argc) return pd_error(PD_EINVAL, "%s: missing value", o);
        const char *v = argv[++i];
        if (!strcmp(o, "--model"))
            a->model = v;
        else if (!strcmp(o, "--prompt-ids"))
            PD_CHECK(parse_list(o, v, a->prompt, &a->n_prompt));
        else if (!strcmp(o, "--stop-token-ids"))
            PD_CHECK(parse_list(o, v, a->stop_ids, &a->n_stop_ids));
        else if (!strcmp(o, "--width"))
            PD_CHECK(pd_arg_i64(o, v, 1, MAX_W, &a->width));
        else if (!strcmp(o, "--n"))
            PD_CHECK(pd_arg_i64(o, v, 1, MAX_W, &a->n));
        else if (!strcmp(o, "--max-tokens"))
            PD_CHECK(pd_arg_i64(o, v, 1, INT64_MAX, &a->max_tokens));
        else if (!strcmp(o, "--max-model-len"))
            PD_CHECK(pd_arg_i64(o, v, 2, INT64_MAX, &a->max_model_len));
        else if (!strcmp(o, "--copies"))
            PD_CHECK(pd_arg_i64(o, v, 1, MAX_C, &a->copies));
        else if (!strcmp(o, "--num-kv-blocks"))
            PD_CHECK(pd_arg_i64(o, v, 1, 1 << 20, &a->kv_blocks));
        else if (!strcmp(o, "--logprobs"))
            PD_CHECK(pd_arg_i64(o, v, 0, 20, &a->logprobs));
        else if (!strcmp(o, "--abort-after-steps"))
            PD_CHECK(pd_arg_i64(o, v, 0, INT64_MAX, &a->abort_after));
        else if (!strcmp(o, "--length-penalty"))
            PD_CHECK(pd_arg_f64(o, v, &a->length_penalty));
        else if (!strcmp(o, "--early-stopping")) {
            if (!strcmp(v, "false"))
                a->early = PD_EARLY_STOPPING_FALSE;
            else if (!strcmp(v, "true"))
                a->early = PD_EARLY_STOPPING_TRUE;
            else if (!strcmp(v, "never"))
                a->early = PD_EARLY_STOPPING_NEVER;
            else
                return pd_error(PD_EINVAL, "--early-stopping: expected false, true or never");
        } else
            return pd_error(PD_EINVAL, "unknown option %s", o);
    }
    if (!a->model || !a->n_prompt || !a->width || !a->max_tokens)
        return pd_error(PD_EINVAL, "--model, --prompt-ids, --width and --max-tokens are required");
    return PD_OK;
}

/* Drains the events into the choices (c[copy * n + choice]; request ids "beam-<copy>");
 * *n_done counts the final ones. */
static int drain(pd_engine *e, choice_t *c, int64_t copies, int64_t n, int64_t *n_done)
{
    const pd_engine_event *ev;
    while (pd_engine_next_event(e, &ev)) {
        int rc = PD_OK;
        long k = strtol(ev->request_id + 5, NULL, 10);
        choice_t *ch = k >= 0 && k < copies && ev->seq_index < n ? &c[k * n + ev->seq_index] : NULL;
        if (!ch || ch->done || !ev->final)
            rc = pd_error(PD_EINTERNAL, "unexpected event (choice %u, final %d)", ev->seq_index,
                          ev->final);
        if (rc == PD_OK && ev->n_tokens && !(ch->toks = malloc(ev->n_tokens * sizeof *ch->toks)))
            rc = pd_error(PD_ENOMEM, "out of memory");
        size_t nk = ev->n_tokens * (size_t)(ev->n_top > 0 ? ev->n_top : 0);
        if (rc == PD_OK && ev->token_logprobs &&
            (!(ch->lps = malloc(ev->n_tokens * sizeof *ch->lps + 1)) ||
             !(ch->top_id = malloc(nk * sizeof *ch->top_id + 1)) ||
             !(ch->top_lp = malloc(nk * sizeof *ch->top_lp + 1))))
            rc = pd_error(PD_ENOMEM, "out of memory");
        if (rc == PD_OK && ev->token_logprobs) {
            memcpy(ch->lps, ev->token_logprobs, ev->n_tokens * sizeof *ch->lps);
            memcpy(ch->top_id, ev->top_ids, nk * sizeof *ch->top_id);
            memcpy(ch->top_lp, ev->top_logprobs, nk * sizeof *ch->top_lp);
            ch->k = ev->n_top;
        }
        if (rc == PD_OK) {
            if (ev->n_tokens) memcpy(ch->toks, ev->token_ids, ev->n_tokens * sizeof *ch->toks);
            ch->n = ev->n_tokens;
            ch->cum = ev->cumulative_logprob;
            ch->finish = pd_finish_reason_name(ev->finish);
            ch->status = ev->status;
            ch->done = true;
            (*n_done)++;
        }
        pd_engine_event_done(e);
        PD_CHECK(rc);
    }
    return PD_OK;
}

/* --split: rq's prompt prefilled on a fresh engine made with p, as pd-scheduler asks a prefill
 * instance for a search (a plain request that no stop token ends), its KV moved into blocks D
 * reserves, then the search admitted on D. */
static int add_split(const pd_engine_params *p, pd_engine *D, const pd_engine_request *rq)
{
    pd_engine *P;
    PD_CHECK(pd_engine_create(p, &P));
    pd_sampling_params plain = pd_sampling_default_params();
    plain.temperature = 0.0;
    plain.min_tokens = 2;
    pd_engine_request pq = *rq;
    pq.sampling = &plain;
    pq.phase = PD_PHASE_PREFILL_ONLY;
    int32_t pblocks[MAX_IDS], dblocks[MAX_IDS];
    size_t np = 0, nd = 0;
    uint64_t seed = 0;
    int rc = pd_engine_add(P, &pq);
    for (bool held = false; rc >= 0 && !held;) {
        bool did = false;
        rc = pd_engine_step(P, &did);
        const pd_engine_event *ev;
        while (rc >= 0 && pd_engine_next_event(P, &ev)) {
            if (ev->held) {
                held = true;
                np = ev->n_blocks;
                memcpy(pblocks, ev->block_ids, np * sizeof *pblocks);
                seed = ev->seed;
            } else if (ev->final) {
                rc = pd_error(PD_EINTERNAL, "the prefill ended without its KV held");
            }
            pd_engine_event_done(P);
        }
        if (rc >= 0 && !did && !held) rc = pd_error(PD_EINTERNAL, "the prefill stopped");
    }
    if (rc >= 0)
        rc = pd_engine_reserve(D, rq->request_id, rq->n_prompt, rq->prompt_ids, dblocks, MAX_IDS,
                               &nd, NULL);
    if (rc >= 0 && nd != np)
        rc = pd_error(PD_EINTERNAL, "%zu blocks prefilled, %zu reserved", np, nd);
    if (rc >= 0) rc = kv_move(P, pblocks, D, dblocks, nd);
    if (rc >= 0) rc = pd_engine_release(P, rq->request_id);
    pd_engine_free(P);
    pd_sampling_params sp = *rq->sampling;
    sp.has_seed = true; /* as the nodes pass it; a search draws nothing */
    sp.seed = (int64_t)seed;
    pd_engine_request iq = *rq;
    iq.sampling = &sp;
    return rc >= 0 ? pd_engine_add_imported(D, &iq, -1) : rc;
}

static int run(const args_t *a)
{
    pd_engine_params p = pd_engine_default_params();
    p.model_dir = a->model;
    p.n_threads = 2;
    p.max_num_seqs = MAX_W;
    p.num_kv_blocks = (size_t)a->kv_blocks;
    p.seed = 0;
    if (a->max_model_len) p.max_model_len = (size_t)a->max_model_len;
    pd_engine *e;
    PD_CHECK(pd_engine_create(&p, &e));
    pd_sampling_params sp = pd_sampling_default_params();
    sp.n = (int32_t)a->n;
    sp.use_beam_search = true;
    sp.best_of = (int32_t)a->width;
    sp.temperature = 0.0;
    sp.length_penalty = a->length_penalty;
    sp.early_stopping = a->early;
    sp.ignore_eos = a->ignore_eos;
    sp.max_tokens = a->max_tokens;
    sp.stop_token_ids = a->stop_ids;
    sp.n_stop_token_ids = (int32_t)a->n_stop_ids;
    sp.logprobs = (int32_t)a->logprobs;
    pd_engine_stats st;
    pd_engine_get_stats(e, &st);
    size_t free_start = st.kv_blocks_free, peak = 0;
    choice_t c[MAX_C * MAX_W] = {0};
    int64_t n_done = 0, steps = 0, n_all = a->copies * a->n;
    char ids[MAX_C][32];
    int rc = PD_OK;
    for (int64_t k = 0; k < a->copies && rc >= 0; k++) {
        snprintf(ids[k], sizeof ids[k], "beam-%lld", (long long)k);
        pd_engine_request rq = {.request_id = ids[k],
                                .prompt_ids = a->prompt,
                                .n_prompt = a->n_prompt,
                                .sampling = &sp};
        rc = a->split ? add_split(&p, e, &rq) : pd_engine_add(e, &rq);
    }
    while (rc >= 0 && n_done < n_all) {
        for (int64_t k = 0; k < a->copies && steps == a->abort_after && rc >= 0; k++)
            rc = pd_engine_abort(e, ids[k]);
        bool did = false;
        if (rc >= 0) rc = pd_engine_step(e, &did);
        steps++;
        pd_engine_get_stats(e, &st);
        if (st.kv_blocks_total - st.kv_blocks_free > peak)
            peak = st.kv_blocks_total - st.kv_blocks_free;
        if (rc >= 0) rc = drain(e, c, a->copies, a->n, &n_done);
        if (rc >= 0 && !did && n_done < n_all)
            rc = pd_error(PD_EINTERNAL, "the engine stopped with %lld of %lld choices answered",
                          (long long)n_done, (long long)n_all);
    }
    for (int64_t i = a->n; rc >= 0 && i < n_all; i++) { /* every copy answers as copy 0 */
        const choice_t *x = &c[i], *y = &c[i % a->n];
        if (x->n != y->n || (x->n && memcmp(x->toks, y->toks, x->n * sizeof *x->toks)) ||
            x->cum != y->cum || x->status != y->status)
            rc = pd_error(PD_EINTERNAL, "copy %lld answered choice %lld differently",
                          (long long)(i / a->n), (long long)(i % a->n));
    }
    if (rc >= 0) { /* the request is freed at the end of the step that answered it */
        pd_engine_get_stats(e, &st);
        printf("{\"beams\": [");
        for (int64_t j = 0; j < a->n; j++) {
            size_t len = a->n_prompt + c[j].n;
            printf("%s{\"tokens\": [", j ? ", " : "");
            for (size_t k = 0; k < c[j].n; k++) printf("%s%d", k ? ", " : "", c[j].toks[k]);
            printf("], \"cumulative_logprob\": %.17g, \"score\": %.17g, \"finish_reason\": ",
                   c[j].cum, c[j].cum / pow((double)len, a->length_penalty));
            printf(c[j].finish ? "\"%s\"" : "null", c[j].finish);
            if (c[j].lps) {
                printf(", \"logprobs\": [");
                for (size_t k = 0; k < c[j].n; k++) {
                    printf("%s[%.9g, [", k ? ", " : "", c[j].lps[k]);
                    for (int32_t q = 0; q < c[j].k; q++)
                        printf("%s[%d, %.9g]", q ? ", " : "", c[j].top_id[k * c[j].k + q],
                               c[j].top_lp[k * c[j].k + q]);
                    printf("]]");
                }
                printf("]");
            }
            printf("}");
        }
        printf("], \"statuses\": [");
        for (int64_t j = 0; j < a->n; j++) printf("%s%d", j ? ", " : "", c[j].status);
        printf("], \"kv_blocks_free_start\": %zu, \"kv_blocks_free_end\": %zu, "
               "\"kv_blocks_peak_used\": %zu, \"block_size\": %zu, \"preemptions\": %llu}\n",
               free_start, st.kv_blocks_free, peak, st.block_size,
               (unsigned long long)st.num_preemptions);
    }
    for (int64_t j = 0; j < n_all; j++) {
        free(c[j].toks);
        free(c[j].lps);
        free(c[j].top_id);
        free(c[j].top_lp);
    }
    pd_engine_free(e);
    return rc;
}

int main(int argc, char **argv)
{
    pd_log_set_level(PD_LOG_WARN);
    args_t a;
    int rc = parse(argc, argv, &a);
    if (rc >= 0) rc = run(&a);
    if (rc < 0) {
        fprintf(stderr, "beam_run: %s\n", pd_last_error());
        return 1;
    }
    return 0;
}
