/* Unit tests of the TCP KV transfer between real CPU-backend KV pools on loopback. */
#include "harness.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include "backend/backend.h"
#include "transfer/kv_frames.h"
#include "transfer/kv_route.h"
#include "transfer/kv_tcp.h"
#include "util/clock.h"

#define LAYERS 3
#define BLOCK  4
#define HEADS  4
#define HDIM   8
#define POOL   16

typedef struct {
    pd_backend *b;
    pd_kv *kv;
    pd_kv_params p;
} pool;

static int pool_make(pool *pl, size_t n_heads)
{
    pd_backend_params bp = pd_backend_default_params();
    bp.n_threads = 1;
    PD_CHECK(pd_backend_cpu_create(&bp, &pl->b));
    pl->p = (pd_kv_params){.n_layers = LAYERS,
                           .n_blocks = POOL,
                           .block_size = BLOCK,
                           .n_kv_heads = n_heads,
                           .head_dim = HDIM,
                           .dtype = PD_DTYPE_F32};
    return pd_backend_get_ops(pl->b)->kv_create(pl->b, &pl->p, &pl->kv);
}

static void pool_free(pool *pl)
{
    pd_backend_get_ops(pl->b)->kv_free(pl->b, pl->kv);
    pd_backend_free(pl->b);
}

/* Value of (layer, k/v, token t of the prompt, global head h, dim d): distinct everywhere. */
static float val(int layer, int kv, size_t t, size_t h, size_t d)
{
    return (float)(layer * 100000 + kv * 50000 + (int)t * 1000 + (int)h * 100 + (int)d);
}

/* Writes the prompt's KV (n_blocks blocks) for global heads [h0, h0+n) into pool blocks. */
static int fill(pool *pl, const int32_t *blocks, size_t n_blocks, size_t h0)
{
    size_t n = pl->p.n_kv_heads, per = n_blocks * BLOCK * n * HDIM;
    float *host = malloc(2 * per * sizeof(float));
    for (int l = 0; l < LAYERS; l++) {
        for (int kv = 0; kv < 2; kv++)
            for (size_t t = 0; t < n_blocks * BLOCK; t++)
                for (size_t h = 0; h < n; h++)
                    for (size_t d = 0; d < HDIM; d++)
                        host[kv * per + (t * n + h) * HDIM + d] = val(l, kv, t, h0 + h, d);
        pd_kv_range r = {
            .layer = l, .block_ids = blocks, .n_blocks = n_blocks, .head0 = 0, .n_heads = n};
        int rc = pd_backend_get_ops(pl->b)->kv_import(pl->b, pl->kv, &r, host);
        if (rc < 0) {
            free(host);
            return rc;
        }
    }
    free(host);
    return PD_OK;
}

/* Counts elements of the pool's blocks that differ from the expected values: the prompt's
 * values for its first `tokens` tokens (0 = all slots), zero after them. */
static size_t mismatches_upto(pool *pl, const int32_t *blocks, size_t n_blocks, size_t h0,
                              size_t tokens)
{
    size_t n = pl->p.n_kv_heads, per = n_blocks * BLOCK * n * HDIM, bad = 0;
    float *host = malloc(2 * per * sizeof(float));
    for (int l = 0; l < LAYERS; l++) {
        pd_kv_range r = {
            .layer = l, .block_ids = blocks, .n_blocks = n_blocks, .head0 = 0, .n_heads = n};
        pd_backend_get_ops(pl->b)->kv_export(pl->b, pl->kv, &r, host);
        for (int kv = 0; kv < 2; kv++)
            for (size_t t = 0; t < n_blocks * BLOCK; t++)
                for (size_t h = 0; h < n; h++)
                    for (size_t d = 0; d < HDIM; d++)
                        bad += host[kv * per + (t * n + h) * HDIM + d] !=
                               (!tokens || t < tokens ? val(l, kv, t, h0 + h, d) : 0.0f);
    }
    free(host);
    return bad;
}

static size_t mismatches(pool *pl, const int32_t *blocks, size_t n_blocks, size_t h0)
{
    return mismatches_upto(pl, blocks, n_blocks, h0, 0);
}

static atomic_int g_done, g_done_status;
static void on_done(void *arg, const char *id, int status)
{
    (void)arg, (void)id;
    atomic_store(&g_done_status, status);
    atomic_fetch_add(&g_done, 1);
}

static int wait_done(int n)
{
    for (int i = 0; i < 3000 && atomic_load(&g_done) < n; i++) pd_sleep_ns(PD_NS_PER_MS);
    return atomic_load(&g_done) >= n;
}

static pd_kv_tcp_receiver *rx_start(pool *d, size_t head0)
{
    pd_kv_rx_params p = {.host = "127.0.0.1",
                         .port = 0,
                         .backend = d->b,
                         .kv = d->kv,
                         .kv_params = d->p,
                         .head0 = head0};
    pd_kv_tcp_receiver *rx = NULL;
    if (pd_kv_tcp_receiver_start(&p, on_done, NULL, &rx) < 0) return NULL;
    return rx;
}

/* A send of heads [h0, h0 + n) of blocks from p (holding heads from src_head0) to 127.0.0.1:port.
 */
static pd_kv_send_req req_at(const char *id, pool *p, size_t src_head0, const int32_t *blocks,
                             size_t n_blocks, int port, size_t h0, size_t n)
{
    return (pd_kv_send_req){.request_id = id,
                            .host = "127.0.0.1",
                            .port = port,
                            .backend = p->b,
                            .kv = p->kv,
                            .kv_params = p->p,
                            .src_head0 = src_head0,
                            .block_ids = blocks,
                            .n_blocks = n_blocks,
                            .head0 = h0,
                            .n_heads = n,
                            .timeout_ms = 5000};
}

/* req_at to rx's port. */
static pd_kv_send_req req_for(const char *id, pool *p, size_t src_head0, const int32_t *blocks,
                              size_t n_blocks, pd_kv_tcp_receiver *rx, size_t h0, size_t n)
{
    return req_at(id, p, src_head0, blocks, n_blocks, pd_kv_tcp_receiver_port(rx), h0, n);
}

TEST(kv_head_plan)
{
    size_t h0, n;
    ASSERT_OK(pd_kv_rank_heads(8, 2, 1, &h0, &n));
    ASSERT_EQ_INT(h0, 4);
    ASSERT_EQ_INT(n, 4);
    ASSERT_ERR(pd_kv_rank_heads(6, 4, 0, &h0, &n), PD_EINVAL, "cannot be split");
    pd_kv_head_overlap(0, 4, 2, 4, &h0, &n);
    ASSERT_EQ_INT(h0, 2);
    ASSERT_EQ_INT(n, 2);
    pd_kv_head_overlap(0, 2, 2, 2, &h0, &n);
    ASSERT_EQ_INT(n, 0);
}

