/* KV transfer over TCP (see kv_tcp.h).
 *
 * Wire format, little-endian:
 *   frame   = header (80 bytes) + payload; payload = K then V, each (n_tokens, n_heads,
 *             head_dim) in the pool dtype: the pd_kv_range layout of the blocks cut after the
 *             prompt's last token (the unused slots of the last block do not move)
 *   header  = "PDKV" u16 version u16 flags char request_id[40] u32 layer u32 head0 u32 n_heads
 *             u32 block0 u32 n_blocks u32 n_tokens u64 payload_bytes
 *   ack     = "PDKA" u16 version u16 pad i32 status char request_id[40] char message[204]
 *             (256 bytes), sent for a sender's frame flagged LAST
 * One connection carries one request at a time; the sender reads the acknowledgement before
 * it reuses the connection, so acknowledgements never cross requests.
 *
 * CUDA IPC (a sender given a pd_kv_share): one frame flagged IPC | LAST, layer 0, the usual
 * head and block fields, whose payload describes the prefill pool instead of carrying KV:
 *   char boot_id[40] u8 handle[64] u64 pool_id u32 n_layers u32 block_size u64 n_blocks
 *   u32 n_kv_heads u32 head_dim u32 dtype u32 src_head0 (pool-local) u32 src_blocks[n_blocks]
 * The receiver maps the pool (kv_peer_open, kept per connection), copies every layer device to
 * device into the reserved blocks (kv_pull) and acknowledges; the prefill side keeps its blocks
 * under the lease until then, and the receiver writes only blocks it reserved, under the same
 * lock that a cancel takes, so an abort never races a copy. boot_id (the kernel's, shared by the
 * containers of one host) tells another host apart before any CUDA call: such frames, and frames
 * to a receiver whose backend has no kv_pull (CPU), are refused with PD_EUNSUPPORTED, which the
 * sender reports as such so the caller can fall back to host staging.
 *
 * NCCL (a sender given nccl = 1): the KV moves device to device over a 2-rank NCCL communicator
 * (the backend's kv_link_* ops) bound to the TCP connection: one communicator per (prefill rank,
 * decode rank) connection, created on the connection's first NCCL request and dropped with it.
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
 * Deviations from DESIGN.md (KV cache and transfer): the link id travels on the KV data
 * connection, not over gRPC; it is the channel that already pairs one prefill rank with one
 * decode rank, and it keeps the communicator's life equal to the connection's. And a
 * communicator belongs to a connection, not to the (prefill rank, decode rank) pair: a pair with
 * several transfers in flight at once (transfer workers) has one connection, and so one
 * communicator, per concurrent transfer; pooled connections keep theirs for the next request.
 */
#include "transfer/kv_tcp.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "util/clock.h"
#include "util/log.h"
#include "util/status.h"

#define HDR_BYTES             80
#define ACK_BYTES             256
#define ACK_MSG_BYTES         204
#define VERSION               2
#define FLAG_LAST             1u
#define FLAG_IPC              2u
#define FLAG_NCCL             4u
#define FLAG_NCCL_INIT        8u
#define FLAG_DISTINCT_GPUS    16u /* NCCL_INIT: refuse a link from the receiver's own GPU */
#define IPC_FIXED             144   /* IPC payload bytes before the block ids */
#define LINK_OPEN_MS          30000 /* joining an NCCL link, both sides */
#define SOCK_BUF              (4 << 20)
#define FRAME_READ_TIMEOUT_MS 30000
#define CANCEL_POLL_MS        50     /* how often a send in progress looks at its cancel flag */
#define ACK_SPIN_NS           200000 /* a sender polls for its acknowledgement this long first */
#define DONE_RING             256

typedef struct {
    uint16_t version, flags;
    char request_id[PD_KV_REQUEST_ID_MAX];
    uint32_t layer, head0, n_heads, block0, n_blocks, n_tokens;
    uint64_t payload_bytes;
} frame_hdr;

static void put_u16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static void put_u32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put_u64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint16_t get_u16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}
static uint32_t get_u32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}
static uint64_t get_u64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static void hdr_pack(const frame_hdr *h, uint8_t *p)
{
    memcpy(p, "PDKV", 4);
    put_u16(p + 4, h->version);
    put_u16(p + 6, h->flags);
    memset(p + 8, 0, PD_KV_REQUEST_ID_MAX);
    memcpy(p + 8, h->request_id, strnlen(h->request_id, PD_KV_REQUEST_ID_MAX - 1));
    put_u32(p + 48, h->layer);
    put_u32(p + 52, h->head0);
    put_u32(p + 56, h->n_heads);
    put_u32(p + 60, h->block0);
    put_u32(p + 64, h->n_blocks);
    put_u32(p + 68, h->n_tokens);
    put_u64(p + 72, h->payload_bytes);
}

/* Returns false when the magic is wrong. The request id is always NUL-terminated. */
static bool hdr_unpack(const uint8_t *p, frame_hdr *h)
{
    if (memcmp(p, "PDKV", 4) != 0) return false;
    h->version = get_u16(p + 4);
    h->flags = get_u16(p + 6);
    memcpy(h->request_id, p + 8, PD_KV_REQUEST_ID_MAX);
    h->request_id[PD_KV_REQUEST_ID_MAX - 1] = '\0';
    h->layer = get_u32(p + 48);
    h->head0 = get_u32(p + 52);
    h->n_heads = get_u32(p + 56);
    h->block0 = get_u32(p + 60);
    h->n_blocks = get_u32(p + 64);
    h->n_tokens = get_u32(p + 68);
    h->payload_bytes = get_u64(p + 72);
    return true;
}

static void ack_pack(uint8_t *p, int32_t status, const char *id, const char *msg)
{
    memset(p, 0, ACK_BYTES);
    memcpy(p, "PDKA", 4);
    put_u16(p + 4, VERSION);
    put_u32(p + 8, (uint32_t)status);
    memcpy(p + 12, id, strnlen(id, PD_KV_REQUEST_ID_MAX - 1));
    memcpy(p + 52, msg, strnlen(msg, ACK_MSG_BYTES - 1));
}

int pd_kv_rank_heads(size_t n_kv_heads, int tp, int rank, size_t *head0, size_t *n_heads)
{
    if (tp < 1 || rank < 0 || rank >= tp || n_kv_heads % (size_t)tp != 0)
        return pd_error(PD_EINVAL,
                        "kv heads: %zu heads cannot be split over tensor-parallel "
                        "size %d (rank %d)",
                        n_kv_heads, tp, rank);
    *n_heads = n_kv_heads / (size_t)tp;
    *head0 = *n_heads * (size_t)rank;
    return PD_OK;
}

void pd_kv_head_overlap(size_t a0, size_t an, size_t b0, size_t bn, size_t *h0, size_t *n)
{
    size_t lo = a0 > b0 ? a0 : b0, hi = a0 + an < b0 + bn ? a0 + an : b0 + bn;
    *h0 = lo;
    *n = hi > lo ? hi - lo : 0;
}

int pd_kv_nccl_chunk_layers(size_t layer_bytes, int n_layers, size_t cap)
{
    if (!cap) cap = PD_KV_NCCL_CHUNK_BYTES;
    if (n_layers < 1) return 1;
    size_t k = layer_bytes ? cap / layer_bytes : (size_t)n_layers;
    if (k < 1) k = 1;
    if (k > (size_t)n_layers) k = (size_t)n_layers;
    return (int)k;
}

void pd_kv_nccl_desc_pack(const pd_kv_nccl_desc *d, uint8_t out[PD_KV_NCCL_DESC_BYTES])
{
    put_u32(out, d->chunk_layers);
    put_u32(out + 4, 0);
    put_u64(out + 8, d->link_bytes);
}

