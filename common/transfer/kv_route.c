/* The table of KV transports and --kv-transport's choice among them (see kv_route.h): which
 * transport carries a send, and auto's fallback chain, in one place.
 *
 * Design: the table's order is auto's order, and a transport says itself what a refusal looks
 * like (pd_kv_xport.refused), so the chain is a walk down the table that skips what a
 * destination refused before; a new transport is one more entry here. The route sets every
 * transport up once per rank at start-up (a share of the pool for CUDA IPC), so a rank that
 * cannot use one is told before the first request, not during it.
 */
#include "transfer/kv_route.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "transfer/kv_xport.h"
#include "util/log.h"
#include "util/status.h"

#define REFUSED_MAX 32 /* destinations remembered per transport */

/* Every transport, in the order --kv-transport auto tries them. */
const pd_kv_xport *const kv_xports[] = {&kv_xport_cuda_ipc, &kv_xport_nccl, &kv_xport_tcp};
const size_t kv_n_xports = sizeof kv_xports / sizeof kv_xports[0];
_Static_assert(sizeof kv_xports / sizeof kv_xports[0] <= KV_XPORT_MAX, "KV_XPORT_MAX");

size_t kv_xport_slot(const pd_kv_xport *x)
{
    for (size_t i = 0; i < kv_n_xports; i++)
        if (kv_xports[i] == x) return i;
    abort(); /* a transport missing from the table: a bug */
}

const pd_kv_xport *kv_xport_by_name(const char *name)
{
    for (size_t i = 0; i < kv_n_xports; i++)
        if (strcmp(kv_xports[i]->name, name) == 0) return kv_xports[i];
    return NULL;
}

const pd_kv_xport *kv_xport_of_frame(uint16_t flags)
{
    const pd_kv_xport *plain = NULL;
    for (size_t i = 0; i < kv_n_xports; i++) {
        if (kv_xports[i]->rx_flags & flags) return kv_xports[i];
        if (!kv_xports[i]->rx_flags) plain = kv_xports[i];
    }
    return plain;
}

/* ---- the plan of a send ---- */

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

bool pd_kv_plan(const pd_kv_part *p, const pd_kv_part *d, pd_kv_part *send)
{
    pd_kv_head_overlap(p->head0, p->n_heads, d->head0, d->n_heads, &send->head0, &send->n_heads);
    pd_kv_head_overlap(p->layer0, p->n_layers, d->layer0, d->n_layers, &send->layer0,
                       &send->n_layers);
    return send->n_heads > 0 && send->n_layers > 0;
}

/* ---- the route ---- */

/* Destinations ("host:port") that refused one transport. */
typedef struct {
    char addr[REFUSED_MAX][300];
    int n;
} addr_set;

struct pd_kv_route {
    pd_kv_tcp_sender *tx;
    bool fallback; /* auto on device memory: a destination that refuses a transport gets the
                      next one of the chain */
    const pd_kv_xport *chain[KV_XPORT_MAX]; /* what sends try, in order; the last never refuses */
    size_t n_chain;
    int n_ranks;
    void **args;        /* (n_chain, n_ranks) what each transport's tx_setup made for a rank */
    pthread_mutex_t mu; /* refused */
    addr_set refused[KV_XPORT_MAX]; /* per chain entry */
};

int pd_kv_route_check(const char *transport, bool device)
{
    if (strcmp(transport, "auto") == 0) return PD_OK;
    const pd_kv_xport *x = kv_xport_by_name(transport);
    if (!x) {
        char names[200] = "auto";
        for (size_t i = 0; i < kv_n_xports; i++)
            snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s",
                     i + 1 < kv_n_xports ? ", " : " or ", kv_xports[i]->name);
        return pd_error(PD_EINVAL, "--kv-transport: expected %s, got '%s'", names, transport);
    }
    if (x->device_only && !device)
        return pd_error(PD_EINVAL, "--kv-transport %s needs --device cuda (%s)", x->name,
                        x->device_only);
    return PD_OK;
}

static void release_ranks(const pd_kv_xport *x, void **args, int n_ranks)
{
    for (int r = 0; r < n_ranks; r++)
        if (args[r]) x->tx_release(args[r]);
    memset(args, 0, (size_t)n_ranks * sizeof *args);
}

/* Sets x up for every rank into args (n_ranks); nothing is kept when a rank cannot. */
static int setup_ranks(const pd_kv_route_params *p, const pd_kv_xport *x, void **args)
{
    for (int r = 0; r < p->n_ranks; r++) {
        int rc = x->tx_check ? x->tx_check(p->backends[r]) : PD_OK;
        if (rc == PD_OK && x->tx_setup) rc = x->tx_setup(p->backends[r], p->kvs[r], &args[r]);
        if (rc < 0) {
            release_ranks(x, args, p->n_ranks);
            return pd_error_prefix(rc, "--kv-transport %s (rank %d)", p->transport, r);
        }
    }
    return PD_OK;
}

