// The CUDA backend's operation table (see cuda_backend.h): memory, weights, the KV pool, step
// planning, cuBLAS matrix products, and the calls into the kernel launchers of k_*.cu.
//
// Design: one stream and one cuBLAS handle per instance; everything an op needs on the device
// is allocated at create (step metadata buffers sized from the params, the GEMM and download
// workspaces, the attention split workspace) or at load (weights, KV pool), so no op allocates.
// plan() packs the step's host arrays into one pinned staging buffer and issues a single
// host-to-device copy; the host copy stays readable for validation until the next plan, which
// first waits on an event recorded after the last copy out of the staging buffers. Attention's
// work list depends on the head layout, so it is built on the host at the step's first
// attention call and copied with the first attention launch. Matrix products take our GEMV for
// n <= 8 rows (decode) and cuBLAS GemmEx (f32 accumulation) otherwise. Repeated decode-only
// steps are captured into CUDA graphs and replayed (see "graphs" below). KV transfers
// (kv_export/kv_import/kv_pull) run on a second stream of their own under a mutex, so the
// transfer threads of a node never touch the step's stream or its graph state (see "KV pool").
#include <cublas_v2.h>
#include <cuda.h> // CUresult, CUdeviceptr: cuMemGetAddressRange through the runtime's entry point
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/cuda/cuda_common.cuh"

extern "C" {
#include "backend/backend.h"
#include "util/log.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/pd_nccl.h"
}

// ---- error helpers ------------------------------------------------------------------------------

static const char *cublas_status_str(cublasStatus_t s)
{
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED: return "alloc failed";
    case CUBLAS_STATUS_INVALID_VALUE: return "invalid value";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "arch mismatch";
    case CUBLAS_STATUS_MAPPING_ERROR: return "mapping error";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "execution failed";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "internal error";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "not supported";
    default: return "unknown status";
    }
}

#define CUBLAS_TRY(expr)                                                                           \
    do {                                                                                           \
        cublasStatus_t cb_st_ = (expr);                                                            \
        if (cb_st_ != CUBLAS_STATUS_SUCCESS)                                                       \
            return pd_error(cb_st_ == CUBLAS_STATUS_ALLOC_FAILED ? PD_ENOMEM : PD_EINTERNAL,       \
                            "cublas: %s: %s (%d) (%s:%d)", #expr, cublas_status_str(cb_st_),       \
                            (int)cb_st_, __FILE__, __LINE__);                                      \
    } while (0)

// ---- structs ------------------------------------------------------------------------------------

struct pd_weight {
    pd_dtype dtype;    // matrices: the backend's weight dtype; vectors (1-D tensors): F32
    size_t rows, cols; // a 1-D tensor is (1, n)
    int is_vector;
    void *data; // (rows, cols) in dtype, device
    size_t nbytes;
};

struct pd_kv {
    pd_kv_params p;
    void *base;        // (n_layers, 2 (K, V), n_blocks, block_size, n_kv_heads, head_dim) in
                       // the activation dtype
    size_t elem;       // bytes per element
    size_t half_bytes; // bytes of one layer's K (or V)
    uint64_t share_id; // random: names this pool to other processes (kv_share)
};

// Another process's pool mapped with cudaIpcOpenMemHandle. One mapping per (device, pool) in
// the process, however many opens (CUDA maps a handle once per context); kept in a list.
struct pd_kv_peer {
    struct pd_kv_peer *next;
    int device;
    uint64_t id;
    pd_kv_params p;
    void *base;
    size_t half_bytes;
    int refs;
};

enum { G_EAGER = 0, G_RECORD = 1, G_REPLAY = 2 };
enum {
    T_EMBED,
    T_RMSNORM,
    T_MATMUL,
    T_ROPE,
    T_KV_WRITE,
    T_ATTENTION,
    T_SWIGLU,
    T_ADD,
    T_GATHER,
    T_DOWNLOAD,
    T_MATMUL_MULTI,
    T_ROPE_KV_WRITE,
    T_ADD_RMSNORM,
    T_MATMUL_SWIGLU,
    T_QKV_ROPE_KV_WRITE
};

#define PRE_P (2 + 3 * PD_MATMUL_MULTI_MAX) // a norm_* op's norm: add, x_out, w, h (eps in f)
typedef struct {
    int op;
    // matmul_multi: x, then w, bias, y of each; qkv_rope_kv_write: the same, then the pool;
    // the norm_* ops' norm from PRE_P on
    const void *p[PRE_P + 4];
    size_t z[3];
    float f;
} tape_ent;

typedef struct graph_slot {
    int used;
    size_t n_tokens, n_out, rope_dim; // the key (decode steps: n_seqs == n_tokens)
    cudaGraphExec_t exec;             // NULL until recorded
    tape_ent *tape;
    size_t len;
    uint64_t last_use;
} graph_slot;

#define GRAPH_SLOTS 8 // step shapes with a cached graph (least recently used replaced)

#define MM_WS_BYTES     ((size_t)64 << 20) // f32/f16 input conversion + f32 GEMM output chunks
#define DL_WS_ELEMS     ((size_t)4 << 20)  // download_f32 chunk (f32 elements)
#define PART_BYTES      ((size_t)32 << 20) // attention split partials (f32 o + lse)
#define MAX_PARTS       4096               // attention split parts per step
#define SPLIT_MIN       CUDA_ATTN_KT       // shortest KV range worth its own split: one tile
#define CUBLAS_WS_BYTES ((size_t)32 << 20)

typedef struct {
    int device;
    int sm_count;
    pd_backend_params params;
    pd_dtype wdtype;
    int act; // activation dtype: ACT_BF16, or ACT_F32 when weights are f32 (precision mode)
    size_t act_size;
    cudaStream_t stream;
    cublasHandle_t cublas;
    void *cublas_ws;

    // Step staging: pinned host + device, same packed layout, stage_cap bytes each.
    unsigned char *h_stage, *d_stage;
    size_t stage_cap;
    cudaEvent_t stage_done; // recorded after the last copy out of the pinned buffers
    int stage_pending;

    // The planned step: host views (into h_stage) and device pointers (into d_stage).
    int planned;
    size_t n_tokens, n_seqs, n_out, rope_dim, n_block_ids;
    const int32_t *h_tokens, *h_positions, *h_q_indptr, *h_kv_len, *h_block_indptr, *h_block_ids,
        *h_out_rows;
    const int64_t *h_slots;
    const int32_t *d_tokens, *d_positions, *d_block_indptr, *d_block_ids, *d_out_rows;
    const int64_t *d_slots;
    const float *d_cos, *d_sin;
    const pd_kv *checked_kv; // pool this step was validated against (NULL: none yet)

    // Attention work list for the planned step.
    int attn_built, attn_nqh, attn_nkvh, attn_hd, attn_tc_ok;
    cuda_attn_item *h_items, *d_items;    // (items_cap) pinned / device: CUDA-core items, then
                                          // tensor-core items
    cuda_attn_merge *h_merges, *d_merges; // (max_tokens)
    size_t items_cap, n_items, n_tc_items, n_merges;
    int hpi, tc_hpi;
    float *part_ws; // PART_BYTES: part_o then part_lse

    // Attention work-list upload state and graph-step capacities (see attn_build).
    int attn_fixed, attn_uploaded;
    size_t g_items_cap, g_merges_cap;
    int32_t *h_counts, *d_counts; // (4) pinned / device: {CUDA-core items, merges}

    // CUDA graphs for repeated decode steps (see "graphs" below).
    int graphs_on;
    int attn_tc_wmma; // PD_CUDA_ATTN_TC=wmma: the older tensor-core prefill attention kernel
    int unfused;      // PD_CUDA_FUSED=0: the fused ops issue the plain ops they stand for
    int pdl;          // programmatic dependent launch for this backend's kernels (cuda_pdl)
    int gmode;        // G_EAGER / G_RECORD / G_REPLAY for the current step
    graph_slot graphs[GRAPH_SLOTS];
    graph_slot *gcur; // slot being recorded / replayed
    size_t gpos;      // replay position in gcur->tape
    tape_ent *rec;    // (TAPE_CAP) tape being recorded
    size_t rec_len;
    uint64_t gtick;

    void *mm_ws;  // MM_WS_BYTES
    float *dl_ws; // (DL_WS_ELEMS) f32 (bf16 mode only)

    // KV transfers: their own stream, one at a time (xfer_mu), any thread.
    pthread_mutex_t xfer_mu;
    cudaStream_t xfer_stream;
    cudaEvent_t pull_ev[2];    // pull timing (pd_backend_cuda_pull_timing; NULL: off)
    double pull_sum, pull_min; // device seconds of the timed pulls: sum, best
    uint64_t pull_n;

    size_t free_at_create; // device memory free before this backend allocated anything
} cuda_be;

static cuda_be *BE(pd_backend *b)
{
    return (cuda_be *)pd_backend_impl(b);
}

static void graph_slot_clear(graph_slot *g)
{
    if (g->exec) cudaGraphExecDestroy(g->exec);
    free(g->tape);
    memset(g, 0, sizeof *g);
}

static int graph_flush(cuda_be *cb);
static int graph_plan(cuda_be *cb);
static int graph_finish(cuda_be *cb, const tape_ent *e);
static tape_ent ent(int op);

// Makes the backend's device current on the calling thread. Done by create, plan, memory and
// KV ops; the kernel ops of a step rely on the plan that preceded them (same thread), which
// keeps the per-op launch cost at the kernel launch itself.
#define ENTER(cb) CUDA_TRY(cudaSetDevice((cb)->device))

// ---- lifetime -----------------------------------------------------------------------------------

static void be_free_state(cuda_be *cb)
{
    if (!cb) return;
    cudaSetDevice(cb->device);
    if (cb->gmode == G_RECORD) { // a step abandoned during capture: drop the capture
        cudaGraph_t g = NULL;
        cudaStreamEndCapture(cb->stream, &g);
        if (g) cudaGraphDestroy(g);
        cudaGetLastError();
    }
    free(cb->rec);
    for (int i = 0; i < GRAPH_SLOTS; i++) graph_slot_clear(&cb->graphs[i]);
    if (cb->stream) cudaStreamSynchronize(cb->stream);
    cudaFreeHost(cb->h_counts);
    cudaFree(cb->d_counts);
    if (cb->cublas) cublasDestroy(cb->cublas);
    cudaFree(cb->cublas_ws);
    cudaFreeHost(cb->h_stage);
    cudaFree(cb->d_stage);
    cudaFreeHost(cb->h_items);
    cudaFree(cb->d_items);
    cudaFreeHost(cb->h_merges);
    cudaFree(cb->d_merges);
    cudaFree(cb->part_ws);
    cudaFree(cb->mm_ws);
    cudaFree(cb->dl_ws);
    if (cb->stage_done) cudaEventDestroy(cb->stage_done);
    if (cb->stream) cudaStreamDestroy(cb->stream);
    if (cb->xfer_stream) cudaStreamDestroy(cb->xfer_stream);
    for (int i = 0; i < 2; i++)
        if (cb->pull_ev[i]) cudaEventDestroy(cb->pull_ev[i]);
    pthread_mutex_destroy(&cb->xfer_mu);
    free(cb);
}

static void op_destroy(pd_backend *b)
{
    be_free_state(BE(b));
}

static pd_dtype op_act_dtype(const pd_backend *b)
{
    return (pd_dtype)((const cuda_be *)pd_backend_impl(b))->act;
}

static size_t align64(size_t x)
{
    return (x + 63) & ~(size_t)63;
}

// Bytes of the packed step staging for the capacities in p.
static size_t stage_bytes(const pd_backend_params *p)
{
    size_t t = p->max_tokens, s = p->max_seqs;
    size_t half = p->max_rope_dim / 2;
    return align64(t * 4) + align64(t * 4) + align64(t * 8) + 2 * align64(t * half * 4) +
           align64((s + 1) * 4) + align64(s * 4) + align64((s + 1) * 4) +
           align64(p->max_blocks * 4) + align64(t * 4) + 64;
}

