/* EBNF grammars for guided_grammar: GBNF as llama.cpp writes it (name ::= ..., "strings",
 * [classes], ., | * + ? {m,n}, ( ), # comments) and the Lark subset vLLM documents
 * (name: ..., ?name / !name, "strings", /regex/, "a".."z", %import common.X for the common
 * terminals). The root is `root`, else `start`, else the first rule. Left recursion and
 * %ignore are refused with the position. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/gram_internal.h"
#include "util/status.h"

typedef struct {
    gb *b;
    const char *s;
    size_t n, i;
    int depth;
    struct {
        char *name;
        int32_t rule;
        bool defined;
    } * names;
    int nn, cap;
} ep;

static int efail(ep *p, size_t pos, const char *what)
{
    /* line:col for the message */
    int line = 1, col = 1;
    for (size_t k = 0; k < pos && k < p->n; k++) {
        if (p->s[k] == '\n')
            line++, col = 1;
        else
            col++;
    }
    return gb_fail(p->b, PD_EPARSE, "", "", (long)pos, "grammar: %s at line %d column %d", what,
                   line, col);
}

static void skip_ws(ep *p)
{
    while (p->i < p->n) {
        char c = p->s[p->i];
        if (c == ' ' || c == '\t' || c == '\r' || c == '\n')
            p->i++;
        else if (c == '#' || (c == '/' && p->i + 1 < p->n && p->s[p->i + 1] == '/')) {
            while (p->i < p->n && p->s[p->i] != '\n') p->i++;
        } else
            break;
    }
}

static bool is_id(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '-';
}

static size_t id_len(ep *p, size_t at)
{
    size_t k = at;
    while (k < p->n && is_id(p->s[k])) k++;
    return k - at;
}

static int32_t name_rule(ep *p, const char *s, size_t n, bool define)
{
    for (int i = 0; i < p->nn; i++)
        if (strlen(p->names[i].name) == n && memcmp(p->names[i].name, s, n) == 0) {
            if (define) {
                if (p->names[i].defined) return -2;
                p->names[i].defined = true;
            }
            return p->names[i].rule;
        }
    if (p->nn == p->cap) {
        int cap = p->cap ? 2 * p->cap : 16;
        void *q = realloc(p->names, sizeof(*p->names) * (size_t)cap);
        if (!q) return -1;
        p->names = q;
        p->cap = cap;
    }
    char *nm = pd_arena_strndup(p->b->a, s, n);
    int32_t r = gb_rule_new(p->b, nm);
    p->names[p->nn].name = nm;
    p->names[p->nn].rule = r;
    p->names[p->nn].defined = define;
    p->nn++;
    return r;
}

/* at p->i: [?!]name[.N] followed by "::=" or ":" (not "::"+non-=) */
static bool at_definition(ep *p, size_t *name_at, size_t *name_n, size_t *body_at)
{
    size_t k = p->i;
    if (k < p->n && (p->s[k] == '?' || p->s[k] == '!')) k++;
    size_t l = id_len(p, k);
    if (l == 0) return false;
    size_t at = k;
    k += l;
    if (k + 1 < p->n && p->s[k] == '.' && p->s[k + 1] >= '0' && p->s[k + 1] <= '9') {
        k++;
        while (k < p->n && p->s[k] >= '0' && p->s[k] <= '9') k++;
    }
    while (k < p->n && (p->s[k] == ' ' || p->s[k] == '\t')) k++;
    if (k + 2 < p->n + 0 && strncmp(p->s + k, "::=", 3) == 0)
        k += 3;
    else if (k < p->n && p->s[k] == ':' && !(k + 1 < p->n && p->s[k + 1] == ':'))
        k += 1;
    else
        return false;
    *name_at = at;
    *name_n = l;
    *body_at = k;
    return true;
}

