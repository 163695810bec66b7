/* Chat-template interpreter: evaluates the tree built by jinja_parse.c against the render
 * variables, with Python/jinja2 semantics where the output depends on them (docs/api.md
 * §13.4): Python str()/repr() printing, float repr, json.dumps-compatible tojson, deep
 * equality, Python slicing and modulo, jinja2's Undefined (prints "", is false, iterates
 * empty, compares, but any arithmetic, attribute or call on it is an error).
 *
 * Design: all values of one render live in one arena (dropped at the end, whatever
 * happened); scopes are small arrays chained innermost-first (a for iteration opens one,
 * `if` does not); the output is one growable malloc'd buffer handed to the caller. Work is
 * bounded (steps, output bytes, arena bytes, nesting) so a hostile template from a request
 * cannot hang or exhaust the process: it gets an error instead.
 */
#include "tokenizer/jinja_internal.h"

#include <errno.h>
#include <locale.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "tokenizer/chat_template.h"
#include "tokenizer/unicode.h"
#include "util/status.h"

#define MAX_STEPS  50000000ull         /* statements + loop iterations per render */
#define MAX_OUTPUT ((size_t)64 << 20)  /* bytes of rendered text */
#define MAX_ARENA  ((size_t)512 << 20) /* bytes of values per render */
#define MAX_NEST   256                 /* value nesting for printing, equality, tojson */
#define MAX_RANGE  100000              /* jinja2 sandbox's MAX_RANGE */

/* ---- runtime state ------------------------------------------------------------------ */

typedef struct {
    char *p;
    size_t n, cap;
} sbuf; /* malloc'd growable text */

typedef struct scope scope;
struct scope {
    scope *parent;
    size_t n, cap;
    const char **names; /* (n) */
    jv *vals;           /* (n) */
};

typedef struct {
    pd_arena *A;
    jdict *ctx;  /* the render variables */
    scope *top;  /* template-level assignments */
    sbuf *out;   /* where text goes (a block set redirects it) */
    int64_t now; /* strftime_now's clock */
    uint64_t steps;
    int line; /* line of the node being evaluated, for messages */
} rt;

static int rt_error(rt *R, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int rt_error(rt *R, int line, const char *fmt, ...)
{
    char detail[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    return pd_error(PD_CHAT_ERENDER, "Chat template error: line %d: %s", line ? line : R->line,
                    detail);
}

static int oom(rt *R)
{
    if (pd_arena_used(R->A) > MAX_ARENA)
        return rt_error(R, 0, "the template used more than %zu MiB of values", MAX_ARENA >> 20);
    return pd_error(PD_ENOMEM, "chat template: out of memory while rendering");
}

static void *ralloc(rt *R, size_t bytes)
{
    if (pd_arena_used(R->A) > MAX_ARENA) return NULL;
    return pd_arena_alloc(R->A, bytes ? bytes : 1, 0);
}

static int sb_reserve(sbuf *b, size_t extra)
{
    if (b->n + extra + 1 <= b->cap) return 0;
    if (b->n + extra + 1 > MAX_OUTPUT + 1)
        return pd_error(PD_CHAT_ERENDER, "Chat template error: rendered text exceeds %zu bytes",
                        MAX_OUTPUT);
    size_t cap = b->cap ? b->cap * 2 : 256;
    while (cap < b->n + extra + 1) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) return pd_error(PD_ENOMEM, "chat template: out of memory while rendering");
    b->p = p;
    b->cap = cap;
    return 0;
}

static int sb_add(sbuf *b, const char *s, size_t n)
{
    if (n == 0) return 0;
    PD_CHECK(sb_reserve(b, n));
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return 0;
}

static int sb_adds(sbuf *b, const char *s)
{
    return sb_add(b, s, strlen(s));
}

static int sb_addc(sbuf *b, char c)
{
    return sb_add(b, &c, 1);
}

static int sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int sb_printf(sbuf *b, const char *fmt, ...)
{
    char tmp[128];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (k < 0) return 0;
    return sb_add(b, tmp, (size_t)k < sizeof tmp ? (size_t)k : sizeof tmp - 1);
}

/* ---- value constructors ------------------------------------------------------------- */

static jv v_undef(const char *hint)
{
    return (jv){.kind = JV_UNDEF, .u.s = {hint, hint ? strlen(hint) : 0}};
}
static jv v_none(void)
{
    return (jv){.kind = JV_NONE};
}
static jv v_bool(bool b)
{
    return (jv){.kind = JV_BOOL, .u.b = b};
}
static jv v_int(int64_t i)
{
    return (jv){.kind = JV_INT, .u.i = i};
}
static jv v_float(double f)
{
    return (jv){.kind = JV_FLOAT, .u.f = f};
}
static jv v_str(const char *p, size_t n)
{
    return (jv){.kind = JV_STR, .u.s = {p, n}};
}

/* Copies text into the arena as a string value. */
static int v_strdup(rt *R, const char *p, size_t n, jv *out)
{
    char *s = ralloc(R, n + 1);
    if (!s) return oom(R);
    if (n) memcpy(s, p, n);
    s[n] = 0;
    *out = v_str(s, n);
    return 0;
}

static int v_from_sb(rt *R, sbuf *b, jv *out)
{
    int rc = v_strdup(R, b->p ? b->p : "", b->n, out);
    free(b->p);
    b->p = NULL;
    b->n = b->cap = 0;
    return rc;
}

static int new_list(rt *R, size_t cap, bool tuple, jv *out)
{
    jlist *l = ralloc(R, sizeof *l);
    if (!l) return oom(R);
    l->n = 0;
    l->cap = cap;
    l->tuple = tuple;
    l->gen = false;
    l->fail = NULL;
    l->v = cap ? ralloc(R, cap * sizeof *l->v) : NULL;
    if (cap && !l->v) return oom(R);
    *out = (jv){.kind = JV_LIST, .u.l = l};
    return 0;
}

static int list_push(rt *R, jlist *l, jv x)
{
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 4;
        jv *v = ralloc(R, cap * sizeof *v);
        if (!v) return oom(R);
        if (l->n) memcpy(v, l->v, l->n * sizeof *v);
        l->v = v;
        l->cap = cap;
    }
    l->v[l->n++] = x;
    return 0;
}

static int new_dict(rt *R, size_t cap, jv_kind kind, jv *out)
{
    jdict *d = ralloc(R, sizeof *d);
    if (!d) return oom(R);
    d->n = 0;
    d->cap = cap;
    d->k = cap ? ralloc(R, cap * sizeof *d->k) : NULL;
    d->v = cap ? ralloc(R, cap * sizeof *d->v) : NULL;
    if (cap && (!d->k || !d->v)) return oom(R);
    *out = (jv){.kind = (uint8_t)kind, .u.d = d};
    return 0;
}

static bool v_eq(const jv *a, const jv *b, int depth);

static long dict_find(const jdict *d, const jv *key)
{
    for (size_t i = 0; i < d->n; i++)
        if (v_eq(&d->k[i], key, 0)) return (long)i;
    return -1;
}

static long dict_find_str(const jdict *d, const char *s, size_t n)
{
    for (size_t i = 0; i < d->n; i++)
        if (d->k[i].kind == JV_STR && d->k[i].u.s.n == n && memcmp(d->k[i].u.s.p, s, n) == 0)
            return (long)i;
    return -1;
}

static int dict_set(rt *R, jdict *d, jv key, jv val)
{
    long at = dict_find(d, &key);
    if (at >= 0) {
        d->v[at] = val;
        return 0;
    }
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 4;
        jv *k = ralloc(R, cap * sizeof *k), *v = ralloc(R, cap * sizeof *v);
        if (!k || !v) return oom(R);
        if (d->n) {
            memcpy(k, d->k, d->n * sizeof *k);
            memcpy(v, d->v, d->n * sizeof *v);
        }
        d->k = k;
        d->v = v;
        d->cap = cap;
    }
    d->k[d->n] = key;
    d->v[d->n] = val;
    d->n++;
    return 0;
}

static int from_json(rt *R, const json_t *j, jv *out, int depth)
{
    if (depth > 4096) return rt_error(R, 0, "render variables nested too deeply");
    switch (json_typeof(j)) {
    case JSON_NULL: *out = v_none(); return 0;
    case JSON_TRUE: *out = v_bool(true); return 0;
    case JSON_FALSE: *out = v_bool(false); return 0;
    case JSON_INTEGER: *out = v_int((int64_t)json_integer_value(j)); return 0;
    case JSON_REAL: *out = v_float(json_real_value(j)); return 0;
    case JSON_STRING: *out = v_str(json_string_value(j), json_string_length(j)); return 0;
    case JSON_ARRAY: {
        size_t n = json_array_size(j);
        PD_CHECK(new_list(R, n, false, out));
        for (size_t i = 0; i < n; i++) {
            jv x;
            PD_CHECK(from_json(R, json_array_get(j, i), &x, depth + 1));
            out->u.l->v[out->u.l->n++] = x;
        }
        return 0;
    }
    case JSON_OBJECT: {
        PD_CHECK(new_dict(R, json_object_size(j), JV_DICT, out));
        const char *key;
        json_t *val;
        jdict *d = out->u.d;
        json_object_foreach((json_t *)j, key, val)
        {
            jv x;
            PD_CHECK(from_json(R, val, &x, depth + 1));
            d->k[d->n] = v_str(key, strlen(key));
            d->v[d->n] = x;
            d->n++;
        }
        return 0;
    }
    }
    *out = v_none();
    return 0;
}

/* ---- basic predicates --------------------------------------------------------------- */

static const char *type_name(const jv *v)
{
    switch (v->kind) {
    case JV_UNDEF: return "Undefined";
    case JV_NONE: return "NoneType";
    case JV_BOOL: return "bool";
    case JV_INT: return "int";
    case JV_FLOAT: return "float";
    case JV_STR: return "str";
    case JV_LIST: return v->u.l->gen ? "generator" : v->u.l->tuple ? "tuple" : "list";
    case JV_DICT: return "dict";
    case JV_NS: return "Namespace";
    case JV_LOOP: return "LoopContext";
    case JV_FUNC: return "function";
    default: return "builtin_function_or_method";
    }
}

static bool truthy(const jv *v)
{
    switch (v->kind) {
    case JV_UNDEF:
    case JV_NONE: return false;
    case JV_BOOL: return v->u.b;
    case JV_INT: return v->u.i != 0;
    case JV_FLOAT: return v->u.f != 0.0;
    case JV_STR: return v->u.s.n != 0;
    case JV_LIST: return v->u.l->gen || v->u.l->n != 0;
    case JV_DICT: return v->u.d->n != 0;
    default: return true;
    }
}

static bool is_num(const jv *v)
{
    return v->kind == JV_INT || v->kind == JV_FLOAT || v->kind == JV_BOOL;
}
static bool is_intlike(const jv *v)
{
    return v->kind == JV_INT || v->kind == JV_BOOL;
}
static int64_t as_int(const jv *v)
{
    return v->kind == JV_BOOL ? (int64_t)v->u.b : v->u.i;
}
static double as_float(const jv *v)
{
    return v->kind == JV_FLOAT ? v->u.f : (double)as_int(v);
}
static bool is_seq(const jv *v)
{
    return v->kind == JV_LIST && !v->u.l->gen;
}

static int undefined_error(rt *R, const jv *v, int line)
{
    if (v->u.s.p && v->u.s.n) return rt_error(R, line, "%.*s", (int)v->u.s.n, v->u.s.p);
    return rt_error(R, line, "a value is undefined");
}

static bool v_eq(const jv *a, const jv *b, int depth)
{
    if (depth > MAX_NEST) return false;
    if (is_num(a) && is_num(b)) {
        if (a->kind == JV_FLOAT || b->kind == JV_FLOAT) return as_float(a) == as_float(b);
        return as_int(a) == as_int(b);
    }
    if (a->kind != b->kind) return false;
    switch (a->kind) {
    case JV_UNDEF:
    case JV_NONE: return true;
    case JV_STR: return a->u.s.n == b->u.s.n && memcmp(a->u.s.p, b->u.s.p, a->u.s.n) == 0;
    case JV_LIST:
        if (a->u.l->gen || b->u.l->gen) return a->u.l == b->u.l;
        if (a->u.l->tuple != b->u.l->tuple || a->u.l->n != b->u.l->n) return false;
        for (size_t i = 0; i < a->u.l->n; i++)
            if (!v_eq(&a->u.l->v[i], &b->u.l->v[i], depth + 1)) return false;
        return true;
    case JV_DICT:
        if (a->u.d->n != b->u.d->n) return false;
        for (size_t i = 0; i < a->u.d->n; i++) {
            long j = dict_find(b->u.d, &a->u.d->k[i]);
            if (j < 0 || !v_eq(&a->u.d->v[i], &b->u.d->v[j], depth + 1)) return false;
        }
        return true;
    case JV_NS: return a->u.d == b->u.d;
    case JV_LOOP: return a->u.lp == b->u.lp;
    case JV_FUNC: return a->fn == b->fn;
    default: return a->fn == b->fn && a->u.self == b->u.self;
    }
}

