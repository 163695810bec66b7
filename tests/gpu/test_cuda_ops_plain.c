/* The CUDA backend's plain ops against the CPU backend: rmsnorm (in place too), swiglu, add
 * (bf16 and f32 activations), matmul for each GPU weight dtype over odd shapes and weight
 * slices, embed, rope and gather_rows. */
#include <stdlib.h>
#include <string.h>

#include "cuda_ops_common.h"

/* mode: -1 = bf16 activations (default), PD_DTYPE_F32 = the f32 precision mode */
static void elementwise_case(int mode)
{
    cuda_pair p;
    ASSERT_OK(ctu_pair_open(&p, mode));
    /* 2048 .. 16384: the register-resident kernel's block sizes; the rest the general one */
    static const size_t shapes[][2] = {{1, 64},    {7, 100},  {33, 4097}, {130, 2048},
                                       {3, 12288}, {2, 6144}, {2, 16384}};
    uint64_t seed = 1;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        size_t n = shapes[si][0], dim = shapes[si][1], ne = n * dim;
        float *x = malloc(ne * sizeof(float)), *x2 = malloc(ne * sizeof(float));
        float *w = malloc(dim * sizeof(float));
        ASSERT(x && x2 && w);
        ctu_fill(x, ne, &seed, 3.0f);
        ctu_fill(x2, ne, &seed, 3.0f);
        ctu_fill(w, dim, &seed, 2.0f);
        pd_tensor wt = tensor_f32("norm.weight", w, 0, dim);
        pd_weight *ww[2];
        void *xb[2] = {0}, *x2b[2] = {0}, *yb[2] = {0};
        double e_norm, e_norm_inplace, e_swiglu, e_add;
        for (int i = 0; i < 2; i++) ASSERT_OK(p.o[i]->weight_load(p.b[i], &wt, NULL, &ww[i]));
        ASSERT_OK(upload_both(&p, x, ne, xb));
        ASSERT_OK(upload_both(&p, x2, ne, x2b));
        ASSERT_OK(alloc_both(&p, ne, yb));
        for (int i = 0; i < 2; i++)
            ASSERT_OK(p.o[i]->rmsnorm(p.b[i], xb[i], ww[i], 1e-6f, n, dim, yb[i]));
        ASSERT_OK(compare(&p, yb, ne, &e_norm));
        for (int i = 0; i < 2; i++) /* in place on x2 */
            ASSERT_OK(p.o[i]->rmsnorm(p.b[i], x2b[i], ww[i], 1e-5f, n, dim, x2b[i]));
        ASSERT_OK(compare(&p, x2b, ne, &e_norm_inplace));
        for (int i = 0; i < 2; i++) ASSERT_OK(p.o[i]->swiglu(p.b[i], xb[i], x2b[i], n, dim, yb[i]));
        ASSERT_OK(compare(&p, yb, ne, &e_swiglu));
        for (int i = 0; i < 2; i++) ASSERT_OK(p.o[i]->add(p.b[i], yb[i], xb[i], ne));
        ASSERT_OK(compare(&p, yb, ne, &e_add));
        printf("    %s (%zu, %zu): nmse rmsnorm %.2e, in-place %.2e, swiglu %.2e, add %.2e\n",
               pd_dtype_name(pd_backend_act_dtype(p.b[PAIR_GPU])), n, dim, e_norm, e_norm_inplace,
               e_swiglu, e_add);
        ASSERT(e_norm <= NMSE_MAX && e_norm_inplace <= NMSE_MAX);
        ASSERT(e_swiglu <= NMSE_MAX && e_add <= NMSE_MAX);
        for (int i = 0; i < 2; i++) p.o[i]->weight_free(p.b[i], ww[i]);
        free_bufs(&p, xb);
        free_bufs(&p, x2b);
        free_bufs(&p, yb);
        free(x);
        free(x2);
        free(w);
    }
    ctu_pair_close(&p);
}

TEST(cuda_rmsnorm_swiglu_add)
{
    NEED_GPU();
    elementwise_case(-1);
    elementwise_case(PD_DTYPE_F32);
}

