/* pd-generate: offline generation in one process (the colocated baseline).
 *
 *   pd-generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3 | --prompts-file F) [--chat]
 *               [--max-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S]
 *               [--concurrency N] [--json] [--bench] [--cpu-threads N] [--kv-cache-bytes N]
 *               [--prompt-logprobs K] [--dtype auto|float32|bfloat16]
 *               [--ignore-eos] [--beam-width W [--length-penalty X]] [--quantization METHOD]
 *               [--kv-cache-dtype auto|fp8|fp8_e4m3] [--tensor-parallel-size T]
 *               [--pipeline-parallel-size P] [--cuda-device N [--dtype
 * auto|float32|bfloat16|float16]]
 *
 * Design: a thin driver over the engine (engine.h) — the same scheduler, sampler, detokenizer
 * and stop checker that pd-decode runs, so split and colocated serving agree token for token.
 * Prompts are queued --concurrency at a time (default: all), the engine batches them
 * (continuous batching, chunked prefill) and each prompt's events are collected until its final
 * one. --prompt-logprobs K (with --json): each prompt's "prompt_logprobs" as the api-server's
 * body has them, keyed by token id ({"logprob", "rank"}; no decoded_token). --prompts-file: one
 * prompt per line (empty lines skipped); comma-separated ids per line when the file name ends in
 * ".ids". Without --seed the seed is 0, so runs are reproducible. --beam-width W: each prompt
 * answers the best beam of a beam search of W beams (use_beam_search, best_of W, temperature 0;
 * docs/beam_search.md), which comes whole at the end.
 *
 * The KV pool holds what this run can use at once and no more (the engine's max_kv_tokens): the
 * prompts that can be in flight together (--concurrency, and the engine's max_num_seqs), each
 * with its prompt plus its largest output, in whole blocks, within the instances' default budget
 * or --kv-cache-bytes. A pool sized for the instances' workload would make a one-prompt run wait
 * for gigabytes it never touches.
 */
#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "engine/spec.h"
#include "model/model.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"
#include "util/args.h"
#include "util/clock.h"
#include "util/log.h"
#include "util/status.h"
#include "util/threadpool.h"

typedef struct {
    const char *model;
    const char *tokenizer; /* --tokenizer DIR: tokenizer and chat template; NULL: model's */
    const char *prompt;
    const char *prompt_ids;
    const char *prompts_file;
    bool chat, json, bench;
    int64_t max_tokens; /* -1: generation_config max_new_tokens, else 16 */
    bool has_temperature, has_top_p, has_top_k, has_seed;
    double temperature, top_p;
    int64_t top_k, seed;
    int threads;
    int64_t tp, pp;           /* --tensor-parallel-size, --pipeline-parallel-size (1 each) */
    int cuda_device;          /* --cuda-device N: run on this GPU; -1 = the CPU backend */
    int dtype;                /* --dtype: -1 = auto (CUDA bfloat16, CPU float32), or a pd_dtype */
    const char *quantization; /* --quantization: checked against the checkpoint (NULL: none) */
    const char *kv_cache_dtype; /* --kv-cache-dtype auto|fp8|fp8_e4m3 (NULL: auto) */
    int64_t concurrency;      /* requests in flight at once; 0 = all */
    bool no_prefix_cache;     /* --no-enable-prefix-caching */
    int64_t kv_cache_bytes;   /* --kv-cache-bytes: the pool's budget; 0 = the engine's default */
    int64_t prompt_logprobs;  /* --prompt-logprobs K: -1 = none */
    pd_spec_flags spec;       /* speculative decoding, as pd-decode's flags */
    bool ignore_eos;          /* --ignore-eos */
    int64_t beam_width;       /* --beam-width W: beam search of W beams; 0 = sampling */
    double length_penalty;    /* --length-penalty (beam search) */
} args_t;

typedef struct {
    char *text;   /* the prompt text as given (NULL for id prompts) */
    int32_t *ids; /* prompt ids */
    size_t n_ids;
    int32_t *out; /* (max_out) generated ids, the one that ended it included */
    size_t n_out, max_out;
    char *gen; /* generated text (engine deltas, after hold-back) */
    size_t gen_len, gen_cap;
    const char *finish; /* "stop" | "length" */
    bool added, done;
    double t_first; /* when its first token came (pd_now_s) */
    json_t *plp;    /* --prompt-logprobs: [null, {"<id>": {"logprob", "rank"}, ...}, ...] */
} seq_t;