int pd_kv_nccl_desc_unpack(const uint8_t in[PD_KV_NCCL_DESC_BYTES], int n_layers,
                           size_t layer_bytes, pd_kv_nccl_desc *out)
{
    out->chunk_layers = get_u32(in);
    out->link_bytes = get_u64(in + 8);
    if (out->chunk_layers < 1 || n_layers < 1 || out->chunk_layers > (uint32_t)n_layers)
        return pd_error(PD_EINVAL, "kv NCCL frame: chunk_layers %u outside 1..%d",
                        out->chunk_layers, n_layers);
    if (get_u32(in + 4) != 0)
        return pd_error(PD_EINVAL, "kv NCCL frame: reserved field is %u, expected 0",
                        get_u32(in + 4));
    if (out->link_bytes != (uint64_t)n_layers * layer_bytes)
        return pd_error(
            PD_EINVAL, "kv NCCL frame: link_bytes %llu, expected %llu (%d layers of %zu)",
            (unsigned long long)out->link_bytes,
            (unsigned long long)((uint64_t)n_layers * layer_bytes), n_layers, layer_bytes);
    return PD_OK;
}

/* ---- sockets ---- */

/* Waits for fd (and, when stop_fd >= 0, for a stop signal; when cancel is not NULL, for it to
 * turn true, looked at every CANCEL_POLL_MS). 1 ready, 0 timeout, -1 stop, -2 cancelled. */
static int wait_fd(int fd, short events, int stop_fd, const atomic_bool *cancel,
                   int64_t deadline_ns)
{
    for (;;) {
        if (cancel && atomic_load(cancel)) return -2;
        int ms = -1;
        if (deadline_ns != INT64_MAX) {
            int64_t left = deadline_ns - pd_now_ns();
            if (left <= 0) return 0;
            ms = (int)((left + PD_NS_PER_MS - 1) / PD_NS_PER_MS);
        }
        if (cancel && (ms < 0 || ms > CANCEL_POLL_MS)) ms = CANCEL_POLL_MS;
        struct pollfd p[2] = {{.fd = fd, .events = events}, {.fd = stop_fd, .events = POLLIN}};
        int r = poll(p, stop_fd >= 0 ? 2 : 1, ms);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -1;
        if (r == 0) continue; /* the deadline and the cancel flag are looked at above */
        if (stop_fd >= 0 && p[1].revents) return -1;
        return 1;
    }
}

/* The socket calls below try the call first and wait only when the socket is not ready (the
 * sockets are non-blocking): a frame's header, its payload and an acknowledgement are usually
 * there already, and each poll() would cost a system call. Before each try they look at the
 * cancel flag and the deadline, which need no system call. */

/* PD_OK to go on, else the status to return (PD_ECANCELLED, PD_ETIMEOUT). */
static int io_gate(const atomic_bool *cancel, int64_t deadline_ns)
{
    if (cancel && atomic_load(cancel)) return PD_ECANCELLED;
    if (deadline_ns != INT64_MAX && pd_now_ns() >= deadline_ns) return PD_ETIMEOUT;
    return PD_OK;
}

/* After a call that returned r < 0: PD_OK to try again (EINTR, or EAGAIN and fd became ready),
 * else the status to return. */
static int io_retry(int fd, short events, int stop_fd, const atomic_bool *cancel,
                    int64_t deadline_ns)
{
    if (errno == EINTR) return PD_OK;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return PD_ECLOSED;
    int w = wait_fd(fd, events, stop_fd, cancel, deadline_ns);
    return w == 1 ? PD_OK : w == 0 ? PD_ETIMEOUT : w == -2 ? PD_ECANCELLED : PD_ECLOSED;
}

/* PD_OK, PD_ETIMEOUT, PD_ECANCELLED, PD_ECLOSED (peer closed / error / stop). stop_fd is looked
 * at only while the socket has nothing to read. */
static int read_full(int fd, void *buf, size_t n, int stop_fd, const atomic_bool *cancel,
                     int64_t deadline_ns)
{
    uint8_t *p = buf;
    while (n > 0) {
        int rc = io_gate(cancel, deadline_ns);
        if (rc < 0) return rc;
        ssize_t r = read(fd, p, n);
        if (r == 0) return PD_ECLOSED;
        if (r < 0) {
            if ((rc = io_retry(fd, POLLIN, stop_fd, cancel, deadline_ns)) < 0) return rc;
            continue;
        }
        p += r;
        n -= (size_t)r;
    }
    return PD_OK;
}

static int write_full(int fd, const void *buf, size_t n, const atomic_bool *cancel,
                      int64_t deadline_ns)
{
    const uint8_t *p = buf;
    while (n > 0) {
        int rc = io_gate(cancel, deadline_ns);
        if (rc < 0) return rc;
        ssize_t r = send(fd, p, n, MSG_NOSIGNAL);
        if (r == 0) return PD_ECLOSED;
        if (r < 0) {
            if ((rc = io_retry(fd, POLLOUT, -1, cancel, deadline_ns)) < 0) return rc;
            continue;
        }
        p += r;
        n -= (size_t)r;
    }
    return PD_OK;
}

/* writev of the whole vector (iov is consumed). PD_OK, PD_ETIMEOUT, PD_ECANCELLED or
 * PD_ECLOSED. */
static int writev_full(int fd, struct iovec *iov, int cnt, const atomic_bool *cancel,
                       int64_t deadline_ns)
{
    while (cnt > 0) {
        int rc = io_gate(cancel, deadline_ns);
        if (rc < 0) return rc;
        ssize_t n = writev(fd, iov, cnt);
        if (n == 0) return PD_ECLOSED;
        if (n < 0) {
            if ((rc = io_retry(fd, POLLOUT, -1, cancel, deadline_ns)) < 0) return rc;
            continue;
        }
        while (cnt > 0 && (size_t)n >= iov->iov_len) {
            n -= (ssize_t)iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + n;
            iov->iov_len -= (size_t)n;
        }
    }
    return PD_OK;
}

static void tune_socket(int fd)
{
    int one = 1, buf = SOCK_BUF;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    fcntl(fd, F_SETFD, FD_CLOEXEC);
}

/* The prompt's tokens in n_blocks blocks: n_tokens, or every slot when it is 0. PD_EINVAL when
 * the last token does not fall in the last block. */
static int tokens_in(const pd_kv_params *kp, size_t n_blocks, size_t n_tokens, size_t *out)
{
    size_t bs = kp->block_size;
    if (n_tokens && (n_tokens > n_blocks * bs || n_tokens <= (n_blocks - 1) * bs))
        return pd_error(PD_EINVAL, "kv: %zu tokens do not end in the last of %zu %zu-token blocks",
                        n_tokens, n_blocks, bs);
    *out = n_tokens ? n_tokens : n_blocks * bs;
    return PD_OK;
}

/* Bytes of one token of n_heads heads (K or V). */
static size_t token_bytes(const pd_kv_params *kp, size_t n_heads)
{
    return n_heads * kp->head_dim * pd_dtype_size(kp->dtype);
}

/* Payload of one frame: K and V of n_tokens tokens. */
static size_t slice_bytes(const pd_kv_params *kp, size_t n_tokens, size_t n_heads)
{
    return 2 * n_tokens * token_bytes(kp, n_heads);
}

/* ====================================================================== receiver ========== */

/* A KV frame is read straight into kv_import's layout: K, then V, each of whole blocks with the
 * slots past the prompt zero (they do not travel). Returns the bytes of zeros after each half:
 * 0 when the payload already is whole blocks, and for a frame whose header does not describe
 * such a payload (read as sent; rx_check or rx_import refuses it). */
