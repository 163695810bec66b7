// NCCL in the CUDA backend (see pd_nccl.h): the tensor-parallel all-reduce and the KV links.
//
// Design. Tensor parallelism: ncclCommInitAll over the instance's devices (one process, ranks
// on distinct GPUs), then one grouped warm-up all-reduce from the creating thread so NCCL's
// lazy connection set-up happens at start-up and not inside the first step with a rank missing;
// each rank then calls ncclAllReduce on its own communicator from its own thread, enqueued on its
// step stream (no host synchronization mid-step). These communicators are blocking: a rank that
// fails mid-step makes the backend group call pd_nccl_tp_abort, which ends the others' waits.
//
// KV links: a 2-rank non-blocking communicator (config.blocking = 0) per link, created by
// ncclCommInitRankConfig with the id the prefill side generated (it travels on the KV TCP
// connection, see common/transfer/nccl.c). Every NCCL call on a link is made under the link's mutex, and every
// call that returns ncclInProgress is followed by polling ncclCommGetAsyncError until it leaves
// ncclInProgress (NCCL's rule for non-blocking communicators) before anything else is enqueued
// on the link's stream. Waits (initialization, the enqueue, the completion of a chunk's copies)
// are polling loops bounded by the caller's deadline and check callback; a process-wide watchdog
// thread polls every open link's asynchronous error and the deadline of the operation in flight
// and calls ncclCommAbort on a failed link, so a peer that died (or froze) never wedges a caller:
// its operation fails with the reason, the link stays aborted until closed, the caller drops
// the connection and a new link is made on the next one. Chunks are gathered from the paged
// pool into device staging (and scattered back on the receiver) by the pull kernel of k_kv.cu
// with an identity block list on the staging side, on the link's own stream; staging grows
// with stream-ordered allocations (cudaMallocAsync), never a device-wide synchronizing free.
//
// Several communicators share a device here (the TP one and every KV link of a rank). NCCL does
// not allow issuing operations on different communicators of one device from several threads at
// once, so every issuing call (init, the grouped send/receive, the all-reduce, abort) holds the
// process-wide issue_mu; it covers the enqueue only, never a wait. NCCL also does not promise that
// kernels of different communicators progress side by side on one GPU; any such stall involves a
// KV link (TP communicators are used in lock-step by the rank threads), whose waits are bounded
// by deadlines, so the watchdog aborts the link and the TP kernel proceeds.
#include <nccl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/cuda/cuda_common.cuh"

extern "C" {
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/pd_nccl.h"
#include "util/clock.h"
#include "util/log.h"
}

// A link id: the ncclUniqueId, then the UUID of the GPU that made it (kv_link_local).
static_assert(sizeof(ncclUniqueId) + sizeof(cudaUUID_t) == PD_KV_LINK_ID_BYTES,
              "a link id is an ncclUniqueId and a GPU's UUID");

// Held around every call that issues NCCL work (see the file-top comment); innermost lock.
static pthread_mutex_t issue_mu = PTHREAD_MUTEX_INITIALIZER;

// A pd status naming the failed NCCL call, with NCCL's last message.
static int nccl_status(ncclResult_t r, const char *what, ncclComm_t comm, const char *file,
                       int line)
{
    if (r == ncclSuccess || r == ncclInProgress) return PD_OK;
    const char *last = ncclGetLastError(comm);
    return pd_error(PD_EINTERNAL, "nccl: %s: %s%s%s (%s:%d)", what, ncclGetErrorString(r),
                    last && last[0] ? ": " : "", last ? last : "", file, line);
}