TEST(kv_tcp_moves_blocks_exactly)
{
    pool p, d;
    ASSERT_OK(pool_make(&p, HEADS));
    ASSERT_OK(pool_make(&d, HEADS));
    int32_t pb[3] = {3, 7, 1}, db[3] = {10, 2, 5};
    ASSERT_OK(fill(&p, pb, 3, 0));
    pd_kv_tcp_receiver *rx = rx_start(&d, 0);
    ASSERT(rx);
    atomic_store(&g_done, 0);
    ASSERT_OK(pd_kv_rx_expect(rx, "req-1", db, 3, 0));
    pd_kv_tcp_sender *tx;
    ASSERT_OK(pd_kv_tcp_sender_create(&tx));
    pd_kv_send_req r = req_for("req-1", &p, 0, pb, 3, rx, 0, HEADS);
    pd_kv_send_stats st;
    ASSERT_OK(pd_kv_tcp_send(tx, &r, &st));
    ASSERT(wait_done(1));
    ASSERT_EQ_INT(atomic_load(&g_done_status), 0);
    ASSERT_EQ_INT(mismatches(&d, db, 3, 0), 0);
    ASSERT_EQ_INT(st.frames, LAYERS);
    ASSERT_EQ_INT(st.bytes, (uint64_t)LAYERS * 2 * 3 * BLOCK * HEADS * HDIM * 4);
    ASSERT_EQ_INT(st.writes, 1); /* small layers are coalesced into one message */
    pd_kv_rx_stats rs;
    pd_kv_rx_get_stats(rx, &rs);
    ASSERT_EQ_INT(rs.completed, 1);
    ASSERT_EQ_INT(rs.expected, 0);
    /* the same request again is refused, and the connection stays usable */
    ASSERT_ERR(pd_kv_rx_expect(rx, "req-1", db, 3, 0), PD_EEXIST, "already imported");
    ASSERT_ERR(pd_kv_tcp_send(tx, &r, &st), PD_EINVAL, "already imported");
    ASSERT_OK(pd_kv_rx_expect(rx, "req-2", db, 3, 0));
    r.request_id = "req-2";
    ASSERT_OK(pd_kv_tcp_send(tx, &r, &st));
    ASSERT(wait_done(2));
    pd_kv_tcp_sender_free(tx);
    pd_kv_tcp_receiver_stop(rx);
    pool_free(&p);
    pool_free(&d);
}

TEST(kv_tcp_p_tp1_to_two_d_ranks)
{
    pool p, d0, d1;
    ASSERT_OK(pool_make(&p, HEADS));
    ASSERT_OK(pool_make(&d0, HEADS / 2));
    ASSERT_OK(pool_make(&d1, HEADS / 2));
    int32_t pb[2] = {0, 9}, db[2] = {4, 6};
    ASSERT_OK(fill(&p, pb, 2, 0));
    pd_kv_tcp_receiver *rx0 = rx_start(&d0, 0), *rx1 = rx_start(&d1, 2);
    atomic_store(&g_done, 0);
    ASSERT_OK(pd_kv_rx_expect(rx0, "r", db, 2, 0));
    ASSERT_OK(pd_kv_rx_expect(rx1, "r", db, 2, 0));
    pd_kv_tcp_sender *tx;
    ASSERT_OK(pd_kv_tcp_sender_create(&tx));
    for (int rank = 0; rank < 2; rank++) {
        size_t dh0, dn, h0, n;
        ASSERT_OK(pd_kv_rank_heads(HEADS, 2, rank, &dh0, &dn));
        pd_kv_head_overlap(0, HEADS, dh0, dn, &h0, &n);
        pd_kv_send_req r = req_for("r", &p, 0, pb, 2, rank ? rx1 : rx0, h0, n);
        ASSERT_OK(pd_kv_tcp_send(tx, &r, NULL));
    }
    ASSERT(wait_done(2));
    ASSERT_EQ_INT(mismatches(&d0, db, 2, 0), 0);
    ASSERT_EQ_INT(mismatches(&d1, db, 2, 2), 0);
    pd_kv_tcp_sender_free(tx);
    pd_kv_tcp_receiver_stop(rx0);
    pd_kv_tcp_receiver_stop(rx1);
    pool_free(&p);
    pool_free(&d0);
    pool_free(&d1);
}

/* Only the prompt's tokens move (9 tokens in three 4-token blocks): straight from the pool
 * (every head) and through kv_export (a head split over two decode ranks); the last block's
 * unused slots arrive empty, over what the blocks held before. The sender's token count must be
 * the reservation's. */
TEST(kv_tcp_moves_only_the_prompt_tokens)
{
    enum { TOKENS = 2 * BLOCK + 1 };
    pool p, d, d0, d1;
    ASSERT_OK(pool_make(&p, HEADS));
    ASSERT_OK(pool_make(&d, HEADS));
    ASSERT_OK(pool_make(&d0, HEADS / 2));
    ASSERT_OK(pool_make(&d1, HEADS / 2));
    int32_t pb[3] = {3, 7, 1}, db[3] = {10, 2, 5};
    ASSERT_OK(fill(&p, pb, 3, 0));
    ASSERT_OK(fill(&d, db, 3, 0)); /* every slot, so an unused one left alone shows */
    ASSERT_OK(fill(&d0, db, 3, 0));
    ASSERT_OK(fill(&d1, db, 3, 2));
    pd_kv_tcp_receiver *rx = rx_start(&d, 0), *rx0 = rx_start(&d0, 0), *rx1 = rx_start(&d1, 2);
    ASSERT(rx && rx0 && rx1);
    atomic_store(&g_done, 0);
    ASSERT_ERR(pd_kv_rx_expect(rx, "x", db, 3, 3 * BLOCK + 1), PD_EINVAL, "last of 3");
    ASSERT_ERR(pd_kv_rx_expect(rx, "x", db, 3, 2 * BLOCK), PD_EINVAL, "last of 3");
    ASSERT_OK(pd_kv_rx_expect(rx, "whole", db, 3, TOKENS));
    pd_kv_tcp_sender *tx;
    ASSERT_OK(pd_kv_tcp_sender_create(&tx));
    pd_kv_send_req r = req_for("whole", &p, 0, pb, 3, rx, 0, HEADS);
    r.n_tokens = TOKENS + 1; /* not what was reserved: refused */
    ASSERT_ERR(pd_kv_tcp_send(tx, &r, NULL), PD_EINVAL, "holding 9");
    ASSERT_OK(pd_kv_rx_cancel(rx, "whole"));
    ASSERT_OK(pd_kv_rx_expect(rx, "whole2", db, 3, TOKENS));
    r.request_id = "whole2";
    r.n_tokens = TOKENS;
    pd_kv_send_stats st;
    ASSERT_OK(pd_kv_tcp_send(tx, &r, &st));
    ASSERT_EQ_INT(st.bytes, (uint64_t)LAYERS * 2 * TOKENS * HEADS * HDIM * 4);
    ASSERT_OK(pd_kv_rx_expect(rx0, "split", db, 3, TOKENS));
    ASSERT_OK(pd_kv_rx_expect(rx1, "split", db, 3, TOKENS));
    for (int rank = 0; rank < 2; rank++) {
        pd_kv_send_req q = req_for("split", &p, 0, pb, 3, rank ? rx1 : rx0, rank * 2, 2);
        q.n_tokens = TOKENS;
        ASSERT_OK(pd_kv_tcp_send(tx, &q, &st));
        ASSERT_EQ_INT(st.bytes, (uint64_t)LAYERS * 2 * TOKENS * 2 * HDIM * 4);
    }
    ASSERT(wait_done(3));
    ASSERT_EQ_INT(atomic_load(&g_done_status), 0);
    ASSERT_EQ_INT(mismatches_upto(&d, db, 3, 0, TOKENS), 0);
    ASSERT_EQ_INT(mismatches_upto(&d0, db, 3, 0, TOKENS), 0);
    ASSERT_EQ_INT(mismatches_upto(&d1, db, 3, 2, TOKENS), 0);
    pd_kv_tcp_sender_free(tx);
    pd_kv_tcp_receiver_stop(rx);
    pd_kv_tcp_receiver_stop(rx0);
    pd_kv_tcp_receiver_stop(rx1);
    pool_free(&p);
    pool_free(&d);
    pool_free(&d0);
    pool_free(&d1);
}

