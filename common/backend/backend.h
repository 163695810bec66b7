/* The backend operation table: everything the forward pass needs from a device.
 *
 * Design (llama.cpp / calm style): the Llama forward pass is written once, in forward.c, as a
 * sequence of calls through a small table of operations (pd_backend_ops) that each backend
 * fills: the CPU backend (threads, own SIMD kernels, OpenBLAS) and the CUDA backend. The forward
 * code never dereferences an activation buffer: activations are opaque `void *` device buffers
 * of n * pd_dtype_size(act_dtype) bytes, in the dtype the backend chose (CPU: f32; CUDA: bf16 or
 * f32). Logits come back to the host as f32.
 *
 * Per-step metadata (token ids, positions, KV slots, per-sequence CSR arrays, RoPE cos/sin,
 * output rows) is handed over once per step by `plan` (FlashInfer style: plan on the host, run
 * on the device): the CPU backend keeps the host pointers, the CUDA backend copies them into
 * device buffers sized from pd_backend_params at create time. The ops that work on "the batch"
 * (embed, rope, kv_write, attention, gather_rows) then use the planned step implicitly.
 *
 * Ordering: all ops on one backend execute in call order (CUDA: one stream). Host memory read by
 * an op (plan arrays, upload sources) must stay valid until the next `sync`; results written to
 * host memory (download) are complete only after `sync`. Every op returns a pd status (0 ok,
 * negative PD_E* with a message set by pd_error()).
 *
 * Tensor parallelism: weights are loaded as 2-D slices (weight_load's pd_weight_slice), so a
 * rank holds a range of output rows (column-parallel: q/k/v heads, gate/up columns) or a range
 * of input columns (row-parallel: o_proj, down_proj) of the stored matrix. The KV cache holds the
 * rank's KV heads only.
 *
 * Layout of shapes in comments: (rows, cols) row-major; "n" = rows of the batch (tokens of
 * several sequences, prefill chunks and decode tokens mixed).
 */
#ifndef PD_BACKEND_BACKEND_H
#define PD_BACKEND_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "model/dtype.h"
#include "model/safetensors.h"

typedef struct pd_backend pd_backend; /* an instance: op table + implementation state */
typedef struct pd_weight pd_weight;   /* a weight matrix/vector resident on the backend */
typedef struct pd_kv pd_kv;           /* a paged KV-cache pool on the backend */

/* ---- creation parameters ---------------------------------------------------------------- */

/* Kernel families of the CPU backend; AUTO picks the best the running CPU supports. Tests force
 * each one. Only grows at the end. */
typedef enum {
    PD_CPU_ISA_AUTO = 0,
    PD_CPU_ISA_SCALAR = 1,      /* portable C, any x86-64 or other CPU */
    PD_CPU_ISA_AVX512 = 2,      /* avx512f (+ f16c for f16 weights) */
    PD_CPU_ISA_AVX512_BF16 = 3, /* AVX512 + avx512_bf16: bf16 dot products (vdpbf16ps) in the
                                   bf16 compute mode (compute_dtype BF16); else as AVX512 */
} pd_cpu_isa;

