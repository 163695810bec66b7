/* The CPU backend: fills the operation table of backend.h with f32 activations, weights kept
 * as stored (f32/bf16/f16, widened in registers) or converted at load, a paged f32 KV pool, and
 * kernels parallelized over a fork-join thread pool (common/util/threadpool.h).
 *
 * Design: every op runs synchronously on the calling thread plus the pool, so "in order until
 * sync" holds trivially and sync is a no-op. Work is split by output rows (matmul: ranges of W
 * rows; attention: (row, head) units; row-wise ops: ranges of rows), and each output element is
 * computed by exactly one kernel call whose reduction order depends only on its own inputs, so
 * results do not depend on the thread count, the batch composition or prefill chunking.
 * Kernel family (scalar, AVX-512, AVX-512 with bf16 dot products) is chosen once at create by
 * runtime feature detection.
 * The bf16 compute mode (compute_dtype BF16) stores every matrix in bf16 and rounds each
 * matmul's x rows to bf16 once per call into a workspace before the tiles run: with avx512_bf16
 * as bf16 for vdpbf16ps, otherwise as the bf16 values in f32 for the f32 kernels (the products
 * are exact there, so that is the same arithmetic emulated; its bits may differ from
 * vdpbf16ps, whose pairs of products are summed inside the instruction, but each path is
 * batch-invariant on its own).
 * Nothing allocates after create except weight_load/kv_create (load time); the KV pool's pages are
 * committed as the pool is first written (kv_create).
 */
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "backend/backend.h"
#include "backend/cpu/cpu_internal.h"
#include "util/status.h"
#include "util/threadpool.h"

typedef struct {
    pd_backend_params p;
    pd_threadpool *pool;
    int n_threads;
    pd_cpu_isa isa; /* resolved: SCALAR, AVX512 or AVX512_BF16 */
    bool bf16;      /* the bf16 compute mode (p.compute_dtype BF16) */
    cpu_mm_fn mm;
    cpu_dot_fn dot;
    cpu_axpy_fn axpy;
    pd_batch batch; /* the planned step (host pointers borrowed from the caller) */
    int planned;
    int32_t *row_seq; /* (max_tokens) sequence index of each planned row */
    /* bf16 mode: one matmul's x rounded to bf16, (max_tokens, xr_ld) bf16 with avx512_bf16, else
     * f32; xr_ld the largest ld of the loaded weights. An anonymous mapping (pages committed as
     * they are first written), sized by weight_load. */
    void *xr;
    size_t xr_ld, xr_bytes;
    /* GPTQ act order: x permuted for each weight of a matmul_multi call whose columns are
     * stored permuted, (PD_MATMUL_MULTI_MAX, max_tokens, xp_ld) f32, mapped like xr. */
    float *xp;
    size_t xp_ld, xp_bytes;
    /* W8A8: x rows quantized to int8 (cpu_quant_row_i8 layout), (max_tokens, xq_ld) bytes */
    uint8_t *xq;
    size_t xq_ld, xq_bytes;
    bool vnni; /* the W8A8 kernel uses vpdpbusd */
} cpu_be;

struct pd_kv {
    pd_kv_params p;
    uint8_t *k;         /* (n_layers, n_blocks, block_size, n_kv_heads, head_dim) f32 or fp8 */
    uint8_t *v;         /* same */
    size_t es;          /* bytes per element: 4, or 1 for fp8 */
    size_t layer_bytes; /* n_blocks * block_size * n_kv_heads * head_dim * es */
    size_t bytes;       /* of k and v together */
    float *scales;      /* fp8: (n_layers) K scales, then (n_layers) V scales; NULL for f32 */
};

static cpu_be *BE(const pd_backend *b)
{
    return pd_backend_impl(b);
}

/* 64-byte aligned allocation, size rounded up to the alignment. */
static void *alloc64(size_t bytes)
{
    if (bytes == 0) bytes = 64;
    size_t rounded = (bytes + 63) & ~(size_t)63;
    if (rounded < bytes) return NULL;
    return aligned_alloc(64, rounded);
}

/* ---- lifetime, memory ---------------------------------------------------------------------- */

static void cpu_free(pd_backend *b)
{
    cpu_be *be = BE(b);
    if (!be) return;
    pd_pool_free(be->pool);
    free(be->row_seq);
    if (be->xr) munmap(be->xr, be->xr_bytes);
    if (be->xp) munmap(be->xp, be->xp_bytes);
    if (be->xq) munmap(be->xq, be->xq_bytes);
    free(be);
}

static pd_dtype cpu_act_dtype(const pd_backend *b)
{
    return PD_DTYPE_F32;
}

static int cpu_buf_alloc(pd_backend *b, size_t bytes, void **out)
{
    void *p = alloc64(bytes);
    if (!p) return pd_error(PD_ENOMEM, "cpu backend: cannot allocate %zu bytes", bytes);
    /* Touch every page now (create time) rather than in the first forward step. */
    memset(p, 0, bytes);
    *out = p;
    return PD_OK;
}

static void cpu_buf_free(pd_backend *b, void *buf)
{
    free(buf);
}

static int cpu_copy(pd_backend *b, void *dst, const void *src, size_t bytes)
{
    if (bytes && (!dst || !src)) return pd_error(PD_EINVAL, "cpu backend: copy with NULL buffer");
    if (bytes) memcpy(dst, src, bytes);
    return PD_OK;
}

static int cpu_download_f32(pd_backend *b, float *dst, const void *src, size_t n)
{
    return cpu_copy(b, dst, src, n * sizeof(float));
}

static int cpu_upload_f32(pd_backend *b, void *dst, const float *src, size_t n)
{
    return cpu_copy(b, dst, src, n * sizeof(float));
}

static int cpu_sync(pd_backend *b)
{
    return PD_OK;
}

/* ---- weights --------------------------------------------------------------------------------- */

/* Makes a workspace (*buf, mapped, *bytes) hold copies x max_tokens rows of ld elements of es
 * bytes (load time); pages are committed as they are first written. */
static int ws_reserve(cpu_be *be, void **buf, size_t *cur_ld, size_t *bytes, size_t ld, size_t es,
                      size_t copies, const char *name)
{
    if (ld <= *cur_ld) return PD_OK;
    if (be->p.max_tokens > SIZE_MAX / es / ld / copies)
        return pd_error(PD_ERANGE, "weight_load: tensor %s: workspace size overflows", name);
    size_t n = be->p.max_tokens * ld * es * copies;
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return pd_error(PD_ENOMEM, "weight_load: tensor %s: cannot map a %zu-byte workspace", name,
                        n);
    if (*buf) munmap(*buf, *bytes);
    *buf = p;
    *cur_ld = ld;
    *bytes = n;
    return PD_OK;
}

