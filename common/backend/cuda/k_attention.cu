// Paged attention over the KV pool (bf16, or f32 in the f32 mode), one kernel for the whole
// mixed batch (prefill chunks and decode rows), plus the merge kernel of split
// (flash-decoding) rows.
//
// Design: the host (cuda_ops.cu) turns the planned step into a work list of items: a tile
// of up to CUDA_ATTN_QV query vectors (consecutive rows of one sequence x the q heads of one
// GQA group) against a range of that sequence's cached positions. A block runs one item for
// one head group (grid.y): it stages the item's queries in shared memory, then walks the KV
// range in tiles of CUDA_ATTN_KT positions, loading each K/V tile from the paged pool once for
// all its queries (flash-style; the causal mask is applied per query row), with an online
// softmax in the exp2 domain and f32 accumulators in registers (lane l owns dims l, l+32, ...).
// Decode rows of long contexts are split along the sequence when the batch alone would not
// fill the GPU; each split writes an f32 partial output and its log-sum-exp, and the merge
// kernel combines them. Arithmetic is on CUDA cores in f32. Prefill tiles of bf16 steps with
// head_dim 64/128 go to the tensor-core kernel of k_attention_tc.cu instead (host decides).
//
// Decode items (one row, a few tiles each) are bound by memory latency and by instruction
// issue, so: every thread of the block loads 16-byte chunks of the K/V tile (all rows at once
// instead of one row per warp, each behind its own block-table read); the next tile is fetched
// into registers while the current one is computed and the block-table entries are read one
// tile further ahead still, so a tile costs about one exposed memory latency in all; queries
// are staged the same way (only the active vectors are read); the tile arithmetic is
// specialised on the number of query slots in use (1..4 per warp; decode rows of a GQA group
// use 1), which removes a branch per slot from every inner-loop step, and K rows are padded to
// D + 4 floats so the score loop reads 4 dims per shared-memory access. The sums are the same
// sums in the same order as a plain per-dim loop. The merge kernel reads the parts'
// log-sum-exps in parallel across its threads and keeps eight parts' loads in flight per output
// element, summing them in part order (deterministic).
#include <math.h>

#include "backend/cuda/cuda_common.cuh"

#define ATTN_THREADS  (CUDA_ATTN_WARPS * 32)
#define LOG2E         1.4426950408889634f
#define MERGE_THREADS 128 // most threads of a merge block (fewer for head_dim < 128)
#define MERGE_INFL    8   // parts whose loads a merge thread keeps in flight

static_assert(CUDA_ATTN_QPW == 4, "attn_kernel dispatches 1..4 query slots per warp");

static size_t attn_smem_bytes(int D)
{
    return sizeof(float) *
           ((size_t)CUDA_ATTN_QV * D + (size_t)CUDA_ATTN_KT * (D + 4) + (size_t)CUDA_ATTN_KT * D);
}

__device__ static inline float warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ static inline float warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// EPC consecutive elements of T loaded as one access (16 bytes for the vector path: one LDG.128).
template <typename T, int EPC> struct __align__(sizeof(T) * EPC) attn_chunk
{
    T e[EPC];
};

// dst[0, EPC) = f; 16-byte shared-memory stores when EPC is a multiple of 4 (dst is then
// 16-byte aligned: rows of whole chunks from a 16-byte aligned base), which spreads a warp's
// stores over all banks where scalar stores of 8 consecutive floats per thread would collide.
template <int EPC> __device__ __forceinline__ void attn_store_row(float *dst, const float *f)
{
    if constexpr (EPC % 4 == 0) {
#pragma unroll
        for (int e = 0; e < EPC; e += 4)
            *(float4 *)(dst + e) = make_float4(f[e], f[e + 1], f[e + 2], f[e + 3]);
    } else {
#pragma unroll
        for (int e = 0; e < EPC; e++) dst[e] = f[e];
    }
}

