/* Per-sequence matching: the parser state is a set of stacks (hash-consed frames: a DFA state
 * and the frame below, whose state is where to resume when the callee ends). Masks come from
 * the per-state cache (tokens that a walk from the state alone accepts without leaving its
 * frame, and the trie nodes after which the frame may end) plus short trie walks below those
 * nodes with the real stack. */
#include <stdlib.h>
#include <string.h>

#include "grammar/gram_internal.h"
#include "util/status.h"

#define NOPARENT  (-1)
#define BOTTOM    (-2)
#define AMBIGUOUS (-2) /* a walk's or a step's result: over PD_GRAMMAR_MAX_STACKS stacks */
#define MAX_DEPTH 2000

typedef struct {
    int32_t st, parent;
} frame;

typedef struct {
    frame *f;
    int32_t n, cap;
    int32_t *ht;
    uint32_t mask;
    uint32_t *stamp;
    uint32_t gen;
    int32_t *depth;
} store;

typedef struct {
    int32_t *v;
    int32_t n, cap;
} ivec;

static int ivec_push(ivec *a, int32_t x)
{
    if (a->n == a->cap) {
        int32_t cap = a->cap ? 2 * a->cap : 64;
        int32_t *p = realloc(a->v, sizeof(int32_t) * (size_t)cap);
        if (!p) return -1;
        a->v = p;
        a->cap = cap;
    }
    a->v[a->n++] = x;
    return 0;
}

static int ivec_reserve(ivec *a, int32_t n)
{
    if (n <= a->cap) return 0;
    int32_t cap = a->cap ? a->cap : 64;
    while (cap < n) cap *= 2;
    int32_t *p = realloc(a->v, sizeof(int32_t) * (size_t)cap);
    if (!p) return -1;
    a->v = p;
    a->cap = cap;
    return 0;
}

static void store_free(store *s)
{
    free(s->f);
    free(s->ht);
    free(s->stamp);
    free(s->depth);
    memset(s, 0, sizeof *s);
}

static inline uint32_t fhash(int32_t st, int32_t parent)
{
    uint64_t x = ((uint64_t)(uint32_t)st << 32) | (uint32_t)parent;
    x ^= x >> 29;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 32;
    return (uint32_t)x;
}

static int store_grow(store *s)
{
    int32_t cap = s->cap ? 2 * s->cap : 256;
    frame *f = realloc(s->f, sizeof(frame) * (size_t)cap);
    if (f) s->f = f;
    uint32_t *sp = realloc(s->stamp, sizeof(uint32_t) * (size_t)cap);
    if (sp) s->stamp = sp;
    int32_t *dp = realloc(s->depth, sizeof(int32_t) * (size_t)cap);
    if (dp) s->depth = dp;
    int32_t *ht = malloc(sizeof(int32_t) * (size_t)cap * 2);
    if (!f || !sp || !dp || !ht) {
        free(ht);
        return -1;
    }
    for (int32_t i = s->cap; i < cap; i++) s->stamp[i] = 0;
    uint32_t mask = (uint32_t)cap * 2 - 1;
    for (uint32_t i = 0; i <= mask; i++) ht[i] = -1;
    for (int32_t i = 0; i < s->n; i++) {
        uint32_t h = fhash(s->f[i].st, s->f[i].parent) & mask;
        while (ht[h] >= 0) h = (h + 1) & mask;
        ht[h] = i;
    }
    free(s->ht);
    s->ht = ht;
    s->mask = mask;
    s->cap = cap;
    return 0;
}

static int32_t store_get(store *s, int32_t st, int32_t parent)
{
    if (s->n + 1 > s->cap / 2 * 1 + s->cap / 4 && store_grow(s) < 0) return -1;
    if (!s->ht && store_grow(s) < 0) return -1;
    uint32_t h = fhash(st, parent) & s->mask;
    while (s->ht[h] >= 0) {
        int32_t i = s->ht[h];
        if (s->f[i].st == st && s->f[i].parent == parent) return i;
        h = (h + 1) & s->mask;
    }
    int32_t i = s->n++;
    s->f[i].st = st;
    s->f[i].parent = parent;
    s->depth[i] = parent >= 0 ? s->depth[parent] + 1 : 0;
    s->ht[h] = i;
    return i;
}

