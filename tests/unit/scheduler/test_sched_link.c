/* The engine's batch scheduler (common/engine/sched.h, in libpdcommon) and the api-server
 * (scheduler/apiserver.h, in pdsched) linked into one program. The api-server used to take the
 * engine's names (pd_sched, pd_sched_create, pd_sched_default_params, in scheduler/sched.h), so
 * a program that pulled in both objects failed to link with "multiple definition", and the
 * scheduler's include directory shadowed the system <sched.h>. This one includes all three
 * headers and calls into the objects that define those names in each library. */
#include "harness.h"

#include <sched.h>

#include "apiserver.h"
#include "engine/kvpool.h"
#include "engine/sched.h"

TEST(engine_and_apiserver_link_together)
{
    /* the engine's batch scheduler: defaults, create and free */
    pd_sched_params ep = pd_sched_default_params();
    ASSERT_OK(pd_sched_check_params(&ep));
    pd_kvpool *pool = NULL;
    ASSERT_OK(pd_kvpool_create(8, 16, &pool));
    pd_sched *es = NULL;
    int rc = pd_sched_create(&ep, pool, &es);
    if (rc == PD_OK) pd_sched_free(es);
    pd_kvpool_free(pool);
    ASSERT_OK(rc);
    /* the api-server: defaults, and create refusing parameters without --model */
    pd_apiserver_params ap = pd_apiserver_default_params();
    ASSERT_EQ_INT(ap.port, 8000);
    ASSERT_STR_EQ(ap.response_role, "assistant");
    pd_apiserver *as = NULL;
    ASSERT_ERR(pd_apiserver_create(&ap, &as), PD_EINVAL, "--model is required");
    ASSERT(as == NULL);
    pd_apiserver_free(NULL);
    /* the system <sched.h>, not a header of the scheduler's directory */
    ASSERT_EQ_INT(sched_yield(), 0);
}

/* --max-body-bytes-in-flight: 4 x --max-request-body-bytes unless given, and never below
 * --max-request-body-bytes (a body of the largest size could never be received). */
TEST(apiserver_body_bytes_in_flight_bound)
{
    pd_apiserver_params ap = pd_apiserver_default_params();
    ASSERT_EQ_INT(ap.max_body_bytes_in_flight, 0);
    ASSERT(pd_apiserver_body_bytes_in_flight(&ap) == 4 * (size_t)ap.max_request_body_bytes);
    ap.max_body_bytes_in_flight = 12345;
    ASSERT(pd_apiserver_body_bytes_in_flight(&ap) == 12345);
    ap.model = "unused";
    ap.max_request_body_bytes = 12346;
    pd_apiserver *as = NULL;
    ASSERT_ERR(pd_apiserver_create(&ap, &as), PD_EINVAL,
               "--max-body-bytes-in-flight 12345 is below --max-request-body-bytes 12346");
    ASSERT(as == NULL);
}
