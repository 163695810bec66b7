/* The Llama-family forward pass (Llama 2/3, Mistral, Qwen2, TinyLlama), written once over the
 * backend operation table (backend.h).
 *
 * Design: pd_forward owns the backend-resident weights of one rank and the activation buffers
 * for the largest step (max_tokens rows), all allocated at create; pd_forward_run allocates
 * nothing. One run takes a batch of rows from several sequences (prefill chunks and decode
 * tokens mixed) described per sequence with CSR arrays over a paged KV cache, and returns f32
 * logits for the rows asked for.
 *
 * Tensor parallelism: params.shard {rank, size} selects attention heads [h0, h1) of q/k/v/o and
 * intermediate columns [i0, i1) of gate/up/down for this rank (column-parallel q/k/v/gate/up,
 * row-parallel o/down, whose partial sums go through params.allreduce). size 1 is the default.
 *
 * RoPE: cos/sin are computed per row on the host as transformers does (float32 angle
 * pos * inv_freq, times the attention scaling). rope_scaling "dynamic" follows transformers'
 * dynamic update per call: a sequence's rows in one step use the frequencies of
 * seq_len = max(kv_len, max_position_embeddings), so beyond max_position_embeddings a prompt
 * prefilled in several chunks gets different (equally transformers-like) keys than in one chunk;
 * every other rope type is independent of chunking.
 */
#ifndef PD_BACKEND_FORWARD_H
#define PD_BACKEND_FORWARD_H

#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "model/model.h"

typedef struct pd_forward pd_forward;

typedef struct {
    int rank; /* 0 .. size-1 */
    int size; /* tensor-parallel size; must divide num_key_value_heads and intermediate_size */
} pd_shard;

/* Sums buf (n_elems activations, in place) over all ranks of the tensor-parallel group. */
typedef int (*pd_allreduce_fn)(void *ctx, pd_backend *b, void *buf, size_t n_elems);

typedef struct {
    pd_shard shard;            /* {0, 1} */
    pd_allreduce_fn allreduce; /* required when shard.size > 1 */
    void *allreduce_ctx;
    size_t max_tokens; /* rows per step (default 2048) */
    size_t max_seqs;   /* sequences per step (default 256) */
    size_t max_out;    /* logit rows per step (default 256) */
    int no_fused;      /* 1: issue only the plain ops, never the backend's fused ones (the
                          same results; for comparisons and benchmarks) */
    int kv_dtype;      /* -1 (default): the KV cache holds the activation dtype; else its
                          pd_dtype (PD_DTYPE_F8_E4M3: an fp8 KV cache, pd_forward_kv_init) */
    /* A pipeline stage: decoder layers [layer0, layer0 + n_layers) of the model (n_layers 0:
     * to the last). Only the first stage (layer0 0) embeds tokens and only the last computes
     * logits; the others take and give the residual stream (pd_forward_run_stage). Its KV pool
     * holds its layers only, numbered from 0. */
    size_t layer0, n_layers;
} pd_forward_params;

pd_forward_params pd_forward_default_params(void);

/* One step, as the engine describes it (host arrays, valid during the call).
 * Sequence s contributes rows [q_indptr[s], q_indptr[s+1]) of token_ids, which are the tokens at
 * positions kv_len[s] - n_s .. kv_len[s] - 1 (n_s = its row count); its KV cache is the block
 * table block_ids[block_indptr[s] .. block_indptr[s+1]) of the pool passed to run, which must
 * cover kv_len[s] tokens. Earlier positions must have been run before (their KV is in the pool). */
typedef struct {
    size_t n_seqs;
    const int32_t *token_ids;    /* (q_indptr[n_seqs]) */
    const int32_t *q_indptr;     /* (n_seqs + 1), q_indptr[0] = 0, non-decreasing */
    const int32_t *kv_len;       /* (n_seqs) */
    const int32_t *block_indptr; /* (n_seqs + 1) */
    const int32_t *block_ids;    /* (block_indptr[n_seqs]) */
    size_t n_out;                /* rows whose logits are wanted */
    const int32_t *out_rows;     /* (n_out) increasing row indices */
} pd_step;

/* Loads this rank's slice of every weight of m onto b (converted as the backend chooses) and
 * allocates the activation buffers. m may be freed after this returns. PD_EINVAL when the shard
 * does not divide the model, PD_EUNSUPPORTED for size > 1 without allreduce. */
int pd_forward_create(pd_backend *b, const pd_model *m, const pd_forward_params *params,
                      pd_forward **out);
void pd_forward_free(pd_forward *f);

/* KV-pool parameters matching this forward pass (layers, local kv heads, head_dim, the
 * backend's dtype or params.kv_dtype) for a pool of n_blocks blocks of block_size tokens. */
pd_kv_params pd_forward_kv_params(const pd_forward *f, size_t n_blocks, size_t block_size);

/* Readies a pool made from pd_forward_kv_params before its first step: a quantized pool gets
 * the checkpoint's per-layer scales (kv_scales). (pd_forward_create refuses a kv_dtype the
 * backend has no quantized pool of, PD_EUNSUPPORTED.) */
int pd_forward_kv_init(const pd_forward *f, pd_kv *kv);

/* Runs one step: writes the rows' K/V into kv and logits (n_out, vocab) f32 into the host
 * buffer. Validates the step (shapes, token ids < vocab, block tables, capacities) before any
 * work, with a message naming the field. */
int pd_forward_run(pd_forward *f, pd_kv *kv, const pd_step *step, float *logits);

/* One pipeline stage's part of a step. The state that crosses a stage boundary is the residual
 * stream x and the last sublayer's output t not yet added to it (vLLM's hidden states and
 * residual): x_in (n_tokens rows of x, then n_tokens rows of t, hidden floats each, host f32)
 * from the stage before, NULL on the first stage; x_out receives the same for the stage after
 * (NULL on the last); logits as pd_forward_run, on the last stage only. So a split model runs
 * exactly the operations of the whole one: its tokens are identical. */
int pd_forward_run_stage(pd_forward *f, pd_kv *kv, const pd_step *step, const float *x_in,
                         float *x_out, float *logits);
/* The model's index of f's first layer (its pipeline stage's; 0 without stages). */
size_t pd_forward_layer0(const pd_forward *f);

/* Vocabulary size (logit row length), hidden size, and backend bytes of the loaded weights. */
size_t pd_forward_vocab(const pd_forward *f);
size_t pd_forward_hidden(const pd_forward *f);
size_t pd_forward_weight_bytes(const pd_forward *f);
/* Bytes of weights streamed per decode step (every matrix once, LM head included); used for
 * the memory-bandwidth bound. */
size_t pd_forward_bytes_per_step(const pd_forward *f);

#endif
