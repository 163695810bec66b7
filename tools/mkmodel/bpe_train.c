/* Byte-level BPE trainer (see bpe_train.h).
 *
 * Design: the classic incremental algorithm. The text is split into words the way GPT-2's
 * pre-tokenizer regex would split ASCII, identical words are counted once with a frequency,
 * and pair counts live in a hash map whose entries also list the words holding the pair. Each
 * merge rewrites only the words that contain the chosen pair; a max-heap with lazy deletion
 * (stale entries are re-checked when popped) picks the next pair in O(log n). Ties break on the
 * smaller (left id, right id), so training is deterministic.
 *
 * The built-in corpus yields a few thousand merges; larger vocabularies (the 1b preset's 32000)
 * come from pseudo-words generated from syllables by a fixed-seed PRNG. English words weigh
 * far more than pseudo-words, so English merges come first.
 */
#include "bpe_train.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "json/json.h"
#include "util/hash.h"
#include "util/status.h"

#define ENGLISH_WEIGHT 1000 /* frequency of one corpus occurrence */

typedef struct {
    uint8_t *bytes;
    int32_t len;
} token;

typedef struct {
    int32_t *sym;
    int32_t len;
    int64_t freq;
    uint32_t stamp; /* last merge that rewrote it */
} word;

typedef struct {
    uint64_t key; /* (left << 32) | right */
    int64_t count;
    int32_t *words; /* indices of words that held the pair when it was added (may repeat) */
    int32_t n_words, cap_words;
    uint32_t stamp;
    bool used;
} pair_ent;

typedef struct {
    int64_t count;
    uint64_t key;
} heap_ent;

struct bpe_model {
    token *tokens;
    int64_t n_tokens, cap_tokens;
    uint64_t *merges; /* (left << 32) | right, in merge order */
    int64_t n_merges, cap_merges;
};

typedef struct {
    bpe_model *m;
    word *words;
    int64_t n_words, cap_words;
    int32_t *word_index; /* open addressing over words by bytes; value idx + 1 */
    size_t word_index_cap;
    pair_ent *pairs;
    size_t pairs_cap, pairs_used;
    heap_ent *heap;
    size_t heap_n, heap_cap;
    int32_t *tok_index; /* token bytes -> id + 1 */
    size_t tok_index_cap;
} trainer;