/* "NCCL, else TCP": the chain from entry i on, for log lines. */
static void describe(const pd_kv_route *rt, size_t i, char *buf, size_t n)
{
    buf[0] = '\0';
    for (; i < rt->n_chain; i++)
        snprintf(buf + strlen(buf), n - strlen(buf), "%s%s", buf[0] ? ", else " : "",
                 rt->chain[i]->title);
}

int pd_kv_route_create(const pd_kv_route_params *p, pd_kv_route **out)
{
    PD_CHECK(pd_kv_route_check(p->transport, p->device));
    pd_kv_route *rt = calloc(1, sizeof *rt);
    if (rt) rt->args = calloc(KV_XPORT_MAX * (size_t)p->n_ranks, sizeof *rt->args);
    if (!rt || !rt->args) {
        if (rt) free(rt->args);
        free(rt);
        return pd_error(PD_ENOMEM, "out of memory");
    }
    pthread_mutex_init(&rt->mu, NULL);
    rt->n_ranks = p->n_ranks;
    bool automatic = strcmp(p->transport, "auto") == 0;
    rt->fallback = automatic && p->device;
    int rc = pd_kv_tcp_sender_create(&rt->tx);
    for (size_t i = 0; rc == PD_OK && i < kv_n_xports; i++) {
        const pd_kv_xport *x = kv_xports[i];
        bool wanted = rt->fallback ? true
                      : automatic  ? !x->device_only /* auto on host memory */
                                   : strcmp(x->name, p->transport) == 0;
        if (!wanted) continue;
        void **args = rt->args + rt->n_chain * (size_t)p->n_ranks;
        rc = setup_ranks(p, x, args);
        /* auto goes on without a transport a destination could refuse too (one with a next
           one; the last resort has nothing to set up) */
        if (rc < 0 && rt->fallback && x->refused) {
            PD_WARN(NULL, "%s; KV moves without %s", pd_last_error(), x->title);
            rc = PD_OK;
            continue;
        }
        rt->chain[rt->n_chain++] = x;
    }
    if (rc < 0) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", pd_last_error());
        pd_kv_route_free(rt);
        return pd_error(rc, "%s", msg);
    }
    if (rt->chain[0]->device_only) {
        char how[160];
        describe(rt, 0, how, sizeof how);
        PD_INFO(NULL, "KV transport: %s%s", how,
                rt->fallback ? ", per decode rank by what it accepts" : "");
    }
    *out = rt;
    return PD_OK;
}

void pd_kv_route_free(pd_kv_route *rt)
{
    if (!rt) return;
    pd_kv_tcp_sender_free(rt->tx);
    for (size_t i = 0; i < rt->n_chain; i++)
        if (rt->chain[i]->tx_release)
            release_ranks(rt->chain[i], rt->args + i * (size_t)rt->n_ranks, rt->n_ranks);
    free(rt->args);
    pthread_mutex_destroy(&rt->mu);
    free(rt);
}

const char *pd_kv_route_first(const pd_kv_route *rt)
{
    return rt->chain[0]->name;
}

/* Whether addr has refused chain entry i before; remember = mark it so. */
static bool refused(pd_kv_route *rt, size_t i, const char *addr, bool remember)
{
    addr_set *s = &rt->refused[i];
    pthread_mutex_lock(&rt->mu);
    bool found = false;
    for (int k = 0; k < s->n && !found; k++) found = strcmp(s->addr[k], addr) == 0;
    if (!found && remember && s->n < REFUSED_MAX) snprintf(s->addr[s->n++], 300, "%s", addr);
    pthread_mutex_unlock(&rt->mu);
    return found;
}

/* The first chain entry from i on that addr has not refused (the last one when all have). */
static size_t next_for(pd_kv_route *rt, size_t i, const char *addr)
{
    while (rt->fallback && i + 1 < rt->n_chain && refused(rt, i, addr, false)) i++;
    return i;
}

int pd_kv_route_send(pd_kv_route *rt, int rank, const pd_kv_send_req *req, pd_kv_send_stats *stats)
{
    pd_kv_send_req r = *req;
    r.share = NULL;
    r.nccl = 0;
    r.nccl_distinct_gpus = rt->fallback; /* auto leaves NCCL to processes on GPUs of their own */
    char addr[300];
    snprintf(addr, sizeof addr, "%s:%d", r.host, r.port);
    pd_kv_send_stats st;
    size_t i = next_for(rt, 0, addr);
    for (;;) {
        const pd_kv_xport *x = rt->chain[i];
        int rc = kv_send(rt->tx, x, rt->args[i * (size_t)rt->n_ranks + (size_t)rank], &r, &st);
        bool refusal = rc < 0 && rc != PD_ECANCELLED && rt->fallback && i + 1 < rt->n_chain &&
                       x->refused && x->refused(rc, &st);
        if (!refusal) {
            if (stats) *stats = st;
            return rc;
        }
        refused(rt, i, addr, true);
        i = next_for(rt, i + 1, addr);
        char how[160];
        describe(rt, i, how, sizeof how);
        PD_INFO(r.request_id, "%s; KV to %s moves over %s from now on", pd_last_error(), addr, how);
    }
}
