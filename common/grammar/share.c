/* Mask-cache entries shared across the grammars of one vocabulary. The entry of a state of a
 * call-free rule (what a trie walk from it accepts) depends only on that rule's DFA and the
 * vocabulary, and the same lexemes (JSON strings, numbers, keys, formats) recur in almost
 * every grammar; so such a rule's DFA is registered by its exact tables in the vocabulary, and
 * every grammar with an identical rule uses the same entry slots: the first-visit walk of a
 * string state (the whole trie) is paid once per process, not once per grammar. Bounded: up
 * to SHARE_RULES rules of up to SHARE_STATES states, and SHARE_BYTES of entries; past that,
 * entries stay in the grammar's own cache. */
#include <stdlib.h>
#include <string.h>

#include "grammar/gram_internal.h"
#include "util/hash.h"

#define SHARE_RULES  4096
#define SHARE_STATES 4096
#define SHARE_BYTES  ((size_t)256 << 20)

typedef struct {
    uint64_t hash;
    int32_t n, ncls;
    uint8_t cls[256];
    int32_t *trans;         /* (n, ncls), local state or -1 */
    uint8_t *final;         /* (n) */
    _Atomic(gentry *) *ent; /* (n), by representative local state */
} gsrule;

#define SHARE_SLOTS (2 * SHARE_RULES) /* open addressing over the rules by hash */

struct gshare {
    pthread_mutex_t lock;
    gsrule **rules;
    int32_t *slots; /* rule index or -1 */
    int32_t n;
    _Atomic size_t bytes;
};

gshare *gshare_create(void)
{
    gshare *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->rules = calloc(SHARE_RULES, sizeof(gsrule *));
    s->slots = malloc(sizeof(int32_t) * SHARE_SLOTS);
    if (!s->rules || !s->slots) {
        free(s->rules);
        free(s->slots);
        free(s);
        return NULL;
    }
    for (int32_t i = 0; i < SHARE_SLOTS; i++) s->slots[i] = -1;
    pthread_mutex_init(&s->lock, NULL);
    atomic_init(&s->bytes, 0);
    return s;
}

void gshare_free(gshare *s)
{
    if (!s) return;
    for (int32_t i = 0; i < s->n; i++) {
        gsrule *r = s->rules[i];
        for (int32_t k = 0; k < r->n; k++) gentry_free(atomic_load(&r->ent[k]));
        free(r->ent);
        free(r->trans);
        free(r->final);
        free(r);
    }
    free(s->rules);
    free(s->slots);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

size_t gentry_bytes(const gentry *e, int32_t vocab_size)
{
    size_t acc = e->bits ? pd_gmask_words(vocab_size) : e->n_acc;
    return sizeof *e + 4 * (acc + e->n_pop);
}

bool gshare_publish(gshare *s, _Atomic(gentry *) *slot, gentry **e, int32_t vocab_size)
{
    size_t n = gentry_bytes(*e, vocab_size);
    if (atomic_fetch_add(&s->bytes, n) + n > SHARE_BYTES) {
        atomic_fetch_sub(&s->bytes, n);
        return false;
    }
    gentry *expected = NULL;
    if (!atomic_compare_exchange_strong(slot, &expected, *e)) {
        atomic_fetch_sub(&s->bytes, n);
        gentry_free(*e);
        *e = expected;
    }
    return true;
}

/* The registered copy of rule r of g (registering it when new and there is room), or NULL. */
static gsrule *lookup(gshare *s, const pd_grammar *g, int32_t r)
{
    const grule *R = &g->rules[r];
    int32_t n = R->n_states, ncls = R->ncls;
    int32_t *trans = malloc(sizeof(int32_t) * (size_t)n * (size_t)ncls);
    uint8_t *final = malloc((size_t)n);
    if (!trans || !final) {
        free(trans);
        free(final);
        return NULL;
    }
    uint64_t h = pd_mix64(0x5ba7e + (uint64_t)n * 31 + (uint64_t)ncls);
    for (int b = 0; b < 256; b++) h = pd_mix64(h ^ R->cls[b]);
    for (int32_t i = 0; i < n; i++) {
        const gstate *st = &g->states[R->first + i];
        final[i] = (st->flags & GS_FINAL) != 0;
        h = pd_mix64(h ^ final[i]);
        for (int32_t k = 0; k < ncls; k++) {
            int32_t t = g->trans[st->trans_off + k];
            trans[(size_t)i * (size_t)ncls + (size_t)k] = t < 0 ? -1 : t - R->first;
            h = pd_mix64(h ^ (uint64_t)(uint32_t)trans[(size_t)i * (size_t)ncls + (size_t)k]);
        }
    }
    gsrule *found = NULL;
    pthread_mutex_lock(&s->lock);
    uint32_t slot = (uint32_t)h & (SHARE_SLOTS - 1);
    for (; s->slots[slot] >= 0 && !found; slot = (slot + 1) & (SHARE_SLOTS - 1)) {
        gsrule *q = s->rules[s->slots[slot]];
        if (q->hash == h && q->n == n && q->ncls == ncls && memcmp(q->cls, R->cls, 256) == 0 &&
            memcmp(q->final, final, (size_t)n) == 0 &&
            memcmp(q->trans, trans, sizeof(int32_t) * (size_t)n * (size_t)ncls) == 0)
            found = q;
    }
    if (!found && s->n < SHARE_RULES) { /* slot: the empty one that ended the probe */
        gsrule *q = calloc(1, sizeof *q);
        _Atomic(gentry *) *ent = calloc((size_t)n, sizeof *ent);
        if (q && ent) {
            q->hash = h;
            q->n = n;
            q->ncls = ncls;
            memcpy(q->cls, R->cls, 256);
            q->trans = trans;
            q->final = final;
            q->ent = ent;
            s->slots[slot] = s->n;
            s->rules[s->n++] = q;
            found = q;
            trans = NULL;
            final = NULL;
        } else {
            free(q);
            free(ent);
        }
    }
    pthread_mutex_unlock(&s->lock);
    free(trans);
    free(final);
    return found;
}

int gshare_attach(gshare *s, pd_grammar *g)
{
    g->slot = malloc(sizeof(*g->slot) * (size_t)(g->n_keys ? g->n_keys : 1));
    g->slot_shared = calloc((size_t)(g->n_keys ? g->n_keys : 1), 1);
    int32_t *first = malloc(sizeof(int32_t) * (size_t)(g->n_keys ? g->n_keys : 1));
    if (!g->slot || !g->slot_shared || !first) {
        free(first);
        return -1;
    }
    for (int32_t k = 0; k < g->n_keys; k++) g->slot[k] = &g->cache[k];
    for (int32_t r = 0; s && r < g->n_rules; r++) {
        const grule *R = &g->rules[r];
        if (!R->leaf || R->n_states > SHARE_STATES) continue;
        gsrule *q = lookup(s, g, r);
        if (!q) continue;
        for (int32_t i = 0; i < R->n_states; i++) first[g->states[R->first + i].cache_key] = -1;
        for (int32_t i = 0; i < R->n_states; i++) {
            int32_t key = g->states[R->first + i].cache_key;
            if (first[key] >= 0) continue;
            first[key] = i;
            if (!g->slot_shared[key]) { /* a key two rules share: either slot is right */
                g->slot[key] = &q->ent[i];
                g->slot_shared[key] = 1;
            }
        }
    }
    free(first);
    return 0;
}
