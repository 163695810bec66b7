/* Request parsing and validation (see api.h). The field tables follow docs/api.md §5/§6; the
 * rule order follows §2 and the tables of §8. */
#include "api.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json/json.h"
#include "util/log.h"
#include "util/status.h"

/* ---- typed field reads: 1 read, 0 absent or null, < 0 wrong type (contract message) ---------- */

static int type_err(const char *path, const char *kind)
{
    return pd_error(PD_EINVAL, "The field `%s` must be %s.", path, kind);
}

static bool as_int(const json_t *v, int64_t *out)
{
    if (json_is_integer(v)) {
        *out = json_integer_value(v);
        return true;
    }
    if (json_is_real(v)) {
        double d = json_real_value(v);
        if (d == floor(d) && d >= -9.2e18 && d <= 9.2e18) {
            *out = (int64_t)d;
            return true;
        }
    }
    return false;
}

static int f_int(const json_t *o, const char *key, int64_t *out)
{
    const json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return 0;
    return as_int(v, out) ? 1 : type_err(key, "an integer");
}

static int f_num(const json_t *o, const char *key, double *out)
{
    const json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_number(v)) return type_err(key, "a number");
    *out = json_number_value(v);
    return 1;
}

static int f_bool(const json_t *o, const char *path, const char *key, bool *out)
{
    const json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_boolean(v)) return type_err(path, "a boolean");
    *out = json_is_true(v);
    return 1;
}

/* early_stopping: a boolean, or on /generate (vLLM 0.5's SamplingParams) also "never". */
static int f_early_stopping(const json_t *o, pd_api_kind kind, int32_t *out)
{
    const json_t *v = json_object_get(o, "early_stopping");
    if (kind == PD_API_GENERATE && json_is_string(v) && !strcmp(json_string_value(v), "never")) {
        *out = PD_EARLY_STOPPING_NEVER;
        return 1;
    }
    bool b = false;
    int rc = f_bool(o, "early_stopping", "early_stopping", &b);
    if (rc < 0 && kind == PD_API_GENERATE)
        return pd_error(PD_EINVAL, "early_stopping must be True, False, or 'never', got %s.",
                        json_is_string(v) ? json_string_value(v) : "a value of another type");
    *out = b ? PD_EARLY_STOPPING_TRUE : PD_EARLY_STOPPING_FALSE;
    return rc;
}

static int f_str(const json_t *o, const char *key, const char **out)
{
    const json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_string(v)) return type_err(key, "a string");
    *out = json_string_value(v);
    return 1;
}

static int f_obj(const json_t *o, const char *key, const json_t **out)
{
    const json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_object(v)) return type_err(key, "an object");
    *out = v;
    return 1;
}

static int f_arr(const json_t *o, const char *key, const json_t **out)
{
    const json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_array(v)) return type_err(key, "an array");
    *out = v;
    return 1;
}

/* [int] into an arena array. */
static int f_int_array(const json_t *o, const char *key, pd_arena *a, int32_t **ids, int32_t *n,
                       bool *present)
{
    const json_t *v = json_object_get(o, key);
    *present = false;
    if (!v || json_is_null(v)) return 0;
    if (!json_is_array(v)) return type_err(key, "an array of integers");
    size_t cnt = json_array_size(v);
    int32_t *p = pd_arena_calloc(a, cnt ? cnt : 1, sizeof *p);
    if (!p) return pd_error(PD_ENOMEM, "out of memory");
    for (size_t i = 0; i < cnt; i++) {
        int64_t x;
        if (!as_int(json_array_get(v, i), &x)) return type_err(key, "an array of integers");
        p[i] = x < INT32_MIN ? INT32_MIN : x > INT32_MAX ? INT32_MAX : (int32_t)x;
    }
    *ids = p;
    *n = (int32_t)cnt;
    *present = true;
    return 1;
}

