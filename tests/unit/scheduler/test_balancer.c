/* Unit tests of pd-scheduler's routing policies (scheduler/balancer.h) on hand-made instance
 * tables: the least-load policy's costs, its turn-taking among ties, and that it never picks an
 * instance out of the routing set or one the request has tried. */
#include "harness.h"

#include "balancer.h"

static int pick(pd_balancer *b, const pd_balancer_target *t, size_t n, const bool *tried)
{
    return b->ops->select(b, t, n, tried);
}

TEST(least_load_picks_the_lowest_load_less_cached)
{
    pd_balancer *b = pd_balancer_least_load_create();
    ASSERT(b != NULL);
    pd_balancer_target t[3] = {{true, 300, 0}, {true, 100, 0}, {true, 200, 0}};
    for (int i = 0; i < 4; i++) ASSERT_EQ_INT(pick(b, t, 3, NULL), 1);
    /* 400 - 320 = 80 beats 100: the prompt's cached blocks count against the load */
    t[0].load = 400, t[0].cached = 320;
    ASSERT_EQ_INT(pick(b, t, 3, NULL), 0);
    b->ops->free(b);
}

TEST(least_load_ties_take_turns)
{
    pd_balancer *b = pd_balancer_least_load_create();
    ASSERT(b != NULL);
    pd_balancer_target t[4] = {{true, 0, 0}, {true, 0, 0}, {false, 0, 0}, {true, 0, 0}};
    int count[4] = {0};
    for (int i = 0; i < 12; i++) {
        int k = pick(b, t, 4, NULL);
        ASSERT(k >= 0 && k < 4);
        count[k]++;
    }
    /* the scan starts one instance further each pick: the down one's turn goes to the next */
    ASSERT_EQ_INT(count[0], 3);
    ASSERT_EQ_INT(count[1], 3);
    ASSERT_EQ_INT(count[2], 0);
    ASSERT_EQ_INT(count[3], 6);
    b->ops->free(b);
}

TEST(least_load_skips_down_and_tried_instances)
{
    pd_balancer *b = pd_balancer_least_load_create();
    ASSERT(b != NULL);
    pd_balancer_target t[3] = {{false, 0, 0}, {true, 500, 0}, {true, 900, 0}};
    bool tried[3] = {false, true, false};
    for (int i = 0; i < 3; i++) ASSERT_EQ_INT(pick(b, t, 3, tried), 2);
    tried[2] = true;
    ASSERT_EQ_INT(pick(b, t, 3, tried), -1);
    ASSERT_EQ_INT(pick(b, t, 0, NULL), -1);
    t[1].up = false, t[2].up = false;
    ASSERT_EQ_INT(pick(b, t, 3, NULL), -1);
    b->ops->free(b);
}
