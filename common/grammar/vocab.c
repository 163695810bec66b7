/* Vocabulary for masks: each token's bytes and a byte trie in DFS preorder (node i's subtree
 * is [i, t_next[i])), so a walk is a forward scan that skips dead subtrees. */
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

static int build_trie(pd_gvocab *v)
{
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(v->n ? v->n : 1));
    if (!ids) return pd_error(PD_ENOMEM, "grammar vocab: out of memory");
    int32_t m = 0;
    size_t total = 1;
    for (int32_t i = 0; i < v->n; i++)
        if (v->tok[i] && v->len[i] > 0) {
            ids[m++] = i;
            total += v->len[i];
            if (v->len[i] > v->max_len) v->max_len = v->len[i];
        }
    static pthread_mutex_t sort_lock = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&sort_lock);
    g_sort_v = v;
    qsort(ids, (size_t)m, sizeof(int32_t), cmp_tok);
    pthread_mutex_unlock(&sort_lock);
    v->t_byte = malloc(total);
    v->t_depth = malloc(total);
    v->t_next = malloc(sizeof(uint32_t) * total);
    v->t_tok = malloc(sizeof(int32_t) * total);
    v->dup = malloc(sizeof(int32_t) * (size_t)(v->n ? v->n : 1));
    uint32_t *path = malloc(sizeof(uint32_t) * (v->max_len + 2));
    if (!v->t_byte || !v->t_depth || !v->t_next || !v->t_tok || !v->dup || !path) {
        free(ids);
        free(path);
        return pd_error(PD_ENOMEM, "grammar vocab: out of memory");
    }
    for (int32_t i = 0; i < v->n; i++) v->dup[i] = -1;
    uint32_t nn = 1;
    v->t_byte[0] = 0;
    v->t_depth[0] = 0;
    v->t_tok[0] = -1;
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
            uint32_t node = path[depth];
            int32_t *p = &v->t_tok[node];
            while (*p >= 0 && v->dup[*p] >= 0) p = &v->dup[*p];
            v->dup[*p] = id;
            prev = id;
            continue;
        }
        while (depth > lcp) v->t_next[path[depth--]] = nn;
        for (uint32_t i = lcp; i < len; i++) {
            uint32_t node = nn++;
            v->t_byte[node] = s[i];
            v->t_depth[node] = (uint8_t)(i + 1 > 255 ? 255 : i + 1);
            v->t_tok[node] = -1;
            path[++depth] = node;
        }
        v->t_tok[path[depth]] = id;
        prev = id;
    }
    while (depth > 0) v->t_next[path[depth--]] = nn;
    v->t_next[0] = nn;
    v->n_nodes = nn;
    free(ids);
    free(path);
    if (v->max_len > 255)
        return pd_error(PD_EUNSUPPORTED, "grammar vocab: a token longer than 255 bytes");
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
    int rc = build_trie(v);
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
    free(v->t_byte);
    free(v->t_depth);
    free(v->t_next);
    free(v->t_tok);
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
