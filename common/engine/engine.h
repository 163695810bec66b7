/* The engine: turns concurrent requests into batched forward steps and streams their tokens.
 *
 * Design (llama.cpp server / vLLM engine core): one engine thread owns the model, the KV pool, the
 * scheduler (sched.h) and every sequence. Other threads talk to it only through a mutex-protected
 * inbox (add, abort, release, import) and read results from a bounded output queue of events that
 * they drain; after each step that produced events the engine calls params.on_event (so a libuv
 * loop can uv_async_send and drain the whole queue in its callback). pd_engine_step runs one
 * step synchronously on the caller's thread, for tests and offline generation; pd_engine_start
 * runs steps on a pthread until pd_engine_stop.
 *
 * A step: apply the inbox, schedule (decode rows and prefill chunks mixed), run copy-on-write
 * block copies, run the forward pass on every tensor-parallel rank at once, then for each
 * sequence whose last row produced logits: sample (sampler.h, keyed by (seed, choice index,
 * output index)), detokenize incrementally (tokenizer.h), check stop conditions with hold-back
 * (stop.h), and push one event. Nothing is allocated per token: step arrays, logits, sampler
 * workspace and event slots are sized at create; per-request memory is allocated when a
 * request is added and freed when it finishes.
 *
 * Determinism: every row's math is independent of the batch (the backend's contract) and sampling
 * depends on (seed, choice index, output index) only, so a request gives the same tokens alone or
 * with others, prefilled in one chunk or many, preempted or not, with TP = 1 or t (up to the
 * float reduction order of the TP sum, which is fixed: rank 0 + rank 1 + ...).
 *
 * Tensor parallelism: with tp_size = t the engine asks a backend group (backend/group.h) for t
 * backends (CPU: threads split between them; CUDA: one per cuda_devices entry) and creates t
 * pd_forward instances with shard {r, t}, each with a KV pool of its own head range and the same
 * block ids; rank 0 runs on the engine thread, ranks 1..t-1 on their own threads, and partial sums
 * meet in the group's all-reduce: NCCL when every rank has a GPU of its own, else staged through
 * the host (download as f32, barrier, a fixed-order sum, upload converted back). Steps of TP
 * instances are not captured into CUDA graphs.
 *
 * PD phases: a PD_PHASE_PREFILL_ONLY request runs its prompt, samples the first token and stops
 * there with its blocks kept (HELD) for the KV hand-over; its final event carries the first
 * token, the block ids and the seed; pd_engine_release frees the blocks. On the decode side,
 * pd_engine_reserve allocates blocks for a prompt (refusing when they do not fit), a transfer
 * writes the prompt's K/V into them, and pd_engine_add_imported admits the sequence with its
 * first token; it continues from there as if it had been prefilled here.
 */
#ifndef PD_ENGINE_ENGINE_H
#define PD_ENGINE_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "engine/sampler.h"
#include "engine/stop.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"

typedef struct pd_engine pd_engine;

#define PD_ENGINE_MAX_REQUEST_ID 128 /* bytes of a request id, NUL excluded */
#define PD_ENGINE_GRAMMAR_CACHE  64  /* compiled structured-output grammars kept (LRU) */
/* vLLM's CPU KV budget per rank when VLLM_CPU_KVCACHE_SPACE is unset, in GiB */
#define PD_ENGINE_CPU_KVCACHE_SPACE_GIB 4.0
#define PD_ENGINE_MAX_CUDA_DEVICES      16
#define PD_ENGINE_MAX_PP                16 /* pipeline stages */

typedef void (*pd_engine_wakeup_fn)(void *ctx);
/* Observer of the raw logits row of a sequence before it is sampled (tests, debugging); called
 * on the engine thread; logits (vocab) f32 valid during the call. step = output index. */
typedef void (*pd_engine_logits_fn)(void *ctx, const char *request_id, uint32_t seq_index,
                                    int64_t step, const float *logits, size_t vocab);