/* bf16 mode: makes the x-rounding workspace hold max_tokens rows of ld (load time). */
static int xr_reserve(cpu_be *be, size_t ld, const char *name)
{
    if (!be->bf16) return PD_OK;
    size_t es = be->isa == PD_CPU_ISA_AVX512_BF16 ? 2 : 4;
    return ws_reserve(be, &be->xr, &be->xr_ld, &be->xr_bytes, ld, es, 1, name);
}

static int quant_load(cpu_be *be, const pd_tensor *t, const pd_weight_slice *s, pd_weight **out)
{
    if (be->bf16)
        return pd_error(PD_EUNSUPPORTED,
                        "weight_load: tensor %s: quantized weights compute in float32 on the CPU "
                        "(--dtype bfloat16 takes float checkpoints)",
                        t->name);
    PD_CHECK(cpu_qweight_load(t, s, out));
    int rc = PD_OK;
    if ((*out)->q == CPU_WQ_I8A8)
        rc = ws_reserve(be, (void **)&be->xq, &be->xq_ld, &be->xq_bytes, CPU_XQ_HEAD + (*out)->ld,
                        1, 1, t->name);
    if ((*out)->perm && rc == PD_OK)
        rc = ws_reserve(be, (void **)&be->xp, &be->xp_ld, &be->xp_bytes, (*out)->cols,
                        sizeof(float), PD_MATMUL_MULTI_MAX, t->name);
    if (rc < 0) {
        cpu_weight_release(*out);
        *out = NULL;
    }
    return rc;
}

static int cpu_weight_load(pd_backend *b, const pd_tensor *t, const pd_weight_slice *sl,
                           pd_weight **out)
{
    cpu_be *be = BE(b);
    const char *name = t && t->name ? t->name : "(unnamed)";
    if (!t || (!t->data && !t->quant))
        return pd_error(PD_EINVAL, "weight_load: tensor %s has no data", name);
    if (t->ndim != 1 && t->ndim != 2)
        return pd_error(PD_EINVAL, "weight_load: tensor %s: expected 1 or 2 dimensions, got %d",
                        name, t->ndim);
    if (pd_dtype_size(t->dtype) == 0)
        return pd_error(PD_EINVAL, "weight_load: tensor %s: bad dtype %d", name, (int)t->dtype);
    size_t rows = t->ndim == 1 ? 1 : (size_t)t->shape[0];
    size_t cols = (size_t)t->shape[t->ndim - 1];
    pd_weight_slice s = sl ? *sl : (pd_weight_slice){0, 0, 0, 0};
    if (s.nrows == 0 && s.row0 == 0) s.nrows = rows;
    if (s.ncols == 0 && s.col0 == 0) s.ncols = cols;
    if (s.nrows == 0 || s.ncols == 0 || s.row0 > rows || s.nrows > rows - s.row0 || s.col0 > cols ||
        s.ncols > cols - s.col0)
        return pd_error(PD_EINVAL,
                        "weight_load: tensor %s: slice rows [%zu, +%zu) cols [%zu, +%zu) outside "
                        "(%zu, %zu)",
                        name, s.row0, s.nrows, s.col0, s.ncols, rows, cols);
    if (t->quant) return quant_load(be, t, &s, out);
    if (!pd_dtype_is_float(t->dtype))
        return pd_error(PD_EINVAL, "weight_load: tensor %s: dtype %s is not a float dtype", name,
                        pd_dtype_st_name(t->dtype));

    pd_dtype dt = t->dtype;
    if (t->ndim == 1)
        dt = PD_DTYPE_F32; /* norms, biases: always f32 */
    else if (be->bf16)
        dt = PD_DTYPE_BF16; /* as vLLM's --dtype bfloat16 converts a checkpoint at load */
    else if (be->p.weight_dtype >= 0)
        dt = (pd_dtype)be->p.weight_dtype;
    if (pd_dtype_size(dt) == 0)
        return pd_error(PD_EINVAL, "weight_load: bad weight_dtype %d", be->p.weight_dtype);

    size_t es = pd_dtype_size(dt), ses = pd_dtype_size(t->dtype);
    size_t align = be->bf16 ? 32 : 16; /* vdpbf16ps takes 32 elements at a time */
    size_t ld = (s.ncols + align - 1) & ~(align - 1);
    if (t->ndim == 2) PD_CHECK(xr_reserve(be, ld, name));
    pd_weight *w = calloc(1, sizeof *w);
    if (!w) return pd_error(PD_ENOMEM, "weight_load: out of memory");
    w->dtype = dt;
    w->rows = s.nrows;
    w->cols = s.ncols;
    w->ld = ld;
    w->nbytes = s.nrows * ld * es;
    w->data = alloc64(w->nbytes);
    float *tmp = dt != t->dtype ? malloc(s.ncols * sizeof(float)) : NULL;
    if (!w->data || (dt != t->dtype && !tmp)) {
        free(w->data);
        free(w);
        free(tmp);
        return pd_error(PD_ENOMEM, "weight_load: tensor %s: cannot allocate %zu bytes", name,
                        s.nrows * ld * es);
    }
    for (size_t r = 0; r < s.nrows; r++) {
        const char *src = (const char *)t->data + ((s.row0 + r) * cols + s.col0) * ses;
        char *dst = (char *)w->data + r * ld * es;
        if (dt == t->dtype) {
            memcpy(dst, src, s.ncols * es);
        } else {
            pd_to_f32_n(t->dtype, src, tmp, s.ncols);
            pd_from_f32_n(dt, tmp, dst, s.ncols);
        }
        memset(dst + s.ncols * es, 0, (ld - s.ncols) * es);
    }
    free(tmp);
    *out = w;
    return PD_OK;
}

static void cpu_weight_free(pd_backend *b, pd_weight *w)
{
    cpu_weight_release(w);
}

static size_t cpu_weight_nbytes(const pd_backend *b, const pd_weight *w)
{
    return w ? w->nbytes : 0;
}

/* ---- KV cache ----------------------------------------------------------------------------------
 */

