/* Helpers of the KV transfer unit tests (declared in kv_tcp_common.h): CPU-backend KV pools
 * filled with values distinct everywhere and checked after a move, receivers on loopback, and
 * send requests. */
#include "kv_tcp_common.h"

#include <stdlib.h>
#include <string.h>

#include "util/clock.h"
#include "util/status.h"

int pool_make(pool *pl, size_t n_heads)
{
    return pool_make_stage(pl, n_heads, 0, LAYERS);
}

int pool_make_stage(pool *pl, size_t n_heads, size_t layer0, int n_layers)
{
    pd_backend_params bp = pd_backend_default_params();
    bp.n_threads = 1;
    PD_CHECK(pd_backend_cpu_create(&bp, &pl->b));
    pl->layer0 = layer0;
    pl->p = (pd_kv_params){.n_layers = n_layers,
                           .n_blocks = POOL,
                           .block_size = BLOCK,
                           .n_kv_heads = n_heads,
                           .head_dim = HDIM,
                           .dtype = PD_DTYPE_F32};
    return pd_backend_get_ops(pl->b)->kv_create(pl->b, &pl->p, &pl->kv);
}

void pool_free(pool *pl)
{
    pd_backend_get_ops(pl->b)->kv_free(pl->b, pl->kv);
    pd_backend_free(pl->b);
}

/* Value of (layer, k/v, token t of the prompt, global head h, dim d): distinct everywhere. */
static float val(int layer, int kv, size_t t, size_t h, size_t d)
{
    return (float)(layer * 100000 + kv * 50000 + (int)t * 1000 + (int)h * 100 + (int)d);
}

int fill(pool *pl, const int32_t *blocks, size_t n_blocks, size_t h0)
{
    size_t n = pl->p.n_kv_heads, per = n_blocks * BLOCK * n * HDIM;
    float *host = malloc(2 * per * sizeof(float));
    for (int l = 0; l < pl->p.n_layers; l++) {
        int ml = (int)pl->layer0 + l; /* the model's layer */
        for (int kv = 0; kv < 2; kv++)
            for (size_t t = 0; t < n_blocks * BLOCK; t++)
                for (size_t h = 0; h < n; h++)
                    for (size_t d = 0; d < HDIM; d++)
                        host[kv * per + (t * n + h) * HDIM + d] = val(ml, kv, t, h0 + h, d);
        pd_kv_range r = {
            .layer = l, .block_ids = blocks, .n_blocks = n_blocks, .head0 = 0, .n_heads = n};
        int rc = pd_backend_get_ops(pl->b)->kv_import(pl->b, pl->kv, &r, host);
        if (rc < 0) {
            free(host);
            return rc;
        }
    }
    free(host);
    return PD_OK;
}

size_t mismatches_upto(pool *pl, const int32_t *blocks, size_t n_blocks, size_t h0, size_t tokens)
{
    size_t n = pl->p.n_kv_heads, per = n_blocks * BLOCK * n * HDIM, bad = 0;
    float *host = malloc(2 * per * sizeof(float));
    for (int l = 0; l < pl->p.n_layers; l++) {
        pd_kv_range r = {
            .layer = l, .block_ids = blocks, .n_blocks = n_blocks, .head0 = 0, .n_heads = n};
        pd_backend_get_ops(pl->b)->kv_export(pl->b, pl->kv, &r, host);
        int ml = (int)pl->layer0 + l;
        for (int kv = 0; kv < 2; kv++)
            for (size_t t = 0; t < n_blocks * BLOCK; t++)
                for (size_t h = 0; h < n; h++)
                    for (size_t d = 0; d < HDIM; d++)
                        bad += host[kv * per + (t * n + h) * HDIM + d] !=
                               (!tokens || t < tokens ? val(ml, kv, t, h0 + h, d) : 0.0f);
    }
    free(host);
    return bad;
}

size_t mismatches(pool *pl, const int32_t *blocks, size_t n_blocks, size_t h0)
{
    return mismatches_upto(pl, blocks, n_blocks, h0, 0);
}

atomic_int g_done, g_done_status;
static void on_done(void *arg, const char *id, int status)
{
    (void)arg, (void)id;
    atomic_store(&g_done_status, status);
    atomic_fetch_add(&g_done, 1);
}

int wait_done(int n)
{
    for (int i = 0; i < 3000 && atomic_load(&g_done) < n; i++) pd_sleep_ns(PD_NS_PER_MS);
    return atomic_load(&g_done) >= n;
}

pd_kv_tcp_receiver *rx_start_on(pd_backend *b, pool *d, size_t head0)
{
    pd_kv_rx_params p = {.host = "127.0.0.1",
                         .port = 0,
                         .backend = b,
                         .kv = d->kv,
                         .kv_params = d->p,
                         .head0 = head0,
                         .layer0 = d->layer0};
    pd_kv_tcp_receiver *rx = NULL;
    if (pd_kv_tcp_receiver_start(&p, on_done, NULL, &rx) < 0) return NULL;
    return rx;
}

pd_kv_tcp_receiver *rx_start(pool *d, size_t head0)
{
    return rx_start_on(d->b, d, head0);
}

pd_kv_send_req req_at(const char *id, pool *p, size_t src_head0, const int32_t *blocks,
                      size_t n_blocks, int port, size_t h0, size_t n)
{
    return (pd_kv_send_req){.request_id = id,
                            .host = "127.0.0.1",
                            .port = port,
                            .backend = p->b,
                            .kv = p->kv,
                            .kv_params = p->p,
                            .layer0 = p->layer0,
                            .src_head0 = src_head0,
                            .block_ids = blocks,
                            .n_blocks = n_blocks,
                            .head0 = h0,
                            .n_heads = n,
                            .timeout_ms = 5000};
}

pd_kv_send_req req_for(const char *id, pool *p, size_t src_head0, const int32_t *blocks,
                       size_t n_blocks, pd_kv_tcp_receiver *rx, size_t h0, size_t n)
{
    return req_at(id, p, src_head0, blocks, n_blocks, pd_kv_tcp_receiver_port(rx), h0, n);
}
