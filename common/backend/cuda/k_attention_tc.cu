// Tensor-core paged attention for prefill tiles (bf16 activations, head_dim 64 or 128), launched
// by cuda_attention (k_attention.cu) for the work items the host marked as tensor-core items.
// Two kernels of the same contract: the mma.sync kernel (default) and the WMMA kernel it
// replaces (PD_CUDA_ATTN_TC=wmma; kept until the new one has run on a GPU).
//
// Both are FlashAttention-2 shaped: a block of 4 warps takes 64 query vectors (consecutive rows
// of one sequence x the q heads of one GQA group) and walks the sequence's paged KV in tiles of
// 64 positions staged in shared memory once for all 64 queries; each warp owns 16 query vectors,
// computes their 16 x 64 scores on tensor cores (f32 accumulate), applies scale and the causal
// mask in f32, updates the running max / sum (online softmax, exp2 domain), rounds P to bf16 and
// accumulates O = O * alpha + P V on tensor cores; rows end as O / l rounded once to bf16.
//
// mma.sync kernel: m16n8k16 PTX fragments, whose register layout is documented, so S, P and O
// never leave registers (the score accumulators of two 8-key tiles are exactly the A fragment of
// P for a 16-key step); K/V tiles are double-buffered with cp.async (the next tile loads while
// this one is used, past the end zero-filled); V's B fragments come from ldmatrix.trans.
// WMMA kernel: opaque fragments, so S goes through shared memory for the softmax and O is kept
// in shared memory as f32 (per-row rescaling needs addressable rows); K/V loads are synchronous.
#include <mma.h>

#include "backend/cuda/cuda_common.cuh"

using namespace nvcuda;

#define TC_WARPS   4
#define TC_THREADS (TC_WARPS * 32)
#define TC_LDS     (CUDA_ATTN_TC_KT + 4) // f32 score row stride
#define TC_LDP     (CUDA_ATTN_TC_KT + 8) // bf16 probability row stride

template <int D> struct tc_layout {
    static constexpr int LDQ = D + 8, LDK = D + 8, LDV = D + 8, LDO = D + 4;
    static constexpr size_t q_off = 0;
    static constexpr size_t k_off = q_off + (size_t)CUDA_ATTN_TC_QV * LDQ * 2;
    static constexpr size_t v_off = k_off + (size_t)CUDA_ATTN_TC_KT * LDK * 2;
    static constexpr size_t s_off = v_off + (size_t)CUDA_ATTN_TC_KT * LDV * 2;
    static constexpr size_t p_off = s_off + (size_t)TC_WARPS * 16 * TC_LDS * 4;
    static constexpr size_t o_off = p_off + (size_t)TC_WARPS * 16 * TC_LDP * 2;
    static constexpr size_t a_off = o_off + (size_t)TC_WARPS * 16 * LDO * 4;
    static constexpr size_t bytes = a_off + (size_t)TC_WARPS * 16 * 4;
};

// The item's 64 query vectors (row r = v / hpi, head h0 + v % hpi; zeros past nrows * hpi) into
// shared rows of ld elements.
template <int D>
__device__ __forceinline__ void tc_stage_q(const cuda_attn_args &a, const cuda_attn_item &it,
                                           int h0, bf16 *Qs, int ld)
{
    constexpr int CH = D / 8; // 16-byte chunks per row
    const int hpi = a.tc_heads_per_item, nq = it.nrows * hpi;
    const bf16 *q = (const bf16 *)a.q;
    for (int i = threadIdx.x; i < CUDA_ATTN_TC_QV * CH; i += TC_THREADS) {
        int v = i / CH, c = i % CH;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (v < nq) {
            size_t row = (size_t)it.row0 + v / hpi;
            int head = h0 + v % hpi;
            val = *(const uint4 *)(q + (row * a.n_q_heads + head) * D + c * 8);
        }
        *(uint4 *)(Qs + v * ld + c * 8) = val;
    }
}