static int store_copy(store *d, const store *s)
{
    memset(d, 0, sizeof *d);
    if (!s->cap) return 0;
    d->f = malloc(sizeof(frame) * (size_t)s->cap);
    d->stamp = calloc((size_t)s->cap, sizeof(uint32_t));
    d->depth = malloc(sizeof(int32_t) * (size_t)s->cap);
    d->ht = malloc(sizeof(int32_t) * ((size_t)s->mask + 1));
    if (!d->f || !d->stamp || !d->depth || !d->ht) {
        store_free(d);
        return -1;
    }
    memcpy(d->f, s->f, sizeof(frame) * (size_t)s->n);
    memcpy(d->depth, s->depth, sizeof(int32_t) * (size_t)s->n);
    memcpy(d->ht, s->ht, sizeof(int32_t) * ((size_t)s->mask + 1));
    d->n = s->n;
    d->cap = s->cap;
    d->mask = s->mask;
    return 0;
}

/* ---- closure and step ------------------------------------------------------------------ */
typedef struct {
    const pd_grammar *g;
    store *s;
    ivec *out;
    bool accept, popped, oom;
} ctx;

static void closure(ctx *c, int32_t sid)
{
    if (sid < 0) {
        c->oom = true;
        return;
    }
    store *s = c->s;
    if (s->stamp[sid] == s->gen) return;
    s->stamp[sid] = s->gen;
    frame fr = s->f[sid];
    const gstate *gs = &c->g->states[fr.st];
    if (gs->flags & GS_BYTES)
        if (ivec_push(c->out, sid) < 0) c->oom = true;
    if (gs->n_calls && s->depth[sid] < MAX_DEPTH) {
        for (int32_t i = 0; i < gs->n_calls; i++) {
            const gcall *cl = &c->g->calls[gs->calls_off + i];
            int32_t ret = store_get(s, cl->ret, fr.parent);
            if (ret < 0) {
                c->oom = true;
                return;
            }
            int32_t callee = store_get(s, c->g->rules[cl->callee].start, ret);
            closure(c, callee);
            s = c->s;
        }
    }
    if (gs->flags & GS_FINAL) {
        fr = s->f[sid];
        if (fr.parent == NOPARENT)
            c->accept = true;
        else if (fr.parent == BOTTOM)
            c->popped = true;
        else
            closure(c, fr.parent);
    }
}

/* A new closure generation: frames stamped before it count as unvisited. */
static void next_gen(store *s)
{
    if (++s->gen == 0) { /* wrapped: clear stamps */
        memset(s->stamp, 0, sizeof(uint32_t) * (size_t)s->cap);
        s->gen = 1;
    }
}

/* Steps every stack of in[0..n) by byte b; closure of the results into c->out. */
static void step(ctx *c, const int32_t *in, int32_t n, uint8_t b)
{
    const pd_grammar *g = c->g;
    next_gen(c->s);
    for (int32_t i = 0; i < n; i++) {
        frame fr = c->s->f[in[i]];
        const gstate *gs = &g->states[fr.st];
        int32_t t = g->trans[gs->trans_off + g->rules[gs->rule].cls[b]];
        if (t < 0) continue;
        closure(c, store_get(c->s, t, fr.parent));
    }
}

/* ---- trie walks --------------------------------------------------------------------------- */
typedef struct {
    ivec acc;       /* cache mode: accepted tokens */
    ivec pops;      /* cache mode: pop nodes */
    uint32_t *bits; /* runtime mode */
} sink;

static inline void add_tok(const pd_gvocab *v, sink *k, int32_t id, bool *oom)
{
    for (; id >= 0; id = v->dup[id]) {
        if (k->bits)
            k->bits[id >> 5] |= 1u << (id & 31);
        else if (ivec_push(&k->acc, id) < 0)
            *oom = true;
    }
}

