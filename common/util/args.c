#include "util/args.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "util/log.h"
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

void pd_arg_early_log_level(int argc, char **argv)
{
    const char *level = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--log-level") == 0 && i + 1 < argc)
            level = argv[++i];
        else if (strncmp(argv[i], "--log-level=", 12) == 0)
            level = argv[i] + 12;
    }
    pd_log_level lv;
    if (level && pd_log_parse_level(level, &lv) == PD_OK) pd_log_set_level(lv);
}

int pd_arg_vllm_noop(const char *flag)
{
    static const char *const valueless[] = {"--disable-log-requests", "--disable-log-stats",
                                            "--trust-remote-code"};
    if (strcmp(flag, "--swap-space") == 0) return 2;
    for (size_t i = 0; i < sizeof valueless / sizeof *valueless; i++)
        if (strcmp(flag, valueless[i]) == 0) return 1;
    return 0;
}

int pd_arg_vllm_noop_take(const char *flag, const char *value)
{
    if (value) {
        double gib;
        PD_CHECK(pd_arg_f64(flag, value, &gib));
        if (gib < 0) return pd_error(PD_EINVAL, "%s: expected GiB >= 0, got \"%s\"", flag, value);
    }
    PD_INFO(NULL, "%s: a vLLM flag with no effect in pdserve; ignored", flag);
    return PD_OK;
}
