/* An id -> object map: intrusive hash chains keyed by a NUL-terminated id string (request ids,
 * choice ids), for the tables of the engine, the instances and the api-server.
 *
 * Design: the object embeds a pd_idmap_link whose key points at the object's own id (which must
 * not change while it is in the map), so the map allocates nothing but its buckets and an entry
 * is unlinked in O(chain) without a search by key. FNV-1a over the id picks the bucket. Not
 * thread-safe: the owner's lock covers it. */
#ifndef PD_UTIL_IDMAP_H
#define PD_UTIL_IDMAP_H

#include <stdbool.h>
#include <stddef.h>

typedef struct pd_idmap_link {
    struct pd_idmap_link *next;
    const char *key; /* the object's id */
} pd_idmap_link;

typedef struct {
    pd_idmap_link **buckets; /* (n_buckets) */
    size_t n_buckets;
    size_t count;
} pd_idmap;

/* The object that holds link l as its member `member`. */
#define PD_IDMAP_ENTRY(l, type, member) ((type *)((char *)(l)-offsetof(type, member)))

/* An empty map of n_buckets (> 0) chains; PD_ENOMEM. */
int pd_idmap_init(pd_idmap *m, size_t n_buckets);
/* Frees the buckets (not the objects). */
void pd_idmap_free(pd_idmap *m);
/* Links l under key (l->key = key); the caller checks for a duplicate first when it matters. */
void pd_idmap_put(pd_idmap *m, pd_idmap_link *l, const char *key);
/* The link of key (the most recently put one), or NULL. */
pd_idmap_link *pd_idmap_get(const pd_idmap *m, const char *key);
/* Unlinks l; false when it was not in the map. */
bool pd_idmap_del(pd_idmap *m, pd_idmap_link *l);
/* Iteration: the first link, then the one after l (NULL at the end); the map must not change
 * meanwhile, except that the link just returned may be deleted after its successor is taken. */
pd_idmap_link *pd_idmap_first(const pd_idmap *m);
pd_idmap_link *pd_idmap_next(const pd_idmap *m, const pd_idmap_link *l);
/* for (every link l of m): the body may delete l (its successor nx is taken first). */
#define PD_IDMAP_FOREACH(m, l, nx)                                                                 \
    for (pd_idmap_link *l = pd_idmap_first(m), *nx = l ? pd_idmap_next(m, l) : NULL; l;            \
         l = nx, nx = l ? pd_idmap_next(m, l) : NULL)

#endif