static int bad(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* model is one of the --served-model-name values. */
static bool served(const pd_api_limits *lim, const char *model)
{
    for (int i = 0; i < lim->n_served_names; i++)
        if (strcmp(model, lim->served_names[i]) == 0) return true;
    return false;
}
static int bad(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int rc = pd_verror(PD_EINVAL, fmt, ap);
    va_end(ap);
    return rc;
}

/* ---- parsed fields shared by both endpoints ------------------------------------------------- */

typedef struct {
    int64_t n, best_of, top_k, max_tokens, min_tokens, truncate, priority, seed, logprobs,
        prompt_logprobs;
    bool has_n, has_best_of, has_top_k, has_max_tokens, max_tokens_null, has_min_tokens,
        has_truncate, has_priority, has_seed, has_logprobs, has_prompt_logprobs;
    double temperature, top_p, min_p, presence, frequency, repetition;
    bool has_temperature, has_top_p, has_min_p, has_presence, has_frequency, has_repetition;
    const json_t *logit_bias, *stream_options, *stop_ids_json;
    bool stream, echo, include_stop, ignore_eos, skip_special, use_beam_search, add_special;
    bool has_add_special, tokens_as_ids, has_length_penalty;
    int32_t early_stopping; /* pd_early_stopping */
    double length_penalty;
    const char **stop;
    int32_t n_stop;
    int32_t *stop_ids, n_stop_ids, *allowed, n_allowed;
    bool has_allowed;
    bool include_usage, continuous_usage;
} common_fields;

static int read_common(const json_t *o, pd_api_kind kind, pd_arena *a, common_fields *f)
{
    int rc;
    memset(f, 0, sizeof *f);
    f->skip_special = true;
#define RD(expr, flag)                                                                             \
    do {                                                                                           \
        if ((rc = (expr)) < 0) return rc;                                                          \
        flag = rc == 1;                                                                            \
    } while (0)
    RD(f_int(o, "n", &f->n), f->has_n);
    RD(f_int(o, "best_of", &f->best_of), f->has_best_of);
    RD(f_num(o, "temperature", &f->temperature), f->has_temperature);
    RD(f_num(o, "top_p", &f->top_p), f->has_top_p);
    RD(f_int(o, "top_k", &f->top_k), f->has_top_k);
    RD(f_num(o, "min_p", &f->min_p), f->has_min_p);
    RD(f_num(o, "repetition_penalty", &f->repetition), f->has_repetition);
    RD(f_num(o, "presence_penalty", &f->presence), f->has_presence);
    RD(f_num(o, "frequency_penalty", &f->frequency), f->has_frequency);
    bool dummy;
    if ((rc = f_obj(o, "logit_bias", &f->logit_bias)) < 0) return rc;
    RD(f_int(o, "seed", &f->seed), f->has_seed);
    /* max tokens: chat prefers max_completion_tokens */
    int64_t mct = 0;
    bool has_mct = false;
    if (kind == PD_API_CHAT) RD(f_int(o, "max_completion_tokens", &mct), has_mct);
    RD(f_int(o, "max_tokens", &f->max_tokens), f->has_max_tokens);
    if (has_mct) {
        f->max_tokens = mct;
        f->has_max_tokens = true;
    }
    const json_t *mt = json_object_get(o, "max_tokens");
    f->max_tokens_null = mt && json_is_null(mt);
    RD(f_int(o, "min_tokens", &f->min_tokens), f->has_min_tokens);
    RD(f_int(o, "truncate_prompt_tokens", &f->truncate), f->has_truncate);
    RD(f_int(o, "priority", &f->priority), f->has_priority);
    /* stop: string or [string] */
    const json_t *stop = json_object_get(o, "stop");
    if (stop && !json_is_null(stop)) {
        if (json_is_string(stop)) {
            f->stop = pd_arena_calloc(a, 1, sizeof *f->stop);
            if (!f->stop) return pd_error(PD_ENOMEM, "out of memory");
            f->stop[0] = pd_arena_strdup(a, json_string_value(stop));
            if (!f->stop[0]) return pd_error(PD_ENOMEM, "out of memory");
            f->n_stop = 1;
        } else if (json_is_array(stop)) {
            size_t cnt = json_array_size(stop);
            f->stop = pd_arena_calloc(a, cnt ? cnt : 1, sizeof *f->stop);
            if (!f->stop) return pd_error(PD_ENOMEM, "out of memory");
            for (size_t i = 0; i < cnt; i++) {
                const json_t *s = json_array_get(stop, i);
                if (!json_is_string(s)) return type_err("stop", "a string or an array of strings");
                f->stop[i] = pd_arena_strdup(a, json_string_value(s));
                if (!f->stop[i]) return pd_error(PD_ENOMEM, "out of memory");
            }
            f->n_stop = (int32_t)cnt;
        } else {
            return type_err("stop", "a string or an array of strings");
        }
    }
    if ((rc = f_int_array(o, "stop_token_ids", a, &f->stop_ids, &f->n_stop_ids, &dummy)) < 0)
        return rc;
    f->stop_ids_json = json_object_get(o, "stop_token_ids");
    if ((rc = f_int_array(o, "allowed_token_ids", a, &f->allowed, &f->n_allowed, &f->has_allowed)) <
        0)
        return rc;
    if ((rc = f_bool(o, "stream", "stream", &f->stream)) < 0) return rc;
    if ((rc = f_obj(o, "stream_options", &f->stream_options)) < 0) return rc;
    if (f->stream_options) {
        f->include_usage = true;
        if ((rc = f_bool(f->stream_options, "stream_options.include_usage", "include_usage",
                         &f->include_usage)) < 0)
            return rc;
        if ((rc = f_bool(f->stream_options, "stream_options.continuous_usage_stats",
                         "continuous_usage_stats", &f->continuous_usage)) < 0)
            return rc;
    }
    if ((rc = f_bool(o, "echo", "echo", &f->echo)) < 0) return rc;
    if ((rc = f_bool(o, "include_stop_str_in_output", "include_stop_str_in_output",
                     &f->include_stop)) < 0)
        return rc;
    if ((rc = f_bool(o, "ignore_eos", "ignore_eos", &f->ignore_eos)) < 0) return rc;
    if ((rc = f_bool(o, "skip_special_tokens", "skip_special_tokens", &f->skip_special)) < 0)
        return rc;
    if ((rc = f_bool(o, "spaces_between_special_tokens", "spaces_between_special_tokens", &dummy)) <
        0)
        return rc;
    if ((rc = f_bool(o, "return_tokens_as_token_ids", "return_tokens_as_token_ids",
                     &f->tokens_as_ids)) < 0)
        return rc;
    if ((rc = f_bool(o, "use_beam_search", "use_beam_search", &f->use_beam_search)) < 0) return rc;
    RD(f_bool(o, "add_special_tokens", "add_special_tokens", &f->add_special), f->has_add_special);
    RD(f_num(o, "length_penalty", &f->length_penalty), f->has_length_penalty);
    if ((rc = f_early_stopping(o, kind, &f->early_stopping)) < 0) return rc;
    if (kind == PD_API_COMPLETIONS) RD(f_int(o, "logprobs", &f->logprobs), f->has_logprobs);
    RD(f_int(o, "prompt_logprobs", &f->prompt_logprobs), f->has_prompt_logprobs);
    const json_t *rf;
    if ((rc = f_obj(o, "response_format", &rf)) < 0) return rc;
#undef RD
    /* logit_bias values are numbers */
    if (f->logit_bias) {
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)f->logit_bias, k, v)
        {
            if (!json_is_number(v)) {
                char path[300];
                snprintf(path, sizeof path, "logit_bias.%s", k);
                return type_err(path, "a number");
            }
        }
    }
    return 0;
}

