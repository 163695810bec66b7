/* Unit tests of the TCP KV transfer between real CPU-backend KV pools on loopback: head and
 * (layer, head) plans, exact moves (only the prompt's tokens; P TP 1 or 2 to D ranks; pipeline
 * stages on either side), refusals, hostile and dead peers, timeouts and cancels. */
#include "harness.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kv_tcp_common.h"
#include "transfer/kv_frames.h"
#include "util/clock.h"

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

/* The (layer, head) plan of a prefill rank and a decode rank: the overlap of both. */
TEST(kv_pipeline_plan)
{
    pd_kv_part out;
    /* P(PP 2) stage 1 (layers 3..4 of 5, all 4 heads) -> D(TP 2) rank 1 (heads 2..3, all) */
    pd_kv_part p = {0, 4, 3, 2}, d = {2, 2, 0, 5};
    ASSERT(pd_kv_plan(&p, &d, &out));
    ASSERT(out.head0 == 2 && out.n_heads == 2 && out.layer0 == 3 && out.n_layers == 2);
    /* P(TP 2) rank 0 (heads 0..1) -> D(PP 2) stage 0 (layers 0..2) */
    p = (pd_kv_part){0, 2, 0, 5}, d = (pd_kv_part){0, 4, 0, 3};
    ASSERT(pd_kv_plan(&p, &d, &out));
    ASSERT(out.head0 == 0 && out.n_heads == 2 && out.layer0 == 0 && out.n_layers == 3);
    /* disjoint layers, disjoint heads: nothing */
    p = (pd_kv_part){0, 4, 3, 2}, d = (pd_kv_part){0, 4, 0, 3};
    ASSERT(!pd_kv_plan(&p, &d, &out));
    p = (pd_kv_part){0, 2, 0, 5}, d = (pd_kv_part){2, 2, 0, 5};
    ASSERT(!pd_kv_plan(&p, &d, &out));
}

/* Pipeline stages on both sides: a prefill instance of two stages (layers 0..1 and 2 of 3)
 * feeds a decode rank holding every layer, and a prefill rank holding every layer feeds a
 * decode instance of two stages (layers 0 and 1..2); each frame names the model's layer, and
 * the receiver completes when its own layers have all come. A layer outside the receiver's
 * stage, or outside the sender's pool, is refused. */
TEST(kv_tcp_pipeline_stages)
{
    pool p0, p1, p, d, d0, d1;
    ASSERT_OK(pool_make_stage(&p0, HEADS, 0, 2));
    ASSERT_OK(pool_make_stage(&p1, HEADS, 2, 1));
    ASSERT_OK(pool_make(&p, HEADS));
    ASSERT_OK(pool_make(&d, HEADS));
    ASSERT_OK(pool_make_stage(&d0, HEADS, 0, 1));
    ASSERT_OK(pool_make_stage(&d1, HEADS, 1, 2));
    int32_t pb[2] = {5, 6}, db[2] = {1, 2};
    ASSERT_OK(fill(&p0, pb, 2, 0));
    ASSERT_OK(fill(&p1, pb, 2, 0));
    ASSERT_OK(fill(&p, pb, 2, 0));
    pd_kv_tcp_receiver *rx = rx_start(&d, 0), *rx0 = rx_start(&d0, 0), *rx1 = rx_start(&d1, 0);
    ASSERT(rx && rx0 && rx1);
    atomic_store(&g_done, 0);
    pd_kv_tcp_sender *tx;
    ASSERT_OK(pd_kv_tcp_sender_create(&tx));
    /* P(PP 2) -> D(PP 1) */
    ASSERT_OK(pd_kv_rx_expect(rx, "a", db, 2, 0));
    pd_kv_send_req r0 = req_for("a", &p0, 0, pb, 2, rx, 0, HEADS);
    pd_kv_send_stats st;
    ASSERT_OK(pd_kv_tcp_send(tx, &r0, &st));
    ASSERT_EQ_INT(st.frames, 2);
    pd_sleep_ns(20 * PD_NS_PER_MS);
    ASSERT_EQ_INT(atomic_load(&g_done), 0); /* layer 2 has not come yet */
    pd_kv_send_req r1 = req_for("a", &p1, 0, pb, 2, rx, 0, HEADS);
    ASSERT_OK(pd_kv_tcp_send(tx, &r1, &st));
    ASSERT_EQ_INT(st.frames, 1);
    ASSERT(wait_done(1));
    ASSERT_EQ_INT(atomic_load(&g_done_status), 0);
    ASSERT_EQ_INT(mismatches(&d, db, 2, 0), 0);
    /* P(PP 1) -> D(PP 2): each stage gets the overlap of the layers */
    ASSERT_OK(pd_kv_rx_expect(rx0, "b", db, 2, 0));
    ASSERT_OK(pd_kv_rx_expect(rx1, "b", db, 2, 0));
    pd_kv_send_req s0 = req_for("b", &p, 0, pb, 2, rx0, 0, HEADS);
    s0.send_layer0 = 0, s0.send_layers = 1;
    pd_kv_send_req s1 = req_for("b", &p, 0, pb, 2, rx1, 0, HEADS);
    s1.send_layer0 = 1, s1.send_layers = 2;
    ASSERT_OK(pd_kv_tcp_send(tx, &s0, NULL));
    ASSERT_OK(pd_kv_tcp_send(tx, &s1, NULL));
    ASSERT(wait_done(3));
    ASSERT_EQ_INT(atomic_load(&g_done_status), 0);
    ASSERT_EQ_INT(mismatches(&d0, db, 2, 0), 0);
    ASSERT_EQ_INT(mismatches(&d1, db, 2, 0), 0);
    /* the wrong stage: layer 2 to a rank holding layer 0 only; layers the pool lacks */
    ASSERT_OK(pd_kv_rx_expect(rx0, "c", db, 2, 0));
    pd_kv_send_req w = req_for("c", &p1, 0, pb, 2, rx0, 0, HEADS);
    ASSERT_ERR(pd_kv_tcp_send(tx, &w, NULL), PD_EINVAL, "layer 2 outside this rank's 0..0");
    w.send_layer0 = 0, w.send_layers = 1;
    ASSERT_ERR(pd_kv_tcp_send(tx, &w, NULL), PD_EINVAL,
               "layers [0, +1) outside the pool's [2, +1)");
    pd_kv_tcp_sender_free(tx);
    pd_kv_tcp_receiver_stop(rx);
    pd_kv_tcp_receiver_stop(rx0);
    pd_kv_tcp_receiver_stop(rx1);
    pool *all[] = {&p0, &p1, &p, &d, &d0, &d1};
    for (size_t i = 0; i < 6; i++) pool_free(all[i]);
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
