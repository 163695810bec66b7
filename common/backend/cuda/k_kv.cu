// KV-cache write kernel and launcher: scatters this step's k and v rows into the paged pool.
//
// Design: the pool (bf16, or f32 in the f32 mode) is vLLM's layout (n_blocks, block_size,
// n_kv_heads, head_dim) per layer, so a slot s = block * block_size + offset is simply row s
// of a (n_slots, kvh * D) matrix; one thread per element copies k and v together. Slots are
// validated on the host before launch.
#include "backend/cuda/cuda_common.cuh"

template <typename T>
__global__ void kv_write_kernel(const T *k, const T *v, size_t n, size_t row_elems,
                                const int64_t *slots, T *kc, T *vc)
{
    size_t total = n * row_elems;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / row_elems, c = i % row_elems;
        size_t dst = (size_t)slots[r] * row_elems + c;
        kc[dst] = k[i];
        vc[dst] = v[i];
    }
}

int cuda_kv_write(cudaStream_t s, int act, const void *k, const void *v, size_t n, size_t kvh,
                  size_t D, const int64_t *slots, void *kc, void *vc)
{
    size_t total = n * kvh * D;
    if (total == 0) return PD_OK;
    size_t blocks = (total + 255) / 256;
    if (blocks > 65535) blocks = 65535;
    ACT_DISPATCH(act, T,
                 kv_write_kernel<<<(unsigned)blocks, 256, 0, s>>>(
                     (const T *)k, (const T *)v, n, kvh * D, slots, (T *)kc, (T *)vc));
    CUDA_LAUNCH_CHECK("kv_write_kernel");
}