template <int D> __global__ void __launch_bounds__(TC_THREADS) attn_tc_wmma_kernel(cuda_attn_args a)
{
    typedef tc_layout<D> L;
    extern __shared__ __align__(128) unsigned char tc_smem[];
    bf16 *Qs = (bf16 *)(tc_smem + L::q_off); // (QV, LDQ)
    bf16 *Ks = (bf16 *)(tc_smem + L::k_off); // (KT, LDK)
    bf16 *Vs = (bf16 *)(tc_smem + L::v_off); // (KT, LDV)
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    float *Sw = (float *)(tc_smem + L::s_off) + (size_t)warp * 16 * TC_LDS; // (16, LDS)
    bf16 *Pw = (bf16 *)(tc_smem + L::p_off) + (size_t)warp * 16 * TC_LDP;   // (16, LDP)
    float *Ow = (float *)(tc_smem + L::o_off) + (size_t)warp * 16 * L::LDO; // (16, LDO)
    float *Aw = (float *)(tc_smem + L::a_off) + warp * 16;                  // (16) alpha

    const int n_groups = a.n_q_heads / a.tc_heads_per_item;
    const cuda_attn_item it = a.tc_items[blockIdx.x / n_groups];
    const int hpi = a.tc_heads_per_item;
    const int G = a.n_q_heads / a.n_kv_heads;
    const int h0 = (int)(blockIdx.x % n_groups) * hpi, kvhead = h0 / G;
    const int nq = it.nrows * hpi, nqh = a.n_q_heads;
    const bf16 *kc = (const bf16 *)a.kc, *vc = (const bf16 *)a.vc;
    const float qs = a.scale * 1.4426950408889634f;
    const int CH = D / 8; // 16-byte chunks per row

    tc_stage_q<D>(a, it, h0, Qs, L::LDQ);
    for (int i = lane; i < 16 * L::LDO; i += 32) Ow[i] = 0.0f;

    // lane pair (2r, 2r+1) owns row r of the warp's 16 query vectors, half h of the columns
    const int r = lane >> 1, h = lane & 1;
    const int vq = warp * 16 + r;
    const int qpos = vq < nq ? a.positions[it.row0 + vq / hpi] : -1;
    float m = -INFINITY, l = 0.0f;

    const int32_t *bt = a.block_ids + a.block_indptr[it.seq];
    const int bs = a.block_size;
    const size_t tok_elems = (size_t)a.n_kv_heads * D;

    // the warp's 16 query vectors as matrix_a fragments, loaded once for all key tiles
    __syncthreads();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fq[D / 16];
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
        wmma::load_matrix_sync(fq[kk], Qs + (warp * 16) * L::LDQ + kk * 16, L::LDQ);

    for (int t0 = it.kv0; t0 < it.kv1; t0 += CUDA_ATTN_TC_KT) {
        __syncthreads(); // previous tile consumed
        for (int i = tid; i < CUDA_ATTN_TC_KT * CH; i += TC_THREADS) {
            int j = i / CH, c = i % CH, t = t0 + j;
            uint4 kv_k = make_uint4(0, 0, 0, 0), kv_v = kv_k;
            if (t < it.kv1) {
                size_t off =
                    ((size_t)bt[t / bs] * bs + t % bs) * tok_elems + (size_t)kvhead * D + c * 8;
                kv_k = *(const uint4 *)(kc + off);
                kv_v = *(const uint4 *)(vc + off);
            }
            *(uint4 *)(Ks + j * L::LDK + c * 8) = kv_k;
            *(uint4 *)(Vs + j * L::LDV + c * 8) = kv_v;
        }
        __syncthreads();

        // S (16 x 64) = Q_w (16 x D) . K^T (D x 64)
        for (int nt = 0; nt < CUDA_ATTN_TC_KT / 16; nt++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
            wmma::fill_fragment(c, 0.0f);
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> fb;
                wmma::load_matrix_sync(fb, Ks + (nt * 16) * L::LDK + kk * 16, L::LDK);
                wmma::mma_sync(c, fq[kk], fb, c);
            }
            wmma::store_matrix_sync(Sw + nt * 16, c, TC_LDS, wmma::mem_row_major);
        }
        __syncwarp();

        // online softmax for row r, columns [32h, 32h + 32)
        float sv[32];
        float tmax = -INFINITY;
#pragma unroll
        for (int j = 0; j < 32; j++) {
            int col = h * 32 + j, t = t0 + col;
            bool ok = t < it.kv1 && t <= qpos;
            sv[j] = ok ? Sw[r * TC_LDS + col] * qs : -INFINITY;
            tmax = fmaxf(tmax, sv[j]);
        }
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
        float m_new = fmaxf(m, tmax);
        float alpha = 1.0f, psum = 0.0f;
        if (m_new == -INFINITY) {
#pragma unroll
            for (int j = 0; j < 32; j++) Pw[r * TC_LDP + h * 32 + j] = __float2bfloat16(0.0f);
        } else {
            alpha = exp2f(m - m_new);
#pragma unroll
            for (int j = 0; j < 32; j++) {
                float p = sv[j] == -INFINITY ? 0.0f : exp2f(sv[j] - m_new);
                psum += p;
                Pw[r * TC_LDP + h * 32 + j] = __float2bfloat16(p);
            }
            m = m_new;
        }
        psum += __shfl_xor_sync(0xffffffffu, psum, 1);
        l = l * alpha + psum;
        if (h == 0) Aw[r] = alpha;
        __syncwarp();

        // O = O * alpha (per row), then O += P (16 x 64) . V (64 x D)
        for (int i = lane; i < 16 * D; i += 32) {
            int rr = i / D, d = i % D;
            Ow[rr * L::LDO + d] *= Aw[rr];
        }
        __syncwarp();
        for (int dt = 0; dt < D / 16; dt++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
            wmma::load_matrix_sync(c, Ow + dt * 16, L::LDO, wmma::mem_row_major);
#pragma unroll
            for (int kk = 0; kk < CUDA_ATTN_TC_KT / 16; kk++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> fb;
                wmma::load_matrix_sync(fa, Pw + kk * 16, TC_LDP);
                wmma::load_matrix_sync(fb, Vs + (kk * 16) * L::LDV + dt * 16, L::LDV);
                wmma::mma_sync(c, fa, fb, c);
            }
            wmma::store_matrix_sync(Ow + dt * 16, c, L::LDO, wmma::mem_row_major);
        }
        __syncwarp();
    }

    if (vq < nq && l > 0.0f) {
        size_t row = (size_t)it.row0 + vq / hpi;
        int head = h0 + vq % hpi;
        bf16 *o = (bf16 *)a.out + (row * nqh + head) * D;
        float inv = 1.0f / l;
        for (int d = h * (D / 2); d < (h + 1) * (D / 2); d++)
            o[d] = __float2bfloat16(Ow[r * L::LDO + d] * inv);
    }
}

