// Matrix-vector products for decode rows: y (n, out) = x (n, in) . W^T (+ bias), n <= 8, and its
// launcher.
//
// Design: decode is bound by reading the weights once per step, and cuBLAS's GEMM tiles waste
// most of their work (and grid) when n is 1..8, so small n takes this kernel: warps stream the
// weight rows with 16-byte loads, apply them to all n input rows (each weight element read once
// per step) and reduce. A decode matrix is a few MiB, so the time is mostly memory latency and
// the kernel keeps many bytes in flight: a lane issues GEMV_UNROLL (8) raw 16-byte loads before
// using any, so a warp covers a segment of 256 chunks (2048 elements, 4 KiB of bf16) per round
// trip; rows longer than one segment are split over S = ceil(segments) warps (at most
// GEMV_MAX_SPLIT, each then taking consecutive segments) whose partial sums meet in shared
// memory; blocks are small (4 warps, or the S warps of one row) so that matrices of a few
// hundred rows still spread over most SMs.
// The reduction order depends only on `in`: a lane sums its chunks in increasing order, a fixed
// shuffle tree reduces the warp, and the S partials are added in split order; S and the
// segment bounds are functions of `in` alone. So a row's result is the same whatever n and the
// other rows are; the bias is added in f32 before the single rounding of y.
// One launch may cover up to CUDA_GEMV_MAX_MATS matrices applied to the same x (q/k/v, gate/up:
// vLLM fuses them by concatenating the weights; here the grid is): blocks are assigned to the
// matrices in order, and each row is computed exactly as in a launch of its matrix alone. The
// gate/up pair can also end in the SwiGLU itself (cuda_gemv_swiglu): a block then holds the
// same rows of both matrices and writes silu(gate) * up, not gate and up. The q/k/v triple can
// end in the rotary embedding and the KV-cache write (cuda_gemv_qkv_rope): a block of q or k then
// holds both rows of its rotary pairs (dims i and i + D/2 of a head), rotates them and writes q
// and the pool's k; v's rows go to the pool.
#include <stdint.h>
#include <string.h>

#include "backend/cuda/cuda_common.cuh"

#define GEMV_WARPS     4                  // warps of a block when a row is one segment
#define GEMV_UNROLL    8                  // 16-byte loads in flight per lane
#define GEMV_SEG       (32 * GEMV_UNROLL) // chunks of 8 elements one warp covers per pass
#define GEMV_MAX_SPLIT 8                  // most warps sharing one row
#define GEMV_MAX_WARPS (GEMV_MAX_SPLIT > GEMV_WARPS ? GEMV_MAX_SPLIT : GEMV_WARPS)

// 8 consecutive elements of a row in their storage type (16 bytes, or 32 for f32), loaded with
// read-only 16-byte loads and turned into f32 only when used.
template <typename T> struct gemv_chunk;
template <> struct gemv_chunk<bf16> {
    uint4 u;
    __device__ __forceinline__ void load(const bf16 *p)
    {
        u = __ldg((const uint4 *)p);
    }
    __device__ __forceinline__ void get(float f[8]) const
    {
        const __nv_bfloat162 *h = (const __nv_bfloat162 *)&u;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float2 v = __bfloat1622float2(h[i]);
            f[2 * i] = v.x;
            f[2 * i + 1] = v.y;
        }
    }
};
template <> struct gemv_chunk<__half> {
    uint4 u;
    __device__ __forceinline__ void load(const __half *p)
    {
        u = __ldg((const uint4 *)p);
    }
    __device__ __forceinline__ void get(float f[8]) const
    {
        const __half2 *h = (const __half2 *)&u;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float2 v = __half22float2(h[i]);
            f[2 * i] = v.x;
            f[2 * i + 1] = v.y;
        }
    }
};
template <> struct gemv_chunk<float> {
    float4 a, b;
    __device__ __forceinline__ void load(const float *p)
    {
        a = __ldg((const float4 *)p);
        b = __ldg((const float4 *)p + 1);
    }
    __device__ __forceinline__ void get(float f[8]) const
    {
        f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w;
        f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
    }
};