static size_t frame_gap(const pd_kv_params *kp, const frame_hdr *h)
{
    size_t bs = kp->block_size, t = h->n_tokens, nb = h->n_blocks;
    if (h->flags & (FLAG_NCCL_INIT | FLAG_NCCL | FLAG_IPC) || h->n_heads > kp->n_kv_heads ||
        nb == 0 || t > nb * bs || t <= (nb - 1) * bs ||
        h->payload_bytes != slice_bytes(kp, t, h->n_heads))
        return 0;
    return (nb * bs - t) * token_bytes(kp, h->n_heads);
}

typedef struct expect_entry {
    struct expect_entry *next;
    char id[PD_KV_REQUEST_ID_MAX];
    int32_t *blocks;
    size_t n_blocks;
    size_t n_tokens; /* the prompt's tokens in those blocks */
    uint8_t *got;    /* (n_layers, n_local_heads) flags */
    size_t n_got, n_need;
} expect_entry;

/* The last DONE_RING request ids of a kind (a ring). */
typedef struct {
    char ids[DONE_RING][PD_KV_REQUEST_ID_MAX];
    int pos;
} id_ring;

typedef struct rx_conn {
    struct rx_conn *next;
    pd_kv_tcp_receiver *rx;
    int fd;
    pthread_t thread;
    bool finished;
    pd_kv_peer *peer; /* the sender's pool, mapped at its first IPC frame (NULL: none) */
    uint64_t peer_id;
    pd_kv_link *link; /* the NCCL link of this connection (NULL: none yet) */
} rx_conn;

struct pd_kv_tcp_receiver {
    pd_kv_rx_params p;
    size_t n_local_heads;
    pd_kv_rx_done_fn done;
    void *done_arg;
    int listen_fd, port;
    int stop_pipe[2];
    pthread_t accept_thread;
    pthread_mutex_t mu;
    expect_entry *expected;
    id_ring imported;  /* requests imported lately */
    id_ring cancelled; /* requests cancelled lately (their frames may still be on the way) */
    rx_conn *conns;
    pd_kv_rx_stats stats;
};

static expect_entry *find_expected(pd_kv_tcp_receiver *rx, const char *id, expect_entry ***link)
{
    expect_entry **pp = &rx->expected;
    for (; *pp; pp = &(*pp)->next)
        if (strcmp((*pp)->id, id) == 0) {
            if (link) *link = pp;
            return *pp;
        }
    return NULL;
}

static void ring_add(id_ring *r, const char *id)
{
    snprintf(r->ids[r->pos], PD_KV_REQUEST_ID_MAX, "%s", id);
    r->pos = (r->pos + 1) % DONE_RING;
}

static bool ring_has(const id_ring *r, const char *id)
{
    for (int i = 0; i < DONE_RING; i++)
        if (r->ids[i][0] && strcmp(r->ids[i], id) == 0) return true;
    return false;
}

static void entry_free(expect_entry *e)
{
    free(e->blocks);
    free(e->got);
    free(e);
}

int pd_kv_rx_expect(pd_kv_tcp_receiver *rx, const char *request_id, const int32_t *block_ids,
                    size_t n_blocks, size_t n_tokens)
{
    if (!request_id[0] || strlen(request_id) >= PD_KV_REQUEST_ID_MAX)
        return pd_error(PD_EINVAL, "kv receive: request id must be 1..%d bytes",
                        PD_KV_REQUEST_ID_MAX - 1);
    if (n_blocks == 0) return pd_error(PD_EINVAL, "kv receive %s: no blocks", request_id);
    size_t tokens = 0;
    PD_CHECK(tokens_in(&rx->p.kv_params, n_blocks, n_tokens, &tokens));
    for (size_t i = 0; i < n_blocks; i++)
        if (block_ids[i] < 0 || (size_t)block_ids[i] >= rx->p.kv_params.n_blocks)
            return pd_error(PD_EINVAL, "kv receive %s: block id %d outside the pool of %zu",
                            request_id, block_ids[i], rx->p.kv_params.n_blocks);
    expect_entry *e = calloc(1, sizeof *e);
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
    expect_entry **link = NULL;
    expect_entry *e = find_expected(rx, request_id, &link);
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

/* Checks a frame's header against the reservation. Called with rx->mu held. Returns the
 * expected entry (and *link to it) or NULL with the refusal's message set in *rc. */
static expect_entry *rx_check(pd_kv_tcp_receiver *rx, const frame_hdr *h, expect_entry ***link,
                              int *rc)
{
    const pd_kv_params *kp = &rx->p.kv_params;
    expect_entry *e = find_expected(rx, h->request_id, link);
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
    if (h->layer >= (uint32_t)kp->n_layers)
        *rc = pd_error(PD_EINVAL, "kv frame %s: layer %u outside 0..%d", h->request_id, h->layer,
                       kp->n_layers - 1);
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

/* Marks layers [l0, l0 + nl) x the frame's heads imported; *complete when that was the rest. */
static void rx_mark(pd_kv_tcp_receiver *rx, expect_entry *e, expect_entry **link,
                    const frame_hdr *h, uint32_t l0, uint32_t nl, expect_entry **complete)
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
        ring_add(&rx->imported, e->id);
        *complete = e;
    }
}

/* Checks a frame against the reservation and imports it; payload is laid out by frame_gap (whole
 * blocks). Called with rx->mu held.
 * Returns PD_OK or a refusal with the message set; *complete is set when the request is done. */
static int rx_import(pd_kv_tcp_receiver *rx, const frame_hdr *h, const uint8_t *payload,
                     expect_entry **complete)
{
    const pd_kv_params *kp = &rx->p.kv_params;
    expect_entry **link = NULL;
    int rc = PD_OK;
    expect_entry *e = rx_check(rx, h, &link, &rc);
    if (!e) return rc;
    size_t want = slice_bytes(kp, e->n_tokens, h->n_heads);
    if (h->payload_bytes != want)
        return pd_error(PD_EINVAL, "kv frame %s: payload of %llu bytes, expected %zu",
                        h->request_id, (unsigned long long)h->payload_bytes, want);
    pd_kv_range r = {.layer = (int)h->layer,
                     .block_ids = e->blocks,
                     .n_blocks = e->n_blocks,
                     .head0 = h->head0 - rx->p.head0,
                     .n_heads = h->n_heads};
    rc = pd_backend_get_ops(rx->p.backend)->kv_import(rx->p.backend, rx->p.kv, &r, payload);
    if (rc < 0) return rc;
    rx->stats.bytes += h->payload_bytes;
    rx_mark(rx, e, link, h, h->layer, 1, complete);
    return PD_OK;
}

/* This host's identity for IPC frames: the kernel's boot id (empty when unreadable), read once
 * per process (both ends of every IPC frame need it). */
static char g_boot_id[40];
static void read_boot_id(void)
{
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (!f) return;
    if (!fgets(g_boot_id, sizeof g_boot_id, f)) g_boot_id[0] = '\0';
    fclose(f);
    g_boot_id[strcspn(g_boot_id, "\n")] = '\0';
}

static void boot_id(char out[40])
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, read_boot_id);
    memcpy(out, g_boot_id, 40);
}

/* An IPC frame (see the file-top comment): maps the sender's pool on this connection and pulls
 * every layer into the reserved blocks. Called with rx->mu held. */
