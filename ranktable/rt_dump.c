/* Ranktable serialization, byte-compatible with the Ascend tool's Python json.dump(indent=4).
 *
 * jansson's own dumper differs from Python in small ways that matter for byte equality
 * (upper-case \u escapes, DEL unescaped, float spelling), so tables are written by this
 * small serializer over the jansson document instead: separators "," and ": ", 4-space
 * indentation, "{}"/"[]" for empty containers, ensure_ascii escapes in lower case with
 * surrogate pairs, floats spelled like Python's repr, keys in document order, no
 * trailing newline.
 */
#include "ranktable/ranktable.h"
#include "ranktable/rt_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "util/status.h"

typedef struct {
    char *p;    /* text so far, NUL-terminated when !oom */
    size_t n;   /* bytes used */
    size_t cap; /* bytes allocated */
    bool oom;
} sbuf;

static void put(sbuf *b, const char *s, size_t len)
{
    if (b->oom) return;
    if (b->n + len + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 1024;
        while (cap < b->n + len + 1) cap *= 2;
        char *q = realloc(b->p, cap);
        if (!q) {
            b->oom = true;
            return;
        }
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, len);
    b->n += len;
    b->p[b->n] = '\0';
}

static void puts_(sbuf *b, const char *s)
{
    put(b, s, strlen(s));
}

static void newline_indent(sbuf *b, int depth)
{
    put(b, "\n", 1);
    for (int i = 0; i < depth; i++) put(b, "    ", 4);
}

/* Decodes one UTF-8 sequence (jansson guarantees valid UTF-8). Returns its length. */
static size_t utf8_decode(const unsigned char *s, size_t left, uint32_t *cp)
{
    if (s[0] < 0x80 || left < 2) {
        *cp = s[0];
        return 1;
    }
    if ((s[0] & 0xe0) == 0xc0) {
        *cp = ((uint32_t)(s[0] & 0x1f) << 6) | (s[1] & 0x3f);
        return 2;
    }
    if ((s[0] & 0xf0) == 0xe0 && left >= 3) {
        *cp = ((uint32_t)(s[0] & 0x0f) << 12) | ((uint32_t)(s[1] & 0x3f) << 6) | (s[2] & 0x3f);
        return 3;
    }
    if (left >= 4) {
        *cp = ((uint32_t)(s[0] & 0x07) << 18) | ((uint32_t)(s[1] & 0x3f) << 12) |
              ((uint32_t)(s[2] & 0x3f) << 6) | (s[3] & 0x3f);
        return 4;
    }
    *cp = s[0];
    return 1;
}

/* Python's ensure_ascii string encoding. */
static void put_string(sbuf *b, const char *s, size_t len)
{
    put(b, "\"", 1);
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < len) {
        size_t start = i;
        while (i < len && u[i] >= 0x20 && u[i] < 0x7f && u[i] != '"' && u[i] != '\\') i++;
        put(b, s + start, i - start);
        if (i == len) break;
        char esc[16];
        uint32_t cp;
        i += utf8_decode(u + i, len - i, &cp);
        switch (cp) {
        case '"': puts_(b, "\\\""); continue;
        case '\\': puts_(b, "\\\\"); continue;
        case '\n': puts_(b, "\\n"); continue;
        case '\r': puts_(b, "\\r"); continue;
        case '\t': puts_(b, "\\t"); continue;
        case '\b': puts_(b, "\\b"); continue;
        case '\f': puts_(b, "\\f"); continue;
        default: break;
        }
        if (cp >= 0x10000) {
            uint32_t v = cp - 0x10000;
            snprintf(esc, sizeof esc, "\\u%04x\\u%04x", 0xd800 + (v >> 10), 0xdc00 + (v & 0x3ff));
        } else {
            snprintf(esc, sizeof esc, "\\u%04x", cp);
        }
        puts_(b, esc);
    }
    put(b, "\"", 1);
}

/* Python float repr: the shortest digits that round-trip, fixed notation for decimal
 * exponents -4..15 (always with a fractional part), else d[.ddd]e[+-]XX. */
static void put_real(sbuf *b, double d)
{
    char e[40];
    int prec = 1;
    for (; prec < 17; prec++) {
        snprintf(e, sizeof e, "%.*e", prec - 1, d);
        if (strtod(e, NULL) == d) break;
    }
    snprintf(e, sizeof e, "%.*e", prec - 1, d);
    /* e = [-]D[.DDD]e[+-]XX */
    const char *q = e;
    bool neg = *q == '-';
    if (neg) q++;
    char digits[24];
    size_t nd = 0;
    for (; *q && *q != 'e'; q++)
        if (*q != '.') digits[nd++] = *q;
    digits[nd] = '\0';
    int exp10 = atoi(q + 1);
    char out[64];
    size_t o = 0;
    if (neg) out[o++] = '-';
    if (exp10 >= -4 && exp10 < 16) {
        if (exp10 < 0) {
            out[o++] = '0';
            out[o++] = '.';
            for (int z = 0; z < -exp10 - 1; z++) out[o++] = '0';
            for (size_t k = 0; k < nd; k++) out[o++] = digits[k];
        } else {
            for (int k = 0; k <= exp10; k++) out[o++] = (size_t)k < nd ? digits[k] : '0';
            out[o++] = '.';
            if ((size_t)exp10 + 1 < nd)
                for (size_t k = (size_t)exp10 + 1; k < nd; k++) out[o++] = digits[k];
            else
                out[o++] = '0';
        }
        out[o] = '\0';
    } else {
        out[o++] = digits[0];
        if (nd > 1) {
            out[o++] = '.';
            for (size_t k = 1; k < nd; k++) out[o++] = digits[k];
        }
        snprintf(out + o, sizeof out - o, "e%c%02d", exp10 < 0 ? '-' : '+',
                 exp10 < 0 ? -exp10 : exp10);
    }
    puts_(b, out);
}