#define NCCL_TRY(expr, comm)                                                                       \
    do {                                                                                           \
        int nccl_try_rc_ = nccl_status((expr), #expr, (comm), __FILE__, __LINE__);                 \
        if (nccl_try_rc_ < 0) return nccl_try_rc_;                                                 \
    } while (0)

static int dtype_of(pd_dtype d, ncclDataType_t *out)
{
    if (d == PD_DTYPE_BF16)
        *out = ncclBfloat16;
    else if (d == PD_DTYPE_F32)
        *out = ncclFloat32;
    else if (d == PD_DTYPE_F16)
        *out = ncclFloat16;
    else
        return pd_error(PD_EUNSUPPORTED, "nccl: activation dtype %s", pd_dtype_name(d));
    return PD_OK;
}

// ==================================================================== tensor parallelism ======

struct pd_nccl_tp {
    int n;
    ncclComm_t *comms;  // (n) rank r's communicator
    pd_backend **ranks; // (n) borrowed
    ncclDataType_t type;
    int aborted; // atomic (__atomic builtins)
};

extern "C" int pd_nccl_multi_rank_gpu(void)
{
    const char *e = getenv("NCCL_MULTI_RANK_GPU_ENABLE");
    int v = 0;
    return e && strcmp(e, "1") == 0 && ncclGetVersion(&v) == ncclSuccess && v >= 23000;
}

extern "C" int pd_nccl_tp_create(pd_backend *const *ranks, int n, pd_nccl_tp **out)
{
    *out = NULL;
    const int shared_ok = pd_nccl_multi_rank_gpu();
    if (n < 2 || n > 64) return pd_error(PD_EINVAL, "nccl all-reduce: %d ranks (2..64)", n);
    int devs[64];
    for (int r = 0; r < n; r++) {
        if (strcmp(pd_backend_name(ranks[r]), "cuda") != 0)
            return pd_error(PD_EUNSUPPORTED, "nccl all-reduce: rank %d runs on the %s backend", r,
                            pd_backend_name(ranks[r]));
        devs[r] = pd_backend_cuda_device(ranks[r]);
        for (int q = 0; q < r; q++)
            if (devs[q] == devs[r] && !shared_ok)
                return pd_error(PD_EUNSUPPORTED,
                                "nccl all-reduce: ranks %d and %d share CUDA device %d (NCCL "
                                "takes one rank per GPU)",
                                q, r, devs[r]);
        if (pd_backend_act_dtype(ranks[r]) != pd_backend_act_dtype(ranks[0]))
            return pd_error(PD_EINVAL, "nccl all-reduce: ranks compute in different dtypes");
    }
    pd_nccl_tp *t = (pd_nccl_tp *)calloc(1, sizeof *t);
    if (!t) return pd_error(PD_ENOMEM, "nccl all-reduce: out of memory");
    t->n = n;
    t->comms = (ncclComm_t *)calloc((size_t)n, sizeof *t->comms);
    t->ranks = (pd_backend **)calloc((size_t)n, sizeof *t->ranks);
    int rc = t->comms && t->ranks ? dtype_of(pd_backend_act_dtype(ranks[0]), &t->type)
                                  : pd_error(PD_ENOMEM, "nccl all-reduce: out of memory");
    if (rc == PD_OK) {
        memcpy(t->ranks, ranks, (size_t)n * sizeof *ranks);
        rc = nccl_status(ncclCommInitAll(t->comms, n, devs), "ncclCommInitAll", NULL, __FILE__,
                         __LINE__);
        if (rc < 0) memset(t->comms, 0, (size_t)n * sizeof *t->comms);
    }
    // Warm-up: one grouped all-reduce of one element on every device from this thread, so the
    // connections exist before the first step.
    float *bufs[64] = {0};
    cudaStream_t streams[64] = {0};
    for (int r = 0; r < n && rc == PD_OK; r++) {
        rc = cuda_status(cudaSetDevice(devs[r]), "cudaSetDevice", __FILE__, __LINE__);
        if (rc == PD_OK)
            rc = cuda_status(cudaMalloc(&bufs[r], sizeof(float)), "cudaMalloc(warm-up)", __FILE__,
                             __LINE__);
        if (rc == PD_OK)
            rc = cuda_status(cudaMemset(bufs[r], 0, sizeof(float)), "cudaMemset", __FILE__,
                             __LINE__);
        if (rc == PD_OK)
            rc = cuda_status(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking),
                             "cudaStreamCreate", __FILE__, __LINE__);
    }
    if (rc == PD_OK) {
        pthread_mutex_lock(&issue_mu);
        rc = nccl_status(ncclGroupStart(), "ncclGroupStart", NULL, __FILE__, __LINE__);
        for (int r = 0; r < n && rc == PD_OK; r++)
            rc = nccl_status(
                ncclAllReduce(bufs[r], bufs[r], 1, ncclFloat32, ncclSum, t->comms[r], streams[r]),
                "ncclAllReduce(warm-up)", t->comms[r], __FILE__, __LINE__);
        int grc = nccl_status(ncclGroupEnd(), "ncclGroupEnd", NULL, __FILE__, __LINE__);
        pthread_mutex_unlock(&issue_mu);
        if (rc == PD_OK) rc = grc;
    }
    for (int r = 0; r < n; r++) {
        cudaSetDevice(devs[r]);
        if (streams[r]) {
            int src = cuda_status(cudaStreamSynchronize(streams[r]), "warm-up all-reduce", __FILE__,
                                  __LINE__);
            if (rc == PD_OK) rc = src;
            cudaStreamDestroy(streams[r]);
        }
        cudaFree(bufs[r]);
    }
    if (rc < 0) {
        pd_nccl_tp_free(t);
        return pd_error_prefix(rc, "tensor parallel over CUDA devices");
    }
    int ver = 0;
    ncclGetVersion(&ver);
    PD_INFO(NULL, "tensor parallel: NCCL %d all-reduce over %d GPUs (in place, %s)", ver, n,
            pd_dtype_name(pd_backend_act_dtype(ranks[0])));
    *out = t;
    return PD_OK;
}