static int cpu_kv_create(pd_backend *b, const pd_kv_params *p, pd_kv **out)
{
    if (p->dtype != PD_DTYPE_F32 && p->dtype != PD_DTYPE_F8_E4M3)
        return pd_error(PD_EUNSUPPORTED,
                        "cpu backend: KV cache dtype %s not supported (float32, float8_e4m3fn)",
                        pd_dtype_name(p->dtype));
    if (p->n_layers <= 0 || p->n_blocks == 0 || p->block_size == 0 || p->n_kv_heads == 0 ||
        p->head_dim == 0)
        return pd_error(PD_EINVAL, "kv_create: every size must be positive");
    if (p->head_dim > CPU_MAX_HEAD_DIM)
        return pd_error(PD_EUNSUPPORTED, "kv_create: head_dim %zu > %d", p->head_dim,
                        CPU_MAX_HEAD_DIM);
    size_t per_block = p->block_size * p->n_kv_heads * p->head_dim;
    if (per_block / p->block_size != p->n_kv_heads * p->head_dim ||
        p->n_blocks > SIZE_MAX / 8 / per_block / (size_t)p->n_layers)
        return pd_error(PD_ERANGE, "kv_create: pool size overflows");
    pd_kv *kv = calloc(1, sizeof *kv);
    if (!kv) return pd_error(PD_ENOMEM, "kv_create: out of memory");
    kv->p = *p;
    kv->es = pd_dtype_size(p->dtype);
    kv->layer_bytes = p->n_blocks * per_block * kv->es;
    size_t bytes = kv->layer_bytes * (size_t)p->n_layers;
    if (p->dtype == PD_DTYPE_F8_E4M3) {
        kv->scales = malloc(2 * (size_t)p->n_layers * sizeof(float));
        if (!kv->scales) {
            free(kv);
            return pd_error(PD_ENOMEM, "kv_create: out of memory");
        }
        for (int i = 0; i < 2 * p->n_layers; i++) kv->scales[i] = 1.0f;
    }
    /* Anonymous mappings, not malloc + memset: their pages are zero (defined, for valgrind too)
       and committed when first written, so a large pool costs neither start-up time nor memory
       until it is used. Zeroing them would buy nothing: attention reads only positions < kv_len
       of its own block table, which a step, a KV transfer or a copy-on-write wrote first (a
       block moved whole carries its unwritten tail along, which nothing reads either). The
       first write of a page is what a request pays instead (a fault and the kernel zeroing it):
       transparent huge pages, where the host offers them, make that one fault per 2 MiB instead
       of per 4 KiB (on the 2-core development VM 12 MiB, a 512-token prompt's KV in the medium
       preset, took 69-79 ms to fault in 4 KiB pages and 1-31 ms in huge pages). */
    void *k = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    void *v = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (k == MAP_FAILED || v == MAP_FAILED) {
        if (k != MAP_FAILED) munmap(k, bytes);
        if (v != MAP_FAILED) munmap(v, bytes);
        free(kv->scales);
        free(kv);
        return pd_error(PD_ENOMEM, "kv_create: cannot map 2 x %zu bytes", bytes);
    }
#ifdef MADV_HUGEPAGE
    (void)madvise(k, bytes, MADV_HUGEPAGE); /* advice only: without THP, 4 KiB pages */
    (void)madvise(v, bytes, MADV_HUGEPAGE);
#endif
    kv->k = k;
    kv->v = v;
    kv->bytes = 2 * bytes;
    *out = kv;
    return PD_OK;
}

static void cpu_kv_free(pd_backend *b, pd_kv *kv)
{
    if (!kv) return;
    munmap(kv->k, kv->bytes / 2);
    munmap(kv->v, kv->bytes / 2);
    free(kv->scales);
    free(kv);
}

static int check_layer(const pd_kv *kv, int layer, const char *op)
{
    if (layer < 0 || layer >= kv->p.n_layers)
        return pd_error(PD_ERANGE, "%s: layer %d outside [0, %d)", op, layer, kv->p.n_layers);
    return PD_OK;
}

static int cpu_kv_view(pd_backend *b, const pd_kv *kv, int layer, pd_kv_layer_view *out)
{
    PD_CHECK(check_layer(kv, layer, "kv_layer"));
    out->k = kv->k + (size_t)layer * kv->layer_bytes;
    out->v = kv->v + (size_t)layer * kv->layer_bytes;
    out->head_stride = kv->p.head_dim * kv->es;
    out->token_stride = kv->p.n_kv_heads * out->head_stride;
    out->block_stride = kv->p.block_size * out->token_stride;
    out->dtype = kv->p.dtype;
    out->host_visible = 1;
    return PD_OK;
}

static int cpu_kv_scales(pd_backend *b, pd_kv *kv, int layer, float k_scale, float v_scale)
{
    PD_CHECK(check_layer(kv, layer, "kv_scales"));
    if (!kv->scales)
        return pd_error(PD_EINVAL, "kv_scales: the pool holds %s, not a quantized dtype",
                        pd_dtype_name(kv->p.dtype));
    if (!(k_scale > 0.0f) || !(v_scale > 0.0f) || !isfinite(k_scale) || !isfinite(v_scale))
        return pd_error(PD_EINVAL, "kv_scales: layer %d: scales %g, %g must be positive and finite",
                        layer, (double)k_scale, (double)v_scale);
    kv->scales[layer] = k_scale;
    kv->scales[kv->p.n_layers + layer] = v_scale;
    return PD_OK;
}

static int check_range(const pd_kv *kv, const pd_kv_range *r, const char *op)
{
    PD_CHECK(check_layer(kv, r->layer, op));
    if (r->n_heads == 0 || r->head0 > kv->p.n_kv_heads || r->n_heads > kv->p.n_kv_heads - r->head0)
        return pd_error(PD_ERANGE, "%s: heads [%zu, +%zu) outside [0, %zu)", op, r->head0,
                        r->n_heads, kv->p.n_kv_heads);
    for (size_t i = 0; i < r->n_blocks; i++)
        if (r->block_ids[i] < 0 || (size_t)r->block_ids[i] >= kv->p.n_blocks)
            return pd_error(PD_ERANGE, "%s: block_ids[%zu] = %d outside [0, %zu)", op, i,
                            r->block_ids[i], kv->p.n_blocks);
    return PD_OK;
}

/* dir 0: pool -> host, 1: host -> pool. */
static void kv_copy_range(pd_kv *kv, const pd_kv_range *r, char *host, int dir)
{
    const size_t D = kv->p.head_dim, bs = kv->p.block_size, H = kv->p.n_kv_heads;
    const size_t run = r->n_heads * D * kv->es; /* bytes copied per token */
    const size_t half = r->n_blocks * bs * run;
    for (int part = 0; part < 2; part++) {
        uint8_t *pool = (part ? kv->v : kv->k) + (size_t)r->layer * kv->layer_bytes;
        char *h = host + (size_t)part * half;
        for (size_t i = 0; i < r->n_blocks; i++)
            for (size_t t = 0; t < bs; t++) {
                uint8_t *pp =
                    pool + (((size_t)r->block_ids[i] * bs + t) * H + r->head0) * D * kv->es;
                char *hp = h + (i * bs + t) * run;
                if (dir == 0)
                    memcpy(hp, pp, run);
                else
                    memcpy(pp, hp, run);
            }
    }
}

static int cpu_kv_export(pd_backend *b, const pd_kv *kv, const pd_kv_range *r, void *host)
{
    PD_CHECK(check_range(kv, r, "kv_export"));
    kv_copy_range((pd_kv *)kv, r, host, 0);
    return PD_OK;
}

