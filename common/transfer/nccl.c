/* KV transport "nccl": the KV moves device to device over a 2-rank NCCL communicator (the
 * backend's kv_link_* ops) bound to the TCP connection: one communicator per (prefill rank,
 * decode rank) connection, created on the connection's first NCCL request and dropped with it.
 *
 *   link set-up: a frame flagged NCCL_INIT | LAST (| DISTINCT_GPUS) whose payload is the link
 *     id the sender's backend generated (PD_KV_LINK_ID_BYTES: the ncclUniqueId and the sender's
 *     GPU); the receiver acknowledges it (status 0, or PD_EUNSUPPORTED from a backend without
 *     kv_link ops: CPU, and with DISTINCT_GPUS from a receiver on the sender's own GPU) and both
 *     sides then join the link (non-blocking communicator, bounded by a deadline; a failure
 *     drops the connection).
 *   per request: a frame flagged NCCL | LAST with the usual head and block fields and a 16-byte
 *     payload: u32 chunk_layers u32 0 u64 link_bytes (pd_kv_nccl_desc). Then the sender gathers
 *     the prompt's tokens of its blocks, layers in chunks of chunk_layers (coalesced to at most
 *     PD_KV_NCCL_CHUNK_BYTES, at least one layer), into device staging and sends each chunk
 *     (ncclSend); chunk layout = the TCP payloads of its layers concatenated. The receiver
 *     checks the frame against the reservation, receives each chunk (ncclRecv) into staging
 *     without holding its lock, then takes the lock that a cancel takes, checks that the
 *     request is still expected, and scatters the chunk into the reserved blocks; the request
 *     counts as imported after its last chunk. A request refused or cancelled after the frame is
 *     still drained (received, not written) so the link stays in step, then refused in the
 *     acknowledgement. A frame whose chunks cannot be sized safely, a link error or a deadline
 *     drops the connection and its link. Both sides bound every NCCL wait by a deadline and by
 *     a check of the TCP connection (closed = the peer is gone), and the backend's watchdog
 *     aborts a communicator with an asynchronous error, so a dead peer fails the transfer with
 *     a message and never blocks a thread of either process.
 * Choices of this design: the link id travels on the KV data
 * connection, not over gRPC; it is the channel that already pairs one prefill rank with one
 * decode rank, and it keeps the communicator's life equal to the connection's. And a
 * communicator belongs to a connection, not to the (prefill rank, decode rank) pair: a pair with
 * several transfers in flight at once (transfer workers) has one connection, and so one
 * communicator, per concurrent transfer; pooled connections keep theirs for the next request.
 */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

#include "transfer/kv_sock.h"
#include "transfer/kv_xport.h"
#include "util/clock.h"
#include "util/log.h"
#include "util/status.h"

#define LINK_OPEN_MS 30000 /* joining an NCCL link, both sides */

/* pd_kv_link_wait check of one TCP connection: PD_ECLOSED once the peer closed it (or, with
 * stop_fd >= 0, once the receiver is stopping); PD_ECANCELLED once cancel is set. Data waiting on
 * the socket (an early acknowledgement) is left alone. */
typedef struct {
    int fd, stop_fd;
    const atomic_bool *cancel;
} conn_watch;

static int conn_check(void *arg)
{
    const conn_watch *cw = arg;
    if (cw->cancel && atomic_load(cw->cancel))
        return pd_error(PD_ECANCELLED, "the request was cancelled");
    struct pollfd p[2] = {{.fd = cw->fd, .events = POLLIN}, {.fd = cw->stop_fd, .events = POLLIN}};
    if (poll(p, cw->stop_fd >= 0 ? 2 : 1, 0) <= 0) return PD_OK;
    if (cw->stop_fd >= 0 && p[1].revents) return pd_error(PD_ECLOSED, "the receiver is stopping");
    if (p[0].revents & (POLLHUP | POLLERR)) return pd_error(PD_ECLOSED, "the peer hung up");
    if (p[0].revents & POLLIN) {
        uint8_t b;
        ssize_t r = recv(cw->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
        if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR))
            return pd_error(PD_ECLOSED, "the peer closed the KV connection");
    }
    return PD_OK;
}

/* ---- sender ---- */

static int nccl_tx_check(pd_backend *b)
{
    if (!pd_backend_get_ops(b)->kv_link_send)
        return pd_error(PD_EUNSUPPORTED, "the %s backend cannot send KV over NCCL",
                        pd_backend_name(b));
    return PD_OK;
}

