/* Chunked bump allocator (see arena.h). */
#include "util/arena.h"

#include <stdarg.h>
#include <stdalign.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct chunk {
    struct chunk *next;
    size_t cap;  /* bytes of data[] */
    size_t used; /* bytes handed out from data[] */
    alignas(max_align_t) unsigned char data[];
} chunk;

struct pd_arena {
    chunk *head;      /* current chunk; older ones follow */
    size_t first_cap; /* capacity of the first chunk */
    size_t total;     /* bytes handed out */
};

static chunk *chunk_new(size_t cap)
{
    chunk *c = malloc(sizeof *c + cap);
    if (!c) return NULL;
    c->next = NULL;
    c->cap = cap;
    c->used = 0;
    return c;
}

pd_arena *pd_arena_create(size_t chunk_bytes)
{
    pd_arena *a = calloc(1, sizeof *a);
    if (!a) return NULL;
    a->first_cap = chunk_bytes ? chunk_bytes : 4096;
    a->head = chunk_new(a->first_cap);
    if (!a->head) {
        free(a);
        return NULL;
    }
    return a;
}

void pd_arena_free(pd_arena *a)
{
    if (!a) return;
    for (chunk *c = a->head; c;) {
        chunk *next = c->next;
        free(c);
        c = next;
    }
    free(a);
}

void *pd_arena_alloc(pd_arena *a, size_t bytes, size_t align)
{
    if (align == 0) align = alignof(max_align_t);
    if (align & (align - 1)) return NULL;
    chunk *c = a->head;
    uintptr_t base = (uintptr_t)c->data;
    size_t off = ((base + c->used + align - 1) & ~(uintptr_t)(align - 1)) - base;
    if (off > c->cap || bytes > c->cap - off) {
        size_t cap = c->cap * 2;
        if (bytes > SIZE_MAX - align || bytes + align > SIZE_MAX / 2) return NULL;
        if (cap < bytes + align) cap = bytes + align;
        chunk *n = chunk_new(cap);
        if (!n) return NULL;
        n->next = c;
        a->head = c = n;
        base = (uintptr_t)c->data;
        off = ((base + align - 1) & ~(uintptr_t)(align - 1)) - base;
    }
    c->used = off + bytes;
    a->total += bytes;
    return c->data + off;
}

void *pd_arena_calloc(pd_arena *a, size_t n, size_t size)
{
    if (size && n > SIZE_MAX / size) return NULL;
    void *p = pd_arena_alloc(a, n * size, 0);
    if (p) memset(p, 0, n * size);
    return p;
}

char *pd_arena_strndup(pd_arena *a, const char *s, size_t n)
{
    char *p = pd_arena_alloc(a, n + 1, 1);
    if (!p) return NULL;
    memcpy(p, s, n);
    p[n] = '\0';
    return p;
}

char *pd_arena_strdup(pd_arena *a, const char *s)
{
    return pd_arena_strndup(a, s, strlen(s));
}

char *pd_arena_sprintf(pd_arena *a, const char *fmt, ...)
{
    va_list ap, ap2;
    va_start(ap, fmt);
    va_copy(ap2, ap);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    char *p = n < 0 ? NULL : pd_arena_alloc(a, (size_t)n + 1, 1);
    if (p) vsnprintf(p, (size_t)n + 1, fmt, ap2);
    va_end(ap2);
    return p;
}

void pd_arena_reset(pd_arena *a)
{
    chunk *c = a->head;
    while (c->next) { /* keep only the oldest (first) chunk */
        chunk *next = c->next;
        free(c);
        c = next;
    }
    c->used = 0;
    a->head = c;
    a->total = 0;
}

size_t pd_arena_used(const pd_arena *a)
{
    return a->total;
}
