/* pd-generate: offline generation in one process (the colocated baseline).
 *
 *   pd-generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3 | --prompts-file F) [--chat]
 *               [--max-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S]
 *               [--json] [--bench] [--cpu-threads N]
 *
 * Design: a thin driver over the library: tokenizer (+ chat template with --chat), the forward
 * pass on the CPU backend, the sampler, the incremental detokenizer. Every prompt is prefilled
 * (in chunks of at most CHUNK rows), then all unfinished sequences decode together, one row
 * each per step. KV handling is deliberately minimal and kept in one place (kv_plan below):
 * sequence i owns a fixed contiguous run of blocks sized for prompt + max tokens; the paged
 * block manager of the engine replaces it. Stops at an EOS id (generation_config eos ids plus
 * the tokenizer's eos) or after max tokens (or at max_position_embeddings).
 * --prompts-file: one prompt per line (empty lines skipped); with --prompt-ids semantics when
 * the file name ends in ".ids" (comma-separated ids per line).
 */
#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/forward.h"
#include "engine/sampler.h"
#include "model/model.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"
#include "util/clock.h"
#include "util/log.h"
#include "util/status.h"
#include "util/threadpool.h"

#define CHUNK 512       /* prefill rows per step */
#define BLOCK_SIZE 16   /* tokens per KV block */

typedef struct {
    const char *model;
    const char *prompt;
    const char *prompt_ids;
    const char *prompts_file;
    bool chat, json, bench;
    int64_t max_tokens; /* -1: generation_config max_new_tokens, else 16 */
    bool has_temperature, has_top_p, has_top_k, has_seed;
    double temperature, top_p;
    int64_t top_k, seed;
    int threads;
} args_t;

typedef struct {
    char *text;          /* the prompt text as given (NULL for id prompts) */
    int32_t *ids;        /* prompt ids */
    size_t n_ids;
    int32_t *out;        /* (max_tokens) generated ids */
    size_t n_out;
    size_t max_out;      /* generation cap for this sequence */
    int32_t block0;      /* first block of its contiguous run (kv_plan) */
    size_t n_blocks;
    pd_sampler_seq *sampler;
    pd_detok *detok;
    bool done;
    const char *finish;  /* "stop" | "length" */
} seq_t;

static void usage(FILE *o)
{
    fprintf(o, "usage: pd-generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3 | "
               "--prompts-file F) [--chat]\n"
               "                   [--max-tokens N] [--temperature T] [--top-p P] [--top-k K] "
               "[--seed S]\n"
               "                   [--json] [--bench] [--cpu-threads N]\n");
}

static int parse_i64(const char *opt, const char *s, int64_t lo, int64_t hi, int64_t *out)
{
    char *end;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end || v < lo || v > hi)
        return pd_error(PD_EINVAL, "%s: expected an integer in [%lld, %lld], got \"%s\"", opt,
                        (long long)lo, (long long)hi, s);
    *out = v;
    return PD_OK;
}

static int parse_f64(const char *opt, const char *s, double *out)
{
    char *end;
    double v = strtod(s, &end);
    if (end == s || *end || v != v)
        return pd_error(PD_EINVAL, "%s: expected a number, got \"%s\"", opt, s);
    *out = v;
    return PD_OK;
}

