/* Chat-template compiler: Jinja lexer and parser for the subset of docs/api.md §13.4.
 *
 * The lexer follows jinja2 3.x's own lexer rule for rule, because byte-identical output
 * depends on its whitespace handling: newlines are normalized and one trailing newline is
 * dropped first (keep_trailing_newline off); `{%-`/`{{-`/`{#-` strip all whitespace before
 * the tag; `-%}`/`-}}`/`-#}` strip all whitespace after it; trim_blocks drops one "\n" after
 * `%}`/`#}`; lstrip_blocks drops spaces and tabs between a line start and `{%`/`{#`
 * (`{%+` keeps them). Inside a tag, an end marker only counts when brackets are balanced.
 *
 * The parser is jinja2's recursive descent (same precedence: filters and tests bind tighter
 * than any binary operator) and resolves every filter, test, method and global function
 * name to an id, so constructs outside the subset fail here with the contract's message.
 * Recursion depth is bounded so hostile templates cannot exhaust the stack.
 */
#include "tokenizer/jinja_internal.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/unicode.h"
#include "util/status.h"

#define MAX_DEPTH 200 /* nesting of expressions and statements */

/* Status of the last error raised while compiling on this thread (syntax, unsupported or
 * out of memory), so the parser's NULL returns can report the right code. */
static _Thread_local int compile_rc;

/* ---- names of the subset ------------------------------------------------------------ */

static const char *const filter_names[JF__COUNT] = {
    [JF_TRIM] = "trim",
    [JF_LENGTH] = "length",
    [JF_TOJSON] = "tojson",
    [JF_JOIN] = "join",
    [JF_LIST] = "list",
    [JF_ITEMS] = "items",
    [JF_STRING] = "string",
    [JF_FIRST] = "first",
    [JF_LAST] = "last",
    [JF_UPPER] = "upper",
    [JF_LOWER] = "lower",
    [JF_REPLACE] = "replace",
    [JF_DEFAULT] = "default",
    [JF_INT] = "int",
    [JF_FLOAT] = "float",
    [JF_ABS] = "abs",
    [JF_SELECT] = "select",
    [JF_REJECT] = "reject",
    [JF_SELECTATTR] = "selectattr",
    [JF_REJECTATTR] = "rejectattr",
    [JF_MAP] = "map",
    [JF_UNIQUE] = "unique",
};
static const char *const test_names[JT__COUNT] = {
    [JT_DEFINED] = "defined",
    [JT_UNDEFINED] = "undefined",
    [JT_NONE] = "none",
    [JT_TRUE] = "true",
    [JT_FALSE] = "false",
    [JT_BOOLEAN] = "boolean",
    [JT_STRING] = "string",
    [JT_NUMBER] = "number",
    [JT_INTEGER] = "integer",
    [JT_FLOAT] = "float",
    [JT_MAPPING] = "mapping",
    [JT_ITERABLE] = "iterable",
    [JT_SEQUENCE] = "sequence",
    [JT_EQ] = "equalto",
    [JT_NE] = "ne",
    [JT_IN] = "in",
};
static const char *const method_names[JM__COUNT] = {
    [JM_STRIP] = "strip",           [JM_LSTRIP] = "lstrip",     [JM_RSTRIP] = "rstrip",
    [JM_STARTSWITH] = "startswith", [JM_ENDSWITH] = "endswith", [JM_SPLIT] = "split",
    [JM_UPPER] = "upper",           [JM_LOWER] = "lower",       [JM_REPLACE] = "replace",
    [JM_TITLE] = "title",           [JM_ITEMS] = "items",       [JM_KEYS] = "keys",
    [JM_VALUES] = "values",         [JM_GET] = "get",
};
static const char *const func_names[JG__COUNT] = {
    [JG_RAISE_EXCEPTION] = "raise_exception",
    [JG_STRFTIME_NOW] = "strftime_now",
    [JG_NAMESPACE] = "namespace",
    [JG_RANGE] = "range",
    [JG_DICT] = "dict",
};

static int find_name(const char *const *tab, int count, const char *name, size_t n)
{
    for (int i = 0; i < count; i++)
        if (tab[i] && strlen(tab[i]) == n && memcmp(tab[i], name, n) == 0) return i;
    return -1;
}

int jinja_filter_id(const char *name, size_t n)
{
    if (n == 5 && memcmp(name, "count", 5) == 0) return JF_LENGTH;
    if (n == 1 && name[0] == 'd') return JF_DEFAULT;
    return find_name(filter_names, JF__COUNT, name, n);
}

int jinja_test_id(const char *name, size_t n)
{
    if ((n == 2 && memcmp(name, "eq", 2) == 0) || (n == 2 && memcmp(name, "==", 2) == 0))
        return JT_EQ;
    if (n == 2 && memcmp(name, "!=", 2) == 0) return JT_NE;
    return find_name(test_names, JT__COUNT, name, n);
}

int jinja_method_id(const char *name, size_t n)
{
    return find_name(method_names, JM__COUNT, name, n);
}
int jinja_func_id(const char *name, size_t n)
{
    return find_name(func_names, JG__COUNT, name, n);
}
const char *jinja_method_name(int id)
{
    return id >= 0 && id < JM__COUNT ? method_names[id] : "?";
}
const char *jinja_func_name(int id)
{
    return id >= 0 && id < JG__COUNT ? func_names[id] : "?";
}

bool jinja_is_space(uint32_t cp)
{
    if (cp < 0x80) return cp == ' ' || (cp >= 0x09 && cp <= 0x0d) || (cp >= 0x1c && cp <= 0x1f);
    return (pd_uc_class(cp) & PD_UC_S) != 0;
}

/* ---- lexer -------------------------------------------------------------------------- */

typedef enum {
    TK_DATA,
    TK_VAR_BEGIN,
    TK_VAR_END,
    TK_BLOCK_BEGIN,
    TK_BLOCK_END,
    TK_NAME,
    TK_STRING,
    TK_INT,
    TK_FLOAT,
    TK_OP,
    TK_EOF,
} tk_type;

typedef enum {
    OP_ADD,
    OP_SUB,
    OP_DIV,
    OP_FLOORDIV,
    OP_MUL,
    OP_MOD,
    OP_POW,
    OP_TILDE,
    OP_LBRACKET,
    OP_RBRACKET,
    OP_LPAREN,
    OP_RPAREN,
    OP_LBRACE,
    OP_RBRACE,
    OP_EQ,
    OP_NE,
    OP_GT,
    OP_GE,
    OP_LT,
    OP_LE,
    OP_ASSIGN,
    OP_DOT,
    OP_COLON,
    OP_PIPE,
    OP_COMMA,
    OP_SEMICOLON,
} tk_op;

/* Longest first, as jinja2's operator regex. */
static const struct {
    const char *s;
    tk_op op;
} op_table[] = {
    {"//", OP_FLOORDIV}, {"**", OP_POW},   {"==", OP_EQ},      {"!=", OP_NE},      {">=", OP_GE},
    {"<=", OP_LE},       {"+", OP_ADD},    {"-", OP_SUB},      {"/", OP_DIV},      {"*", OP_MUL},
    {"%", OP_MOD},       {"~", OP_TILDE},  {"[", OP_LBRACKET}, {"]", OP_RBRACKET}, {"(", OP_LPAREN},
    {")", OP_RPAREN},    {"{", OP_LBRACE}, {"}", OP_RBRACE},   {">", OP_GT},       {"<", OP_LT},
    {"=", OP_ASSIGN},    {".", OP_DOT},    {":", OP_COLON},    {"|", OP_PIPE},     {",", OP_COMMA},
    {";", OP_SEMICOLON},
};

