/* See kv_ipc_util.h. */
#include "kv_ipc_util.h"

#include <limits.h>
#include <sys/wait.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/dtype.h"
#include "util/status.h"

/* Host buffer of one layer's range: K then V, each (n, block_size, nh, head_dim) bf16. */
static uint16_t *range_buf(const pd_kv_params *p, size_t n, size_t nh)
{
    return malloc(2 * n * p->block_size * nh * p->head_dim * sizeof(uint16_t));
}

int kv_ipc_fill(pd_backend *b, pd_kv *kv, const pd_kv_params *p, size_t head0, const int32_t *ids,
                size_t n)
{
    const pd_backend_ops *o = pd_backend_get_ops(b);
    size_t nh = p->n_kv_heads, hd = p->head_dim, bs = p->block_size;
    uint16_t *h = range_buf(p, n, nh);
    if (!h) return pd_error(PD_ENOMEM, "kv_ipc_fill: out of memory");
    int rc = PD_OK;
    for (int l = 0; l < p->n_layers && rc == PD_OK; l++) {
        size_t i = 0;
        for (int kv_i = 0; kv_i < 2; kv_i++)
            for (size_t t = 0; t < n * bs; t++)
                for (size_t k = 0; k < nh; k++)
                    for (size_t d = 0; d < hd; d++)
                        h[i++] = pd_f32_to_bf16(kv_ipc_val(l, kv_i, head0 + k, t, d));
        pd_kv_range r = {.layer = l, .block_ids = ids, .n_blocks = n, .head0 = 0, .n_heads = nh};
        rc = o->kv_import(b, kv, &r, h);
    }
    free(h);
    return rc;
}

int kv_ipc_check(pd_backend *b, const pd_kv *kv, const pd_kv_params *p, size_t lh0, size_t gh0,
                 size_t nh, const int32_t *ids, size_t n, size_t n_tokens)
{
    const pd_backend_ops *o = pd_backend_get_ops(b);
    size_t hd = p->head_dim, bs = p->block_size;
    uint16_t *h = range_buf(p, n, nh);
    if (!h) return pd_error(PD_ENOMEM, "kv_ipc_check: out of memory");
    int rc = PD_OK;
    for (int l = 0; l < p->n_layers && rc == PD_OK; l++) {
        pd_kv_range r = {.layer = l, .block_ids = ids, .n_blocks = n, .head0 = lh0, .n_heads = nh};
        rc = o->kv_export(b, kv, &r, h);
        for (int kv_i = 0; kv_i < 2 && rc == PD_OK; kv_i++)
            for (size_t t = 0; t < n_tokens && rc == PD_OK; t++)
                for (size_t k = 0; k < nh && rc == PD_OK; k++)
                    for (size_t d = 0; d < hd; d++) {
                        size_t i = (((size_t)kv_i * n * bs + t) * nh + k) * hd + d;
                        float want = kv_ipc_val(l, kv_i, gh0 + k, t, d);
                        if (pd_bf16_to_f32(h[i]) != want) {
                            rc = pd_error(
                                PD_EINTERNAL, "layer %d %s token %zu head %zu dim %zu: %g, want %g",
                                l, kv_i ? "V" : "K", t, gh0 + k, d, pd_bf16_to_f32(h[i]), want);
                            break;
                        }
                    }
    }
    free(h);
    return rc;
}

long kv_ipc_opt(int argc, char **argv, const char *name, long def)
{
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], name) == 0) return strtol(argv[i + 1], NULL, 10);
    return def;
}

int kv_ipc_spawn_peer(const char *args, FILE **out, int *port)
{
    char self[PATH_MAX];
    ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
    if (len <= 0) return pd_error(PD_EIO, "kv_ipc_spawn_peer: /proc/self/exe unreadable");
    self[len] = '\0';
    char *slash = strrchr(self, '/');
    if (slash) *slash = '\0';
    char cmd[PATH_MAX + 1024];
    snprintf(cmd, sizeof cmd, "exec '%s/kv_ipc_peer' %s", self, args);
    FILE *f = popen(cmd, "r");
    if (!f) return pd_error(PD_EIO, "kv_ipc_spawn_peer: cannot start %s", cmd);
    char line[256];
    *port = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "port %d", port) == 1) break;
    if (*port <= 0) {
        int st = pclose(f);
        return pd_error(PD_EIO, "kv_ipc_peer did not report its port (exit status %d)", st);
    }
    *out = f;
    return PD_OK;
}

int kv_ipc_send(pd_kv_tcp_sender *tx, int port, int rep, pd_backend *b, const pd_kv *kv,
                const pd_kv_params *p, const pd_kv_share *share, const int32_t *ids, size_t n,
                size_t n_tokens, size_t h0, size_t nh, pd_kv_send_stats *st)
{
    char id[32];
    snprintf(id, sizeof id, "r%d", rep);
    pd_kv_send_req sr = {.request_id = id,
                         .host = "127.0.0.1",
                         .port = port,
                         .backend = b,
                         .kv = kv,
                         .kv_params = *p,
                         .src_head0 = 0,
                         .block_ids = ids,
                         .n_blocks = n,
                         .n_tokens = n_tokens,
                         .head0 = h0,
                         .n_heads = nh,
                         .timeout_ms = 20000,
                         .share = share};
    return pd_kv_tcp_send(tx, &sr, st);
}

int kv_ipc_peer_finish(FILE *peer, char *imports, size_t ni, char *verdict, size_t nv)
{
    imports[0] = '\0';
    snprintf(verdict, nv, "(no verdict)\n");
    while (fgets(verdict, (int)nv, peer) && strncmp(verdict, "imports:", 8) == 0)
        snprintf(imports, ni, "%s", verdict);
    int st = pclose(peer);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}
