/* Helpers shared by the GPU tests and bench_cuda: a CPU + CUDA backend pair, activation
 * upload/download in each backend's dtype, bf16-representable random data, and NMSE.
 *
 * Design: every comparison runs the same op on the CPU backend (f32 activations: the
 * reference) and on the CUDA backend (bf16 activations) with inputs that are exactly
 * representable in bf16, so the measured error is the CUDA kernels' own (their bf16 output
 * rounding and f32 arithmetic order), as llama.cpp's test-backend-ops measures it: NMSE =
 * sum (gpu - ref)^2 / sum ref^2. Functions return a pd status like library code.
 */
#ifndef PD_TESTS_GPU_CUDA_TEST_UTIL_H
#define PD_TESTS_GPU_CUDA_TEST_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"

enum { PAIR_CPU = 0, PAIR_GPU = 1 };

typedef struct {
    pd_backend *b[2];
    const pd_backend_ops *o[2];
} cuda_pair;

/* 1 when a CUDA device is usable; else 0 with the reason in pd_last_error(). */
int ctu_have_gpu(void);
/* Usable CUDA devices (0 without a GPU or driver). */
int ctu_gpu_count(void);
/* Parameters of the CPU reference: f32 weights, one thread. One thread because the reference
 * must not depend on scheduling: on a 16-core host the CPU backend's threaded matmul returned
 * wrong results and crashed in mm_task (a pd_pool_run race, reported to the lead). */
pd_backend_params ctu_cpu_ref_params(void);
/* CPU reference backend + CUDA backend with gpu_weight_dtype (-1 = default). */
int ctu_pair_open(cuda_pair *p, int gpu_weight_dtype);
void ctu_pair_close(cuda_pair *p);

/* Uniform in [-scale, scale], rounded to bf16 (so exact on both backends). seed is updated. */
float ctu_rand(uint64_t *seed, float scale);
void ctu_fill(float *x, size_t n, uint64_t *seed, float scale);

/* A device buffer of n activations of backend b holding host f32 x (converted to b's dtype). */
int ctu_act_upload(pd_backend *b, const float *x, size_t n, void **out);
/* An uninitialized activation buffer of n elements. */
int ctu_act_alloc(pd_backend *b, size_t n, void **out);
/* Host f32 copy of n activations (waits). */
int ctu_act_download(pd_backend *b, const void *buf, size_t n, float *out);

/* sum (a - ref)^2 / sum ref^2 (0 when both are all zero). */
double ctu_nmse(const float *a, const float *ref, size_t n);
/* sqrt(sum (a - ref)^2) / sqrt(sum ref^2). */
double ctu_rel_err(const float *a, const float *ref, size_t n);

#endif

/* ---- whole-model runs (tests and bench_cuda) ------------------------------------------------ */

#include "backend/forward.h"
#include "model/model.h"

/* Makes (once per process) a pd-mkmodel model of preset with dtype ("" = preset default) under
 * pdt-style dir base and writes its path into out. The binary is $PD_MKMODEL, else
 * $PD_BUILD_ROOT/tools/mkmodel/pd-mkmodel. A dir that already holds config.json is reused. */
int ctu_make_model(const char *base, const char *preset, const char *dtype, char *out,
                   size_t out_size);
/* The same with pd-mkmodel's --arch arch ("" = its default, llama). */
int ctu_make_model_arch(const char *base, const char *preset, const char *dtype, const char *arch,
                        char *out, size_t out_size);

/* One forward pass + KV pool driven like a tiny engine: n_seqs sequences with interleaved
 * (non-contiguous) block tables, each step appends rows to some sequences and returns the last
 * row's logits of each. */
typedef struct {
    pd_backend *b;
    pd_forward *f;
    pd_kv *kv;
    size_t n_seqs, blocks_per_seq, block_size, vocab, max_tokens;
    int32_t *ctx_len; /* (n_seqs) cached tokens per sequence */
    float *logits;    /* (n_seqs, vocab) of the last step; pinned host memory on CUDA (what an
                         engine would use: the download then runs at full PCIe speed) */
    int pinned;
    /* step scratch */
    int32_t *tok, *qip, *kvl, *bip, *bid, *out_rows;
} ctu_runner;

int ctu_runner_open(ctu_runner *r, pd_backend *b, const pd_model *m, size_t n_seqs, size_t max_ctx,
                    size_t max_tokens);
/* The same with pd_forward_params.no_fused (1: the plain ops only). */
int ctu_runner_open_ex(ctu_runner *r, pd_backend *b, const pd_model *m, size_t n_seqs,
                       size_t max_ctx, size_t max_tokens, int no_fused);
void ctu_runner_close(ctu_runner *r);
/* For i < n: sequence seqs[i] appends rows[i] tokens toks[i][0..rows[i]). logits row i (in
 * r->logits) is the last new row of seqs[i]. */
int ctu_runner_step(ctu_runner *r, size_t n, const int32_t *seqs, const int32_t *const *toks,
                    const int32_t *rows);
/* Index of the largest of v[0..n) (first on ties). */
int32_t ctu_argmax(const float *v, size_t n);