/* Python ordering: *res < 0, 0, > 0. Numbers, strings and lists (lexicographic). */
static int v_cmp(rt *R, const jv *a, const jv *b, int op_line, int *res, int depth)
{
    if (depth > MAX_NEST) return rt_error(R, op_line, "values nested too deeply to compare");
    if (is_num(a) && is_num(b)) {
        if (a->kind == JV_FLOAT || b->kind == JV_FLOAT) {
            double x = as_float(a), y = as_float(b);
            *res = x < y ? -1 : x > y ? 1 : 0;
        } else {
            int64_t x = as_int(a), y = as_int(b);
            *res = x < y ? -1 : x > y ? 1 : 0;
        }
        return 0;
    }
    if (a->kind == JV_STR && b->kind == JV_STR) {
        size_t n = a->u.s.n < b->u.s.n ? a->u.s.n : b->u.s.n;
        int c = memcmp(a->u.s.p, b->u.s.p, n);
        *res = c ? c : (a->u.s.n < b->u.s.n ? -1 : a->u.s.n > b->u.s.n ? 1 : 0);
        return 0;
    }
    if (is_seq(a) && is_seq(b) && a->u.l->tuple == b->u.l->tuple) {
        size_t n = a->u.l->n < b->u.l->n ? a->u.l->n : b->u.l->n;
        for (size_t i = 0; i < n; i++) {
            if (v_eq(&a->u.l->v[i], &b->u.l->v[i], depth + 1)) continue;
            return v_cmp(R, &a->u.l->v[i], &b->u.l->v[i], op_line, res, depth + 1);
        }
        *res = a->u.l->n < b->u.l->n ? -1 : a->u.l->n > b->u.l->n ? 1 : 0;
        return 0;
    }
    if (a->kind == JV_UNDEF) return undefined_error(R, a, op_line);
    if (b->kind == JV_UNDEF) return undefined_error(R, b, op_line);
    return rt_error(R, op_line, "'<' not supported between instances of '%s' and '%s'",
                    type_name(a), type_name(b));
}

/* ---- UTF-8 and case helpers --------------------------------------------------------- */

static size_t dec(const char *s, size_t n, size_t i, uint32_t *cp)
{
    bool valid;
    return pd_utf8_decode((const uint8_t *)s + i, n - i, cp, &valid);
}

static bool all_ascii(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] >= 0x80) return false;
    return true;
}

static size_t cp_count(const char *s, size_t n)
{
    size_t k = 0;
    for (size_t i = 0; i < n; k++) {
        uint32_t cp;
        i += dec(s, n, i, &cp);
    }
    return k;
}

enum { CASE_UPPER = PD_UC_UPPER, CASE_LOWER = PD_UC_LOWER, CASE_TITLE = PD_UC_TITLE };

/* Whether the first code point of s[i..n) that is not case-ignorable is cased (false at the
 * end): what follows a capital sigma, for Python's Final_Sigma rule. */
static bool cased_ahead(const char *s, size_t n, size_t i)
{
    while (i < n) {
        uint32_t cp;
        i += dec(s, n, i, &cp);
        if (!pd_uc_is_case_ignorable(cp)) return pd_uc_is_cased(cp);
    }
    return false;
}

/* Python's str.upper / lower / title: full case mappings (U+00DF upper is "SS", so the text
 * may grow, at most 3x); title() maps a character after a cased one to lower case, any
 * other to title case. Lowering U+03A3 gives U+03C2 where a cased code point comes before it
 * and none after it, case-ignorable ones skipped (Python's handle_capital_sigma), else U+03C3.
 * Invalid bytes are kept as they are. */
static int str_case(rt *R, const char *s, size_t n, int mode, jv *out)
{
    char *o = ralloc(R, n * 3 + 1);
    if (!o) return oom(R);
    size_t k = 0;
    bool prev_cased = false;   /* the code point before this one is cased (title()) */
    bool cased_before = false; /* so is the last one before this that is not case-ignorable */
    for (size_t i = 0; i < n;) {
        uint32_t cp, m[3];
        size_t len = dec(s, n, i, &cp);
        if (cp == 0xFFFD && len == 1 && (unsigned char)s[i] >= 0x80) {
            o[k++] = s[i++];
            cased_before = prev_cased = false;
            continue;
        }
        int md = mode != CASE_TITLE ? mode : prev_cased ? CASE_LOWER : CASE_TITLE;
        size_t nm = pd_uc_case(cp, md, m);
        if (cp == 0x3A3 && md == CASE_LOWER && cased_before && !cased_ahead(s, n, i + len))
            m[0] = 0x3C2;
        prev_cased = pd_uc_is_cased(cp);
        if (mode != CASE_UPPER && !pd_uc_is_case_ignorable(cp)) cased_before = prev_cased;
        if (nm == 1 && m[0] == cp) {
            memcpy(o + k, s + i, len);
            k += len;
        } else {
            for (size_t j = 0; j < nm; j++) k += pd_utf8_encode(m[j], (uint8_t *)o + k);
        }
        i += len;
    }
    o[k] = 0;
    *out = v_str(o, k);
    return 0;
}

/* Byte offsets of each code point of s (n_cp + 1 entries), for indexing and slicing. */
static int cp_offsets(rt *R, const char *s, size_t n, size_t **offs, size_t *count)
{
    size_t k = cp_count(s, n);
    size_t *o = ralloc(R, (k + 1) * sizeof *o);
    if (!o) return oom(R);
    size_t j = 0;
    for (size_t i = 0; i < n; j++) {
        uint32_t cp;
        o[j] = i;
        i += dec(s, n, i, &cp);
    }
    o[k] = n;
    *offs = o;
    *count = k;
    return 0;
}

/* ---- printing: Python str() / repr() ------------------------------------------------- */

/* Shortest repr of a double as Python prints it (repr / json.dumps). */
static void float_repr(double x, char *buf, size_t n, bool json)
{
    if (isnan(x)) {
        snprintf(buf, n, "%s", json ? "NaN" : "nan");
        return;
    }
    if (isinf(x)) {
        snprintf(buf, n, "%s%s", x < 0 ? "-" : "", json ? "Infinity" : "inf");
        return;
    }
    char e[40];
    int prec;
    for (prec = 1; prec <= 17; prec++) {
        snprintf(e, sizeof e, "%.*e", prec - 1, x);
        if (strtod(e, NULL) == x) break;
    }
    /* e = [-]d.ddde[+-]XX : split digits and exponent */
    const char *p = e;
    bool neg = *p == '-';
    if (neg) p++;
    char digits[24];
    int nd = 0;
    for (; *p && *p != 'e'; p++)
        if (*p >= '0' && *p <= '9') digits[nd++] = *p;
    int exp10 = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    digits[nd] = 0;
    char *o = buf;
    size_t left = n;
#define PUT(...)                                                                                   \
    do {                                                                                           \
        int w_ = snprintf(o, left, __VA_ARGS__);                                                   \
        if (w_ > 0 && (size_t)w_ < left) {                                                         \
            o += w_;                                                                               \
            left -= (size_t)w_;                                                                    \
        }                                                                                          \
    } while (0)
    if (neg) PUT("-");
    if (exp10 < -4 || exp10 >= 16) {
        PUT("%c", digits[0]);
        if (nd > 1) PUT(".%s", digits + 1);
        PUT("e%c%02d", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
    } else if (exp10 < 0) {
        PUT("0.");
        for (int i = 0; i < -exp10 - 1; i++) PUT("0");
        PUT("%s", digits);
    } else {
        for (int i = 0; i <= exp10; i++) PUT("%c", i < nd ? digits[i] : '0');
        PUT(".");
        if (nd > exp10 + 1)
            PUT("%s", digits + exp10 + 1);
        else
            PUT("0");
    }
#undef PUT
}

static bool cp_printable(uint32_t c)
{
    if (c < 0x20 || c == 0x7F) return false;
    if (c < 0x7F) return true;
    if (c <= 0xA0 || c == 0xAD) return false;
    if ((c >= 0x600 && c <= 0x605) || c == 0x61C || c == 0x6DD || c == 0x70F || c == 0x8E2 ||
        c == 0x180E || c == 0x1680 || (c >= 0x2000 && c <= 0x200F) ||
        (c >= 0x2028 && c <= 0x202F) || (c >= 0x205F && c <= 0x2064) ||
        (c >= 0x2066 && c <= 0x206F) || c == 0x3000 || (c >= 0xD800 && c <= 0xF8FF) ||
        c == 0xFEFF || (c >= 0xFFF9 && c <= 0xFFFB) || c == 0xFFFE || c == 0xFFFF || c == 0x110BD ||
        c == 0x110CD || (c >= 0x13430 && c <= 0x1343F) || (c >= 0x1BCA0 && c <= 0x1BCA3) ||
        (c >= 0x1D173 && c <= 0x1D17A) || c == 0xE0001 || (c >= 0xE0020 && c <= 0xE007F) ||
        c >= 0xF0000)
        return false;
    return true;
}

static int repr_str(sbuf *b, const char *s, size_t n)
{
    bool has_sq = memchr(s, '\'', n) != NULL, has_dq = memchr(s, '"', n) != NULL;
    char q = has_sq && !has_dq ? '"' : '\'';
    PD_CHECK(sb_addc(b, q));
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x80) {
            i++;
            if (c == '\\')
                PD_CHECK(sb_adds(b, "\\\\"));
            else if (c == (unsigned char)q) {
                PD_CHECK(sb_addc(b, '\\'));
                PD_CHECK(sb_addc(b, (char)c));
            } else if (c == '\n')
                PD_CHECK(sb_adds(b, "\\n"));
            else if (c == '\r')
                PD_CHECK(sb_adds(b, "\\r"));
            else if (c == '\t')
                PD_CHECK(sb_adds(b, "\\t"));
            else if (c < 0x20 || c == 0x7F)
                PD_CHECK(sb_printf(b, "\\x%02x", c));
            else
                PD_CHECK(sb_addc(b, (char)c));
            continue;
        }
        uint32_t cp;
        size_t len = dec(s, n, i, &cp);
        if (cp_printable(cp))
            PD_CHECK(sb_add(b, s + i, len));
        else if (cp < 0x100)
            PD_CHECK(sb_printf(b, "\\x%02x", cp));
        else if (cp < 0x10000)
            PD_CHECK(sb_printf(b, "\\u%04x", cp));
        else
            PD_CHECK(sb_printf(b, "\\U%08x", cp));
        i += len;
    }
    return sb_addc(b, q);
}

static int print_value(rt *R, sbuf *b, const jv *v, bool repr, int depth)
{
    if (depth > MAX_NEST) return rt_error(R, 0, "value nested too deeply to print");
    char num[64];
    switch (v->kind) {
    case JV_UNDEF: return repr ? sb_adds(b, "Undefined") : 0;
    case JV_NONE: return sb_adds(b, "None");
    case JV_BOOL: return sb_adds(b, v->u.b ? "True" : "False");
    case JV_INT: return sb_printf(b, "%lld", (long long)v->u.i);
    case JV_FLOAT: float_repr(v->u.f, num, sizeof num, false); return sb_adds(b, num);
    case JV_STR: return repr ? repr_str(b, v->u.s.p, v->u.s.n) : sb_add(b, v->u.s.p, v->u.s.n);
    case JV_LIST: {
        const jlist *l = v->u.l;
        if (l->gen) return sb_adds(b, "<generator object>");
        PD_CHECK(sb_addc(b, l->tuple ? '(' : '['));
        for (size_t i = 0; i < l->n; i++) {
            if (i) PD_CHECK(sb_adds(b, ", "));
            PD_CHECK(print_value(R, b, &l->v[i], true, depth + 1));
        }
        if (l->tuple && l->n == 1) PD_CHECK(sb_addc(b, ','));
        return sb_addc(b, l->tuple ? ')' : ']');
    }
    case JV_DICT:
    case JV_NS: {
        const jdict *d = v->u.d;
        if (v->kind == JV_NS) PD_CHECK(sb_adds(b, "<Namespace "));
        PD_CHECK(sb_addc(b, '{'));
        for (size_t i = 0; i < d->n; i++) {
            if (i) PD_CHECK(sb_adds(b, ", "));
            PD_CHECK(print_value(R, b, &d->k[i], true, depth + 1));
            PD_CHECK(sb_adds(b, ": "));
            PD_CHECK(print_value(R, b, &d->v[i], true, depth + 1));
        }
        PD_CHECK(sb_addc(b, '}'));
        return v->kind == JV_NS ? sb_addc(b, '>') : 0;
    }
    case JV_LOOP:
        return sb_printf(b, "<LoopContext %lld/%lld>", (long long)v->u.lp->index0 + 1,
                         (long long)v->u.lp->length);
    case JV_FUNC: return sb_printf(b, "<function %s>", jinja_func_name(v->fn));
    default: return sb_printf(b, "<built-in method %s>", jinja_method_name(v->fn));
    }
}

