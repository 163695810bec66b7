/* Expressions -> one byte-level DFA per rule (Thompson NFA, subset construction over byte
 * classes and call labels), with non-recursive rules inlined, dead ends pruned, left
 * recursion refused, and states of call-free rules grouped by their behaviour up to the
 * longest token (those share a mask-cache entry). */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/gram_internal.h"
#include "util/hash.h"
#include "util/status.h"

/* ---- NFA ------------------------------------------------------------------------------ */
enum { NE_EPS, NE_BYTES, NE_CALL };
typedef struct {
    int32_t to, next, rule;
    uint8_t kind, lo, hi;
} nedge;

typedef struct {
    nedge *e;
    int32_t ne, cape;
    int32_t *head;
    int32_t nn, capn;
} nfa;

typedef struct {
    gb *b;
    bool *recursive;
    int32_t *gid; /* builder rule -> grammar rule, -1 */
    int32_t *work;
    int32_t n_work;
    int depth;
    long states_left;
    int32_t *nrefs;   /* call sites per builder rule */
    int force_inline; /* inside an intersection/complement: every non-recursive rule inlines */
    int64_t *isize;   /* per builder rule: its body's size inlined (inline_size), -1 not yet */
} cc;

static int32_t nnode(cc *c, nfa *n)
{
    if (c->b->status < 0) return -1;
    if (--c->b->budget < 0) {
        gb_fail(c->b, PD_EUNSUPPORTED, "", "", -1,
                "grammar too large: over %d automaton nodes (large repetition bounds such as "
                "maxLength/maxItems multiply the size)",
                PD_GRAMMAR_MAX_NFA);
        return -1;
    }
    if (n->nn == n->capn) {
        int32_t cap = n->capn ? 2 * n->capn : 64;
        int32_t *h = realloc(n->head, sizeof(int32_t) * (size_t)cap);
        if (!h) {
            gb_fail(c->b, PD_ENOMEM, "", "", -1, "out of memory");
            return -1;
        }
        n->head = h;
        n->capn = cap;
    }
    n->head[n->nn] = -1;
    return n->nn++;
}

static void nadd(cc *c, nfa *n, int32_t from, int kind, uint8_t lo, uint8_t hi, int32_t rule,
                 int32_t to)
{
    if (from < 0 || to < 0 || c->b->status < 0) return;
    if (n->ne == n->cape) {
        int32_t cap = n->cape ? 2 * n->cape : 64;
        nedge *e = realloc(n->e, sizeof(nedge) * (size_t)cap);
        if (!e) {
            gb_fail(c->b, PD_ENOMEM, "", "", -1, "out of memory");
            return;
        }
        n->e = e;
        n->cape = cap;
    }
    nedge *e = &n->e[n->ne];
    e->to = to;
    e->kind = (uint8_t)kind;
    e->lo = lo;
    e->hi = hi;
    e->rule = rule;
    e->next = n->head[from];
    n->head[from] = n->ne++;
}

static void nfa_free(nfa *n)
{
    free(n->e);
    free(n->head);
    memset(n, 0, sizeof *n);
}

/* ---- DFA ------------------------------------------------------------------------------ */
typedef struct {
    int32_t n, cap, cap_hint; /* cap_hint: the first capacity */
    int32_t ncls;
    uint8_t cls[256];
    int32_t *trans;
    uint8_t *final;
    int32_t *call_off, *call_n;
    gcall *calls; /* callee is a grammar rule id, ret a local state */
    int32_t ncalls, capcalls;
} dfa;

static void dfa_free(dfa *d)
{
    free(d->trans);
    free(d->final);
    free(d->call_off);
    free(d->call_n);
    free(d->calls);
    memset(d, 0, sizeof *d);
}

static int dfa_add_state(cc *c, dfa *d)
{
    if (--c->states_left < 0) {
        gb_fail(c->b, PD_EUNSUPPORTED, "", "", -1,
                "grammar too large: over %d automaton states (large repetition bounds such "
                "as maxLength/maxItems multiply the size)",
                PD_GRAMMAR_MAX_STATES);
        return -1;
    }
    if (d->n == d->cap) {
        int32_t cap = d->cap ? 2 * d->cap : d->cap_hint > 16 ? d->cap_hint : 16;
        int32_t *t = realloc(d->trans, sizeof(int32_t) * (size_t)cap * (size_t)d->ncls);
        uint8_t *f = realloc(d->final, (size_t)cap);
        int32_t *co = realloc(d->call_off, sizeof(int32_t) * (size_t)cap);
        int32_t *cn = realloc(d->call_n, sizeof(int32_t) * (size_t)cap);
        if (t) d->trans = t;
        if (f) d->final = f;
        if (co) d->call_off = co;
        if (cn) d->call_n = cn;
        if (!t || !f || !co || !cn) {
            gb_fail(c->b, PD_ENOMEM, "", "", -1, "out of memory");
            return -1;
        }
        d->cap = cap;
    }
    int32_t s = d->n++;
    for (int32_t k = 0; k < d->ncls; k++) d->trans[(size_t)s * (size_t)d->ncls + (size_t)k] = -1;
    d->final[s] = 0;
    d->call_off[s] = d->ncalls;
    d->call_n[s] = 0;
    return s;
}

static int dfa_add_call(cc *c, dfa *d, int32_t s, int32_t callee, int32_t ret)
{
    if (d->ncalls == d->capcalls) {
        int32_t cap = d->capcalls ? 2 * d->capcalls : 16;
        gcall *x = realloc(d->calls, sizeof(gcall) * (size_t)cap);
        if (!x) return gb_fail(c->b, PD_ENOMEM, "", "", -1, "out of memory");
        d->calls = x;
        d->capcalls = cap;
    }
    d->calls[d->ncalls].callee = callee;
    d->calls[d->ncalls].ret = ret;
    d->ncalls++;
    d->call_n[s]++;
    return 0;
}

/* hash set of state sets */
typedef struct {
    int32_t *pool;
    size_t npool, cappool;
    int32_t *off, *len;
    int32_t *slots;
    uint32_t mask;
    int32_t n;
} setmap;

static uint64_t set_hash(const int32_t *s, int32_t n)
{
    uint64_t h = 0x12345 + (uint64_t)n;
    for (int32_t i = 0; i < n; i++) h = pd_mix64(h ^ (uint64_t)(uint32_t)s[i]);
    return h;
}

