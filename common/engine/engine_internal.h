/* The engine's internals, shared by its files (engine.h is the API):
 *   engine.c          parameters, create / free, queries
 *   engine_request.c  the request table, adding and ending requests, the inbox
 *   engine_step.c     one step (schedule, forward, sample) and the engine thread
 *   engine_ranks.c    the tensor-parallel ranks: their forward passes, threads and step jobs
 *   engine_events.c   the output queue and the events a sequence pushes to it
 *   engine_beam.c     beam search (use_beam_search): candidates, rounds, the answer
 *
 * Threads and locks:
 *   - e->mu guards the scheduler, the KV block pool, the request table and the inbox. The engine
 *     thread holds it while it schedules and while it commits and processes a step's results,
 *     never during the forward pass. Callers (add, abort, release, reserve, import) take it
 *     briefly. Aborts and imports are queued in the inbox and applied by the engine thread at a
 *     step boundary, so a sequence is never freed while a step in flight refers to it; adds and
 *     reservations only append to the waiting queue or take free blocks, which a step in flight
 *     never looks at, so they apply at once.
 *   - gmu guards the creation of the structured-output vocabulary and grammar cache (the cache
 *     has its own lock); grammars compile on the callers' threads, never the engine's. The
 *     mask thread (mmu/mcv, a generation counter) computes a step's token masks during its
 *     forward pass; the engine thread touches no matcher until the job is done.
 *   - The output queue has its own mutex (qmu): one producer (the engine thread), one consumer.
 *   - Tensor-parallel ranks 1..t-1 run on their own threads, started per step through a
 *     generation counter (rmu/rcv) and joined the same way. Their all-reduce and what happens
 *     when a rank fails mid-step belong to the backend group (backend/group.h), which the engine
 *     tells when a step's rank jobs begin and end.
 */
#ifndef PD_ENGINE_ENGINE_INTERNAL_H
#define PD_ENGINE_ENGINE_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/forward.h"
#include "backend/group.h"
#include "engine/engine.h"
#include "engine/kvpool.h"
#include "engine/sched.h"
#include "grammar/grammar.h"
#include "util/idmap.h"
#include "util/arena.h"

#define REQ_BUCKETS 4096 /* of the request map */

/* ---- requests and sequences ------------------------------------------------------------------ */

typedef struct eng_req eng_req;

typedef struct {
    eng_req *req;
    uint32_t index;   /* choice index */
    pd_sched_seq *sq; /* NULL for a child not forked yet */
    pd_sampler_seq *smp;
    pd_stop *stop;
    pd_detok *detok;    /* NULL without a tokenizer */
    pd_gmatcher *gm;    /* structured output: the grammar's state; NULL when unguided */
    uint32_t *mask;     /* its allowed tokens for the next draw (with gm), made by the mask
                           thread while the forward pass runs */
    int mask_rc;        /* status of that computation */
    bool ended;         /* its final event was pushed */
    float spec_rate;    /* speculative decoding: recent share of its drafts accepted (decaying
                           average, starts at 1) */
    uint32_t spec_rest; /* steps to go without drafts (the rate fell below SPEC_MIN_RATE) */
} eng_seq;

typedef enum {
    REQ_ACTIVE = 0,    /* queued, running, or ended and about to be freed */
    REQ_HELD = 1,      /* blocks kept outside the queues: a prefill-only hand-over (phase
                          PREFILL_ONLY, until release) or a reservation (phase FULL, until the
                          import or an abort) */
    REQ_IMPORTING = 2, /* a reservation whose import waits in the inbox */
} req_state;

/* Beam search state of a request (engine_beam.c), in the request's arena. The request's W =
 * best_of eng_seqs are beam slots: a slot holds a running beam (sq set) or nothing (sq NULL);
 * choice j of the answer is pushed on slot j. A round runs when every running beam has its
 * candidates (its last token computed). */
/* One output token of a beam with its logprobs (a request with logprobs >= 0): a beam's tokens
 * are a chain back to its first, shared by the beams that forked from it; in the arena. */
typedef struct eng_beam_lp {
    const struct eng_beam_lp *prev; /* the token before, NULL for the first */
    float logprob;
    int32_t *top_ids; /* (k) the k most likely tokens of its step, desc */
    float *top_lps;   /* (k) */
} eng_beam_lp;

typedef struct {
    uint32_t parent; /* slot of the beam it extends */
    int32_t token;
    float logprob;         /* the token's */
    double cum;            /* cumulative logprob with the token */
    double score;          /* beam score (EOS-corrected) */
    pd_stop_result fin;    /* finish, stop_kind, stop_token, stop_string; NONE while running */
    uint32_t scratch;      /* with stop strings: its checker and detokenizer in cand_st / cand_dt */
    const eng_beam_lp *lp; /* finished, with logprobs: its last token's */
    int32_t *tokens;       /* finished: (max_out) its output tokens, in the pool */
    size_t n_tokens;
} eng_beam_cand;