/* Sets up the NCCL link of connection s->c (see the file-top comment). */
static int link_up(const kv_send_ctx *s)
{
    const pd_kv_send_req *r = s->r;
    const pd_backend_ops *ops = pd_backend_get_ops(r->backend);
    uint8_t buf[KV_HDR_BYTES + PD_KV_LINK_ID_BYTES];
    kv_hdr h = {.version = KV_VERSION,
                .flags = KV_FLAG_NCCL_INIT | KV_FLAG_LAST |
                         (r->nccl_distinct_gpus ? KV_FLAG_DISTINCT_GPUS : 0u),
                .payload_bytes = PD_KV_LINK_ID_BYTES};
    snprintf(h.request_id, sizeof h.request_id, "%s", r->request_id);
    kv_hdr_pack(&h, buf);
    PD_CHECK(ops->kv_link_id(r->backend, buf + KV_HDR_BYTES));
    int rc = kv_write_full(s->c->fd, buf, sizeof buf, r->cancel, s->deadline);
    if (rc < 0) return pd_error(rc, "kv send %s: %s", r->request_id, kv_io_failure(rc, "writing"));
    PD_CHECK(kv_read_ack(s->c->fd, r, s->deadline, s->keep)); /* PD_EUNSUPPORTED: a CPU one */
    *s->keep = false; /* from here a failure leaves the two sides out of step */
    conn_watch cw = {.fd = s->c->fd, .stop_fd = -1, .cancel = r->cancel};
    pd_kv_link_wait w = {.deadline_ns = s->deadline, .check = conn_check, .check_arg = &cw};
    int64_t t0 = pd_now_ns();
    pd_kv_link *link = NULL;
    rc = ops->kv_link_open(r->backend, buf + KV_HDR_BYTES, 0, &w, &link);
    if (rc < 0)
        return pd_error_prefix(rc, "kv send %s: NCCL link to %s:%d", r->request_id, r->host,
                               r->port);
    s->c->x = &kv_xport_nccl;
    s->c->state = link;
    PD_INFO(r->request_id, "kv NCCL link to %s:%d up in %.3f s", r->host, r->port,
            (double)(pd_now_ns() - t0) / 1e9);
    return PD_OK;
}

/* s->r over the NCCL link of s->c (made first when the connection has none), then the
 * acknowledgement. */
static int nccl_send(const kv_send_ctx *s)
{
    const pd_kv_send_req *r = s->r;
    if (kv_send_partial(r))
        return pd_error(PD_EUNSUPPORTED,
                        "kv send %s: NCCL moves whole pools; a pipeline stage's layers move over "
                        "tcp",
                        r->request_id);
    const pd_kv_params *kp = &r->kv_params;
    const pd_backend_ops *ops = pd_backend_get_ops(r->backend);
    if (!s->c->state) PD_CHECK(link_up(s));
    *s->keep = false;
    size_t layer_b = kv_slice_bytes(kp, s->tokens, r->n_heads);
    pd_kv_nccl_desc d = {
        .chunk_layers = (uint32_t)pd_kv_nccl_chunk_layers(layer_b, kp->n_layers, r->coalesce_bytes),
        .link_bytes = (uint64_t)kp->n_layers * layer_b};
    uint8_t buf[KV_HDR_BYTES + PD_KV_NCCL_DESC_BYTES];
    kv_hdr_for(r, 0, s->tokens, KV_FLAG_NCCL | KV_FLAG_LAST, PD_KV_NCCL_DESC_BYTES, buf);
    pd_kv_nccl_desc_pack(&d, buf + KV_HDR_BYTES);
    int rc = kv_write_full(s->c->fd, buf, sizeof buf, r->cancel, s->deadline);
    if (rc < 0) return pd_error(rc, "kv send %s: %s", r->request_id, kv_io_failure(rc, "writing"));
    s->st->frames = 1; /* the request is on its way: a failure from here is not the link's set-up */
    conn_watch cw = {.fd = s->c->fd, .stop_fd = -1, .cancel = r->cancel};
    pd_kv_link_wait w = {.deadline_ns = s->deadline, .check = conn_check, .check_arg = &cw};
    pd_kv_xfer x = {.blocks = r->block_ids,
                    .n_blocks = r->n_blocks,
                    .n_tokens = s->tokens,
                    .head0 = r->head0 - r->src_head0,
                    .n_heads = r->n_heads,
                    .layer0 = 0,
                    .n_layers = kp->n_layers};
    rc = ops->kv_link_send(r->backend, r->kv, s->c->state, &x, (int)d.chunk_layers, &w);
    if (rc < 0) return pd_error_prefix(rc, "kv send %s over NCCL", r->request_id);
    s->st->writes = ((uint64_t)kp->n_layers + d.chunk_layers - 1) / d.chunk_layers; /* chunks */
    s->st->bytes = d.link_bytes;
    return kv_read_ack(s->c->fd, r, s->deadline, s->keep);
}

