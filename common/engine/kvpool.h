/* KV block manager: which blocks of the paged KV cache belong to which sequence.
 *
 * Design choice: pure host-side bookkeeping, no device memory. The pool hands out block ids of
 * a backend pd_kv pool (or of t identical pools, one per tensor-parallel rank: block ids are the
 * same on every rank) and keeps a reference count per block, so `n > 1` sequences of one request
 * share their prompt blocks after pd_kvtable_fork. Writing into a shared, partially filled last
 * block is copy-on-write: pd_kvtable_grow swaps in a fresh block and reports the (src, dst) pair;
 * the caller copies the device data on every rank before the step runs (vLLM's blocks_to_copy).
 * A free list (a doubly linked list of ids) makes alloc/free O(1). Nothing here allocates after
 * create except pd_kvtable_create (once per sequence) and pd_kvpool_enable_prefix_cache (once).
 *
 * Prefix caching (vLLM's automatic prefix caching): a full block whose K/V are computed can be
 * registered under a key of its tokens and of every token before it (pd_kvpool_block_key
 * chains them). It stays cached while it is free, at the free list's tail, until it is handed
 * out again (evicted, least recently freed first); a new sequence whose first blocks' keys are
 * cached takes references on those blocks instead of computing them
 * (pd_kvtable_append_cached).
 *
 * Sizing helpers turn a byte budget into a block count (bytes per block from pd_kv_params, so
 * the same function serves the CPU byte budget and a GPU's free memory) and refuse a
 * max_model_len that one sequence could never hold, with vLLM's wording.
 */
#ifndef PD_ENGINE_KVPOOL_H
#define PD_ENGINE_KVPOOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"

typedef struct pd_kvpool pd_kvpool;
typedef struct pd_kvtable pd_kvtable;

/* The key of a full block of tokens under the prefix cache: its tokens chained onto the key of
 * the block before it (128 bits). */
typedef struct {
    uint64_t h[2];
} pd_kv_block_key;

/* A copy-on-write order: copy every layer's K and V of block src into block dst. */
typedef struct {
    int32_t src;
    int32_t dst;
} pd_kv_block_copy;

/* ---- sizing ------------------------------------------------------------------------------- */

/* Bytes one block occupies in a pool of parameters p (all layers, K and V):
 * 2 * n_layers * block_size * n_kv_heads * head_dim * elem. p->n_blocks is ignored. */
size_t pd_kv_block_bytes(const pd_kv_params *p);

/* MemAvailable of /proc/meminfo in bytes (to warn about a CPU budget the host cannot hold).
 * PD_EIO / PD_EPARSE naming /proc/meminfo when it cannot be read. */
int pd_kv_mem_available(size_t *bytes);

/* Number of blocks a budget of `bytes` holds (floor(bytes / block_bytes)). */
size_t pd_kv_blocks_for_bytes(size_t bytes, size_t block_bytes);

/* PD_EINVAL with vLLM's message ("The model's max seq len (L) is larger than the maximum number
 * of tokens that can be stored in KV cache (N). ...") when one sequence of max_model_len tokens
 * does not fit in n_blocks blocks of block_size tokens; also when n_blocks is 0. */
int pd_kv_check_capacity(size_t n_blocks, size_t block_size, int64_t max_model_len);

/* ---- the pool ----------------------------------------------------------------------------- */

/* A pool of n_blocks blocks (ids 0 .. n_blocks-1), block_size tokens each, all free.
 * PD_EINVAL for zero sizes or n_blocks > INT32_MAX. */
int pd_kvpool_create(size_t n_blocks, size_t block_size, pd_kvpool **out);
/* Frees the bookkeeping (tables made from the pool must be freed first). NULL is a no-op. */
void pd_kvpool_free(pd_kvpool *p);

size_t pd_kvpool_num_blocks(const pd_kvpool *p);
size_t pd_kvpool_block_size(const pd_kvpool *p);
/* Blocks with reference count 0. */
size_t pd_kvpool_num_free(const pd_kvpool *p);
/* True when every block is free again ("full again", for tests and Stats). */
bool pd_kvpool_all_free(const pd_kvpool *p);
/* Reference count of one block (0 = free); -1 for an id out of range. */
int pd_kvpool_refcount(const pd_kvpool *p, int32_t block);
/* Cumulative counters: blocks handed out, copy-on-write copies ordered. */
uint64_t pd_kvpool_num_allocs(const pd_kvpool *p);
uint64_t pd_kvpool_num_cow(const pd_kvpool *p);
/* Checks the invariants (free list holds each free block once, counts add up, every cached
 * block is found by its key); PD_EINTERNAL with a message naming the first broken one.
 * O(n_blocks): for tests and debug builds. */
