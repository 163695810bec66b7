#include "util/clock.h"

#include <errno.h>
#include <time.h>

static int64_t ts_ns(clockid_t id)
{
    struct timespec ts;
    clock_gettime(id, &ts);
    return (int64_t)ts.tv_sec * PD_NS_PER_S + ts.tv_nsec;
}

int64_t pd_now_ns(void)
{
    return ts_ns(CLOCK_MONOTONIC);
}

int64_t pd_wall_ns(void)
{
    return ts_ns(CLOCK_REALTIME);
}

double pd_now_s(void)
{
    return (double)pd_now_ns() / 1e9;
}

void pd_sleep_ns(int64_t ns)
{
    if (ns <= 0) return;
    struct timespec req = {.tv_sec = ns / PD_NS_PER_S, .tv_nsec = ns % PD_NS_PER_S}, rem;
    while (nanosleep(&req, &rem) != 0 && errno == EINTR) req = rem;
}
