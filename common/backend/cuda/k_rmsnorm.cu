// RMSNorm kernel and launcher: y = x * rsqrt(mean(x^2) + eps) * w, one block per row.
//
// Design: the sum of squares is reduced in f32 (per-thread partials, then warp shuffles, then
// one shared-memory pass over the warps); the scaling is applied as (x * r) * w in f32 like
// Hugging Face's float32 path, rounded once to the activation type. In place (y == x) is safe: each
// thread reads its elements again in the second pass before writing them.
#include "backend/cuda/cuda_common.cuh"

#define NORM_THREADS 256

template <typename T>
__global__ void rmsnorm_kernel(const T *x, const float *w, float eps, size_t dim, T *y)
{
    __shared__ float warp_sums[NORM_THREADS / 32];
    __shared__ float r_shared;
    const T *xr = x + (size_t)blockIdx.x * dim;
    T *yr = y + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (size_t i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = ldf(xr, i);
        ss += v * v;
    }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < blockDim.x / 32 ? warp_sums[threadIdx.x] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (threadIdx.x == 0) r_shared = rsqrtf(v / (float)dim + eps);
    }
    __syncthreads();
    float r = r_shared;
    for (size_t i = threadIdx.x; i < dim; i += blockDim.x) stf(yr, i, (ldf(xr, i) * r) * w[i]);
}

int cuda_rmsnorm(cudaStream_t s, int act, const void *x, const float *w, float eps, size_t n,
                 size_t dim, void *y)
{
    if (n == 0) return PD_OK;
    if (n > 0x7fffffffu) return pd_error(PD_EINVAL, "cuda rmsnorm: %zu rows is too many", n);
    ACT_DISPATCH(
        act, T,
        rmsnorm_kernel<<<(unsigned)n, NORM_THREADS, 0, s>>>((const T *)x, w, eps, dim, (T *)y));
    CUDA_LAUNCH_CHECK("rmsnorm_kernel");
}
