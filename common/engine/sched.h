/* Batch scheduler: decides, per engine step, which sequences run and how many of their tokens.
 *
 * Design choice (vLLM v1's unified scheduler): a sequence is just its token ids (prompt, then
 * generated) and `num_computed`, the tokens whose K/V are already in the cache. A step gives each
 * scheduled sequence the next `n_new` of its uncomputed tokens, so a decode row (n_new = 1), a
 * whole prompt, or a chunk of a long prompt are the same thing and mix freely in one step, under
 * two budgets: max_num_seqs sequences and max_num_batched_tokens rows. Order is FCFS by arrival:
 * running sequences (oldest first) are served before waiting ones are admitted, and a waiting
 * sequence that does not fit stops admission (no overtaking). When the block pool runs out the
 * youngest running sequence is preempted by recompute: its blocks are freed, num_computed drops
 * to 0, it goes back to the waiting queue at its arrival position and later recomputes its
 * prompt and generated tokens as one (chunked) prefill. Sampling is keyed by the sequence's own
 * output count, never by the step, so none of this changes the tokens.
 *
 * The scheduler never runs the model. The engine calls pd_sched_schedule, runs the step described
 * by the returned items, then pd_sched_commit, then appends sampled tokens and finishes, holds or
 * forks sequences. Single-threaded: one engine thread owns a pd_sched.
 */
#ifndef PD_ENGINE_SCHED_H
#define PD_ENGINE_SCHED_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/kvpool.h"

typedef struct pd_sched pd_sched;
typedef struct pd_sched_seq pd_sched_seq;

typedef struct {
    size_t max_num_seqs;           /* sequences per step and running at once (256) */
    size_t max_num_batched_tokens; /* rows per step (2048); >= max_num_seqs, and >=
                                      max_model_len unless chunked_prefill */
    size_t max_model_len;          /* prompt + output tokens of one sequence (2048) */
    bool chunked_prefill;          /* vLLM's enable_chunked_prefill: max_num_batched_tokens may be
                                      below max_model_len, a longer prompt (or recompute) then
                                      always prefills over several steps (false). Either way a
                                      prompt that does not fit a step's remaining rows goes on in
                                      the next step */
    size_t max_prefill_chunk;      /* rows one sequence may take in a step while it is
                                      prefilling (vLLM's long_prefill_token_threshold);
                                      0 = no limit but the token budget */
    bool prefix_caching;           /* a sequence admitted without KV takes the cached blocks of
                                      its longest cached prefix of full blocks (at least its last
                                      token is computed), and computed full blocks are cached
                                      (the pool's prefix cache must be on): false */
    size_t max_prompt_logit_rows;  /* logits rows a step may ask for prompt logprobs (above one
                                      row per sequence for sampling): a sequence that wants them
                                      prefills at most this many such rows per step; 0 = none
                                      (pd_sched_seq_want_prompt_logits is refused) */
} pd_sched_params;

/* Defaults as documented on each field. */
pd_sched_params pd_sched_default_params(void);

/* PD_EINVAL with vLLM's wording when the budgets are inconsistent, e.g. without chunked_prefill
 * "max_num_batched_tokens (512) is smaller than max_model_len (2048). This effectively limits
 * the maximum sequence length to max_num_batched_tokens and makes vLLM reject longer sequences.
 * Please increase max_num_batched_tokens or decrease max_model_len." */
int pd_sched_check_params(const pd_sched_params *p);

typedef enum {
    PD_SEQ_NEW = 0,      /* created, not queued */
    PD_SEQ_WAITING = 1,  /* in the waiting queue (new, or preempted) */
    PD_SEQ_RUNNING = 2,  /* in the running queue, holding blocks */
    PD_SEQ_HELD = 3,     /* out of both queues, blocks kept (prefill-only hand-over, or a
                            reservation waiting for its KV import) */
    PD_SEQ_FINISHED = 4, /* out of both queues, blocks freed */
} pd_seq_state;

/* One scheduled sequence of a step. Its rows are tokens [start, start + n_new) of the
 * sequence, at those positions; the step writes their K/V into the slots of its block table. */
typedef struct {
    pd_sched_seq *seq;
    size_t start;          /* num_computed before the step = position of the first row */
    size_t n_new;          /* rows this step (>= 1) */
    bool sample;           /* start + n_new == number of tokens: the last row's logits give the next
                              token */
    size_t lp_start, lp_n; /* rows at positions [lp_start, lp_start + lp_n) want their logits for
                              the prompt logprobs of the tokens after them (lp_n 0: none) */
    size_t n_draft;        /* speculative decoding: the last n_draft rows are draft tokens
                              (pd_sched_add_drafts); the last n_draft + 1 rows' logits are
                              wanted: row d's verifies draft d and gives the token after */
} pd_sched_item;

