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
// Either of those two can also take the norm before it (cuda_norm_in): x is then the residual
// stream, and every block normalizes its rows into shared memory after the wait (reading them,
// plus the sublayer output to add, from L2, in the vector RMSNorm kernel's order); block 0 writes
// the sum. A decode step then has no norm launch, each of which (launch, wait for the GEMV
// before it, a dependent wait for it) had cost about as long as a small GEMV.
// A launch has at most as many blocks as the device holds at once (gemv_grid); each takes row
// groups in turn and loads the next group's first pass before it reduces and stores the one
// it has, so the weight stream does not pause at block boundaries, and a NORM block normalizes
// once for all its groups.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_common.cuh"

#define GEMV_WARPS     4                  // warps of a block when a row is one segment
#define GEMV_UNROLL    8                  // 16-byte loads in flight per lane
#define GEMV_SEG       (32 * GEMV_UNROLL) // chunks of 8 elements one warp covers per pass
#define GEMV_MAX_SPLIT 8                  // most warps sharing one row
#define GEMV_MAX_WARPS (GEMV_MAX_SPLIT > GEMV_WARPS ? GEMV_MAX_SPLIT : GEMV_WARPS)
#define GEMV_NORM_SMEM (48 << 10) // most bytes of normed rows a NORM block holds