static int parse_args(int argc, char **argv, args_t *a)
{
    memset(a, 0, sizeof *a);
    a->max_tokens = -1;
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        if (!strcmp(o, "--chat")) a->chat = true;
        else if (!strcmp(o, "--json")) a->json = true;
        else if (!strcmp(o, "--bench")) a->bench = true;
        else if (!strcmp(o, "--help") || !strcmp(o, "-h")) {
            usage(stdout);
            exit(0);
        } else {
            if (i + 1 >= argc) return pd_error(PD_EINVAL, "%s: missing value (or unknown option)", o);
            const char *v = argv[++i];
            int64_t iv;
            if (!strcmp(o, "--model")) a->model = v;
            else if (!strcmp(o, "--prompt")) a->prompt = v;
            else if (!strcmp(o, "--prompt-ids")) a->prompt_ids = v;
            else if (!strcmp(o, "--prompts-file")) a->prompts_file = v;
            else if (!strcmp(o, "--max-tokens")) PD_CHECK(parse_i64(o, v, 1, 1 << 24, &a->max_tokens));
            else if (!strcmp(o, "--temperature")) {
                PD_CHECK(parse_f64(o, v, &a->temperature));
                a->has_temperature = true;
            } else if (!strcmp(o, "--top-p")) {
                PD_CHECK(parse_f64(o, v, &a->top_p));
                a->has_top_p = true;
            } else if (!strcmp(o, "--top-k")) {
                PD_CHECK(parse_i64(o, v, -1, INT32_MAX, &a->top_k));
                a->has_top_k = true;
            } else if (!strcmp(o, "--seed")) {
                PD_CHECK(parse_i64(o, v, INT64_MIN, INT64_MAX, &a->seed));
                a->has_seed = true;
            } else if (!strcmp(o, "--cpu-threads")) {
                PD_CHECK(parse_i64(o, v, 1, 4096, &iv));
                a->threads = (int)iv;
            } else return pd_error(PD_EINVAL, "unknown option %s", o);
        }
    }
    if (!a->model) return pd_error(PD_EINVAL, "--model is required");
    int n_src = !!a->prompt + !!a->prompt_ids + !!a->prompts_file;
    if (n_src != 1)
        return pd_error(PD_EINVAL, "exactly one of --prompt, --prompt-ids, --prompts-file is required");
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
        if (*end == ',') end++;
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
        if (!(a[k] = strdup(line))) rc = pd_error(PD_ENOMEM, "out of memory");
        else k++;
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

static int is_eos(int32_t t, const int32_t *eos, size_t n_eos)
{
    for (size_t i = 0; i < n_eos; i++)
        if (eos[i] == t) return 1;
    return 0;
}

/* ---- KV: a fixed contiguous run of blocks per sequence ------------------------------------- */

static size_t kv_plan(seq_t *seqs, size_t n)
{
    size_t next = 0;
    for (size_t i = 0; i < n; i++) {
        size_t tokens = seqs[i].n_ids + seqs[i].max_out;
        seqs[i].block0 = (int32_t)next;
        seqs[i].n_blocks = (tokens + BLOCK_SIZE - 1) / BLOCK_SIZE;
        next += seqs[i].n_blocks;
    }
    return next;
}

/* ---- generation --------------------------------------------------------------------------- */

typedef struct {
    pd_forward *f;
    pd_kv *kv;
    int32_t *tok, *qi, *kvl, *bi, *bl, *orow; /* step arrays, sized for the batch */
    float *logits;                            /* (n_seqs, vocab) */
    size_t V;
} gen_ctx;

/* Appends token t to sequence s (sampled from logits); marks it done at EOS or its cap. */
static int accept(seq_t *s, int32_t t, const int32_t *eos, size_t n_eos)
{
    s->out[s->n_out++] = t;
    const char *d;
    size_t dl;
    PD_CHECK(pd_detok_push(s->detok, t, &d, &dl));
    if (is_eos(t, eos, n_eos)) {
        s->done = true;
        s->finish = "stop";
    } else if (s->n_out >= s->max_out) {
        s->done = true;
        s->finish = "length";
    }
    return PD_OK;
}