static uint64_t hash_bytes(const void *p, size_t n)
{
    const uint8_t *b = p;
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

static int oom(void)
{
    return pd_error(PD_ENOMEM, "bpe: out of memory");
}

static int grow(void **p, int64_t *cap, int64_t need, size_t elem)
{
    if (need <= *cap) return PD_OK;
    int64_t nc = *cap ? *cap * 2 : 64;
    while (nc < need) nc *= 2;
    void *q = realloc(*p, (size_t)nc * elem);
    if (!q) return oom();
    *p = q;
    *cap = nc;
    return PD_OK;
}

/* ---- tokens ------------------------------------------------------------------------------ */

static int32_t tok_lookup(const trainer *t, const uint8_t *b, int32_t len)
{
    size_t mask = t->tok_index_cap - 1;
    size_t h = (size_t)hash_bytes(b, (size_t)len) & mask;
    while (t->tok_index[h]) {
        const token *k = &t->m->tokens[t->tok_index[h] - 1];
        if (k->len == len && memcmp(k->bytes, b, (size_t)len) == 0) return t->tok_index[h] - 1;
        h = (h + 1) & mask;
    }
    return -1;
}

static int tok_index_insert(trainer *t, int32_t id)
{
    if ((size_t)(t->m->n_tokens * 2) > t->tok_index_cap) {
        size_t cap = t->tok_index_cap ? t->tok_index_cap * 2 : 1024;
        while (cap < (size_t)t->m->n_tokens * 2) cap *= 2;
        int32_t *idx = calloc(cap, sizeof *idx);
        if (!idx) return oom();
        free(t->tok_index);
        t->tok_index = idx;
        t->tok_index_cap = cap;
        for (int64_t i = 0; i < t->m->n_tokens; i++) {
            if (i == id) continue;
            const token *k = &t->m->tokens[i];
            size_t h = (size_t)hash_bytes(k->bytes, (size_t)k->len) & (cap - 1);
            while (idx[h]) h = (h + 1) & (cap - 1);
            idx[h] = (int32_t)i + 1;
        }
    }
    const token *k = &t->m->tokens[id];
    size_t mask = t->tok_index_cap - 1;
    size_t h = (size_t)hash_bytes(k->bytes, (size_t)k->len) & mask;
    while (t->tok_index[h]) h = (h + 1) & mask;
    t->tok_index[h] = id + 1;
    return PD_OK;
}

static int tok_add(trainer *t, const uint8_t *b, int32_t len, int32_t *id)
{
    bpe_model *m = t->m;
    PD_CHECK(grow((void **)&m->tokens, &m->cap_tokens, m->n_tokens + 1, sizeof *m->tokens));
    uint8_t *c = malloc((size_t)len);
    if (!c) return oom();
    memcpy(c, b, (size_t)len);
    m->tokens[m->n_tokens].bytes = c;
    m->tokens[m->n_tokens].len = len;
    *id = (int32_t)m->n_tokens;
    m->n_tokens++;
    return tok_index_insert(t, *id);
}

/* ---- words ------------------------------------------------------------------------------- */

static int word_add(trainer *t, const char *s, size_t len, int64_t freq)
{
    if (len == 0) return PD_OK;
    if ((size_t)(t->n_words + 1) * 2 > t->word_index_cap) {
        size_t cap = t->word_index_cap ? t->word_index_cap * 2 : 4096;
        int32_t *idx = calloc(cap, sizeof *idx);
        if (!idx) return oom();
        for (int64_t i = 0; i < t->n_words; i++) {
            const word *w = &t->words[i];
            uint8_t buf[256];
            for (int32_t j = 0; j < w->len; j++) buf[j] = (uint8_t)w->sym[j];
            size_t h = (size_t)hash_bytes(buf, (size_t)w->len) & (cap - 1);
            while (idx[h]) h = (h + 1) & (cap - 1);
            idx[h] = (int32_t)i + 1;
        }
        free(t->word_index);
        t->word_index = idx;
        t->word_index_cap = cap;
    }
    if (len > 255) len = 255; /* pieces are short; a pathological run is truncated */
    size_t mask = t->word_index_cap - 1;
    size_t h = (size_t)hash_bytes(s, len) & mask;
    while (t->word_index[h]) {
        word *w = &t->words[t->word_index[h] - 1];
        bool same = (size_t)w->len == len;
        for (size_t j = 0; same && j < len; j++) same = w->sym[j] == (uint8_t)s[j];
        if (same) {
            w->freq += freq;
            return PD_OK;
        }
        h = (h + 1) & mask;
    }
    PD_CHECK(grow((void **)&t->words, &t->cap_words, t->n_words + 1, sizeof *t->words));
    word *w = &t->words[t->n_words];
    w->sym = malloc(len * sizeof *w->sym);
    if (!w->sym) return oom();
    for (size_t j = 0; j < len; j++) w->sym[j] = (uint8_t)s[j]; /* byte b is token id b */
    w->len = (int32_t)len;
    w->freq = freq;
    w->stamp = 0;
    t->word_index[h] = (int32_t)t->n_words + 1;
    t->n_words++;
    return PD_OK;
}

static bool is_sp(unsigned char c)
{
    return c == ' ' || (c >= '\t' && c <= '\r');
}
static bool is_letter(unsigned char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c >= 0x80;
}
static bool is_digit(unsigned char c)
{
    return c >= '0' && c <= '9';
}

/* End of the piece starting at i: GPT-2's pattern
 * 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ over ASCII. */
static size_t next_piece(const unsigned char *s, size_t n, size_t i)
{
    if (s[i] == '\'' && i + 1 < n) {
        static const char *const k[] = {"re", "ve", "ll", "s", "t", "m", "d"};
        for (size_t q = 0; q < sizeof k / sizeof k[0]; q++) {
            size_t l = strlen(k[q]);
            if (i + 1 + l <= n && memcmp(s + i + 1, k[q], l) == 0) return i + 1 + l;
        }
    }
    size_t j = i;
    if (s[i] == ' ' && i + 1 < n && !is_sp(s[i + 1])) j = i + 1;
    if (is_letter(s[j])) {
        while (j < n && is_letter(s[j])) j++;
        return j;
    }
    if (is_digit(s[j])) {
        while (j < n && is_digit(s[j])) j++;
        return j;
    }
    if (!is_sp(s[j])) {
        while (j < n && !is_sp(s[j]) && !is_letter(s[j]) && !is_digit(s[j])) j++;
        return j;
    }
    size_t k = i;
    while (k < n && is_sp(s[k])) k++;
    if (k < n && k - i > 1) return k - 1; /* \s+(?!\S): leave the last one to the next piece */
    return k;
}

static int add_text(trainer *t, const char *text, size_t len)
{
    const unsigned char *s = (const unsigned char *)text;
    for (size_t i = 0; i < len;) {
        size_t e = next_piece(s, len, i);
        PD_CHECK(word_add(t, text + i, e - i, ENGLISH_WEIGHT));
        i = e;
    }
    return PD_OK;
}

/* Deterministic pseudo-words: 1-4 syllables, mostly with a leading space, Zipf-like weights. */
static int add_pseudo_words(trainer *t, int64_t count)
{
    static const char *const onset[] = {
        "b", "c", "d",  "f",  "g",  "h",  "j",  "k",  "l",  "m",  "n",  "p",  "r",  "s",  "t", "v",
        "w", "z", "br", "cl", "dr", "st", "tr", "sh", "ch", "th", "gr", "pl", "qu", "sc", "",  "y"};
    static const char *const vowel[] = {"a", "e", "i", "o", "u", "ai", "ea", "ou", "io", "y"};
    static const char *const coda[] = {"",  "",   "",   "n",  "r", "s",  "l",  "m",
                                       "t", "nd", "st", "rk", "x", "ng", "ck", "ph"};
    uint64_t st = 0x5eed0bbe0000ull;
    for (int64_t i = 0; i < count; i++) {
        char buf[64];
        size_t n = 0;
        uint64_t r = pd_mix64(st += 0x9e3779b97f4a7c15ull);
        if (r % 100 < 85) buf[n++] = ' ';
        bool cap = (r >> 8) % 10 == 0;
        int syl = 1 + (int)((r >> 16) % 4);
        for (int k = 0; k < syl; k++) {
            uint64_t q = pd_mix64(st += 0x9e3779b97f4a7c15ull);
            const char *parts[3] = {onset[q % 32], vowel[(q >> 8) % 10], coda[(q >> 16) % 16]};
            for (int p = 0; p < 3; p++)
                for (const char *c = parts[p]; *c; c++) buf[n++] = *c;
        }
        size_t first = buf[0] == ' ' ? 1 : 0;
        if (cap && n > first && buf[first] >= 'a' && buf[first] <= 'z') buf[first] -= 32;
        int64_t freq = 1 + 64 / (i + 1);
        PD_CHECK(word_add(t, buf, n, freq));
    }
    return PD_OK;
}

/* ---- pair map and heap --------------------------------------------------------------------- */

static size_t pair_slot(const trainer *t, uint64_t key)
{
    size_t mask = t->pairs_cap - 1;
    size_t h = (size_t)pd_mix64(key) & mask;
    while (t->pairs[h].used && t->pairs[h].key != key) h = (h + 1) & mask;
    return h;
}

static pair_ent *pair_get(trainer *t, uint64_t key)
{
    size_t h = pair_slot(t, key);
    return t->pairs[h].used ? &t->pairs[h] : NULL;
}

/* Finds or inserts; the pointer is valid until the next insert. */
static int pair_upsert(trainer *t, uint64_t key, pair_ent **out)
{
    if ((t->pairs_used + 1) * 2 > t->pairs_cap) {
        size_t cap = t->pairs_cap ? t->pairs_cap * 2 : 1 << 14;
        pair_ent *np = calloc(cap, sizeof *np);
        if (!np) return oom();
        for (size_t i = 0; i < t->pairs_cap; i++) {
            if (!t->pairs[i].used) continue;
            size_t h = (size_t)pd_mix64(t->pairs[i].key) & (cap - 1);
            while (np[h].used) h = (h + 1) & (cap - 1);
            np[h] = t->pairs[i];
        }
        free(t->pairs);
        t->pairs = np;
        t->pairs_cap = cap;
    }
    size_t h = pair_slot(t, key);
    if (!t->pairs[h].used) {
        memset(&t->pairs[h], 0, sizeof t->pairs[h]);
        t->pairs[h].used = true;
        t->pairs[h].key = key;
        t->pairs_used++;
    }
    *out = &t->pairs[h];
    return PD_OK;
}

static int pair_add_word(pair_ent *e, int32_t w)
{
    if (e->n_words == e->cap_words) {
        int32_t nc = e->cap_words ? e->cap_words * 2 : 4;
        int32_t *q = realloc(e->words, (size_t)nc * sizeof *q);
        if (!q) return oom();
        e->words = q;
        e->cap_words = nc;
    }
    e->words[e->n_words++] = w;
    return PD_OK;
}

static bool heap_less(const heap_ent *x, const heap_ent *y) /* x has lower priority than y */
{
    if (x->count != y->count) return x->count < y->count;
    return x->key > y->key;
}

static int heap_push(trainer *t, int64_t count, uint64_t key)
{
    if (t->heap_n == t->heap_cap) {
        size_t nc = t->heap_cap ? t->heap_cap * 2 : 1 << 14;
        heap_ent *q = realloc(t->heap, nc * sizeof *q);
        if (!q) return oom();
        t->heap = q;
        t->heap_cap = nc;
    }
    size_t i = t->heap_n++;
    t->heap[i] = (heap_ent){count, key};
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!heap_less(&t->heap[p], &t->heap[i])) break;
        heap_ent tmp = t->heap[p];
        t->heap[p] = t->heap[i];
        t->heap[i] = tmp;
        i = p;
    }
    return PD_OK;
}