typedef struct {
    /* -- model: a directory to load, or an already loaded model (borrowed) ------------------ */
    const char *model_dir;        /* NULL: use model */
    const char *tokenizer_dir;    /* --tokenizer: tokenizer.json from here; NULL: model_dir's */
    const pd_model *model;        /* borrowed, used when model_dir is NULL; must outlive create */
    const pd_tok *tok;            /* borrowed tokenizer; NULL: loaded from model_dir when it has a
                                     tokenizer.json; with neither, events carry no text and stop
                                     strings are refused */
    bool require_tokenizer;       /* refuse to start without one (the instances detokenize their
                                     answers and check stop strings) */
    pd_backend *backend;          /* borrowed backend for TP = 1; NULL: the engine creates CPU
                                     backend(s) */
    int tp_size;                  /* tensor parallel size (1); > 1 needs backend NULL */
    int pp_size;                  /* pipeline parallel size (1): the layers split into pp_size
                                     stages of tp_size ranks each (vLLM's split); > 1 needs
                                     backend NULL */
    int pp_micro_batches;         /* with pp_size > 1: a step's sequences run as up to this many
                                     micro-batches, stage s on one while s + 1 runs the one
                                     before; 0 (default): PD_PP_MICRO_BATCHES when set, else
                                     pp_size on GPUs, 1 on the CPU (its stages share the cores,
                                     and a decode step reads the weights once per micro-batch) */
    int n_threads;                /* CPU threads in total, split evenly across ranks; <= 0 = all
                                     online cores */
    const char *cpu_threads_bind; /* CPU ranks: vLLM's VLLM_CPU_OMP_THREADS_BIND ("0-3|4-7": one
                                     core list per rank; NULL, "all", "auto": unpinned) */
    const char *cpu_budget;       /* CPU ranks: PD_CPU_BUDGET, the host core budget the ranks'
                                     threads share with other processes (NULL: "host"; "off") */
    /* -- device: CPU backends (n_cuda_devices 0) or one CUDA backend per rank --------------- */
    int n_cuda_devices; /* 0, or tp_size * pp_size: rank stage * tp_size + t (may share GPUs) */
    int cuda_devices[PD_ENGINE_MAX_CUDA_DEVICES]; /* CUDA ordinal of each rank */
    double gpu_memory_utilization; /* (0.9) CUDA: sizes the KV pool as vLLM does, when
                                      kv_cache_bytes and num_kv_blocks are 0 */
    const char *quantization;      /* --quantization (vLLM's spelling): must name the checkpoint's
                                      quantization_config method (pd_quant_check_flag); NULL or
                                      "none": whatever the checkpoint is */
    const char *kv_cache_dtype;    /* --kv-cache-dtype (vLLM's spelling, pd_kv_cache_dtype_parse):
                                      NULL or "auto" the activation dtype; "fp8", "fp8_e4m3" an
                                      fp8 KV cache with the checkpoint's scales (CPU backend) */
    int dtype; /* --dtype: -1 (default) the backend's choice (CUDA bf16, CPU f32 compute);
                  CUDA: PD_DTYPE_F32 the f32 precision mode, F16, BF16; CPU: F32, or BF16 the
                  bf16 compute mode (pd_backend_params.compute_dtype) */
    /* -- KV cache ------------------------------------------------------------------------- */
    size_t block_size;            /* tokens per block (16) */
    size_t kv_cache_bytes;        /* KV budget per rank in bytes; 0 = on CPU ranks
                                     cpu_kvcache_space_gib, on CUDA ranks gpu_memory_utilization */
    double cpu_kvcache_space_gib; /* (4) CPU ranks: KV budget per rank in GiB when kv_cache_bytes
                                     is 0 (vLLM's VLLM_CPU_KVCACHE_SPACE; <= 0: the default) */
    size_t max_kv_tokens;         /* the most tokens the workload can hold in the pool at once; 0 =
                                     max_num_seqs x max_model_len. A budget holding more is cut
                                     to these tokens' blocks, never below one max_model_len
                                     sequence (the run of pd-generate sets its own need) */
    size_t num_kv_blocks;       /* exact block count (overrides the byte budget; tests); 0 = off */
    bool enable_prefix_caching; /* (true) vLLM's automatic prefix caching: full blocks of
                                   computed K/V stay cached by content while free, and a new
                                   sequence reuses those of its longest cached prefix */
    /* -- scheduling ------------------------------------------------------------------------ */
    size_t max_num_seqs;           /* (256) */
    size_t max_num_batched_tokens; /* rows per step; 0 = 512 with enable_chunked_prefill, else
                                      max(max_model_len, 2048) (vLLM 0.5's defaults) */
    bool enable_chunked_prefill;   /* (false) vLLM's: max_num_batched_tokens may be below
                                      max_model_len (pd_sched_params.chunked_prefill) */
    size_t max_model_len;          /* 0 = the model's max_position_embeddings */
    size_t max_prefill_chunk;      /* rows of one prefilling sequence per step; 0 = budget only */
    /* -- speculative decoding (vLLM's n-gram prompt lookup, engine/spec.h) ----------------- */
    size_t spec_num_tokens;    /* drafts a decoding sequence may verify per step; 0 = off */
    size_t spec_ngram_max;     /* longest suffix n-gram looked up in the sequence (4) */
    size_t spec_ngram_min;     /* shortest (1) */
    size_t spec_disable_batch; /* no drafts while this many sequences run or more; 0 = none
                                  (vLLM's speculative_disable_by_batch_size) */
    size_t spec_max_step_rows; /* drafts join a step while its rows stay within this: where a
                                  step's time still grows little with its rows (32) */
    /* -- sampling and output --------------------------------------------------------------- */
    int64_t seed;                 /* -1 (default): a request without a seed gets a random one;
                                     else seed of a seedless request = mix(seed, request counter) */
    int32_t max_logprobs;         /* largest logprobs (and prompt_logprobs) a request may ask
                                     for (20) */
    size_t prompt_logprob_rows;   /* logits rows per step for prompt logprobs, above one row per
                                     sequence (128): a request with prompt_logprobs prefills at
                                     most this many rows per step; 0 = prompt_logprobs refused.
                                     Costs (max_num_seqs + this) x vocab f32 of logits per rank */
    size_t event_capacity;        /* output queue slots; 0 = 4 * max_num_seqs + 64 */
    pd_engine_wakeup_fn on_event; /* called (engine thread) after a step pushed events */
    void *on_event_ctx;
    pd_engine_logits_fn on_logits; /* optional observer, NULL = none */
    void *on_logits_ctx;
} pd_engine_params;

