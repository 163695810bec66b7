/* Regex -> expression over UTF-8 bytes. The syntax of JSON Schema "pattern" (ECMA-262) and
 * vLLM's guided_regex: literals, escapes, classes (negated, ranges, \d \w \s and their
 * negations), '.', groups ((...), (?:...), named), alternation, * + ? {m} {m,} {m,n} (lazy
 * forms accepted: the language is the same), ^ and $ at the ends of top-level alternatives.
 * Lookaround, backreferences, word boundaries and flags are refused with the position. */
#include <stdlib.h>
#include <string.h>

#include "grammar/gram_internal.h"
#include "util/status.h"

#define MAX_REPEAT 100000

typedef struct {
    gb *b;
    const char *s;
    size_t n, i;
    int mode;
    const char *path;
    int depth;
} rx;

static gx *rx_fail(rx *r, size_t pos, const char *what)
{
    if (*r->path)
        gb_fail(r->b, PD_EUNSUPPORTED, "pattern", r->path, (long)pos,
                "json schema: pattern at %s: regex: %s at position %zu", r->path, what, pos);
    else
        gb_fail(r->b, PD_EUNSUPPORTED, "pattern", r->path, (long)pos, "regex: %s at position %zu",
                what, pos);
    return gx_none(r->b);
}

/* next code point (UTF-8; an invalid byte is taken as itself) */
static uint32_t rx_cp(rx *r)
{
    const uint8_t *p = (const uint8_t *)r->s + r->i;
    size_t left = r->n - r->i;
    uint32_t c = p[0];
    int len = 1;
    if (c >= 0xC0 && c < 0xE0 && left >= 2) {
        c = ((c & 0x1F) << 6) | (p[1] & 0x3F);
        len = 2;
    } else if (c >= 0xE0 && c < 0xF0 && left >= 3) {
        c = ((c & 0x0F) << 12) | ((p[1] & 0x3F) << 6) | (p[2] & 0x3F);
        len = 3;
    } else if (c >= 0xF0 && c < 0xF8 && left >= 4) {
        c = ((c & 0x07) << 18) | ((p[1] & 0x3F) << 12) | ((p[2] & 0x3F) << 6) | (p[3] & 0x3F);
        len = 4;
    }
    r->i += (size_t)len;
    return c;
}

static const uint32_t R_DIGIT[] = {'0', '9'};
static const uint32_t R_WORD[] = {'0', '9', 'A', 'Z', '_', '_', 'a', 'z'};
static const uint32_t R_SPACE[] = {'\t',   '\r',   ' ',    ' ',    0xA0,   0xA0,   0x1680,
                                   0x1680, 0x2000, 0x200A, 0x2028, 0x2029, 0x202F, 0x202F,
                                   0x205F, 0x205F, 0x3000, 0x3000, 0xFEFF, 0xFEFF};

/* complement of sorted merged ranges over [0, 0x10FFFF] */
static int complement(const uint32_t *in, int n, uint32_t *out)
{
    int m = 0;
    uint32_t next = 0;
    for (int i = 0; i < n; i++) {
        if (in[2 * i] > next) {
            out[2 * m] = next;
            out[2 * m + 1] = in[2 * i] - 1;
            m++;
        }
        if (in[2 * i + 1] + 1 > next) next = in[2 * i + 1] + 1;
    }
    if (next <= 0x10FFFF) {
        out[2 * m] = next;
        out[2 * m + 1] = 0x10FFFF;
        m++;
    }
    return m;
}

static int cmp_pair(const void *x, const void *y)
{
    const uint32_t *a = x, *b = y;
    return a[0] < b[0] ? -1 : a[0] > b[0];
}

int gram_ranges_merge(uint32_t *r, int n)
{
    qsort(r, (size_t)n, 2 * sizeof(uint32_t), cmp_pair);
    int m = 0;
    for (int i = 0; i < n; i++) {
        if (m > 0 && r[2 * i] <= r[2 * (m - 1) + 1] + 1) {
            if (r[2 * i + 1] > r[2 * (m - 1) + 1]) r[2 * (m - 1) + 1] = r[2 * i + 1];
        } else {
            r[2 * m] = r[2 * i];
            r[2 * m + 1] = r[2 * i + 1];
            m++;
        }
    }
    return m;
}

