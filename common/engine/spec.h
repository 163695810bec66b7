/* Speculative decoding's proposer: n-gram prompt lookup (vLLM's `[ngram]` speculative model).
 *
 * Decode is memory-bound: a step that computes a few more rows of a sequence costs about what one
 * row costs, so rows holding guessed next tokens ("drafts") are verified nearly for free. The guess
 * here is the prompt-lookup one: text repeats (code edits, quotes, lists, a model in a loop), so
 * the tokens that followed the last occurrence of the sequence's current suffix are likely to
 * follow again.
 *
 * Verification lives in the engine (engine_spec.c): every row's logits are sampled in turn exactly
 * as without drafts (same sampler state, same per-output-index random stream), and a draft is
 * accepted while the sampled token equals it. The sampled tokens are then the ones plain decoding
 * would give, bit for bit, greedy or seeded; for a point-mass proposal this is the rejection
 * sampling of speculative decoding (accept x with probability p(x), else draw from p without x).
 */
#ifndef PD_ENGINE_SPEC_H
#define PD_ENGINE_SPEC_H

#include <stddef.h>
#include <stdint.h>

#include "engine/engine.h"

/* Looks for the longest n-gram, n from max_n down to min_n (>= 1), that ends tokens[0..n_tokens)
 * and also occurs earlier in it, taking its most recent earlier occurrence, and copies up to k of
 * the tokens that followed that occurrence into out (vLLM v1's n-gram proposer). Returns how many
 * (0: no match, or k 0). */
size_t pd_spec_ngram_propose(const int32_t *tokens, size_t n_tokens, size_t min_n, size_t max_n,
                             size_t k, int32_t *out);

/* The speculative-decoding flags as vLLM spells them (pd-decode, pd-generate). */
typedef struct {
    const char *model;       /* --speculative-model: "[ngram]" (or "ngram"); NULL: not given */
    int64_t num_tokens;      /* --num-speculative-tokens; -1: not given */
    int64_t ngram_max;       /* --ngram-prompt-lookup-max; -1: not given */
    int64_t ngram_min;       /* --ngram-prompt-lookup-min; -1: not given */
    const char *config_json; /* --speculative-config '{"method":"ngram",...}'; NULL: not given */
    int64_t disable_batch;   /* --speculative-disable-by-batch-size; -1: not given */
} pd_spec_flags;

/* The flags' defaults: nothing given. */
pd_spec_flags pd_spec_flags_default(void);

/* Resolves f into p's spec_* fields, with vLLM's rules and messages: --speculative-model and
 * --num-speculative-tokens go together ("Expected both speculative_model and
 * num_speculative_tokens to be provided, ..."), [ngram] needs --ngram-prompt-lookup-max (min
 * defaults to 1); --speculative-config takes method (or model) "ngram", num_speculative_tokens,
 * prompt_lookup_max / _min (one defaults to the other, both to 5) and disable_by_batch_size, and
 * excludes --speculative-model. Draft models, other methods and unknown keys are refused naming
 * the flag or key. */
int pd_spec_configure(const pd_spec_flags *f, pd_engine_params *p);

#endif