TEST(kv_tcp_p_tp2_to_one_d_rank)
{
    pool p0, p1, d;
    ASSERT_OK(pool_make(&p0, HEADS / 2));
    ASSERT_OK(pool_make(&p1, HEADS / 2));
    ASSERT_OK(pool_make(&d, HEADS));
    int32_t pb[2] = {5, 6}, db[2] = {1, 2};
    ASSERT_OK(fill(&p0, pb, 2, 0));
    ASSERT_OK(fill(&p1, pb, 2, 2));
    pd_kv_tcp_receiver *rx = rx_start(&d, 0);
    atomic_store(&g_done, 0);
    ASSERT_OK(pd_kv_rx_expect(rx, "r", db, 2, 0));
    pd_kv_tcp_sender *tx;
    ASSERT_OK(pd_kv_tcp_sender_create(&tx));
    pd_kv_send_req r0 = req_for("r", &p0, 0, pb, 2, rx, 0, 2);
    ASSERT_OK(pd_kv_tcp_send(tx, &r0, NULL));
    pd_sleep_ns(20 * PD_NS_PER_MS);
    ASSERT_EQ_INT(atomic_load(&g_done), 0); /* half the heads: not complete yet */
    pd_kv_send_req r1 = req_for("r", &p1, 2, pb, 2, rx, 2, 2);
    ASSERT_OK(pd_kv_tcp_send(tx, &r1, NULL));
    ASSERT(wait_done(1));
    ASSERT_EQ_INT(mismatches(&d, db, 2, 0), 0);
    /* sending heads the P rank does not hold is refused before anything moves */
    pd_kv_send_req bad = req_for("x", &p1, 2, pb, 2, rx, 0, 2);
    ASSERT_ERR(pd_kv_tcp_send(tx, &bad, NULL), PD_EINVAL, "not held by this rank");
    pd_kv_tcp_sender_free(tx);
    pd_kv_tcp_receiver_stop(rx);
    pool_free(&p0);
    pool_free(&p1);
    pool_free(&d);
}

TEST(kv_tcp_refuses_unknown_and_cancelled_requests)
{
    pool p, d;
    ASSERT_OK(pool_make(&p, HEADS));
    ASSERT_OK(pool_make(&d, HEADS));
    int32_t blocks[1] = {0};
    pd_kv_tcp_receiver *rx = rx_start(&d, 0);
    pd_kv_tcp_sender *tx;
    ASSERT_OK(pd_kv_tcp_sender_create(&tx));
    pd_kv_send_req r = req_for("nobody", &p, 0, blocks, 1, rx, 0, HEADS);
    ASSERT_ERR(pd_kv_tcp_send(tx, &r, NULL), PD_EINVAL, "not expected");
    ASSERT_OK(pd_kv_rx_expect(rx, "gone", blocks, 1, 0));
    ASSERT_OK(pd_kv_rx_cancel(rx, "gone"));
    ASSERT_ERR(pd_kv_rx_cancel(rx, "gone"), PD_ENOTFOUND, "not expected");
    r.request_id = "gone"; /* frames of a cancelled request: dropped, logged at INFO */
    ASSERT_ERR(pd_kv_tcp_send(tx, &r, NULL), PD_EINVAL, "dropped: it was cancelled");
    /* reservation with a bad block id */
    int32_t bad_blocks[1] = {POOL};
    ASSERT_ERR(pd_kv_rx_expect(rx, "b", bad_blocks, 1, 0), PD_EINVAL, "outside the pool");
    /* a frame covering fewer blocks than reserved is refused, the next request still works */
    int32_t two[2] = {1, 2};
    ASSERT_OK(pd_kv_rx_expect(rx, "short", two, 2, 0));
    r = req_for("short", &p, 0, blocks, 1, rx, 0, HEADS);
    ASSERT_ERR(pd_kv_tcp_send(tx, &r, NULL), PD_EINVAL,
               "blocks 0+1 holding 4 tokens, expected 0+2");
    pd_kv_rx_stats rs;
    pd_kv_rx_get_stats(rx, &rs);
    ASSERT(rs.refused >= 3);
    pd_kv_tcp_sender_free(tx);
    pd_kv_tcp_receiver_stop(rx);
    pool_free(&p);
    pool_free(&d);
}

static int raw_connect(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) return -1;
    return fd;
}

TEST(kv_tcp_garbage_and_wrong_length_do_not_crash)
{
    pool p, d;
    ASSERT_OK(pool_make(&p, HEADS));
    ASSERT_OK(pool_make(&d, HEADS));
    int32_t blocks[1] = {3};
    pd_kv_tcp_receiver *rx = rx_start(&d, 0);
    /* garbage: the receiver drops that connection */
    int fd = raw_connect(pd_kv_tcp_receiver_port(rx));
    char junk[200];
    memset(junk, 'z', sizeof junk);
    ASSERT_EQ_INT(write(fd, junk, sizeof junk), (ssize_t)sizeof junk);
    char c;
    ASSERT(read(fd, &c, 1) <= 0); /* closed by the receiver (EOF or reset) */
    close(fd);
    /* a well-formed header with a wrong payload length: refused with an acknowledgement */
    ASSERT_OK(pd_kv_rx_expect(rx, "len", blocks, 1, 0));
    uint8_t hdr[80] = {0};
    memcpy(hdr, "PDKV", 4);
    hdr[4] = 2; /* version */
    hdr[6] = 1; /* LAST */
    memcpy(hdr + 8, "len", 3);
    hdr[56] = HEADS; /* n_heads */
    hdr[64] = 1;     /* n_blocks */
    hdr[68] = BLOCK; /* n_tokens */
    hdr[72] = 16;    /* payload: 16 bytes instead of the expected size */
    fd = raw_connect(pd_kv_tcp_receiver_port(rx));
    ASSERT_EQ_INT(write(fd, hdr, 80), 80);
    ASSERT_EQ_INT(write(fd, junk, 16), 16);
    uint8_t ack[256];
    size_t got = 0;
    while (got < sizeof ack) {
        ssize_t n = read(fd, ack + got, sizeof ack - got);
        if (n <= 0) break;
        got += (size_t)n;
    }
    ASSERT_EQ_INT(got, 256);
    ASSERT(memcmp(ack, "PDKA", 4) == 0);
    ASSERT(ack[8] != 0); /* status: refused */
    ASSERT_CONTAINS((const char *)ack + 52, "payload of 16 bytes, expected");
    close(fd);
    /* the receiver still serves the real transfer */
    ASSERT_OK(fill(&p, blocks, 1, 0));
    atomic_store(&g_done, 0);
    pd_kv_tcp_sender *tx;
    ASSERT_OK(pd_kv_tcp_sender_create(&tx));
    pd_kv_send_req r = req_for("len", &p, 0, blocks, 1, rx, 0, HEADS);
    ASSERT_OK(pd_kv_tcp_send(tx, &r, NULL));
    ASSERT(wait_done(1));
    ASSERT_EQ_INT(mismatches(&d, blocks, 1, 0), 0);
    pd_kv_tcp_sender_free(tx);
    pd_kv_tcp_receiver_stop(rx);
    pool_free(&p);
    pool_free(&d);
}

TEST(kv_tcp_dead_receiver_fails_fast)
{
    pool p, d;
    ASSERT_OK(pool_make(&p, HEADS));
    ASSERT_OK(pool_make(&d, HEADS));
    int32_t blocks[1] = {0};
    pd_kv_tcp_receiver *rx = rx_start(&d, 0);
    int port = pd_kv_tcp_receiver_port(rx);
    pd_kv_tcp_receiver_stop(rx);
    pd_kv_tcp_sender *tx;
    ASSERT_OK(pd_kv_tcp_sender_create(&tx));
    pd_kv_send_req r = req_at("x", &p, 0, blocks, 1, port, 0, HEADS);
    r.timeout_ms = 2000;
    int64_t t0 = pd_now_ns();
    ASSERT_ERR(pd_kv_tcp_send(tx, &r, NULL), PD_ECLOSED, "connect 127.0.0.1");
    ASSERT((pd_now_ns() - t0) / PD_NS_PER_MS < 1000);
    pd_kv_tcp_sender_free(tx);
    pool_free(&p);
    pool_free(&d);
}

/* Sets *flag after 150 ms (a request aborted while its KV waits for the acknowledgement). */
static void *cancel_later(void *flag)
{
    pd_sleep_ns(150 * PD_NS_PER_MS);
    atomic_store((atomic_bool *)flag, true);
    return NULL;
}

/* A receiver that takes the frames and never acknowledges (a listening socket nobody serves):
 * the send ends at its deadline, or soon after its cancel flag is set, naming the wait. */