static int cpu_kv_import(pd_backend *b, pd_kv *kv, const pd_kv_range *r, const void *host)
{
    PD_CHECK(check_range(kv, r, "kv_import"));
    kv_copy_range(kv, r, (char *)host, 1);
    return PD_OK;
}

/* ---- plan --------------------------------------------------------------------------------------
 */

static int cpu_plan(pd_backend *b, const pd_batch *bt)
{
    cpu_be *be = BE(b);
    be->planned = 0;
    const pd_backend_params *p = &be->p;
    if (bt->n_tokens == 0 || bt->n_tokens > p->max_tokens)
        return pd_error(PD_ERANGE, "plan: n_tokens %zu outside [1, %zu]", bt->n_tokens,
                        p->max_tokens);
    if (bt->n_seqs == 0 || bt->n_seqs > p->max_seqs)
        return pd_error(PD_ERANGE, "plan: n_seqs %zu outside [1, %zu]", bt->n_seqs, p->max_seqs);
    if (bt->rope_dim == 0 || bt->rope_dim % 2 || bt->rope_dim > p->max_rope_dim)
        return pd_error(PD_ERANGE, "plan: rope_dim %zu must be even and in [2, %zu]", bt->rope_dim,
                        p->max_rope_dim);
    if (!bt->token_ids || !bt->positions || !bt->slots || !bt->rope_cos || !bt->rope_sin ||
        !bt->q_indptr || !bt->kv_len || !bt->block_indptr || (bt->n_out && !bt->out_rows))
        return pd_error(PD_EINVAL, "plan: a required array is NULL");
    if (bt->q_indptr[0] != 0 || (size_t)bt->q_indptr[bt->n_seqs] != bt->n_tokens)
        return pd_error(PD_EINVAL, "plan: q_indptr must start at 0 and end at n_tokens (%zu)",
                        bt->n_tokens);
    if (bt->block_indptr[0] != 0) return pd_error(PD_EINVAL, "plan: block_indptr[0] must be 0");
    for (size_t s = 0; s < bt->n_seqs; s++) {
        if (bt->q_indptr[s + 1] < bt->q_indptr[s])
            return pd_error(PD_EINVAL, "plan: q_indptr decreases at sequence %zu", s);
        if (bt->block_indptr[s + 1] < bt->block_indptr[s])
            return pd_error(PD_EINVAL, "plan: block_indptr decreases at sequence %zu", s);
        for (int32_t r = bt->q_indptr[s]; r < bt->q_indptr[s + 1]; r++) {
            if (bt->positions[r] < 0 || bt->positions[r] >= bt->kv_len[s])
                return pd_error(PD_ERANGE, "plan: positions[%d] = %d outside [0, kv_len[%zu] = %d)",
                                r, bt->positions[r], s, bt->kv_len[s]);
            if (bt->slots[r] < 0)
                return pd_error(PD_ERANGE, "plan: slots[%d] = %lld is negative", r,
                                (long long)bt->slots[r]);
            be->row_seq[r] = (int32_t)s;
        }
    }
    size_t nblk = (size_t)bt->block_indptr[bt->n_seqs];
    if (nblk > p->max_blocks)
        return pd_error(PD_ERANGE, "plan: %zu block-table entries > max_blocks %zu", nblk,
                        p->max_blocks);
    if (nblk && !bt->block_ids) return pd_error(PD_EINVAL, "plan: block_ids is NULL");
    for (size_t i = 0; i < bt->n_out; i++)
        if (bt->out_rows[i] < 0 || (size_t)bt->out_rows[i] >= bt->n_tokens ||
            (i && bt->out_rows[i] <= bt->out_rows[i - 1]))
            return pd_error(PD_EINVAL, "plan: out_rows[%zu] = %d not increasing in [0, %zu)", i,
                            bt->out_rows[i], bt->n_tokens);
    be->batch = *bt;
    be->planned = 1;
    return PD_OK;
}

static int need_plan(const cpu_be *be, const char *op)
{
    if (!be->planned) return pd_error(PD_EINVAL, "%s: no planned step (call plan first)", op);
    return PD_OK;
}

/* Splits [0, n) into about n_tasks ranges; task i gets [lo, hi). */
static void task_range(size_t n, int task, int n_tasks, size_t *lo, size_t *hi)
{
    *lo = n * (size_t)task / (size_t)n_tasks;
    *hi = n * (size_t)(task + 1) / (size_t)n_tasks;
}

/* Task count for n independent rows of `work` elements each: one task when small. */
static int row_tasks(const cpu_be *be, size_t n, size_t work)
{
    if (be->n_threads == 1 || n * work < 32768) return 1;
    size_t t = (size_t)be->n_threads * 4;
    return (int)(t < n ? t : n);
}

/* ---- embedding, norms, elementwise --------------------------------------------------------- */

typedef struct {
    cpu_be *be;
    const pd_weight *w;
    const float *x;
    const float *x2;
    float *y;
    float *h; /* add_rmsnorm: the normed rows */
    size_t n, dim;
    float eps;
} row_ctx;

static void embed_task(void *vctx, int task, int n_tasks)
{
    row_ctx *c = vctx;
    size_t lo, hi;
    task_range(c->n, task, n_tasks, &lo, &hi);
    size_t es = pd_dtype_size(c->w->dtype);
    for (size_t r = lo; r < hi; r++) {
        const char *src =
            (const char *)c->w->data + (size_t)c->be->batch.token_ids[r] * c->w->ld * es;
        pd_to_f32_n(c->w->dtype, src, c->y + r * c->dim, c->dim);
    }
}

static int cpu_embed(pd_backend *b, const pd_weight *table, void *out)
{
    cpu_be *be = BE(b);
    PD_CHECK(need_plan(be, "embed"));
    const pd_batch *bt = &be->batch;
    for (size_t r = 0; r < bt->n_tokens; r++)
        if (bt->token_ids[r] < 0 || (size_t)bt->token_ids[r] >= table->rows)
            return pd_error(PD_ERANGE, "embed: token_ids[%zu] = %d outside the vocabulary [0, %zu)",
                            r, bt->token_ids[r], table->rows);
    row_ctx c = {.be = be, .w = table, .y = out, .n = bt->n_tokens, .dim = table->cols};
    pd_pool_run(be->pool, embed_task, &c, row_tasks(be, c.n, c.dim));
    return PD_OK;
}

static void rmsnorm_task(void *vctx, int task, int n_tasks)
{
    row_ctx *c = vctx;
    size_t lo, hi;
    task_range(c->n, task, n_tasks, &lo, &hi);
    for (size_t r = lo; r < hi; r++)
        cpu_rmsnorm_row(c->x + r * c->dim, c->w->data, c->eps, c->dim, c->y + r * c->dim,
                        c->be->dot);
}

