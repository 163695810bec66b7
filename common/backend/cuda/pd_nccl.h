/* NCCL in the CUDA backend (plain C header; implemented in pd_nccl.cu).
 *
 * Two uses, both device to device:
 *   - Tensor parallelism inside one process: one communicator per rank over the instance's
 *     GPUs (ncclCommInitAll), ncclAllReduce(sum) in place on each rank's step stream, called
 *     from each rank's own thread. Only for ranks on distinct GPUs (NCCL refuses one GPU twice);
 *     the backend group (backend/group.h) keeps its host-staged all-reduce otherwise.
 *   - KV links between a prefill and a decode process (the kv_link_* ops of backend.h): a
 *     2-rank non-blocking communicator (config.blocking = 0) per link, point-to-point
 *     ncclSend/ncclRecv of coalesced chunks gathered from / scattered into the paged pool by
 *     the pull kernel (k_kv.cu) on a stream of the link's own, and one watchdog thread per
 *     process that polls every open link (ncclCommGetAsyncError, the deadline of the operation
 *     in flight) and calls ncclCommAbort on a failed one, so a dead peer never wedges a caller.
 */
#ifndef PD_BACKEND_CUDA_PD_NCCL_H
#define PD_BACKEND_CUDA_PD_NCCL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "backend/backend.h"

/* ---- tensor-parallel all-reduce ---------------------------------------------------------------
 */

typedef struct pd_nccl_tp pd_nccl_tp;

/* 1 when NCCL takes several ranks of one process on one GPU: NCCL_MULTI_RANK_GPU_ENABLE=1 in
 * the environment and the NCCL loaded is 2.30 or later (earlier ones refuse such ranks whatever
 * the environment says). */
int pd_nccl_multi_rank_gpu(void);
/* One communicator per rank over the devices of ranks[0..n) (CUDA backends, n >= 2).
 * PD_EUNSUPPORTED when two ranks share a device (unless pd_nccl_multi_rank_gpu) or a backend is
 * not CUDA (the caller keeps its host-staged all-reduce), PD_EINTERNAL with NCCL's message when
 * NCCL cannot start. */
int pd_nccl_tp_create(pd_backend *const *ranks, int n, pd_nccl_tp **out);
/* buf (n_elems) activations of rank's backend = the sum over every rank's buf, in place, enqueued
 * on the rank's step stream (the activation dtype: bf16 or f32). Called by each rank from the
 * thread that runs its steps, in the same order on every rank. PD_EINTERNAL after an abort. */
int pd_nccl_tp_allreduce(pd_nccl_tp *t, int rank, void *buf, size_t n_elems);
/* Aborts every communicator (any thread): all-reduces in flight end, later ones fail. For a rank
 * that failed mid-step while the others wait in an all-reduce. Idempotent. */
void pd_nccl_tp_abort(pd_nccl_tp *t);
/* 1 once aborted. */
int pd_nccl_tp_aborted(const pd_nccl_tp *t);
void pd_nccl_tp_free(pd_nccl_tp *t);

/* ---- KV links: the kv_link_* ops of the CUDA backend's table (see backend.h) ------------------
 */

int pd_nccl_link_id(pd_backend *b, uint8_t id[PD_KV_LINK_ID_BYTES]);
int pd_nccl_link_open(pd_backend *b, const uint8_t id[PD_KV_LINK_ID_BYTES], int rank,
                      const pd_kv_link_wait *w, pd_kv_link **out);
void pd_nccl_link_close(pd_backend *b, pd_kv_link *l);
int pd_nccl_link_send(pd_backend *b, const pd_kv *kv, pd_kv_link *l, const pd_kv_xfer *x,
                      int chunk_layers, const pd_kv_link_wait *w);
int pd_nccl_link_recv(pd_backend *b, const pd_kv *kv, pd_kv_link *l, const pd_kv_xfer *x,
                      const pd_kv_link_wait *w);
int pd_nccl_link_scatter(pd_backend *b, pd_kv *kv, pd_kv_link *l, const pd_kv_xfer *x);
int pd_nccl_link_local(pd_backend *b, const uint8_t id[PD_KV_LINK_ID_BYTES]);

#ifdef __cplusplus
}
#endif
#endif