/* Walks the children of trie node root from the stacks S0 (each a config whose top scans).
 * While one stack is alive and its top only scans bytes (no calls, not final), a step is one
 * table lookup, as in walk_leaf: such a depth holds that frame (sst, spar) without interning
 * it; otherwise the depth holds a set of interned stacks in buf. Object keys and other
 * string-like states inlined in rules with calls walk most of the trie this way. */
static int walk(const pd_grammar *g, store *s, uint32_t root, const int32_t *S0, int32_t n0,
                sink *k)
{
    const pd_gvocab *v = g->v;
    const gtrie *tr = &v->trie;
    const gstate *S = g->states;
    uint32_t end = tr->next[root], base = tr->depth[root];
    int32_t off[260], len[260], sst[260], spar[260];
    ivec buf = {0};
    bool oom = false;
    if (ivec_reserve(&buf, n0 + 64) < 0) return -1;
    memcpy(buf.v, S0, sizeof(int32_t) * (size_t)n0);
    off[0] = 0;
    len[0] = n0;
    sst[0] = -1;
    if (n0 == 1) {
        sst[0] = s->f[S0[0]].st;
        spar[0] = s->f[S0[0]].parent;
    }
    ctx c = {g, s, &buf, false, false, false};
    uint32_t i = root + 1;
    while (i < end) {
        uint32_t d = tr->depth[i] - base;
        buf.n = off[d - 1] + len[d - 1];
        off[d] = buf.n;
        sst[d] = -1;
        c.accept = c.popped = false;
        if (sst[d - 1] >= 0) {
            const gstate *gs = &S[sst[d - 1]];
            int32_t t = g->trans[gs->trans_off + g->rules[gs->rule].cls[tr->byte[i]]];
            if (t < 0) {
                i = tr->next[i];
                continue;
            }
            if (!S[t].n_calls && !(S[t].flags & GS_FINAL)) {
                if (!(S[t].flags & GS_BYTES)) {
                    i = tr->next[i];
                    continue;
                }
                sst[d] = t;
                spar[d] = spar[d - 1];
                len[d] = 0;
                if (tr->tok[i] >= 0) add_tok(v, k, tr->tok[i], &oom);
                i++;
                continue;
            }
            if (ivec_reserve(&buf, buf.n + 16) < 0) {
                oom = true;
                break;
            }
            next_gen(s);
            closure(&c, store_get(s, t, spar[d - 1]));
        } else {
            /* the input set lives in buf below off[d]; step appends */
            int32_t pin = off[d - 1], pn = len[d - 1];
            if (ivec_reserve(&buf, buf.n + 4 * pn + 16) < 0) {
                oom = true;
                break;
            }
            /* step reads buf.v[pin..] while appending: copy first when small buffers move */
            int32_t tmp[64];
            int32_t *in = pn <= 64 ? tmp : malloc(sizeof(int32_t) * (size_t)pn);
            if (!in) {
                oom = true;
                break;
            }
            memcpy(in, buf.v + pin, sizeof(int32_t) * (size_t)pn);
            step(&c, in, pn, tr->byte[i]);
            if (in != tmp) free(in);
        }
        if (c.oom) {
            oom = true;
            break;
        }
        len[d] = buf.n - off[d];
        if (len[d] > PD_GRAMMAR_MAX_STACKS) {
            free(buf.v);
            return AMBIGUOUS;
        }
        if (len[d] == 1) {
            sst[d] = s->f[buf.v[off[d]]].st;
            spar[d] = s->f[buf.v[off[d]]].parent;
        }
        bool alive = len[d] > 0 || c.accept || c.popped;
        if (!alive) {
            i = tr->next[i];
            continue;
        }
        if (tr->tok[i] >= 0) add_tok(v, k, tr->tok[i], &oom);
        if (c.popped && !k->bits && tr->next[i] > i + 1 && ivec_push(&k->pops, (int32_t)i) < 0)
            oom = true;
        i = len[d] > 0 ? i + 1 : tr->next[i];
    }
    free(buf.v);
    return oom ? -1 : 0;
}

