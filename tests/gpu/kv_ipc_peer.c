/* kv_ipc_peer: the decode side of the CUDA IPC KV-transfer test and benchmark, in a process of
 * its own (CUDA IPC maps only another process's memory).
 *   kv_ipc_peer --layers L --heads H --head0 H0 --head-dim D --blocks N --tokens T
 *               --reps R --ids b0,b1,...
 * Makes a CUDA backend (device 0, bf16) with an N-block pool of H heads (global heads H0..),
 * starts a KV receiver on 127.0.0.1 and prints "port P"; expects requests r0..r{R-1} of T tokens
 * into blocks ids (all layers, its heads), waits for them all (30 s), then checks the pool against
 * kv_ipc_val and prints the mean import time and the pulls' device time (events around each
 * pull), then "ok" or the first mismatch. Exit 0 only when everything passed. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_backend.h"
#include "kv_ipc_util.h"
#include "transfer/kv_tcp.h"
#include "util/clock.h"
#include "util/status.h"

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int n_done, n_failed;

static void on_done(void *arg, const char *id, int status)
{
    (void)arg;
    (void)id;
    pthread_mutex_lock(&mu);
    n_done++;
    n_failed += status != 0;
    pthread_mutex_unlock(&mu);
}

int main(int argc, char **argv)
{
    pd_kv_params p = {.n_layers = (int)kv_ipc_opt(argc, argv, "--layers", 2),
                      .n_blocks = (size_t)kv_ipc_opt(argc, argv, "--blocks", 16),
                      .block_size = 16,
                      .n_kv_heads = (size_t)kv_ipc_opt(argc, argv, "--heads", 4),
                      .head_dim = (size_t)kv_ipc_opt(argc, argv, "--head-dim", 64),
                      .dtype = PD_DTYPE_BF16};
    size_t head0 = (size_t)kv_ipc_opt(argc, argv, "--head0", 0),
           tokens = (size_t)kv_ipc_opt(argc, argv, "--tokens", 1);
    int reps = (int)kv_ipc_opt(argc, argv, "--reps", 1);
    int32_t ids[4096];
    size_t n = 0;
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], "--ids") == 0)
            for (char *s = argv[i + 1]; *s && n < 4096; s += *s == ',')
                ids[n++] = (int32_t)strtol(s, &s, 10);
    pd_backend *b = NULL;
    pd_kv *kv = NULL;
    pd_kv_tcp_receiver *rx = NULL;
    int rc = pd_backend_cuda_create(NULL, &b);
    if (rc == PD_OK) rc = pd_backend_cuda_pull_timing(b);
    if (rc == PD_OK) rc = pd_backend_get_ops(b)->kv_create(b, &p, &kv);
    pd_kv_rx_params rp = {
        .host = "127.0.0.1", .backend = b, .kv = kv, .kv_params = p, .head0 = head0};
    if (rc == PD_OK) rc = pd_kv_tcp_receiver_start(&rp, on_done, NULL, &rx);
    if (rc == PD_OK) {
        printf("port %d\n", pd_kv_tcp_receiver_port(rx));
        fflush(stdout);
    }
    /* every request expected up front: the sender sends the next one right after an ack */
    for (int r = 0; r < reps && rc == PD_OK; r++) {
        char id[32];
        snprintf(id, sizeof id, "r%d", r);
        rc = pd_kv_rx_expect(rx, id, ids, n, tokens);
    }
    int64_t deadline = pd_now_ns() + 30 * PD_NS_PER_S;
    pthread_mutex_lock(&mu);
    while (rc == PD_OK && n_done < reps && pd_now_ns() < deadline) {
        pthread_mutex_unlock(&mu);
        pd_sleep_ns(PD_NS_PER_MS);
        pthread_mutex_lock(&mu);
    }
    if (rc == PD_OK && (n_done < reps || n_failed))
        rc = pd_error(PD_ETIMEOUT, "%d of %d requests imported within 30 s (%d failed)", n_done,
                      reps, n_failed);
    pthread_mutex_unlock(&mu);
    if (rc == PD_OK) {
        pd_kv_rx_stats st;
        pd_kv_rx_get_stats(rx, &st);
        double sum, best;
        uint64_t pulls;
        pd_backend_cuda_pull_time(b, &sum, &best, &pulls);
        double bytes = 2.0 * p.n_layers * (double)tokens * (double)(p.n_kv_heads * p.head_dim * 2);
        printf("imports: %llu requests, %.3f ms each on average (frame checks, mapping, pull); "
               "pull on the device: best %.3f ms = %.1f GB/s, mean %.3f ms (%llu pulls)\n",
               (unsigned long long)st.completed, 1e3 * st.import_seconds / (double)st.completed,
               1e3 * best, best > 0 ? bytes / best / 1e9 : 0.0,
               pulls ? 1e3 * sum / (double)pulls : 0.0, (unsigned long long)pulls);
        rc = kv_ipc_check(b, kv, &p, 0, head0, p.n_kv_heads, ids, n, tokens);
    }
    printf("%s\n", rc == PD_OK ? "ok" : pd_last_error());
    if (rx) pd_kv_tcp_receiver_stop(rx);
    if (kv) pd_backend_get_ops(b)->kv_free(b, kv);
    pd_backend_free(b);
    return rc == PD_OK ? 0 : 1;
}
