/* Logging: one line per event, written with a single write(2) so lines from threads
 * and processes never interleave:
 *     2026-11-22T10:54:23.123Z INFO  prefill req-7 message
 * The role is set once per process; the request id is "-" when an event has none.
 * Level from --log-level or PD_LOG_LEVEL (debug, info, warn, error); default info.
 *
 * A call site that can fire many times a second (a refusal repeated while a condition lasts)
 * logs through PD_WARN_EVERY (PD_LOG_EVERY for another level): the site's first line is written,
 * the ones after it within the window are only counted, and the site's next line written after the
 * window ends with "(repeated N times in the last T s)", N the lines left out since the site's last
 * written line, T the seconds since it. The count of the last window shows with the site's next
 * line.
 */
#ifndef PD_UTIL_LOG_H
#define PD_UTIL_LOG_H

#include <stdint.h>

typedef enum { PD_LOG_DEBUG = 0, PD_LOG_INFO = 1, PD_LOG_WARN = 2, PD_LOG_ERROR = 3 } pd_log_level;

/* Reads PD_LOG_LEVEL (ignored when invalid, with a warning) and sets the role. */
void pd_log_init(const char *role);
void pd_log_set_role(const char *role);
void pd_log_set_level(pd_log_level level);
pd_log_level pd_log_get_level(void);
/* "debug"/"info"/"warn"/"warning"/"error" -> level; returns PD_EINVAL for anything else. */
int pd_log_parse_level(const char *s, pd_log_level *out);
/* Redirects output (default: stderr). fd must stay open. */
void pd_log_set_fd(int fd);

void pd_log(pd_log_level level, const char *request_id, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* One call site's rate limit; a static at the site (PD_LOG_EVERY), zero-initialised but for
 * window_ms. */
typedef struct {
    int window_ms;    /* a line at most every window_ms */
    int64_t last_ns;  /* monotonic time of the last line written; 0: none yet */
    int64_t left_out; /* lines counted and not written since */
} pd_log_limit;

/* pd_log through lim: written, or counted when lim's last line is less than its window old. */
void pd_log_limited(pd_log_limit *lim, pd_log_level level, const char *request_id, const char *fmt,
                    ...) __attribute__((format(printf, 4, 5)));

#define PD_DEBUG(rid, ...)                                                                         \
    do {                                                                                           \
        if (pd_log_get_level() <= PD_LOG_DEBUG) pd_log(PD_LOG_DEBUG, rid, __VA_ARGS__);            \
    } while (0)
#define PD_INFO(rid, ...)  pd_log(PD_LOG_INFO, rid, __VA_ARGS__)
#define PD_WARN(rid, ...)  pd_log(PD_LOG_WARN, rid, __VA_ARGS__)
#define PD_ERROR(rid, ...) pd_log(PD_LOG_ERROR, rid, __VA_ARGS__)

/* Rate-limited logging at one call site: at most one line per window_ms (see above). */
#define PD_LOG_EVERY(level, ms, rid, ...)                                                          \
    do {                                                                                           \
        static pd_log_limit pd_log_site_ = {.window_ms = (ms)};                                    \
        pd_log_limited(&pd_log_site_, level, rid, __VA_ARGS__);                                    \
    } while (0)
#define PD_WARN_EVERY(ms, rid, ...) PD_LOG_EVERY(PD_LOG_WARN, ms, rid, __VA_ARGS__)

#endif