/* The same for a call-free rule: one DFA state per depth. Walks trie tr (the full trie, or
 * the rest trie when the slice is accepted whole); pops are recorded as full-trie nodes. */
static int walk_leaf(const pd_grammar *g, int32_t st0, const gtrie *tr, sink *k)
{
    const pd_gvocab *v = g->v;
    const grule *R = &g->rules[g->states[st0].rule];
    const int32_t *trans = g->trans;
    const gstate *S = g->states;
    int32_t stk[260];
    stk[0] = st0;
    bool oom = false;
    uint32_t i = 1, end = tr->n_nodes;
    while (i < end) {
        uint32_t d = tr->depth[i];
        int32_t t = trans[S[stk[d - 1]].trans_off + R->cls[tr->byte[i]]];
        if (t < 0) {
            i = tr->next[i];
            continue;
        }
        stk[d] = t;
        if (tr->tok[i] >= 0) add_tok(v, k, tr->tok[i], &oom);
        bool has_kids = tr->next[i] > i + 1;
        if ((S[t].flags & GS_FINAL) && has_kids &&
            ivec_push(&k->pops, (int32_t)(tr->full ? tr->full[i] : i)) < 0)
            oom = true;
        i = (S[t].flags & GS_BYTES) ? i + 1 : tr->next[i];
    }
    return oom ? -1 : 0;
}

/* Whether state st0 of a call-free rule accepts every token of the slice without its frame
 * ending inside one: each path of the slice's automaton, up to its longest token, keeps the
 * rule in live states that are not final. A search over (rule state, slice state) pairs;
 * 1 yes, 0 no (or too many pairs to tell), -1 out of memory. */
#define SLICE_MAX_PAIRS 8192
static int slice_fits(const pd_grammar *g, int32_t st0)
{
    const pd_gvocab *v = g->v;
    const grule *R = &g->rules[g->states[st0].rule];
    const gstate *S = g->states;
    if (v->n_slice == 0) return 0;
    /* one byte per (rule class, slice transitions) */
    uint8_t rep[256];
    uint64_t sig[256];
    int nrep = 0;
    for (int b = 0; b < 256; b++) {
        uint64_t x = (uint64_t)R->cls[b] << 32;
        for (int8_t p = 0; p < SL_NSTATES; p++)
            x |= (uint64_t)(uint8_t)(gslice_next(p, (uint8_t)b) + 1) << (4 * p);
        if ((x & 0xffffffffu) == 0) continue; /* no slice state takes b */
        int j = 0;
        while (j < nrep && sig[j] != x) j++;
        if (j == nrep) {
            sig[nrep] = x;
            rep[nrep++] = (uint8_t)b;
        }
    }
    /* breadth first, so a pair is expanded at its smallest depth; the queue holds every pair
     * seen, and the hash table (twice its capacity) is rebuilt from it when it grows */
    int32_t cap = 64, nq = 0, head = 0;
    uint64_t *q = NULL, *ht = NULL;
    uint8_t *qd = NULL;
    int fits = 1;
    for (;;) {
        if (nq == 0 || nq == cap) {
            if (nq) cap *= 2;
            uint64_t *q2 = realloc(q, sizeof(uint64_t) * (size_t)cap);
            if (q2) q = q2;
            uint8_t *qd2 = realloc(qd, (size_t)cap);
            if (qd2) qd = qd2;
            free(ht);
            ht = malloc(sizeof(uint64_t) * 2 * (size_t)cap);
            if (!q2 || !qd2 || !ht) {
                fits = -1;
                break;
            }
            memset(ht, 0xff, sizeof(uint64_t) * 2 * (size_t)cap);
            if (nq == 0) {
                q[nq] = (uint64_t)(uint32_t)st0 << 3;
                qd[nq++] = 0;
            }
            for (int32_t i = 0; i < nq; i++) {
                uint32_t h = (uint32_t)((q[i] * 0x9e3779b97f4a7c15ull) >> 40) & (2 * cap - 1);
                while (ht[h] != UINT64_MAX) h = (h + 1) & (2 * cap - 1);
                ht[h] = q[i];
            }
        }
        if (head == nq || !fits) break;
        uint64_t pr = q[head];
        uint32_t d = qd[head++];
        int32_t st = (int32_t)(pr >> 3);
        int8_t p = (int8_t)(pr & 7);
        for (int j = 0; j < nrep && fits && nq < cap; j++) {
            int8_t p2 = gslice_next(p, rep[j]);
            if (p2 == SL_DEAD) continue;
            int32_t t = g->trans[S[st].trans_off + R->cls[rep[j]]];
            if (t < 0 || (S[t].flags & GS_FINAL)) {
                fits = 0;
                break;
            }
            if (d + 1 >= v->slice_len) continue;
            uint64_t key = (uint64_t)(uint32_t)t << 3 | (uint64_t)p2;
            uint32_t h = (uint32_t)((key * 0x9e3779b97f4a7c15ull) >> 40) & (2 * cap - 1);
            while (ht[h] != UINT64_MAX && ht[h] != key) h = (h + 1) & (2 * cap - 1);
            if (ht[h] == key) continue;
            if (nq == SLICE_MAX_PAIRS) {
                fits = 0;
                break;
            }
            ht[h] = key;
            q[nq] = key;
            qd[nq++] = (uint8_t)(d + 1);
        }
        if (nq == cap) head--; /* cut short: grow, then expand this pair again */
    }
    free(q);
    free(qd);
    free(ht);
    return fits;
}

