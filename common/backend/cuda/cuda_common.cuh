// Internal to the CUDA backend: error-check macros, bf16 helpers and the host launchers that
// the kernel files export to the op files (cuda_be.cuh). Not for use outside common/backend/cuda/.
//
// Design: each kernel family lives in its own .cu file with its launcher (llm.c style); a
// launcher takes the stream, sizes the grid, launches, and returns the cudaGetLastError status
// turned into a pd status. Activations are bf16 (__nv_bfloat16), or f32 in the f32 precision
// mode; kernels are templates over the activation type (act: 0 = f32, 2 = bf16, the pd_dtype
// values) and all arithmetic is f32.
#ifndef PD_BACKEND_CUDA_COMMON_CUH
#define PD_BACKEND_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

extern "C" {
#include "util/status.h"
}

typedef __nv_bfloat16 bf16;

#define ACT_F32  0 // == PD_DTYPE_F32
#define ACT_F16  1 // == PD_DTYPE_F16 (weights only)
#define ACT_BF16 2 // == PD_DTYPE_BF16

// Element loads/stores in f32 for every storage type.
__device__ __forceinline__ float ldf(const float *p, size_t i)
{
    return p[i];
}
__device__ __forceinline__ float ldf(const bf16 *p, size_t i)
{
    return __bfloat162float(p[i]);
}
__device__ __forceinline__ float ldf(const __half *p, size_t i)
{
    return __half2float(p[i]);
}
__device__ __forceinline__ void stf(float *p, size_t i, float v)
{
    p[i] = v;
}
__device__ __forceinline__ void stf(bf16 *p, size_t i, float v)
{
    p[i] = __float2bfloat16(v);
}

// Runs the statement(s) after T with T = the activation type of act (float for ACT_F32, else
// bf16). Variadic so the body may contain commas (template and launch arguments).
#define ACT_DISPATCH(act, T, ...)                                                                  \
    do {                                                                                           \
        if ((act) == ACT_F32) {                                                                    \
            typedef float T;                                                                       \
            __VA_ARGS__;                                                                           \
        } else {                                                                                   \
            typedef bf16 T;                                                                        \
            __VA_ARGS__;                                                                           \
        }                                                                                          \
    } while (0)

// Returns a PD_EINTERNAL status (PD_ENOMEM for out-of-memory) naming the failed call.
static inline int cuda_status(cudaError_t e, const char *what, const char *file, int line)
{
    if (e == cudaSuccess) return PD_OK;
    int code = e == cudaErrorMemoryAllocation ? PD_ENOMEM : PD_EINTERNAL;
    return pd_error(code, "cuda: %s: %s (%s:%d)", what, cudaGetErrorString(e), file, line);
}

#define CUDA_TRY(expr)                                                                             \
    do {                                                                                           \
        int cuda_try_rc_ = cuda_status((expr), #expr, __FILE__, __LINE__);                         \
        if (cuda_try_rc_ < 0) return cuda_try_rc_;                                                 \
    } while (0)

// After a <<<>>> or cuda_launch launch in a launcher.
#define CUDA_LAUNCH_CHECK(name) return cuda_status(cudaGetLastError(), name, __FILE__, __LINE__)

// The rotated pair (x1, x2) -> (o1, o2) of the rotary embedding; one definition, and explicit
// roundings (no FMA contraction left to the compiler), so every kernel that rotates (k_rope.cu,
// the q/k/v GEMV's epilogue in k_gemv.cu) gives the same bits.
__device__ __forceinline__ void rope_pair(float x1, float x2, float c, float sn, float *o1,
                                          float *o2)
{
    *o1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, sn));
    *o2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, sn));
}

// ---- programmatic dependent launch (Hopper) ------------------------------------------------
// The decode step is a chain of short kernels, each a few microseconds, so the time between one
// kernel's end and the next one's start is a large share of the step. A kernel launched by
// cuda_launch while cuda_pdl is set may be launched before the previous kernel in its stream has
// finished (cudaLaunchAttributeProgrammaticStreamSerialization, kept by CUDA graph capture): its
// blocks become resident and wait in griddep_wait() until that kernel has completed and its
// writes are visible. Every kernel launched by cuda_launch therefore calls griddep_wait() before
// its first global memory access, read or write, other than reads of memory that no kernel of
// the step writes (gemv_kernel's first weight rows; attn_kernel's work list, block table and
// K/V of earlier steps' positions), which overlap the previous kernel that way;
// griddep_launch_dependents() then lets the next kernel start launching. Without the attribute
// (cuda_pdl 0, other launches) both are no-ops.
// cuda_pdl is set by each backend's step plan (and create) to that backend's choice, made at
// create by cuda_pdl_allowed: on unless PD_CUDA_PDL=0, the device is below compute capability 9.0
// or the kernels were built without sm_90 code. A kernel launched by cuda_launch waits in
// griddep_wait() either way, so a launch under another backend's setting is still correct.
extern int cuda_pdl;
int cuda_pdl_allowed(int device_major, int *allowed); // after cudaSetDevice (k_elementwise.cu)

