/* Sampler implementation: parameter defaults and validation, the per-sequence penalty state,
 * and pd_sample's pipeline (order and design in sampler.h).
 *
 * Every filter reduces to a cut in the total order "logit descending, id ascending", and
 * the weights w (vocab,) are zeroed outside it, so the kept set never depends on how it was
 * found: min_p and top_k are logit thresholds (top_k's is the k-th largest value, from a
 * min-heap that SSE2 lets skip 4 logits per compare), top_p ends at one (logit, id) pair
 * found from the 256 largest logits or, for flat distributions, a weight histogram. The
 * draw then walks w in ascending id order. The hot passes (max, weights, block sums) use
 * SSE2 / AVX2 with the same IEEE operations as the scalar code, so every CPU gives the
 * same bits, and the per-token path allocates nothing.
 */
#include "engine/sampler.h"

#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/rng.h"
#include "grammar/grammar.h"
#include "util/fmt.h"
#include "util/status.h"

/* ---- parameters -------------------------------------------------------------------------- */

pd_sampling_params pd_sampling_default_params(void)
{
    pd_sampling_params p;
    memset(&p, 0, sizeof p);
    p.n = 1;
    p.temperature = 1.0;
    p.top_p = 1.0;
    p.top_k = 0;
    p.min_p = 0.0;
    p.presence_penalty = 0.0;
    p.frequency_penalty = 0.0;
    p.repetition_penalty = 1.0;
    p.has_seed = false;
    p.seed = 0;
    p.min_tokens = 0;
    p.ignore_eos = false;
    p.logprobs = -1;
    p.prompt_logprobs = -1;
    p.include_stop_str_in_output = false;
    p.max_tokens = -1;
    p.skip_special_tokens = true;
    p.length_penalty = 1.0;
    return p;
}

pd_sampling_params pd_sampling_model_params(const pd_generation_config *g)
{
    pd_sampling_params p = pd_sampling_default_params();
    if (!g) return p;
    /* §7.1: a value equal to the Hugging Face default is not an override. */
    if (g->has_temperature && g->temperature != 1.0) p.temperature = g->temperature;
    if (g->has_top_p && g->top_p != 1.0) p.top_p = g->top_p;
    if (g->has_top_k && g->top_k != 50)
        p.top_k = g->top_k > INT32_MAX ? INT32_MAX : (g->top_k < -1 ? -1 : (int32_t)g->top_k);
    if (g->has_min_p) p.min_p = g->min_p;
    if (g->has_repetition_penalty && g->repetition_penalty != 1.0)
        p.repetition_penalty = g->repetition_penalty;
    return p;
}

bool pd_sampling_is_greedy(const pd_sampling_params *p)
{
    return p->temperature < PD_SAMPLING_GREEDY_EPS;
}

/* x as Python's repr(float) prints it, so messages read exactly like vLLM's. */
static const char *py_float(double x, char *buf, size_t n)
{
    pd_fmt_double(x, buf, n);
    return buf;
}

/* Appends the integer the key k writes to out (sign, except for 0; digits without leading
 * zeros), also past int64. */
static size_t key_as_int(const char *k, char *out, size_t n)
{
    const char *d = k + (*k == '-' || *k == '+');
    while (d[0] == '0' && d[1]) d++;
    bool neg = *k == '-' && *d != '0';
    int w = snprintf(out, n, "%s%.40s", neg ? "-" : "", d);
    return w < 0 ? 0 : (size_t)w < n ? (size_t)w : n - 1;
}

/* The logit_bias rules: keys are integers, then every out-of-vocabulary id is named ("[128300,
 * 999999]", as Python prints a list), then no bias is NaN. */
static int check_logit_bias(const pd_sampling_fields *f, int32_t vocab)
{
    for (int32_t i = 0; f->logit_bias_keys && i < f->n_logit_bias; i++) {
        const char *k = f->logit_bias_keys[i], *d = k + (*k == '-' || *k == '+');
        bool digits = *d != '\0';
        for (const char *c = d; *c; c++) digits = digits && *c >= '0' && *c <= '9';
        if (!digits)
            return pd_error(PD_EINVAL, "Invalid key `%s` in logit_bias: keys must be token ids.",
                            k);
    }
    char ids[512];
    size_t o = 0;
    int32_t n_bad = 0;
    bool cut = false; /* the list no longer fits: ", ..." ends it */
    ids[o++] = '[';
    for (int32_t i = 0; i < f->n_logit_bias && !cut; i++) {
        int32_t id = f->logit_bias[i].id;
        if (id >= 0 && id < vocab) continue;
        if (n_bad++) o += (size_t)snprintf(ids + o, sizeof ids - o, ", ");
        if ((cut = o >= sizeof ids - 64)) {
            o += (size_t)snprintf(ids + o, sizeof ids - o, "...");
            continue;
        }
        if (f->logit_bias_keys)
            o += key_as_int(f->logit_bias_keys[i], ids + o, sizeof ids - o);
        else
            o += (size_t)snprintf(ids + o, sizeof ids - o, "%" PRId32, id);
    }
    if (n_bad > 0) {
        snprintf(ids + o, sizeof ids - o, "]");
        return pd_error(PD_EINVAL,
                        "token_id(s) %s in logit_bias contain out-of-vocab token ids. "
                        "Vocabulary size: %" PRId32,
                        ids, vocab);
    }
    for (int32_t i = 0; i < f->n_logit_bias; i++)
        if (isnan(f->logit_bias[i].bias))
            return pd_error(PD_EINVAL, "logit_bias: the bias of token %" PRId32 " is NaN",
                            f->logit_bias[i].id);
    return PD_OK;
}