/* §8.1 in table order: the sampling fields through the engine's validator, then the rest. */
static int check_shared(const pd_api_limits *lim, pd_api_kind kind, const common_fields *f,
                        pd_arena *a, pd_api_request *r)
{
    pd_sampling_params *sp = &r->sp;
    /* logit_bias as written: its keys (checked by the validator) and their ids, clamped */
    pd_logit_bias *lb = NULL;
    const char **keys = NULL;
    int32_t n_lb = 0;
    if (f->logit_bias) {
        size_t cnt = json_object_size(f->logit_bias);
        lb = pd_arena_calloc(a, cnt ? cnt : 1, sizeof *lb);
        keys = pd_arena_calloc(a, cnt ? cnt : 1, sizeof *keys);
        if (!lb || !keys) return pd_error(PD_ENOMEM, "out of memory");
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)f->logit_bias, k, v)
        {
            long long id = strtoll(k, NULL, 10);
            double bias = json_number_value(v);
            if (bias > PD_LOGIT_BIAS_MAX) bias = PD_LOGIT_BIAS_MAX;
            if (bias < -PD_LOGIT_BIAS_MAX) bias = -PD_LOGIT_BIAS_MAX;
            keys[n_lb] = k;
            lb[n_lb].id = id < INT32_MIN ? INT32_MIN : id > INT32_MAX ? INT32_MAX : (int32_t)id;
            lb[n_lb].bias = (float)bias;
            n_lb++;
        }
    }
    /* stop_token_ids as written (stop_ids holds them clamped to int32) */
    int64_t *stop_written =
        pd_arena_calloc(a, f->n_stop_ids ? (size_t)f->n_stop_ids : 1, sizeof *stop_written);
    if (!stop_written) return pd_error(PD_ENOMEM, "out of memory");
    for (int32_t i = 0; i < f->n_stop_ids; i++)
        as_int(json_array_get(f->stop_ids_json, (size_t)i), &stop_written[i]);
    pd_sampling_fields sf = {.has_n = f->has_n,
                             .has_best_of = f->has_best_of,
                             .has_presence_penalty = f->has_presence,
                             .has_frequency_penalty = f->has_frequency,
                             .has_repetition_penalty = f->has_repetition,
                             /* beam search checks the values in use, given or default */
                             .has_temperature = f->has_temperature || f->use_beam_search,
                             .has_top_p = f->has_top_p || f->use_beam_search,
                             .has_top_k = f->has_top_k || f->use_beam_search,
                             .has_min_p = f->has_min_p,
                             .has_max_tokens = f->has_max_tokens,
                             .has_min_tokens = f->has_min_tokens,
                             .n = f->n,
                             .best_of = f->best_of,
                             .top_k = f->has_top_k ? f->top_k : lim->defaults.top_k,
                             .max_tokens = f->max_tokens,
                             .min_tokens = f->min_tokens,
                             .presence_penalty = f->presence,
                             .frequency_penalty = f->frequency,
                             .repetition_penalty = f->repetition,
                             .temperature =
                                 f->has_temperature ? f->temperature : lim->defaults.temperature,
                             .top_p = f->has_top_p ? f->top_p : lim->defaults.top_p,
                             .min_p = f->min_p,
                             .stop = (const char *const *)f->stop,
                             .n_stop = f->n_stop,
                             .stop_token_ids = f->stop_ids,
                             .stop_token_ids_written = stop_written,
                             .n_stop_token_ids = f->n_stop_ids,
                             .logit_bias = lb,
                             .logit_bias_keys = keys,
                             .n_logit_bias = n_lb,
                             .has_allowed_token_ids = f->has_allowed,
                             .allowed_token_ids = f->allowed,
                             .n_allowed_token_ids = f->n_allowed,
                             .max_n = lim->max_n,
                             .max_tokens_zero_ok = f->echo && kind == PD_API_COMPLETIONS,
                             .use_beam_search = f->use_beam_search,
                             .early_stopping = f->early_stopping,
                             .has_length_penalty = f->has_length_penalty,
                             .length_penalty = f->length_penalty};
    PD_CHECK(pd_sampling_check(&sf, lim->vocab));
    int64_t n = f->has_n ? f->n : 1;
    if (f->has_truncate) {
        if (f->truncate < 1)
            return bad("truncate_prompt_tokens must be at least 1, got %lld.",
                       (long long)f->truncate);
        if (f->truncate > lim->max_model_len)
            return bad("truncate_prompt_tokens value (%lld) is greater than max_model_len (%lld). "
                       "Please, select a smaller truncation size.",
                       (long long)f->truncate, (long long)lim->max_model_len);
    }
    if (f->has_priority && f->priority != 0)
        return bad("Got priority %lld but Priority scheduling is not enabled.",
                   (long long)f->priority);
    if (f->stream_options && !f->stream) { /* members that are null count as absent */
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)f->stream_options, k, v)
        {
            if (!json_is_null(v))
                return bad("Stream options can only be defined when `stream=True`.");
        }
    }

    /* the sampling parameters the engine gets */
    *sp = lim->defaults;
    sp->n = (int32_t)n;
    if (f->has_temperature) sp->temperature = f->temperature;
    if (f->has_top_p) sp->top_p = f->top_p;
    if (f->has_top_k) sp->top_k = (int32_t)f->top_k;
    if (f->has_min_p) sp->min_p = f->min_p;
    if (f->has_presence) sp->presence_penalty = f->presence;
    if (f->has_frequency) sp->frequency_penalty = f->frequency;
    if (f->has_repetition) sp->repetition_penalty = f->repetition;
    if (f->has_seed) {
        sp->has_seed = true;
        sp->seed = f->seed;
    }
    sp->logit_bias = lb;
    sp->n_logit_bias = n_lb;
    sp->has_allowed_token_ids = f->has_allowed;
    sp->allowed_token_ids = f->allowed;
    sp->n_allowed_token_ids = f->n_allowed;
    sp->min_tokens = f->has_min_tokens ? (int32_t)f->min_tokens : 0;
    sp->ignore_eos = f->ignore_eos;
    sp->stop_token_ids = f->stop_ids;
    sp->n_stop_token_ids = f->n_stop_ids;
    sp->stop = f->stop;
    sp->n_stop = f->n_stop;
    sp->include_stop_str_in_output = f->include_stop;
    sp->skip_special_tokens = f->skip_special;
    sp->logprobs = -1;
    sp->prompt_logprobs = -1;
    /* best_of > n: best_of sequences are sampled and the n of the highest cumulative logprob
     * returned, as vLLM 0.5 does; whole, not streamed (its completions rule, taken for every
     * endpoint) */
    r->best_of = f->has_best_of ? (int32_t)f->best_of : sp->n;
    if (f->use_beam_search) { /* one search answers the n choices (docs/beam_search.md) */
        sp->use_beam_search = true;
        sp->best_of = r->best_of;
        sp->length_penalty = f->has_length_penalty ? f->length_penalty : 1.0;
        sp->early_stopping = f->early_stopping;
        r->best_of = sp->n;
    } else if (r->best_of > sp->n && sp->temperature < 1e-5)
        return bad("best_of must be 1 when using greedy sampling.Got %lld.", (long long)f->best_of);
    /* a search's beams are answered whole at its end: not streamed, as vLLM 0.5's completions
     * (and best_of > n above) */
    r->stream = f->stream && r->best_of == sp->n && !f->use_beam_search;
    return 0;
}

/* prompt_logprobs (both endpoints; vLLM's checks and words): computed on the prefill instance,
 * returned in the response body only. */
static int check_prompt_logprobs(const pd_api_limits *lim, const common_fields *f,
                                 pd_api_request *r)
{
    if (!f->has_prompt_logprobs) return 0;
    if (f->stream && f->prompt_logprobs > 0)
        return bad("`prompt_logprobs` are not available when `stream=True`.");
    if (f->prompt_logprobs < 0) return bad("`prompt_logprobs` must be a positive value.");
    if (f->prompt_logprobs > lim->max_logprobs)
        return bad("Requested prompt logprobs of %lld, which is greater than max allowed: %d",
                   (long long)f->prompt_logprobs, lim->max_logprobs);
    r->sp.prompt_logprobs = (int32_t)f->prompt_logprobs;
    return 0;
}

/* §8.4 in table order. */
static int check_unsupported(const json_t *o, const common_fields *f)
{
    const json_t *v = json_object_get(o, "prompt_embeds");
    if (v && !json_is_null(v)) return bad("`prompt_embeds` is not supported.");
    v = json_object_get(o, "structural_tag");
    if (v && !json_is_null(v)) return bad("`structural_tag` is not supported.");
    v = json_object_get(o, "logits_processors");
    if (v && !json_is_null(v)) return bad("`logits_processors` is not supported.");
    v = json_object_get(o, "bad_words");
    if (v && !json_is_null(v) && !(json_is_array(v) && json_array_size(v) == 0))
        return bad("`bad_words` is not supported.");
    return 0;
}

/* ---- structured output ---------------------------------------------------------------------- */

/* JSON text of v in the arena (compact, key order kept). */
static int dump_json(const json_t *v, pd_arena *a, const char **text, size_t *len)
{
    char *d = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!d) return pd_error(PD_ENOMEM, "out of memory");
    *len = strlen(d);
    *text = pd_arena_strndup(a, d, *len);
    free(d);
    return *text ? 0 : pd_error(PD_ENOMEM, "out of memory");
}

/* Sets sp's guided spec to (kind, the text of v) and compiles it once through the api-server's
 * cache, so that a schema, regex or grammar that cannot be enforced is a 400 naming the keyword
 * and its place (field: the request field it came from). The instances compile the same text. */
