/* Prometheus registry and text exposition (see metrics.h). Series are found by a linear scan
 * of their joined label values: families hold a handful of series (finish reasons, instances). */
#include "metrics/metrics.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/fmt.h"
#include "util/status.h"

#define MAX_LABELS 8

typedef struct series {
    struct series *next;
    char *key;      /* label values joined by '\x1f' */
    char **values;  /* (n_labels) */
    double value;   /* counter/gauge value, or histogram sum */
    double count;   /* histogram observations */
    double *bucket; /* (n_buckets) cumulative counts are computed at render */
} series;

struct pd_metric {
    pd_metric *next;
    pd_metrics *reg;
    pd_metric_type type;
    char *name, *help;
    char *labels[MAX_LABELS];
    size_t n_labels;
    double *buckets;
    size_t n_buckets;
    series *head, *tail;
};

struct pd_metrics {
    pthread_mutex_t mu;
    pd_metric *head, *tail;
};

pd_metrics *pd_metrics_create(void)
{
    pd_metrics *r = calloc(1, sizeof *r);
    if (r) pthread_mutex_init(&r->mu, NULL);
    return r;
}

/* Frees every series of m; called with the registry lock held (or at teardown). */
static void free_series(pd_metric *m)
{
    for (series *s = m->head, *sn; s; s = sn) {
        sn = s->next;
        for (size_t i = 0; i < m->n_labels; i++) free(s->values[i]);
        free(s->values);
        free(s->bucket);
        free(s->key);
        free(s);
    }
    m->head = m->tail = NULL;
}

void pd_metrics_free(pd_metrics *r)
{
    if (!r) return;
    for (pd_metric *m = r->head, *mn; m; m = mn) {
        mn = m->next;
        free_series(m);
        for (size_t i = 0; i < m->n_labels; i++) free(m->labels[i]);
        free(m->buckets);
        free(m->name);
        free(m->help);
        free(m);
    }
    pthread_mutex_destroy(&r->mu);
    free(r);
}

pd_metric *pd_metrics_add(pd_metrics *r, pd_metric_type type, const char *name, const char *help,
                          const char *labels, const double *buckets, size_t n_buckets)
{
    size_t nl = strlen(name);
    if (type == PD_METRIC_COUNTER && (nl < 6 || strcmp(name + nl - 6, "_total") != 0)) {
        pd_error(PD_EINVAL, "metric %s: a counter's name must end in _total", name);
        return NULL;
    }
    if (type == PD_METRIC_HISTOGRAM && n_buckets == 0) {
        pd_error(PD_EINVAL, "metric %s: a histogram needs buckets", name);
        return NULL;
    }
    for (size_t i = 1; i < n_buckets; i++)
        if (!(buckets[i] > buckets[i - 1])) {
            pd_error(PD_EINVAL, "metric %s: buckets must be ascending", name);
            return NULL;
        }
    pthread_mutex_lock(&r->mu);
    for (pd_metric *m = r->head; m; m = m->next)
        if (strcmp(m->name, name) == 0) {
            pthread_mutex_unlock(&r->mu);
            pd_error(PD_EEXIST, "metric %s: registered twice", name);
            return NULL;
        }
    pd_metric *m = calloc(1, sizeof *m);
    m->reg = r;
    m->type = type;
    m->name = strdup(name);
    m->help = strdup(help ? help : "");
    if (labels && *labels) {
        char *copy = strdup(labels), *save = NULL;
        for (char *t = strtok_r(copy, ",", &save); t && m->n_labels < MAX_LABELS;
             t = strtok_r(NULL, ",", &save))
            m->labels[m->n_labels++] = strdup(t);
        free(copy);
    }
    if (type == PD_METRIC_HISTOGRAM) {
        m->buckets = malloc(n_buckets * sizeof *m->buckets);
        memcpy(m->buckets, buckets, n_buckets * sizeof *m->buckets);
        m->n_buckets = n_buckets;
    }
    if (r->tail)
        r->tail->next = m;
    else
        r->head = m;
    r->tail = m;
    pthread_mutex_unlock(&r->mu);
    return m;
}

/* Finds or creates a series; called with the registry lock held. */
static series *get_series(pd_metric *m, const char *const *values)
{
    char key[1024];
    size_t k = 0;
    for (size_t i = 0; i < m->n_labels; i++)
        k += (size_t)snprintf(key + k, k < sizeof key ? sizeof key - k : 0, "%s\x1f",
                              values && values[i] ? values[i] : "");
    if (k >= sizeof key) k = sizeof key - 1;
    key[k] = '\0';
    for (series *s = m->head; s; s = s->next)
        if (strcmp(s->key, key) == 0) return s;
    series *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->key = strdup(key);
    s->values = calloc(m->n_labels ? m->n_labels : 1, sizeof *s->values);
    for (size_t i = 0; i < m->n_labels; i++)
        s->values[i] = strdup(values && values[i] ? values[i] : "");
    if (m->n_buckets) s->bucket = calloc(m->n_buckets, sizeof *s->bucket);
    if (m->tail)
        m->tail->next = s;
    else
        m->head = s;
    m->tail = s;
    return s;
}

static void update(pd_metric *m, const char *const *values, double v, int op)
{
    if (!m) return;
    pthread_mutex_lock(&m->reg->mu);
    series *s = get_series(m, values);
    if (s) {
        if (op == 0) {
            s->value += v;
        } else if (op == 1) {
            s->value = v;
        } else if (op == 2) {
            s->value += v;
            s->count += 1;
            for (size_t i = 0; i < m->n_buckets; i++)
                if (v <= m->buckets[i]) {
                    s->bucket[i] += 1;
                    break;
                }
        }
    }
    pthread_mutex_unlock(&m->reg->mu);
}

