// The CUDA backend's KV pool (cuda_be.cuh): one allocation per pool, its copies to and from
// host memory (kv_export / kv_import), and CUDA IPC: a pool shared with another process on the
// same host (kv_share), mapped there (kv_peer_open) and pulled from device to device (kv_pull).
//
// Design: KV transfers run on a second stream of the backend's own (xfer_stream) under a mutex
// (xfer_mu), so the transfer threads of a node never touch the step's stream or its graph state,
// and each is complete on return. A peer pool is mapped once per (device, pool) in the process,
// however many opens (CUDA maps a handle once per context), and reference counted.
#include <cuda.h> // CUresult, CUdeviceptr: cuMemGetAddressRange through the runtime's entry point
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/cuda/cuda_be.cuh"

// ---- KV pool ------------------------------------------------------------------------------------

static uint64_t random_id(void);

int op_kv_create(pd_backend *b, const pd_kv_params *p, pd_kv **out)
{
    cuda_be *cb = BE(b);
    PD_CHECK(graph_flush(cb));
    ENTER(cb);
    *out = NULL;
    if (p->n_layers < 1 || p->n_blocks < 1 || p->block_size < 1 || p->n_kv_heads < 1 ||
        p->head_dim < 1)
        return pd_error(PD_EINVAL,
                        "cuda kv pool: layers %d, blocks %zu, block_size %zu, kv heads %zu, "
                        "head_dim %zu must all be >= 1",
                        p->n_layers, p->n_blocks, p->block_size, p->n_kv_heads, p->head_dim);
    if ((int)p->dtype != cb->act)
        return pd_error(PD_EUNSUPPORTED,
                        "cuda kv pool: dtype %s is not supported (the activation dtype %s only)",
                        pd_dtype_name(p->dtype), pd_dtype_name((pd_dtype)cb->act));
    if (p->head_dim > CUDA_ATTN_MAX_D)
        return pd_error(PD_EUNSUPPORTED, "cuda kv pool: head_dim %zu is over %d", p->head_dim,
                        CUDA_ATTN_MAX_D);
    size_t tok = p->n_kv_heads * p->head_dim * cb->act_size;
    if (p->n_blocks > SIZE_MAX / p->block_size / tok / 2 / (size_t)p->n_layers)
        return pd_error(PD_EINVAL, "cuda kv pool: size overflows");
    pd_kv *kv = (pd_kv *)calloc(1, sizeof *kv);
    if (!kv) return pd_error(PD_ENOMEM, "cuda kv pool: out of host memory");
    kv->p = *p;
    kv->elem = cb->act_size;
    kv->share_id = random_id();
    kv->half_bytes = p->n_blocks * p->block_size * tok;
    size_t total = kv->half_bytes * 2 * (size_t)p->n_layers;
    cudaError_t e = cudaMalloc(&kv->base, total);
    if (e != cudaSuccess) {
        cudaGetLastError();
        free(kv);
        return pd_error(e == cudaErrorMemoryAllocation ? PD_ENOMEM : PD_EINTERNAL,
                        "cuda kv pool: %zu bytes (%zu blocks): %s", total, p->n_blocks,
                        cudaGetErrorString(e));
    }
    e = cudaMemsetAsync(kv->base, 0, total, cb->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(cb->stream);
    if (e != cudaSuccess) {
        int rc = cuda_status(e, "cudaMemset(kv pool)", __FILE__, __LINE__);
        cudaFree(kv->base);
        free(kv);
        return rc;
    }
    *out = kv;
    return PD_OK;
}

void op_kv_free(pd_backend *b, pd_kv *kv)
{
    if (!kv) return;
    cuda_be *cb = BE(b);
    graph_flush(cb);
    cudaSetDevice(cb->device);
    if (cb->checked_kv == kv) cb->checked_kv = NULL;
    cudaFree(kv->base);
    free(kv);
}

int op_kv_layer(pd_backend *b, const pd_kv *kv, int layer, pd_kv_layer_view *out)
{
    (void)b;
    if (layer < 0 || layer >= kv->p.n_layers)
        return pd_error(PD_EINVAL, "cuda kv pool: layer %d out of range [0, %d)", layer,
                        kv->p.n_layers);
    out->k = kv_k(kv, layer);
    out->v = kv_v(kv, layer);
    out->head_stride = kv->p.head_dim * kv->elem;
    out->token_stride = kv->p.n_kv_heads * out->head_stride;
    out->block_stride = kv->p.block_size * out->token_stride;
    out->dtype = kv->p.dtype;
    out->host_visible = 0;
    return PD_OK;
}

static int kv_range_check(const pd_kv *kv, const pd_kv_range *r, const char *what)
{
    if (r->layer < 0 || r->layer >= kv->p.n_layers)
        return pd_error(PD_EINVAL, "cuda %s: layer %d out of range [0, %d)", what, r->layer,
                        kv->p.n_layers);
    if (r->n_heads == 0 || r->head0 > kv->p.n_kv_heads || r->n_heads > kv->p.n_kv_heads - r->head0)
        return pd_error(PD_EINVAL, "cuda %s: heads [%zu, +%zu) out of range [0, %zu)", what,
                        r->head0, r->n_heads, kv->p.n_kv_heads);
    if (r->n_blocks && !r->block_ids)
        return pd_error(PD_EINVAL, "cuda %s: block_ids is NULL", what);
    for (size_t i = 0; i < r->n_blocks; i++)
        if (r->block_ids[i] < 0 || (size_t)r->block_ids[i] >= kv->p.n_blocks)
            return pd_error(PD_EINVAL, "cuda %s: block_ids[%zu] = %d out of range [0, %zu)", what,
                            i, r->block_ids[i], kv->p.n_blocks);
    return PD_OK;
}

// Copies the range between the pool and host (to_host: export). Runs of consecutive blocks with
// all heads are one contiguous copy; otherwise one 2-D copy per block (a head sub-range is a
// strided slice of every token).
static int kv_copy(cudaStream_t st, const pd_kv *kv, const pd_kv_range *r, unsigned char *host,
                   int to_host)
{
    const pd_kv_params *p = &kv->p;
    size_t head_b = p->head_dim * kv->elem, tok_b = p->n_kv_heads * head_b;
    size_t blk_b = p->block_size * tok_b;
    size_t hrow_b = r->n_heads * head_b;    // bytes of one token in the host layout
    size_t hblk_b = p->block_size * hrow_b; // bytes of one block in the host layout
    int full = r->n_heads == p->n_kv_heads;
    cudaMemcpyKind kind = to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
    for (int which = 0; which < 2; which++) {
        unsigned char *dev = (unsigned char *)(which ? kv_v(kv, r->layer) : kv_k(kv, r->layer));
        unsigned char *hbase = host + (size_t)which * r->n_blocks * hblk_b;
        for (size_t i = 0; i < r->n_blocks;) {
            size_t run = 1;
            if (full)
                while (i + run < r->n_blocks && r->block_ids[i + run] == r->block_ids[i] + (int)run)
                    run++;
            unsigned char *d = dev + (size_t)r->block_ids[i] * blk_b + r->head0 * head_b;
            unsigned char *h = hbase + i * hblk_b;
            if (full) {
                if (to_host)
                    CUDA_TRY(cudaMemcpyAsync(h, d, run * blk_b, kind, st));
                else
                    CUDA_TRY(cudaMemcpyAsync(d, h, run * blk_b, kind, st));
            } else if (to_host) {
                CUDA_TRY(cudaMemcpy2DAsync(h, hrow_b, d, tok_b, hrow_b, p->block_size, kind, st));
            } else {
                CUDA_TRY(cudaMemcpy2DAsync(d, tok_b, h, hrow_b, hrow_b, p->block_size, kind, st));
            }
            i += run;
        }
    }
    CUDA_TRY(cudaStreamSynchronize(st));
    return PD_OK;
}

// The transfer ops below hold xfer_mu and use xfer_stream: see the file-top comment.
int op_kv_export(pd_backend *b, const pd_kv *kv, const pd_kv_range *r, void *host)
{
    cuda_be *cb = BE(b);
    PD_CHECK(kv_range_check(kv, r, "kv_export"));
    pthread_mutex_lock(&cb->xfer_mu);
    int rc = cuda_status(cudaSetDevice(cb->device), "cudaSetDevice", __FILE__, __LINE__);
    if (rc == PD_OK) rc = kv_copy(cb->xfer_stream, kv, r, (unsigned char *)host, 1);
    pthread_mutex_unlock(&cb->xfer_mu);
    return rc;
}

int op_kv_import(pd_backend *b, pd_kv *kv, const pd_kv_range *r, const void *host)
{
    cuda_be *cb = BE(b);
    PD_CHECK(kv_range_check(kv, r, "kv_import"));
    pthread_mutex_lock(&cb->xfer_mu);
    int rc = cuda_status(cudaSetDevice(cb->device), "cudaSetDevice", __FILE__, __LINE__);
    if (rc == PD_OK) rc = kv_copy(cb->xfer_stream, kv, r, (unsigned char *)host, 0);
    pthread_mutex_unlock(&cb->xfer_mu);
    return rc;
}

// Pinned staging for kv_export / kv_import callers; portable, so any device's copies use it
// as pinned memory.
int op_host_alloc(pd_backend *b, size_t bytes, void **out)
{
    ENTER(BE(b));
    cudaError_t e = cudaHostAlloc(out, bytes ? bytes : 1, cudaHostAllocPortable);
    if (e == cudaSuccess) return PD_OK;
    *out = NULL;
    return cuda_status(e, "cudaHostAlloc(staging)", __FILE__, __LINE__);
}

void op_host_free(pd_backend *b, void *p)
{
    (void)b;
    cudaFreeHost(p);
    cudaGetLastError();
}

// ---- KV between processes (CUDA IPC) ------------------------------------------------------------

static pthread_mutex_t peers_mu = PTHREAD_MUTEX_INITIALIZER;
static pd_kv_peer *peers; // every mapped peer pool of this process

static uint64_t random_id(void)
{
    uint64_t v = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (read(fd, &v, sizeof v) != (ssize_t)sizeof v) v = 0;
        close(fd);
    }
    static uint64_t counter;
    return v ^ ((uint64_t)getpid() << 32) ^ __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED);
}

