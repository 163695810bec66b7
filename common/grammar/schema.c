/* JSON Schema -> grammar expressions (the subset of docs/structured_output.md). Every keyword
 * is either enforced exactly, an annotation (ignored by definition), or refused with its JSON
 * pointer; unknown non-standard keywords are ignored as JSON Schema itself does. Objects keep
 * the schema's property order (optional ones may be skipped; additional properties, when
 * allowed, come last). */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/gram_internal.h"
#include "json/json.h"
#include "util/fmt.h"
#include "util/status.h"

#define MAX_DEPTH 64

typedef struct {
    char *ref;
    int32_t rule;
} refrule;

typedef struct {
    gb *b;
    json_t *root;
    gx *ws;
    int32_t r_string, r_number, r_integer, r_value;
    refrule *refs;
    int nrefs, caprefs;
    json_t **keep; /* merged schemas, freed at the end */
    int nkeep, capkeep;
    int depth;
    bool ref_alone; /* drafts 3-7: keywords beside $ref are ignored */
} sc;

static gx *sch(sc *c, json_t *s, const char *path);

static const char *const ANNOTATIONS[] = {
    "title",           "description",   "examples",    "example",     "default",
    "$schema",         "$id",           "id",          "$comment",    "deprecated",
    "readOnly",        "writeOnly",     "definitions", "$defs",       "contentMediaType",
    "contentEncoding", "contentSchema", "$anchor",     "$vocabulary", NULL};

/* Validation keywords of JSON Schema that this compiler does not enforce. */
static const char *const REFUSED[] = {"not",
                                      "if",
                                      "then",
                                      "else",
                                      "dependentRequired",
                                      "dependentSchemas",
                                      "dependencies",
                                      "propertyNames",
                                      "uniqueItems",
                                      "contains",
                                      "minContains",
                                      "maxContains",
                                      "unevaluatedProperties",
                                      "unevaluatedItems",
                                      "$dynamicRef",
                                      "$recursiveRef",
                                      "multipleOf",
                                      NULL};

/* The keywords enforced (docs/structured_output.md); with ANNOTATIONS and REFUSED, the JSON
 * Schema vocabulary. Any other key is not a keyword and constrains nothing. */
static const char *const ENFORCED[] = {"type",
                                       "properties",
                                       "required",
                                       "additionalProperties",
                                       "patternProperties",
                                       "minProperties",
                                       "maxProperties",
                                       "items",
                                       "additionalItems",
                                       "prefixItems",
                                       "minItems",
                                       "maxItems",
                                       "enum",
                                       "const",
                                       "anyOf",
                                       "oneOf",
                                       "allOf",
                                       "$ref",
                                       "minLength",
                                       "maxLength",
                                       "pattern",
                                       "format",
                                       "minimum",
                                       "maximum",
                                       "exclusiveMinimum",
                                       "exclusiveMaximum",
                                       NULL};

static bool in_list(const char *k, const char *const *l)
{
    for (; *l; l++)
        if (strcmp(k, *l) == 0) return true;
    return false;
}

static void keep(sc *c, json_t *j)
{
    if (c->nkeep == c->capkeep) {
        int cap = c->capkeep ? 2 * c->capkeep : 16;
        json_t **p = realloc(c->keep, sizeof(json_t *) * (size_t)cap);
        if (!p) return;
        c->keep = p;
        c->capkeep = cap;
    }
    c->keep[c->nkeep++] = j;
}

/* path + "/" + escaped token, in the builder's arena */
static const char *sub(sc *c, const char *path, const char *tok)
{
    size_t n = strlen(path), t = strlen(tok);
    char *o = pd_arena_alloc(c->b->a, n + 2 * t + 2, 1);
    if (!o) return path;
    memcpy(o, path, n);
    size_t k = n;
    o[k++] = '/';
    for (size_t i = 0; i < t; i++) {
        if (tok[i] == '~')
            o[k++] = '~', o[k++] = '0';
        else if (tok[i] == '/')
            o[k++] = '~', o[k++] = '1';
        else
            o[k++] = tok[i];
    }
    o[k] = 0;
    return o;
}

static const char *subi(sc *c, const char *path, size_t i)
{
    char buf[32];
    snprintf(buf, sizeof buf, "%zu", i);
    return sub(c, path, buf);
}

static gx *fail(sc *c, const char *kw, const char *path, const char *fmt, const char *detail)
{
    const char *p = sub(c, path, kw);
    char msg[400];
    snprintf(msg, sizeof msg, fmt, detail ? detail : "");
    gb_fail(c->b, PD_EUNSUPPORTED, kw, p, -1, "json schema: %s at %s: %s", kw, p, msg);
    return gx_none(c->b);
}

/* ---- JSON text pieces --------------------------------------------------------------------------
 */
static gx *lit(sc *c, const char *s)
{
    return gx_str(c->b, s);
}

/* one character of a JSON string as written: raw UTF-8 (no '"', '\\', controls) or an escape */
static gx *jchar(sc *c)
{
    gb *b = c->b;
    uint32_t raw[] = {0x20, 0x21, 0x23, 0x5B, 0x5D, 0x10FFFF};
    gx *hex =
        gx_alt(b, (gx *[]){gx_byte(b, '0', '9'), gx_byte(b, 'a', 'f'), gx_byte(b, 'A', 'F')}, 3);
    gx *esc = gx_seq2(b, gx_byte(b, '\\', '\\'),
                      gx_alt(b,
                             (gx *[]){gx_alt(b,
                                             (gx *[]){gx_byte(b, '"', '"'), gx_byte(b, '\\', '\\'),
                                                      gx_byte(b, '/', '/'), gx_byte(b, 'b', 'b'),
                                                      gx_byte(b, 'f', 'f'), gx_byte(b, 'n', 'n'),
                                                      gx_byte(b, 'r', 'r'), gx_byte(b, 't', 't')},
                                             8),
                                      gx_seq2(b, gx_byte(b, 'u', 'u'), gx_rep(b, hex, 4, 4))},
                             2));
    return gx_alt2(b, gx_cp_set(b, raw, 3), esc);
}

/* The JSON-encoded form of an expression over a string's UTF-8 bytes: '"', '\\' and control
 * characters become their escapes (jansson's: short forms, else \u00XX either case). */
static gx *json_esc(sc *c, gx *x)
{
    gb *b = c->b;
    switch (x->kind) {
    case X_BYTES: {
        if (x->hi < 0x20 && x->lo >= 0x80) return x;
        gx *parts[40];
        int n = 0;
        int lo = x->lo, hi = x->hi;
        for (int v = lo; v <= hi && v < 0x20; v++) {
            const char *s = NULL;
            switch (v) {
            case '\b': s = "\\b"; break;
            case '\f': s = "\\f"; break;
            case '\n': s = "\\n"; break;
            case '\r': s = "\\r"; break;
            case '\t': s = "\\t"; break;
            }
            if (s) {
                parts[n++] = gx_str(b, s);
            } else {
                static const char hx[] = "0123456789abcdef";
                gx *d1 = gx_byte(b, (uint8_t)('0' + (v >> 4)), (uint8_t)('0' + (v >> 4)));
                char lc = hx[v & 15], uc = (char)(lc >= 'a' ? lc - 32 : lc);
                gx *d2 = gx_alt2(b, gx_byte(b, (uint8_t)lc, (uint8_t)lc),
                                 gx_byte(b, (uint8_t)uc, (uint8_t)uc));
                parts[n++] = gx_seq3(b, gx_str(b, "\\u00"), d1, d2);
            }
        }
        if (lo < 0x20) lo = 0x20;
        /* raw part minus '"' and '\\' */
        int cuts[3] = {'"', '\\', 256};
        int cur = lo;
        for (int k = 0; k < 3 && cur <= hi; k++) {
            int cut = cuts[k];
            if (cut < cur) continue;
            int end = cut - 1 < hi ? cut - 1 : hi;
            if (cur <= end) parts[n++] = gx_byte(b, (uint8_t)cur, (uint8_t)end);
            if (cut <= hi && cut < 256) parts[n++] = gx_str(b, cut == '"' ? "\\\"" : "\\\\");
            cur = cut + 1;
        }
        return gx_alt(b, parts, n);
    }
    case X_SEQ:
    case X_ALT:
    case X_REP:
    case X_AND: {
        gx **k = malloc(sizeof(gx *) * (size_t)(x->n ? x->n : 1));
        if (!k) return gx_none(b);
        for (int32_t i = 0; i < x->n; i++) k[i] = json_esc(c, x->kids[i]);
        gx *r;
        if (x->kind == X_SEQ)
            r = gx_seq(b, k, x->n);
        else if (x->kind == X_ALT)
            r = gx_alt(b, k, x->n);
        else if (x->kind == X_AND)
            r = gx_and(b, k[0], k[1]);
        else
            r = gx_rep(b, k[0], x->min, x->max);
        free(k);
        return r;
    }
    default: return x;
    }
}

static gx *json_string_lit(sc *c, const char *s, size_t n)
{
    json_t *j = json_stringn(s, n);
    char *d = j ? json_dumps(j, JSON_ENCODE_ANY) : NULL;
    json_decref(j);
    if (!d) return gx_none(c->b);
    gx *x = gx_str(c->b, d);
    free(d);
    return x;
}

/* A JSON value written with optional whitespace between tokens. */
static gx *value_lit(sc *c, json_t *v)
{
    gb *b = c->b;
    if (json_is_string(v)) return json_string_lit(c, json_string_value(v), json_string_length(v));
    if (json_is_object(v)) {
        if (json_object_size(v) == 0) return gx_seq3(b, lit(c, "{"), c->ws, lit(c, "}"));
        size_t n = json_object_size(v), i = 0;
        gx **k = malloc(sizeof(gx *) * (4 * n + 2));
        if (!k) return gx_none(b);
        int m = 0;
        k[m++] = lit(c, "{");
        const char *key;
        json_t *val;
        json_object_foreach(v, key, val)
        {
            k[m++] = gx_seq3(b, c->ws, i ? gx_seq2(b, lit(c, ","), c->ws) : gx_empty(b),
                             json_string_lit(c, key, strlen(key)));
            k[m++] = gx_seq3(b, c->ws, lit(c, ":"), c->ws);
            k[m++] = value_lit(c, val);
            i++;
        }
        k[m++] = gx_seq2(b, c->ws, lit(c, "}"));
        gx *x = gx_seq(b, k, m);
        free(k);
        return x;
    }
    if (json_is_array(v)) {
        size_t n = json_array_size(v);
        if (n == 0) return gx_seq3(b, lit(c, "["), c->ws, lit(c, "]"));
        gx **k = malloc(sizeof(gx *) * (2 * n + 2));
        if (!k) return gx_none(b);
        int m = 0;
        k[m++] = gx_seq2(b, lit(c, "["), c->ws);
        for (size_t i = 0; i < n; i++) {
            if (i) k[m++] = gx_seq3(b, c->ws, lit(c, ","), c->ws);
            k[m++] = value_lit(c, json_array_get(v, i));
        }
        k[m++] = gx_seq2(b, c->ws, lit(c, "]"));
        gx *x = gx_seq(b, k, m);
        free(k);
        return x;
    }
    char *d = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    if (!d) return gx_none(b);
    if (json_is_real(v)) { /* the shortest text that reads back as v: 2.1, not jansson's
                              2.1000000000000001 (what a model, or Python's json, writes) */
        char t[48];
        for (int prec = 1; prec <= 17; prec++) {
            snprintf(t, sizeof t, "%.*g", prec, json_real_value(v));
            if (strtod(t, NULL) == json_real_value(v)) break;
        }
        if (!strpbrk(t, ".eE")) strcat(t, ".0"); /* a real as written: 2.0 (2 is added below) */
        free(d);
        if (!(d = strdup(t))) return gx_none(b);
    }
    gx *x = gx_str(b, d);
    if (json_is_real(v) && floor(json_real_value(v)) == json_real_value(v) &&
        fabs(json_real_value(v)) < 1e15) { /* 2.0 == 2 */
        char t[64];
        snprintf(t, sizeof t, "%.0f", json_real_value(v));
        x = gx_alt2(b, x, gx_str(b, t));
    } else if (json_is_integer(v)) {
        char t[64];
        snprintf(t, sizeof t, "%lld.0", (long long)json_integer_value(v));
        x = gx_alt2(b, x, gx_str(b, t));
    }
    free(d);
    return x;
}

