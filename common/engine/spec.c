/* n-gram prompt lookup (spec.h). */
#include "engine/spec.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "util/status.h"

size_t pd_spec_ngram_propose(const int32_t *tokens, size_t n_tokens, size_t min_n, size_t max_n,
                             size_t k, int32_t *out)
{
    if (k == 0 || min_n == 0 || n_tokens < 2) return 0;
    if (max_n > n_tokens - 1) max_n = n_tokens - 1; /* an earlier occurrence needs a token after */
    for (size_t n = max_n; n >= min_n && n > 0; n--) {
        const int32_t *suffix = tokens + n_tokens - n;
        /* occurrences [i, i + n) with i + n <= n_tokens - 1, the most recent first */
        for (size_t i = n_tokens - n; i-- > 0;) {
            if (tokens[i] != suffix[0] || memcmp(tokens + i, suffix, n * sizeof *tokens) != 0)
                continue;
            size_t avail = n_tokens - (i + n), m = avail < k ? avail : k;
            memcpy(out, tokens + i + n, m * sizeof *out);
            return m;
        }
    }
    return 0;
}

/* ---- configuration --------------------------------------------------------------------------- */

pd_spec_flags pd_spec_flags_default(void)
{
    return (pd_spec_flags){.num_tokens = -1, .ngram_max = -1, .ngram_min = -1, .disable_batch = -1};
}

static bool is_ngram(const char *name)
{
    return strcmp(name, "[ngram]") == 0 || strcmp(name, "ngram") == 0;
}

/* num_speculative_tokens, prompt_lookup_max / _min, disable_by_batch_size of the JSON config into
 * f; method or model must name the n-gram proposer. */
static int parse_config(const char *text, pd_spec_flags *f)
{
    json_error_t jerr;
    json_t *o = json_loads(text, JSON_REJECT_DUPLICATES, &jerr);
    if (!o || !json_is_object(o)) {
        json_decref(o);
        return pd_error(PD_EINVAL, "--speculative-config: expected a JSON object (%s)",
                        o ? "not an object" : jerr.text);
    }
    static const struct {
        const char *key;
        size_t off;
    } INTS[] = {{"num_speculative_tokens", offsetof(pd_spec_flags, num_tokens)},
                {"prompt_lookup_max", offsetof(pd_spec_flags, ngram_max)},
                {"prompt_lookup_min", offsetof(pd_spec_flags, ngram_min)},
                {"disable_by_batch_size", offsetof(pd_spec_flags, disable_batch)}};
    const char *key;
    json_t *v;
    int rc = PD_OK;
    bool method = false;
    json_object_foreach(o, key, v)
    {
        size_t k = 0;
        while (k < sizeof INTS / sizeof *INTS && strcmp(INTS[k].key, key) != 0) k++;
        if (k < sizeof INTS / sizeof *INTS) {
            if (!json_is_integer(v) || json_integer_value(v) < 0) {
                rc = pd_error(PD_EINVAL, "--speculative-config: %s must be an integer >= 0", key);
                break;
            }
            *(int64_t *)((char *)f + INTS[k].off) = (int64_t)json_integer_value(v);
        } else if (strcmp(key, "method") == 0 || strcmp(key, "model") == 0) {
            if (!json_is_string(v) || !is_ngram(json_string_value(v))) {
                rc = pd_error(PD_EUNSUPPORTED,
                              "--speculative-config: %s %s is not supported: pdserve proposes "
                              "drafts by n-gram prompt lookup (\"method\": \"ngram\")",
                              key, json_is_string(v) ? json_string_value(v) : "(not a string)");
                break;
            }
            method = true;
        } else {
            rc = pd_error(PD_EINVAL, "--speculative-config: unknown key '%s'", key);
            break;
        }
    }
    json_decref(o);
    if (rc == PD_OK && !method)
        rc = pd_error(PD_EINVAL, "--speculative-config: \"method\": \"ngram\" is required");
    if (rc == PD_OK && f->num_tokens < 0)
        rc = pd_error(PD_EINVAL, "--speculative-config: num_speculative_tokens is required");
    if (rc == PD_OK && f->ngram_max < 0 && f->ngram_min < 0) f->ngram_max = f->ngram_min = 5;
    if (rc == PD_OK && f->ngram_min < 0) f->ngram_min = f->ngram_max;
    if (rc == PD_OK && f->ngram_max < 0) f->ngram_max = f->ngram_min;
    if (rc == PD_OK && f->ngram_min < 1)
        rc = pd_error(PD_EINVAL, "--speculative-config: prompt_lookup_min=%lld must be > 0",
                      (long long)f->ngram_min);
    return rc;
}

int pd_spec_configure(const pd_spec_flags *flags, pd_engine_params *p)
{
    pd_spec_flags f = *flags;
    if (f.config_json) {
        if (f.model || f.num_tokens >= 0 || f.ngram_max >= 0 || f.ngram_min >= 0)
            return pd_error(PD_EINVAL, "--speculative-config cannot be combined with "
                                       "--speculative-model, --num-speculative-tokens or "
                                       "--ngram-prompt-lookup-max/-min");
        PD_CHECK(parse_config(f.config_json, &f));
    } else if (f.model || f.num_tokens >= 0) {
        if (!f.model || f.num_tokens < 0) {
            char k[32];
            snprintf(k, sizeof k, "%lld", (long long)f.num_tokens);
            return pd_error(PD_EINVAL,
                            "Expected both speculative_model and num_speculative_tokens to be "
                            "provided, but found speculative_model=%s and "
                            "num_speculative_tokens=%s.",
                            f.model ? f.model : "None", f.num_tokens < 0 ? "None" : k);
        }
        if (!is_ngram(f.model))
            return pd_error(PD_EUNSUPPORTED,
                            "--speculative-model %s: draft models are not supported yet; use "
                            "[ngram] (n-gram prompt lookup)",
                            f.model);
        if (f.ngram_max < 1)
            return pd_error(PD_EINVAL, "ngram_prompt_lookup_max=%lld must be > 0",
                            (long long)(f.ngram_max < 0 ? 0 : f.ngram_max));
        if (f.ngram_min < 1) f.ngram_min = 1;
    } else if (f.ngram_max >= 0 || f.ngram_min >= 0 || f.disable_batch >= 0) {
        return pd_error(PD_EINVAL, "--ngram-prompt-lookup-max/-min and "
                                   "--speculative-disable-by-batch-size need --speculative-model "
                                   "[ngram] and --num-speculative-tokens");
    } else {
        return PD_OK;
    }
    if (f.num_tokens < 1 || f.num_tokens > PD_ENGINE_SPEC_MAX_TOKENS)
        return pd_error(PD_EINVAL, "num_speculative_tokens=%lld must be in [1, %d]",
                        (long long)f.num_tokens, PD_ENGINE_SPEC_MAX_TOKENS);
    if (f.ngram_min > f.ngram_max)
        return pd_error(PD_EINVAL, "prompt_lookup_min=%lld must be <= prompt_lookup_max=%lld",
                        (long long)f.ngram_min, (long long)f.ngram_max);
    p->spec_num_tokens = (size_t)f.num_tokens;
    p->spec_ngram_max = (size_t)f.ngram_max;
    p->spec_ngram_min = (size_t)f.ngram_min;
    p->spec_disable_batch = f.disable_batch > 0 ? (size_t)f.disable_batch : 0;
    return PD_OK;
}
