// Element-wise and row-copy kernels of the CUDA backend, each with its launcher: embedding
// lookup, row gather, SwiGLU, residual add, dtype conversions and the GEMM bias epilogue.
//
// Design: grid-stride loops over elements, templates over the storage types, f32 arithmetic
// and one rounding at the store; launches are capped at a fixed number of blocks so a grid
// never overflows.
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_common.cuh"

#define EW_THREADS 256

static unsigned ew_blocks(size_t n)
{
    size_t b = (n + EW_THREADS - 1) / EW_THREADS;
    if (b > 65535) b = 65535;
    return b ? (unsigned)b : 1u;
}

#define GRID_STRIDE(i, n)                                                                          \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);                        \
         i += (size_t)gridDim.x * blockDim.x)

// ---- embedding --------------------------------------------------------------------------------

template <typename TT, typename T>
__global__ void embed_kernel(const TT *table, size_t H, const int32_t *ids, size_t n, T *out)
{
    GRIDDEP_ENTRY();
    GRID_STRIDE(i, n * H)
    {
        size_t r = i / H, c = i % H;
        stf(out, i, ldf(table, (size_t)ids[r] * H + c));
    }
}

int cuda_embed(cudaStream_t s, int act, const void *table, int tdtype, size_t H, const int32_t *ids,
               size_t n, void *out)
{
    if (n == 0) return PD_OK;
    ACT_DISPATCH(act, T, {
        if (tdtype == ACT_F32)
            cuda_launch(embed_kernel<float, T>, ew_blocks(n * H), EW_THREADS, 0, s,
                        (const float *)table, H, ids, n, (T *)out);
        else if (tdtype == ACT_F16)
            cuda_launch(embed_kernel<__half, T>, ew_blocks(n * H), EW_THREADS, 0, s,
                        (const __half *)table, H, ids, n, (T *)out);
        else
            cuda_launch(embed_kernel<bf16, T>, ew_blocks(n * H), EW_THREADS, 0, s,
                        (const bf16 *)table, H, ids, n, (T *)out);
    });
    CUDA_LAUNCH_CHECK("embed_kernel");
}

// ---- gather rows ------------------------------------------------------------------------------

template <typename T>
__global__ void gather_rows_kernel(const T *x, size_t dim, const int32_t *rows, size_t n_out,
                                   T *out)
{
    GRIDDEP_ENTRY();
    GRID_STRIDE(i, n_out * dim)
    {
        size_t r = i / dim, c = i % dim;
        out[i] = x[(size_t)rows[r] * dim + c];
    }
}

int cuda_gather_rows(cudaStream_t s, int act, const void *x, size_t dim, const int32_t *rows,
                     size_t n_out, void *out)
{
    if (n_out == 0) return PD_OK;
    ACT_DISPATCH(act, T,
                 cuda_launch(gather_rows_kernel<T>, ew_blocks(n_out * dim), EW_THREADS, 0, s,
                             (const T *)x, dim, rows, n_out, (T *)out));
    CUDA_LAUNCH_CHECK("gather_rows_kernel");
}

// ---- SwiGLU -------------------------------------------------------------------------------------

template <typename T> __global__ void swiglu_kernel(const T *gate, const T *up, size_t n, T *out)
{
    GRIDDEP_ENTRY();
    GRID_STRIDE(i, n)
    {
        float g = ldf(gate, i), u = ldf(up, i);
        stf(out, i, (g / (1.0f + expf(-g))) * u);
    }
}

// The same per element, 16 bytes of each operand per thread (nv 16-byte groups): a prefill's
// SwiGLU moves tens of megabytes, and 2-byte accesses leave most of the bandwidth unused.
template <typename T>
__global__ void swiglu_vec_kernel(const T *gate, const T *up, size_t nv, T *out)
{
    GRIDDEP_ENTRY();
    constexpr int E = 16 / (int)sizeof(T);
    GRID_STRIDE(i, nv)
    {
        uint4 gr = __ldg((const uint4 *)gate + i), ur = __ldg((const uint4 *)up + i), orr;
        const T *g = (const T *)&gr, *u = (const T *)&ur;
        T *o = (T *)&orr;
#pragma unroll
        for (int e = 0; e < E; e++) {
            float gv = ldf(g, e), uv = ldf(u, e);
            stf(o, e, (gv / (1.0f + expf(-gv))) * uv);
        }
        ((uint4 *)out)[i] = orr;
    }
}