TEST(kv_tcp_silent_receiver_times_out_or_cancels)
{
    pool p;
    ASSERT_OK(pool_make(&p, HEADS));
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    ASSERT(ls >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t al = sizeof a;
    ASSERT(bind(ls, (struct sockaddr *)&a, sizeof a) == 0 && listen(ls, 4) == 0);
    ASSERT(getsockname(ls, (struct sockaddr *)&a, &al) == 0);
    int32_t blocks[2] = {1, 2};
    pd_kv_tcp_sender *tx;
    ASSERT_OK(pd_kv_tcp_sender_create(&tx));
    pd_kv_send_req r = req_at("silent", &p, 0, blocks, 2, ntohs(a.sin_port), 0, HEADS);
    r.timeout_ms = 300;
    int64_t t0 = pd_now_ns();
    ASSERT_ERR(pd_kv_tcp_send(tx, &r, NULL), PD_ETIMEOUT, "waiting for the acknowledgement");
    int64_t ms = (pd_now_ns() - t0) / PD_NS_PER_MS;
    ASSERT(ms >= 290 && ms < 2000);
    atomic_bool cancel = false;
    r.cancel = &cancel;
    r.timeout_ms = 20000;
    pthread_t th;
    ASSERT(pthread_create(&th, NULL, cancel_later, &cancel) == 0);
    t0 = pd_now_ns();
    ASSERT_ERR(pd_kv_tcp_send(tx, &r, NULL), PD_ECANCELLED, "waiting for the acknowledgement");
    ms = (pd_now_ns() - t0) / PD_NS_PER_MS;
    pthread_join(th, NULL);
    ASSERT(ms >= 140 && ms < 2000); /* the flag is looked at every 50 ms while waiting */
    pd_kv_tcp_sender_free(tx);
    close(ls);
    pool_free(&p);
}

/* A CUDA IPC frame to a receiver whose backend cannot map device memory (CPU) is refused as
 * PD_EUNSUPPORTED (what the prefill node's `auto` transport falls back on), the reservation
 * stays, the connection stays in sync, and the same request then moves over TCP. */
TEST(kv_tcp_ipc_frame_refused_by_cpu_receiver)
{
    pool p, d;
    ASSERT_OK(pool_make(&p, HEADS));
    ASSERT_OK(pool_make(&d, HEADS));
    int32_t pb[2] = {4, 6}, db[2] = {1, 9};
    ASSERT_OK(fill(&p, pb, 2, 0));
    pd_kv_tcp_receiver *rx = rx_start(&d, 0);
    ASSERT(rx);
    atomic_store(&g_done, 0);
    ASSERT_OK(pd_kv_rx_expect(rx, "ipc-1", db, 2, 7));
    pd_kv_tcp_sender *tx;
    ASSERT_OK(pd_kv_tcp_sender_create(&tx));
    pd_kv_share share = {.id = 42, .p = p.p};
    memset(share.handle, 0x5a, sizeof share.handle);
    pd_kv_send_req r = req_for("ipc-1", &p, 0, pb, 2, rx, 0, HEADS);
    r.n_tokens = 7;
    r.share = &share;
    pd_kv_send_stats st;
    ASSERT_ERR(pd_kv_tcp_send(tx, &r, &st), PD_EUNSUPPORTED, "cannot take KV by CUDA IPC");
    pd_kv_rx_stats rs;
    pd_kv_rx_get_stats(rx, &rs);
    ASSERT_EQ_INT(rs.expected, 1);
    ASSERT_EQ_INT(rs.refused, 1);
    r.share = NULL;
    ASSERT_OK(pd_kv_tcp_send(tx, &r, &st));
    ASSERT(wait_done(1));
    ASSERT_EQ_INT(mismatches_upto(&d, db, 2, 0, 7), 0);
    pd_kv_tcp_sender_free(tx);
    pd_kv_tcp_receiver_stop(rx);
    pool_free(&p);
    pool_free(&d);
}

/* ---- NCCL frames ---------------------------------------------------------------------------
 * The NCCL protocol of nccl.c (link set-up frame, request frame, chunks, drains, refusals) is
 * exercised here on the CPU through a host-memory stand-in for the backend's link ops: a backend
 * that wraps a CPU backend's state with the CPU op table plus kv_link_* ops moving chunks through
 * an in-process channel keyed by the link id, one chunk in flight (like NCCL's matched send and
 * receive). The real NCCL ops (pd_nccl.cu) run only on GPUs (tests/gpu). */

TEST(kv_nccl_desc_and_chunking)
{
    ASSERT_EQ_INT(pd_kv_nccl_chunk_layers((size_t)10 << 20, 32, 0), 6); /* 64 MiB / 10 MiB */
    ASSERT_EQ_INT(pd_kv_nccl_chunk_layers((size_t)100 << 20, 4, 0), 1); /* one layer at least */
    ASSERT_EQ_INT(pd_kv_nccl_chunk_layers(1024, 3, 0), 3);              /* all layers at most */
    ASSERT_EQ_INT(pd_kv_nccl_chunk_layers(1000, 8, 2500), 2);
    pd_kv_nccl_desc d = {.chunk_layers = 2, .link_bytes = 3 * 4096}, e;
    uint8_t b[PD_KV_NCCL_DESC_BYTES];
    pd_kv_nccl_desc_pack(&d, b);
    ASSERT_OK(pd_kv_nccl_desc_unpack(b, 3, 4096, &e));
    ASSERT_EQ_INT(e.chunk_layers, 2);
    ASSERT_EQ_INT(e.link_bytes, 3 * 4096);
    ASSERT_ERR(pd_kv_nccl_desc_unpack(b, 3, 4000, &e), PD_EINVAL,
               "link_bytes 12288, expected 12000");
    ASSERT_ERR(pd_kv_nccl_desc_unpack(b, 1, 12288, &e), PD_EINVAL, "chunk_layers 2 outside 1..1");
    d.chunk_layers = 0;
    pd_kv_nccl_desc_pack(&d, b);
    ASSERT_ERR(pd_kv_nccl_desc_unpack(b, 3, 4096, &e), PD_EINVAL, "chunk_layers 0");
    d.chunk_layers = 1;
    pd_kv_nccl_desc_pack(&d, b);
    b[4] = 1;
    ASSERT_ERR(pd_kv_nccl_desc_unpack(b, 3, 4096, &e), PD_EINVAL, "reserved field is 1");
}

#define FAKE_CHANS 16
typedef struct {
    uint8_t id[PD_KV_LINK_ID_BYTES];
    int used, joined, refs, dead;
    uint8_t *data; /* the chunk in flight (malloc), NULL: none */
    size_t bytes;
} fake_chan;

struct pd_kv_link { /* the test's link: one end of a channel */
    fake_chan *ch;
    int rank;
    uint8_t *staging; /* the chunk received last */
    size_t staging_bytes;
};

static pthread_mutex_t g_chan_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_chan_cv = PTHREAD_COND_INITIALIZER;
static fake_chan g_chans[FAKE_CHANS];
static atomic_int g_link_opens, g_fail_recv_after = -1, g_recvs;

/* Waits on g_chan_cv (g_chan_mu held) for up to 5 ms, then looks at w: PD_OK to go on. */
static int chan_wait(const pd_kv_link_wait *w, fake_chan *ch)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 5 * 1000000L;
    if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    pthread_cond_timedwait(&g_chan_cv, &g_chan_mu, &ts);
    if (ch && ch->dead) return pd_error(PD_ECLOSED, "fake link: the peer closed the link");
    if (w->check) {
        pthread_mutex_unlock(&g_chan_mu);
        int c = w->check(w->check_arg);
        pthread_mutex_lock(&g_chan_mu);
        if (c < 0) return c;
    }
    if (pd_now_ns() > w->deadline_ns) return pd_error(PD_ETIMEOUT, "fake link: timed out");
    return PD_OK;
}

