// RMSNorm kernels and launcher: y = x * rsqrt(mean(x^2) + eps) * w, one block per row.
//
// Design: the sum of squares is reduced in f32 (per-thread partials, then warp shuffles, then
// one shared-memory pass over the warps); the scaling is applied as (x * r) * w in f32 like
// Hugging Face's float32 path, rounded once to the activation type. A row is a few KiB, so the
// kernel is bound by memory latency, not bandwidth: the main kernel reads the row once in
// 16-byte chunks into registers (with the matching weight chunks, loaded at the same time),
// reduces, and writes from the registers, with a block size fitted to the row (one chunk per
// thread up to 1024 threads, then two chunks each). The block size and each
// thread's chunks depend only on dim, so a row's result does not depend on n. In place
// (y == x) is safe: each thread writes only the chunks it read itself. Rows that do not split
// into aligned chunks (dim % (16 / elem) != 0, misaligned pointers) or exceed the register
// budget take the scalar kernel, which reads x twice.
// With ADD (vLLM's fused_add_rms_norm) each kernel first adds the sublayer output to the
// residual row, rounds the sum to the activation type, stores it (back, or to another buffer)
// and normalizes that rounded row: the values of an add launch followed by an rmsnorm launch,
// in one pass. The GEMVs that take the norm themselves (k_gemv.cu) follow the vector kernel's
// order (norm_vec_shape).
#include <stdint.h>

#include "backend/cuda/cuda_common.cuh"

#define NORM_THREADS 256 // scalar kernel

// Sum of v over the block (blockDim.x a multiple of 32, <= 1024), returned to every thread.
__device__ static float norm_block_sum(float v)
{
    __shared__ float warp_sums[32];
    __shared__ float total;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        float s = threadIdx.x < blockDim.x / 32 ? warp_sums[threadIdx.x] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (threadIdx.x == 0) total = s;
    }
    __syncthreads();
    return total;
}

template <typename T, bool ADD>
__global__ void rmsnorm_kernel(const T *x, const T *add, T *xo, const float *w, float eps,
                               size_t dim, T *y)
{
    GRIDDEP_ENTRY();
    const T *xr = (ADD ? xo : x) + (size_t)blockIdx.x * dim; // the row normalized
    const T *ar = add + (ADD ? (size_t)blockIdx.x * dim : 0);
    T *yr = y + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (size_t i = threadIdx.x; i < dim; i += blockDim.x) {
        if (ADD) // read back below by this thread only
            stf(xo + (size_t)blockIdx.x * dim, i,
                ldf(x + (size_t)blockIdx.x * dim, i) + ldf(ar, i));
        float v = ldf(xr, i);
        ss += v * v;
    }
    float r = rsqrtf(norm_block_sum(ss) / (float)dim + eps);
    for (size_t i = threadIdx.x; i < dim; i += blockDim.x) stf(yr, i, (ldf(xr, i) * r) * w[i]);
}

