/* Unit tests: float formatting (Python repr, Go style) and Prometheus exposition. */
#include "harness.h"

#include <math.h>
#include <stdlib.h>

#include "metrics/metrics.h"
#include "util/fmt.h"

/* Expected strings printed by CPython 3.11's repr(float) for the same doubles. */
static const struct {
    double v;
    const char *repr;
} REPRS[] = {
    {0.1, "0.1"},
    {1.0, "1.0"},
    {1e+16, "1e+16"},
    {1e-05, "1e-05"},
    {0.0001, "0.0001"},
    {123.456, "123.456"},
    {1.5e-07, "1.5e-07"},
    {-0.0123, "-0.0123"},
    {-9999.0, "-9999.0"},
    {2.5e-05, "2.5e-05"},
    {1e+22, "1e+22"},
    {5e-324, "5e-324"},
    {1.7976931348623157e+308, "1.7976931348623157e+308"},
    {0.30000000000000004, "0.30000000000000004"},
    {1.2345678901234568e+17, "1.2345678901234568e+17"},
    {1000000000000000.0, "1000000000000000.0"},
    {9999999999999998.0, "9999999999999998.0"},
    {0.5, "0.5"},
    {100.0, "100.0"},
    {-1.0, "-1.0"},
    {0.3333333333333333, "0.3333333333333333"},
    {0.0, "0.0"},
};

TEST(fmt_double_matches_python_repr)
{
    char buf[64];
    for (size_t i = 0; i < sizeof REPRS / sizeof REPRS[0]; i++) {
        pd_fmt_double(REPRS[i].v, buf, sizeof buf);
        ASSERT_STR_EQ(buf, REPRS[i].repr);
        ASSERT(strtod(buf, NULL) == REPRS[i].v);
    }
}

TEST(fmt_double_round_trips_random_values)
{
    char buf[64];
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < 100000; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        double v;
        memcpy(&v, &x, sizeof v);
        if (!isfinite(v)) continue;
        pd_fmt_double(v, buf, sizeof buf);
        ASSERT_MSG(strtod(buf, NULL) == v, "%s does not read back as %.17g", buf, v);
        ASSERT(strchr(buf, '.') || strchr(buf, 'e'));
    }
}

