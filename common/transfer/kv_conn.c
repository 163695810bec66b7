/* The KV connections every transport shares (see kv_tcp.h for the API, kv_xport.h for the
 * transports): the receiver's expect table, listener and one thread per accepted connection,
 * and the sender's pool of idle connections.
 *
 * Design: the receiver reads every frame the same way (header, then the payload into the
 * backend's host staging) and hands it to the transport its flags name; the transport checks it
 * against the reservation (kv_rx_check) and marks what it imported (kv_rx_mark), and the loop
 * here keeps the one rule that holds for all of them: a request refused once on a connection
 * stays refused until its LAST frame, whose acknowledgement carries the first refusal. The
 * expect table, the rings of imported and cancelled ids and the statistics sit under one lock,
 * which imports take too, so a cancel never races a write into the blocks it frees.
 * The sender dials a connection per destination address and keeps it for the next request when
 * the stream is still in step (acknowledged, even if refused); a transport that keeps state on
 * a connection (NCCL's link) gets connections of its own per prefill backend.
 */
#include "transfer/kv_conn.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "transfer/kv_sock.h"
#include "transfer/kv_xport.h"
#include "util/clock.h"
#include "util/log.h"
#include "util/status.h"

#define FRAME_READ_TIMEOUT_MS 30000
#define ACK_SPIN_NS           200000 /* a sender polls for its acknowledgement this long first */

/* ====================================================================== receiver ========== */

static kv_expect *find_expected(pd_kv_tcp_receiver *rx, const char *id, kv_expect ***link)
{
    kv_expect **pp = &rx->expected;
    for (; *pp; pp = &(*pp)->next)
        if (strcmp((*pp)->id, id) == 0) {
            if (link) *link = pp;
            return *pp;
        }
    return NULL;
}

static void ring_add(kv_id_ring *r, const char *id)
{
    snprintf(r->ids[r->pos], PD_KV_REQUEST_ID_MAX, "%s", id);
    r->pos = (r->pos + 1) % KV_DONE_RING;
}

static bool ring_has(const kv_id_ring *r, const char *id)
{
    for (int i = 0; i < KV_DONE_RING; i++)
        if (r->ids[i][0] && strcmp(r->ids[i], id) == 0) return true;
    return false;
}

static void entry_free(kv_expect *e)
{
    free(e->blocks);
    free(e->got);
    free(e);
}

void **kv_rx_state(kv_rx_conn *c, const pd_kv_xport *x)
{
    return &c->state[kv_xport_slot(x)];
}

int pd_kv_rx_expect(pd_kv_tcp_receiver *rx, const char *request_id, const int32_t *block_ids,
                    size_t n_blocks, size_t n_tokens)
{
    if (!request_id[0] || strlen(request_id) >= PD_KV_REQUEST_ID_MAX)
        return pd_error(PD_EINVAL, "kv receive: request id must be 1..%d bytes",
                        PD_KV_REQUEST_ID_MAX - 1);
    if (n_blocks == 0) return pd_error(PD_EINVAL, "kv receive %s: no blocks", request_id);
    size_t tokens = 0;
    PD_CHECK(kv_tokens_in(&rx->p.kv_params, n_blocks, n_tokens, &tokens));
    for (size_t i = 0; i < n_blocks; i++)
        if (block_ids[i] < 0 || (size_t)block_ids[i] >= rx->p.kv_params.n_blocks)
            return pd_error(PD_EINVAL, "kv receive %s: block id %d outside the pool of %zu",
                            request_id, block_ids[i], rx->p.kv_params.n_blocks);
    kv_expect *e = calloc(1, sizeof *e);
    size_t n_need = (size_t)rx->p.kv_params.n_layers * rx->n_local_heads;
    if (e) {
        e->blocks = malloc(n_blocks * sizeof *e->blocks);
        e->got = calloc(n_need, 1);
    }
    if (!e || !e->blocks || !e->got) {
        if (e) entry_free(e);
        return pd_error(PD_ENOMEM, "kv receive: out of memory");
    }
    snprintf(e->id, sizeof e->id, "%s", request_id);
    memcpy(e->blocks, block_ids, n_blocks * sizeof *block_ids);
    e->n_blocks = n_blocks;
    e->n_tokens = tokens;
    e->n_need = n_need;
    pthread_mutex_lock(&rx->mu);
    int rc = PD_OK;
    if (find_expected(rx, request_id, NULL))
        rc = pd_error(PD_EEXIST, "kv receive %s: already expected", request_id);
    else if (ring_has(&rx->imported, request_id))
        rc = pd_error(PD_EEXIST, "kv receive %s: already imported", request_id);
    if (rc == PD_OK) {
        e->next = rx->expected;
        rx->expected = e;
        rx->stats.expected++;
    }
    pthread_mutex_unlock(&rx->mu);
    if (rc < 0) entry_free(e);
    return rc;
}