static int norm_weight_check(const pd_weight *w, size_t dim)
{
    if (w->rows != 1 || w->cols != dim || w->dtype != PD_DTYPE_F32)
        return pd_error(PD_EINVAL, "rmsnorm: weight is (%zu, %zu), expected (1, %zu)", w->rows,
                        w->cols, dim);
    return PD_OK;
}

static int cpu_rmsnorm(pd_backend *b, const void *x, const pd_weight *w, float eps, size_t n,
                       size_t dim, void *y)
{
    cpu_be *be = BE(b);
    PD_CHECK(norm_weight_check(w, dim));
    row_ctx c = {.be = be, .w = w, .x = x, .y = y, .n = n, .dim = dim, .eps = eps};
    pd_pool_run(be->pool, rmsnorm_task, &c, row_tasks(be, n, dim));
    return PD_OK;
}

/* y += x, then h = rmsnorm(y), a row at a time while the row is in cache. */
static void add_rmsnorm_task(void *vctx, int task, int n_tasks)
{
    row_ctx *c = vctx;
    size_t lo, hi;
    task_range(c->n, task, n_tasks, &lo, &hi);
    for (size_t r = lo; r < hi; r++) {
        float *yr = c->y + r * c->dim;
        const float *xr = c->x + r * c->dim;
        for (size_t i = 0; i < c->dim; i++) yr[i] += xr[i];
        cpu_rmsnorm_row(yr, c->w->data, c->eps, c->dim, c->h + r * c->dim, c->be->dot);
    }
}

static int cpu_add_rmsnorm(pd_backend *b, void *y, const void *x, const pd_weight *w, float eps,
                           size_t n, size_t dim, void *h)
{
    cpu_be *be = BE(b);
    PD_CHECK(norm_weight_check(w, dim));
    row_ctx c = {.be = be, .w = w, .x = x, .y = y, .h = h, .n = n, .dim = dim, .eps = eps};
    pd_pool_run(be->pool, add_rmsnorm_task, &c, row_tasks(be, n, dim));
    return PD_OK;
}

static void swiglu_task(void *vctx, int task, int n_tasks)
{
    row_ctx *c = vctx;
    size_t lo, hi;
    task_range(c->n, task, n_tasks, &lo, &hi);
    for (size_t r = lo; r < hi; r++)
        cpu_swiglu_row(c->x + r * c->dim, c->x2 + r * c->dim, c->dim, c->y + r * c->dim);
}

static int cpu_swiglu(pd_backend *b, const void *gate, const void *up, size_t n, size_t dim,
                      void *out)
{
    cpu_be *be = BE(b);
    row_ctx c = {.be = be, .x = gate, .x2 = up, .y = out, .n = n, .dim = dim};
    pd_pool_run(be->pool, swiglu_task, &c, row_tasks(be, n, dim * 8));
    return PD_OK;
}

static int cpu_add(pd_backend *b, void *y, const void *x, size_t n_elems)
{
    float *yf = y;
    const float *xf = x;
    for (size_t i = 0; i < n_elems; i++) yf[i] += xf[i];
    return PD_OK;
}

static int cpu_gather_rows(pd_backend *b, const void *x, size_t dim, void *out)
{
    cpu_be *be = BE(b);
    PD_CHECK(need_plan(be, "gather_rows"));
    for (size_t i = 0; i < be->batch.n_out; i++)
        memcpy((float *)out + i * dim, (const float *)x + (size_t)be->batch.out_rows[i] * dim,
               dim * sizeof(float));
    return PD_OK;
}

/* ---- matmul ---------------------------------------------------------------------------------- */

/* Prefill: bytes of W one task keeps hot (L2) while every x row tile passes over it. */
#ifndef MM_CHUNK_KB
#define MM_CHUNK_KB 96
#endif

/* One matmul_multi call: weight i's rows are split into tasks of chunk[i] rows; tasks of
 * weight i are [task0[i], task0[i + 1]). */
typedef struct {
    cpu_be *be;
    const float *x;     /* (n, ldx) f32: the caller's rows, or (bf16 mode, no avx512_bf16) their
                           values rounded to bf16 */
    const uint16_t *xb; /* bf16 mode with avx512_bf16: (n, ldx) the rows rounded; else NULL */
    size_t ldx;
    size_t n, n_w;
    const pd_weight *w[PD_MATMUL_MULTI_MAX];
    const float *bias[PD_MATMUL_MULTI_MAX];
    const float *xw[PD_MATMUL_MULTI_MAX]; /* weight i's x when its columns are permuted */
    const uint8_t *xq;                    /* W8A8 weights' x, quantized; row stride ldxq */
    size_t ldxq;
    float *y[PD_MATMUL_MULTI_MAX];
    size_t chunk[PD_MATMUL_MULTI_MAX];
    size_t task0[PD_MATMUL_MULTI_MAX + 1];
} mm_ctx;

static void mm_task(void *vctx, int task, int n_tasks)
{
    mm_ctx *c = vctx;
    size_t i = 0, t = (size_t)task;
    while (t >= c->task0[i + 1]) i++;
    const pd_weight *w = c->w[i];
    size_t j0 = (t - c->task0[i]) * c->chunk[i];
    size_t j1 = j0 + c->chunk[i] < w->rows ? j0 + c->chunk[i] : w->rows;
    if (w->q == CPU_WQ_I8A8)
        (c->be->vnni ? cpu_mm_i8a8_vnni : cpu_mm_i8a8_scalar)(c->xq, c->n, c->ldxq, w, j0, j1,
                                                              c->bias[i], c->y[i], w->rows);
    else if (c->xb)
        cpu_mm_avx512bf16(c->xb, c->n, c->ldx, w, j0, j1, c->bias[i], c->y[i], w->rows);
    else
        c->be->mm(c->xw[i] ? c->xw[i] : c->x, c->n, c->ldx, w, j0, j1, c->bias[i], c->y[i],
                  w->rows);
}

/* W8A8: rows of x (n, K) quantized into xq (row stride ld bytes). */
typedef struct {
    const float *x;
    uint8_t *xq;
    size_t n, K, ld;
    bool simd;
} xq_ctx;

static void xq_task(void *vctx, int task, int n_tasks)
{
    xq_ctx *c = vctx;
    size_t lo, hi;
    task_range(c->n, task, n_tasks, &lo, &hi);
    for (size_t r = lo; r < hi; r++)
        (c->simd ? cpu_quant_row_i8_avx512
                 : cpu_quant_row_i8)(c->x + r * c->K, c->K, c->ld - CPU_XQ_HEAD, c->xq + r * c->ld);
}

/* Act order: rows of x (n, K) into xp with column k = x column perm[k]. */
typedef struct {
    cpu_be *be;
    const float *x;
    float *xp;
    const int32_t *perm;
    size_t n, K;
} perm_ctx;