// One pass of a lane: the chunks c0 + u * 32 (u < GEMV_UNROLL) of row wr below c_end, all
// loads issued before any is used.
template <typename TW>
__device__ __forceinline__ void gemv_load_pass(gemv_chunk<TW> w[GEMV_UNROLL], const TW *wr,
                                               size_t c0, size_t c_end)
{
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; u++) {
        size_t c = c0 + (size_t)u * 32;
        if (c < c_end) w[u].load(wr + c * 8);
    }
}

// The matrices of one launch (q/k/v or gate/up: one x, the same `in`): block b works on the
// last matrix i with blk0[i] <= b, on its rows (b - blk0[i]) * R onwards (GEMV_ROPE: see there).
template <typename TW, typename TX> struct gemv_mats {
    const TW *W[CUDA_GEMV_MAX_MATS];
    const float *bias[CUDA_GEMV_MAX_MATS];
    TX *y[CUDA_GEMV_MAX_MATS];
    unsigned out[CUDA_GEMV_MAX_MATS];
    unsigned blk0[CUDA_GEMV_MAX_MATS];
    int n;
    // GEMV_ROPE only: the step's rotary tables (n, half), slots (n), the layer's pools
    // (n_slots, kv_row), the head size
    const float *cos_t, *sin_t;
    const int64_t *slots;
    TX *kc, *vc;
    unsigned head_dim, kv_row;
};

// What a launch writes: y = the products (GEMV_PLAIN); silu(gate) * up (GEMV_SWIGLU); rotated q,
// and rotated k and v into the KV pool (GEMV_ROPE).
enum { GEMV_PLAIN, GEMV_SWIGLU, GEMV_ROPE };

// The value an activation of type T stores for v (what a store and a load round it to).
template <typename T> __device__ __forceinline__ float act_round(float v)
{
    T t;
    stf(&t, 0, v);
    return ldf(&t, 0);
}

// Block: R rows x S warps per row (blockDim.x = 32 * S * R); warp (r, sp) covers chunks
// [sp * per, min((sp + 1) * per, in / 8)) of row (blockIdx.x - blk0) * R + r of its matrix,
// per = a multiple of GEMV_SEG (a function of in only).
// GEMV_SWIGLU: M holds gate (0) and up (1) of the same shape, and the output is
// y[0] = silu(gate . x) * (up . x). The block's R row slots (R even) are R / 2 gate rows and the
// same R / 2 up rows; each dot product is computed and rounded exactly as in a plain launch, so
// the result equals two GEMV launches and a swiglu launch bit for bit.
// GEMV_ROPE: M holds q (0), k (1) and v (2). A block of q or k holds P = R / 2 rotary pairs of
// one head: slots s < P are dims c * P + s of the head, slots P + s the dims half further; each
// row is computed and rounded as in a plain launch, then the pair goes through rope_pair as in
// the rotary kernels: the result equals a GEMV launch and a rope_kv_write launch bit for bit.
template <typename TW, typename TX, int N, int MODE>
__global__ void __launch_bounds__(GEMV_MAX_WARPS * 32)
    gemv_kernel(const TX *x, gemv_mats<TW, TX> M, size_t in, int S, size_t per)
{
    constexpr bool SWI = MODE == GEMV_SWIGLU, ROPE = MODE == GEMV_ROPE;
    __shared__ float part[GEMV_MAX_WARPS][N]; // per warp: its partial for each input row
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int R = (int)(blockDim.x >> 5) / S;
    const int sp = warp % S, slot = warp / S;
    // this block's matrix and row (constant indices only, so the parameters stay in the
    // constant bank)
    const TW *W = M.W[0];
    const float *bias = M.bias[0];
    TX *y = M.y[0];
    size_t out = M.out[0];
    size_t j;
    int mat = 0;
    if (SWI) {
        const bool up = slot >= R / 2;
        if (up) W = M.W[1];
        j = (size_t)blockIdx.x * (R / 2) + (up ? slot - R / 2 : slot);
    } else {
        unsigned b0 = 0;
#pragma unroll
        for (int i = 1; i < CUDA_GEMV_MAX_MATS; i++)
            if (i < M.n && blockIdx.x >= M.blk0[i]) {
                W = M.W[i];
                bias = M.bias[i];
                y = M.y[i];
                out = M.out[i];
                b0 = M.blk0[i];
                mat = i;
            }
        j = (size_t)(blockIdx.x - b0) * R + slot;
        if (ROPE && mat < 2) { // the pair group c of head h: dims c * P + s and half further
            const unsigned P = (unsigned)R / 2, half = M.head_dim / 2, groups = half / P;
            const unsigned bb = blockIdx.x - b0, h = bb / groups, c = bb % groups;
            j = (size_t)h * M.head_dim + c * P + (slot < (int)P ? slot : half + slot - P);
        }
    }
    const bool active = j < out;
    float acc[N];
#pragma unroll
    for (int r = 0; r < N; r++) acc[r] = 0.0f;
    const size_t chunks = in / 8; // 8-element chunks of the row
    const size_t c_end = min(chunks, (size_t)(sp + 1) * per);
    const TW *wr = W + (active ? j : 0) * in;
    // The first pass's weights are loaded before griddep_wait: no kernel of a step writes
    // weights, so under programmatic dependent launch this block streams them while the
    // previous kernel (attention, a norm) is still running. x is read only after the wait.
    size_t c0 = (size_t)sp * per + lane;
    gemv_chunk<TW> w[GEMV_UNROLL];
    if (active) gemv_load_pass(w, wr, c0, c_end);
    GRIDDEP_ENTRY();
    for (; active && c0 < c_end;) {
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            size_t c = c0 + (size_t)u * 32;
            if (c >= c_end) break;
            float wf[8];
            w[u].get(wf);
#pragma unroll
            for (int r = 0; r < N; r++) {
                gemv_chunk<TX> xc;
                xc.load(x + (size_t)r * in + c * 8);
                float xv[8];
                xc.get(xv);
                float s = 0.0f;
#pragma unroll
                for (int e = 0; e < 8; e++) s += wf[e] * xv[e];
                acc[r] += s;
            }
        }
        c0 += GEMV_SEG;
        if (c0 < c_end) gemv_load_pass(w, wr, c0, c_end);
    }