int cuda_swiglu(cudaStream_t s, int act, const void *gate, const void *up, size_t n, void *out)
{
    if (n == 0) return PD_OK;
    size_t e = act == ACT_F32 ? 4 : 8; // elements per 16 bytes
    if (n % e == 0 && (((uintptr_t)gate | (uintptr_t)up | (uintptr_t)out) & 15) == 0)
        ACT_DISPATCH(act, T,
                     cuda_launch(swiglu_vec_kernel<T>, ew_blocks(n / e), EW_THREADS, 0, s,
                                 (const T *)gate, (const T *)up, n / e, (T *)out));
    else
        ACT_DISPATCH(act, T,
                     cuda_launch(swiglu_kernel<T>, ew_blocks(n), EW_THREADS, 0, s, (const T *)gate,
                                 (const T *)up, n, (T *)out));
    CUDA_LAUNCH_CHECK("swiglu_kernel");
}

// ---- residual add ---------------------------------------------------------------------------

template <typename T> __global__ void add_kernel(T *y, const T *x, size_t n)
{
    GRIDDEP_ENTRY();
    GRID_STRIDE(i, n) stf(y, i, ldf(y, i) + ldf(x, i));
}

int cuda_add(cudaStream_t s, int act, void *y, const void *x, size_t n)
{
    if (n == 0) return PD_OK;
    ACT_DISPATCH(
        act, T,
        cuda_launch(add_kernel<T>, ew_blocks(n), EW_THREADS, 0, s, (T *)y, (const T *)x, n));
    CUDA_LAUNCH_CHECK("add_kernel");
}

// ---- conversions ------------------------------------------------------------------------------

__device__ __forceinline__ void stf(__half *p, size_t i, float v)
{
    p[i] = __float2half(v);
}

template <typename TS, typename TD> __global__ void convert_kernel(const TS *src, size_t n, TD *dst)
{
    GRIDDEP_ENTRY();
    GRID_STRIDE(i, n) stf(dst, i, ldf(src, i));
}

int cuda_act_convert(cudaStream_t s, int act, const void *src, size_t n, int dst_t, void *dst)
{
    if (n == 0) return PD_OK;
    if (dst_t == act) {
        size_t e = act == ACT_F32 ? 4 : 2;
        CUDA_TRY(cudaMemcpyAsync(dst, src, n * e, cudaMemcpyDeviceToDevice, s));
        return PD_OK;
    }
    ACT_DISPATCH(act, T, {
        if (dst_t == ACT_F32)
            cuda_launch(convert_kernel<T, float>, ew_blocks(n), EW_THREADS, 0, s, (const T *)src, n,
                        (float *)dst);
        else if (dst_t == ACT_F16)
            cuda_launch(convert_kernel<T, __half>, ew_blocks(n), EW_THREADS, 0, s, (const T *)src,
                        n, (__half *)dst);
        else
            cuda_launch(convert_kernel<T, bf16>, ew_blocks(n), EW_THREADS, 0, s, (const T *)src, n,
                        (bf16 *)dst);
    });
    CUDA_LAUNCH_CHECK("convert_kernel");
}

template <typename T>
__global__ void bias_epilogue_kernel(const float *y32, const float *bias, size_t n, size_t out,
                                     T *y)
{
    GRIDDEP_ENTRY();
    GRID_STRIDE(i, n * out)
    {
        float v = y32[i];
        if (bias) v += bias[i % out];
        stf(y, i, v);
    }
}

int cuda_bias_epilogue(cudaStream_t s, int act, const float *y32, const float *bias, size_t n,
                       size_t out, void *y)
{
    if (n == 0) return PD_OK;
    ACT_DISPATCH(act, T,
                 cuda_launch(bias_epilogue_kernel<T>, ew_blocks(n * out), EW_THREADS, 0, s, y32,
                             bias, n, out, (T *)y));
    CUDA_LAUNCH_CHECK("bias_epilogue_kernel");
}

// ---- programmatic dependent launch switch (cuda_common.cuh) -------------------------------------

int cuda_pdl;

int cuda_pdl_allowed(int device_major, int *allowed)
{
    const char *e = getenv("PD_CUDA_PDL");
    // The kernels wait in griddepcontrol.wait only where they were compiled for sm_90 or newer
    // (a JIT from older PTX leaves it out): launch with the attribute only then.
    cudaFuncAttributes fa;
    CUDA_TRY(cudaFuncGetAttributes(&fa, add_kernel<bf16>));
    *allowed = !(e && strcmp(e, "0") == 0) && device_major >= 9 && fa.binaryVersion >= 90;
    return PD_OK;
}