static int set_guided(const pd_api_limits *lim, const char *field, pd_gspec_kind kind,
                      const char *text, size_t len, pd_sampling_params *sp)
{
    sp->guided_kind = (int32_t)kind;
    sp->guided = text;
    sp->guided_len = len;
    if (!lim->grammars)
        return bad("`%s`: structured output needs the model's tokenizer, which this server has "
                   "not loaded.",
                   field);
    pd_gspec spec = {
        .kind = kind, .text = text, .len = len, .ws_pattern = sp->guided_ws, .strict = true};
    pd_grammar *g;
    pd_gerr ge;
    int rc = pd_gcache_get(lim->grammars, &spec, &g, &ge);
    if (rc == PD_ENOMEM) return rc;
    if (rc < 0) return bad("`%s`: %s", field, ge.msg[0] ? ge.msg : pd_last_error());
    pd_grammar_unref(g);
    return 0;
}

/* The structured-output fields (vLLM's guided_json / guided_regex / guided_choice /
 * guided_grammar, guided_whitespace_pattern, guided_decoding_backend, and response_format
 * json_object / json_schema): at most one kind, into sp. */
static int read_guided(const pd_api_limits *lim, const json_t *o, pd_arena *a,
                       pd_sampling_params *sp)
{
    static const char *const fields[] = {"guided_json", "guided_regex", "guided_choice",
                                         "guided_grammar"};
    static const pd_gspec_kind kinds[] = {PD_GSPEC_JSON_SCHEMA, PD_GSPEC_REGEX, PD_GSPEC_CHOICE,
                                          PD_GSPEC_GRAMMAR};
    const char *field = NULL, *text = NULL;
    size_t len = 0;
    pd_gspec_kind kind = 0;
    int rc;
    for (size_t i = 0; i < sizeof fields / sizeof *fields; i++) {
        const json_t *v = json_object_get(o, fields[i]);
        if (!v || json_is_null(v)) continue;
        if (field)
            return bad("You can only use one kind of guided decoding but multiple are specified: "
                       "`%s` and `%s`.",
                       field, fields[i]);
        field = fields[i];
        kind = kinds[i];
        if (kind == PD_GSPEC_JSON_SCHEMA && (json_is_object(v) || json_is_boolean(v))) {
            if ((rc = dump_json(v, a, &text, &len)) < 0) return rc;
        } else if (kind == PD_GSPEC_CHOICE) {
            if (!json_is_array(v)) return type_err(field, "an array of strings");
            for (size_t k = 0; k < json_array_size(v); k++)
                if (!json_is_string(json_array_get(v, k)))
                    return type_err(field, "an array of strings");
            if (json_array_size(v) == 0) return bad("`guided_choice` must not be empty.");
            if ((rc = dump_json(v, a, &text, &len)) < 0) return rc;
        } else if (json_is_string(v)) { /* the body is freed before the request ends */
            len = json_string_length(v);
            if (!(text = pd_arena_strndup(a, json_string_value(v), len)))
                return pd_error(PD_ENOMEM, "out of memory");
        } else {
            return type_err(field,
                            kind == PD_GSPEC_JSON_SCHEMA ? "an object or a string" : "a string");
        }
    }
    const json_t *rf = json_object_get(o, "response_format");
    if (rf && !json_is_null(rf)) {
        const char *t = json_string_value(json_object_get(rf, "type"));
        if (!t) return type_err("response_format.type", "a string");
        if (strcmp(t, "text") == 0) {
            rf = NULL;
        } else if (strcmp(t, "json_object") != 0 && strcmp(t, "json_schema") != 0) {
            return bad("`response_format` type '%s' is not supported; use 'text', 'json_object' "
                       "or 'json_schema'.",
                       t);
        } else if (field) {
            return bad("You can only use one kind of guided decoding but multiple are specified: "
                       "`%s` and `response_format`.",
                       field);
        } else if (strcmp(t, "json_object") == 0) {
            field = "response_format";
            kind = PD_GSPEC_JSON_OBJECT;
            text = "";
        } else {
            const json_t *js = json_object_get(rf, "json_schema");
            if (!json_is_object(js))
                return type_err("response_format.json_schema", "an object (with `name` and "
                                                               "`schema`)");
            const json_t *name = json_object_get(js, "name");
            if (!json_is_string(name))
                return type_err("response_format.json_schema.name", "a string");
            const json_t *sch = json_object_get(js, "schema");
            field = "response_format.json_schema.schema";
            if (!sch || json_is_null(sch)) { /* no schema: any JSON object */
                kind = PD_GSPEC_JSON_OBJECT;
                text = "";
            } else if (json_is_object(sch) || json_is_boolean(sch)) {
                kind = PD_GSPEC_JSON_SCHEMA;
                if ((rc = dump_json(sch, a, &text, &len)) < 0) return rc;
            } else {
                return type_err(field, "an object");
            }
        }
    }
    const char *backend = NULL;
    if ((rc = f_str(o, "guided_decoding_backend", &backend)) < 0) return rc; /* ours, whatever */
    const char *ws = NULL;
    if ((rc = f_str(o, "guided_whitespace_pattern", &ws)) < 0) return rc;
    sp->guided_ws = NULL;
    if (ws && !(sp->guided_ws = pd_arena_strdup(a, ws)))
        return pd_error(PD_ENOMEM, "out of memory");
    if (!field) return 0; /* the pattern stays for tool_choice's schema (guide_tools) */
    if (kind != PD_GSPEC_JSON_SCHEMA && kind != PD_GSPEC_JSON_OBJECT) sp->guided_ws = NULL;
    return set_guided(lim, field, kind, text, len, sp);
}

/* §8.5's 400 for a prompt of P >= L tokens (at least P: its tokenization stopped there). */
static int too_long(int64_t L, int64_t P, bool at_least)
{
    return bad("This model's maximum context length is %lld tokens. However, your request has "
               "%s%lld input tokens. Please reduce the length of the input messages.",
               (long long)L, at_least ? "at least " : "", (long long)P);
}

/* §8.5 and the min_tokens rule for one prompt; sets its effective max_tokens. */
static int check_context(const pd_api_limits *lim, const pd_api_request *r, pd_api_prompt *p)
{
    int64_t L = lim->max_model_len, P = (int64_t)p->n_ids, M = r->max_tokens;
    if (P >= L) return too_long(L, P, false);
    if (M >= 0 && P + M > L)
        return bad("'max_tokens' or 'max_completion_tokens' is too large: %lld. This model's "
                   "maximum context length is %lld tokens and your request has %lld input tokens "
                   "(%lld > %lld - %lld).",
                   (long long)M, (long long)L, (long long)P, (long long)M, (long long)L,
                   (long long)P);
    int64_t eff = L - P;
    if (M >= 0 && M < eff) eff = M;
    if (lim->max_new_tokens >= 0 && lim->max_new_tokens < eff) eff = lim->max_new_tokens;
    if (r->sp.min_tokens > eff)
        return bad("min_tokens must be less than or equal to max_tokens=%lld, got %d.",
                   (long long)eff, r->sp.min_tokens);
    p->max_tokens = eff;
    return 0;
}