/* Defaults as documented on each field (every CLI starts from these). */
pd_engine_params pd_engine_default_params(void);

/* Loads (or borrows) the model, creates backends, forward passes, the KV pools sized from the
 * budget (capacity in tokens logged), the scheduler and the rank threads. Bad parameters fail
 * with vLLM's wording (max_num_batched_tokens < max_model_len, max_model_len larger than the KV
 * cache holds, max_model_len above max_position_embeddings, TP size not dividing the heads). */
int pd_engine_create(const pd_engine_params *params, pd_engine **out);
/* Stops the thread if running, aborts what is left, frees everything. NULL is a no-op. */
void pd_engine_free(pd_engine *e);

/* ---- requests (any thread) -------------------------------------------------------------- */

typedef enum {
    PD_PHASE_FULL = 0,         /* prefill and decode here */
    PD_PHASE_PREFILL_ONLY = 1, /* stop after the first token; keep the blocks until release */
} pd_engine_phase;

typedef struct {
    const char *request_id;    /* unique among live requests; <= PD_ENGINE_MAX_REQUEST_ID bytes */
    const int32_t *prompt_ids; /* (n_prompt) */
    size_t n_prompt;
    const pd_sampling_params *sampling; /* NULL: pd_sampling_model_params(generation config);
                                           copied, n choices = sampling->n */
    pd_engine_phase phase;
} pd_engine_request;

/* Validates and queues a request (everything copied). Errors (nothing queued): PD_EINVAL with
 * the contract's message (empty prompt, prompt too long for max_model_len, n > max_num_seqs,
 * logprobs or prompt_logprobs > max_logprobs, sampling ranges, stop strings without a
 * tokenizer), PD_EEXIST for a
 * live request id, PD_EUNSUPPORTED for n > 1 with PREFILL_ONLY, PD_ECLOSED after pd_engine_free
 * started. */
int pd_engine_add(pd_engine *e, const pd_engine_request *r);