int pd_sampling_check(const pd_sampling_fields *f, int32_t vocab)
{
    char b[64];
    int64_t n = f->has_n ? f->n : 1;
    if (n < 1) return pd_error(PD_EINVAL, "n must be at least 1, got %" PRId64 ".", n);
    if (f->max_n > 0 && n > f->max_n)
        return pd_error(PD_EINVAL, "n must be at most %" PRId64 ", got %" PRId64 ".", f->max_n, n);
    if (f->has_best_of) {
        if (f->best_of < n)
            return pd_error(PD_EINVAL,
                            "best_of must be greater than or equal to n, got n=%" PRId64
                            " and best_of=%" PRId64 ".",
                            n, f->best_of);
        if (f->max_n > 0 && f->best_of > f->max_n) /* each is a sequence, as a choice is */
            return pd_error(PD_EINVAL, "best_of must be at most %" PRId64 ", got %" PRId64 ".",
                            f->max_n, f->best_of);
    }
    if (f->has_presence_penalty && !(f->presence_penalty >= -2.0 && f->presence_penalty <= 2.0))
        return pd_error(PD_EINVAL, "presence_penalty must be in [-2, 2], got %s.",
                        py_float(f->presence_penalty, b, sizeof b));
    if (f->has_frequency_penalty && !(f->frequency_penalty >= -2.0 && f->frequency_penalty <= 2.0))
        return pd_error(PD_EINVAL, "frequency_penalty must be in [-2, 2], got %s.",
                        py_float(f->frequency_penalty, b, sizeof b));
    if (f->has_repetition_penalty &&
        (!(f->repetition_penalty > 0.0) || isinf(f->repetition_penalty)))
        return pd_error(PD_EINVAL, "repetition_penalty must be greater than zero, got %s.",
                        py_float(f->repetition_penalty, b, sizeof b));
    if (f->has_temperature && (!(f->temperature >= 0.0) || isinf(f->temperature)))
        return pd_error(PD_EINVAL, "temperature must be non-negative, got %s.",
                        py_float(f->temperature, b, sizeof b));
    if (f->has_top_p && !(f->top_p > 0.0 && f->top_p <= 1.0))
        return pd_error(PD_EINVAL, "top_p must be in (0, 1], got %s.",
                        py_float(f->top_p, b, sizeof b));
    if (f->has_top_k && f->top_k < -1)
        return pd_error(PD_EINVAL, "top_k must be 0 (disable), or at least 1, got %" PRId64 ".",
                        f->top_k);
    if (f->has_min_p && !(f->min_p >= 0.0 && f->min_p <= 1.0))
        return pd_error(PD_EINVAL, "min_p must be in [0, 1], got %s.",
                        py_float(f->min_p, b, sizeof b));
    if (f->has_max_tokens && f->max_tokens < 1 && !(f->max_tokens == 0 && f->max_tokens_zero_ok))
        return pd_error(PD_EINVAL, "max_tokens must be at least 1, got %" PRId64 ".",
                        f->max_tokens);
    if (f->has_min_tokens && f->min_tokens < 0)
        return pd_error(PD_EINVAL,
                        "min_tokens must be greater than or equal to 0, got %" PRId64 ".",
                        f->min_tokens);
    if (f->has_logprobs && f->logprobs < -1)
        return pd_error(PD_EINVAL, "`logprobs` must be a positive value.");
    for (int32_t i = 0; i < f->n_stop; i++)
        if (!f->stop[i] || f->stop[i][0] == '\0')
            return pd_error(PD_EINVAL, "stop cannot contain an empty string.");
    for (int32_t i = 0; i < f->n_stop_token_ids; i++) {
        int64_t id =
            f->stop_token_ids_written ? f->stop_token_ids_written[i] : f->stop_token_ids[i];
        if (id < 0 || id >= vocab)
            return pd_error(PD_EINVAL,
                            "Token id %" PRId64 " in stop_token_ids is out of vocabulary.", id);
    }
    PD_CHECK(check_logit_bias(f, vocab));
    if (f->has_allowed_token_ids) {
        if (f->n_allowed_token_ids <= 0 || !f->allowed_token_ids)
            return pd_error(PD_EINVAL, "allowed_token_ids is not allowed to be empty.");
        for (int32_t i = 0; i < f->n_allowed_token_ids; i++)
            if (f->allowed_token_ids[i] < 0 || f->allowed_token_ids[i] >= vocab)
                return pd_error(PD_EINVAL, "allowed_token_ids contains out-of-vocab token id!");
    }
    if (f->use_beam_search) {
        int64_t best_of = f->has_best_of ? f->best_of : n;
        if (best_of == 1)
            return pd_error(
                PD_EINVAL,
                "best_of must be greater than 1 when using beam search. Got %" PRId64 ".", best_of);
        if (f->has_temperature && f->temperature > PD_SAMPLING_GREEDY_EPS)
            return pd_error(PD_EINVAL, "temperature must be 0 when using beam search.");
        if (f->has_top_p && f->top_p < 1.0 - PD_SAMPLING_GREEDY_EPS)
            return pd_error(PD_EINVAL, "top_p must be 1 when using beam search.");
        if (f->has_top_k && f->top_k != -1 && f->top_k != 0)
            return pd_error(PD_EINVAL, "top_k must be -1 when using beam search.");
        if (f->early_stopping < PD_EARLY_STOPPING_FALSE ||
            f->early_stopping > PD_EARLY_STOPPING_NEVER)
            return pd_error(PD_EINVAL, "early_stopping must be True, False, or 'never', got %d.",
                            (int)f->early_stopping);
        if (f->has_length_penalty && !isfinite(f->length_penalty))
            return pd_error(PD_EINVAL, "length_penalty must be a finite number.");
    } else {
        if (f->early_stopping)
            return pd_error(PD_EINVAL, "early_stopping is not effective and must be False when "
                                       "not using beam search.");
        if (f->has_length_penalty &&
            !(f->length_penalty >= 1.0 - 1e-5 && f->length_penalty <= 1.0 + 1e-5))
            return pd_error(PD_EINVAL, "length_penalty is not effective and must be the default "
                                       "value of 1.0 when not using beam search.");
    }
    return PD_OK;
}

const char *pd_sampling_beam_unsupported(const pd_sampling_params *p)
{
    if (p->min_tokens > 0) return "min_tokens";
    if (p->presence_penalty != 0.0) return "presence_penalty";
    if (p->frequency_penalty != 0.0) return "frequency_penalty";
    if (p->repetition_penalty != 1.0) return "repetition_penalty";
    if (p->min_p > 0.0) return "min_p";
    if (p->n_logit_bias > 0) return "logit_bias";
    if (p->has_allowed_token_ids) return "allowed_token_ids";
    if (p->guided_kind) return "guided decoding";
    return NULL;
}

int pd_sampling_params_validate(const pd_sampling_params *p, int32_t vocab)
{
    if (p->n_stop < 0 || (p->n_stop > 0 && !p->stop))
        return pd_error(PD_EINVAL, "stop: %" PRId32 " strings but no array", p->n_stop);
    if (p->n_stop_token_ids < 0 || (p->n_stop_token_ids > 0 && !p->stop_token_ids))
        return pd_error(PD_EINVAL, "stop_token_ids: %" PRId32 " ids but no array",
                        p->n_stop_token_ids);
    if (p->n_logit_bias < 0 || (p->n_logit_bias > 0 && !p->logit_bias))
        return pd_error(PD_EINVAL, "logit_bias: %" PRId32 " entries but no array", p->n_logit_bias);
    if (p->guided_kind < 0 || p->guided_kind > PD_GSPEC_GRAMMAR ||
        (p->guided_len > 0 && !p->guided))
        return pd_error(PD_EINVAL, "guided: kind %" PRId32 " with %zu bytes of text",
                        p->guided_kind, p->guided_len);
    pd_sampling_fields f = {.has_n = true,
                            .has_presence_penalty = true,
                            .has_frequency_penalty = true,
                            .has_repetition_penalty = true,
                            .has_temperature = true,
                            .has_top_p = true,
                            .has_top_k = true,
                            .has_min_p = true,
                            .has_max_tokens = p->max_tokens != -1,
                            .has_min_tokens = true,
                            .has_logprobs = true,
                            .n = p->n,
                            .top_k = p->top_k,
                            .max_tokens = p->max_tokens,
                            .min_tokens = p->min_tokens,
                            .logprobs = p->logprobs,
                            .presence_penalty = p->presence_penalty,
                            .frequency_penalty = p->frequency_penalty,
                            .repetition_penalty = p->repetition_penalty,
                            .temperature = p->temperature,
                            .top_p = p->top_p,
                            .min_p = p->min_p,
                            .stop = p->stop,
                            .n_stop = p->n_stop,
                            .stop_token_ids = p->stop_token_ids,
                            .n_stop_token_ids = p->n_stop_token_ids,
                            .logit_bias = p->logit_bias,
                            .n_logit_bias = p->n_logit_bias,
                            .has_allowed_token_ids = p->has_allowed_token_ids,
                            .allowed_token_ids = p->allowed_token_ids,
                            .n_allowed_token_ids = p->n_allowed_token_ids,
                            .has_best_of = p->use_beam_search,
                            .best_of = p->best_of > 0 ? p->best_of : p->n,
                            .use_beam_search = p->use_beam_search,
                            .early_stopping = p->early_stopping,
                            .has_length_penalty = true,
                            .length_penalty = p->length_penalty};
    return pd_sampling_check(&f, vocab);
}

