/* KV block manager: free list + reference counts + per-sequence block tables (kvpool.h).
 *
 * The free list is a LIFO stack of block ids (the most recently freed block is reused first,
 * which keeps a small working set warm in cache). Reference counts are uint32 per block; a
 * table drops each of its references exactly once in pd_kvtable_clear, and every unref of a
 * free block is a broken invariant counted in `bad_unrefs` (pd_kvpool_verify reports it).
 */
#include "engine/kvpool.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/dtype.h"
#include "util/status.h"

struct pd_kvpool {
    size_t n_blocks;
    size_t block_size; /* tokens per block */
    uint32_t *ref;     /* (n_blocks) reference counts, 0 = free */
    int32_t *free_ids; /* (n_blocks) stack of free block ids; free_ids[0 .. n_free) */
    size_t n_free;
    uint64_t n_allocs;
    uint64_t n_cow;
    uint64_t bad_unrefs; /* unref of a free block: a bug, reported by verify */
};

struct pd_kvtable {
    pd_kvpool *pool;
    size_t max_tokens;
    size_t max_blocks; /* ceil(max_tokens / block_size) */
    int32_t *ids;      /* (max_blocks) block ids, ids[0 .. n_blocks) in use */
    size_t n_blocks;
    size_t n_tokens; /* slots held */
};

/* ---- sizing ------------------------------------------------------------------------------- */

size_t pd_kv_block_bytes(const pd_kv_params *p)
{
    return 2 * (size_t)p->n_layers * p->block_size * p->n_kv_heads * p->head_dim *
           pd_dtype_size(p->dtype);
}

int pd_kv_default_cpu_bytes(double fraction, size_t *bytes)
{
    const char *path = "/proc/meminfo";
    if (!(fraction > 0.0 && fraction <= 1.0))
        return pd_error(PD_EINVAL, "kv_cache_fraction must be in (0, 1], got %g", fraction);
    FILE *f = fopen(path, "r");
    if (!f) return pd_error(PD_EIO, "%s: %s", path, strerror(errno));
    char line[256];
    long long kib = -1;
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "MemAvailable: %lld kB", &kib) == 1) break;
        kib = -1;
    }
    fclose(f);
    if (kib < 0) return pd_error(PD_EPARSE, "%s: no MemAvailable line", path);
    *bytes = (size_t)((double)kib * 1024.0 * fraction);
    return PD_OK;
}

size_t pd_kv_blocks_for_bytes(size_t bytes, size_t block_bytes)
{
    return block_bytes ? bytes / block_bytes : 0;
}

int pd_kv_check_capacity(size_t n_blocks, size_t block_size, int64_t max_model_len)
{
    if (n_blocks == 0)
        return pd_error(PD_EINVAL, "No available memory for the cache blocks. Try increasing "
                                   "`gpu_memory_utilization` (GPU) or `--kv-cache-bytes` (CPU) "
                                   "when initializing the engine.");
    int64_t max_seq_len = (int64_t)(n_blocks * block_size);
    if (max_model_len > max_seq_len)
        return pd_error(PD_EINVAL,
                        "The model's max seq len (%lld) is larger than the maximum number of "
                        "tokens that can be stored in KV cache (%lld). Try increasing "
                        "`gpu_memory_utilization` (GPU) or `--kv-cache-bytes` (CPU) or decreasing "
                        "`max_model_len` when initializing the engine.",
                        (long long)max_model_len, (long long)max_seq_len);
    return PD_OK;
}

/* ---- the pool ----------------------------------------------------------------------------- */

int pd_kvpool_create(size_t n_blocks, size_t block_size, pd_kvpool **out)
{
    *out = NULL;
    if (n_blocks == 0 || block_size == 0)
        return pd_error(PD_EINVAL, "kv pool: n_blocks (%zu) and block_size (%zu) must be > 0",
                        n_blocks, block_size);
    if (n_blocks > (size_t)INT32_MAX)
        return pd_error(PD_EINVAL, "kv pool: n_blocks (%zu) exceeds %d", n_blocks, INT32_MAX);
    pd_kvpool *p = calloc(1, sizeof *p);
    if (!p) return pd_error(PD_ENOMEM, "kv pool: out of memory");
    p->ref = calloc(n_blocks, sizeof *p->ref);
    p->free_ids = malloc(n_blocks * sizeof *p->free_ids);
    if (!p->ref || !p->free_ids) {
        pd_kvpool_destroy(p);
        return pd_error(PD_ENOMEM, "kv pool: out of memory for %zu blocks", n_blocks);
    }
    p->n_blocks = n_blocks;
    p->block_size = block_size;
    /* Stack top = end of the array: push ids in reverse so block 0 is handed out first. */
    for (size_t i = 0; i < n_blocks; i++) p->free_ids[i] = (int32_t)(n_blocks - 1 - i);
    p->n_free = n_blocks;
    *out = p;
    return PD_OK;
}