static int fake_link_id(pd_backend *b, uint8_t id[PD_KV_LINK_ID_BYTES])
{
    (void)b;
    static atomic_int counter;
    memset(id, 0, PD_KV_LINK_ID_BYTES);
    int v = atomic_fetch_add(&counter, 1) + 1;
    memcpy(id, &v, sizeof v);
    return PD_OK;
}

static int fake_link_open(pd_backend *b, const uint8_t id[PD_KV_LINK_ID_BYTES], int rank,
                          const pd_kv_link_wait *w, pd_kv_link **out)
{
    (void)b;
    pthread_mutex_lock(&g_chan_mu);
    fake_chan *ch = NULL;
    for (int i = 0; i < FAKE_CHANS && !ch; i++)
        if (g_chans[i].used && memcmp(g_chans[i].id, id, PD_KV_LINK_ID_BYTES) == 0)
            ch = &g_chans[i];
    for (int i = 0; i < FAKE_CHANS && !ch; i++)
        if (!g_chans[i].used) {
            ch = &g_chans[i];
            memset(ch, 0, sizeof *ch);
            ch->used = 1;
            memcpy(ch->id, id, PD_KV_LINK_ID_BYTES);
        }
    int rc = ch ? PD_OK : pd_error(PD_ENOMEM, "fake link: no free channel");
    if (ch) {
        ch->joined |= 1 << rank;
        ch->refs++;
        pthread_cond_broadcast(&g_chan_cv);
        while (rc == PD_OK && ch->joined != 3) rc = chan_wait(w, ch);
    }
    pd_kv_link *l = NULL;
    if (rc == PD_OK && !(l = calloc(1, sizeof *l))) rc = pd_error(PD_ENOMEM, "fake link: memory");
    if (rc < 0 && ch && --ch->refs == 0) ch->used = 0;
    pthread_mutex_unlock(&g_chan_mu);
    if (rc < 0) return rc;
    l->ch = ch;
    l->rank = rank;
    atomic_fetch_add(&g_link_opens, 1);
    *out = l;
    return PD_OK;
}

static void fake_link_close(pd_backend *b, pd_kv_link *l)
{
    (void)b;
    pthread_mutex_lock(&g_chan_mu);
    l->ch->dead = 1;
    if (--l->ch->refs == 0) {
        free(l->ch->data);
        l->ch->data = NULL;
        l->ch->used = 0;
    }
    pthread_cond_broadcast(&g_chan_cv);
    pthread_mutex_unlock(&g_chan_mu);
    free(l->staging);
    free(l);
}

/* The chunk of x (layers [layer0, +n_layers)) in the chunk layout, through kv_export. */
static int chunk_gather(pd_backend *b, const pd_kv *kv, const pd_kv_xfer *x, int layer0, int n,
                        uint8_t *out)
{
    size_t row = x->n_heads * HDIM * sizeof(float), whole = x->n_blocks * BLOCK * row;
    uint8_t *tmp = malloc(2 * whole);
    if (!tmp) return pd_error(PD_ENOMEM, "fake link: memory");
    for (int l = layer0; l < layer0 + n; l++) {
        pd_kv_range r = {.layer = l,
                         .block_ids = x->blocks,
                         .n_blocks = x->n_blocks,
                         .head0 = x->head0,
                         .n_heads = x->n_heads};
        int rc = pd_backend_get_ops(b)->kv_export(b, kv, &r, tmp);
        if (rc < 0) {
            free(tmp);
            return rc;
        }
        memcpy(out, tmp, x->n_tokens * row);
        memcpy(out + x->n_tokens * row, tmp + whole, x->n_tokens * row);
        out += 2 * x->n_tokens * row;
    }
    free(tmp);
    return PD_OK;
}

static int fake_link_send(pd_backend *b, const pd_kv *kv, pd_kv_link *l, const pd_kv_xfer *x,
                          int chunk_layers, const pd_kv_link_wait *w)
{
    size_t layer_b = 2 * x->n_tokens * x->n_heads * HDIM * sizeof(float);
    for (int l0 = x->layer0; l0 < x->layer0 + x->n_layers; l0 += chunk_layers) {
        int n = x->layer0 + x->n_layers - l0 < chunk_layers ? x->layer0 + x->n_layers - l0
                                                            : chunk_layers;
        uint8_t *buf = malloc(layer_b * (size_t)n);
        if (!buf) return pd_error(PD_ENOMEM, "fake link: memory");
        int rc = chunk_gather(b, kv, x, l0, n, buf);
        pthread_mutex_lock(&g_chan_mu);
        while (rc == PD_OK && l->ch->data) rc = chan_wait(w, l->ch); /* one chunk in flight */
        if (rc == PD_OK) {
            l->ch->data = buf;
            l->ch->bytes = layer_b * (size_t)n;
            buf = NULL;
            pthread_cond_broadcast(&g_chan_cv);
        }
        pthread_mutex_unlock(&g_chan_mu);
        free(buf);
        if (rc < 0) return rc;
    }
    pthread_mutex_lock(&g_chan_mu); /* complete when the last chunk was taken */
    int rc = PD_OK;
    while (rc == PD_OK && l->ch->data) rc = chan_wait(w, l->ch);
    pthread_mutex_unlock(&g_chan_mu);
    return rc;
}

static int fake_link_recv(pd_backend *b, const pd_kv *kv, pd_kv_link *l, const pd_kv_xfer *x,
                          const pd_kv_link_wait *w)
{
    (void)b, (void)kv;
    if (atomic_fetch_add(&g_recvs, 1) == atomic_load(&g_fail_recv_after))
        return pd_error(PD_EINTERNAL, "fake link: receiver failure (test)");
    size_t want = 2 * (size_t)x->n_layers * x->n_tokens * x->n_heads * HDIM * sizeof(float);
    pthread_mutex_lock(&g_chan_mu);
    int rc = PD_OK;
    while (rc == PD_OK && !l->ch->data) rc = chan_wait(w, l->ch);
    if (rc == PD_OK && l->ch->bytes != want)
        rc = pd_error(PD_EINVAL, "fake link: chunk of %zu bytes, receiver expects %zu",
                      l->ch->bytes, want);
    if (rc == PD_OK) {
        free(l->staging);
        l->staging = l->ch->data;
        l->staging_bytes = l->ch->bytes;
        l->ch->data = NULL;
        pthread_cond_broadcast(&g_chan_cv);
    }
    pthread_mutex_unlock(&g_chan_mu);
    return rc;
}

static int fake_link_scatter(pd_backend *b, pd_kv *kv, pd_kv_link *l, const pd_kv_xfer *x)
{
    size_t row = x->n_heads * HDIM * sizeof(float), whole = x->n_blocks * BLOCK * row;
    uint8_t *tmp = calloc(2, whole);
    if (!tmp) return pd_error(PD_ENOMEM, "fake link: memory");
    const uint8_t *in = l->staging;
    int rc = PD_OK;
    for (int ly = x->layer0; ly < x->layer0 + x->n_layers && rc == PD_OK; ly++) {
        memcpy(tmp, in, x->n_tokens * row);
        memcpy(tmp + whole, in + x->n_tokens * row, x->n_tokens * row);
        in += 2 * x->n_tokens * row;
        pd_kv_range r = {.layer = ly,
                         .block_ids = x->blocks,
                         .n_blocks = x->n_blocks,
                         .head0 = x->head0,
                         .n_heads = x->n_heads};
        rc = pd_backend_get_ops(b)->kv_import(b, kv, &r, tmp);
    }
    free(tmp);
    return rc;
}

static void fake_free(pd_backend *b)
{
    (void)b; /* the wrapped CPU backend is destroyed by its own handle */
}

/* Whether the fake links' two ends stand for one GPU (kv_link_local). */
static atomic_int g_same_gpu;

static int fake_link_local(pd_backend *b, const uint8_t id[PD_KV_LINK_ID_BYTES])
{
    (void)b, (void)id;
    return atomic_load(&g_same_gpu);
}

static pd_backend_ops g_fake_ops;