// One K/V tile (CUDA_ATTN_KT positions x D) of the paged pool, loaded by all ATTN_THREADS threads
// as chunks of EPC elements (chunk c = row c / (D / EPC), dims (c % (D / EPC)) * EPC + [0, EPC)),
// thread tid taking chunks tid + i * ATTN_THREADS. N bounds the chunks per thread for
// head_dim <= 32 * DPL. blk holds the block ids of the rows of the tile fetched next (read one
// tile ahead, so fetch() never waits on the block table); -1 marks rows past the range.
template <typename T, int DPL, int EPC> struct attn_tile {
    static constexpr int N = (CUDA_ATTN_KT * 32 * DPL / EPC + ATTN_THREADS - 1) / ATTN_THREADS;
    // with few chunks per thread (the 16-byte path) their row, dims and in-block offsets are
    // kept in registers, so no tile repeats the divisions; the scalar path (up to 32 chunks)
    // recomputes them instead of holding 3 x 32 more registers
    static constexpr bool PRE = N <= 4;
    attn_chunk<T, EPC> k[N], v[N]; // the fetched tile, in registers until store()
    int32_t blk[N];                // block ids of the next tile's chunk rows (-1: past the range)
    int32_t row_[PRE ? N : 1], dim_[PRE ? N : 1], tin_[PRE ? N : 1];
    int cpr; // chunks per row (D / EPC)

    __device__ void init(int chunks_per_row)
    {
        cpr = chunks_per_row;
        if constexpr (PRE) {
#pragma unroll
            for (int i = 0; i < N; i++) {
                int c = (int)threadIdx.x + i * ATTN_THREADS;
                row_[i] = c / cpr;
                dim_[i] = (c - row_[i] * cpr) * EPC;
            }
        }
    }
    __device__ int row(int i) const
    {
        if constexpr (PRE) return row_[i];
        return ((int)threadIdx.x + i * ATTN_THREADS) / cpr;
    }
    __device__ int dim(int i) const
    {
        if constexpr (PRE) return dim_[i];
        int c = (int)threadIdx.x + i * ATTN_THREADS;
        return (c - c / cpr * cpr) * EPC;
    }

    __device__ void read_blocks(const int32_t *bt, int bs, int t0, int kv1)
    {
#pragma unroll
        for (int i = 0; i < N; i++) {
            int t = t0 + row(i);
            blk[i] = -1;
            if (row(i) < CUDA_ATTN_KT && t < kv1) {
                int b = t / bs;
                blk[i] = bt[b];
                if constexpr (PRE) tin_[i] = t - b * bs;
            }
        }
    }

    // the tile at t0 (its blocks read by read_blocks); pool offset of the head's element 0 is
    // head_off; a token row is tok_elems elements
    __device__ void fetch(const T *kc, const T *vc, int bs, size_t tok_elems, size_t head_off,
                          int t0)
    {
#pragma unroll
        for (int i = 0; i < N; i++) {
            if (blk[i] >= 0) {
                int tin;
                if constexpr (PRE)
                    tin = tin_[i];
                else
                    tin = (t0 + row(i)) % bs;
                size_t off = ((size_t)blk[i] * bs + tin) * tok_elems + head_off + dim(i);
                k[i] = *(const attn_chunk<T, EPC> *)(kc + off);
                v[i] = *(const attn_chunk<T, EPC> *)(vc + off);
            } else {
#pragma unroll
                for (int e = 0; e < EPC; e++) k[i].e[e] = v[i].e[e] = (T)0.0f;
            }
        }
    }

    // Ks (KT, ks) and Vs (KT, D) f32 (ks: K row stride, see attn_kernel); rows past the range
    // hold zeros
    __device__ void store(float *Ks, float *Vs, int D, int ks) const
    {
#pragma unroll
        for (int i = 0; i < N; i++) {
            if (row(i) >= CUDA_ATTN_KT) continue;
            float kf[EPC], vf[EPC];
#pragma unroll
            for (int e = 0; e < EPC; e++) {
                kf[e] = (float)k[i].e[e];
                vf[e] = (float)v[i].e[e];
            }
            attn_store_row<EPC>(Ks + row(i) * ks + dim(i), kf);
            attn_store_row<EPC>(Vs + row(i) * D + dim(i), vf);
        }
    }
};

