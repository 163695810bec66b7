/* The CUDA half of a backend group (backend/group.h): CUDA backends for the ranks, the NCCL
 * all-reduce between them, KV sizing by each GPU's memory. Plain C header.
 *
 * Design: group.c is written once for every build; a build with the CUDA backend compiles
 * cuda_group.c (over cuda_backend.h and pd_nccl.h), one without it compiles cuda_group_none.c,
 * whose every call refuses with PD_EUNSUPPORTED, so no file carries #if PD_HAVE_CUDA.
 */
#ifndef PD_BACKEND_CUDA_GROUP_H
#define PD_BACKEND_CUDA_GROUP_H

#include <stddef.h>

#include "backend/backend.h"
#include "backend/tp_allreduce.h"

/* PD_OK when this build has the CUDA backend, else PD_EUNSUPPORTED saying how to get one. */
int pd_cuda_group_check(void);

/* A CUDA backend on bp->device (pd_backend_cuda_create). */
int pd_cuda_group_backend(const pd_backend_params *bp, pd_backend **out);

/* The NCCL all-reduce over the CUDA backends ranks[0..n) (n >= 2), when every rank has a GPU of
 * its own or NCCL takes several ranks per GPU (pd_nccl_multi_rank_gpu). PD_EUNSUPPORTED (ranks
 * share a GPU) when it does not: the caller keeps its host-staged all-reduce; NCCL's status
 * when it cannot start. */
int pd_cuda_group_allreduce(pd_backend *const *ranks, int n, pd_tp_allreduce **out);

/* The smallest of the ranks' pd_backend_cuda_kv_blocks(kp, util): blocks every rank can hold. */
int pd_cuda_group_kv_blocks(pd_backend *const *ranks, int n, const pd_kv_params *kp, double util,
                            size_t *n_blocks);

#endif