// ---- mma.sync kernel ----------------------------------------------------------------------------

template <int D> struct mma_layout {
    static constexpr int LD = D + 8;   // bf16 per shared row: 16-byte aligned, rows 4 banks apart
    static constexpr size_t q_off = 0; // (QV, LD)
    static constexpr size_t k_off = q_off + (size_t)CUDA_ATTN_TC_QV * LD * 2;     // 2 x (KT, LD)
    static constexpr size_t v_off = k_off + 2 * (size_t)CUDA_ATTN_TC_KT * LD * 2; // 2 x (KT, LD)
    static constexpr size_t bytes = v_off + 2 * (size_t)CUDA_ATTN_TC_KT * LD * 2;
};

// 16 bytes global -> shared, asynchronously; zeros when !valid (src is then not read).
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid)
{
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(n));
}

__device__ __forceinline__ void cp_async_commit(void)
{
    asm volatile("cp.async.commit_group;\n" ::);
}

// Waits until at most n of this thread's committed groups are still in flight.
template <int n> __device__ __forceinline__ void cp_async_wait(void)
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(n));
}

// c (16 x 8, f32) += a (16 x 16, bf16, row) . b (16 x 8, bf16, col). Fragments (g = lane / 4,
// q = lane % 4): a = {(g, 2q..2q+1), (g+8, 2q..), (g, 2q+8..), (g+8, 2q+8..)}; b = {(k 2q..2q+1,
// n g), (k 2q+8.., n g)}; c = {(g, 2q), (g, 2q+1), (g+8, 2q), (g+8, 2q+1)}.
__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The b fragments of two 8-column tiles of a row-major (k, n) bf16 matrix in shared memory:
// lanes 0-15 name rows k0..k0+15 at column n0, lanes 16-31 the same rows at n0 + 8; .trans hands
// each lane its (k, k+1) pairs: r[0], r[1] for columns n0.., r[2], r[3] for n0 + 8.. (one
// instruction for what two ldmatrix.x2 would load).
__device__ __forceinline__ void ldsm_x4_trans(uint32_t r[4], const bf16 *row)
{
    unsigned a = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t *)&v;
}