static void usage(FILE *o)
{
    fprintf(o,
            "usage: pd-generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3 | "
            "--prompts-file F) [--chat]\n"
            "                   [--max-tokens N] [--temperature T] [--top-p P] [--top-k K] "
            "[--seed S]\n"
            "                   [--concurrency N] [--json] [--bench] [--cpu-threads N]\n"
            "                   [--tokenizer DIR] [--prompt-logprobs K]\n"
            "                   [--[no-]enable-prefix-caching] [--kv-cache-bytes N]\n"
            "                   [--dtype auto|float32|bfloat16] (CPU: bfloat16 = bf16 matmuls)\n"
            "                   [--quantization METHOD] (checked against config.json)\n"
            "                   [--kv-cache-dtype auto|fp8|fp8_e4m3]\n"
            "                   [--tensor-parallel-size T] [--pipeline-parallel-size P]\n"
            "                   [--cuda-device N [--dtype auto|float32|bfloat16|float16]]\n"
            "                   [--speculative-model [ngram] --num-speculative-tokens K\n"
            "                    --ngram-prompt-lookup-max N [--ngram-prompt-lookup-min N]\n"
            "                    | --speculative-config JSON]\n"
            "                   [--speculative-disable-by-batch-size N]\n"
            "                   [--ignore-eos] [--beam-width W [--length-penalty X]]\n"
            "  --beam-width W      answer the best of a beam search of W beams (temperature 0)\n"
            "  --kv-cache-bytes N  KV budget (bytes; default: %.0f GiB on the CPU, the GPU's\n"
            "                      free share with --cuda-device); the pool never holds more\n"
            "                      than the run needs: the prompts in flight at once, each\n"
            "                      with its --max-tokens\n",
            PD_ENGINE_CPU_KVCACHE_SPACE_GIB);
}