// 8 consecutive elements of a row in their storage type (16 bytes, or 32 for f32), loaded with
// read-only 16-byte loads and turned into f32 only when used.
template <typename T> struct gemv_chunk;
template <> struct gemv_chunk<bf16> {
    uint4 u;
    __device__ __forceinline__ void load(const bf16 *p)
    {
        u = __ldg((const uint4 *)p);
    }
    __device__ __forceinline__ void load_shared(const bf16 *p) // NORM's rows
    {
        u = *(const uint4 *)p;
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
    __device__ __forceinline__ void load_shared(const float *p)
    {
        a = *(const float4 *)p;
        b = *((const float4 *)p + 1);
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
// The norm a launch applies to x (NORM): add, x_out, w (in) f32, eps.
template <typename TX> struct gemv_norm {
    const TX *add;
    TX *x_out;
    const float *w;
    float eps;
};

// NORM, after the wait: xs (N, in), in shared memory, = the normed rows as rmsnorm_vec_kernel
// computes and rounds them: x (+ add, rounded; block 0 stores these sums into x_out), each row's
// sum of squares reduced in that kernel's order (its thread t's chunks t + k * threads, the same
// shuffle tree over each 32 of them, then one over the warp sums), then (v * rs) * w.
template <typename TX, int N>
__device__ void gemv_norm_rows(const TX *x, const gemv_norm<TX> &nm, size_t in, TX *xs)
{
    constexpr int EPC = norm_chunk<TX>::EPC;
    __shared__ float wsum[N][32];
    __shared__ float scale[N];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    int threads, nr; // the vector kernel's shape for these rows
    norm_vec_shape(in / EPC, &threads, &nr);
    const int nch = (int)(in / EPC), vwarps = threads / 32;
    norm_chunk<TX> *xc = (norm_chunk<TX> *)xs; // the sums, normed in place below
    for (int r = 0; r < N; r++) {
        const norm_chunk<TX> *xr = (const norm_chunk<TX> *)(x + (size_t)r * in);
        const norm_chunk<TX> *ar = (const norm_chunk<TX> *)(nm.add + (nm.add ? (size_t)r * in : 0));
        norm_chunk<TX> *xo = (norm_chunk<TX> *)(nm.x_out + (nm.x_out ? (size_t)r * in : 0));
        for (int vw = warp; vw < vwarps; vw += nw) {
            const int t = vw * 32 + lane;
            float ss = 0.0f;
            for (int k = 0; k < nr; k++) {
                const int c = t + k * threads;
                if (c >= nch) continue;
                norm_chunk<TX> v = xr[c];
                if (nm.add) {
                    norm_chunk<TX> a = ar[c];
#pragma unroll
                    for (int e = 0; e < EPC; e++) v.e[e] = (TX)((float)v.e[e] + (float)a.e[e]);
                    if (blockIdx.x == 0) xo[c] = v;
                }
                xc[r * nch + c] = v;
#pragma unroll
                for (int e = 0; e < EPC; e++) {
                    float f = (float)v.e[e];
                    ss += f * f;
                }
            }
            for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
            if (lane == 0) wsum[r][vw] = ss;
        }
    }
    __syncthreads();
    if (warp == 0)
        for (int r = 0; r < N; r++) {
            float v = lane < vwarps ? wsum[r][lane] : 0.0f;
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) scale[r] = rsqrtf(v / (float)in + nm.eps);
        }
    __syncthreads();
    const float4 *w4 = (const float4 *)nm.w;
    for (int i = (int)threadIdx.x; i < N * nch; i += (int)blockDim.x) {
        const int r = i / nch, c = i % nch;
        float4 wv[EPC / 4];
#pragma unroll
        for (int k = 0; k < EPC / 4; k++) wv[k] = __ldg(w4 + (size_t)c * (EPC / 4) + k);
        const float *wf = (const float *)wv;
        norm_chunk<TX> v = xc[i];
#pragma unroll
        for (int e = 0; e < EPC; e++) v.e[e] = (TX)(((float)v.e[e] * scale[r]) * wf[e]);
        xc[i] = v;
    }
    __syncthreads();
}

// What row slot `slot` of block b computes: its matrix's weights, bias and output, and row j
// (j >= out: nothing). GEMV_ROPE: see gemv_kernel.
template <typename TW, typename TX> struct gemv_row {
    const TW *W;
    const float *bias;
    TX *y;
    size_t out, j;
    int mat;
};

template <typename TW, typename TX, int MODE>
__device__ __forceinline__ gemv_row<TW, TX> gemv_row_of(const gemv_mats<TW, TX> &M, unsigned b,
                                                        int R, int slot)
{
    // constant indices only, so the parameters stay in the constant bank
    gemv_row<TW, TX> g = {M.W[0], M.bias[0], M.y[0], M.out[0], 0, 0};
    if (MODE == GEMV_SWIGLU) {
        const bool up = slot >= R / 2;
        if (up) g.W = M.W[1];
        g.j = (size_t)b * (R / 2) + (up ? slot - R / 2 : slot);
        return g;
    }
    unsigned b0 = 0;
#pragma unroll
    for (int i = 1; i < CUDA_GEMV_MAX_MATS; i++)
        if (i < M.n && b >= M.blk0[i]) {
            g.W = M.W[i];
            g.bias = M.bias[i];
            g.y = M.y[i];
            g.out = M.out[i];
            b0 = M.blk0[i];
            g.mat = i;
        }
    g.j = (size_t)(b - b0) * R + slot;
    if (MODE == GEMV_ROPE &&
        g.mat < 2) { // the pair group c of head h: dims c * P + s, half further
        const unsigned P = (unsigned)R / 2, half = M.head_dim / 2, groups = half / P;
        const unsigned bb = b - b0, h = bb / groups, c = bb % groups;
        g.j = (size_t)h * M.head_dim + c * P + (slot < (int)P ? slot : half + slot - P);
    }
    return g;
}

// The end of a row group: each warp's sums reduced, the S partials of a row added in split order,
// the result (with the bias) rounded and stored, or combined first (SwiGLU, rotary pairs).
template <typename TW, typename TX, int N, int MODE>
__device__ __forceinline__ void gemv_store(float acc[N], const gemv_row<TW, TX> &g,
                                           const gemv_mats<TW, TX> &M, int S, int R,
                                           float (*part)[N], float (*res)[N])
{
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, sp = warp % S, slot = warp / S;
    const bool active = g.j < g.out;
    const size_t j = g.j, out = g.out;
#pragma unroll
    for (int r = 0; r < N; r++)
        for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
    if (MODE == GEMV_PLAIN && S == 1) { // grid-uniform
        if (active && lane == 0)
#pragma unroll
            for (int r = 0; r < N; r++)
                stf(g.y, (size_t)r * out + j, g.bias ? acc[r] + g.bias[j] : acc[r]);
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
        for (int r = 0; r < N; r++)
            stf(g.y, (size_t)r * out + j, g.bias ? acc[r] + g.bias[j] : acc[r]);
        return;
    }
    // SwiGLU, rope: each slot's leader publishes its row's value as stored (rounded), then the
    // gate slots combine with the up slot of the same row / the first slot of each rotary pair
    // with the second
    if (sp == 0 && lane == 0)
#pragma unroll
        for (int r = 0; r < N; r++)
            res[slot][r] = act_round<TX>(active && g.bias ? acc[r] + g.bias[j] : acc[r]);
    __syncthreads();
    if (!active || sp != 0 || lane != 0) return;
    if (MODE == GEMV_ROPE && g.mat == 2) { // v: into the pool as it is
#pragma unroll
        for (int r = 0; r < N; r++) stf(M.vc, (size_t)M.slots[r] * M.kv_row + j, res[slot][r]);
        return;
    }
    if (slot >= R / 2) return;
    if (MODE == GEMV_SWIGLU) {
#pragma unroll
        for (int r = 0; r < N; r++) {
            float gv = res[slot][r], u = res[slot + R / 2][r];
            stf(g.y, (size_t)r * out + j, (gv / (1.0f + expf(-gv))) * u);
        }
        return;
    }
    const unsigned half = M.head_dim / 2, pair = (unsigned)(j % M.head_dim);
#pragma unroll
    for (int r = 0; r < N; r++) {
        float o1, o2;
        rope_pair(res[slot][r], res[slot + R / 2][r], M.cos_t[(size_t)r * half + pair],
                  M.sin_t[(size_t)r * half + pair], &o1, &o2);
        if (g.mat == 0) {
            stf(g.y, (size_t)r * out + j, o1);
            stf(g.y, (size_t)r * out + j + half, o2);
        } else {
            stf(M.kc, (size_t)M.slots[r] * M.kv_row + j, o1);
            stf(M.kc, (size_t)M.slots[r] * M.kv_row + j + half, o2);
        }
    }
}

// Block: R rows x S warps per row (blockDim.x = 32 * S * R); warp (r, sp) covers chunks
// [sp * per, min((sp + 1) * per, in / 8)) of row slot r of its row group, per = a multiple of
// GEMV_SEG (a function of in only). The launch has nblk row groups (block b of a one-block-per-
// group launch: rows (b - blk0) * R + r of its matrix); a grid of fewer blocks (as many as are
// resident at once) takes them in turn, b = blockIdx.x, + gridDim.x, ..., and loads the next
// group's first pass before it reduces and stores the current one.
// GEMV_SWIGLU: M holds gate (0) and up (1) of the same shape, and the output is
// y[0] = silu(gate . x) * (up . x). The block's R row slots (R even) are R / 2 gate rows and the
// same R / 2 up rows; each dot product is computed and rounded exactly as in a plain launch, so
// the result equals two GEMV launches and a swiglu launch bit for bit.
// GEMV_ROPE: M holds q (0), k (1) and v (2). A block of q or k holds P = R / 2 rotary pairs of
// one head: slots s < P are dims c * P + s of the head, slots P + s the dims half further; each
// row is computed and rounded as in a plain launch, then the pair goes through rope_pair as in
// the rotary kernels: the result equals a GEMV launch and a rope_kv_write launch bit for bit.
// NORM: x is normed first (gemv_norm_rows, into the launch's dynamic shared memory).
template <typename TW, typename TX, int N, int MODE, bool NORM>
__global__ void __launch_bounds__(GEMV_MAX_WARPS * 32)
    gemv_kernel(const TX *x, gemv_mats<TW, TX> M, size_t in, int S, size_t per, unsigned nblk,
                gemv_norm<TX> nm)
{
    __shared__ float part[GEMV_MAX_WARPS][N]; // per warp: its partial for each input row
    __shared__ float res[GEMV_MAX_WARPS][N];  // per row slot: its rounded value
    extern __shared__ uint4 gemv_xs[];        // NORM: the normed rows (N, in)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int R = (int)(blockDim.x >> 5) / S;
    const int sp = warp % S, slot = warp / S;
    const size_t chunks = in / 8; // 8-element chunks of the row
    const size_t c_begin = (size_t)sp * per + lane, c_end = min(chunks, (size_t)(sp + 1) * per);
    unsigned b = blockIdx.x;
    gemv_row<TW, TX> g = gemv_row_of<TW, TX, MODE>(M, b, R, slot);
    // The first pass's weights are loaded before griddep_wait: no kernel of a step writes
    // weights, so under programmatic dependent launch this block streams them while the
    // previous kernel (attention, a norm) is still running. x is read only after the wait.
    gemv_chunk<TW> w[GEMV_UNROLL];
    if (g.j < g.out) gemv_load_pass(w, g.W + g.j * in, c_begin, c_end);
    GRIDDEP_ENTRY();
    const TX *xr = x;
    if constexpr (NORM) {
        gemv_norm_rows<TX, N>(x, nm, in, (TX *)gemv_xs);
        xr = (const TX *)gemv_xs;
    }
    for (;;) {
        const bool active = g.j < g.out;
        const TW *wr = g.W + (active ? g.j : 0) * in;
        float acc[N];
#pragma unroll
        for (int r = 0; r < N; r++) acc[r] = 0.0f;
        for (size_t c0 = c_begin; active && c0 < c_end;) {
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; u++) {
                size_t c = c0 + (size_t)u * 32;
                if (c >= c_end) break;
                float wf[8];
                w[u].get(wf);
#pragma unroll
                for (int r = 0; r < N; r++) {
                    gemv_chunk<TX> xc;
                    if constexpr (NORM)
                        xc.load_shared(xr + (size_t)r * in + c * 8);
                    else
                        xc.load(xr + (size_t)r * in + c * 8);
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
        // the block's next row group: its first pass in flight while this one is reduced
        const unsigned nb = b + gridDim.x;
        gemv_row<TW, TX> ng = g;
        if (nb < nblk) {
            ng = gemv_row_of<TW, TX, MODE>(M, nb, R, slot);
            if (ng.j < ng.out) gemv_load_pass(w, ng.W + ng.j * in, c_begin, c_end);
        }
        gemv_store<TW, TX, N, MODE>(acc, g, M, S, R, part, res);
        if (nb >= nblk) break;
        b = nb;
        g = ng;
        if (S > 1 || MODE != GEMV_PLAIN) __syncthreads(); // part and res are reused
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

// The grid of a launch of nblk row groups: at most as many blocks as the device holds at once
// (each then takes groups in turn and has the next one's first weights in flight while it
// finishes one, and a NORM block normalizes x once for all its groups), or one block per group
// with PD_CUDA_GEMV_GRID=groups (for comparison).
template <typename K> static unsigned gemv_grid(K kernel, unsigned nblk, unsigned th, size_t smem)
{
    static const bool per_group = [] {
        const char *e = getenv("PD_CUDA_GEMV_GRID");
        return e && strcmp(e, "groups") == 0;
    }();
    int dev = 0, sms = 0, per_sm = 0;
    if (per_group || cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, (int)th, smem) !=
            cudaSuccess ||
        per_sm < 1)
        return nblk;
    const unsigned resident = (unsigned)sms * (unsigned)per_sm;
    return nblk < resident ? nblk : resident;
}

// gemv_kernel<.., N, MODE, NORM> over nblk row groups of th threads; NORM: N rows of x in
// shared memory.
template <typename TW, typename TX, int N, int MODE, bool NORM>
static void gemv_launch_k(cudaStream_t s, unsigned nblk, unsigned th, const TX *x,
                          const gemv_mats<TW, TX> &M, size_t in, int S, size_t per,
                          const gemv_norm<TX> &nm)
{
    auto k = gemv_kernel<TW, TX, N, MODE, NORM>;
    const size_t smem = NORM ? (size_t)N * in * sizeof(TX) : 0;
    cuda_launch(k, gemv_grid(k, nblk, th, smem), th, smem, s, x, M, in, S, per, nblk, nm);
}

// gemv_launch_k with N = n.
template <typename TW, typename TX, int MODE, bool NORM>
static void gemv_launch_n(cudaStream_t s, unsigned g, unsigned th, size_t n, const TX *x,
                          const gemv_mats<TW, TX> &M, size_t in, int S, size_t per,
                          const gemv_norm<TX> &nm)
{
    switch (n) {
    case 1: gemv_launch_k<TW, TX, 1, MODE, NORM>(s, g, th, x, M, in, S, per, nm); break;
    case 2: gemv_launch_k<TW, TX, 2, MODE, NORM>(s, g, th, x, M, in, S, per, nm); break;
    case 3: gemv_launch_k<TW, TX, 3, MODE, NORM>(s, g, th, x, M, in, S, per, nm); break;
    case 4: gemv_launch_k<TW, TX, 4, MODE, NORM>(s, g, th, x, M, in, S, per, nm); break;
    case 5: gemv_launch_k<TW, TX, 5, MODE, NORM>(s, g, th, x, M, in, S, per, nm); break;
    case 6: gemv_launch_k<TW, TX, 6, MODE, NORM>(s, g, th, x, M, in, S, per, nm); break;
    case 7: gemv_launch_k<TW, TX, 7, MODE, NORM>(s, g, th, x, M, in, S, per, nm); break;
    default: gemv_launch_k<TW, TX, 8, MODE, NORM>(s, g, th, x, M, in, S, per, nm); break;
    }
}

// norm: the input's norm (GEMV_SWIGLU, GEMV_ROPE only), or NULL.
template <typename TW, typename TX, int MODE>
static void gemv_launch(cudaStream_t s, const TX *x, size_t n, int nm, const void *const *W,
                        const size_t *out, size_t in, const float *const *bias, void *const *y,
                        const gemv_rope_args *ra, const cuda_norm_in *norm)
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
    gemv_norm<TX> gn;
    memset(&gn, 0, sizeof gn);
    if constexpr (MODE != GEMV_PLAIN && sizeof(TX) == 2) { // bf16 activations (f32: refused)
        if (norm) {
            gn.add = (const TX *)norm->add;
            gn.x_out = (TX *)norm->x_out;
            gn.w = norm->w;
            gn.eps = norm->eps;
            gemv_launch_n<TW, TX, MODE, true>(s, g, th, n, x, M, in, S, per, gn);
            return;
        }
    }
    gemv_launch_n<TW, TX, MODE, false>(s, g, th, n, x, M, in, S, per, gn);
}

// Runs gemv_launch<.., MODE> for the activation / weight type pair; PD_EUNSUPPORTED for others.
template <int MODE>
static int gemv_dispatch(cudaStream_t s, int act, const void *x, size_t n, int nm,
                         const void *const *W, int wdtype, const size_t *out, size_t in,
                         const float *const *bias, void *const *y, const gemv_rope_args *ra = NULL,
                         const cuda_norm_in *norm = NULL)
{
    if (norm) { // bf16 rows rmsnorm_vec_kernel would normalize; else the caller's norm kernel
        int threads, r;
        if (act != ACT_BF16 || !norm_vec_shape(in / 8, &threads, &r) ||
            n * in * 2 > GEMV_NORM_SMEM ||
            ((uintptr_t)norm->add | (uintptr_t)norm->x_out | (uintptr_t)norm->w) % 16)
            return PD_EUNSUPPORTED;
    }
    if (act == ACT_BF16 && wdtype == ACT_BF16)
        gemv_launch<bf16, bf16, MODE>(s, (const bf16 *)x, n, nm, W, out, in, bias, y, ra, norm);
    else if (act == ACT_BF16 && wdtype == ACT_F16)
        gemv_launch<__half, bf16, MODE>(s, (const bf16 *)x, n, nm, W, out, in, bias, y, ra, norm);
    else if (act == ACT_F32 && wdtype == ACT_F32)
        gemv_launch<float, float, MODE>(s, (const float *)x, n, nm, W, out, in, bias, y, ra, norm);
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
                     const void *Wu, int wdtype, size_t out, size_t in, void *y,
                     const cuda_norm_in *nm)
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
    return gemv_dispatch<GEMV_SWIGLU>(s, act, x, n, 2, W, wdtype, outs, in, bias, ys, NULL, nm);
}

int cuda_gemv_qkv_rope(cudaStream_t s, int act, const void *x, size_t n, const void *const *W,
                       int wdtype, size_t nq, size_t nkv, size_t D, size_t in,
                       const float *const *bias, void *q, const float *cos_t, const float *sin_t,
                       const int64_t *slots, void *kc, void *vc, const cuda_norm_in *nm)
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
    return gemv_dispatch<GEMV_ROPE>(s, act, x, n, 3, W, wdtype, out, in, bias, y, &ra, nm);
}

int cuda_gemv(cudaStream_t s, int act, const void *x, size_t n, const void *W, int wdtype,
              size_t out, size_t in, const float *bias, void *y)
{
    return cuda_gemv_multi(s, act, x, n, 1, &W, wdtype, &out, in, &bias, &y);
}