static void nccl_tx_conn_close(kv_tx_conn *c)
{
    pd_backend_get_ops(c->owner)->kv_link_close(c->owner, c->state);
}

/* A receiver that refused the link (PD_EUNSUPPORTED), or a link that could not be made: no
 * request frame went out. */
static bool nccl_refused(int rc, const pd_kv_send_stats *st)
{
    return rc == PD_EUNSUPPORTED || st->frames == 0;
}

/* ---- receiver ---- */

/* An NCCL_INIT frame: acknowledges it (refused with PD_EUNSUPPORTED when the backend has no
 * links), then joins the link. Sets res->drop when the connection must be dropped. */
static void rx_link_init(kv_rx_conn *c, const kv_hdr *h, const uint8_t *payload, kv_rx_result *res)
{
    pd_kv_tcp_receiver *rx = c->rx;
    const pd_backend_ops *ops = pd_backend_get_ops(rx->p.backend);
    int st = PD_OK;
    char msg[KV_ACK_MSG_BYTES] = "";
    if (h->payload_bytes != PD_KV_LINK_ID_BYTES) {
        st = pd_error(PD_EINVAL, "kv NCCL link frame: payload of %llu bytes, expected %d",
                      (unsigned long long)h->payload_bytes, PD_KV_LINK_ID_BYTES);
    } else if (!ops->kv_link_open) {
        st = pd_error(PD_EUNSUPPORTED,
                      "kv NCCL link: this decode rank's %s backend cannot take KV over NCCL",
                      pd_backend_name(rx->p.backend));
    } else if ((h->flags & KV_FLAG_DISTINCT_GPUS) && ops->kv_link_local &&
               ops->kv_link_local(rx->p.backend, payload)) {
        st = pd_error(PD_EUNSUPPORTED,
                      "kv NCCL link: the prefill rank runs on this decode rank's own GPU (NCCL "
                      "would carry the KV over its socket transport)");
    }
    res->acked = true;
    if (st < 0) {
        snprintf(msg, sizeof msg, "%s", pd_last_error());
        PD_INFO(h->request_id, "%s", msg);
        kv_rx_refused(rx);
    }
    if (!kv_rx_ack(c, st, h->request_id, msg)) {
        res->drop = true;
        return;
    }
    if (st < 0) return; /* refused and acknowledged: the stream is in sync */
    void **slot = kv_rx_state(c, &kv_xport_nccl);
    if (*slot) { /* the sender made a new link on this connection: the old one is done */
        ops->kv_link_close(rx->p.backend, *slot);
        *slot = NULL;
    }
    conn_watch cw = {.fd = c->fd, .stop_fd = rx->stop_pipe[0], .cancel = NULL};
    pd_kv_link_wait w = {.deadline_ns = pd_now_ns() + LINK_OPEN_MS * PD_NS_PER_MS,
                         .check = conn_check,
                         .check_arg = &cw};
    pd_kv_link *link = NULL;
    if (ops->kv_link_open(rx->p.backend, payload, 1, &w, &link) < 0) {
        PD_ERROR(h->request_id, "kv NCCL link: %s; closing connection", pd_last_error());
        res->drop = true;
        return;
    }
    *slot = link;
    PD_INFO(h->request_id, "kv NCCL link up (decode rank head %zu)", rx->p.head0);
}

/* An NCCL request frame (see the file-top comment): receives every chunk, scatters the chunks
 * of an accepted request. */
