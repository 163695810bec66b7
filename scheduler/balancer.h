/* Routing policies of pd-scheduler: which instance of a role a request goes to.
 *
 * Design (h2o's balancer): a policy is an ops table of two callbacks, select and free, over
 * state of its own (a round-robin cursor, say). The registry owns one policy object per role and
 * calls select under its lock with a snapshot of that role's instances in ranktable order: each
 * one's routing state and load, what its prefix cache likely holds of the request's prompt, and
 * which instances this request has tried already (a retry goes elsewhere). The registry charges
 * what select picked; a policy never sees the registry, so another policy is one more file.
 */
#ifndef PD_SCHEDULER_BALANCER_H
#define PD_SCHEDULER_BALANCER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* One instance of the role at the time of the pick. */
typedef struct {
    bool up;        /* in the routing set */
    int64_t load;   /* outstanding tokens: prefill, the prompt tokens this scheduler has in
                       flight there; decode, running + reserved tokens from its Stats plus
                       this scheduler's in flight */
    int64_t cached; /* tokens of the request's prompt its prefix cache likely holds (0 for a
                       pick without a prompt) */
} pd_balancer_target;

typedef struct pd_balancer pd_balancer;

typedef struct {
    /* The index into targets (n of them) of the instance to use: up, and not tried[i] (tried
     * is NULL when nothing was tried). -1 when there is none. Called under the registry's
     * lock, one call at a time. */
    int (*select)(pd_balancer *b, const pd_balancer_target *targets, size_t n, const bool *tried);
    void (*free)(pd_balancer *b);
} pd_balancer_ops;

/* The first member of every policy's own struct. */
struct pd_balancer {
    const pd_balancer_ops *ops;
};

/* Least outstanding tokens less the cached ones; ties take turns. NULL when out of memory. */
pd_balancer *pd_balancer_least_load_create(void);

#endif