__device__ __forceinline__ void griddep_wait()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_launch_dependents()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// The first statement of a kernel launched by cuda_launch.
#define GRIDDEP_ENTRY()                                                                            \
    do {                                                                                           \
        griddep_wait();                                                                            \
        griddep_launch_dependents();                                                               \
    } while (0)

// kernel<<<grid, block, smem, s>>>(args...), with programmatic dependent launch when cuda_pdl.
// Errors are left for CUDA_LAUNCH_CHECK, as after <<<>>>.
template <typename... P, typename... A>
static inline void cuda_launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem,
                               cudaStream_t s, A &&...args)
{
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cfg.attrs = at;
    cfg.numAttrs = __atomic_load_n(&cuda_pdl, __ATOMIC_RELAXED) ? 1 : 0;
    (void)cudaLaunchKernelEx(&cfg, kernel, static_cast<A &&>(args)...);
}

static inline unsigned cdiv_u(size_t a, size_t b)
{
    return (unsigned)((a + b - 1) / b);
}

// ---- attention work list (built on the host by cuda_ops.cu, read by k_attention.cu) ----------

// One block's worth of attention: query rows [row0, row0 + nrows) of one sequence against its
// cached positions [kv0, kv1). part < 0: the item covers the rows' whole causal range and
// writes the bf16 output; part >= 0: one split of a single row's range, written as f32
// partial output + log-sum-exp into partial slot `part`, combined later by a merge item.
// fresh0: the sequence's first position written in this step (its first row's): its K/V from
// fresh0 on comes from the step's own KV write, positions below it from earlier steps.
typedef struct {
    int32_t row0, nrows;
    int32_t seq;
    int32_t kv0, kv1;
    int32_t part;
    int32_t fresh0;
} cuda_attn_item;

// Combines parts [part0, part0 + n_parts) of row `row`.
typedef struct {
    int32_t row;
    int32_t part0, n_parts;
} cuda_attn_merge;

// Query vectors (row, q head) one attention block handles: 8 warps x 4 each.
#define CUDA_ATTN_WARPS 8
#define CUDA_ATTN_QPW   4
#define CUDA_ATTN_QV    (CUDA_ATTN_WARPS * CUDA_ATTN_QPW)
#define CUDA_ATTN_KT    32  // keys per shared-memory tile (one per lane)
#define CUDA_ATTN_MAX_D 256 // largest head_dim the attention kernel supports
// Tensor-core (WMMA, bf16) kernel for prefill tiles: 4 warps x 16 query vectors, 64-key tiles.
#define CUDA_ATTN_TC_QV 64
#define CUDA_ATTN_TC_KT 64

// ---- launchers (each returns a pd status) -----------------------------------------------------

// k_elementwise.cu (act: activation type of x/y/out buffers)
// out (n, H) = table[ids[r]] (table (V, H) in tdtype: ACT_F32 / ACT_F16 / ACT_BF16).
int cuda_embed(cudaStream_t s, int act, const void *table, int tdtype, size_t H, const int32_t *ids,
               size_t n, void *out);
// out (n_out, dim) = x[rows[i]].
int cuda_gather_rows(cudaStream_t s, int act, const void *x, size_t dim, const int32_t *rows,
                     size_t n_out, void *out);
// out = silu(gate) * up, n elements.
int cuda_swiglu(cudaStream_t s, int act, const void *gate, const void *up, size_t n, void *out);
// y += x, n elements.
int cuda_add(cudaStream_t s, int act, void *y, const void *x, size_t n);
// dst (n) in dtype dst_t (ACT_F32 / ACT_F16 / ACT_BF16) = src (n) activations; a plain copy when
// the types agree.
int cuda_act_convert(cudaStream_t s, int act, const void *src, size_t n, int dst_t, void *dst);
// y (n, out) activations = y32 (n, out) f32 + bias (out) f32 (bias may be NULL).
int cuda_bias_epilogue(cudaStream_t s, int act, const float *y32, const float *bias, size_t n,
                       size_t out, void *y);