extern "C" int pd_nccl_tp_allreduce(pd_nccl_tp *t, int rank, void *buf, size_t n_elems)
{
    if (rank < 0 || rank >= t->n)
        return pd_error(PD_EINVAL, "nccl all-reduce: rank %d of %d", rank, t->n);
    if (__atomic_load_n(&t->aborted, __ATOMIC_ACQUIRE))
        return pd_error(PD_EINTERNAL, "tensor parallel: the NCCL all-reduce was aborted after a "
                                      "rank failed mid-step; restart the instance");
    if (n_elems == 0) return PD_OK;
    void *stream = NULL;
    PD_CHECK(pd_backend_cuda_step_stream(t->ranks[rank], &stream));
    pthread_mutex_lock(&issue_mu);
    ncclResult_t r =
        ncclAllReduce(buf, buf, n_elems, t->type, ncclSum, t->comms[rank], (cudaStream_t)stream);
    pthread_mutex_unlock(&issue_mu);
    return nccl_status(r, "ncclAllReduce", t->comms[rank], __FILE__, __LINE__);
}

extern "C" void pd_nccl_tp_abort(pd_nccl_tp *t)
{
    if (!t || __atomic_exchange_n(&t->aborted, 1, __ATOMIC_ACQ_REL)) return;
    // Like every framework's watchdog, from another thread than the waiting ranks: NCCL's abort
    // flag makes the kernels in flight return. Without issue_mu: a rank may be stuck inside an
    // issuing call (it then fails with the aborted communicator).
    for (int r = 0; r < t->n; r++)
        if (t->comms[r]) ncclCommAbort(t->comms[r]);
    PD_ERROR(NULL, "tensor parallel: NCCL communicators aborted (a rank failed mid-step)");
}

extern "C" int pd_nccl_tp_aborted(const pd_nccl_tp *t)
{
    return __atomic_load_n(&t->aborted, __ATOMIC_ACQUIRE);
}

extern "C" void pd_nccl_tp_free(pd_nccl_tp *t)
{
    if (!t) return;
    if (!__atomic_load_n(&t->aborted, __ATOMIC_ACQUIRE) && t->comms)
        for (int r = 0; r < t->n; r++) {
            if (!t->comms[r]) continue;
            pd_backend_get_ops(t->ranks[r])->sync(t->ranks[r]); // nothing of ours in flight
            ncclCommDestroy(t->comms[r]);
        }
    free(t->comms);
    free(t->ranks);
    free(t);
}

// ==================================================================== KV links ================

#define WATCHDOG_MS 20 // how often the watchdog looks at every link

struct pd_kv_link {
    struct pd_kv_link *next; // the watchdog's list (links_mu)
    pthread_mutex_t mu;      // every NCCL call on comm; aborted, why, deadline_ns, busy
    ncclComm_t comm;
    int device, rank;
    cudaStream_t stream; // the link's copies and NCCL operations
    cudaEvent_t done;    // recorded after a chunk's operations
    void *staging;       // (staging_cap) bytes, device: one chunk in the chunk layout
    size_t staging_cap;
    int32_t *h_ids; // (2 * ids_cap): pool blocks, then 0..n-1 (the staging's)
    size_t ids_cap;
    int aborted;
    char why[256]; // the abort's reason
    int busy;      // an operation waits on the link: deadline_ns applies
    int64_t deadline_ns;
};

static pthread_mutex_t links_mu = PTHREAD_MUTEX_INITIALIZER;
static pd_kv_link *links;
static int watchdog_running;

// Under l->mu. Aborts the communicator once; later operations fail with why.
static void link_abort(pd_kv_link *l, const char *why)
{
    if (l->aborted) return;
    l->aborted = 1;
    snprintf(l->why, sizeof l->why, "%s", why);
    if (l->comm) {
        pthread_mutex_lock(&issue_mu);
        ncclCommAbort(l->comm);
        pthread_mutex_unlock(&issue_mu);
    }
    PD_WARN(NULL, "kv link (device %d, rank %d) aborted: %s", l->device, l->rank, why);
}

