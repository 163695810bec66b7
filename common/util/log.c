/* One-line-per-event logger (see log.h). Each line is formatted into a stack buffer
 * and written with one write(2): no lock, no interleaving, no allocation. A rate-limited call
 * site takes one process-wide lock for its counters only (such sites are the frequent
 * refusals, not a hot path). */
#include "util/log.h"
#include "util/status.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

static _Atomic int g_level = PD_LOG_INFO;
static _Atomic int g_fd = 2;
static char g_role[32] = "-";

static const char *const level_names[] = {"DEBUG", "INFO", "WARN", "ERROR"};

int pd_log_parse_level(const char *s, pd_log_level *out)
{
    static const struct {
        const char *name;
        pd_log_level level;
    } table[] = {
        {"debug", PD_LOG_DEBUG},  {"info", PD_LOG_INFO},   {"warn", PD_LOG_WARN},
        {"warning", PD_LOG_WARN}, {"error", PD_LOG_ERROR},
    };
    for (size_t i = 0; s && i < sizeof table / sizeof table[0]; i++) {
        if (strcasecmp(s, table[i].name) == 0) {
            *out = table[i].level;
            return PD_OK;
        }
    }
    return pd_error(PD_EINVAL, "log level '%s': expected debug, info, warn or error",
                    s ? s : "(null)");
}

void pd_log_set_role(const char *role)
{
    snprintf(g_role, sizeof g_role, "%s", role && *role ? role : "-");
}

void pd_log_init(const char *role)
{
    pd_log_set_role(role);
    const char *env = getenv("PD_LOG_LEVEL");
    if (env && *env) {
        pd_log_level lv;
        if (pd_log_parse_level(env, &lv) == PD_OK)
            pd_log_set_level(lv);
        else
            pd_log(PD_LOG_WARN, NULL, "PD_LOG_LEVEL: %s; using info", pd_last_error());
    }
}

void pd_log_set_level(pd_log_level level)
{
    atomic_store(&g_level, (int)level);
}

pd_log_level pd_log_get_level(void)
{
    return (pd_log_level)atomic_load(&g_level);
}

void pd_log_set_fd(int fd)
{
    atomic_store(&g_fd, fd);
}

/* Formats and writes one line; suffix (or NULL) goes after the message. */
static void log_line(pd_log_level level, const char *request_id, const char *suffix,
                     const char *fmt, va_list ap)
{
    char line[2048];
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    int n = snprintf(line, sizeof line, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %-5s %s %s ",
                     tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                     ts.tv_nsec / 1000000, level_names[level], g_role,
                     request_id && *request_id ? request_id : "-");
    int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof line - 2) len = sizeof line - 2; /* truncated */
    if (suffix) { /* kept whole: a long message gives way to it */
        size_t sl = strlen(suffix);
        if (len + sl > sizeof line - 2) len = sizeof line - 2 - sl;
        memcpy(line + len, suffix, sl);
        len += sl;
    }
    /* one event, one line: flatten embedded newlines */
    for (size_t i = (size_t)n; i < len; i++)
        if (line[i] == '\n' || line[i] == '\r') line[i] = ' ';
    line[len++] = '\n';
    ssize_t w = write(atomic_load(&g_fd), line, len);
    (void)w;
}

void pd_log(pd_log_level level, const char *request_id, const char *fmt, ...)
{
    if ((int)level < atomic_load(&g_level)) return;
    va_list ap;
    va_start(ap, fmt);
    log_line(level, request_id, NULL, fmt, ap);
    va_end(ap);
}

static pthread_mutex_t g_limit_mu = PTHREAD_MUTEX_INITIALIZER;

void pd_log_limited(pd_log_limit *lim, pd_log_level level, const char *request_id, const char *fmt,
                    ...)
{
    if ((int)level < atomic_load(&g_level)) return;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t now = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
    pthread_mutex_lock(&g_limit_mu);
    bool write_it = lim->last_ns == 0 || now - lim->last_ns >= (int64_t)lim->window_ms * 1000000;
    int64_t left_out = lim->left_out, since = now - lim->last_ns;
    if (write_it) {
        lim->last_ns = now;
        lim->left_out = 0;
    } else {
        lim->left_out++;
    }
    pthread_mutex_unlock(&g_limit_mu);
    if (!write_it) return;
    char suffix[96] = "";
    if (left_out > 0)
        snprintf(suffix, sizeof suffix, " (repeated %lld times in the last %.3g s)",
                 (long long)left_out, (double)since / 1e9);
    va_list ap;
    va_start(ap, fmt);
    log_line(level, request_id, left_out > 0 ? suffix : NULL, fmt, ap);
    va_end(ap);
}
