/* Grammar expressions: constructors, UTF-8 code point ranges, the builder and its errors. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/gram_internal.h"
#include "util/status.h"

static gx *mk(gb *b, int kind)
{
    gx *x = pd_arena_calloc(b->a, 1, sizeof *x);
    if (!x) {
        gb_fail(b, PD_ENOMEM, "", "", -1, "out of memory");
        static gx none;
        none.kind = X_NONE;
        return &none;
    }
    x->kind = (uint8_t)kind;
    x->rule = -1;
    return x;
}

gx *gx_none(gb *b)
{
    return mk(b, X_NONE);
}
gx *gx_empty(gb *b)
{
    return mk(b, X_EMPTY);
}

gx *gx_byte(gb *b, uint8_t lo, uint8_t hi)
{
    if (lo > hi) return gx_none(b);
    gx *x = mk(b, X_BYTES);
    x->lo = lo;
    x->hi = hi;
    return x;
}

static gx *mk_list(gb *b, int kind, gx **kids, int n)
{
    gx *x = mk(b, kind);
    if (x->kind != kind) return x;
    x->kids = pd_arena_alloc(b->a, sizeof(gx *) * (size_t)(n ? n : 1), sizeof(void *));
    if (!x->kids) {
        gb_fail(b, PD_ENOMEM, "", "", -1, "out of memory");
        return x;
    }
    memcpy(x->kids, kids, sizeof(gx *) * (size_t)n);
    x->n = n;
    return x;
}

gx *gx_lit(gb *b, const char *s, size_t n)
{
    if (n == 0) return gx_empty(b);
    if (n == 1) return gx_byte(b, (uint8_t)s[0], (uint8_t)s[0]);
    gx **k = malloc(sizeof(gx *) * n);
    if (!k) return gx_none(b);
    for (size_t i = 0; i < n; i++) k[i] = gx_byte(b, (uint8_t)s[i], (uint8_t)s[i]);
    gx *x = mk_list(b, X_SEQ, k, (int)n);
    free(k);
    return x;
}

gx *gx_str(gb *b, const char *s)
{
    return gx_lit(b, s, strlen(s));
}

gx *gx_seq(gb *b, gx **kids, int n)
{
    int m = 0;
    for (int i = 0; i < n; i++) {
        if (kids[i]->kind == X_NONE) return gx_none(b);
        if (kids[i]->kind != X_EMPTY) m++;
    }
    if (m == 0) return gx_empty(b);
    gx *tmp[64];
    gx **k = m <= 64 ? tmp : malloc(sizeof(gx *) * (size_t)m);
    if (!k) return gx_none(b);
    m = 0;
    for (int i = 0; i < n; i++)
        if (kids[i]->kind != X_EMPTY) k[m++] = kids[i];
    gx *x = m == 1 ? k[0] : mk_list(b, X_SEQ, k, m);
    if (k != tmp) free(k);
    return x;
}

gx *gx_seq2(gb *b, gx *x, gx *y)
{
    gx *k[2] = {x, y};
    return gx_seq(b, k, 2);
}

gx *gx_seq3(gb *b, gx *x, gx *y, gx *z)
{
    gx *k[3] = {x, y, z};
    return gx_seq(b, k, 3);
}

gx *gx_alt(gb *b, gx **kids, int n)
{
    int m = 0;
    for (int i = 0; i < n; i++)
        if (kids[i]->kind != X_NONE) m++;
    if (m == 0) return gx_none(b);
    gx *tmp[64];
    gx **k = m <= 64 ? tmp : malloc(sizeof(gx *) * (size_t)m);
    if (!k) return gx_none(b);
    m = 0;
    for (int i = 0; i < n; i++)
        if (kids[i]->kind != X_NONE) k[m++] = kids[i];
    gx *x = m == 1 ? k[0] : mk_list(b, X_ALT, k, m);
    if (k != tmp) free(k);
    return x;
}

gx *gx_alt2(gb *b, gx *x, gx *y)
{
    gx *k[2] = {x, y};
    return gx_alt(b, k, 2);
}

gx *gx_rep(gb *b, gx *x, int32_t min, int32_t max)
{
    if (max >= 0 && max < min) return gx_none(b);
    if (max == 0) return gx_empty(b);
    if (min == 1 && max == 1) return x;
    if (x->kind == X_EMPTY) return x;
    if (x->kind == X_NONE) return min == 0 ? gx_empty(b) : x;
    /* (y{0,k}){m,n} is y{0,k*n}: one chain where each end may stop, instead of n copies each of
     * which may be skipped, whose closures hold every copy after it (`[ ]?{2257}` as a whitespace
     * pattern: 2,257 states of sets of up to 2,257 nodes, 94 s to compile) */
    if (x->kind == X_REP && x->min == 0) {
        if (x->max < 0 || max < 0) return gx_rep(b, x->kids[0], 0, -1);
        if ((int64_t)x->max * max <= INT32_MAX) return gx_rep(b, x->kids[0], 0, x->max * max);
    }
    /* (y{a,}){m,n} is y{a*m,} for a, m >= 1 (m blocks of at least a, the last takes the rest),
     * and (y+){0,n} is y*: one chain ending in a loop, not n loops of which the subset
     * construction tracks every one entered (`[^a]+{2257}` as a regex: 3.3 s to compile) */
    if (x->kind == X_REP && x->max < 0 && x->min >= 1) {
        if (min >= 1 && (int64_t)x->min * min <= INT32_MAX)
            return gx_rep(b, x->kids[0], x->min * min, -1);
        if (min == 0 && x->min == 1) return gx_rep(b, x->kids[0], 0, -1);
    }
    gx *r = mk_list(b, X_REP, &x, 1);
    r->min = min;
    r->max = max;
    return r;
}

