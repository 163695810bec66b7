/* KV transport "tcp": the KV itself travels in the frames, staged through host memory (the
 * backend's kv_export and kv_import), so it works between any two hosts and any two backends.
 *
 * The sender (P rank) writes one frame per layer (kv_frames.h: header, then K and V of the
 * prompt's tokens of its heads), the last flagged LAST, coalesced into messages of at least
 * coalesce_bytes (1 MiB). Two ways to fill them:
 *   - zero copy: when the pool is host memory and a frame carries every head the rank holds, a
 *     block's K (or V) of one layer is one contiguous run of the pool, so the frames are written
 *     straight from the pool with writev;
 *   - staged: kv_export of each layer into a send buffer behind its header. The buffer is the
 *     backend's host memory (pinned on CUDA), costly to allocate and to touch the first time, so
 *     it is kept for the next send from the same backend (one per send in flight, as large as
 *     the largest send needed).
 * The receiver (D rank) reads a frame straight into kv_import's layout (K, then V, each of whole
 * blocks with the slots past the prompt zero: they do not travel), checks it against the
 * reservation and imports it into the reserved blocks.
 */
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

#include "transfer/kv_sock.h"
#include "transfer/kv_xport.h"
#include "util/status.h"

/* ---- sender ---- */

/* A staging buffer of backend b. */
typedef struct stage_buf {
    struct stage_buf *next;
    pd_backend *b;
    uint8_t *p;
    size_t cap;
} stage_buf;

/* The sender-wide state: the idle staging buffers. */
typedef struct {
    pthread_mutex_t mu;
    stage_buf *idle;
} stage_pool;

static int tcp_tx_create(void **out)
{
    stage_pool *sp = calloc(1, sizeof *sp);
    if (!sp) return pd_error(PD_ENOMEM, "kv send: out of memory");
    pthread_mutex_init(&sp->mu, NULL);
    *out = sp;
    return PD_OK;
}

static void stage_free(stage_buf *sb)
{
    pd_backend_host_free(sb->b, sb->p);
    free(sb);
}

static void tcp_tx_free(void *state)
{
    stage_pool *sp = state;
    while (sp->idle) {
        stage_buf *sb = sp->idle;
        sp->idle = sb->next;
        stage_free(sb);
    }
    pthread_mutex_destroy(&sp->mu);
    free(sp);
}

/* A staging buffer of b with at least bytes (an idle one when there is, grown if need be). */
static int take_stage(stage_pool *sp, pd_backend *b, size_t bytes, stage_buf **out)
{
    stage_buf *sb = NULL;
    pthread_mutex_lock(&sp->mu);
    for (stage_buf **pp = &sp->idle; *pp; pp = &(*pp)->next)
        if ((*pp)->b == b) {
            sb = *pp;
            *pp = sb->next;
            break;
        }
    pthread_mutex_unlock(&sp->mu);
    if (!sb) {
        sb = calloc(1, sizeof *sb);
        if (!sb) return pd_error(PD_ENOMEM, "kv send: out of memory");
        sb->b = b;
    }
    if (sb->cap < bytes) {
        pd_backend_host_free(b, sb->p);
        sb->p = NULL;
        sb->cap = 0;
        void *p = NULL;
        int rc = pd_backend_host_alloc(b, bytes, &p);
        if (rc < 0) {
            free(sb);
            return pd_error_prefix(rc, "kv send: staging");
        }
        sb->p = p;
        sb->cap = bytes;
    }
    *out = sb;
    return PD_OK;
}

static void give_stage(stage_pool *sp, stage_buf *sb)
{
    pthread_mutex_lock(&sp->mu);
    sb->next = sp->idle;
    sp->idle = sb;
    pthread_mutex_unlock(&sp->mu);
}

/* The header of pool layer `layer`'s frame (it names the model's layer); the last layer sent
 * (end - 1) is flagged LAST. */
static void frame_header(const pd_kv_send_req *r, int layer, int end, size_t tokens,
                         size_t per_layer, uint8_t *out)
{
    kv_hdr_for(r, layer + (int)r->layer0, tokens, layer == end - 1 ? KV_FLAG_LAST : 0, per_layer,
               out);
}

/* The zero-copy frames (see the file-top comment): up to IOV_BATCH pieces or `coalesce` bytes
 * go out per call. */
