/* Vocabulary for masks: each token's bytes and a byte trie in DFS preorder (node i's subtree
 * is [i, next[i])), so a walk is a forward scan that skips dead subtrees; the slice (tokens of
 * string contents) and the trie of the other tokens. */
#include <stdlib.h>
#include <string.h>

#include "grammar/gram_internal.h"
#include "tokenizer/tok_internal.h"
#include "util/status.h"

static const pd_gvocab *g_sort_v;

static int cmp_tok(const void *x, const void *y)
{
    int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
    const pd_gvocab *v = g_sort_v;
    uint32_t la = v->len[a], lb = v->len[b];
    int c = memcmp(v->tok[a], v->tok[b], la < lb ? la : lb);
    if (c) return c;
    if (la != lb) return la < lb ? -1 : 1;
    return (a > b) - (a < b);
}

/* The trie of tokens ids[0..m) (sorted by bytes); dup links tokens with the same bytes when
 * given (the full trie builds the chains, the rest trie reuses them). */
static int trie_build(const pd_gvocab *v, const int32_t *ids, int32_t m, gtrie *t, int32_t *dup)
{
    size_t total = 1;
    for (int32_t k = 0; k < m; k++) total += v->len[ids[k]];
    t->byte = malloc(total);
    t->depth = malloc(total);
    t->next = malloc(sizeof(uint32_t) * total);
    t->tok = malloc(sizeof(int32_t) * total);
    uint32_t *path = malloc(sizeof(uint32_t) * (v->max_len + 2));
    if (!t->byte || !t->depth || !t->next || !t->tok || !path) {
        free(path);
        return pd_error(PD_ENOMEM, "grammar vocab: out of memory");
    }
    uint32_t nn = 1;
    t->byte[0] = 0;
    t->depth[0] = 0;
    t->tok[0] = -1;
    path[0] = 0;
    uint32_t depth = 0; /* path[0..depth] */
    int32_t prev = -1;
    for (int32_t k = 0; k < m; k++) {
        int32_t id = ids[k];
        const uint8_t *s = v->tok[id];
        uint32_t len = v->len[id];
        uint32_t lcp = 0;
        if (prev >= 0) {
            uint32_t pl = v->len[prev];
            while (lcp < pl && lcp < len && v->tok[prev][lcp] == s[lcp]) lcp++;
        }
        if (prev >= 0 && lcp == len && v->len[prev] == len) { /* same bytes */
            if (dup) {
                int32_t *p = &t->tok[path[depth]];
                while (*p >= 0 && dup[*p] >= 0) p = &dup[*p];
                dup[*p] = id;
            }
            prev = id;
            continue;
        }
        while (depth > lcp) t->next[path[depth--]] = nn;
        for (uint32_t i = lcp; i < len; i++) {
            uint32_t node = nn++;
            t->byte[node] = s[i];
            t->depth[node] = (uint8_t)(i + 1 > 255 ? 255 : i + 1);
            t->tok[node] = -1;
            path[++depth] = node;
        }
        t->tok[path[depth]] = id;
        prev = id;
    }
    while (depth > 0) t->next[path[depth--]] = nn;
    t->next[0] = nn;
    t->n_nodes = nn;
    free(path);
    return 0;
}

static void trie_free(gtrie *t)
{
    free(t->byte);
    free(t->depth);
    free(t->next);
    free(t->tok);
    free(t->full);
}

/* The slice's automaton: UTF-8 as RFC 3629 (no overlongs, no surrogates) over code points from
 * U+0020 except '"' and '\\'. States: 0 between characters; 1, 2, 3 continuation bytes left;
 * 4 after E0 (A0-BF next), 5 after ED (80-9F), 6 after F0 (90-BF), 7 after F4 (80-8F). */