void pd_kvpool_destroy(pd_kvpool *p)
{
    if (!p) return;
    free(p->ref);
    free(p->free_ids);
    free(p);
}

size_t pd_kvpool_num_blocks(const pd_kvpool *p)
{
    return p->n_blocks;
}
size_t pd_kvpool_block_size(const pd_kvpool *p)
{
    return p->block_size;
}
size_t pd_kvpool_num_free(const pd_kvpool *p)
{
    return p->n_free;
}
bool pd_kvpool_all_free(const pd_kvpool *p)
{
    return p->n_free == p->n_blocks;
}
uint64_t pd_kvpool_num_allocs(const pd_kvpool *p)
{
    return p->n_allocs;
}
uint64_t pd_kvpool_num_cow(const pd_kvpool *p)
{
    return p->n_cow;
}

int pd_kvpool_refcount(const pd_kvpool *p, int32_t block)
{
    if (block < 0 || (size_t)block >= p->n_blocks) return -1;
    return (int)p->ref[block];
}

/* Pops a free block (refcount 1). The caller has checked n_free. */
static int32_t pool_alloc(pd_kvpool *p)
{
    int32_t id = p->free_ids[--p->n_free];
    p->ref[id] = 1;
    p->n_allocs++;
    return id;
}

static void pool_unref(pd_kvpool *p, int32_t id)
{
    if (p->ref[id] == 0) {
        p->bad_unrefs++;
        return;
    }
    if (--p->ref[id] == 0) p->free_ids[p->n_free++] = id;
}

int pd_kvpool_verify(const pd_kvpool *p)
{
    if (p->bad_unrefs)
        return pd_error(PD_EINTERNAL, "kv pool: %llu release(s) of an already free block",
                        (unsigned long long)p->bad_unrefs);
    if (p->n_free > p->n_blocks)
        return pd_error(PD_EINTERNAL, "kv pool: %zu free of %zu blocks", p->n_free, p->n_blocks);
    uint8_t *seen = calloc(p->n_blocks, 1);
    if (!seen) return pd_error(PD_ENOMEM, "kv pool verify: out of memory");
    int rc = PD_OK;
    for (size_t i = 0; i < p->n_free && rc == PD_OK; i++) {
        int32_t id = p->free_ids[i];
        if (id < 0 || (size_t)id >= p->n_blocks)
            rc = pd_error(PD_EINTERNAL, "kv pool: free list entry %zu is %d", i, id);
        else if (seen[id]++)
            rc = pd_error(PD_EINTERNAL, "kv pool: block %d is on the free list twice", id);
        else if (p->ref[id] != 0)
            rc = pd_error(PD_EINTERNAL, "kv pool: free block %d has refcount %u", id, p->ref[id]);
    }
    for (size_t id = 0; id < p->n_blocks && rc == PD_OK; id++)
        if (!seen[id] && p->ref[id] == 0)
            rc = pd_error(PD_EINTERNAL, "kv pool: block %zu has refcount 0 but is not free", id);
    free(seen);
    return rc;
}

/* ---- tables ------------------------------------------------------------------------------- */

int pd_kvtable_create(pd_kvpool *p, size_t max_tokens, pd_kvtable **out)
{
    *out = NULL;
    if (max_tokens == 0) return pd_error(PD_EINVAL, "kv table: max_tokens must be > 0");
    pd_kvtable *t = calloc(1, sizeof *t);
    if (!t) return pd_error(PD_ENOMEM, "kv table: out of memory");
    t->pool = p;
    t->max_tokens = max_tokens;
    t->max_blocks = (max_tokens + p->block_size - 1) / p->block_size;
    t->ids = malloc(t->max_blocks * sizeof *t->ids);
    if (!t->ids) {
        free(t);
        return pd_error(PD_ENOMEM, "kv table: out of memory");
    }
    *out = t;
    return PD_OK;
}

