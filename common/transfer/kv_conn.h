/* Internals of the KV connections shared by every transport (kv_conn.c): the receiver's state
 * (its expect table, its connections and their threads) and the sender's (its pool of idle
 * connections), with the helpers a transport file uses to check a frame against a reservation,
 * to mark it imported, to acknowledge, and to read an acknowledgement. Not a public header: the
 * transports (kv_xport.h) and kv_conn.c include it; callers use kv_tcp.h.
 */
#ifndef PD_TRANSFER_KV_CONN_H
#define PD_TRANSFER_KV_CONN_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "transfer/kv_frames.h"
#include "transfer/kv_tcp.h"

#define KV_XPORT_MAX 8 /* transports in the table (kv_route.c), at most */
#define KV_DONE_RING 256

typedef struct pd_kv_xport pd_kv_xport;

/* ---- receiver ---- */

/* An expected import (pd_kv_rx_expect). */
typedef struct kv_expect {
    struct kv_expect *next;
    char id[PD_KV_REQUEST_ID_MAX];
    int32_t *blocks; /* (n_blocks) the reserved blocks */
    size_t n_blocks;
    size_t n_tokens; /* the prompt's tokens in those blocks */
    uint8_t *got;    /* (n_layers, n_local_heads) flags */
    size_t n_got, n_need;
} kv_expect;

/* The last KV_DONE_RING request ids of a kind (a ring). */
typedef struct {
    char ids[KV_DONE_RING][PD_KV_REQUEST_ID_MAX];
    int pos;
} kv_id_ring;

/* One accepted connection and its thread. */
typedef struct kv_rx_conn {
    struct kv_rx_conn *next;
    pd_kv_tcp_receiver *rx;
    int fd;
    pthread_t thread;
    bool finished;
    void *state[KV_XPORT_MAX]; /* what each transport keeps on the connection (kv_rx_state) */
} kv_rx_conn;

struct pd_kv_tcp_receiver {
    pd_kv_rx_params p;
    size_t n_local_heads;
    pd_kv_rx_done_fn done;
    void *done_arg;
    int listen_fd, port;
    int stop_pipe[2]; /* written once by pd_kv_tcp_receiver_stop: every thread ends */
    pthread_t accept_thread;
    pthread_mutex_t mu; /* the expect table, the rings, conns, stats; imports run under it */
    kv_expect *expected;
    kv_id_ring imported;  /* requests imported lately */
    kv_id_ring cancelled; /* requests cancelled lately (their frames may still be on the way) */
    kv_rx_conn *conns;
    pd_kv_rx_stats stats;
};

/* The slot where transport x keeps its state on connection c (NULL until x sets it). */
void **kv_rx_state(kv_rx_conn *c, const pd_kv_xport *x);

/* Checks a frame's header against the reservation. Called with rx->mu held. Returns the
 * expected entry (and *link to it) or NULL with the refusal's message set in *rc. */
kv_expect *kv_rx_check(pd_kv_tcp_receiver *rx, const kv_hdr *h, kv_expect ***link, int *rc);
/* Marks layers [l0, l0 + nl) x the frame's heads imported; *complete when that was the rest
 * (e is then unlinked: the caller hands it to the receiver loop). Called with rx->mu held. */
void kv_rx_mark(pd_kv_tcp_receiver *rx, kv_expect *e, kv_expect **link, const kv_hdr *h,
                uint32_t l0, uint32_t nl, kv_expect **complete);
/* Counts a refused frame. Called with rx->mu NOT held. */
void kv_rx_refused(pd_kv_tcp_receiver *rx);
/* Writes an acknowledgement on c. False when the connection is lost. */
bool kv_rx_ack(kv_rx_conn *c, int32_t status, const char *id, const char *msg);

/* ---- sender ---- */

/* A connection a send works on. */
typedef struct {
    int fd;
    pd_backend *owner;    /* connections kept per prefill backend (a transport whose
                             tx_own_conns is set): that backend; NULL: shared ones */
    const pd_kv_xport *x; /* the transport whose state the connection holds (NULL: none) */
    void *state;          /* x's (NCCL: the link) */
} kv_tx_conn;

struct pd_kv_tcp_sender {
    pthread_mutex_t mu; /* idle */
    struct kv_idle_conn *idle;
    void *state[KV_XPORT_MAX]; /* each transport's sender-wide state (tx_create) */
};

/* Transport x's sender-wide state (what its tx_create made). */
void *kv_tx_state(pd_kv_tcp_sender *tx, const pd_kv_xport *x);
/* Reads the acknowledgement of r's last frame. *keep = the stream is in sync after it. */
int kv_read_ack(int fd, const pd_kv_send_req *r, int64_t deadline, bool *keep);
/* One send of r by transport x (arg: what x's tx_setup made for the sending rank, or NULL):
 * checks r, takes or dials a connection, runs x's tx_send, keeps the connection when it is in
 * step. Statuses as pd_kv_tcp_send; stats (may be NULL) name x. */
int kv_send(pd_kv_tcp_sender *tx, const pd_kv_xport *x, const void *arg, const pd_kv_send_req *r,
            pd_kv_send_stats *stats);

#endif
