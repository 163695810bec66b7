// The CUDA backend's internals, shared by its files: the instance state (cuda_be), the pool and
// weight structs, the step tape, and the functions one file calls in another. Not for use outside
// common/backend/cuda/ (the API is cuda_backend.h).
//
// Design: one op table (cuda_backend.cu) whose entries live in one file per concern:
//   cuda_backend.cu  the op table, lifetime, memory and weights, the extern "C" entry points
//   cuda_kv.cu       the KV pool: host copies (kv_export / kv_import), CUDA IPC between processes
//   cuda_step.cu     a step's plan (metadata staging and checks) and the graph tape
//   cuda_ops.cu      the plain ops: their tape entries and their execution on the step stream
//   cuda_fused.cu    the fused ops (vLLM's fusions): tape entries, execution, plain-op fallbacks
// These files call cuBLAS and the launchers of k_*.cu (cuda_common.cuh), never a kernel.
#ifndef PD_BACKEND_CUDA_BE_CUH
#define PD_BACKEND_CUDA_BE_CUH

#include <cublas_v2.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_common.cuh"

extern "C" {
#include "backend/backend.h"
}

// ---- error helpers ------------------------------------------------------------------------------

static inline const char *cublas_status_str(cublasStatus_t s)
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

static inline cuda_be *BE(pd_backend *b)
{
    return (cuda_be *)pd_backend_impl(b);
}

// Makes the backend's device current on the calling thread. Done by create, plan, memory and
// KV ops; the kernel ops of a step rely on the plan that preceded them (same thread), which
// keeps the per-op launch cost at the kernel launch itself.
#define ENTER(cb) CUDA_TRY(cudaSetDevice((cb)->device))

static inline size_t align64(size_t x)
{
    return (x + 63) & ~(size_t)63;
}

// Layer's K and V in the pool (see struct pd_kv).
static inline void *kv_k(const pd_kv *kv, int layer)
{
    return (unsigned char *)kv->base + (size_t)layer * 2 * kv->half_bytes;
}

static inline void *kv_v(const pd_kv *kv, int layer)
{
    return (unsigned char *)kv->base + ((size_t)layer * 2 + 1) * kv->half_bytes;
}

// A cleared tape entry of op.
static inline tape_ent ent(int op)
{
    tape_ent e;
    memset(&e, 0, sizeof e); // padding included: entries are compared with memcmp
    e.op = op;
    return e;
}

// ---- cuda_kv.cu: the KV entries of the op table
// --------------------------------------------------

int op_kv_create(pd_backend *b, const pd_kv_params *p, pd_kv **out);
void op_kv_free(pd_backend *b, pd_kv *kv);
int op_kv_layer(pd_backend *b, const pd_kv *kv, int layer, pd_kv_layer_view *out);
int op_kv_export(pd_backend *b, const pd_kv *kv, const pd_kv_range *r, void *host);
int op_kv_import(pd_backend *b, pd_kv *kv, const pd_kv_range *r, const void *host);
int op_host_alloc(pd_backend *b, size_t bytes, void **out);
void op_host_free(pd_backend *b, void *p);
int op_kv_share(pd_backend *b, const pd_kv *kv, pd_kv_share *out);
int op_kv_peer_open(pd_backend *b, const pd_kv *kv, const pd_kv_share *s, pd_kv_peer **out);
void op_kv_peer_close(pd_backend *b, pd_kv_peer *peer);
int op_kv_pull(pd_backend *b, pd_kv *kv, pd_kv_peer *peer, const pd_kv_pull *pl);

// ---- cuda_step.cu: plan and the graph tape
// -------------------------------------------------------

