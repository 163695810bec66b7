/* KV-cache transfer: the data plane that moves a prompt's KV from a prefill rank to a decode
 * rank. Every transport shares one TCP connection per (sender, request): the frames, the
 * acknowledgement and, where the KV moves another way, the description of that way travel on
 * it. This header is the API callers use; the transports sit behind kv_xport.h, one file each
 * (tcp.c: host staging, cuda_ipc.c: device to device on one host, nccl.c: device to device over
 * an NCCL link), the bytes on the wire are in kv_frames.h, and kv_route.h picks the transport
 * of each send (--kv-transport, and auto's fallback chain).
 *
 * What moves is planned as (layer, kv-head range, token range): a prefill rank holding kv heads
 * [p0, p0 + pn) sends to a decode rank holding [d0, d0 + dn) the overlap of the two ranges, for
 * every layer and every token of the prompt (the blocks' slots past the prompt stay behind), so
 * instances with different tensor-parallel sizes exchange KV. The receiver (D rank) accepts KV
 * only for requests it expects (blocks reserved before the prefill ran), checks every header
 * field against the reservation and its pool, writes into the reserved blocks, and acknowledges
 * the sender's last frame once everything that sender sent is imported. A wrong header or a
 * frame for an unknown or already imported request is refused: logged, answered with an error
 * acknowledgement, never a crash; the connection is dropped when the stream cannot be
 * resynchronized. A (layer, head) sent again before the request is complete (a prefill retried
 * on another instance after a transfer broke half-way) overwrites the first copy, so the retry
 * completes the import.
 */
#ifndef PD_TRANSFER_KV_TCP_H
#define PD_TRANSFER_KV_TCP_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"

#define PD_KV_REQUEST_ID_MAX 40 /* bytes incl. NUL: 32 hex digits fit with room to spare */

/* Heads of rank `rank` when n_kv_heads are split over tp ranks (tp must divide n_kv_heads). */
int pd_kv_rank_heads(size_t n_kv_heads, int tp, int rank, size_t *head0, size_t *n_heads);
/* Overlap of [a0, a0 + an) and [b0, b0 + bn); *n = 0 when they are disjoint. */
void pd_kv_head_overlap(size_t a0, size_t an, size_t b0, size_t bn, size_t *h0, size_t *n);

/* What a rank's pool holds of the model's KV: heads [head0, +n_heads) of layers
 * [layer0, +n_layers) (a tensor-parallel rank of a pipeline stage). */
typedef struct {
    size_t head0, n_heads;
    size_t layer0, n_layers;
} pd_kv_part;
/* The transfer plan of one (prefill rank, decode rank) pair: the part of the KV both hold,
 * which the prefill rank sends the decode rank (heads and layers each the overlap); false when
 * they share nothing. */
bool pd_kv_plan(const pd_kv_part *prefill, const pd_kv_part *decode, pd_kv_part *send);

/* ---- receiver (decode rank) ---------------------------------------------------------------- */

typedef struct pd_kv_tcp_receiver pd_kv_tcp_receiver;

typedef struct {
    const char *host;    /* bind address: the rank's device_ip */
    int port;            /* 0 = ephemeral */
    pd_backend *backend; /* pool owner: kv_import runs on the receiver's threads */
    pd_kv *kv;           /* the rank's pool */
    pd_kv_params kv_params;
    size_t head0;           /* first global kv head this rank holds */
    size_t layer0;          /* the model's index of its pool's first layer (pipeline stage): a
                               frame's layer is the model's */
    size_t max_frame_bytes; /* refuse larger frames (default 256 MiB) */
} pd_kv_rx_params;

/* Called on a receiver thread when every (layer, head) of an expected request has been
 * imported (status 0), or when its import failed (negative status, message set). */
typedef void (*pd_kv_rx_done_fn)(void *arg, const char *request_id, int status);

int pd_kv_tcp_receiver_start(const pd_kv_rx_params *p, pd_kv_rx_done_fn done, void *arg,
                             pd_kv_tcp_receiver **out);
int pd_kv_tcp_receiver_port(const pd_kv_tcp_receiver *rx);
/* Closes the listener and every connection, joins the threads. */
void pd_kv_tcp_receiver_stop(pd_kv_tcp_receiver *rx);

/* Registers an expected import: the prompt's n_tokens tokens go into the n_blocks blocks of
 * block_ids (copied; n_tokens 0 = every slot of every block), all the rank's layers and heads
 * (from whichever prefill ranks hold them). PD_EEXIST when the id is already expected or was
 * imported; PD_EINVAL when n_tokens does not end in the last block. */
