// Tensor-core paged attention for prefill tiles (bf16 activations, head_dim 64 or 128), launched
// by cuda_attention (k_attention.cu) for the work items the host marked as tensor-core items.
//
// Design (FlashAttention-2 shape on WMMA bf16 16x16x16 fragments): a block of 4 warps takes 64
// query vectors (consecutive rows of one sequence x the q heads of one GQA group) and walks the
// sequence's paged KV in tiles of 64 positions staged in shared memory once for all 64 queries.
// Per tile each warp computes its 16 x 64 scores S = Q K^T on tensor cores (f32 accumulate),
// applies scale and the causal mask per query row in f32, updates the running max / sum
// (online softmax, exp2 domain), writes P as bf16 and accumulates O = O * alpha + P V on tensor
// cores with O kept in shared memory as f32 (per-row rescaling needs addressable rows). Rows end
// as O / l rounded once to bf16.
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

template <int D> __global__ void __launch_bounds__(TC_THREADS) attn_tc_kernel(cuda_attn_args a)
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

    const cuda_attn_item it = a.tc_items[blockIdx.x];
    const int hpi = a.tc_heads_per_item;
    const int G = a.n_q_heads / a.n_kv_heads;
    const int h0 = blockIdx.y * hpi, kvhead = h0 / G;
    const int nq = it.nrows * hpi, nqh = a.n_q_heads;
    const bf16 *q = (const bf16 *)a.q, *kc = (const bf16 *)a.kc, *vc = (const bf16 *)a.vc;
    const float qs = a.scale * 1.4426950408889634f;
    const int CH = D / 8; // 16-byte chunks per row

    for (int i = tid; i < CUDA_ATTN_TC_QV * CH; i += TC_THREADS) {
        int v = i / CH, c = i % CH;
        uint4 val = make_uint4(0, 0, 0, 0);
        if (v < nq) {
            size_t row = (size_t)it.row0 + v / hpi;
            int head = h0 + v % hpi;
            val = *(const uint4 *)(q + (row * nqh + head) * D + c * 8);
        }
        *(uint4 *)(Qs + v * L::LDQ + c * 8) = val;
    }
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

int cuda_attention_tc_init(void)
{
    CUDA_TRY(cudaFuncSetAttribute(attn_tc_kernel<64>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  (int)tc_layout<64>::bytes));
    CUDA_TRY(cudaFuncSetAttribute(attn_tc_kernel<128>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  (int)tc_layout<128>::bytes));
    return PD_OK;
}

int cuda_attention_tc(cudaStream_t s, const cuda_attn_args *a)
{
    if (a->n_tc_items == 0) return PD_OK;
    if (a->act != ACT_BF16 || (a->head_dim != 64 && a->head_dim != 128))
        return pd_error(PD_EINTERNAL, "cuda attention: tensor-core items for head_dim %d / act %d",
                        a->head_dim, a->act);
    dim3 grid((unsigned)a->n_tc_items, (unsigned)(a->n_q_heads / a->tc_heads_per_item));
    if (a->head_dim == 64)
        attn_tc_kernel<64><<<grid, TC_THREADS, tc_layout<64>::bytes, s>>>(*a);
    else
        attn_tc_kernel<128><<<grid, TC_THREADS, tc_layout<128>::bytes, s>>>(*a);
    CUDA_LAUNCH_CHECK("attn_tc_kernel");
}