__device__ __forceinline__ uint32_t lds32(const bf16 *p)
{
    return *(const uint32_t *)p;
}

// K and V of positions [t0, t0 + KT) of the item's sequence into one tile buffer (zeros at and
// past kv1), asynchronously.
template <int D>
__device__ __forceinline__ void mma_load_tile(const cuda_attn_args &a, const cuda_attn_item &it,
                                              int kvhead, int t0, bf16 *kd, bf16 *vd)
{
    constexpr int LD = mma_layout<D>::LD, CH = D / 8;
    const int32_t *bt = a.block_ids + a.block_indptr[it.seq];
    const int bs = a.block_size;
    const size_t tok_elems = (size_t)a.n_kv_heads * D;
    const bf16 *kc = (const bf16 *)a.kc, *vc = (const bf16 *)a.vc;
    for (int i = threadIdx.x; i < CUDA_ATTN_TC_KT * CH; i += TC_THREADS) {
        int j = i / CH, c = i % CH, t = t0 + j;
        bool ok = t < it.kv1;
        size_t off =
            ok ? ((size_t)bt[t / bs] * bs + t % bs) * tok_elems + (size_t)kvhead * D + c * 8 : 0;
        cp_async16(kd + j * LD + c * 8, kc + off, ok);
        cp_async16(vd + j * LD + c * 8, vc + off, ok);
    }
}

