/* pd_grammar_compile (dispatch per spec kind), reference counting, and the LRU compile cache. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/gram_internal.h"
#include "util/status.h"

static int choice_compile(gb *b, const char *text, size_t len, int32_t *root)
{
    json_error_t je;
    json_t *a = json_loadb(text, len, 0, &je);
    if (!a || !json_is_array(a) || json_array_size(a) == 0) {
        json_decref(a);
        return gb_fail(b, PD_EINVAL, "", "", -1,
                       "guided_choice must be a non-empty JSON array of strings");
    }
    size_t n = json_array_size(a);
    gx **k = malloc(sizeof(gx *) * n);
    if (!k) {
        json_decref(a);
        return gb_fail(b, PD_ENOMEM, "", "", -1, "out of memory");
    }
    for (size_t i = 0; i < n; i++) {
        json_t *s = json_array_get(a, i);
        if (!json_is_string(s)) {
            free(k);
            json_decref(a);
            return gb_fail(b, PD_EINVAL, "", "", (long)i, "guided_choice[%zu] is not a string", i);
        }
        k[i] = gx_lit(b, json_string_value(s), json_string_length(s));
    }
    int32_t r = gb_rule_new(b, "choice");
    gb_rule_set(b, r, gx_alt(b, k, (int)n));
    free(k);
    json_decref(a);
    *root = r;
    return b->status;
}

int pd_grammar_compile(const pd_gvocab *v, const pd_gspec *spec, pd_grammar **out, pd_gerr *err)
{
    *out = NULL;
    gb b;
    gb_init(&b, err);
    if (b.status < 0) return b.status;
    int32_t root = -1;
    int rc = 0;
    b.strict = spec->strict;
    const char *text = spec->text ? spec->text : "";
    size_t len = spec->text ? spec->len : 0;
    switch (spec->kind) {
    case PD_GSPEC_JSON_SCHEMA: rc = schema_compile(&b, text, len, spec->ws_pattern, &root); break;
    case PD_GSPEC_JSON_OBJECT: rc = json_object_compile(&b, spec->ws_pattern, &root); break;
    case PD_GSPEC_REGEX: {
        gx *x = rx_parse(&b, text, len, RX_FULL, "");
        root = gb_rule_new(&b, "regex");
        gb_rule_set(&b, root, x);
        rc = b.status;
        break;
    }
    case PD_GSPEC_CHOICE: rc = choice_compile(&b, text, len, &root); break;
    case PD_GSPEC_GRAMMAR: rc = ebnf_compile(&b, text, len, &root); break;
    default: rc = gb_fail(&b, PD_EINVAL, "", "", -1, "unknown grammar kind %d", (int)spec->kind);
    }
    if (rc < 0 || b.status < 0) {
        rc = b.status < 0 ? b.status : rc;
        gb_free(&b);
        return rc;
    }
    pd_grammar *g = calloc(1, sizeof *g);
    if (!g) {
        gb_free(&b);
        return pd_error(PD_ENOMEM, "grammar: out of memory");
    }
    atomic_init(&g->refs, 1);
    g->v = v;
    pthread_mutex_init(&g->lock, NULL);
    rc = gram_build(&b, root, g);
    if (rc == 0) {
        /* rule names point into the builder's arena: copy them */
        for (int32_t i = 0; i < g->n_rules; i++)
            g->rules[i].name = strdup(g->rules[i].name ? g->rules[i].name : "");
        g->cache = calloc((size_t)(g->n_keys ? g->n_keys : 1), sizeof(*g->cache));
        if (!g->cache || gshare_attach(v->share, g) < 0)
            rc = pd_error(PD_ENOMEM, "grammar: out of memory");
    } else {
        for (int32_t i = 0; g->rules && i < g->n_rules; i++) g->rules[i].name = NULL;
    }
    gb_free(&b);
    if (rc < 0) {
        pd_grammar_unref(g);
        return rc;
    }
    *out = g;
    return 0;
}

pd_grammar *pd_grammar_ref(pd_grammar *g)
{
    if (g) atomic_fetch_add(&g->refs, 1);
    return g;
}

void pd_grammar_unref(pd_grammar *g)
{
    if (!g || atomic_fetch_sub(&g->refs, 1) != 1) return;
    if (g->cache)
        for (int32_t i = 0; i < g->n_keys; i++) gentry_free(atomic_load(&g->cache[i]));
    free(g->cache);
    free(g->slot);
    free(g->slot_shared);
    if (g->rules)
        for (int32_t i = 0; i < g->n_rules; i++) free((char *)g->rules[i].name);
    free(g->rules);
    free(g->states);
    free(g->trans);
    free(g->calls);
    pthread_mutex_destroy(&g->lock);
    free(g);
}

