// The CUDA backend's operation table (see cuda_backend.h): lifetime, memory, weights, and the
// extern "C" entry points; cuda_be.cuh lists the files that hold the other entries.
//
// Design: one stream and one cuBLAS handle per instance; everything an op needs on the device
// is allocated at create (step metadata buffers sized from the params, the GEMM and download
// workspaces, the attention split workspace) or at load (weights, KV pool), so no op allocates.
// Repeated decode-only steps are captured into CUDA graphs and replayed (cuda_step.cu); the
// memory ops leave graph mode first. KV transfers run on a second stream of their own
// (cuda_kv.cu).
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_be.cuh"

extern "C" {
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/pd_nccl.h"
#include "model/quant.h"
#include "util/log.h"
}

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

static void op_free(pd_backend *b)
{
    be_free_state(BE(b));
}

static pd_dtype op_act_dtype(const pd_backend *b)
{
    return (pd_dtype)((const cuda_be *)pd_backend_impl(b))->act;
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
    if (!t || (!t->data && !t->quant) || (t->ndim != 1 && t->ndim != 2))
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
    if (!t->quant && !pd_dtype_is_float(t->dtype))
        return pd_error(PD_EINVAL, "cuda weight_load: tensor '%s': dtype %s is not a float dtype",
                        name, pd_dtype_st_name(t->dtype));
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
    // Convert on the host in chunks of rows, then copy each chunk. A quantized linear is
    // dequantized into the weight dtype here (its own kernels are not written yet), so it
    // computes as its dequantized float checkpoint would.
    size_t row_bytes = nc * de;
    size_t chunk_rows = ((size_t)16 << 20) / row_bytes;
    if (chunk_rows < 1) chunk_rows = 1;
    if (chunk_rows > nr) chunk_rows = nr;
    unsigned char *hbuf = (unsigned char *)malloc(chunk_rows * row_bytes);
    float *tmp = (float *)malloc((t->quant ? chunk_rows : 1) * nc * sizeof(float));
    int rc = PD_OK;
    if (!hbuf || !tmp) {
        rc = pd_error(PD_ENOMEM, "cuda weight_load: out of host memory");
        goto fail;
    }
    for (size_t r0 = 0; r0 < nr; r0 += chunk_rows) {
        size_t cr = nr - r0 < chunk_rows ? nr - r0 : chunk_rows;
        if (t->quant) {
            rc = pd_qweight_dequant(t->quant, (int64_t)(sl->row0 + r0), (int64_t)cr,
                                    (int64_t)sl->col0, (int64_t)nc, tmp);
            if (rc < 0) goto fail;
            pd_from_f32_n(w->dtype, tmp, hbuf, cr * nc);
        }
        for (size_t r = 0; r < cr && !t->quant; r++) {
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

static const pd_backend_ops cuda_ops = {
    "cuda",
    op_free,
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
    NULL, // kv_scales: the pool holds the activation dtype
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