static int parse_args(int argc, char **argv, args_t *a)
{
    memset(a, 0, sizeof *a);
    a->max_tokens = -1;
    a->prompt_logprobs = -1;
    a->cuda_device = -1;
    a->dtype = -1;
    a->tp = a->pp = 1;
    a->spec = pd_spec_flags_default();
    a->length_penalty = 1.0;
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        if (!strcmp(o, "--chat"))
            a->chat = true;
        else if (!strcmp(o, "--json"))
            a->json = true;
        else if (!strcmp(o, "--bench"))
            a->bench = true;
        else if (!strcmp(o, "--ignore-eos"))
            a->ignore_eos = true;
        else if (!strcmp(o, "--enable-prefix-caching") || !strcmp(o, "--no-enable-prefix-caching"))
            a->no_prefix_cache = o[2] == 'n';
        else if (!strcmp(o, "--help") || !strcmp(o, "-h")) {
            usage(stdout);
            exit(0);
        } else {
            if (i + 1 >= argc)
                return pd_error(PD_EINVAL, "%s: missing value (or unknown option)", o);
            const char *v = argv[++i];
            int64_t iv;
            if (!strcmp(o, "--model"))
                a->model = v;
            else if (!strcmp(o, "--tokenizer"))
                a->tokenizer = v;
            else if (!strcmp(o, "--prompt"))
                a->prompt = v;
            else if (!strcmp(o, "--prompt-ids"))
                a->prompt_ids = v;
            else if (!strcmp(o, "--prompts-file"))
                a->prompts_file = v;
            else if (!strcmp(o, "--max-tokens"))
                PD_CHECK(pd_arg_i64(o, v, 1, 1 << 24, &a->max_tokens));
            else if (!strcmp(o, "--prompt-logprobs"))
                PD_CHECK(pd_arg_i64(o, v, 0, 1 << 20, &a->prompt_logprobs));
            else if (!strcmp(o, "--temperature")) {
                PD_CHECK(pd_arg_f64(o, v, &a->temperature));
                a->has_temperature = true;
            } else if (!strcmp(o, "--top-p")) {
                PD_CHECK(pd_arg_f64(o, v, &a->top_p));
                a->has_top_p = true;
            } else if (!strcmp(o, "--top-k")) {
                PD_CHECK(pd_arg_i64(o, v, -1, INT32_MAX, &a->top_k));
                a->has_top_k = true;
            } else if (!strcmp(o, "--seed")) {
                PD_CHECK(pd_arg_i64(o, v, INT64_MIN, INT64_MAX, &a->seed));
                a->has_seed = true;
            } else if (!strcmp(o, "--cpu-threads")) {
                PD_CHECK(pd_arg_i64(o, v, 1, 4096, &iv));
                a->threads = (int)iv;
            } else if (!strcmp(o, "--cuda-device")) {
                PD_CHECK(pd_arg_i64(o, v, 0, 1023, &iv));
                a->cuda_device = (int)iv;
            } else if (!strcmp(o, "--dtype")) {
                if (!strcmp(v, "float32"))
                    a->dtype = PD_DTYPE_F32;
                else if (!strcmp(v, "bfloat16"))
                    a->dtype = PD_DTYPE_BF16;
                else if (!strcmp(v, "float16"))
                    a->dtype = PD_DTYPE_F16;
                else if (strcmp(v, "auto") != 0)
                    return pd_error(
                        PD_EINVAL, "--dtype: expected auto, float32, bfloat16 or float16, got '%s'",
                        v);
            } else if (!strcmp(o, "--quantization")) {
                a->quantization = v;
            } else if (!strcmp(o, "--kv-cache-dtype")) {
                a->kv_cache_dtype = v;
            } else if (!strcmp(o, "--tensor-parallel-size") || !strcmp(o, "-tp")) {
                PD_CHECK(pd_arg_i64(o, v, 1, PD_ENGINE_MAX_CUDA_DEVICES, &a->tp));
            } else if (!strcmp(o, "--pipeline-parallel-size") || !strcmp(o, "-pp")) {
                PD_CHECK(pd_arg_i64(o, v, 1, PD_ENGINE_MAX_PP, &a->pp));
            } else if (!strcmp(o, "--beam-width")) {
                PD_CHECK(pd_arg_i64(o, v, 2, 1 << 10, &a->beam_width));
            } else if (!strcmp(o, "--length-penalty")) {
                PD_CHECK(pd_arg_f64(o, v, &a->length_penalty));
            } else if (!strcmp(o, "--concurrency")) {
                PD_CHECK(pd_arg_i64(o, v, 1, 1 << 20, &a->concurrency));
            } else if (!strcmp(o, "--speculative-model")) {
                a->spec.model = v;
            } else if (!strcmp(o, "--speculative-config")) {
                a->spec.config_json = v;
            } else if (!strcmp(o, "--num-speculative-tokens")) {
                PD_CHECK(pd_arg_i64(o, v, 1, PD_ENGINE_SPEC_MAX_TOKENS, &a->spec.num_tokens));
            } else if (!strcmp(o, "--ngram-prompt-lookup-max")) {
                PD_CHECK(pd_arg_i64(o, v, 1, 1 << 20, &a->spec.ngram_max));
            } else if (!strcmp(o, "--ngram-prompt-lookup-min")) {
                PD_CHECK(pd_arg_i64(o, v, 0, 1 << 20, &a->spec.ngram_min));
            } else if (!strcmp(o, "--speculative-disable-by-batch-size")) {
                PD_CHECK(pd_arg_i64(o, v, 1, 1 << 20, &a->spec.disable_batch));
            } else if (!strcmp(o, "--kv-cache-bytes")) {
                PD_CHECK(pd_arg_i64(o, v, 1, (int64_t)1 << 50, &a->kv_cache_bytes));
            } else
                return pd_error(PD_EINVAL, "unknown option %s", o);
        }
    }
    if (!a->model) return pd_error(PD_EINVAL, "--model is required");
    int n_src = !!a->prompt + !!a->prompt_ids + !!a->prompts_file;
    if (n_src != 1)
        return pd_error(PD_EINVAL,
                        "exactly one of --prompt, --prompt-ids, --prompts-file is required");
    if (a->chat && a->prompt_ids)
        return pd_error(PD_EINVAL, "--chat needs text prompts (--prompt or --prompts-file)");
    return PD_OK;
}