void pd_metric_inc(pd_metric *m, const char *const *lv, double v)
{
    update(m, lv, v, 0);
}
void pd_metric_set(pd_metric *m, const char *const *lv, double v)
{
    update(m, lv, v, 1);
}
void pd_metric_observe(pd_metric *m, const char *const *lv, double v)
{
    update(m, lv, v, 2);
}
void pd_metric_touch(pd_metric *m, const char *const *lv)
{
    update(m, lv, 0, 3);
}

void pd_metric_merge(pd_metric *m, const char *const *lv, const double *counts, size_t n,
                     double sum)
{
    if (!m || m->type != PD_METRIC_HISTOGRAM || n != m->n_buckets + 1) return;
    pthread_mutex_lock(&m->reg->mu);
    series *s = get_series(m, lv);
    if (s) {
        for (size_t i = 0; i < n; i++) {
            if (i < m->n_buckets) s->bucket[i] += counts[i];
            s->count += counts[i];
        }
        s->value += sum;
    }
    pthread_mutex_unlock(&m->reg->mu);
}

void pd_metric_clear(pd_metric *m)
{
    if (!m) return;
    pthread_mutex_lock(&m->reg->mu);
    free_series(m);
    pthread_mutex_unlock(&m->reg->mu);
}

double pd_metric_value(pd_metric *m, const char *const *lv)
{
    pthread_mutex_lock(&m->reg->mu);
    series *s = get_series(m, lv);
    double v = s ? (m->type == PD_METRIC_HISTOGRAM ? s->count : s->value) : 0;
    pthread_mutex_unlock(&m->reg->mu);
    return v;
}

/* ---- rendering ---- */

typedef struct {
    char *buf;
    size_t len, cap;
    int oom;
} sbuf;

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...)
{
    if (b->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->buf + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) return;
        if (b->len + (size_t)n < b->cap) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = b->cap * 2 + (size_t)n + 1;
        char *p = realloc(b->buf, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->buf = p;
        b->cap = cap;
    }
}

/* Label set {a="x",b="y"[,le="..."]} with escaping of \ " and newline. */
static void sb_labels(sbuf *b, const pd_metric *m, const series *s, const char *le)
{
    if (m->n_labels == 0 && !le) return;
    sb_printf(b, "{");
    for (size_t i = 0; i < m->n_labels; i++) {
        sb_printf(b, "%s%s=\"", i ? "," : "", m->labels[i]);
        for (const char *c = s->values[i]; *c; c++) {
            if (*c == '\\' || *c == '"')
                sb_printf(b, "\\%c", *c);
            else if (*c == '\n')
                sb_printf(b, "\\n");
            else
                sb_printf(b, "%c", *c);
        }
        sb_printf(b, "\"");
    }
    if (le) sb_printf(b, "%sle=\"%s\"", m->n_labels ? "," : "", le);
    sb_printf(b, "}");
}

char *pd_metrics_render(pd_metrics *r)
{
    sbuf b = {.buf = malloc(4096), .cap = 4096};
    if (!b.buf) return NULL;
    b.buf[0] = '\0';
    static const char *const type_names[] = {"counter", "gauge", "histogram"};
    char num[40], le[40];
    pthread_mutex_lock(&r->mu);
    for (pd_metric *m = r->head; m; m = m->next) {
        sb_printf(&b, "# HELP %s %s\n# TYPE %s %s\n", m->name, m->help, m->name,
                  type_names[m->type]);
        for (series *s = m->head; s; s = s->next) {
            if (m->type != PD_METRIC_HISTOGRAM) {
                pd_fmt_go_float(s->value, num, sizeof num);
                sb_printf(&b, "%s", m->name);
                sb_labels(&b, m, s, NULL);
                sb_printf(&b, " %s\n", num);
                continue;
            }
            double cum = 0;
            for (size_t i = 0; i <= m->n_buckets; i++) {
                if (i < m->n_buckets) {
                    cum += s->bucket[i];
                    pd_fmt_go_float(m->buckets[i], le, sizeof le);
                } else {
                    cum = s->count;
                    snprintf(le, sizeof le, "+Inf");
                }
                pd_fmt_go_float(cum, num, sizeof num);
                sb_printf(&b, "%s_bucket", m->name);
                sb_labels(&b, m, s, le);
                sb_printf(&b, " %s\n", num);
            }
            pd_fmt_go_float(s->count, num, sizeof num);
            sb_printf(&b, "%s_count", m->name);
            sb_labels(&b, m, s, NULL);
            sb_printf(&b, " %s\n", num);
            pd_fmt_go_float(s->value, num, sizeof num);
            sb_printf(&b, "%s_sum", m->name);
            sb_labels(&b, m, s, NULL);
            sb_printf(&b, " %s\n", num);
        }
    }
    pthread_mutex_unlock(&r->mu);
    if (b.oom) {
        free(b.buf);
        return NULL;
    }
    return b.buf;
}

size_t pd_metrics_125_buckets(double limit, double *out, size_t cap)
{
    static const double steps[] = {1, 2, 5};
    size_t n = 0;
    for (double scale = 1; n < cap; scale *= 10)
        for (int i = 0; i < 3 && n < cap; i++) {
            double v = steps[i] * scale;
            if (v > limit) return n;
            out[n++] = v;
        }
    return n;
}