/* ---- generic rules --------------------------------------------------------------------------- */
static gx *digits(gb *b)
{
    return gx_byte(b, '0', '9');
}

static gx *int_expr(gb *b)
{
    return gx_seq2(
        b, gx_opt(b, gx_str(b, "-")),
        gx_alt2(b, gx_str(b, "0"), gx_seq2(b, gx_byte(b, '1', '9'), gx_star(b, digits(b)))));
}

static gx *frac_expr(gb *b)
{
    return gx_seq2(b, gx_str(b, "."), gx_plus(b, digits(b)));
}

static gx *exp_expr(gb *b)
{
    return gx_seq3(b, gx_alt2(b, gx_str(b, "e"), gx_str(b, "E")),
                   gx_opt(b, gx_alt2(b, gx_str(b, "+"), gx_str(b, "-"))), gx_plus(b, digits(b)));
}

static int32_t r_string(sc *c)
{
    if (c->r_string < 0) {
        c->r_string = gb_rule_new(c->b, "string");
        c->b->rules[c->r_string].keep = true;
        gb_rule_set(c->b, c->r_string,
                    gx_seq3(c->b, lit(c, "\""), gx_star(c->b, jchar(c)), lit(c, "\"")));
    }
    return c->r_string;
}

static int32_t r_number(sc *c)
{
    if (c->r_number < 0) {
        gb *b = c->b;
        c->r_number = gb_rule_new(b, "number");
        b->rules[c->r_number].keep = true;
        gb_rule_set(b, c->r_number,
                    gx_seq3(b, int_expr(b), gx_opt(b, frac_expr(b)), gx_opt(b, exp_expr(b))));
    }
    return c->r_number;
}

static int32_t r_integer(sc *c)
{
    if (c->r_integer < 0) {
        c->r_integer = gb_rule_new(c->b, "integer");
        c->b->rules[c->r_integer].keep = true;
        gb_rule_set(c->b, c->r_integer, int_expr(c->b));
    }
    return c->r_integer;
}

static gx *object_any(sc *c);
static gx *array_any(sc *c);

static int32_t r_value(sc *c)
{
    if (c->r_value < 0) {
        gb *b = c->b;
        c->r_value = gb_rule_new(b, "value");
        gx *k[7] = {object_any(c),           array_any(c),   gx_call(b, r_string(c)),
                    gx_call(b, r_number(c)), lit(c, "true"), lit(c, "false"),
                    lit(c, "null")};
        gb_rule_set(b, c->r_value, gx_alt(b, k, 7));
    }
    return c->r_value;
}

static gx *list_of(sc *c, gx *item)
{
    gb *b = c->b;
    return gx_opt(
        b, gx_seq2(b, item, gx_star(b, gx_seq3(b, c->ws, lit(c, ","), gx_seq2(b, c->ws, item)))));
}

static gx *object_any(sc *c)
{
    gb *b = c->b;
    gx *pair = gx_seq3(b, gx_call(b, r_string(c)), gx_seq3(b, c->ws, lit(c, ":"), c->ws),
                       gx_call(b, r_value(c)));
    return gx_seq(b, (gx *[]){lit(c, "{"), c->ws, list_of(c, pair), c->ws, lit(c, "}")}, 5);
}

static gx *array_any(sc *c)
{
    gb *b = c->b;
    return gx_seq(
        b, (gx *[]){lit(c, "["), c->ws, list_of(c, gx_call(b, r_value(c))), c->ws, lit(c, "]")}, 5);
}

/* ---- $ref ----------------------------------------------------------------------------------- */
static json_t *resolve(sc *c, const char *ref, const char *path)
{
    if (ref[0] != '#') {
        fail(c, "$ref", path, "only local references (#/...) are supported, not '%s'", ref);
        return NULL;
    }
    json_t *cur = c->root;
    const char *p = ref + 1;
    if (*p == 0) return cur;
    if (*p != '/') {
        fail(c, "$ref", path, "'%s' is not a JSON pointer ($anchor references are not supported)",
             ref);
        return NULL;
    }
    while (*p == '/') {
        p++;
        char tok[512];
        size_t k = 0;
        while (*p && *p != '/' && k + 1 < sizeof tok) {
            if (p[0] == '~' && p[1] == '0')
                tok[k++] = '~', p += 2;
            else if (p[0] == '~' && p[1] == '1')
                tok[k++] = '/', p += 2;
            else if (p[0] == '%' && p[1] && p[2]) {
                char h[3] = {p[1], p[2], 0};
                tok[k++] = (char)strtol(h, NULL, 16);
                p += 3;
            } else
                tok[k++] = *p++;
        }
        tok[k] = 0;
        if (json_is_object(cur))
            cur = json_object_get(cur, tok);
        else if (json_is_array(cur))
            cur = json_array_get(cur, (size_t)strtoul(tok, NULL, 10));
        else
            cur = NULL;
        if (!cur) {
            fail(c, "$ref", path, "'%s' does not resolve in this document", ref);
            return NULL;
        }
    }
    return cur;
}

static gx *ref_call(sc *c, const char *ref, const char *path)
{
    for (int i = 0; i < c->nrefs; i++)
        if (strcmp(c->refs[i].ref, ref) == 0) return gx_call(c->b, c->refs[i].rule);
    json_t *t = resolve(c, ref, path);
    if (!t) return gx_none(c->b);
    if (c->nrefs == c->caprefs) {
        int cap = c->caprefs ? 2 * c->caprefs : 16;
        refrule *p = realloc(c->refs, sizeof(refrule) * (size_t)cap);
        if (!p) return gx_none(c->b);
        c->refs = p;
        c->caprefs = cap;
    }
    int32_t r = gb_rule_new(c->b, ref);
    c->refs[c->nrefs].ref = pd_arena_strdup(c->b->a, ref);
    c->refs[c->nrefs].rule = r;
    c->nrefs++;
    /* the body refers to this rule by id, so recursion terminates */
    const char *tp = pd_arena_strdup(c->b->a, ref + 1);
    gb_rule_set(c->b, r, sch(c, t, tp));
    return gx_call(c->b, r);
}

/* ---- numbers -------------------------------------------------------------------------------- */
typedef struct {
    char i[64], f[64]; /* integer digits (no leading zeros, "0"), fraction (no trailing zeros) */
    bool neg;
} dec;

static bool to_dec(double x, dec *d)
{
    char buf[64];
    for (int p = 1; p <= 17; p++) {
        snprintf(buf, sizeof buf, "%.*e", p - 1, x);
        if (strtod(buf, NULL) == x) break;
    }
    /* buf: [-]d.ddde[+-]XX */
    d->neg = buf[0] == '-';
    const char *s = buf + (d->neg ? 1 : 0);
    char dig[40];
    int nd = 0;
    for (; *s && *s != 'e'; s++)
        if (*s >= '0' && *s <= '9') dig[nd++] = *s;
    int e = *s == 'e' ? atoi(s + 1) : 0;
    if (e > 40 || e < -40) return false;
    /* value = 0.dig * 10^(e+1) */
    int point = e + 1;
    char all[128];
    int na = 0;
    int ip = 0;
    if (point <= 0) {
        d->i[0] = '0';
        d->i[1] = 0;
        for (int k = 0; k < -point; k++) all[na++] = '0';
        for (int k = 0; k < nd; k++) all[na++] = dig[k];
        all[na] = 0;
        pd_str_copy(d->f, sizeof d->f, all); /* at most 40 zeros and 17 digits */
    } else {
        for (int k = 0; k < point; k++) d->i[ip++] = k < nd ? dig[k] : '0';
        d->i[ip] = 0;
        na = 0;
        for (int k = point; k < nd; k++) all[na++] = dig[k];
        all[na] = 0;
        pd_str_copy(d->f, sizeof d->f, all); /* at most 40 zeros and 17 digits */
    }
    /* strip leading zeros of i, trailing of f */
    char *q = d->i;
    while (q[0] == '0' && q[1]) q++;
    memmove(d->i, q, strlen(q) + 1);
    size_t fl = strlen(d->f);
    while (fl > 0 && d->f[fl - 1] == '0') d->f[--fl] = 0;
    if (strcmp(d->i, "0") == 0 && fl == 0) d->neg = false;
    return true;
}

static gx *drange(gb *b, char lo, char hi)
{
    return lo > hi ? gx_none(b) : gx_byte(b, (uint8_t)lo, (uint8_t)hi);
}

/* non-negative integers (no leading zeros) > I */
static gx *int_gt(gb *b, const char *I)
{
    size_t n = strlen(I);
    gx *alts[70];
    int m = 0;
    alts[m++] = gx_seq2(b, gx_byte(b, '1', '9'), gx_rep(b, digits(b), (int32_t)n, -1));
    for (size_t j = 0; j < n; j++) {
        if (I[j] == '9') continue;
        alts[m++] = gx_seq3(b, gx_lit(b, I, j), drange(b, (char)(I[j] + 1), '9'),
                            gx_rep(b, digits(b), (int32_t)(n - j - 1), (int32_t)(n - j - 1)));
    }
    return gx_alt(b, alts, m);
}

/* non-negative integers < I */
static gx *int_lt(gb *b, const char *I)
{
    size_t n = strlen(I);
    gx *alts[70];
    int m = 0;
    if (n >= 2) {
        alts[m++] = gx_str(b, "0");
        if (n >= 3 || true)
            alts[m++] = gx_seq2(b, gx_byte(b, '1', '9'), gx_rep(b, digits(b), 0, (int32_t)n - 2));
    }
    for (size_t j = 0; j < n; j++) {
        char lo = (j == 0 && n > 1) ? '1' : '0';
        if (I[j] <= lo) continue;
        alts[m++] = gx_seq3(b, gx_lit(b, I, j), drange(b, lo, (char)(I[j] - 1)),
                            gx_rep(b, digits(b), (int32_t)(n - j - 1), (int32_t)(n - j - 1)));
    }
    return gx_alt(b, alts, m);
}