/* matmul with bias or not, for one GPU weight dtype, over odd shapes and weight slices. */
static void matmul_case(int gpu_wdtype)
{
    cuda_pair p;
    ASSERT_OK(ctu_pair_open(&p, gpu_wdtype));
    /* n <= 8 with in % 8 == 0 takes the GEMV kernel, the others cuBLAS */
    static const size_t shapes[][3] = {{1, 64, 96},     {5, 100, 37},    {64, 512, 1408},
                                       {130, 257, 513}, {3, 2048, 4099}, {8, 256, 300},
                                       {2, 5632, 77},   {2, 20480, 33},  {1, 4096, 3},
                                       {7, 12288, 5}}; /* in > 2048: the GEMV split over warps */
    uint64_t seed = 7 + (uint64_t)gpu_wdtype;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        size_t n = shapes[si][0], in = shapes[si][1], out = shapes[si][2];
        /* The stored matrix has 3 extra rows and 2 extra cols; we load a slice of it. */
        size_t R = out + 3, C = in + 2;
        float *W = malloc(R * C * sizeof(float)), *x = malloc(n * in * sizeof(float));
        float *bias = malloc(out * sizeof(float));
        ASSERT(W && x && bias);
        ctu_fill(W, R * C, &seed, 0.5f);
        ctu_fill(x, n * in, &seed, 1.0f);
        ctu_fill(bias, out, &seed, 1.0f);
        pd_tensor wt = tensor_f32("proj.weight", W, R, C);
        pd_tensor bt = tensor_f32("proj.bias", bias, 0, out);
        pd_weight_slice sl = {2, out, 1, in};
        pd_weight *ww[2], *bw[2];
        void *xb[2] = {0}, *yb[2] = {0};
        for (int i = 0; i < 2; i++) {
            ASSERT_OK(p.o[i]->weight_load(p.b[i], &wt, &sl, &ww[i]));
            ASSERT_OK(p.o[i]->weight_load(p.b[i], &bt, NULL, &bw[i]));
        }
        ASSERT_OK(upload_both(&p, x, n * in, xb));
        ASSERT_OK(alloc_both(&p, n * out, yb));
        double e_plain, e_bias;
        for (int i = 0; i < 2; i++) ASSERT_OK(p.o[i]->matmul(p.b[i], xb[i], n, ww[i], NULL, yb[i]));
        ASSERT_OK(compare(&p, yb, n * out, &e_plain));
        for (int i = 0; i < 2; i++)
            ASSERT_OK(p.o[i]->matmul(p.b[i], xb[i], n, ww[i], bw[i], yb[i]));
        ASSERT_OK(compare(&p, yb, n * out, &e_bias));
        printf("    %s weights (%zu x %zu) . (%zu x %zu)^T: nmse %.2e, with bias %.2e\n",
               gpu_wdtype < 0 ? "default" : pd_dtype_name((pd_dtype)gpu_wdtype), n, in, out, in,
               e_plain, e_bias);
        ASSERT(e_plain <= NMSE_MAX && e_bias <= NMSE_MAX);
        for (int i = 0; i < 2; i++) {
            p.o[i]->weight_free(p.b[i], ww[i]);
            p.o[i]->weight_free(p.b[i], bw[i]);
        }
        free_bufs(&p, xb);
        free_bufs(&p, yb);
        free(W);
        free(x);
        free(bias);
    }
    ctu_pair_close(&p);
}

TEST(cuda_matmul_bf16)
{
    NEED_GPU();
    matmul_case(-1);
}

TEST(cuda_matmul_f16)
{
    NEED_GPU();
    matmul_case(PD_DTYPE_F16);
}

TEST(cuda_matmul_f32)
{
    NEED_GPU();
    matmul_case(PD_DTYPE_F32);
}

TEST(cuda_embed_rope_gather)
{
    NEED_GPU();
    cuda_pair p;
    ASSERT_OK(ctu_pair_open(&p, -1));
    static const size_t shapes[][4] = {/* n, vocab, heads, head_dim */
                                       {1, 50, 4, 64},
                                       {37, 1000, 3, 128},
                                       {300, 4096, 8, 96},
                                       {5, 77, 2, 256},
                                       {9, 60, 5, 36}}; /* 18 pairs: 1 per thread */
    uint64_t seed = 3;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        size_t n = shapes[si][0], V = shapes[si][1], nh = shapes[si][2], D = shapes[si][3];
        size_t H = nh * D;
        simple_step st;
        ASSERT_OK(simple_step_make(&st, n, V, D, &seed));
        float *table = malloc(V * H * sizeof(float)), *x = malloc(n * H * sizeof(float));
        ASSERT(table && x);
        ctu_fill(table, V * H, &seed, 1.0f);
        ctu_fill(x, n * H, &seed, 2.0f);
        pd_tensor tt = tensor_f32("embed_tokens.weight", table, V, H);
        pd_weight *tw[2];
        void *eb[2] = {0}, *xb[2] = {0}, *gb[2] = {0};
        for (int i = 0; i < 2; i++) {
            ASSERT_OK(p.o[i]->weight_load(p.b[i], &tt, NULL, &tw[i]));
            ASSERT_OK(p.o[i]->plan(p.b[i], &st.b));
        }
        ASSERT_OK(alloc_both(&p, n * H, eb));
        ASSERT_OK(upload_both(&p, x, n * H, xb));
        ASSERT_OK(alloc_both(&p, st.b.n_out * H, gb));
        double e_embed, e_rope, e_gather;
        for (int i = 0; i < 2; i++) ASSERT_OK(p.o[i]->embed(p.b[i], tw[i], eb[i]));
        ASSERT_OK(compare(&p, eb, n * H, &e_embed));
        for (int i = 0; i < 2; i++) ASSERT_OK(p.o[i]->rope(p.b[i], xb[i], nh, D));
        ASSERT_OK(compare(&p, xb, n * H, &e_rope));
        for (int i = 0; i < 2; i++) ASSERT_OK(p.o[i]->gather_rows(p.b[i], xb[i], H, gb[i]));
        ASSERT_OK(compare(&p, gb, st.b.n_out * H, &e_gather));
        printf("    n %zu, vocab %zu, %zu heads x %zu: nmse embed %.2e, rope %.2e, gather %.2e\n",
               n, V, nh, D, e_embed, e_rope, e_gather);
        ASSERT(e_embed == 0.0); /* a bf16-representable table is copied exactly */
        ASSERT(e_rope <= NMSE_MAX && e_gather <= NMSE_MAX);
        for (int i = 0; i < 2; i++) p.o[i]->weight_free(p.b[i], tw[i]);
        free_bufs(&p, eb);
        free_bufs(&p, xb);
        free_bufs(&p, gb);
        free(table);
        free(x);
        simple_step_free(&st);
    }
    ctu_pair_close(&p);
}
