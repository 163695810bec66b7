/* Command-line value parsing shared by every executable, with messages that name the flag:
 * "--max-tokens: expected an integer in [1, 16777216], got \"abc\"". */
#ifndef PD_UTIL_ARGS_H
#define PD_UTIL_ARGS_H

#include <stdint.h>

/* A whole decimal integer in [lo, hi] (hi == INT64_MAX: "an integer >= lo"). */
int pd_arg_i64(const char *flag, const char *s, int64_t lo, int64_t hi, int64_t *out);
/* A finite number (range checks are the caller's). */
int pd_arg_f64(const char *flag, const char *s, double *out);

/* Applies argv's --log-level L (or --log-level=L; the last one) before the flags are parsed, so
 * that what parsing logs (the vLLM flags below, --enforce-eager) already follows it. A bad value
 * is left for the parser to report. */
void pd_arg_early_log_level(int argc, char **argv);

/* vLLM flags that have no effect in pdserve but that the guide's command lines carry
 * (--swap-space N, --disable-log-requests, --disable-log-stats, --trust-remote-code): 0 when flag
 * is none of them, else 1 + the number of values it takes. */
int pd_arg_vllm_noop(const char *flag);
/* Checks the value of one (value: NULL for the valueless ones; --swap-space: GiB >= 0) and logs
 * at INFO that it is ignored. */
int pd_arg_vllm_noop_take(const char *flag, const char *value);

#endif