template <int D> __global__ void __launch_bounds__(TC_THREADS) attn_tc_mma_kernel(cuda_attn_args a)
{
    typedef mma_layout<D> L;
    constexpr int LD = L::LD, KT = CUDA_ATTN_TC_KT;
    constexpr int NT = KT / 8;  // 8-key score tiles per key tile
    constexpr int KS = D / 16;  // 16-wide k steps of Q K^T
    constexpr int DT = D / 8;   // 8-wide output column tiles
    constexpr int PS = KT / 16; // 16-key k steps of P V
    extern __shared__ __align__(128) unsigned char tc_smem[];
    bf16 *Qs = (bf16 *)(tc_smem + L::q_off);
    bf16 *Ks = (bf16 *)(tc_smem + L::k_off);
    bf16 *Vs = (bf16 *)(tc_smem + L::v_off);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q4 = lane & 3;

    const int n_groups = a.n_q_heads / a.tc_heads_per_item;
    const cuda_attn_item it = a.tc_items[blockIdx.x / n_groups];
    const int hpi = a.tc_heads_per_item;
    const int G = a.n_q_heads / a.n_kv_heads;
    const int h0 = (int)(blockIdx.x % n_groups) * hpi, kvhead = h0 / G;
    const int nq = it.nrows * hpi, nqh = a.n_q_heads;
    const float qs = a.scale * 1.4426950408889634f;

    mma_load_tile<D>(a, it, kvhead, it.kv0, Ks, Vs);
    cp_async_commit();
    tc_stage_q<D>(a, it, h0, Qs, LD);
    __syncthreads();

    // the warp's 16 query vectors (rows g and g + 8 of this lane) as a fragments, for all tiles
    uint32_t qf[KS][4];
    const bf16 *qw = Qs + warp * 16 * LD;
#pragma unroll
    for (int kk = 0; kk < KS; kk++) {
        qf[kk][0] = lds32(qw + g * LD + kk * 16 + 2 * q4);
        qf[kk][1] = lds32(qw + (g + 8) * LD + kk * 16 + 2 * q4);
        qf[kk][2] = lds32(qw + g * LD + kk * 16 + 8 + 2 * q4);
        qf[kk][3] = lds32(qw + (g + 8) * LD + kk * 16 + 8 + 2 * q4);
    }
    const int vq0 = warp * 16 + g, vq1 = vq0 + 8;
    const int qpos0 = vq0 < nq ? a.positions[it.row0 + vq0 / hpi] : -1;
    const int qpos1 = vq1 < nq ? a.positions[it.row0 + vq1 / hpi] : -1;
    const int qmin = __reduce_min_sync(0xffffffffu, min(qpos0, qpos1)); // the warp's rows

    float o[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; dt++) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f; // rows g, g + 8 (lane's part of l)

    int buf = 0;
    for (int t0 = it.kv0; t0 < it.kv1; t0 += KT, buf ^= 1) {
        if (t0 + KT < it.kv1)
            mma_load_tile<D>(a, it, kvhead, t0 + KT, Ks + (buf ^ 1) * KT * LD,
                             Vs + (buf ^ 1) * KT * LD);
        cp_async_commit();  // possibly empty: one group per tile either way
        cp_async_wait<1>(); // this tile's group has landed
        __syncthreads();
        const bf16 *kt = Ks + buf * KT * LD, *vt = Vs + buf * KT * LD;

        // S (16 x KT) = Q K^T: b fragment = K rows (keys) read as columns (32-bit loads: an
        // ldmatrix.x4 here took 139 registers instead of 128, one block less per SM)
        float sc[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
            const bf16 *kr = kt + (nt * 8 + g) * LD + 2 * q4;
#pragma unroll
            for (int kk = 0; kk < KS; kk++)
                mma_bf16(sc[nt], qf[kk], lds32(kr + kk * 16), lds32(kr + kk * 16 + 8));
        }

        // scale, causal mask, row max over the quad (the 4 lanes sharing rows g, g + 8); a tile
        // wholly visible to every row of the warp needs no mask (the same values)
        float mx0 = -INFINITY, mx1 = -INFINITY;
        if (t0 + KT <= it.kv1 && t0 + KT - 1 <= qmin) {
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    sc[nt][e] *= qs;
                    sc[nt][2 + e] *= qs;
                    mx0 = fmaxf(mx0, sc[nt][e]);
                    mx1 = fmaxf(mx1, sc[nt][2 + e]);
                }
        } else {
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    int t = t0 + nt * 8 + 2 * q4 + e;
                    bool in = t < it.kv1;
                    sc[nt][e] = in && t <= qpos0 ? sc[nt][e] * qs : -INFINITY;
                    sc[nt][2 + e] = in && t <= qpos1 ? sc[nt][2 + e] * qs : -INFINITY;
                    mx0 = fmaxf(mx0, sc[nt][e]);
                    mx1 = fmaxf(mx1, sc[nt][2 + e]);
                }
        }
#pragma unroll
        for (int sh = 1; sh <= 2; sh <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, sh));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, sh));
        }
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        // a row with no visible key yet keeps m = -inf: its p are 0 and nothing is rescaled
        const float al0 = mn0 == -INFINITY ? 1.0f : exp2f(m0 - mn0);
        const float al1 = mn1 == -INFINITY ? 1.0f : exp2f(m1 - mn1);
        const float base0 = mn0 == -INFINITY ? 0.0f : mn0, base1 = mn1 == -INFINITY ? 0.0f : mn1;
        m0 = mn0;
        m1 = mn1;

        // P = exp2(S - m) in f32 for l, as bf16 a fragments for P V: score tiles 2k and 2k+1
        // are the two 8-key halves of k step k
        uint32_t pa[PS][4];
        float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            float p00 = exp2f(sc[nt][0] - base0), p01 = exp2f(sc[nt][1] - base0);
            float p10 = exp2f(sc[nt][2] - base1), p11 = exp2f(sc[nt][3] - base1);
            ps0 += p00 + p01;
            ps1 += p10 + p11;
            pa[nt >> 1][(nt & 1) * 2 + 0] = pack_bf16(p00, p01);
            pa[nt >> 1][(nt & 1) * 2 + 1] = pack_bf16(p10, p11);
        }
        l0 = l0 * al0 + ps0;
        l1 = l1 * al1 + ps1;

        // O = O * alpha + P V
