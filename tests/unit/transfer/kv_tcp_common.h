/* Unit tests of the KV transfer between real CPU-backend KV pools on loopback: TCP
 * (test_kv_tcp.c), the NCCL protocol (test_kv_nccl.c) and the route (test_kv_route.c), the last
 * two over the host-memory stand-ins of kv_tcp_stubs.c.
 *
 * One executable (test_kv_tcp): this header declares the pools and helpers every file uses
 * (kv_tcp_common.c); the files are linked in the order the tests run. */
#ifndef PD_TESTS_UNIT_KV_TCP_COMMON_H
#define PD_TESTS_UNIT_KV_TCP_COMMON_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "transfer/kv_tcp.h"

#define LAYERS 3
#define BLOCK  4
#define HEADS  4
#define HDIM   8
#define POOL   16

/* A CPU backend with a pool of POOL blocks of LAYERS x BLOCK tokens x n_kv_heads x HDIM, f32;
 * or of n_layers of the LAYERS from layer0 (a pipeline stage's). */
typedef struct {
    pd_backend *b;
    pd_kv *kv;
    pd_kv_params p;
    size_t layer0;
} pool;

int pool_make(pool *pl, size_t n_heads);
int pool_make_stage(pool *pl, size_t n_heads, size_t layer0, int n_layers);
void pool_free(pool *pl);
/* Writes the prompt's KV (n_blocks blocks) for global heads [h0, h0+n) into pool blocks. */
int fill(pool *pl, const int32_t *blocks, size_t n_blocks, size_t h0);
/* Counts elements of the pool's blocks that differ from the expected values: the prompt's
 * values for its first `tokens` tokens (0 = all slots), zero after them. */
size_t mismatches_upto(pool *pl, const int32_t *blocks, size_t n_blocks, size_t h0, size_t tokens);
size_t mismatches(pool *pl, const int32_t *blocks, size_t n_blocks, size_t h0);

/* Requests the receivers completed and the status of the last one. */
extern atomic_int g_done, g_done_status;
/* Waits up to 3 s for g_done to reach n; whether it did. */
int wait_done(int n);
/* A receiver on 127.0.0.1 (any port) into d's pool for heads from head0, through backend b
 * (rx_start: d's own). */
pd_kv_tcp_receiver *rx_start_on(pd_backend *b, pool *d, size_t head0);
pd_kv_tcp_receiver *rx_start(pool *d, size_t head0);
/* A send of heads [h0, h0 + n) of blocks from p (holding heads from src_head0) to 127.0.0.1:port.
 */
pd_kv_send_req req_at(const char *id, pool *p, size_t src_head0, const int32_t *blocks,
                      size_t n_blocks, int port, size_t h0, size_t n);
/* req_at to rx's port. */
pd_kv_send_req req_for(const char *id, pool *p, size_t src_head0, const int32_t *blocks,
                       size_t n_blocks, pd_kv_tcp_receiver *rx, size_t h0, size_t n);

#endif