static int be_init(cuda_be *cb)
{
    CUDA_TRY(cudaSetDevice(cb->device));
    size_t total_b = 0;
    CUDA_TRY(cudaMemGetInfo(&cb->free_at_create, &total_b));
    cudaDeviceProp prop;
    CUDA_TRY(cudaGetDeviceProperties(&prop, cb->device));
    cb->sm_count = prop.multiProcessorCount;
    CUDA_TRY(cudaStreamCreateWithFlags(&cb->stream, cudaStreamNonBlocking));
    CUDA_TRY(cudaStreamCreateWithFlags(&cb->xfer_stream, cudaStreamNonBlocking));
    CUDA_TRY(cudaEventCreateWithFlags(&cb->stage_done, cudaEventDisableTiming));
    CUBLAS_TRY(cublasCreate(&cb->cublas));
    CUBLAS_TRY(cublasSetStream(cb->cublas, cb->stream));
    CUDA_TRY(cudaMalloc(&cb->cublas_ws, CUBLAS_WS_BYTES));
    CUBLAS_TRY(cublasSetWorkspace(cb->cublas, cb->cublas_ws, CUBLAS_WS_BYTES));
    // Tensor-core math for bf16/f16; f32 weights keep full f32 GEMMs (CUBLAS_COMPUTE_32F).
    CUBLAS_TRY(cublasSetMathMode(cb->cublas, CUBLAS_DEFAULT_MATH));

    cb->stage_cap = stage_bytes(&cb->params);
    CUDA_TRY(cudaMallocHost(&cb->h_stage, cb->stage_cap));
    CUDA_TRY(cudaMalloc(&cb->d_stage, cb->stage_cap));
    cb->items_cap = 2 * (cb->params.max_tokens + MAX_PARTS); // halves: CUDA-core, tensor-core
    CUDA_TRY(cudaMallocHost(&cb->h_items, cb->items_cap * sizeof(cuda_attn_item)));
    CUDA_TRY(cudaMalloc(&cb->d_items, cb->items_cap * sizeof(cuda_attn_item)));
    CUDA_TRY(cudaMallocHost(&cb->h_merges, cb->params.max_tokens * sizeof(cuda_attn_merge)));
    CUDA_TRY(cudaMalloc(&cb->d_merges, cb->params.max_tokens * sizeof(cuda_attn_merge)));
    CUDA_TRY(cudaMalloc(&cb->part_ws, PART_BYTES));
    CUDA_TRY(cudaMalloc(&cb->mm_ws, MM_WS_BYTES));
    CUDA_TRY(cudaMalloc(&cb->dl_ws, DL_WS_ELEMS * sizeof(float)));
    CUDA_TRY(cudaMallocHost(&cb->h_counts, 4 * sizeof(int32_t)));
    CUDA_TRY(cudaMalloc(&cb->d_counts, 4 * sizeof(int32_t)));
    const char *g = getenv("PD_CUDA_GRAPHS");
    cb->graphs_on = !(g && strcmp(g, "0") == 0) && !cb->params.no_graphs;
    const char *tc = getenv("PD_CUDA_ATTN_TC");
    cb->attn_tc_wmma = tc && strcmp(tc, "wmma") == 0;
    const char *fu = getenv("PD_CUDA_FUSED");
    cb->unfused = fu && strcmp(fu, "0") == 0;
    PD_CHECK(cuda_pdl_allowed(prop.major, &cb->pdl));
    __atomic_store_n(&cuda_pdl, cb->pdl, __ATOMIC_RELAXED);
    PD_CHECK(cuda_attention_init());
    return PD_OK;
}

// ---- memory -------------------------------------------------------------------------------------

static int op_buf_alloc(pd_backend *b, size_t bytes, void **out)
{
    cuda_be *cb = BE(b);
    PD_CHECK(graph_flush(cb));
    ENTER(cb);
    *out = NULL;
    cudaError_t e = cudaMalloc(out, bytes ? bytes : 64);
    if (e != cudaSuccess) {
        cudaGetLastError();
        *out = NULL;
        return pd_error(e == cudaErrorMemoryAllocation ? PD_ENOMEM : PD_EINTERNAL,
                        "cuda: buffer of %zu bytes: %s", bytes, cudaGetErrorString(e));
    }
    return PD_OK;
}

static void op_buf_free(pd_backend *b, void *buf)
{
    if (!buf) return;
    graph_flush(BE(b)); // errors surface at the next op
    cudaSetDevice(BE(b)->device);
    cudaFree(buf);
}

static int op_upload(pd_backend *b, void *dst_dev, const void *src_host, size_t bytes)
{
    cuda_be *cb = BE(b);
    PD_CHECK(graph_flush(cb));
    ENTER(cb);
    if (bytes == 0) return PD_OK;
    CUDA_TRY(cudaMemcpyAsync(dst_dev, src_host, bytes, cudaMemcpyHostToDevice, cb->stream));
    return PD_OK;
}

static int op_download(pd_backend *b, void *dst_host, const void *src_dev, size_t bytes)
{
    cuda_be *cb = BE(b);
    PD_CHECK(graph_flush(cb));
    ENTER(cb);
    if (bytes == 0) return PD_OK;
    CUDA_TRY(cudaMemcpyAsync(dst_host, src_dev, bytes, cudaMemcpyDeviceToHost, cb->stream));
    return PD_OK;
}

static int op_download_f32(pd_backend *b, float *dst_host, const void *src_dev, size_t n)
{
    cuda_be *cb = BE(b);
    if (cb->gmode != G_EAGER && n <= DL_WS_ELEMS) {
        // end of a graph step: device part (bf16 -> f32) in the graph, host copy after it
        tape_ent e = ent(T_DOWNLOAD);
        e.p[0] = src_dev;
        e.z[0] = n;
        PD_CHECK(graph_finish(cb, &e));
        const void *src = cb->act == ACT_F32 ? src_dev : (const void *)cb->dl_ws;
        if (n)
            CUDA_TRY(cudaMemcpyAsync(dst_host, src, n * sizeof(float), cudaMemcpyDeviceToHost,
                                     cb->stream));
        CUDA_TRY(cudaEventRecord(cb->stage_done, cb->stream)); // the graph read the staging
        cb->stage_pending = 1;
        return PD_OK;
    }
    PD_CHECK(graph_flush(cb));
    ENTER(cb);
    if (cb->act == ACT_F32) {
        if (n)
            CUDA_TRY(cudaMemcpyAsync(dst_host, src_dev, n * sizeof(float), cudaMemcpyDeviceToHost,
                                     cb->stream));
        return PD_OK;
    }
    const bf16 *src = (const bf16 *)src_dev;
    for (size_t i = 0; i < n; i += DL_WS_ELEMS) {
        size_t c = n - i < DL_WS_ELEMS ? n - i : DL_WS_ELEMS;
        PD_CHECK(cuda_act_convert(cb->stream, ACT_BF16, src + i, c, ACT_F32, cb->dl_ws));
        CUDA_TRY(cudaMemcpyAsync(dst_host + i, cb->dl_ws, c * sizeof(float), cudaMemcpyDeviceToHost,
                                 cb->stream));
    }
    return PD_OK;
}

static int op_upload_f32(pd_backend *b, void *dst_dev, const float *src_host, size_t n)
{
    cuda_be *cb = BE(b);
    PD_CHECK(graph_flush(cb));
    ENTER(cb);
    if (cb->act == ACT_F32) {
        if (n)
            CUDA_TRY(cudaMemcpyAsync(dst_dev, src_host, n * sizeof(float), cudaMemcpyHostToDevice,
                                     cb->stream));
        return PD_OK;
    }
    bf16 *dst = (bf16 *)dst_dev;
    for (size_t i = 0; i < n; i += DL_WS_ELEMS) { // through dl_ws, converted on the device
        size_t c = n - i < DL_WS_ELEMS ? n - i : DL_WS_ELEMS;
        CUDA_TRY(cudaMemcpyAsync(cb->dl_ws, src_host + i, c * sizeof(float), cudaMemcpyHostToDevice,
                                 cb->stream));
        PD_CHECK(cuda_act_convert(cb->stream, ACT_F32, cb->dl_ws, c, ACT_BF16, dst + i));
    }
    return PD_OK;
}

static int op_sync(pd_backend *b)
{
    cuda_be *cb = BE(b);
    PD_CHECK(graph_flush(cb));
    ENTER(cb);
    CUDA_TRY(cudaStreamSynchronize(cb->stream));
    CUDA_TRY(cudaGetLastError());
    return PD_OK;
}

// ---- weights ------------------------------------------------------------------------------------

static int op_weight_load(pd_backend *b, const pd_tensor *t, const pd_weight_slice *sl,
                          pd_weight **out)
{
    cuda_be *cb = BE(b);
    PD_CHECK(graph_flush(cb));
    ENTER(cb);
    *out = NULL;
    const char *name = t && t->name ? t->name : "(unnamed)";
    if (!t || !t->data || (t->ndim != 1 && t->ndim != 2))
        return pd_error(PD_EINVAL, "cuda weight_load: tensor '%s' must be 1-D or 2-D with data",
                        name);
    size_t R = t->ndim == 2 ? (size_t)t->shape[0] : 1;
    size_t C = t->ndim == 2 ? (size_t)t->shape[1] : (size_t)t->shape[0];
    pd_weight_slice all = {0, 0, 0, 0};
    if (!sl) sl = &all;
    size_t nr = sl->nrows ? sl->nrows : R - (sl->row0 < R ? sl->row0 : R);
    size_t nc = sl->ncols ? sl->ncols : C - (sl->col0 < C ? sl->col0 : C);
    if (sl->row0 > R || nr > R - sl->row0 || sl->col0 > C || nc > C - sl->col0 || nr == 0 ||
        nc == 0)
        return pd_error(PD_EINVAL,
                        "cuda weight_load: tensor '%s' (%zu, %zu): slice rows [%zu, +%zu) cols "
                        "[%zu, +%zu) is out of range",
                        name, R, C, sl->row0, sl->nrows, sl->col0, sl->ncols);
    pd_weight *w = (pd_weight *)calloc(1, sizeof *w);
    if (!w) return pd_error(PD_ENOMEM, "cuda weight_load: out of host memory");
    w->is_vector = t->ndim == 1;
    w->dtype = w->is_vector ? PD_DTYPE_F32 : cb->wdtype;
    w->rows = nr;
    w->cols = nc;
    size_t de = pd_dtype_size(w->dtype), se = pd_dtype_size(t->dtype);
    w->nbytes = nr * nc * de;
    cudaError_t e = cudaMalloc(&w->data, w->nbytes);
    if (e != cudaSuccess) {
        cudaGetLastError();
        free(w);
        return pd_error(e == cudaErrorMemoryAllocation ? PD_ENOMEM : PD_EINTERNAL,
                        "cuda weight_load: tensor '%s': %zu bytes: %s", name, nr * nc * de,
                        cudaGetErrorString(e));
    }
    // Convert on the host in chunks of rows, then copy each chunk.
    size_t row_bytes = nc * de;
    size_t chunk_rows = ((size_t)16 << 20) / row_bytes;
    if (chunk_rows < 1) chunk_rows = 1;
    if (chunk_rows > nr) chunk_rows = nr;
    unsigned char *hbuf = (unsigned char *)malloc(chunk_rows * row_bytes);
    float *tmp = (float *)malloc(nc * sizeof(float));
    int rc = PD_OK;
    if (!hbuf || !tmp) {
        rc = pd_error(PD_ENOMEM, "cuda weight_load: out of host memory");
        goto fail;
    }
    for (size_t r0 = 0; r0 < nr; r0 += chunk_rows) {
        size_t cr = nr - r0 < chunk_rows ? nr - r0 : chunk_rows;
        for (size_t r = 0; r < cr; r++) {
            const unsigned char *src =
                (const unsigned char *)t->data + ((sl->row0 + r0 + r) * C + sl->col0) * se;
            unsigned char *dst = hbuf + r * row_bytes;
            if (t->dtype == w->dtype) {
                memcpy(dst, src, row_bytes);
            } else {
                pd_to_f32_n(t->dtype, src, tmp, nc);
                pd_from_f32_n(w->dtype, tmp, dst, nc);
            }
        }
        e = cudaMemcpy((unsigned char *)w->data + r0 * row_bytes, hbuf, cr * row_bytes,
                       cudaMemcpyHostToDevice);
        if (e != cudaSuccess) {
            rc = cuda_status(e, "cudaMemcpy(weight)", __FILE__, __LINE__);
            goto fail;
        }
    }
    free(hbuf);
    free(tmp);
    *out = w;
    return PD_OK;
fail:
    free(hbuf);
    free(tmp);
    cudaFree(w->data);
    free(w);
    return rc;
}

