/* KV transfer by CUDA IPC between two processes on one GPU (the transport of prefill and decode
 * instances sharing a host): this process is the prefill side (a CUDA pool filled with
 * kv_ipc_util's pattern, a pd_kv_tcp sender given the pool's share); kv_ipc_peer is the decode
 * side (its own pool and receiver), which checks every copied element. Cases: all heads with
 * a prompt that ends inside its last block and blocks numbered differently on both sides; the
 * head overlap of a prefill rank holding 4 heads and a decode rank holding heads 2..3 (TP 1 to
 * TP 2); the same connection reused for a second request (the mapping is kept); a prompt of
 * more blocks than one pull launch takes (CUDA_KV_PULL_IDS), scattered on both sides; a frame
 * describing a pool larger than the mapping, refused before the request goes through. Exits 77
 * without a GPU. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#include "backend/cuda/cuda_backend.h"
#include "cuda_test_util.h"
#include "kv_ipc_util.h"
#include "transfer/kv_tcp.h"

enum { LAYERS = 3, BLOCKS = 1024, HEADS = 4, HD = 64 };

static const pd_kv_params k_pool = {.n_layers = LAYERS,
                                    .n_blocks = BLOCKS,
                                    .block_size = 16,
                                    .n_kv_heads = HEADS,
                                    .head_dim = HD,
                                    .dtype = PD_DTYPE_BF16};

/* A CUDA backend on device 0 with a k_pool-shaped pool. */
static int open_pool(pd_backend **b, pd_kv **kv)
{
    *kv = NULL;
    PD_CHECK(pd_backend_cuda_create(NULL, b));
    int rc = pd_backend_get_ops(*b)->kv_create(*b, &k_pool, kv);
    if (rc < 0) pd_backend_free(*b);
    return rc;
}

/* Sends n_tokens of src_ids (heads [h0, h0 + nh) of a 4-head pool) to a peer holding nh heads
 * from global head h0 in dst_ids, reps times, and returns the peer's verdict. oversized: before
 * that, a frame that describes the pool as 64 times its size, which the peer must refuse (the
 * pull would read past the mapping) without dropping the connection or the request. */
static void transfer_case(const int32_t *src_ids, const int32_t *dst_ids, size_t n, size_t n_tokens,
                          size_t h0, size_t nh, int reps, bool oversized)
{
    pd_backend *b = NULL;
    pd_kv *kv = NULL;
    const pd_kv_params p = k_pool;
    ASSERT_OK(open_pool(&b, &kv));
    const pd_backend_ops *o = pd_backend_get_ops(b);
    int rc = kv_ipc_fill(b, kv, &p, 0, src_ids, n);
    pd_kv_share share;
    if (rc == PD_OK) rc = o->kv_share(b, kv, &share);
    static char args[16384];
    int off = snprintf(args, sizeof args,
                       "--layers %d --heads %zu --head0 %zu --head-dim %d --blocks %d "
                       "--tokens %zu --reps %d --ids ",
                       LAYERS, nh, h0, HD, BLOCKS, n_tokens, reps);
    for (size_t i = 0; i < n; i++)
        off += snprintf(args + off, sizeof args - (size_t)off, "%s%d", i ? "," : "", dst_ids[i]);
    FILE *peer = NULL;
    int port = 0;
    if (rc == PD_OK) rc = kv_ipc_spawn_peer(args, &peer, &port);
    pd_kv_tcp_sender *tx = NULL;
    if (rc == PD_OK) rc = pd_kv_tcp_sender_create(&tx);
    char refusal[512] = "";
    int rc_big = PD_EINVAL;
    if (rc == PD_OK && oversized) {
        pd_kv_params big = p;
        big.n_blocks *= 64;
        pd_kv_send_stats st;
        rc_big = kv_ipc_send(tx, port, 0, b, kv, &big, &share, src_ids, n, n_tokens, h0, nh, &st);
        snprintf(refusal, sizeof refusal, "%s", pd_last_error());
        printf("    oversized frame: %s\n", refusal);
    }
    for (int r = 0; r < reps && rc == PD_OK; r++) {
        pd_kv_send_stats st;
        rc = kv_ipc_send(tx, port, r, b, kv, &p, &share, src_ids, n, n_tokens, h0, nh, &st);
        if (rc == PD_OK) {
            printf("    r%d: %llu bytes in %.3f ms (%llu frame)\n", r, (unsigned long long)st.bytes,
                   st.seconds * 1e3, (unsigned long long)st.frames);
            ASSERT_EQ_INT(st.bytes, 2ull * LAYERS * n_tokens * nh * HD * 2);
        }
    }
    char imports[256], verdict[512] = "(no peer)\n";
    int st = peer ? kv_ipc_peer_finish(peer, imports, sizeof imports, verdict, sizeof verdict) : -1;
    pd_kv_tcp_sender_free(tx);
    if (kv) o->kv_free(b, kv);
    pd_backend_free(b);
    ASSERT_OK(rc);
    printf("    peer: %s", verdict);
    ASSERT_EQ_INT(st, 0);
    ASSERT_EQ_INT(rc_big, PD_EINVAL);
    ASSERT_MSG(!oversized || strstr(refusal, "but the mapped allocation holds"), "refusal: %s",
               refusal);
}

