/* Arena allocator: many small allocations freed together in one place (request-scoped
 * memory, parsed configs). Chunks grow geometrically; nothing is freed individually. */
#ifndef PD_UTIL_ARENA_H
#define PD_UTIL_ARENA_H

#include <stddef.h>

typedef struct pd_arena pd_arena;

/* chunk_bytes: size of the first chunk (0 = 4 KiB). NULL when out of memory. */
pd_arena *pd_arena_create(size_t chunk_bytes);
void pd_arena_free(pd_arena *a);
/* Aligned allocation (align a power of two, 0 = max_align_t). NULL when out of memory. */
void *pd_arena_alloc(pd_arena *a, size_t bytes, size_t align);
/* Zeroed allocation of n * size bytes; NULL on overflow or out of memory. */
void *pd_arena_calloc(pd_arena *a, size_t n, size_t size);
char *pd_arena_strdup(pd_arena *a, const char *s);
char *pd_arena_strndup(pd_arena *a, const char *s, size_t n);
char *pd_arena_sprintf(pd_arena *a, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Forgets every allocation but keeps the first chunk for reuse. */
void pd_arena_reset(pd_arena *a);
/* Bytes handed out since create/reset. */
size_t pd_arena_used(const pd_arena *a);

#endif
