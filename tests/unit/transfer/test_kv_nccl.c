/* Unit tests of the NCCL KV protocol of nccl.c (link set-up frame, request frame, chunks,
 * drains, refusals) on the CPU, over the host link stand-in of kv_tcp_stubs.c. */
#include "harness.h"

#include "kv_tcp_stubs.h"
#include "transfer/kv_frames.h"
#include "util/clock.h"

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