static int rx_import_ipc(pd_kv_tcp_receiver *rx, rx_conn *c, const frame_hdr *h,
                         const uint8_t *payload, expect_entry **complete)
{
    const pd_kv_params *kp = &rx->p.kv_params;
    const pd_backend_ops *ops = pd_backend_get_ops(rx->p.backend);
    expect_entry **link = NULL;
    int rc = PD_OK;
    expect_entry *e = rx_check(rx, h, &link, &rc);
    if (!e) return rc;
    if (h->payload_bytes != IPC_FIXED + 4 * (uint64_t)e->n_blocks)
        return pd_error(PD_EINVAL, "kv IPC frame %s: payload of %llu bytes, expected %zu",
                        h->request_id, (unsigned long long)h->payload_bytes,
                        IPC_FIXED + 4 * e->n_blocks);
    if (!ops->kv_pull)
        return pd_error(PD_EUNSUPPORTED,
                        "kv IPC frame %s: this decode rank's %s backend cannot take KV by CUDA "
                        "IPC",
                        h->request_id, pd_backend_name(rx->p.backend));
    char mine[40];
    boot_id(mine);
    if (strncmp(mine, (const char *)payload, 39) != 0)
        return pd_error(PD_EUNSUPPORTED,
                        "kv IPC frame %s: the prefill rank runs on another host (boot id %.36s, "
                        "here %.36s)",
                        h->request_id, (const char *)payload, mine);
    pd_kv_share sh;
    memcpy(sh.handle, payload + 40, PD_KV_SHARE_HANDLE_BYTES);
    sh.id = get_u64(payload + 104);
    sh.p = (pd_kv_params){.n_layers = (int)get_u32(payload + 112),
                          .block_size = get_u32(payload + 116),
                          .n_blocks = get_u64(payload + 120),
                          .n_kv_heads = get_u32(payload + 128),
                          .head_dim = get_u32(payload + 132),
                          .dtype = (pd_dtype)get_u32(payload + 136)};
    size_t src_head0 = get_u32(payload + 140);
    if (sh.p.n_layers != kp->n_layers)
        return pd_error(PD_EINVAL, "kv IPC frame %s: the prefill pool has %d layers, this one %d",
                        h->request_id, sh.p.n_layers, kp->n_layers);
    if (!c->peer || c->peer_id != sh.id) { /* first IPC frame, or the sender restarted */
        if (c->peer) ops->kv_peer_close(rx->p.backend, c->peer);
        c->peer = NULL;
        PD_CHECK(ops->kv_peer_open(rx->p.backend, rx->p.kv, &sh, &c->peer));
        c->peer_id = sh.id;
    }
    int32_t *src = malloc(e->n_blocks * sizeof *src);
    if (!src) return pd_error(PD_ENOMEM, "kv receive: out of memory");
    for (size_t i = 0; i < e->n_blocks; i++) src[i] = (int32_t)get_u32(payload + IPC_FIXED + 4 * i);
    pd_kv_pull pl = {.src_blocks = src,
                     .dst_blocks = e->blocks,
                     .n_blocks = e->n_blocks,
                     .n_tokens = e->n_tokens,
                     .src_head0 = src_head0,
                     .dst_head0 = h->head0 - rx->p.head0,
                     .n_heads = h->n_heads};
    rc = ops->kv_pull(rx->p.backend, rx->p.kv, c->peer, &pl);
    free(src);
    if (rc < 0) return rc;
    rx->stats.bytes += (uint64_t)kp->n_layers * slice_bytes(kp, e->n_tokens, h->n_heads);
    rx_mark(rx, e, link, h, 0, (uint32_t)kp->n_layers, complete);
    return PD_OK;
}

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

/* An NCCL_INIT frame: acknowledges it (refused with PD_EUNSUPPORTED when the backend has no
 * links), then joins the link. Returns false when the connection must be dropped. */
static bool rx_nccl_init(pd_kv_tcp_receiver *rx, rx_conn *c, const frame_hdr *h,
                         const uint8_t *payload)
{
    const pd_backend_ops *ops = pd_backend_get_ops(rx->p.backend);
    uint8_t ack[ACK_BYTES];
    int st = PD_OK;
    char msg[ACK_MSG_BYTES] = "";
    if (h->payload_bytes != PD_KV_LINK_ID_BYTES) {
        st = pd_error(PD_EINVAL, "kv NCCL link frame: payload of %llu bytes, expected %d",
                      (unsigned long long)h->payload_bytes, PD_KV_LINK_ID_BYTES);
    } else if (!ops->kv_link_open) {
        st = pd_error(PD_EUNSUPPORTED,
                      "kv NCCL link: this decode rank's %s backend cannot take KV over NCCL",
                      pd_backend_name(rx->p.backend));
    } else if ((h->flags & FLAG_DISTINCT_GPUS) && ops->kv_link_local &&
               ops->kv_link_local(rx->p.backend, payload)) {
        st = pd_error(PD_EUNSUPPORTED,
                      "kv NCCL link: the prefill rank runs on this decode rank's own GPU (NCCL "
                      "would carry the KV over its socket transport)");
    }
    if (st < 0) {
        snprintf(msg, sizeof msg, "%s", pd_last_error());
        PD_INFO(h->request_id, "%s", msg);
        pthread_mutex_lock(&rx->mu);
        rx->stats.refused++;
        pthread_mutex_unlock(&rx->mu);
    }
    ack_pack(ack, st, h->request_id, msg);
    if (write_full(c->fd, ack, ACK_BYTES, NULL, pd_now_ns() + 5 * PD_NS_PER_S) != PD_OK)
        return false;
    if (st < 0) return true; /* refused and acknowledged: the stream is in sync */
    if (c->link) { /* the sender made a new link on this connection: the old one is done */
        ops->kv_link_close(rx->p.backend, c->link);
        c->link = NULL;
    }
    conn_watch cw = {.fd = c->fd, .stop_fd = rx->stop_pipe[0], .cancel = NULL};
    pd_kv_link_wait w = {.deadline_ns = pd_now_ns() + LINK_OPEN_MS * PD_NS_PER_MS,
                         .check = conn_check,
                         .check_arg = &cw};
    if (ops->kv_link_open(rx->p.backend, payload, 1, &w, &c->link) < 0) {
        PD_ERROR(h->request_id, "kv NCCL link: %s; closing connection", pd_last_error());
        return false;
    }
    PD_INFO(h->request_id, "kv NCCL link up (decode rank head %zu)", rx->p.head0);
    return true;
}

/* An NCCL request frame (see the file-top comment): receives every chunk, scatters the chunks
 * of an accepted request. Returns the acknowledgement's status (message set); *drop when the
 * connection and its link must go (the link is out of step or failed). */
static int rx_nccl(pd_kv_tcp_receiver *rx, rx_conn *c, const frame_hdr *h, const uint8_t *payload,
                   int64_t deadline, expect_entry **complete, bool *drop)
{
    const pd_kv_params *kp = &rx->p.kv_params;
    const pd_backend_ops *ops = pd_backend_get_ops(rx->p.backend);
    *drop = false;
    if (!c->link || h->payload_bytes != PD_KV_NCCL_DESC_BYTES) {
        /* nothing follows on a link that does not exist; a wrong payload cannot be sized */
        *drop = c->link != NULL;
        return pd_error(PD_EINVAL, "kv NCCL frame %s: %s", h->request_id,
                        c->link ? "wrong payload size" : "no NCCL link on this connection");
    }
    /* the chunks' sizes come from the header alone, so a refused request is drained too */
    if (h->n_heads == 0 || h->n_heads > rx->n_local_heads || h->n_tokens == 0 ||
        (size_t)h->n_tokens > kp->n_blocks * kp->block_size) {
        *drop = true;
        return pd_error(PD_EINVAL, "kv NCCL frame %s: %u heads x %u tokens cannot be received",
                        h->request_id, h->n_heads, h->n_tokens);
    }
    size_t layer_b = slice_bytes(kp, h->n_tokens, h->n_heads);
    pd_kv_nccl_desc d;
    int rc = pd_kv_nccl_desc_unpack(payload, kp->n_layers, layer_b, &d);
    if (rc == PD_OK && (size_t)d.chunk_layers * layer_b > rx->p.max_frame_bytes)
        rc = pd_error(PD_EINVAL, "kv NCCL frame %s: chunks of %zu bytes over the %zu-byte limit",
                      h->request_id, (size_t)d.chunk_layers * layer_b, rx->p.max_frame_bytes);
    if (rc < 0) {
        *drop = true;
        return rc;
    }
    pthread_mutex_lock(&rx->mu);
    expect_entry **link = NULL;
    int status = PD_OK;
    char msg[ACK_MSG_BYTES] = "";
    if (!rx_check(rx, h, &link, &status)) snprintf(msg, sizeof msg, "%s", pd_last_error());
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
        rc = ops->kv_link_recv(rx->p.backend, rx->p.kv, c->link, &x, &w);
        if (rc < 0) {
            *drop = true;
            return pd_error_prefix(rc, "kv NCCL receive %s", h->request_id);
        }
        if (status < 0) continue; /* drained, not written */
        pthread_mutex_lock(&rx->mu);
        int64_t t0 = pd_now_ns();
        expect_entry *e = rx_check(rx, h, &link, &status); /* a cancel may have come meanwhile */
        if (e) {
            x.blocks = e->blocks;
            x.n_blocks = e->n_blocks;
            status = ops->kv_link_scatter(rx->p.backend, rx->p.kv, c->link, &x);
            if (status == PD_OK && l0 + n == kp->n_layers) {
                rx->stats.bytes += (uint64_t)kp->n_layers * layer_b;
                rx_mark(rx, e, link, h, 0, (uint32_t)kp->n_layers, complete);
            }
            if (status == PD_OK) rx->stats.import_seconds += (double)(pd_now_ns() - t0) / 1e9;
        }
        if (status < 0) snprintf(msg, sizeof msg, "%s", pd_last_error());
        pthread_mutex_unlock(&rx->mu);
    }
    if (status < 0) return pd_error(status, "%s", msg);
    return PD_OK;
}