typedef struct {
    int n_threads;      /* CPU: worker threads incl. the caller; <= 0 = all online cores */
    pd_cpu_isa cpu_isa; /* CPU: kernel family (AUTO) */
    int device;         /* CUDA: device ordinal (0) */
    int weight_dtype;   /* -1 = backend's choice (default); else a pd_dtype every matrix is
                           converted to at load (vectors: norms, biases are always f32) */
    int compute_dtype;  /* CPU: -1 (default) or PD_DTYPE_F32: matmuls in f32; PD_DTYPE_BF16:
                           vLLM's --dtype bfloat16, every matrix stored bf16 (weight_dtype -1 or
                           BF16) and each matmul's x rows rounded to bf16, f32 accumulation.
                           Activations between ops and the KV pool stay f32. CUDA: unused (its
                           precision follows weight_dtype) */
    /* Capacity of one planned step (CUDA sizes its metadata buffers from these; the CPU backend
     * checks them too so both refuse the same batches). */
    size_t max_tokens;   /* rows per step (default 8192) */
    size_t max_seqs;     /* sequences per step (default 256) */
    size_t max_blocks;   /* block-table entries per step, all sequences (default 65536) */
    size_t max_rope_dim; /* largest head_dim the cos/sin tables carry (default 256) */
    int no_graphs;       /* CUDA: never capture steps into graphs (1 when steps synchronize with the
                            host half-way, as tensor parallelism's host-staged all-reduce does) */
    /* CPU: where the threads run (util/cores.h) */
    const char *cpu_budget; /* the host core budget the pool joins (NULL: none) */
    int cpu_share;          /* with cpu_budget: threads a run takes whether cores are free or not
                               (the caller's included; <= 1: the caller's alone); the pool's other
                               threads run only on free cores */
    const int *cpus;        /* (n_cpus) the cores to pin the threads to; NULL: unpinned */
    int n_cpus;             /* with cpus: the pool's size (n_threads is then ignored) */
} pd_backend_params;

/* Defaults as documented on each field. */
pd_backend_params pd_backend_default_params(void);

/* "auto", "scalar", "avx512" or "avx512bf16" -> *out; PD_EINVAL naming s otherwise. */
int pd_cpu_isa_parse(const char *s, pd_cpu_isa *out);

/* ---- host-side descriptions passed to ops --------------------------------------------------- */

/* A 2-D slice of a stored tensor. A 1-D tensor of n elements is viewed as (1, n). The slice is
 * rows [row0, row0 + nrows) x cols [col0, col0 + ncols); nrows = ncols = 0 means "all". */
typedef struct {
    size_t row0, nrows;
    size_t col0, ncols;
} pd_weight_slice;

/* The KV-cache pool. Per layer, K and V each have layout
 * (n_blocks, block_size, n_kv_heads, head_dim) in dtype (vLLM's layout); a token at slot s lives
 * in block s / block_size, offset s % block_size. */
typedef struct {
    int n_layers;
    size_t n_blocks;
    size_t block_size; /* tokens per block */
    size_t n_kv_heads; /* heads held by this backend (the rank's range under TP) */
    size_t head_dim;
    pd_dtype dtype; /* CPU: F32, or F8_E4M3 (an fp8 KV cache, scaled per layer: kv_scales) */
} pd_kv_params;

/* Raw access to one layer of the pool, for the KV transfer code. Pointers are device pointers
 * (host-dereferenceable only when host_visible). Strides in bytes. */
typedef struct {
    void *k;             /* (n_blocks, block_size, n_kv_heads, head_dim) */
    void *v;             /* same layout */
    size_t block_stride; /* bytes between blocks = block_size * token_stride */
    size_t token_stride; /* bytes between tokens = n_kv_heads * head_stride */
    size_t head_stride;  /* bytes between heads = head_dim * elem */
    pd_dtype dtype;
    int host_visible; /* 1: k/v can be read and written by the CPU directly */
} pd_kv_layer_view;

/* A block range for export/import: for one layer, whole blocks block_ids[0..n_blocks) and heads
 * [head0, head0 + n_heads) of the pool. The host buffer is K then V, each
 * (n_blocks, block_size, n_heads, head_dim) in the pool's dtype:
 * 2 * n_blocks * block_size * n_heads * head_dim * elem bytes. */
typedef struct {
    int layer;
    const int32_t *block_ids; /* (n_blocks) host */
    size_t n_blocks;
    size_t head0, n_heads;
} pd_kv_range;

/* A pool's device memory described for another process on the same host (CUDA IPC): filled by
 * kv_share in the owner, carried over the KV data plane, mapped by kv_peer_open in the peer.
 * The handle is opaque bytes; id tells pools apart (a restarted process shares a new pool). */