typedef struct {
    uint32_t *r;
    int n, cap;
} rset;

static void rs_add(rset *s, uint32_t lo, uint32_t hi)
{
    if (s->n == s->cap) {
        int cap = s->cap ? 2 * s->cap : 16;
        uint32_t *p = realloc(s->r, sizeof(uint32_t) * 2 * (size_t)cap);
        if (!p) return;
        s->r = p;
        s->cap = cap;
    }
    s->r[2 * s->n] = lo;
    s->r[2 * s->n + 1] = hi;
    s->n++;
}

static void rs_add_set(rset *s, const uint32_t *r, int n, bool neg)
{
    if (!neg) {
        for (int i = 0; i < n; i++) rs_add(s, r[2 * i], r[2 * i + 1]);
        return;
    }
    uint32_t tmp[64], out[70];
    memcpy(tmp, r, sizeof(uint32_t) * 2 * (size_t)n);
    int m = gram_ranges_merge(tmp, n);
    int k = complement(tmp, m, out);
    for (int i = 0; i < k; i++) rs_add(s, out[2 * i], out[2 * i + 1]);
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static bool read_hex(rx *r, int digits, uint32_t *out)
{
    uint32_t v = 0;
    for (int k = 0; k < digits; k++) {
        if (r->i >= r->n || hexval(r->s[r->i]) < 0) return false;
        v = v * 16 + (uint32_t)hexval(r->s[r->i++]);
    }
    *out = v;
    return true;
}

/* After a backslash. Returns 1 and a code point in *cp, or 2 and a class added to set (when
 * set is NULL a class is an error), or 0 after an error. */
static int rx_escape(rx *r, uint32_t *cp, rset *set)
{
    size_t pos = r->i - 1;
    if (r->i >= r->n) {
        rx_fail(r, pos, "a trailing backslash");
        return 0;
    }
    char c = r->s[r->i++];
    switch (c) {
    case 'd':
    case 'D':
    case 'w':
    case 'W':
    case 's':
    case 'S': {
        const uint32_t *t = c == 'd' || c == 'D'   ? R_DIGIT
                            : c == 'w' || c == 'W' ? R_WORD
                                                   : R_SPACE;
        int n = c == 'd' || c == 'D' ? 1 : c == 'w' || c == 'W' ? 4 : 10;
        rs_add_set(set, t, n, c == 'D' || c == 'W' || c == 'S');
        return 2;
    }
    case 'n': *cp = '\n'; return 1;
    case 't': *cp = '\t'; return 1;
    case 'r': *cp = '\r'; return 1;
    case 'f': *cp = '\f'; return 1;
    case 'v': *cp = '\v'; return 1;
    case '0': *cp = 0; return 1;
    case 'x':
        if (!read_hex(r, 2, cp)) {
            rx_fail(r, pos, "a bad \\x escape");
            return 0;
        }
        return 1;
    case 'u':
        if (r->i < r->n && r->s[r->i] == '{') {
            r->i++;
            uint32_t v = 0;
            int k = 0;
            while (r->i < r->n && hexval(r->s[r->i]) >= 0 && k < 8)
                v = v * 16 + (uint32_t)hexval(r->s[r->i++]), k++;
            if (k == 0 || r->i >= r->n || r->s[r->i] != '}' || v > 0x10FFFF) {
                rx_fail(r, pos, "a bad \\u{...} escape");
                return 0;
            }
            r->i++;
            *cp = v;
            return 1;
        }
        if (!read_hex(r, 4, cp)) {
            rx_fail(r, pos, "a bad \\u escape");
            return 0;
        }
        /* a surrogate pair written as two escapes */
        if (*cp >= 0xD800 && *cp <= 0xDBFF && r->i + 6 <= r->n && r->s[r->i] == '\\' &&
            r->s[r->i + 1] == 'u') {
            size_t save = r->i;
            r->i += 2;
            uint32_t lo;
            if (read_hex(r, 4, &lo) && lo >= 0xDC00 && lo <= 0xDFFF) {
                *cp = 0x10000 + ((*cp - 0xD800) << 10) + (lo - 0xDC00);
                return 1;
            }
            r->i = save;
        }
        if (*cp >= 0xD800 && *cp <= 0xDFFF) {
            rx_fail(r, pos, "a lone surrogate escape");
            return 0;
        }
        return 1;
    case 'b':
    case 'B': rx_fail(r, pos, "a word boundary (\\b, \\B) is not supported"); return 0;
    case 'A':
    case 'Z':
    case 'z':
    case 'G': rx_fail(r, pos, "the anchor escapes \\A \\Z \\z \\G are not supported"); return 0;
    case 'p':
    case 'P': rx_fail(r, pos, "Unicode property classes (\\p, \\P) are not supported"); return 0;
    case 'c': rx_fail(r, pos, "control escapes (\\c) are not supported"); return 0;
    case 'k': rx_fail(r, pos, "backreferences are not supported"); return 0;
    default:
        if (c >= '1' && c <= '9') {
            rx_fail(r, pos, "backreferences are not supported");
            return 0;
        }
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
            rx_fail(r, pos, "an unknown escape");
            return 0;
        }
        r->i--;
        *cp = rx_cp(r);
        return 1;
    }
}