static void *watchdog_main(void *arg)
{
    (void)arg;
    for (;;) {
        struct timespec ts = {0, WATCHDOG_MS * 1000000L};
        nanosleep(&ts, NULL);
        pthread_mutex_lock(&links_mu);
        if (!links) { // nothing to watch: the next open starts a new watchdog
            watchdog_running = 0;
            pthread_mutex_unlock(&links_mu);
            return NULL;
        }
        int64_t now = pd_now_ns();
        for (pd_kv_link *l = links; l; l = l->next) {
            if (pthread_mutex_trylock(&l->mu) != 0) continue; // the owner is in a call: next round
            if (!l->aborted && l->comm) {
                ncclResult_t st = ncclSuccess;
                ncclResult_t r = ncclCommGetAsyncError(l->comm, &st);
                char why[200];
                if (r != ncclSuccess) st = r;
                if (st != ncclSuccess && st != ncclInProgress) {
                    snprintf(why, sizeof why, "asynchronous NCCL error: %s (%s)",
                             ncclGetErrorString(st), ncclGetLastError(l->comm));
                    link_abort(l, why);
                } else if (l->busy && now > l->deadline_ns) {
                    link_abort(l, "the peer did not complete the operation before its deadline "
                                  "(watchdog)");
                }
            }
            pthread_mutex_unlock(&l->mu);
        }
        pthread_mutex_unlock(&links_mu);
    }
}

static int watch(pd_kv_link *l)
{
    pthread_mutex_lock(&links_mu);
    l->next = links;
    links = l;
    int rc = PD_OK;
    if (!watchdog_running) {
        pthread_t th;
        pthread_attr_t at;
        pthread_attr_init(&at);
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&th, &at, watchdog_main, NULL) == 0)
            watchdog_running = 1;
        else
            rc = pd_error(PD_EINTERNAL, "kv link: cannot start the NCCL watchdog thread");
        pthread_attr_destroy(&at);
    }
    if (rc < 0) links = l->next;
    pthread_mutex_unlock(&links_mu);
    return rc;
}

static void unwatch(pd_kv_link *l)
{
    pthread_mutex_lock(&links_mu);
    for (pd_kv_link **pp = &links; *pp; pp = &(*pp)->next)
        if (*pp == l) {
            *pp = l->next;
            break;
        }
    pthread_mutex_unlock(&links_mu);
}

static void pause_us(int64_t us)
{
    struct timespec ts = {0, (long)(us * 1000)};
    nanosleep(&ts, NULL);
}

// Starts a wait bounded by w (watchdog-visible deadline).
static void wait_begin(pd_kv_link *l, const pd_kv_link_wait *w)
{
    pthread_mutex_lock(&l->mu);
    l->busy = 1;
    l->deadline_ns = w->deadline_ns;
    pthread_mutex_unlock(&l->mu);
}

static void wait_end(pd_kv_link *l)
{
    pthread_mutex_lock(&l->mu);
    l->busy = 0;
    pthread_mutex_unlock(&l->mu);
}

// One look at the ways a wait ends early: abort (status set), the check, the deadline.
// Returns PD_OK to keep waiting.
static int wait_step(pd_kv_link *l, const pd_kv_link_wait *w, const char *what)
{
    pthread_mutex_lock(&l->mu);
    int aborted = l->aborted;
    char why[256];
    memcpy(why, l->why, sizeof why);
    pthread_mutex_unlock(&l->mu);
    if (aborted) return pd_error(PD_ECLOSED, "kv link: %s: link aborted: %s", what, why);
    if (w->check) {
        int c = w->check(w->check_arg);
        if (c < 0) {
            char msg[256];
            snprintf(msg, sizeof msg, "%s", pd_last_error());
            pthread_mutex_lock(&l->mu);
            link_abort(l, msg);
            pthread_mutex_unlock(&l->mu);
            return pd_error(c, "kv link: %s: %s", what, msg);
        }
    }
    if (pd_now_ns() > w->deadline_ns) {
        pthread_mutex_lock(&l->mu);
        link_abort(l, "deadline passed");
        pthread_mutex_unlock(&l->mu);
        return pd_error(PD_ETIMEOUT, "kv link: %s timed out", what);
    }
    return PD_OK;
}

