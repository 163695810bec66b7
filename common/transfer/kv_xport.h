/* A KV transport: one way of moving a prompt's KV from a prefill rank to a decode rank, behind
 * one small table of operations, one file per transport (tcp.c, cuda_ipc.c, nccl.c).
 *
 * Every transport rides the KV connection of kv_conn.c: one TCP connection per (sender,
 * destination) request at a time, whose frames (kv_frames.h) carry the request, and whose
 * acknowledgement ends it. What differs is what the frames carry and what else moves:
 *   tcp       the KV itself, in frames (host staging)
 *   cuda_ipc  one frame describing the prefill pool; the receiver copies device to device
 *   nccl      one frame describing the chunks that follow on an NCCL link of the connection
 * so a transport is the sender's half of a request (tx_send, with what the sending rank has to
 * set up once, tx_setup) and the receiver's half of its frames (rx_frame), with the state each
 * keeps on a connection. The expect table, cancellation, the connection pool and the threads
 * are the same for all (kv_conn.c), and so are the receiver's statistics.
 *
 * Adding a transport (RDMA, UCX): a file that fills a pd_kv_xport, a header flag of its own for
 * its frames (kv_frames.h), and one entry in the table of kv_route.c, which also places it in
 * --kv-transport auto's order.
 */
#ifndef PD_TRANSFER_KV_XPORT_H
#define PD_TRANSFER_KV_XPORT_H

#include <stdbool.h>
#include <stdint.h>

#include "transfer/kv_conn.h"

/* A send in progress, for tx_send. */
typedef struct {
    pd_kv_tcp_sender *tx;
    kv_tx_conn *c; /* dialled or taken from the pool; the transport's state on it in c->state */
    const pd_kv_send_req *r;
    const void *arg;      /* what tx_setup made for the sending rank (pd_kv_tcp_send: r->share) */
    size_t tokens;        /* the prompt's tokens in r's blocks */
    int64_t deadline;     /* of the whole send */
    pd_kv_send_stats *st; /* frames, bytes, writes to fill */
    bool *keep;           /* set: the connection is in step after the send (false on entry) */
} kv_send_ctx;

/* What the receiver loop does after a frame. */
typedef struct {
    kv_expect *complete; /* the request whose import the frame completed (NULL: none) */
    bool drop;           /* the stream cannot go on: close the connection */
    bool acked;          /* the frame was a set-up frame outside any request that rx_frame has
                            answered (and counted and logged, when refused) itself */
} kv_rx_result;

struct pd_kv_xport {
    const char *name;        /* the --kv-transport value and metric label: "tcp" */
    const char *title;       /* for log lines: "TCP" */
    const char *device_only; /* NULL, or why it needs --device cuda (for the refusal) */

    /* ---- sender (prefill rank) ---- */
    /* Whether backend b can send this way: PD_OK, or PD_EUNSUPPORTED with the reason. Checked
     * before a send dials. NULL: every backend can. */
    int (*tx_check)(pd_backend *b);
    /* Once per prefill rank, for a route: what its sends need (*arg, released by tx_release).
     * PD_EUNSUPPORTED with the reason when the rank cannot send this way. NULL: nothing. */
    int (*tx_setup)(pd_backend *b, const pd_kv *kv, void **arg);
    void (*tx_release)(void *arg);
    /* Sender-wide state, made with the sender (tx_create) and freed with it. NULL: none. */
    int (*tx_create)(void **state);
    void (*tx_free)(void *state);
    bool tx_own_conns; /* connections of its own per prefill backend (NCCL: each carries the
                          rank's link); else it shares the plain ones per address */
    /* Sends s->r over s->c, then reads the acknowledgement (kv_read_ack). */
    int (*tx_send)(const kv_send_ctx *s);
    /* Frees c->state (c->owner's). NULL where tx_send keeps none. */
    void (*tx_conn_close)(kv_tx_conn *c);
    /* Whether rc (with st) from a send means the destination refuses this transport, so that
     * --kv-transport auto gives it the next one from then on. Never called with PD_ECANCELLED.
     * NULL: never (the last resort). */
    bool (*refused)(int rc, const pd_kv_send_stats *st);

    /* ---- receiver (decode rank) ---- */
    uint16_t rx_flags; /* frames flagged with any of these are this transport's (0: the frames
                          no other transport claims) */
    /* Zero bytes after each half of the payload as the receiver lays it out (tcp: the slots
     * past the prompt in its last block). NULL: 0, the payload is read as sent. */
    size_t (*rx_gap)(const pd_kv_params *kp, const kv_hdr *h);
    bool rx_locked; /* rx_frame runs under the receiver's lock and counts as import time (else
                       it takes the lock itself around what needs it) */
    bool rx_drains; /* rx_frame runs also for a request refused earlier on the connection (its
                       data follows outside the frames and must be taken off the wire) */
    /* One frame of this transport, header and payload read; the header is checked only for
     * magic, version and size. Returns PD_OK or the refusal (message set) that the
     * acknowledgement carries. */
    int (*rx_frame)(kv_rx_conn *c, const kv_hdr *h, const uint8_t *payload, int64_t deadline,
                    kv_rx_result *res);
    /* Frees the connection's state (*kv_rx_state(c, x)) when the connection ends. NULL: none. */
    void (*rx_conn_close)(kv_rx_conn *c);
};

extern const pd_kv_xport kv_xport_tcp;      /* tcp.c */
extern const pd_kv_xport kv_xport_cuda_ipc; /* cuda_ipc.c */
extern const pd_kv_xport kv_xport_nccl;     /* nccl.c */

/* ---- the table (kv_route.c) ---- */

/* Every transport, in the order --kv-transport auto tries them; kv_n_xports entries. */
extern const pd_kv_xport *const kv_xports[];
extern const size_t kv_n_xports;
/* x's index in kv_xports. */
size_t kv_xport_slot(const pd_kv_xport *x);
/* NULL when no transport has that name. */
const pd_kv_xport *kv_xport_by_name(const char *name);
/* The transport whose frames carry these header flags. */
const pd_kv_xport *kv_xport_of_frame(uint16_t flags);

#endif