static gx *rx_class(rx *r)
{
    size_t start = r->i - 1;
    bool neg = false;
    rset s = {0};
    if (r->i < r->n && r->s[r->i] == '^') {
        neg = true;
        r->i++;
    }
    bool first = true;
    while (true) {
        if (r->i >= r->n) {
            free(s.r);
            return rx_fail(r, start, "an unterminated character class");
        }
        char c = r->s[r->i];
        if (c == ']' && !first) {
            r->i++;
            break;
        }
        first = false;
        uint32_t lo;
        if (c == '[' && r->i + 1 < r->n &&
            (r->s[r->i + 1] == ':' || r->s[r->i + 1] == '=' || r->s[r->i + 1] == '.')) {
            free(s.r);
            return rx_fail(r, r->i, "POSIX classes ([:alpha:]) are not supported");
        }
        if (c == '\\' && r->i + 1 < r->n && r->s[r->i + 1] == 'b') { /* backspace in a class */
            r->i += 2;
            lo = '\b';
        } else if (c == '\\') {
            r->i++;
            int k = rx_escape(r, &lo, &s);
            if (k == 0) {
                free(s.r);
                return gx_none(r->b);
            }
            if (k == 2) continue;
        } else {
            lo = rx_cp(r);
        }
        uint32_t hi = lo;
        if (r->i + 1 < r->n && r->s[r->i] == '-' && r->s[r->i + 1] != ']') {
            r->i++;
            if (r->s[r->i] == '\\') {
                r->i++;
                rset dummy = {0};
                int k = rx_escape(r, &hi, &dummy);
                free(dummy.r);
                if (k != 1) {
                    free(s.r);
                    return k == 0 ? gx_none(r->b)
                                  : rx_fail(r, r->i, "a class escape as a range end");
                }
            } else {
                hi = rx_cp(r);
            }
            if (hi < lo) {
                free(s.r);
                return rx_fail(r, start, "a character range out of order");
            }
        }
        rs_add(&s, lo, hi);
    }
    int n = s.n ? gram_ranges_merge(s.r, s.n) : 0;
    gx *x;
    if (neg) {
        uint32_t *out = malloc(sizeof(uint32_t) * 2 * (size_t)(n + 1));
        if (!out) {
            free(s.r);
            return gx_none(r->b);
        }
        int m = complement(s.r, n, out);
        x = gx_cp_set(r->b, out, m);
        free(out);
    } else {
        x = gx_cp_set(r->b, s.r, n);
    }
    free(s.r);
    return x;
}

static gx *rx_alt(rx *r, bool top);