// Polls the communicator until it leaves ncclInProgress (after a non-blocking call).
static int settle(pd_kv_link *l, const pd_kv_link_wait *w, const char *what)
{
    int64_t us = 50;
    for (;;) {
        pthread_mutex_lock(&l->mu);
        ncclResult_t st = ncclInProgress;
        int rc = PD_OK;
        if (l->aborted) {
            rc = pd_error(PD_ECLOSED, "kv link: %s: link aborted: %s", what, l->why);
        } else {
            ncclResult_t r = ncclCommGetAsyncError(l->comm, &st);
            if (r != ncclSuccess) st = r;
            if (st != ncclSuccess && st != ncclInProgress) {
                rc = nccl_status(st, what, l->comm, __FILE__, __LINE__);
                link_abort(l, pd_last_error());
            }
        }
        pthread_mutex_unlock(&l->mu);
        if (rc < 0) return rc;
        if (st == ncclSuccess) return PD_OK;
        PD_CHECK(wait_step(l, w, what));
        pause_us(us);
        if (us < 1000) us *= 2;
    }
}

// Waits for the link's event (the chunk's copies) to complete.
static int wait_done(pd_kv_link *l, const pd_kv_link_wait *w, const char *what)
{
    int64_t us = 20;
    for (;;) {
        cudaError_t q = cudaEventQuery(l->done);
        if (q == cudaSuccess) break;
        if (q != cudaErrorNotReady) {
            int rc = cuda_status(q, what, __FILE__, __LINE__);
            pthread_mutex_lock(&l->mu);
            link_abort(l, pd_last_error());
            pthread_mutex_unlock(&l->mu);
            return rc;
        }
        PD_CHECK(wait_step(l, w, what));
        pause_us(us);
        if (us < 1000) us *= 2;
    }
    pthread_mutex_lock(&l->mu); // an error NCCL saw while the copies completed
    int rc = PD_OK;
    if (l->aborted) rc = pd_error(PD_ECLOSED, "kv link: %s: link aborted: %s", what, l->why);
    pthread_mutex_unlock(&l->mu);
    return rc;
}

// The UUID of b's GPU (the same in every process that sees that GPU, whatever its ordinal).
static int device_uuid(pd_backend *b, cudaUUID_t *out)
{
    cudaDeviceProp prop;
    CUDA_TRY(cudaGetDeviceProperties(&prop, pd_backend_cuda_device(b)));
    *out = prop.uuid;
    return PD_OK;
}

extern "C" int pd_nccl_link_id(pd_backend *b, uint8_t id[PD_KV_LINK_ID_BYTES])
{
    CUDA_TRY(cudaSetDevice(pd_backend_cuda_device(b)));
    ncclUniqueId u;
    NCCL_TRY(ncclGetUniqueId(&u), NULL);
    cudaUUID_t dev;
    PD_CHECK(device_uuid(b, &dev));
    memcpy(id, &u, sizeof u);
    memcpy(id + sizeof u, &dev, sizeof dev);
    return PD_OK;
}

extern "C" int pd_nccl_link_local(pd_backend *b, const uint8_t id[PD_KV_LINK_ID_BYTES])
{
    cudaUUID_t dev;
    if (device_uuid(b, &dev) < 0) return 0;
    return memcmp(id + sizeof(ncclUniqueId), &dev, sizeof dev) == 0;
}

static void link_free(pd_kv_link *l)
{
    cudaSetDevice(l->device);
    if (l->stream) {
        if (l->staging) cudaFreeAsync(l->staging, l->stream);
        cudaStreamSynchronize(l->stream); // after an abort the NCCL kernels have returned
        cudaStreamDestroy(l->stream);
    }
    if (l->done) cudaEventDestroy(l->done);
    cudaGetLastError();
    free(l->h_ids);
    pthread_mutex_destroy(&l->mu);
    free(l);
}

