/* Socket calls of the KV data plane (see kv_sock.h). */
#include "transfer/kv_sock.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "util/clock.h"
#include "util/status.h"

#define SOCK_BUF (4 << 20)

int kv_wait_fd(int fd, short events, int stop_fd, const atomic_bool *cancel, int64_t deadline_ns)
{
    for (;;) {
        if (cancel && atomic_load(cancel)) return -2;
        int ms = -1;
        if (deadline_ns != INT64_MAX) {
            int64_t left = deadline_ns - pd_now_ns();
            if (left <= 0) return 0;
            ms = (int)((left + PD_NS_PER_MS - 1) / PD_NS_PER_MS);
        }
        if (cancel && (ms < 0 || ms > KV_CANCEL_POLL_MS)) ms = KV_CANCEL_POLL_MS;
        struct pollfd p[2] = {{.fd = fd, .events = events}, {.fd = stop_fd, .events = POLLIN}};
        int r = poll(p, stop_fd >= 0 ? 2 : 1, ms);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -1;
        if (r == 0) continue; /* the deadline and the cancel flag are looked at above */
        if (stop_fd >= 0 && p[1].revents) return -1;
        return 1;
    }
}

/* PD_OK to go on, else the status to return (PD_ECANCELLED, PD_ETIMEOUT). */
static int io_gate(const atomic_bool *cancel, int64_t deadline_ns)
{
    if (cancel && atomic_load(cancel)) return PD_ECANCELLED;
    if (deadline_ns != INT64_MAX && pd_now_ns() >= deadline_ns) return PD_ETIMEOUT;
    return PD_OK;
}

/* After a call that returned r < 0: PD_OK to try again (EINTR, or EAGAIN and fd became ready),
 * else the status to return. */
static int io_retry(int fd, short events, int stop_fd, const atomic_bool *cancel,
                    int64_t deadline_ns)
{
    if (errno == EINTR) return PD_OK;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return PD_ECLOSED;
    int w = kv_wait_fd(fd, events, stop_fd, cancel, deadline_ns);
    return w == 1 ? PD_OK : w == 0 ? PD_ETIMEOUT : w == -2 ? PD_ECANCELLED : PD_ECLOSED;
}

int kv_read_full(int fd, void *buf, size_t n, int stop_fd, const atomic_bool *cancel,
                 int64_t deadline_ns)
{
    uint8_t *p = buf;
    while (n > 0) {
        int rc = io_gate(cancel, deadline_ns);
        if (rc < 0) return rc;
        ssize_t r = read(fd, p, n);
        if (r == 0) return PD_ECLOSED;
        if (r < 0) {
            if ((rc = io_retry(fd, POLLIN, stop_fd, cancel, deadline_ns)) < 0) return rc;
            continue;
        }
        p += r;
        n -= (size_t)r;
    }
    return PD_OK;
}

int kv_write_full(int fd, const void *buf, size_t n, const atomic_bool *cancel, int64_t deadline_ns)
{
    const uint8_t *p = buf;
    while (n > 0) {
        int rc = io_gate(cancel, deadline_ns);
        if (rc < 0) return rc;
        ssize_t r = send(fd, p, n, MSG_NOSIGNAL);
        if (r == 0) return PD_ECLOSED;
        if (r < 0) {
            if ((rc = io_retry(fd, POLLOUT, -1, cancel, deadline_ns)) < 0) return rc;
            continue;
        }
        p += r;
        n -= (size_t)r;
    }
    return PD_OK;
}

int kv_writev_full(int fd, struct iovec *iov, int cnt, const atomic_bool *cancel,
                   int64_t deadline_ns)
{
    while (cnt > 0) {
        int rc = io_gate(cancel, deadline_ns);
        if (rc < 0) return rc;
        ssize_t n = writev(fd, iov, cnt);
        if (n == 0) return PD_ECLOSED;
        if (n < 0) {
            if ((rc = io_retry(fd, POLLOUT, -1, cancel, deadline_ns)) < 0) return rc;
            continue;
        }
        while (cnt > 0 && (size_t)n >= iov->iov_len) {
            n -= (ssize_t)iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + n;
            iov->iov_len -= (size_t)n;
        }
    }
    return PD_OK;
}

const char *kv_io_failure(int rc, const char *what)
{
    static _Thread_local char buf[96];
    snprintf(buf, sizeof buf, "%s %s",
             rc == PD_ETIMEOUT     ? "timed out"
             : rc == PD_ECANCELLED ? "cancelled"
                                   : "connection lost",
             what);
    return buf;
}

void kv_tune_socket(int fd)
{
    int one = 1, buf = SOCK_BUF;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    fcntl(fd, F_SETFD, FD_CLOEXEC);
}

static int resolve(const char *host, int port, struct sockaddr_storage *ss, socklen_t *len)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    int e = getaddrinfo(host, ps, &hints, &res);
    if (e != 0 || !res)
        return pd_error(PD_EINVAL, "address %s:%d: %s", host, port, gai_strerror(e));
    memcpy(ss, res->ai_addr, res->ai_addrlen);
    *len = res->ai_addrlen;
    freeaddrinfo(res);
    return PD_OK;
}

int kv_dial(const char *host, int port, const atomic_bool *cancel, int64_t deadline, int *out)
{
    struct sockaddr_storage ss;
    socklen_t sl;
    PD_CHECK(resolve(host, port, &ss, &sl));
    int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return pd_error(PD_EIO, "kv send: socket: %s", strerror(errno));
    kv_tune_socket(fd);
    if (connect(fd, (struct sockaddr *)&ss, sl) != 0 && errno != EINPROGRESS) {
        int e = errno;
        close(fd);
        return pd_error(PD_ECLOSED, "kv send: connect %s:%d: %s", host, port, strerror(e));
    }
    int w = kv_wait_fd(fd, POLLOUT, -1, cancel, deadline);
    int err = 0;
    socklen_t el = sizeof err;
    if (w == 1) getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
    if (w != 1 || err) {
        close(fd);
        if (w == 0) return pd_error(PD_ETIMEOUT, "kv send: connect %s:%d timed out", host, port);
        if (w == -2) return pd_error(PD_ECANCELLED, "kv send: connect %s:%d cancelled", host, port);
        return pd_error(PD_ECLOSED, "kv send: connect %s:%d: %s", host, port,
                        strerror(err ? err : ECONNREFUSED));
    }
    *out = fd;
    return PD_OK;
}

int kv_listen(const char *host, int port, int *out, int *bound_port)
{
    struct sockaddr_storage ss;
    socklen_t sl;
    PD_CHECK(resolve(host, port, &ss, &sl));
    int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, (struct sockaddr *)&ss, sl) != 0 || listen(fd, 64) != 0) {
        int rc =
            pd_error(PD_EIO, "kv receive: cannot listen on %s:%d: %s", host, port, strerror(errno));
        close(fd);
        return rc;
    }
    struct sockaddr_storage bound;
    socklen_t bl = sizeof bound;
    getsockname(fd, (struct sockaddr *)&bound, &bl);
    *bound_port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                    : ((struct sockaddr_in *)&bound)->sin_port);
    *out = fd;
    return PD_OK;
}