typedef struct {
    uint32_t width;              /* W = best_of */
    uint32_t n_cand;             /* candidates per beam: min(2W, vocab) */
    uint32_t n_keep;             /* tokens kept per beam and step: n_cand, or k when larger */
    int32_t k;                   /* top logprobs per token (the request's logprobs), -1: none */
    size_t max_out;              /* output tokens a beam may reach (the effective max_tokens) */
    int32_t *prompt;             /* (n_prompt) for the answers' detokenizers */
    double *cum;                 /* (W) cumulative logprob of each slot's beam */
    bool *ready;                 /* (W) the slot's candidates are those of its current tokens */
    int32_t *cand_tok;           /* (W, n_keep) each slot's most likely next tokens, desc */
    double *cand_lp;             /* (W, n_keep) their logprobs */
    const eng_beam_lp **lp_tail; /* (W) with logprobs: each slot's last token's, NULL at first */
    const eng_beam_lp **lp_new;  /* (W) scratch: the new beams' */
    /* with stop strings: a candidate is decoded and checked on copies of its beam's
     * detokenizer and checker (the slot's eng_seq.detok / .stop), which the beams it becomes
     * take over */
    pd_detok **cand_dt; /* (2W) */
    pd_stop **cand_st;  /* (2W) */
    uint32_t *order;    /* (n_order) running slots, best first (the parents' order) */
    uint32_t n_order;
    eng_beam_cand *cands; /* (2W) a round's candidates, then the running ones by score */
    eng_beam_cand *fin;   /* (3W) the finished kept (n_fin, best first), then scratch */
    uint32_t n_fin;
    int32_t *fin_pool;  /* (3W, max_out) token arrays of finished beams */
    uint32_t *fin_free; /* (3W) free token arrays of fin_pool */
    uint32_t n_fin_free;
    uint32_t *kids;      /* (W) scratch: children of each slot in a round */
    uint32_t *slot_of;   /* (W) scratch: the slot of each new beam */
    pd_sched_seq **dead; /* (W) sequences of beams dropped last round: a step's items may
                            still point at them, so they are freed at the next round */
    uint32_t n_dead;
} eng_beam;

struct eng_req {
    char id[PD_ENGINE_MAX_REQUEST_ID + 1];
    pd_idmap_link link; /* in pd_engine.reqs, keyed by id */
    eng_req *inext;     /* inbox chain (aborts and imports) */
    eng_req *fnext;     /* list of requests to free after a step */
    bool in_inbox;
    bool free_mark;
    bool abort_requested;
    req_state state;
    pd_engine_phase phase;
    pd_arena *arena;       /* owns sp's arrays and strings */
    pd_sampling_params sp; /* has_seed always true (the engine draws a seed when absent) */
    size_t n_prompt;
    int32_t first_token;     /* imported requests */
    uint32_t n;              /* choices */
    uint32_t n_live;         /* sequences without a final event */
    pd_prompt_logprobs *plp; /* prompt logprobs being filled (malloc'd), NULL when not asked or
                                once the first event of choice 0 took them */
    eng_beam *beam;          /* use_beam_search: its state (n = best_of slots), else NULL */
    eng_seq seqs[];          /* (n) */
};

/* ---- output queue ---------------------------------------------------------------------------- */

typedef struct {
    pd_engine_event ev;
    char id[PD_ENGINE_MAX_REQUEST_ID + 1];
    int32_t token;
    int32_t *tokens; /* a beam's answer: its tokens (grows geometrically, tokens_cap bytes) */
    size_t tokens_cap;
    char *text; /* grows geometrically */
    size_t text_cap;
    char *stop_str; /* grows geometrically */
    size_t stop_cap;
    char err[256];
    int32_t *top_ids;                               /* (max_logprobs) */
    float *top_lp;                                  /* (max_logprobs) */
    float *beam_lp;                                 /* a beam's answer with logprobs: (n tokens) */
    int32_t *beam_top_ids;                          /* (n tokens, k) */
    float *beam_top_lp;                             /* (n tokens, k) */
    size_t beam_lp_cap, beam_ids_cap, beam_top_cap; /* their bytes */
    int32_t *blocks;                                /* (max_blocks_per_seq) */
    pd_prompt_logprobs *plp; /* owned: the event's prompt logprobs, freed when the slot is
                                taken again */
} ev_slot;

/* ---- tensor-parallel ranks ------------------------------------------------------------------- */

typedef struct pd_engine_rank pd_engine_rank;