static heap_ent heap_pop(trainer *t)
{
    heap_ent top = t->heap[0];
    t->heap[0] = t->heap[--t->heap_n];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, b = i;
        if (l < t->heap_n && heap_less(&t->heap[b], &t->heap[l])) b = l;
        if (r < t->heap_n && heap_less(&t->heap[b], &t->heap[r])) b = r;
        if (b == i) break;
        heap_ent tmp = t->heap[b];
        t->heap[b] = t->heap[i];
        t->heap[i] = tmp;
        i = b;
    }
    return top;
}

#define PAIR_KEY(a, b) (((uint64_t)(uint32_t)(a) << 32) | (uint32_t)(b))

/* ---- training ---------------------------------------------------------------------------- */

static int merge_once(trainer *t, uint64_t key, uint32_t stamp, int64_t **touched,
                      int64_t *cap_touched)
{
    bpe_model *m = t->m;
    int32_t a = (int32_t)(key >> 32), b = (int32_t)(key & 0xffffffffu);
    const token *ta = &m->tokens[a], *tb = &m->tokens[b];
    int32_t len = ta->len + tb->len;
    uint8_t *buf = malloc((size_t)len);
    if (!buf) return oom();
    memcpy(buf, ta->bytes, (size_t)ta->len);
    memcpy(buf + ta->len, tb->bytes, (size_t)tb->len);
    int32_t c = tok_lookup(t, buf, len);
    int rc = PD_OK;
    if (c < 0) rc = tok_add(t, buf, len, &c);
    free(buf);
    PD_CHECK(rc);
    PD_CHECK(grow((void **)&m->merges, &m->cap_merges, m->n_merges + 1, sizeof *m->merges));
    m->merges[m->n_merges++] = key;

    pair_ent *e = pair_get(t, key);
    int32_t *list = e->words;
    int32_t n_list = e->n_words;
    e->words = NULL;
    e->n_words = e->cap_words = 0;
    int64_t n_touched = 0;
    for (int32_t li = 0; li < n_list; li++) {
        word *w = &t->words[list[li]];
        if (w->stamp == stamp) continue;
        w->stamp = stamp;
        bool has = false;
        for (int32_t i = 0; i + 1 < w->len && !has; i++) has = w->sym[i] == a && w->sym[i + 1] == b;
        if (!has) continue;
        for (int32_t i = 0; i + 1 < w->len; i++)
            pair_get(t, PAIR_KEY(w->sym[i], w->sym[i + 1]))->count -= w->freq;
        int32_t o = 0;
        for (int32_t r = 0; r < w->len;) {
            if (r + 1 < w->len && w->sym[r] == a && w->sym[r + 1] == b) {
                w->sym[o++] = c;
                r += 2;
            } else {
                w->sym[o++] = w->sym[r++];
            }
        }
        w->len = o;
        for (int32_t i = 0; i + 1 < w->len; i++) {
            uint64_t k = PAIR_KEY(w->sym[i], w->sym[i + 1]);
            pair_ent *p;
            PD_CHECK_GOTO(pair_upsert(t, k, &p), rc, out);
            p->count += w->freq;
            if (w->sym[i] == c || w->sym[i + 1] == c) {
                PD_CHECK_GOTO(pair_add_word(p, list[li]), rc, out);
                if (p->stamp != stamp) {
                    p->stamp = stamp;
                    PD_CHECK_GOTO(
                        grow((void **)touched, cap_touched, n_touched + 1, sizeof **touched), rc,
                        out);
                    (*touched)[n_touched++] = (int64_t)k;
                }
            }
        }
    }
    for (int64_t i = 0; i < n_touched; i++) {
        pair_ent *p = pair_get(t, (uint64_t)(*touched)[i]);
        if (p->count > 0) PD_CHECK_GOTO(heap_push(t, p->count, p->key), rc, out);
    }
out:
    free(list);
    return rc;
}

