/* Growable byte buffer (see sbuf.h). */
#include "sbuf.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/fmt.h"

void pd_sb_free(pd_sb *b)
{
    free(b->p);
    memset(b, 0, sizeof *b);
}

void pd_sb_reset(pd_sb *b)
{
    b->len = 0;
    b->failed = false;
    if (b->p) b->p[0] = '\0';
}

bool pd_sb_failed(const pd_sb *b)
{
    return b->failed;
}

static bool reserve(pd_sb *b, size_t extra)
{
    if (b->failed) return false;
    if (b->len + extra + 1 <= b->cap) return true;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra + 1) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
        b->failed = true;
        return false;
    }
    b->p = p;
    b->cap = cap;
    return true;
}

void pd_sb_add(pd_sb *b, const void *data, size_t len)
{
    if (!reserve(b, len)) return;
    memcpy(b->p + b->len, data, len);
    b->len += len;
    b->p[b->len] = '\0';
}

void pd_sb_str(pd_sb *b, const char *s)
{
    pd_sb_add(b, s, strlen(s));
}

void pd_sb_printf(pd_sb *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char tmp[256];
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0) {
        b->failed = true;
        return;
    }
    if ((size_t)n < sizeof tmp) {
        pd_sb_add(b, tmp, (size_t)n);
        return;
    }
    if (!reserve(b, (size_t)n)) return;
    va_start(ap, fmt);
    vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

void pd_sb_json_str(pd_sb *b, const char *s, size_t len)
{
    if (!reserve(b, len + 2)) return;
    b->p[b->len++] = '"';
    size_t run = 0; /* start of the pending run of bytes that need no escape */
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\') continue;
        pd_sb_add(b, s + run, i - run);
        run = i + 1;
        switch (c) {
        case '"': pd_sb_add(b, "\\\"", 2); break;
        case '\\': pd_sb_add(b, "\\\\", 2); break;
        case '\n': pd_sb_add(b, "\\n", 2); break;
        case '\r': pd_sb_add(b, "\\r", 2); break;
        case '\t': pd_sb_add(b, "\\t", 2); break;
        case '\b': pd_sb_add(b, "\\b", 2); break;
        case '\f': pd_sb_add(b, "\\f", 2); break;
        default: pd_sb_printf(b, "\\u%04x", c); break;
        }
    }
    pd_sb_add(b, s + run, len - run);
    pd_sb_add(b, "\"", 1);
}

void pd_sb_json_str_ascii(pd_sb *b, const char *s, size_t len)
{
    pd_sb_add(b, "\"", 1);
    const unsigned char *p = (const unsigned char *)s, *end = p + len;
    while (p < end) {
        unsigned c = *p;
        if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') {
            const unsigned char *q = p;
            while (q < end && *q >= 0x20 && *q < 0x7f && *q != '"' && *q != '\\') q++;
            pd_sb_add(b, p, (size_t)(q - p));
            p = q;
            continue;
        }
        uint32_t cp = c;
        size_t n = 1;
        if (c >= 0xF0 && p + 3 < end) {
            cp = ((c & 0x07u) << 18) | ((p[1] & 0x3Fu) << 12) | ((p[2] & 0x3Fu) << 6) |
                 (p[3] & 0x3Fu);
            n = 4;
        } else if (c >= 0xE0 && p + 2 < end) {
            cp = ((c & 0x0Fu) << 12) | ((p[1] & 0x3Fu) << 6) | (p[2] & 0x3Fu);
            n = 3;
        } else if (c >= 0xC0 && p + 1 < end) {
            cp = ((c & 0x1Fu) << 6) | (p[1] & 0x3Fu);
            n = 2;
        } else if (c >= 0x80) {
            cp = 0xFFFD; /* not valid UTF-8: never produced by the detokenizer */
        }
        p += n;
        switch (cp) {
        case '"': pd_sb_add(b, "\\\"", 2); break;
        case '\\': pd_sb_add(b, "\\\\", 2); break;
        case '\n': pd_sb_add(b, "\\n", 2); break;
        case '\r': pd_sb_add(b, "\\r", 2); break;
        case '\t': pd_sb_add(b, "\\t", 2); break;
        case '\b': pd_sb_add(b, "\\b", 2); break;
        case '\f': pd_sb_add(b, "\\f", 2); break;
        default:
            if (cp >= 0x10000) {
                uint32_t v = cp - 0x10000;
                pd_sb_printf(b, "\\u%04x\\u%04x", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
            } else {
                pd_sb_printf(b, "\\u%04x", cp);
            }
        }
    }
    pd_sb_add(b, "\"", 1);
}

void pd_sb_double(pd_sb *b, double v)
{
    char tmp[32];
    size_t n = pd_fmt_double(v, tmp, sizeof tmp);
    pd_sb_add(b, tmp, n);
}
