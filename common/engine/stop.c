/* Stop checker implementation (semantics and check order in stop.h).
 *
 * One byte buffer holds [context | held text]: `released` bytes at its start were already
 * emitted and are kept only as look-behind for stop strings (at most longest-stop-minus-one
 * code points); the rest is held back. Each push trims the context first (so the text handed
 * out by the previous call stays valid until this call), appends the token's text, searches
 * the new text, then releases what the hold-back rule allows. Lengths for hold-back and
 * look-behind are counted in code points by skipping UTF-8 continuation bytes.
 */
#include "engine/stop.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "util/status.h"

struct pd_stop {
    /* configuration, copied from the params and the model */
    int32_t eos_id;    /* primary EOS, -1: none (or ignored) */
    int32_t *stop_ids; /* (n_stop_ids,) client stop ids, then the other model EOS ids */
    size_t n_stop_ids;
    bool include_stop;
    int32_t min_tokens;
    int64_t max_tokens; /* effective cap on output tokens */
    int64_t max_model_len;
    int64_t prompt_len;
    char **stop;        /* (n_stop,) NUL-terminated stop strings */
    size_t *stop_bytes; /* (n_stop,) */
    size_t *stop_cps;   /* (n_stop,) lengths in code points */
    int32_t n_stop;
    size_t holdback_cps; /* longest stop - 1 when holding back, else 0 */
    size_t context_cps;  /* longest stop - 1: look-behind kept after release */

    /* state */
    char *buf;       /* (cap,) UTF-8: [released context | held text] */
    size_t len, cap; /* bytes used / allocated */
    size_t released; /* bytes of buf already emitted */
    int64_t n_output;
    bool finished, flushed;
    bool complete;        /* pd_stop_complete: the next push finishes with "stop" */
    pd_stop_result final; /* the finishing result, repeated by pd_stop_flush */
};

const char *pd_finish_reason_name(pd_finish_reason r)
{
    switch (r) {
    case PD_FINISH_STOP: return "stop";
    case PD_FINISH_LENGTH: return "length";
    default: return NULL;
    }
}

static size_t utf8_cps(const char *s, size_t n)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) k += ((unsigned char)s[i] & 0xC0) != 0x80;
    return k;
}

/* Byte offset of the start of the k-th code point before pos in buf (0 at the start). */
static size_t back_cps(const char *buf, size_t pos, size_t k)
{
    while (k > 0 && pos > 0) {
        pos--;
        while (pos > 0 && ((unsigned char)buf[pos] & 0xC0) == 0x80) pos--;
        k--;
    }
    return pos;
}

int64_t pd_stop_effective_max_tokens(const pd_sampling_params *p, const pd_stop_model *m,
                                     int64_t prompt_len)
{
    int64_t cap = m->max_model_len - prompt_len;
    if (p->max_tokens >= 0 && p->max_tokens < cap) cap = p->max_tokens;
    if (m->max_new_tokens >= 0 && m->max_new_tokens < cap) cap = m->max_new_tokens;
    return cap;
}