gx *gx_opt(gb *b, gx *x)
{
    return gx_rep(b, x, 0, 1);
}
gx *gx_star(gb *b, gx *x)
{
    return gx_rep(b, x, 0, -1);
}
gx *gx_plus(gb *b, gx *x)
{
    return gx_rep(b, x, 1, -1);
}

gx *gx_call(gb *b, int32_t rule)
{
    gx *x = mk(b, X_CALL);
    x->rule = rule;
    return x;
}

gx *gx_and(gb *b, gx *x, gx *y)
{
    gx *k[2] = {x, y};
    return mk_list(b, X_AND, k, 2);
}

gx *gx_not(gb *b, gx *x)
{
    return mk_list(b, X_NOT, &x, 1);
}

static void utf8_enc(uint32_t c, int len, uint8_t *o)
{
    static const uint8_t lead[5] = {0, 0x00, 0xC0, 0xE0, 0xF0};
    for (int i = len - 1; i > 0; i--) {
        o[i] = (uint8_t)(0x80 | (c & 0x3F));
        c >>= 6;
    }
    o[0] = (uint8_t)(lead[len] | c);
}

/* UTF-8 of [lo, hi], both of encoded length len: split until each byte position is a range
 * (as Rust regex-syntax's Utf8Sequences does). */
static gx *utf8_same_len(gb *b, uint32_t lo, uint32_t hi, int len)
{
    for (int i = 1; i < len; i++) {
        uint32_t m = (1u << (6 * i)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if ((lo & m) != 0)
                return gx_alt2(b, utf8_same_len(b, lo, lo | m, len),
                               utf8_same_len(b, (lo | m) + 1, hi, len));
            if ((hi & m) != m)
                return gx_alt2(b, utf8_same_len(b, lo, (hi & ~m) - 1, len),
                               utf8_same_len(b, hi & ~m, hi, len));
        }
    }
    uint8_t L[4], H[4];
    utf8_enc(lo, len, L);
    utf8_enc(hi, len, H);
    gx *k[4];
    for (int i = 0; i < len; i++) k[i] = gx_byte(b, L[i], H[i]);
    return gx_seq(b, k, len);
}