/* str(v) as a string value (no copy for strings). */
static int to_str(rt *R, const jv *v, jv *out)
{
    if (v->kind == JV_STR) {
        *out = *v;
        return 0;
    }
    if (v->kind == JV_UNDEF) {
        *out = v_str("", 0);
        return 0;
    }
    sbuf b = {0};
    int rc = print_value(R, &b, v, false, 0);
    if (rc < 0) {
        free(b.p);
        return rc;
    }
    return v_from_sb(R, &b, out);
}

/* ---- tojson: json.dumps(x, ensure_ascii=False, indent, separators, sort_keys) --------- */

typedef struct {
    const char *indent; /* NULL = no indent */
    size_t indent_n;
    const char *item_sep, *key_sep;
    size_t item_sep_n, key_sep_n;
    bool sort_keys, ensure_ascii;
} json_opts;

static int json_str(sbuf *b, const char *s, size_t n, bool ascii)
{
    PD_CHECK(sb_addc(b, '"'));
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x80) {
            i++;
            switch (c) {
            case '"': PD_CHECK(sb_adds(b, "\\\"")); break;
            case '\\': PD_CHECK(sb_adds(b, "\\\\")); break;
            case '\n': PD_CHECK(sb_adds(b, "\\n")); break;
            case '\r': PD_CHECK(sb_adds(b, "\\r")); break;
            case '\t': PD_CHECK(sb_adds(b, "\\t")); break;
            case '\b': PD_CHECK(sb_adds(b, "\\b")); break;
            case '\f': PD_CHECK(sb_adds(b, "\\f")); break;
            default:
                if (c < 0x20)
                    PD_CHECK(sb_printf(b, "\\u%04x", c));
                else
                    PD_CHECK(sb_addc(b, (char)c));
            }
            continue;
        }
        uint32_t cp;
        size_t len = dec(s, n, i, &cp);
        if (!ascii)
            PD_CHECK(sb_add(b, s + i, len));
        else if (cp < 0x10000)
            PD_CHECK(sb_printf(b, "\\u%04x", cp));
        else {
            uint32_t v = cp - 0x10000;
            PD_CHECK(sb_printf(b, "\\u%04x\\u%04x", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF)));
        }
        i += len;
    }
    return sb_addc(b, '"');
}

static int json_newline(sbuf *b, const json_opts *o, int level)
{
    PD_CHECK(sb_addc(b, '\n'));
    for (int i = 0; i < level; i++) PD_CHECK(sb_add(b, o->indent, o->indent_n));
    return 0;
}

static int json_value(rt *R, sbuf *b, const jv *v, const json_opts *o, int level);

static int json_key(rt *R, sbuf *b, const jv *k, const json_opts *o)
{
    char num[64];
    switch (k->kind) {
    case JV_STR: return json_str(b, k->u.s.p, k->u.s.n, o->ensure_ascii);
    case JV_INT: return sb_printf(b, "\"%lld\"", (long long)k->u.i);
    case JV_BOOL: return sb_adds(b, k->u.b ? "\"true\"" : "\"false\"");
    case JV_NONE: return sb_adds(b, "\"null\"");
    case JV_FLOAT: float_repr(k->u.f, num, sizeof num, true); return sb_printf(b, "\"%s\"", num);
    default:
        return rt_error(R, 0, "keys must be str, int, float, bool or None, not %s", type_name(k));
    }
}

static int cmp_keys(const void *x, const void *y)
{
    const jv *a = *(const jv *const *)x, *b = *(const jv *const *)y;
    if (a->kind == JV_STR && b->kind == JV_STR) {
        size_t n = a->u.s.n < b->u.s.n ? a->u.s.n : b->u.s.n;
        int c = memcmp(a->u.s.p, b->u.s.p, n);
        return c ? c : (a->u.s.n > b->u.s.n) - (a->u.s.n < b->u.s.n);
    }
    if (is_num(a) && is_num(b)) return (as_float(a) > as_float(b)) - (as_float(a) < as_float(b));
    return 0;
}

static int json_value(rt *R, sbuf *b, const jv *v, const json_opts *o, int level)
{
    if (level > MAX_NEST) return rt_error(R, 0, "value nested too deeply for tojson");
    char num[64];
    switch (v->kind) {
    case JV_NONE: return sb_adds(b, "null");
    case JV_BOOL: return sb_adds(b, v->u.b ? "true" : "false");
    case JV_INT: return sb_printf(b, "%lld", (long long)v->u.i);
    case JV_FLOAT: float_repr(v->u.f, num, sizeof num, true); return sb_adds(b, num);
    case JV_STR: return json_str(b, v->u.s.p, v->u.s.n, o->ensure_ascii);
    case JV_LIST: {
        const jlist *l = v->u.l;
        if (l->gen) return rt_error(R, 0, "Object of type generator is not JSON serializable");
        if (l->n == 0) return sb_adds(b, "[]");
        PD_CHECK(sb_addc(b, '['));
        for (size_t i = 0; i < l->n; i++) {
            if (i) PD_CHECK(sb_add(b, o->item_sep, o->item_sep_n));
            if (o->indent) PD_CHECK(json_newline(b, o, level + 1));
            PD_CHECK(json_value(R, b, &l->v[i], o, level + 1));
        }
        if (o->indent) PD_CHECK(json_newline(b, o, level));
        return sb_addc(b, ']');
    }
    case JV_DICT: {
        const jdict *d = v->u.d;
        if (d->n == 0) return sb_adds(b, "{}");
        const jv **order = ralloc(R, d->n * sizeof *order);
        if (!order) return oom(R);
        for (size_t i = 0; i < d->n; i++) order[i] = &d->k[i];
        if (o->sort_keys) qsort(order, d->n, sizeof *order, cmp_keys);
        PD_CHECK(sb_addc(b, '{'));
        for (size_t i = 0; i < d->n; i++) {
            size_t at = (size_t)(order[i] - d->k);
            if (i) PD_CHECK(sb_add(b, o->item_sep, o->item_sep_n));
            if (o->indent) PD_CHECK(json_newline(b, o, level + 1));
            PD_CHECK(json_key(R, b, &d->k[at], o));
            PD_CHECK(sb_add(b, o->key_sep, o->key_sep_n));
            PD_CHECK(json_value(R, b, &d->v[at], o, level + 1));
        }
        if (o->indent) PD_CHECK(json_newline(b, o, level));
        return sb_addc(b, '}');
    }
    default: return rt_error(R, 0, "Object of type %s is not JSON serializable", type_name(v));
    }
}

/* ---- scopes and names ----------------------------------------------------------------- */

static scope *scope_new(rt *R, scope *parent)
{
    scope *s = ralloc(R, sizeof *s);
    if (!s) return NULL;
    memset(s, 0, sizeof *s);
    s->parent = parent;
    return s;
}

static int scope_set(rt *R, scope *s, const char *name, jv val)
{
    for (size_t i = 0; i < s->n; i++)
        if (strcmp(s->names[i], name) == 0) {
            s->vals[i] = val;
            return 0;
        }
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 2;
        const char **nm = ralloc(R, cap * sizeof *nm);
        jv *v = ralloc(R, cap * sizeof *v);
        if (!nm || !v) return oom(R);
        if (s->n) {
            memcpy(nm, s->names, s->n * sizeof *nm);
            memcpy(v, s->vals, s->n * sizeof *v);
        }
        s->names = nm;
        s->vals = v;
        s->cap = cap;
    }
    s->names[s->n] = name;
    s->vals[s->n] = val;
    s->n++;
    return 0;
}

static int lookup(rt *R, scope *s, const char *name, size_t n, jv *out)
{
    for (; s; s = s->parent)
        for (size_t i = s->n; i-- > 0;)
            if (strcmp(s->names[i], name) == 0) {
                *out = s->vals[i];
                return 0;
            }
    long at = dict_find_str(R->ctx, name, n);
    if (at >= 0) {
        *out = R->ctx->v[at];
        return 0;
    }
    int g = jinja_func_id(name, n);
    if (g >= 0) {
        *out = (jv){.kind = JV_FUNC, .fn = (uint8_t)g};
        return 0;
    }
    const char *hint = pd_arena_sprintf(R->A, "'%s' is undefined", name);
    *out = v_undef(hint);
    return 0;
}

/* ---- attribute and item access ------------------------------------------------------ */

static int make_method(rt *R, const jv *self, int id, jv *out)
{
    jv *copy = ralloc(R, sizeof *copy);
    if (!copy) return oom(R);
    *copy = *self;
    *out = (jv){.kind = JV_METHOD, .fn = (uint8_t)id, .u.self = copy};
    return 0;
}

static bool is_str_method(int id)
{
    return id >= JM_STRIP && id <= JM_TITLE;
}
static bool is_dict_method(int id)
{
    return id >= JM_ITEMS && id <= JM_GET;
}

/* obj.name (jinja2: attribute first, then item; here the subset's rules). */
static int get_attr(rt *R, const jv *obj, const char *name, size_t n, int mid, int line, jv *out)
{
    switch (obj->kind) {
    case JV_UNDEF: return undefined_error(R, obj, line);
    case JV_DICT: {
        if (mid >= 0 && is_dict_method(mid)) return make_method(R, obj, mid, out);
        long at = dict_find_str(obj->u.d, name, n);
        if (at >= 0) {
            *out = obj->u.d->v[at];
            return 0;
        }
        *out =
            v_undef(pd_arena_sprintf(R->A, "'dict object' has no attribute '%.*s'", (int)n, name));
        return 0;
    }
    case JV_NS: {
        long at = dict_find_str(obj->u.d, name, n);
        if (at >= 0) {
            *out = obj->u.d->v[at];
            return 0;
        }
        break;
    }
    case JV_STR:
        if (mid >= 0 && is_str_method(mid)) return make_method(R, obj, mid, out);
        break;
    case JV_LOOP: {
        const jloop *lp = obj->u.lp;
#define IS(s) (n == strlen(s) && memcmp(name, s, n) == 0)
        if (IS("index"))
            *out = v_int(lp->index0 + 1);
        else if (IS("index0"))
            *out = v_int(lp->index0);
        else if (IS("first"))
            *out = v_bool(lp->index0 == 0);
        else if (IS("last"))
            *out = v_bool(lp->index0 == lp->length - 1);
        else if (IS("length"))
            *out = v_int(lp->length);
        else if (IS("revindex"))
            *out = v_int(lp->length - lp->index0);
        else if (IS("revindex0"))
            *out = v_int(lp->length - lp->index0 - 1);
        else if (IS("depth"))
            *out = v_int(1);
        else if (IS("depth0"))
            *out = v_int(0);
        else if (IS("previtem"))
            *out =
                lp->index0 > 0 ? lp->items[lp->index0 - 1] : v_undef("there is no previous item");
        else if (IS("nextitem"))
            *out = lp->index0 + 1 < lp->length ? lp->items[lp->index0 + 1]
                                               : v_undef("there is no next item");
        else
            break;
#undef IS
        return 0;
    }
    default: break;
    }
    *out = v_undef(pd_arena_sprintf(R->A, "'%s object' has no attribute '%.*s'", type_name(obj),
                                    (int)n, name));
    return 0;
}

/* Python index normalization; false when out of range. */
static bool norm_index(int64_t i, size_t n, size_t *at)
{
    if (i < 0) i += (int64_t)n;
    if (i < 0 || (uint64_t)i >= n) return false;
    *at = (size_t)i;
    return true;
}

/* obj[key] */
static int get_item(rt *R, const jv *obj, const jv *key, int line, jv *out)
{
    if (obj->kind == JV_UNDEF) return undefined_error(R, obj, line);
    if (obj->kind == JV_DICT || obj->kind == JV_NS) {
        long at = dict_find(obj->u.d, key);
        if (at >= 0) {
            *out = obj->u.d->v[at];
            return 0;
        }
    } else if (obj->kind == JV_LIST && obj->u.l->gen) {
        *out = v_undef("'generator' object is not subscriptable");
        return 0;
    } else if (obj->kind == JV_LIST && is_intlike(key)) {
        size_t at;
        if (norm_index(as_int(key), obj->u.l->n, &at)) {
            *out = obj->u.l->v[at];
            return 0;
        }
        *out = v_undef(pd_arena_sprintf(R->A, "%s object has no element %lld", type_name(obj),
                                        (long long)as_int(key)));
        return 0;
    } else if (obj->kind == JV_STR && is_intlike(key)) {
        const char *s = obj->u.s.p;
        size_t n = obj->u.s.n, at;
        if (all_ascii(s, n)) {
            if (norm_index(as_int(key), n, &at)) {
                *out = v_str(s + at, 1);
                return 0;
            }
        } else {
            size_t *offs, count;
            PD_CHECK(cp_offsets(R, s, n, &offs, &count));
            if (norm_index(as_int(key), count, &at)) {
                *out = v_str(s + offs[at], offs[at + 1] - offs[at]);
                return 0;
            }
        }
        *out = v_undef("string index out of range");
        return 0;
    }
    if (key->kind == JV_STR && obj->kind != JV_DICT)
        return get_attr(R, obj, key->u.s.p, key->u.s.n, jinja_method_id(key->u.s.p, key->u.s.n),
                        line, out);
    if (key->kind == JV_STR && obj->kind == JV_DICT) {
        int mid = jinja_method_id(key->u.s.p, key->u.s.n);
        if (mid >= 0 && is_dict_method(mid)) return make_method(R, obj, mid, out);
        *out = v_undef(pd_arena_sprintf(R->A, "'dict object' has no attribute '%.*s'",
                                        (int)key->u.s.n, key->u.s.p));
        return 0;
    }
    *out = v_undef("no such item");
    return 0;
}