int pd_sampling_params_clone(const pd_sampling_params *src, pd_arena *a, pd_sampling_params *out)
{
    pd_sampling_params p = *src;
    if (src->n_logit_bias > 0) {
        pd_logit_bias *b = pd_arena_calloc(a, (size_t)src->n_logit_bias, sizeof *b);
        if (!b) return pd_error(PD_ENOMEM, "sampling params: out of memory (logit_bias)");
        memcpy(b, src->logit_bias, (size_t)src->n_logit_bias * sizeof *b);
        p.logit_bias = b;
    } else {
        p.logit_bias = NULL;
    }
    if (src->n_allowed_token_ids > 0) {
        int32_t *v = pd_arena_calloc(a, (size_t)src->n_allowed_token_ids, sizeof *v);
        if (!v) return pd_error(PD_ENOMEM, "sampling params: out of memory (allowed_token_ids)");
        memcpy(v, src->allowed_token_ids, (size_t)src->n_allowed_token_ids * sizeof *v);
        p.allowed_token_ids = v;
    } else {
        p.allowed_token_ids = NULL;
    }
    if (src->n_stop_token_ids > 0) {
        int32_t *v = pd_arena_calloc(a, (size_t)src->n_stop_token_ids, sizeof *v);
        if (!v) return pd_error(PD_ENOMEM, "sampling params: out of memory (stop_token_ids)");
        memcpy(v, src->stop_token_ids, (size_t)src->n_stop_token_ids * sizeof *v);
        p.stop_token_ids = v;
    } else {
        p.stop_token_ids = NULL;
    }
    if (src->n_stop > 0) {
        const char **v = pd_arena_calloc(a, (size_t)src->n_stop, sizeof *v);
        if (!v) return pd_error(PD_ENOMEM, "sampling params: out of memory (stop)");
        for (int32_t i = 0; i < src->n_stop; i++) {
            v[i] = pd_arena_strdup(a, src->stop[i] ? src->stop[i] : "");
            if (!v[i]) return pd_error(PD_ENOMEM, "sampling params: out of memory (stop)");
        }
        p.stop = v;
    } else {
        p.stop = NULL;
    }
    if (src->guided_kind) {
        char *g = pd_arena_alloc(a, src->guided_len + 1, 1);
        if (!g) return pd_error(PD_ENOMEM, "sampling params: out of memory (guided)");
        if (src->guided_len) memcpy(g, src->guided, src->guided_len);
        g[src->guided_len] = '\0';
        p.guided = g;
        p.guided_ws = src->guided_ws ? pd_arena_strdup(a, src->guided_ws) : NULL;
        if (src->guided_ws && !p.guided_ws)
            return pd_error(PD_ENOMEM, "sampling params: out of memory (guided)");
    } else {
        p.guided = p.guided_ws = NULL;
        p.guided_len = 0;
    }
    *out = p;
    return PD_OK;
}

/* ---- per-sequence state ------------------------------------------------------------------ */

#define SEQ_IN_PROMPT  0x80000000u /* counts[] bit: id occurs in the prompt */
#define SEQ_COUNT_MASK 0x7fffffffu /* counts[] bits: occurrences in the output */

struct pd_sampler_seq {
    int32_t vocab;
    uint32_t seq_index;
    uint64_t seed;
    int64_t n_output; /* tokens appended = step of the next draw */

    bool greedy;
    float temperature;
    float top_p;
    int32_t top_k; /* <= 0: off */
    float min_p;
    int32_t min_tokens;
    int32_t logprobs; /* -1: none */

    pd_logit_bias *bias; /* (n_bias,) sorted by id, one per id (last given wins), clamped */
    int32_t n_bias;
    int32_t *allowed; /* (n_allowed,) distinct ids, when has_allowed */
    int32_t n_allowed;
    bool has_allowed;
    int32_t *stop_ids; /* (n_stop_ids,) distinct EOS + stop_token_ids, for min_tokens */
    int32_t n_stop_ids;

    /* Penalties: only when one is active. counts: (vocab,) packed SEQ_IN_PROMPT | output count.
     * touched: (n_touched,) the distinct ids with a non-zero counts[] entry, so applying the
     * penalties costs O(distinct ids), not O(vocab). Grows geometrically on new ids. */
    bool penalize;
    float presence, frequency, repetition;
    uint32_t *counts;
    int32_t *touched;
    int32_t n_touched, cap_touched;
};

static int cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Sorts v and drops duplicates; returns the new length. */
static int32_t sort_unique(int32_t *v, int32_t n)
{
    if (n <= 1) return n;
    qsort(v, (size_t)n, sizeof *v, cmp_i32);
    int32_t m = 1;
    for (int32_t i = 1; i < n; i++)
        if (v[i] != v[m - 1]) v[m++] = v[i];
    return m;
}

typedef struct {
    pd_logit_bias b;
    int32_t order;
} bias_entry;

static int cmp_bias(const void *a, const void *b)
{
    const bias_entry *x = a, *y = b;
    if (x->b.id != y->b.id) return (x->b.id > y->b.id) - (x->b.id < y->b.id);
    return (x->order > y->order) - (x->order < y->order);
}

static int seq_touch(pd_sampler_seq *s, int32_t id)
{
    if (s->n_touched == s->cap_touched) {
        int32_t cap = s->cap_touched ? s->cap_touched * 2 : 256;
        if (cap > s->vocab) cap = s->vocab;
        int32_t *t = realloc(s->touched, (size_t)cap * sizeof *t);
        if (!t) return pd_error(PD_ENOMEM, "sampler: out of memory (penalty ids)");
        s->touched = t;
        s->cap_touched = cap;
    }
    s->touched[s->n_touched++] = id;
    return PD_OK;
}