typedef struct {
    size_t n_items;
    const pd_sched_item *items; /* (n_items) oldest first; valid until the next schedule */
    size_t n_tokens;            /* sum of n_new */
    size_t n_copies;
    const pd_kv_block_copy *copies; /* (n_copies) copy-on-write orders to run before the step */
    size_t n_preempted;             /* sequences preempted while building this step */
} pd_sched_out;

/* A scheduler over pool (borrowed; it must outlive the scheduler). Arrays sized here. */
int pd_sched_create(const pd_sched_params *p, pd_kvpool *pool, pd_sched **out);
/* Frees every sequence still known to it (and their blocks), then itself. NULL is a no-op. */
void pd_sched_free(pd_sched *s);

/* ---- sequences -------------------------------------------------------------------------- */

/* A new sequence (state NEW) whose tokens are prompt[0..n_prompt), with room for max_model_len
 * tokens (allocated once, here). user is the engine's per-sequence pointer. PD_EINVAL when
 * n_prompt is 0 or >= max_model_len (vLLM's "This model's maximum context length is ..."). */
int pd_sched_seq_create(pd_sched *s, const int32_t *prompt, size_t n_prompt, void *user,
                        pd_sched_seq **out);

/* Asks for the logits of every prompt position but the last (prompt logprobs) of a NEW
 * sequence: its items name those rows (lp_start, lp_n) once each, even when a preemption makes
 * it compute them again, at most max_prompt_logit_rows of them per step; it takes nothing from
 * the prefix cache until they are computed (cached K/V would skip their rows). PD_EINVAL when
 * max_prompt_logit_rows is 0 or the sequence is queued. */
int pd_sched_seq_want_prompt_logits(pd_sched *s, pd_sched_seq *seq);

/* Queues a NEW sequence at the tail of the waiting queue. n_children: sequences that
 * pd_sched_fork will add after its prefill (n - 1 for a request of n choices); they are counted
 * against max_num_seqs at admission. */
int pd_sched_add(pd_sched *s, pd_sched_seq *seq, size_t n_children);

/* Reserves blocks for a NEW sequence's first n_tokens slots and moves it to HELD (the decode side
 * of PD: a transfer writes the prompt's K/V into them). With use_cache (the sequence was created
 * with its real prompt ids) and prefix caching on, the reservation starts with the cached blocks
 * of the prompt's longest cached prefix, short of its last token, as at admission; *n_cached
 * (may be NULL) receives their tokens, whose K/V need no transfer. PD_EBUSY when the pool lacks
 * the blocks (nothing reserved). */
int pd_sched_reserve(pd_sched *s, pd_sched_seq *seq, size_t n_tokens, bool use_cache,
                     size_t *n_cached);

/* Replaces the prompt ids of a NEW or HELD sequence that has no output yet by n_prompt ids
 * (the same count): a reservation is created before the prompt ids arrive. PD_EINVAL when the
 * reservation holds cached blocks and the new ids differ in their tokens. */
int pd_sched_seq_set_prompt(const pd_sched *s, pd_sched_seq *seq, const int32_t *prompt,
                            size_t n_prompt);

/* Admits a HELD sequence whose first n_computed tokens have their K/V in its blocks (an import
 * finished): queued, computing from token n_computed on, with n_children forks to come
 * reserved against max_num_seqs (a beam search's, as pd_sched_add's). */
int pd_sched_admit_computed(pd_sched *s, pd_sched_seq *seq, size_t n_computed, size_t n_children);

/* Appends a token (sampled, or the first token of an imported sequence). PD_ERANGE at
 * max_model_len. */
int pd_sched_append(pd_sched *s, pd_sched_seq *seq, int32_t token);

/* ---- speculative decoding ---------------------------------------------------------------- */

/* Adds k draft tokens to item `item` of the schedule out (from the last pd_sched_schedule): a
 * sequence decoding one row whose logits are wanted. Its slots grow by k (no preemption: PD_EBUSY,
 * nothing changed, when the pool lacks the blocks or the step's budget the rows), and the item
 * computes the drafts after its token, out->n_tokens growing by k. After pd_sched_commit the
 * sequence counts the item's first row computed and holds none of the drafts: the engine appends
 * the sampled tokens, calls pd_sched_accept_draft for each draft it accepts (its K/V, written by
 * the step, become the sequence's) and then pd_sched_drafts_done. */