/* Python slice indices (CPython's PySlice_AdjustIndices). */
static int slice_indices(rt *R, int line, const jv *s0, const jv *s1, const jv *s2, size_t len,
                         int64_t *start, int64_t *step, int64_t *count)
{
    int64_t st = 1;
    if (s2 && s2->kind != JV_NONE) {
        if (!is_intlike(s2)) return rt_error(R, line, "slice indices must be integers or None");
        st = as_int(s2);
        if (st == 0) return rt_error(R, line, "slice step cannot be zero");
    }
    int64_t n = (int64_t)len, a, b;
    for (int k = 0; k < 2; k++) {
        const jv *x = k == 0 ? s0 : s1;
        int64_t *dst = k == 0 ? &a : &b;
        if (!x || x->kind == JV_NONE) {
            *dst = k == 0 ? (st < 0 ? n - 1 : 0) : (st < 0 ? -1 : n);
            if (k == 1 && st < 0) *dst = INT64_MIN; /* "to the beginning" */
            continue;
        }
        if (!is_intlike(x)) return rt_error(R, line, "slice indices must be integers or None");
        int64_t v = as_int(x);
        if (v < 0) {
            v += n;
            if (v < 0) v = st < 0 ? -1 : 0;
        } else if (v >= n) {
            v = st < 0 ? n - 1 : n;
        }
        *dst = v;
    }
    if (b == INT64_MIN) b = -1;
    int64_t c = 0;
    if (st > 0 && a < b)
        c = (b - a - 1) / st + 1;
    else if (st < 0 && b < a)
        c = (a - b - 1) / (-st) + 1;
    *start = a;
    *step = st;
    *count = c;
    return 0;
}

static int do_slice(rt *R, const jv *obj, const jv *s0, const jv *s1, const jv *s2, int line,
                    jv *out)
{
    int64_t start, step, count;
    if (obj->kind == JV_UNDEF) return undefined_error(R, obj, line);
    if (obj->kind == JV_LIST && obj->u.l->gen) /* jinja2 slices bypass getitem: an error */
        return rt_error(R, line, "'generator' object is not subscriptable");
    if (obj->kind == JV_LIST) {
        PD_CHECK(slice_indices(R, line, s0, s1, s2, obj->u.l->n, &start, &step, &count));
        PD_CHECK(new_list(R, (size_t)count, obj->u.l->tuple, out));
        for (int64_t i = 0; i < count; i++) out->u.l->v[i] = obj->u.l->v[start + i * step];
        out->u.l->n = (size_t)count;
        return 0;
    }
    if (obj->kind == JV_STR) {
        const char *s = obj->u.s.p;
        size_t n = obj->u.s.n;
        size_t *offs = NULL, ncp = n;
        if (!all_ascii(s, n)) PD_CHECK(cp_offsets(R, s, n, &offs, &ncp));
        PD_CHECK(slice_indices(R, line, s0, s1, s2, ncp, &start, &step, &count));
        if (step == 1) {
            size_t a = offs ? offs[start] : (size_t)start;
            size_t b = offs ? offs[start + count] : (size_t)(start + count);
            if (count == 0) b = a;
            *out = v_str(s + a, b - a);
            return 0;
        }
        char *o = ralloc(R, n + 1);
        if (!o) return oom(R);
        size_t k = 0;
        for (int64_t i = 0; i < count; i++) {
            size_t at = (size_t)(start + i * step);
            size_t a = offs ? offs[at] : at, b = offs ? offs[at + 1] : at + 1;
            memcpy(o + k, s + a, b - a);
            k += b - a;
        }
        o[k] = 0;
        *out = v_str(o, k);
        return 0;
    }
    return rt_error(R, line, "'%s' object is not subscriptable", type_name(obj));
}

/* Items a for loop (or a filter) iterates over. */
static int iterate(rt *R, const jv *v, int line, const jv **items, size_t *n)
{
    switch (v->kind) {
    case JV_UNDEF:
        *items = NULL;
        *n = 0;
        return 0;
    case JV_LIST:
        if (v->u.l->fail) return rt_error(R, line, "%s", v->u.l->fail);
        *items = v->u.l->v;
        *n = v->u.l->n;
        if (v->u.l->gen) { /* consumed */
            v->u.l->v += v->u.l->n;
            v->u.l->n = 0;
        }
        return 0;
    case JV_DICT:
        *items = v->u.d->k;
        *n = v->u.d->n;
        return 0;
    case JV_STR: {
        size_t *offs, count;
        PD_CHECK(cp_offsets(R, v->u.s.p, v->u.s.n, &offs, &count));
        jv *chars = ralloc(R, (count ? count : 1) * sizeof *chars);
        if (!chars) return oom(R);
        for (size_t i = 0; i < count; i++)
            chars[i] = v_str(v->u.s.p + offs[i], offs[i + 1] - offs[i]);
        *items = chars;
        *n = count;
        return 0;
    }
    default: return rt_error(R, line, "'%s' object is not iterable", type_name(v));
    }
}

static int v_length(rt *R, const jv *v, int line, int64_t *n)
{
    switch (v->kind) {
    case JV_UNDEF: *n = 0; return 0;
    case JV_STR: *n = (int64_t)cp_count(v->u.s.p, v->u.s.n); return 0;
    case JV_LIST:
        if (v->u.l->gen) return rt_error(R, line, "object of type 'generator' has no len()");
        *n = (int64_t)v->u.l->n;
        return 0;
    case JV_DICT:
    case JV_NS: *n = (int64_t)v->u.d->n; return 0;
    default: return rt_error(R, line, "object of type '%s' has no len()", type_name(v));
    }
}

static int contains(rt *R, const jv *needle, const jv *hay, int line, bool *res)
{
    switch (hay->kind) {
    case JV_UNDEF: *res = false; return 0;
    case JV_STR:
        if (needle->kind == JV_UNDEF) return undefined_error(R, needle, line);
        if (needle->kind != JV_STR)
            return rt_error(R, line, "'in <string>' requires string as left operand, not %s",
                            type_name(needle));
        if (needle->u.s.n == 0)
            *res = true;
        else {
            *res = false;
            for (size_t i = 0; i + needle->u.s.n <= hay->u.s.n; i++)
                if (memcmp(hay->u.s.p + i, needle->u.s.p, needle->u.s.n) == 0) {
                    *res = true;
                    break;
                }
        }
        return 0;
    case JV_LIST: {
        jlist *l = hay->u.l;
        size_t i;
        if (l->fail) return rt_error(R, line, "%s", l->fail);
        *res = false;
        for (i = 0; i < l->n; i++)
            if (v_eq(needle, &l->v[i], 0)) {
                *res = true;
                break;
            }
        if (l->gen) { /* a generator is consumed up to the match */
            size_t used = *res ? i + 1 : l->n;
            l->v += used;
            l->n -= used;
        }
        return 0;
    }
    case JV_DICT:
    case JV_NS:
        if ((needle->kind == JV_LIST && !needle->u.l->tuple) || needle->kind == JV_DICT)
            return rt_error(R, line, "unhashable type: '%s'", type_name(needle));
        *res = dict_find(hay->u.d, needle) >= 0;
        return 0;
    default: return rt_error(R, line, "argument of type '%s' is not iterable", type_name(hay));
    }
}

/* ---- arithmetic ------------------------------------------------------------------------ */

static int binop(rt *R, int op, const jv *a, const jv *b, int line, jv *out)
{
    if (a->kind == JV_UNDEF) return undefined_error(R, a, line);
    if (b->kind == JV_UNDEF) return undefined_error(R, b, line);
    static const char *const sym[] = {"+", "-", "*", "/", "//", "%", "**"};
    if (is_num(a) && is_num(b)) {
        bool fl = a->kind == JV_FLOAT || b->kind == JV_FLOAT;
        int64_t x = as_int(a), y = as_int(b), r;
        double fx = as_float(a), fy = as_float(b);
        switch (op) {
        case JOP_ADD:
            if (fl)
                *out = v_float(fx + fy);
            else if (__builtin_add_overflow(x, y, &r))
                goto overflow;
            else
                *out = v_int(r);
            return 0;
        case JOP_SUB:
            if (fl)
                *out = v_float(fx - fy);
            else if (__builtin_sub_overflow(x, y, &r))
                goto overflow;
            else
                *out = v_int(r);
            return 0;
        case JOP_MUL:
            if (fl)
                *out = v_float(fx * fy);
            else if (__builtin_mul_overflow(x, y, &r))
                goto overflow;
            else
                *out = v_int(r);
            return 0;
        case JOP_DIV:
            if (fy == 0.0) return rt_error(R, line, "division by zero");
            *out = v_float(fx / fy);
            return 0;
        case JOP_FLOORDIV:
        case JOP_MOD:
            if (fl ? fy == 0.0 : y == 0)
                return rt_error(R, line, "integer division or modulo by zero");
            if (fl) {
                double m = fmod(fx, fy);
                if (m != 0.0 && ((fy < 0) != (m < 0))) m += fy;
                if (op == JOP_MOD)
                    *out = v_float(m == 0.0 ? copysign(0.0, fy) : m);
                else
                    *out = v_float(floor((fx - m) / fy));
                return 0;
            }
            if (x == INT64_MIN && y == -1) goto overflow;
            {
                int64_t q = x / y, m = x % y;
                if (m != 0 && ((m < 0) != (y < 0))) {
                    m += y;
                    q -= 1;
                }
                *out = v_int(op == JOP_MOD ? m : q);
            }
            return 0;
        case JOP_POW:
            if (!fl && y >= 0) {
                int64_t acc = 1, base = x;
                for (int64_t e = y; e > 0; e >>= 1) {
                    if ((e & 1) && __builtin_mul_overflow(acc, base, &acc)) goto overflow;
                    if (e > 1 && __builtin_mul_overflow(base, base, &base)) goto overflow;
                }
                *out = v_int(acc);
                return 0;
            }
            if (fx == 0.0 && fy < 0)
                return rt_error(R, line, "0.0 cannot be raised to a negative power");
            *out = v_float(pow(fx, fy));
            return 0;
        }
    }
    if (op == JOP_ADD && a->kind == JV_STR && b->kind == JV_STR) {
        char *s = ralloc(R, a->u.s.n + b->u.s.n + 1);
        if (!s) return oom(R);
        memcpy(s, a->u.s.p, a->u.s.n);
        memcpy(s + a->u.s.n, b->u.s.p, b->u.s.n);
        s[a->u.s.n + b->u.s.n] = 0;
        *out = v_str(s, a->u.s.n + b->u.s.n);
        return 0;
    }
    if (op == JOP_ADD && is_seq(a) && is_seq(b) && a->u.l->tuple == b->u.l->tuple) {
        PD_CHECK(new_list(R, a->u.l->n + b->u.l->n, a->u.l->tuple, out));
        memcpy(out->u.l->v, a->u.l->v, a->u.l->n * sizeof(jv));
        memcpy(out->u.l->v + a->u.l->n, b->u.l->v, b->u.l->n * sizeof(jv));
        out->u.l->n = a->u.l->n + b->u.l->n;
        return 0;
    }
    if (op == JOP_MUL && (((a->kind == JV_STR || is_seq(a)) && is_intlike(b)) ||
                          ((b->kind == JV_STR || is_seq(b)) && is_intlike(a)))) {
        const jv *seq = is_intlike(b) ? a : b;
        int64_t times = is_intlike(b) ? as_int(b) : as_int(a);
        if (times < 0) times = 0;
        size_t unit = seq->kind == JV_STR ? seq->u.s.n : seq->u.l->n;
        if (unit && (uint64_t)times > MAX_OUTPUT / unit)
            return rt_error(R, line, "repeated value too large");
        if (seq->kind == JV_STR) {
            char *s = ralloc(R, unit * (size_t)times + 1);
            if (!s) return oom(R);
            for (int64_t i = 0; i < times; i++) memcpy(s + (size_t)i * unit, seq->u.s.p, unit);
            s[unit * (size_t)times] = 0;
            *out = v_str(s, unit * (size_t)times);
        } else {
            PD_CHECK(new_list(R, unit * (size_t)times, seq->u.l->tuple, out));
            for (int64_t i = 0; i < times; i++)
                memcpy(out->u.l->v + (size_t)i * unit, seq->u.l->v, unit * sizeof(jv));
            out->u.l->n = unit * (size_t)times;
        }
        return 0;
    }
    if (op == JOP_ADD && a->kind == JV_STR)
        return rt_error(R, line, "can only concatenate str (not \"%s\") to str", type_name(b));
    if (op == JOP_MOD && a->kind == JV_STR)
        return rt_error(R, line, "string formatting with '%%' is not supported");
    return rt_error(R, line, "unsupported operand type(s) for %s: '%s' and '%s'", sym[op],
                    type_name(a), type_name(b));
overflow:
    return rt_error(R, line, "integer overflow");
}

