// A step on the CUDA backend (cuda_be.cuh): plan, which stages the step's metadata and checks
// it, and the graph tape, which captures repeated decode steps into CUDA graphs and replays them.
//
// Design: plan packs the step's host arrays into one pinned staging buffer and issues a single
// host-to-device copy; the host copy stays readable for validation until the next plan, which
// first waits on an event recorded after the last copy out of the staging buffers. Every op of
// the step then goes through step_op with a tape entry (see "graphs" below), so a replayed step
// launches one graph instead of its kernels.
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_be.cuh"

// ---- plan ---------------------------------------------------------------------------------------

static int graph_plan(cuda_be *cb);

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

int op_plan(pd_backend *b, const pd_batch *bt)
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

int need_plan(const cuda_be *cb, const char *op)
{
    if (!cb->planned) return pd_error(PD_EINVAL, "cuda %s: no step planned", op);
    return PD_OK;
}

int check_kv(cuda_be *cb, const pd_kv *kv, int layer, const char *op)
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

void graph_slot_clear(graph_slot *g)
{
    if (g->exec) cudaGraphExecDestroy(g->exec);
    free(g->tape);
    memset(g, 0, sizeof *g);
}

int graph_flush(cuda_be *cb)
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

int step_op(cuda_be *cb, const tape_ent *e)
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
int graph_finish(cuda_be *cb, const tape_ent *e)
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