int pd_sampler_seq_create(const pd_sampling_params *p, int32_t vocab, const int32_t *eos_ids,
                          size_t n_eos, uint32_t seq_index, const int32_t *prompt, size_t n_prompt,
                          pd_sampler_seq **out)
{
    *out = NULL;
    if (vocab <= 0)
        return pd_error(PD_EINVAL, "sampler: vocabulary size must be positive, got %" PRId32,
                        vocab);
    PD_CHECK(pd_sampling_params_validate(p, vocab));
    for (size_t i = 0; i < n_eos; i++)
        if (eos_ids[i] < 0 || eos_ids[i] >= vocab)
            return pd_error(PD_EINVAL,
                            "sampler: EOS id %" PRId32 " is out of vocabulary (%" PRId32 " tokens)",
                            eos_ids[i], vocab);
    for (size_t i = 0; i < n_prompt; i++)
        if (prompt[i] < 0 || prompt[i] >= vocab)
            return pd_error(PD_EINVAL,
                            "sampler: prompt token %zu (id %" PRId32
                            ") is out of vocabulary (%" PRId32 " tokens)",
                            i, prompt[i], vocab);

    pd_sampler_seq *s = calloc(1, sizeof *s);
    if (!s) return pd_error(PD_ENOMEM, "sampler: out of memory");
    int rc = PD_OK;
    s->vocab = vocab;
    s->seq_index = seq_index;
    s->seed = (uint64_t)p->seed;
    s->greedy = pd_sampling_is_greedy(p);
    s->temperature = (float)p->temperature;
    s->top_p = (float)p->top_p;
    s->top_k = p->top_k > 0 && p->top_k < vocab ? p->top_k : 0;
    s->min_p = (float)p->min_p;
    s->min_tokens = p->min_tokens;
    s->logprobs = p->logprobs;

    if (p->n_logit_bias > 0) {
        bias_entry *e = calloc((size_t)p->n_logit_bias, sizeof *e);
        s->bias = calloc((size_t)p->n_logit_bias, sizeof *s->bias);
        if (!e || !s->bias) {
            free(e);
            rc = pd_error(PD_ENOMEM, "sampler: out of memory (logit_bias)");
            goto fail;
        }
        for (int32_t i = 0; i < p->n_logit_bias; i++) {
            e[i].b = p->logit_bias[i];
            e[i].order = i;
        }
        qsort(e, (size_t)p->n_logit_bias, sizeof *e, cmp_bias);
        for (int32_t i = 0; i < p->n_logit_bias; i++) {
            if (i + 1 < p->n_logit_bias && e[i + 1].b.id == e[i].b.id)
                continue; /* a later entry for the same id wins, as in a Python dict */
            float b = e[i].b.bias;
            b = b > (float)PD_LOGIT_BIAS_MAX ? (float)PD_LOGIT_BIAS_MAX : b;
            b = b < (float)-PD_LOGIT_BIAS_MAX ? (float)-PD_LOGIT_BIAS_MAX : b;
            s->bias[s->n_bias].id = e[i].b.id;
            s->bias[s->n_bias].bias = b;
            s->n_bias++;
        }
        free(e);
    }
    if (p->has_allowed_token_ids) {
        s->has_allowed = true;
        s->allowed = malloc((size_t)p->n_allowed_token_ids * sizeof *s->allowed);
        if (!s->allowed) {
            rc = pd_error(PD_ENOMEM, "sampler: out of memory (allowed_token_ids)");
            goto fail;
        }
        memcpy(s->allowed, p->allowed_token_ids,
               (size_t)p->n_allowed_token_ids * sizeof *s->allowed);
        s->n_allowed = sort_unique(s->allowed, p->n_allowed_token_ids);
    }
    {
        size_t n = n_eos + (size_t)p->n_stop_token_ids;
        if (n > 0) {
            s->stop_ids = malloc(n * sizeof *s->stop_ids);
            if (!s->stop_ids) {
                rc = pd_error(PD_ENOMEM, "sampler: out of memory (stop ids)");
                goto fail;
            }
            if (n_eos) memcpy(s->stop_ids, eos_ids, n_eos * sizeof *s->stop_ids);
            if (p->n_stop_token_ids)
                memcpy(s->stop_ids + n_eos, p->stop_token_ids,
                       (size_t)p->n_stop_token_ids * sizeof *s->stop_ids);
            s->n_stop_ids = sort_unique(s->stop_ids, (int32_t)n);
        }
    }

    s->presence = (float)p->presence_penalty;
    s->frequency = (float)p->frequency_penalty;
    s->repetition = (float)p->repetition_penalty;
    s->penalize = s->presence != 0.0f || s->frequency != 0.0f || s->repetition != 1.0f;
    if (s->penalize) {
        s->counts = calloc((size_t)vocab, sizeof *s->counts);
        if (!s->counts) {
            rc = pd_error(PD_ENOMEM, "sampler: out of memory (penalty counts, %" PRId32 " ids)",
                          vocab);
            goto fail;
        }
        for (size_t i = 0; i < n_prompt; i++) {
            int32_t id = prompt[i];
            if (s->counts[id] == 0) PD_CHECK_GOTO(seq_touch(s, id), rc, fail);
            s->counts[id] |= SEQ_IN_PROMPT;
        }
    }
    *out = s;
    return PD_OK;
fail:
    pd_sampler_seq_free(s);
    return rc;
}

void pd_sampler_seq_free(pd_sampler_seq *s)
{
    if (!s) return;
    free(s->bias);
    free(s->allowed);
    free(s->stop_ids);
    free(s->counts);
    free(s->touched);
    free(s);
}

int pd_sampler_seq_append(pd_sampler_seq *s, int32_t token)
{
    if (token < 0 || token >= s->vocab)
        return pd_error(PD_EINVAL,
                        "sampler: token id %" PRId32 " is out of vocabulary (%" PRId32 " tokens)",
                        token, s->vocab);
    if (s->penalize) {
        uint32_t c = s->counts[token];
        if (c == 0) PD_CHECK(seq_touch(s, token));
        if ((c & SEQ_COUNT_MASK) != SEQ_COUNT_MASK) s->counts[token] = c + 1;
    }
    s->n_output++;
    return PD_OK;
}

int64_t pd_sampler_seq_num_output(const pd_sampler_seq *s)
{
    return s->n_output;
}

uint64_t pd_sampler_seq_seed(const pd_sampler_seq *s)
{
    return s->seed;
}

/* ---- vector kernels ------------------------------------------------------------------------ */

/* The SSE2 paths (baseline on every x86-64) and the scalar fallbacks perform the same IEEE
 * operations in the same order, so results are bit-identical either way. The scalar form
 * below is the definition. */
#if defined(__SSE2__)
#include <emmintrin.h>
#define PD_SAMPLER_SSE2 1
#endif

#define EXP_LO    (-87.0f)
#define EXP_HI    88.0f /* keeps 2^n a normal float (the sampler only passes x <= 0) */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_C1    0.693359375f      /* ln 2, high part */
#define EXP_C2    (-2.12194440e-4f) /* ln 2 - EXP_C1 */

float pd_sampler_exp(float x)
{
    /* Cephes-style expf: 2^n * p(r), r = x - n ln2 (|r| <= ~ln2/2), degree-6 polynomial. */
    float xc = x > EXP_LO ? x : EXP_LO;
    xc = xc < EXP_HI ? xc : EXP_HI;
    int32_t n = (int32_t)(xc * EXP_LOG2E - 0.5f);
    float fn = (float)n;
    float r = xc - fn * EXP_C1;
    r = r - fn * EXP_C2;
    float p = 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = (n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    float y = p * scale;
    return x < EXP_LO ? 0.0f : y;
}

#ifdef PD_SAMPLER_SSE2
static inline __m128 exp4(__m128 x)
{
    const __m128 lo = _mm_set1_ps(EXP_LO);
    __m128 xc = _mm_max_ps(x, lo); /* x > lo ? x : lo, NaN -> lo, as the scalar form */
    xc = _mm_min_ps(xc, _mm_set1_ps(EXP_HI));
    __m128i n =
        _mm_cvttps_epi32(_mm_sub_ps(_mm_mul_ps(xc, _mm_set1_ps(EXP_LOG2E)), _mm_set1_ps(0.5f)));
    __m128 fn = _mm_cvtepi32_ps(n);
    __m128 r = _mm_sub_ps(xc, _mm_mul_ps(fn, _mm_set1_ps(EXP_C1)));
    r = _mm_sub_ps(r, _mm_mul_ps(fn, _mm_set1_ps(EXP_C2)));
    __m128 p = _mm_set1_ps(1.9875691500E-4f);
    p = _mm_add_ps(_mm_mul_ps(p, r), _mm_set1_ps(1.3981999507E-3f));
    p = _mm_add_ps(_mm_mul_ps(p, r), _mm_set1_ps(8.3334519073E-3f));
    p = _mm_add_ps(_mm_mul_ps(p, r), _mm_set1_ps(4.1665795894E-2f));
    p = _mm_add_ps(_mm_mul_ps(p, r), _mm_set1_ps(1.6666665459E-1f));
    p = _mm_add_ps(_mm_mul_ps(p, r), _mm_set1_ps(5.0000001201E-1f));
    p = _mm_add_ps(_mm_add_ps(_mm_mul_ps(_mm_mul_ps(p, r), r), r), _mm_set1_ps(1.0f));
    __m128 scale = _mm_castsi128_ps(_mm_slli_epi32(_mm_add_epi32(n, _mm_set1_epi32(127)), 23));
    __m128 y = _mm_mul_ps(p, scale);
    return _mm_andnot_ps(_mm_cmplt_ps(x, lo), y);
}
#endif

/* Largest element of x[0, n), NaN ignored; -inf when none. */
static float vec_max(const float *x, int32_t n)
{
    int32_t i = 0;
    float m = -INFINITY;
#ifdef PD_SAMPLER_SSE2
    __m128 a = _mm_set1_ps(-INFINITY), b = a;
    for (; i + 8 <= n; i += 8) {
        a = _mm_max_ps(_mm_loadu_ps(x + i), a); /* NaN in x -> keeps a */
        b = _mm_max_ps(_mm_loadu_ps(x + i + 4), b);
    }
    float t[4];
    _mm_storeu_ps(t, _mm_max_ps(a, b));
    for (int j = 0; j < 4; j++) m = t[j] > m ? t[j] : m;
#endif
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

#if defined(PD_SAMPLER_SSE2) && defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PD_SAMPLER_AVX2 1

/* exp4 on eight lanes: the same operations, so the same bits. */
__attribute__((target("avx2"))) static inline __m256 exp8(__m256 x)
{
    const __m256 lo = _mm256_set1_ps(EXP_LO);
    __m256 xc = _mm256_max_ps(x, lo);
    xc = _mm256_min_ps(xc, _mm256_set1_ps(EXP_HI));
    __m256i n = _mm256_cvttps_epi32(
        _mm256_sub_ps(_mm256_mul_ps(xc, _mm256_set1_ps(EXP_LOG2E)), _mm256_set1_ps(0.5f)));
    __m256 fn = _mm256_cvtepi32_ps(n);
    __m256 r = _mm256_sub_ps(xc, _mm256_mul_ps(fn, _mm256_set1_ps(EXP_C1)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(fn, _mm256_set1_ps(EXP_C2)));
    __m256 p = _mm256_set1_ps(1.9875691500E-4f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507E-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073E-3f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894E-2f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459E-1f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201E-1f));
    p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r),
                      _mm256_set1_ps(1.0f));
    __m256 scale =
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
    __m256 y = _mm256_mul_ps(p, scale);
    return _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), y);
}