/* Tokenizes text into p (with truncation). Without truncation (and but for /tokenize, which
 * counts every token), tokenization stops once the prompt cannot fit the context (a huge prompt
 * costs what L tokens do): 400 "at least N". */
static int tokenize(const pd_api_limits *lim, const pd_api_request *r, const char *text, size_t len,
                    pd_arena *a, pd_api_prompt *p)
{
    int32_t *ids = NULL;
    size_t n = 0;
    bool more = false;
    int rc = r->truncate > 0 || r->kind == PD_API_TOKENIZE || lim->max_model_len <= 0
                 ? pd_tok_encode(lim->tok, text, len, r->add_special_tokens, &ids, &n)
                 : pd_tok_encode_max(lim->tok, text, len, r->add_special_tokens,
                                     (size_t)lim->max_model_len - 1, &ids, &n, &more);
    if (rc < 0) {
        free(ids);
        return bad("Tokenization failed: %s", pd_last_error());
    }
    if (more) return too_long(lim->max_model_len, (int64_t)n, true);
    size_t skip = r->truncate > 0 && (size_t)r->truncate < n ? n - (size_t)r->truncate : 0;
    p->n_ids = n - skip;
    p->ids = pd_arena_calloc(a, p->n_ids ? p->n_ids : 1, sizeof *p->ids);
    if (!p->ids) {
        free(ids);
        return pd_error(PD_ENOMEM, "out of memory");
    }
    if (p->n_ids) memcpy(p->ids, ids + skip, p->n_ids * sizeof *ids);
    free(ids);
    p->text = pd_arena_strndup(a, text, len);
    if (p->n_ids == 0) return bad("The decoder prompt cannot be empty");
    return 0;
}

/* ---- completions ---------------------------------------------------------------------------- */

static const char *const PROMPT_KIND = "a string, an array of strings, an array of integers, or an "
                                       "array of arrays of integers";

static int parse_completions(const pd_api_limits *lim, const json_t *o, pd_arena *a,
                             const common_fields *f, pd_api_request *r)
{
    /* prompt shape (a type check: done before the model and the rules by the caller order) */
    const json_t *prompt = json_object_get(o, "prompt");
    int rc;
    const json_t *pe = json_object_get(o, "prompt_embeds");
    if ((!prompt || json_is_null(prompt)) && (!pe || json_is_null(pe)))
        return bad("At least one of `prompt` or `prompt_embeds` must be set.");
    if (json_is_array(prompt) && json_array_size(prompt) == 0)
        return bad("The field `prompt` must not be an empty array.");
    /* token ids in vocabulary */
    if (json_is_array(prompt)) {
        for (size_t i = 0; i < json_array_size(prompt); i++) {
            const json_t *e = json_array_get(prompt, i);
            size_t n = json_is_array(e) ? json_array_size(e) : json_is_string(e) ? 0 : 1;
            for (size_t j = 0; j < n; j++) {
                int64_t id = 0; /* integers, or numbers with a zero fraction (type-checked) */
                as_int(json_is_array(e) ? json_array_get(e, j) : e, &id);
                if (id < 0 || id >= lim->vocab)
                    return bad("Token id %lld is out of vocabulary", (long long)id);
            }
        }
    }
    if (f->has_logprobs) {
        if (f->logprobs < 0) return bad("`logprobs` must be a positive value.");
        if (f->logprobs > lim->max_logprobs)
            return bad("Requested sample logprobs of %lld, which is greater than max allowed: %d",
                       (long long)f->logprobs, lim->max_logprobs);
    }
    const json_t *suffix = json_object_get(o, "suffix");
    if (suffix && !json_is_null(suffix)) return bad("suffix is not currently supported");
    if ((rc = check_unsupported(o, f)) < 0) return rc;
    if ((rc = read_guided(lim, o, a, &r->sp)) < 0) return rc;
    if ((rc = check_prompt_logprobs(lim, f, r)) < 0) return rc;
    if (f->has_logprobs) r->sp.logprobs = (int32_t)f->logprobs;
    /* echo with logprobs: the prompt's tokens lead choice.logprobs (vLLM asks for prompt
     * logprobs of the same k unless prompt_logprobs says otherwise) */
    if (f->echo && f->has_logprobs && r->sp.prompt_logprobs < 0)
        r->sp.prompt_logprobs = (int32_t)f->logprobs;
    if (r->sp.prompt_logprobs >= 0 && f->has_max_tokens && f->max_tokens == 0)
        return bad("`max_tokens` 0 (the prompt only) is not supported together with prompt "
                   "logprobs (`prompt_logprobs`, or `echo` with `logprobs`).");
    if (!prompt || json_is_null(prompt)) return bad("`prompt_embeds` is not supported.");
    /* prompts */
    size_t np = json_is_string(prompt) ? 1 : json_array_size(prompt);
    bool ids_flat = json_is_array(prompt) && !json_is_string(json_array_get(prompt, 0)) &&
                    !json_is_array(json_array_get(prompt, 0));
    if (ids_flat) np = 1;
    r->prompts = pd_arena_calloc(a, np, sizeof *r->prompts);
    if (!r->prompts) return pd_error(PD_ENOMEM, "out of memory");
    r->n_prompts = np;
    for (size_t i = 0; i < np; i++) {
        pd_api_prompt *p = &r->prompts[i];
        const json_t *e = json_is_string(prompt) ? prompt
                          : ids_flat             ? prompt
                                                 : json_array_get(prompt, i);
        if (json_is_string(e)) {
            if ((rc = tokenize(lim, r, json_string_value(e), json_string_length(e), a, p)) < 0)
                return rc;
        } else {
            size_t n = json_array_size(e);
            int32_t *ids = pd_arena_calloc(a, n ? n : 1, sizeof *ids);
            if (!ids) return pd_error(PD_ENOMEM, "out of memory");
            for (size_t j = 0; j < n; j++) {
                int64_t id = 0;
                as_int(json_array_get(e, j), &id);
                ids[j] = (int32_t)id;
            }
            size_t skip = r->truncate > 0 && (size_t)r->truncate < n ? n - (size_t)r->truncate : 0;
            p->ids = ids + skip;
            p->n_ids = n - skip;
            char *text = NULL;
            size_t tl = 0;
            if (pd_tok_decode(lim->tok, p->ids, p->n_ids, false, &text, &tl) < 0)
                return bad("Tokenization failed: %s", pd_last_error());
            p->text = pd_arena_strndup(a, text, tl);
            free(text);
            if (p->n_ids == 0) return bad("The decoder prompt cannot be empty");
        }
    }
    return 0;
}

