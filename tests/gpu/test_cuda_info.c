/* GPU smoke test: device discovery and a verified device-to-device copy. */
#include "harness.h"

#include "backend/cuda/cuda_info.h"

TEST(cuda_device_and_d2d_copy)
{
    pd_cuda_info info;
    int rc = pd_cuda_query(0, &info);
    printf("    cudart %d, driver %d, cuBLAS %d, NCCL %d\n", info.runtime_version,
           info.driver_version, info.cublas_version, info.nccl_version);
    ASSERT(info.runtime_version >= 12000);
    ASSERT(info.nccl_version > 0);
    if (rc == PD_ENOTFOUND) SKIP(pd_last_error());
    ASSERT_OK(rc);
    printf("    device 0: %s, sm_%d%d, %d SMs, %.1f GiB (%.1f free)\n", info.name, info.cc_major,
           info.cc_minor, info.sm_count, info.total_mem_bytes / 1073741824.0,
           info.free_mem_bytes / 1073741824.0);
    ASSERT(info.device_count >= 1 && info.sm_count > 0);
    double gbps = 0;
    ASSERT_OK(pd_cuda_d2d_bandwidth(0, (size_t)1 << 30, 10, &gbps));
    printf("    device-to-device copy: %.0f GB/s (read+write, 1 GiB)\n", gbps);
    ASSERT(gbps > 50.0); /* any datacenter GPU copies far faster; a tiny figure means a bug */
    ASSERT_ERR(pd_cuda_d2d_bandwidth(0, 16, 1, &gbps), PD_EINVAL, "bad size");
}