/* p with a second handle f over the same CPU state whose op table has the fake link ops. */
static pd_backend *fake_linked(pool *p)
{
    g_fake_ops = *pd_backend_get_ops(p->b);
    g_fake_ops.name = "fake-link";
    g_fake_ops.free = fake_free;
    g_fake_ops.kv_link_id = fake_link_id;
    g_fake_ops.kv_link_open = fake_link_open;
    g_fake_ops.kv_link_close = fake_link_close;
    g_fake_ops.kv_link_send = fake_link_send;
    g_fake_ops.kv_link_recv = fake_link_recv;
    g_fake_ops.kv_link_scatter = fake_link_scatter;
    g_fake_ops.kv_link_local = fake_link_local;
    return pd_backend_wrap(&g_fake_ops, pd_backend_impl(p->b));
}

static pd_kv_tcp_receiver *rx_start_on(pd_backend *b, pool *d, size_t head0)
{
    pd_kv_rx_params p = {.host = "127.0.0.1",
                         .port = 0,
                         .backend = b,
                         .kv = d->kv,
                         .kv_params = d->p,
                         .head0 = head0};
    pd_kv_tcp_receiver *rx = NULL;
    if (pd_kv_tcp_receiver_start(&p, on_done, NULL, &rx) < 0) return NULL;
    return rx;
}

/* A prefill rank whose backend has no links (CPU) cannot send over NCCL: refused before any I/O. */
TEST(kv_nccl_cpu_sender_refused)
{
    pool p, d;
    ASSERT_OK(pool_make(&p, HEADS));
    ASSERT_OK(pool_make(&d, HEADS));
    int32_t blocks[1] = {2};
    pd_kv_tcp_receiver *rx = rx_start(&d, 0);
    ASSERT(rx);
    pd_kv_tcp_sender *tx;
    ASSERT_OK(pd_kv_tcp_sender_create(&tx));
    pd_kv_send_req r = req_for("cpu-nccl", &p, 0, blocks, 1, rx, 0, HEADS);
    r.nccl = 1;
    pd_kv_send_stats st;
    ASSERT_ERR(pd_kv_tcp_send(tx, &r, &st), PD_EUNSUPPORTED,
               "cpu backend cannot send KV over NCCL");
    ASSERT_EQ_INT(st.frames, 0);
    pd_kv_tcp_sender_free(tx);
    pd_kv_tcp_receiver_stop(rx);
    pool_free(&p);
    pool_free(&d);
}

/* The link set-up frame to a receiver whose backend has no links (CPU) is refused with
 * PD_EUNSUPPORTED before any request frame (what `auto` falls back on), the reservation stays,
 * and the same request then moves over TCP. */
TEST(kv_nccl_frame_refused_by_cpu_receiver)
{
    pool p, d;
    ASSERT_OK(pool_make(&p, HEADS));
    ASSERT_OK(pool_make(&d, HEADS));
    pd_backend *pf = fake_linked(&p);
    ASSERT(pf);
    int32_t pb[2] = {4, 6}, db[2] = {1, 9};
    ASSERT_OK(fill(&p, pb, 2, 0));
    pd_kv_tcp_receiver *rx = rx_start(&d, 0);
    ASSERT(rx);
    atomic_store(&g_done, 0);
    atomic_store(&g_link_opens, 0);
    ASSERT_OK(pd_kv_rx_expect(rx, "nccl-cpu", db, 2, 7));
    pd_kv_tcp_sender *tx;
    ASSERT_OK(pd_kv_tcp_sender_create(&tx));
    pd_kv_send_req r = req_for("nccl-cpu", &p, 0, pb, 2, rx, 0, HEADS);
    r.backend = pf;
    r.n_tokens = 7;
    r.nccl = 1;
    pd_kv_send_stats st;
    ASSERT_ERR(pd_kv_tcp_send(tx, &r, &st), PD_EUNSUPPORTED, "cannot take KV over NCCL");
    ASSERT_EQ_INT(st.frames, 0); /* no request frame: the link was never made */
    ASSERT_EQ_INT(atomic_load(&g_link_opens), 0);
    pd_kv_rx_stats rs;
    pd_kv_rx_get_stats(rx, &rs);
    ASSERT_EQ_INT(rs.expected, 1);
    ASSERT_EQ_INT(rs.refused, 1);
    r.nccl = 0;
    ASSERT_OK(pd_kv_tcp_send(tx, &r, &st));
    ASSERT(wait_done(1));
    ASSERT_EQ_INT(mismatches_upto(&d, db, 2, 0, 7), 0);
    pd_kv_tcp_sender_free(tx);
    pd_kv_tcp_receiver_stop(rx);
    pd_backend_free(pf);
    pool_free(&p);
    pool_free(&d);
}

/* --kv-transport auto (nccl_distinct_gpus) leaves NCCL to processes on GPUs of their own: a
 * receiver on the sender's GPU refuses the link set-up with PD_EUNSUPPORTED before any link or
 * request frame (the sender then takes TCP); --kv-transport nccl (no flag) joins it, and auto
 * joins a receiver on another GPU. */
TEST(kv_nccl_auto_refuses_a_link_within_one_gpu)
{
    pool p, d;
    ASSERT_OK(pool_make(&p, HEADS));
    ASSERT_OK(pool_make(&d, HEADS));
    pd_backend *pf = fake_linked(&p), *fd = pd_backend_wrap(&g_fake_ops, pd_backend_impl(d.b));
    ASSERT(pf && fd);
    int32_t pb[2] = {4, 6}, db[2] = {1, 9}, db2[2] = {3, 5};
    ASSERT_OK(fill(&p, pb, 2, 0));
    pd_kv_tcp_receiver *rx = rx_start_on(fd, &d, 0);
    ASSERT(rx);
    atomic_store(&g_done, 0);
    atomic_store(&g_link_opens, 0);
    atomic_store(&g_fail_recv_after, -1);
    atomic_store(&g_same_gpu, 1);
    ASSERT_OK(pd_kv_rx_expect(rx, "one-gpu", db, 2, 7));
    pd_kv_tcp_sender *tx;
    ASSERT_OK(pd_kv_tcp_sender_create(&tx));
    pd_kv_send_req r = req_for("one-gpu", &p, 0, pb, 2, rx, 0, HEADS);
    r.backend = pf;
    r.n_tokens = 7;
    r.nccl = 1;
    r.nccl_distinct_gpus = 1;
    pd_kv_send_stats st;
    ASSERT_ERR(pd_kv_tcp_send(tx, &r, &st), PD_EUNSUPPORTED,
               "the prefill rank runs on this decode rank's own GPU");
    ASSERT_EQ_INT(st.frames, 0);
    ASSERT_EQ_INT(atomic_load(&g_link_opens), 0);
    r.nccl_distinct_gpus = 0; /* --kv-transport nccl */
    ASSERT_OK(pd_kv_tcp_send(tx, &r, &st));
    ASSERT(wait_done(1));
    ASSERT_EQ_INT(atomic_load(&g_link_opens), 2);
    ASSERT_EQ_INT(mismatches_upto(&d, db, 2, 0, 7), 0);
    pd_kv_tcp_sender_free(tx); /* a new connection, hence a new link set-up frame */
    ASSERT_OK(pd_kv_tcp_sender_create(&tx));
    atomic_store(&g_same_gpu, 0);
    ASSERT_OK(pd_kv_rx_expect(rx, "two-gpus", db2, 2, 7));
    r.request_id = "two-gpus";
    r.nccl_distinct_gpus = 1;
    ASSERT_OK(pd_kv_tcp_send(tx, &r, &st));
    ASSERT(wait_done(2));
    ASSERT_EQ_INT(atomic_load(&g_link_opens), 4);
    ASSERT_EQ_INT(mismatches_upto(&d, db2, 2, 0, 7), 0);
    pd_kv_tcp_sender_free(tx);
    pd_kv_tcp_receiver_stop(rx);
    pd_backend_free(pf);
    pd_backend_free(fd);
    pool_free(&p);
    pool_free(&d);
}