#pragma unroll
    for (int r = 0; r < N; r++)
        for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
    if (MODE == GEMV_PLAIN && S == 1) { // grid-uniform
        if (active && lane == 0)
#pragma unroll
            for (int r = 0; r < N; r++)
                stf(y, (size_t)r * out + j, bias ? acc[r] + bias[j] : acc[r]);
        return;
    }
    if (S > 1) { // grid-uniform
        if (lane == 0)
#pragma unroll
            for (int r = 0; r < N; r++) part[warp][r] = acc[r];
        __syncthreads();
        if (sp == 0 && lane == 0)
#pragma unroll
            for (int r = 0; r < N; r++) {
                float v = part[warp][r];
                for (int q = 1; q < S; q++) v += part[warp + q][r];
                acc[r] = v;
            }
    }
    if (MODE == GEMV_PLAIN) {
        if (!active || sp != 0 || lane != 0) return;
#pragma unroll
        for (int r = 0; r < N; r++) stf(y, (size_t)r * out + j, bias ? acc[r] + bias[j] : acc[r]);
        return;
    }
    // SwiGLU, rope: each slot's leader publishes its row's value as stored (rounded), then the
    // gate slots combine with the up slot of the same row / the first slot of each rotary pair
    // with the second
    __shared__ float res[GEMV_MAX_WARPS][N];
    if (sp == 0 && lane == 0)
#pragma unroll
        for (int r = 0; r < N; r++)
            res[slot][r] = act_round<TX>(active && bias ? acc[r] + bias[j] : acc[r]);
    __syncthreads();
    if (!active || sp != 0 || lane != 0) return;
    if (ROPE && mat == 2) { // v: into the pool as it is
#pragma unroll
        for (int r = 0; r < N; r++) stf(M.vc, (size_t)M.slots[r] * M.kv_row + j, res[slot][r]);
        return;
    }
    if (slot >= R / 2) return;
    if (SWI) {
#pragma unroll
        for (int r = 0; r < N; r++) {
            float g = res[slot][r], u = res[slot + R / 2][r];
            stf(y, (size_t)r * out + j, (g / (1.0f + expf(-g))) * u);
        }
        return;
    }
    const unsigned half = M.head_dim / 2, pair = (unsigned)(j % M.head_dim);