extern "C" int pd_nccl_link_open(pd_backend *b, const uint8_t id[PD_KV_LINK_ID_BYTES], int rank,
                                 const pd_kv_link_wait *w, pd_kv_link **out)
{
    *out = NULL;
    if (rank != 0 && rank != 1) return pd_error(PD_EINVAL, "kv link: rank %d (0 or 1)", rank);
    pd_kv_link *l = (pd_kv_link *)calloc(1, sizeof *l);
    if (!l) return pd_error(PD_ENOMEM, "kv link: out of memory");
    pthread_mutex_init(&l->mu, NULL);
    l->device = pd_backend_cuda_device(b);
    l->rank = rank;
    int rc = cuda_status(cudaSetDevice(l->device), "cudaSetDevice", __FILE__, __LINE__);
    if (rc == PD_OK)
        rc = cuda_status(cudaStreamCreateWithFlags(&l->stream, cudaStreamNonBlocking),
                         "cudaStreamCreate", __FILE__, __LINE__);
    if (rc == PD_OK)
        rc = cuda_status(cudaEventCreateWithFlags(&l->done, cudaEventDisableTiming),
                         "cudaEventCreate", __FILE__, __LINE__);
    if (rc < 0) {
        link_free(l);
        return rc;
    }
    ncclUniqueId u;
    memcpy(&u, id, sizeof u);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0; // every call returns at once; waits are ours (settle), bounded by w
    cfg.commName = rank == 0 ? "pd-kv-send" : "pd-kv-recv";
    pthread_mutex_lock(&issue_mu);
    ncclResult_t r = ncclCommInitRankConfig(&l->comm, 2, u, rank, &cfg);
    pthread_mutex_unlock(&issue_mu);
    if (r != ncclSuccess && r != ncclInProgress) {
        rc = nccl_status(r, "ncclCommInitRankConfig", l->comm, __FILE__, __LINE__);
        pthread_mutex_lock(&issue_mu);
        if (l->comm) ncclCommAbort(l->comm);
        pthread_mutex_unlock(&issue_mu);
        l->comm = NULL;
        link_free(l);
        return rc;
    }
    rc = watch(l);
    if (rc == PD_OK) {
        wait_begin(l, w);
        rc = settle(l, w, "joining the link (ncclCommInitRankConfig)");
        wait_end(l);
    }
    if (rc < 0) {
        unwatch(l);
        pthread_mutex_lock(&l->mu);
        link_abort(l, pd_last_error());
        pthread_mutex_unlock(&l->mu);
        link_free(l);
        return rc;
    }
    PD_DEBUG(NULL, "kv link: NCCL communicator up (device %d, rank %d of 2)", l->device, rank);
    *out = l;
    return PD_OK;
}

extern "C" void pd_nccl_link_close(pd_backend *b, pd_kv_link *l)
{
    (void)b;
    if (!l) return;
    unwatch(l);
    pthread_mutex_lock(&l->mu);
    if (!l->aborted && l->comm) { // abort, not destroy: never wait for the peer
        pthread_mutex_lock(&issue_mu);
        ncclCommAbort(l->comm);
        pthread_mutex_unlock(&issue_mu);
        l->aborted = 1;
    }
    pthread_mutex_unlock(&l->mu);
    link_free(l);
}

// The pool side of a transfer: layer x->layer0's K, the layer pitch, the head range.
typedef struct {
    unsigned char *k0; // K of the first layer moved
    size_t half;       // bytes from a layer's K to its V (layers are 2 * half apart)
    size_t tok;        // bytes of one token (all heads) in the pool
    size_t off;        // bytes from a token's start to head x->head0
    size_t row;        // bytes of one token's moved heads
    size_t block_size; // tokens per block
} pool_geom;

// Validates x against kv and fills the block lists (pool blocks, then 0..n-1 for the staging)
// in h_ids, which the pull kernels take as parameters. *chunk_b = bytes of x's layers in the chunk
// layout.
static int xfer_prepare(pd_backend *b, const pd_kv *kv, pd_kv_link *l, const pd_kv_xfer *x,
                        pool_geom *g, size_t *chunk_b)
{
    pd_kv_params kp;
    PD_CHECK(pd_backend_cuda_kv_params(kv, &kp));
    const pd_backend_ops *o = pd_backend_get_ops(b);
    if (x->n_blocks == 0 || x->n_blocks > 0x7fffffff || x->n_tokens == 0 ||
        x->n_tokens > x->n_blocks * kp.block_size ||
        x->n_tokens <= (x->n_blocks - 1) * kp.block_size)
        return pd_error(PD_EINVAL,
                        "kv link: %zu tokens do not end in the last of %zu blocks of %zu",
                        x->n_tokens, x->n_blocks, kp.block_size);
    if (x->n_heads == 0 || x->head0 > kp.n_kv_heads || x->n_heads > kp.n_kv_heads - x->head0)
        return pd_error(PD_EINVAL, "kv link: heads %zu+%zu outside the pool's %zu", x->head0,
                        x->n_heads, kp.n_kv_heads);
    if (x->layer0 < 0 || x->n_layers < 1 || x->layer0 > kp.n_layers - x->n_layers)
        return pd_error(PD_EINVAL, "kv link: layers %d+%d outside the pool's %d", x->layer0,
                        x->n_layers, kp.n_layers);
    for (size_t i = 0; i < x->n_blocks; i++)
        if (x->blocks[i] < 0 || (size_t)x->blocks[i] >= kp.n_blocks)
            return pd_error(PD_EINVAL, "kv link: block %zu is %d, outside the pool of %zu", i,
                            x->blocks[i], kp.n_blocks);
    pd_kv_layer_view v0;
    PD_CHECK(o->kv_layer(b, kv, x->layer0, &v0));
    g->k0 = (unsigned char *)v0.k;
    g->half = (size_t)((const unsigned char *)v0.v - (const unsigned char *)v0.k);
    if (x->n_layers > 1) { // the pull kernel steps layers by 2 * half: check the pool agrees
        pd_kv_layer_view v1;
        PD_CHECK(o->kv_layer(b, kv, x->layer0 + 1, &v1));
        if ((size_t)((const unsigned char *)v1.k - g->k0) != 2 * g->half)
            return pd_error(PD_EINTERNAL, "kv link: the pool's layers are not K, V interleaved");
    }
    g->tok = v0.token_stride;
    g->off = x->head0 * v0.head_stride;
    g->row = x->n_heads * v0.head_stride;
    g->block_size = kp.block_size;
    *chunk_b = 2 * (size_t)x->n_layers * x->n_tokens * g->row;
    if (x->n_blocks > l->ids_cap) {
        int32_t *h = (int32_t *)malloc(2 * x->n_blocks * sizeof *h);
        if (!h) return pd_error(PD_ENOMEM, "kv link: out of memory");
        free(l->h_ids);
        l->h_ids = h;
        l->ids_cap = x->n_blocks;
    }
    memcpy(l->h_ids, x->blocks, x->n_blocks * sizeof(int32_t));
    for (size_t i = 0; i < x->n_blocks; i++) l->h_ids[x->n_blocks + i] = (int32_t)i;
    return PD_OK;
}

