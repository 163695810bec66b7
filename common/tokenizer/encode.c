/* Encoding: text -> token ids, in Hugging Face's order: split out added tokens
 * (leftmost-longest) -> normalize each remaining piece -> pre-tokenize into words -> BPE each
 * word -> post-process (BOS/EOS).
 *
 * Design: BPE keeps a word's symbols in a linked list and candidate merges in a binary heap
 * ordered by (rank, position), so a word of n symbols costs O(n log n) merge-table lookups;
 * inputs of 512 bytes or more also get a per-call word cache (words repeat a lot in natural
 * text). All scratch lives in a per-call context, so one pd_tok serves every thread.
 * Invalid UTF-8 is first read as U+FFFD per maximal invalid subpart.
 */
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tok_internal.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode.h"
#include "util/status.h"

static inline const pd_tok_merge *merge_find(const pd_tok *t, int32_t a, int32_t b)
{
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint32_t i = (uint32_t)merge_hash(key) & t->mmap_mask;
    for (;;) {
        const pd_tok_merge *m = &t->mmap[i];
        if (m->key == key) return m;
        if (m->key == UINT64_MAX) return NULL;
        i = (i + 1) & t->mmap_mask;
    }
}

/* ---- encoding ------------------------------------------------------------------------------ */

typedef struct {
    int32_t id;
    int32_t prev, next;  /* neighbour symbol indices, -1 at the ends */
    uint32_t start, len; /* bytes of the word this symbol covers */
} bpe_sym;

typedef struct {
    int32_t rank;
    int32_t pos;         /* left symbol index: ties go to the leftmost pair */
    int32_t left, right; /* ids at push time, to detect stale entries */
} bpe_cand;

typedef struct {
    uint64_t hash;
    uint32_t off, n;     /* ids in cache_ids[off, off+n) */
    uint32_t woff, wlen; /* word bytes in cache_words */
} cache_ent;

typedef struct {
    const pd_tok *t;
    int32_t *ids; /* (n_ids of cap) output */
    size_t n, cap;
    bpe_sym *syms;
    size_t sym_cap;
    bpe_cand *heap;
    size_t heap_cap;
    uint8_t *wbuf; /* byte-level mapped word (ignore_merges lookups) */
    size_t wcap;
    uint32_t *spans; /* pairs (start, end) of pre-tokenized words */
    size_t span_n, span_cap;
    /* word cache (long inputs only): open addressing, never evicts; cleared when full */
    cache_ent *cache;
    uint32_t cache_mask, cache_used;
    int32_t *cache_ids;
    size_t cache_ids_n, cache_ids_cap;
    uint8_t *cache_words;
    size_t cache_words_n, cache_words_cap;
} enc_ctx;

static int grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return 0;
    size_t nc = *cap ? *cap : 64;
    while (nc < need) nc *= 2;
    void *q = realloc(*p, nc * elem);
    if (!q) return pd_error(PD_ENOMEM, "tokenizer: out of memory");
    *p = q;
    *cap = nc;
    return 0;
}

static inline int push_id(enc_ctx *c, int32_t id)
{
    if (c->n == c->cap) PD_CHECK(grow((void **)&c->ids, &c->cap, c->n + 1, sizeof *c->ids));
    c->ids[c->n++] = id;
    return 0;
}

static inline bool cand_less(const bpe_cand *a, const bpe_cand *b)
{
    return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}