/* Aborts a request at any point (waiting, running, held, reserved): at the next step boundary its
 * sequences free their blocks (each exactly once) and one final event per sequence with status
 * PD_ECANCELLED is pushed. PD_ENOTFOUND when the id is not live. */
int pd_engine_abort(pd_engine *e, const char *request_id);

/* Frees the blocks of a finished PREFILL_ONLY request after its KV was handed over.
 * PD_ENOTFOUND when no such held request exists. */
int pd_engine_release(pd_engine *e, const char *request_id);

/* Decode side of PD: reserves blocks for the K/V of n_tokens prompt tokens under request_id.
 * block_ids (cap entries) receives the ids, *n_blocks their count (ceil(n_tokens/block_size)).
 * prompt_ids (n_tokens, or NULL): with prefix caching on, the first blocks are the cached ones
 * of the prompt's longest cached prefix (short of its last token), and *n_cached (may be NULL;
 * 0 without prompt_ids) receives their tokens: their K/V is here already, the transfer carries
 * the rest; pd_engine_add_imported must then bring the same prompt.
 * PD_EBUSY (nothing reserved) when the pool cannot hold them now; PD_EINVAL when n_tokens >=
 * max_model_len or cap is too small; PD_EEXIST for a live id. Undo with pd_engine_abort. */
int pd_engine_reserve(pd_engine *e, const char *request_id, size_t n_tokens,
                      const int32_t *prompt_ids, int32_t *block_ids, size_t cap, size_t *n_blocks,
                      size_t *n_cached);

/* Admits a reserved request whose prompt K/V the transfer wrote: r->prompt_ids must have the
 * reserved length, r->sampling must carry the seed the prefill side used (has_seed) and n = 1;
 * first_token is the token the prefill side sampled. The engine then emits its event (text,
 * stop check: it may finish right away) and decodes on from it. A beam search
 * (use_beam_search, any n) ignores first_token: the engine computes the prompt's last position
 * again (a step of one row, whose logits are the colocated prefill's bit for bit) and runs the
 * whole search from there. */
int pd_engine_add_imported(pd_engine *e, const pd_engine_request *r, int32_t first_token);

/* ---- running ------------------------------------------------------------------------------ */

/* Runs one step on the caller's thread (PD_EBUSY while the engine thread runs). *did_work
 * (may be NULL) is false when there was nothing to do. PD_EBUSY also when the output queue has
 * too few free slots for a step: drain it and call again. A forward failure finishes the step's
 * sequences with an error event and is returned. */
int pd_engine_step(pd_engine *e, bool *did_work);

/* True while requests are waiting, running, or commands are pending (held ones excluded). */
bool pd_engine_has_work(pd_engine *e);

/* Warm-up (vLLM's dummy run, llama.cpp's warm-up decode): before the first request, runs a
 * prefill of n_tokens dummy tokens (0: max(16, max_num_seqs), as vLLM's CPU model runner; at most
 * max_num_batched_tokens, max_model_len - 1 and what the pool holds) and one decode step after it
 * on every rank, so that what a process pays once (the first read of every weight and buffer by
 * the threads that compute, on a GPU lazy module loading and the first launches) is paid here
 * instead of by the first request. Writes the K/V of blocks 0, 1, ... of the pool, which are free
 * and written again before anything reads them; leaves the scheduler, the pool's bookkeeping and
 * the statistics as they were. *n_run (may be NULL) receives the prefill's length. Call after
 * create, before pd_engine_start and before any request (PD_EBUSY otherwise). */
int pd_engine_warmup(pd_engine *e, size_t n_tokens, size_t *n_run);

/* Starts / stops the engine thread (stop waits for the current step). */
int pd_engine_start(pd_engine *e);
void pd_engine_stop(pd_engine *e);

/* ---- output events (one consumer thread) -------------------------------------------------- */

/* A request's prompt logprobs (sampling prompt_logprobs = k >= 0), vLLM's: for every prompt
 * position i in [1, n_prompt), the log_softmax of the RAW logits of position i - 1 (as for
 * generated tokens: floored at PD_LOGPROB_FLOOR) at the prompt token i, its rank (the number of
 * tokens whose logit is >= its own, so 1 for the largest, as vLLM v1 counts) and the n_top most
 * likely tokens (ranks 1..n_top). Entry 0 of each array is unused: the first prompt token has no
 * logits before it. One allocation; its owner frees it with free(). */