static int rx_request(kv_rx_conn *c, const kv_hdr *h, const uint8_t *payload, int64_t deadline,
                      kv_rx_result *res)
{
    pd_kv_tcp_receiver *rx = c->rx;
    const pd_kv_params *kp = &rx->p.kv_params;
    const pd_backend_ops *ops = pd_backend_get_ops(rx->p.backend);
    pd_kv_link *lk = *kv_rx_state(c, &kv_xport_nccl);
    if (!lk || h->payload_bytes != PD_KV_NCCL_DESC_BYTES) {
        /* nothing follows on a link that does not exist; a wrong payload cannot be sized */
        res->drop = lk != NULL;
        return pd_error(PD_EINVAL, "kv NCCL frame %s: %s", h->request_id,
                        lk ? "wrong payload size" : "no NCCL link on this connection");
    }
    /* the chunks' sizes come from the header alone, so a refused request is drained too */
    if (h->n_heads == 0 || h->n_heads > rx->n_local_heads || h->n_tokens == 0 ||
        (size_t)h->n_tokens > kp->n_blocks * kp->block_size) {
        res->drop = true;
        return pd_error(PD_EINVAL, "kv NCCL frame %s: %u heads x %u tokens cannot be received",
                        h->request_id, h->n_heads, h->n_tokens);
    }
    size_t layer_b = kv_slice_bytes(kp, h->n_tokens, h->n_heads);
    pd_kv_nccl_desc d;
    int rc = pd_kv_nccl_desc_unpack(payload, kp->n_layers, layer_b, &d);
    if (rc == PD_OK && (size_t)d.chunk_layers * layer_b > rx->p.max_frame_bytes)
        rc = pd_error(PD_EINVAL, "kv NCCL frame %s: chunks of %zu bytes over the %zu-byte limit",
                      h->request_id, (size_t)d.chunk_layers * layer_b, rx->p.max_frame_bytes);
    if (rc < 0) {
        res->drop = true;
        return rc;
    }
    pthread_mutex_lock(&rx->mu);
    kv_expect **link = NULL;
    int status = PD_OK;
    char msg[KV_ACK_MSG_BYTES] = "";
    if (!kv_rx_check(rx, h, &link, &status)) snprintf(msg, sizeof msg, "%s", pd_last_error());
    pthread_mutex_unlock(&rx->mu);
    conn_watch cw = {.fd = c->fd, .stop_fd = rx->stop_pipe[0], .cancel = NULL};
    pd_kv_link_wait w = {.deadline_ns = deadline, .check = conn_check, .check_arg = &cw};
    for (int l0 = 0; l0 < kp->n_layers; l0 += (int)d.chunk_layers) {
        int n = kp->n_layers - l0 < (int)d.chunk_layers ? kp->n_layers - l0 : (int)d.chunk_layers;
        pd_kv_xfer x = {.blocks = NULL,
                        .n_blocks = 0,
                        .n_tokens = h->n_tokens,
                        .head0 = h->head0 >= rx->p.head0 ? h->head0 - rx->p.head0 : 0,
                        .n_heads = h->n_heads,
                        .layer0 = l0,
                        .n_layers = n};
        rc = ops->kv_link_recv(rx->p.backend, rx->p.kv, lk, &x, &w);
        if (rc < 0) {
            res->drop = true;
            return pd_error_prefix(rc, "kv NCCL receive %s", h->request_id);
        }
        if (status < 0) continue; /* drained, not written */
        pthread_mutex_lock(&rx->mu);
        int64_t t0 = pd_now_ns();
        kv_expect *e = kv_rx_check(rx, h, &link, &status); /* a cancel may have come meanwhile */
        if (e) {
            x.blocks = e->blocks;
            x.n_blocks = e->n_blocks;
            status = ops->kv_link_scatter(rx->p.backend, rx->p.kv, lk, &x);
            if (status == PD_OK && l0 + n == kp->n_layers) {
                rx->stats.bytes += (uint64_t)kp->n_layers * layer_b;
                kv_rx_mark(rx, e, link, h, 0, (uint32_t)kp->n_layers, &res->complete);
            }
            if (status == PD_OK) rx->stats.import_seconds += (double)(pd_now_ns() - t0) / 1e9;
        }
        if (status < 0) snprintf(msg, sizeof msg, "%s", pd_last_error());
        pthread_mutex_unlock(&rx->mu);
    }
    if (status < 0) return pd_error(status, "%s", msg);
    return PD_OK;
}

/* Runs without the receiver's lock, and also for a request refused before (rx_drains): the
 * chunks of every request frame must be taken off the link. */
static int nccl_rx_frame(kv_rx_conn *c, const kv_hdr *h, const uint8_t *payload, int64_t deadline,
                         kv_rx_result *res)
{
    if (h->flags & KV_FLAG_NCCL_INIT) {
        rx_link_init(c, h, payload, res);
        return PD_OK;
    }
    return rx_request(c, h, payload, deadline, res);
}

/* Only the connection's thread uses the link; closing aborts whatever it had in flight. */
static void nccl_rx_conn_close(kv_rx_conn *c)
{
    void **slot = kv_rx_state(c, &kv_xport_nccl);
    pd_backend_get_ops(c->rx->p.backend)->kv_link_close(c->rx->p.backend, *slot);
    *slot = NULL;
}

const pd_kv_xport kv_xport_nccl = {
    .name = "nccl",
    .title = "NCCL",
    .device_only = "NCCL moves the KV between GPU memories",
    .tx_check = nccl_tx_check,
    .tx_own_conns = true,
    .tx_send = nccl_send,
    .tx_conn_close = nccl_tx_conn_close,
    .refused = nccl_refused,
    .rx_flags = KV_FLAG_NCCL | KV_FLAG_NCCL_INIT,
    .rx_locked = false,
    .rx_drains = true,
    .rx_frame = nccl_rx_frame,
    .rx_conn_close = nccl_rx_conn_close,
};
