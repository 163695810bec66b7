#include "util/signals.h"
#include "util/status.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static volatile sig_atomic_t g_signal;
static int g_pipe[2] = {-1, -1};

static void on_signal(int sig)
{
    int saved = errno;
    if (!g_signal) g_signal = sig;
    if (g_pipe[1] >= 0) {
        ssize_t w = write(g_pipe[1], "s", 1);
        (void)w;
    }
    errno = saved;
}

int pd_signals_install(void)
{
    if (g_pipe[0] < 0) {
        if (pipe(g_pipe) != 0) return pd_error(PD_EIO, "signal pipe: %s", strerror(errno));
        for (int i = 0; i < 2; i++) {
            fcntl(g_pipe[i], F_SETFL, fcntl(g_pipe[i], F_GETFL) | O_NONBLOCK);
            fcntl(g_pipe[i], F_SETFD, FD_CLOEXEC);
        }
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGINT, &sa, NULL) != 0 || sigaction(SIGTERM, &sa, NULL) != 0)
        return pd_error(PD_EIO, "sigaction: %s", strerror(errno));
    signal(SIGPIPE, SIG_IGN);
    return PD_OK;
}

int pd_signal_received(void)
{
    return (int)g_signal;
}

int pd_signals_fd(void)
{
    return g_pipe[0];
}

void pd_signals_reset(void)
{
    g_signal = 0;
    char buf[64];
    if (g_pipe[0] >= 0)
        while (read(g_pipe[0], buf, sizeof buf) > 0) {
        }
}