void pd_kvtable_free(pd_kvtable *t)
{
    if (!t) return;
    pd_kvtable_clear(t);
    free(t->ids);
    free(t);
}

/* True when the next write (at slot n_tokens) lands in a shared block that holds tokens. */
static bool needs_cow(const pd_kvtable *t)
{
    size_t bs = t->pool->block_size;
    if (t->n_tokens % bs == 0 || t->n_blocks == 0) return false;
    return t->pool->ref[t->ids[t->n_blocks - 1]] > 1;
}

size_t pd_kvtable_blocks_needed(const pd_kvtable *t, size_t n_tokens)
{
    if (n_tokens <= t->n_tokens) return 0;
    size_t bs = t->pool->block_size;
    size_t want = (n_tokens + bs - 1) / bs;
    return (want - t->n_blocks) + (needs_cow(t) ? 1 : 0);
}

int pd_kvtable_grow(pd_kvtable *t, size_t n_tokens, pd_kv_block_copy *cow, size_t *n_cow)
{
    if (n_cow) *n_cow = 0;
    if (n_tokens < t->n_tokens)
        return pd_error(PD_EINVAL, "kv table: cannot shrink from %zu to %zu tokens", t->n_tokens,
                        n_tokens);
    if (n_tokens == t->n_tokens) return PD_OK;
    if (n_tokens > t->max_tokens)
        return pd_error(PD_ERANGE, "kv table: %zu tokens exceed the sequence maximum %zu", n_tokens,
                        t->max_tokens);
    pd_kvpool *p = t->pool;
    size_t need = pd_kvtable_blocks_needed(t, n_tokens);
    if (need > p->n_free)
        return pd_error(PD_ENOMEM, "kv pool: %zu blocks needed, %zu free", need, p->n_free);
    if (needs_cow(t)) {
        if (!cow || !n_cow)
            return pd_error(PD_EINVAL, "kv table: copy-on-write needed but no copy slot given");
        int32_t old = t->ids[t->n_blocks - 1];
        int32_t fresh = pool_alloc(p);
        pool_unref(p, old);
        t->ids[t->n_blocks - 1] = fresh;
        cow->src = old;
        cow->dst = fresh;
        *n_cow = 1;
        p->n_cow++;
    }
    size_t want = (n_tokens + p->block_size - 1) / p->block_size;
    while (t->n_blocks < want) t->ids[t->n_blocks++] = pool_alloc(p);
    t->n_tokens = n_tokens;
    return PD_OK;
}

int pd_kvtable_fork(pd_kvtable *dst, const pd_kvtable *src)
{
    if (dst->pool != src->pool) return pd_error(PD_EINVAL, "kv table fork: different pools");
    if (dst->n_blocks != 0) return pd_error(PD_EINVAL, "kv table fork: destination not empty");
    if (dst->max_blocks < src->n_blocks || dst->max_tokens < src->n_tokens)
        return pd_error(PD_EINVAL, "kv table fork: destination holds %zu tokens, source %zu",
                        dst->max_tokens, src->n_tokens);
    for (size_t i = 0; i < src->n_blocks; i++) {
        dst->ids[i] = src->ids[i];
        src->pool->ref[src->ids[i]]++;
    }
    dst->n_blocks = src->n_blocks;
    dst->n_tokens = src->n_tokens;
    return PD_OK;
}

void pd_kvtable_clear(pd_kvtable *t)
{
    for (size_t i = 0; i < t->n_blocks; i++) pool_unref(t->pool, t->ids[i]);
    t->n_blocks = 0;
    t->n_tokens = 0;
}

size_t pd_kvtable_num_tokens(const pd_kvtable *t)
{
    return t->n_tokens;
}
size_t pd_kvtable_num_blocks(const pd_kvtable *t)
{
    return t->n_blocks;
}
const int32_t *pd_kvtable_ids(const pd_kvtable *t)
{
    return t->ids;
}

int64_t pd_kvtable_slot(const pd_kvtable *t, size_t pos)
{
    if (pos >= t->n_tokens) return -1;
    size_t bs = t->pool->block_size;
    return (int64_t)t->ids[pos / bs] * (int64_t)bs + (int64_t)(pos % bs);
}
