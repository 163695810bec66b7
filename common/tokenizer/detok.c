/* Decoding: whole-sequence decode (pd_tok_decode) and the incremental detokenizer
 * (pd_detok_*) used by the decode node, one per sequence.
 *
 * Both reproduce Hugging Face's decoder chains for the supported models:
 *   ByteLevel: every token maps back to bytes; the concatenation is decoded lossily
 *     (invalid UTF-8 -> U+FFFD per maximal invalid subpart, like from_utf8_lossy).
 *   SentencePiece (Replace "▁"->" ", ByteFallback, Fuse, Strip): a run of <0xNN> tokens is
 *     one byte string, kept if valid UTF-8, else one U+FFFD per byte (Rust ByteFallback);
 *     then up to `strip` leading spaces of the whole text are removed.
 * pd_tok_decode is the direct transcription of those chains (the reference); the
 * detokenizer is a state machine that emits each character as soon as no later token can
 * change it: ByteLevel holds back at most a 3-byte incomplete UTF-8 tail, SentencePiece
 * holds back an unfinished <0xNN> run (a later stray byte would turn the whole run into
 * U+FFFD). Instead of vLLM's re-decoding of a window (prefix_offset/read_offset), this
 * touches each byte once; the property is the same: concatenated deltas == full decode.
 */
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tok_internal.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"
#include "util/status.h"

static const char META[] = "\xe2\x96\x81"; /* U+2581 "▁" */
static const uint8_t FFFD[3] = {0xEF, 0xBF, 0xBD};

int pd_tok_build_decoder(pd_tok *t)
{
    /* byte-level char -> byte */
    int16_t rev[0x144];
    for (int i = 0; i < 0x144; i++) rev[i] = -1;
    for (int b = 0; b < 256; b++) {
        uint32_t cp;
        bool ok;
        pd_utf8_decode(t->bl_enc[b], t->bl_enc_len[b], &cp, &ok);
        rev[cp] = (int16_t)b;
    }
    for (int32_t id = 0; id < t->n_ids; id++) {
        const uint8_t *s = (const uint8_t *)t->id_str[id];
        size_t n = t->id_len[id];
        if (!s) continue;
        if (t->dec_mode == DEC_BYTELEVEL) {
            uint8_t *o = pd_arena_alloc(t->arena, n + 1, 1);
            if (!o) return pd_error(PD_ENOMEM, "tokenizer: out of memory");
            size_t k = 0;
            bool all = true;
            for (size_t i = 0; i < n && all;) {
                uint32_t cp;
                bool ok;
                i += pd_utf8_decode(s + i, n - i, &cp, &ok);
                if (cp < 0x144 && rev[cp] >= 0)
                    o[k++] = (uint8_t)rev[cp];
                else
                    all = false;
            }
            if (!all) { /* a char outside the alphabet: the token's own bytes (as HF) */
                memcpy(o, s, n);
                k = n;
            }
            t->id_dec[id] = o;
            t->id_dec_len[id] = (uint32_t)k;
        } else if (t->dec_mode == DEC_SPM) {
            uint8_t *o = pd_arena_alloc(t->arena, n + 1, 1);
            if (!o) return pd_error(PD_ENOMEM, "tokenizer: out of memory");
            size_t k = 0;
            for (size_t i = 0; i < n;) {
                if (i + 3 <= n && memcmp(s + i, META, 3) == 0) {
                    o[k++] = ' ';
                    i += 3;
                } else {
                    o[k++] = s[i++];
                }
            }
            t->id_dec[id] = o;
            t->id_dec_len[id] = (uint32_t)k;
        } else {
            t->id_dec[id] = s;
            t->id_dec_len[id] = (uint32_t)n;
        }
    }
    return 0;
}

/* ---- a growable byte buffer ------------------------------------------------------------ */

typedef struct {
    uint8_t *p;
    size_t n, cap;
} bbuf;

static int bb_reserve(bbuf *b, size_t extra)
{
    if (b->n + extra + 1 <= b->cap) return 0;
    size_t nc = b->cap ? b->cap : 256;
    while (nc < b->n + extra + 1) nc *= 2;
    uint8_t *q = realloc(b->p, nc);
    if (!q) return pd_error(PD_ENOMEM, "detokenizer: out of memory");
    b->p = q;
    b->cap = nc;
    return 0;
}

static int bb_put(bbuf *b, const void *s, size_t n)
{
    PD_CHECK(bb_reserve(b, n));
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return 0;
}

static bool utf8_ok(const uint8_t *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        bool ok;
        i += pd_utf8_decode(s + i, n - i, &cp, &ok);
        if (!ok) return false;
    }
    return true;
}

/* Rust ByteFallback: a valid run is its text, an invalid one is U+FFFD per byte. */
static int put_run(bbuf *o, const uint8_t *run, size_t n)
{
    if (utf8_ok(run, n)) return bb_put(o, run, n);
    PD_CHECK(bb_reserve(o, 3 * n));
    for (size_t i = 0; i < n; i++) PD_CHECK(bb_put(o, FFFD, 3));
    return 0;
}