static gx *rx_atom(rx *r)
{
    size_t pos = r->i;
    char c = r->s[r->i];
    if (c == '(') {
        r->i++;
        if (r->i < r->n && r->s[r->i] == '?') {
            r->i++;
            if (r->i < r->n && r->s[r->i] == ':') {
                r->i++;
            } else if (r->i < r->n && (r->s[r->i] == '<' || r->s[r->i] == 'P') &&
                       !(r->s[r->i] == '<' && r->i + 1 < r->n &&
                         (r->s[r->i + 1] == '=' || r->s[r->i + 1] == '!'))) {
                if (r->s[r->i] == 'P') r->i++;
                if (r->i >= r->n || r->s[r->i] != '<')
                    return rx_fail(r, pos, "an unsupported group");
                while (r->i < r->n && r->s[r->i] != '>') r->i++;
                if (r->i >= r->n) return rx_fail(r, pos, "an unterminated group name");
                r->i++;
            } else if (r->i < r->n &&
                       (r->s[r->i] == '=' || r->s[r->i] == '!' || r->s[r->i] == '<')) {
                return rx_fail(r, pos, "lookaround is not supported");
            } else {
                return rx_fail(r, pos, "inline flags and other (?...) groups are not supported");
            }
        }
        if (++r->depth > 200) return rx_fail(r, pos, "groups nested too deeply");
        gx *x = rx_alt(r, false);
        r->depth--;
        if (r->b->status < 0) return x;
        if (r->i >= r->n || r->s[r->i] != ')') return rx_fail(r, pos, "an unclosed group");
        r->i++;
        return x;
    }
    if (c == '[') {
        r->i++;
        return rx_class(r);
    }
    if (c == '.') {
        r->i++;
        uint32_t rg[] = {0, '\n' - 1, '\n' + 1, 0x10FFFF};
        return gx_cp_set(r->b, rg, 2);
    }
    if (c == '\\') {
        r->i++;
        uint32_t cp;
        rset s = {0};
        int k = rx_escape(r, &cp, &s);
        if (k == 0) {
            free(s.r);
            return gx_none(r->b);
        }
        if (k == 2) {
            int n = gram_ranges_merge(s.r, s.n);
            gx *x = gx_cp_set(r->b, s.r, n);
            free(s.r);
            return x;
        }
        return gx_cp_range(r->b, cp, cp);
    }
    if (c == '*' || c == '+' || c == '?')
        return rx_fail(r, pos, "a quantifier with nothing to repeat");
    if (c == '{') {
        /* a literal '{' unless it starts a valid quantifier (then nothing to repeat) */
        r->i++;
        return gx_byte(r->b, '{', '{');
    }
    uint32_t cp = rx_cp(r);
    return gx_cp_range(r->b, cp, cp);
}

static bool rx_number(rx *r, int32_t *v)
{
    size_t st = r->i;
    long x = 0;
    while (r->i < r->n && r->s[r->i] >= '0' && r->s[r->i] <= '9') {
        x = x * 10 + (r->s[r->i++] - '0');
        if (x > MAX_REPEAT) x = MAX_REPEAT + 1;
    }
    *v = (int32_t)x;
    return r->i > st;
}

/* {m}, {m,}, {m,n} at r->i; false (position unchanged) when it is not a quantifier */
static bool rx_braces(rx *r, int32_t *mn, int32_t *mx)
{
    size_t save = r->i;
    r->i++;
    if (!rx_number(r, mn)) {
        r->i = save;
        return false;
    }
    *mx = *mn;
    if (r->i < r->n && r->s[r->i] == ',') {
        r->i++;
        if (!rx_number(r, mx)) *mx = -1;
    }
    if (r->i >= r->n || r->s[r->i] != '}') {
        r->i = save;
        return false;
    }
    r->i++;
    return true;
}

