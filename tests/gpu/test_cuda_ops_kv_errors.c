/* The CUDA backend's KV export and import (against the CPU backend, then a round trip) and the
 * errors it must return instead of crashing, KV-pool sizing by --gpu-memory-utilization
 * included. */
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_backend.h"
#include "cuda_ops_common.h"

/* ---- KV export / import
 * -------------------------------------------------------------------------- */

TEST(cuda_kv_export_import)
{
    NEED_GPU();
    cuda_pair p;
    ASSERT_OK(ctu_pair_open(&p, -1));
    const size_t kvh = 4, D = 64, bs = 16, nblocks = 40;
    static const seq_spec sp[] = {{0, 150}};
    int32_t perm[64];
    for (int i = 0; i < 64; i++) perm[i] = (i * 7 + 3) % (int)nblocks;
    pd_kv *kv[2];
    for (int i = 0; i < 2; i++) {
        pd_kv_params kp = {3, nblocks, bs, kvh, D, pd_backend_act_dtype(p.b[i])};
        ASSERT_OK(p.o[i]->kv_create(p.b[i], &kp, &kv[i]));
    }
    paged_step st;
    ASSERT_OK(paged_step_make(&st, sp, 1, 0, bs, perm, D));
    for (int i = 0; i < 2; i++) ASSERT_OK(p.o[i]->plan(p.b[i], &st.b));
    uint64_t seed = 5;
    ASSERT_OK(write_random_kv(&p, kv, 2, st.n_tokens, kvh, D, &seed));
    /* export blocks 3 (consecutive run 10, 11 included) for heads [1, 3) and all heads */
    int32_t ids[] = {perm[0], perm[1], 10, 11, 12, perm[5]};
    const size_t nb = sizeof ids / sizeof ids[0];
    for (int full = 0; full < 2; full++) {
        pd_kv_range r = {2, ids, nb, full ? 0 : 1, full ? kvh : 2};
        size_t ne = 2 * nb * bs * r.n_heads * D;
        float *cpu = malloc(ne * sizeof(float)), *gpu32 = malloc(ne * sizeof(float));
        uint16_t *gpu = malloc(ne * 2), *back = malloc(ne * 2);
        ASSERT(cpu && gpu && gpu32 && back);
        ASSERT_OK(p.o[PAIR_CPU]->kv_export(p.b[PAIR_CPU], kv[PAIR_CPU], &r, cpu));
        ASSERT_OK(p.o[PAIR_CPU]->sync(p.b[PAIR_CPU]));
        ASSERT_OK(p.o[PAIR_GPU]->kv_export(p.b[PAIR_GPU], kv[PAIR_GPU], &r, gpu));
        ASSERT_OK(p.o[PAIR_GPU]->sync(p.b[PAIR_GPU]));
        pd_bf16_to_f32_n(gpu, gpu32, ne);
        ASSERT(ctu_nmse(gpu32, cpu, ne) == 0.0); /* bf16-representable values copy exactly */
        /* import into other blocks (reversed order) and export again */
        int32_t ids2[6];
        for (size_t i = 0; i < nb; i++) ids2[i] = (int32_t)(nblocks - 1 - i);
        pd_kv_range r2 = r;
        r2.layer = 0;
        r2.block_ids = ids2;
        ASSERT_OK(p.o[PAIR_GPU]->kv_import(p.b[PAIR_GPU], kv[PAIR_GPU], &r2, gpu));
        ASSERT_OK(p.o[PAIR_GPU]->kv_export(p.b[PAIR_GPU], kv[PAIR_GPU], &r2, back));
        ASSERT_OK(p.o[PAIR_GPU]->sync(p.b[PAIR_GPU]));
        ASSERT(memcmp(gpu, back, ne * 2) == 0);
        printf("    %s heads: %zu blocks exported (matches CPU) and re-imported\n",
               full ? "all" : "[1, 3)", nb);
        free(cpu);
        free(gpu);
        free(gpu32);
        free(back);
    }
    /* kv_layer view describes the same pool */
    pd_kv_layer_view view;
    ASSERT_OK(p.o[PAIR_GPU]->kv_layer(p.b[PAIR_GPU], kv[PAIR_GPU], 2, &view));
    ASSERT_EQ_INT(view.head_stride, D * 2);
    ASSERT_EQ_INT(view.block_stride, bs * kvh * D * 2);
    ASSERT_EQ_INT(view.host_visible, 0);
    /* bad ranges */
    int32_t bad_id[] = {(int32_t)nblocks};
    pd_kv_range bad = {2, bad_id, 1, 0, kvh};
    uint16_t tmp[2 * 16 * 4 * 64];
    ASSERT_ERR(p.o[PAIR_GPU]->kv_export(p.b[PAIR_GPU], kv[PAIR_GPU], &bad, tmp), PD_EINVAL,
               "block_ids[0]");
    pd_kv_range badh = {2, ids, 1, 3, 2};
    ASSERT_ERR(p.o[PAIR_GPU]->kv_import(p.b[PAIR_GPU], kv[PAIR_GPU], &badh, tmp), PD_EINVAL,
               "heads");
    pd_kv_range badl = {3, ids, 1, 0, 1};
    ASSERT_ERR(p.o[PAIR_GPU]->kv_export(p.b[PAIR_GPU], kv[PAIR_GPU], &badl, tmp), PD_EINVAL,
               "layer 3");
    paged_step_free(&st);
    for (int i = 0; i < 2; i++) p.o[i]->kv_free(p.b[i], kv[i]);
    ctu_pair_close(&p);
}