#pragma unroll
    for (int r = 0; r < N; r++) {
        float o1, o2;
        rope_pair(res[slot][r], res[slot + R / 2][r], M.cos_t[(size_t)r * half + pair],
                  M.sin_t[(size_t)r * half + pair], &o1, &o2);
        if (mat == 0) {
            stf(y, (size_t)r * out + j, o1);
            stf(y, (size_t)r * out + j + half, o2);
        } else {
            stf(M.kc, (size_t)M.slots[r] * M.kv_row + j, o1);
            stf(M.kc, (size_t)M.slots[r] * M.kv_row + j + half, o2);
        }
    }
}

// Warps per row (S), chunks per warp (per) and rows per block (R) for rows of `in` elements:
// functions of `in` alone (see the file comment).
static void gemv_shape(size_t in, int *S, size_t *per, int *R)
{
    const size_t segs = (in / 8 + GEMV_SEG - 1) / GEMV_SEG;
    *S = segs <= 1 ? 1 : segs < GEMV_MAX_SPLIT ? (int)segs : GEMV_MAX_SPLIT;
    *per = (segs + *S - 1) / *S * GEMV_SEG;
    *R = *S >= GEMV_WARPS ? 1 : GEMV_WARPS / *S;
}

// GEMV_ROPE's extra arguments (host side).
typedef struct {
    const float *cos_t, *sin_t;
    const int64_t *slots;
    void *kc, *vc;
    size_t head_dim, kv_row;
} gemv_rope_args;

template <typename TW, typename TX, int MODE>
static void gemv_launch(cudaStream_t s, const TX *x, size_t n, int nm, const void *const *W,
                        const size_t *out, size_t in, const float *const *bias, void *const *y,
                        const gemv_rope_args *ra)
{
    int S, R;
    size_t per;
    gemv_shape(in, &S, &per, &R);
    gemv_mats<TW, TX> M;
    memset(&M, 0, sizeof M);
    M.n = nm;
    size_t grid = 0;
    for (int i = 0; i < nm; i++) {
        M.W[i] = (const TW *)W[i];
        M.bias[i] = bias[i];
        M.y[i] = (TX *)y[i];
        M.out[i] = (unsigned)out[i];
        M.blk0[i] = (unsigned)grid;
        grid += MODE == GEMV_SWIGLU ? 0 : (out[i] + R - 1) / R; // GEMV_ROPE: q, k rows % R == 0
    }
    if (MODE == GEMV_SWIGLU) grid = (out[0] + R / 2 - 1) / (R / 2); // R / 2 gate, R / 2 up rows
    if (ra) {
        M.cos_t = ra->cos_t;
        M.sin_t = ra->sin_t;
        M.slots = ra->slots;
        M.kc = (TX *)ra->kc;
        M.vc = (TX *)ra->vc;
        M.head_dim = (unsigned)ra->head_dim;
        M.kv_row = (unsigned)ra->kv_row;
    }
    const unsigned g = (unsigned)grid, th = (unsigned)(32 * S * R);
    switch (n) {
    case 1: cuda_launch(gemv_kernel<TW, TX, 1, MODE>, g, th, 0, s, x, M, in, S, per); break;
    case 2: cuda_launch(gemv_kernel<TW, TX, 2, MODE>, g, th, 0, s, x, M, in, S, per); break;
    case 3: cuda_launch(gemv_kernel<TW, TX, 3, MODE>, g, th, 0, s, x, M, in, S, per); break;
    case 4: cuda_launch(gemv_kernel<TW, TX, 4, MODE>, g, th, 0, s, x, M, in, S, per); break;
    case 5: cuda_launch(gemv_kernel<TW, TX, 5, MODE>, g, th, 0, s, x, M, in, S, per); break;
    case 6: cuda_launch(gemv_kernel<TW, TX, 6, MODE>, g, th, 0, s, x, M, in, S, per); break;
    case 7: cuda_launch(gemv_kernel<TW, TX, 7, MODE>, g, th, 0, s, x, M, in, S, per); break;
    default: cuda_launch(gemv_kernel<TW, TX, 8, MODE>, g, th, 0, s, x, M, in, S, per); break;
    }
}