// Grows the staging to bytes (stream-ordered: no device-wide synchronization).
static int staging_reserve(pd_kv_link *l, size_t bytes)
{
    if (bytes <= l->staging_cap) return PD_OK;
    void *p = NULL;
    CUDA_TRY(cudaMallocAsync(&p, bytes, l->stream));
    if (l->staging) cudaFreeAsync(l->staging, l->stream);
    l->staging = p;
    l->staging_cap = bytes;
    return PD_OK;
}

// Pull-kernel arguments moving layers [layer_off, layer_off + n) of the transfer (relative to
// x->layer0) between the pool and the staging (chunk layout: the staging is a pool whose block
// list is 0..n_blocks-1 and whose token is the moved heads alone), and the source and
// destination block lists.
static cuda_kv_pull_args chunk_args(const pd_kv_link *l, const pd_kv_xfer *x, const pool_geom *g,
                                    int layer_off, int n, int gather, const int32_t **src_ids,
                                    const int32_t **dst_ids)
{
    cuda_kv_pull_args a;
    memset(&a, 0, sizeof a);
    const unsigned char *pool = g->k0 + (size_t)layer_off * 2 * g->half;
    size_t st_half = x->n_tokens * g->row;
    const int32_t *pool_ids = l->h_ids, *st_ids = l->h_ids + x->n_blocks;
    if (gather) {
        a.src = pool, a.src_half = g->half, a.src_tok = g->tok, a.src_off = g->off;
        a.dst = (unsigned char *)l->staging, a.dst_half = st_half, a.dst_tok = g->row;
        *src_ids = pool_ids, *dst_ids = st_ids;
    } else {
        a.src = (const unsigned char *)l->staging, a.src_half = st_half, a.src_tok = g->row;
        a.dst = (unsigned char *)pool, a.dst_half = g->half, a.dst_tok = g->tok, a.dst_off = g->off;
        *src_ids = st_ids, *dst_ids = pool_ids;
    }
    a.row = g->row;
    a.block_size = g->block_size;
    a.n_tokens = x->n_tokens;
    a.n_layers = n;
    return a;
}

// Under l->mu: fails when the link was aborted.
static int link_usable(pd_kv_link *l, const char *what)
{
    if (l->aborted) return pd_error(PD_ECLOSED, "kv link: %s: link aborted: %s", what, l->why);
    return PD_OK;
}

// Issues one NCCL point-to-point call inside a group and settles it.
static int p2p(pd_kv_link *l, int send, void *buf, size_t bytes, const pd_kv_link_wait *w)
{
    const char *what = send ? "ncclSend" : "ncclRecv";
    pthread_mutex_lock(&l->mu);
    int rc = link_usable(l, what);
    if (rc == PD_OK) {
        pthread_mutex_lock(&issue_mu);
        ncclResult_t r = ncclGroupStart();
        if (r == ncclSuccess)
            r = send ? ncclSend(buf, bytes, ncclUint8, 1 - l->rank, l->comm, l->stream)
                     : ncclRecv(buf, bytes, ncclUint8, 1 - l->rank, l->comm, l->stream);
        ncclResult_t e = ncclGroupEnd();
        pthread_mutex_unlock(&issue_mu);
        if (r == ncclSuccess || r == ncclInProgress) r = e;
        rc = nccl_status(r, what, l->comm, __FILE__, __LINE__);
        if (rc < 0) link_abort(l, pd_last_error());
    }
    pthread_mutex_unlock(&l->mu);
    if (rc < 0) return rc;
    return settle(l, w, what); // before anything else goes on the stream
}

