/* Command-line value parsing shared by every executable, with messages that name the flag:
 * "--max-tokens: expected an integer in [1, 16777216], got \"abc\"". */
#ifndef PD_UTIL_ARGS_H
#define PD_UTIL_ARGS_H

#include <stdint.h>

/* A whole decimal integer in [lo, hi] (hi == INT64_MAX: "an integer >= lo"). */
int pd_arg_i64(const char *flag, const char *s, int64_t lo, int64_t hi, int64_t *out);
/* A finite number (range checks are the caller's). */
int pd_arg_f64(const char *flag, const char *s, double *out);

#endif
