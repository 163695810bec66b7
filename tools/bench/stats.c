/* pd-bench statistics: mean, median, std and percentiles the way vLLM's benchmark reports them
 * (numpy.mean / median / std / percentile with linear interpolation). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bench.h"
#include "util/status.h"

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double pdb_percentile_sorted(const double *sorted, size_t n, double pct)
{
    if (n == 0) return 0.0;
    double pos = pct / 100.0 * (double)(n - 1);
    size_t lo = (size_t)floor(pos);
    if (lo >= n - 1) return sorted[n - 1];
    double frac = pos - (double)lo;
    return sorted[lo] + (sorted[lo + 1] - sorted[lo]) * frac;
}

int pdb_stats_compute(const double *v, size_t n, pdb_stats *out)
{
    memset(out, 0, sizeof *out);
    if (n == 0) return PD_OK;
    double *s = malloc(n * sizeof *s);
    if (!s) return pd_error(PD_ENOMEM, "out of memory");
    memcpy(s, v, n * sizeof *s);
    qsort(s, n, sizeof *s, cmp_double);
    double sum = 0.0;
    for (size_t i = 0; i < n; i++) sum += s[i];
    out->mean = sum / (double)n;
    double var = 0.0;
    for (size_t i = 0; i < n; i++) var += (s[i] - out->mean) * (s[i] - out->mean);
    out->std = sqrt(var / (double)n);
    out->median = pdb_percentile_sorted(s, n, 50.0);
    out->p90 = pdb_percentile_sorted(s, n, 90.0);
    out->p99 = pdb_percentile_sorted(s, n, 99.0);
    out->min = s[0];
    out->max = s[n - 1];
    free(s);
    return PD_OK;
}