int pd_stop_create(const pd_sampling_params *p, const pd_stop_model *m, int64_t prompt_len,
                   pd_stop **out)
{
    *out = NULL;
    if (m->max_model_len <= 0)
        return pd_error(PD_EINVAL, "stop checker: max_model_len must be positive, got %" PRId64,
                        m->max_model_len);
    if (prompt_len < 0 || prompt_len >= m->max_model_len)
        return pd_error(PD_EINVAL,
                        "stop checker: a prompt of %" PRId64
                        " tokens leaves no room under max_model_len %" PRId64,
                        prompt_len, m->max_model_len);
    if (p->n_stop < 0 || (p->n_stop > 0 && !p->stop) || p->n_stop_token_ids < 0 ||
        (p->n_stop_token_ids > 0 && !p->stop_token_ids) ||
        (m->n_extra_eos_ids > 0 && !m->extra_eos_ids))
        return pd_error(PD_EINVAL, "stop checker: a stop list has a count but no array");

    pd_stop *s = calloc(1, sizeof *s);
    if (!s) return pd_error(PD_ENOMEM, "stop checker: out of memory");
    int rc = PD_OK;
    s->eos_id = p->ignore_eos ? -1 : m->eos_id;
    s->include_stop = p->include_stop_str_in_output;
    s->min_tokens = p->min_tokens;
    s->max_tokens = pd_stop_effective_max_tokens(p, m, prompt_len);
    s->max_model_len = m->max_model_len;
    s->prompt_len = prompt_len;

    size_t n_ids = (size_t)p->n_stop_token_ids + (p->ignore_eos ? 0 : m->n_extra_eos_ids);
    if (n_ids > 0) {
        s->stop_ids = malloc(n_ids * sizeof *s->stop_ids);
        if (!s->stop_ids) {
            rc = pd_error(PD_ENOMEM, "stop checker: out of memory");
            goto fail;
        }
        for (int32_t i = 0; i < p->n_stop_token_ids; i++)
            s->stop_ids[s->n_stop_ids++] = p->stop_token_ids[i];
        if (!p->ignore_eos)
            for (size_t i = 0; i < m->n_extra_eos_ids; i++)
                if (m->extra_eos_ids[i] != m->eos_id)
                    s->stop_ids[s->n_stop_ids++] = m->extra_eos_ids[i];
    }

    if (p->n_stop > 0) {
        s->stop = calloc((size_t)p->n_stop, sizeof *s->stop);
        s->stop_bytes = calloc((size_t)p->n_stop, sizeof *s->stop_bytes);
        s->stop_cps = calloc((size_t)p->n_stop, sizeof *s->stop_cps);
        if (!s->stop || !s->stop_bytes || !s->stop_cps) {
            rc = pd_error(PD_ENOMEM, "stop checker: out of memory");
            goto fail;
        }
        s->n_stop = p->n_stop;
        size_t longest = 0;
        for (int32_t i = 0; i < p->n_stop; i++) {
            if (!p->stop[i] || !p->stop[i][0]) {
                rc = pd_error(PD_EINVAL, "stop cannot contain an empty string.");
                goto fail;
            }
            s->stop[i] = strdup(p->stop[i]);
            if (!s->stop[i]) {
                rc = pd_error(PD_ENOMEM, "stop checker: out of memory");
                goto fail;
            }
            s->stop_bytes[i] = strlen(s->stop[i]);
            s->stop_cps[i] = utf8_cps(s->stop[i], s->stop_bytes[i]);
            if (s->stop_cps[i] > longest) longest = s->stop_cps[i];
        }
        s->context_cps = longest - 1;
        s->holdback_cps = s->include_stop ? 0 : longest - 1;
    }
    /* Room for the held text, its context and a few long tokens before any growth. */
    s->cap = 256 + 8 * (s->context_cps + 1);
    s->buf = malloc(s->cap);
    if (!s->buf) {
        rc = pd_error(PD_ENOMEM, "stop checker: out of memory");
        goto fail;
    }
    *out = s;
    return PD_OK;
fail:
    pd_stop_free(s);
    return rc;
}

void pd_stop_free(pd_stop *s)
{
    if (!s) return;
    for (int32_t i = 0; i < s->n_stop; i++) free(s->stop[i]);
    free(s->stop);
    free(s->stop_bytes);
    free(s->stop_cps);
    free(s->stop_ids);
    free(s->buf);
    free(s);
}

static int reserve(pd_stop *s, size_t extra)
{
    if (s->len + extra <= s->cap) return PD_OK;
    size_t cap = s->cap * 2;
    while (cap < s->len + extra) cap *= 2;
    char *b = realloc(s->buf, cap);
    if (!b) return pd_error(PD_ENOMEM, "stop checker: out of memory (%zu bytes of text)", cap);
    s->buf = b;
    s->cap = cap;
    return PD_OK;
}

/* Drops released bytes that are no longer needed as look-behind. */
static void trim_context(pd_stop *s)
{
    size_t keep = back_cps(s->buf, s->released, s->context_cps);
    if (keep == 0) return;
    memmove(s->buf, s->buf + keep, s->len - keep);
    s->len -= keep;
    s->released -= keep;
}

/* First occurrence of needle (m > 0 bytes) in hay (n bytes), or NULL (memmem is a GNU
 * extension; stop strings are short, so memchr on the first byte then memcmp is enough). */
static const char *find_bytes(const char *hay, size_t n, const char *needle, size_t m)
{
    const char *end = hay + n;
    while ((size_t)(end - hay) >= m) {
        const char *c = memchr(hay, needle[0], (size_t)(end - hay) - m + 1);
        if (!c) return NULL;
        if (memcmp(c, needle, m) == 0) return c;
        hay = c + 1;
    }
    return NULL;
}

static bool is_stop_id(const pd_stop *s, int32_t token)
{
    for (size_t i = 0; i < s->n_stop_ids; i++)
        if (s->stop_ids[i] == token) return true;
    return false;
}

pd_finish_reason pd_stop_check_token(const pd_stop *s, int32_t token, pd_stop_result *r)
{
    if (s->eos_id >= 0 && token == s->eos_id) {
        r->finish = PD_FINISH_STOP;
    } else if (is_stop_id(s, token)) {
        r->finish = PD_FINISH_STOP;
        r->stop_kind = PD_STOP_REASON_TOKEN;
        r->stop_token = token;
    }
    return r->finish;
}