static gx *rx_seq(rx *r, bool top, bool *anc_start, bool *anc_end)
{
    gx **k = NULL;
    int n = 0, cap = 0;
    *anc_start = *anc_end = false;
    size_t seq_start = r->i;
    while (r->i < r->n && r->s[r->i] != '|' && r->s[r->i] != ')' && r->b->status >= 0) {
        size_t pos = r->i;
        if (r->s[r->i] == '^') {
            if (!top || pos != seq_start) {
                free(k);
                return rx_fail(r, pos, "'^' not at the start of the pattern");
            }
            *anc_start = true;
            r->i++;
            continue;
        }
        if (r->s[r->i] == '$') {
            r->i++;
            if (!top || (r->i < r->n && r->s[r->i] != '|')) {
                free(k);
                return rx_fail(r, pos, "'$' not at the end of the pattern");
            }
            *anc_end = true;
            continue;
        }
        gx *x = rx_atom(r);
        while (r->i < r->n && r->b->status >= 0) {
            char q = r->s[r->i];
            int32_t mn, mx;
            size_t qpos = r->i;
            if (q == '*')
                mn = 0, mx = -1, r->i++;
            else if (q == '+')
                mn = 1, mx = -1, r->i++;
            else if (q == '?')
                mn = 0, mx = 1, r->i++;
            else if (q == '{' && rx_braces(r, &mn, &mx)) {
                if (mn > MAX_REPEAT || mx > MAX_REPEAT) {
                    free(k);
                    return rx_fail(r, qpos, "a repetition bound over 100000");
                }
                if (mx >= 0 && mx < mn) {
                    free(k);
                    return rx_fail(r, qpos, "a repetition {m,n} with n < m");
                }
            } else
                break;
            if (r->i < r->n && r->s[r->i] == '?')
                r->i++; /* lazy: same language */
            else if (r->i < r->n && r->s[r->i] == '+') {
                free(k);
                return rx_fail(r, r->i, "possessive quantifiers are not supported");
            }
            x = gx_rep(r->b, x, mn, mx);
        }
        if (n == cap) {
            cap = cap ? 2 * cap : 16;
            gx **p = realloc(k, sizeof(gx *) * (size_t)cap);
            if (!p) {
                free(k);
                return gx_none(r->b);
            }
            k = p;
        }
        k[n++] = x;
    }
    gx *x = gx_seq(r->b, k, n);
    free(k);
    return x;
}

static gx *any_chars(gb *b)
{
    return gx_star(b, gx_cp_range(b, 0, 0x10FFFF));
}

/* Alternatives of a top-level search (a JSON Schema pattern: unanchored unless ^ / $) are grouped
 * by their anchors, and each group gets one `.*` before and after it: `.*(A|B|C).*` rather than
 * `.*A.*|.*B.*|.*C.*`, whose subset construction tracks which alternatives have matched so far
 * (2^n times the states: an enum of 7 words in one pattern made 18,691 states). */
static gx *rx_alt(rx *r, bool top)
{
    bool search = top && r->mode == RX_SEARCH;
    gx **k = NULL;
    uint8_t *anch = NULL; /* per alternative: 1 anchored at the start, 2 at the end */
    int n = 0, cap = 0;
    while (r->b->status >= 0) {
        bool as, ae;
        gx *x = rx_seq(r, top, &as, &ae);
        if (n == cap) {
            cap = cap ? 2 * cap : 8;
            gx **p = realloc(k, sizeof(gx *) * (size_t)cap);
            if (p) k = p;
            uint8_t *q = realloc(anch, (size_t)cap);
            if (q) anch = q;
            if (!p || !q) break;
        }
        anch[n] = (uint8_t)((as ? 1 : 0) | (ae ? 2 : 0));
        k[n++] = x;
        if (r->i < r->n && r->s[r->i] == '|') {
            r->i++;
            continue;
        }
        break;
    }
    gx *x;
    gx **grp = search ? malloc(sizeof(gx *) * (size_t)(n ? n : 1)) : NULL;
    if (!search || !grp) {
        x = search ? gx_none(r->b) : gx_alt(r->b, k, n);
    } else {
        gx *groups[4];
        int ng = 0;
        for (uint8_t a = 0; a < 4; a++) {
            int m = 0;
            for (int i = 0; i < n; i++)
                if (anch[i] == a) grp[m++] = k[i];
            if (m == 0) continue;
            gx *g = gx_alt(r->b, grp, m);
            if (!(a & 1)) g = gx_seq2(r->b, any_chars(r->b), g);
            if (!(a & 2)) g = gx_seq2(r->b, g, any_chars(r->b));
            groups[ng++] = g;
        }
        x = gx_alt(r->b, groups, ng);
    }
    free(grp);
    free(k);
    free(anch);
    return x;
}

gx *rx_parse(gb *b, const char *re, size_t len, int mode, const char *path)
{
    rx r = {b, re, len, 0, mode, path ? path : "", 0};
    gx *x = rx_alt(&r, true);
    if (b->status >= 0 && r.i < r.n) return rx_fail(&r, r.i, "an unmatched ')'");
    return x;
}