typedef struct {
    size_t n_prompt;
    int32_t n_top;       /* min(k, vocab) */
    float *logprob;      /* (n_prompt) */
    int32_t *rank;       /* (n_prompt) */
    int32_t *top_ids;    /* (n_prompt, n_top) by logit desc (ties: lower id) */
    float *top_logprobs; /* (n_prompt, n_top) */
} pd_prompt_logprobs;

typedef struct {
    const char *request_id;
    uint32_t seq_index;       /* choice index 0 .. n-1 */
    const int32_t *token_ids; /* (n_tokens): the new token, 0 or 1 of them (a beam search's
                                 answer: all its tokens) */
    size_t n_tokens;
    const char *text; /* UTF-8 delta to show now (after hold-back), not NUL-terminated */
    size_t text_len;
    bool final;              /* the sequence ended (finish set, or status < 0) */
    int status;              /* 0, PD_ECANCELLED (aborted), or an error code */
    const char *error;       /* message when status is an error, else "" */
    pd_finish_reason finish; /* STOP / LENGTH on a normal end, NONE otherwise */
    pd_stop_reason_kind stop_kind;
    int32_t stop_token;      /* when stop_kind is TOKEN */
    const char *stop_string; /* when stop_kind is STRING (NUL-terminated) */
    int64_t prompt_tokens;   /* usage so far */
    int64_t completion_tokens;
    bool has_logprob; /* the request asked for logprobs (>= 0) and a token came */
    float logprob;    /* of the new token, raw-logit log_softmax */
    int32_t n_top;
    const int32_t *top_ids;    /* (n_top) */
    const float *top_logprobs; /* (n_top) */
    /* the request's prompt logprobs: on the first event of choice 0 when it asked for them
     * (a PREFILL_ONLY request's hand-over event carries them; an imported one never has them) */
    const pd_prompt_logprobs *prompt_logprobs;
    /* PREFILL_ONLY hand-over (final event of such a request): */
    bool held;                /* blocks kept until pd_engine_release */
    const int32_t *block_ids; /* (n_blocks) holding the prompt's K/V */
    size_t n_blocks;
    uint64_t seed;        /* the sampling seed in use (pass it to the decode side) */
    size_t cached_tokens; /* prompt tokens the prefix cache held when it was admitted */
    /* beam search (use_beam_search): a choice comes as one final event carrying every output
     * token of its beam (n_tokens of them) and its text; this is the beam's cumulative logprob.
     * With logprobs asked (has_logprob), token_logprobs holds each token's and top_ids /
     * top_logprobs n_top entries per token (n_tokens x n_top). */
    bool has_cumulative_logprob;
    double cumulative_logprob;
    const float *token_logprobs; /* (n_tokens) */
} pd_engine_event;

/* Borrows the oldest event: 1 and *ev set, or 0 when the queue is empty. Every pointer in *ev
 * stays valid until pd_engine_event_done. */
int pd_engine_next_event(pd_engine *e, const pd_engine_event **ev);
/* Returns the slot of the event borrowed by the last pd_engine_next_event. */
void pd_engine_event_done(pd_engine *e);

/* ---- queries ------------------------------------------------------------------------------ */

#define PD_ENGINE_STEP_BINS       16 /* pd_engine_stats.step_tokens: up to 2^14 tokens, then above */
#define PD_ENGINE_SPEC_MAX_TOKENS 16 /* the most drafts per sequence step (spec_num_tokens) */