// Qs (QV, D) f32 = the item's query vectors (v < nq) pre-scaled by qscale, zeros after them;
// loads in chunks of EPC elements, all issued before the first store.
template <typename T, int DPL, int EPC>
__device__ void attn_stage_q(float *Qs, const T *q, size_t row0, int h0, int hpi, int nqh, int nq,
                             int D, float qscale)
{
    constexpr int N = (CUDA_ATTN_QV * 32 * DPL / EPC + ATTN_THREADS - 1) / ATTN_THREADS;
    const int cpr = D / EPC;
    attn_chunk<T, EPC> r[N];
#pragma unroll
    for (int i = 0; i < N; i++) {
        int c = (int)threadIdx.x + i * ATTN_THREADS, v = c / cpr;
        if (v < nq) {
            size_t row = row0 + (size_t)(v / hpi);
            int head = h0 + v % hpi;
            r[i] = *(const attn_chunk<T, EPC> *)(q + (row * nqh + head) * D +
                                                 (size_t)(c - v * cpr) * EPC);
        }
    }
#pragma unroll
    for (int i = 0; i < N; i++) {
        int c = (int)threadIdx.x + i * ATTN_THREADS, v = c / cpr;
        if (v >= CUDA_ATTN_QV) continue;
        int d = (c - v * cpr) * EPC;
        float f[EPC];
#pragma unroll
        for (int e = 0; e < EPC; e++) f[e] = v < nq ? (float)r[i].e[e] * qscale : 0.0f;
        attn_store_row<EPC>(Qs + v * D + d, f);
    }
}

// One K/V tile's arithmetic for the warp's first QA query slots (QA: the slots in use in this
// block, a template parameter so that the loops carry no per-slot branches): scores of lane =
// key against the warp's queries (the same sums in the same order either way; 16-byte
// shared-memory reads when D % 4 == 0), the online-softmax update, then acc += p V over all
// CUDA_ATTN_KT rows (rows past the range have p = 0 and zero V, so they add exact zeros).
template <int QA, int DPL>
__device__ __forceinline__ void
attn_tile_math(const float *Qs, const float *Ks, const float *Vs, int D, int ks, int t0, int kv1,
               const int (&qpos)[CUDA_ATTN_QPW], float (&m)[CUDA_ATTN_QPW],
               float (&l)[CUDA_ATTN_QPW], float (&acc)[CUDA_ATTN_QPW][DPL])
{
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = t0 + lane;
    float sc[QA];
#pragma unroll
    for (int i = 0; i < QA; i++) sc[i] = 0.0f;
    const float *krow = Ks + lane * ks;
    if (D % 4 == 0) {
#pragma unroll 4
        for (int d = 0; d < D; d += 4) {
            const float4 k4 = *(const float4 *)(krow + d);
#pragma unroll
            for (int i = 0; i < QA; i++) {
                const float4 q4 = *(const float4 *)(Qs + (warp + CUDA_ATTN_WARPS * i) * D + d);
                sc[i] += q4.x * k4.x;
                sc[i] += q4.y * k4.y;
                sc[i] += q4.z * k4.z;
                sc[i] += q4.w * k4.w;
            }
        }
    } else {
#pragma unroll 4
        for (int d = 0; d < D; d++) {
            float kd = krow[d];
#pragma unroll
            for (int i = 0; i < QA; i++) sc[i] += Qs[(warp + CUDA_ATTN_WARPS * i) * D + d] * kd;
        }
    }

    float ps[QA];
#pragma unroll
    for (int i = 0; i < QA; i++) {
        bool ok = t < kv1 && t <= qpos[i];
        float s = ok ? sc[i] : -INFINITY;
        float m_new = fmaxf(m[i], warp_max(s));
        ps[i] = 0.0f;
        if (m_new == -INFINITY) continue; // warp-uniform: nothing visible yet
        float alpha = exp2f(m[i] - m_new);
        float p = ok ? exp2f(s - m_new) : 0.0f;
        l[i] = l[i] * alpha + warp_sum(p);
#pragma unroll
        for (int k = 0; k < DPL; k++) acc[i][k] *= alpha;
        m[i] = m_new;
        ps[i] = p;
    }

    // lanes past head_dim read dim D - 1 instead of branching; their acc entries are never
    // written out
    int dv[DPL];
#pragma unroll
    for (int k = 0; k < DPL; k++) dv[k] = min(lane + 32 * k, D - 1);
#pragma unroll 8
    for (int j = 0; j < CUDA_ATTN_KT; j++) {
        float vv[DPL];
#pragma unroll
        for (int k = 0; k < DPL; k++) vv[k] = Vs[j * D + dv[k]];
#pragma unroll
        for (int i = 0; i < QA; i++) {
            float pj = __shfl_sync(0xffffffffu, ps[i], j);
#pragma unroll
            for (int k = 0; k < DPL; k++) acc[i][k] += pj * vv[k];
        }
    }
}

