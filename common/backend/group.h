/* A backend group: the backends of an instance's tensor-parallel ranks, the all-reduce that sums
 * their partial results, and the size of the KV pool their memory holds.
 *
 * Design: the engine never knows which backend it runs on. It asks the group for one backend per
 * rank (CPU: the threads split between the ranks; CUDA: one device per rank, behind
 * backend/cuda/cuda_group.h), hands each rank's forward pass the all-reduce the group chose, and
 * sizes its KV pool by what the group says fits. The all-reduce is one of the implementations of
 * tp_allreduce.h: NCCL in place on each rank's stream when every rank has a GPU of its own (or
 * NCCL takes several ranks per GPU), else a sum staged through host memory in a fixed rank order.
 * A rank that fails mid-step must not leave the others waiting in an all-reduce forever, so the
 * group also follows each step's rank jobs (step_begin / rank_end / step_end): the host-staged
 * sum fails the waiting ranks at once; NCCL's waits cannot be broken, so the group gives the
 * other ranks RANK_FAIL_WAIT_MS to end their jobs and then aborts the communicators (every later
 * all-reduce fails: the instance must be restarted).
 */
#ifndef PD_BACKEND_GROUP_H
#define PD_BACKEND_GROUP_H

#include <stddef.h>

#include "backend/backend.h"
#include "backend/forward.h"

typedef struct pd_backend_group pd_backend_group;

#define PD_BACKEND_GROUP_MAX_DEVICES 16 /* CUDA devices of one group */

typedef struct {
    int n_ranks;          /* tensor-parallel size, >= 1 */
    pd_backend *borrowed; /* one rank only: run on this backend (not owned); NULL: create */
    int no_graphs;        /* 1: no CUDA graphs (the ranks' steps meet the host mid-step: a
                             pipeline stage); with n_ranks > 1 they are never used anyway */
    int n_threads;        /* CPU ranks: threads of all ranks together; <= 0 = all online cores */
    const char *cpu_threads_bind; /* CPU ranks: VLLM_CPU_OMP_THREADS_BIND's core lists, or NULL */
    const char *cpu_budget;       /* CPU ranks: PD_CPU_BUDGET's value (NULL: "host") */
    int dtype; /* -1: the backend's choice; else a pd_dtype: the weight dtype of CUDA ranks, the
                  compute dtype of CPU ranks */
    /* -- CUDA ranks ---------------------------------------------------------------------------- */
    int n_cuda_devices;            /* 0: CPU ranks; else n_ranks (ranks may share a GPU) */
    const int *cuda_devices;       /* (n_cuda_devices) CUDA ordinal of each rank */
    double gpu_memory_utilization; /* (0, 1]: this instance's share of each GPU (KV sizing) */
    /* -- capacities ---------------------------------------------------------------------------- */
    size_t max_tokens;          /* rows per step (each rank's backend) */
    size_t max_seqs;            /* sequences per step */
    size_t max_blocks;          /* block-table entries per step, all sequences */
    size_t max_allreduce_elems; /* the largest all-reduce, in activation elements */
    /* -- KV sizing on the host (CPU ranks, or a byte budget on GPUs) --------------------------- */
    size_t kv_cache_bytes; /* per rank; 0 = cpu_kv_bytes on CPU ranks, the GPU's share on CUDA */
    size_t cpu_kv_bytes;   /* CPU ranks: the default budget per rank (VLLM_CPU_KVCACHE_SPACE) */
} pd_backend_group_params;

/* PD_EINVAL naming the engine parameter (tensor_parallel_size, n_cuda_devices, ...) for a group
 * that cannot be made, PD_EUNSUPPORTED for CUDA ranks in a build without the CUDA backend. */
int pd_backend_group_check(const pd_backend_group_params *p);

/* Checks p, creates (or borrows) one backend per rank and chooses the all-reduce (logged).
 * p->cuda_devices is copied. Errors of the backends' creation pass through. */
int pd_backend_group_create(const pd_backend_group_params *p, pd_backend_group **out);
/* Frees the all-reduce, then the backends the group created (every weight, pool and forward pass
 * on them must have been freed). NULL is a no-op. */
void pd_backend_group_free(pd_backend_group *g);

int pd_backend_group_size(const pd_backend_group *g);
/* Rank r's backend (0 <= r < size). */
pd_backend *pd_backend_group_backend(const pd_backend_group *g, int rank);

/* The all-reduce of rank's forward pass (pd_forward_params.allreduce and allreduce_ctx); *fn NULL
 * for a group of one rank. Each rank calls it from the thread that runs its steps, in the same
 * order on every rank. */
void pd_backend_group_allreduce(pd_backend_group *g, int rank, pd_allreduce_fn *fn, void **ctx);
/* "nccl", "host" (staged through host memory), or "none" (one rank). */
const char *pd_backend_group_allreduce_name(const pd_backend_group *g);

/* A step's rank jobs, for more than one rank (no-ops for one). step_begin before any rank starts
 * the step; rank_end from each rank's thread when its job ended with status (negative: failed,
 * see the file-top comment); step_end once every rank_end returned. */
void pd_backend_group_step_begin(pd_backend_group *g);
void pd_backend_group_rank_end(pd_backend_group *g, int rank, int status);
void pd_backend_group_step_end(pd_backend_group *g);

/* Blocks of a KV pool shaped like kp (kp->n_blocks ignored) that every rank can hold, with the
 * same block ids on every rank: on CUDA ranks without kv_cache_bytes, the smallest share of the
 * ranks' GPUs left by gpu_memory_utilization after the weights and buffers
 * (pd_backend_cuda_kv_blocks; call after the forward passes are created); otherwise
 * kv_cache_bytes, else cpu_kv_bytes (each rank), over the bytes of one block. */
int pd_backend_group_kv_blocks(pd_backend_group *g, const pd_kv_params *kp, size_t *n_blocks);

#endif