TEST(fmt_go_float_style)
{
    char buf[64];
    const struct {
        double v;
        const char *s;
    } cases[] = {
        {0.001, "0.001"},
        {1.0, "1.0"},
        {2560.0, "2560.0"},
        {1e6, "1e+06"},
        {1234567.0, "1.234567e+06"},
        {12.0, "12.0"},
        {0.125, "0.125"},
        {INFINITY, "+Inf"},
        {-INFINITY, "-Inf"},
        {999999.0, "999999.0"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        pd_fmt_go_float(cases[i].v, buf, sizeof buf);
        ASSERT_STR_EQ(buf, cases[i].s);
    }
}

TEST(metrics_render_counter_gauge_histogram)
{
    pd_metrics *r = pd_metrics_create();
    pd_metric *c = pd_metrics_add(r, PD_METRIC_COUNTER, "vllm:request_success_total",
                                  "Count of successfully processed requests.",
                                  "model_name,engine,finished_reason", NULL, 0);
    pd_metric *g =
        pd_metrics_add(r, PD_METRIC_GAUGE, "pd:instance_up", "Up.", "role,instance", NULL, 0);
    double b[] = {0.3, 0.5, 1.0};
    pd_metric *h = pd_metrics_add(r, PD_METRIC_HISTOGRAM, "vllm:e2e_request_latency_seconds",
                                  "Latency.", "model_name,engine", b, 3);
    ASSERT(c && g && h);
    const char *stop[] = {"m", "0", "stop"}, *len[] = {"m", "0", "length"};
    pd_metric_touch(c, len);
    pd_metric_inc(c, stop, 1);
    pd_metric_inc(c, stop, 40);
    const char *inst[] = {"prefill", "10.0.0.1:8001"};
    pd_metric_set(g, inst, 1);
    const char *ml[] = {"m", "0"};
    pd_metric_observe(h, ml, 0.2);
    pd_metric_observe(h, ml, 0.4);
    pd_metric_observe(h, ml, 9.5);
    char *text = pd_metrics_render(r);
    const char *want =
        "# HELP vllm:request_success_total Count of successfully processed requests.\n"
        "# TYPE vllm:request_success_total counter\n"
        "vllm:request_success_total{model_name=\"m\",engine=\"0\",finished_reason=\"length\"} 0.0\n"
        "vllm:request_success_total{model_name=\"m\",engine=\"0\",finished_reason=\"stop\"} 41.0\n"
        "# HELP pd:instance_up Up.\n"
        "# TYPE pd:instance_up gauge\n"
        "pd:instance_up{role=\"prefill\",instance=\"10.0.0.1:8001\"} 1.0\n"
        "# HELP vllm:e2e_request_latency_seconds Latency.\n"
        "# TYPE vllm:e2e_request_latency_seconds histogram\n"
        "vllm:e2e_request_latency_seconds_bucket{model_name=\"m\",engine=\"0\",le=\"0.3\"} 1.0\n"
        "vllm:e2e_request_latency_seconds_bucket{model_name=\"m\",engine=\"0\",le=\"0.5\"} 2.0\n"
        "vllm:e2e_request_latency_seconds_bucket{model_name=\"m\",engine=\"0\",le=\"1.0\"} 2.0\n"
        "vllm:e2e_request_latency_seconds_bucket{model_name=\"m\",engine=\"0\",le=\"+Inf\"} 3.0\n"
        "vllm:e2e_request_latency_seconds_count{model_name=\"m\",engine=\"0\"} 3.0\n"
        "vllm:e2e_request_latency_seconds_sum{model_name=\"m\",engine=\"0\"} 10.1\n";
    ASSERT_STR_EQ(text, want);
    ASSERT_NEAR(pd_metric_value(c, stop), 41, 0);
    ASSERT_NEAR(pd_metric_value(h, ml), 3, 0);
    free(text);
    pd_metrics_free(r);
}

TEST(metrics_bad_definitions)
{
    pd_metrics *r = pd_metrics_create();
    ASSERT(pd_metrics_add(r, PD_METRIC_COUNTER, "requests", "x", NULL, NULL, 0) == NULL);
    ASSERT_CONTAINS(pd_last_error(), "must end in _total");
    double bad[] = {1.0, 0.5};
    ASSERT(pd_metrics_add(r, PD_METRIC_HISTOGRAM, "h", "x", NULL, bad, 2) == NULL);
    ASSERT_CONTAINS(pd_last_error(), "ascending");
    ASSERT(pd_metrics_add(r, PD_METRIC_GAUGE, "g", "x", NULL, NULL, 0) != NULL);
    ASSERT(pd_metrics_add(r, PD_METRIC_GAUGE, "g", "x", NULL, NULL, 0) == NULL);
    ASSERT_CONTAINS(pd_last_error(), "registered twice");
    pd_metrics_free(r);
}

TEST(metrics_label_escaping_and_no_labels)
{
    pd_metrics *r = pd_metrics_create();
    pd_metric *g = pd_metrics_add(r, PD_METRIC_GAUGE, "g", "h", "name", NULL, 0);
    pd_metric *n = pd_metrics_add(r, PD_METRIC_GAUGE, "plain", "h", NULL, NULL, 0);
    const char *v[] = {"a\"b\\c\nd"};
    pd_metric_set(g, v, 2.5);
    pd_metric_set(n, NULL, 1e6);
    char *text = pd_metrics_render(r);
    ASSERT_CONTAINS(text, "g{name=\"a\\\"b\\\\c\\nd\"} 2.5\n");
    ASSERT_CONTAINS(text, "\nplain 1e+06\n");
    free(text);
    pd_metrics_free(r);
}

TEST(metrics_125_buckets)
{
    double b[64];
    size_t n = pd_metrics_125_buckets(4096, b, 64);
    const double want[] = {1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000};
    ASSERT_EQ_INT(n, 11);
    for (size_t i = 0; i < n; i++) ASSERT_NEAR(b[i], want[i], 0);
    ASSERT_EQ_INT(pd_metrics_125_buckets(0.5, b, 64), 0);
    ASSERT_EQ_INT(pd_metrics_125_buckets(5, b, 64), 3);
}

/* A histogram gathered elsewhere (an instance's steps) merges bucket by bucket: counts land in
 * their buckets, +Inf's only in the count, the sum as given; a count array of the wrong length
 * changes nothing. */
TEST(metrics_merge_bucket_counts)
{
    pd_metrics *r = pd_metrics_create();
    double b[] = {1, 8, 16};
    pd_metric *h = pd_metrics_add(r, PD_METRIC_HISTOGRAM, "h", "x", "engine", b, 3);
    ASSERT(h);
    const char *lv[] = {"0"};
    pd_metric_observe(h, lv, 4);
    const double counts[] = {2, 0, 1, 3}; /* two 1-token steps, one of 9..16, three above 16 */
    pd_metric_merge(h, lv, counts, 4, 2 + 12 + 3 * 100);
    pd_metric_merge(h, lv, counts, 3, 1000); /* wrong length: ignored */
    char *text = pd_metrics_render(r);
    ASSERT_CONTAINS(text, "h_bucket{engine=\"0\",le=\"1.0\"} 2.0\n"
                          "h_bucket{engine=\"0\",le=\"8.0\"} 3.0\n"
                          "h_bucket{engine=\"0\",le=\"16.0\"} 4.0\n"
                          "h_bucket{engine=\"0\",le=\"+Inf\"} 7.0\n"
                          "h_count{engine=\"0\"} 7.0\n"
                          "h_sum{engine=\"0\"} 318.0\n");
    free(text);
    pd_metrics_free(r);
}

/* An info gauge's label values change: clear drops the old series, the family stays. */
TEST(metrics_clear_family)
{
    pd_metrics *r = pd_metrics_create();
    pd_metric *g = pd_metrics_add(r, PD_METRIC_GAUGE, "i", "x", "block_size", NULL, 0);
    ASSERT(g);
    const char *a[] = {"16"}, *b[] = {"32"};
    pd_metric_set(g, a, 1);
    pd_metric_clear(g);
    pd_metric_set(g, b, 1);
    char *text = pd_metrics_render(r);
    ASSERT_STR_EQ(text, "# HELP i x\n# TYPE i gauge\ni{block_size=\"32\"} 1.0\n");
    free(text);
    pd_metrics_free(r);
}