int pd_kv_rx_cancel(pd_kv_tcp_receiver *rx, const char *request_id)
{
    pthread_mutex_lock(&rx->mu);
    kv_expect **link = NULL;
    kv_expect *e = find_expected(rx, request_id, &link);
    if (e) {
        *link = e->next;
        rx->stats.expected--;
        ring_add(&rx->cancelled, request_id);
    }
    pthread_mutex_unlock(&rx->mu);
    if (!e) return pd_error(PD_ENOTFOUND, "kv receive %s: not expected", request_id);
    entry_free(e);
    return PD_OK;
}

void pd_kv_rx_get_stats(pd_kv_tcp_receiver *rx, pd_kv_rx_stats *out)
{
    pthread_mutex_lock(&rx->mu);
    *out = rx->stats;
    pthread_mutex_unlock(&rx->mu);
}

kv_expect *kv_rx_check(pd_kv_tcp_receiver *rx, const kv_hdr *h, kv_expect ***link, int *rc)
{
    const pd_kv_params *kp = &rx->p.kv_params;
    kv_expect *e = find_expected(rx, h->request_id, link);
    if (!e) {
        if (ring_has(&rx->cancelled, h->request_id))
            *rc = pd_error(PD_ECANCELLED, "kv frame for request %s dropped: it was cancelled",
                           h->request_id);
        else
            *rc = pd_error(PD_EINVAL, "kv frame for request %s refused: %s", h->request_id,
                           ring_has(&rx->imported, h->request_id) ? "already imported"
                                                                  : "not expected");
        return NULL;
    }
    if (h->layer < rx->p.layer0 || h->layer - rx->p.layer0 >= (size_t)kp->n_layers)
        *rc =
            pd_error(PD_EINVAL, "kv frame %s: layer %u outside this rank's %zu..%zu", h->request_id,
                     h->layer, rx->p.layer0, rx->p.layer0 + (size_t)kp->n_layers - 1);
    else if (h->n_heads == 0 || h->head0 < rx->p.head0 ||
             (size_t)h->head0 + h->n_heads > rx->p.head0 + rx->n_local_heads)
        *rc = pd_error(PD_EINVAL, "kv frame %s: heads %u..%u outside this rank's %zu..%zu",
                       h->request_id, h->head0, h->head0 + h->n_heads - 1, rx->p.head0,
                       rx->p.head0 + rx->n_local_heads - 1);
    else if (h->block0 != 0 || h->n_blocks != e->n_blocks || h->n_tokens != e->n_tokens)
        *rc =
            pd_error(PD_EINVAL,
                     "kv frame %s: blocks %u+%u holding %u tokens, expected 0+%zu "
                     "holding %zu",
                     h->request_id, h->block0, h->n_blocks, h->n_tokens, e->n_blocks, e->n_tokens);
    else
        return e;
    return NULL;
}