/* The whole NCCL protocol over the host stand-in: one link per connection made on the first
 * request and reused, chunks of one layer, only the prompt's tokens, a refused request drained
 * so the link stays in step, and P TP 2 -> D TP 1 head ranges (two prefill ranks, two links). */
TEST(kv_nccl_protocol_over_host_link)
{
    pool p0, p1, d;
    ASSERT_OK(pool_make(&p0, HEADS / 2));
    ASSERT_OK(pool_make(&p1, HEADS / 2));
    ASSERT_OK(pool_make(&d, HEADS));
    pd_backend *f0 = fake_linked(&p0), *f1 = pd_backend_wrap(&g_fake_ops, pd_backend_impl(p1.b));
    pd_backend *fd = pd_backend_wrap(&g_fake_ops, pd_backend_impl(d.b));
    ASSERT(f0 && f1 && fd);
    int32_t pb[2] = {3, 5}, db[2] = {8, 2}, db2[2] = {11, 12};
    ASSERT_OK(fill(&p0, pb, 2, 0));
    ASSERT_OK(fill(&p1, pb, 2, HEADS / 2));
    pd_kv_tcp_receiver *rx = rx_start_on(fd, &d, 0);
    ASSERT(rx);
    atomic_store(&g_done, 0);
    atomic_store(&g_link_opens, 0);
    atomic_store(&g_fail_recv_after, -1);
    pd_kv_tcp_sender *tx;
    ASSERT_OK(pd_kv_tcp_sender_create(&tx));
    /* an unexpected request: its chunks are drained, then it is refused */
    pd_kv_send_req r = req_for("nope", &p0, 0, pb, 2, rx, 0, HEADS / 2);
    r.backend = f0;
    r.n_tokens = 6;
    r.nccl = 1;
    r.coalesce_bytes = 1; /* one layer per chunk */
    pd_kv_send_stats st;
    ASSERT_ERR(pd_kv_tcp_send(tx, &r, &st), PD_EINVAL, "not expected");
    ASSERT_EQ_INT(atomic_load(&g_link_opens), 2); /* both ends of one link */
    /* the real request, from both prefill ranks (their halves of the heads) */
    ASSERT_OK(pd_kv_rx_expect(rx, "n1", db, 2, 6));
    r.request_id = "n1";
    ASSERT_OK(pd_kv_tcp_send(tx, &r, &st));
    ASSERT_EQ_INT(st.bytes, (uint64_t)LAYERS * 2 * 6 * (HEADS / 2) * HDIM * sizeof(float));
    ASSERT_EQ_INT(st.writes, LAYERS);             /* chunks */
    ASSERT_EQ_INT(atomic_load(&g_link_opens), 2); /* the connection's link was reused */
    ASSERT_EQ_INT(atomic_load(&g_done), 0);       /* half the heads so far */
    pd_kv_send_req r1 = req_for("n1", &p1, HEADS / 2, pb, 2, rx, HEADS / 2, HEADS / 2);
    r1.backend = f1;
    r1.n_tokens = 6;
    r1.nccl = 1;
    ASSERT_OK(pd_kv_tcp_send(tx, &r1, &st));
    ASSERT_EQ_INT(st.writes, 1);                  /* default coalescing: every layer in one chunk */
    ASSERT_EQ_INT(atomic_load(&g_link_opens), 4); /* a second link, for the second rank */
    ASSERT(wait_done(1));
    ASSERT_EQ_INT(atomic_load(&g_done_status), 0);
    ASSERT_EQ_INT(mismatches_upto(&d, db, 2, 0, 6), 0);
    /* a cancelled request is drained too and the link still works afterwards */
    ASSERT_OK(pd_kv_rx_expect(rx, "n2", db2, 2, 5));
    ASSERT_OK(pd_kv_rx_cancel(rx, "n2"));
    r.request_id = "n2";
    r.n_tokens = 5;
    ASSERT_ERR(pd_kv_tcp_send(tx, &r, &st), PD_EINVAL, "cancelled");
    ASSERT_OK(pd_kv_rx_expect(rx, "n3", db2, 2, 5));
    r.request_id = "n3";
    r1.request_id = "n3";
    r1.n_tokens = 5;
    ASSERT_OK(pd_kv_tcp_send(tx, &r, &st));
    ASSERT_OK(pd_kv_tcp_send(tx, &r1, &st));
    ASSERT(wait_done(2));
    ASSERT_EQ_INT(mismatches_upto(&d, db2, 2, 0, 5), 0);
    ASSERT_EQ_INT(atomic_load(&g_link_opens), 4);
    pd_kv_tcp_sender_free(tx);
    pd_kv_tcp_receiver_stop(rx);
    pd_backend_free(f0);
    pd_backend_free(f1);
    pd_backend_free(fd);
    pool_free(&p0);
    pool_free(&p1);
    pool_free(&d);
}

/* A receiver whose link fails mid-request drops the connection and the link: the sender's wait
 * ends at once with an error (not at its deadline), and the next request gets a fresh
 * connection and link. */
TEST(kv_nccl_receiver_failure_fails_fast)
{
    pool p, d;
    ASSERT_OK(pool_make(&p, HEADS));
    ASSERT_OK(pool_make(&d, HEADS));
    pd_backend *pf = fake_linked(&p), *fd = pd_backend_wrap(&g_fake_ops, pd_backend_impl(d.b));
    ASSERT(pf && fd);
    int32_t pb[2] = {0, 1}, db[2] = {6, 7};
    ASSERT_OK(fill(&p, pb, 2, 0));
    pd_kv_tcp_receiver *rx = rx_start_on(fd, &d, 0);
    ASSERT(rx);
    atomic_store(&g_done, 0);
    atomic_store(&g_link_opens, 0);
    atomic_store(&g_recvs, 0);
    atomic_store(&g_fail_recv_after, 1); /* the second chunk fails */
    pd_kv_tcp_sender *tx;
    ASSERT_OK(pd_kv_tcp_sender_create(&tx));
    ASSERT_OK(pd_kv_rx_expect(rx, "f1", db, 2, 8));
    pd_kv_send_req r = req_for("f1", &p, 0, pb, 2, rx, 0, HEADS);
    r.backend = pf;
    r.n_tokens = 8;
    r.nccl = 1;
    r.coalesce_bytes = 1;
    r.timeout_ms = 20000;
    pd_kv_send_stats st;
    int64_t t0 = pd_now_ns();
    int rc = pd_kv_tcp_send(tx, &r, &st);
    ASSERT(rc == PD_ECLOSED);
    ASSERT((pd_now_ns() - t0) / PD_NS_PER_MS < 5000);
    ASSERT_EQ_INT(st.frames, 1); /* the failure came after the request frame */
    atomic_store(&g_fail_recv_after, -1);
    ASSERT_OK(pd_kv_tcp_send(tx, &r, &st)); /* the reservation is still there */
    ASSERT_EQ_INT(atomic_load(&g_link_opens), 4);
    ASSERT(wait_done(1));
    ASSERT_EQ_INT(mismatches_upto(&d, db, 2, 0, 8), 0);
    pd_kv_tcp_sender_free(tx);
    pd_kv_tcp_receiver_stop(rx);
    pd_backend_free(pf);
    pd_backend_free(fd);
    pool_free(&p);
    pool_free(&d);
}

/* ---- the route (kv_route.h) ----------------------------------------------------------------
 * --kv-transport's choice over the stand-ins: next to the link ops above, a CUDA IPC stand-in
 * whose share's handle holds the sender's pool (both ends live in this process) and whose
 * kv_pull copies through kv_export and kv_import. */

typedef struct {
    pd_backend *b;
    const pd_kv *kv;
} fake_pool;

struct pd_kv_peer { /* the test's mapped pool */
    fake_pool src;
};

static int fake_kv_share(pd_backend *b, const pd_kv *kv, pd_kv_share *out)
{
    fake_pool src = {b, kv};
    memset(out, 0, sizeof *out);
    memcpy(out->handle, &src, sizeof src);
    out->id = (uint64_t)(uintptr_t)kv;
    return PD_OK;
}

