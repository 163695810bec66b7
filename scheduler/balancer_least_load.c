/* Routing policy "least load" (balancer.h): the instance with the fewest outstanding tokens,
 * less the tokens of the prompt its prefix cache likely holds, among those in the routing set
 * that the request has not tried.
 *
 * Design: each pick scans the instances from a cursor that moves on by one per pick, and only a
 * strictly lower cost displaces the best so far, so instances that tie (an idle cluster, or
 * load figures not read yet) take turns instead of the first one taking every request.
 */
#include <stdlib.h>

#include "balancer.h"

typedef struct {
    pd_balancer base;
    unsigned next; /* where the next scan starts (modulo the number of instances) */
} least_load;

static int least_load_select(pd_balancer *b, const pd_balancer_target *targets, size_t n,
                             const bool *tried)
{
    least_load *ll = (least_load *)b;
    if (n == 0) return -1;
    int best = -1;
    int64_t best_cost = 0;
    unsigned start = ll->next++;
    for (size_t i = 0; i < n; i++) {
        size_t k = (start + (unsigned)i) % (unsigned)n;
        const pd_balancer_target *t = &targets[k];
        if (!t->up || (tried && tried[k])) continue;
        int64_t cost = t->load - t->cached;
        if (best < 0 || cost < best_cost) {
            best = (int)k;
            best_cost = cost;
        }
    }
    return best;
}

static void least_load_free(pd_balancer *b)
{
    free(b);
}

static const pd_balancer_ops LEAST_LOAD_OPS = {least_load_select, least_load_free};

pd_balancer *pd_balancer_least_load_create(void)
{
    least_load *ll = calloc(1, sizeof *ll);
    if (!ll) return NULL;
    ll->base.ops = &LEAST_LOAD_OPS;
    return &ll->base;
}