// DPL: dims per lane (head_dim <= 32 * DPL); T: activation / pool type; EPC: elements per K/V
// chunk (16 / sizeof(T) when head_dim is a multiple of it, else 1).
template <int DPL, typename T, int EPC>
__global__ void __launch_bounds__(ATTN_THREADS) attn_kernel(cuda_attn_args a)
{
    // Before griddep_wait (programmatic dependent launch, cuda_common.cuh) this block reads only
    // what no kernel of the step writes, while the step's KV write still runs: the work list,
    // the counts and the block table (copied in before the step's first attention launch) and,
    // when it lies wholly below it.fresh0, the first K/V tile (written by earlier steps).
    // The item is read before the count so the two loads overlap (items holds n_items entries,
    // the grid size, either way).
    const cuda_attn_item it = a.items[blockIdx.x];
    if (a.counts && (int)blockIdx.x >= a.counts[0]) return; // capacity-sized grid (graphs)
    const T *q = (const T *)a.q, *kc = (const T *)a.kc, *vc = (const T *)a.vc;
    extern __shared__ float smem[];
    const int D = a.head_dim;
    // K rows are padded so that lane = key reads are free of bank conflicts: D + 4 when D is a
    // multiple of 4 (16-byte reads; conflict-free for D % 8 == 0), else D + 1 (4-byte reads)
    const int ks = D % 4 == 0 ? D + 4 : D + 1;
    float *Qs = smem;                                // (QV, D), pre-scaled by scale*log2(e)
    float *Ks = Qs + (size_t)CUDA_ATTN_QV * D;       // (KT, ks)
    float *Vs = Ks + (size_t)CUDA_ATTN_KT * (D + 4); // (KT, D)

    const int hpi = a.heads_per_item;
    const int G = a.n_q_heads / a.n_kv_heads;
    const int h0 = blockIdx.y * hpi;
    const int kvhead = h0 / G;
    const int nq = it.nrows * hpi;                               // active query vectors
    const int qa = (nq + CUDA_ATTN_WARPS - 1) / CUDA_ATTN_WARPS; // query slots in use per warp
    const int nqh = a.n_q_heads;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const float qscale = a.scale * LOG2E;

    const int32_t *bt = a.block_ids + a.block_indptr[it.seq];
    const int bs = a.block_size;
    const size_t tok_elems = (size_t)a.n_kv_heads * D, head_off = (size_t)kvhead * D;
    const int cpr = D / EPC; // K/V chunks per row
    attn_tile<T, DPL, EPC> tile;
    tile.init(cpr);
    tile.read_blocks(bt, bs, it.kv0, it.kv1);
    const bool early = min(it.kv0 + CUDA_ATTN_KT, it.kv1) <= it.fresh0;
    if (early) tile.fetch(kc, vc, bs, tok_elems, head_off, it.kv0);
    GRIDDEP_ENTRY();
    if (!early) tile.fetch(kc, vc, bs, tok_elems, head_off, it.kv0); // first tile in flight ...
    tile.read_blocks(bt, bs, it.kv0 + CUDA_ATTN_KT, it.kv1);

    // ... while the queries are staged (16-byte loads when q allows them)
    constexpr int QEPC = 16 / (int)sizeof(T);
    if (D % QEPC == 0 && (uintptr_t)q % 16 == 0)
        attn_stage_q<T, DPL, QEPC>(Qs, q, (size_t)it.row0, h0, hpi, nqh, nq, D, qscale);
    else
        attn_stage_q<T, DPL, 1>(Qs, q, (size_t)it.row0, h0, hpi, nqh, nq, D, qscale);

    float m[CUDA_ATTN_QPW], l[CUDA_ATTN_QPW], acc[CUDA_ATTN_QPW][DPL];
    int qpos[CUDA_ATTN_QPW];
#pragma unroll
    for (int i = 0; i < CUDA_ATTN_QPW; i++) {
        int v = warp + CUDA_ATTN_WARPS * i;
        m[i] = -INFINITY;
        l[i] = 0.0f;
        qpos[i] = v < nq ? a.positions[it.row0 + v / hpi] : -1;
#pragma unroll
        for (int k = 0; k < DPL; k++) acc[i][k] = 0.0f;
    }

    for (int t0 = it.kv0; t0 < it.kv1; t0 += CUDA_ATTN_KT) {
        __syncthreads(); // previous tile consumed (and Qs written, on the first pass)
        tile.store(Ks, Vs, D, ks);
        __syncthreads();
        if (t0 + CUDA_ATTN_KT < it.kv1) { // next tile in flight during this one's arithmetic
            tile.fetch(kc, vc, bs, tok_elems, head_off, t0 + CUDA_ATTN_KT);
            tile.read_blocks(bt, bs, t0 + 2 * CUDA_ATTN_KT, it.kv1);
        }

        switch (qa) { // block-uniform: the tile's loops then carry no per-slot branches
        case 1: attn_tile_math<1, DPL>(Qs, Ks, Vs, D, ks, t0, it.kv1, qpos, m, l, acc); break;
        case 2: attn_tile_math<2, DPL>(Qs, Ks, Vs, D, ks, t0, it.kv1, qpos, m, l, acc); break;
        case 3: attn_tile_math<3, DPL>(Qs, Ks, Vs, D, ks, t0, it.kv1, qpos, m, l, acc); break;
        default: attn_tile_math<4, DPL>(Qs, Ks, Vs, D, ks, t0, it.kv1, qpos, m, l, acc); break;
        }
    }

#pragma unroll
    for (int i = 0; i < CUDA_ATTN_QPW; i++) {
        int v = warp + CUDA_ATTN_WARPS * i;
        if (v >= nq) continue;
        size_t row = (size_t)it.row0 + v / hpi;
        int head = h0 + v % hpi;
        float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
        if (it.part < 0) {
            T *o = (T *)a.out + (row * nqh + head) * D;
#pragma unroll
            for (int k = 0; k < DPL; k++) {
                int d = lane + 32 * k;
                if (d < D) stf(o, d, acc[i][k] * inv);
            }
        } else {
            float *o = a.part_o + ((size_t)it.part * nqh + head) * D;
#pragma unroll
            for (int k = 0; k < DPL; k++) {
                int d = lane + 32 * k;
                if (d < D) o[d] = acc[i][k] * inv;
            }
            if (lane == 0)
                a.part_lse[(size_t)it.part * nqh + head] =
                    l[i] > 0.0f ? m[i] + log2f(l[i]) : -INFINITY;
        }
    }
}