static void perm_task(void *vctx, int task, int n_tasks)
{
    perm_ctx *c = vctx;
    size_t lo, hi;
    task_range(c->n, task, n_tasks, &lo, &hi);
    for (size_t r = lo; r < hi; r++)
        for (size_t k = 0; k < c->K; k++) c->xp[r * c->K + k] = c->x[r * c->K + c->perm[k]];
}

/* bf16 mode: rows of x (n, K) rounded to bf16 into the workspace (row stride ld). */
typedef struct {
    cpu_be *be;
    const float *x;
    size_t n, K, ld;
} round_ctx;

static void round_task(void *vctx, int task, int n_tasks)
{
    round_ctx *c = vctx;
    size_t lo, hi;
    task_range(c->n, task, n_tasks, &lo, &hi);
    for (size_t r = lo; r < hi; r++) {
        const float *x = c->x + r * c->K;
        if (c->be->isa == PD_CPU_ISA_AVX512_BF16) {
            cpu_round_bf16_avx512bf16(x, c->K, (uint16_t *)c->be->xr + r * c->ld, c->ld);
        } else {
            float *xr = (float *)c->be->xr + r * c->ld;
            for (size_t k = 0; k < c->K; k++) xr[k] = pd_bf16_to_f32(pd_f32_to_bf16(x[k]));
        }
    }
}

/* W rows per task for an n-row product with w. */
static size_t mm_chunk(const cpu_be *be, size_t n, const pd_weight *w)
{
    size_t out = w->rows, chunk;
    if (be->n_threads == 1) return out ? out : 1;
    if (n <= 2) {
        /* Decode: weight streaming; about 8 tasks per thread for balance, 8-row multiples. */
        size_t per = (out + (size_t)be->n_threads * 8 - 1) / ((size_t)be->n_threads * 8);
        chunk = (per + 7) & ~(size_t)7;
    } else {
        /* Prefill: a W chunk of MM_CHUNK_KB stays in L2 while all x row tiles pass over it. */
        size_t row_bytes = w->q ? cpu_wq_row_bytes(w->q, w->ld) : w->ld * pd_dtype_size(w->dtype);
        chunk = ((size_t)MM_CHUNK_KB * 1024) / row_bytes;
        chunk &= ~(size_t)3;
        if (chunk < 4) chunk = 4;
        size_t fair = (out + (size_t)be->n_threads - 1) / (size_t)be->n_threads;
        if (chunk > fair) chunk = (fair + 3) & ~(size_t)3;
    }
    return chunk ? chunk : 4;
}

/* The products of several weights with one x in one fork-join (q/k/v, gate/up). */
static int cpu_matmul_multi(pd_backend *b, const void *x, size_t n, size_t n_w,
                            const pd_weight *const *w, const pd_weight *const *bias, void *const *y)
{
    cpu_be *be = BE(b);
    if (n_w < 1 || n_w > PD_MATMUL_MULTI_MAX)
        return pd_error(PD_EINVAL, "matmul: %zu weights in one call, expected 1 to %d", n_w,
                        PD_MATMUL_MULTI_MAX);
    mm_ctx c = {.be = be, .x = x, .ldx = w[0]->cols, .n = n, .n_w = n_w};
    for (size_t i = 0; i < n_w; i++) {
        const pd_weight *bi = bias ? bias[i] : NULL;
        if (bi && (bi->rows != 1 || bi->cols != w[i]->rows || bi->dtype != PD_DTYPE_F32))
            return pd_error(PD_EINVAL, "matmul: bias is (%zu, %zu), expected (1, %zu)", bi->rows,
                            bi->cols, w[i]->rows);
        if (w[i]->cols != w[0]->cols)
            return pd_error(PD_EINVAL, "matmul: weight %zu has %zu columns, weight 0 has %zu", i,
                            w[i]->cols, w[0]->cols);
        c.w[i] = w[i];
        c.bias[i] = bi ? bi->data : NULL;
        c.y[i] = y[i];
        c.chunk[i] = mm_chunk(be, n, w[i]);
        c.task0[i + 1] = c.task0[i] + (w[i]->rows + c.chunk[i] - 1) / c.chunk[i];
    }
    if (n == 0 || c.task0[n_w] == 0) return PD_OK;
    for (size_t i = 0; i < n_w; i++) {
        if (w[i]->q != CPU_WQ_I8A8 || c.xq) continue;
        if (n > be->p.max_tokens)
            return pd_error(PD_EINVAL, "matmul: %zu rows, the backend's max_tokens is %zu", n,
                            be->p.max_tokens);
        xq_ctx qc = {.x = x, .xq = be->xq, .n = n, .K = w[i]->cols, .simd = be->vnni};
        qc.ld = CPU_XQ_HEAD + w[i]->ld;
        pd_pool_run(be->pool, xq_task, &qc, row_tasks(be, n, qc.K));
        c.xq = be->xq;
        c.ldxq = qc.ld;
    }
    for (size_t i = 0; i < n_w; i++) {
        if (!w[i]->perm) continue;
        if (n > be->p.max_tokens)
            return pd_error(PD_EINVAL, "matmul: %zu rows, the backend's max_tokens is %zu", n,
                            be->p.max_tokens);
        perm_ctx pc = {.be = be, .x = x, .perm = w[i]->perm, .n = n, .K = w[i]->cols};
        pc.xp = be->xp + i * be->p.max_tokens * be->xp_ld;
        pd_pool_run(be->pool, perm_task, &pc, row_tasks(be, n, pc.K));
        c.xw[i] = pc.xp;
    }
    if (be->bf16) {
        /* Once per call, not per tile; every weight of the mode is bf16 (weight_load). */
        if (n > be->p.max_tokens)
            return pd_error(PD_EINVAL, "matmul: %zu rows, the backend's max_tokens is %zu", n,
                            be->p.max_tokens);
        bool dot = be->isa == PD_CPU_ISA_AVX512_BF16;
        round_ctx rc = {.be = be, .x = x, .n = n, .K = w[0]->cols};
        rc.ld = dot ? w[0]->ld : rc.K;
        pd_pool_run(be->pool, round_task, &rc, row_tasks(be, n, rc.K));
        c.ldx = rc.ld;
        if (dot)
            c.xb = be->xr;
        else
            c.x = be->xr;
    }
    pd_pool_run(be->pool, mm_task, &c, (int)c.task0[n_w]);
    return PD_OK;
}

static int cpu_matmul(pd_backend *b, const void *x, size_t n, const pd_weight *w,
                      const pd_weight *bias, void *y)
{
    return cpu_matmul_multi(b, x, n, 1, &w, &bias, &y);
}