void gentry_free(gentry *e)
{
    if (!e) return;
    free(e->acc);
    free(e->pops);
    free(e);
}

/* NULL with *rc -1 (out of memory) or AMBIGUOUS. */
static gentry *compute_entry(const pd_grammar *g, int32_t st, int *rc_out)
{
    sink k = {0};
    int rc;
    *rc_out = -1;
    int32_t nv = g->v->n;
    size_t words = pd_gmask_words(nv);
    if (g->rules[g->states[st].rule].leaf) {
        rc = slice_fits(g, st);
        if (rc == 1) { /* the slice whole, and a walk of the other tokens */
            k.bits = malloc(words * sizeof(uint32_t));
            if (k.bits) memcpy(k.bits, g->v->slice, words * sizeof(uint32_t));
            rc = k.bits ? walk_leaf(g, st, &g->v->rest, &k) : -1;
        } else if (rc == 0) {
            rc = walk_leaf(g, st, &g->v->trie, &k);
        }
    } else {
        store s = {0};
        int32_t sid = store_get(&s, st, BOTTOM);
        rc = sid < 0 ? -1 : walk(g, &s, 0, &sid, 1, &k);
        store_free(&s);
    }
    gentry *e = calloc(1, sizeof *e);
    if (rc < 0 || !e) {
        if (rc == AMBIGUOUS) *rc_out = AMBIGUOUS;
        free(k.bits);
        free(k.acc.v);
        free(k.pops.v);
        free(e);
        return NULL;
    }
    if (k.bits) {
        e->bits = true;
        e->acc = k.bits;
        for (size_t w = 0; w < words; w++) e->n_acc += (uint32_t)__builtin_popcount(k.bits[w]);
    } else if ((size_t)k.acc.n > (size_t)nv / 32) {
        e->n_acc = (uint32_t)k.acc.n;
        e->bits = true;
        e->acc = calloc(words, sizeof(uint32_t));
        if (e->acc)
            for (int32_t i = 0; i < k.acc.n; i++)
                e->acc[k.acc.v[i] >> 5] |= 1u << (k.acc.v[i] & 31);
        free(k.acc.v);
    } else {
        e->n_acc = (uint32_t)k.acc.n;
        e->acc = (uint32_t *)k.acc.v;
    }
    e->n_pop = (uint32_t)k.pops.n;
    e->pops = (uint32_t *)k.pops.v;
    if (e->bits && !e->acc) {
        gentry_free(e);
        return NULL;
    }
    return e;
}

