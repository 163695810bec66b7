// The CUDA backend's plain ops (cuda_be.cuh): each op checks its arguments on the host and hands
// a tape entry to step_op (cuda_step.cu); tape_exec then executes an entry on the step stream,
// calling cuBLAS or a launcher of k_*.cu, for every op (the fused ones of cuda_fused.cu too).
//
// Design: matrix products take our GEMV for n <= CUDA_GEMV_MAX_N rows (decode) and cuBLAS GemmEx
// (f32 accumulation) otherwise. Attention's work list depends on the head layout, so it is built
// on the host at the step's first attention call and copied with the first attention launch.
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_be.cuh"

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

int exec_matmul(cuda_be *cb, const void *x, size_t n, const pd_weight *w, const pd_weight *bias,
                void *y)
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

int tape_exec(cuda_be *cb, const tape_ent *e)
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

// ---- ops --------------------------------------------------------------------------------------

int op_embed(pd_backend *b, const pd_weight *table, void *out)
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

int norm_check(const pd_weight *w, size_t n, size_t dim)
{
    if (w->dtype != PD_DTYPE_F32 || w->rows * w->cols != dim)
        return pd_error(PD_EINVAL, "cuda rmsnorm: weight is (%zu, %zu) %s, need %zu f32", w->rows,
                        w->cols, pd_dtype_name(w->dtype), dim);
    if (n > 0x7fffffffu) return pd_error(PD_EINVAL, "cuda rmsnorm: %zu rows is too many", n);
    return PD_OK;
}

// h = rmsnorm(x) (add NULL: T_RMSNORM), or x + add into xo (== x: in place), h = rmsnorm(xo)
// (T_ADD_RMSNORM): one entry.
int norm_entry(pd_backend *b, const void *x, const void *add, void *xo, const pd_weight *w,
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

int op_rmsnorm(pd_backend *b, const void *x, const pd_weight *w, float eps, size_t n, size_t dim,
               void *y)
{
    return norm_entry(b, x, NULL, NULL, w, eps, n, dim, y);
}

int matmul_check(const pd_weight *w, const pd_weight *bias, size_t n)
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

int op_matmul(pd_backend *b, const void *x, size_t n, const pd_weight *w, const pd_weight *bias,
              void *y)
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

int op_rope(pd_backend *b, void *x, size_t n_heads, size_t head_dim)
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

int op_kv_write(pd_backend *b, pd_kv *kv, int layer, const void *k, const void *v)
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

int op_attention(pd_backend *b, const pd_kv *kv, int layer, const void *q, size_t n_q_heads,
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

int op_swiglu(pd_backend *b, const void *gate, const void *up, size_t n, size_t dim, void *out)
{
    tape_ent e = ent(T_SWIGLU);
    e.p[0] = gate;
    e.p[1] = up;
    e.p[2] = out;
    e.z[0] = n * dim;
    return step_op(BE(b), &e);
}

int op_add(pd_backend *b, void *y, const void *x, size_t n_elems)
{
    tape_ent e = ent(T_ADD);
    e.p[0] = y;
    e.p[1] = x;
    e.z[0] = n_elems;
    return step_op(BE(b), &e);
}

int op_gather_rows(pd_backend *b, const void *x, size_t dim, void *out)
{
    cuda_be *cb = BE(b);
    PD_CHECK(need_plan(cb, "gather_rows"));
    tape_ent e = ent(T_GATHER);
    e.p[0] = x;
    e.p[1] = out;
    e.z[0] = dim;
    return step_op(cb, &e);
}