static int hexv(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static void put_utf8(char *o, size_t *k, uint32_t c)
{
    if (c < 0x80)
        o[(*k)++] = (char)c;
    else if (c < 0x800)
        o[(*k)++] = (char)(0xC0 | (c >> 6)), o[(*k)++] = (char)(0x80 | (c & 0x3F));
    else if (c < 0x10000)
        o[(*k)++] = (char)(0xE0 | (c >> 12)), o[(*k)++] = (char)(0x80 | ((c >> 6) & 0x3F)),
        o[(*k)++] = (char)(0x80 | (c & 0x3F));
    else
        o[(*k)++] = (char)(0xF0 | (c >> 18)), o[(*k)++] = (char)(0x80 | ((c >> 12) & 0x3F)),
        o[(*k)++] = (char)(0x80 | ((c >> 6) & 0x3F)), o[(*k)++] = (char)(0x80 | (c & 0x3F));
}

/* a quoted string at p->i (" or '); decoded bytes into *out (arena) */
static int read_string(ep *p, char **out, size_t *olen)
{
    size_t start = p->i;
    char q = p->s[p->i++];
    char *o = pd_arena_alloc(p->b->a, p->n - p->i + 4, 1);
    if (!o) return -1;
    size_t k = 0;
    while (p->i < p->n && p->s[p->i] != q) {
        char c = p->s[p->i++];
        if (c == '\n') return efail(p, start, "an unterminated string");
        if (c != '\\') {
            o[k++] = c;
            continue;
        }
        if (p->i >= p->n) break;
        char e = p->s[p->i++];
        uint32_t v = 0;
        int nd = 0;
        switch (e) {
        case 'n': o[k++] = '\n'; break;
        case 't': o[k++] = '\t'; break;
        case 'r': o[k++] = '\r'; break;
        case '0': o[k++] = 0; break;
        case 'x': nd = 2; break;
        case 'u': nd = 4; break;
        case 'U': nd = 8; break;
        default: o[k++] = e;
        }
        if (nd) {
            for (int d = 0; d < nd; d++) {
                if (p->i >= p->n || hexv(p->s[p->i]) < 0) return efail(p, p->i, "a bad escape");
                v = v * 16 + (uint32_t)hexv(p->s[p->i++]);
            }
            if (v > 0x10FFFF) return efail(p, p->i, "a bad escape");
            if (e == 'x')
                o[k++] = (char)v;
            else
                put_utf8(o, &k, v);
        }
    }
    if (p->i >= p->n) return efail(p, start, "an unterminated string");
    p->i++;
    *out = o;
    *olen = k;
    return 0;
}

static gx *e_alt(ep *p);

static const struct {
    const char *name, *re;
} COMMON[] = {
    {"DIGIT", "[0-9]"},
    {"HEXDIGIT", "[0-9a-fA-F]"},
    {"INT", "[0-9]+"},
    {"SIGNED_INT", "[+-]?[0-9]+"},
    {"DECIMAL", "[0-9]+\\.[0-9]*|\\.[0-9]+"},
    {"NUMBER", "[0-9]+(\\.[0-9]*)?([eE][+-]?[0-9]+)?|\\.[0-9]+([eE][+-]?[0-9]+)?"},
    {"SIGNED_NUMBER", "[+-]?([0-9]+(\\.[0-9]*)?([eE][+-]?[0-9]+)?|\\.[0-9]+([eE][+-]?[0-9]+)?)"},
    {"FLOAT",
     "[0-9]+\\.[0-9]*([eE][+-]?[0-9]+)?|\\.[0-9]+([eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+"},
    {"LCASE_LETTER", "[a-z]"},
    {"UCASE_LETTER", "[A-Z]"},
    {"LETTER", "[A-Za-z]"},
    {"WORD", "[A-Za-z]+"},
    {"CNAME", "[A-Za-z_][A-Za-z0-9_]*"},
    {"ESCAPED_STRING", "\"([^\"\\\\\\n]|\\\\.)*\""},
    {"WS_INLINE", "[ \\t]+"},
    {"WS", "[ \\t\\f\\r\\n]+"},
    {"CR", "\\r"},
    {"LF", "\\n"},
    {"NEWLINE", "(\\r?\\n)+"},
    {NULL, NULL}};

static gx *e_atom(ep *p)
{
    gb *b = p->b;
    skip_ws(p);
    if (p->i >= p->n) {
        efail(p, p->i, "an expression expected");
        return gx_none(b);
    }
    size_t pos = p->i;
    char c = p->s[p->i];
    if (c == '(' || c == '[') {
        if (c == '[' && p->i + 1 < p->n) {
            /* GBNF class: reuse the regex class parser on "[...]" */
            size_t k = p->i + 1;
            if (k < p->n && p->s[k] == '^') k++;
            if (k < p->n && p->s[k] == ']') k++;
            while (k < p->n && p->s[k] != ']') k += p->s[k] == '\\' ? 2 : 1;
            if (k >= p->n) {
                efail(p, pos, "an unterminated character class");
                return gx_none(b);
            }
            gx *x = rx_parse(b, p->s + p->i, k + 1 - p->i, RX_FULL, "");
            if (b->status < 0 && b->err) b->err->pos += (long)p->i;
            p->i = k + 1;
            return x;
        }
        if (c == '[') { /* Lark optional [x] */
        }
        p->i++;
        if (++p->depth > 200) {
            efail(p, pos, "nesting too deep");
            return gx_none(b);
        }
        gx *x = e_alt(p);
        p->depth--;
        skip_ws(p);
        if (p->i >= p->n || p->s[p->i] != ')') {
            efail(p, pos, "an unclosed '('");
            return gx_none(b);
        }
        p->i++;
        return x;
    }
    if (c == '"' || c == '\'') {
        char *s;
        size_t n;
        if (read_string(p, &s, &n) < 0) return gx_none(b);
        if (p->i < p->n && p->s[p->i] == 'i' && !(p->i + 1 < p->n && is_id(p->s[p->i + 1]))) {
            efail(p, p->i, "case-insensitive strings (\"...\"i) are not supported");
            return gx_none(b);
        }
        /* Lark range "a".."z" */
        size_t save = p->i;
        skip_ws(p);
        if (p->i + 1 < p->n && p->s[p->i] == '.' && p->s[p->i + 1] == '.') {
            p->i += 2;
            skip_ws(p);
            char *s2;
            size_t n2;
            if (p->i >= p->n || (p->s[p->i] != '"' && p->s[p->i] != '\'')) {
                efail(p, p->i, "a string after '..'");
                return gx_none(b);
            }
            if (read_string(p, &s2, &n2) < 0) return gx_none(b);
            /* single characters (UTF-8) */
            char cls[64];
            int m = snprintf(cls, sizeof cls, "[%.*s-%.*s]", (int)n, s, (int)n2, s2);
            return rx_parse(b, cls, (size_t)m, RX_FULL, "");
        }
        p->i = save;
        return gx_lit(b, s, n);
    }
    if (c == '/') {
        size_t k = p->i + 1;
        while (k < p->n && p->s[k] != '/' && p->s[k] != '\n') k += p->s[k] == '\\' ? 2 : 1;
        if (k >= p->n || p->s[k] != '/') {
            efail(p, pos, "an unterminated /regex/");
            return gx_none(b);
        }
        gx *x = rx_parse(b, p->s + p->i + 1, k - p->i - 1, RX_FULL, "");
        if (b->status < 0 && b->err && b->err->pos >= 0) b->err->pos += (long)p->i + 1;
        p->i = k + 1;
        if (p->i < p->n && is_id(p->s[p->i]) && p->s[p->i] != '-') {
            efail(p, p->i, "regex flags are not supported");
            return gx_none(b);
        }
        return x;
    }
    if (c == '.') {
        p->i++;
        uint32_t rg[] = {0, 0x10FFFF};
        return gx_cp_set(b, rg, 1);
    }
    size_t l = id_len(p, p->i);
    if (l) {
        int32_t r = name_rule(p, p->s + p->i, l, false);
        p->i += l;
        return r < 0 ? gx_none(b) : gx_call(b, r);
    }
    efail(p, pos, "an unexpected character");
    return gx_none(b);
}

static bool read_int(ep *p, long *v)
{
    size_t s = p->i;
    long x = 0;
    while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9') {
        x = x * 10 + (p->s[p->i++] - '0');
        if (x > 100000) x = 100001;
    }
    *v = x;
    return p->i > s;
}

