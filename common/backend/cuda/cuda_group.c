/* The CUDA half of a backend group (cuda_group.h), in a build with the CUDA backend.
 *
 * Design: the NCCL all-reduce is pd_nccl.h's tensor-parallel communicators behind the
 * tp_allreduce.h interface. NCCL's waits run on the GPUs and cannot be broken from the host, so
 * it has no fail entry, only abort (ncclCommAbort on every communicator; group.c decides when).
 */
#include "backend/cuda/cuda_group.h"

#include <stdbool.h>
#include <stdlib.h>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/pd_nccl.h"
#include "util/status.h"

typedef struct {
    pd_tp_allreduce base;
    pd_nccl_tp *t;
} nccl_allreduce;

static int nccl_run(pd_tp_allreduce *a, int rank, pd_backend *b, void *buf, size_t n_elems)
{
    (void)b;
    return pd_nccl_tp_allreduce(((nccl_allreduce *)a)->t, rank, buf, n_elems);
}

static void nccl_abort(pd_tp_allreduce *a)
{
    pd_nccl_tp_abort(((nccl_allreduce *)a)->t);
}

static void nccl_free(pd_tp_allreduce *a)
{
    if (!a) return;
    pd_nccl_tp_free(((nccl_allreduce *)a)->t);
    free(a);
}

static const pd_tp_allreduce_ops nccl_ops = {
    .name = "nccl",
    .run = nccl_run,
    .fail = NULL,
    .abort = nccl_abort,
    .step_end = NULL,
    .free = nccl_free,
};

int pd_cuda_group_check(void)
{
    return PD_OK;
}

int pd_cuda_group_backend(const pd_backend_params *bp, pd_backend **out)
{
    return pd_backend_cuda_create(bp, out);
}

int pd_cuda_group_allreduce(pd_backend *const *ranks, int n, pd_tp_allreduce **out)
{
    *out = NULL;
    bool distinct = true;
    for (int r = 0; r < n; r++)
        for (int q = 0; q < r; q++)
            distinct =
                distinct && pd_backend_cuda_device(ranks[q]) != pd_backend_cuda_device(ranks[r]);
    if (!distinct && !pd_nccl_multi_rank_gpu())
        return pd_error(PD_EUNSUPPORTED, "ranks share a GPU (NCCL takes one rank per GPU)");
    nccl_allreduce *a = calloc(1, sizeof *a);
    if (!a) return pd_error(PD_ENOMEM, "tensor parallel: out of memory");
    a->base.ops = &nccl_ops;
    int rc = pd_nccl_tp_create(ranks, n, &a->t);
    if (rc < 0) {
        free(a);
        return rc;
    }
    *out = &a->base;
    return PD_OK;
}

int pd_cuda_group_kv_blocks(pd_backend *const *ranks, int n, const pd_kv_params *kp, double util,
                            size_t *n_blocks)
{
    *n_blocks = 0;
    for (int r = 0; r < n; r++) {
        size_t nb = 0;
        PD_CHECK(pd_backend_cuda_kv_blocks(ranks[r], kp, util, &nb));
        if (r == 0 || nb < *n_blocks) *n_blocks = nb;
    }
    return PD_OK;
}