int op_plan(pd_backend *b, const pd_batch *bt);
// PD_EINVAL naming op when no step is planned.
int need_plan(const cuda_be *cb, const char *op);
// Checks the planned step against a KV pool once per (step, pool): slots and block tables.
int check_kv(cuda_be *cb, const pd_kv *kv, int layer, const char *op);
void graph_slot_clear(graph_slot *g);
// Leaves graph mode in the middle of a step: whatever was skipped or only captured so far is
// executed eagerly from the tape.
int graph_flush(cuda_be *cb);
// Every op: eager execution, recording into the capture, or a checked skip while replaying.
int step_op(cuda_be *cb, const tape_ent *e);
// download_f32's device part ends the tape (see cuda_step.cu).
int graph_finish(cuda_be *cb, const tape_ent *e);

// ---- cuda_ops.cu: the plain ops
// ------------------------------------------------------------------

// Executes one tape entry on the step stream (every op, plain and fused).
int tape_exec(cuda_be *cb, const tape_ent *e);
// y (n, w->rows) = x . w^T (+ bias) on the step stream.
int exec_matmul(cuda_be *cb, const void *x, size_t n, const pd_weight *w, const pd_weight *bias,
                void *y);
int norm_check(const pd_weight *w, size_t n, size_t dim);
int norm_entry(pd_backend *b, const void *x, const void *add, void *xo, const pd_weight *w,
               float eps, size_t n, size_t dim, void *h);
int matmul_check(const pd_weight *w, const pd_weight *bias, size_t n);
int op_embed(pd_backend *b, const pd_weight *table, void *out);
int op_rmsnorm(pd_backend *b, const void *x, const pd_weight *w, float eps, size_t n, size_t dim,
               void *y);
int op_matmul(pd_backend *b, const void *x, size_t n, const pd_weight *w, const pd_weight *bias,
              void *y);
int op_rope(pd_backend *b, void *x, size_t n_heads, size_t head_dim);
int op_kv_write(pd_backend *b, pd_kv *kv, int layer, const void *k, const void *v);
int op_attention(pd_backend *b, const pd_kv *kv, int layer, const void *q, size_t n_q_heads,
                 float scale, void *out);
int op_swiglu(pd_backend *b, const void *gate, const void *up, size_t n, size_t dim, void *out);
int op_add(pd_backend *b, void *y, const void *x, size_t n_elems);
int op_gather_rows(pd_backend *b, const void *x, size_t dim, void *out);

// ---- cuda_fused.cu: the fused ops
// ----------------------------------------------------------------

int exec_matmul_multi(cuda_be *cb, const tape_ent *e);
int exec_rope_kv_write(cuda_be *cb, const pd_kv *kv, int layer, void *q, size_t nq, const void *k,
                       const void *v);
int exec_qkv_rope_kv_write(cuda_be *cb, const tape_ent *e);
int exec_matmul_swiglu(cuda_be *cb, const tape_ent *e);
int op_matmul_multi(pd_backend *b, const void *x, size_t n, size_t n_w, const pd_weight *const *w,
                    const pd_weight *const *bias, void *const *y);
int op_rope_kv_write(pd_backend *b, pd_kv *kv, int layer, void *q, size_t n_q_heads, void *k,
                     const void *v);
int op_add_rmsnorm(pd_backend *b, void *y, const void *x, const pd_weight *w, float eps, size_t n,
                   size_t dim, void *h);
int op_matmul_swiglu(pd_backend *b, const void *x, size_t n, const pd_weight *wg,
                     const pd_weight *wu, void *g, void *u, void *out);
int op_qkv_rope_kv_write(pd_backend *b, pd_kv *kv, int layer, const void *x, size_t n,
                         const pd_weight *const *w, const pd_weight *const *bias, void *q, void *k,
                         void *v);
int op_norm_qkv_rope_kv_write(pd_backend *b, pd_kv *kv, int layer, const pd_norm_in *pre, size_t n,
                              const pd_weight *const *w, const pd_weight *const *bias, void *q,
                              void *k, void *v);
int op_norm_matmul_swiglu(pd_backend *b, const pd_norm_in *pre, size_t n, const pd_weight *wg,
                          const pd_weight *wu, void *g, void *u, void *out);

#endif
