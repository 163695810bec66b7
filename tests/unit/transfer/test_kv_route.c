/* Unit test of the route (kv_route.h): --kv-transport's choice per destination over the link
 * and CUDA IPC stand-ins of kv_tcp_stubs.c. */
#include "harness.h"

#include <stdlib.h>

#include "kv_tcp_stubs.h"
#include "transfer/kv_route.h"

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