/* digit strings D' (possibly empty) with 0.(P D') >= / > 0.(P F) given equal prefix P */
static gx *fge(gb *b, const char *F, bool inc)
{
    if (!*F)
        return inc ? gx_star(b, digits(b))
                   : gx_seq3(b, gx_star(b, digits(b)), gx_byte(b, '1', '9'), gx_star(b, digits(b)));
    return gx_alt2(b, gx_seq2(b, drange(b, (char)(F[0] + 1), '9'), gx_star(b, digits(b))),
                   gx_seq2(b, gx_lit(b, F, 1), fge(b, F + 1, inc)));
}

static gx *fle(gb *b, const char *F, bool inc, bool top)
{
    if (!*F)
        return inc ? (top ? gx_plus(b, gx_str(b, "0")) : gx_star(b, gx_str(b, "0"))) : gx_none(b);
    gx *k[3] = {top ? gx_none(b) : gx_empty(b),
                gx_seq2(b, drange(b, '0', (char)(F[0] - 1)), gx_star(b, digits(b))),
                gx_seq2(b, gx_lit(b, F, 1), fle(b, F + 1, inc, false))};
    return gx_alt(b, k, 3);
}

/* magnitude >= / > L (fraction parts only when frac) */
static gx *mag_ge(gb *b, const dec *L, bool inc, bool frac)
{
    gx *anyfrac = frac ? gx_opt(b, frac_expr(b)) : gx_empty(b);
    gx *eqpart;
    if (!frac)
        eqpart = (!*L->f && inc) ? gx_empty(b) : gx_none(b);
    else if (!*L->f)
        eqpart = inc ? anyfrac : gx_seq2(b, gx_str(b, "."), fge(b, "", false));
    else
        eqpart = gx_seq2(b, gx_str(b, "."), fge(b, L->f, inc));
    return gx_alt2(b, gx_seq2(b, int_gt(b, L->i), anyfrac), gx_seq2(b, gx_str(b, L->i), eqpart));
}

static gx *mag_le(gb *b, const dec *H, bool inc, bool frac)
{
    gx *anyfrac = frac ? gx_opt(b, frac_expr(b)) : gx_empty(b);
    bool absent_ok = *H->f || inc;
    gx *eqpart = absent_ok ? gx_empty(b) : gx_none(b);
    if (frac) eqpart = gx_alt2(b, eqpart, gx_seq2(b, gx_str(b, "."), fle(b, H->f, inc, true)));
    return gx_alt2(b, gx_seq2(b, int_lt(b, H->i), anyfrac), gx_seq2(b, gx_str(b, H->i), eqpart));
}

static gx *mag_range(gb *b, const dec *L, bool linc, const dec *H, bool hinc, bool frac)
{
    gx *ge = mag_ge(b, L, linc, frac);
    return H ? gx_and(b, ge, mag_le(b, H, hinc, frac)) : ge;
}

static bool num_of(json_t *j, double *v)
{
    if (json_is_integer(j))
        *v = (double)json_integer_value(j);
    else if (json_is_real(j))
        *v = json_real_value(j);
    else
        return false;
    return true;
}

/* Numbers written without an exponent that are multiples of q = k / 10^d, as a remainder
 * automaton over the digits: v = N / 10^f (N the digits read, f of them after the point) is a
 * multiple of q iff k * 10^f divides N * 10^d, i.e. the digits past the d-th fraction digit
 * are zeros and k divides N' * 10^(d - f') (N', f' up to the d-th). Nodes: start, '-', "0",
 * I_r (integer part, N mod k = r), P_r (just after the point), F_{f,r} (f fraction digits,
 * f = 1..max(d, 1); for d = 0, F_{1,r} takes the fraction's zeros). */
static gx *multiple_graph(gb *b, long k, int d, bool integer)
{
    long D = d > 0 ? d : 1;
    long nn = 3 + k + (integer ? 0 : k + D * k),
         ne = 32 + 12 * k + (integer ? 0 : 12 * (D + 1) * k);
    gx *x = pd_arena_calloc(b->a, 1, sizeof *x);
    bool *fin = pd_arena_calloc(b->a, (size_t)nn, sizeof(bool));
    gx_edge *ed = pd_arena_calloc(b->a, (size_t)ne, sizeof(gx_edge));
    if (!x || !fin || !ed) return gx_none(b);
    x->kind = X_GRAPH;
    x->g_nodes = (int32_t)nn;
    x->g_start = 0;
    x->g_final = fin;
    x->g_edges = ed;
    gx *dig[10];
    for (int g = 0; g < 10; g++) dig[g] = gx_byte(b, (uint8_t)('0' + g), (uint8_t)('0' + g));
    long pw[12]; /* 10^j mod k */
    pw[0] = 1 % k;
    for (int j = 1; j < 12; j++) pw[j] = pw[j - 1] * 10 % k;
#define EDGE(f, t, e) (ed[x->n].from = (int32_t)(f), ed[x->n].to = (int32_t)(t), ed[x->n++].x = (e))
    const long I = 3, P = 3 + k, F = 3 + 2 * k;
    EDGE(0, 1, gx_str(b, "-"));
    for (int s = 0; s < 2; s++) {
        EDGE(s, 2, dig[0]);
        for (int g = 1; g < 10; g++) EDGE(s, I + g % k, dig[g]);
    }
    fin[2] = true;
    for (long r = 0; r < k; r++) {
        for (int g = 0; g < 10; g++) EDGE(I + r, I + (10 * r + g) % k, dig[g]);
        fin[I + r] = r * pw[d] % k == 0;
        if (integer) continue;
        EDGE(I + r, P + r, gx_str(b, "."));
        if (d == 0) {
            EDGE(P + r, F + r, dig[0]);
            EDGE(F + r, F + r, dig[0]);
            fin[F + r] = r == 0;
            continue;
        }
        for (int g = 0; g < 10; g++) EDGE(P + r, F + (10 * r + g) % k, dig[g]);
        for (long f = 1; f <= d; f++) {
            long at = F + (f - 1) * k + r;
            fin[at] = r * pw[d - f] % k == 0;
            if (f == d)
                EDGE(at, at, dig[0]);
            else
                for (int g = 0; g < 10; g++) EDGE(at, F + f * k + (10 * r + g) % k, dig[g]);
        }
    }
    if (!integer) EDGE(2, P, gx_str(b, "."));
#undef EDGE
    return x;
}

/* multipleOf q as k / 10^d (k <= 1000, d <= 9); false when it is not a positive number of
 * that form. */
static bool multiple_of(json_t *j, long *k, int *d)
{
    double m;
    dec q;
    if (!num_of(j, &m) || !(m > 0) || !to_dec(m, &q) || strlen(q.f) > 9) return false;
    char all[140];
    snprintf(all, sizeof all, "%s%s", q.i, q.f);
    char *end;
    errno = 0;
    long long v = strtoll(all, &end, 10);
    if (errno || *end || v <= 0 || v > 1000) return false;
    *k = (long)v;
    *d = (int)strlen(q.f);
    return true;
}

static gx *number_expr(sc *c, json_t *s, const char *path, bool integer)
{
    gb *b = c->b;
    double lo = -INFINITY, hi = INFINITY, v;
    bool linc = true, hinc = true;
    json_t *j;
    if ((j = json_object_get(s, "minimum")) && num_of(j, &v)) lo = v;
    if ((j = json_object_get(s, "maximum")) && num_of(j, &v)) hi = v;
    j = json_object_get(s, "exclusiveMinimum");
    if (json_is_true(j))
        linc = false;
    else if (j && num_of(j, &v) && (v >= lo))
        lo = v, linc = false;
    j = json_object_get(s, "exclusiveMaximum");
    if (json_is_true(j))
        hinc = false;
    else if (j && num_of(j, &v) && (v <= hi))
        hi = v, hinc = false;
    gx *mult = NULL;
    if ((j = json_object_get(s, "multipleOf"))) {
        long k;
        int d;
        if (!multiple_of(j, &k, &d))
            return fail(c, "multipleOf", path, "%s",
                        "supported: a positive k / 10^d with k up to 1000 and d up to 9");
        if (!(integer && k == 1 && d == 0)) mult = multiple_graph(b, k, d, integer);
    }
    if ((j = json_object_get(s, "format")) && json_is_string(j)) {
        /* OpenAPI's integer formats are bounds; float/double and string formats do not
         * constrain a number (a format applies to its own type) */
        static const struct {
            const char *name;
            double lo, hi;
        } ifmt[] = {{"int8", -128.0, 127.0},
                    {"uint8", 0.0, 255.0},
                    {"int16", -32768.0, 32767.0},
                    {"uint16", 0.0, 65535.0},
                    {"int32", -2147483648.0, 2147483647.0},
                    {"uint32", 0.0, 4294967295.0},
                    {"int64", -9223372036854775808.0, 9223372036854775807.0},
                    {"uint64", 0.0, 18446744073709551615.0}};
        const char *f = json_string_value(j);
        for (size_t k = 0; k < sizeof ifmt / sizeof *ifmt; k++)
            if (strcmp(f, ifmt[k].name) == 0) {
                if (lo < ifmt[k].lo) lo = ifmt[k].lo, linc = true;
                if (hi > ifmt[k].hi) hi = ifmt[k].hi, hinc = true;
            }
    }
    if (isinf(lo) && isinf(hi)) {
        if (!mult) return gx_call(b, integer ? r_integer(c) : r_number(c));
        int32_t r = gb_rule_new(b, "number-multiple");
        b->rules[r].keep = true;
        gb_rule_set(b, r, mult);
        return gx_call(b, r);
    }
    if (lo > hi || (lo == hi && !(linc && hinc)))
        return fail(c, "minimum", path, "%s", "the bounds exclude every number");
    dec L, H;
    gx *pos = gx_none(b), *neg = gx_none(b);
    if (hi >= 0) { /* non-negative part [max(lo,0), hi] */
        dec Z = {"0", "", false};
        bool zinc = true;
        const dec *Lp = &Z;
        if (lo > 0 || (lo == 0 && !linc)) {
            if (!to_dec(lo, &L))
                return fail(c, "minimum", path, "%s", "a bound too large or too small");
            Lp = &L;
            zinc = linc;
        }
        const dec *Hp = NULL;
        if (!isinf(hi)) {
            if (!to_dec(hi, &H))
                return fail(c, "maximum", path, "%s", "a bound too large or too small");
            Hp = &H;
        }
        if (!(Hp && lo == 0 && hi == 0 && !hinc)) pos = mag_range(b, Lp, zinc, Hp, hinc, !integer);
    }
    if (lo < 0) { /* "-" then magnitude in [max(-hi,0), -lo] */
        dec Lm = {"0", "", false}, Hm;
        bool lminc = true;
        if (hi < 0) {
            if (!to_dec(-hi, &Lm))
                return fail(c, "maximum", path, "%s", "a bound too large or too small");
            lminc = hinc;
        }
        const dec *Hp = NULL;
        if (!isinf(lo)) {
            if (!to_dec(-lo, &Hm))
                return fail(c, "minimum", path, "%s", "a bound too large or too small");
            Hp = &Hm;
        }
        neg = gx_seq2(b, gx_str(b, "-"), mag_range(b, &Lm, lminc, Hp, linc, !integer));
    }
    int32_t r = gb_rule_new(b, "number-range");
    b->rules[r].keep = true;
    gb_rule_set(b, r, mult ? gx_and(b, gx_alt2(b, pos, neg), mult) : gx_alt2(b, pos, neg));
    return gx_call(b, r);
}