// The norm before a projection, done by its GEMV (cuda_gemv_swiglu, cuda_gemv_qkv_rope): x is
// then the residual rows (n, in); with add, x_out = x + add (x_out overlapping neither; block 0
// writes it), and the GEMV reads rmsnorm(x_out, w, eps) as cuda_add_rmsnorm would write it, else
// rmsnorm(x, w, eps) as cuda_rmsnorm would, bit for bit (the vector kernel's reduction order).
// PD_EUNSUPPORTED where cuda_rmsnorm would take its scalar kernel.
struct cuda_norm_in {
    const void *add;
    void *x_out;
    const float *w;
    float eps;
};

// The vector RMSNorm kernel's shape for rows of nch 16-byte chunks (k_rmsnorm.cu): `threads`
// threads (a multiple of 32) each taking chunks t, t + threads, ... (at most NORM_MAX_R); a
// GEMV that does the norm itself follows the same order.
#define NORM_MAX_THREADS 1024
#define NORM_MAX_R       2
__host__ __device__ inline bool norm_vec_shape(size_t nch, int *threads, int *r)
{
    size_t t = (nch + 31) / 32 * 32;
    if (t > NORM_MAX_THREADS) t = NORM_MAX_THREADS;
    if (t < 32) t = 32; // dim 0: a block that writes nothing
    *threads = (int)t;
    *r = (int)((nch + t - 1) / t);
    return nch <= (size_t)NORM_MAX_THREADS * NORM_MAX_R;
}

// 16 bytes of T as EPC elements (one LDG.128 / STG.128).
template <typename T> struct __align__(16) norm_chunk
{
    static constexpr int EPC = 16 / (int)sizeof(T);
    T e[EPC];
};

// k_gemv.cu: y (n, out) = x (n, in) . W^T (+ bias) for small n (decode rows): one warp per
// output row, 16-byte weight loads, fixed reduction order per row (independent of n).
// W (out, in) in wdtype; requires in % 8 == 0. Returns PD_EUNSUPPORTED when not applicable.
#define CUDA_GEMV_MAX_N 8
int cuda_gemv(cudaStream_t s, int act, const void *x, size_t n, const void *W, int wdtype,
              size_t out, size_t in, const float *bias, void *y);
// The same for nm (<= CUDA_GEMV_MAX_MATS) matrices W[i] (out[i], in) of one wdtype and the same
// x, in one launch: y[i] = x . W[i]^T (+ bias[i]), each row as cuda_gemv computes it.
#define CUDA_GEMV_MAX_MATS 4
int cuda_gemv_multi(cudaStream_t s, int act, const void *x, size_t n, int nm, const void *const *W,
                    int wdtype, const size_t *out, size_t in, const float *const *bias,
                    void *const *y);
// y (n, out) = silu(x . Wg^T) * (x . Wu^T), Wg and Wu (out, in) of one wdtype, in one launch;
// the values of two cuda_gemv launches and cuda_swiglu. PD_EUNSUPPORTED where cuda_gemv would
// refuse or the rows of `in` elements split over 3 or more warps.
// nm: the input's norm (cuda_norm_in), or NULL.
int cuda_gemv_swiglu(cudaStream_t s, int act, const void *x, size_t n, const void *Wg,
                     const void *Wu, int wdtype, size_t out, size_t in, void *y,
                     const struct cuda_norm_in *nm);
// The q/k/v projection of decode rows with the rotary embedding and the KV-cache write in its
// epilogue, in one launch: W[0..2] = wq (nq * D, in), wk and wv (kv_row = nkv * D, in), bias[i]
// or NULL; q (n, nq * D) receives the rotated q, the rotated k and v go to slot slots[r] of the
// layer's pools kc, vc (n_slots, kv_row), as cuda_gemv_multi then cuda_rope_kv_write would
// write them, bit for bit (each row's dot product and rounding as there, then rope_pair). cos_t,
// sin_t (n, D / 2). PD_EUNSUPPORTED where that launch pair would not be replaced: cuda_gemv
// refusing, rows split over 3 or more warps, a rotary pair group not dividing D / 2.
int cuda_gemv_qkv_rope(cudaStream_t s, int act, const void *x, size_t n, const void *const *W,
                       int wdtype, size_t nq, size_t nkv, size_t D, size_t in,
                       const float *const *bias, void *q, const float *cos_t, const float *sin_t,
                       const int64_t *slots, void *kc, void *vc, const struct cuda_norm_in *nm);

// k_rmsnorm.cu: y (n, dim) = x * rsqrt(mean(x^2) + eps) * w; w (dim) f32. y may equal x.
int cuda_rmsnorm(cudaStream_t s, int act, const void *x, const float *w, float eps, size_t n,
                 size_t dim, void *y);
// xo = x + add (rounded to the activation type; xo may equal x), then y = rmsnorm(xo) as
// cuda_rmsnorm; y != x, xo.
int cuda_add_rmsnorm(cudaStream_t s, int act, const void *x, const void *add, void *xo,
                     const float *w, float eps, size_t n, size_t dim, void *y);