/* ---- string helpers for methods and filters ------------------------------------------- */

static bool in_chars(uint32_t cp, const jv *chars)
{
    const char *s = chars->u.s.p;
    size_t n = chars->u.s.n;
    for (size_t i = 0; i < n;) {
        uint32_t c;
        i += dec(s, n, i, &c);
        if (c == cp) return true;
    }
    return false;
}

/* Python str.strip/lstrip/rstrip; chars NULL (or none) = whitespace. */
static jv do_strip(const jv *v, const jv *chars, bool left, bool right)
{
    const char *s = v->u.s.p;
    size_t a = 0, b = v->u.s.n;
    bool ws = !chars || chars->kind != JV_STR;
    if (left)
        while (a < b) {
            uint32_t cp;
            size_t len = dec(s, b, a, &cp);
            if (ws ? !jinja_is_space(cp) : !in_chars(cp, chars)) break;
            a += len;
        }
    if (right)
        while (b > a) {
            size_t st = b - 1;
            while (st > a && ((unsigned char)s[st] & 0xC0) == 0x80 && b - st < 4) st--;
            uint32_t cp;
            dec(s, b, st, &cp);
            if (ws ? !jinja_is_space(cp) : !in_chars(cp, chars)) break;
            b = st;
        }
    return v_str(s + a, b - a);
}

static int do_replace(rt *R, const jv *s, const jv *old, const jv *new_, int64_t count, jv *out)
{
    sbuf b = {0};
    const char *p = s->u.s.p;
    size_t n = s->u.s.n, on = old->u.s.n;
    int rc = 0;
    if (count < 0) count = INT64_MAX;
    if (on == 0) {
        /* Python inserts new before every code point and at the end */
        size_t i = 0;
        int64_t done = 0;
        while (rc == 0 && i <= n) {
            if (done < count) {
                rc = sb_add(&b, new_->u.s.p, new_->u.s.n);
                done++;
            }
            if (i == n) break;
            uint32_t cp;
            size_t len = dec(p, n, i, &cp);
            if (rc == 0) rc = sb_add(&b, p + i, len);
            i += len;
        }
    } else {
        size_t i = 0;
        int64_t done = 0;
        while (rc == 0 && i < n) {
            if (done < count && i + on <= n && memcmp(p + i, old->u.s.p, on) == 0) {
                rc = sb_add(&b, new_->u.s.p, new_->u.s.n);
                i += on;
                done++;
            } else {
                rc = sb_addc(&b, p[i++]);
            }
        }
    }
    if (rc < 0) {
        free(b.p);
        return rc;
    }
    return v_from_sb(R, &b, out);
}

static int do_split(rt *R, const jv *s, const jv *sep, int64_t maxsplit, int line, jv *out)
{
    PD_CHECK(new_list(R, 4, false, out));
    const char *p = s->u.s.p;
    size_t n = s->u.s.n;
    if (maxsplit < 0) maxsplit = INT64_MAX;
    if (!sep || sep->kind == JV_NONE) {
        size_t i = 0;
        int64_t splits = 0;
        for (;;) {
            while (i < n) { /* skip whitespace */
                uint32_t cp;
                size_t len = dec(p, n, i, &cp);
                if (!jinja_is_space(cp)) break;
                i += len;
            }
            if (i >= n) break;
            size_t start = i;
            if (splits >= maxsplit) {
                /* the rest, as it is (its leading whitespace was skipped) */
                PD_CHECK(list_push(R, out->u.l, v_str(p + start, n - start)));
                break;
            }
            while (i < n) {
                uint32_t cp;
                size_t len = dec(p, n, i, &cp);
                if (jinja_is_space(cp)) break;
                i += len;
            }
            PD_CHECK(list_push(R, out->u.l, v_str(p + start, i - start)));
            splits++;
        }
        return 0;
    }
    if (sep->kind != JV_STR)
        return rt_error(R, line, "must be str or None, not %s", type_name(sep));
    size_t sn = sep->u.s.n;
    if (sn == 0) return rt_error(R, line, "empty separator");
    size_t start = 0;
    int64_t splits = 0;
    for (size_t i = 0; i + sn <= n && splits < maxsplit;) {
        if (memcmp(p + i, sep->u.s.p, sn) == 0) {
            PD_CHECK(list_push(R, out->u.l, v_str(p + start, i - start)));
            i += sn;
            start = i;
            splits++;
        } else {
            i++;
        }
    }
    return list_push(R, out->u.l, v_str(p + start, n - start));
}

/* ---- evaluation ----------------------------------------------------------------------- */

typedef struct {
    jv *pos;
    int npos;
    const char **kwn;
    jv *kwv;
    int nkw;
} callargs;

static int eval(rt *R, const jnode *x, scope *S, jv *out);

static int eval_args(rt *R, const jnode *x, scope *S, callargs *ca)
{
    memset(ca, 0, sizeof *ca);
    if (x->nargs == 0) return 0;
    ca->pos = ralloc(R, (size_t)x->nargs * sizeof(jv));
    ca->kwv = ralloc(R, (size_t)x->nargs * sizeof(jv));
    ca->kwn = ralloc(R, (size_t)x->nargs * sizeof(char *));
    if (!ca->pos || !ca->kwv || !ca->kwn) return oom(R);
    for (int i = 0; i < x->nargs; i++) {
        jv v;
        PD_CHECK(eval(R, x->args[i], S, &v));
        if (x->kw && x->kw[i]) {
            ca->kwn[ca->nkw] = x->kw[i];
            ca->kwv[ca->nkw++] = v;
        } else {
            ca->pos[ca->npos++] = v;
        }
    }
    return 0;
}

/* Argument by position or keyword; NULL when not given. */
static const jv *arg(const callargs *ca, int pos, const char *kw)
{
    if (kw)
        for (int i = 0; i < ca->nkw; i++)
            if (strcmp(ca->kwn[i], kw) == 0) return &ca->kwv[i];
    return pos >= 0 && pos < ca->npos ? &ca->pos[pos] : NULL;
}

static int check_args(rt *R, const callargs *ca, int maxpos, const char *const *kws,
                      const char *what, int line)
{
    if (ca->npos > maxpos)
        return rt_error(R, line, "%s() takes at most %d positional arguments (%d given)", what,
                        maxpos, ca->npos);
    for (int i = 0; i < ca->nkw; i++) {
        bool ok = false;
        for (int k = 0; kws && kws[k]; k++) ok |= strcmp(kws[k], ca->kwn[i]) == 0;
        if (!ok)
            return rt_error(R, line, "%s() got an unexpected keyword argument '%s'", what,
                            ca->kwn[i]);
    }
    return 0;
}

static int need_str(rt *R, const jv *v, const char *what, int line)
{
    if (v->kind == JV_STR) return 0;
    if (v->kind == JV_UNDEF) return undefined_error(R, v, line);
    return rt_error(R, line, "%s: expected a string, got %s", what, type_name(v));
}

static int call_func(rt *R, int fn, const callargs *ca, int line, jv *out)
{
    switch (fn) {
    case JG_RAISE_EXCEPTION: {
        jv msg = v_str("", 0);
        if (ca->npos > 0) PD_CHECK(to_str(R, &ca->pos[0], &msg));
        return pd_error(PD_CHAT_ERAISED, "%.*s", (int)msg.u.s.n, msg.u.s.p);
    }
    case JG_STRFTIME_NOW: {
        const jv *fmt = arg(ca, 0, "format");
        if (!fmt) return rt_error(R, line, "strftime_now() missing argument 'format'");
        PD_CHECK(need_str(R, fmt, "strftime_now", line));
        char *f = ralloc(R, fmt->u.s.n + 1);
        if (!f) return oom(R);
        memcpy(f, fmt->u.s.p, fmt->u.s.n);
        f[fmt->u.s.n] = 0;
        time_t t = (time_t)R->now;
        struct tm tm;
        if (!localtime_r(&t, &tm)) return rt_error(R, line, "strftime_now(): bad clock");
        locale_t c = newlocale(LC_ALL_MASK, "C", (locale_t)0);
        if (!c) return oom(R);
        size_t cap = 256, k = 0;
        char *buf = NULL;
        while (cap <= 65536) {
            buf = ralloc(R, cap);
            if (!buf) break;
            k = strftime_l(buf, cap, f, &tm, c);
            if (k > 0 || fmt->u.s.n == 0) break;
            cap *= 4;
        }
        freelocale(c);
        if (!buf) return oom(R);
        *out = v_str(buf, k);
        return 0;
    }
    case JG_NAMESPACE: {
        PD_CHECK(new_dict(R, 4, JV_NS, out));
        if (ca->npos > 1)
            return rt_error(R, line, "namespace() takes at most 1 positional argument");
        if (ca->npos == 1) {
            const jv *init = &ca->pos[0];
            if (init->kind != JV_DICT && init->kind != JV_NS)
                return rt_error(R, line, "namespace() argument must be a mapping");
            for (size_t i = 0; i < init->u.d->n; i++)
                PD_CHECK(dict_set(R, out->u.d, init->u.d->k[i], init->u.d->v[i]));
        }
        for (int i = 0; i < ca->nkw; i++)
            PD_CHECK(dict_set(R, out->u.d, v_str(ca->kwn[i], strlen(ca->kwn[i])), ca->kwv[i]));
        return 0;
    }
    case JG_DICT: {
        PD_CHECK(new_dict(R, 4, JV_DICT, out));
        if (ca->npos > 1) return rt_error(R, line, "dict() takes at most 1 positional argument");
        if (ca->npos == 1) {
            const jv *init = &ca->pos[0];
            if (init->kind != JV_DICT)
                return rt_error(R, line, "dict() argument must be a mapping");
            for (size_t i = 0; i < init->u.d->n; i++)
                PD_CHECK(dict_set(R, out->u.d, init->u.d->k[i], init->u.d->v[i]));
        }
        for (int i = 0; i < ca->nkw; i++)
            PD_CHECK(dict_set(R, out->u.d, v_str(ca->kwn[i], strlen(ca->kwn[i])), ca->kwv[i]));
        return 0;
    }
    case JG_RANGE: {
        if (ca->nkw || ca->npos < 1 || ca->npos > 3)
            return rt_error(R, line, "range() takes 1 to 3 positional arguments");
        for (int i = 0; i < ca->npos; i++)
            if (!is_intlike(&ca->pos[i]))
                return rt_error(R, line, "range(): '%s' object cannot be interpreted as an integer",
                                type_name(&ca->pos[i]));
        int64_t a = 0, b, st = 1;
        if (ca->npos == 1)
            b = as_int(&ca->pos[0]);
        else {
            a = as_int(&ca->pos[0]);
            b = as_int(&ca->pos[1]);
            if (ca->npos == 3) st = as_int(&ca->pos[2]);
        }
        if (st == 0) return rt_error(R, line, "range() arg 3 must not be zero");
        int64_t count = 0;
        if (st > 0 && a < b) count = (int64_t)(((double)b - (double)a - 1) / (double)st) + 1;
        if (st < 0 && a > b) count = (int64_t)(((double)a - (double)b - 1) / (double)-st) + 1;
        if (count > MAX_RANGE)
            return rt_error(R, line,
                            "Range too big. The sandbox blocks ranges larger than "
                            "MAX_RANGE (%d).",
                            MAX_RANGE);
        PD_CHECK(new_list(R, (size_t)count, false, out));
        for (int64_t i = 0; i < count; i++) out->u.l->v[i] = v_int(a + i * st);
        out->u.l->n = (size_t)count;
        return 0;
    }
    }
    return rt_error(R, line, "unknown function");
}