int op_kv_share(pd_backend *b, const pd_kv *kv, pd_kv_share *out)
{
    cuda_be *cb = BE(b);
    ENTER(cb);
    memset(out, 0, sizeof *out);
    cudaIpcMemHandle_t h;
    CUDA_TRY(cudaIpcGetMemHandle(&h, kv->base));
    static_assert(sizeof h == PD_KV_SHARE_HANDLE_BYTES, "cudaIpcMemHandle_t is 64 bytes");
    memcpy(out->handle, &h, sizeof h);
    out->id = kv->share_id;
    out->p = kv->p;
    return PD_OK;
}

// Bytes of the allocation that ptr lies in, from the driver's cuMemGetAddressRange (the runtime
// has no call for it; its entry point is looked up once, so libcuda need not be linked): 0 when
// it cannot be told.
typedef CUresult (*mem_range_fn)(CUdeviceptr *, size_t *, CUdeviceptr);
static mem_range_fn mem_range;
static pthread_once_t mem_range_once = PTHREAD_ONCE_INIT;

static void mem_range_init(void)
{
    cudaDriverEntryPointQueryResult q;
    void *fn = NULL;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                         &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
        mem_range = (mem_range_fn)fn;
    cudaGetLastError();
}

static size_t mapping_bytes(void *ptr)
{
    pthread_once(&mem_range_once, mem_range_init);
    CUdeviceptr base = 0;
    size_t bytes = 0;
    if (!mem_range || mem_range(&base, &bytes, (CUdeviceptr)ptr) != CUDA_SUCCESS) return 0;
    return bytes - (size_t)((CUdeviceptr)ptr - base);
}