static void op_weight_free(pd_backend *b, pd_weight *w)
{
    if (!w) return;
    graph_flush(BE(b));
    cudaSetDevice(BE(b)->device);
    cudaFree(w->data);
    free(w);
}

static size_t op_weight_nbytes(const pd_backend *b, const pd_weight *w)
{
    (void)b;
    return w ? w->nbytes : 0;
}

// ---- KV pool ------------------------------------------------------------------------------------

static uint64_t random_id(void);

static int op_kv_create(pd_backend *b, const pd_kv_params *p, pd_kv **out)
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

static void op_kv_free(pd_backend *b, pd_kv *kv)
{
    if (!kv) return;
    cuda_be *cb = BE(b);
    graph_flush(cb);
    cudaSetDevice(cb->device);
    if (cb->checked_kv == kv) cb->checked_kv = NULL;
    cudaFree(kv->base);
    free(kv);
}

static void *kv_k(const pd_kv *kv, int layer)
{
    return (unsigned char *)kv->base + (size_t)layer * 2 * kv->half_bytes;
}

static void *kv_v(const pd_kv *kv, int layer)
{
    return (unsigned char *)kv->base + ((size_t)layer * 2 + 1) * kv->half_bytes;
}

static int op_kv_layer(pd_backend *b, const pd_kv *kv, int layer, pd_kv_layer_view *out)
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
static int op_kv_export(pd_backend *b, const pd_kv *kv, const pd_kv_range *r, void *host)
{
    cuda_be *cb = BE(b);
    PD_CHECK(kv_range_check(kv, r, "kv_export"));
    pthread_mutex_lock(&cb->xfer_mu);
    int rc = cuda_status(cudaSetDevice(cb->device), "cudaSetDevice", __FILE__, __LINE__);
    if (rc == PD_OK) rc = kv_copy(cb->xfer_stream, kv, r, (unsigned char *)host, 1);
    pthread_mutex_unlock(&cb->xfer_mu);
    return rc;
}

static int op_kv_import(pd_backend *b, pd_kv *kv, const pd_kv_range *r, const void *host)
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
static int op_host_alloc(pd_backend *b, size_t bytes, void **out)
{
    ENTER(BE(b));
    cudaError_t e = cudaHostAlloc(out, bytes ? bytes : 1, cudaHostAllocPortable);
    if (e == cudaSuccess) return PD_OK;
    *out = NULL;
    return cuda_status(e, "cudaHostAlloc(staging)", __FILE__, __LINE__);
}

static void op_host_free(pd_backend *b, void *p)
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

static int op_kv_share(pd_backend *b, const pd_kv *kv, pd_kv_share *out)
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

static int op_kv_peer_open(pd_backend *b, const pd_kv *kv, const pd_kv_share *s, pd_kv_peer **out)
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

static void op_kv_peer_close(pd_backend *b, pd_kv_peer *peer)
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

static int op_kv_pull(pd_backend *b, pd_kv *kv, pd_kv_peer *peer, const pd_kv_pull *pl)
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

// ---- plan ---------------------------------------------------------------------------------------

// Waits until the pinned staging buffers are no longer read by an in-flight copy.
static int stage_wait(cuda_be *cb)
{
    if (!cb->stage_pending) return PD_OK;
    CUDA_TRY(cudaEventSynchronize(cb->stage_done));
    cb->stage_pending = 0;
    return PD_OK;
}

// The same refusals as the CPU backend (ERANGE for capacities and ranges, EINVAL for missing
// or malformed arrays), plus increasing positions within a sequence and non-negative token ids.
static int plan_check(const cuda_be *cb, const pd_batch *bt)
{
    const pd_backend_params *p = &cb->params;
    size_t n = bt->n_tokens, ns = bt->n_seqs;
    if (n == 0 || n > p->max_tokens)
        return pd_error(PD_ERANGE, "cuda plan: n_tokens %zu outside [1, %zu]", n, p->max_tokens);
    if (ns == 0 || ns > p->max_seqs)
        return pd_error(PD_ERANGE, "cuda plan: n_seqs %zu outside [1, %zu]", ns, p->max_seqs);
    if (bt->rope_dim == 0 || bt->rope_dim % 2 || bt->rope_dim > p->max_rope_dim)
        return pd_error(PD_ERANGE, "cuda plan: rope_dim %zu must be even and in [2, %zu]",
                        bt->rope_dim, p->max_rope_dim);
    if (!bt->token_ids || !bt->positions || !bt->slots || !bt->rope_cos || !bt->rope_sin ||
        !bt->q_indptr || !bt->kv_len || !bt->block_indptr || (bt->n_out && !bt->out_rows))
        return pd_error(PD_EINVAL, "cuda plan: a required array is NULL");
    if (bt->q_indptr[0] != 0 || (size_t)bt->q_indptr[ns] != n)
        return pd_error(PD_EINVAL, "cuda plan: q_indptr must start at 0 and end at n_tokens (%zu)",
                        n);
    if (bt->block_indptr[0] != 0)
        return pd_error(PD_EINVAL, "cuda plan: block_indptr[0] must be 0");
    for (size_t s = 0; s < ns; s++) {
        if (bt->q_indptr[s + 1] < bt->q_indptr[s])
            return pd_error(PD_EINVAL, "cuda plan: q_indptr decreases at sequence %zu", s);
        if (bt->block_indptr[s + 1] < bt->block_indptr[s])
            return pd_error(PD_EINVAL, "cuda plan: block_indptr decreases at sequence %zu", s);
        for (int32_t r = bt->q_indptr[s]; r < bt->q_indptr[s + 1]; r++) {
            if (bt->positions[r] < 0 || bt->positions[r] >= bt->kv_len[s])
                return pd_error(PD_ERANGE,
                                "cuda plan: positions[%d] = %d outside [0, kv_len[%zu] = %d)", r,
                                bt->positions[r], s, bt->kv_len[s]);
            if (r > bt->q_indptr[s] && bt->positions[r] <= bt->positions[r - 1])
                return pd_error(PD_EINVAL,
                                "cuda plan: positions of sequence %zu are not increasing at row %d",
                                s, r);
            if (bt->slots[r] < 0)
                return pd_error(PD_ERANGE, "cuda plan: slots[%d] = %lld is negative", r,
                                (long long)bt->slots[r]);
            if (bt->token_ids[r] < 0)
                return pd_error(PD_ERANGE, "cuda plan: token_ids[%d] = %d is negative", r,
                                bt->token_ids[r]);
        }
    }
    size_t nb = (size_t)bt->block_indptr[ns];
    if (nb > p->max_blocks)
        return pd_error(PD_ERANGE, "cuda plan: %zu block-table entries > max_blocks %zu", nb,
                        p->max_blocks);
    if (nb && !bt->block_ids) return pd_error(PD_EINVAL, "cuda plan: block_ids is NULL");
    for (size_t i = 0; i < bt->n_out; i++)
        if (bt->out_rows[i] < 0 || (size_t)bt->out_rows[i] >= n ||
            (i && bt->out_rows[i] <= bt->out_rows[i - 1]))
            return pd_error(PD_EINVAL, "cuda plan: out_rows[%zu] = %d not increasing in [0, %zu)",
                            i, bt->out_rows[i], n);
    return PD_OK;
}

// Appends count elements of elem bytes from src to the staging at *off; returns the offset.
static size_t stage_put(cuda_be *cb, size_t *off, const void *src, size_t bytes)
{
    size_t at = *off;
    if (bytes && src) memcpy(cb->h_stage + at, src, bytes);
    *off = align64(at + bytes);
    return at;
}

static int op_plan(pd_backend *b, const pd_batch *bt)
{
    cuda_be *cb = BE(b);
    PD_CHECK(graph_flush(cb)); // a step left unfinished
    ENTER(cb);
    __atomic_store_n(&cuda_pdl, cb->pdl, __ATOMIC_RELAXED); // this step's launches (cuda_launch)
    cb->planned = 0;
    PD_CHECK(plan_check(cb, bt));
    PD_CHECK(stage_wait(cb));
    size_t n = bt->n_tokens, ns = bt->n_seqs, nb = (size_t)bt->block_indptr[ns];
    size_t half = bt->rope_dim / 2;
    size_t off = 0;
    size_t o_tok = stage_put(cb, &off, bt->token_ids, n * 4);
    size_t o_pos = stage_put(cb, &off, bt->positions, n * 4);
    size_t o_slot = stage_put(cb, &off, bt->slots, n * 8);
    size_t o_cos = stage_put(cb, &off, bt->rope_cos, n * half * 4);
    size_t o_sin = stage_put(cb, &off, bt->rope_sin, n * half * 4);
    size_t o_qip = stage_put(cb, &off, bt->q_indptr, (ns + 1) * 4);
    size_t o_kvl = stage_put(cb, &off, bt->kv_len, ns * 4);
    size_t o_bip = stage_put(cb, &off, bt->block_indptr, (ns + 1) * 4);
    size_t o_out = stage_put(cb, &off, bt->out_rows, bt->n_out * 4);
    // last: the other offsets then depend on the step shape only (graphs rely on it)
    size_t o_bid = stage_put(cb, &off, bt->block_ids, nb * 4);
    if (off > cb->stage_cap) // plan_check bounds every array, so this is a broken invariant
        return pd_error(PD_EINTERNAL, "cuda plan: staging overflow (%zu > %zu)", off,
                        cb->stage_cap);
    CUDA_TRY(cudaMemcpyAsync(cb->d_stage, cb->h_stage, off, cudaMemcpyHostToDevice, cb->stream));
    CUDA_TRY(cudaEventRecord(cb->stage_done, cb->stream));
    cb->stage_pending = 1;

    cb->n_tokens = n;
    cb->n_seqs = ns;
    cb->n_out = bt->n_out;
    cb->n_block_ids = nb;
    cb->rope_dim = bt->rope_dim;
    cb->h_tokens = (const int32_t *)(cb->h_stage + o_tok);
    cb->h_positions = (const int32_t *)(cb->h_stage + o_pos);
    cb->h_slots = (const int64_t *)(cb->h_stage + o_slot);
    cb->h_q_indptr = (const int32_t *)(cb->h_stage + o_qip);
    cb->h_kv_len = (const int32_t *)(cb->h_stage + o_kvl);
    cb->h_block_indptr = (const int32_t *)(cb->h_stage + o_bip);
    cb->h_block_ids = (const int32_t *)(cb->h_stage + o_bid);
    cb->h_out_rows = (const int32_t *)(cb->h_stage + o_out);
    cb->d_tokens = (const int32_t *)(cb->d_stage + o_tok);
    cb->d_positions = (const int32_t *)(cb->d_stage + o_pos);
    cb->d_slots = (const int64_t *)(cb->d_stage + o_slot);
    cb->d_cos = (const float *)(cb->d_stage + o_cos);
    cb->d_sin = (const float *)(cb->d_stage + o_sin);
    cb->d_block_indptr = (const int32_t *)(cb->d_stage + o_bip);
    cb->d_block_ids = (const int32_t *)(cb->d_stage + o_bid);
    cb->d_out_rows = (const int32_t *)(cb->d_stage + o_out);
    cb->checked_kv = NULL;
    cb->attn_built = 0;
    cb->attn_uploaded = 0;
    cb->planned = 1;
    return graph_plan(cb);
}