int8_t gslice_next(int8_t st, uint8_t b)
{
    bool cont = b >= 0x80 && b <= 0xBF;
    switch (st) {
    case 0:
        if (b < 0x20 || b == '"' || b == '\\') return SL_DEAD;
        if (b < 0x80) return 0;
        if (b >= 0xC2 && b <= 0xDF) return 1;
        if (b == 0xE0) return 4;
        if (b == 0xED) return 5;
        if (b >= 0xE1 && b <= 0xEF) return 2;
        if (b == 0xF0) return 6;
        if (b >= 0xF1 && b <= 0xF3) return 3;
        if (b == 0xF4) return 7;
        return SL_DEAD;
    case 1: return cont ? 0 : SL_DEAD;
    case 2: return cont ? 1 : SL_DEAD;
    case 3: return cont ? 2 : SL_DEAD;
    case 4: return b >= 0xA0 && b <= 0xBF ? 1 : SL_DEAD;
    case 5: return b >= 0x80 && b <= 0x9F ? 1 : SL_DEAD;
    case 6: return b >= 0x90 && b <= 0xBF ? 2 : SL_DEAD;
    case 7: return b >= 0x80 && b <= 0x8F ? 2 : SL_DEAD;
    default: return SL_DEAD;
    }
}

static bool in_slice(const uint8_t *s, uint32_t n)
{
    int8_t st = 0;
    for (uint32_t i = 0; i < n && st != SL_DEAD; i++) st = gslice_next(st, s[i]);
    return st != SL_DEAD;
}

/* The full trie, the slice and the rest trie (its nodes mapped to the full trie's: the rest
 * trie's nodes are a prefix-closed subset, in the same order). */
static int build_tries(pd_gvocab *v)
{
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(v->n ? v->n : 1));
    v->dup = malloc(sizeof(int32_t) * (size_t)(v->n ? v->n : 1));
    v->slice = calloc(pd_gmask_words(v->n), sizeof(uint32_t));
    if (!ids || !v->dup || !v->slice) {
        free(ids);
        return pd_error(PD_ENOMEM, "grammar vocab: out of memory");
    }
    int32_t m = 0;
    for (int32_t i = 0; i < v->n; i++) {
        v->dup[i] = -1;
        if (v->tok[i] && v->len[i] > 0) {
            ids[m++] = i;
            if (v->len[i] > v->max_len) v->max_len = v->len[i];
        }
    }
    if (v->max_len > 255) {
        free(ids);
        return pd_error(PD_EUNSUPPORTED, "grammar vocab: a token longer than 255 bytes");
    }
    static pthread_mutex_t sort_lock = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&sort_lock);
    g_sort_v = v;
    qsort(ids, (size_t)m, sizeof(int32_t), cmp_tok);
    pthread_mutex_unlock(&sort_lock);
    int rc = trie_build(v, ids, m, &v->trie, v->dup);
    int32_t mr = 0;
    for (int32_t k = 0; rc == 0 && k < m; k++) {
        int32_t id = ids[k];
        if (!in_slice(v->tok[id], v->len[id])) {
            ids[mr++] = id;
            continue;
        }
        v->slice[id >> 5] |= 1u << (id & 31);
        v->n_slice++;
        if (v->len[id] > v->slice_len) v->slice_len = v->len[id];
    }
    if (rc == 0) rc = trie_build(v, ids, mr, &v->rest, NULL);
    free(ids);
    if (rc < 0) return rc;
    v->rest.full = malloc(sizeof(uint32_t) * v->rest.n_nodes);
    if (!v->rest.full) return pd_error(PD_ENOMEM, "grammar vocab: out of memory");
    /* walk both in step: a rest node's bytes are a path of the full trie */
    uint32_t path[257];
    path[0] = 0;
    v->rest.full[0] = 0;
    for (uint32_t i = 1; i < v->rest.n_nodes; i++) {
        uint32_t d = v->rest.depth[i], f = path[d - 1] + 1;
        while (v->trie.byte[f] != v->rest.byte[i]) f = v->trie.next[f];
        path[d] = f;
        v->rest.full[i] = f;
    }
    return 0;
}

