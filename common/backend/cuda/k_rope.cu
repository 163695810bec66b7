// Rotary position embedding kernel and launcher (rotate_half convention: pair i is dims i and
// i + head_dim/2), in place on (n, n_heads, head_dim) activation rows.
//
// Design: the forward pass computes the cos/sin tables once per step on the host (every
// scaling type, attention scaling folded in), so this kernel is a pure element-wise rotation:
// one thread per (row, head, group of pairs), f32 math, each pair read and written by the same
// thread; a group is 16 bytes of each half of the head (8 pairs in bf16) when the rows and
// tables allow 16-byte accesses, else one pair.
// rope_kv_write_kernel does the rotation of q and k and the KV-cache write of k and v of one
// layer in one launch (vLLM's rotary_embedding + reshape_and_cache): the rotated k goes
// straight to its slot, so a decode step launches one kernel here instead of three.
#include "backend/cuda/cuda_common.cuh"

// V consecutive elements of T as one access (V = 16 / sizeof(T): one 16-byte load or store; V = 1:
// a scalar).
template <typename T, int V> struct __align__(sizeof(T) * V) rope_vec
{
    T e[V];
};

// cos / sin of pairs [p, p + V) of a table row (16-byte loads when V is a multiple of 4).
template <int V> __device__ __forceinline__ void rope_cs(const float *t, float out[V])
{
    if constexpr (V % 4 == 0) {
#pragma unroll
        for (int k = 0; k < V / 4; k++) {
            float4 f = __ldg((const float4 *)t + k);
            out[4 * k] = f.x, out[4 * k + 1] = f.y, out[4 * k + 2] = f.z, out[4 * k + 3] = f.w;
        }
    } else {
#pragma unroll
        for (int e = 0; e < V; e++) out[e] = t[e];
    }
}

// Pairs [p, p + V) of one head: src's dims p.. and p + half.. rotated into dst's (src == dst: in
// place). Each element through rope_pair, so V does not change a value.
template <typename T, int V>
__device__ __forceinline__ void rope_pairs(const T *src, T *dst, size_t p, size_t half,
                                           const float *c_row, const float *s_row)
{
    typedef rope_vec<T, V> vec;
    vec a = *(const vec *)(src + p), b = *(const vec *)(src + p + half), oa, ob;
    float c[V], sn[V];
    rope_cs<V>(c_row + p, c);
    rope_cs<V>(s_row + p, sn);
#pragma unroll
    for (int e = 0; e < V; e++) {
        float o1, o2;
        rope_pair(ldf(a.e, e), ldf(b.e, e), c[e], sn[e], &o1, &o2);
        stf(oa.e, e, o1);
        stf(ob.e, e, o2);
    }
    *(vec *)(dst + p) = oa;
    *(vec *)(dst + p + half) = ob;
}

// I: the index type, 32-bit where every element index of the launch fits (64-bit division is
// many instructions, and this kernel does three per thread); the values are the same either way.
// V: pairs per thread (consecutive; 16 / sizeof(T) when the launcher finds every row and table
// aligned for 16-byte accesses, else 1): a prefill rotates megabytes, and 2-byte accesses leave
// most of the bandwidth unused.
template <typename T, typename I, int V>
__global__ void rope_kernel(T *x, I n, I n_heads, I head_dim, const float *cos_t,
                            const float *sin_t, I rope_half)
{
    GRIDDEP_ENTRY();
    const I half = head_dim / 2, groups = half / V;
    const I total = n * n_heads * groups;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (I)gridDim.x * blockDim.x) {
        I p = i % groups * V;
        I rh = i / groups; // row * n_heads + head
        I r = rh / n_heads;
        T *xh = x + (size_t)rh * head_dim;
        rope_pairs<T, V>(xh, xh, p, half, cos_t + (size_t)r * rope_half,
                         sin_t + (size_t)r * rope_half);
    }
}