int op_kv_peer_open(pd_backend *b, const pd_kv *kv, const pd_kv_share *s, pd_kv_peer **out)
{
    cuda_be *cb = BE(b);
    *out = NULL;
    const pd_kv_params *sp = &s->p;
    if (sp->n_layers != kv->p.n_layers || sp->head_dim != kv->p.head_dim ||
        sp->dtype != kv->p.dtype || sp->block_size != kv->p.block_size || sp->n_blocks < 1 ||
        sp->n_kv_heads < 1)
        return pd_error(PD_EINVAL,
                        "cuda kv peer: its pool (%d layers, block %zu, %zu heads x %zu, %s) does "
                        "not match this one (%d layers, block %zu, head_dim %zu, %s)",
                        sp->n_layers, sp->block_size, sp->n_kv_heads, sp->head_dim,
                        pd_dtype_name(sp->dtype), kv->p.n_layers, kv->p.block_size, kv->p.head_dim,
                        pd_dtype_name(kv->p.dtype));
    size_t tok = sp->n_kv_heads * sp->head_dim * kv->elem;
    if (sp->n_blocks > SIZE_MAX / sp->block_size / tok / 2 / (size_t)sp->n_layers)
        return pd_error(PD_EINVAL, "cuda kv peer: pool of %zu blocks overflows", sp->n_blocks);
    ENTER(cb);
    pthread_mutex_lock(&peers_mu);
    pd_kv_peer *p = peers;
    while (p && !(p->device == cb->device && p->id == s->id)) p = p->next;
    int rc = PD_OK;
    if (p) {
        p->refs++;
    } else if (!(p = (pd_kv_peer *)calloc(1, sizeof *p))) {
        rc = pd_error(PD_ENOMEM, "cuda kv peer: out of host memory");
    } else {
        cudaIpcMemHandle_t h;
        memcpy(&h, s->handle, sizeof h);
        cudaError_t e = cudaIpcOpenMemHandle(&p->base, h, cudaIpcMemLazyEnablePeerAccess);
        // the pool the frame describes must lie inside the mapping: the pull reads all of it
        size_t need = 2 * (size_t)sp->n_layers * sp->n_blocks * sp->block_size * tok,
               have = e == cudaSuccess ? mapping_bytes(p->base) : 0;
        if (e != cudaSuccess) {
            cudaGetLastError();
            free(p);
            p = NULL;
            rc = pd_error(PD_EUNSUPPORTED,
                          "cuda kv peer: cannot map the peer's KV pool on device %d: %s (another "
                          "host, another container without --ipc=host, or no peer access)",
                          cb->device, cudaGetErrorString(e));
        } else if (have && have < need) {
            cudaIpcCloseMemHandle(p->base);
            cudaGetLastError();
            free(p);
            p = NULL;
            rc = pd_error(PD_EINVAL,
                          "cuda kv peer: its pool of %zu blocks takes %zu bytes, but the mapped "
                          "allocation holds %zu",
                          sp->n_blocks, need, have);
        } else {
            p->device = cb->device;
            p->id = s->id;
            p->p = *sp;
            p->half_bytes = sp->n_blocks * sp->block_size * tok;
            p->refs = 1;
            p->next = peers;
            peers = p;
        }
    }
    pthread_mutex_unlock(&peers_mu);
    *out = p;
    return rc;
}