static void *rx_conn_main(void *arg)
{
    rx_conn *c = arg;
    pd_kv_tcp_receiver *rx = c->rx;
    uint8_t hb[HDR_BYTES], ack[ACK_BYTES];
    uint8_t *buf = NULL;
    size_t cap = 0;
    char cur_id[PD_KV_REQUEST_ID_MAX] = "";
    int cur_status = PD_OK;
    char cur_msg[ACK_MSG_BYTES] = "";
    for (;;) {
        /* idle between frames: no deadline, and the stop signal is looked at; inside a frame:
           FRAME_READ_TIMEOUT_MS from its first byte */
        if (wait_fd(c->fd, POLLIN, rx->stop_pipe[0], NULL, INT64_MAX) != 1) break;
        int64_t deadline = pd_now_ns() + FRAME_READ_TIMEOUT_MS * PD_NS_PER_MS;
        if (read_full(c->fd, hb, HDR_BYTES, rx->stop_pipe[0], NULL, deadline) != PD_OK) break;
        frame_hdr h;
        if (!hdr_unpack(hb, &h) || h.version != VERSION) {
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
        size_t gap = frame_gap(&rx->p.kv_params, &h), half = h.payload_bytes / 2;
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
        int rrc =
            read_full(c->fd, buf, gap ? half : h.payload_bytes, rx->stop_pipe[0], NULL, deadline);
        if (gap && rrc == PD_OK)
            rrc = read_full(c->fd, buf + half + gap, half, rx->stop_pipe[0], NULL, deadline);
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
        if (h.flags & FLAG_NCCL_INIT) {
            if (!rx_nccl_init(rx, c, &h, buf)) break;
            cur_id[0] = '\0';
            continue;
        }
        expect_entry *complete = NULL;
        if (h.flags & FLAG_NCCL) {
            /* always run, also after an earlier refusal: the chunks must be drained */
            bool drop = false;
            int rc = rx_nccl(rx, c, &h, buf, deadline, &complete, &drop);
            if (rc < 0 && cur_status == PD_OK) {
                cur_status = rc;
                snprintf(cur_msg, sizeof cur_msg, "%s", pd_last_error());
                if (rc == PD_ECANCELLED)
                    PD_INFO(h.request_id, "%s", cur_msg);
                else
                    PD_ERROR(h.request_id, "%s", cur_msg);
            }
            if (rc < 0) {
                pthread_mutex_lock(&rx->mu);
                rx->stats.refused++;
                pthread_mutex_unlock(&rx->mu);
            }
            if (drop) {
                PD_ERROR(h.request_id, "kv NCCL: closing the connection and its link");
                break;
            }
        } else if (cur_status == PD_OK) {
            pthread_mutex_lock(&rx->mu);
            int64_t t0 = pd_now_ns();
            int rc = h.flags & FLAG_IPC ? rx_import_ipc(rx, c, &h, buf, &complete)
                                        : rx_import(rx, &h, buf, &complete);
            if (rc == PD_OK) rx->stats.import_seconds += (double)(pd_now_ns() - t0) / 1e9;
            if (rc < 0) rx->stats.refused++;
            pthread_mutex_unlock(&rx->mu);
            if (rc < 0) {
                cur_status = rc;
                snprintf(cur_msg, sizeof cur_msg, "%s", pd_last_error());
                if (rc == PD_ECANCELLED || rc == PD_EUNSUPPORTED) /* an abort raced the
                                     transfer; an IPC frame the sender will resend over TCP */
                    PD_INFO(h.request_id, "%s", cur_msg);
                else
                    PD_ERROR(h.request_id, "%s", cur_msg);
            }
        } else {
            pthread_mutex_lock(&rx->mu);
            rx->stats.refused++;
            pthread_mutex_unlock(&rx->mu);
        }
        if (complete) {
            if (rx->done) rx->done(rx->done_arg, complete->id, PD_OK);
            entry_free(complete);
        }
        if (h.flags & FLAG_LAST) {
            ack_pack(ack, cur_status, cur_id, cur_msg);
            if (write_full(c->fd, ack, ACK_BYTES, NULL, pd_now_ns() + 5 * PD_NS_PER_S) != PD_OK)
                break;
            cur_id[0] = '\0';
        }
    }
    pd_backend_host_free(rx->p.backend, buf);
    if (c->link) /* only this thread uses it; closing aborts whatever it had in flight */
        pd_backend_get_ops(rx->p.backend)->kv_link_close(rx->p.backend, c->link);
    c->link = NULL;
    close(c->fd);
    pthread_mutex_lock(&rx->mu);
    if (c->peer) pd_backend_get_ops(rx->p.backend)->kv_peer_close(rx->p.backend, c->peer);
    c->peer = NULL;
    c->finished = true;
    pthread_mutex_unlock(&rx->mu);
    return NULL;
}

/* Joins connection threads that have ended. Called with rx->mu NOT held. */
static void reap_conns(pd_kv_tcp_receiver *rx, bool all)
{
    for (;;) {
        rx_conn *victim = NULL;
        pthread_mutex_lock(&rx->mu);
        for (rx_conn **pp = &rx->conns; *pp; pp = &(*pp)->next)
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
        if (wait_fd(rx->listen_fd, POLLIN, rx->stop_pipe[0], NULL, INT64_MAX) <= 0) break;
        int fd = accept(rx->listen_fd, NULL, NULL);
        if (fd < 0) continue;
        tune_socket(fd);
        reap_conns(rx, false);
        rx_conn *c = calloc(1, sizeof *c);
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

static int resolve(const char *host, int port, struct sockaddr_storage *ss, socklen_t *len)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    int e = getaddrinfo(host, ps, &hints, &res);
    if (e != 0 || !res)
        return pd_error(PD_EINVAL, "address %s:%d: %s", host, port, gai_strerror(e));
    memcpy(ss, res->ai_addr, res->ai_addrlen);
    *len = res->ai_addrlen;
    freeaddrinfo(res);
    return PD_OK;
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
    struct sockaddr_storage ss;
    socklen_t sl;
    int rc = resolve(p->host, p->port, &ss, &sl);
    if (rc < 0) goto fail;
    rx->listen_fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    setsockopt(rx->listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(rx->listen_fd, (struct sockaddr *)&ss, sl) != 0 || listen(rx->listen_fd, 64) != 0) {
        rc = pd_error(PD_EIO, "kv receive: cannot listen on %s:%d: %s", p->host, p->port,
                      strerror(errno));
        close(rx->listen_fd);
        goto fail;
    }
    struct sockaddr_storage bound;
    socklen_t bl = sizeof bound;
    getsockname(rx->listen_fd, (struct sockaddr *)&bound, &bl);
    rx->port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                                 : ((struct sockaddr_in *)&bound)->sin_port);
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
        expect_entry *e = rx->expected;
        rx->expected = e->next;
        entry_free(e);
    }
    pthread_mutex_destroy(&rx->mu);
    free(rx);
}

