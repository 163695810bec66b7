/* Every op of the CUDA backend against the CPU backend (test-backend-ops style): random
 * bf16-representable inputs, several shapes including odd sizes, NMSE <= 1e-5 against the CPU's
 * f32 results; attention with GQA ratios 1, 3, 8, head dims 64/96/128/256, block sizes 16 and 5,
 * mixed prefill/decode/chunked rows in one step over shuffled (non-contiguous) block tables and a
 * long decode context that takes the split (flash-decoding) path; KV export/import; the fused
 * ops (matmul_multi, matmul_swiglu, add_rmsnorm, rope_kv_write, qkv_rope_kv_write) bit for bit
 * against the plain GPU ops they stand for; and the errors the backend must return instead of
 * crashing. Exits 77 without a GPU.
 *
 * One executable (test_cuda_ops) of several files: this header declares the helpers they share
 * (cuda_ops_common.c), and each test_cuda_ops_*.c holds one group of ops, linked in the order
 * the tests run. */
#ifndef PD_TESTS_GPU_CUDA_OPS_COMMON_H
#define PD_TESTS_GPU_CUDA_OPS_COMMON_H

#include <stddef.h>
#include <stdint.h>

#include "harness.h"

#include "cuda_test_util.h"

#define NMSE_MAX 1e-5

#define NEED_GPU()                                                                                 \
    do {                                                                                           \
        if (!ctu_have_gpu()) SKIP(pd_last_error());                                                \
    } while (0)

/* A pd_tensor over host f32 data of shape (rows, cols) (rows 0: 1-D of cols). */
pd_tensor tensor_f32(const char *name, const float *data, size_t rows, size_t cols);
/* Compares buffers bufs[0] (CPU) and bufs[1] (GPU) of n activations. */
int compare(cuda_pair *p, void *bufs[2], size_t n, double *nmse);
void free_bufs(cuda_pair *p, void *bufs[2]);
int upload_both(cuda_pair *p, const float *x, size_t n, void *bufs[2]);
int alloc_both(cuda_pair *p, size_t n, void *bufs[2]);

/* A single-sequence step of n rows at positions 0..n-1 with cos/sin tables for rope_dim. */
typedef struct {
    int32_t *tok, *pos, *qip, *kvl, *bip, *bid, *out_rows;
    int64_t *slots;
    float *cos_t, *sin_t;
    pd_batch b;
} simple_step;

int simple_step_make(simple_step *s, size_t n, size_t vocab, size_t rope_dim, uint64_t *seed);
void simple_step_free(simple_step *s);

typedef struct {
    int past, rows; /* cached tokens before the step; rows the step adds */
} seq_spec;

typedef struct {
    size_t n_seqs, n_tokens, n_blk_total;
    int32_t *tok, *pos, *qip, *kvl, *bip, *bid;
    int64_t *slots;
    float *cos_t, *sin_t; /* (n_tokens, D / 2): identity rotation (attention tests skip rope) */
    pd_batch b;
} paged_step;

/* Rows of each sequence s at positions [from_s, to_s) with its block table (block ids from the
 * shuffled pool order `perm`, assigned per sequence in order). */
int paged_step_make(paged_step *ps, const seq_spec *sp, size_t ns, int fill, size_t block_size,
                    const int32_t *perm, size_t D);
void paged_step_free(paged_step *ps);
/* Writes random K/V for the step's rows into both pools (after plan). */
int write_random_kv(cuda_pair *p, pd_kv *kv[2], int layer, size_t n, size_t kvh, size_t D,
                    uint64_t *seed);

#endif