static gentry *cache_get(pd_grammar *g, int32_t st, int *rc)
{
    int32_t key = g->states[st].cache_key;
    gentry *e = atomic_load_explicit(g->slot[key], memory_order_acquire);
    if (e) return e;
    if (g->slot_shared[key]) { /* the share was full: maybe computed here before */
        e = atomic_load_explicit(&g->cache[key], memory_order_acquire);
        if (e) return e;
    }
    e = compute_entry(g, st, rc);
    if (!e) return NULL;
    if (g->slot_shared[key] && gshare_publish(g->v->share, g->slot[key], &e, g->v->n)) return e;
    gentry *expected = NULL;
    if (!atomic_compare_exchange_strong(&g->cache[key], &expected, e)) {
        gentry_free(e);
        e = expected;
    }
    return e;
}

/* ---- matcher ------------------------------------------------------------------------------ */
typedef struct {
    size_t off;
    int32_t n;
    bool accept, term;
} hrec;

struct pd_gmatcher {
    pd_grammar *g;
    store s;
    ivec cur;
    bool accept, term;
    bool ambiguous; /* over PD_GRAMMAR_MAX_STACKS parses: stopped until a rollback */
    ivec hist;
    hrec *rec;
    size_t nrec, caprec;
    ivec tmp, tmp2;
};

int pd_gmatcher_create(pd_grammar *g, pd_gmatcher **out)
{
    *out = NULL;
    pd_gmatcher *m = calloc(1, sizeof *m);
    if (!m) return pd_error(PD_ENOMEM, "grammar: out of memory");
    m->g = pd_grammar_ref(g);
    m->s.gen = 1;
    int32_t root = store_get(&m->s, g->rules[g->root].start, NOPARENT);
    ctx c = {g, &m->s, &m->cur, false, false, false};
    next_gen(&m->s);
    closure(&c, root);
    if (c.oom) {
        pd_gmatcher_free(m);
        return pd_error(PD_ENOMEM, "grammar: out of memory");
    }
    m->accept = c.accept;
    m->term = m->accept && m->cur.n == 0;
    *out = m;
    return 0;
}

void pd_gmatcher_free(pd_gmatcher *m)
{
    if (!m) return;
    store_free(&m->s);
    free(m->cur.v);
    free(m->hist.v);
    free(m->rec);
    free(m->tmp.v);
    free(m->tmp2.v);
    pd_grammar_unref(m->g);
    free(m);
}

static int ivec_copy(ivec *d, const ivec *s)
{
    memset(d, 0, sizeof *d);
    if (ivec_reserve(d, s->n ? s->n : 1) < 0) return -1;
    if (s->n) memcpy(d->v, s->v, sizeof(int32_t) * (size_t)s->n);
    d->n = s->n;
    return 0;
}

int pd_gmatcher_clone(const pd_gmatcher *m, pd_gmatcher **out)
{
    *out = NULL;
    pd_gmatcher *c = calloc(1, sizeof *c);
    if (!c) return pd_error(PD_ENOMEM, "grammar: out of memory");
    c->g = pd_grammar_ref(m->g);
    c->accept = m->accept;
    c->term = m->term;
    c->ambiguous = m->ambiguous;
    if (store_copy(&c->s, &m->s) < 0 || ivec_copy(&c->cur, &m->cur) < 0 ||
        ivec_copy(&c->hist, &m->hist) < 0) {
        pd_gmatcher_free(c);
        return pd_error(PD_ENOMEM, "grammar: out of memory");
    }
    c->s.gen = 1;
    if (m->nrec) {
        c->rec = malloc(sizeof(hrec) * m->nrec);
        if (!c->rec) {
            pd_gmatcher_free(c);
            return pd_error(PD_ENOMEM, "grammar: out of memory");
        }
        memcpy(c->rec, m->rec, sizeof(hrec) * m->nrec);
        c->nrec = c->caprec = m->nrec;
    }
    *out = c;
    return 0;
}