/* vec_weights' body for the first n8 (a multiple of 8) elements. */
__attribute__((target("avx2"))) static void weights_avx2(const float *l, float *w, int32_t n8,
                                                         float mx, float cut, float inv_t)
{
    const __m256 vmx = _mm256_set1_ps(mx), vcut = _mm256_set1_ps(cut);
    const __m256 vit = _mm256_set1_ps(inv_t);
    for (int32_t i = 0; i < n8; i += 8) {
        __m256 x = _mm256_loadu_ps(l + i);
        __m256 keep = _mm256_cmp_ps(x, vcut, _CMP_GE_OQ);
        if (!_mm256_movemask_ps(keep)) {
            _mm256_storeu_ps(w + i, _mm256_setzero_ps());
            continue;
        }
        __m256 e = exp8(_mm256_mul_ps(_mm256_sub_ps(x, vmx), vit));
        _mm256_storeu_ps(w + i, _mm256_and_ps(keep, e));
    }
}
#endif

/* w[i] = l[i] >= cut ? pd_sampler_exp((l[i] - mx) * inv_t) : 0 (NaN -> 0), with the widest
 * of AVX2 / SSE2 / scalar up to isa: identical bits on every path. Blocks entirely below
 * the cut (top_k, min_p, masked ids) skip the exponential. */
static void weights_isa(const float *l, float *w, int32_t n, float mx, float cut, float inv_t,
                        int isa)
{
    int32_t i = 0;
#ifdef PD_SAMPLER_AVX2
    if (isa >= PD_SAMPLER_ISA_AVX2) {
        i = n & ~7;
        weights_avx2(l, w, i, mx, cut, inv_t);
    }
#endif
#ifdef PD_SAMPLER_SSE2
    if (isa >= PD_SAMPLER_ISA_SSE2) {
        const __m128 vmx = _mm_set1_ps(mx), vcut = _mm_set1_ps(cut), vit = _mm_set1_ps(inv_t);
        for (; i + 4 <= n; i += 4) {
            __m128 x = _mm_loadu_ps(l + i);
            __m128 keep = _mm_cmpge_ps(x, vcut);
            if (!_mm_movemask_ps(keep)) {
                _mm_storeu_ps(w + i, _mm_setzero_ps());
                continue;
            }
            __m128 e = exp4(_mm_mul_ps(_mm_sub_ps(x, vmx), vit));
            _mm_storeu_ps(w + i, _mm_and_ps(keep, e));
        }
    }
#endif
    for (; i < n; i++) {
        float e = pd_sampler_exp((l[i] - mx) * inv_t);
        w[i] = l[i] >= cut ? e : 0.0f;
    }
}

/* The widest instruction set this CPU runs. */
static int best_isa(void)
{
#ifdef PD_SAMPLER_AVX2
    if (__builtin_cpu_supports("avx2")) return PD_SAMPLER_ISA_AVX2;
#endif
#ifdef PD_SAMPLER_SSE2
    return PD_SAMPLER_ISA_SSE2;
#else
    return PD_SAMPLER_ISA_SCALAR;
#endif
}

static void vec_weights(const float *l, float *w, int32_t n, float mx, float cut, float inv_t)
{
    weights_isa(l, w, n, mx, cut, inv_t, best_isa());
}

int pd_sampler_weights(const float *l, float *w, int32_t n, float mx, float cut, float inv_t,
                       int isa)
{
    if (isa < PD_SAMPLER_ISA_SCALAR || isa > best_isa())
        return pd_error(PD_EUNSUPPORTED, "sampler: instruction set %d is not available here", isa);
    weights_isa(l, w, n, mx, cut, inv_t, isa);
    return PD_OK;
}

/* Sum of w[0, n) (n <= PD_SAMPLER_BLOCK) in four lanes, lane j taking elements i = j mod 4,
 * combined as (s0 + s1) + (s2 + s3). */
#define PD_SAMPLER_BLOCK 64
static float block_sum(const float *w, int32_t n)
{
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int32_t i = 0;
#ifdef PD_SAMPLER_SSE2
    __m128 acc = _mm_setzero_ps();
    for (; i + 4 <= n; i += 4) acc = _mm_add_ps(acc, _mm_loadu_ps(w + i));
    _mm_storeu_ps(s, acc);
#else
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; j++) s[j] += w[i + j];
#endif
    for (int j = 0; i < n; i++, j++) s[j] += w[i];
    return (s[0] + s[1]) + (s[2] + s[3]);
}

/* ---- workspace --------------------------------------------------------------------------- */

#define PD_SAMPLER_BUCKETS      2048  /* top_p histogram buckets ... */
#define PD_SAMPLER_BUCKET_SCALE 32.0f /* ... each 1/32 nat of (max - logit) / temperature wide */

typedef struct {
    float l;    /* processed logit */
    float w;    /* weight */
    int32_t id; /* token id */
} cand;

struct pd_sampler_ws {
    int32_t vocab;
    int32_t max_logprobs;
    float *logits;    /* (vocab,) f32: processed logits of the current row */
    float *w;         /* (vocab,) f32: unnormalized probabilities, 0 outside the kept set */
    float *scratch;   /* (vocab,) f32: saved allowed logits / top_k values / top-N logits */
    cand *cands;      /* (vocab,) the top_p boundary bucket */
    double *bsum;     /* (vocab / PD_SAMPLER_BLOCK + 1,) block sums of w */
    double *mass;     /* (2, PD_SAMPLER_BUCKETS) top_p histograms (even ids, odd ids) */
    int32_t *top_ids; /* (max_logprobs,) top-N result ids */
    float *top_lp;    /* (max_logprobs,) top-N result logprobs */
};