static void heap_push(bpe_cand *h, size_t *n, bpe_cand x)
{
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_less(&x, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = x;
}

static bpe_cand heap_pop(bpe_cand *h, size_t *n)
{
    bpe_cand top = h[0], x = h[--(*n)];
    size_t i = 0, m = *n;
    for (;;) {
        size_t l = 2 * i + 1;
        if (l >= m) break;
        size_t r = l + 1, k = (r < m && cand_less(&h[r], &h[l])) ? r : l;
        if (!cand_less(&h[k], &x)) break;
        h[i] = h[k];
        i = k;
    }
    if (m > 0) h[i] = x;
    return top;
}

static inline void try_pair(const pd_tok *t, bpe_sym *s, int32_t i, bpe_cand *h, size_t *hn)
{
    if (i < 0) return;
    int32_t j = s[i].next;
    if (j < 0 || s[i].id < 0 || s[j].id < 0) return;
    const pd_tok_merge *m = merge_find(t, s[i].id, s[j].id);
    if (m) heap_push(h, hn, (bpe_cand){m->rank, i, s[i].id, s[j].id});
}

/* BPE over the initial symbols c->syms[0..n); appends the resulting ids. */
static int bpe_run(enc_ctx *c, size_t n)
{
    const pd_tok *t = c->t;
    bpe_sym *s = c->syms;
    if (n > 1) {
        /* Each merge pushes at most 2 candidates: n + 2n bounds the heap. */
        PD_CHECK(grow((void **)&c->heap, &c->heap_cap, 3 * n, sizeof *c->heap));
        size_t hn = 0;
        for (size_t i = 0; i + 1 < n; i++) try_pair(t, s, (int32_t)i, c->heap, &hn);
        while (hn > 0) {
            bpe_cand x = heap_pop(c->heap, &hn);
            int32_t i = x.pos, j = s[i].next;
            if (s[i].len == 0 || j < 0 || s[i].id != x.left || s[j].id != x.right)
                continue; /* stale */
            const pd_tok_merge *m = merge_find(t, x.left, x.right);
            s[i].id = m->id;
            s[i].len += s[j].len;
            s[i].next = s[j].next;
            if (s[j].next >= 0) s[s[j].next].prev = i;
            s[j].len = 0;
            try_pair(t, s, s[i].prev, c->heap, &hn);
            try_pair(t, s, i, c->heap, &hn);
        }
    }
    bool last_unk = false;
    for (int32_t i = 0; i >= 0 && n > 0; i = s[i].next) {
        int32_t id = s[i].id;
        if (id < 0) continue; /* no unk token: the character is dropped, as Hugging Face does */
        bool is_unk = id == t->model_unk_id;
        if (!(is_unk && last_unk && t->fuse_unk)) PD_CHECK(push_id(c, id));
        last_unk = is_unk;
    }
    return 0;
}

static inline void add_sym(bpe_sym *s, size_t *n, int32_t id, uint32_t start, uint32_t len)
{
    size_t i = (*n)++;
    s[i].id = id;
    s[i].prev = (int32_t)i - 1;
    s[i].next = -1;
    if (i > 0) s[i - 1].next = (int32_t)i;
    s[i].start = start;
    s[i].len = len;
}

/* Encodes one pre-tokenized word w[0..n). */
static int encode_word_uncached(enc_ctx *c, const uint8_t *w, size_t n)
{
    const pd_tok *t = c->t;
    if (n == 0) return 0;
    if (t->mode == TOK_MODE_BYTELEVEL) {
        if (t->ignore_merges) {
            PD_CHECK(grow((void **)&c->wbuf, &c->wcap, 2 * n, 1));
            size_t k = 0;
            for (size_t i = 0; i < n; i++) {
                memcpy(c->wbuf + k, t->bl_enc[w[i]], 2);
                k += t->bl_enc_len[w[i]];
            }
            int32_t id = pd_tok_vocab_find(t, (const char *)c->wbuf, k);
            if (id >= 0) return push_id(c, id);
        }
        PD_CHECK(grow((void **)&c->syms, &c->sym_cap, n, sizeof *c->syms));
        size_t ns = 0;
        for (size_t i = 0; i < n; i++)
            add_sym(c->syms, &ns, t->byte_tok[w[i]] >= 0 ? t->byte_tok[w[i]] : t->model_unk_id,
                    (uint32_t)i, 1);
        return bpe_run(c, ns);
    }
    if (t->ignore_merges) {
        int32_t id = pd_tok_vocab_find(t, (const char *)w, n);
        if (id >= 0) return push_id(c, id);
    }
    PD_CHECK(grow((void **)&c->syms, &c->sym_cap, n, sizeof *c->syms));
    size_t ns = 0;
    for (size_t i = 0; i < n;) {
        if (w[i] < 0x80 && t->ascii_tok[w[i]] >= 0) {
            add_sym(c->syms, &ns, t->ascii_tok[w[i]], (uint32_t)i, 1);
            i++;
            continue;
        }
        uint32_t cp;
        bool ok;
        size_t k = pd_utf8_decode(w + i, n - i, &cp, &ok);
        int32_t id = pd_tok_vocab_find(t, (const char *)w + i, k);
        if (id >= 0) {
            add_sym(c->syms, &ns, id, (uint32_t)i, (uint32_t)k);
        } else {
            bool all = t->byte_fallback;
            for (size_t b = 0; all && b < k; b++) all = t->byte_tok[w[i + b]] >= 0;
            if (all) {
                for (size_t b = 0; b < k; b++)
                    add_sym(c->syms, &ns, t->byte_tok[w[i + b]], (uint32_t)(i + b), 1);
            } else {
                add_sym(c->syms, &ns, t->model_unk_id, (uint32_t)i, (uint32_t)k);
            }
        }
        i += k;
    }
    return bpe_run(c, ns);
}

/* Cache slots scale with the input (about one per 8 bytes, 256..16384). */
static int cache_init(enc_ctx *c, size_t text_len)
{
    size_t slots = 256;
    while (slots < text_len / 8 && slots < 16384) slots *= 2;
    c->cache_mask = (uint32_t)slots - 1;
    c->cache = calloc(slots, sizeof *c->cache);
    if (!c->cache) return pd_error(PD_ENOMEM, "tokenizer: out of memory");
    return 0;
}

static int encode_word(enc_ctx *c, const uint8_t *w, size_t n)
{
    if (!c->cache || n > 64) return encode_word_uncached(c, w, n);
    uint64_t h = pd_tok_hash(w, n) | 1; /* 0 marks an empty slot */
    uint32_t i = (uint32_t)h & c->cache_mask;
    for (;;) {
        cache_ent *e = &c->cache[i];
        if (e->hash == 0) break;
        if (e->hash == h && e->wlen == n && memcmp(c->cache_words + e->woff, w, n) == 0) {
            PD_CHECK(grow((void **)&c->ids, &c->cap, c->n + e->n, sizeof *c->ids));
            memcpy(c->ids + c->n, c->cache_ids + e->off, e->n * sizeof *c->ids);
            c->n += e->n;
            return 0;
        }
        i = (i + 1) & c->cache_mask;
    }
    size_t before = c->n;
    PD_CHECK(encode_word_uncached(c, w, n));
    if (c->cache_used * 2 >= c->cache_mask) { /* half full: start over */
        memset(c->cache, 0, ((size_t)c->cache_mask + 1) * sizeof *c->cache);
        c->cache_used = 0;
        c->cache_ids_n = c->cache_words_n = 0;
        i = (uint32_t)h & c->cache_mask;
    }
    size_t k = c->n - before;
    PD_CHECK(grow((void **)&c->cache_ids, &c->cache_ids_cap, c->cache_ids_n + k, sizeof(int32_t)));
    PD_CHECK(grow((void **)&c->cache_words, &c->cache_words_cap, c->cache_words_n + n, 1));
    cache_ent *e = &c->cache[i];
    e->hash = h;
    e->off = (uint32_t)c->cache_ids_n;
    e->n = (uint32_t)k;
    e->woff = (uint32_t)c->cache_words_n;
    e->wlen = (uint32_t)n;
    memcpy(c->cache_ids + c->cache_ids_n, c->ids + before, k * sizeof(int32_t));
    memcpy(c->cache_words + c->cache_words_n, w, n);
    c->cache_ids_n += k;
    c->cache_words_n += n;
    c->cache_used++;
    return 0;
}

static int push_span(enc_ctx *c, size_t a, size_t b)
{
    if (a >= b) return 0;
    PD_CHECK(grow((void **)&c->spans, &c->span_cap, 2 * (c->span_n + 1), sizeof *c->spans));
    c->spans[2 * c->span_n] = (uint32_t)a;
    c->spans[2 * c->span_n + 1] = (uint32_t)b;
    c->span_n++;
    return 0;
}

/* Replaces every occurrence of pat in s with rep; result malloc'd. */
static int replace_all(const uint8_t *s, size_t n, const char *pat, size_t plen, const char *rep,
                       size_t rlen, uint8_t **out, size_t *out_len)
{
    size_t count = 0;
    for (size_t i = 0; i + plen <= n;) {
        if (memcmp(s + i, pat, plen) == 0) {
            count++;
            i += plen;
        } else {
            i++;
        }
    }
    size_t cap = n + count * rlen + 1;
    uint8_t *o = malloc(cap);
    if (!o) return pd_error(PD_ENOMEM, "tokenizer: out of memory");
    size_t k = 0;
    for (size_t i = 0; i < n;) {
        if (i + plen <= n && memcmp(s + i, pat, plen) == 0) {
            memcpy(o + k, rep, rlen);
            k += rlen;
            i += plen;
        } else {
            o[k++] = s[i++];
        }
    }
    o[k] = 0;
    *out = o;
    *out_len = k;
    return 0;
}

/* Runs the normalizer steps over s; *out is always a malloc'd copy (caller frees). */
int pd_tok_normalize(const pd_tok *t, const uint8_t *s, size_t n, uint8_t **out, size_t *out_len)
{
    uint8_t *cur = malloc(n + 1);
    if (!cur) return pd_error(PD_ENOMEM, "tokenizer: out of memory");
    memcpy(cur, s, n);
    cur[n] = 0;
    size_t len = n;
    for (int i = 0; i < t->n_norm; i++) {
        const pd_tok_norm *x = &t->norm[i];
        uint8_t *next = NULL;
        size_t nl = 0;
        int rc = 0;
        if (x->kind == NORM_PREPEND) {
            if (len == 0) continue;
            next = malloc(len + x->alen + 1);
            if (!next) {
                rc = pd_error(PD_ENOMEM, "tokenizer: out of memory");
            } else {
                memcpy(next, x->a, x->alen);
                memcpy(next + x->alen, cur, len);
                nl = len + x->alen;
                next[nl] = 0;
            }
        } else if (x->kind == NORM_REPLACE) {
            rc = replace_all(cur, len, x->a, x->alen, x->b, x->blen, &next, &nl);
        } else {
            rc = pd_uc_nfc(cur, len, &next, &nl);
            if (rc == 0 && !next) continue; /* already NFC */
        }
        if (rc < 0) {
            free(cur);
            return rc;
        }
        free(cur);
        cur = next;
        len = nl;
    }
    *out = cur;
    *out_len = len;
    return 0;
}

/* Pre-tokenizes s[0..n) (after normalization) into words and encodes each. first_section:
 * the piece is the first of the input (Metaspace prepend_scheme "first"). */
static int pretokenize_and_encode(enc_ctx *c, const uint8_t *s, size_t n, bool first_section)
{
    const pd_tok *t = c->t;
    uint8_t *owned = NULL; /* text rebuilt by a step (prefix spaces, metaspace) */
    int rc = 0;
    c->span_n = 0;
    PD_CHECK(push_span(c, 0, n));
    for (int p = 0; p < t->n_pre && rc == 0; p++) {
        const pd_tok_pre *x = &t->pre[p];
        bool rebuild =
            (x->kind == PRE_BYTELEVEL && x->add_prefix_space) || x->kind == PRE_METASPACE;
        if (rebuild) {
            /* Rebuild the text span by span: ByteLevel adds " " before a word that lacks
             * one; Metaspace replaces " " with the replacement and prepends it. */
            size_t cap = 0;
            for (size_t k = 0; k < c->span_n; k++)
                cap += (c->spans[2 * k + 1] - c->spans[2 * k]) *
                           (x->kind == PRE_METASPACE ? x->repl_len : 1) +
                       8;
            uint8_t *nb = malloc(cap + 1);
            uint32_t *ns = malloc((2 * c->span_n + 2) * sizeof *ns);
            if (!nb || !ns) {
                free(nb);
                free(ns);
                rc = pd_error(PD_ENOMEM, "tokenizer: out of memory");
                break;
            }
            size_t k2 = 0;
            for (size_t k = 0; k < c->span_n; k++) {
                const uint8_t *w = s + c->spans[2 * k];
                size_t wl = c->spans[2 * k + 1] - c->spans[2 * k];
                ns[2 * k] = (uint32_t)k2;
                if (x->kind == PRE_BYTELEVEL) {
                    if (wl == 0 || w[0] != ' ') nb[k2++] = ' ';
                    memcpy(nb + k2, w, wl);
                    k2 += wl;
                } else {
                    bool starts = wl >= x->repl_len && memcmp(w, x->repl, x->repl_len) == 0;
                    bool starts_space = wl > 0 && w[0] == ' ';
                    bool prepend =
                        !starts && !starts_space &&
                        (x->prepend_scheme == PREPEND_ALWAYS ||
                         (x->prepend_scheme == PREPEND_FIRST && first_section && k == 0));
                    if (prepend) {
                        memcpy(nb + k2, x->repl, x->repl_len);
                        k2 += x->repl_len;
                    }
                    for (size_t i = 0; i < wl; i++) {
                        if (w[i] == ' ') {
                            memcpy(nb + k2, x->repl, x->repl_len);
                            k2 += x->repl_len;
                        } else {
                            nb[k2++] = w[i];
                        }
                    }
                }
                ns[2 * k + 1] = (uint32_t)k2;
            }
            free(owned);
            owned = nb;
            s = nb;
            n = k2;
            memcpy(c->spans, ns, 2 * c->span_n * sizeof *ns);
            free(ns);
        }
        int rx = x->kind == PRE_METASPACE ? -1 : x->regex;
        bool msplit = x->kind == PRE_METASPACE && x->split;
        if (rx < 0 && !msplit) continue;
        /* Split every span; new spans are appended after the old ones, then moved down. */
        size_t old = c->span_n;
        for (size_t k = 0; k < old && rc == 0; k++) {
            size_t a = c->spans[2 * k], b = c->spans[2 * k + 1];
            if (rx >= 0) {
                for (size_t i = a; i < b && rc == 0;) {
                    size_t e = pd_tok_rx_match(rx, s + a, b - a, i - a) + a;
                    rc = push_span(c, i, e);
                    i = e;
                }
            } else {
                /* Metaspace split: a new word starts at each replacement char. */
                size_t st = a;
                for (size_t i = a + 1; i + x->repl_len <= b && rc == 0; i++) {
                    if (memcmp(s + i, x->repl, x->repl_len) == 0) {
                        rc = push_span(c, st, i);
                        st = i;
                    }
                }
                if (rc == 0) rc = push_span(c, st, b);
            }
        }
        if (rc == 0) {
            memmove(c->spans, c->spans + 2 * old, 2 * (c->span_n - old) * sizeof *c->spans);
            c->span_n -= old;
        }
    }
    for (size_t k = 0; k < c->span_n && rc == 0; k++) {
        const uint8_t *w = s + c->spans[2 * k];
        size_t wl = c->spans[2 * k + 1] - c->spans[2 * k];
        if (!t->spm_split) {
            rc = encode_word(c, w, wl);
            continue;
        }
        size_t st = 0;
        for (size_t i = 1; i + 3 <= wl && rc == 0; i++) {
            if (w[i] == 0xE2 && w[i + 1] == 0x96 && w[i + 2] == 0x81 &&
                !(i >= 3 && w[i - 3] == 0xE2 && w[i - 2] == 0x96 && w[i - 1] == 0x81)) {
                rc = encode_word(c, w + st, i - st);
                st = i;
            }
        }
        if (rc == 0) rc = encode_word(c, w + st, wl - st);
    }
    free(owned);
    return rc;
}

static bool is_ws_byte_at(const uint8_t *s, size_t n, size_t i, size_t *len)
{
    uint32_t cp;
    bool ok;
    *len = pd_utf8_decode(s + i, n - i, &cp, &ok);
    return pd_uc_class(cp) & PD_UC_S;
}

static bool is_word_char(uint32_t cp)
{
    return cp == '_' || (pd_uc_class(cp) & (PD_UC_L | PD_UC_N));
}

/* Finds the leftmost-longest added token in s[from..n) among raw (normalized=false) or
 * normalized tokens. Returns its index in t->added or -1; *at = match start. */
static int find_added(const pd_tok *t, const uint8_t *s, size_t n, size_t from, bool normalized,
                      size_t *at)
{
    for (size_t i = from; i < n; i++) {
        if (!normalized && !(t->added_first[s[i] >> 3] & (1u << (s[i] & 7)))) continue;
        for (int k = 0; k < t->n_added; k++) { /* longest first */
            const pd_tok_added *a = &t->added[k];
            if (a->normalized != normalized) continue;
            const char *cs = normalized ? a->ns : a->s;
            size_t cl = normalized ? a->nlen : a->len;
            if (cl > n - i || memcmp(s + i, cs, cl) != 0) continue;
            if (a->single_word) {
                uint32_t cp;
                bool ok;
                if (i > 0) {
                    size_t b = i - 1;
                    while (b > 0 && (s[b] & 0xC0) == 0x80) b--;
                    pd_utf8_decode(s + b, n - b, &cp, &ok);
                    if (is_word_char(cp)) continue;
                }
                if (i + cl < n) {
                    pd_utf8_decode(s + i + cl, n - i - cl, &cp, &ok);
                    if (is_word_char(cp)) continue;
                }
            }
            *at = i;
            return k;
        }
    }
    return -1;
}

/* Splits s by added tokens, calling fn on the pieces between them; lstrip/rstrip tokens
 * swallow the whitespace next to them. */
static int split_added(enc_ctx *c, const uint8_t *s, size_t n, bool normalized,
                       int (*fn)(enc_ctx *, const uint8_t *, size_t, bool), bool first)
{
    const pd_tok *t = c->t;
    size_t pos = 0;
    bool piece_first = first;
    while (pos <= n) {
        size_t at = n;
        int k = (t->n_added > 0) ? find_added(t, s, n, pos, normalized, &at) : -1;
        if (k < 0) {
            if (pos < n) PD_CHECK(fn(c, s + pos, n - pos, piece_first));
            return 0;
        }
        const pd_tok_added *a = &t->added[k];
        size_t end = at + (normalized ? a->nlen : a->len), piece_end = at, len;
        if (a->lstrip) {
            while (piece_end > pos) {
                size_t b = piece_end - 1;
                while (b > pos && (s[b] & 0xC0) == 0x80) b--;
                if (!is_ws_byte_at(s, n, b, &len)) break;
                piece_end = b;
            }
        }
        if (piece_end > pos) PD_CHECK(fn(c, s + pos, piece_end - pos, piece_first));
        PD_CHECK(push_id(c, a->id));
        piece_first = false;
        if (a->rstrip)
            while (end < n && is_ws_byte_at(s, n, end, &len)) end += len;
        pos = end;
    }
    return 0;
}

static int encode_normalized_piece(enc_ctx *c, const uint8_t *s, size_t n, bool first)
{
    return pretokenize_and_encode(c, s, n, first);
}

static int encode_raw_piece(enc_ctx *c, const uint8_t *s, size_t n, bool first)
{
    const pd_tok *t = c->t;
    if (t->n_norm == 0) return pretokenize_and_encode(c, s, n, first);
    uint8_t *ns;
    size_t nl;
    PD_CHECK(pd_tok_normalize(t, s, n, &ns, &nl));
    int rc = t->any_normalized_added ? split_added(c, ns, nl, true, encode_normalized_piece, first)
                                     : pretokenize_and_encode(c, ns, nl, first);
    free(ns);
    return rc;
}

static bool utf8_valid(const uint8_t *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        uint32_t cp;
        bool ok;
        i += pd_utf8_decode(s + i, n - i, &cp, &ok);
        if (!ok) return false;
    }
    return true;
}

