/* Quantized weights on the CPU backend: a slice of a checkpoint's quantized linear (model/quant.h)
 * repacked into the layout cpu_internal.h describes, which tile_q (cpu_matmul.c) dequantizes in
 * registers.
 *
 * Design: the values come through pd_qweight_unpack (a byte per value, f32 scales and zero
 * points), so no packing order of a checkpoint format is known here. GPTQ act order assigns input
 * columns to groups in any order; the columns are then stored sorted by group (stable, so a
 * checkpoint whose groups are already contiguous keeps its order and gets no permutation) and
 * each matmul permutes x to match (cpu_backend.c). A tensor-parallel column slice must hold whole
 * groups, as in vLLM.
 */
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu_internal.h"
#include "model/quant.h"
#include "util/status.h"

static cpu_wq wq_of(const pd_qweight *q)
{
    if (q->cfg->kind == PD_QKIND_FP8) return CPU_WQ_FP8;
    if (q->cfg->kind == PD_QKIND_INT8) return q->cfg->act_int8 ? CPU_WQ_I8A8 : CPU_WQ_I8;
    return q->cfg->bits == 4 ? CPU_WQ_U4 : CPU_WQ_U8;
}

void cpu_weight_release(pd_weight *w)
{
    if (!w) return;
    free(w->data);
    free(w->scale);
    free(w->zero);
    free(w->perm);
    free(w->wsum);
    free(w);
}

/* The stored order of the slice's nc columns (perm[k] = slice column) sorted by group, and the
 * group of each stored group (gid, ng entries). PD_EINVAL when a group is not whole. */
static int order_columns(const pd_qweight *q, size_t c0, size_t nc, int32_t *perm, int64_t *gid,
                         size_t *ng, size_t *gs)
{
    const int64_t G = q->cfg->kind == PD_QKIND_INT ? q->group_size : (int64_t)nc;
    size_t n = 0;
    if (!q->g_idx.data) {
        if (q->cfg->kind == PD_QKIND_INT && (c0 % (size_t)G != 0 || nc % (size_t)G != 0))
            goto split;
        for (size_t k = 0; k < nc; k++) perm[k] = (int32_t)k;
        for (size_t g = 0; g < nc / (size_t)G; g++) gid[g] = (int64_t)(c0 / (size_t)G + g);
        *ng = nc / (size_t)G;
        *gs = (size_t)G;
        return PD_OK;
    }
    /* counting sort of the slice's columns by group: groups in increasing order, each whole */
    for (int64_t g = 0; g < q->n_groups; g++) {
        size_t first = n;
        for (size_t k = 0; k < nc; k++)
            if (pd_qweight_group(q, (int64_t)(c0 + k)) == g) perm[n++] = (int32_t)k;
        if (n == first) continue;
        if (n - first != (size_t)G) goto split;
        gid[n / (size_t)G - 1] = g;
    }
    *ng = nc / (size_t)G;
    *gs = (size_t)G;
    return PD_OK;
split:
    return pd_error(PD_EINVAL,
                    "weight_load: tensor %s: columns [%zu, +%zu) split a quantization group of "
                    "%lld (the tensor-parallel size must divide in_features / group_size)",
                    q->prefix, c0, nc, (long long)G);
}

/* Packs row r of the unpacked values (in stored column order perm) into dst. */
static void pack_row(cpu_wq wq, const uint8_t *val, const int32_t *perm, size_t nc, uint8_t *dst)
{
    for (size_t k = 0; k < nc; k++) {
        uint8_t v = val[perm[k]];
        if (wq != CPU_WQ_U4)
            dst[k] = v;
        else /* word k % 16 of the 128-column block, nibble (k % 128) / 16 */
            dst[(k / 128) * 64 + 4 * (k % 16) + (k % 128) / 32] |=
                (uint8_t)((k % 128) / 16 % 2 ? v << 4 : v);
    }
}