// k_rope.cu: x (n, n_heads, head_dim) rotated in place with cos/sin (n, rope_half) f32.
int cuda_rope(cudaStream_t s, int act, void *x, size_t n, size_t n_heads, size_t head_dim,
              const float *cos_t, const float *sin_t, size_t rope_half);
// k_rope.cu: q (n, nq, head_dim) rotated in place; k (n, nkv, head_dim) rotated and v copied
// into slots[r] of the layer's pools kc, vc (n_blocks * block_size, nkv, head_dim); k is
// not modified. The same values as cuda_rope on q and k, then cuda_kv_write.
int cuda_rope_kv_write(cudaStream_t s, int act, void *q, const void *k, const void *v, size_t n,
                       size_t nq, size_t nkv, size_t head_dim, const float *cos_t,
                       const float *sin_t, size_t rope_half, const int64_t *slots, void *kc,
                       void *vc);

// k_kv.cu: k, v (n, kvh, D) stored at slots[r] of the layer's pools
// kc, vc (n_blocks * block_size, kvh, D); pool type = activation type.
int cuda_kv_write(cudaStream_t s, int act, const void *k, const void *v, size_t n, size_t kvh,
                  size_t D, const int64_t *slots, void *kc, void *vc);

// k_kv.cu: device-to-device copy of a prompt's KV between two pools (CUDA IPC pull): for every
// layer and K/V, token t of the prompt moves from slot src_blocks[t / block_size] * block_size +
// t % block_size of src to the same offset of dst_blocks' block in dst, `row` bytes starting
// src_off / dst_off bytes into the token (a head range). The block ids (host memory, n_blocks
// each) travel in the kernel's parameters, so nothing is copied to the device before the kernel:
// one launch per CUDA_KV_PULL_IDS blocks, the parameters within the classic 4 KiB.
#define CUDA_KV_PULL_IDS 448
typedef struct {
    const unsigned char *src;
    unsigned char *dst;
    size_t src_half, dst_half; // bytes of one layer's K (or V) in each pool
    size_t src_tok, dst_tok;   // bytes of one token (all heads) in each pool
    size_t src_off, dst_off;   // bytes from a token's start to the first copied head
    size_t row;                // bytes copied per token
    size_t block_size, n_tokens;
    int n_layers;
} cuda_kv_pull_args;
int cuda_kv_pull(cudaStream_t s, const cuda_kv_pull_args *a, const int32_t *src_blocks,
                 const int32_t *dst_blocks, size_t n_blocks);

// k_attention.cu
typedef struct {
    int act;                     // activation / pool type (ACT_F32 or ACT_BF16)
    const void *q;               // (n_tokens, n_q_heads, D)
    const void *kc, *vc;         // layer pools (n_blocks, block_size, n_kv_heads, D)
    void *out;                   // (n_tokens, n_q_heads, D)
    const int32_t *positions;    // (n_tokens)
    const int32_t *block_indptr; // (n_seqs + 1)
    const int32_t *block_ids;
    const cuda_attn_item *items; // (n_items) CUDA-core items (decode rows, splits, f32 mode)
    size_t n_items;
    const cuda_attn_item *tc_items; // (n_tc_items) tensor-core items (bf16 prefill tiles)
    size_t n_tc_items;
    int tc_heads_per_item;
    const cuda_attn_merge *merges; // (n_merges)
    size_t n_merges;
    const int32_t *counts; // device {CUDA-core items, merges} when the grids are sized to a
                           // capacity (CUDA graphs): blocks past the count return at once; or NULL
    float *part_o;         // (parts, n_q_heads, D) f32 workspace
    float *part_lse;       // (parts, n_q_heads) f32 workspace
    int n_q_heads, n_kv_heads, head_dim;
    int heads_per_item; // q heads one block covers (divides n_q_heads / n_kv_heads)
    int tc_wmma;        // 1: the WMMA tensor-core kernel instead of the mma.sync one
    int block_size;
    float scale;
} cuda_attn_args;
// Attributes (dynamic shared memory) of every attention kernel instance; once per device.
int cuda_attention_init(void);
// Runs the CUDA-core items, the tensor-core items and the merges of a step's work list.
int cuda_attention(cudaStream_t s, const cuda_attn_args *a);
// k_attention_tc.cu: the tensor-core items alone (bf16, head_dim 64 or 128; mma.sync kernel, or
// the WMMA one when tc_wmma).
int cuda_attention_tc_init(void);
int cuda_attention_tc(cudaStream_t s, const cuda_attn_args *a);

#endif
