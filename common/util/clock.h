/* Time: a monotonic clock for deadlines and durations, wall time for timestamps. */
#ifndef PD_UTIL_CLOCK_H
#define PD_UTIL_CLOCK_H

#include <stdint.h>

#define PD_NS_PER_US 1000LL
#define PD_NS_PER_MS 1000000LL
#define PD_NS_PER_S  1000000000LL

int64_t pd_now_ns(void);      /* CLOCK_MONOTONIC, nanoseconds */
int64_t pd_wall_ns(void);     /* CLOCK_REALTIME, nanoseconds since the epoch */
double pd_now_s(void);        /* monotonic seconds, for benchmarks */
void pd_sleep_ns(int64_t ns); /* sleeps the whole duration even when interrupted */

#endif