static gx *e_postfix(ep *p)
{
    gx *x = e_atom(p);
    while (p->b->status >= 0 && p->i < p->n) {
        size_t k = p->i;
        while (k < p->n && (p->s[k] == ' ' || p->s[k] == '\t')) k++;
        if (k >= p->n) break;
        char c = p->s[k];
        if (c == '*')
            p->i = k + 1, x = gx_star(p->b, x);
        else if (c == '+')
            p->i = k + 1, x = gx_plus(p->b, x);
        else if (c == '?')
            p->i = k + 1, x = gx_opt(p->b, x);
        else if (c == '{') {
            p->i = k + 1;
            long mn, mx;
            skip_ws(p);
            if (!read_int(p, &mn)) {
                efail(p, k, "a number in {m,n}");
                return gx_none(p->b);
            }
            mx = mn;
            skip_ws(p);
            if (p->i < p->n && p->s[p->i] == ',') {
                p->i++;
                skip_ws(p);
                if (!read_int(p, &mx)) mx = -1;
            }
            skip_ws(p);
            if (p->i >= p->n || p->s[p->i] != '}') {
                efail(p, k, "an unclosed {m,n}");
                return gx_none(p->b);
            }
            p->i++;
            if (mn > 100000 || mx > 100000 || (mx >= 0 && mx < mn)) {
                efail(p, k, "a bad repetition bound");
                return gx_none(p->b);
            }
            x = gx_rep(p->b, x, (int32_t)mn, (int32_t)mx);
        } else if (c == '~') { /* Lark: item ~ n or item ~ n..m */
            p->i = k + 1;
            skip_ws(p);
            long mn, mx;
            if (!read_int(p, &mn)) {
                efail(p, k, "a number after '~'");
                return gx_none(p->b);
            }
            mx = mn;
            if (p->i + 1 < p->n && p->s[p->i] == '.' && p->s[p->i + 1] == '.') {
                p->i += 2;
                if (!read_int(p, &mx)) {
                    efail(p, k, "a number after '..'");
                    return gx_none(p->b);
                }
            }
            if (mn > 100000 || mx > 100000 || mx < mn) {
                efail(p, k, "a bad repetition bound");
                return gx_none(p->b);
            }
            x = gx_rep(p->b, x, (int32_t)mn, (int32_t)mx);
        } else
            break;
    }
    return x;
}