/* returns the id of set s (inserting it as id == map->n when new: *fresh = true) */
static int32_t setmap_get(setmap *m, const int32_t *s, int32_t n, bool *fresh)
{
    *fresh = false;
    if ((uint32_t)(m->n + 1) * 2 > m->mask + 1) {
        uint32_t cap = (m->mask + 1) * 2;
        if (cap < 64) cap = 64;
        int32_t *sl = malloc(sizeof(int32_t) * cap);
        if (!sl) return -2;
        for (uint32_t i = 0; i < cap; i++) sl[i] = -1;
        for (int32_t i = 0; i < m->n; i++) {
            uint32_t h = (uint32_t)set_hash(m->pool + m->off[i], m->len[i]) & (cap - 1);
            while (sl[h] >= 0) h = (h + 1) & (cap - 1);
            sl[h] = i;
        }
        free(m->slots);
        m->slots = sl;
        m->mask = cap - 1;
        int32_t *o = realloc(m->off, sizeof(int32_t) * cap);
        int32_t *l = realloc(m->len, sizeof(int32_t) * cap);
        if (o) m->off = o;
        if (l) m->len = l;
        if (!o || !l) return -2;
    }
    uint32_t h = (uint32_t)set_hash(s, n) & m->mask;
    while (m->slots[h] >= 0) {
        int32_t id = m->slots[h];
        if (m->len[id] == n && memcmp(m->pool + m->off[id], s, sizeof(int32_t) * (size_t)n) == 0)
            return id;
        h = (h + 1) & m->mask;
    }
    if (m->npool + (size_t)n > m->cappool) {
        size_t cap = m->cappool ? m->cappool * 2 : 1024;
        while (cap < m->npool + (size_t)n) cap *= 2;
        int32_t *p = realloc(m->pool, sizeof(int32_t) * cap);
        if (!p) return -2;
        m->pool = p;
        m->cappool = cap;
    }
    memcpy(m->pool + m->npool, s, sizeof(int32_t) * (size_t)n);
    m->off[m->n] = (int32_t)m->npool;
    m->len[m->n] = n;
    m->npool += (size_t)n;
    m->slots[h] = m->n;
    *fresh = true;
    return m->n++;
}

static void setmap_free(setmap *m)
{
    free(m->pool);
    free(m->off);
    free(m->len);
    free(m->slots);
}

/* Ascending sorts without a comparison callback (subset construction sorts every state's NFA
 * set and labelled edges, so qsort's indirect calls showed in profiles): quicksort, pivot the
 * median of three moved to the front (Hoare's partition then never returns an empty side),
 * recursing into the smaller side, and insertion sort for runs of up to 24. */
#define DEFINE_SORT(name, T, LESS)                                                                 \
    static void name(T *a, size_t n)                                                               \
    {                                                                                              \
        while (n > 24) {                                                                           \
            size_t m = n / 2, h = n - 1, k = 0;                                                    \
            if (LESS(a[m], a[0]) != LESS(a[m], a[h]))                                              \
                k = m;                                                                             \
            else if (LESS(a[h], a[0]) != LESS(a[h], a[m]))                                         \
                k = h;                                                                             \
            T p = a[k];                                                                            \
            a[k] = a[0];                                                                           \
            a[0] = p;                                                                              \
            ptrdiff_t i = -1, j = (ptrdiff_t)n;                                                    \
            for (;;) {                                                                             \
                do i++;                                                                            \
                while (LESS(a[i], p));                                                             \
                do j--;                                                                            \
                while (LESS(p, a[j]));                                                             \
                if (i >= j) break;                                                                 \
                T t = a[i];                                                                        \
                a[i] = a[j];                                                                       \
                a[j] = t;                                                                          \
            }                                                                                      \
            size_t left = (size_t)j + 1; /* [0, left) <= p <= [left, n) */                         \
            if (left < n - left) {                                                                 \
                name(a, left);                                                                     \
                a += left;                                                                         \
                n -= left;                                                                         \
            } else {                                                                               \
                name(a + left, n - left);                                                          \
                n = left;                                                                          \
            }                                                                                      \
        }                                                                                          \
        for (size_t i = 1; i < n; i++) {                                                           \
            T x = a[i];                                                                            \
            size_t j = i;                                                                          \
            for (; j > 0 && LESS(x, a[j - 1]); j--) a[j] = a[j - 1];                               \
            a[j] = x;                                                                              \
        }                                                                                          \
    }
#define LESS_SCALAR(x, y) ((x) < (y))
DEFINE_SORT(sort_u64, uint64_t, LESS_SCALAR)
DEFINE_SORT(sort_i32, int32_t, LESS_SCALAR)

typedef struct {
    const nfa *n;
    uint32_t *stamp;
    uint32_t gen;
    int32_t *stack, *out;
} closer;

/* epsilon closure of seeds (modifies nothing else); result sorted in c->out, returns count */
static int32_t closure(closer *c, const int32_t *seeds, int32_t ns)
{
    c->gen++;
    int32_t sp = 0, no = 0;
    for (int32_t i = 0; i < ns; i++)
        if (c->stamp[seeds[i]] != c->gen) {
            c->stamp[seeds[i]] = c->gen;
            c->stack[sp++] = seeds[i];
        }
    while (sp > 0) {
        int32_t u = c->stack[--sp];
        c->out[no++] = u;
        for (int32_t e = c->n->head[u]; e >= 0; e = c->n->e[e].next)
            if (c->n->e[e].kind == NE_EPS && c->stamp[c->n->e[e].to] != c->gen) {
                c->stamp[c->n->e[e].to] = c->gen;
                c->stack[sp++] = c->n->e[e].to;
            }
    }
    sort_i32(c->out, (size_t)no);
    return no;
}

static void byte_classes(const nfa *n, uint8_t *cls, int32_t *ncls)
{
    uint8_t cut[257] = {0};
    for (int32_t i = 0; i < n->ne; i++)
        if (n->e[i].kind == NE_BYTES) {
            cut[n->e[i].lo] = 1;
            cut[n->e[i].hi + 1] = 1;
        }
    int32_t k = 0;
    for (int b = 0; b < 256; b++) {
        if (b > 0 && cut[b]) k++;
        cls[b] = (uint8_t)k;
    }
    *ncls = k + 1;
}