// Block-wide max (is_max) or sum of v over blockDim.x <= 1024 threads; red: 32 floats of shared
// memory. The combination order depends only on blockDim.x.
__device__ static float block_reduce(float v, bool is_max, float *red)
{
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = (blockDim.x + 31) >> 5;
    v = is_max ? warp_max(v) : warp_sum(v);
    __syncthreads(); // red may still be read by a previous call
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float r = lane < nw ? red[lane] : (is_max ? -INFINITY : 0.0f);
    return is_max ? warp_max(r) : warp_sum(r);
}

// One block per (merge item, q head): out = sum_p w_p o_p / sum_p w_p, w_p = 2^(lse_p - max).
// The threads share the parts for max and sum, then each output dim sums its parts in order.
template <typename T>
__global__ void __launch_bounds__(MERGE_THREADS) attn_merge_kernel(cuda_attn_args a)
{
    GRIDDEP_ENTRY();
    __shared__ float red[32];
    const cuda_attn_merge mg = a.merges[blockIdx.x]; // merges holds n_merges entries (the grid)
    if (a.counts && (int)blockIdx.x >= a.counts[1]) return; // capacity-sized grid (graphs)
    const int head = blockIdx.y, nqh = a.n_q_heads, D = a.head_dim;
    const float *lse = a.part_lse + (size_t)mg.part0 * nqh + head;    // part p at lse[p * nqh]
    const float *po = a.part_o + ((size_t)mg.part0 * nqh + head) * D; // part p at po[p * nqh * D]
    float M = -INFINITY;
    for (int p = threadIdx.x; p < mg.n_parts; p += blockDim.x) M = fmaxf(M, lse[(size_t)p * nqh]);
    M = block_reduce(M, true, red);
    float ws = 0.0f;
    if (M != -INFINITY)
        for (int p = threadIdx.x; p < mg.n_parts; p += blockDim.x) {
            float x = lse[(size_t)p * nqh];
            ws += x == -INFINITY ? 0.0f : exp2f(x - M);
        }
    const float wsum = block_reduce(ws, false, red);
    const float inv = wsum > 0.0f ? 1.0f / wsum : 0.0f;
    T *o = (T *)a.out + ((size_t)mg.row * nqh + head) * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.0f;
        for (int p0 = 0; p0 < mg.n_parts; p0 += MERGE_INFL) {
            float x[MERGE_INFL], y[MERGE_INFL];
#pragma unroll
            for (int u = 0; u < MERGE_INFL; u++) {
                int p = p0 + u;
                x[u] = p < mg.n_parts ? lse[(size_t)p * nqh] : -INFINITY;
                y[u] = p < mg.n_parts ? po[(size_t)p * nqh * D + d] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < MERGE_INFL; u++)
                if (x[u] != -INFINITY) acc += exp2f(x[u] - M) * y[u];
        }
        stf(o, d, acc * inv);
    }
}