struct pd_engine_rank {
    pd_engine *e;
    int r;         /* stage * tp + t */
    int stage, t;  /* its pipeline stage, and its tensor-parallel rank there */
    pd_backend *b; /* its stage's backend group's */
    pd_forward *f;
    pd_kv *kv;
    float *logits;           /* last stage: (max_num_seqs + prompt_logprob_rows, vocab) f32, host */
    float *x_out;            /* a stage before the last, t > 0: its residual stream, unused (the
                                hand-over is t 0's) */
    _Atomic int64_t busy_ns; /* t 0: time in its stage's forward passes (Stats' stage_seconds) */
    uint8_t *bounce; /* (2 * block_size * n_kv_heads * head_dim * elem): one block of one
                        layer, K then V, for copy-on-write */
    size_t bounce_bytes;
    pthread_t thread;
    bool thread_started;
    int rc;        /* status of the last job */
    char err[512]; /* its message (thread-local errors do not cross threads) */
};

struct pd_engine {
    pd_engine_params p;
    /* model */
    pd_model *own_model;
    const pd_model *model;
    pd_tok *own_tok;
    const pd_tok *tok;
    size_t vocab;
    size_t hidden;
    int32_t eos_ids[PD_MAX_EOS_IDS + 1]; /* every model EOS id: primary first */
    size_t n_eos;
    pd_stop_model stop_model;
    /* ranks */
    int tp, pp, n_ranks; /* tensor-parallel size, pipeline stages, tp * pp */
    int kv_dtype;        /* --kv-cache-dtype: -1 the activation dtype, else a pd_dtype */
    pd_backend_group *groups[PD_ENGINE_MAX_PP]; /* (pp) each stage's backends and all-reduce */
    pd_engine_rank *ranks;                      /* (n_ranks) */
    pd_engine_rank *out;                        /* the rank whose logits are read: the last
                                                   stage's tensor-parallel rank 0 */
    float *stage_x[PD_ENGINE_MAX_PP];     /* (pp - 1) hand-over of stage s to s + 1: micro-batch m
                                             at 2 * its first row * hidden, its rows of x then of
                                             t (2 x max_num_batched_tokens x hidden f32 in all) */
    uint64_t stage_gen[PD_ENGINE_MAX_PP]; /* = job_gen once stage s handed over in this step */
    int stage_mb[PD_ENGINE_MAX_PP];       /* micro-batches stage s has handed over then */
    int stage_rc[PD_ENGINE_MAX_PP];       /* and its status (a failure ends the step) */
    struct {
        pd_step st;         /* the step's sequences [seq0, seq0 + st.n_seqs) */
        size_t row0, out0;  /* its first token row and first logit row in the step */
    } mb[PD_ENGINE_MAX_PP]; /* the step's micro-batches (pp > 1) */
    int n_mb;
    int32_t *mb_ints; /* their rebased q_indptr, block_indptr and out_rows */
    pthread_mutex_t rmu;
    pthread_cond_t rcv;
    uint64_t job_gen; /* bumped to start a rank job */
    int jobs_done;
    bool ranks_quit;
    /* scheduling state (under mu) */
    pthread_mutex_t mu;
    pthread_cond_t work_cv; /* signalled on add/abort/release/import and stop */
    uint64_t work_gen;
    pd_kvpool *pool;
    pd_sched *sched;
    pd_idmap reqs; /* eng_req by id */
    eng_req *inbox_head, *inbox_tail;
    uint64_t n_requests; /* requests ever added (seed derivation) */
    size_t n_held;
    bool closing;
    pd_engine_stats stats;
    /* one step (engine thread) */
    size_t max_blocks_per_seq;
    int32_t *st_tokens;   /* (max_num_batched_tokens) */
    int32_t *st_qindptr;  /* (max_num_seqs + 1) */
    int32_t *st_kvlen;    /* (max_num_seqs) */
    int32_t *st_bindptr;  /* (max_num_seqs + 1) */
    int32_t *st_blocks;   /* (max_num_seqs * max_blocks_per_seq) */
    int32_t *st_outrows;  /* (max_num_seqs + prompt_logprob_rows) */
    int32_t *item_out;    /* (max_num_seqs) logits row of each item, -1 when none */
    int32_t *item_lp_out; /* (max_num_seqs) first logits row of an item's prompt-logprob rows */
    int32_t *spec_drafts; /* (max_num_seqs * spec_num_tokens) the drafts of each item */
    pd_step step;
    pd_sched_out so;
    pd_sampler_ws *ws;
    /* structured output: the vocabulary's bytes and the compiled grammars, made at the first
     * guided request (under gmu, on the caller's thread); gmask is the engine thread's */
    pthread_mutex_t gmu;
    pd_gvocab *gvocab;
    pd_gcache *gcache;
    size_t gmask_words; /* (max(vocab, gvocab size) + 31) / 32: an eng_seq.mask */
    /* the mask thread: started at the first step with a guided sequence; a job is the masks
     * of one step's guided sequences, run while the engine thread runs the forward pass */
    pthread_t mthread;
    bool mthread_on, m_quit;
    pthread_mutex_t mmu;
    pthread_cond_t mcv;
    uint64_t m_job, m_done;
    /* output queue */
    pthread_mutex_t qmu;
    pthread_cond_t qcv; /* signalled when the consumer frees a slot */
    ev_slot *slots;     /* (cap) */
    size_t cap, qhead, qcount;
    uint64_t n_pushed; /* events published so far */
    bool borrowed;     /* the consumer holds slots[qhead] */
    /* thread */
    pthread_t thread;
    bool running; /* the engine thread exists */
    atomic_bool stop_req;
    bool in_step; /* a step is executing (thread or synchronous) */
};