#define PD_KV_SHARE_HANDLE_BYTES 64
typedef struct {
    uint8_t handle[PD_KV_SHARE_HANDLE_BYTES]; /* cudaIpcMemHandle_t of the pool's allocation */
    uint64_t id;                              /* random per pool */
    pd_kv_params p;                           /* the pool's geometry (layout as above) */
} pd_kv_share;

typedef struct pd_kv_peer pd_kv_peer; /* another process's pool, mapped into this one */

/* A device-to-device copy out of a peer's pool into this backend's pool: for every layer, K and
 * V of the first n_tokens tokens of src_blocks (peer) into the same slots of dst_blocks (local),
 * heads [src_head0, src_head0 + n_heads) of the peer's pool into [dst_head0, ...) of the local
 * pool. */
typedef struct {
    const int32_t *src_blocks, *dst_blocks; /* (n_blocks) host */
    size_t n_blocks, n_tokens;
    size_t src_head0, dst_head0, n_heads;
} pd_kv_pull;

/* KV over a device link (NCCL) between this process and another: a 2-rank communicator, rank 0
 * the prefill side (sends), rank 1 the decode side (receives). What moves is a chunk of layers
 * [layer0, layer0 + n_layers) of one prompt, in the chunk layout: for each layer of the chunk,
 * K then V, each (n_tokens, n_heads, head_dim) in the pool dtype (the TCP frame payload of
 * common/transfer/tcp.c, layers concatenated): 2 * n_layers * n_tokens * n_heads * head_dim * elem
 * bytes. */
typedef struct pd_kv_link pd_kv_link;
/* A link id: the ncclUniqueId rank 0 made (128 bytes), then the UUID of rank 0's GPU (16). */
#define PD_KV_LINK_ID_BYTES 144

typedef struct {
    const int32_t *blocks;     /* (n_blocks) host: the pool's blocks of the prompt, in order */
    size_t n_blocks, n_tokens; /* the prompt's tokens in those blocks (the last may be partial) */
    size_t head0, n_heads;     /* pool-local head range */
    int layer0, n_layers;      /* the layers this call moves */
} pd_kv_xfer;

/* How a link operation's wait ends besides completion. The operation polls check (when not
 * NULL) every few milliseconds while it waits; a negative status from it (message set) ends the
 * wait with that status. Past deadline_ns (pd_now_ns clock) the wait ends with PD_ETIMEOUT.
 * Either way, and on an asynchronous NCCL error, the link is aborted: every later operation on
 * it fails at once and the caller closes it. */
typedef struct {
    int64_t deadline_ns;
    int (*check)(void *arg);
    void *check_arg;
} pd_kv_link_wait;

/* A sublayer's input norm handed to the projection that reads it (norm_qkv_rope_kv_write,
 * norm_matmul_swiglu): the residual rows x (n, H), the sublayer output to add first (NULL: none)
 * and where the sum goes, the norm's (1, H) f32 weight and eps, and h, the normed rows. */
typedef struct {
    const void *x;
    const void *add;
    void *x_out;
    const pd_weight *w;
    float eps;
    void *h;
} pd_norm_in;

/* One forward step, as the backend sees it. All arrays are host memory; see "Ordering" above
 * for their lifetime. Rows of one sequence are contiguous and in position order. */
