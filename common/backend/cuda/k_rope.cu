// Rotary position embedding kernel and launcher (rotate_half convention: pair i is dims i and
// i + head_dim/2), in place on (n, n_heads, head_dim) activation rows.
//
// Design: the forward pass computes the cos/sin tables once per step on the host (every
// scaling type, attention scaling folded in), so this kernel is a pure element-wise rotation:
// one thread per (row, head, pair), f32 math, each pair read and written by the same thread.
#include "backend/cuda/cuda_common.cuh"

template <typename T>
__global__ void rope_kernel(T *x, size_t n, size_t n_heads, size_t head_dim, const float *cos_t,
                            const float *sin_t, size_t rope_half)
{
    size_t half = head_dim / 2;
    size_t total = n * n_heads * half;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t p = i % half;
        size_t rh = i / half; // row * n_heads + head
        size_t r = rh / n_heads;
        T *xh = x + rh * head_dim;
        float c = cos_t[r * rope_half + p], sn = sin_t[r * rope_half + p];
        float x1 = ldf(xh, p), x2 = ldf(xh, p + half);
        stf(xh, p, x1 * c - x2 * sn);
        stf(xh, p + half, x2 * c + x1 * sn);
    }
}

int cuda_rope(cudaStream_t s, int act, void *x, size_t n, size_t n_heads, size_t head_dim,
              const float *cos_t, const float *sin_t, size_t rope_half)
{
    size_t total = n * n_heads * (head_dim / 2);
    if (total == 0) return PD_OK;
    size_t blocks = (total + 255) / 256;
    if (blocks > 65535) blocks = 65535;
    ACT_DISPATCH(act, T,
                 rope_kernel<<<(unsigned)blocks, 256, 0, s>>>((T *)x, n, n_heads, head_dim, cos_t,
                                                              sin_t, rope_half));
    CUDA_LAUNCH_CHECK("rope_kernel");
}