static int call_method(rt *R, const jv *self, int m, const callargs *ca, int line, jv *out)
{
    const char *name = jinja_method_name(m);
    if (is_str_method(m)) {
        switch (m) {
        case JM_STRIP:
        case JM_LSTRIP:
        case JM_RSTRIP: {
            static const char *const kws[] = {NULL};
            PD_CHECK(check_args(R, ca, 1, kws, name, line));
            const jv *chars = arg(ca, 0, NULL);
            if (chars && chars->kind != JV_STR && chars->kind != JV_NONE)
                return rt_error(R, line, "%s arg must be None or str", name);
            *out = do_strip(self, chars, m != JM_RSTRIP, m != JM_LSTRIP);
            return 0;
        }
        case JM_STARTSWITH:
        case JM_ENDSWITH: {
            PD_CHECK(check_args(R, ca, 1, NULL, name, line));
            const jv *p = arg(ca, 0, NULL);
            if (!p) return rt_error(R, line, "%s() takes at least 1 argument (0 given)", name);
            const jv *cands = p;
            size_t nc = 1;
            if (p->kind == JV_LIST && p->u.l->tuple) {
                cands = p->u.l->v;
                nc = p->u.l->n;
            }
            bool res = false;
            for (size_t i = 0; i < nc; i++) {
                const jv *c = &cands[i];
                if (c->kind != JV_STR)
                    return rt_error(R, line, "%s first arg must be str or a tuple of str, not %s",
                                    name, type_name(c));
                size_t k = c->u.s.n, n = self->u.s.n;
                if (k <= n &&
                    memcmp(self->u.s.p + (m == JM_STARTSWITH ? 0 : n - k), c->u.s.p, k) == 0)
                    res = true;
            }
            *out = v_bool(res);
            return 0;
        }
        case JM_SPLIT: {
            static const char *const kws[] = {"sep", "maxsplit", NULL};
            PD_CHECK(check_args(R, ca, 2, kws, name, line));
            const jv *ms = arg(ca, 1, "maxsplit");
            if (ms && !is_intlike(ms)) return rt_error(R, line, "maxsplit must be an integer");
            return do_split(R, self, arg(ca, 0, "sep"), ms ? as_int(ms) : -1, line, out);
        }
        case JM_UPPER:
        case JM_LOWER:
        case JM_TITLE:
            PD_CHECK(check_args(R, ca, 0, NULL, name, line));
            return str_case(R, self->u.s.p, self->u.s.n,
                            m == JM_UPPER   ? CASE_UPPER
                            : m == JM_LOWER ? CASE_LOWER
                                            : CASE_TITLE,
                            out);
        case JM_REPLACE: {
            static const char *const kws[] = {"count", NULL};
            PD_CHECK(check_args(R, ca, 3, kws, name, line));
            const jv *o = arg(ca, 0, NULL), *nw = arg(ca, 1, NULL), *cnt = arg(ca, 2, "count");
            if (!o || !nw) return rt_error(R, line, "replace() takes at least 2 arguments");
            PD_CHECK(need_str(R, o, "replace", line));
            PD_CHECK(need_str(R, nw, "replace", line));
            if (cnt && !is_intlike(cnt))
                return rt_error(R, line, "replace() count must be an integer");
            return do_replace(R, self, o, nw, cnt ? as_int(cnt) : -1, out);
        }
        }
    }
    /* mapping methods */
    const jdict *d = self->u.d;
    switch (m) {
    case JM_ITEMS:
    case JM_KEYS:
    case JM_VALUES:
        PD_CHECK(check_args(R, ca, 0, NULL, name, line));
        PD_CHECK(new_list(R, d->n, false, out));
        for (size_t i = 0; i < d->n; i++) {
            if (m == JM_KEYS)
                out->u.l->v[i] = d->k[i];
            else if (m == JM_VALUES)
                out->u.l->v[i] = d->v[i];
            else {
                jv pair;
                PD_CHECK(new_list(R, 2, true, &pair));
                pair.u.l->v[0] = d->k[i];
                pair.u.l->v[1] = d->v[i];
                pair.u.l->n = 2;
                out->u.l->v[i] = pair;
            }
        }
        out->u.l->n = d->n;
        return 0;
    case JM_GET: {
        PD_CHECK(check_args(R, ca, 2, NULL, name, line));
        const jv *k = arg(ca, 0, NULL), *def = arg(ca, 1, NULL);
        if (!k) return rt_error(R, line, "get expected at least 1 argument, got 0");
        long at = dict_find(d, k);
        *out = at >= 0 ? d->v[at] : def ? *def : v_none();
        return 0;
    }
    }
    return rt_error(R, line, "unknown method");
}

/* ---- tests and filters ------------------------------------------------------------------ */

static int apply_test(rt *R, int test, const jv *v, const jv *args, int nargs, int line, bool *res)
{
    int want = test == JT_EQ || test == JT_NE || test == JT_IN ? 1 : 0;
    if (nargs != want)
        return rt_error(R, line, "the test takes %d argument%s but %d were given", want,
                        want == 1 ? "" : "s", nargs);
    switch (test) {
    case JT_DEFINED: *res = v->kind != JV_UNDEF; return 0;
    case JT_UNDEFINED: *res = v->kind == JV_UNDEF; return 0;
    case JT_NONE: *res = v->kind == JV_NONE; return 0;
    case JT_TRUE: *res = v->kind == JV_BOOL && v->u.b; return 0;
    case JT_FALSE: *res = v->kind == JV_BOOL && !v->u.b; return 0;
    case JT_BOOLEAN: *res = v->kind == JV_BOOL; return 0;
    case JT_STRING: *res = v->kind == JV_STR; return 0;
    case JT_NUMBER: *res = is_num(v); return 0;
    case JT_INTEGER: *res = v->kind == JV_INT; return 0;
    case JT_FLOAT: *res = v->kind == JV_FLOAT; return 0;
    case JT_MAPPING: *res = v->kind == JV_DICT; return 0;
    case JT_ITERABLE:
    case JT_SEQUENCE:
        *res = v->kind == JV_UNDEF || v->kind == JV_STR || v->kind == JV_LIST || v->kind == JV_DICT;
        if (test == JT_SEQUENCE && v->kind == JV_LIST && v->u.l->gen) *res = false;
        return 0;
    case JT_EQ: *res = v_eq(v, &args[0], 0); return 0;
    case JT_NE: *res = !v_eq(v, &args[0], 0); return 0;
    case JT_IN: return contains(R, v, &args[0], line, res);
    }
    return rt_error(R, line, "unknown test");
}

/* jinja2's environment.getitem on a dotted attribute path ("a.b", "0"). */
static int attr_path(rt *R, const jv *item, const jv *path, int line, jv *out)
{
    if (path->kind == JV_INT) return get_item(R, item, path, line, out);
    if (path->kind != JV_STR) return rt_error(R, line, "attribute must be a string");
    jv cur = *item;
    const char *p = path->u.s.p, *end = p + path->u.s.n;
    while (p <= end) {
        const char *dot = memchr(p, '.', (size_t)(end - p));
        if (!dot) dot = end;
        size_t n = (size_t)(dot - p);
        bool digits = n > 0;
        for (size_t i = 0; i < n; i++) digits &= p[i] >= '0' && p[i] <= '9';
        jv key = digits ? v_int(strtoll(p, NULL, 10)) : v_str(p, n);
        jv next;
        if (cur.kind == JV_UNDEF) return undefined_error(R, &cur, line);
        PD_CHECK(get_item(R, &cur, &key, line, &next));
        cur = next;
        p = dot + 1;
    }
    *out = cur;
    return 0;
}

static int test_by_name(rt *R, const jv *name, int line, int *id)
{
    if (name->kind != JV_STR) return rt_error(R, line, "test name must be a string");
    *id = jinja_test_id(name->u.s.p, name->u.s.n);
    if (*id < 0) return rt_error(R, line, "No test named '%.*s'", (int)name->u.s.n, name->u.s.p);
    return 0;
}

static int apply_filter(rt *R, int f, const jv *v, const callargs *ca, int line, jv *out);

static int filter_select(rt *R, int f, const jv *v, const callargs *ca, int line, jv *out)
{
    bool attr = f == JF_SELECTATTR || f == JF_REJECTATTR;
    bool want = f == JF_SELECT || f == JF_SELECTATTR;
    const jv *items = NULL;
    size_t n = 0;
    if (truthy(v)) PD_CHECK(iterate(R, v, line, &items, &n)); /* jinja2: falsy -> nothing */
    int first = attr ? 1 : 0;
    if (attr && ca->npos < 1) return rt_error(R, line, "selectattr() needs an attribute");
    int test = -1;
    if (ca->npos > first) PD_CHECK(test_by_name(R, &ca->pos[first], line, &test));
    const jv *targs = ca->npos > first + 1 ? &ca->pos[first + 1] : NULL;
    int ntargs = ca->npos > first + 1 ? ca->npos - first - 1 : 0;
    PD_CHECK(new_list(R, n, false, out));
    for (size_t i = 0; i < n; i++) {
        jv x = items[i];
        if (attr) PD_CHECK(attr_path(R, &items[i], &ca->pos[0], line, &x));
        bool r = false;
        if (test < 0)
            r = truthy(&x);
        else
            PD_CHECK(apply_test(R, test, &x, targs, ntargs, line, &r));
        if (r == want) out->u.l->v[out->u.l->n++] = items[i];
    }
    out->u.l->gen = true;
    return 0;
}

static int tojson_filter(rt *R, const jv *v, const callargs *ca, int line, jv *out)
{
    static const char *const kws[] = {"indent", "ensure_ascii", "separators", "sort_keys", NULL};
    /* Hugging Face's tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
     */
    PD_CHECK(check_args(R, ca, 4, kws, "tojson", line));
    json_opts o = {.item_sep = ", ", .key_sep = ": "};
    const jv *ind = arg(ca, 1, "indent"), *ea = arg(ca, 0, "ensure_ascii"),
             *sep = arg(ca, 2, "separators"), *sk = arg(ca, 3, "sort_keys");
    char *spaces = NULL;
    if (ind && ind->kind != JV_NONE) {
        if (is_intlike(ind)) {
            int64_t k = as_int(ind);
            if (k < 0) k = 0;
            if (k > 1024) return rt_error(R, line, "tojson indent too large");
            spaces = ralloc(R, (size_t)k + 1);
            if (!spaces) return oom(R);
            memset(spaces, ' ', (size_t)k);
            o.indent = spaces;
            o.indent_n = (size_t)k;
        } else if (ind->kind == JV_STR) {
            o.indent = ind->u.s.p;
            o.indent_n = ind->u.s.n;
        } else {
            return rt_error(R, line, "tojson indent must be an integer or a string");
        }
        o.item_sep = ",";
    }
    if (sep && sep->kind != JV_NONE) {
        if (sep->kind != JV_LIST || sep->u.l->n != 2 || sep->u.l->v[0].kind != JV_STR ||
            sep->u.l->v[1].kind != JV_STR)
            return rt_error(R, line, "tojson separators must be a pair of strings");
        o.item_sep = sep->u.l->v[0].u.s.p;
        o.key_sep = sep->u.l->v[1].u.s.p;
        o.item_sep_n = sep->u.l->v[0].u.s.n;
        o.key_sep_n = sep->u.l->v[1].u.s.n;
    }
    if (!o.item_sep_n) o.item_sep_n = strlen(o.item_sep);
    if (!o.key_sep_n) o.key_sep_n = strlen(o.key_sep);
    o.ensure_ascii = ea && truthy(ea);
    o.sort_keys = sk && truthy(sk);
    sbuf b = {0};
    int rc = json_value(R, &b, v, &o, 0);
    if (rc < 0) {
        free(b.p);
        return rc;
    }
    return v_from_sb(R, &b, out);
}

/* c is an ASCII digit of base (2..36; any other base: of base 36). */
static bool is_digit_of(char c, int base)
{
    int d = c >= '0' && c <= '9'   ? c - '0'
            : c >= 'a' && c <= 'z' ? c - 'a' + 10
            : c >= 'A' && c <= 'Z' ? c - 'A' + 10
                                   : 99;
    return d < (base >= 2 && base <= 36 ? base : 36);
}

/* A stripped string with Python's digit separators removed into buf (n bytes): an underscore
 * counts only between two digits of base ("1_000"); any other one stays, so that the parse
 * fails as Python's does ("1__0", "_1", "1e_5"). false when it does not fit. */
static bool py_unsep(const jv *t, int base, char *buf, size_t n)
{
    const char *s = t->u.s.p;
    size_t m = 0;
    if (t->u.s.n == 0 || t->u.s.n >= n) return false;
    for (size_t i = 0; i < t->u.s.n; i++) {
        if (s[i] == '_' && i > 0 && i + 1 < t->u.s.n && is_digit_of(s[i - 1], base) &&
            is_digit_of(s[i + 1], base))
            continue;
        buf[m++] = s[i];
    }
    buf[m] = 0;
    return true;
}

/* Python's float(s) for s from py_unsep: a decimal literal or inf / infinity / nan, signed.
 * strtod alone also takes C's hex floats ("0x10" is 16.0) and "nan(...)", which Python
 * refuses. */