int pd_gvocab_create(int32_t n, const uint8_t *const *bytes, const uint32_t *lens,
                     const bool *special, const int32_t *eos, size_t n_eos, pd_gvocab **out)
{
    *out = NULL;
    if (n <= 0) return pd_error(PD_EINVAL, "grammar vocab: empty vocabulary");
    pd_gvocab *v = calloc(1, sizeof *v);
    if (!v) return pd_error(PD_ENOMEM, "grammar vocab: out of memory");
    v->n = n;
    v->tok = calloc((size_t)n, sizeof(uint8_t *));
    v->len = calloc((size_t)n, sizeof(uint32_t));
    v->eos = calloc((size_t)n, sizeof(bool));
    v->eos_ids = malloc(sizeof(int32_t) * (n_eos ? n_eos : 1));
    if (!v->tok || !v->len || !v->eos || !v->eos_ids) {
        pd_gvocab_free(v);
        return pd_error(PD_ENOMEM, "grammar vocab: out of memory");
    }
    for (size_t i = 0; i < n_eos; i++)
        if (eos[i] >= 0 && eos[i] < n && !v->eos[eos[i]]) {
            v->eos[eos[i]] = true;
            v->eos_ids[v->n_eos++] = eos[i];
        }
    for (int32_t i = 0; i < n; i++) {
        if ((special && special[i]) || v->eos[i] || !bytes[i] || lens[i] == 0) continue;
        v->tok[i] = malloc(lens[i]);
        if (!v->tok[i]) {
            pd_gvocab_free(v);
            return pd_error(PD_ENOMEM, "grammar vocab: out of memory");
        }
        memcpy(v->tok[i], bytes[i], lens[i]);
        v->len[i] = lens[i];
    }
    int rc = build_tries(v);
    if (rc < 0) {
        pd_gvocab_free(v);
        return rc;
    }
    v->share = gshare_create();
    if (!v->share) {
        pd_gvocab_free(v);
        return pd_error(PD_ENOMEM, "grammar vocab: out of memory");
    }
    *out = v;
    return 0;
}

int pd_gvocab_from_tok(const pd_tok *t, const int32_t *extra_eos, size_t n_extra, pd_gvocab **out)
{
    int32_t n = t->n_ids;
    const uint8_t **bytes = calloc((size_t)n, sizeof(uint8_t *));
    uint32_t *lens = calloc((size_t)n, sizeof(uint32_t));
    bool *special = calloc((size_t)n, sizeof(bool));
    const int32_t *eos0;
    size_t n0 = pd_tok_eos_ids(t, &eos0);
    int32_t *eos = malloc(sizeof(int32_t) * (n0 + n_extra + 1));
    if (!bytes || !lens || !special || !eos) {
        free(bytes);
        free(lens);
        free(special);
        free(eos);
        return pd_error(PD_ENOMEM, "grammar vocab: out of memory");
    }
    size_t ne = 0;
    for (size_t i = 0; i < n0; i++) eos[ne++] = eos0[i];
    for (size_t i = 0; i < n_extra; i++) eos[ne++] = extra_eos[i];
    for (int32_t i = 0; i < n; i++) {
        uint8_t f = t->id_flags[i];
        if (!(f & TOKF_USED) || (f & TOKF_SPECIAL)) {
            special[i] = true;
            continue;
        }
        if (f & TOKF_BYTE) {
            bytes[i] = &t->id_byte[i];
            lens[i] = 1;
        } else if (f & TOKF_ADDED) { /* added tokens decode to their content */
            bytes[i] = (const uint8_t *)t->id_str[i];
            lens[i] = t->id_len[i];
        } else {
            bytes[i] = t->id_dec[i];
            lens[i] = t->id_dec_len[i];
        }
    }
    int rc = pd_gvocab_create(n, bytes, lens, special, eos, ne, out);
    free(bytes);
    free(lens);
    free(special);
    free(eos);
    return rc;
}

void pd_gvocab_free(pd_gvocab *v)
{
    if (!v) return;
    if (v->tok)
        for (int32_t i = 0; i < v->n; i++) free(v->tok[i]);
    free(v->tok);
    free(v->len);
    free(v->eos);
    free(v->eos_ids);
    trie_free(&v->trie);
    trie_free(&v->rest);
    free(v->slice);
    free(v->dup);
    gshare_free(v->share);
    free(v);
}

int32_t pd_gvocab_size(const pd_gvocab *v)
{
    return v->n;
}

const uint8_t *pd_gvocab_token(const pd_gvocab *v, int32_t id, uint32_t *len)
{
    if (id < 0 || id >= v->n || !v->tok[id]) {
        if (len) *len = 0;
        return NULL;
    }
    if (len) *len = v->len[id];
    return v->tok[id];
}

bool pd_gvocab_is_eos(const pd_gvocab *v, int32_t id)
{
    return id >= 0 && id < v->n && v->eos[id];
}
