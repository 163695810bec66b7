// Paged attention over the KV pool (bf16, or f32 in the f32 mode), one kernel for the whole
// mixed batch (prefill chunks and decode rows), plus the merge kernel of split
// (flash-decoding) rows.
//
// Design: the host (cuda_backend.cu) turns the planned step into a work list of items: a tile
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
#include <math.h>

#include "backend/cuda/cuda_common.cuh"

#define ATTN_THREADS (CUDA_ATTN_WARPS * 32)
#define LOG2E        1.4426950408889634f

static size_t attn_smem_bytes(int D)
{
    return sizeof(float) *
           ((size_t)CUDA_ATTN_QV * D + (size_t)CUDA_ATTN_KT * (D + 1) + (size_t)CUDA_ATTN_KT * D);
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

// DPL: dims per lane (head_dim <= 32 * DPL); T: activation / pool type.
template <int DPL, typename T>
__global__ void __launch_bounds__(ATTN_THREADS) attn_kernel(cuda_attn_args a)
{
    if (a.counts && (int)blockIdx.x >= a.counts[0]) return; // capacity-sized grid (graphs)
    const T *q = (const T *)a.q, *kc = (const T *)a.kc, *vc = (const T *)a.vc;
    extern __shared__ float smem[];
    const int D = a.head_dim;
    float *Qs = smem;                                // (QV, D), pre-scaled by scale*log2(e)
    float *Ks = Qs + (size_t)CUDA_ATTN_QV * D;       // (KT, D + 1), padded: no bank conflicts
    float *Vs = Ks + (size_t)CUDA_ATTN_KT * (D + 1); // (KT, D)

    const cuda_attn_item it = a.items[blockIdx.x];
    const int hpi = a.heads_per_item;
    const int G = a.n_q_heads / a.n_kv_heads;
    const int h0 = blockIdx.y * hpi;
    const int kvhead = h0 / G;
    const int nq = it.nrows * hpi;                               // active query vectors
    const int qa = (nq + CUDA_ATTN_WARPS - 1) / CUDA_ATTN_WARPS; // query slots in use per warp
    const int nqh = a.n_q_heads;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const float qscale = a.scale * LOG2E;

    for (int idx = tid; idx < CUDA_ATTN_QV * D; idx += ATTN_THREADS) {
        int v = idx / D, d = idx % D;
        float val = 0.0f;
        if (v < nq) {
            size_t row = (size_t)it.row0 + v / hpi;
            int head = h0 + v % hpi;
            val = ldf(q, (row * nqh + head) * D + d) * qscale;
        }
        Qs[idx] = val;
    }

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

    const int32_t *bt = a.block_ids + a.block_indptr[it.seq];
    const int bs = a.block_size;
    const size_t tok_elems = (size_t)a.n_kv_heads * D;

    for (int t0 = it.kv0; t0 < it.kv1; t0 += CUDA_ATTN_KT) {
        __syncthreads(); // previous tile consumed (and Qs written, on the first pass)
        // one warp per key row: the slot is computed once, lanes read contiguous dims
        for (int j = warp; j < CUDA_ATTN_KT; j += CUDA_ATTN_WARPS) {
            int t = t0 + j;
            if (t < it.kv1) {
                size_t base = ((size_t)bt[t / bs] * bs + t % bs) * tok_elems + (size_t)kvhead * D;
                for (int d = lane; d < D; d += 32) {
                    Ks[j * (D + 1) + d] = ldf(kc, base + d);
                    Vs[j * D + d] = ldf(vc, base + d);
                }
            } else {
                for (int d = lane; d < D; d += 32) {
                    Ks[j * (D + 1) + d] = 0.0f;
                    Vs[j * D + d] = 0.0f;
                }
            }
        }
        __syncthreads();

        const int t = t0 + lane;
        float sc[CUDA_ATTN_QPW];
#pragma unroll
        for (int i = 0; i < CUDA_ATTN_QPW; i++) sc[i] = 0.0f;
        const float *krow = Ks + lane * (D + 1);
        for (int d = 0; d < D; d++) {
            float kd = krow[d];
#pragma unroll
            for (int i = 0; i < CUDA_ATTN_QPW; i++)
                if (i < qa) sc[i] += Qs[(warp + CUDA_ATTN_WARPS * i) * D + d] * kd;
        }

        float ps[CUDA_ATTN_QPW];
#pragma unroll
        for (int i = 0; i < CUDA_ATTN_QPW; i++) {
            if (i >= qa) {
                ps[i] = 0.0f;
                continue;
            }
            bool ok = t < it.kv1 && t <= qpos[i];
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

        const int jn = min(CUDA_ATTN_KT, it.kv1 - t0);
        for (int j = 0; j < jn; j++) {
            float vv[DPL];
#pragma unroll
            for (int k = 0; k < DPL; k++) {
                int d = lane + 32 * k;
                vv[k] = d < D ? Vs[j * D + d] : 0.0f;
            }
#pragma unroll
            for (int i = 0; i < CUDA_ATTN_QPW; i++) {
                if (i >= qa) continue;
                float pj = __shfl_sync(0xffffffffu, ps[i], j);
#pragma unroll
                for (int k = 0; k < DPL; k++) acc[i][k] += pj * vv[k];
            }
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

// One block per (merge item, q head): out = sum_p w_p o_p / sum_p w_p, w_p = 2^(lse_p - max).
template <typename T> __global__ void attn_merge_kernel(cuda_attn_args a)
{
    if (a.counts && (int)blockIdx.x >= a.counts[1]) return; // capacity-sized grid (graphs)
    const cuda_attn_merge mg = a.merges[blockIdx.x];
    const int head = blockIdx.y, nqh = a.n_q_heads, D = a.head_dim;
    float M = -INFINITY;
    for (int p = 0; p < mg.n_parts; p++)
        M = fmaxf(M, a.part_lse[(size_t)(mg.part0 + p) * nqh + head]);
    float wsum = 0.0f;
    for (int p = 0; p < mg.n_parts; p++) {
        float lse = a.part_lse[(size_t)(mg.part0 + p) * nqh + head];
        wsum += lse == -INFINITY ? 0.0f : exp2f(lse - M);
    }
    float inv = wsum > 0.0f ? 1.0f / wsum : 0.0f;
    T *o = (T *)a.out + ((size_t)mg.row * nqh + head) * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.0f;
        for (int p = 0; p < mg.n_parts; p++) {
            float lse = a.part_lse[(size_t)(mg.part0 + p) * nqh + head];
            if (lse == -INFINITY) continue;
            acc += exp2f(lse - M) * a.part_o[((size_t)(mg.part0 + p) * nqh + head) * D + d];
        }
        stf(o, d, acc * inv);
    }
}

template <typename T> static int attn_init_t(void)
{
    // f32 pools take the same shared memory (tiles are staged as f32 either way)
    CUDA_TRY(cudaFuncSetAttribute(attn_kernel<2, T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  (int)attn_smem_bytes(64)));
    CUDA_TRY(cudaFuncSetAttribute(attn_kernel<4, T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  (int)attn_smem_bytes(128)));
    CUDA_TRY(cudaFuncSetAttribute(attn_kernel<8, T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  (int)attn_smem_bytes(256)));
    return PD_OK;
}

int cuda_attention_init(void)
{
    PD_CHECK(attn_init_t<bf16>());
    PD_CHECK(attn_init_t<float>());
    return cuda_attention_tc_init();
}

template <typename T> static void attn_launch(cudaStream_t s, const cuda_attn_args *a)
{
    const int D = a->head_dim;
    dim3 grid((unsigned)a->n_items, (unsigned)(a->n_q_heads / a->heads_per_item));
    size_t smem = attn_smem_bytes(D);
    if (D <= 64)
        attn_kernel<2, T><<<grid, ATTN_THREADS, smem, s>>>(*a);
    else if (D <= 128)
        attn_kernel<4, T><<<grid, ATTN_THREADS, smem, s>>>(*a);
    else
        attn_kernel<8, T><<<grid, ATTN_THREADS, smem, s>>>(*a);
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
    ACT_DISPATCH(a->act, T, attn_merge_kernel<T><<<mgrid, D >= 128 ? 128 : 64, 0, s>>>(*a));
    CUDA_LAUNCH_CHECK("attn_merge_kernel");
}