/* ---- strings -------------------------------------------------------------------------------- */
#define DATE_RE                                                                                    \
    "([0-9]{4}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-("  \
    "0["                                                                                           \
    "1-9]|1[0-9]|2[0-8]))|([0-9]{2}(0[48]|[2468][048]|[13579][26])|([02468][048]|[13579][26])00)-" \
    "02-29)"

/* The regex of a string format (NULL: none). JSON Schema's own formats are enforced or, where
 * their grammar is not regular or not written here, refused (*refused); any other name is not
 * a JSON Schema format and constrains nothing, as the specification says of unknown formats
 * (docs/structured_output.md). */
static const char *format_regex(const char *f, bool *refused)
{
    static const struct {
        const char *name, *re;
    } fmts[] = {
        /* RFC 3339 full-date, days per month exact, 02-29 in leap years only */
        {"date", DATE_RE},
        {"time", "([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\\.[0-9]+)?([Zz]|[+-]([01][0-9]|2["
                 "0-3]):[0-5][0-9])"},
        {"date-time",
         DATE_RE "[Tt]([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\\.[0-9]+)?([Zz]|[+-"
                 "]([01][0-9]|2[0-3]):[0-5][0-9])"},
        /* RFC 3339 appendix A */
        {"duration", "P(([0-9]+D|[0-9]+M([0-9]+D)?|[0-9]+Y([0-9]+M([0-9]+D)?)?)(T([0-9]+H([0-9]+"
                     "M([0-9]+S)?)?|[0-9]+M([0-9]+S)?|[0-9]+S))?|T([0-9]+H([0-9]+M([0-9]+S)?)?|["
                     "0-9]+M([0-9]+S)?|[0-9]+S)|[0-9]+W)"},
        {"uuid", "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"},
        {"ipv4", "((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\\.){3}(25[0-5]|2[0-4][0-9]|1[0-9]"
                 "[0-9]|[1-9]?[0-9])"},
        /* RFC 4291 section 2.2: eight groups, one :: for a run of zero groups, an IPv4 tail */
        {"ipv6", "(([0-9a-fA-F]{1,4}:){7}[0-9a-fA-F]{1,4}|([0-9a-fA-F]{1,4}:){1,7}:|([0-9a-fA-F]{1,"
                 "4}:){1,6}:[0-9a-fA-F]{1,4}|([0-9a-fA-F]{1,4}:){1,5}(:[0-9a-fA-F]{1,4}){1,2}|([0-"
                 "9a-fA-F]{1,4}:){1,4}(:[0-9a-fA-F]{1,4}){1,3}|([0-9a-fA-F]{1,4}:){1,3}(:[0-9a-fA-"
                 "F]{1,4}){1,4}|([0-9a-fA-F]{1,4}:){1,2}(:[0-9a-fA-F]{1,4}){1,5}|[0-9a-fA-F]{1,4}:"
                 "(:[0-9a-fA-F]{1,4}){1,6}|:((:[0-9a-fA-F]{1,4}){1,7}|:)|([0-9a-fA-F]{1,4}:){6}((25"
                 "[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]"
                 "|[1-9]?[0-9])|(([0-9a-fA-F]{1,4}:){0,5}[0-9a-fA-F]{1,4})?::(([0-9a-fA-F]{1,4}:){"
                 "0,4})((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\\.){3}(25[0-5]|2[0-4][0-9]|1"
                 "[0-9][0-9]|[1-9]?[0-9]))"},
        {"email", "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(\\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*@([A-Za-z0-"
                  "9]([A-Za-z0-9-]*[A-Za-z0-9])?\\.)+[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"},
        /* approximations of the RFC grammars (docs/structured_output.md) */
        {"uri", "[A-Za-z][A-Za-z0-9+.-]*:[^ \\t\\n\\r\"<>\\\\^`{|}]*"},
        {"uri-reference", "[^ \\t\\n\\r\"<>\\\\^`{|}]*"},
        {"hostname", "[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\\.[A-Za-z0-9]([A-Za-z0-9-]{0,"
                     "61}[A-Za-z0-9])?)*"},
        /* RFC 6901 and draft-handrews-relative-json-pointer */
        {"json-pointer", "(/([^~/]|~[01])*)*"},
        {"relative-json-pointer", "(0|[1-9][0-9]*)(#|(/([^~/]|~[01])*)*)"},
    };
    static const char *const unsupported[] = {
        "iri", "iri-reference", "idn-email", "idn-hostname", "uri-template", "regex", NULL};
    *refused = false;
    for (size_t k = 0; k < sizeof fmts / sizeof *fmts; k++)
        if (strcmp(f, fmts[k].name) == 0) return fmts[k].re;
    *refused = in_list(f, unsupported);
    return NULL;
}

/* The content of a string (JSON-escaped, between the quotes) under the string keywords of s;
 * NULL when they leave any content. */
static gx *string_body(sc *c, json_t *s, const char *path)
{
    gb *b = c->b;
    json_t *mn = json_object_get(s, "minLength"), *mx = json_object_get(s, "maxLength");
    json_t *pat = json_object_get(s, "pattern"), *fmt = json_object_get(s, "format");
    long lmin = json_is_integer(mn) ? (long)json_integer_value(mn) : 0;
    long lmax = json_is_integer(mx) ? (long)json_integer_value(mx) : -1;
    if (lmin < 0) lmin = 0;
    if (lmax > 100000)
        return fail(c, "maxLength", path, "%s", "maxLength over 100000 is not supported");
    if (lmin > 100000)
        return fail(c, "minLength", path, "%s", "minLength over 100000 is not supported");
    if (lmax >= 0 && lmax < lmin)
        return fail(c, "maxLength", path, "%s", "maxLength < minLength: no string matches");
    gx *body = NULL;
    if (fmt && json_is_string(fmt)) {
        bool refused;
        const char *re = format_regex(json_string_value(fmt), &refused);
        if (refused)
            return fail(c, "format", path, "format '%s' is not supported", json_string_value(fmt));
        if (re) body = json_esc(c, rx_parse(b, re, strlen(re), RX_FULL, sub(c, path, "format")));
    }
    if (pat && json_is_string(pat)) {
        gx *p = json_esc(c, rx_parse(b, json_string_value(pat), json_string_length(pat), RX_SEARCH,
                                     sub(c, path, "pattern")));
        body = body ? gx_and(b, body, p) : p;
    }
    if (lmin > 0 || lmax >= 0) {
        gx *len = gx_rep(b, jchar(c), (int32_t)lmin, (int32_t)lmax);
        body = body ? gx_and(b, body, len) : len;
    }
    return body;
}

/* The content of the strings that `not: nt` leaves (not_on_strings): the strings written as
 * json_esc writes them (one spelling per string, so the complement cannot let another spelling
 * of an excluded string through) that are not in nt's language. */
static gx *string_not(sc *c, json_t *nt, const char *path)
{
    gb *b = c->b;
    gx *x = string_body(c, nt, path);
    json_t *cst = json_object_get(nt, "const"), *en = json_object_get(nt, "enum");
    if (cst || en) {
        size_t n = cst ? 1 : json_array_size(en);
        gx **alts = malloc(sizeof(gx *) * (n ? n : 1));
        if (!alts) return gx_none(b);
        for (size_t i = 0; i < n; i++) {
            json_t *v = cst ? cst : json_array_get(en, i);
            alts[i] = json_esc(c, gx_lit(b, json_string_value(v), json_string_length(v)));
        }
        gx *e = gx_alt(b, alts, (int)n);
        free(alts);
        if (cst && en) { /* the const, when the enum lists it */
            bool listed = false;
            for (size_t i = 0; i < json_array_size(en); i++)
                listed = listed || json_equal(cst, json_array_get(en, i));
            if (!listed) e = gx_none(b);
        }
        x = x ? gx_and(b, x, e) : e;
    }
    gx *all = json_esc(c, gx_star(b, gx_cp_range(b, 0, 0x10FFFF)));
    return x ? gx_and(b, all, gx_not(b, x)) : gx_none(b);
}

static gx *string_expr(sc *c, json_t *s, const char *path)
{
    gb *b = c->b;
    gx *body = string_body(c, s, path);
    json_t *nt = json_object_get(s, "not");
    if (nt && b->status >= 0) {
        gx *n = string_not(c, nt, sub(c, path, "not"));
        body = body ? gx_and(b, body, n) : n;
    }
    if (b->status < 0) return gx_none(b);
    if (!body) return gx_call(b, r_string(c));
    int32_t r = gb_rule_new(b, "string-constrained");
    b->rules[r].keep = true;
    gb_rule_set(b, r, gx_seq3(b, lit(c, "\""), body, lit(c, "\"")));
    return gx_call(b, r);
}

/* ---- arrays ------------------------------------------------------------------------------------
 */
static gx *elem_call(sc *c, json_t *s, const char *path)
{
    gx *x = sch(c, s, path);
    if (x->kind == X_CALL || x->kind == X_NONE) return x;
    int32_t r = gb_rule_new(c->b, "item");
    c->b->rules[r].keep = true;
    gb_rule_set(c->b, r, x);
    return gx_call(c->b, r);
}