extern "C" int pd_nccl_link_send(pd_backend *b, const pd_kv *kv, pd_kv_link *l, const pd_kv_xfer *x,
                                 int chunk_layers, const pd_kv_link_wait *w)
{
    if (l->rank != 0) return pd_error(PD_EINVAL, "kv link: only rank 0 sends");
    if (chunk_layers < 1) chunk_layers = 1;
    CUDA_TRY(cudaSetDevice(l->device));
    pool_geom g;
    size_t all_b = 0;
    PD_CHECK(xfer_prepare(b, kv, l, x, &g, &all_b));
    int chunk = chunk_layers < x->n_layers ? chunk_layers : x->n_layers;
    size_t layer_b = all_b / (size_t)x->n_layers;
    PD_CHECK(staging_reserve(l, layer_b * (size_t)chunk));
    // Prompt blocks stay leased to this transfer: the step stream never writes them meanwhile,
    // and the prefill step that wrote them completed (its first token was sampled).
    wait_begin(l, w);
    int rc = PD_OK;
    for (int l0 = 0; l0 < x->n_layers && rc == PD_OK; l0 += chunk) {
        int n = x->n_layers - l0 < chunk ? x->n_layers - l0 : chunk;
        const int32_t *src, *dst;
        cuda_kv_pull_args a = chunk_args(l, x, &g, l0, n, 1, &src, &dst);
        // the gather; the send below waits for it (stream order)
        rc = cuda_kv_pull(l->stream, &a, src, dst, x->n_blocks);
        if (rc == PD_OK) rc = p2p(l, 1, l->staging, layer_b * (size_t)n, w);
        // the next gather reuses the staging after this send on the same stream
    }
    if (rc == PD_OK)
        rc =
            cuda_status(cudaEventRecord(l->done, l->stream), "cudaEventRecord", __FILE__, __LINE__);
    if (rc == PD_OK) rc = wait_done(l, w, "sending the KV");
    wait_end(l);
    return rc;
}

extern "C" int pd_nccl_link_recv(pd_backend *b, const pd_kv *kv, pd_kv_link *l, const pd_kv_xfer *x,
                                 const pd_kv_link_wait *w)
{
    (void)b;
    if (l->rank != 1) return pd_error(PD_EINVAL, "kv link: only rank 1 receives");
    CUDA_TRY(cudaSetDevice(l->device));
    pd_kv_params kp;
    PD_CHECK(pd_backend_cuda_kv_params(kv, &kp));
    if (x->n_layers < 1 || x->n_heads == 0 || x->n_tokens == 0)
        return pd_error(PD_EINVAL, "kv link: empty chunk");
    size_t bytes =
        2 * (size_t)x->n_layers * x->n_tokens * x->n_heads * kp.head_dim * pd_dtype_size(kp.dtype);
    PD_CHECK(staging_reserve(l, bytes));
    wait_begin(l, w);
    int rc = p2p(l, 0, l->staging, bytes, w);
    if (rc == PD_OK)
        rc =
            cuda_status(cudaEventRecord(l->done, l->stream), "cudaEventRecord", __FILE__, __LINE__);
    if (rc == PD_OK) rc = wait_done(l, w, "receiving the KV");
    wait_end(l);
    return rc;
}

extern "C" int pd_nccl_link_scatter(pd_backend *b, pd_kv *kv, pd_kv_link *l, const pd_kv_xfer *x)
{
    if (l->rank != 1) return pd_error(PD_EINVAL, "kv link: only rank 1 scatters");
    CUDA_TRY(cudaSetDevice(l->device));
    pool_geom g;
    size_t bytes = 0;
    PD_CHECK(xfer_prepare(b, kv, l, x, &g, &bytes));
    if (bytes > l->staging_cap)
        return pd_error(PD_EINVAL, "kv link: scatter of %zu bytes, %zu received", bytes,
                        l->staging_cap);
    const int32_t *src, *dst;
    cuda_kv_pull_args a = chunk_args(l, x, &g, 0, x->n_layers, 0, &src, &dst);
    PD_CHECK(cuda_kv_pull(l->stream, &a, src, dst, x->n_blocks));
    // no NCCL operation in flight here: a plain synchronization (copies within this GPU)
    CUDA_TRY(cudaStreamSynchronize(l->stream));
    return PD_OK;
}
