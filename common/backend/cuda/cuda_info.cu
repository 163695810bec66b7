// Device discovery and D2D copy bandwidth (see cuda_info.h).
#include "backend/cuda/cuda_info.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

extern "C" {
#include "util/status.h"
}

#define CUDA_TRY(expr)                                                                             \
    do {                                                                                           \
        cudaError_t e_ = (expr);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            return pd_error(PD_EINTERNAL, "%s: %s (%s:%d)", #expr, cudaGetErrorString(e_),         \
                            __FILE__, __LINE__);                                                   \
    } while (0)

// Fills dst[i] with a position-dependent pattern so a wrong copy is detected.
__global__ void fill_pattern(uint32_t *dst, size_t n, uint32_t seed)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (; i < n; i += stride) dst[i] = (uint32_t)(i * 2654435761u) ^ seed;
}

// Counts words of dst that differ from the pattern.
__global__ void check_pattern(const uint32_t *dst, size_t n, uint32_t seed, unsigned long long *bad)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t stride = (size_t)gridDim.x * blockDim.x;
    unsigned long long local = 0;
    for (; i < n; i += stride) local += dst[i] != ((uint32_t)(i * 2654435761u) ^ seed);
    if (local) atomicAdd(bad, local);
}

extern "C" int pd_cuda_query(int device, pd_cuda_info *out)
{
    memset(out, 0, sizeof *out);
    cudaRuntimeGetVersion(&out->runtime_version);
    cudaDriverGetVersion(&out->driver_version);
    int major = 0, minor = 0, patch = 0;
    cublasGetProperty(MAJOR_VERSION, &major);
    cublasGetProperty(MINOR_VERSION, &minor);
    cublasGetProperty(PATCH_LEVEL, &patch);
    out->cublas_version = major * 10000 + minor * 100 + patch;
    ncclGetVersion(&out->nccl_version);
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    // Without libcuda this is cudaErrorInsufficientDriver, not NoDevice: any failure = no GPU.
    if (e != cudaSuccess || n == 0) {
        const char *why = e != cudaSuccess ? cudaGetErrorString(e) : "device count is 0";
        cudaGetLastError(); // clear the sticky-free error state
        return pd_error(PD_ENOTFOUND, "no CUDA device: %s", why);
    }
    out->device_count = n;
    if (device < 0 || device >= n)
        return pd_error(PD_ENOTFOUND, "CUDA device %d does not exist (%d present)", device, n);
    cudaDeviceProp prop;
    CUDA_TRY(cudaGetDeviceProperties(&prop, device));
    snprintf(out->name, sizeof out->name, "%s", prop.name);
    out->cc_major = prop.major;
    out->cc_minor = prop.minor;
    out->sm_count = prop.multiProcessorCount;
    out->total_mem_bytes = prop.totalGlobalMem;
    CUDA_TRY(cudaSetDevice(device));
    CUDA_TRY(cudaMemGetInfo(&out->free_mem_bytes, &out->total_mem_bytes));
    return PD_OK;
}

extern "C" int pd_cuda_d2d_bandwidth(int device, size_t bytes, int iters, double *gbps)
{
    if (iters < 1 || bytes < 4096) return pd_error(PD_EINVAL, "d2d bandwidth: bad size/iters");
    CUDA_TRY(cudaSetDevice(device));
    size_t n = bytes / sizeof(uint32_t);
    bytes = n * sizeof(uint32_t);
    uint32_t *src = NULL, *dst = NULL;
    unsigned long long *bad = NULL, bad_host = 0;
    cudaEvent_t t0 = NULL, t1 = NULL;
    int rc = PD_OK;
    float best_ms = 1e30f;
    cudaError_t e;
#define STEP(expr)                                                                                 \
    if ((e = (expr)) != cudaSuccess) {                                                             \
        rc = pd_error(PD_EINTERNAL, "%s: %s", #expr, cudaGetErrorString(e));                       \
        goto done;                                                                                 \
    }
    STEP(cudaMalloc(&src, bytes));
    STEP(cudaMalloc(&dst, bytes));
    STEP(cudaMalloc(&bad, sizeof *bad));
    STEP(cudaMemset(bad, 0, sizeof *bad));
    STEP(cudaEventCreate(&t0));
    STEP(cudaEventCreate(&t1));
    fill_pattern<<<1024, 256>>>(src, n, 0x9e3779b9u);
    STEP(cudaGetLastError());
    STEP(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice)); // warm-up
    for (int i = 0; i < iters; i++) {
        float ms = 0;
        STEP(cudaEventRecord(t0));
        STEP(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice));
        STEP(cudaEventRecord(t1));
        STEP(cudaEventSynchronize(t1));
        STEP(cudaEventElapsedTime(&ms, t0, t1));
        if (ms < best_ms) best_ms = ms;
    }
    check_pattern<<<1024, 256>>>(dst, n, 0x9e3779b9u, bad);
    STEP(cudaGetLastError());
    STEP(cudaMemcpy(&bad_host, bad, sizeof bad_host, cudaMemcpyDeviceToHost));
    if (bad_host) {
        rc = pd_error(PD_EINTERNAL, "d2d copy corrupted %llu of %zu words", bad_host, n);
        goto done;
    }
    *gbps = 2.0 * (double)bytes / (best_ms * 1e-3) / 1e9;
#undef STEP
done:
    if (t0) cudaEventDestroy(t0);
    if (t1) cudaEventDestroy(t1);
    cudaFree(src);
    cudaFree(dst);
    cudaFree(bad);
    return rc;
}