typedef struct {
    size_t num_running; /* sequences */
    size_t num_waiting;
    size_t num_held;               /* prefill-only hand-overs and reservations */
    size_t queued_tokens;          /* prompt tokens waiting or being prefilled, not computed */
    uint64_t num_preemptions;      /* cumulative */
    uint64_t prefix_cache_queries; /* cumulative: tokens of sequences admitted without KV */
    uint64_t prefix_cache_hits;    /* cumulative: of those, tokens found in the prefix cache */
    size_t kv_blocks_cached;       /* blocks registered in the prefix cache (held or free) */
    size_t kv_blocks_total;
    size_t kv_blocks_free;
    size_t block_size;
    uint64_t steps;
    uint64_t prompt_tokens;     /* prompt rows computed (recompute included) */
    uint64_t generation_tokens; /* tokens sampled */
    uint64_t requests_finished; /* incl. aborted */
    uint64_t step_ns;           /* wall time inside steps (scheduling, forward, sampling) */
    uint64_t forward_ns;        /* of which the forward pass on all ranks (CoW copies incl.) */
    /* steps by the tokens t they ran (prompt rows plus decode rows): bin 0 t = 1, bin i
     * 2^(i-1) < t <= 2^i, the last bin every larger t; powers of two so a reader can fold them
     * into any power-of-two buckets (vLLM's vllm:iteration_tokens_total) */
    uint64_t step_tokens[PD_ENGINE_STEP_BINS];
    uint64_t step_tokens_sum; /* tokens over all steps */
    /* speculative decoding (vLLM's vllm:spec_decode_* counters), cumulative */
    uint64_t spec_drafts;          /* sequence steps that verified drafts */
    uint64_t spec_draft_tokens;    /* draft tokens verified */
    uint64_t spec_accepted_tokens; /* of those, accepted */
    uint64_t spec_accepted_per_pos[PD_ENGINE_SPEC_MAX_TOKENS]; /* accepted at draft position i */
    /* cumulative seconds pipeline stage s (its tensor-parallel rank 0) spent computing its part
       of the steps, waits for the stage before excluded; [0, pp_size) */
    double stage_seconds[PD_ENGINE_MAX_PP];
} pd_engine_stats;

/* A consistent snapshot (any thread). */
void pd_engine_get_stats(pd_engine *e, pd_engine_stats *out);

size_t pd_engine_max_model_len(const pd_engine *e);
size_t pd_engine_block_size(const pd_engine *e);
/* The KV cache's dtype (what a KV transfer moves): the activation dtype, or fp8 e4m3. */
pd_dtype pd_engine_kv_dtype(const pd_engine *e);
size_t pd_engine_vocab(const pd_engine *e);
int pd_engine_tp_size(const pd_engine *e);
int pd_engine_pp_size(const pd_engine *e);
/* Layers [*layer0, *layer0 + *count) of stage of a pp-stage pipeline over n_layers: vLLM's split
 * (n_layers / pp each, the remainder one each to the stages before the last), or the counts of
 * VLLM_PP_LAYER_PARTITION ("4,6,6,6"); PD_EINVAL naming the size or the variable. */
int pd_engine_pp_layers(size_t n_layers, int pp, int stage, size_t *layer0, size_t *count);
/* The tensor-parallel all-reduce in use: "nccl", "host" (host-staged), or "none" (TP 1). */
const char *pd_engine_allreduce_name(const pd_engine *e);
/* The tokenizer in use (NULL when none). */
const pd_tok *pd_engine_tokenizer(const pd_engine *e);

/* Structured output: whether sp (guided_kind set) is ready to add without compiling (its
 * grammar is in the engine's cache; also true for an unguided sp or an engine without a
 * tokenizer, whose add reports the error). pd_engine_grammar_warm compiles it into the cache
 * (a refusal is left for the add to report). The adds compile what is missing themselves; a
 * caller that must not block (an RPC thread) warms first on a thread of its own. */
bool pd_engine_grammar_ready(pd_engine *e, const pd_sampling_params *sp);
void pd_engine_grammar_warm(pd_engine *e, const pd_sampling_params *sp);
/* The model's config (loaded or borrowed). */
const pd_model_config *pd_engine_model_config(const pd_engine *e);
/* Rank r's backend and KV pool, for the KV transfer code (same block ids on every rank); rank
 * r is tensor-parallel rank r % tp_size of pipeline stage r / tp_size, whose pool holds the
 * stage's layers only. */
pd_backend *pd_engine_backend(const pd_engine *e, int rank);
/* Rank r's pool parameters (its stage's layers) and the model's index of its first layer. */
pd_kv_params pd_engine_rank_kv(const pd_engine *e, int rank, size_t *layer0);
pd_kv *pd_engine_kv(const pd_engine *e, int rank);

#endif