void pd_grammar_stats(const pd_grammar *g, size_t *rules, size_t *states)
{
    if (rules) *rules = (size_t)g->n_rules;
    if (states) *states = (size_t)g->n_states;
}

/* ---- LRU cache -------------------------------------------------------------------------- */
typedef struct centry {
    char *key;
    size_t klen;
    pd_grammar *g;
    struct centry *prev, *next; /* most recent first */
} centry;

struct pd_gcache {
    const pd_gvocab *v;
    size_t max, n;
    centry *head, *tail;
    uint64_t hits, misses;
    pthread_mutex_t lock;
};

pd_gcache *pd_gcache_create(const pd_gvocab *v, size_t max_entries)
{
    pd_gcache *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->v = v;
    c->max = max_entries ? max_entries : 1;
    pthread_mutex_init(&c->lock, NULL);
    return c;
}

static void unlink_e(pd_gcache *c, centry *e)
{
    if (e->prev)
        e->prev->next = e->next;
    else
        c->head = e->next;
    if (e->next)
        e->next->prev = e->prev;
    else
        c->tail = e->prev;
    e->prev = e->next = NULL;
}

static void push_front(pd_gcache *c, centry *e)
{
    e->next = c->head;
    e->prev = NULL;
    if (c->head) c->head->prev = e;
    c->head = e;
    if (!c->tail) c->tail = e;
}

void pd_gcache_free(pd_gcache *c)
{
    if (!c) return;
    for (centry *e = c->head, *n; e; e = n) {
        n = e->next;
        pd_grammar_unref(e->g);
        free(e->key);
        free(e);
    }
    pthread_mutex_destroy(&c->lock);
    free(c);
}

/* canonical key: kind, strict, ws pattern, NUL, text */
static char *make_key(const pd_gspec *s, size_t *klen)
{
    const char *ws = s->ws_pattern ? s->ws_pattern : "";
    size_t wl = strlen(ws), tl = s->text ? s->len : 0;
    *klen = 2 + wl + 1 + tl;
    char *k = malloc(*klen);
    if (!k) return NULL;
    k[0] = (char)('0' + (int)s->kind);
    k[1] = s->strict ? 's' : 'l';
    memcpy(k + 2, ws, wl);
    k[2 + wl] = 0;
    if (tl) memcpy(k + 3 + wl, s->text, tl);
    return k;
}

int pd_gcache_get(pd_gcache *c, const pd_gspec *spec, pd_grammar **out, pd_gerr *err)
{
    *out = NULL;
    size_t klen;
    char *key = make_key(spec, &klen);
    if (!key) return pd_error(PD_ENOMEM, "grammar cache: out of memory");
    pthread_mutex_lock(&c->lock);
    for (centry *e = c->head; e; e = e->next)
        if (e->klen == klen && memcmp(e->key, key, klen) == 0) {
            unlink_e(c, e);
            push_front(c, e);
            *out = pd_grammar_ref(e->g);
            c->hits++;
            pthread_mutex_unlock(&c->lock);
            free(key);
            return 0;
        }
    c->misses++;
    pthread_mutex_unlock(&c->lock);
    /* compile outside the lock: a slow compile does not block other lookups */
    pd_grammar *g;
    int rc = pd_grammar_compile(c->v, spec, &g, err);
    if (rc < 0) {
        free(key);
        return rc;
    }
    centry *e = calloc(1, sizeof *e);
    if (!e) {
        free(key);
        *out = g;
        return 0;
    }
    e->key = key;
    e->klen = klen;
    e->g = pd_grammar_ref(g);
    pthread_mutex_lock(&c->lock);
    push_front(c, e);
    c->n++;
    while (c->n > c->max && c->tail) {
        centry *t = c->tail;
        unlink_e(c, t);
        pd_grammar_unref(t->g);
        free(t->key);
        free(t);
        c->n--;
    }
    pthread_mutex_unlock(&c->lock);
    *out = g;
    return 0;
}

bool pd_gcache_has(pd_gcache *c, const pd_gspec *spec)
{
    size_t klen;
    char *key = make_key(spec, &klen);
    if (!key) return false;
    bool found = false;
    pthread_mutex_lock(&c->lock);
    for (centry *e = c->head; e && !found; e = e->next)
        found = e->klen == klen && memcmp(e->key, key, klen) == 0;
    pthread_mutex_unlock(&c->lock);
    free(key);
    return found;
}

void pd_gcache_stats(const pd_gcache *c, size_t *entries, uint64_t *hits, uint64_t *misses)
{
    pd_gcache *m = (pd_gcache *)c;
    pthread_mutex_lock(&m->lock);
    if (entries) *entries = c->n;
    if (hits) *hits = c->hits;
    if (misses) *misses = c->misses;
    pthread_mutex_unlock(&m->lock);
}