void kv_rx_mark(pd_kv_tcp_receiver *rx, kv_expect *e, kv_expect **link, const kv_hdr *h,
                uint32_t l0, uint32_t nl, kv_expect **complete)
{
    size_t local0 = h->head0 - rx->p.head0;
    /* A (layer, head) that arrives again before the request is complete comes from a prefill
     * retried on another instance after a transfer broke half-way (the scheduler keeps the
     * reservation): it is the same prompt's KV, so it overwrites the first copy and counts once. */
    for (uint32_t l = l0; l < l0 + nl; l++) {
        uint8_t *got = e->got + (size_t)l * rx->n_local_heads + local0;
        for (size_t i = 0; i < h->n_heads; i++) e->n_got += !got[i];
        memset(got, 1, h->n_heads);
    }
    rx->stats.frames++;
    if (e->n_got == e->n_need) {
        *link = e->next;
        rx->stats.expected--;
        rx->stats.completed++;
        rx->stats.transport = kv_xport_of_frame(h->flags)->name;
        ring_add(&rx->imported, e->id);
        *complete = e;
    }
}

void kv_rx_refused(pd_kv_tcp_receiver *rx)
{
    pthread_mutex_lock(&rx->mu);
    rx->stats.refused++;
    pthread_mutex_unlock(&rx->mu);
}

bool kv_rx_ack(kv_rx_conn *c, int32_t status, const char *id, const char *msg)
{
    uint8_t ack[KV_ACK_BYTES];
    kv_ack_pack(ack, status, id, msg);
    return kv_write_full(c->fd, ack, KV_ACK_BYTES, NULL, pd_now_ns() + 5 * PD_NS_PER_S) == PD_OK;
}

/* x's rx_frame, under the receiver's lock and timed when x asks for it; a refusal counted. */
static int rx_frame(kv_rx_conn *c, const pd_kv_xport *x, const kv_hdr *h, const uint8_t *payload,
                    int64_t deadline, kv_rx_result *res)
{
    pd_kv_tcp_receiver *rx = c->rx;
    if (!x->rx_locked) {
        int rc = x->rx_frame(c, h, payload, deadline, res);
        if (rc < 0) kv_rx_refused(rx);
        return rc;
    }
    pthread_mutex_lock(&rx->mu);
    int64_t t0 = pd_now_ns();
    int rc = x->rx_frame(c, h, payload, deadline, res);
    if (rc == PD_OK) rx->stats.import_seconds += (double)(pd_now_ns() - t0) / 1e9;
    if (rc < 0) rx->stats.refused++;
    pthread_mutex_unlock(&rx->mu);
    return rc;
}

