/* Prometheus metrics: a registry of counter, gauge and histogram families with labels, rendered
 * in the text exposition format the API contract §16 fixes (HELP, TYPE, samples; counters named
 * *_total; histogram buckets ascending then +Inf, then _count, then _sum; values in Go float
 * style "12.0", "1e+06"). Thread-safe (one mutex per registry): engine, RPC and loop threads
 * update the same registry. Families keep their registration order; series of a family keep
 * their creation order. */
#ifndef PD_METRICS_METRICS_H
#define PD_METRICS_METRICS_H

#include <stddef.h>

typedef struct pd_metrics pd_metrics;
typedef struct pd_metric pd_metric; /* a family */

typedef enum { PD_METRIC_COUNTER = 0, PD_METRIC_GAUGE = 1, PD_METRIC_HISTOGRAM = 2 } pd_metric_type;

pd_metrics *pd_metrics_create(void);
void pd_metrics_free(pd_metrics *r);

/* Registers a family. labels: comma-separated label names ("model_name,engine") or NULL.
 * Histograms take ascending bucket bounds (+Inf is implicit). NULL on a bad definition (the
 * message says why: duplicate name, counter not ending in _total, buckets not ascending). */
pd_metric *pd_metrics_add(pd_metrics *r, pd_metric_type type, const char *name, const char *help,
                          const char *labels, const double *buckets, size_t n_buckets);

/* Updates the series named by label values (one per label name, in order; NULL when the family
 * has no labels). A series is created on first use. */
void pd_metric_inc(pd_metric *m, const char *const *label_values, double v);     /* counter/gauge */
void pd_metric_set(pd_metric *m, const char *const *label_values, double v);     /* gauge */
void pd_metric_observe(pd_metric *m, const char *const *label_values, double v); /* histogram */
/* Adds to a histogram series observations already sorted into its buckets: counts[i]
 * observations fell in bucket i (not cumulative; counts[n_buckets] is +Inf's), of total sum.
 * n must be the family's bucket count + 1 (else nothing changes). For figures a process
 * gathered itself (an instance's per-step histogram). */
void pd_metric_merge(pd_metric *m, const char *const *label_values, const double *counts, size_t n,
                     double sum);
/* Drops every series of the family (an info gauge whose label values changed). */
void pd_metric_clear(pd_metric *m);
/* Creates the series with value 0 (so it exists from start-up). */
void pd_metric_touch(pd_metric *m, const char *const *label_values);
/* Current value of a counter/gauge series, or a histogram's count (0 when absent). */
double pd_metric_value(pd_metric *m, const char *const *label_values);

/* The exposition text (malloc'd; caller frees). NULL when out of memory. */
char *pd_metrics_render(pd_metrics *r);

/* Fills out with the contract's "1-2-5 up to L" buckets (1, 2, 5, 10, ... <= limit); returns the
 * count (at most cap). */
size_t pd_metrics_125_buckets(double limit, double *out, size_t cap);

#endif
