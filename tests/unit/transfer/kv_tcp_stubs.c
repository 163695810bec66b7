/* Host-memory stand-ins for the backend ops that only GPUs have (declared in kv_tcp_stubs.h),
 * so that the NCCL protocol and the route run on the CPU. The NCCL protocol of nccl.c (link
 * set-up frame, request frame, chunks, drains, refusals) goes through a stand-in for the
 * backend's link ops: a backend that wraps a CPU backend's state with the CPU op table plus
 * kv_link_* ops moving chunks through an in-process channel keyed by the link id, one chunk in
 * flight (like NCCL's matched send and receive). The real NCCL ops (pd_nccl.cu) run only on
 * GPUs (tests/gpu). For --kv-transport's choice, next to the link ops, a CUDA IPC stand-in whose
 * share's handle holds the sender's pool (both ends live in this process) and whose kv_pull
 * copies through kv_export and kv_import. */
#include "kv_tcp_stubs.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "util/clock.h"
#include "util/status.h"

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
atomic_int g_link_opens, g_fail_recv_after = -1, g_recvs;

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

atomic_int g_same_gpu;

static int fake_link_local(pd_backend *b, const uint8_t id[PD_KV_LINK_ID_BYTES])
{
    (void)b, (void)id;
    return atomic_load(&g_same_gpu);
}

pd_backend_ops g_fake_ops;

pd_backend *fake_linked(pool *p)
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

typedef struct {
    pd_backend *b;
    const pd_kv *kv;
} fake_pool;

struct pd_kv_peer { /* the test's mapped pool */
    fake_pool src;
};

int fake_kv_share(pd_backend *b, const pd_kv *kv, pd_kv_share *out)
{
    fake_pool src = {b, kv};
    memset(out, 0, sizeof *out);
    memcpy(out->handle, &src, sizeof src);
    out->id = (uint64_t)(uintptr_t)kv;
    return PD_OK;
}

int fake_peer_open(pd_backend *b, const pd_kv *kv, const pd_kv_share *s, pd_kv_peer **out)
{
    (void)b, (void)kv;
    if (!(*out = malloc(sizeof **out))) return pd_error(PD_ENOMEM, "fake peer: memory");
    memcpy(&(*out)->src, s->handle, sizeof(*out)->src);
    return PD_OK;
}

void fake_peer_close(pd_backend *b, pd_kv_peer *peer)
{
    (void)b;
    free(peer);
}

int fake_pull(pd_backend *b, pd_kv *kv, pd_kv_peer *peer, const pd_kv_pull *pl)
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
