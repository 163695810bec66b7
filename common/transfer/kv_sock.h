/* Socket calls of the KV data plane: non-blocking reads and writes of whole buffers bounded by a
 * deadline, a stop pipe and a cancel flag, and the dial and listen of a KV connection. Every
 * transport shares one TCP connection per request (kv_xport.h); these are its only socket calls.
 *
 * The calls try first and wait only when the socket is not ready: a frame's header, its payload
 * and an acknowledgement are usually there already, and each poll() would cost a system call.
 * Before each try they look at the cancel flag and the deadline, which need no system call.
 */
#ifndef PD_TRANSFER_KV_SOCK_H
#define PD_TRANSFER_KV_SOCK_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#define KV_CANCEL_POLL_MS 50 /* how often a wait looks at its cancel flag */

/* Waits for fd (and, when stop_fd >= 0, for a stop signal; when cancel is not NULL, for it to
 * turn true, looked at every KV_CANCEL_POLL_MS). 1 ready, 0 timeout, -1 stop, -2 cancelled. */
int kv_wait_fd(int fd, short events, int stop_fd, const atomic_bool *cancel, int64_t deadline_ns);

/* PD_OK, PD_ETIMEOUT, PD_ECANCELLED, PD_ECLOSED (peer closed / error / stop), no message set.
 * stop_fd is looked at only while the socket has nothing to read. */
int kv_read_full(int fd, void *buf, size_t n, int stop_fd, const atomic_bool *cancel,
                 int64_t deadline_ns);
int kv_write_full(int fd, const void *buf, size_t n, const atomic_bool *cancel,
                  int64_t deadline_ns);
/* writev of the whole vector (iov is consumed); statuses as kv_write_full. */
int kv_writev_full(int fd, struct iovec *iov, int cnt, const atomic_bool *cancel,
                   int64_t deadline_ns);

/* What a failed socket call's status means, for messages: "timed out writing". Thread-local. */
const char *kv_io_failure(int rc, const char *what);

/* Non-blocking, no delay, large buffers, close-on-exec. */
void kv_tune_socket(int fd);
/* A connected socket to host:port (tuned), within the deadline and the cancel flag. */
int kv_dial(const char *host, int port, const atomic_bool *cancel, int64_t deadline, int *out);
/* A listening socket on host:port (0: ephemeral); *bound_port is the port it got. */
int kv_listen(const char *host, int port, int *out, int *bound_port);

#endif