int pd_sampler_ws_create(int32_t vocab, int32_t max_logprobs, pd_sampler_ws **out)
{
    *out = NULL;
    if (vocab <= 0 || max_logprobs < 0)
        return pd_error(
            PD_EINVAL, "sampler workspace: bad sizes (vocab %" PRId32 ", max_logprobs %" PRId32 ")",
            vocab, max_logprobs);
    pd_sampler_ws *w = calloc(1, sizeof *w);
    if (!w) return pd_error(PD_ENOMEM, "sampler workspace: out of memory");
    w->vocab = vocab;
    w->max_logprobs = max_logprobs;
    size_t ntop = max_logprobs > 0 ? (size_t)max_logprobs : 1;
    w->logits = malloc((size_t)vocab * sizeof *w->logits);
    w->w = malloc((size_t)vocab * sizeof *w->w);
    w->scratch = malloc((size_t)vocab * sizeof *w->scratch);
    w->cands = malloc((size_t)vocab * sizeof *w->cands);
    w->bsum = malloc(((size_t)vocab / PD_SAMPLER_BLOCK + 1) * sizeof *w->bsum);
    w->mass = malloc(2 * PD_SAMPLER_BUCKETS * sizeof *w->mass);
    w->top_ids = malloc(ntop * sizeof *w->top_ids);
    w->top_lp = malloc(ntop * sizeof *w->top_lp);
    if (!w->logits || !w->w || !w->scratch || !w->cands || !w->bsum || !w->mass || !w->top_ids ||
        !w->top_lp) {
        pd_sampler_ws_free(w);
        return pd_error(PD_ENOMEM, "sampler workspace: out of memory (%" PRId32 " tokens)", vocab);
    }
    *out = w;
    return PD_OK;
}

void pd_sampler_ws_free(pd_sampler_ws *w)
{
    if (!w) return;
    free(w->logits);
    free(w->w);
    free(w->scratch);
    free(w->cands);
    free(w->bsum);
    free(w->mass);
    free(w->top_ids);
    free(w->top_lp);
    free(w);
}

/* ---- selection helpers ------------------------------------------------------------------- */

/* Min-heap of floats: h[0] is the smallest. */
static void heap_sift_down(float *h, int32_t k, int32_t i)
{
    for (;;) {
        int32_t c = 2 * i + 1;
        if (c >= k) return;
        if (c + 1 < k && h[c + 1] < h[c]) c++;
        if (!(h[c] < h[i])) return;
        float t = h[i];
        h[i] = h[c];
        h[c] = t;
        i = c;
    }
}

/* The k-th largest value among the finite l[i] >= cut (counting repeats), or -inf when
 * fewer than k qualify. A min-heap of the k largest seen: after it fills, an element only
 * costs a compare with the heap's minimum (SSE2 tests 4 at a time), so O(V) for the usual
 * order and O(V log k) at worst. h: (k,) scratch. */
static float kth_largest(const float *l, int32_t V, float cut, int32_t k, float *h)
{
    int32_t n = 0, i = 0;
    for (; i < V && n < k; i++)
        if (l[i] >= cut && l[i] > -INFINITY) {
            /* sift up */
            int32_t j = n++;
            h[j] = l[i];
            while (j > 0 && h[(j - 1) / 2] > h[j]) {
                float t = h[j];
                h[j] = h[(j - 1) / 2];
                h[(j - 1) / 2] = t;
                j = (j - 1) / 2;
            }
        }
    if (n < k) return -INFINITY;
        /* heap full: h[0] >= cut, so "x > h[0]" implies x >= cut and finite */
#ifdef PD_SAMPLER_SSE2
    for (; i + 4 <= V; i += 4) {
        if (!_mm_movemask_ps(_mm_cmpgt_ps(_mm_loadu_ps(l + i), _mm_set1_ps(h[0])))) continue;
        for (int32_t j = i; j < i + 4; j++)
            if (l[j] > h[0]) {
                h[0] = l[j];
                heap_sift_down(h, k, 0);
            }
    }
#endif
    for (; i < V; i++)
        if (l[i] > h[0]) {
            h[0] = l[i];
            heap_sift_down(h, k, 0);
        }
    return h[0];
}

/* The total order of candidates: higher logit first, then lower id. */
static inline bool before(const cand *a, const cand *b)
{
    return a->l > b->l || (a->l == b->l && a->id < b->id);
}

/* Heapsort of c[0, n) into the total order: in place, no allocation (glibc's qsort may
 * malloc a merge buffer, which the per-token path must not do). */
static void sift_down(cand *c, int32_t root, int32_t n)
{
    for (;;) {
        int32_t child = 2 * root + 1;
        if (child >= n) return;
        /* a max-heap of "later in the order", so the sorted array ends with the last */
        if (child + 1 < n && before(&c[child], &c[child + 1])) child++;
        if (!before(&c[root], &c[child])) return;
        cand t = c[root];
        c[root] = c[child];
        c[child] = t;
        root = child;
    }
}

static void sort_cands(cand *c, int32_t n)
{
    for (int32_t i = n / 2 - 1; i >= 0; i--) sift_down(c, i, n);
    for (int32_t end = n - 1; end > 0; end--) {
        cand t = c[0];
        c[0] = c[end];
        c[end] = t;
        sift_down(c, 0, end);
    }
}

static inline int32_t bucket_of(float mx, float l, float scale)
{
    float f = (mx - l) * scale;
    return f < (float)(PD_SAMPLER_BUCKETS - 1) ? (int32_t)f : PD_SAMPLER_BUCKETS - 1;
}

/* Bucket indices of l[i, i + 4) into b (same values as bucket_of, NaN/inf -> last). */
static inline void bucket4(const float *l, float mx, float scale, int32_t *b)
{
#ifdef PD_SAMPLER_SSE2
    __m128 f = _mm_mul_ps(_mm_sub_ps(_mm_set1_ps(mx), _mm_loadu_ps(l)), _mm_set1_ps(scale));
    f = _mm_min_ps(f, _mm_set1_ps((float)(PD_SAMPLER_BUCKETS - 1))); /* NaN -> the bound */
    _mm_storeu_si128((__m128i *)b, _mm_cvttps_epi32(f));
#else
    for (int j = 0; j < 4; j++) b[j] = bucket_of(mx, l[j], scale);
#endif
}

/* Zeroes w outside the prefix of the total order that ends at (lc, idc): keeps l > lc, and
 * l == lc up to id idc. */
static void keep_prefix(float *w, const float *l, int32_t V, float lc, int32_t idc)
{
    int32_t i = 0;
#ifdef PD_SAMPLER_SSE2
    const __m128 vlc = _mm_set1_ps(lc);
    for (; i + 4 <= V; i += 4) {
        __m128 x = _mm_loadu_ps(l + i);
        if (_mm_movemask_ps(_mm_cmpeq_ps(x, vlc))) {
            for (int32_t j = i; j < i + 4; j++)
                if (!(l[j] > lc) && (l[j] != lc || j > idc)) w[j] = 0.0f;
            continue;
        }
        _mm_storeu_ps(w + i, _mm_and_ps(_mm_cmpgt_ps(x, vlc), _mm_loadu_ps(w + i)));
    }
#endif
    for (; i < V; i++)
        if (!(l[i] > lc) && (l[i] != lc || i > idc)) w[i] = 0.0f;
}