static gx *array_expr(sc *c, json_t *s, const char *path)
{
    gb *b = c->b;
    json_t *items = json_object_get(s, "items"), *prefix = json_object_get(s, "prefixItems");
    json_t *addl = json_object_get(s, "additionalItems");
    const char *ipath = sub(c, path, "items");
    const char *ppath = sub(c, path, "prefixItems");
    if (json_is_array(items)) { /* draft 4-7 tuple form */
        prefix = items;
        ppath = ipath;
        items = addl;
        ipath = sub(c, path, "additionalItems");
    }
    if (prefix && !json_is_array(prefix))
        return fail(c, "prefixItems", path, "%s", "must be an array");
    json_t *mn = json_object_get(s, "minItems"), *mx = json_object_get(s, "maxItems");
    long nmin = json_is_integer(mn) ? (long)json_integer_value(mn) : 0;
    long nmax = json_is_integer(mx) ? (long)json_integer_value(mx) : -1;
    if (nmin < 0) nmin = 0;
    size_t np = prefix ? json_array_size(prefix) : 0;
    bool more = !json_is_false(items) && !(c->b->strict && prefix && !items);
    if (!more && nmax < 0) nmax = (long)np;
    if (!more && nmax > (long)np) nmax = (long)np;
    if (nmax >= 0 && nmax < nmin)
        return fail(c, "maxItems", path, "%s", "no array length satisfies minItems/maxItems");
    if (nmax > 10000 || nmin > 10000)
        return fail(c, nmax > 10000 ? "maxItems" : "minItems", path, "%s",
                    "bounds over 10000 are not supported");
    /* nodes 0..K: count of elements so far; K loops when unbounded */
    long K = (long)np > nmin ? (long)np : nmin;
    if (nmax >= 0) K = nmax;
    gx *item = NULL;
    if (more) {
        item = (items && !json_is_true(items)) ? sch(c, items, ipath) : gx_call(b, r_value(c));
        if (K - (long)np > 2 && item->kind != X_CALL) item = elem_call(c, items, ipath);
    }
    gx *x = pd_arena_calloc(b->a, 1, sizeof *x);
    if (!x) return gx_none(b);
    x->kind = X_GRAPH;
    x->g_nodes = (int32_t)K + 1;
    x->g_start = 0;
    x->g_final = pd_arena_calloc(b->a, (size_t)K + 1, sizeof(bool));
    x->g_edges = pd_arena_calloc(b->a, (size_t)K + 2, sizeof(gx_edge));
    if (!x->g_final || !x->g_edges) return gx_none(b);
    gx *sep = gx_seq3(b, c->ws, lit(c, ","), c->ws);
    for (long k = 0; k <= K; k++) x->g_final[k] = k >= nmin;
    for (long k = 0; k < K; k++) {
        gx *e = (size_t)k < np
                    ? sch(c, json_array_get(prefix, (size_t)k), subi(c, ppath, (size_t)k))
                    : item;
        if (!e) break;
        x->g_edges[x->n].from = (int32_t)k;
        x->g_edges[x->n].to = (int32_t)k + 1;
        x->g_edges[x->n].x = k ? gx_seq2(b, sep, e) : e;
        x->n++;
    }
    if (nmax < 0 && more) { /* loop at K */
        x->g_edges[x->n].from = (int32_t)K;
        x->g_edges[x->n].to = (int32_t)K;
        x->g_edges[x->n].x = K ? gx_seq2(b, sep, item) : item;
        if (!K) { /* first element from 0 then loop at a new node: use K=0 -> 0 with sep needs a
                     first-flag */
            x->g_edges[x->n].x = item;
        }
        x->n++;
        if (K == 0) { /* [a, b, c]: 0 -item-> 1, 1 -sep item-> 1 */
            x->g_nodes = 2;
            bool *f = pd_arena_calloc(b->a, 2, sizeof(bool));
            gx_edge *ed = pd_arena_calloc(b->a, 2, sizeof(gx_edge));
            if (!f || !ed) return gx_none(b);
            f[0] = f[1] = true;
            ed[0] = (gx_edge){0, 1, item};
            ed[1] = (gx_edge){1, 1, gx_seq2(b, sep, item)};
            x->g_final = f;
            x->g_edges = ed;
            x->n = 2;
        }
    }
    return gx_seq(b, (gx *[]){lit(c, "["), c->ws, x, c->ws, lit(c, "]")}, 5);
}

/* ---- objects ------------------------------------------------------------------------------------
 */
/* The expression of a property value; a rule of its own when the object graph copies it
 * (counted properties), so that its automaton is built once. */
static gx *shared_value(sc *c, gx *x, bool copied)
{
    if (!copied || x->kind == X_CALL || x->kind == X_NONE) return x;
    int32_t r = gb_rule_new(c->b, "value");
    c->b->rules[r].keep = true;
    gb_rule_set(c->b, r, x);
    return gx_call(c->b, r);
}

#define MAX_PATTERN_PROPS 3
#define MAX_PROP_COUNT    64

/* Keys other than the listed ones (names) whose content matches exactly the patterns in set
 * in (bit i: pats[i]) and none of the others, as a quoted JSON string (may match nothing).
 * Keys are compared as written: an escape spelling a plain character is not recognised
 * (docs). */
static gx *key_class(sc *c, gx *names, gx **pats, int npat, unsigned in)
{
    gb *b = c->b;
    gx *content = gx_star(b, jchar(c));
    gx *others[MAX_PATTERN_PROPS];
    int no = 0;
    for (int i = 0; i < npat; i++) {
        if (in >> i & 1)
            content = gx_and(b, content, pats[i]);
        else
            others[no++] = pats[i];
    }
    if (no) content = gx_and(b, content, gx_not(b, gx_alt(b, others, no)));
    if (npat == 0 && !names) return gx_call(b, r_string(c));
    gx *key = gx_seq3(b, lit(c, "\""), content, lit(c, "\""));
    if (names) key = gx_and(b, key, gx_not(b, names));
    return key;
}

/* Edges of one (listed or additional) property in the object graph: from count node
 * from + k, through middle node mid + k' - 1 (a comma unless k = 0), to count node to + k'
 * by pair, k' = k + 1 saturating at K (or stopping there when bounded); optional adds the
 * skip from + k -> to + k. */
static void add_counted(gx *x, long from, long to, long mid, long K, bool bounded, gx *sep,
                        gx *pair, bool optional)
{
    for (long k = 0; k <= K; k++) {
        long k2 = k < K ? k + 1 : (bounded ? -1 : K);
        if (k2 >= 0)
            x->g_edges[x->n++] =
                (gx_edge){(int32_t)(from + k), (int32_t)(mid + k2 - 1), k ? sep : NULL};
        if (optional) x->g_edges[x->n++] = (gx_edge){(int32_t)(from + k), (int32_t)(to + k), NULL};
    }
    for (long k2 = 1; k2 <= K; k2++)
        x->g_edges[x->n++] = (gx_edge){(int32_t)(mid + k2 - 1), (int32_t)(to + k2), pair};
}

/* An object as a graph: node (i, k) = after the first i listed properties with k properties
 * written so far (k saturates at K = maxProperties, else minProperties, at least 1 so that
 * the first property is told from the others, which need a comma). Additional properties
 * (keys neither listed nor matched by patternProperties, and keys of each pattern class)
 * loop at node (n, k). */
static gx *object_expr(sc *c, json_t *s, const char *path)
{
    gb *b = c->b;
    json_t *props = json_object_get(s, "properties");
    json_t *req = json_object_get(s, "required");
    json_t *addl = json_object_get(s, "additionalProperties");
    json_t *pp = json_object_get(s, "patternProperties");
    json_t *jmin = json_object_get(s, "minProperties"), *jmax = json_object_get(s, "maxProperties");
    if (props && !json_is_object(props))
        return fail(c, "properties", path, "%s", "must be an object");
    if (pp && !json_is_object(pp))
        return fail(c, "patternProperties", path, "%s", "must be an object");
    if ((jmin && !json_is_integer(jmin)) || (jmax && !json_is_integer(jmax)))
        return fail(c, jmin && !json_is_integer(jmin) ? "minProperties" : "maxProperties", path,
                    "%s", "must be an integer");
    long pmin = jmin ? (long)json_integer_value(jmin) : 0;
    long pmax = jmax ? (long)json_integer_value(jmax) : -1;
    if (pmin < 0) pmin = 0;
    if (pmin > MAX_PROP_COUNT || pmax > MAX_PROP_COUNT)
        return fail(c, pmin > MAX_PROP_COUNT ? "minProperties" : "maxProperties", path, "%s",
                    "property counts over 64 are not supported");
    if (pmax >= 0 && pmax < pmin)
        return fail(c, "maxProperties", path, "%s", "maxProperties < minProperties: no object");
    if (pmax == 0) /* the count nodes below start at 1: the empty object, unless one is required */
        return json_array_size(req) ? gx_none(b) : gx_seq3(b, lit(c, "{"), c->ws, lit(c, "}"));
    size_t npat = pp ? json_object_size(pp) : 0;
    if (npat > MAX_PATTERN_PROPS)
        return fail(c, "patternProperties", path, "%s",
                    "more than 3 patterns in one patternProperties are not supported");
    const char *ppath = sub(c, path, "properties");
    const char *patpath = sub(c, path, "patternProperties");
    /* patterns: over the raw key text (for listed names) and JSON-escaped (for keys) */
    gx *praw[MAX_PATTERN_PROPS], *pesc[MAX_PATTERN_PROPS];
    json_t *pschema[MAX_PATTERN_PROPS];
    const char *pname[MAX_PATTERN_PROPS];
    const char *key;
    json_t *v;
    int np_ = 0;
    if (pp) json_object_foreach(pp, key, v)
        {
            praw[np_] = rx_parse(b, key, strlen(key), RX_SEARCH, sub(c, patpath, key));
            pesc[np_] = json_esc(c, praw[np_]);
            pschema[np_] = v;
            pname[np_] = key;
            np_++;
        }
    if (b->status < 0) return gx_none(b);
    /* the ordered property list: properties, then required names not listed */
    size_t nr = json_is_array(req) ? json_array_size(req) : 0;
    json_t *all = json_object();
    keep(c, all);
    if (props) json_object_foreach(props, key, v) json_object_set(all, key, v);
    for (size_t i = 0; i < nr; i++) {
        json_t *r = json_array_get(req, i);
        if (!json_is_string(r)) return fail(c, "required", path, "%s", "entries must be strings");
        if (!json_object_get(all, json_string_value(r))) {
            /* an unlisted required key: its value is what a key of that name gets */
            json_t *vs = NULL;
            for (int p = 0; p < np_; p++) {
                int mt =
                    gx_match(praw[p], (const uint8_t *)json_string_value(r), json_string_length(r));
                if (mt < 0) return fail(c, "patternProperties", patpath, "%s", "cannot match");
                if (mt) {
                    if (!vs) {
                        vs = json_pack("{s:[]}", "allOf");
                        keep(c, vs);
                    }
                    json_array_append(json_object_get(vs, "allOf"), pschema[p]);
                }
            }
            json_object_set(all, json_string_value(r), vs ? vs : addl ? addl : json_true());
        }
    }
    size_t n = json_object_size(all);
    long K = pmax >= 0 ? pmax : pmin;
    if (K < 1) K = 1;
    bool copied = K > 1;
    bool addl_ok = !json_is_false(addl) && !(c->b->strict && !addl && props);
    /* additional key classes: each subset of the patterns, then keys matching none */
    gx *names = NULL;
    if (n) {
        gx **k = malloc(sizeof(gx *) * n);
        if (!k) return gx_none(b);
        int m = 0;
        json_object_foreach(all, key, v) k[m++] = json_string_lit(c, key, strlen(key));
        names = gx_alt(b, k, m);
        free(k);
    }
    gx *extra[1 << MAX_PATTERN_PROPS], *addl_val = NULL;
    int nextra = 0;
    gx *colon = gx_seq3(b, c->ws, lit(c, ":"), c->ws);
    for (unsigned set = 0; set < (1u << np_); set++) {
        gx *val;
        if (set == 0) {
            if (!addl_ok) continue;
            val = (addl && !json_is_true(addl)) ? sch(c, addl, sub(c, path, "additionalProperties"))
                                                : gx_call(b, r_value(c));
        } else {
            json_t *w = json_pack("{s:[]}", "allOf");
            keep(c, w);
            const char *vpath = patpath;
            for (int p = 0; p < np_; p++)
                if (set >> p & 1) {
                    json_array_append(json_object_get(w, "allOf"), pschema[p]);
                    vpath = sub(c, patpath, pname[p]);
                }
            val = sch(c,
                      json_array_size(json_object_get(w, "allOf")) == 1
                          ? json_array_get(json_object_get(w, "allOf"), 0)
                          : w,
                      vpath);
        }
        if (b->status < 0) return gx_none(b);
        if (val->kind == X_NONE) continue;
        if (np_ == 0) {
            addl_val = val;
            nextra = 1;
            continue;
        }
        extra[nextra++] =
            gx_seq3(b, key_class(c, names, pesc, np_, set), colon, shared_value(c, val, true));
    }
    /* one rule for all classes: a class may be empty (two disjoint patterns), the union not.
     * Without patterns the key is a leaf rule of its own (its mask-cache entries are shared by
     * bisimulation) and the value stays inline. */
    gx *addl_pair = NULL;
    if (nextra && np_ == 0) {
        gx *kx = key_class(c, names, pesc, 0, 0);
        if (kx->kind != X_CALL) {
            int32_t r = gb_rule_new(b, "key");
            b->rules[r].keep = true;
            gb_rule_set(b, r, kx);
            kx = gx_call(b, r);
        }
        addl_pair = gx_seq3(b, kx, colon, shared_value(c, addl_val, copied));
    } else if (nextra) {
        int32_t r = gb_rule_new(b, "additional-property");
        b->rules[r].keep = true;
        gb_rule_set(b, r, gx_alt(b, extra, nextra));
        addl_pair = gx_call(b, r);
    }
    gx *x = pd_arena_calloc(b->a, 1, sizeof *x);
    if (!x) return gx_none(b);
    long W = K + 1;                /* count nodes per i */
    long mid0 = W * (long)(n + 1); /* middle node (i, k'), k' in [1, K]: before pair i */
    x->kind = X_GRAPH;
    x->g_nodes = (int32_t)(mid0 + K * (long)(n + 1));
    x->g_start = 0;
    x->g_final = pd_arena_calloc(b->a, (size_t)x->g_nodes, sizeof(bool));
    x->g_edges = pd_arena_calloc(b->a, (size_t)((3 * K + 2) * (long)(n + 1)), sizeof(gx_edge));
    if (!x->g_final || !x->g_edges) return gx_none(b);
    gx *sep = gx_seq3(b, c->ws, lit(c, ","), c->ws);
    /* (i, k) -> middle (i, k + 1) through a comma unless first -> (i + 1, k + 1) through the
     * pair, built once per count rather than once per (count, first) */
    size_t i = 0;
    json_object_foreach(all, key, v)
    {
        bool required = false;
        for (size_t k = 0; k < nr; k++)
            if (strcmp(json_string_value(json_array_get(req, k)), key) == 0) required = true;
        /* a listed property also satisfies every pattern its name matches */
        json_t *vs = v;
        for (int p = 0; p < np_; p++) {
            int mt = gx_match(praw[p], (const uint8_t *)key, strlen(key));
            if (mt < 0) return fail(c, "patternProperties", patpath, "%s", "cannot match");
            if (mt && props && json_object_get(props, key) == v) {
                json_t *w = json_pack("{s:[OO]}", "allOf", vs, pschema[p]);
                keep(c, w);
                vs = w;
            }
        }
        gx *val = json_is_false(vs) ? gx_none(b) : sch(c, vs, sub(c, ppath, key));
        if (b->status < 0) return gx_none(b);
        gx *pair =
            gx_seq3(b, json_string_lit(c, key, strlen(key)), colon, shared_value(c, val, copied));
        add_counted(x, (long)i * W, (long)(i + 1) * W, mid0 + (long)i * K, K, pmax >= 0, sep, pair,
                    !required);
        i++;
    }
    for (long k = pmin; k <= K; k++) x->g_final[(long)n * W + k] = true;
    if (addl_pair)
        add_counted(x, (long)n * W, (long)n * W, mid0 + (long)n * K, K, pmax >= 0, sep, addl_pair,
                    false);
    return gx_seq(b, (gx *[]){lit(c, "{"), c->ws, x, c->ws, lit(c, "}")}, 5);
}