static int need_plan(const cuda_be *cb, const char *op)
{
    if (!cb->planned) return pd_error(PD_EINVAL, "cuda %s: no step planned", op);
    return PD_OK;
}

// Checks the planned step against a KV pool once per (step, pool): slots and block tables.
static int check_kv(cuda_be *cb, const pd_kv *kv, int layer, const char *op)
{
    if (layer < 0 || layer >= kv->p.n_layers)
        return pd_error(PD_EINVAL, "cuda %s: layer %d out of range [0, %d)", op, layer,
                        kv->p.n_layers);
    if (cb->checked_kv == kv) return PD_OK;
    size_t bs = kv->p.block_size, nslots = kv->p.n_blocks * bs;
    for (size_t r = 0; r < cb->n_tokens; r++)
        if ((size_t)cb->h_slots[r] >= nslots)
            return pd_error(PD_EINVAL, "cuda %s: slots[%zu] = %lld is outside the pool's %zu slots",
                            op, r, (long long)cb->h_slots[r], nslots);
    for (size_t s = 0; s < cb->n_seqs; s++) {
        size_t have = (size_t)(cb->h_block_indptr[s + 1] - cb->h_block_indptr[s]);
        size_t need = ((size_t)cb->h_kv_len[s] + bs - 1) / bs;
        if (need > have)
            return pd_error(
                PD_EINVAL, "cuda %s: kv_len[%zu] = %d needs %zu blocks but its block table has %zu",
                op, s, cb->h_kv_len[s], need, have);
    }
    for (size_t i = 0; i < cb->n_block_ids; i++)
        if (cb->h_block_ids[i] < 0 || (size_t)cb->h_block_ids[i] >= kv->p.n_blocks)
            return pd_error(PD_EINVAL, "cuda %s: block_ids[%zu] = %d out of range [0, %zu)", op, i,
                            cb->h_block_ids[i], kv->p.n_blocks);
    cb->checked_kv = kv;
    return PD_OK;
}

// ---- graphs: the step tape ----------------------------------------------------------------------
//
// Decode steps repeat the same op calls with the same arguments, and launching ~10 kernels per
// layer one by one leaves the GPU waiting on the host. So a step whose shape (rows, outputs,
// rope_dim; decode rows only) was seen before is captured into a CUDA graph: plan begins stream
// capture, each op appends its arguments to a tape and launches into the capture, download_f32
// ends it, instantiates, launches the graph and keeps it with its tape. The next step of that
// shape replays: each op only checks its arguments against the tape (host-side validation still
// runs in the op) and download_f32 launches the graph. Any difference, or any op outside the
// tape (upload, sync, KV export, ...), flushes: the ops skipped so far are executed eagerly from
// the tape and the step goes on without a graph, so results never depend on the cache. Kernel
// arguments inside the graph must therefore be a function of the tape and the step shape only:
// staging offsets depend on (rows, sequences, outputs, rope_dim) (block ids are staged last),
// and attention grids are sized to a capacity with the real counts read on the device.
// PD_CUDA_GRAPHS=0 in the environment turns graphs off.

#define TAPE_CAP 16384 // entries a recording may hold (~10 per layer)

static int tape_exec(cuda_be *cb, const tape_ent *e);

// Leaves graph mode in the middle of a step: whatever was skipped or only captured so far is
// executed eagerly from the tape.
static int graph_flush(cuda_be *cb)
{
    if (cb->gmode == G_EAGER) return PD_OK;
    const tape_ent *t;
    size_t n;
    if (cb->gmode == G_RECORD) {
        cudaGraph_t g = NULL;
        cudaStreamEndCapture(cb->stream, &g); // the capture is dropped either way
        if (g) cudaGraphDestroy(g);
        cudaGetLastError();
        t = cb->rec;
        n = cb->rec_len;
    } else {
        t = cb->gcur->tape;
        n = cb->gpos;
    }
    cb->gmode = G_EAGER;
    cb->attn_uploaded = 0; // the work list copy was captured or skipped, not executed
    int rc = PD_OK;
    for (size_t i = 0; i < n && rc == 0; i++) rc = tape_exec(cb, &t[i]);
    free(cb->rec);
    cb->rec = NULL;
    cb->rec_len = 0;
    cb->gcur = NULL;
    return rc;
}

// Every op: eager execution, recording into the capture, or a checked skip while replaying.
static int step_op(cuda_be *cb, const tape_ent *e)
{
    if (cb->gmode == G_RECORD) {
        if (cb->rec_len == TAPE_CAP) {
            PD_CHECK(graph_flush(cb));
            return tape_exec(cb, e);
        }
        cb->rec[cb->rec_len++] = *e;
        int rc = tape_exec(cb, e);
        if (rc < 0) { // e.g. a library call that refuses capture: redo the step eagerly
            cb->rec_len--;
            PD_CHECK(graph_flush(cb));
            return tape_exec(cb, e);
        }
        return rc;
    }
    if (cb->gmode == G_REPLAY) {
        if (cb->gpos < cb->gcur->len && memcmp(&cb->gcur->tape[cb->gpos], e, sizeof *e) == 0) {
            cb->gpos++;
            return PD_OK;
        }
        PD_CHECK(graph_flush(cb));
    }
    return tape_exec(cb, e);
}

// Chooses the step's graph mode at the end of plan (the staging copy is already issued).
static int graph_plan(cuda_be *cb)
{
    cb->gmode = G_EAGER;
    if (!cb->graphs_on || cb->n_tokens != cb->n_seqs || cb->n_tokens > 256) return PD_OK;
    graph_slot *g = NULL, *lru = &cb->graphs[0];
    for (int i = 0; i < GRAPH_SLOTS; i++) {
        graph_slot *c = &cb->graphs[i];
        if (c->used && c->n_tokens == cb->n_tokens && c->n_out == cb->n_out &&
            c->rope_dim == cb->rope_dim)
            g = c;
        if (!c->used || (lru->used && c->last_use < lru->last_use)) lru = c;
    }
    cb->gtick++;
    if (!g) { // first sight: remember the shape, run eagerly
        graph_slot_clear(lru);
        lru->used = 1;
        lru->n_tokens = cb->n_tokens;
        lru->n_out = cb->n_out;
        lru->rope_dim = cb->rope_dim;
        lru->last_use = cb->gtick;
        return PD_OK;
    }
    g->last_use = cb->gtick;
    if (g->exec) {
        cb->gmode = G_REPLAY;
        cb->gcur = g;
        cb->gpos = 0;
        return PD_OK;
    }
    cb->rec = (tape_ent *)malloc(TAPE_CAP * sizeof(tape_ent));
    if (!cb->rec) return PD_OK; // no graph this time
    cudaError_t e = cudaStreamBeginCapture(cb->stream, cudaStreamCaptureModeThreadLocal);
    if (e != cudaSuccess) {
        cudaGetLastError();
        free(cb->rec);
        cb->rec = NULL;
        return PD_OK;
    }
    cb->gmode = G_RECORD;
    cb->gcur = g;
    cb->rec_len = 0;
    return PD_OK;
}

// download_f32's device part ends the tape: a recording is closed, instantiated, kept and
// launched; a replay whose tape also ends here launches its graph. Otherwise the entry runs
// eagerly (after a flush).
static int graph_finish(cuda_be *cb, const tape_ent *e)
{
    if (cb->gmode == G_REPLAY) {
        graph_slot *g = cb->gcur;
        if (cb->gpos + 1 != g->len || memcmp(&g->tape[cb->gpos], e, sizeof *e) != 0) {
            PD_CHECK(graph_flush(cb));
            return tape_exec(cb, e);
        }
        cb->gmode = G_EAGER;
        cb->gcur = NULL;
        CUDA_TRY(cudaGraphLaunch(g->exec, cb->stream));
        return PD_OK;
    }
    if (cb->gmode != G_RECORD) return tape_exec(cb, e);
    if (cb->rec_len == TAPE_CAP) {
        PD_CHECK(graph_flush(cb));
        return tape_exec(cb, e);
    }
    cb->rec[cb->rec_len++] = *e;
    int rc = tape_exec(cb, e);
    if (rc < 0) {
        cb->rec_len--;
        PD_CHECK(graph_flush(cb));
        return tape_exec(cb, e);
    }
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    cudaError_t err = cudaStreamEndCapture(cb->stream, &graph);
    if (err == cudaSuccess) err = cudaGraphInstantiate(&exec, graph, 0);
    if (graph) cudaGraphDestroy(graph);
    if (err != cudaSuccess) { // no graph: run the step eagerly (nothing of it ran yet)
        cudaGetLastError();
        cb->gmode = G_EAGER;
        cb->attn_uploaded = 0;
        int rc2 = PD_OK;
        for (size_t i = 0; i < cb->rec_len && rc2 == 0; i++) rc2 = tape_exec(cb, &cb->rec[i]);
        free(cb->rec);
        cb->rec = NULL;
        cb->gcur = NULL;
        cb->graphs_on = 0; // this device/driver does not take our graphs: stop trying
        return rc2;
    }
    graph_slot *g = cb->gcur;
    g->exec = exec;
    tape_ent *shrunk = (tape_ent *)realloc(cb->rec, cb->rec_len * sizeof(tape_ent));
    g->tape = shrunk ? shrunk : cb->rec;
    g->len = cb->rec_len;
    cb->rec = NULL;
    cb->gmode = G_EAGER;
    cb->gcur = NULL;
    CUDA_TRY(cudaGraphLaunch(exec, cb->stream));
    return PD_OK;
}

// ---- ops: execution from a tape entry ---------------------------------------------------------

static cudaDataType_t cuda_type(pd_dtype d)
{
    return d == PD_DTYPE_F32 ? CUDA_R_32F : d == PD_DTYPE_F16 ? CUDA_R_16F : CUDA_R_16BF;
}