// R: chunks per thread (chunk c = threadIdx.x + r * blockDim.x of the row's dim / EPC chunks).
template <typename T, int R, bool ADD>
__global__ void __launch_bounds__(NORM_MAX_THREADS)
    rmsnorm_vec_kernel(const T *x, const T *add, T *xo, const float *w, float eps, int dim, T *y)
{
    GRIDDEP_ENTRY();
    constexpr int EPC = norm_chunk<T>::EPC;
    const int nch = dim / EPC;
    const norm_chunk<T> *xr = (const norm_chunk<T> *)(x + (size_t)blockIdx.x * dim);
    const norm_chunk<T> *ar = (const norm_chunk<T> *)(add + (ADD ? (size_t)blockIdx.x * dim : 0));
    norm_chunk<T> *xw = (norm_chunk<T> *)(xo + (ADD ? (size_t)blockIdx.x * dim : 0));
    norm_chunk<T> *yr = (norm_chunk<T> *)(y + (size_t)blockIdx.x * dim);
    const float4 *w4 = (const float4 *)w; // dim / 4 float4s
    norm_chunk<T> xv[R];                  // the thread's chunks of the row
    float4 wv[R][EPC / 4];                // and of the weight
#pragma unroll
    for (int r = 0; r < R; r++) {
        int c = (int)threadIdx.x + r * (int)blockDim.x;
        if (c < nch) {
            xv[r] = xr[c];
            if (ADD) {
                norm_chunk<T> a = ar[c];
#pragma unroll
                for (int e = 0; e < EPC; e++) xv[r].e[e] = (T)((float)xv[r].e[e] + (float)a.e[e]);
                xw[c] = xv[r];
            }
#pragma unroll
            for (int k = 0; k < EPC / 4; k++) wv[r][k] = __ldg(w4 + (size_t)c * (EPC / 4) + k);
        }
    }
    float ss = 0.0f;
#pragma unroll
    for (int r = 0; r < R; r++) {
        int c = (int)threadIdx.x + r * (int)blockDim.x;
        if (c >= nch) continue;
#pragma unroll
        for (int e = 0; e < EPC; e++) {
            float v = (float)xv[r].e[e];
            ss += v * v;
        }
    }
    const float rs = rsqrtf(norm_block_sum(ss) / (float)dim + eps);
#pragma unroll
    for (int r = 0; r < R; r++) {
        int c = (int)threadIdx.x + r * (int)blockDim.x;
        if (c >= nch) continue;
        const float *wf = (const float *)wv[r];
        norm_chunk<T> o;
#pragma unroll
        for (int e = 0; e < EPC; e++) o.e[e] = (T)(((float)xv[r].e[e] * rs) * wf[e]);
        yr[c] = o;
    }
}

template <typename T, bool ADD>
static void rmsnorm_launch(cudaStream_t s, const T *x, const T *add, T *xo, const float *w,
                           float eps, size_t n, size_t dim, T *y)
{
    constexpr int EPC = norm_chunk<T>::EPC;
    int threads, R;
    const bool vec =
        norm_vec_shape(dim / EPC, &threads, &R) && dim % EPC == 0 &&
        ((uintptr_t)x | (uintptr_t)add | (uintptr_t)xo | (uintptr_t)y | (uintptr_t)w) % 16 == 0;
    if (!vec) {
        cuda_launch(rmsnorm_kernel<T, ADD>, (unsigned)n, NORM_THREADS, 0, s, x, add, xo, w, eps,
                    dim, y);
        return;
    }
    const unsigned g = (unsigned)n, b = (unsigned)threads;
    if (R <= 1)
        cuda_launch(rmsnorm_vec_kernel<T, 1, ADD>, g, b, 0, s, x, add, xo, w, eps, (int)dim, y);
    else
        cuda_launch(rmsnorm_vec_kernel<T, NORM_MAX_R, ADD>, g, b, 0, s, x, add, xo, w, eps,
                    (int)dim, y);
}

int cuda_rmsnorm(cudaStream_t s, int act, const void *x, const float *w, float eps, size_t n,
                 size_t dim, void *y)
{
    if (n == 0) return PD_OK;
    if (n > 0x7fffffffu) return pd_error(PD_EINVAL, "cuda rmsnorm: %zu rows is too many", n);
    // x is only read without ADD
    ACT_DISPATCH(act, T,
                 rmsnorm_launch<T, false>(s, (const T *)x, (const T *)NULL, (T *)NULL, w, eps, n,
                                          dim, (T *)y));
    CUDA_LAUNCH_CHECK("rmsnorm_kernel");
}

int cuda_add_rmsnorm(cudaStream_t s, int act, const void *x, const void *add, void *xo,
                     const float *w, float eps, size_t n, size_t dim, void *y)
{
    if (n == 0) return PD_OK;
    if (n > 0x7fffffffu) return pd_error(PD_EINVAL, "cuda rmsnorm: %zu rows is too many", n);
    ACT_DISPATCH(
        act, T,
        rmsnorm_launch<T, true>(s, (const T *)x, (const T *)add, (T *)xo, w, eps, n, dim, (T *)y));
    CUDA_LAUNCH_CHECK("rmsnorm_kernel");
}