static int determinize(cc *c, const nfa *n, int32_t start, int32_t final, dfa *d)
{
    memset(d, 0, sizeof *d);
    byte_classes(n, d->cls, &d->ncls);
    /* the DFA's first capacity: a third of the NFA's nodes (the dev set's rules come out at a
     * third to a half), up to 65,536 states; growing from 16 copied the table over and over */
    d->cap_hint = n->nn / 3 < 65536 ? n->nn / 3 : 65536;
    closer cl = {n, calloc((size_t)n->nn, sizeof(uint32_t)), 0,
                 malloc(sizeof(int32_t) * (size_t)n->nn), malloc(sizeof(int32_t) * (size_t)n->nn)};
    setmap m = {0};
    /* The NFA targets of a transition (its kernel) before their closure: most transitions lead
     * to a state made before, and looking up the few targets skips the closure, its sort and
     * the lookup of the whole set. kid[k]: the DFA state of kernel k. */
    setmap km = {0};
    int32_t *kid = NULL, capkid = 0;
    uint64_t *pairs = NULL, *grouped = NULL; /* (label << 32) | NFA target */
    size_t cappairs = 0;
    int32_t cnt[258];
    int32_t *seeds = malloc(sizeof(int32_t) * (size_t)n->nn);
    int rc = 0;
    if (!cl.stamp || !cl.stack || !cl.out || !seeds) {
        rc = gb_fail(c->b, PD_ENOMEM, "", "", -1, "out of memory");
        goto done;
    }
    int32_t k = closure(&cl, &start, 1);
    bool fresh;
    if (setmap_get(&m, cl.out, k, &fresh) < 0 || dfa_add_state(c, d) < 0) {
        rc =
            c->b->status < 0 ? c->b->status : gb_fail(c->b, PD_ENOMEM, "", "", -1, "out of memory");
        goto done;
    }
    for (int32_t s = 0; s < d->n; s++) {
        size_t np = 0;
        const int32_t *set = m.pool + m.off[s];
        int32_t len = m.len[s];
        d->call_off[s] = d->ncalls;
        for (int32_t i = 0; i < len; i++) {
            int32_t u = set[i];
            if (u == final) d->final[s] = 1;
            for (int32_t e = n->head[u]; e >= 0; e = n->e[e].next) {
                const nedge *E = &n->e[e];
                if (E->kind == NE_EPS) continue;
                int32_t lo = E->kind == NE_BYTES ? d->cls[E->lo] : 1000 + E->rule;
                int32_t hi = E->kind == NE_BYTES ? d->cls[E->hi] : 1000 + E->rule;
                for (int32_t k2 = lo; k2 <= hi; k2++) {
                    if (np == cappairs) {
                        cappairs = cappairs ? cappairs * 2 : 256;
                        uint64_t *p = realloc(pairs, sizeof *p * cappairs);
                        if (p) pairs = p;
                        uint64_t *q = realloc(grouped, sizeof *q * cappairs);
                        if (q) grouped = q;
                        if (!p || !q) {
                            rc = gb_fail(c->b, PD_ENOMEM, "", "", -1, "out of memory");
                            goto done;
                        }
                    }
                    pairs[np++] = (uint64_t)(uint32_t)k2 << 32 | (uint32_t)E->to;
                }
            }
        }
        /* grouped by label: byte classes in order by counting, then the calls sorted */
        memset(cnt, 0, sizeof(int32_t) * (size_t)(d->ncls + 2));
        for (size_t i = 0; i < np; i++) {
            int32_t key = (int32_t)(pairs[i] >> 32);
            cnt[(key < 1000 ? key : d->ncls) + 1]++;
        }
        for (int32_t b = 0; b <= d->ncls; b++) cnt[b + 1] += cnt[b];
        int32_t ncall = cnt[d->ncls + 1] - cnt[d->ncls];
        for (size_t i = 0; i < np; i++) {
            int32_t key = (int32_t)(pairs[i] >> 32);
            grouped[cnt[key < 1000 ? key : d->ncls]++] = pairs[i];
        }
        if (np) {
            sort_u64(grouped + np - ncall, (size_t)ncall);
            uint64_t *t = pairs;
            pairs = grouped;
            grouped = t;
        }
        for (size_t i = 0; i < np;) {
            size_t j = i;
            int32_t ns = 0;
            int32_t key = (int32_t)(pairs[i] >> 32);
            while (j < np && (int32_t)(pairs[j] >> 32) == key) {
                int32_t to = (int32_t)(uint32_t)pairs[j];
                if (ns == 0 || seeds[ns - 1] != to) seeds[ns++] = to;
                j++;
            }
            sort_i32(seeds, (size_t)ns);
            int32_t nu = 0;
            for (int32_t q = 0; q < ns; q++)
                if (nu == 0 || seeds[nu - 1] != seeds[q]) seeds[nu++] = seeds[q];
            int32_t kidx = setmap_get(&km, seeds, nu, &fresh);
            int32_t id = kidx >= 0 && !fresh ? kid[kidx] : -1;
            if (kidx >= 0 && fresh) {
                if (kidx == capkid) {
                    capkid = capkid ? 2 * capkid : 256;
                    int32_t *g = realloc(kid, sizeof(int32_t) * (size_t)capkid);
                    if (!g) {
                        rc = gb_fail(c->b, PD_ENOMEM, "", "", -1, "out of memory");
                        goto done;
                    }
                    kid = g;
                }
                int32_t kk = closure(&cl, seeds, nu);
                id = setmap_get(&m, cl.out, kk, &fresh);
                if (id >= 0 && fresh && dfa_add_state(c, d) < 0) {
                    rc = c->b->status;
                    goto done;
                }
                kid[kidx] = id;
            }
            if (kidx < 0 || id < 0) {
                rc = gb_fail(c->b, PD_ENOMEM, "", "", -1, "out of memory");
                goto done;
            }
            if (key < 1000)
                d->trans[(size_t)s * (size_t)d->ncls + (size_t)key] = id;
            else if ((rc = dfa_add_call(c, d, s, key - 1000, id)) < 0)
                goto done;
            i = j;
        }
    }
done:
    free(cl.stamp);
    free(cl.stack);
    free(cl.out);
    free(seeds);
    free(pairs);
    free(grouped);
    setmap_free(&m);
    setmap_free(&km);
    free(kid);
    if (rc < 0) dfa_free(d);
    return rc;
}

/* Marks states that can reach a final state (callees assumed non-empty); cuts the rest. Returns
 * whether the start state survives. */
static bool dfa_prune(dfa *d)
{
    uint8_t *live = calloc((size_t)d->n, 1);
    if (!live) return true;
    for (int32_t s = 0; s < d->n; s++) live[s] = d->final[s];
    bool changed = true;
    while (changed) { /* small automata: a fixpoint is fine */
        changed = false;
        for (int32_t s = d->n - 1; s >= 0; s--) {
            if (live[s]) continue;
            bool l = false;
            for (int32_t k = 0; k < d->ncls && !l; k++) {
                int32_t t = d->trans[(size_t)s * (size_t)d->ncls + (size_t)k];
                if (t >= 0 && live[t]) l = true;
            }
            for (int32_t i = 0; i < d->call_n[s] && !l; i++)
                if (live[d->calls[d->call_off[s] + i].ret]) l = true;
            if (l) {
                live[s] = 1;
                changed = true;
            }
        }
    }
    for (int32_t s = 0; s < d->n; s++) {
        for (int32_t k = 0; k < d->ncls; k++) {
            int32_t *t = &d->trans[(size_t)s * (size_t)d->ncls + (size_t)k];
            if (*t >= 0 && !live[*t]) *t = -1;
        }
        if (!d->calls) continue;
        gcall *cs = d->calls + d->call_off[s];
        int32_t m = 0;
        for (int32_t i = 0; i < d->call_n[s]; i++)
            if (live[cs[i].ret]) cs[m++] = cs[i];
        d->call_n[s] = m;
    }
    bool ok = d->n > 0 && live[0];
    free(live);
    return ok;
}

/* ---- Thompson construction ----------------------------------------------------------------- */
static int32_t frag(cc *c, nfa *n, gx *x, int32_t s);

static int32_t rule_gid(cc *c, int32_t r)
{
    if (c->gid[r] < 0) {
        c->gid[r] = c->n_work;
        c->work[c->n_work++] = r;
    }
    return c->gid[r];
}