static int exec_attention(cuda_be *cb, const pd_kv *kv, int layer, const void *q, size_t nqh,
                          float scale, void *out)
{
    if (!cb->attn_uploaded) {
        size_t ni = cb->attn_fixed ? cb->g_items_cap : cb->n_items + cb->n_tc_items;
        size_t nm = cb->attn_fixed ? cb->g_merges_cap : cb->n_merges;
        if (ni)
            CUDA_TRY(cudaMemcpyAsync(cb->d_items, cb->h_items, ni * sizeof(cuda_attn_item),
                                     cudaMemcpyHostToDevice, cb->stream));
        if (nm)
            CUDA_TRY(cudaMemcpyAsync(cb->d_merges, cb->h_merges, nm * sizeof(cuda_attn_merge),
                                     cudaMemcpyHostToDevice, cb->stream));
        if (cb->attn_fixed)
            CUDA_TRY(cudaMemcpyAsync(cb->d_counts, cb->h_counts, 4 * sizeof(int32_t),
                                     cudaMemcpyHostToDevice, cb->stream));
        if (cb->gmode == G_EAGER) { // in a graph the event is recorded after the launch
            CUDA_TRY(cudaEventRecord(cb->stage_done, cb->stream));
            cb->stage_pending = 1;
        }
        cb->attn_uploaded = 1;
    }
    cuda_attn_args a;
    memset(&a, 0, sizeof a);
    a.act = cb->act;
    a.q = q;
    a.kc = kv_k(kv, layer);
    a.vc = kv_v(kv, layer);
    a.out = out;
    a.positions = cb->d_positions;
    a.block_indptr = cb->d_block_indptr;
    a.block_ids = cb->d_block_ids;
    a.items = cb->d_items;
    a.n_items = cb->attn_fixed ? cb->g_items_cap : cb->n_items;
    a.tc_items = cb->d_items + cb->n_items;
    a.n_tc_items = cb->attn_fixed ? 0 : cb->n_tc_items;
    a.tc_heads_per_item = cb->tc_hpi;
    a.merges = cb->d_merges;
    a.n_merges = cb->attn_fixed ? cb->g_merges_cap : cb->n_merges;
    a.counts = cb->attn_fixed ? cb->d_counts : NULL;
    size_t part_cap = PART_BYTES / (nqh * (kv->p.head_dim + 1) * sizeof(float));
    if (part_cap > MAX_PARTS) part_cap = MAX_PARTS;
    a.part_o = cb->part_ws;
    a.part_lse = cb->part_ws + part_cap * nqh * kv->p.head_dim;
    a.n_q_heads = (int)nqh;
    a.n_kv_heads = (int)kv->p.n_kv_heads;
    a.head_dim = (int)kv->p.head_dim;
    a.heads_per_item = cb->hpi;
    a.tc_wmma = cb->attn_tc_wmma;
    a.block_size = (int)kv->p.block_size;
    a.scale = scale;
    return cuda_attention(cb->stream, &a);
}