/* Type check of `prompt` (part of the "types of known fields" step). */
static int check_prompt_type(const json_t *prompt)
{
    if (!prompt || json_is_null(prompt) || json_is_string(prompt)) return 0;
    if (!json_is_array(prompt)) return type_err("prompt", PROMPT_KIND);
    size_t n = json_array_size(prompt);
    if (n == 0) return 0;
    const json_t *first = json_array_get(prompt, 0);
    int64_t x;
    for (size_t i = 0; i < n; i++) {
        const json_t *e = json_array_get(prompt, i);
        if (json_is_string(first)) {
            if (!json_is_string(e)) return type_err("prompt", PROMPT_KIND);
        } else if (json_is_array(first)) {
            if (!json_is_array(e)) return type_err("prompt", PROMPT_KIND);
            for (size_t j = 0; j < json_array_size(e); j++)
                if (!as_int(json_array_get(e, j), &x)) return type_err("prompt", PROMPT_KIND);
        } else if (!as_int(e, &x)) {
            return type_err("prompt", PROMPT_KIND);
        }
    }
    return 0;
}

/* ---- chat ------------------------------------------------------------------------------------ */

typedef struct {
    bool logprobs, add_generation_prompt, continue_final;
    int64_t top_logprobs;
    bool has_top_logprobs;
    const char *chat_template;
    const json_t *kwargs, *documents, *tools, *tool_choice;
} chat_fields;

static int read_chat(const json_t *o, chat_fields *c)
{
    int rc;
    memset(c, 0, sizeof *c);
    c->add_generation_prompt = true;
    if ((rc = f_bool(o, "logprobs", "logprobs", &c->logprobs)) < 0) return rc;
    if ((rc = f_int(o, "top_logprobs", &c->top_logprobs)) < 0) return rc;
    c->has_top_logprobs = rc == 1;
    if ((rc = f_bool(o, "add_generation_prompt", "add_generation_prompt",
                     &c->add_generation_prompt)) < 0)
        return rc;
    if ((rc = f_bool(o, "continue_final_message", "continue_final_message", &c->continue_final)) <
        0)
        return rc;
    if ((rc = f_str(o, "chat_template", &c->chat_template)) < 0) return rc;
    if ((rc = f_obj(o, "chat_template_kwargs", &c->kwargs)) < 0) return rc;
    if ((rc = f_arr(o, "documents", &c->documents)) < 0) return rc;
    if ((rc = f_arr(o, "tools", &c->tools)) < 0) return rc;
    const json_t *tc = json_object_get(o, "tool_choice");
    if (tc && !json_is_null(tc)) c->tool_choice = tc;
    return 0;
}

/* tool_choice "required" or a named function (vLLM's _get_guided_json_from_tool): the answer is
 * constrained by a JSON schema made of the tools' parameters. Named: the function's parameters
 * (its arguments are the whole answer). Required: a non-empty array of {"name", "parameters"}
 * objects, one schema per tool, their "$defs" gathered at the top. */
static int guide_tools(const pd_api_limits *lim, const json_t *tools, pd_api_request *r,
                       pd_arena *a)
{
    if (r->sp.guided_kind)
        return bad("You can only either use guided decoding or tools, not both: `tool_choice` %s "
                   "constrains the answer itself.",
                   r->tool_named ? "with a named function" : "\"required\"");
    json_t *schema = NULL, *any = json_array(), *defs = json_object();
    int rc = 0;
    if (!any || !defs) rc = pd_error(PD_ENOMEM, "out of memory");
    for (size_t i = 0; rc == 0 && i < json_array_size(tools); i++) {
        const json_t *fn = json_object_get(json_array_get(tools, i), "function");
        const char *name = json_string_value(json_object_get(fn, "name"));
        const json_t *params = json_object_get(fn, "parameters");
        bool empty = !json_is_object(params) || json_object_size(params) == 0;
        if (r->tool_named) {
            if (!name || strcmp(name, r->tool_named) != 0) continue;
            schema = empty ? json_pack("{s:s,s:{}}", "type", "object", "properties")
                           : json_deep_copy(params);
            break;
        }
        json_t *p = empty ? json_pack("{s:s,s:{}}", "type", "object", "properties")
                          : json_deep_copy(params);
        const json_t *d = p ? json_object_get(p, "$defs") : NULL;
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)d, k, v)
        {
            const json_t *old = json_object_get(defs, k);
            if (old && !json_equal(old, v)) {
                rc = bad("Tool definition '%s' has multiple schemas, which is not supported.", k);
                break;
            }
            json_object_set(defs, k, v);
        }
        if (p) json_object_del(p, "$defs");
        json_t *one = p ? json_pack("{s:{s:{s:s,s:[s]},s:o},s:[s,s]}", "properties", "name", "type",
                                    "string", "enum", name ? name : "", "parameters", p, "required",
                                    "name", "parameters")
                        : NULL;
        if (rc == 0 && (!one || json_array_append_new(any, one) < 0))
            rc = pd_error(PD_ENOMEM, "out of memory");
    }
    if (rc == 0 && r->tool_named && !schema)
        rc = bad("Tool '%s' has not been passed in `tools`.", r->tool_named);
    if (rc == 0 && !r->tool_named) {
        schema = json_pack("{s:s,s:i,s:{s:s,s:O}}", "type", "array", "minItems", 1, "items", "type",
                           "object", "anyOf", any);
        if (schema && json_object_size(defs) > 0) json_object_set(schema, "$defs", defs);
        if (!schema) rc = pd_error(PD_ENOMEM, "out of memory");
    }
    const char *text = NULL;
    size_t len = 0;
    if (rc == 0) rc = dump_json(schema, a, &text, &len);
    json_decref(schema);
    json_decref(any);
    json_decref(defs);
    if (rc < 0) return rc;
    return set_guided(lim, "tools", PD_GSPEC_JSON_SCHEMA, text, len, &r->sp);
}