/* Token text with every "▁" removed (Metaspace decoder, first token). */
static int put_without_meta(bbuf *o, const uint8_t *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        if (i + 3 <= n && memcmp(s + i, META, 3) == 0) {
            i += 3;
            continue;
        }
        PD_CHECK(bb_put(o, s + i, 1));
        i++;
    }
    return 0;
}

static int check_id(const pd_tok *t, int32_t id)
{
    if (id < 0 || id >= t->n_ids)
        return pd_error(PD_EINVAL, "token id %d out of range [0, %d)", id, t->n_ids);
    return 0;
}

/* Skipped by the decoder: unused ids (Hugging Face's id_to_token gives none) and, when
 * asked, special tokens. */
static inline bool skipped(const pd_tok *t, int32_t id, bool skip_special)
{
    return !(t->id_flags[id] & TOKF_USED) || (skip_special && (t->id_flags[id] & TOKF_SPECIAL));
}

int pd_tok_decode(const pd_tok *t, const int32_t *ids, size_t n_ids, bool skip_special_tokens,
                  char **text, size_t *text_len)
{
    *text = NULL;
    if (text_len) *text_len = 0;
    for (size_t i = 0; i < n_ids; i++) PD_CHECK(check_id(t, ids[i]));
    bbuf o = {0}, raw = {0};
    int rc = bb_reserve(&o, 16);
    if (rc == 0) o.p[0] = 0;
    size_t k = 0; /* tokens that reached the decoder */
    for (size_t i = 0; i < n_ids && rc == 0; i++) {
        int32_t id = ids[i];
        if (skipped(t, id, skip_special_tokens)) continue;
        const uint8_t *s = t->id_dec[id];
        size_t n = t->id_dec_len[id];
        switch (t->dec_mode) {
        case DEC_BYTELEVEL: rc = bb_put(&raw, s, n); break;
        case DEC_NONE:
            if (k > 0) rc = bb_put(&o, " ", 1);
            if (rc == 0) rc = bb_put(&o, s, n);
            break;
        default:
            if (t->dec_byte_fallback && (t->id_flags[id] & TOKF_BYTE)) {
                rc = bb_put(&raw, &t->id_byte[id], 1);
                break;
            }
            if (raw.n) {
                rc = put_run(&o, raw.p, raw.n);
                raw.n = 0;
            }
            if (rc == 0 && t->dec_meta_first && k == 0)
                rc = put_without_meta(&o, (const uint8_t *)t->id_str[id], t->id_len[id]);
            else if (rc == 0)
                rc = bb_put(&o, s, n);
            break;
        }
        k++;
    }
    if (rc == 0 && raw.n) {
        if (t->dec_mode == DEC_BYTELEVEL) {
            rc = bb_reserve(&o, 3 * raw.n);
            if (rc == 0) {
                o.n = pd_utf8_lossy(raw.p, raw.n, o.p);
                o.p[o.n] = 0;
            }
        } else {
            rc = put_run(&o, raw.p, raw.n);
        }
    }
    free(raw.p);
    if (rc < 0) {
        free(o.p);
        return rc;
    }
    size_t cut = 0;
    if (t->dec_mode == DEC_SPM)
        while ((int)cut < t->dec_strip && cut < o.n && o.p[cut] == ' ') cut++;
    memmove(o.p, o.p + cut, o.n - cut + 1);
    *text = (char *)o.p;
    if (text_len) *text_len = o.n - cut;
    return 0;
}

/* ---- incremental detokenizer ---------------------------------------------------------- */

struct pd_detok {
    const pd_tok *t;
    bool skip_special;
    bbuf out;       /* every character emitted so far, NUL-terminated */
    bbuf pending;   /* ByteLevel: incomplete UTF-8 tail; SPM: unfinished <0xNN> run */
    size_t n_tok;   /* tokens that reached the decoder (not skipped) */
    int strip_left; /* SPM Strip: leading spaces still to drop */
    size_t hidden;  /* bytes of out produced by the prompt (not part of any delta) */
};

/* Appends text to out, applying the Strip decoder at the very start of the text. */
static int emit(pd_detok *d, const uint8_t *s, size_t n)
{
    while (d->strip_left > 0 && n > 0) {
        if (s[0] != ' ') {
            d->strip_left = 0;
            break;
        }
        s++;
        n--;
        d->strip_left--;
    }
    if (n == 0) return 0;
    d->strip_left = 0;
    return bb_put(&d->out, s, n);
}

static int emit_run(pd_detok *d)
{
    const uint8_t *run = d->pending.p;
    size_t n = d->pending.n;
    if (n == 0) return 0;
    d->pending.n = 0;
    if (utf8_ok(run, n)) return emit(d, run, n);
    for (size_t i = 0; i < n; i++) PD_CHECK(emit(d, FFFD, 3));
    return 0;
}