static bool py_float(const char *s, double *out)
{
    const char *w = s + (*s == '+' || *s == '-');
    bool word =
        strcasecmp(w, "inf") == 0 || strcasecmp(w, "infinity") == 0 || strcasecmp(w, "nan") == 0;
    if (!word && (!*w || strspn(w, "0123456789.eE+-") != strlen(w))) return false;
    char *end;
    double f = strtod(s, &end);
    if (*end) return false;
    *out = f;
    return true;
}

/* Python int(str) / int(float) as jinja2's int filter does, with a default. */
static int filter_int(rt *R, const jv *v, const callargs *ca, int line, jv *out)
{
    const jv *def = arg(ca, 0, "default"), *basev = arg(ca, 1, "base");
    jv d = def ? *def : v_int(0);
    int base = basev && is_intlike(basev) ? (int)as_int(basev) : 10;
    if (v->kind == JV_UNDEF) return undefined_error(R, v, line);
    if (is_intlike(v)) {
        *out = v_int(as_int(v));
        return 0;
    }
    if (v->kind == JV_FLOAT) {
        if (!isfinite(v->u.f) || fabs(v->u.f) >= 9.2e18)
            *out = d;
        else
            *out = v_int((int64_t)v->u.f);
        return 0;
    }
    if (v->kind == JV_STR) {
        /* jinja2: int(value, base), else int(float(value)), else the default */
        jv t = do_strip(v, NULL, true, true);
        char buf[128];
        if (py_unsep(&t, base, buf, sizeof buf)) {
            char *end;
            errno = 0;
            long long x = strtoll(buf, &end, base);
            if (*end == 0 && errno == 0) {
                *out = v_int(x);
                return 0;
            }
            double f;
            if ((base == 10 || py_unsep(&t, 10, buf, sizeof buf)) && py_float(buf, &f) &&
                isfinite(f) && fabs(f) < 9.2e18) {
                *out = v_int((int64_t)f);
                return 0;
            }
        }
    }
    *out = d;
    return 0;
}

static int filter_float(rt *R, const jv *v, const callargs *ca, int line, jv *out)
{
    const jv *def = arg(ca, 0, "default");
    jv d = def ? *def : v_float(0.0);
    if (v->kind == JV_UNDEF) return undefined_error(R, v, line);
    if (is_num(v)) {
        *out = v_float(as_float(v));
        return 0;
    }
    if (v->kind == JV_STR) {
        jv t = do_strip(v, NULL, true, true);
        char buf[128];
        double f;
        if (py_unsep(&t, 10, buf, sizeof buf) && py_float(buf, &f)) {
            *out = v_float(f);
            return 0;
        }
    }
    *out = d;
    return 0;
}

/* Positional and keyword parameters of each filter after the value (jinja2 3.1
 * signatures; tojson checks its own). -1 = any (select, map, ...). */
static const struct {
    int maxpos;
    const char *kws[4]; /* NULL-terminated */
} filter_params[JF__COUNT] = {
    [JF_TRIM] = {1, {"chars"}},
    [JF_LENGTH] = {0, {NULL}},
    [JF_TOJSON] = {-1, {NULL}},
    [JF_JOIN] = {2, {"d", "attribute"}},
    [JF_LIST] = {0, {NULL}},
    [JF_ITEMS] = {0, {NULL}},
    [JF_STRING] = {0, {NULL}},
    [JF_FIRST] = {0, {NULL}},
    [JF_LAST] = {0, {NULL}},
    [JF_UPPER] = {0, {NULL}},
    [JF_LOWER] = {0, {NULL}},
    [JF_REPLACE] = {3, {"old", "new", "count"}},
    [JF_DEFAULT] = {2, {"default_value", "boolean"}},
    [JF_INT] = {2, {"default", "base"}},
    [JF_FLOAT] = {1, {"default"}},
    [JF_ABS] = {0, {NULL}},
    [JF_SELECT] = {-1, {NULL}},
    [JF_REJECT] = {-1, {NULL}},
    [JF_SELECTATTR] = {-1, {NULL}},
    [JF_REJECTATTR] = {-1, {NULL}},
    [JF_MAP] = {-1, {NULL}},
    [JF_UNIQUE] = {2, {"case_sensitive", "attribute"}},
};

static int apply_filter(rt *R, int f, const jv *v, const callargs *ca, int line, jv *out)
{
    if (filter_params[f].maxpos >= 0)
        PD_CHECK(check_args(R, ca, filter_params[f].maxpos, filter_params[f].kws, "filter", line));
    switch (f) {
    case JF_TRIM: {
        jv s;
        PD_CHECK(to_str(R, v, &s));
        const jv *chars = arg(ca, 0, "chars");
        *out = do_strip(&s, chars, true, true);
        return 0;
    }
    case JF_LENGTH: {
        int64_t n = 0;
        PD_CHECK(v_length(R, v, line, &n));
        *out = v_int(n);
        return 0;
    }
    case JF_TOJSON: return tojson_filter(R, v, ca, line, out);
    case JF_JOIN: {
        const jv *sep = arg(ca, 0, "d"), *attr = arg(ca, 1, "attribute");
        jv sepv = v_str("", 0);
        if (sep) PD_CHECK(to_str(R, sep, &sepv));
        const jv *items;
        size_t n = 0;
        PD_CHECK(iterate(R, v, line, &items, &n));
        sbuf b = {0};
        int rc = 0;
        for (size_t i = 0; i < n && rc == 0; i++) {
            jv x = items[i], s;
            if (attr) rc = attr_path(R, &items[i], attr, line, &x);
            if (rc == 0) rc = to_str(R, &x, &s);
            if (rc == 0 && i) rc = sb_add(&b, sepv.u.s.p, sepv.u.s.n);
            if (rc == 0) rc = sb_add(&b, s.u.s.p, s.u.s.n);
        }
        if (rc < 0) {
            free(b.p);
            return rc;
        }
        return v_from_sb(R, &b, out);
    }
    case JF_LIST: {
        const jv *items;
        size_t n = 0;
        PD_CHECK(iterate(R, v, line, &items, &n));
        PD_CHECK(new_list(R, n, false, out));
        if (n) memcpy(out->u.l->v, items, n * sizeof(jv));
        out->u.l->n = n;
        return 0;
    }
    case JF_ITEMS: {
        if (v->kind == JV_DICT)
            PD_CHECK(call_method(R, v, JM_ITEMS, &(callargs){0}, line, out));
        else
            PD_CHECK(new_list(R, 0, false, out));
        /* jinja2's do_items is a generator: a non-mapping fails only when iterated */
        if (v->kind != JV_DICT && v->kind != JV_UNDEF)
            out->u.l->fail = "Can only get item pairs from a mapping.";
        out->u.l->gen = true;
        return 0;
    }
    case JF_STRING: return to_str(R, v, out);
    case JF_FIRST:
    case JF_LAST: {
        const jv *items;
        size_t n = 0;
        if (v->kind == JV_LIST && v->u.l->gen) {
            if (f == JF_LAST) return rt_error(R, line, "'generator' object is not reversible");
            jlist *g = v->u.l; /* next(): consumes one item */
            if (g->fail) return rt_error(R, line, "%s", g->fail);
            *out = g->n ? g->v[0] : v_undef("No first item, sequence was empty.");
            if (g->n) {
                g->v++;
                g->n--;
            }
            return 0;
        }
        PD_CHECK(iterate(R, v, line, &items, &n));
        *out = n ? items[f == JF_FIRST ? 0 : n - 1]
                 : v_undef(f == JF_FIRST ? "No first item, sequence was empty."
                                         : "No last item, sequence was empty.");
        return 0;
    }
    case JF_UPPER:
    case JF_LOWER: {
        jv s;
        PD_CHECK(to_str(R, v, &s));
        return str_case(R, s.u.s.p, s.u.s.n, f == JF_UPPER ? CASE_UPPER : CASE_LOWER, out);
    }
    case JF_REPLACE: {
        jv s, o, nw;
        const jv *a0 = arg(ca, 0, "old"), *a1 = arg(ca, 1, "new"), *cnt = arg(ca, 2, "count");
        if (!a0 || !a1) return rt_error(R, line, "replace filter needs old and new");
        PD_CHECK(to_str(R, v, &s));
        PD_CHECK(to_str(R, a0, &o));
        PD_CHECK(to_str(R, a1, &nw));
        if (cnt && cnt->kind != JV_NONE && !is_intlike(cnt))
            return rt_error(R, line, "replace count must be an integer");
        return do_replace(R, &s, &o, &nw, cnt && cnt->kind != JV_NONE ? as_int(cnt) : -1, out);
    }
    case JF_DEFAULT: {
        const jv *def = arg(ca, 0, "default_value"), *boolean = arg(ca, 1, "boolean");
        bool use = v->kind == JV_UNDEF || (boolean && truthy(boolean) && !truthy(v));
        *out = use ? (def ? *def : v_str("", 0)) : *v;
        return 0;
    }
    case JF_INT: return filter_int(R, v, ca, line, out);
    case JF_FLOAT: return filter_float(R, v, ca, line, out);
    case JF_ABS:
        if (v->kind == JV_FLOAT)
            *out = v_float(fabs(v->u.f));
        else if (is_intlike(v)) {
            if (as_int(v) == INT64_MIN) return rt_error(R, line, "integer overflow");
            *out = v_int(as_int(v) < 0 ? -as_int(v) : as_int(v));
        } else if (v->kind == JV_UNDEF)
            return undefined_error(R, v, line);
        else
            return rt_error(R, line, "bad operand type for abs(): '%s'", type_name(v));
        return 0;
    case JF_SELECT:
    case JF_REJECT:
    case JF_SELECTATTR:
    case JF_REJECTATTR: return filter_select(R, f, v, ca, line, out);
    case JF_MAP: {
        const jv *items = NULL;
        size_t n = 0;
        if (truthy(v)) PD_CHECK(iterate(R, v, line, &items, &n)); /* jinja2: falsy -> nothing */
        const jv *attr = arg(ca, -1, "attribute"), *def = arg(ca, -1, "default");
        int sub = -1;
        callargs rest = {0};
        if (!attr) {
            if (ca->npos < 1 || ca->pos[0].kind != JV_STR)
                return rt_error(R, line, "map() needs attribute= or a filter name");
            sub = jinja_filter_id(ca->pos[0].u.s.p, ca->pos[0].u.s.n);
            if (sub < 0 || sub == JF_MAP)
                return rt_error(R, line, "No filter named '%.*s'", (int)ca->pos[0].u.s.n,
                                ca->pos[0].u.s.p);
            rest = *ca;
            rest.pos++;
            rest.npos--;
        }
        PD_CHECK(new_list(R, n, false, out));
        for (size_t i = 0; i < n; i++) {
            jv x;
            if (attr) {
                PD_CHECK(attr_path(R, &items[i], attr, line, &x));
                if (x.kind == JV_UNDEF && def) x = *def;
            } else {
                PD_CHECK(apply_filter(R, sub, &items[i], &rest, line, &x));
            }
            out->u.l->v[out->u.l->n++] = x;
        }
        out->u.l->gen = true;
        return 0;
    }
    case JF_UNIQUE: {
        const jv *items;
        size_t n = 0;
        PD_CHECK(iterate(R, v, line, &items, &n));
        const jv *cs = arg(ca, 0, "case_sensitive"), *attr = arg(ca, 1, "attribute");
        bool sensitive = cs && truthy(cs);
        PD_CHECK(new_list(R, n, false, out));
        jv *keys = ralloc(R, (n ? n : 1) * sizeof *keys);
        if (!keys) return oom(R);
        for (size_t i = 0; i < n; i++) {
            jv k = items[i];
            if (attr) PD_CHECK(attr_path(R, &items[i], attr, line, &k));
            if ((k.kind == JV_LIST && !k.u.l->tuple) || k.kind == JV_DICT || k.kind == JV_NS)
                return rt_error(R, line, "unhashable type: '%s'", type_name(&k));
            if (!sensitive && k.kind == JV_STR)
                PD_CHECK(str_case(R, k.u.s.p, k.u.s.n, CASE_LOWER, &k));
            bool seen = false;
            for (size_t j = 0; j < out->u.l->n && !seen; j++) seen = v_eq(&keys[j], &k, 0);
            if (!seen) {
                keys[out->u.l->n] = k;
                out->u.l->v[out->u.l->n++] = items[i];
            }
        }
        out->u.l->gen = true;
        return 0;
    }
    }
    return rt_error(R, line, "unknown filter");
}

/* ---- expressions ---------------------------------------------------------------------- */