int cpu_qweight_load(const pd_tensor *t, const pd_weight_slice *s, pd_weight **out)
{
    const pd_qweight *q = t->quant;
    const cpu_wq wq = wq_of(q);
    const size_t nr = s->nrows, nc = s->ncols;
    const size_t align = wq == CPU_WQ_U4 ? 128 : 64;
    const size_t ld = (nc + align - 1) & ~(align - 1), rb = cpu_wq_row_bytes(wq, ld);
    const bool is_int = q->cfg->kind == PD_QKIND_INT;
    const size_t n_src_groups = is_int ? (size_t)q->n_groups : 1;
    pd_weight *w = calloc(1, sizeof *w);
    int32_t *perm = malloc(nc * sizeof *perm);
    int64_t *gid = malloc(nc * sizeof *gid);
    uint8_t *val = malloc(nr * nc);
    float *ssrc = malloc(nr * n_src_groups * sizeof *ssrc);
    float *zsrc = is_int ? malloc(nr * n_src_groups * sizeof *zsrc) : NULL;
    int rc = PD_OK;
    if (!w || !perm || !gid || !val || !ssrc || (is_int && !zsrc)) {
        rc = pd_error(PD_ENOMEM, "weight_load: tensor %s: out of memory", t->name);
        goto done;
    }
    w->dtype = PD_DTYPE_F32;
    w->q = wq;
    w->rows = nr;
    w->cols = nc;
    w->ld = ld;
    PD_CHECK_GOTO(order_columns(q, s->col0, nc, perm, gid, &w->ng, &w->gs), rc, done);
    if (w->gs % 16 != 0 && w->ng != 1) {
        rc = pd_error(PD_EUNSUPPORTED,
                      "weight_load: tensor %s: group_size %zu is not a multiple of 16 (CPU)",
                      t->name, w->gs);
        goto done;
    }
    /* 64-byte aligned rows (rb is a multiple of 64 for U4): a block's words are one cache line */
    size_t bytes = (nr * rb + 63) & ~(size_t)63;
    w->data = aligned_alloc(64, bytes ? bytes : 64);
    if (w->data) memset(w->data, 0, bytes);
    w->scale = malloc(nr * w->ng * sizeof(float));
    w->zero = calloc(nr * w->ng, sizeof(float));
    if (wq == CPU_WQ_I8A8) w->wsum = calloc(nr, sizeof *w->wsum);
    if (!w->data || !w->scale || !w->zero || (wq == CPU_WQ_I8A8 && !w->wsum)) {
        rc = pd_error(PD_ENOMEM, "weight_load: tensor %s: out of memory", t->name);
        goto done;
    }
    pd_qweight_unpack(q, (int64_t)s->row0, (int64_t)nr, (int64_t)s->col0, (int64_t)nc, val, ssrc,
                      zsrc);
    for (size_t r = 0; r < nr; r++) {
        if (wq == CPU_WQ_FP8)
            for (size_t k = 0; k < nc; k++)
                if ((val[r * nc + k] & 0x7f) == 0x7f) {
                    rc = pd_error(PD_EINVAL, "weight_load: tensor %s: NaN at (%zu, %zu)", t->name,
                                  s->row0 + r, s->col0 + k);
                    goto done;
                }
        pack_row(wq, val + r * nc, perm, nc, (uint8_t *)w->data + r * rb);
        for (size_t k = 0; k < nc && w->wsum; k++) w->wsum[r] += (int8_t)val[r * nc + k];
        for (size_t g = 0; g < w->ng; g++) {
            w->scale[r * w->ng + g] = ssrc[r * n_src_groups + (is_int ? (size_t)gid[g] : 0)];
            if (is_int) w->zero[r * w->ng + g] = zsrc[r * n_src_groups + (size_t)gid[g]];
        }
    }
    bool identity = true;
    for (size_t k = 0; k < nc && identity; k++) identity = perm[k] == (int32_t)k;
    if (!identity) {
        w->perm = perm;
        perm = NULL;
    }
    w->nbytes = nr * rb + 2 * nr * w->ng * sizeof(float) + (w->perm ? nc * sizeof(int32_t) : 0) +
                (w->wsum ? nr * sizeof(int32_t) : 0);
    *out = w;
    w = NULL;
done:
    cpu_weight_release(w);
    free(perm);
    free(gid);
    free(val);
    free(ssrc);
    free(zsrc);
    return rc;
}