template <int DPL, typename T> static int attn_init_dpl(void)
{
    // f32 pools take the same shared memory (tiles are staged as f32 either way)
    const int smem = (int)attn_smem_bytes(32 * DPL);
    CUDA_TRY(cudaFuncSetAttribute(attn_kernel<DPL, T, 16 / (int)sizeof(T)>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CUDA_TRY(cudaFuncSetAttribute(attn_kernel<DPL, T, 1>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return PD_OK;
}

template <typename T> static int attn_init_t(void)
{
    PD_CHECK((attn_init_dpl<2, T>()));
    PD_CHECK((attn_init_dpl<4, T>()));
    PD_CHECK((attn_init_dpl<8, T>()));
    return PD_OK;
}

int cuda_attention_init(void)
{
    PD_CHECK(attn_init_t<bf16>());
    PD_CHECK(attn_init_t<float>());
    return cuda_attention_tc_init();
}

template <int DPL, typename T>
static void attn_launch_dpl(cudaStream_t s, const cuda_attn_args *a, dim3 grid, size_t smem)
{
    // 16-byte K/V chunks need head_dim rows of whole chunks (the pools are cudaMalloc'd, and
    // layer and head offsets are then multiples of 16 bytes too)
    constexpr int EPC = 16 / (int)sizeof(T);
    if (a->head_dim % EPC == 0 && (uintptr_t)a->kc % 16 == 0 && (uintptr_t)a->vc % 16 == 0)
        cuda_launch(attn_kernel<DPL, T, EPC>, grid, ATTN_THREADS, smem, s, *a);
    else
        cuda_launch(attn_kernel<DPL, T, 1>, grid, ATTN_THREADS, smem, s, *a);
}

template <typename T> static void attn_launch(cudaStream_t s, const cuda_attn_args *a)
{
    const int D = a->head_dim;
    dim3 grid((unsigned)a->n_items, (unsigned)(a->n_q_heads / a->heads_per_item));
    size_t smem = attn_smem_bytes(D);
    if (D <= 64)
        attn_launch_dpl<2, T>(s, a, grid, smem);
    else if (D <= 128)
        attn_launch_dpl<4, T>(s, a, grid, smem);
    else
        attn_launch_dpl<8, T>(s, a, grid, smem);
}

int cuda_attention(cudaStream_t s, const cuda_attn_args *a)
{
    const int D = a->head_dim;
    if (D < 1 || D > CUDA_ATTN_MAX_D)
        return pd_error(PD_EUNSUPPORTED, "cuda attention: head_dim %d is not in [1, %d]", D,
                        CUDA_ATTN_MAX_D);
    PD_CHECK(cuda_attention_tc(s, a));
    if (a->n_items == 0) return PD_OK;
    ACT_DISPATCH(a->act, T, attn_launch<T>(s, a));
    CUDA_TRY(cudaGetLastError());
    if (a->n_merges == 0) return PD_OK;
    dim3 mgrid((unsigned)a->n_merges, (unsigned)a->n_q_heads);
    const unsigned mthreads = D >= MERGE_THREADS ? MERGE_THREADS : (unsigned)(D + 31) / 32 * 32;
    ACT_DISPATCH(a->act, T, cuda_launch(attn_merge_kernel<T>, mgrid, mthreads, 0, s, *a));
    CUDA_LAUNCH_CHECK("attn_merge_kernel");
}