static void put_value(sbuf *b, const json_t *v, int depth)
{
    char num[32];
    switch (json_typeof(v)) {
    case JSON_OBJECT: {
        if (json_object_size(v) == 0) {
            puts_(b, "{}");
            return;
        }
        puts_(b, "{");
        bool first = true;
        const char *key;
        json_t *val;
        void *it;
        for (it = json_object_iter((json_t *)v); it; it = json_object_iter_next((json_t *)v, it)) {
            key = json_object_iter_key(it);
            val = json_object_iter_value(it);
            if (!first) puts_(b, ",");
            first = false;
            newline_indent(b, depth + 1);
            put_string(b, key, json_object_iter_key_len(it));
            puts_(b, ": ");
            put_value(b, val, depth + 1);
        }
        newline_indent(b, depth);
        puts_(b, "}");
        return;
    }
    case JSON_ARRAY: {
        size_t n = json_array_size(v);
        if (n == 0) {
            puts_(b, "[]");
            return;
        }
        puts_(b, "[");
        for (size_t i = 0; i < n; i++) {
            if (i) puts_(b, ",");
            newline_indent(b, depth + 1);
            put_value(b, json_array_get(v, i), depth + 1);
        }
        newline_indent(b, depth);
        puts_(b, "]");
        return;
    }
    case JSON_STRING: put_string(b, json_string_value(v), json_string_length(v)); return;
    case JSON_INTEGER:
        snprintf(num, sizeof num, "%lld", (long long)json_integer_value(v));
        puts_(b, num);
        return;
    case JSON_REAL: put_real(b, json_real_value(v)); return;
    case JSON_TRUE: puts_(b, "true"); return;
    case JSON_FALSE: puts_(b, "false"); return;
    case JSON_NULL: puts_(b, "null"); return;
    }
}

char *rt_json_dumps_py(const json_t *v)
{
    sbuf b = {0};
    put_value(&b, v, 0);
    if (b.oom || !b.p) {
        free(b.p);
        return NULL;
    }
    return b.p;
}

char *rt_global_dumps(const rt_global *g)
{
    return rt_json_dumps_py(g->root);
}

char *rt_local_dumps(const rt_local *l)
{
    return rt_json_dumps_py(l->root);
}

/* Atomic write: temporary file in the same directory, then rename. */
static int save_text(const char *text, const char *file)
{
    if (!text) return pd_error(PD_ENOMEM, "%s: out of memory", file);
    char tmp[4096];
    int w = snprintf(tmp, sizeof tmp, "%s.tmp.%d", file, (int)getpid());
    if (w < 0 || (size_t)w >= sizeof tmp) return pd_error(PD_ERANGE, "%s: path too long", file);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) return pd_error(PD_EIO, "%s: %s", tmp, strerror(errno));
    size_t len = strlen(text), done = 0;
    int err = 0;
    while (done < len) {
        ssize_t k = write(fd, text + done, len - done);
        if (k < 0) {
            if (errno == EINTR) continue;
            err = errno;
            break;
        }
        done += (size_t)k;
    }
    if (close(fd) != 0 && !err) err = errno;
    if (!err && rename(tmp, file) != 0) err = errno;
    if (err) {
        unlink(tmp);
        return pd_error(PD_EIO, "%s: write failed: %s", file, strerror(err));
    }
    return PD_OK;
}

int rt_global_save(const rt_global *g, const char *file)
{
    char *text = rt_global_dumps(g);
    int rc = save_text(text, file);
    free(text);
    return rc;
}

int rt_local_save(const rt_local *l, const char *file)
{
    char *text = rt_local_dumps(l);
    int rc = save_text(text, file);
    free(text);
    return rc;
}

int rt_global_file_name(char *buf, size_t n, const char *ip)
{
    int w = snprintf(buf, n, "global_ranktable_%s.json", ip);
    if (w < 0 || (size_t)w >= n) return pd_error(PD_ERANGE, "ranktable file name too long");
    return PD_OK;
}

int rt_local_file_name(char *buf, size_t n, const char *ip, const rt_instance *inst)
{
    int w = snprintf(buf, n, "local_ranktable_%s_", ip);
    if (w < 0 || (size_t)w >= n) return pd_error(PD_ERANGE, "ranktable file name too long");
    size_t used = (size_t)w;
    if (!inst || inst->role == RT_ROLE_SCHEDULER || inst->n_devices == 0) {
        w = snprintf(buf + used, n - used, "host.json");
        if (w < 0 || (size_t)w >= n - used)
            return pd_error(PD_ERANGE, "ranktable file name too long");
        return PD_OK;
    }
    for (size_t k = 0; k < inst->n_devices; k++) {
        w = snprintf(buf + used, n - used, "%s", inst->devices[k].device_id);
        if (w < 0 || (size_t)w >= n - used)
            return pd_error(PD_ERANGE, "ranktable file name too long");
        used += (size_t)w;
    }
    w = snprintf(buf + used, n - used, ".json");
    if (w < 0 || (size_t)w >= n - used) return pd_error(PD_ERANGE, "ranktable file name too long");
    return PD_OK;
}