/* "1,2,3" -> ids, each in [0, vocab). */
static int parse_ids(const char *what, const char *s, int32_t vocab, int32_t **ids, size_t *n)
{
    size_t cap = 8, k = 0;
    int32_t *a = malloc(cap * sizeof *a);
    if (!a) return pd_error(PD_ENOMEM, "out of memory");
    while (*s == ' ') s++;
    while (*s) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < 0 || v >= vocab) {
            free(a);
            return pd_error(PD_EINVAL, "%s: bad token id at \"%.20s\" (vocabulary size %d)", what,
                            s, vocab);
        }
        if (k == cap) {
            int32_t *na = realloc(a, (cap *= 2) * sizeof *a);
            if (!na) {
                free(a);
                return pd_error(PD_ENOMEM, "out of memory");
            }
            a = na;
        }
        a[k++] = (int32_t)v;
        while (*end == ' ') end++;
        if (*end == ',')
            end++;
        else if (*end) {
            free(a);
            return pd_error(PD_EINVAL, "%s: expected ',' at \"%.20s\"", what, end);
        }
        s = end;
        while (*s == ' ') s++;
    }
    if (k == 0) {
        free(a);
        return pd_error(PD_EINVAL, "%s: no token ids", what);
    }
    *ids = a;
    *n = k;
    return PD_OK;
}

/* Text of a prompt as the model sees it: the chat template rendering of one user message with
 * --chat, else the text itself. *out is malloc'd. */
static int prompt_text(const pd_chat_template *tpl, const json_t *cfg_vars, const char *text,
                       char **out)
{
    if (!tpl) {
        *out = strdup(text);
        return *out ? PD_OK : pd_error(PD_ENOMEM, "out of memory");
    }
    json_t *req = json_pack("[{s:s, s:s}]", "role", "user", "content", text);
    json_t *msgs = NULL, *vars = NULL;
    if (!req) return pd_error(PD_ENOMEM, "out of memory");
    int rc = pd_chat_normalize_messages(req, "messages", &msgs);
    if (rc == 0) rc = pd_chat_build_vars(cfg_vars, msgs, NULL, NULL, true, NULL, NULL, &vars);
    if (rc == 0) rc = pd_chat_render(tpl, vars, out, NULL);
    json_decref(req);
    json_decref(msgs);
    json_decref(vars);
    return rc;
}

/* Reads the prompts file: one prompt per non-empty line. */
static int read_lines(const char *file, char ***lines, size_t *n)
{
    FILE *f = fopen(file, "rb");
    if (!f) return pd_error(PD_EIO, "%s: cannot open", file);
    char *line = NULL;
    size_t cap = 0, k = 0, lcap = 8;
    char **a = malloc(lcap * sizeof *a);
    ssize_t len;
    int rc = a ? PD_OK : pd_error(PD_ENOMEM, "out of memory");
    while (rc == 0 && (len = getline(&line, &cap, f)) >= 0) {
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = 0;
        if (len == 0) continue;
        if (k == lcap) {
            char **na = realloc(a, (lcap *= 2) * sizeof *a);
            if (!na) {
                rc = pd_error(PD_ENOMEM, "out of memory");
                break;
            }
            a = na;
        }
        if (!(a[k] = strdup(line)))
            rc = pd_error(PD_ENOMEM, "out of memory");
        else
            k++;
    }
    free(line);
    fclose(f);
    if (rc == 0 && k == 0) rc = pd_error(PD_EINVAL, "%s: no prompts", file);
    if (rc) {
        for (size_t i = 0; i < k; i++) free(a[i]);
        free(a);
        return rc;
    }
    *lines = a;
    *n = k;
    return PD_OK;
}