/* ====================================================================== sender ============ */

typedef struct idle_conn {
    struct idle_conn *next;
    char addr[300];
    int fd;
    pd_backend *owner; /* NCCL connections: the prefill rank's backend (NULL: plain TCP) */
    pd_kv_link *link;  /* its NCCL link (NULL: none yet) */
} idle_conn;

/* A connection a send works on: the socket, and for NCCL sends the backend that owns its link. */
typedef struct {
    int fd;
    pd_backend *owner;
    pd_kv_link *link;
} tx_conn;

static void tx_conn_close(tx_conn *c)
{
    if (c->link) pd_backend_get_ops(c->owner)->kv_link_close(c->owner, c->link);
    c->link = NULL;
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
}

/* Host staging of the export path (send_on), kept for the next send from the same backend:
 * the backend's host memory (pinned on CUDA) is costly to allocate and to touch the first time.
 * One per send in flight; it keeps the largest size a send needed. */
typedef struct stage_buf {
    struct stage_buf *next;
    pd_backend *b;
    uint8_t *p;
    size_t cap;
} stage_buf;

struct pd_kv_tcp_sender {
    pthread_mutex_t mu;
    idle_conn *idle;
    stage_buf *stages; /* idle ones */
};

static void stage_free(stage_buf *sb)
{
    pd_backend_host_free(sb->b, sb->p);
    free(sb);
}

