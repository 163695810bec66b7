/* CUDA device discovery and the device-to-device copy bandwidth that GPU benchmarks use
 * as their memory-bandwidth reference. Plain C header; implemented in cuda_info.cu.
 * Every function is safe to call on a machine without a GPU or driver: it returns
 * PD_ENOTFOUND with the CUDA error in the message. */
#ifndef PD_BACKEND_CUDA_INFO_H
#define PD_BACKEND_CUDA_INFO_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_cuda_info {
    int runtime_version; /* cudaRuntimeGetVersion, e.g. 13000 */
    int driver_version;  /* cudaDriverGetVersion; 0 without a driver */
    int cublas_version;  /* major*10000 + minor*100 + patch */
    int nccl_version;    /* ncclGetVersion, e.g. 22809 */
    int device_count;    /* 0 when no usable device */
    /* filled for the queried device when device_count > 0 */
    char name[256];
    int cc_major, cc_minor;
    int sm_count;
    size_t total_mem_bytes;
    size_t free_mem_bytes;
} pd_cuda_info;

/* Versions always; device fields for `device` when one exists.
 * Returns 0, or PD_ENOTFOUND ("no CUDA device: <cuda error>") with versions still filled. */
int pd_cuda_query(int device, pd_cuda_info *out);

/* Measures cudaMemcpyDeviceToDevice bandwidth on `device` for a buffer of `bytes`,
 * best of `iters` timed copies after one warm-up, and checks the copied bytes.
 * Reports bytes read + written per second in GB/s (1e9), as STREAM's copy does. */
int pd_cuda_d2d_bandwidth(int device, size_t bytes, int iters, double *gbps);

#ifdef __cplusplus
}
#endif
#endif