/* A rule used at one place is inlined there (no call at match time), unless its body is larger
 * than MAX_INLINE nodes inlined: then it is a rule of its own, determinized on its own with its
 * own byte classes. The caller's automaton would otherwise carry it in every row of its table
 * (Kubernetes objects inlining a hundred definitions: one rule of 112,534 states and 73 classes,
 * 381 ms of subset construction over sets of the whole object). Over the dev set of
 * docs/benchmarks.md, a cap of 20,000 gave a compile mean of 10.1 ms, 5,000 9.1 ms, 2,000 9.1 ms
 * with slower masks (more calls). */
#define MAX_INLINE 5000

static bool inlines(const cc *c, int32_t r)
{
    return !c->recursive[r] && !c->b->rules[r].keep && c->nrefs[r] <= 1;
}

static int64_t rule_size(cc *c, int32_t r);

/* The NFA nodes x makes, roughly (saturating): calls that inline count their rule's body. */
static int64_t inline_size(cc *c, const gx *x)
{
    const int64_t cap = (int64_t)1 << 40;
    int64_t n = 1;
    switch (x->kind) {
    case X_SEQ:
    case X_ALT:
    case X_AND:
    case X_NOT:
        for (int32_t i = 0; i < x->n && n < cap; i++) n += inline_size(c, x->kids[i]);
        break;
    case X_REP: {
        int64_t copies = x->max < 0 ? (int64_t)x->min + 1 : (int64_t)x->max;
        n += inline_size(c, x->kids[0]) * (copies > 1 ? copies : 1);
        break;
    }
    case X_CALL:
        if (inlines(c, x->rule)) n += rule_size(c, x->rule);
        break;
    case X_GRAPH:
        n += x->g_nodes;
        for (int32_t i = 0; i < x->n && n < cap; i++)
            if (x->g_edges[i].x) n += inline_size(c, x->g_edges[i].x);
        break;
    default: break;
    }
    return n < cap ? n : cap;
}

static int64_t rule_size(cc *c, int32_t r)
{
    if (c->isize[r] < 0) c->isize[r] = inline_size(c, c->b->rules[r].body) + 1;
    return c->isize[r];
}

/* Emits DFA d into n from s; returns the end node. */
static int32_t emit_dfa(cc *c, nfa *n, const dfa *d, int32_t s)
{
    int32_t e = nnode(c, n);
    int32_t *map = malloc(sizeof(int32_t) * (size_t)(d->n ? d->n : 1));
    if (!map || e < 0) {
        free(map);
        return -1;
    }
    for (int32_t i = 0; i < d->n; i++) map[i] = nnode(c, n);
    nadd(c, n, s, NE_EPS, 0, 0, -1, map[0]);
    /* the bytes as runs of one class (start[r], class cl[r]), read per state instead of bytes */
    int start[257], cl[256], nr = 0;
    for (int b = 0; b < 256; b++)
        if (b == 0 || d->cls[b] != d->cls[b - 1]) {
            start[nr] = b;
            cl[nr++] = d->cls[b];
        }
    start[nr] = 256;
    for (int32_t i = 0; i < d->n; i++) {
        if (d->final[i]) nadd(c, n, map[i], NE_EPS, 0, 0, -1, e);
        const int32_t *row = d->trans + (size_t)i * (size_t)d->ncls;
        for (int r = 0; r < nr;) {
            int32_t t = row[cl[r]];
            int r2 = r + 1;
            while (r2 < nr && row[cl[r2]] == t) r2++;
            if (t >= 0)
                nadd(c, n, map[i], NE_BYTES, (uint8_t)start[r], (uint8_t)(start[r2] - 1), -1,
                     map[t]);
            r = r2;
        }
    }
    free(map);
    return c->b->status < 0 ? -1 : e;
}

/* A call-free expression as a standalone DFA. */
static int sub_dfa(cc *c, gx *x, dfa *d)
{
    nfa m = {0};
    int32_t s = nnode(c, &m);
    c->force_inline++;
    int32_t e = s >= 0 ? frag(c, &m, x, s) : -1;
    c->force_inline--;
    if (e < 0) {
        nfa_free(&m);
        return c->b->status < 0 ? c->b->status : -1;
    }
    for (int32_t i = 0; i < m.ne; i++)
        if (m.e[i].kind == NE_CALL) {
            nfa_free(&m);
            return gb_fail(c->b, PD_EUNSUPPORTED, "", "", -1,
                           "a recursive rule inside an intersection or complement");
        }
    int rc = determinize(c, &m, s, e, d);
    nfa_free(&m);
    return rc;
}

/* ---- partition refinement -------------------------------------------------------------- */
typedef struct {
    int32_t s, cls;
    uint64_t sig;
} gmover;

#define LESS_MOVER(x, y) ((x).cls < (y).cls || ((x).cls == (y).cls && (x).sig < (y).sig))
DEFINE_SORT(sort_movers, gmover, LESS_MOVER)

/* A call-free automaton's tables as the refinement reads them: a rule of a compiled grammar or
 * a DFA being built. */
typedef struct {
    const int32_t *trans; /* n x m, row by row; targets are state + off, -1 none */
    int32_t off, n, m;
    const uint8_t *final; /* n */
} gtable;

/* What state i leads to on each byte class, as a hash of the target classes. */
static uint64_t succ_sig(const gtable *T, int32_t i, const int32_t *cls)
{
    const int32_t *t = T->trans + (size_t)i * (size_t)T->m;
    uint64_t x = 0x9e37;
    for (int32_t k = 0; k < T->m; k++)
        x = pd_mix64(x ^ (t[k] < 0 ? 0xdeadull << 32 : (uint64_t)(uint32_t)cls[t[k] - T->off]) ^
                     ((uint64_t)k << 48));
    return x;
}

/* Groups the states of a call-free automaton that behave the same on every byte string of up
 * to rounds bytes (the same ends and dead ends; with no bound, its minimal DFA's states):
 * Moore's partition refinement, one round per byte, with stable class numbers and a worklist.
 * A round looks again only at the predecessors of the states that changed class in the round
 * before, so a long chain (a string of maxLength 4,096: states far from its end all alike)
 * costs its transitions plus one layer per round rather than every state per round. cls[i]
 * gets state i's class (not dense); returns the number of class numbers used, -1 out of
 * memory. */