static void *rx_conn_main(void *arg)
{
    kv_rx_conn *c = arg;
    pd_kv_tcp_receiver *rx = c->rx;
    uint8_t hb[KV_HDR_BYTES];
    uint8_t *buf = NULL;
    size_t cap = 0;
    char cur_id[PD_KV_REQUEST_ID_MAX] = "";
    int cur_status = PD_OK;
    char cur_msg[KV_ACK_MSG_BYTES] = "";
    for (;;) {
        /* idle between frames: no deadline, and the stop signal is looked at; inside a frame:
           FRAME_READ_TIMEOUT_MS from its first byte */
        if (kv_wait_fd(c->fd, POLLIN, rx->stop_pipe[0], NULL, INT64_MAX) != 1) break;
        int64_t deadline = pd_now_ns() + FRAME_READ_TIMEOUT_MS * PD_NS_PER_MS;
        if (kv_read_full(c->fd, hb, KV_HDR_BYTES, rx->stop_pipe[0], NULL, deadline) != PD_OK) break;
        kv_hdr h;
        if (!kv_hdr_unpack(hb, &h) || h.version != KV_VERSION) {
            PD_ERROR(NULL, "kv receive: bad frame header (magic or version); closing connection");
            break;
        }
        if (h.payload_bytes > rx->p.max_frame_bytes) {
            PD_ERROR(h.request_id,
                     "kv receive: frame of %llu bytes over the %zu-byte limit; "
                     "closing connection",
                     (unsigned long long)h.payload_bytes, rx->p.max_frame_bytes);
            break;
        }
        const pd_kv_xport *x = kv_xport_of_frame(h.flags);
        size_t gap = x->rx_gap ? x->rx_gap(&rx->p.kv_params, &h) : 0, half = h.payload_bytes / 2;
        size_t need = h.payload_bytes + 2 * gap;
        if (need > cap) { /* the backend's staging: imports from it are one DMA */
            pd_backend_host_free(rx->p.backend, buf);
            buf = NULL;
            cap = 0;
            void *nb = NULL;
            if (pd_backend_host_alloc(rx->p.backend, need, &nb) < 0) {
                PD_ERROR(h.request_id, "kv receive: a %llu-byte frame: %s",
                         (unsigned long long)h.payload_bytes, pd_last_error());
                break;
            }
            buf = nb;
            cap = need;
        }
        int rrc = kv_read_full(c->fd, buf, gap ? half : h.payload_bytes, rx->stop_pipe[0], NULL,
                               deadline);
        if (gap && rrc == PD_OK)
            rrc = kv_read_full(c->fd, buf + half + gap, half, rx->stop_pipe[0], NULL, deadline);
        if (rrc != PD_OK) {
            PD_WARN(h.request_id, "kv receive: connection lost inside a frame");
            break;
        }
        if (gap) {
            memset(buf + half, 0, gap);
            memset(buf + 2 * half + gap, 0, gap);
        }
        if (strcmp(h.request_id, cur_id) != 0) { /* a new request on this connection */
            snprintf(cur_id, sizeof cur_id, "%s", h.request_id);
            cur_status = PD_OK;
            cur_msg[0] = '\0';
        }
        kv_rx_result res = {0};
        if (x->rx_drains || cur_status == PD_OK) {
            int rc = rx_frame(c, x, &h, buf, deadline, &res);
            if (res.acked) { /* a set-up frame, answered: no request goes on */
                cur_id[0] = '\0';
                if (res.drop) break;
                continue;
            }
            if (rc < 0 && cur_status == PD_OK) {
                cur_status = rc;
                snprintf(cur_msg, sizeof cur_msg, "%s", pd_last_error());
                if (rc == PD_ECANCELLED || rc == PD_EUNSUPPORTED) /* an abort raced the
                         transfer; a device transport the sender will replace by another */
                    PD_INFO(h.request_id, "%s", cur_msg);
                else
                    PD_ERROR(h.request_id, "%s", cur_msg);
            }
            if (res.drop) {
                PD_ERROR(h.request_id, "kv %s: closing the connection", x->title);
                break;
            }
        } else {
            kv_rx_refused(rx);
        }
        if (res.complete) {
            if (rx->done) rx->done(rx->done_arg, res.complete->id, PD_OK);
            entry_free(res.complete);
        }
        if (h.flags & KV_FLAG_LAST) {
            if (!kv_rx_ack(c, cur_status, cur_id, cur_msg)) break;
            cur_id[0] = '\0';
        }
    }
    pd_backend_host_free(rx->p.backend, buf);
    for (size_t i = 0; i < kv_n_xports; i++) /* only this thread uses them */
        if (c->state[i] && kv_xports[i]->rx_conn_close) kv_xports[i]->rx_conn_close(c);
    close(c->fd);
    pthread_mutex_lock(&rx->mu);
    c->finished = true;
    pthread_mutex_unlock(&rx->mu);
    return NULL;
}

/* Joins connection threads that have ended. Called with rx->mu NOT held. */
static void reap_conns(pd_kv_tcp_receiver *rx, bool all)
{
    for (;;) {
        kv_rx_conn *victim = NULL;
        pthread_mutex_lock(&rx->mu);
        for (kv_rx_conn **pp = &rx->conns; *pp; pp = &(*pp)->next)
            if ((*pp)->finished || all) {
                victim = *pp;
                *pp = victim->next;
                break;
            }
        pthread_mutex_unlock(&rx->mu);
        if (!victim) return;
        pthread_join(victim->thread, NULL);
        free(victim);
    }
}