typedef struct {
    size_t n_tokens;          /* rows in the step */
    const int32_t *token_ids; /* (n_tokens) */
    const int32_t *positions; /* (n_tokens) position of each row in its sequence */
    const int64_t *slots;     /* (n_tokens) KV slot (block_id * block_size + offset) that
                                 receives the row's k and v */
    const float *rope_cos;    /* (n_tokens, rope_dim / 2) cos(pos * inv_freq) * attn scaling */
    const float *rope_sin;    /* (n_tokens, rope_dim / 2) sin(pos * inv_freq) * attn scaling */
    size_t rope_dim;          /* head_dim the tables are for (even) */
    size_t n_seqs;
    const int32_t *q_indptr;     /* (n_seqs + 1) rows of sequence s: [q_indptr[s], q_indptr[s+1]) */
    const int32_t *kv_len;       /* (n_seqs) context length of s after this step (its new rows
                                    included); row r attends to positions [0, positions[r]] */
    const int32_t *block_indptr; /* (n_seqs + 1) block table of s: block_ids[indptr[s]..[s+1]) */
    const int32_t *block_ids;    /* (block_indptr[n_seqs]) */
    size_t n_out;                /* rows whose logits are wanted */
    const int32_t *out_rows;     /* (n_out) row indices into the step, increasing */
} pd_batch;

/* ---- the operation table ------------------------------------------------------------------- */