static int parse_chat(const pd_api_limits *lim, const json_t *o, pd_arena *a,
                      const common_fields *f, const chat_fields *c, json_t **msgs,
                      pd_api_request *r)
{
    int rc;
    /* §8.3 in table order: messages (their types were checked with the other fields'), ... */
    if ((rc = pd_chat_normalize_messages(json_object_get(o, "messages"), "messages", msgs)) < 0)
        return rc == PD_ENOMEM ? rc : PD_EINVAL;
    const json_t *messages = *msgs;
    if (c->has_top_logprobs) {
        if (c->top_logprobs < 0) return bad("`top_logprobs` must be a positive value.");
        if (c->top_logprobs > 0 && !c->logprobs)
            return bad("when using `top_logprobs`, `logprobs` must be set to true.");
        if (c->top_logprobs > lim->max_logprobs)
            return bad("Requested sample logprobs of %lld, which is greater than max allowed: %d",
                       (long long)c->top_logprobs, lim->max_logprobs);
    }
    if (c->continue_final && c->add_generation_prompt)
        return bad("Cannot set both `continue_final_message` and `add_generation_prompt` to True.");
    const char *choice = c->tools ? "auto" : "none";
    bool named = false;
    if (c->tool_choice) {
        if (json_is_string(c->tool_choice)) {
            choice = json_string_value(c->tool_choice);
            if (strcmp(choice, "none") != 0 && !c->tools)
                return bad("When using `tool_choice`, `tools` must be set.");
            if (strcmp(choice, "none") != 0 && strcmp(choice, "auto") != 0 &&
                strcmp(choice, "required") != 0)
                return bad("Invalid value for `tool_choice`: %s! Only named tools, \"none\", "
                           "\"auto\" or \"required\" are supported.",
                           choice);
        } else {
            if (!c->tools) return bad("When using `tool_choice`, `tools` must be set.");
            const json_t *fn = json_object_get(c->tool_choice, "function");
            if (!json_is_object(c->tool_choice) || !json_is_string(json_object_get(fn, "name"))) {
                char *s = json_dumps(c->tool_choice, JSON_COMPACT | JSON_ENCODE_ANY);
                rc = bad("Invalid value for `tool_choice`: %s! Only named tools, \"none\", "
                         "\"auto\" or \"required\" are supported.",
                         s ? s : "");
                free(s);
                return rc;
            }
            named = true;
            choice = "named";
        }
    }
    if (strcmp(choice, "auto") == 0 && !lim->auto_tools)
        return bad("\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser "
                   "to be set");
    r->parse_tools = strcmp(choice, "auto") == 0;
    r->tools_required = strcmp(choice, "required") == 0;
    if (named)
        r->tool_named =
            pd_arena_strdup(a, json_string_value(json_object_get(
                                   json_object_get(c->tool_choice, "function"), "name")));
    /* mistral's [TOOL_CALLS] is a special token: vLLM's adjust_request keeps it in the text */
    if (r->parse_tools && lim->tool_parser == PD_TOOL_MISTRAL) r->sp.skip_special_tokens = false;
    if (c->chat_template && !lim->trust_request_template)
        return bad("Chat template is passed with request, but --trust-request-chat-template is not "
                   "set. Refused request with untrusted chat template.");
    if (!lim->chat_template && !c->chat_template)
        return bad("This model has no chat template; start the server with --chat-template, or "
                   "use /v1/completions.");
    if ((rc = check_unsupported(o, f)) < 0) return rc;
    if ((rc = read_guided(lim, o, a, &r->sp)) < 0) return rc;
    if ((r->tool_named || r->tools_required) && (rc = guide_tools(lim, c->tools, r, a)) < 0)
        return rc;
    if ((rc = check_prompt_logprobs(lim, f, r)) < 0) return rc;
    if (c->logprobs) r->sp.logprobs = c->has_top_logprobs ? (int32_t)c->top_logprobs : 0;
    /* the request's own template (trusted), compiled for this request only */
    pd_chat_template *own = NULL;
    if (c->chat_template &&
        (rc = pd_chat_compile(c->chat_template, "request chat_template", &own)) < 0)
        return rc == PD_ENOMEM ? rc : PD_EINVAL; /* the compiler's message is the 400's */
    /* render */
    json_t *tools = NULL, *vars = NULL;
    if (c->tools && (rc = pd_chat_normalize_tools(c->tools, "tools", &tools)) < 0) {
        pd_chat_free(own);
        return rc;
    }
    rc = pd_chat_build_vars(lim->chat_config_vars, messages, tools, c->documents,
                            c->add_generation_prompt, lim->default_kwargs, c->kwargs, &vars);
    json_decref(tools);
    if (rc < 0) {
        pd_chat_free(own);
        return rc;
    }
    char *text = NULL;
    size_t len = 0;
    const pd_chat_template *model_tmpl = // §13.1: 'tool_use' for a request with tools
        c->tools && lim->chat_template_tools ? lim->chat_template_tools : lim->chat_template;
    rc = pd_chat_render(own ? own : model_tmpl, vars, &text, &len);
    pd_chat_free(own);
    json_decref(vars);
    if (rc < 0) return rc == PD_ENOMEM ? rc : PD_EINVAL;
    size_t n_msg = json_array_size(messages);
    const json_t *last = json_array_get(messages, n_msg - 1);
    const char *last_role = json_string_value(json_object_get(last, "role"));
    const char *last_content = json_string_value(json_object_get(last, "content"));
    if (c->continue_final && (rc = pd_chat_continue_final(text, last_content, &len)) < 0) {
        free(text);
        return rc;
    }
    r->role = c->add_generation_prompt ? lim->response_role : pd_arena_strdup(a, last_role);
    if (f->echo && last_role && strcmp(last_role, r->role) == 0)
        r->echo_text = pd_arena_strdup(a, last_content ? last_content : "");
    r->prompts = pd_arena_calloc(a, 1, sizeof *r->prompts);
    if (!r->prompts) {
        free(text);
        return pd_error(PD_ENOMEM, "out of memory");
    }
    r->n_prompts = 1;
    rc = tokenize(lim, r, text, len, a, &r->prompts[0]);
    free(text);
    return rc;
}

/* ---- legacy /generate (§14) --------------------------------------------------------------------
 */

static int parse_generate(const pd_api_limits *lim, const json_t *o, pd_arena *a, pd_api_request *r)
{
    static const char *const allowed[] = {"prompt",
                                          "stream",
                                          "n",
                                          "best_of",
                                          "temperature",
                                          "top_p",
                                          "top_k",
                                          "min_p",
                                          "presence_penalty",
                                          "frequency_penalty",
                                          "repetition_penalty",
                                          "seed",
                                          "stop",
                                          "stop_token_ids",
                                          "ignore_eos",
                                          "max_tokens",
                                          "min_tokens",
                                          "logprobs",
                                          "skip_special_tokens",
                                          "spaces_between_special_tokens",
                                          "include_stop_str_in_output",
                                          "logit_bias",
                                          "allowed_token_ids",
                                          "truncate_prompt_tokens",
                                          "guided_json",
                                          "guided_regex",
                                          "guided_choice",
                                          "guided_grammar",
                                          "guided_whitespace_pattern",
                                          "guided_decoding_backend",
                                          "use_beam_search",
                                          "length_penalty",
                                          "early_stopping"};
    const char *k;
    json_t *v;
    json_object_foreach((json_t *)o, k, v)
    {
        bool ok = false;
        for (size_t i = 0; i < sizeof allowed / sizeof *allowed && !ok; i++)
            ok = strcmp(k, allowed[i]) == 0;
        if (!ok) return bad("Unsupported sampling parameter: `%s`.", k);
    }
    const json_t *prompt = json_object_get(o, "prompt");
    if (!prompt || json_is_null(prompt)) return bad("The field `prompt` is required.");
    if (!json_is_string(prompt)) return bad("The field `prompt` must be a string.");
    int64_t lp;
    int rc;
    if ((rc = f_int(o, "logprobs", &lp)) < 0) return rc; /* accepted, nothing returned */
    common_fields f;
    if ((rc = read_common(o, PD_API_GENERATE, a, &f)) < 0) return rc;
    /* fixed defaults: generation_config.json is never applied here */
    pd_api_limits fixed = *lim;
    fixed.defaults = pd_sampling_default_params();
    fixed.max_new_tokens = -1;
    if ((rc = check_shared(&fixed, PD_API_GENERATE, &f, a, r)) < 0) return rc;
    if ((rc = read_guided(lim, o, a, &r->sp)) < 0) return rc;
    r->truncate = f.has_truncate ? f.truncate : -1;
    r->add_special_tokens = true;
    r->max_tokens = f.has_max_tokens ? f.max_tokens : f.max_tokens_null ? -1 : 16;
    r->prompts = pd_arena_calloc(a, 1, sizeof *r->prompts);
    if (!r->prompts) return pd_error(PD_ENOMEM, "out of memory");
    r->n_prompts = 1;
    if ((rc = tokenize(lim, r, json_string_value(prompt), json_string_length(prompt), a,
                       &r->prompts[0])) < 0)
        return rc;
    pd_api_limits nocap = *lim;
    nocap.max_new_tokens = -1;
    if ((rc = check_context(&nocap, r, &r->prompts[0])) < 0) return rc;
    r->sp.max_tokens = -1;
    return 0;
}

