/* pd-bench datasets: random prompts of given length distributions, or a JSONL prompt file.
 *
 * Design: random draws come from the engine's counter-based generator (engine/rng.h) keyed by
 * (--seed, prompt index, draw number), so a dataset is a pure function of its options and the
 * same prompts can be replayed through pd-generate for the colocated baseline.
 */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "engine/rng.h"
#include "json/json.h"
#include "util/status.h"

/* rng streams: lengths, prompt contents, request shapes (stream 3 is main.c's arrivals) */
enum { STREAM_LEN = 1, STREAM_TOKEN = 2, STREAM_SHAPE = 4 };

/* Words for text prompts (chat, /generate): common English words, each usually one token. */
static const char *const k_words[] = {
    "the",      "of",     "and",    "to",       "in",     "is",    "was",     "for",    "that",
    "with",     "as",     "on",     "by",       "at",     "from",  "his",     "her",    "they",
    "we",       "you",    "time",   "year",     "people", "way",   "day",     "man",    "thing",
    "woman",    "life",   "child",  "world",    "school", "state", "family",  "group",  "country",
    "problem",  "hand",   "part",   "place",    "case",   "week",  "company", "system", "program",
    "question", "work",   "number", "night",    "point",  "home",  "water",   "room",   "mother",
    "area",     "money",  "story",  "fact",     "month",  "lot",   "right",   "study",  "book",
    "eye",      "job",    "word",   "business", "issue",  "side",  "kind",    "head",   "house",
    "service",  "friend", "father", "power",    "hour",   "game",  "line",    "end",    "city",
    "name",     "idea",   "body",   "back",     "face",   "door",  "car",     "law",    "war",
};
#define N_WORDS (sizeof k_words / sizeof k_words[0])

/* Uniform integer in [lo, hi] from draw (idx, step, stream). */
static int64_t uniform_int(uint64_t seed, uint32_t idx, uint64_t step, uint32_t stream, int64_t lo,
                           int64_t hi)
{
    double u = pd_rng_uniform(seed, idx, step, stream);
    int64_t v = lo + (int64_t)floor(u * (double)(hi - lo + 1));
    return v > hi ? hi : v;
}

/* [len*(1-r), len*(1+r)] as vLLM's random dataset computes it, never below 1. */
static void len_range(int64_t len, double r, int64_t *lo, int64_t *hi)
{
    *lo = (int64_t)floor((double)len * (1.0 - r));
    *hi = (int64_t)ceil((double)len * (1.0 + r));
    if (*lo < 1) *lo = 1;
    if (*hi < *lo) *hi = *lo;
}

int pdb_dataset_random(pdb_dataset *d, size_t n, int64_t prefix_len, int64_t n_prefixes,
                       int64_t input_len, int64_t output_len, double range_ratio, int64_t vocab,
                       bool ids, uint64_t seed)
{
    memset(d, 0, sizeof *d);
    if (n == 0) return pd_error(PD_EINVAL, "--num-prompts: must be at least 1");
    if (input_len < 1) return pd_error(PD_EINVAL, "--random-input-len: must be at least 1");
    if (prefix_len < 0) return pd_error(PD_EINVAL, "--random-prefix-len: must be at least 0");
    if (n_prefixes < 1) return pd_error(PD_EINVAL, "--random-num-prefixes: must be at least 1");
    if (output_len < 1) return pd_error(PD_EINVAL, "--random-output-len: must be at least 1");
    if (!(range_ratio >= 0.0 && range_ratio < 1.0))
        return pd_error(PD_EINVAL, "--random-range-ratio: must be in [0, 1), got %g", range_ratio);
    if (ids && vocab < 4)
        return pd_error(PD_EINVAL, "--random-vocab-size: must be at least 4, got %lld",
                        (long long)vocab);
    d->items = calloc(n, sizeof *d->items);
    if (!d->items) return pd_error(PD_ENOMEM, "out of memory");
    d->n = n;
    int64_t ilo, ihi, olo, ohi;
    len_range(input_len, range_ratio, &ilo, &ihi);
    len_range(output_len, range_ratio, &olo, &ohi);
    for (size_t i = 0; i < n; i++) {
        pdb_prompt *p = &d->items[i];
        uint32_t idx = (uint32_t)i;
        int64_t own = uniform_int(seed, idx, 0, STREAM_LEN, ilo, ihi);
        p->input_len = prefix_len + own;
        p->output_len = uniform_int(seed, idx, 1, STREAM_LEN, olo, ohi);
        size_t cap = (size_t)p->input_len * 16 + 1, len = 0;
        if (ids) {
            p->ids = malloc((size_t)p->input_len * sizeof *p->ids);
            p->n_ids = (size_t)p->input_len;
        } else {
            p->text = malloc(cap);
        }
        if (!p->ids && !p->text) goto oom;
        for (int64_t k = 0; k < p->input_len; k++) {
            /* prefix j (prompt i's is i mod n_prefixes) is prompt "-1 - j"'s: no prompt's index */
            uint32_t at = k < prefix_len ? UINT32_MAX - (uint32_t)(i % (uint64_t)n_prefixes) : idx;
            uint64_t pos = (uint64_t)(k < prefix_len ? k : k - prefix_len);
            if (ids) {
                p->ids[k] = (int32_t)uniform_int(seed, at, pos, STREAM_TOKEN, 3, vocab - 1);
            } else {
                const char *w =
                    k_words[uniform_int(seed, at, pos, STREAM_TOKEN, 0, (int64_t)N_WORDS - 1)];
                len += (size_t)snprintf(p->text + len, cap - len, "%s%s", k ? " " : "", w);
            }
        }
    }
    return PD_OK;
oom:
    pdb_dataset_free(d);
    return pd_error(PD_ENOMEM, "out of memory");
}