typedef struct pd_backend_ops {
    const char *name; /* "cpu", "cuda" */

    /* Frees the implementation state (not the pd_backend wrapper). */
    void (*free)(pd_backend *b);
    /* Activation dtype of this instance (CPU: F32). */
    pd_dtype (*act_dtype)(const pd_backend *b);

    /* -- memory ------------------------------------------------------------------------------ */
    /* A device buffer of bytes (64-byte aligned, uninitialized); PD_ENOMEM when out of memory. */
    int (*buf_alloc)(pd_backend *b, size_t bytes, void **out);
    void (*buf_free)(pd_backend *b, void *buf);
    int (*upload)(pd_backend *b, void *dst_dev, const void *src_host, size_t bytes);
    int (*download)(pd_backend *b, void *dst_host, const void *src_dev, size_t bytes);
    /* n activation elements -> host f32 (converted from act_dtype). */
    int (*download_f32)(pd_backend *b, float *dst_host, const void *src_dev, size_t n);
    /* host f32 -> n activation elements (converted to act_dtype): download_f32's counterpart. */
    int (*upload_f32)(pd_backend *b, void *dst_dev, const float *src_host, size_t n);
    /* Waits for every op issued so far. */
    int (*sync)(pd_backend *b);

    /* -- weights ----------------------------------------------------------------------------- */
    /* Copies (and possibly converts or repacks) slice sl of host tensor t (1-D or 2-D, any
     * stored dtype) into a backend weight. PD_EINVAL naming the tensor when the slice is out of
     * range or t is not 1-D/2-D. The tensor may be unmapped after the call returns. */
    int (*weight_load)(pd_backend *b, const pd_tensor *t, const pd_weight_slice *sl,
                       pd_weight **out);
    void (*weight_free)(pd_backend *b, pd_weight *w);
    /* Bytes the weight occupies on the backend. */
    size_t (*weight_nbytes)(const pd_backend *b, const pd_weight *w);

    /* -- KV cache ---------------------------------------------------------------------------- */
    /* One pool (zero-filled) for all layers; PD_ENOMEM when it does not fit. */
    int (*kv_create)(pd_backend *b, const pd_kv_params *p, pd_kv **out);
    void (*kv_free)(pd_backend *b, pd_kv *kv);
    int (*kv_layer)(pd_backend *b, const pd_kv *kv, int layer, pd_kv_layer_view *out);
    /* The scales of layer in a quantized (fp8) pool: K is stored as k / k_scale, V as
     * v / v_scale, and attention reads them back multiplied. 1 until set; before the first
     * step. PD_EINVAL for a pool of a float dtype. NULL where the backend has no quantized
     * pool (CUDA: its pools hold the activation dtype). */
    int (*kv_scales)(pd_backend *b, pd_kv *kv, int layer, float k_scale, float v_scale);
    /* Copies a block/head range of one layer to host memory / from host memory (see
     * pd_kv_range for the host layout). Block ids and heads are checked against the pool.
     * Callable from any thread, also while another thread runs a step: they see what every
     * step synchronized so far (sync/download returned) wrote, and are complete on return. */
    int (*kv_export)(pd_backend *b, const pd_kv *kv, const pd_kv_range *r, void *host);
    int (*kv_import)(pd_backend *b, pd_kv *kv, const pd_kv_range *r, const void *host);
    /* KV between processes on one host without host staging (CUDA IPC). NULL where the
     * backend has no such path (CPU). Same threading as kv_export/kv_import.
     * kv_share: describes kv for another process (cheap; the same description every call).
     * kv_peer_open: maps a pool another process shared; one mapping per pool however many
     * opens (reference counted), released by as many kv_peer_close. PD_EUNSUPPORTED when the
     * memory cannot be mapped here (another host, no peer access); PD_EINVAL for a pool whose
     * dtype or head_dim differs from kv's.
     * kv_pull: copies plan (checked against both pools) from the peer into kv; complete on
     * return. */
    int (*kv_share)(pd_backend *b, const pd_kv *kv, pd_kv_share *out);
    int (*kv_peer_open)(pd_backend *b, const pd_kv *kv, const pd_kv_share *s, pd_kv_peer **out);
    void (*kv_peer_close)(pd_backend *b, pd_kv_peer *peer);
    int (*kv_pull)(pd_backend *b, pd_kv *kv, pd_kv_peer *peer, const pd_kv_pull *plan);

    /* -- one step ---------------------------------------------------------------------------- */
    /* Hands over the step's metadata. Checks it against the capacities and, at attention time,
     * against the KV pool (block ids, slots, kv_len vs block table size). */
    int (*plan)(pd_backend *b, const pd_batch *batch);
    /* out (n_tokens, H) = table[token_ids[r]] for the planned rows. table: (V, H) weight. */
    int (*embed)(pd_backend *b, const pd_weight *table, void *out);
    /* y (n, dim) = x / sqrt(mean(x^2) + eps) * w; w: (1, dim) weight. y may equal x. */
    int (*rmsnorm)(pd_backend *b, const void *x, const pd_weight *w, float eps, size_t n,
                   size_t dim, void *y);
    /* y (n, out) = x (n, in) . W^T (+ bias); W: (out, in) weight; bias: (1, out) or NULL.
     * Each row's result is bit-identical whatever n and the other rows are (fixed reduction
     * order), on every backend that claims determinism (CPU does). */
    int (*matmul)(pd_backend *b, const void *x, size_t n, const pd_weight *w, const pd_weight *bias,
                  void *y);
    /* In-place rotary embedding (rotate_half convention: pair i = dims i and i + head_dim/2) of
     * x (n_tokens, n_heads, head_dim) with the planned cos/sin rows; head_dim == rope_dim. */
    int (*rope)(pd_backend *b, void *x, size_t n_heads, size_t head_dim);
    /* Stores k, v (n_tokens, n_kv_heads, head_dim) at the planned slots of layer. */
    int (*kv_write)(pd_backend *b, pd_kv *kv, int layer, const void *k, const void *v);
    /* out (n_tokens, n_q_heads, head_dim) = causal softmax(q k^T * scale) v per sequence over
     * the paged cache of layer (after kv_write of this step). GQA: q head h reads kv head
     * h / (n_q_heads / n_kv_heads). q: (n_tokens, n_q_heads, head_dim). */
    int (*attention)(pd_backend *b, const pd_kv *kv, int layer, const void *q, size_t n_q_heads,
                     float scale, void *out);
    /* out (n, dim) = silu(gate) * up; gate, up: (n, dim). out may equal gate or up. */
    int (*swiglu)(pd_backend *b, const void *gate, const void *up, size_t n, size_t dim, void *out);
    /* y (n_elems) += x (n_elems). */
    int (*add)(pd_backend *b, void *y, const void *x, size_t n_elems);
    /* out (n_out, dim) = x[out_rows[i]] for the planned out_rows; x: (n_tokens, dim). */
    int (*gather_rows)(pd_backend *b, const void *x, size_t dim, void *out);

    /* -- KV over a device link (NCCL; see pd_kv_link). NULL where the backend has none (CPU).
     * Called from transfer threads, never the step's: they use a stream of the link's own.
     * kv_link_id: a fresh link id for rank 0 to hand to rank 1 out of band (any channel).
     * kv_link_open: joins the link of id as rank (0 or 1) with the device of b; both processes
     *   call it with the same id; returns once both joined. A watchdog thread of the backend
     *   watches every open link (asynchronous errors, deadlines) and aborts a failed one, so a
     *   dead peer never blocks a caller past its deadline. PD_ETIMEOUT, or the check's status.
     *   Two processes on one GPU join only where NCCL takes them for two hosts (a per-process
     *   NCCL_HOSTID); then their traffic goes over NCCL's socket transport.
     * kv_link_local: 1 when id was made on the very GPU of b (kv_link_open would join one GPU
     *   to itself), else 0.
     * kv_link_close: aborts whatever is in flight and frees the link; never waits for the peer.
     * kv_link_send (rank 0): moves x's layers in chunks of at most chunk_layers layers: each
     *   chunk is gathered from kv into device staging and sent; complete (received) on return.
     * kv_link_recv (rank 1): receives the chunk of x (its layer range) into the link's staging,
     *   growing it when needed; touches no pool.
     * kv_link_scatter (rank 1): writes the received chunk into x's blocks and heads of kv;
     *   complete on return. Callers hold the lock that frees blocks, so no freed block is
     *   written. */
    int (*kv_link_id)(pd_backend *b, uint8_t id[PD_KV_LINK_ID_BYTES]);
    int (*kv_link_open)(pd_backend *b, const uint8_t id[PD_KV_LINK_ID_BYTES], int rank,
                        const pd_kv_link_wait *w, pd_kv_link **out);
    void (*kv_link_close)(pd_backend *b, pd_kv_link *l);
    int (*kv_link_send)(pd_backend *b, const pd_kv *kv, pd_kv_link *l, const pd_kv_xfer *x,
                        int chunk_layers, const pd_kv_link_wait *w);
    int (*kv_link_recv)(pd_backend *b, const pd_kv *kv, pd_kv_link *l, const pd_kv_xfer *x,
                        const pd_kv_link_wait *w);
    int (*kv_link_scatter)(pd_backend *b, pd_kv *kv, pd_kv_link *l, const pd_kv_xfer *x);
    int (*kv_link_local)(pd_backend *b, const uint8_t id[PD_KV_LINK_ID_BYTES]);

    /* -- fused ops (vLLM's QKV projection, gate-up projection + SiluAndMul, fused_add_rms_norm,
     * rotary + cache write).
     * Each stands for a sequence of the plain ops above and must give the same result bit for
     * bit; it exists so a backend can do that sequence in fewer passes (on a GPU: fewer kernel
     * launches per decode step). NULL where the backend has none: forward.c then issues the
     * plain ops. */
    /* y[i] = matmul(x, n, w[i], bias ? bias[i] : NULL) for i < n_w (1 .. PD_MATMUL_MULTI_MAX);
     * every w[i] has the same columns (one x). */
    int (*matmul_multi)(pd_backend *b, const void *x, size_t n, size_t n_w,
                        const pd_weight *const *w, const pd_weight *const *bias, void *const *y);
    /* rope(q, n_q_heads, head_dim), rope(k, n_kv_heads of kv, head_dim), kv_write(kv, layer, k,
     * v); head_dim = the pool's. k's contents are unspecified afterwards (rotated or not). */
    int (*rope_kv_write)(pd_backend *b, pd_kv *kv, int layer, void *q, size_t n_q_heads, void *k,
                         const void *v);
    /* add(y, x, n * dim), then rmsnorm(y, w, eps, n, dim, h); h != y. */
    int (*add_rmsnorm)(pd_backend *b, void *y, const void *x, const pd_weight *w, float eps,
                       size_t n, size_t dim, void *h);
    /* matmul(x, n, wg) -> g, matmul(x, n, wu) -> u, swiglu(g, u) -> out (wg and wu of one
     * shape); g and u are (n, rows) scratch whose contents are unspecified afterwards; out may
     * equal g or u. */
    int (*matmul_swiglu)(pd_backend *b, const void *x, size_t n, const pd_weight *wg,
                         const pd_weight *wu, void *g, void *u, void *out);
    /* matmul_multi(x, n, 3, w = {wq, wk, wv}, bias, {q, k, v}), then rope_kv_write(kv, layer,
     * q, wq's rows / head_dim, k, v) (head_dim = the pool's); k's and v's contents are
     * unspecified afterwards. */
    int (*qkv_rope_kv_write)(pd_backend *b, pd_kv *kv, int layer, const void *x, size_t n,
                             const pd_weight *const *w, const pd_weight *const *bias, void *q,
                             void *k, void *v);
    /* The sublayer's input norm done by the projection after it: with pre->add, add(x_out =
     * x + add) then rmsnorm(x_out, pre->w, pre->eps, n, H, pre->h), else rmsnorm(x, ...) into
     * pre->h (x_out untouched); then qkv_rope_kv_write / matmul_swiglu of pre->h. H = the
     * projection's columns; x_out must not overlap x or add (it is written while they are read);
     * pre->h's contents are unspecified afterwards. A decode step on a GPU then needs no norm
     * launch between its projections. */
    int (*norm_qkv_rope_kv_write)(pd_backend *b, pd_kv *kv, int layer, const pd_norm_in *pre,
                                  size_t n, const pd_weight *const *w, const pd_weight *const *bias,
                                  void *q, void *k, void *v);
    int (*norm_matmul_swiglu)(pd_backend *b, const pd_norm_in *pre, size_t n, const pd_weight *wg,
                              const pd_weight *wu, void *g, void *u, void *out);

    /* -- host staging ------------------------------------------------------------------------ */
    /* Host memory that kv_export / kv_import copy to and from at full speed (CUDA: pinned, so
     * the copy is one DMA with no bounce through the driver's own staging). Allocating it may
     * stall the device's streams (CUDA's implicit synchronization), so callers keep and reuse
     * it. NULL where plain memory is as good (CPU): use pd_backend_host_alloc, which falls back
     * to malloc. */
    int (*host_alloc)(pd_backend *b, size_t bytes, void **out);
    void (*host_free)(pd_backend *b, void *p);
} pd_backend_ops;