void op_kv_peer_close(pd_backend *b, pd_kv_peer *peer)
{
    if (!peer) return;
    pthread_mutex_lock(&peers_mu);
    if (--peer->refs == 0) {
        pd_kv_peer **pp = &peers;
        while (*pp != peer) pp = &(*pp)->next;
        *pp = peer->next;
        cudaSetDevice(BE(b)->device);
        cudaIpcCloseMemHandle(peer->base);
        cudaGetLastError();
        free(peer);
    }
    pthread_mutex_unlock(&peers_mu);
}

static int pull_check(const char *side, const int32_t *ids, size_t n, size_t pool_blocks,
                      size_t head0, size_t n_heads, size_t pool_heads)
{
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || (size_t)ids[i] >= pool_blocks)
            return pd_error(PD_EINVAL, "cuda kv_pull: %s block %zu is %d, outside the pool of %zu",
                            side, i, ids[i], pool_blocks);
    if (n_heads == 0 || head0 > pool_heads || n_heads > pool_heads - head0)
        return pd_error(PD_EINVAL, "cuda kv_pull: %s heads %zu+%zu outside the pool's %zu", side,
                        head0, n_heads, pool_heads);
    return PD_OK;
}

int op_kv_pull(pd_backend *b, pd_kv *kv, pd_kv_peer *peer, const pd_kv_pull *pl)
{
    cuda_be *cb = BE(b);
    size_t bs = kv->p.block_size;
    if (pl->n_blocks == 0 || pl->n_tokens == 0 || pl->n_tokens > pl->n_blocks * bs ||
        pl->n_blocks > INT_MAX)
        return pd_error(PD_EINVAL, "cuda kv_pull: %zu tokens in %zu blocks of %zu", pl->n_tokens,
                        pl->n_blocks, bs);
    PD_CHECK(pull_check("source", pl->src_blocks, pl->n_blocks, peer->p.n_blocks, pl->src_head0,
                        pl->n_heads, peer->p.n_kv_heads));
    PD_CHECK(pull_check("destination", pl->dst_blocks, pl->n_blocks, kv->p.n_blocks, pl->dst_head0,
                        pl->n_heads, kv->p.n_kv_heads));
    size_t head_b = kv->p.head_dim * kv->elem;
    cuda_kv_pull_args a;
    a.src = (const unsigned char *)peer->base;
    a.dst = (unsigned char *)kv->base;
    a.src_half = peer->half_bytes;
    a.dst_half = kv->half_bytes;
    a.src_tok = peer->p.n_kv_heads * head_b;
    a.dst_tok = kv->p.n_kv_heads * head_b;
    a.src_off = pl->src_head0 * head_b;
    a.dst_off = pl->dst_head0 * head_b;
    a.row = pl->n_heads * head_b;
    a.block_size = bs;
    a.n_tokens = pl->n_tokens;
    a.n_layers = kv->p.n_layers;
    pthread_mutex_lock(&cb->xfer_mu);
    int rc = cuda_status(cudaSetDevice(cb->device), "cudaSetDevice", __FILE__, __LINE__);
    const bool timed = cb->pull_ev[0] != NULL;
    if (rc == PD_OK && timed)
        rc = cuda_status(cudaEventRecord(cb->pull_ev[0], cb->xfer_stream), "cudaEventRecord",
                         __FILE__, __LINE__);
    if (rc == PD_OK)
        rc = cuda_kv_pull(cb->xfer_stream, &a, pl->src_blocks, pl->dst_blocks, pl->n_blocks);
    if (rc == PD_OK && timed)
        rc = cuda_status(cudaEventRecord(cb->pull_ev[1], cb->xfer_stream), "cudaEventRecord",
                         __FILE__, __LINE__);
    if (rc == PD_OK)
        rc = cuda_status(cudaStreamSynchronize(cb->xfer_stream), "cudaStreamSynchronize(pull)",
                         __FILE__, __LINE__);
    float ms = 0.0f;
    if (rc == PD_OK && timed)
        rc = cuda_status(cudaEventElapsedTime(&ms, cb->pull_ev[0], cb->pull_ev[1]),
                         "cudaEventElapsedTime(pull)", __FILE__, __LINE__);
    if (rc == PD_OK && timed) {
        cb->pull_sum += ms / 1e3;
        if (cb->pull_n++ == 0 || ms / 1e3 < cb->pull_min) cb->pull_min = ms / 1e3;
    }
    pthread_mutex_unlock(&cb->xfer_mu);
    return rc;
}
