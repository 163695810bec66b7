/* See kv_move.h. */
#include "kv_move.h"

#include <stdlib.h>

#include "backend/backend.h"
#include "model/model.h"
#include "util/status.h"

int kv_move(pd_engine *P, const int32_t *pblocks, pd_engine *D, const int32_t *dblocks,
            size_t n_blocks)
{
    pd_backend *bp = pd_engine_backend(P, 0), *bd = pd_engine_backend(D, 0);
    const pd_backend_ops *op = pd_backend_get_ops(bp), *od = pd_backend_get_ops(bd);
    const pd_model_config *cfg = pd_engine_model_config(P);
    pd_engine_stats st;
    pd_engine_get_stats(P, &st);
    size_t heads = (size_t)cfg->num_key_value_heads, hd = (size_t)cfg->head_dim;
    void *host = malloc(2 * n_blocks * st.block_size * heads * hd * sizeof(float) + 1);
    if (!host) return pd_error(PD_ENOMEM, "out of memory");
    int rc = PD_OK;
    for (int l = 0; l < (int)cfg->num_hidden_layers && rc >= 0; l++) {
        pd_kv_range src = {
            .layer = l, .block_ids = pblocks, .n_blocks = n_blocks, .head0 = 0, .n_heads = heads};
        pd_kv_range dst = src;
        dst.block_ids = dblocks;
        rc = op->kv_export(bp, pd_engine_kv(P, 0), &src, host);
        if (rc >= 0) rc = op->sync(bp);
        if (rc >= 0) rc = od->kv_import(bd, pd_engine_kv(D, 0), &dst, host);
        if (rc >= 0) rc = od->sync(bd);
    }
    free(host);
    return rc;
}
