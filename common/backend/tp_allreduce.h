/* Tensor-parallel all-reduce: one interface, one file per implementation (the backend group,
 * group.h, picks one per instance).
 *
 * Implementations: tp_allreduce_host.c (every backend: partial sums staged through host memory
 * and added in rank order) and the NCCL one of backend/cuda/cuda_group.c (in place on each
 * rank's CUDA stream). run is called by every rank from its own thread, in the same order on
 * every rank; the other entries from any thread.
 */
#ifndef PD_BACKEND_TP_ALLREDUCE_H
#define PD_BACKEND_TP_ALLREDUCE_H

#include <stddef.h>

#include "backend/backend.h"

typedef struct pd_tp_allreduce pd_tp_allreduce;

typedef struct {
    const char *name; /* pd_backend_group_allreduce_name */
    /* buf (n_elems activations on rank's backend b) = the sum of every rank's buf, in place. */
    int (*run)(pd_tp_allreduce *a, int rank, pd_backend *b, void *buf, size_t n_elems);
    /* A rank failed mid-step: ends at once, with an error, the waits of the others that can be
     * ended that way. NULL when none can. */
    void (*fail)(pd_tp_allreduce *a);
    /* Ends every wait in flight for good; later runs fail. NULL when fail suffices. */
    void (*abort)(pd_tp_allreduce *a);
    /* Every rank's job of a step ended (after a fail too): ready for the next step. NULL: none. */
    void (*step_end)(pd_tp_allreduce *a);
    void (*free)(pd_tp_allreduce *a);
} pd_tp_allreduce_ops;

/* The base of every implementation's state (its first member). */
struct pd_tp_allreduce {
    const pd_tp_allreduce_ops *ops;
};

/* The host-staged all-reduce over n_ranks (>= 2) ranks, for at most max_elems elements. */
int pd_tp_allreduce_host_create(int n_ranks, size_t max_elems, pd_tp_allreduce **out);

#endif