static int save_history(pd_gmatcher *m)
{
    if (m->nrec == m->caprec) {
        size_t cap = m->caprec ? 2 * m->caprec : 64;
        hrec *r = realloc(m->rec, sizeof(hrec) * cap);
        if (!r) return -1;
        m->rec = r;
        m->caprec = cap;
    }
    if (ivec_reserve(&m->hist, m->hist.n + m->cur.n + 1) < 0) return -1;
    hrec *r = &m->rec[m->nrec++];
    r->off = (size_t)m->hist.n;
    r->n = m->cur.n;
    r->accept = m->accept;
    r->term = m->term;
    memcpy(m->hist.v + m->hist.n, m->cur.v, sizeof(int32_t) * (size_t)m->cur.n);
    m->hist.n += m->cur.n;
    return 0;
}

/* Runs bytes through the current set into m->tmp; returns alive (set non-empty or accepting),
 * -1 out of memory or AMBIGUOUS. */
static int run_bytes(pd_gmatcher *m, const uint8_t *p, size_t n, bool *accept)
{
    if (ivec_reserve(&m->tmp, m->cur.n + 1) < 0) return -1;
    memcpy(m->tmp.v, m->cur.v, sizeof(int32_t) * (size_t)m->cur.n);
    m->tmp.n = m->cur.n;
    bool acc = m->accept;
    for (size_t i = 0; i < n; i++) {
        if (m->tmp.n == 0) return 0;
        m->tmp2.n = 0;
        ctx c = {m->g, &m->s, &m->tmp2, false, false, false};
        step(&c, m->tmp.v, m->tmp.n, p[i]);
        if (c.oom) return -1;
        if (m->tmp2.n > PD_GRAMMAR_MAX_STACKS) return AMBIGUOUS;
        ivec t = m->tmp;
        m->tmp = m->tmp2;
        m->tmp2 = t;
        acc = c.accept;
    }
    *accept = acc;
    return m->tmp.n > 0 || acc ? 1 : 0;
}

static int too_ambiguous(void)
{
    return pd_error(PD_EUNSUPPORTED,
                    "grammar: over %d parses at once: the grammar is too ambiguous to follow",
                    PD_GRAMMAR_MAX_STACKS);
}

static int advance(pd_gmatcher *m, const uint8_t *p, size_t n, bool save)
{
    if (m->term) return pd_error(PD_EINVAL, "grammar: the output is complete");
    if (m->ambiguous) return too_ambiguous();
    bool acc = false;
    int r = run_bytes(m, p, n, &acc);
    if (r == AMBIGUOUS) {
        m->ambiguous = true;
        return too_ambiguous();
    }
    if (r < 0) return pd_error(PD_ENOMEM, "grammar: out of memory");
    if (r == 0) return pd_error(PD_EINVAL, "grammar: bytes not allowed here");
    if (save && save_history(m) < 0) return pd_error(PD_ENOMEM, "grammar: out of memory");
    ivec t = m->cur;
    m->cur = m->tmp;
    m->tmp = t;
    m->accept = acc;
    m->term = acc && m->cur.n == 0;
    return 0;
}

int pd_gmatcher_accept_token(pd_gmatcher *m, int32_t id)
{
    const pd_gvocab *v = m->g->v;
    if (id < 0 || id >= v->n) return pd_error(PD_EINVAL, "grammar: token id %d out of range", id);
    if (m->ambiguous) return too_ambiguous();
    if (v->eos[id]) {
        if (!m->accept) return pd_error(PD_EINVAL, "grammar: EOS before the output is complete");
        if (save_history(m) < 0) return pd_error(PD_ENOMEM, "grammar: out of memory");
        m->term = true;
        m->cur.n = 0;
        return 0;
    }
    if (!v->tok[id]) return pd_error(PD_EINVAL, "grammar: special token %d not allowed", id);
    return advance(m, v->tok[id], v->len[id], true);
}

int pd_gmatcher_accept_bytes(pd_gmatcher *m, const void *bytes, size_t len)
{
    return advance(m, bytes, len, true);
}

