/* bench_kv_ipc: CUDA IPC KV transfer throughput for docs/benchmarks.md.
 *
 *   bench_kv_ipc [--layers 22] [--heads 4] [--head-dim 64] [--tokens 2048] [--reps 20]
 *
 * Defaults are a 2048-token prompt of `pd-mkmodel --preset 1b` (TinyLlama's shape: 22 layers,
 * 4 KV heads of 64, bf16: 46.1 MB of K and V). This process is the prefill side; kv_ipc_peer
 * (the decode side, another process) maps the pool and pulls every layer device to device.
 * Prints the device-to-device copy bandwidth measured in the same run (cudaMemcpy of 1 GiB,
 * counted as bytes copied, i.e. half of the read + write figure test_cuda_info prints), and the
 * transfer's bytes / seconds over reps requests, each timed from the sender's first byte to
 * the decode side's acknowledgement (frame, pull, completion over the control connection);
 * the first request (which maps the pool) is reported apart; then the pull's own device time
 * (events on the decode side around the kernel) against the same copy.
 * The peer checks the copied KV. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_info.h"
#include "kv_ipc_util.h"
#include "transfer/kv_tcp.h"
#include "util/status.h"

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    size_t tokens = (size_t)kv_ipc_opt(argc, argv, "--tokens", 2048);
    int reps = (int)kv_ipc_opt(argc, argv, "--reps", 20);
    pd_kv_params p = {.n_layers = (int)kv_ipc_opt(argc, argv, "--layers", 22),
                      .block_size = 16,
                      .n_kv_heads = (size_t)kv_ipc_opt(argc, argv, "--heads", 4),
                      .head_dim = (size_t)kv_ipc_opt(argc, argv, "--head-dim", 64),
                      .dtype = PD_DTYPE_BF16};
    size_t n = (tokens + 15) / 16;
    p.n_blocks = 2 * n + 8;
    if (reps < 2 || n > 4096 || tokens == 0) {
        fprintf(stderr, "bench_kv_ipc: --reps >= 2 and 1..65536 --tokens\n");
        return 2;
    }
    double bw = 0;
    int rc = pd_cuda_d2d_bandwidth(0, (size_t)1 << 30, 20, &bw);
    pd_backend *b = NULL;
    pd_kv *kv = NULL;
    if (rc == PD_OK) rc = pd_backend_cuda_create(NULL, &b);
    const pd_backend_ops *o = b ? pd_backend_get_ops(b) : NULL;
    if (rc == PD_OK) rc = o->kv_create(b, &p, &kv);
    int32_t *src = malloc(n * sizeof *src);
    char *args = malloc(64 + n * 8);
    int off = snprintf(args, 64 + n * 8,
                       "--layers %d --heads %zu --head0 0 --head-dim %zu --blocks %zu --tokens "
                       "%zu --reps %d --ids ",
                       p.n_layers, p.n_kv_heads, p.head_dim, p.n_blocks, tokens, reps);
    for (size_t i = 0; i < n; i++) {
        src[i] = (int32_t)(2 * i + 1); /* scattered on the prefill side, contiguous on decode */
        off += snprintf(args + off, 64 + n * 8 - (size_t)off, "%s%zu", i ? "," : "", i + 4);
    }
    if (rc == PD_OK) rc = kv_ipc_fill(b, kv, &p, 0, src, n);
    pd_kv_share share;
    if (rc == PD_OK) rc = o->kv_share(b, kv, &share);
    FILE *peer = NULL;
    int port = 0;
    if (rc == PD_OK) rc = kv_ipc_spawn_peer(args, &peer, &port);
    pd_kv_tcp_sender *tx = NULL;
    if (rc == PD_OK) rc = pd_kv_tcp_sender_create(&tx);
    double *secs = calloc((size_t)reps, sizeof *secs);
    uint64_t bytes = 0;
    for (int r = 0; r < reps && rc == PD_OK; r++) {
        pd_kv_send_stats st;
        rc = kv_ipc_send(tx, port, r, b, kv, &p, &share, src, n, tokens, 0, p.n_kv_heads, &st);
        secs[r] = st.seconds;
        bytes = st.bytes;
    }
    char verdict[512] = "(no peer)\n", imports[512] = "";
    if (peer && kv_ipc_peer_finish(peer, imports, sizeof imports, verdict, sizeof verdict) != 0 &&
        rc == PD_OK)
        rc = pd_error(PD_EINTERNAL, "kv_ipc_peer: %s", verdict);
    if (rc == PD_OK) {
        double first = secs[0];
        qsort(secs + 1, (size_t)reps - 1, sizeof *secs, cmp_d);
        double best = secs[1], med = secs[1 + (reps - 1) / 2];
        double copy = bw / 2; /* bytes copied per second, GB/s */
        printf("d2d copy: %.0f GB/s read+write = %.0f GB/s copied (1 GiB, best of 20)\n", bw, copy);
        printf("cuda_ipc KV transfer, %zu tokens x %d layers x %zu heads x %zu (bf16): %.1f MB "
               "per request\n",
               tokens, p.n_layers, p.n_kv_heads, p.head_dim, bytes / 1e6);
        printf("  first request (maps the pool): %.3f ms\n", first * 1e3);
        printf("  next %d: best %.3f ms (%.0f GB/s, %.1f%% of the copy), median %.3f ms (%.0f "
               "GB/s, %.1f%%)\n",
               reps - 1, best * 1e3, bytes / best / 1e9, 100.0 * bytes / best / 1e9 / copy,
               med * 1e3, bytes / med / 1e9, 100.0 * bytes / med / 1e9 / copy);
        printf("  decode side %s", imports);
        const char *dev = strstr(imports, "device: best");
        double pull_ms = 0, pull_gbs = 0;
        if (dev && sscanf(dev, "device: best %lf ms = %lf GB/s", &pull_ms, &pull_gbs) == 2)
            printf("  the pull alone (kernel, device time, best): %.1f%% of the "
                   "copy\n",
                   100.0 * pull_gbs / copy);
        printf("  peer check: %s", verdict);
    } else {
        fprintf(stderr, "bench_kv_ipc: %s\n", pd_last_error());
    }
    free(secs);
    free(src);
    free(args);
    pd_kv_tcp_sender_free(tx);
    if (kv) o->kv_free(b, kv);
    pd_backend_free(b);
    return rc == PD_OK ? 0 : 1;
}
