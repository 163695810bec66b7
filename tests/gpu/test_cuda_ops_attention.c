/* The CUDA backend's paged attention against the CPU backend: GQA ratios 1, 3, 8, head dims
 * 64/96/128/256 and odd ones, block sizes 16 and 5, mixed prefill/decode/chunked rows over
 * shuffled block tables, the split (flash-decoding) path of a long decode, long prefills, and
 * the older WMMA prefill kernel. */
#include <stdlib.h>
#include <string.h>

#include "cuda_ops_common.h"

static void attention_case_mode(int mode, size_t nqh, size_t kvh, size_t D, size_t bs,
                                const seq_spec *sp, size_t ns, const char *label)
{
    cuda_pair p;
    ASSERT_OK(ctu_pair_open(&p, mode));
    uint64_t seed = 11 + nqh * 131 + D;
    size_t n_blocks = 0;
    for (size_t s = 0; s < ns; s++) n_blocks += ((size_t)(sp[s].past + sp[s].rows) + bs - 1) / bs;
    n_blocks += 17; /* spare blocks so the shuffled ids are not a dense prefix */
    int32_t *perm = malloc(n_blocks * sizeof(int32_t));
    ASSERT(perm);
    for (size_t i = 0; i < n_blocks; i++) perm[i] = (int32_t)i;
    for (size_t i = n_blocks - 1; i > 0; i--) {
        size_t j = (size_t)((ctu_rand(&seed, 1.0f) + 1.0f) * 0.5f * (float)(i + 1)) % (i + 1);
        int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    pd_kv *kv[2];
    const int layer = 1;
    for (int i = 0; i < 2; i++) {
        pd_kv_params kp = {2, n_blocks, bs, kvh, D, pd_backend_act_dtype(p.b[i])};
        ASSERT_OK(p.o[i]->kv_create(p.b[i], &kp, &kv[i]));
    }
    paged_step fill, step;
    ASSERT_OK(paged_step_make(&fill, sp, ns, 1, bs, perm, D));
    ASSERT_OK(paged_step_make(&step, sp, ns, 0, bs, perm, D));
    /* the fill step cannot hold sequences without cached tokens: drop them from it */
    {
        size_t w = 0;
        for (size_t s = 0; s < ns; s++) {
            if (sp[s].past == 0) continue;
            int32_t b0 = fill.bip[s], b1 = fill.bip[s + 1];
            fill.kvl[w] = fill.kvl[s];
            fill.qip[w + 1] = fill.qip[s + 1];
            memmove(fill.bid + fill.bip[w], fill.bid + b0, (size_t)(b1 - b0) * 4);
            fill.bip[w + 1] = fill.bip[w] + (b1 - b0);
            w++;
        }
        fill.b.n_seqs = w;
    }
    if (fill.b.n_seqs) {
        for (int i = 0; i < 2; i++) ASSERT_OK(p.o[i]->plan(p.b[i], &fill.b));
        ASSERT_OK(write_random_kv(&p, kv, layer, fill.n_tokens, kvh, D, &seed));
    }
    for (int i = 0; i < 2; i++) ASSERT_OK(p.o[i]->plan(p.b[i], &step.b));
    ASSERT_OK(write_random_kv(&p, kv, layer, step.n_tokens, kvh, D, &seed));
    size_t nq = step.n_tokens * nqh * D;
    float *q = malloc(nq * sizeof(float));
    ASSERT(q);
    ctu_fill(q, nq, &seed, 2.0f);
    void *qb[2] = {0}, *ob[2] = {0};
    ASSERT_OK(upload_both(&p, q, nq, qb));
    ASSERT_OK(alloc_both(&p, nq, ob));
    float scale = 1.0f / sqrtf((float)D);
    for (int i = 0; i < 2; i++)
        ASSERT_OK(p.o[i]->attention(p.b[i], kv[i], layer, qb[i], nqh, scale, ob[i]));
    double e;
    ASSERT_OK(compare(&p, ob, nq, &e));
    /* a second call in the same step reuses the work list and must agree */
    double e2;
    ASSERT_OK(p.o[PAIR_GPU]->attention(p.b[PAIR_GPU], kv[PAIR_GPU], layer, qb[PAIR_GPU], nqh, scale,
                                       ob[PAIR_GPU]));
    ASSERT_OK(compare(&p, ob, nq, &e2));
    printf("    %s (%s): %zu q heads / %zu kv heads x %zu, block %zu, %zu rows: nmse %.2e\n", label,
           pd_dtype_name(pd_backend_act_dtype(p.b[PAIR_GPU])), nqh, kvh, D, bs, step.n_tokens, e);
    ASSERT(e <= NMSE_MAX && e2 == e);
    free_bufs(&p, qb);
    free_bufs(&p, ob);
    free(q);
    paged_step_free(&fill);
    paged_step_free(&step);
    for (int i = 0; i < 2; i++) p.o[i]->kv_free(p.b[i], kv[i]);
    free(perm);
    ctu_pair_close(&p);
}

static void attention_case(size_t nqh, size_t kvh, size_t D, size_t bs, const seq_spec *sp,
                           size_t ns, const char *label)
{
    attention_case_mode(-1, nqh, kvh, D, bs, sp, ns, label);
}

/* prefill from 0, decode at 700, chunked prefill continuation, long decode, short decode */
static const seq_spec k_mixed[] = {{0, 37}, {700, 1}, {20, 5}, {3000, 1}, {100, 1}};

TEST(cuda_attention_mixed_gqa8)
{
    NEED_GPU();
    attention_case(32, 4, 64, 16, k_mixed, 5, "mixed");
}

TEST(cuda_attention_mixed_gqa8_f32_mode)
{
    NEED_GPU();
    attention_case_mode(PD_DTYPE_F32, 32, 4, 64, 16, k_mixed, 5, "mixed");
}

TEST(cuda_attention_mixed_mha)
{
    NEED_GPU();
    attention_case(8, 8, 64, 16, k_mixed, 5, "mixed");
}

TEST(cuda_attention_mixed_gqa3_d128_bs5)
{
    NEED_GPU();
    attention_case(12, 4, 128, 5, k_mixed, 5, "mixed");
}

TEST(cuda_attention_d96_d256)
{
    NEED_GPU();
    static const seq_spec s[] = {{0, 70}, {333, 1}, {64, 33}};
    attention_case(16, 2, 96, 16, s, 3, "d96");
    attention_case(8, 1, 256, 16, s, 3, "d256");
}

/* head_dim not a multiple of 8 (bf16) or 4 (f32): the scalar chunk path; 200: wide heads */
TEST(cuda_attention_odd_head_dims)
{
    NEED_GPU();
    static const seq_spec s[] = {{0, 70}, {333, 1}, {64, 33}, {1500, 1}};
    attention_case(8, 2, 36, 16, s, 4, "d36");
    attention_case_mode(PD_DTYPE_F32, 8, 2, 34, 16, s, 4, "d34 f32");
    attention_case_mode(PD_DTYPE_F32, 8, 2, 36, 5, s, 4, "d36 f32, block 5");
    attention_case(16, 2, 200, 16, s, 4, "d200");
}

TEST(cuda_attention_long_decode_split)
{
    NEED_GPU();
    static const seq_spec one[] = {{5000, 1}};
    attention_case(32, 4, 64, 16, one, 1, "one long decode (split)");
    static const seq_spec two[] = {{2047, 1}, {4100, 1}};
    attention_case(32, 8, 128, 16, two, 2, "two long decodes (split)");
}

TEST(cuda_attention_long_prefill)
{
    NEED_GPU();
    static const seq_spec s[] = {{0, 1000}, {500, 300}};
    attention_case(32, 4, 64, 16, s, 2, "prefill 1000 + chunk 300");
}

/* The older WMMA prefill kernel (PD_CUDA_ATTN_TC=wmma, read when a backend is created) on the
 * tensor-core shapes above; the default runs the mma.sync kernel. */
TEST(cuda_attention_prefill_wmma_kernel)
{
    NEED_GPU();
    setenv("PD_CUDA_ATTN_TC", "wmma", 1);
    attention_case(32, 4, 64, 16, k_mixed, 5, "mixed, wmma");
    attention_case(12, 4, 128, 5, k_mixed, 5, "mixed d128 block 5, wmma");
    static const seq_spec s[] = {{0, 1000}, {500, 300}};
    attention_case(32, 4, 64, 16, s, 2, "prefill 1000 + chunk 300, wmma");
    unsetenv("PD_CUDA_ATTN_TC");
}