int pd_sched_add_drafts(pd_sched *s, pd_sched_out *out, size_t item, const int32_t *drafts,
                        size_t k);

/* The next draft of seq's last step was accepted: its token was appended (the same id), and its
 * K/V count as computed. */
void pd_sched_accept_draft(pd_sched *s, pd_sched_seq *seq);

/* Drops the slots of seq's rejected drafts (blocks freed at once). */
void pd_sched_drafts_done(pd_sched *s, pd_sched_seq *seq);

/* A new RUNNING sequence sharing parent's tokens, computed count and blocks (copy-on-write),
 * placed right after it in arrival order. parent must be RUNNING with nothing uncomputed but
 * its last token. */
int pd_sched_fork(pd_sched *s, pd_sched_seq *parent, void *user, pd_sched_seq **out);

/* Beam search keeps the children reserved at add while its beams fork and drop: moves n of
 * from's reserved children to to (both RUNNING), or ends seq (RUNNING; as pd_sched_finish) and
 * gives its place and its reserved children to heir (RUNNING) as reserved children. */
int pd_sched_pass_children(pd_sched *s, pd_sched_seq *from, pd_sched_seq *to, size_t n);
int pd_sched_finish_into(pd_sched *s, pd_sched_seq *seq, pd_sched_seq *heir);

/* RUNNING -> HELD (blocks kept, no longer scheduled): a prefill-only sequence after its first
 * token. */
int pd_sched_hold(pd_sched *s, pd_sched_seq *seq);

/* Ends a sequence in any state: leaves its queue, drops each of its block references exactly
 * once, state FINISHED. Finishing a FINISHED sequence is a no-op. Does not free seq. */
void pd_sched_finish(pd_sched *s, pd_sched_seq *seq);

/* Finishes (if needed) and frees seq. */
void pd_sched_seq_free(pd_sched *s, pd_sched_seq *seq);

/* ---- one step --------------------------------------------------------------------------- */

/* Builds the next step (see the file comment). An empty step (n_items 0) means nothing can run.
 * The step's block tables are grown here; run the copies, then the step, then commit. */
int pd_sched_schedule(pd_sched *s, pd_sched_out *out);
/* Marks the last schedule's rows as computed (num_computed += n_new). */
void pd_sched_commit(pd_sched *s);

/* ---- queries ----------------------------------------------------------------------------- */

size_t pd_sched_num_waiting(const pd_sched *s);
size_t pd_sched_num_running(const pd_sched *s);
uint64_t pd_sched_num_preemptions(const pd_sched *s);
/* Prompt tokens of the waiting and running sequences not computed yet (the prefill work queued;
 * a waiting sequence's cached prefix counts until it is admitted). */
size_t pd_sched_num_queued_tokens(const pd_sched *s);
/* Prefix caching, cumulative: tokens of the sequences admitted without KV (queries) and of
 * those tokens, the ones found in the cache (hits). */
void pd_sched_prefix_cache_stats(const pd_sched *s, uint64_t *queries, uint64_t *hits);
const pd_sched_params *pd_sched_get_params(const pd_sched *s);

pd_seq_state pd_seq_get_state(const pd_sched_seq *seq);
void *pd_seq_user(const pd_sched_seq *seq);
/* Hands seq to another owner (an imported request takes over its reservation's sequence). */
void pd_seq_set_user(pd_sched_seq *seq, void *user);
/* All tokens (prompt then generated): *n receives the count. Valid until the next append. */
const int32_t *pd_seq_tokens(const pd_sched_seq *seq, size_t *n);
size_t pd_seq_num_prompt(const pd_sched_seq *seq);
size_t pd_seq_num_output(const pd_sched_seq *seq);
size_t pd_seq_num_computed(const pd_sched_seq *seq);
/* Prompt tokens whose KV the prefix cache held when the sequence was first admitted. */
size_t pd_seq_num_cached(const pd_sched_seq *seq);
/* Children still reserved for it (pd_sched_add's n_children not forked yet, or passed). */
size_t pd_seq_num_reserved(const pd_sched_seq *seq);
/* Times this sequence was preempted. */
uint32_t pd_seq_num_preemptions(const pd_sched_seq *seq);
/* The sequence's block table (never NULL). */
const pd_kvtable *pd_seq_table(const pd_sched_seq *seq);

#endif