int pd_kvpool_verify(const pd_kvpool *p);

/* ---- prefix cache ------------------------------------------------------------------------- */

/* Turns the prefix cache on (idempotent; PD_ENOMEM). Off, the calls below do nothing. */
int pd_kvpool_enable_prefix_cache(pd_kvpool *p);
bool pd_kvpool_prefix_cache_enabled(const pd_kvpool *p);
/* The key of the block holding tokens[0 .. block_size) after the block keyed parent (NULL: the
 * sequence's first block). Keys are seeded per pool at random: they mean nothing elsewhere. */
pd_kv_block_key pd_kvpool_block_key(const pd_kvpool *p, const pd_kv_block_key *parent,
                                    const int32_t *tokens);
/* Registers block (held, full, its K/V computed) under key. A no-op when the block is already
 * registered or another block holds the key (the same content computed twice). */
void pd_kvpool_cache_block(pd_kvpool *p, int32_t block, const pd_kv_block_key *key);
/* Blocks registered now (held or free); free blocks handed out while registered. */
size_t pd_kvpool_num_cached(const pd_kvpool *p);
uint64_t pd_kvpool_num_evictions(const pd_kvpool *p);

/* ---- per-sequence block tables -------------------------------------------------------------- */

/* An empty table for a sequence of at most max_tokens tokens (its id array is sized once, here).
 * PD_EINVAL for max_tokens 0. */
int pd_kvtable_create(pd_kvpool *p, size_t max_tokens, pd_kvtable **out);
/* Drops the table's references (pd_kvtable_clear) and frees it. NULL is a no-op. */
void pd_kvtable_free(pd_kvtable *t);

/* Blocks needed to grow t to n_tokens slots, copy-on-write of a shared partial last block
 * included (0 when it already holds them). */
size_t pd_kvtable_blocks_needed(const pd_kvtable *t, size_t n_tokens);

/* Makes t hold slots for n_tokens tokens, writing into slots [t's tokens, n_tokens) next.
 * New blocks come from the pool. When the block that receives the first new token is shared
 * (refcount > 1) and already holds tokens, it is replaced by a fresh block and *cow (may be NULL
 * only when no copy can happen) receives the copy order; *n_cow is set to 0 or 1.
 * PD_ENOMEM (nothing changed) when the pool lacks the blocks; PD_ERANGE when n_tokens exceeds
 * the table's max_tokens. Shrinking is not allowed (PD_EINVAL); equal is a no-op. */
int pd_kvtable_grow(pd_kvtable *t, size_t n_tokens, pd_kv_block_copy *cow, size_t *n_cow);

/* Appends the block cached under key to t, whose blocks are all full, taking a reference (a
 * free block leaves the free list): t then holds block_size more tokens. false (nothing done)
 * when no block is cached under key or t has no room. */
bool pd_kvtable_append_cached(pd_kvtable *t, const pd_kv_block_key *key);

/* Makes dst (empty, same pool) share every block of src (reference counts + 1), with src's
 * token count. PD_EINVAL when dst is not empty or too small. */
int pd_kvtable_fork(pd_kvtable *dst, const pd_kvtable *src);

/* Drops every reference of t exactly once and empties it (token count 0). */
void pd_kvtable_clear(pd_kvtable *t);

/* Shrinks t to n_tokens slots (speculative decoding: the slots of rejected draft tokens), dropping
 * the references of the blocks past them, last first. No-op when t holds at most n_tokens. */
void pd_kvtable_truncate(pd_kvtable *t, size_t n_tokens);

/* Slots held (tokens whose K/V have a place). */
size_t pd_kvtable_num_tokens(const pd_kvtable *t);
size_t pd_kvtable_num_blocks(const pd_kvtable *t);
/* Block ids (num_blocks of them), valid until the table changes. */
const int32_t *pd_kvtable_ids(const pd_kvtable *t);
/* KV slot of position pos (< num_tokens): block_id * block_size + pos % block_size; -1 when out
 * of range. */
int64_t pd_kvtable_slot(const pd_kvtable *t, size_t pos);

#endif
