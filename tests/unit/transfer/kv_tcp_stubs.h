/* Host-memory stand-ins for the backend's NCCL link ops and CUDA IPC ops (kv_tcp_stubs.c), for
 * the KV transfer tests that run on the CPU. */
#ifndef PD_TESTS_UNIT_KV_TCP_STUBS_H
#define PD_TESTS_UNIT_KV_TCP_STUBS_H

#include "kv_tcp_common.h"

/* Link ends opened; the receive that fails (counted in g_recvs from 0; -1: none). */
extern atomic_int g_link_opens, g_fail_recv_after, g_recvs;
/* Whether the fake links' two ends stand for one GPU (kv_link_local). */
extern atomic_int g_same_gpu;
/* The CPU op table plus the fake link ops (set by fake_linked). */
extern pd_backend_ops g_fake_ops;

/* p with a second handle f over the same CPU state whose op table has the fake link ops. */
pd_backend *fake_linked(pool *p);

/* The CUDA IPC stand-in, for an op table built on g_fake_ops. */
int fake_kv_share(pd_backend *b, const pd_kv *kv, pd_kv_share *out);
int fake_peer_open(pd_backend *b, const pd_kv *kv, const pd_kv_share *s, pd_kv_peer **out);
void fake_peer_close(pd_backend *b, pd_kv_peer *peer);
/* Layer by layer: the source blocks' heads out, the slots past the prompt zeroed, then in. */
int fake_pull(pd_backend *b, pd_kv *kv, pd_kv_peer *peer, const pd_kv_pull *pl);

#endif
