/* Clean shutdown on SIGINT/SIGTERM for processes that do not run a libuv loop.
 * The handler only records the signal and writes one byte to a self-pipe, so any loop
 * (poll, gRPC completion-queue timeout, condvar wait) can notice it. SIGPIPE is ignored:
 * a closed socket is an error return, never a crash. */
#ifndef PD_UTIL_SIGNALS_H
#define PD_UTIL_SIGNALS_H

int pd_signals_install(void); /* returns 0 or PD_EIO */
int pd_signal_received(void); /* 0, or the first signal number received */
int pd_signals_fd(void);      /* read end of the self-pipe (-1 before install) */
void pd_signals_reset(void);  /* forget a received signal (tests) */

#endif