/* ---- allOf merging ----------------------------------------------------------------------------
 */
static json_t *deref(sc *c, json_t *s, const char *path)
{
    for (int k = 0; k < 32 && json_is_object(s); k++) {
        json_t *r = json_object_get(s, "$ref");
        if (!json_is_string(r)) return s;
        json_t *t = resolve(c, json_string_value(r), path);
        if (!t) return NULL;
        if (json_object_size(s) == 1 || c->ref_alone) {
            s = t;
            continue;
        }
        json_t *m = json_deep_copy(s);
        keep(c, m);
        json_object_del(m, "$ref");
        json_t *w = json_pack("{s:[OO]}", "allOf", t, m);
        keep(c, w);
        return w;
    }
    return s;
}

static const char *const TYPES[] = {"null",   "boolean", "object",  "array",
                                    "string", "number",  "integer", NULL};

static unsigned type_mask(json_t *t)
{
    if (!t) return 0x7f;
    unsigned m = 0;
    if (json_is_string(t))
        t = json_pack("[O]", t);
    else
        json_incref(t);
    size_t i;
    json_t *v;
    json_array_foreach(t, i, v) for (int k = 0; TYPES[k];
                                     k++) if (json_is_string(v) &&
                                              strcmp(json_string_value(v), TYPES[k]) == 0) m |=
        1u << k;
    json_decref(t);
    if (m & (1u << 5)) m |= 1u << 6; /* number includes integer */
    return m;
}

static json_t *mask_types(unsigned m)
{
    json_t *a = json_array();
    if ((m & (1u << 5)) && (m & (1u << 6))) m &= ~(1u << 6);
    for (int k = 0; TYPES[k]; k++)
        if (m & (1u << k)) json_array_append_new(a, json_string(TYPES[k]));
    return a;
}

/* Appends x to r's allOf (r is a copy of ours). */
static void add_allof(json_t *r, json_t *x)
{
    json_t *all = json_object_get(r, "allOf");
    if (!json_is_array(all)) {
        all = json_array();
        json_object_set_new(r, "allOf", all);
    }
    json_array_append_new(all, x);
}

static json_t *merge2(sc *c, json_t *a, json_t *b2, const char *path);

static json_t *flatten_allof(sc *c, json_t *s, const char *path, int depth)
{
    if (depth > 16) {
        fail(c, "allOf", path, "%s", "allOf nested too deeply");
        return NULL;
    }
    s = deref(c, s, path);
    if (!s) return NULL;
    if (json_is_true(s))
        s = json_object();
    else if (json_is_false(s))
        s = json_pack("{s:b}", "not", true); /* no value */
    else
        json_incref(s);
    keep(c, s);
    if (!json_is_object(s)) {
        fail(c, "allOf", path, "%s", "an allOf entry is not an object");
        return NULL;
    }
    json_t *all = json_object_get(s, "allOf");
    if (!all) return s;
    json_t *rest = json_deep_copy(s);
    keep(c, rest);
    json_object_del(rest, "allOf");
    json_t *acc = rest;
    size_t i;
    json_t *v;
    json_array_foreach(all, i, v)
    {
        json_t *f = flatten_allof(c, v, subi(c, sub(c, path, "allOf"), i), depth + 1);
        if (!f) return NULL;
        acc = merge2(c, acc, f, path);
        if (!acc) return NULL;
    }
    return acc;
}

/* JSON Schema evaluates each allOf entry on its own, so the patternProperties and
 * additionalProperties of `other` also bind the properties that `to` lists and `other` does
 * not: each such property of `to` gets, as an allOf, the schemas of the patterns of `other`
 * its name matches, else `other`'s additionalProperties. Returns `to` or a changed copy; NULL
 * on a refusal. */
static json_t *close_props(sc *c, json_t *to, json_t *other, const char *path)
{
    json_t *tp = json_object_get(to, "properties"), *op = json_object_get(other, "properties");
    json_t *ox = json_object_get(other, "additionalProperties");
    json_t *opp = json_object_get(other, "patternProperties");
    if (!json_is_object(tp) || (!json_is_object(opp) && (!ox || json_is_true(ox)))) return to;
    /* other's patterns, parsed once; past MAX_PATTERN_PROPS the merged object is refused
       (object_expr), so the rest need no closing */
    gx *re[MAX_PATTERN_PROPS];
    json_t *rs[MAX_PATTERN_PROPS];
    int nre = 0;
    const char *pat;
    json_t *ps;
    if (json_is_object(opp)) json_object_foreach(opp, pat, ps)
        {
            if (nre == MAX_PATTERN_PROPS) break;
            re[nre] = rx_parse(c->b, pat, strlen(pat), RX_SEARCH, path);
            rs[nre++] = ps;
        }
    json_t *np = NULL;
    const char *pk;
    json_t *pv;
    json_object_foreach(tp, pk, pv)
    {
        if (json_is_object(op) && json_object_get(op, pk)) continue;
        json_t *all = json_array();
        keep(c, all);
        json_array_append(all, pv);
        for (int p = 0; p < nre; p++) {
            int mt = c->b->status < 0 ? -1 : gx_match(re[p], (const uint8_t *)pk, strlen(pk));
            if (mt < 0) {
                fail(c, "allOf", path, "%s", "cannot match patternProperties");
                return NULL;
            }
            if (mt) json_array_append(all, rs[p]);
        }
        if (json_array_size(all) == 1 && ox && !json_is_true(ox)) json_array_append(all, ox);
        if (json_array_size(all) == 1) continue;
        if (!np) {
            np = json_deep_copy(tp);
            keep(c, np);
        }
        json_object_set_new(np, pk, json_pack("{s:O}", "allOf", all));
    }
    if (!np) return to;
    json_t *t2 = json_copy(to);
    keep(c, t2);
    json_object_set(t2, "properties", np);
    return t2;
}

