/* See idmap.h. */
#include "util/idmap.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "util/status.h"

static size_t bucket_of(const pd_idmap *m, const char *key)
{
    uint32_t h = 2166136261u; /* FNV-1a */
    for (; *key; key++) h = (h ^ (uint8_t)*key) * 16777619u;
    return h % m->n_buckets;
}

int pd_idmap_init(pd_idmap *m, size_t n_buckets)
{
    memset(m, 0, sizeof *m);
    if (n_buckets == 0) return pd_error(PD_EINVAL, "idmap: 0 buckets");
    m->buckets = calloc(n_buckets, sizeof *m->buckets);
    if (!m->buckets) return pd_error(PD_ENOMEM, "idmap: out of memory (%zu buckets)", n_buckets);
    m->n_buckets = n_buckets;
    return PD_OK;
}

void pd_idmap_free(pd_idmap *m)
{
    free(m->buckets);
    memset(m, 0, sizeof *m);
}

void pd_idmap_put(pd_idmap *m, pd_idmap_link *l, const char *key)
{
    size_t b = bucket_of(m, key);
    l->key = key;
    l->next = m->buckets[b];
    m->buckets[b] = l;
    m->count++;
}

pd_idmap_link *pd_idmap_get(const pd_idmap *m, const char *key)
{
    for (pd_idmap_link *l = m->buckets[bucket_of(m, key)]; l; l = l->next)
        if (strcmp(l->key, key) == 0) return l;
    return NULL;
}

bool pd_idmap_del(pd_idmap *m, pd_idmap_link *l)
{
    for (pd_idmap_link **pp = &m->buckets[bucket_of(m, l->key)]; *pp; pp = &(*pp)->next)
        if (*pp == l) {
            *pp = l->next;
            l->next = NULL;
            m->count--;
            return true;
        }
    return false;
}

/* The first link in bucket b or after it. */
static pd_idmap_link *from_bucket(const pd_idmap *m, size_t b)
{
    for (; b < m->n_buckets; b++)
        if (m->buckets[b]) return m->buckets[b];
    return NULL;
}

pd_idmap_link *pd_idmap_first(const pd_idmap *m)
{
    return m->count ? from_bucket(m, 0) : NULL;
}

pd_idmap_link *pd_idmap_next(const pd_idmap *m, const pd_idmap_link *l)
{
    return l->next ? l->next : from_bucket(m, bucket_of(m, l->key) + 1);
}
