/* Thread-local error message + breadcrumb trace (see status.h). */
#include "util/status.h"

#include <stdio.h>
#include <string.h>

#define PD_ERRMSG_MAX 1024
#define PD_TRACE_MAX  512

static _Thread_local char t_msg[PD_ERRMSG_MAX];
static _Thread_local char t_trace[PD_TRACE_MAX];

const char *pd_status_name(int status)
{
    switch (status) {
    case PD_OK: return "OK";
    case PD_EINVAL: return "EINVAL";
    case PD_ENOMEM: return "ENOMEM";
    case PD_EIO: return "EIO";
    case PD_EPARSE: return "EPARSE";
    case PD_ENOTFOUND: return "ENOTFOUND";
    case PD_ERANGE: return "ERANGE";
    case PD_EUNSUPPORTED: return "EUNSUPPORTED";
    case PD_ETIMEOUT: return "ETIMEOUT";
    case PD_ECLOSED: return "ECLOSED";
    case PD_EBUSY: return "EBUSY";
    case PD_EEXIST: return "EEXIST";
    case PD_EINTERNAL: return "EINTERNAL";
    case PD_ECANCELLED: return "ECANCELLED";
    default: return "EUNKNOWN";
    }
}

int pd_verror(int status, const char *fmt, va_list ap)
{
    vsnprintf(t_msg, sizeof t_msg, fmt, ap);
    t_trace[0] = '\0';
    return status;
}

int pd_error(int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    pd_verror(status, fmt, ap);
    va_end(ap);
    return status;
}

int pd_error_prefix(int status, const char *fmt, ...)
{
    char prefix[PD_ERRMSG_MAX];
    char old[PD_ERRMSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, t_msg, sizeof old);
    size_t n = strlen(prefix);
    if (n > sizeof t_msg - 3) n = sizeof t_msg - 3;
    memcpy(t_msg, prefix, n);
    memcpy(t_msg + n, ": ", 2);
    size_t room = sizeof t_msg - n - 3, m = strlen(old);
    if (m > room) m = room;
    memcpy(t_msg + n + 2, old, m);
    t_msg[n + 2 + m] = '\0';
    return status;
}

const char *pd_last_error(void)
{
    return t_msg;
}

const char *pd_last_error_trace(void)
{
    return t_trace;
}

void pd_error_clear(void)
{
    t_msg[0] = '\0';
    t_trace[0] = '\0';
}

void pd_error_trace_add(const char *file, int line)
{
    const char *base = strrchr(file, '/');
    base = base ? base + 1 : file;
    size_t n = strlen(t_trace);
    if (n + 4 >= sizeof t_trace) return; /* full: keep the innermost frames */
    snprintf(t_trace + n, sizeof t_trace - n, "%s%s:%d", n ? " <- " : "", base, line);
}