#define PD_MATMUL_MULTI_MAX 4

/* ---- instances ------------------------------------------------------------------------------ */

/* The CPU backend: a thread pool of params->n_threads, kernels chosen by params->cpu_isa and
 * runtime CPU feature detection. PD_EUNSUPPORTED when a forced ISA is not available. */
int pd_backend_cpu_create(const pd_backend_params *params, pd_backend **out);

/* Destroys any backend (its weights and KV pools must have been freed first). NULL is a no-op. */
void pd_backend_free(pd_backend *b);
/* The op table of b (never NULL). */
const pd_backend_ops *pd_backend_get_ops(const pd_backend *b);
/* Shorthands. */
const char *pd_backend_name(const pd_backend *b);
pd_dtype pd_backend_act_dtype(const pd_backend *b);
/* Host staging memory of b (ops->host_alloc, else malloc); PD_ENOMEM naming the size when out
 * of memory. Freed with pd_backend_host_free on the same backend (NULL is a no-op). */
int pd_backend_host_alloc(pd_backend *b, size_t bytes, void **out);
void pd_backend_host_free(pd_backend *b, void *p);

/* For backend implementations: wraps ops + impl into a new instance (NULL when out of memory);
 * pd_backend_impl returns impl. */
pd_backend *pd_backend_wrap(const pd_backend_ops *ops, void *impl);
void *pd_backend_impl(const pd_backend *b);

#endif