static int fake_peer_open(pd_backend *b, const pd_kv *kv, const pd_kv_share *s, pd_kv_peer **out)
{
    (void)b, (void)kv;
    if (!(*out = malloc(sizeof **out))) return pd_error(PD_ENOMEM, "fake peer: memory");
    memcpy(&(*out)->src, s->handle, sizeof(*out)->src);
    return PD_OK;
}

static void fake_peer_close(pd_backend *b, pd_kv_peer *peer)
{
    (void)b;
    free(peer);
}

/* Layer by layer: the source blocks' heads out, the slots past the prompt zeroed, then in. */
static int fake_pull(pd_backend *b, pd_kv *kv, pd_kv_peer *peer, const pd_kv_pull *pl)
{
    size_t row = pl->n_heads * HDIM, whole = pl->n_blocks * BLOCK * row, used = pl->n_tokens * row;
    float *tmp = malloc(2 * whole * sizeof *tmp);
    if (!tmp) return pd_error(PD_ENOMEM, "fake pull: memory");
    int rc = PD_OK;
    for (int l = 0; l < LAYERS && rc == PD_OK; l++) {
        pd_kv_range src = {.layer = l,
                           .block_ids = pl->src_blocks,
                           .n_blocks = pl->n_blocks,
                           .head0 = pl->src_head0,
                           .n_heads = pl->n_heads},
                    dst = src;
        dst.block_ids = pl->dst_blocks;
        dst.head0 = pl->dst_head0;
        rc = pd_backend_get_ops(peer->src.b)->kv_export(peer->src.b, peer->src.kv, &src, tmp);
        memset(tmp + used, 0, (whole - used) * sizeof *tmp);
        memset(tmp + whole + used, 0, (whole - used) * sizeof *tmp);
        if (rc == PD_OK) rc = pd_backend_get_ops(b)->kv_import(b, kv, &dst, tmp);
    }
    free(tmp);
    return rc;
}

/* --kv-transport auto, per destination: CUDA IPC where the decode rank maps the pool, else NCCL
 * where it takes a link, else TCP. Each send names the transport that carried it (the label of
 * pd:kv_transfer_bytes_total) and so does the receiver; a refusal is remembered for its
 * destination, a cancelled send is none; an explicit transport never falls back. */
TEST(kv_route_auto_chain_per_destination)
{
    pool p, d[4];
    ASSERT_OK(pool_make(&p, HEADS));
    for (int k = 0; k < 4; k++) ASSERT_OK(pool_make(&d[k], HEADS));
    pd_backend *pl = fake_linked(&p);
    static pd_backend_ops ipc_ops;
    ipc_ops = g_fake_ops;
    ipc_ops.kv_share = fake_kv_share;
    ipc_ops.kv_peer_open = fake_peer_open;
    ipc_ops.kv_peer_close = fake_peer_close;
    ipc_ops.kv_pull = fake_pull;
    pd_backend *pi = pd_backend_wrap(&ipc_ops, pd_backend_impl(p.b));
    pd_backend *f1 = pd_backend_wrap(&g_fake_ops, pd_backend_impl(d[1].b));
    pd_backend *f2 = pd_backend_wrap(&ipc_ops, pd_backend_impl(d[2].b));
    ASSERT(pl && pi && f1 && f2);
    int32_t pb[2] = {4, 6}, db[2] = {1, 9};
    ASSERT_OK(fill(&p, pb, 2, 0));
    /* CPU, links, links and IPC; the fourth (CPU) is met only by the cancelled send first */
    pd_kv_tcp_receiver *rx[4] = {rx_start(&d[0], 0), rx_start_on(f1, &d[1], 0),
                                 rx_start_on(f2, &d[2], 0), rx_start(&d[3], 0)};
    ASSERT(rx[0] && rx[1] && rx[2] && rx[3]);
    atomic_store(&g_done, 0);
    atomic_store(&g_same_gpu, 0);
    atomic_store(&g_fail_recv_after, -1);
    pd_backend *bs[1] = {pi};
    const pd_kv *kvs[1] = {p.kv};
    pd_kv_route_params rp = {
        .transport = "auto", .device = true, .n_ranks = 1, .backends = bs, .kvs = kvs};
    pd_kv_route *rt;
    ASSERT_OK(pd_kv_route_create(&rp, &rt));
    ASSERT_STR_EQ(pd_kv_route_first(rt), "cuda_ipc");
    const char *want[4] = {"tcp", "nccl", "cuda_ipc", "tcp"};
    const int refusals[4] = {2, 1, 0, 2}; /* IPC and NCCL's link, the first time only */
    pd_kv_send_stats st;
    atomic_bool cancel = true;
    pd_kv_send_req r = req_for("c", &p, 0, pb, 2, rx[3], 0, HEADS);
    r.backend = pi;
    r.n_tokens = 7;
    r.cancel = &cancel;
    ASSERT_OK(pd_kv_rx_expect(rx[3], "c", db, 2, 7));
    ASSERT_ERR(pd_kv_route_send(rt, 0, &r, &st), PD_ECANCELLED, "cancelled");
    ASSERT_STR_EQ(st.transport, "cuda_ipc");
    ASSERT_OK(pd_kv_rx_cancel(rx[3], "c"));
    for (int round = 0, done = 0; round < 2; round++)
        for (int k = 0; k < 4; k++) {
            char id[16];
            snprintf(id, sizeof id, "r%d-%d", round, k);
            ASSERT_OK(pd_kv_rx_expect(rx[k], id, db, 2, 7));
            r = req_for(id, &p, 0, pb, 2, rx[k], 0, HEADS);
            r.backend = pi;
            r.n_tokens = 7;
            ASSERT_OK(pd_kv_route_send(rt, 0, &r, &st));
            ASSERT_STR_EQ(st.transport, want[k]);
            ASSERT(wait_done(++done));
            ASSERT_EQ_INT(mismatches_upto(&d[k], db, 2, 0, 7), 0);
            pd_kv_rx_stats rs;
            pd_kv_rx_get_stats(rx[k], &rs);
            ASSERT_STR_EQ(rs.transport, want[k]);
            ASSERT_EQ_INT(rs.refused, refusals[k]);
        }
    pd_kv_route_free(rt);
    rp.transport = "nccl";
    ASSERT_OK(pd_kv_route_create(&rp, &rt));
    ASSERT_OK(pd_kv_rx_expect(rx[0], "x", db, 2, 7));
    r = req_for("x", &p, 0, pb, 2, rx[0], 0, HEADS);
    r.backend = pi;
    r.n_tokens = 7;
    ASSERT_ERR(pd_kv_route_send(rt, 0, &r, &st), PD_EUNSUPPORTED, "cannot take KV over NCCL");
    ASSERT_STR_EQ(st.transport, "nccl");
    pd_kv_route_free(rt);
    rp.transport = "auto";
    rp.device = false; /* host memory: TCP only */
    ASSERT_OK(pd_kv_route_create(&rp, &rt));
    ASSERT_STR_EQ(pd_kv_route_first(rt), "tcp");
    pd_kv_route_free(rt);
    rp.transport = "cuda_ipc";
    ASSERT_ERR(pd_kv_route_create(&rp, &rt), PD_EINVAL, "--kv-transport cuda_ipc needs --device");
    rp.device = true;
    bs[0] = p.b; /* a CPU backend cannot share its pool */
    ASSERT_ERR(pd_kv_route_create(&rp, &rt), PD_EUNSUPPORTED, "cannot share its KV pool");
    for (int k = 0; k < 4; k++) pd_kv_tcp_receiver_stop(rx[k]);
    pd_backend_free(pl);
    pd_backend_free(pi);
    pd_backend_free(f1);
    pd_backend_free(f2);
    pool_free(&p);
    for (int k = 0; k < 4; k++) pool_free(&d[k]);
}