/* ---- errors
 * ---------------------------------------------------------------------------------------- */

TEST(cuda_errors)
{
    NEED_GPU();
    pd_backend_params bp = pd_backend_default_params();
    bp.max_tokens = 64;
    bp.max_seqs = 4;
    bp.max_blocks = 16;
    pd_backend *b;
    bp.weight_dtype = 7;
    ASSERT_ERR(pd_backend_cuda_create(&bp, &b), PD_EUNSUPPORTED, "weight_dtype 7");
    bp.weight_dtype = -1;
    bp.device = 99;
    ASSERT_ERR(pd_backend_cuda_create(&bp, &b), PD_ENOTFOUND, "device 99");
    bp.device = 0;
    ASSERT_OK(pd_backend_cuda_create(&bp, &b));
    const pd_backend_ops *o = pd_backend_get_ops(b);
    ASSERT_STR_EQ(o->name, "cuda");
    ASSERT_EQ_INT(pd_backend_act_dtype(b), PD_DTYPE_BF16);

    pd_kv *kv;
    pd_kv_params kp = {1, 4, 16, 2, 64, PD_DTYPE_F32};
    ASSERT_ERR(o->kv_create(b, &kp, &kv), PD_EUNSUPPORTED, "float32");
    kp.dtype = PD_DTYPE_BF16;
    ASSERT_OK(o->kv_create(b, &kp, &kv));

    uint64_t seed = 9;
    simple_step st;
    ASSERT_OK(simple_step_make(&st, 100, 50, 64, &seed));
    ASSERT_ERR(o->plan(b, &st.b), PD_ERANGE, "n_tokens 100");
    simple_step_free(&st);
    ASSERT_OK(simple_step_make(&st, 40, 50, 64, &seed));
    st.b.rope_dim = 512;
    ASSERT_ERR(o->plan(b, &st.b), PD_ERANGE, "rope_dim 512");
    st.b.rope_dim = 64;
    st.pos[5] = 3; /* positions must increase within a sequence */
    ASSERT_ERR(o->plan(b, &st.b), PD_EINVAL, "not increasing");
    st.pos[5] = 5;
    ASSERT_OK(o->plan(b, &st.b));
    /* 40 tokens need 3 blocks of 16: a table of 2 is refused at kv_write / attention */
    st.bip[1] = 2;
    ASSERT_OK(o->plan(b, &st.b));
    void *buf;
    ASSERT_OK(o->buf_alloc(b, 40 * 2 * 64 * 2, &buf));
    ASSERT_ERR(o->kv_write(b, kv, 0, buf, buf), PD_EINVAL, "needs 3 blocks");
    st.bip[1] = 3;
    st.slots[7] = 64; /* pool has 4 * 16 slots */
    ASSERT_OK(o->plan(b, &st.b));
    ASSERT_ERR(o->kv_write(b, kv, 0, buf, buf), PD_EINVAL, "slots[7]");
    ASSERT_ERR(o->attention(b, kv, 1, buf, 4, 0.1f, buf), PD_EINVAL, "layer 1");
    st.slots[7] = 7;
    ASSERT_OK(o->plan(b, &st.b));
    ASSERT_ERR(o->attention(b, kv, 0, buf, 3, 0.1f, buf), PD_EINVAL, "multiple of 2");
    ASSERT_ERR(o->rope(b, buf, 2, 32), PD_EINVAL, "rope_dim 64");

    float table[10 * 8];
    for (int i = 0; i < 80; i++) table[i] = (float)i;
    pd_tensor tt = tensor_f32("embed.weight", table, 10, 8);
    pd_weight *w;
    pd_weight_slice sl = {8, 3, 0, 0};
    ASSERT_ERR(o->weight_load(b, &tt, &sl, &w), PD_EINVAL, "embed.weight");
    ASSERT_OK(o->weight_load(b, &tt, NULL, &w));
    ASSERT_EQ_INT(o->weight_nbytes(b, w), 10 * 8 * 2);
    ASSERT_ERR(o->embed(b, w, buf), PD_EINVAL, "vocab 10"); /* token ids reach 49 */
    o->weight_free(b, w);
    ASSERT_OK(o->sync(b));

    /* KV-pool sizing by --gpu-memory-utilization */
    pd_kv_params kvp = {22, 0, 16, 4, 64, PD_DTYPE_BF16};
    size_t nblk = 0;
    ASSERT_ERR(pd_backend_cuda_kv_blocks(b, &kvp, 0.0, &nblk), PD_EINVAL, "not in (0, 1]");
    ASSERT_ERR(pd_backend_cuda_kv_blocks(b, &kvp, 1e-9, &nblk), PD_ENOMEM,
               "no room for one KV block");
    ASSERT_OK(pd_backend_cuda_kv_blocks(b, &kvp, 0.9, &nblk));
    printf("    --gpu-memory-utilization 0.9: %zu blocks of 16 tokens (22 layers, 4 x 64 bf16)\n",
           nblk);
    ASSERT(nblk >= 1);
    size_t nblk2 = 0;
    ASSERT_OK(pd_backend_cuda_kv_blocks(b, &kvp, 0.95, &nblk2));
    ASSERT(nblk2 > nblk);
    o->buf_free(b, buf);
    o->kv_free(b, kv);
    simple_step_free(&st);
    pd_backend_free(b);
}