static int cpu_matmul_swiglu(pd_backend *b, const void *x, size_t n, const pd_weight *wg,
                             const pd_weight *wu, void *g, void *u, void *out)
{
    if (wg->rows != wu->rows)
        return pd_error(PD_EINVAL, "matmul_swiglu: gate has %zu rows, up %zu", wg->rows, wu->rows);
    const pd_weight *w[2] = {wg, wu};
    void *y[2] = {g, u};
    PD_CHECK(cpu_matmul_multi(b, x, n, 2, w, NULL, y));
    return cpu_swiglu(b, g, u, n, wg->rows, out);
}

/* ---- rope, KV write, attention ------------------------------------------------------------ */

static int cpu_rope(pd_backend *b, void *x, size_t n_heads, size_t head_dim)
{
    cpu_be *be = BE(b);
    PD_CHECK(need_plan(be, "rope"));
    const pd_batch *bt = &be->batch;
    if (head_dim != bt->rope_dim)
        return pd_error(PD_EINVAL, "rope: head_dim %zu != planned rope_dim %zu", head_dim,
                        bt->rope_dim);
    size_t half = head_dim / 2;
    for (size_t r = 0; r < bt->n_tokens; r++)
        cpu_rope_row((float *)x + r * n_heads * head_dim, n_heads, head_dim,
                     bt->rope_cos + r * half, bt->rope_sin + r * half);
    return PD_OK;
}

static int cpu_kv_write(pd_backend *b, pd_kv *kv, int layer, const void *k, const void *v)
{
    cpu_be *be = BE(b);
    PD_CHECK(need_plan(be, "kv_write"));
    PD_CHECK(check_layer(kv, layer, "kv_write"));
    const pd_batch *bt = &be->batch;
    size_t te = kv->p.n_kv_heads * kv->p.head_dim, cap = kv->p.n_blocks * kv->p.block_size;
    uint8_t *kl = kv->k + (size_t)layer * kv->layer_bytes;
    uint8_t *vl = kv->v + (size_t)layer * kv->layer_bytes;
    for (size_t r = 0; r < bt->n_tokens; r++)
        if ((uint64_t)bt->slots[r] >= cap)
            return pd_error(PD_ERANGE, "kv_write: slots[%zu] = %lld outside the pool [0, %zu)", r,
                            (long long)bt->slots[r], cap);
    for (size_t r = 0; r < bt->n_tokens; r++) {
        const float *kr = (const float *)k + r * te, *vr = (const float *)v + r * te;
        size_t at = (size_t)bt->slots[r] * te * kv->es;
        if (!kv->scales) {
            memcpy(kl + at, kr, te * sizeof(float));
            memcpy(vl + at, vr, te * sizeof(float));
            continue;
        }
        float ik = 1.0f / kv->scales[layer], iv = 1.0f / kv->scales[kv->p.n_layers + layer];
        for (size_t i = 0; i < te; i++) {
            kl[at + i] = pd_f32_to_f8e4m3(kr[i] * ik);
            vl[at + i] = pd_f32_to_f8e4m3(vr[i] * iv);
        }
    }
    return PD_OK;
}

static int cpu_rope_kv_write(pd_backend *b, pd_kv *kv, int layer, void *q, size_t n_q_heads,
                             void *k, const void *v)
{
    PD_CHECK(check_layer(kv, layer, "rope_kv_write"));
    PD_CHECK(cpu_rope(b, q, n_q_heads, kv->p.head_dim));
    PD_CHECK(cpu_rope(b, k, kv->p.n_kv_heads, kv->p.head_dim));
    return cpu_kv_write(b, kv, layer, k, v);
}

typedef struct {
    cpu_be *be;
    cpu_kv_layer layer;
    const float *q;
    float *out;
    size_t n_q_heads, group, n_units;
    float scale;
} attn_ctx;

static void attn_task(void *vctx, int task, int n_tasks)
{
    attn_ctx *c = vctx;
    const pd_batch *bt = &c->be->batch;
    size_t lo, hi, D = c->layer.head_dim;
    task_range(c->n_units, task, n_tasks, &lo, &hi);
    for (size_t u = lo; u < hi; u++) {
        size_t r = u / c->n_q_heads, h = u % c->n_q_heads;
        int32_t s = c->be->row_seq[r];
        const int32_t *table = bt->block_ids + bt->block_indptr[s];
        size_t off = (r * c->n_q_heads + h) * D;
        size_t n_ctx = (size_t)bt->positions[r] + 1;
        if (c->be->isa != PD_CPU_ISA_SCALAR &&
            cpu_attention_head_avx512(c->q + off, &c->layer, (int)(h / c->group), table, n_ctx,
                                      c->scale, c->out + off))
            continue;
        cpu_attention_head(c->q + off, &c->layer, (int)(h / c->group), table, n_ctx, c->scale,
                           c->out + off, c->be->dot, c->be->axpy);
    }
}

static int cpu_attention(pd_backend *b, const pd_kv *kv, int layer, const void *q, size_t n_q_heads,
                         float scale, void *out)
{
    cpu_be *be = BE(b);
    PD_CHECK(need_plan(be, "attention"));
    PD_CHECK(check_layer(kv, layer, "attention"));
    const pd_batch *bt = &be->batch;
    size_t H = kv->p.n_kv_heads;
    if (n_q_heads == 0 || n_q_heads % H)
        return pd_error(PD_EINVAL, "attention: %zu query heads not a multiple of %zu kv heads",
                        n_q_heads, H);
    for (size_t s = 0; s < bt->n_seqs; s++) {
        size_t nb = (size_t)(bt->block_indptr[s + 1] - bt->block_indptr[s]);
        if ((size_t)bt->kv_len[s] > nb * kv->p.block_size)
            return pd_error(PD_ERANGE,
                            "attention: sequence %zu: kv_len %d exceeds its %zu blocks of %zu", s,
                            bt->kv_len[s], nb, kv->p.block_size);
        for (int32_t i = bt->block_indptr[s]; i < bt->block_indptr[s + 1]; i++)
            if (bt->block_ids[i] < 0 || (size_t)bt->block_ids[i] >= kv->p.n_blocks)
                return pd_error(PD_ERANGE, "attention: block_ids[%d] = %d outside [0, %zu)", i,
                                bt->block_ids[i], kv->p.n_blocks);
    }
    attn_ctx c = {
        .be = be,
        .layer = {.k = kv->k + (size_t)layer * kv->layer_bytes,
                  .v = kv->v + (size_t)layer * kv->layer_bytes,
                  .block_size = kv->p.block_size,
                  .token_elems = H * kv->p.head_dim,
                  .head_dim = kv->p.head_dim,
                  .fp8 = kv->scales != NULL,
                  .k_scale = kv->scales ? kv->scales[layer] : 1.0f,
                  .v_scale = kv->scales ? kv->scales[kv->p.n_layers + layer] : 1.0f},
        .q = q,
        .out = out,
        .n_q_heads = n_q_heads,
        .group = n_q_heads / H,
        .n_units = bt->n_tokens * n_q_heads,
        .scale = scale,
    };
    /* Short contexts (decode with a few hundred keys) are cheaper inline than a pool run. */
    size_t work = 0;
    for (size_t r = 0; r < bt->n_tokens; r++) work += (size_t)bt->positions[r] + 1;
    work *= n_q_heads * kv->p.head_dim;
    int n_tasks = be->n_threads == 1 || work < ((size_t)1 << 17)
                      ? 1
                      : (int)(c.n_units < 256 ? c.n_units : 256);
    pd_pool_run(be->pool, attn_task, &c, n_tasks);
    return PD_OK;
}