static bool seq_end(ep *p)
{
    skip_ws(p);
    if (p->i >= p->n) return true;
    char c = p->s[p->i];
    if (c == '|' || c == ')' || c == '%') return true;
    size_t a, n, bd;
    return at_definition(p, &a, &n, &bd);
}

/* Appends x to the growing array *k (*n of *cap); -1 when out of memory. */
static int push_gx(gx ***k, int *n, int *cap, gx *x)
{
    if (*n == *cap) {
        int c = *cap ? 2 * *cap : 8;
        gx **q = realloc(*k, sizeof(gx *) * (size_t)c);
        if (!q) return -1;
        *k = q;
        *cap = c;
    }
    (*k)[(*n)++] = x;
    return 0;
}

static gx *e_seq(ep *p)
{
    gx **k = NULL;
    int n = 0, cap = 0;
    while (p->b->status >= 0 && !seq_end(p)) {
        gx *x = e_postfix(p);
        if (push_gx(&k, &n, &cap, x) < 0) break;
    }
    gx *x = gx_seq(p->b, k, n);
    free(k);
    return x;
}

static gx *e_alt(ep *p)
{
    gx **k = NULL;
    int n = 0, cap = 0;
    while (p->b->status >= 0) {
        gx *x = e_seq(p);
        if (push_gx(&k, &n, &cap, x) < 0) break;
        skip_ws(p);
        if (p->i < p->n && p->s[p->i] == '|') {
            p->i++;
            continue;
        }
        break;
    }
    gx *x = gx_alt(p->b, k, n);
    free(k);
    return x;
}

int ebnf_compile(gb *b, const char *text, size_t len, int32_t *root)
{
    ep p = {b, text, len, 0, 0, NULL, 0, 0};
    int32_t first = -1;
    while (b->status >= 0) {
        skip_ws(&p);
        if (p.i >= p.n) break;
        if (p.s[p.i] == '%') {
            size_t pos = p.i;
            if (strncmp(p.s + p.i, "%import", 7) == 0) {
                p.i += 7;
                skip_ws(&p);
                if (strncmp(p.s + p.i, "common.", 7) != 0) {
                    efail(&p, pos, "%import other than common.NAME is not supported");
                    break;
                }
                p.i += 7;
                size_t l = id_len(&p, p.i);
                int k = 0;
                while (COMMON[k].name &&
                       !(strlen(COMMON[k].name) == l && memcmp(COMMON[k].name, p.s + p.i, l) == 0))
                    k++;
                if (!COMMON[k].name) {
                    efail(&p, p.i, "an unknown common terminal");
                    break;
                }
                int32_t r = name_rule(&p, COMMON[k].name, l, true);
                p.i += l;
                if (r == -2) continue;
                gb_rule_set(b, r, rx_parse(b, COMMON[k].re, strlen(COMMON[k].re), RX_FULL, ""));
                continue;
            }
            if (strncmp(p.s + p.i, "%ignore", 7) == 0)
                efail(&p, pos, "%ignore is not supported (write the whitespace into the rules)");
            else
                efail(&p, pos, "an unknown % directive");
            break;
        }
        size_t at, n, body;
        if (!at_definition(&p, &at, &n, &body)) {
            efail(&p, p.i, "a rule definition (name ::= ... or name: ...) expected");
            break;
        }
        int32_t r = name_rule(&p, p.s + at, n, true);
        if (r == -2) {
            efail(&p, at, "a rule defined twice");
            break;
        }
        if (r < 0) break;
        if (first < 0) first = r;
        p.i = body;
        gx *x = e_alt(&p);
        gb_rule_set(b, r, x);
    }
    if (b->status >= 0) {
        if (first < 0) {
            free(p.names);
            return gb_fail(b, PD_EPARSE, "", "", 0, "grammar: no rules");
        }
        for (int i = 0; i < p.nn; i++)
            if (!p.names[i].defined) {
                gb_fail(b, PD_EPARSE, "", "", -1, "grammar: rule '%s' is used but not defined",
                        p.names[i].name);
                break;
            }
        int32_t rr = first;
        for (int i = 0; i < p.nn; i++)
            if (strcmp(p.names[i].name, "root") == 0) rr = p.names[i].rule;
        if (rr == first)
            for (int i = 0; i < p.nn; i++)
                if (strcmp(p.names[i].name, "start") == 0) rr = p.names[i].rule;
        *root = rr;
    }
    free(p.names);
    return b->status;
}