static int32_t bounded_classes(const gtable *T, uint32_t rounds, int32_t *cls)
{
    int32_t n = T->n, m = T->m, nc = 2, cap = 64;
    int32_t *poff = calloc((size_t)n + 1, sizeof(int32_t));
    int32_t *pred = malloc(sizeof(int32_t) * ((size_t)n * (size_t)m + 1));
    int32_t *size = malloc(sizeof(int32_t) * (size_t)cap);
    uint64_t *csig = malloc(sizeof(uint64_t) * (size_t)cap);
    bool *valid = calloc((size_t)cap, 1);
    uint32_t *stamp = calloc((size_t)n, sizeof(uint32_t));
    int32_t *aff = malloc(sizeof(int32_t) * (size_t)n),
            *dirty = malloc(sizeof(int32_t) * (size_t)n);
    gmover *mv = malloc(sizeof(gmover) * (size_t)n);
    int32_t rc = -1;
    if (!poff || !pred || !size || !csig || !valid || !stamp || !aff || !dirty || !mv) goto out;
    for (int32_t i = 0; i < n; i++) {
        const int32_t *t = T->trans + (size_t)i * (size_t)m;
        for (int32_t k = 0; k < m; k++)
            if (t[k] >= 0) poff[t[k] - T->off + 1]++;
    }
    for (int32_t i = 0; i < n; i++) {
        poff[i + 1] += poff[i];
        dirty[i] = poff[i]; /* fill cursor */
    }
    for (int32_t i = 0; i < n; i++) {
        const int32_t *t = T->trans + (size_t)i * (size_t)m;
        for (int32_t k = 0; k < m; k++)
            if (t[k] >= 0) pred[dirty[t[k] - T->off]++] = i;
    }
    size[0] = size[1] = 0;
    for (int32_t i = 0; i < n; i++) {
        cls[i] = T->final[i] ? 1 : 0;
        size[cls[i]]++;
        aff[i] = i;
    }
    int32_t na = n;
    for (uint32_t round = 1; round <= rounds && na > 0; round++) {
        int32_t nm = 0;
        for (int32_t j = 0; j < na; j++) {
            int32_t s = aff[j], c = cls[s];
            uint64_t x = succ_sig(T, s, cls);
            if (!valid[c]) {
                csig[c] = x;
                valid[c] = true;
            }
            if (x != csig[c]) mv[nm++] = (gmover){s, c, x};
        }
        if (nm == 0) break; /* stable: every later round would be the same */
        sort_movers(mv, (size_t)nm);
        int32_t nd = 0;
        for (int32_t a = 0; a < nm;) {
            int32_t c = mv[a].cls, e = a, keep = -1, best = 0;
            while (e < nm && mv[e].cls == c) e++;
            if (e - a == size[c]) /* no state stays: the largest group keeps the number */
                for (int32_t p = a; p < e;) {
                    int32_t q = p;
                    while (q < e && mv[q].sig == mv[p].sig) q++;
                    if (q - p > best) best = q - p, keep = p;
                    p = q;
                }
            for (int32_t p = a; p < e;) {
                int32_t q = p;
                while (q < e && mv[q].sig == mv[p].sig) q++;
                if (p == keep) {
                    csig[c] = mv[p].sig;
                } else {
                    if (nc == cap) {
                        cap *= 2;
                        int32_t *s2 = realloc(size, sizeof(int32_t) * (size_t)cap);
                        if (s2) size = s2;
                        uint64_t *c2 = realloc(csig, sizeof(uint64_t) * (size_t)cap);
                        if (c2) csig = c2;
                        bool *v2 = realloc(valid, (size_t)cap);
                        if (v2) valid = v2;
                        if (!s2 || !c2 || !v2) goto out;
                    }
                    int32_t nw = nc++;
                    csig[nw] = mv[p].sig;
                    valid[nw] = true;
                    size[nw] = q - p;
                    size[c] -= q - p;
                    for (int32_t r = p; r < q; r++) {
                        cls[mv[r].s] = nw;
                        dirty[nd++] = mv[r].s;
                    }
                }
                p = q;
            }
            a = e;
        }
        na = 0;
        for (int32_t j = 0; j < nd; j++)
            for (int32_t p = poff[dirty[j]]; p < poff[dirty[j] + 1]; p++)
                if (stamp[pred[p]] != round) {
                    stamp[pred[p]] = round;
                    aff[na++] = pred[p];
                }
    }
    rc = nc;
out:
    free(poff);
    free(pred);
    free(size);
    free(csig);
    free(valid);
    free(stamp);
    free(aff);
    free(dirty);
    free(mv);
    return rc;
}

/* ---- repeated sub-automata ----------------------------------------------------------------
 * A bounded repetition copies its expression once per count (a string of maxLength 4,096 is
 * 4,096 copies of a JSON character). Thompson's construction of one JSON character, through
 * subset construction, gives about 35 states per copy (each UTF-8 lead-byte range and escape
 * its own); minimized it has 13. So a call-free repeated expression is determinized and
 * minimized once, and that DFA is what each copy emits: the rule's automaton gets the minimal
 * states per count, and so does everything after it (tables, cache keys, masks). */
static bool call_free(const gx *x, int depth)
{
    if (depth > 64 || x->kind == X_CALL || x->kind == X_GRAPH) return false;
    for (int32_t i = 0; i < x->n; i++)
        if (!call_free(x->kids[i], depth + 1)) return false;
    return true;
}

/* A call-free, pruned DFA minimized (bounded_classes without a bound), renumbered breadth first
 * from the start (unreachable states dropped). -1 out of memory (d unchanged). */
static int dfa_minimize(dfa *d)
{
    int32_t n = d->n, m = d->ncls;
    if (n <= 1) return 0;
    int32_t *cls = malloc(sizeof(int32_t) * (size_t)n);
    int32_t *newid = NULL, *rep = NULL, *queue = NULL, *nt = NULL;
    uint8_t *nf = NULL;
    int rc = -1;
    gtable T = {d->trans, 0, n, m, d->final};
    int32_t ncl = cls ? bounded_classes(&T, UINT32_MAX, cls) : -1;
    if (ncl < 0) goto out;
    newid = malloc(sizeof(int32_t) * (size_t)ncl);
    rep = malloc(sizeof(int32_t) * (size_t)ncl);
    queue = malloc(sizeof(int32_t) * (size_t)ncl);
    nt = malloc(sizeof(int32_t) * (size_t)ncl * (size_t)m);
    nf = malloc((size_t)ncl);
    if (!newid || !rep || !queue || !nt || !nf) goto out;
    for (int32_t q = 0; q < ncl; q++) newid[q] = -1;
    for (int32_t i = n - 1; i >= 0; i--) rep[cls[i]] = i;
    int32_t nq = 0;
    newid[cls[0]] = nq;
    queue[nq++] = cls[0];
    for (int32_t h = 0; h < nq; h++) {
        int32_t r = rep[queue[h]];
        nf[h] = d->final[r];
        for (int32_t k = 0; k < m; k++) {
            int32_t t = d->trans[(size_t)r * (size_t)m + (size_t)k];
            if (t >= 0 && newid[cls[t]] < 0) {
                newid[cls[t]] = nq;
                queue[nq++] = cls[t];
            }
            nt[(size_t)h * (size_t)m + (size_t)k] = t < 0 ? -1 : newid[cls[t]];
        }
    }
    memcpy(d->trans, nt, sizeof(int32_t) * (size_t)nq * (size_t)m);
    memcpy(d->final, nf, (size_t)nq);
    for (int32_t i = 0; i < nq; i++) d->call_off[i] = d->call_n[i] = 0;
    d->n = nq;
    rc = 0;
out:
    free(cls);
    free(newid);
    free(rep);
    free(queue);
    free(nt);
    free(nf);
    return rc;
}

/* The minimal DFA of the call-free expression x, for the copies of a repetition: 1 when made,
 * 0 to copy x itself (it matches nothing, or memory ran out), a status when the build fails. */