int64_t pd_stop_max_tokens(const pd_stop *s)
{
    return s->max_tokens;
}

int pd_stop_push(pd_stop *s, int32_t token, const char *delta, size_t delta_len, pd_stop_result *r)
{
    if (s->finished)
        return pd_error(PD_EINVAL, "stop checker: token pushed after the sequence finished");
    if (delta_len > 0 && !delta)
        return pd_error(PD_EINVAL, "stop checker: NULL text with length %zu", delta_len);
    trim_context(s);
    PD_CHECK(reserve(s, delta_len));

    memset(r, 0, sizeof *r);
    r->stop_index = -1;
    r->stop_token = -1;
    s->n_output++;

    /* 1-4: decisions from the token id alone. */
    bool drop_text = false;
    if (s->prompt_len + s->n_output >= s->max_model_len || s->n_output >= s->max_tokens) {
        r->finish = PD_FINISH_LENGTH;
    } else if (s->n_output >= s->min_tokens && pd_stop_check_token(s, token, r) != PD_FINISH_NONE) {
        drop_text = !s->include_stop;
    }
    if (r->finish == PD_FINISH_NONE && s->complete) r->finish = PD_FINISH_STOP;

    size_t new_start = s->len;
    if (!drop_text && delta_len > 0) {
        memcpy(s->buf + s->len, delta, delta_len);
        s->len += delta_len;
    }

    /* 5: stop strings over the new text and the look-behind before it; list order wins. */
    if (s->n_stop > 0 && s->len > new_start && s->n_output > s->min_tokens) {
        for (int32_t i = 0; i < s->n_stop; i++) {
            size_t from = back_cps(s->buf, new_start, s->stop_cps[i] - 1);
            const char *hit =
                find_bytes(s->buf + from, s->len - from, s->stop[i], s->stop_bytes[i]);
            if (!hit) continue;
            size_t end = (size_t)(hit - s->buf) + (s->include_stop ? s->stop_bytes[i] : 0);
            if (end < s->len) s->len = end;
            r->finish = PD_FINISH_STOP;
            r->stop_kind = PD_STOP_REASON_STRING;
            r->stop_index = i;
            r->stop_string = s->stop[i];
            r->stop_token = -1;
            break;
        }
    }

    /* Release: everything at the finish, else all but the last holdback_cps code points. */
    size_t upto = s->len;
    if (r->finish == PD_FINISH_NONE) upto = back_cps(s->buf, s->len, s->holdback_cps);
    if (upto < s->released)
        upto = s->released; /* a stop match never reaches into released text (see stop.h) */
    r->text = s->buf + s->released;
    r->text_len = upto - s->released;
    s->released = upto;
    if (r->finish != PD_FINISH_NONE) {
        s->finished = true;
        s->final = *r;
        s->final.text = NULL;
        s->final.text_len = 0;
    }
    return PD_OK;
}

void pd_stop_complete(pd_stop *s)
{
    s->complete = true;
}

int pd_stop_flush(pd_stop *s, const char *tail, size_t tail_len, pd_stop_result *r)
{
    if (!s->finished)
        return pd_error(PD_EINVAL, "stop checker: flush before the sequence finished");
    if (s->flushed) return pd_error(PD_EINVAL, "stop checker: flushed twice");
    if (tail_len > 0 && !tail)
        return pd_error(PD_EINVAL, "stop checker: NULL tail with length %zu", tail_len);
    s->flushed = true;
    *r = s->final;
    /* A stop string drops everything after its match, including bytes still undecoded. */
    if (s->final.stop_kind == PD_STOP_REASON_STRING || tail_len == 0) {
        r->text = s->buf + s->len;
        r->text_len = 0;
        return PD_OK;
    }
    trim_context(s);
    PD_CHECK(reserve(s, tail_len));
    memcpy(s->buf + s->len, tail, tail_len);
    r->text = s->buf + s->len;
    r->text_len = tail_len;
    s->len += tail_len;
    s->released = s->len;
    return PD_OK;
}

int pd_stop_copy_state(pd_stop *dst, const pd_stop *src)
{
    if (src->finished || dst->n_stop != src->n_stop || dst->max_tokens != src->max_tokens)
        return pd_error(PD_EINVAL, "stop checker: state copied from a finished or different one");
    dst->len = 0;
    PD_CHECK(reserve(dst, src->len));
    memcpy(dst->buf, src->buf, src->len);
    dst->len = src->len;
    dst->released = src->released;
    dst->n_output = src->n_output;
    dst->finished = dst->flushed = false;
    dst->complete = src->complete;
    return PD_OK;
}

int64_t pd_stop_num_output(const pd_stop *s)
{
    return s->n_output;
}

bool pd_stop_finished(const pd_stop *s)
{
    return s->finished;
}