static int train(trainer *t, int64_t n_tokens)
{
    bpe_model *m = t->m;
    for (int i = 0; i < 256; i++) {
        uint8_t byte = (uint8_t)i;
        int32_t id;
        PD_CHECK(tok_add(t, &byte, 1, &id));
    }
    for (int64_t wi = 0; wi < t->n_words; wi++) {
        const word *w = &t->words[wi];
        for (int32_t i = 0; i + 1 < w->len; i++) {
            pair_ent *p;
            PD_CHECK(pair_upsert(t, PAIR_KEY(w->sym[i], w->sym[i + 1]), &p));
            p->count += w->freq;
            PD_CHECK(pair_add_word(p, (int32_t)wi));
        }
    }
    for (size_t i = 0; i < t->pairs_cap; i++)
        if (t->pairs[i].used) PD_CHECK(heap_push(t, t->pairs[i].count, t->pairs[i].key));
    int64_t *touched = NULL, cap_touched = 0;
    uint32_t stamp = 0;
    int rc = PD_OK;
    while (m->n_tokens < n_tokens) {
        if (t->heap_n == 0) {
            rc = pd_error(PD_ERANGE, "bpe: training text exhausted at %lld tokens (wanted %lld)",
                          (long long)m->n_tokens, (long long)n_tokens);
            break;
        }
        heap_ent top = heap_pop(t);
        pair_ent *p = pair_get(t, top.key);
        if (!p || p->count != top.count) {
            if (p && p->count > 0 && p->count < top.count) {
                rc = heap_push(t, p->count, p->key);
                if (rc < 0) break;
            }
            continue;
        }
        if (p->count <= 0) continue;
        rc = merge_once(t, top.key, ++stamp, &touched, &cap_touched);
        if (rc < 0) break;
    }
    free(touched);
    return rc;
}