#define IOV_BATCH 1024
static int send_frames_gather(const kv_send_ctx *s, int first, int end, size_t per_layer,
                              size_t coalesce)
{
    const pd_kv_send_req *r = s->r;
    const pd_kv_params *kp = &r->kv_params;
    const pd_backend_ops *ops = pd_backend_get_ops(r->backend);
    size_t tokens = s->tokens;
    uint8_t(*hdrs)[KV_HDR_BYTES] = malloc((size_t)kp->n_layers * KV_HDR_BYTES);
    struct iovec *iov = malloc(IOV_BATCH * sizeof *iov);
    if (!hdrs || !iov) {
        free(hdrs);
        free(iov);
        return pd_error(PD_ENOMEM, "kv send: out of memory");
    }
    int rc = ops->sync(r->backend), cnt = 0;
    size_t pending = 0;
    for (int layer = first; layer < end && rc == PD_OK; layer++) {
        pd_kv_layer_view v;
        rc = ops->kv_layer(r->backend, r->kv, layer, &v);
        if (rc < 0) break;
        frame_header(r, layer, end, tokens, per_layer, hdrs[layer]);
        for (size_t piece = 0; piece < 1 + 2 * r->n_blocks && rc == PD_OK; piece++) {
            void *base;
            size_t len;
            if (piece == 0) {
                base = hdrs[layer], len = KV_HDR_BYTES;
            } else {
                size_t b = (piece - 1) % r->n_blocks;
                uint8_t *pool = piece <= r->n_blocks ? v.k : v.v;
                base = pool + (size_t)r->block_ids[b] * v.block_stride, len = v.block_stride;
                if (b == r->n_blocks - 1) /* the prompt's part of its last block */
                    len = (tokens - b * kp->block_size) * v.token_stride;
            }
            iov[cnt].iov_base = base;
            iov[cnt++].iov_len = len;
            pending += len;
            bool last = layer == end - 1 && piece == 2 * r->n_blocks;
            if (cnt == IOV_BATCH || (piece == 2 * r->n_blocks && pending >= coalesce) || last) {
                rc = kv_writev_full(s->c->fd, iov, cnt, r->cancel, s->deadline);
                s->st->writes++;
                cnt = 0;
                pending = 0;
            }
        }
        s->st->frames++;
        s->st->bytes += per_layer;
    }
    free(hdrs);
    free(iov);
    if (rc == PD_ETIMEOUT || rc == PD_ECLOSED || rc == PD_ECANCELLED)
        return pd_error(rc, "kv send %s: %s", r->request_id, kv_io_failure(rc, "writing"));
    return rc;
}

/* The staged frames (see the file-top comment). */
static int send_frames_staged(const kv_send_ctx *s, int first, int end, size_t per_layer,
                              size_t coalesce)
{
    const pd_kv_send_req *r = s->r;
    const pd_kv_params *kp = &r->kv_params;
    /* kv_export writes whole blocks; the frame keeps the prompt's tokens of K and of V */
    size_t full_layer = kv_slice_bytes(kp, r->n_blocks * kp->block_size, r->n_heads);
    size_t cap = (coalesce > KV_HDR_BYTES + per_layer ? coalesce : KV_HDR_BYTES + per_layer) +
                 KV_HDR_BYTES + full_layer;
    stage_pool *sp = kv_tx_state(s->tx, &kv_xport_tcp);
    stage_buf *sb = NULL;
    PD_CHECK(take_stage(sp, r->backend, cap, &sb));
    uint8_t *buf = sb->p;
    const pd_backend_ops *ops = pd_backend_get_ops(r->backend);
    size_t used = 0;
    int rc = PD_OK;
    for (int layer = first; layer < end && rc == PD_OK; layer++) {
        frame_header(r, layer, end, s->tokens, per_layer, buf + used);
        pd_kv_range range = {.layer = layer,
                             .block_ids = r->block_ids,
                             .n_blocks = r->n_blocks,
                             .head0 = r->head0 - r->src_head0,
                             .n_heads = r->n_heads};
        uint8_t *payload = buf + used + KV_HDR_BYTES;
        rc = ops->kv_export(r->backend, r->kv, &range, payload); /* complete on return */
        if (rc < 0) break;
        if (per_layer < full_layer) /* V right after the prompt's part of K */
            memmove(payload + per_layer / 2, payload + full_layer / 2, per_layer / 2);
        used += KV_HDR_BYTES + per_layer;
        s->st->frames++;
        s->st->bytes += per_layer;
        if (used >= coalesce || layer == end - 1) {
            rc = kv_write_full(s->c->fd, buf, used, r->cancel, s->deadline);
            if (rc < 0) {
                rc = pd_error(rc, "kv send %s: %s", r->request_id, kv_io_failure(rc, "writing"));
                break;
            }
            s->st->writes++;
            used = 0;
        }
    }
    give_stage(sp, sb);
    return rc;
}