// Runs gemv_launch<.., MODE> for the activation / weight type pair; PD_EUNSUPPORTED for others.
template <int MODE>
static int gemv_dispatch(cudaStream_t s, int act, const void *x, size_t n, int nm,
                         const void *const *W, int wdtype, const size_t *out, size_t in,
                         const float *const *bias, void *const *y, const gemv_rope_args *ra = NULL)
{
    if (act == ACT_BF16 && wdtype == ACT_BF16)
        gemv_launch<bf16, bf16, MODE>(s, (const bf16 *)x, n, nm, W, out, in, bias, y, ra);
    else if (act == ACT_BF16 && wdtype == ACT_F16)
        gemv_launch<__half, bf16, MODE>(s, (const bf16 *)x, n, nm, W, out, in, bias, y, ra);
    else if (act == ACT_F32 && wdtype == ACT_F32)
        gemv_launch<float, float, MODE>(s, (const float *)x, n, nm, W, out, in, bias, y, ra);
    else
        return PD_EUNSUPPORTED;
    CUDA_LAUNCH_CHECK("gemv_kernel");
}

// What cuda_gemv_multi accepts (nm matrices W of out[i] rows): else PD_EUNSUPPORTED.
static bool gemv_fits(const void *x, size_t n, int nm, const void *const *W, const size_t *out,
                      size_t in)
{
    if (n < 1 || n > CUDA_GEMV_MAX_N || nm < 1 || nm > CUDA_GEMV_MAX_MATS || in % 8 ||
        (uintptr_t)x % 16)
        return false;
    size_t blocks = 0;
    for (int i = 0; i < nm; i++) {
        if ((uintptr_t)W[i] % 16 || out[i] > (size_t)0x7fffffff) return false;
        blocks += out[i];
    }
    return blocks <= (size_t)0x7fffffff;
}

int cuda_gemv_multi(cudaStream_t s, int act, const void *x, size_t n, int nm, const void *const *W,
                    int wdtype, const size_t *out, size_t in, const float *const *bias,
                    void *const *y)
{
    if (!gemv_fits(x, n, nm, W, out, in))
        return PD_EUNSUPPORTED; // the caller takes the GEMM path; no message needed
    return gemv_dispatch<GEMV_PLAIN>(s, act, x, n, nm, W, wdtype, out, in, bias, y);
}

int cuda_gemv_swiglu(cudaStream_t s, int act, const void *x, size_t n, const void *Wg,
                     const void *Wu, int wdtype, size_t out, size_t in, void *y)
{
    int S, R;
    size_t per;
    gemv_shape(in, &S, &per, &R);
    if (n < 1 || n > CUDA_GEMV_MAX_N || in % 8 || R % 2 ||
        ((uintptr_t)x | (uintptr_t)Wg | (uintptr_t)Wu) % 16 || out > (size_t)0x7fffffff)
        return PD_EUNSUPPORTED; // the caller takes the plain ops; no message needed
    const void *W[2] = {Wg, Wu};
    const size_t outs[2] = {out, out};
    const float *bias[2] = {NULL, NULL};
    void *ys[2] = {y, y};
    return gemv_dispatch<GEMV_SWIGLU>(s, act, x, n, 2, W, wdtype, outs, in, bias, ys);
}

int cuda_gemv_qkv_rope(cudaStream_t s, int act, const void *x, size_t n, const void *const *W,
                       int wdtype, size_t nq, size_t nkv, size_t D, size_t in,
                       const float *const *bias, void *q, const float *cos_t, const float *sin_t,
                       const int64_t *slots, void *kc, void *vc)
{
    int S, R;
    size_t per;
    gemv_shape(in, &S, &per, &R);
    const size_t out[3] = {nq * D, nkv * D, nkv * D};
    if (!gemv_fits(x, n, 3, W, out, in) || R % 2 || D % 2 || D == 0 || (D / 2) % (R / 2) ||
        out[0] == 0 || out[1] == 0)
        return PD_EUNSUPPORTED; // the caller takes matmul_multi and rope_kv_write
    gemv_rope_args ra = {cos_t, sin_t, slots, kc, vc, D, nkv * D};
    void *y[3] = {q, NULL, NULL};
    return gemv_dispatch<GEMV_ROPE>(s, act, x, n, 3, W, wdtype, out, in, bias, y, &ra);
}

int cuda_gemv(cudaStream_t s, int act, const void *x, size_t n, const void *W, int wdtype,
              size_t out, size_t in, const float *bias, void *y)
{
    return cuda_gemv_multi(s, act, x, n, 1, &W, wdtype, &out, in, &bias, &y);
}