static void trainer_free(trainer *t)
{
    for (int64_t i = 0; i < t->n_words; i++) free(t->words[i].sym);
    free(t->words);
    free(t->word_index);
    for (size_t i = 0; i < t->pairs_cap; i++) free(t->pairs[i].words);
    free(t->pairs);
    free(t->heap);
    free(t->tok_index);
}

int bpe_train(const char *text, size_t len, int64_t n_tokens, bpe_model **out)
{
    *out = NULL;
    if (n_tokens < 256)
        return pd_error(PD_EINVAL, "bpe: %lld tokens requested, at least 256 needed",
                        (long long)n_tokens);
    bpe_model *m = calloc(1, sizeof *m);
    if (!m) return oom();
    trainer t;
    memset(&t, 0, sizeof t);
    t.m = m;
    int rc;
    PD_CHECK_GOTO(add_text(&t, text, len), rc, fail);
    /* distinct words bound the merges; two pseudo-words per wanted token is ample */
    PD_CHECK_GOTO(add_pseudo_words(&t, 2 * n_tokens), rc, fail);
    PD_CHECK_GOTO(train(&t, n_tokens), rc, fail);
    trainer_free(&t);
    *out = m;
    return PD_OK;
fail:
    trainer_free(&t);
    bpe_free(m);
    return rc;
}

void bpe_free(bpe_model *m)
{
    if (!m) return;
    for (int64_t i = 0; i < m->n_tokens; i++) free(m->tokens[i].bytes);
    free(m->tokens);
    free(m->merges);
    free(m);
}

int64_t bpe_size(const bpe_model *m)
{
    return m->n_tokens;
}
int64_t bpe_merge_count(const bpe_model *m)
{
    return m->n_merges;
}

/* ---- tokenizer.json ------------------------------------------------------------------------ */

/* GPT-2 bytes_to_unicode: printable bytes map to themselves, the rest to U+0100 onwards. */
static void byte_map(uint32_t cp[256])
{
    uint32_t next = 256;
    for (int b = 0; b < 256; b++) {
        bool keep = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        cp[b] = keep ? (uint32_t)b : next++;
    }
}