static json_t *merge2(sc *c, json_t *a, json_t *b2, const char *path)
{
    json_t *a2 = close_props(c, a, b2, path), *b3 = a2 ? close_props(c, b2, a, path) : NULL;
    if (!b3) return NULL;
    a = a2;
    b2 = b3;
    json_t *m = json_deep_copy(a);
    keep(c, m);
    const char *k;
    json_t *v;
    json_object_foreach(b2, k, v)
    {
        json_t *o = json_object_get(m, k);
        if (!o && (strcmp(k, "anyOf") == 0 || strcmp(k, "oneOf") == 0))
            o = json_object_get(m, k[0] == 'a' ? "oneOf" : "anyOf"); /* both as anyOf */
        if (!o || in_list(k, ANNOTATIONS) || !(in_list(k, ENFORCED) || in_list(k, REFUSED))) {
            if (!o) json_object_set(m, k, v);
            continue;
        }
        if (json_equal(o, v)) continue;
        if (strcmp(k, "type") == 0) {
            unsigned t = type_mask(o) & type_mask(v);
            json_object_set_new(m, k, mask_types(t));
        } else if (strcmp(k, "properties") == 0) {
            json_t *np = json_deep_copy(o);
            keep(c, np);
            const char *pk;
            json_t *pv;
            json_object_foreach(v, pk, pv)
            {
                json_t *q = json_object_get(np, pk);
                if (q)
                    json_object_set_new(np, pk, json_pack("{s:[OO]}", "allOf", q, pv));
                else
                    json_object_set(np, pk, pv);
            }
            json_object_set(m, k, np);
        } else if (strcmp(k, "required") == 0 && json_is_array(o) && json_is_array(v)) {
            json_t *u = json_deep_copy(o);
            size_t i;
            json_t *x;
            json_array_foreach(v, i, x)
            {
                bool have = false;
                for (size_t j = 0; j < json_array_size(u); j++)
                    if (json_equal(json_array_get(u, j), x)) have = true;
                if (!have) json_array_append(u, x);
            }
            json_object_set_new(m, k, u);
        } else if (strcmp(k, "minimum") == 0 || strcmp(k, "minLength") == 0 ||
                   strcmp(k, "minItems") == 0 || strcmp(k, "maximum") == 0 ||
                   strcmp(k, "maxLength") == 0 || strcmp(k, "maxItems") == 0 ||
                   strcmp(k, "minProperties") == 0 || strcmp(k, "maxProperties") == 0 ||
                   strcmp(k, "exclusiveMinimum") == 0 || strcmp(k, "exclusiveMaximum") == 0) {
            double x, y;
            if (!num_of(o, &x) || !num_of(v, &y)) {
                fail(c, "allOf", path, "cannot merge '%s'", k);
                return NULL;
            }
            bool takemax = strncmp(k, "min", 3) == 0 || strcmp(k, "exclusiveMinimum") == 0;
            if (takemax ? y > x : y < x) json_object_set(m, k, v);
        } else if (strcmp(k, "enum") == 0 && json_is_array(o) && json_is_array(v)) {
            json_t *u = json_array();
            size_t i;
            json_t *x;
            json_array_foreach(o, i, x) for (size_t j = 0; j < json_array_size(v);
                                             j++) if (json_equal(json_array_get(v, j), x))
            {
                json_array_append(u, x);
                break;
            }
            json_object_set_new(m, k, u);
        } else if (strcmp(k, "items") == 0 || strcmp(k, "additionalProperties") == 0) {
            json_object_set_new(m, k, json_pack("{s:[OO]}", "allOf", o, v));
        } else if (strcmp(k, "anyOf") == 0 || strcmp(k, "oneOf") == 0) {
            /* (a1|a2) & (b1|b2): distribute */
            json_t *u = json_array();
            size_t i, j;
            json_t *x, *y;
            json_array_foreach(o, i, x) json_array_foreach(v, j, y)
                json_array_append_new(u, json_pack("{s:[OO]}", "allOf", x, y));
            if (json_array_size(u) > 64) {
                json_decref(u);
                fail(c, "allOf", path, "%s", "merging anyOf/oneOf gives over 64 branches");
                return NULL;
            }
            json_object_del(m, "oneOf");
            json_object_set_new(m, "anyOf", u);
        } else if (strcmp(k, "not") == 0) {
            add_allof(m, json_pack("{s:O}", "not", v)); /* sch takes one `not` at a time */
        } else {
            fail(c, "allOf", path, "cannot merge two different '%s'", k);
            return NULL;
        }
    }
    return m;
}

/* ---- the main switch ------------------------------------------------------------------------- */
static bool has_constraints(json_t *s, const char *skip1, const char *skip2)
{
    const char *k;
    json_t *v;
    json_object_foreach(s, k, v)
    {
        if (in_list(k, ANNOTATIONS) || strcmp(k, skip1) == 0 || (skip2 && strcmp(k, skip2) == 0))
            continue;
        return true;
    }
    return false;
}

/* whether value v has one of the types in mask */
static bool value_has_type(json_t *v, unsigned m)
{
    switch (json_typeof(v)) {
    case JSON_NULL: return m & 1;
    case JSON_TRUE:
    case JSON_FALSE: return m & 2;
    case JSON_OBJECT: return m & 4;
    case JSON_ARRAY: return m & 8;
    case JSON_STRING: return m & 16;
    case JSON_INTEGER: return m & 96;
    case JSON_REAL:
        return (m & 32) || ((m & 64) && floor(json_real_value(v)) == json_real_value(v));
    }
    return false;
}

/* not {bound: v} for a single bound: the opposite bound. The integer keywords flip to v -+ 1;
 * `minLength: 0` and the like match every value of their type (handled by the caller). */
static const struct {
    const char *kw, *opp;
    int shift; /* 0: numbers (inclusive <-> exclusive), -1/+1: counts */
} NOT_BOUNDS[] = {
    {"minimum", "exclusiveMaximum", 0},     {"maximum", "exclusiveMinimum", 0},
    {"exclusiveMinimum", "maximum", 0},     {"exclusiveMaximum", "minimum", 0},
    {"minLength", "maxLength", -1},         {"maxLength", "minLength", 1},
    {"minItems", "maxItems", -1},           {"maxItems", "minItems", 1},
    {"minProperties", "maxProperties", -1}, {"maxProperties", "minProperties", 1},
};

/* Whether `not: nt` constrains strings only and string_expr subtracts it: nt holds string
 * keywords (`pattern`, `format`, `minLength`, `maxLength`, `enum`/`const` of strings, `type`
 * "string") and at least one of `pattern`, `format`, `enum`, `const`. */
static bool not_on_strings(json_t *nt)
{
    if (!json_is_object(nt)) return false;
    const char *k;
    json_t *v;
    bool core = false;
    json_object_foreach(nt, k, v)
    {
        if (in_list(k, ANNOTATIONS) || strcmp(k, "minLength") == 0 || strcmp(k, "maxLength") == 0)
            continue;
        if (strcmp(k, "type") == 0) {
            if (!json_is_string(v) || strcmp(json_string_value(v), "string") != 0) return false;
        } else if (strcmp(k, "pattern") == 0 || strcmp(k, "format") == 0) {
            if (!json_is_string(v)) return false;
            core = true;
        } else if (strcmp(k, "const") == 0) {
            if (!json_is_string(v)) return false;
            core = true;
        } else if (strcmp(k, "enum") == 0) {
            size_t i;
            json_t *x;
            if (!json_is_array(v)) return false;
            json_array_foreach(v, i, x) if (!json_is_string(x)) return false;
            core = true;
        } else {
            return false;
        }
    }
    return core;
}

/* `not` in the forms that reduce exactly to other keywords: not false (no constraint), not
 * true or not {} (no value), not {"type": ...} (those types removed), not {"not": X} (X),
 * not {"anyOf": [...]} (allOf of the nots), not {"allOf": [...]} (anyOf of the nots), not of a
 * lone local `$ref` (not of its target), not {"required": [...]} (one of them absent), not of
 * a single bound (the opposite bound). Returns the schema without `not` (and with what it
 * became), NULL for no value (or a refusal already recorded), s itself to refuse as usual. */
static json_t *not_rewrite(sc *c, json_t *s, json_t *nt, const char *path)
{
    if (json_is_true(nt) || (json_is_object(nt) && !has_constraints(nt, "", NULL))) return NULL;
    json_t *r = json_deep_copy(s);
    keep(c, r);
    json_object_del(r, "not");
    if (json_is_false(nt)) return r;
    if (!json_is_object(nt)) return s;
    json_t *v;
    const char *npath = sub(c, path, "not");
    if ((v = json_object_get(nt, "not")) && !has_constraints(nt, "not", NULL)) {
        if (json_is_false(v)) return NULL;
        if (!json_is_true(v)) add_allof(r, json_incref(v));
        return r;
    }
    if ((v = json_object_get(nt, "$ref")) && !has_constraints(nt, "$ref", NULL)) {
        json_t *t = deref(c, nt, npath);
        if (!t) return NULL;
        if (t == nt) return s;
        add_allof(r, json_pack("{s:O}", "not", t));
        return r;
    }
    bool any = (v = json_object_get(nt, "anyOf")) && !has_constraints(nt, "anyOf", NULL);
    if (any || ((v = json_object_get(nt, "allOf")) && !has_constraints(nt, "allOf", NULL))) {
        if (!json_is_array(v) || json_array_size(v) == 0) return s;
        json_t *nots = json_array();
        size_t i;
        json_t *x;
        json_array_foreach(v, i, x) json_array_append_new(nots, json_pack("{s:O}", "not", x));
        add_allof(r, any ? json_pack("{s:o}", "allOf", nots) : json_pack("{s:o}", "anyOf", nots));
        return r;
    }
    if ((v = json_object_get(nt, "required")) && !has_constraints(nt, "required", NULL)) {
        if (!json_is_array(v) || json_array_size(v) == 0) return s;
        json_t *alts = json_array();
        size_t i;
        json_t *x;
        json_array_foreach(v, i, x)
        {
            if (!json_is_string(x)) {
                json_decref(alts);
                return s;
            }
            json_array_append_new(
                alts, json_pack("{s:{s:b}}", "properties", json_string_value(x), false));
        }
        add_allof(r, json_pack("{s:o}", "anyOf", alts));
        return r;
    }
    for (size_t k = 0; k < sizeof NOT_BOUNDS / sizeof *NOT_BOUNDS; k++) {
        if (!(v = json_object_get(nt, NOT_BOUNDS[k].kw)) ||
            has_constraints(nt, NOT_BOUNDS[k].kw, NULL))
            continue;
        if (NOT_BOUNDS[k].shift == 0) {
            if (!json_is_number(v)) return s;
            add_allof(r, json_pack("{s:O}", NOT_BOUNDS[k].opp, v));
            return r;
        }
        if (!json_is_integer(v)) return s;
        json_int_t n = json_integer_value(v) + NOT_BOUNDS[k].shift;
        if (n < 0) { /* not {minLength: 0}: no value of that type */
            const char *t = NOT_BOUNDS[k].kw[3] == 'L'   ? "string"
                            : NOT_BOUNDS[k].kw[3] == 'I' ? "array"
                                                         : "object";
            add_allof(r, json_pack("{s:{s:s}}", "not", "type", t));
        } else {
            add_allof(r, json_pack("{s:I}", NOT_BOUNDS[k].opp, n));
        }
        return r;
    }
    if (!json_object_get(nt, "type") || has_constraints(nt, "type", NULL)) return s;
    unsigned neg = type_mask(json_object_get(nt, "type"));
    unsigned have = type_mask(json_object_get(s, "type"));
    if (neg == 0) return s;
    /* "not integer" leaves the numbers with a fraction: not a type of its own */
    if ((neg & (1u << 6)) && !(neg & (1u << 5)) && (have & (1u << 5))) return s;
    json_object_set_new(r, "type", mask_types(have & ~neg));
    return r;
}

/* Whether name is in s's `required`. */
static bool is_required(json_t *s, const char *name)
{
    json_t *req = json_object_get(s, "required");
    for (size_t i = 0; i < json_array_size(req); i++)
        if (json_is_string(json_array_get(req, i)) &&
            strcmp(json_string_value(json_array_get(req, i)), name) == 0)
            return true;
    return false;
}