// One thread per (row, head, V pairs) over the heads q (nq), then k (nkv), then v (nkv); I and V
// as above.
template <typename T, typename I, int V>
__global__ void rope_kv_write_kernel(T *q, const T *k, const T *v, I n, I nq, I nkv, I head_dim,
                                     const float *cos_t, const float *sin_t, I rope_half,
                                     const int64_t *slots, T *kc, T *vc)
{
    GRIDDEP_ENTRY();
    typedef rope_vec<T, V> vec;
    const I half = head_dim / 2, groups = half / V, heads = nq + 2 * nkv;
    const I total = n * heads * groups;
    for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (I)gridDim.x * blockDim.x) {
        I p = i % groups * V;
        I rh = i / groups; // row * heads + head
        I r = rh / heads, h = rh % heads;
        if (h >= nq + nkv) { // v: a plain copy into the slot
            I vh = h - nq - nkv;
            const T *src = v + ((size_t)r * nkv + vh) * head_dim;
            T *dst = vc + ((size_t)slots[r] * nkv + vh) * head_dim;
            *(vec *)(dst + p) = *(const vec *)(src + p);
            *(vec *)(dst + p + half) = *(const vec *)(src + p + half);
            continue;
        }
        const T *src;
        T *dst;
        if (h < nq) { // q: in place
            dst = q + ((size_t)r * nq + h) * head_dim;
            src = dst;
        } else { // k: rotated into the slot
            src = k + ((size_t)r * nkv + (h - nq)) * head_dim;
            dst = kc + ((size_t)slots[r] * nkv + (h - nq)) * head_dim;
        }
        rope_pairs<T, V>(src, dst, p, half, cos_t + (size_t)r * rope_half,
                         sin_t + (size_t)r * rope_half);
    }
}

// Whether the 32-bit index type holds every index of a launch over `total` pairs (elements go
// up to twice that, plus a grid stride).
static bool idx32(size_t total)
{
    return total <= 0x3fffffffu;
}

// Pairs per thread for rows of head_dim elements of T and tables of rope_half columns: 16 bytes
// of T per access where each pointer and row offset allows it, else 1.
template <typename T>
static int rope_width(size_t head_dim, size_t rope_half, const void *const *ptrs, int n_ptrs)
{
    const size_t V = 16 / sizeof(T);
    uintptr_t a = 0;
    for (int i = 0; i < n_ptrs; i++) a |= (uintptr_t)ptrs[i];
    return (head_dim / 2) % V == 0 && rope_half % 4 == 0 && a % 16 == 0 ? (int)V : 1;
}

// kernel<T, I, V> over `total` pairs, width pairs per thread (rope_width): I is 32-bit when
// idx32(total); V is 16 / sizeof(T) for width > 1.
#define ROPE_LAUNCH(kernel, T, width, total, s, ...)                                               \
    do {                                                                                           \
        size_t blocks_ = ((total) / (width) + 255) / 256;                                          \
        if (blocks_ > 65535) blocks_ = 65535;                                                      \
        constexpr int V_ = 16 / (int)sizeof(T);                                                    \
        if (idx32(total) && (width) > 1)                                                           \
            cuda_launch(kernel<T, unsigned, V_>, (unsigned)blocks_, 256, 0, s, __VA_ARGS__);       \
        else if (idx32(total))                                                                     \
            cuda_launch(kernel<T, unsigned, 1>, (unsigned)blocks_, 256, 0, s, __VA_ARGS__);        \
        else if ((width) > 1)                                                                      \
            cuda_launch(kernel<T, size_t, V_>, (unsigned)blocks_, 256, 0, s, __VA_ARGS__);         \
        else                                                                                       \
            cuda_launch(kernel<T, size_t, 1>, (unsigned)blocks_, 256, 0, s, __VA_ARGS__);          \
    } while (0)

int cuda_rope(cudaStream_t s, int act, void *x, size_t n, size_t n_heads, size_t head_dim,
              const float *cos_t, const float *sin_t, size_t rope_half)
{
    size_t total = n * n_heads * (head_dim / 2);
    if (total == 0) return PD_OK;
    const void *ptrs[] = {x, cos_t, sin_t};
    ACT_DISPATCH(act, T, {
        int width = rope_width<T>(head_dim, rope_half, ptrs, 3);
        ROPE_LAUNCH(rope_kernel, T, width, total, s, (T *)x, n, n_heads, head_dim, cos_t, sin_t,
                    rope_half);
    });
    CUDA_LAUNCH_CHECK("rope_kernel");
}

int cuda_rope_kv_write(cudaStream_t s, int act, void *q, const void *k, const void *v, size_t n,
                       size_t nq, size_t nkv, size_t head_dim, const float *cos_t,
                       const float *sin_t, size_t rope_half, const int64_t *slots, void *kc,
                       void *vc)
{
    size_t total = n * (nq + 2 * nkv) * (head_dim / 2);
    if (total == 0) return PD_OK;
    const void *ptrs[] = {q, k, v, kc, vc, cos_t, sin_t};
    ACT_DISPATCH(act, T, {
        int width = rope_width<T>(head_dim, rope_half, ptrs, 7);
        ROPE_LAUNCH(rope_kv_write_kernel, T, width, total, s, (T *)q, (const T *)k, (const T *)v, n,
                    nq, nkv, head_dim, cos_t, sin_t, rope_half, slots, (T *)kc, (T *)vc);
    });
    CUDA_LAUNCH_CHECK("rope_kv_write_kernel");
}