static int eval(rt *R, const jnode *x, scope *S, jv *out)
{
    R->line = x->line;
    switch (x->kind) {
    case JE_CONST: *out = x->lit; return 0;
    case JE_NAME: return lookup(R, S, x->name, x->name_n, out);
    case JE_GETATTR: {
        jv obj;
        PD_CHECK(eval(R, x->a, S, &obj));
        return get_attr(R, &obj, x->name, x->name_n, x->method, x->line, out);
    }
    case JE_GETITEM: {
        jv obj, key;
        PD_CHECK(eval(R, x->a, S, &obj));
        PD_CHECK(eval(R, x->b, S, &key));
        return get_item(R, &obj, &key, x->line, out);
    }
    case JE_SLICE: {
        jv obj, parts[3];
        const jv *pp[3] = {NULL, NULL, NULL};
        PD_CHECK(eval(R, x->a, S, &obj));
        const jnode *nodes[3] = {x->b, x->c, x->d};
        for (int i = 0; i < 3; i++)
            if (nodes[i]) {
                PD_CHECK(eval(R, nodes[i], S, &parts[i]));
                pp[i] = &parts[i];
            }
        return do_slice(R, &obj, pp[0], pp[1], pp[2], x->line, out);
    }
    case JE_CALL: {
        jv callee;
        PD_CHECK(eval(R, x->a, S, &callee));
        callargs ca;
        PD_CHECK(eval_args(R, x, S, &ca));
        if (callee.kind == JV_FUNC) return call_func(R, callee.fn, &ca, x->line, out);
        if (callee.kind == JV_METHOD)
            return call_method(R, callee.u.self, callee.fn, &ca, x->line, out);
        if (callee.kind == JV_UNDEF) return undefined_error(R, &callee, x->line);
        return rt_error(R, x->line, "'%s' object is not callable", type_name(&callee));
    }
    case JE_FILTER: {
        jv v;
        PD_CHECK(eval(R, x->a, S, &v));
        callargs ca;
        PD_CHECK(eval_args(R, x, S, &ca));
        return apply_filter(R, x->op, &v, &ca, x->line, out);
    }
    case JE_TEST: {
        jv v;
        PD_CHECK(eval(R, x->a, S, &v));
        callargs ca;
        PD_CHECK(eval_args(R, x, S, &ca));
        bool r = false;
        PD_CHECK(apply_test(R, x->op, &v, ca.pos, ca.npos, x->line, &r));
        *out = v_bool(r);
        return 0;
    }
    case JE_NOT: {
        jv v;
        PD_CHECK(eval(R, x->a, S, &v));
        *out = v_bool(!truthy(&v));
        return 0;
    }
    case JE_NEG:
    case JE_POS: {
        jv v;
        PD_CHECK(eval(R, x->a, S, &v));
        if (v.kind == JV_FLOAT)
            *out = v_float(x->kind == JE_NEG ? -v.u.f : v.u.f);
        else if (is_intlike(&v)) {
            if (x->kind == JE_NEG && as_int(&v) == INT64_MIN)
                return rt_error(R, x->line, "integer overflow");
            *out = v_int(x->kind == JE_NEG ? -as_int(&v) : as_int(&v));
        } else if (v.kind == JV_UNDEF)
            return undefined_error(R, &v, x->line);
        else
            return rt_error(R, x->line, "bad operand type for unary %c: '%s'",
                            x->kind == JE_NEG ? '-' : '+', type_name(&v));
        return 0;
    }
    case JE_BIN: {
        jv a, b;
        PD_CHECK(eval(R, x->a, S, &a));
        PD_CHECK(eval(R, x->b, S, &b));
        return binop(R, x->op, &a, &b, x->line, out);
    }
    case JE_AND:
    case JE_OR: {
        jv a;
        PD_CHECK(eval(R, x->a, S, &a));
        if (truthy(&a) == (x->kind == JE_OR)) {
            *out = a;
            return 0;
        }
        return eval(R, x->b, S, out);
    }
    case JE_COMPARE: {
        jv left;
        PD_CHECK(eval(R, x->a, S, &left));
        for (int i = 0; i < x->nargs; i++) {
            jv right;
            PD_CHECK(eval(R, x->args[i], S, &right));
            bool r = false;
            int c = 0;
            switch (x->ops[i]) {
            case JOP_EQ: r = v_eq(&left, &right, 0); break;
            case JOP_NE: r = !v_eq(&left, &right, 0); break;
            case JOP_IN: PD_CHECK(contains(R, &left, &right, x->line, &r)); break;
            case JOP_NOTIN:
                PD_CHECK(contains(R, &left, &right, x->line, &r));
                r = !r;
                break;
            default:
                PD_CHECK(v_cmp(R, &left, &right, x->line, &c, 0));
                r = x->ops[i] == JOP_LT   ? c < 0
                    : x->ops[i] == JOP_LE ? c <= 0
                    : x->ops[i] == JOP_GT ? c > 0
                                          : c >= 0;
            }
            if (!r) {
                *out = v_bool(false);
                return 0;
            }
            left = right;
        }
        *out = v_bool(true);
        return 0;
    }
    case JE_CONCAT: {
        sbuf b = {0};
        int rc = 0;
        for (int i = 0; i < x->nargs && rc == 0; i++) {
            jv v, s;
            rc = eval(R, x->args[i], S, &v);
            if (rc == 0) rc = to_str(R, &v, &s);
            if (rc == 0) rc = sb_add(&b, s.u.s.p, s.u.s.n);
        }
        if (rc < 0) {
            free(b.p);
            return rc;
        }
        return v_from_sb(R, &b, out);
    }
    case JE_COND: {
        jv c;
        PD_CHECK(eval(R, x->a, S, &c));
        if (truthy(&c)) return eval(R, x->b, S, out);
        if (x->c) return eval(R, x->c, S, out);
        *out =
            v_undef("the inline if-expression evaluated to false and no else section was defined");
        return 0;
    }
    case JE_LIST:
    case JE_TUPLE: {
        PD_CHECK(new_list(R, (size_t)x->nargs, x->kind == JE_TUPLE, out));
        for (int i = 0; i < x->nargs; i++) PD_CHECK(eval(R, x->args[i], S, &out->u.l->v[i]));
        out->u.l->n = (size_t)x->nargs;
        return 0;
    }
    case JE_DICT: {
        PD_CHECK(new_dict(R, (size_t)x->nargs / 2, JV_DICT, out));
        for (int i = 0; i + 1 < x->nargs; i += 2) {
            jv k, v;
            PD_CHECK(eval(R, x->args[i], S, &k));
            PD_CHECK(eval(R, x->args[i + 1], S, &v));
            if (k.kind == JV_LIST && !k.u.l->tuple)
                return rt_error(R, x->line, "unhashable type: 'list'");
            if (k.kind == JV_DICT) return rt_error(R, x->line, "unhashable type: 'dict'");
            PD_CHECK(dict_set(R, out->u.d, k, v));
        }
        return 0;
    }
    }
    return rt_error(R, x->line, "bad expression node");
}

/* ---- statements ------------------------------------------------------------------------ */

enum { EX_OK = 0, EX_BREAK = 1, EX_CONTINUE = 2 };

static int exec_body(rt *R, const jnode *x, scope *S);

static int bind_targets(rt *R, const jnode *x, scope *S, const jv *val)
{
    if (x->op == 1) return scope_set(R, S, x->names[0], *val);
    if (val->kind != JV_LIST) {
        if (val->kind == JV_UNDEF) return undefined_error(R, val, x->line);
        return rt_error(R, x->line, "cannot unpack non-iterable %s object", type_name(val));
    }
    if (val->u.l->n != (size_t)x->op)
        return rt_error(R, x->line, "%s values to unpack (expected %d, got %zu)",
                        val->u.l->n > (size_t)x->op ? "too many" : "not enough", x->op,
                        val->u.l->n);
    for (int i = 0; i < x->op; i++) PD_CHECK(scope_set(R, S, x->names[i], val->u.l->v[i]));
    return 0;
}

static int step(rt *R, int line)
{
    if (++R->steps > MAX_STEPS)
        return rt_error(R, line, "template exceeded %llu steps", (unsigned long long)MAX_STEPS);
    return 0;
}

static int exec_for(rt *R, const jnode *x, scope *S)
{
    jv seq;
    PD_CHECK(eval(R, x->a, S, &seq));
    const jv *items;
    size_t n = 0;
    PD_CHECK(iterate(R, &seq, x->line, &items, &n));
    if (x->d) { /* inline filter: loop.length counts the kept items */
        jv *kept = ralloc(R, (n ? n : 1) * sizeof *kept);
        if (!kept) return oom(R);
        size_t k = 0;
        for (size_t i = 0; i < n; i++) {
            PD_CHECK(step(R, x->line));
            scope *fs = scope_new(R, S);
            if (!fs) return oom(R);
            PD_CHECK(bind_targets(R, x, fs, &items[i]));
            jv c;
            PD_CHECK(eval(R, x->d, fs, &c));
            if (truthy(&c)) kept[k++] = items[i];
        }
        items = kept;
        n = k;
    }
    if (n == 0) return x->c ? exec_body(R, x->c, S) : 0;
    jloop *lp = ralloc(R, sizeof *lp);
    if (!lp) return oom(R);
    lp->length = (int64_t)n;
    lp->items = items;
    for (size_t i = 0; i < n; i++) {
        PD_CHECK(step(R, x->line));
        lp->index0 = (int64_t)i;
        scope *it = scope_new(R, S);
        if (!it) return oom(R);
        PD_CHECK(scope_set(R, it, "loop", (jv){.kind = JV_LOOP, .u.lp = lp}));
        PD_CHECK(bind_targets(R, x, it, &items[i]));
        int rc = exec_body(R, x->b, it);
        if (rc < 0) return rc;
        if (rc == EX_BREAK) break;
    }
    return 0;
}

static int exec_body(rt *R, const jnode *x, scope *S)
{
    for (; x; x = x->next) {
        PD_CHECK(step(R, x->line));
        R->line = x->line;
        switch (x->kind) {
        case JS_TEXT: PD_CHECK(sb_add(R->out, x->lit.u.s.p, x->lit.u.s.n)); break;
        case JS_PRINT: {
            jv v;
            PD_CHECK(eval(R, x->a, S, &v));
            if (v.kind == JV_STR)
                PD_CHECK(sb_add(R->out, v.u.s.p, v.u.s.n));
            else
                PD_CHECK(print_value(R, R->out, &v, false, 0));
            break;
        }
        case JS_IF: {
            jv c;
            PD_CHECK(eval(R, x->a, S, &c));
            int rc = truthy(&c) ? exec_body(R, x->b, S) : exec_body(R, x->c, S);
            if (rc != EX_OK) return rc;
            break;
        }
        case JS_FOR: PD_CHECK(exec_for(R, x, S)); break;
        case JS_SET: {
            jv v;
            PD_CHECK(eval(R, x->a, S, &v));
            PD_CHECK(bind_targets(R, x, S, &v));
            break;
        }
        case JS_SET_ATTR: {
            jv ns, v;
            PD_CHECK(lookup(R, S, x->names[0], strlen(x->names[0]), &ns));
            if (ns.kind != JV_NS)
                return rt_error(R, x->line, "cannot assign attribute on non-namespace object");
            PD_CHECK(eval(R, x->a, S, &v));
            PD_CHECK(dict_set(R, ns.u.d, v_str(x->name, x->name_n), v));
            break;
        }
        case JS_SET_BLOCK: {
            sbuf capture = {0}, *saved = R->out;
            R->out = &capture;
            int rc = exec_body(R, x->b, S);
            R->out = saved;
            jv v;
            if (rc < 0) {
                free(capture.p);
                return rc;
            }
            PD_CHECK(v_from_sb(R, &capture, &v));
            PD_CHECK(scope_set(R, S, x->names[0], v));
            break;
        }
        case JS_BREAK: return EX_BREAK;
        case JS_CONTINUE: return EX_CONTINUE;
        case JS_GENERATION: {
            int rc = exec_body(R, x->b, S);
            if (rc != EX_OK) return rc;
            break;
        }
        default: return rt_error(R, x->line, "bad statement node");
        }
    }
    return EX_OK;
}

int jinja_render(const jinja_program *prog, const json_t *vars, int64_t now_unix, char **out,
                 size_t *out_len)
{
    *out = NULL;
    if (out_len) *out_len = 0;
    if (!json_is_object(vars))
        return pd_error(PD_EINVAL, "chat template: render variables must be a JSON object");
    rt R = {.now = now_unix};
    R.A = pd_arena_create(65536);
    if (!R.A) return pd_error(PD_ENOMEM, "chat template: out of memory while rendering");
    sbuf text = {0};
    R.out = &text;
    jv ctx;
    int rc = from_json(&R, vars, &ctx, 0);
    if (rc == 0) {
        R.ctx = ctx.u.d;
        R.top = scope_new(&R, NULL);
        rc = R.top ? exec_body(&R, prog->body, R.top) : oom(&R);
    }
    if (rc == 0) rc = sb_reserve(&text, 0);
    pd_arena_free(R.A);
    if (rc < 0) {
        free(text.p);
        return rc;
    }
    text.p[text.n] = 0;
    *out = text.p;
    if (out_len) *out_len = text.n;
    return 0;
}
