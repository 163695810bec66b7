// Matrix-vector products for decode rows: y (n, out) = x (n, in) . W^T (+ bias), n <= 8, and its
// launcher.
//
// Design: decode is bound by reading the weights once per step, and cuBLAS's GEMM tiles waste
// most of their work (and grid) when n is 1..8, so small n takes this kernel: one warp per
// output row streams the weight row with 16-byte loads, 4 loads in flight per lane, applies it
// to all n input rows (each weight element read once per step), then reduces across the warp.
// The reduction order depends only on `in` (never on n or on other rows), so a row's result is
// the same whatever the batch; the bias is added in f32 before the single rounding of y.
#include <stdint.h>

#include "backend/cuda/cuda_common.cuh"

#define GEMV_WARPS  8
#define GEMV_UNROLL 4

__device__ __forceinline__ void load8(const bf16 *p, float f[8])
{
    uint4 u = __ldg((const uint4 *)p);
    const __nv_bfloat162 *h = (const __nv_bfloat162 *)&u;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 v = __bfloat1622float2(h[i]);
        f[2 * i] = v.x;
        f[2 * i + 1] = v.y;
    }
}

__device__ __forceinline__ void load8(const __half *p, float f[8])
{
    uint4 u = __ldg((const uint4 *)p);
    const __half2 *h = (const __half2 *)&u;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 v = __half22float2(h[i]);
        f[2 * i] = v.x;
        f[2 * i + 1] = v.y;
    }
}

__device__ __forceinline__ void load8(const float *p, float f[8])
{
    float4 a = __ldg((const float4 *)p), b = __ldg((const float4 *)p + 1);
    f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w;
    f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}

template <typename TW, typename TX, int N>
__global__ void __launch_bounds__(GEMV_WARPS * 32)
    gemv_kernel(const TX *x, const TW *W, size_t out, size_t in, const float *bias, TX *y)
{
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const size_t j = (size_t)blockIdx.x * GEMV_WARPS + warp;
    if (j >= out) return;
    const TW *wr = W + j * in;
    float acc[N];
#pragma unroll
    for (int r = 0; r < N; r++) acc[r] = 0.0f;
    const size_t chunks = in / 8; // 8-element chunks of the row
    for (size_t c0 = lane; c0 < chunks; c0 += 32 * GEMV_UNROLL) {
        float w[GEMV_UNROLL][8];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            size_t c = c0 + (size_t)u * 32;
            if (c < chunks) load8(wr + c * 8, w[u]);
        }
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            size_t c = c0 + (size_t)u * 32;
            if (c >= chunks) break;
#pragma unroll
            for (int r = 0; r < N; r++) {
                float xv[8];
                load8(x + (size_t)r * in + c * 8, xv);
                float s = 0.0f;
#pragma unroll
                for (int e = 0; e < 8; e++) s += w[u][e] * xv[e];
                acc[r] += s;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < N; r++) {
        float v = acc[r];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) stf(y, (size_t)r * out + j, bias ? v + bias[j] : v);
    }
}

template <typename TW, typename TX>
static void gemv_launch(cudaStream_t s, const TX *x, size_t n, const TW *W, size_t out, size_t in,
                        const float *bias, TX *y)
{
    unsigned grid = (unsigned)((out + GEMV_WARPS - 1) / GEMV_WARPS);
    const unsigned th = GEMV_WARPS * 32;
    switch (n) {
    case 1: gemv_kernel<TW, TX, 1><<<grid, th, 0, s>>>(x, W, out, in, bias, y); break;
    case 2: gemv_kernel<TW, TX, 2><<<grid, th, 0, s>>>(x, W, out, in, bias, y); break;
    case 3: gemv_kernel<TW, TX, 3><<<grid, th, 0, s>>>(x, W, out, in, bias, y); break;
    case 4: gemv_kernel<TW, TX, 4><<<grid, th, 0, s>>>(x, W, out, in, bias, y); break;
    case 5: gemv_kernel<TW, TX, 5><<<grid, th, 0, s>>>(x, W, out, in, bias, y); break;
    case 6: gemv_kernel<TW, TX, 6><<<grid, th, 0, s>>>(x, W, out, in, bias, y); break;
    case 7: gemv_kernel<TW, TX, 7><<<grid, th, 0, s>>>(x, W, out, in, bias, y); break;
    default: gemv_kernel<TW, TX, 8><<<grid, th, 0, s>>>(x, W, out, in, bias, y); break;
    }
}

int cuda_gemv(cudaStream_t s, int act, const void *x, size_t n, const void *W, int wdtype,
              size_t out, size_t in, const float *bias, void *y)
{
    if (n < 1 || n > CUDA_GEMV_MAX_N || in % 8 || ((uintptr_t)x | (uintptr_t)W) % 16 ||
        out > (size_t)0x7fffffff * GEMV_WARPS)
        return PD_EUNSUPPORTED; // the caller takes the GEMM path; no message needed
    if (act == ACT_BF16 && wdtype == ACT_BF16)
        gemv_launch(s, (const bf16 *)x, n, (const bf16 *)W, out, in, bias, (bf16 *)y);
    else if (act == ACT_BF16 && wdtype == ACT_F16)
        gemv_launch(s, (const bf16 *)x, n, (const __half *)W, out, in, bias, (bf16 *)y);
    else if (act == ACT_F32 && wdtype == ACT_F32)
        gemv_launch(s, (const float *)x, n, (const float *)W, out, in, bias, (float *)y);
    else
        return PD_EUNSUPPORTED;
    CUDA_LAUNCH_CHECK("gemv_kernel");
}
