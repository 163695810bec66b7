/* Tool-call parsers (see tool_parser.h).
 *
 * Design: one JSON scanner serves both modes. It reads a prefix of the model's text and writes
 * the Python json.dumps form of what that prefix fixes (scan_value); a call object is scanned
 * for its "name" and its arguments value (scan_call). Whole text = the scanner with the input
 * final; streaming = the same scan over everything seen so far after each delta, and what was
 * not sent yet of each call is the delta. Rescanning is linear in the call's text per delta, and
 * the buffers are reused, so a stream allocates only while they grow.
 */
#include "tokenizer/tool_parser.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/fmt.h"
#include "util/status.h"

/* ---- a growable byte buffer ------------------------------------------------------------- */

typedef struct {
    char *p; /* (cap,) NUL-terminated at len when non-NULL */
    size_t len, cap;
    bool oom;
} tbuf;

static void tb_add(tbuf *b, const char *s, size_t n)
{
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->len + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void tb_str(tbuf *b, const char *s)
{
    tb_add(b, s, strlen(s));
}

static void tb_free(tbuf *b)
{
    free(b->p);
    memset(b, 0, sizeof *b);
}

static char *tb_take(tbuf *b)
{
    char *p = b->p ? b->p : strdup("");
    memset(b, 0, sizeof *b);
    return p;
}

/* ---- the JSON scanner --------------------------------------------------------------------- */

enum { SC_DONE = 0, SC_MORE = 1, SC_BAD = -1 };
#define MAX_DEPTH 512

typedef struct {
    const char *s;
    size_t n, i;
    bool final; /* the input ends here for good */
} scan;

static bool is_ws(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

static void skip_ws(scan *c)
{
    while (c->i < c->n && is_ws(c->s[c->i])) c->i++;
}

static int hexval(char h)
{
    if (h >= '0' && h <= '9') return h - '0';
    if (h >= 'a' && h <= 'f') return h - 'a' + 10;
    if (h >= 'A' && h <= 'F') return h - 'A' + 10;
    return -1;
}

/* \uXXXX at s (6 bytes available); -1 when not one. */
static long u_escape(const char *s)
{
    if (s[0] != '\\' || s[1] != 'u') return -1;
    long v = 0;
    for (int k = 2; k < 6; k++) {
        int h = hexval(s[k]);
        if (h < 0) return -1;
        v = v * 16 + h;
    }
    return v;
}

static void put_utf8(tbuf *b, long cp)
{
    char u[4];
    size_t n;
    if (cp < 0x80) {
        u[0] = (char)cp;
        n = 1;
    } else if (cp < 0x800) {
        u[0] = (char)(0xC0 | (cp >> 6));
        u[1] = (char)(0x80 | (cp & 0x3F));
        n = 2;
    } else if (cp < 0x10000) {
        u[0] = (char)(0xE0 | (cp >> 12));
        u[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        u[2] = (char)(0x80 | (cp & 0x3F));
        n = 3;
    } else {
        u[0] = (char)(0xF0 | (cp >> 18));
        u[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
        u[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
        u[3] = (char)(0x80 | (cp & 0x3F));
        n = 4;
    }
    tb_add(b, u, n);
}

/* Code point cp inside a string as json.dumps(ensure_ascii=False) writes it (py) or as the
 * decoded text (!py). A lone surrogate stays an escape in both. */
static void put_char(tbuf *b, long cp, bool py)
{
    static const char *const esc[32] = {
        [8] = "\\b", [9] = "\\t", [10] = "\\n", [12] = "\\f", [13] = "\\r"};
    char e[24];
    if (cp >= 0xD800 && cp <= 0xDFFF) {
        snprintf(e, sizeof e, "\\u%04lx", cp);
        tb_str(b, e);
    } else if (!py) {
        put_utf8(b, cp);
    } else if (cp == '"') {
        tb_str(b, "\\\"");
    } else if (cp == '\\') {
        tb_str(b, "\\\\");
    } else if (cp < 0x20) {
        if (esc[cp]) {
            tb_str(b, esc[cp]);
        } else {
            snprintf(e, sizeof e, "\\u%04lx", cp);
            tb_str(b, e);
        }
    } else {
        put_utf8(b, cp);
    }
}

/* Length of the UTF-8 sequence led by byte c, 0 when c cannot lead one. */
static size_t utf8_len(unsigned char c)
{
    return c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
}

/* A string at c->i (on its '"'); its characters to out (py: json.dumps form with quotes;
 * !py: decoded, no quotes) as far as the input holds them whole. */
static int scan_string(scan *c, tbuf *out, bool py)
{
    c->i++; /* '"' */
    if (out && py) tb_add(out, "\"", 1);
    while (c->i < c->n) {
        unsigned char ch = (unsigned char)c->s[c->i];
        if (ch == '"') {
            c->i++;
            if (out && py) tb_add(out, "\"", 1);
            return SC_DONE;
        }
        if (ch < 0x20) return SC_BAD; /* json.loads is strict */
        if (ch == '\\') {
            if (c->i + 1 >= c->n) return SC_MORE;
            char e = c->s[c->i + 1];
            long cp;
            size_t used = 2;
            if (e == 'u') {
                if (c->i + 6 > c->n) return SC_MORE;
                cp = u_escape(c->s + c->i);
                if (cp < 0) return SC_BAD;
                used = 6;
                if (cp >= 0xD800 && cp <= 0xDBFF) { /* a pair when a low surrogate follows */
                    if (c->i + 12 > c->n) {
                        size_t have = c->n - c->i - 6;
                        if (memcmp(c->s + c->i + 6, "\\u", have < 2 ? have : 2) == 0)
                            return SC_MORE;
                    } else {
                        long lo = u_escape(c->s + c->i + 6);
                        if (lo >= 0xDC00 && lo <= 0xDFFF) {
                            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                            used = 12;
                        }
                    }
                }
            } else {
                const char *from = "\"\\/bfnrt", *to = "\"\\/\b\f\n\r\t";
                const char *at = strchr(from, e);
                if (!at || !e) return SC_BAD;
                cp = (unsigned char)to[at - from];
            }
            if (out) put_char(out, cp, py);
            c->i += used;
            continue;
        }
        size_t k = utf8_len(ch);
        if (!k) return SC_BAD;
        if (c->i + k > c->n) return SC_MORE; /* a character split by the delta: wait for it */
        if (out) tb_add(out, c->s + c->i, k);
        c->i += k;
    }
    return SC_MORE;
}

/* A number at c->i: written (Python form) only once it is followed by something else or the
 * input is final. */
static int scan_number(scan *c, tbuf *out)
{
    size_t st = c->i, i = c->i;
    bool real = false;
    if (i < c->n && c->s[i] == '-') i++;
    if (i >= c->n) return c->final ? SC_BAD : SC_MORE;
    if (c->s[i] == '0') {
        i++;
    } else if (c->s[i] >= '1' && c->s[i] <= '9') {
        while (i < c->n && c->s[i] >= '0' && c->s[i] <= '9') i++;
    } else {
        return SC_BAD;
    }
    if (i < c->n && c->s[i] == '.') {
        real = true;
        size_t d = ++i;
        while (i < c->n && c->s[i] >= '0' && c->s[i] <= '9') i++;
        if (i == d) return i >= c->n && !c->final ? SC_MORE : SC_BAD;
    }
    if (i < c->n && (c->s[i] == 'e' || c->s[i] == 'E')) {
        real = true;
        i++;
        if (i < c->n && (c->s[i] == '+' || c->s[i] == '-')) i++;
        size_t d = i;
        while (i < c->n && c->s[i] >= '0' && c->s[i] <= '9') i++;
        if (i == d) return i >= c->n && !c->final ? SC_MORE : SC_BAD;
    }
    if (i >= c->n && !c->final) return SC_MORE; /* more digits may follow */
    c->i = i;
    if (!out) return SC_DONE;
    if (real) {
        char tmp[64], num[40];
        size_t len = i - st < sizeof tmp - 1 ? i - st : sizeof tmp - 1;
        memcpy(tmp, c->s + st, len);
        tmp[len] = '\0';
        pd_fmt_double(strtod(tmp, NULL), num, sizeof num);
        tb_str(out, num);
    } else if (i - st == 2 && c->s[st] == '-' && c->s[st + 1] == '0') {
        tb_str(out, "0"); /* int("-0") */
    } else {
        tb_add(out, c->s + st, i - st); /* Python ints keep every digit */
    }
    return SC_DONE;
}

static int scan_value(scan *c, tbuf *out, int depth);

/* An object or array at c->i (on its bracket). */
static int scan_container(scan *c, tbuf *out, int depth)
{
    bool obj = c->s[c->i] == '{';
    char close = obj ? '}' : ']';
    c->i++;
    if (out) tb_add(out, obj ? "{" : "[", 1);
    skip_ws(c);
    if (c->i >= c->n) return SC_MORE;
    if (c->s[c->i] == close) {
        c->i++;
        if (out) tb_add(out, &close, 1);
        return SC_DONE;
    }
    for (;;) {
        int rc;
        if (obj) {
            if (c->s[c->i] != '"') return SC_BAD;
            if ((rc = scan_string(c, out, true)) != SC_DONE) return rc;
            skip_ws(c);
            if (c->i >= c->n) return SC_MORE;
            if (c->s[c->i++] != ':') return SC_BAD;
            if (out) tb_add(out, ": ", 2);
        }
        if ((rc = scan_value(c, out, depth + 1)) != SC_DONE) return rc;
        skip_ws(c);
        if (c->i >= c->n) return SC_MORE;
        char ch = c->s[c->i++];
        if (ch == close) {
            if (out) tb_add(out, &close, 1);
            return SC_DONE;
        }
        if (ch != ',') return SC_BAD;
        if (out) tb_add(out, ", ", 2);
        skip_ws(c);
        if (c->i >= c->n) return SC_MORE;
    }
}

/* One JSON value at c->i (whitespace first), its stable Python form to out (may be NULL). */
static int scan_value(scan *c, tbuf *out, int depth)
{
    if (depth > MAX_DEPTH) return SC_BAD;
    skip_ws(c);
    if (c->i >= c->n) return SC_MORE;
    char ch = c->s[c->i];
    if (ch == '{' || ch == '[') return scan_container(c, out, depth);
    if (ch == '"') return scan_string(c, out, true);
    if (ch == '-' || (ch >= '0' && ch <= '9')) return scan_number(c, out);
    static const char *const lits[] = {"true", "false", "null"};
    for (int k = 0; k < 3; k++) {
        size_t len = strlen(lits[k]), have = c->n - c->i < len ? c->n - c->i : len;
        if (memcmp(c->s + c->i, lits[k], have) != 0) continue;
        if (have < len) return SC_MORE;
        c->i += len;
        if (out) tb_str(out, lits[k]);
        return SC_DONE;
    }
    return SC_BAD;
}

/* ---- one call object: {"name": N, "arguments": A, ...} ------------------------------------ */

typedef struct {
    tbuf name, args, key;
    bool name_done; /* name holds the whole decoded name */
    bool has_args;  /* the arguments key was seen (args holds what is fixed of A) */
    int rc;         /* SC_DONE: the object is complete */
} call_scan;

static void cs_reset(call_scan *cs)
{
    cs->name.len = cs->args.len = cs->key.len = 0;
    cs->name_done = cs->has_args = false;
    cs->rc = SC_MORE;
}

static void cs_free(call_scan *cs)
{
    tb_free(&cs->name);
    tb_free(&cs->args);
    tb_free(&cs->key);
}

/* Scans a call object at c->i; key: the key that holds the arguments ("arguments", or
 * "parameters" for tool_choice "required"), alt: another one ("parameters" for llama3_json) or
 * NULL. A complete object needs a string name and the arguments. */
static int scan_call(scan *c, call_scan *cs, const char *key, const char *alt)
{
    cs_reset(cs);
    skip_ws(c);
    if (c->i >= c->n) return cs->rc = SC_MORE;
    if (c->s[c->i] != '{') return cs->rc = SC_BAD;
    c->i++;
    for (bool first = true;; first = false) {
        skip_ws(c);
        if (c->i >= c->n) return cs->rc = SC_MORE;
        if (first && c->s[c->i] == '}') {
            c->i++;
            break;
        }
        if (c->s[c->i] != '"') return cs->rc = SC_BAD;
        cs->key.len = 0;
        int rc = scan_string(c, &cs->key, false);
        if (rc != SC_DONE) return cs->rc = rc;
        tb_add(&cs->key, "", 0);
        skip_ws(c);
        if (c->i >= c->n) return cs->rc = SC_MORE;
        if (c->s[c->i++] != ':') return cs->rc = SC_BAD;
        const char *k = cs->key.p ? cs->key.p : "";
        bool is_args = strcmp(k, key) == 0 || (alt && strcmp(k, alt) == 0);
        if (strcmp(k, "name") == 0) {
            skip_ws(c);
            if (c->i >= c->n) return cs->rc = SC_MORE;
            if (c->s[c->i] != '"') return cs->rc = SC_BAD; /* the name must be a string */
            cs->name.len = 0;
            cs->name_done = false;
            if ((rc = scan_string(c, &cs->name, false)) != SC_DONE) return cs->rc = rc;
            tb_add(&cs->name, "", 0);
            cs->name_done = true;
        } else if (is_args) {
            if (cs->has_args) return cs->rc = SC_BAD; /* twice: nothing sent can be taken back */
            cs->has_args = true;
            if ((rc = scan_value(c, &cs->args, 1)) != SC_DONE) return cs->rc = rc;
        } else if ((rc = scan_value(c, NULL, 1)) != SC_DONE) {
            return cs->rc = rc;
        }
        skip_ws(c);
        if (c->i >= c->n) return cs->rc = SC_MORE;
        char ch = c->s[c->i++];
        if (ch == '}') break;
        if (ch != ',') return cs->rc = SC_BAD;
    }
    if (!cs->name_done || !cs->has_args) return cs->rc = SC_BAD; /* vLLM: KeyError */
    return cs->rc = SC_DONE;
}

/* ---- parsers --------------------------------------------------------------------------- */

static const char *const KIND_NAMES[] = {"hermes", "llama3_json", "mistral"};

int pd_tool_kind_from_name(const char *name, pd_tool_kind *out)
{
    for (int k = 0; k < 3; k++)
        if (name && strcmp(name, KIND_NAMES[k]) == 0) {
            *out = (pd_tool_kind)k;
            return PD_OK;
        }
    return pd_error(PD_EINVAL, "unknown tool call parser '%s' (hermes, llama3_json or mistral)",
                    name ? name : "");
}

const char *pd_tool_required_token(pd_tool_kind k)
{
    return k == PD_TOOL_MISTRAL ? "[TOOL_CALLS]" : NULL;
}

static const char HERMES_OPEN[] = "<tool_call>", HERMES_CLOSE[] = "</tool_call>";
static const char PY_TAG[] = "<|python_tag|>", MISTRAL_BOT[] = "[TOOL_CALLS]";

/* tool_choice "required" and a named function: formats of the answers that structured output
 * constrained (not --tool-call-parser choices; the kind of a stream or of array_calls). */
enum { K_REQUIRED = 3, K_NAMED = 4 };

/* The start marker after which a parser reads calls (llama3_json: none, see below). */
static const char *marker(int k)
{
    return k == PD_TOOL_HERMES ? HERMES_OPEN : k == PD_TOOL_MISTRAL ? MISTRAL_BOT : NULL;
}

static const char *args_key(int k)
{
    return k == K_REQUIRED ? "parameters" : "arguments";
}

static const char *alt_key(int k)
{
    return k == PD_TOOL_LLAMA3_JSON ? "parameters" : NULL;
}

static const char *find(const char *s, size_t n, const char *needle)
{
    size_t m = strlen(needle);
    for (size_t i = 0; i + m <= n; i++)
        if (s[i] == needle[0] && memcmp(s + i, needle, m) == 0) return s + i;
    return NULL;
}

static uint64_t next_rand(uint64_t *st)
{
    uint64_t z = (*st += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* A new call id (vLLM's make_tool_call_id, or MistralToolCall.generate_random_id). */
static void make_id(int k, uint64_t *rng, char id[48])
{
    if (k == PD_TOOL_MISTRAL) {
        static const char an[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
        for (int i = 0; i < 9; i++) id[i] = an[next_rand(rng) % 62];
        id[9] = '\0';
        return;
    }
    uint64_t a = next_rand(rng), b = next_rand(rng);
    snprintf(id, 48, "chatcmpl-tool-%016llx%016llx", (unsigned long long)a, (unsigned long long)b);
}

/* ---- whole text ---- */

static int add_call(int k, uint64_t *rng, pd_tool_calls *out, call_scan *cs)
{
    pd_tool_call *calls = realloc(out->calls, (out->n + 1) * sizeof *calls);
    if (!calls) return PD_ENOMEM;
    out->calls = calls;
    pd_tool_call *tc = &calls[out->n];
    make_id(k, rng, tc->id);
    tc->name = tb_take(&cs->name);
    tc->arguments = tb_take(&cs->args);
    out->n++;
    return tc->name && tc->arguments ? PD_OK : PD_ENOMEM;
}

/* s[0..n) is exactly one call object, whitespace around it allowed (json.loads of it). */
static bool whole_call(const char *s, size_t n, const char *alt, call_scan *cs)
{
    scan c = {s, n, 0, true};
    if (scan_call(&c, cs, "arguments", alt) != SC_DONE) return false;
    skip_ws(&c);
    return c.i == n;
}

/* "required": the parameters are an object or null (vLLM validates the answer as a list of
 * FunctionDefinition, whose parameters are Optional[dict]). */
static bool params_ok(const call_scan *cs)
{
    const char *a = cs->args.p ? cs->args.p : "";
    return a[0] == '{' || strcmp(a, "null") == 0;
}

/* s[0..n) is a JSON array of call objects, whitespace around it allowed. */
static int array_calls(int k, uint64_t *rng, const char *s, size_t n, call_scan *cs,
                       pd_tool_calls *out)
{
    scan c = {s, n, 0, true};
    skip_ws(&c);
    if (c.i >= n || s[c.i++] != '[') return SC_BAD;
    skip_ws(&c);
    if (c.i < n && s[c.i] == ']') {
        c.i++;
    } else {
        for (;;) {
            if (scan_call(&c, cs, args_key(k), NULL) != SC_DONE) return SC_BAD;
            if (k == K_REQUIRED && !params_ok(cs)) return SC_BAD;
            PD_CHECK(add_call(k, rng, out, cs));
            skip_ws(&c);
            if (c.i >= n) return SC_BAD;
            char ch = s[c.i++];
            if (ch == ']') break;
            if (ch != ',') return SC_BAD;
        }
    }
    skip_ws(&c);
    return c.i == n ? SC_DONE : SC_BAD;
}

/* llama3_json's regex {[^{}]*(?:{[^{}]*}[^{}]*)*}: an object with at most one level of nested
 * objects, braces inside strings counted as braces. The end of the match at s[i], or 0. */
static size_t llama_obj(const char *s, size_t n, size_t i)
{
    if (i >= n || s[i] != '{') return 0;
    for (i++; i < n; i++) {
        if (s[i] == '}') return i + 1;
        if (s[i] != '{') continue;
        for (i++; i < n && s[i] != '{' && s[i] != '}'; i++) {
        }
        if (i >= n || s[i] == '{') return 0;
    }
    return 0;
}

static int extract_hermes(const char *t, size_t len, uint64_t *rng, call_scan *cs,
                          pd_tool_calls *out)
{
    const char *first = find(t, len, HERMES_OPEN);
    if (!first) return SC_BAD;
    /* <tool_call>(.*?)</tool_call>|<tool_call>(.*) */
    for (const char *p = first; p;) {
        const char *body = p + strlen(HERMES_OPEN), *end = t + len;
        const char *close = find(body, (size_t)(end - body), HERMES_CLOSE);
        size_t blen = (size_t)((close ? close : end) - body);
        if (!whole_call(body, blen, NULL, cs)) return SC_BAD;
        PD_CHECK(add_call(PD_TOOL_HERMES, rng, out, cs));
        if (!close) break;
        const char *next = close + strlen(HERMES_CLOSE);
        p = find(next, (size_t)(end - next), HERMES_OPEN);
    }
    out->content_len = (size_t)(first - t);
    return SC_DONE;
}

static int extract_llama(const char *t, size_t len, uint64_t *rng, call_scan *cs,
                         pd_tool_calls *out)
{
    if (!find(t, len, PY_TAG) && !memchr(t, '{', len)) return SC_BAD;
    size_t st = 0, end = 0;
    for (st = 0; st < len && !(end = llama_obj(t, len, st)); st++) {
    }
    if (!end) return SC_BAD;
    for (;;) { /* (?:\s*;\s*{...})* */
        size_t i = end;
        while (i < len && is_ws(t[i])) i++;
        if (i >= len || t[i] != ';') break;
        i++;
        while (i < len && is_ws(t[i])) i++;
        size_t e = llama_obj(t, len, i);
        if (!e) break;
        end = e;
    }
    /* json_str.split(';'), each stripped, empty ones skipped */
    for (size_t a = st; a < end;) {
        const char *semi = memchr(t + a, ';', end - a);
        size_t b = semi ? (size_t)(semi - t) : end;
        size_t x = a, y = b;
        while (x < y && is_ws(t[x])) x++;
        if (x < y) {
            if (!whole_call(t + x, y - x, "parameters", cs)) return SC_BAD;
            PD_CHECK(add_call(PD_TOOL_LLAMA3_JSON, rng, out, cs));
        }
        a = b + 1;
    }
    out->content_len = 0;
    return SC_DONE;
}

/* mistral: every [TOOL_CALLS] removed, stripped: a JSON array of calls, else the first
 * \[{.*}\] span of it (greedy). *stripped receives the text that is the fallback content. */
static int extract_mistral(const char *t, size_t len, uint64_t *rng, call_scan *cs, tbuf *stripped,
                           pd_tool_calls *out)
{
    const char *first = find(t, len, MISTRAL_BOT);
    if (!first) return SC_BAD;
    size_t m = strlen(MISTRAL_BOT);
    for (const char *p = t, *e = t + len; p < e;) {
        const char *q = find(p, (size_t)(e - p), MISTRAL_BOT);
        tb_add(stripped, p, (size_t)((q ? q : e) - p));
        p = q ? q + m : e;
    }
    if (stripped->oom) return PD_ENOMEM;
    if (stripped->p) { /* .strip() */
        size_t a = 0, b = stripped->len;
        while (a < b && is_ws(stripped->p[a])) a++;
        while (b > a && is_ws(stripped->p[b - 1])) b--;
        memmove(stripped->p, stripped->p + a, b - a);
        stripped->len = b - a;
        stripped->p[stripped->len] = '\0';
    }
    const char *s = stripped->p ? stripped->p : "";
    int rc = array_calls(PD_TOOL_MISTRAL, rng, s, stripped->len, cs, out);
    if (rc < 0 && rc != SC_BAD) return rc;
    if (rc == SC_BAD) {
        for (size_t i = 0; i < out->n; i++) {
            free(out->calls[i].name);
            free(out->calls[i].arguments);
        }
        out->n = 0;
        const char *open = find(s, stripped->len, "[{");
        const char *close = NULL;
        for (size_t i = stripped->len; open && i >= 2 && !close; i--)
            if (s[i - 2] == '}' && s[i - 1] == ']' && s + i - 2 > open) close = s + i;
        if (!open || !close) return SC_BAD;
        rc = array_calls(PD_TOOL_MISTRAL, rng, open, (size_t)(close - open), cs, out);
        if (rc != SC_DONE) return rc;
    }
    out->content_len = (size_t)(first - t);
    return SC_DONE;
}

void pd_tool_calls_free(pd_tool_calls *c)
{
    for (size_t i = 0; i < c->n; i++) {
        free(c->calls[i].name);
        free(c->calls[i].arguments);
    }
    free(c->calls);
    free(c->content);
    memset(c, 0, sizeof *c);
}

int pd_tool_extract(pd_tool_kind k, const char *text, size_t len, uint64_t seed, pd_tool_calls *out)
{
    memset(out, 0, sizeof *out);
    call_scan cs = {0};
    tbuf stripped = {0};
    uint64_t rng = seed;
    int rc = k == PD_TOOL_HERMES        ? extract_hermes(text, len, &rng, &cs, out)
             : k == PD_TOOL_LLAMA3_JSON ? extract_llama(text, len, &rng, &cs, out)
                                        : extract_mistral(text, len, &rng, &cs, &stripped, out);
    cs_free(&cs);
    if (rc == PD_ENOMEM || stripped.oom) {
        tb_free(&stripped);
        pd_tool_calls_free(out);
        return pd_error(PD_ENOMEM, "out of memory parsing tool calls");
    }
    if (rc == SC_DONE && out->n > 0) {
        tb_free(&stripped);
        if (out->content_len == 0) return PD_OK; /* content null */
        out->content = strndup(text, out->content_len);
        return out->content ? PD_OK : pd_error(PD_ENOMEM, "out of memory");
    }
    /* no call: the text, or what the parser cleaned of it when that is not empty */
    pd_tool_calls_free(out);
    if (stripped.len > 0) {
        out->content_len = stripped.len;
        out->content = tb_take(&stripped);
        return PD_OK;
    }
    tb_free(&stripped);
    out->content = strndup(text, len);
    out->content_len = len;
    return out->content ? PD_OK : pd_error(PD_ENOMEM, "out of memory");
}

int pd_tool_extract_forced(const char *named, const char *text, size_t len, uint64_t seed,
                           pd_tool_calls *out)
{
    memset(out, 0, sizeof *out);
    uint64_t rng = seed;
    int rc = SC_DONE;
    out->content = strdup(""); /* vLLM's content "" */
    if (!out->content) {
        rc = PD_ENOMEM;
    } else if (named) { /* the whole text is the arguments, as generated */
        out->calls = calloc(1, sizeof *out->calls);
        if (out->calls) {
            out->n = 1;
            make_id(K_NAMED, &rng, out->calls[0].id);
            out->calls[0].name = strdup(named);
            out->calls[0].arguments = strndup(text, len);
        }
        if (!out->calls || !out->calls[0].name || !out->calls[0].arguments) rc = PD_ENOMEM;
    } else {
        call_scan cs = {0};
        rc = array_calls(K_REQUIRED, &rng, text, len, &cs, out);
        cs_free(&cs);
    }
    if (rc == SC_DONE) return PD_OK;
    pd_tool_calls_free(out);
    if (rc == PD_ENOMEM) return pd_error(PD_ENOMEM, "out of memory parsing tool calls");
    return pd_error(PD_EINVAL, "the generated text is not a JSON array of {\"name\": string, "
                               "\"parameters\": object} tool calls");
}

/* ---- streaming ---- */

typedef struct {
    char id[48];
    bool header_sent;
    size_t args_sent; /* bytes of json.dumps(A) sent */
    bool dead;        /* not valid JSON: nothing more is sent for it */
} call_state;

enum { M_UNDECIDED, M_CONTENT, M_TOOLS, M_PLAIN };

struct pd_tool_stream {
    int kind;    /* pd_tool_kind, K_REQUIRED or K_NAMED */
    char *named; /* K_NAMED: the function's name */
    uint64_t rng;
    tbuf text;           /* everything fed */
    int mode;            /* M_* */
    size_t content_sent; /* bytes of text sent as content */
    size_t region;       /* M_TOOLS: where the calls start in text */
    call_state *calls;
    size_t n_calls, cap_calls;
    call_scan cs;
    tbuf out_args; /* this delta's argument fragments, back to back */
    pd_tool_delta_call *dcalls;
    size_t cap_dcalls;
    size_t *frag_off; /* (cap_dcalls,) offsets of the fragments in out_args */
};

pd_tool_stream *pd_tool_stream_create(pd_tool_kind k, uint64_t seed)
{
    pd_tool_stream *st = calloc(1, sizeof *st);
    if (!st) return NULL;
    st->kind = k;
    st->rng = seed;
    st->mode = k == PD_TOOL_LLAMA3_JSON ? M_UNDECIDED : M_CONTENT;
    return st;
}

pd_tool_stream *pd_tool_stream_create_forced(const char *named, uint64_t seed)
{
    pd_tool_stream *st = calloc(1, sizeof *st);
    if (!st) return NULL;
    st->kind = named ? K_NAMED : K_REQUIRED;
    st->rng = seed;
    st->mode = M_TOOLS; /* the answer is the calls from its first byte */
    if (named && !(st->named = strdup(named))) {
        free(st);
        return NULL;
    }
    return st;
}

void pd_tool_stream_free(pd_tool_stream *st)
{
    if (!st) return;
    free(st->named);
    tb_free(&st->text);
    tb_free(&st->out_args);
    cs_free(&st->cs);
    free(st->calls);
    free(st->dcalls);
    free(st->frag_off);
    free(st);
}

bool pd_tool_stream_called(const pd_tool_stream *st)
{
    return st->kind != K_NAMED && st->n_calls > 0 && st->calls[0].header_sent;
}

/* Call i's state, created on first sight. */
static call_state *call_at(pd_tool_stream *st, size_t i)
{
    if (i < st->n_calls) return &st->calls[i];
    if (i >= st->cap_calls) {
        size_t cap = st->cap_calls ? st->cap_calls * 2 : 4;
        call_state *p = realloc(st->calls, cap * sizeof *p);
        if (!p) return NULL;
        st->calls = p;
        st->cap_calls = cap;
    }
    call_state *c = &st->calls[st->n_calls++];
    memset(c, 0, sizeof *c);
    make_id(st->kind, &st->rng, c->id);
    return c;
}

/* Room for one more call in this delta. */
static int grow_dcalls(pd_tool_stream *st, size_t n_out)
{
    if (n_out < st->cap_dcalls) return PD_OK;
    size_t cap = st->cap_dcalls ? st->cap_dcalls * 2 : 4;
    pd_tool_delta_call *p = realloc(st->dcalls, cap * sizeof *p);
    if (p) st->dcalls = p;
    size_t *q = p ? realloc(st->frag_off, cap * sizeof *q) : NULL;
    if (!q) return PD_ENOMEM;
    st->frag_off = q;
    st->cap_dcalls = cap;
    return PD_OK;
}

/* What call i (as scanned into st->cs) adds to this delta. */
static int emit_call(pd_tool_stream *st, size_t i, size_t *n_out)
{
    call_state *c = call_at(st, i);
    if (!c) return PD_ENOMEM;
    call_scan *cs = &st->cs;
    if (c->dead || !cs->name_done) return PD_OK; /* the name goes out whole, first */
    bool first = !c->header_sent;
    size_t frag = cs->args.len > c->args_sent ? cs->args.len - c->args_sent : 0;
    if (!first && !frag) return PD_OK;
    PD_CHECK(grow_dcalls(st, *n_out));
    pd_tool_delta_call *d = &st->dcalls[(*n_out)++];
    memset(d, 0, sizeof *d);
    d->index = (int)i;
    d->first = first;
    if (first) {
        d->id = c->id;
        d->name = cs->name.p; /* stays valid: the scan buffer is only reused at the next feed */
        c->header_sent = true;
        /* the name must outlive later scans of this feed: keep a copy in out_args */
        st->frag_off[*n_out - 1] = st->out_args.len;
        tb_add(&st->out_args, cs->name.p, cs->name.len + 1);
    } else {
        st->frag_off[*n_out - 1] = (size_t)-1;
    }
    d->args_len = frag;
    size_t at = st->out_args.len;
    tb_add(&st->out_args, cs->args.p ? cs->args.p + c->args_sent : "", frag);
    d->args = (const char *)(uintptr_t)at; /* an offset until the buffer stops moving */
    c->args_sent += frag;
    return PD_OK;
}

/* Scans the calls region and collects their deltas. */
static int scan_tools(pd_tool_stream *st, bool final, size_t *n_out)
{
    const char *t = st->text.p ? st->text.p : "";
    size_t len = st->text.len, p = st->region;
    const char *alt = alt_key(st->kind);
    for (size_t i = 0;; i++) {
        size_t body_end = len;
        bool closed = final;
        if (st->kind == PD_TOOL_HERMES) { /* the body runs to </tool_call> */
            const char *cl = find(t + p, len - p, HERMES_CLOSE);
            if (cl) {
                body_end = (size_t)(cl - t);
                closed = true;
            }
        }
        scan c = {t, body_end, p, closed};
        int rc = scan_call(&c, &st->cs, args_key(st->kind), alt);
        if (rc == SC_DONE && closed && st->kind == PD_TOOL_HERMES) {
            skip_ws(&c);
            if (c.i != body_end) rc = SC_BAD; /* json.loads of the body fails */
        }
        if (rc == SC_DONE && st->kind == K_REQUIRED && !params_ok(&st->cs)) rc = SC_BAD;
        if (rc == SC_BAD || (rc == SC_MORE && closed)) {
            call_state *cst = call_at(st, i);
            if (!cst) return PD_ENOMEM;
            cst->dead = true; /* what was sent stays; nothing more */
        } else {
            PD_CHECK(emit_call(st, i, n_out));
        }
        if (rc != SC_DONE) return PD_OK;
        /* the next call */
        p = c.i;
        if (st->kind == PD_TOOL_HERMES) {
            if (body_end == len) return PD_OK;
            const char *nx = find(t + body_end, len - body_end, HERMES_OPEN);
            if (!nx) return PD_OK;
            p = (size_t)(nx - t) + strlen(HERMES_OPEN);
            continue;
        }
        while (p < len && is_ws(t[p])) p++;
        char sep = st->kind == PD_TOOL_LLAMA3_JSON ? ';' : ',';
        if (p >= len || t[p] != sep) return PD_OK; /* an array's ']' or the end: no more calls */
        p++;
    }
}

/* The longest suffix of s[0..n) that is a proper prefix of m. */
static size_t partial_marker(const char *s, size_t n, const char *m)
{
    size_t ml = strlen(m);
    for (size_t k = ml - 1; k > 0; k--)
        if (k <= n && memcmp(s + n - k, m, k) == 0) return k;
    return 0;
}

/* A named function: every text delta is the next arguments fragment of call 0, as generated
 * (vLLM's serving_chat sends each one, empty ones too). */
static int feed_named(pd_tool_stream *st, const char *text, size_t len, pd_tool_delta *out)
{
    call_state *c = call_at(st, 0);
    if (!c || grow_dcalls(st, 0) < 0)
        return pd_error(PD_ENOMEM, "out of memory parsing tool calls");
    st->out_args.len = 0;
    tb_add(&st->out_args, text, len);
    if (st->out_args.oom) return pd_error(PD_ENOMEM, "out of memory parsing tool calls");
    pd_tool_delta_call *d = &st->dcalls[0];
    memset(d, 0, sizeof *d);
    d->first = !c->header_sent;
    if (d->first) {
        d->id = c->id;
        d->name = st->named;
        c->header_sent = true;
    }
    d->args = st->out_args.p ? st->out_args.p : "";
    d->args_len = len;
    out->calls = st->dcalls;
    out->n_calls = 1;
    return PD_OK;
}

int pd_tool_stream_feed(pd_tool_stream *st, const char *text, size_t len, bool final,
                        pd_tool_delta *out)
{
    memset(out, 0, sizeof *out);
    if (st->kind == K_NAMED) return feed_named(st, text, len, out);
    tb_add(&st->text, text, len);
    st->out_args.len = 0;
    if (st->text.oom) return pd_error(PD_ENOMEM, "out of memory parsing tool calls");
    const char *t = st->text.p ? st->text.p : "";
    size_t n = st->text.len, content_end = st->content_sent;
    if (st->mode == M_UNDECIDED) { /* llama3_json: calls only when the text starts with them */
        size_t pl = strlen(PY_TAG);
        if (n >= pl && memcmp(t, PY_TAG, pl) == 0) {
            st->mode = M_TOOLS;
            st->region = pl;
        } else if (n > 0 && t[0] == '{') {
            st->mode = M_TOOLS;
            st->region = 0;
        } else if (final || n >= pl || memcmp(t, PY_TAG, n) != 0) {
            st->mode = M_PLAIN;
        }
    }
    if (st->mode == M_PLAIN) {
        content_end = n;
    } else if (st->mode == M_CONTENT) {
        const char *m = marker(st->kind);
        const char *at = find(t + st->content_sent, n - st->content_sent, m);
        if (at) {
            content_end = (size_t)(at - t);
            st->mode = M_TOOLS;
            st->region = content_end + strlen(m);
        } else {
            content_end = final ? n : n - partial_marker(t, n, m);
        }
    }
    if (content_end > st->content_sent) {
        out->content = t + st->content_sent;
        out->content_len = content_end - st->content_sent;
        st->content_sent = content_end;
    }
    size_t n_out = 0;
    if (st->mode == M_TOOLS) {
        if (st->kind == PD_TOOL_MISTRAL || st->kind == K_REQUIRED) { /* ([TOOL_CALLS]) '[' */
            size_t p = st->region;
            while (p < n && is_ws(t[p])) p++;
            if (p < n && t[p] == '[') {
                st->region = p + 1;
                PD_CHECK(scan_tools(st, final, &n_out));
                st->region = p; /* rescanned from the bracket next time */
            }
        } else {
            PD_CHECK(scan_tools(st, final, &n_out));
        }
    }
    if (st->out_args.oom) return pd_error(PD_ENOMEM, "out of memory parsing tool calls");
    for (size_t i = 0; i < n_out; i++) { /* offsets -> pointers, now that out_args is still */
        pd_tool_delta_call *d = &st->dcalls[i];
        d->args = !d->args_len     ? NULL /* no arguments key */
                  : st->out_args.p ? st->out_args.p + (size_t)(uintptr_t)d->args
                                   : "";
        if (d->first) d->name = st->out_args.p + st->frag_off[i];
    }
    out->calls = st->dcalls;
    out->n_calls = n_out;
    return PD_OK;
}