static int sample_one(seq_t *s, const float *logits, pd_sampler_ws *ws, const int32_t *eos,
                      size_t n_eos)
{
    pd_sample_result r;
    PD_CHECK(pd_sample(s->sampler, logits, ws, &r));
    return accept(s, r.token, eos, n_eos);
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
    pd_backend *b = NULL;
    gen_ctx g = {0};
    pd_sampler_ws *ws = NULL;
    seq_t *seqs = NULL;
    size_t n_seqs = 0;
    char **lines = NULL;
    size_t n_lines = 0;
    int32_t eos[PD_MAX_EOS_IDS * 2];
    size_t n_eos = 0;
    double t_prefill = 0, t_decode = 0;
    size_t prompt_tokens = 0, decode_tokens = 0;

    PD_CHECK_GOTO(pd_model_load(a.model, &m), rc, out);
    PD_CHECK_GOTO(pd_tok_load(a.model, &tok), rc, out);
    const pd_model_config *cfg = &m->config;
    int32_t vocab = (int32_t)cfg->vocab_size;
    if (pd_tok_vocab_size(tok) > vocab) {
        rc = pd_error(PD_EINVAL, "%s: tokenizer has %d ids but config.json vocab_size is %d",
                      a.model, pd_tok_vocab_size(tok), vocab);
        goto out;
    }
    /* EOS: generation_config's, then the tokenizer's */
    for (int i = 0; i < m->generation.n_eos_token_ids; i++)
        eos[n_eos++] = (int32_t)m->generation.eos_token_ids[i];
    if (n_eos == 0)
        for (int i = 0; i < cfg->n_eos_token_ids; i++) eos[n_eos++] = (int32_t)cfg->eos_token_ids[i];
    {
        const int32_t *te;
        size_t nt = pd_tok_eos_ids(tok, &te);
        for (size_t i = 0; i < nt && n_eos < sizeof eos / sizeof eos[0]; i++)
            if (!is_eos(te[i], eos, n_eos)) eos[n_eos++] = te[i];
    }
    if (a.chat) {
        char *src = NULL, *what = NULL;
        PD_CHECK_GOTO(pd_chat_select(a.model, NULL, false, &src, &what), rc, out);
        if (!src) {
            free(what);
            rc = pd_error(PD_EINVAL, "%s: --chat: the model has no chat template", a.model);
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
    int64_t max_tokens = a.max_tokens > 0                       ? a.max_tokens
                         : m->generation.has_max_new_tokens ? m->generation.max_new_tokens
                                                              : 16;
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
            PD_CHECK_GOTO(pd_tok_encode(tok, s->text, strlen(s->text), !a.chat, &s->ids,
                                        &s->n_ids),
                          rc, out);
            if (s->n_ids == 0) {
                rc = pd_error(PD_EINVAL, "prompt %zu: empty after tokenization", i);
                goto out;
            }
        }
        if ((int64_t)s->n_ids >= cfg->max_position_embeddings) {
            rc = pd_error(PD_EINVAL, "prompt %zu: %zu tokens, the model's context is %lld", i,
                          s->n_ids, (long long)cfg->max_position_embeddings);
            goto out;
        }
        int64_t room = cfg->max_position_embeddings - (int64_t)s->n_ids;
        s->max_out = (size_t)(max_tokens < room ? max_tokens : room);
        prompt_tokens += s->n_ids;
    }

    /* sampling parameters: model defaults (generation_config), then the flags */
    pd_sampling_params sp = pd_sampling_model_params(m->has_generation_config ? &m->generation
                                                                              : NULL);
    if (a.has_temperature) sp.temperature = a.temperature;
    if (a.has_top_p) sp.top_p = a.top_p;
    if (a.has_top_k) sp.top_k = (int32_t)a.top_k;
    if (a.has_seed) sp.has_seed = true, sp.seed = a.seed;
    if (!sp.has_seed) sp.has_seed = true, sp.seed = 0; /* offline runs are reproducible */
    PD_CHECK_GOTO(pd_sampling_params_validate(&sp, vocab), rc, out);
    PD_CHECK_GOTO(pd_sampler_ws_create(vocab, 0, &ws), rc, out);
    for (size_t i = 0; i < n_seqs; i++) {
        seq_t *s = &seqs[i];
        s->out = malloc(s->max_out * sizeof(int32_t));
        if (!s->out) {
            rc = pd_error(PD_ENOMEM, "out of memory");
            goto out;
        }
        PD_CHECK_GOTO(pd_sampler_seq_create(&sp, vocab, eos, n_eos, 0, s->ids, s->n_ids,
                                            &s->sampler),
                      rc, out);
        PD_CHECK_GOTO(pd_detok_create(tok, sp.skip_special_tokens, s->ids, s->n_ids, &s->detok),
                      rc, out);
    }

    /* backend, forward, KV */
    size_t total_blocks = kv_plan(seqs, n_seqs);
    pd_backend_params bp = pd_backend_default_params();
    bp.n_threads = a.threads;
    if (bp.max_seqs < n_seqs) bp.max_seqs = n_seqs;
    if (bp.max_blocks < total_blocks) bp.max_blocks = total_blocks;
    PD_CHECK_GOTO(pd_backend_cpu_create(&bp, &b), rc, out);
    pd_forward_params fp = pd_forward_default_params();
    fp.max_tokens = CHUNK > n_seqs ? CHUNK : n_seqs;
    fp.max_seqs = n_seqs;
    fp.max_out = n_seqs;
    PD_CHECK_GOTO(pd_forward_create(b, m, &fp, &g.f), rc, out);
    g.V = pd_forward_vocab(g.f);
    pd_kv_params kp = pd_forward_kv_params(g.f, total_blocks, BLOCK_SIZE);
    PD_CHECK_GOTO(pd_backend_get_ops(b)->kv_create(b, &kp, &g.kv), rc, out);
    g.tok = malloc(fp.max_tokens * sizeof(int32_t));
    g.qi = malloc((n_seqs + 1) * sizeof(int32_t));
    g.kvl = malloc(n_seqs * sizeof(int32_t));
    g.bi = malloc((n_seqs + 1) * sizeof(int32_t));
    g.bl = malloc(total_blocks * sizeof(int32_t));
    g.orow = malloc(n_seqs * sizeof(int32_t));
    g.logits = malloc(n_seqs * g.V * sizeof(float));
    if (!g.tok || !g.qi || !g.kvl || !g.bi || !g.bl || !g.orow || !g.logits) {
        rc = pd_error(PD_ENOMEM, "out of memory");
        goto out;
    }

    /* prefill: each prompt in chunks of CHUNK rows; the last chunk yields the first token */
    double t0 = pd_now_s();
    for (size_t i = 0; i < n_seqs && rc == 0; i++) {
        seq_t *s = &seqs[i];
        for (size_t p = 0; p < s->n_ids; p += CHUNK) {
            size_t c = s->n_ids - p < CHUNK ? s->n_ids - p : CHUNK;
            g.qi[0] = 0;
            g.qi[1] = (int32_t)c;
            g.kvl[0] = (int32_t)(p + c);
            g.bi[0] = 0;
            g.bi[1] = (int32_t)s->n_blocks;
            for (size_t k = 0; k < s->n_blocks; k++) g.bl[k] = s->block0 + (int32_t)k;
            g.orow[0] = (int32_t)c - 1;
            bool last = p + c == s->n_ids;
            pd_step st = {.n_seqs = 1, .token_ids = s->ids + p, .q_indptr = g.qi,
                          .kv_len = g.kvl, .block_indptr = g.bi, .block_ids = g.bl,
                          .n_out = last ? 1 : 0, .out_rows = g.orow};
            PD_CHECK_GOTO(pd_forward_run(g.f, g.kv, &st, g.logits), rc, out);
            if (last) PD_CHECK_GOTO(sample_one(s, g.logits, ws, eos, n_eos), rc, out);
        }
    }
    t_prefill = pd_now_s() - t0;

    /* decode: every unfinished sequence contributes one row per step */
    t0 = pd_now_s();
    for (;;) {
        size_t n = 0, nb = 0;
        g.qi[0] = 0;
        g.bi[0] = 0;
        for (size_t i = 0; i < n_seqs; i++) {
            seq_t *s = &seqs[i];
            if (s->done) continue;
            g.tok[n] = s->out[s->n_out - 1];
            g.kvl[n] = (int32_t)(s->n_ids + s->n_out);
            for (size_t k = 0; k < s->n_blocks; k++) g.bl[nb + k] = s->block0 + (int32_t)k;
            nb += s->n_blocks;
            g.bi[n + 1] = (int32_t)nb;
            g.orow[n] = (int32_t)n;
            g.qi[n + 1] = (int32_t)(n + 1);
            n++;
        }
        if (n == 0) break;
        pd_step st = {.n_seqs = n, .token_ids = g.tok, .q_indptr = g.qi, .kv_len = g.kvl,
                      .block_indptr = g.bi, .block_ids = g.bl, .n_out = n, .out_rows = g.orow};
        PD_CHECK_GOTO(pd_forward_run(g.f, g.kv, &st, g.logits), rc, out);
        size_t r = 0;
        for (size_t i = 0; i < n_seqs; i++) {
            seq_t *s = &seqs[i];
            if (s->done) continue;
            PD_CHECK_GOTO(sample_one(s, g.logits + (r++) * g.V, ws, eos, n_eos), rc, out);
            decode_tokens++;
        }
    }
    t_decode = pd_now_s() - t0;

    /* output */
    for (size_t i = 0; i < n_seqs; i++) {
        seq_t *s = &seqs[i];
        const char *d;
        size_t dl, tl;
        PD_CHECK_GOTO(pd_detok_flush(s->detok, &d, &dl), rc, out);
        const char *text = pd_detok_text(s->detok, &tl);
        if (a.json) {
            json_t *pi = json_array(), *oi = json_array();
            for (size_t k = 0; k < s->n_ids; k++) json_array_append_new(pi, json_integer(s->ids[k]));
            for (size_t k = 0; k < s->n_out; k++) json_array_append_new(oi, json_integer(s->out[k]));
            json_t *o = json_object();
            json_object_set_new(o, "prompt_token_ids", pi);
            json_object_set_new(o, "token_ids", oi);
            json_object_set_new(o, "text", json_stringn(text, tl));
            json_object_set_new(o, "finish_reason", json_string(s->finish));
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
            fwrite(text, 1, tl, stdout);
            putchar('\n');
        }
    }
    if (a.bench) {
        fprintf(stderr,
                "bench: prefill %zu tokens in %.3f s = %.1f tokens/s; decode %zu tokens in "
                "%.3f s = %.1f tokens/s (%zu sequences, %d threads)\n",
                prompt_tokens, t_prefill, prompt_tokens / (t_prefill > 0 ? t_prefill : 1e-9),
                decode_tokens, t_decode, decode_tokens / (t_decode > 0 ? t_decode : 1e-9),
                n_seqs, a.threads > 0 ? a.threads : pd_cpu_count());
    }
    rc = 0;
out:
    if (rc < 0) fprintf(stderr, "pd-generate: %s\n", pd_last_error());
    for (size_t i = 0; seqs && i < n_seqs; i++) {
        free(seqs[i].text);
        free(seqs[i].ids);
        free(seqs[i].out);
        pd_sampler_seq_free(seqs[i].sampler);
        pd_detok_free(seqs[i].detok);
    }
    free(seqs);
    for (size_t i = 0; i < n_lines; i++) free(lines[i]);
    free(lines);
    if (g.kv) pd_backend_get_ops(b)->kv_free(b, g.kv);
    pd_forward_destroy(g.f);
    free(g.tok), free(g.qi), free(g.kvl), free(g.bi), free(g.bl), free(g.orow), free(g.logits);
    pd_sampler_ws_free(ws);
    pd_backend_destroy(b);
    json_decref(cfg_vars);
    pd_chat_free(tpl);
    pd_tok_free(tok);
    pd_model_free(m);
    return rc < 0 ? 1 : 0;
}