gx *gx_cp_range(gb *b, uint32_t lo, uint32_t hi)
{
    if (hi > 0x10FFFF) hi = 0x10FFFF;
    if (lo > hi) return gx_none(b);
    /* surrogates are not characters */
    if (lo <= 0xDFFF && hi >= 0xD800) {
        gx *k[2];
        int n = 0;
        if (lo < 0xD800) k[n++] = gx_cp_range(b, lo, 0xD7FF);
        if (hi > 0xDFFF) k[n++] = gx_cp_range(b, 0xE000, hi);
        return gx_alt(b, k, n);
    }
    static const uint32_t lim[4] = {0x7F, 0x7FF, 0xFFFF, 0x10FFFF};
    gx *k[4];
    int n = 0;
    uint32_t start = 0;
    for (int len = 1; len <= 4; len++) {
        uint32_t a = lo > start ? lo : start, z = hi < lim[len - 1] ? hi : lim[len - 1];
        if (a <= z)
            k[n++] = len == 1 ? gx_byte(b, (uint8_t)a, (uint8_t)z) : utf8_same_len(b, a, z, len);
        start = lim[len - 1] + 1;
    }
    return gx_alt(b, k, n);
}

gx *gx_cp_set(gb *b, const uint32_t *ranges, int n)
{
    if (n <= 0) return gx_none(b);
    uint32_t *r = malloc(sizeof(uint32_t) * 2 * (size_t)n);
    if (!r) return gx_none(b);
    memcpy(r, ranges, sizeof(uint32_t) * 2 * (size_t)n);
    int m = gram_ranges_merge(r, n);
    gx **k = malloc(sizeof(gx *) * (size_t)m);
    if (!k) {
        free(r);
        return gx_none(b);
    }
    for (int i = 0; i < m; i++) k[i] = gx_cp_range(b, r[2 * i], r[2 * i + 1]);
    gx *x = gx_alt(b, k, m);
    free(k);
    free(r);
    return x;
}

/* ---- matching a call-free expression against a short string ------------------------------ */
/* out = the end positions reachable by matching x from any position set in in (len + 1
 * entries each). A repetition stops at a fixpoint: a kid that can match the empty string
 * only grows the set, one that cannot moves every position forward. */
static int ends(const gx *x, const uint8_t *s, size_t len, const uint8_t *in, uint8_t *out)
{
    size_t n = len + 1;
    memset(out, 0, n);
    switch (x->kind) {
    case X_NONE: return 0;
    case X_EMPTY: memcpy(out, in, n); return 0;
    case X_BYTES:
        for (size_t p = 0; p < len; p++)
            if (in[p] && s[p] >= x->lo && s[p] <= x->hi) out[p + 1] = 1;
        return 0;
    case X_SEQ:
    case X_ALT:
    case X_REP:
    case X_AND:
    case X_NOT: break;
    default: return -1; /* calls and graphs: not a plain language over bytes */
    }
    uint8_t *a = malloc(n), *t = malloc(n);
    int rc = 0;
    if (!a || !t) {
        rc = -1;
        goto done;
    }
    if (x->kind == X_SEQ) {
        memcpy(a, in, n);
        for (int32_t i = 0; i < x->n && rc == 0; i++) {
            rc = ends(x->kids[i], s, len, a, t);
            memcpy(a, t, n);
        }
        memcpy(out, a, n);
    } else if (x->kind == X_ALT) {
        for (int32_t i = 0; i < x->n && rc == 0; i++) {
            rc = ends(x->kids[i], s, len, in, t);
            for (size_t p = 0; p < n; p++) out[p] |= t[p];
        }
    } else if (x->kind == X_AND) {
        rc = ends(x->kids[0], s, len, in, a);
        if (rc == 0) rc = ends(x->kids[1], s, len, in, t);
        for (size_t p = 0; p < n; p++) out[p] = a[p] && t[p];
    } else if (x->kind == X_NOT) { /* per start: every later end the kid does not reach */
        uint8_t *one = calloc(n, 1);
        if (!one) {
            rc = -1;
            goto done;
        }
        for (size_t p0 = 0; p0 < n && rc == 0; p0++) {
            if (!in[p0]) continue;
            one[p0] = 1;
            rc = ends(x->kids[0], s, len, one, t);
            one[p0] = 0;
            for (size_t p = p0; p < n; p++)
                if (!t[p]) out[p] = 1;
        }
        free(one);
    } else { /* X_REP */
        memcpy(a, in, n);
        int64_t i = 0;
        for (; i < x->min && rc == 0; i++) {
            rc = ends(x->kids[0], s, len, a, t);
            bool same = memcmp(a, t, n) == 0, empty = memchr(t, 1, n) == NULL;
            memcpy(a, t, n);
            if (same || empty) break;
        }
        memcpy(out, a, n);
        for (; (x->max < 0 || i < x->max) && rc == 0; i++) {
            rc = ends(x->kids[0], s, len, a, t);
            bool grew = false;
            for (size_t p = 0; p < n; p++)
                if (t[p] && !out[p]) out[p] = 1, grew = true;
            bool empty = memchr(t, 1, n) == NULL, same = memcmp(a, t, n) == 0;
            memcpy(a, t, n);
            if (empty || same || (!grew && i > (int64_t)len + 2)) break;
        }
    }
done:
    free(a);
    free(t);
    return rc;
}