static int rep_dfa(cc *c, gx *x, dfa *d)
{
    int rc = sub_dfa(c, x, d);
    if (rc < 0) return rc;
    if (!dfa_prune(d) || dfa_minimize(d) < 0) {
        dfa_free(d);
        return 0;
    }
    return 1;
}

static int dfa_product(cc *c, const dfa *a, const dfa *b2, bool complement_b, dfa *out)
{
    /* complement_b: b2 completed with a sink and its finals flipped */
    memset(out, 0, sizeof *out);
    int32_t pairmap[256][2];
    int32_t k = 0;
    uint8_t seen[256][256];
    memset(seen, 0, sizeof seen);
    int32_t id_of[256][256];
    for (int bb = 0; bb < 256; bb++) {
        int x = a->cls[bb], y = b2->cls[bb];
        if (!seen[x][y]) {
            seen[x][y] = 1;
            id_of[x][y] = k;
            pairmap[k][0] = x;
            pairmap[k][1] = y;
            k++;
        }
        out->cls[bb] = (uint8_t)id_of[x][y];
    }
    out->ncls = k;
    int32_t sink = b2->n; /* b2 state index of the sink (complement only) */
    int32_t nb = b2->n + 1;
    /* pair (i, j) -> state; sparse via a hash of i*nb+j */
    setmap m = {0};
    int32_t p0[2] = {0, 0};
    bool fresh;
    if (setmap_get(&m, p0, 2, &fresh) < 0 || dfa_add_state(c, out) < 0) {
        setmap_free(&m);
        return c->b->status < 0 ? c->b->status
                                : gb_fail(c->b, PD_ENOMEM, "", "", -1, "out of memory");
    }
    for (int32_t s = 0; s < out->n; s++) {
        int32_t i = m.pool[m.off[s]], j = m.pool[m.off[s] + 1];
        bool fb = j == sink ? true : (b2->final[j] != 0);
        if (complement_b) fb = j == sink ? true : !b2->final[j];
        out->final[s] = a->final[i] && fb;
        out->call_off[s] = 0;
        for (int32_t q = 0; q < k; q++) {
            int32_t ti = a->trans[(size_t)i * (size_t)a->ncls + (size_t)pairmap[q][0]];
            int32_t tj =
                j == sink ? sink : b2->trans[(size_t)j * (size_t)b2->ncls + (size_t)pairmap[q][1]];
            if (ti < 0) continue;
            if (tj < 0) {
                if (!complement_b) continue;
                tj = sink;
            }
            int32_t p[2] = {ti, tj};
            int32_t id = setmap_get(&m, p, 2, &fresh);
            if (id < 0 || (fresh && dfa_add_state(c, out) < 0)) {
                setmap_free(&m);
                return c->b->status < 0 ? c->b->status
                                        : gb_fail(c->b, PD_ENOMEM, "", "", -1, "out of memory");
            }
            out->trans[(size_t)s * (size_t)k + (size_t)q] = id;
        }
    }
    (void)nb;
    setmap_free(&m);
    return 0;
}

static int32_t frag(cc *c, nfa *n, gx *x, int32_t s)
{
    if (s < 0 || c->b->status < 0) return -1;
    switch (x->kind) {
    case X_NONE: return nnode(c, n);
    case X_EMPTY: return s;
    case X_BYTES: {
        int32_t e = nnode(c, n);
        nadd(c, n, s, NE_BYTES, x->lo, x->hi, -1, e);
        return e;
    }
    case X_SEQ: {
        int32_t cur = s;
        for (int32_t i = 0; i < x->n && cur >= 0; i++) cur = frag(c, n, x->kids[i], cur);
        return cur;
    }
    case X_ALT: {
        /* branches start at s itself (loops always go through fresh nodes, so no branch can
         * re-enter another); a byte branch is one edge straight to the end */
        int32_t e = nnode(c, n);
        for (int32_t i = 0; i < x->n; i++) {
            gx *k = x->kids[i];
            if (k->kind == X_BYTES) {
                nadd(c, n, s, NE_BYTES, k->lo, k->hi, -1, e);
                continue;
            }
            int32_t ke = frag(c, n, k, s);
            if (ke < 0) return -1;
            nadd(c, n, ke, NE_EPS, 0, 0, -1, e);
        }
        return e;
    }
    case X_REP: {
        /* many copies of a call-free expression: each emits its minimal DFA (above) */
        gx *kid = x->kids[0];
        dfa kd = {0};
        int use = 0;
        if (kid->kind != X_BYTES && (x->min > 4 || x->max > 4) && call_free(kid, 0) &&
            (use = rep_dfa(c, kid, &kd)) < 0)
            return -1;
#define REP_COPY(from) (use ? emit_dfa(c, n, &kd, (from)) : frag(c, n, kid, (from)))
        int32_t cur = s, e = -1;
        for (int32_t i = 0; i < x->min && cur >= 0; i++) cur = REP_COPY(cur);
        if (cur >= 0 && x->max < 0) {
            int32_t l = nnode(c, n);
            nadd(c, n, cur, NE_EPS, 0, 0, -1, l);
            int32_t ke = REP_COPY(l);
            if (ke >= 0) {
                nadd(c, n, ke, NE_EPS, 0, 0, -1, l);
                e = l;
            }
        } else if (cur >= 0) {
            e = nnode(c, n);
            nadd(c, n, cur, NE_EPS, 0, 0, -1, e);
            for (int32_t i = x->min; i < x->max && cur >= 0; i++) {
                cur = REP_COPY(cur);
                nadd(c, n, cur, NE_EPS, 0, 0, -1, e);
            }
            if (cur < 0) e = -1;
        }
#undef REP_COPY
        if (use) dfa_free(&kd);
        return e;
    }
    case X_CALL: {
        gb_rule *r = &c->b->rules[x->rule];
        if (!r->body) {
            gb_fail(c->b, PD_EINVAL, "", "", -1, "rule '%s' is used but not defined", r->name);
            return -1;
        }
        bool inl = c->force_inline ? !c->recursive[x->rule]
                                   : inlines(c, x->rule) && rule_size(c, x->rule) <= MAX_INLINE;
        if (inl && c->depth < 200) {
            c->depth++;
            int32_t e = frag(c, n, r->body, s);
            c->depth--;
            return e;
        }
        int32_t e = nnode(c, n);
        nadd(c, n, s, NE_CALL, 0, 0, rule_gid(c, x->rule), e);
        return e;
    }
    case X_AND:
    case X_NOT: {
        dfa a = {0}, bb = {0}, p = {0};
        int32_t e = -1;
        if (x->kind == X_AND) {
            if (sub_dfa(c, x->kids[0], &a) < 0 || sub_dfa(c, x->kids[1], &bb) < 0) goto out;
            if (dfa_product(c, &a, &bb, false, &p) < 0) goto out;
        } else {
            /* any bytes, minus kids[0] */
            gb *b = c->b;
            gx *any = gx_star(b, gx_byte(b, 0, 255));
            if (sub_dfa(c, any, &a) < 0 || sub_dfa(c, x->kids[0], &bb) < 0) goto out;
            if (dfa_product(c, &a, &bb, true, &p) < 0) goto out;
        }
        if (!dfa_prune(&p)) {
            e = nnode(c, n); /* empty language: an unreachable end */
            goto out;
        }
        e = emit_dfa(c, n, &p, s);
    out:
        dfa_free(&a);
        dfa_free(&bb);
        dfa_free(&p);
        return e;
    }
    case X_GRAPH: {
        int32_t *gn = malloc(sizeof(int32_t) * (size_t)x->g_nodes);
        if (!gn) return -1;
        for (int32_t i = 0; i < x->g_nodes; i++) gn[i] = nnode(c, n);
        int32_t e = nnode(c, n);
        nadd(c, n, s, NE_EPS, 0, 0, -1, gn[x->g_start]);
        for (int32_t i = 0; i < x->n && c->b->status >= 0; i++) {
            gx_edge *E = &x->g_edges[i];
            int32_t fe = E->x ? frag(c, n, E->x, gn[E->from]) : gn[E->from];
            nadd(c, n, fe, NE_EPS, 0, 0, -1, gn[E->to]);
        }
        for (int32_t i = 0; i < x->g_nodes; i++)
            if (x->g_final[i]) nadd(c, n, gn[i], NE_EPS, 0, 0, -1, e);
        free(gn);
        return c->b->status < 0 ? -1 : e;
    }
    }
    return -1;
}