static void *rx_accept_main(void *arg)
{
    pd_kv_tcp_receiver *rx = arg;
    for (;;) {
        if (kv_wait_fd(rx->listen_fd, POLLIN, rx->stop_pipe[0], NULL, INT64_MAX) <= 0) break;
        int fd = accept(rx->listen_fd, NULL, NULL);
        if (fd < 0) continue;
        kv_tune_socket(fd);
        reap_conns(rx, false);
        kv_rx_conn *c = calloc(1, sizeof *c);
        if (!c) {
            close(fd);
            continue;
        }
        c->rx = rx;
        c->fd = fd;
        pthread_mutex_lock(&rx->mu);
        c->next = rx->conns;
        rx->conns = c;
        pthread_mutex_unlock(&rx->mu);
        if (pthread_create(&c->thread, NULL, rx_conn_main, c) != 0) {
            close(fd);
            pthread_mutex_lock(&rx->mu);
            rx->conns = c->next;
            pthread_mutex_unlock(&rx->mu);
            free(c);
        }
    }
    return NULL;
}

int pd_kv_tcp_receiver_start(const pd_kv_rx_params *p, pd_kv_rx_done_fn done, void *arg,
                             pd_kv_tcp_receiver **out)
{
    if (p->kv_params.n_kv_heads == 0 || p->kv_params.n_layers <= 0)
        return pd_error(PD_EINVAL, "kv receive: empty KV pool parameters");
    pd_kv_tcp_receiver *rx = calloc(1, sizeof *rx);
    if (!rx) return pd_error(PD_ENOMEM, "kv receive: out of memory");
    rx->p = *p;
    if (!rx->p.max_frame_bytes) rx->p.max_frame_bytes = (size_t)256 << 20;
    rx->n_local_heads = p->kv_params.n_kv_heads;
    rx->done = done;
    rx->done_arg = arg;
    pthread_mutex_init(&rx->mu, NULL);
    int rc = kv_listen(p->host, p->port, &rx->listen_fd, &rx->port);
    if (rc < 0) goto fail;
    if (pipe(rx->stop_pipe) != 0) {
        rc = pd_error(PD_EIO, "kv receive: pipe: %s", strerror(errno));
        close(rx->listen_fd);
        goto fail;
    }
    pthread_create(&rx->accept_thread, NULL, rx_accept_main, rx);
    *out = rx;
    return PD_OK;
fail:
    pthread_mutex_destroy(&rx->mu);
    free(rx);
    return rc;
}

int pd_kv_tcp_receiver_port(const pd_kv_tcp_receiver *rx)
{
    return rx->port;
}

void pd_kv_tcp_receiver_stop(pd_kv_tcp_receiver *rx)
{
    if (!rx) return;
    ssize_t w = write(rx->stop_pipe[1], "x", 1); /* wakes the accept and connection threads */
    (void)w;
    pthread_join(rx->accept_thread, NULL);
    reap_conns(rx, true);
    close(rx->listen_fd);
    close(rx->stop_pipe[0]);
    close(rx->stop_pipe[1]);
    while (rx->expected) {
        kv_expect *e = rx->expected;
        rx->expected = e->next;
        entry_free(e);
    }
    pthread_mutex_destroy(&rx->mu);
    free(rx);
}

/* ====================================================================== sender ============ */

typedef struct kv_idle_conn {
    struct kv_idle_conn *next;
    char addr[300];
    kv_tx_conn c;
} kv_idle_conn;

static void tx_conn_close(kv_tx_conn *c)
{
    if (c->state) c->x->tx_conn_close(c);
    c->state = NULL;
    c->x = NULL;
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
}

void *kv_tx_state(pd_kv_tcp_sender *tx, const pd_kv_xport *x)
{
    return tx->state[kv_xport_slot(x)];
}