int gx_match(const gx *x, const uint8_t *s, size_t len)
{
    uint8_t *in = calloc(len + 1, 1), *out = malloc(len + 1);
    int rc = -1;
    if (in && out) {
        in[0] = 1;
        rc = ends(x, s, len, in, out);
        if (rc == 0) rc = out[len] ? 1 : 0;
    }
    free(in);
    free(out);
    return rc;
}

int32_t gb_rule_new(gb *b, const char *name)
{
    if (b->n_rules == b->cap_rules) {
        int32_t cap = b->cap_rules ? 2 * b->cap_rules : 16;
        gb_rule *r = realloc(b->rules, sizeof *r * (size_t)cap);
        if (!r) return gb_fail(b, PD_ENOMEM, "", "", -1, "out of memory");
        b->rules = r;
        b->cap_rules = cap;
    }
    gb_rule *r = &b->rules[b->n_rules];
    memset(r, 0, sizeof *r);
    r->name = pd_arena_strdup(b->a, name ? name : "");
    r->body = NULL;
    return b->n_rules++;
}

void gb_rule_set(gb *b, int32_t r, gx *body)
{
    if (r >= 0 && r < b->n_rules) b->rules[r].body = body;
}

int gb_fail(gb *b, int status, const char *keyword, const char *path, long pos, const char *fmt,
            ...)
{
    if (b->status < 0) return b->status;
    b->status = status;
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (b->err) {
        snprintf(b->err->keyword, sizeof b->err->keyword, "%s", keyword ? keyword : "");
        snprintf(b->err->path, sizeof b->err->path, "%s", path ? path : "");
        b->err->pos = pos;
        snprintf(b->err->msg, sizeof b->err->msg, "%s", msg);
    }
    return pd_error(status, "%s", msg);
}

void gb_init(gb *b, pd_gerr *err)
{
    memset(b, 0, sizeof *b);
    b->a = pd_arena_create(1 << 16);
    b->err = err;
    b->budget = PD_GRAMMAR_MAX_NFA;
    if (err) {
        err->keyword[0] = err->path[0] = err->msg[0] = 0;
        err->pos = -1;
    }
    if (!b->a) b->status = pd_error(PD_ENOMEM, "grammar: out of memory");
}

void gb_free(gb *b)
{
    pd_arena_free(b->a);
    free(b->rules);
    memset(b, 0, sizeof *b);
}