/* ---- rule graph ------------------------------------------------------------------------ */
static uint32_t g_mark_gen = 1;

static void refs(gx *x, uint32_t mark, uint8_t *out)
{
    if (x->mark == mark) return;
    x->mark = mark;
    if (x->kind == X_CALL) out[x->rule] = 1;
    for (int32_t i = 0; i < x->n && x->kind != X_GRAPH; i++) refs(x->kids[i], mark, out);
    if (x->kind == X_GRAPH)
        for (int32_t i = 0; i < x->n; i++)
            if (x->g_edges[i].x) refs(x->g_edges[i].x, mark, out);
}

static void count_refs(gx *x, uint32_t mark, int32_t *out)
{
    if (x->mark == mark) return;
    x->mark = mark;
    if (x->kind == X_CALL) out[x->rule]++;
    if (x->kind == X_REP && x->max != 1 && x->n && x->kids[0]->kind == X_CALL)
        out[x->kids[0]->rule]++; /* copied: more than one site */
    if (x->kind == X_GRAPH) {
        for (int32_t i = 0; i < x->n; i++)
            if (x->g_edges[i].x) count_refs(x->g_edges[i].x, mark, out);
        return;
    }
    for (int32_t i = 0; i < x->n; i++) count_refs(x->kids[i], mark, out);
}

static void find_recursive(gb *b, bool *rec)
{
    int32_t n = b->n_rules;
    uint8_t *adj = calloc((size_t)n * (size_t)n, 1);
    uint8_t *seen = calloc((size_t)n, 1);
    int32_t *stack = malloc(sizeof(int32_t) * (size_t)(n + 1));
    if (!adj || !seen || !stack) {
        for (int32_t i = 0; i < n; i++) rec[i] = true;
        goto done;
    }
    for (int32_t r = 0; r < n; r++)
        if (b->rules[r].body)
            refs(b->rules[r].body, __atomic_add_fetch(&g_mark_gen, 1, __ATOMIC_RELAXED),
                 adj + (size_t)r * (size_t)n);
    for (int32_t r = 0; r < n; r++) {
        memset(seen, 0, (size_t)n);
        int32_t sp = 0;
        for (int32_t t = 0; t < n; t++)
            if (adj[(size_t)r * (size_t)n + (size_t)t] && !seen[t]) {
                seen[t] = 1;
                stack[sp++] = t;
            }
        while (sp > 0 && !seen[r]) {
            int32_t u = stack[--sp];
            for (int32_t t = 0; t < n; t++)
                if (adj[(size_t)u * (size_t)n + (size_t)t] && !seen[t]) {
                    seen[t] = 1;
                    stack[sp++] = t;
                }
        }
        rec[r] = seen[r];
    }
done:
    free(adj);
    free(seen);
    free(stack);
}

/* ---- left recursion ------------------------------------------------------------------------ */
static int check_left_recursion(gb *b, pd_grammar *g)
{
    int32_t n = g->n_rules;
    bool *nullable = calloc((size_t)n, 1);
    uint8_t *adj = calloc((size_t)n * (size_t)n, 1);
    uint8_t *seen = malloc((size_t)g->n_states);
    int32_t *stack = malloc(sizeof(int32_t) * (size_t)(g->n_states + n + 1));
    int rc = 0;
    if (!nullable || !adj || !seen || !stack) {
        rc = gb_fail(b, PD_ENOMEM, "", "", -1, "out of memory");
        goto done;
    }
    /* states reachable from a rule's start without bytes (through nullable callees) */
    for (bool changed = true; changed;) {
        changed = false;
        for (int32_t r = 0; r < n; r++) {
            memset(seen, 0, (size_t)g->n_states);
            int32_t sp = 0;
            stack[sp++] = g->rules[r].start;
            seen[g->rules[r].start] = 1;
            bool nul = false;
            while (sp > 0) {
                int32_t s = stack[--sp];
                if (g->states[s].flags & GS_FINAL) nul = true;
                const gstate *st = &g->states[s];
                for (int32_t i = 0; i < st->n_calls; i++) {
                    const gcall *cl = &g->calls[st->calls_off + i];
                    if (!adj[(size_t)r * (size_t)n + (size_t)cl->callee]) {
                        adj[(size_t)r * (size_t)n + (size_t)cl->callee] = 1;
                        changed = true;
                    }
                    if (nullable[cl->callee] && !seen[cl->ret]) {
                        seen[cl->ret] = 1;
                        stack[sp++] = cl->ret;
                    }
                }
            }
            if (nul && !nullable[r]) {
                nullable[r] = true;
                changed = true;
            }
        }
    }
    for (int32_t r = 0; r < n; r++) {
        uint8_t *vis = seen;
        memset(vis, 0, (size_t)n < (size_t)g->n_states ? (size_t)n : (size_t)g->n_states);
        if ((size_t)n > (size_t)g->n_states) break;
        int32_t sp = 0;
        for (int32_t t = 0; t < n; t++)
            if (adj[(size_t)r * (size_t)n + (size_t)t] && !vis[t]) {
                vis[t] = 1;
                stack[sp++] = t;
            }
        while (sp > 0 && !vis[r]) {
            int32_t u = stack[--sp];
            for (int32_t t = 0; t < n; t++)
                if (adj[(size_t)u * (size_t)n + (size_t)t] && !vis[t]) {
                    vis[t] = 1;
                    stack[sp++] = t;
                }
        }
        if (vis[r]) {
            rc = gb_fail(b, PD_EUNSUPPORTED, "", "", -1,
                         "rule '%s' is left-recursive (it can reach itself without reading a "
                         "byte); rewrite it with repetition",
                         g->rules[r].name);
            goto done;
        }
    }
done:
    free(nullable);
    free(adj);
    free(seen);
    free(stack);
    return rc;
}

