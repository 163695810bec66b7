// KV-cache kernels and launchers: the write that scatters this step's k and v rows into the
// paged pool, and the pull that copies a prompt's KV out of another process's pool (CUDA IPC).
//
// Design: the pool (bf16, or f32 in the f32 mode) is vLLM's layout (n_blocks, block_size,
// n_kv_heads, head_dim) per layer, so a slot s = block * block_size + offset is simply row s
// of a (n_slots, kvh * D) matrix; one thread per element copies k and v together. Slots are
// validated on the host before launch.
#include <string.h>

#include "backend/cuda/cuda_common.cuh"

template <typename T>
__global__ void kv_write_kernel(const T *k, const T *v, size_t n, size_t row_elems,
                                const int64_t *slots, T *kc, T *vc)
{
    GRIDDEP_ENTRY();
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
                 cuda_launch(kv_write_kernel<T>, (unsigned)blocks, 256, 0, s, (const T *)k,
                             (const T *)v, n, kvh * D, slots, (T *)kc, (T *)vc));
    CUDA_LAUNCH_CHECK("kv_write_kernel");
}

// Grid: y = layer * 2 + (0: K, 1: V), x = runs of 32 tokens; each warp moves 4 tokens' rows,
// all 4 loads of a lane in flight before its stores, in words of W (16 bytes when the offsets
// allow; a row of 4 heads of 64 bf16 is 512 bytes = one word per lane). Only 32-bit division
// by the block size per row: the copy is bound by memory, not by index arithmetic. A warp's
// tokens are the same for all its lanes, so its block-id reads are uniform (constant bank).
#define PULL_WARPS 8
#define PULL_ROWS  4
typedef struct {
    cuda_kv_pull_args a; // n_tokens: this launch's, from its first block
    int32_t src_blocks[CUDA_KV_PULL_IDS], dst_blocks[CUDA_KV_PULL_IDS];
} kv_pull_launch;

template <typename W>
__global__ void __launch_bounds__(PULL_WARPS * 32)
    kv_pull_kernel(const __grid_constant__ kv_pull_launch p)
{
    const cuda_kv_pull_args &a = p.a;
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const unsigned wpr = (unsigned)(a.row / sizeof(W)), bs = (unsigned)a.block_size;
    const unsigned t0 = (blockIdx.x * PULL_WARPS + warp) * PULL_ROWS;
    const unsigned char *sl = a.src + (size_t)blockIdx.y * a.src_half + a.src_off;
    unsigned char *dl = a.dst + (size_t)blockIdx.y * a.dst_half + a.dst_off;
    const W *s[PULL_ROWS];
    W *d[PULL_ROWS];
#pragma unroll
    for (int j = 0; j < PULL_ROWS; j++) {
        unsigned t = t0 + j, blk = t / bs, off = t - blk * bs;
        s[j] = NULL;
        d[j] = NULL;
        if (t < a.n_tokens) {
            s[j] = (const W *)(sl + ((size_t)p.src_blocks[blk] * bs + off) * a.src_tok);
            d[j] = (W *)(dl + ((size_t)p.dst_blocks[blk] * bs + off) * a.dst_tok);
        }
    }
    for (unsigned w = lane; w < wpr; w += 32) {
        W v[PULL_ROWS];
#pragma unroll
        for (int j = 0; j < PULL_ROWS; j++)
            if (s[j]) v[j] = s[j][w];
#pragma unroll
        for (int j = 0; j < PULL_ROWS; j++)
            if (d[j]) d[j][w] = v[j];
    }
}

int cuda_kv_pull(cudaStream_t s, const cuda_kv_pull_args *a, const int32_t *src_blocks,
                 const int32_t *dst_blocks, size_t n_blocks)
{
    if (a->n_tokens == 0 || a->n_layers == 0) return PD_OK;
    if (a->n_layers > 32767 || a->n_tokens > 0x7fffffffu || a->block_size == 0 ||
        a->n_tokens > n_blocks * a->block_size)
        return pd_error(PD_EINVAL,
                        "cuda kv_pull: %d layers / %zu tokens in %zu blocks out of range",
                        a->n_layers, a->n_tokens, n_blocks);
    size_t align = a->row | a->src_tok | a->dst_tok | a->src_off | a->dst_off | a->src_half |
                   a->dst_half | (size_t)a->src | (size_t)a->dst;
    const size_t per_block = PULL_WARPS * PULL_ROWS;
    kv_pull_launch p;
    p.a = *a;
    for (size_t b0 = 0; b0 * a->block_size < a->n_tokens; b0 += CUDA_KV_PULL_IDS) {
        size_t nb = n_blocks - b0 < CUDA_KV_PULL_IDS ? n_blocks - b0 : CUDA_KV_PULL_IDS;
        size_t t0 = b0 * a->block_size, nt = a->n_tokens - t0;
        if (nt > nb * a->block_size) nt = nb * a->block_size;
        p.a.n_tokens = nt;
        memcpy(p.src_blocks, src_blocks + b0, nb * sizeof(int32_t));
        memcpy(p.dst_blocks, dst_blocks + b0, nb * sizeof(int32_t));
        dim3 grid((unsigned)((nt + per_block - 1) / per_block), (unsigned)(2 * a->n_layers));
        if (align % 16 == 0)
            kv_pull_kernel<uint4><<<grid, PULL_WARPS * 32, 0, s>>>(p);
        else if (align % 4 == 0)
            kv_pull_kernel<uint32_t><<<grid, PULL_WARPS * 32, 0, s>>>(p);
        else
            kv_pull_kernel<uint16_t><<<grid, PULL_WARPS * 32, 0, s>>>(p);
        PD_CHECK(cuda_status(cudaGetLastError(), "kv_pull_kernel", __FILE__, __LINE__));
    }
    return PD_OK;
}