int pdb_dataset_jsonl(pdb_dataset *d, const char *file, size_t n, int64_t default_out)
{
    memset(d, 0, sizeof *d);
    FILE *f = fopen(file, "r");
    if (!f) return pd_error(PD_ENOTFOUND, "--dataset-path %s: cannot open", file);
    char *line = NULL;
    size_t lcap = 0, cap = 0, lineno = 0;
    ssize_t len;
    int rc = PD_OK;
    json_t *o = NULL;
    while ((n == 0 || d->n < n) && (len = getline(&line, &lcap, f)) >= 0) {
        lineno++;
        while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r')) line[--len] = 0;
        if (len == 0) continue;
        char what[64];
        snprintf(what, sizeof what, "line %zu", lineno);
        rc = pdj_loads(line, (size_t)len, what, &o);
        if (rc < 0) goto bad;
        if (!json_is_object(o)) {
            rc = pd_error(PD_EINVAL, "line %zu: expected a JSON object", lineno);
            goto bad;
        }
        const char *text;
        int64_t out = default_out;
        char path[32];
        snprintf(path, sizeof path, "line %zu", lineno);
        if ((rc = pdj_get_string(o, path, "prompt", PDJ_REQUIRED, &text)) < 0) goto bad;
        if ((rc = pdj_get_int_range(o, path, "output_len", PDJ_NULL_IS_ABSENT, 1, 1 << 24, &out)) <
            0)
            goto bad;
        if (d->n == cap) {
            size_t nc = cap ? cap * 2 : 64;
            pdb_prompt *ni = realloc(d->items, nc * sizeof *ni);
            if (!ni) {
                rc = pd_error(PD_ENOMEM, "out of memory");
                goto bad;
            }
            d->items = ni;
            cap = nc;
        }
        pdb_prompt *p = &d->items[d->n];
        memset(p, 0, sizeof *p);
        p->text = strdup(text);
        if (!p->text) {
            rc = pd_error(PD_ENOMEM, "out of memory");
            goto bad;
        }
        p->input_len = -1;
        p->output_len = out;
        d->n++;
        json_decref(o);
        o = NULL;
    }
    if (d->n == 0) {
        rc = pd_error(PD_EINVAL, "no prompts in the file");
        goto bad;
    }
    if (n && d->n < n) {
        rc = pd_error(PD_EINVAL, "--num-prompts %zu: the file has only %zu prompts", n, d->n);
        goto bad;
    }
    free(line);
    fclose(f);
    return PD_OK;
bad:
    json_decref(o);
    free(line);
    fclose(f);
    pdb_dataset_free(d);
    return pd_error_prefix(rc, "--dataset-path %s", file);
}

int pdb_dataset_mix(pdb_dataset *d, double abort_ratio, uint64_t seed)
{
    if (!(abort_ratio >= 0.0 && abort_ratio <= 1.0))
        return pd_error(PD_EINVAL, "--abort-ratio: must be in [0, 1], got %g", abort_ratio);
    for (size_t i = 0; i < d->n; i++) {
        pdb_prompt *p = &d->items[i];
        if (!p->text)
            return pd_error(PD_EINVAL, "--workload mixed: prompt %zu is not text (token ids)", i);
        uint32_t idx = (uint32_t)i;
        pdb_shape *s = &p->shape;
        s->set = true;
        s->ep = pd_rng_uniform(seed, idx, 0, STREAM_SHAPE) < 0.5 ? PDB_EP_COMPLETIONS : PDB_EP_CHAT;
        s->stream = pd_rng_uniform(seed, idx, 1, STREAM_SHAPE) < 0.75;
        s->n = pd_rng_uniform(seed, idx, 2, STREAM_SHAPE) < 0.10 ? 2 : 1;
        s->logprobs = pd_rng_uniform(seed, idx, 3, STREAM_SHAPE) < 0.15 ? 2 : 0;
        s->abort_after = 0;
        if (s->stream && pd_rng_uniform(seed, idx, 4, STREAM_SHAPE) < abort_ratio) {
            int64_t hi = (int64_t)s->n * p->output_len / 2;
            s->abort_after = uniform_int(seed, idx, 5, STREAM_SHAPE, 1, hi < 1 ? 1 : hi);
        }
    }
    return PD_OK;
}

void pdb_dataset_free(pdb_dataset *d)
{
    for (size_t i = 0; d->items && i < d->n; i++) {
        free(d->items[i].text);
        free(d->items[i].ids);
    }
    free(d->items);
    memset(d, 0, sizeof *d);
}