int pd_kv_tcp_sender_create(pd_kv_tcp_sender **out)
{
    pd_kv_tcp_sender *tx = calloc(1, sizeof *tx);
    if (!tx) return pd_error(PD_ENOMEM, "kv send: out of memory");
    pthread_mutex_init(&tx->mu, NULL);
    for (size_t i = 0; i < kv_n_xports; i++) {
        int rc = kv_xports[i]->tx_create ? kv_xports[i]->tx_create(&tx->state[i]) : PD_OK;
        if (rc < 0) {
            pd_kv_tcp_sender_free(tx);
            return rc;
        }
    }
    *out = tx;
    return PD_OK;
}

void pd_kv_tcp_sender_free(pd_kv_tcp_sender *tx)
{
    if (!tx) return;
    while (tx->idle) {
        kv_idle_conn *ic = tx->idle;
        tx->idle = ic->next;
        tx_conn_close(&ic->c);
        free(ic);
    }
    for (size_t i = 0; i < kv_n_xports; i++)
        if (tx->state[i]) kv_xports[i]->tx_free(tx->state[i]);
    pthread_mutex_destroy(&tx->mu);
    free(tx);
}

/* An idle connection to addr owned by owner (NULL: a shared one); false when there is none. */
static bool take_conn(pd_kv_tcp_sender *tx, const char *addr, pd_backend *owner, kv_tx_conn *out)
{
    pthread_mutex_lock(&tx->mu);
    for (kv_idle_conn **pp = &tx->idle; *pp; pp = &(*pp)->next)
        if (strcmp((*pp)->addr, addr) == 0 && (*pp)->c.owner == owner) {
            kv_idle_conn *ic = *pp;
            *pp = ic->next;
            pthread_mutex_unlock(&tx->mu);
            *out = ic->c;
            free(ic);
            return true;
        }
    pthread_mutex_unlock(&tx->mu);
    return false;
}

static void give_conn(pd_kv_tcp_sender *tx, const char *addr, kv_tx_conn *c)
{
    kv_idle_conn *ic = malloc(sizeof *ic);
    if (!ic) {
        tx_conn_close(c);
        return;
    }
    snprintf(ic->addr, sizeof ic->addr, "%s", addr);
    ic->c = *c;
    pthread_mutex_lock(&tx->mu);
    ic->next = tx->idle;
    tx->idle = ic;
    pthread_mutex_unlock(&tx->mu);
}

/* Polls fd without sleeping until it is readable or ACK_SPIN_NS have passed. An acknowledgement
 * usually comes within tens of microseconds (a small TCP frame, a CUDA IPC pull), and waking a
 * thread that sleeps in poll() costs about as much again (20 us on a 2-core VM). */
static void spin_readable(int fd, const atomic_bool *cancel)
{
    int64_t until = pd_now_ns() + ACK_SPIN_NS;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    while (!(cancel && atomic_load(cancel)) && poll(&p, 1, 0) == 0 && pd_now_ns() < until) {
    }
}

int kv_read_ack(int fd, const pd_kv_send_req *r, int64_t deadline, bool *keep)
{
    uint8_t ack[KV_ACK_BYTES];
    spin_readable(fd, r->cancel);
    int rc = kv_read_full(fd, ack, KV_ACK_BYTES, -1, r->cancel, deadline);
    if (rc < 0)
        return pd_error(rc, "kv send %s: %s", r->request_id,
                        kv_io_failure(rc, "waiting for the acknowledgement"));
    int32_t status = 0;
    char msg[KV_ACK_MSG_BYTES];
    if (!kv_ack_unpack(ack, r->request_id, &status, msg))
        return pd_error(PD_EINTERNAL, "kv send %s: malformed acknowledgement", r->request_id);
    *keep = true; /* acknowledged: the stream is still in sync */
    if (status != 0) {
        int st_code = status == PD_EUNSUPPORTED ? PD_EUNSUPPORTED : PD_EINVAL;
        return pd_error(st_code, "kv send %s: refused by the decode rank: %s", r->request_id, msg);
    }
    return PD_OK;
}