int pd_kv_rx_expect(pd_kv_tcp_receiver *rx, const char *request_id, const int32_t *block_ids,
                    size_t n_blocks, size_t n_tokens);
/* Forgets an expected import (abort, reservation expired). Frames arriving later are refused.
 * Returns PD_ENOTFOUND when it was not expected. */
int pd_kv_rx_cancel(pd_kv_tcp_receiver *rx, const char *request_id);

typedef struct {
    uint64_t frames, bytes; /* accepted frames and payload bytes */
    uint64_t refused;       /* frames refused */
    uint64_t completed;     /* requests fully imported */
    double import_seconds;  /* time spent importing accepted frames (copies into the pool) */
    int expected;           /* requests expected now */
    const char *transport;  /* the transport of the request imported last ("tcp", "cuda_ipc",
                               "nccl"); NULL before the first */
} pd_kv_rx_stats;
void pd_kv_rx_get_stats(pd_kv_tcp_receiver *rx, pd_kv_rx_stats *out);

/* ---- sender (prefill rank) ----------------------------------------------------------------- */

typedef struct pd_kv_tcp_sender pd_kv_tcp_sender;

int pd_kv_tcp_sender_create(pd_kv_tcp_sender **out);
void pd_kv_tcp_sender_free(pd_kv_tcp_sender *tx);

typedef struct {
    const char *request_id;
    const char *host; /* the decode rank's data-plane address and port */
    int port;
    pd_backend *backend; /* the prefill rank's pool */
    const pd_kv *kv;
    pd_kv_params kv_params;
    size_t src_head0;         /* first global kv head the prefill rank holds */
    const int32_t *block_ids; /* (n_blocks) prefill-side blocks of the prompt, in order */
    size_t n_blocks;
    size_t n_tokens;       /* the prompt's tokens in those blocks (as the receiver expects them);
                              0 = every slot of every block */
    size_t head0, n_heads; /* global head range to send (the overlap with the decode rank) */
    size_t layer0;         /* the model's index of the pool's first layer (pipeline stage) */
    size_t send_layer0, send_layers; /* the model's layers to send (the overlap with the decode
                                        rank's); send_layers 0: every layer of the pool. Only
                                        the frames of tcp carry a part of the pool's layers: the
                                        device transports refuse it (PD_EUNSUPPORTED) */
    int timeout_ms;        /* for the whole send, acknowledgement included */
    size_t coalesce_bytes; /* 0 = 1 MiB */
    const atomic_bool *cancel; /* NULL, or a flag another thread may set: the send then gives up
                                * within ~50 ms with PD_ECANCELLED (an aborted request) */
    /* The transport of a send by pd_kv_tcp_send (a route, kv_route.h, picks its own and sets
     * these itself): */
    const pd_kv_share *share; /* NULL: the KV moves in frames (host staging). Else CUDA IPC: one
                               * frame describes the pool (this share) and the blocks; the
                               * receiver copies device to device and acknowledges */
    int nccl;                 /* 1 (and share NULL): the KV moves over an NCCL link of the
                               * connection (backend kv_link_* ops), created on first use;
                               * PD_EUNSUPPORTED when the receiver or this backend cannot */
    int nccl_distinct_gpus;   /* with nccl: the receiver refuses (PD_EUNSUPPORTED) a link from
                               * its own GPU (--kv-transport auto: NCCL between two processes of
                               * one GPU runs only over its socket transport, and only under a
                               * per-process NCCL_HOSTID) */
} pd_kv_send_req;

typedef struct {
    uint64_t bytes; /* payload bytes sent */
    uint64_t frames;
    uint64_t writes;       /* socket messages (coalesced frames) */
    double seconds;        /* first byte to acknowledgement */
    const char *transport; /* the transport this send used: "tcp", "cuda_ipc" or "nccl" (the
                              one that carried the bytes, or that failed) */
} pd_kv_send_stats;

/* Sends by the transport r->share / r->nccl name and waits for the acknowledgement. PD_ETIMEOUT,
 * PD_ECLOSED (connection lost), PD_ECANCELLED (r->cancel was set), PD_EINVAL (refused by the
 * receiver: its reason is in the message), PD_EUNSUPPORTED (a device transport this backend or
 * the receiver cannot take: another host, a receiver without CUDA; host staging works there).
 * Thread-safe: one sender may serve several threads (connections are taken from a per-address
 * pool). */
int pd_kv_tcp_send(pd_kv_tcp_sender *tx, const pd_kv_send_req *r, pd_kv_send_stats *stats);

#endif
