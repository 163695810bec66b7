/* The CUDA half of a backend group (cuda_group.h) in a build without the CUDA backend: every call
 * refuses with the same message. */
#include "backend/cuda/cuda_group.h"

#include "util/status.h"

int pd_cuda_group_check(void)
{
    return pd_error(PD_EUNSUPPORTED, "this build has no CUDA backend (configure with meson "
                                     "-Dcuda=enabled on a machine with nvcc, cuBLAS and NCCL)");
}

int pd_cuda_group_backend(const pd_backend_params *bp, pd_backend **out)
{
    (void)bp;
    *out = NULL;
    return pd_cuda_group_check();
}

int pd_cuda_group_allreduce(pd_backend *const *ranks, int n, pd_tp_allreduce **out)
{
    (void)ranks;
    (void)n;
    *out = NULL;
    return pd_cuda_group_check();
}

int pd_cuda_group_kv_blocks(pd_backend *const *ranks, int n, const pd_kv_params *kp, double util,
                            size_t *n_blocks)
{
    (void)ranks;
    (void)n;
    (void)kp;
    (void)util;
    *n_blocks = 0;
    return pd_cuda_group_check();
}