static int feed(pd_detok *d, int32_t id)
{
    const pd_tok *t = d->t;
    if (skipped(t, id, d->skip_special)) return 0;
    const uint8_t *s = t->id_dec[id];
    size_t n = t->id_dec_len[id];
    switch (t->dec_mode) {
    case DEC_BYTELEVEL: {
        PD_CHECK(bb_put(&d->pending, s, n));
        size_t k = pd_utf8_complete_prefix(d->pending.p, d->pending.n);
        if (k > 0) {
            PD_CHECK(bb_reserve(&d->out, 3 * k));
            d->out.n += pd_utf8_lossy(d->pending.p, k, d->out.p + d->out.n);
            d->out.p[d->out.n] = 0;
            memmove(d->pending.p, d->pending.p + k, d->pending.n - k);
            d->pending.n -= k;
        }
        break;
    }
    case DEC_NONE:
        if (d->n_tok > 0) PD_CHECK(bb_put(&d->out, " ", 1));
        PD_CHECK(bb_put(&d->out, s, n));
        break;
    default:
        if (t->dec_byte_fallback && (t->id_flags[id] & TOKF_BYTE)) {
            PD_CHECK(bb_put(&d->pending, &t->id_byte[id], 1));
            break;
        }
        PD_CHECK(emit_run(d));
        if (t->dec_meta_first && d->n_tok == 0) {
            /* first token: every "▁" dropped */
            const uint8_t *r = (const uint8_t *)t->id_str[id];
            size_t rn = t->id_len[id];
            for (size_t i = 0; i < rn;) {
                if (i + 3 <= rn && memcmp(r + i, META, 3) == 0) {
                    i += 3;
                    continue;
                }
                size_t j = i;
                while (j < rn && !(j + 3 <= rn && memcmp(r + j, META, 3) == 0)) j++;
                PD_CHECK(emit(d, r + i, j - i));
                i = j;
            }
        } else {
            PD_CHECK(emit(d, s, n));
        }
        break;
    }
    d->n_tok++;
    return 0;
}

int pd_detok_create(const pd_tok *tok, bool skip_special_tokens, const int32_t *prompt_ids,
                    size_t n_prompt, pd_detok **out)
{
    *out = NULL;
    for (size_t i = 0; i < n_prompt; i++) PD_CHECK(check_id(tok, prompt_ids[i]));
    pd_detok *d = calloc(1, sizeof *d);
    if (!d) return pd_error(PD_ENOMEM, "detokenizer: out of memory");
    d->t = tok;
    d->skip_special = skip_special_tokens;
    d->strip_left = tok->dec_mode == DEC_SPM ? tok->dec_strip : 0;
    int rc = bb_reserve(&d->out, 256);
    if (rc == 0) rc = bb_reserve(&d->pending, 16);
    for (size_t i = 0; i < n_prompt && rc == 0; i++) rc = feed(d, prompt_ids[i]);
    if (rc < 0) {
        pd_detok_free(d);
        return rc;
    }
    d->hidden = d->out.n;
    *out = d;
    return 0;
}

void pd_detok_free(pd_detok *d)
{
    if (!d) return;
    free(d->out.p);
    free(d->pending.p);
    free(d);
}

int pd_detok_copy_state(pd_detok *dst, const pd_detok *src)
{
    if (dst->t != src->t || dst->skip_special != src->skip_special)
        return pd_error(PD_EINVAL, "detokenizer: state copied from a different one");
    dst->out.n = dst->pending.n = 0;
    PD_CHECK(bb_put(&dst->out, src->out.p, src->out.n));
    PD_CHECK(bb_put(&dst->pending, src->pending.p, src->pending.n));
    dst->n_tok = src->n_tok;
    dst->strip_left = src->strip_left;
    dst->hidden = src->hidden;
    return 0;
}

int pd_detok_push(pd_detok *d, int32_t id, const char **delta, size_t *delta_len)
{
    *delta = "";
    *delta_len = 0;
    PD_CHECK(check_id(d->t, id));
    size_t before = d->out.n;
    PD_CHECK(feed(d, id));
    *delta = (const char *)d->out.p + before;
    *delta_len = d->out.n - before;
    return 0;
}

int pd_detok_flush(pd_detok *d, const char **delta, size_t *delta_len)
{
    size_t before = d->out.n;
    if (d->t->dec_mode == DEC_BYTELEVEL) {
        if (d->pending.n) {
            PD_CHECK(bb_reserve(&d->out, 3 * d->pending.n));
            d->out.n += pd_utf8_lossy(d->pending.p, d->pending.n, d->out.p + d->out.n);
            d->out.p[d->out.n] = 0;
            d->pending.n = 0;
        }
    } else {
        PD_CHECK(emit_run(d));
    }
    *delta = (const char *)d->out.p + before;
    *delta_len = d->out.n - before;
    return 0;
}

const char *pd_detok_text(const pd_detok *d, size_t *len)
{
    if (len) *len = d->out.n - d->hidden;
    return (const char *)d->out.p + d->hidden;
}