/* x's tx_send of r over c. *keep tells whether the connection is still in sync (success, or a
 * refusal the receiver acknowledged). */
static int send_once(pd_kv_tcp_sender *tx, const pd_kv_xport *x, const void *arg, kv_tx_conn *c,
                     const pd_kv_send_req *r, int64_t deadline, pd_kv_send_stats *st, bool *keep)
{
    *keep = false;
    size_t tokens = 0;
    PD_CHECK(kv_tokens_in(&r->kv_params, r->n_blocks, r->n_tokens, &tokens));
    kv_send_ctx s = {.tx = tx,
                     .c = c,
                     .r = r,
                     .arg = arg,
                     .tokens = tokens,
                     .deadline = deadline,
                     .st = st,
                     .keep = keep};
    return x->tx_send(&s);
}

int kv_send(pd_kv_tcp_sender *tx, const pd_kv_xport *x, const void *arg, const pd_kv_send_req *r,
            pd_kv_send_stats *stats)
{
    pd_kv_send_stats st = {.transport = x->name};
    if (stats) *stats = st; /* also for the early returns below */
    if (r->n_heads == 0 || r->n_blocks == 0)
        return pd_error(PD_EINVAL, "kv send %s: nothing to send (heads %zu, blocks %zu)",
                        r->request_id, r->n_heads, r->n_blocks);
    if (r->head0 < r->src_head0 || r->head0 + r->n_heads > r->src_head0 + r->kv_params.n_kv_heads)
        return pd_error(PD_EINVAL, "kv send %s: heads %zu+%zu not held by this rank (%zu+%zu)",
                        r->request_id, r->head0, r->n_heads, r->src_head0, r->kv_params.n_kv_heads);
    if (strlen(r->request_id) >= PD_KV_REQUEST_ID_MAX || !r->request_id[0])
        return pd_error(PD_EINVAL, "kv send: request id must be 1..%d bytes",
                        PD_KV_REQUEST_ID_MAX - 1);
    char addr[300];
    snprintf(addr, sizeof addr, "%s:%d", r->host, r->port);
    int64_t t0 = pd_now_ns();
    int64_t deadline = t0 + (int64_t)(r->timeout_ms > 0 ? r->timeout_ms : 30000) * PD_NS_PER_MS;
    if (x->tx_check) {
        int rc = x->tx_check(r->backend);
        if (rc < 0) return pd_error_prefix(rc, "kv send %s", r->request_id);
    }
    kv_tx_conn c = {.fd = -1, .owner = x->tx_own_conns ? r->backend : NULL};
    bool reused = take_conn(tx, addr, c.owner, &c);
    if (!reused) PD_CHECK(kv_dial(r->host, r->port, r->cancel, deadline, &c.fd));
    bool keep = false;
    int rc = send_once(tx, x, arg, &c, r, deadline, &st, &keep);
    if (rc == PD_ECLOSED && reused && !keep) { /* the pooled connection had gone stale */
        tx_conn_close(&c);
        st = (pd_kv_send_stats){.transport = x->name};
        PD_CHECK(kv_dial(r->host, r->port, r->cancel, deadline, &c.fd));
        rc = send_once(tx, x, arg, &c, r, deadline, &st, &keep);
    }
    if (keep)
        give_conn(tx, addr, &c);
    else
        tx_conn_close(&c);
    st.seconds = (double)(pd_now_ns() - t0) / 1e9;
    if (stats) *stats = st;
    return rc;
}

int pd_kv_tcp_send(pd_kv_tcp_sender *tx, const pd_kv_send_req *r, pd_kv_send_stats *stats)
{
    /* the one place the request's own choice of transport is read */
    const pd_kv_xport *x = r->share ? &kv_xport_cuda_ipc : r->nccl ? &kv_xport_nccl : &kv_xport_tcp;
    return kv_send(tx, x, r->share, r, stats);
}