/* ---- table and create -------------------------------------------------------------------------
 */

static const pd_backend_ops cpu_ops = {
    .name = "cpu",
    .free = cpu_free,
    .act_dtype = cpu_act_dtype,
    .buf_alloc = cpu_buf_alloc,
    .buf_free = cpu_buf_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .download_f32 = cpu_download_f32,
    .upload_f32 = cpu_upload_f32,
    .sync = cpu_sync,
    .weight_load = cpu_weight_load,
    .weight_free = cpu_weight_free,
    .weight_nbytes = cpu_weight_nbytes,
    .kv_create = cpu_kv_create,
    .kv_free = cpu_kv_free,
    .kv_layer = cpu_kv_view,
    .kv_scales = cpu_kv_scales,
    .kv_export = cpu_kv_export,
    .kv_import = cpu_kv_import,
    .plan = cpu_plan,
    .embed = cpu_embed,
    .rmsnorm = cpu_rmsnorm,
    .matmul = cpu_matmul,
    .rope = cpu_rope,
    .kv_write = cpu_kv_write,
    .attention = cpu_attention,
    .swiglu = cpu_swiglu,
    .add = cpu_add,
    .gather_rows = cpu_gather_rows,
    .matmul_multi = cpu_matmul_multi,
    .rope_kv_write = cpu_rope_kv_write,
    .add_rmsnorm = cpu_add_rmsnorm,
    .matmul_swiglu = cpu_matmul_swiglu,
};

/* The pool of p->n_threads threads, or of the cores p->cpus pins it to; joined to the host
 * budget p->cpu_budget (util/cores.h). */
static int cpu_pool_create(const pd_backend_params *p, pd_threadpool **out)
{
    pd_threadpool *pool = pd_pool_create(p->cpus ? p->n_cpus : p->n_threads);
    if (!pool) return pd_error(PD_ENOMEM, "cpu backend: out of memory");
    int rc = PD_OK;
    if (p->cpus) {
        rc = pd_pool_pin(pool, p->cpus, p->n_cpus);
    } else if (p->cpu_budget) {
        pd_cores *budget = NULL;
        rc = pd_cores_open(p->cpu_budget, 0, &budget);
        if (rc == PD_OK) pd_pool_share(pool, budget, p->cpu_share);
    }
    if (rc != PD_OK) {
        pd_pool_free(pool);
        return rc;
    }
    *out = pool;
    return PD_OK;
}

int pd_backend_cpu_create(const pd_backend_params *params, pd_backend **out)
{
    pd_backend_params p = params ? *params : pd_backend_default_params();
    if (p.max_tokens == 0 || p.max_seqs == 0 || p.max_rope_dim == 0)
        return pd_error(PD_EINVAL, "cpu backend: max_tokens, max_seqs, max_rope_dim must be > 0");
    if (p.weight_dtype >= PD_DTYPE_COUNT)
        return pd_error(PD_EINVAL, "cpu backend: weight_dtype %d is not a dtype", p.weight_dtype);
    if (p.compute_dtype != -1 && p.compute_dtype != PD_DTYPE_F32 &&
        p.compute_dtype != PD_DTYPE_BF16)
        return pd_error(PD_EUNSUPPORTED,
                        "cpu backend: compute_dtype %d is not supported (float32 or bfloat16)",
                        p.compute_dtype);
    if (p.compute_dtype == PD_DTYPE_BF16 && p.weight_dtype != -1 && p.weight_dtype != PD_DTYPE_BF16)
        return pd_error(PD_EINVAL,
                        "cpu backend: weight_dtype %d with compute_dtype bfloat16 (its weights "
                        "are bfloat16)",
                        p.weight_dtype);
    pd_cpu_isa isa = p.cpu_isa;
    if (isa == PD_CPU_ISA_AUTO)
        isa = cpu_have_avx512bf16() ? PD_CPU_ISA_AVX512_BF16
              : cpu_have_avx512()   ? PD_CPU_ISA_AVX512
                                    : PD_CPU_ISA_SCALAR;
    else if (isa == PD_CPU_ISA_AVX512 && !cpu_have_avx512())
        return pd_error(PD_EUNSUPPORTED, "cpu backend: this CPU lacks avx512f/f16c");
    else if (isa == PD_CPU_ISA_AVX512_BF16 && !cpu_have_avx512bf16())
        return pd_error(PD_EUNSUPPORTED,
                        "cpu backend: this CPU or build lacks avx512_bf16 (or avx512f/f16c)");
    else if (isa != PD_CPU_ISA_SCALAR && isa != PD_CPU_ISA_AVX512 && isa != PD_CPU_ISA_AVX512_BF16)
        return pd_error(PD_EINVAL, "cpu backend: unknown cpu_isa %d", (int)isa);

    cpu_be *be = calloc(1, sizeof *be);
    if (!be) return pd_error(PD_ENOMEM, "cpu backend: out of memory");
    be->p = p;
    be->isa = isa;
    be->bf16 = p.compute_dtype == PD_DTYPE_BF16;
    bool simd = isa != PD_CPU_ISA_SCALAR; /* AVX512_BF16 is AVX512 outside the bf16 matmul */
    be->mm = simd ? cpu_mm_avx512 : cpu_mm_scalar;
    be->dot = simd ? cpu_dot_avx512 : cpu_dot_scalar;
    be->axpy = simd ? cpu_axpy_avx512 : cpu_axpy_scalar;
    be->vnni = simd && cpu_have_avx512vnni();
    int rc = cpu_pool_create(&p, &be->pool);
    if (rc != PD_OK) {
        free(be);
        return rc;
    }
    be->row_seq = malloc(p.max_tokens * sizeof(int32_t));
    pd_backend *b = be->row_seq ? pd_backend_wrap(&cpu_ops, be) : NULL;
    if (!b) {
        pd_pool_free(be->pool);
        free(be->row_seq);
        free(be);
        return pd_error(PD_ENOMEM, "cpu backend: out of memory");
    }
    be->n_threads = pd_pool_size(be->pool);
    *out = b;
    return PD_OK;
}
