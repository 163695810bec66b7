#include "util/args.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "util/status.h"

int pd_arg_i64(const char *flag, const char *s, int64_t lo, int64_t hi, int64_t *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) {
        if (hi == INT64_MAX)
            return pd_error(PD_EINVAL, "%s: expected an integer >= %lld, got \"%s\"", flag,
                            (long long)lo, s);
        return pd_error(PD_EINVAL, "%s: expected an integer in [%lld, %lld], got \"%s\"", flag,
                        (long long)lo, (long long)hi, s);
    }
    *out = v;
    return PD_OK;
}

int pd_arg_f64(const char *flag, const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v))
        return pd_error(PD_EINVAL, "%s: expected a number, got \"%s\"", flag, s);
    *out = v;
    return PD_OK;
}