static size_t put_utf8(char *o, uint32_t c)
{
    if (c < 0x80) {
        o[0] = (char)c;
        return 1;
    }
    o[0] = (char)(0xC0 | (c >> 6)); /* all code points here are < 0x800 */
    o[1] = (char)(0x80 | (c & 0x3F));
    return 2;
}

static char *token_string(const token *k, const uint32_t cp[256])
{
    char *s = malloc((size_t)k->len * 2 + 1);
    if (!s) return NULL;
    size_t n = 0;
    for (int32_t i = 0; i < k->len; i++) n += put_utf8(s + n, cp[k->bytes[i]]);
    s[n] = '\0';
    return s;
}

static json_t *byte_level(bool add_prefix_space, bool trim_offsets)
{
    json_t *o = json_object();
    json_object_set_new(o, "type", json_string("ByteLevel"));
    json_object_set_new(o, "add_prefix_space", json_boolean(add_prefix_space));
    json_object_set_new(o, "trim_offsets", json_boolean(trim_offsets));
    json_object_set_new(o, "use_regex", json_true());
    return o;
}

int bpe_write_tokenizer_json(const bpe_model *m, const char *const *specials, int n_special,
                             const char *file)
{
    uint32_t cp[256];
    byte_map(cp);
    char **names = calloc((size_t)m->n_tokens, sizeof *names);
    if (!names) return oom();
    int rc = PD_OK;
    json_t *root = json_object();
    json_t *vocab = json_object();
    json_t *merges = json_array();
    for (int64_t i = 0; i < m->n_tokens; i++) {
        names[i] = token_string(&m->tokens[i], cp);
        if (!names[i]) {
            rc = oom();
            goto done;
        }
        json_object_set_new(vocab, names[i], json_integer(i));
    }
    for (int64_t i = 0; i < m->n_merges; i++) {
        const char *a = names[m->merges[i] >> 32], *b = names[m->merges[i] & 0xffffffffu];
        size_t la = strlen(a), lb = strlen(b);
        char *s = malloc(la + lb + 2);
        if (!s) {
            rc = oom();
            goto done;
        }
        memcpy(s, a, la);
        s[la] = ' ';
        memcpy(s + la + 1, b, lb + 1);
        json_array_append_new(merges, json_string(s));
        free(s);
    }
    json_t *added = json_array();
    for (int i = 0; i < n_special; i++) {
        json_t *a = json_object();
        json_object_set_new(a, "id", json_integer(m->n_tokens + i));
        json_object_set_new(a, "content", json_string(specials[i]));
        json_object_set_new(a, "single_word", json_false());
        json_object_set_new(a, "lstrip", json_false());
        json_object_set_new(a, "rstrip", json_false());
        json_object_set_new(a, "normalized", json_false());
        json_object_set_new(a, "special", json_true());
        json_array_append_new(added, a);
    }
    json_t *model = json_object();
    json_object_set_new(model, "type", json_string("BPE"));
    json_object_set_new(model, "dropout", json_null());
    json_object_set_new(model, "unk_token", json_null());
    json_object_set_new(model, "continuing_subword_prefix", json_null());
    json_object_set_new(model, "end_of_word_suffix", json_null());
    json_object_set_new(model, "fuse_unk", json_false());
    json_object_set_new(model, "byte_fallback", json_false());
    json_object_set_new(model, "ignore_merges", json_false());
    json_object_set_new(model, "vocab", vocab);
    json_object_set_new(model, "merges", merges);
    vocab = merges = NULL;
    json_object_set_new(root, "version", json_string("1.0"));
    json_object_set_new(root, "truncation", json_null());
    json_object_set_new(root, "padding", json_null());
    json_object_set_new(root, "added_tokens", added);
    json_object_set_new(root, "normalizer", json_null());
    json_object_set_new(root, "pre_tokenizer", byte_level(false, true));
    json_object_set_new(root, "post_processor", byte_level(false, false));
    json_object_set_new(root, "decoder", byte_level(true, true));
    json_object_set_new(root, "model", model);
    rc = pdj_dump_file(root, file, 2);
done:
    for (int64_t i = 0; i < m->n_tokens; i++) free(names[i]);
    free(names);
    json_decref(vocab);
    json_decref(merges);
    json_decref(root);
    return rc;
}