bool pd_gmatcher_allows(pd_gmatcher *m, int32_t id)
{
    const pd_gvocab *v = m->g->v;
    if (id < 0 || id >= v->n) return false;
    if (v->eos[id]) return m->accept;
    if (!v->tok[id] || m->term || m->ambiguous) return false;
    bool acc;
    int r = run_bytes(m, v->tok[id], v->len[id], &acc);
    if (r == AMBIGUOUS) m->ambiguous = true;
    return r > 0;
}

int pd_gmatcher_fill_mask(pd_gmatcher *m, uint32_t *bits)
{
    pd_grammar *g = m->g;
    const pd_gvocab *v = g->v;
    size_t words = pd_gmask_words(v->n);
    memset(bits, 0, words * sizeof(uint32_t));
    if (m->ambiguous) return too_ambiguous();
    if (!m->term) {
        sink k = {.bits = bits};
        for (int32_t i = 0; i < m->cur.n; i++) {
            int32_t sid = m->cur.v[i];
            frame fr = m->s.f[sid];
            int rc;
            gentry *e = cache_get(g, fr.st, &rc);
            if (!e && rc == AMBIGUOUS) {
                m->ambiguous = true;
                return too_ambiguous();
            }
            if (!e) return pd_error(PD_ENOMEM, "grammar: out of memory");
            if (e->bits) {
                for (size_t w = 0; w < words; w++) bits[w] |= e->acc[w];
            } else {
                for (uint32_t j = 0; j < e->n_acc; j++)
                    bits[e->acc[j] >> 5] |= 1u << (e->acc[j] & 31);
            }
            if (e->n_pop == 0 || fr.parent < 0) continue;
            /* the stacks after this frame ends */
            m->tmp2.n = 0;
            ctx c = {g, &m->s, &m->tmp2, false, false, false};
            next_gen(&m->s);
            closure(&c, fr.parent);
            if (c.oom) return pd_error(PD_ENOMEM, "grammar: out of memory");
            if (m->tmp2.n == 0) continue;
            ivec P;
            if (ivec_copy(&P, &m->tmp2) < 0) return pd_error(PD_ENOMEM, "grammar: out of memory");
            for (uint32_t j = 0; j < e->n_pop; j++)
                if ((rc = walk(g, &m->s, e->pops[j], P.v, P.n, &k)) < 0) {
                    free(P.v);
                    if (rc != AMBIGUOUS) return pd_error(PD_ENOMEM, "grammar: out of memory");
                    m->ambiguous = true;
                    return too_ambiguous();
                }
            free(P.v);
        }
    }
    if (m->accept)
        for (size_t i = 0; i < v->n_eos; i++)
            bits[v->eos_ids[i] >> 5] |= 1u << (v->eos_ids[i] & 31);
    return 0;
}

bool pd_gmatcher_is_accepting(const pd_gmatcher *m)
{
    return m->accept;
}
bool pd_gmatcher_is_terminated(const pd_gmatcher *m)
{
    return m->term;
}
bool pd_gmatcher_too_ambiguous(const pd_gmatcher *m)
{
    return m->ambiguous;
}
size_t pd_gmatcher_history(const pd_gmatcher *m)
{
    return m->nrec;
}

int pd_gmatcher_rollback(pd_gmatcher *m, size_t k)
{
    if (k > m->nrec)
        return pd_error(PD_EINVAL, "grammar: rollback of %zu past %zu tokens", k, m->nrec);
    if (k == 0) return 0;
    hrec r = m->rec[m->nrec - k];
    m->nrec -= k;
    if (ivec_reserve(&m->cur, r.n + 1) < 0) return pd_error(PD_ENOMEM, "grammar: out of memory");
    memcpy(m->cur.v, m->hist.v + r.off, sizeof(int32_t) * (size_t)r.n);
    m->cur.n = r.n;
    m->accept = r.accept;
    m->term = r.term;
    m->ambiguous = false;
    m->hist.n = (int32_t)r.off;
    return 0;
}