/* Sorts c[0, n) into the total order and returns the index of the first element at which
 * the running weight, starting from `need` missing, is covered (n - 1 when rounding never
 * gets there). */
static int32_t walk_to_mass(cand *c, int32_t n, double need)
{
    sort_cands(c, n);
    for (int32_t j = 0; j < n; j++) {
        need -= c[j].w;
        if (need <= 0.0) return j;
    }
    return n - 1;
}

#define PD_SAMPLER_TOP_P_FAST 256 /* top_p first tries the 256 largest logits */

/* top_p: zeroes w outside the shortest prefix of the total order whose weight reaches
 * top_p of the total. cut: the logit cut w was computed with (min_p / top_k).
 * Fast path, for the peaked distributions of trained models: the PD_SAMPLER_TOP_P_FAST
 * largest logits (and their ties) are found with the top-k heap; when their weight reaches
 * the target, only they are sorted. Otherwise a histogram of weight over logit buckets
 * (monotone in the logit) finds the boundary bucket, and only that bucket is sorted. Two
 * interleaved histograms (even and odd ids) halve the store-to-load chains when
 * neighbours share a bucket. */
static void apply_top_p(pd_sampler_ws *ws, const float *l, int32_t V, float mx, float inv_t,
                        float cut, float top_p)
{
    float *w = ws->w;
    cand *c = ws->cands;
    int32_t i = 0, n = 0;
    {
        double total = 0.0;
        for (int32_t lo = 0; lo < V; lo += PD_SAMPLER_BLOCK)
            total += block_sum(w + lo, V - lo < PD_SAMPLER_BLOCK ? V - lo : PD_SAMPLER_BLOCK);
        double target = (double)top_p * total;
        float t = kth_largest(l, V, cut, PD_SAMPLER_TOP_P_FAST, ws->scratch);
        double mass = 0.0;
#ifdef PD_SAMPLER_SSE2
        const __m128 vt = _mm_set1_ps(t), zero = _mm_setzero_ps();
        for (; i + 4 <= V; i += 4) {
            if (!_mm_movemask_ps(_mm_and_ps(_mm_cmpge_ps(_mm_loadu_ps(l + i), vt),
                                            _mm_cmpgt_ps(_mm_loadu_ps(w + i), zero))))
                continue;
            for (int32_t j = i; j < i + 4; j++)
                if (w[j] > 0.0f && l[j] >= t) {
                    c[n++] = (cand){l[j], w[j], j};
                    mass += w[j];
                }
        }
#endif
        for (; i < V; i++)
            if (w[i] > 0.0f && l[i] >= t) {
                c[n++] = (cand){l[i], w[i], i};
                mass += w[i];
            }
        if (n > 0 && (mass >= target || t == -INFINITY)) {
            int32_t k = walk_to_mass(c, n, target);
            keep_prefix(w, l, V, c[k].l, c[k].id);
            return;
        }
    }
    double *m0 = ws->mass, *m1 = ws->mass + PD_SAMPLER_BUCKETS;
    const float scale = inv_t * PD_SAMPLER_BUCKET_SCALE;
    memset(ws->mass, 0, 2 * PD_SAMPLER_BUCKETS * sizeof *ws->mass);
    int32_t b4[4];
    i = 0;
    for (; i + 4 <= V; i += 4) {
        bucket4(l + i, mx, scale, b4);
        /* adding a zero weight changes nothing, so no branch on w */
        m0[b4[0]] += w[i];
        m1[b4[1]] += w[i + 1];
        m0[b4[2]] += w[i + 2];
        m1[b4[3]] += w[i + 3];
    }
    for (; i < V; i++) (i & 1 ? m1 : m0)[bucket_of(mx, l[i], scale)] += w[i];
    double total = 0.0;
    for (int32_t b = 0; b < PD_SAMPLER_BUCKETS; b++) total += m0[b] + m1[b];
    double target = (double)top_p * total, cum = 0.0;
    int32_t bstar = -1;
    for (int32_t b = 0; b < PD_SAMPLER_BUCKETS; b++) {
        double mb = m0[b] + m1[b];
        if (cum + mb >= target) {
            bstar = b;
            break;
        }
        cum += mb;
    }
    if (bstar < 0) return; /* rounding left the target unreached: keep everything */
    n = 0;
    for (i = 0; i + 4 <= V; i += 4) {
        bucket4(l + i, mx, scale, b4);
#ifdef PD_SAMPLER_SSE2
        if (!_mm_movemask_epi8(
                _mm_cmpeq_epi32(_mm_loadu_si128((const __m128i *)b4), _mm_set1_epi32(bstar))))
            continue;
#endif
        for (int j = 0; j < 4; j++)
            if (b4[j] == bstar && w[i + j] > 0.0f) c[n++] = (cand){l[i + j], w[i + j], i + j};
    }
    for (; i < V; i++)
        if (w[i] > 0.0f && bucket_of(mx, l[i], scale) == bstar) c[n++] = (cand){l[i], w[i], i};
    if (n == 0) return; /* cannot happen: bucket bstar holds weight */
    int32_t k = walk_to_mass(c, n, target - cum);
    keep_prefix(w, l, V, c[k].l, c[k].id);
}

/* Inverse CDF over w in ascending id order: block sums (block_sum) accumulated in double
 * find the block where u * total falls, then a sequential double sum inside it. */
static int32_t draw(pd_sampler_ws *ws, int32_t V, double u)
{
    const float *w = ws->w;
    int32_t nb = (V + PD_SAMPLER_BLOCK - 1) / PD_SAMPLER_BLOCK;
    double total = 0.0;
    for (int32_t b = 0; b < nb; b++) {
        int32_t lo = b * PD_SAMPLER_BLOCK;
        int32_t len = V - lo < PD_SAMPLER_BLOCK ? V - lo : PD_SAMPLER_BLOCK;
        ws->bsum[b] = (double)block_sum(w + lo, len);
        total += ws->bsum[b];
    }
    if (!(total > 0.0)) return -1;
    double target = u * total, acc = 0.0;
    for (int32_t b = 0; b < nb; b++) {
        if (acc + ws->bsum[b] > target && ws->bsum[b] > 0.0) {
            int32_t lo = b * PD_SAMPLER_BLOCK;
            int32_t hi = V - lo < PD_SAMPLER_BLOCK ? V : lo + PD_SAMPLER_BLOCK;
            int32_t last = -1;
            for (int32_t i = lo; i < hi; i++) {
                if (w[i] <= 0.0f) continue;
                last = i;
                acc += w[i];
                if (acc > target) return i;
            }
            return last; /* the in-block sum rounded below the block sum */
        }
        acc += ws->bsum[b];
    }
    for (int32_t i = V - 1; i >= 0; i--) /* target at the very top: the last kept token */
        if (w[i] > 0.0f) return i;
    return -1;
}

/* Top-N of the raw logits by the total order and their log_softmax values. Keeps a sorted
 * array of the best N seen (N is small: --max-logprobs, 20 by default). */