int pd_tok_encode(const pd_tok *t, const char *text, size_t len, bool add_special_tokens,
                  int32_t **ids, size_t *n_ids)
{
    *ids = NULL;
    *n_ids = 0;
    if (!text && len > 0) return pd_error(PD_EINVAL, "pd_tok_encode: text is NULL");
    if (len > UINT32_MAX / 16) /* offsets are 32-bit; normalization may expand 3x */
        return pd_error(PD_ERANGE, "pd_tok_encode: text of %zu bytes is too long", len);
    enc_ctx c = {.t = t};
    int rc = 0;
    const uint8_t *s = (const uint8_t *)text;
    uint8_t *fixed = NULL;
    if (!utf8_valid(s, len)) {
        fixed = malloc(3 * len + 1);
        if (!fixed) return pd_error(PD_ENOMEM, "tokenizer: out of memory");
        len = pd_utf8_lossy(s, len, fixed);
        s = fixed;
    }
    if (len >= 512) PD_CHECK_GOTO(cache_init(&c, len), rc, out);
    PD_CHECK_GOTO(grow((void **)&c.ids, &c.cap, len / 3 + 8, sizeof *c.ids), rc, out);
    if (add_special_tokens)
        for (int i = 0; i < t->n_post_pre; i++) PD_CHECK_GOTO(push_id(&c, t->post_pre[i]), rc, out);
    PD_CHECK_GOTO(split_added(&c, s, len, false, encode_raw_piece, true), rc, out);
    if (add_special_tokens)
        for (int i = 0; i < t->n_post_suf; i++) PD_CHECK_GOTO(push_id(&c, t->post_suf[i]), rc, out);
out:
    free(fixed);
    free(c.syms);
    free(c.heap);
    free(c.wbuf);
    free(c.spans);
    free(c.cache);
    free(c.cache_ids);
    free(c.cache_words);
    if (rc < 0) {
        free(c.ids);
        return rc;
    }
    *ids = c.ids;
    *n_ids = c.n;
    return 0;
}