#pragma unroll
        for (int dt = 0; dt < DT; dt++) {
            o[dt][0] *= al0;
            o[dt][1] *= al0;
            o[dt][2] *= al1;
            o[dt][3] *= al1;
        }
#pragma unroll
        for (int kk = 0; kk < PS; kk++)
#pragma unroll
            for (int dt = 0; dt < DT; dt += 2) { // b fragments of column tiles dt and dt + 1
                uint32_t vb[4];
                ldsm_x4_trans(vb, vt + (kk * 16 + (lane & 15)) * LD + (dt + (lane >> 4)) * 8);
                mma_bf16(o[dt], pa[kk], vb[0], vb[1]);
                mma_bf16(o[dt + 1], pa[kk], vb[2], vb[3]);
            }
        __syncthreads(); // this buffer is refilled by the next iteration's prefetch
    }
    cp_async_wait<0>(); // nothing left in flight at exit (an item without keys loaded a tile)

#pragma unroll
    for (int sh = 1; sh <= 2; sh <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, sh);
        l1 += __shfl_xor_sync(0xffffffffu, l1, sh);
    }
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int vq = half ? vq1 : vq0;
        const float l = half ? l1 : l0;
        if (vq >= nq || !(l > 0.0f)) continue;
        size_t row = (size_t)it.row0 + vq / hpi;
        int head = h0 + vq % hpi;
        bf16 *out = (bf16 *)a.out + (row * nqh + head) * D;
        const float inv = 1.0f / l;
#pragma unroll
        for (int dt = 0; dt < DT; dt++)
            *(__nv_bfloat162 *)(out + dt * 8 + 2 * q4) =
                __floats2bfloat162_rn(o[dt][half * 2] * inv, o[dt][half * 2 + 1] * inv);
    }
}

// ---- launcher ---------------------------------------------------------------------------------

int cuda_attention_tc_init(void)
{
    CUDA_TRY(cudaFuncSetAttribute(attn_tc_wmma_kernel<64>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  (int)tc_layout<64>::bytes));
    CUDA_TRY(cudaFuncSetAttribute(attn_tc_wmma_kernel<128>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  (int)tc_layout<128>::bytes));
    CUDA_TRY(cudaFuncSetAttribute(attn_tc_mma_kernel<64>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  (int)mma_layout<64>::bytes));
    CUDA_TRY(cudaFuncSetAttribute(attn_tc_mma_kernel<128>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  (int)mma_layout<128>::bytes));
    return PD_OK;
}

int cuda_attention_tc(cudaStream_t s, const cuda_attn_args *a)
{
    if (a->n_tc_items == 0) return PD_OK;
    if (a->act != ACT_BF16 || (a->head_dim != 64 && a->head_dim != 128))
        return pd_error(PD_EINTERNAL, "cuda attention: tensor-core items for head_dim %d / act %d",
                        a->head_dim, a->act);
    // one block per (item, head group), the groups of an item next to each other: the host
    // sorts the items longest first, so the blocks start in that order and the last wave holds
    // the short ones (with items as x and groups as y, every group's long items came after the
    // short items of the groups before it: a tail of long blocks)
    size_t blocks = a->n_tc_items * (size_t)(a->n_q_heads / a->tc_heads_per_item);
    if (blocks > 0x7fffffffu)
        return pd_error(PD_EINVAL, "cuda attention: %zu tensor-core blocks", blocks);
    const unsigned grid = (unsigned)blocks;
    if (a->tc_wmma) {
        if (a->head_dim == 64)
            attn_tc_wmma_kernel<64><<<grid, TC_THREADS, tc_layout<64>::bytes, s>>>(*a);
        else
            attn_tc_wmma_kernel<128><<<grid, TC_THREADS, tc_layout<128>::bytes, s>>>(*a);
    } else if (a->head_dim == 64) {
        attn_tc_mma_kernel<64><<<grid, TC_THREADS, mma_layout<64>::bytes, s>>>(*a);
    } else {
        attn_tc_mma_kernel<128><<<grid, TC_THREADS, mma_layout<128>::bytes, s>>>(*a);
    }
    CUDA_LAUNCH_CHECK("attn_tc_kernel");
}
