/* The CUDA backend: fills the backend operation table (backend.h) for one NVIDIA GPU.
 *
 * Design: one instance = one device, one CUDA stream, one cuBLAS handle; every op is enqueued on
 * that stream in call order and nothing synchronizes except sync/download (and plan, which waits
 * for the previous step's use of its pinned staging buffer). Weights are matrices in bf16
 * (default), f16 or f32 (params->weight_dtype) and vectors (norms, biases) in f32.
 * Activations and the KV pool are bf16, except in the f32 precision mode (weight_dtype F32),
 * where weights, activations and the KV pool are all f32 (a reference mode: full-f32 GEMMs).
 * Every reduction (cuBLAS GEMMs with CUBLAS_COMPUTE_32F, our GEMV for decode rows, norms,
 * softmax, attention) accumulates in f32. Per-step metadata is copied by plan into pinned host
 * staging then into device buffers sized at create from params->max_tokens / max_seqs /
 * max_blocks / max_rope_dim; no op allocates. Threads: plan makes the device current on the
 * calling thread, and the ops of that step must be called from the same thread.
 *
 * Decode-only steps whose shape (rows, outputs) repeats are captured once into a CUDA graph and
 * replayed while the op calls match the recorded ones (see "graphs" in cuda_step.cu);
 * PD_CUDA_GRAPHS=0 in the environment at create time turns this off.
 *
 * Kernels live one family per .cu file with their host launchers (llm.c style); cuda_backend.cu
 * holds the op table, whose entries live in the files cuda_be.cuh lists. Every CUDA/cuBLAS call
 * is checked and turned into a pd_error() status.
 */
#ifndef PD_BACKEND_CUDA_BACKEND_H
#define PD_BACKEND_CUDA_BACKEND_H

#ifdef __cplusplus
extern "C" {
#endif

#include "backend/backend.h"

/* Creates a CUDA backend on params->device (NULL params = pd_backend_default_params()).
 * PD_ENOTFOUND when there is no usable CUDA device (message names the CUDA error),
 * PD_EUNSUPPORTED for a weight_dtype other than -1/F32/F16/BF16, PD_ENOMEM when the step
 * buffers do not fit, PD_EINTERNAL for any other CUDA/cuBLAS failure. */
int pd_backend_cuda_create(const pd_backend_params *params, pd_backend **out);

/* KV-pool sizing by --gpu-memory-utilization (vLLM's meaning: this instance's share of the
 * device, also when other instances share it): call after the weights and all other buffers
 * are allocated. The pool gets total * util minus what this backend has taken since it was
 * created (weights, workspaces), capped by the memory free now less 256 MiB. *n_blocks = that
 * budget divided by the bytes of one block of a pool shaped like p (p->n_blocks is ignored);
 * the capacity is logged. PD_EINVAL for util outside (0, 1] or an empty p, PD_ENOMEM (with the
 * figures) when not even one block fits. b must be a CUDA backend. */
int pd_backend_cuda_kv_blocks(pd_backend *b, const pd_kv_params *p, double util, size_t *n_blocks);

/* The CUDA device ordinal of b (a CUDA backend). */
int pd_backend_cuda_device(const pd_backend *b);
/* For code that enqueues work on b's step stream between its ops (the NCCL all-reduce of tensor
 * parallelism): leaves graph mode, makes b's device current on the calling thread and sets
 * *stream to the step stream (a cudaStream_t). Call from the thread that runs b's steps. */
int pd_backend_cuda_step_stream(pd_backend *b, void **stream);
/* Device time of b's KV pulls (kv_pull, the CUDA IPC import), for benchmarks: after
 * pd_backend_cuda_pull_timing, each pull records an event before its kernel(s) and one after
 * (two calls more per pull), and pd_backend_cuda_pull_time reports the sum and the
 * best of those times in seconds and the number of pulls timed. */
int pd_backend_cuda_pull_timing(pd_backend *b);
void pd_backend_cuda_pull_time(pd_backend *b, double *sum, double *best, uint64_t *n);
/* The geometry of a CUDA backend's pool (n_blocks included). */
int pd_backend_cuda_kv_params(const pd_kv *kv, pd_kv_params *out);

#ifdef __cplusplus
}
#endif
#endif
