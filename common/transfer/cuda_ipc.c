/* KV transport "cuda_ipc": for a prefill and a decode rank on one host, the decode rank maps the
 * prefill pool (CUDA IPC) and copies the prompt's KV device to device; nothing but a description
 * crosses the connection.
 *
 * The sender writes one frame flagged IPC | LAST, layer 0, the usual head and block fields,
 * whose payload describes the prefill pool (its pd_kv_share, from the backend's kv_share) and
 * the prompt's blocks in it (kv_frames.h). The receiver maps the pool (kv_peer_open, kept per
 * connection), copies every layer device to device into the reserved blocks (kv_pull) and
 * acknowledges; the prefill side keeps its blocks under the lease until then, and the receiver
 * writes only blocks it reserved, under the same lock that a cancel takes, so an abort never
 * races a copy. boot_id (the kernel's, shared by the containers of one host) tells another host
 * apart before any CUDA call: such frames, and frames to a receiver whose backend has no kv_pull
 * (CPU), are refused with PD_EUNSUPPORTED, which the sender reports as such so the caller can
 * fall back to another transport (kv_route.c).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "transfer/kv_sock.h"
#include "transfer/kv_xport.h"
#include "util/status.h"

/* This host's identity for IPC frames: the kernel's boot id (empty when unreadable), read once
 * per process (both ends of every IPC frame need it). */
static char g_boot_id[KV_BOOT_ID_BYTES];
static void read_boot_id(void)
{
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (!f) return;
    if (!fgets(g_boot_id, sizeof g_boot_id, f)) g_boot_id[0] = '\0';
    fclose(f);
    g_boot_id[strcspn(g_boot_id, "\n")] = '\0';
}

static void boot_id(char out[KV_BOOT_ID_BYTES])
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, read_boot_id);
    memcpy(out, g_boot_id, KV_BOOT_ID_BYTES);
}

/* ---- sender ---- */

/* A prefill rank's share of its pool: what every IPC frame of the rank describes. */
static int ipc_tx_setup(pd_backend *b, const pd_kv *kv, void **arg)
{
    const pd_backend_ops *o = pd_backend_get_ops(b);
    if (!o->kv_share)
        return pd_error(PD_EUNSUPPORTED, "the %s backend cannot share its KV pool",
                        pd_backend_name(b));
    pd_kv_share *sh = calloc(1, sizeof *sh);
    if (!sh) return pd_error(PD_ENOMEM, "out of memory");
    int rc = o->kv_share(b, kv, sh);
    if (rc < 0) {
        free(sh);
        return rc;
    }
    *arg = sh;
    return PD_OK;
}

static void ipc_tx_release(void *arg)
{
    free(arg);
}

/* The IPC frame of s->r (the share is s->arg), then the acknowledgement. */
static int ipc_send(const kv_send_ctx *s)
{
    const pd_kv_send_req *r = s->r;
    if (kv_send_partial(r))
        return pd_error(PD_EUNSUPPORTED,
                        "kv send %s: CUDA IPC moves whole pools; a pipeline stage's layers move "
                        "over tcp",
                        r->request_id);
    const pd_kv_params *kp = &r->kv_params;
    size_t payload = kv_ipc_payload_bytes(r->n_blocks), n = KV_HDR_BYTES + payload;
    uint8_t *buf = calloc(1, n);
    if (!buf) return pd_error(PD_ENOMEM, "kv send: out of memory");
    kv_hdr_for(r, 0, s->tokens, KV_FLAG_LAST | KV_FLAG_IPC, payload, buf);
    kv_ipc_desc d = {.share = *(const pd_kv_share *)s->arg,
                     .src_head0 = (uint32_t)(r->head0 - r->src_head0)};
    boot_id(d.boot_id);
    d.share.p = *kp;
    kv_ipc_pack(&d, r->block_ids, r->n_blocks, buf + KV_HDR_BYTES);
    /* the prefill step that wrote these blocks has completed (its first token was sampled) */
    int rc = kv_write_full(s->c->fd, buf, n, r->cancel, s->deadline);
    free(buf);
    if (rc == PD_ETIMEOUT || rc == PD_ECLOSED || rc == PD_ECANCELLED)
        return pd_error(rc, "kv send %s: %s", r->request_id, kv_io_failure(rc, "writing"));
    if (rc < 0) return rc;
    s->st->frames = 1;
    s->st->writes = 1;
    s->st->bytes = (uint64_t)kp->n_layers * kv_slice_bytes(kp, s->tokens, r->n_heads);
    return kv_read_ack(s->c->fd, r, s->deadline, s->keep);
}

/* A receiver that cannot map the pool (another host, no kv_pull) answers PD_EUNSUPPORTED. */
static bool ipc_refused(int rc, const pd_kv_send_stats *st)
{
    (void)st;
    return rc == PD_EUNSUPPORTED;
}

/* ---- receiver ---- */