/* ---- cache keys ---------------------------------------------------------------------------- */
/* Cache keys: states of a call-free rule share one when they behave the same up to the longest
 * token (bounded_classes); every other state has its own. */
static void cache_keys(pd_grammar *g)
{
    uint32_t D = g->v ? g->v->max_len : 16;
    int32_t nk = 0;
    for (int32_t r = 0; r < g->n_rules; r++) {
        grule *R = &g->rules[r];
        int32_t n = R->n_states, nc = -1;
        int32_t *cls = R->leaf ? malloc(sizeof(int32_t) * (size_t)(n ? n : 1)) : NULL;
        uint8_t *fin = cls ? malloc((size_t)(n ? n : 1)) : NULL;
        if (fin) {
            for (int32_t i = 0; i < n; i++)
                fin[i] = (g->states[R->first + i].flags & GS_FINAL) != 0;
            /* a rule's rows are consecutive (gram_build) */
            gtable T = {&g->trans[g->states[R->first].trans_off], R->first, n, R->ncls, fin};
            nc = bounded_classes(&T, D + 1, cls);
        }
        free(fin);
        int32_t *key = nc > 0 ? malloc(sizeof(int32_t) * (size_t)nc) : NULL;
        if (!key) {
            for (int32_t s = R->first; s < R->first + n; s++) g->states[s].cache_key = nk++;
            free(cls);
            continue;
        }
        for (int32_t c = 0; c < nc; c++) key[c] = -1;
        for (int32_t i = 0; i < n; i++) {
            if (key[cls[i]] < 0) key[cls[i]] = nk++;
            g->states[R->first + i].cache_key = key[cls[i]];
        }
        free(key);
        free(cls);
    }
    g->n_keys = nk;
}

/* ---- build ------------------------------------------------------------------------------------
 */
int gram_build(gb *b, int32_t root, pd_grammar *g)
{
    if (b->status < 0) return b->status;
    cc c = {0};
    c.b = b;
    c.states_left = PD_GRAMMAR_MAX_STATES;
    int32_t nr = b->n_rules;
    c.recursive = calloc((size_t)nr, sizeof(bool));
    c.gid = malloc(sizeof(int32_t) * (size_t)nr);
    c.work = malloc(sizeof(int32_t) * (size_t)nr);
    dfa *ds = calloc((size_t)nr, sizeof(dfa));
    int rc = 0;
    if (!c.recursive || !c.gid || !c.work || !ds) {
        rc = gb_fail(b, PD_ENOMEM, "", "", -1, "out of memory");
        goto done;
    }
    for (int32_t i = 0; i < nr; i++) c.gid[i] = -1;
    find_recursive(b, c.recursive);
    c.nrefs = calloc((size_t)nr, sizeof(int32_t));
    c.isize = malloc(sizeof(int64_t) * (size_t)nr);
    if (!c.nrefs || !c.isize) {
        rc = gb_fail(b, PD_ENOMEM, "", "", -1, "out of memory");
        goto done;
    }
    {
        uint32_t mark = __atomic_add_fetch(&g_mark_gen, 1, __ATOMIC_RELAXED);
        for (int32_t r = 0; r < nr; r++)
            if (b->rules[r].body) count_refs(b->rules[r].body, mark, c.nrefs);
    }
    for (int32_t r = 0; r < nr; r++) c.isize[r] = -1;
    rule_gid(&c, root);
    for (int32_t w = 0; w < c.n_work; w++) {
        int32_t r = c.work[w];
        if (!b->rules[r].body) {
            rc = gb_fail(b, PD_EINVAL, "", "", -1, "rule '%s' is used but not defined",
                         b->rules[r].name);
            goto done;
        }
        nfa n = {0};
        int32_t s = nnode(&c, &n);
        int32_t e = frag(&c, &n, b->rules[r].body, s);
        if (e < 0 || b->status < 0) {
            nfa_free(&n);
            rc = b->status < 0 ? b->status
                               : gb_fail(b, PD_EINTERNAL, "", "", -1, "grammar build failed");
            goto done;
        }
        rc = determinize(&c, &n, s, e, &ds[w]);
        nfa_free(&n);
        if (rc < 0) goto done;
        if (!dfa_prune(&ds[w])) {
            rc = gb_fail(b, PD_EUNSUPPORTED, "", "", -1,
                         w == 0 ? "the grammar matches nothing" : "rule '%s' matches nothing",
                         b->rules[r].name);
            goto done;
        }
    }
    /* assemble */
    size_t nst = 0, ntr = 0, ncl = 0;
    for (int32_t w = 0; w < c.n_work; w++) {
        nst += (size_t)ds[w].n;
        ntr += (size_t)ds[w].n * (size_t)ds[w].ncls;
        ncl += (size_t)ds[w].ncalls;
    }
    g->rules = calloc(c.n_work > 0 ? (size_t)c.n_work : 1, sizeof(grule));
    g->states = calloc(nst ? nst : 1, sizeof(gstate));
    g->trans = malloc(sizeof(int32_t) * (ntr ? ntr : 1));
    g->calls = malloc(sizeof(gcall) * (ncl ? ncl : 1));
    if (!g->rules || !g->states || !g->trans || !g->calls) {
        rc = gb_fail(b, PD_ENOMEM, "", "", -1, "out of memory");
        goto done;
    }
    g->n_rules = c.n_work;
    g->root = 0;
    size_t so = 0, to = 0, co = 0;
    for (int32_t w = 0; w < c.n_work; w++) {
        dfa *d = &ds[w];
        grule *R = &g->rules[w];
        R->first = (int32_t)so;
        R->n_states = d->n;
        R->start = (int32_t)so;
        R->ncls = d->ncls;
        memcpy(R->cls, d->cls, 256);
        R->leaf = d->ncalls == 0;
        R->name = b->rules[c.work[w]].name;
        for (int32_t i = 0; i < d->n; i++) {
            gstate *st = &g->states[so + (size_t)i];
            st->rule = w;
            st->flags = d->final[i] ? GS_FINAL : 0;
            st->trans_off = (int32_t)to;
            for (int32_t k = 0; k < d->ncls; k++) {
                int32_t t = d->trans[(size_t)i * (size_t)d->ncls + (size_t)k];
                g->trans[to++] = t < 0 ? -1 : t + (int32_t)so;
                if (t >= 0) st->flags |= GS_BYTES;
            }
            st->calls_off = (int32_t)co;
            st->n_calls = d->call_n[i];
            for (int32_t k = 0; k < d->call_n[i]; k++) {
                gcall cl = d->calls[d->call_off[i] + k];
                cl.ret += (int32_t)so;
                g->calls[co++] = cl;
            }
        }
        so += (size_t)d->n;
    }
    g->n_states = (int32_t)so;
    rc = check_left_recursion(b, g);
    if (rc < 0) goto done;
    cache_keys(g);
done:
    if (ds)
        for (int32_t w = 0; w < nr; w++) dfa_free(&ds[w]);
    free(ds);
    free(c.recursive);
    free(c.nrefs);
    free(c.isize);
    free(c.gid);
    free(c.work);
    return rc;
}