/* `dependentRequired`, `dependentSchemas` and draft-7 `dependencies` as anyOf: for each entry
 * (a, D), either a is absent (`properties: {a: false}`) or a is present and the object has the
 * names of D (`required`) or matches D (a schema); a required a needs no branch. Returns s
 * without these keywords and with an allOf of what they became, or s itself when it has none;
 * NULL after a refusal. */
static json_t *deps_rewrite(sc *c, json_t *s, const char *path)
{
    static const char *const KW[] = {"dependencies", "dependentRequired", "dependentSchemas"};
    json_t *r = s;
    for (size_t k = 0; k < 3; k++) {
        json_t *d = json_object_get(s, KW[k]);
        if (!d) continue;
        if (!json_is_object(d)) {
            fail(c, KW[k], path, "%s", "must be an object");
            return NULL;
        }
        if (r == s) {
            r = json_deep_copy(s);
            keep(c, r);
        }
        json_object_del(r, KW[k]);
        const char *a;
        json_t *dv;
        json_object_foreach(d, a, dv)
        {
            json_t *then;
            if (json_is_array(dv) && k != 2) {
                size_t i;
                json_t *x;
                json_array_foreach(dv, i, x) if (!json_is_string(x))
                {
                    fail(c, KW[k], path, "'%s': names must be strings", a);
                    return NULL;
                }
                if (json_array_size(dv) == 0) continue;
                then = json_pack("{s:O}", "required", dv);
            } else if ((json_is_object(dv) || json_is_boolean(dv)) && k != 1) {
                if (json_is_true(dv)) continue;
                then = json_is_false(dv) ? json_pack("{s:b}", "not", true) : json_incref(dv);
            } else {
                fail(c, KW[k], path, "'%s': not a list of names or a schema", a);
                return NULL;
            }
            if (is_required(s, a)) {
                add_allof(r, then);
                continue;
            }
            add_allof(r, json_pack("{s:[{s:{s:b}},{s:[{s:[s]},o]}]}", "anyOf", "properties", a,
                                   false, "allOf", "required", a, then));
        }
    }
    return r;
}

static gx *sch(sc *c, json_t *s, const char *path)
{
    gb *b = c->b;
    if (b->status < 0) return gx_none(b);
    if (json_is_true(s)) return gx_call(b, r_value(c));
    if (json_is_false(s)) return gx_none(b);
    if (!json_is_object(s)) {
        gb_fail(b, PD_EINVAL, "", path, -1,
                "json schema: %s: a schema must be an object or a boolean", *path ? path : "/");
        return gx_none(b);
    }
    if (++c->depth > MAX_DEPTH) {
        c->depth--;
        return fail(c, "allOf", path, "%s", "schema nested too deeply");
    }
    gx *out = NULL;
    const char *k;
    json_t *v;
    json_t *nt = json_object_get(s, "not");
    if (nt) {
        json_t *r = not_on_strings(nt) ? s : not_rewrite(c, s, nt, path);
        if (!r) {
            out = gx_none(b);
            goto done;
        }
        if (r != s) {
            out = sch(c, r, path);
            goto done;
        }
    }
    json_t *dr = deps_rewrite(c, s, path);
    if (dr != s) {
        out = dr ? sch(c, dr, path) : gx_none(b);
        goto done;
    }
    json_object_foreach(s, k, v)
    {
        if (in_list(k, REFUSED)) {
            /* a few harmless values */
            if (strcmp(k, "uniqueItems") == 0 && json_is_false(v)) continue;
            if (strcmp(k, "multipleOf") == 0) continue;               /* checked with the number */
            if (strcmp(k, "not") == 0 && not_on_strings(v)) continue; /* string_expr */
            out = fail(c, k, path, "%s", "this keyword is not supported");
            goto done;
        }
    }
    if (json_object_get(s, "$ref")) {
        json_t *r = json_object_get(s, "$ref");
        if (!json_is_string(r)) {
            out = fail(c, "$ref", path, "%s", "must be a string");
            goto done;
        }
        if (c->ref_alone || !has_constraints(s, "$ref", NULL)) {
            out = ref_call(c, json_string_value(r), path);
            goto done;
        }
    }
    if (json_object_get(s, "allOf") || json_object_get(s, "$ref")) {
        json_t *f = flatten_allof(c, s, path, 0);
        if (!f) {
            out = gx_none(b);
            goto done;
        }
        if ((json_object_get(f, "allOf") && !json_object_get(f, "not")) ||
            json_object_get(f, "$ref")) {
            out = fail(c, "allOf", path, "%s", "could not be flattened");
            goto done;
        }
        out = sch(c, f, path);
        goto done;
    }
    json_t *any = json_object_get(s, "anyOf");
    const char *anykw = "anyOf";
    if (!any) {
        any = json_object_get(s, "oneOf");
        anykw = "oneOf";
    }
    if (any) {
        if (!json_is_array(any) || json_array_size(any) == 0) {
            out = fail(c, anykw, path, "%s", "must be a non-empty array");
            goto done;
        }
        if (json_object_get(s, "anyOf") && json_object_get(s, "oneOf")) {
            out = fail(c, "oneOf", path, "%s", "anyOf together with oneOf is not supported");
            goto done;
        }
        size_t n = json_array_size(any);
        gx **alts = malloc(sizeof(gx *) * n);
        if (!alts) {
            out = gx_none(b);
            goto done;
        }
        bool siblings = has_constraints(s, anykw, NULL);
        json_t *rest = NULL;
        if (siblings) {
            rest = json_deep_copy(s);
            keep(c, rest);
            json_object_del(rest, anykw);
        }
        const char *apath = sub(c, path, anykw);
        for (size_t i = 0; i < n; i++) {
            json_t *br = json_array_get(any, i);
            if (siblings) {
                json_t *w = json_pack("{s:[OO]}", "allOf", rest, br);
                keep(c, w);
                alts[i] = sch(c, w, subi(c, apath, i));
            } else {
                alts[i] = sch(c, br, subi(c, apath, i));
            }
        }
        out = gx_alt(b, alts, (int)n);
        free(alts);
        goto done;
    }
    json_t *type = json_object_get(s, "type");
    unsigned tm = type_mask(type);
    if (json_is_array(type) && json_array_size(type) == 0) {
        out = gx_none(b); /* allOf of disjoint types (merge2): no value */
        goto done;
    }
    if (type && tm == 0) {
        out = fail(c, "type", path, "%s", "unknown type name");
        goto done;
    }
    json_t *cst = json_object_get(s, "const"), *en = json_object_get(s, "enum");
    if (cst || en) {
        const char *ek = cst ? "const" : "enum";
        if (en && !json_is_array(en)) {
            out = fail(c, "enum", path, "%s", "must be an array");
            goto done;
        }
        json_t *rest = NULL;
        if (has_constraints(s, ek,
                            cst && en ? "enum" : NULL)) { /* values must also match the rest */
            rest = json_deep_copy(s);
            keep(c, rest);
            json_object_del(rest, "enum");
            json_object_del(rest, "const");
        }
        size_t n = cst ? 1 : json_array_size(en);
        gx **alts = malloc(sizeof(gx *) * (n ? n : 1));
        int m = 0;
        unsigned vt = 0; /* the types of the values kept */
        for (size_t i = 0; alts && i < n; i++) {
            json_t *val = cst ? cst : json_array_get(en, i);
            if (!value_has_type(val, tm)) continue;
            alts[m++] = value_lit(c, val);
            for (unsigned t = 0; t < 7; t++)
                if (value_has_type(val, 1u << t)) vt |= 1u << t;
        }
        /* the rest only for the types of the values: keeps the intersection free of the
         * recursive rules of the other types */
        if (rest) json_object_set_new(rest, "type", mask_types(tm & vt));
        out = alts ? gx_alt(b, alts, m) : gx_none(b);
        free(alts);
        if (rest && m > 0) out = gx_and(b, out, sch(c, rest, path));
        goto done;
    }
    gx *alts[7];
    int m = 0;
    if (tm & 1) alts[m++] = lit(c, "null");
    if (tm & 2) alts[m++] = gx_alt2(b, lit(c, "true"), lit(c, "false"));
    if (tm & 4) alts[m++] = object_expr(c, s, path);
    if (tm & 8) alts[m++] = array_expr(c, s, path);
    if (tm & 16) alts[m++] = string_expr(c, s, path);
    if (tm & 32)
        alts[m++] = number_expr(c, s, path, false);
    else if (tm & 64)
        alts[m++] = number_expr(c, s, path, true);
    out = gx_alt(b, alts, m);
done:
    c->depth--;
    return out ? out : gx_none(b);
}

static int ws_init(sc *c, const char *ws_pattern)
{
    gb *b = c->b;
    if (ws_pattern) {
        c->ws = rx_parse(b, ws_pattern, strlen(ws_pattern), RX_FULL, "guided_whitespace_pattern");
        return b->status;
    }
    gx *one = gx_alt(b,
                     (gx *[]){gx_byte(b, ' ', ' '), gx_byte(b, '\t', '\t'), gx_byte(b, '\n', '\n'),
                              gx_byte(b, '\r', '\r')},
                     4);
    c->ws = gx_rep(b, one, 0, PD_GRAMMAR_WS_MAX);
    return b->status;
}

static void sc_free(sc *c)
{
    for (int i = 0; i < c->nkeep; i++) json_decref(c->keep[i]);
    free(c->keep);
    free(c->refs);
}

int schema_compile(gb *b, const char *text, size_t len, const char *ws_pattern, int32_t *root)
{
    json_error_t je;
    json_t *j = pdj_loadb(text, len, JSON_ALLOW_NUL, &je); /* a bound beyond int64 too */
    if (!j)
        return gb_fail(b, PD_EPARSE, "", "", je.position, "json schema: not valid JSON: %s at %d",
                       je.text, je.position);
    sc c = {0};
    c.b = b;
    c.root = j;
    const char *draft = json_string_value(json_object_get(j, "$schema"));
    c.ref_alone = draft && (strstr(draft, "draft-03") || strstr(draft, "draft-04") ||
                            strstr(draft, "draft-06") || strstr(draft, "draft-07"));
    c.r_string = c.r_number = c.r_integer = c.r_value = -1;
    int rc = ws_init(&c, ws_pattern);
    if (rc == 0) {
        gx *x = sch(&c, j, "");
        int32_t r = gb_rule_new(b, "root");
        gb_rule_set(b, r, x);
        *root = r;
    }
    rc = b->status;
    sc_free(&c);
    json_decref(j);
    return rc;
}

int json_object_compile(gb *b, const char *ws_pattern, int32_t *root)
{
    sc c = {0};
    c.b = b;
    c.r_string = c.r_number = c.r_integer = c.r_value = -1;
    int rc = ws_init(&c, ws_pattern);
    if (rc == 0) {
        gx *x = object_any(&c);
        int32_t r = gb_rule_new(b, "root");
        gb_rule_set(b, r, x);
        *root = r;
    }
    rc = b->status;
    sc_free(&c);
    return rc;
}
