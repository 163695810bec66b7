/* KV block manager: free list + reference counts + per-sequence block tables + the prefix cache
 * (kvpool.h).
 *
 * The free list is a doubly linked list of block ids. A block freed without a cache key goes to
 * its head and is handed out first (the most recently freed block is reused first, which keeps a
 * small working set warm in cache); a block freed with a key goes to its tail, so cached blocks
 * are taken last, least recently freed first (LRU eviction). Reference counts are uint32 per
 * block; a table drops each of its references exactly once in pd_kvtable_clear, and every unref
 * of a free block is a broken invariant counted in `bad_unrefs` (pd_kvpool_verify reports it).
 *
 * The prefix cache maps 128-bit block keys to block ids in an open-addressing table (linear
 * probing, backward-shift deletion, at most half full). A key chains the block's tokens onto
 * its parent's key, seeded per pool from /dev/urandom so that keys cannot be computed outside
 * the process.
 */
#include "engine/kvpool.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/dtype.h"
#include "util/hash.h"
#include "util/status.h"

struct pd_kvpool {
    size_t n_blocks;
    size_t block_size;      /* tokens per block */
    uint32_t *ref;          /* (n_blocks) reference counts, 0 = free */
    int32_t *fprev, *fnext; /* (n_blocks) free list links (-1: none) */
    int32_t fhead, ftail;
    size_t n_free;
    uint64_t n_allocs;
    uint64_t n_cow;
    uint64_t bad_unrefs; /* unref of a free block: a bug, reported by verify */
    /* prefix cache (NULL / 0 while off) */
    pd_kv_block_key *keys; /* (n_blocks) the key of each keyed block */
    uint8_t *keyed;        /* (n_blocks) 1: the block is in the table under keys[id] */
    int32_t *slots;        /* (mask + 1) block ids, -1 = empty */
    size_t mask;
    size_t n_cached;
    uint64_t n_evictions;
    uint64_t seed[2];
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

int pd_kv_mem_available(size_t *bytes)
{
    const char *path = "/proc/meminfo";
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
    *bytes = (size_t)kib * 1024;
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
    p->fprev = malloc(n_blocks * sizeof *p->fprev);
    p->fnext = malloc(n_blocks * sizeof *p->fnext);
    if (!p->ref || !p->fprev || !p->fnext) {
        pd_kvpool_free(p);
        return pd_error(PD_ENOMEM, "kv pool: out of memory for %zu blocks", n_blocks);
    }
    p->n_blocks = n_blocks;
    p->block_size = block_size;
    /* block 0 at the head: handed out first */
    for (size_t i = 0; i < n_blocks; i++) {
        p->fprev[i] = (int32_t)i - 1;
        p->fnext[i] = i + 1 < n_blocks ? (int32_t)i + 1 : -1;
    }
    p->fhead = 0;
    p->ftail = (int32_t)n_blocks - 1;
    p->n_free = n_blocks;
    *out = p;
    return PD_OK;
}

void pd_kvpool_free(pd_kvpool *p)
{
    if (!p) return;
    free(p->ref);
    free(p->fprev);
    free(p->fnext);
    free(p->keys);
    free(p->keyed);
    free(p->slots);
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

/* ---- free list and cache table ----------------------------------------------------------- */

static void free_unlink(pd_kvpool *p, int32_t id)
{
    int32_t a = p->fprev[id], b = p->fnext[id];
    if (a >= 0)
        p->fnext[a] = b;
    else
        p->fhead = b;
    if (b >= 0)
        p->fprev[b] = a;
    else
        p->ftail = a;
    p->n_free--;
}

static void free_push(pd_kvpool *p, int32_t id, bool at_tail)
{
    if (at_tail) {
        p->fprev[id] = p->ftail;
        p->fnext[id] = -1;
        if (p->ftail >= 0)
            p->fnext[p->ftail] = id;
        else
            p->fhead = id;
        p->ftail = id;
    } else {
        p->fprev[id] = -1;
        p->fnext[id] = p->fhead;
        if (p->fhead >= 0)
            p->fprev[p->fhead] = id;
        else
            p->ftail = id;
        p->fhead = id;
    }
    p->n_free++;
}

static bool key_eq(const pd_kv_block_key *a, const pd_kv_block_key *b)
{
    return a->h[0] == b->h[0] && a->h[1] == b->h[1];
}

static size_t key_home(const pd_kvpool *p, const pd_kv_block_key *k)
{
    return (size_t)k->h[0] & p->mask;
}

/* The table slot holding key (or the empty slot where it would go). */
static size_t slot_find(const pd_kvpool *p, const pd_kv_block_key *k)
{
    size_t i = key_home(p, k);
    while (p->slots[i] >= 0 && !key_eq(&p->keys[p->slots[i]], k)) i = (i + 1) & p->mask;
    return i;
}

/* Takes block id's key out of the table (backward-shift deletion keeps probes unbroken). */
static void cache_drop(pd_kvpool *p, int32_t id)
{
    size_t i = slot_find(p, &p->keys[id]);
    p->slots[i] = -1;
    for (size_t j = (i + 1) & p->mask; p->slots[j] >= 0; j = (j + 1) & p->mask) {
        size_t home = key_home(p, &p->keys[p->slots[j]]);
        /* the entry at j may move to the hole at i when its home is not in (i, j] (cyclic) */
        bool stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (stays) continue;
        p->slots[i] = p->slots[j];
        p->slots[j] = -1;
        i = j;
    }
    p->keyed[id] = 0;
    p->n_cached--;
}

/* Takes the head of the free list (refcount 1), evicting its cached content. The caller has
 * checked n_free. */
static int32_t pool_alloc(pd_kvpool *p)
{
    int32_t id = p->fhead;
    free_unlink(p, id);
    if (p->keyed && p->keyed[id]) {
        cache_drop(p, id);
        p->n_evictions++;
    }
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
    if (--p->ref[id] == 0) free_push(p, id, p->keyed && p->keyed[id]);
}

/* ---- prefix cache ------------------------------------------------------------------------- */

int pd_kvpool_enable_prefix_cache(pd_kvpool *p)
{
    if (p->keys) return PD_OK;
    size_t cap = 2;
    while (cap < 2 * p->n_blocks) cap <<= 1;
    p->keys = calloc(p->n_blocks, sizeof *p->keys);
    p->keyed = calloc(p->n_blocks, 1);
    p->slots = malloc(cap * sizeof *p->slots);
    if (!p->keys || !p->keyed || !p->slots) {
        free(p->keys);
        free(p->keyed);
        free(p->slots);
        p->keys = NULL;
        p->keyed = NULL;
        p->slots = NULL;
        return pd_error(PD_ENOMEM, "kv pool: out of memory for the prefix cache of %zu blocks",
                        p->n_blocks);
    }
    memset(p->slots, 0xff, cap * sizeof *p->slots);
    p->mask = cap - 1;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (read(fd, p->seed, sizeof p->seed) != (ssize_t)sizeof p->seed) p->seed[0] = 0;
        close(fd);
    }
    p->seed[0] ^= (uint64_t)(uintptr_t)p;
    p->seed[1] ^= 0x9e3779b97f4a7c15ull;
    return PD_OK;
}

bool pd_kvpool_prefix_cache_enabled(const pd_kvpool *p)
{
    return p->keys != NULL;
}

pd_kv_block_key pd_kvpool_block_key(const pd_kvpool *p, const pd_kv_block_key *parent,
                                    const int32_t *tokens)
{
    uint64_t a = parent ? parent->h[0] : p->seed[0], b = parent ? parent->h[1] : p->seed[1];
    for (size_t i = 0; i < p->block_size; i++) {
        uint64_t t = (uint32_t)tokens[i];
        a = pd_mix64(a ^ t ^ (i << 32));
        b = pd_mix64(b + t * 0x9e3779b97f4a7c15ull + i);
    }
    return (pd_kv_block_key){{pd_mix64(a ^ 0x2545f4914f6cdd1dull), pd_mix64(b ^ a)}};
}

void pd_kvpool_cache_block(pd_kvpool *p, int32_t block, const pd_kv_block_key *key)
{
    if (!p->keys || block < 0 || (size_t)block >= p->n_blocks || p->keyed[block] ||
        p->ref[block] == 0)
        return;
    size_t i = slot_find(p, key);
    if (p->slots[i] >= 0) return; /* the same content is cached in another block */
    p->keys[block] = *key;
    p->keyed[block] = 1;
    p->slots[i] = block;
    p->n_cached++;
}

size_t pd_kvpool_num_cached(const pd_kvpool *p)
{
    return p->n_cached;
}

uint64_t pd_kvpool_num_evictions(const pd_kvpool *p)
{
    return p->n_evictions;
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
    size_t n = 0;
    for (int32_t id = p->fhead, prev = -1; id != -1 && rc == PD_OK; prev = id, id = p->fnext[id]) {
        if (id < 0 || (size_t)id >= p->n_blocks)
            rc = pd_error(PD_EINTERNAL, "kv pool: free list entry %zu is %d", n, id);
        else if (seen[id]++)
            rc = pd_error(PD_EINTERNAL, "kv pool: block %d is on the free list twice", id);
        else if (p->ref[id] != 0)
            rc = pd_error(PD_EINTERNAL, "kv pool: free block %d has refcount %u", id, p->ref[id]);
        else if (p->fprev[id] != prev)
            rc = pd_error(PD_EINTERNAL, "kv pool: free block %d links back to %d, not %d", id,
                          p->fprev[id], prev);
        n++;
    }
    if (rc == PD_OK && n != p->n_free)
        rc = pd_error(PD_EINTERNAL, "kv pool: %zu blocks on the free list, %zu counted", n,
                      p->n_free);
    for (size_t id = 0; id < p->n_blocks && rc == PD_OK; id++)
        if (!seen[id] && p->ref[id] == 0)
            rc = pd_error(PD_EINTERNAL, "kv pool: block %zu has refcount 0 but is not free", id);
    size_t n_keyed = 0;
    for (size_t id = 0; p->keys && id < p->n_blocks && rc == PD_OK; id++) {
        if (!p->keyed[id]) continue;
        n_keyed++;
        if (p->slots[slot_find(p, &p->keys[id])] != (int32_t)id)
            rc = pd_error(PD_EINTERNAL, "kv pool: cached block %zu is not found by its key", id);
    }
    for (size_t i = 0; p->keys && i <= p->mask && rc == PD_OK; i++)
        if (p->slots[i] >= 0 && !p->keyed[p->slots[i]])
            rc = pd_error(PD_EINTERNAL, "kv pool: cache slot %zu holds uncached block %d", i,
                          p->slots[i]);
    if (rc == PD_OK && n_keyed != p->n_cached)
        rc =
            pd_error(PD_EINTERNAL, "kv pool: %zu cached blocks, %zu counted", n_keyed, p->n_cached);
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

bool pd_kvtable_append_cached(pd_kvtable *t, const pd_kv_block_key *key)
{
    pd_kvpool *p = t->pool;
    if (!p->keys || t->n_blocks >= t->max_blocks || t->n_tokens != t->n_blocks * p->block_size ||
        t->n_tokens + p->block_size > t->max_tokens)
        return false;
    int32_t id = p->slots[slot_find(p, key)];
    if (id < 0) return false;
    if (p->ref[id]++ == 0) free_unlink(p, id);
    t->ids[t->n_blocks++] = id;
    t->n_tokens += p->block_size;
    return true;
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
    /* last block first: of a sequence's cached blocks, the later ones are evicted first (a
       prefix's first blocks are the ones other prompts share) */
    for (size_t i = t->n_blocks; i-- > 0;) pool_unref(t->pool, t->ids[i]);
    t->n_blocks = 0;
    t->n_tokens = 0;
}

void pd_kvtable_truncate(pd_kvtable *t, size_t n_tokens)
{
    if (n_tokens >= t->n_tokens) return;
    size_t keep = (n_tokens + t->pool->block_size - 1) / t->pool->block_size;
    while (t->n_blocks > keep) pool_unref(t->pool, t->ids[--t->n_blocks]);
    t->n_tokens = n_tokens;
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