/* ---- entry point ------------------------------------------------------------------------------
 */

int pd_api_parse(const pd_api_limits *lim, pd_api_kind kind, const char *body, size_t len,
                 pd_arena *a, pd_api_request *out, int *http_status)
{
    memset(out, 0, sizeof *out);
    out->kind = kind;
    *http_status = 400;
    json_error_t jerr;
    json_t *o = pdj_loadb(body, len, JSON_DECODE_ANY, &jerr);
    if (!o)
        return bad("Invalid JSON in request body: %s (line %d, column %d)", jerr.text, jerr.line,
                   jerr.column);
    int rc = 0;
    json_t *messages = NULL;
    if (!json_is_object(o)) {
        rc = bad("Request body must be a JSON object.");
        goto done;
    }
    if (kind == PD_API_GENERATE) {
        rc = parse_generate(lim, o, a, out);
        goto done;
    }
    /* /tokenize: a completions body (vLLM's takes one prompt string) or a chat body */
    bool tokenize = kind == PD_API_TOKENIZE;
    if (tokenize) {
        kind = json_object_get(o, "messages") ? PD_API_CHAT : PD_API_COMPLETIONS;
        const json_t *prompt = json_object_get(o, "prompt");
        if (kind == PD_API_COMPLETIONS && prompt && !json_is_string(prompt)) {
            rc = type_err("prompt", "a string");
            goto done;
        }
        if ((rc = f_bool(o, "return_token_strs", "return_token_strs", &out->token_strs)) < 0)
            goto done;
    }
    /* types of known fields */
    common_fields f;
    chat_fields c;
    memset(&c, 0, sizeof c);
    const char *model = NULL;
    if ((rc = f_str(o, "model", &model)) < 0) goto done;
    if (kind == PD_API_COMPLETIONS) {
        if ((rc = check_prompt_type(json_object_get(o, "prompt"))) < 0) goto done;
        const json_t *suffix = json_object_get(o, "suffix");
        if (suffix && !json_is_null(suffix) && !json_is_string(suffix)) {
            rc = type_err("suffix", "a string");
            goto done;
        }
    } else {
        if ((rc = pd_chat_check_message_types(json_object_get(o, "messages"), "messages")) < 0)
            goto done;
        if ((rc = read_chat(o, &c)) < 0) goto done;
    }
    if ((rc = read_common(o, kind, a, &f)) < 0) goto done;
    /* model */
    if (model && *model) {
        if (!served(lim, model)) {
            *http_status = 404;
            rc = pd_error(PD_ENOTFOUND, "The model `%s` does not exist.", model);
            goto done;
        }
    }
    /* §8.1 */
    if ((rc = check_shared(lim, kind, &f, a, out)) < 0) goto done;
    out->include_usage = f.stream_options && out->stream ? f.include_usage : false;
    out->continuous_usage = f.stream_options && f.include_usage && f.continuous_usage;
    out->echo = f.echo;
    out->truncate = f.has_truncate ? f.truncate : -1;
    out->tokens_as_ids = f.tokens_as_ids;
    if (kind == PD_API_COMPLETIONS) {
        out->add_special_tokens = f.has_add_special ? f.add_special : true;
        out->max_tokens = f.has_max_tokens ? f.max_tokens : f.max_tokens_null ? -1 : 16;
        rc = parse_completions(lim, o, a, &f, out);
    } else {
        out->add_special_tokens = f.has_add_special ? f.add_special : false;
        out->max_tokens = f.has_max_tokens ? f.max_tokens : -1;
        rc = parse_chat(lim, o, a, &f, &c, &messages, out);
    }
    if (rc < 0) goto done;
    /* §8.5, then min_tokens (a prompt to tokenize only is not held to the context) */
    for (size_t i = 0; i < out->n_prompts && !tokenize; i++)
        if ((rc = check_context(lim, out, &out->prompts[i])) < 0) goto done;
    out->sp.max_tokens = -1; /* per prompt: pd_api_prompt.max_tokens */
    if (pd_log_get_level() <= PD_LOG_DEBUG) {
        const char *k;
        json_t *v;
        json_object_foreach(o, k, v) PD_DEBUG(NULL, "request key '%s'", k);
    }
done:
    /* what the engine's search does not apply: the logits processors (docs/beam_search.md) */
    if (rc >= 0 && out->sp.use_beam_search && out->kind != PD_API_TOKENIZE) {
        const char *field = pd_sampling_beam_unsupported(&out->sp);
        if (field) rc = bad("use_beam_search: %s is not supported with beam search", field);
    }
    if (rc < 0 && rc != PD_ENOMEM && *http_status == 400) rc = PD_EINVAL;
    json_decref(messages);
    json_decref(o);
    return rc;
}

int pd_api_detokenize(const pd_api_limits *lim, const char *body, size_t len, pd_arena *a,
                      const char **text, int *http_status)
{
    *http_status = 400;
    *text = NULL;
    json_error_t jerr;
    json_t *o = pdj_loadb(body, len, JSON_DECODE_ANY, &jerr);
    if (!o)
        return bad("Invalid JSON in request body: %s (line %d, column %d)", jerr.text, jerr.line,
                   jerr.column);
    int rc = json_is_object(o) ? 0 : bad("Request body must be a JSON object.");
    const char *model = NULL;
    int32_t *ids = NULL, n = 0;
    bool present = false;
    if (rc == 0) rc = f_str(o, "model", &model);
    if (rc >= 0) rc = f_int_array(o, "tokens", a, &ids, &n, &present);
    if (rc >= 0 && !present) rc = bad("The field `tokens` is required.");
    if (rc >= 0 && model && *model && !served(lim, model)) {
        *http_status = 404;
        rc = pd_error(PD_ENOTFOUND, "The model `%s` does not exist.", model);
    }
    for (int32_t i = 0; rc >= 0 && i < n; i++)
        if (ids[i] < 0 || ids[i] >= lim->vocab)
            rc = bad("Token id %lld is out of vocabulary", (long long)ids[i]);
    char *t = NULL;
    if (rc >= 0) rc = pd_tok_decode(lim->tok, ids, (size_t)n, false, &t, NULL);
    if (rc >= 0) {
        *text = pd_arena_strdup(a, t);
        rc = *text ? PD_OK : pd_error(PD_ENOMEM, "out of memory");
    }
    free(t);
    json_decref(o);
    return rc < 0 ? rc : PD_OK;
}