/* A staging buffer of b with at least bytes (an idle one when there is, grown if need be). */
static int take_stage(pd_kv_tcp_sender *tx, pd_backend *b, size_t bytes, stage_buf **out)
{
    stage_buf *sb = NULL;
    pthread_mutex_lock(&tx->mu);
    for (stage_buf **pp = &tx->stages; *pp; pp = &(*pp)->next)
        if ((*pp)->b == b) {
            sb = *pp;
            *pp = sb->next;
            break;
        }
    pthread_mutex_unlock(&tx->mu);
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

static void give_stage(pd_kv_tcp_sender *tx, stage_buf *sb)
{
    pthread_mutex_lock(&tx->mu);
    sb->next = tx->stages;
    tx->stages = sb;
    pthread_mutex_unlock(&tx->mu);
}

int pd_kv_tcp_sender_create(pd_kv_tcp_sender **out)
{
    pd_kv_tcp_sender *tx = calloc(1, sizeof *tx);
    if (!tx) return pd_error(PD_ENOMEM, "kv send: out of memory");
    pthread_mutex_init(&tx->mu, NULL);
    *out = tx;
    return PD_OK;
}

void pd_kv_tcp_sender_destroy(pd_kv_tcp_sender *tx)
{
    if (!tx) return;
    while (tx->idle) {
        idle_conn *c = tx->idle;
        tx->idle = c->next;
        tx_conn tc = {.fd = c->fd, .owner = c->owner, .link = c->link};
        tx_conn_close(&tc);
        free(c);
    }
    while (tx->stages) {
        stage_buf *sb = tx->stages;
        tx->stages = sb->next;
        stage_free(sb);
    }
    pthread_mutex_destroy(&tx->mu);
    free(tx);
}

/* An idle connection to addr owned by owner (NULL: a plain one); false when there is none. */
static bool take_conn(pd_kv_tcp_sender *tx, const char *addr, pd_backend *owner, tx_conn *out)
{
    pthread_mutex_lock(&tx->mu);
    for (idle_conn **pp = &tx->idle; *pp; pp = &(*pp)->next)
        if (strcmp((*pp)->addr, addr) == 0 && (*pp)->owner == owner) {
            idle_conn *c = *pp;
            *pp = c->next;
            pthread_mutex_unlock(&tx->mu);
            *out = (tx_conn){.fd = c->fd, .owner = c->owner, .link = c->link};
            free(c);
            return true;
        }
    pthread_mutex_unlock(&tx->mu);
    return false;
}

static void give_conn(pd_kv_tcp_sender *tx, const char *addr, tx_conn *tc)
{
    idle_conn *c = malloc(sizeof *c);
    if (!c) {
        tx_conn_close(tc);
        return;
    }
    snprintf(c->addr, sizeof c->addr, "%s", addr);
    c->fd = tc->fd;
    c->owner = tc->owner;
    c->link = tc->link;
    pthread_mutex_lock(&tx->mu);
    c->next = tx->idle;
    tx->idle = c;
    pthread_mutex_unlock(&tx->mu);
}

/* What a failed socket wait means, for the messages of the sender. */
static const char *io_failure(int rc, const char *what)
{
    static _Thread_local char buf[96];
    snprintf(buf, sizeof buf, "%s %s",
             rc == PD_ETIMEOUT     ? "timed out"
             : rc == PD_ECANCELLED ? "cancelled"
                                   : "connection lost",
             what);
    return buf;
}

static int dial(const char *host, int port, const atomic_bool *cancel, int64_t deadline, int *out)
{
    struct sockaddr_storage ss;
    socklen_t sl;
    PD_CHECK(resolve(host, port, &ss, &sl));
    int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return pd_error(PD_EIO, "kv send: socket: %s", strerror(errno));
    tune_socket(fd);
    if (connect(fd, (struct sockaddr *)&ss, sl) != 0 && errno != EINPROGRESS) {
        int e = errno;
        close(fd);
        return pd_error(PD_ECLOSED, "kv send: connect %s:%d: %s", host, port, strerror(e));
    }
    int w = wait_fd(fd, POLLOUT, -1, cancel, deadline);
    int err = 0;
    socklen_t el = sizeof err;
    if (w == 1) getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
    if (w != 1 || err) {
        close(fd);
        if (w == 0) return pd_error(PD_ETIMEOUT, "kv send: connect %s:%d timed out", host, port);
        if (w == -2) return pd_error(PD_ECANCELLED, "kv send: connect %s:%d cancelled", host, port);
        return pd_error(PD_ECLOSED, "kv send: connect %s:%d: %s", host, port,
                        strerror(err ? err : ECONNREFUSED));
    }
    *out = fd;
    return PD_OK;
}

/* The header of a frame of r: layer, flags and payload size as given, the rest from r. */
static void fill_header_ex(const pd_kv_send_req *r, int layer, size_t tokens, uint16_t flags,
                           uint64_t payload_bytes, uint8_t *out)
{
    frame_hdr h = {.version = VERSION,
                   .flags = flags,
                   .layer = (uint32_t)layer,
                   .head0 = (uint32_t)r->head0,
                   .n_heads = (uint32_t)r->n_heads,
                   .block0 = 0,
                   .n_blocks = (uint32_t)r->n_blocks,
                   .n_tokens = (uint32_t)tokens,
                   .payload_bytes = payload_bytes};
    snprintf(h.request_id, sizeof h.request_id, "%s", r->request_id);
    hdr_pack(&h, out);
}

/* A KV frame's header: the last layer's is flagged LAST. */
static void fill_header(const pd_kv_send_req *r, int layer, size_t tokens, size_t per_layer,
                        uint8_t *out)
{
    fill_header_ex(r, layer, tokens, layer == r->kv_params.n_layers - 1 ? FLAG_LAST : 0, per_layer,
                   out);
}

/* Zero-copy frames: when the pool is host memory and the frame carries every head the rank
 * holds, a block's K (or V) of one layer is one contiguous run of the pool, so the frames are
 * written straight from the pool with writev (no export copy). Up to IOV_BATCH pieces or
 * `coalesce` bytes go out per call. */
#define IOV_BATCH 1024
static int send_frames_gather(int fd, const pd_kv_send_req *r, size_t tokens, size_t per_layer,
                              size_t coalesce, int64_t deadline, pd_kv_send_stats *st)
{
    const pd_kv_params *kp = &r->kv_params;
    const pd_backend_ops *ops = pd_backend_get_ops(r->backend);
    uint8_t(*hdrs)[HDR_BYTES] = malloc((size_t)kp->n_layers * HDR_BYTES);
    struct iovec *iov = malloc(IOV_BATCH * sizeof *iov);
    if (!hdrs || !iov) {
        free(hdrs);
        free(iov);
        return pd_error(PD_ENOMEM, "kv send: out of memory");
    }
    int rc = ops->sync(r->backend), cnt = 0;
    size_t pending = 0;
    for (int layer = 0; layer < kp->n_layers && rc == PD_OK; layer++) {
        pd_kv_layer_view v;
        rc = ops->kv_layer(r->backend, r->kv, layer, &v);
        if (rc < 0) break;
        fill_header(r, layer, tokens, per_layer, hdrs[layer]);
        for (size_t piece = 0; piece < 1 + 2 * r->n_blocks && rc == PD_OK; piece++) {
            void *base;
            size_t len;
            if (piece == 0) {
                base = hdrs[layer], len = HDR_BYTES;
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
            bool last = layer == kp->n_layers - 1 && piece == 2 * r->n_blocks;
            if (cnt == IOV_BATCH || (piece == 2 * r->n_blocks && pending >= coalesce) || last) {
                rc = writev_full(fd, iov, cnt, r->cancel, deadline);
                st->writes++;
                cnt = 0;
                pending = 0;
            }
        }
        st->frames++;
        st->bytes += per_layer;
    }
    free(hdrs);
    free(iov);
    if (rc == PD_ETIMEOUT || rc == PD_ECLOSED || rc == PD_ECANCELLED)
        return pd_error(rc, "kv send %s: %s", r->request_id, io_failure(rc, "writing"));
    return rc;
}

/* The IPC frame of r (see the file-top comment). */
static int send_frame_ipc(int fd, const pd_kv_send_req *r, size_t tokens, int64_t deadline,
                          pd_kv_send_stats *st)
{
    const pd_kv_params *kp = &r->kv_params;
    size_t n = HDR_BYTES + IPC_FIXED + 4 * r->n_blocks;
    uint8_t *buf = calloc(1, n);
    if (!buf) return pd_error(PD_ENOMEM, "kv send: out of memory");
    fill_header_ex(r, 0, tokens, FLAG_LAST | FLAG_IPC, IPC_FIXED + 4 * r->n_blocks, buf);
    uint8_t *p = buf + HDR_BYTES;
    boot_id((char *)p);
    memcpy(p + 40, r->share->handle, PD_KV_SHARE_HANDLE_BYTES);
    put_u64(p + 104, r->share->id);
    put_u32(p + 112, (uint32_t)kp->n_layers);
    put_u32(p + 116, (uint32_t)kp->block_size);
    put_u64(p + 120, kp->n_blocks);
    put_u32(p + 128, (uint32_t)kp->n_kv_heads);
    put_u32(p + 132, (uint32_t)kp->head_dim);
    put_u32(p + 136, (uint32_t)kp->dtype);
    put_u32(p + 140, (uint32_t)(r->head0 - r->src_head0));
    for (size_t i = 0; i < r->n_blocks; i++)
        put_u32(p + IPC_FIXED + 4 * i, (uint32_t)r->block_ids[i]);
    /* the prefill step that wrote these blocks has completed (its first token was sampled) */
    int rc = write_full(fd, buf, n, r->cancel, deadline);
    free(buf);
    if (rc == PD_ETIMEOUT || rc == PD_ECLOSED || rc == PD_ECANCELLED)
        return pd_error(rc, "kv send %s: %s", r->request_id, io_failure(rc, "writing"));
    if (rc < 0) return rc;
    st->frames = 1;
    st->writes = 1;
    st->bytes = (uint64_t)kp->n_layers * slice_bytes(kp, tokens, r->n_heads);
    return PD_OK;
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

/* Reads the acknowledgement of r's last frame. *keep = the stream is in sync after it. */
static int read_ack(int fd, const pd_kv_send_req *r, int64_t deadline, bool *keep)
{
    uint8_t ack[ACK_BYTES];
    spin_readable(fd, r->cancel);
    int rc = read_full(fd, ack, ACK_BYTES, -1, r->cancel, deadline);
    if (rc < 0)
        return pd_error(rc, "kv send %s: %s", r->request_id,
                        io_failure(rc, "waiting for the acknowledgement"));
    if (memcmp(ack, "PDKA", 4) != 0 ||
        strncmp((const char *)ack + 12, r->request_id, PD_KV_REQUEST_ID_MAX) != 0)
        return pd_error(PD_EINTERNAL, "kv send %s: malformed acknowledgement", r->request_id);
    *keep = true; /* acknowledged: the stream is still in sync */
    if ((int32_t)get_u32(ack + 8) != 0) {
        char msg[ACK_MSG_BYTES];
        memcpy(msg, ack + 52, sizeof msg);
        msg[sizeof msg - 1] = '\0';
        int st_code = (int32_t)get_u32(ack + 8) == PD_EUNSUPPORTED ? PD_EUNSUPPORTED : PD_EINVAL;
        return pd_error(st_code, "kv send %s: refused by the decode rank: %s", r->request_id, msg);
    }
    return PD_OK;
}

/* Sets up the NCCL link of connection c (see the file-top comment). */
static int nccl_link_up(tx_conn *c, const pd_kv_send_req *r, int64_t deadline, bool *keep)
{
    const pd_backend_ops *ops = pd_backend_get_ops(r->backend);
    uint8_t buf[HDR_BYTES + PD_KV_LINK_ID_BYTES];
    frame_hdr h = {.version = VERSION,
                   .flags = FLAG_NCCL_INIT | FLAG_LAST |
                            (r->nccl_distinct_gpus ? FLAG_DISTINCT_GPUS : 0u),
                   .payload_bytes = PD_KV_LINK_ID_BYTES};
    snprintf(h.request_id, sizeof h.request_id, "%s", r->request_id);
    hdr_pack(&h, buf);
    PD_CHECK(ops->kv_link_id(r->backend, buf + HDR_BYTES));
    int rc = write_full(c->fd, buf, sizeof buf, r->cancel, deadline);
    if (rc < 0) return pd_error(rc, "kv send %s: %s", r->request_id, io_failure(rc, "writing"));
    PD_CHECK(read_ack(c->fd, r, deadline, keep)); /* PD_EUNSUPPORTED: a CPU receiver */
    *keep = false; /* from here a failure leaves the two sides out of step */
    conn_watch cw = {.fd = c->fd, .stop_fd = -1, .cancel = r->cancel};
    pd_kv_link_wait w = {.deadline_ns = deadline, .check = conn_check, .check_arg = &cw};
    int64_t t0 = pd_now_ns();
    rc = ops->kv_link_open(r->backend, buf + HDR_BYTES, 0, &w, &c->link);
    if (rc < 0)
        return pd_error_prefix(rc, "kv send %s: NCCL link to %s:%d", r->request_id, r->host,
                               r->port);
    PD_INFO(r->request_id, "kv NCCL link to %s:%d up in %.3f s", r->host, r->port,
            (double)(pd_now_ns() - t0) / 1e9);
    return PD_OK;
}

/* r over the NCCL link of c (made first when the connection has none), then the
 * acknowledgement. */
static int send_nccl(tx_conn *c, const pd_kv_send_req *r, size_t tokens, int64_t deadline,
                     pd_kv_send_stats *st, bool *keep)
{
    const pd_kv_params *kp = &r->kv_params;
    const pd_backend_ops *ops = pd_backend_get_ops(r->backend);
    if (!ops->kv_link_send)
        return pd_error(PD_EUNSUPPORTED, "kv send %s: the %s backend cannot send KV over NCCL",
                        r->request_id, pd_backend_name(r->backend));
    if (!c->link) PD_CHECK(nccl_link_up(c, r, deadline, keep));
    *keep = false;
    size_t layer_b = slice_bytes(kp, tokens, r->n_heads);
    pd_kv_nccl_desc d = {
        .chunk_layers = (uint32_t)pd_kv_nccl_chunk_layers(layer_b, kp->n_layers, r->coalesce_bytes),
        .link_bytes = (uint64_t)kp->n_layers * layer_b};
    uint8_t buf[HDR_BYTES + PD_KV_NCCL_DESC_BYTES];
    fill_header_ex(r, 0, tokens, FLAG_NCCL | FLAG_LAST, PD_KV_NCCL_DESC_BYTES, buf);
    pd_kv_nccl_desc_pack(&d, buf + HDR_BYTES);
    int rc = write_full(c->fd, buf, sizeof buf, r->cancel, deadline);
    if (rc < 0) return pd_error(rc, "kv send %s: %s", r->request_id, io_failure(rc, "writing"));
    st->frames = 1; /* the request is on its way: a failure from here is not the link's set-up */
    conn_watch cw = {.fd = c->fd, .stop_fd = -1, .cancel = r->cancel};
    pd_kv_link_wait w = {.deadline_ns = deadline, .check = conn_check, .check_arg = &cw};
    pd_kv_xfer x = {.blocks = r->block_ids,
                    .n_blocks = r->n_blocks,
                    .n_tokens = tokens,
                    .head0 = r->head0 - r->src_head0,
                    .n_heads = r->n_heads,
                    .layer0 = 0,
                    .n_layers = kp->n_layers};
    rc = ops->kv_link_send(r->backend, r->kv, c->link, &x, (int)d.chunk_layers, &w);
    if (rc < 0) return pd_error_prefix(rc, "kv send %s over NCCL", r->request_id);
    st->writes = ((uint64_t)kp->n_layers + d.chunk_layers - 1) / d.chunk_layers; /* chunks */
    st->bytes = d.link_bytes;
    return read_ack(c->fd, r, deadline, keep);
}

/* Frames of one request over fd, then the acknowledgement. *keep tells whether the
 * connection is still in sync (success, or a refusal the receiver acknowledged). */
static int send_on(pd_kv_tcp_sender *tx, tx_conn *c, const pd_kv_send_req *r, int64_t deadline,
                   pd_kv_send_stats *st, bool *keep)
{
    int fd = c->fd;
    *keep = false;
    const pd_kv_params *kp = &r->kv_params;
    size_t tokens = 0;
    PD_CHECK(tokens_in(kp, r->n_blocks, r->n_tokens, &tokens));
    size_t per_layer = slice_bytes(kp, tokens, r->n_heads);
    /* kv_export writes whole blocks; the frame keeps the prompt's tokens of K and of V */
    size_t full_layer = slice_bytes(kp, r->n_blocks * kp->block_size, r->n_heads);
    size_t coalesce = r->coalesce_bytes ? r->coalesce_bytes : (size_t)1 << 20;
    if (r->share) {
        PD_CHECK(send_frame_ipc(fd, r, tokens, deadline, st));
        goto ack;
    }
    if (r->nccl) return send_nccl(c, r, tokens, deadline, st, keep);
    pd_kv_layer_view view;
    const pd_backend_ops *vops = pd_backend_get_ops(r->backend);
    bool gather = r->head0 == r->src_head0 && r->n_heads == kp->n_kv_heads &&
                  vops->kv_layer(r->backend, r->kv, 0, &view) == PD_OK && view.host_visible;
    if (gather) {
        int grc = send_frames_gather(fd, r, tokens, per_layer, coalesce, deadline, st);
        if (grc < 0) return grc;
        goto ack;
    }
    size_t cap = (coalesce > HDR_BYTES + per_layer ? coalesce : HDR_BYTES + per_layer) + HDR_BYTES +
                 full_layer;
    stage_buf *sb = NULL;
    PD_CHECK(take_stage(tx, r->backend, cap, &sb));
    uint8_t *buf = sb->p;
    const pd_backend_ops *ops = pd_backend_get_ops(r->backend);
    size_t used = 0;
    int rc = PD_OK;
    for (int layer = 0; layer < kp->n_layers && rc == PD_OK; layer++) {
        fill_header(r, layer, tokens, per_layer, buf + used);
        pd_kv_range range = {.layer = layer,
                             .block_ids = r->block_ids,
                             .n_blocks = r->n_blocks,
                             .head0 = r->head0 - r->src_head0,
                             .n_heads = r->n_heads};
        uint8_t *payload = buf + used + HDR_BYTES;
        rc = ops->kv_export(r->backend, r->kv, &range, payload); /* complete on return */
        if (rc < 0) break;
        if (per_layer < full_layer) /* V right after the prompt's part of K */
            memmove(payload + per_layer / 2, payload + full_layer / 2, per_layer / 2);
        used += HDR_BYTES + per_layer;
        st->frames++;
        st->bytes += per_layer;
        if (used >= coalesce || layer == kp->n_layers - 1) {
            rc = write_full(fd, buf, used, r->cancel, deadline);
            if (rc < 0) {
                rc = pd_error(rc, "kv send %s: %s", r->request_id, io_failure(rc, "writing"));
                break;
            }
            st->writes++;
            used = 0;
        }
    }
    give_stage(tx, sb);
    if (rc < 0) return rc;
ack:
    return read_ack(fd, r, deadline, keep);
}

int pd_kv_tcp_send(pd_kv_tcp_sender *tx, const pd_kv_send_req *r, pd_kv_send_stats *stats)
{
    pd_kv_send_stats st = {0};
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
    /* NCCL sends keep connections of their own per prefill rank: each carries that rank's link */
    pd_backend *owner = r->nccl && !r->share ? r->backend : NULL;
    if (owner && !pd_backend_get_ops(owner)->kv_link_send)
        return pd_error(PD_EUNSUPPORTED, "kv send %s: the %s backend cannot send KV over NCCL",
                        r->request_id, pd_backend_name(owner));
    tx_conn c = {.fd = -1, .owner = owner, .link = NULL};
    bool reused = take_conn(tx, addr, owner, &c);
    if (!reused) PD_CHECK(dial(r->host, r->port, r->cancel, deadline, &c.fd));
    bool keep = false;
    int rc = send_on(tx, &c, r, deadline, &st, &keep);
    if (rc == PD_ECLOSED && reused && !keep) { /* the pooled connection had gone stale */
        tx_conn_close(&c);
        st = (pd_kv_send_stats){0};
        PD_CHECK(dial(r->host, r->port, r->cancel, deadline, &c.fd));
        rc = send_on(tx, &c, r, deadline, &st, &keep);
    }
    if (keep)
        give_conn(tx, addr, &c);
    else
        tx_conn_close(&c);
    st.seconds = (double)(pd_now_ns() - t0) / 1e9;
    if (stats) *stats = st;
    return rc;
}