/* The sender's pool, mapped at the connection's first IPC frame. */
typedef struct {
    pd_kv_peer *peer;
    uint64_t id; /* the pool's share id: another one means the sender restarted */
} ipc_peer;

/* An IPC frame: maps the sender's pool on this connection and pulls every layer into the
 * reserved blocks. Called with the receiver's lock held. */
static int ipc_rx_frame(kv_rx_conn *c, const kv_hdr *h, const uint8_t *payload, int64_t deadline,
                        kv_rx_result *res)
{
    (void)deadline;
    pd_kv_tcp_receiver *rx = c->rx;
    const pd_kv_params *kp = &rx->p.kv_params;
    const pd_backend_ops *ops = pd_backend_get_ops(rx->p.backend);
    kv_expect **link = NULL;
    int rc = PD_OK;
    kv_expect *e = kv_rx_check(rx, h, &link, &rc);
    if (!e) return rc;
    if (h->payload_bytes != kv_ipc_payload_bytes(e->n_blocks))
        return pd_error(PD_EINVAL, "kv IPC frame %s: payload of %llu bytes, expected %zu",
                        h->request_id, (unsigned long long)h->payload_bytes,
                        kv_ipc_payload_bytes(e->n_blocks));
    if (!ops->kv_pull)
        return pd_error(PD_EUNSUPPORTED,
                        "kv IPC frame %s: this decode rank's %s backend cannot take KV by CUDA "
                        "IPC",
                        h->request_id, pd_backend_name(rx->p.backend));
    char mine[KV_BOOT_ID_BYTES];
    boot_id(mine);
    kv_ipc_desc d;
    kv_ipc_unpack(payload, &d);
    if (strncmp(mine, d.boot_id, KV_BOOT_ID_BYTES - 1) != 0)
        return pd_error(PD_EUNSUPPORTED,
                        "kv IPC frame %s: the prefill rank runs on another host (boot id %.36s, "
                        "here %.36s)",
                        h->request_id, d.boot_id, mine);
    if (d.share.p.n_layers != kp->n_layers)
        return pd_error(PD_EINVAL, "kv IPC frame %s: the prefill pool has %d layers, this one %d",
                        h->request_id, d.share.p.n_layers, kp->n_layers);
    void **slot = kv_rx_state(c, &kv_xport_cuda_ipc);
    if (!*slot && !(*slot = calloc(1, sizeof(ipc_peer))))
        return pd_error(PD_ENOMEM, "kv receive: out of memory");
    ipc_peer *pe = *slot;
    if (!pe->peer || pe->id != d.share.id) { /* first IPC frame, or the sender restarted */
        if (pe->peer) ops->kv_peer_close(rx->p.backend, pe->peer);
        pe->peer = NULL;
        PD_CHECK(ops->kv_peer_open(rx->p.backend, rx->p.kv, &d.share, &pe->peer));
        pe->id = d.share.id;
    }
    int32_t *src = malloc(e->n_blocks * sizeof *src);
    if (!src) return pd_error(PD_ENOMEM, "kv receive: out of memory");
    for (size_t i = 0; i < e->n_blocks; i++) src[i] = kv_ipc_block(payload, i);
    pd_kv_pull pl = {.src_blocks = src,
                     .dst_blocks = e->blocks,
                     .n_blocks = e->n_blocks,
                     .n_tokens = e->n_tokens,
                     .src_head0 = d.src_head0,
                     .dst_head0 = h->head0 - rx->p.head0,
                     .n_heads = h->n_heads};
    rc = ops->kv_pull(rx->p.backend, rx->p.kv, pe->peer, &pl);
    free(src);
    if (rc < 0) return rc;
    rx->stats.bytes += (uint64_t)kp->n_layers * kv_slice_bytes(kp, e->n_tokens, h->n_heads);
    kv_rx_mark(rx, e, link, h, 0, (uint32_t)kp->n_layers, &res->complete);
    return PD_OK;
}

/* Unmaps the connection's peer pool, under the receiver's lock as every open is. */
static void ipc_rx_conn_close(kv_rx_conn *c)
{
    pd_kv_tcp_receiver *rx = c->rx;
    void **slot = kv_rx_state(c, &kv_xport_cuda_ipc);
    ipc_peer *pe = *slot;
    pthread_mutex_lock(&rx->mu);
    if (pe->peer) pd_backend_get_ops(rx->p.backend)->kv_peer_close(rx->p.backend, pe->peer);
    pthread_mutex_unlock(&rx->mu);
    free(pe);
    *slot = NULL;
}

const pd_kv_xport kv_xport_cuda_ipc = {
    .name = "cuda_ipc",
    .title = "CUDA IPC",
    .device_only = "the KV pool must be in GPU memory",
    .tx_setup = ipc_tx_setup,
    .tx_release = ipc_tx_release,
    .tx_send = ipc_send,
    .refused = ipc_refused,
    .rx_flags = KV_FLAG_IPC,
    .rx_locked = true,
    .rx_frame = ipc_rx_frame,
    .rx_conn_close = ipc_rx_conn_close,
};