/* ---- shared between the files ------------------------------------------------------------- */

/* engine_request.c (callers hold mu) */
void eng_req_free(pd_engine *e, eng_req *r);
/* Frees a request once every sequence has ended and it holds nothing. */
void eng_req_maybe_free(pd_engine *e, eng_req *r);
/* Applies queued aborts and imports while the output queue has room (PD_EBUSY when it has
 * none). */
int eng_apply_inbox(pd_engine *e);

/* engine_events.c */
size_t eng_queue_free(pd_engine *e);
uint64_t eng_events_pushed(pd_engine *e);
/* Ends one sequence with status (PD_ECANCELLED or an error) and pushes its final event. Returns
 * false when the queue had no room (nothing done). Called under mu. */
bool eng_seq_end_status(pd_engine *e, eng_seq *s, int status, const char *msg);
/* Feeds one new token of s through the detokenizer and the stop checker and pushes its event
 * (res: the sampler's result for logprobs, or NULL). Finishes the sequence when the checker says
 * so (prefill-only sequences are held instead). Under mu; the caller checked the queue has room. */
int eng_seq_emit_token(pd_engine *e, eng_seq *s, int32_t token, const pd_sample_result *res);

/* engine.c: logits rows a step may ask for (sampling, prompt logprobs, drafts). */
size_t eng_max_out_rows(const pd_engine_params *p);

/* engine_spec.c (under mu): drafts for the schedule's decoding items (spec_num_tokens > 0), after
 * pd_sched_schedule and before the step is built. */
int eng_spec_propose(pd_engine *e);
/* Samples item i's rows one by one, accepting its drafts while the sampled token equals them;
 * emits every token sampled (under mu). */
int eng_spec_process(pd_engine *e, size_t i, const float *logits);

/* engine_step.c: samples one token for s from logits, advances its grammar, appends it and
 * emits it (under mu; the queue has room). */
int eng_sample_emit(pd_engine *e, eng_seq *s, const float *logits);

/* Pushes the final event of a beam search answer on s: every output token of finished beam f
 * at once, their text (decoded and stop-checked as a sampled sequence's would be), with
 * logprobs their logprobs, f's cumulative logprob and finish. Under mu; the caller checked the
 * queue has room. */
int eng_seq_emit_beam(pd_engine *e, eng_seq *s, const eng_beam_cand *f);

/* engine_beam.c (under mu) */
/* The beam state of a request being built (r->n = best_of slots), in r's arena. */
int eng_beam_create(pd_engine *e, eng_req *r, const int32_t *prompt);
/* Frees the sequences of dropped beams that are still kept (each round, and eng_req_free). */
void eng_beam_free(pd_engine *e, eng_req *r);
/* Everything the search owns outside the arena (eng_req_free). */
void eng_beam_destroy(pd_engine *e, eng_req *r);
/* Takes slot s's candidates from its logits row (the step computed its last token). */
int eng_beam_candidates(pd_engine *e, eng_seq *s, const float *logits);
/* Runs a round of r's search once every running beam has its candidates: ranks the
 * candidates, keeps the best finished ones, forks and drops beams, appends their tokens; when
 * the search stops, pushes the answer and ends every slot. No-op otherwise. */
int eng_beam_round(pd_engine *e, eng_req *r);

/* engine_ranks.c */
/* The backend group's parameters from e->p (and e's sizes, once known). */
pd_backend_group_params eng_group_params(const pd_engine *e, int stage);
/* The backend groups (one per stage, e->p's devices), then every rank's forward pass. */
int eng_ranks_create(pd_engine *e);
int eng_ranks_start(pd_engine *e);
/* Stops the rank threads and frees the ranks' pools, forward passes and the backend groups. */
void eng_ranks_free(pd_engine *e);
/* Runs the current step on every rank (rank 0 on the calling thread) and waits for all of them. */
int eng_ranks_run(pd_engine *e);
/* engine_step.c: stops the structured-output mask thread, if it runs (pd_engine_free). */
void eng_masks_stop(pd_engine *e);

#endif