typedef struct {
    uint8_t type; /* tk_type */
    uint8_t op;   /* tk_op for TK_OP */
    int line;
    const char *p; /* TK_NAME: source text; TK_STRING/TK_DATA: decoded text (arena) */
    size_t n;
    int64_t i;
    double f;
} token;

typedef struct {
    const char *what;
    pd_arena *A;
    token *t;
    size_t n, cap;
} lexer;

static int syntax_error(const char *what, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int syntax_error(const char *what, int line, const char *fmt, ...)
{
    char detail[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    return compile_rc = pd_error(PD_EPARSE, "chat template: %s: line %d: %s", what, line, detail);
}

static int unsupported(const char *construct, const char *name, size_t n, int line)
{
    return compile_rc =
               pd_error(PD_EUNSUPPORTED,
                        "chat template: unsupported %s '%.*s' at line %d; pass --chat-template to "
                        "override",
                        construct, (int)n, name, line);
}

static int push_token(lexer *L, token tk)
{
    if (L->n == L->cap) {
        size_t cap = L->cap ? L->cap * 2 : 256;
        token *t = realloc(L->t, cap * sizeof *t);
        if (!t) return (compile_rc = pd_error(PD_ENOMEM, "chat template: out of memory"));
        L->t = t;
        L->cap = cap;
    }
    L->t[L->n++] = tk;
    return 0;
}

/* Length of the Python-whitespace code point at s[i..n), 0 when not whitespace. */
static size_t space_len(const char *s, size_t i, size_t n)
{
    unsigned char c = (unsigned char)s[i];
    if (c < 0x80) return jinja_is_space(c) ? 1 : 0;
    uint32_t cp;
    bool valid;
    size_t k = pd_utf8_decode((const uint8_t *)s + i, n - i, &cp, &valid);
    return valid && jinja_is_space(cp) ? k : 0;
}

static size_t skip_space(const char *s, size_t i, size_t n)
{
    size_t k;
    while (i < n && (k = space_len(s, i, n)) > 0) i += k;
    return i;
}

/* Length of text after stripping trailing Python whitespace. */
static size_t rstrip_len(const char *s, size_t n)
{
    size_t end = n;
    while (end > 0) {
        size_t start = end - 1;
        while (start > 0 && ((unsigned char)s[start] & 0xC0) == 0x80 && end - start < 4) start--;
        if (space_len(s, start, end) == end - start)
            end = start;
        else
            break;
    }
    return end;
}

static int count_lines(const char *s, size_t a, size_t b)
{
    int k = 0;
    for (size_t i = a; i < b; i++) k += s[i] == '\n';
    return k;
}

static void put_utf8(char *out, size_t *o, uint32_t cp)
{
    if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) cp = 0xFFFD;
    *o += pd_utf8_encode(cp, (uint8_t *)out + *o);
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Decodes the body of a string literal with Python's unicode-escape rules. */
static int decode_string(lexer *L, const char *s, size_t n, int line, token *tk)
{
    char *out = pd_arena_alloc(L->A, n + 1, 1);
    if (!out) return (compile_rc = pd_error(PD_ENOMEM, "chat template: out of memory"));
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        if (s[i] != '\\' || i + 1 >= n) {
            out[o++] = s[i++];
            continue;
        }
        char e = s[i + 1];
        i += 2;
        switch (e) {
        case '\n': break; /* line continuation */
        case '\\': out[o++] = '\\'; break;
        case '\'': out[o++] = '\''; break;
        case '"': out[o++] = '"'; break;
        case 'a': out[o++] = '\a'; break;
        case 'b': out[o++] = '\b'; break;
        case 'f': out[o++] = '\f'; break;
        case 'n': out[o++] = '\n'; break;
        case 'r': out[o++] = '\r'; break;
        case 't': out[o++] = '\t'; break;
        case 'v': out[o++] = '\v'; break;
        case 'x':
        case 'u':
        case 'U': {
            int digits = e == 'x' ? 2 : e == 'u' ? 4 : 8;
            uint32_t cp = 0;
            for (int k = 0; k < digits; k++) {
                int h = i + (size_t)k < n ? hexval(s[i + (size_t)k]) : -1;
                if (h < 0)
                    return syntax_error(L->what, line, "truncated \\%c escape in a string", e);
                cp = cp * 16 + (uint32_t)h;
            }
            i += (size_t)digits;
            if (cp > 0x10FFFF)
                return syntax_error(L->what, line, "illegal Unicode character in a string");
            put_utf8(out, &o, cp);
            break;
        }
        case 'N': return syntax_error(L->what, line, "\\N{...} escapes are not supported");
        default:
            if (e >= '0' && e <= '7') {
                uint32_t cp = (uint32_t)(e - '0');
                for (int k = 0; k < 2 && i < n && s[i] >= '0' && s[i] <= '7'; k++)
                    cp = cp * 8 + (uint32_t)(s[i++] - '0');
                put_utf8(out, &o, cp);
            } else {
                out[o++] = '\\';
                out[o++] = e;
            }
        }
    }
    out[o] = 0;
    tk->p = out;
    tk->n = o;
    return 0;
}

static bool is_digit(char c)
{
    return c >= '0' && c <= '9';
}
static bool is_name_start(unsigned char c)
{
    return c == '_' || ((c | 32) >= 'a' && (c | 32) <= 'z') || c >= 0x80;
}
static bool is_name_char(unsigned char c)
{
    return is_name_start(c) || is_digit((char)c);
}

/* (\d+_)*\d+ at s[i]: returns the end, or i when no digits. */
static size_t scan_digits(const char *s, size_t i, size_t n)
{
    size_t j = i;
    if (j >= n || !is_digit(s[j])) return i;
    while (j < n && is_digit(s[j])) {
        j++;
        if (j + 1 < n && s[j] == '_' && is_digit(s[j + 1])) j++;
    }
    return j;
}

/* Numbers exactly as jinja2's float_re then integer_re. Returns bytes consumed, 0 if none. */
static size_t scan_number(const char *s, size_t i, size_t n, token *tk, const char *what, int line,
                          int *rc)
{
    *rc = 0;
    if (!is_digit(s[i])) return 0;
    char buf[128];
    if (i == 0 || s[i - 1] != '.') {
        size_t j = scan_digits(s, i, n), k = j;
        bool is_float = false;
        if (k < n && s[k] == '.' && k + 1 < n && is_digit(s[k + 1])) {
            k = scan_digits(s, k + 1, n);
            is_float = true;
        }
        if (k < n && (s[k] | 32) == 'e') {
            size_t e = k + 1;
            if (e < n && (s[e] == '+' || s[e] == '-')) e++;
            size_t ee = scan_digits(s, e, n);
            if (ee > e) {
                k = ee;
                is_float = true;
            }
        }
        if (is_float) {
            size_t m = 0;
            for (size_t x = i; x < k && m + 1 < sizeof buf; x++)
                if (s[x] != '_') buf[m++] = s[x];
            buf[m] = 0;
            tk->type = TK_FLOAT;
            tk->f = strtod(buf, NULL);
            return k - i;
        }
    }
    /* integer: 0b / 0o / 0x, [1-9](_?\d)*, 0(_?0)* */
    int base = 10;
    size_t j = i;
    if (s[i] == '0' && i + 2 < n + 1 && i + 1 < n && strchr("bBoOxX", s[i + 1]) && s[i + 1]) {
        char b = (char)(s[i + 1] | 32);
        base = b == 'b' ? 2 : b == 'o' ? 8 : 16;
        size_t k = i + 2, m = 0;
        while (k < n) {
            if (s[k] == '_' && k + 1 < n) k++;
            int h = hexval(s[k]);
            if (h < 0 || h >= base) break;
            if (m + 1 < sizeof buf) buf[m++] = s[k];
            k++;
        }
        if (m == 0)
            base = 10;
        else {
            buf[m] = 0;
            errno = 0;
            unsigned long long v = strtoull(buf, NULL, base);
            if (errno || v > INT64_MAX) {
                *rc = syntax_error(what, line, "integer literal too large");
                return 0;
            }
            tk->type = TK_INT;
            tk->i = (int64_t)v;
            return k - i;
        }
    }
    size_t m = 0;
    if (s[i] == '0') {
        j = i + 1;
        while (j < n) {
            if (s[j] == '0')
                j++;
            else if (s[j] == '_' && j + 1 < n && s[j + 1] == '0')
                j += 2;
            else
                break;
        }
        buf[m++] = '0';
    } else {
        j = i;
        while (j < n) {
            if (is_digit(s[j])) {
                if (m + 1 < sizeof buf) buf[m++] = s[j];
                j++;
            } else if (s[j] == '_' && j + 1 < n && is_digit(s[j + 1]))
                j++;
            else
                break;
        }
    }
    buf[m] = 0;
    errno = 0;
    unsigned long long v = strtoull(buf, NULL, 10);
    if (errno || v > INT64_MAX || m >= sizeof buf - 1) {
        *rc = syntax_error(what, line, "integer literal too large");
        return 0;
    }
    tk->type = TK_INT;
    tk->i = (int64_t)v;
    return j - i;
}

/* Finds the next "{%", "{{" or "{#" at or after pos. */
static size_t find_tag(const char *s, size_t pos, size_t n)
{
    for (size_t i = pos; i + 1 < n; i++) {
        if (s[i] == '{' && (s[i + 1] == '%' || s[i + 1] == '{' || s[i + 1] == '#')) return i;
    }
    return n;
}

static int emit_data(lexer *L, const char *s, size_t n, int line)
{
    if (n == 0) return 0;
    token tk = {.type = TK_DATA, .line = line, .p = s, .n = n};
    return push_token(L, tk);
}

static int lex(lexer *L, const char *s, size_t n)
{
    size_t pos = 0;
    int line = 1;
    bool line_starting = true;
    while (pos < n) {
        size_t at = find_tag(s, pos, n);
        if (at >= n) {
            PD_CHECK(emit_data(L, s + pos, n - pos, line));
            break;
        }
        char kind = s[at + 1];
        char sign = at + 2 < n && (s[at + 2] == '-' || s[at + 2] == '+') ? s[at + 2] : 0;
        size_t tlen = at - pos;
        if (sign == '-') {
            tlen = rstrip_len(s + pos, tlen);
        } else if (sign != '+' && kind != '{') {
            size_t l_pos = 0;
            for (size_t i = tlen; i > 0; i--)
                if (s[pos + i - 1] == '\n') {
                    l_pos = i;
                    break;
                }
            if ((l_pos > 0 || line_starting) && l_pos < tlen &&
                skip_space(s + pos, l_pos, tlen) == tlen)
                tlen = l_pos;
        }
        PD_CHECK(emit_data(L, s + pos, tlen, line));
        line += count_lines(s, pos, at);
        size_t p = at + 2 + (sign ? 1 : 0);
        int tag_line = line;

        if (kind == '#') {
            size_t q = p;
            for (; q + 1 < n; q++) {
                if ((s[q] == '+' || s[q] == '-') && q + 2 < n && s[q + 1] == '#' && s[q + 2] == '}')
                    break;
                if (s[q] == '#' && s[q + 1] == '}') break;
            }
            if (q + 1 >= n) return syntax_error(L->what, tag_line, "missing end of comment tag");
            size_t end;
            if (s[q] == '+')
                end = q + 3;
            else if (s[q] == '-')
                end = skip_space(s, q + 3, n);
            else {
                end = q + 2;
                if (end < n && s[end] == '\n') end++;
            }
            line += count_lines(s, p, end);
            line_starting = s[end - 1] == '\n';
            pos = end;
            continue;
        }

        bool is_block = kind == '%';
        PD_CHECK(push_token(
            L, (token){.type = is_block ? TK_BLOCK_BEGIN : TK_VAR_BEGIN, .line = tag_line}));
        char balance[MAX_DEPTH];
        int depth = 0;
        for (;;) {
            if (p >= n)
                return syntax_error(L->what, line, "unexpected end of template, expected '%s'",
                                    is_block ? "%}" : "}}");
            /* end marker (only when brackets are balanced) */
            if (depth == 0) {
                char close = is_block ? '%' : '}';
                size_t end = 0;
                if (s[p] == '-' && p + 2 < n && s[p + 1] == close && s[p + 2] == '}') {
                    end = skip_space(s, p + 3, n);
                } else if (is_block && s[p] == '+' && p + 2 < n && s[p + 1] == '%' &&
                           s[p + 2] == '}') {
                    end = p + 3;
                } else if (s[p] == close && p + 1 < n && s[p + 1] == '}') {
                    end = p + 2;
                    if (is_block && end < n && s[end] == '\n') end++;
                }
                if (end) {
                    PD_CHECK(push_token(
                        L, (token){.type = is_block ? TK_BLOCK_END : TK_VAR_END, .line = line}));
                    line += count_lines(s, p, end);
                    line_starting = s[end - 1] == '\n';
                    pos = end;
                    break;
                }
            }
            size_t k = space_len(s, p, n);
            if (k) {
                if (s[p] == '\n') line++;
                p += k;
                continue;
            }
            token tk = {.line = line};
            int rc;
            size_t used = scan_number(s, p, n, &tk, L->what, line, &rc);
            if (rc < 0) return rc;
            if (used) {
                PD_CHECK(push_token(L, tk));
                p += used;
                continue;
            }
            if (is_name_start((unsigned char)s[p])) {
                size_t q = p;
                while (q < n && is_name_char((unsigned char)s[q])) q++;
                tk.type = TK_NAME;
                tk.p = s + p;
                tk.n = q - p;
                PD_CHECK(push_token(L, tk));
                p = q;
                continue;
            }
            if (s[p] == '\'' || s[p] == '"') {
                char quote = s[p];
                size_t q = p + 1;
                while (q < n && s[q] != quote) q += s[q] == '\\' && q + 1 < n ? 2 : 1;
                if (q >= n) return syntax_error(L->what, line, "unterminated string");
                tk.type = TK_STRING;
                PD_CHECK(decode_string(L, s + p + 1, q - p - 1, line, &tk));
                line += count_lines(s, p, q);
                PD_CHECK(push_token(L, tk));
                p = q + 1;
                continue;
            }
            size_t o;
            for (o = 0; o < sizeof op_table / sizeof op_table[0]; o++) {
                size_t len = strlen(op_table[o].s);
                if (p + len <= n && memcmp(s + p, op_table[o].s, len) == 0) break;
            }
            if (o == sizeof op_table / sizeof op_table[0])
                return syntax_error(L->what, line, "unexpected character '%c'", s[p]);
            tk_op op = op_table[o].op;
            if (op == OP_LPAREN || op == OP_LBRACKET || op == OP_LBRACE) {
                if (depth >= MAX_DEPTH)
                    return syntax_error(L->what, line, "brackets nested too deeply");
                balance[depth++] = op == OP_LPAREN ? ')' : op == OP_LBRACKET ? ']' : '}';
            } else if (op == OP_RPAREN || op == OP_RBRACKET || op == OP_RBRACE) {
                char c = s[p];
                if (depth == 0) return syntax_error(L->what, line, "unexpected '%c'", c);
                if (balance[--depth] != c)
                    return syntax_error(L->what, line, "unexpected '%c', expected '%c'", c,
                                        balance[depth]);
            }
            tk.type = TK_OP;
            tk.op = (uint8_t)op;
            PD_CHECK(push_token(L, tk));
            p += strlen(op_table[o].s);
        }
    }
    return push_token(L, (token){.type = TK_EOF, .line = line});
}

/* ---- parser ------------------------------------------------------------------------- */

typedef struct {
    const char *what;
    pd_arena *A;
    const token *t;
    size_t i;
    int depth;
    int loops; /* enclosing for loops (break/continue check) */
} parser;

#define CUR(P) (&(P)->t[(P)->i])
#define FAILED ((jnode *)NULL)

static jnode *new_node(parser *P, jnode_kind kind, int line)
{
    jnode *x = pd_arena_calloc(P->A, 1, sizeof *x);
    if (!x) {
        (compile_rc = pd_error(PD_ENOMEM, "chat template: out of memory"));
        return NULL;
    }
    x->kind = (uint8_t)kind;
    x->line = line;
    return x;
}

static bool is_op(const token *tk, tk_op op)
{
    return tk->type == TK_OP && tk->op == op;
}
static bool is_name(const token *tk, const char *name)
{
    return tk->type == TK_NAME && tk->n == strlen(name) && memcmp(tk->p, name, tk->n) == 0;
}

static const char *describe(const token *tk, char *buf, size_t n)
{
    switch (tk->type) {
    case TK_NAME: snprintf(buf, n, "'%.*s'", (int)(tk->n > 40 ? 40 : tk->n), tk->p); break;
    case TK_STRING: snprintf(buf, n, "string"); break;
    case TK_INT:
    case TK_FLOAT: snprintf(buf, n, "number"); break;
    case TK_OP: {
        for (size_t o = 0; o < sizeof op_table / sizeof op_table[0]; o++)
            if (op_table[o].op == tk->op) snprintf(buf, n, "'%s'", op_table[o].s);
        break;
    }
    case TK_VAR_END: snprintf(buf, n, "end of print statement"); break;
    case TK_BLOCK_END: snprintf(buf, n, "end of statement block"); break;
    case TK_EOF: snprintf(buf, n, "end of template"); break;
    default: snprintf(buf, n, "template data"); break;
    }
    return buf;
}

static jnode *fail_unexpected(parser *P, const char *expected)
{
    char b[64];
    if (expected)
        syntax_error(P->what, CUR(P)->line, "expected %s, got %s", expected,
                     describe(CUR(P), b, sizeof b));
    else
        syntax_error(P->what, CUR(P)->line, "unexpected %s", describe(CUR(P), b, sizeof b));
    return NULL;
}

static bool expect_op(parser *P, tk_op op, const char *text)
{
    if (!is_op(CUR(P), op)) {
        char want[16];
        snprintf(want, sizeof want, "'%s'", text);
        fail_unexpected(P, want);
        return false;
    }
    P->i++;
    return true;
}

static bool expect_type(parser *P, tk_type type, const char *text)
{
    if (CUR(P)->type != type) {
        fail_unexpected(P, text);
        return false;
    }
    P->i++;
    return true;
}

static const char *dup_name(parser *P, const token *tk)
{
    char *s = pd_arena_strndup(P->A, tk->p, tk->n);
    if (!s) (compile_rc = pd_error(PD_ENOMEM, "chat template: out of memory"));
    return s;
}

/* Growable node array while parsing (arena-backed). */
typedef struct {
    jnode **v;
    const char **kw;
    int n, cap;
} nodevec;

static bool vec_push(parser *P, nodevec *vec, jnode *x, const char *kw)
{
    if (vec->n == vec->cap) {
        int cap = vec->cap ? vec->cap * 2 : 4;
        jnode **v = pd_arena_alloc(P->A, (size_t)cap * sizeof *v, 0);
        const char **k = pd_arena_alloc(P->A, (size_t)cap * sizeof *k, 0);
        if (!v || !k) {
            (compile_rc = pd_error(PD_ENOMEM, "chat template: out of memory"));
            return false;
        }
        if (vec->n) {
            memcpy(v, vec->v, (size_t)vec->n * sizeof *v);
            memcpy(k, vec->kw, (size_t)vec->n * sizeof *k);
        }
        vec->v = v;
        vec->kw = k;
        vec->cap = cap;
    }
    vec->v[vec->n] = x;
    vec->kw[vec->n] = kw;
    vec->n++;
    return true;
}

static void set_args(jnode *x, const nodevec *vec)
{
    x->args = vec->v;
    x->kw = vec->kw;
    x->nargs = vec->n;
}

static jnode *parse_expression(parser *P, bool with_condexpr);
static jnode *parse_or(parser *P);
static jnode *parse_unary(parser *P, bool with_filter);
static jnode *parse_primary(parser *P);
static jnode *parse_postfix(parser *P, jnode *node);
static jnode *parse_tuple(parser *P, bool with_condexpr, bool explicit_parens,
                          const char *extra_end);

static bool enter(parser *P)
{
    if (++P->depth > MAX_DEPTH) {
        syntax_error(P->what, CUR(P)->line, "template nested too deeply");
        return false;
    }
    return true;
}

/* '(' args ')' : positional and keyword arguments. */
static bool parse_call_args(parser *P, nodevec *vec)
{
    if (!expect_op(P, OP_LPAREN, "(")) return false;
    bool first = true;
    while (!is_op(CUR(P), OP_RPAREN)) {
        if (!first && !expect_op(P, OP_COMMA, ",")) return false;
        if (is_op(CUR(P), OP_RPAREN)) break;
        first = false;
        if (is_op(CUR(P), OP_MUL) || is_op(CUR(P), OP_POW)) {
            syntax_error(P->what, CUR(P)->line, "*args and **kwargs are not supported");
            return false;
        }
        const char *kw = NULL;
        if (CUR(P)->type == TK_NAME && is_op(&P->t[P->i + 1], OP_ASSIGN)) {
            if (!(kw = dup_name(P, CUR(P)))) return false;
            P->i += 2;
        } else {
            for (int k = 0; k < vec->n; k++)
                if (vec->kw[k]) {
                    syntax_error(P->what, CUR(P)->line,
                                 "positional argument follows keyword argument");
                    return false;
                }
        }
        jnode *arg = parse_expression(P, true);
        if (!arg || !vec_push(P, vec, arg, kw)) return false;
    }
    P->i++;
    return true;
}

/* A literal string argument naming a test must be one of the subset. */
static bool check_test_literal(parser *P, const jnode *arg)
{
    if (!arg || arg->kind != JE_CONST || arg->lit.kind != JV_STR) return true;
    if (jinja_test_id(arg->lit.u.s.p, arg->lit.u.s.n) >= 0) return true;
    unsupported("test", arg->lit.u.s.p, arg->lit.u.s.n, arg->line);
    return false;
}

static jnode *parse_filter(parser *P, jnode *node)
{
    int line = CUR(P)->line;
    P->i++; /* '|' */
    const token *nm = CUR(P);
    if (nm->type != TK_NAME) return fail_unexpected(P, "a filter name");
    P->i++;
    size_t nlen = nm->n;
    while (is_op(CUR(P), OP_DOT) && P->t[P->i + 1].type == TK_NAME) {
        nlen = (size_t)(P->t[P->i + 1].p + P->t[P->i + 1].n - nm->p);
        P->i += 2;
    }
    int id = jinja_filter_id(nm->p, nlen);
    if (id < 0) {
        unsupported("filter", nm->p, nlen, nm->line);
        return NULL;
    }
    jnode *x = new_node(P, JE_FILTER, line);
    if (!x) return NULL;
    x->op = id;
    x->a = node;
    nodevec args = {0};
    if (is_op(CUR(P), OP_LPAREN) && !parse_call_args(P, &args)) return NULL;
    set_args(x, &args);
    /* literal test names inside select/reject/selectattr/rejectattr, filter names in map */
    int pos = 0;
    for (int k = 0; k < x->nargs; k++) {
        if (x->kw[k]) continue;
        if (((id == JF_SELECT || id == JF_REJECT) && pos == 0) ||
            ((id == JF_SELECTATTR || id == JF_REJECTATTR) && pos == 1)) {
            if (!check_test_literal(P, x->args[k])) return NULL;
        }
        if (id == JF_MAP && pos == 0 && x->args[k]->kind == JE_CONST &&
            x->args[k]->lit.kind == JV_STR) {
            const jv *s = &x->args[k]->lit;
            int f = jinja_filter_id(s->u.s.p, s->u.s.n);
            if (f < 0 || f == JF_MAP || f == JF_SELECT || f == JF_REJECT || f == JF_SELECTATTR ||
                f == JF_REJECTATTR) {
                unsupported("filter", s->u.s.p, s->u.s.n, x->args[k]->line);
                return NULL;
            }
        }
        pos++;
    }
    return x;
}

static jnode *parse_test(parser *P, jnode *node)
{
    int line = CUR(P)->line;
    P->i++; /* 'is' */
    bool negated = false;
    if (is_name(CUR(P), "not")) {
        negated = true;
        P->i++;
    }
    const token *nm = CUR(P);
    if (nm->type != TK_NAME) return fail_unexpected(P, "a test name");
    P->i++;
    size_t nlen = nm->n;
    while (is_op(CUR(P), OP_DOT) && P->t[P->i + 1].type == TK_NAME) {
        nlen = (size_t)(P->t[P->i + 1].p + P->t[P->i + 1].n - nm->p);
        P->i += 2;
    }
    int id = jinja_test_id(nm->p, nlen);
    if (id < 0) {
        unsupported("test", nm->p, nlen, nm->line);
        return NULL;
    }
    jnode *x = new_node(P, JE_TEST, line);
    if (!x) return NULL;
    x->op = id;
    x->a = node;
    nodevec args = {0};
    const token *c = CUR(P);
    if (is_op(c, OP_LPAREN)) {
        if (!parse_call_args(P, &args)) return NULL;
    } else if ((c->type == TK_NAME || c->type == TK_STRING || c->type == TK_INT ||
                c->type == TK_FLOAT || is_op(c, OP_LBRACKET) || is_op(c, OP_LBRACE)) &&
               !is_name(c, "else") && !is_name(c, "or") && !is_name(c, "and")) {
        if (is_name(c, "is")) {
            syntax_error(P->what, c->line, "You cannot chain multiple tests with is");
            return NULL;
        }
        jnode *arg = parse_primary(P);
        if (arg) arg = parse_postfix(P, arg);
        if (!arg || !vec_push(P, &args, arg, NULL)) return NULL;
    }
    set_args(x, &args);
    if (negated) {
        jnode *n = new_node(P, JE_NOT, line);
        if (!n) return NULL;
        n->a = x;
        return n;
    }
    return x;
}

static jnode *parse_call(parser *P, jnode *callee)
{
    int line = CUR(P)->line;
    jnode *x = new_node(P, JE_CALL, line);
    if (!x) return NULL;
    if (callee->kind == JE_NAME) {
        int id = jinja_func_id(callee->name, strlen(callee->name));
        if (id < 0) {
            unsupported("function", callee->name, strlen(callee->name), callee->line);
            return NULL;
        }
    } else if (callee->kind == JE_GETATTR) {
        if (callee->method < 0) {
            unsupported("method", callee->name, strlen(callee->name), callee->line);
            return NULL;
        }
    } /* anything else is checked when called (only functions and methods are callable) */
    x->a = callee;
    nodevec args = {0};
    if (!parse_call_args(P, &args)) return NULL;
    set_args(x, &args);
    return x;
}

/* One subscript item: an expression or a slice [start]:[stop][:step]. */
static jnode *parse_subscribed(parser *P)
{
    int line = CUR(P)->line;
    jnode *parts[3] = {NULL, NULL, NULL};
    if (!is_op(CUR(P), OP_COLON)) {
        if (!(parts[0] = parse_expression(P, true))) return NULL;
        if (!is_op(CUR(P), OP_COLON)) return parts[0];
    }
    P->i++; /* ':' */
    if (!is_op(CUR(P), OP_RBRACKET) && !is_op(CUR(P), OP_COMMA) && !is_op(CUR(P), OP_COLON)) {
        if (!(parts[1] = parse_expression(P, true))) return NULL;
    }
    if (is_op(CUR(P), OP_COLON)) {
        P->i++;
        if (!is_op(CUR(P), OP_RBRACKET) && !is_op(CUR(P), OP_COMMA)) {
            if (!(parts[2] = parse_expression(P, true))) return NULL;
        }
    }
    jnode *x = new_node(P, JE_SLICE, line);
    if (!x) return NULL;
    x->b = parts[0];
    x->c = parts[1];
    x->d = parts[2];
    return x;
}

/* node[...]: one item is an index or a slice; none or several make a tuple key (jinja2). */
static jnode *parse_subscript(parser *P, jnode *node)
{
    int line = CUR(P)->line;
    P->i++; /* '[' */
    nodevec items = {0};
    while (!is_op(CUR(P), OP_RBRACKET)) {
        if (items.n && !expect_op(P, OP_COMMA, ",")) return NULL;
        jnode *e = parse_subscribed(P);
        if (!e || !vec_push(P, &items, e, NULL)) return NULL;
    }
    P->i++;
    if (items.n == 1 && items.v[0]->kind == JE_SLICE && !items.v[0]->a) {
        items.v[0]->a = node;
        return items.v[0];
    }
    jnode *x = new_node(P, JE_GETITEM, line);
    if (!x) return NULL;
    x->a = node;
    if (items.n == 1) {
        x->b = items.v[0];
        return x;
    }
    for (int k = 0; k < items.n; k++)
        if (items.v[k]->kind == JE_SLICE) {
            syntax_error(P->what, line, "slices inside a tuple subscript are not supported");
            return NULL;
        }
    jnode *key = new_node(P, JE_TUPLE, line);
    if (!key) return NULL;
    set_args(key, &items);
    x->b = key;
    return x;
}

static jnode *parse_postfix(parser *P, jnode *node)
{
    while (node) {
        const token *c = CUR(P);
        if (is_op(c, OP_DOT)) {
            const token *nx = &P->t[P->i + 1];
            if (nx->type == TK_NAME) {
                jnode *x = new_node(P, JE_GETATTR, c->line);
                if (!x || !(x->name = dup_name(P, nx))) return NULL;
                x->name_n = nx->n;
                x->method = jinja_method_id(nx->p, nx->n);
                x->a = node;
                P->i += 2;
                node = x;
            } else if (nx->type == TK_INT) {
                jnode *k = new_node(P, JE_CONST, nx->line);
                jnode *x = new_node(P, JE_GETITEM, c->line);
                if (!k || !x) return NULL;
                k->lit = (jv){.kind = JV_INT, .u.i = nx->i};
                x->a = node;
                x->b = k;
                P->i += 2;
                node = x;
            } else {
                P->i++;
                return fail_unexpected(P, "an attribute name");
            }
        } else if (is_op(c, OP_LBRACKET)) {
            node = parse_subscript(P, node);
        } else if (is_op(c, OP_LPAREN)) {
            node = parse_call(P, node);
        } else {
            break;
        }
    }
    return node;
}

static jnode *parse_filter_expr(parser *P, jnode *node)
{
    while (node) {
        const token *c = CUR(P);
        if (is_op(c, OP_PIPE))
            node = parse_filter(P, node);
        else if (is_name(c, "is"))
            node = parse_test(P, node);
        else if (is_op(c, OP_LPAREN))
            node = parse_call(P, node);
        else
            break;
    }
    return node;
}

static jnode *parse_list(parser *P)
{
    jnode *x = new_node(P, JE_LIST, CUR(P)->line);
    if (!x) return NULL;
    P->i++;
    nodevec items = {0};
    while (!is_op(CUR(P), OP_RBRACKET)) {
        if (items.n && !expect_op(P, OP_COMMA, ",")) return NULL;
        if (is_op(CUR(P), OP_RBRACKET)) break;
        jnode *e = parse_expression(P, true);
        if (!e || !vec_push(P, &items, e, NULL)) return NULL;
    }
    P->i++;
    set_args(x, &items);
    return x;
}

static jnode *parse_dict(parser *P)
{
    jnode *x = new_node(P, JE_DICT, CUR(P)->line);
    if (!x) return NULL;
    P->i++;
    nodevec items = {0};
    while (!is_op(CUR(P), OP_RBRACE)) {
        if (items.n && !expect_op(P, OP_COMMA, ",")) return NULL;
        if (is_op(CUR(P), OP_RBRACE)) break;
        jnode *k = parse_expression(P, true);
        if (!k || !expect_op(P, OP_COLON, ":")) return NULL;
        jnode *v = parse_expression(P, true);
        if (!v || !vec_push(P, &items, k, NULL) || !vec_push(P, &items, v, NULL)) return NULL;
    }
    P->i++;
    set_args(x, &items);
    return x;
}

static jnode *parse_primary(parser *P)
{
    const token *c = CUR(P);
    jnode *x;
    switch (c->type) {
    case TK_NAME:
        if (!(x = new_node(P, JE_CONST, c->line))) return NULL;
        if (is_name(c, "true") || is_name(c, "True"))
            x->lit = (jv){.kind = JV_BOOL, .u.b = true};
        else if (is_name(c, "false") || is_name(c, "False"))
            x->lit = (jv){.kind = JV_BOOL, .u.b = false};
        else if (is_name(c, "none") || is_name(c, "None"))
            x->lit = (jv){.kind = JV_NONE};
        else {
            x->kind = JE_NAME;
            if (!(x->name = dup_name(P, c))) return NULL;
            x->name_n = c->n;
        }
        P->i++;
        return x;
    case TK_STRING: {
        if (!(x = new_node(P, JE_CONST, c->line))) return NULL;
        size_t total = 0, k = P->i;
        while (P->t[k].type == TK_STRING) total += P->t[k++].n;
        char *buf = pd_arena_alloc(P->A, total + 1, 1);
        if (!buf) {
            (compile_rc = pd_error(PD_ENOMEM, "chat template: out of memory"));
            return NULL;
        }
        size_t o = 0;
        while (CUR(P)->type == TK_STRING) {
            memcpy(buf + o, CUR(P)->p, CUR(P)->n);
            o += CUR(P)->n;
            P->i++;
        }
        buf[o] = 0;
        x->lit = (jv){.kind = JV_STR, .u.s = {buf, o}};
        return x;
    }
    case TK_INT:
    case TK_FLOAT:
        if (!(x = new_node(P, JE_CONST, c->line))) return NULL;
        x->lit = c->type == TK_INT ? (jv){.kind = JV_INT, .u.i = c->i}
                                   : (jv){.kind = JV_FLOAT, .u.f = c->f};
        P->i++;
        return x;
    case TK_OP:
        if (c->op == OP_LPAREN) {
            P->i++;
            x = parse_tuple(P, true, true, NULL);
            if (!x || !expect_op(P, OP_RPAREN, ")")) return NULL;
            return x;
        }
        if (c->op == OP_LBRACKET) return parse_list(P);
        if (c->op == OP_LBRACE) return parse_dict(P);
        break;
    default: break;
    }
    return fail_unexpected(P, NULL);
}

static jnode *parse_unary(parser *P, bool with_filter)
{
    if (!enter(P)) return NULL;
    const token *c = CUR(P);
    jnode *node;
    if (is_op(c, OP_SUB) || is_op(c, OP_ADD)) {
        P->i++;
        jnode *operand = parse_unary(P, false);
        if (!operand) return NULL;
        if (!(node = new_node(P, is_op(c, OP_SUB) ? JE_NEG : JE_POS, c->line))) return NULL;
        node->a = operand;
    } else {
        node = parse_primary(P);
    }
    node = parse_postfix(P, node);
    if (with_filter) node = parse_filter_expr(P, node);
    P->depth--;
    return node;
}

static jnode *binary(parser *P, jnode_kind kind, int op, jnode *l, jnode *r, int line)
{
    if (!l || !r) return NULL;
    jnode *x = new_node(P, kind, line);
    if (!x) return NULL;
    x->op = op;
    x->a = l;
    x->b = r;
    return x;
}

static jnode *parse_pow(parser *P)
{
    jnode *left = parse_unary(P, true);
    while (left && is_op(CUR(P), OP_POW)) {
        int line = CUR(P)->line;
        P->i++;
        left = binary(P, JE_BIN, JOP_POW, left, parse_unary(P, true), line);
    }
    return left;
}

static jnode *parse_math2(parser *P)
{
    jnode *left = parse_pow(P);
    while (left) {
        const token *c = CUR(P);
        int op;
        if (is_op(c, OP_MUL))
            op = JOP_MUL;
        else if (is_op(c, OP_DIV))
            op = JOP_DIV;
        else if (is_op(c, OP_FLOORDIV))
            op = JOP_FLOORDIV;
        else if (is_op(c, OP_MOD))
            op = JOP_MOD;
        else
            break;
        P->i++;
        left = binary(P, JE_BIN, op, left, parse_pow(P), c->line);
    }
    return left;
}

static jnode *parse_concat(parser *P)
{
    int line = CUR(P)->line;
    jnode *first = parse_math2(P);
    if (!first || !is_op(CUR(P), OP_TILDE)) return first;
    nodevec parts = {0};
    if (!vec_push(P, &parts, first, NULL)) return NULL;
    while (is_op(CUR(P), OP_TILDE)) {
        P->i++;
        jnode *e = parse_math2(P);
        if (!e || !vec_push(P, &parts, e, NULL)) return NULL;
    }
    jnode *x = new_node(P, JE_CONCAT, line);
    if (!x) return NULL;
    set_args(x, &parts);
    return x;
}

static jnode *parse_math1(parser *P)
{
    jnode *left = parse_concat(P);
    while (left && (is_op(CUR(P), OP_ADD) || is_op(CUR(P), OP_SUB))) {
        const token *c = CUR(P);
        P->i++;
        left =
            binary(P, JE_BIN, is_op(c, OP_ADD) ? JOP_ADD : JOP_SUB, left, parse_concat(P), c->line);
    }
    return left;
}

static jnode *parse_compare(parser *P)
{
    int line = CUR(P)->line;
    jnode *expr = parse_math1(P);
    if (!expr) return NULL;
    nodevec operands = {0};
    int ops[64], nops = 0;
    for (;;) {
        const token *c = CUR(P);
        int op;
        if (is_op(c, OP_EQ))
            op = JOP_EQ;
        else if (is_op(c, OP_NE))
            op = JOP_NE;
        else if (is_op(c, OP_LT))
            op = JOP_LT;
        else if (is_op(c, OP_LE))
            op = JOP_LE;
        else if (is_op(c, OP_GT))
            op = JOP_GT;
        else if (is_op(c, OP_GE))
            op = JOP_GE;
        else if (is_name(c, "in"))
            op = JOP_IN;
        else if (is_name(c, "not") && is_name(&P->t[P->i + 1], "in")) {
            op = JOP_NOTIN;
            P->i++;
        } else
            break;
        P->i++;
        if (nops == 64) {
            syntax_error(P->what, c->line, "too many chained comparisons");
            return NULL;
        }
        jnode *r = parse_math1(P);
        if (!r || !vec_push(P, &operands, r, NULL)) return NULL;
        ops[nops++] = op;
    }
    if (!nops) return expr;
    jnode *x = new_node(P, JE_COMPARE, line);
    if (!x) return NULL;
    x->a = expr;
    set_args(x, &operands);
    x->ops = pd_arena_alloc(P->A, (size_t)nops * sizeof(int), 0);
    if (!x->ops) {
        (compile_rc = pd_error(PD_ENOMEM, "chat template: out of memory"));
        return NULL;
    }
    memcpy(x->ops, ops, (size_t)nops * sizeof(int));
    return x;
}

static jnode *parse_not(parser *P)
{
    if (is_name(CUR(P), "not")) {
        int line = CUR(P)->line;
        P->i++;
        if (!enter(P)) return NULL;
        jnode *operand = parse_not(P);
        P->depth--;
        if (!operand) return NULL;
        jnode *x = new_node(P, JE_NOT, line);
        if (x) x->a = operand;
        return x;
    }
    return parse_compare(P);
}

static jnode *parse_and(parser *P)
{
    jnode *left = parse_not(P);
    while (left && is_name(CUR(P), "and")) {
        int line = CUR(P)->line;
        P->i++;
        left = binary(P, JE_AND, 0, left, parse_not(P), line);
    }
    return left;
}

static jnode *parse_or(parser *P)
{
    jnode *left = parse_and(P);
    while (left && is_name(CUR(P), "or")) {
        int line = CUR(P)->line;
        P->i++;
        left = binary(P, JE_OR, 0, left, parse_and(P), line);
    }
    return left;
}

static jnode *parse_condexpr(parser *P)
{
    if (!enter(P)) return NULL;
    int line = CUR(P)->line;
    jnode *expr1 = parse_or(P);
    while (expr1 && is_name(CUR(P), "if")) {
        P->i++;
        jnode *expr2 = parse_or(P), *expr3 = NULL;
        if (!expr2) return NULL;
        if (is_name(CUR(P), "else")) {
            P->i++;
            if (!(expr3 = parse_condexpr(P))) return NULL;
        }
        jnode *x = new_node(P, JE_COND, line);
        if (!x) return NULL;
        x->a = expr2;
        x->b = expr1;
        x->c = expr3;
        expr1 = x;
        line = CUR(P)->line;
    }
    P->depth--;
    return expr1;
}

static jnode *parse_expression(parser *P, bool with_condexpr)
{
    return with_condexpr ? parse_condexpr(P) : parse_or(P);
}

static bool is_tuple_end(parser *P, const char *extra_end)
{
    const token *c = CUR(P);
    if (c->type == TK_VAR_END || c->type == TK_BLOCK_END || is_op(c, OP_RPAREN)) return true;
    return extra_end && is_name(c, extra_end);
}

static jnode *parse_tuple(parser *P, bool with_condexpr, bool explicit_parens,
                          const char *extra_end)
{
    int line = CUR(P)->line;
    nodevec items = {0};
    bool is_tuple = false;
    for (;;) {
        if (items.n && !expect_op(P, OP_COMMA, ",")) return NULL;
        if (is_tuple_end(P, extra_end)) break;
        jnode *e = parse_expression(P, with_condexpr);
        if (!e || !vec_push(P, &items, e, NULL)) return NULL;
        if (is_op(CUR(P), OP_COMMA))
            is_tuple = true;
        else
            break;
    }
    if (!is_tuple) {
        if (items.n) return items.v[0];
        if (!explicit_parens) return fail_unexpected(P, "an expression");
    }
    jnode *x = new_node(P, JE_TUPLE, line);
    if (!x) return NULL;
    set_args(x, &items);
    return x;
}

/* ---- statements --------------------------------------------------------------------- */

static jnode *parse_body(parser *P, const char *const *ends, int *which);

static bool expect_block_end(parser *P)
{
    return expect_type(P, TK_BLOCK_END, "end of statement block");
}

/* Target names: NAME or NAME, NAME... (optionally in parentheses). */
static bool parse_targets(parser *P, jnode *x)
{
    bool parens = false;
    if (is_op(CUR(P), OP_LPAREN)) {
        parens = true;
        P->i++;
    }
    const char *names[16];
    int n = 0;
    for (;;) {
        if (CUR(P)->type != TK_NAME) {
            fail_unexpected(P, "a variable name");
            return false;
        }
        if (n == 16) {
            syntax_error(P->what, CUR(P)->line, "too many assignment targets");
            return false;
        }
        if (!(names[n++] = dup_name(P, CUR(P)))) return false;
        P->i++;
        if (!is_op(CUR(P), OP_COMMA)) break;
        P->i++;
        if (!parens && (is_name(CUR(P), "in") || is_op(CUR(P), OP_ASSIGN))) break;
        if (parens && is_op(CUR(P), OP_RPAREN)) break;
    }
    if (parens && !expect_op(P, OP_RPAREN, ")")) return false;
    x->names = pd_arena_alloc(P->A, (size_t)n * sizeof *x->names, 0);
    if (!x->names) {
        (compile_rc = pd_error(PD_ENOMEM, "chat template: out of memory"));
        return false;
    }
    memcpy(x->names, names, (size_t)n * sizeof *names);
    x->op = n;
    return true;
}

static jnode *parse_if(parser *P, int line)
{
    jnode *x = new_node(P, JS_IF, line);
    if (!x) return NULL;
    if (!(x->a = parse_tuple(P, false, false, NULL)) || !expect_block_end(P)) return NULL;
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    int which;
    x->b = parse_body(P, ends, &which);
    if (which < 0) return NULL;
    int tline = CUR(P)->line;
    P->i++; /* the end name */
    if (which == 0) {
        x->c = parse_if(P, tline);
        return x->c ? x : NULL;
    }
    if (which == 1) {
        if (!expect_block_end(P)) return NULL;
        static const char *const ends2[] = {"endif", NULL};
        x->c = parse_body(P, ends2, &which);
        if (which < 0) return NULL;
        P->i++;
    }
    return expect_block_end(P) ? x : NULL;
}

static jnode *parse_for(parser *P, int line)
{
    jnode *x = new_node(P, JS_FOR, line);
    if (!x || !parse_targets(P, x)) return NULL;
    if (!is_name(CUR(P), "in")) return fail_unexpected(P, "'in'");
    P->i++;
    if (!(x->a = parse_tuple(P, false, false, "recursive"))) return NULL;
    if (is_name(CUR(P), "if")) {
        P->i++;
        if (!(x->d = parse_expression(P, true))) return NULL;
    }
    if (is_name(CUR(P), "recursive")) {
        unsupported("loop modifier", "recursive", 9, CUR(P)->line);
        return NULL;
    }
    if (!expect_block_end(P)) return NULL;
    static const char *const ends[] = {"endfor", "else", NULL};
    int which;
    P->loops++;
    x->b = parse_body(P, ends, &which);
    P->loops--;
    if (which < 0) return NULL;
    P->i++;
    if (which == 1) {
        if (!expect_block_end(P)) return NULL;
        static const char *const ends2[] = {"endfor", NULL};
        x->c = parse_body(P, ends2, &which);
        if (which < 0) return NULL;
        P->i++;
    }
    return expect_block_end(P) ? x : NULL;
}

static jnode *parse_set(parser *P, int line)
{
    jnode *x = new_node(P, JS_SET, line);
    if (!x) return NULL;
    if (CUR(P)->type == TK_NAME && is_op(&P->t[P->i + 1], OP_DOT) &&
        P->t[P->i + 2].type == TK_NAME) {
        x->kind = JS_SET_ATTR;
        x->op = 1;
        x->names = pd_arena_alloc(P->A, sizeof *x->names, 0);
        if (!x->names || !(x->names[0] = dup_name(P, CUR(P))) ||
            !(x->name = dup_name(P, &P->t[P->i + 2])))
            return NULL;
        x->name_n = P->t[P->i + 2].n;
        P->i += 3;
    } else if (!parse_targets(P, x)) {
        return NULL;
    }
    if (is_op(CUR(P), OP_ASSIGN)) {
        P->i++;
        if (!(x->a = parse_tuple(P, true, false, NULL)) || !expect_block_end(P)) return NULL;
        return x;
    }
    if (x->kind == JS_SET_ATTR || x->op != 1) return fail_unexpected(P, "'='");
    if (is_op(CUR(P), OP_PIPE)) {
        unsupported("filter", "set block filter", 16, CUR(P)->line);
        return NULL;
    }
    if (!expect_block_end(P)) return NULL;
    x->kind = JS_SET_BLOCK;
    static const char *const ends[] = {"endset", NULL};
    int which;
    x->b = parse_body(P, ends, &which);
    if (which < 0) return NULL;
    P->i++;
    return expect_block_end(P) ? x : NULL;
}

static jnode *parse_statement(parser *P)
{
    const token *nm = CUR(P);
    if (nm->type != TK_NAME) return fail_unexpected(P, "a statement name");
    int line = nm->line;
    P->i++;
    if (!enter(P)) return NULL;
    jnode *x = NULL;
    if (is_name(nm, "if"))
        x = parse_if(P, line);
    else if (is_name(nm, "for"))
        x = parse_for(P, line);
    else if (is_name(nm, "set"))
        x = parse_set(P, line);
    else if (is_name(nm, "break") || is_name(nm, "continue")) {
        if (P->loops == 0) {
            syntax_error(P->what, line, "'%.*s' outside of a loop", (int)nm->n, nm->p);
            return NULL;
        }
        x = new_node(P, is_name(nm, "break") ? JS_BREAK : JS_CONTINUE, line);
        if (x && !expect_block_end(P)) return NULL;
    } else if (is_name(nm, "generation")) {
        if (!expect_block_end(P)) return NULL;
        x = new_node(P, JS_GENERATION, line);
        static const char *const ends[] = {"endgeneration", NULL};
        int which;
        if (!x) return NULL;
        x->b = parse_body(P, ends, &which);
        if (which < 0) return NULL;
        P->i++;
        if (!expect_block_end(P)) return NULL;
    } else if ((nm->n >= 3 && memcmp(nm->p, "end", 3) == 0) || is_name(nm, "elif") ||
               is_name(nm, "else")) {
        syntax_error(P->what, line, "unexpected '%.*s'", (int)nm->n, nm->p);
        return NULL;
    } else {
        unsupported("tag", nm->p, nm->n, line);
        return NULL;
    }
    P->depth--;
    return x;
}

/* Statements until EOF (ends == NULL) or a block whose name is in ends; *which is the index
 * of that name (the parser stays on it), -1 on error. Returns the first statement. */
static jnode *parse_body(parser *P, const char *const *ends, int *which)
{
    jnode *head = NULL, **tail = &head;
    *which = -1;
    for (;;) {
        const token *c = CUR(P);
        jnode *x = NULL;
        if (c->type == TK_EOF) {
            if (ends) {
                syntax_error(P->what, c->line, "unexpected end of template, expected '%s'",
                             ends[0]);
                return NULL;
            }
            *which = 0;
            return head;
        }
        if (c->type == TK_DATA) {
            if (!(x = new_node(P, JS_TEXT, c->line))) return NULL;
            x->lit = (jv){.kind = JV_STR, .u.s = {c->p, c->n}};
            P->i++;
        } else if (c->type == TK_VAR_BEGIN) {
            P->i++;
            if (!(x = new_node(P, JS_PRINT, c->line))) return NULL;
            if (!(x->a = parse_tuple(P, true, false, NULL))) return NULL;
            if (!expect_type(P, TK_VAR_END, "end of print statement")) return NULL;
        } else if (c->type == TK_BLOCK_BEGIN) {
            P->i++;
            if (ends) {
                for (int k = 0; ends[k]; k++)
                    if (is_name(CUR(P), ends[k])) {
                        *which = k;
                        return head;
                    }
            }
            if (!(x = parse_statement(P))) return NULL;
        } else {
            return fail_unexpected(P, NULL);
        }
        *tail = x;
        tail = &x->next;
    }
}

int jinja_compile(const char *source, const char *what, jinja_program *prog)
{
    memset(prog, 0, sizeof *prog);
    if (!what) what = "template";
    size_t n = strlen(source);
    pd_arena *A = pd_arena_create(16384);
    if (!A) return (compile_rc = pd_error(PD_ENOMEM, "chat template: out of memory"));
    /* newlines -> "\n", one trailing newline dropped (keep_trailing_newline off) */
    char *src = pd_arena_alloc(A, n + 1, 1);
    if (!src) {
        pd_arena_free(A);
        return (compile_rc = pd_error(PD_ENOMEM, "chat template: out of memory"));
    }
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        if (source[i] == '\r') {
            src[m++] = '\n';
            if (i + 1 < n && source[i + 1] == '\n') i++;
        } else {
            src[m++] = source[i];
        }
    }
    if (m > 0 && src[m - 1] == '\n') m--;
    src[m] = 0;

    compile_rc = 0;
    lexer L = {.what = what, .A = A};
    int rc = lex(&L, src, m);
    if (rc == 0) {
        parser P = {.what = what, .A = A, .t = L.t};
        int which;
        jnode *body = parse_body(&P, NULL, &which);
        if (which < 0)
            rc = compile_rc < 0 ? compile_rc : PD_EPARSE;
        else
            prog->body = body;
    }
    free(L.t);
    if (rc < 0) {
        pd_arena_free(A);
        return rc;
    }
    prog->arena = A;
    return 0;
}