static int cmp_size_desc(const void *a, const void *b)
{
    size_t x = *(const size_t *)a, y = *(const size_t *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* KV tokens the run can hold at once (the engine's max_kv_tokens): the in_flight largest of the
 * prompts' needs, each its prompt plus max_new tokens, at most max_len, in whole blocks. */
static int run_kv_tokens(const seq_t *seqs, size_t n, size_t in_flight, int64_t max_new,
                         size_t max_len, size_t block_size, size_t *out)
{
    size_t *need = malloc(n * sizeof *need);
    if (!need) return pd_error(PD_ENOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        size_t t = seqs[i].n_ids + (size_t)max_new;
        if (t > max_len) t = max_len;
        need[i] = (t + block_size - 1) / block_size * block_size;
    }
    qsort(need, n, sizeof *need, cmp_size_desc);
    *out = 0;
    for (size_t i = 0; i < n && i < in_flight; i++) *out += need[i];
    free(need);
    return PD_OK;
}

/* Appends an event's new token and text to its sequence. */
/* The prompt logprobs as the api-server's body lists them: the prompt token first, then the
 * top ones not already listed. */
static json_t *plp_json(const int32_t *ids, const pd_prompt_logprobs *p)
{
    json_t *arr = json_array();
    json_array_append_new(arr, json_null());
    size_t nt = (size_t)p->n_top;
    for (size_t i = 1; i < p->n_prompt; i++) {
        json_t *d = json_object();
        for (size_t j = 0; j <= nt; j++) {
            int32_t id = j == 0 ? ids[i] : p->top_ids[i * nt + j - 1];
            if (j > 0 && id == ids[i]) continue;
            char key[16];
            snprintf(key, sizeof key, "%d", id);
            json_object_set_new(
                d, key,
                json_pack("{s:f,s:i}", "logprob",
                          (double)(j == 0 ? p->logprob[i] : p->top_logprobs[i * nt + j - 1]),
                          "rank", j == 0 ? p->rank[i] : (int)j));
        }
        json_array_append_new(arr, d);
    }
    return arr;
}

static int collect(seq_t *s, const pd_engine_event *ev)
{
    if (ev->prompt_logprobs && !(s->plp = plp_json(s->ids, ev->prompt_logprobs)))
        return pd_error(PD_ENOMEM, "out of memory");
    for (size_t k = 0; k < ev->n_tokens && s->n_out < s->max_out; k++)
        s->out[s->n_out++] = ev->token_ids[k];
    if (s->gen_len + ev->text_len + 1 > s->gen_cap) {
        size_t cap = (s->gen_cap ? s->gen_cap * 2 : 256) + ev->text_len;
        char *g = realloc(s->gen, cap);
        if (!g) return pd_error(PD_ENOMEM, "out of memory");
        s->gen = g;
        s->gen_cap = cap;
    }
    memcpy(s->gen + s->gen_len, ev->text, ev->text_len);
    s->gen_len += ev->text_len;
    s->gen[s->gen_len] = '\0';
    if (ev->final) {
        if (ev->status < 0)
            return pd_error(ev->status, "generation failed: %s", ev->error ? ev->error : "");
        s->finish = pd_finish_reason_name(ev->finish);
        s->done = true;
    }
    return PD_OK;
}

int main(int argc, char **argv)
{
    pd_log_init("generate");
    args_t a;
    int rc = parse_args(argc, argv, &a);
    if (rc < 0) {
        fprintf(stderr, "pd-generate: %s\n", pd_last_error());
        usage(stderr);
        return 2;
    }
    pd_model *m = NULL;
    pd_tok *tok = NULL;
    pd_chat_template *tpl = NULL;
    json_t *cfg_vars = NULL;
    pd_engine *e = NULL;
    seq_t *seqs = NULL;
    size_t n_seqs = 0;
    char **lines = NULL;
    size_t n_lines = 0;
    size_t prompt_tokens = 0, gen_tokens = 0;

    PD_CHECK_GOTO(pd_model_load(a.model, &m), rc, out);
    const char *tok_dir = a.tokenizer ? a.tokenizer : a.model;
    PD_CHECK_GOTO(pd_tok_load(tok_dir, &tok), rc, out);
    const pd_model_config *cfg = &m->config;
    int32_t vocab = (int32_t)cfg->vocab_size;
    if (a.chat) {
        char *src = NULL, *what = NULL;
        PD_CHECK_GOTO(pd_chat_select(tok_dir, NULL, false, &src, &what), rc, out);
        if (!src) {
            free(what);
            rc = pd_error(PD_EINVAL, "%s: --chat: the model has no chat template", tok_dir);
            goto out;
        }
        rc = pd_chat_compile(src, what, &tpl);
        free(src);
        free(what);
        if (rc < 0) goto out;
        PD_CHECK_GOTO(pd_chat_config_vars(pd_tok_config(tok), &cfg_vars), rc, out);
    }

    /* prompts */
    if (a.prompts_file) PD_CHECK_GOTO(read_lines(a.prompts_file, &lines, &n_lines), rc, out);
    n_seqs = a.prompts_file ? n_lines : 1;
    seqs = calloc(n_seqs, sizeof *seqs);
    if (!seqs) {
        rc = pd_error(PD_ENOMEM, "out of memory");
        goto out;
    }
    bool ids_file = a.prompts_file && strlen(a.prompts_file) > 4 &&
                    !strcmp(a.prompts_file + strlen(a.prompts_file) - 4, ".ids");
    for (size_t i = 0; i < n_seqs; i++) {
        seq_t *s = &seqs[i];
        const char *src = a.prompts_file ? lines[i] : a.prompt;
        if (a.prompt_ids || ids_file) {
            PD_CHECK_GOTO(parse_ids(a.prompt_ids ? "--prompt-ids" : a.prompts_file,
                                    a.prompt_ids ? a.prompt_ids : src, vocab, &s->ids, &s->n_ids),
                          rc, out);
        } else {
            PD_CHECK_GOTO(prompt_text(tpl, cfg_vars, src, &s->text), rc, out);
            /* chat: the template carries the special tokens (as apply_chat_template) */
            PD_CHECK_GOTO(pd_tok_encode(tok, s->text, strlen(s->text), !a.chat, &s->ids, &s->n_ids),
                          rc, out);
            if (s->n_ids == 0) {
                rc = pd_error(PD_EINVAL, "prompt %zu: empty after tokenization", i);
                goto out;
            }
        }
        prompt_tokens += s->n_ids;
    }

    /* sampling parameters: model defaults (generation_config), then the flags. Without
     * --max-tokens: the model's max_new_tokens (applied by the engine), else 16. */
    pd_sampling_params sp =
        pd_sampling_model_params(m->has_generation_config ? &m->generation : NULL);
    if (a.has_temperature) sp.temperature = a.temperature;
    if (a.has_top_p) sp.top_p = a.top_p;
    if (a.has_top_k) sp.top_k = (int32_t)a.top_k;
    if (a.has_seed) sp.has_seed = true, sp.seed = a.seed;
    if (!sp.has_seed) sp.has_seed = true, sp.seed = 0; /* offline runs are reproducible */
    sp.prompt_logprobs = (int32_t)a.prompt_logprobs;
    sp.max_tokens = a.max_tokens > 0 ? a.max_tokens : m->generation.has_max_new_tokens ? -1 : 16;
    sp.ignore_eos = a.ignore_eos;
    if (a.beam_width > 0) {
        sp.use_beam_search = true;
        sp.best_of = (int32_t)a.beam_width;
        sp.temperature = 0.0;
        sp.top_p = 1.0;
        sp.top_k = 0;
        sp.length_penalty = a.length_penalty;
    }
    PD_CHECK_GOTO(pd_sampling_params_validate(&sp, vocab), rc, out);

    pd_engine_params ep = pd_engine_default_params();
    ep.model = m;
    ep.tok = tok;
    ep.n_threads = a.threads;
    ep.cpu_threads_bind = getenv("VLLM_CPU_OMP_THREADS_BIND");
    ep.cpu_budget = getenv("PD_CPU_BUDGET");
    ep.enable_prefix_caching = !a.no_prefix_cache;
    ep.dtype = a.dtype;
    ep.quantization = a.quantization;
    ep.kv_cache_dtype = a.kv_cache_dtype;
    ep.tp_size = (int)a.tp;
    ep.pp_size = (int)a.pp;
    if (a.tp * a.pp > PD_ENGINE_MAX_CUDA_DEVICES) {
        fprintf(stderr,
                "pd-generate: --tensor-parallel-size x --pipeline-parallel-size: at most %d "
                "ranks\n",
                PD_ENGINE_MAX_CUDA_DEVICES);
        return 2;
    }
    if (a.cuda_device >= 0) { /* the engine explains when this build or machine has no GPU */
        ep.n_cuda_devices = (int)(a.tp * a.pp); /* every rank on that GPU */
        for (int r = 0; r < ep.n_cuda_devices; r++) ep.cuda_devices[r] = a.cuda_device;
    } else if (a.dtype == PD_DTYPE_F16) {
        fprintf(stderr, "pd-generate: --dtype float16: the CPU backend computes in float32 or "
                        "bfloat16 (or use --cuda-device)\n");
        return 2;
    }
    if (ep.max_num_seqs < n_seqs && a.concurrency == 0) ep.max_num_seqs = n_seqs;
    ep.kv_cache_bytes = (size_t)a.kv_cache_bytes;
    PD_CHECK_GOTO(pd_spec_configure(&a.spec, &ep), rc, out);
    size_t ctx_len = (size_t)pd_model_max_len(cfg, NULL); /* the engine's max_model_len */
    int64_t max_new = sp.max_tokens > 0                  ? sp.max_tokens
                      : m->generation.has_max_new_tokens ? m->generation.max_new_tokens
                                                         : (int64_t)ctx_len;
    size_t at_once = a.concurrency > 0 ? (size_t)a.concurrency : n_seqs;
    if (at_once > ep.max_num_seqs) at_once = ep.max_num_seqs; /* the engine runs no more */
    PD_CHECK_GOTO(
        run_kv_tokens(seqs, n_seqs, at_once, max_new, ctx_len, ep.block_size, &ep.max_kv_tokens),
        rc, out);
    if (a.beam_width > 0) ep.max_kv_tokens *= (size_t)a.beam_width; /* each beam its own tail */
    PD_CHECK_GOTO(pd_engine_create(&ep, &e), rc, out);
    size_t max_len = pd_engine_max_model_len(e);
    for (size_t i = 0; i < n_seqs; i++) {
        seq_t *s = &seqs[i];
        if (s->n_ids >= max_len) {
            rc = pd_error(PD_EINVAL, "prompt %zu: %zu tokens, the model's context is %zu", i,
                          s->n_ids, max_len);
            goto out;
        }
        s->max_out = max_len - s->n_ids;
        s->out = malloc(s->max_out * sizeof(int32_t));
        if (!s->out) {
            rc = pd_error(PD_ENOMEM, "out of memory");
            goto out;
        }
    }

    /* run: keep `concurrency` requests in flight, step, collect events */
    size_t in_flight_cap = a.concurrency > 0 ? (size_t)a.concurrency : n_seqs;
    size_t next = 0, in_flight = 0, done = 0;
    double t0 = pd_now_s(), t_last_first = t0;
    while (done < n_seqs) {
        while (next < n_seqs && in_flight < in_flight_cap) {
            char id[32];
            snprintf(id, sizeof id, "%zu", next);
            pd_engine_request r = {.request_id = id,
                                   .prompt_ids = seqs[next].ids,
                                   .n_prompt = seqs[next].n_ids,
                                   .sampling = &sp,
                                   .phase = PD_PHASE_FULL};
            PD_CHECK_GOTO(pd_engine_add(e, &r), rc, out);
            seqs[next++].added = true;
            in_flight++;
        }
        bool did = false;
        rc = pd_engine_step(e, &did);
        if (rc < 0 && rc != PD_EBUSY) goto out;
        const pd_engine_event *ev;
        while (pd_engine_next_event(e, &ev) == 1) {
            seq_t *s = &seqs[strtoul(ev->request_id, NULL, 10)];
            if (s->n_out == 0 && ev->n_tokens) s->t_first = t_last_first = pd_now_s();
            rc = collect(s, ev);
            pd_engine_event_done(e);
            if (rc < 0) goto out;
            if (s->done) in_flight--, done++;
        }
        if (!did && rc != PD_EBUSY && !pd_engine_has_work(e) && done < n_seqs && next >= n_seqs) {
            rc = pd_error(PD_EINTERNAL, "the engine stopped with %zu prompts unfinished",
                          n_seqs - done);
            goto out;
        }
    }
    double t_end = pd_now_s();

    /* output */
    for (size_t i = 0; i < n_seqs; i++) {
        seq_t *s = &seqs[i];
        gen_tokens += s->n_out;
        if (a.json) {
            json_t *pi = json_array(), *oi = json_array();
            for (size_t k = 0; k < s->n_ids; k++)
                json_array_append_new(pi, json_integer(s->ids[k]));
            for (size_t k = 0; k < s->n_out; k++)
                json_array_append_new(oi, json_integer(s->out[k]));
            json_t *o = json_object();
            json_object_set_new(o, "prompt_token_ids", pi);
            json_object_set_new(o, "token_ids", oi);
            json_object_set_new(o, "text", json_stringn(s->gen ? s->gen : "", s->gen_len));
            json_object_set_new(o, "finish_reason", json_string(s->finish));
            if (s->plp) json_object_set(o, "prompt_logprobs", s->plp);
            char *js = json_dumps(o, JSON_COMPACT | JSON_ENSURE_ASCII);
            json_decref(o);
            if (!js) {
                rc = pd_error(PD_ENOMEM, "out of memory");
                goto out;
            }
            printf("%s\n", js);
            free(js);
        } else {
            if (n_seqs > 1) printf("--- prompt %zu (%s, %zu tokens)\n", i, s->finish, s->n_out);
            if (s->text && !a.chat) fputs(s->text, stdout);
            if (s->gen) fwrite(s->gen, 1, s->gen_len, stdout);
            putchar('\n');
        }
    }
    if (a.bench && a.beam_width > 0) { /* the answer comes whole: no prefill/decode split */
        fprintf(stderr,
                "bench: beam search of width %lld: %zu prompts, %zu answered tokens in %.3f s "
                "(concurrency %zu, %d threads); total %.3f s\n",
                (long long)a.beam_width, n_seqs, gen_tokens, t_end - t0, in_flight_cap,
                a.threads > 0 ? a.threads : pd_cpu_count(), t_end - t0);
    } else if (a.bench) {
        /* prefill: start -> the last first token; decode: the remaining tokens after it */
        double tp = t_last_first - t0, td = t_end - t_last_first;
        size_t decode_tokens = gen_tokens > n_seqs ? gen_tokens - n_seqs : 0;
        fprintf(stderr,
                "bench: prefill %zu tokens in %.3f s = %.1f tokens/s; decode %zu tokens in "
                "%.3f s = %.1f tokens/s (%zu prompts, concurrency %zu, %d threads); total %.3f s\n",
                prompt_tokens, tp, prompt_tokens / (tp > 0 ? tp : 1e-9), decode_tokens, td,
                decode_tokens / (td > 0 ? td : 1e-9), n_seqs, in_flight_cap,
                a.threads > 0 ? a.threads : pd_cpu_count(), t_end - t0);
        pd_engine_stats st;
        pd_engine_get_stats(e, &st);
        if (ep.spec_num_tokens)
            fprintf(stderr,
                    "bench: speculative decoding: %llu steps with drafts, %llu draft tokens, "
                    "%llu accepted (acceptance %.1f %%), %llu engine steps\n",
                    (unsigned long long)st.spec_drafts, (unsigned long long)st.spec_draft_tokens,
                    (unsigned long long)st.spec_accepted_tokens,
                    st.spec_draft_tokens
                        ? 100.0 * (double)st.spec_accepted_tokens / (double)st.spec_draft_tokens
                        : 0.0,
                    (unsigned long long)st.steps);
    }
    rc = 0;
out:
    if (rc < 0) fprintf(stderr, "pd-generate: %s\n", pd_last_error());
    for (size_t i = 0; seqs && i < n_seqs; i++) {
        free(seqs[i].text);
        free(seqs[i].ids);
        free(seqs[i].out);
        free(seqs[i].gen);
        json_decref(seqs[i].plp);
    }
    free(seqs);
    for (size_t i = 0; i < n_lines; i++) free(lines[i]);
    free(lines);
    pd_engine_free(e);
    json_decref(cfg_vars);
    pd_chat_free(tpl);
    pd_tok_free(tok);
    pd_model_free(m);
    return rc < 0 ? 1 : 0;
}