static int exec_matmul(cuda_be *cb, const void *x, size_t n, const pd_weight *w,
                       const pd_weight *bias, void *y)
{
    size_t out = w->rows, in = w->cols;
    const float *bias_f = bias ? (const float *)bias->data : NULL;
    // Decode rows: our GEMV streams the weights once with the bias fused.
    if (n <= CUDA_GEMV_MAX_N) {
        int rc = cuda_gemv(cb->stream, cb->act, x, n, w->data, (int)w->dtype, out, in, bias_f, y);
        if (rc != PD_EUNSUPPORTED) return rc;
    }
    const float one = 1.0f, zero = 0.0f;
    const int act = cb->act;
    if ((int)w->dtype == act && !bias) {
        // Column-major view: Y^T (out, n) = W (out, in) . X^T (in, n); f32 accumulation.
        cudaDataType_t t = cuda_type(w->dtype);
        CUBLAS_TRY(cublasGemmEx(cb->cublas, CUBLAS_OP_T, CUBLAS_OP_N, (int)out, (int)n, (int)in,
                                &one, w->data, t, (int)in, x, t, (int)in, &zero, y, t, (int)out,
                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        return PD_OK;
    }
    // Chunked path: x converted to the weight dtype (unless equal), f32 output + bias -> act.
    size_t xe = (int)w->dtype == act ? 0 : pd_dtype_size(w->dtype);
    size_t row_ws = in * xe + out * sizeof(float);
    size_t ch = (MM_WS_BYTES - 64) / row_ws; // 64: alignment of the f32 output area
    if (ch == 0)
        return pd_error(PD_EUNSUPPORTED, "cuda matmul: row of %zu + %zu is over the workspace", in,
                        out);
    unsigned char *ws = (unsigned char *)cb->mm_ws;
    for (size_t r0 = 0; r0 < n; r0 += ch) {
        size_t cr = n - r0 < ch ? n - r0 : ch;
        const void *xa = (const unsigned char *)x + r0 * in * cb->act_size;
        float *y32 = (float *)(ws + align64(ch * in * xe));
        if (xe) {
            PD_CHECK(cuda_act_convert(cb->stream, act, xa, cr * in, (int)w->dtype, ws));
            xa = ws;
        }
        cudaDataType_t t = cuda_type(w->dtype);
        CUBLAS_TRY(cublasGemmEx(cb->cublas, CUBLAS_OP_T, CUBLAS_OP_N, (int)out, (int)cr, (int)in,
                                &one, w->data, t, (int)in, xa, t, (int)in, &zero, y32, CUDA_R_32F,
                                (int)out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        PD_CHECK(cuda_bias_epilogue(cb->stream, act, y32, bias_f, cr, out,
                                    (unsigned char *)y + r0 * out * cb->act_size));
    }
    return PD_OK;
}

// matmul_multi's entry: x = p[0]; weight i's w, bias, y = p[1 + i], p[1 + M + i], p[1 + 2M + i].
#define MM_W(e, i) ((const pd_weight *)(e)->p[1 + (i)])
#define MM_B(e, i) ((const pd_weight *)(e)->p[1 + PD_MATMUL_MULTI_MAX + (i)])
#define MM_Y(e, i) ((void *)(e)->p[1 + 2 * PD_MATMUL_MULTI_MAX + (i)])

// Decode rows: all weights in one GEMV launch (same x, same dtype); otherwise one by one.
static int exec_matmul_multi(cuda_be *cb, const tape_ent *e)
{
    const size_t n = e->z[0], nw = e->z[1];
    if (n <= CUDA_GEMV_MAX_N && nw <= CUDA_GEMV_MAX_MATS) {
        const void *W[CUDA_GEMV_MAX_MATS];
        const float *bias[CUDA_GEMV_MAX_MATS];
        void *y[CUDA_GEMV_MAX_MATS];
        size_t out[CUDA_GEMV_MAX_MATS];
        int same = 1;
        for (size_t i = 0; i < nw; i++) {
            W[i] = MM_W(e, i)->data;
            out[i] = MM_W(e, i)->rows;
            bias[i] = MM_B(e, i) ? (const float *)MM_B(e, i)->data : NULL;
            y[i] = MM_Y(e, i);
            same &= MM_W(e, i)->dtype == MM_W(e, 0)->dtype;
        }
        int rc = same ? cuda_gemv_multi(cb->stream, cb->act, e->p[0], n, (int)nw, W,
                                        (int)MM_W(e, 0)->dtype, out, MM_W(e, 0)->cols, bias, y)
                      : PD_EUNSUPPORTED;
        if (rc != PD_EUNSUPPORTED) return rc;
    }
    for (size_t i = 0; i < nw; i++)
        PD_CHECK(exec_matmul(cb, e->p[0], n, MM_W(e, i), MM_B(e, i), MM_Y(e, i)));
    return PD_OK;
}

// Rotary embedding of q and k and the KV-cache write of the step's rows, one launch.
static int exec_rope_kv_write(cuda_be *cb, const pd_kv *kv, int layer, void *q, size_t nq,
                              const void *k, const void *v)
{
    return cuda_rope_kv_write(cb->stream, cb->act, q, k, v, cb->n_tokens, nq, kv->p.n_kv_heads,
                              kv->p.head_dim, cb->d_cos, cb->d_sin, cb->rope_dim / 2, cb->d_slots,
                              kv_k(kv, layer), kv_v(kv, layer));
}

#define PRE_ADD(e)  ((e)->p[PRE_P])
#define PRE_XOUT(e) ((void *)(e)->p[PRE_P + 1])
#define PRE_W(e)    ((const pd_weight *)(e)->p[PRE_P + 2])
#define PRE_H(e)    ((void *)(e)->p[PRE_P + 3])

// The norm of a norm_* entry (p[0]: the residual rows) for its GEMV, or NULL (a plain entry).
static const cuda_norm_in *entry_norm(const tape_ent *e, cuda_norm_in *nm)
{
    if (!PRE_W(e)) return NULL;
    *nm = {PRE_ADD(e), PRE_XOUT(e), (const float *)PRE_W(e)->data, e->f};
    return nm;
}

// A norm_* entry's norm as its own launch (where its GEMV does not take it): into h, which the
// entry's projection then reads instead of p[0] (*x). No-op for a plain entry.
static int exec_prenorm(cuda_be *cb, const tape_ent *e, size_t dim, const void **x)
{
    if (!PRE_W(e)) return PD_OK;
    const float *w = (const float *)PRE_W(e)->data;
    *x = PRE_H(e);
    if (PRE_ADD(e))
        return cuda_add_rmsnorm(cb->stream, cb->act, e->p[0], PRE_ADD(e), PRE_XOUT(e), w, e->f,
                                e->z[0], dim, PRE_H(e));
    return cuda_rmsnorm(cb->stream, cb->act, e->p[0], w, e->f, e->z[0], dim, PRE_H(e));
}

// Decode rows: one GEMV launch with the rotary embedding and the KV write in its epilogue (and
// the norm before it, for norm_qkv_rope_kv_write); otherwise the norm, matmul_multi, then
// rope_kv_write. The entry is matmul_multi's (3 weights), the pool after it, the layer in z[2].
static int exec_qkv_rope_kv_write(cuda_be *cb, const tape_ent *e)
{
    const pd_kv *kv = (const pd_kv *)e->p[1 + 3 * PD_MATMUL_MULTI_MAX];
    const int layer = (int)e->z[2];
    const size_t D = kv->p.head_dim, nq = MM_W(e, 0)->rows / D;
    cuda_norm_in nb;
    const cuda_norm_in *nm = entry_norm(e, &nb);
    if (MM_W(e, 1)->dtype == MM_W(e, 0)->dtype && MM_W(e, 2)->dtype == MM_W(e, 0)->dtype) {
        const void *W[3];
        const float *bias[3];
        for (int i = 0; i < 3; i++) {
            W[i] = MM_W(e, i)->data;
            bias[i] = MM_B(e, i) ? (const float *)MM_B(e, i)->data : NULL;
        }
        int rc =
            cuda_gemv_qkv_rope(cb->stream, cb->act, e->p[0], e->z[0], W, (int)MM_W(e, 0)->dtype, nq,
                               kv->p.n_kv_heads, D, MM_W(e, 0)->cols, bias, MM_Y(e, 0), cb->d_cos,
                               cb->d_sin, cb->d_slots, kv_k(kv, layer), kv_v(kv, layer), nm);
        if (rc != PD_EUNSUPPORTED) return rc;
    }
    tape_ent m = *e;
    PD_CHECK(exec_prenorm(cb, e, MM_W(e, 0)->cols, &m.p[0]));
    PD_CHECK(exec_matmul_multi(cb, &m));
    return exec_rope_kv_write(cb, kv, layer, MM_Y(e, 0), nq, MM_Y(e, 1), MM_Y(e, 2));
}

// Decode rows: one GEMV launch ending in the SwiGLU (and starting with the norm, for
// norm_matmul_swiglu); otherwise the norm, gate and up, then swiglu.
static int exec_matmul_swiglu(cuda_be *cb, const tape_ent *e)
{
    const pd_weight *wg = (const pd_weight *)e->p[1], *wu = (const pd_weight *)e->p[2];
    const size_t n = e->z[0];
    void *g = (void *)e->p[3], *u = (void *)e->p[4], *out = (void *)e->p[5];
    cuda_norm_in nb;
    const cuda_norm_in *nm = entry_norm(e, &nb);
    if (n <= CUDA_GEMV_MAX_N && wg->dtype == wu->dtype) {
        int rc = cuda_gemv_swiglu(cb->stream, cb->act, e->p[0], n, wg->data, wu->data,
                                  (int)wg->dtype, wg->rows, wg->cols, out, nm);
        if (rc != PD_EUNSUPPORTED) return rc;
    }
    const void *x = e->p[0];
    PD_CHECK(exec_prenorm(cb, e, wg->cols, &x));
    PD_CHECK(exec_matmul(cb, x, n, wg, NULL, g));
    PD_CHECK(exec_matmul(cb, x, n, wu, NULL, u));
    return cuda_swiglu(cb->stream, cb->act, g, u, n * wg->rows, out);
}

static int tape_exec(cuda_be *cb, const tape_ent *e)
{
    switch (e->op) {
    case T_EMBED: {
        const pd_weight *t = (const pd_weight *)e->p[0];
        return cuda_embed(cb->stream, cb->act, t->data, (int)t->dtype, t->cols, cb->d_tokens,
                          cb->n_tokens, (void *)e->p[1]);
    }
    case T_RMSNORM:
        return cuda_rmsnorm(cb->stream, cb->act, e->p[0],
                            (const float *)((const pd_weight *)e->p[2])->data, e->f, e->z[0],
                            e->z[1], (void *)e->p[3]);
    case T_MATMUL:
        return exec_matmul(cb, e->p[0], e->z[0], (const pd_weight *)e->p[1],
                           (const pd_weight *)e->p[2], (void *)e->p[3]);
    case T_ROPE:
        return cuda_rope(cb->stream, cb->act, (void *)e->p[0], cb->n_tokens, e->z[0], e->z[1],
                         cb->d_cos, cb->d_sin, cb->rope_dim / 2);
    case T_KV_WRITE: {
        const pd_kv *kv = (const pd_kv *)e->p[0];
        return cuda_kv_write(cb->stream, cb->act, e->p[1], e->p[2], cb->n_tokens, kv->p.n_kv_heads,
                             kv->p.head_dim, cb->d_slots, kv_k(kv, (int)e->z[0]),
                             kv_v(kv, (int)e->z[0]));
    }
    case T_ATTENTION:
        return exec_attention(cb, (const pd_kv *)e->p[0], (int)e->z[0], e->p[1], e->z[1], e->f,
                              (void *)e->p[2]);
    case T_SWIGLU:
        return cuda_swiglu(cb->stream, cb->act, e->p[0], e->p[1], e->z[0], (void *)e->p[2]);
    case T_ADD: return cuda_add(cb->stream, cb->act, (void *)e->p[0], e->p[1], e->z[0]);
    case T_GATHER:
        return cuda_gather_rows(cb->stream, cb->act, e->p[0], e->z[0], cb->d_out_rows, cb->n_out,
                                (void *)e->p[1]);
    case T_MATMUL_MULTI: return exec_matmul_multi(cb, e);
    case T_ROPE_KV_WRITE:
        return exec_rope_kv_write(cb, (const pd_kv *)e->p[0], (int)e->z[0], (void *)e->p[1],
                                  e->z[1], e->p[2], e->p[3]);
    case T_ADD_RMSNORM:
        return cuda_add_rmsnorm(cb->stream, cb->act, e->p[0], e->p[1], (void *)e->p[4],
                                (const float *)((const pd_weight *)e->p[2])->data, e->f, e->z[0],
                                e->z[1], (void *)e->p[3]);
    case T_MATMUL_SWIGLU: return exec_matmul_swiglu(cb, e);
    case T_QKV_ROPE_KV_WRITE: return exec_qkv_rope_kv_write(cb, e);
    case T_DOWNLOAD: // the device part of download_f32: bf16 -> f32 into dl_ws
        if (cb->act == ACT_F32) return PD_OK;
        return cuda_act_convert(cb->stream, ACT_BF16, e->p[0], e->z[0], ACT_F32, cb->dl_ws);
    default: return pd_error(PD_EINTERNAL, "cuda: tape op %d", e->op);
    }
}

static tape_ent ent(int op)
{
    tape_ent e;
    memset(&e, 0, sizeof e); // padding included: entries are compared with memcmp
    e.op = op;
    return e;
}

// ---- ops --------------------------------------------------------------------------------------

static int op_embed(pd_backend *b, const pd_weight *table, void *out)
{
    cuda_be *cb = BE(b);
    PD_CHECK(need_plan(cb, "embed"));
    for (size_t r = 0; r < cb->n_tokens; r++)
        if ((size_t)cb->h_tokens[r] >= table->rows)
            return pd_error(PD_EINVAL, "cuda embed: token_ids[%zu] = %d is not below vocab %zu", r,
                            cb->h_tokens[r], table->rows);
    tape_ent e = ent(T_EMBED);
    e.p[0] = table;
    e.p[1] = out;
    return step_op(cb, &e);
}

static int norm_check(const pd_weight *w, size_t n, size_t dim)
{
    if (w->dtype != PD_DTYPE_F32 || w->rows * w->cols != dim)
        return pd_error(PD_EINVAL, "cuda rmsnorm: weight is (%zu, %zu) %s, need %zu f32", w->rows,
                        w->cols, pd_dtype_name(w->dtype), dim);
    if (n > 0x7fffffffu) return pd_error(PD_EINVAL, "cuda rmsnorm: %zu rows is too many", n);
    return PD_OK;
}

// h = rmsnorm(x) (add NULL: T_RMSNORM), or x + add into xo (== x: in place), h = rmsnorm(xo)
// (T_ADD_RMSNORM): one entry.
static int norm_entry(pd_backend *b, const void *x, const void *add, void *xo, const pd_weight *w,
                      float eps, size_t n, size_t dim, void *h)
{
    PD_CHECK(norm_check(w, n, dim));
    tape_ent e = ent(add ? T_ADD_RMSNORM : T_RMSNORM);
    e.p[0] = x;
    e.p[1] = add;
    e.p[2] = w;
    e.p[3] = h;
    e.p[4] = xo;
    e.z[0] = n;
    e.z[1] = dim;
    e.f = eps;
    return step_op(BE(b), &e);
}

static int op_rmsnorm(pd_backend *b, const void *x, const pd_weight *w, float eps, size_t n,
                      size_t dim, void *y)
{
    return norm_entry(b, x, NULL, NULL, w, eps, n, dim, y);
}

static int matmul_check(const pd_weight *w, const pd_weight *bias, size_t n)
{
    size_t out = w->rows, in = w->cols;
    if (w->is_vector) return pd_error(PD_EINVAL, "cuda matmul: weight is a vector");
    if (bias && bias->rows * bias->cols != out)
        return pd_error(PD_EINVAL, "cuda matmul: bias has %zu elements, need %zu",
                        bias->rows * bias->cols, out);
    if (n > INT_MAX || in > INT_MAX || out > INT_MAX)
        return pd_error(PD_EINVAL, "cuda matmul: (%zu x %zu) . (%zu x %zu)^T is too large", n, in,
                        out, in);
    return PD_OK;
}

static int op_matmul(pd_backend *b, const void *x, size_t n, const pd_weight *w,
                     const pd_weight *bias, void *y)
{
    cuda_be *cb = BE(b);
    PD_CHECK(matmul_check(w, bias, n));
    if (n == 0) return PD_OK;
    tape_ent e = ent(T_MATMUL);
    e.p[0] = x;
    e.p[1] = w;
    e.p[2] = bias;
    e.p[3] = y;
    e.z[0] = n;
    return step_op(cb, &e);
}

static int op_rope(pd_backend *b, void *x, size_t n_heads, size_t head_dim)
{
    cuda_be *cb = BE(b);
    PD_CHECK(need_plan(cb, "rope"));
    if (head_dim != cb->rope_dim)
        return pd_error(PD_EINVAL, "cuda rope: head_dim %zu != planned rope_dim %zu", head_dim,
                        cb->rope_dim);
    tape_ent e = ent(T_ROPE);
    e.p[0] = x;
    e.z[0] = n_heads;
    e.z[1] = head_dim;
    return step_op(cb, &e);
}

static int op_kv_write(pd_backend *b, pd_kv *kv, int layer, const void *k, const void *v)
{
    cuda_be *cb = BE(b);
    PD_CHECK(need_plan(cb, "kv_write"));
    PD_CHECK(check_kv(cb, kv, layer, "kv_write"));
    tape_ent e = ent(T_KV_WRITE);
    e.p[0] = kv;
    e.p[1] = k;
    e.p[2] = v;
    e.z[0] = (size_t)layer;
    return step_op(cb, &e);
}

// Largest divisor of g that is <= cap.
static int largest_divisor(int g, int cap)
{
    int best = 1;
    for (int h = 1; h <= g && h <= cap; h++)
        if (g % h == 0) best = h;
    return best;
}

// Tensor-core items by descending key range (then by row): the GPU starts blocks in grid order,
// so the longest (a prompt's last rows) start first and the short ones fill the tail; each item
// writes its own rows, so the order does not change any value.
static int tc_item_cmp(const void *a, const void *b)
{
    const cuda_attn_item *x = (const cuda_attn_item *)a, *y = (const cuda_attn_item *)b;
    int32_t ex = x->kv1 - x->kv0, ey = y->kv1 - y->kv0;
    if (ex != ey) return ex > ey ? -1 : 1;
    return x->row0 < y->row0 ? -1 : x->row0 > y->row0;
}

// Builds the step's attention work list on the host for this head layout (the copy to the
// device happens with the first attention launch). Sequences whose rows fill at least one
// 16-row tensor-core tile (bf16, head_dim 64/128) become tensor-core items of up to
// CUDA_ATTN_TC_QV query vectors; the rest become CUDA-core items, and single-row items with
// long contexts are split when the whole list would not fill the GPU. In a graph step the
// grids are sized to a capacity that depends on the step shape only.
static int attn_build(cuda_be *cb, int nqh, int nkvh, int D, int tc_ok)
{
    if (cb->attn_built && cb->attn_nqh == nqh && cb->attn_nkvh == nkvh && cb->attn_hd == D &&
        cb->attn_tc_ok == tc_ok)
        return PD_OK;
    if (cb->attn_built) { // a second head layout in one step: the first list may be in flight
        PD_CHECK(graph_flush(cb));
        CUDA_TRY(cudaStreamSynchronize(cb->stream));
    }
    int fixed = cb->gmode != G_EAGER;
    int G = nqh / nkvh;
    int hpi = largest_divisor(G, CUDA_ATTN_QV), tc_hpi = largest_divisor(G, CUDA_ATTN_TC_QV);
    int R = CUDA_ATTN_QV / hpi, R_tc = CUDA_ATTN_TC_QV / tc_hpi;
    size_t groups = (size_t)(nqh / hpi);
    size_t part_cap = PART_BYTES / ((size_t)nqh * (D + 1) * sizeof(float));
    if (part_cap > MAX_PARTS) part_cap = MAX_PARTS;

    size_t base = 0;
    for (size_t s = 0; s < cb->n_seqs; s++) {
        size_t rows = (size_t)(cb->h_q_indptr[s + 1] - cb->h_q_indptr[s]);
        int tc = tc_ok && rows * (size_t)tc_hpi >= 16;
        base += tc ? (rows + R_tc - 1) / R_tc : (rows + R - 1) / R;
    }
    size_t target = 2 * (size_t)cb->sm_count;
    size_t want = 1;
    if (base && base * groups < target) want = (target + base * groups - 1) / (base * groups);

    // CUDA-core items fill h_items from the front; tensor-core items are collected after them.
    size_t ni = 0, nm = 0, parts = 0, ntc = 0;
    cuda_attn_item *tc_list = cb->h_items + cb->items_cap / 2; // staging for tc items
    size_t tc_cap = cb->items_cap - cb->items_cap / 2;
    for (size_t s = 0; s < cb->n_seqs; s++) {
        int32_t q0 = cb->h_q_indptr[s], q1 = cb->h_q_indptr[s + 1];
        int tc = tc_ok && (size_t)(q1 - q0) * (size_t)tc_hpi >= 16;
        int32_t step = tc ? R_tc : R;
        for (int32_t r0 = q0; r0 < q1; r0 += step) {
            int32_t nr = q1 - r0 < step ? q1 - r0 : step;
            int32_t extent = cb->h_positions[r0 + nr - 1] + 1;
            if (tc) {
                if (ntc >= tc_cap) return pd_error(PD_EINTERNAL, "cuda attention: tc overflow");
                cuda_attn_item *it = &tc_list[ntc++];
                it->row0 = r0;
                it->nrows = nr;
                it->seq = (int32_t)s;
                it->kv0 = 0;
                it->kv1 = extent;
                it->part = -1;
                it->fresh0 = cb->h_positions[q0];
                continue;
            }
            size_t nsplit = 1;
            if (nr == 1 && want > 1 && extent > SPLIT_MIN) {
                nsplit = ((size_t)extent + SPLIT_MIN - 1) / SPLIT_MIN;
                if (nsplit > want) nsplit = want;
                if (parts + nsplit > part_cap) nsplit = 1;
            }
            if (ni + nsplit > cb->items_cap / 2)
                return pd_error(PD_EINTERNAL, "cuda attention: work list overflow");
            if (nsplit > 1) {
                size_t chunk = ((size_t)extent + nsplit - 1) / nsplit;
                chunk = (chunk + CUDA_ATTN_KT - 1) / CUDA_ATTN_KT * CUDA_ATTN_KT;
                nsplit = ((size_t)extent + chunk - 1) / chunk;
                cb->h_merges[nm].row = r0;
                cb->h_merges[nm].part0 = (int32_t)parts;
                cb->h_merges[nm].n_parts = (int32_t)nsplit;
                nm++;
                for (size_t k = 0; k < nsplit; k++) {
                    cuda_attn_item *it = &cb->h_items[ni++];
                    it->row0 = r0;
                    it->nrows = 1;
                    it->seq = (int32_t)s;
                    it->kv0 = (int32_t)(k * chunk);
                    it->kv1 = (int32_t)((k + 1) * chunk < (size_t)extent ? (k + 1) * chunk
                                                                         : (size_t)extent);
                    it->part = (int32_t)(parts + k);
                    it->fresh0 = cb->h_positions[q0];
                }
                parts += nsplit;
            } else {
                cuda_attn_item *it = &cb->h_items[ni++];
                it->row0 = r0;
                it->nrows = nr;
                it->seq = (int32_t)s;
                it->kv0 = 0;
                it->kv1 = extent;
                it->part = -1;
                it->fresh0 = cb->h_positions[q0];
            }
        }
    }
    if (nm > cb->params.max_tokens)
        return pd_error(PD_EINTERNAL, "cuda attention: merge list overflow (%zu)", nm);
    if (fixed && (ntc || ni > cb->n_seqs * want || nm > cb->n_seqs)) {
        // cannot happen for decode rows with tc_ok = 0; stay correct if it ever does
        PD_CHECK(graph_flush(cb));
        fixed = 0;
    }
    // one contiguous list: CUDA-core items then tensor-core items
    qsort(tc_list, ntc, sizeof(cuda_attn_item), tc_item_cmp);
    if (ntc) memmove(cb->h_items + ni, tc_list, ntc * sizeof(cuda_attn_item));
    cb->h_counts[0] = (int32_t)ni;
    cb->h_counts[1] = (int32_t)nm;
    cb->attn_fixed = fixed;
    cb->g_items_cap = cb->n_seqs * want;
    cb->g_merges_cap = cb->n_seqs;
    cb->attn_uploaded = 0;
    cb->n_items = ni;
    cb->n_tc_items = ntc;
    cb->n_merges = nm;
    cb->hpi = hpi;
    cb->tc_hpi = tc_hpi;
    cb->attn_nqh = nqh;
    cb->attn_nkvh = nkvh;
    cb->attn_hd = D;
    cb->attn_tc_ok = tc_ok;
    cb->attn_built = 1;
    return PD_OK;
}

static int op_attention(pd_backend *b, const pd_kv *kv, int layer, const void *q, size_t n_q_heads,
                        float scale, void *out)
{
    cuda_be *cb = BE(b);
    PD_CHECK(need_plan(cb, "attention"));
    PD_CHECK(check_kv(cb, kv, layer, "attention"));
    size_t nkvh = kv->p.n_kv_heads;
    if (n_q_heads == 0 || n_q_heads % nkvh || n_q_heads > 65535)
        return pd_error(PD_EINVAL,
                        "cuda attention: %zu q heads is not a multiple of %zu kv heads (or too "
                        "many)",
                        n_q_heads, nkvh);
    // tensor cores for bf16 prefill tiles (never in decode-only steps, which graphs capture
    // with fixed grids, so a decode step computes the same way captured or not); q must allow
    // 16-byte loads
    int tc_ok = cb->act == ACT_BF16 && (kv->p.head_dim == 64 || kv->p.head_dim == 128) &&
                (uintptr_t)q % 16 == 0 && cb->n_tokens != cb->n_seqs;
    PD_CHECK(attn_build(cb, (int)n_q_heads, (int)nkvh, (int)kv->p.head_dim, tc_ok));
    tape_ent e = ent(T_ATTENTION);
    e.p[0] = kv;
    e.p[1] = q;
    e.p[2] = out;
    e.z[0] = (size_t)layer;
    e.z[1] = n_q_heads;
    e.f = scale;
    return step_op(cb, &e);
}

static int op_swiglu(pd_backend *b, const void *gate, const void *up, size_t n, size_t dim,
                     void *out)
{
    tape_ent e = ent(T_SWIGLU);
    e.p[0] = gate;
    e.p[1] = up;
    e.p[2] = out;
    e.z[0] = n * dim;
    return step_op(BE(b), &e);
}

static int op_add(pd_backend *b, void *y, const void *x, size_t n_elems)
{
    tape_ent e = ent(T_ADD);
    e.p[0] = y;
    e.p[1] = x;
    e.z[0] = n_elems;
    return step_op(BE(b), &e);
}

static int op_gather_rows(pd_backend *b, const void *x, size_t dim, void *out)
{
    cuda_be *cb = BE(b);
    PD_CHECK(need_plan(cb, "gather_rows"));
    tape_ent e = ent(T_GATHER);
    e.p[0] = x;
    e.p[1] = out;
    e.z[0] = dim;
    return step_op(cb, &e);
}

// A matmul_multi tape entry of op `op` (checked: one x for every weight).
static int multi_entry(int op, const void *x, size_t n, size_t n_w, const pd_weight *const *w,
                       const pd_weight *const *bias, void *const *y, tape_ent *e)
{
    if (n_w < 1 || n_w > PD_MATMUL_MULTI_MAX)
        return pd_error(PD_EINVAL, "cuda matmul: %zu weights in one call, expected 1 to %d", n_w,
                        PD_MATMUL_MULTI_MAX);
    *e = ent(op);
    e->p[0] = x;
    for (size_t i = 0; i < n_w; i++) {
        PD_CHECK(matmul_check(w[i], bias ? bias[i] : NULL, n));
        if (w[i]->cols != w[0]->cols)
            return pd_error(PD_EINVAL, "cuda matmul: weight %zu has %zu columns, weight 0 has %zu",
                            i, w[i]->cols, w[0]->cols);
        e->p[1 + i] = w[i];
        e->p[1 + PD_MATMUL_MULTI_MAX + i] = bias ? bias[i] : NULL;
        e->p[1 + 2 * PD_MATMUL_MULTI_MAX + i] = y[i];
    }
    e->z[0] = n;
    e->z[1] = n_w;
    return PD_OK;
}

static int op_matmul_multi(pd_backend *b, const void *x, size_t n, size_t n_w,
                           const pd_weight *const *w, const pd_weight *const *bias, void *const *y)
{
    if (BE(b)->unfused && n_w >= 1 && n_w <= PD_MATMUL_MULTI_MAX) {
        for (size_t i = 0; i < n_w; i++)
            PD_CHECK(op_matmul(b, x, n, w[i], bias ? bias[i] : NULL, y[i]));
        return PD_OK;
    }
    tape_ent e;
    PD_CHECK(multi_entry(T_MATMUL_MULTI, x, n, n_w, w, bias, y, &e));
    if (n == 0) return PD_OK;
    return step_op(BE(b), &e);
}

static int op_rope_kv_write(pd_backend *b, pd_kv *kv, int layer, void *q, size_t n_q_heads, void *k,
                            const void *v)
{
    cuda_be *cb = BE(b);
    PD_CHECK(need_plan(cb, "rope_kv_write"));
    PD_CHECK(check_kv(cb, kv, layer, "rope_kv_write"));
    if (kv->p.head_dim != cb->rope_dim)
        return pd_error(PD_EINVAL, "cuda rope_kv_write: head_dim %zu != planned rope_dim %zu",
                        kv->p.head_dim, cb->rope_dim);
    if (cb->unfused) {
        PD_CHECK(op_rope(b, q, n_q_heads, kv->p.head_dim));
        PD_CHECK(op_rope(b, k, kv->p.n_kv_heads, kv->p.head_dim));
        return op_kv_write(b, kv, layer, k, v);
    }
    tape_ent e = ent(T_ROPE_KV_WRITE);
    e.p[0] = kv;
    e.p[1] = q;
    e.p[2] = k;
    e.p[3] = v;
    e.z[0] = (size_t)layer;
    e.z[1] = n_q_heads;
    return step_op(cb, &e);
}

// A norm_* op's arguments, for rows of dim elements.
static int prenorm_check(const pd_norm_in *pre, size_t n, size_t dim, const char *op)
{
    if (!pre->x || !pre->w || !pre->h || (pre->add && !pre->x_out))
        return pd_error(PD_EINVAL, "cuda %s: the norm needs x, w, h%s", op,
                        pre->add ? " and x_out (add given)" : "");
    if (pre->add && (pre->x_out == pre->x || pre->x_out == pre->add))
        return pd_error(PD_EINVAL,
                        "cuda %s: x_out must not be x or add (it is written while they "
                        "are read)",
                        op);
    return norm_check(pre->w, n, dim);
}

// A norm_* op's norm as its own launch (rows the GEMV does not take, PD_CUDA_FUSED=0): into
// pre->h.
static int op_prenorm(pd_backend *b, const pd_norm_in *pre, size_t n, size_t dim)
{
    return norm_entry(b, pre->x, pre->add, pre->x_out, pre->w, pre->eps, n, dim, pre->h);
}

// The entry's norm fields from pre (NULL: none).
static void set_prenorm(tape_ent *e, const pd_norm_in *pre)
{
    if (!pre) return;
    e->p[PRE_P] = pre->add;
    e->p[PRE_P + 1] = pre->x_out;
    e->p[PRE_P + 2] = pre->w;
    e->p[PRE_P + 3] = pre->h;
    e->f = pre->eps;
}

// qkv_rope_kv_write of x, or with pre (norm_qkv_rope_kv_write) of pre->h after the norm.
static int qkv_rope_kv_write(pd_backend *b, pd_kv *kv, int layer, const pd_norm_in *pre,
                             const void *x, size_t n, const pd_weight *const *w,
                             const pd_weight *const *bias, void *q, void *k, void *v)
{
    cuda_be *cb = BE(b);
    const size_t D = kv->p.head_dim, kv_row = kv->p.n_kv_heads * D;
    if (w[0]->rows % D || w[1]->rows != kv_row || w[2]->rows != kv_row)
        return pd_error(PD_EINVAL,
                        "cuda qkv_rope_kv_write: q, k, v have %zu, %zu, %zu rows; the pool holds "
                        "%zu heads of %zu",
                        w[0]->rows, w[1]->rows, w[2]->rows, kv->p.n_kv_heads, D);
    void *y[3] = {q, k, v};
    if (cb->unfused || n > CUDA_GEMV_MAX_N) { // no GEMV here: the ops' launches
        if (pre) {
            PD_CHECK(op_prenorm(b, pre, n, w[0]->cols));
            x = pre->h;
        }
        PD_CHECK(op_matmul_multi(b, x, n, 3, w, bias, y));
        return op_rope_kv_write(b, kv, layer, q, w[0]->rows / D, k, v);
    }
    PD_CHECK(need_plan(cb, "qkv_rope_kv_write"));
    PD_CHECK(check_kv(cb, kv, layer, "qkv_rope_kv_write"));
    if (D != cb->rope_dim || n != cb->n_tokens)
        return pd_error(PD_EINVAL,
                        "cuda qkv_rope_kv_write: head_dim %zu and %zu rows, planned rope_dim %zu "
                        "and %zu rows",
                        D, n, cb->rope_dim, cb->n_tokens);
    tape_ent e;
    PD_CHECK(multi_entry(T_QKV_ROPE_KV_WRITE, pre ? pre->x : x, n, 3, w, bias, y, &e));
    e.p[1 + 3 * PD_MATMUL_MULTI_MAX] = kv;
    e.z[2] = (size_t)layer;
    set_prenorm(&e, pre);
    return step_op(cb, &e);
}

static int op_qkv_rope_kv_write(pd_backend *b, pd_kv *kv, int layer, const void *x, size_t n,
                                const pd_weight *const *w, const pd_weight *const *bias, void *q,
                                void *k, void *v)
{
    return qkv_rope_kv_write(b, kv, layer, NULL, x, n, w, bias, q, k, v);
}

static int op_norm_qkv_rope_kv_write(pd_backend *b, pd_kv *kv, int layer, const pd_norm_in *pre,
                                     size_t n, const pd_weight *const *w,
                                     const pd_weight *const *bias, void *q, void *k, void *v)
{
    PD_CHECK(prenorm_check(pre, n, w[0]->cols, "norm_qkv_rope_kv_write"));
    return qkv_rope_kv_write(b, kv, layer, pre, NULL, n, w, bias, q, k, v);
}

static int op_add_rmsnorm(pd_backend *b, void *y, const void *x, const pd_weight *w, float eps,
                          size_t n, size_t dim, void *h)
{
    PD_CHECK(norm_check(w, n, dim));
    if (BE(b)->unfused) {
        PD_CHECK(op_add(b, y, x, n * dim));
        return op_rmsnorm(b, y, w, eps, n, dim, h);
    }
    return norm_entry(b, y, x, y, w, eps, n, dim, h);
}

// matmul_swiglu of x, or with pre (norm_matmul_swiglu) of pre->h after the norm.
static int matmul_swiglu(pd_backend *b, const pd_norm_in *pre, const void *x, size_t n,
                         const pd_weight *wg, const pd_weight *wu, void *g, void *u, void *out)
{
    PD_CHECK(matmul_check(wg, NULL, n));
    PD_CHECK(matmul_check(wu, NULL, n));
    if (wg->rows != wu->rows || wg->cols != wu->cols)
        return pd_error(PD_EINVAL, "cuda matmul_swiglu: gate is (%zu, %zu), up (%zu, %zu)",
                        wg->rows, wg->cols, wu->rows, wu->cols);
    if (BE(b)->unfused) {
        if (pre) {
            PD_CHECK(op_prenorm(b, pre, n, wg->cols));
            x = pre->h;
        }
        PD_CHECK(op_matmul(b, x, n, wg, NULL, g));
        PD_CHECK(op_matmul(b, x, n, wu, NULL, u));
        return op_swiglu(b, g, u, n, wg->rows, out);
    }
    if (n == 0) return PD_OK;
    tape_ent e = ent(T_MATMUL_SWIGLU);
    e.p[0] = pre ? pre->x : x;
    e.p[1] = wg;
    e.p[2] = wu;
    e.p[3] = g;
    e.p[4] = u;
    e.p[5] = out;
    e.z[0] = n;
    set_prenorm(&e, pre);
    return step_op(BE(b), &e);
}

static int op_matmul_swiglu(pd_backend *b, const void *x, size_t n, const pd_weight *wg,
                            const pd_weight *wu, void *g, void *u, void *out)
{
    return matmul_swiglu(b, NULL, x, n, wg, wu, g, u, out);
}

static int op_norm_matmul_swiglu(pd_backend *b, const pd_norm_in *pre, size_t n,
                                 const pd_weight *wg, const pd_weight *wu, void *g, void *u,
                                 void *out)
{
    PD_CHECK(prenorm_check(pre, n, wg->cols, "norm_matmul_swiglu"));
    return matmul_swiglu(b, pre, NULL, n, wg, wu, g, u, out);
}

static const pd_backend_ops cuda_ops = {
    "cuda",
    op_destroy,
    op_act_dtype,
    op_buf_alloc,
    op_buf_free,
    op_upload,
    op_download,
    op_download_f32,
    op_upload_f32,
    op_sync,
    op_weight_load,
    op_weight_free,
    op_weight_nbytes,
    op_kv_create,
    op_kv_free,
    op_kv_layer,
    op_kv_export,
    op_kv_import,
    op_kv_share,
    op_kv_peer_open,
    op_kv_peer_close,
    op_kv_pull,
    op_plan,
    op_embed,
    op_rmsnorm,
    op_matmul,
    op_rope,
    op_kv_write,
    op_attention,
    op_swiglu,
    op_add,
    op_gather_rows,
    pd_nccl_link_id,
    pd_nccl_link_open,
    pd_nccl_link_close,
    pd_nccl_link_send,
    pd_nccl_link_recv,
    pd_nccl_link_scatter,
    pd_nccl_link_local,
    op_matmul_multi,
    op_rope_kv_write,
    op_add_rmsnorm,
    op_matmul_swiglu,
    op_qkv_rope_kv_write,
    op_norm_qkv_rope_kv_write,
    op_norm_matmul_swiglu,
    op_host_alloc,
    op_host_free,
};

extern "C" int pd_backend_cuda_device(const pd_backend *b)
{
    return ((const cuda_be *)pd_backend_impl(b))->device;
}

extern "C" int pd_backend_cuda_step_stream(pd_backend *b, void **stream)
{
    cuda_be *cb = BE(b);
    PD_CHECK(graph_flush(cb));
    ENTER(cb);
    *stream = (void *)cb->stream;
    return PD_OK;
}

extern "C" int pd_backend_cuda_pull_timing(pd_backend *b)
{
    cuda_be *cb = BE(b);
    pthread_mutex_lock(&cb->xfer_mu);
    int rc = cuda_status(cudaSetDevice(cb->device), "cudaSetDevice", __FILE__, __LINE__);
    for (int i = 0; i < 2 && rc == PD_OK; i++)
        if (!cb->pull_ev[i])
            rc = cuda_status(cudaEventCreate(&cb->pull_ev[i]), "cudaEventCreate(pull timing)",
                             __FILE__, __LINE__);
    if (rc < 0) // off again: pulls time themselves only with both events
        for (int i = 0; i < 2; i++) {
            if (cb->pull_ev[i]) cudaEventDestroy(cb->pull_ev[i]);
            cb->pull_ev[i] = NULL;
        }
    pthread_mutex_unlock(&cb->xfer_mu);
    return rc;
}

extern "C" void pd_backend_cuda_pull_time(pd_backend *b, double *sum, double *best, uint64_t *n)
{
    cuda_be *cb = BE(b);
    pthread_mutex_lock(&cb->xfer_mu);
    *sum = cb->pull_sum;
    *best = cb->pull_min;
    *n = cb->pull_n;
    pthread_mutex_unlock(&cb->xfer_mu);
}

extern "C" int pd_backend_cuda_kv_params(const pd_kv *kv, pd_kv_params *out)
{
    *out = kv->p;
    return PD_OK;
}

extern "C" int pd_backend_cuda_kv_blocks(pd_backend *b, const pd_kv_params *p, double util,
                                         size_t *n_blocks)
{
    *n_blocks = 0;
    if (strcmp(pd_backend_name(b), "cuda") != 0)
        return pd_error(PD_EINVAL, "cuda kv sizing: backend is %s", pd_backend_name(b));
    if (!(util > 0.0 && util <= 1.0))
        return pd_error(PD_EINVAL, "--gpu-memory-utilization %g is not in (0, 1]", util);
    if (p->n_layers < 1 || p->block_size < 1 || p->n_kv_heads < 1 || p->head_dim < 1)
        return pd_error(PD_EINVAL, "cuda kv sizing: empty pool shape");
    cuda_be *cb = BE(b);
    PD_CHECK(graph_flush(cb));
    ENTER(cb);
    size_t free_b = 0, total_b = 0;
    CUDA_TRY(cudaMemGetInfo(&free_b, &total_b));
    size_t block_b = 2 * (size_t)p->n_layers * p->block_size * p->n_kv_heads * p->head_dim *
                     pd_dtype_size(p->dtype);
    // This instance's share (vLLM's meaning, also when several instances share the GPU): what
    // this backend took since it was created (weights, workspaces, the CUDA context's growth)
    // counts against total * util; memory of other processes does not, but the pool must fit
    // in what is free now, less a margin for the allocator.
    double mine = cb->free_at_create > free_b ? (double)(cb->free_at_create - free_b) : 0.0;
    double budget = (double)total_b * util - mine;
    double room = (double)free_b - (double)((size_t)256 << 20);
    if (budget > room) budget = room;
    if (budget < (double)block_b)
        return pd_error(PD_ENOMEM,
                        "--gpu-memory-utilization %.2f: this instance uses %.2f GiB of %.2f GiB "
                        "and %.2f GiB are free; no room for one KV block of %zu bytes",
                        util, mine / 1073741824.0, (double)total_b / 1073741824.0,
                        (double)free_b / 1073741824.0, block_b);
    *n_blocks = (size_t)(budget / (double)block_b);
    PD_INFO(NULL,
            "cuda kv pool: %zu blocks of %zu tokens (%.2f GiB, %zu tokens) at "
            "--gpu-memory-utilization %.2f",
            *n_blocks, p->block_size, (double)*n_blocks * (double)block_b / 1073741824.0,
            *n_blocks * p->block_size, util);
    return PD_OK;
}

extern "C" int pd_backend_cuda_create(const pd_backend_params *params, pd_backend **out)
{
    *out = NULL;
    pd_backend_params p = params ? *params : pd_backend_default_params();
    if (p.weight_dtype != -1 && p.weight_dtype != PD_DTYPE_F32 && p.weight_dtype != PD_DTYPE_F16 &&
        p.weight_dtype != PD_DTYPE_BF16)
        return pd_error(PD_EUNSUPPORTED, "cuda backend: weight_dtype %d is not supported",
                        p.weight_dtype);
    if (p.max_tokens < 1 || p.max_seqs < 1 || p.max_tokens > INT_MAX || p.max_blocks > INT_MAX)
        return pd_error(PD_EINVAL,
                        "cuda backend: max_tokens %zu / max_seqs %zu / max_blocks %zu "
                        "out of range",
                        p.max_tokens, p.max_seqs, p.max_blocks);
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
        cudaGetLastError();
        return pd_error(PD_ENOTFOUND, "no CUDA device: %s",
                        e != cudaSuccess ? cudaGetErrorString(e) : "device count is 0");
    }
    if (p.device < 0 || p.device >= count)
        return pd_error(PD_ENOTFOUND, "CUDA device %d does not exist (%d present)", p.device,
                        count);
    cuda_be *cb = (cuda_be *)calloc(1, sizeof *cb);
    if (!cb) return pd_error(PD_ENOMEM, "cuda backend: out of host memory");
    pthread_mutex_init(&cb->xfer_mu, NULL);
    cb->device = p.device;
    cb->params = p;
    cb->wdtype = p.weight_dtype == -1 ? PD_DTYPE_BF16 : (pd_dtype)p.weight_dtype;
    cb->act = cb->wdtype == PD_DTYPE_F32 ? ACT_F32 : ACT_BF16;
    cb->act_size = cb->act == ACT_F32 ? 4 : 2;
    int rc = be_init(cb);
    if (rc < 0) {
        be_free_state(cb);
        return rc;
    }
    pd_backend *b = pd_backend_wrap(&cuda_ops, cb);
    if (!b) {
        be_free_state(cb);
        return pd_error(PD_ENOMEM, "cuda backend: out of host memory");
    }
    *out = b;
    return PD_OK;
}
