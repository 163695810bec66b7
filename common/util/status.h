/* Status codes and the error message that travels with them.
 *
 * Library code returns an int: 0 on success, a negative PD_E* code on failure, after
 * setting a human-readable message with pd_error(). The message lives in thread-local
 * storage, so it survives until the next pd_error() on the same thread. Callers that
 * pass an error upward use PD_CHECK(), which adds a "file:line" breadcrumb to a separate
 * trace (shown at debug log level) and never touches the user-facing message.
 * Only main() turns a status into an exit code.
 */
#ifndef PD_UTIL_STATUS_H
#define PD_UTIL_STATUS_H

#include <stdarg.h>

enum {
    PD_OK = 0,
    PD_EINVAL = -1,       /* bad argument or bad input (file, request) */
    PD_ENOMEM = -2,       /* allocation failed or a pool is exhausted */
    PD_EIO = -3,          /* read/write/socket failure */
    PD_EPARSE = -4,       /* malformed syntax (JSON, HTTP, safetensors header) */
    PD_ENOTFOUND = -5,    /* a named thing does not exist */
    PD_ERANGE = -6,       /* a value outside its allowed range */
    PD_EUNSUPPORTED = -7, /* valid but not supported by pdserve */
    PD_ETIMEOUT = -8,     /* a deadline passed */
    PD_ECLOSED = -9,      /* peer or queue closed, shutting down */
    PD_EBUSY = -10,       /* over capacity; try again later */
    PD_EEXIST = -11,      /* already exists / done twice */
    PD_EINTERNAL = -12,   /* a broken invariant or a failing library (CUDA, NCCL, gRPC) */
    PD_ECANCELLED = -13,  /* aborted by the client or by shutdown */
};

/* Name of a status code ("EINVAL"), never NULL. */
const char *pd_status_name(int status);

/* Sets the thread's error message (printf-style), clears its trace, returns status. */
int pd_error(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int pd_verror(int status, const char *fmt, va_list ap);

/* Prepends "prefix: " to the current message, e.g. the file name. Returns status. */
int pd_error_prefix(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Message of the last error on this thread ("" when none). */
const char *pd_last_error(void);
/* Breadcrumbs added by PD_CHECK, innermost first ("a.c:10 <- b.c:42"). */
const char *pd_last_error_trace(void);
/* Clears message and trace. */
void pd_error_clear(void);

void pd_error_trace_add(const char *file, int line);

/* Evaluates expr (an int status); on failure records file:line and returns it. */
#define PD_CHECK(expr)                                                                             \
    do {                                                                                           \
        int pd_check_rc_ = (expr);                                                                 \
        if (pd_check_rc_ < 0) {                                                                    \
            pd_error_trace_add(__FILE__, __LINE__);                                                \
            return pd_check_rc_;                                                                   \
        }                                                                                          \
    } while (0)

/* Same, but jumps to a cleanup label with rc set. */
#define PD_CHECK_GOTO(expr, rc, label)                                                             \
    do {                                                                                           \
        (rc) = (expr);                                                                             \
        if ((rc) < 0) {                                                                            \
            pd_error_trace_add(__FILE__, __LINE__);                                                \
            goto label;                                                                            \
        }                                                                                          \
    } while (0)

#endif