static void raw_logprobs(const float *raw, int32_t vocab, int32_t n_top, int32_t token,
                         pd_sampler_ws *ws, pd_sample_result *out)
{
    float mx = vec_max(raw, vocab);
    double lse = (double)mx;
    if (mx > -INFINITY && mx < INFINITY) {
        vec_weights(raw, ws->w, vocab, mx, -INFINITY, 1.0f);
        double sum = 0.0;
        for (int32_t lo = 0; lo < vocab; lo += PD_SAMPLER_BLOCK)
            sum += block_sum(ws->w + lo,
                             vocab - lo < PD_SAMPLER_BLOCK ? vocab - lo : PD_SAMPLER_BLOCK);
        lse = (double)mx + log(sum);
    }
    /* log_softmax = x - lse; -inf and NaN entries, and a non-finite lse, get the floor. */
#define LOGPROB(x)                                                                                 \
    (!((x) > -INFINITY) || !isfinite(lse) ? PD_LOGPROB_FLOOR                                       \
                                          : fmaxf((float)((double)(x)-lse), PD_LOGPROB_FLOOR))
    out->logprob = LOGPROB(raw[token]);
    int32_t m = 0;
    int32_t *ids = ws->top_ids;
    float *lv = ws->scratch; /* raw logits of the kept top ids, (n_top,) */
    for (int32_t i = 0; i < vocab && n_top > 0; i++) {
#ifdef PD_SAMPLER_SSE2
        /* once full, skip 4 at a time while none beats the worst kept (NaN never does) */
        while (m == n_top && (i & 3) == 0 && i + 4 <= vocab &&
               !_mm_movemask_ps(_mm_cmpgt_ps(_mm_loadu_ps(raw + i), _mm_set1_ps(lv[m - 1]))))
            i += 4;
        if (i >= vocab) break;
#endif
        float x = raw[i] == raw[i] ? raw[i] : -INFINITY;
        if (m == n_top && !(x > lv[m - 1]))
            continue; /* not better than the worst kept (equal logit: the kept id is lower) */
        int32_t j = m < n_top ? m++ : m - 1;
        while (j > 0 && x > lv[j - 1]) {
            lv[j] = lv[j - 1];
            ids[j] = ids[j - 1];
            j--;
        }
        lv[j] = x;
        ids[j] = i;
    }
    for (int32_t j = 0; j < m; j++) ws->top_lp[j] = LOGPROB(lv[j]);
#undef LOGPROB
    out->n_top = m;
    out->top_ids = ws->top_ids;
    out->top_logprobs = ws->top_lp;
}

int pd_sampler_logprobs(const float *logits, int32_t vocab, int32_t n_top, int32_t token,
                        pd_sampler_ws *ws, pd_sample_result *out, int32_t *rank)
{
    if (ws->vocab < vocab || n_top > ws->max_logprobs || token < 0 || token >= vocab)
        return pd_error(PD_EINVAL,
                        "sampler: logprobs of token %" PRId32 " with top %" PRId32 " over %" PRId32
                        " tokens (workspace: %" PRId32 " tokens, %" PRId32 " logprobs)",
                        token, n_top, vocab, ws->vocab, ws->max_logprobs);
    out->token = token;
    raw_logprobs(logits, vocab, n_top < vocab ? n_top : vocab, token, ws, out);
    if (rank) {
        float t = logits[token] == logits[token] ? logits[token] : -INFINITY;
        int32_t n = 0;
        for (int32_t i = 0; i < vocab; i++)
            n += (logits[i] == logits[i] ? logits[i] : -INFINITY) >= t;
        *rank = n;
    }
    return PD_OK;
}

/* ---- pd_sample ----------------------------------------------------------------------------- */

int pd_sample(pd_sampler_seq *s, const float *logits, const uint32_t *mask, pd_sampler_ws *ws,
              pd_sample_result *out)
{
    const int32_t V = s->vocab;
    if (ws->vocab < V)
        return pd_error(PD_EINVAL,
                        "sampler: workspace holds %" PRId32 " tokens, the vocabulary has %" PRId32,
                        ws->vocab, V);
    if (s->logprobs > ws->max_logprobs)
        return pd_error(PD_EINVAL,
                        "sampler: %" PRId32 " logprobs requested, the workspace holds %" PRId32,
                        s->logprobs, ws->max_logprobs);
    float *l = ws->logits;
    memcpy(l, logits, (size_t)V * sizeof *l);

    /* 1. allowed_token_ids: everything else -inf. */
    if (s->has_allowed) {
        for (int32_t j = 0; j < s->n_allowed; j++) ws->scratch[j] = l[s->allowed[j]];
        for (int32_t i = 0; i < V; i++) l[i] = -INFINITY;
        for (int32_t j = 0; j < s->n_allowed; j++) l[s->allowed[j]] = ws->scratch[j];
    }
    if (mask) /* the grammar's: whole words of allowed ids are skipped */
        for (int32_t w = 0; w < (V + 31) / 32; w++) {
            uint32_t m = mask[w];
            if (m == UINT32_MAX) continue;
            int32_t end = w * 32 + 32 < V ? w * 32 + 32 : V;
            for (int32_t i = w * 32; i < end; i++)
                if (!(m >> (i & 31) & 1u)) l[i] = -INFINITY;
        }
    /* 2. min_tokens: EOS and stop ids impossible until min_tokens tokens exist. */
    if (s->n_output < s->min_tokens)
        for (int32_t j = 0; j < s->n_stop_ids; j++) l[s->stop_ids[j]] = -INFINITY;
    /* 3. logit_bias. */
    for (int32_t j = 0; j < s->n_bias; j++) l[s->bias[j].id] += s->bias[j].bias;
    /* 4-5. penalties over the ids seen so far. */
    if (s->penalize) {
        for (int32_t j = 0; j < s->n_touched; j++) {
            int32_t id = s->touched[j];
            uint32_t c = s->counts[id];
            float x = l[id];
            if (s->repetition != 1.0f) x = x > 0.0f ? x / s->repetition : x * s->repetition;
            uint32_t k = c & SEQ_COUNT_MASK;
            if (k > 0) x -= s->frequency * (float)k + s->presence;
            l[id] = x;
        }
    }

    int32_t token = -1;
    float mx = vec_max(l, V);
    if (s->greedy) {
        /* 6. argmax; ties go to the lowest id, NaN never wins. */
        if (mx > -INFINITY)
            for (int32_t i = 0; i < V; i++)
                if (l[i] == mx) {
                    token = i;
                    break;
                }
    } else if (mx == INFINITY) {
        return pd_error(PD_EINVAL, "sampler: a logit is +inf (step %" PRId64 ")", s->n_output);
    } else if (mx > -INFINITY) {
        const float inv_t = 1.0f / s->temperature;
        /* min_p: keep p_i >= min_p * p_max, i.e. (l_i - max) / T >= log(min_p). */
        float cut = -INFINITY;
        if (s->min_p > 0.0f) {
            cut = mx + s->temperature * logf(s->min_p);
            if (cut > mx) cut = mx; /* rounding must never drop the maximum */
        }
        /* top_k: the k-th largest surviving logit becomes the cut; ties with it stay. */
        if (s->top_k > 0) {
            float kth = kth_largest(l, V, cut, s->top_k, ws->scratch);
            if (kth > cut) cut = kth;
        }
        vec_weights(l, ws->w, V, mx, cut, inv_t);
        if (s->top_p < 1.0f) apply_top_p(ws, l, V, mx, inv_t, cut, s->top_p);
        double u =
            pd_rng_uniform(s->seed, s->seq_index, (uint64_t)s->n_output, PD_RNG_STREAM_SAMPLE);
        token = draw(ws, V, u);
    }
    if (token < 0)
        return pd_error(PD_EINVAL,
                        "sampler: no token can be sampled at step %" PRId64
                        ": every logit is masked or NaN",
                        s->n_output);

    out->token = token;
    out->logprob = 0.0f;
    out->n_top = 0;
    out->top_ids = ws->top_ids;
    out->top_logprobs = ws->top_lp;
    if (s->logprobs >= 0)
        raw_logprobs(logits, V, s->logprobs < V ? s->logprobs : V, token, ws, out);
    PD_CHECK(pd_sampler_seq_append(s, token));
    return PD_OK;
}