/* Where a prefix of about w bytes of s (n bytes) ends: after an ASCII space or newline within
 * the last 256 bytes before w when there is one, else at the start of a UTF-8 character. */
static size_t prefix_cut(const uint8_t *s, size_t n, size_t w)
{
    if (w >= n) return n;
    for (size_t i = w; i > 0 && i + 256 > w; i--)
        if (s[i - 1] == ' ' || s[i - 1] == '\n') return i;
    while (w > 0 && (s[w] & 0xC0) == 0x80) w--;
    return w;
}

int pd_tok_encode_max(const pd_tok *t, const char *text, size_t len, bool add_special_tokens,
                      size_t max_ids, int32_t **ids, size_t *n_ids, bool *more)
{
    /* A cut changes the tokens of the word it falls in and of its neighbours at most: the
     * prefix's count less ENCODE_CUT_SLACK is a lower bound of the whole text's. */
    enum { ENCODE_CUT_SLACK = 16 };
    *more = false;
    size_t w = 8 * (max_ids + ENCODE_CUT_SLACK) + 4096;
    for (;;) {
        size_t cut = prefix_cut((const uint8_t *)text, len, w);
        PD_CHECK(pd_tok_encode(t, text, cut, add_special_tokens, ids, n_ids));
        if (cut == len) return 0;
        size_t suffix = add_special_tokens ? (size_t)t->n_post_suf : 0;
        if (*n_ids > max_ids + ENCODE_CUT_SLACK + suffix) {
            *n_ids -= ENCODE_CUT_SLACK + suffix;
            free(*ids);
            *ids = NULL;
            *more = true;
            return 0;
        }
        free(*ids);
        *ids = NULL;
        w = w > SIZE_MAX / 4 ? SIZE_MAX : 4 * w;
    }
}