static int tcp_send(const kv_send_ctx *s)
{
    const pd_kv_send_req *r = s->r;
    const pd_kv_params *kp = &r->kv_params;
    size_t per_layer = kv_slice_bytes(kp, s->tokens, r->n_heads);
    size_t coalesce = r->coalesce_bytes ? r->coalesce_bytes : (size_t)1 << 20;
    pd_kv_layer_view view;
    const pd_backend_ops *ops = pd_backend_get_ops(r->backend);
    int first, end;
    PD_CHECK(kv_send_layers(r, &first, &end));
    bool gather = r->head0 == r->src_head0 && r->n_heads == kp->n_kv_heads &&
                  ops->kv_layer(r->backend, r->kv, 0, &view) == PD_OK && view.host_visible;
    PD_CHECK(gather ? send_frames_gather(s, first, end, per_layer, coalesce)
                    : send_frames_staged(s, first, end, per_layer, coalesce));
    return kv_read_ack(s->c->fd, r, s->deadline, s->keep);
}

/* ---- receiver ---- */

/* The zeros after each half of a frame laid out as whole blocks: 0 when the payload already is
 * whole blocks, and for a frame whose header does not describe such a payload (read as sent;
 * tcp_rx_frame refuses it). */
static size_t tcp_rx_gap(const pd_kv_params *kp, const kv_hdr *h)
{
    size_t bs = kp->block_size, t = h->n_tokens, nb = h->n_blocks;
    if (h->n_heads > kp->n_kv_heads || nb == 0 || t > nb * bs || t <= (nb - 1) * bs ||
        h->payload_bytes != kv_slice_bytes(kp, t, h->n_heads))
        return 0;
    return (nb * bs - t) * kv_token_bytes(kp, h->n_heads);
}

/* Checks a frame against the reservation and imports it; payload is laid out by tcp_rx_gap
 * (whole blocks). Called with the receiver's lock held. */
static int tcp_rx_frame(kv_rx_conn *c, const kv_hdr *h, const uint8_t *payload, int64_t deadline,
                        kv_rx_result *res)
{
    (void)deadline;
    pd_kv_tcp_receiver *rx = c->rx;
    const pd_kv_params *kp = &rx->p.kv_params;
    kv_expect **link = NULL;
    int rc = PD_OK;
    kv_expect *e = kv_rx_check(rx, h, &link, &rc);
    if (!e) return rc;
    size_t want = kv_slice_bytes(kp, e->n_tokens, h->n_heads);
    if (h->payload_bytes != want)
        return pd_error(PD_EINVAL,
                        "kv frame %s: payload of %llu bytes, expected %zu (this instance's KV "
                        "cache holds %s: do both instances run the same --kv-cache-dtype?)",
                        h->request_id, (unsigned long long)h->payload_bytes, want,
                        pd_dtype_name(kp->dtype));
    pd_kv_range r = {.layer = (int)(h->layer - rx->p.layer0), /* kv_rx_check: in its pool */
                     .block_ids = e->blocks,
                     .n_blocks = e->n_blocks,
                     .head0 = h->head0 - rx->p.head0,
                     .n_heads = h->n_heads};
    rc = pd_backend_get_ops(rx->p.backend)->kv_import(rx->p.backend, rx->p.kv, &r, payload);
    if (rc < 0) return rc;
    rx->stats.bytes += h->payload_bytes;
    kv_rx_mark(rx, e, link, h, h->layer - (uint32_t)rx->p.layer0, 1, &res->complete);
    return PD_OK;
}

const pd_kv_xport kv_xport_tcp = {
    .name = "tcp",
    .title = "TCP",
    .tx_create = tcp_tx_create,
    .tx_free = tcp_tx_free,
    .tx_send = tcp_send,
    .rx_flags = 0,
    .rx_gap = tcp_rx_gap,
    .rx_locked = true,
    .rx_frame = tcp_rx_frame,
};
