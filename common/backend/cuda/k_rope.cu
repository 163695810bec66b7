// Rotary position embedding kernel and launcher (rotate_half convention: pair i is dims i and
// i + head_dim/2), in place on (n, n_heads, head_dim) activation rows.
//
// Design: the forward pass computes the cos/sin tables once per step on the host (every
// scaling type, attention scaling folded in), so this kernel is a pure element-wise rotation:
// one thread per (row, head, pair), f32 math, each pair read and written by the same thread.
// rope_kv_write_kernel does the rotation of q and k and the KV-cache write of k and v of one
// layer in one launch (vLLM's rotary_embedding + reshape_and_cache): the rotated k goes
// straight to its slot, so a decode step launches one kernel here instead of three.
#include "backend/cuda/cuda_common.cuh"

// The rotated pair (x1, x2) -> (o1, o2); one definition, and explicit roundings (no FMA
// contraction left to the compiler), so both kernels give the same bits.
__device__ __forceinline__ void rope_pair(float x1, float x2, float c, float sn, float *o1,
                                          float *o2)
{
    *o1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, sn));
    *o2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, sn));
}

// I: the index type, 32-bit where every element index of the launch fits (64-bit division is
// many instructions, and this kernel does three per thread); the values are the same either way.
template <typename T, typename I>
__global__ void rope_kernel(T *x, I n, I n_heads, I head_dim, const float *cos_t,
                            const float *sin_t, I rope_half)
{
    GRIDDEP_ENTRY();
    const I half = head_dim / 2;
    const I total = n * n_heads * half;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (I)gridDim.x * blockDim.x) {
        I p = i % half;
        I rh = i / half; // row * n_heads + head
        I r = rh / n_heads;
        T *xh = x + (size_t)rh * head_dim;
        float c = cos_t[(size_t)r * rope_half + p], sn = sin_t[(size_t)r * rope_half + p];
        float o1, o2;
        rope_pair(ldf(xh, p), ldf(xh, p + half), c, sn, &o1, &o2);
        stf(xh, p, o1);
        stf(xh, p + half, o2);
    }
}

// One thread per (row, head, pair) over the heads q (nq), then k (nkv), then v (nkv); I as above.
template <typename T, typename I>
__global__ void rope_kv_write_kernel(T *q, const T *k, const T *v, I n, I nq, I nkv, I head_dim,
                                     const float *cos_t, const float *sin_t, I rope_half,
                                     const int64_t *slots, T *kc, T *vc)
{
    GRIDDEP_ENTRY();
    const I half = head_dim / 2, heads = nq + 2 * nkv;
    const I total = n * heads * half;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (I)gridDim.x * blockDim.x) {
        I p = i % half;
        I rh = i / half; // row * heads + head
        I r = rh / heads, h = rh % heads;
        if (h >= nq + nkv) { // v: a plain copy into the slot
            I vh = h - nq - nkv;
            const T *src = v + ((size_t)r * nkv + vh) * head_dim;
            T *dst = vc + ((size_t)slots[r] * nkv + vh) * head_dim;
            dst[p] = src[p];
            dst[p + half] = src[p + half];
            continue;
        }
        float c = cos_t[(size_t)r * rope_half + p], sn = sin_t[(size_t)r * rope_half + p];
        const T *src;
        T *dst;
        if (h < nq) { // q: in place
            dst = q + ((size_t)r * nq + h) * head_dim;
            src = dst;
        } else { // k: rotated into the slot
            src = k + ((size_t)r * nkv + (h - nq)) * head_dim;
            dst = kc + ((size_t)slots[r] * nkv + (h - nq)) * head_dim;
        }
        float o1, o2;
        rope_pair(ldf(src, p), ldf(src, p + half), c, sn, &o1, &o2);
        stf(dst, p, o1);
        stf(dst, p + half, o2);
    }
}

// Whether the 32-bit index type holds every index of a launch over `total` pairs (elements go
// up to twice that, plus a grid stride).
static bool idx32(size_t total)
{
    return total <= 0x3fffffffu;
}

int cuda_rope(cudaStream_t s, int act, void *x, size_t n, size_t n_heads, size_t head_dim,
              const float *cos_t, const float *sin_t, size_t rope_half)
{
    size_t total = n * n_heads * (head_dim / 2);
    if (total == 0) return PD_OK;
    size_t blocks = (total + 255) / 256;
    if (blocks > 65535) blocks = 65535;
    if (idx32(total))
        ACT_DISPATCH(act, T,
                     cuda_launch(rope_kernel<T, unsigned>, (unsigned)blocks, 256, 0, s, (T *)x, n,
                                 n_heads, head_dim, cos_t, sin_t, rope_half));
    else
        ACT_DISPATCH(act, T,
                     cuda_launch(rope_kernel<T, size_t>, (unsigned)blocks, 256, 0, s, (T *)x, n,
                                 n_heads, head_dim, cos_t, sin_t, rope_half));
    CUDA_LAUNCH_CHECK("rope_kernel");
}

int cuda_rope_kv_write(cudaStream_t s, int act, void *q, const void *k, const void *v, size_t n,
                       size_t nq, size_t nkv, size_t head_dim, const float *cos_t,
                       const float *sin_t, size_t rope_half, const int64_t *slots, void *kc,
                       void *vc)
{
    size_t total = n * (nq + 2 * nkv) * (head_dim / 2);
    if (total == 0) return PD_OK;
    size_t blocks = (total + 255) / 256;
    if (blocks > 65535) blocks = 65535;
    if (idx32(total))
        ACT_DISPATCH(act, T,
                     cuda_launch(rope_kv_write_kernel<T, unsigned>, (unsigned)blocks, 256, 0, s,
                                 (T *)q, (const T *)k, (const T *)v, n, nq, nkv, head_dim, cos_t,
                                 sin_t, rope_half, slots, (T *)kc, (T *)vc));
    else
        ACT_DISPATCH(act, T,
                     cuda_launch(rope_kv_write_kernel<T, size_t>, (unsigned)blocks, 256, 0, s,
                                 (T *)q, (const T *)k, (const T *)v, n, nq, nkv, head_dim, cos_t,
                                 sin_t, rope_half, slots, (T *)kc, (T *)vc));
    CUDA_LAUNCH_CHECK("rope_kv_write_kernel");
}