TEST(cuda_ipc_all_heads_partial_last_block)
{
    if (!ctu_have_gpu()) SKIP(pd_last_error());
    const int32_t src[3] = {5, 2, 17}, dst[3] = {30, 0, 9};
    transfer_case(src, dst, 3, 37, 0, HEADS, 2, false);
}

TEST(cuda_ipc_head_overlap_tp1_to_tp2)
{
    if (!ctu_have_gpu()) SKIP(pd_last_error());
    const int32_t src[2] = {1, 3}, dst[2] = {7, 6};
    transfer_case(src, dst, 2, 32, 2, 2, 1, false);
}

TEST(cuda_ipc_more_blocks_than_one_launch)
{
    if (!ctu_have_gpu()) SKIP(pd_last_error());
    enum { N = 1000 }; /* > 2 launches of CUDA_KV_PULL_IDS (448) blocks */
    static int32_t src[N], dst[N];
    for (int i = 0; i < N; i++) {
        src[i] = BLOCKS - 1 - i;
        dst[i] = (i * 7) % BLOCKS; /* a permutation: 7 is odd, BLOCKS a power of 2 */
    }
    transfer_case(src, dst, N, N * 16 - 5, 0, HEADS, 1, false);
}

TEST(cuda_ipc_frame_larger_than_mapping)
{
    if (!ctu_have_gpu()) SKIP(pd_last_error());
    const int32_t src[] = {5, 9}, dst[] = {1, 0};
    transfer_case(src, dst, 2, 20, 0, HEADS, 1, true);
}

TEST(cuda_ipc_peer_checks)
{
    if (!ctu_have_gpu()) SKIP(pd_last_error());
    pd_backend *b = NULL;
    pd_kv *kv = NULL;
    ASSERT_OK(open_pool(&b, &kv));
    const pd_backend_ops *o = pd_backend_get_ops(b);
    pd_kv_share share, again;
    ASSERT_OK(o->kv_share(b, kv, &share));
    ASSERT_OK(o->kv_share(b, kv, &again));
    ASSERT(share.id == again.id && memcmp(share.handle, again.handle, sizeof share.handle) == 0);
    pd_kv_peer *peer = NULL;
    /* a pool of another geometry is refused before any mapping */
    pd_kv_share other = share;
    other.p.head_dim = 128;
    int rc = o->kv_peer_open(b, kv, &other, &peer);
    /* mapping this process's own pool is not what IPC is for: CUDA refuses it */
    int rc2 = o->kv_peer_open(b, kv, &share, &peer);
    o->kv_free(b, kv);
    pd_backend_free(b);
    ASSERT_EQ_INT(rc, PD_EINVAL);
    ASSERT_EQ_INT(rc2, PD_EUNSUPPORTED);
}
